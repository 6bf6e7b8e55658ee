"""The Gluon variable-K grouped BLOCKWISE FP8 GEMM, the MoE wgrad
(primus_turbo/triton/grouped_gemm/grouped_gemm_fp8_variable_k_gluon.py).

On CPU: the eligibility reasons (also for the operands ``turbo.ops.grouped_gemm_fp8`` builds for
its BLOCKWISE wgrad, E4M3 and HYBRID), the backend's opt-in default rule with a mocked platform,
and that the kernel compiles for sm_90 without spills, with the wgmma / TMA instructions expected,
also through the launcher's own arguments. On an sm_90 GPU: against the fp32 product of the
dequantized operands and the ``triton.language`` variable-K kernel, on a poisoned output, with
balanced, unbalanced and empty groups, accumulation, P / Q tails, E5M2 x E4M3, the backend and the op.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.gemm import gemm_fp8_gluon as dense  # noqa: E402
from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_variable_k_gluon as vk  # noqa: E402
from tests.triton.gluon_compile_child import rerun_outside_interpreter, warmup_for_sm90  # noqa: E402
from tests.triton.gluon_gemm_helpers import (  # noqa: E402
    assert_pinned_gluon_raises_on_cpu, assert_refused_on_cpu, assert_row_scales_arg, compile_report, fake_platform,
    needs_gluon, sm90_gpu,
)
from tests.triton.gluon_gemm_helpers import offsets as _offsets  # noqa: E402
from tests.triton.gluon_gemm_helpers import snr as _snr  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def _quant_tokens(x: torch.Tensor, dtype=E4M3):
    """x [R, M_total] (M_total % 128 == 0) -> (q [R, M_total], scale_inv [R, M_total/128]): 1 x 128
    token blocks, as the op quantizes its padded wgrad copies."""
    R, M = x.shape
    g = x.float().view(R, M // 128, 128)
    scale = FP8_MAX[dtype] / g.abs().amax(-1).clamp(min=1e-12)
    q = (g * scale[..., None]).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).view(R, M)
    return q.contiguous(), (1.0 / scale).contiguous()


def _operands(lens, P, Q, device, extra=0, x_dtype=E4M3, y_dtype=E4M3):
    """x_t [P, M], y_t [Q, M] with M = sum(lens) + extra (token blocks past offs[G] are ignored),
    their scales, the offsets, and the float64 reference [G, P, Q] of the dequantized operands."""
    assert all(n % 128 == 0 for n in lens) and extra % 128 == 0
    M = sum(lens) + extra
    x_q, sx = _quant_tokens(torch.randn(P, M, device=device) * 2, x_dtype)
    y_q, sy = _quant_tokens(torch.randn(Q, M, device=device) * 0.05, y_dtype)
    offs = _offsets(lens, device)
    x_d = x_q.double() * sx.double().repeat_interleave(128, 1)
    y_d = y_q.double() * sy.double().repeat_interleave(128, 1)
    ref = torch.zeros(len(lens), P, Q, dtype=torch.float64, device=device)
    start = 0
    for g, n in enumerate(lens):
        ref[g] = x_d[:, start:start + n] @ y_d[:, start:start + n].T
        start += n
    return (x_q, sx, y_q, sy, offs), ref


# ---------------------------------------------------------------------------------------------
# CPU: reasons
# ---------------------------------------------------------------------------------------------
def test_reason_on_cpu_tensors():
    operands, _ = _operands([256, 0, 128], 128, 256, "cpu")
    assert_refused_on_cpu(vk.gluon_variable_k_blockwise_reason, vk.gluon_variable_k_operand_reason,
                          vk.grouped_gemm_fp8_variable_k_blockwise_gluon, operands)


@needs_gluon
def test_operand_reasons():
    (x, sx, y, sy, offs), _ = _operands([256, 0, 128], 192, 200, "cpu")
    G, P, Q = 3, 192, 200
    base = dict(x_t=x, sx=sx, y_t=y, sy=sy, group_offs=offs, out=None, accumulate=False, out_dtype=torch.bfloat16)
    out32 = torch.empty(G, P, Q)
    cases = [
        (dict(x_t=x.to(torch.int8)), "float8_e4m3fn or float8_e5m2"),
        (dict(y_t=y.float()), "float8_e4m3fn or float8_e5m2"),
        (dict(y_t=y[:, :256]), "token dim mismatch"),
        (dict(x_t=x[:, :256], y_t=y[:, :256], sx=sx[:, :2], sy=sy[:, :2]), None),  # fewer tokens: fine
        (dict(x_t=x[:, :200], y_t=y[:, :200]), "multiple of 128"),
        (dict(x_t=x[:96], sx=sx[:96]), "multiple of 64"),
        (dict(sx=sx[:, :1]), "sx must be float32 [P, M_total/128]"),
        (dict(sy=sy.double()), "sy must be float32 [Q, M_total/128]"),
        (dict(group_offs=offs.to(torch.int32)), "int64 [G+1]"),
        (dict(group_offs=[0, 128]), "group_offs must be a torch.Tensor"),
        (dict(x_t=x.t().contiguous().t()), "token-contiguous"),
        (dict(x_t=x[:, 1:129], y_t=y[:, :128], sx=sx[:, :1], sy=sy[:, :1]), "16-byte aligned"),
        (dict(out_dtype=torch.float64), "not one of bfloat16"),
        (dict(y_t=y[:196], sy=sy[:196]), "16-byte aligned for the TMA store"),  # 196 bf16: 392 bytes
        (dict(accumulate=True), "accumulate=True needs out"),
        (dict(out=torch.empty(G, P, Q, dtype=torch.bfloat16), accumulate=True), "out must be float32"),
        (dict(out=torch.empty(G, P, Q + 8)[:, :, :Q]), None),  # padded rows: still one [G * P, Q] view
        (dict(out=torch.empty(G, P + 64, Q)[:, :P]), "row-contiguous, experts stacked"),
        (dict(out=torch.empty(G, Q, P).transpose(1, 2)), "row-contiguous, experts stacked"),
        (dict(out=torch.empty(G + 1, P, Q)), "expected [G, P, Q]"),
        (dict(out=out32), None),
        (dict(out=out32, accumulate=True), None),
        (dict(x_t=x.to(E5M2)), None),  # HYBRID's E5M2 gradient: a mixed-type wgmma
    ]
    for over, match in cases:
        kw = {**base, **over}
        reason = vk.gluon_variable_k_operand_reason(**kw)
        if match is None:
            assert reason is None, (over.keys(), reason)
        else:
            assert reason is not None and match in reason, (over.keys(), reason)
    assert "block_size" in vk.gluon_variable_k_operand_reason(x, sx, y, sy, offs, block_size=64)
    assert vk.gluon_variable_k_operand_reason(x, sx, y, sy, offs, out_dtype=torch.float32) is None
    assert "out must be a torch.Tensor" in vk.gluon_variable_k_blockwise_reason(x, sx, y, sy, offs, out=object())


@needs_gluon
@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
@pytest.mark.parametrize("trans_b", [True, False])
def test_op_wgrad_operands_are_gluon_shaped(fmt, trans_b, monkeypatch):
    """The operands grouped_gemm_fp8 BLOCKWISE hands its variable-K dispatcher (the padded token
    layout's column-wise copies and offsets, E5M2 dY under HYBRID, bf16 grad or fp32 main_grad)
    pass the operand checks; recorded from a real backward on the CPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the op on CPU tensors: needs the Triton interpreter (the CPU test run)")
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as be
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    seen = []
    ops_mod = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")
    real = ops_mod._dispatch

    def spy(dispatcher, envs, kw):  # every FP8 grouped GEMM of the op goes through _dispatch
        if dispatcher is be.grouped_gemm_fp8_variable_k_dispatcher:
            seen.append(vk.gluon_variable_k_operand_reason(
                kw["x_t"], kw["x_scale"], kw["y_t"], kw["y_scale"], kw["group_offs"], out=kw["out"],
                accumulate=kw["accumulate"], out_dtype=kw["out_dtype"], block_size=kw["block_size"]))
        return real(dispatcher, envs, kw)

    monkeypatch.setattr(ops_mod, "_dispatch", spy)
    G, N, K = 3, 128, 64
    lens = torch.tensor([40, 0, 100], dtype=torch.int64)
    a = torch.randn(int(lens.sum()) + 3, K, requires_grad=True)
    b = (torch.randn((G, N, K) if trans_b else (G, K, N)) / 8).requires_grad_()
    cfg = Float8QuantConfig(format=fmt, granularity="BLOCKWISE")
    turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=trans_b, config=cfg).sum().backward()
    assert seen == [None], seen


