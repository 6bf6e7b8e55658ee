"""The Gluon BLOCKWISE FP8 GEMM (primus_turbo/triton/gemm/gemm_fp8_gluon.py).

Gluon kernels do not run in the Triton interpreter, so on CPU this file checks what can be checked
without a GPU: the eligibility reasons, the config helpers, and that the kernel compiles for sm_90
(PTX and cubin with the bundled ptxas) without register spills and within the shared memory of an
SM. On an sm_90 GPU it runs the kernel against the fp32 product of the dequantized operands (only
the accumulation order differs: >= 40 dB with bf16 output, which alone costs ~50 dB) and against
the ``triton.language`` kernel, with M, N and K tails, every output dtype, a caller's strided
``out``, and the inputs it must refuse.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton import is_interpreter  # noqa: E402
from primus_turbo.triton.gemm import gemm_fp8_gluon as gg  # noqa: E402
from tests.triton.gluon_compile_child import rerun_outside_interpreter, warmup_for_sm90  # noqa: E402
from tests.triton.gluon_gemm_helpers import ON_SM90 as _ON_SM90  # noqa: E402
from tests.triton.gluon_gemm_helpers import assert_row_scales_arg, compile_report, sm90  # noqa: E402
from tests.triton.gluon_gemm_helpers import snr as _snr  # noqa: E402

E4M3 = torch.float8_e4m3fn
MIN_SNR = {torch.bfloat16: 40.0, torch.float16: 45.0, torch.float32: 55.0}


def _quant_1x128(x: torch.Tensor):
    """Activation: 1 x 128 groups along K -> (q [M, K] e4m3, scale_inv [M, ceil(K/128)])."""
    M, K = x.shape
    kb = math.ceil(K / 128)
    g = torch.nn.functional.pad(x.float(), (0, kb * 128 - K)).view(M, kb, 128)
    amax = g.abs().amax(-1).clamp(min=1e-12)
    scale = 448.0 / amax
    q = (g * scale[..., None]).clamp(-448, 448).to(E4M3).view(M, kb * 128)[:, :K].contiguous()
    return q, (1.0 / scale).contiguous()


def _quant_128x128(w: torch.Tensor):
    """Weight: 128 x 128 blocks -> (q [N, K] e4m3, scale_inv [ceil(N/128), ceil(K/128)])."""
    N, K = w.shape
    nb, kb = math.ceil(N / 128), math.ceil(K / 128)
    g = torch.nn.functional.pad(w.float(), (0, kb * 128 - K, 0, nb * 128 - N)).view(nb, 128, kb, 128)
    amax = g.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = 448.0 / amax
    q = (g * scale[:, None, :, None]).clamp(-448, 448).to(E4M3).view(nb * 128, kb * 128)[:N, :K].contiguous()
    return q, (1.0 / scale).contiguous()


def _operands(M, N, K, device):
    a_q, sa = _quant_1x128(torch.randn(M, K, device=device) * 2)
    b_q, sb = _quant_128x128(torch.randn(N, K, device=device) * 0.05)
    sa_full = sa.repeat_interleave(128, 1)[:, :K]
    sb_full = sb.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    ref = (a_q.double() * sa_full.double()) @ (b_q.double() * sb_full.double()).T
    return (a_q, sa, b_q, sb), ref


# ---------------------------------------------------------------------------------------------
# CPU: reasons, config helpers, sm_90 compile
# ---------------------------------------------------------------------------------------------
def test_reason_on_cpu_tensors():
    (a_q, sa, b_q, sb), _ = _operands(64, 128, 128, "cpu")
    reason = gg.gluon_blockwise_reason(a_q, sa, b_q, sb)
    assert reason is not None
    if gg.GLUON_AVAILABLE:
        assert "cpu" in reason and "sm_90" in reason, reason
    else:
        assert "gluon" in reason.lower()
    with pytest.raises(ValueError, match="gemm_fp8_blockwise_gluon"):
        gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb)


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
def test_reason_names_bad_inputs_before_device():
    (a_q, sa, b_q, sb), _ = _operands(64, 128, 256, "cpu")
    cases = [
        (dict(a=a_q.to(torch.float8_e5m2)), "float8_e4m3fn only"),
        (dict(b=b_q[:, :128]), "K mismatch"),
        (dict(a=a_q.reshape(-1)), "must be 2-D"),
        (dict(sa="x"), "must be a torch.Tensor"),
    ]
    for kw, match in cases:
        args = {**dict(a=a_q, sa=sa, b=b_q, sb=sb), **kw}
        reason = gg.gluon_blockwise_reason(args["a"], args["sa"], args["b"], args["sb"])
        assert reason is not None and match in reason, (kw.keys(), reason)


def test_config_parse_and_fit():
    cfg = gg.GluonBlockwiseConfig.parse("n256s3g16c2r240w24")
    assert (cfg.block_n, cfg.stages, cfg.group_m, cfg.c_bufs, cfg.consumer_regs, cfg.producer_regs) == \
        (256, 3, 16, 2, 240, 24)
    assert gg.GluonBlockwiseConfig.parse(cfg.short()) == cfg
    assert gg.GluonBlockwiseConfig.parse("n128s5") == gg.GluonBlockwiseConfig()
    with pytest.raises(ValueError, match="bad Gluon config"):
        gg.GluonBlockwiseConfig.parse("128x128")
    assert cfg.check() is None
    assert "block_n" in gg.GluonBlockwiseConfig.parse("n192s4").check()
    assert "pipelined" in gg.GluonBlockwiseConfig.parse("n256s3x").check()
    assert gg.GluonBlockwiseConfig.parse("n128s5c2x").pipeline
    assert "shared memory" in gg.GluonBlockwiseConfig.parse("n256s5").check()
    assert "registers" in gg.GluonBlockwiseConfig.parse("n128s4r248w40").check()
    assert "multiples of 8" in gg.GluonBlockwiseConfig.parse("n128s4r230").check()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cfg = gg.default_config(4096, 4096, 4096, dtype)
        assert cfg.check(dtype.itemsize) is None


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
@pytest.mark.parametrize("out_dtype,config", [("bf16", None), ("fp32", None), ("bf16", "n256s4"), ("bf16", "n256s3c2"),
                                              ("bf16", "n128s5x"), ("fp32", "n128s3c2x")])
def test_compiles_for_sm90_without_spills(out_dtype, config, request):
    """The GPU-only kernel still compiles for sm_90 (catches API drift and register spills on CPU CI)."""
    if rerun_outside_interpreter(request):
        return
    cfg = (gg.GluonBlockwiseConfig.parse(config) if config else
           gg.default_config(4096, 4096, 4096, torch.bfloat16 if out_dtype == "bf16" else torch.float32))
    assert cfg.check(2 if out_dtype == "bf16" else 4) is None
    compile_report(cfg, out_dtype)


# ---------------------------------------------------------------------------------------------
# GPU: correctness
# ---------------------------------------------------------------------------------------------
# (M, N, K): aligned; M and N tails (partial tiles, a fully empty second A half; with 256-wide
# tiles N = 384 leaves a 128-column half wholly past N, N = 200 one partly past it); K tail
# (336 = 2 x 128 + 80, zero-filled by TMA); M = 1; one tile column; multi-wave persistent grid
SHAPES = [(256, 256, 256), (300, 200, 384), (130, 136, 336), (1, 256, 512), (70, 128, 128), (520, 384, 256),
          (2048, 1536, 1024)]


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, "n256s4", "n128s5x", "n128s3g1c2"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matches_reference(M, N, K, config):
    (a_q, sa, b_q, sb), ref = _operands(M, N, K, "cuda")
    assert gg.gluon_blockwise_reason(a_q, sa, b_q, sb) is None
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    cfg = gg.GluonBlockwiseConfig.parse(config) if config else None
    res = gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out=out, config=cfg)
    assert res is out
    assert not torch.isnan(out).any(), "unwritten output elements"
    assert _snr(ref, out) >= MIN_SNR[torch.bfloat16], (M, N, K, config)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_out_dtypes_and_configs(out_dtype):
    M, N, K = 384, 640, 1024
    (a_q, sa, b_q, sb), ref = _operands(M, N, K, "cuda")
    out = gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (M, N)
    assert _snr(ref, out) >= MIN_SNR[out_dtype]
    for text in ("n128s3", "n128s4g1", "n128s6g16", "n256s4", "n256s3c2", "n256s2", "n128s5x", "n128s3c2x"):
        if gg.GluonBlockwiseConfig.parse(text).check(out_dtype.itemsize) is not None:
            continue
        again = gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out_dtype=out_dtype,
                                            config=gg.GluonBlockwiseConfig.parse(text))
        assert _snr(ref, again) >= MIN_SNR[out_dtype], text


@sm90
@pytest.mark.gpu
def test_matches_triton_kernel_and_strided_out():
    from primus_turbo.triton.gemm.gemm_fp8_kernel import gemm_fp8_triton

    M, N, K = 512, 384, 768
    (a_q, sa, b_q, sb), ref = _operands(M, N, K, "cuda")
    # a caller's out with padded rows (row stride N + 64): the padding must stay untouched
    buf = torch.full((M, N + 64), 7.0, device="cuda", dtype=torch.bfloat16)
    out = buf[:, :N]
    gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out=out)
    assert torch.all(buf[:, N:] == 7.0)
    tl_out = gemm_fp8_triton(a_q, sa, b_q, sb, "BLOCKWISE", out_dtype=torch.bfloat16)
    assert _snr(ref, out) >= 40.0
    assert _snr(tl_out.float(), out) >= 40.0
    # non-contiguous scales (a transposed copy) are read through their strides
    sa_t = sa.t().contiguous().t()
    again = gg.gemm_fp8_blockwise_gluon(a_q, sa_t, b_q, sb)
    assert torch.equal(again, out)


@sm90
@pytest.mark.gpu
def test_empty_and_refused_inputs():
    (a_q, sa, b_q, sb), _ = _operands(256, 256, 256, "cuda")
    # empty M: nothing launched
    empty = gg.gemm_fp8_blockwise_gluon(a_q[:0], sa[:0], b_q, sb)
    assert empty.shape == (0, 256)
    refused = {
        "K-contiguous": dict(a=a_q.t().contiguous().t()),  # column-major a
        "1x128 groups": dict(sa=sa[:, :1]),
        "128x128 blocks": dict(sb=sb.repeat_interleave(128, 0)),  # per-row weight scales
        "float8_e4m3fn only": dict(b=b_q.to(torch.float8_e5m2)),
    }
    for match, kw in refused.items():
        args = {**dict(a=a_q, sa=sa, b=b_q, sb=sb), **kw}
        # per-row weight scales are the wgrad path, taken unless switched off: off here
        reason = gg.gluon_blockwise_reason(args["a"], args["sa"], args["b"], args["sb"], allow_b_row_scales=False)
        assert reason is not None and match in reason, (match, reason)
        with pytest.raises(ValueError, match="gemm_fp8_blockwise_gluon"):
            gg.gemm_fp8_blockwise_gluon(args["a"], args["sa"], args["b"], args["sb"], allow_b_row_scales=False)
    # K = 200: rows of 200 bytes are not 16-byte aligned for TMA
    (a2, sa2, b2, sb2), _ = _operands(64, 128, 200, "cuda")
    assert "16-byte" in gg.gluon_blockwise_reason(a2, sa2, b2, sb2)
    # an output whose rows TMA cannot address
    bad_out = torch.empty(256, 257, device="cuda", dtype=torch.bfloat16)[:, :256]
    assert "16-byte" in gg.gluon_blockwise_reason(a_q, sa, b_q, sb, out=bad_out)


# ---------------------------------------------------------------------------------------------
# Backend registration and the default rule: GLUON for BLOCKWISE E4M3 forward-style GEMMs on sm_90
# ---------------------------------------------------------------------------------------------
def _dispatch_kw(device, M=128, N=256, K=256):
    import primus_turbo.pytorch as turbo

    (a_q, sa, b_q, sb), ref = _operands(M, N, K, device)
    kw = dict(a_q=a_q, a_scale=sa, b_q=b_q, b_scale=sb, mode=turbo.ScalingGranularity.BLOCKWISE, out=None,
              out_dtype=torch.bfloat16, accumulate=False, block_size=128)
    return kw, ref


def test_gluon_backend_default_and_pin(device):
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.backends import gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType

    assert be.gemm_fp8_dispatcher.backends[BackendType.GLUON] is be.GemmFP8GluonBackend
    assert be.GemmFP8GluonBackend.autotune is True
    assert BackendType.GLUON in be.gemm_fp8_dispatcher.default_checked
    kw, ref = _dispatch_kw(device)
    chosen = be.gemm_fp8_dispatcher.resolve(PrecisionType.FP8, **kw).backend_type
    assert chosen == (BackendType.GLUON if _ON_SM90 and gg.GLUON_AVAILABLE else BackendType.TRITON)
    assert "BLOCKWISE only" in be.GemmFP8GluonBackend.why_not(**dict(kw, mode=turbo.ScalingGranularity.ROWWISE))
    assert "accumulate" in be.GemmFP8GluonBackend.why_not(**dict(kw, accumulate=True,
                                                                 out=torch.zeros(128, 256, device=device)))
    GlobalBackendManager.set_gemm_backend(BackendType.GLUON, precision=PrecisionType.FP8)
    try:
        if not _ON_SM90:
            with pytest.raises(ValueError, match="GLUON"):
                be.gemm_fp8_dispatcher.resolve(PrecisionType.FP8, **kw)
        else:
            out = be.gemm_fp8_dispatcher.dispatch(PrecisionType.FP8, **kw)
            assert _snr(ref, out) >= 40.0
            # a pin that cannot run the inputs (E5M2 gradient) says so
            with pytest.raises(ValueError, match="backend GLUON .* cannot run these inputs: .*float8_e4m3fn only"):
                be.gemm_fp8_dispatcher.resolve(PrecisionType.FP8, **dict(kw, a_q=kw["a_q"].to(torch.float8_e5m2)))
    finally:
        GlobalBackendManager.reset()


@pytest.fixture
def fake_sm90(monkeypatch):
    """Make gluon_platform_reason answer as on an sm_90 GPU (or as ``reason``) for CPU tensors."""
    state = {"reason": None, "calls": 0}

    def platform_reason(device):
        state["calls"] += 1
        return state["reason"]

    monkeypatch.setattr(gg, "gluon_platform_reason", platform_reason)
    return state


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
@pytest.mark.skipif(not is_interpreter(), reason="the mocked rule resolves CPU tensors, which the TRITON "
                    "backend runs only under the interpreter (a GPU run covers the real rule)")
def test_default_rule_with_mocked_platform(fake_sm90):
    """The rule of backends/gemm_fp8._default without a GPU: GLUON where the Gluon reason is None,
    TRITON where the platform (not sm_90, interpreter) or the operands say no."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.backends import gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType, PrecisionType

    kw, _ = _dispatch_kw("cpu")
    G = turbo.ScalingGranularity
    assert be._default(**kw) == BackendType.GLUON
    assert be.gemm_fp8_dispatcher.resolve(PrecisionType.FP8, **kw) is be.GemmFP8GluonBackend
    assert fake_sm90["calls"] >= 1
    fake_sm90["reason"] = "the Gluon kernel is built for sm_90 (H100/H200), this GPU is sm_80"
    assert be._default(**kw) == BackendType.TRITON
    assert be.gemm_fp8_dispatcher.resolve(PrecisionType.FP8, **kw) is be.GemmFP8TritonBackend
    fake_sm90["reason"] = None
    a_q, b_q = kw["a_q"], kw["b_q"]
    refused = [
        dict(a_q=a_q.to(torch.float8_e5m2)),                                  # HYBRID dgrad: E5M2 dY
        dict(b_q=b_q.to(torch.float8_e5m2)),
        dict(accumulate=True, out=torch.zeros(128, 256)),                     # fused wgrad accumulation
        dict(mode=G.MX_BLOCKWISE),
        dict(block_size=64),
        dict(out_dtype=torch.bfloat16, b_q=b_q[:250], b_scale=kw["b_scale"]),  # N=250: bf16 rows not 16 B
        dict(a_q=torch.empty(128, 272, dtype=torch.float8_e4m3fn)[:, :264],   # K=264 rows not 16 B aligned
             a_scale=torch.ones(128, 3), b_q=torch.empty(256, 264, dtype=torch.float8_e4m3fn),
             b_scale=torch.ones(2, 3)),
    ]
    for over in refused:
        assert be._default(**dict(kw, **over)) == BackendType.TRITON, over.keys()
    # the wgrad (1x128 x 1x128): GLUON's per-row B scale path unless switched off
    assert be._default(**dict(kw, b_scale=torch.ones(256, 2))) == BackendType.GLUON
    import os
    os.environ["PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD"] = "0"
    try:
        assert be._default(**dict(kw, b_scale=torch.ones(256, 2))) == BackendType.TRITON
    finally:
        del os.environ["PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD"]
    # TENSORWISE / ROWWISE never go to GLUON (TORCH needs CUDA: TRITON on CPU)
    assert be._default(**dict(kw, mode=G.TENSORWISE)) == BackendType.TRITON


