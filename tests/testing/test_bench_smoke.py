"""Smoke tests of the benchmark harness (benchmarks/), runnable without a GPU."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

from tests.testing.bench_results import TOP_KEYS, load_rows

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Row, bench_ms, geomean, gpu_slug, write_results  # noqa: E402

ROW_KEYS = {"op", "case", "impl", "baseline", "ms", "baseline_ms", "speedup", "tflops", "snr_db"}


def _has_turbo_gemm() -> bool:
    try:
        ops = importlib.import_module("primus_turbo.pytorch.ops")
    except Exception:
        return False
    return hasattr(ops, "gemm")


def test_geomean():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([1.0, None, float("nan"), 0.0, -1.0, 4.0]) == pytest.approx(2.0)
    assert math.isnan(geomean([]))


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_slug("cpu") == "cpu"


def test_bench_ms_cpu():
    calls = []
    ms = bench_ms(lambda: calls.append(1), warmup_ms=0, rep_ms=0)
    assert ms >= 0 and len(calls) >= 4


def test_write_results_schema(tmp_path):
    rows = [
        Row("gemm_fwd", "m:qkv", "cublas", "cublas", ms=2.0, baseline_ms=2.0, tflops=10.0, snr_db=float("inf"),
            extra={"M": 1, "N": 2, "K": 3}).finalize(),
        Row("gemm_fwd", "m:qkv", "turbo", "cublas", ms=1.0, baseline_ms=2.0, tflops=20.0, snr_db=50.0).finalize(),
        Row("gemm_fwd", "m:down", "turbo", "cublas", error="boom | bad"),
    ]
    assert rows[1].speedup == pytest.approx(2.0)
    path = write_results(rows, tmp_path / "sub", "demo")
    doc = json.loads(path.read_text())
    assert TOP_KEYS <= set(doc)
    assert len(doc["rows"]) == 3
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r)
    assert doc["rows"][0]["snr_db"] == "inf"
    md = (tmp_path / "sub" / "demo.md").read_text()
    assert "## Geomean speedup" in md
    assert "| gemm_fwd | turbo | cublas | 2.000 |" in md


@pytest.mark.skipif(not _has_turbo_gemm(), reason="primus_turbo.pytorch.ops.gemm does not exist yet")
def test_bench_gemm_cpu_smoke(tmp_path):
    bench_gemm = importlib.import_module("benchmarks.bench_gemm")
    rc = bench_gemm.main(["--out", str(tmp_path), "--quick", "--cpu-smoke", "--cases", "qkv", "down"])
    assert rc == 0
    rows = load_rows(tmp_path, "gemm_bf16")
    for r in rows:
        assert r["baseline"] == "cublas"
    impls = {r["impl"] for r in rows}
    assert impls == {"cublas", "turbo-default", "turbo-triton"}
    assert {r["op"] for r in rows} == {"gemm_fwd", "gemm_fwd_bwd"}
    # the peer always runs on CPU; the dispatcher's default must run there too
    for r in rows:
        if r["impl"] in ("cublas", "turbo-default"):
            assert r["error"] is None, r
            assert r["ms"] > 0
    assert {r["case"] for r in rows} == {"Llama-3.1-8B:qkv", "Llama-3.1-8B:down"}
    # under the test suite the interpreter's bf16 dot is shimmed, so every impl that ran is accurate
    for r in rows:
        if r["error"] is None:
            assert float(r["snr_db"]) > 40, r
    assert (tmp_path / "gemm_bf16.md").exists()


@pytest.mark.skipif(not _has_turbo_gemm(), reason="primus_turbo.pytorch.ops.gemm does not exist yet")
def test_run_all_cpu_smoke(tmp_path, capsys):
    run_all = importlib.import_module("benchmarks.run_all")
    rc = run_all.main(["--out", str(tmp_path), "--quick", "--cpu-smoke", "--modes", "fwd", "--cases", "qkv",
                       "--impls", "cublas", "turbo-default"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.rstrip().endswith("|")  # the geomean table is printed last
    assert "===== summary =====" in out
    assert (tmp_path / "gemm_bf16.json").exists()


def test_progress_lines_of_the_shared_printers(capsys):
    """The benchmarks' progress lines (benchmarks.common.print_compute_row / print_bandwidth_row):
    fixed columns, the timed values, and the error text where a row failed."""
    from benchmarks.common import print_bandwidth_row, print_compute_row

    row = Row(op="gemm_fwd", case="Llama:qkv", impl="turbo", baseline="torch", ms=1.25, speedup=1.0625,
              tflops=612.34, snr_db=51.25)
    print_compute_row(row, "4096x6144x4096", (10, 12, 16, 8))
    assert capsys.readouterr().out == ("gemm_fwd   Llama:qkv    4096x6144x4096   turbo       1.2500 ms   612.3 TF "
                                       "x1.062 snr   51.2 dB\n")
    print_compute_row(row, "4096x6144x4096", (10, 12, 16, 8), speedup="x1.062 vs torch")
    assert "x1.062 vs torch snr" in capsys.readouterr().out
    bad = Row(op="gemm_fwd", case="Llama:qkv", impl="turbo", baseline="torch", error="RuntimeError: boom")
    print_compute_row(bad, "4096x6144x4096", (10, 12, 16, 8))
    assert capsys.readouterr().out == "gemm_fwd   Llama:qkv    4096x6144x4096   turbo    ERROR RuntimeError: boom\n"

    mem = Row(op="rmsnorm", case="4096x7168", impl="turbo", baseline="copy", ms=0.05, speedup=0.95, gbps=3900.0)
    print_bandwidth_row(mem, f"{mem.case:10s}", 6, "exact")
    assert capsys.readouterr().out == "4096x7168  turbo     0.0500 ms   3900.0 GB/s x0.950 exact\n"
    failed = Row(op="rmsnorm", case="4096x7168", impl="turbo", baseline="copy", error="ValueError: shape")
    print_bandwidth_row(failed, f"{failed.case:10s}", 6, "-")
    assert capsys.readouterr().out == "4096x7168  turbo  ERROR ValueError: shape\n"
