"""Row-movement kernels behind ``turbo.ops.moe_permute`` / ``moe_unpermute``.

``gather_rows``:  ``out[o, :] = src[src_row[o], :] (* scale[o])``, zero rows where ``src_row[o] < 0``
(padding / unused rows). One program per block of ``BLOCK_R`` output rows; the column loop moves
16 bytes per lane per step. Without a scale the rows are moved as raw bits (the caller passes an
integer view), so FP8 data, NaNs and signed zeros are copied exactly.

``merge_rows``:  ``out[t, :] = sum_j w[t, j] * src[row_id_map[t, j], :]`` over the entries with
``row_id_map[t, j] >= 0``, accumulated in fp32 in ascending ``j`` order, then cast to ``out``'s
dtype. One program per block of ``BLOCK_T`` tokens.

The launchers take device tensors and never read them on the host.
"""

from __future__ import annotations

from typing import Optional

import os

import torch
import triton
import triton.language as tl

__all__ = ["gather_rows_launch", "merge_rows_launch", "col_block"]


@triton.jit
def _gather_rows_kernel(src_ptr, out_ptr, src_row_ptr, scale_ptr, n_out, H, stride_src, stride_out,
                        HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_out
    srow = tl.load(src_row_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    valid = srow >= 0
    srow = tl.where(valid, srow, 0)
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
def _merge_rows_kernel(src_ptr, out_ptr, map_ptr, w_ptr, T, K, H, stride_src, stride_out,
                       HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    map_base = map_ptr + toks.to(tl.int64) * K
    w_base = w_ptr + toks.to(tl.int64) * K
    out_base = out_ptr + toks.to(tl.int64)[:, None] * stride_out
    for c0 in range(0, H, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < H
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in range(0, K):
            r = tl.load(map_base + j, mask=tmask, other=-1).to(tl.int64)
            ok = r >= 0
            r = tl.where(ok, r, 0)
            x = tl.load(src_ptr + r[:, None] * stride_src + cols[None, :],
                        mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            if HAS_W:
                w = tl.load(w_base + j, mask=tmask & ok, other=0.0).to(tl.float32)
                x = x * w[:, None]
            acc += x
        tl.store(out_base + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def col_block(h: int, elem_bytes: int, num_warps: int = 4) -> int:
    """Columns per step: 16 bytes per lane over all lanes, capped at the (power-of-2) row width."""
    per_lane = max(1, 16 // elem_bytes)
    return max(16, min(triton.next_power_of_2(max(h, 1)), per_lane * 32 * num_warps))


def gather_rows_launch(src: torch.Tensor, out: torch.Tensor, src_row: torch.Tensor,
                       scale: Optional[torch.Tensor] = None, block_r: Optional[int] = None) -> torch.Tensor:
    """out[o] = src[src_row[o]] (* scale[o]); zero where src_row[o] < 0. 2-D, unit column stride."""
    n_out, h = out.shape
    if n_out == 0 or h == 0:
        return out
    num_warps = 4
    block_r = block_r or (32 if _interp() else 4)  # the interpreter pays per program
    bc = col_block(h, out.element_size(), num_warps)
    grid = (triton.cdiv(n_out, block_r),)
    if scale is not None and out.dtype == torch.bfloat16 and _interp():
        # the interpreter's fp32 -> bf16 cast truncates: store fp32, round (RNE) with torch
        tmp = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        gather_rows_launch(src, tmp, src_row, scale, block_r)
        out.copy_(tmp)
        return out
    _gather_rows_kernel[grid](
        src, out, src_row, scale if scale is not None else src_row, n_out, h, src.stride(0), out.stride(0),
        HAS_SCALE=scale is not None, BLOCK_R=block_r, BLOCK_C=bc, num_warps=num_warps)
    return out


def merge_rows_launch(src: torch.Tensor, out: torch.Tensor, row_id_map: torch.Tensor,
                      weights: Optional[torch.Tensor] = None, block_t: Optional[int] = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * src[row_id_map[t, j]] (fp32 accumulation). 2-D, unit column stride."""
    t, h = out.shape
    if t == 0 or h == 0:
        return out
    k = row_id_map.shape[1]
    num_warps = 4
    block_t = block_t or (32 if _interp() else 2)
    bc = col_block(h, src.element_size(), num_warps)  # 16-byte loads of src; fp32 accumulator
    grid = (triton.cdiv(t, block_t),)
    if out.dtype == torch.bfloat16 and _interp():
        # the interpreter's fp32 -> bf16 cast truncates: store fp32, round (RNE) with torch
        tmp = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        merge_rows_launch(src, tmp, row_id_map, weights, block_t)
        out.copy_(tmp)
        return out
    _merge_rows_kernel[grid](
        src, out, row_id_map, weights if weights is not None else row_id_map, t, k, h,
        src.stride(0), out.stride(0), HAS_W=weights is not None, BLOCK_T=block_t, BLOCK_C=bc,
        num_warps=num_warps)
    return out
