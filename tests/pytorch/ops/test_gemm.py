"""turbo.ops.gemm against a float64 reference: every layout, dtype and backend, gradients,
Megatron's fused wgrad accumulation, torch.compile, empty problems and bad input.

Grid: the TORCH backend runs the full m x n x k grid on every machine (cheap); the TRITON backend
runs it on the GPU and a covering subset on CPU, where each kernel instance runs in the Triton
interpreter (each value of m, n and k still appears, with every layout and dtype).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.testing import pick_shapes, poison_, snr_db

ON_GPU = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["NN", "NT", "TN", "TT"]
BACKENDS = [None, BackendType.TORCH, BackendType.TRITON]
# bf16/fp16 keep 8/11 mantissa bits: their rounding alone sits near 55/65 dB; fp32 is full IEEE.
MIN_SNR = {torch.float32: 80.0, torch.float16: 50.0, torch.bfloat16: 45.0}

M_VALUES = [1, 16, 128, 256]
N_VALUES = [1, 16, 129, 512]
K_VALUES = [1, 16, 127, 255]
# On the GPU the small grid runs for every backend, plus realistic sizes.
LARGE = pick_shapes([], [(512, 1024, 2048), (2048, 4096, 1024), (1024, 2048, 4096), (4096, 4096, 512)])
FULL_GRID = list(itertools.product(M_VALUES, N_VALUES, K_VALUES)) + LARGE
# CPU subset for TRITON: a Latin-square walk so each value of m, n, k appears with each other axis.
CPU_TRITON_GRID = [(m, N_VALUES[(i + j) % 4], K_VALUES[(i + 2 * j) % 4]) for i, m in enumerate(M_VALUES[:4]) for j in range(2)]


def _make(m, n, k, layout, dtype, device, requires_grad=False):
    ta, tb = layout[0] == "T", layout[1] == "T"
    a = torch.randn((k, m) if ta else (m, k), dtype=dtype, device=device)
    b = torch.randn((n, k) if tb else (k, n), dtype=dtype, device=device)
    a.requires_grad_(requires_grad)
    b.requires_grad_(requires_grad)
    return a, b, ta, tb


def _ref(a, b, ta, tb):
    A = a.detach().double()
    B = b.detach().double()
    return (A.t() if ta else A) @ (B.t() if tb else B)


def _pin(backend):
    if backend is not None:
        GlobalBackendManager.set_gemm_backend(backend)


def _grid_for(backend):
    if backend == BackendType.TRITON and not ON_GPU:
        return CPU_TRITON_GRID
    return FULL_GRID


def _cases():
    for backend in BACKENDS:
        for m, n, k in _grid_for(backend):
            yield pytest.param(backend, m, n, k, id=f"{backend.name if backend else 'default'}-{m}x{n}x{k}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend, m, n, k", list(_cases()))
def test_gemm_forward(backend, m, n, k, layout, dtype, device):
    _pin(backend)
    a, b, ta, tb = _make(m, n, k, layout, dtype, device)
    out = turbo.ops.gemm(a, b, trans_a=ta, trans_b=tb)
    assert out.shape == (m, n) and out.dtype == dtype and out.device == a.device
    assert snr_db(_ref(a, b, ta, tb), out) >= MIN_SNR[dtype]


@pytest.mark.parametrize("layout", ["NN", "NT", "TN"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name if b else "default")
@pytest.mark.parametrize("m, n, k", [(128, 129, 127), (1, 16, 16), (64, 1, 33)] + pick_shapes([], [(2048, 1024, 4096)]))
def test_gemm_backward(backend, m, n, k, layout, dtype, device):
    _pin(backend)
    a, b, ta, tb = _make(m, n, k, layout, dtype, device, requires_grad=True)
    grad = torch.randn(m, n, dtype=dtype, device=device)
    out = turbo.ops.gemm(a, b, trans_a=ta, trans_b=tb)
    out.backward(grad)

    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    ref = (a64.t() if ta else a64) @ (b64.t() if tb else b64)
    ref.backward(grad.double())
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert a.grad.dtype == dtype and b.grad.dtype == dtype
    assert snr_db(ref, out) >= MIN_SNR[dtype]
    assert snr_db(a64.grad, a.grad) >= MIN_SNR[dtype], "grad_a"
    assert snr_db(b64.grad, b.grad) >= MIN_SNR[dtype], "grad_b"


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name if b else "default")
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_gemm_out_dtype(backend, out_dtype, device):
    _pin(backend)
    a, b, ta, tb = _make(64, 48, 40, "NT", torch.bfloat16, device, requires_grad=True)
    out = turbo.ops.gemm(a, b, trans_b=True, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    ref = _ref(a, b, ta, tb)
    assert snr_db(ref, out) >= (45.0 if out_dtype == torch.bfloat16 else 48.0)
    out.float().sum().backward()  # grads come back in the input dtype
    assert a.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name if b else "default")
@pytest.mark.parametrize("layout", ["NN", "NT", "TN"])
@pytest.mark.parametrize("main_grad_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_megatron_fused_wgrad_accumulation(backend, layout, main_grad_dtype, device):
    """Several micro-batches add into b.main_grad; b.grad is the placeholder; the flag is set."""
    _pin(backend)
    (m, n, k), = pick_shapes([(48, 40, 32)], [(256, 512, 256)])
    dtype = torch.bfloat16
    ta, tb = layout[0] == "T", layout[1] == "T"
    b = torch.randn((n, k) if tb else (k, n), dtype=dtype, device=device, requires_grad=True)
    start = torch.randn(b.shape, dtype=main_grad_dtype, device=device)  # never start from zeros
    b.main_grad = start.clone()
    b.grad_added_to_main_grad = False
    expected = start.double()
    for _ in range(3):
        a = torch.randn((k, m) if ta else (m, k), dtype=dtype, device=device, requires_grad=True)
        grad = torch.randn(m, n, dtype=dtype, device=device)
        out = turbo.ops.gemm(a, b, trans_a=ta, trans_b=tb, fuse_bgrad_accum_pattern="megatron")
        out.backward(grad)
        A = a.detach().double()
        A = A.t() if ta else A
        dB = A.t() @ grad.double()  # [K, N]
        expected += dB.t() if tb else dB
        # dgrad is unaffected by the fusion
        B = b.detach().double()
        ref_da = grad.double() @ (B.t() if tb else B).t()
        assert snr_db(ref_da.t() if ta else ref_da, a.grad) >= 45.0
    assert b.grad_added_to_main_grad is True
    assert b.main_grad.dtype == main_grad_dtype
    assert b.grad is not None and b.grad.shape == b.shape  # the placeholder wgrad
    assert snr_db(expected, b.main_grad) >= (45.0 if main_grad_dtype == torch.float32 else 40.0)


def test_megatron_zero_out_wgrad(device):
    b = torch.randn(8, 16, device=device, requires_grad=True)
    b.main_grad = torch.randn(8, 16, device=device)
    b.zero_out_wgrad = True
    a = torch.randn(4, 16, device=device)
    turbo.ops.gemm(a, b, trans_b=True, fuse_bgrad_accum_pattern="megatron").sum().backward()
    assert torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("backend", [BackendType.TORCH, BackendType.TRITON], ids=lambda b: b.name)
@pytest.mark.parametrize(
    "m, n, k, layout",
    pick_shapes([(64, 64, 64, "NN"), (64, 96, 32, "TN"), (96, 64, 32, "NT")],
                [(256, 256, 256, "NN"), (256, 512, 128, "TN"), (512, 256, 128, "NT")]),
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_misaligned_and_noncontiguous_subviews(backend, m, n, k, layout, dtype, device):
    """Sub-views whose base pointer and row stride are not 16-byte aligned are read in place."""
    _pin(backend)
    ta, tb = layout[0] == "T", layout[1] == "T"
    big_a = torch.randn((k + 3, m + 5) if ta else (m + 3, k + 5), dtype=dtype, device=device)
    big_b = torch.randn((n + 3, k + 5) if tb else (k + 3, n + 5), dtype=dtype, device=device)
    a = big_a[1:, 1:][: (k if ta else m), : (m if ta else k)]
    b = big_b[1:, 1:][: (n if tb else k), : (k if tb else n)]
    assert not a.is_contiguous() and a.data_ptr() % 16 != 0 and (a.stride(0) * a.element_size()) % 16 != 0
    out = turbo.ops.gemm(a, b, trans_a=ta, trans_b=tb)
    assert snr_db(_ref(a, b, ta, tb), out) >= MIN_SNR[dtype]
    # a column-strided view (every other column) and an expanded (stride-0) operand
    a2 = torch.randn(m, 2 * k, dtype=dtype, device=device)[:, ::2]
    b2 = torch.randn(1, n, dtype=dtype, device=device).expand(k, n)
    out2 = turbo.ops.gemm(a2, b2)
    assert snr_db(a2.double() @ b2.double(), out2) >= MIN_SNR[dtype]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name if b else "default")
def test_output_is_fully_written(backend, device, monkeypatch):
    """Poison the allocator's memory: every element of the result must be overwritten."""
    _pin(backend)
    poison = torch.empty(1 << 16, device=device)
    poison_(poison)
    del poison  # the caching allocator may hand this NaN-filled block to the output
    a, b, ta, tb = _make(65, 130, 33, "NT", torch.float32, device)
    out = turbo.ops.gemm(a, b, trans_b=True)
    assert torch.isfinite(out).all()
    assert snr_db(_ref(a, b, ta, tb), out) >= 80.0


