"""MXFP4 quantize / dequantize kernels: E2M1 values, two per byte, one E8M0 scale per 32.

Same structure as the FP8 tile kernel (quant_fp8_kernel.py): one program per ``[TR, TC]`` tile,
x read once, the block amax reduced on a ``[.., 32, ..]`` view, the OCP MX shared exponent taken
from the amax's exponent field (emax = 2 for E2M1). E2M1 rounding is round-to-nearest-even on the
scaled, clamped (+-6) value, computed as a sum of threshold comparisons (the midpoints between
neighbouring codes, ``>`` where the lower code is even and ``>=`` where it is odd). Nibbles are
packed along the quantized axis: element ``2i`` in the low nibble, ``2i + 1`` in the high one.
With ``HAS_T`` the same tile also yields the column-wise copy (blocks and packing along rows),
stored transposed ``[cols, rows / 2]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_fp8_kernel import _abs_bits, _mx_scales, _round_for_store
from primus_turbo.triton import is_interpreter

__all__ = ["fp4_quant_launch", "fp4_dequant_launch"]

_BLOCK = 32
_FP4_EMAX = 2


@triton.jit
def _e2m1_nibbles(y):
    """fp32 values in [-6, 6] (or NaN) -> int32 nibbles: RNE magnitude code, sign in bit 3.

    Midpoints 0.25|0.75|1.25|1.75|2.5|3.5|5 between codes 0..7; a tie goes to the even code, so
    the comparison is strict above an even code and inclusive above an odd one. NaN gives 0."""
    a = tl.abs(y)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    sign = tl.where(y != y, 0, sign)
    return code | (sign << 3)


@triton.jit
def _e2m1_decode(n):
    """int32 nibbles -> fp32 E2M1 values (exact)."""
    e = (n >> 1) & 3
    m = (n & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((n & 8) != 0, -mag, mag)


@triton.jit
def _fp4_quantize_groups(x, TR: tl.constexpr, TC: tl.constexpr, ALONG_COLS: tl.constexpr):
    """fp32 tile [TR, TC] -> (packed uint8 [TR, TC/2] or [TR/2, TC], E8M0 bytes per block)."""
    if ALONG_COLS:
        x4 = tl.reshape(x, (TR, 1, TC // 32, 32))
    else:
        x4 = tl.reshape(x, (TR // 32, 32, TC, 1))
    amax_bits = tl.max(tl.max(_abs_bits(x4), axis=3), axis=1)
    mult, byte = _mx_scales(amax_bits, 2)
    y = tl.reshape(x4 * mult[:, None, :, None], (TR, TC))
    y = tl.clamp(y, -6.0, 6.0, propagate_nan=tl.PropagateNan.ALL)
    nib = _e2m1_nibbles(y)
    if ALONG_COLS:
        lo, hi = tl.split(tl.reshape(nib, (TR, TC // 2, 2)))
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(nib, (TR // 2, 2, TC)), (0, 2, 1)))
    return (lo | (hi << 4)).to(tl.uint8), byte


@triton.jit
def _store_fp4(
    p_ptr, s_ptr, packed, byte, pid_r, pid_c, rows, cols,
    stride_pr, stride_pc, stride_sr, stride_sc,
    ALONG_COLS: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
):
    """Packed tile and its scales through strides in (packed row, packed col) / block coordinates."""
    if ALONG_COLS:
        pr = pid_r * TR + tl.arange(0, TR)
        pc = pid_c * (TC // 2) + tl.arange(0, TC // 2)
        pmask = (pr < rows)[:, None] & (pc < cols // 2)[None, :]
        sr = pid_r * TR + tl.arange(0, TR)
        sc = pid_c * (TC // 32) + tl.arange(0, TC // 32)
        smask = (sr < rows)[:, None] & (sc < cols // 32)[None, :]
    else:
        pr = pid_r * (TR // 2) + tl.arange(0, TR // 2)
        pc = pid_c * TC + tl.arange(0, TC)
        pmask = (pr < rows // 2)[:, None] & (pc < cols)[None, :]
        sr = pid_r * (TR // 32) + tl.arange(0, TR // 32)
        sc = pid_c * TC + tl.arange(0, TC)
        smask = (sr < rows // 32)[:, None] & (sc < cols)[None, :]
    tl.store(p_ptr + pr.to(tl.int64)[:, None] * stride_pr + pc.to(tl.int64)[None, :] * stride_pc, packed, mask=pmask)
    tl.store(s_ptr + sr.to(tl.int64)[:, None] * stride_sr + sc.to(tl.int64)[None, :] * stride_sc,
             byte.to(tl.uint8), mask=smask)


@triton.jit
def _quant_mxfp4_kernel(
    # pointers: input, first copy + scales, transposed copy + scales
    x_ptr, p_ptr, s_ptr, pt_ptr, st_ptr,
    # sizes
    rows, cols, n_tiles_c,
    # strides: x in (row, col); packed outputs in packed coordinates; scales in block coordinates
    stride_xr, stride_xc,
    stride_pr, stride_pc, stride_sr, stride_sc,
    stride_ptr, stride_ptc, stride_str, stride_stc,
    # meta-parameters
    ALONG_COLS: tl.constexpr, HAS_T: tl.constexpr, T_ALONG_COLS: tl.constexpr,  # T_: = not ALONG_COLS
    TR: tl.constexpr, TC: tl.constexpr,
):
    """MXFP4 of one [TR, TC] tile along ALONG_COLS; with HAS_T also along the other axis."""
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
    offs_r = pid_r * TR + tl.arange(0, TR)
    offs_c = pid_c * TC + tl.arange(0, TC)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_xr + offs_c.to(tl.int64)[None, :] * stride_xc,
                mask=mask, other=0.0).to(tl.float32)
    packed, byte = _fp4_quantize_groups(x, TR, TC, ALONG_COLS)
    _store_fp4(p_ptr, s_ptr, packed, byte, pid_r, pid_c, rows, cols,
               stride_pr, stride_pc, stride_sr, stride_sc, ALONG_COLS, TR, TC)
    if HAS_T:
        packed_t, byte_t = _fp4_quantize_groups(x, TR, TC, T_ALONG_COLS)
        _store_fp4(pt_ptr, st_ptr, packed_t, byte_t, pid_r, pid_c, rows, cols,
                   stride_ptr, stride_ptc, stride_str, stride_stc, T_ALONG_COLS, TR, TC)


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
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
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


def _tile(rows: int, cols: int, along_cols: bool, with_trans: bool) -> tuple[int, int, int]:
    """(TR, TC, num_warps): like the FP8 heuristic, ~8192-element tiles holding whole 32-blocks;
    64 x 64 with the transposed copy."""
    if with_trans:
        return 64, 64, 4
    if along_cols:
        tc = max(32, min(triton.next_power_of_2(cols), 1024))
        tr = max(1, min(8192 // tc, triton.next_power_of_2(rows)))
    else:
        tr = 32 if rows <= 32 else 64
        tc = max(16, min(triton.next_power_of_2(cols), 8192 // tr))
    n = tr * tc
    return tr, tc, 4 if n <= 2048 else 8


def fp4_quant_launch(x: torch.Tensor, along_cols: bool, with_trans: bool = False):
    """MXFP4 of a contiguous 2-D x. Returns ``(packed, scale)`` or, with ``with_trans``,
    ``(packed, scale, packed_t, scale_t)``; packed tensors and E8M0 scales as uint8.

    along_cols: ``packed [rows, cols/2]``, ``scale [rows, cols/32]``; else ``[rows/2, cols]``,
    ``[rows/32, cols]``. The transposed copy (only with ``along_cols``): ``[cols, rows/2]`` and
    ``[cols, rows/32]``."""
    rows, cols = x.shape
    dev = x.device
    if along_cols:
        p = torch.empty((rows, cols // 2), dtype=torch.uint8, device=dev)
        s = torch.empty((rows, cols // _BLOCK), dtype=torch.uint8, device=dev)
    else:
        p = torch.empty((rows // 2, cols), dtype=torch.uint8, device=dev)
        s = torch.empty((rows // _BLOCK, cols), dtype=torch.uint8, device=dev)
    if with_trans:
        pt = torch.empty((cols, rows // 2), dtype=torch.uint8, device=dev)
        st = torch.empty((cols, rows // _BLOCK), dtype=torch.uint8, device=dev)
        t_strides = (1, rows // 2, 1, rows // _BLOCK)
    else:
        pt, st, t_strides = p, s, (0, 0, 0, 0)
    tr, tc, nw = _tile(rows, cols, along_cols, with_trans)
    n_tr, n_tc = triton.cdiv(rows, tr), triton.cdiv(cols, tc)
    _quant_mxfp4_kernel[(n_tr * n_tc,)](
        x, p, s, pt, st, rows, cols, n_tc,
        x.stride(0), x.stride(1), p.stride(0), 1, s.stride(0), 1, *t_strides,
        ALONG_COLS=along_cols, HAS_T=with_trans, T_ALONG_COLS=not along_cols, TR=tr, TC=tc, num_warps=nw,
    )
    if with_trans:
        return p, s, pt, st
    return p, s


def fp4_dequant_launch(packed: torch.Tensor, scale: torch.Tensor, along_cols: bool, out_dtype: torch.dtype):
    """Unpack a contiguous MXFP4 tensor (uint8 view) with its uint8 E8M0 scales into ``out_dtype``."""
    if along_cols:
        rows, cols = packed.shape[0], packed.shape[1] * 2
    else:
        rows, cols = packed.shape[0] * 2, packed.shape[1]
    out = torch.empty((rows, cols), dtype=out_dtype, device=packed.device)
    tr, tc, nw = _tile(rows, cols, along_cols, False)
    n_tr, n_tc = triton.cdiv(rows, tr), triton.cdiv(cols, tc)
    _dequant_mxfp4_kernel[(n_tr * n_tc,)](
        packed, scale, out, rows, cols, n_tc, packed.stride(0), scale.stride(0), out.stride(0),
        ALONG_COLS=along_cols, TR=tr, TC=tc, SOFT=is_interpreter(), num_warps=nw,
    )
    return out
