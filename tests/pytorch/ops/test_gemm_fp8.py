"""turbo.ops.gemm_fp8 against float64 on the *unquantized* inputs: every granularity, format and
layout, forward and both gradients, Megatron's fused wgrad accumulation, backend pins,
pre-quantized operands, torch.compile, empty problems and bad input.

SNR bars (primus_turbo.testing.SNR_THRESHOLDS): 25 dB for E4M3, 20 dB for E5M2 and HYBRID (the
gradients are E5M2 there), for the output and both gradients. On CPU the FP8 GEMMs run in the
Triton interpreter by default; the TORCH backend (torch._scaled_mm) runs CPU tensors where this
torch's CPU _scaled_mm does (probed), and its CPU tests pin it.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch

import primus_turbo.pytorch as turbo  # noqa: F401  (the package must import cleanly)
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
from primus_turbo.testing import snr_db

pytest.importorskip("triton")

from primus_turbo.pytorch.backends import gemm_fp8 as be  # noqa: E402
# the module, not the function that turbo.ops re-exports under the same name
op_mod = importlib.import_module("primus_turbo.pytorch.ops.gemm_fp8")
from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8  # noqa: E402

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

GRANS = ["TENSORWISE", "ROWWISE", "BLOCKWISE", "MX_BLOCKWISE"]
MIN_SNR = {"E4M3": 25.0, "E5M2": 20.0, "HYBRID": 20.0}
# MX needs every GEMM's K (so M, N and K) to be a multiple of 32: its tail shape differs
SHAPES = {g: [(64, 96, 128), (128, 256, 256), (48, 64, 160)] for g in GRANS}
SHAPES["MX_BLOCKWISE"] = [(64, 96, 128), (128, 256, 256), (96, 64, 160)]
if ON_GPU:
    for g in GRANS:
        SHAPES[g] = SHAPES[g] + [(1024, 2048, 1536)]


def _make(m, n, k, layout, dtype=torch.bfloat16, device="cpu", requires_grad=True):
    ta, tb = layout[0] == "T", layout[1] == "T"
    a = torch.randn((k, m) if ta else (m, k), dtype=dtype, device=device)
    b = (torch.randn((n, k) if tb else (k, n), dtype=torch.float32, device=device) / k ** 0.5).to(dtype)
    return a.requires_grad_(requires_grad), b.requires_grad_(requires_grad), ta, tb


def _reference(a, b, ta, tb, grad):
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    out = (a64.t() if ta else a64) @ (b64.t() if tb else b64)
    out.backward(grad.double())
    return out.detach(), a64.grad, b64.grad


def _check(m, n, k, layout, gran, fmt, device, dtype=torch.bfloat16, out_dtype=None):
    a, b, ta, tb = _make(m, n, k, layout, dtype, device)
    cfg = Float8QuantConfig(format=fmt, granularity=gran)
    out = gemm_fp8(a, b, trans_a=ta, trans_b=tb, out_dtype=out_dtype, config=cfg)
    assert out.shape == (m, n) and out.dtype == (out_dtype or dtype)
    grad = torch.randn(m, n, dtype=dtype, device=device)
    out.backward(grad)
    ref, ref_ga, ref_gb = _reference(a, b, ta, tb, grad)
    assert a.grad.shape == a.shape and a.grad.dtype == a.dtype
    assert b.grad.shape == b.shape and b.grad.dtype == b.dtype
    bar = MIN_SNR[fmt]
    assert snr_db(ref, out) >= bar, ("out", snr_db(ref, out))
    assert snr_db(ref_ga, a.grad) >= bar, ("grad_a", snr_db(ref_ga, a.grad))
    assert snr_db(ref_gb, b.grad) >= bar, ("grad_b", snr_db(ref_gb, b.grad))


# ---------------------------------------------------------------------------------------------
# Accuracy: forward and backward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NT", "NN", "TN", "TT"])
@pytest.mark.parametrize("gran", GRANS)
def test_layouts_e4m3(gran, layout, device):
    _check(*SHAPES[gran][0], layout, gran, "E4M3", device)


@pytest.mark.parametrize("shape_idx", range(1, 4 if ON_GPU else 3))
@pytest.mark.parametrize("gran", GRANS)
def test_shapes_e4m3(gran, shape_idx, device):
    """Larger shapes and M/N/K tails (not multiples of the tiles or of the 128 blocks)."""
    _check(*SHAPES[gran][shape_idx], "NT", gran, "E4M3", device)


@pytest.mark.parametrize("fmt", ["E5M2", "HYBRID"])
@pytest.mark.parametrize("gran", GRANS)
def test_formats(gran, fmt, device):
    _check(*SHAPES[gran][0], "NN", gran, fmt, device)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=str)
def test_out_dtype_and_fp16_inputs(out_dtype, device):
    _check(64, 96, 128, "NT", "BLOCKWISE", "E4M3", device, out_dtype=out_dtype)
    _check(64, 96, 128, "NT", "TENSORWISE", "HYBRID", device, dtype=torch.float16)


def test_no_grad_forward(device):
    a, b, ta, tb = _make(64, 96, 128, "NT", device=device, requires_grad=False)
    ref = a.double() @ b.double().t()
    with torch.no_grad():
        assert snr_db(ref, gemm_fp8(a, b, trans_b=True)) >= 25
    out = gemm_fp8(a, b, trans_b=True)  # no input requires grad
    assert not out.requires_grad and snr_db(ref, out) >= 25


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("gran, fmt, layout", [("TENSORWISE", "E4M3", "NT"), ("ROWWISE", "E4M3", "NN"),
                                               ("BLOCKWISE", "E4M3", "TN"), ("MX_BLOCKWISE", "E4M3", "NT"),
                                               ("BLOCKWISE", "HYBRID", "NT")])
def test_single_operand_grad(gran, fmt, layout, which, device):
    """Only a (frozen weight) or only b (e.g. the first layer) requires grad: that gradient against
    the fp64 reference at the format's bar, bit-identical to the one computed when both require grad."""
    m, n, k = 64, 96, 128
    a, b, ta, tb = _make(m, n, k, layout, device=device, requires_grad=False)
    grad = torch.randn(m, n, dtype=torch.bfloat16, device=device)
    cfg = Float8QuantConfig(format=fmt, granularity=gran)
    x, w = a.clone().requires_grad_(which == "a"), b.clone().requires_grad_(which == "b")
    gemm_fp8(x, w, trans_a=ta, trans_b=tb, config=cfg).backward(grad)
    x2, w2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    gemm_fp8(x2, w2, trans_a=ta, trans_b=tb, config=cfg).backward(grad)
    _, ga, gb = _reference(a, b, ta, tb, grad)
    if which == "a":
        assert w.grad is None and x.grad.shape == a.shape and x.grad.dtype == a.dtype
        assert snr_db(ga, x.grad) >= MIN_SNR[fmt], snr_db(ga, x.grad)
        assert torch.equal(x.grad, x2.grad)
    else:
        assert x.grad is None and w.grad.shape == b.shape and w.grad.dtype == b.dtype
        assert snr_db(gb, w.grad) >= MIN_SNR[fmt], snr_db(gb, w.grad)
        assert torch.equal(w.grad, w2.grad)


