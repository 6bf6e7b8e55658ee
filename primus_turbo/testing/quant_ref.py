"""Reference quantizers in plain PyTorch: the executable definition of docs/low_precision.md.

Written for clarity, not speed. Every scale is formed exactly as the contract says, with fp64
intermediates that are rounded to fp32 where the contract rounds (an fp64 quotient or product of
two fp32 values rounded once to fp32 equals the IEEE-rounded fp32 operation), so the Triton
kernels must agree with these functions bit for bit.

Groups of a 2-D tensor ``[rows, cols]`` are described by a block shape ``(br, bc)``:

============================== ================ =================
granularity                     axis=-1          axis=0
============================== ================ =================
TENSORWISE                      (rows, cols)     (rows, cols)
ROWWISE                         (1, cols)        (rows, 1)
BLOCKWISE 1 x b                 (1, b)           (b, 1)
BLOCKWISE b x b (use_2d_block)  (b, b)           (b, b)
MX_BLOCKWISE                    (1, 32)          (32, 1)
============================== ================ =================

and ``scale_inv`` holds one value per block (``[ceil(rows / br), ceil(cols / bc)]``; a 0-dim
tensor for TENSORWISE). Inputs of more than two dims are accepted with ``axis=-1`` (and for
TENSORWISE): the leading dims are flattened for the computation and restored on the outputs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from primus_turbo.pytorch.core.low_precision import (
    DEFAULT_BLOCK_SIZE,
    MXFP4_BLOCK_SIZE,
    MXFP8_BLOCK_SIZE,
    ScalingGranularity,
    ScalingRecipe,
)

__all__ = [
    "FP4_E2M1_VALUES",
    "fp8_max",
    "mx_emax",
    "quant_block_shape",
    "scale_inv_shape",
    "quantize_fp8_ref",
    "dequantize_fp8_ref",
    "quantize_fp4_ref",
    "dequantize_fp4_ref",
]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: largest finite fp32: the cap on a scale whose quotient FP8_MAX / amax overflows
_FLT_MAX = torch.finfo(torch.float32).max
#: magnitudes of the E2M1 codes 0..7 (bit 3 of a nibble is the sign)
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_MAX = 6.0
_FP4_EMAX = 2


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 for E4M3, 57344 for E5M2."""
    if dtype not in _FP8_DTYPES:
        raise TypeError(f"fp8_max: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return float(torch.finfo(dtype).max)


def mx_emax(dtype: Optional[torch.dtype]) -> int:
    """OCP MX ``emax`` (exponent of the largest power of two): 8 (E4M3), 15 (E5M2), 2 (E2M1: None)."""
    if dtype is None:
        return _FP4_EMAX
    return {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}[dtype]


def _as_granularity(granularity) -> ScalingGranularity:
    if isinstance(granularity, ScalingGranularity):
        return granularity
    if isinstance(granularity, str) and granularity.upper() in ScalingGranularity.__members__:
        return ScalingGranularity[granularity.upper()]
    raise ValueError(f"granularity={granularity!r} is not a ScalingGranularity")


def quant_block_shape(
    shape2d: tuple[int, int],
    granularity,
    block_size: Optional[int] = None,
    axis: int = -1,
    scaling_recipe: Optional[ScalingRecipe] = None,
) -> tuple[int, int]:
    """The ``(br, bc)`` block of a 2-D tensor that one scale covers (see the module docstring)."""
    g = _as_granularity(granularity)
    rows, cols = shape2d
    if axis not in (-1, 0, 1):
        raise ValueError(f"axis must be -1 (or 1) or 0, got {axis}")
    along_rows = axis == 0  # groups run down the columns
    if g == ScalingGranularity.TENSORWISE:
        return (max(rows, 1), max(cols, 1))
    if g == ScalingGranularity.ROWWISE:
        return (max(rows, 1), 1) if along_rows else (1, max(cols, 1))
    if g == ScalingGranularity.BLOCKWISE:
        b = DEFAULT_BLOCK_SIZE if block_size is None else int(block_size)
        if b <= 0:
            raise ValueError(f"BLOCKWISE block_size must be positive, got {block_size}")
        if scaling_recipe is not None and scaling_recipe.use_2d_block:
            return (b, b)
        return (b, 1) if along_rows else (1, b)
    if g == ScalingGranularity.MX_BLOCKWISE:
        b = MXFP8_BLOCK_SIZE
        if block_size is not None and block_size != b:
            raise ValueError(f"MX_BLOCKWISE block_size must be 32, got {block_size}")
        n = rows if along_rows else cols
        if n % b:
            raise ValueError(f"MX_BLOCKWISE needs the quantized dim to be a multiple of 32, got {n} (axis={axis})")
        return (b, 1) if along_rows else (1, b)
    raise ValueError(f"unsupported granularity {g}")


def scale_inv_shape(shape: tuple[int, ...], granularity, block_size=None, axis=-1, scaling_recipe=None) -> tuple:
    """Shape of ``scale_inv`` for an input of ``shape`` (leading dims kept for N-D, axis=-1)."""
    g = _as_granularity(granularity)
    if g == ScalingGranularity.TENSORWISE:
        return ()
    lead, rows, cols = _split_shape(tuple(shape), axis)
    br, bc = quant_block_shape((rows, cols), g, block_size, axis, scaling_recipe)
    sr, sc = -(-rows // br), -(-cols // bc)
    if lead is not None:
        return (*lead, sc)
    return (sr, sc)


def _split_shape(shape: tuple[int, ...], axis: int):
    """(lead dims or None, rows, cols) of the 2-D view used for the computation."""
    if len(shape) == 2:
        return None, shape[0], shape[1]
    if len(shape) > 2 and axis in (-1, len(shape) - 1):
        return shape[:-1], math.prod(shape[:-1]), shape[-1]
    raise ValueError(f"expected a 2-D tensor (or N-D with axis=-1), got shape {shape} with axis={axis}")


def _block_reduce_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """max |x| over each (br, bc) block of a 2-D fp64 tensor; partial blocks are zero-padded.

    NaN anywhere in a block makes its amax NaN (torch.amax propagates NaN)."""
    rows, cols = x.shape
    sr, sc = -(-rows // br), -(-cols // bc)
    padded = x.new_zeros((sr * br, sc * bc))
    padded[:rows, :cols] = x.abs()
    return padded.reshape(sr, br, sc, bc).amax(dim=(1, 3))


def _expand(s: torch.Tensor, br: int, bc: int, rows: int, cols: int) -> torch.Tensor:
    """Broadcast a per-block tensor back over the elements of its blocks."""
    return s.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]


def _fp32_scales(amax: torch.Tensor, fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale = FP8_MAX / amax`` (IEEE-rounded fp32, capped at FLT_MAX) when ``0 < amax < inf``,
    else 1; ``scale_inv = 1 / scale`` (IEEE-rounded fp32). Both returned as fp32."""
    amax32 = amax.to(torch.float32)
    ok = (amax32 > 0) & torch.isfinite(amax32)
    safe = torch.where(ok, amax32, torch.ones_like(amax32)).double()
    scale = (fmax / safe).to(torch.float32)  # fp64 quotient rounded once: the IEEE fp32 quotient
    scale = torch.clamp(scale, max=_FLT_MAX)  # a quotient past FLT_MAX rounds to inf: cap it
    scale = torch.where(ok, scale, torch.ones_like(scale))
    scale_inv = (1.0 / scale.double()).to(torch.float32)
    return scale, scale_inv


def _mx_shared_exp(amax: torch.Tensor, emax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX: ``shared_exp = clamp(floor(log2(amax)) - emax, -127, 127)`` (amax = 0 gives -127).

    Returns (shared_exp as int64, E8M0 byte as int64), the byte being 255 (NaN) for a block whose
    amax is inf or NaN."""
    a = amax.double()
    bad = ~torch.isfinite(a)
    mant, exp = torch.frexp(torch.where(bad | (a == 0), torch.ones_like(a), a))  # a = mant * 2**exp, mant in [0.5, 1)
    floor_log2 = exp.to(torch.int64) - 1
    shared = torch.clamp(floor_log2 - emax, -127, 127)
    shared = torch.where(a == 0, torch.full_like(shared, -127), shared)
    byte = torch.where(bad, torch.full_like(shared, 255), shared + 127)
    shared = torch.where(bad, torch.zeros_like(shared), shared)  # unscaled
    return shared, byte


def quantize_fp8_ref(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity,
    *,
    block_size: Optional[int] = None,
    axis: int = -1,
    scaling_recipe: Optional[ScalingRecipe] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to FP8 as docs/low_precision.md defines it.

    Args:
        x: fp32/bf16/fp16 tensor, 2-D (or N-D with ``axis=-1``; any dims for TENSORWISE).
        out_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        granularity: a ``ScalingGranularity`` (or its name).
        block_size: BLOCKWISE block (default 128); MX_BLOCKWISE accepts only 32 (or None).
        axis: -1 (groups along the last dim) or 0 (down the columns); 2-D blocks ignore it.
        scaling_recipe: ``ScalingRecipe(use_2d_block=True)`` makes BLOCKWISE use b x b tiles.

    Returns:
        ``(q, scale_inv)``: ``q`` shaped like ``x`` in ``out_dtype``; ``scale_inv`` the
        dequantization multiplier per block (fp32, or ``float8_e8m0fnu`` for MX).
    """
    if out_dtype not in _FP8_DTYPES:
        raise TypeError(f"quantize_fp8_ref: out_dtype must be float8_e4m3fn or float8_e5m2, got {out_dtype}")
    g = _as_granularity(granularity)
    fmax = fp8_max(out_dtype)
    shape = tuple(x.shape)
    if g == ScalingGranularity.TENSORWISE:
        if x.numel() == 0:  # no elements: amax 0, so scale_inv 1
            return torch.empty(shape, dtype=out_dtype, device=x.device), torch.ones((), device=x.device)
        x2 = x.reshape(1, -1)
    else:
        lead, rows, cols = _split_shape(shape, axis)
        x2 = x.reshape(rows, cols)
    rows, cols = x2.shape
    br, bc = quant_block_shape((rows, cols), g, block_size, axis if g != ScalingGranularity.TENSORWISE else -1,
                               scaling_recipe)
    xd = x2.double()  # exact for fp32/bf16/fp16 inputs
    amax = _block_reduce_amax(xd, br, bc)
    if g == ScalingGranularity.MX_BLOCKWISE:
        shared, byte = _mx_shared_exp(amax, mx_emax(out_dtype))
        mult = torch.pow(2.0, -shared.double())  # x / 2**shared_exp, exact
        y = (xd * _expand(mult, br, bc, rows, cols)).to(torch.float32)
        scale_inv = byte.to(torch.uint8).view(torch.float8_e8m0fnu)
    else:
        scale, scale_inv = _fp32_scales(amax, fmax)
        y = (xd * _expand(scale.double(), br, bc, rows, cols)).to(torch.float32)  # the fp32 product
    q = torch.clamp(y, -fmax, fmax).to(out_dtype)  # clamp keeps NaN; the cast rounds to nearest even
    if g == ScalingGranularity.TENSORWISE:
        return q.reshape(shape), scale_inv.reshape(())
    return q.reshape(shape), scale_inv.reshape(scale_inv_shape(shape, g, block_size, axis, scaling_recipe))


def _scale_values(scale_inv: torch.Tensor) -> torch.Tensor:
    """fp64 multipliers of a scale tensor (E8M0 bytes decoded: 255 is NaN)."""
    if scale_inv.dtype == torch.float8_e8m0fnu:
        e = scale_inv.view(torch.uint8).to(torch.int64)
        v = torch.pow(2.0, (e - 127).double())
        return torch.where(e == 255, torch.full_like(v, float("nan")), v)
    return scale_inv.double()


def dequantize_fp8_ref(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    granularity,
    *,
    block_size: Optional[int] = None,
    axis: int = -1,
    scaling_recipe: Optional[ScalingRecipe] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x = q * scale_inv`` over each block: the product rounded to fp32, then cast to ``out_dtype``."""
    g = _as_granularity(granularity)
    shape = tuple(q.shape)
    if g == ScalingGranularity.TENSORWISE:
        return (q.double() * scale_inv.double()).to(torch.float32).to(out_dtype)
    lead, rows, cols = _split_shape(shape, axis)
    br, bc = quant_block_shape((rows, cols), g, block_size, axis, scaling_recipe)
    sr, sc = -(-rows // br), -(-cols // bc)
    s = _scale_values(scale_inv).reshape(sr, sc)
    x = q.reshape(rows, cols).double() * _expand(s, br, bc, rows, cols)
    return x.to(torch.float32).to(out_dtype).reshape(shape)


def _e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp64 values already in [-6, 6] (or NaN) -> 4-bit codes (int64): nearest E2M1 value, ties to
    the even code; the sign in bit 3 (so -0.0 and small negatives give 0x8); NaN gives 0."""
    grid = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float64, device=y.device)
    codes = torch.arange(8, device=y.device)
    a = y.abs()
    dist = (a.unsqueeze(-1) - grid).abs()
    best = dist == dist.amin(dim=-1, keepdim=True)  # all False for NaN
    pref = best.to(torch.int64) * (2 - (codes & 1))  # among ties prefer the even code
    mag = pref.argmax(dim=-1)
    nan = torch.isnan(y)
    sign = torch.signbit(y) & ~nan
    return torch.where(nan, torch.zeros_like(mag), mag | (sign.to(torch.int64) << 3))


def _e2m1_encode_sr(y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of fp64 values in [-6, 6] (or NaN) to E2M1 codes with uniforms ``u`` in
    [0, 1): between the neighbouring grid magnitudes ``lo <= |y| <= hi`` the code of ``hi`` when
    ``u < (|y| - lo) / (hi - lo)``, else that of ``lo`` (a value on the grid never moves)."""
    grid = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float64, device=y.device)
    a = y.abs()
    nan = torch.isnan(y)
    a = torch.where(nan, torch.zeros_like(a), a)
    lo = (torch.searchsorted(grid, a.contiguous(), right=True) - 1).clamp(0, 7)  # largest grid value <= a
    hi = (lo + 1).clamp(max=7)
    glo, ghi = grid[lo], grid[hi]
    frac = torch.where(ghi > glo, (a - glo) / (ghi - glo), torch.zeros_like(a))
    mag = torch.where(u.double() < frac, hi, lo)
    sign = torch.signbit(y) & ~nan
    return torch.where(nan, torch.zeros_like(mag), mag | (sign.to(torch.int64) << 3))


def _fp4_dtype():
    return getattr(torch, "float4_e2m1fn_x2", None) or torch.uint8


def quantize_fp4_ref(x: torch.Tensor, *, axis: int = -1,
                     rand: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: E2M1 values (RNE, saturating to +-6) with one E8M0 scale per 32 elements.

    Args:
        x: 2-D fp32/bf16/fp16 ``[rows, cols]``; the quantized dim must be a multiple of 32.
        axis: -1 (groups and packing along the columns) or 0 (along the rows).
        rand: optional uniforms in [0, 1) shaped like ``x``: stochastic rounding instead of RNE
            (the scales and the saturation are unchanged; a value between the neighbouring codes
            ``lo < v < hi`` rounds up iff ``rand < (v - lo) / (hi - lo)``). ``rand = 0`` gives
            round-up and ``rand = 1`` round-down of every off-grid value.

    Returns:
        ``(packed, scale_inv)``: ``packed`` is ``[rows, cols / 2]`` (axis=-1) or ``[rows / 2, cols]``
        (axis=0), ``float4_e2m1fn_x2`` (``uint8`` on torch without it), element ``2i`` of the
        quantized axis in the low nibble; ``scale_inv`` the E8M0 scales, ``[rows, cols / 32]`` or
        ``[rows / 32, cols]``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_fp4_ref: x must be 2-D, got shape {tuple(x.shape)}")
    xt = x.t() if axis == 0 else x
    rows, cols = xt.shape
    if cols % MXFP4_BLOCK_SIZE:
        raise ValueError(f"quantize_fp4_ref: the quantized dim must be a multiple of 32, got {cols}")
    xd = xt.double()
    amax = _block_reduce_amax(xd, 1, MXFP4_BLOCK_SIZE)
    shared, byte = _mx_shared_exp(amax, _FP4_EMAX)
    y = xd * _expand(torch.pow(2.0, -shared.double()), 1, MXFP4_BLOCK_SIZE, rows, cols)
    y = y.to(torch.float32).double()  # the fp32 product (exact unless deep in fp32's subnormals)
    y = torch.clamp(y, -_FP4_MAX, _FP4_MAX)
    if rand is None:
        codes = _e2m1_encode(y)
    else:
        if tuple(rand.shape) != tuple(x.shape):
            raise ValueError(f"quantize_fp4_ref: rand must be shaped like x {tuple(x.shape)}, got {tuple(rand.shape)}")
        codes = _e2m1_encode_sr(y, (rand.t() if axis == 0 else rand).to(y.device))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = byte.to(torch.uint8)
    if axis == 0:
        packed, scale = packed.t().contiguous(), scale.t().contiguous()
    return packed.view(_fp4_dtype()), scale.view(torch.float8_e8m0fnu)


def dequantize_fp4_ref(
    packed: torch.Tensor, scale_inv: torch.Tensor, *, axis: int = -1, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Unpack E2M1 codes and multiply by the E8M0 block scales (product rounded to fp32, then cast)."""
    p = packed.view(torch.uint8)
    s = scale_inv
    if axis == 0:
        p, s = p.t(), s.t()
    lo, hi = (p & 0xF).to(torch.int64), (p >> 4).to(torch.int64)
    codes = torch.stack((lo, hi), dim=-1).reshape(p.shape[0], p.shape[1] * 2)
    grid = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float64, device=p.device)
    mag = grid[codes & 7]
    val = torch.where((codes & 8) != 0, -mag, mag)
    rows, cols = val.shape
    x = val * _expand(_scale_values(s), 1, MXFP4_BLOCK_SIZE, rows, cols)
    x = x.to(torch.float32).to(out_dtype)
    return x.t().contiguous() if axis == 0 else x
