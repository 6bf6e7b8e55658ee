"""turbo.ops.flash_attn_func against float64 references: both backends, GQA/MQA, head_dim_qk != head_dim_v,
causal (bottom-right), sliding windows, sinks, the LSE, strided layouts, one backend per call, error paths.

On CPU the TRITON backend runs in the Triton interpreter, so shapes are tiny; tests marked ``gpu``
run realistic sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo  # noqa: F401  (package import, as users do)
from primus_turbo.pytorch.backends.attention import AttnTorchBackend, AttnTritonBackend, attn_dispatcher
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
from primus_turbo.pytorch.ops.attention import flash_attn_func
from primus_turbo.testing import attention_ref, snr_db

# (seq_q, seq_kv, heads_q, heads_kv, head_dim_qk, head_dim_v)
CONFIGS = [(64, 64, 2, 2, 32, 32), (64, 64, 4, 2, 32, 32), (32, 96, 4, 1, 32, 32), (64, 64, 2, 2, 48, 32)]
# (causal, window_size)
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 0)), (False, (8, 8))]
GPU_CONFIGS = [(1024, 1024, 32, 32, 128, 128), (1024, 1024, 32, 8, 128, 128), (512, 1024, 16, 16, 192, 128)]


def _inputs(cfg, batch, dtype, device, sink=False, requires_grad=True):
    sq, sk, hq, hk, dqk, dv = cfg
    q = torch.randn(batch, sq, hq, dqk, dtype=dtype, device=device)
    k = torch.randn(batch, sk, hk, dqk, dtype=dtype, device=device)
    v = torch.randn(batch, sk, hk, dv, dtype=dtype, device=device)
    s = torch.randn(hq, dtype=torch.float32, device=device) if sink else None
    ts = [q, k, v] + ([s] if sink else [])
    for t in ts:
        t.requires_grad_(requires_grad)
    return q, k, v, s


def _ref(q, k, v, s, causal, window, compute_dtype=torch.float64, dout=None):
    """(out, grads) of attention_ref computed in compute_dtype from leaf copies of the inputs."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    sl = None if s is None else s.detach().to(compute_dtype).requires_grad_()
    out = attention_ref(*leaves, causal=causal, window_size=window, sink=sl, compute_dtype=compute_dtype)
    out.backward(dout.to(compute_dtype))
    grads = [t.grad for t in leaves] + ([sl.grad] if sl is not None else [])
    return out.detach(), grads


def _run(q, k, v, s, causal, window, dout, **kw):
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, sink=s, **kw)
    out.backward(dout)
    grads = [q.grad, k.grad, v.grad] + ([s.grad] if s is not None else [])
    return out.detach(), grads


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("causal,window", MASKS, ids=lambda m: str(m).replace(" ", ""))
@pytest.mark.parametrize("sink", [False, True], ids=["nosink", "sink"])
def test_triton_fp32_vs_fp64(cfg, causal, window, sink, device):
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    q, k, v, s = _inputs(cfg, 2, torch.float32, device, sink)
    dout = torch.randn(2, cfg[0], cfg[2], cfg[5], device=device)
    out, grads = _run(q, k, v, s, causal, window, dout)
    ref, ref_grads = _ref(q, k, v, s, causal, window, dout=dout)
    assert snr_db(ref, out) >= 40.0
    for name, g, rg in zip(["dq", "dk", "dv", "dsink"], grads, ref_grads):
        assert snr_db(rg, g) >= 40.0, name


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("causal", [False, True])
def test_torch_fp32_vs_fp64(cfg, causal, device):
    GlobalBackendManager.set_attn_backend(BackendType.TORCH)
    q, k, v, s = _inputs(cfg, 2, torch.float32, device)
    dout = torch.randn(2, cfg[0], cfg[2], cfg[5], device=device)
    out, grads = _run(q, k, v, s, causal, (-1, -1), dout)
    ref, ref_grads = _ref(q, k, v, s, causal, (-1, -1), dout=dout)
    assert snr_db(ref, out) >= 40.0
    for name, g, rg in zip(["dq", "dk", "dv"], grads, ref_grads):
        assert snr_db(rg, g) >= 40.0, name


def _max_err(ref, x):
    return float((x.double() - ref.double()).abs().max())


