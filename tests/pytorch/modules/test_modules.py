"""turbo.modules layers vs plain-PyTorch equivalents: forward, backward, main_grad, FP8 weight cache, compile."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float4QuantConfig, Float8QuantConfig, ScalingGranularity
from primus_turbo.pytorch.modules import linear as linear_mod
from primus_turbo.testing import snr_db

# the standard's bars: bf16 45 dB (41 on CPU, where the Triton interpreter truncates fp32 -> bf16
# instead of rounding), fp32 80, FP8 E4M3 25 (every FP8 config here is E4M3)
BF16_DB = 45.0 if torch.cuda.is_available() else 41.0
FP32_DB, FP8_DB = 80.0, 25.0


@pytest.fixture(autouse=True)
def _on_device(device):
    """Every tensor and module of these tests on the suite's device (cuda where present)."""
    with torch.device(device):
        yield


def _db(dtype):
    return FP32_DB if dtype == torch.float32 else BF16_DB


def _assert(ref, out, bar, name):
    s = snr_db(ref.double(), out.double())
    assert s >= bar, f"{name}: SNR {s:.1f} dB < {bar}"


def _ref_linear(x, w, b, dy):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    y = F.linear(x64, w64, b64)
    y.backward(dy.double())
    return y.detach(), x64.grad, w64.grad, (None if b64 is None else b64.grad)


# ----------------------------------------------------------------------------------------------
# Linear
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(dtype, bias):
    torch.manual_seed(0)
    lin = turbo.modules.Linear(48, 40, bias=bias, dtype=dtype)
    assert isinstance(lin, torch.nn.Linear)
    x = torch.randn(2, 5, 48, dtype=dtype, requires_grad=True)
    y = lin(x)
    assert y.shape == (2, 5, 40) and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    ry, rx, rw, rb = _ref_linear(x, lin.weight, lin.bias, dy)
    bar = _db(dtype)
    _assert(ry, y, bar, "y")
    _assert(rx, x.grad, bar, "dx")
    _assert(rw, lin.weight.grad, bar, "dw")
    if bias:
        _assert(rb, lin.bias.grad, bar, "db")


def _attach_main_grad(p):
    p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_main_grad_accumulation(dtype):
    torch.manual_seed(1)
    lin = turbo.modules.Linear(32, 24, bias=True, dtype=dtype)
    _attach_main_grad(lin.weight)
    ref_sum = torch.zeros(24, 32, dtype=torch.float64)
    for _ in range(3):
        x = torch.randn(7, 32, dtype=dtype, requires_grad=True)
        y = lin(x)
        dy = torch.randn_like(y)
        y.backward(dy)
        ref_sum += _ref_linear(x, lin.weight, lin.bias, dy)[2]
    assert lin.weight.grad_added_to_main_grad is True
    _assert(ref_sum, lin.weight.main_grad, _db(dtype), "main_grad")
    # the autograd gradient is Megatron's placeholder (contents unspecified), never the wgrad sum
    assert lin.weight.grad is None or lin.weight.grad.shape == lin.weight.shape


def test_linear_torch_compile_fullgraph():
    torch.manual_seed(2)
    lin = turbo.modules.Linear(32, 16, dtype=torch.float32)
    x = torch.randn(3, 4, 32, requires_grad=True)
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    ry, rx, rw, rb = _ref_linear(x, lin.weight, lin.bias, dy)
    _assert(ry, y, FP32_DB, "y")
    _assert(rx, x.grad, FP32_DB, "dx")
    _assert(rw, lin.weight.grad, FP32_DB, "dw")
    _assert(rb, lin.bias.grad, FP32_DB, "db")


# ----------------------------------------------------------------------------------------------
# Float8Linear
# ----------------------------------------------------------------------------------------------
_F8_CONFIGS = {
    "tensorwise": Float8QuantConfig(),
    "rowwise": Float8QuantConfig(granularity="ROWWISE"),
    "blockwise": Float8QuantConfig(granularity="BLOCKWISE", block_size=32),
    "mx": Float8QuantConfig(granularity="MX_BLOCKWISE"),
}


@pytest.mark.parametrize("name", list(_F8_CONFIGS))
@pytest.mark.parametrize("first", [None, True])
def test_float8_linear_matches_torch(name, first):
    torch.manual_seed(3)
    lin = turbo.modules.Float8Linear(64, 32, bias=True, config=_F8_CONFIGS[name], dtype=torch.bfloat16)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x, is_first_microbatch=first)
    assert y.shape == (2, 16, 32) and y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    y.backward(dy)
    ry, rx, rw, rb = _ref_linear(x, lin.weight, lin.bias, dy)
    _assert(ry, y, FP8_DB, "y")
    _assert(rx, x.grad, FP8_DB, "dx")
    _assert(rw, lin.weight.grad, FP8_DB, "dw")
    _assert(rb, lin.bias.grad, BF16_DB, "db")
    assert (lin._weight_cache is None) == (first is None)


class _Spy:
    def __init__(self, monkeypatch):
        self.calls = []
        real = linear_mod.create_quantized_weight

        def spy(w, dtype, config, need_weight_transpose_cache=False):
            self.calls.append(need_weight_transpose_cache)
            return real(w, dtype, config, need_weight_transpose_cache)

        monkeypatch.setattr(linear_mod, "create_quantized_weight", spy)