# ---------------------------------------------------------------------------------------------
# CPU: the backend and its opt-in default rule
# ---------------------------------------------------------------------------------------------
def _dispatch_kw(device, lens=(256, 0, 128), P=128, Q=256, **over):
    (x, sx, y, sy, offs), ref = _operands(list(lens), P, Q, device)
    kw = dict(x_t=x, x_scale=sx, y_t=y, y_scale=sy, mode="BLOCKWISE", group_lens=None, group_offs=offs, out=None,
              accumulate=False, out_dtype=torch.bfloat16, num_cu=None, block_size=128)
    kw.update(over)
    return kw, ref


@pytest.fixture
def fake_sm90(monkeypatch):
    return fake_platform(monkeypatch, vk)


@needs_gluon
def test_default_rule(fake_sm90, monkeypatch):
    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType, PrecisionType

    var = "PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_WGRAD"
    d = be.grouped_gemm_fp8_variable_k_dispatcher
    assert d.backends[BackendType.GLUON] is be.GroupedGemmFP8VariableKGluonBackend
    assert be.GroupedGemmFP8VariableKGluonBackend.autotune is False
    kw, _ = _dispatch_kw("cpu")
    assert be.GroupedGemmFP8VariableKGluonBackend.why_not(**kw) is None  # the mocked platform says sm_90
    # on by default (auto) since the H200 measurement; 0 turns it off
    monkeypatch.setenv(var, "0")
    assert be._default_vk(**kw) == BackendType.TRITON
    for value in (None, "auto", "1"):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        assert be._default_vk(**kw) == BackendType.GLUON, value
    assert d.resolve(PrecisionType.FP8, **kw) is be.GroupedGemmFP8VariableKGluonBackend
    G, P, Q = 3, 128, 256
    acc = dict(out=torch.zeros(G, P, Q), accumulate=True)
    assert be._default_vk(**dict(kw, **acc)) == BackendType.GLUON  # main_grad accumulation (fp32)
    assert be._default_vk(**dict(kw, x_t=kw["x_t"].to(E5M2))) == BackendType.GLUON  # HYBRID
    refused = [dict(mode="ROWWISE"), dict(block_size=64), dict(num_cu=0), dict(group_offs=None),
               dict(out=torch.zeros(G, P, Q, dtype=torch.bfloat16), accumulate=True)]
    for over in refused:
        assert be._default_vk(**dict(kw, **over)) == BackendType.TRITON, over.keys()
    fake_sm90["reason"] = "the Gluon kernel is built for sm_90 (H100/H200), this GPU is sm_80"
    assert be._default_vk(**kw) == BackendType.TRITON
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=var):
        be.gluon_grouped_wgrad_enabled()


