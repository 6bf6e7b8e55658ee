"""``torch.autocast`` over the library's ops and layers (primus_turbo/pytorch/core/amp.py).

GEMM-class ops and attention cast their floating inputs to the autocast dtype, as ``torch.mm`` and
SDPA do: under autocast, a call on fp32 inputs equals the call on inputs cast by hand, bit for bit,
and the gradients come back in fp32 (the hand-cast call's, cast up). The FP8 / FP4 ops write the
autocast dtype. The router keeps its ``router_dtype``. Each layer runs with fp32 parameters (the
TorchTitan setup without FSDP), gives outputs in the autocast dtype and fp32 gradients. Megatron's
fused form with a weight autocast would cast, and the FP8 grouped cache with such a weight, are
refused by name."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float4QuantConfig, Float8QuantConfig, ScalingGranularity
from primus_turbo.testing import snr_db

BF = torch.bfloat16


def _lens(device):
    return torch.tensor([40, 0, 56], dtype=torch.int64, device=device)


_OPS = {
    # name: (input shapes, call(*inputs, device)); every input fp32
    "gemm": ([(24, 64), (32, 64)], lambda a, b, d: turbo.ops.gemm(a, b, trans_b=True)),
    "grouped_gemm": ([(96, 64), (3, 32, 64)], lambda a, b, d: turbo.ops.grouped_gemm(a, b, _lens(d), trans_b=True)),
    "grouped_gemm_glu": ([(96, 64), (3, 64, 64)], lambda a, b, d: turbo.ops.grouped_gemm_glu(a, b, _lens(d))),
    "flash_attn_func": ([(1, 16, 2, 32)] * 3, lambda q, k, v, d: turbo.ops.flash_attn_func(q, k, v, causal=True,
                                                                                           deterministic=True)),
    "gemm_fp8": ([(32, 64), (32, 64)], lambda a, b, d: turbo.ops.gemm_fp8(a, b, trans_b=True)),
    "grouped_gemm_fp8": ([(96, 64), (3, 32, 64)], lambda a, b, d: turbo.ops.grouped_gemm_fp8(
        a, b, _lens(d), config=Float8QuantConfig(granularity=ScalingGranularity.ROWWISE))),
    "gemm_fp4": ([(32, 64), (32, 64)], lambda a, b, d: turbo.ops.gemm_fp4(a, b, trans_b=True)),
    "grouped_gemm_fp4": ([(96, 64), (3, 32, 64)], lambda a, b, d: turbo.ops.grouped_gemm_fp4(a, b, _lens(d))),
}


@pytest.mark.parametrize("name", list(_OPS))
def test_op_under_autocast_is_the_op_on_cast_inputs(name, device):
    torch.manual_seed(61)
    shapes, call = _OPS[name]
    base = [torch.randn(s, device=device) for s in shapes]
    x = [t.clone().requires_grad_() for t in base]
    xb = [t.to(BF).requires_grad_() for t in base]
    with torch.autocast(device, dtype=BF):
        y = call(*x, device)
    yb = call(*xb, device)
    assert y.dtype == BF and yb.dtype == BF and y.abs().sum() > 0
    assert torch.equal(y, yb)
    dy = torch.randn(y.shape, dtype=BF, device=device)
    y.backward(dy)
    yb.backward(dy)
    for i, (t, tb) in enumerate(zip(x, xb)):
        assert t.grad.dtype == torch.float32 and t.grad.abs().sum() > 0, i
        assert torch.equal(t.grad, tb.grad.float()), i


def test_autocast_off_inside_the_op(device, monkeypatch):
    """The op's body runs with autocast off (its ATen ops keep the dtypes it chose)."""
    import importlib

    gemm_mod = importlib.import_module("primus_turbo.pytorch.ops.gemm")
    seen = []
    real = gemm_mod._check_inputs

    def spy(*args, **kwargs):
        seen.append(torch.is_autocast_enabled(device))
        return real(*args, **kwargs)

    monkeypatch.setattr(gemm_mod, "_check_inputs", spy)
    a, b = torch.randn(8, 32, device=device), torch.randn(16, 32, device=device)
    with torch.autocast(device, dtype=BF):
        turbo.ops.gemm(a, b, trans_b=True)
    assert seen == [False]


def test_router_keeps_its_dtype_under_autocast(device):
    """router_gating_linear's logits are router_dtype's (fp32 here), with autocast on or off."""
    torch.manual_seed(62)
    x = torch.randn(16, 64, dtype=BF, device=device)
    w = torch.randn(8, 64, device=device)
    ref = turbo.ops.router_gating_linear(x, w, None, torch.float32)
    with torch.autocast(device, dtype=BF):
        out = turbo.ops.router_gating_linear(x, w, None, torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, ref)


