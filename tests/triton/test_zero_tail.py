"""zero_tail_rows_: rows past offs[-1] become zero, every other row is left bit-identical."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.grouped_gemm.zero_tail import zero_tail_rows_  # noqa: E402


@pytest.mark.parametrize("m,n,last", [(100, 70, 37), (64, 300, 64), (5, 8, 0), (33, 512, 32), (1, 1, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_tail_rows(m, n, last, dtype, device):
    out = torch.randn(m, n, dtype=dtype, device=device)
    ref = out.clone()
    ref[last:] = 0
    offs = torch.tensor([0, last // 2, last], dtype=torch.int64, device=device)
    assert zero_tail_rows_(out, offs) is out
    assert torch.equal(out, ref)


def test_zero_tail_rows_strided_view(device):
    base = torch.randn(40, 96, device=device)
    out = base[:, :64]  # row stride 96, unit column stride
    ref = base.clone()
    ref[25:, :64] = 0
    zero_tail_rows_(out, torch.tensor([0, 25], device=device))
    assert torch.equal(base, ref)
