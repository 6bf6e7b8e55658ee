"""The attention Triton kernels called directly: ragged sequence lengths (not block multiples),
non-power-of-two head dims, every mask kind, sinks, and degenerate sizes, against float64."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.testing import attention_ref, snr_db

triton_attn = pytest.importorskip("primus_turbo.triton.attention")


def _win(causal, window):
    left, right = window
    return left, (0 if causal else right)


@pytest.mark.parametrize(
    "cfg,causal,window,sink",
    [
        ((37, 50, 2, 1, 24, 40), False, (-1, -1), True),
        ((50, 37, 3, 3, 40, 24), True, (-1, -1), False),  # seq_q > seq_kv: empty causal rows
        ((45, 45, 2, 2, 16, 16), False, (5, 3), True),
        ((33, 70, 4, 2, 32, 16), True, (20, -1), True),
        ((40, 40, 2, 1, 32, 32), False, (-1, 0), False),  # right=0 without causal = causal
        # several blocks per row / column (the CPU tiles are 32): masked edge blocks around an
        # unmasked interior, whole and partial blocks, head dims with and without padding
        ((128, 128, 2, 1, 32, 32), True, (-1, -1), False),
        ((100, 164, 2, 1, 32, 32), True, (-1, -1), True),
        ((164, 100, 2, 2, 32, 32), False, (40, 10), False),
        ((130, 130, 2, 2, 24, 40), False, (50, -1), True),
        ((96, 160, 1, 1, 32, 32), False, (-1, -1), False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_vs_fp64(cfg, causal, window, sink, dtype, device):
    """fp32 (exact products) and fp16 (the tensor-core path on the GPU, where narrow head dims are
    padded to 64-wide tiles: see mma_min_block) on the same masks and ragged sizes."""
    _check_vs_fp64(cfg, causal, window, sink, device, 0.3, dtype)


def test_mma_min_block():
    from primus_turbo.triton.attention import flash_attn_fwd as fwd_mod

    cpu16 = torch.empty(1, dtype=torch.float16)
    assert fwd_mod.mma_min_block(cpu16) == 16
    assert fwd_mod.attn_block_dims(40, 24, 64) == (64, 64) and fwd_mod.attn_block_dims(40, 24) == (64, 32)
    if torch.cuda.is_available():
        assert fwd_mod.mma_min_block(cpu16.cuda()) == 64
        assert fwd_mod.mma_min_block(torch.empty(1, device="cuda")) == 16


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_kernels_nonpositive_scale(scale, causal, device):
    """The forward takes the row extreme before scaling: a negative scale needs the row minimum."""
    _check_vs_fp64((100, 164, 2, 1, 32, 32), causal, (-1, -1), True, device, scale)


def _skip_if_no_triton(device):
    if triton_attn.check_flash_attn_triton(torch.empty(1, device=device), None, torch.empty(1, device=device)):
        pytest.skip("Triton attention kernels cannot run on this device")


def _check_vs_fp64(cfg, causal, window, sink, device, scale, dtype=torch.float32, **bwd_kw):
    """The kernels on ``dtype`` inputs (sink fp32) against float64 math on the same (rounded) values."""
    _skip_if_no_triton(device)
    sq, sk, hq, hk, dqk, dv = cfg
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, device=device).to(dtype).double()  # noqa: E731
    q, k, v = (rnd(2, sq, hq, dqk).requires_grad_(), rnd(2, sk, hk, dqk).requires_grad_(),
               rnd(2, sk, hk, dv).requires_grad_())
    s = torch.randn(hq, dtype=torch.float64, device=device, requires_grad=True) if sink else None
    wl, wr = _win(causal, window)
    f = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
    fs = None if s is None else s.detach().float()
    out, lse = triton_attn.flash_attn_fwd_triton(f(q), f(k), f(v), fs, scale, wl, wr)
    ref, ref_lse = attention_ref(q, k, v, causal, window, s, scale, return_lse=True)
    dout = rnd(*ref.shape)
    ref.backward(dout)
    dq, dk, dv_, dsink = triton_attn.flash_attn_bwd_triton(f(dout), f(q), f(k), f(v), out, lse, fs, scale, wl, wr,
                                                           **bwd_kw)
    assert dq.dtype == dtype and dq.shape == q.shape and dq.is_contiguous()
    assert snr_db(ref, out) >= 40.0
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert snr_db(ref_lse[fin], lse[fin]) >= 40.0
    for name, g, rg in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv_, v.grad)):
        assert snr_db(rg, g) >= 40.0, name
    if sink:
        assert snr_db(s.grad, dsink) >= 40.0
    else:
        assert dsink is None


def test_zero_length_kv(device):
    _skip_if_no_triton(device)
    q = torch.randn(1, 8, 2, 16, device=device)
    k = torch.randn(1, 0, 2, 16, device=device)
    v = torch.randn(1, 0, 2, 16, device=device)
    out, lse = triton_attn.flash_attn_fwd_triton(q, k, v, None, 0.25)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("inf")).all())
    dq, dk, dv, _ = triton_attn.flash_attn_bwd_triton(torch.randn_like(out), q, k, v, out, lse, None, 0.25)
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.numel() == 0 and dv.numel() == 0


# ---- the one-kernel backward with atomic dQ accumulation --------------------------------------
@pytest.fixture
def launches(monkeypatch):
    """The ``atomic`` flag of every backward launch (spies on flash_attn_bwd._launch_bwd)."""
    from primus_turbo.triton.attention import flash_attn_bwd as bwd_mod

    seen = []
    orig = bwd_mod._launch_bwd

    def spy(*args, **kwargs):
        seen.append(kwargs.get("atomic", False))
        return orig(*args, **kwargs)

    monkeypatch.setattr(bwd_mod, "_launch_bwd", spy)
    return seen


ATOMIC_CASES = [  # (cfg, causal, window, sink)
    # several 32-row / 32-key blocks per row and column: masked edges around an unmasked interior
    ((128, 128, 2, 1, 32, 32), True, (-1, -1), False),  # GQA, whole blocks, causal
    ((100, 164, 4, 2, 32, 32), True, (-1, -1), True),  # GQA, partial blocks, seq_q < seq_kv, sink
    ((164, 100, 2, 2, 32, 32), False, (40, 10), False),  # two-sided window, seq_q > seq_kv
    ((130, 130, 2, 2, 24, 40), False, (50, -1), True),  # left window, padded head dims
    ((50, 37, 3, 3, 40, 24), True, (-1, -1), False),  # empty causal rows
    ((96, 160, 1, 1, 64, 64), False, (-1, -1), False),  # no mask at all
    ((80, 100, 4, 1, 128, 128), True, (-1, -1), False),  # head dim 128 (the common GPU case), MQA
    ((70, 90, 2, 1, 192, 128), True, (-1, -1), True),  # head_dim_qk 192 != head_dim_v 128, GQA
]


@pytest.mark.parametrize(
    "cfg,causal,window,sink,dtype",
    [(*c, torch.float16) for c in ATOMIC_CASES]
    # bf16 without sinks: dsink = -sum P_sink * rowsum(dO * O) (torch, the same on both paths) inherits
    # the bf16 rounding of the forward's O and reaches only ~35 dB against float64
    + [(*c, torch.bfloat16) for c in ATOMIC_CASES if not c[3]],
)
def test_atomic_dq_vs_fp64(cfg, causal, window, sink, dtype, device, launches):
    """The one-kernel backward (16-bit inputs: the only ones it takes) against float64 math."""
    _check_vs_fp64(cfg, causal, window, sink, device, 0.3, dtype, deterministic=False, atomic_dq=True)
    assert launches == [True]


def test_atomic_dq_bf16_matches_two_kernel(device, launches):
    """bf16: the atomic variant's gradients are as close to the two-kernel ones as rounding allows."""
    _skip_if_no_triton(device)
    q = torch.randn(1, 96, 4, 64, dtype=torch.bfloat16, device=device)
    k = torch.randn(1, 80, 2, 64, dtype=torch.bfloat16, device=device)
    v = torch.randn(1, 80, 2, 64, dtype=torch.bfloat16, device=device)
    out, lse = triton_attn.flash_attn_fwd_triton(q, k, v, None, 0.125, -1, 0)
    dout = torch.randn_like(out)
    two = triton_attn.flash_attn_bwd_triton(dout, q, k, v, out, lse, None, 0.125, -1, 0)
    one = triton_attn.flash_attn_bwd_triton(dout, q, k, v, out, lse, None, 0.125, -1, 0, deterministic=False,
                                            atomic_dq=True)
    assert launches == [False, True]
    for name, a, b in zip(("dq", "dk", "dv"), two, one):
        assert b.dtype == torch.bfloat16 and b.shape == a.shape and b.is_contiguous(), name
        assert snr_db(a.float(), b.float()) >= 40.0, name
    assert torch.equal(two[1], one[1]) and torch.equal(two[2], one[2])  # dK, dV: the same program


