"""Bad-input handling and empty tensors of the public ops and modules (the input-validation audit).

Two kinds of tests:

* bad input gets a clear ValueError / TypeError / NotImplementedError naming the op and the offending
  values (the cases the audit found failing deep inside: ZeroDivisionError, a broadcasting error in
  a backward, a torch constructor error, a silent no-op or a silently zero result);
* empty tensors (0 tokens / rows / groups / sequence length, empty feature dims) give outputs and
  gradients of the right shapes and values, checked against a reference.

Small shapes throughout: on CPU the Triton kernels run in the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float4QuantConfig
from primus_turbo.triton import triton_available

ops = turbo.ops
M = turbo.modules
bf16 = torch.bfloat16
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")
#: the devices whose Triton paths can run here: CPU through the interpreter, CUDA where present (the
#: empty-input tests run on both, so the GPU kernels' empty-input handling is tested too)
_KERNEL_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="CPU kernels need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]
kernel_devices = pytest.mark.parametrize("dev", _KERNEL_DEVICES)


def _kernel_dtype(dev: str) -> torch.dtype:
    """The GEMM tests' operand dtype: bf16 on CUDA (what every CUDA path takes), fp32 on CPU."""
    return bf16 if dev == "cuda" else torch.float32


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _other_device(dev: str) -> str:
    """A device unlike ``dev`` that needs no hardware: ``meta`` stands for a wrong device."""
    return "meta" if dev != "meta" else "cpu"


# ================================================================================================
# Bad input: clear errors naming the op and the values
# ================================================================================================
# ---- attention --------------------------------------------------------------------------------
@pytest.mark.parametrize("fn_name", ["flash_attn_func", "flash_attn_fp8_func"])
def test_attention_empty_head_dim_is_refused(fn_name):
    """head_dim_qk = 0 was a ZeroDivisionError (the default scale 1/sqrt(head_dim))."""
    fn = getattr(ops, fn_name)
    q = torch.randn(1, 4, 2, 0, dtype=bf16)
    with pytest.raises(ValueError, match=rf"{fn_name}: head_dim_qk must be >= 1, got q shape \(1, 4, 2, 0\)"):
        fn(q, q, torch.randn(1, 4, 2, 8, dtype=bf16))


def test_attention_varlen_empty_head_dim_is_refused():
    q = torch.randn(4, 2, 0, dtype=bf16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"flash_attn_varlen_func: head_dim_qk must be >= 1, got q shape \(4, 2, 0\)"):
        ops.flash_attn_varlen_func(q, q, torch.randn(4, 2, 8, dtype=bf16), cu, cu, 4, 4)


@pytest.mark.parametrize("fn_name", ["flash_attn_func", "flash_attn_fp8_func"])
def test_attention_zero_kv_heads_is_refused(fn_name):
    q = torch.randn(1, 4, 2, 8, dtype=bf16)
    kv = torch.randn(1, 4, 0, 8, dtype=bf16)
    with pytest.raises(ValueError, match=rf"{fn_name}: k and v need at least one head, got heads_kv=0"):
        getattr(ops, fn_name)(q, kv, kv)


@pytest.mark.parametrize("d_qk,d_v", [(300, 300), (16, 300)])
def test_attention_fp8_head_dim_limit_is_not_implemented(d_qk, d_v):
    """Was a RuntimeError("cannot run: ...") from the launcher check; an unsupported size is a
    NotImplementedError (still a RuntimeError subclass) naming both head dims, raised before any work."""
    q = torch.zeros(1, 4, 2, d_qk, dtype=bf16)
    v = torch.zeros(1, 4, 2, d_v, dtype=bf16)
    with pytest.raises(NotImplementedError,
                       match=rf"flash_attn_fp8_func: head dims above 256 .* head_dim_qk={d_qk}, head_dim_v={d_v}"):
        ops.flash_attn_fp8_func(q, q, v)


# ---- router GEMM main_grad ----------------------------------------------------------------------
def _router_weight(main_grad):
    w = torch.randn(4, 16, requires_grad=True)
    w.main_grad = main_grad
    return w