@pytest.mark.parametrize("name", list(_F8_CONFIGS))
def test_float8_linear_cache_main_grad_and_refresh(name, monkeypatch):
    """Every granularity: ROWWISE and MX cache the transposed copy too (their dgrad copy is grouped
    along N and cannot be had by transposing the forward one), TENSORWISE and BLOCKWISE (2-D weight
    blocks) reuse the forward copy's scales."""
    torch.manual_seed(4)
    cfg = _F8_CONFIGS[name]
    # K = 96, not 64: nn.Linear's init bound 1/sqrt(64) = 2^-3 is MX's worst case: a weight block's
    # amax just under a power of two scales (E8M0 exponent floor(log2 amax) - 8) to just under 512,
    # past E4M3's 448, so the block's largest values saturate (~24.5 dB, at the 25 dB bar);
    # 1/sqrt(96) = 1.63 * 2^-4 scales to ~420 (~28 dB, as the other granularities)
    K = 96
    spy = _Spy(monkeypatch)
    lin = turbo.modules.Float8Linear(K, 32, bias=False, config=cfg, dtype=torch.bfloat16)
    _attach_main_grad(lin.weight)
    ref_sum = torch.zeros(32, K, dtype=torch.float64)
    uncached = turbo.modules.Float8Linear(K, 32, bias=False, config=cfg, dtype=torch.bfloat16)
    uncached.weight = _attach_main_grad(torch.nn.Parameter(lin.weight.detach().clone()))
    for i in range(3):
        x = torch.randn(32, K, dtype=torch.bfloat16, requires_grad=True)
        y = lin(x, is_first_microbatch=(i == 0))
        dy = torch.randn_like(y)
        y.backward(dy)
        ry, rx, rw, _ = _ref_linear(x, lin.weight, None, dy)
        ref_sum += rw
        _assert(ry, y, FP8_DB, "y")
        _assert(rx, x.grad, FP8_DB, "dx")
        # the cached path gives the same numbers as quantizing on every call
        x2 = x.detach().clone().requires_grad_()
        y2 = uncached(x2)
        y2.backward(dy)
        torch.testing.assert_close(y, y2, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    # one quantization for the three micro-batches (the uncached layer does not go through the spy)
    assert spy.calls == [name in ("rowwise", "mx")]
    assert lin.weight.grad_added_to_main_grad is True
    _assert(ref_sum, lin.weight.main_grad, FP8_DB, "main_grad")
    torch.testing.assert_close(lin.weight.main_grad, uncached.weight.main_grad, rtol=0, atol=0)

    # optimizer step: weight changes in place -> the next reuse call re-quantizes
    lin.weight.grad = lin.weight.main_grad.to(lin.weight.dtype)
    opt = torch.optim.SGD([lin.weight], lr=0.5)
    opt.step()
    x = torch.randn(32, K, dtype=torch.bfloat16)
    with torch.no_grad():
        y_new = lin(x, is_first_microbatch=False)
        y_fresh = turbo.ops.gemm_fp8(x, lin.weight, trans_b=True, config=cfg)
    assert len(spy.calls) == 2
    torch.testing.assert_close(y_new, y_fresh, rtol=0, atol=0)
    _assert(F.linear(x.double(), lin.weight.double()), y_new, FP8_DB, "y after step")
    with torch.no_grad():
        lin(x, is_first_microbatch=False)
    assert len(spy.calls) == 2  # reused again
    lin(x, is_first_microbatch=True)
    assert len(spy.calls) == 3  # True always re-quantizes
    lin(x, is_first_microbatch=None)
    assert len(spy.calls) == 3 and lin._weight_cache is None  # None: no cache at all


def test_float8_linear_from_float_and_no_grad_cache():
    torch.manual_seed(5)
    base = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    lin = turbo.modules.Float8Linear.from_float(base, inplace=False)
    assert lin is not base and type(base) is torch.nn.Linear
    assert lin.weight is base.weight and lin.bias is base.bias
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = lin(x, is_first_microbatch=True)
        y2 = lin(x, is_first_microbatch=False)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    _assert(base(x).detach(), y, FP8_DB, "y")


def test_float8_linear_from_float_in_place():
    """The reference default (``inplace=True``): the module itself becomes a Float8Linear (the parent
    keeps its child, parameters and hooks stay), its forward and gradients are FP8's; the
    ``modules.linear_fp8`` import path names the same class; bad modules are refused by name."""
    from primus_turbo.pytorch.modules.linear_fp8 import Float8Linear

    assert Float8Linear is turbo.modules.Float8Linear
    torch.manual_seed(15)
    parent = torch.nn.Sequential(torch.nn.Linear(64, 48, dtype=torch.bfloat16))
    base = parent[0]
    w, b = base.weight, base.bias
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, 48, dtype=torch.bfloat16)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = x64 @ w64.t() + b.detach().double()
    ref.backward(dy.double())
    cfg = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=32)
    out = Float8Linear.from_float(base, cfg)
    assert out is base and parent[0] is base and type(base) is Float8Linear
    assert base.weight is w and base.bias is b and base.config is cfg and base._weight_cache is None
    y = parent(x)
    y.backward(dy)
    _assert(ref.detach(), y, FP8_DB, "y")
    _assert(x64.grad, x.grad, FP8_DB, "dx")
    _assert(w64.grad, w.grad, FP8_DB, "dw")
    with pytest.raises(TypeError, match="already a Float8Linear"):
        Float8Linear.from_float(base)
    with pytest.raises(TypeError, match="Conv1d"):
        Float8Linear.from_float(torch.nn.Conv1d(4, 4, 1))

    class MyLinear(torch.nn.Linear):
        pass

    with pytest.raises(TypeError, match="MyLinear.*inplace=False"):
        Float8Linear.from_float(MyLinear(8, 8))
    assert type(Float8Linear.from_float(MyLinear(8, 8), inplace=False)) is Float8Linear


# ----------------------------------------------------------------------------------------------
# GroupedLinear
# ----------------------------------------------------------------------------------------------
def _grouped_ref(x, w, lens, dy):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    outs, o = [], 0
    for g, n in enumerate(lens.tolist()):
        outs.append(x64[o:o + n] @ w64[g].t())
        o += n
    y = torch.cat(outs)
    y.backward(dy.double())
    return y.detach(), x64.grad, w64.grad


@pytest.mark.parametrize("config,dtype", [(None, torch.float32), (None, torch.bfloat16),
                                          (Float8QuantConfig(), torch.bfloat16)])
def test_grouped_linear(config, dtype):
    torch.manual_seed(6)
    mod = turbo.modules.GroupedLinear(3, 32, 48, dtype=dtype, config=config)
    assert mod.weight.shape == (3, 48, 32)
    lens = torch.tensor([5, 0, 11], dtype=torch.int64)
    x = torch.randn(16, 32, dtype=dtype, requires_grad=True)
    y = mod(x, lens)
    dy = torch.randn_like(y)
    y.backward(dy)
    ry, rx, rw = _grouped_ref(x, mod.weight, lens, dy)
    bar = FP8_DB if config is not None else _db(dtype)
    _assert(ry, y, bar, "y")
    _assert(rx, x.grad, bar, "dx")
    _assert(rw, mod.weight.grad, bar, "dw")


