"""The benchmarks' timing switch: bad values and unsupported combinations are refused."""

from __future__ import annotations

import pytest

from benchmarks import common


def test_set_timing_rejects_unknown_modes():
    with pytest.raises(ValueError, match="timing must be"):
        common.set_timing("wall")
    common.set_timing("do_bench")


def test_graph_timing_resets_grads_in_every_call():
    """Graph timing of a backward: every captured call starts with the grads set to None (so its
    backward assigns, as under do_bench's grad_to_none, rather than accumulating)."""
    import torch

    x = torch.ones(3, requires_grad=True)
    seen = []

    def fn():
        seen.append(x.grad is None)
        (x * 2).sum().backward()

    step = common._with_grads_reset(fn, [x])
    for _ in range(3):
        step()
    assert seen == [True, True, True] and torch.equal(x.grad, torch.full((3,), 2.0))