_LAYERS = {
    "Linear": (lambda: turbo.modules.Linear(64, 32), lambda d: [torch.randn(4, 8, 64, device=d)], {}),
    "Float8Linear": (lambda: turbo.modules.Float8Linear(64, 32, config=Float8QuantConfig()),
                     lambda d: [torch.randn(32, 64, device=d)], {}),
    "Float8Linear_cache": (lambda: turbo.modules.Float8Linear(
        64, 32, config=Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)),
        lambda d: [torch.randn(32, 64, device=d)], dict(is_first_microbatch=True)),
    "GroupedLinear_fp8": (lambda: turbo.modules.GroupedLinear(3, 64, 32, config=Float8QuantConfig()),
                          lambda d: [torch.randn(96, 64, device=d), _lens(d)], {}),
    "GroupedLinear_mxfp4": (lambda: turbo.modules.GroupedLinear(3, 64, 32, config=Float4QuantConfig()),
                            lambda d: [torch.randn(96, 64, device=d), _lens(d)], {}),
    "GroupedMLP": (lambda: turbo.modules.GroupedMLP(3, 64, 32),
                   lambda d: [torch.randn(96, 64, device=d), _lens(d), torch.rand(96, device=d)], {}),
    "MoELayer": (lambda: turbo.modules.MoELayer(64, 32, 4, 2, aux_loss_coeff=0.01),
                 lambda d: [torch.randn(16, 64, device=d)], {}),
    "MoELayer_fp8_blockwise": (lambda: turbo.modules.MoELayer(64, 32, 4, 2, config=Float8QuantConfig(
        granularity=ScalingGranularity.BLOCKWISE, block_size=32)), lambda d: [torch.randn(16, 64, device=d)], {}),
    "TurboAttention": (lambda: turbo.modules.TurboAttention(causal=True),
                       lambda d: [torch.randn(1, 16, 2, 32, device=d) for _ in range(3)], {}),
}


@pytest.mark.parametrize("name", list(_LAYERS))
def test_layer_with_fp32_parameters_under_autocast(name, device):
    torch.manual_seed(63)
    make, inputs, kwargs = _LAYERS[name]
    with torch.device(device):
        layer = make()
    xs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs(device)]
    with torch.autocast(device, dtype=BF):
        y = layer(*xs, **kwargs)
    assert y.dtype == BF and y.abs().sum() > 0
    y.float().square().sum().backward()
    assert xs[0].grad.dtype == torch.float32 and xs[0].grad.abs().sum() > 0
    for n, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, n


def test_linear_matches_torch_under_autocast(device):
    """turbo.modules.Linear under autocast against nn.Linear under autocast: a bf16 product with
    the bias added in bf16 (the same dtype, SNR of the bf16 rounding only)."""
    torch.manual_seed(64)
    with torch.device(device):
        lin = turbo.modules.Linear(64, 48)
        ref = torch.nn.Linear(64, 48)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(32, 64, device=device)
    with torch.autocast(device, dtype=BF):
        y, y_ref = lin(x), ref(x)
    assert y.dtype == y_ref.dtype == BF
    assert snr_db(y_ref.double(), y) >= 40.0


def test_fused_form_with_a_cast_weight_is_refused(device):
    w = torch.nn.Parameter(torch.randn(32, 64, device=device))
    w.main_grad = torch.zeros(32, 64, device=device)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    with torch.autocast(device, dtype=BF), pytest.raises(ValueError, match="copy without main_grad"):
        turbo.ops.gemm(x, w, trans_b=True, fuse_bgrad_accum_pattern="megatron")
    wb = torch.nn.Parameter(torch.randn(32, 64, dtype=BF, device=device))  # Megatron's bf16 weight: fine
    wb.main_grad = torch.zeros(32, 64, device=device)
    with torch.autocast(device, dtype=BF):
        turbo.ops.gemm(x, wb, trans_b=True, fuse_bgrad_accum_pattern="megatron").sum().backward()
    assert wb.grad_added_to_main_grad is True and wb.main_grad.abs().sum() > 0


def test_grouped_fp8_cache_with_a_cast_weight_is_refused(device):
    with torch.device(device):
        layer = turbo.modules.GroupedLinear(3, 64, 32, config=Float8QuantConfig())
    x = torch.randn(96, 64, device=device)
    with torch.autocast(device, dtype=BF), pytest.raises(TypeError, match="FP8 weight cache"):
        layer(x, _lens(device), is_first_microbatch=True)


@pytest.mark.parametrize("name", ["Linear", "GroupedMLP", "TurboAttention"])
def test_compiled_layer_under_autocast_matches_eager(name, device):
    """torch.compile(fullgraph=True) of a layer called under autocast traces the casts and gives the
    eager layer's output bit for bit."""
    import copy

    torch.manual_seed(65)
    make, inputs, kwargs = _LAYERS[name]
    if name == "TurboAttention":
        make = lambda: turbo.modules.TurboAttention(causal=True, deterministic=True)  # noqa: E731
    with torch.device(device):
        layer = make()
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend="aot_eager")
    xs = inputs(device)
    with torch.autocast(device, dtype=BF):
        y, yc = layer(*xs, **kwargs), compiled(*xs, **kwargs)
    assert y.dtype == yc.dtype == BF and y.abs().sum() > 0 and torch.equal(y, yc)


def test_meta_tensors_skip_the_autocast_query():
    """``torch.is_autocast_enabled("meta")`` raises: the query is only made for CPU / CUDA tensors."""
    from primus_turbo.pytorch.core.amp import autocast_dtype

    assert autocast_dtype(torch.empty(2, device="meta")) is None
    with torch.autocast("cpu", dtype=BF):
        assert autocast_dtype(torch.empty(2)) == BF
