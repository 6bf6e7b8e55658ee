"""Row-movement kernels behind ``turbo.ops.moe_permute`` / ``moe_unpermute``.

``gather_rows``:  ``out[o, :] = src[src_row[o], :] (* scale[o])``, zero rows where ``src_row[o] < 0``
(padding / unused rows). One program per block of ``BLOCK_R`` output rows; the column loop moves
16 bytes per lane per step. Without a scale the rows are moved as raw bits (the caller passes an
integer view), so FP8 data, NaNs and signed zeros are copied exactly.

``merge_rows``:  ``out[t, :] = sum_j w[t, j] * src[row_id_map[t, j], :]`` over the entries with
``0 <= row_id_map[t, j] < src.shape[0]`` (an index past ``src``'s rows, from a map built for a larger
buffer, counts as unrouted: it is never read), accumulated in fp32 in ascending ``j`` order, then cast
to ``out``'s dtype. One program per block of ``BLOCK_T`` tokens; up to 16 columns the terms are unrolled, a wider
map (one column per expert) is packed per token first (``compact_map``) and merged in unrolled
chunks up to each token's count.

``scatter_rows`` (the token-major direction, ``moe_permute``'s forward and ``moe_unpermute``'s plain
backward): each token row ``g[t]`` is read once and written to its rows ``0 <= row_id_map[t, j] < n_out``
(an index past the output's rows is skipped, never written)
(as raw bits, or times ``w[t, j]``), the weights copied alongside; rows no pair fills get zeros from
extra programs of the same launch. The row-major gather reads a token's row once per routed expert
and those reads sit in different expert segments, so they come from DRAM: at GPT-OSS-20B's top-4
the scatter ran 0.136 ms against the gather's 0.19 ms.

``permute_map`` (``build_permute_map_launch``): the whole ``moe_permute`` row map on device in three
launches (count, scan, assign), replacing a chain of ~35 small torch ops that made small problems
host-bound:

1. count (one program per block of ``BLOCK_T`` tokens): ``cnt[b, e]`` = routed pairs of expert ``e``
   in block ``b``: the ``[BLOCK_T, BLOCK_E]`` one-hot tiles summed over tokens. Map form: the tile is
   the bool map's. Indices form: the tile is built in registers from the block's ``k`` slot columns
   (one compare per slot), so both forms run the same schedule; no atomics.
2. scan (a single program; a few torch ops when blocks x experts > ``SCAN_KERNEL_MAX``, where one
   program would walk too many tiles): per-expert totals, padded segment lengths ``seg``, expert starts
   (exclusive scan over experts), ``off[b, e] = start[e] + sum_{b' < b} cnt[b', e]``, the
   ``tokens_per_expert`` output ``min(seg, max(n_out - start, 0))`` (int64) and the padded total.
3. assign (one program per block): each pair's rank among the block's earlier tokens of the same
   expert (an exclusive ``cumsum`` over the tokens of the one-hot tile), ``dest = off[b, e] + rank``,
   ``-1`` when unrouted or ``dest >= n_out``; writes ``row_id_map`` (indices form: each slot reads its
   expert's column of the tile) and the inverse ``src_idx[dest] = t * K + j``. The indices form can
   also write Primus-Turbo's ``[T, E + 1 + k]`` map in the same launch. (An earlier indices form
   ranked pairs by a ``[BLOCK_P, BLOCK_P]`` comparison of flattened pairs: 0.466 ms at 16384 x top-8
   on the H200, against 0.005 ms for the map form's tiles.)

The row order is expert-major, tokens ascending within an expert, each segment padded to a
multiple of ``pad_multiple``; ``src_idx`` is ``-1`` on rows no pair fills (padding, tail).
``gather_rows`` with ``row_div=K`` then reads ``src_idx`` directly (token ``src_idx // K``) and can
copy the probs (``probs.flatten()[src_idx]``) in the same launch.

The launchers take device tensors and never read them on the host (except
``build_permute_map_launch`` without ``num_out_tokens``: one read of the padded total).
"""

from __future__ import annotations

from typing import Optional

import os

import torch
import triton
import triton.language as tl
from primus_turbo.triton import next_pow2

__all__ = ["gather_rows_launch", "merge_rows_launch", "compact_map_launch", "build_permute_map_launch",
           "permute_map_scan_launch", "permute_map_assign_launch", "col_block"]


