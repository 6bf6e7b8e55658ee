"""turbo.ops.grouped_gemm_fp8 (MoE experts in FP8) against float64 references on the unquantized
inputs: forward and both gradients for TENSORWISE / ROWWISE / BLOCKWISE x E4M3 / E5M2 / HYBRID,
1 to 32 experts with balanced, unbalanced and empty groups, both weight layouts, issue 4's (N, K)
pairs (GPU); the zeroed tail, Megatron's fused wgrad accumulation, repeatability, bad input, and (on
the GPU) proof that no host synchronisation happens. BLOCKWISE's FP8 wgrad (per-group-segment 1 x 128
token blocks on the padded layout) with groups longer than a block and not multiples of it.
MX_BLOCKWISE (emulated MXFP8, per-group-segment wgrad blocks) at small shapes; the TORCH backend
(torch._scaled_grouped_mm) against TRITON on the GPU."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo  # noqa: F401  (the package must import cleanly)
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8
from primus_turbo.testing import grouped_gemm_ref, grouped_gemm_variable_k_ref, snr_db
from tests.grouped_gemm_checks import check_compiled_matches_eager, check_grouped_op

ON_GPU = torch.cuda.is_available()
GRANS = [ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE, ScalingGranularity.BLOCKWISE]
MX = ScalingGranularity.MX_BLOCKWISE
FORMATS = [Format.E4M3, Format.E5M2, Format.HYBRID]
MIN_SNR = {Format.E4M3: 25.0, Format.E5M2: 20.0, Format.HYBRID: 20.0}
CASES = [  # (group lens, N, K)
    ([64], 64, 128),
    ([20, 0, 41], 96, 256),
    ([0, 64, 3, 0, 9, 33, 0, 1], 64, 128),
    ([16] * 8, 96, 256),
    ([0, 0, 0], 64, 128),
]


def _cfg(gran, fmt=Format.E4M3):
    return Float8QuantConfig(format=fmt, granularity=gran)


def _make(lens, n, k, trans_b, device, dtype=torch.bfloat16, extra_rows=0):
    G = len(lens)
    a = torch.randn(sum(lens) + extra_rows, k, dtype=dtype, device=device)
    b = torch.randn((G, n, k) if trans_b else (G, k, n), dtype=dtype, device=device) * k ** -0.5
    return a, b, torch.tensor(lens, dtype=torch.int64, device=device)


def _check(a, b, gl, trans_b, config, min_snr, out_dtype=None):
    check_grouped_op(grouped_gemm_fp8, a, b, gl, trans_b, min_snr, out_dtype, config=config)


def _params():
    i = 0
    for gran in GRANS:
        for fmt in FORMATS:
            for trans_b in (True, False):
                lens, n, k = CASES[i % len(CASES)]
                i += 1
                yield pytest.param(gran, fmt, trans_b, lens, n, k,
                                   id=f"{gran.name}-{fmt.name}-{'NT' if trans_b else 'NN'}-G{len(lens)}-{n}x{k}")


@pytest.mark.parametrize("gran, fmt, trans_b, lens, n, k", list(_params()))
def test_grouped_gemm_fp8(gran, fmt, trans_b, lens, n, k, device):
    a, b, gl = _make(lens, n, k, trans_b, device)
    _check(a, b, gl, trans_b, _cfg(gran, fmt), MIN_SNR[fmt])


def _many_groups_cases():
    """G = 16 and 32. GPU: every granularity, 128 to 2048 rows a group (one of 2048) at expert
    sizes. CPU: two cases at small (N, K), the interpreter walking every group in every program
    (about a second each; BLOCKWISE and MX cost 2-4 s at G = 32 and run on the GPU)."""
    if ON_GPU:
        for G, (n, k) in ((16, (2048, 1408)), (32, (1408, 2048))):
            lens = [2048] + [128 + (i * 977) % 1921 for i in range(1, G)]
            for gran in GRANS + [MX]:
                yield pytest.param(lens, n, k, gran, Format.E4M3, True, id=f"G{G}-{gran.name}-{n}x{k}")
        return
    yield pytest.param([(i * 7) % 11 for i in range(16)], 32, 64, ScalingGranularity.TENSORWISE, Format.E4M3, True,
                       id="G16-TENSORWISE-E4M3-NT")
    yield pytest.param([(i * 5) % 9 for i in range(32)], 16, 32, ScalingGranularity.ROWWISE, Format.HYBRID, False,
                       id="G32-ROWWISE-HYBRID-NN")


@pytest.mark.parametrize("lens, n, k, gran, fmt, trans_b", list(_many_groups_cases()))
def test_grouped_gemm_fp8_many_groups(lens, n, k, gran, fmt, trans_b, device):
    """Issue 4's 16 and 32 experts, with empty groups on CPU and tail rows: forward and both
    gradients against float64 at the format's bar, the empty groups' weight gradients zero."""
    a, b, gl = _make(lens, n, k, trans_b, device, extra_rows=3)
    _check(a, b, gl, trans_b, _cfg(gran, fmt), MIN_SNR[fmt])


ISSUE_NK = [(2048, 1536), (2048, 1408), (1408, 2048), (4096, 7168), (7168, 2048), (5120, 1536)]


@pytest.mark.gpu
@pytest.mark.parametrize("gran", GRANS, ids=lambda g: g.name)
@pytest.mark.parametrize("n, k", ISSUE_NK, ids=[f"{n}x{k}" for n, k in ISSUE_NK])
def test_issue_nk_pairs(n, k, gran, device):
    """Issue 4's expert (N, K) pairs (K = 1408 = 11 x 128: not a multiple of 256) in the weight layout
    the op defaults to, 128 to 2048 rows a group with an empty one and tail rows, E4M3."""
    a, b, gl = _make([2048, 0, 977, 128, 1500, 300, 2048, 640], n, k, True, device, extra_rows=5)
    _check(a, b, gl, True, _cfg(gran), MIN_SNR[Format.E4M3])


@pytest.mark.parametrize("gran", GRANS, ids=lambda g: g.name)
def test_zeroed_tail_fp32_and_out_dtype(gran, device):
    # a holds more rows than were routed: those output and grad_input rows must be exactly 0
    for _ in range(2):
        a, b, gl = _make([10, 0, 21], 64, 96, True, device, dtype=torch.float32, extra_rows=40)
        _check(a, b, gl, True, _cfg(gran), MIN_SNR[Format.E4M3], out_dtype=torch.bfloat16)


@pytest.mark.parametrize("gran", GRANS, ids=lambda g: g.name)
def test_megatron_fused_accumulation(gran, device):
    lens_per_step = [[20, 0, 31], [5, 40, 2], [0, 0, 64]]
    k, n = 128, 64
    b = (torch.randn((3, n, k), dtype=torch.bfloat16, device=device) * k ** -0.5).requires_grad_()
    b.main_grad = torch.randn(b.shape, dtype=torch.float32, device=device)
    start = b.main_grad.double().clone()
    expected = start.clone()
    for lens in lens_per_step:  # three micro-batches accumulate into main_grad
        gl = torch.tensor(lens, dtype=torch.int64, device=device)
        a = torch.randn(sum(lens), k, dtype=torch.bfloat16, device=device, requires_grad=True)
        out = grouped_gemm_fp8(a, b, gl, config=_cfg(gran), fuse_bgrad_accum_pattern="megatron")
        dc = torch.randn_like(out)
        out.backward(dc)
        expected += grouped_gemm_variable_k_ref(dc, a, gl)
        assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=False), a.grad) >= 25.0
        b.grad = None
    assert b.grad_added_to_main_grad is True
    assert snr_db(expected - start, b.main_grad.double() - start) >= 25.0


@pytest.mark.parametrize("gran", GRANS + [MX], ids=lambda g: g.name)
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_torch_compile_fullgraph_matches_eager(gran, fuse, device):
    """torch.compile(fullgraph=True) traces the op whole (its GEMMs are custom ops with shape-only
    fakes): the output and both gradients (or main_grad's accumulation) equal eager's bit for bit,
    with an empty group and rows past the groups, HYBRID's E5M2 gradient."""
    torch.manual_seed(31)
    cfg = Float8QuantConfig(format=Format.HYBRID, granularity=gran,
                            block_size=32 if gran == ScalingGranularity.BLOCKWISE else None)
    a0 = torch.randn(100, 64, dtype=torch.bfloat16, device=device)
    b0 = torch.randn(3, 96, 64, dtype=torch.bfloat16, device=device) * 0.125
    gl = torch.tensor([32, 0, 61], dtype=torch.int64, device=device)
    check_compiled_matches_eager(grouped_gemm_fp8, a0, b0, gl, fuse, config=cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU code generation")
@pytest.mark.parametrize("gran", GRANS + [MX], ids=lambda g: g.name)
def test_inductor_matches_eager_gpu(gran):
    """The default compile backend on the GPU: inductor generates the glue between the custom ops.
    torch 2.11's inductor got the padded token layout (searchsorted, where) wrong on CUDA, and the
    BLOCKWISE / MX weight gradients read 4-8 dB against eager until the layout became a custom op."""
    torch.manual_seed(33)
    cfg = Float8QuantConfig(granularity=gran)
    a0 = torch.randn(1032, 256, dtype=torch.bfloat16, device="cuda")
    b0 = torch.randn(8, 1024, 256, dtype=torch.bfloat16, device="cuda") * 0.0625
    gl = torch.tensor([200, 0, 97, 128, 300, 50, 149, 100], dtype=torch.int64, device="cuda")
    torch._dynamo.reset()
    check_compiled_matches_eager(grouped_gemm_fp8, a0, b0, gl, False, backend="inductor", config=cfg)


def test_bitwise_repeatable(device):
    a, b, gl = _make([0, 64, 3, 0, 9, 33, 0, 1], 64, 128, True, device)
    for gran in GRANS:
        results = []
        for _ in range(2):
            x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
            out = grouped_gemm_fp8(x, w, gl, config=_cfg(gran))
            out.backward(torch.ones_like(out))
            results.append((out, x.grad, w.grad))
        for r0, r1 in zip(*results):
            assert torch.equal(r0, r1)


def test_no_grad_offsets_and_num_cu(device):
    a, b, gl = _make([5, 40, 0, 19], 64, 128, True, device)
    offs = torch.zeros(5, dtype=torch.int64, device=device)
    offs[1:] = gl.cumsum(0)
    ref = grouped_gemm_ref(a, b, gl, trans_b=True)
    with torch.no_grad():
        outs = [grouped_gemm_fp8(a, b, gl, group_offs=offs, num_cu=c) for c in (None, 1)]
    for out in outs:
        assert snr_db(ref, out) >= 25.0 and not out.requires_grad
    assert torch.equal(outs[0], outs[1])


SINGLE_GRAD_CFGS = [(ScalingGranularity.TENSORWISE, Format.E4M3, True),
                    (ScalingGranularity.ROWWISE, Format.E4M3, False), (ScalingGranularity.BLOCKWISE, Format.E4M3, True), (MX, Format.E4M3, False),
                    (ScalingGranularity.ROWWISE, Format.HYBRID, True)]


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("gran, fmt, trans_b", SINGLE_GRAD_CFGS,
                         ids=[f"{g.name}-{f.name}-{'NT' if t else 'NN'}" for g, f, t in SINGLE_GRAD_CFGS])
def test_single_operand_grad(gran, fmt, trans_b, which, device):
    """Only a (frozen weight) or only b (first layer) requires grad: that gradient against the fp64
    reference at the format's bar, bit-identical to the one computed when both require grad; the
    tail rows of dA and the empty group's dB exactly zero; the no-grad forward against fp64."""
    lens, extra = [20, 0, 41], 5
    a, b, gl = _make(lens, 64, 128, trans_b, device, extra_rows=extra)
    cfg, bar, routed = _cfg(gran, fmt), MIN_SNR[fmt], sum(lens)
    with torch.no_grad():
        out = grouped_gemm_fp8(a, b, gl, trans_b=trans_b, config=cfg)
    assert not out.requires_grad and not out[routed:].any()
    assert snr_db(grouped_gemm_ref(a, b, gl, trans_b), out) >= MIN_SNR[Format.E4M3]  # E4M3 forward operands
    dc = torch.randn_like(out)
    x, w = a.clone().requires_grad_(which == "a"), b.clone().requires_grad_(which == "b")
    y = grouped_gemm_fp8(x, w, gl, trans_b=trans_b, config=cfg)
    assert torch.equal(y.detach(), out)
    y.backward(dc)
    x2, w2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    grouped_gemm_fp8(x2, w2, gl, trans_b=trans_b, config=cfg).backward(dc)
    if which == "a":
        assert w.grad is None and x.grad.shape == a.shape and x.grad.dtype == a.dtype
        assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=not trans_b), x.grad) >= bar
        assert torch.equal(x.grad[routed:], torch.zeros_like(x.grad[routed:]))
        assert torch.equal(x.grad, x2.grad)
    else:
        assert x.grad is None and w.grad.shape == b.shape and w.grad.dtype == b.dtype
        ref_db = grouped_gemm_variable_k_ref(dc, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, dc, gl)
        assert snr_db(ref_db, w.grad) >= bar
        assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))  # the empty group
        assert torch.equal(w.grad, w2.grad)


