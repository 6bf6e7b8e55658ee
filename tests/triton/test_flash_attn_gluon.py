"""The Gluon attention forward (primus_turbo/triton/attention/flash_attn_fwd_gluon.py).

Gluon kernels do not run in the Triton interpreter, so on CPU this file checks the eligibility
reasons, the env switch, and that every shipped variant (head dim 64/128, causal or not,
bf16/fp16, sink) compiles for sm_90 without spills and with wgmma, also through the launcher's own
arguments, and that the opt-in ``o`` configs put the whole softmax between the S and PV waits. On an sm_90 GPU it runs the kernel (poisoned outputs) against an fp32 reference and
the ``triton.language`` forward, O and LSE, at shapes that are not block multiples, with GQA,
seq_q != seq_kv (empty causal rows), strided layouts, and through ``turbo.ops.flash_attn_func``'s
backward.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from primus_turbo.triton.attention.flash_attn_fp8 import _exp2_fma  # noqa: E402

from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa  # noqa: E402
from tests.triton.gluon_attn_helpers import load_script, qkv as _qkv, sm90, snr_finite as _snr_finite  # noqa: E402
from tests.triton.gluon_compile_child import rerun_outside_interpreter, warmup_for_sm90  # noqa: E402

needs_gluon = pytest.mark.skipif(not fa.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
MIN_SNR = 40.0


def _check_script():
    return load_script("check_gluon_attn")


# ---------------------------------------------------------------------------------------------
# CPU: reasons, env switch, sm_90 compile
# ---------------------------------------------------------------------------------------------
@needs_gluon
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("D,Hk", [(64, 4), (128, 2), (128, 1)])
def test_operand_reason_accepts(layout, D, Hk):
    q, k, v = _qkv(2, 100, 130, 4, Hk, D, layout=layout)
    assert fa.gluon_attn_operand_reason(q, k, v, None, 0.1, -1, -1) is None
    assert fa.gluon_attn_operand_reason(q, k, v, torch.zeros(4), 0.1, -1, 0) is None  # causal + sink
    assert fa.gluon_attn_operand_reason(q, k, v, None, 0.1, -1, 7) is None  # right window


@needs_gluon
def test_operand_reason_refuses():
    q, k, v = _qkv(2, 100, 130, 4, 2, 128)
    cases = {
        "dtype": (q.float(), k.float(), v.float(), None, 0.1, -1, -1),
        "head dims": (q[..., :96], k[..., :96], v[..., :96], None, 0.1, -1, -1),
        "head dims qk": (q, k, v[..., :64], None, 0.1, -1, -1),
        "sliding window": (q, k, v, None, 0.1, 16, 0),
        "softmax_scale": (q, k, v, None, -0.1, -1, -1),
        "seq_kv = 0": (q, k[:, :0], v[:, :0], None, 0.1, -1, -1),
        # rows of 129 bf16 elements: 258-byte strides, not 16-byte aligned
        "strides": (torch.empty(2, 100, 4, 129, dtype=q.dtype)[..., :128], k, v, None, 0.1, -1, -1),
    }
    for key, args in cases.items():
        reason = fa.gluon_attn_operand_reason(*args)
        assert reason is not None and key in reason, (key, reason)
    # a non-unit head-dim stride
    qt = torch.randn(2, 100, 128, 4, dtype=q.dtype).transpose(2, 3)
    assert "strides" in fa.gluon_attn_operand_reason(qt, k, v, None, 0.1, -1, -1)


@needs_gluon
def test_reason_on_cpu_names_the_device():
    q, k, v = _qkv(1, 64, 64, 2, 2, 64)
    reason = fa.gluon_attn_fwd_reason(q, k, v, None, 0.125, -1, 0)
    assert reason is not None and "cpu" in reason and "sm_90" in reason, reason
    with pytest.raises(ValueError, match="flash_attn_fwd_gluon: .*cpu"):
        fa.flash_attn_fwd_gluon(q, k, v, None, 0.125, -1, 0)


def test_reason_never_raises():
    assert fa.gluon_attn_fwd_reason(None, None, None) is not None


def test_size_one_dims_get_aligned_strides():
    # batch 1 / one head: torch may give those dims any stride; TMA never steps along them
    q = torch.randn(1, 3, 1, 64, dtype=torch.bfloat16)[:, :, :, :]
    q = q.as_strided(q.shape, (7, 64, 5, 1))
    strides = fa._tma_strides(q)
    assert strides is not None and strides[1] == 64 and strides[-1] == 1
    assert all((s * 2) % 16 == 0 for s in strides[:-1])


def test_env_switch(monkeypatch):
    """The TRITON backend's forward takes the Gluon kernel by the switch: auto where it was measured
    faster (head dim 128 except causal at <= 2048 queries; head dim 64 from 2048 queries), 1
    wherever it can run, 0 never. Recorded
    with the kernel and its reason mocked (no sm_90 here)."""
    from primus_turbo.pytorch.backends import attention as ab

    calls = []
    monkeypatch.setattr(fa, "gluon_attn_fwd_reason", lambda *a: None)
    monkeypatch.setattr(fa, "flash_attn_fwd_gluon", lambda q, *a: calls.append(q.shape) or ("out", "lse"))

    def picked(d, s, causal):
        q = torch.empty(1, s, 2, d)
        calls.clear()
        return ab._gluon_fwd(q, q, q, None, 1.0, -1, 0 if causal else -1) is not None and bool(calls)

    monkeypatch.delenv(fa.GLUON_ATTN_ENV, raising=False)
    assert picked(128, 4096, False) and picked(128, 4096, True) and picked(128, 2048, False)
    assert not picked(128, 2048, True) and not picked(64, 1024, True) and not picked(64, 1024, False)
    assert picked(64, 2048, False) and picked(64, 8192, True)  # head dim 64: from 2048 queries
    monkeypatch.setenv(fa.GLUON_ATTN_ENV, "1")
    assert picked(64, 2048, True) and picked(128, 2048, True)
    monkeypatch.setenv(fa.GLUON_ATTN_ENV, "0")
    assert not picked(128, 8192, False)
    monkeypatch.setenv(fa.GLUON_ATTN_ENV, "maybe")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_ATTN_FWD_GLUON"):
        picked(128, 4096, False)


def test_config_check():
    for d in fa.HEAD_DIMS:
        assert fa.default_attn_config(d).check(d) is None
    assert "shared memory" in fa.GluonAttnConfig(block_n=128, stages=4).check(128)
    assert fa.GluonAttnConfig.parse("n64s4r232w40") == fa.GluonAttnConfig(64, 4, 232, 40)
    assert fa.GluonAttnConfig.parse("n128s2p") == fa.GluonAttnConfig(128, 2, pingpong=True)
    assert fa.GluonAttnConfig.parse("n128s2o") == fa.GluonAttnConfig(128, 2, overlap=True)
    assert fa.GluonAttnConfig.parse("n64s3por232w40") == fa.GluonAttnConfig(64, 3, 232, 40, True, True)
    for text in ("n128s2", "n128s2p", "n128s2o", "n64s3po"):  # short() names parse back to the same config
        cfg = fa.GluonAttnConfig.parse(text)
        assert fa.GluonAttnConfig.parse(cfg.short()) == cfg
    assert not any(fa.default_attn_config(d).overlap for d in fa.HEAD_DIMS)  # opt-in, not yet timed
    for bad in ("m128", "n128s2op", "n128s2oo"):
        with pytest.raises(ValueError, match="bad Gluon attention config"):
            fa.GluonAttnConfig.parse(bad)
    assert "registers" in fa.GluonAttnConfig(consumer_regs=256, producer_regs=56).check(128)
    assert "block_n" in fa.GluonAttnConfig(block_n=96).check(128)


def test_config_three_consumer_warpgroups():
    """``c3``: three consumer warpgroups, 192-row tiles, 160 registers each by default."""
    cfg = fa.GluonAttnConfig.parse("n64s4c3")
    assert cfg == fa.GluonAttnConfig(64, 4, 160, 24, consumers=3)
    assert cfg.BLOCK_M == 192 and fa.GluonAttnConfig().BLOCK_M == 128
    assert cfg.check(64) is None and cfg.check(128) is None
    assert fa.GluonAttnConfig.parse(cfg.short()) == cfg
    assert fa.GluonAttnConfig.parse("n128s3c3r152w32").consumer_regs == 152
    assert "registers" in fa.GluonAttnConfig(consumer_regs=168, consumers=3).check(64)
    assert "ping-pong" in fa.GluonAttnConfig(consumer_regs=160, pingpong=True, consumers=3).check(64)
    assert "consumers" in fa.GluonAttnConfig(consumer_regs=120, consumers=4).check(64)
    # three warpgroups by default only at head dim 64 (measured faster there; causal with ``j``)
    assert [(d, c) for d in fa.HEAD_DIMS for c in (False, True) if fa.default_attn_config(d, c).consumers == 3] == [
        (64, False), (64, True)]
    assert fa._launch_kwargs(cfg, -1, None)["NUM_WG"] == 3


def test_config_exp2_on_the_fma_pipe():
    """``e<N>[d<deg>]``: 1/N of the unmasked blocks' exponentials by the FMA polynomial (opt-in)."""
    cfg = fa.GluonAttnConfig.parse("n128s3e4")
    assert (cfg.emu, cfg.emu_deg) == (4, 3) and cfg.check(64) is None
    assert fa.GluonAttnConfig.parse("n64s4c3e2d4") == fa.GluonAttnConfig(64, 4, 160, 24, consumers=3, emu=2,
                                                                          emu_deg=4)
    for text in ("n128s3e4", "n64s4c3e2d4", "n128s2e8d5r232w40"):
        assert fa.GluonAttnConfig.parse(fa.GluonAttnConfig.parse(text).short()) == fa.GluonAttnConfig.parse(text)
    assert "emu" in fa.GluonAttnConfig(emu=3).check(64)
    assert "emu" in fa.GluonAttnConfig(emu=2, emu_deg=6).check(64)
    kw = fa._launch_kwargs(fa.GluonAttnConfig.parse("n128s3e2d5"), 0, None)
    assert (kw["EMU"], kw["EMU_DEG"]) == (2, 5)
    assert all(fa.default_attn_config(d).emu == 0 for d in fa.HEAD_DIMS)  # opt-in


