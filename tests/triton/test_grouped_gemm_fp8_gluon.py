"""The Gluon M-grouped BLOCKWISE FP8 GEMM (primus_turbo/triton/grouped_gemm/grouped_gemm_fp8_gluon.py).

On CPU: the eligibility reasons (also for the operands ``turbo.ops.grouped_gemm_fp8`` builds for
its forward and dgrad), the backend's opt-in default rule with a mocked platform, and that the
kernel compiles for sm_90 without spills or serialized wgmmas, also through the launcher's own
arguments. On an sm_90 GPU: against the fp32 product of the dequantized operands and the
``triton.language`` grouped kernel, with balanced, unbalanced, empty and partial-tile groups, rows
past ``group_offs[G]`` (zero), M / N / K tails, every output dtype, several configs, the backend
and the op.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.gemm import gemm_fp8_gluon as dense  # noqa: E402
from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_gluon as gg  # noqa: E402
from tests.triton.gluon_compile_child import rerun_outside_interpreter, warmup_for_sm90  # noqa: E402
from tests.triton.gluon_gemm_helpers import (  # noqa: E402
    assert_pinned_gluon_raises_on_cpu, assert_refused_on_cpu, compile_report, fake_platform, needs_gluon, sm90,
)
from tests.triton.gluon_gemm_helpers import offsets as _offsets  # noqa: E402
from tests.triton.gluon_gemm_helpers import snr as _snr  # noqa: E402

E4M3 = torch.float8_e4m3fn
MIN_SNR = {torch.bfloat16: 40.0, torch.float16: 45.0, torch.float32: 55.0}


def _quant_1x128(x: torch.Tensor):
    M, K = x.shape
    kb = math.ceil(K / 128)
    g = torch.nn.functional.pad(x.float(), (0, kb * 128 - K)).view(M, kb, 128)
    scale = 448.0 / g.abs().amax(-1).clamp(min=1e-12)
    q = (g * scale[..., None]).clamp(-448, 448).to(E4M3).view(M, kb * 128)[:, :K].contiguous()
    return q, (1.0 / scale).contiguous()


def _quant_128x128(w: torch.Tensor):
    """w [G, N, K] -> (q [G, N, K], scale_inv [G, ceil(N/128), ceil(K/128)])."""
    G, N, K = w.shape
    nb, kb = math.ceil(N / 128), math.ceil(K / 128)
    g = torch.nn.functional.pad(w.float(), (0, kb * 128 - K, 0, nb * 128 - N)).view(G, nb, 128, kb, 128)
    scale = 448.0 / g.abs().amax(dim=(2, 4)).clamp(min=1e-12)
    q = (g * scale[:, :, None, :, None]).clamp(-448, 448).to(E4M3).view(G, nb * 128, kb * 128)[:, :N, :K]
    return q.contiguous(), (1.0 / scale).contiguous()


def _operands(lens, N, K, device, extra_rows=0):
    """a [sum(lens) + extra_rows, K] (the extra rows lie past offs[G]), b [G, N, K], and the
    float64 reference of the dequantized operands (rows past offs[G]: zero)."""
    G = len(lens)
    M = sum(lens) + extra_rows
    a_q, sa = _quant_1x128(torch.randn(M, K, device=device) * 2)
    b_q, sb = _quant_128x128(torch.randn(G, N, K, device=device) * 0.05)
    offs = _offsets(lens, device)
    a_d = a_q.double() * sa.double().repeat_interleave(128, 1)[:, :K]
    b_d = b_q.double() * sb.double().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N, :K]
    ref = torch.zeros(M, N, dtype=torch.float64, device=device)
    start = 0
    for g, n in enumerate(lens):
        ref[start:start + n] = a_d[start:start + n] @ b_d[g].T
        start += n
    return (a_q, sa, b_q, sb, offs), ref


# ---------------------------------------------------------------------------------------------
# CPU: reasons
# ---------------------------------------------------------------------------------------------
def test_reason_on_cpu_tensors():
    operands, _ = _operands([64, 0, 100], 256, 256, "cpu")
    assert_refused_on_cpu(gg.gluon_grouped_blockwise_reason, gg.gluon_grouped_operand_reason,
                          gg.grouped_gemm_fp8_blockwise_gluon, operands)


@needs_gluon
def test_operand_reasons():
    (a_q, sa, b_q, sb, offs), _ = _operands([64, 0, 100], 256, 256, "cpu")
    base = dict(a=a_q, sa=sa, b=b_q, sb=sb, group_offs=offs)
    G = b_q.shape[0]
    wide = torch.empty(G, 256, 512, dtype=E4M3)[:, :, :256]  # K-contiguous, rows 512 apart: fine
    gapped = torch.empty(G, 320, 256, dtype=E4M3)[:, :256]   # experts 320 rows apart: no [G*N, K] view
    cases = [
        (dict(a=a_q.to(torch.float8_e5m2)), "float8_e4m3fn only"),
        (dict(b=b_q.to(torch.float8_e5m2)), "float8_e4m3fn only"),
        (dict(sb=sb[:, :1]), "[G, ceil(N/128), ceil(K/128)]"),
        (dict(sa=sa[:, :1]), "[M_total, ceil(K/128)]"),
        (dict(group_offs=offs.to(torch.int32)), "int64 [G+1]"),
        (dict(group_offs=offs[:-1]), "int64 [G+1]"),
        (dict(b=b_q[:, :, :128]), "K mismatch"),
        (dict(a=a_q.t().contiguous().t()), "K-contiguous"),
        (dict(b=b_q.transpose(1, 2).contiguous().transpose(1, 2)), "K-contiguous"),
        (dict(b=gapped), "stacked row after row"),
        (dict(b=b_q[0]), "[G, N, K]"),
    ]
    for over, match in cases:
        kw = {**base, **over}
        reason = gg.gluon_grouped_operand_reason(kw["a"], kw["sa"], kw["b"], kw["sb"], kw["group_offs"])
        assert reason is not None and match in reason, (over.keys(), reason)
    assert gg.gluon_grouped_operand_reason(a_q, sa, wide, sb, offs) is None
    assert "block_size" in gg.gluon_grouped_operand_reason(a_q, sa, b_q, sb, offs, block_size=64)
    # N = 196 bf16: rows of 392 bytes (fp32: 784, aligned)
    (a2, sa2, b2, sb2, o2), _ = _operands([8, 8], 196, 128, "cpu")
    assert "16-byte" in gg.gluon_grouped_operand_reason(a2, sa2, b2, sb2, o2)
    assert gg.gluon_grouped_operand_reason(a2, sa2, b2, sb2, o2, out_dtype=torch.float32) is None
    # group_offs may be left to the caller (the backend derives it from group_lens)
    assert gg.gluon_grouped_operand_reason(a_q, sa, b_q, sb, None) is None


@needs_gluon
@pytest.mark.parametrize("trans_b", [True, False])
def test_op_forward_and_dgrad_operands_are_gluon_shaped(trans_b):
    """The operands grouped_gemm_fp8 BLOCKWISE builds (forward: a 1x128 x the [G, N, K] weight
    copy; dgrad: dY 1x128 x the [G, K, N] copy it keeps anyway) pass the operand checks with
    E4M3; the HYBRID dgrad (E5M2 dY) does not."""
    # the module, not the function that turbo.ops re-exports under the same name
    op = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")

    G, N, K, M = 3, 256, 384, 96
    b = torch.randn((G, N, K) if trans_b else (G, K, N)) / 16
    fwd, dgr = op._weight_copies(b, trans_b, E4M3, "BLOCKWISE", 128, True, True)
    a_q, sa = op._quant_rows(torch.randn(M, K), E4M3, "BLOCKWISE", 128)
    offs = _offsets([32, 0, 64], "cpu")
    assert tuple(fwd[0].shape) == (G, N, K) and tuple(dgr[0].shape) == (G, K, N)
    assert gg.gluon_grouped_operand_reason(a_q, sa, fwd[0], fwd[1], offs) is None
    for dtype, ok in ((E4M3, True), (torch.float8_e5m2, False)):
        dy_q, dy_s = op._quant_rows(torch.randn(M, N), dtype, "BLOCKWISE", 128)
        reason = gg.gluon_grouped_operand_reason(dy_q, dy_s, dgr[0], dgr[1], offs)
        assert (reason is None) == ok, reason


# ---------------------------------------------------------------------------------------------
# CPU: the backend and its opt-in default rule
# ---------------------------------------------------------------------------------------------
def _dispatch_kw(device, lens=(64, 0, 100), N=256, K=256):
    (a_q, sa, b_q, sb, offs), ref = _operands(list(lens), N, K, device)
    return dict(a_q=a_q, a_scale=sa, b_q=b_q, b_scale=sb, mode="BLOCKWISE", group_lens=None, group_offs=offs,
                out_dtype=torch.bfloat16, block_size=128, num_cu=None), ref


@pytest.fixture
def fake_sm90(monkeypatch):
    return fake_platform(monkeypatch, gg)


@needs_gluon
def test_default_rule(fake_sm90, monkeypatch):
    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType, PrecisionType

    d = be.grouped_gemm_fp8_dispatcher
    assert d.backends[BackendType.GLUON] is be.GroupedGemmFP8GluonBackend
    assert be.GroupedGemmFP8GluonBackend.autotune is False
    kw, _ = _dispatch_kw("cpu")
    assert be.GroupedGemmFP8GluonBackend.why_not(**kw) is None  # the mocked platform says sm_90
    # on by default (auto) since its H200 measurement; 0 turns it off
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON", "0")
    assert be._default_mgrouped(**kw) == BackendType.TRITON
    for value in (None, "auto", "1"):
        if value is None:
            monkeypatch.delenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON", raising=False)
        else:
            monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON", value)
        assert be._default_mgrouped(**kw) == BackendType.GLUON, value
    assert d.resolve(PrecisionType.FP8, **kw) is be.GroupedGemmFP8GluonBackend
    # group_lens instead of group_offs
    lens = kw["group_offs"].diff()
    assert be._default_mgrouped(**dict(kw, group_offs=None, group_lens=lens)) == BackendType.GLUON
    refused = [dict(a_q=kw["a_q"].to(torch.float8_e5m2)), dict(mode="ROWWISE"), dict(block_size=64),
               dict(num_cu=0), dict(group_offs=None, group_lens=lens.to(torch.int32))]
    for over in refused:
        assert be._default_mgrouped(**dict(kw, **over)) != BackendType.GLUON, over.keys()
    fake_sm90["reason"] = "the Gluon kernel is built for sm_90 (H100/H200), this GPU is sm_80"
    assert be._default_mgrouped(**kw) == BackendType.TRITON
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON", "maybe")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON"):
        be.gluon_grouped_enabled()


def test_pin_on_cpu_raises(device):
    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as be

    kw, _ = _dispatch_kw(device)
    assert_pinned_gluon_raises_on_cpu(be.grouped_gemm_fp8_dispatcher, kw)


# ---------------------------------------------------------------------------------------------
# CPU: sm_90 compile
# ---------------------------------------------------------------------------------------------
@needs_gluon
@pytest.mark.parametrize("out_dtype,config", [("bf16", None), ("fp32", None), ("bf16", "n128s5x"),
                                              ("bf16", "n256s4"), ("fp16", "n128s5")])
def test_compiles_for_sm90_without_spills(out_dtype, config, request):
    if rerun_outside_interpreter(request):
        return
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[out_dtype]
    cfg = dense.GluonBlockwiseConfig.parse(config) if config else gg.grouped_default_config(1, 1, 1, 1, torch_dtype)
    assert cfg.check(torch_dtype.itemsize) is None
    compile_report(cfg, out_dtype, grouped=True)


@needs_gluon
@pytest.mark.parametrize("config,out_dtype", [("n256s3c2", torch.bfloat16), ("n128s5x", torch.float32)])
def test_launcher_arguments_bind_and_compile_for_sm90(config, out_dtype, monkeypatch, request):
    """The launcher's own arguments (host TMA descriptors incl. the [G*N, K] expert view, the
    output pointer, scales, offsets, strides) bind and compile for sm_90 with a stand-in driver."""
    if rerun_outside_interpreter(request):
        return
    (a_q, sa, b_q, sb, offs), _ = _operands([100, 0, 200], 384, 640, "cpu", extra_rows=20)
    out = torch.empty(a_q.shape[0], 384, dtype=out_dtype)
    cfg = dense.GluonBlockwiseConfig.parse(config)
    assert cfg.check(out_dtype.itemsize) is None
    args, kwargs = gg._kernel_args(a_q, sa, b_q, sb, offs, out, cfg)
    kernel = warmup_for_sm90(gg._grouped_gemm_fp8_blockwise_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.shared <= dense.SMEM_LIMIT
    assert kernel.metadata.num_warps == 12


# ---------------------------------------------------------------------------------------------
# GPU: correctness
# ---------------------------------------------------------------------------------------------
# group sizes: balanced whole tiles; unbalanced with an empty group and partial tiles (rows not
# multiples of 64 or 128, a group smaller than one warpgroup half); a single group; many tiny groups
LENS = {
    "balanced": [256, 256, 256, 256],
    "unbalanced": [300, 0, 1, 64, 129, 500],
    "single": [333],
    "tiny": [1, 2, 3, 0, 5, 70, 0, 9],
}


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, "n128s5x", "n256s4", "n128s3g1c2"])
@pytest.mark.parametrize("pattern", list(LENS))
@pytest.mark.parametrize("N,K", [(256, 512), (384, 336), (136, 128)])
def test_matches_reference_and_tl(pattern, N, K, config):
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_triton

    (a_q, sa, b_q, sb, offs), ref = _operands(LENS[pattern], N, K, "cuda", extra_rows=37)
    assert gg.gluon_grouped_blockwise_reason(a_q, sa, b_q, sb, offs) is None
    M = a_q.shape[0]
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    cfg = dense.GluonBlockwiseConfig.parse(config) if config else None
    res = gg.grouped_gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, offs, config=cfg, out=out)
    assert res is out
    assert not torch.isnan(out).any(), "unwritten output elements"
    end = int(offs[-1])
    assert torch.all(out[end:] == 0), "rows past group_offs[G] must be zero"
    assert _snr(ref, out) >= MIN_SNR[torch.bfloat16], (pattern, N, K, config)
    tl_out = grouped_gemm_fp8_triton(a_q, sa, b_q, sb, "BLOCKWISE", None, offs, out_dtype=torch.bfloat16)
    assert _snr(tl_out.float(), out) >= 40.0


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_out_dtypes_num_programs_and_non_contiguous_scales(out_dtype):
    (a_q, sa, b_q, sb, offs), ref = _operands([200, 0, 384, 77], 512, 1024, "cuda", extra_rows=5)
    out = gg.grouped_gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, offs, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert _snr(ref, out) >= MIN_SNR[out_dtype]
    few = gg.grouped_gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, offs, out_dtype=out_dtype, num_programs=3)
    assert torch.equal(few, out)
    sb_t = sb.transpose(1, 2).contiguous().transpose(1, 2)  # the op's dgrad copy's scales are a view
    again = gg.grouped_gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb_t, offs, out_dtype=out_dtype)
    assert torch.equal(again, out)


@sm90
@pytest.mark.gpu
def test_offsets_past_m_are_clamped():
    (a_q, sa, b_q, sb, offs), ref = _operands([64, 64], 256, 256, "cuda")
    bad = offs.clone()
    bad[-1] = 10_000  # past M_total: clamped on the device, as the tl kernel does
    out = gg.grouped_gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, bad)
    assert _snr(ref, out) >= 40.0


@sm90
@pytest.mark.gpu
def test_backend_and_op_with_the_switch(monkeypatch):
    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType, PrecisionType

    kw, ref = _dispatch_kw("cuda", lens=(300, 0, 129))
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON", "1")
    assert be.grouped_gemm_fp8_dispatcher.resolve(PrecisionType.FP8, **kw).backend_type == BackendType.GLUON
    out = be.grouped_gemm_fp8_dispatcher.dispatch(PrecisionType.FP8, **kw)
    assert _snr(ref[:429], out[:429]) >= 40.0
    # the op: forward and dgrad on GLUON, wgrad on TRITON; against the switch off
    _op_with_switch_on_and_off(monkeypatch, "PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON", "BLOCKWISE")


def _op_with_switch_on_and_off(monkeypatch, switch: str, granularity: str) -> dict:
    """grouped_gemm_fp8 forward and backward (an empty group, rows past the last offset) with the
    environment switch ``switch`` at 0 and 1: the two agree (>= 40 dB). Returns {value: (y, dx, dw)}."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    G, N, K, M = 4, 512, 768, 1000
    lens = torch.tensor([300, 0, 450, 200], dtype=torch.int64, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(G, N, K, device="cuda") / 32).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    cfg = Float8QuantConfig(format="E4M3", granularity=granularity)
    results = {}
    for value in ("0", "1"):
        monkeypatch.setenv(switch, value)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = turbo.ops.grouped_gemm_fp8(xi, wi, lens, trans_b=True, config=cfg)
        y.backward(dy)
        results[value] = (y.detach(), xi.grad, wi.grad)
    for a, b in zip(results["0"], results["1"]):
        assert _snr(a.float(), b) >= 40.0
    return results