def test_empty_shapes(device):
    a, b, gl = _make([0, 0], 64, 128, True, device)  # M = 0
    a.requires_grad_()
    b.requires_grad_()
    out = grouped_gemm_fp8(a, b, gl)
    assert out.shape == (0, 64)
    out.sum().backward()
    assert b.grad.shape == b.shape and not b.grad.any()


def test_bad_inputs(device):
    a, b, gl = _make([3, 4], 64, 128, True, device)
    with pytest.raises(TypeError, match="int64"):
        grouped_gemm_fp8(a, b, gl.int())
    if device == "cuda":
        with pytest.raises(ValueError, match="device"):
            grouped_gemm_fp8(a, b, gl.cpu())
    else:
        with pytest.raises(ValueError, match="device"):
            grouped_gemm_fp8(a, b, gl.to("meta"))
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_gemm_fp8(a[:, :64], b, gl)
    with pytest.raises(ValueError, match="G=2"):
        grouped_gemm_fp8(a, b, torch.tensor([7], dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="entries"):
        grouped_gemm_fp8(a, b, gl, group_offs=gl)
    with pytest.raises(ValueError, match="K to be a multiple of 32"):  # K = 128 - 16
        grouped_gemm_fp8(a[:, :112], b[:, :, :112], gl, config=_cfg(MX))
    with pytest.raises(ValueError, match="block_size >= 32, got 16"):
        grouped_gemm_fp8(a, b, gl, config=Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=16))
    with pytest.raises(TypeError, match="dtype"):
        grouped_gemm_fp8(a.to(torch.float8_e4m3fn), b, gl)
    with pytest.raises(TypeError, match="config"):
        grouped_gemm_fp8(a, b, gl, config="TENSORWISE")
    with pytest.raises(ValueError, match="fuse_bgrad_accum_pattern"):
        grouped_gemm_fp8(a, b, gl, fuse_bgrad_accum_pattern="deepspeed")
    with pytest.raises(ValueError, match="main_grad"):
        grouped_gemm_fp8(a, b.clone().requires_grad_(), gl, fuse_bgrad_accum_pattern="megatron")


