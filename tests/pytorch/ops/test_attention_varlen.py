"""flash_attn_varlen_func (packed THD sequences) against attention_ref applied per sequence in float64:
GQA/MQA, head_dim_qk != head_dim_v, causal (bottom-right per sequence), sliding windows, sinks (with
dsink), the [heads_q, total_q] LSE, equality with flash_attn_func for equal lengths, backend
selection (TRITON only), error paths, and a GPU run under sync-debug "error" (no host sync).

On CPU the TRITON kernels run in the Triton interpreter, so shapes are tiny.
"""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo  # noqa: F401  (package import, as users do)
from primus_turbo.pytorch.backends.attention import AttnTorchBackend, AttnTritonBackend, attn_dispatcher
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
from primus_turbo.pytorch.ops.attention import flash_attn_func, flash_attn_varlen_func
from primus_turbo.testing import attention_ref, snr_db

PATTERNS = {"eq32": [32] * 4, "pow2": [8, 16, 32, 64], "odd": [7, 31, 50, 17], "long-first": [64, 8, 8, 8]}
# (heads_q, heads_kv, head_dim_qk, head_dim_v)
HEADS = [(2, 2, 32, 32), (4, 2, 32, 32), (4, 1, 48, 32)]
# (causal, window_size, sink): every pattern x heads config runs each of these
MASKS = [(False, (-1, -1), False), (True, (-1, -1), True), (False, (16, 0), True)]


def _cu(lens, device):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _inputs(lens_q, lens_k, heads, dtype, device, sink=False, requires_grad=True):
    hq, hk, dqk, dv = heads
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, dqk, dtype=dtype, device=device)
    k = torch.randn(tk, hk, dqk, dtype=dtype, device=device)
    v = torch.randn(tk, hk, dv, dtype=dtype, device=device)
    s = torch.randn(hq, dtype=torch.float32, device=device) if sink else None
    for t in (q, k, v, s):
        if t is not None:
            t.requires_grad_(requires_grad)
    return q, k, v, s


