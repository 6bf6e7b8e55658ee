"""The ``[G+1]`` exclusive prefix sum of the group sizes, in one launch and without a host sync.

``offs[0] = 0``, ``offs[g+1] = group_lens[0] + ... + group_lens[g]`` (int64). The torch form
(``zeros`` + ``cumsum`` + a copy into the slice) is three kernels and three dispatches; on the H200
machine's host each torch call costs 12-17 us (``scripts/diag_host_path.py``, 2026-12-01), and a
grouped GEMM called without ``group_offs`` spent ~80 us of its host time there. One program
scans the whole vector (G is the local expert count: hundreds at most).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.launch import launch_keyed
from primus_turbo.triton import next_pow2

__all__ = ["group_offsets_", "MAX_GROUPS"]

#: One program holds the whole vector; larger G (not an MoE layer's) takes the torch form.
MAX_GROUPS = 8192


# no value specialisation: one compiled kernel per power-of-two block serves every G up to it
@triton.jit(do_not_specialize=["G", "stride"], do_not_specialize_on_alignment=["lens_ptr", "offs_ptr"])
def _offsets_kernel(lens_ptr, offs_ptr, G, stride, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    ok = idx < G
    lens = tl.load(lens_ptr + idx * stride, mask=ok, other=0).to(tl.int64)
    tl.store(offs_ptr + 1 + idx, tl.cumsum(lens, 0), mask=ok)
    tl.store(offs_ptr + idx, tl.zeros([BLOCK], tl.int64), mask=idx == 0)


def group_offsets_(group_lens: torch.Tensor) -> torch.Tensor:
    """``[G+1]`` int64 exclusive prefix sum of the 1-D integer ``group_lens``, on its device."""
    if group_lens.dim() != 1:
        raise ValueError(f"group_offsets_: group_lens must be 1-D, got shape {tuple(group_lens.shape)}")
    if group_lens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"group_offsets_: group_lens must be int64 or int32, got {group_lens.dtype}")
    G = group_lens.numel()
    offs = torch.empty(G + 1, dtype=torch.int64, device=group_lens.device)
    if G == 0:
        return offs.zero_()
    if G > MAX_GROUPS:
        offs[0] = 0
        offs[1:] = torch.cumsum(group_lens, 0)
        return offs
    block = max(next_pow2(G), 16)
    stride = group_lens.stride(0)
    # G and the stride are unspecialised: the kernel depends on the dtype and BLOCK alone
    launch_keyed(_offsets_kernel, (1,), (group_lens, offs, G, stride), dict(BLOCK=block, num_warps=4),
                 group_lens.device, (group_lens.dtype, block, stride >= 2**31))
    return offs