def test_bad_shapes_dtypes_and_num_cu(device):
    a, b, gl = _make([3, 4], 64, 128, True, device)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8: a must be 2-D, got shape \(896,\)"):
        grouped_gemm_fp8(a.reshape(-1), b, gl)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8: b must be 3-D, got shape \(128, 128\)"):
        grouped_gemm_fp8(a, b.reshape(-1, 128), gl)
    with pytest.raises(TypeError, match=r"same dtype, got a=torch.bfloat16, b=torch.float32"):
        grouped_gemm_fp8(a, b.float(), gl)
    with pytest.raises(TypeError, match=r"out_dtype must be float32, float16, bfloat16 or None, got torch.int32"):
        grouped_gemm_fp8(a, b, gl, out_dtype=torch.int32)
    for bad in (0, -2, 1.5, "4", True):
        with pytest.raises(ValueError, match=rf"grouped_gemm_fp8: num_cu must be None or a positive int, got {bad!r}"):
            grouped_gemm_fp8(a, b, gl, num_cu=bad)


@pytest.mark.parametrize("trans_b", [True, False], ids=["NT", "NN"])
def test_zero_experts(trans_b, device):
    """G = 0 (no expert, group_lens empty): an all-zero [M, N] output, zero dA, an empty dB."""
    a = torch.randn(7, 64, dtype=torch.bfloat16, device=device)
    b = torch.randn((0, 32, 64) if trans_b else (0, 64, 32), dtype=torch.bfloat16, device=device)
    gl = torch.zeros(0, dtype=torch.int64, device=device)
    for gran in (ScalingGranularity.TENSORWISE, MX):
        with torch.no_grad():
            out = grouped_gemm_fp8(a, b, gl, trans_b=trans_b, config=_cfg(gran), out_dtype=torch.float32)
        assert torch.equal(out, torch.zeros(7, 32, dtype=torch.float32, device=device))
        x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = grouped_gemm_fp8(x, w, gl, trans_b=trans_b, config=_cfg(gran))
        assert torch.equal(out, torch.zeros(7, 32, dtype=torch.bfloat16, device=device))
        out.backward(torch.randn_like(out))
        assert torch.equal(x.grad, torch.zeros_like(a)) and w.grad.shape == b.shape


@pytest.mark.gpu
@pytest.mark.parametrize("gran", GRANS, ids=lambda g: g.name)
def test_no_host_sync(gran, device):
    a, b, gl = _make([256, 0, 100, 700], 512, 256, True, device)
    a.requires_grad_()
    b.requires_grad_()
    for _ in range(2):  # warm up (compile, configs) with the exact call below
        out = grouped_gemm_fp8(a, b, gl, config=_cfg(gran, Format.HYBRID))
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_gemm_fp8(a, b, gl, config=_cfg(gran, Format.HYBRID))
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_backend_pin(device):
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="FP8")
    a, b, gl = _make([5, 11], 64, 128, True, device)
    assert snr_db(grouped_gemm_ref(a, b, gl, True), grouped_gemm_fp8(a, b, gl)) >= 25.0


