"""Router GEMM kernels: bf16 activations against an fp32 (or bf16) router weight, with fp32
logits, on bf16 tensor cores.

A high-precision router (Megatron's ``moe_router_dtype="fp32"``) computes ``logits = x @ W^T``
with bf16 ``x [T, H]`` and ``W [E, H]`` in fp32. The plain way casts ``x`` to fp32 (a full extra
read and write of the activations) and runs fp32 GEMMs on the CUDA cores, three times per step
(forward, grad_input, grad_weight): at GPT-OSS-20B shapes about 0.6 ms of a 16 ms MoE layer step
for a GEMM with N = 32.

Here each fp32 operand is split on the fly into three bf16 pieces, ``v = hi + mid + lo`` with
``hi = bf16(v)``, ``mid = bf16(v - hi)``, ``lo = bf16(v - hi - mid)``: the subtractions are exact
in fp32 and the three pieces carry 3 x 8 significant bits, so the sum is ``v`` exactly (short of
bf16 underflow below 2**-126, as fp32 itself). A bf16 x bf16 product is exact in fp32, so MMAs on
the pieces accumulated in fp32 form the fp32 GEMM while the kernels stream only the bf16
activations. A bf16 weight (Megatron keeps the router weight in the model's dtype) is its own
single piece.

* ``_router_fwd_kernel``: ``logits [T, E] (fp32) = x @ W^T (+ bias)``; three products per K block
  (one for a bf16 weight).
* ``_router_dx_kernel``: ``dx [T, H] (bf16) = g @ W`` with ``g = dlogits`` fp32: both operands are
  split; the six products whose pieces' bits reach fp32's 24 (hi.hi, hi.mid, mid.hi, hi.lo,
  mid.mid, lo.hi) are summed, the three dropped ones lie below 2**-32 relative (three products for
  a bf16 weight). Each program holds its ``[BT, E]`` slice of ``g`` (split once when E fits one
  step) and walks all of H.
* ``_router_dw_kernel``: per-split partials ``P[s] = g[rows of s]^T @ x[rows of s]`` (fp32,
  ``[S, E, H]``), computed as ``x^T @ g`` so the long H side is the MMA's M; the op layer sums
  them over ``s`` (a fixed-order, deterministic reduction: no atomics).

Accuracy. The tensor cores' fp32 accumulation truncates at every MMA step: chained over all of H
the forward drifted ~1e-5 relative (H200, H = 2880). Each kernel therefore forms the leading (hi)
product of every K block from zero and adds it to the running sum with a rounded fp32 add
(DeepGEMM's promotion, applied to FP8 there); the smaller terms chain. What remains is inside the
MMAs: 2-8e-6 relative for the logits at H = 2048-7168 against 0.6-1.1e-6 for cuBLAS fp32
(``scripts/diag_router_gemm.py``; smaller promotion blocks change nothing measurable).

Offsets into the ``[T, *]`` tensors are int64. Any T, H, E (masked edges); E up to any size
(tiled by ``BE`` in the forward and the weight gradient, looped in ``grad_input``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.gemm.gemm_kernel import _num_sms
from primus_turbo.triton.launch import launch
from primus_turbo.triton import cdiv, next_pow2

__all__ = ["router_fwd_launch", "router_dx_launch", "router_dw_launch"]


@triton.jit
def _split3(v):
    """fp32 -> (hi, mid, lo) bf16 with hi + mid + lo == v exactly (no underflow)."""
    # any rounding keeps the split exact: the GPU rounds to nearest even, the interpreter truncates
    hi = v.to(tl.bfloat16)
    r = v - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _router_fwd_kernel(x_ptr, w_ptr, b_ptr, out_ptr, T, H, E, stride_xt, stride_we, stride_ot,
                       HAS_BIAS: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                       PIECES: tl.constexpr = 3, IEEE: tl.constexpr = False):
    # expert tiles vary fastest: the programs sharing a token tile run together and read it once
    pid_e = tl.program_id(0)
    pid_t = tl.program_id(1)
    rt = pid_t * BT + tl.arange(0, BT)
    re = pid_e * BE + tl.arange(0, BE)
    rk = tl.arange(0, BK)
    mt = rt < T
    me = re < E
    x_rows = x_ptr + rt.to(tl.int64)[:, None] * stride_xt
    w_cols = w_ptr + re.to(tl.int64)[None, :] * stride_we
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    small = tl.zeros((BT, BE), dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + rk
        mk = kk < H
        x = tl.load(x_rows + kk[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=mk[:, None] & me[None, :], other=0.0).to(tl.float32)  # [BK, BE]
        if IEEE:  # fp32 FMA on the CUDA cores (diagnostics)
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            hi, mid, lo = _split3(w)
            # The tensor cores' fp32 accumulation truncates at every MMA step: chained over all
            # of H the leading term drifts by ~1e-5 relative (measured on the H200). So the hi
            # product of each K block starts from zero and joins the sum through a rounded fp32
            # add (the promotion DeepGEMM applies to FP8); the mid / lo terms chain.
            if PIECES >= 3:
                small = tl.dot(x, lo, small)
            if PIECES >= 2:
                small = tl.dot(x, mid, small)
            acc += tl.dot(x, hi)
    acc += small
    if HAS_BIAS:
        acc += tl.load(b_ptr + re, mask=me, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_ot + re[None, :], acc, mask=mt[:, None] & me[None, :])


@triton.jit
def _router_dx_kernel(g_ptr, w_ptr, dx_ptr, T, H, E, stride_gt, stride_we, stride_dt,
                      BT: tl.constexpr, BH: tl.constexpr, BE: tl.constexpr, ONE_STEP: tl.constexpr,
                      W_PIECES: tl.constexpr = 3):
    pid_t = tl.program_id(0)
    rt = pid_t * BT + tl.arange(0, BT)
    mt = rt < T
    rh = tl.arange(0, BH)
    re = tl.arange(0, BE)
    g_rows = g_ptr + rt.to(tl.int64)[:, None] * stride_gt
    dx_rows = dx_ptr + rt.to(tl.int64)[:, None] * stride_dt
    if ONE_STEP:
        # the common case (E <= BE): the program's [BT, E] gradient slice is split once
        g = tl.load(g_rows + re[None, :], mask=mt[:, None] & (re < E)[None, :], other=0.0)
        g_hi, g_mid, g_lo = _split3(g)
    for h0 in range(0, H, BH):
        hh = h0 + rh
        mh = hh < H
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        # E > BE: a runtime loop (one weight tile in flight per stage, not E / BE of them)
        for e0 in range(0, E if not ONE_STEP else 1, BE):
            ee = e0 + re
            me = ee < E
            if not ONE_STEP:
                g = tl.load(g_rows + ee[None, :], mask=mt[:, None] & me[None, :], other=0.0)
                g_hi, g_mid, g_lo = _split3(g)
            w = tl.load(w_ptr + ee.to(tl.int64)[:, None] * stride_we + hh[None, :], mask=me[:, None] & mh[None, :],
                        other=0.0).to(tl.float32)
            if W_PIECES == 3:
                w_hi, w_mid, w_lo = _split3(w)
                small = tl.dot(g_hi, w_lo)
                small = tl.dot(g_mid, w_mid, small)
                small = tl.dot(g_lo, w_hi, small)
                small = tl.dot(g_hi, w_mid, small)
                small = tl.dot(g_mid, w_hi, small)
            else:  # a bf16 weight is its own single piece
                w_hi = w.to(tl.bfloat16)
                small = tl.dot(g_lo, w_hi)
                small = tl.dot(g_mid, w_hi, small)
            # the leading product from zero, added with fp32 rounding (see the forward)
            acc += tl.dot(g_hi, w_hi) + small
        tl.store(dx_rows + hh[None, :], acc.to(tl.bfloat16), mask=mt[:, None] & mh[None, :])


@triton.jit
def _router_dw_kernel(x_ptr, g_ptr, p_ptr, T, H, E, rows_per_split, stride_xt, stride_gt, stride_ps, stride_pe,
                      BH: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr):
    pid_e = tl.program_id(0)  # fastest: the programs reading the same x tile run together
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    rh = pid_h * BH + tl.arange(0, BH)
    re = pid_e * BE + tl.arange(0, BE)
    mh = rh < H
    me = re < E
    rt = tl.arange(0, BT)
    t_begin = pid_s * rows_per_split
    t_end = tl.minimum(t_begin + rows_per_split, T)
    acc = tl.zeros((BH, BE), dtype=tl.float32)
    small = tl.zeros((BH, BE), dtype=tl.float32)
    for t0 in range(t_begin, t_end, BT):
        tt = t0 + rt
        mt = tt < t_end
        t64 = tt.to(tl.int64)
        x = tl.load(x_ptr + t64[:, None] * stride_xt + rh[None, :], mask=mt[:, None] & mh[None, :], other=0.0)
        g = tl.load(g_ptr + t64[:, None] * stride_gt + re[None, :], mask=mt[:, None] & me[None, :], other=0.0)
        g_hi, g_mid, g_lo = _split3(g)
        xt = tl.trans(x)  # [BH, BT]
        small = tl.dot(xt, g_lo, small)
        small = tl.dot(xt, g_mid, small)
        acc += tl.dot(xt, g_hi)  # per-block promotion of the leading term (see the forward)
    acc += small
    # P[s, e, h] = acc[h, e]
    ptrs = p_ptr + pid_s.to(tl.int64) * stride_ps + re.to(tl.int64)[None, :] * stride_pe + rh[:, None]
    tl.store(ptrs, acc, mask=mh[:, None] & me[None, :])


# Defaults from the H200 sweep (benchmarks/bench_router_gemm.py --sweep, device time, 2026-12-02):
# forward 128-token tiles at 8 warps (GPT-OSS-20B 41.8 us, DeepSeek-V3 with 256 experts 469 us
# against 43.9 / 900 us at 64 tokens and 4 warps), grad_input 128 x 128 tiles at 8 warps (65.3 /
# 978 us against 67.8 / 1590), weight gradient at four programs per SM and 8 warps (45.8 / 473 us
# against 52.0 / 498 at two per SM and 4 warps).
_DW_PROGS_PER_SM = 4


def _e_block(e: int, cap: int) -> int:
    return max(16, min(next_pow2(max(e, 1)), cap))


def router_fwd_launch(x: torch.Tensor, w: torch.Tensor, bias: "torch.Tensor | None" = None, *,
                      bt: int = 128, bk: int = 64, be: "int | None" = None, num_warps: int = 8,
                      num_stages: "int | None" = None, pieces: "int | None" = None, ieee: bool = False
                      ) -> torch.Tensor:
    """``x`` bf16 ``[T, H]`` (unit stride along H), ``w`` fp32 or bf16 ``[E, H]`` contiguous,
    ``bias`` ``[E]`` (fp32 or bf16) or None -> fp32 ``[T, E]``. Keywords override the tiling
    (tuning); ``pieces`` (diagnostics) defaults to 3 for an fp32 weight, 1 for a bf16 one (exact)."""
    t, h = x.shape
    e = w.shape[0]
    out = torch.empty((t, e), dtype=torch.float32, device=x.device)
    be = be or _e_block(e, 128)
    pieces = pieces or (1 if w.dtype == torch.bfloat16 else 3)
    # the fp32 weight tile dominates the stages' shared memory: fewer stages for wide E tiles (the
    # interpreter ignores num_stages)
    kw = dict(HAS_BIAS=bias is not None, BT=bt, BE=be, BK=bk, PIECES=pieces, IEEE=ieee, num_warps=num_warps,
              num_stages=num_stages or (3 if be * bk > 64 * 64 else 4))
    launch(_router_fwd_kernel, (cdiv(e, be), cdiv(t, bt)),
           (x, w, bias if bias is not None else w, out, t, h, e, x.stride(0), w.stride(0), out.stride(0)), kw,
           x.device)
    return out


def router_dx_launch(g: torch.Tensor, w: torch.Tensor, *, bt: int = 128, bh: int = 128,
                     num_warps: int = 8) -> torch.Tensor:
    """``g`` fp32 ``[T, E]`` contiguous, ``w`` fp32 or bf16 ``[E, H]`` contiguous -> ``g @ w``
    ``[T, H]`` in bf16 (the fp32 sum rounded to nearest even on the GPU; the interpreter truncates)."""
    t, e = g.shape
    h = w.shape[1]
    dx = torch.empty((t, h), dtype=torch.bfloat16, device=g.device)
    be = _e_block(e, 64)
    launch(_router_dx_kernel, (cdiv(t, bt),),
           (g, w, dx, t, h, e, g.stride(0), w.stride(0), dx.stride(0)),
           dict(BT=bt, BH=bh, BE=be, ONE_STEP=e <= be, W_PIECES=1 if w.dtype == torch.bfloat16 else 3,
                num_warps=num_warps), g.device)
    return dx


def router_dw_launch(x: torch.Tensor, g: torch.Tensor, *, bh: int = 128, bt: int = 64, num_warps: int = 8,
                     splits: "int | None" = None, progs_per_sm: int = _DW_PROGS_PER_SM) -> torch.Tensor:
    """``x`` bf16 ``[T, H]`` (unit stride along H), ``g`` fp32 ``[T, E]`` contiguous -> the fp32
    partials ``[S, E, H]`` of ``g^T @ x`` over S row splits (sum them over dim 0). ``splits``
    defaults to about ``progs_per_sm`` programs per SM on CUDA, 2 on the interpreter."""
    t, h = x.shape
    e = g.shape[1]
    be = _e_block(e, 64)
    tiles = cdiv(h, bh) * cdiv(e, be)
    row_tiles = max(1, cdiv(t, bt))
    if splits is None:
        if x.device.type == "cuda":
            idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
            splits = cdiv(progs_per_sm * _num_sms(idx), tiles)
        else:
            splits = 2
    splits = max(1, min(int(splits), row_tiles))
    rows_per_split = cdiv(row_tiles, splits) * bt
    splits = cdiv(max(t, 1), rows_per_split)
    part = torch.empty((splits, e, h), dtype=torch.float32, device=x.device)
    launch(_router_dw_kernel, (cdiv(e, be), cdiv(h, bh), splits),
           (x, g, part, t, h, e, rows_per_split, x.stride(0), g.stride(0), part.stride(0), part.stride(1)),
           dict(BH=bh, BE=be, BT=bt, num_warps=num_warps), x.device)
    return part
