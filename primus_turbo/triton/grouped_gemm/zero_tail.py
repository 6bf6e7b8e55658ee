"""Zero the rows of a grouped-GEMM output past the routed rows, without a host sync.

``out[offs[G]:] = 0`` where ``offs[G]`` lives on the device. One program per block of rows reads
``offs[G]`` and returns at once unless its rows reach past it, so the cost is a few microseconds
plus the tail's own bytes (zero when every row is routed). A masked fill over the whole output
instead reads and writes all of it: a full extra memory pass per grouped GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.launch import launch_keyed
from primus_turbo.triton import cdiv, next_pow2

__all__ = ["zero_tail_rows_"]

_BLOCK_R = 32


# No value or alignment specialisation: one compiled kernel serves every shape; launched through
# primus_turbo.triton.launch, which skips Triton's per-call argument binding (this runs twice per
# grouped GEMM forward+backward, where the host time of a small step is the cost that shows).
@triton.jit(do_not_specialize=["G", "M", "N", "stride_m"], do_not_specialize_on_alignment=["out_ptr", "offs_ptr"])
def _zero_tail_kernel(out_ptr, offs_ptr, G, M, N, stride_m, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_R
    start = tl.load(offs_ptr + G)
    if r0 + BLOCK_R > start:
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = (rows >= start) & (rows < M)
        zeros = tl.zeros((BLOCK_R, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_m + cols[None, :]
            tl.store(ptrs, zeros, mask=rmask[:, None] & (cols < N)[None, :])


def zero_tail_rows_(out: torch.Tensor, group_offs: torch.Tensor) -> torch.Tensor:
    """In place: ``out[group_offs[-1]:] = 0`` for a 2-D ``out`` with unit column stride."""
    m, n = out.shape
    if m == 0 or n == 0:
        return out
    block_n = min(next_pow2(n), 256)
    grid0 = cdiv(m, _BLOCK_R)
    G, stride = group_offs.numel() - 1, out.stride(0)
    args = (out, group_offs, G, m, n, stride)
    # every integer parameter is unspecialised: the compiled kernel depends on the two dtypes, the
    # integers' width class and BLOCK_N alone
    wide = max(m, n, stride, G) >= 2**31
    launch_keyed(_zero_tail_kernel, (grid0,), args, dict(BLOCK_R=_BLOCK_R, BLOCK_N=block_n, num_warps=4),
                 out.device, (out.dtype, group_offs.dtype, block_n, wide))
    return out