def test_default_config_is_tensorwise_e4m3(device, monkeypatch):
    seen = []
    real = op_mod._quantize

    def spy(x, dtype, granularity, *args, **kwargs):
        seen.append((dtype, granularity))
        return real(x, dtype, granularity, *args, **kwargs)

    monkeypatch.setattr(op_mod, "_quantize", spy)
    a, b, _, _ = _make(32, 32, 32, "NT", device=device)
    gemm_fp8(a, b, trans_b=True).sum().backward()
    assert set(seen) == {(torch.float8_e4m3fn, "TENSORWISE")}


@pytest.mark.parametrize("layout", ["NT", "NN"])
@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
@pytest.mark.parametrize("gran", GRANS)
def test_every_gemm_of_the_step_is_fp8(gran, fmt, layout, device, monkeypatch):
    """One forward + backward dispatches exactly three FP8 GEMMs (forward, dgrad, wgrad), with
    FP8 operands: the forward's in E4M3, the output gradient in E4M3 (E4M3) or E5M2 (HYBRID) and
    the operand it meets in E4M3. The SNR tests alone would also pass a bf16 backward."""
    m, n, k = 64, 96, 128  # distinct, so each GEMM is told apart by its reduction dim
    seen = []
    real = be.gemm_fp8_dispatcher.dispatch

    def spy(precision, **kw):
        seen.append((kw["a_q"].dtype, tuple(kw["a_q"].shape), kw["b_q"].dtype, tuple(kw["b_q"].shape),
                     kw["mode"], kw["accumulate"]))
        return real(precision, **kw)

    monkeypatch.setattr(be.gemm_fp8_dispatcher, "dispatch", spy)
    a, b, ta, tb = _make(m, n, k, layout, device=device)
    cfg = Float8QuantConfig(format=fmt, granularity=gran)
    out = gemm_fp8(a, b, trans_a=ta, trans_b=tb, config=cfg)
    out.backward(torch.randn(m, n, dtype=torch.bfloat16, device=device))
    assert a.grad is not None and b.grad is not None
    e4, grad_dtype = torch.float8_e4m3fn, (torch.float8_e5m2 if fmt == "HYBRID" else torch.float8_e4m3fn)
    assert len(seen) == 3, seen
    by_k = {call[1][1]: call for call in seen}  # reduction dim: K (forward), N (dgrad), M (wgrad)
    assert sorted(by_k) == sorted((k, n, m)), seen
    for call in seen:
        assert call[4] == turbo.ScalingGranularity[gran] and call[5] is False
    fwd, dgrad, wgrad = by_k[k], by_k[n], by_k[m]
    assert (fwd[0], fwd[2]) == (e4, e4)
    # dgrad multiplies dC [M, N] by the weight's copy [K, N]; wgrad dC's column copy [N, M] by
    # the activation's [K, M]: the output gradient is the operand with M rows, then N rows
    for call, grad_rows in ((dgrad, m), (wgrad, n)):
        (g_dt, _), (o_dt, _) = sorted([(call[0], call[1]), (call[2], call[3])], key=lambda t: t[1][0] != grad_rows)
        assert g_dt == grad_dtype and o_dt == e4, (call, grad_dtype)


