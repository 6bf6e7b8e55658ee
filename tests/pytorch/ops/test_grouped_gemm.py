"""turbo.ops.grouped_gemm (MoE experts) against float64 references: forward and both gradients for
1 to 32 experts, balanced / unbalanced / empty groups, both weight layouts, the (N, K) pairs issue 4
lists (scaled down on CPU) and every backend that can run here; the zeroed tail, Megatron's fused
wgrad accumulation, repeatability, the num_cu grid cap, the signature, bad input, overrunning
group_lens (clamped on the GPU), and (on the GPU) proof that no host synchronisation happens (sync
debug mode, CUDA-graph capture)."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo  # noqa: F401  (the package must import cleanly)
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.ops.grouped_gemm import grouped_gemm
from primus_turbo.testing import grouped_gemm_ref, grouped_gemm_variable_k_ref, pick_shapes, snr_db

ON_GPU = torch.cuda.is_available()
# issue 4's bars (bf16 >= 45 dB, fp16 >= 50 dB), on CPU too: the interpreter's bf16 products measure
# 49.3-49.9 dB on every case here (fp32 accumulation, one bf16 rounding of the result)
MIN_SNR = {torch.float32: 80.0, torch.float16: 50.0, torch.bfloat16: 45.0}
# the expert (N, K) pairs issue 4 lists (DeepSeek-V3, Qwen3 MoE gate_up / down shapes)
ISSUE_NK = [(2048, 1536), (2048, 1408), (1408, 2048), (4096, 7168), (7168, 2048), (5120, 1536)]
# ... scaled down for the interpreter, each keeping its N:K ratio, 16-byte aligned bf16 rows and its
# odd factor against the tiles (1408 = 11 x 128 -> 88 = 11 x 8, 7168 = 7 x 1024 -> 224 = 7 x 32):
# divided by 16, the three large ones by 32 (the interpreter's time grows with N * K: 4 s a case at /16)
ISSUE_NK_CPU = [(128, 96), (128, 88), (88, 128), (128, 224), (224, 64), (160, 48)]
NK = [(96, 64), (64, 160), (33, 47)] + pick_shapes([], ISSUE_NK)
# rows per group, by G: balanced, unbalanced, with empty groups
LENS = {
    1: [[64], [0], [37]],
    2: [[32, 32], [60, 3], [0, 45]],
    3: [[20, 20, 20], [0, 64, 1], [17, 0, 0]],
    8: [[16] * 8, [0, 64, 3, 0, 9, 33, 0, 1], [0] * 7 + [50]],
    16: [[(i * 7) % 11 for i in range(16)]],  # 0 to 10 rows, two empty groups
    32: [[(i * 5) % 9 for i in range(32)]],  # 0 to 8 rows, four empty groups
}
# On CPU the many-group cases take small (N, K) (K = 24: a masked K tail): every persistent program
# walks every group in the interpreter, so G = 32 at (64, 160) costs ~4 s a case against <1 s here
CPU_NK_MANY = {16: (16, 24), 32: (24, 16)}
if ON_GPU:  # realistic token counts on the GPU: 256 a group; 0-1023; 128-2048 with a 2048 group
    LENS = {g: ls + [[256] * g, [(i * 977) % 1024 for i in range(g)],
                     [2048] + [128 + (i * 977) % 1921 for i in range(1, g)]] for g, ls in LENS.items()}
BACKENDS = [None, BackendType.TRITON] + ([BackendType.TORCH] if ON_GPU else [])


def _pin(backend):
    if backend is not None:
        GlobalBackendManager.set_grouped_gemm_backend(backend)


def _make(lens, n, k, dtype, trans_b, device, extra_rows=0):
    G = len(lens)
    a = torch.randn(sum(lens) + extra_rows, k, dtype=dtype, device=device)
    b = torch.randn((G, n, k) if trans_b else (G, k, n), dtype=dtype, device=device)
    if dtype == torch.float16 or dtype == torch.bfloat16:
        b = b * k ** -0.5  # keep fp16 products in range for the large GPU shapes
    gl = torch.tensor(lens, dtype=torch.int64, device=device)
    return a, b, gl


def _check_fwd_bwd(a, b, gl, trans_b, dtype, extra_rows=0):
    a = a.detach().requires_grad_()
    b = b.detach().requires_grad_()
    out = grouped_gemm(a, b, gl, trans_b=trans_b)
    n = b.shape[1] if trans_b else b.shape[2]
    assert out.shape == (a.shape[0], n) and out.dtype == dtype
    assert snr_db(grouped_gemm_ref(a, b, gl, trans_b), out) >= MIN_SNR[dtype]
    routed = int(gl.sum())
    assert torch.equal(out[routed:], torch.zeros_like(out[routed:]))
    dc = torch.randn_like(out)
    out.backward(dc)
    ref_da = grouped_gemm_ref(dc, b, gl, trans_b=not trans_b)  # dA = dC @ op(b).T
    ref_db = grouped_gemm_variable_k_ref(dc, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, dc, gl)
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert snr_db(ref_da, a.grad) >= MIN_SNR[dtype]
    assert torch.equal(a.grad[routed:], torch.zeros_like(a.grad[routed:]))
    assert snr_db(ref_db, b.grad) >= MIN_SNR[dtype]


def _cases():
    for G, lens_list in LENS.items():
        for i, lens in enumerate(lens_list):
            n, k = NK[(G + i) % len(NK)] if ON_GPU or G not in CPU_NK_MANY else CPU_NK_MANY[G]
            for trans_b in (False, True):
                for backend in BACKENDS:
                    if backend is None and G in CPU_NK_MANY and not ON_GPU:
                        continue  # on CPU the default dispatch is the TRITON backend: run the slow ones once
                    yield pytest.param(lens, n, k, trans_b, backend,
                                       id=f"G{G}-l{i}-{n}x{k}-{'NT' if trans_b else 'NN'}-{_bname(backend)}")


def _bname(backend):
    return backend.name if backend else "default"


@pytest.mark.parametrize("lens, n, k, trans_b, backend", list(_cases()))
def test_grouped_gemm_bf16(lens, n, k, trans_b, backend, device):
    if backend == BackendType.TORCH and (n % 8 or k % 8):
        pytest.skip("torch._grouped_mm needs 16-byte aligned rows (a pinned backend that cannot run raises)")
    _pin(backend)
    a, b, gl = _make(lens, n, k, torch.bfloat16, trans_b, device)
    _check_fwd_bwd(a, b, gl, trans_b, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("n, k", NK[:3])
def test_grouped_gemm_fp16_fp32(n, k, trans_b, dtype, device):
    a, b, gl = _make([0, 50, 13], n, k, dtype, trans_b, device)
    _check_fwd_bwd(a, b, gl, trans_b, dtype)


def _issue_nk_cases():
    # the GPU: every pair in both layouts on every backend; CPU: the scaled pairs once, layouts
    # alternating (each case's backward runs the other layout's GEMMs too), on the default dispatch
    pairs = ISSUE_NK if ON_GPU else ISSUE_NK_CPU
    for i, (n, k) in enumerate(pairs):
        for trans_b in ((False, True) if ON_GPU else (bool(i % 2),)):
            for backend in (BACKENDS if ON_GPU else [None]):
                yield pytest.param(n, k, trans_b, backend, id=f"{n}x{k}-{'NT' if trans_b else 'NN'}-{_bname(backend)}")


@pytest.mark.parametrize("n, k, trans_b, backend", list(_issue_nk_cases()))
def test_issue_nk_pairs(n, k, trans_b, backend, device):
    """Issue 4's (N, K) pairs (scaled down on CPU): forward and both gradients against float64 with
    unbalanced groups, an empty one and tail rows; on the GPU 128 to 2048 rows a group."""
    _pin(backend)
    lens = [2048, 0, 977, 128, 1500, 300, 2048, 640] if ON_GPU else [5, 0, 11, 2]
    a, b, gl = _make(lens, n, k, torch.bfloat16, trans_b, device, extra_rows=5)
    _check_fwd_bwd(a, b, gl, trans_b, torch.bfloat16, extra_rows=5)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name if b else "default")
@pytest.mark.parametrize("trans_b", [False, True])
def test_zeroed_tail(trans_b, backend, device):
    # a holds more rows than were routed (a padded buffer): those output rows must be exactly 0,
    # however the backend allocates its output; run twice so reused, dirty memory is covered too
    _pin(backend)
    for _ in range(2):
        a, b, gl = _make([10, 0, 21], 64, 96, torch.bfloat16, trans_b, device, extra_rows=40)
        a[31:] = float("nan")  # rows that no expert owns must not leak into anything
        _check_fwd_bwd(a.nan_to_num(), b, gl, trans_b, torch.bfloat16, extra_rows=40)
        out = grouped_gemm(a, b, gl, trans_b=trans_b)
        assert torch.equal(out[31:], torch.zeros_like(out[31:]))


def test_explicit_offsets_and_num_cu(device):
    a, b, gl = _make([5, 40, 0, 19], 33, 47, torch.float16, True, device)
    offs = torch.zeros(5, dtype=torch.int64, device=device)
    offs[1:] = gl.cumsum(0)
    ref = grouped_gemm_ref(a, b, gl, trans_b=True)
    for num_cu in (None, 1, 2):
        out = grouped_gemm(a, b, gl, group_offs=offs, trans_b=True, num_cu=num_cu)
        assert snr_db(ref, out) >= MIN_SNR[torch.float16]


def test_num_cu_caps_the_launch_grid(monkeypatch):
    """num_cu caps the persistent programs of all three GEMMs (the forward and dgrad M-grouped
    kernel, the wgrad variable-K kernel): the launch grid and the NUM_PROGRAMS the tile deal uses
    are min(num_cu, the device's programs), and the results are bit-identical to num_cu=None (each
    tile is summed by one program in one order, whichever program it is dealt to). CPU: the
    interpreter runs the tl kernels (on sm_90 the Gluon kernels take num_cu; their own tests)."""
    if ON_GPU:
        pytest.skip("spies on the tl kernels' launches, which the interpreter runs")
    import primus_turbo.triton.grouped_gemm.grouped_gemm_kernel as kmod

    launches = []

    class Spy:  # kernel[grid](*args, **meta): records the grid and NUM_PROGRAMS, then launches
        def __init__(self, kernel, tag):
            self.kernel, self.tag = kernel, tag

        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((self.tag, tuple(grid), meta["NUM_PROGRAMS"]))
                return self.kernel[grid](*args, **meta)
            return launch

    monkeypatch.setattr(kmod, "_grouped_gemm_kernel", Spy(kmod._grouped_gemm_kernel, "m"))
    monkeypatch.setattr(kmod, "_grouped_gemm_variable_k_kernel", Spy(kmod._grouped_gemm_variable_k_kernel, "vk"))
    full = kmod._INTERPRETER_NUM_PROGRAMS
    assert full > 2  # so that caps of 1 and 2 show in the grid
    a, b, gl = _make([0, 20, 3, 0, 9, 11], 32, 32, torch.bfloat16, True, "cpu", extra_rows=3)
    dc = torch.randn(a.size(0), 32, dtype=torch.bfloat16)
    results = {}
    for num_cu in (None, 1, 2, 64):
        launches.clear()
        x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = grouped_gemm(x, w, gl, trans_b=True, num_cu=num_cu)
        out.backward(dc)
        programs = full if num_cu is None else min(num_cu, full)
        assert launches == [("m", (programs,), programs), ("m", (programs,), programs),
                            ("vk", (programs,), programs)], num_cu  # forward, dgrad, wgrad
        results[num_cu] = (out.detach(), x.grad, w.grad)
    assert snr_db(grouped_gemm_ref(a, b, gl, trans_b=True), results[None][0]) >= MIN_SNR[torch.bfloat16]
    for num_cu in (1, 2, 64):
        for got, want in zip(results[num_cu], results[None]):
            assert torch.equal(got, want), num_cu


@pytest.mark.parametrize("num_cu", [0, -1, 1.5, 2.0, "4", True, False, torch.tensor(4)], ids=repr)
def test_num_cu_rejects_bad_values(num_cu, device):
    """num_cu is None or a positive int: anything else raises ValueError naming the value, with and
    without autograd (the checks run before any route is taken)."""
    a, b, gl = _make([4, 4], 16, 8, torch.float32, False, device)
    with pytest.raises(ValueError, match=r"grouped_gemm: num_cu must be None or a positive int, got "):
        grouped_gemm(a, b, gl, num_cu=num_cu)
    with pytest.raises(ValueError, match="got " + __import__("re").escape(repr(num_cu))):
        grouped_gemm(a.requires_grad_(), b, gl, num_cu=num_cu)


@pytest.mark.parametrize("mg_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("trans_b", [False, True])
def test_megatron_fused_accumulation(trans_b, mg_dtype, device):
    lens_per_step = [[20, 0, 31], [5, 40, 2], [0, 0, 64]]
    k, n = 48, 40
    b = torch.randn((3, n, k) if trans_b else (3, k, n), dtype=torch.bfloat16, device=device).requires_grad_()
    b.main_grad = torch.randn(b.shape, dtype=mg_dtype, device=device)
    expected = b.main_grad.double().clone()
    for lens in lens_per_step:  # three micro-batches accumulate into main_grad
        gl = torch.tensor(lens, dtype=torch.int64, device=device)
        a = torch.randn(sum(lens), k, dtype=torch.bfloat16, device=device, requires_grad=True)
        out = grouped_gemm(a, b, gl, trans_b=trans_b, fuse_bgrad_accum_pattern="megatron")
        dc = torch.randn_like(out)
        out.backward(dc)
        expected += grouped_gemm_variable_k_ref(dc, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, dc, gl)
        assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=not trans_b), a.grad) >= MIN_SNR[torch.bfloat16]
        b.grad = None
    assert b.grad_added_to_main_grad is True
    # a bf16 main_grad is rounded once a micro-batch, three roundings of the running sum (45.3-45.5
    # dB measured on CPU): a looser bar than one bf16 rounding's
    assert snr_db(expected, b.main_grad) >= (41.0 if mg_dtype == torch.bfloat16 else MIN_SNR[torch.bfloat16])


def test_bitwise_repeatable(device):
    a, b, gl = _make([0, 64, 3, 0, 9, 33, 0, 1], 64, 160, torch.bfloat16, True, device)
    results = []
    for _ in range(2):
        x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = grouped_gemm(x, w, gl, trans_b=True)
        out.backward(torch.ones_like(out))
        results.append((out, x.grad, w.grad))
    for r0, r1 in zip(*results):
        assert torch.equal(r0, r1)


def test_no_grad_and_single_input_grads(device):
    a, b, gl = _make([7, 9], 33, 47, torch.float32, False, device)
    with torch.no_grad():
        out = grouped_gemm(a.requires_grad_(), b, gl)
    assert not out.requires_grad
    b.requires_grad_()
    a.requires_grad_(False)
    grouped_gemm(a, b, gl).sum().backward()
    assert a.grad is None and snr_db(grouped_gemm_variable_k_ref(a, torch.ones(16, 33, device=device), gl), b.grad) >= 80


def test_errors(device):
    a, b, gl = _make([4, 4], 16, 8, torch.float32, False, device)
    with pytest.raises(TypeError, match="int64"):
        grouped_gemm(a, b, gl.int())
    with pytest.raises(TypeError, match="torch.Tensor"):
        grouped_gemm(a, b, [4, 4])
    other = "cpu" if ON_GPU else "meta"
    with pytest.raises(ValueError, match="device"):
        grouped_gemm(a, b, gl.to(other))
    with pytest.raises(ValueError, match="2-D"):
        grouped_gemm(a[None], b, gl)
    with pytest.raises(ValueError, match="3-D"):
        grouped_gemm(a, b[0], gl)
    with pytest.raises(ValueError, match="1-D"):
        grouped_gemm(a, b, gl[None])
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_gemm(a, b, gl, trans_b=True)
    with pytest.raises(ValueError, match="G=2"):
        grouped_gemm(a, b, torch.tensor([2, 2, 4], device=device))
    with pytest.raises(ValueError, match="group_offs"):
        grouped_gemm(a, b, gl, group_offs=torch.tensor([0, 8], device=device))
    with pytest.raises(TypeError, match="same dtype"):
        grouped_gemm(a, b.half(), gl)
    with pytest.raises(ValueError, match="num_cu"):
        grouped_gemm(a, b, gl, num_cu=0)
    with pytest.raises(ValueError, match="fuse_bgrad_accum_pattern"):
        grouped_gemm(a, b, gl, fuse_bgrad_accum_pattern="deepspeed")
    with pytest.raises(ValueError, match="main_grad"):
        grouped_gemm(a, b.requires_grad_(), gl, fuse_bgrad_accum_pattern="megatron")
    if not ON_GPU:  # on CPU an overlong group_lens is reported (on CUDA it would need a sync)
        with pytest.raises(RuntimeError, match="exceeds"):
            grouped_gemm(a[:6], b.detach(), gl)


@pytest.mark.parametrize("op", ["grouped_gemm", "grouped_gemm_fp8", "grouped_gemm_fp4", "grouped_gemm_glu"])
def test_cpu_reports_inconsistent_group_tensors(op):
    """On CPU (no sync to pay) every grouped op reports group tensors only the device could check:
    a negative length (whose rows would otherwise come out as zeros), a group_offs that is not
    group_lens' prefix sum (which the kernels would follow, ignoring group_lens), a sum past a."""
    if ON_GPU:
        pytest.skip("CPU-only behaviour (on CUDA these need a host sync)")
    from primus_turbo.pytorch.ops.grouped_gemm_fp4 import grouped_gemm_fp4
    from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8
    from primus_turbo.pytorch.ops.grouped_gemm_glu import grouped_gemm_glu

    a = torch.randn(64, 64, dtype=torch.bfloat16)
    b = torch.randn(2, 64, 64, dtype=torch.bfloat16)  # [G, N, K], trans_b=True
    call = {"grouped_gemm": lambda gl, go: grouped_gemm(a, b, gl, go, trans_b=True),
            "grouped_gemm_fp8": lambda gl, go: grouped_gemm_fp8(a, b, gl, go),
            "grouped_gemm_fp4": lambda gl, go: grouped_gemm_fp4(a, b, gl, go),
            "grouped_gemm_glu": lambda gl, go: grouped_gemm_glu(a, b, gl, go)}[op]
    lens = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    call(lens(40, 24), lens(0, 40, 64))  # consistent: runs
    with pytest.raises(RuntimeError, match=f"{op}: group_lens has a negative entry"):
        call(lens(70, -6), None)
    with pytest.raises(RuntimeError, match=f"{op}: group_offs is not the exclusive prefix sum"):
        call(lens(32, 32), lens(0, 16, 64))
    with pytest.raises(RuntimeError, match=f"{op}: group_offs is not the exclusive prefix sum"):
        call(lens(24, 24), lens(8, 32, 56))  # right differences, shifted start
    with pytest.raises(RuntimeError, match=f"{op}: sum\\(group_lens\\) exceeds"):
        call(lens(40, 40), None)


