"""turbo.ops.swiglu / swiglu_with_probs / geglu_with_probs: forward and backward against the
float64 references, probs and row_mask (masked rows exactly zero, zero gradients, no NaN leak),
the plain-PyTorch fallback, torch.compile, and input validation."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.ops import activation as A
from primus_turbo.pytorch.ops.activation import geglu_with_probs, swiglu, swiglu_with_probs
from primus_turbo.testing import geglu_with_probs_ref, rel_err, snr_db, swiglu_ref, swiglu_with_probs_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MIN_SNR = {torch.bfloat16: 45.0, torch.float16: 50.0}
IDS = lambda d: str(d).split(".")[-1]  # noqa: E731


def _close(ref, out, dtype, what):
    assert out.dtype == dtype, what
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    if dtype == torch.float32:
        e = rel_err(ref, out)
        assert e < 1e-5, f"{what}: rel err {e:.3g}"
    else:
        s = snr_db(ref, out)
        assert s >= MIN_SNR[dtype], f"{what}: snr {s:.1f} dB"


def _ref(fn, x, dout, probs=None, mask=None):
    x64 = x.detach().double().requires_grad_()
    args = [x64]
    p64 = None
    if probs is not None:
        p64 = probs.detach().double().requires_grad_()
        args += [p64, mask]
    y = fn(*args)
    y.backward(dout.double())
    return y.detach(), x64.grad, (p64.grad if p64 is not None else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("h", [33, 128, 513, 1024])
@pytest.mark.parametrize("outer", [1, 7, 64])
def test_swiglu(device, outer, h, dtype):
    x = torch.randn(outer, 2 * h, device=device, dtype=dtype, requires_grad=True)
    y = swiglu(x)
    assert y.shape == (outer, h)
    dout = torch.randn_like(y)
    y.backward(dout)
    yr, dxr, _ = _ref(swiglu_ref, x, dout)
    _close(yr, y, dtype, "out")
    _close(dxr, x.grad, dtype, "dx")


def test_swiglu_leading_dims(device):
    x = torch.randn(2, 3, 5, 64, device=device, requires_grad=True)
    y = swiglu(x)
    assert y.shape == (2, 3, 5, 32)
    dout = torch.randn_like(y)
    y.backward(dout)
    yr, dxr, _ = _ref(swiglu_ref, x, dout)
    _close(yr, y, torch.float32, "out")
    _close(dxr, x.grad, torch.float32, "dx")


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("h", [33, 128, 513, 1024])
@pytest.mark.parametrize("outer", [1, 7, 64])
def test_glu_with_probs(device, kind, outer, h, dtype):
    fn, ref = (swiglu_with_probs, swiglu_with_probs_ref) if kind == "swiglu" else (geglu_with_probs, geglu_with_probs_ref)
    x = torch.randn(outer, 2 * h, device=device, dtype=dtype, requires_grad=True)
    probs = torch.rand(outer, device=device, requires_grad=True)
    mask = None
    if outer > 1:  # every other row a padding row, poisoned with NaN in x and probs
        mask = torch.arange(outer, device=device) % 2 == 0
        with torch.no_grad():
            x[~mask] = float("nan")
            probs[~mask] = float("nan")
    y = fn(x, probs, mask)
    dout = torch.randn_like(y)
    y.backward(dout)
    xs = torch.where(torch.isnan(x.detach()), 0.0, x.detach()).to(dtype)
    ps = torch.where(torch.isnan(probs.detach()), 0.0, probs.detach())
    yr, dxr, dpr = _ref(ref, xs, dout, ps, mask)
    _close(yr, y, dtype, "out")
    _close(dxr, x.grad, dtype, "dx")
    assert probs.grad.dtype == torch.float32
    if dtype == torch.float32:
        assert rel_err(dpr, probs.grad) < 1e-5
    else:
        assert snr_db(dpr, probs.grad) >= MIN_SNR[dtype]
    if mask is not None:
        off = ~mask
        assert (y[off] == 0).all() and not torch.signbit(y[off].float()).any()
        assert (x.grad[off] == 0).all() and (probs.grad[off] == 0).all()


def test_row_mask_int_dtype(device):
    x = torch.randn(6, 64, device=device, requires_grad=True)
    probs = torch.rand(6, device=device, requires_grad=True)
    m_int = torch.tensor([1, 0, 2, 0, 1, 1], device=device, dtype=torch.int32)
    y = swiglu_with_probs(x, probs, m_int)
    y.sum().backward()
    yr, dxr, dpr = _ref(swiglu_with_probs_ref, x, torch.ones_like(y), probs, m_int)
    _close(yr, y, torch.float32, "out")
    _close(dxr, x.grad, torch.float32, "dx")
    assert rel_err(dpr, probs.grad) < 1e-5
    assert (y[1] == 0).all() and (probs.grad[[1, 3]] == 0).all()


def test_geglu_is_tanh_approximation(device):
    x = torch.randn(4, 64, device=device)
    p = torch.ones(4, device=device)
    a, b = x[:, :32], x[:, 32:]
    exact = torch.nn.functional.gelu(a.double()) * b.double()
    tanh = torch.nn.functional.gelu(a.double(), approximate="tanh") * b.double()
    y = geglu_with_probs(x, p)
    assert rel_err(tanh, y) < 1e-6 < rel_err(exact, y)


@pytest.mark.parametrize("f", [4200, 2880])
def test_wide_rows_split_dprobs(device, f):
    """Several column tiles, dprobs reduced from per-tile partials: F > 4096 (forward and backward),
    and F = 2880 (GPT-OSS), whose backward runs three 1024-column tiles (glu_bwd_config)."""
    x = torch.randn(3, 2 * f, device=device, requires_grad=True)
    probs = torch.rand(3, device=device, requires_grad=True)
    y = swiglu_with_probs(x, probs)
    dout = torch.randn_like(y)
    y.backward(dout)
    yr, dxr, dpr = _ref(swiglu_with_probs_ref, x, dout, probs)
    _close(yr, y, torch.float32, "out")
    _close(dxr, x.grad, torch.float32, "dx")
    assert rel_err(dpr, probs.grad) < 1e-5


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_torch_fallback_matches(device, monkeypatch, kind):
    fn = swiglu_with_probs if kind == "swiglu" else geglu_with_probs
    x = torch.randn(7, 130, device=device, requires_grad=True)
    p = torch.rand(7, device=device, requires_grad=True)
    m = torch.tensor([1, 1, 0, 1, 0, 1, 1], device=device, dtype=torch.bool)
    y = fn(x, p, m)
    dout = torch.randn_like(y)
    y.backward(dout)
    monkeypatch.setattr(A, "act_backend", lambda t: "torch")
    x2, p2 = x.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
    y2 = fn(x2, p2, m)
    y2.backward(dout)
    assert rel_err(y2, y) < 1e-6 and rel_err(x2.grad, x.grad) < 1e-6 and rel_err(p2.grad, p.grad) < 1e-6


def test_torch_compile_fullgraph(device):
    x = torch.randn(7, 128, device=device, requires_grad=True)
    p = torch.rand(7, device=device, requires_grad=True)
    compiled = torch.compile(lambda x, p: swiglu_with_probs(x, p), fullgraph=True, backend="aot_eager")
    y = compiled(x, p)
    dout = torch.randn_like(y)
    y.backward(dout)
    yr, dxr, dpr = _ref(swiglu_with_probs_ref, x, dout, p)
    _close(yr, y, torch.float32, "out")
    _close(dxr, x.grad, torch.float32, "dx")
    assert rel_err(dpr, p.grad) < 1e-5


def test_glu_bwd_config():
    """The backward's tiling: 1024-column tiles where they waste fewer lanes than the power-of-two
    tile (F = 2880), the forward's config otherwise."""
    pytest.importorskip("triton")
    from primus_turbo.triton.activation.swiglu_kernel import glu_bwd_config, glu_config

    assert glu_bwd_config(65536, 2880) == (1, 1024, 4)
    for f in (512, 1024, 2048, 1536, 4096, 8192):
        assert glu_bwd_config(65536, f) == glu_config(65536, f), f


