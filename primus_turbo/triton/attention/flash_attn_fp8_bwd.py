"""FP8 FlashAttention backward in Triton, on the FP8 tensors of the forward (flash_attn_fp8.py).

Same structure as flash_attn_bwd.py (two kernels, no atomics, deterministic): a dK/dV kernel that owns
a key block of one (batch, kv head) and loops over every query head of its GQA group and every query
block that sees it, and a dQ kernel that owns a query block and loops over key blocks. Causal /
sliding windows (bottom-right aligned) and GQA/MQA as in the bf16 kernels; the sink gradient is the
same small torch reduction.

Inputs: ``q8 [B, H, Sq, Dqk]``, ``k8 [B, Hk, Sk, Dqk]``, ``v8t [B, Hk, Dv, Sk]`` (E4M3, from the forward)
with their fp32 power-of-two multipliers per ``(batch, head, BLK tokens)``, and ``dO`` quantized here
by the same quantizer (E4M3, one power-of-two scale per ``(batch, head, BLK query tokens)``).

The four GEMMs are FP8 x FP8 ``tl.dot`` with fp32 accumulation; every operand tile lies inside one
scale block (``BLOCK_M`` and ``BLOCK_N`` divide ``BLK``), so each product is rescaled by scalars:

* ``S = Q8 K8^T * (q_s k_s softmax_scale)`` (recomputed exactly as the forward did), ``P = exp(S - LSE)``
  in fp32;
* ``dV += P8^T dO8 * (do_s / 256)``: P quantized to E4M3 at the forward's static scale 256;
* ``dP = dO8 V8^T * (do_s v_s)``;
* ``dS = P * (dP - delta)`` in fp32, ``delta_i = sum_d dO_i O_i`` (with the dequantized dO, so that
  ``delta`` matches the dP the kernel sees); dS is quantized to E4M3 per (BLOCK_M x BLOCK_N) tile with
  a dynamic power-of-two scale from the tile's amax (in registers), and
  ``dQ += dS8 K8 * (k_s / ds_s)``, ``dK += dS8^T Q8 * (q_s / ds_s)``.

The sink gradient ``-sum_i P_sink(i) delta_i`` is a torch reduction with ``delta`` from the unquantized
dO (it is a single sum per head, so dO's rounding would show there more than in dq/dk/dv).

Why E4M3 (not E5M2) for dO: with one scale per 128 tokens and head the range of a block is covered by
the scale; what limits accuracy is the mantissa (E4M3: 3 bits, E5M2: 2 bits, i.e. ~6 dB more error).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, is_interpreter
from primus_turbo.triton.quantization.quant_fp8_kernel import _round_for_store

from .flash_attn_fp8 import FP8_ATTN_P_SCALE, _fp8_dims, _to_e4m3, dequantize_tokens_fp8, quantize_tokens_fp8
from .flash_attn_fwd import LOG2E, _kv_range, _visible, window_flags

__all__ = ["flash_attn_fp8_bwd_triton"]


@triton.jit
def _pow2_tile_scale(amax):
    """(scale, scale_inv): the largest power of two with ``amax * scale <= 448`` (1 for 0 / non-finite)."""
    ok = (amax > 0.0) & (amax < float("inf"))
    r = 448.0 / tl.where(ok, amax, 1.0)
    e = (r.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.where(ok, tl.minimum(tl.maximum(e, 1), 253), 127)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quant_ds(ds, SOFT: tl.constexpr):
    """fp32 dS tile -> (E4M3 tile, its dequantization multiplier)."""
    amax = tl.max(tl.max(tl.abs(ds), 1), 0)
    scale, scale_inv = _pow2_tile_scale(amax)
    return _to_e4m3(ds * scale, SOFT), scale_inv


@triton.jit
def _attn_fp8_bwd_dkdv_kernel(
    Q, K, V, DO, QS, KS, VS, DOS, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vd, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    H, HK, SEQ_Q, SEQ_K, GROUP, D_QK, D_V, NBQ, NBK,
    qk_scale, sm_scale, offset, win_left, win_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLK: tl.constexpr, P_SCALE: tl.constexpr,
    SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK
    seq_q = SEQ_Q
    seq_k = SEQ_K
    off = offset

    n_start = pid_n * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < seq_k

    k = tl.load(
        K + b.to(tl.int64) * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_dqk[None, :] * stride_kd,
        mask=n_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
    )
    v = tl.load(  # [BLOCK_N, BLOCK_DV] from the [B, Hk, Dv, Sk] copy
        V + b.to(tl.int64) * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
        mask=n_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0,
    )
    k_scale = tl.load(KS + pid_bh * NBK + n_start // BLK)  # one k / v scale per key tile
    v_scale = tl.load(VS + pid_bh * NBK + n_start // BLK)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # query rows that can see keys n_start..n_start+BLOCK_N-1 (the transpose of the forward's range)
    lo = n_start * 0
    hi = n_start * 0 + seq_q
    if HAS_RIGHT:
        lo = tl.maximum(n_start - off - win_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(n_start + BLOCK_N - off + win_left, seq_q)

    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_base = Q + b.to(tl.int64) * stride_qb + h * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + h * stride_doh
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < seq_q
            q = tl.load(
                q_base + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
                mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
            )
            do = tl.load(
                do_base + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod,
                mask=m_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0,
            )
            q_scale = tl.load(QS + bh * NBQ + start_m // BLK)
            do_scale = tl.load(DOS + bh * NBQ + start_m // BLK)
            lse = tl.load(LSE + bh * seq_q + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + bh * seq_q + offs_m, mask=m_ok, other=0.0)
            st = tl.dot(k, tl.trans(q)) * (q_scale * qk_scale * k_scale)  # [BLOCK_N, BLOCK_M]
            ok = tl.trans(_visible(offs_m, offs_n, seq_q, seq_k, off, win_left, win_right, HAS_LEFT, HAS_RIGHT))
            pt = tl.where(ok, tl.exp2(st - lse[None, :]), 0.0)
            pt8 = _to_e4m3(pt * P_SCALE, SOFT)
            dv += tl.dot(pt8, do) * (do_scale / P_SCALE)
            dpt = tl.dot(v, tl.trans(do)) * (v_scale * do_scale)  # [BLOCK_N, BLOCK_M]
            dst = pt * (dpt - delta[None, :])
            dst8, ds_inv = _quant_ds(dst, SOFT)
            dk += tl.dot(dst8, q) * (ds_inv * q_scale)

    dk = dk * sm_scale
    tl.store(
        DK + b.to(tl.int64) * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks
        + offs_dqk[None, :] * stride_dkd,
        _round_for_store(dk, DK, SOFT), mask=n_ok[:, None] & (offs_dqk[None, :] < D_QK),
    )
    tl.store(
        DV + b.to(tl.int64) * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs
        + offs_dv[None, :] * stride_dvd,
        _round_for_store(dv, DV, SOFT), mask=n_ok[:, None] & (offs_dv[None, :] < D_V),
    )


@triton.jit
def _attn_fp8_bwd_dq_kernel(
    Q, K, V, DO, QS, KS, VS, DOS, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vd, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    H, HK, SEQ_Q, SEQ_K, GROUP, D_QK, D_V, NBQ, NBK,
    qk_scale, sm_scale, offset, win_left, win_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLK: tl.constexpr,
    SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    seq_q = SEQ_Q
    seq_k = SEQ_K
    off = offset

    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < seq_q

    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
        mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
    )
    do = tl.load(
        DO + b.to(tl.int64) * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos
        + offs_dv[None, :] * stride_dod,
        mask=m_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0,
    )
    q_scale = tl.load(QS + pid_bh * NBQ + m_start // BLK)
    do_scale = tl.load(DOS + pid_bh * NBQ + m_start // BLK)
    lse = tl.load(LSE + pid_bh * seq_q + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + pid_bh * seq_q + offs_m, mask=m_ok, other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk * stride_vh
    ks_base = KS + (b * HK + hk) * NBK
    vs_base = VS + (b * HK + hk) * NBK
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)

    lo, hi = _kv_range(m_start, off, win_left, win_right, seq_k, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < seq_k
        kt = tl.load(
            k_base + offs_n[None, :] * stride_ks + offs_dqk[:, None] * stride_kd,
            mask=n_ok[None, :] & (offs_dqk[:, None] < D_QK), other=0.0,
        )
        vt = tl.load(
            v_base + offs_n[None, :] * stride_vs + offs_dv[:, None] * stride_vd,
            mask=n_ok[None, :] & (offs_dv[:, None] < D_V), other=0.0,
        )
        k_scale = tl.load(ks_base + start_n // BLK)
        v_scale = tl.load(vs_base + start_n // BLK)
        s = tl.dot(q, kt) * (q_scale * qk_scale * k_scale)
        ok = _visible(offs_m, offs_n, seq_q, seq_k, off, win_left, win_right, HAS_LEFT, HAS_RIGHT)
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, vt) * (do_scale * v_scale)
        ds = p * (dp - delta[:, None])
        ds8, ds_inv = _quant_ds(ds, SOFT)
        dq += tl.dot(ds8, tl.trans(kt)) * (ds_inv * k_scale)

    dq = dq * sm_scale
    tl.store(
        DQ + b.to(tl.int64) * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs
        + offs_dqk[None, :] * stride_dqd,
        _round_for_store(dq, DQ, SOFT), mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK),
    )


def _bwd_config(d_max: int, blk: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); both tile sizes divide the scale block ``blk``."""
    if is_interpreter():
        bm, bn, warps, stages = 32, 32, 4, 1
    elif d_max <= 128:
        bm, bn, warps, stages = 64, 64, 4 if d_max <= 64 else 8, 2
    else:
        bm, bn, warps, stages = 32, 32, 4, 1
    return min(bm, blk), min(bn, blk), warps, stages


