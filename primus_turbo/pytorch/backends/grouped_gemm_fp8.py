"""FP8 grouped GEMM backends (MoE experts): TRITON.

Two problems, each with a dispatcher in the ``grouped_gemm`` family at precision FP8 (so
``GlobalBackendManager.set_grouped_gemm_backend(..., precision="FP8")`` /
``PRIMUS_TURBO_GROUPED_GEMM_BACKEND=FP8:TRITON`` pin them):

* M-grouped (forward, dgrad): ``out[rows of g] = (a_q * a_scale)[rows of g] @ (b_q[g] * b_scale[g]).T``
  with K-major ``a_q [M_total, K]``, ``b_q [G, N, K]`` and the rows past ``offs[G]`` zeroed.
  Keyword arguments: ``a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype,
  block_size=128, num_cu=None``.
* variable-K (wgrad): ``out[g] (+)= (x_t * x_scale)[:, rows of g] @ ((y_t * y_scale)[:, rows of g]).T``
  (TENSORWISE / ROWWISE). Keyword arguments: ``x_t, x_scale, y_t, y_scale, mode, group_lens,
  group_offs, out=None, accumulate=False, out_dtype, num_cu=None``.

A TORCH backend (``torch._scaled_grouped_mm``) is not wired yet. Keys read shapes, dtypes and
devices only: never a device value (no host sync).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core.backend import AutoKernelDispatcher, BackendType, KernelBackend

__all__ = [
    "GroupedGemmFP8TritonBackend",
    "GroupedGemmFP8VariableKTritonBackend",
    "grouped_gemm_fp8_dispatcher",
    "grouped_gemm_fp8_variable_k_dispatcher",
]


def _mode_name(mode) -> str:
    return str(getattr(mode, "name", mode)).upper()


class GroupedGemmFP8TritonBackend(KernelBackend):
    """Persistent Triton kernel with a device-side tile schedule (grouped_gemm_fp8_kernel.py)."""

    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128,
              num_cu=None, **_) -> Optional[str]:
        try:
            from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import check_grouped_gemm_fp8_triton
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_grouped_gemm_fp8_triton(a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs,
                                             out_dtype=out_dtype, block_size=block_size)

    @classmethod
    def execute(cls, a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128,
                num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_triton

        return grouped_gemm_fp8_triton(a_q, a_scale, b_q, b_scale, _mode_name(mode), group_lens, group_offs,
                                       out_dtype=out_dtype, block_size=block_size, num_cu=num_cu, checked=True)


def _make_key(a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128, num_cu=None,
              **_):
    return (a_q.size(0), b_q.size(1), a_q.size(1), b_q.size(0), a_q.dtype, b_q.dtype, out_dtype, _mode_name(mode),
            block_size, num_cu, a_q.device.type)


grouped_gemm_fp8_dispatcher = AutoKernelDispatcher(
    op_name="grouped_gemm_fp8",
    family="grouped_gemm",
    backends=[GroupedGemmFP8TritonBackend],
    make_key=_make_key,
    default=lambda **kw: BackendType.TRITON,
)


class GroupedGemmFP8VariableKTritonBackend(KernelBackend):
    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
              out_dtype=torch.bfloat16, num_cu=None, **_) -> Optional[str]:
        try:
            from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import (
                check_grouped_gemm_fp8_variable_k_triton,
            )
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_grouped_gemm_fp8_variable_k_triton(x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs,
                                                        out=out, accumulate=accumulate, out_dtype=out_dtype)

    @classmethod
    def execute(cls, x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
                out_dtype=torch.bfloat16, num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_variable_k_triton

        return grouped_gemm_fp8_variable_k_triton(
            x_t, x_scale, y_t, y_scale, _mode_name(mode), group_lens, group_offs, out=out, accumulate=accumulate,
            out_dtype=out_dtype, num_cu=num_cu, checked=True)


def _make_key_vk(x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
                 out_dtype=torch.bfloat16, num_cu=None, **_):
    return (x_t.size(1), x_t.size(0), y_t.size(0), group_offs.numel() - 1, x_t.dtype, y_t.dtype,
            None if out is None else out.dtype, out_dtype, _mode_name(mode), bool(accumulate), num_cu,
            x_t.device.type)


def _tune_kwargs_vk(out=None, **kw):
    # autotune never writes into the caller's accumulation buffer (main_grad)
    return dict(kw, out=None if out is None else torch.zeros_like(out))


grouped_gemm_fp8_variable_k_dispatcher = AutoKernelDispatcher(
    op_name="grouped_gemm_fp8_variable_k",
    family="grouped_gemm",
    backends=[GroupedGemmFP8VariableKTritonBackend],
    make_key=_make_key_vk,
    default=lambda **kw: BackendType.TRITON,
    make_tune_kwargs=_tune_kwargs_vk,
)