def test_platform_reason_cpu_and_interpreter(monkeypatch):
    assert "cpu" in gg.gluon_platform_reason(torch.device("cpu"))
    if gg.GLUON_AVAILABLE:
        assert "TRITON_INTERPRET" in gg._platform_reason(0, True)


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
@pytest.mark.parametrize("trans_b", [True, False])
def test_linear_dgrad_operands_are_gluon_shaped(trans_b, device, monkeypatch):
    """The BLOCKWISE E4M3 FP8 linear: the forward and the dgrad (dY 1x128 x the weight's copy that
    the op already keeps for dgrad, 128x128) and the wgrad (1x128 x 1x128, the per-row B scale
    path) are operands the Gluon kernel takes; the HYBRID dgrad and wgrad (E5M2 dY) are not. Recorded through the dispatcher on CPU."""
    from primus_turbo.pytorch.backends import gemm_fp8 as be
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
    from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8

    calls = []
    real = be.gemm_fp8_dispatcher.dispatch

    def record(precision, **kw):
        calls.append(kw)
        return real(precision, **kw)

    monkeypatch.setattr(be.gemm_fp8_dispatcher, "dispatch", record)
    M, N, K = 64, 256, 384
    for fmt, dgrad_ok in (("E4M3", True), ("HYBRID", False)):
        calls.clear()
        x = torch.randn(M, K, dtype=torch.bfloat16, device=device, requires_grad=True)
        w = (torch.randn((N, K) if trans_b else (K, N), device=device) / 16).to(torch.bfloat16).requires_grad_()
        gemm_fp8(x, w, trans_b=trans_b, config=Float8QuantConfig(format=fmt, granularity="BLOCKWISE")).sum().backward()
        assert len(calls) == 3  # forward, dgrad, wgrad

        def ok(kw):
            return gg.gluon_operand_reason(kw["a_q"], kw["a_scale"], kw["b_q"], kw["b_scale"],
                                           out_dtype=kw["out_dtype"]) is None

        fwd, dgrad, wgrad = calls
        assert tuple(fwd["a_q"].shape) == (M, K) and ok(fwd)
        assert tuple(dgrad["a_q"].shape) == (M, N) and tuple(dgrad["b_q"].shape) == (K, N)
        assert ok(dgrad) == dgrad_ok, gg.gluon_operand_reason(dgrad["a_q"], dgrad["a_scale"], dgrad["b_q"],
                                                              dgrad["b_scale"])
        # the wgrad (1x128 x 1x128): the per-row B scale path for E4M3 (HYBRID's dY is E5M2: no)
        assert ok(wgrad) == dgrad_ok
        assert gg.gluon_operand_reason(wgrad["a_q"], wgrad["a_scale"], wgrad["b_q"], wgrad["b_scale"],
                                       allow_b_row_scales=False) is not None


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
@pytest.mark.parametrize("config,out_dtype", [("n128s5", torch.bfloat16), ("n128s5x", torch.float16),
                                              ("n256s4", torch.bfloat16), ("n128s3c2", torch.float32)])