@pytest.mark.parametrize("backend", [BackendType.TORCH, BackendType.TRITON], ids=lambda b: b.name)
def test_empty_problems_launch_nothing(backend, device, monkeypatch):
    from primus_turbo.pytorch.backends import gemm as backends_gemm

    _pin(backend)

    def _no_launch(*args, **kwargs):
        raise AssertionError("a kernel was dispatched for an empty problem")

    monkeypatch.setattr(backends_gemm.gemm_dispatcher, "dispatch", _no_launch)
    a = torch.randn(5, 0, device=device, requires_grad=True)
    b = torch.randn(0, 7, device=device, requires_grad=True)
    out = turbo.ops.gemm(a, b)
    assert out.shape == (5, 7) and torch.equal(out, torch.zeros(5, 7, device=device))
    out.sum().backward()
    assert a.grad.shape == (5, 0) and b.grad.shape == (0, 7)
    assert turbo.ops.gemm(torch.randn(0, 4, device=device), torch.randn(4, 3, device=device)).shape == (0, 3)
    assert turbo.ops.gemm(torch.randn(2, 4, device=device), torch.randn(4, 0, device=device)).shape == (2, 0)
    # M = 0 micro-batch with fused accumulation: main_grad unchanged, flag set
    w = torch.randn(6, 4, device=device, requires_grad=True)
    w.main_grad = torch.randn(6, 4, device=device)
    before = w.main_grad.clone()
    x = torch.randn(0, 4, device=device, requires_grad=True)
    turbo.ops.gemm(x, w, trans_b=True, fuse_bgrad_accum_pattern="megatron").sum().backward()
    assert torch.equal(w.main_grad, before) and w.grad_added_to_main_grad is True