@triton.jit
def _gather_rows_kernel(src_ptr, out_ptr, src_row_ptr, scale_ptr, probs_ptr, pout_ptr, n_out, H, stride_src,
                        stride_out, row_div, HAS_SCALE: tl.constexpr, HAS_PROBS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_out
    sidx = tl.load(src_row_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    valid = sidx >= 0
    sidx = tl.where(valid, sidx, 0)
    srow = sidx // row_div
    if HAS_PROBS:  # pout[o] = probs.flatten()[src_row[o]], 0 where src_row[o] < 0
        p = tl.load(probs_ptr + sidx, mask=rmask & valid, other=0)
        tl.store(pout_ptr + rows, p, mask=rmask)
    if HAS_SCALE:
        s = tl.load(scale_ptr + rows, mask=rmask & valid, other=0.0).to(tl.float32)
    src_base = src_ptr + srow[:, None] * stride_src
    out_base = out_ptr + rows.to(tl.int64)[:, None] * stride_out
    for c0 in range(0, H, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < H
        x = tl.load(src_base + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0)
        if HAS_SCALE:
            x = (x.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_base + cols[None, :], x, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _merge_term(acc, src_ptr, map_base, w_base, j, tmask, cols, cmask, stride_src, n_src, HAS_W: tl.constexpr):
    r = tl.load(map_base + j, mask=tmask, other=-1).to(tl.int64)
    ok = (r >= 0) & (r < n_src)  # an index past src's rows (a bad map) is not routed: never read out of bounds
    r = tl.where(ok, r, 0)
    x = tl.load(src_ptr + r[:, None] * stride_src + cols[None, :],
                mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(w_base + j, mask=tmask & ok, other=0.0).to(tl.float32)
        x = x * w[:, None]
    return acc + x


@triton.jit
def _merge_rows_kernel(src_ptr, out_ptr, map_ptr, w_ptr, n_ptr, T, K, H, stride_src, stride_out, n_src,
                       HAS_W: tl.constexpr, K_STATIC: tl.constexpr, COUNTED: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """``K_STATIC > 0`` (= K, the usual top-k of 1..16): the K terms are unrolled, so the K row
    loads of a column step are all in flight at once; a runtime loop over K (``K_STATIC = 0``, for
    wide maps) issues them one dependent index load + row load at a time, which measured ~0.3x the
    copy bandwidth at top-8.

    ``COUNTED``: the map was packed by ``_compact_map_kernel`` (token ``t``'s ``n[t]`` entries first,
    ascending ``j``); the terms run in unrolled chunks of ``K_STATIC`` up to the block's largest
    ``n``, so a wide map (one column per expert, a few routed) costs about what its top-k form does."""
    pid = tl.program_id(0)
    toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    map_base = map_ptr + toks.to(tl.int64) * K
    w_base = w_ptr + toks.to(tl.int64) * K
    out_base = out_ptr + toks.to(tl.int64)[:, None] * stride_out
    if COUNTED:
        n = tl.load(n_ptr + toks, mask=tmask, other=0)
        n_hi = tl.max(n, 0)
    for c0 in range(0, H, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < H
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if COUNTED:
            for j0 in range(0, n_hi, K_STATIC):
                for i in tl.static_range(K_STATIC):  # ascending j across and within chunks
                    acc = _merge_term(acc, src_ptr, map_base, w_base, j0 + i, tmask & (j0 + i < n), cols, cmask,
                                      stride_src, n_src, HAS_W)
        elif K_STATIC > 0:
            for j in tl.static_range(K_STATIC):  # ascending j: the fp32 sum order is fixed
                acc = _merge_term(acc, src_ptr, map_base, w_base, j, tmask, cols, cmask, stride_src, n_src, HAS_W)
        else:
            for j in range(0, K):
                acc = _merge_term(acc, src_ptr, map_base, w_base, j, tmask, cols, cmask, stride_src, n_src, HAS_W)
        tl.store(out_base + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])


@triton.jit
def _compact_map_kernel(map_ptr, w_ptr, cmap_ptr, cw_ptr, n_ptr, T, K, HAS_W: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packs each token's entries with ``map[t, j] >= 0`` to the front of its row in ascending ``j``:
    ``cmap[t, :n[t]]`` (and their weights ``cw[t, :n[t]]``), ``n[t]`` the count. Slots past ``n[t]``
    are left unwritten: the counted merge never reads them."""
    pid = tl.program_id(0)
    toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    cols = tl.arange(0, BLOCK_K)
    row = toks.to(tl.int64)[:, None] * K
    r = tl.load(map_ptr + row + cols[None, :], mask=tmask[:, None] & (cols[None, :] < K), other=-1)
    ok = r >= 0
    oki = ok.to(tl.int32)
    pos = tl.cumsum(oki, axis=1) - oki  # the entry's place among the token's kept entries
    tl.store(cmap_ptr + row + pos, r, mask=ok)
    if HAS_W:
        w = tl.load(w_ptr + row + cols[None, :], mask=ok, other=0)
        tl.store(cw_ptr + row + pos, w, mask=ok)
    tl.store(n_ptr + toks, tl.sum(oki, axis=1), mask=tmask)


@triton.jit
def _unpermute_bwd_kernel(g_ptr, perm_ptr, src_ptr, probs_ptr, gp_ptr, dot_ptr, n_out, H, stride_g, stride_p,
                          stride_gp, row_div, HAS_PROBS: tl.constexpr, NEED_GP: tl.constexpr,
                          NEED_DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Backward of the weighted merge, one pass over each permuted row o (token t = src[o] // row_div):
    gp[o] = g[t] * probs.flatten()[src[o]] and dot[o] = <g[t], perm[o]> (fp32), both 0 where
    src[o] < 0. Reads g's row and perm's row once, instead of gathering g twice and materialising
    fp32 copies for the dot."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_out
    sidx = tl.load(src_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    valid = sidx >= 0
    sidx = tl.where(valid, sidx, 0)
    trow = sidx // row_div
    if HAS_PROBS:
        w = tl.load(probs_ptr + sidx, mask=rmask & valid, other=0).to(tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    g_base = g_ptr + trow[:, None] * stride_g
    r64 = rows.to(tl.int64)[:, None]
    for c0 in range(0, H, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < H
        m = rmask[:, None] & cmask[None, :]
        g = tl.load(g_base + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0).to(tl.float32)
        if NEED_GP:
            gp = g
            if HAS_PROBS:
                gp = g * w[:, None]
            tl.store(gp_ptr + r64 * stride_gp + cols[None, :], gp.to(gp_ptr.dtype.element_ty), mask=m)
        if NEED_DOT:
            x = tl.load(perm_ptr + r64 * stride_p + cols[None, :], mask=m, other=0).to(tl.float32)
            acc += tl.sum(g * x, axis=1)
    if NEED_DOT:
        tl.store(dot_ptr + rows, acc, mask=rmask)


@triton.jit
def _scatter_term(g, out_ptr, perm_ptr, map_base, w_base, j, tmask, cols, cmask, stride_out, stride_p, acc, jv,
                  n_out, SCALE_W: tl.constexpr, NEED_OUT: tl.constexpr, NEED_DOT: tl.constexpr):
    r = tl.load(map_base + j, mask=tmask, other=-1).to(tl.int64)
    ok = (r >= 0) & (r < n_out)  # an index past out's rows (a bad map) is not routed: never written
    r = tl.where(ok, r, 0)
    m = ok[:, None] & cmask[None, :]
    if NEED_OUT:
        y = g
        if SCALE_W:
            w = tl.load(w_base + j, mask=tmask & ok, other=0).to(tl.float32)
            y = g * w[:, None]
        tl.store(out_ptr + r[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
    if NEED_DOT:
        x = tl.load(perm_ptr + r[:, None] * stride_p + cols[None, :], mask=m, other=0).to(tl.float32)
        s = tl.sum(g * x, axis=1)
        acc = tl.where(jv[None, :] == j, acc + s[:, None], acc)
    return acc


@triton.jit
def _scatter_rows_kernel(g_ptr, map_ptr, w_ptr, n_ptr, src_ptr, out_ptr, pout_ptr, perm_ptr, dot_ptr,
                         T, K, H, n_out, stride_g, stride_out, stride_p, n_tok_prog,
                         SCALE_W: tl.constexpr, STORE_W: tl.constexpr, NEED_OUT: tl.constexpr,
                         NEED_DOT: tl.constexpr, K_STATIC: tl.constexpr, COUNTED: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_Z: tl.constexpr):
    """Token-major scatter: each token's row ``g[t]`` is read once and written to every row
    ``r = map[t, j] >= 0`` of ``out`` (times ``w[t, j]`` with ``SCALE_W``); with ``STORE_W``
    ``pout[r] = w[t, j]``; with ``NEED_DOT`` ``dot[r] = <g[t], perm[r]>`` (fp32). The gather form
    (one program per output row, ``g[src[o] // K]``) reads a token's row K times, and the K rows of
    one token lie in K different expert segments, so the re-reads come from DRAM, not L2.

    Programs ``>= n_tok_prog`` write the rows nobody fills (``src[o] < 0``: segment padding, the
    tail): zeros in ``out``, ``pout`` and ``dot``. ``COUNTED`` / ``K_STATIC`` as in the merge."""
    pid = tl.program_id(0)
    if pid < n_tok_prog:
        toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = toks < T
        map_base = map_ptr + toks.to(tl.int64) * K
        w_base = w_ptr + toks.to(tl.int64) * K
        g_base = g_ptr + toks.to(tl.int64)[:, None] * stride_g
        jv = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        if COUNTED:
            n = tl.load(n_ptr + toks, mask=tmask, other=0)
            n_hi = tl.max(n, 0)
            jmask = jv[None, :] < n[:, None]
        else:
            jmask = (jv[None, :] < K) & tmask[:, None]
        if NEED_OUT or NEED_DOT:
            for c0 in range(0, H, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                cmask = cols < H
                g = tl.load(g_base + cols[None, :], mask=tmask[:, None] & cmask[None, :], other=0)
                if SCALE_W or NEED_DOT:
                    g = g.to(tl.float32)
                if COUNTED:
                    for j0 in range(0, n_hi, K_STATIC):
                        for i in tl.static_range(K_STATIC):
                            acc = _scatter_term(g, out_ptr, perm_ptr, map_base, w_base, j0 + i, tmask & (j0 + i < n),
                                                cols, cmask, stride_out, stride_p, acc, jv, n_out, SCALE_W, NEED_OUT,
                                                NEED_DOT)
                elif K_STATIC > 0:
                    for j in tl.static_range(K_STATIC):
                        acc = _scatter_term(g, out_ptr, perm_ptr, map_base, w_base, j, tmask, cols, cmask,
                                            stride_out, stride_p, acc, jv, n_out, SCALE_W, NEED_OUT, NEED_DOT)
                else:
                    for j in range(0, K):
                        acc = _scatter_term(g, out_ptr, perm_ptr, map_base, w_base, j, tmask, cols, cmask,
                                            stride_out, stride_p, acc, jv, n_out, SCALE_W, NEED_OUT, NEED_DOT)
        if STORE_W or NEED_DOT:
            rr = tl.load(map_base[:, None] + jv[None, :], mask=jmask, other=-1).to(tl.int64)
            ok = (rr >= 0) & (rr < n_out)
            rr = tl.where(ok, rr, 0)
            if STORE_W:
                w = tl.load(w_base[:, None] + jv[None, :], mask=jmask & ok, other=0)
                tl.store(pout_ptr + rr, w, mask=ok)
            if NEED_DOT:
                tl.store(dot_ptr + rr, acc, mask=ok)
    else:
        rows = (pid - n_tok_prog) * BLOCK_Z + tl.arange(0, BLOCK_Z)
        rmask = rows < n_out
        empty = (tl.load(src_ptr + rows, mask=rmask, other=0) < 0) & rmask
        if tl.max(empty.to(tl.int32), 0) > 0:
            if STORE_W:
                tl.store(pout_ptr + rows, tl.zeros([BLOCK_Z], dtype=pout_ptr.dtype.element_ty), mask=empty)
            if NEED_DOT:
                tl.store(dot_ptr + rows, tl.zeros([BLOCK_Z], dtype=tl.float32), mask=empty)
            if NEED_OUT:
                r64 = rows.to(tl.int64)[:, None] * stride_out
                for c0 in range(0, H, BLOCK_C):
                    cols = c0 + tl.arange(0, BLOCK_C)
                    tl.store(out_ptr + r64 + cols[None, :], tl.zeros([BLOCK_Z, BLOCK_C], dtype=out_ptr.dtype.element_ty),
                             mask=empty[:, None] & (cols < H)[None, :])


def scatter_rows_launch(g: torch.Tensor, row_id_map: torch.Tensor, src_idx: torch.Tensor,
                        out: Optional[torch.Tensor] = None, weights: Optional[torch.Tensor] = None,
                        scale_by_weights: bool = False, probs_out: Optional[torch.Tensor] = None,
                        permuted: Optional[torch.Tensor] = None, dot: Optional[torch.Tensor] = None,
                        compact: Optional[bool] = None, num_warps: Optional[int] = None,
                        block_t: Optional[int] = None, block_c: Optional[int] = None):
    """Token-major row scatter (see ``_scatter_rows_kernel``), the inverse direction of ``merge_rows``:

    - ``out[r] = g[t]`` (raw bits: pass integer views) or ``g[t] * weights[t, j]`` (``scale_by_weights``)
      for every ``r = row_id_map[t, j] >= 0``; ``probs_out[r] = weights[t, j]``;
      ``dot[r] = <g[t], permuted[r]>`` (fp32);
    - rows with ``src_idx[r] < 0`` (nobody fills them) get zeros in all three.

    ``g`` ``[T, H]``, ``row_id_map`` contiguous ``[T, K]`` int32, ``src_idx`` ``[n_out]`` (its inverse),
    ``weights`` contiguous ``[T, K]``. A map wider than :data:`MERGE_UNROLL_MAX` is packed first."""
    t, k = row_id_map.shape
    n_out = src_idx.shape[0]
    h = g.shape[1]
    if n_out == 0 or (out is None and probs_out is None and dot is None):
        return out, probs_out, dot
    if scale_by_weights and weights is None:
        raise ValueError("scatter_rows_launch: scale_by_weights needs weights")
    if probs_out is not None and weights is None:
        raise ValueError("scatter_rows_launch: probs_out needs weights")
    if dot is not None and permuted is None:
        raise ValueError("scatter_rows_launch: dot needs permuted")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"scatter_rows_launch: num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
    for name, v, lo in (("block_t", block_t, 1), ("block_c", block_c, 16)):
        if v is not None and (v < lo or v & (v - 1)):
            raise ValueError(f"scatter_rows_launch: {name} must be a power of two >= {lo}, got {v}")
    if out is not None and out.dtype == torch.bfloat16 and scale_by_weights and _interp():
        # the interpreter's fp32 -> bf16 cast truncates: store fp32, round (RNE) with torch after
        tmp = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        scatter_rows_launch(g, row_id_map, src_idx, tmp, weights, True, probs_out, permuted, dot, compact, num_warps,
                            block_t, block_c)
        out.copy_(tmp)
        return out, probs_out, dot
    if compact is None:
        compact = k > MERGE_UNROLL_MAX
    counts = row_id_map
    if compact:
        row_id_map, weights, counts = compact_map_launch(row_id_map, weights)
        k_static = MERGE_CHUNK
    else:
        k_static = k if k <= MERGE_UNROLL_MAX else 0
    num_warps = num_warps or SCATTER_NUM_WARPS
    block_t = block_t or (32 if _interp() else SCATTER_BLOCK_T)
    elem = out.element_size() if out is not None else g.element_size()
    bc = block_c or max(16, min(next_pow2(max(h, 1)), SCATTER_BLOCK_BYTES // elem))
    block_z = 64
    n_tok_prog = _cdiv(t, block_t) if t > 0 else 0
    grid = (n_tok_prog + _cdiv(n_out, block_z),)
    any_ = out if out is not None else (probs_out if probs_out is not None else dot)
    _scatter_rows_kernel[grid](
        g, row_id_map, weights if weights is not None else row_id_map, counts, src_idx,
        out if out is not None else any_, probs_out if probs_out is not None else any_,
        permuted if permuted is not None else g, dot if dot is not None else any_,
        t, k, h, n_out, g.stride(0), out.stride(0) if out is not None else 0,
        permuted.stride(0) if permuted is not None else 0, n_tok_prog,
        SCALE_W=scale_by_weights, STORE_W=probs_out is not None, NEED_OUT=out is not None and h > 0,
        NEED_DOT=dot is not None, K_STATIC=k_static, COUNTED=compact, BLOCK_T=block_t, BLOCK_C=bc,
        BLOCK_K=next_pow2(max(k, 1)), BLOCK_Z=block_z, num_warps=num_warps)
    return out, probs_out, dot


def unpermute_bwd_launch(g: torch.Tensor, permuted: torch.Tensor, src_idx: torch.Tensor, row_div: int,
                         probs: Optional[torch.Tensor], need_grad_permuted: bool, need_dot: bool):
    """``(grad_permuted or None, dot or None)`` of the weighted merge (see _unpermute_bwd_kernel).
    ``g`` ``[T, H]``, ``permuted`` ``[n_out, H]`` (unit column strides), ``src_idx`` ``[n_out]``,
    ``probs`` contiguous ``[T, K]`` or None (weights of 1)."""
    n_out, h = permuted.shape
    dev = permuted.device
    gp = torch.empty((n_out, h), dtype=permuted.dtype, device=dev) if need_grad_permuted else None
    dot = torch.empty((n_out,), dtype=torch.float32, device=dev) if need_dot else None
    if n_out == 0 or not (need_grad_permuted or need_dot):
        return gp, dot
    if h == 0:
        if dot is not None:
            dot.zero_()
        return gp, dot
    target = gp
    if gp is not None and gp.dtype == torch.bfloat16 and _interp():
        # the interpreter's fp32 -> bf16 cast truncates: store fp32, round (RNE) with torch after
        target = torch.empty((n_out, h), dtype=torch.float32, device=dev)
    num_warps = 4
    block_r = 32 if _interp() else 4
    bc = col_block(h, g.element_size(), num_warps)
    _unpermute_bwd_kernel[(_cdiv(n_out, block_r),)](
        g, permuted, src_idx, probs if probs is not None else src_idx,
        target if target is not None else permuted, dot if dot is not None else src_idx,
        n_out, h, g.stride(0), permuted.stride(0), target.stride(0) if target is not None else 0, row_div,
        HAS_PROBS=probs is not None, NEED_GP=gp is not None, NEED_DOT=dot is not None,
        BLOCK_R=block_r, BLOCK_C=bc, num_warps=num_warps)
    if target is not gp:
        gp.copy_(target)
    return gp, dot


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a jit function: slow to call from the host


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def col_block(h: int, elem_bytes: int, num_warps: int = 4) -> int:
    """Columns per step: 16 bytes per lane over all lanes, capped at the (power-of-2) row width."""
    per_lane = max(1, 16 // elem_bytes)
    return max(16, min(next_pow2(max(h, 1)), per_lane * 32 * num_warps))


def gather_rows_launch(src: torch.Tensor, out: torch.Tensor, src_row: torch.Tensor,
                       scale: Optional[torch.Tensor] = None, block_r: Optional[int] = None, *,
                       row_div: int = 1, probs: Optional[torch.Tensor] = None,
                       probs_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[o] = src[src_row[o] // row_div] (* scale[o]); zero where src_row[o] < 0. 2-D, unit column stride.

    With ``probs`` (contiguous) and ``probs_out`` (``[n_out]``, same dtype): also
    ``probs_out[o] = probs.flatten()[src_row[o]]`` (0 where ``src_row[o] < 0``) in the same launch."""
    n_out, h = out.shape
    has_probs = probs is not None
    if n_out == 0 or (h == 0 and not has_probs):
        return out
    num_warps = 4
    block_r = block_r or (32 if _interp() else 4)  # the interpreter pays per program
    bc = col_block(h, out.element_size(), num_warps)
    grid = (_cdiv(n_out, block_r),)
    if scale is not None and out.dtype == torch.bfloat16 and _interp():
        # the interpreter's fp32 -> bf16 cast truncates: store fp32, round (RNE) with torch
        tmp = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        gather_rows_launch(src, tmp, src_row, scale, block_r, row_div=row_div, probs=probs, probs_out=probs_out)
        out.copy_(tmp)
        return out
    _gather_rows_kernel[grid](
        src, out, src_row, scale if scale is not None else src_row, probs if has_probs else src_row,
        probs_out if has_probs else src_row, n_out, h, src.stride(0), out.stride(0), row_div,
        HAS_SCALE=scale is not None, HAS_PROBS=has_probs, BLOCK_R=block_r, BLOCK_C=bc, num_warps=num_warps)
    return out


def merge_rows_launch(src: torch.Tensor, out: torch.Tensor, row_id_map: torch.Tensor,
                      weights: Optional[torch.Tensor] = None, block_t: Optional[int] = None,
                      num_warps: Optional[int] = None, block_c: Optional[int] = None,
                      compact: Optional[bool] = None, chunk: Optional[int] = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * src[row_id_map[t, j]] (fp32 accumulation). 2-D, unit column stride.
    ``block_t`` / ``num_warps`` / ``block_c`` override the launch configuration (benchmarks sweep them).

    A map wider than :data:`MERGE_UNROLL_MAX` (``compact`` forces the choice) is first packed by
    ``_compact_map_kernel`` (one small launch over the map) and merged in unrolled chunks of
    ``chunk`` (:data:`MERGE_CHUNK`) terms up to each token's count; same terms, same order, same bits."""
    t, h = out.shape
    if t == 0 or h == 0:
        return out
    k = row_id_map.shape[1]
    num_warps = num_warps or MERGE_NUM_WARPS
    block_t = block_t or (32 if _interp() else MERGE_BLOCK_T)
    bc = block_c or col_block(h, src.element_size(), num_warps)  # 16-byte loads per lane
    grid = (_cdiv(t, block_t),)
    if out.dtype == torch.bfloat16 and _interp():
        # the interpreter's fp32 -> bf16 cast truncates: store fp32, round (RNE) with torch
        tmp = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        merge_rows_launch(src, tmp, row_id_map, weights, block_t, num_warps, block_c, compact, chunk)
        out.copy_(tmp)
        return out
    if compact is None:
        compact = k > MERGE_UNROLL_MAX
    if chunk is not None and chunk < 1:
        raise ValueError(f"merge_rows_launch: chunk must be >= 1, got {chunk}")
    counts = row_id_map  # unread placeholder pointer unless the map is packed
    if compact:
        row_id_map, weights, counts = compact_map_launch(row_id_map, weights)
        k_static = chunk or MERGE_CHUNK
    else:
        k_static = k if k <= MERGE_UNROLL_MAX else 0
    _merge_rows_kernel[grid](
        src, out, row_id_map, weights if weights is not None else row_id_map, counts, t, k, h,
        src.stride(0), out.stride(0), src.shape[0], HAS_W=weights is not None, K_STATIC=k_static, COUNTED=compact,
        BLOCK_T=block_t, BLOCK_C=bc, num_warps=num_warps)
    return out


def compact_map_launch(row_id_map: torch.Tensor, weights: Optional[torch.Tensor] = None):
    """``(packed map, packed weights or None, counts int32 [T])`` of a contiguous ``[T, K]`` map (see
    ``_compact_map_kernel``; slots past a token's count are uninitialised)."""
    t, k = row_id_map.shape
    cmap = torch.empty_like(row_id_map)
    cw = torch.empty_like(weights) if weights is not None else None
    n = torch.empty(t, dtype=torch.int32, device=row_id_map.device)
    if t == 0:
        return cmap, cw, n
    block_k = next_pow2(max(k, 1))
    block_t = max(1, min(64, 4096 // block_k))
    _compact_map_kernel[(_cdiv(t, block_t),)](row_id_map, weights if weights is not None else row_id_map,
                                             cmap, cw if cw is not None else cmap, n, t, k,
                                             HAS_W=weights is not None, BLOCK_T=block_t, BLOCK_K=block_k,
                                             num_warps=4)
    return cmap, cw, n


#: widest row map whose terms merge_rows unrolls (top-k is 1..16 in practice); a wider map, e.g. one
#: column per expert with a few routed, is packed per token and merged in chunks of MERGE_CHUNK
MERGE_UNROLL_MAX = 16


#: terms per unrolled chunk of the counted (packed-map) merge: top-4 in one chunk, top-8 in two
MERGE_CHUNK = 4


#: scatter_rows' default launch: 4 tokens per program, 8 warps, 2 KiB of each row per column step
#: (1024 bf16 columns), so four row loads are in flight per step; one token per program keeps a single
#: load in flight and ran at 0.45-0.62x the copy. H200, GPT-OSS-20B's [16384, 2880] -> [65536, 2880]
#: top-4 (scripts/tune_gptoss_memory.py, 12 launches): 0.136 ms, 0.84x the device copy of the
#: compulsory bytes, against 0.19 ms (0.61x) for the row-major gather that reads each token row 4 times
SCATTER_BLOCK_T = 4
SCATTER_NUM_WARPS = 8
SCATTER_BLOCK_BYTES = 2048
#: The [T, E] map form (GPT-OSS-20B's 32 experts, top-4) is packed per token and scattered in chunks
#: of MERGE_CHUNK up to each block's largest count: 0.141 ms (0.82x the copy); unrolling all 8 chunks
#: with the terms past the count masked off ran 0.20-0.32 ms (tried and removed)


#: merge_rows' default launch: one token per program, 8 warps, 16-byte loads per lane, so a column
#: step keeps K x 16 bytes per lane in flight. H200, bf16 [8192 | 16384, 7168] from top-8 rows
#: (scripts/tune_memory_bound.py --only merge_rows): 1.03-1.05x the device copy's GB/s, against
#: ~0.3x for the runtime-K loop it replaced; the worst of the 12 configs swept 0.66x.
MERGE_NUM_WARPS = 8
MERGE_BLOCK_T = 1


# ----------------------------------------------------------------------------------------------
# Row map of moe_permute: count -> scan -> assign
# ----------------------------------------------------------------------------------------------
@triton.jit
def _map_tile(map_ptr, toks, tmask, cols, cmask, K):
    """[BLOCK_T, BLOCK_E] int32 mask tile of the bool [T, K] routing map."""
    m = tl.load(map_ptr + toks.to(tl.int64)[:, None] * K + cols[None, :],
                mask=tmask[:, None] & cmask[None, :], other=0)
    return (m != 0).to(tl.int32)


@triton.jit
def _slot_tile(idx_ptr, flat, tmask, cols, cmask, K):
    """One-hot tile of top-k indices: ``m[t, e]`` (int32) = 1 when a slot of token ``t`` names expert
    ``cols[e]``, and ``jof[t, e]`` = that slot (the last one if a row repeats an expert, which the
    contract excludes; the torch builder collapses repeats the same way). Slots outside ``[0, E)``
    never match a column."""
    m = tl.zeros([flat.shape[0], cols.shape[0]], tl.int32)
    jof = tl.zeros([flat.shape[0], cols.shape[0]], tl.int32)
    for j in range(0, K):
        ej = tl.load(idx_ptr + flat + j, mask=tmask, other=-1).to(tl.int32)
        hit = (ej[:, None] == cols[None, :]) & cmask[None, :]
        m = tl.where(hit, 1, m)
        jof = tl.where(hit, j, jof)
    return m, jof


@triton.jit
def _permute_count_kernel(map_ptr, cnt_ptr, T, K, E, IS_MAP: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_E: tl.constexpr):
    """``cnt[b, e]``: routed pairs of expert ``e`` among the ``BLOCK_T`` tokens of block ``b`` (every
    entry written: the workspace needs no zero fill)."""
    b = tl.program_id(0)
    toks = b * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    flat = toks.to(tl.int64) * K
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        cmask = cols < E
        if IS_MAP:
            m = _map_tile(map_ptr, toks, tmask, cols, cmask, K)
        else:
            m, _j = _slot_tile(map_ptr, flat, tmask, cols, cmask, K)
        tl.store(cnt_ptr + b * E + cols, tl.sum(m, axis=0), mask=cmask)


@triton.jit
def _permute_scan_kernel(ws_ptr, tpe_ptr, NB, E, pad, n_out, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """Single program. ws = [cnt (NB*E) | off (NB*E) | total (1)], int32."""
    off_ptr = ws_ptr + NB * E
    carry = tl.sum(tl.zeros([BLOCK_E], tl.int32), axis=0)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        cmask = cols < E
        tot = tl.zeros([BLOCK_E], tl.int32)
        for b0 in range(0, NB, BLOCK_B):
            rows = b0 + tl.arange(0, BLOCK_B)
            c = tl.load(ws_ptr + rows[:, None] * E + cols[None, :], mask=(rows < NB)[:, None] & cmask[None, :],
                        other=0)
            tot += tl.sum(c, axis=0)
        seg = (tot + pad - 1) // pad * pad
        start = carry + tl.cumsum(seg, axis=0) - seg
        carry += tl.sum(seg, axis=0)
        # segments cut by a short buffer: count only the rows that are in it
        tl.store(tpe_ptr + cols, tl.minimum(seg, tl.maximum(n_out - start, 0)).to(tl.int64), mask=cmask)
        run = start
        for b0 in range(0, NB, BLOCK_B):
            rows = b0 + tl.arange(0, BLOCK_B)
            m2 = (rows < NB)[:, None] & cmask[None, :]
            c = tl.load(ws_ptr + rows[:, None] * E + cols[None, :], mask=m2, other=0)
            tl.store(off_ptr + rows[:, None] * E + cols[None, :], tl.cumsum(c, axis=0) - c + run[None, :], mask=m2)
            run += tl.sum(c, axis=0)
    tl.store(off_ptr + NB * E, carry)


@triton.jit
def _permute_assign_kernel(map_ptr, ws_ptr, rid_ptr, src_ptr, full_ptr, T, K, E, NB, n_out, IS_MAP: tl.constexpr,
                           FULL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Map form: ``rid[t, e]`` for every expert. Indices form: the one-hot ``[BLOCK_T, BLOCK_E]`` tile
    of the block's slots gives each (token, expert) pair its row exactly as the map form does, then
    ``rid[t, j]`` is read off the tile column of slot ``j``'s expert. With ``FULL`` (indices only)
    the Primus-Turbo ``[T, E + 1 + K]`` map is written too: the ``E`` expert columns, a spare ``-1``
    column, then each slot's column (``E`` when the slot got no row)."""
    b = tl.program_id(0)
    off_ptr = ws_ptr + NB * E + b * E
    toks = b * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    flat = toks.to(tl.int64) * K
    FW = E + 1 + K
    full_row = toks.to(tl.int64) * FW
    if not IS_MAP:
        # slots routed to no expert (-1, or any value outside [0, E)) match no tile column
        for j in range(0, K):
            ej = tl.load(map_ptr + flat + j, mask=tmask, other=0)
            nowhere = tmask & ((ej < 0) | (ej >= E))
            tl.store(rid_ptr + flat + j, tl.full([BLOCK_T], -1, tl.int32), mask=nowhere)
            if FULL:
                tl.store(full_ptr + full_row + E + 1 + j, tl.full([BLOCK_T], 0, tl.int32) + E, mask=nowhere)
        if FULL:
            tl.store(full_ptr + full_row + E, tl.full([BLOCK_T], -1, tl.int32), mask=tmask)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        cmask = cols < E
        if IS_MAP:
            m = _map_tile(map_ptr, toks, tmask, cols, cmask, K)
            jof = cols[None, :] + tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
        else:
            m, jof = _slot_tile(map_ptr, flat, tmask, cols, cmask, K)
        base = tl.load(off_ptr + cols, mask=cmask, other=0)
        dest = base[None, :] + tl.cumsum(m, axis=0) - m
        ok = (m != 0) & (dest < n_out)
        d = tl.where(ok, dest, -1)
        tl.store(src_ptr + dest.to(tl.int64), flat[:, None] + jof, mask=ok)
        if IS_MAP:
            tl.store(rid_ptr + flat[:, None] + cols[None, :], d, mask=tmask[:, None] & cmask[None, :])
        else:
            if FULL:
                tl.store(full_ptr + full_row[:, None] + cols[None, :], d, mask=tmask[:, None] & cmask[None, :])
            for j in range(0, K):
                ej = tl.load(map_ptr + flat + j, mask=tmask, other=-1).to(tl.int32)
                hit = (ej[:, None] == cols[None, :]) & cmask[None, :]
                here = tmask & (ej >= e0) & (ej < E) & (ej < e0 + BLOCK_E)   # this slot's expert is in the tile
                r = tl.sum(tl.where(hit, d, 0), axis=1)
                tl.store(rid_ptr + flat + j, r, mask=here)
                if FULL:
                    tl.store(full_ptr + full_row + E + 1 + j, tl.where(r >= 0, ej, E), mask=here)


SCAN_KERNEL_MAX = 32768  # cnt entries (blocks x experts) scanned by the single-program kernel


def permute_map_blocks(is_map: bool, num_experts: int, num_tokens: int = 0, k: int = 1) -> tuple:
    """(BLOCK_T, BLOCK_E): tokens per block and experts per tile, for both forms (the indices form
    builds the same one-hot tiles from its slots). Blocks grow with the problem so that blocks x
    experts stays small for the scan; a tile holds at most 8192 entries (map form) or 4096 (indices:
    the tile carries each pair's slot too)."""
    ep = next_pow2(max(num_experts, 1))
    if _interp():  # the interpreter pays per op: big tiles
        return 128, min(ep, 256)
    bt = min(512, max(64, next_pow2(_cdiv(num_tokens * num_experts, SCAN_KERNEL_MAX // 2))))
    return bt, max(1, min(ep, (8192 if is_map else 4096) // bt))


def permute_map_scan_launch(routing_map: torch.Tensor, num_experts: int, pad_multiple: Optional[int],
                            num_out_tokens: Optional[int], blocks: Optional[tuple] = None,
                            scan_max: int = SCAN_KERNEL_MAX) -> tuple:
    """Count + scan launches (the scan with a few torch ops when blocks x experts > ``scan_max``). Returns the state for ``permute_map_assign_launch``:
    ``(ws, tokens_per_expert, blocks, n_blocks)``; ``ws[-1]`` (int32, on device) is the padded total:
    read it on the host only when ``num_out_tokens`` is None."""
    is_map = routing_map.dtype == torch.bool
    t, kk = routing_map.shape
    e = int(num_experts)
    dev = routing_map.device
    blocks = tuple(blocks or permute_map_blocks(is_map, e, t, kk))
    if len(blocks) != 2 or any(not isinstance(v, int) or v < 1 or v & (v - 1) for v in blocks):
        raise ValueError(f"permute_map_scan_launch: blocks must be (BLOCK_T, BLOCK_E), powers of two, got {blocks}")
    bt, be = blocks
    nb = _cdiv(t, bt)
    pad = int(pad_multiple) if pad_multiple else 1
    # cnt | off | total: the count kernel writes every cnt entry and the scan every off entry and the
    # total, so no zero fill is needed unless nothing is launched
    alloc = torch.empty if nb and e else torch.zeros
    ws = alloc(2 * nb * e + 1, dtype=torch.int32, device=dev)
    if nb and e:
        _permute_count_kernel[(nb,)](routing_map, ws, t, kk, e, IS_MAP=is_map, BLOCK_T=bt, BLOCK_E=be,
                                     num_warps=4)
    n_clip = 2 ** 31 - 1 if num_out_tokens is None else int(num_out_tokens)
    if e == 0:
        tpe = torch.zeros(0, dtype=torch.int64, device=dev)
    elif nb * e <= scan_max:
        tpe = torch.empty(e, dtype=torch.int64, device=dev)
        scan_be = min(next_pow2(e), 256 if _interp() else 128)
        scan_bb = 256 if _interp() else max(1, 8192 // scan_be)
        _permute_scan_kernel[(1,)](ws, tpe, nb, e, pad, n_clip, BLOCK_B=scan_bb, BLOCK_E=scan_be, num_warps=4)
    else:  # large problems: a single program would walk too many tiles; torch scans [E, NB] rows in parallel
        tpe = _scan_torch(ws, nb, e, pad, n_clip)
    return ws, tpe, blocks, nb


def _scan_torch(ws: torch.Tensor, nb: int, e: int, pad: int, n_clip: int) -> torch.Tensor:
    """``_permute_scan_kernel`` with torch ops (device-only): fills off and total in ``ws``, returns tpe."""
    cnt_t = ws[: nb * e].view(nb, e).t()                        # [E, NB]
    tot = cnt_t.sum(1, dtype=torch.int32)
    seg = (tot + pad - 1) // pad * pad if pad > 1 else tot
    start = torch.cumsum(seg, 0, dtype=torch.int32) - seg
    off = torch.cumsum(cnt_t, 1, dtype=torch.int32) - cnt_t + start[:, None]
    ws[nb * e: 2 * nb * e].view(nb, e).t().copy_(off)
    ws[2 * nb * e:].copy_(seg.sum(dtype=torch.int32).reshape(1))
    return torch.minimum(seg, (n_clip - start).clamp(min=0)).to(torch.int64)


def permute_map_assign_launch(routing_map: torch.Tensor, num_experts: int, state: tuple, n_out: int,
                              full_map: bool = False):
    """Assign launch: returns ``(row_id_map int32 [T, K], src_idx int64 [n_out])``, and with ``full_map``
    (top-k indices only) a third output, Primus-Turbo's int32 ``[T, E + 1 + k]`` map: the row of each
    (token, expert) pair, a spare ``-1`` column ``E``, then each slot's expert column (``E`` when the
    slot has no row), written by the same launch."""
    ws, _tpe, (bt, be), nb = state
    is_map = routing_map.dtype == torch.bool
    if full_map and is_map:
        raise ValueError("permute_map_assign_launch: full_map is the top-k indices form's map; a bool map is one")
    t, kk = routing_map.shape
    e = int(num_experts)
    dev = routing_map.device
    row_id_map = torch.empty(t, kk, dtype=torch.int32, device=dev)
    full = torch.empty(t, e + 1 + kk, dtype=torch.int32, device=dev) if full_map else None
    # never hand a kernel an empty (possibly null) buffer: one spare row, cut off below
    src_idx = torch.full((max(n_out, 1),), -1, dtype=torch.int64, device=dev)
    if nb and e:
        _permute_assign_kernel[(nb,)](routing_map, ws, row_id_map, src_idx, full if full is not None else row_id_map,
                                      t, kk, e, nb, n_out, IS_MAP=is_map, FULL=full is not None, BLOCK_T=bt,
                                      BLOCK_E=be, num_warps=4)
    elif row_id_map.numel():
        row_id_map.fill_(-1)  # no experts: nothing is routed
    src_idx = src_idx if n_out else src_idx[:0]
    if full_map:
        if not (nb and e) and full.numel():
            full.fill_(-1)
            full[:, e + 1:] = e
        return row_id_map, src_idx, full
    return row_id_map, src_idx


def build_permute_map_launch(routing_map: torch.Tensor, num_experts: int, pad_multiple: Optional[int],
                             num_out_tokens: Optional[int], blocks: Optional[tuple] = None,
                             scan_max: int = SCAN_KERNEL_MAX):
    """Row map of ``moe_permute`` on device. ``routing_map``: contiguous bool ``[T, E]`` or int32/int64
    ``[T, k]`` (values outside ``[0, E)`` are treated as unrouted).

    Returns ``(row_id_map int32 [T, K], tokens_per_expert int64 [E], src_idx int64 [n_out], n_out)``:
    ``src_idx[o] = t * K + j`` of the pair in row ``o`` (``-1`` on padding / unfilled rows) and
    ``tokens_per_expert`` clipped to the buffer. ``num_out_tokens=None`` reads the padded total back
    to the host (one sync); otherwise nothing is read. ``blocks`` overrides ``permute_map_blocks``.
    (``moe_permute`` calls the two phases itself, so that its documented sync is made in the op.)"""
    routing_map = routing_map.contiguous()
    state = permute_map_scan_launch(routing_map, num_experts, pad_multiple, num_out_tokens, blocks, scan_max)
    n_out = int(state[0][-1]) if num_out_tokens is None else int(num_out_tokens)
    row_id_map, src_idx = permute_map_assign_launch(routing_map, num_experts, state, n_out)
    return row_id_map, state[1], src_idx, n_out