# ---------------------------------------------------------------------------------------------
# Megatron fused wgrad accumulation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gran, layout, main_grad_dtype",
    [("TENSORWISE", "NT", torch.float32), ("ROWWISE", "NN", torch.float32), ("BLOCKWISE", "NT", torch.float32),
     ("MX_BLOCKWISE", "NT", torch.float32), ("TENSORWISE", "NT", torch.bfloat16), ("BLOCKWISE", "NN", torch.bfloat16)],
)
def test_megatron_fused_wgrad_accumulation(gran, layout, main_grad_dtype, device):
    m, n, k = (256, 512, 256) if ON_GPU else (64, 96, 64)
    cfg = Float8QuantConfig(format="HYBRID", granularity=gran)
    ta, tb = layout[0] == "T", layout[1] == "T"
    b = (torch.randn((n, k) if tb else (k, n), device=device) / k ** 0.5).to(torch.bfloat16).requires_grad_()
    start = torch.randn(b.shape, device=device).to(main_grad_dtype)  # never start from zeros
    b.main_grad = start.clone()
    b.grad_added_to_main_grad = False
    expected = start.double()
    for _ in range(3):
        a = torch.randn((k, m) if ta else (m, k), dtype=torch.bfloat16, device=device, requires_grad=True)
        grad = torch.randn(m, n, dtype=torch.bfloat16, device=device)
        out = gemm_fp8(a, b, trans_a=ta, trans_b=tb, config=cfg, fuse_bgrad_accum_pattern="megatron")
        out.backward(grad)
        _, ref_ga, ref_gb = _reference(a, b, ta, tb, grad)
        expected += ref_gb
        assert snr_db(ref_ga, a.grad) >= 20.0  # grad_input unaffected by the fusion
    assert b.grad_added_to_main_grad is True
    assert b.main_grad.dtype == main_grad_dtype
    assert b.grad is not None and b.grad.shape == b.shape  # the placeholder
    # start is O(1) per element, each dB is O(sqrt(m)): the FP8 error of the three dB's dominates
    assert snr_db(expected, b.main_grad) >= 20.0
    delta_ref = expected - start.double()
    assert snr_db(delta_ref, b.main_grad.double() - start.double()) >= 20.0


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------
def test_default_backend_choice(device, monkeypatch):
    """Default: TORCH (_scaled_mm) for TENSORWISE/ROWWISE where it can run (on CPU only without
    the Triton interpreter), GLUON for BLOCKWISE on sm_90 (tests/triton/test_gemm_fp8_gluon.py
    mocks the platform), else TRITON."""
    from tests.fp8_quant_helpers import quantize

    for gran in GRANS:
        a_q, sa = quantize(torch.randn(64, 128), gran)
        b_q, sb = quantize(torch.randn(96, 128), gran, weight=True)
        kw = dict(a_q=a_q.to(device), a_scale=sa.to(device), b_q=b_q.to(device), b_scale=sb.to(device),
                  mode=turbo.ScalingGranularity[gran], out=None, out_dtype=torch.bfloat16, accumulate=False,
                  block_size=128)
        chosen = be.gemm_fp8_dispatcher.resolve(PrecisionType.FP8, **kw).backend_type
        want = BackendType.TORCH if (ON_GPU and gran in ("TENSORWISE", "ROWWISE")) else BackendType.TRITON
        if gran == "BLOCKWISE" and be.GemmFP8GluonBackend.can_handle(**kw):
            want = BackendType.GLUON
        assert chosen == want, gran
    # E5M2 x E5M2 has no cuBLASLt kernel: TRITON, also on the GPU
    e5 = dict(kw, a_q=kw["a_q"].to(torch.float8_e5m2), b_q=kw["b_q"].to(torch.float8_e5m2),
              mode=turbo.ScalingGranularity.TENSORWISE, a_scale=torch.ones((), device=device),
              b_scale=torch.ones((), device=device))
    assert be._default(**e5) == BackendType.TRITON
    if not ON_GPU:
        # CPU without the interpreter: the Triton kernels cannot run there, _scaled_mm can (E5M2 too)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        for gran in ("TENSORWISE", "ROWWISE"):
            a_q, sa = quantize(torch.randn(64, 128), gran)
            b_q, sb = quantize(torch.randn(96, 128), gran, weight=True)
            cpu = dict(kw, a_q=a_q, a_scale=sa, b_q=b_q, b_scale=sb, mode=turbo.ScalingGranularity[gran])
            assert be._default(**cpu) == BackendType.TORCH, gran
        assert be._default(**e5) == BackendType.TORCH
        assert be._default(**dict(kw, mode=turbo.ScalingGranularity.BLOCKWISE)) == BackendType.TRITON


