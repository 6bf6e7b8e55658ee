"""FP8 quantize / dequantize kernels (TENSORWISE, ROWWISE, BLOCKWISE, MX) for Hopper.

Every kernel works on a 2-D view ``x[rows, cols]`` and addresses every tensor through strides
expressed in x's ``(row, col)`` coordinates, so the same kernel writes a row-major copy
(strides ``(cols, 1)``) or the column-wise copy stored transposed (strides ``(1, rows)``).

A scale covers a block of ``GR x GC`` elements of x (docs/low_precision.md):
ROWWISE ``(1, cols)`` / ``(rows, 1)``, BLOCKWISE ``(1, b)`` / ``(b, 1)`` / ``(b, b)``,
MX ``(1, 32)`` / ``(32, 1)``. The kernels:

* ``_quant_fp8_tile_kernel``: one program per ``[TR, TC]`` tile that holds whole blocks; the tile is
  read once (16-byte vector loads), viewed as ``[TR/GR, GR, TC/GC, GC]`` to reduce each block's
  amax, scaled, cast and written once. With ``HAS_T`` it also forms a second grouping of the same
  registers (e.g. ``(b, 1)`` next to ``(1, b)``) and writes it through the transposed strides:
  ``quantize_fp8_with_trans`` reads x once. ``MODE`` 2 (TENSORWISE) reduces the amax kernel's
  per-program partial maxima (``n_amax`` ints) and forms the scale on the device (no host sync).
  ``S_TWICE`` (one grouping) also stores the scales through the second scale pointer and strides:
  the transposed copy's scales of a grouping that transposes with the tensor (TENSORWISE, b x b),
  without a separate copy launch.
* ``_quant_fp8_tile_batched_kernel``: the one-grouping tile kernel over a batch ``x [B, rows,
  cols]`` (grid axis 1 = the matrix): every matrix quantized exactly as alone, blocks never
  straddling two of them, in one launch (``fp8_quant_batched_launch``; grouped-GEMM weights
  ``[G, R, C]`` in b x b blocks when b does not divide R).
* ``_quant_fp8_dual_kernel``: the two copies of ``quantize_fp8_with_trans`` for ``1 x g`` row
  blocks with ``g x 1`` column blocks (BLOCKWISE, MX), rows % 4 == 0. The tile is read as four
  row-interleaved quarters, so the column copy's codes of 4 consecutive rows meet in one thread
  and pack into an int32 word; the words are transposed (4-byte elements through shared memory)
  and stored as contiguous rows of the transposed copy (16-byte stores instead of strided byte
  stores). ``_quant_fp8_dual_staged_kernel``: the same with fp32 scales (BLOCKWISE) formed once
  per block through a per-program scratch rather than by every thread holding the block (the
  IEEE divisions were a third of the instructions). Launch configuration: ``with_trans_config``
  (the one place the default is set; ``WITH_TRANS_CANDIDATES`` for scripts/tune_quant.py).
* ``_quant_fp8_long_kernel``: ROWWISE whose row (or column) does not fit a tile: two passes over
  the strip (amax, then scale + cast); the second pass mostly hits L2.
* ``_amax_kernel``: TENSORWISE first pass, the max of ``|x|`` bit patterns per program, one int32
  per program (no atomics, so the buffer needs no zero fill: that was a fill launch and an
  allocation per call on the host-bound path); the tile kernel reduces the partials. For
  non-negative floats the int32 order of the bit patterns is the value order and every NaN lies
  above +inf, so the result is deterministic and a NaN anywhere wins.
* ``_dequant_fp8_kernel``: ``x = q * scale_inv`` gathered per element's block.

Scale arithmetic is the contract's, bit for bit: ``tl.math.div_rn`` (IEEE-rounded division, not
the approximate ``div.full``), the MX shared exponent from the exponent field of the amax bits.
On the GPU the FP8 cast is the saturating hardware conversion, so the two-copy kernels leave out
the clamp before it (``_fp8_codes``); the interpreter's soft cast gets the clamped value.
Offsets are int64. Tiles aim at 8192 elements (16 KiB of bf16 in flight per program), see
:func:`tile_config`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, next_pow2, is_interpreter
from primus_turbo.triton.launch import launch

__all__ = [
    "GROUP_TENSOR",
    "QuantGrouping",
    "tile_config",
    "fp8_quant_launch",
    "batched_trans_ok",
    "fp8_quant_batched_launch",
    "fp8_quant_with_trans_launch",
    "fp8_dequant_launch",
    "transpose_bytes",
    "MAX_TILE_GROUP",
]

_FLT_MAX = 3.4028234663852886e38
#: the widest group (padded to a power of two) the tile kernel holds in one program; ROWWISE
#: rows/columns past it use the two-pass long kernel
MAX_TILE_GROUP = 16384
_TARGET_TILE = 8192  # elements per program for the single-output kernels
GROUP_TENSOR = -1  # sentinel GR/GC: the whole tensor is one group (TENSORWISE)
_MODE_FP32, _MODE_MX, _MODE_TENSOR = 0, 1, 2


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _abs_bits(x):
    """|x| (fp32) as int32 bit patterns: ordered like the values, every NaN above +inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _tile_pid(n_tiles_c):
    """(tile row, tile column) of this program in a row-major grid of n_tiles_c tile columns."""
    pid = tl.program_id(0)
    return pid // n_tiles_c, pid % n_tiles_c


@triton.jit
def _fp32_scales(amax_bits, FP8_MAX: tl.constexpr):
    """(scale, scale_inv) of the contract: FP8_MAX / amax (IEEE-rounded, capped at FLT_MAX) when
    0 < amax < inf, else 1; scale_inv = 1 / scale (IEEE-rounded)."""
    ok = (amax_bits > 0) & (amax_bits < 0x7F800000)
    amax = tl.where(ok, amax_bits, 0x3F800000).to(tl.float32, bitcast=True)  # 1.0 where not ok
    zero = amax * 0.0  # amax is finite here: a zero tensor of its shape
    scale = tl.math.div_rn(zero + FP8_MAX, amax)
    scale = tl.minimum(scale, 3.4028234663852886e38)
    scale = tl.where(ok, scale, 1.0)
    scale_inv = tl.math.div_rn(zero + 1.0, scale)
    return scale, scale_inv


@triton.jit
def _mx_scales(amax_bits, EMAX: tl.constexpr):
    """(multiplier 2**-shared_exp, E8M0 byte) of the OCP MX rule.

    floor(log2(amax)) is the unbiased exponent field e - 127 (a subnormal or zero amax has e = 0
    and clamps to -127 like amax = 0), so the byte shared_exp + 127 = max(e - EMAX, 0); e = 255
    (inf/NaN) gives the NaN byte and an unscaled block. The multiplier 2**(127 - byte) is a normal
    fp32 for every byte <= 254 - EMAX, so x * multiplier equals x / 2**shared_exp exactly."""
    e = amax_bits >> 23
    bad = e == 255
    byte = tl.where(bad, 255, tl.maximum(e - EMAX, 0))
    mult = tl.where(bad, 1.0, ((254 - tl.minimum(byte, 254)) << 23).to(tl.float32, bitcast=True))
    return mult, byte


