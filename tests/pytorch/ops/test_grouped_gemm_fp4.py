"""turbo.ops.grouped_gemm_fp4 (MoE experts in emulated MXFP4) against float64 references on the
unquantized inputs: forward and both gradients (SNR >= 8 dB, the grouped MXFP4 bar), 1 and 3
experts with balanced, unbalanced and empty groups, both weight layouts, the zeroed tail rows,
Megatron's fused wgrad accumulation, repeatability, the 32-multiple dims and bad input; the
training options (stochastic rounding of dC, the random Hadamard transform of the grad_weight
operands along each expert's tokens): accuracy, the exact transformed product, reproducibility."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float4QuantConfig
from primus_turbo.testing import grouped_gemm_ref, grouped_gemm_variable_k_ref, snr_db
from tests.grouped_gemm_checks import check_compiled_matches_eager, check_grouped_op

MIN_SNR = 8.0
CASES = [  # (group lens, N, K, trans_b, extra tail rows)
    ([64], 64, 128, True, 0),
    ([40, 0, 23], 96, 64, False, 5),
    ([32, 64, 32], 64, 64, True, 3),
    ([0, 0, 0], 64, 64, False, 4),
]


def _make(lens, n, k, trans_b, device, dtype=torch.bfloat16, extra_rows=0):
    G = len(lens)
    a = torch.randn(sum(lens) + extra_rows, k, dtype=dtype, device=device)
    b = torch.randn((G, n, k) if trans_b else (G, k, n), dtype=dtype, device=device) * k ** -0.5
    return a, b, torch.tensor(lens, dtype=torch.int64, device=device)


def _check(a, b, gl, trans_b, out_dtype=None):
    check_grouped_op(turbo.ops.grouped_gemm_fp4, a, b, gl, trans_b, MIN_SNR, out_dtype)


@pytest.mark.parametrize("lens, n, k, trans_b, extra", CASES,
                         ids=[f"G{len(c[0])}-{c[0]}-{'NT' if c[3] else 'NN'}" for c in CASES])
def test_grouped_gemm_fp4(lens, n, k, trans_b, extra, device):
    a, b, gl = _make(lens, n, k, trans_b, device, extra_rows=extra)
    _check(a, b, gl, trans_b)


def test_fp32_inputs_bf16_out(device):
    a, b, gl = _make([33, 0, 31], 64, 64, True, device, dtype=torch.float32, extra_rows=2)
    _check(a, b, gl, True, out_dtype=torch.bfloat16)


def test_megatron_fused_accumulation_and_repeatable(device):
    k, n = 64, 64
    b = (torch.randn((3, n, k), dtype=torch.bfloat16, device=device) * k ** -0.5).requires_grad_()
    b.main_grad = torch.randn(b.shape, dtype=torch.float32, device=device)
    start = b.main_grad.double().clone()
    expected = start.clone()
    for lens in ([20, 0, 31], [5, 40, 2]):
        gl = torch.tensor(lens, dtype=torch.int64, device=device)
        a = torch.randn(sum(lens), k, dtype=torch.bfloat16, device=device, requires_grad=True)
        out = turbo.ops.grouped_gemm_fp4(a, b, gl, fuse_bgrad_accum_pattern="megatron")
        dc = torch.randn_like(out)
        out.backward(dc)
        expected += grouped_gemm_variable_k_ref(dc, a, gl)
        assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=False), a.grad) >= MIN_SNR
        b.grad = None
    assert b.grad_added_to_main_grad is True
    assert snr_db(expected - start, b.main_grad.double() - start) >= MIN_SNR
    a, w, gl = _make([7, 0, 40], 64, 64, True, device)
    offs = torch.tensor([0, 7, 7, 47], dtype=torch.int64, device=device)
    with torch.no_grad():
        ref = turbo.ops.grouped_gemm_fp4(a, w, gl)
        assert torch.equal(turbo.ops.grouped_gemm_fp4(a, w, gl, group_offs=offs, num_cu=1), ref)
    assert torch.equal(turbo.ops.grouped_gemm_fp4(a.clone().requires_grad_(), w, gl), ref)


@pytest.mark.parametrize("trans_b", [True, False], ids=["NT", "NN"])
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_torch_compile_fullgraph_matches_eager(trans_b, fuse, device):
    """torch.compile(fullgraph=True) traces the op whole (its GEMMs are custom ops with shape-only
    fakes): the output and both gradients (or main_grad's accumulation) equal eager's bit for bit."""
    torch.manual_seed(32)
    a0 = torch.randn(100, 64, dtype=torch.bfloat16, device=device)
    b0 = torch.randn((3, 96, 64) if trans_b else (3, 64, 96), dtype=torch.bfloat16, device=device) * 0.125
    gl = torch.tensor([40, 0, 57], dtype=torch.int64, device=device)
    check_compiled_matches_eager(turbo.ops.grouped_gemm_fp4, a0, b0, gl, fuse, trans_b=trans_b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU code generation")
@pytest.mark.parametrize("trans_b", [True, False])
def test_inductor_matches_eager_gpu(trans_b):
    """The default compile backend on the GPU (the FP8 file's test: inductor generates the glue)."""
    torch.manual_seed(34)
    a0 = torch.randn(1032, 256, dtype=torch.bfloat16, device="cuda")
    b0 = torch.randn((8, 512, 256) if trans_b else (8, 256, 512), dtype=torch.bfloat16, device="cuda") * 0.0625
    gl = torch.tensor([200, 0, 97, 128, 300, 50, 149, 100], dtype=torch.int64, device="cuda")
    torch._dynamo.reset()
    check_compiled_matches_eager(turbo.ops.grouped_gemm_fp4, a0, b0, gl, False, backend="inductor", trans_b=trans_b)


def test_empty_shapes(device):
    a, b, gl = _make([0, 0], 64, 64, True, device)
    a.requires_grad_()
    b.requires_grad_()
    out = turbo.ops.grouped_gemm_fp4(a, b, gl)
    assert out.shape == (0, 64)
    out.sum().backward()
    assert b.grad.shape == b.shape and not b.grad.any()


def test_bad_inputs(device):
    a, b, gl = _make([3, 4], 48, 64, True, device)  # N = 48: fine without grad_input
    with torch.no_grad():
        assert turbo.ops.grouped_gemm_fp4(a, b, gl).shape == (7, 48)
    with pytest.raises(ValueError, match="grouped_gemm_fp4: MXFP4 needs N to be a multiple of 32"):
        turbo.ops.grouped_gemm_fp4(a.requires_grad_(), b, gl)
    a, b, gl = _make([3, 4], 64, 80, True, device)
    with pytest.raises(ValueError, match="K to be a multiple of 32, got K=80"):
        turbo.ops.grouped_gemm_fp4(a, b, gl)
    a, b, gl = _make([3, 4], 64, 64, True, device)
    with pytest.raises(TypeError, match="int64"):
        turbo.ops.grouped_gemm_fp4(a, b, gl.int())
    with pytest.raises(ValueError, match="K mismatch"):
        turbo.ops.grouped_gemm_fp4(a[:, :32], b, gl)
    with pytest.raises(TypeError, match="Float4QuantConfig"):
        turbo.ops.grouped_gemm_fp4(a, b, gl, config="MXFP4")
    with pytest.raises(ValueError, match="main_grad"):
        turbo.ops.grouped_gemm_fp4(a, b.clone().requires_grad_(), gl, fuse_bgrad_accum_pattern="megatron")
    with pytest.raises(TypeError, match="dtype"):
        turbo.ops.grouped_gemm_fp4(a.to(torch.float8_e4m3fn), b, gl)
    from primus_turbo.pytorch.core import QuantizedTensor
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity

    qa = QuantizedTensor.quantize(a, torch.float8_e4m3fn, ScalingGranularity.MX_BLOCKWISE)
    with pytest.raises(TypeError, match="grouped_gemm_fp4: a must be a torch.Tensor .* got QuantizedTensor"):
        turbo.ops.grouped_gemm_fp4(qa, b, gl)
    with pytest.raises(TypeError, match="grouped_gemm_fp4: b must be a torch.Tensor .* got list"):
        turbo.ops.grouped_gemm_fp4(a, [b], gl)


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("trans_b", [True, False], ids=["NT", "NN"])
def test_single_operand_grad(trans_b, which, device):
    """Only a (frozen weight) or only b (first layer) requires grad: that gradient against the fp64
    reference at the grouped MXFP4 bar, bit-identical to the one computed when both require grad;
    the tail rows of dA and the empty group's dB exactly zero; the no-grad forward against fp64."""
    lens, extra = [20, 0, 41], 5
    a, b, gl = _make(lens, 64, 128, trans_b, device, extra_rows=extra)
    routed = sum(lens)
    with torch.no_grad():
        out = turbo.ops.grouped_gemm_fp4(a, b, gl, trans_b=trans_b)
    assert not out.requires_grad and not out[routed:].any()
    assert snr_db(grouped_gemm_ref(a, b, gl, trans_b), out) >= MIN_SNR
    dc = torch.randn_like(out)
    x, w = a.clone().requires_grad_(which == "a"), b.clone().requires_grad_(which == "b")
    y = turbo.ops.grouped_gemm_fp4(x, w, gl, trans_b=trans_b)
    assert torch.equal(y.detach(), out)
    y.backward(dc)
    x2, w2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    turbo.ops.grouped_gemm_fp4(x2, w2, gl, trans_b=trans_b).backward(dc)
    if which == "a":
        assert w.grad is None and x.grad.shape == a.shape and x.grad.dtype == a.dtype
        assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=not trans_b), x.grad) >= MIN_SNR
        assert torch.equal(x.grad[routed:], torch.zeros_like(x.grad[routed:]))
        assert torch.equal(x.grad, x2.grad)
    else:
        assert x.grad is None and w.grad.shape == b.shape and w.grad.dtype == b.dtype
        ref_db = grouped_gemm_variable_k_ref(dc, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, dc, gl)
        assert snr_db(ref_db, w.grad) >= MIN_SNR
        assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))  # the empty group
        assert torch.equal(w.grad, w2.grad)