def test_torch_backend_check_rejects():
    from tests.fp8_quant_helpers import quantize

    a_q, sa = quantize(torch.randn(64, 128), "TENSORWISE")
    kw = dict(a_q=a_q, a_scale=sa, b_q=a_q, b_scale=sa, mode=turbo.ScalingGranularity.TENSORWISE)
    if not ON_GPU:  # this torch's CPU _scaled_mm runs tensor-wise scaling (the GPU machine's may not)
        assert be.GemmFP8TorchBackend.why_not(**kw) is None
    meta = torch.empty(64, 128, dtype=torch.float8_e4m3fn, device="meta")
    assert "runs CUDA and CPU tensors, got meta" in be.GemmFP8TorchBackend.why_not(
        **dict(kw, a_q=meta, b_q=meta, a_scale=sa.to("meta"), b_scale=sa.to("meta")))
    assert "one fp32 value each" in be.GemmFP8TorchBackend.why_not(**dict(kw, b_scale=torch.ones(2)))
    assert "ROWWISE scales must be fp32 [M, 1] and [N, 1], got (), ()" in be.GemmFP8TorchBackend.why_not(
        **dict(kw, mode=turbo.ScalingGranularity.ROWWISE))
    assert "no BLOCKWISE scaling" in be.GemmFP8TorchBackend.why_not(**dict(kw, mode=turbo.ScalingGranularity.BLOCKWISE))
    assert "MX_BLOCKWISE" in be.GemmFP8TorchBackend.why_not(**dict(kw, mode=turbo.ScalingGranularity.MX_BLOCKWISE))
    assert "K mismatch" in be.GemmFP8TorchBackend.why_not(**dict(kw, b_q=a_q[:, :64]))
    # the Triton kernel runs CUDA tensors (sm_89+) and CPU ones under the interpreter only
    from primus_turbo.triton import is_interpreter

    if is_interpreter():
        assert be.GemmFP8TritonBackend.why_not(**kw) is None
    else:
        assert "tensors on cpu; needs CUDA (or CPU with TRITON_INTERPRET=1)" in be.GemmFP8TritonBackend.why_not(**kw)
    if ON_GPU:
        on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        reason = be.GemmFP8TritonBackend.why_not(**on_gpu)
        if torch.cuda.get_device_capability() >= (8, 9):
            assert reason is None
        else:
            assert "has no FP8 tensor cores" in reason


def test_pins(device, monkeypatch):
    a, b, _, _ = _make(64, 96, 128, "NT", device=device)
    GlobalBackendManager.set_gemm_backend(BackendType.TRITON, precision="FP8")
    out = gemm_fp8(a, b, trans_b=True)
    assert snr_db(a.double() @ b.double().t(), out) >= 25
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision="FP8")
    ran = []
    real = be.GemmFP8TorchBackend.execute
    monkeypatch.setattr(be.GemmFP8TorchBackend, "execute", lambda **kw: ran.append(1) or real(**kw))
    assert snr_db(a.double() @ b.double().t(), gemm_fp8(a, b, trans_b=True)) >= 25  # CPU too
    assert ran == [1]
    with pytest.raises(ValueError, match="backend TORCH .* cannot run these inputs: .*no BLOCKWISE scaling"):
        gemm_fp8(a, b, trans_b=True, config=Float8QuantConfig(granularity="BLOCKWISE"))
    # the BF16 pin does not touch FP8
    GlobalBackendManager.reset()
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision="BF16")
    assert snr_db(a.double() @ b.double().t(), gemm_fp8(a, b, trans_b=True)) >= 25


