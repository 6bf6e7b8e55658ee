"""The bf16 / fp16 Gluon grouped GEMMs: M-grouped forward / dgrad
(primus_turbo/triton/grouped_gemm/grouped_gemm_gluon.py) and the variable-K wgrad
(grouped_gemm_variable_k_gluon.py), and their place in the TRITON backend of ``grouped_gemm``.

On CPU: the eligibility reasons, the config parser, the backend rule (``PRIMUS_TURBO_GROUPED_GEMM_GLUON``)
with a mocked platform, and that every kernel variant compiles for sm_90 without spills or
serialized wgmmas (also through the launchers' own arguments). On an sm_90 GPU: against the fp32
reference (bf16 >= 45 dB, fp16 >= 50 dB) with balanced, unbalanced and empty groups, NaN rows past
``group_offs[G]`` (zero output rows, never read by the wgrad), short groups next to groups whose
rows hold Inf / NaN (never leaking into them), M / N / K tails, both weight
layouts, fused fp32 accumulation, bitwise repeatability, and the op.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg  # noqa: E402
from primus_turbo.triton.grouped_gemm import grouped_gemm_variable_k_gluon as vk  # noqa: E402
from tests.triton.gluon_compile_child import rerun_outside_interpreter, warmup_for_sm90  # noqa: E402
from tests.triton.gluon_gemm_helpers import fake_platform, needs_gluon, sm90_gpu  # noqa: E402
from tests.triton.gluon_gemm_helpers import offsets as _offsets  # noqa: E402
from tests.triton.gluon_gemm_helpers import snr as _snr  # noqa: E402

MIN_SNR = {torch.bfloat16: 45.0, torch.float16: 50.0}


def _script():
    """scripts/check_gluon_grouped.py as a module (its sm_90 compile report)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "check_gluon_grouped.py"
    spec = importlib.util.spec_from_file_location("check_gluon_grouped", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _operands(lens, N, K, device, dtype=torch.bfloat16, tail=0, kmajor=True):
    """a [sum(lens) + tail, K] (tail rows NaN), the logical weight B [G, K, N] (K-contiguous when
    ``kmajor``: a [G, N, K] weight's transposed view), dy [M, N], offsets."""
    G, M = len(lens), sum(lens) + tail
    a = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(G, N, K, device=device) / K ** 0.5).to(dtype)
    B = w.transpose(1, 2) if kmajor else w.transpose(1, 2).contiguous()
    dy = torch.randn(M, N, device=device).to(dtype)
    if tail:
        a[M - tail:] = float("nan")
        dy[M - tail:] = float("nan")
    return a, B, dy, _offsets(lens, device)


def _ref_fwd(a, B, lens):
    out = torch.zeros(a.shape[0], B.shape[2], dtype=torch.float64, device=a.device)
    start = 0
    for g, n in enumerate(lens):
        out[start:start + n] = a[start:start + n].double() @ B[g].double()
        start += n
    return out


