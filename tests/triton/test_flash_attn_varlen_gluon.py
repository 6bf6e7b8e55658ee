"""The Gluon varlen (packed THD) attention forward (``flash_attn_varlen_fwd_gluon`` in
primus_turbo/triton/attention/flash_attn_fwd_gluon.py).

On CPU: the eligibility reasons, the TRITON backend's dispatch rule (``PRIMUS_TURBO_ATTN_VARLEN_GLUON``
auto by ``max_seqlen_q`` / on / off / invalid, reason check; kernels mocked), the kernel that writes
O = 0 / LSE = +inf on the rows no document owns (Triton interpreter), and the sm_90 compile of every
variant (head dim 64/128, causal or not, bf16/fp16, sink) and of the launcher's own arguments (GQA).
On an sm_90 GPU: O and LSE (poisoned with NaN before the call) against a per-document fp32
reference and the tl varlen forward for the document patterns of the H200 report, each document
alone giving its rows of the packed run bitwise, k / v rows past ``cu_seqlens_k[-1]`` holding NaN
and +Inf changing nothing (bitwise; documents shorter than the key block too: ``-k nan``), and the
tl varlen backward on the Gluon forward's O and LSE.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa  # noqa: E402
from tests.triton.gluon_attn_helpers import load_script, sm90  # noqa: E402
from tests.triton.gluon_compile_child import rerun_outside_interpreter, warmup_for_sm90  # noqa: E402

needs_gluon = pytest.mark.skipif(not fa.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
MIN_SNR = 40.0
PATTERNS = {"eq512": [512] * 4, "pow2": [128, 256, 512, 1024], "odd": [57, 311, 800, 173],
            "long-first": [2048, 64, 64, 64]}


def _script():
    return load_script("check_gluon_attn_varlen")


def _pack(lens, Hq, Hk, D, dtype=torch.bfloat16, device="cpu"):
    s = _script()
    q, k, v = s.make_pack(lens, lens, Hq, Hk, D, dtype, device)
    cu = s.cu_seqlens(lens, device)
    return q, k, v, cu


# ---------------------------------------------------------------------------------------------
# CPU: reasons, dispatch, the outside-rows fill, sm_90 compile
# ---------------------------------------------------------------------------------------------
@needs_gluon
@pytest.mark.parametrize("Hq,Hk,D", [(32, 8, 128), (8, 8, 64), (4, 1, 128)])
def test_operand_reason_accepts(Hq, Hk, D):
    q, k, v, cu = _pack([57, 311, 20], Hq, Hk, D)
    assert fa.gluon_attn_varlen_operand_reason(q, k, v, cu, cu, 311, 311, None, 0.1, -1, -1) is None
    assert fa.gluon_attn_varlen_operand_reason(q, k, v, cu, cu, 311, 311, torch.zeros(Hq), 0.1, -1, 0) is None
    # q, k, v slices of one packed qkv tensor (a row stride of 3 heads' worth)
    qkv = torch.randn(q.size(0), 3, Hq, D, dtype=q.dtype)
    if Hq == Hk:
        assert fa.gluon_attn_varlen_operand_reason(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 311, 311) is None


@needs_gluon
def test_operand_reason_refuses():
    q, k, v, cu = _pack([57, 311, 20], 4, 2, 128)
    cases = {
        "dtype": (q.float(), k.float(), v.float(), cu, cu, 311, 311),
        "head dims": (q[..., :96], k[..., :96], v[..., :96], cu, cu, 311, 311),
        "sliding window": (q, k, v, cu, cu, 311, 311, None, 0.1, 16, 0),
        "softmax_scale": (q, k, v, cu, cu, 311, 311, None, -0.1, -1, -1),
        "packed": (q[None], k[None], v[None], cu, cu, 311, 311),
        "int32": (q, k, v, cu.long(), cu, 311, 311),
        "unit stride": (q, k, v, torch.zeros(8, dtype=torch.int32)[::2], cu, 311, 311),
        "entries": (q, k, v, cu, cu[:-1], 311, 311),
        "documents": (q, k, v, torch.zeros(70000, dtype=torch.int32), torch.zeros(70000, dtype=torch.int32), 1, 1),
        "seq_kv = 0": (q, k[:0], v[:0], cu, torch.zeros_like(cu), 311, 0),
        "strides": (torch.empty(q.size(0), 4, 129, dtype=q.dtype)[..., :128], k, v, cu, cu, 311, 311),
    }
    for key, args in cases.items():
        reason = fa.gluon_attn_varlen_operand_reason(*args)
        assert reason is not None and key in reason, (key, reason)


@needs_gluon
def test_reason_on_cpu_names_the_device():
    q, k, v, cu = _pack([64, 64], 2, 2, 64)
    reason = fa.gluon_attn_varlen_fwd_reason(q, k, v, cu, cu, 64, 64, None, 0.125, -1, 0)
    assert reason is not None and "cpu" in reason and "sm_90" in reason, reason
    with pytest.raises(ValueError, match="flash_attn_varlen_fwd_gluon: .*cpu"):
        fa.flash_attn_varlen_fwd_gluon(q, k, v, cu, cu, 64, 64, None, 0.125, -1, 0)


def test_reason_never_raises():
    assert fa.gluon_attn_varlen_fwd_reason(None, None, None, None, None, 0, 0) is not None


def test_env_registered_and_documented():
    from pathlib import Path

    from primus_turbo.pytorch.core.env import ENV_VARS

    assert ENV_VARS[fa.GLUON_ATTN_VARLEN_ENV][0] == "auto"
    doc = (Path(__file__).resolve().parents[2] / "docs" / "env_vars.md").read_text()
    assert f"`{fa.GLUON_ATTN_VARLEN_ENV}` | `auto`" in doc


def test_use_rule(monkeypatch):
    """use_gluon_attn_varlen_fwd: auto (the default) for every pack at head dim 128 and from
    max_seqlen_q 2048 on at head dim 64 (full and causal); 1 always, 0 never."""
    monkeypatch.delenv(fa.GLUON_ATTN_VARLEN_ENV, raising=False)
    assert fa.VARLEN_AUTO_MIN_SEQLEN_Q == 2048
    assert not fa.use_gluon_attn_varlen_fwd(2047, -1, 64) and fa.use_gluon_attn_varlen_fwd(2048, -1, 64)
    assert fa.use_gluon_attn_varlen_fwd(16384, -1, 64) and not fa.use_gluon_attn_varlen_fwd(0, -1, 64)
    for d in (64, 128):
        assert fa.use_gluon_attn_varlen_fwd(2048, 0, d) and fa.use_gluon_attn_varlen_fwd(16384, -1, d)
    # head dim 128: every pack; head dim 64: from 2048 only
    assert fa.use_gluon_attn_varlen_fwd(512, 0, 128) and fa.use_gluon_attn_varlen_fwd(57, 5, 128)
    assert fa.use_gluon_attn_varlen_fwd(512, -1, 128) and fa.use_gluon_attn_varlen_fwd(1, -1, 128)
    assert not fa.use_gluon_attn_varlen_fwd(512, 0, 64) and not fa.use_gluon_attn_varlen_fwd(2047, -1, 64)
    for auto in ("auto", "AUTO", ""):
        monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, auto)
        assert not fa.use_gluon_attn_varlen_fwd(2047, -1, 64) and fa.use_gluon_attn_varlen_fwd(2048, -1, 64)
    for on in ("1", "on", "true"):
        monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, on)
        assert fa.use_gluon_attn_varlen_fwd(1, -1, 64) and fa.use_gluon_attn_varlen_fwd(2047, 0, 64)
    for off in ("0", "off", "false"):
        monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, off)
        assert not fa.use_gluon_attn_varlen_fwd(2048, -1, 64) and not fa.use_gluon_attn_varlen_fwd(16384, 0, 128)
    monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, "maybe")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_ATTN_VARLEN_GLUON"):
        fa.use_gluon_attn_varlen_fwd(2048, -1, 64)


def test_dispatch_rule(monkeypatch):
    """The TRITON backend's varlen forward runs the Gluon varlen kernel where the switch allows it
    for the call's max_seqlen_q (auto, the default: >= 2048; 1: always; 0: never) and the reason
    check passes, else the tl kernel. Recorded with both kernels and the reason mocked (no sm_90
    here), through AttnTritonBackend.execute; max_seqlen_q reaches the rule as the host int."""
    import primus_turbo.triton.attention as tl_attn
    from primus_turbo.pytorch.backends.attention import AttnTritonBackend

    calls = []
    reason = {"value": None}
    monkeypatch.setattr(fa, "gluon_attn_varlen_fwd_reason", lambda *a: reason["value"])
    monkeypatch.setattr(fa, "flash_attn_varlen_fwd_gluon", lambda *a: calls.append("gluon") or ("out", "lse"))
    monkeypatch.setattr(tl_attn, "flash_attn_varlen_fwd_triton", lambda *a: calls.append("tl") or ("out", "lse"))
    q = torch.empty(100, 4, 64, dtype=torch.bfloat16)  # head dim 64: the max_seqlen_q rule (128: every pack)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)

    def picked(max_seqlen_q=60):
        calls.clear()
        AttnTritonBackend.execute(q, q, q, 0.1, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen_q,
                                  max_seqlen_k=60)
        assert len(calls) == 1
        return calls[0]

    monkeypatch.delenv(fa.GLUON_ATTN_VARLEN_ENV, raising=False)  # default auto
    assert picked(2047) == "tl" and picked(2048) == "gluon" and picked(8192) == "gluon"
    q128 = torch.empty(100, 4, 128, dtype=torch.bfloat16)
    calls.clear()
    AttnTritonBackend.execute(q128, q128, q128, 0.1, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=60,
                              max_seqlen_k=60)
    assert calls == ["gluon"]  # head dim 128: every pack
    for auto in ("auto", ""):
        monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, auto)
        assert picked(2047) == "tl" and picked(2048) == "gluon"
    for on in ("1", "on", "true"):
        monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, on)
        assert picked(60) == "gluon" and picked(2047) == "gluon"
    reason["value"] = "the Gluon forward takes float16 and bfloat16"
    assert picked(2048) == "tl"  # refused by the reason check, 1 or auto
    monkeypatch.delenv(fa.GLUON_ATTN_VARLEN_ENV, raising=False)
    assert picked(2048) == "tl"
    reason["value"] = None
    for off in ("0", "off"):
        monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, off)
        assert picked(2048) == "tl" and picked(16384) == "tl"
    monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, "maybe")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_ATTN_VARLEN_GLUON"):
        picked()
    # the dense forward is not affected by the varlen switch
    from primus_turbo.pytorch.backends import attention as ab

    monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, "1")
    monkeypatch.setenv(fa.GLUON_ATTN_ENV, "0")
    assert ab._gluon_fwd(q[None], q[None], q[None], None, 0.1, -1, -1) is None


def test_dispatch_real_reason_on_cpu(monkeypatch):
    """With the switch at 1 (or auto and a long max_seqlen_q) on CPU the real reason check refuses
    (no sm_90): the tl kernel runs."""
    from primus_turbo.pytorch.backends import attention as ab

    q, k, v, cu = _pack([30, 34], 2, 2, 64)
    monkeypatch.setenv(fa.GLUON_ATTN_VARLEN_ENV, "1")
    assert ab._gluon_varlen_fwd(q, k, v, cu, cu, 34, 34, None, 0.125, -1, 0) is None
    monkeypatch.delenv(fa.GLUON_ATTN_VARLEN_ENV, raising=False)
    assert ab._gluon_varlen_fwd(q, k, v, cu, cu, 4096, 4096, None, 0.125, -1, 0) is None


@needs_gluon
@pytest.mark.parametrize("lens,extra,D", [([3, 10, 7], 5, 64), ([100, 0, 37], 200, 128), ([0], 70, 64), ([64, 64], 0, 64)])
def test_fill_outside_rows(lens, extra, D, device):
    """Rows past cu_seqlens[-1] (and before cu_seqlens[0]) get O = 0, LSE = +inf; the documents'
    rows are left as they were (the attention kernel writes them)."""
    H = 3
    T = sum(lens) + extra
    cu = _script().cu_seqlens(lens, device)
    out = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((H, T), float("nan"), device=device)
    fa._fill_outside(out, lse, cu)
    n = sum(lens)
    assert torch.isnan(out[:n]).all() and torch.isnan(lse[:, :n]).all()
    assert (out[n:] == 0).all() and (lse[:, n:] == float("inf")).all()
    # a document range that starts past row 0
    cu2 = cu + 5
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    fa._fill_outside(out, lse, cu2)
    inside = torch.zeros(T, dtype=torch.bool, device=device)
    inside[5:min(n + 5, T)] = True
    assert torch.isnan(out[inside]).all() and (out[~inside] == 0).all()
    assert torch.isnan(lse[:, inside]).all() and (lse[:, ~inside] == float("inf")).all()


@needs_gluon
@pytest.mark.parametrize("head_dim,causal,dtype,sink", [
    (64, False, "bf16", False), (64, True, "bf16", False), (64, False, "fp16", True), (64, True, "fp16", False),
    (128, False, "bf16", False), (128, True, "bf16", False), (128, False, "fp16", False), (128, True, "bf16", True),
])
def test_varlen_compiles_for_sm90_without_spills(head_dim, causal, dtype, sink, request):
    """Every varlen variant compiles for sm_90: wgmma in the SASS, no local memory, no serialized
    wgmma, the shared memory of the dense kernel's config; partial tiles' O stores vectorized."""
    if rerun_outside_interpreter(request):
        return
    try:
        res = _script().compile_attn_varlen(head_dim, causal, dtype, sink)
    except FileNotFoundError as exc:  # no bundled ptxas in this triton wheel
        pytest.skip(f"ptxas not available: {exc}")
    # the three-warpgroup default (head dim 64, full) runs at 160 registers a consumer thread, the
    # most three warpgroups and the producer's 24 leave; its varlen masks spill a few registers
    # (96 bytes, single values around the masked blocks, L1-resident) and it still ran 1.08x the
    # two-warpgroup config on the H200 (session 28). Everything else: no local memory at all.
    three = fa.default_attn_config(head_dim, causal, varlen=True).consumers == 3
    assert res["spill_bytes"] <= (128 if three else 0) and not res["serialized"], res
    assert res["shared"] <= fa.SMEM_LIMIT
    if res["hgmma"] is not None:  # cuobjdump bundled
        assert res["hgmma"] > 0 and (three or res["local_mem"] == 0), res


@needs_gluon
@pytest.mark.parametrize("Hq,Hk,D,causal,sink,config", [
    (32, 8, 128, True, False, None), (32, 8, 128, False, True, None), (8, 8, 64, True, False, None),
    (8, 2, 64, False, True, None), (8, 2, 64, False, False, "n128s3p"), (4, 1, 128, True, True, "n128s2o"),
])
def test_varlen_launcher_arguments_bind_and_compile_for_sm90(Hq, Hk, D, causal, sink, config, monkeypatch, request):
    """The launcher's own arguments (TMA descriptors over the packed [1, T, H, D] views, O, LSE,
    sink, cu_seqlens, strides, constexprs) bind and compile for sm_90 under a stand-in CUDA driver,
    GQA included; the grid is (query tiles of max_seqlen_q, heads, documents)."""
    if rerun_outside_interpreter(request):
        return
    lens = [57, 311, 800, 173]
    q, k, v, cu = _pack(lens, Hq, Hk, D)
    s = torch.zeros(Hq) if sink else None
    wr = 0 if causal else -1
    assert fa.gluon_attn_varlen_operand_reason(q, k, v, cu, cu, 800, 800, s, 0.1, -1, wr) is None
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(Hq, q.size(0))
    cfg = fa.GluonAttnConfig.parse(config) if config else fa.default_attn_config(D, causal, Hq // Hk, varlen=True)
    grid, args, kwargs = fa._varlen_kernel_args(q, k, v, out, lse, s, cu, cu, 800, 0.1, wr, cfg)
    tiles = -(-800 // cfg.BLOCK_M)
    assert grid == ((Hq, tiles, 4) if cfg.heads_fastest else (tiles, Hq, 4)), (grid, cfg.short())
    assert kwargs["HAS_RIGHT"] == causal and kwargs["HAS_SINK"] == sink and kwargs["HEADS_FASTEST"] == cfg.heads_fastest
    assert args[9] == Hq and args[10] == Hq // Hk  # H, GROUP
    kernel = warmup_for_sm90(fa._attn_fwd_varlen_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.shared <= fa.SMEM_LIMIT
    assert kernel.metadata.num_warps == 4 * cfg.consumers + 4


# ---------------------------------------------------------------------------------------------
# GPU (sm_90): numerics
# ---------------------------------------------------------------------------------------------
def _check(lens, Hq, Hk, D, causal, dtype=torch.bfloat16, sink=False, lens_k=None, extra=0, cfg=None):
    from primus_turbo.triton.attention.flash_attn_fwd import flash_attn_varlen_fwd_triton

    s_mod = _script()
    lens_k = lens_k or lens
    q, k, v = s_mod.make_pack(lens, lens_k, Hq, Hk, D, dtype, "cuda", extra)
    s = torch.randn(Hq, device="cuda") if sink else None
    scale, wr = D ** -0.5, (0 if causal else -1)
    cq, ck = s_mod.cu_seqlens(lens, "cuda"), s_mod.cu_seqlens(lens_k, "cuda")
    assert fa.gluon_attn_varlen_fwd_reason(q, k, v, cq, ck, max(lens), max(lens_k), s, scale, -1, wr) is None
    out, lse = s_mod.run_gluon(q, k, v, lens, lens_k, causal, scale, s, cfg=cfg)  # into NaN-poisoned O and LSE
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    n = sum(lens)
    ref_out, ref_lse = s_mod.reference(q, k, v, lens, lens_k, causal, scale, s)
    assert s_mod.snr_finite(ref_out, out[:n].float()) >= MIN_SNR
    assert s_mod.snr_finite(ref_lse, lse[:, :n]) >= MIN_SNR
    tl_out, tl_lse = flash_attn_varlen_fwd_triton(q, k, v, cq, ck, max(lens), max(lens_k), s, scale, -1, wr)
    assert s_mod.snr_finite(tl_out.float(), out.float()) >= MIN_SNR
    assert s_mod.snr_finite(tl_lse, lse) >= MIN_SNR
    if extra:
        assert (out[n:] == 0).all() and (lse[:, n:] == float("inf")).all()
    return q, k, v, s, out, lse


@sm90
@pytest.mark.parametrize("pattern", list(PATTERNS), ids=list(PATTERNS))
@pytest.mark.parametrize("Hq,Hk,D", [(32, 8, 128), (8, 8, 64)], ids=["h32x8d128", "h8x8d64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference_and_tl(pattern, Hq, Hk, D, causal):
    _check(PATTERNS[pattern], Hq, Hk, D, causal)


@sm90
@pytest.mark.parametrize("lens,lens_k,Hq,Hk,D,causal,dtype,sink,extra", [
    ([57, 311, 800, 173], None, 8, 2, 128, True, torch.bfloat16, True, 0),
    ([57, 311, 800, 173], None, 8, 8, 64, False, torch.float16, True, 0),
    ([300, 1100, 65, 700], [1100, 300, 129, 700], 8, 2, 128, True, torch.bfloat16, False, 0),  # empty causal rows
    ([200, 0, 333, 1], None, 8, 2, 128, True, torch.bfloat16, False, 0),  # an empty document
    ([100, 250], None, 8, 2, 128, True, torch.bfloat16, False, 77),  # rows no document owns
    ([2048] * 8, None, 32, 8, 128, True, torch.bfloat16, False, 0),  # the 16384-token pack
])
def test_more_cases(lens, lens_k, Hq, Hk, D, causal, dtype, sink, extra):
    _check(lens, Hq, Hk, D, causal, dtype, sink, lens_k, extra)


@sm90
@pytest.mark.parametrize("config", ["n128s3c3j", "n128s3c3jg", "n128s2jg", "n64s4c3j"])
@pytest.mark.parametrize("lens,Hq,Hk,D,causal,sink,extra", [
    ([57, 311, 800, 173], 8, 2, 64, True, False, 0),
    ([57, 311, 800, 173], 8, 2, 64, False, True, 0),
    ([300, 1100, 65, 700], 8, 2, 128, True, False, 0),
    ([200, 0, 333, 1], 8, 8, 64, True, True, 0),  # an empty document, a one-token one
    ([100, 250], 8, 2, 64, True, False, 77),  # rows no document owns
    ([2048] * 8, 16, 2, 64, True, False, 0),  # uniform documents: the last tile's upper warpgroup sees no row
    ([2048] * 8, 16, 2, 64, False, False, 0),
])
def test_skip_and_heads_fastest_configs(config, lens, Hq, Hk, D, causal, sink, extra):
    """Configs ``j`` (each warpgroup computes only the key blocks its rows see and releases the rest
    of the ring unread) and ``g`` (grid (heads, query tiles, documents)): the same checks as the
    default (fp32 reference, the tl kernel, poisoned outputs, rows no document owns)."""
    cfg = fa.GluonAttnConfig.parse(config)
    if cfg.check(D) is not None:
        pytest.skip(cfg.check(D))
    _check(lens, Hq, Hk, D, causal, torch.bfloat16, sink, None, extra, cfg=cfg)


@sm90
@pytest.mark.parametrize("pattern", ["odd", "long-first"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_documents_alone_match_bitwise(pattern, causal):
    """Each document run as its own one-document pack gives exactly its rows of the packed run: no
    document's tile reads another's keys unmasked or writes another's rows."""
    s_mod = _script()
    lens = PATTERNS[pattern]
    q, k, v = s_mod.make_pack(lens, lens, 32, 8, 128, torch.bfloat16, "cuda")
    scale = 128 ** -0.5
    out, lse = s_mod.run_gluon(q, k, v, lens, lens, causal, scale)
    start = 0
    for n in lens:
        o1, l1 = s_mod.run_gluon(q[start:start + n], k[start:start + n], v[start:start + n], [n], [n], causal, scale)
        diff = ((o1.float() - out[start:start + n].float()).abs().max().item(),
                (l1 - lse[:, start:start + n]).abs().max().item())
        assert torch.equal(o1, out[start:start + n]) and torch.equal(l1, lse[:, start:start + n]), (n, start, diff)
        start += n