def test_autotune_keeps_main_grad(device):
    GlobalBackendManager.set_auto_tune(True)
    b = (torch.randn(96, 64, device=device) / 8).to(torch.bfloat16).requires_grad_()
    b.main_grad = torch.randn(96, 64, device=device)
    start = b.main_grad.clone()
    a = torch.randn(32, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    g = torch.randn(32, 96, dtype=torch.bfloat16, device=device)
    gemm_fp8(a, b, trans_b=True, fuse_bgrad_accum_pattern="megatron").backward(g)
    delta = g.double().t() @ a.detach().double()
    assert snr_db(delta, b.main_grad.double() - start.double()) >= 25  # exactly one add
    assert len(be.gemm_fp8_dispatcher.tune_cache) >= 1


def _count_torch_executes(monkeypatch) -> list:
    """Records every GemmFP8TorchBackend.execute (its ``accumulate`` flag) and runs it."""
    calls = []
    real = be.GemmFP8TorchBackend.execute
    def spy(**kw):
        calls.append(kw.get("accumulate", False))
        return real(**kw)

    monkeypatch.setattr(be.GemmFP8TorchBackend, "execute", spy)
    return calls


@pytest.mark.skipif(ON_GPU, reason="CPU tensors; on a GPU machine test_torch_vs_triton covers TORCH")
@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID", "E5M2"])
@pytest.mark.parametrize("gran", ["TENSORWISE", "ROWWISE"])
def test_torch_backend_on_cpu(gran, fmt, layout, monkeypatch):
    """TORCH pinned on CPU tensors: CPU torch._scaled_mm runs all three GEMMs (E5M2 x E5M2 too,
    which cuBLASLt lacks), with no 16-multiple sizes; forward and both gradients against fp64."""
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision="FP8")
    calls = _count_torch_executes(monkeypatch)
    _check(40, 72, 100, layout, gran, fmt, "cpu")
    assert calls == [False, False, False]


@pytest.mark.skipif(ON_GPU, reason="CPU tensors; on a GPU machine test_torch_vs_triton covers TORCH")
@pytest.mark.parametrize("gran", ["TENSORWISE", "ROWWISE"])
def test_torch_backend_on_cpu_dtypes(gran, monkeypatch):
    """fp32 / fp16 outputs and fp16 inputs through CPU _scaled_mm (CUDA row-wise: bf16 unless probed)."""
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision="FP8")
    calls = _count_torch_executes(monkeypatch)
    _check(64, 96, 128, "NT", gran, "E4M3", "cpu", out_dtype=torch.float32)
    _check(64, 96, 128, "NT", gran, "HYBRID", "cpu", dtype=torch.float16)
    assert len(calls) == 6


@pytest.mark.parametrize("gran", ["TENSORWISE", "ROWWISE"])
def test_torch_fused_wgrad_accumulation(gran, device, monkeypatch):
    """TORCH pinned, E4M3 (so ROWWISE stays on _scaled_mm on sm_90): three micro-batches added
    into an fp32 main_grad that starts non-zero, against the fp64 sum. Then, at the backend, each
    addend is _scaled_mm's fp32 product where this build writes one (the gemm_fp8 docstring's
    claim), bit for bit: a bf16-rounded addend would differ."""
    from tests.fp8_quant_helpers import quantize

    GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision="FP8")
    calls = _count_torch_executes(monkeypatch)
    m, n, k = (256, 512, 256) if ON_GPU else (64, 96, 64)
    cfg = Float8QuantConfig(format="E4M3", granularity=gran)
    b = (torch.randn(n, k, device=device) / k ** 0.5).to(torch.bfloat16).requires_grad_()
    start = torch.randn(n, k, device=device)  # never start from zeros
    b.main_grad = start.clone()
    b.grad_added_to_main_grad = False
    expected = start.double()
    for _ in range(3):
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device, requires_grad=True)
        grad = torch.randn(m, n, dtype=torch.bfloat16, device=device)
        gemm_fp8(a, b, trans_b=True, config=cfg, fuse_bgrad_accum_pattern="megatron").backward(grad)
        expected += grad.double().t() @ a.detach().double()
    assert calls.count(True) == 3 and len(calls) == 9  # every wgrad accumulated through TORCH
    assert b.grad_added_to_main_grad is True and b.main_grad.dtype == torch.float32
    assert snr_db(expected, b.main_grad) >= 25.0
    assert snr_db(expected - start.double(), b.main_grad.double() - start.double()) >= 25.0

    x_q, sx = quantize(torch.randn(n, m), gran)
    y_q, sy = quantize(torch.randn(k, m), gran)
    kw = dict(a_q=x_q.to(device), a_scale=sx.to(device), b_q=y_q.to(device), b_scale=sy.to(device),
              mode=turbo.ScalingGranularity[gran])
    res_dtype = be._result_dtype(kw["mode"], x_q.to(device).device, x_q.dtype, y_q.dtype, torch.float32, True)
    if not ON_GPU or gran == "TENSORWISE":
        assert res_dtype == torch.float32  # cuBLASLt tensor-wise, and this torch's CPU _scaled_mm
    c0 = torch.randn(n, k, device=device)
    c = c0.clone()
    be.GemmFP8TorchBackend.execute(**kw, out=c, accumulate=True)
    product = be.GemmFP8TorchBackend.execute(**kw, out_dtype=res_dtype)
    assert product.dtype == res_dtype
    assert torch.equal(c, c0 + product.float())
    if res_dtype == torch.float32:
        assert not torch.equal(c, c0 + product.to(torch.bfloat16).float())