def _ref_wgrad(x, y, lens):
    out = torch.zeros(len(lens), x.shape[1], y.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for g, n in enumerate(lens):
        out[g] = x[start:start + n].double().T @ y[start:start + n].double()
        start += n
    return out


# ---------------------------------------------------------------------------------------------
# CPU: configs and reasons
# ---------------------------------------------------------------------------------------------
def test_config_parse_check_and_fit():
    c = gg.GluonGroupedConfig.parse("n256s4")
    assert (c.block_n, c.block_k, c.stages, c.epi_n, c.c_bufs) == (256, 64, 4, 128, 1)
    assert gg.GluonGroupedConfig.parse(c.short()) == c
    assert gg.GluonGroupedConfig.parse("n128k64s6g16e64c2r240w24").short() == "n128k64s6g16e64c2r240w24"
    with pytest.raises(ValueError, match="bad Gluon grouped config"):
        gg.GluonGroupedConfig.parse("m256s4")
    assert c.check(2) is None and gg.GROUPED16_DEFAULT_CONFIG.check(2) is None
    assert "shared memory" in gg.GluonGroupedConfig.parse("n256s5").check(2)
    assert "epi_n" in gg.GluonGroupedConfig.parse("n128s4e256").check(2)
    d = gg.GROUPED16_DEFAULT_CONFIG
    fitted = gg.fitted_config(d, torch.float32)
    assert fitted.check(4) is None and (fitted.block_n, fitted.stages) == (d.block_n, d.stages)
    assert 64 <= fitted.epi_n <= d.epi_n
    fitted = gg.fitted_config(c, torch.float32)  # n256s4: fp32 staging fits only in 64-column pieces
    assert fitted.check(4) is None and (fitted.stages, fitted.epi_n) == (4, 64)
    for text in gg.GROUPED16_CANDIDATES:
        assert gg.GluonGroupedConfig.parse(text).check(2) is None, text


def test_config_pace_option(monkeypatch):
    """``p<D>``: the pacing distance of a config (0 = off, every shipped config; at most 8);
    PRIMUS_TURBO_GROUPED_GEMM_PACE (0 / 1-8) paces the launcher's default config, other values of
    the switch raise naming the value."""
    p = gg.GluonGroupedConfig.parse("n256k64s3e256p2")
    monkeypatch.delenv(gg.PACE_ENV, raising=False)
    assert p.check(2) is None and gg._config_problem(p, 2) is None
    assert p.pace == 2 and p.short().endswith("p2") and gg.GluonGroupedConfig.parse(p.short()) == p
    assert gg.GROUPED16_DEFAULT_CONFIG.pace == 0 and gg.GROUPED16_DEFAULT_CONFIG.short() == "n256k64s3g8e256c1r232w40"
    assert "pace" in gg.GluonGroupedConfig.parse("n256k64s3e256p9").check(2)
    assert gg.pace_default() == 0
    assert gg.default_launch_config(4096 * 8, 4096, 8, 132, torch.bfloat16) == gg.GROUPED16_DEFAULT_CONFIG
    monkeypatch.setenv(gg.PACE_ENV, "1")
    a = torch.randn(300, 64).to(torch.bfloat16)
    B = torch.randn(2, 64, 128).to(torch.bfloat16)
    offs = torch.tensor([0, 100, 300])
    out = torch.empty(300, 128, dtype=torch.bfloat16)
    args, kwargs = gg._kernel_args(a, B, offs, out, p)
    assert kwargs["PACE"] == 2 and args[5].dtype == torch.int32 and args[5].tolist() == [0]
    args, kwargs = gg._kernel_args(a, B, offs, out, gg.GROUPED16_DEFAULT_CONFIG)
    assert kwargs["PACE"] == 0 and args[5] is offs  # unused pointer
    assert gg.default_launch_config(4096 * 8, 4096, 8, 132, torch.bfloat16).pace == 1
    monkeypatch.setenv(gg.PACE_ENV, "3")
    assert gg.pace_default() == 3 and gg.default_launch_config(300, 128, 2, 132, torch.bfloat16).pace == 3
    monkeypatch.setenv(gg.PACE_ENV, "0")
    assert gg.default_launch_config(4096 * 8, 4096, 8, 132, torch.bfloat16) == gg.GROUPED16_DEFAULT_CONFIG
    for bad in ("9", "yes", "-1"):
        monkeypatch.setenv(gg.PACE_ENV, bad)
        with pytest.raises(ValueError, match=f"{gg.PACE_ENV}={bad!r}"):
            gg.pace_default()


def test_large_problem_rule():
    """The 16-bit default's large-problem rule: >= 2048 rows per group (mean), >= 2e11 multiply-adds,
    N and K multiples of 256 with min >= 1536 and max >= 4096; symmetric in N and K (the grad_input
    GEMM swaps them); and the op keeps the dispatcher's route under autograd for those problems."""
    from primus_turbo.pytorch.backends import grouped_gemm as be

    rule = be.gluon16_large_preferred
    yes = [(32 * 2048, 4096, 7168, 32), (8 * 4096, 28672, 4096, 8), (8 * 4096, 4096, 14336, 8),
           (16 * 2048, 3072, 4096, 16), (16 * 2048, 4096, 1536, 16), (8 * 2048, 4096, 7168, 8)]
    no = [(64 * 512, 4096, 7168, 64),   # 512 rows per group
          (2048, 4096, 14336, 1),       # 1.2e11 multiply-adds
          (4 * 2048, 3072, 4096, 4),    # 1.0e11
          (16 * 2048, 2880, 5760, 16),  # N not a multiple of 256
          (16 * 2048, 4096, 1280, 16),  # the smaller of N and K under 1536
          (16 * 4096, 3072, 3072, 16),  # the larger under 4096
          (0, 4096, 4096, 0)]
    assert all(rule(*c) for c in yes) and not any(rule(*c) for c in no)
    assert all(rule(m, k, n, g) == rule(m, n, k, g) for m, n, k, g in yes + no)
    assert all(be.gluon16_preferred(*c) for c in yes)


def test_mid_problem_rule(monkeypatch):
    """The mid-size rule (at least two experts, N >= 2880, K >= 1536, >= 5e10 multiply-adds; kept for
    the record and its callers); the dispatcher's default no longer asks the size rules: on sm_90
    (mocked) it takes the Gluon kernel wherever that runs, whatever they say."""
    from primus_turbo.pytorch.backends import grouped_gemm as be
    from primus_turbo.pytorch.core.backend import BackendType

    rule = be.gluon16_mid_preferred
    yes = [(4096, 4096, 7168, 8), (4096, 7168, 2048, 8), (8192, 3072, 4096, 16), (8192, 4096, 1536, 4),
           (8192, 5760, 2880, 4), (4096, 5760, 2880, 2)]
    no = [(2048, 4096, 14336, 1),   # one expert
          (16384, 1536, 2048, 8),   # N under 2880 (Qwen3-30B-A3B)
          (32768, 2048, 768, 16),   # and K under 1536
          (2048, 5760, 2880, 4),    # 3.4e10 multiply-adds
          (0, 4096, 4096, 0)]
    assert all(rule(*c) for c in yes) and not any(rule(*c) for c in no)
    fake_platform(monkeypatch, gg)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(be, "GLUON16_SMALL_MAX_MNK", 100.0)
    monkeypatch.setattr(be, "GLUON16_SMALL_MAX_MNK_SHORT_K", 100.0)
    a, B, _dy, offs = _operands([40, 0, 100], 128, 64, "cpu")
    kw = dict(a=a, b=B, group_lens=offs[1:] - offs[:-1], group_offs=offs)
    monkeypatch.setattr(be, "gluon16_mid_preferred", lambda *s: False)
    assert be._default(**kw) == BackendType.GLUON
    monkeypatch.setenv(gg.GLUON_GROUPED_ENV, "0")
    assert be._default(**kw) != BackendType.GLUON


def test_default_config_rule_small_groups():
    """128 x 128 tiles where an average group has at most half a wave of 128 x 256 tiles (the H200
    rows of the rule's comment), 128 x 256 everywhere else."""
    small, big = gg.GROUPED16_SMALL_GROUPS_CONFIG, gg.GROUPED16_DEFAULT_CONFIG
    assert small.check(2) is None and gg.fitted_config(small, torch.float32).check(4) is None
    rule = gg.default_grouped16_config
    assert rule(64 * 512, 4096, 64, 132) is small  # DeepSeek-V3 EP4 gate_up forward: 64 tiles
    assert rule(64 * 512, 2048, 64, 132) is small  # its down GEMM's dgrad
    assert rule(128 * 1024, 2048, 128, 132) is small  # Qwen3-30B-A3B down: 64 tiles per group
    assert rule(128 * 1024, 768, 128, 132) is small
    assert rule(64 * 512, 7168, 64, 132) is big  # EP4 down forward / gate_up dgrad: 112 tiles per group
    assert rule(64 * 512, 4097, 64, 132) is big  # one column past 4096: 68 tiles, over half of 132
    assert rule(64 * 1024, 4096, 64, 132) is big  # 1024 rows: 128 tiles, about a wave
    assert rule(32 * 2048, 4096, 32, 132) is big
    assert rule(64 * 512, 4096, 64, 66) is big  # half the SMs: a group fills their wave
    assert rule(0, 4096, 64, 132) is small and rule(100, 4096, 0, 132) is big


@needs_gluon
def test_m_operand_reasons():
    a, B, _, offs = _operands([40, 0, 100], 128, 64, "cpu")
    assert gg.gluon_grouped_operand_reason(a, B, offs) is None  # K-major weight view
    assert gg.gluon_grouped_operand_reason(a, B.contiguous(), offs) is None  # N-major
    assert gg.gluon_grouped_operand_reason(a, B, None) is None  # offsets derived by the caller
    cases = [
        (dict(a=a.float(), b=B.float()), "bfloat16 or float16"),
        (dict(b=B.half()), "bfloat16 or float16"),
        (dict(a=a[:, :32]), "K mismatch"),
        (dict(a=a.t().contiguous().t()), "K-contiguous"),
        (dict(a=torch.randn(140, 68).to(torch.bfloat16)[:, :64]), "16-byte aligned"),
        (dict(b=torch.randn(3, 64, 132).to(torch.bfloat16)[:, :, :128]), "K- or N-contiguous"),  # rows: 264 bytes
        (dict(group_offs=offs.int()), "int64 [G+1]"),
        (dict(group_offs=offs[:-1]), "int64 [G+1]"),
        (dict(b=B.contiguous()[:, :, :124]), "16-byte aligned for the TMA store"),  # rows 248 bytes, out 248
        (dict(out_dtype=torch.float16), "must be the operands'"),
    ]
    for over, match in cases:
        kw = {**dict(a=a, b=B, group_offs=offs), **over}
        reason = gg.gluon_grouped_operand_reason(**kw)
        assert reason is not None and match in reason, (over.keys(), reason)
    assert gg.gluon_grouped_operand_reason(a, B, offs, torch.float32) is None
    reason = gg.gluon_grouped_reason(a, B, offs)
    assert "cpu" in reason and "sm_90" in reason, reason
    with pytest.raises(ValueError, match="grouped_gemm_gluon"):
        gg.grouped_gemm_gluon(a, B, offs)


@needs_gluon
def test_variable_k_operand_reasons():
    x = torch.randn(300, 128).to(torch.bfloat16)
    y = torch.randn(300, 200).to(torch.bfloat16)
    offs = _offsets([100, 0, 150], "cpu")
    assert vk.gluon_variable_k_operand_reason(x, y, offs) is None
    out32 = torch.zeros(3, 128, 200)
    cases = [
        (dict(x=x[:, :96]), "multiple of 64"),
        (dict(y=y.half()), "bfloat16 or float16"),
        (dict(y=y[:200]), "x must be [M_total, P]"),
        (dict(x=x.t().contiguous().t()), "row-major"),
        (dict(y=torch.randn(300, 204).to(torch.bfloat16)[:, :196]), "row-major"),  # rows of 408 bytes
        (dict(accumulate=True), "accumulate=True needs out"),
        (dict(out=out32.to(torch.bfloat16), accumulate=True), "out must be float32"),
        (dict(out=torch.zeros(3, 128 + 64, 200)[:, :128]), "experts stacked"),
        (dict(out=torch.zeros(4, 128, 200)), "expected [G, P, Q]"),
        (dict(out_dtype=torch.float16), "must be the operands'"),
        (dict(group_offs=offs.int()), "int64 [G+1]"),
    ]
    for over, match in cases:
        kw = {**dict(x=x, y=y, group_offs=offs), **over}
        reason = vk.gluon_variable_k_operand_reason(**kw)
        assert reason is not None and match in reason, (over.keys(), reason)
    assert vk.gluon_variable_k_operand_reason(x, y, offs, out=out32, accumulate=True) is None
    assert vk.gluon_variable_k_operand_reason(x, y, offs, out=torch.zeros(3, 128, 208)[:, :, :200]) is None
    with pytest.raises(ValueError, match="grouped_gemm_variable_k_gluon"):
        vk.grouped_gemm_variable_k_gluon(x, y, offs)


# ---------------------------------------------------------------------------------------------
# CPU: the TRITON backend's rule
# ---------------------------------------------------------------------------------------------
@needs_gluon
def test_triton_backend_takes_gluon_where_it_can(monkeypatch):
    """With the platform mocked as sm_90 (and tensors that claim CUDA), the TRITON backends call
    the Gluon launchers unless PRIMUS_TURBO_GROUPED_GEMM_GLUON=0 or the reason says no."""
    from primus_turbo.pytorch.backends import grouped_gemm as be
    from primus_turbo.triton import is_interpreter
    from primus_turbo.triton.grouped_gemm import grouped_gemm_kernel as tlk

    if not is_interpreter():
        # the "offsets derived" calls launch the real offsets kernel on the CPU tensors that claim
        # CUDA, which only the interpreter runs (failed on the H200 host, 2026-12-02); GPU hosts test
        # the real routes in test_op_triton_backend_runs_gluon
        pytest.skip("mocks CUDA tensors on CPU: needs the Triton interpreter (TRITON_INTERPRET=1)")

    fake_platform(monkeypatch, gg)
    fake_platform(monkeypatch, vk)
    calls = []
    monkeypatch.setattr(gg, "grouped_gemm_gluon", lambda *a, **k: calls.append("gluon") or "g")
    monkeypatch.setattr(vk, "grouped_gemm_variable_k_gluon", lambda *a, **k: calls.append("gluon_vk") or "gv")
    monkeypatch.setattr(tlk, "grouped_gemm_triton", lambda *a, **k: calls.append("tl") or "t")
    monkeypatch.setattr(tlk, "grouped_gemm_variable_k_triton", lambda *a, **k: calls.append("tl_vk") or "tv")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    a, B, dy, offs = _operands([40, 0, 100], 128, 64, "cpu")
    lens = offs[1:] - offs[:-1]
    var = gg.GLUON_GROUPED_ENV
    for value, expect in ((None, "g"), ("auto", "g"), ("1", "g"), ("0", "t")):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        assert be.GroupedGemmTritonBackend.execute(a, B, lens, offs) == expect, value
        assert be.GroupedGemmTritonBackend.execute(a, B, lens, None) == expect, value  # offsets derived
        assert be.GroupedGemmVariableKTritonBackend.execute(dy, a, lens, offs) == expect + "v", value
    monkeypatch.delenv(var, raising=False)
    # what the Gluon kernels do not take goes to the tl kernels
    assert be.GroupedGemmTritonBackend.execute(a.float(), B.float(), lens, offs) == "t"
    assert be.GroupedGemmVariableKTritonBackend.execute(dy, a, lens, offs, out=torch.zeros(3, 128, 64,
                                                        dtype=torch.bfloat16), accumulate=True) == "tv"
    assert be.GroupedGemmVariableKTritonBackend.execute(dy, a, lens, offs, out=torch.zeros(3, 128, 64),
                                                        accumulate=True) == "gv"
    assert be.GroupedGemmVariableKTritonBackend.execute(dy[:, :96], a, lens, offs) == "tv"  # P % 64
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=var):
        gg.gluon_grouped_enabled()