@pytest.mark.parametrize("main_grad,exc,match", [
    (torch.zeros(3), ValueError, r"weight.main_grad must match weight, got main_grad \(3,\) on cpu, weight \(4, 16\)"),
    (torch.zeros(4, 16, device="meta"), ValueError, r"weight.main_grad must match weight, got main_grad \(4, 16\) on meta"),
    (torch.zeros(4, 16, dtype=torch.float16), TypeError, r"weight.main_grad must be float32 .* got torch.float16"),
], ids=["shape", "device", "dtype"])
def test_router_gating_linear_bad_main_grad(main_grad, exc, match):
    """Was a broadcasting RuntimeError inside the backward's ``main_grad.add_`` (shape), or a silent
    no-op that dropped the weight gradient (a main_grad on another device)."""
    x = torch.randn(8, 16, dtype=bf16, requires_grad=True)
    with pytest.raises(exc, match=rf"router_gating_linear: {match}"):
        ops.router_gating_linear(x, _router_weight(main_grad), fuse_bgrad_accum_pattern="megatron")


def test_router_gating_linear_main_grad_not_needed_without_grad():
    """No weight gradient to accumulate: main_grad is not looked at beyond its presence."""
    x = torch.randn(8, 16, dtype=bf16)
    w = _router_weight(torch.zeros(3))
    with torch.no_grad():
        y = ops.router_gating_linear(x, w, fuse_bgrad_accum_pattern="megatron")
    torch.testing.assert_close(y, x.float() @ w.detach().t(), rtol=1e-5, atol=1e-5)


def test_grouped_gemm_glu_main_grad_message_names_w():
    x = torch.randn(8, 32)
    w = torch.randn(2, 8, 32, requires_grad=True)
    w.main_grad = torch.zeros(3)
    with pytest.raises(ValueError, match=r"grouped_gemm_glu: w.main_grad must match w, got main_grad \(3,\)"):
        ops.grouped_gemm_glu(x, w, torch.tensor([3, 5]), fuse_bgrad_accum_pattern="megatron")


# ---- normalization ------------------------------------------------------------------------------
@pytest.mark.parametrize("fn_name", ["rmsnorm", "rmsnorm_residual"])
def test_rmsnorm_infinite_eps_is_refused(fn_name):
    """eps=inf silently gave y = 0 and zero gradients."""
    x = torch.randn(4, 8)
    args = (x, torch.zeros_like(x)) if fn_name == "rmsnorm_residual" else (x,)
    with pytest.raises(ValueError, match=rf"{fn_name}: eps must be a non-negative float \(finite\), got inf"):
        getattr(ops, fn_name)(*args, torch.ones(8), eps=float("inf"))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(normalized_shape=8.0), ValueError, r"normalized_shape must be one int .* got 8.0"),
    (dict(normalized_shape=8, eps="a"), ValueError, r"eps must be a float >= 0 or None, got 'a'"),
    (dict(normalized_shape=8, eps=float("inf")), ValueError, r"eps must be >= 0, got inf"),
])
def test_rmsnorm_module_bad_constructor_args(kwargs, exc, match):
    """Were ``TypeError: 'float' object is not iterable`` and ``could not convert string to float``
    (no op named), and an accepted eps=inf."""
    with pytest.raises(exc, match=rf"RMSNorm: {match}"):
        M.RMSNorm(**kwargs)


def test_rmsnorm_module_non_tensor_input():
    with pytest.raises(TypeError, match="RMSNorm: input must be a torch.Tensor, got list"):
        M.RMSNorm(8)([1.0] * 8)


# ---- linear modules -----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", ["Linear", "Float8Linear", "RouterLinear"])
@pytest.mark.parametrize("bad", [-1, 2.5])
def test_linear_bad_sizes(cls, bad):
    """A negative size was torch's ``Trying to create tensor with negative dimension``."""
    with pytest.raises(ValueError, match=rf"{cls}: in_features must be a non-negative int, got {bad}"):
        getattr(M, cls)(bad, 8)
    with pytest.raises(ValueError, match=rf"{cls}: out_features must be a non-negative int, got {bad}"):
        getattr(M, cls)(8, bad)


@pytest.mark.parametrize("cls", ["Linear", "Float8Linear"])
def test_linear_non_tensor_input(cls):
    with pytest.raises(TypeError, match=rf"{cls}: input must be a torch.Tensor, got list"):
        getattr(M, cls)(4, 4)([1.0] * 4)


def test_float8_linear_is_first_microbatch_type():
    """A non-bool was taken for its truth value (``"no"`` cached the weight)."""
    with pytest.raises(TypeError, match="Float8Linear: is_first_microbatch must be None, True or False, got 'no'"):
        M.Float8Linear(32, 32)(torch.randn(4, 32), is_first_microbatch="no")