def _ref(q, k, v, s, lens_q, lens_k, causal, window, dout, compute_dtype=torch.float64):
    """Per-sequence attention_ref in compute_dtype: (out, [dq, dk, dv, (dsink)], lse [Hq, Tq])."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    sl = None if s is None else s.detach().to(compute_dtype).requires_grad_()
    outs, lses = [], []
    cq, ck = 0, 0
    for nq, nk in zip(lens_q, lens_k):
        o, lse = attention_ref(leaves[0][cq:cq + nq][None], leaves[1][ck:ck + nk][None], leaves[2][ck:ck + nk][None],
                               causal=causal, window_size=window, sink=sl, return_lse=True, compute_dtype=compute_dtype)
        outs.append(o[0])
        lses.append(lse[0])
        cq, ck = cq + nq, ck + nk
    out = torch.cat(outs)
    out.backward(dout.to(compute_dtype))
    grads = [t.grad for t in leaves] + ([sl.grad] if sl is not None else [])
    return out.detach(), grads, torch.cat(lses, dim=1).detach()


def _run(q, k, v, s, lens_q, lens_k, causal, window, dout, **kw):
    device = q.device
    out, lse = flash_attn_varlen_func(q, k, v, _cu(lens_q, device), _cu(lens_k, device), max(lens_q), max(lens_k),
                                      causal=causal, window_size=window, sink=s, return_lse=True, **kw)
    out.backward(dout)
    grads = [q.grad, k.grad, v.grad] + ([s.grad] if s is not None else [])
    return out.detach(), grads, lse


@pytest.mark.parametrize("pattern", list(PATTERNS), ids=list(PATTERNS))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("causal,window,sink", MASKS, ids=["full-nosink", "causal-sink", "window16-sink"])
def test_varlen_fp32_vs_fp64(pattern, heads, causal, window, sink, device):
    lens = PATTERNS[pattern]
    q, k, v, s = _inputs(lens, lens, heads, torch.float32, device, sink)
    dout = torch.randn(sum(lens), heads[0], heads[3], device=device)
    out, grads, lse = _run(q, k, v, s, lens, lens, causal, window, dout)
    ref, ref_grads, ref_lse = _ref(q, k, v, s, lens, lens, causal, window, dout)
    assert out.shape == (sum(lens), heads[0], heads[3])
    assert lse.shape == (heads[0], sum(lens)) and lse.dtype == torch.float32
    assert snr_db(ref, out) >= 40.0
    assert snr_db(ref_lse, lse) >= 40.0
    for name, g, rg in zip(["dq", "dk", "dv", "dsink"], grads, ref_grads):
        assert snr_db(rg, g) >= 40.0, name


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (16, 0)), (False, (-1, -1))],
                         ids=["causal", "window", "full"])
def test_varlen_seqlen_q_ne_k(causal, window, device):
    """Different q and k lengths per sequence (incl. seq_q > seq_k: causal rows with no key) + a sink."""
    lens_q, lens_k = [7, 31, 50, 17], [20, 16, 64, 17]
    heads = HEADS[1]
    q, k, v, s = _inputs(lens_q, lens_k, heads, torch.float32, device, sink=True)
    dout = torch.randn(sum(lens_q), heads[0], heads[3], device=device)
    out, grads, lse = _run(q, k, v, s, lens_q, lens_k, causal, window, dout)
    ref, ref_grads, ref_lse = _ref(q, k, v, s, lens_q, lens_k, causal, window, dout)
    assert snr_db(ref, out) >= 40.0 and snr_db(ref_lse, lse) >= 40.0
    for name, g, rg in zip(["dq", "dk", "dv", "dsink"], grads, ref_grads):
        assert snr_db(rg, g) >= 40.0, name


def test_varlen_zero_length_sequences(device):
    """Empty sequences (q and/or k) inside the batch: their programs exit; the rest is unaffected."""
    lens_q, lens_k = [0, 16, 5, 9], [4, 16, 0, 9]
    heads = HEADS[1]
    q, k, v, s = _inputs(lens_q, lens_k, heads, torch.float32, device, sink=True)
    dout = torch.randn(sum(lens_q), heads[0], heads[3], device=device)
    out, grads, lse = _run(q, k, v, s, lens_q, lens_k, True, (-1, -1), dout)
    ref, ref_grads, ref_lse = _ref(q, k, v, s, lens_q, lens_k, True, (-1, -1), dout)
    assert snr_db(ref, out) >= 40.0 and snr_db(ref_lse, lse) >= 40.0
    assert bool((grads[1][:4] == 0).all())  # keys of a sequence with no queries get zero gradients
    for name, g, rg in zip(["dq", "dk", "dv", "dsink"], grads, ref_grads):
        assert snr_db(rg, g) >= 40.0, name


def test_varlen_empty_rows_no_sink(device):
    """causal with seq_q > seq_k and no sink: rows with no key give 0 and LSE +inf; grads finite."""
    lens_q, lens_k = [40, 8], [8, 40]
    heads = HEADS[0]
    q, k, v, s = _inputs(lens_q, lens_k, heads, torch.float32, device)
    dout = torch.randn(sum(lens_q), heads[0], heads[3], device=device)
    out, grads, lse = _run(q, k, v, s, lens_q, lens_k, True, (-1, -1), dout)
    ref, ref_grads, ref_lse = _ref(q, k, v, s, lens_q, lens_k, True, (-1, -1), dout)
    fin = torch.isfinite(ref_lse)
    assert not fin.all() and torch.equal(torch.isfinite(lse), fin) and bool((lse[~fin] == float("inf")).all())
    assert bool((out.transpose(0, 1)[~fin] == 0).all())
    assert snr_db(ref, out) >= 40.0
    for g, rg in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and snr_db(rg, g) >= 40.0


def _max_err(ref, x):
    return float((x.double() - ref.double()).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "pattern,heads,causal,window,sink",
    [("odd", HEADS[1], True, (-1, -1), True), ("long-first", HEADS[2], False, (16, 0), False)],
    ids=["gqa-causal-sink", "mqa-dv-window"],
)
def test_varlen_low_precision_flash_rule(dtype, pattern, heads, causal, window, sink, device):
    """flash-attention's rule: error vs fp64 <= 2x PyTorch's own low-precision error (+ slack)."""
    lens = PATTERNS[pattern]
    q, k, v, s = _inputs(lens, lens, heads, dtype, device, sink)
    dout = torch.randn(sum(lens), heads[0], heads[3], dtype=dtype, device=device)
    out, grads, _ = _run(q, k, v, s, lens, lens, causal, window, dout)
    assert out.dtype == dtype and grads[0].dtype == dtype
    ref, ref_grads, _ = _ref(q, k, v, s, lens, lens, causal, window, dout)
    pt, pt_grads, _ = _ref(q, k, v, s, lens, lens, causal, window, dout, compute_dtype=dtype)
    for name, x, r, p in zip(["out", "dq", "dk", "dv", "dsink"], [out] + grads, [ref] + ref_grads, [pt] + pt_grads):
        slack = 1e-3 * float(r.abs().max()) + 1e-5
        assert _max_err(r, x) <= 2 * _max_err(r, p) + slack, (name, _max_err(r, x), _max_err(r, p))


@pytest.mark.parametrize("causal,window,sink", [(True, (-1, -1), True), (False, (16, 0), False)], ids=["causal-sink", "window"])
def test_varlen_equals_dense_for_equal_lengths(causal, window, sink, device):
    """[32]*4 packed == flash_attn_func on [4, 32, ...]: same kernels, same blocks, bitwise equal."""
    GlobalBackendManager.set_attn_backend(BackendType.TRITON)
    lens, heads = [32] * 4, HEADS[1]
    q, k, v, s = _inputs(lens, lens, heads, torch.float32, device, sink)
    dout = torch.randn(sum(lens), heads[0], heads[3], device=device)
    out, grads, lse = _run(q, k, v, s, lens, lens, causal, window, dout)
    qd, kd, vd = (t.detach().view(4, 32, *t.shape[1:]).clone().requires_grad_() for t in (q, k, v))
    sd = None if s is None else s.detach().clone().requires_grad_()
    out_d, lse_d = flash_attn_func(qd, kd, vd, causal=causal, window_size=window, sink=sd, return_lse=True)
    out_d.backward(dout.view(4, 32, *dout.shape[1:]))
    assert torch.equal(out, out_d.detach().reshape(out.shape))
    assert torch.equal(lse, lse_d.permute(1, 0, 2).reshape(lse.shape))
    for g, gd in zip(grads, [qd.grad, kd.grad, vd.grad] + ([sd.grad] if sd is not None else [])):
        assert torch.allclose(g, gd.reshape(g.shape), rtol=1e-5, atol=1e-6)
    for g, gd in zip(grads[:3], [qd.grad, kd.grad, vd.grad]):
        assert torch.equal(g, gd.reshape(g.shape))


def test_varlen_padding_rows_and_strides(device):
    """Rows outside cu_seqlens get out 0 / LSE inf / zero grads; non-contiguous (strided) inputs work."""
    lens = [8, 16]
    heads = HEADS[1]
    hq, hk, dqk, dv = heads
    # q, k, v as views into wider buffers (head-major storage), plus 5 trailing padding rows
    qb = torch.randn(hq, sum(lens) + 5, dqk, device=device)
    kb = torch.randn(hk, sum(lens) + 5, dqk, device=device)
    vb = torch.randn(hk, sum(lens) + 5, dv, device=device)
    q, k, v = (t.transpose(0, 1).requires_grad_() for t in (qb, kb, vb))
    cu = _cu(lens, device)
    out, lse = flash_attn_varlen_func(q, k, v, cu, cu, 16, 16, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    n = sum(lens)
    assert bool((out[n:] == 0).all()) and bool((lse[:, n:] == float("inf")).all())
    for t in (q, k, v):
        assert bool((t.grad[n:] == 0).all())
    ref, ref_grads, ref_lse = _ref(q[:n], k[:n], v[:n], None, lens, lens, True, (-1, -1), dout[:n])
    assert snr_db(ref, out[:n]) >= 40.0 and snr_db(ref_lse, lse[:, :n]) >= 40.0
    for t, rg in zip((q, k, v), ref_grads):
        assert snr_db(rg, t.grad[:n]) >= 40.0


def test_varlen_no_grad_and_deterministic(device):
    lens, heads = PATTERNS["odd"], HEADS[1]
    q, k, v, s = _inputs(lens, lens, heads, torch.float32, device, sink=True)
    cu = _cu(lens, device)
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k, v, cu, cu, 50, 50, sink=s, causal=True)
    assert not out.requires_grad
    dout = torch.randn_like(out)
    results = []
    for _ in range(2):
        for t in (q, k, v, s):
            t.grad = None
        flash_attn_varlen_func(q, k, v, cu, cu, 50, 50, sink=s, causal=True, deterministic=True).backward(dout)
        results.append([t.grad.clone() for t in (q, k, v, s)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_varlen_backend_is_triton_only(device):
    lens, heads = [8, 16], HEADS[0]
    q, k, v, _ = _inputs(lens, lens, heads, torch.float32, device, requires_grad=False)
    cu = _cu(lens, device)
    kw = dict(q=q, k=k, v=v, sink=None, softmax_scale=0.1, win_left=-1, win_right=-1, return_lse=False,
              deterministic=False, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16)
    assert "varlen" in AttnTorchBackend.why_not(**kw)
    assert attn_dispatcher.resolve(PrecisionType.BF16_FP16_FP32, **kw) is AttnTritonBackend
    GlobalBackendManager.set_attn_backend(BackendType.TORCH)
    with pytest.raises(ValueError, match="varlen"):
        flash_attn_varlen_func(q, k, v, cu, cu, 16, 16)


@pytest.mark.parametrize("shared_cu", [True, False], ids=["one_cu", "two_cu"])
def test_varlen_torch_compile_fullgraph(shared_cu, device):
    """torch.compile(fullgraph=True) of the self-attention call form, one cu_seqlens tensor passed
    as both (which an autograd.Function cannot receive twice under dynamo: the op passes it once),
    and of two equal tensors: output and every gradient equal eager's bit for bit."""
    lens, heads = PATTERNS["odd"], HEADS[1]
    q, k, v, s = _inputs(lens, lens, heads, torch.float32, device, sink=True)
    cu = _cu(lens, device)
    cu_k = cu if shared_cu else cu.clone()

    def f(q, k, v, s):
        return flash_attn_varlen_func(q, k, v, cu, cu_k, 50, 50, sink=s, causal=True, deterministic=True)

    dout = torch.randn(q.shape[0], heads[0], heads[3], device=device)
    runs = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        for t in (q, k, v, s):
            t.grad = None
        out = fn(q, k, v, s)
        out.backward(dout)
        runs.append([out.detach()] + [t.grad.clone() for t in (q, k, v, s)])
    for i, (a, b) in enumerate(zip(*runs)):
        assert a.abs().sum() > 0 and torch.equal(a, b), i