def test_torch_cpu_probe_refuses_what_scaled_mm_cannot_do(monkeypatch):
    """CPU _scaled_mm is probed once per combination: an error or a wrong value makes TORCH refuse
    CPU tensors with the reason (the pin names it); nothing is assumed from the torch version."""
    from tests.fp8_quant_helpers import quantize

    a_q, sa = quantize(torch.randn(32, 64), "ROWWISE")
    b_q, sb = quantize(torch.randn(48, 64), "ROWWISE")
    kw = dict(a_q=a_q, a_scale=sa, b_q=b_q, b_scale=sb, mode=turbo.ScalingGranularity.ROWWISE,
              out_dtype=torch.bfloat16)

    def raises(*args, **kwargs):
        raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")

    def swapped_scales(a, b, scale_a, scale_b, out_dtype):  # scales applied along the wrong dims
        return ((a.float() * scale_b.reshape(-1)[: a.shape[0]].reshape(-1, 1)) @ b.float()).to(out_dtype)

    for fake, match in ((raises, r"cannot run row-wise scaling, float8_e4m3fn x float8_e4m3fn -> bfloat16 .*"
                                 r"per-tensor scaling for CPU"),
                        (swapped_scales, r"gives wrong values for row-wise scaling")):
        monkeypatch.setattr(be, "_PROBES", {})
        monkeypatch.setattr(torch, "_scaled_mm", fake)
        reason = be.GemmFP8TorchBackend.why_not(**kw)
        assert reason is not None and re.search(match, reason), reason
        GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision="FP8")
        with pytest.raises(ValueError, match="backend TORCH .* cannot run these inputs: torch._scaled_mm on cpu"):
            be.gemm_fp8_dispatcher.dispatch(PrecisionType.FP8, **kw)
        GlobalBackendManager.reset()
        # the default then leaves CPU tensors to TRITON even without the interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert be._default(**kw) == BackendType.TRITON
        monkeypatch.delenv("TRITON_INTERPRET")


def test_mxfp8_support_reason_names_the_bf16_mma(monkeypatch):
    """Hopper's MX path widens FP8 tiles to bf16 (scales folded in) and runs a bf16 MMA: the
    capability reason says so, not "FP8 tensor cores"."""
    from primus_turbo.pytorch.core import low_precision as lp

    monkeypatch.setattr(lp, "_device_capability", lambda device=None: (9, 0))
    ok, reason = lp.check_mxfp8_support()
    assert ok is True and "emulated on sm_90" in reason and "bf16 MMA" in reason and "E8M0" in reason
    assert "FP8 tensor cores" not in reason
    monkeypatch.setattr(lp, "_device_capability", lambda device=None: (10, 0))
    assert lp.check_mxfp8_support() == (True, "native MX block-scaled tensor cores on sm_100")
    monkeypatch.setattr(lp, "_device_capability", lambda device=None: (8, 0))
    ok, reason = lp.check_mxfp8_support()
    assert ok is False and "sm_80" in reason and "sm_89" in reason


@pytest.mark.gpu
@pytest.mark.parametrize("gran", ["TENSORWISE", "ROWWISE"])
@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_torch_vs_triton(gran, fmt):
    results = {}
    for backend in (BackendType.TORCH, BackendType.TRITON):
        GlobalBackendManager.reset()
        GlobalBackendManager.set_gemm_backend(backend, precision="FP8")
        torch.manual_seed(0)
        a, b, ta, tb = _make(1024, 2048, 1536, "NT", device="cuda")
        grad = torch.randn(1024, 2048, dtype=torch.bfloat16, device="cuda")
        cfg = Float8QuantConfig(format=fmt, granularity=gran)
        if backend == BackendType.TORCH and fmt == "HYBRID" and gran == "ROWWISE":
            with pytest.raises(ValueError, match="E4M3 x E4M3 only"):
                gemm_fp8(a, b, trans_b=True, config=cfg).backward(grad)
            return
        out = gemm_fp8(a, b, trans_b=True, config=cfg)
        out.backward(grad)
        results[backend] = (out.detach(), a.grad, b.grad)
    for x, y in zip(results[BackendType.TORCH], results[BackendType.TRITON]):
        assert snr_db(x, y) >= 35.0


@pytest.mark.gpu
@pytest.mark.parametrize("gran", GRANS)
def test_gpu_4096(gran):
    _check(4096, 4096, 4096, "NT", gran, "E4M3", "cuda")