# ---------------------------------------------------------------------------------------------
# TENSORWISE / ROWWISE on the BLOCKWISE kernel (broadcast scales, per-column weight scales)
# ---------------------------------------------------------------------------------------------
def _scale_forms(M, G, N, device):
    """{name: (a_scale, b_scale)} of every form the scaled path takes (fresh positive values)."""
    r = lambda *s: torch.rand(*s, device=device) * 0.02 + 0.001  # noqa: E731
    return {
        "tensorwise": (r(()), r(())),
        "tensorwise_1": (r(1), r(1)),
        "per_expert": (r(()), r(G)),
        "rowwise": (r(M), r(G, N)),
        "rowwise_keepdim": (r(M, 1), r(G, N, 1)),
    }


def _scaled_operands(lens, N, K, device, extra_rows=0):
    G = len(lens)
    M = sum(lens) + extra_rows
    a_q = (torch.randn(M, K, device=device) * 60).clamp(-448, 448).to(E4M3)
    b_q = (torch.randn(G, N, K, device=device) * 60).clamp(-448, 448).to(E4M3)
    return a_q, b_q, _offsets(lens, device)


def _scaled_ref(a_q, a_scale, b_q, b_scale, lens):
    """float64 (a_q * a_scale) @ (b_q[g] * b_scale[g]).T per group; rows past the groups zero."""
    M, K = a_q.shape
    G, N, _ = b_q.shape
    a_d = a_q.double() * a_scale.double().reshape(-1, 1)
    bs = b_scale.double().reshape(-1)
    b_d = b_q.double() * (bs.reshape(1, 1, 1) if bs.numel() == 1 else
                          bs.reshape(G, 1, 1) if bs.numel() == G else bs.reshape(G, N, 1))
    ref = torch.zeros(M, N, dtype=torch.float64, device=a_q.device)
    start = 0
    for g, n in enumerate(lens):
        ref[start:start + n] = a_d[start:start + n] @ b_d[g].T
        start += n
    return ref