@pytest.mark.parametrize("arg", ["num_groups", "in_features", "out_features"])
def test_grouped_linear_non_int_sizes(arg):
    """A float size reached ``torch.empty`` (``empty() takes 1 positional argument but 3 were given``)."""
    sizes = dict(num_groups=2, in_features=32, out_features=32)
    sizes[arg] = 2.5
    with pytest.raises(TypeError, match=rf"GroupedLinear: {arg} must be an int, got 2.5"):
        M.GroupedLinear(**sizes)


def test_grouped_linear_non_tensor_input():
    with pytest.raises(TypeError, match="GroupedLinear: x must be a torch.Tensor, got list"):
        M.GroupedLinear(2, 4, 4)([[1.0] * 4], torch.tensor([1, 0]))


# ---- attention module ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(window_size=3), r"window_size must be \(left, right\) ints >= -1 .* got 3"),
    (dict(window_size=(-5, 0)), r"window_size must be \(left, right\) ints >= -1 .* got \(-5, 0\)"),
    (dict(window_size=("a", "b")), r"window_size .* got \('a', 'b'\)"),
    (dict(softmax_scale="x"), r"softmax_scale must be a finite float or None, got 'x'"),
    (dict(softmax_scale=float("nan")), r"softmax_scale must be a finite float or None, got nan"),
])
def test_turbo_attention_bad_constructor_args(kwargs, match):
    """The class promises unsupported options raise at construction: these were accepted (and
    failed at the first forward) or raised ``'int' object is not subscriptable`` / ``invalid literal
    for int()``."""
    with pytest.raises(ValueError, match=rf"TurboAttention: {match}"):
        M.TurboAttention(**kwargs)


# ---- MoE layer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(scaling_factor=float("nan")), r"scaling_factor must be finite, got nan"),
    (dict(scaling_factor=float("inf")), r"scaling_factor must be finite, got inf"),
    (dict(activation="relu"), r"activation must be one of \['geglu', 'swiglu'\], got 'relu'"),
    (dict(config="fp8"), r"config must be a Float8QuantConfig, a Float4QuantConfig or None, got str"),
])
def test_moe_layer_bad_constructor_args(kwargs, match):
    """scaling_factor NaN / inf was accepted (the router refused it at the first forward); the
    activation and config errors named GroupedMLP, a submodule the caller did not build."""
    with pytest.raises(ValueError, match=rf"MoELayer: {match}"):
        M.MoELayer(16, 16, 4, 2, **kwargs)


def test_moe_layer_bad_forward_args():
    layer = M.MoELayer(16, 16, 4, 2)
    with pytest.raises(ValueError, match=r"MoELayer: hidden_states on meta, the layer's parameters on cpu"):
        layer(torch.randn(8, 16, device="meta"))
    with pytest.raises(TypeError, match=r"MoELayer: is_first_microbatch must be None, True or False, got 'x'"):
        layer(torch.randn(8, 16), is_first_microbatch="x")


