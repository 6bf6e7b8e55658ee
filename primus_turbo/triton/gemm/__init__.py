"""Dense GEMM Triton kernels: ``gemm_triton`` (C = A @ B, optional ``out +=``) and its eligibility check."""

from __future__ import annotations

from primus_turbo.triton import triton_available

__all__ = ["check_gemm_triton", "gemm_triton"]

if triton_available():
    from .gemm_kernel import GemmConfig, check_gemm_triton, gemm_triton  # noqa: F401

    __all__ += ["GemmConfig"]
else:  # keep the check usable (it must never raise) when triton is not installed

    def check_gemm_triton(a, b, out=None, accumulate=False):  # noqa: ARG001
        return "triton is not installed"

    def gemm_triton(a, b, out=None, out_dtype=None, accumulate=False, **kwargs):  # noqa: ARG001
        raise RuntimeError("gemm_triton: triton is not installed")
