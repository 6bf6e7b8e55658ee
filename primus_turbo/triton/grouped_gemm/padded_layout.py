"""The group-aligned padded token layout of a grouped GEMM in one kernel launch (no host sync).

``padded_group_layout_triton(group_offs, m_total, align, nonempty)`` returns what
``primus_turbo.pytorch.backends.grouped_gemm_fp8.padded_group_layout`` computes with about fifteen
small torch ops (clamp, diff, cumsum, searchsorted, where, ...; each a launch plus Python, ~0.5 ms
of host time per call on the H200 machine, twice per FP8 MoE layer step): ``src [M_pad]`` int64,
the source row of each padded row or -1, and ``padded_offs [G+1]`` int64.

One program per ``BLOCK_P`` padded rows. Each walks the ``G`` groups in chunks of ``BLOCK_G``: the
clamped offsets, the (padded) lengths and their running inclusive sum (``tl.cumsum`` plus the
carry of the chunks before), so every program knows every group's padded segment; program 0 also
stores ``padded_offs``. A chunk whose groups put a source row into this program's rows then
matches rows to groups with a ``[BLOCK_P, BLOCK_G]`` compare: row ``p`` comes from group ``g``
when ``excl_g <= p < excl_g + len_g`` (at most one ``g``: the padded segments are disjoint and
``len_g <= plen_g``), as ``offs_g + p - excl_g``. The compare runs in int32 on coordinates relative
to the program's first row (bounds clamped to ``[0, BLOCK_P]``, the source base to
``[-BLOCK_P, m_total]``, exact for every row that matches), so the caller keeps ``m_total`` and
``M_pad`` below 2**31 (it falls back to torch past that). Chunks whose padded rows miss the
program's rows skip the compare, and every program but 0 stops at the first chunk past its rows,
so the 2-D work is a few tiles per program whatever ``G``. sm_90: 78 registers, no spills, 1 KiB
of shared memory (``BLOCK_G = 64`` takes 229 registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.launch import launch

__all__ = ["padded_group_layout_triton", "BLOCK_P"]

BLOCK_P = 256  # padded rows per program
_BLOCK_G = 32  # groups per chunk
_NUM_WARPS = 8


# No value or alignment specialisation: one compiled kernel (per offsets dtype and ``nonempty``)
# serves every G, m_total and align; launched through primus_turbo.triton.launch, which skips
# Triton's per-call argument binding (the host time of small MoE steps is what this kernel cuts).
@triton.jit(do_not_specialize=["G", "m_total", "align", "m_pad"],
            do_not_specialize_on_alignment=["offs_ptr", "src_ptr", "poffs_ptr"])
def _padded_layout_kernel(offs_ptr, src_ptr, poffs_ptr, G, m_total, align, m_pad, NONEMPTY: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr):
    pid = tl.program_id(0)
    p0 = pid.to(tl.int64) * BLOCK_P
    prow = tl.arange(0, BLOCK_P)  # int32, relative to p0
    m_hi = m_total.to(tl.int64)
    al = align.to(tl.int64)
    acc = tl.zeros((BLOCK_P,), dtype=tl.int32)  # 0: no source row; else src - prow + BLOCK_P
    carry = tl.full((), 0, tl.int64)  # padded rows of the chunks before
    if pid == 0:
        tl.store(poffs_ptr, carry)
    c0 = 0
    # program 0 walks every chunk (it stores padded_offs); the others stop at the first chunk
    # that starts past their rows (the padded offsets never decrease)
    while (c0 < G) & ((pid == 0) | (carry < p0 + BLOCK_P)):
        g = c0 + tl.arange(0, BLOCK_G)
        gm = g < G
        o0 = tl.load(offs_ptr + g, mask=gm, other=0).to(tl.int64)
        o1 = tl.load(offs_ptr + g + 1, mask=gm, other=0).to(tl.int64)
        o0 = tl.minimum(tl.maximum(o0, 0), m_hi)
        o1 = tl.minimum(tl.maximum(o1, 0), m_hi)
        lens = tl.maximum(o1 - o0, 0)  # 0 for the masked groups
        plens = (lens + (al - 1)) // al * al
        if NONEMPTY:
            plens = tl.maximum(plens, al)
        plens = tl.where(gm, plens, 0)
        incl = carry + tl.cumsum(plens, axis=0)
        if pid == 0:
            tl.store(poffs_ptr + 1 + g, incl, mask=gm)
        d = incl - plens - p0  # each group's first padded row, relative to p0
        nxt = carry + tl.sum(plens, axis=0)
        if (carry < p0 + BLOCK_P) & (nxt > p0):  # the chunk's padded rows reach this program's
            lo = tl.minimum(tl.maximum(d, 0), BLOCK_P).to(tl.int32)
            hi = tl.minimum(tl.maximum(d + lens, 0), BLOCK_P).to(tl.int32)
            # src of row p0 + r from group g is (o0 - d) + r, in [0, m_total) when it matches
            base = (tl.minimum(tl.maximum(o0 - d, -BLOCK_P), m_hi) + BLOCK_P).to(tl.int32)
            hit = (lo[None, :] <= prow[:, None]) & (prow[:, None] < hi[None, :])
            acc += tl.sum(tl.where(hit, base[None, :], 0), axis=1)
        carry = nxt
        c0 += BLOCK_G
    src = tl.where(acc > 0, acc.to(tl.int64) + (prow - BLOCK_P), -1)
    tl.store(src_ptr + p0 + prow, src, mask=p0 + prow < m_pad)


#: the kernel's int32 arithmetic bound: the caller's m_pad (>= m_total, align * G) stays below it
MAX_ROWS = 2**31 - 2 * BLOCK_P


def padded_group_layout_triton(group_offs: torch.Tensor, m_total: int, align: int,
                               nonempty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src [M_pad] int64, padded_offs [G+1] int64)``, as ``padded_group_layout``: one launch.

    ``group_offs``: contiguous 1-D int32 / int64 on CUDA (or CPU under ``TRITON_INTERPRET=1``);
    ``m_total >= 0``, ``align >= 1`` and ``M_pad = round_up(m_total + align * G, align)`` below
    :data:`MAX_ROWS` (the caller checks; the torch version serves the rest)."""
    G = group_offs.numel() - 1
    m_pad = -(-(m_total + align * G) // align) * align
    dev = group_offs.device
    src = torch.empty(m_pad, dtype=torch.int64, device=dev)
    poffs = torch.empty(G + 1, dtype=torch.int64, device=dev)
    grid0 = max(-(-m_pad // BLOCK_P), 1)  # one program at least: program 0 writes padded_offs
    args = (group_offs, src, poffs, G, m_total, align, m_pad)
    launch(_padded_layout_kernel, (grid0,), args,
           dict(NONEMPTY=nonempty, BLOCK_P=BLOCK_P, BLOCK_G=_BLOCK_G, num_warps=_NUM_WARPS), dev)
    return src, poffs