def _nan_tail_check(lens, Hq, Hk, D, causal, extra):
    """k / v rows past cu_seqlens_k[-1] NaN / +Inf (the documents' own rows, and so each document's
    neighbours, finite): O and LSE equal, bitwise, those of the same pack with finite trailing rows,
    without NaN, right against the fp32 reference; each document alone gives its rows bitwise. The
    kernel loads a document's last key block shifted back to end at the document's end, so it never
    reads those rows (a block read past the end would multiply them by P = 0: NaN)."""
    s_mod = _script()
    q, k, v = s_mod.make_pack(lens, lens, Hq, Hk, D, torch.bfloat16, "cuda", extra)
    scale = D ** -0.5
    fin_out, fin_lse = (t.clone() for t in s_mod.run_gluon(q, k, v, lens, lens, causal, scale))
    n = sum(lens)
    s_mod.poison_tail(k, v, n)
    assert torch.isnan(k[n:]).any() and torch.isinf(v[n:]).any() and torch.isfinite(k[:n]).all()
    out, lse = s_mod.run_gluon(q, k, v, lens, lens, causal, scale)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out, fin_out) and torch.equal(lse, fin_lse), (
        (out.float() - fin_out.float()).abs().max().item())
    ref_out, ref_lse = s_mod.reference(q, k, v, lens, lens, causal, scale)
    assert s_mod.snr_finite(ref_out, out[:n].float()) >= MIN_SNR
    assert s_mod.snr_finite(ref_lse, lse[:, :n]) >= MIN_SNR
    assert (out[n:] == 0).all() and (lse[:, n:] == float("inf")).all()
    start = 0
    for m in lens:
        o1, l1 = s_mod.run_gluon(q[start:start + m], k[start:start + m], v[start:start + m], [m], [m], causal, scale)
        assert torch.equal(o1, out[start:start + m]) and torch.equal(l1, lse[:, start:start + m]), (m, start)
        start += m