_GROUPED_F8 = {
    "tensorwise": Float8QuantConfig(),
    "rowwise": Float8QuantConfig(granularity="ROWWISE"),
    "blockwise": Float8QuantConfig(granularity="BLOCKWISE", block_size=32),
    "hybrid_blockwise": Float8QuantConfig(format="HYBRID", granularity="BLOCKWISE", block_size=32),
}


def _count_grouped_weight_copies(monkeypatch) -> list:
    """Record ``need_dgrad`` of every expert-weight quantization GroupedLinear makes (its cache's misses)."""
    from primus_turbo.pytorch.modules import grouped_linear as gl_mod

    calls = []
    real = gl_mod.grouped_weight_copies

    def spy(b, config, need_dgrad, trans_b=True):
        calls.append(need_dgrad)
        return real(b, config, need_dgrad, trans_b)

    monkeypatch.setattr(gl_mod, "grouped_weight_copies", spy)
    return calls


@pytest.mark.parametrize("name", list(_GROUPED_F8))
def test_grouped_linear_fp8_weight_cache(name, monkeypatch):
    """is_first_microbatch: one quantization of the expert weights serves later micro-batches,
    bit-identical to quantizing on every call (out, dx, and the main_grad accumulation); an
    optimizer step invalidates it; True refreshes; None drops it."""
    torch.manual_seed(7)
    cfg = _GROUPED_F8[name]
    gbar = 20.0 if name.startswith("hybrid") else FP8_DB  # HYBRID's gradients are E5M2: the standard's 20 dB
    calls = _count_grouped_weight_copies(monkeypatch)
    G, K, N = 3, 64, 96
    mod = turbo.modules.GroupedLinear(G, K, N, dtype=torch.bfloat16, config=cfg)
    _attach_main_grad(mod.weight)
    plain = turbo.modules.GroupedLinear(G, K, N, dtype=torch.bfloat16, config=cfg)
    plain.weight = _attach_main_grad(torch.nn.Parameter(mod.weight.detach().clone()))
    lens = torch.tensor([40, 0, 70], dtype=torch.int64)
    ref_sum = torch.zeros(G, N, K, dtype=torch.float64)
    for i in range(3):
        x = torch.randn(120, K, dtype=torch.bfloat16, requires_grad=True)  # 10 rows past the groups
        y = mod(x, lens, is_first_microbatch=(i == 0))
        dy = torch.randn_like(y)
        y.backward(dy)
        ry, rx, rw = _grouped_ref(x[:110], mod.weight, lens, dy[:110])
        ref_sum += rw
        _assert(ry, y[:110], FP8_DB, "y")
        _assert(rx, x.grad[:110], gbar, "dx")
        assert torch.all(y[110:] == 0) and torch.all(x.grad[110:] == 0)
        x2 = x.detach().clone().requires_grad_()
        y2 = plain(x2, lens)
        y2.backward(dy)
        torch.testing.assert_close(y, y2, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    assert calls == [True]  # one quantization (with the grad_input copy) for three micro-batches
    assert mod.weight.grad_added_to_main_grad is True
    _assert(ref_sum, mod.weight.main_grad, gbar, "main_grad")
    torch.testing.assert_close(mod.weight.main_grad, plain.weight.main_grad, rtol=0, atol=0)

    # optimizer step (in place: _version bumps) -> the next reuse call re-quantizes
    mod.weight.grad = mod.weight.main_grad.to(mod.weight.dtype)
    torch.optim.SGD([mod.weight], lr=0.5).step()
    x = torch.randn(110, K, dtype=torch.bfloat16)
    with torch.no_grad():
        y_new = mod(x, lens, is_first_microbatch=False)
        y_fresh = turbo.ops.grouped_gemm_fp8(x, mod.weight, lens, config=cfg)
    assert calls == [True, False]  # no gradient recorded: no grad_input copy
    torch.testing.assert_close(y_new, y_fresh, rtol=0, atol=0)
    with torch.no_grad():
        mod(x, lens, is_first_microbatch=False)
    assert len(calls) == 2  # reused
    # a gradient wanted for x: the cache without the grad_input copy does not serve, it is rebuilt
    xg = x.clone().requires_grad_()
    mod(xg, lens, is_first_microbatch=False).sum().backward()
    assert calls == [True, False, True]
    with torch.no_grad():
        mod(x, lens, is_first_microbatch=False)  # the copy with the grad_input copy serves no-grad calls
    assert len(calls) == 3
    # writes through .data are invisible to the version counter: True refreshes
    with torch.no_grad():
        mod.weight.data.mul_(0.5)
        mod(x, lens, is_first_microbatch=True)
        torch.testing.assert_close(mod(x, lens, is_first_microbatch=False),
                                   turbo.ops.grouped_gemm_fp8(x, mod.weight, lens, config=cfg), rtol=0, atol=0)
    assert len(calls) == 4
    mod(x, lens, is_first_microbatch=None)
    assert mod._weight_cache is None  # None: no cache at all
    with pytest.raises(TypeError, match="is_first_microbatch"):
        mod(x, lens, is_first_microbatch=1)
    with pytest.raises(TypeError, match="must match the weight"):
        mod(x.float(), lens, is_first_microbatch=False)


def test_grouped_linear_fp4():
    """Float4QuantConfig: MXFP4 grouped GEMMs (forward, dgrad, wgrad) against float64, rows past
    the groups zero; main_grad accumulation; bad config types named."""
    from primus_turbo.pytorch.core.low_precision import Float4QuantConfig

    torch.manual_seed(9)
    mod = turbo.modules.GroupedLinear(3, 64, 96, dtype=torch.bfloat16, config=Float4QuantConfig())
    lens = torch.tensor([40, 0, 70], dtype=torch.int64)
    x = torch.randn(116, 64, dtype=torch.bfloat16, requires_grad=True)
    y = mod(x, lens, is_first_microbatch=True)  # no cache for FP4: quantized every call
    dy = torch.randn_like(y)
    y.backward(dy)
    ry, rx, rw = _grouped_ref(x[:110], mod.weight, lens, dy[:110])
    for ref, got, name in ((ry, y[:110], "y"), (rx, x.grad[:110], "dx"), (rw, mod.weight.grad, "dw")):
        _assert(ref, got, 8.0, name)  # the grouped MXFP4 SNR bar
    assert torch.all(y[110:] == 0) and mod._weight_cache is None
    _attach_main_grad(mod.weight)
    mod(x.detach(), lens).backward(dy)
    _assert(rw, mod.weight.main_grad, 8.0, "main_grad")
    with pytest.raises(TypeError, match="Float4QuantConfig or None, got str"):
        turbo.modules.GroupedLinear(2, 32, 32, config="fp4")
    # the MXFP4 training options reach the grouped op: SR of dy, RHT of the wgrad operands
    mod.config = Float4QuantConfig(use_gradient_sr=True, use_rht=True)
    mod.weight.main_grad.zero_()
    dx_rne = x.grad.clone()
    x.grad = None
    y2 = mod(x, lens)
    y2.backward(dy)
    assert torch.equal(y2, y)  # the forward keeps RNE
    assert not torch.equal(x.grad, dx_rne)  # dy was rounded stochastically: the option reached the op
    for ref, got, name in ((rx, x.grad[:110], "dx sr"), (rw, mod.weight.main_grad, "dw sr+rht")):
        _assert(ref, got, 8.0, name)


def test_grouped_linear_bf16_ignores_is_first_microbatch():
    torch.manual_seed(8)
    mod = turbo.modules.GroupedLinear(2, 32, 16, dtype=torch.float32)
    lens = torch.tensor([5, 7], dtype=torch.int64)
    x = torch.randn(12, 32)
    torch.testing.assert_close(mod(x, lens, is_first_microbatch=True), mod(x, lens), rtol=0, atol=0)


def test_grouped_linear_primus_call_forms():
    """Primus-Turbo's constructor: ``group_num=`` keyword, positional ``(G, K, N, device, dtype)``;
    its forward ``(x, group_lens, group_offs=None)``."""
    G, K, N = 3, 32, 48
    torch.manual_seed(10)
    a = turbo.modules.GroupedLinear(group_num=G, in_features=K, out_features=N)
    torch.manual_seed(10)
    b = turbo.modules.GroupedLinear(num_groups=G, in_features=K, out_features=N)
    assert a.weight.shape == b.weight.shape == (G, N, K)
    assert a.num_groups == a.group_num == G
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)  # same initialisation
    assert "num_groups=3" in repr(a)

    c = turbo.modules.GroupedLinear(G, K, N, "cpu", torch.float32)
    assert c.weight.device == torch.device("cpu") and c.weight.dtype == torch.float32
    d = turbo.modules.GroupedLinear(G, K, N, None, torch.bfloat16)
    assert d.weight.dtype == torch.bfloat16
    e = turbo.modules.GroupedLinear(G, K, N, device="cpu", dtype=torch.float64)
    assert e.weight.device == torch.device("cpu") and e.weight.dtype == torch.float64

    # forward(x, group_lens, group_offs) as Primus-Turbo calls it, offsets positional or keyword
    lens = torch.tensor([5, 0, 11], dtype=torch.int64)
    offs = torch.tensor([0, 5, 5, 16], dtype=torch.int64)
    x = torch.randn(16, K)
    y = a(x, lens)
    torch.testing.assert_close(a(x, lens, offs), y, rtol=0, atol=0)
    torch.testing.assert_close(a(x, group_lens=lens, group_offs=offs), y, rtol=0, atol=0)