# ----------------------------------------------------------------------------------------------
# BLOCKWISE grad_weight in FP8: 1 x 128 token blocks per group segment (padded layout)
# ----------------------------------------------------------------------------------------------
BW = ScalingGranularity.BLOCKWISE
BW_CASES = [  # (group lens, N, K, trans_b, format, input dtype, extra tail rows): blocks of 128 tokens
    ([300], 64, 128, True, Format.E4M3, torch.bfloat16, 0),  # 2 full blocks + a partial one
    ([130, 0, 77], 96, 64, False, Format.E5M2, torch.bfloat16, 5),  # unbalanced, empty, not multiples of 128
    ([0, 129, 3], 64, 128, True, Format.HYBRID, torch.float32, 7),  # E5M2 dC, fp32 inputs, tail rows
]


@pytest.mark.parametrize("lens, n, k, trans_b, fmt, dtype, extra", BW_CASES,
                         ids=[f"G{len(c[0])}-{c[0]}-{'NT' if c[3] else 'NN'}-{c[4].name}" for c in BW_CASES])
def test_grouped_gemm_fp8_blockwise_wgrad(lens, n, k, trans_b, fmt, dtype, extra, device):
    a, b, gl = _make(lens, n, k, trans_b, device, dtype=dtype, extra_rows=extra)
    _check(a, b, gl, trans_b, _cfg(BW, fmt), MIN_SNR[fmt])


