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


@pytest.mark.gpu
def test_zero_tail_rows_direct_launch_after_the_first_call():
    """From the second call on, the compiled kernel is launched through its C entry (no Triton
    launch path): same result, on the current stream, and Triton's path again under launch hooks."""
    from triton import knobs

    from primus_turbo.triton.grouped_gemm import zero_tail as zt
    from primus_turbo.triton import launch as launch_mod

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for call in range(3):
        out = torch.randn(300, 200, dtype=torch.bfloat16, device="cuda")
        ref = out.clone()
        last = 17 + 90 * call
        ref[last:] = 0
        offs = torch.tensor([0, last], dtype=torch.int64, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            zt.zero_tail_rows_(out, offs)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(out, ref), call
    assert any(k[0] == id(zt._zero_tail_kernel) and v[0] is not None for k, v in launch_mod._ENTRIES.items())  # the direct entry exists for this launcher
    # and the launcher's own key holds it (launch_keyed: no launch_key on later calls)
    assert any(k[0] == id(zt._zero_tail_kernel) for k in launch_mod._KEYED)
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        out = torch.randn(64, 200, dtype=torch.bfloat16, device="cuda")
        zt.zero_tail_rows_(out, torch.tensor([0, 10], device="cuda"))
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert seen and torch.equal(out[10:], torch.zeros_like(out[10:]))