# ---- a sweep over the ops: every bad input named, none deep inside -------------------------------
def _bad_calls():
    f32 = torch.float32
    x2, w2 = torch.randn(4, 32), torch.randn(32, 32)
    gl = torch.tensor([1, 3])
    qkv = torch.randn(1, 4, 2, 8, dtype=bf16)
    meta = _other_device("cpu")
    return [
        ("gemm", lambda: ops.gemm(x2.to(torch.float64), w2.to(torch.float64)), TypeError, r"a.dtype .* torch.float64"),
        ("gemm", lambda: ops.gemm(x2, w2.to(meta)), ValueError, r"same device, got a on cpu, b on meta"),
        ("gemm", lambda: ops.gemm(x2, torch.randn(16, 32)), ValueError, r"K mismatch, a\(4, 32\)"),
        ("gemm_fp4", lambda: ops.gemm_fp4(torch.randn(4, 16), torch.randn(16, 32)), ValueError,
         r"multiple of 32, got K=16"),
        ("grouped_gemm", lambda: ops.grouped_gemm(x2, torch.randn(2, 32, 32), gl.int()), TypeError,
         r"group_lens must be int64, got torch.int32"),
        ("grouped_gemm", lambda: ops.grouped_gemm(x2, torch.randn(2, 32, 32), gl.to(meta)), ValueError,
         r"group_lens must be on a's device cpu, got meta"),
        ("grouped_gemm_fp4", lambda: ops.grouped_gemm_fp4(x2, torch.randn(2, 32, 32), gl[:1]), ValueError,
         r"group_lens must be 1-D with 2 entries .* got shape \(1,\)"),
        ("grouped_gemm_glu", lambda: ops.grouped_gemm_glu(x2, torch.randn(2, 5, 32), gl), ValueError,
         r"even row count, got \(2, 5, 32\)"),
        ("flash_attn_func", lambda: ops.flash_attn_func(qkv, qkv, qkv.to(meta)), ValueError, r"v=meta"),
        ("flash_attn_func", lambda: ops.flash_attn_func(qkv, qkv, qkv, window_size=(-2, 0)), ValueError,
         r"got \(-2, 0\)"),
        ("flash_attn_fp8_func", lambda: ops.flash_attn_fp8_func(qkv.float(), qkv.float(), qkv.float()), TypeError,
         r"bfloat16 or float16, got torch.float32"),
        ("fused_group_topk_routing_with_aux_score",
         lambda: ops.fused_group_topk_routing_with_aux_score(torch.randn(4, 8), 9), ValueError, r"topk \(9\) exceeds"),
        ("indices_to_multihot", lambda: ops.indices_to_multihot(torch.zeros(2, 2), torch.rand(2, 2), 4), ValueError,
         r"integer dtype, got torch.float32"),
        ("tokens_per_expert_to_mask", lambda: ops.tokens_per_expert_to_mask(torch.ones(2, dtype=torch.long), -1),
         ValueError, r"non-negative int, got -1"),
        ("router_gating_linear", lambda: ops.router_gating_linear(x2.to(bf16), torch.randn(8, 32, dtype=torch.float64)),
         ValueError, r"weight.dtype .* got torch.float64"),
        ("swiglu", lambda: ops.swiglu(torch.randn(4, 7)), ValueError, r"even last dim, got shape \(4, 7\)"),
        ("swiglu_with_probs", lambda: ops.swiglu_with_probs(torch.randn(4, 8), torch.ones(4, device=meta)),
         ValueError, r"same device, got cpu and meta"),
        ("geglu_with_probs", lambda: ops.geglu_with_probs(torch.randn(4, 8), torch.ones(4, dtype=bf16)), TypeError,
         r"probs.dtype must be float32, got torch.bfloat16"),
        ("rmsnorm", lambda: ops.rmsnorm(torch.randn(4, 8), torch.ones(7, dtype=f32)), ValueError,
         r"gamma must be \[H\] = \[8\] .* got shape \(7,\)"),
        ("rmsnorm_residual", lambda: ops.rmsnorm_residual(torch.randn(4, 8), torch.randn(4, 8, dtype=bf16),
                                                          torch.ones(8)), TypeError, r"got torch.bfloat16"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_inputs_named(case):
    op, call, exc, match = _bad_calls()[case]
    with pytest.raises(exc, match=rf"{op}: .*{match}"):
        call()


# ================================================================================================
# Empty tensors: right shapes, right values
# ================================================================================================
def _zeros(t: torch.Tensor) -> bool:
    return t is not None and bool(torch.all(t == 0))


# ---- linear modules with an empty feature dim (the module's reshape(-1, 0) failed) ---------------
@pytest.mark.parametrize("cls", ["Linear", "Float8Linear"])
def test_linear_zero_in_features(cls):
    """Was ``cannot reshape tensor of 0 elements into shape [-1, 0]``: y = 0 @ W^T + b = b per row."""
    torch.manual_seed(0)
    lin = getattr(M, cls)(0, 8)
    x = torch.randn(2, 3, 0, requires_grad=True)
    y = lin(x)
    assert y.shape == (2, 3, 8)
    torch.testing.assert_close(y, lin.bias.detach().expand(2, 3, 8))
    y.sum().backward()
    assert x.grad.shape == (2, 3, 0) and lin.weight.grad.shape == (8, 0)
    torch.testing.assert_close(lin.bias.grad, torch.full((8,), 6.0))


@pytest.mark.parametrize("cls", ["Linear", "Float8Linear"])
def test_linear_zero_out_features_and_rows(cls):
    lin = getattr(M, cls)(32, 0)
    x = torch.randn(4, 32, requires_grad=True)
    y = lin(x)
    assert y.shape == (4, 0)
    y.sum().backward()
    assert _zeros(x.grad) and x.grad.shape == (4, 32) and lin.weight.grad.shape == (0, 32)
    lin = getattr(M, cls)(32, 16)
    x = torch.randn(2, 0, 32, requires_grad=True)
    y = lin(x)
    assert y.shape == (2, 0, 16)
    y.sum().backward()
    assert x.grad.shape == (2, 0, 32) and _zeros(lin.weight.grad) and _zeros(lin.bias.grad)


# ---- GEMMs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["gemm", "gemm_fp4"])
@pytest.mark.parametrize("m,n,k", [(0, 32, 32), (32, 0, 32), (32, 32, 0)], ids=["m0", "n0", "k0"])
def test_gemm_empty(op, m, n, k):
    a = torch.randn(m, k, requires_grad=True)
    b = torch.randn(k, n, requires_grad=True)
    out = getattr(ops, op)(a, b)
    assert out.shape == (m, n)
    assert _zeros(out)  # empty, or (k = 0) an empty sum
    out.backward(torch.randn(m, n))
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert _zeros(a.grad) and _zeros(b.grad)


@needs_triton
@pytest.mark.parametrize("op", ["grouped_gemm", "grouped_gemm_fp4"])
@pytest.mark.parametrize("m,g,lens", [(0, 2, [0, 0]), (8, 0, []), (8, 2, [0, 0])], ids=["m0", "g0", "lens0"])
@kernel_devices
def test_grouped_gemm_empty(op, m, g, lens, dev):
    """No tokens, no experts, or experts without rows: zero output rows, zero gradients."""
    trans_b = op == "grouped_gemm_fp4"
    dt = _kernel_dtype(dev)
    a = torch.randn(m, 32, dtype=dt, device=dev, requires_grad=True)
    b = torch.randn(g, 32, 32, dtype=dt, device=dev, requires_grad=True)
    out = getattr(ops, op)(a, b, torch.tensor(lens, dtype=torch.int64, device=dev), trans_b=trans_b)
    assert out.shape == (m, 32) and _zeros(out)
    out.backward(torch.randn(m, 32, dtype=dt, device=dev))
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert _zeros(a.grad) and _zeros(b.grad)


@needs_triton
@kernel_devices
def test_grouped_gemm_one_group_empty_matches_reference(dev):
    """An empty group next to a full one: the full one is the dense product (fp64 reference of
    the same values), gradients too."""
    torch.manual_seed(1)
    dt = _kernel_dtype(dev)
    tol = 2e-2 if dt == bf16 else 1e-4
    a = torch.randn(8, 32, dtype=dt, device=dev, requires_grad=True)
    b = torch.randn(2, 32, 16, dtype=dt, device=dev, requires_grad=True)
    out = ops.grouped_gemm(a, b, torch.tensor([0, 8], device=dev))
    g = torch.randn(8, 16, dtype=dt, device=dev)
    out.backward(g)
    ref_a, ref_b = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = ref_a @ ref_b[1]
    ref.backward(g.double())
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(a.grad.double(), ref_a.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(b.grad[1].double(), ref_b.grad[1], rtol=tol, atol=tol)
    assert _zeros(b.grad[0])


@needs_triton
@kernel_devices
def test_grouped_gemm_glu_empty_tokens(dev):
    dt = _kernel_dtype(dev)
    x = torch.randn(0, 32, dtype=dt, device=dev, requires_grad=True)
    w = torch.randn(2, 8, 32, dtype=dt, device=dev, requires_grad=True)
    p = torch.rand(0, device=dev, requires_grad=True)
    out = ops.grouped_gemm_glu(x, w, torch.zeros(2, dtype=torch.int64, device=dev), probs=p)
    assert out.shape == (0, 4)
    out.sum().backward()
    assert x.grad.shape == (0, 32) and p.grad.shape == (0,) and _zeros(w.grad) and w.grad.shape == w.shape


# ---- attention ------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("fn_name", ["flash_attn_func", "flash_attn_fp8_func"])
@pytest.mark.parametrize("b,sq,sk", [(0, 4, 4), (1, 0, 4), (1, 4, 0)], ids=["batch0", "sq0", "sk0"])
@kernel_devices
def test_attention_empty(fn_name, b, sq, sk, dev):
    """Rows that see no key give zeros (LSE +inf) and zero gradients; empty query rows give zero dK, dV."""
    q = torch.randn(b, sq, 2, 16, dtype=bf16, device=dev, requires_grad=True)
    k = torch.randn(b, sk, 2, 16, dtype=bf16, device=dev, requires_grad=True)
    v = torch.randn(b, sk, 2, 16, dtype=bf16, device=dev, requires_grad=True)
    out, lse = getattr(ops, fn_name)(q, k, v, return_lse=True)
    assert out.shape == (b, sq, 2, 16) and lse.shape == (b, 2, sq)
    assert _zeros(out)
    if sk == 0 and sq > 0:
        assert bool(torch.all(torch.isinf(lse) & (lse > 0)))
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert t.grad.shape == t.shape and _zeros(t.grad)


@needs_triton
@kernel_devices
def test_attention_varlen_empty_sequences(dev):
    """A zero-length sequence between two others: its neighbours are dense attention of their own rows."""
    torch.manual_seed(2)
    q = torch.randn(6, 2, 16, dtype=bf16, device=dev, requires_grad=True)
    k = torch.randn(6, 2, 16, dtype=bf16, device=dev, requires_grad=True)
    v = torch.randn(6, 2, 16, dtype=bf16, device=dev, requires_grad=True)
    cu = torch.tensor([0, 2, 2, 6], dtype=torch.int32, device=dev)
    out = ops.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4)
    assert out.shape == (6, 2, 16)
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[s:e].float().transpose(0, 1) for t in (q, k, v))).transpose(0, 1) for s, e in ((0, 2), (2, 6))])
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    empty = ops.flash_attn_varlen_func(q[:0], k[:0], v[:0], cu[:1], cu[:1], 0, 0)
    assert empty.shape == (0, 2, 16)