def _emulate_kernel(a_q, sa, b_q, sb, sc, lens):
    """What the kernel computes from its operands, in float64: per 128-deep K block the partial
    times ``sa[m, kb] * sb[g, n // 128, kb]``, summed, then times ``sc[g, n]`` (COL_SCALE)."""
    M, K = a_q.shape
    G, N, _ = b_q.shape
    out = torch.zeros(M, N, dtype=torch.float64)
    start = 0
    for g, n in enumerate(lens):
        rows = slice(start, start + n)
        for kb in range(-(-K // 128)):
            ks = slice(kb * 128, (kb + 1) * 128)
            part = a_q[rows, ks].double() @ b_q[g, :, ks].double().T
            colf = sb[g, :, kb].double().repeat_interleave(128)[:N]
            out[rows] += part * sa[rows, kb].double()[:, None] * colf[None, :]
        if sc is not None:
            out[rows] *= sc[g].double()[None, :]
        start += n
    return out


@needs_gluon
@pytest.mark.parametrize("form", ["tensorwise", "tensorwise_1", "per_expert", "rowwise", "rowwise_keepdim"])
def test_scaled_views_reproduce_the_product(form):
    """The broadcast views the launcher hands the kernel give the TENSORWISE / ROWWISE product
    (float64 emulation of the kernel's promotion arithmetic against the direct product)."""
    lens, N, K = [37, 0, 90], 200, 304  # K and N tails: partial 128-blocks
    a_q, b_q, offs = _scaled_operands(lens, N, K, "cpu", extra_rows=5)
    a_scale, b_scale = _scale_forms(a_q.shape[0], len(lens), N, "cpu")[form]
    assert gg.gluon_grouped_scaled_scale_reason(a_q, a_scale, b_q, b_scale, "ROWWISE") is None
    sa, sb, sc = gg._scaled_views(a_q, a_scale, b_q, b_scale)
    assert gg.gluon_grouped_operand_reason(a_q, sa, b_q, sb, offs) is None  # the BLOCKWISE operand shapes
    assert (sc is not None) == form.startswith("rowwise")
    assert sa.shape == (a_q.shape[0], 3) and sb.shape == (3, 2, 3)
    assert sa.stride(1) == 0 and sb.stride(1) == 0 and sb.stride(2) == 0  # broadcast, no copies
    got = _emulate_kernel(a_q, sa, b_q, sb, sc, lens)
    ref = _scaled_ref(a_q, a_scale, b_q, b_scale, lens)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@needs_gluon
def test_scaled_reasons():
    lens, N, K = [64, 0, 100], 256, 256
    a_q, b_q, offs = _scaled_operands(lens, N, K, "cpu")
    M, G = a_q.shape[0], len(lens)
    sa, sb = torch.ones(M), torch.ones(G, N)
    ok = gg.gluon_grouped_scaled_operand_reason
    assert "sm_90" in gg.gluon_grouped_scaled_reason(a_q, sa, b_q, sb, offs, "ROWWISE")  # CPU tensors
    assert ok(a_q, sa, b_q, sb, offs, "ROWWISE") is None
    assert ok(a_q, sa[:1], b_q, sb[:1, :1], offs, "TENSORWISE") is None
    cases = [
        (dict(mode="BLOCKWISE"), "TENSORWISE / ROWWISE, not BLOCKWISE"),
        (dict(mode="MX_BLOCKWISE"), "not MX_BLOCKWISE"),
        (dict(a_scale=sa[:-1]), "a_scale must hold 1 or M_total=164"),
        (dict(b_scale=sb[:, :-1]), "b_scale must hold 1, G=3 or G*N=768"),
        (dict(a_scale=sa.to(torch.int32)), "a_scale must be a float tensor"),
        (dict(b_scale=None), "b_scale must be a torch.Tensor"),
        (dict(b_scale=sb.to("meta")), "one device"),
        (dict(a=a_q.to(torch.float8_e5m2)), "float8_e4m3fn only"),
        (dict(b=b_q[0]), "[G, N, K]"),
        (dict(group_offs=offs.to(torch.int32)), "int64 [G+1]"),
        (dict(a=a_q.t().contiguous().t()), "K-contiguous"),
    ]
    base = dict(a=a_q, a_scale=sa, b=b_q, b_scale=sb, group_offs=offs, mode="ROWWISE")
    for over, match in cases:
        kw = {**base, **over}
        reason = ok(kw["a"], kw["a_scale"], kw["b"], kw["b_scale"], kw["group_offs"], kw["mode"])
        assert reason is not None and match in reason, (over.keys(), reason)
    with pytest.raises(ValueError, match="grouped_gemm_fp8_scaled_gluon"):
        gg.grouped_gemm_fp8_scaled_gluon(a_q, sa, b_q, sb, offs, "BLOCKWISE")


@needs_gluon
def test_scaled_default_rule(fake_sm90, monkeypatch):
    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType

    lens, N, K = [64, 0, 100], 256, 256
    a_q, b_q, offs = _scaled_operands(lens, N, K, "cpu")
    for mode, (sa, sb) in (("ROWWISE", (torch.ones(164), torch.ones(3, 256))),
                           ("TENSORWISE", (torch.ones(()), torch.ones(())))):
        kw = dict(a_q=a_q, a_scale=sa, b_q=b_q, b_scale=sb, mode=mode, group_lens=None, group_offs=offs,
                  out_dtype=torch.bfloat16, block_size=128, num_cu=None)
        assert be.GroupedGemmFP8GluonBackend.why_not(**kw) is None, mode
        monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED", "1")
        assert be._default_mgrouped(**kw) == BackendType.GLUON
        # E5M2 (HYBRID's dgrad): not the Gluon kernel
        assert be._default_mgrouped(**dict(kw, a_q=a_q.to(torch.float8_e5m2))) != BackendType.GLUON
        monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED", "0")
        assert be._default_mgrouped(**kw) != BackendType.GLUON
        # auto: the shape rule (G 3, K 256: the Gluon kernel)
        monkeypatch.delenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED")
        assert be.gluon_grouped_scaled_enabled() is None
        assert be._default_mgrouped(**kw) == BackendType.GLUON
    # the rule: the Gluon kernel for every shape, the old vendor band (2048 < K < 8192 with four
    # experts or more) included since the H200 run of 2026-12-04
    assert all(be.gluon_scaled_preferred(G, K) for G, K in ((4, 768), (16, 2048), (1, 2880), (2, 4096), (4, 2880),
                                                            (32, 7168), (8, 8192), (1, 14336)))
    a4, b4, offs4 = _scaled_operands([16, 0, 8, 24], 128, 4096, "cpu")
    kw4 = dict(a_q=a4, a_scale=torch.ones(()), b_q=b4, b_scale=torch.ones(()), mode="TENSORWISE", group_lens=None,
               group_offs=offs4, out_dtype=torch.bfloat16, block_size=128, num_cu=None)
    assert be.GroupedGemmFP8GluonBackend.why_not(**kw4) is None
    assert be._default_mgrouped(**kw4) == BackendType.GLUON
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED", "0")
    assert be._default_mgrouped(**kw4) != BackendType.GLUON
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED", "sometimes")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED"):
        be.gluon_grouped_scaled_enabled()


@needs_gluon
@pytest.mark.parametrize("out_dtype", ["bf16", "fp32"])
def test_col_scale_compiles_for_sm90_without_spills(out_dtype, request):
    if rerun_outside_interpreter(request):
        return
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[out_dtype]
    compile_report(gg.grouped_default_config(1, 1, 1, 1, torch_dtype), out_dtype, grouped=True, col_scale=True)


@needs_gluon
def test_scaled_launcher_arguments_bind_and_compile_for_sm90(monkeypatch, request):
    if rerun_outside_interpreter(request):
        return
    a_q, b_q, offs = _scaled_operands([100, 0, 200], 384, 640, "cpu", extra_rows=20)
    a_scale, b_scale = _scale_forms(a_q.shape[0], 3, 384, "cpu")["rowwise"]
    out = torch.empty(a_q.shape[0], 384, dtype=torch.bfloat16)
    sa, sb, sc = gg._scaled_views(a_q, a_scale, b_q, b_scale)
    cfg = gg.grouped_default_config(1, 1, 1, 1)
    args, kwargs = gg._kernel_args(a_q, sa, b_q, sb, offs, out, cfg, sc)
    assert kwargs["COL_SCALE"] is True and args[7] is sc and args[-1] == 384
    kernel = warmup_for_sm90(gg._grouped_gemm_fp8_blockwise_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.num_warps == 12


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", ["tensorwise", "per_expert", "rowwise", "rowwise_keepdim"])
@pytest.mark.parametrize("pattern", ["balanced", "unbalanced", "tiny"])
@pytest.mark.parametrize("N,K", [(256, 512), (384, 336), (144, 128)])
def test_scaled_matches_reference(form, pattern, N, K):
    lens = LENS[pattern]
    a_q, b_q, offs = _scaled_operands(lens, N, K, "cuda", extra_rows=37)
    M = a_q.shape[0]
    a_scale, b_scale = _scale_forms(M, len(lens), N, "cuda")[form]
    mode = "ROWWISE" if form.startswith("rowwise") else "TENSORWISE"
    assert gg.gluon_grouped_scaled_reason(a_q, a_scale, b_q, b_scale, offs, mode) is None
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    res = gg.grouped_gemm_fp8_scaled_gluon(a_q, a_scale, b_q, b_scale, offs, mode, out=out)
    assert res is out and not torch.isnan(out).any(), "unwritten output elements"
    end = int(offs[-1])
    assert torch.all(out[end:] == 0), "rows past group_offs[G] must be zero"
    ref = _scaled_ref(a_q, a_scale, b_q, b_scale, lens)
    assert _snr(ref, out) >= MIN_SNR[torch.bfloat16], (form, pattern, N, K)
    f32 = gg.grouped_gemm_fp8_scaled_gluon(a_q, a_scale, b_q, b_scale, offs, mode, out_dtype=torch.float32)
    # fp32 out: ~78 dB on the H200 (sm_90 FP8 wgmma sums each 128-deep block with a reduced-precision
    # accumulator before the fp32 promotion; the same for the BLOCKWISE kernel and the vendor)
    assert _snr(ref, f32) >= 70.0
    if hasattr(torch, "_scaled_grouped_mm") and N % 16 == 0 and K % 16 == 0 and form != "per_expert":
        G = len(lens)
        sa = a_scale.float().reshape(-1).expand(M).contiguous()
        sb = b_scale.float().reshape(-1).expand(G * N).reshape(G, N).contiguous()
        vendor = torch._scaled_grouped_mm(a_q, b_q.transpose(-2, -1), sa, sb, offs=offs[1:].to(torch.int32),
                                          out_dtype=torch.bfloat16)
        assert _snr(vendor[:end].float(), out[:end]) >= 40.0


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["TENSORWISE", "ROWWISE"])
def test_scaled_op_with_the_switch(granularity, monkeypatch):
    """grouped_gemm_fp8 forward and backward with the scaled Gluon default on and off."""
    results = _op_with_switch_on_and_off(monkeypatch, "PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED", granularity)
    assert torch.all(results["1"][0][950:] == 0)


# ---------------------------------------------------------------------------------------------
# The prepared launch (triton/launch.launch_prepared)
# ---------------------------------------------------------------------------------------------
def _launch_operands(form, lens, extra_rows=0, device="cpu", N=256, K=384):
    """(a, sa, b, sb, offs, out, sc) as the launcher hands them to the kernel: BLOCKWISE operands, or
    the broadcast scale views of the TENSORWISE / ROWWISE path (``_scaled_views``)."""
    if form == "blockwise":
        (a, sa, b, sb, offs), _ = _operands(lens, N, K, device, extra_rows=extra_rows)
        sc = None
    else:
        a, b, offs = _scaled_operands(lens, N, K, device, extra_rows=extra_rows)
        a_scale, b_scale = _scale_forms(a.shape[0], len(lens), N, device)[form]
        sa, sb, sc = gg._scaled_views(a, a_scale, b, b_scale)
    out = torch.empty(a.shape[0], N, dtype=torch.bfloat16, device=device)
    return a, sa, b, sb, offs, out, sc


@needs_gluon
@pytest.mark.parametrize("form", ["blockwise", "tensorwise", "rowwise"])
def test_prepared_key_covers_the_launch_arguments(form):
    """The prepared launch's key and pointers (``_prepared_key``): the pointers cover every tensor
    and descriptor base among the kernel's arguments (else ``launch_prepared`` keeps nothing and
    every call pays the full host path); new tensors of the same signature give the same key and
    their own pointers; another M, a misaligned output or the column-scale switch give another key."""
    from primus_turbo.triton import launch as L

    cfg = gg.grouped_default_config(0, 0, 0, 0, torch.bfloat16)
    ops = _launch_operands(form, [64, 0, 100])
    key, ptrs = gg._prepared_key(*ops[:6], cfg, ops[6])
    args, kwargs = gg._kernel_args(*ops[:6], cfg, ops[6])
    assert L._pointers_of(args) and L._pointers_of(args) <= set(ptrs)
    assert kwargs["COL_SCALE"] == (form == "rowwise") == (ops[6] is not None)
    hash(key)
    again = _launch_operands(form, [64, 0, 100])
    key2, ptrs2 = gg._prepared_key(*again[:6], cfg, again[6])
    assert key2 == key and ptrs2 != ptrs
    other = _launch_operands(form, [64, 0, 100], extra_rows=3)
    assert gg._prepared_key(*other[:6], cfg, other[6])[0] != key
    a, sa, b, sb, offs, out, sc = ops
    raw = torch.empty(out.numel() + 8, dtype=out.dtype)
    shifted = raw[1:1 + out.numel()].view(out.shape)  # 2 bytes past a 16-byte boundary
    assert gg._prepared_key(a, sa, b, sb, offs, shifted, cfg, sc)[0] != key
    if form == "rowwise":  # the same operands without the per-column scales: another key
        assert gg._prepared_key(a, sa, b, sb, offs, out, cfg, None)[0] != key


@sm90
@pytest.mark.gpu
def test_prepared_launches_follow_the_pointers():
    """The BLOCKWISE and ROWWISE launches through the prepared path: a signature's first call,
    repeats on the same tensors (a kept list) and new tensors of the same signature all give the
    reference and the output of a fresh call; the kept lists hold no tensor (freed operands are
    freed)."""
    from primus_turbo.triton import launch as L

    lens, N, K = [200, 0, 384, 77], 512, 1024

    def run_once(check: bool):
        (a, sa, b, sb, offs), ref = _operands(lens, N, K, "cuda", extra_rows=5)
        a8, b8, offs8 = _scaled_operands(lens, N, K, "cuda", extra_rows=5)
        a_scale, b_scale = _scale_forms(a8.shape[0], len(lens), N, "cuda")["rowwise"]
        ref8 = _scaled_ref(a8, a_scale, b8, b_scale, lens)
        for _ in range(2):
            out = torch.full((a.shape[0], N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gg.grouped_gemm_fp8_blockwise_gluon(a, sa, b, sb, offs, out=out)
            fresh = gg.grouped_gemm_fp8_blockwise_gluon(a, sa, b, sb, offs)
            out8 = torch.full((a8.shape[0], N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gg.grouped_gemm_fp8_scaled_gluon(a8, a_scale, b8, b_scale, offs8, "ROWWISE", out=out8)
            if check:
                assert _snr(ref, out) >= MIN_SNR[torch.bfloat16] and torch.equal(fresh, out)
                assert _snr(ref8, out8) >= MIN_SNR[torch.bfloat16]

    # first: the references' cuBLAS workspace and the scaled path's persistent 1.0 (both kept for
    # the process by design), so that the count below sees only what the launches keep
    run_once(check=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        run_once(check=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    kept = [rec for key, rec in L._PREPARED.items() if key[0] == id(gg._grouped_gemm_fp8_blockwise_ws_kernel)]
    assert kept and all(not isinstance(v, torch.Tensor) for rec in kept for v in rec[1])


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("form", ["blockwise", "tensorwise", "per_expert", "rowwise", "rowwise_strided",
                                  "rowwise_bf16"])
def test_flat_signature_repeats(form, monkeypatch):
    """Calls that allocate their output (the dispatcher's form): the first call of a flat signature
    keeps its launch (``_FAST``), repeats fire it and give the first call's output bitwise; new
    tensors of the same facts make their own entry and give their own reference. Scales the
    launcher copies every call (a strided ``[G, N]`` ROWWISE weight scale, a bf16 one) keep nothing:
    the kept launch would hold the freed copy's address."""
    lens, N, K = [200, 0, 384, 77], 512, 1024
    gg._FAST.clear()
    fired = []
    real_fire = gg._gg.fire
    monkeypatch.setattr(gg._gg, "fire", lambda kept, index: fired.append(real_fire(kept, index)) or fired[-1])

    def operands():
        if form == "blockwise":
            (a, sa, b, sb, offs), ref = _operands(lens, N, K, "cuda", extra_rows=5)
            return (lambda: gg.grouped_gemm_fp8_blockwise_gluon(a, sa, b, sb, offs)), ref, (a, sa, b, sb, offs)
        a, b, offs = _scaled_operands(lens, N, K, "cuda", extra_rows=5)
        a_scale, b_scale = _scale_forms(a.shape[0], len(lens), N, "cuda")[form.split("_")[0]
                                                                           if form.startswith("rowwise") else form]
        if form == "rowwise_strided":
            b_scale = torch.empty(len(lens), 2 * N, device="cuda")[:, ::2].copy_(b_scale)
        elif form == "rowwise_bf16":
            b_scale = b_scale.bfloat16()
        ref = _scaled_ref(a, a_scale.float(), b, b_scale.float(), lens)
        mode = "ROWWISE" if form.startswith("rowwise") else "TENSORWISE"
        return ((lambda: gg.grouped_gemm_fp8_scaled_gluon(a, a_scale, b, b_scale, offs, mode)), ref,
                (a, a_scale, b, b_scale, offs))

    copies = form in ("rowwise_strided", "rowwise_bf16")
    for _ in range(2):  # two sets of tensors of one signature
        call, ref, keep_alive = operands()
        first = call()
        torch.cuda.synchronize()
        assert _snr(ref, first) >= MIN_SNR[torch.bfloat16] and torch.all(first[661:] == 0)
        entries = len(gg._FAST)
        for _ in range(3):
            again = call()
            assert torch.equal(again, first)
            del again
        assert len(gg._FAST) == entries
        if copies:
            assert not gg._FAST
        else:
            # kept launches hold plain pointers, no tensor (freed operands stay freed)
            assert entries >= 1 and all(not isinstance(x, torch.Tensor) for v in gg._FAST.values()
                                        for rec, _grid in v[3].values() for x in rec[1])
    assert len(gg._FAST) == (0 if copies else 2)
    # repeats whose output lands on a kept address (the caching allocator cycles through a few
    # blocks: the first repeat's is new, later ones reuse it) launch from the kept record
    assert (fired.count(True) >= 2) if not copies else not fired


@needs_gluon
@pytest.mark.parametrize("form", ["blockwise", "tensorwise", "rowwise", "rowwise_strided", "rowwise_bf16"])
def test_flat_signature_bookkeeping_without_a_gpu(form, monkeypatch):
    """``_launch``'s keeping and ``_fast``'s firing with the CUDA side mocked (CPU CI): a launch
    whose prepared pointers are all the inputs', the output's or the persistent 1.0 is kept under
    the flat signature and the output's address, with the plan's grid; firing it launches that
    record; a launch through a per-call scale copy (a strided or bf16 ROWWISE weight scale) keeps
    nothing; another output address or a declined fire falls back (None)."""
    from primus_turbo.triton import launch as L

    prepared, calls = [], []

    def fake_prepared(kernel, grid, args_fn, kwargs, device, key, ptrs):
        args_fn()  # the argument list must build
        prepared.append(ptrs)
        L._PREPARED[(id(kernel), device.index, key, ptrs)] = (("launcher",), list(ptrs))

    monkeypatch.setattr(gg, "launch_prepared", fake_prepared)
    monkeypatch.setattr(dense, "_num_sms", lambda device: 132)
    monkeypatch.setattr(L, "_call_entry", lambda entry, grid, index, args, tail: calls.append((grid, args)))
    monkeypatch.setattr(L, "_DIRECT", [True])
    monkeypatch.setattr(L, "no_launch_hooks", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: None, raising=False)  # CPU tensors: index None
    gg._FAST.clear()
    lens, N, K = [64, 0, 100], 256, 384
    if form == "blockwise":
        (a, sa, b, sb, offs), _ = _operands(lens, N, K, "cpu", extra_rows=3)
        inputs, tag, a_s, b_s = (a, sa, b, sb, offs), "bw", sa, sb
        views = (sa, sb, None)
    else:
        a, b, offs = _scaled_operands(lens, N, K, "cpu", extra_rows=3)
        a_s, b_s = _scale_forms(a.shape[0], len(lens), N, "cpu")[form.split("_")[0]]
        if form == "rowwise_strided":
            b_s = torch.empty(len(lens), 2 * N)[:, ::2].copy_(b_s)
        elif form == "rowwise_bf16":
            b_s = b_s.bfloat16()
        inputs, tag = (a, a_s, b, b_s, offs), ("sc", "ROWWISE" if form.startswith("rowwise") else "TENSORWISE")
        views = gg._scaled_views(a, a_s, b, b_s)
    fk = gg._flat_key(tag, a, a_s, b, b_s, offs, torch.bfloat16, None, None)
    assert fk is not None and gg._fast(fk) is None  # nothing kept yet
    try:
        out = gg._launch(a, views[0], b, views[1], offs, torch.bfloat16, None, None, None, views[2], "t", fk, inputs)
        assert len(prepared) == 1 and out.shape == (a.shape[0], N)
        if form in ("rowwise_strided", "rowwise_bf16"):
            assert fk not in gg._FAST and gg._fast(fk) is None
            return
        shape, dtype, device, kept = gg._FAST[fk]
        assert (shape, dtype, device) == ((a.shape[0], N), torch.bfloat16, a.device)
        rec, grid = kept[out.data_ptr()]
        assert rec == (("launcher",), list(prepared[0])) and grid[0] <= 132
        other = torch.empty_like(out)
        real_empty = torch.empty
        block = [out]  # the block the next output takes (the caching allocator's reuse, made certain)
        monkeypatch.setattr(torch, "empty", lambda *args, **kw: block[0] if args == (shape,) else real_empty(*args,
                                                                                                             **kw))
        assert gg._fast(fk) is out and calls == [(grid, list(prepared[0]))]
        block[0] = other  # an address without a kept launch
        assert gg._fast(fk) is None and len(calls) == 1
        block[0] = out
        monkeypatch.setattr(L, "_DIRECT", [False])
        assert gg._fast(fk) is None and len(calls) == 1
        assert gg._flat_key(tag, a, a_s, b, b_s, offs[:-1], torch.bfloat16, None, None) != fk
        assert gg._flat_key(tag, a, a_s, b, b_s, [0, 1], torch.bfloat16, None, None) is None
    finally:
        for k in [k for k in L._PREPARED if k[0] == id(gg._grouped_gemm_fp8_blockwise_ws_kernel)]:
            del L._PREPARED[k]
        gg._FAST.clear()
