"""FP8 (E4M3) FlashAttention forward in Triton, with block scaling per token block and head.

Two kernels:

* ``_quant_tokens_kernel``: quantizes a logical ``[batch, seq, heads, dim]`` tensor (any strides)
  to FP8 E4M3 with one fp32 scale per ``(batch, head, block of BLK tokens)`` (BLK = the config's
  ``block_size``, 128 by default). The scale is a **power of two**: ``scale = 2**floor(log2(448 /
  amax))`` (so the block's amax lands in ``(224, 448]``; E4M3's relative precision does not depend
  on the scale, and a power of two makes ``q.float() * scale_inv`` exact in bf16, which the
  backward relies on). ``amax = 0`` (or a non-finite amax) gives ``scale = 1``. Codes are rounded to
  nearest even and saturate at +-448. The FP8 copy is written in a layout chosen for the attention
  kernel (q, k: ``[B, H, S, D]``; v: ``[B, H, D, S]``, so both FP8 dots read K-major operands), the
  dequantization multipliers ``scale_inv`` as fp32 ``[B, H, ceil(S / BLK)]``.

* ``_attn_fp8_fwd_kernel``: the FA2-style forward of ``flash_attn_fwd.py`` (same masks, sink,
  bottom-right alignment, LSE) on those FP8 tensors:

  - ``S = (Q8 @ K8^T)`` is an FP8 ``tl.dot`` with fp32 accumulation; the per-row q scales and the
    per-column k scales (and ``softmax_scale * log2(e)``) are applied to the fp32 scores;
  - the online softmax runs in fp32; ``P = exp2(S - m)`` lies in ``[0, 1]`` and is quantized to E4M3
    with the **static scale 256** (a power of two: ``P * 256 <= 256 < 448``; FA3 also uses a static
    scale for P), for the FP8 dot ``P8 @ V8``; the result is multiplied by ``v_scale_inv / 256``
    (one v scale per key tile: ``BLOCK_N`` divides ``BLK``). The row sum ``l`` uses the fp32 ``P``.

The CPU interpreter's float -> fp8 / bf16 downcasts do not round to nearest even, so under it the
codes are formed with exact fp32 arithmetic (``quant_fp8_kernel._fp8_bits``), as the quantizers do.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, next_pow2, is_interpreter
from primus_turbo.triton.quantization.quant_fp8_kernel import _fp8_bits, _round_for_store

from .flash_attn_fwd import LOG2E, _kv_range, _running_max, _unmasked_kv_blocks, _visible, window_flags

__all__ = [
    "FP8_ATTN_P_SCALE", "FP8_ATTN_BLOCK_SIZES", "quantize_tokens_fp8", "dequantize_tokens_fp8",
    "flash_attn_fp8_fwd_triton",
]

E4M3_MAX = 448.0
#: the static scale of P (in [0, 1]) before its E4M3 cast
FP8_ATTN_P_SCALE = 256.0
#: the supported token-block sizes of the q/k/v scales
FP8_ATTN_BLOCK_SIZES = (32, 64, 128, 256)


@triton.jit
def _to_e4m3(y, SOFT: tl.constexpr):
    """fp32 (already within +-448) -> float8e4nv, round to nearest even."""
    if SOFT:
        return _fp8_bits(y, True, True).to(tl.float8e4nv, bitcast=True)
    else:
        return y.to(tl.float8e4nv)


@triton.jit
def _exp2_fma(x, DEG: tl.constexpr):
    """``2**x`` without MUFU.EX2, on the FMA pipe: ``x = j + f`` with ``j = round(x)``, ``|f| <= 1/2``
    (the 1.5 * 2**23 rounding trick), ``2**f`` by a minimax polynomial of degree DEG (max relative
    error 2: 1.7e-3, 3: 7.5e-5, 4: 2.7e-6, 5: 2e-7), ``j`` added into the exponent bits. ``x`` must be
    finite and below 128; it is clamped at -126 (then the result is tiny and >= 0, never 0).
    The Gluon FP8 forward (``flash_attn_fp8_fwd_gluon.py``) calls this function too: keep it to
    arithmetic, ``tl.maximum`` and bit casts, which compile in a Gluon caller as well."""
    x = tl.maximum(x, -126.0)
    r = x + 12582912.0  # the low mantissa bits of r hold round(x), two's complement
    f = x - (r - 12582912.0)
    if DEG == 2:
        p = (0.23842893540859222 * f + 0.7034479975700378) * f + 1.0004431009292603
    elif DEG == 3:
        p = ((0.0551716685295105 * f + 0.2426111251115799) * f + 0.6932609677314758) * f + 0.9999280571937561
    elif DEG == 4:
        p = (((0.009570102207362652 * f + 0.05591785907745361) * f + 0.240247443318367) * f
             + 0.6931217908859253) * f + 0.9999992847442627
    else:
        p = ((((0.0013276472454890609 * f + 0.009675540961325169) * f + 0.05550713092088699) * f
              + 0.24022120237350464) * f + 0.6931469440460205) * f + 1.0000001192092896
    # (r's bits << 23) keeps round(x) << 23 only: the magic constant's own bits shift out
    bits = p.to(tl.int32, bitcast=True) + (r.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _split_top(x):
    """[M, N] -> the halves of the top column bit (a register bit of a wgmma accumulator)."""
    BM: tl.constexpr = x.shape[0]
    BN: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, [BM, 2, BN // 2]), [0, 2, 1]))


@triton.jit
def _join_top(a, b):
    BM: tl.constexpr = a.shape[0]
    BN: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), [0, 2, 1]), [BM, 2 * BN])


@triton.jit
def _exp2_mixed(x, EMU: tl.constexpr, DEG: tl.constexpr):
    """``2**x`` with 1/EMU of the elements (EMU 0: none; 2, 4 or 8) on the FMA pipe (:func:`_exp2_fma`)
    and the rest on MUFU.EX2 (the hardware's 16 exponentials per clock and SM are, with FP8 MMAs, as
    slow as the MMAs). The split is over column bit 0 (a wgmma accumulator holds column pairs in
    one thread) and then the top column bits (registers too), so it moves no data."""
    if EMU == 0:
        return tl.exp2(x)
    else:
        BM: tl.constexpr = x.shape[0]
        BN: tl.constexpr = x.shape[1]
        a, b = tl.split(tl.reshape(x, [BM, BN // 2, 2]))
        a = tl.exp2(a)
        if EMU == 2:
            b = _exp2_fma(b, DEG)
        else:
            b0, b1 = _split_top(b)
            if EMU == 4:
                b1 = _exp2_fma(b1, DEG)
            else:
                b10, b11 = _split_top(b1)
                b1 = _join_top(tl.exp2(b10), _exp2_fma(b11, DEG))
            b = _join_top(tl.exp2(b0), b1)
        return tl.reshape(tl.join(a, b), [BM, BN])


@triton.jit
def _quant_tokens_kernel(
    X, Y, SCALE_INV,
    stride_xb, stride_xs, stride_xh, stride_xd,
    stride_yb, stride_ys, stride_yh, stride_yd,
    H, SEQ, D, NB,
    BLK: tl.constexpr, BLOCK_D: tl.constexpr, SOFT: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_s = pid_t * BLK + tl.arange(0, BLK)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_s[:, None] < SEQ) & (offs_d[None, :] < D)
    x = tl.load(
        X + b.to(tl.int64) * stride_xb + h * stride_xh + offs_s[:, None].to(tl.int64) * stride_xs
        + offs_d[None, :] * stride_xd,
        mask=mask, other=0.0,
    ).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), 1), 0)
    ok = (amax > 0.0) & (amax < float("inf"))
    r = 448.0 / tl.where(ok, amax, 1.0)
    # floor(log2(r)) from r's exponent field, clamped so that 2**e and 2**-e are normal fp32
    e = (r.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.where(ok, tl.minimum(tl.maximum(e, 1), 253), 127)
    scale = (e << 23).to(tl.float32, bitcast=True)
    scale_inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(x * scale, -448.0), 448.0)
    y = tl.where(x != x, x, y)  # NaN stays NaN
    code = _fp8_bits(y, True, SOFT)
    tl.store(
        Y + b.to(tl.int64) * stride_yb + h * stride_yh + offs_s[:, None].to(tl.int64) * stride_ys
        + offs_d[None, :] * stride_yd,
        code, mask=mask,
    )
    tl.store(SCALE_INV + pid_bh * NB + pid_t, scale_inv)


@triton.jit
def _attn_fp8_fwd_step(acc, m_i, l_i, q, q_scale, k_base, v_base, ks_base, vs_base, start_n, offs_m, offs_n0,
                       offs_dqk, offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seq_q, seq_k, off,
                       win_left, win_right, D_QK, D_V, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                       BLK: tl.constexpr, P_SCALE: tl.constexpr, SOFT: tl.constexpr, MASKED: tl.constexpr,
                       EVEN_D: tl.constexpr, P_LOG2: tl.constexpr, NEG_SCALE: tl.constexpr,
                       EXP_EMU: tl.constexpr = 0, EXP_DEG: tl.constexpr = 3):
    """One key block (see ``_attn_fwd_step``; ``MASKED=False``: whole, fully visible block).
    EXP_EMU / EXP_DEG: 1/EXP_EMU of the exponentials of a whole block on the FMA pipe
    (:func:`_exp2_mixed`); masked blocks (scores may be -inf) keep MUFU.EX2."""
    offs_n = start_n + offs_n0
    kt_ptrs = k_base + offs_n[None, :] * stride_ks + offs_dqk[:, None] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd
    if MASKED:
        kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < seq_k) & (offs_dqk[:, None] < D_QK), other=0.0)
    elif EVEN_D:
        kt = tl.load(kt_ptrs)
    else:
        kt = tl.load(kt_ptrs, mask=offs_dqk[:, None] < D_QK, other=0.0)
    # the tile lies in one k scale block (BLOCK_N divides BLK), so the score scale is per row:
    # rs = q_scale * k_scale (softmax_scale * log2(e) already in q_scale). The row extreme is taken
    # on the raw FP8 products and scaled once per row, so each score costs one FMA
    # (dot * rs - m) and the static P scale (2**P_LOG2) is folded into the exponent.
    rs = q_scale * tl.load(ks_base + start_n // BLK)
    d = tl.dot(q, kt)
    if MASKED:
        ok = _visible(offs_m, offs_n, seq_q, seq_k, off, win_left, win_right, HAS_LEFT, HAS_RIGHT)
        m_new, m_safe = _running_max(m_i, d, ok, rs, True, NEG_SCALE)
        ps = tl.where(ok, tl.exp2(d * rs[:, None] - (m_safe[:, None] - P_LOG2)), 0.0)
    else:
        m_new, m_safe = _running_max(m_i, d, d, rs, False, NEG_SCALE)
        # = P * P_SCALE, in [0, P_SCALE]
        ps = _exp2_mixed(d * rs[:, None] - (m_safe[:, None] - P_LOG2), EXP_EMU, EXP_DEG)
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(ps, 1) * (1.0 / P_SCALE)
    p8 = _to_e4m3(ps, SOFT)
    if MASKED:
        v = tl.load(v_ptrs, mask=(offs_n[:, None] < seq_k) & (offs_dv[None, :] < D_V), other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < D_V, other=0.0)
    v_scale = tl.load(vs_base + start_n // BLK)  # one v scale per key tile (BLOCK_N divides BLK)
    acc = acc * alpha[:, None] + tl.dot(p8, v) * (v_scale / P_SCALE)
    return acc, m_new, l_i


@triton.jit
def _attn_fp8_fwd_kernel(
    Q, K, V, QS, KS, VS, O, LSE, SINK,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    H, HK, SEQ_Q, SEQ_K, GROUP, D_QK, D_V, NBQ, NBK,
    qk_scale, offset, win_left, win_right,
    HAS_SINK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLK: tl.constexpr, P_SCALE: tl.constexpr, SOFT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, P_LOG2: tl.constexpr, NEG_SCALE: tl.constexpr,
    EXP_EMU: tl.constexpr = 0, EXP_DEG: tl.constexpr = 3,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    seq_q = SEQ_Q
    seq_k = SEQ_K
    off = offset

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < seq_q

    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
        mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
    )
    # per-row dequantization multiplier of q, with softmax_scale * log2(e) folded in
    q_scale = tl.load(QS + pid_bh * NBQ + offs_m // BLK, mask=m_ok, other=0.0) * qk_scale
    k_base = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk * stride_vh
    ks_base = KS + (b * HK + hk) * NBK
    vs_base = VS + (b * HK + hk) * NBK

    if HAS_SINK:
        sink_log2 = tl.load(SINK + h).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink_log2
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    m_start = pid_m * BLOCK_M
    lo, hi = _kv_range(m_start, off, win_left, win_right, seq_k, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    a, bb = _unmasked_kv_blocks(m_start, lo, hi, off, win_left, win_right, seq_k, HAS_LEFT, HAS_RIGHT,
                                BLOCK_M, BLOCK_N)
    for start_n in range(lo, a, BLOCK_N):
        acc, m_i, l_i = _attn_fp8_fwd_step(acc, m_i, l_i, q, q_scale, k_base, v_base, ks_base, vs_base, start_n,
                                           offs_m, offs_n0, offs_dqk, offs_dv, stride_ks, stride_kd, stride_vs,
                                           stride_vd, seq_q, seq_k, off, win_left, win_right, D_QK, D_V,
                                           HAS_LEFT, HAS_RIGHT, BLK, P_SCALE, SOFT, True, EVEN_D,
                                           P_LOG2, NEG_SCALE)
    for start_n in range(a, bb, BLOCK_N):
        acc, m_i, l_i = _attn_fp8_fwd_step(acc, m_i, l_i, q, q_scale, k_base, v_base, ks_base, vs_base, start_n,
                                           offs_m, offs_n0, offs_dqk, offs_dv, stride_ks, stride_kd, stride_vs,
                                           stride_vd, seq_q, seq_k, off, win_left, win_right, D_QK, D_V,
                                           HAS_LEFT, HAS_RIGHT, BLK, P_SCALE, SOFT, False, EVEN_D,
                                           P_LOG2, NEG_SCALE, EXP_EMU, EXP_DEG)
    for start_n in range(bb, hi, BLOCK_N):
        acc, m_i, l_i = _attn_fp8_fwd_step(acc, m_i, l_i, q, q_scale, k_base, v_base, ks_base, vs_base, start_n,
                                           offs_m, offs_n0, offs_dqk, offs_dv, stride_ks, stride_kd, stride_vs,
                                           stride_vd, seq_q, seq_k, off, win_left, win_right, D_QK, D_V,
                                           HAS_LEFT, HAS_RIGHT, BLK, P_SCALE, SOFT, True, EVEN_D,
                                           P_LOG2, NEG_SCALE)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) / 1.4426950408889634)
    o_ptrs = O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, _round_for_store(out, O, SOFT), mask=m_ok[:, None] & (offs_dv[None, :] < D_V))
    tl.store(LSE + pid_bh * SEQ_Q + offs_m, lse, mask=m_ok)


def _fp8_dims(d_qk: int, d_v: int) -> tuple[int, int]:
    """Head dims padded to powers of two, at least 32 (the K of an FP8 MMA on Hopper)."""
    return max(32, next_pow2(d_qk)), max(32, next_pow2(d_v))


#: sm_90 tiles per padded head dim (BLOCK_M, BLOCK_N, num_warps, num_stages); scripts/tune_attention.py --fp8
FP8_FWD_CONFIGS = {64: (64, 64, 4, 3), 128: (64, 128, 4, 3), 256: (128, 64, 8, 2)}
#: default ``exp_emu`` of :func:`flash_attn_fp8_fwd_triton` (0: every exponential on MUFU.EX2)
FP8_FWD_EXP_EMU = 0


def _fwd_config(d_max: int, blk: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N always divides the scale block ``blk``."""
    if is_interpreter():
        bm, bn, warps, stages = 32, 32, 4, 1
    else:
        bm, bn, warps, stages = next((c for d, c in sorted(FP8_FWD_CONFIGS.items()) if d_max <= d),
                                     FP8_FWD_CONFIGS[max(FP8_FWD_CONFIGS)])
    return bm, min(bn, blk), warps, stages


