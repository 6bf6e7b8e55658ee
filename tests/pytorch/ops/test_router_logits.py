"""turbo.ops.router_logits: the fp32 router GEMM over 16-bit tokens (Triton kernels on the GPU and
under the interpreter) against float64, against torch's own fp32 expression, and its error paths."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo

CASES = [(100, 96, 8, torch.bfloat16), (130, 200, 32, torch.float16), (64, 64, 3, torch.float32),
         (1, 40, 256, torch.bfloat16), (600, 72, 16, torch.bfloat16)]  # 600 rows: two T splits in dw


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("t,h,e,dtype", CASES, ids=[f"T{c[0]}-H{c[1]}-E{c[2]}-{str(c[3])[6:]}" for c in CASES])
def test_router_logits_vs_fp64(t, h, e, dtype, device):
    g = torch.Generator().manual_seed(t * 7 + e)
    x = (torch.randn(t, h, generator=g) * 3).to(dtype).to(device).requires_grad_()
    w = (torch.randn(e, h, generator=g) * 0.05).to(device).requires_grad_()
    out = turbo.ops.router_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (t, e)
    gy = torch.randn(t, e, generator=g).to(device)
    out.backward(gy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    (x64 @ w64.t()).backward(gy.double())
    ref = x64.detach() @ w64.detach().t()
    # torch's fp32 expression as the yardstick of fp32 arithmetic error
    xt, wt = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    yt = torch.nn.functional.linear(xt, wt)
    yt.backward(gy)
    tol = lambda torch_err: 4 * torch_err + 1e-7  # noqa: E731
    assert _rel(out.detach(), ref) <= tol(_rel(yt.detach(), ref))
    assert _rel(w.grad, w64.grad) <= tol(_rel(wt.grad, w64.grad))
    assert x.grad.dtype == dtype
    if dtype == torch.float32:  # dx is an fp32 sum itself: torch's error is the yardstick
        assert _rel(x.grad, x64.grad) <= tol(_rel(xt.grad, x64.grad))
        return
    # dx: one rounding of the fp32 sum to x's 16-bit dtype: within one ulp of the rounded float64 value
    want = x64.grad.to(dtype).double()
    ulp = torch.finfo(dtype).eps * x64.grad.abs().clamp(min=torch.finfo(dtype).tiny)
    assert bool(((x.grad.double() - want).abs() <= 2 * ulp + 1e-30).all())


def test_router_logits_deterministic_and_empty(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(700, 48, generator=g).bfloat16().to(device).requires_grad_()
    w = torch.randn(12, 48, generator=g).to(device).requires_grad_()
    gy = torch.randn(700, 12, generator=g).to(device)
    grads = []
    for _ in range(2):
        x.grad = w.grad = None
        turbo.ops.router_logits(x, w).backward(gy)
        grads.append((x.grad.clone(), w.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    x0 = torch.randn(0, 48, device=device).bfloat16().requires_grad_()
    w0 = torch.randn(12, 48, device=device).requires_grad_()
    y0 = turbo.ops.router_logits(x0, w0)
    assert y0.shape == (0, 12)
    y0.sum().backward()
    assert x0.grad.shape == (0, 48) and bool((w0.grad == 0).all())


def test_router_logits_wide_router_uses_torch(device):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, 32, generator=g).bfloat16().to(device)
    w = torch.randn(300, 32, generator=g).to(device)  # wider than the kernels' 256 experts
    out = turbo.ops.router_logits(x, w)
    torch.testing.assert_close(out, torch.nn.functional.linear(x.float(), w), rtol=1e-5, atol=1e-5)


def test_router_logits_errors(device):
    x = torch.randn(4, 8, device=device).bfloat16()
    w = torch.randn(3, 8, device=device)
    with pytest.raises(TypeError, match="float32"):
        turbo.ops.router_logits(x, w.bfloat16())
    with pytest.raises(ValueError, match="2-D"):
        turbo.ops.router_logits(x[None], w)
    with pytest.raises(ValueError, match=r"\[E, H=8\]"):
        turbo.ops.router_logits(x, torch.randn(3, 9, device=device))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        turbo.ops.router_logits(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="no experts"):
        turbo.ops.router_logits(x, torch.randn(0, 8, device=device))