def test_grouped_linear_call_form_errors():
    with pytest.raises(TypeError, match="exactly once.*both"):
        turbo.modules.GroupedLinear(3, 32, 48, group_num=3)
    with pytest.raises(TypeError, match="exactly once.*both"):
        turbo.modules.GroupedLinear(num_groups=3, group_num=3, in_features=32, out_features=48)
    with pytest.raises(TypeError, match="exactly once.*neither"):
        turbo.modules.GroupedLinear(in_features=32, out_features=48)
    with pytest.raises(TypeError, match="missing required argument 'out_features'"):
        turbo.modules.GroupedLinear(group_num=3, in_features=32)
    # the old positional order (dtype before device) is refused, not misread
    order = r"positional order is \(num_groups, in_features, out_features, device, dtype\)"
    with pytest.raises(TypeError, match=order):
        turbo.modules.GroupedLinear(3, 32, 48, torch.float32, "cpu")
    with pytest.raises(TypeError, match="positional order"):
        turbo.modules.GroupedLinear(3, 32, 48, torch.float32)
    with pytest.raises(TypeError):  # config is keyword-only
        turbo.modules.GroupedLinear(3, 32, 48, None, None, Float8QuantConfig())


# ----------------------------------------------------------------------------------------------
# TurboAttention
# ----------------------------------------------------------------------------------------------
def _sdpa_ref(q, k, v, dout, scale, causal, sink=None):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s64 = None if sink is None else sink.detach().double().requires_grad_()
    rep = q.shape[2] // k.shape[2]
    qh = q64.transpose(1, 2)
    kh = k64.repeat_interleave(rep, 2).transpose(1, 2)
    vh = v64.repeat_interleave(rep, 2).transpose(1, 2)
    logits = qh @ kh.transpose(-1, -2) * scale
    if causal:
        sq, sk = logits.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        logits = logits.masked_fill(~mask, float("-inf"))
    if s64 is not None:
        sink_col = s64.view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        p = torch.softmax(torch.cat([logits, sink_col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(logits, -1)
    out = (p @ vh).transpose(1, 2)
    out.backward(dout.double())
    grads = [q64.grad, k64.grad, v64.grad] + ([] if s64 is None else [s64.grad])
    return out.detach(), grads


@pytest.mark.parametrize("causal,use_sink,dtype", [(False, False, torch.float32), (True, True, torch.float32),
                                                   (True, False, torch.bfloat16)])
def test_turbo_attention(causal, use_sink, dtype):
    torch.manual_seed(7)
    b, s, hq, hk, d = 1, 16, 4, 2, 16
    q = torch.randn(b, s, hq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, s, hk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, s, hk, d, dtype=dtype, requires_grad=True)
    sink = torch.randn(hq, dtype=torch.float32, requires_grad=True) if use_sink else None
    attn = turbo.modules.TurboAttention(causal=causal)
    out = attn(q, k, v, sink=sink)
    assert out.shape == (b, s, hq, d) and out.dtype == dtype
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, grads = _sdpa_ref(q, k, v, dout, 1.0 / math.sqrt(d), causal, sink)
    bar = _db(dtype)
    _assert(ref, out, bar, "out")
    for name, t, g in zip("qkvs", (q, k, v, sink), grads):
        _assert(g, t.grad, bar, f"d{name}")


def _attn_inputs(dtype, b=1, s=16, hq=4, hk=2, d=16, requires_grad=False):
    return [torch.randn(b, s, h, d, dtype=dtype, requires_grad=requires_grad) for h in (hq, hk, hk)]


def test_turbo_attention_primus_positional():
    """Primus-Turbo's positional order: ``TurboAttention(dropout_p, softmax_scale, causal, window_size,
    alibi_slopes, deterministic, return_lse, return_attn_probs, fp8_config, ulysses_group, ring_group)``."""
    from primus_turbo.pytorch.ops import flash_attn_func

    torch.manual_seed(11)
    q, k, v = _attn_inputs(torch.float32)
    attn = turbo.modules.TurboAttention(0.0, None, True)
    assert attn.dropout_p == 0.0 and attn.softmax_scale is None and attn.causal is True
    out = attn(q, k, v)
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True))
    assert not torch.equal(out, flash_attn_func(q, k, v, causal=False))

    attn = turbo.modules.TurboAttention(0.0, 0.5, False, (4, 0), None, True, True, False, None, None, None)
    assert attn.window_size == (4, 0) and attn.deterministic and attn.return_lse
    out, lse = attn(q, k, v)
    ref_out, ref_lse = flash_attn_func(q, k, v, softmax_scale=0.5, window_size=(4, 0), deterministic=True,
                                       return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert "dropout_p=0.0" in repr(attn) and "fp8_config=None" in repr(attn)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(dropout_p=0.1), NotImplementedError, r"dropout_p=0\.1 is not implemented"),
        (dict(alibi_slopes=torch.zeros(4)), NotImplementedError, "alibi_slopes.*not implemented"),
        (dict(return_attn_probs=True), NotImplementedError, "return_attn_probs=True is not implemented"),
        (dict(ulysses_group=object()), NotImplementedError,
         r"context parallelism \(Ulysses / ring attention\) is not implemented; ulysses_group"),
        (dict(ring_group=object()), NotImplementedError,
         r"context parallelism \(Ulysses / ring attention\) is not implemented; ring_group"),
        (dict(fp8_config=Float8QuantConfig()), NotImplementedError, "granularity=TENSORWISE"),
        (dict(fp8_config=Float8QuantConfig(format="E5M2", granularity="BLOCKWISE")), NotImplementedError,
         "format=E5M2"),
        (dict(fp8_config="e4m3"), TypeError, "fp8_config must be a Float8QuantConfig"),
        (dict(dropout_p=None), TypeError, "dropout_p must be a float"),
    ],
    ids=["dropout", "alibi", "attn_probs", "ulysses", "ring", "fp8_tensorwise", "fp8_e5m2", "fp8_str",
         "dropout_none"],
)
def test_turbo_attention_unsupported_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        turbo.modules.TurboAttention(**kwargs)