def test_launcher_arguments_bind_and_compile_for_sm90(config, out_dtype, monkeypatch, request):
    """The launcher's own arguments (host TMA descriptors, scales, strides, constexprs) go through
    the JIT's binder and compile for sm_90, with a stand-in for the CUDA driver: what the first GPU
    call would do up to the launch itself."""
    if rerun_outside_interpreter(request):
        return
    (a_q, sa, b_q, sb), _ = _operands(300, 384, 640, "cpu")
    out = torch.empty(300, 384, dtype=out_dtype)
    cfg = gg.GluonBlockwiseConfig.parse(config)
    assert cfg.check(out_dtype.itemsize) is None
    args, kwargs = gg._kernel_args(a_q, sa, b_q, sb, out, cfg)
    kernel = warmup_for_sm90(gg._gemm_fp8_blockwise_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.shared <= gg.SMEM_LIMIT
    assert kernel.metadata.num_warps == 12  # 4 + 4 consumer warps, 1 producer warp, rounded up


# ---------------------------------------------------------------------------------------------
# Per-row B scales (B_ROW_SCALES): the FP8 linear's wgrad, 1x128 x 1x128
# ---------------------------------------------------------------------------------------------
WGRAD_ENV = "PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD"


def _operands_rows(M, N, K, device):
    """a 1x128 along K, b 1x128 along K as well (sb [N, ceil(K/128)]): the wgrad's operands."""
    a_q, sa = _quant_1x128(torch.randn(M, K, device=device) * 2)
    b_q, sb = _quant_1x128(torch.randn(N, K, device=device) * 0.05)
    ref = ((a_q.double() * sa.repeat_interleave(128, 1)[:, :K].double())
           @ (b_q.double() * sb.repeat_interleave(128, 1)[:, :K].double()).T)
    return (a_q, sa, b_q, sb), ref


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
def test_row_scales_reason_follows_the_switch(monkeypatch):
    (a_q, sa, b_q, sb), _ = _operands_rows(64, 256, 384, "cpu")
    assert tuple(sb.shape) == (256, 3)
    monkeypatch.setenv(WGRAD_ENV, "0")
    reason = gg.gluon_operand_reason(a_q, sa, b_q, sb)
    assert reason is not None and "per-row" in reason and WGRAD_ENV in reason and "128x128 blocks" in reason
    assert gg.gluon_operand_reason(a_q, sa, b_q, sb, allow_b_row_scales=True) is None
    monkeypatch.delenv(WGRAD_ENV, raising=False)
    for value in (None, "auto", "1"):  # auto is on since the H200 measurement
        if value is not None:
            monkeypatch.setenv(WGRAD_ENV, value)
        assert gg.gluon_operand_reason(a_q, sa, b_q, sb) is None
    assert gg.gluon_operand_reason(a_q, sa, b_q, sb, allow_b_row_scales=False) is not None
    # still the platform's answer for CPU tensors, and other scale shapes stay refused
    assert "sm_90" in gg.gluon_blockwise_reason(a_q, sa, b_q, sb)
    assert "128x128 blocks" in gg.gluon_operand_reason(a_q, sa, b_q, sb[:, :2])
    assert "128x128 blocks" in gg.gluon_operand_reason(a_q, sa, b_q, sb.double())
    monkeypatch.setenv(WGRAD_ENV, "maybe")
    assert "ValueError" in gg.gluon_blockwise_reason(a_q, sa, b_q, sb)  # never raises


def test_row_scales_config_and_padding():
    assert gg.ROW_SCALES_DEFAULT_CONFIG.check(2, b_row_scales=True) is None
    assert gg.ROW_SCALES_REGISTER_CONFIG.check(2, b_row_scales=True) is None
    # 256-wide and pipelined tiles take the column scales through the ring (4 x BLOCK_N bytes a stage)
    for text, via_smem in (("n256s3c2", True), ("n128s5x", True), ("n128s5c2x", True), ("n256s3", True),
                           ("n128s6", False), ("n128s4c2", False)):
        cfg = gg.GluonBlockwiseConfig.parse(text)
        assert gg.row_scales_via_smem(cfg) is via_smem and cfg.check(2, b_row_scales=True) is None, text
        assert cfg.smem_bytes(2, True) == cfg.smem_bytes(2) + via_smem * cfg.stages * 4 * cfg.block_n
    for text in ("n256s4", "n128s6x"):  # fit without the scale boxes, not with them
        cfg = gg.GluonBlockwiseConfig.parse(text)
        assert cfg.check(2) is None and "with per-row B scales" in cfg.check(2, b_row_scales=True)
    assert gg.ROW_SCALES_PIPELINED_CONFIG.check(2, b_row_scales=True) is None
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cfg = gg.default_config(4096, 4096, 4096, dtype, b_row_scales=True)
        assert cfg.check(dtype.itemsize, True) is None and gg.row_scales_via_smem(cfg)
        assert cfg.block_n == 256 and (cfg == gg.ROW_SCALES_DEFAULT_CONFIG or dtype == torch.float32)
    # the scale grid's TMA descriptor: taken as is when addressable, else a 16-byte aligned copy
    if gg.GLUON_AVAILABLE:
        grid = torch.rand(3, 256)
        desc = gg._scale_grid_desc(grid, 128)
        assert desc.base is grid and list(desc.shape) == [3, 256] and list(desc.block_shape) == [1, 128]
        odd = torch.rand(3, 201)[:, :200]  # row stride 201 floats: not 16-byte aligned
        desc = gg._scale_grid_desc(odd, 256)
        assert desc.base.stride() == (200, 1) and torch.equal(desc.base, odd) and list(desc.shape) == [3, 200]
        desc = gg._scale_grid_desc(torch.rand(200, 3).t(), 128)  # [N, kb] row-major: not unit stride along N
        assert desc.base.stride(1) == 1
    assert gg.default_config(1, 1, 1, torch.bfloat16) == gg.default_config(1, 1, 1, torch.bfloat16, False)
    # row-major [N, kb] with N = 200: copied to unit stride along N, padded with zeros to 256
    sb = torch.rand(200, 3)
    p = gg._column_major_padded(sb)
    assert torch.equal(p, sb) and p.stride() == (1, 256)
    assert torch.all(p.as_strided((3, 256), (256, 1))[:, 200:] == 0)
    # the transpose of a [kb, N] grid with N % 128 == 0 is taken as is
    sb_t = torch.rand(3, 256).t()
    assert gg._column_major_padded(sb_t) is sb_t
    assert gg._is_b_row_scales(torch.ones(256, 3), 256, 384)
    assert not gg._is_b_row_scales(torch.ones(2, 3), 256, 384)
    assert not gg._is_b_row_scales(torch.ones(1, 3), 1, 384)  # N = 1: one block, one row


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
@pytest.mark.parametrize("out_dtype,config", [("bf16", None), ("fp32", None), ("bf16", "n128s5"), ("bf16", "n128s4c2"),
                                              ("bf16", "n128s6"), ("bf16", "n256s3c2"), ("fp32", "n256s3"),
                                              ("bf16", "n128s5x"), ("bf16", "n128s5c2xr240w24"), ("fp32", "n128s4x")])
def test_row_scales_compile_for_sm90_without_spills(out_dtype, config, request):
    """The B_ROW_SCALES path compiles for sm_90 without spills or wgmma serialization, the register
    path (n128 not pipelined) and the shared-memory one (n256, pipelined: a fourth TMA load, the
    column scales)."""
    if rerun_outside_interpreter(request):
        return
    dtype = torch.bfloat16 if out_dtype == "bf16" else torch.float32
    cfg = gg.GluonBlockwiseConfig.parse(config) if config else gg.default_config(4096, 4096, 4096, dtype, True)
    assert cfg.check(dtype.itemsize, b_row_scales=True) is None
    res = compile_report(cfg, out_dtype, row_scales=True)
    counts = res["sass_counts"]
    if any(counts.values()):
        assert counts["tma_load"] == (4 if gg.row_scales_via_smem(cfg) else 3), counts
        assert counts["local_store"] == 0 and counts["local_load"] == 0, counts


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
@pytest.mark.parametrize("N,config", [(384, None), (200, None), (200, "n128s6"), (200, "n256s3c2")])
def test_row_scales_launcher_arguments_bind_and_compile_for_sm90(N, config, monkeypatch, request):
    """The launcher's B_ROW_SCALES arguments bind and compile for sm_90: padded unit-stride scales
    (register path) or the scale grid's TMA descriptor (shared-memory path)."""
    if rerun_outside_interpreter(request):
        return
    (a_q, sa, b_q, sb), _ = _operands_rows(300, N, 640, "cpu")
    out = torch.empty(300, N, dtype=torch.bfloat16)
    cfg = gg.GluonBlockwiseConfig.parse(config) if config else gg.default_config(300, N, 640, torch.bfloat16, True)
    args, kwargs = gg._kernel_args(a_q, sa, b_q, sb, out, cfg)
    assert kwargs["B_ROW_SCALES"] is True
    assert_row_scales_arg(args, kwargs, "sb_desc", cfg, [5, N], sb.t())
    kernel = warmup_for_sm90(gg._gemm_fp8_blockwise_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.shared <= gg.SMEM_LIMIT


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
@pytest.mark.skipif(not is_interpreter(), reason="the mocked rule resolves CPU tensors, which the TRITON "
                    "backend runs only under the interpreter (a GPU run covers the real rule)")
def test_default_rule_row_scales_switch(fake_sm90, monkeypatch):
    """The wgrad (1x128 x 1x128) goes to GLUON only with the switch on, and never with accumulation
    or an E5M2 gradient."""
    from primus_turbo.pytorch.backends import gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType

    kw, _ = _dispatch_kw("cpu")
    (a_q, sa, b_q, sb), _ = _operands_rows(128, 256, 256, "cpu")
    kw = dict(kw, a_q=a_q, a_scale=sa, b_q=b_q, b_scale=sb)
    monkeypatch.delenv(WGRAD_ENV, raising=False)
    assert be._default(**kw) == BackendType.GLUON
    monkeypatch.setenv(WGRAD_ENV, "0")
    assert be._default(**kw) == BackendType.TRITON
    monkeypatch.setenv(WGRAD_ENV, "1")
    assert be._default(**kw) == BackendType.GLUON
    assert be._default(**dict(kw, accumulate=True, out=torch.zeros(128, 256))) == BackendType.TRITON
    assert be._default(**dict(kw, a_q=a_q.to(torch.float8_e5m2))) == BackendType.TRITON


@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
@pytest.mark.parametrize("trans_b", [True, False])
def test_linear_wgrad_operands_take_row_scales_with_switch(trans_b, device, monkeypatch):
    """With PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD=1 the E4M3 BLOCKWISE linear's wgrad operands are ones
    the Gluon kernel takes (per-row B scales); the fused main_grad accumulation is not."""
    from primus_turbo.pytorch.backends import gemm_fp8 as be
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
    from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8

    calls = []
    real = be.gemm_fp8_dispatcher.dispatch

    def record(precision, **kw):
        calls.append(kw)
        return real(precision, **kw)

    monkeypatch.setattr(be.gemm_fp8_dispatcher, "dispatch", record)
    monkeypatch.setenv(WGRAD_ENV, "1")
    M, N, K = 256, 384, 256
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = (torch.randn((N, K) if trans_b else (K, N), device=device) / 16).to(torch.bfloat16).requires_grad_()
    gemm_fp8(x, w, trans_b=trans_b, config=Float8QuantConfig(format="E4M3", granularity="BLOCKWISE")).sum().backward()
    assert len(calls) == 3
    wgrad = calls[2]
    assert not wgrad["accumulate"]
    assert gg._is_b_row_scales(wgrad["b_scale"], wgrad["b_q"].shape[0], wgrad["b_q"].shape[1])
    assert gg.gluon_operand_reason(wgrad["a_q"], wgrad["a_scale"], wgrad["b_q"], wgrad["b_scale"],
                                   out_dtype=wgrad["out_dtype"]) is None
    assert be.GemmFP8GluonBackend.why_not(**dict(wgrad, accumulate=True, out=torch.zeros(
        wgrad["a_q"].shape[0], wgrad["b_q"].shape[0], device=device))) is not None


ROW_SHAPES = [(256, 256, 256), (300, 200, 384), (130, 136, 336), (1, 256, 512), (520, 384, 256), (2048, 1536, 1024)]


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, "n128s5", "n128s3g1c2", "n128s6", "n256s3c2", "n128s3g1x"])
@pytest.mark.parametrize("M,N,K", ROW_SHAPES)
def test_row_scales_match_reference(M, N, K, config):
    (a_q, sa, b_q, sb), ref = _operands_rows(M, N, K, "cuda")
    assert gg.gluon_blockwise_reason(a_q, sa, b_q, sb, allow_b_row_scales=True) is None
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    cfg = gg.GluonBlockwiseConfig.parse(config) if config else None
    gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out=out, config=cfg, allow_b_row_scales=True)
    assert not torch.isnan(out).any(), "unwritten output elements"
    assert _snr(ref, out) >= MIN_SNR[torch.bfloat16], (M, N, K, config)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_scales_match_triton_kernel(out_dtype):
    from primus_turbo.triton.gemm.gemm_fp8_kernel import gemm_fp8_triton

    M, N, K = 384, 640, 1024
    (a_q, sa, b_q, sb), ref = _operands_rows(M, N, K, "cuda")
    out = gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out_dtype=out_dtype, allow_b_row_scales=True)
    assert _snr(ref, out) >= MIN_SNR[out_dtype]
    tl_out = gemm_fp8_triton(a_q, sa, b_q, sb, "BLOCKWISE", out_dtype=out_dtype)
    assert _snr(tl_out.double(), out) >= MIN_SNR[out_dtype]
    # the same scales stored [kb, N] (a transposed view: used without a copy) give the same bits
    sb_t = sb.t().contiguous().t()
    assert torch.equal(gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb_t, out_dtype=out_dtype,
                                                   allow_b_row_scales=True), out)
    with pytest.raises(ValueError, match="with per-row B scales"):  # fits without the scale boxes only
        gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, config=gg.GluonBlockwiseConfig.parse("n256s4"),
                                    allow_b_row_scales=True)
    # every B_ROW_SCALES schedule runs the same promotions in the same order: the same bits
    for text in ("n128s6", "n256s3", "n128s4x", "n128s5xr240w24"):
        cfg = gg.GluonBlockwiseConfig.parse(text)
        if cfg.check(out.element_size(), True) is None:
            assert torch.equal(gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out_dtype=out_dtype, config=cfg,
                                                           allow_b_row_scales=True), out), text
    with pytest.raises(ValueError, match=WGRAD_ENV):
        gg.gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, allow_b_row_scales=False)


