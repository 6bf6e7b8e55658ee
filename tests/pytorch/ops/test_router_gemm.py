"""turbo.ops.router_logits: the fp32 router GEMM of bf16 activations through bf16 operand splits,
against an fp64 reference and next to the plain fp32 path (``F.linear(x.float(), w)``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from primus_turbo.pytorch.ops import router_logits
from primus_turbo.pytorch.ops.router_gemm import _split3


def _inputs(t, h, e, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(e, h, generator=g) * h ** -0.5).to(device)
    dlog = torch.randn(t, e, generator=g).to(device)
    return x, w, dlog


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref).norm() / ref.norm())


def test_split3_is_exact():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    hi, mid, lo = _split3(t)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi.double() + mid.double() + lo.double(), t.double())


@pytest.mark.parametrize("t,h,e", [(256, 2880, 32), (130, 7168, 8), (64, 512, 256), (1, 64, 4)])
def test_matches_fp64_like_the_fp32_path(t, h, e, device):
    """Out, x.grad and weight.grad: within the plain fp32 path's own error of the fp64 reference
    (x 2, both are fp32 accumulations in different orders); x.grad is bf16 like the plain path's
    cast (at most one bf16 ulp apart from the rounded fp64 gradient). Outputs are fresh tensors
    (nothing to poison); the gradients start as None."""
    x, w, dlog = _inputs(t, h, e, device, seed=t + e)
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = router_logits(xs, ws)
    out.backward(dlog)
    xp, wp = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    plain = F.linear(xp.float(), wp)
    plain.backward(dlog)

    x64, w64, g64 = x.double(), w.double(), dlog.double()
    ref, ref_dx, ref_dw = x64 @ w64.T, g64 @ w64, g64.T @ x64
    assert out.dtype == torch.float32 and out.shape == (t, e)
    assert _rel_err(out, ref) <= 2 * _rel_err(plain, ref) + 1e-9
    assert _rel_err(ws.grad, ref_dw) <= 2 * _rel_err(wp.grad, ref_dw) + 1e-9
    assert xs.grad.dtype == torch.bfloat16 and xp.grad.dtype == torch.bfloat16
    # per element: the bf16 rounding (half an ulp, <= 2**-8 relative) plus an fp32 accumulation
    # bound over the E terms (where they cancel, the result is tiny and the fp32 sums dominate)
    bound = ref_dx.abs() * 2.0 ** -8 + 2.0 ** -20 * (g64.abs() @ w64.abs())
    assert bool(((xs.grad.double() - ref_dx).abs() <= bound).all())
    assert _rel_err(xs.grad, ref_dx) <= 2 * _rel_err(xp.grad, ref_dx) + 1e-9


def test_only_weight_grad(device):
    x, w, dlog = _inputs(32, 128, 4, device)
    ws = w.clone().requires_grad_(True)
    router_logits(x, ws).backward(dlog)
    assert ws.grad is not None and ws.grad.dtype == torch.float32


def test_empty_tokens(device):
    x, w, _ = _inputs(0, 64, 4, device)
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = router_logits(xs, ws)
    assert out.shape == (0, 4)
    out.sum().backward()
    assert xs.grad.shape == (0, 64) and bool((ws.grad == 0).all())


def test_errors(device):
    x, w, _ = _inputs(8, 64, 4, device)
    with pytest.raises(TypeError, match="bfloat16"):
        router_logits(x.float(), w)
    with pytest.raises(TypeError, match="float32"):
        router_logits(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        router_logits(x, w[:, :32])
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        router_logits(x[None], w)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="on"):
            router_logits(x.cuda(), w.cpu())


@pytest.mark.parametrize("mg_dtype", [torch.float32, torch.bfloat16])
def test_megatron_main_grad_accumulation(mg_dtype, device):
    """fuse_bgrad_accum_pattern="megatron": two micro-batches add their weight gradients into
    main_grad (fp32 or bf16), grad_added_to_main_grad is set, x.grad is unchanged by the fusion."""
    x, w, dlog = _inputs(48, 256, 8, device, seed=3)
    x2, _, dlog2 = _inputs(48, 256, 8, device, seed=4)
    ws = w.clone().requires_grad_(True)
    start = torch.randn(w.shape, generator=torch.Generator().manual_seed(9)).to(device)
    ws.main_grad = start.to(mg_dtype).clone()
    want = start.to(mg_dtype).float()
    for xi, gi in ((x, dlog), (x2, dlog2)):
        xs = xi.clone().requires_grad_(True)
        router_logits(xs, ws, fuse_bgrad_accum_pattern="megatron").backward(gi)
        assert ws.grad_added_to_main_grad
        xr, wr = xi.clone().requires_grad_(True), w.clone().requires_grad_(True)
        router_logits(xr, wr).backward(gi)
        assert torch.equal(xs.grad, xr.grad)
        want = (want + wr.grad).to(mg_dtype).float()
        ws.grad = None
    tol = 1e-6 if mg_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ws.main_grad.float(), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="fuse_bgrad_accum_pattern"):
        router_logits(x, ws, fuse_bgrad_accum_pattern="apex")
    del ws.main_grad
    with pytest.raises(ValueError, match="main_grad"):
        router_logits(x, ws, fuse_bgrad_accum_pattern="megatron")
