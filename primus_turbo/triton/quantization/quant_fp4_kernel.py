"""MXFP4 quantize / dequantize kernels: E2M1 values, two per byte, one E8M0 scale per 32.

Same structure as the FP8 tile kernel (quant_fp8_kernel.py): one program per ``[TR, TC]`` tile,
x read once, the block amax reduced on a ``[.., 32, ..]`` view, the OCP MX shared exponent taken
from the amax's exponent field (emax = 2 for E2M1). E2M1 rounding is round-to-nearest-even on the
scaled, clamped (+-6) value: one fp32 addition of a per-segment magic constant picked from the
value's exponent bits, then integer work on the bit patterns (``_e2m1_code``: no float -> int
conversion, no per-code comparisons). Nibbles are packed along the quantized axis: element ``2i``
in the low nibble, ``2i + 1`` in the high one. Copies packed along their rows are stored as 32-bit
words of eight nibbles. ``quantize_fp4_with_trans`` (rows, cols % 32 == 0) runs
``_quant_mxfp4_dual_kernel``: the tile is read as eight row-interleaved eighths, so the column
copy's nibbles of 8 consecutive rows meet in one thread and form one int32 word, and the words
are transposed and stored as contiguous rows of the transposed copy. The generic kernel's
``HAS_T`` (blocks and packing along x's columns, stored through transposed strides) remains for
tuning. Launch configurations: ``fp4_config`` (the one place the defaults are set).

Stochastic rounding (``SR``): the scale (amax, E8M0 exponent) and the +-6 saturation are unchanged;
only the element's rounding is random. A scaled value between the neighbouring E2M1 codes ``lo <
v < hi`` rounds up with probability ``(v - lo) / (hi - lo)`` (so ``E[q] = v``: unbiased), with one
uniform ``u = tl.rand(seed, offset)`` (Philox4x32-10) per element. ``offset`` is the element's
index in the view whose rows are the quantized vectors (``r * cols + c`` for blocks along x's
columns, ``c * rows + r`` for blocks along its rows); the transposed copy of the one-read variant
uses the key ``seed + 1``. The seed is an int64 loaded from device memory (no host sync), so a
result is reproducible for a given seed and independent of the tiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_fp8_kernel import _abs_bits, _mx_scales, _round_for_store, _tile_pid
from primus_turbo.triton import cdiv, next_pow2, is_interpreter

__all__ = ["fp4_quant_launch", "fp4_dequant_launch"]

_BLOCK = 32
_FP4_EMAX = 2


@triton.jit
def _e2m1_nibbles(y):
    """fp32 values in [-6, 6] (or NaN) -> int32 nibbles: RNE magnitude code, sign in bit 3."""
    return _e2m1_code(tl.abs(y), y)


@triton.jit
def _e2m1_scaled_nibbles(x, mult):
    """Nibbles of ``clamp(x * mult, -6, 6)`` (``mult`` > 0): the clamp is taken on the magnitude,
    ``min(|x * mult|, 6)`` (one instruction, NaN kept), the sign from x."""
    return _e2m1_code(tl.minimum(tl.abs(x * mult), 6.0, propagate_nan=tl.PropagateNan.ALL), x)


@triton.jit
def _e2m1_code(t, s):
    """Magnitude ``t`` in [0, 6] (or NaN) and the sign of ``s`` -> int32 nibble.

    On t the E2M1 grid is uniform per segment: step 0.5 below 2 (codes 0..4), 1 in [2, 4)
    (codes 4..6), 2 in [4, 6] (codes 6, 7). One fp32 addition of ``C = 1.5 * 2**(22 + seg)``
    (seg = 0, 1, 2: the segment, read from t's exponent) rounds t to the segment's step, half to
    even, and leaves the step count in the low bits of the sum: ``bits(t + C) - bits(C)``. Adding
    ``2 * seg`` gives the code (a value rounding up to a segment's end gets the next segment's
    first code, as the grid is continuous). All integer work on bit patterns: no float -> int
    conversion (a slow pipe on the GPU) and no per-segment selects. NaN gives 0."""
    tb = t.to(tl.int32, bitcast=True)
    m = tl.maximum(tb >> 23, 127)  # 127 + seg for t < 8 (t < 1 counts as seg 0)
    cb = (m << 23) + 188743680  # bits(1.5 * 2**(22 + seg)) = 0x4AC00000 + (seg << 23)
    r = t + cb.to(tl.float32, bitcast=True)
    code = r.to(tl.int32, bitcast=True) - cb + 2 * m - 254
    code = code | ((s.to(tl.int32, bitcast=True) >> 28) & 8)
    return tl.where(tb > 0x7F800000, 0, code)


@triton.jit
def _e2m1_nibbles_sr(y, u):
    """Stochastic-rounding variant of :func:`_e2m1_nibbles`: ``u`` uniform in [0, 1), one per element.

    In each segment of q = 2|y| the grid is uniform (steps 1, 2, 4), so with ``v`` the value in
    grid steps, the code is ``floor(v) + (u < v - floor(v))`` (+ the segment's code offset): it
    rounds up with probability equal to the fractional distance, and a value on the grid (fraction
    0) never moves. A value at a segment's end (v = 4 or 3 in the lower segments) is exactly the
    next segment's first code, so the segments agree. Magnitudes stay <= 6 (q <= 12 gives v <= 3
    in the top segment). NaN gives 0."""
    q = tl.abs(y) * 2.0
    lo = q < 4.0
    mid = q < 8.0
    v = q * tl.where(lo, 1.0, tl.where(mid, 0.5, 0.25))
    v = tl.where(v == v, v, 0.0)  # NaN (code 0 below) would make the integer conversion undefined
    f = tl.floor(v)
    r = f + tl.where(u < v - f, 1.0, 0.0)
    code = r.to(tl.int32) + tl.where(lo, 0, tl.where(mid, 2, 4))
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return tl.where(y != y, 0, code | (sign << 3))


@triton.jit
def _e2m1_decode(n):
    """int32 nibbles -> fp32 E2M1 values (exact)."""
    e = (n >> 1) & 3
    m = (n & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((n & 8) != 0, -mag, mag)


@triton.jit
def _fp4_scaled_nibbles(x4, u4, SR: tl.constexpr):
    """[.., 32, ..]-blocked fp32 view -> (int32 nibbles of the same view, E8M0 bytes per block).
    With SR the elements round stochastically with the uniforms ``u4`` (same view; else unused)."""
    amax_bits = tl.max(tl.max(_abs_bits(x4), axis=3), axis=1)
    mult, byte = _mx_scales(amax_bits, 2)
    if SR:
        y = tl.clamp(x4 * mult[:, None, :, None], -6.0, 6.0, propagate_nan=tl.PropagateNan.ALL)
        return _e2m1_nibbles_sr(y, u4), byte
    return _e2m1_scaled_nibbles(x4, mult[:, None, :, None]), byte


@triton.jit
def _fp4_quantize_rows(x, u, TR: tl.constexpr, TC: tl.constexpr, SR: tl.constexpr):
    """fp32 tile [TR, TC], blocks of 32 along each row -> (uint32 words [TR, TC/8] holding eight
    nibbles each, element 8w + i in bits 4i..4i+3: byte order = the packed layout on a
    little-endian GPU; E8M0 bytes [TR, TC/32]). One 4-byte store per eight elements instead of
    byte stores. ``u``: the [TR, TC] uniforms of stochastic rounding (only read with SR)."""
    u4 = tl.reshape(u, (TR, 1, TC // 32, 32)) if SR else u
    nib, byte = _fp4_scaled_nibbles(tl.reshape(x, (TR, 1, TC // 32, 32)), u4, SR)
    nib = tl.reshape(nib, (TR, TC // 8, 8)).to(tl.uint32)
    shifts = (tl.arange(0, 8) * 4).to(tl.uint32)
    words = tl.sum(nib << shifts[None, None, :], axis=2)  # disjoint bits: the sum is an OR
    return words, tl.reshape(byte, (TR, TC // 32))


@triton.jit
def _fp4_quantize_cols(x, u, TR: tl.constexpr, TC: tl.constexpr, SR: tl.constexpr):
    """fp32 tile [TR, TC], blocks of 32 along each column -> (packed uint8 [TR/2, TC]: rows 2i and
    2i + 1 in the low and high nibble; E8M0 bytes [TR/32, TC]). ``u`` as in _fp4_quantize_rows."""
    u4 = tl.reshape(u, (TR // 32, 32, TC, 1)) if SR else u
    nib, byte = _fp4_scaled_nibbles(tl.reshape(x, (TR // 32, 32, TC, 1)), u4, SR)
    nib = tl.reshape(nib, (TR, TC))
    lo, hi = tl.split(tl.permute(tl.reshape(nib, (TR // 2, 2, TC)), (0, 2, 1)))
    return (lo | (hi << 4)).to(tl.uint8), tl.reshape(byte, (TR // 32, TC))


@triton.jit
def _store_2d(ptr, vals, r0, c0, n_r, n_c, stride_r, R: tl.constexpr, C: tl.constexpr):
    """vals [R, C] at rows r0.., columns c0.. of a row-major array with n_r x n_c valid entries."""
    r = r0 + tl.arange(0, R)
    c = c0 + tl.arange(0, C)
    m = (r < n_r)[:, None] & (c < n_c)[None, :]
    tl.store(ptr + r.to(tl.int64)[:, None] * stride_r + c.to(tl.int64)[None, :], vals, mask=m)


@triton.jit
def _store_2d_t(ptr, vals, r0, c0, n_r, n_c, stride_c, R: tl.constexpr, C: tl.constexpr):
    """vals [R, C] transposed: entry (r, c) at ptr[c * stride_c + r] (n_r x n_c valid entries)."""
    r = r0 + tl.arange(0, R)
    c = c0 + tl.arange(0, C)
    m = (r < n_r)[:, None] & (c < n_c)[None, :]
    tl.store(ptr + c.to(tl.int64)[None, :] * stride_c + r.to(tl.int64)[:, None], vals, mask=m)


@triton.jit
def _quant_mxfp4_kernel(
    # pointers: input, first copy + scales, transposed copy + scales, the int64 SR seed
    x_ptr, p_ptr, s_ptr, pt_ptr, st_ptr, seed_ptr,
    # sizes
    rows, cols, n_tiles_c,
    # strides: x in (row, col); the outputs' row strides (in their own elements: uint32 words for
    # copies packed along their rows, bytes otherwise)
    stride_xr, stride_xc, stride_p, stride_s, stride_pt, stride_st,
    # meta-parameters
    ALONG_COLS: tl.constexpr, HAS_T: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
    SR: tl.constexpr, SR_T: tl.constexpr,
):
    """MXFP4 of one [TR, TC] tile along its rows (ALONG_COLS) or columns; with HAS_T (only with
    ALONG_COLS) also the column-wise copy, stored transposed [cols, rows / 2]. SR / SR_T:
    stochastic rounding of the first / the transposed copy (see the module docstring)."""
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
    offs_r = pid_r * TR + tl.arange(0, TR)
    offs_c = pid_c * TC + tl.arange(0, TC)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_xr + offs_c.to(tl.int64)[None, :] * stride_xc,
                mask=mask, other=0.0).to(tl.float32)
    r64 = offs_r.to(tl.int64)[:, None]
    c64 = offs_c.to(tl.int64)[None, :]
    seed = tl.load(seed_ptr) if (SR or SR_T) else 0
    if ALONG_COLS:
        u = tl.rand(seed, r64 * cols + c64) if SR else x
        words, byte = _fp4_quantize_rows(x, u, TR, TC, SR)
        _store_2d(p_ptr, words, pid_r * TR, pid_c * (TC // 8), rows, cols // 8, stride_p, TR, TC // 8)
        _store_2d(s_ptr, byte, pid_r * TR, pid_c * (TC // 32), rows, cols // 32, stride_s, TR, TC // 32)
        if HAS_T:
            # blocks along x's columns, in x's coordinates, stored through the transposed strides
            # (measured faster on the H200 than transposing the fp32 tile in registers)
            u_t = tl.rand(seed + 1, c64 * rows + r64) if SR_T else x
            packed_t, byte_t = _fp4_quantize_cols(x, u_t, TR, TC, SR_T)
            _store_2d_t(pt_ptr, packed_t, pid_r * (TR // 2), pid_c * TC, rows // 2, cols, stride_pt, TR // 2, TC)
            _store_2d_t(st_ptr, byte_t, pid_r * (TR // 32), pid_c * TC, rows // 32, cols, stride_st, TR // 32, TC)
    else:
        u = tl.rand(seed, c64 * rows + r64) if SR else x
        packed, byte = _fp4_quantize_cols(x, u, TR, TC, SR)
        _store_2d(p_ptr, packed, pid_r * (TR // 2), pid_c * TC, rows // 2, cols, stride_p, TR // 2, TC)
        _store_2d(s_ptr, byte, pid_r * (TR // 32), pid_c * TC, rows // 32, cols, stride_s, TR // 32, TC)


@triton.jit
def _fp4_dual_eighth(v, k: tl.constexpr, i, c, p_ptr, s_ptr, seed, rows, cols, stride_p, stride_s, mask,
                     TE: tl.constexpr, TC: tl.constexpr, EVEN: tl.constexpr, SR: tl.constexpr):
    """Row-wise copy of one eighth (rows 8i + k, input dtype ``v``) of the two-copy kernel: words
    of eight nibbles and E8M0 bytes stored. Returns its |x| bits ([TE, TC] int32)."""
    x = v.to(tl.float32)
    r = 8 * i + k
    r64 = r.to(tl.int64)[:, None]
    u = tl.rand(seed, r64 * cols + c[None, :]) if SR else x
    words, byte = _fp4_quantize_rows(x, u, TE, TC, SR)
    wc = tl.program_id(0) % tl.cdiv(cols, TC) * (TC // 8) + tl.arange(0, TC // 8)
    sc = tl.program_id(0) % tl.cdiv(cols, TC) * (TC // 32) + tl.arange(0, TC // 32)
    if EVEN:
        tl.store(p_ptr + r64 * stride_p + wc[None, :], words)
        tl.store(s_ptr + r64 * stride_s + sc[None, :], byte)
    else:
        rm = (r < rows)[:, None]
        tl.store(p_ptr + r64 * stride_p + wc[None, :], words, mask=rm & (wc < cols // 8)[None, :])
        tl.store(s_ptr + r64 * stride_s + sc[None, :], byte, mask=rm & (sc < cols // 32)[None, :])
    return _abs_bits(x)


@triton.jit
def _fp4_dual_col_nibbles(v, k: tl.constexpr, i, c, mult, seed, rows, TE: tl.constexpr, TC: tl.constexpr,
                          SR_T: tl.constexpr):
    """Column-wise nibbles of eighth k (rows 8i + k) under the column blocks' multipliers, shifted
    to bits 4k..4k+3 of the transposed copy's word (uint32 [TE, TC])."""
    x = tl.reshape(_widen16(v), (TE // 4, 4, TC))
    if SR_T:
        y = tl.clamp(x * mult, -6.0, 6.0, propagate_nan=tl.PropagateNan.ALL)
        r = 8 * i + k
        u = tl.reshape(tl.rand(seed + 1, c.to(tl.int64)[None, :] * rows + r[:, None]), (TE // 4, 4, TC))
        nib = _e2m1_nibbles_sr(y, u)
    else:
        nib = _e2m1_scaled_nibbles(x, mult)
    return tl.reshape(nib, (TE, TC)).to(tl.uint32) << (4 * k)


@triton.jit
def _widen16(v):
    """Input values -> fp32 (exact); bf16 by a shift of its bits, a different operation from the
    row copy's ``.to(tl.float32)`` so the compiler keeps the 16-bit values live, not fp32 ones."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _ld(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _quant_mxfp4_dual_kernel(
    # pointers: input, row-wise copy (int32 words) + scales, transposed copy (int32 words) +
    # scales, the int64 SR seed
    x_ptr, p_ptr, s_ptr, pt_ptr, st_ptr, seed_ptr,
    # sizes
    rows, cols, n_tiles_c,
    # row strides: x (elements), p (words), s (bytes), pt (words), st (bytes)
    stride_x, stride_p, stride_s, stride_pt, stride_st,
    # meta-parameters
    TR: tl.constexpr, TC: tl.constexpr, EVEN: tl.constexpr, SR: tl.constexpr, SR_T: tl.constexpr,
):
    """``quantize_fp4_with_trans`` from one read of a [TR, TC] tile (rows, cols % 32 == 0).

    The tile is read as eight row-interleaved eighths ``x_k = x[8i + k, :]`` (16-byte loads, the
    same register layout for all eight), so the column-wise copy's nibbles of rows 8i..8i+7 of a
    column are in one thread: they form one int32 word in registers (bits 4k..4k+3 = row 8i + k:
    the packed byte order). The words [TR/8, TC] are transposed (4-byte elements through shared
    memory) and stored as contiguous rows of the transposed copy viewed as int32 [cols, rows/8].
    The row-wise copy is stored per eighth as words of eight nibbles along the row."""
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
    TE: tl.constexpr = TR // 8
    i = pid_r * TE + tl.arange(0, TE)  # row octets
    c = pid_c * TC + tl.arange(0, TC)
    mask = None if EVEN else (i < rows // 8)[:, None] & (c < cols)[None, :]
    base = x_ptr + (8 * i).to(tl.int64)[:, None] * stride_x + c[None, :]
    seed = tl.load(seed_ptr) if (SR or SR_T) else 0
    v0 = _ld(base, mask, EVEN)
    v1 = _ld(base + stride_x, mask, EVEN)
    v2 = _ld(base + 2 * stride_x, mask, EVEN)
    v3 = _ld(base + 3 * stride_x, mask, EVEN)
    v4 = _ld(base + 4 * stride_x, mask, EVEN)
    v5 = _ld(base + 5 * stride_x, mask, EVEN)
    v6 = _ld(base + 6 * stride_x, mask, EVEN)
    v7 = _ld(base + 7 * stride_x, mask, EVEN)
    a = _fp4_dual_eighth(v0, 0, i, c, p_ptr, s_ptr, seed, rows, cols, stride_p, stride_s, mask, TE, TC, EVEN, SR)
    a = tl.maximum(a, _fp4_dual_eighth(v1, 1, i, c, p_ptr, s_ptr, seed, rows, cols, stride_p, stride_s, mask,
                                       TE, TC, EVEN, SR))
    a = tl.maximum(a, _fp4_dual_eighth(v2, 2, i, c, p_ptr, s_ptr, seed, rows, cols, stride_p, stride_s, mask,
                                       TE, TC, EVEN, SR))
    a = tl.maximum(a, _fp4_dual_eighth(v3, 3, i, c, p_ptr, s_ptr, seed, rows, cols, stride_p, stride_s, mask,
                                       TE, TC, EVEN, SR))
    a = tl.maximum(a, _fp4_dual_eighth(v4, 4, i, c, p_ptr, s_ptr, seed, rows, cols, stride_p, stride_s, mask,
                                       TE, TC, EVEN, SR))
    a = tl.maximum(a, _fp4_dual_eighth(v5, 5, i, c, p_ptr, s_ptr, seed, rows, cols, stride_p, stride_s, mask,
                                       TE, TC, EVEN, SR))
    a = tl.maximum(a, _fp4_dual_eighth(v6, 6, i, c, p_ptr, s_ptr, seed, rows, cols, stride_p, stride_s, mask,
                                       TE, TC, EVEN, SR))
    a = tl.maximum(a, _fp4_dual_eighth(v7, 7, i, c, p_ptr, s_ptr, seed, rows, cols, stride_p, stride_s, mask,
                                       TE, TC, EVEN, SR))
    # column blocks: 32 rows = 4 octets x 8 eighths
    amax = tl.max(tl.reshape(a, (TE // 4, 4, TC)), axis=1)
    mult, byte = _mx_scales(amax, 2)
    mult = mult[:, None, :]
    w = _fp4_dual_col_nibbles(v0, 0, i, c, mult, seed, rows, TE, TC, SR_T)
    w |= _fp4_dual_col_nibbles(v1, 1, i, c, mult, seed, rows, TE, TC, SR_T)
    w |= _fp4_dual_col_nibbles(v2, 2, i, c, mult, seed, rows, TE, TC, SR_T)
    w |= _fp4_dual_col_nibbles(v3, 3, i, c, mult, seed, rows, TE, TC, SR_T)
    w |= _fp4_dual_col_nibbles(v4, 4, i, c, mult, seed, rows, TE, TC, SR_T)
    w |= _fp4_dual_col_nibbles(v5, 5, i, c, mult, seed, rows, TE, TC, SR_T)
    w |= _fp4_dual_col_nibbles(v6, 6, i, c, mult, seed, rows, TE, TC, SR_T)
    w |= _fp4_dual_col_nibbles(v7, 7, i, c, mult, seed, rows, TE, TC, SR_T)
    wt = tl.trans(w.to(tl.int32, bitcast=True))  # [TC, TE]: row c of the transposed copy
    c64 = c.to(tl.int64)
    sb = pid_r * (TR // 32) + tl.arange(0, TR // 32)
    if EVEN:
        tl.store(pt_ptr + c64[:, None] * stride_pt + i[None, :], wt)
        tl.store(st_ptr + c64[None, :] * stride_st + sb[:, None], byte.to(tl.uint8))
    else:
        tl.store(pt_ptr + c64[:, None] * stride_pt + i[None, :], wt, mask=tl.trans(mask))
        tl.store(st_ptr + c64[None, :] * stride_st + sb[:, None], byte.to(tl.uint8),
                 mask=(sb < rows // 32)[:, None] & (c < cols)[None, :])


@triton.jit
def _dequant_mxfp4_kernel(
    # pointers
    p_ptr, s_ptr, out_ptr,
    # sizes (of the unpacked tensor)
    rows, cols, n_tiles_c,
    # row strides of the packed tensor, the scales and the output (all row-major)
    stride_pr, stride_sr, stride_or,
    # meta-parameters
    ALONG_COLS: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr, SOFT: tl.constexpr,
):
    """out[rows, cols] = E2M1(packed) * 2**(scale - 127), packed along ALONG_COLS (or rows)."""
    pid_r, pid_c = _tile_pid(n_tiles_c)
    offs_r = pid_r * TR + tl.arange(0, TR)
    offs_c = pid_c * TC + tl.arange(0, TC)
    r64 = offs_r.to(tl.int64)
    c64 = offs_c.to(tl.int64)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    if ALONG_COLS:
        pc = pid_c * (TC // 2) + tl.arange(0, TC // 2)
        pmask = (offs_r < rows)[:, None] & (pc < cols // 2)[None, :]
        p = tl.load(p_ptr + r64[:, None] * stride_pr + pc.to(tl.int64)[None, :], mask=pmask, other=0).to(tl.int32)
        v = tl.reshape(tl.join(_e2m1_decode(p & 15), _e2m1_decode(p >> 4)), (TR, TC))
        s_ptrs = s_ptr + r64[:, None] * stride_sr + (c64 // 32)[None, :]
    else:
        pr = pid_r * (TR // 2) + tl.arange(0, TR // 2)
        pmask = (pr < rows // 2)[:, None] & (offs_c < cols)[None, :]
        p = tl.load(p_ptr + pr.to(tl.int64)[:, None] * stride_pr + c64[None, :], mask=pmask, other=0).to(tl.int32)
        v = tl.join(_e2m1_decode(p & 15), _e2m1_decode(p >> 4))  # [TR/2, TC, 2]
        v = tl.reshape(tl.permute(v, (0, 2, 1)), (TR, TC))
        s_ptrs = s_ptr + (r64 // 32)[:, None] * stride_sr + c64[None, :]
    e = tl.load(s_ptrs, mask=mask, other=127).to(tl.int32)
    s = tl.where(e == 255, 0x7FC00000, tl.where(e == 0, 0x00400000, e << 23)).to(tl.float32, bitcast=True)
    tl.store(out_ptr + r64[:, None] * stride_or + c64[None, :], _round_for_store(v * s, out_ptr, SOFT), mask=mask)


#: candidate (TR, TC, num_warps) per kernel, timed by scripts/tune_quant.py; defaults in :func:`fp4_config`
FP4_CANDIDATES = (
    (8, 1024, 8), (4, 1024, 4), (8, 1024, 4), (16, 1024, 8), (16, 512, 8), (16, 1024, 16), (32, 512, 16),
    (32, 256, 8), (4, 512, 4),
    # the bf16-pair kernel (quant_fp4_packed.py): ~7 SASS instructions per element instead of ~21
    (8, 1024, 4, "packed"), (16, 1024, 8, "packed"), (4, 1024, 4, "packed"), (8, 512, 4, "packed"),
    (16, 1024, 4, "packed"), (32, 512, 8, "packed"), (8, 1024, 8, "packed"),
)
#: the two-copy kernel: (TR, TC, num_warps[, maxnreg]), TR and TC multiples of 32; maxnreg caps the
#: registers per thread (ptx .maxnreg: more programs per SM)
FP4_WITH_TRANS_CANDIDATES = (
    (64, 128, 4), (32, 256, 4, 128), (32, 128, 4), (64, 64, 4), (64, 256, 8), (32, 256, 4), (64, 128, 8),
    (128, 128, 8), (128, 64, 4), (32, 64, 2), (64, 128, 4, 128), (64, 128, 4, 96),
    # the bf16-pair kernel (quant_fp4_packed.py): (TR, TC, num_warps, "packed"[, maxnreg])
    (64, 128, 4, "packed"), (64, 128, 4, "packed", 128), (32, 128, 4, "packed"), (64, 256, 8, "packed"),
    (128, 128, 8, "packed"), (32, 256, 4, "packed"), (64, 64, 4, "packed"), (128, 64, 4, "packed"),
    # Measured and removed (session 32, as the FP8 two-copy one- and two-warp programs): H200, bf16
    # [16384, 7168], x the device copy, 32x128x1 0.407, 32x64x1 0.395, 64x64x2 0.594, 64x128x2 0.579
    # against the default's 0.619
    # option "tscale": the scales stored transposed (returned as transposed views), as the FP8
    # two-copy kernel's (whole sectors for the column-block scales)
    (128, 64, 4, "packed", 0, "tscale"), (64, 128, 4, "packed", 0, "tscale"), (64, 64, 4, "packed", 0, "tscale"),
    # the Hopper Gluon kernel (quant_fp4_gluon.py): ("gluon", TWP, WI, WP[, maxnreg, BAND, programs per SM])
    ("gluon", 4, 1, 4, 128, 4, 4), ("gluon", 4, 1, 4), ("gluon", 4, 1, 8, 128, 4, 2), ("gluon", 4, 2, 4, 128, 4, 2),
)


def fp4_config(rows: int, cols: int, along_cols: bool, with_trans: bool):
    """The default (TR, TC, num_warps[, maxnreg]) of a quantizer launch: the one place the defaults are set
    (scripts/tune_quant.py prints the H200 winner per shape). With the transposed copy: the
    two-copy kernel's tile (rows and cols multiples of 32)."""
    if with_trans:
        # H200 sweep (session 4, scripts/tune_quant.py): 64 x 128 tiles, 4 warps the fastest of 12
        # at [16384, 7168] (0.40x copy, was 0.24); registers held at the 128 measured there
        # (the magnitude clamp since then compiles to 136: 3 programs per SM instead of 4)
        return 64, 128, 4, 128
    tr, tc, nw = _tile(rows, cols, along_cols, False)
    if along_cols and (tr, tc) == (8, 1024):
        nw = 4  # H200 sweep: 0.671x copy at [16384, 7168] against 0.638 with 8 warps
    return tr, tc, nw


def fp4_packed_default(with_trans: bool) -> tuple:
    """The default tile of the bf16-pair kernels (quant_fp4_packed.py), which take bf16 input along
    rows without stochastic rounding on the GPU. H200 sweep (session 6, scripts/tune_quant.py
    --match packed, bf16 [16384, 7168]): quantize_fp4 0.893x the device copy with (4, 1024, 4)
    (the tl kernel's default 0.664x); with the transposed copy 0.617x with (128, 64, 4) (0.389x).
    Session 33 (scripts/diag_quant_spread.py, device time): with the scales stored transposed
    ("tscale") the transposed-copy kernel went 0.620 -> 0.666 at [16384, 7168], 0.608 -> 0.662 at
    [8192, 14336]."""
    return (128, 64, 4, "packed", 0, "tscale") if with_trans else (4, 1024, 4, "packed")


def _tile(rows: int, cols: int, along_cols: bool, with_trans: bool) -> tuple[int, int, int]:
    """(TR, TC, num_warps): like the FP8 heuristic, ~8192-element tiles holding whole 32-blocks;
    a square 64 x 64 tile with the transposed copy in the generic kernel (both copies >= 32-byte
    row segments)."""
    if with_trans:
        return 64, 64, 4
    if along_cols:
        tc = max(32, min(next_pow2(cols), 1024))
        tr = max(1, min(8192 // tc, next_pow2(rows)))
    else:
        tr = 32 if rows <= 32 else 64
        tc = max(16, min(next_pow2(cols), 8192 // tr))
    n = tr * tc
    return tr, tc, 4 if n <= 2048 else 8


def fp4_quant_launch(x: torch.Tensor, along_cols: bool, with_trans: bool = False,
                     tile: "tuple | None" = None, seed: "torch.Tensor | None" = None,
                     sr: bool = False, sr_t: bool = False):
    """MXFP4 of a contiguous 2-D x. Returns ``(packed, scale)`` or, with ``with_trans``,
    ``(packed, scale, packed_t, scale_t)``; packed tensors and E8M0 scales as uint8.

    along_cols: ``packed [rows, cols/2]``, ``scale [rows, cols/32]``; else ``[rows/2, cols]``,
    ``[rows/32, cols]``. The transposed copy (only with ``along_cols``): ``[cols, rows/2]`` and
    ``[cols, rows/32]``. ``tile`` overrides :func:`fp4_config` (for tuning): ``(TR, TC, num_warps)``, with the transposed
    copy ``(TR, TC, num_warps[, maxnreg])`` for the two-copy kernel (rows, cols % 32 == 0) or
    ``(TR, TC, num_warps, "generic")`` for the generic kernel.
    ``sr`` / ``sr_t``: stochastic rounding of the first / the transposed copy, keyed by ``seed``
    (a one-element int64 tensor on x's device, read in the kernel: no host sync)."""
    rows, cols = x.shape
    dev = x.device
    if with_trans and not along_cols:
        raise ValueError("fp4_quant_launch: the transposed copy is built with along_cols=True")
    sr_t = bool(sr_t and with_trans)
    if (sr or sr_t) and (not isinstance(seed, torch.Tensor) or seed.numel() != 1 or seed.dtype != torch.int64
                         or seed.device != dev):
        raise ValueError("fp4_quant_launch: stochastic rounding needs seed, a one-element int64 tensor on "
                         f"{dev}, got {seed!r}")
    # the Hopper Gluon kernel of quant_fp4_gluon.py: the default for the two bf16 copies on the GPU
    # where it covers the shape, or a tile ("gluon", TWP, WI, WP) (tuning)
    gluon_cfg = tile is not None and len(tile) in (4, 7) and tile[0] == "gluon"
    if with_trans and along_cols and not (sr or sr_t) and (tile is None or gluon_cfg) and x.is_cuda \
            and not is_interpreter():
        from .gather_quant_gluon import gluon_switch
        from .quant_fp4_gluon import FP4_GLUON_ENV, fp4_gluon_reason, fp4_gluon_with_trans_launch

        cfg = tuple(tile[1:]) if gluon_cfg else None
        if (gluon_cfg or gluon_switch(FP4_GLUON_ENV) is not False) and fp4_gluon_reason(x, cfg) is None:
            return fp4_gluon_with_trans_launch(x, cfg)
    if gluon_cfg:
        tile = None  # not covered: the default kernels
    # the bf16-pair kernels (quant_fp4_packed.py, which allocate their own outputs): the default for
    # bf16 rows on the GPU, or a tile (TR, TC, num_warps, "packed"[, maxnreg])
    packed_tile = tile
    if tile is None and along_cols and x.is_cuda and not is_interpreter():
        packed_tile = fp4_packed_default(with_trans)
    if _packed(packed_tile, x, with_trans, sr, sr_t):
        from .quant_fp4_packed import fp4_packed_launch, fp4_packed_with_trans_launch

        cfg = (*packed_tile[:3], *packed_tile[4:])
        if with_trans:
            return fp4_packed_with_trans_launch(x, cfg)
        return fp4_packed_launch(x, cfg)
    if along_cols:
        p = torch.empty((rows, cols // 2), dtype=torch.uint8, device=dev)
        s = torch.empty((rows, cols // _BLOCK), dtype=torch.uint8, device=dev)
    else:
        p = torch.empty((rows // 2, cols), dtype=torch.uint8, device=dev)
        s = torch.empty((rows // _BLOCK, cols), dtype=torch.uint8, device=dev)
    if with_trans:
        pt = torch.empty((cols, rows // 2), dtype=torch.uint8, device=dev)
        st = torch.empty((cols, rows // _BLOCK), dtype=torch.uint8, device=dev)
    else:
        pt, st = p, s
    if tile is not None and len(tile) > 3 and tile[3] == "packed":
        tile = (*tile[:3], *tile[4:])  # not covered here: the same tile for the tl kernels
    generic = tile is not None and len(tile) > 3 and tile[3] == "generic"
    if with_trans and not generic and rows % 32 == 0 and cols % 32 == 0 and rows > 0 and cols > 0 \
            and x.stride(1) == 1:
        # the one-read two-copy kernel, tile (TR, TC, num_warps[, maxnreg]); a tile (TR, TC,
        # num_warps, "generic") runs the generic kernel below (for tuning)
        cfg = tile or fp4_config(rows, cols, True, True)
        tr, tc, nw = cfg[:3]
        extra = {"maxnreg": cfg[3]} if len(cfg) > 3 and cfg[3] and not is_interpreter() else {}
        n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
        _quant_mxfp4_dual_kernel[(n_tr * n_tc,)](
            x, p.view(torch.int32), s, pt.view(torch.int32), st, seed if (sr or sr_t) else s, rows, cols, n_tc,
            x.stride(0), cols // 8, s.stride(0), rows // 8, st.stride(0),
            TR=tr, TC=tc, EVEN=rows % tr == 0 and cols % tc == 0, SR=bool(sr), SR_T=sr_t, num_warps=nw, **extra,
        )
        return p, s, pt, st
    tr, tc, nw = tuple(tile[:3]) if tile else fp4_config(rows, cols, along_cols, False) if not with_trans \
        else _tile(rows, cols, True, True)
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    # the copy packed along its rows is written as uint32 words (rows hold a multiple of 32
    # values: 16-byte multiples, so the int32 view is exact)
    p_arg = p.view(torch.int32) if along_cols else p
    pt_arg = pt if with_trans else p_arg
    _quant_mxfp4_kernel[(n_tr * n_tc,)](
        x, p_arg, s, pt_arg, st, seed if (sr or sr_t) else s, rows, cols, n_tc,
        x.stride(0), x.stride(1), p_arg.stride(0), s.stride(0), pt_arg.stride(0), st.stride(0),
        ALONG_COLS=along_cols, HAS_T=with_trans, TR=tr, TC=tc, SR=bool(sr), SR_T=sr_t, num_warps=nw,
    )
    if with_trans:
        return p, s, pt, st
    return p, s


def _packed(tile, x: torch.Tensor, with_trans: bool, sr: bool, sr_t: bool) -> bool:
    """Whether ``tile`` selects the bf16-pair kernels (``(TR, TC, num_warps, "packed"[, maxnreg])``)
    and they cover this call (bf16 x, no stochastic rounding, shapes as fp4_packed_ok)."""
    if tile is None or len(tile) < 4 or tile[3] != "packed" or sr or sr_t:
        return False
    from .quant_fp4_packed import fp4_packed_ok

    if not fp4_packed_ok(x, with_trans):
        return False
    tr, tc = tile[0], tile[1]
    return tc % 32 == 0 and (tr % 32 == 0 if with_trans else tr >= 1)


def fp4_dequant_launch(packed: torch.Tensor, scale: torch.Tensor, along_cols: bool, out_dtype: torch.dtype):
    """Unpack a contiguous MXFP4 tensor (uint8 view) with its uint8 E8M0 scales into ``out_dtype``."""
    if along_cols:
        rows, cols = packed.shape[0], packed.shape[1] * 2
    else:
        rows, cols = packed.shape[0] * 2, packed.shape[1]
    out = torch.empty((rows, cols), dtype=out_dtype, device=packed.device)
    tr, tc, nw = _tile(rows, cols, along_cols, False)
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    _dequant_mxfp4_kernel[(n_tr * n_tc,)](
        packed, scale, out, rows, cols, n_tc, packed.stride(0), scale.stride(0), out.stride(0),
        ALONG_COLS=along_cols, TR=tr, TC=tc, SOFT=is_interpreter(), num_warps=nw,
    )
    return out
