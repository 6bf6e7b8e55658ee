"""primus_turbo.testing.host_sync.forbid_host_sync: what it flags, what it lets through, and that it
leaves torch as it found it."""

from __future__ import annotations

import os

import pytest
import torch

from primus_turbo.testing import host_sync
from primus_turbo.testing.host_sync import HostSyncError, forbid_host_sync


@pytest.mark.parametrize("name, fn", [
    ("item", lambda x: x.sum().item()),
    ("bool", lambda x: bool(x.sum() > 0)),
    ("int", lambda x: int(x[0, 0])),
    ("mask index", lambda x: x[x > 0]),
    ("nonzero", lambda x: torch.nonzero(x)),
    ("masked_select", lambda x: torch.masked_select(x, x > 0)),
    ("unique", lambda x: torch.unique(x)),
    # repeats made on the device (a host tensor copied in would trip CUDA's sync check first)
    ("repeat_interleave", lambda x: torch.repeat_interleave((x[0, :2] > -1e9).long() + 1)),
])
def test_flags_syncing_ops(name, fn, device):
    x = torch.randn(6, 4, device=device)
    with pytest.raises(HostSyncError, match=f"{name}: aten"):
        with forbid_host_sync(name):
            fn(x)


def test_lets_device_only_ops_through(device):
    x = torch.randn(6, 4, device=device)
    idx = torch.tensor([1, 3], device=device)
    reps = torch.tensor([1, 2], device=device)  # made outside: a pageable host copy syncs on CUDA
    with forbid_host_sync("device only"):
        y = x[idx] * 2 + x.sum()
        torch.repeat_interleave(reps, output_size=3)
        torch.where(x > 0, x, 0).cumsum(0)
        torch._assert_async(torch.all(x == x))
    assert y.shape == (2, 4)


def test_library_host_reads_are_flagged_and_tests_are_not():
    x = torch.arange(4)
    # a function whose code lives in the package (as the library's own code would)
    fake = os.path.join(host_sync._PKG, "pytorch", "ops", "fake_op.py")
    scope = {}
    exec(compile("def op(t):\n    return t.tolist()\n\ndef op_cpu(t):\n    return t.cpu()\n", fake, "exec"), scope)
    with forbid_host_sync("lib"):
        assert x.tolist() == [0, 1, 2, 3]          # a test's own read: not the library
        with pytest.raises(HostSyncError, match=r"Tensor.tolist\(\) copies to the host"):
            scope["op"](x)
        with pytest.raises(HostSyncError, match=r"Tensor.cpu\(\)"):
            scope["op_cpu"](x)
    assert scope["op"](x) == [0, 1, 2, 3]          # outside the block: untouched


def test_restores_torch_on_exit_and_on_error():
    before = {n: getattr(torch.Tensor, n) for n in host_sync._HOST_READS}
    with pytest.raises(ValueError):
        with forbid_host_sync("boom"):
            raise ValueError("inside")
    assert {n: getattr(torch.Tensor, n) for n in host_sync._HOST_READS} == before
    torch.zeros(2).sum().item()                     # no mode left active
    if torch.cuda.is_available():
        assert torch.cuda.get_sync_debug_mode() == 0
