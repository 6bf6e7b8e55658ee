"""Smoke test of benchmarks/bench_moe_permute.py, runnable without a GPU."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROW_KEYS = {"op", "case", "impl", "baseline", "ms", "baseline_ms", "speedup", "gbps", "snr_db", "extra"}


def test_bench_moe_permute_cpu_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.bench_moe_permute")
    rc = bench.main(["--out", str(tmp_path), "--quick", "--cpu-smoke"])
    assert rc == 0
    doc = json.loads((tmp_path / "moe_permute.json").read_text())
    assert {"gpu", "torch", "triton", "date", "rows"} <= set(doc)
    assert {r["impl"] for r in doc["rows"]} == set(bench.IMPLS)
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r), r
        assert r["baseline"] == "device-copy"
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["gbps"] > 0 and r["speedup"] > 0
        if r["impl"] != "device-copy":
            assert r["extra"]["mismatches"] == 0, r
            assert r["snr_db"] == "inf", r
    copy = next(r for r in doc["rows"] if r["impl"] == "device-copy")
    assert abs(copy["speedup"] - 1.0) < 1e-9
    assert (tmp_path / "moe_permute.md").exists()


def test_bench_moe_permute_args():
    bench = importlib.import_module("benchmarks.bench_moe_permute")
    args = bench.parse_args(["--cpu-smoke", "--impls", "cublas", "--permute-ops", "moe_permute"])
    assert args.cpu_smoke and args.permute_ops == ["moe_permute"]
    assert (16384, 7168, 8, 32) in bench.CASES and (4096, 4096, 2, 8) in bench.CASES