def _check_flash_rule(out, grads, q, k, v, s, causal, window, dout):
    """flash-attention's rule: our error vs the fp64 reference <= 2x PyTorch's own low-precision error (+ slack)."""
    ref, ref_grads = _ref(q, k, v, s, causal, window, dout=dout)
    pt, pt_grads = _ref(q, k, v, s, causal, window, compute_dtype=q.dtype, dout=dout)
    for name, x, r, p in zip(["out", "dq", "dk", "dv", "dsink"], [out] + grads, [ref] + ref_grads, [pt] + pt_grads):
        slack = 1e-3 * float(r.abs().max()) + 1e-5
        assert _max_err(r, x) <= 2 * _max_err(r, p) + slack, (name, _max_err(r, x), _max_err(r, p))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "cfg,causal,window,sink",
    [(CONFIGS[1], True, (-1, -1), True), (CONFIGS[2], False, (16, 0), False), (CONFIGS[3], False, (8, 8), True)],
    ids=["gqa-causal-sink", "mqa-window", "dv-window-sink"],
)
def test_triton_low_precision_flash_rule(dtype, cfg, causal, window, sink, device):
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    q, k, v, s = _inputs(cfg, 1, dtype, device, sink)
    dout = torch.randn(1, cfg[0], cfg[2], cfg[5], dtype=dtype, device=device)
    out, grads = _run(q, k, v, s, causal, window, dout)
    assert out.dtype == dtype and grads[0].dtype == dtype
    _check_flash_rule(out, grads, q, k, v, s, causal, window, dout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_low_precision_flash_rule(dtype, device):
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("fp16 SDPA on CPU is emulated; covered on GPU")
    GlobalBackendManager.set_attn_backend(BackendType.TORCH)
    cfg = CONFIGS[1]
    q, k, v, s = _inputs(cfg, 1, dtype, device)
    dout = torch.randn(1, cfg[0], cfg[2], cfg[5], dtype=dtype, device=device)
    out, grads = _run(q, k, v, s, True, (-1, -1), dout)
    _check_flash_rule(out, grads, q, k, v, s, True, (-1, -1), dout)


@pytest.mark.parametrize(
    "cfg,causal,window,sink",
    [(CONFIGS[1], False, (-1, -1), True), (CONFIGS[2], True, (-1, -1), False), ((96, 32, 2, 1, 32, 32), True, (-1, -1), False),
     ((96, 32, 2, 1, 32, 32), True, (-1, -1), True)],
    ids=["sink", "causal-sq<sk", "causal-empty-rows", "causal-empty-rows-sink"],
)
def test_return_lse(cfg, causal, window, sink, device):
    q, k, v, s = _inputs(cfg, 2, torch.float32, device, sink, requires_grad=False)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, sink=s, return_lse=True)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal, window, None if s is None else s.double(),
                                 return_lse=True)
    assert lse.shape == (2, cfg[2], cfg[0]) and lse.dtype == torch.float32
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert bool((lse[~fin] == float("inf")).all())
    assert snr_db(ref_lse[fin], lse[fin]) >= 40.0
    assert snr_db(ref, out) >= 40.0
    if not fin.all():  # rows with no visible key and no sink give zeros
        assert bool((out.transpose(1, 2)[~fin] == 0).all())


def test_empty_rows_backward_finite(device):
    """causal with seq_q > seq_kv: the top rows see nothing; gradients stay finite and match."""
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    cfg = (96, 32, 2, 1, 32, 32)
    q, k, v, s = _inputs(cfg, 1, torch.float32, device)
    dout = torch.randn(1, 96, 2, 32, device=device)
    out, grads = _run(q, k, v, s, True, (-1, -1), dout)
    ref, ref_grads = _ref(q, k, v, s, True, (-1, -1), dout=dout)
    assert snr_db(ref, out) >= 40.0
    for g, rg in zip(grads, ref_grads):
        assert snr_db(rg, g) >= 40.0


