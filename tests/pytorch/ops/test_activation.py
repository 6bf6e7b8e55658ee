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
    with pytest.raises(ValueError, match=r"probs must be x.shape\[:-1\] = \[1, 4\] or its flattened \[T\] = \[4\], "
                                         r"got shape \(4, 1\)"):
        swiglu_with_probs(x[None], p[:, None])
    with pytest.raises(TypeError, match="row_mask.dtype must be bool or an integer dtype"):
        swiglu_with_probs(x, p, torch.ones(4))
    with pytest.raises(ValueError, match=r"row_mask must be \[T\] = \[4\]"):
        swiglu_with_probs(x, p, torch.ones(5, dtype=torch.bool))


def _poison_rows(t: torch.Tensor, keep: torch.Tensor) -> None:
    with torch.no_grad():
        t[~keep] = float("nan")


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS)
@pytest.mark.parametrize("flat", [False, True], ids=["lead_shape", "flat_probs_mask"])
def test_glu_with_probs_nd(device, kind, dtype, flat):
    """x [..., 2F] with probs / row_mask [...] (or flattened [T], Primus-Turbo's 1-D mask): the same
    values and gradients as the 2-D call on the flattened inputs, output [..., F], gradients in the
    inputs' shapes, and the fp64 reference."""
    fn, ref = (swiglu_with_probs, swiglu_with_probs_ref) if kind == "swiglu" else (geglu_with_probs, geglu_with_probs_ref)
    lead, f = (2, 3, 5), 48
    g = torch.Generator().manual_seed(21)
    x0 = torch.randn(*lead, 2 * f, generator=g).to(device, dtype)
    p0 = torch.rand(*lead, generator=g).to(device) + 0.1
    m0 = torch.randint(1, 4, lead, generator=g, dtype=torch.int64).to(device)
    m0.view(-1)[::4] = 0                                   # padding rows (int64 0)
    keep = m0 != 0
    _poison_rows(x0, keep)
    _poison_rows(p0, keep)
    dout = torch.randn(*lead, f, generator=g).to(device, dtype)

    x, p = x0.clone().requires_grad_(True), (p0.reshape(-1) if flat else p0).clone().requires_grad_(True)
    y = fn(x, p, m0.reshape(-1) if flat else m0)
    assert y.shape == (*lead, f) and y.dtype == dtype
    y.backward(dout)
    assert x.grad.shape == x.shape and p.grad.shape == p.shape and p.grad.dtype == torch.float32

    x2, p2 = x0.reshape(-1, 2 * f).clone().requires_grad_(True), p0.reshape(-1).clone().requires_grad_(True)
    y2 = fn(x2, p2, m0.reshape(-1))
    y2.backward(dout.reshape(-1, f))
    assert torch.equal(y.reshape(-1, f), y2)
    assert torch.equal(x.grad.reshape(-1, 2 * f), x2.grad) and torch.equal(p.grad.reshape(-1), p2.grad)

    xs = torch.where(keep[..., None], x0, 0.0).reshape(-1, 2 * f)
    ps = torch.where(keep, p0, 0.0).reshape(-1)
    yr, dxr, dpr = _ref(ref, xs, dout.reshape(-1, f), ps, keep.reshape(-1))
    _close(yr, y.reshape(-1, f), dtype, "out")
    _close(dxr, x.grad.reshape(-1, 2 * f), dtype, "dx")
    if dtype == torch.float32:
        assert rel_err(dpr, p.grad.reshape(-1)) < 1e-5
    else:
        assert snr_db(dpr, p.grad.reshape(-1)) >= MIN_SNR[dtype]
    assert (y[~keep] == 0).all() and (x.grad[~keep] == 0).all() and (p.grad.reshape(lead)[~keep] == 0).all()


def test_glu_with_probs_nd_no_copy(device, monkeypatch):
    """Contiguous N-D inputs reach the kernels as views (no copy); a non-contiguous x still works."""
    seen = {}
    real = A._fwd

    def spy(x2, act, p, m):
        seen.update(x=x2.data_ptr(), p=p.data_ptr(), m=m.data_ptr())
        return real(x2, act, p, m)

    monkeypatch.setattr(A, "_fwd", spy)
    x = torch.randn(3, 4, 64, device=device)
    p = torch.rand(3, 4, device=device)
    m = torch.ones(3, 4, dtype=torch.int64, device=device)
    swiglu_with_probs(x, p, m)
    assert seen == dict(x=x.data_ptr(), p=p.data_ptr(), m=m.data_ptr())
    xt = torch.randn(4, 3, 64, device=device).transpose(0, 1)   # [3, 4, 64], not contiguous
    y = swiglu_with_probs(xt, p, m)
    assert seen["x"] != xt.data_ptr()
    assert torch.equal(y, swiglu_with_probs(xt.contiguous(), p, m))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mdtype", [torch.bool, torch.int32, torch.int64], ids=IDS)