@needs_gluon
def test_gluon_backends_and_the_small_problem_default(monkeypatch):
    """The GLUON backends of both 16-bit dispatchers (platform mocked as sm_90, tensors claiming
    CUDA): the M-grouped default takes GLUON wherever it can run and launches the kernel with its
    check skipped (already done); the switch at 0 and missing offsets do not reach it; the
    variable-K GLUON backend serves a family pin."""
    from primus_turbo.pytorch.backends import grouped_gemm as be
    from primus_turbo.pytorch.core.backend import BackendType, PrecisionType

    fake_platform(monkeypatch, gg)
    fake_platform(monkeypatch, vk)
    calls = []
    monkeypatch.setattr(gg, "grouped_gemm_gluon", lambda *a, **k: calls.append(k) or "g")
    monkeypatch.setattr(vk, "grouped_gemm_variable_k_gluon", lambda *a, **k: "gv")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    a, B, dy, offs = _operands([40, 0, 100], 128, 64, "cpu")
    lens = offs[1:] - offs[:-1]
    kw = dict(a=a, b=B, group_lens=lens, group_offs=offs)
    assert be.grouped_gemm_dispatcher.backends[BackendType.GLUON] is be.GroupedGemmGluonBackend
    assert be.grouped_gemm_variable_k_dispatcher.backends[BackendType.GLUON] is be.GroupedGemmVariableKGluonBackend
    assert be._default(**kw) == BackendType.GLUON
    assert be.grouped_gemm_dispatcher.dispatch(PrecisionType.BF16_FP16_FP32, **kw) == "g"
    assert calls[-1]["checked"] is True
    assert [be.gluon16_small_preferred(*s) for s in ((4096, 2048, 768), (16384, 2048, 768), (4096, 4096, 1536),
                                                      (4096, 1536, 2048), (8192, 1536, 2048), (4096, 2880, 2880),
                                                      (1024, 4096, 14336))] == [True, True, True, True, False,
                                                                                False, False]
    monkeypatch.setattr(be, "GLUON16_SMALL_MAX_MNK", 100.0)
    monkeypatch.setattr(be, "GLUON16_SMALL_MAX_MNK_SHORT_K", 100.0)
    assert be._default(**kw) == BackendType.GLUON  # the size rules no longer gate the default
    monkeypatch.undo()
    fake_platform(monkeypatch, gg)
    fake_platform(monkeypatch, vk)
    monkeypatch.setattr(vk, "grouped_gemm_variable_k_gluon", lambda *a, **k: "gv")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert "group_offs" in be.GroupedGemmGluonBackend.why_not(**dict(kw, group_offs=None))
    assert "num_cu" in be.GroupedGemmGluonBackend.why_not(**kw, num_cu=0)
    assert be.GroupedGemmVariableKGluonBackend.why_not(x=dy, y=a, group_lens=lens, group_offs=offs) is None
    assert be.GroupedGemmVariableKGluonBackend.execute(dy, a, lens, offs) == "gv"
    monkeypatch.setenv(gg.GLUON_GROUPED_ENV, "0")
    assert be._default(**kw) != BackendType.GLUON
    assert gg.GLUON_GROUPED_ENV in be.GroupedGemmGluonBackend.why_not(**kw)
    assert gg.GLUON_GROUPED_ENV in be.GroupedGemmVariableKGluonBackend.why_not(x=dy, y=a, group_lens=lens,
                                                                               group_offs=offs)