def test_config_conditional_rescale():
    """``z<T>``: the reference maximum moves only past T (log2 units); the O multiplies are skipped
    per warp where no row's moved (opt-in)."""
    cfg = fa.GluonAttnConfig.parse("n128s3c3z2")
    assert (cfg.lazy, cfg.consumers, cfg.consumer_regs) == (2, 3, 160) and cfg.check(64) is None
    assert fa.GluonAttnConfig.parse("n64s4oc3e2z3r152w32") == fa.GluonAttnConfig(
        64, 4, 152, 32, overlap=True, consumers=3, emu=2, lazy=3)
    for text in ("n128s3z2", "n128s3oz1", "n64s4c3e4d2z4"):
        assert fa.GluonAttnConfig.parse(fa.GluonAttnConfig.parse(text).short()) == fa.GluonAttnConfig.parse(text)
    assert "z5" in fa.GluonAttnConfig(lazy=5).check(64)


def test_default_config_skip_and_grid_order():
    """The defaults: ``j`` at head dim 64, and at head dim 128 in the varlen kernel only (the dense one
    keeps the plain config); the heads-fastest grid at head dim 64 only, from HEADS_FASTEST_MIN_GROUP
    query heads per kv head (GQA), never at head dim 128."""
    assert [(d, c) for d in fa.HEAD_DIMS for c in (False, True) if fa.default_attn_config(d, c).skip] == [
        (64, False), (64, True)]
    assert all(fa.default_attn_config(d, c, varlen=True).skip for d in fa.HEAD_DIMS for c in (False, True))
    assert fa.default_attn_config(128, True, varlen=True) == fa.GluonAttnConfig.parse("n128s2j")
    g = fa.HEADS_FASTEST_MIN_GROUP
    for d in fa.HEAD_DIMS:
        for c in (False, True):
            assert not fa.default_attn_config(d, c).heads_fastest
            assert not fa.default_attn_config(d, c, g - 1).heads_fastest
            assert fa.default_attn_config(d, c, g).heads_fastest == (d == 64)
            assert fa.default_attn_config(d, c, 8).check(d) is None