def test_turbo_attention_unsupported_positional():
    with pytest.raises(NotImplementedError, match=r"dropout_p=0\.1"):
        turbo.modules.TurboAttention(0.1, None, True)
    with pytest.raises(TypeError, match="dropout_p must be a float, got None"):
        turbo.modules.TurboAttention(None, True)  # the old (softmax_scale, causal) order: loud, not misread


@pytest.mark.parametrize("fp8", [False, True])
def test_turbo_attention_bias_raises(fp8):
    q, k, v = _attn_inputs(torch.bfloat16, s=32, d=32)
    cfg = Float8QuantConfig(granularity="BLOCKWISE", block_size=32) if fp8 else None
    attn = turbo.modules.TurboAttention(causal=True, fp8_config=cfg)
    fn = "flash_attn_fp8_func" if fp8 else "flash_attn_func"
    with pytest.raises(NotImplementedError, match=f"{fn}: bias .* not implemented"):
        attn(q, k, v, torch.zeros(1, 4, 32, 32, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="bias"):
        attn(q, k, v, bias=torch.zeros(1, 4, 32, 32, dtype=torch.bfloat16))


def test_turbo_attention_fp8_dispatch(monkeypatch):
    """fp8_config picks flash_attn_fp8_func (with the config and every option); None picks flash_attn_func."""
    from primus_turbo.pytorch.modules import attention as attn_mod

    calls = []

    def spy(name):
        def fn(q, k, v, **kw):
            calls.append((name, kw))
            return q
        return fn

    monkeypatch.setattr(attn_mod, "flash_attn_fp8_func", spy("fp8"))
    monkeypatch.setattr(attn_mod, "flash_attn_func", spy("bf16"))
    q, k, v = _attn_inputs(torch.bfloat16)
    sink = torch.zeros(4)
    cfg = Float8QuantConfig(granularity="BLOCKWISE", block_size=64)
    turbo.modules.TurboAttention(0.0, 0.25, True, (8, -1), None, True, True, False, cfg)(q, k, v, sink=sink)
    turbo.modules.TurboAttention(causal=True)(q, k, v)
    (n0, kw0), (n1, kw1) = calls
    assert n0 == "fp8" and kw0["fp8_config"] is cfg and kw0["sink"] is sink and kw0["bias"] is None
    assert (kw0["dropout_p"], kw0["softmax_scale"], kw0["causal"], kw0["window_size"], kw0["deterministic"],
            kw0["return_lse"]) == (0.0, 0.25, True, (8, -1), True, True)
    assert n1 == "bf16" and "fp8_config" not in kw1 and kw1["causal"] is True and kw1["sink"] is None


@pytest.mark.parametrize("causal,use_sink", [(False, False), (True, True)])
def test_turbo_attention_fp8_matches_op(causal, use_sink):
    """The fp8_config path gives exactly flash_attn_fp8_func's output and gradients."""
    from primus_turbo.pytorch.ops import flash_attn_fp8_func

    torch.manual_seed(12)
    cfg = Float8QuantConfig(granularity="BLOCKWISE", block_size=32)
    q, k, v = _attn_inputs(torch.bfloat16, s=64, hq=2, hk=1, d=32, requires_grad=True)
    sink = torch.randn(2, requires_grad=True) if use_sink else None
    out = turbo.modules.TurboAttention(causal=causal, fp8_config=cfg)(q, k, v, sink=sink)
    dout = torch.randn_like(out)
    out.backward(dout)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    s2 = None if sink is None else sink.detach().clone().requires_grad_()
    ref = flash_attn_fp8_func(*leaves, causal=causal, sink=s2, fp8_config=cfg)
    ref.backward(dout)
    assert torch.equal(out, ref)
    for t, r in zip((q, k, v), leaves):
        assert torch.equal(t.grad, r.grad)
    if sink is not None:
        assert torch.equal(sink.grad, s2.grad)


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------
def test_rmsnorm_reference_constructor():
    """The reference API's constructor ``(normalized_shape, eps=None, elementwise_affine=True,
    zero_centered_gamma=False, device, dtype)``, positionally and by keyword, against an fp64
    reference; the earlier keyword names still work; bad arguments name themselves."""
    torch.manual_seed(9)
    x = torch.randn(4, 3, 48, requires_grad=True)
    dy = torch.randn(4, 3, 48)
    x64 = x.detach().double()
    rms = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)

    norm = turbo.modules.RMSNorm(48, 1e-5, True, True)  # positional: elementwise_affine, zero_centered_gamma
    assert norm.zero_centered_gamma and norm.elementwise_affine and norm.normalized_shape == (48,)
    assert torch.equal(norm.weight.detach(), torch.zeros(48))
    with torch.no_grad():
        norm.weight.copy_(0.2 * torch.randn(48))
    y = norm(x)
    _assert(x64 * rms * (1 + norm.weight.detach().double()), y, _db(torch.float32), "zero-centred y")

    plain = turbo.modules.RMSNorm([48], elementwise_affine=False)  # no gain: y = x * rsqrt(ms + 1e-6)
    assert plain.weight is None and plain.eps == 1e-6 and len(list(plain.parameters())) == 0
    assert "_unit_gain" not in plain.state_dict()
    x.grad = None
    y = plain(x)
    y.backward(dy)
    ref_x = x64.clone().requires_grad_()
    ref = ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref.backward(dy.double())
    _assert(ref.detach(), y, _db(torch.float32), "no-affine y")
    _assert(ref_x.grad, x.grad, _db(torch.float32), "no-affine dx")

    old = turbo.modules.RMSNorm(hidden=48, zero_centered=True)  # the earlier keyword names
    assert old.hidden == 48 and old.zero_centered_gamma
    for kwargs, exc, match in (
            (dict(normalized_shape=(8, 48)), ValueError, r"normalized_shape .*\(8, 48\)"),
            (dict(normalized_shape=0), ValueError, "positive, got 0"),
            (dict(normalized_shape=48, hidden=48), ValueError, "not both"),
            (dict(normalized_shape=48, eps=-1.0), ValueError, "eps must be >= 0, got -1.0"),
            (dict(normalized_shape=48, elementwise_affine=False, zero_centered_gamma=True), ValueError,
             "elementwise_affine"),
            (dict(), TypeError, "normalized_shape")):
        with pytest.raises(exc, match=match):
            turbo.modules.RMSNorm(**kwargs)