def test_gluon_pin_of_16bit_grouped_gemm_raises_on_cpu():
    """A GLUON pin on inputs the Gluon kernel cannot run raises ValueError naming the backend."""
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
    from primus_turbo.pytorch.ops.grouped_gemm import grouped_gemm

    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    a, B, _, offs = _operands([8, 8], 64, 32, "cpu")
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.GLUON)
    try:
        with pytest.raises(ValueError, match="GLUON"):
            grouped_gemm(a, B.transpose(1, 2).contiguous(), offs[1:] - offs[:-1], offs, trans_b=True)
    finally:
        GlobalBackendManager.reset()


@sm90_gpu
@pytest.mark.parametrize("lens", [[1024, 1024, 1024, 1024], [700, 0, 1300, 31], [4096]])
def test_small_problem_default_and_gluon_pin_match_reference(lens):
    """On the GPU: the no-grad default of a small problem runs the GLUON backend and matches the
    reference (zero tail rows); a family GLUON pin runs forward, dgrad and wgrad on the Gluon
    kernels and matches the vendor route."""
    from primus_turbo.pytorch.backends import grouped_gemm as be
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
    from primus_turbo.pytorch.ops.grouped_gemm import grouped_gemm

    N, K = 2048, 768
    a, B, dy, offs = _operands(lens, N, K, "cuda", tail=5)
    w = B.transpose(1, 2).contiguous()  # [G, N, K]
    glens = offs[1:] - offs[:-1]
    kw = dict(a=a, b=w.transpose(1, 2), group_lens=glens, group_offs=offs)
    assert be.grouped_gemm_dispatcher.resolve(PrecisionType.BF16_FP16_FP32, **kw) is be.GroupedGemmGluonBackend
    with torch.no_grad():
        out = grouped_gemm(a, w, glens, offs, trans_b=True)
    assert torch.all(out[sum(lens):] == 0)
    assert _snr(_ref_fwd(a, B, lens), out) >= MIN_SNR[torch.bfloat16]

    def step():
        x = a.detach().clone().requires_grad_()
        ww = w.detach().clone().requires_grad_()
        y = grouped_gemm(x, ww, glens, offs, trans_b=True)
        y.backward(dy.nan_to_num())
        return y.detach(), x.grad, ww.grad

    ref = step()
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.GLUON)
    try:
        got = step()
    finally:
        GlobalBackendManager.reset()
    for r, g in zip(ref, got):
        assert _snr(r.double(), g) >= MIN_SNR[torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# CPU: sm_90 compile
# ---------------------------------------------------------------------------------------------
@needs_gluon
@pytest.mark.parametrize("variant", _script().COMPILE_VARIANTS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("config", ["n256k64s4", "n128k64s6", "n256k64s3e256p2"])
def test_compiles_for_sm90_without_spills(variant, config, request):
    """Every kernel variant (M-grouped with K- / N-major B, bf16 and fp16; variable-K with 16-bit
    or fp32 output and the fp32 reduce-add): no spills, no serialized wgmmas, shared memory within
    sm_90's, 4 wgmmas per warpgroup per 64-deep K block, the TMA loads / stores expected."""
    if rerun_outside_interpreter(request):
        return
    kind, dt, odt, kmajor, acc = variant
    if kind != "m" and "p" in config[1:]:
        pytest.skip("pace is an option of the M-grouped kernel only")
    torch_out = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[odt]
    cfg = gg.fitted_config(gg.GluonGroupedConfig.parse(config), torch_out)
    try:
        r = _script().compile_config(cfg, kind, dt, odt, kmajor, acc)
    except FileNotFoundError as exc:
        pytest.skip(f"ptxas not available: {exc}")
    assert r["spill_bytes"] == 0 and not r["serialized"] and r["shared"] <= 232448, r
    counts = r["sass_counts"]
    if not any(counts.values()):
        pytest.skip("cuobjdump not available: no SASS to count")
    assert counts["wgmma"] == 8 and counts["local_store"] == 0 and counts["local_load"] == 0, counts
    n_major = kind == "vk" or not kmajor  # B boxes of 64 columns each (one 128-byte swizzle row)
    assert counts["tma_load"] == 2 + (cfg.block_n // 64 if n_major else 1), counts
    stores = 2 * (cfg.block_n // cfg.epi_n)
    assert (counts["tma_reduce"], counts["tma_store"]) == ((stores, 0) if acc else (0, stores)), counts
    ty = {"bf16": "bf16", "fp16": "f16"}[dt]
    wgmma = "m64n%dk16.f32.%s.%s" % (cfg.block_n, ty, ty)
    assert wgmma in r["ptx"], wgmma
    # no scalar crossing lanes through shared memory in the producer (pacing's first form did); the
    # pacing counter is polled by a volatile load in every lane
    if kind == "m":
        assert "st.shared.b32" not in r["ptx"]
    if cfg.pace:
        assert "ld.volatile.global" in r["ptx"] and "atom.global.gpu.relaxed.add" in r["ptx"]


@needs_gluon
@pytest.mark.parametrize("kmajor", [True, False])
def test_m_launcher_arguments_bind_and_compile_for_sm90(kmajor, monkeypatch, request):
    """The launcher's own arguments (3-D weight descriptor of either layout, output pointer and
    descriptor, offsets) bind and compile for sm_90 with a stand-in driver."""
    if rerun_outside_interpreter(request):
        return
    a, B, _, offs = _operands([100, 0, 300], 192, 136, "cpu", tail=5, kmajor=kmajor)
    out = torch.empty(a.shape[0], 192, dtype=torch.bfloat16)
    args, kwargs = gg._kernel_args(a, B, offs, out, gg.GROUPED16_DEFAULT_CONFIG)
    assert kwargs["B_KMAJOR"] is kmajor
    kernel = warmup_for_sm90(gg._grouped_gemm_gluon_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.shared <= 232448 and kernel.metadata.num_warps == 12


@needs_gluon
@pytest.mark.parametrize("accumulate", [False, True])
def test_vk_launcher_arguments_bind_and_compile_for_sm90(accumulate, monkeypatch, request):
    if rerun_outside_interpreter(request):
        return
    x = torch.randn(400, 192).to(torch.bfloat16)
    y = torch.randn(400, 136).to(torch.bfloat16)
    offs = _offsets([100, 0, 290], "cpu")
    out = torch.zeros(3, 192, 136, dtype=torch.float32 if accumulate else torch.bfloat16)
    cfg = gg.fitted_config(vk.VARIABLE_K16_DEFAULT_CONFIG, out.dtype)
    args, kwargs = vk._kernel_args(x, y, offs, out, cfg, accumulate)
    assert list(args[2].shape) == [3 * 192, 136]
    kernel = warmup_for_sm90(vk._grouped_gemm_variable_k_gluon_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.shared <= 232448 and kernel.metadata.num_warps == 12


def _capture_launches(monkeypatch, module):
    """Records the launches of ``module`` (its generic and keyed entries) instead of running them."""
    calls = []
    monkeypatch.setattr(module, "launch", lambda fn, grid, args, kw, dev: calls.append((None, grid, args, kw)))
    monkeypatch.setattr(module, "launch_keyed",
                        lambda fn, grid, args, kw, dev, key: calls.append((key, grid, args, kw)))
    monkeypatch.setattr(gg._dense, "_num_sms", lambda device: 132)
    return calls


@needs_gluon
@pytest.mark.parametrize("kmajor", [True, False])
def test_m_launch_plan_is_kept_per_signature(kmajor, monkeypatch):
    """The M-grouped launcher's host path (platform mocked as sm_90, launches recorded): the first
    call of a signature validates and plans, repeats reuse the plan with a keyed launch whose
    descriptors carry the new tensors; a different alignment, shape, pacing setting or a bad input
    makes its own plan (or raises, every time)."""
    fake_platform(monkeypatch, gg)
    calls = _capture_launches(monkeypatch, gg)
    planned = []
    real_plan = gg._plan
    monkeypatch.setattr(gg, "_plan", lambda *a: planned.append(1) or real_plan(*a))
    gg._PLANS.clear()
    a, B, _, offs = _operands([100, 0, 300], 192, 136, "cpu", tail=5, kmajor=kmajor)
    out1 = gg.grouped_gemm_gluon(a, B, offs)
    a2 = torch.randn_like(a)
    out2 = gg.grouped_gemm_gluon(a2, B, offs)
    assert len(planned) == 1 and len(calls) == 2
    (k1, grid1, args1, kw1), (k2, grid2, args2, kw2) = calls
    assert k1 is not None and k1 == k2 and grid1 == grid2 and kw1 == kw2 and kw1["B_KMAJOR"] is kmajor
    cfg = gg.default_launch_config(a.shape[0], 192, 3, 132, torch.bfloat16)
    assert grid1 == (min(132, (-(-a.shape[0] // cfg.BLOCK_M) + 4) * -(-192 // cfg.block_n)),)
    a_d, b_d, c_d = args2[:3]
    assert a_d.base is a2 and list(a_d.block_shape) == [64, cfg.block_k] and a_d.shape == list(a.shape)
    assert c_d.base is out2 and out2.shape == (a.shape[0], 192) and out2 is not out1
    assert list(b_d.block_shape) == ([1, cfg.block_n, cfg.block_k] if kmajor else [1, cfg.block_k, cfg.block_n])
    assert b_d.strides == list((B.transpose(1, 2) if kmajor else B).stride())
    assert args2[3:] == (out2, offs, offs, a.shape[0], 192, 136, 3, 192)
    # another signature: a misaligned view of a
    buf = torch.randn(a.numel() + 8, dtype=a.dtype)
    a_mis = buf[4:4 + a.numel()].view(a.shape)
    with pytest.raises(ValueError, match="16-byte"):
        gg.grouped_gemm_gluon(a_mis, B, offs)
    with pytest.raises(ValueError, match="16-byte"):
        gg.grouped_gemm_gluon(a_mis, B, offs)
    assert len(planned) == 3 and len(calls) == 2
    monkeypatch.setenv(gg.PACE_ENV, "2")
    gg.grouped_gemm_gluon(a, B, offs)
    assert len(planned) == 4 and calls[-1][0] != k1 and calls[-1][3]["PACE"] == 2
    assert calls[-1][2][5] is not offs and calls[-1][2][5].dtype == torch.int32  # a fresh pacing counter
    monkeypatch.delenv(gg.PACE_ENV)
    # empty problems: planned once, no launch
    empty = gg.grouped_gemm_gluon(a[:0], B, offs)
    assert empty.shape == (0, 192) and len(calls) == 3
    out = torch.full((a.shape[0], 192), float("nan"), dtype=a.dtype)
    gg.grouped_gemm_gluon(a[:, :0], B[:, :0], offs, out=out)
    assert (out == 0).all()


@needs_gluon
def test_vk_launch_plan_is_kept_per_signature(monkeypatch):
    """The variable-K launcher's host path, as the M-grouped one's."""
    fake_platform(monkeypatch, vk)
    calls = _capture_launches(monkeypatch, gg)  # both launchers launch through gg.planned_launch
    planned = []
    real_plan = vk._plan
    monkeypatch.setattr(vk, "_plan", lambda *a: planned.append(1) or real_plan(*a))
    gg._PLANS.clear()
    x = torch.randn(400, 192).to(torch.bfloat16)
    y = torch.randn(400, 136).to(torch.bfloat16)
    offs = _offsets([100, 0, 290], "cpu")
    o1 = vk.grouped_gemm_variable_k_gluon(x, y, offs)
    o2 = vk.grouped_gemm_variable_k_gluon(torch.randn_like(x), y, offs)
    assert len(planned) == 1 and len(calls) == 2 and calls[0][0] == calls[1][0] is not None
    assert o1.shape == o2.shape == (3, 192, 136) and o1 is not o2
    cfg = gg.fitted_config(vk.VARIABLE_K16_DEFAULT_CONFIG, torch.bfloat16)
    _key, grid, args, kw = calls[1]
    assert grid == (min(132, 3 * -(-192 // cfg.BLOCK_M) * -(-136 // cfg.block_n)),)
    assert kw["ACCUMULATE"] is False and list(args[2].shape) == [3 * 192, 136] and args[2].base.data_ptr() == \
        o2.data_ptr()
    assert args[3:] == (offs, 400, 192, 136, 3)
    acc = torch.zeros(3, 192, 136)
    vk.grouped_gemm_variable_k_gluon(x, y, offs, out=acc, accumulate=True)
    assert len(planned) == 2 and calls[-1][3]["ACCUMULATE"] is True
    with pytest.raises(ValueError, match="multiple of 64"):
        vk.grouped_gemm_variable_k_gluon(x[:, :100], y, offs)
    nan = torch.full((3, 192, 136), float("nan"), dtype=torch.bfloat16)
    vk.grouped_gemm_variable_k_gluon(x[:0], y[:0], offs, out=nan)
    assert (nan == 0).all() and len(calls) == 3


# ---------------------------------------------------------------------------------------------
# GPU: correctness
# ---------------------------------------------------------------------------------------------
LENS = {
    "balanced": [512, 512, 512, 512],
    "unbalanced": [0, 1000, 37, 0, 333, 1],
    "small": [5, 0, 63, 64, 65, 0, 128, 17],
}


@sm90_gpu
@pytest.mark.parametrize("pattern", list(LENS))
@pytest.mark.parametrize("N,K", [(256, 512), (192, 136), (384, 72)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kmajor", [True, False])
@pytest.mark.parametrize("config", [None, "n128k64s5", "n128k64s6", "n256k64s3e256"])
def test_m_grouped_matches_reference(pattern, N, K, dtype, kmajor, config):
    lens = LENS[pattern]
    a, B, _, offs = _operands(lens, N, K, "cuda", dtype, tail=7, kmajor=kmajor)
    cfg = gg.GluonGroupedConfig.parse(config) if config else None
    assert gg.gluon_grouped_reason(a, B, offs) is None
    out = torch.full((a.shape[0], N), float("nan"), device="cuda", dtype=dtype)
    res = gg.grouped_gemm_gluon(a, B, offs, config=cfg, out=out)
    assert res is out
    assert torch.all(out[sum(lens):] == 0), "rows past offs[G] must be zero"
    assert _snr(_ref_fwd(a, B, lens), out) >= MIN_SNR[dtype], (pattern, N, K)
    assert torch.equal(gg.grouped_gemm_gluon(a, B, offs, config=cfg), out)  # bitwise repeatable
    few = gg.grouped_gemm_gluon(a, B, offs, config=cfg, num_programs=3)
    assert torch.equal(few, out)


@sm90_gpu
@pytest.mark.timeout(300)  # the child compiles six kernels; its own limit is 240 s
def test_m_grouped_paced_is_bit_equal():
    """Pacing changes when tiles start, never what they compute: bit-equal to the unpaced kernel
    (balanced, empty / tiny and many groups; K- and N-major weights; pace 1 and 2; the default
    grid and 3 programs, i.e. with waits), the counter ending at the tiles started. Runs in a child
    process under a timeout (tests/triton/paced_grouped_child.py): a hang fails here instead of
    wedging this worker's CUDA context."""
    import subprocess
    import sys
    from pathlib import Path

    child = Path(__file__).with_name("paced_grouped_child.py")
    try:
        r = subprocess.run([sys.executable, str(child)], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the paced kernel did not finish in 240 s")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-2000:]


@sm90_gpu
@pytest.mark.parametrize("pattern", list(LENS))
@pytest.mark.parametrize("P,Q", [(256, 512), (192, 200), (64, 136)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [None, "n128k64s6"])
def test_variable_k_matches_reference(pattern, P, Q, dtype, config):
    """Any group offsets (the last token block of a group reloads earlier rows and zeroes them),
    NaN rows past offs[G] never read, empty groups zero."""
    lens = LENS[pattern]
    M = sum(lens) + 9
    x = torch.randn(M, P, device="cuda").to(dtype)
    y = torch.randn(M, Q, device="cuda").to(dtype)
    x[sum(lens):] = float("nan")
    y[sum(lens):] = float("nan")
    offs = _offsets(lens, "cuda")
    cfg = gg.GluonGroupedConfig.parse(config) if config else None
    assert vk.gluon_variable_k_reason(x, y, offs) is None
    out = torch.full((len(lens), P, Q), float("nan"), device="cuda", dtype=dtype)
    res = vk.grouped_gemm_variable_k_gluon(x, y, offs, out=out, config=cfg)
    assert res is out
    for g, n in enumerate(lens):
        if n == 0:
            assert torch.all(out[g] == 0), f"empty group {g} must be zero"
    assert _snr(_ref_wgrad(x, y, lens), out) >= MIN_SNR[dtype], (pattern, P, Q)
    assert torch.equal(vk.grouped_gemm_variable_k_gluon(x, y, offs, config=cfg), out)


# rows of the poisoned groups: (x / a value, y / dy value); each kernel must keep them out of the
# other groups' results (0 * Inf and 0 * NaN are NaN: zeroing one operand of a row is not enough)
POISONS = {"inf_nan": (float("inf"), float("nan")), "nan_neginf": (float("nan"), float("-inf"))}


def _poisoned_lens(short):
    """Group sizes: a short group first (its block reaches before row 0), a poisoned group, the
    short group right after it (its last block reloads the poisoned rows), another poisoned group
    right after it, a clean multi-block group with a partial last block, and a poisoned last group.
    Returns (lens, poisoned group indices)."""
    return [short, 100, short, 70, 130, 41], (1, 3, 5)


@sm90_gpu
@pytest.mark.parametrize("short", [5, 17, 63])
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [None, "n128k64s6", "n64k32s4"])
def test_variable_k_short_group_ignores_other_groups_inf_nan(short, poison, dtype, config):
    """A group shorter than a token block next to groups whose rows hold Inf / NaN in both x and
    y: its last block reloads those rows and must zero them in both operands (zeroing x alone
    gives 0 * Inf = NaN in this expert's gradient). Every clean group finite and >= the SNR bar
    against the fp32 reference of its own rows."""
    lens, bad = _poisoned_lens(short)
    P, Q = 128, 256
    x = torch.randn(sum(lens), P, device="cuda").to(dtype)
    y = torch.randn(sum(lens), Q, device="cuda").to(dtype)
    offs = _offsets(lens, "cuda")
    vx, vy = POISONS[poison]
    for g in bad:
        rows = slice(sum(lens[:g]), sum(lens[:g + 1]))
        x[rows] = vx
        y[rows] = vy
    cfg = gg.GluonGroupedConfig.parse(config) if config else None
    assert vk.gluon_variable_k_reason(x, y, offs) is None
    out = vk.grouped_gemm_variable_k_gluon(x, y, offs, config=cfg)  # x's dtype
    ref = _ref_wgrad(x, y, lens)
    for g, n in enumerate(lens):
        if g in bad:
            continue
        assert torch.isfinite(out[g]).all(), f"group {g} ({n} tokens) took another group's Inf / NaN"
        assert _snr(ref[g], out[g]) >= MIN_SNR[dtype], (g, n)
    c0 = torch.randn(len(lens), P, Q, device="cuda")
    acc = c0.clone()
    cfg32 = gg.fitted_config(cfg or vk.VARIABLE_K16_DEFAULT_CONFIG, torch.float32)  # fp32 staging fits
    vk.grouped_gemm_variable_k_gluon(x, y, offs, out=acc, accumulate=True, config=cfg32)
    for g in range(len(lens)):
        if g not in bad:
            assert torch.isfinite(acc[g]).all() and _snr(ref[g] + c0[g].double(), acc[g]) >= 60.0, g


@sm90_gpu
@pytest.mark.parametrize("short", [5, 17, 63])
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("kmajor", [True, False])
def test_m_grouped_short_group_ignores_other_groups_inf_nan(short, poison, kmajor):
    """The forward: a group's output rows come from its own rows of a only (a tile's rows of the
    neighbouring groups, here Inf / NaN, are separate rows of the MMA and never stored)."""
    lens, bad = _poisoned_lens(short)
    a, B, _, offs = _operands(lens, 256, 136, "cuda", torch.bfloat16, tail=7, kmajor=kmajor)
    vx, _ = POISONS[poison]
    for g in bad:
        a[sum(lens[:g]):sum(lens[:g + 1])] = vx
    out = gg.grouped_gemm_gluon(a, B, offs)
    ref = _ref_fwd(a, B, lens)
    assert torch.all(out[sum(lens):] == 0), "rows past offs[G] must be zero"
    for g, n in enumerate(lens):
        if g in bad:
            continue
        rows = slice(sum(lens[:g]), sum(lens[:g + 1]))
        assert torch.isfinite(out[rows]).all(), f"group {g} ({n} rows) took another group's Inf / NaN"
        assert _snr(ref[rows], out[rows]) >= MIN_SNR[torch.bfloat16], (g, n)


@sm90_gpu
@pytest.mark.parametrize("pattern", ["balanced", "unbalanced"])
def test_variable_k_accumulates_into_fp32(pattern):
    lens = LENS[pattern]
    P, Q = 256, 384
    x = torch.randn(sum(lens), P, device="cuda").to(torch.bfloat16)
    y = torch.randn(sum(lens), Q, device="cuda").to(torch.bfloat16)
    offs = _offsets(lens, "cuda")
    c0 = torch.randn(len(lens), P, Q, device="cuda")
    out = c0.clone()
    assert vk.grouped_gemm_variable_k_gluon(x, y, offs, out=out, accumulate=True) is out
    for g, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[g], c0[g]), f"empty group {g} must be unchanged"
    ref = _ref_wgrad(x, y, lens)
    assert _snr(ref + c0.double(), out) >= 60.0
    vk.grouped_gemm_variable_k_gluon(x, y, offs, out=out, accumulate=True)
    assert _snr(2 * ref + c0.double(), out) >= 60.0


@sm90_gpu
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("fuse", [None, "megatron"])
def test_op_triton_backend_runs_gluon(trans_b, fuse, monkeypatch):
    """turbo.ops.grouped_gemm pinned to TRITON: the same forward and grads with the switch on
    (Gluon) and off (tl kernels), the Gluon launchers called when on."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

    G, N, K = 4, 384, 256
    lens = torch.tensor([300, 0, 451, 200], device="cuda")
    a0 = torch.randn(1000, K, device="cuda").to(torch.bfloat16)
    w0 = (torch.randn((G, N, K) if trans_b else (G, K, N), device="cuda") / 16).to(torch.bfloat16)
    dy = torch.randn(1000, N, device="cuda").to(torch.bfloat16)
    calls = []
    real_m, real_vk = gg.grouped_gemm_gluon, vk.grouped_gemm_variable_k_gluon
    monkeypatch.setattr(gg, "grouped_gemm_gluon", lambda *a, **k: calls.append("m") or real_m(*a, **k))
    monkeypatch.setattr(vk, "grouped_gemm_variable_k_gluon", lambda *a, **k: calls.append("vk") or real_vk(*a, **k))
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON)
    try:
        res = {}
        for value in ("0", "1"):
            monkeypatch.setenv(gg.GLUON_GROUPED_ENV, value)
            calls.clear()
            a = a0.clone().requires_grad_()
            w = w0.clone().requires_grad_()
            if fuse:
                w.main_grad = torch.zeros(w.shape, device="cuda")
            out = turbo.ops.grouped_gemm(a, w, lens, trans_b=trans_b, fuse_bgrad_accum_pattern=fuse)
            out.backward(dy)
            res[value] = (out, a.grad, w.main_grad if fuse else w.grad)
            assert calls == ([] if value == "0" else ["m", "m", "vk"]), (value, calls)
        for ref, got in zip(res["0"], res["1"]):
            assert _snr(ref.float(), got) >= 45.0
    finally:
        GlobalBackendManager.reset()


def test_flat_signature_bookkeeping_without_a_gpu(monkeypatch):
    """``fire`` / ``fast_miss`` with the CUDA side mocked (CPU CI): an output address without a
    kept launch launches nothing; the prepared launch of a miss is kept under the output's address
    with the plan's grid, and firing it calls its C entry with that grid; a launch hook, direct launches off or
    another current device decline the hit; at most ``_MAX_OUTS`` addresses are kept."""
    from types import SimpleNamespace

    from primus_turbo.triton import launch as L

    calls, prepared = [], []
    monkeypatch.setattr(L, "_call_entry", lambda entry, grid, index, args, tail: calls.append((entry, grid, index,
                                                                                                args)))
    monkeypatch.setattr(L, "_DIRECT", [True])
    hooks, current = [False], [0]
    monkeypatch.setattr(L, "no_launch_hooks", lambda: not hooks[0])
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)  # absent from CPU builds
    kernel = object()

    def fake_prepared(k, grid, args_fn, kwargs, device, key, ptrs):
        prepared.append(ptrs)
        L._PREPARED[(id(k), device.index, key, ptrs)] = (("launcher",), [7, ptrs[2]])

    monkeypatch.setattr(gg, "launch_prepared", fake_prepared)

    class Out:  # a tensor stand-in: its data pointer and device
        def __init__(self, ptr):
            self.ptr, self.device = ptr, SimpleNamespace(type="cuda", index=0)

        def data_ptr(self):
            return self.ptr

    hit = (SimpleNamespace(grid=(5,), kwargs={}), "key", {})

    def fire(out):  # what the launchers do on a _FAST hit
        return gg.fire(hit[2].get(out.data_ptr()), out.device.index)

    try:
        o = Out(1000)
        assert not fire(o) and not calls
        gg.fast_miss(kernel, hit, o, lambda: None, (1, 2, 1000, 3))
        assert prepared == [(1, 2, 1000, 3)] and list(hit[2]) == [1000]
        assert fire(o) and calls == [(("launcher",), (5,), 0, [7, 1000])]
        assert not fire(Out(1001))
        hooks[0] = True
        assert not fire(o)
        hooks[0] = False
        current[0] = 1
        assert not fire(o)
        current[0] = 0
        monkeypatch.setattr(L, "_DIRECT", [False])
        assert not fire(o) and len(calls) == 1
        for ptr in range(2000, 2000 + gg._MAX_OUTS + 3):
            gg.fast_miss(kernel, hit, Out(ptr), lambda: None, (1, 2, ptr, 3))
        assert 0 < len(hit[2]) <= gg._MAX_OUTS
    finally:
        for k in [k for k in L._PREPARED if k[0] == id(kernel)]:
            del L._PREPARED[k]


@sm90_gpu
def test_flat_signature_launches_follow_new_tensors(monkeypatch):
    """Both 16-bit launchers' flat-signature path (``gg._FAST``: calls that allocate their output):
    new operands of one signature, fresh outputs whose blocks held NaN, and launches with the
    direct path switched off all give the reference, tail rows zero; a repeat on the same tensors
    whose output lands on a kept address takes neither the plan nor the prepared launch."""
    from primus_turbo.triton import launch as L

    lens = [300, 0, 451, 200]
    gg._FAST.clear()
    prepared = []
    real = gg.launch_prepared
    monkeypatch.setattr(gg, "launch_prepared", lambda *args: prepared.append(1) or real(*args))

    def poisoned_fresh(shape, dtype):  # the next block of this size held NaN
        torch.full(shape, float("nan"), device="cuda", dtype=dtype)

    for rep in range(3):
        a, B, dy, offs = _operands(lens, 384, 256, "cuda", tail=7, kmajor=True)
        y = dy[:, :128].contiguous()
        ref_o, ref_w = _ref_fwd(a, B, lens), _ref_wgrad(a, y, lens)
        for _ in range(3):
            poisoned_fresh((a.shape[0], 384), a.dtype)
            o = gg.grouped_gemm_gluon(a, B, offs)
            assert torch.isfinite(o).all() and (o[-7:] == 0).all() and _snr(ref_o, o) >= MIN_SNR[torch.bfloat16]
            poisoned_fresh((len(lens), 256, 128), a.dtype)
            w = vk.grouped_gemm_variable_k_gluon(a, y, offs)
            assert torch.isfinite(w).all() and (w[1] == 0).all() and _snr(ref_w, w) >= MIN_SNR[torch.bfloat16]
            del o, w
    tags = {k[0] for k in gg._FAST}
    assert tags == {"m16", "vk16"}, tags
    assert all(not isinstance(v, torch.Tensor) for _p, _k, recs in gg._FAST.values() for rec, _grid in recs.values()
               for v in rec[1])
    o = gg.grouped_gemm_gluon(a, B, offs)
    del o
    n, planned = len(prepared), []
    monkeypatch.setattr(gg, "_plan", lambda *args: planned.append(1))
    o = gg.grouped_gemm_gluon(a, B, offs)  # the block just freed: a kept record
    assert len(prepared) == n and not planned
    assert _snr(ref_o, o) >= MIN_SNR[torch.bfloat16]
    monkeypatch.setattr(L, "_DIRECT", [False])  # Triton's own launch path, same results
    o2 = gg.grouped_gemm_gluon(a, B, offs)
    w2 = vk.grouped_gemm_variable_k_gluon(a, y, offs)
    assert torch.equal(o2, o) and _snr(ref_w, w2) >= MIN_SNR[torch.bfloat16]


@sm90_gpu
def test_prepared_launches_follow_the_pointers():
    """Both 16-bit launchers through their prepared launches (launch.launch_prepared): a signature's
    first call, repeats on the same tensors (a kept list), new tensors of the same signature and a
    recurring output block (the caching allocator's) all give the reference; the kept lists hold no
    tensor (freed operands are freed)."""
    from primus_turbo.triton import launch as L

    lens = [300, 0, 451, 200]
    # the references' first cuBLAS call allocates its workspace through the caching allocator (kept
    # for the process): make it before the count starts, so that only what the launches keep counts
    a, B, dy, offs = _operands(lens, 384, 256, "cuda", tail=7, kmajor=False)
    _snr(_ref_fwd(a, B, lens), gg.grouped_gemm_gluon(a, B, offs))
    y = dy[:, :128].contiguous()
    _snr(_ref_wgrad(a, y, lens), vk.grouped_gemm_variable_k_gluon(a, y, offs))
    del a, B, dy, offs, y
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for rep in range(4):
        a, B, dy, offs = _operands(lens, 384, 256, "cuda", tail=7, kmajor=rep % 2 == 0)
        for _ in range(2):
            out = torch.full((a.shape[0], 384), float("nan"), device="cuda", dtype=a.dtype)
            gg.grouped_gemm_gluon(a, B, offs, out=out)
            assert torch.isfinite(out).all() and _snr(_ref_fwd(a, B, lens), out) >= MIN_SNR[torch.bfloat16]
            fresh = gg.grouped_gemm_gluon(a, B, offs)  # a fresh output: the allocator's recurring block
            assert torch.equal(fresh, out)
            wg = vk.grouped_gemm_variable_k_gluon(a, dy[:, :128].contiguous(), offs)
            assert _snr(_ref_wgrad(a, dy[:, :128].contiguous(), lens), wg) >= MIN_SNR[torch.bfloat16]
        del a, B, dy, offs, out, fresh, wg
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    kept = [rec for key, rec in L._PREPARED.items()
            if key[0] in (id(gg._grouped_gemm_gluon_ws_kernel), id(vk._grouped_gemm_variable_k_gluon_ws_kernel))]
    assert kept and all(not isinstance(v, torch.Tensor) for rec in kept for v in rec[1])
