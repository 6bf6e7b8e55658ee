"""Smoke test of benchmarks/bench_moe_layer.py (CPU: the Triton interpreter; timings mean nothing)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.testing.bench_results import load_rows

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("triton")



def _has_moe_layer() -> bool:
    try:
        mod = importlib.import_module("primus_turbo.pytorch.modules")
    except Exception:
        return False
    return hasattr(mod, "MoELayer")


def test_cases_and_flops():
    bench = importlib.import_module("benchmarks.bench_moe_layer")
    cases = {c["model"]: c for c in bench.build_cases(bench.MOE_MODELS, bench.TOKENS)}
    ds = cases["DeepSeek-V3"]
    assert (ds["H"], ds["F"], ds["E"], ds["topk"], ds["T"]) == (7168, 2048, 32, 8, 16384)
    assert ds["case"] == "DeepSeek-V3:T16384:E32"
    for c in cases.values():
        assert 8 <= c["E"] <= 32, c
    m = 16384 * 8
    assert bench.expert_flops(16384, 8, 7168, 2048) == 3 * (2 * m * 7168 * 4096 + 2 * m * 2048 * 7168)
    smoke = bench.build_cases(bench.QUICK_MODELS, bench.QUICK_TOKENS, smoke=True)
    assert len(smoke) == 1 and smoke[0]["T"] <= 64 and smoke[0]["E"] <= 4
    assert smoke[0]["H"] % 16 == 0 and smoke[0]["F"] % 16 == 0


@pytest.mark.skipif(not _has_moe_layer(), reason="primus_turbo.pytorch.modules.MoELayer does not exist")
def test_bench_moe_layer_cpu_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.bench_moe_layer")
    rc = bench.main(["--cpu-smoke", "--quick", "--out", str(tmp_path), "--cases", "ignored-option"])
    assert rc == 0
    rows = load_rows(tmp_path, bench.RESULT_NAME)
    for r in rows:
        assert r["op"] == "moe_layer_fwd_bwd" and r["baseline"] == "torch-baseline"
        assert {"T", "H", "F", "E", "topk", "M", "flops"} <= set(r["extra"]), r
    assert {r["impl"] for r in rows} == {"torch-baseline", "turbo-bf16", "turbo-fp8-blockwise"}
    by = {r["impl"]: r for r in rows}
    for name in ("torch-baseline", "turbo-bf16"):
        r = by[name]
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["tflops"] > 0 and r["speedup"] > 0
    bf16 = by["turbo-bf16"]
    assert float(bf16["snr_db"]) > 20, bf16
    assert float(bf16["extra"]["snr_grad_x_db"]) > 20, bf16
    assert bf16["extra"]["routing_mismatch_tokens"] == 0
    fp8 = by["turbo-fp8-blockwise"]
    if fp8["error"] is None:
        assert float(fp8["snr_db"]) > 15, fp8
    assert (tmp_path / f"{bench.RESULT_NAME}.md").exists()


def test_parse_variant():
    bench = importlib.import_module("benchmarks.bench_moe_layer")
    assert bench.parse_variant("fused:A=1") == ("fused", {"A": "1"})
    assert bench.parse_variant("x:A=1,B=") == ("x", {"A": "1", "B": ""})
    for bad in ("fused", "fused:", ":A=1", "t:A", "t:=1", "a@b:A=1"):
        with pytest.raises(ValueError, match="--variant"):
            bench.parse_variant(bad)


@pytest.mark.skipif(not _has_moe_layer(), reason="primus_turbo.pytorch.modules.MoELayer does not exist")
def test_bench_moe_layer_variant_env(tmp_path, monkeypatch):
    """``impl@TAG`` rows run under the variant's environment, restored afterwards."""
    bench = importlib.import_module("benchmarks.bench_moe_layer")
    monkeypatch.delenv("PRIMUS_TURBO_BENCH_PROBE", raising=False)
    seen = []
    import primus_turbo.pytorch as turbo

    orig = turbo.modules.MoELayer.forward

    def spy(self, *a, **kw):
        import os

        seen.append(os.environ.get("PRIMUS_TURBO_BENCH_PROBE"))
        return orig(self, *a, **kw)

    monkeypatch.setattr(turbo.modules.MoELayer, "forward", spy)
    rc = bench.main(["--cpu-smoke", "--quick", "--out", str(tmp_path), "--impls", "turbo-bf16",
                     "--variant", "probe:PRIMUS_TURBO_BENCH_PROBE=7"])
    assert rc == 0
    by = {r["impl"]: r for r in load_rows(tmp_path, bench.RESULT_NAME)}
    assert set(by) == {"torch-baseline", "turbo-bf16", "turbo-bf16@probe"}
    assert by["turbo-bf16@probe"]["error"] is None and by["turbo-bf16@probe"]["ms"] > 0
    assert by["turbo-bf16@probe"]["extra"]["env"] == {"PRIMUS_TURBO_BENCH_PROBE": "7"}
    assert "7" in seen and None in seen
    import os

    assert "PRIMUS_TURBO_BENCH_PROBE" not in os.environ