def quantize_tokens_fp8(x: torch.Tensor, blk: int, transpose_sd: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize logical ``[B, S, H, D]`` ``x`` (any strides) to E4M3 per ``(batch, head, BLK tokens)``.

    Returns ``(x8, scale_inv)``: ``x8`` stored ``[B, H, S, D]`` contiguous (``[B, H, D, S]`` with
    ``transpose_sd``), ``scale_inv`` fp32 ``[B, H, ceil(S / blk)]`` (powers of two): ``x ~= x8 * scale_inv``.
    """
    B, S, H, D = x.shape
    nb = cdiv(S, blk) if S > 0 else 0
    shape = (B, H, D, S) if transpose_sd else (B, H, S, D)
    x8 = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale_inv = torch.empty((B, H, nb), dtype=torch.float32, device=x.device)
    if x8.numel() == 0:
        scale_inv.fill_(1.0)
        return x8, scale_inv
    y_strides = x8.stride()
    if transpose_sd:  # logical (b, s, h, d) strides of a [B, H, D, S] buffer
        ys = (y_strides[0], y_strides[3], y_strides[1], y_strides[2])
    else:
        ys = (y_strides[0], y_strides[2], y_strides[1], y_strides[3])
    block_d = max(16, next_pow2(D))
    _quant_tokens_kernel[(nb, B * H)](
        x, x8.view(torch.uint8), scale_inv, *x.stride(), *ys, H, S, D, nb,
        BLK=blk, BLOCK_D=block_d, SOFT=is_interpreter(), num_warps=8 if blk * block_d >= 8192 else 4,
    )
    return x8, scale_inv


def dequantize_tokens_fp8(x8: torch.Tensor, scale_inv: torch.Tensor, blk: int, dtype: torch.dtype,
                          transpose_sd: bool = False) -> torch.Tensor:
    """Inverse of :func:`quantize_tokens_fp8`: a logical ``[B, S, H, D]`` view (of a bhsd buffer) in
    ``dtype`` (exact for bf16: the scales are powers of two)."""
    s = x8.size(3) if transpose_sd else x8.size(2)
    mult = scale_inv.repeat_interleave(blk, dim=-1)[..., :s]  # [B, H, S]
    if transpose_sd:
        x = (x8.float() * mult.unsqueeze(2)).to(dtype).transpose(2, 3)  # [B, H, S, D] view
    else:
        x = (x8.float() * mult.unsqueeze(3)).to(dtype)
    return x.transpose(1, 2)


def flash_attn_fp8_fwd_triton(
    q8: torch.Tensor, k8: torch.Tensor, v8t: torch.Tensor, q_scale_inv: torch.Tensor, k_scale_inv: torch.Tensor,
    v_scale_inv: torch.Tensor, blk: int, sink: Optional[torch.Tensor], softmax_scale: float,
    win_left: int = -1, win_right: int = -1, out_dtype: torch.dtype = torch.bfloat16,
    exp_emu: Optional[int] = None, exp_deg: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention forward on :func:`quantize_tokens_fp8` outputs: ``q8 [B, Hq, Sq, Dqk]``,
    ``k8 [B, Hk, Sk, Dqk]``, ``v8t [B, Hk, Dv, Sk]`` (E4M3) with their ``[B, H, ceil(S / blk)]`` fp32
    multipliers. Returns ``O [B, Sq, Hq, Dv]`` in ``out_dtype`` and ``LSE [B, Hq, Sq]`` fp32.

    ``exp_emu`` (opt-in, not yet timed; None: :data:`FP8_FWD_EXP_EMU`, 0): 2, 4 or 8 runs 1/exp_emu
    of the softmax exponentials of the whole key blocks on the FMA pipe (a degree-``exp_deg``
    polynomial, 2..5) instead of MUFU.EX2."""
    B, H, Sq, Dqk = q8.shape
    Hk, Dv, Sk = v8t.shape[1], v8t.shape[2], v8t.shape[3]
    out = torch.empty((B, Sq, H, Dv), dtype=out_dtype, device=q8.device)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q8.device)
    if B == 0 or Sq == 0 or H == 0:
        return out, lse
    exp_emu = FP8_FWD_EXP_EMU if exp_emu is None else int(exp_emu)
    if exp_emu not in (0, 2, 4, 8) or not 2 <= exp_deg <= 5:
        raise ValueError(f"exp_emu={exp_emu}, exp_deg={exp_deg}: expected exp_emu 0, 2, 4 or 8 and exp_deg 2..5")
    block_dqk, block_dv = _fp8_dims(Dqk, Dv)
    bm, bn, warps, stages = _fwd_config(max(block_dqk, block_dv), blk)
    has_left, has_right, wl, wr = window_flags(win_left, win_right)
    qs, ks, vs = q8.stride(), k8.stride(), v8t.stride()
    grid = (cdiv(Sq, bm), B * H)
    _attn_fp8_fwd_kernel[grid](
        q8, k8, v8t, q_scale_inv, k_scale_inv, v_scale_inv, out, lse, sink if sink is not None else lse,
        qs[0], qs[2], qs[1], qs[3],
        ks[0], ks[2], ks[1], ks[3],
        vs[0], vs[3], vs[1], vs[2],
        *out.stride(),
        H, Hk, Sq, Sk, H // Hk, Dqk, Dv, q_scale_inv.size(-1), k_scale_inv.size(-1),
        float(softmax_scale) * LOG2E, Sk - Sq, wl, wr,
        HAS_SINK=sink is not None, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        BLK=blk, P_SCALE=FP8_ATTN_P_SCALE, SOFT=is_interpreter(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv,
        EVEN_D=(Dqk == block_dqk and Dv == block_dv), P_LOG2=float(math.log2(FP8_ATTN_P_SCALE)),
        NEG_SCALE=softmax_scale < 0, EXP_EMU=exp_emu if bn >= 4 * exp_emu else 0, EXP_DEG=int(exp_deg),
        num_warps=warps, num_stages=stages,
    )
    return out, lse
