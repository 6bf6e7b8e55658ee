"""turbo.ops.gemm_fp4 (MXFP4, emulated on Hopper) against float64 on the *unquantized* inputs:
layouts NN, NT, TN, TT, forward and both gradients, Megatron's fused wgrad accumulation over
micro-batches, backend pin, torch.compile, empty problems and bad input.

SNR bar (issue 3): MXFP4 >= 10 dB for the output and both gradients (measured ~15-16 dB; ~14 dB
for the gradients with stochastic rounding of dC). The training options (``use_gradient_sr``,
``use_rht``) are checked for accuracy, exactness of the transformed grad_weight, the effect of
the transform on outliers, and reproducibility. On CPU the GEMMs run in the Triton interpreter.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import primus_turbo.pytorch as turbo  # noqa: F401  (the package must import cleanly)
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.core.low_precision import Float4QuantConfig
from primus_turbo.testing import snr_db
from primus_turbo.testing.quant_ref import dequantize_fp4_ref, quantize_fp4_ref

pytest.importorskip("triton")

from primus_turbo.pytorch.backends import gemm_fp4 as be  # noqa: E402
op_mod = importlib.import_module("primus_turbo.pytorch.ops.gemm_fp4")
from primus_turbo.pytorch.ops.gemm_fp4 import gemm_fp4  # noqa: E402

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
MIN_SNR = 10.0


def _make(m, n, k, layout, dtype=torch.bfloat16, device="cpu", requires_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    ta, tb = layout[0] == "T", layout[1] == "T"
    a = torch.randn((k, m) if ta else (m, k), generator=g).to(dtype).to(device)
    b = (torch.randn((n, k) if tb else (k, n), generator=g) / k ** 0.5).to(dtype).to(device)
    return a.requires_grad_(requires_grad), b.requires_grad_(requires_grad), ta, tb


def _reference(a, b, ta, tb, grad):
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    out = (a64.t() if ta else a64) @ (b64.t() if tb else b64)
    out.backward(grad.double())
    return out.detach(), a64.grad, b64.grad


@pytest.mark.parametrize("layout", ["NT", "NN", "TN", "TT"])
@pytest.mark.parametrize("shape", [(64, 96, 128), (32, 64, 256)], ids=str)
def test_forward_backward_snr(shape, layout, device):
    m, n, k = shape
    a, b, ta, tb = _make(m, n, k, layout, device=device)
    out = gemm_fp4(a, b, trans_a=ta, trans_b=tb)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, ga, gb = _reference(a, b, ta, tb, grad)
    assert a.grad.dtype == a.dtype and b.grad.dtype == b.dtype
    for name, r, x in (("out", ref, out), ("dA", ga, a.grad), ("dB", gb, b.grad)):
        assert snr_db(r.cpu(), x.double().cpu()) >= MIN_SNR, (name, shape, layout)


def test_forward_equals_dequantized_product(device):
    # The op quantizes each operand 1x32 along K and runs the exact emulated GEMM: its fp32 output
    # is the fp64 product of the reference-dequantized operands up to fp32 accumulation.
    a, b, _, _ = _make(64, 32, 96, "NT", dtype=torch.float32, device=device, requires_grad=False)
    out = gemm_fp4(a, b, trans_b=True, out_dtype=torch.float32)
    deq = [dequantize_fp4_ref(*quantize_fp4_ref(t.cpu())).double() for t in (a, b)]
    assert snr_db(deq[0] @ deq[1].T, out.double().cpu()) >= 80.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_input_and_out_dtypes(dtype, device):
    a, b, ta, tb = _make(32, 64, 64, "NT", dtype=dtype, device=device)
    out = gemm_fp4(a, b, trans_b=True, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert a.grad.dtype == dtype and b.grad.dtype == dtype
    ref, _, _ = _reference(a, b, ta, tb, torch.ones_like(out))
    assert snr_db(ref.cpu(), out.double().cpu()) >= MIN_SNR


def test_no_grad_and_partial_grads(device):
    a, b, _, _ = _make(32, 48, 64, "NN", device=device, requires_grad=False, seed=1)
    with torch.no_grad():
        out = gemm_fp4(a, b)
    assert out.shape == (32, 48) and not out.requires_grad
    assert snr_db(a.double() @ b.double(), out) >= MIN_SNR
    # no gradient wanted: only K must be a multiple of 32 (M = 40, N = 40 are fine)
    a2, b2, _, _ = _make(40, 40, 64, "NN", device=device, requires_grad=False, seed=2)
    out = gemm_fp4(a2, b2)
    assert out.shape == (40, 40) and snr_db(a2.double() @ b2.double(), out) >= MIN_SNR
    # only b needs a gradient: N need not be a multiple of 32
    a3, b3, ta, tb = _make(32, 40, 64, "NN", device=device, requires_grad=False, seed=3)
    b3.requires_grad_()
    out = gemm_fp4(a3, b3)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert a3.grad is None and b3.grad.shape == b3.shape
    assert snr_db(_reference(a3, b3, ta, tb, grad)[2].cpu(), b3.grad.double().cpu()) >= MIN_SNR


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("layout", ["NT", "TN"])
def test_single_operand_grad(layout, which, device):
    """Only a (frozen weight) or only b (first layer) requires grad: that gradient against the fp64
    reference at the MXFP4 bar and bit-identical to the one computed when both require grad."""
    m, n, k = 64, 96, 128
    a, b, ta, tb = _make(m, n, k, layout, device=device, requires_grad=False, seed=7)
    grad = torch.randn(m, n, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(device)
    x, w = a.clone().requires_grad_(which == "a"), b.clone().requires_grad_(which == "b")
    gemm_fp4(x, w, trans_a=ta, trans_b=tb).backward(grad)
    x2, w2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    gemm_fp4(x2, w2, trans_a=ta, trans_b=tb).backward(grad)
    _, ga, gb = _reference(a, b, ta, tb, grad)
    if which == "a":
        assert w.grad is None and x.grad.shape == a.shape and x.grad.dtype == a.dtype
        assert snr_db(ga.cpu(), x.grad.double().cpu()) >= MIN_SNR
        assert torch.equal(x.grad, x2.grad)
    else:
        assert x.grad is None and w.grad.shape == b.shape and w.grad.dtype == b.dtype
        assert snr_db(gb.cpu(), w.grad.double().cpu()) >= MIN_SNR
        assert torch.equal(w.grad, w2.grad)


@pytest.mark.parametrize("layout, main_grad_dtype", [("NT", torch.float32), ("NN", torch.bfloat16)])
def test_megatron_fused_wgrad_accumulation(layout, main_grad_dtype, device):
    m, n, k = 64, 32, 96
    _, b, ta, tb = _make(m, n, k, layout, device=device)
    start = torch.randn(b.shape).to(main_grad_dtype).to(device)  # never start from zeros
    b.main_grad = start.clone()
    b.grad_added_to_main_grad = False
    expected = start.double().cpu()
    for i in range(3):  # three micro-batches; the second with a gradient for b only
        a, _, _, _ = _make(m, n, k, layout, device=device, requires_grad=i != 1, seed=10 + i)
        out = gemm_fp4(a, b, trans_a=ta, trans_b=tb, fuse_bgrad_accum_pattern="megatron")
        grad = torch.randn_like(out)
        out.backward(grad)
        _, ga, gb = _reference(a, b, ta, tb, grad)
        expected += gb.cpu()
        assert b.grad_added_to_main_grad is True
        if i == 1:
            assert a.grad is None
        else:  # grad_input unaffected by the fusion
            assert snr_db(ga.cpu(), a.grad.double().cpu()) >= MIN_SNR
    assert b.main_grad.dtype == main_grad_dtype and b.main_grad.shape == b.shape
    delta = b.main_grad.double().cpu() - start.double().cpu()
    assert snr_db(expected - start.double().cpu(), delta) >= MIN_SNR
    # the placeholder .grad is not the wgrad (Megatron's hook skips it)
    assert b.grad is not None and b.grad.shape == b.shape


def test_backend_pin(device):
    GlobalBackendManager.set_gemm_backend(BackendType.TRITON, precision="FP4")
    a, b, _, _ = _make(32, 32, 64, "NT", device=device, requires_grad=False)
    assert gemm_fp4(a, b, trans_b=True).shape == (32, 32)
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision="FP4")
    with pytest.raises(ValueError, match="not available"):
        gemm_fp4(a, b, trans_b=True)


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    a, b, _, _ = _make(32, 64, 64, "NT", device=device)

    def f(x, w):
        return gemm_fp4(x, w, trans_b=True).float().relu().sum()

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(a, b)
    loss.backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    eager = f(a, b)
    eager.backward()
    assert torch.allclose(loss, eager)
    assert torch.equal(ga, a.grad) and torch.equal(gb, b.grad)


def test_empty_problems_launch_nothing(device, monkeypatch):
    def _no_launch(*args, **kwargs):
        raise AssertionError("a kernel was dispatched for an empty problem")

    monkeypatch.setattr(be.gemm_fp4_dispatcher, "dispatch", _no_launch)
    a = torch.randn(5, 0, device=device, requires_grad=True)
    b = torch.randn(0, 7, device=device, requires_grad=True)
    out = gemm_fp4(a, b)
    assert out.shape == (5, 7) and torch.equal(out, torch.zeros(5, 7, device=device))
    out.sum().backward()
    assert a.grad.shape == (5, 0) and b.grad.shape == (0, 7)


@pytest.mark.parametrize(
    "make, kwargs, match, exc",
    [
        (lambda d: (torch.randn(32, 48, device=d), torch.randn(48, 32, device=d)), {},
         r"needs K to be a multiple of 32, got K=48", ValueError),
        (lambda d: (torch.randn(32, 64, device=d, requires_grad=True), torch.randn(64, 40, device=d)), {},
         r"needs N to be a multiple of 32, got N=40", ValueError),
        (lambda d: (torch.randn(40, 64, device=d), torch.randn(64, 32, device=d, requires_grad=True)), {},
         r"needs M to be a multiple of 32, got M=40", ValueError),
        (lambda d: (torch.randn(32, 64, device=d), torch.randn(32, 64, device=d)), {},
         r"K mismatch", ValueError),
        (lambda d: (torch.randn(32, 64, device=d), torch.randn(64, 32, device=d, dtype=torch.float16)), {},
         r"same dtype", TypeError),
        (lambda d: (torch.randn(32, 64, device=d).int(), torch.randn(64, 32, device=d).int()), {},
         r"a.dtype must be", TypeError),
        (lambda d: (torch.randn(2, 32, 64, device=d), torch.randn(64, 32, device=d)), {}, r"2-D", ValueError),
        (lambda d: (torch.randn(32, 64, device=d), torch.randn(64, 32, device=d)), dict(out_dtype=torch.int8),
         r"out_dtype", TypeError),
        (lambda d: (torch.randn(32, 64, device=d), torch.randn(64, 32, device=d)), dict(config=object()),
         r"Float4QuantConfig", TypeError),
        # the Hadamard block (32) must divide the grad_weight reduction dim M: the MXFP4 rule already says so
        (lambda d: (torch.randn(40, 64, device=d), torch.randn(64, 32, device=d, requires_grad=True)),
         dict(config=Float4QuantConfig(use_rht=True)), r"needs M to be a multiple of 32, got M=40", ValueError),
        (lambda d: (torch.randn(32, 64, device=d), torch.randn(64, 32, device=d)),
         dict(fuse_bgrad_accum_pattern="te"), r"fuse_bgrad_accum_pattern", ValueError),
        (lambda d: (torch.randn(32, 64, device=d), torch.randn(64, 32, device=d, requires_grad=True)),
         dict(fuse_bgrad_accum_pattern="megatron"), r"needs b.main_grad", ValueError),
    ],
)
def test_bad_input(make, kwargs, match, exc, device):
    a, b = make(device)
    with pytest.raises(exc, match=match):
        gemm_fp4(a, b, **kwargs)


def test_bad_main_grad_and_quantized_tensor(device):
    a = torch.randn(32, 64, device=device)
    b = torch.randn(64, 32, device=device, requires_grad=True)
    b.main_grad = torch.zeros(5, 4, device=device)
    with pytest.raises(ValueError, match=r"b.main_grad must match b"):
        gemm_fp4(a, b, fuse_bgrad_accum_pattern="megatron")
    b.main_grad = torch.zeros(64, 32, device=device, dtype=torch.float16)
    with pytest.raises(TypeError, match="main_grad must be float32 or bfloat16"):
        gemm_fp4(a, b, fuse_bgrad_accum_pattern="megatron")
    with pytest.raises(TypeError, match="FP8-only"):
        gemm_fp4(object(), b)


# ---- training options: stochastic rounding of gradients, random Hadamard transform ------------
SR_CFG = Float4QuantConfig(use_gradient_sr=True)
RHT_CFG = Float4QuantConfig(use_rht=True)
BOTH_CFG = Float4QuantConfig(use_gradient_sr=True, use_rht=True)


@pytest.mark.parametrize("cfg, layout", [(RHT_CFG, "NT"), (RHT_CFG, "TN"), (SR_CFG, "NN"), (BOTH_CFG, "TT")],
                         ids=["rht-NT", "rht-TN", "sr-NN", "sr+rht-TT"])
def test_options_snr(cfg, layout, device):
    m, n, k = 64, 96, 128
    a, b, ta, tb = _make(m, n, k, layout, device=device)
    out = gemm_fp4(a, b, trans_a=ta, trans_b=tb, config=cfg)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, ga, gb = _reference(a, b, ta, tb, grad)
    for name, r, x in (("out", ref, out), ("dA", ga, a.grad), ("dB", gb, b.grad)):
        assert snr_db(r.cpu(), x.double().cpu()) >= MIN_SNR, (name, layout, cfg)


def _rht_deq(x, signs):
    """The reference grad_weight operand: x [rows, M] transformed along M, MXFP4, dequantized (fp64)."""
    from primus_turbo.pytorch.ops.quantization import hadamard_transform

    return dequantize_fp4_ref(*quantize_fp4_ref(hadamard_transform(x.detach().cpu().float(), signs.cpu()))).double()


@pytest.mark.parametrize("layout", ["NT", "TN"])
def test_rht_wgrad_is_the_transformed_product(layout, device):
    # with use_rht, dB is the fp32-accumulated product of the MXFP4 copies of op(A).T and dC.T, both
    # transformed along M with the same 32 signs (drawn first in forward: torch.manual_seed
    # reproduces them); the forward output and dA are those of the default config, bit for bit
    from primus_turbo.pytorch.ops.quantization import random_hadamard_signs

    m, n, k = 64, 32, 96
    a, b, ta, tb = _make(m, n, k, layout, dtype=torch.float32, device=device)
    grad = torch.randn(m, n, generator=torch.Generator().manual_seed(3)).to(device)
    torch.manual_seed(1234)
    signs = random_hadamard_signs(32, device=device)
    torch.manual_seed(1234)
    out = gemm_fp4(a, b, trans_a=ta, trans_b=tb, config=RHT_CFG)
    out.backward(grad)
    x = a.t() if not ta else a  # op(A).T [K, M]
    want = _rht_deq(x, signs) @ _rht_deq(grad.t(), signs).T  # [K, N]
    if tb:
        want = want.T
    assert snr_db(want, b.grad.double().cpu()) >= 80.0
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out2 = gemm_fp4(a2, b2, trans_a=ta, trans_b=tb)
    out2.backward(grad)
    assert torch.equal(out, out2) and torch.equal(a.grad, a2.grad)
    # the transform preserves the product: dB is as accurate as without it
    gb_ref = _reference(a, b, ta, tb, grad)[2].cpu()
    assert snr_db(gb_ref, b.grad.double().cpu()) >= MIN_SNR


def test_rht_reduces_wgrad_error_on_outliers(device):
    # activations with outlier tokens (about one 40-sigma element per 32-block along M): without the
    # transform their block scales flush the other tokens of the block; with it dB is more accurate
    g = torch.Generator().manual_seed(0)
    m, n, k = 128, 64, 64
    a = torch.randn(m, k, generator=g) + (torch.rand(m, k, generator=g) < 1 / 32) * 40
    b = torch.randn(k, n, generator=g) / 8
    dy = torch.randn(m, n, generator=g)
    gb_ref = a.double().T @ dy.double()
    snr = {}
    for cfg in (Float4QuantConfig(), RHT_CFG):
        aa, bb = a.clone().to(device).requires_grad_(), b.clone().to(device).requires_grad_()
        torch.manual_seed(0)
        gemm_fp4(aa, bb, config=cfg).backward(dy.to(device))
        snr[cfg.use_rht] = snr_db(gb_ref, bb.grad.double().cpu())
    assert snr[True] >= snr[False] + 1.5, snr


def test_gradient_sr_reproducible_and_random(device):
    # SR draws its seeds on the device: torch.manual_seed reproduces the gradients, another seed
    # changes them; the forward output is the RNE one
    a, b, ta, tb = _make(32, 64, 64, "NT", device=device)
    grad = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)).bfloat16().to(device)
    res = []
    for seed in (0, 0, 1):
        aa, bb = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        torch.manual_seed(seed)
        out = gemm_fp4(aa, bb, trans_b=tb, config=SR_CFG)
        out.backward(grad)
        res.append((out, aa.grad, bb.grad))
    assert all(torch.equal(x, y) for x, y in zip(res[0], res[1]))
    assert torch.equal(res[0][0], res[2][0])  # forward unchanged
    assert not torch.equal(res[0][1], res[2][1]) and not torch.equal(res[0][2], res[2][2])
    assert torch.equal(res[0][0], gemm_fp4(a.detach(), b.detach(), trans_b=tb))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NT", "NN"])
def test_gpu_large(layout):
    m, n, k = 1024, 2048, 1536
    a, b, ta, tb = _make(m, n, k, layout, device="cuda")
    out = gemm_fp4(a, b, trans_a=ta, trans_b=tb)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, ga, gb = _reference(a, b, ta, tb, grad)
    for r, x in ((ref, out), (ga, a.grad), (gb, b.grad)):
        assert snr_db(r.cpu(), x.double().cpu()) >= MIN_SNR