def test_pin_on_cpu_raises(device):
    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as be

    kw, _ = _dispatch_kw(device)
    assert_pinned_gluon_raises_on_cpu(be.grouped_gemm_fp8_variable_k_dispatcher, kw)


# ---------------------------------------------------------------------------------------------
# CPU: sm_90 compile
# ---------------------------------------------------------------------------------------------
@needs_gluon
@pytest.mark.parametrize("out_dtype,accumulate,config", [("bf16", False, None), ("fp32", False, None),
                                                         ("fp32", True, None), ("fp16", False, None),
                                                         ("bf16", False, "n128s6"), ("fp32", True, "n128s5"),
                                                         ("bf16", False, "n256s3c2"), ("fp32", True, "n256s3"),
                                                         ("bf16", False, "n128s5c2xr240w24"),
                                                         ("fp32", True, "n128s4xr240w24")])
def test_compiles_for_sm90_without_spills(out_dtype, accumulate, config, request):
    """The shipped default config (n128s5xr240w24: pipelined, column scales TMA'd through the
    ring) and the other kinds (register path n128s4-6, 256-wide): no spills, no serialized
    wgmmas, 4 FP8 wgmmas per warpgroup per 128-token block (unrolled: 8 in the register path, 16
    at BLOCK_N 256, 32 pipelined), TMA loads, and a TMA store or (accumulating) a TMA reduce-add
    per warpgroup and 128 columns."""
    if rerun_outside_interpreter(request):
        return
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[out_dtype]
    cfg = dense.GluonBlockwiseConfig.parse(config) if config else vk.variable_k_default_config(1, 1, 1, 1, torch_dtype)
    assert cfg.check(torch_dtype.itemsize, b_row_scales=True) is None
    res = compile_report(cfg, out_dtype, variable_k=True, accumulate=accumulate)
    counts = res["sass_counts"]
    if not any(counts.values()):
        pytest.skip("cuobjdump not available: no SASS to count")
    wgmma = 32 if cfg.pipeline else 8 * (cfg.block_n // 128)
    assert counts["wgmma"] == wgmma and counts["local_store"] == 0 and counts["local_load"] == 0, counts
    # two A halves and one B box per stage, plus the column scales' box on the shared-memory path
    assert counts["tma_load"] == (4 if dense.row_scales_via_smem(cfg) else 3), counts
    stores = 2 * (cfg.block_n // 128)
    assert (counts["tma_reduce"], counts["tma_store"]) == ((stores, 0) if accumulate else (0, stores)), counts


@needs_gluon
@pytest.mark.parametrize("out_dtype,accumulate,x_dtype,config", [(torch.bfloat16, False, E4M3, None),
                                                                 (torch.float32, True, E4M3, None),
                                                                 (torch.bfloat16, False, E5M2, None),
                                                                 (torch.bfloat16, False, E4M3, "n128s6"),
                                                                 (torch.float32, True, E5M2, "n256s3")])
def test_launcher_arguments_bind_and_compile_for_sm90(out_dtype, accumulate, x_dtype, config, monkeypatch, request):
    """The launcher's own arguments (host TMA descriptors incl. the [G * P, Q] output view, sy as
    a TMA descriptor of its [M/128, Q] transpose or (register path) column-major padded, offsets,
    strides) bind and compile for sm_90 with a stand-in driver; E5M2 x E4M3 compiles to a
    mixed-type wgmma."""
    if rerun_outside_interpreter(request):
        return
    (x, sx, y, sy, offs), _ = _operands([256, 0, 384], 192, 200, "cpu", extra=128, x_dtype=x_dtype)
    out = torch.zeros(3, 192, 200, dtype=out_dtype)
    cfg = (dense.GluonBlockwiseConfig.parse(config) if config
           else vk.variable_k_default_config(192, 200, x.shape[1], 3, out_dtype))
    args, kwargs = vk._kernel_args(x, sx, y, sy, offs, out, cfg, accumulate)
    assert_row_scales_arg(args, kwargs, "sy_desc", cfg, [x.shape[1] // 128, 200], sy.t())
    kernel = warmup_for_sm90(vk._grouped_gemm_fp8_variable_k_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.shared <= dense.SMEM_LIMIT
    assert kernel.metadata.num_warps == 12
    if x_dtype == E5M2:
        assert "f32.e5m2.e4m3" in kernel.asm["ptx"]


# ---------------------------------------------------------------------------------------------
# GPU: correctness
# ---------------------------------------------------------------------------------------------
# token counts per group (multiples of 128, as the op's padded layout): balanced; unbalanced with
# empty groups first, inside and last; a single group; many small ones
LENS = {
    "balanced": [512, 512, 512, 512],
    "unbalanced": [0, 1280, 128, 0, 384, 0],
    "single": [896],
    "small": [128, 0, 256, 128, 0, 128, 128, 0],
}


@sm90_gpu
@pytest.mark.parametrize("pattern", list(LENS))
@pytest.mark.parametrize("P,Q", [(256, 512), (192, 200), (64, 136)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_matches_reference_and_tl(pattern, P, Q, out_dtype):
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_variable_k_triton

    (x, sx, y, sy, offs), ref = _operands(LENS[pattern], P, Q, "cuda", extra=128)
    G = len(LENS[pattern])
    assert vk.gluon_variable_k_blockwise_reason(x, sx, y, sy, offs, out_dtype=out_dtype) is None
    out = torch.full((G, P, Q), float("nan"), device="cuda", dtype=out_dtype)
    res = vk.grouped_gemm_fp8_variable_k_blockwise_gluon(x, sx, y, sy, offs, out=out)
    assert res is out
    assert not torch.isnan(out).any(), "unwritten output elements"
    for g, n in enumerate(LENS[pattern]):
        if n == 0:
            assert torch.all(out[g] == 0), f"empty group {g} must be zero"
    assert _snr(ref, out) >= 25.0, (pattern, P, Q)
    assert _snr(ref, out) >= (40.0 if out_dtype == torch.bfloat16 else 50.0), (pattern, P, Q)
    tl_out = grouped_gemm_fp8_variable_k_triton(x, sx, y, sy, "BLOCKWISE", None, offs, out_dtype=out_dtype)
    assert _snr(tl_out.float(), out) >= (40.0 if out_dtype == torch.bfloat16 else 60.0)


@sm90_gpu
@pytest.mark.parametrize("pattern", ["balanced", "unbalanced"])
def test_accumulate_into_fp32(pattern):
    """out += ...: a TMA reduce-add; empty groups leave out[g] bit-for-bit unchanged; the same
    result as the tl kernel accumulating."""
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_variable_k_triton

    P, Q = 256, 384
    (x, sx, y, sy, offs), ref = _operands(LENS[pattern], P, Q, "cuda")
    G = len(LENS[pattern])
    c0 = torch.randn(G, P, Q, device="cuda")
    out = c0.clone()
    res = vk.grouped_gemm_fp8_variable_k_blockwise_gluon(x, sx, y, sy, offs, out=out, accumulate=True)
    assert res is out
    for g, n in enumerate(LENS[pattern]):
        if n == 0:
            assert torch.equal(out[g], c0[g]), f"empty group {g} must be unchanged"
    assert _snr(ref + c0.double(), out) >= 50.0
    tl_out = c0.clone()
    grouped_gemm_fp8_variable_k_triton(x, sx, y, sy, "BLOCKWISE", None, offs, out=tl_out, accumulate=True)
    assert _snr(tl_out, out) >= 60.0
    # twice: the second call adds the same product again
    vk.grouped_gemm_fp8_variable_k_blockwise_gluon(x, sx, y, sy, offs, out=out, accumulate=True)
    assert _snr(2 * ref + c0.double(), out) >= 50.0


@sm90_gpu
@pytest.mark.parametrize("pattern", ["unbalanced", "small"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_configs_are_bit_identical(pattern, accumulate):
    """Every per-row-B-scale schedule (register path n128s6, 256-wide, pipelined; the column
    scales in registers or TMA'd through the ring) runs the same fp32 promotions in the same
    order: the same bits, Q tails included (a 256-wide tile's second half partly past Q, and for Q
    200 the 128-wide path's padded column scales)."""
    for P, Q in ((192, 200), (64, 136)):
        (x, sx, y, sy, offs), _ = _operands(LENS[pattern], P, Q, "cuda", extra=128)
        G = len(LENS[pattern])
        dtype = torch.float32 if accumulate else torch.bfloat16
        c0 = torch.randn(G, P, Q, device="cuda").to(dtype)
        outs = {}
        # an fp32 output's staging buffers leave room for five 128-wide stages, not six
        first = "n128s5" if accumulate else "n128s6"
        for text in (first, "n256s3", "n128s4xr240w24", None):
            cfg = dense.GluonBlockwiseConfig.parse(text) if text else None
            out = c0.clone()
            vk.grouped_gemm_fp8_variable_k_blockwise_gluon(x, sx, y, sy, offs, out=out, accumulate=accumulate,
                                                           config=cfg)
            outs[text] = out
        for text, out in outs.items():
            assert torch.equal(out, outs[first]), (pattern, accumulate, P, Q, text)


@sm90_gpu
def test_hybrid_num_programs_strides_and_clamped_offsets():
    P, Q = 128, 256
    (x, sx, y, sy, offs), ref = _operands([384, 0, 640], P, Q, "cuda", x_dtype=E5M2)
    out = vk.grouped_gemm_fp8_variable_k_blockwise_gluon(x, sx, y, sy, offs, out_dtype=torch.float32)
    assert _snr(ref, out) >= 25.0
    few = vk.grouped_gemm_fp8_variable_k_blockwise_gluon(x, sx, y, sy, offs, out_dtype=torch.float32, num_programs=3)
    assert torch.equal(few, out)
    # scales as the transposes of [M/128, R] grids (column-major views): the same result
    again = vk.grouped_gemm_fp8_variable_k_blockwise_gluon(x, sx.t().contiguous().t(), y, sy.t().contiguous().t(),
                                                           offs, out_dtype=torch.float32)
    assert torch.equal(again, out)
    bad = offs.clone()
    bad[-1] = 1 << 20  # past M_total: clamped on the device, as the tl kernel does
    clamped = vk.grouped_gemm_fp8_variable_k_blockwise_gluon(x, sx, y, sy, bad, out_dtype=torch.float32)
    assert torch.equal(clamped, out)


@sm90_gpu
def test_backend_and_op_with_the_switch(monkeypatch):
    """grouped_gemm_fp8 BLOCKWISE (E4M3 and HYBRID) with the switch off and on: the same grads,
    and with the switch on its variable-K dispatcher picks GLUON."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    picked = []
    ops_mod = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")
    real = ops_mod._dispatch

    def spy(dispatcher, envs, kw):  # every FP8 grouped GEMM of the op goes through _dispatch
        if dispatcher is be.grouped_gemm_fp8_variable_k_dispatcher:
            picked.append(be._default_vk(**kw))
        return real(dispatcher, envs, kw)

    monkeypatch.setattr(ops_mod, "_dispatch", spy)
    G, N, K, M = 4, 512, 768, 1000
    lens = torch.tensor([300, 0, 450, 200], dtype=torch.int64, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(G, N, K, device="cuda") / 32).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    for fmt in ("E4M3", "HYBRID"):
        cfg = Float8QuantConfig(format=fmt, granularity="BLOCKWISE")
        grads = {}
        for value in ("0", "1"):
            monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_WGRAD", value)
            picked.clear()
            wi = w.clone().requires_grad_()
            turbo.ops.grouped_gemm_fp8(x, wi, lens, trans_b=True, config=cfg).backward(dy)
            assert picked == [BackendType.GLUON if value == "1" else BackendType.TRITON], (fmt, value, picked)
            grads[value] = wi.grad
        assert _snr(grads["0"].float(), grads["1"]) >= 40.0, fmt
