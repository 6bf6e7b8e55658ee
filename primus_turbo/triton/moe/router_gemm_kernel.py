"""Router GEMM of an fp32 router over 16-bit tokens, in IEEE fp32 arithmetic, reading the tokens as they are.

A router kept in fp32 (Megatron's ``moe_router_dtype="fp32"``) is usually run as
``F.linear(x.float(), w)``: a converted fp32 copy of the tokens (2x their bytes written, then read
by the GEMM), and in the backward an fp32 ``dx`` converted back to the tokens' dtype. With only E
(8..256) output columns the GEMMs are small and SIMT-bound in cuBLAS as well; the copies cost about
as much again. These kernels read ``x`` in its own dtype and upcast in registers, with the products
and sums in fp32 FMA (``input_precision="ieee"``: no TF32, no bf16 split), so the result is the
fp32 GEMM of the upcast tokens up to summation order:

- ``logits [T, E] = x [T, H] @ w [E, H]^T``   (fp32 out)
- ``dx [T, H]     = dl [T, E] @ w [E, H]``      (stored in x's dtype: one rounding of the fp32 sum)
- ``dw [E, H]     = dl^T @ x``                   (fp32; T split over programs, partials summed in a
  fixed order by the caller: deterministic)
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["router_fwd_launch", "router_dx_launch", "router_dw_launch", "ROUTER_MAX_E"]

#: widest router the kernels take (one program holds all E columns); wider routers use torch
ROUTER_MAX_E = 256


@triton.jit
def _router_fwd_kernel(x_ptr, w_ptr, out_ptr, T, H, E, stride_x, stride_w, stride_o,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    ecols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    emask = ecols < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_base = w_ptr + ecols.to(tl.int64)[None, :] * stride_w
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < H
        x = tl.load(x_base + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_base + ks[:, None], mask=kmask[:, None] & emask[None, :], other=0.0)  # [BLOCK_K, BLOCK_E]
        acc = tl.dot(x, w, acc, input_precision="ieee")
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + ecols[None, :], acc,
             mask=rmask[:, None] & emask[None, :])


@triton.jit
def _router_dx_kernel(dl_ptr, w_ptr, dx_ptr, T, H, E, stride_dl, stride_w, stride_dx, n_tiles_h,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    pid_t = pid // n_tiles_h
    pid_h = pid % n_tiles_h
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    es = tl.arange(0, BLOCK_E)
    rmask = rows < T
    hmask = hs < H
    emask = es < E
    dl = tl.load(dl_ptr + rows.to(tl.int64)[:, None] * stride_dl + es[None, :],
                 mask=rmask[:, None] & emask[None, :], other=0.0)
    w = tl.load(w_ptr + es.to(tl.int64)[:, None] * stride_w + hs[None, :], mask=emask[:, None] & hmask[None, :],
                other=0.0)
    acc = tl.dot(dl, w, input_precision="ieee")
    tl.store(dx_ptr + rows.to(tl.int64)[:, None] * stride_dx + hs[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=rmask[:, None] & hmask[None, :])


@triton.jit
def _router_dw_kernel(dl_ptr, x_ptr, part_ptr, T, H, E, stride_dl, stride_x, rows_per_split, n_tiles_h,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr):
    """part[s, :, h-tile] = dl[rows of split s]^T @ x[rows of split s, h-tile] (fp32)."""
    pid = tl.program_id(0)
    split = pid // n_tiles_h
    pid_h = pid % n_tiles_h
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    es = tl.arange(0, BLOCK_E)
    hmask = hs < H
    emask = es < E
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    t_lo = split * rows_per_split
    for t0 in range(t_lo, t_lo + rows_per_split, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        rmask = (rows < T) & (rows < t_lo + rows_per_split)
        dlt = tl.load(dl_ptr + es[:, None] + rows.to(tl.int64)[None, :] * stride_dl,
                      mask=emask[:, None] & rmask[None, :], other=0.0)  # [BLOCK_E, BLOCK_T]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + hs[None, :],
                    mask=rmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(dlt, x, acc, input_precision="ieee")
    base = part_ptr + split.to(tl.int64) * E * H
    tl.store(base + es.to(tl.int64)[:, None] * H + hs[None, :], acc, mask=emask[:, None] & hmask[None, :])


def _block_e(e: int) -> int:
    return max(16, triton.next_power_of_2(e))


def router_fwd_launch(x, w, out, block_t: int = 64, block_k: int = 32, num_warps: int = 4):
    """``out [T, E] fp32 = x [T, H] (any float dtype, unit column stride) @ w [E, H]^T (fp32)``."""
    t, h = x.shape
    e = w.shape[0]
    if t == 0:
        return out
    _router_fwd_kernel[(triton.cdiv(t, block_t),)](
        x, w, out, t, h, e, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_E=_block_e(e), BLOCK_K=block_k, num_warps=num_warps)
    return out


def router_dx_launch(dl, w, dx, block_t: int = 64, block_h: int = 64, num_warps: int = 4):
    """``dx [T, H] (its own dtype) = dl [T, E] (fp32) @ w [E, H] (fp32)``, one rounding per element."""
    t, e = dl.shape
    h = w.shape[1]
    if t == 0 or h == 0:
        return dx
    n_th = triton.cdiv(h, block_h)
    _router_dx_kernel[(triton.cdiv(t, block_t) * n_th,)](
        dl, w, dx, t, h, e, dl.stride(0), w.stride(0), dx.stride(0), n_th,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_E=_block_e(e), num_warps=num_warps)
    return dx


def router_dw_launch(dl, x, part, rows_per_split: int, block_t: int = 64, block_h: int = 64, num_warps: int = 4):
    """``part [S, E, H] fp32``: split ``s`` holds ``dl[rows]^T @ x[rows]`` over its ``rows_per_split``
    rows (``S = ceil(T / rows_per_split)``, a multiple of ``block_t``); the caller sums over S."""
    t, e = dl.shape
    h = x.shape[1]
    s = part.shape[0]
    n_th = triton.cdiv(h, block_h)
    _router_dw_kernel[(s * n_th,)](
        dl, x, part, t, h, e, dl.stride(0), x.stride(0), rows_per_split, n_th,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_E=_block_e(e), num_warps=num_warps)
    return part