def test_signature_is_primus_turbos(device):
    """The parameters are Primus-Turbo's, in its order: issue 4's (a, b, group_lens, group_offs,
    trans_b, num_cu, fuse_bgrad_accum_pattern) with ``schedule`` before the pattern. Megatron passes
    the pattern by keyword; passed positionally in schedule's place it is refused by name."""
    import inspect

    params = inspect.signature(grouped_gemm).parameters
    assert list(params) == ["a", "b", "group_lens", "group_offs", "trans_b", "num_cu", "schedule",
                            "fuse_bgrad_accum_pattern"]
    assert params["schedule"].default == "static" and params["fuse_bgrad_accum_pattern"].default is None
    a, b, gl = _make([5, 0, 11], 24, 16, torch.float32, True, device, extra_rows=3)
    w = b.detach().clone().requires_grad_()
    w.main_grad = torch.randn(w.shape, device=device)
    expected = w.main_grad.double().clone()
    for positional in (False, True):  # two micro-batches: Megatron's keyword form, then every argument positional
        x = a.detach().clone().requires_grad_()
        if positional:
            out = grouped_gemm(x, w, gl, None, True, None, "static", "megatron")
        else:
            out = grouped_gemm(x, w, gl, trans_b=True, fuse_bgrad_accum_pattern="megatron")
        dc = torch.randn_like(out)
        out.backward(dc)
        expected += grouped_gemm_variable_k_ref(dc, a, gl)
        assert snr_db(grouped_gemm_ref(a, b, gl, trans_b=True), out) >= MIN_SNR[torch.float32]
        assert w.grad_added_to_main_grad is True
        w.grad = None
    assert snr_db(expected, w.main_grad) >= MIN_SNR[torch.float32]
    with pytest.raises(ValueError, match="'megatron'"):
        grouped_gemm(a, b, gl, None, True, None, "megatron")  # the pattern in schedule's place