# ---------------------------------------------------------------------------------------------
# Pre-quantized operands
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gran", GRANS)
def test_quantized_tensor_inputs(gran, device):
    """Pre-quantized operands give exactly what on-the-fly quantization gives (same quantizer)."""
    qt_mod = pytest.importorskip("primus_turbo.pytorch.core.quantized_tensor")
    cfg = Float8QuantConfig(granularity=gran)
    x, w, _, _ = _make(64, 96, 128, "NT", device=device)
    grad = torch.randn(64, 96, dtype=torch.bfloat16, device=device)
    ref_out = gemm_fp8(x, w, trans_b=True, config=cfg)
    ref_out.backward(grad)
    ref_gx, ref_gw = x.grad.clone(), w.grad.clone()
    x.grad = None

    # weight cache with its transposed copy: forward and grad_input match
    pair = qt_mod.create_quantized_weight(w.detach(), torch.float8_e4m3fn, cfg, need_weight_transpose_cache=True)
    out = gemm_fp8(x, pair, trans_b=True, config=cfg)
    assert torch.equal(out, ref_out.detach())
    out.backward(grad)
    assert torch.equal(x.grad, ref_gx)
    # a bare QuantizedTensor weight serves the forward (and grad_input when its scales are shared)
    x.grad = None
    with torch.no_grad():
        assert torch.equal(gemm_fp8(x, pair.data, trans_b=True, config=cfg), ref_out.detach())
    if gran in ("TENSORWISE", "BLOCKWISE"):  # one scale grid serves both orientations (128x128 tiles)
        gemm_fp8(x, pair.data, trans_b=True, config=cfg).backward(grad)
        assert torch.equal(x.grad, ref_gx)
    else:  # grad_input needs the transposed copy: refused at the forward, not mid-backward
        with pytest.raises(ValueError, match="has no copy grouped along its first dim"):
            gemm_fp8(x, pair.data, trans_b=True, config=cfg)
    # a pre-quantized activation, weight in high precision: forward and grad_weight match when
    # both copies of the activation are at hand (TENSORWISE: one scale for both)
    w.grad = None
    xq = qt_mod.QuantizedTensor.quantize(x.detach(), torch.float8_e4m3fn, cfg.granularity,
                                         block_size=cfg.block_size)
    with torch.no_grad():
        assert torch.equal(gemm_fp8(xq, w, trans_b=True, config=cfg), ref_out.detach())
    if gran == "TENSORWISE":
        gemm_fp8(xq, w, trans_b=True, config=cfg).backward(grad)
        assert torch.equal(w.grad, ref_gw)
    # an activation quantized down its columns (axis=0) is the column-wise copy: a TN product
    if gran != "TENSORWISE":
        xt = x.detach().t().contiguous()  # [K, M]: op(A) = xt.T, grouped along K = down xt's columns
        xq0 = qt_mod.QuantizedTensor.quantize(xt, torch.float8_e4m3fn, cfg.granularity, axis=0,
                                              block_size=cfg.block_size)
        with torch.no_grad():
            assert torch.equal(gemm_fp8(xq0, w, trans_a=True, trans_b=True, config=cfg), ref_out.detach())
    with pytest.raises(ValueError, match="config says"):
        gemm_fp8(x, pair, trans_b=True, config=Float8QuantConfig(granularity="ROWWISE" if gran != "ROWWISE"
                                                                 else "TENSORWISE"))
    # a cached weight that requires grad gets the weight gradient, bit-identical to w's
    pair_g = qt_mod.create_quantized_weight(w.detach().clone().requires_grad_(), torch.float8_e4m3fn, cfg,
                                            need_weight_transpose_cache=True)
    x.grad = None
    gemm_fp8(x, pair_g, trans_b=True, config=cfg).backward(grad)
    assert torch.equal(pair_g.data.grad, ref_gw) and torch.equal(x.grad, ref_gx) and pair_g.data_t.grad is None
    # fused accumulation reads main_grad off the quantized buffer, which needs one
    with pytest.raises(ValueError, match="main_grad"):
        gemm_fp8(x, pair_g, trans_b=True, config=cfg, fuse_bgrad_accum_pattern="megatron")


# ---------------------------------------------------------------------------------------------
# torch.compile, empty problems, errors
# ---------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph(device):
    GlobalBackendManager.set_gemm_backend(BackendType.TRITON, precision="FP8")
    torch._dynamo.reset()
    a, b, _, _ = _make(32, 48, 64, "NT", device=device)

    def f(x, w):
        return gemm_fp8(x, w, trans_b=True).float().relu().sum()

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

    monkeypatch.setattr(be.gemm_fp8_dispatcher, "dispatch", _no_launch)
    a = torch.randn(5, 0, device=device, requires_grad=True)
    b = torch.randn(0, 7, device=device, requires_grad=True)
    out = gemm_fp8(a, b)
    assert out.shape == (5, 7) and torch.equal(out, torch.zeros(5, 7, device=device))
    out.sum().backward()
    assert a.grad.shape == (5, 0) and b.grad.shape == (0, 7)
    assert gemm_fp8(torch.randn(0, 32, device=device), torch.randn(32, 3, device=device)).shape == (0, 3)
    w = torch.randn(6, 32, device=device, requires_grad=True)
    w.main_grad = torch.randn(6, 32, device=device)
    before = w.main_grad.clone()
    x = torch.randn(0, 32, device=device, requires_grad=True)
    gemm_fp8(x, w, trans_b=True, fuse_bgrad_accum_pattern="megatron").sum().backward()
    assert torch.equal(w.main_grad, before) and w.grad_added_to_main_grad is True