@pytest.mark.parametrize("dtype,zero_centered", [(torch.float32, False), (torch.float32, True),
                                                 (torch.bfloat16, False)])
def test_rmsnorm(dtype, zero_centered):
    torch.manual_seed(8)
    norm = turbo.modules.RMSNorm(64, eps=1e-6, zero_centered=zero_centered, dtype=dtype)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(64, dtype=dtype))
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    y = norm(x)
    assert y.shape == x.shape and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    w_eff = 1 + w64 if zero_centered else w64
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w_eff
    ref.backward(dy.double())
    bar = _db(dtype)
    _assert(ref.detach(), y, bar, "y")
    _assert(x64.grad, x.grad, bar, "dx")
    _assert(w64.grad, norm.weight.grad, bar, "dgamma")


# ----------------------------------------------------------------------------------------------
# torch.compile: every layer, forward and backward equal to eager
# ----------------------------------------------------------------------------------------------
def _compiled_matches_eager(module, inputs, kwargs=None, fullgraph=True, backend="aot_eager"):
    """``module(*inputs, **kwargs)`` eager and under ``torch.compile`` (aot_eager, on a deep copy, its
    own copies of the inputs): the output and every parameter's and float input's gradient under a
    random upstream gradient must be equal bit for bit (the compiled graph runs the same kernels,
    reached through the ops' custom ops or, where a layer runs outside the graph, eagerly).
    ``backend="inductor"``: >= 40 dB against eager instead (inductor generates its own kernels for the
    glue between the custom ops, which may round differently; a tensor it got wrong reads near 0 dB)."""
    kwargs = kwargs or {}
    twin = copy.deepcopy(module)
    compiled = torch.compile(twin, fullgraph=fullgraph, backend=backend)

    def same(x, y):
        if backend == "inductor":
            return x.dtype == y.dtype and snr_db(x.double(), y) >= 40.0
        return torch.equal(x, y)

    def leaves():
        return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]

    a, b = leaves(), leaves()
    y = module(*a, **kwargs)
    yc = compiled(*b, **kwargs)
    dy = torch.randn_like(y)
    y.backward(dy)
    yc.backward(dy)
    assert y.abs().sum() > 0 and same(y, yc), "output"
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(module.named_parameters(), twin.parameters())]
    grads += [(f"input {i}", t.grad, u.grad) for i, (t, u) in enumerate(zip(a, b)) if t.requires_grad]
    assert grads
    for name, g, gc in grads:
        assert g is not None and gc is not None and g.abs().sum() > 0 and same(g, gc), name


