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
    with pytest.raises(TypeError, match="a must be a torch.Tensor .* or an MXFP4 QuantizedTensor, got object"):
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


# ---- pre-quantized (MXFP4 QuantizedTensor) operands --------------------------------------------
from primus_turbo.pytorch.core.low_precision import ScalingGranularity, ScalingRecipe  # noqa: E402
from primus_turbo.pytorch.core.quantized_tensor import QuantizedTensor, QuantizedTensorPair  # noqa: E402
from primus_turbo.pytorch.ops.gemm_fp4 import mxfp4_weight_pair  # noqa: E402

MX = ScalingGranularity.MX_BLOCKWISE
FP4 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)


def _qt(x, axis):
    """x's MXFP4 QuantizedTensor grouped along ``axis`` (-1 or 0), a new leaf requiring grad as x does."""
    return QuantizedTensor.quantize(x.detach().requires_grad_(x.requires_grad), FP4, MX, axis=axis)


def _run(a, b, ta, tb, dy, **kw):
    out = gemm_fp4(a, b, trans_a=ta, trans_b=tb, **kw)
    out.backward(dy)
    return out


def _fresh(layout, seed, device, a_grad=True, b_grad=True):
    # seeded per case, so a wrong copy (other axis, other operand) cannot match by chance; leaves on
    # ``device`` (a CUDA copy of a CPU leaf would be a non-leaf whose .grad stays None)
    a, b, ta, tb = _make(64, 96, 128, layout, device=device, seed=seed)
    return a.detach().requires_grad_(a_grad), b.detach().requires_grad_(b_grad), ta, tb


@pytest.mark.parametrize("layout", ["NT", "NN", "TN", "TT"])
def test_quantized_weight_pair_matches_on_the_fly(layout, device):
    # a weight quantized once (both copies, one read) gives out, dA and dB bit-identical to the op
    # quantizing the high-precision weight; dB lands on the pair's data, in the weight's dtype
    a, b, ta, tb = _fresh(layout, seed=100 + len(layout) * ord(layout[0]) + ord(layout[1]), device=device)
    dy = torch.randn(64, 96, device=device).bfloat16()
    ref = _run(a, b, ta, tb, dy)
    a2 = a.detach().clone().requires_grad_()
    pair = mxfp4_weight_pair(b)
    assert pair.data.requires_grad and pair.data_t.shape == b.t().shape
    out = _run(a2, pair, ta, tb, dy)
    assert torch.equal(out, ref) and torch.equal(a2.grad, a.grad)
    assert pair.data.grad.dtype == b.dtype and torch.equal(pair.data.grad, b.grad)
    assert pair.data_t.grad is None
    with torch.no_grad():
        assert torch.equal(gemm_fp4(a2, pair, trans_a=ta, trans_b=tb), ref)


@pytest.mark.parametrize("layout", ["NT", "NN", "TN", "TT"])
def test_quantized_tensor_operands_match_on_the_fly(layout, device):
    a, b, ta, tb = _fresh(layout, seed=7 + ord(layout[0]) * 3 + ord(layout[1]), device=device)
    dy = torch.randn(64, 96, device=device).bfloat16()
    # b alone, quantized along K (the forward's copy): out and dB (grad_weight reads a, not b's copies)
    a_ng = a.detach()
    ref = _run(a_ng, b, ta, tb, dy)
    qb = _qt(b, -1 if tb else 0)
    out = _run(a_ng, qb, ta, tb, dy)
    assert torch.equal(out, ref) and qb.grad.dtype == b.dtype and torch.equal(qb.grad, b.grad)
    # a alone, quantized along K, with b's pair: out and dA (grad_input reads b's other copy)
    b_ng = b.detach()
    ref = _run(a, b_ng, ta, tb, dy)
    qa = _qt(a, 0 if ta else -1)
    out = _run(qa, mxfp4_weight_pair(b_ng), ta, tb, dy)
    assert torch.equal(out, ref) and qa.grad.dtype == a.dtype and torch.equal(qa.grad, a.grad)
    # inference: both pre-quantized (uint8 storage views read as the same bytes)
    qa8 = QuantizedTensor(qa.data.view(torch.uint8), qa.scale_inv, MX, block_size=32, axis=qa.axis,
                          orig_dtype=a.dtype)
    with torch.no_grad():
        assert torch.equal(gemm_fp4(qa8, _qt(b_ng, -1 if tb else 0), trans_a=ta, trans_b=tb), ref)


def test_quantized_weight_megatron_fused_accumulation(device):
    # main_grad sits on the pair's data (a framework's bridge sets it there), accumulated as for b
    a, b, ta, tb = _fresh("NT", seed=31, device=device, b_grad=False)
    start = torch.randn(b.shape, device=device)
    ref_b = b.detach().clone().requires_grad_()
    ref_b.main_grad = start.clone()
    pair = mxfp4_weight_pair(b.detach().requires_grad_())
    pair.data.main_grad = start.clone()
    for i in range(2):  # two micro-batches reuse the one quantized weight
        x = torch.randn(64, 128, device=device).bfloat16().requires_grad_()
        dy = torch.randn(64, 96, device=device).bfloat16()
        _run(x, ref_b, ta, tb, dy, fuse_bgrad_accum_pattern="megatron")
        x2 = x.detach().clone().requires_grad_()
        _run(x2, pair, ta, tb, dy, fuse_bgrad_accum_pattern="megatron")
        assert torch.equal(x2.grad, x.grad)
    assert pair.data.grad_added_to_main_grad is True
    assert not torch.equal(pair.data.main_grad, start) and torch.equal(pair.data.main_grad, ref_b.main_grad)