def flash_attn_fp8_bwd_triton(
    dout: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8t: torch.Tensor, q_scale_inv: torch.Tensor,
    k_scale_inv: torch.Tensor, v_scale_inv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    sink: Optional[torch.Tensor], softmax_scale: float, blk: int, win_left: int = -1, win_right: int = -1,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """FP8 gradients of :func:`flash_attn_fp8_fwd_triton`: ``(dq, dk, dv, dsink)``; dq/dk/dv logical
    ``[B, S, H, D]`` (bshd) in ``dtype``, dsink fp32 ``[Hq]`` or None. ``dout``: logical ``[B, Sq, Hq, Dv]``."""
    B, H, Sq, Dqk = q8.shape
    Hk, Dv, Sk = v8t.shape[1], v8t.shape[2], v8t.shape[3]
    dev = q8.device
    dq = torch.empty((B, Sq, H, Dqk), dtype=dtype, device=dev)
    dk = torch.empty((B, Sk, Hk, Dqk), dtype=dtype, device=dev)
    dv = torch.empty((B, Sk, Hk, Dv), dtype=dtype, device=dev)
    do8, do_scale_inv = quantize_tokens_fp8(dout, blk)
    # delta_i = rowsum(dO * O) in fp32 with the dequantized dO (the dO that the dP dot sees), [B, H, Sq]
    dod = dequantize_tokens_fp8(do8, do_scale_inv, blk, torch.float32)
    delta = (dod * out.float()).sum(-1).transpose(1, 2).contiguous()
    dsink = None
    if sink is not None:  # a plain fp32 reduction: with the unquantized dO (as the bf16 backward)
        delta_exact = (dout.float() * out.float()).sum(-1).transpose(1, 2)
        p_sink = torch.exp(sink.float().view(1, H, 1) - lse)  # 0 where LSE = +inf
        dsink = -(p_sink * delta_exact).sum(dim=(0, 2))
    if B == 0 or H == 0 or Sq == 0 or Sk == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return dq, dk, dv, dsink
    block_dqk, block_dv = _fp8_dims(Dqk, Dv)
    bm, bn, warps, stages = _bwd_config(max(block_dqk, block_dv), blk)
    has_left, has_right, wl, wr = window_flags(win_left, win_right)
    common = dict(
        HAS_LEFT=has_left, HAS_RIGHT=has_right, BLK=blk, SOFT=is_interpreter(), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_DQK=block_dqk, BLOCK_DV=block_dv, num_warps=warps, num_stages=stages,
    )
    args = (
        *q8.stride(), *k8.stride(), *v8t.stride(), *do8.stride(),
    )
    scalars = (H, Hk, Sq, Sk, H // Hk, Dqk, Dv, q_scale_inv.size(-1), k_scale_inv.size(-1),
               float(softmax_scale) * LOG2E, float(softmax_scale), Sk - Sq, wl, wr)
    lse = lse.contiguous()
    _attn_fp8_bwd_dkdv_kernel[(cdiv(Sk, bn), B * Hk)](
        q8, k8, v8t, do8, q_scale_inv, k_scale_inv, v_scale_inv, do_scale_inv, lse, delta, dk, dv,
        *args, *dk.stride(), *dv.stride(), *scalars, P_SCALE=FP8_ATTN_P_SCALE, **common,
    )
    _attn_fp8_bwd_dq_kernel[(cdiv(Sq, bm), B * H)](
        q8, k8, v8t, do8, q_scale_inv, k_scale_inv, v_scale_inv, do_scale_inv, lse, delta, dq,
        *args, *dq.stride(), *scalars, **common,
    )
    return dq, dk, dv, dsink