def test_schedule_values(device):
    """Both ``schedule`` values give the same product and gradients (the same kernels run); bad
    values and ``"work_steal"`` with ``num_cu`` raise naming themselves."""
    a, b, gl = _make([5, 0, 11], 24, 16, torch.float32, True, device, extra_rows=3)
    dc = torch.randn(a.size(0), 24, device=device)
    outs = []
    for schedule in ("static", "work_steal"):
        x, w = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        out = grouped_gemm(x, w, gl, trans_b=True, schedule=schedule)
        out.backward(dc)
        outs.append((out.detach(), x.grad, w.grad))
    assert snr_db(grouped_gemm_ref(a[:16], b, gl, trans_b=True), outs[0][0][:16]) >= MIN_SNR[torch.float32]
    assert torch.equal(outs[0][0][16:], torch.zeros_like(outs[0][0][16:]))
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="'dynamic'"):
        grouped_gemm(a, b, gl, trans_b=True, schedule="dynamic")
    with pytest.raises(ValueError, match="num_cu=4"):
        grouped_gemm(a, b, gl, trans_b=True, num_cu=4, schedule="work_steal")


def test_torch_backend_reason_on_cpu():
    if ON_GPU:
        pytest.skip("CPU-only behaviour")
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH)
    a, b, gl = _make([4, 4], 16, 8, torch.bfloat16, False, "cpu")
    with pytest.raises(ValueError, match="needs CUDA"):
        grouped_gemm(a, b, gl)


def test_torch_compile_fullgraph(device):
    a, b, gl = _make([5, 0, 11], 32, 16, torch.float32, True, device)
    a.requires_grad_()
    b.requires_grad_()
    fn = torch.compile(lambda x, w, l: grouped_gemm(x, w, l, trans_b=True), fullgraph=True, backend="aot_eager")
    out = fn(a, b, gl)
    assert snr_db(grouped_gemm_ref(a, b, gl, trans_b=True), out) >= 80
    out.sum().backward()
    assert snr_db(grouped_gemm_variable_k_ref(torch.ones(16, 32, device=device), a, gl), b.grad) >= 80


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name if b else "default")
def test_no_host_sync(backend):
    _pin(backend)
    a, b, gl = _make([0, 300, 17, 129], 256, 512, torch.bfloat16, True, "cuda", extra_rows=20)
    a.requires_grad_()
    b.requires_grad_()
    b.main_grad = torch.zeros(b.shape, dtype=torch.float32, device="cuda")
    grouped_gemm(a, b, gl, trans_b=True).sum().backward()  # warm-up: compile, tune
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_gemm(a, b, gl, trans_b=True)
        out.backward(torch.ones_like(out))
        out = grouped_gemm(a, b, gl, trans_b=True, fuse_bgrad_accum_pattern="megatron")
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [False, True])
def test_large_wgrad_on_default_route(trans_b):
    """A wgrad above GLUON_WGRAD_MIN_FLOPS on the default dispatch (the Gluon variable-K kernel on
    sm_90, the vendor kernel elsewhere): right, with unbalanced, empty and tail rows, and bitwise
    repeatable."""
    from primus_turbo.pytorch.backends.grouped_gemm import GLUON_WGRAD_MIN_FLOPS

    lens = [9000, 0, 5700, 9876]
    a, b, gl = _make(lens, 4096, 2048, torch.bfloat16, trans_b, "cuda", extra_rows=77)
    assert 2.0 * sum(lens) * 4096 * 2048 >= GLUON_WGRAD_MIN_FLOPS
    _check_fwd_bwd(a, b, gl, trans_b, torch.bfloat16, extra_rows=77)
    grads = []
    for _ in range(2):
        bb = b.detach().requires_grad_()
        out = grouped_gemm(a, bb, gl, trans_b=trans_b)
        out.backward(torch.ones_like(out))
        grads.append(bb.grad)
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))  # the empty group's gradient


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name if b else "default")
def test_cuda_graph_capture(backend):
    _pin(backend)
    a, b, gl = _make([0, 300, 17, 129], 256, 512, torch.bfloat16, True, "cuda", extra_rows=20)
    grouped_gemm(a, b, gl, trans_b=True)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_gemm(a, b, gl, trans_b=True)
    # new routing, same shapes: the captured graph reads the group sizes from device memory
    gl.copy_(torch.tensor([100, 0, 300, 46], device="cuda"))
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    assert snr_db(grouped_gemm_ref(a, b, gl, trans_b=True), out) >= MIN_SNR[torch.bfloat16]
    assert torch.equal(out[446:], torch.zeros_like(out[446:]))


