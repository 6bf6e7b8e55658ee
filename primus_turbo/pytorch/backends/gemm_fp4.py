"""MXFP4 GEMM backends: TRITON (in-kernel E2M1 decode onto bf16 tensor cores; Hopper has no FP4 MMA).

Every backend computes the canonical problem of docs/low_precision.md on pre-quantized K-major
MXFP4 operands: ``C[M, N] = deq(a_q[M, K/2], a_scale[M, K/32]) @ deq(b_q[N, K/2], b_scale[N, K/32])^T``,
or ``out += C`` when accumulating. Keyword arguments of ``check``/``execute``: ``a_q, a_scale,
b_q, b_scale, out=None, out_dtype=None, accumulate=False``. Dispatcher family ``"gemm"``,
precision ``FP4`` (``PRIMUS_TURBO_GEMM_BACKEND=FP4:TRITON``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core.backend import AutoKernelDispatcher, BackendType, KernelBackend, scratch_out_tune_kwargs

__all__ = ["GemmFP4TritonBackend", "gemm_fp4_dispatcher"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GemmFP4TritonBackend(KernelBackend):
    """Our persistent Triton MXFP4 kernel (exact emulation), with fused accumulation."""

    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, a_q=None, a_scale=None, b_q=None, b_scale=None, out=None, out_dtype=None,
              accumulate=False, **_) -> Optional[str]:
        if out_dtype is not None and out_dtype not in _OUT_DTYPES:
            return f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}"
        try:
            from primus_turbo.triton.gemm.gemm_fp4_kernel import check_gemm_fp4_triton
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_gemm_fp4_triton(a_q, a_scale, b_q, b_scale, out=out,
                                     out_dtype=None if out is not None else out_dtype, accumulate=accumulate)

    @classmethod
    def execute(cls, a_q=None, a_scale=None, b_q=None, b_scale=None, out=None, out_dtype=None,
                accumulate=False, **_) -> torch.Tensor:
        from primus_turbo.triton.gemm.gemm_fp4_kernel import gemm_fp4_triton_prechecked

        return gemm_fp4_triton_prechecked(a_q, a_scale, b_q, b_scale, out=out,
                                          out_dtype=out_dtype or torch.bfloat16, accumulate=accumulate)


def _make_key(a_q=None, a_scale=None, b_q=None, b_scale=None, out=None, out_dtype=None, accumulate=False, **_):
    return (a_q.size(0), b_q.size(0), a_q.size(1), out_dtype if out is None else out.dtype, bool(accumulate),
            a_q.device.type)


def _default(**_) -> BackendType:
    return BackendType.TRITON


gemm_fp4_dispatcher = AutoKernelDispatcher(
    op_name="gemm_fp4",
    family="gemm",
    backends=[GemmFP4TritonBackend],
    make_key=_make_key,
    default=_default,
    make_tune_kwargs=scratch_out_tune_kwargs,
)