@pytest.mark.parametrize("backend", [None, BackendType.TRITON], ids=lambda b: b.name if b else "default")
def test_torch_compile_fullgraph(backend, device):
    _pin(backend)
    torch._dynamo.reset()
    a, b, ta, tb = _make(32, 48, 16, "NT", torch.float32, device, requires_grad=True)

    def f(x, w):
        return turbo.ops.gemm(x, w, trans_b=True).relu().sum()

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(a, b)
    loss.backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    f(a, b).backward()
    assert torch.allclose(loss, f(a, b))
    assert torch.allclose(ga, a.grad) and torch.allclose(gb, b.grad)


def test_autotune_end_to_end_keeps_main_grad(device):
    """Autotune times TORCH and TRITON on scratch buffers; main_grad receives exactly one add."""
    GlobalBackendManager.set_auto_tune(True)
    b = torch.randn(24, 16, device=device, requires_grad=True)
    b.main_grad = torch.randn(24, 16, device=device)
    start = b.main_grad.clone()
    a = torch.randn(8, 16, device=device, requires_grad=True)
    g = torch.randn(8, 24, device=device)
    turbo.ops.gemm(a, b, trans_b=True, fuse_bgrad_accum_pattern="megatron").backward(g)
    expected = start.double() + g.double().t() @ a.detach().double()
    assert snr_db(expected, b.main_grad) >= 80.0
    from primus_turbo.pytorch.backends.gemm import gemm_dispatcher

    assert len(gemm_dispatcher.tune_cache) >= 1