def _segment_blockwise_wgrad(dc, a, lens, fp8_dc, fp8_a, bs=128):
    """float64 dC^T @ a per group, each operand quantized along the tokens in bs-token blocks of its
    own group segment (zero-padded to a multiple of bs): what the FP8 BLOCKWISE wgrad computes."""
    from primus_turbo.pytorch.ops.quantization import quantize_fp8

    def deq(x, dtype):
        seg = x.new_zeros(-(-x.shape[0] // bs) * bs, x.shape[1])
        seg[: x.shape[0]] = x
        q, sc = quantize_fp8(seg, dtype, BW, block_size=bs, axis=0)
        return q.double() * sc.double().repeat_interleave(bs, 0)

    out, s = [], 0
    for n in lens:
        if n == 0:
            out.append(torch.zeros(dc.shape[1], a.shape[1], dtype=torch.float64, device=dc.device))
        else:
            out.append(deq(dc[s:s + n], fp8_dc).t() @ deq(a[s:s + n], fp8_a))
        s += n
    return torch.stack(out)


def test_grouped_gemm_fp8_blockwise_wgrad_is_fp8(device, monkeypatch):
    """The BLOCKWISE wgrad runs the FP8 variable-K kernel in BLOCKWISE mode on 128-aligned group
    offsets (E5M2 dC under HYBRID), its result is the product of the per-segment quantized
    operands, and it is no longer the bf16 product (whose SNR against fp64 is far higher)."""
    import importlib

    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as backends

    ops_mod = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")
    calls = []
    real = ops_mod._dispatch

    def spy(dispatcher, envs, kw):
        if dispatcher is backends.grouped_gemm_fp8_variable_k_dispatcher:
            calls.append(dict(mode=str(kw["mode"]), x=kw["x_t"].dtype, y=kw["y_t"].dtype, bs=kw.get("block_size"),
                              offs=kw["group_offs"].clone(), sx=kw["x_scale"].shape, m=kw["x_t"].shape[1]))
        return real(dispatcher, envs, kw)

    monkeypatch.setattr(ops_mod, "_dispatch", spy)
    lens = [150, 0, 40]
    a, b, gl = _make(lens, 64, 128, True, device, extra_rows=3)
    a.requires_grad_()
    b.requires_grad_()
    out = grouped_gemm_fp8(a, b, gl, config=_cfg(BW, Format.HYBRID))
    dc = torch.randn_like(out)
    out.backward(dc)
    assert len(calls) == 1
    c = calls[0]
    assert c["mode"] == "BLOCKWISE" and c["bs"] == 128
    assert c["x"] == torch.float8_e5m2 and c["y"] == torch.float8_e4m3fn  # NT: x = dC^T (E5M2), y = a^T
    assert c["offs"].tolist() == [0, 256, 256, 384] and c["m"] % 128 == 0 and c["sx"] == (64, c["m"] // 128)
    ref = grouped_gemm_variable_k_ref(dc, a, gl)
    snr = snr_db(ref, b.grad)
    assert MIN_SNR[Format.HYBRID] <= snr < 35.0  # quantized (a bf16 wgrad is ~50 dB)
    emulated = _segment_blockwise_wgrad(dc, a, lens, torch.float8_e5m2, torch.float8_e4m3fn)
    assert snr_db(emulated, b.grad) >= 40.0  # equal up to the bf16 output rounding
    assert not b.grad[1].any()


@pytest.mark.parametrize("r, c, bs", [(256, 200, 128), (64, 96, 32), (200, 64, 128), (2880 // 9, 200, 128),
                                     (64, 128, 128)],
                         ids=["R-2-blocks", "bs32", "R-not-a-multiple", "R-320", "R-below-a-block"])
def test_blockwise_weight_quantization_one_launch(r, c, bs, device, monkeypatch):
    """BLOCKWISE weights [G, R, C] in bs x bs tiles per expert: one kernel launch for any R (one
    quantization of [G * R, C] when bs divides R, its tiles never straddling two experts; else the
    batched kernel over the experts, whose last tile row covers R % bs rows), bit-identical to
    quantizing each expert alone. The dgrad copy is the byte transpose of the forward copy."""
    import importlib

    from primus_turbo.pytorch.core.low_precision import ScalingRecipe
    from primus_turbo.pytorch.ops.quantization import quantize_fp8
    from primus_turbo.triton.quantization import quant_fp8_gluon as QG
    from primus_turbo.triton.quantization import quant_fp8_kernel as F8

    ops = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")  # the module, not the op
    LM = importlib.import_module("primus_turbo.triton.launch")

    G = 3
    w = torch.randn(G, r, c, device=device) * torch.exp2(torch.randint(-6, 7, (G, 1, 1), device=device).float())
    w[1, -(r % bs or bs):, :bs] = 0.0  # an all-zero (partial) block: scale_inv 1
    launches = []

    class _Count:  # stands in for a kernel of the quantizer module: records each launch
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append((self.name, grid))
            return self.kernel[grid]

    # counted on Triton's own launch path (``kernel[grid]``, which _Count intercepts): the direct C
    # entry of primus_turbo.triton.launch would read the stand-in's signature, and skip it once cached
    monkeypatch.setattr(LM, "_DIRECT", [False])
    for name in [n for n in vars(F8) if n.endswith("_kernel")]:
        monkeypatch.setattr(F8, name, _Count(name, getattr(F8, name)))
    q, s = ops._quant_weight(w, torch.float8_e4m3fn, "BLOCKWISE", bs)
    assert [n for n, _ in launches] == ["_quant_fp8_tile_kernel" if r % bs == 0 else "_quant_fp8_tile_batched_kernel"]
    monkeypatch.undo()
    recipe = ScalingRecipe(use_2d_block=True)
    per = [quantize_fp8(w[g], torch.float8_e4m3fn, BW, block_size=bs, axis=-1, scaling_recipe=recipe)
           for g in range(G)]
    assert q.shape == (G, r, c) and s.shape == (G, -(-r // bs), -(-c // bs))
    assert torch.equal(q.view(torch.uint8), torch.stack([p[0] for p in per]).view(torch.uint8))
    assert torch.equal(s, torch.stack([p[1] for p in per]))
    for one_read in ("0", "1"):  # quantize then byte-transpose / both copies from one launch
        monkeypatch.setenv("PRIMUS_TURBO_FP8_WEIGHT_ONE_READ", one_read)
        launches.clear()
        monkeypatch.setattr(LM, "_DIRECT", [False])  # as above
        for name in [n for n in vars(F8) if n.endswith("_kernel")]:
            monkeypatch.setattr(F8, name, _Count(name, getattr(F8, name)))
        gluon_fn = QG.weight_copies_gluon

        def _gluon(*args, **kwargs):  # the Hopper Gluon twin of the one-launch kernel
            launches.append(("weight_copies_gluon", None))
            return gluon_fn(*args, **kwargs)

        monkeypatch.setattr(QG, "weight_copies_gluon", _gluon)
        fwd, dgr = ops._weight_copies(w, True, torch.float8_e4m3fn, "BLOCKWISE", bs, True, True)
        if one_read == "1" and bs == 128:  # the one-launch form needs 128 x 128 blocks
            one = "weight_copies_gluon" if QG.weight_copies_gluon_reason(w, torch.float8_e4m3fn) is None \
                else "_quant_fp8_tile_batched_kernel"
            assert [n for n, _ in launches] == [one]
        else:
            assert len(launches) == 2 and launches[-1][0] == "_transpose_bytes_kernel", launches
        monkeypatch.undo()
        assert torch.equal(fwd[0].view(torch.uint8), q.view(torch.uint8)), one_read
        assert torch.equal(dgr[0].view(torch.uint8), q.view(torch.uint8).transpose(1, 2)), one_read
        assert torch.equal(dgr[1], s.transpose(1, 2)), one_read
    assert s[1, -1, 0] == 1.0  # the zero block
    fwd_nn, _ = ops._weight_copies(w.transpose(1, 2).contiguous(), False, torch.float8_e4m3fn, "BLOCKWISE", bs, True,
                                   False)  # the [G, K, N] layout: its [G, N, K] view quantized
    assert torch.equal(fwd_nn[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(fwd_nn[1], s)


# ----------------------------------------------------------------------------------------------
# MX_BLOCKWISE (emulated MXFP8)
# ----------------------------------------------------------------------------------------------
MX_CASES = [  # (group lens, N, K, trans_b, extra tail rows): small, the interpreter runs them
    ([64], 64, 128, True, 0),
    ([40, 0, 23], 96, 64, False, 5),  # unbalanced, an empty group, lens not multiples of 32
    ([32, 96, 32], 64, 64, True, 0),  # balanced-ish, 32-aligned segments
    ([0, 0, 0], 64, 64, True, 7),  # nothing routed: all zeros
]


@pytest.mark.parametrize("lens, n, k, trans_b, extra", MX_CASES,
                         ids=[f"G{len(c[0])}-{c[0]}-{'NT' if c[3] else 'NN'}" for c in MX_CASES])
def test_grouped_gemm_fp8_mx(lens, n, k, trans_b, extra, device):
    a, b, gl = _make(lens, n, k, trans_b, device, extra_rows=extra)
    _check(a, b, gl, trans_b, _cfg(MX), MIN_SNR[Format.E4M3])


def test_grouped_gemm_fp8_mx_hybrid_fp32(device):
    a, b, gl = _make([33, 0, 31], 64, 64, True, device, dtype=torch.float32, extra_rows=3)
    _check(a, b, gl, True, _cfg(MX, Format.HYBRID), MIN_SNR[Format.HYBRID], out_dtype=torch.bfloat16)


def test_grouped_gemm_fp8_mx_megatron_and_repeatable(device):
    k, n = 64, 64
    b = (torch.randn((3, n, k), dtype=torch.bfloat16, device=device) * k ** -0.5).requires_grad_()
    b.main_grad = torch.randn(b.shape, dtype=torch.float32, device=device)
    start = b.main_grad.double().clone()
    expected = start.clone()
    for lens in ([20, 0, 31], [5, 40, 2]):  # two micro-batches accumulate into main_grad
        gl = torch.tensor(lens, dtype=torch.int64, device=device)
        a = torch.randn(sum(lens), k, dtype=torch.bfloat16, device=device, requires_grad=True)
        out = grouped_gemm_fp8(a, b, gl, config=_cfg(MX), fuse_bgrad_accum_pattern="megatron")
        dc = torch.randn_like(out)
        out.backward(dc)
        expected += grouped_gemm_variable_k_ref(dc, a, gl)
        assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=False), a.grad) >= 25.0
        b.grad = None
    assert b.grad_added_to_main_grad is True
    assert snr_db(expected - start, b.main_grad.double() - start) >= 25.0
    # bitwise repeatable, no_grad forward equal to the autograd forward
    a, w, gl = _make([7, 0, 40], 64, 64, True, device)
    with torch.no_grad():
        ref = grouped_gemm_fp8(a, w, gl, config=_cfg(MX))
    for _ in range(2):
        assert torch.equal(grouped_gemm_fp8(a.clone().requires_grad_(), w, gl, config=_cfg(MX)), ref)


def test_grouped_gemm_fp8_mx_dims(device):
    a, b, gl = _make([3, 4], 48, 64, True, device)  # N = 48: fine without grad_input
    with torch.no_grad():  # (the public name, too)
        assert turbo.ops.grouped_gemm_fp8(a, b, gl, config=_cfg(MX)).shape == (7, 48)
    with pytest.raises(ValueError, match="N to be a multiple of 32"):
        grouped_gemm_fp8(a.requires_grad_(), b, gl, config=_cfg(MX))
    a, b, gl = _make([3, 4], 64, 80, True, device)
    with pytest.raises(ValueError, match="K to be a multiple of 32, got K=80"):
        grouped_gemm_fp8(a, b, gl, config=_cfg(MX))


# ----------------------------------------------------------------------------------------------
# TORCH backend (torch._scaled_grouped_mm): GPU only
# ----------------------------------------------------------------------------------------------
def test_torch_backend_declines_on_cpu_or_unsupported(device):
    from primus_turbo.pytorch.backends.grouped_gemm_fp8 import (
        GroupedGemmFP8TorchBackend,
        GroupedGemmFP8VariableKTorchBackend,
    )

    a = torch.randn(8, 64, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(2, 32, 64, device=device).to(torch.float8_e4m3fn)
    gl = torch.tensor([3, 5], dtype=torch.int64, device=device)
    offs = torch.tensor([0, 3, 8], dtype=torch.int64, device=device)
    s, sb = torch.ones((), device=device), torch.ones(2, device=device)
    reason = GroupedGemmFP8TorchBackend.check(a_q=a, a_scale=s, b_q=b, b_scale=sb, mode="BLOCKWISE", group_lens=gl,
                                              group_offs=offs, out_dtype=torch.bfloat16)
    assert isinstance(reason, str) and reason
    reason = GroupedGemmFP8VariableKTorchBackend.check(x_t=a, x_scale=s, y_t=a, y_scale=s, mode="TENSORWISE",
                                                       group_lens=gl, group_offs=offs, out_dtype=torch.bfloat16,
                                                       num_cu=1)
    assert isinstance(reason, str) and reason
    if device == "cpu":
        reason = GroupedGemmFP8TorchBackend.check(a_q=a, a_scale=s, b_q=b, b_scale=sb, mode="TENSORWISE",
                                                  group_lens=gl, group_offs=offs, out_dtype=torch.bfloat16)
        assert "CUDA" in reason


def _scaled_grouped_mm_ok() -> bool:
    return (torch.cuda.is_available() and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability() >= (9, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not _scaled_grouped_mm_ok(), reason="needs torch._scaled_grouped_mm on sm_90+")
@pytest.mark.parametrize("gran", [ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE], ids=lambda g: g.name)
@pytest.mark.parametrize("trans_b", [True, False], ids=["NT", "NN"])
def test_torch_backend_matches_triton(gran, trans_b, device):
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

    lens = [256, 0, 100, 713, 7]
    a, b, gl = _make(lens, 512, 256, trans_b, device, extra_rows=9)
    dc = torch.randn(a.shape[0], 512, dtype=a.dtype, device=device)
    results = {}
    try:
        for backend in (BackendType.TRITON, BackendType.TORCH):
            GlobalBackendManager.set_grouped_gemm_backend(backend, precision="FP8")
            x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
            out = grouped_gemm_fp8(x, w, gl, trans_b=trans_b, config=_cfg(gran))
            out.backward(dc)
            results[backend] = (out.detach(), x.grad, w.grad, dc)
        # fused main_grad accumulation through the TORCH wgrad
        w = b.clone().requires_grad_()
        w.main_grad = torch.zeros(b.shape, dtype=torch.float32, device=device)
        out = grouped_gemm_fp8(a, w, gl, trans_b=trans_b, config=_cfg(gran), fuse_bgrad_accum_pattern="megatron")
        out.backward(results[BackendType.TORCH][3])
        fused = w.main_grad.clone()
    finally:
        GlobalBackendManager.reset()
    (o0, ga0, gb0, dc), (o1, ga1, gb1, _) = results[BackendType.TRITON], results[BackendType.TORCH]
    routed = sum(lens)
    assert torch.equal(o1[routed:], torch.zeros_like(o1[routed:]))
    assert snr_db(o0, o1) >= 40.0 and snr_db(ga0, ga1) >= 40.0 and snr_db(gb0, gb1) >= 35.0
    assert snr_db(grouped_gemm_ref(a, b, gl, trans_b), o1) >= 25.0
    assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=not trans_b), ga1) >= 25.0
    ref_db = grouped_gemm_variable_k_ref(dc, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, dc, gl)
    assert snr_db(ref_db, gb1) >= 25.0 and snr_db(ref_db, fused) >= 25.0
    assert not gb1[1].any()  # the empty group


@pytest.mark.gpu
@pytest.mark.skipif(not _scaled_grouped_mm_ok(), reason="needs torch._scaled_grouped_mm on sm_90+")
def test_torch_backend_autotune_and_pin_refusal(device):
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

    a, b, gl = _make([300, 0, 212], 256, 256, True, device)
    ref = grouped_gemm_ref(a, b, gl, True)
    try:
        GlobalBackendManager.set_grouped_gemm_backend(precision="FP8", auto_tune=True)
        for _ in range(2):
            assert snr_db(ref, grouped_gemm_fp8(a, b, gl, config=_cfg(ScalingGranularity.ROWWISE))) >= 25.0
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH, precision="FP8")
        with pytest.raises(ValueError):  # a pin is never silently ignored: BLOCKWISE is TRITON-only
            grouped_gemm_fp8(a, b, gl, config=_cfg(ScalingGranularity.BLOCKWISE))
    finally:
        GlobalBackendManager.reset()


# ----------------------------------------------------------------------------------------------
# Pre-quantized operands (QuantizedTensor / QuantizedTensorPair)
# ----------------------------------------------------------------------------------------------
_PRE_CFGS = {
    "tensorwise": Float8QuantConfig(),
    "rowwise": Float8QuantConfig(granularity=ScalingGranularity.ROWWISE),
    "blockwise": Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=32),
    "hybrid_blockwise": Float8QuantConfig(format=Format.HYBRID, granularity=ScalingGranularity.BLOCKWISE,
                                          block_size=32),
    "mx": Float8QuantConfig(granularity=MX),
}


@pytest.mark.parametrize("name", list(_PRE_CFGS))
def test_prequantized_weight_matches_on_the_fly(name, device):
    """b = create_quantized_weight(expert stack without grad): out and dx bit-identical to
    quantizing b on the fly; dequantize() of the stack matches the per-expert reference."""
    from primus_turbo.pytorch.core.quantized_tensor import create_quantized_weight

    cfg = _PRE_CFGS[name]
    a, b, gl = _make([20, 0, 41], 96, 128, True, device, extra_rows=5)
    pair = create_quantized_weight(b, cfg.fwd_dtype(), cfg, need_weight_transpose_cache=True)
    assert tuple(pair.data.data.shape) == (3, 96, 128) and tuple(pair.data_t.data.shape) == (3, 128, 96)
    deq = pair.data.dequantize(torch.float32)
    assert deq.shape == b.shape and snr_db(b.double(), deq.double()) >= 25.0
    deq_t = pair.data_t.dequantize(torch.float32)
    assert snr_db(b.transpose(1, 2).double(), deq_t.double()) >= 25.0
    dy = torch.randn(a.shape[0], 96, dtype=torch.bfloat16, device=device)
    res = {}
    for key, bb in (("fly", b), ("pre", pair)):
        ai = a.clone().requires_grad_()
        y = grouped_gemm_fp8(ai, bb, gl, config=cfg)
        y.backward(dy)
        res[key] = (y.detach(), ai.grad)
    for u, v in zip(res["fly"], res["pre"]):
        torch.testing.assert_close(u, v, rtol=0, atol=0)
    assert torch.all(res["pre"][0][61:] == 0)
    ref = grouped_gemm_ref(a.double(), b.double(), gl, True)
    # the bar of the forward operands' format: E4M3 in every config here (HYBRID's E5M2 is dC's only)
    fwd_bar = MIN_SNR[Format.E4M3] if cfg.fwd_dtype() == torch.float8_e4m3fn else MIN_SNR[cfg.format]
    assert snr_db(ref[:61], res["pre"][0][:61].double()) >= fwd_bar
    # the forward copy alone serves no-grad calls (and TENSORWISE / BLOCKWISE gradients)
    with torch.no_grad():
        torch.testing.assert_close(grouped_gemm_fp8(a, pair.data, gl, config=cfg), res["pre"][0], rtol=0, atol=0)
    if name in ("rowwise", "mx"):
        with pytest.raises(ValueError, match="transposed copy"):
            grouped_gemm_fp8(a.clone().requires_grad_(), pair.data, gl, config=cfg)
    else:
        ai = a.clone().requires_grad_()
        grouped_gemm_fp8(ai, pair.data, gl, config=cfg).backward(dy)
        torch.testing.assert_close(ai.grad, res["pre"][1], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(_PRE_CFGS))
def test_prequantized_operands_get_their_gradients(name, device):
    """QuantizedTensor operands are torch.Tensor subclasses: a cached expert stack that requires
    grad gets the weight gradient, and a quantized activation that requires grad gets dA, each
    bit-identical to the high-precision operand's; b's gradient with a quantized a is refused."""
    from primus_turbo.pytorch.core.quantized_tensor import QuantizedTensor, create_quantized_weight

    cfg = _PRE_CFGS[name]
    a, b, gl = _make([20, 0, 41], 96, 128, True, device, extra_rows=5)
    dy = torch.randn(a.shape[0], 96, dtype=torch.bfloat16, device=device)
    ai, bi = a.clone().requires_grad_(), b.clone().requires_grad_()
    y_ref = grouped_gemm_fp8(ai, bi, gl, config=cfg)
    y_ref.backward(dy)
    pair = create_quantized_weight(b.clone().requires_grad_(), cfg.fwd_dtype(), cfg, need_weight_transpose_cache=True)
    assert pair.data.requires_grad and pair.data.dtype == b.dtype and pair.data.shape == b.shape
    a2 = a.clone().requires_grad_()
    y = grouped_gemm_fp8(a2, pair, gl, config=cfg)
    y.backward(dy)
    assert torch.equal(y, y_ref.detach()) and torch.equal(a2.grad, ai.grad)
    assert pair.data.grad.dtype == b.dtype and torch.equal(pair.data.grad, bi.grad) and pair.data_t.grad is None
    if name in ("tensorwise", "rowwise", "blockwise"):  # activations quantized along K (MX: 1 x 32 too)
        bs = cfg.block_size if name == "blockwise" else None
        qa = QuantizedTensor.quantize(a.clone().requires_grad_(), cfg.fwd_dtype(), cfg.granularity, axis=-1,
                                      block_size=bs)
        grouped_gemm_fp8(qa, b, gl, config=cfg).backward(dy)
        assert qa.grad.dtype == a.dtype and torch.equal(qa.grad, ai.grad)
        with pytest.raises(ValueError, match="needs the high-precision a"):
            grouped_gemm_fp8(qa, pair, gl, config=cfg)
        with torch.no_grad():
            assert torch.equal(grouped_gemm_fp8(qa, pair, gl, config=cfg), y_ref.detach())


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "mx"])
def test_prequantized_activation_forward(name, device):
    """a = QuantizedTensor.quantize(x, along K) of an x without grad: the forward bit-identical to
    on-the-fly quantization; b's gradient from a pre-quantized a raises."""
    from primus_turbo.pytorch.core.quantized_tensor import QuantizedTensor, create_quantized_weight

    cfg = _PRE_CFGS[name]
    a, b, gl = _make([20, 0, 41], 96, 128, True, device, extra_rows=5)
    bs = cfg.block_size if name == "blockwise" else None
    qa = QuantizedTensor.quantize(a, cfg.fwd_dtype(), cfg.granularity, axis=-1, block_size=bs)
    with torch.no_grad():
        want = grouped_gemm_fp8(a, b, gl, config=cfg)
        got = grouped_gemm_fp8(qa, b, gl, config=cfg)
        both = grouped_gemm_fp8(qa, create_quantized_weight(b, cfg.fwd_dtype(), cfg), gl, config=cfg)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(both, want, rtol=0, atol=0)
    assert got.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="needs the high-precision a"):
        grouped_gemm_fp8(qa, b.clone().requires_grad_(), gl, config=cfg)
    out = grouped_gemm_fp8(qa, b, gl, config=cfg)  # b without requires_grad: fine under grad mode
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_prequantized_errors(device):
    from primus_turbo.pytorch.core.quantized_tensor import QuantizedTensor, create_quantized_weight

    a, b, gl = _make([3, 4], 64, 128, True, device)
    tw, bw = _PRE_CFGS["tensorwise"], _PRE_CFGS["blockwise"]
    pair = create_quantized_weight(b, torch.float8_e4m3fn, bw)
    with pytest.raises(ValueError, match="quantized BLOCKWISE, config says TENSORWISE"):
        grouped_gemm_fp8(a, pair, gl, config=tw)
    with pytest.raises(ValueError, match="block_size=32, config says 64"):
        grouped_gemm_fp8(a, pair, gl, config=Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE,
                                                               block_size=64))
    e5 = create_quantized_weight(b, torch.float8_e5m2, bw)
    with pytest.raises(ValueError, match="float8_e5m2 data, config's forward operands are torch.float8_e4m3fn"):
        grouped_gemm_fp8(a, e5, gl, config=bw)
    with pytest.raises(ValueError, match="trans_b=True"):
        grouped_gemm_fp8(a, pair, gl, trans_b=False, config=bw)
    flat = create_quantized_weight(b[0], torch.float8_e4m3fn, bw)
    with pytest.raises(ValueError, match="3-D data"):
        grouped_gemm_fp8(a, flat, gl, config=bw)
    bad = QuantizedTensor(pair.data.data, pair.data.scale_inv[:, :1], pair.data.granularity, block_size=32)
    with pytest.raises(ValueError, match="scale_inv must be"):
        grouped_gemm_fp8(a, bad, gl, config=bw)
    qa = QuantizedTensor.quantize(a, torch.float8_e4m3fn, ScalingGranularity.TENSORWISE)
    with pytest.raises(TypeError, match="QuantizedTensorPair is for b"):
        grouped_gemm_fp8(create_quantized_weight(a, torch.float8_e4m3fn, tw), b, gl, config=tw)
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_gemm_fp8(QuantizedTensor.quantize(a[:, :64], torch.float8_e4m3fn, ScalingGranularity.TENSORWISE),
                         b, gl, config=tw)
    with torch.no_grad():
        torch.testing.assert_close(grouped_gemm_fp8(qa, b, gl, config=tw), grouped_gemm_fp8(a, b, gl, config=tw),
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match="2-D \\[N, K\\] or 3-D"):
        create_quantized_weight(b[0, 0], torch.float8_e4m3fn, tw)
    if device == "cpu":  # the groups must fit a's rows (an async assert, immediate on CPU)
        too_many = torch.tensor([3, 5], dtype=torch.int64)
        for aa, bb in ((qa, b), (a, create_quantized_weight(b, torch.float8_e4m3fn, tw))):
            with pytest.raises(RuntimeError, match="exceeds a.shape"):
                grouped_gemm_fp8(aa, bb, too_many, config=tw)


