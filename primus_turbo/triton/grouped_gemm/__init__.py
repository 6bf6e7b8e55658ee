"""Grouped GEMM Triton kernels (MoE experts): M-grouped (forward/dgrad) and variable-K (wgrad)."""

from __future__ import annotations

from primus_turbo.triton import triton_available

__all__ = [
    "check_grouped_gemm_triton",
    "check_grouped_gemm_variable_k_triton",
    "grouped_gemm_triton",
    "grouped_gemm_variable_k_triton",
]

if triton_available():
    from .grouped_gemm_kernel import (  # noqa: F401
        GroupedGemmConfig,
        check_grouped_gemm_triton,
        check_grouped_gemm_variable_k_triton,
        grouped_gemm_triton,
        grouped_gemm_variable_k_triton,
    )

    __all__ += ["GroupedGemmConfig"]
else:

    def check_grouped_gemm_triton(*args, **kwargs):  # noqa: ARG001
        return "triton is not installed"

    def check_grouped_gemm_variable_k_triton(*args, **kwargs):  # noqa: ARG001
        return "triton is not installed"

    def grouped_gemm_triton(*args, **kwargs):  # noqa: ARG001
        raise RuntimeError("grouped_gemm_triton: triton is not installed")

    def grouped_gemm_variable_k_triton(*args, **kwargs):  # noqa: ARG001
        raise RuntimeError("grouped_gemm_variable_k_triton: triton is not installed")