@sm90
@pytest.mark.gpu
def test_row_scales_linear_wgrad_through_dispatch(monkeypatch):
    """The E4M3 BLOCKWISE linear with the switch on: the wgrad runs GLUON and matches the TRITON wgrad."""
    from primus_turbo.pytorch.backends import gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
    from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8

    chosen = []
    real = be.gemm_fp8_dispatcher.resolve

    def record(precision, **kw):
        impl = real(precision, **kw)
        chosen.append(impl.backend_type)
        return impl

    monkeypatch.setattr(be.gemm_fp8_dispatcher, "resolve", record)
    torch.manual_seed(0)
    x = torch.randn(512, 768, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(640, 768, device="cuda") / 16).to(torch.bfloat16)
    cfg = Float8QuantConfig(format="E4M3", granularity="BLOCKWISE")
    grads = {}
    for value in ("0", "1"):
        monkeypatch.setenv(WGRAD_ENV, value)
        wv = w.clone().requires_grad_()
        chosen.clear()
        gemm_fp8(x, wv, trans_b=True, config=cfg).float().pow(2).sum().backward()
        grads[value] = wv.grad.float()
        assert chosen[-1] == (BackendType.GLUON if value == "1" else BackendType.TRITON), (value, chosen)
    assert _snr(grads["0"], grads["1"]) >= 40.0


