"""Activation Triton kernels: SwiGLU / GeGLU (tanh) with optional MoE probs and row mask."""

from __future__ import annotations

from primus_turbo.triton import triton_available

__all__: list[str] = []

if triton_available():
    from .swiglu_kernel import ACT_GELU_TANH, ACT_SILU, glu_bwd_config, glu_bwd_launch, glu_config, glu_fwd_launch  # noqa: F401

    __all__ += ["ACT_SILU", "ACT_GELU_TANH", "glu_config", "glu_bwd_config", "glu_fwd_launch", "glu_bwd_launch"]