_COMPILE_CASES = {
    # the FP8 GEMMs' custom ops trace whole when the weight is quantized on every call
    "float8_linear_tensorwise": (lambda: turbo.modules.Float8Linear(64, 32, config=_F8_CONFIGS["tensorwise"],
                                                                    dtype=torch.bfloat16),
                                 lambda: [torch.randn(2, 16, 64, dtype=torch.bfloat16)], {}, True),
    "float8_linear_blockwise": (lambda: turbo.modules.Float8Linear(64, 32, config=_F8_CONFIGS["blockwise"],
                                                                   dtype=torch.bfloat16),
                                lambda: [torch.randn(32, 64, dtype=torch.bfloat16)], {}, True),
    # the micro-batch cache's branch runs outside the graph (Float8Linear.forward): a graph break
    "float8_linear_rowwise_first_microbatch": (
        lambda: turbo.modules.Float8Linear(64, 32, config=_F8_CONFIGS["rowwise"], dtype=torch.bfloat16),
        lambda: [torch.randn(32, 64, dtype=torch.bfloat16)], dict(is_first_microbatch=True), False),
    "grouped_linear_bf16": (lambda: turbo.modules.GroupedLinear(3, 32, 48, dtype=torch.bfloat16),
                            lambda: [torch.randn(16, 32, dtype=torch.bfloat16),
                                     torch.tensor([5, 0, 9], dtype=torch.int64)], {}, True),
    # the grouped FP8 / MXFP4 GEMMs' custom ops trace whole when the weight is quantized on every call
    **{f"grouped_linear_fp8_{g}": (
        (lambda g=g: turbo.modules.GroupedLinear(2, 64, 32, dtype=torch.bfloat16, config=_GROUPED_F8[g])),
        lambda: [torch.randn(40, 64, dtype=torch.bfloat16), torch.tensor([13, 20], dtype=torch.int64)], {}, True)
       for g in ("tensorwise", "rowwise", "hybrid_blockwise")},
    "grouped_linear_mxfp8": (
        lambda: turbo.modules.GroupedLinear(2, 64, 32, dtype=torch.bfloat16,
                                            config=Float8QuantConfig(granularity="MX_BLOCKWISE")),
        lambda: [torch.randn(40, 64, dtype=torch.bfloat16), torch.tensor([13, 20], dtype=torch.int64)], {}, True),
    "grouped_linear_mxfp4": (
        lambda: turbo.modules.GroupedLinear(2, 64, 32, dtype=torch.bfloat16, config=Float4QuantConfig()),
        lambda: [torch.randn(40, 64, dtype=torch.bfloat16), torch.tensor([13, 20], dtype=torch.int64)], {}, True),
    # the FP8 expert-weight cache's branch runs outside the graph (GroupedLinear.forward): a graph break
    "grouped_linear_fp8_blockwise_first_microbatch": (
        lambda: turbo.modules.GroupedLinear(2, 64, 32, dtype=torch.bfloat16, config=_GROUPED_F8["blockwise"]),
        lambda: [torch.randn(40, 64, dtype=torch.bfloat16), torch.tensor([13, 20], dtype=torch.int64)],
        dict(is_first_microbatch=True), False),
    "rmsnorm": (lambda: turbo.modules.RMSNorm(64, zero_centered=True),
                lambda: [torch.randn(3, 5, 64)], {}, True),
    # deterministic: the backward without atomic dQ (a run-dependent order would break bit equality)
    "turbo_attention": (lambda: turbo.modules.TurboAttention(causal=True, deterministic=True),
                        lambda: _attn_inputs(torch.float32), {}, True),
    "turbo_attention_fp8": (
        lambda: turbo.modules.TurboAttention(causal=True, deterministic=True,
                                             fp8_config=Float8QuantConfig(granularity="BLOCKWISE", block_size=32)),
        lambda: _attn_inputs(torch.bfloat16, s=64, hq=2, hk=1, d=32), {}, True),
}


@pytest.mark.parametrize("case", list(_COMPILE_CASES))
def test_module_torch_compile_matches_eager(case):
    make, inputs, kwargs, fullgraph = _COMPILE_CASES[case]
    torch.manual_seed(17)
    module = make()
    if isinstance(module, turbo.modules.RMSNorm):
        with torch.no_grad():  # a weight that is not all zeros (zero-centred init), so dgamma is checked
            module.weight.add_(0.1 * torch.randn_like(module.weight))
    _compiled_matches_eager(module, inputs(), kwargs, fullgraph)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU code generation")
@pytest.mark.parametrize("case", [c for c, v in _COMPILE_CASES.items() if v[3]])
def test_module_inductor_matches_eager_gpu(case):
    """The default compile backend, as a training script uses it, on every layer that traces whole
    (CPU CI compiles with aot_eager, and inductor's CUDA code has differed from its CPU code: the
    padded token layout it computed wrong in torch 2.11 was right on the CPU)."""
    make, inputs, kwargs, fullgraph = _COMPILE_CASES[case]
    torch.manual_seed(19)
    torch._dynamo.reset()
    module = make()
    if isinstance(module, turbo.modules.RMSNorm):
        with torch.no_grad():
            module.weight.add_(0.1 * torch.randn_like(module.weight))
    _compiled_matches_eager(module, inputs(), kwargs, fullgraph, backend="inductor")


def test_float8_linear_cache_under_torch_compile(monkeypatch):
    """is_first_microbatch under torch.compile keeps the cache's eager semantics: one quantization for
    a True micro-batch and the False ones after it, a fresh one after an optimizer step (a stale
    copy would give other numbers), outputs and gradients equal to the eager layer's."""
    torch.manual_seed(18)
    spy = _Spy(monkeypatch)
    cfg = _F8_CONFIGS["rowwise"]
    lin = turbo.modules.Float8Linear(64, 32, config=cfg, dtype=torch.bfloat16)
    eager = copy.deepcopy(lin)
    compiled = torch.compile(lin, backend="aot_eager")
    for i in range(3):
        x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y = compiled(x, is_first_microbatch=(i == 0))
        dy = torch.randn_like(y)
        y.backward(dy)
        y2 = eager(x2, is_first_microbatch=(i == 0))
        y2.backward(dy)
        assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad), i
    assert spy.calls == [True, True]  # once per layer (compiled, eager), with ROWWISE's transposed copy
    assert torch.equal(lin.weight.grad, eager.weight.grad) and torch.equal(lin.bias.grad, eager.bias.grad)
    for m in (lin, eager):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = compiled(x, is_first_microbatch=False)
        fresh = turbo.ops.gemm_fp8(x, lin.weight, trans_b=True, config=cfg) + lin.bias
    assert spy.calls == [True, True, False]
    assert torch.equal(y, fresh)