def _clamped_lens(lens, rows):
    """The group sizes the kernels run for a ``group_lens`` that overruns ``rows``: each group cut
    at the last row, the groups past it empty."""
    out, start = [], 0
    for n in lens:
        out.append(min(start + n, rows) - min(start, rows))
        start += n
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name if b else "default")
@pytest.mark.parametrize("trans_b", [False, True])
def test_overrunning_group_lens_are_clamped(trans_b, backend):
    """sum(group_lens) > a's rows on CUDA (not checked: that needs a host sync): every backend
    clamps the offsets on the device, so the result is that of the clamped groups (the group
    reaching past the end cut at the last row, the one past it empty): the output, the grad_input
    and the grad_weight (fused into an fp32 main_grad: with TORCH pinned, the route through
    GroupedGemmTorchBackend's vendor GEMMs). Poisoned outputs: nothing may be left unwritten."""
    _pin(backend)
    rows, lens = 200, [80, 0, 90, 70, 40]  # sum 280: the fourth group cut at 30 rows, the fifth past the end
    clamped = torch.tensor(_clamped_lens(lens, rows), device="cuda")
    assert clamped.tolist() == [80, 0, 90, 30, 0]
    a, b, gl = _make(lens, 256, 128, torch.bfloat16, trans_b, "cuda")
    a = a[:rows].clone()
    for _ in range(2):
        # the output's block poisoned first (freed NaNs the caching allocator hands back)
        torch.full((rows, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            out = grouped_gemm(a, b, gl, trans_b=trans_b)
        assert not out.isnan().any()
        assert snr_db(grouped_gemm_ref(a, b, clamped, trans_b), out) >= MIN_SNR[torch.bfloat16]
    w = b.detach().clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
    x = a.detach().clone().requires_grad_()
    out = grouped_gemm(x, w, gl, trans_b=trans_b, fuse_bgrad_accum_pattern="megatron")
    dc = torch.randn_like(out)
    out.backward(dc)
    torch.cuda.synchronize()  # an out-of-bounds access would surface here
    assert snr_db(grouped_gemm_ref(a, b, clamped, trans_b), out) >= MIN_SNR[torch.bfloat16]
    assert snr_db(grouped_gemm_ref(dc, b, clamped, trans_b=not trans_b), x.grad) >= MIN_SNR[torch.bfloat16]
    ref_db = grouped_gemm_variable_k_ref(dc, a, clamped) if trans_b else grouped_gemm_variable_k_ref(a, dc, clamped)
    assert snr_db(ref_db, w.main_grad) >= MIN_SNR[torch.bfloat16]
    assert not w.main_grad[4].any()  # the group past the end adds nothing


def test_torch_backend_clamps_overrunning_offsets(monkeypatch):
    """GroupedGemmTorchBackend and its variable-K form hand ``torch._grouped_mm`` int32 group ends
    clamped to the operands' rows (CPU stand-in for the vendor kernel recording its ``offs``;
    called below the op, whose CPU checks would refuse these offsets first), whether they make the
    int32 ends themselves or get the op's ``offs32``; the results are the clamped groups'."""
    if ON_GPU:
        pytest.skip("CPU stand-in of the vendor kernel; the GPU runs the real one above")
    import primus_turbo.pytorch.backends.grouped_gemm as bg

    calls, seen = [], []
    emulated = _emulated_grouped_mm(calls)
    monkeypatch.setattr(torch, "_grouped_mm", lambda x, y, offs=None: seen.append(offs.clone()) or emulated(x, y, offs),
                        raising=False)
    rows, lens = 40, [12, 0, 20, 15, 9]  # ends 12, 12, 32, 47, 56 past 40 rows
    clamped = _clamped_lens(lens, rows)
    a = torch.randn(rows, 16, dtype=torch.bfloat16)
    b = torch.randn(5, 16, 24, dtype=torch.bfloat16)
    offs = torch.tensor([0, 12, 12, 32, 47, 56])
    want = torch.tensor([12, 12, 32, 40, 40], dtype=torch.int32)
    out = bg.GroupedGemmTorchBackend.execute(a, b, None, offs)
    out32 = bg.GroupedGemmTorchBackend.execute(a, b, None, offs, offs32=offs[1:].to(torch.int32))
    y = torch.randn(rows, 24, dtype=torch.bfloat16)
    wgrad = bg.GroupedGemmVariableKTorchBackend.execute(a, y, None, offs)
    wgrad32 = bg.GroupedGemmVariableKTorchBackend.execute(a, y, None, offs, offs32=offs[1:].to(torch.int32))
    assert len(seen) == 4
    for got in seen:
        assert got.dtype == torch.int32 and torch.equal(got, want)
    gl = torch.tensor(clamped)
    for o in (out, out32):
        assert snr_db(grouped_gemm_ref(a, b, gl), o) >= MIN_SNR[torch.bfloat16]
    for w in (wgrad, wgrad32):
        assert snr_db(grouped_gemm_variable_k_ref(a, y, gl), w) >= MIN_SNR[torch.bfloat16]


def _emulated_grouped_mm(calls):
    """A CPU stand-in for ``torch._grouped_mm`` (2-D x 3-D and 2-D x 2-D with int32 ``offs``): the
    vendor kernel's contract, rows it does not own left NaN (the real one leaves them
    uninitialised), so a missing tail zeroing shows."""
    def fn(x, y, offs=None):
        calls.append((x.dim(), y.dim()))
        assert offs is not None and offs.dtype == torch.int32
        ends = [0] + offs.tolist()
        if y.dim() == 3:
            out = torch.full((x.size(0), y.size(2)), float("nan"), dtype=x.dtype)
            for g in range(y.size(0)):
                out[ends[g]:ends[g + 1]] = (x[ends[g]:ends[g + 1]].float() @ y[g].float()).to(x.dtype)
            return out
        out = torch.empty((len(ends) - 1, x.size(0), y.size(1)), dtype=x.dtype)
        for g in range(len(ends) - 1):
            out[g] = (x[:, ends[g]:ends[g + 1]].float() @ y[ends[g]:ends[g + 1]].float()).to(x.dtype)
        return out
    return fn


@pytest.mark.parametrize("trans_b", [False, True])
def test_vendor_route_one_decision_per_step(trans_b, monkeypatch):
    """The op decides once per forward that all three GEMMs run the vendor kernel, and the backward
    then calls it directly with the right operand views: checked on CPU against the references
    with the vendor kernel emulated (the real one needs sm_90)."""
    if ON_GPU:
        pytest.skip("CPU emulation of the vendor path; the GPU runs the real one in the tests above")
    import primus_turbo.pytorch.backends.grouped_gemm as bg

    calls = []
    ops_mod = __import__("sys").modules["primus_turbo.pytorch.ops.grouped_gemm"]
    monkeypatch.setattr(ops_mod, "_native_ok", lambda *x: False)  # the autograd.Function form (below: native)
    monkeypatch.setattr(bg, "_sm90_bf16", lambda t: None)
    monkeypatch.setattr(torch, "_grouped_mm", _emulated_grouped_mm(calls), raising=False)
    lens = [5, 0, 19, 8]
    a, b, gl = _make(lens, 24, 16, torch.bfloat16, trans_b, "cpu", extra_rows=3)
    resolved = []
    real_resolve = bg.grouped_gemm_dispatcher.resolve
    monkeypatch.setattr(bg.grouped_gemm_dispatcher, "resolve", lambda *x, **k: resolved.append(1) or real_resolve(*x, **k))
    _check_fwd_bwd(a, b, gl, trans_b, torch.bfloat16, extra_rows=3)
    assert calls == [(2, 3), (2, 3), (2, 2)]  # forward, grad_input, grad_weight: all on the vendor kernel
    assert not resolved  # and none went through the per-GEMM dispatch


def _fake_gluon_modules(calls):
    """CPU stand-ins of the two 16-bit Gluon kernel modules (the route's checks pass, the kernels
    compute the fp32 reference products and record their operands)."""
    from types import SimpleNamespace

    from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg

    def m16(a, B, offs, checked=False, **_):
        calls.append(("m", B.stride(), a.data_ptr() % 16 == 0, checked))
        ends = offs.tolist()
        out = torch.zeros(a.size(0), B.size(2), dtype=a.dtype)
        for g in range(B.size(0)):
            out[ends[g]:ends[g + 1]] = (a[ends[g]:ends[g + 1]].float() @ B[g].float()).to(a.dtype)
        return out

    def vk(x, y, offs, **_):
        calls.append(("vk", x.shape, y.shape))
        ends = offs.tolist()
        return torch.stack([(x[ends[g]:ends[g + 1]].float().T @ y[ends[g]:ends[g + 1]].float()).to(x.dtype)
                            for g in range(len(ends) - 1)])

    mods = {"grouped_gemm_gluon": SimpleNamespace(grouped_gemm_gluon=m16, gluon_grouped_reason=lambda *x: None,
                                                  _b_kmajor=gg._b_kmajor),
            "grouped_gemm_variable_k_gluon": SimpleNamespace(grouped_gemm_variable_k_gluon=vk)}
    return mods


@pytest.mark.parametrize("trans_b", [False, True])
def test_gluon_route_all_three_gemms(trans_b, monkeypatch):
    """Under the default dispatch, where the 16-bit Gluon kernels can take all three GEMMs, the op
    decides once per forward and launches them directly: the forward and grad_input on the
    M-grouped kernel (the grad_input with the weight read transposed, in place; a misaligned output
    gradient copied first), the grad_weight on the variable-K kernel. CPU stand-ins for the kernels
    (they need sm_90); the references, the zeroed tail rows and the call order are checked."""
    if ON_GPU:
        pytest.skip("CPU stand-ins of the Gluon kernels; the GPU runs the real ones in the tests above")
    ops_mod = __import__("sys").modules["primus_turbo.pytorch.ops.grouped_gemm"]
    calls = []
    mods = _fake_gluon_modules(calls)
    monkeypatch.setattr(ops_mod, "_gluon16", lambda name, t: mods[name])
    monkeypatch.setattr(ops_mod, "_gluon_module", lambda name: mods[name])
    ops_mod._ROUTES.clear()
    lens = [5, 0, 19, 8]
    a, b, gl = _make(lens, 64, 128, torch.bfloat16, trans_b, "cpu", extra_rows=3)
    offs = torch.tensor([0, 5, 5, 24, 32])
    B = b.transpose(1, 2) if trans_b else b
    assert ops_mod._vendor_route(a, B, None, offs, trans_b) == "gluon"
    assert ops_mod._vendor_route(a, B, 4, offs, trans_b) is None  # num_cu: the dispatcher
    assert ops_mod._vendor_route(a, B, None, None, trans_b) != "gluon"  # no offsets
    for pin in (BackendType.TRITON, BackendType.GLUON, BackendType.TORCH):
        GlobalBackendManager.set_grouped_gemm_backend(pin)  # the TRITON / GLUON backends run these kernels
        try:
            assert (ops_mod._vendor_route(a, B, None, offs, trans_b) == "gluon") is (pin != BackendType.TORCH)
        finally:
            GlobalBackendManager.reset()
    _check_fwd_bwd(a, b, gl, trans_b, torch.bfloat16, extra_rows=3)
    assert [c[0] for c in calls] == ["m", "m", "vk"] and all(c[3] for c in calls[:2])
    assert calls[1][1] == (b if trans_b else b.transpose(1, 2)).stride()  # the weight, read transposed in place
    # an output gradient with a misaligned base reaches the kernels as an aligned copy
    calls.clear()
    a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
    out = grouped_gemm(a2, b2, gl, trans_b=trans_b)
    big = torch.randn(out.numel() + 1, dtype=out.dtype)
    out.backward(big[1:].view(out.shape))
    assert calls[1][2] is True
    # P (the grad_weight's rows per expert) not a multiple of 64: not this route
    a3, b3, _ = _make(lens, 24, 64, torch.bfloat16, trans_b, "cpu")
    B3 = b3.transpose(1, 2) if trans_b else b3
    assert (ops_mod._vendor_route(a3, B3, None, offs[:5], trans_b) == "gluon") is (not trans_b)


@pytest.mark.parametrize("pinned", [False, True])
def test_vendor_route_gives_large_wgrad_to_gluon(pinned, monkeypatch):
    """On the default vendor route the grad_weight goes to the Gluon variable-K kernel where
    gluon_wgrad gives it the problem (emulated here: the module and the vendor kernel are CPU
    stand-ins); a TORCH pin keeps every GEMM on the vendor kernel."""
    if ON_GPU:
        pytest.skip("CPU emulation of the vendor path")
    from types import SimpleNamespace

    import primus_turbo.pytorch.backends.grouped_gemm as bg

    ops_mod = __import__("sys").modules["primus_turbo.pytorch.ops.grouped_gemm"]
    calls, gluon_calls = [], []
    emulated = _emulated_grouped_mm([])

    def variable_k(x, y, group_offs):
        gluon_calls.append(group_offs.dtype)
        return emulated(x.t(), y, offs=group_offs[1:].to(torch.int32))

    fake = SimpleNamespace(grouped_gemm_variable_k_gluon=variable_k)
    monkeypatch.setattr(bg, "_sm90_bf16", lambda t: None)
    monkeypatch.setattr(torch, "_grouped_mm", _emulated_grouped_mm(calls), raising=False)
    monkeypatch.setattr(ops_mod, "gluon_wgrad", lambda x, y, offs, **k: fake)
    monkeypatch.setattr(ops_mod, "_native_ok", lambda *x: False)  # the autograd.Function form
    if pinned:
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH)
    a, b, gl = _make([5, 0, 19, 8], 24, 16, torch.bfloat16, True, "cpu", extra_rows=3)
    _check_fwd_bwd(a, b, gl, True, torch.bfloat16, extra_rows=3)
    assert calls == [(2, 3), (2, 3)] + ([(2, 2)] if pinned else [])
    assert gluon_calls == ([] if pinned else [torch.int64])


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("grads", ["both", "a", "b"])
def test_native_vendor_route(trans_b, grads, monkeypatch):
    """A small vendor-routed problem under autograd leaves its backward to torch's own formula for
    torch._grouped_mm (the real CPU kernel here; the route's sm_90 check mocked): same references
    as every path, rows past offs[G] zero in the output and in the grad_input (a post hook on the
    GEMM's node), whichever of a and b needs a gradient; a fused main_grad accumulation or a large
    grad_weight keeps the autograd.Function form."""
    if ON_GPU:
        pytest.skip("CPU form of the route check; on the GPU the default tests run the real route")
    import primus_turbo.pytorch.backends.grouped_gemm as bg

    ops_mod = __import__("sys").modules["primus_turbo.pytorch.ops.grouped_gemm"]
    monkeypatch.setattr(bg, "_sm90_bf16", lambda t: None)
    lens = [5, 0, 19, 8]
    a, b, gl = _make(lens, 24, 16, torch.bfloat16, trans_b, "cpu", extra_rows=7)
    a[32:] = float("nan")  # rows no expert owns: must reach neither the output nor a gradient
    a = a.requires_grad_(grads in ("both", "a"))
    b = b.requires_grad_(grads in ("both", "b"))
    out = grouped_gemm(a, b, gl, trans_b=trans_b)
    assert type(out.grad_fn).__name__ == "GroupedMmBackward0"  # no Python autograd.Function
    assert snr_db(grouped_gemm_ref(a[:32], b, gl, trans_b), out[:32]) >= MIN_SNR[torch.bfloat16]
    assert torch.equal(out[32:], torch.zeros_like(out[32:]))
    dc = torch.randn_like(out)
    out.backward(dc)
    if a.requires_grad:
        ref_da = grouped_gemm_ref(dc[:32], b, gl, trans_b=not trans_b)
        assert snr_db(ref_da, a.grad[:32]) >= MIN_SNR[torch.bfloat16]
        assert torch.equal(a.grad[32:], torch.zeros_like(a.grad[32:]))
    if b.requires_grad:
        ref_db = (grouped_gemm_variable_k_ref(dc[:32], a[:32], gl) if trans_b
                  else grouped_gemm_variable_k_ref(a[:32], dc[:32], gl))
        assert snr_db(ref_db, b.grad) >= MIN_SNR[torch.bfloat16]
    # an expanded output gradient (a .sum()'s): made dense before the vendor GEMM, which takes row-
    # or column-major operands only (on the GPU it raises otherwise)
    seen = []
    real_pre = ops_mod._vendor_grad_output
    monkeypatch.setattr(ops_mod, "_vendor_grad_output", lambda go: seen.append(real_pre(go)) or seen[-1])
    a.grad = b.grad = None
    grouped_gemm(a, b, gl, trans_b=trans_b).sum().backward()
    assert len(seen) == 1 and seen[0] is not None and seen[0][0].is_contiguous()
    ones = torch.ones(32, out.size(1), dtype=torch.bfloat16)
    if a.requires_grad:
        assert snr_db(grouped_gemm_ref(ones, b, gl, trans_b=not trans_b), a.grad[:32]) >= MIN_SNR[torch.bfloat16]
        assert torch.equal(a.grad[32:], torch.zeros_like(a.grad[32:]))
    if b.requires_grad:
        ref_db = (grouped_gemm_variable_k_ref(ones, a[:32], gl) if trans_b
                  else grouped_gemm_variable_k_ref(a[:32], ones, gl))
        assert snr_db(ref_db, b.grad) >= MIN_SNR[torch.bfloat16]
    # the Function form where the native one does not apply
    assert ops_mod._native_ok(a, b, trans_b, "default", False)
    assert not ops_mod._native_ok(a, b, trans_b, "default", True)  # fused main_grad accumulation
    assert not ops_mod._native_ok(a, b, trans_b, None, False)
    big = torch.empty(16384, 4096, dtype=torch.bfloat16)
    wbig = torch.empty(2, 4096, 4096, dtype=torch.bfloat16)
    assert 2.0 * 16384 * 4096 * 4096 >= ops_mod.GLUON_WGRAD_MIN_FLOPS
    assert not ops_mod._native_ok(big, wbig, True, "default", False)  # the default's Gluon wgrad size
    assert ops_mod._native_ok(big, wbig, True, "pinned", False)


def test_route_cache_follows_settings(monkeypatch):
    """_routed caches _vendor_route per call signature; a backend pin, the Gluon switch, another
    layout or offsets change the key."""
    if ON_GPU:
        pytest.skip("CPU form of the route check")
    import primus_turbo.pytorch.backends.grouped_gemm as bg

    ops_mod = __import__("sys").modules["primus_turbo.pytorch.ops.grouped_gemm"]
    monkeypatch.setattr(bg, "_sm90_bf16", lambda t: None)
    seen = []
    real = ops_mod._vendor_route
    monkeypatch.setattr(ops_mod, "_vendor_route", lambda *x: seen.append(1) or real(*x))
    a, b, _gl = _make([4, 4], 16, 8, torch.bfloat16, False, "cpu")
    assert ops_mod._routed(a, b, False, None, None) == "default"
    assert ops_mod._routed(a, b, False, None, None) == "default" and len(seen) == 1
    assert ops_mod._routed(a, b, False, 4, None) is None and len(seen) == 1  # num_cu: never routed
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH)
    assert ops_mod._routed(a, b, False, None, None) == "pinned" and len(seen) == 2
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON)  # asked: the Gluon route may serve it
    assert ops_mod._routed(a, b, False, None, None) is None and len(seen) == 3
    GlobalBackendManager.reset()
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_GLUON", "0")
    assert ops_mod._routed(a, b, False, None, None) == "default" and len(seen) == 4
    assert ops_mod._routed(a, b, False, None, torch.tensor([0, 4, 8])) == "default" and len(seen) == 5
    assert ops_mod._routed(a, b.transpose(1, 2).contiguous(), True, None, None) == "default" and len(seen) == 6