def _mx_qt(b, **kw):
    """A QuantizedTensor over b's MXFP4 codes along its last dim with some parameter overridden."""
    q = QuantizedTensor.quantize(b.detach(), FP4, MX)
    args = dict(data=q.data, scale_inv=q.scale_inv, granularity=MX, block_size=32, axis=-1, orig_dtype=b.dtype,
                shape=tuple(b.shape), scaling_recipe=None)
    args.update(kw)
    data, scale_inv, g = args.pop("data"), args.pop("scale_inv"), args.pop("granularity")
    return QuantizedTensor(data, scale_inv, g, **args)


def test_quantized_operand_mismatches(device):
    a = torch.randn(64, 128, device=device).bfloat16()
    b = torch.randn(96, 128, device=device).bfloat16()  # [N, K]: trans_b
    # FP8 data: the FP8 GEMMs' operand
    fp8 = QuantizedTensor.quantize(b, torch.float8_e4m3fn, MX)
    with pytest.raises(TypeError, match=r"b holds FP8 data \(torch.float8_e4m3fn\).*gemm_fp8"):
        gemm_fp4(a, fp8, trans_b=True)
    # the block, granularity and scale dtype the op quantizes with
    with pytest.raises(ValueError, match="block_size=16; gemm_fp4 groups operands 1 x 32"):
        gemm_fp4(a, _mx_qt(b, block_size=16), trans_b=True)
    with pytest.raises(ValueError, match="b was quantized ROWWISE; MXFP4 operands are MX_BLOCKWISE"):
        gemm_fp4(a, _mx_qt(b, granularity=ScalingGranularity.ROWWISE), trans_b=True)
    q = QuantizedTensor.quantize(b, FP4, MX)
    with pytest.raises(ValueError, match=r"b.scale_inv must be float8_e8m0fnu .*torch.float32"):
        gemm_fp4(a, _mx_qt(b, scale_inv=q.scale_inv.float()), trans_b=True)
    with pytest.raises(ValueError, match=r"must hold data \[96, 64\] and scale_inv \[96, 4\].*scale_inv \[96, 2\]"):
        gemm_fp4(a, _mx_qt(b, scale_inv=q.scale_inv[:, :2]), trans_b=True)
    # recipes the op never uses for an operand
    sr = QuantizedTensor.quantize(b, FP4, MX, scaling_recipe=ScalingRecipe(use_sr=True))
    with pytest.raises(ValueError, match=r"b was quantized with stochastic rounding \(scaling_recipe.use_sr=True\)"):
        gemm_fp4(a, sr, trans_b=True)
    with pytest.raises(ValueError, match=r"b was quantized after a Hadamard transform \(scaling_recipe.use_rht=True\)"):
        gemm_fp4(a, _mx_qt(b, scaling_recipe=ScalingRecipe(use_rht=True)), trans_b=True)
    # the wrong axis: the forward needs b grouped along K
    with pytest.raises(ValueError, match=r"pre-quantized b \[96, 128\] \(quantized along dim 0\) has no copy grouped "
                                         r"along its last dim \(axis=-1\)"):
        gemm_fp4(a, QuantizedTensor.quantize(b, FP4, MX, axis=0), trans_b=True)
    # grad_input needs b grouped along N: a lone QuantizedTensor lacks it
    with pytest.raises(ValueError,
                       match=r"has no copy grouped along its second-last dim \(axis=-2\).*mxfp4_weight_pair"):
        gemm_fp4(a.clone().requires_grad_(), q, trans_b=True)
    # grad_weight needs a's other copy, and use_rht a transform of it
    qa = QuantizedTensor.quantize(a, FP4, MX)
    with pytest.raises(ValueError, match=r"pre-quantized a \[64, 128\] .* has no copy grouped along its second-last"):
        gemm_fp4(qa, b.clone().requires_grad_(), trans_b=True)
    with pytest.raises(ValueError, match="config.use_rht transforms op\\(A\\).*pre-quantized a"):
        gemm_fp4(qa, b.clone().requires_grad_(), trans_b=True, config=Float4QuantConfig(use_rht=True))
    # a pair is for b; its data_t must stand for the transpose
    with pytest.raises(TypeError,
                       match=r"a pre-quantized a must be a QuantizedTensor \(a QuantizedTensorPair is for b\)"):
        gemm_fp4(QuantizedTensorPair(qa), b, trans_b=True)
    with pytest.raises(ValueError, match=r"b.data_t must stand for the transpose of b.data \(96, 128\), i.e. have "
                                         r"shape \(128, 96\), got \(96, 128\)"):
        gemm_fp4(a, QuantizedTensorPair(q, q), trans_b=True)
    with pytest.raises(ValueError, match=r"K mismatch, a\(64, 128\) .* b\(96, 128\) with trans_b=False has K=96"):
        gemm_fp4(a, q)
    with pytest.raises(ValueError, match=r"mxfp4_weight_pair: the second-last dim of weight \(40, 64\) must be a "
                                         r"multiple of 32, got 40"):
        mxfp4_weight_pair(torch.randn(40, 64))