@pytest.mark.parametrize("causal,window,sink", [(True, (-1, -1), True), (False, (20, 5), False)])
def test_atomic_dq_varlen_vs_fp64(causal, window, sink, device, launches):
    """Packed sequences of ragged lengths (one empty), GQA, padding rows outside cu_seqlens."""
    _skip_if_no_triton(device)
    lens_q, lens_k = [70, 0, 33, 100], [45, 12, 80, 100]
    hq, hk, dqk, dv = 4, 2, 48, 32
    pad = 5  # trailing rows outside every sequence: zero gradients
    tq, tk = sum(lens_q) + pad, sum(lens_k)
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, device=device).half().double()  # noqa: E731
    q, k, v = rnd(tq, hq, dqk).requires_grad_(), rnd(tk, hk, dqk).requires_grad_(), rnd(tk, hk, dv).requires_grad_()
    s = torch.randn(hq, dtype=torch.float64, device=device, requires_grad=True) if sink else None
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    wl, wr = _win(causal, window)
    f = lambda t: None if t is None else t.detach().half()  # noqa: E731
    fs = None if s is None else s.detach().float()
    out, lse = triton_attn.flash_attn_varlen_fwd_triton(f(q), f(k), f(v), cu_q, cu_k, max(lens_q), max(lens_k), fs,
                                                        0.3, wl, wr)
    refs, cq, ck = [], 0, 0
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            refs.append(attention_ref(q[cq:cq + nq][None], k[ck:ck + nk][None], v[ck:ck + nk][None], causal, window, s,
                                      0.3)[0])
        cq, ck = cq + nq, ck + nk
    ref = torch.cat(refs)
    dout = rnd(tq, hq, dv)
    ref.backward(dout[: ref.shape[0]])
    dq, dk, dv_, dsink = triton_attn.flash_attn_varlen_bwd_triton(
        f(dout), f(q), f(k), f(v), out, lse, cu_q, cu_k, max(lens_q), max(lens_k), fs, 0.3, wl, wr,
        deterministic=False, atomic_dq=True)
    assert launches == [True]
    assert snr_db(ref, out[: ref.shape[0]]) >= 40.0
    assert bool((dq[-pad:] == 0).all())
    for name, g, rg in (("dq", dq[:-pad], q.grad[:-pad]), ("dk", dk, k.grad), ("dv", dv_, v.grad)):
        assert snr_db(rg, g) >= 40.0, name
    if sink:
        assert snr_db(s.grad, dsink) >= 40.0


