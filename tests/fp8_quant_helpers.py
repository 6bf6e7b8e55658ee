"""Plain-torch FP8 quantizers and dequantizers for the FP8 GEMM tests (docs/low_precision.md).

Self-contained so the kernel tests do not depend on the quantization ops: scale computation as
the doc specifies (``scale = FP8_MAX / amax`` for 0 < amax < inf, else 1; saturating RNE cast;
``scale_inv = 1 / scale``; MX: ``shared_exp = floor(log2(amax)) - emax``, E8M0 byte ``+127``).
Every quantizer returns ``(q, scale_inv)`` grouped along the last dim of ``x``.
"""

from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
MX_EMAX = {E4M3: 8, E5M2: 15}


def _scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, FP8_MAX[dtype] / torch.where(ok, amax, torch.ones_like(amax)), torch.ones_like(amax))


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = FP8_MAX[dtype]
    return x.clamp(-m, m).to(dtype)


def quant_tensorwise(x: torch.Tensor, dtype=E4M3):
    x = x.float()
    scale = _scale_from_amax(x.abs().amax(), dtype)
    return _cast(x * scale, dtype), (1.0 / scale).reshape(())


def quant_rowwise(x: torch.Tensor, dtype=E4M3):
    """Per row of a 2-D x: scale_inv [rows, 1]."""
    x = x.float()
    scale = _scale_from_amax(x.abs().amax(dim=1, keepdim=True), dtype)
    return _cast(x * scale, dtype), 1.0 / scale


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def quant_block_1d(x: torch.Tensor, dtype=E4M3, block: int = 128):
    """1 x block groups along the last dim: scale_inv [rows, ceil(cols / block)]."""
    x = x.float()
    r, c = x.shape
    kb = math.ceil(c / block)
    g = _pad_to(x, r, kb * block).view(r, kb, block)
    scale = _scale_from_amax(g.abs().amax(-1), dtype)
    q = _cast(g * scale[..., None], dtype).view(r, kb * block)[:, :c].contiguous()
    return q, 1.0 / scale


def quant_block_2d(x: torch.Tensor, dtype=E4M3, block: int = 128):
    """block x block tiles: scale_inv [ceil(rows / block), ceil(cols / block)]."""
    x = x.float()
    r, c = x.shape
    rb, kb = math.ceil(r / block), math.ceil(c / block)
    g = _pad_to(x, rb * block, kb * block).view(rb, block, kb, block)
    scale = _scale_from_amax(g.abs().amax(dim=(1, 3)), dtype)
    q = _cast(g * scale[:, None, :, None], dtype).view(rb * block, kb * block)[:r, :c].contiguous()
    return q, 1.0 / scale


def quant_mx(x: torch.Tensor, dtype=E4M3):
    """1 x 32 groups along the last dim (cols % 32 == 0): E8M0 scale [rows, cols / 32]."""
    x = x.float()
    r, c = x.shape
    assert c % 32 == 0
    g = x.view(r, c // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)), torch.full_like(amax, -127.0)) - MX_EMAX[dtype]
    e = torch.where(amax > 0, e, torch.full_like(amax, -127.0)).clamp(-127, 127)
    q = _cast(g / torch.exp2(e)[..., None], dtype).view(r, c)
    return q, (e + 127).to(torch.uint8).view(E8M0)


def quantize(x: torch.Tensor, mode: str, dtype=E4M3, weight: bool = False, block: int = 128):
    """Quantize x [rows, K] along K in ``mode``; BLOCKWISE weights take block x block tiles."""
    if mode == "TENSORWISE":
        return quant_tensorwise(x, dtype)
    if mode == "ROWWISE":
        return quant_rowwise(x, dtype)
    if mode == "BLOCKWISE":
        return quant_block_2d(x, dtype, block) if weight else quant_block_1d(x, dtype, block)
    if mode == "MX_BLOCKWISE":
        return quant_mx(x, dtype)
    raise ValueError(mode)


def dequantize(q: torch.Tensor, s: torch.Tensor, mode: str, block: int = 128) -> torch.Tensor:
    """float64 x = q * scale_inv over the groups of ``mode`` (the block kind read from s's shape)."""
    qd = q.double()
    r, c = q.shape
    if mode in ("TENSORWISE", "ROWWISE"):
        return qd * s.double().reshape(-1, 1) if mode == "ROWWISE" else qd * s.double()
    if mode == "MX_BLOCKWISE":
        e = s.view(torch.uint8).double()
        scale = torch.where(e == 255, torch.full_like(e, float("nan")), torch.exp2(e - 127))
        return (qd.view(r, c // 32, 32) * scale[..., None]).view(r, c)
    kb = math.ceil(c / block)
    if s.shape[0] == r:  # 1 x block groups (one scale row per row)
        g = _pad_to(qd, r, kb * block).view(r, kb, block) * s.double()[..., None]
        return g.view(r, kb * block)[:, :c]
    rb = math.ceil(r / block)
    g = _pad_to(qd, rb * block, kb * block).view(rb, block, kb, block) * s.double()[:, None, :, None]
    return g.view(rb * block, kb * block)[:r, :c]