@triton.jit
def _fp8_bits(y, IS_E4M3: tl.constexpr, SOFT: tl.constexpr):
    """fp32 ``y`` (already clamped to +-FP8_MAX, or NaN) -> its FP8 code as uint8, rounded to
    nearest even.

    On the GPU this is the hardware conversion (``cvt.rn.satfinite``). ``SOFT`` (the CPU
    interpreter, whose float downcast neither rounds to even nor carries a rounded-up mantissa
    into the exponent) forms the code with exact fp32 arithmetic instead: ``(|y| + c) - c`` with
    ``c = 1.5 * 2**23 * ulp`` rounds |y| to a multiple of the FP8 ulp at its exponent (RNE, by
    the fp32 addition), then the bits are assembled. NaN gives 0x7F."""
    if not SOFT:
        if IS_E4M3:
            q = y.to(tl.float8e4nv)
        else:
            q = y.to(tl.float8e5)
        return q.to(tl.uint8, bitcast=True)
    else:
        MBITS: tl.constexpr = 3 if IS_E4M3 else 2
        EMIN: tl.constexpr = -6 if IS_E4M3 else -14
        BIAS: tl.constexpr = 7 if IS_E4M3 else 15
        SUB_MUL: tl.constexpr = 512.0 if IS_E4M3 else 65536.0  # 2**(MBITS - EMIN)
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 31) & 1
        a_bits = bits & 0x7FFFFFFF
        e = tl.maximum((a_bits >> 23) - 127, EMIN)
        e = tl.minimum(e, 15)  # NaN lanes: keep the magic constant finite (result replaced below)
        c = (((e - MBITS + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
        r = (a_bits.to(tl.float32, bitcast=True) + c) - c
        rb = r.to(tl.int32, bitcast=True)
        re = (rb >> 23) - 127
        code_n = ((re + BIAS) << MBITS) | ((rb >> (23 - MBITS)) & ((1 << MBITS) - 1))
        code_s = (tl.where(re < EMIN, r, 0.0) * SUB_MUL).to(tl.int32)  # NaN lanes: 0, replaced below
        code = tl.where(re >= EMIN, code_n, code_s) | (sign << 7)
        code = tl.where(y != y, 0x7F, code)
        return code.to(tl.uint8)


@triton.jit
def _fp8_value(code, IS_E4M3: tl.constexpr, SOFT: tl.constexpr):
    """uint8 FP8 codes -> fp32 values (exact). ``SOFT`` decodes the bits by hand (the
    interpreter's upcast maps E4M3 NaN and E5M2 inf/NaN to finite numbers)."""
    if not SOFT:
        if IS_E4M3:
            return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            return code.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        MBITS: tl.constexpr = 3 if IS_E4M3 else 2
        EMASK: tl.constexpr = 15 if IS_E4M3 else 31
        BIAS: tl.constexpr = 7 if IS_E4M3 else 15
        SUB_UNIT: tl.constexpr = 0.001953125 if IS_E4M3 else 1.52587890625e-05  # 2**(EMIN - MBITS)
        c = code.to(tl.int32)
        e = (c >> MBITS) & EMASK
        m = c & ((1 << MBITS) - 1)
        val_n = (((e - BIAS + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
        val = tl.where(e == 0, m.to(tl.float32) * SUB_UNIT, val_n)
        if IS_E4M3:
            val = tl.where((c & 0x7F) == 0x7F, float("nan"), val)
        else:
            val = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), val)
        return tl.where((c & 0x80) != 0, -val, val)


@triton.jit
def _round_for_store(x, out_ptr, SOFT: tl.constexpr):
    """fp32 -> the output's dtype. SOFT: round to bf16 by hand (RNE) first, since the
    interpreter's fp32 -> bf16 cast truncates; fp16 and fp32 casts are exact there."""
    if SOFT:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
    return x.to(out_ptr.dtype.element_ty)


@triton.jit
def _quantize_groups(
    x, amax_ptr, n_amax,
    MODE: tl.constexpr, FP8_MAX: tl.constexpr, EMAX: tl.constexpr,
    TR: tl.constexpr, TC: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr, AMAX_SLOTS: tl.constexpr,
):
    """Quantize an fp32 tile [TR, TC] whose blocks are GR x GC (zeros outside the tensor).
    TENSORWISE (MODE 2): the amax is the max of the ``n_amax <= AMAX_SLOTS`` partials at amax_ptr.

    Returns (y, s): y the scaled, clamped fp32 tile (cast by the caller), s the per-block scale
    to store ([TR/GR, TC/GC] fp32 scale_inv or int32 E8M0 bytes; a scalar for TENSORWISE)."""
    if MODE == 2:
        # every program reduces the amax kernel's partials (a few KiB from L2): the same max
        # as one atomic word, with no zero-filled buffer to launch first
        slots = tl.arange(0, AMAX_SLOTS)
        amax_bits = tl.max(tl.load(amax_ptr + slots, mask=slots < n_amax, other=0), axis=0)
        scale, s = _fp32_scales(amax_bits, FP8_MAX)
        y = x * scale
    else:
        x4 = tl.reshape(x, (TR // GR, GR, TC // GC, GC))
        amax_bits = tl.max(tl.max(_abs_bits(x4), axis=3), axis=1)
        if MODE == 1:
            mult, s = _mx_scales(amax_bits, EMAX)
        else:
            mult, s = _fp32_scales(amax_bits, FP8_MAX)
        y = tl.reshape(x4 * mult[:, None, :, None], (TR, TC))
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return y, s


@triton.jit
def _store_tile(
    q_ptr, s_ptr, y, s, pid, offs_r, offs_c, mask,
    rows, cols, stride_qr, stride_qc, stride_sr, stride_sc, n_sr, n_sc,
    MODE: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr,
    pid_r, pid_c, IS_E4M3: tl.constexpr, SOFT: tl.constexpr,
):
    """Write the cast tile through its strides and the tile's block scales."""
    q_ptrs = q_ptr + offs_r.to(tl.int64)[:, None] * stride_qr + offs_c.to(tl.int64)[None, :] * stride_qc
    tl.store(q_ptrs, _fp8_bits(y, IS_E4M3, SOFT), mask=mask)
    _store_scales(s_ptr, s, pid, stride_sr, stride_sc, n_sr, n_sc, MODE, TR, TC, GR, GC, pid_r, pid_c)


@triton.jit
def _store_scales(
    s_ptr, s, pid, stride_sr, stride_sc, n_sr, n_sc,
    MODE: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr, pid_r, pid_c,
):
    """Write the tile's block scales ``s`` (a scalar for TENSORWISE: program 0 writes it)."""
    if MODE == 2:
        if pid == 0:
            tl.store(s_ptr, s)
    else:
        sr = pid_r * (TR // GR) + tl.arange(0, TR // GR)
        sc = pid_c * (TC // GC) + tl.arange(0, TC // GC)
        s_ptrs = s_ptr + sr.to(tl.int64)[:, None] * stride_sr + sc.to(tl.int64)[None, :] * stride_sc
        s_mask = (sr < n_sr)[:, None] & (sc < n_sc)[None, :]
        tl.store(s_ptrs, s.to(s_ptr.dtype.element_ty), mask=s_mask)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _amax_kernel(
    # pointers
    x_ptr, amax_ptr,
    # sizes: elements, and loop trips per program (cdiv(cdiv(n, BLOCK), NUM_PROGS))
    n, n_iters,
    # meta-parameters
    BLOCK: tl.constexpr, NUM_PROGS: tl.constexpr,
):
    """amax_ptr[pid] = max of |x| as int32 bits over this program's blocks (0 where it has none);
    every one of the NUM_PROGS slots is written, so the buffer needs no initialization."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for _ in range(0, n_iters):
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
        offs += NUM_PROGS * BLOCK
    tl.store(amax_ptr + pid, tl.max(acc, axis=0))


@triton.jit
def _quant_fp8_tile_kernel(
    # pointers: input, row-wise output + scales, transposed output + scales, TENSORWISE amax
    # partials (n_amax of them)
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, amax_ptr,
    # sizes
    rows, cols, n_tiles_c, n_amax,
    # strides, all in x's (row, col) coordinates
    stride_xr, stride_xc,
    stride_qr, stride_qc, stride_sr, stride_sc,
    stride_qtr, stride_qtc, stride_str, stride_stc,
    # extents of the two scale grids (blocks along rows, along cols)
    n_sr, n_sc, n_str, n_stc,
    # meta-parameters
    FP8_MAX: tl.constexpr, EMAX: tl.constexpr,
    MODE: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr,  # first grouping
    HAS_T: tl.constexpr, MODE_T: tl.constexpr, GR_T: tl.constexpr, GC_T: tl.constexpr,  # second
    TR: tl.constexpr, TC: tl.constexpr, IS_E4M3: tl.constexpr, SOFT: tl.constexpr,
    AMAX_SLOTS: tl.constexpr, S_TWICE: tl.constexpr,
):
    """q = quant(x) with GR x GC blocks (and, with HAS_T, qt = quant(x) with GR_T x GC_T blocks;
    with S_TWICE instead, the same scales also into st_ptr through strides stride_str /
    stride_stc, in x's block coordinates)."""
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
    offs_r = pid_r * TR + tl.arange(0, TR)
    offs_c = pid_c * TC + tl.arange(0, TC)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    x_ptrs = x_ptr + offs_r.to(tl.int64)[:, None] * stride_xr + offs_c.to(tl.int64)[None, :] * stride_xc
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)

    y, s = _quantize_groups(x, amax_ptr, n_amax, MODE, FP8_MAX, EMAX, TR, TC, GR, GC, AMAX_SLOTS)
    _store_tile(q_ptr, s_ptr, y, s, pid, offs_r, offs_c, mask, rows, cols,
                stride_qr, stride_qc, stride_sr, stride_sc, n_sr, n_sc, MODE, TR, TC, GR, GC, pid_r, pid_c, IS_E4M3, SOFT)
    if S_TWICE:
        tl.static_assert(not HAS_T, "S_TWICE is for one grouping")
        _store_scales(st_ptr, s, pid, stride_str, stride_stc, n_sr, n_sc, MODE, TR, TC, GR, GC, pid_r, pid_c)
    if HAS_T:
        # The second copy is stored transposed. It is quantized from the tile transposed in
        # registers, with its blocks in the copy's own coordinates, and written in the copy's
        # row-major order: every stored row is contiguous (coalesced, no byte stores strided by
        # `rows`). Arguments below are in the copy's coordinates: its rows are x's columns.
        yt, st = _quantize_groups(tl.trans(x), amax_ptr, n_amax, MODE_T, FP8_MAX, EMAX, TC, TR, GC_T, GR_T,
                                  AMAX_SLOTS)
        mask_t = (offs_c < cols)[:, None] & (offs_r < rows)[None, :]
        _store_tile(qt_ptr, st_ptr, yt, st, pid, offs_c, offs_r, mask_t, cols, rows,
                    stride_qtc, stride_qtr, stride_stc, stride_str, n_stc, n_str,
                    MODE_T, TC, TR, GC_T, GR_T, pid_c, pid_r, IS_E4M3, SOFT)


@triton.jit
def _quant_fp8_tile_batched_kernel(
    # pointers: input [B, rows, cols], output [B, rows, cols] (contiguous), scales [B, n_sr, n_sc]
    x_ptr, q_ptr, s_ptr,
    # sizes of one matrix of the batch
    rows, cols, n_tiles_c,
    # strides: x (batch, row, col), q (batch), s (batch)
    stride_xb, stride_xr, stride_xc, stride_qb, stride_sb,
    # extents of one matrix's scale grid
    n_sr, n_sc,
    # meta-parameters
    FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MODE: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr,
    TR: tl.constexpr, TC: tl.constexpr, IS_E4M3: tl.constexpr, SOFT: tl.constexpr,
    # HAS_T: also each matrix's codes transposed, as int32 words qt [B, cols, rows / 4] (rows % 4 == 0)
    qt_ptr=None, HAS_T: tl.constexpr = False,
):
    """``_quant_fp8_tile_kernel`` (one grouping) over a batch of matrices in one launch: program
    (pid, b) runs tile ``pid`` of matrix ``b`` exactly as the 2-D kernel runs it on matrix ``b``
    alone (its rows masked against ``rows``, so a block never straddles two matrices and the last
    block row covers ``rows % GR`` rows): the same codes and scales, bit for bit. Used for the b x b
    weight blocks of grouped GEMMs.

    HAS_T (one b x b block per tile, whose scale grid transposes with the matrix): the tile's codes
    also stored transposed, the grad_input copy of the weights, in the same launch. The tile is
    read a second time (from L2: it was just loaded) as four row sets, rows 4i + j, so the int32
    word holding the codes of rows 4i..4i+3 forms elementwise and only 32-bit words change layout
    in the transpose. Forms that reuse the forward copy's codes wrote wrong bytes on sm_90 with
    Triton 3.6 wherever the code stores vectorize (columns 0, 1, 4, 5, ... of every 128 wrong):
    a transpose of the 8-bit codes, also when widened first; the codes packed into words by a
    reshape and a sum over the row quartets, stored through ``tl.trans`` or through transposed
    addresses; the codes of the four row sets stored as the forward copy too."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
    offs_r = pid_r * TR + tl.arange(0, TR)
    offs_c = pid_c * TC + tl.arange(0, TC)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    x_ptrs = (x_ptr + b * stride_xb + offs_r.to(tl.int64)[:, None] * stride_xr
              + offs_c.to(tl.int64)[None, :] * stride_xc)
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    y, s = _quantize_groups(x, s_ptr, 1, MODE, FP8_MAX, EMAX, TR, TC, GR, GC, 1)
    _store_tile(q_ptr + b * stride_qb, s_ptr + b * stride_sb, y, s, pid, offs_r, offs_c, mask, rows, cols,
                cols, 1, n_sc, 1, n_sr, n_sc, MODE, TR, TC, GR, GC, pid_r, pid_c, IS_E4M3, SOFT)
    if HAS_T:
        tl.static_assert((MODE == 0) & (GR == TR) & (GC == TC), "HAS_T: one fp32 block per tile")
        xb = x_ptr + b * stride_xb + offs_c.to(tl.int64)[None, :] * stride_xc
        mc = (offs_c < cols)[None, :]
        r4 = pid_r * TR + 4 * tl.arange(0, TR // 4)  # row 4i of each quartet
        x0 = _load_rows(xb, r4, rows, mc, stride_xr)
        x1 = _load_rows(xb, r4 + 1, rows, mc, stride_xr)
        x2 = _load_rows(xb, r4 + 2, rows, mc, stride_xr)
        x3 = _load_rows(xb, r4 + 3, rows, mc, stride_xr)
        # the block's scale again from the same values (max is exact: the same bits as above)
        sc, _ = _fp32_scales(tl.maximum(tl.maximum(_tile_amax_bits(x0), _tile_amax_bits(x1)),
                                        tl.maximum(_tile_amax_bits(x2), _tile_amax_bits(x3))), FP8_MAX)
        w = (_code_i32(x0, sc, FP8_MAX, IS_E4M3, SOFT) | (_code_i32(x1, sc, FP8_MAX, IS_E4M3, SOFT) << 8)
             | (_code_i32(x2, sc, FP8_MAX, IS_E4M3, SOFT) << 16) | (_code_i32(x3, sc, FP8_MAX, IS_E4M3, SOFT) << 24))
        # stored through transposed addresses (the compiler's store-side layout conversion, on
        # 32-bit words): measured a little faster than tl.trans (1.157 vs 1.164 ms, Mixtral gate_up)
        wr = pid_r * (TR // 4) + tl.arange(0, TR // 4)
        qt_ptrs = qt_ptr + b * (stride_qb // 4) + offs_c.to(tl.int64)[None, :] * (rows // 4) + wr[:, None]
        tl.store(qt_ptrs, w, mask=(offs_c < cols)[None, :] & (wr < rows // 4)[:, None])


@triton.jit
def _load_rows(xb, r, rows, mc, stride_xr):
    """Rows ``r`` of a tile (column pointers ``xb``, column mask ``mc``), zeros past ``rows``."""
    return tl.load(xb + r.to(tl.int64)[:, None] * stride_xr, mask=(r < rows)[:, None] & mc, other=0.0)


@triton.jit
def _tile_amax_bits(x):
    """max |x| over a whole tile, as fp32 bits (see _abs_bits)."""
    return tl.max(tl.max(_abs_bits(x.to(tl.float32)), axis=1), axis=0)


@triton.jit
def _code_i32(x, scale, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, SOFT: tl.constexpr):
    """The FP8 codes of x * scale (clamped, NaN kept) as int32 values 0..255."""
    y = tl.clamp(x.to(tl.float32) * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return _fp8_bits(y, IS_E4M3, SOFT).to(tl.int32)


@triton.jit
def _fp8_codes(y, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, SOFT: tl.constexpr):
    """Scaled fp32 -> FP8 codes (uint8), saturating, RNE. On the GPU the hardware conversion is
    ``cvt.rn.satfinite``: it saturates to +-FP8_MAX and passes NaN, exactly what the clamp does,
    so the clamp is left out there (one instruction per element less); the interpreter's soft
    conversion needs the clamped input."""
    if SOFT:
        y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return _fp8_bits(y, IS_E4M3, SOFT)


@triton.jit
def _block_scales(amax_bits, MODE: tl.constexpr, FP8_MAX: tl.constexpr, EMAX: tl.constexpr):
    """(multiplier, scale to store) of a block amax: fp32 scales (MODE 0) or MX (MODE 1)."""
    if MODE == 1:
        return _mx_scales(amax_bits, EMAX)
    else:
        return _fp32_scales(amax_bits, FP8_MAX)


@triton.jit
def _load_raw(ptrs, mask, EVEN: tl.constexpr):
    """Load in the input dtype: unmasked when EVEN (the tile grid covers the tensor), else zeros outside."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _widen(v, RECONVERT: tl.constexpr):
    """Input values -> fp32 (exact). RECONVERT: bf16 by a shift of its bits, a different operation
    from the ``.to(tl.float32)`` of the first use, so the compiler keeps the 16-bit values live
    instead of the fp32 ones (half the registers, one instruction per element more)."""
    if RECONVERT and v.dtype == tl.bfloat16:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _dual_row_copy(v, q_ptr, s_ptr, r, c, mask, stride_q, stride_s, pid_c, rows, cols,
                   FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MODE: tl.constexpr, GC: tl.constexpr,
                   TQ: tl.constexpr, TC: tl.constexpr, EVEN: tl.constexpr, IS_E4M3: tl.constexpr,
                   SOFT: tl.constexpr):
    """One quarter [TQ, TC] (rows ``r``, input dtype ``v``) of the row-wise copy: 1 x GC blocks,
    codes and scales stored. Returns |x| as int32 bits (for the column amax)."""
    x = v.to(tl.float32)
    a = _abs_bits(x)
    amax = tl.max(tl.reshape(a, (TQ, TC // GC, GC)), axis=2)
    m, s = _block_scales(amax, MODE, FP8_MAX, EMAX)
    y = tl.reshape(tl.reshape(x, (TQ, TC // GC, GC)) * m[:, :, None], (TQ, TC))
    r64 = r.to(tl.int64)
    tl.store(q_ptr + r64[:, None] * stride_q + c[None, :], _fp8_codes(y, FP8_MAX, IS_E4M3, SOFT), mask=mask)
    sc = pid_c * (TC // GC) + tl.arange(0, TC // GC)
    smask = None if EVEN else (r < rows)[:, None] & (sc < tl.cdiv(cols, GC))[None, :]
    tl.store(s_ptr + r64[:, None] * stride_s + sc[None, :], s.to(s_ptr.dtype.element_ty), mask=smask)
    return a


@triton.jit
def _quant_fp8_dual_kernel(
    # pointers: input; row-wise copy + scales; transposed column-wise copy (int32 words) + scales
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
    # sizes
    rows, cols, n_tiles_c,
    # row strides: x (elements), q (bytes), s, qt (int32 words: rows / 4), st
    stride_x, stride_q, stride_s, stride_qt, stride_st,
    # meta-parameters
    FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MODE: tl.constexpr,
    GC: tl.constexpr, GR_T: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
    EVEN: tl.constexpr, RECONVERT: tl.constexpr, IS_E4M3: tl.constexpr, SOFT: tl.constexpr,
):
    """Both copies of ``quantize_fp8_with_trans`` for ``1 x GC`` row blocks and ``GR_T x 1``
    column blocks (BLOCKWISE 1x128 / 128x1, MX 1x32 / 32x1) from one read of a [TR, TC] tile.

    The tile is read as four row-interleaved quarters ``x_k = x[4i + k, :]`` (k = 0..3, each
    [TR/4, TC], 16-byte loads): element (i, c) of the four quarters lives in one thread, so the
    column-wise copy's codes of rows 4i..4i+3 pack into one int32 word in registers. The words
    [TR/4, TC] are transposed (4-byte elements through shared memory) and stored as rows of the
    transposed copy viewed as int32 ``[cols, rows/4]``: contiguous, vectorised stores, no byte
    scatter. Needs rows % 4 == 0. ``EVEN``: the tile grid covers x exactly (no masks)."""
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
    TQ: tl.constexpr = TR // 4
    i = pid_r * TQ + tl.arange(0, TQ)  # row quads
    c = pid_c * TC + tl.arange(0, TC)
    if EVEN:
        mask = None
    else:
        mask = (i < rows // 4)[:, None] & (c < cols)[None, :]
    base = x_ptr + (4 * i).to(tl.int64)[:, None] * stride_x + c[None, :]
    # the quarters stay in the input dtype (half the registers of fp32 for 16-bit inputs) and are
    # widened where used: the row-wise copy first, quarter by quarter, accumulating the column
    # amax; then the column-wise copy widens them again
    r0 = _load_raw(base, mask, EVEN)
    r1 = _load_raw(base + stride_x, mask, EVEN)
    r2 = _load_raw(base + 2 * stride_x, mask, EVEN)
    r3 = _load_raw(base + 3 * stride_x, mask, EVEN)
    acol = _dual_row_copy(r0, q_ptr, s_ptr, 4 * i + 0, c, mask, stride_q, stride_s, pid_c, rows, cols,
                          FP8_MAX, EMAX, MODE, GC, TQ, TC, EVEN, IS_E4M3, SOFT)
    acol = tl.maximum(acol, _dual_row_copy(r1, q_ptr, s_ptr, 4 * i + 1, c, mask, stride_q, stride_s, pid_c, rows,
                                           cols, FP8_MAX, EMAX, MODE, GC, TQ, TC, EVEN, IS_E4M3, SOFT))
    acol = tl.maximum(acol, _dual_row_copy(r2, q_ptr, s_ptr, 4 * i + 2, c, mask, stride_q, stride_s, pid_c, rows,
                                           cols, FP8_MAX, EMAX, MODE, GC, TQ, TC, EVEN, IS_E4M3, SOFT))
    acol = tl.maximum(acol, _dual_row_copy(r3, q_ptr, s_ptr, 4 * i + 3, c, mask, stride_q, stride_s, pid_c, rows,
                                           cols, FP8_MAX, EMAX, MODE, GC, TQ, TC, EVEN, IS_E4M3, SOFT))

    # column-wise copy: blocks of GR_T rows = GR_T / 4 quads, all four quarters
    NB: tl.constexpr = TR // GR_T
    acol = tl.max(tl.reshape(acol, (NB, GR_T // 4, TC)), axis=1)
    mcol, scol = _block_scales(acol, MODE, FP8_MAX, EMAX)
    mcol = mcol[:, None, :]
    y0 = tl.reshape(tl.reshape(_widen(r0, RECONVERT), (NB, GR_T // 4, TC)) * mcol, (TQ, TC))
    y1 = tl.reshape(tl.reshape(_widen(r1, RECONVERT), (NB, GR_T // 4, TC)) * mcol, (TQ, TC))
    y2 = tl.reshape(tl.reshape(_widen(r2, RECONVERT), (NB, GR_T // 4, TC)) * mcol, (TQ, TC))
    y3 = tl.reshape(tl.reshape(_widen(r3, RECONVERT), (NB, GR_T // 4, TC)) * mcol, (TQ, TC))
    # rows 4i..4i+3 of column c as two in-thread dims: element [.., h, l] is row 4i + 2h + l (join
    # stacks along a new last dim), so the hardware cast converts rows 2h, 2h + 1 in one
    # instruction; little-endian word byte k = row 4i + k, the transposed copy's byte order
    b = _fp8_codes(tl.join(tl.join(y0, y2), tl.join(y1, y3)), FP8_MAX, IS_E4M3, SOFT).to(tl.uint32)
    sh = (tl.arange(0, 2) * 8).to(tl.uint32)
    w = tl.sum(tl.sum(b << sh[None, None, None, :], axis=3) << (2 * sh)[None, None, :], axis=2)
    wt = tl.trans(w.to(tl.int32, bitcast=True))  # [TC, TQ]: row c of the transposed copy
    qt_ptrs = qt_ptr + c.to(tl.int64)[:, None] * stride_qt + i[None, :]
    tl.store(qt_ptrs, wt, mask=None if EVEN else tl.trans(mask))
    sb = pid_r * NB + tl.arange(0, NB)
    st_ptrs = st_ptr + c.to(tl.int64)[None, :] * stride_st + sb[:, None]
    smask = None if EVEN else (sb < tl.cdiv(rows, GR_T))[:, None] & (c < cols)[None, :]
    tl.store(st_ptrs, scol.to(st_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _staged_scales(scr, n: tl.constexpr, FP8_MAX: tl.constexpr):
    """Load ``n`` block amaxes (int32 bits) staged at ``scr`` and form their fp32 scales with
    one element per thread (a 1-D layout: no replication across the threads of a block)."""
    return _fp32_scales(tl.load(scr + tl.arange(0, n)), FP8_MAX)


@triton.jit
def _quant_fp8_dual_staged_kernel(
    # pointers: as _quant_fp8_dual_kernel, plus a per-program fp32 scratch of TR * TC / GC + TR / GR_T * TC
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, scr_ptr,
    rows, cols, n_tiles_c,
    stride_x, stride_q, stride_s, stride_qt, stride_st,
    FP8_MAX: tl.constexpr, GC: tl.constexpr, GR_T: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
    EVEN: tl.constexpr, IS_E4M3: tl.constexpr, SOFT: tl.constexpr,
):
    """``_quant_fp8_dual_kernel`` for fp32 block scales (BLOCKWISE) with the scale divisions done
    once per block. In the register layout of the tile every block amax is held by all the
    threads that share its row (or column): 16 threads compute the same two IEEE divisions (a
    third of the kernel's instructions). Here the amaxes are staged in a per-program scratch
    (global memory, L1/L2-resident), the program synchronises (``bar.sync`` orders the global
    accesses of the program's threads), each thread forms the scales of one or two blocks
    (1-D layout), stores the scale_inv outputs and writes the multipliers back, synchronises
    again, and the quantization passes read their multipliers from the scratch. Same outputs
    bit for bit."""
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
    TQ: tl.constexpr = TR // 4
    NR: tl.constexpr = TC // GC   # row blocks per tile row
    NB: tl.constexpr = TR // GR_T  # column blocks per tile column
    NS_R: tl.constexpr = TR * NR
    scr = (scr_ptr + pid.to(tl.int64) * (NS_R + NB * TC)).to(tl.pointer_type(tl.int32))  # amax bits first
    i = pid_r * TQ + tl.arange(0, TQ)
    li = tl.arange(0, TQ)  # local quad index
    c = pid_c * TC + tl.arange(0, TC)
    if EVEN:
        mask = None
    else:
        mask = (i < rows // 4)[:, None] & (c < cols)[None, :]
    base = x_ptr + (4 * i).to(tl.int64)[:, None] * stride_x + c[None, :]
    x0 = _load_raw(base, mask, EVEN).to(tl.float32)
    x1 = _load_raw(base + stride_x, mask, EVEN).to(tl.float32)
    x2 = _load_raw(base + 2 * stride_x, mask, EVEN).to(tl.float32)
    x3 = _load_raw(base + 3 * stride_x, mask, EVEN).to(tl.float32)
    a0, a1, a2, a3 = _abs_bits(x0), _abs_bits(x1), _abs_bits(x2), _abs_bits(x3)
    # stage the amaxes: row blocks at [local row, block], column blocks after them at [b, c]
    j = tl.arange(0, NR)
    tl.store(scr + (4 * li + 0)[:, None] * NR + j[None, :], tl.max(tl.reshape(a0, (TQ, NR, GC)), axis=2))
    tl.store(scr + (4 * li + 1)[:, None] * NR + j[None, :], tl.max(tl.reshape(a1, (TQ, NR, GC)), axis=2))
    tl.store(scr + (4 * li + 2)[:, None] * NR + j[None, :], tl.max(tl.reshape(a2, (TQ, NR, GC)), axis=2))
    tl.store(scr + (4 * li + 3)[:, None] * NR + j[None, :], tl.max(tl.reshape(a3, (TQ, NR, GC)), axis=2))
    acol = tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3))
    acol = tl.max(tl.reshape(acol, (NB, GR_T // 4, TC)), axis=1)
    lb = tl.arange(0, NB)
    lc = tl.arange(0, TC)
    tl.store(scr + NS_R + lb[:, None] * TC + lc[None, :], acol)
    tl.debug_barrier()
    m_r, inv_r = _staged_scales(scr, NS_R, FP8_MAX)
    m_c, inv_c = _staged_scales(scr + NS_R, NB * TC, FP8_MAX)
    # every thread has read its amaxes before any multiplier overwrites them (a 1-D tensor
    # smaller than the program is replicated: its copies must not read a rewritten slot)
    tl.debug_barrier()
    tl.store(scr + tl.arange(0, NS_R), m_r.to(tl.int32, bitcast=True))
    tl.store(scr + NS_R + tl.arange(0, NB * TC), m_c.to(tl.int32, bitcast=True))
    # the scale_inv outputs, from the 1-D layout
    e = tl.arange(0, NS_R)
    sr = pid_r * TR + e // NR
    sc = pid_c * NR + e % NR
    tl.store(s_ptr + sr.to(tl.int64) * stride_s + sc, inv_r,
             mask=None if EVEN else (sr < rows) & (sc < tl.cdiv(cols, GC)))
    e = tl.arange(0, NB * TC)
    sb = pid_r * NB + e // TC
    cc = pid_c * TC + e % TC
    tl.store(st_ptr + cc.to(tl.int64) * stride_st + sb, inv_c,
             mask=None if EVEN else (sb < tl.cdiv(rows, GR_T)) & (cc < cols))
    tl.debug_barrier()
    scr_m = scr.to(tl.pointer_type(tl.float32))
    # row-wise copy
    _staged_row_copy(x0, scr_m + (4 * li + 0)[:, None] * NR + j[None, :], q_ptr, 4 * i + 0, c, mask, stride_q,
                     FP8_MAX, GC, TQ, TC, NR, IS_E4M3, SOFT)
    _staged_row_copy(x1, scr_m + (4 * li + 1)[:, None] * NR + j[None, :], q_ptr, 4 * i + 1, c, mask, stride_q,
                     FP8_MAX, GC, TQ, TC, NR, IS_E4M3, SOFT)
    _staged_row_copy(x2, scr_m + (4 * li + 2)[:, None] * NR + j[None, :], q_ptr, 4 * i + 2, c, mask, stride_q,
                     FP8_MAX, GC, TQ, TC, NR, IS_E4M3, SOFT)
    _staged_row_copy(x3, scr_m + (4 * li + 3)[:, None] * NR + j[None, :], q_ptr, 4 * i + 3, c, mask, stride_q,
                     FP8_MAX, GC, TQ, TC, NR, IS_E4M3, SOFT)
    # column-wise copy
    mcol = tl.load(scr_m + NS_R + lb[:, None] * TC + lc[None, :])[:, None, :]
    y0 = tl.reshape(tl.reshape(x0, (NB, GR_T // 4, TC)) * mcol, (TQ, TC))
    y1 = tl.reshape(tl.reshape(x1, (NB, GR_T // 4, TC)) * mcol, (TQ, TC))
    y2 = tl.reshape(tl.reshape(x2, (NB, GR_T // 4, TC)) * mcol, (TQ, TC))
    y3 = tl.reshape(tl.reshape(x3, (NB, GR_T // 4, TC)) * mcol, (TQ, TC))
    b = _fp8_codes(tl.join(tl.join(y0, y2), tl.join(y1, y3)), FP8_MAX, IS_E4M3, SOFT).to(tl.uint32)
    sh = (tl.arange(0, 2) * 8).to(tl.uint32)
    w = tl.sum(tl.sum(b << sh[None, None, None, :], axis=3) << (2 * sh)[None, None, :], axis=2)
    wt = tl.trans(w.to(tl.int32, bitcast=True))
    tl.store(qt_ptr + c.to(tl.int64)[:, None] * stride_qt + i[None, :], wt, mask=None if EVEN else tl.trans(mask))


@triton.jit
def _staged_row_copy(x, m_ptrs, q_ptr, r, c, mask, stride_q, FP8_MAX: tl.constexpr, GC: tl.constexpr,
                     TQ: tl.constexpr, TC: tl.constexpr, NR: tl.constexpr, IS_E4M3: tl.constexpr,
                     SOFT: tl.constexpr):
    m = tl.load(m_ptrs)  # [TQ, NR] multipliers
    y = tl.reshape(tl.reshape(x, (TQ, NR, GC)) * m[:, :, None], (TQ, TC))
    tl.store(q_ptr + r.to(tl.int64)[:, None] * stride_q + c[None, :], _fp8_codes(y, FP8_MAX, IS_E4M3, SOFT),
             mask=mask)


@triton.jit
def _quant_fp8_long_kernel(
    # pointers
    x_ptr, q_ptr, s_ptr,
    # sizes
    rows, cols,
    # strides in x's (row, col) coordinates; the scale is indexed by the strip
    stride_xr, stride_xc, stride_qr, stride_qc, stride_s,
    # meta-parameters
    FP8_MAX: tl.constexpr, ALONG_COLS: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
    IS_E4M3: tl.constexpr, SOFT: tl.constexpr,
):
    """ROWWISE over strips too long for a tile: each program owns TR rows (ALONG_COLS: groups are
    rows) or TC columns (groups are columns) and walks the long dim twice: amax, then cast."""
    pid = tl.program_id(0)
    if ALONG_COLS:
        offs_r = pid * TR + tl.arange(0, TR)
        acc = tl.zeros((TR, TC), dtype=tl.int32)
        for c0 in range(0, cols, TC):
            offs_c = c0 + tl.arange(0, TC)
            m = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
            x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_xr + offs_c.to(tl.int64)[None, :] * stride_xc,
                        mask=m, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, _abs_bits(x))
        scale, scale_inv = _fp32_scales(tl.max(acc, axis=1), FP8_MAX)
        for c0 in range(0, cols, TC):
            offs_c = c0 + tl.arange(0, TC)
            m = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
            x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_xr + offs_c.to(tl.int64)[None, :] * stride_xc,
                        mask=m, other=0.0).to(tl.float32)
            y = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_ptr + offs_r.to(tl.int64)[:, None] * stride_qr + offs_c.to(tl.int64)[None, :] * stride_qc,
                     _fp8_bits(y, IS_E4M3, SOFT), mask=m)
        tl.store(s_ptr + offs_r.to(tl.int64) * stride_s, scale_inv, mask=offs_r < rows)
    else:
        offs_c = pid * TC + tl.arange(0, TC)
        acc = tl.zeros((TR, TC), dtype=tl.int32)
        for r0 in range(0, rows, TR):
            offs_r = r0 + tl.arange(0, TR)
            m = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
            x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_xr + offs_c.to(tl.int64)[None, :] * stride_xc,
                        mask=m, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, _abs_bits(x))
        scale, scale_inv = _fp32_scales(tl.max(acc, axis=0), FP8_MAX)
        for r0 in range(0, rows, TR):
            offs_r = r0 + tl.arange(0, TR)
            m = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
            x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_xr + offs_c.to(tl.int64)[None, :] * stride_xc,
                        mask=m, other=0.0).to(tl.float32)
            y = tl.clamp(x * scale[None, :], -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_ptr + offs_r.to(tl.int64)[:, None] * stride_qr + offs_c.to(tl.int64)[None, :] * stride_qc,
                     _fp8_bits(y, IS_E4M3, SOFT), mask=m)
        tl.store(s_ptr + offs_c.to(tl.int64) * stride_s, scale_inv, mask=offs_c < cols)


@triton.jit
def _transpose_bytes_kernel(
    src_ptr, dst_ptr,
    rows, cols, n_tiles_r, n_tiles_c,
    stride_sg, stride_sr, stride_sc, stride_dg, stride_dc, stride_dr,
    T: tl.constexpr,
):
    """dst[g, c, r] = src[g, r, c] for 1-byte elements, any strides; program = (batch, T x T tile).
    The tile is widened to int32 for the transpose: an 8-bit register transpose is the pattern
    that miscompiled on sm_90 (see fp8_quant_with_trans_launch); the widening costs registers only."""
    pid = tl.program_id(0)
    tiles = n_tiles_r * n_tiles_c
    g = (pid // tiles).to(tl.int64)
    t = pid % tiles
    pid_r = t // n_tiles_c
    pid_c = t % n_tiles_c
    r = pid_r * T + tl.arange(0, T)
    c = pid_c * T + tl.arange(0, T)
    r64, c64 = r.to(tl.int64), c.to(tl.int64)
    m = (r < rows)[:, None] & (c < cols)[None, :]
    v = tl.load(src_ptr + g * stride_sg + r64[:, None] * stride_sr + c64[None, :] * stride_sc, mask=m, other=0)
    vt = tl.trans(v.to(tl.int32)).to(tl.uint8)
    mt = (c < cols)[:, None] & (r < rows)[None, :]
    tl.store(dst_ptr + g * stride_dg + c64[:, None] * stride_dc + r64[None, :] * stride_dr, vt, mask=mt)


def transpose_bytes(src: torch.Tensor, dst: torch.Tensor, tile: "tuple[int, int] | None" = None) -> torch.Tensor:
    """``dst.copy_(src.transpose(-2, -1))`` for 1-byte tensors (FP8, packed FP4, E8M0, uint8), at
    copy speed (torch's generic strided copy of a byte transpose runs far below it): ``src [R, C]``
    -> ``dst [C, R]``, or batched ``src [G, R, C]`` -> ``dst [G, C, R]`` in one launch. Any strides
    (16-byte vector accesses where the unit-stride dims and the other strides allow them).
    ``tile=(T, num_warps)`` overrides the 64 x 64, 4-warp launch (for tuning; same bytes)."""
    if src.dim() not in (2, 3) or dst.dim() != src.dim():
        raise ValueError(f"transpose_bytes: src and dst must both be 2-D or 3-D, got {tuple(src.shape)} and "
                         f"{tuple(dst.shape)}")
    if src.element_size() != 1 or dst.element_size() != 1:
        raise TypeError(f"transpose_bytes: 1-byte dtypes only, got {src.dtype} and {dst.dtype}")
    s3 = src if src.dim() == 3 else src.unsqueeze(0)
    d3 = dst if dst.dim() == 3 else dst.unsqueeze(0)
    G, rows, cols = s3.shape
    if tuple(d3.shape) != (G, cols, rows):
        raise ValueError(f"transpose_bytes: dst must be the transposed shape of src {tuple(src.shape)}, got "
                         f"{tuple(dst.shape)}")
    if G == 0 or rows == 0 or cols == 0:
        return dst
    t, nw = tile if tile is not None else (64, 4)
    if t < 16 or t & (t - 1) or nw not in (1, 2, 4, 8, 16):
        raise ValueError(f"transpose_bytes: tile (T, num_warps) needs a power-of-two T >= 16 and num_warps in "
                         f"1, 2, 4, 8, 16, got {tuple(tile)}")
    n_tr, n_tc = cdiv(rows, t), cdiv(cols, t)
    s3, d3 = s3.view(torch.uint8), d3.view(torch.uint8)
    launch(_transpose_bytes_kernel, (G * n_tr * n_tc,), (
        s3, d3, rows, cols, n_tr, n_tc, *s3.stride(), *d3.stride(),
    ), dict(
        T=t, num_warps=nw
    ), s3.device)
    return dst


@triton.jit
def _dequant_fp8_kernel(
    # pointers
    q_ptr, s_ptr, out_ptr,
    # sizes
    rows, cols, n_tiles_c,
    # strides (q and out are row-major [rows, cols]; the scale grid has its own)
    stride_qr, stride_or, stride_sr, stride_sc,
    # meta-parameters
    MODE: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
    IS_E4M3: tl.constexpr, SOFT: tl.constexpr,
):
    """out = q * scale_inv[r // GR, c // GC] (fp32 product, cast to out's dtype)."""
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
    offs_r = pid_r * TR + tl.arange(0, TR)
    offs_c = pid_c * TC + tl.arange(0, TC)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    r64 = offs_r.to(tl.int64)
    c64 = offs_c.to(tl.int64)
    q = _fp8_value(tl.load(q_ptr + r64[:, None] * stride_qr + c64[None, :], mask=mask, other=0), IS_E4M3, SOFT)
    if MODE == 2:
        s = tl.load(s_ptr)
        x = q * s
    else:
        s_ptrs = s_ptr + (r64 // GR)[:, None] * stride_sr + (c64 // GC)[None, :] * stride_sc
        if MODE == 1:
            e = tl.load(s_ptrs, mask=mask, other=127).to(tl.int32)
            bits = tl.where(e == 255, 0x7FC00000, tl.where(e == 0, 0x00400000, e << 23))
            s = bits.to(tl.float32, bitcast=True)
        else:
            s = tl.load(s_ptrs, mask=mask, other=1.0)
        x = q * s
    tl.store(out_ptr + r64[:, None] * stride_or + c64[None, :], _round_for_store(x, out_ptr, SOFT), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantGrouping:
    """One grouping of a 2-D tensor: block (gr, gc) in x's coordinates, and how scales are formed.

    ``mode``: 0 fp32 scales (ROWWISE / BLOCKWISE), 1 MX E8M0, 2 TENSORWISE. ``gr``/``gc`` are the
    true block extents (ROWWISE: the full row/column length)."""

    mode: int
    gr: int
    gc: int

    def padded(self) -> tuple[int, int]:
        """Block extents as the tile kernel sees them (powers of two; 1 for TENSORWISE)."""
        if self.mode == _MODE_TENSOR:
            return 1, 1
        return next_pow2(self.gr), next_pow2(self.gc)

    def scale_grid(self, rows: int, cols: int) -> tuple[int, int]:
        if self.mode == _MODE_TENSOR:
            return 1, 1
        return cdiv(rows, self.gr), cdiv(cols, self.gc)


def tile_config(rows: int, cols: int, groups: tuple[tuple[int, int], ...], with_trans: bool = False):
    """(TR, TC, num_warps) for a memory-bound tile pass.

    Heuristic: the tile must hold whole (power-of-two padded) blocks of every grouping. Single
    output: TC = up to 1024 columns (>= 64 bytes contiguous per row for every dtype), TR chosen so
    the tile has ~8192 elements (16 KiB of bf16 per program: with 2+ programs per SM that keeps
    ~32 KiB in flight per SM, what HBM3e needs at ~600 ns latency), never taller than the tensor.
    With a transposed output: a square 128 x 128 tile, 4 warps (the H200 sweep's best), so both
    copies are written in rows of >= 128 contiguous bytes.
    Warps: 4 up to 2048 elements, 8 up to 8192, 16 above (<= 32 fp32 registers of x per thread),
    except 4 for a 128 x 128 tile (measured).
    """
    need_r = max(g[0] for g in groups)
    need_c = max(g[1] for g in groups)
    if with_trans:
        # measured on the H200 (scripts/tune_memory_bound.py): a 128 x 128 tile with 4 warps
        # is the fastest two-copy configuration for 1x32, 1x128 and 128x128 blocks alike
        t = max(128, need_r, need_c)
        tr = tc = t
    else:
        tc = max(need_c, min(next_pow2(max(cols, 1)), 1024))
        tr = max(need_r, min(max(1, _TARGET_TILE // tc), next_pow2(max(rows, 1))))
        tc = max(need_c, min(tc, max(1, _TARGET_TILE // tr)))  # tall blocks: narrower tiles
    n = tr * tc
    num_warps = 4 if n <= 2048 else (8 if n <= 8192 else 16)
    if with_trans or (tr, tc) == (128, 128):
        # 128 x 128 (the b x b weight blocks' tile): 4 warps measured fastest on the H200, bf16
        # [184320, 2880] (scripts/tune_gptoss_memory.py): 0.376 ms (1.00x the device copy) against
        # 0.408 (16 warps) and 0.402 (8); same bytes whatever the warps
        num_warps = 4
    return tr, tc, num_warps


@functools.lru_cache(maxsize=None)
def fp8_max_of(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def mx_emax_of(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float8_e4m3fn else 15


@functools.lru_cache(maxsize=4096)
def _single_plan(rows: int, cols: int, grouping: QuantGrouping):
    """Launch geometry of a one-grouping tile pass, cached per shape: the host work of a
    quantizer call is a few dict lookups, not a re-derivation (calls repeat the same shapes
    every step, and on a slow host CPU this bookkeeping is a good part of a small call's time).
    Returns (gr, gc, tr, tc, num_warps, n_programs, n_tc, n_sr, n_sc)."""
    gr, gc = grouping.padded()
    tr, tc, nw = tile_config(rows, cols, ((gr, gc),))
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    n_sr, n_sc = grouping.scale_grid(rows, cols)
    return gr, gc, tr, tc, nw, n_tr * n_tc, n_tc, n_sr, n_sc


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


#: the most partial maxima the amax kernel leaves (its programs); the tile kernel reduces them
#: all in every program (AMAX_SLOTS), so this stays small: 1024 ints, 4 KiB read from L2
AMAX_SLOTS = 1024
_AMAX_BLOCK = 4096


def amax_programs(x: torch.Tensor) -> int:
    """How many programs (and partial maxima) the TENSORWISE amax pass of ``x`` uses."""
    n = x.numel()
    if x.is_cuda:
        n_sm = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())
        progs = min(cdiv(n, _AMAX_BLOCK), 4 * n_sm, AMAX_SLOTS)
    else:
        progs = min(cdiv(n, _AMAX_BLOCK), 8)
    return max(progs, 1)


def amax_launch(x: torch.Tensor, partials: torch.Tensor) -> None:
    """The amax pass of a contiguous ``x`` into ``partials`` (int32, ``amax_programs(x)`` of them,
    any prior contents: every one is written): slot p holds the max |x| bits over program p's
    blocks (p, p + P, p + 2P, ... of 4096 elements), 0 for a program without elements."""
    progs = amax_programs(x)
    if partials.dtype != torch.int32 or partials.numel() != progs:
        raise ValueError(f"amax_launch: partials must be {progs} int32 values for x of {x.numel()} elements, got "
                         f"{partials.numel()} {partials.dtype}")
    n = x.numel()
    launch(_amax_kernel, (progs,), (
        x, partials, n, cdiv(cdiv(n, _AMAX_BLOCK), progs),
    ), dict(
        BLOCK=_AMAX_BLOCK, NUM_PROGS=progs, num_warps=8
    ), x.device)


def _amax_bits(x: torch.Tensor) -> "tuple[torch.Tensor, int]":
    """(partials, n): max |x| as fp32 bits is the max of the ``n`` int32 partials (TENSORWISE
    first pass, on x's device). Every partial is written by the kernel: no zero fill."""
    progs = amax_programs(x)
    amax = torch.empty(progs, dtype=torch.int32, device=x.device)
    amax_launch(x, amax)
    return amax, progs


def _scale_tensor(grouping: QuantGrouping, rows: int, cols: int, transposed: bool, device) -> tuple:
    """(scale tensor, its (row, col) strides in block coordinates, grid extents)."""
    sr, sc = grouping.scale_grid(rows, cols)
    dtype = torch.uint8 if grouping.mode == _MODE_MX else torch.float32
    if grouping.mode == _MODE_TENSOR:
        return torch.empty((), dtype=torch.float32, device=device), (0, 0), (1, 1)
    if transposed:
        s = torch.empty((sc, sr), dtype=dtype, device=device)
        return s, (1, sr), (sr, sc)
    s = torch.empty((sr, sc), dtype=dtype, device=device)
    return s, (sc, 1), (sr, sc)


def _long_rowwise(x: torch.Tensor, out: torch.Tensor, out_strides, scale: torch.Tensor, along_cols: bool, fmax):
    rows, cols = x.shape
    if along_cols:
        tr, tc = 1, 4096
        grid = (rows,)
    else:
        tr, tc = 64, 64
        grid = (cdiv(cols, tc),)
    launch(_quant_fp8_long_kernel, grid, (
        x, out.view(torch.uint8), scale, rows, cols, x.stride(0), x.stride(1), out_strides[0], out_strides[1],
        1,
    ), dict(
        FP8_MAX=fmax, ALONG_COLS=along_cols, TR=tr, TC=tc, IS_E4M3=out.dtype == torch.float8_e4m3fn,
        SOFT=is_interpreter(), num_warps=8
    ), x.device)


@functools.lru_cache(maxsize=1024)
def _fits_tile(g: QuantGrouping) -> bool:
    pr, pc = g.padded()
    if pr * pc > MAX_TILE_GROUP:
        return False
    # a column group taller than 256 would leave < 32 columns per tile: uncoalesced
    return not (g.gc == 1 and pr > 256)


def fp8_quant_launch(x: torch.Tensor, out_dtype: torch.dtype, grouping: QuantGrouping, tile: "tuple | None" = None,
                     st: "torch.Tensor | None" = None):
    """Quantize a contiguous 2-D ``x`` with one grouping. Returns ``(q [rows, cols], scale)``;
    ``scale`` is ``[n_sr, n_sc]`` (fp32, or uint8 E8M0 bytes for MX) or 0-dim for TENSORWISE.
    ``tile=(TR, TC, num_warps)`` overrides :func:`tile_config` for blocks that fit a tile (for
    tuning, scripts/tune_gptoss_memory.py): a tile holds whole blocks, so the bytes are the same.
    ``st``: also write the scales, transposed, into this ``[n_sc, n_sr]`` tensor (0-dim for
    TENSORWISE) in the same launch: the transposed copy's scales of a grouping that transposes
    with the tensor (:func:`fp8_quant_with_trans_launch`)."""
    rows, cols = x.shape
    fmax = fp8_max_of(out_dtype)
    q = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    twice = st is not None
    if grouping.mode == _MODE_TENSOR:
        if not x.is_contiguous():  # read as one flat row below
            raise ValueError(f"fp8_quant_launch: TENSORWISE needs a contiguous x, got strides {tuple(x.stride())}")
        amax, n_amax = _amax_bits(x)
        s = torch.empty((), dtype=torch.float32, device=x.device)
        n = rows * cols
        tr, tc, nw = 1, 8192, 8
        n_tc = cdiv(n, tc)
        # x is contiguous: its [1, n] view's strides are (n, 1), passed as numbers (no view op)
        launch(_quant_fp8_tile_kernel, (n_tc,), (
            x, q.view(torch.uint8), s, q, st if twice else s, amax, 1, n, n_tc, n_amax, n, 1, n, 1, 0, 0, n, 1,
            0, 0, 1, 1, 1, 1,
        ), dict(
            FP8_MAX=fmax, EMAX=0, MODE=_MODE_TENSOR, GR=1, GC=1, HAS_T=False, MODE_T=_MODE_TENSOR, GR_T=1,
            GC_T=1, TR=tr, TC=tc, IS_E4M3=out_dtype == torch.float8_e4m3fn, SOFT=is_interpreter(),
            AMAX_SLOTS=AMAX_SLOTS, S_TWICE=twice, num_warps=nw
        ), x.device)
        return q, s
    if not _fits_tile(grouping):
        if twice:
            raise ValueError(f"fp8_quant_launch: st (the scales written twice) needs blocks that fit a tile, got "
                             f"{grouping}")
        s, _, _ = _scale_tensor(grouping, rows, cols, False, x.device)
        _long_rowwise(x, q, (cols, 1), s.view(-1), grouping.gr == 1, fmax)
        return q, s
    gr, gc, tr, tc, nw, n_prog, n_tc, n_sr, n_sc = _single_plan(rows, cols, grouping)
    if tile is not None:
        tr, tc, nw = (int(v) for v in tile)
        if tr < gr or tc < gc or tr & (tr - 1) or tc & (tc - 1) or nw not in (1, 2, 4, 8, 16):
            raise ValueError(f"fp8_quant_launch: tile {tuple(tile)} must be powers of two holding whole "
                             f"{gr} x {gc} blocks, with num_warps in 1, 2, 4, 8, 16")
        n_tc = cdiv(cols, tc)
        n_prog = cdiv(rows, tr) * n_tc
    s = torch.empty((n_sr, n_sc), dtype=torch.uint8 if grouping.mode == _MODE_MX else torch.float32, device=x.device)
    # st [n_sc, n_sr] contiguous: element (block row r, block col c) of x's grid at c * n_sr + r
    launch(_quant_fp8_tile_kernel, (n_prog,), (
        x, q.view(torch.uint8), s, q, st if twice else s, s, rows, cols, n_tc, 1, x.stride(0), x.stride(1), cols,
        1, n_sc, 1, 0, 0, 1 if twice else 0, n_sr if twice else 0, n_sr, n_sc, 1, 1,
    ), dict(
        FP8_MAX=fmax, EMAX=mx_emax_of(out_dtype), MODE=grouping.mode, GR=gr, GC=gc, HAS_T=False,
        MODE_T=grouping.mode, GR_T=gr, GC_T=gc, TR=tr, TC=tc, IS_E4M3=out_dtype == torch.float8_e4m3fn,
        SOFT=is_interpreter(), AMAX_SLOTS=1, S_TWICE=twice, num_warps=nw
    ), x.device)
    return q, s


#: the most matrices one batched launch covers (the grid's second dimension)
_MAX_GRID_Y = 65535


def batched_trans_ok(rows: int, grouping: QuantGrouping) -> bool:
    """Can :func:`fp8_quant_batched_launch` form the transposed copy too (``with_trans``)? It needs
    128 x 128 fp32 blocks (one block per 128 x 128 tile) and ``rows % 4 == 0``."""
    return grouping.mode == _MODE_FP32 and grouping.gr == grouping.gc == 128 and rows % 4 == 0


def fp8_quant_batched_launch(x: torch.Tensor, out_dtype: torch.dtype, grouping: QuantGrouping,
                             with_trans: bool = False):
    """Quantize each matrix of a 3-D ``x [B, rows, cols]`` with one grouping (fp32 BLOCKWISE or MX,
    blocks that fit one tile) in one launch, bit-identical to :func:`fp8_quant_launch` on every
    ``x[b]`` followed by ``torch.stack``: blocks never straddle two matrices, whatever ``rows``.
    Returns ``(q [B, rows, cols], scale [B, n_sr, n_sc])``; with ``with_trans`` (128 x 128 fp32
    blocks, whose grid transposes with the matrix; rows % 4 == 0: :func:`batched_trans_ok`) also
    ``qt [B, cols, rows]``, each matrix's codes transposed (``q.transpose(1, 2)`` bit for bit), in
    the same launch (the tile's second read comes from L2). ``x`` may have any strides (a
    contiguous ``x`` reads fastest). The launch geometry per matrix is
    :func:`fp8_quant_launch`'s."""
    if x.dim() != 3:
        raise ValueError(f"fp8_quant_batched_launch: expected a 3-D tensor, got shape {tuple(x.shape)}")
    if grouping.mode == _MODE_TENSOR or not _fits_tile(grouping):
        raise ValueError(f"fp8_quant_batched_launch: {grouping} needs blocks that fit one tile (not "
                         "TENSORWISE, not a long ROWWISE row)")
    nb, rows, cols = x.shape
    if with_trans and not batched_trans_ok(rows, grouping):
        raise ValueError(f"fp8_quant_batched_launch: the transposed copy needs 128 x 128 fp32 blocks and rows % 4 == 0, "
                         f"got {grouping} and rows={rows}")
    if with_trans and x.is_cuda:
        # the Hopper Gluon twin (the same bytes, one read, no shared-memory transpose) where it runs
        # and PRIMUS_TURBO_FP8_WEIGHT_GLUON (docs/env_vars.md) does not say no
        from .gather_quant_gluon import gluon_switch
        from .quant_fp8_gluon import WEIGHT_COPIES_GLUON_ENV, weight_copies_gluon, weight_copies_gluon_reason

        if gluon_switch(WEIGHT_COPIES_GLUON_ENV) is not False and weight_copies_gluon_reason(x, out_dtype) is None:
            return weight_copies_gluon(x, out_dtype)
    gr, gc, tr, tc, nw, n_prog, n_tc, n_sr, n_sc = _single_plan(rows, cols, grouping)
    if with_trans:
        # 8 warps: the configuration timed on the H200 (scripts/diag_weight_copies.py; 4 warps not
        # timed for this form)
        nw = max(nw, 8)
    q = torch.empty((nb, rows, cols), dtype=out_dtype, device=x.device)
    qt = torch.empty((nb, cols, rows), dtype=out_dtype, device=x.device) if with_trans else None
    s = torch.empty((nb, n_sr, n_sc), dtype=torch.uint8 if grouping.mode == _MODE_MX else torch.float32,
                    device=x.device)
    if q.numel() == 0:
        return (q, s, qt) if with_trans else (q, s)
    q8 = q.view(torch.uint8)
    qt32 = qt.view(torch.uint8).view(torch.int32) if with_trans else None
    for b0 in range(0, nb, _MAX_GRID_Y):  # one launch for any realistic batch (<= 65535 matrices)
        xs, qs, ss = (x, q8, s) if b0 == 0 else (x[b0:], q8[b0:], s[b0:])
        qts = None if qt32 is None else qt32[b0:]
        _quant_fp8_tile_batched_kernel[(n_prog, min(_MAX_GRID_Y, nb - b0))](
            xs, qs, ss, rows, cols, n_tc,
            x.stride(0), x.stride(1), x.stride(2), rows * cols, n_sr * n_sc,
            n_sr, n_sc,
            FP8_MAX=fp8_max_of(out_dtype), EMAX=mx_emax_of(out_dtype), MODE=grouping.mode, GR=gr, GC=gc,
            TR=tr, TC=tc, IS_E4M3=out_dtype == torch.float8_e4m3fn, SOFT=is_interpreter(),
            qt_ptr=qts, HAS_T=with_trans, num_warps=nw,
        )
    return (q, s, qt) if with_trans else (q, s)


def fp8_quant_with_trans_launch(x: torch.Tensor, out_dtype: torch.dtype, row: QuantGrouping, col: QuantGrouping,
                                tile: "tuple | None" = None):
    """One read of a contiguous 2-D ``x``: ``q [rows, cols]`` quantized with ``row`` and the
    column-wise copy ``qt [cols, rows]`` (stored transposed) quantized with ``col``; their scales
    (``col``'s stored transposed too: ``[n_sc, n_sr]``).

    ``1 x g`` row blocks with ``g x 1`` column blocks (BLOCKWISE, MX) run the two-copy kernel
    ``_quant_fp8_dual_kernel`` when rows % 4 == 0, with :func:`with_trans_config`'s tile;
    other groupings and shapes the generic tile kernel. ROWWISE (a block spanning a whole row or
    column) cannot be formed from one tile: it runs as two launches (row copy, then the
    transposed column copy), reading x twice. ``tile`` overrides the default (for tuning):
    ``(TR, TC, num_warps[, maxnreg])`` for the two-copy kernel (where it applies), ``(edge,
    num_warps)`` for the generic kernel with a square tile."""
    rows, cols = x.shape
    fmax = fp8_max_of(out_dtype)
    dev = x.device
    tensorwise = row.mode == _MODE_TENSOR
    if tensorwise != (col.mode == _MODE_TENSOR):
        raise ValueError("fp8_quant_with_trans_launch: TENSORWISE must be used for both copies or neither")
    if (row.mode, row.gr, row.gc) == (col.mode, col.gr, col.gc):
        # TENSORWISE or b x b blocks: the column-wise copy is the row-wise one transposed, with
        # the scale grid transposed. The copy is a byte transpose after one quantization pass.
        # (Forming it in the same kernel from the quantized tile, or from the transposed input
        # tile that the compiler then shares with the first copy, miscompiled on sm_90 with
        # Triton 3.6: wrong bytes in both copies.)
        # The transposed copy's scales are written by the same launch (S_TWICE): custom ops may not
        # return aliasing outputs, and a clone / transposed copy of the scales was one more launch.
        if row.mode == _MODE_TENSOR:
            st = torch.empty((), dtype=torch.float32, device=dev)
        else:
            n_sr, n_sc = row.scale_grid(rows, cols)
            st = torch.empty((n_sc, n_sr), dtype=torch.uint8 if row.mode == _MODE_MX else torch.float32, device=dev)
        q, s = fp8_quant_launch(x, out_dtype, row, st=st)
        qt = torch.empty((cols, rows), dtype=out_dtype, device=dev)
        transpose_bytes(q, qt)
        return q, s, qt, st
    # one [<=128, <=128] tile must hold whole blocks of both groupings
    one_tile = max(*row.padded(), *col.padded()) <= 128
    if not one_tile:
        # ROWWISE: each copy through the single-grouping path, the column copy via transposed strides
        q, s = fp8_quant_launch(x, out_dtype, row)
        qt = torch.empty((cols, rows), dtype=out_dtype, device=dev)
        st = _transposed_single(x, qt, col, out_dtype)
        return q, s, qt, st
    packed = tile if tile is not None and len(tile) > 3 and tile[3] in ("packed", "packed2", "packed3") \
        else packed_with_trans_config(row) if tile is None else None
    if packed is not None:
        # the bf16-pair kernel of quant_fp8_packed.py: the bf16 -> E4M3 default for BLOCKWISE and
        # MX, or a tuning override (both fall back to the tl kernels where it does not apply)
        from .quant_fp8_packed import fp8_packed_ok, fp8_packed_with_trans_launch

        if fp8_packed_ok(x, out_dtype, row, col, packed):
            return fp8_packed_with_trans_launch(x, out_dtype, row, col, packed)
        dflt = packed_with_trans_config(row)  # an override that does not apply: the default's kernel
        if tile is not None and dflt is not None and fp8_packed_ok(x, out_dtype, row, col, dflt):
            return fp8_packed_with_trans_launch(x, out_dtype, row, col, dflt)
        tile = None
    # the two-copy and generic kernels write into these (the paths above allocate their own)
    q = torch.empty((rows, cols), dtype=out_dtype, device=dev)
    qt = torch.empty((cols, rows), dtype=out_dtype, device=dev)
    cfg = tile if (tile is not None and len(tile) >= 3) else None
    if cfg is None and tile is None:
        cfg = with_trans_config(rows, cols, row, col)
    if cfg is not None and x.stride(1) == 1 and _dual_ok(rows, cols, row, col, cfg):
        return _dual_launch(x, q, qt, out_dtype, row, col, cfg)
    amax, n_amax = _amax_bits(x) if tensorwise else (None, 1)
    s, s_strides, (n_sr, n_sc) = _scale_tensor(row, rows, cols, False, dev)
    st, st_strides, (n_str, n_stc) = _scale_tensor(col, rows, cols, True, dev)
    gr, gc = row.padded()
    gr_t, gc_t = col.padded()
    tr, tc, nw = tile_config(rows, cols, ((gr, gc), (gr_t, gc_t)), with_trans=True)
    if tile is not None and len(tile) == 2:
        tr = tc = max(tile[0], gr, gc, gr_t, gc_t)
        nw = tile[1]
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    launch(_quant_fp8_tile_kernel, (n_tr * n_tc,), (
        x, q.view(torch.uint8), s, qt.view(torch.uint8), st, amax if amax is not None else s, rows, cols, n_tc,
        n_amax, x.stride(0), x.stride(1), cols, 1, s_strides[0], s_strides[1], 1, rows, st_strides[0],
        st_strides[1], n_sr, n_sc, n_str, n_stc,
    ), dict(
        FP8_MAX=fmax, EMAX=mx_emax_of(out_dtype), MODE=row.mode, GR=gr, GC=gc, HAS_T=True, MODE_T=col.mode,
        GR_T=gr_t, GC_T=gc_t, TR=tr, TC=tc, IS_E4M3=out_dtype == torch.float8_e4m3fn, SOFT=is_interpreter(),
        AMAX_SLOTS=AMAX_SLOTS if tensorwise else 1, S_TWICE=False, num_warps=nw
    ), x.device)
    return q, s, qt, st


#: candidate (TR, TC, num_warps[, maxnreg[, "staged"]]) of the one-read two-copy kernel for
#: ``1 x g`` row blocks with ``g x 1`` column blocks (scripts/tune_quant.py times each); the
#: default is chosen by :func:`with_trans_config`. Each must hold whole blocks of both groupings
#: (TR >= g, TC >= g). ``maxnreg`` (0: none) caps the registers per thread (more programs per SM,
#: at the price of spills); ``"staged"`` (fp32 scales only) forms each block's scales once per
#: program through a scratch instead of in every thread that holds the block.
WITH_TRANS_CANDIDATES = (
    (64, 128, 4), (128, 128, 4), (32, 128, 4), (64, 64, 4), (32, 256, 4), (64, 256, 8), (64, 128, 8),
    (128, 128, 8), (128, 256, 8), (256, 128, 8), (32, 64, 2),
    (128, 128, 4, 168), (128, 128, 4, 128), (128, 128, 8, 128), (64, 128, 4, 96), (32, 256, 4, 96),
    (128, 128, 4, 168, "staged"), (128, 128, 4, 0, "staged"), (128, 128, 8, 0, "staged"),
    (128, 128, 4, 128, "staged"), (128, 256, 8, 0, "staged"), (256, 128, 8, 0, "staged"),
    (64, 128, 4, 0, "staged"), (64, 128, 4, 128, "staged"), (128, 64, 4, 0, "staged"),
    # the bf16-pair kernel (quant_fp8_packed.py, bf16 -> E4M3): (TR, TC, num_warps, "packed"[, maxnreg])
    (128, 128, 4, "packed"), (128, 128, 4, "packed", 168), (128, 128, 8, "packed"), (128, 256, 8, "packed"),
    (64, 128, 4, "packed"), (64, 128, 4, "packed", 128), (32, 128, 4, "packed"), (64, 256, 8, "packed"),
    (128, 64, 4, "packed"), (32, 256, 4, "packed"),
    # "packed2": the same with the row-wise words stored from their own layout (no shared-memory
    # conversion; sm_90 compile: BLOCKWISE 128x128x4 1656 -> 1616 SASS, MX 128x128x4/168 2040 ->
    # 1944 and no spills)
    (128, 128, 4, "packed2"), (128, 128, 4, "packed2", 168), (128, 128, 8, "packed2"), (128, 256, 8, "packed2"),
    (64, 128, 4, "packed2"), (64, 128, 4, "packed2", 128), (32, 256, 4, "packed2"), (128, 64, 4, "packed2"),
    # 8 warps with registers capped for 4 programs (32 warps) per SM, against the BLOCKWISE
    # default's 74 registers and 3 programs: sm_90 compile BLOCKWISE 64 registers, no spills,
    # 15.9 SASS per element (MX spills 148 bytes). Not yet timed.
    (128, 128, 8, "packed2", 64),
    # options (6th entry) "inreg": BLOCKWISE fp32 scales formed where the reduced amaxes live
    # instead of through the per-program scratch (sm_90: 18.6 SASS per element against 15.6, but
    # no scratch round trip and its barriers; H200 0.799-0.801x the copy at 4 warps / 168
    # registers against the 8-warp scratch form's 0.785-0.787). Measured and removed (session 14,
    # benchmarks/results/h200/NOTES.md): persistent programs with the next tile's loads in flight
    # (0.59-0.74) and programs in bands of tile rows (0.73-0.78).
    (128, 128, 8, "packed2", 0, "inreg"), (128, 128, 4, "packed2", 0, "inreg"), (64, 128, 4, "packed2", 0, "inreg"),
    (128, 128, 4, "packed2", 168, "inreg"), (128, 128, 8, "packed2", 64, "inreg"),
    # Measured and removed (session 32, benchmarks/results/h200/session32/candidates_quant_call1.*):
    # one- and two-warp programs, every reduction and the transpose inside a warp or a pair of warps
    # (sm_90: MX 32x128x1 11.1 SASS per element against the default's 15.3). H200, bf16 [16384, 7168],
    # x the device copy: MX 32x128x1 0.694, 32x64x1 0.644, 32x128x2 0.697, 64x128x2 0.785, 128x128x2
    # inreg 0.790 against the default's 0.812; BLOCKWISE 128x128x2 inreg 0.694 against 0.801. Fewer
    # instructions did not pay: the small programs keep fewer bytes in flight per SM.
    # "packed3" (TC = 128 only): packed2 with the column words stored straight from their
    # registers (4-byte stores, no shared-memory transpose): BLOCKWISE 128x128x4 1496 SASS (11.7
    # per element), MX 64x128x4 1008 (1144 packed), MX 128x128x4 1856 (2008 packed), no spills
    (128, 128, 4, "packed3"), (128, 128, 4, "packed3", 168), (128, 128, 4, "packed3", 128),
    (64, 128, 4, "packed3"), (64, 128, 4, "packed3", 128), (32, 128, 4, "packed3"),
    # option "tscale": the scales stored transposed and returned as transposed views, so that a
    # tile's scales fill whole 32-byte sectors (MX: one 4-byte word per four rows / columns; sm_90
    # MX 128x128x4: 2 word stores and 17 barriers against 8 byte stores and 25)
    (128, 128, 4, "packed2", 0, "tscale"), (128, 128, 4, "packed3", 0, "tscale"), (64, 128, 4, "packed2", 0, "tscale"),
    (128, 256, 8, "packed2", 0, "tscale"), (128, 128, 4, "packed2", 168, "inreg,tscale"),
    (128, 128, 4, "packed3", 168, "inreg,tscale"), (128, 128, 4, "packed2", 0, "inreg,tscale"),
    (128, 128, 8, "packed2", 0, "inreg,tscale"), (128, 256, 8, "packed2", 0, "inreg,tscale"),
    (256, 128, 8, "packed2", 0, "inreg,tscale"), (32, 128, 4, "packed2", 0, "tscale"),
    (64, 256, 8, "packed2", 0, "tscale"), (64, 128, 4, "packed3", 0, "tscale"), (64, 128, 4, "packed2", 128, "tscale"),
    (128, 128, 4, "packed2", 168, "inreg,tscale"), (128, 128, 8, "packed2", 80, "inreg,tscale"),
)


def packed_with_trans_config(row: QuantGrouping):
    """The default bf16 -> E4M3 configuration of the bf16-pair kernel (quant_fp8_packed.py) for
    BLOCKWISE (1x128 / 128x1) and MX (1x32 / 32x1), or None for other groupings. It runs where
    ``fp8_packed_ok`` accepts the input (bf16, E4M3, rows and cols multiples of 4, 4-byte aligned
    rows); everything else takes :func:`with_trans_config`'s kernels. H200, 2026-12-01, bf16
    [16384, 7168] (scripts/tune_quant.py and benchmarks/bench_quantization.py, session 13 calls 4-5):
    BLOCKWISE 0.782-0.788x the device copy (the staged tl kernel 0.46-0.63), MX 0.805-0.809 (the tl
    kernel 0.720). Session 14 (scripts/tune_quant.py, two calls): BLOCKWISE with its scales formed in
    registers ("inreg", 4 warps, 168 registers) 0.799-0.801 against 0.785-0.787 for the 8-warp
    scratch form, which also needed a scratch buffer per call. Session 33 (scripts/tune_quant.py,
    bf16 [16384, 7168] / [8192, 14336]): the scales stored transposed ("tscale": each tile's scales
    fill whole 32-byte sectors; the op returns them column-major) took MX from 0.809 / 0.813 to
    0.914 / 0.921 at 64 x 128 tiles (80 registers: six programs per SM) and BLOCKWISE from 0.802 /
    0.802 to 0.842 / 0.854; BLOCKWISE capped at 128 registers (four programs per SM instead of
    three, no spills) then read 0.902 / 0.895 in device time against 0.839 / 0.833 at 168
    (scripts/diag_quant_spread.py --timing graph, six and four fresh allocations)."""
    if row.mode == _MODE_MX and row.gc == 32:
        return 64, 128, 4, "packed2", 0, "tscale"
    if row.mode == _MODE_FP32 and row.gc == 128:
        return 128, 128, 4, "packed2", 128, "inreg,tscale"
    return None


def with_trans_config(rows: int, cols: int, row: QuantGrouping, col: QuantGrouping):
    """The default launch configuration of :func:`fp8_quant_with_trans_launch`: ``(TR, TC,
    num_warps[, maxnreg])`` of the one-read two-copy kernel, or None for the generic tile kernel
    (the configuration the H200 measured before the two-copy kernel: square 128 tile, 4 warps).

    The one place the default is set: scripts/tune_quant.py prints the winner per shape."""
    g = max(row.padded()[1], col.padded()[0])
    if row.mode == _MODE_MX:
        # MX 1x32 / 32x1: 64 x 128 tiles, 4 warps: 128 registers (4 programs per SM), ~17 SASS
        # instructions per element (sm_90 compile)
        return 64, 128, 4
    if g <= 64:
        return 64, 128, 4, 0, "staged"
    # BLOCKWISE 1x128 / 128x1: scales formed once per block (~13 SASS instructions per element,
    # against ~20 with every thread of a block's row forming them), registers capped at 168 for
    # 3 programs per SM
    return 128, 128, 4, 168, "staged"


def _dual_ok(rows: int, cols: int, row: QuantGrouping, col: QuantGrouping, cfg) -> bool:
    """Whether the two-copy kernel covers these groupings and shape with tile ``cfg``."""
    tr, tc = cfg[0], cfg[1]
    # the pair kernels: shape/grouping check only (dtype: at the launch)
    if len(cfg) > 3 and cfg[3] in ("packed", "packed2", "packed3"):
        return (row.mode == col.mode and row.mode in (_MODE_FP32, _MODE_MX) and row.gr == 1 and col.gc == 1
                and row.gc == col.gr and row.gc in (32, 64, 128) and (row.mode == _MODE_FP32 or row.gc == 32)
                and rows % 4 == 0 and cols % 4 == 0 and tr % row.gc == 0 and tc % row.gc == 0
                and (cfg[3] != "packed3" or tc == 128))
    if row.mode != col.mode or row.mode == _MODE_TENSOR or row.gr != 1 or col.gc != 1:
        return False
    gc, gr_t = row.padded()[1], col.padded()[0]
    if gc != row.gc or gr_t != col.gr:  # partial (non power-of-two) blocks: generic kernel
        return False
    if len(cfg) > 4 and cfg[4] == "staged" and row.mode != _MODE_FP32:
        return False
    return rows % 4 == 0 and tr % gr_t == 0 and tc % gc == 0 and rows > 0 and cols > 0


def _dual_launch(x, q, qt, out_dtype, row: QuantGrouping, col: QuantGrouping, cfg):
    rows, cols = x.shape
    tr, tc, nw = cfg[:3]
    # an optional 4th entry caps the registers per thread (ptx .maxnreg): more programs per SM
    extra = {"maxnreg": cfg[3]} if len(cfg) > 3 and cfg[3] and not is_interpreter() else {}
    s, _, (n_sr, n_sc) = _scale_tensor(row, rows, cols, False, x.device)
    st, _, (n_str, n_stc) = _scale_tensor(col, rows, cols, True, x.device)
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    even = rows % tr == 0 and cols % tc == 0
    qt_words = qt.view(torch.uint8).view(torch.int32)  # [cols, rows / 4]
    if len(cfg) > 4 and cfg[4] == "staged" and row.mode == _MODE_FP32:
        n_scr = tr * (tc // row.gc) + (tr // col.gr) * tc
        scr = torch.empty((n_tr * n_tc, n_scr), dtype=torch.float32, device=x.device)
        launch(_quant_fp8_dual_staged_kernel, (n_tr * n_tc,), (
            x, q.view(torch.uint8), s, qt_words, st, scr, rows, cols, n_tc, x.stride(0), cols, n_sc, rows // 4,
            n_str,
        ), dict(
            FP8_MAX=fp8_max_of(out_dtype), GC=row.gc, GR_T=col.gr, TR=tr, TC=tc, EVEN=even, IS_E4M3=out_dtype ==
            torch.float8_e4m3fn, SOFT=is_interpreter(), num_warps=nw, **extra
        ), x.device)
        return q, s, qt, st
    launch(_quant_fp8_dual_kernel, (n_tr * n_tc,), (
        x, q.view(torch.uint8), s, qt_words, st, rows, cols, n_tc, x.stride(0), cols, n_sc, rows // 4, n_str,
    ), dict(
        FP8_MAX=fp8_max_of(out_dtype), EMAX=mx_emax_of(out_dtype), MODE=row.mode, GC=row.gc, GR_T=col.gr, TR=tr,
        TC=tc, EVEN=even, RECONVERT=tr * tc >= 128 * 32 * nw, IS_E4M3=out_dtype == torch.float8_e4m3fn,
        SOFT=is_interpreter(), num_warps=nw, **extra
    ), x.device)
    return q, s, qt, st


def _transposed_single(x: torch.Tensor, qt: torch.Tensor, col: QuantGrouping, out_dtype) -> torch.Tensor:
    """Write the column-wise copy of x (grouping ``col``) into ``qt [cols, rows]``; return its scale."""
    rows, cols = x.shape
    fmax = fp8_max_of(out_dtype)
    st, st_strides, (n_str, n_stc) = _scale_tensor(col, rows, cols, True, x.device)
    if not _fits_tile(col):
        _long_rowwise(x, qt, (1, rows), st.view(-1), col.gr == 1, fmax)
        return st
    gr, gc = col.padded()
    tr, tc, nw = tile_config(rows, cols, ((gr, gc),))
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    launch(_quant_fp8_tile_kernel, (n_tr * n_tc,), (
        x, qt.view(torch.uint8), st, qt, st, st, rows, cols, n_tc, 1, x.stride(0), x.stride(1), 1, rows,
        st_strides[0], st_strides[1], 0, 0, 0, 0, n_str, n_stc, 1, 1,
    ), dict(
        FP8_MAX=fmax, EMAX=mx_emax_of(out_dtype), MODE=col.mode, GR=gr, GC=gc, HAS_T=False, MODE_T=col.mode,
        GR_T=gr, GC_T=gc, TR=tr, TC=tc, IS_E4M3=out_dtype == torch.float8_e4m3fn, SOFT=is_interpreter(),
        AMAX_SLOTS=1, S_TWICE=False, num_warps=nw
    ), x.device)
    return st


def fp8_dequant_launch(q: torch.Tensor, scale: torch.Tensor, grouping: QuantGrouping, out_dtype: torch.dtype):
    """``q [rows, cols]`` (contiguous) times its block scales (2-D ``[n_sr, n_sc]``, uint8 bytes for
    MX, or 0-dim for TENSORWISE) -> ``[rows, cols]`` in ``out_dtype``."""
    rows, cols = q.shape
    out = torch.empty((rows, cols), dtype=out_dtype, device=q.device)
    if grouping.mode == _MODE_TENSOR:
        gr = gc = 1
        s_strides = (0, 0)
    else:
        # a block spanning the whole dim indexes scale 0 for every element: use one large constant
        # so ROWWISE does not compile a kernel per row length
        gr = grouping.gr if grouping.gr < rows else 1 << 30
        gc = grouping.gc if grouping.gc < cols else 1 << 30
        s_strides = (scale.stride(0), scale.stride(1))
    tr, tc, nw = tile_config(rows, cols, ((1, 1),))
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    launch(_dequant_fp8_kernel, (n_tr * n_tc,), (
        q.view(torch.uint8), scale, out, rows, cols, n_tc, q.stride(0), out.stride(0), s_strides[0],
        s_strides[1],
    ), dict(
        MODE=grouping.mode, GR=gr, GC=gc, TR=tr, TC=tc, IS_E4M3=q.dtype == torch.float8_e4m3fn,
        SOFT=is_interpreter(), num_warps=nw
    ), q.device)
    return out