def test_varlen_custom_ops_opcheck(device):
    import primus_turbo.pytorch.ops.attention  # noqa: F401  (registers the ops)

    lens, heads = [8, 16], HEADS[1]
    q, k, v, s = _inputs(lens, lens, heads, torch.float32, device, sink=True, requires_grad=False)
    cu = _cu(lens, device)
    args = (q, k, v, cu, cu, 16, 16, s, 0.17, 8, 0)
    torch.library.opcheck(torch.ops.primus_turbo.flash_attn_varlen_triton_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.primus_turbo.flash_attn_varlen_triton_fwd(*args)
    bargs = (torch.randn_like(out), q, k, v, out, lse, cu, cu, 16, 16, s, 0.17, 8, 0)
    torch.library.opcheck(torch.ops.primus_turbo.flash_attn_varlen_triton_bwd.default, bargs,
                          test_utils=("test_schema", "test_faketensor"))


# ---- error paths -----------------------------------------------------------------------------
def test_varlen_bad_inputs(device):
    lens = [8, 16]
    q, k, v, _ = _inputs(lens, lens, HEADS[1], torch.float32, device, requires_grad=False)
    cu = _cu(lens, device)
    f = flash_attn_varlen_func
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        f(q, k, v, cu.long(), cu, 16, 16)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        f(q, k, v, cu, cu.float(), 16, 16)
    with pytest.raises(ValueError, match="1-D"):
        f(q, k, v, cu.view(1, -1), cu, 16, 16)
    with pytest.raises(ValueError, match="1-D"):
        f(q, k, v, cu, cu[:0], 16, 16)
    with pytest.raises(ValueError, match="cu_seqlens_q on meta"):
        f(q, k, v, cu.to("meta"), cu, 16, 16)
    with pytest.raises(ValueError, match="batch \\+ 1 entries"):
        f(q, k, v, cu, cu[:2], 16, 16)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        f(q, k, v, [0, 8, 24], cu, 16, 16)
    with pytest.raises(ValueError, match="3-D"):
        f(q[None], k, v, cu, cu, 16, 16)
    with pytest.raises(ValueError, match="same total_k"):
        f(q, k, v[:10], cu, cu, 16, 16)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        f(q, k, v, cu, cu, 16.0, 16)
    with pytest.raises(ValueError, match="max_seqlen_k=100 exceeds total_k=24"):
        f(q, k, v, cu, cu, 16, 100)
    with pytest.raises(ValueError, match="max_seqlen_q=25 exceeds total_q=24"):
        f(q, k, v, cu, cu, 25, 16)
    with pytest.raises(TypeError, match="flash_attn_varlen_func: q, k, v must share a dtype"):
        f(q, k.half(), v, cu, cu, 16, 16)
    with pytest.raises(ValueError, match="heads_q=4 must be a multiple of heads_kv=3"):
        f(q, torch.randn(24, 3, 32, device=q.device), torch.randn(24, 3, 32, device=q.device), cu, cu, 16, 16)
    with pytest.raises(ValueError, match="sink must have shape"):
        f(q, k, v, cu, cu, 16, 16, sink=torch.zeros(3))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        f(q, k, v, cu, cu, 16, 16, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        f(q, k, v, cu, cu, 16, 16, return_attn_probs=True)


# ---- GPU, realistic sizes, no host sync -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[512] * 4, [2048, 64, 64, 64]], ids=["512x4", "2048-64-64-64"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen_bf16_no_sync(lens, causal, device):
    heads = (32, 8, 128, 128)
    q, k, v, s = _inputs(lens, lens, heads, torch.bfloat16, device, sink=True)
    dout = torch.randn(sum(lens), heads[0], heads[3], dtype=torch.bfloat16, device=device)
    cu = _cu(lens, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal, sink=s,
                                          return_lse=True)
        out.backward(dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    grads = [q.grad, k.grad, v.grad, s.grad]
    ref, ref_grads, _ = _ref(q, k, v, s, lens, lens, causal, (-1, -1), dout)
    pt, pt_grads, _ = _ref(q, k, v, s, lens, lens, causal, (-1, -1), dout, compute_dtype=torch.bfloat16)
    for name, x, r, p in zip(["out", "dq", "dk", "dv", "dsink"], [out] + grads, [ref] + ref_grads, [pt] + pt_grads):
        slack = 1e-3 * float(r.abs().max()) + 1e-5
        assert _max_err(r, x) <= 2 * _max_err(r, p) + slack, (name, _max_err(r, x), _max_err(r, p))
