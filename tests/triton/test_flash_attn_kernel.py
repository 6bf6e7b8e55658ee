"""The attention Triton kernels called directly: ragged sequence lengths (not block multiples),
non-power-of-two head dims, every mask kind, sinks, and degenerate sizes, against float64."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.testing import attention_ref, snr_db

triton_attn = pytest.importorskip("primus_turbo.triton.attention")


def _win(causal, window):
    left, right = window
    return left, (0 if causal else right)


@pytest.mark.parametrize(
    "cfg,causal,window,sink",
    [
        ((37, 50, 2, 1, 24, 40), False, (-1, -1), True),
        ((50, 37, 3, 3, 40, 24), True, (-1, -1), False),  # seq_q > seq_kv: empty causal rows
        ((45, 45, 2, 2, 16, 16), False, (5, 3), True),
        ((33, 70, 4, 2, 32, 16), True, (20, -1), True),
        ((40, 40, 2, 1, 32, 32), False, (-1, 0), False),  # right=0 without causal = causal
        # several blocks per row / column (the CPU tiles are 32): masked edge blocks around an
        # unmasked interior, whole and partial blocks, head dims with and without padding
        ((128, 128, 2, 1, 32, 32), True, (-1, -1), False),
        ((100, 164, 2, 1, 32, 32), True, (-1, -1), True),
        ((164, 100, 2, 2, 32, 32), False, (40, 10), False),
        ((130, 130, 2, 2, 24, 40), False, (50, -1), True),
        ((96, 160, 1, 1, 32, 32), False, (-1, -1), False),
    ],
)
def test_kernels_vs_fp64(cfg, causal, window, sink, device):
    _check_vs_fp64(cfg, causal, window, sink, device, 0.3)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_kernels_nonpositive_scale(scale, causal, device):
    """The forward takes the row extreme before scaling: a negative scale needs the row minimum."""
    _check_vs_fp64((100, 164, 2, 1, 32, 32), causal, (-1, -1), True, device, scale)


def _check_vs_fp64(cfg, causal, window, sink, device, scale):
    if triton_attn.check_flash_attn_triton(torch.empty(1, device=device), None, torch.empty(1, device=device)):
        pytest.skip("Triton attention kernels cannot run on this device")
    sq, sk, hq, hk, dqk, dv = cfg
    q = torch.randn(2, sq, hq, dqk, dtype=torch.float64, device=device, requires_grad=True)
    k = torch.randn(2, sk, hk, dqk, dtype=torch.float64, device=device, requires_grad=True)
    v = torch.randn(2, sk, hk, dv, dtype=torch.float64, device=device, requires_grad=True)
    s = torch.randn(hq, dtype=torch.float64, device=device, requires_grad=True) if sink else None
    wl, wr = _win(causal, window)
    f = lambda t: None if t is None else t.detach().float()  # noqa: E731
    out, lse = triton_attn.flash_attn_fwd_triton(f(q), f(k), f(v), f(s), scale, wl, wr)
    ref, ref_lse = attention_ref(q, k, v, causal, window, s, scale, return_lse=True)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    dq, dk, dv_, dsink = triton_attn.flash_attn_bwd_triton(dout.float(), f(q), f(k), f(v), out, lse, f(s), scale, wl, wr)
    assert snr_db(ref, out) >= 40.0
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert snr_db(ref_lse[fin], lse[fin]) >= 40.0
    for name, g, rg in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv_, v.grad)):
        assert snr_db(rg, g) >= 40.0, name
    if sink:
        assert snr_db(s.grad, dsink) >= 40.0
    else:
        assert dsink is None


def test_zero_length_kv(device):
    if triton_attn.check_flash_attn_triton(torch.empty(1, device=device), None, torch.empty(1, device=device)):
        pytest.skip("Triton attention kernels cannot run on this device")
    q = torch.randn(1, 8, 2, 16, device=device)
    k = torch.randn(1, 0, 2, 16, device=device)
    v = torch.randn(1, 0, 2, 16, device=device)
    out, lse = triton_attn.flash_attn_fwd_triton(q, k, v, None, 0.25)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("inf")).all())
    dq, dk, dv, _ = triton_attn.flash_attn_bwd_triton(torch.randn_like(out), q, k, v, out, lse, None, 0.25)
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.numel() == 0 and dv.numel() == 0