@pytest.mark.parametrize("layout", ["sbhd", "bhsd"])
@pytest.mark.parametrize("backend", [BackendType.TRITON, BackendType.TORCH])
def test_strided_layouts(layout, backend, device):
    """Physical sbhd / bhsd storage passed as logical [b, s, h, d] views gives the same result."""
    GlobalBackendManager.set_attn_backend(backend)
    cfg = CONFIGS[1]
    q, k, v, _ = _inputs(cfg, 2, torch.float32, device, requires_grad=False)

    def restride(t):
        if layout == "sbhd":
            return t.transpose(0, 1).contiguous().transpose(0, 1)
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    qs, ks, vs = (restride(t).requires_grad_() for t in (q, k, v))
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn(2, cfg[0], cfg[2], cfg[5], device=device)
    o1 = flash_attn_func(qs, ks, vs, causal=True)
    o1.backward(dout)
    o2 = flash_attn_func(qc, kc, vc, causal=True)
    o2.backward(dout)
    assert snr_db(o2, o1) >= 100.0
    for a, b in ((qs, qc), (ks, kc), (vs, vc)):
        assert snr_db(b.grad, a.grad) >= 100.0


def test_default_backend_rule(device):
    q, k, v, s = _inputs(CONFIGS[1], 1, torch.float32, device, sink=True, requires_grad=False)
    base = dict(q=q, k=k, v=v, softmax_scale=0.1, win_left=-1, win_right=-1, return_lse=False, deterministic=False)
    res = lambda **kw: attn_dispatcher.resolve(PrecisionType.BF16_FP16_FP32, **dict(base, **kw))  # noqa: E731
    assert res() is AttnTorchBackend
    assert res(win_right=0) is AttnTorchBackend
    assert res(sink=s) is AttnTritonBackend
    assert res(win_left=8, win_right=0) is AttnTritonBackend
    assert res(return_lse=True) is AttnTritonBackend


def test_pinned_torch_refuses_sink(device):
    GlobalBackendManager.set_attn_backend(BackendType.TORCH)
    q, k, v, s = _inputs(CONFIGS[0], 1, torch.float32, device, sink=True, requires_grad=False)
    with pytest.raises(ValueError, match="sink"):
        flash_attn_func(q, k, v, sink=s)


def test_backward_stays_on_forward_backend(device, monkeypatch):
    cfg = CONFIGS[1]
    calls = []
    orig = AttnTritonBackend.backward.__func__
    monkeypatch.setattr(AttnTritonBackend, "backward", classmethod(lambda cls, *a, **kw: calls.append(1) or orig(cls, *a, **kw)))
    dout = torch.randn(1, cfg[0], cfg[2], cfg[5], device=device)

    # forward on TRITON, pin TORCH before backward: the backward is still TRITON's
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    q, k, v, _ = _inputs(cfg, 1, torch.float32, device)
    out = flash_attn_func(q, k, v, causal=True)
    GlobalBackendManager.set_attn_backend(BackendType.TORCH)
    out.backward(dout)
    assert calls == [1]

    # forward on TORCH, pin TRITON before backward: the backward is SDPA's (TRITON never called)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out2 = flash_attn_func(q2, k2, v2, causal=True)
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    out2.backward(dout)
    assert calls == [1]
    assert snr_db(q.grad, q2.grad) >= 40.0 and snr_db(k.grad, k2.grad) >= 40.0