def test_empty(device):
    x = torch.empty(0, 64, device=device, requires_grad=True)
    p = torch.empty(0, device=device, requires_grad=True)
    y = swiglu_with_probs(x, p)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert x.grad.shape == (0, 64) and p.grad.shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32768, 4096), (8192, 2 * 14336)])
def test_swiglu_with_probs_big_gpu(shape):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(shape[0], device="cuda", requires_grad=True)
    m = torch.rand(shape[0], device="cuda") > 0.1
    y = swiglu_with_probs(x, p, m)
    dout = torch.randn_like(y)
    y.backward(dout)
    yr, dxr, dpr = _ref(swiglu_with_probs_ref, x, dout, p, m)
    _close(yr, y, torch.bfloat16, "out")
    _close(dxr, x.grad, torch.bfloat16, "dx")
    assert snr_db(dpr, p.grad) >= 45.0


def test_errors():
    x = torch.randn(4, 64)
    p = torch.rand(4)
    with pytest.raises(ValueError, match=r"even last dim, got shape \(4, 63\)"):
        swiglu(torch.randn(4, 63))
    with pytest.raises(TypeError, match="x.dtype must be float32, bfloat16 or float16"):
        swiglu(x.to(torch.float64))
    with pytest.raises(ValueError, match=r"probs must be \[T\] = \[4\].*\(3,\)"):
        swiglu_with_probs(x, torch.rand(3))
    with pytest.raises(TypeError, match="probs.dtype must be float32, got torch.bfloat16"):
        geglu_with_probs(x, p.bfloat16())
    with pytest.raises(ValueError, match="x must be 2-D"):
        swiglu_with_probs(x[None], p)
    with pytest.raises(TypeError, match="row_mask.dtype must be bool or an integer dtype"):
        swiglu_with_probs(x, p, torch.ones(4))
    with pytest.raises(ValueError, match=r"row_mask must be \[T\] = \[4\]"):
        swiglu_with_probs(x, p, torch.ones(5, dtype=torch.bool))
