"""padded_group_layout as one Triton launch: bit-identical to the torch version (the reference).

Cases: G 0 / 1 / 3 / 8 / 64 / 300 (several chunks of groups per program), align 16 / 32 / 128,
nonempty or not, int32 and int64 offsets; per case, monotone offsets with empty groups, a tail of
unrouted rows, offsets past ``m_total`` and below 0 (clamped), decreasing offsets (lens clamped at
0, padded offsets past ``M_pad``) and ``m_total == 0``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.pytorch.backends.grouped_gemm_fp8 import (  # noqa: E402
    _padded_group_layout_torch,
    _padded_layout_backend,
    padded_group_layout,
)
from primus_turbo.triton.grouped_gemm.padded_layout import padded_group_layout_triton  # noqa: E402


def _cases(G: int, align: int, gen: torch.Generator):
    """(name, offsets [G+1] int64 on the CPU, m_total)."""
    lens = torch.randint(0, 3 * align, (G,), generator=gen)
    lens[torch.rand(G, generator=gen) < 0.3] = 0  # empty groups
    offs = torch.zeros(G + 1, dtype=torch.int64)
    offs[1:] = lens.cumsum(0)
    m = int(offs[-1])
    yield "exact", offs, m
    yield "tail", offs, m + int(torch.randint(1, 2 * align, (1,), generator=gen))
    yield "clamped", offs - int(torch.randint(0, 5, (1,), generator=gen)), max(m - align - 3, 0)
    shuffled = offs.clone()
    if G > 0:
        idx = torch.randperm(G + 1, generator=gen)[: max(2, (G + 1) // 3)]
        shuffled[idx] = shuffled[idx.flip(0)]  # decreasing stretches
    yield "decreasing", shuffled, m
    yield "random", torch.randint(-align, m + align + 1, (G + 1,), generator=gen), m
    yield "m0", offs, 0


def _check(offs: torch.Tensor, m: int, align: int, nonempty: bool):
    src, poffs = padded_group_layout_triton(offs, m, align, nonempty)
    ref_src, ref_poffs = _padded_group_layout_torch(offs, m, align, nonempty)
    assert src.dtype == torch.int64 and poffs.dtype == torch.int64
    assert src.shape == ref_src.shape and poffs.shape == ref_poffs.shape
    assert torch.equal(poffs, ref_poffs), (offs.tolist(), m, align, nonempty)
    bad = (src != ref_src).nonzero().flatten()[:8].tolist()
    assert torch.equal(src, ref_src), (offs.tolist(), m, align, nonempty, bad)


@pytest.mark.parametrize("G", [0, 1, 3, 8, 64, 300])
@pytest.mark.parametrize("align", [16, 32, 128])
@pytest.mark.parametrize("nonempty", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_padded_layout_matches_torch(G, align, nonempty, dtype, device):
    if G == 300 and align == 128:  # 38400+ padded rows a call: one case below, not the grid
        pytest.skip("see test_padded_layout_matches_torch_many_groups_large_align")
    gen = torch.Generator().manual_seed(1000 * G + align + 7 * nonempty)
    big = G >= 300 or G * align >= 8192  # 32+ programs or 10 chunks a call: a few variants each
    keep = ("exact", "decreasing", "random") if dtype == torch.int64 else ("random",)
    for name, offs, m in _cases(G, align, gen):
        if big and name not in keep:
            continue
        _check(offs.to(device=device, dtype=dtype), m, align, nonempty)


def test_padded_layout_matches_torch_many_groups_large_align(device):
    gen = torch.Generator().manual_seed(300128)
    cases = {name: (offs, m) for name, offs, m in _cases(300, 128, gen)}
    offs, m = cases["decreasing"]
    _check(offs.to(device=device, dtype=torch.int32), m, 128, True)


@pytest.mark.parametrize("nonempty", [False, True])
def test_padded_layout_block_edges(nonempty, device):
    """Segments that start, end and run across the 256-row program blocks, and M_pad exactly one block."""
    for lens, m_extra in [([256], 0), ([255, 1], 0), ([1, 256, 255, 0, 513], 3), ([0] * 40, 0), ([240], 0)]:
        offs = torch.zeros(len(lens) + 1, dtype=torch.int64)
        offs[1:] = torch.tensor(lens).cumsum(0)
        for align in (16, 128):
            _check(offs.to(device), int(offs[-1]) + m_extra, align, nonempty)


def test_padded_layout_dispatch(device, monkeypatch):
    """The Triton kernel serves CUDA and the interpreter (so the CPU tests run it); plain CPU, other
    offset dtypes and non-contiguous offsets keep the torch version."""
    offs = torch.tensor([0, 5, 5, 40, 41], dtype=torch.int64, device=device)
    assert _padded_layout_backend(offs, 44, 32) == "triton"
    assert _padded_layout_backend(offs.to(torch.int32), 44, 32) == "triton"
    assert _padded_layout_backend(offs.to(torch.int16), 44, 32) == "torch"
    assert _padded_layout_backend(torch.zeros(10, dtype=torch.int64, device=device)[::2], 44, 32) == "torch"
    assert _padded_layout_backend(offs, 2**31, 32) == "torch"
    src, poffs = padded_group_layout(offs.to(torch.int16), 44, 32)  # the fallback still answers
    ref = _padded_group_layout_torch(offs, 44, 32)
    assert torch.equal(src, ref[0]) and torch.equal(poffs, ref[1])
    calls = []
    import primus_turbo.triton.grouped_gemm.padded_layout as pl

    monkeypatch.setattr(pl, "padded_group_layout_triton", lambda *a: calls.append(a) or ref)
    padded_group_layout(offs, 44, 32)
    assert len(calls) == 1
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert _padded_layout_backend(offs, 44, 32) == "torch"


@pytest.mark.gpu
def test_padded_layout_no_sync_and_direct_launch():
    """On CUDA: no host sync, the direct C launch from the second call on (same results, on the
    current stream), Triton's launch path again under a launch hook."""
    from triton import knobs

    from primus_turbo.triton.grouped_gemm import padded_layout as pl
    from primus_turbo.triton import launch as launch_mod

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(5)
    for call in range(3):
        for G, align in [(8, 16), (64, 128), (300, 32)]:
            for name, offs, m in _cases(G, align, gen):
                o = offs.cuda()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with torch.cuda.stream(stream):
                        src, poffs = padded_group_layout(o, m, align, nonempty=call == 1)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.current_stream().wait_stream(stream)
                ref = _padded_group_layout_torch(o, m, align, nonempty=call == 1)
                assert torch.equal(src, ref[0]) and torch.equal(poffs, ref[1]), (G, align, name, call)
    assert any(k[0] == id(pl._padded_layout_kernel) and v[0] is not None for k, v in launch_mod._ENTRIES.items())  # the direct entry exists for this launcher
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        offs = torch.tensor([0, 5, 5, 40, 41], device="cuda")
        src, poffs = padded_group_layout(offs, 44, 32)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert seen and poffs.tolist() == [0, 32, 32, 96, 128]