def test_default_resolution_cache(monkeypatch, device):
    """_resolved (the M-grouped GEMMs' dispatch without a pin) asks the dispatcher once per call
    signature; a new shape, a pin, the Gluon switch or the interpreter switch asks again, and a pin
    always goes through the dispatcher's own resolution."""
    import primus_turbo.pytorch.backends.grouped_gemm as bg

    calls = []
    real = bg.grouped_gemm_dispatcher.resolve
    monkeypatch.setattr(bg.grouped_gemm_dispatcher, "resolve", lambda *x, **k: calls.append(1) or real(*x, **k))
    a, b, gl = _make([5, 0, 11], 24, 16, torch.float32, True, device)
    ref = grouped_gemm_ref(a, b, gl, True)
    for _ in range(3):
        assert snr_db(ref, grouped_gemm(a, b, gl, trans_b=True)) >= MIN_SNR[torch.float32]
    assert len(calls) == 1
    a2, b2, gl2 = _make([5, 0, 12], 24, 16, torch.float32, True, device)
    grouped_gemm(a2, b2, gl2, trans_b=True)
    assert len(calls) == 2
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_GLUON", "0")
    grouped_gemm(a, b, gl, trans_b=True)
    assert len(calls) == 3
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON)
    for _ in range(2):
        grouped_gemm(a, b, gl, trans_b=True)
    assert len(calls) == 5  # a pin: the dispatcher's resolution every call
    GlobalBackendManager.reset()
    grouped_gemm(a, b, gl, trans_b=True)
    assert len(calls) == 6  # the settings changed: asked again