@pytest.mark.skipif(not _has_moe_layer(), reason="primus_turbo.pytorch.modules.MoELayer does not exist")
def test_bench_moe_layer_microbatch_impl(tmp_path):
    """turbo-fp8-blockwise-mb runs the FP8 layer with its weight cache (is_first_microbatch=False)."""
    bench = importlib.import_module("benchmarks.bench_moe_layer")
    rc = bench.main(["--cpu-smoke", "--quick", "--out", str(tmp_path), "--impls", "turbo-fp8-blockwise",
                     "turbo-fp8-blockwise-mb"])
    assert rc == 0
    by = {r["impl"]: r for r in load_rows(tmp_path, bench.RESULT_NAME)}
    mb = by["turbo-fp8-blockwise-mb"]
    assert mb["error"] is None and mb["ms"] > 0 and "cached" in mb["extra"]["weights"]
    assert float(mb["snr_db"]) > 15


def test_baseline_expert_counts_match_bincount():
    """The baseline's sync-free tokens-per-expert count is bincount's, exactly (int64, empty experts 0)."""
    import torch

    bench = importlib.import_module("benchmarks.bench_moe_layer")
    g = torch.Generator().manual_seed(0)
    for e, m in ((8, 4096), (32, 131), (5, 0), (1, 17)):
        ids = torch.randint(0, max(e - 2, 1), (m,), generator=g)  # the top experts get no rows
        got = bench.expert_counts(ids, e)
        assert got.dtype == torch.int64 and got.shape == (e,)
        assert torch.equal(got, torch.bincount(ids, minlength=e)), (e, m)


def test_baseline_issues_no_host_sync():
    """torch_moe_layer forward + backward under the host-sync guard: no bincount / histc / item etc.

    On CPU the grouped GEMM is a per-expert loop that reads the counts with ``.tolist()``; the guard
    flags such reads only from the library's own files, so this checks the ATen ops the baseline
    issues, which are the same on CUDA (where ``torch._grouped_mm`` replaces the loop)."""
    import torch

    from primus_turbo.testing.host_sync import forbid_host_sync

    bench = importlib.import_module("benchmarks.bench_moe_layer")
    g = torch.Generator().manual_seed(1)
    t, h, f, e, k = 32, 16, 16, 4, 2
    x = torch.randn(t, h, generator=g, dtype=torch.bfloat16).requires_grad_()
    wr = torch.randn(e, h, generator=g).requires_grad_()
    w1 = (torch.randn(e, 2 * f, h, generator=g) * 0.1).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(e, h, f, generator=g) * 0.1).to(torch.bfloat16).requires_grad_()
    with forbid_host_sync("torch-baseline"):
        y = bench.torch_moe_layer(x, wr, w1, w2, k)
        y.backward(torch.ones_like(y))
    assert y.shape == (t, h) and x.grad is not None and w1.grad is not None
