"""Names of the ``PRIMUS_TURBO_*`` environment variables that frameworks set, at the import path
Primus-Turbo users already have (``from primus_turbo.common.constants import ENV_GEMM_BACKEND``:
Primus's Megatron-LM layers write the backend choice into these before the first GEMM).

Only the names live here, as plain strings, so importing this module does not import torch; their
defaults, meanings and readers are in :mod:`primus_turbo.pytorch.core.env` (``ENV_VARS``) and
docs/env_vars.md. Every name below is a key of ``ENV_VARS`` (tests/pytorch/core/test_env.py).
"""

ENV_LOG_LEVEL = "PRIMUS_TURBO_LOG_LEVEL"
ENV_GEMM_BACKEND = "PRIMUS_TURBO_GEMM_BACKEND"
ENV_GROUPED_GEMM_BACKEND = "PRIMUS_TURBO_GROUPED_GEMM_BACKEND"
ENV_ATTN_BACKEND = "PRIMUS_TURBO_ATTN_BACKEND"
ENV_AUTO_TUNE = "PRIMUS_TURBO_AUTO_TUNE"

__all__ = ["ENV_LOG_LEVEL", "ENV_GEMM_BACKEND", "ENV_GROUPED_GEMM_BACKEND", "ENV_ATTN_BACKEND", "ENV_AUTO_TUNE"]