def test_vendor_route_respects_pins_and_num_cu(monkeypatch):
    if ON_GPU:
        pytest.skip("CPU emulation of the vendor path")
    import primus_turbo.pytorch.backends.grouped_gemm as bg

    ops_mod = __import__("sys").modules["primus_turbo.pytorch.ops.grouped_gemm"]
    monkeypatch.setattr(bg, "_sm90_bf16", lambda t: None)
    a, b, _gl = _make([4, 4], 16, 8, torch.bfloat16, False, "cpu")
    assert ops_mod._vendor_route(a, b, None)
    assert not ops_mod._vendor_route(a, b, 4)  # num_cu: the TRITON kernels
    assert not ops_mod._vendor_route(a, torch.randn(2, 8, 12, dtype=torch.bfloat16), None)  # N*2 % 16 != 0
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON)
    assert not ops_mod._vendor_route(a, b, None)
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH)
    assert ops_mod._vendor_route(a, b, None)


def test_vendor_route_leaves_large_problems_to_the_dispatcher(monkeypatch):
    """A problem the 16-bit default gives to the Gluon kernel (gluon16_large_preferred, here mocked
    on a small CPU problem) takes the dispatcher's route under autograd when group_offs is given and
    the Gluon backend can run it; without offsets, or when it cannot, the vendor route stays."""
    if ON_GPU:
        pytest.skip("CPU emulation of the vendor path")
    import primus_turbo.pytorch.backends.grouped_gemm as bg

    ops_mod = __import__("sys").modules["primus_turbo.pytorch.ops.grouped_gemm"]
    monkeypatch.setattr(bg, "_sm90_bf16", lambda t: None)
    a, b, gl = _make([4, 4], 16, 8, torch.bfloat16, False, "cpu")
    offs = torch.tensor([0, 4, 8])
    monkeypatch.setattr(ops_mod, "gluon16_large_preferred", lambda *s: True)
    monkeypatch.setattr(ops_mod.GroupedGemmGluonBackend, "check", classmethod(lambda cls, *x: None))
    assert ops_mod._vendor_route(a, b, None, offs) is None
    assert ops_mod._vendor_route(a, b, None) == "default"
    monkeypatch.setattr(ops_mod.GroupedGemmGluonBackend, "check", classmethod(lambda cls, *x: "no"))
    assert ops_mod._vendor_route(a, b, None, offs) == "default"
    monkeypatch.setattr(ops_mod, "gluon16_large_preferred", lambda *s: False)
    monkeypatch.setattr(ops_mod.GroupedGemmGluonBackend, "check", classmethod(lambda cls, *x: None))
    assert ops_mod._vendor_route(a, b, None, offs) == "default"
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH)
    monkeypatch.setattr(ops_mod, "gluon16_large_preferred", lambda *s: True)
    assert ops_mod._vendor_route(a, b, None, offs) == "pinned"  # a TORCH pin wins


def test_default_vk_picks_gluon_for_fp32_accumulation_and_large_wgrad(monkeypatch):
    """The variable-K dispatcher's default: the vendor kernel, except where the 16-bit Gluon kernel
    can run the fused accumulation into an fp32 main_grad, or a plain wgrad of at least
    GLUON_WGRAD_MIN_FLOPS (TRITON backend, which runs the Gluon kernel); the module is emulated
    (its reason None / a refusal), the rule is what is tested."""
    from types import SimpleNamespace

    from primus_turbo.pytorch.backends import grouped_gemm as be
    from primus_turbo.pytorch.core.backend import BackendType

    x = torch.randn(64, 16, dtype=torch.bfloat16)
    y = torch.randn(64, 32, dtype=torch.bfloat16)
    offs = torch.tensor([0, 32, 64])
    out = torch.zeros(2, 16, 32)
    verdict = {"reason": None}
    fake = SimpleNamespace(gluon_variable_k_reason=lambda *a, **k: verdict["reason"])
    monkeypatch.setattr(be, "_gluon16", lambda name, t: fake)
    monkeypatch.setattr(be.GroupedGemmVariableKTorchBackend, "can_handle", classmethod(lambda cls, **kw: True))
    kw = dict(x=x, y=y, group_lens=offs.diff(), group_offs=offs, out=out)
    assert be._default_vk(**kw, accumulate=True) == BackendType.TRITON
    assert be._default_vk(**kw, accumulate=False) == BackendType.TORCH  # small plain wgrad: vendor
    assert be._default_vk(**{**kw, "out": out.bfloat16()}, accumulate=True) == BackendType.TORCH  # bf16 main_grad
    assert be._default_vk(**kw, accumulate=True, num_cu=8) == BackendType.TORCH  # vendor can_handle emulated
    # a plain wgrad at the bound: 2 * M * P * Q == GLUON_WGRAD_MIN_FLOPS
    monkeypatch.setattr(be, "GLUON_WGRAD_MIN_FLOPS", 2.0 * 64 * 16 * 32)
    assert be._default_vk(**{**kw, "out": None}, accumulate=False) == BackendType.TRITON
    assert be.gluon_wgrad(x, y, offs) is fake
    assert be.gluon_wgrad(x, y, None) is None  # no device offsets: nothing to schedule from
    monkeypatch.setattr(be, "GLUON_WGRAD_MIN_FLOPS", 2.0 * 64 * 16 * 32 + 1)
    assert be._default_vk(**{**kw, "out": None}, accumulate=False) == BackendType.TORCH
    assert be.gluon_wgrad(x, y, offs) is None
    verdict["reason"] = "P must be a multiple of 64"
    assert be._default_vk(**kw, accumulate=True) == BackendType.TORCH
    monkeypatch.setattr(be, "_gluon16", lambda name, t: None)  # switch off / not CUDA
    verdict["reason"] = None
    assert be._default_vk(**kw, accumulate=True) == BackendType.TORCH