@pytest.mark.parametrize(
    "make, kwargs, match, exc",
    [
        (lambda d: (torch.randn(2, 3, 4, device=d), torch.randn(4, 5, device=d)), {}, r"a must be 2-D", ValueError),
        (lambda d: (torch.randn(3, 4, device=d).to(torch.float8_e4m3fn), torch.randn(4, 5, device=d)), {},
         r"a.dtype must be float32, float16 or bfloat16 .* got torch.float8_e4m3fn", TypeError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(4, 5, device=d).half()), {},
         r"same dtype, got a=torch.float32, b=torch.float16", TypeError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(5, 5, device=d)), {},
         r"K mismatch, a\(3, 4\) with trans_a=False has K=4, b\(5, 5\) with trans_b=False has K=5", ValueError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(4, 5, device="meta")), {}, r"same device", ValueError),
        (lambda d: ([[1.0]], torch.randn(4, 5, device=d)), {}, r"a must be a torch.Tensor or a QuantizedTensor, got list", TypeError),
        (lambda d: (torch.randn(32, 48, device=d), torch.randn(48, 32, device=d)),
         dict(config=Float8QuantConfig(granularity="MX_BLOCKWISE")), r"MX_BLOCKWISE needs K to be a multiple of 32, got K=48",
         ValueError),
        (lambda d: (torch.randn(32, 64, device=d), torch.randn(64, 40, device=d, requires_grad=True)),
         dict(config=Float8QuantConfig(granularity="MX_BLOCKWISE")), None, None),
        (lambda d: (torch.randn(32, 64, device=d, requires_grad=True), torch.randn(64, 40, device=d)),
         dict(config=Float8QuantConfig(granularity="MX_BLOCKWISE")), r"needs N to be a multiple of 32, got N=40",
         ValueError),
        # grad_weight reduces over M: with b requiring grad, M = 40 is refused at the forward
        (lambda d: (torch.randn(40, 64, device=d), torch.randn(64, 32, device=d, requires_grad=True)),
         dict(config=Float8QuantConfig(granularity="MX_BLOCKWISE")),
         r"MX_BLOCKWISE needs M to be a multiple of 32, got M=40 \(m, n, k = 40, 32, 64\)", ValueError),
        (lambda d: (torch.randn(40, 64, device=d, requires_grad=True), torch.randn(64, 32, device=d)),
         dict(config=Float8QuantConfig(granularity="MX_BLOCKWISE")), None, None),  # no grad_weight: M free
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(4, 5, device=d)), dict(config="tensorwise"),
         r"config must be a Float8QuantConfig or None, got str", TypeError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(4, 5, device=d)), dict(out_dtype=torch.int32),
         r"out_dtype must be .* got torch.int32", TypeError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(4, 5, device=d)), dict(fuse_bgrad_accum_pattern="te"),
         r"fuse_bgrad_accum_pattern must be None or 'megatron', got 'te'", ValueError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(4, 5, device=d, requires_grad=True)),
         dict(fuse_bgrad_accum_pattern="megatron"), r"needs b.main_grad", ValueError),
    ],
)
def test_bad_input(make, kwargs, match, exc, device):
    a, b = make(device)
    if exc is None:  # valid neighbours of the error cases: the dim that no GEMM reduces over is free
        gemm_fp8(a, b, **kwargs)
        return
    with pytest.raises(exc, match=match):
        gemm_fp8(a, b, **kwargs)


def test_bad_main_grad(device):
    a = torch.randn(3, 4, device=device)
    b = torch.randn(4, 5, device=device, requires_grad=True)
    b.main_grad = torch.zeros(5, 4, device=device)
    with pytest.raises(ValueError, match=r"b.main_grad must match b, got main_grad \(5, 4\)"):
        gemm_fp8(a, b, fuse_bgrad_accum_pattern="megatron")
    b.main_grad = torch.zeros(4, 5, device=device, dtype=torch.float16)
    with pytest.raises(TypeError, match="main_grad must be float32 or bfloat16, got torch.float16"):
        gemm_fp8(a, b, fuse_bgrad_accum_pattern="megatron")
