"""turbo.ops.router_gating_linear (fp32 router over bf16 tokens) and turbo.modules.RouterLinear,
against float64 references; the fused kernels run on CUDA and on CPU under the interpreter."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.ops.moe_router_gemm import router_gating_linear, router_gemm_backend
from primus_turbo.testing import rel_err
from primus_turbo.testing.numerics import poisoned_allocations
from primus_turbo.triton import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")

# Near-fp32 agreement with the float64 reference: within 20x PyTorch's own fp32 GEMM error on the
# same data, or FP32_REL where that is larger. The tensor cores' accumulation inside one MMA keeps
# fewer bits than an fp32 FMA chain: H200, T = 16384, H = 2048-7168: 2-8e-6 against cuBLAS fp32's
# 0.6-1.1e-6, up to 10.4x (scripts/diag_router_gemm.py, the tests); a bf16 router is at ~2e-3. On
# the CPU interpreter (exact fp32 sums) ~1e-7: a dropped split piece (2e-6 or more) fails there.
FP32_REL = 1e-6
FP32_FACTOR = 20.0


def _bound(ref, torch_fp32):
    return max(FP32_REL, FP32_FACTOR * rel_err(ref, torch_fp32))

CASES = [  # (leading shape of x, H, E, bias)
    ((100,), 96, 8, False),
    ((2, 19), 200, 12, True),   # [B, S, H] input, edge tiles in T and H, bias
    ((130,), 64, 70, True),     # E > 64: two expert steps in grad_input, one masked
    ((1,), 48, 4, False),       # one token, E below the 16-wide MMA
]
GPU_CASES = [
    ((16384,), 2880, 32, False),  # GPT-OSS-20B
    ((4099,), 7168, 256, True),   # DeepSeek-V3 (all experts), ragged T
    ((8192,), 4096, 8, False),    # Mixtral-8x7B
]


def _inputs(lead, h, e, bias, device, scale=0.05):
    x = torch.randn(*lead, h, device=device).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(e, h, device=device) * scale).requires_grad_()
    b = torch.randn(e, device=device).requires_grad_() if bias else None
    return x, w, b


def _ref(x, w, b, g):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    y = x64 @ w64.t()
    if b64 is not None:
        y = y + b64
    y.backward(g.double())
    return y.detach(), x64.grad, w64.grad, (b64.grad if b64 is not None else None)


def _check_dx(ref, dx):
    """dx is the fp32 sum rounded to bf16: within one bf16 ulp of the exact value (the GPU rounds
    to nearest, half an ulp; the CPU interpreter's bf16 casts truncate, under one ulp)."""
    assert dx.dtype == torch.bfloat16
    err = (dx.double() - ref).abs()
    ulps = 0.5 * (1 + 1e-3) if dx.is_cuda else 1.0
    bound = ref.abs() * (ulps * 2.0**-7) + 1e-5 * ref.abs().max()
    assert torch.all(err <= bound), f"dx: worst excess {(err - bound).max().item():.3e}"


def _run_case(lead, h, e, bias, device, monkeypatch):
    x, w, b = _inputs(lead, h, e, bias, device)
    assert router_gemm_backend(x, w, b) == "triton"
    g = torch.randn(*lead, e, device=device)
    with poisoned_allocations(monkeypatch):
        y = router_gating_linear(x, w, b)
        y.backward(g)
    ry, rdx, rdw, rdb = _ref(x, w, b, g)
    assert y.dtype == torch.float32 and y.shape == (*lead, e)
    x2, g2 = x.detach().reshape(-1, h).float(), g.reshape(-1, e)
    ty = (x2 @ w.detach().t()).reshape(y.shape) + (b.detach() if bias else 0)
    assert rel_err(ry, y) <= _bound(ry, ty), ("y", rel_err(ry, y), rel_err(ry, ty))
    _check_dx(rdx, x.grad)
    tdw = g2.t() @ x2
    assert w.grad.dtype == torch.float32 and rel_err(rdw, w.grad) <= _bound(rdw, tdw), ("dw", rel_err(rdw, w.grad))
    if bias:
        assert rel_err(rdb, b.grad) <= FP32_REL, ("db", rel_err(rdb, b.grad))


@needs_triton
@pytest.mark.parametrize("lead,h,e,bias", CASES)
def test_fused_matches_fp64(lead, h, e, bias, device, monkeypatch):
    _run_case(lead, h, e, bias, device, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,h,e,bias", GPU_CASES)
def test_fused_matches_fp64_model_shapes(lead, h, e, bias, device, monkeypatch):
    _run_case(lead, h, e, bias, device, monkeypatch)


@needs_triton
def test_fused_weight_grad_is_deterministic(device):
    x, w, _ = _inputs((300,), 160, 24, False, device)
    g = torch.randn(300, 24, device=device)
    grads = []
    for _ in range(2):
        w.grad = None
        router_gating_linear(x, w).backward(g)
        grads.append(w.grad.clone())
    assert torch.equal(grads[0], grads[1])


@needs_triton
@pytest.mark.parametrize("bias", [False, True])
def test_fused_bf16_weight_fp32_router_dtype(bias, device, monkeypatch):
    """Megatron's form: a bf16 router weight, fp32 logits (``router_dtype``), positional order
    ``(inp, weight, bias, router_dtype)``; weight and bias grads in bf16."""
    x = torch.randn(90, 160, device=device).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(12, 160, device=device) * 0.05).to(torch.bfloat16).requires_grad_()
    b = torch.randn(12, device=device).to(torch.bfloat16).requires_grad_() if bias else None
    assert router_gemm_backend(x, w, b, torch.float32) == "triton"
    g = torch.randn(90, 12, device=device)
    with poisoned_allocations(monkeypatch):
        y = router_gating_linear(x, w, b, torch.float32)
        y.backward(g)
    ry, rdx, rdw, rdb = _ref(x, w, b, g)
    assert y.dtype == torch.float32
    ty = x.detach().float() @ w.detach().float().t() + (b.detach().float() if bias else 0)
    assert rel_err(ry, y) <= _bound(ry, ty), rel_err(ry, y)
    _check_dx(rdx, x.grad)
    assert w.grad.dtype == torch.bfloat16 and rel_err(rdw, w.grad) <= 2.0**-8
    if bias:
        assert b.grad.dtype == torch.bfloat16 and rel_err(rdb, b.grad) <= 2.0**-8


def test_router_dtype_other_than_fp32_takes_the_torch_expression(device):
    x = torch.randn(20, 32, device=device).to(torch.bfloat16)
    w = torch.randn(4, 32, device=device)
    assert router_gemm_backend(x, w, None, torch.bfloat16) == "torch"
    y = router_gating_linear(x, w, None, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert rel_err(x.double() @ w.double().t(), y) <= 1e-2


@needs_triton
def test_fused_forward_split_is_exact(device):
    """One-hot token rows pick weight columns: the kernel's three bf16 pieces of each fp32 weight
    (magnitudes over 50 decades, all with normal bf16 pieces: the lowest piece sits ~2**-17 below
    the value, and below 2**-126 it underflows, as the module says) must add back to it bit for bit."""
    from primus_turbo.triton.moe.router_gemm_kernel import router_fwd_launch

    e, h = 24, 200
    w = (torch.randn(e, h) * torch.logspace(-25, 25, e * h).reshape(e, h)).to(device)
    x = torch.eye(h, device=device, dtype=torch.bfloat16)  # token t = unit vector t: picks column t
    y = router_fwd_launch(x, w)
    assert torch.equal(y, w.t())


@pytest.mark.parametrize("xdt,wdt", [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.float32)])
def test_other_dtypes_take_the_torch_expression(xdt, wdt, device):
    x = torch.randn(40, 64, device=device).to(xdt).requires_grad_()
    w = (torch.randn(6, 64, device=device) * 0.1).to(wdt).requires_grad_()
    assert router_gemm_backend(x, w) == "torch"
    g = torch.randn(40, 6, device=device).to(wdt)
    y = router_gating_linear(x, w)
    y.backward(g)
    ry, rdx, rdw, _ = _ref(x, w, None, g)
    assert y.dtype == wdt and x.grad.dtype == xdt and w.grad.dtype == wdt
    tol = 1e-5 if wdt == torch.float32 else 1e-2
    assert rel_err(ry, y) <= tol and rel_err(rdw, w.grad) <= tol
    assert rel_err(rdx, x.grad) <= max(tol, 1e-2 if xdt != torch.float32 else tol)


@needs_triton
def test_switch_off_gives_the_torch_expression(device, monkeypatch):
    x, w, b = _inputs((50,), 80, 10, True, device)
    g = torch.randn(50, 10, device=device)
    y = router_gating_linear(x, w, b)
    y.backward(g)
    fused = (y.detach(), x.grad.clone(), w.grad.clone(), b.grad.clone())
    monkeypatch.setenv("PRIMUS_TURBO_ROUTER_GEMM_FUSED", "0")
    assert router_gemm_backend(x, w, b) == "torch"
    x.grad = w.grad = b.grad = None
    y = router_gating_linear(x, w, b)
    y.backward(g)
    for a, r, tol in zip(fused, (y.detach(), x.grad, w.grad, b.grad), (FP32_REL, 1e-2, FP32_REL, FP32_REL)):
        assert rel_err(r.double(), a) <= tol


@pytest.mark.parametrize("fused", [True, False])
def test_main_grad_accumulation(fused, device, monkeypatch):
    if fused and not triton_available():
        pytest.skip("needs triton")
    if not fused:
        monkeypatch.setenv("PRIMUS_TURBO_ROUTER_GEMM_FUSED", "0")
    x, w, _ = _inputs((64,), 96, 8, False, device)
    start = torch.randn(8, 96, device=device)
    w.main_grad = start.clone()
    total = start.double()
    for _ in range(3):  # micro-batches
        xb = torch.randn_like(x).requires_grad_()
        g = torch.randn(64, 8, device=device)
        router_gating_linear(xb, w, fuse_bgrad_accum_pattern="megatron").backward(g)
        total = total + g.double().t() @ xb.detach().double()
        assert w.grad_added_to_main_grad is True
        w.grad = None
    assert rel_err(total, w.main_grad) <= FP32_REL


@needs_triton
def test_empty_tokens(device):
    x = torch.randn(0, 32, device=device).to(torch.bfloat16).requires_grad_()
    w = torch.randn(4, 32, device=device).requires_grad_()
    y = router_gating_linear(x, w)
    assert y.shape == (0, 4) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.shape == (0, 32) and torch.equal(w.grad, torch.zeros_like(w))


@needs_triton
def test_strided_and_transposed_inputs(device):
    base = torch.randn(40, 100, device=device).to(torch.bfloat16)
    w = torch.randn(5, 64, device=device) * 0.1
    for x in (base[:, 10:74], base.t()[:64].t()):  # a column window, a column-major view
        y = router_gating_linear(x, w)
        assert rel_err(x.double() @ w.double().t(), y) <= FP32_REL


def test_bad_inputs():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    w = torch.randn(4, 16)
    with pytest.raises(ValueError, match="last dim must equal weight.shape"):
        router_gating_linear(torch.randn(8, 12, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        router_gating_linear(x, w[None])
    with pytest.raises(ValueError, match="weight must be non-empty"):
        router_gating_linear(torch.randn(8, 0, dtype=torch.bfloat16), torch.randn(4, 0))
    with pytest.raises(ValueError, match="x.dtype must be"):
        router_gating_linear(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        router_gating_linear(x, [[1.0]])
    with pytest.raises(ValueError, match="bias must be \\[4\\]"):
        router_gating_linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="bias must be \\[4\\]"):
        router_gating_linear(x, w, torch.randn(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="is on meta but weight is on cpu"):
        router_gating_linear(x.to("meta"), w)
    with pytest.raises(ValueError, match="needs weight.main_grad"):
        router_gating_linear(x, w, fuse_bgrad_accum_pattern="megatron")
    with pytest.raises(ValueError, match="fuse_bgrad_accum_pattern must be"):
        router_gating_linear(x, w, fuse_bgrad_accum_pattern="te")
    with pytest.raises(ValueError, match="router_dtype must be"):
        router_gating_linear(x, w, None, torch.float64)


@needs_triton
def test_router_linear_module(device):
    lin = turbo.modules.RouterLinear(48, 6, bias=False, device=device, dtype=torch.float32)
    x = torch.randn(3, 7, 48, device=device).to(torch.bfloat16).requires_grad_()
    y = lin(x)
    assert y.shape == (3, 7, 6) and y.dtype == torch.float32
    assert rel_err(x.detach().double() @ lin.weight.detach().double().t(), y) <= FP32_REL
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.float32
    # same dtype: Linear's path
    xf = torch.randn(5, 48, device=device)
    torch.testing.assert_close(lin(xf), xf @ lin.weight.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="RouterLinear: input's last dim"):
        lin(torch.randn(5, 40, device=device, dtype=torch.bfloat16))
    # a bf16 weight with fp32 logits (Megatron's layout)
    lin16 = turbo.modules.RouterLinear(48, 6, bias=False, device=device, dtype=torch.bfloat16,
                                       router_dtype=torch.float32)
    y = lin16(x)
    assert y.dtype == torch.float32 and "router_dtype=torch.float32" in repr(lin16)
    ref = x.detach().double() @ lin16.weight.detach().double().t()
    assert rel_err(ref, y) <= _bound(ref, x.detach().float() @ lin16.weight.detach().float().t())
    with pytest.raises(ValueError, match="RouterLinear: router_dtype must be"):
        turbo.modules.RouterLinear(48, 6, router_dtype=torch.int8)


def test_router_linear_torch_compile_fullgraph():
    """Traced code takes the PyTorch expression (the compiler fuses the cast into its GEMM)."""
    lin = turbo.modules.RouterLinear(32, 8, bias=True, dtype=torch.float32)
    x = torch.randn(3, 5, 32).to(torch.bfloat16).requires_grad_()
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    g = torch.randn_like(y)
    y.backward(g)
    ry, rdx, rdw, rdb = _ref(x.reshape(-1, 32), lin.weight, lin.bias, g.reshape(-1, 8))
    assert y.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert rel_err(ry, y.reshape(-1, 8)) <= FP32_REL and rel_err(rdw, lin.weight.grad) <= FP32_REL
    assert rel_err(rdb, lin.bias.grad) <= FP32_REL and rel_err(rdx, x.grad.reshape(-1, 32)) <= 1e-2