def test_triton_backward_deterministic(device):
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    cfg = CONFIGS[1]
    q, k, v, s = _inputs(cfg, 1, torch.float32, device, sink=True)
    dout = torch.randn(1, cfg[0], cfg[2], cfg[5], device=device)
    results = []
    for _ in range(2):
        for t in (q, k, v, s):
            t.grad = None
        flash_attn_func(q, k, v, causal=True, sink=s, deterministic=True).backward(dout)
        results.append([t.grad.clone() for t in (q, k, v, s)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("deterministic", [True, False])
def test_atomic_dq_switch_and_deterministic(deterministic, device, monkeypatch):
    """PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ=1 runs the one-kernel atomic-dQ backward (dense and varlen, fp16),
    except with deterministic=True, which always gets the two-kernel path."""
    from primus_turbo.pytorch.ops.attention import flash_attn_varlen_func
    from primus_turbo.triton.attention import flash_attn_bwd as bwd_mod

    seen = []
    orig = bwd_mod._launch_bwd
    monkeypatch.setattr(bwd_mod, "_launch_bwd", lambda *a, **kw: seen.append(kw.get("atomic", False)) or orig(*a, **kw))
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ", "1")
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    cfg = CONFIGS[1]
    q, k, v, s = _inputs(cfg, 2, torch.float16, device, sink=True)
    dout = torch.randn(2, cfg[0], cfg[2], cfg[5], device=device, dtype=torch.float16)
    out, grads = _run(q, k, v, s, True, (-1, -1), dout, deterministic=deterministic)
    assert seen == [not deterministic]
    ref, ref_grads = _ref(q, k, v, s, True, (-1, -1), dout=dout)
    for name, g, rg in zip(["dq", "dk", "dv", "dsink"], grads, ref_grads):
        assert snr_db(rg, g) >= 40.0, name
    # varlen: the same switch, the same rule
    qv, kv, vv = (t.detach()[0].clone().requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, 20, cfg[0]], dtype=torch.int32, device=device)
    flash_attn_varlen_func(qv, kv, vv, cu, cu, cfg[0] - 20, cfg[0] - 20, causal=True,
                           deterministic=deterministic).backward(dout[0])
    assert seen == [not deterministic] * 2


def test_global_deterministic_mode_gets_two_kernel_backward(device, monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` (Megatron's --deterministic-mode) counts as
    ``deterministic=True`` for every call: the two-kernel backward even where the atomic-dQ switch is
    on, dense and varlen, and never the SDPA route (the dispatcher sees the flag)."""
    from primus_turbo.pytorch.ops.attention import flash_attn_varlen_func
    from primus_turbo.triton.attention import flash_attn_bwd as bwd_mod

    seen, flags = [], []
    orig = bwd_mod._launch_bwd
    monkeypatch.setattr(bwd_mod, "_launch_bwd", lambda *a, **kw: seen.append(kw.get("atomic", False)) or orig(*a, **kw))
    orig_resolve = attn_dispatcher.resolve
    monkeypatch.setattr(attn_dispatcher, "resolve",
                        lambda *a, **kw: flags.append(kw["deterministic"]) or orig_resolve(*a, **kw))
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ", "1")
    cfg = CONFIGS[1]
    q, k, v, _ = _inputs(cfg, 1, torch.float16, device)
    dout = torch.randn(1, cfg[0], cfg[2], cfg[5], device=device, dtype=torch.float16)
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn_only: cuBLAS needs no workspace setting
    try:
        GlobalBackendManager.set_attn_backend(BackendType.TRITON)
        flash_attn_func(q, k, v, causal=True).backward(dout)
        qv, kv, vv = (t.detach()[0].clone().requires_grad_() for t in (q, k, v))
        cu = torch.tensor([0, 20, cfg[0]], dtype=torch.int32, device=device)
        flash_attn_varlen_func(qv, kv, vv, cu, cu, cfg[0] - 20, cfg[0] - 20, causal=True).backward(dout[0])
        GlobalBackendManager.reset()
        flash_attn_func(q, k, v, causal=True)  # the default dispatch: told deterministic, so never SDPA on CUDA
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
    assert seen == [False, False]
    assert flags == [True, True, True]
    # with the global switch off again, the dispatcher is told deterministic=False
    flash_attn_func(q, k, v, causal=True)
    assert flags[-1] is False


def test_atomic_dq_env_default_is_two_kernel(device, monkeypatch):
    from primus_turbo.triton.attention import flash_attn_bwd as bwd_mod

    seen = []
    orig = bwd_mod._launch_bwd
    monkeypatch.setattr(bwd_mod, "_launch_bwd", lambda *a, **kw: seen.append(kw.get("atomic", False)) or orig(*a, **kw))
    monkeypatch.delenv("PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ", raising=False)
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    q, k, v, _ = _inputs(CONFIGS[0], 1, torch.bfloat16, device)
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert seen == [False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_atomic_dq_low_precision_flash_rule(dtype, device, monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ", "1")
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    cfg, causal, window = (64, 96, 4, 2, 48, 32), False, (16, 8)
    q, k, v, s = _inputs(cfg, 1, dtype, device, sink=True)
    dout = torch.randn(1, cfg[0], cfg[2], cfg[5], dtype=dtype, device=device)
    out, grads = _run(q, k, v, s, causal, window, dout)
    assert grads[0].dtype == dtype and grads[0].shape == q.shape
    _check_flash_rule(out, grads, q, k, v, s, causal, window, dout)


def test_no_grad_path(device):
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    q, k, v, s = _inputs(CONFIGS[0], 1, torch.float32, device, sink=True)
    with torch.no_grad():
        out = flash_attn_func(q, k, v, sink=s)
    assert not out.requires_grad
    assert snr_db(attention_ref(q.double(), k.double(), v.double(), sink=s.double()), out) >= 40.0


def test_sink_grad_only_when_needed(device):
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    q, k, v, s = _inputs(CONFIGS[0], 1, torch.float32, device, sink=True)
    s.requires_grad_(False)
    flash_attn_func(q, k, v, sink=s).sum().backward()
    assert s.grad is None and q.grad is not None


# ---- error paths -----------------------------------------------------------------------------
def _good(device):
    return _inputs(CONFIGS[1], 1, torch.float32, device, requires_grad=False)[:3]


@pytest.mark.parametrize(
    "kwargs,name",
    [(dict(dropout_p=0.1), "dropout_p"), (dict(bias=torch.zeros(1)), "bias"), (dict(alibi_slopes=torch.zeros(4)), "alibi_slopes"),
     (dict(return_attn_probs=True), "return_attn_probs")],
)
def test_unsupported_options_raise(kwargs, name, device):
    q, k, v = _good(device)
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_func(q, k, v, **kwargs)


def test_bad_inputs(device):
    q, k, v = _good(device)
    with pytest.raises(ValueError, match="4-D"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        flash_attn_func(q, k.half(), v)
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_func(q.to(torch.float64), k.to(torch.float64), v.to(torch.float64))
    with pytest.raises(ValueError, match="one device"):
        flash_attn_func(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="heads_q=4 must be a multiple of heads_kv=3"):
        flash_attn_func(q, torch.randn(1, 64, 3, 32, device=device), torch.randn(1, 64, 3, 32, device=device))
    with pytest.raises(ValueError, match="same head_dim"):
        flash_attn_func(q, k[..., :16], v)
    with pytest.raises(ValueError, match="seq_kv"):
        flash_attn_func(q, k, v[:, :32])
    with pytest.raises(ValueError, match="batch"):
        flash_attn_func(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match="sink must have shape"):
        flash_attn_func(q, k, v, sink=torch.zeros(3))
    with pytest.raises(TypeError, match="sink must be float32"):
        flash_attn_func(q, k, v, sink=torch.zeros(4, dtype=torch.bfloat16))


# ---- GPU, realistic sizes --------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("backend", [BackendType.TRITON, BackendType.TORCH])
def test_gpu_bf16_flash_rule(cfg, causal, sink, backend, device):
    if backend is BackendType.TORCH and sink:
        pytest.skip("SDPA has no sinks")
    GlobalBackendManager.set_attn_backend(backend)
    q, k, v, s = _inputs(cfg, 2, torch.bfloat16, device, sink)
    dout = torch.randn(2, cfg[0], cfg[2], cfg[5], dtype=torch.bfloat16, device=device)
    out, grads = _run(q, k, v, s, causal, (-1, -1), dout)
    _check_flash_rule(out, grads, q, k, v, s, causal, (-1, -1), dout)


@pytest.mark.gpu
@pytest.mark.timeout(420)  # the first case compiles the fp32 kernels: 29 s on the H200 (122 s with the 16-bit tiles)
@pytest.mark.parametrize("window", [(128, 0), (64, 64)])
def test_gpu_window_fp32(window, device):
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    cfg = (1024, 1024, 8, 2, 128, 128)
    q, k, v, s = _inputs(cfg, 1, torch.float32, device, sink=True)
    dout = torch.randn(1, cfg[0], cfg[2], cfg[5], device=device)
    out, grads = _run(q, k, v, s, False, window, dout)
    ref, ref_grads = _ref(q, k, v, s, False, window, dout=dout)
    assert snr_db(ref, out) >= 40.0
    for g, rg in zip(grads, ref_grads):
        assert snr_db(rg, g) >= 40.0


@pytest.mark.parametrize("sink", [False, True])
def test_custom_ops_opcheck(sink, device):
    """The TRITON path's torch.library ops: schema, fake (meta) implementations, autograd registration."""
    import primus_turbo.pytorch.ops.attention  # noqa: F401  (registers the ops)

    q, k, v, s = _inputs(CONFIGS[1], 1, torch.float32, device, sink=sink, requires_grad=False)
    args = (q, k, v, s, 0.17, 8, 0)
    torch.library.opcheck(torch.ops.primus_turbo.flash_attn_triton_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.primus_turbo.flash_attn_triton_fwd(*args)
    bargs = (torch.randn_like(out), q, k, v, out, lse, s, 0.17, 8, 0)
    torch.library.opcheck(torch.ops.primus_turbo.flash_attn_triton_bwd.default, bargs,
                          test_utils=("test_schema", "test_faketensor"))