def test_atomic_dq_selection_rule(monkeypatch):
    """One function decides; deterministic=True and fp32 always refuse the atomic path, whatever else says."""
    from primus_turbo.triton.attention.flash_attn_bwd import use_atomic_dq

    name = "PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ"
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    monkeypatch.delenv(name, raising=False)
    assert not use_atomic_dq(False, bf16)  # auto: two kernels until measured
    assert use_atomic_dq(False, bf16, atomic_dq=True) and use_atomic_dq(False, fp16, atomic_dq=True)
    assert not use_atomic_dq(True, bf16, atomic_dq=True)
    assert not use_atomic_dq(False, fp32, atomic_dq=True)
    for value, want in (("1", True), ("0", False), ("auto", False)):
        monkeypatch.setenv(name, value)
        assert use_atomic_dq(False, bf16) is want
        assert use_atomic_dq(True, bf16) is False
        assert use_atomic_dq(False, fp32) is False
        assert use_atomic_dq(False, fp16, atomic_dq=not want) is (not want)
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(ValueError, match=name):
        use_atomic_dq(False, bf16)


def test_kernel_level_default_is_deterministic(device, launches, monkeypatch):
    """Callers of the kernel functions that do not say deterministic=False (FP8 fallback) stay two-kernel."""
    _skip_if_no_triton(device)
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ", "1")
    q = torch.randn(1, 40, 2, 16, device=device, dtype=torch.float16)
    k = torch.randn(1, 40, 2, 16, device=device, dtype=torch.float16)
    out, lse = triton_attn.flash_attn_fwd_triton(q, k, k, None, 0.25)
    dout = torch.randn_like(out)
    triton_attn.flash_attn_bwd_triton(dout, q, k, k, out, lse, None, 0.25)
    triton_attn.flash_attn_bwd_triton(dout, q, k, k, out, lse, None, 0.25, deterministic=False)
    triton_attn.flash_attn_bwd_triton(dout.float(), q.float(), k.float(), k.float(), out.float(), lse, None, 0.25,
                                      deterministic=False)  # fp32: two kernels
    assert launches == [False, True, False]


def test_fp32_inputs_take_the_small_fp32_tiles(monkeypatch):
    """On the GPU, fp32 inputs (exact products on the FMA pipe) take their own small tiles: the
    16-bit tiles made the first fp32 call compile for ~2 minutes at head dim 128. Every fp32 tile is
    at most the 16-bit one of its head dim."""
    pytest.importorskip("triton")
    from primus_turbo.triton.attention import flash_attn_bwd as B
    from primus_turbo.triton.attention import flash_attn_fwd as F

    monkeypatch.setattr(F, "is_interpreter", lambda: False)
    monkeypatch.setattr(B, "is_interpreter", lambda: False)
    for d in (64, 128, 256):
        assert F._fwd_config(d, torch.float32) == F.FP32_FWD_CONFIGS[d]
        assert F._fwd_config(d, torch.bfloat16) == F.FWD_CONFIGS[d]
        assert B._bwd_config(d, torch.float32) == B.FP32_BWD_CONFIGS[d]
        assert B._bwd_config(d, torch.float16) == B.BWD_CONFIGS[d]
        small, big = F.FP32_FWD_CONFIGS[d], F.FWD_CONFIGS[d]
        assert small[0] * small[1] <= big[0] * big[1]
        for s, b in zip(B.FP32_BWD_CONFIGS[d], B.BWD_CONFIGS[d]):
            assert s[0] * s[1] <= b[0] * b[1]
