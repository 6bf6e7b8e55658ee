"""RMSNorm forward / backward kernels (optionally with the pre-norm residual add fused in).

Every kernel works on a row-major 2-D view ``x[rows, H]`` (the op layer flattens leading dims and
makes the last dim contiguous). Math is fp32 whatever the storage dtype.

* ``_rmsnorm_fwd_kernel``: one program per tile of ``BLOCK_R`` whole rows. ``s = x (+ residual)``
  (with a residual, ``s`` is rounded to the storage dtype and written: the tensor the next residual
  branch adds to, and the one normalized), ``rstd = 1 / sqrt(mean(s^2) + eps)``,
  ``y = s * rstd * w`` with ``w = gamma`` or ``1 + gamma`` (zero-centered). ``rstd`` (fp32, one per
  row) is saved for the backward. Each tensor is read once and written once.
* ``_rmsnorm_bwd_kernel``: a grid of at most a few programs per SM, each walking a contiguous run
  of row tiles: ``dx = rstd * (dy*w - s * rstd^2 * mean(dy*w*s))`` (``+ ds``, the gradient of the
  residual-sum output, when fused), and the program's **partial** ``dgamma`` (fp32, summed over its
  rows in registers) written to row ``pid`` of a ``[n_programs, H]`` buffer; the op layer reduces
  that buffer over dim 0 (a fixed-order, deterministic reduction: no atomics).

Rows wider than ``MAX_ROW_BLOCK`` (16384) do not fit one program's registers: the kernels then
loop over ``NUM_CHUNKS`` column chunks of ``BLOCK_H`` (two passes over the row: the sum of squares
/ the dot product first, then the outputs; the second pass mostly hits L2).

Vector accesses: rows are contiguous and the column offsets come from ``tl.arange``, so Triton
emits 16-byte loads/stores whenever the row stride is a multiple of 16 elements (its integer
arguments are specialized on divisibility by 16); other widths still run, with narrower accesses.
Offsets are int64 (``rows * stride`` can exceed 2**31). Block sizes: :func:`rmsnorm_config`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from primus_turbo.triton import cdiv, next_pow2

__all__ = ["MAX_ROW_BLOCK", "rmsnorm_config", "rmsnorm_fwd_launch", "rmsnorm_bwd_launch"]

#: the widest row one program holds in registers; wider rows are processed in chunks
MAX_ROW_BLOCK = 16384
_CHUNK = 4096  # column chunk of the long-row path
_TARGET_TILE = 8192  # elements per program (16 KiB of bf16 in flight per tensor)


def rmsnorm_config(rows: int, h: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_H, NUM_CHUNKS, num_warps) for a ``[rows, h]`` problem.

    Heuristic: a whole row per program when ``h <= MAX_ROW_BLOCK`` (BLOCK_H = next power of two of
    h, one chunk), else chunks of 4096 columns. Short rows are stacked so a program covers ~8192
    elements (BLOCK_R = 8192 // BLOCK_H, never more rows than the tensor has): enough bytes in flight
    per SM to cover HBM latency while keeping one program's registers small. Warps: 4 up to 2048
    elements, 8 up to 8192, 16 above (at most 32 fp32 values of one tensor per thread).
    """
    if h <= MAX_ROW_BLOCK:
        block_h, chunks = next_pow2(max(h, 1)), 1
    else:
        block_h, chunks = _CHUNK, cdiv(h, _CHUNK)
    block_r = max(1, min(_TARGET_TILE // block_h, next_pow2(max(rows, 1))))
    n = block_r * block_h
    num_warps = 4 if n <= 2048 else (8 if n <= 8192 else 16)
    return block_r, block_h, chunks, num_warps


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_BWD_PROGS_PER_SM = 4


def _bwd_programs(n_tiles: int, device: torch.device, per_sm: "int | None" = None) -> int:
    """Programs of the backward grid: a few per SM on CUDA (each keeps one dgamma partial), 4 on
    the CPU interpreter (which runs programs one after another anyway)."""
    if device.type == "cuda":
        per_sm = per_sm or _BWD_PROGS_PER_SM
        cap = per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        cap = 4
    return max(1, min(n_tiles, cap))


@triton.jit
def _rmsnorm_fwd_kernel(X, RES, G, Y, S, RSTD, n_rows, H, eps,
                        stride_x, stride_r, stride_y, stride_s,
                        HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = tl.arange(0, BLOCK_H)
    if NUM_CHUNKS == 1:
        cmask = cols < H
        m = rmask[:, None] & cmask[None, :]
        s = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(RES + rows[:, None] * stride_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
            s_st = (s + r).to(S.dtype.element_ty)
            tl.store(S + rows[:, None] * stride_s + cols[None, :], s_st, mask=m)
            s = s_st.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(s * s, axis=1) / H + eps)
        w = tl.load(G + cols, mask=cmask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        y = s * rstd[:, None] * w[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=m)
        tl.store(RSTD + rows, rstd, mask=rmask)
    else:
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_H + cols
            m = rmask[:, None] & (cc < H)[None, :]
            s = tl.load(X + rows[:, None] * stride_x + cc[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(RES + rows[:, None] * stride_r + cc[None, :], mask=m, other=0.0).to(tl.float32)
                s_st = (s + r).to(S.dtype.element_ty)
                tl.store(S + rows[:, None] * stride_s + cc[None, :], s_st, mask=m)
                s = s_st.to(tl.float32)
            acc += tl.sum(s * s, axis=1)
        rstd = 1.0 / tl.sqrt_rn(acc / H + eps)
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_H + cols
            cmask = cc < H
            m = rmask[:, None] & cmask[None, :]
            s = tl.load(X + rows[:, None] * stride_x + cc[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_RES:  # recompute the rounded sum (bit-identical to what the first pass wrote)
                r = tl.load(RES + rows[:, None] * stride_r + cc[None, :], mask=m, other=0.0).to(tl.float32)
                s = (s + r).to(S.dtype.element_ty).to(tl.float32)
            w = tl.load(G + cc, mask=cmask, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                w = w + 1.0
            y = s * rstd[:, None] * w[None, :]
            tl.store(Y + rows[:, None] * stride_y + cc[None, :], y.to(Y.dtype.element_ty), mask=m)
        tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _rmsnorm_bwd_kernel(DY, X, G, RSTD, DS, DX, DG, n_rows, H, tiles_per_prog,
                        stride_dy, stride_x, stride_ds, stride_dx,
                        HAS_DS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    dg_row = DG + pid.to(tl.int64) * H
    if NUM_CHUNKS == 1:
        cmask = cols < H
        w = tl.load(G + cols, mask=cmask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        dg = tl.zeros([BLOCK_H], dtype=tl.float32)
        for t in range(tiles_per_prog):
            tile = pid.to(tl.int64) * tiles_per_prog + t
            rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
            rmask = rows < n_rows
            m = rmask[:, None] & cmask[None, :]
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            xhat = x * rstd[:, None]
            dyw = dy * w[None, :]
            c = tl.sum(dyw * xhat, axis=1) / H
            dx = rstd[:, None] * (dyw - xhat * c[:, None])
            if HAS_DS:
                dx += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=m)
            dg += tl.sum(dy * xhat, axis=0)
        tl.store(dg_row + cols, dg, mask=cmask)
    else:
        for t in range(tiles_per_prog):
            tile = pid.to(tl.int64) * tiles_per_prog + t
            rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
            rmask = rows < n_rows
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for ch in range(NUM_CHUNKS):
                cc = ch * BLOCK_H + cols
                cmask = cc < H
                m = rmask[:, None] & cmask[None, :]
                w = tl.load(G + cc, mask=cmask, other=0.0).to(tl.float32)
                if ZERO_CENTERED:
                    w = w + 1.0
                dy = tl.load(DY + rows[:, None] * stride_dy + cc[None, :], mask=m, other=0.0).to(tl.float32)
                x = tl.load(X + rows[:, None] * stride_x + cc[None, :], mask=m, other=0.0).to(tl.float32)
                acc += tl.sum(dy * w[None, :] * x, axis=1)
            c = acc * rstd / H
            for ch in range(NUM_CHUNKS):
                cc = ch * BLOCK_H + cols
                cmask = cc < H
                m = rmask[:, None] & cmask[None, :]
                w = tl.load(G + cc, mask=cmask, other=0.0).to(tl.float32)
                if ZERO_CENTERED:
                    w = w + 1.0
                dy = tl.load(DY + rows[:, None] * stride_dy + cc[None, :], mask=m, other=0.0).to(tl.float32)
                x = tl.load(X + rows[:, None] * stride_x + cc[None, :], mask=m, other=0.0).to(tl.float32)
                xhat = x * rstd[:, None]
                dx = rstd[:, None] * (dy * w[None, :] - xhat * c[:, None])
                if HAS_DS:
                    dx += tl.load(DS + rows[:, None] * stride_ds + cc[None, :], mask=m, other=0.0).to(tl.float32)
                tl.store(DX + rows[:, None] * stride_dx + cc[None, :], dx.to(DX.dtype.element_ty), mask=m)
                # this program owns row pid of the partial buffer (zero-initialized); the barriers
                # order the read-modify-write of one chunk across the program's threads
                contrib = tl.sum(dy * xhat, axis=0)
                tl.debug_barrier()
                part = tl.load(dg_row + cc, mask=cmask, other=0.0)
                tl.store(dg_row + cc, part + contrib, mask=cmask)
                tl.debug_barrier()


def rmsnorm_fwd_launch(x: torch.Tensor, gamma: torch.Tensor, eps: float, zero_centered: bool,
                       residual: "torch.Tensor | None" = None):
    """``x``/``residual``: contiguous ``[rows, H]``. Returns ``(y, s, rstd)``; ``s`` (the rounded
    ``x + residual``) is None without a residual; ``rstd`` is fp32 ``[rows]``."""
    rows, h = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    s = torch.empty_like(x) if residual is not None else None
    br, bh, chunks, warps = rmsnorm_config(rows, h)
    grid = (cdiv(rows, br),)
    _rmsnorm_fwd_kernel[grid](
        x, residual if residual is not None else x, gamma, y, s if s is not None else y, rstd, rows, h, float(eps),
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), s.stride(0) if s is not None else 0,
        HAS_RES=residual is not None, ZERO_CENTERED=bool(zero_centered),
        BLOCK_R=br, BLOCK_H=bh, NUM_CHUNKS=chunks, num_warps=warps,
    )
    return y, s, rstd


def rmsnorm_bwd_launch(dy: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor,
                       zero_centered: bool, ds: "torch.Tensor | None" = None, *,
                       block_r: "int | None" = None, num_warps: "int | None" = None,
                       progs_per_sm: "int | None" = None):
    """``dy``, ``x`` (the normalized input ``s``), ``ds``: contiguous ``[rows, H]``. Returns
    ``(dx, dgamma_partial)`` with ``dgamma_partial`` fp32 ``[n_programs, H]`` (sum it over dim 0).
    ``block_r``, ``num_warps``, ``progs_per_sm`` override the heuristics (for tuning)."""
    rows, h = x.shape
    dx = torch.empty_like(x)
    br, bh, chunks, warps = rmsnorm_config(rows, h)
    if chunks == 1 and x.device.type == "cuda":
        # measured on the H200 (scripts/tune_memory_bound.py, [16384, 4096] and [16384, 7168]):
        # the backward, which reads two tensors and keeps a dgamma partial per program, runs
        # best with ~16K-element tiles, 16 warps and 2 programs per SM (0.76-0.82x copy
        # bandwidth vs 0.63x with the forward's 8K tiles, 8 warps, 4 programs per SM)
        br = max(1, min(2 * _TARGET_TILE // bh, next_pow2(max(rows, 1))))
        warps = 16 if br * bh >= 2 * _TARGET_TILE else warps
        progs_per_sm = progs_per_sm or 2
    br, warps = block_r or br, num_warps or warps
    n_tiles = cdiv(rows, br)
    n_prog = _bwd_programs(n_tiles, x.device, progs_per_sm)
    per = cdiv(n_tiles, n_prog)
    n_prog = cdiv(n_tiles, per)
    alloc = torch.empty if chunks == 1 else torch.zeros
    dg = alloc((n_prog, h), dtype=torch.float32, device=x.device)
    _rmsnorm_bwd_kernel[(n_prog,)](
        dy, x, gamma, rstd, ds if ds is not None else dy, dx, dg, rows, h, per,
        dy.stride(0), x.stride(0), ds.stride(0) if ds is not None else 0, dx.stride(0),
        HAS_DS=ds is not None, ZERO_CENTERED=bool(zero_centered),
        BLOCK_R=br, BLOCK_H=bh, NUM_CHUNKS=chunks, num_warps=warps,
    )
    return dx, dg
