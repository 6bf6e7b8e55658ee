"""Normalization Triton kernels: RMSNorm forward/backward, optionally with the residual add fused."""

from __future__ import annotations

from primus_turbo.triton import triton_available

__all__: list[str] = []

if triton_available():
    from .rmsnorm_kernel import MAX_ROW_BLOCK, rmsnorm_bwd_launch, rmsnorm_config, rmsnorm_fwd_launch  # noqa: F401

    __all__ += ["MAX_ROW_BLOCK", "rmsnorm_config", "rmsnorm_fwd_launch", "rmsnorm_bwd_launch"]
