"""Dense GEMM backends: TORCH (cuBLAS through PyTorch; also what runs on CPU) and TRITON.

Every backend computes the canonical, layout-free problem ``C = A @ B`` (or ``C += A @ B`` when
accumulating) on *logical* operands: ``a`` is ``[M, K]`` and ``b`` is ``[K, N]`` with any strides.
The op layer turns ``trans_a``/``trans_b`` into transposed views, so a layout is just a stride
pattern here and no backend copies an operand to change its layout.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core.backend import (
    AutoKernelDispatcher, BackendType, KernelBackend, PrecisionType, scratch_out_tune_kwargs,
)

__all__ = [
    "GemmTorchBackend", "GemmTritonBackend", "gemm_dispatcher", "GEMM_DTYPES", "all_gemms_on_torch", "torch_autograd_mm",
]

GEMM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _layout(t: torch.Tensor) -> str:
    """'R' row-major, 'C' column-major (a transposed view), 'S' any other strides."""
    if t.stride(1) == 1 or t.size(1) <= 1:
        return "R"
    if t.stride(0) == 1 or t.size(0) <= 1:
        return "C"
    return "S"


def _common_check(a, b, out, out_dtype, accumulate) -> Optional[str]:
    if a.dim() != 2 or b.dim() != 2:
        return f"2-D operands expected, got a.dim()={a.dim()}, b.dim()={b.dim()}"
    if a.dtype not in GEMM_DTYPES or a.dtype != b.dtype:
        return f"dtypes must match and be one of fp32/fp16/bf16, got a={a.dtype}, b={b.dtype}"
    if a.device != b.device:
        return f"operands on different devices: a on {a.device}, b on {b.device}"
    if a.size(1) != b.size(0):
        return f"K mismatch: a is {tuple(a.shape)}, b is {tuple(b.shape)}"
    if accumulate:
        if out is None:
            return "accumulate=True needs out"
        if out.dtype not in (torch.float32, a.dtype):
            return f"accumulation buffer must be fp32 or {a.dtype}, got {out.dtype}"
    return None


class GemmTorchBackend(KernelBackend):
    """cuBLAS(Lt) through torch.mm/addmm (any strides; cuBLAS picks its own transposes)."""

    backend_type = BackendType.TORCH

    @classmethod
    def check(cls, a, b, out=None, out_dtype=None, accumulate=False, **_) -> Optional[str]:
        return _common_check(a, b, out, out_dtype, accumulate)

    @classmethod
    def execute(cls, a, b, out=None, out_dtype=None, accumulate=False, **_) -> torch.Tensor:
        if accumulate:
            if out.dtype == a.dtype:
                out.addmm_(a, b)  # cuBLAS beta=1: the accumulation happens in the GEMM epilogue
            elif a.is_cuda:
                # bf16/fp16 operands, fp32 accumulator: cuBLAS with fp32 C/D, still beta=1.
                torch.ops.aten.addmm.dtype_out(out, a, b, out.dtype, out=out)
            else:
                out.add_(torch.mm(a.to(out.dtype), b.to(out.dtype)))
            return out
        out_dtype = out_dtype or a.dtype
        if out_dtype == a.dtype:
            res = torch.mm(a, b)
        elif a.is_cuda and a.dtype != torch.float32 and out_dtype == torch.float32:
            res = torch.mm(a, b, out_dtype=torch.float32)  # fp32 output straight from the epilogue
        elif a.dtype == torch.float32 or out_dtype == torch.float32:
            res = torch.mm(a.float(), b.float()).to(out_dtype)
        else:
            res = torch.mm(a, b).to(out_dtype)
        if out is not None:
            out.copy_(res)
            return out
        return res


class GemmTritonBackend(KernelBackend):
    """Our persistent tensor-descriptor (TMA) Triton kernel (primus_turbo/triton/gemm)."""

    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, a, b, out=None, out_dtype=None, accumulate=False, **_) -> Optional[str]:
        reason = _common_check(a, b, out, out_dtype, accumulate)
        if reason is not None:
            return reason
        try:
            from primus_turbo.triton.gemm.gemm_kernel import check_gemm_triton
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_gemm_triton(a, b, out=out, accumulate=accumulate)

    @classmethod
    def execute(cls, a, b, out=None, out_dtype=None, accumulate=False, **_) -> torch.Tensor:
        from primus_turbo.triton.gemm.gemm_kernel import gemm_triton_prechecked

        # resolve() ran check() on these very arguments just before
        return gemm_triton_prechecked(a, b, out=out, out_dtype=out_dtype, accumulate=accumulate)


def _make_key(a, b, out=None, out_dtype=None, accumulate=False, **_):
    return (
        a.size(0), b.size(1), a.size(1), a.dtype, out_dtype if out is None else out.dtype,
        _layout(a), _layout(b), bool(accumulate), a.device.type,
    )


def _default(a, b, out=None, out_dtype=None, accumulate=False, **_) -> BackendType:
    # cuBLAS is the default: on the H200 it is at least as fast as our Triton kernel on the
    # registry shapes (benchmarks/results/h200/gemm_bf16.md); TRITON is one pin or autotune away.
    # all_gemms_on_torch relies on this rule being TORCH for every shape (it checks the forward
    # operands only); make it cover the dgrad/wgrad shapes if the rule ever varies.
    return BackendType.TORCH


gemm_dispatcher = AutoKernelDispatcher(
    op_name="gemm",
    family="gemm",
    backends=[GemmTorchBackend, GemmTritonBackend],
    make_key=_make_key,
    default=_default,
    make_tune_kwargs=scratch_out_tune_kwargs,
)


def all_gemms_on_torch(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the current settings send every GEMM of a training step on these operands
    (output, grad_input, grad_weight) to TORCH: no autotune, and TORCH pinned or the default
    (the default rule, ``_default``, is TORCH for every shape)."""
    backend, _, tune = gemm_dispatcher.plan(PrecisionType.BF16_FP16_FP32)
    if tune or backend not in (None, BackendType.TORCH):
        return False
    return backend is BackendType.TORCH or gemm_dispatcher.default(a=a, b=b) is BackendType.TORCH


def torch_autograd_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The TORCH backend for a whole training step: ``torch.mm`` under PyTorch's own autograd, so
    cuBLAS runs all three GEMMs with no Python in the backward (used when
    :func:`all_gemms_on_torch` holds and nothing of ours, such as main_grad fusion, is needed)."""
    return torch.mm(a, b)