def test_bad_shapes_dtypes_groups_and_options(device):
    op = turbo.ops.grouped_gemm_fp4
    a, b, gl = _make([3, 4], 64, 64, True, device)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp4: a must be 2-D, got shape \(448,\)"):
        op(a.reshape(-1), b, gl)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp4: b must be 3-D, got shape \(128, 64\)"):
        op(a, b.reshape(-1, 64), gl)
    with pytest.raises(TypeError, match=r"grouped_gemm_fp4: a and b must have the same dtype, got a=torch.bfloat16, "
                                        r"b=torch.float32"):
        op(a, b.float(), gl)
    with pytest.raises(TypeError, match=r"grouped_gemm_fp4: out_dtype must be .* got torch.int32"):
        op(a, b, gl, out_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp4: num_cu must be None or a positive int, got 0"):
        op(a, b, gl, num_cu=0)
    other = "cpu" if device == "cuda" else "meta"
    with pytest.raises(ValueError, match=rf"grouped_gemm_fp4: group_lens must be on a's device .*, got {other}"):
        op(a, b, gl.to(other))
    with pytest.raises(ValueError, match=r"grouped_gemm_fp4: group_lens must be 1-D with 2 entries \(b has G=2 "
                                         r"experts\), got shape \(3,\)"):
        op(a, b, torch.tensor([3, 4, 0], dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"grouped_gemm_fp4: group_offs must be 1-D with 3 entries \(b has G=2 "
                                         r"experts\), got shape \(2,\)"):
        op(a, b, gl, group_offs=torch.tensor([0, 3], dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"grouped_gemm_fp4: fuse_bgrad_accum_pattern must be None or 'megatron', "
                                         r"got 'deepspeed'"):
        op(a, b, gl, fuse_bgrad_accum_pattern="deepspeed")


@pytest.mark.parametrize("trans_b", [True, False], ids=["NT", "NN"])
def test_zero_experts(trans_b, device):
    """G = 0 (no expert, group_lens empty): an all-zero [M, N] output, zero dA, an empty dB."""
    a = torch.randn(7, 64, dtype=torch.bfloat16, device=device)
    b = torch.randn((0, 32, 64) if trans_b else (0, 64, 32), dtype=torch.bfloat16, device=device)
    gl = torch.zeros(0, dtype=torch.int64, device=device)
    with torch.no_grad():
        out = turbo.ops.grouped_gemm_fp4(a, b, gl, trans_b=trans_b, out_dtype=torch.float32)
    assert torch.equal(out, torch.zeros(7, 32, dtype=torch.float32, device=device))
    x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = turbo.ops.grouped_gemm_fp4(x, w, gl, trans_b=trans_b)
    assert torch.equal(out, torch.zeros(7, 32, dtype=torch.bfloat16, device=device))
    out.backward(torch.randn_like(out))
    assert torch.equal(x.grad, torch.zeros_like(a)) and w.grad.shape == b.shape


def test_backend_pin(device):
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

    a, b, gl = _make([5, 27], 64, 64, True, device)
    try:
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="FP4")
        assert snr_db(grouped_gemm_ref(a, b, gl, True), turbo.ops.grouped_gemm_fp4(a, b, gl)) >= MIN_SNR
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH, precision="FP4")
        with pytest.raises(ValueError, match="TORCH"):
            turbo.ops.grouped_gemm_fp4(a, b, gl)
    finally:
        GlobalBackendManager.reset()


# ---- training options: stochastic rounding of gradients, random Hadamard transform ------------
SR_CFG = Float4QuantConfig(use_gradient_sr=True)
RHT_CFG = Float4QuantConfig(use_rht=True)
BOTH_CFG = Float4QuantConfig(use_gradient_sr=True, use_rht=True)
OPTION_CASES = [(SR_CFG, [40, 0, 23], True), (RHT_CFG, [40, 0, 23], True), (RHT_CFG, [32, 64, 7], False),
                (BOTH_CFG, [17, 50], True)]


@pytest.mark.parametrize("cfg, lens, trans_b", OPTION_CASES, ids=["sr-NT", "rht-NT", "rht-NN", "sr+rht-NT"])
def test_options_snr(cfg, lens, trans_b, device):
    a, b, gl = _make(lens, 64, 64, trans_b, device, extra_rows=3)
    check_grouped_op(turbo.ops.grouped_gemm_fp4, a, b, gl, trans_b, MIN_SNR, config=cfg)


def _padded_rht_deq(x, lens, signs):
    """The reference grad_weight operand of each expert: its rows of ``x [M, C]`` padded with zero
    rows to a multiple of 32, transformed along the tokens, MXFP4 along the tokens, dequantized
    (fp64, ``[C, P_g]``)."""
    from primus_turbo.pytorch.ops.quantization import hadamard_transform
    from primus_turbo.testing.quant_ref import dequantize_fp4_ref, quantize_fp4_ref

    out, start = [], 0
    for n in lens:
        seg = x[start:start + n].detach().cpu().float()
        start += n
        pad = torch.zeros(-(-n // 32) * 32, x.size(1))
        pad[:n] = seg
        t = hadamard_transform(pad.t().contiguous(), signs.cpu())  # [C, P_g] along the tokens
        out.append(dequantize_fp4_ref(*quantize_fp4_ref(t)).double())
    return out


@pytest.mark.parametrize("trans_b", [True, False], ids=["NT", "NN"])
def test_rht_wgrad_is_the_transformed_product(trans_b, device):
    # with use_rht, expert g's weight gradient is the fp32-accumulated product of the MXFP4 copies of
    # its tokens of a and dC, padded to 32-token blocks and transformed along the tokens with the
    # same 32 signs (drawn first in forward: torch.manual_seed reproduces them); the output and
    # grad_input are the default config's, bit for bit
    from primus_turbo.pytorch.ops.quantization import random_hadamard_signs

    lens = [40, 0, 23, 32]
    a, b, gl = _make(lens, 64, 96, trans_b, device, dtype=torch.float32, extra_rows=2)
    a.requires_grad_()
    b.requires_grad_()
    grad = torch.randn(a.size(0), 64, generator=torch.Generator().manual_seed(3)).to(device)
    torch.manual_seed(1234)
    signs = random_hadamard_signs(32, device=device)
    torch.manual_seed(1234)
    out = turbo.ops.grouped_gemm_fp4(a, b, gl, trans_b=trans_b, config=RHT_CFG)
    out.backward(grad)
    xs, ys = _padded_rht_deq(a, lens, signs), _padded_rht_deq(grad, lens, signs)
    for g in range(len(lens)):
        want = ys[g] @ xs[g].T  # [N, K]
        got = b.grad[g].double().cpu()
        if not trans_b:
            want = want.T
        if lens[g] == 0:
            assert not got.any()
        else:
            assert snr_db(want, got) >= 80.0, g
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out2 = turbo.ops.grouped_gemm_fp4(a2, b2, gl, trans_b=trans_b)
    out2.backward(grad)
    assert torch.equal(out, out2) and torch.equal(a.grad, a2.grad)
    ref_db = grouped_gemm_variable_k_ref(grad, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, grad, gl)
    assert snr_db(ref_db, b.grad) >= MIN_SNR


def test_rht_reduces_wgrad_error_on_outliers(device):
    # tokens with outliers (about one 40-sigma element per 32-token block): without the transform
    # their block scales flush the other tokens of the block; with it every expert's dW is more accurate
    g = torch.Generator().manual_seed(0)
    lens, k, n = [96, 64], 64, 64
    a = torch.randn(sum(lens), k, generator=g) + (torch.rand(sum(lens), k, generator=g) < 1 / 32) * 40
    b = torch.randn(len(lens), n, k, generator=g) / 8
    dy = torch.randn(sum(lens), n, generator=g)
    gl = torch.tensor(lens, dtype=torch.int64, device=device)
    ref = grouped_gemm_variable_k_ref(dy, a, gl.cpu())
    snr = {}
    for cfg in (Float4QuantConfig(), RHT_CFG):
        aa, bb = a.clone().to(device).requires_grad_(), b.clone().to(device).requires_grad_()
        torch.manual_seed(0)
        turbo.ops.grouped_gemm_fp4(aa, bb, gl, config=cfg).backward(dy.to(device))
        snr[cfg.use_rht] = snr_db(ref, bb.grad.double().cpu())
    assert snr[True] >= snr[False] + 1.5, snr


def test_gradient_sr_reproducible_and_random(device):
    # SR draws its seeds on the device: torch.manual_seed reproduces the gradients, another seed
    # changes both of them; the forward output is the RNE one
    a, b, gl = _make([40, 24], 64, 64, True, device, extra_rows=2)
    grad = torch.randn(a.size(0), 64, generator=torch.Generator().manual_seed(5)).bfloat16().to(device)
    res = []
    for seed in (0, 0, 1):
        aa, bb = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        torch.manual_seed(seed)
        out = turbo.ops.grouped_gemm_fp4(aa, bb, gl, config=SR_CFG)
        out.backward(grad)
        res.append((out, aa.grad, bb.grad))
    assert all(torch.equal(x, y) for x, y in zip(res[0], res[1]))
    assert torch.equal(res[0][0], res[2][0])  # forward unchanged
    assert not torch.equal(res[0][1], res[2][1]) and not torch.equal(res[0][2], res[2][2])
    with torch.no_grad():
        assert torch.equal(res[0][0], turbo.ops.grouped_gemm_fp4(a, b, gl))
    assert not res[0][1][64:].any()  # the rows past the routed ones stay zero


def test_padding_rows_stay_zero_under_sr(device):
    # the padded token layout's zero rows: stochastic rounding never moves an exact zero, so they
    # add nothing to any expert's weight gradient
    from primus_turbo.pytorch.ops.grouped_gemm_fp4 import _quant_fp4
    from primus_turbo.pytorch.ops.quantization import dequantize_fp4

    x = torch.randn(64, 32, device=device)
    x[5:32] = 0.0
    for _ in range(3):
        q, s = _quant_fp4(x, 0, sr=True)
        d = dequantize_fp4(q, torch.float32, scale_inv=s, axis=0)
        assert not d[5:32].any()
        assert snr_db(x[:5].double(), d[:5]) >= MIN_SNR


# ---- pre-quantized (MXFP4 QuantizedTensor) expert weights -------------------------------------
from primus_turbo.pytorch.core.low_precision import ScalingGranularity, ScalingRecipe  # noqa: E402
from primus_turbo.pytorch.core.quantized_tensor import QuantizedTensor, QuantizedTensorPair  # noqa: E402
from primus_turbo.pytorch.ops.gemm_fp4 import mxfp4_weight_pair  # noqa: E402

MX = ScalingGranularity.MX_BLOCKWISE


def _run(a, b, gl, trans_b, dy, **kw):
    out = turbo.ops.grouped_gemm_fp4(a, b, gl, trans_b=trans_b, **kw)
    out.backward(dy)
    return out


def _expert_qt(b, axis):
    """[G, R, C] experts' MXFP4 QuantizedTensor grouped along C (axis=-1) or R (axis=1), each expert
    on its own, as the op quantizes them; a new leaf requiring grad as b does."""
    from primus_turbo.pytorch.ops.quantization import quantize_fp4

    G, R, C = b.shape
    q, s = quantize_fp4(b.detach().reshape(G * R, C), axis=-1 if axis == -1 else 0)
    shape = (G, R, C // 2) if axis == -1 else (G, R // 2, C)
    sshape = (G, R, C // 32) if axis == -1 else (G, R // 32, C)
    return QuantizedTensor(q.view(shape), s.view(sshape), MX, block_size=32, axis=axis, orig_dtype=b.dtype,
                           requires_grad=b.requires_grad)


@pytest.mark.parametrize("trans_b", [True, False], ids=["NT", "NN"])
def test_quantized_weights_match_on_the_fly(trans_b, device):
    # fresh inputs per layout; unbalanced groups with an empty one and tail rows
    gl = torch.tensor([40, 0, 23], dtype=torch.int64, device=device)
    a, b, _ = _make([40, 0, 23], 96, 64, trans_b, device, extra_rows=5)
    a.requires_grad_()
    b.requires_grad_()
    dy = torch.randn(a.size(0), 96, device=device).bfloat16()
    ref = _run(a, b, gl, trans_b, dy)
    # the pair (both copies from one read): out, dA, dB bit-identical; dB on the pair's data
    a2 = a.detach().clone().requires_grad_()
    pair = mxfp4_weight_pair(b)
    out = _run(a2, pair, gl, trans_b, dy)
    assert torch.equal(out, ref) and torch.equal(a2.grad, a.grad)
    assert pair.data.grad.dtype == b.dtype and torch.equal(pair.data.grad, b.grad) and pair.data_t.grad is None
    # a lone QuantizedTensor grouped along K (the forward's copy): out and dB (no grad_input)
    qb = _expert_qt(b, -1 if trans_b else 1)
    out = _run(a.detach(), qb, gl, trans_b, dy)
    assert torch.equal(out, ref) and torch.equal(qb.grad, b.grad)
    # data grouped along N serves the grad_input; data_t (each expert's transpose) grouped along K
    # the forward: the other axis of each than mxfp4_weight_pair gives, so the other reading paths
    qn = _expert_qt(b.detach(), 1 if trans_b else -1)
    qk_t = _expert_qt(b.detach().transpose(1, 2).contiguous(), 1 if trans_b else -1)
    a3 = a.detach().clone().requires_grad_()
    out = _run(a3, QuantizedTensorPair(qn, qk_t), gl, trans_b, dy)
    assert torch.equal(out, ref) and torch.equal(a3.grad, a.grad)
    with torch.no_grad():
        assert torch.equal(turbo.ops.grouped_gemm_fp4(a, qb, gl, trans_b=trans_b), ref)


def test_quantized_weights_megatron_fused_accumulation(device):
    gl = torch.tensor([20, 0, 31], dtype=torch.int64, device=device)
    _, b, _ = _make([20, 0, 31], 64, 64, True, device)
    start = torch.randn(b.shape, device=device)
    ref_b = b.clone().requires_grad_()
    ref_b.main_grad = start.clone()
    pair = mxfp4_weight_pair(b.clone().requires_grad_())
    pair.data.main_grad = start.clone()
    for _ in range(2):  # two micro-batches reuse the one quantized weight
        a = torch.randn(51, 64, device=device).bfloat16().requires_grad_()
        dy = torch.randn(51, 64, device=device).bfloat16()
        _run(a, ref_b, gl, True, dy, fuse_bgrad_accum_pattern="megatron")
        a2 = a.detach().clone().requires_grad_()
        _run(a2, pair, gl, True, dy, fuse_bgrad_accum_pattern="megatron")
        assert torch.equal(a2.grad, a.grad)
    assert pair.data.grad_added_to_main_grad is True
    assert not torch.equal(pair.data.main_grad, start) and torch.equal(pair.data.main_grad, ref_b.main_grad)
    with pytest.raises(ValueError, match="main_grad"):  # checked on the pair's data
        turbo.ops.grouped_gemm_fp4(a, mxfp4_weight_pair(b.clone().requires_grad_()), gl,
                                   fuse_bgrad_accum_pattern="megatron")


def test_quantized_weight_mismatches(device):
    a, b, gl = _make([32, 32], 64, 64, True, device)
    op = turbo.ops.grouped_gemm_fp4
    qb = _expert_qt(b, -1)
    with pytest.raises(TypeError, match=r"grouped_gemm_fp4: b holds FP8 data \(torch.float8_e4m3fn\)"):
        op(a, QuantizedTensor(qb.data.view(torch.float8_e4m3fn), qb.scale_inv, MX, block_size=32, shape=b.shape), gl)
    with pytest.raises(ValueError, match="b must be 3-D, got data of shape"):
        op(a, QuantizedTensor.quantize(b[0], getattr(torch, "float4_e2m1fn_x2", torch.uint8), MX), gl)
    with pytest.raises(ValueError, match=r"stochastic rounding \(scaling_recipe.use_sr=True\)"):
        op(a, QuantizedTensor(qb.data, qb.scale_inv, MX, block_size=32, scaling_recipe=ScalingRecipe(use_sr=True)), gl)
    with pytest.raises(ValueError, match="block_size=16"):
        op(a, QuantizedTensor(qb.data, qb.scale_inv, MX, block_size=16), gl)
    with pytest.raises(ValueError, match="quantized along dim 0; the groups must run along one of the last two dims"):
        op(a, QuantizedTensor(qb.data.reshape(1, 128, 32), qb.scale_inv.reshape(1, 128, 2), MX, block_size=32,
                              axis=0, shape=(2, 128, 32)), gl)
    # the forward needs each expert grouped along K; grad_input along N
    with pytest.raises(ValueError, match=r"pre-quantized b \[2, 64, 64\] \(quantized along dim 1\) has no copy grouped "
                                         r"along its last dim"):
        op(a, _expert_qt(b, 1), gl)
    with pytest.raises(ValueError, match="has no copy grouped along its second-last dim .*mxfp4_weight_pair"):
        op(a.clone().requires_grad_(), qb, gl)
    with pytest.raises(TypeError, match="grouped_gemm_fp4: a must be a torch.Tensor .*pre-quantized operands are for b "
                                        "only.*got QuantizedTensor"):
        op(QuantizedTensor.quantize(a, getattr(torch, "float4_e2m1fn_x2", torch.uint8), MX), b, gl)
    with pytest.raises(ValueError, match=r"K mismatch"):
        op(a[:, :32].contiguous(), qb, gl)
