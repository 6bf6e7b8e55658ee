"""Smoke test of benchmarks/bench_norm_act.py, runnable without a GPU."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROW_KEYS = {"op", "case", "impl", "baseline", "ms", "baseline_ms", "speedup", "gbps", "snr_db", "extra"}


def test_bench_norm_act_cpu_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.bench_norm_act")
    rc = bench.main(["--out", str(tmp_path), "--quick", "--cpu-smoke"])
    assert rc == 0
    doc = json.loads((tmp_path / "norm_act.json").read_text())
    assert {"gpu", "torch", "triton", "date", "rows"} <= set(doc)
    impls = {r["impl"] for r in doc["rows"]}
    assert impls == set(bench.IMPLS)
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r), r
        assert r["baseline"] == "device-copy"
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["gbps"] > 0 and r["speedup"] > 0
        if r["impl"] != "device-copy":
            assert r["snr_db"] >= 40.0, r
    copies = [r for r in doc["rows"] if r["impl"] == "device-copy"]
    assert len(copies) == 2 and all(abs(c["speedup"] - 1.0) < 1e-9 for c in copies)
    assert (tmp_path / "norm_act.md").exists()