def test_row_mask_dtypes(device, monkeypatch, backend, mdtype):
    """row_mask as bool, int32 or int64 (Primus-Turbo's dtype): 0 masks the row, any other value
    keeps it (int64 2**32 included: its low 32 bits are 0), on both backends."""
    if backend == "torch":
        monkeypatch.setattr(A, "act_backend", lambda t: "torch")
    elif A.act_backend(torch.empty(0, device=device)) != "triton":
        pytest.skip("no Triton backend here")
    g = torch.Generator().manual_seed(31)
    x0 = torch.randn(8, 64, generator=g).to(device)
    p0 = torch.rand(8, generator=g).to(device)
    vals = [1, 0, 2, 0, 2 ** 32 if mdtype == torch.int64 else 7, 1, 0, -1 if mdtype != torch.bool else 1]
    m = torch.tensor(vals, dtype=torch.int64).to(mdtype).to(device)
    keep = torch.tensor([v != 0 for v in vals], device=device)
    for fn, ref in ((swiglu_with_probs, swiglu_with_probs_ref), (geglu_with_probs, geglu_with_probs_ref)):
        x, p = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
        y = fn(x, p, m)
        dout = torch.randn(y.shape, generator=g).to(device)
        y.backward(dout)
        yr, dxr, dpr = _ref(ref, x0, dout, p0, keep)
        _close(yr, y, torch.float32, "out")
        _close(dxr, x.grad, torch.float32, "dx")
        assert rel_err(dpr, p.grad) < 1e-5
        assert (y[~keep] == 0).all() and (x.grad[~keep] == 0).all() and (p.grad[~keep] == 0).all()
        assert (y[keep] != 0).all()


def test_nd_shape_errors():
    x = torch.randn(2, 3, 64)
    p = torch.rand(2, 3)
    with pytest.raises(ValueError, match=r"swiglu_with_probs: probs must be x.shape\[:-1\] = \[2, 3\] or its "
                                         r"flattened \[T\] = \[6\], got shape \(3, 2\) \(x is \(2, 3, 64\)\)"):
        swiglu_with_probs(x, torch.rand(3, 2))
    with pytest.raises(ValueError, match=r"geglu_with_probs: probs must be .*got shape \(2, 3, 1\)"):
        geglu_with_probs(x, torch.rand(2, 3, 1))
    with pytest.raises(ValueError, match=r"probs must be .*\[T\] = \[6\], got shape \(5,\)"):
        swiglu_with_probs(x, torch.rand(5))
    with pytest.raises(ValueError, match=r"row_mask must be x.shape\[:-1\] = \[2, 3\] or its flattened \[T\] = "
                                         r"\[6\], got shape \(3, 2\)"):
        swiglu_with_probs(x, p, torch.ones(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"row_mask must be .*got shape \(6, 1\)"):
        geglu_with_probs(x, p, torch.ones(6, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="row_mask.dtype must be bool or an integer dtype, got torch.float32"):
        swiglu_with_probs(x, p, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"even last dim, got shape \(2, 3, 63\)"):
        swiglu_with_probs(torch.randn(2, 3, 63), p)


@pytest.mark.parametrize("shape", [(4, 0), (2, 3, 0), (0, 0), (0,)])
def test_empty_last_dim(device, shape):
    # F = 0 is well defined: [..., 0] out, zero gradients (it used to fail in a reshape)
    x = torch.randn(shape, device=device, requires_grad=True)
    y = swiglu(x)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape
    p = torch.rand(shape[:-1], device=device, requires_grad=True)
    for fn in (swiglu_with_probs, geglu_with_probs):
        x.grad = p.grad = None
        y = fn(x, p)
        assert y.shape == shape
        y.sum().backward()
        assert x.grad.shape == shape and bool((p.grad == 0).all())