def test_default_grid_order_falls_back_past_the_y_limit():
    """The heads-fastest default puts the query tiles on the grid's y axis (at most 65535): a longer
    sequence takes the tiles-fastest grid; an explicit heads-fastest config there raises."""
    cfg = fa.default_attn_config(64, True, 8)
    assert cfg.heads_fastest and fa._fit_grid(cfg, 65535 * cfg.BLOCK_M) is cfg
    assert not fa._fit_grid(cfg, 65535 * cfg.BLOCK_M + 1).heads_fastest
    assert fa._fit_grid(fa.default_attn_config(64, True, 1), 10 ** 8) == fa.default_attn_config(64, True, 1)


def test_use_gluon_attn_fwd_rule(monkeypatch):
    """use_gluon_attn_fwd's auto rule: head dim 64 from 2048 queries (full and causal), head dim 128
    except causal at <= 2048 queries; 1 / 0 force it."""
    monkeypatch.delenv(fa.GLUON_ATTN_ENV, raising=False)

    def q(s, d):
        return torch.empty(1, s, 2, d)

    assert fa.use_gluon_attn_fwd(q(2048, 64), -1) and fa.use_gluon_attn_fwd(q(2048, 64), 0)
    assert not fa.use_gluon_attn_fwd(q(2047, 64), -1) and not fa.use_gluon_attn_fwd(q(1024, 64), 0)
    assert fa.use_gluon_attn_fwd(q(1024, 128), -1) and not fa.use_gluon_attn_fwd(q(2048, 128), 0)
    assert fa.use_gluon_attn_fwd(q(4096, 128), 0) and not fa.use_gluon_attn_fwd(q(4096, 96), -1)
    monkeypatch.setenv(fa.GLUON_ATTN_ENV, "1")
    assert fa.use_gluon_attn_fwd(q(16, 64), 0)
    monkeypatch.setenv(fa.GLUON_ATTN_ENV, "0")
    assert not fa.use_gluon_attn_fwd(q(4096, 128), -1)


