"""FlashAttention-2 style Triton kernels: forward (O, LSE) and a deterministic backward (dQ, dK, dV, dsink)."""

from __future__ import annotations

from primus_turbo.triton import triton_available

__all__ = [
    "check_flash_attn_triton", "flash_attn_fwd_triton", "flash_attn_bwd_triton",
    "flash_attn_varlen_fwd_triton", "flash_attn_varlen_bwd_triton",
]

if triton_available():
    from .flash_attn_bwd import flash_attn_bwd_triton, flash_attn_varlen_bwd_triton  # noqa: F401
    from .flash_attn_fwd import check_flash_attn_triton, flash_attn_fwd_triton, flash_attn_varlen_fwd_triton  # noqa: F401
else:  # keep the check usable (it must never raise) when triton is not installed

    def check_flash_attn_triton(q, k, v, sink=None):  # noqa: ARG001
        return "triton is not installed"

    def flash_attn_fwd_triton(*args, **kwargs):  # noqa: ARG001
        raise RuntimeError("flash_attn_fwd_triton: triton is not installed")

    def flash_attn_bwd_triton(*args, **kwargs):  # noqa: ARG001
        raise RuntimeError("flash_attn_bwd_triton: triton is not installed")

    def flash_attn_varlen_fwd_triton(*args, **kwargs):  # noqa: ARG001
        raise RuntimeError("flash_attn_varlen_fwd_triton: triton is not installed")

    def flash_attn_varlen_bwd_triton(*args, **kwargs):  # noqa: ARG001
        raise RuntimeError("flash_attn_varlen_bwd_triton: triton is not installed")