# ---------------------------------------------------------------------------------------------
# The prepared launch (triton/launch.launch_prepared)
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not gg.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
def test_prepared_key_covers_the_launch_arguments():
    """``_prepared_key``: the pointers cover every tensor and descriptor base among the kernel's
    arguments (else launch_prepared keeps nothing); new tensors of the same signature give the same
    key and their own pointers; another M or a misaligned output give another key; per-row B scales
    that ``_kernel_args`` would copy or stage through a keyword descriptor take the plain launch."""
    from primus_turbo.triton import launch as L

    M, N, K = 200, 256, 384
    cfg = gg.default_config(M, N, K, torch.bfloat16)
    (a, sa, b, sb), _ = _operands(M, N, K, "cpu")
    out = torch.empty(M, N, dtype=torch.bfloat16)
    assert not gg._is_b_row_scales(sb, N, K)  # block scales: the flag _launch passes
    key, ptrs = gg._prepared_key(a, sa, b, sb, out, cfg, False)
    args, kwargs = gg._kernel_args(a, sa, b, sb, out, cfg)
    assert L._pointers_of(args) and L._pointers_of(args) <= set(ptrs) and "sb_desc" not in kwargs
    hash(key)
    (a2, sa2, b2, sb2), _ = _operands(M, N, K, "cpu")
    out2 = torch.empty(M, N, dtype=torch.bfloat16)
    key2, ptrs2 = gg._prepared_key(a2, sa2, b2, sb2, out2, cfg, False)
    assert key2 == key and ptrs2 != ptrs
    (a3, sa3, b3, sb3), _ = _operands(M + 8, N, K, "cpu")
    assert gg._prepared_key(a3, sa3, b3, sb3, torch.empty(M + 8, N, dtype=torch.bfloat16), cfg, False)[0] != key
    raw = torch.empty(out.numel() + 8, dtype=out.dtype)
    shifted = raw[1:1 + out.numel()].view(out.shape)  # 2 bytes past a 16-byte boundary
    assert gg._prepared_key(a, sa, b, sb, shifted, cfg, False)[0] != key
    assert gg._prepared_key(a, sa, b, sb, out, gg.GluonBlockwiseConfig.parse("n128s5"), False)[0] != key
    # per-row B scales (the wgrad): column-major with N % 128 == 0, read from registers: prepared
    (ar, sar, br, sbr), _ = _operands_rows(M, N, K, "cpu")
    regs = gg.GluonBlockwiseConfig.parse("n128s6")
    col = sbr.t().contiguous().t()  # [N, kb], unit stride along N
    assert gg._is_b_row_scales(col, N, K) and gg._is_b_row_scales(sbr, N, K)
    key_r, ptrs_r = gg._prepared_key(ar, sar, br, col, out, regs, True)
    args_r, kwargs_r = gg._kernel_args(ar, sar, br, col, out, regs)
    assert kwargs_r["B_ROW_SCALES"] and "sb_desc" not in kwargs_r and args_r[4] is col
    assert L._pointers_of(args_r) <= set(ptrs_r) and key_r != key
    # ... row-major (copied by _kernel_args), staged through shared memory, or N not whole blocks: not
    assert gg._prepared_key(ar, sar, br, sbr, out, regs, True) is None
    assert gg._prepared_key(ar, sar, br, col, out, gg.GluonBlockwiseConfig.parse("n256s3c2"), True) is None
    (ao, sao, bo, sbo), _ = _operands_rows(M, 200, K, "cpu")
    assert gg._prepared_key(ao, sao, bo, sbo.t().contiguous().t(), torch.empty(M, 200, dtype=torch.bfloat16),
                            regs, True) is None