def test_config_skip_and_heads_fastest_flags():
    """``j`` (per-warpgroup key extent) and ``g`` (heads-fastest grid): parse / short round trip, the
    grid the launcher builds, and ``j`` refused with ping-pong (whose turns need equal MMA counts)."""
    cfg = fa.GluonAttnConfig.parse("n128s3c3jg")
    assert cfg == fa.GluonAttnConfig(128, 3, 160, 24, consumers=3, skip=True, heads_fastest=True)
    assert fa.GluonAttnConfig.parse(cfg.short()) == cfg and cfg.check(64) is None
    assert fa.GluonAttnConfig.parse("n128s2z2j").skip and not fa.GluonAttnConfig.parse("n128s2z2j").heads_fastest
    assert "ping-pong" in fa.GluonAttnConfig(pingpong=True, skip=True).check(128)
    with pytest.raises(ValueError, match="bad Gluon attention config"):
        fa.GluonAttnConfig.parse("n128s2gj")  # the flags' order is fixed: j before g
    q, k, v = _qkv(2, 200, 200, 4, 2, 64)
    out, lse = torch.empty(2, 200, 4, 64, dtype=q.dtype), torch.empty(2, 4, 200)
    grid, _, kwargs = fa._kernel_args(q, k, v, out, lse, None, 0.1, 0, cfg)
    assert grid == (2 * 4, -(-200 // 192)) and kwargs["SKIP"] and kwargs["HEADS_FASTEST"]
    grid, _, kwargs = fa._kernel_args(q, k, v, out, lse, None, 0.1, 0, fa.GluonAttnConfig.parse("n128s3"))
    assert grid == (-(-200 // 128), 2 * 4) and not kwargs["SKIP"] and not kwargs["HEADS_FASTEST"]
    assert fa._launch_kwargs(fa.GluonAttnConfig.parse("n128s3z2"), 0, None)["LAZY"] == 2
    assert fa._launch_kwargs(fa.GluonAttnConfig.parse("n128s3"), 0, None)["LAZY"] == 0


@triton.jit
def _exp2_fma_kernel(x_ptr, y_ptr, n, DEG: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, _exp2_fma(tl.load(x_ptr + i, mask=i < n), DEG), mask=i < n)


def test_exp2_polynomial_accuracy():
    """The FMA-pipe exp2 the ``e<N>`` flag uses (shared with the FP8 forwards) against float64 over
    the softmax's range: the relative error of each degree stays under its stated bound, far below
    bf16's rounding of P (2**-8). Runs in the interpreter on CPU tensors, else on the GPU."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        pytest.skip("needs the Triton interpreter or a GPU")
    x = torch.linspace(-60.0, 0.0, 4099, dtype=torch.float32)
    x = torch.cat([x, torch.rand(1000, generator=torch.Generator().manual_seed(0)) * -30.0]).to(device)
    ref = torch.exp2(x.double())
    for deg, bound in ((2, 1.8e-3), (3, 8e-5), (4, 3e-6), (5, 3e-7)):
        y = torch.empty_like(x)
        _exp2_fma_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), DEG=deg, BLOCK=1024)
        rel = ((y.double() - ref).abs() / ref).max().item()
        assert rel < bound, (deg, rel)


@needs_gluon
@pytest.mark.parametrize("head_dim,causal,dtype,sink", [
    (64, False, "bf16", False), (64, True, "bf16", False), (64, False, "fp16", False), (64, True, "fp16", True),
    (128, False, "bf16", False), (128, True, "bf16", False), (128, False, "fp16", True), (128, True, "fp16", False),
])
def test_compiles_for_sm90_without_spills(head_dim, causal, dtype, sink, request):
    """Every shipped variant compiles for sm_90: wgmma in the SASS, no local memory, no serialized wgmma."""
    if rerun_outside_interpreter(request):
        return
    try:
        res = _check_script().compile_attn(head_dim, causal, dtype, sink)
    except FileNotFoundError as exc:  # no bundled ptxas in this triton wheel
        pytest.skip(f"ptxas not available: {exc}")
    assert res["spill_bytes"] == 0 and not res["serialized"], res
    if res["hgmma"] is not None:  # cuobjdump bundled
        assert res["hgmma"] > 0 and res["local_mem"] == 0, res
    assert res["shared"] <= fa.SMEM_LIMIT


@needs_gluon
@pytest.mark.parametrize("head_dim,causal,config", [
    (64, False, "n128s3o"), (64, True, "n128s3o"), (128, False, "n128s2o"), (128, True, "n128s2o"),
    (64, True, "n64s3o"), (128, True, "n128s2po"), (64, False, "n128s3po"),
])
def test_overlap_config_keeps_softmax_under_pv_mma(head_dim, causal, config, request):
    """Config suffix ``o``: every loop's S wait (``gsb0, 0x1``) is followed by the whole softmax (the
    block's 64 x BLOCK_N / 128 exponentials per thread plus the two alphas) before the PV wait
    (``gsb0, 0x0``); without it ptxas hoists the PV wait above the exponentials. Compiles for sm_90
    without spills, serialized wgmma, or more registers than setmaxnreg gives the consumers."""
    if rerun_outside_interpreter(request):
        return
    cfg = fa.GluonAttnConfig.parse(config)
    assert cfg.overlap and cfg.check(head_dim) is None
    try:
        res = _check_script().compile_attn(head_dim, causal, "bf16", False, cfg=cfg)
    except FileNotFoundError as exc:  # no bundled ptxas in this triton wheel
        pytest.skip(f"ptxas not available: {exc}")
    assert res["spill_bytes"] == 0 and not res["serialized"], res
    assert res["shared"] <= fa.SMEM_LIMIT
    if res["hgmma"] is None:
        pytest.skip("no bundled cuobjdump: the SASS cannot be checked")
    assert res["hgmma"] > 0 and res["local_mem"] == 0, res
    assert res["max_reg"] <= cfg.consumer_regs, res
    # two consumer warpgroups x (the full-block loop, the masked loop)
    assert len(res["ex2_under_pv"]) == 4 and min(res["ex2_under_pv"]) >= res["softmax_ex2"], res


@needs_gluon
@pytest.mark.parametrize("layout,causal,sink,D,config", [("bshd", True, True, 128, None), ("sbhd", False, False, 64, None),
                                                         ("bhsd", True, False, 128, "n128s2p"),
                                                         ("bshd", False, True, 64, "n128s3po")])
def test_launcher_arguments_bind_and_compile_for_sm90(layout, causal, sink, D, config, monkeypatch, request):
    """The launcher's own arguments (4-D host TMA descriptors of strided views, LSE, sink, sizes,
    constexprs) bind and compile for sm_90 under a stand-in CUDA driver."""
    if rerun_outside_interpreter(request):
        return
    B, Sq, Sk, Hq, Hk = 2, 200, 300, 4, 2
    q, k, v = _qkv(B, Sq, Sk, Hq, Hk, D, layout=layout)
    assert fa.gluon_attn_operand_reason(q, k, v, None, 0.1, -1, 0 if causal else -1) is None
    out = torch.empty(B, Sq, Hq, D, dtype=q.dtype)
    lse = torch.empty(B, Hq, Sq)
    cfg = fa.GluonAttnConfig.parse(config) if config else fa.default_attn_config(D, causal)
    grid, args, kwargs = fa._kernel_args(q, k, v, out, lse, torch.zeros(Hq) if sink else None, 0.1,
                                         0 if causal else -1, cfg)
    assert grid == (-(-Sq // cfg.BLOCK_M), B * Hq) and kwargs["PINGPONG"] == cfg.pingpong
    assert kwargs["OVERLAP"] == cfg.overlap and kwargs["NUM_WG"] == cfg.consumers
    kernel = warmup_for_sm90(fa._attn_fwd_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.shared <= fa.SMEM_LIMIT
    # 4 warps a consumer warpgroup, 1 producer warp, rounded up to whole warpgroups
    assert kernel.metadata.num_warps == 4 * cfg.consumers + 4


# ---------------------------------------------------------------------------------------------
# GPU (sm_90): numerics
# ---------------------------------------------------------------------------------------------
@sm90
@pytest.mark.parametrize("B,Sq,Sk,Hq,Hk,D,causal,dtype,sink,layout", [
    (2, 1000, 1000, 4, 2, 128, False, torch.bfloat16, False, "bshd"),
    (2, 1000, 1000, 4, 2, 128, True, torch.bfloat16, False, "bshd"),
    (2, 1000, 1000, 4, 4, 64, False, torch.float16, False, "bshd"),
    (2, 1000, 1000, 4, 1, 64, True, torch.bfloat16, True, "bshd"),
    (1, 777, 777, 8, 2, 128, True, torch.float16, True, "sbhd"),
    (2, 300, 1100, 4, 2, 128, True, torch.bfloat16, False, "bhsd"),
    (2, 1100, 300, 4, 2, 64, True, torch.bfloat16, False, "bshd"),  # empty causal rows: O = 0, LSE = +inf
    (1, 1, 5, 2, 1, 128, False, torch.bfloat16, False, "bshd"),
    (2, 65, 129, 2, 2, 128, True, torch.bfloat16, False, "bshd"),
])
@pytest.mark.parametrize("config", [None, "n128s2p", "n128s2o", "n128s2po", "n64s3c3z2", "n128s2oz1", "n128s3c3j",
                                    "n128s2jg", "n128s3c3jg", "n64s4c3j"])
def test_matches_reference_and_triton(B, Sq, Sk, Hq, Hk, D, causal, dtype, sink, layout, config):
    from primus_turbo.testing import attention_ref
    from primus_turbo.triton.attention.flash_attn_fwd import flash_attn_fwd_triton

    q, k, v = _qkv(B, Sq, Sk, Hq, Hk, D, dtype, layout, "cuda")
    s = torch.randn(Hq, device="cuda") if sink else None
    scale, wr = D ** -0.5, (0 if causal else -1)
    assert fa.gluon_attn_fwd_reason(q, k, v, s, scale, -1, wr) is None
    out = torch.full((B, Sq, Hq, D), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((B, Hq, Sq), float("nan"), device="cuda")
    cfg = fa.GluonAttnConfig.parse(config) if config else None  # p: the ping-pong schedule, o: the overlap wait
    if cfg is not None and cfg.check(D) is not None:
        pytest.skip(f"{config} at head dim {D}: {cfg.check(D)}")
    out, lse = fa.flash_attn_fwd_gluon(q, k, v, s, scale, -1, wr, config=cfg, out=out, lse=lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, sink=s, softmax_scale=scale, return_lse=True,
                                     compute_dtype=torch.float32)
    tl_out, tl_lse = flash_attn_fwd_triton(q, k, v, s, scale, -1, wr)
    assert _snr_finite(ref_out.float(), out.float()) >= MIN_SNR
    assert _snr_finite(ref_lse.float(), lse) >= MIN_SNR
    assert _snr_finite(tl_out.float(), out.float()) >= MIN_SNR
    assert _snr_finite(tl_lse, lse) >= MIN_SNR


@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_backward_on_gluon_forward(causal, monkeypatch):
    """flash_attn_func on TRITON with the Gluon forward: the tl backward on its O and LSE gives the
    gradients it gives with the tl forward."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.testing import snr_db

    q0, k0, v0 = _qkv(2, 700, 700, 4, 2, 128, torch.bfloat16, "bshd", "cuda")
    dout = torch.randn_like(q0)
    grads = {}
    GlobalBackendManager.set_attn_backend("TRITON")
    try:
        for flag in ("0", "1"):
            monkeypatch.setenv(fa.GLUON_ATTN_ENV, flag)
            q, k, v = (t.detach().clone().requires_grad_() for t in (q0, k0, v0))
            out = turbo.ops.flash_attn_func(q, k, v, causal=causal, deterministic=True)
            out.backward(dout)
            grads[flag] = (out.detach(), q.grad, k.grad, v.grad)
    finally:
        GlobalBackendManager.set_attn_backend(None)
    for a, b in zip(grads["0"], grads["1"]):
        assert snr_db(a.double().cpu(), b.double().cpu()) >= MIN_SNR
