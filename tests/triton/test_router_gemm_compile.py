"""sm_90 compile checks (no GPU) of the router GEMM kernels at their default launch configs: every
kernel binds the launcher's real arguments and fits the H200's shared memory (a config over it
fails only at the first GPU launch: the first version did, at E = 70 and 256). Numerics:
tests/pytorch/ops/test_moe_router_gemm.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from .gluon_compile_child import rerun_outside_interpreter, warmup_for_sm90  # noqa: E402

SMEM_LIMIT = 232448  # bytes per block on sm_90 (227 KiB)


def _captured(monkeypatch, call):
    """(kernel, args, kwargs) of the launch ``call()`` makes, without running it."""
    from primus_turbo.triton.moe import router_gemm_kernel as k

    seen = []
    monkeypatch.setattr(k, "launch", lambda fn, grid, args, kwargs, device: seen.append((fn, args, kwargs)))
    call(k)
    monkeypatch.undo()
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("kern,e,wdt", [("fwd", 8, torch.float32), ("fwd", 32, torch.float32),
                                        ("fwd", 256, torch.float32), ("fwd", 32, torch.bfloat16),
                                        ("dx", 32, torch.float32), ("dx", 256, torch.float32),
                                        ("dx", 32, torch.bfloat16), ("dw", 256, torch.float32)])
def test_router_kernels_fit_sm90(kern, e, wdt, monkeypatch, request):
    if rerun_outside_interpreter(request):
        return
    t, h = 256, 384
    x = torch.randn(t, h).to(torch.bfloat16)
    w = torch.randn(e, h).to(wdt)
    g = torch.randn(t, e)
    calls = {"fwd": lambda k: k.router_fwd_launch(x, w),
             "dx": lambda k: k.router_dx_launch(g, w),
             "dw": lambda k: k.router_dw_launch(x, g, splits=4)}
    fn, args, kwargs = _captured(monkeypatch, calls[kern])
    compiled = warmup_for_sm90(fn, args, kwargs, monkeypatch)
    assert compiled.metadata.shared <= SMEM_LIMIT, (kern, e, compiled.metadata.shared)
    assert compiled.metadata.num_warps == kwargs["num_warps"]
