"""Smoke test of benchmarks/bench_quantization.py, runnable without a GPU."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROW_KEYS = {"op", "case", "impl", "baseline", "ms", "baseline_ms", "speedup", "gbps", "snr_db", "extra"}


def test_bench_quantization_cpu_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.bench_quantization")
    rc = bench.main(["--out", str(tmp_path), "--quick", "--cpu-smoke"])
    assert rc == 0
    doc = json.loads((tmp_path / "quantization.json").read_text())
    assert {"gpu", "torch", "triton", "date", "rows"} <= set(doc)
    impls = {r["impl"] for r in doc["rows"]}
    assert impls == set(bench.IMPLS)
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r), r
        assert r["baseline"] == "device-copy"
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["gbps"] > 0 and r["speedup"] > 0
        assert r["snr_db"] == "inf", r  # bit-exact against quant_ref
        assert r["extra"]["timing"] == ("do_bench" if torch.cuda.is_available() else "perf_counter")
        if r["impl"] != "device-copy":
            assert r["extra"]["mismatches"] == 0
    copy = next(r for r in doc["rows"] if r["impl"] == "device-copy")
    assert abs(copy["speedup"] - 1.0) < 1e-9
    assert (tmp_path / "quantization.md").exists()


def test_bench_quantization_timing_flag(tmp_path):
    """--timing graph is accepted and recorded (on CPU the perf_counter loop runs either way)."""
    bench = importlib.import_module("benchmarks.bench_quantization")
    args = bench.parse_args(["--timing", "graph", "--quick", "--cpu-smoke", "--out", str(tmp_path)])
    assert args.timing == "graph"
    assert bench.parse_args([]).timing == "do_bench"