def _count_routes(monkeypatch):
    """(slow, fast): the routes taken from here on, the checked path's Function (its route
    appended) and the kept Gluon step's (1 appended); the step cache starts empty."""
    import importlib

    mod = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm")
    mod._FAST_ROUTES.clear()
    slow, fast = [], []
    real_slow, real_fast = mod.GroupedGemmFunction.apply, mod._GluonStepFunction.apply
    monkeypatch.setattr(mod.GroupedGemmFunction, "apply", lambda *args: slow.append(args[-1]) or real_slow(*args))
    monkeypatch.setattr(mod._GluonStepFunction, "apply", lambda *args: fast.append(1) or real_fast(*args))
    return slow, fast


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [False, True])
def test_flat_key_route_repeats_and_follows_the_settings(trans_b, monkeypatch):
    """Calls with given offsets under autograd (the form the benchmarks and MoE layers use): the
    first call of a signature takes the checked path, later ones the kept Gluon step
    (``_GluonStepFunction``); new tensors of one signature, fresh output and gradient blocks,
    repeats, a call where only the weight needs its gradient and calls with derived offsets all
    give the references (tail rows zero); a TORCH pin reroutes at once; an input the checks reject still raises."""
    lens = [300, 0, 451, 200]
    slow, fast = _count_routes(monkeypatch)

    def step(a0, b0, gl, offs, need_a=True):
        a = a0.detach().requires_grad_(need_a)
        b = b0.detach().requires_grad_()
        out = grouped_gemm(a, b, gl, offs, trans_b=trans_b)
        dc = torch.randn_like(out)
        out.backward(dc)
        assert snr_db(grouped_gemm_ref(a, b, gl, trans_b), out) >= MIN_SNR[torch.bfloat16]
        assert torch.equal(out[951:], torch.zeros_like(out[951:]))
        if need_a:
            assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=not trans_b), a.grad) >= MIN_SNR[torch.bfloat16]
            assert torch.equal(a.grad[951:], torch.zeros_like(a.grad[951:]))
        else:
            assert a.grad is None
        ref_db = grouped_gemm_variable_k_ref(dc, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, dc, gl)
        assert snr_db(ref_db, b.grad) >= MIN_SNR[torch.bfloat16]
        return a, b

    try:
        for rep in range(3):
            a0, b0, gl = _make(lens, 384, 256, torch.bfloat16, trans_b, "cuda", extra_rows=7)
            offs = torch.zeros(len(lens) + 1, dtype=torch.int64, device="cuda")
            offs[1:] = torch.cumsum(gl, 0)
            for _ in range(2):
                a, b = step(a0, b0, gl, offs)
        assert slow == ["gluon"] and len(fast) == 5
        for _ in range(2):
            step(a0, b0, gl, offs, need_a=False)
        assert slow == ["gluon", "gluon"] and len(fast) == 6
        for _ in range(2):  # offsets derived on the device (the reference API's default form)
            step(a0, b0, gl, None)
        assert slow == ["gluon"] * 3 and len(fast) == 7
        with pytest.raises(TypeError, match="group_lens must be int64"):
            grouped_gemm(a, b, gl.to(torch.int32), offs, trans_b=trans_b)
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH)
        out = grouped_gemm(a, b, gl, offs, trans_b=trans_b)
        assert len(fast) == 7 and "gluon" not in slow[3:]
        assert snr_db(grouped_gemm_ref(a, b, gl, trans_b), out) >= MIN_SNR[torch.bfloat16]
    finally:
        GlobalBackendManager.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [False, True])
def test_flat_key_route_megatron_form(trans_b, monkeypatch):
    """Megatron's calling form (``fuse_bgrad_accum_pattern="megatron"``, given offsets, an fp32
    ``main_grad``) takes the kept Gluon step from the second call of a signature: over several
    micro-batches ``main_grad`` holds the sum of the wgrads, ``grad_added_to_main_grad`` is set and
    ``b.grad`` is the placeholder; a new ``main_grad`` tensor of the same facts is accumulated into
    (not the old one); a bf16 ``main_grad`` (the vendor GEMM + ``add_``) never takes the step."""
    lens = [300, 0, 451, 200]
    slow, fast = _count_routes(monkeypatch)

    def micro_batches(b, gl, offs, expected, steps):
        for _ in range(steps):
            a = torch.randn(gl.sum().item() + 7, b.size(2) if trans_b else b.size(1), dtype=torch.bfloat16,
                            device="cuda", requires_grad=True)
            out = grouped_gemm(a, b, gl, offs, trans_b=trans_b, fuse_bgrad_accum_pattern="megatron")
            dc = torch.randn_like(out)
            out.backward(dc)
            assert snr_db(grouped_gemm_ref(a, b, gl, trans_b), out) >= MIN_SNR[torch.bfloat16]
            assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=not trans_b), a.grad) >= MIN_SNR[torch.bfloat16]
            assert torch.equal(a.grad[951:], torch.zeros_like(a.grad[951:]))
            expected += grouped_gemm_variable_k_ref(dc, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, dc, gl)
            # the op flags b with its forward (Megatron's contract); Megatron's DDP clears it per step
            assert b.grad_added_to_main_grad is True and b.grad is not None and b.grad.shape == b.shape
            b.grad = None
            b.grad_added_to_main_grad = False
        return expected

    try:
        _, b, gl = _make(lens, 384, 256, torch.bfloat16, trans_b, "cuda")
        b.requires_grad_()
        offs = torch.zeros(len(lens) + 1, dtype=torch.int64, device="cuda")
        offs[1:] = torch.cumsum(gl, 0)
        b.main_grad = torch.randn(b.shape, dtype=torch.float32, device="cuda")
        expected = micro_batches(b, gl, offs, b.main_grad.double().clone(), 4)
        assert snr_db(expected, b.main_grad) >= MIN_SNR[torch.bfloat16]
        assert slow == ["gluon"] and len(fast) == 3
        first, snapshot = b.main_grad, b.main_grad.clone()
        b.main_grad = torch.randn(b.shape, dtype=torch.float32, device="cuda")  # a new buffer, same facts
        expected = micro_batches(b, gl, offs, b.main_grad.double().clone(), 2)
        assert snr_db(expected, b.main_grad) >= MIN_SNR[torch.bfloat16]
        assert len(fast) == 5 and len(slow) == 1
        assert torch.equal(first, snapshot)  # the replaced buffer is left alone
        b.main_grad = torch.randn(b.shape, dtype=torch.bfloat16, device="cuda")
        expected = micro_batches(b, gl, offs, b.main_grad.double().clone(), 2)
        assert snr_db(expected, b.main_grad) >= 41.0
        assert len(fast) == 5 and len(slow) == 3
    finally:
        GlobalBackendManager.reset()


