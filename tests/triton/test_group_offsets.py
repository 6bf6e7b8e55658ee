"""group_offsets_: the [G+1] exclusive prefix sum of the group sizes in one launch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.grouped_gemm.offsets import MAX_GROUPS, group_offsets_  # noqa: E402


def _ref(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(lens.cpu().to(torch.int64), 0)
    return out


@pytest.mark.parametrize("G", [1, 2, 3, 16, 17, 300])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_group_offsets(G, dtype, device):
    gen = torch.Generator().manual_seed(G)
    lens = torch.randint(0, 5000, (G,), generator=gen).to(dtype)
    lens[::3] = 0  # empty groups
    lens = lens.to(device)
    offs = group_offsets_(lens)
    assert offs.dtype == torch.int64 and offs.device == lens.device and offs.shape == (G + 1,)
    assert torch.equal(offs.cpu(), _ref(lens))


def test_group_offsets_large_values_and_strided(device):
    """Sums past 2**31 stay exact (int64 scan); a strided view reads its own elements."""
    base = torch.full((40,), 2**30, dtype=torch.int64)
    base[1::2] = 7
    lens = base.to(device)[::2]  # 20 entries of 2**30: the sum needs 35 bits
    offs = group_offsets_(lens)
    assert torch.equal(offs.cpu(), _ref(lens))
    assert int(offs[-1]) == 20 * 2**30


def test_group_offsets_empty_and_fallback(device):
    assert torch.equal(group_offsets_(torch.zeros(0, dtype=torch.int64, device=device)).cpu(),
                       torch.zeros(1, dtype=torch.int64))
    lens = torch.randint(0, 9, (MAX_GROUPS + 5,), generator=torch.Generator().manual_seed(0)).to(device)
    assert torch.equal(group_offsets_(lens).cpu(), _ref(lens))


def test_group_offsets_bad_input(device):
    with pytest.raises(ValueError, match="1-D"):
        group_offsets_(torch.zeros(2, 3, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="float32"):
        group_offsets_(torch.zeros(3, dtype=torch.float32, device=device))


@pytest.mark.gpu
def test_op_offsets_use_one_launch():
    """On CUDA the op's helper takes the Triton kernel (one launch) and agrees with torch."""
    from primus_turbo.pytorch.ops.grouped_gemm import _offsets

    lens = torch.randint(0, 4096, (64,), device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        offs = _offsets(lens)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]
    assert torch.equal(offs.cpu(), _ref(lens))


@pytest.mark.gpu
def test_offsets_launch_takes_the_keyed_direct_path():
    """From the second call on, the offsets launch is a keyed hit on the compiled kernel's C entry
    (launch_keyed), not Triton's Python launch path: the op calls it on every grouped GEMM whose
    caller passes no offsets (the Megatron form)."""
    from primus_turbo.triton import launch as L
    from primus_turbo.triton.grouped_gemm import offsets as O

    lens = torch.randint(0, 4096, (8,), device="cuda")
    for _ in range(2):
        offs = group_offsets_(lens)
    hits = [v for k, v in L._KEYED.items() if k[0] == id(O._offsets_kernel)]
    entries = [v[0] is not None for k, v in L._ENTRIES.items() if k[0] == id(O._offsets_kernel)]
    assert hits, f"no keyed entry for the offsets kernel; launch() entries with a direct path: {entries}"
    assert torch.equal(offs.cpu(), _ref(lens))
