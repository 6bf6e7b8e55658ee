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

    # the byte model of the module docstring: token rows read once and written once
    t, h = (int(v) for v in copy["extra"]["shape"].split("x"))
    k, e = copy["extra"]["topk"], copy["extra"]["experts"]
    row, n = 2 * h, t * k
    npad = n + (bench.PAD - 1) * e
    rid_primus = 4 * t * (e + 1 + k)
    want = {
        "device-copy": 2 * t * row,
        "moe_permute": (t + n) * row + 8 * n + 4 * n + 4 * n + 4 * n,
        "moe_permute_map": (t + n) * row + t * e + 4 * t * e + 4 * n + 4 * t * e,
        "moe_permute_pad128": (t + npad) * row + 8 * n + 4 * n + 4 * npad + 4 * n,
        "moe_unpermute": (n + t) * row + 4 * n + 4 * n,
        "primus_moe_permute": (t + n) * row + 8 * n + 4 * n + rid_primus + 4 * n + 8 * e + 4 + 4,
        "primus_moe_unpermute": (n + t) * row + rid_primus + 4 + 4 * n + 4 * n,
        "token_permute": (t + n) * row + t * e + 4 * t * e + 4 * n + 4 * t * e + 8 * e,
        "token_unpermute": (n + t) * row + 4 * t * e + 4 * t * e,
    }
    by = {r["impl"]: r for r in doc["rows"]}
    assert {i: by[i]["extra"]["bytes"] for i in want} == want
    for r in doc["rows"]:  # the ratio is of bandwidths under that model
        gbps = r["extra"]["bytes"] / (r["ms"] * 1e-3) / 1e9
        copy_gbps = copy["extra"]["bytes"] / (copy["ms"] * 1e-3) / 1e9
        assert abs(r["gbps"] - gbps) <= 1e-9 * gbps and abs(r["speedup"] - gbps / copy_gbps) <= 1e-9 * r["speedup"]
    # permute counts each token row read once, not k times (the old model's 2 * T * k rows)
    assert by["moe_permute_map"]["extra"]["bytes"] < 2 * n * row


def test_io_bytes_counts_each_tensor_once():
    import torch

    bench = importlib.import_module("benchmarks.bench_moe_permute")
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    out = torch.zeros(6, 8, dtype=torch.bfloat16)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    assert bench.io_bytes((x, idx, None), (out, None, 3)) == 64 + 64 + 96
    # an input handed back as an output (the same memory) is not written again; empty tensors add 0
    assert bench.io_bytes((x,), (x, torch.empty(0), [out])) == 64 + 96


def test_bench_moe_permute_args():
    bench = importlib.import_module("benchmarks.bench_moe_permute")
    args = bench.parse_args(["--cpu-smoke", "--impls", "cublas", "--permute-ops", "moe_permute"])
    assert args.cpu_smoke and args.permute_ops == ["moe_permute"]
    assert (16384, 7168, 8, 32) in bench.CASES and (4096, 4096, 2, 8) in bench.CASES