@sm90
@pytest.mark.gpu
def test_prepared_launches_follow_the_pointers():
    """Block scales and register-read per-row scales through the prepared path: a signature's first
    call, repeats on the same tensors (a kept list) and new tensors of the same signature all match
    the reference and a launch with the kept lists cleared; the kept lists hold no tensor (freed
    operands are freed)."""
    from primus_turbo.triton import launch as L

    M, N, K = 384, 512, 1024
    regs = gg.GluonBlockwiseConfig.parse("n128s6")

    def run_once(check: bool):
        (a, sa, b, sb), ref = _operands(M, N, K, "cuda")
        (ar, sar, br, sbr), ref_r = _operands_rows(M, N, K, "cuda")
        col = sbr.t().contiguous().t()
        assert gg._prepared_key(a, sa, b, sb, torch.empty(M, N, dtype=torch.bfloat16, device="cuda"),
                                gg.default_config(M, N, K, torch.bfloat16), False) is not None
        for _ in range(2):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gg.gemm_fp8_blockwise_gluon(a, sa, b, sb, out=out)
            out_r = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gg.gemm_fp8_blockwise_gluon(ar, sar, br, col, out=out_r, config=regs, allow_b_row_scales=True)
            if check:
                saved = dict(L._PREPARED)
                L._PREPARED.clear()
                fresh = gg.gemm_fp8_blockwise_gluon(a, sa, b, sb)
                fresh_r = gg.gemm_fp8_blockwise_gluon(ar, sar, br, col, config=regs, allow_b_row_scales=True)
                L._PREPARED.update(saved)
                assert _snr(ref, out) >= MIN_SNR[torch.bfloat16] and torch.equal(fresh, out)
                assert _snr(ref_r, out_r) >= MIN_SNR[torch.bfloat16] and torch.equal(fresh_r, out_r)

    run_once(check=True)  # the references' cuBLAS workspace, kept for the process
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        run_once(check=False)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    run_once(check=True)
    kept = [rec for key, rec in L._PREPARED.items() if key[0] == id(gg._gemm_fp8_blockwise_ws_kernel)]
    assert kept and all(not isinstance(v, torch.Tensor) for rec in kept for v in rec[1])