@pytest.mark.deterministic
def test_deterministic_pinned_triton_repeatable(device):
    GlobalBackendManager.set_gemm_backend(BackendType.TRITON)
    a, b, ta, tb = _make(96, 80, 72, "NT", torch.bfloat16, device)
    first = turbo.ops.gemm(a, b, trans_b=True)
    for _ in range(2):
        assert torch.equal(first, turbo.ops.gemm(a, b, trans_b=True))


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match, exc",
    [
        (lambda d: (torch.randn(2, 3, 4, device=d), torch.randn(4, 5, device=d)), r"a must be 2-D, got a.dim\(\)=3", ValueError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(4, device=d)), r"b must be 2-D, got b.dim\(\)=1", ValueError),
        (lambda d: (torch.randint(0, 3, (3, 4), device=d), torch.randn(4, 5, device=d)), r"a.dtype must be .* got torch.int64", TypeError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(4, 5, device=d).half()), r"same dtype, got a=torch.float32, b=torch.float16", TypeError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(5, 5, device=d)), r"K mismatch, a\(3, 4\) with trans_a=False has K=4, b\(5, 5\) with trans_b=False has K=5", ValueError),
        (lambda d: (torch.randn(3, 4, device=d), torch.randn(4, 5, device="meta")), r"same device", ValueError),
        (lambda d: ([[1.0]], torch.randn(4, 5, device=d)), r"a must be a torch.Tensor, got list", TypeError),
    ],
)
def test_bad_input(make, match, exc, device):
    a, b = make(device)
    with pytest.raises(exc, match=match):
        turbo.ops.gemm(a, b)


def test_bad_options(device):
    a, b = torch.randn(3, 4, device=device), torch.randn(4, 5, device=device, requires_grad=True)
    with pytest.raises(TypeError, match="out_dtype must be .* got torch.int32"):
        turbo.ops.gemm(a, b, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="fuse_bgrad_accum_pattern must be None or 'megatron', got 'te'"):
        turbo.ops.gemm(a, b, fuse_bgrad_accum_pattern="te")
    with pytest.raises(ValueError, match="needs b.main_grad"):
        turbo.ops.gemm(a, b, fuse_bgrad_accum_pattern="megatron")
    b.main_grad = torch.zeros(5, 4, device=device)
    with pytest.raises(ValueError, match=r"b.main_grad must match b, got main_grad \(5, 4\)"):
        turbo.ops.gemm(a, b, fuse_bgrad_accum_pattern="megatron")
    b.main_grad = torch.zeros(4, 5, device=device, dtype=torch.float16)
    with pytest.raises(TypeError, match="main_grad must be float32 or torch.float32, got torch.float16"):
        turbo.ops.gemm(a, b, fuse_bgrad_accum_pattern="megatron")


def test_pinned_triton_refuses_unsupported_device():
    """A pin is never ignored: TRITON on an input it cannot run raises and says why."""
    GlobalBackendManager.set_gemm_backend(BackendType.TRITON)
    a = torch.randn(3, 4, device="meta")
    b = torch.randn(4, 5, device="meta")
    with pytest.raises(ValueError, match="backend TRITON .* cannot run these inputs"):
        turbo.ops.gemm(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [BackendType.TORCH, BackendType.TRITON], ids=lambda b: b.name)
def test_cuda_graph_capture(backend):
    _pin(backend)
    a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
    turbo.ops.gemm(a, b, trans_b=True)  # compile/tune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = turbo.ops.gemm(a, b, trans_b=True)
    a.copy_(torch.randn_like(a))
    g.replay()
    torch.cuda.synchronize()
    assert snr_db(a.double() @ b.double().t(), out) >= 45.0
