"""turbo.ops.rmsnorm / rmsnorm_residual: forward and backward against the float64 reference,
zero-centered gamma, the fused residual add, the long-row (chunked) kernel path, the plain-PyTorch
fallback, torch.compile, and input validation."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.ops import normalization as N
from primus_turbo.pytorch.ops.normalization import rmsnorm, rmsnorm_residual
from primus_turbo.testing import rel_err, rmsnorm_ref, snr_db

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MIN_SNR = {torch.bfloat16: 45.0, torch.float16: 50.0}


def _close(ref: torch.Tensor, out: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.dtype == dtype, what
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    if dtype == torch.float32:
        e = rel_err(ref, out)
        assert e < 1e-5, f"{what}: rel err {e:.3g}"
    else:
        s = snr_db(ref, out)
        assert s >= MIN_SNR[dtype], f"{what}: snr {s:.1f} dB"


def _ref_grads(s: torch.Tensor, gamma: torch.Tensor, dy: torch.Tensor, eps: float, zc: bool):
    s64 = s.detach().double().requires_grad_()
    g64 = gamma.detach().double().requires_grad_()
    y = rmsnorm_ref(s64, g64, eps, zc)
    y.backward(dy.double())
    return y.detach(), s64.grad, g64.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("h", [33, 128, 513, 1024])
@pytest.mark.parametrize("outer", [1, 7, 64])
def test_rmsnorm_fwd_bwd(device, outer, h, dtype):
    zc = h == 513  # zero-centered on one width of each sweep (also run fully below)
    x = torch.randn(outer, h, device=device, dtype=dtype, requires_grad=True)
    gamma = (torch.randn(h, device=device) * (0.1 if zc else 1.0)).to(dtype).requires_grad_()
    y = rmsnorm(x, gamma, 1e-6, zc)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr, dxr, dgr = _ref_grads(x, gamma, dy, 1e-6, zc)
    _close(yr, y, dtype, "y")
    _close(dxr, x.grad, dtype, "dx")
    _close(dgr, gamma.grad, dtype, "dgamma")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_rmsnorm_zero_centered_3d_fp32_gamma(device, dtype):
    x = torch.randn(2, 5, 96, device=device, dtype=dtype, requires_grad=True)
    gamma = (0.1 * torch.randn(96, device=device)).requires_grad_()  # fp32 gamma with low-precision x
    y = rmsnorm(x, gamma, eps=1e-5, zero_centered=True)
    assert y.shape == x.shape
    dy = torch.randn_like(y)
    y.backward(dy)
    yr, dxr, dgr = _ref_grads(x, gamma, dy, 1e-5, True)
    _close(yr, y, dtype, "y")
    _close(dxr, x.grad, dtype, "dx")
    assert gamma.grad.dtype == torch.float32
    if dtype == torch.float32:
        _close(dgr, gamma.grad, torch.float32, "dgamma")
    else:  # fp32 dgamma built from low-precision x / dy
        assert snr_db(dgr, gamma.grad) >= MIN_SNR[dtype]


def _stored_sum(x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x + r`` in fp32 converted once to ``dtype``, as the kernel's store does: round to nearest
    even on the GPU; the Triton interpreter's fp32 -> bf16 conversion truncates (drops the low 16
    bits), so on CPU a bf16 sum is the truncated one."""
    f = x.float() + r.float()
    if dtype == torch.bfloat16 and f.device.type == "cpu":
        return (f.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return f.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", [(1, 33), (7, 513), (64, 128)])
def test_rmsnorm_residual(device, shape, dtype):
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    gamma = torch.randn(shape[-1], device=device, dtype=dtype, requires_grad=True)
    y, s = rmsnorm_residual(x, r, gamma)
    # the sum is x + residual rounded once to the storage dtype (the fp32 sum, then one conversion)
    assert torch.equal(s, _stored_sum(x.detach(), r.detach(), dtype))
    _close((x.detach().double() + r.detach().double()), s, dtype, "s")
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward([y, s], [dy, ds])
    yr, dsr, dgr = _ref_grads(s, gamma, dy, 1e-6, False)  # the norm of the (rounded) sum
    _close(yr, y, dtype, "y")
    _close(dsr + ds.double(), x.grad, dtype, "dx")
    _close(dsr + ds.double(), r.grad, dtype, "dresidual")
    _close(dgr, gamma.grad, dtype, "dgamma")


def test_rmsnorm_residual_only_y_used(device):
    x = torch.randn(7, 128, device=device, requires_grad=True)
    r = torch.randn(7, 128, device=device, requires_grad=True)
    g = torch.randn(128, device=device, requires_grad=True)
    y, s = rmsnorm_residual(x, r, g)
    dy = torch.randn_like(y)
    y.backward(dy)  # no gradient flows into s
    _, dsr, _ = _ref_grads(s, g, dy, 1e-6, False)
    assert rel_err(dsr, x.grad) < 1e-5 and rel_err(dsr, r.grad) < 1e-5


@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_long_row_chunked_path(device, monkeypatch, residual):
    """Rows wider than MAX_ROW_BLOCK run the two-pass chunked kernels (shrunk here to stay cheap)."""
    from primus_turbo.triton.normalization import rmsnorm_kernel as K

    if N.norm_backend(torch.empty(0, device=device)) != "triton":
        pytest.skip("triton backend not active")
    monkeypatch.setattr(K, "MAX_ROW_BLOCK", 64)
    monkeypatch.setattr(K, "_CHUNK", 32)
    assert K.rmsnorm_config(5, 200)[2] == 7
    x = torch.randn(5, 200, device=device, requires_grad=True)
    g = torch.randn(200, device=device, requires_grad=True)
    if residual:
        r = torch.randn(5, 200, device=device)
        y, s = rmsnorm_residual(x, r, g, zero_centered=True)
    else:
        y, s = rmsnorm(x, g, zero_centered=True), x
    dy = torch.randn_like(y)
    y.backward(dy)
    yr, dxr, dgr = _ref_grads(s, g, dy, 1e-6, True)
    _close(yr, y, torch.float32, "y")
    _close(dxr, x.grad, torch.float32, "dx")
    _close(dgr, g.grad, torch.float32, "dgamma")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 4096), (4096, 7168), (8, 32768)])