@sm90
@pytest.mark.parametrize("pattern", ["odd", "pow2", "long-first"])
@pytest.mark.parametrize("Hq,Hk,D", [(32, 8, 128), (8, 8, 64)], ids=["h32x8d128", "h8x8d64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_trailing_kv_rows_ignored(pattern, Hq, Hk, D, causal):
    """(a) NaN / +Inf in the k / v rows past cu_seqlens_k[-1] (200 of them, past a last document
    that ends inside a key block) change nothing."""
    _nan_tail_check(PATTERNS[pattern], Hq, Hk, D, causal, 200)


@sm90
@pytest.mark.parametrize("lens", [[5, 70, 130, 1, 300], [1, 127, 129, 3]], ids=["5-70-130-1-300", "1-127-129-3"])
@pytest.mark.parametrize("Hq,Hk,D", [(32, 8, 128), (8, 8, 64)], ids=["h32x8d128", "h8x8d64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_trailing_rows_short_documents(lens, Hq, Hk, D, causal):
    """(b) Documents shorter than the key block (128): their one block is loaded shifted back over
    the previous documents' rows (or TMA's zeros before row 0), all masked; NaN / +Inf past
    cu_seqlens_k[-1] change nothing."""
    _nan_tail_check(lens, Hq, Hk, D, causal, 100)


@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_on_gluon_forward(causal):
    """flash_attn_varlen_func on TRITON with PRIMUS_TURBO_ATTN_VARLEN_GLUON=1: the tl varlen backward
    on the Gluon forward's O and LSE gives the gradients it gives on the tl forward's."""
    lens = [57, 311, 800, 173]
    s_mod = _script()
    q, k, v = s_mod.make_pack(lens, lens, 8, 2, 128, torch.bfloat16, "cuda")
    snrs = s_mod._grads_vs_tl_forward(q, k, v, None, lens, lens, causal, 128 ** -0.5, -1)
    assert len(snrs) == 4 and min(snrs) >= MIN_SNR, snrs


def test_check_script_dry_run_on_cpu(monkeypatch):
    """scripts/check_gluon_attn_varlen.py's correctness case end to end on CPU, the tl varlen kernel
    (Triton interpreter) standing in for the Gluon one: its reference, comparisons, per-document
    bitwise check, trailing rows, NaN / +Inf k / v rows past cu_seqlens_k[-1] and the backward through
    the op (a check of the script, not of the Gluon kernel)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through the tl kernel need the Triton interpreter; the GPU runs the real check")
    from primus_turbo.triton.attention.flash_attn_fwd import flash_attn_varlen_fwd_triton

    s_mod = _script()

    def stand_in(q, k, v, cq, ck, mq, mk, sink, scale, wl=-1, wr=-1, config=None, out=None, lse=None):
        o, l_ = flash_attn_varlen_fwd_triton(q, k, v, cq, ck, mq, mk, sink, scale, wl, wr)
        if out is None:
            return o, l_
        out.copy_(o)
        lse.copy_(l_)
        return out, lse

    monkeypatch.setattr(s_mod, "DEVICE", "cpu")
    monkeypatch.setattr(fa, "gluon_attn_varlen_fwd_reason", lambda *a: None)
    monkeypatch.setattr(fa, "flash_attn_varlen_fwd_gluon", stand_in)
    for spec in (["dry_causal_sink", [5, 17, 9], None, 2, 1, 64, True, "bf16", True, -1, 0],
                 ["dry_cross_trailing", [9, 3], [4, 12], 2, 2, 64, False, "fp16", False, 6, 7],
                 ["dry_nan_tail", [5, 17, 9], None, 2, 1, 64, True, "bf16", False, -1, 6, None, True]):
        res = s_mod.check_case(spec)
        assert res["ok"], res
        assert res.get("nan_tail_bitwise", True) and ("nan_tail_bitwise" in res) == (spec[0] == "dry_nan_tail")
    assert sum(s_mod.tile_pattern([57, 311, 800, 173])) == s_mod.TOKENS
    assert s_mod.tile_pattern([2048]) == [2048] * 8
