"""``quantize_fp8_with_trans`` (BLOCKWISE 1x128 / 128x1, MX 1x32 / 32x1, E4M3) for bf16 input
read as bf16 *pairs* (int32 words: element ``2p`` in the low half, ``2p + 1`` in the high one).

Same data flow as ``_quant_fp8_dual_kernel`` / ``_quant_fp8_dual_staged_kernel`` of
quant_fp8_kernel.py (four row-interleaved quarters ``x[4i + k, :]``, the column copy's codes of
rows 4i..4i+3 meet in one thread and form one int32 word, words transposed and stored as rows of
the transposed copy), with the per-element work cut down:

* block amaxes on pairs: ``max.NaN.xorsign.abs.bf16x2`` (two elements per instruction; the
  bf16 bit patterns of |x| order like the values, NaN above inf), the two halves folded with one
  ``max(u, u << 16)`` per word before the cross-thread reduction;
* the codes of 16 elements (two pairs of each of the four quarters: 4 columns x 4 rows) by one
  straight-line PTX sequence (``tl.inline_asm_elementwise``): widen (``shl`` / ``and``), one
  ``mul.rn.f32`` per element and copy, ``cvt.rn.satfinite.e4m3x2.f32`` (two codes per
  instruction) and ``mov.b32 {h, h}`` to pack the four row-wise words and four column-wise words.

Exactness: the instruction sequence is the one the tl kernels compile to (fp32 product rounded
once, then the saturating RNE conversion; NaN -> 0x7F), only issued two codes at a time, so the
outputs equal the tl kernels' and quant_ref's bit for bit. ``emulate_codes`` is a numpy model of
the sequence (the CPU test runs it over every bf16 pattern against the reference); the
interpreter (``SOFT``) runs the same data flow with the soft FP8 conversion of quant_fp8_kernel.py.

MX forms its E8M0 scales (a few integer ops) where the reduced amaxes live; BLOCKWISE its fp32
scales either the same way ("inreg", the default: every thread divides for the blocks it holds)
or once per block through a per-program scratch (as the staged kernel; its reads back and
barriers measured slower on the H200, 0.787 against 0.80x the device copy).

A persistent form (programs looping over tiles, x through TMA in a ``num_stages`` loop so the
next tiles' loads are in flight while one computes) measured 0.41-0.56x the device copy on the
H200 against this kernel's 0.77-0.81 (benchmarks/results/h200/NOTES.md, thirteenth session) and
was removed.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, is_interpreter
from primus_turbo.triton.launch import launch

from .quant_fp8_kernel import (
    _block_scales,
    _fp8_codes,
    _fp32_scales,
    _tile_pid,
    fp8_max_of,
    mx_emax_of,
)

__all__ = ["fp8_packed_ok", "fp8_packed_with_trans_launch", "emulate_codes", "CODES_PTX"]


def _codes_ptx() -> str:
    """PTX: inputs p0_k (pair 2w of quarter k), p1_k (pair 2w + 1), mr_k (row multiplier of
    quarter k's row, fp32 bits), mc_j (column multiplier of column 4w + j); outputs the row words
    of quarters 0..3 (bytes: columns 4w..4w+3) and the column words of columns 4w..4w+3 (bytes:
    rows 4i..4i+3). Operand numbering: outputs $0..$7, p0_k $8+k, p1_k $12+k, mr_k $16+k,
    mc_j $20+j."""
    lines = ["{", ".reg .b32 l<16>;", ".reg .f32 t<4>;", ".reg .b16 h<2>;"]
    for k in range(4):
        p0, p1 = f"${8 + k}", f"${12 + k}"
        lines += [f"shl.b32 l{4 * k}, {p0}, 16;", f"and.b32 l{4 * k + 1}, {p0}, -65536;",
                  f"shl.b32 l{4 * k + 2}, {p1}, 16;", f"and.b32 l{4 * k + 3}, {p1}, -65536;"]
    for k in range(4):  # row word of quarter k: elements j = 0..3 (little-endian byte j)
        m = f"${16 + k}"
        lines += [f"mul.rn.f32 t{j}, l{4 * k + j}, {m};" for j in range(4)]
        lines += ["cvt.rn.satfinite.e4m3x2.f32 h0, t1, t0;", "cvt.rn.satfinite.e4m3x2.f32 h1, t3, t2;",
                  f"mov.b32 ${k}, {{h0, h1}};"]
    for j in range(4):  # column word of column 4w + j: byte k = quarter k
        m = f"${20 + j}"
        lines += [f"mul.rn.f32 t{k}, l{4 * k + j}, {m};" for k in range(4)]
        lines += ["cvt.rn.satfinite.e4m3x2.f32 h0, t1, t0;", "cvt.rn.satfinite.e4m3x2.f32 h1, t3, t2;",
                  f"mov.b32 ${4 + j}, {{h0, h1}};"]
    lines.append("}")
    return "\n".join(lines)


CODES_PTX = _codes_ptx()
_CODES_PTX = tl.constexpr(CODES_PTX)
_MAXABS_PTX = tl.constexpr("{ .reg .b32 t; max.NaN.xorsign.abs.bf16x2 t, $1, $2; and.b32 $0, t, 0x7FFF7FFF; }")
# without the sign clearing: for operands of a further max.abs (which ignores their signs)
_MAXABS_RAW_PTX = tl.constexpr("max.NaN.xorsign.abs.bf16x2 $0, $1, $2;")


# ----------------------------------------------------------------------------------------------
# numpy model of the code sequence (E4M3): widen, fp32 product (RNE), satfinite RNE to E4M3
# ----------------------------------------------------------------------------------------------
def _e4m3_satfinite(y: np.ndarray) -> np.ndarray:
    """fp32 -> E4M3 code as cvt.rn.satfinite does: RNE, |y| > 448 -> 448, NaN -> 0x7F."""
    y = y.astype(np.float64)
    nan = np.isnan(y)
    a = np.minimum(np.abs(np.where(nan, 0.0, y)), 448.0)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(e, -6.0)
    ulp = np.exp2(e - 3)
    r = np.rint(a / ulp) * ulp  # ties to even; exact (a is an fp32 value)
    re = np.floor(np.log2(np.where(r > 0, r, 1.0)))
    normal = r >= 2.0 ** -6
    code_n = ((re + 7).astype(np.int64) << 3) | (np.rint(r / np.exp2(re - 3)).astype(np.int64) & 7)
    code_s = np.rint(r * 512.0).astype(np.int64)
    code = np.where(normal, code_n, code_s)
    code = code | np.where(np.signbit(y), 0x80, 0)
    return np.where(nan, 0x7F, code).astype(np.uint8)


def emulate_codes(pairs0, pairs1, mr, mc):
    """numpy model of CODES_PTX on uint32 arrays (lists of 4 each: p0_k, p1_k, mr_k, mc_j as fp32
    bits). Returns (row words [4], column words [4]) as uint32 arrays."""
    lanes = []
    for k in range(4):
        p0, p1 = (np.asarray(v, dtype=np.uint32) for v in (pairs0[k], pairs1[k]))
        lanes.append([(p0 << 16), p0 & 0xFFFF0000, (p1 << 16), p1 & 0xFFFF0000])
    f = [[(v.astype(np.uint32)).view(np.float32) for v in row] for row in lanes]
    mrf = [np.asarray(m, dtype=np.uint32).view(np.float32) for m in mr]
    mcf = [np.asarray(m, dtype=np.uint32).view(np.float32) for m in mc]

    def word(vals):
        out = np.zeros(vals[0].shape, dtype=np.uint32)
        for b, v in enumerate(vals):
            out |= _e4m3_satfinite(v).astype(np.uint32) << (8 * b)
        return out

    with np.errstate(all="ignore"):
        rows = [word([f[k][j] * mrf[k] for j in range(4)]) for k in range(4)]  # fp32 products (RNE)
        cols = [word([f[k][j] * mcf[j] for k in range(4)]) for j in range(4)]
    return rows, cols


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _load4(base, stride, mask, EVEN: tl.constexpr):
    """The rows at base, base + stride, base + 2 stride, base + 3 stride (zeros outside mask
    unless EVEN)."""
    if EVEN:
        return tl.load(base), tl.load(base + stride), tl.load(base + 2 * stride), tl.load(base + 3 * stride)
    else:
        return (tl.load(base, mask=mask, other=0), tl.load(base + stride, mask=mask, other=0),
                tl.load(base + 2 * stride, mask=mask, other=0), tl.load(base + 3 * stride, mask=mask, other=0))


@triton.jit
def _maxabs2(a, b, SOFT: tl.constexpr):
    """Per half max(|a|, |b|) of two bf16 pairs as bits (sign cleared, NaN above inf)."""
    if SOFT:
        lo = tl.maximum(a & 0x7FFF, b & 0x7FFF)
        hi = tl.maximum((a >> 16) & 0x7FFF, (b >> 16) & 0x7FFF)
        return lo | (hi << 16)
    else:
        return tl.inline_asm_elementwise(_MAXABS_PTX, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _maxabs2_raw(a, b, SOFT: tl.constexpr):
    """_maxabs2 whose sign bits are unspecified (only for operands of a further _maxabs2)."""
    if SOFT:
        return _maxabs2(a, b, SOFT)
    else:
        return tl.inline_asm_elementwise(_MAXABS_RAW_PTX, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _soft_word(y0, y1, y2, y3):
    b0 = _fp8_codes(y0, 448.0, True, True).to(tl.uint32)
    b1 = _fp8_codes(y1, 448.0, True, True).to(tl.uint32)
    b2 = _fp8_codes(y2, 448.0, True, True).to(tl.uint32)
    b3 = _fp8_codes(y3, 448.0, True, True).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.int32, bitcast=True)


@triton.jit
def _codes(a0, a1, a2, a3, b0, b1, b2, b3, r0, r1, r2, r3, c0, c1, c2, c3, SOFT: tl.constexpr):
    """Row words (quarters 0..3) and column words (columns 4w + j) of the pairs a_k (2w), b_k (2w + 1)."""
    if SOFT:
        l00, l01 = (a0 << 16).to(tl.float32, bitcast=True), (a0 & -65536).to(tl.float32, bitcast=True)
        l02, l03 = (b0 << 16).to(tl.float32, bitcast=True), (b0 & -65536).to(tl.float32, bitcast=True)
        l10, l11 = (a1 << 16).to(tl.float32, bitcast=True), (a1 & -65536).to(tl.float32, bitcast=True)
        l12, l13 = (b1 << 16).to(tl.float32, bitcast=True), (b1 & -65536).to(tl.float32, bitcast=True)
        l20, l21 = (a2 << 16).to(tl.float32, bitcast=True), (a2 & -65536).to(tl.float32, bitcast=True)
        l22, l23 = (b2 << 16).to(tl.float32, bitcast=True), (b2 & -65536).to(tl.float32, bitcast=True)
        l30, l31 = (a3 << 16).to(tl.float32, bitcast=True), (a3 & -65536).to(tl.float32, bitcast=True)
        l32, l33 = (b3 << 16).to(tl.float32, bitcast=True), (b3 & -65536).to(tl.float32, bitcast=True)
        m0, m1 = r0.to(tl.float32, bitcast=True), r1.to(tl.float32, bitcast=True)
        m2, m3 = r2.to(tl.float32, bitcast=True), r3.to(tl.float32, bitcast=True)
        n0, n1 = c0.to(tl.float32, bitcast=True), c1.to(tl.float32, bitcast=True)
        n2, n3 = c2.to(tl.float32, bitcast=True), c3.to(tl.float32, bitcast=True)
        w0 = _soft_word(l00 * m0, l01 * m0, l02 * m0, l03 * m0)
        w1 = _soft_word(l10 * m1, l11 * m1, l12 * m1, l13 * m1)
        w2 = _soft_word(l20 * m2, l21 * m2, l22 * m2, l23 * m2)
        w3 = _soft_word(l30 * m3, l31 * m3, l32 * m3, l33 * m3)
        v0 = _soft_word(l00 * n0, l10 * n0, l20 * n0, l30 * n0)
        v1 = _soft_word(l01 * n1, l11 * n1, l21 * n1, l31 * n1)
        v2 = _soft_word(l02 * n2, l12 * n2, l22 * n2, l32 * n2)
        v3 = _soft_word(l03 * n3, l13 * n3, l23 * n3, l33 * n3)
        return w0, w1, w2, w3, v0, v1, v2, v3
    else:
        return tl.inline_asm_elementwise(
            _CODES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [a0, a1, a2, a3, b0, b1, b2, b3, r0, r1, r2, r3, c0, c1, c2, c3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1)


@triton.jit
def _fold(u):
    """Top 16 bits: max of the two halves (both have the sign bit cleared)."""
    return tl.maximum(u, u << 16)


@triton.jit
def _store_row_words_v2(q_ptr, w0, w1, w2, w3, r0, wc0, nb, qb, nr, wb, rows, n_pairs, stride_q, QB: tl.constexpr,
                        WB: tl.constexpr, EVEN: tl.constexpr):
    """Row-wise words w_k [NB, QB, NR, WB] (rows r0 + 4 (nb QB + qb) + k, words wc0 + nr WB + wb) stored
    from their own layout (2 words per thread, blocks and quads over the lanes after the words):
    the tensors are viewed as [NR, QB, NB, WB] (a free permutation) and the offsets declared
    contiguous in runs of 2 only, so the compiler's store layout (4 words per thread for fully
    contiguous offsets, lanes over the leading axes first) is theirs and no shared-memory
    conversion comes before the (8-byte) stores."""
    r_row = r0 + 4 * (nb[None, None, :, None] * QB + qb[None, :, None, None])  # [1, QB, NB, 1]
    wcol = wc0 + nr[:, None, None, None] * WB + wb[None, None, None, :]   # [NR, 1, 1, WB]
    # (the hint on the last op of the offsets: on a foldable one it is lost)
    qp = q_ptr + tl.max_contiguous(r_row.to(tl.int64) * stride_q + wcol, [1, 1, 1, 2])  # [NR, QB, NB, WB]
    if EVEN:
        qmask = None
    else:
        qmask = (r_row < rows) & (wcol < n_pairs // 2)
    tl.store(qp, tl.permute(w0, (2, 1, 0, 3)), mask=qmask)
    tl.store(qp + stride_q, tl.permute(w1, (2, 1, 0, 3)), mask=qmask)
    tl.store(qp + 2 * stride_q, tl.permute(w2, (2, 1, 0, 3)), mask=qmask)
    tl.store(qp + 3 * stride_q, tl.permute(w3, (2, 1, 0, 3)), mask=qmask)


@triton.jit
def _store_col_words_v3(qt_ptr, u0, u1, u2, u3, i0, c0, rows, n_pairs, stride_qt, NB: tl.constexpr,
                        QB: tl.constexpr, NR: tl.constexpr, WB: tl.constexpr, EVEN: tl.constexpr):
    """Column words u_j [NB, QB, NR, WB] (quads i0 + nb QB + qb, columns c0 + 4 (nr WB + wb) + j)
    stored straight from their registers (4-byte stores, no shared-memory transpose). With TC =
    128 and 4 warps their layout holds 2 words per thread, lanes over WB / 2 words, the NR blocks
    and 2 quads, warps over 4 quads: viewed as [WB / 2, NR, 2, 4, QB / 8, NB, 2] (lanes, warps,
    registers) with offsets declared non-contiguous, that is the compiler's own store layout."""
    WL: tl.constexpr = WB // 2
    QR: tl.constexpr = QB // 8
    wl = tl.arange(0, WL)[:, None, None, None, None, None, None]
    nr = tl.arange(0, NR)[None, :, None, None, None, None, None]
    ql = tl.arange(0, 2)[None, None, :, None, None, None, None]
    qw = tl.arange(0, 4)[None, None, None, :, None, None, None]
    qr = tl.arange(0, QR)[None, None, None, None, :, None, None]
    nb = tl.arange(0, NB)[None, None, None, None, None, :, None]
    wr = tl.arange(0, 2)[None, None, None, None, None, None, :]
    q = i0 + nb * QB + qr * 8 + qw * 2 + ql                                 # quad (word of qt)
    c = c0 + 4 * (nr * WB + 2 * wl + wr)                                    # column of j = 0
    ofs = c.to(tl.int64) * stride_qt + q
    mask = None if EVEN else (c < 2 * n_pairs) & (q < rows // 4)
    _store_col_word_v3(qt_ptr, ofs, u0, mask, NB, QR, NR, WL)
    _store_col_word_v3(qt_ptr, ofs + stride_qt, u1, mask, NB, QR, NR, WL)
    _store_col_word_v3(qt_ptr, ofs + 2 * stride_qt, u2, mask, NB, QR, NR, WL)
    _store_col_word_v3(qt_ptr, ofs + 3 * stride_qt, u3, mask, NB, QR, NR, WL)


@triton.jit
def _store_col_word_v3(qt_ptr, ofs, u, mask, NB: tl.constexpr, QR: tl.constexpr, NR: tl.constexpr,
                       WL: tl.constexpr):
    # [NB, QB, NR, WB] -> [NB, QR, 4, 2, NR, WL, 2] -> [WL, NR, 2, 4, QR, NB, 2]
    v = tl.permute(tl.reshape(u, (NB, QR, 4, 2, NR, WL, 2)), (5, 4, 3, 2, 1, 0, 6))
    # (the hint on the pointers: on a foldable offset op it is lost)
    tl.store(tl.max_contiguous(qt_ptr + ofs, [1, 1, 1, 1, 1, 1, 1]), v, mask=mask)


@triton.jit
def _store_scales_t(s_ptr, st_ptr, sr0, sr1, sr2, sr3, sc0, sc1, sc2, sc3, pid_r, pid_c, li, s_col, r_row, cc, sbb,
                    smask, stmask, stride_s, stride_st, MODE: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
                    EVEN: tl.constexpr):
    """The scales of one tile into the transposed stores: row-wise ``[cols / G, rows]`` (row scale
    of row r, block b at ``b * stride_s + r``), column-wise ``[rows / G, cols]`` (``sb * stride_st +
    c``); the strides in the pointers' elements, the indices and masks the kernel's. MX: the four
    bytes of rows 4i..4i+3 (columns 4w..4w+3) as one little-endian word (``s_ptr`` / ``st_ptr``
    int32 views; rows and cols are multiples of 4); fp32: the four scales as one 16-byte vector."""
    if MODE == 1:
        wr = sr0 | (sr1 << 8) | (sr2 << 16) | (sr3 << 24)
        tl.store(s_ptr + s_col.to(tl.int64) * stride_s + pid_r * (TR // 4) + li, wr, mask=smask)
        wc = sc0 | (sc1 << 8) | (sc2 << 16) | (sc3 << 24)
        tl.store(st_ptr + sbb.to(tl.int64) * stride_st + cc // 4, wc, mask=stmask)
    else:
        # the four fp32 scales of rows 4i..4i+3 (columns 4w..4w+3) as one 16-byte vector
        k4 = tl.reshape(tl.arange(0, 4), (2, 2))
        sp = (s_ptr + s_col.to(tl.int64) * stride_s + r_row)[:, :, :, None, None] + k4
        sv = tl.join(tl.join(sr0, sr2), tl.join(sr1, sr3))  # [..., a, b] = sr(2a + b)
        tl.store(sp, sv, mask=None if EVEN else smask[:, :, :, None, None])
        stp = (st_ptr + sbb.to(tl.int64) * stride_st + cc)[:, :, :, None, None] + k4
        sw = tl.join(tl.join(sc0, sc2), tl.join(sc1, sc3))
        tl.store(stp, sw, mask=None if EVEN else stmask[:, :, :, None, None])


@triton.jit
def _quant_fp8_packed_dual_kernel(
    # pointers: x as int32 pairs; row-wise words + scales; transposed words + scales; scratch (BLOCKWISE)
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, scr_ptr,
    rows, n_pairs, n_tiles_c,
    # row strides: x (pairs), q (words), s, qt (words: rows / 4), st
    stride_x, stride_q, stride_s, stride_qt, stride_st,
    MODE: tl.constexpr, FP8_MAX: tl.constexpr, EMAX: tl.constexpr, G: tl.constexpr,
    TR: tl.constexpr, TC: tl.constexpr, EVEN: tl.constexpr, SOFT: tl.constexpr, V2: tl.constexpr = False,
    V3: tl.constexpr = False, INREG: tl.constexpr = False, DIAG: tl.constexpr = 0, TS: tl.constexpr = False,
):
    """Both copies for 1 x G row blocks and G x 1 column blocks (MODE 0: fp32 scales, MODE 1: MX).

    INREG (MODE 0): the fp32 scales formed where the reduced amaxes live, each thread dividing for
    the blocks it holds, instead of once per block through the per-program scratch (whose reads
    back in the amaxes' layouts and barriers cost more than the divisions at 4 warps / 168
    registers). DIAG (timing only, scripts/diag_quant_stages.py): bit 1 leaves the MX / INREG
    scale stores out, bit 2 the column-wise copy, bit 4 the row-wise copy."""
    pid = tl.program_id(0)
    pid_r, pid_c = _tile_pid(n_tiles_c)
    TQ: tl.constexpr = TR // 4
    TP: tl.constexpr = TC // 2
    NB: tl.constexpr = TR // G      # column blocks per tile column
    QB: tl.constexpr = G // 4       # quads per column block
    NR: tl.constexpr = TC // G      # row blocks per tile row
    WB: tl.constexpr = G // 4       # words per row block
    i = pid_r * TQ + tl.arange(0, TQ)
    pc = pid_c * TP + tl.arange(0, TP)
    base = x_ptr + (4 * i).to(tl.int64)[:, None] * stride_x + pc[None, :]
    v0, v1, v2, v3 = _load4(base, stride_x, None if EVEN else (i < rows // 4)[:, None] & (pc < n_pairs)[None, :],
                            EVEN)
    a0, b0 = tl.split(tl.reshape(v0, (NB, QB, NR, WB, 2)))
    a1, b1 = tl.split(tl.reshape(v1, (NB, QB, NR, WB, 2)))
    a2, b2 = tl.split(tl.reshape(v2, (NB, QB, NR, WB, 2)))
    a3, b3 = tl.split(tl.reshape(v3, (NB, QB, NR, WB, 2)))
    # row amaxes [NB, QB, NR] (fp32 bits of the block's largest |x|)
    ar0 = tl.max(_fold(_maxabs2(a0, b0, SOFT)), axis=3) & -65536
    ar1 = tl.max(_fold(_maxabs2(a1, b1, SOFT)), axis=3) & -65536
    ar2 = tl.max(_fold(_maxabs2(a2, b2, SOFT)), axis=3) & -65536
    ar3 = tl.max(_fold(_maxabs2(a3, b3, SOFT)), axis=3) & -65536
    # column amaxes [NB, NR, WB] of columns 4w + j
    ua = _maxabs2(_maxabs2_raw(a0, a1, SOFT), _maxabs2_raw(a2, a3, SOFT), SOFT)
    ub = _maxabs2(_maxabs2_raw(b0, b1, SOFT), _maxabs2_raw(b2, b3, SOFT), SOFT)
    ac0 = tl.max(ua << 16, axis=1)
    ac1 = tl.max(ua & -65536, axis=1)
    ac2 = tl.max(ub << 16, axis=1)
    ac3 = tl.max(ub & -65536, axis=1)
    nb = tl.arange(0, NB)
    qb = tl.arange(0, QB)
    nr = tl.arange(0, NR)
    wb = tl.arange(0, WB)
    li = nb[:, None, None] * QB + qb[None, :, None]                  # [NB, QB, 1] local quad
    lcol = (nr[:, None] * WB + wb[None, :]) * 4                      # [NR, WB] local column of j = 0
    sb = pid_r * NB + nb                                             # column-block index
    if MODE == 1 or INREG:
        # MX: E8M0 bytes; INREG: fp32 scales where the reduced amaxes live (no scratch round trip)
        mr0, sr0 = _block_scales(ar0, MODE, FP8_MAX, EMAX)
        mr1, sr1 = _block_scales(ar1, MODE, FP8_MAX, EMAX)
        mr2, sr2 = _block_scales(ar2, MODE, FP8_MAX, EMAX)
        mr3, sr3 = _block_scales(ar3, MODE, FP8_MAX, EMAX)
        mc0, sc0 = _block_scales(ac0, MODE, FP8_MAX, EMAX)
        mc1, sc1 = _block_scales(ac1, MODE, FP8_MAX, EMAX)
        mc2, sc2 = _block_scales(ac2, MODE, FP8_MAX, EMAX)
        mc3, sc3 = _block_scales(ac3, MODE, FP8_MAX, EMAX)
        # the tile's scale indices: rows 4i + k, row blocks (s_col), columns 4w + j, column blocks (sbb)
        r_row = pid_r * TR + 4 * li                                  # [NB, QB, 1]
        s_col = pid_c * NR + nr[None, None, :]                       # [1, 1, NR]
        cc = pid_c * TC + lcol[None, :, :]                           # [1, NR, WB]
        sbb = sb[:, None, None]                                      # [NB, 1, 1]
        if EVEN:
            smask = None
            stmask = None
        else:
            smask = (r_row < rows) & (s_col < (2 * n_pairs + G - 1) // G)
            stmask = (cc < 2 * n_pairs) & (sbb < (rows + G - 1) // G)
        if DIAG & 1:  # timing only (scripts/diag_quant_stages.py): no scale stores
            smask = (r_row < 0) & (s_col < 0)
            stmask = (cc < 0) & (sbb < 0)
        if TS:
            # scales stored transposed (row-wise [cols / G, rows], column-wise [rows / G, cols]; the
            # launcher returns the transposed views): a tile's scales fill whole 32-byte sectors
            _store_scales_t(s_ptr, st_ptr, sr0, sr1, sr2, sr3, sc0, sc1, sc2, sc3, pid_r, pid_c, li, s_col, r_row,
                            cc, sbb, smask, stmask, stride_s, stride_st, MODE, TR, TC, EVEN)
        else:
            # scales: row-wise [rows, cols / G], column-wise [cols, rows / G]
            sdt = s_ptr.dtype.element_ty
            sp = s_ptr + r_row.to(tl.int64) * stride_s + s_col
            tl.store(sp, sr0.to(sdt), mask=smask)
            tl.store(sp + stride_s, sr1.to(sdt), mask=smask)
            tl.store(sp + 2 * stride_s, sr2.to(sdt), mask=smask)
            tl.store(sp + 3 * stride_s, sr3.to(sdt), mask=smask)
            stp = st_ptr + cc.to(tl.int64) * stride_st + sbb
            tl.store(stp, sc0.to(sdt), mask=stmask)
            tl.store(stp + stride_st, sc1.to(sdt), mask=stmask)
            tl.store(stp + 2 * stride_st, sc2.to(sdt), mask=stmask)
            tl.store(stp + 3 * stride_st, sc3.to(sdt), mask=stmask)
        r0 = mr0.to(tl.int32, bitcast=True)
        r1 = mr1.to(tl.int32, bitcast=True)
        r2 = mr2.to(tl.int32, bitcast=True)
        r3 = mr3.to(tl.int32, bitcast=True)
        c0 = mc0.to(tl.int32, bitcast=True)
        c1 = mc1.to(tl.int32, bitcast=True)
        c2 = mc2.to(tl.int32, bitcast=True)
        c3 = mc3.to(tl.int32, bitcast=True)
    else:
        # fp32 scales once per block: amaxes staged in a per-program scratch (row blocks at
        # [k, local quad, block], column blocks after them at [column block, local column])
        NS_R: tl.constexpr = 4 * TQ * NR
        NS_C: tl.constexpr = NB * TC
        scr = scr_ptr + pid.to(tl.int64) * (NS_R + NS_C)
        ridx = li * NR + nr[None, None, :]                           # [NB, QB, NR]
        tl.store(scr + ridx, ar0)
        tl.store(scr + TQ * NR + ridx, ar1)
        tl.store(scr + 2 * TQ * NR + ridx, ar2)
        tl.store(scr + 3 * TQ * NR + ridx, ar3)
        cidx = NS_R + nb[:, None, None] * TC + lcol[None, :, :]      # [NB, NR, WB]
        tl.store(scr + cidx, ac0)
        tl.store(scr + cidx + 1, ac1)
        tl.store(scr + cidx + 2, ac2)
        tl.store(scr + cidx + 3, ac3)
        tl.debug_barrier()
        e = tl.arange(0, NS_R + NS_C)
        m_all, inv_all = _fp32_scales(tl.load(scr + e), FP8_MAX)
        tl.debug_barrier()  # every amax read before a multiplier overwrites it
        tl.store(scr + e, m_all.to(tl.int32, bitcast=True))
        # scale_inv outputs
        er = e % NS_R
        kq = er // (TQ * NR)
        lq = (er // NR) % TQ
        sr = pid_r * TR + 4 * lq + kq
        scn = pid_c * NR + er % NR
        is_r = e < NS_R
        ec = tl.maximum(e - NS_R, 0)
        sbc = pid_r * NB + ec // TC
        ccol = pid_c * TC + ec % TC
        if EVEN:
            tl.store(s_ptr + sr.to(tl.int64) * stride_s + scn, inv_all, mask=is_r)
            tl.store(st_ptr + ccol.to(tl.int64) * stride_st + sbc, inv_all, mask=e >= NS_R)
        else:
            tl.store(s_ptr + sr.to(tl.int64) * stride_s + scn, inv_all,
                     mask=is_r & (sr < rows) & (scn < (2 * n_pairs + G - 1) // G))
            tl.store(st_ptr + ccol.to(tl.int64) * stride_st + sbc, inv_all,
                     mask=(e >= NS_R) & (ccol < 2 * n_pairs) & (sbc < (rows + G - 1) // G))
        tl.debug_barrier()
        # multipliers back, indexed from the amax tensors' own layouts (no layout conversion)
        r0 = tl.load(scr + ((ar0 & 0) + ridx))
        r1 = tl.load(scr + ((ar1 & 0) + TQ * NR + ridx))
        r2 = tl.load(scr + ((ar2 & 0) + 2 * TQ * NR + ridx))
        r3 = tl.load(scr + ((ar3 & 0) + 3 * TQ * NR + ridx))
        c0 = tl.load(scr + ((ac0 & 0) + cidx))
        c1 = tl.load(scr + ((ac1 & 0) + cidx + 1))
        c2 = tl.load(scr + ((ac2 & 0) + cidx + 2))
        c3 = tl.load(scr + ((ac3 & 0) + cidx + 3))
    r0 = r0[:, :, :, None]
    r1 = r1[:, :, :, None]
    r2 = r2[:, :, :, None]
    r3 = r3[:, :, :, None]
    c0 = c0[:, None, :, :]
    c1 = c1[:, None, :, :]
    c2 = c2[:, None, :, :]
    c3 = c3[:, None, :, :]
    w0, w1, w2, w3, u0, u1, u2, u3 = _codes(a0, a1, a2, a3, b0, b1, b2, b3, r0, r1, r2, r3, c0, c1, c2, c3, SOFT)
    # row-wise words: q viewed as int32 [rows, cols / 4]
    if DIAG & 4:  # timing only: no row-wise copy
        pass
    elif V2:
        _store_row_words_v2(q_ptr, w0, w1, w2, w3, pid_r * TR, pid_c * (TC // 4), nb, qb, nr, wb, rows, n_pairs,
                            stride_q, QB, WB, EVEN)
    else:
        r_row = (pid_r * TR + 4 * li)[:, :, :, None]                       # [NB, QB, 1, 1]
        wcol = pid_c * (TC // 4) + (nr[:, None] * WB + wb[None, :])[None, None, :, :]  # [1, 1, NR, WB]
        qp = q_ptr + r_row.to(tl.int64) * stride_q + wcol
        if EVEN:
            qmask = None
        else:
            qmask = (r_row < rows) & (wcol < n_pairs // 2)
        tl.store(qp, w0, mask=qmask)
        tl.store(qp + stride_q, w1, mask=qmask)
        tl.store(qp + 2 * stride_q, w2, mask=qmask)
        tl.store(qp + 3 * stride_q, w3, mask=qmask)
    # column-wise words: [NB, QB, NR, WB, 4] (column 4w + j) -> [TQ, TC] -> transposed rows
    if DIAG & 2:  # timing only: no column-wise copy
        pass
    elif V3:
        _store_col_words_v3(qt_ptr, u0, u1, u2, u3, pid_r * TQ, pid_c * TC, rows, n_pairs, stride_qt, NB, QB, NR,
                            WB, EVEN)
    else:
        _store_col_words(qt_ptr, u0, u1, u2, u3, i, pid_c, rows, n_pairs, stride_qt, TQ, TC, EVEN)


@triton.jit
def _store_col_words(qt_ptr, u0, u1, u2, u3, i, pid_c, rows, n_pairs, stride_qt, TQ: tl.constexpr,
                     TC: tl.constexpr, EVEN: tl.constexpr):
    """Column words u_j [NB, QB, NR, WB] (column 4w + j of quads i) as rows of the transposed copy
    (a shared-memory transpose to 4 consecutive quads per thread, 16-byte stores)."""
    u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (TQ, TC))
    ut = tl.trans(u)
    c = pid_c * TC + tl.arange(0, TC)
    if EVEN:
        tl.store(qt_ptr + c.to(tl.int64)[:, None] * stride_qt + i[None, :], ut)
    else:
        tl.store(qt_ptr + c.to(tl.int64)[:, None] * stride_qt + i[None, :], ut,
                 mask=(c < 2 * n_pairs)[:, None] & (i < rows // 4)[None, :])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------
def fp8_packed_ok(x: torch.Tensor, out_dtype, row, col, cfg) -> bool:
    """Whether the pair kernel covers x with groupings row (1 x g) / col (g x 1) and tile cfg:
    bf16, E4M3, 2-D with unit column stride, 4-byte aligned rows, g in (32, 128) (MX: 32),
    cols % 4 == 0, rows % 4 == 0, TR and TC multiples of g."""
    if x.dtype != torch.bfloat16 or out_dtype != torch.float8_e4m3fn or x.dim() != 2 or x.numel() == 0:
        return False
    if row.mode != col.mode or row.mode not in (0, 1) or row.gr != 1 or col.gc != 1 or row.gc != col.gr:
        return False
    g = row.gc
    if g not in (32, 64, 128) or (row.mode == 1 and g != 32):
        return False
    rows, cols = x.shape
    tr, tc = cfg[0], cfg[1]
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4 or cols % 4 or rows % 4:
        return False
    if len(cfg) > 3 and cfg[3] == "packed3" and tc != 128:
        return False  # its column-word store is written for the layout of 128-column tiles
    return tr % g == 0 and tc % g == 0


def fp8_packed_with_trans_launch(x: torch.Tensor, out_dtype, row, col, cfg) -> tuple:
    """``(q, s, qt, st)`` of ``quantize_fp8_with_trans`` (see :func:`fp8_packed_ok`).
    ``cfg`` = (TR, TC, num_warps, "packed" | "packed2" | "packed3"[, maxnreg[, options]]); "packed2":
    the row-wise words stored from their own layout (V2); "packed3" (TC = 128 only): also the column
    words, 4-byte stores without the shared-memory transpose (V3); options, comma-separated:
    "inreg" (BLOCKWISE scales in registers, INREG), "tscale" (MX, or BLOCKWISE with "inreg": the
    scales stored transposed, ``[cols / g, rows]`` and ``[rows / g, cols]``, and returned as their
    transposed views, so a tile writes them as whole sectors; TS), "diag<mask>" (timing only, DIAG)."""
    rows, cols = x.shape
    tr, tc, nw = cfg[:3]
    maxnreg = cfg[4] if len(cfg) > 4 else 0
    extra = {"maxnreg": maxnreg} if maxnreg and not is_interpreter() else {}
    g = row.gc
    dev = x.device
    xp = x.view(torch.int32) if x.is_contiguous() else x.contiguous().view(torch.int32)
    q = torch.empty((rows, cols), dtype=out_dtype, device=dev)
    n_sr, n_sc = rows, cdiv(cols, g)
    n_str = cdiv(rows, g)
    sdt = torch.uint8 if row.mode == 1 else torch.float32
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    opts = cfg[5].split(",") if len(cfg) > 5 and cfg[5] else []
    unknown = [o for o in opts if o not in ("inreg", "tscale") and not o.startswith("diag")]
    if unknown:
        raise ValueError(f"unknown pair-kernel options {unknown} in {cfg}")
    inreg = "inreg" in opts
    qt = torch.empty((cols, rows), dtype=out_dtype, device=dev)
    ts = "tscale" in opts and (row.mode == 1 or inreg)
    if ts:  # scales stored transposed, returned as the transposed views (same shapes and values)
        s_buf = torch.empty((n_sc, n_sr), dtype=sdt, device=dev)
        st_buf = torch.empty((n_str, cols), dtype=sdt, device=dev)
        s, st = s_buf.t(), st_buf.t()
        # MX: the kernel stores four scale bytes per 4-byte word
        s_arg, st_arg = (s_buf.view(torch.int32), st_buf.view(torch.int32)) if row.mode == 1 else (s_buf, st_buf)
        s_rs, st_rs = s_arg.stride(0), st_arg.stride(0)
    else:
        s = torch.empty((n_sr, n_sc), dtype=sdt, device=dev)
        st = torch.empty((cols, n_str), dtype=sdt, device=dev)
        s_arg, st_arg = s, st
        s_rs, st_rs = n_sc, n_str
    # "diag<mask>": timing only, outputs incomplete (see the kernel's DIAG)
    diag = next((int(o[4:]) for o in opts if o.startswith("diag")), 0)
    n_prog = n_tr * n_tc
    if row.mode == 0 and not inreg:
        scr = torch.empty((n_prog, tr * (tc // g) + (tr // g) * tc), dtype=torch.int32, device=dev)
    else:
        scr = s_arg  # unused
    launch(_quant_fp8_packed_dual_kernel, (n_prog,), (
        xp, q.view(torch.uint8).view(torch.int32), s_arg, qt.view(torch.uint8).view(torch.int32), st_arg, scr,
        rows, cols // 2, n_tc, xp.stride(0), cols // 4, s_rs, rows // 4, st_rs,
    ), dict(
        MODE=row.mode, FP8_MAX=fp8_max_of(out_dtype), EMAX=mx_emax_of(out_dtype), G=g, TR=tr, TC=tc,
        EVEN=rows % tr == 0 and cols % tc == 0, SOFT=is_interpreter(), V2=cfg[3] in ("packed2", "packed3"),
        V3=cfg[3] == "packed3", INREG=inreg, DIAG=diag, TS=ts, num_warps=nw, **extra
    ), xp.device)
    return q, s, qt, st


_ = np  # numpy is used by the model above
