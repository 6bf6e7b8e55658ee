"""Smoke test of benchmarks/bench_grouped_gemm.py (CPU: the Triton interpreter; timings mean nothing)."""

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



def _has_turbo_grouped_gemm() -> bool:
    try:
        ops = importlib.import_module("primus_turbo.pytorch.ops")
    except Exception:
        return False
    return hasattr(ops, "grouped_gemm")


def test_routing_lens_and_cases():
    bench = importlib.import_module("benchmarks.bench_grouped_gemm")
    assert bench.routing_lens(4, 64, "balanced") == [64] * 4
    lens = bench.routing_lens(16, 1024, "unbalanced")
    assert sum(lens) == 16 * 1024 and min(lens) > 0 and len(set(lens)) > 1
    assert lens == bench.routing_lens(16, 1024, "unbalanced")  # fixed seed
    cases = bench.build_cases(bench.MOE_MODELS, bench.EPS, (1024,))
    keys = [(c["G"], c["M"], c["N"], c["K"], c["routing"]) for c in cases]
    assert len(keys) == len(set(keys))  # deduped
    # Mixtral-8x7B: 8 experts, only EP 8 (G = 1), where unbalanced == balanced
    mix = [c for c in cases if c["case"].startswith("Mixtral-8x7B:")]
    assert {c["G"] for c in mix} == {1} and {c["routing"] for c in mix} == {"balanced"}
    assert all(c["G"] >= 1 for c in cases)


@pytest.mark.skipif(not _has_turbo_grouped_gemm(), reason="primus_turbo.pytorch.ops.grouped_gemm does not exist yet")
def test_bench_grouped_gemm_cpu_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.bench_grouped_gemm")
    rc = bench.main(["--cpu-smoke", "--quick", "--out", str(tmp_path)])
    assert rc == 0
    rows = load_rows(tmp_path, bench.RESULT_NAME)
    bf16 = [r for r in rows if r["op"].startswith("grouped_gemm_")]
    assert {r["op"] for r in bf16} == {"grouped_gemm_fwd", "grouped_gemm_fwd_bwd"}
    assert {r["impl"] for r in bf16} == {"torch_grouped_mm", "turbo-default", "turbo-triton"}
    assert all(r["baseline"] == "torch_grouped_mm" for r in bf16)
    assert {r["extra"]["routing"] for r in bf16} == {"balanced", "unbalanced"}
    for r in bf16:
        e = r["extra"]
        assert {"G", "M", "N", "K", "routing", "tokens_per_expert"} <= set(e), r
        assert e["N"] % 16 == 0 and e["K"] % 16 == 0
        # turbo runs on CPU (the Triton interpreter); the torch peer may not: then its error is recorded
        if r["impl"].startswith("turbo"):
            assert r["error"] is None, r
            assert r["ms"] > 0 and r["tflops"] > 0
        if r["error"] is None:
            assert float(r["snr_db"]) > 40, r
        else:
            assert r["ms"] is None
    fp8 = [r for r in rows if r["op"].startswith("grouped_fp8_fwd_")]
    ops_mod = importlib.import_module("primus_turbo.pytorch.ops")
    if hasattr(ops_mod, "grouped_gemm_fp8"):
        assert fp8
        for r in fp8:
            if r["impl"] != "scaled_grouped_mm":
                want = "torch_grouped_mm" if r["op"] == "grouped_fp8_fwd_blockwise" else "scaled_grouped_mm"
                assert r["baseline"] == want, r
            if r["impl"].startswith("turbo") and r["error"] is None:
                assert float(r["snr_db"]) > 20, r
    else:
        assert not fp8
    assert (tmp_path / f"{bench.RESULT_NAME}.md").exists()