# ---- router, activation, normalization -------------------------------------------------------------
@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_router_empty_tokens(score_function):
    logits = torch.randn(0, 8, requires_grad=True)
    aux, probs, rmap = ops.fused_group_topk_routing_with_aux_score(logits, 2, 2, 1, score_function)
    assert aux.shape == probs.shape == rmap.shape == (0, 8)
    (aux.sum() + probs.sum()).backward()
    assert logits.grad.shape == (0, 8)
    routing_map, dense = ops.indices_to_multihot(torch.zeros(0, 2, dtype=torch.long), torch.rand(0, 2), 4)
    assert routing_map.shape == dense.shape == (0, 4)
    assert ops.tokens_per_expert_to_mask(torch.zeros(0, dtype=torch.long), 3).tolist() == [False] * 3


@needs_triton
@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_router_gating_linear_empty_tokens(lead):
    x = torch.randn(*lead, 16, dtype=bf16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    y = ops.router_gating_linear(x, w, b)
    assert y.shape == (*lead, 4) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.shape == x.shape and _zeros(w.grad) and _zeros(b.grad)


@pytest.mark.parametrize("fn_name", ["swiglu_with_probs", "geglu_with_probs"])
@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (2, 0, 8)], ids=["rows0", "feat0", "lead0"])
def test_activation_empty(fn_name, shape):
    x = torch.randn(*shape, requires_grad=True)
    p = torch.rand(*shape[:-1], requires_grad=True)
    out = getattr(ops, fn_name)(x, p)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    out.sum().backward()
    assert x.grad.shape == x.shape and p.grad.shape == p.shape and _zeros(p.grad)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_rmsnorm_empty_rows(shape):
    x = torch.randn(*shape, requires_grad=True)
    r = torch.randn(*shape, requires_grad=True)
    g = torch.rand(8, requires_grad=True)
    y, s = ops.rmsnorm_residual(x, r, g)
    assert y.shape == s.shape == x.shape
    (y.sum() + s.sum()).backward()
    assert x.grad.shape == r.grad.shape == x.shape and g.grad.shape == (8,) and _zeros(g.grad)


# ---- modules -----------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("config", [None, Float4QuantConfig()], ids=["bf16-path", "mxfp4"])
@kernel_devices
def test_moe_layer_empty_tokens(config, dev):
    torch.manual_seed(3)
    layer = M.MoELayer(32, 32, 4, 2, config=config, aux_loss_coeff=0.1).to(dev)
    x = torch.randn(2, 0, 32, device=dev, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 0, 32)
    (y.sum() + layer.aux_loss).backward()
    assert x.grad.shape == x.shape
    assert layer.aux_loss.shape == () and float(layer.aux_loss) == 0.0
    assert _zeros(layer.router.weight.grad)
    for w in (layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight):
        assert w.grad.shape == w.shape and _zeros(w.grad)
    assert layer.tokens_per_expert.tolist() == [0, 0, 0, 0]