def test_rmsnorm_big_gpu(shape):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = rmsnorm(x, g)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr, dxr, dgr = _ref_grads(x, g, dy, 1e-6, False)
    _close(yr, y, torch.bfloat16, "y")
    _close(dxr, x.grad, torch.bfloat16, "dx")
    _close(dgr, g.grad, torch.bfloat16, "dgamma")


def test_rmsnorm_deterministic(device):
    x = torch.randn(64, 513, device=device, dtype=torch.bfloat16)
    g = torch.randn(513, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    grads = []
    for _ in range(2):
        xx, gg = x.clone().requires_grad_(), g.clone().requires_grad_()
        rmsnorm(xx, gg).backward(dy)
        grads.append((xx.grad, gg.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_rmsnorm_torch_fallback_matches(device, monkeypatch):
    x = torch.randn(7, 513, device=device, requires_grad=True)
    r = torch.randn(7, 513, device=device)
    g = torch.randn(513, device=device, requires_grad=True)
    y, s = rmsnorm_residual(x, r, g, zero_centered=True)
    dy = torch.randn_like(y)
    y.backward(dy)
    monkeypatch.setattr(N, "norm_backend", lambda t: "torch")
    x2, g2 = x.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
    y2, s2 = rmsnorm_residual(x2, r, g2, zero_centered=True)
    y2.backward(dy)
    assert torch.equal(s, s2)
    assert rel_err(y2, y) < 1e-6 and rel_err(x2.grad, x.grad) < 1e-6 and rel_err(g2.grad, g.grad) < 1e-6


def test_rmsnorm_no_nan_leak_and_empty(device):
    x = torch.randn(3, 33, device=device, dtype=torch.bfloat16)
    y = rmsnorm(x, torch.ones(33, device=device, dtype=torch.bfloat16))
    assert torch.isfinite(y).all()
    e = torch.empty(0, 64, device=device, requires_grad=True)
    ye = rmsnorm(e, torch.ones(64, device=device))
    assert ye.shape == (0, 64)
    ye.sum().backward()
    assert e.grad.shape == (0, 64)


def test_rmsnorm_torch_compile_fullgraph(device):
    x = torch.randn(7, 128, device=device, requires_grad=True)
    g = torch.randn(128, device=device, requires_grad=True)

    def f(x, g):
        return rmsnorm(x, g, 1e-6, True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    y = compiled(x, g)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr, dxr, dgr = _ref_grads(x, g, dy, 1e-6, True)
    _close(yr, y, torch.float32, "y")
    _close(dxr, x.grad, torch.float32, "dx")
    _close(dgr, g.grad, torch.float32, "dgamma")


def test_rmsnorm_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"gamma must be \[H\] = \[64\].*\(32,\)"):
        rmsnorm(x, torch.ones(32))
    with pytest.raises(TypeError, match="gamma.dtype must be x.dtype"):
        rmsnorm(x.bfloat16(), torch.ones(64, dtype=torch.float16))
    with pytest.raises(TypeError, match="x.dtype must be float32, bfloat16 or float16, got torch.int32"):
        rmsnorm(x.int(), torch.ones(64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rmsnorm([1.0], torch.ones(1))
    with pytest.raises(ValueError, match="eps must be a non-negative float"):
        rmsnorm(x, torch.ones(64), eps=-1.0)
    with pytest.raises(ValueError, match=r"residual must have x's shape \(4, 64\)"):
        rmsnorm_residual(x, torch.randn(4, 32), torch.ones(64))
    with pytest.raises(TypeError, match="residual.dtype must equal x.dtype"):
        rmsnorm_residual(x, torch.randn(4, 64).half(), torch.ones(64))