def test_grouped_linear_fp8_cache_under_torch_compile(monkeypatch):
    """GroupedLinear's FP8 expert-weight cache under torch.compile: quantized once for True then False,
    again after an optimizer step, numbers equal to the eager layer's."""
    torch.manual_seed(19)
    calls = _count_grouped_weight_copies(monkeypatch)
    mod = turbo.modules.GroupedLinear(2, 64, 32, dtype=torch.bfloat16, config=_GROUPED_F8["tensorwise"])
    eager = copy.deepcopy(mod)
    compiled = torch.compile(mod, backend="aot_eager")
    lens = torch.tensor([13, 20], dtype=torch.int64)
    for i in range(2):
        x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y = compiled(x, lens, is_first_microbatch=(i == 0))
        dy = torch.randn_like(y)
        y.backward(dy)
        y2 = eager(x2, lens, is_first_microbatch=(i == 0))
        y2.backward(dy)
        assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad), i
    assert calls == [True, True] and torch.equal(mod.weight.grad, eager.weight.grad)
    torch.optim.SGD(mod.parameters(), lr=0.5).step()
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = compiled(x, lens, is_first_microbatch=False)
        fresh = turbo.ops.grouped_gemm_fp8(x, mod.weight, lens, trans_b=True, config=_GROUPED_F8["tensorwise"])
    assert calls == [True, True, False]
    assert torch.equal(y, fresh)


def _every_layer(dtype):
    """One of each parameterised layer, small enough for the interpreter."""
    f8 = Float8QuantConfig(granularity=ScalingGranularity.TENSORWISE)
    return torch.nn.ModuleDict(dict(
        lin=turbo.modules.Linear(64, 32, dtype=dtype),
        f8=turbo.modules.Float8Linear(64, 32, config=f8, dtype=dtype),
        gl=turbo.modules.GroupedLinear(4, 64, 32, dtype=dtype),
        mlp=turbo.modules.GroupedMLP(4, 64, 32, dtype=dtype),
        moe=turbo.modules.MoELayer(64, 32, 4, 2, dtype=dtype),
        norm=turbo.modules.RMSNorm(64, dtype=dtype),
    ))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_device_init_then_to_empty(device, dtype):
    """TorchTitan's init: build on the meta device, ``to_empty`` on the real one, then every layer's
    ``reset_parameters``. Every parameter must be re-initialised (none left as the garbage
    ``to_empty`` gives, poisoned with NaN here), with the plain constructor's shapes, dtypes and
    initial spread, and the layers must then run forward and backward like plainly built ones."""
    plain = _every_layer(dtype)
    with torch.device("meta"):
        lazy = _every_layer(dtype)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device=device)
    with torch.no_grad():
        for p in lazy.parameters():
            p.fill_(float("nan"))
    for mod in lazy.modules():
        if mod is not lazy and hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    ours, theirs = dict(lazy.named_parameters()), dict(plain.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        q = theirs[name]
        assert (p.shape, p.dtype, p.device.type) == (q.shape, q.dtype, q.device.type), name
        assert torch.isfinite(p).all(), f"{name} not re-initialised after to_empty"
        if p.numel() > 1 and q.float().std() > 0:
            ratio = float(p.float().std() / q.float().std())
            assert 0.7 < ratio < 1.4, f"{name}: init spread {ratio:.2f}x the plain constructor's"
        else:
            assert torch.equal(p, q), name
    # the lazily built layers, loaded with the plain ones' weights, compute the same as they do
    lazy.load_state_dict(plain.state_dict())
    x = torch.randn(16, 64, dtype=dtype)
    for key in ("lin", "f8", "moe", "norm"):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = lazy[key](xa), plain[key](xb)
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        if device == "cpu":
            assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad), key
        else:  # fp32 atomics in the MoE path may reorder sums between two runs on the GPU
            _assert(yb, ya, 60.0, f"{key} out")
            _assert(xb.grad, xa.grad, 60.0, f"{key} dx")


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64, bias=False)
        self.gate = turbo.modules.RouterLinear(64, 4)  # a Linear subclass: left alone

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def test_convert_to_float8_swaps_plain_linears_in_place():
    torch.manual_seed(23)
    model = torch.nn.Sequential(_Mlp(), _Mlp(), torch.nn.Linear(64, 16))  # "2" is the output head
    keys, params = list(model.state_dict()), {n: p for n, p in model.named_parameters()}
    plain = copy.deepcopy(model)
    cfg = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE)
    out = turbo.modules.convert_to_float8(model, cfg, module_filter_fn=lambda m, fqn: fqn != "2")
    assert out is model
    kinds = {fqn: type(m) for fqn, m in model.named_modules()}
    for fqn in ("0.up", "0.down", "1.up", "1.down"):
        assert kinds[fqn] is turbo.modules.Float8Linear and model.get_submodule(fqn).config is cfg, fqn
    assert kinds["2"] is torch.nn.Linear and kinds["0.gate"] is turbo.modules.RouterLinear
    # the same parameter objects and state-dict keys (an optimizer built before still holds them)
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    # each converted layer computes gemm_fp8's result for its own weights
    x = torch.randn(32, 64)
    with torch.no_grad():
        got = model[0].up(x)
        ref = turbo.ops.gemm_fp8(x, plain[0].up.weight, trans_b=True, config=cfg) + plain[0].up.bias
    assert torch.equal(got, ref)
    y = model(x.requires_grad_())
    y.sum().backward()
    for fqn in ("0.up", "0.down", "1.up", "1.down", "2"):
        assert model.get_submodule(fqn).weight.grad is not None, fqn
    # converting again finds no plain Linear but the filtered head; no filter: the head goes too
    turbo.modules.convert_to_float8(model)
    assert type(model[2]) is turbo.modules.Float8Linear and model[2].config == Float8QuantConfig()
    with torch.device("meta"):
        lazy = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert type(turbo.modules.convert_to_float8(lazy)[0]) is turbo.modules.Float8Linear


def test_convert_to_float8_bad_arguments():
    lin = torch.nn.Linear(16, 16)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got Parameter"):
        turbo.modules.convert_to_float8(lin.weight)
    with pytest.raises(TypeError, match="config must be a Float8QuantConfig or None, got Float4QuantConfig"):
        turbo.modules.convert_to_float8(lin, Float4QuantConfig())
    with pytest.raises(TypeError, match="module_filter_fn must be callable, got str"):
        turbo.modules.convert_to_float8(lin, module_filter_fn="up")
    assert type(lin) is torch.nn.Linear
