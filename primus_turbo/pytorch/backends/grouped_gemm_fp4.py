"""MXFP4 grouped GEMM backends (MoE experts): TRITON (E2M1 decoded in-kernel onto bf16 tensor cores).

Two problems, each with a dispatcher in the ``grouped_gemm`` family at precision FP4 (so
``GlobalBackendManager.set_grouped_gemm_backend(..., precision="FP4")`` /
``PRIMUS_TURBO_GROUPED_GEMM_BACKEND=FP4:TRITON`` pin them):

* M-grouped (forward, dgrad): ``out[rows of g] = deq(a_q, a_scale)[rows of g] @ deq(b_q[g], b_scale[g]).T``
  with packed ``a_q [M_total, K/2]``, ``b_q [G, N, K/2]``, E8M0 scales ``[M_total, K/32]`` /
  ``[G, N, K/32]``. Keyword arguments: ``a_q, a_scale, b_q, b_scale, group_lens, group_offs,
  out_dtype, num_cu=None``.
* variable-K (wgrad): ``out[g] (+)= deq(x_t)[:, rows of g] @ deq(y_t)[:, rows of g].T`` with
  ``x_t [P, M/2]``, ``y_t [Q, M/2]`` packed along the tokens and every group offset a multiple of
  32. Keyword arguments: ``x_t, x_scale, y_t, y_scale, group_lens, group_offs, out=None,
  accumulate=False, out_dtype, num_cu=None``.

Hopper has no FP4 tensor cores and torch has no MXFP4 grouped GEMM for sm_90, so TRITON is the
only backend. Keys read shapes, dtypes and devices only (no host sync).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core.backend import AutoKernelDispatcher, BackendType, KernelBackend, scratch_out_tune_kwargs

__all__ = [
    "GroupedGemmFP4TritonBackend",
    "GroupedGemmFP4VariableKTritonBackend",
    "grouped_gemm_fp4_dispatcher",
    "grouped_gemm_fp4_variable_k_dispatcher",
]


class GroupedGemmFP4TritonBackend(KernelBackend):
    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, a_q, a_scale, b_q, b_scale, group_lens, group_offs, out_dtype, num_cu=None, **_) -> Optional[str]:
        try:
            from primus_turbo.triton.grouped_gemm.grouped_gemm_fp4_kernel import check_grouped_gemm_fp4_triton
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_grouped_gemm_fp4_triton(a_q, a_scale, b_q, b_scale, group_lens, group_offs, out_dtype=out_dtype)

    @classmethod
    def execute(cls, a_q, a_scale, b_q, b_scale, group_lens, group_offs, out_dtype, num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_fp4_kernel import grouped_gemm_fp4_triton

        return grouped_gemm_fp4_triton(a_q, a_scale, b_q, b_scale, group_lens, group_offs, out_dtype=out_dtype,
                                       num_cu=num_cu, checked=True)


def _make_key(a_q, a_scale, b_q, b_scale, group_lens, group_offs, out_dtype, num_cu=None, **_):
    return (a_q.size(0), b_q.size(1), a_q.size(1), b_q.size(0), out_dtype, num_cu, a_q.device.type)


grouped_gemm_fp4_dispatcher = AutoKernelDispatcher(
    op_name="grouped_gemm_fp4",
    family="grouped_gemm",
    backends=[GroupedGemmFP4TritonBackend],
    make_key=_make_key,
    default=lambda **kw: BackendType.TRITON,
)


class GroupedGemmFP4VariableKTritonBackend(KernelBackend):
    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, x_t, x_scale, y_t, y_scale, group_lens, group_offs, out=None, accumulate=False,
              out_dtype=torch.bfloat16, num_cu=None, **_) -> Optional[str]:
        try:
            from primus_turbo.triton.grouped_gemm.grouped_gemm_fp4_kernel import (
                check_grouped_gemm_fp4_variable_k_triton,
            )
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_grouped_gemm_fp4_variable_k_triton(x_t, x_scale, y_t, y_scale, group_lens, group_offs, out=out,
                                                        accumulate=accumulate, out_dtype=out_dtype)

    @classmethod
    def execute(cls, x_t, x_scale, y_t, y_scale, group_lens, group_offs, out=None, accumulate=False,
                out_dtype=torch.bfloat16, num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_fp4_kernel import grouped_gemm_fp4_variable_k_triton

        return grouped_gemm_fp4_variable_k_triton(x_t, x_scale, y_t, y_scale, group_lens, group_offs, out=out,
                                                  accumulate=accumulate, out_dtype=out_dtype, num_cu=num_cu,
                                                  checked=True)


def _make_key_vk(x_t, x_scale, y_t, y_scale, group_lens, group_offs, out=None, accumulate=False,
                 out_dtype=torch.bfloat16, num_cu=None, **_):
    return (x_t.size(1), x_t.size(0), y_t.size(0), group_offs.numel() - 1, None if out is None else out.dtype,
            out_dtype, bool(accumulate), num_cu, x_t.device.type)


grouped_gemm_fp4_variable_k_dispatcher = AutoKernelDispatcher(
    op_name="grouped_gemm_fp4_variable_k",
    family="grouped_gemm",
    backends=[GroupedGemmFP4VariableKTritonBackend],
    make_key=_make_key_vk,
    default=lambda **kw: BackendType.TRITON,
    make_tune_kwargs=scratch_out_tune_kwargs,
)