def test_cached_weight_entry_errors(device):
    from primus_turbo.pytorch.core.quantized_tensor import create_quantized_weight
    from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8_cached_weight, grouped_weight_copies

    a, b, gl = _make([3, 4], 64, 128, True, device)
    cfg = _PRE_CFGS["blockwise"]
    copies = grouped_weight_copies(b, cfg, False)
    with torch.no_grad():
        torch.testing.assert_close(grouped_gemm_fp8_cached_weight(a, b, copies, gl, config=cfg),
                                   grouped_gemm_fp8(a, b, gl, config=cfg), rtol=0, atol=0)
    with pytest.raises(TypeError, match="w_copies"):
        grouped_gemm_fp8_cached_weight(a, b, copies[0], gl, config=cfg)
    with pytest.raises(TypeError, match="high-precision tensors"):
        grouped_gemm_fp8_cached_weight(a, create_quantized_weight(b, torch.float8_e4m3fn, cfg), copies, gl, config=cfg)
    with pytest.raises(RuntimeError, match="lack the grad_input copy"):
        grouped_gemm_fp8_cached_weight(a.clone().requires_grad_(), b, copies, gl, config=cfg)


def test_forward_gemm_resolution_is_kept_per_signature(monkeypatch, device):
    """The M-grouped FP8 GEMMs' backend (``_resolved``): the default's answer is asked once per
    call signature and reused (the results stay the op's); another shape, an FP8 Gluon switch or the
    settings version asks again; a pin or autotuning resolves on every call."""
    import importlib

    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

    mod = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")
    disp = mod.grouped_gemm_fp8_dispatcher
    asked = []
    real = disp.resolve
    monkeypatch.setattr(disp, "resolve", lambda *a, **kw: asked.append(1) or real(*a, **kw))
    mod._DEFAULTS.clear()
    cfg = _cfg(ScalingGranularity.ROWWISE)
    a, b, gl = _make([7, 0, 12], 32, 64, True, device)
    ref = grouped_gemm_ref(a, b, gl, trans_b=True)
    outs = [grouped_gemm_fp8(a, b, gl, trans_b=True, config=cfg) for _ in range(3)]
    assert len(asked) == 1 and all(torch.equal(o, outs[0]) for o in outs)
    assert snr_db(ref, outs[0]) >= 25.0
    a2, b2, gl2 = _make([7, 0, 13], 32, 64, True, device)
    grouped_gemm_fp8(a2, b2, gl2, trans_b=True, config=cfg)
    assert len(asked) == 2
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED", "0")
    grouped_gemm_fp8(a, b, gl, trans_b=True, config=cfg)
    assert len(asked) == 3
    try:
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON)
        for _ in range(2):
            grouped_gemm_fp8(a, b, gl, trans_b=True, config=cfg)
        assert len(asked) == 5
    finally:
        GlobalBackendManager.reset()
    grouped_gemm_fp8(a, b, gl, trans_b=True, config=cfg)  # the reset moved the settings version
    assert len(asked) == 6
