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

from primus_turbo.triton.launch import direct_entry, no_launch_hooks, raw_stream

__all__ = ["zero_tail_rows_"]

_BLOCK_R = 32


# No value or alignment specialisation: one compiled kernel serves every shape, so after the first
# call the launch skips Triton's per-call argument binding (this runs twice per grouped GEMM
# forward+backward, where the host time of a small step is the cost that shows).
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


_compiled: dict = {}  # (device index, out dtype, offsets dtype, BLOCK_N) -> (compiled kernel, direct entry)


def zero_tail_rows_(out: torch.Tensor, group_offs: torch.Tensor) -> torch.Tensor:
    """In place: ``out[group_offs[-1]:] = 0`` for a 2-D ``out`` with unit column stride."""
    m, n = out.shape
    if m == 0 or n == 0:
        return out
    block_n = min(triton.next_power_of_2(n), 256)
    grid0 = triton.cdiv(m, _BLOCK_R)
    args = (out, group_offs, group_offs.numel() - 1, m, n, out.stride(0))
    index = out.get_device() if out.is_cuda else None
    cached_launch(_compiled, (index, out.dtype, group_offs.dtype, block_n), _zero_tail_kernel, grid0, args,
                  dict(BLOCK_R=_BLOCK_R, BLOCK_N=block_n), 4, index)
    return out


def cached_launch(compiled: dict, key: tuple, jit_fn, grid0: int, args: tuple, constexprs: dict, num_warps: int,
                  device_index) -> None:
    """Launch ``jit_fn[(grid0, 1, 1)](*args, **constexprs)``, keeping the compiled kernel in
    ``compiled[key]`` (``key`` must name everything the compilation depends on: the device, dtypes,
    constexprs). From the second launch on it goes through the compiled kernel's C entry
    (:func:`primus_turbo.triton.launch.direct_entry`) unless a launch hook is installed. ``constexprs`` in the kernel's signature order (the cached
    paths pass them positionally); ``device_index`` None off CUDA (the interpreter keeps nothing)."""
    if device_index is not None:
        entry = compiled.get(key)
        if entry is not None:
            kernel, direct = entry
            if direct is not None and no_launch_hooks():  # a profiler's hooks need Triton's path
                launch, function, coop, pdl, packed = direct
                launch(grid0, 1, 1, raw_stream(device_index), function, coop, pdl, None, None, packed, None, None, None,
                       *args, *constexprs.values())
            else:
                kernel[(grid0, 1, 1)](*args, *constexprs.values())
            return
    kernel = jit_fn[(grid0, 1, 1)](*args, **constexprs, num_warps=num_warps)
    if device_index is not None:
        compiled[key] = (kernel, direct_entry(kernel))