def test_fast_key_covers_what_the_checks_and_route_read(monkeypatch):
    """``_fast_key`` (the cache key of the Gluon step route) changes with every fact the checks and
    the route read: ``trans_b``, dtypes, which operands need grads, the backend pin, the Gluon and
    pacing switches; it is None for non-tensor arguments and odd ``trans_b`` values (the checked
    path then raises). On CPU nothing is kept (the route there is never the Gluon one)."""
    import importlib

    from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg

    mod = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm")
    assert mod._PACE_ENV == gg.PACE_ENV
    a, b, gl = _make([3, 5], 16, 32, torch.bfloat16, True, "cpu")
    offs = torch.tensor([0, 3, 8])
    k = mod._fast_key(a, b, gl, offs, True)
    assert k is not None and k == mod._fast_key(a, b, gl, offs, True) and hash(k) == hash(mod._fast_key(a, b, gl, offs, 1))
    assert mod._fast_key(a, b, gl, offs, False) != k
    assert mod._fast_key(a, b, gl, None, True) not in (None, k)  # offsets derived on the device
    assert mod._fast_key(a, b, gl.to(torch.int32), offs, True) != k
    assert mod._fast_key(a.half(), b.half(), gl, offs, True) != k
    assert mod._fast_key(a.detach().requires_grad_(), b, gl, offs, True) != k
    for env in (mod._PACE_ENV, mod._GLUON_ENV):
        monkeypatch.setenv(env, "2")
        assert mod._fast_key(a, b, gl, offs, True) != k
        monkeypatch.delenv(env)
    try:
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON)
        assert mod._fast_key(a, b, gl, offs, True) != k
    finally:
        GlobalBackendManager.reset()
    with pytest.raises(AttributeError):
        b.main_grad
    k = mod._fast_key(a, b, gl, offs, True)  # (the pin and reset above moved the settings version)
    assert mod._fast_key(a, b, gl, offs, True, True) is None  # Megatron's form without main_grad
    b.main_grad = torch.zeros(b.shape, dtype=torch.float32)
    km = mod._fast_key(a, b, gl, offs, True, True)
    assert km not in (None, k) and km == mod._fast_key(a, b, gl, offs, True, True)
    b.main_grad = torch.zeros(b.shape, dtype=torch.bfloat16)
    assert mod._fast_key(a, b, gl, offs, True, True) not in (None, k, km)
    b.main_grad = torch.zeros(b.shape, dtype=torch.float32)
    assert mod._fast_key(a, b, gl, offs, True, True) == km
    assert mod._fast_key(a, b, gl, offs, True) == k  # main_grad is read in Megatron's form only
    del b.main_grad
    assert mod._fast_key(a, b, [3, 5], offs, True) is None
    assert mod._fast_key(a, b, gl, offs, "yes") is None
    assert mod._fast_key(a.float().to_sparse(), b.float(), gl, offs, True) is None  # no strides
    if torch.cuda.is_available():  # CPU tensors run only through the interpreter (the CPU machines)
        return
    mod._FAST_ROUTES.clear()
    out = grouped_gemm(a.detach().requires_grad_(), b, gl, offs, trans_b=True)
    out.sum().backward()
    w = b.detach().requires_grad_()
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    grouped_gemm(a, w, gl, offs, trans_b=True, fuse_bgrad_accum_pattern="megatron").sum().backward()
    assert w.grad_added_to_main_grad is True
    assert not mod._FAST_ROUTES


@pytest.mark.parametrize("trans_b", [False, True])
def test_gluon_accum_ok_follows_the_checked_paths_accumulation(trans_b, monkeypatch):
    """``_gluon_accum_ok`` (may Megatron's form take the kept step?) says yes exactly where the
    checked path's fused accumulation runs the Gluon variable-K kernel: an fp32 ``main_grad`` the
    kernel takes (platform mocked as sm_90); no for a bf16 ``main_grad`` (vendor GEMM + add_), a
    missing one, one of another shape, or a platform the kernel cannot run on."""
    import importlib

    pytest.importorskip("triton")
    from tests.triton.gluon_gemm_helpers import fake_platform

    mod = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm")
    vk = mod._gluon_module("grouped_gemm_variable_k_gluon")
    if not vk.GLUON_AVAILABLE:
        pytest.skip("Gluon is not importable here")
    state = fake_platform(monkeypatch, vk)
    a, b, gl = _make([3, 5], 128, 64, torch.bfloat16, trans_b, "cpu")
    offs = torch.tensor([0, 3, 8])
    assert not mod._gluon_accum_ok(a, b, trans_b, offs)  # no main_grad
    b.main_grad = torch.zeros(b.shape, dtype=torch.float32)
    assert mod._gluon_accum_ok(a, b, trans_b, offs)
    b.main_grad = torch.zeros(b.shape, dtype=torch.bfloat16)
    assert not mod._gluon_accum_ok(a, b, trans_b, offs)
    b.main_grad = torch.zeros((2, 64, 64), dtype=torch.float32)
    assert not mod._gluon_accum_ok(a, b, trans_b, offs)
    b.main_grad = torch.zeros(b.shape, dtype=torch.float32)
    state["reason"] = "not an sm_90 GPU"
    assert not mod._gluon_accum_ok(a, b, trans_b, offs)


class _FakeLaunchers:
    """CPU stand-ins for the 16-bit Gluon launcher modules a ``_GluonStep`` holds (``m16`` / ``vk16``):
    the same contracts (``out`` written, rows past the groups zero, ``accumulate`` adds), computed in
    float64, recording each call's ``keep`` slot; ``fire`` declines (nothing kept runs here)."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _spans(offs):
        o = offs.tolist()
        return list(zip(o[:-1], o[1:]))

    def grouped_gemm_gluon(self, a, B, offs, out=None, checked=False, keep=None):
        self.calls.append(("m", keep))
        res = torch.zeros(out.shape, dtype=torch.float64)
        for g, (s, e) in enumerate(self._spans(offs)):
            res[s:e] = a[s:e].double() @ B[g].double()
        out.copy_(res)
        return out

    def grouped_gemm_variable_k_gluon(self, x, y, offs, out=None, accumulate=False, keep=None):
        self.calls.append(("vk", keep, accumulate))
        res = torch.stack([x[s:e].double().T @ y[s:e].double() for s, e in self._spans(offs)])
        if accumulate:
            out.add_(res.to(out.dtype))
        else:
            out.copy_(res)
        return out

    def fire(self, kept, index):
        return False


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("need", ["both", "a", "b"])
def test_step_function_plumbing_without_a_gpu(fuse, trans_b, need):
    """``_GluonStepFunction`` (the kept Gluon step) with CPU stand-ins for the launchers: the
    forward, grad_input and grad_weight GEMMs get the operands ``GroupedGemmFunction`` gives them
    (``b`` transposed or not, the output gradient made contiguous), each with its own ``keep`` slot;
    gradients match the references for every combination of operands needing grads; Megatron's form
    accumulates into ``main_grad`` (fp32, ``accumulate=True``) over micro-batches and returns the
    placeholder, leaving ``grad_added_to_main_grad`` to the op (``grouped_gemm`` sets it after the
    Function's ``apply``, see ``ops.gemm._flag_main_grad``; checked in test_compile_megatron.py)."""
    import importlib

    mod = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm")
    lens = [5, 0, 9, 3]
    a0, b0, gl = _make(lens, 64, 32, torch.float32, trans_b, "cpu", extra_rows=2)
    offs = torch.tensor([0, 5, 5, 14, 17])
    step = mod._GluonStep(a0, b0, trans_b, fuse)
    fake = step.m16 = step.vk16 = _FakeLaunchers()
    b = b0.detach().requires_grad_(need in ("both", "b"))
    if fuse:
        b.main_grad = torch.randn(b.shape)
    expected = b.main_grad.double().clone() if fuse else None
    for _ in range(2):  # micro-batches
        a = a0.detach().requires_grad_(need in ("both", "a"))
        out = mod._GluonStepFunction.apply(a, b, offs, step)
        assert snr_db(grouped_gemm_ref(a, b, gl, trans_b), out) >= 130 and torch.equal(out[17:], torch.zeros(2, 64))
        dc = torch.randn(out.shape).t().contiguous().t()  # a non-contiguous output gradient
        out.backward(dc)
        if need in ("both", "a"):
            assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=not trans_b), a.grad) >= 130
        else:
            assert a.grad is None
        ref_db = grouped_gemm_variable_k_ref(dc, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, dc, gl)
        if need == "a":
            assert b.grad is None
        elif fuse:
            expected += ref_db
            assert not hasattr(b, "grad_added_to_main_grad") and b.grad is not None
            b.grad = None
        else:
            assert snr_db(ref_db, b.grad) >= 130
            b.grad = None
    if fuse and need != "a":
        assert snr_db(expected, b.main_grad) >= 120
    kinds = [c[0] for c in fake.calls]
    per_step = 1 + (need != "b") + (need != "a")
    assert len(kinds) == 2 * per_step and kinds.count("vk") == 2 * (need != "a")
    for c in fake.calls:  # every launch names its GEMM's keep slot
        slot = {"m": (step.fwd, step.dgrad), "vk": (step.wgrad,)}[c[0]]
        assert c[1] is not None and any(c[1][0] is s for s in slot)
        if c[0] == "vk":
            assert c[2] is fuse
