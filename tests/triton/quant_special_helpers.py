"""Inputs with special values for the bf16-pair quantizer tests (test_quant_fp8_packed.py,
test_quant_fp4_packed.py)."""

from __future__ import annotations

import torch

# bf16 bit patterns: -NaN with payload, +NaN with payload, -/+ smallest subnormal
_PAYLOADS = [0xFF81, 0x7FC1, 0x8001, 0x0001]


def special_bf16(rows: int, cols: int, device, values: list, seed: int = 0) -> torch.Tensor:
    """bf16 [rows, cols]: normal rows scaled by 2**-10 .. 2**10 (one power per row), ``values``
    ((index, value) pairs, index as for ``x[index]``) written in fp32, then row 7's first 32 entries set
    to NaN payloads and signed subnormal bit patterns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-10, 11, (rows, 1), generator=g).float())
    for idx, v in values:
        x[idx] = v if isinstance(v, float) else torch.tensor(v)
    x = x.to(torch.bfloat16)
    x[7, 0:32] = torch.tensor(_PAYLOADS * 8, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x.to(device)
