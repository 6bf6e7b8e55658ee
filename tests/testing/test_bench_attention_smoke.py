"""Smoke test of benchmarks/bench_attention.py (CPU: the Triton interpreter; timings mean nothing)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from tests.testing.bench_results import load_rows

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("triton")



def _has_turbo_attention() -> bool:
    try:
        ops = importlib.import_module("primus_turbo.pytorch.ops")
    except Exception:
        return False
    return hasattr(ops, "flash_attn_func")


def test_attention_cases_and_flops():
    bench = importlib.import_module("benchmarks.bench_attention")
    heads = bench.head_configs(list(bench.MODELS))
    keys = [(h["Hq"], h["Hkv"], h["Dqk"], h["Dv"]) for h in heads]
    assert len(keys) == len(set(keys))  # deduped
    assert {(k[2], k[3]) for k in keys} >= {(64, 64), (128, 128), (192, 128)}
    cases = bench.build_cases(list(bench.MODELS), bench.ALL_SEQS)
    assert all(c["B"] * c["S"] == bench.TOKENS for c in cases)
    assert {c["causal"] for c in cases} == {True, False}
    assert bench.attn_flops(2, 8, 8, 4, 16, 16, False) == 2 * 2 * 8 * 8 * 4 * 32
    assert bench.attn_flops(2, 8, 8, 4, 16, 16, True) == 2 * 8 * 8 * 4 * 32
    assert bench.attn_flops(1, 8, 8, 1, 16, 16, False, "bwd") == 2.5 * bench.attn_flops(1, 8, 8, 1, 16, 16, False)
    # lenient parsing: another benchmark's options and values are ignored
    args = bench.parse_args(["--cpu-smoke", "--cases", "qkv", "--impls", "cublas", "turbo-default", "--m", "4096"])
    assert args.cpu_smoke and args.impls == ["cublas", "turbo-default"]


@pytest.mark.skipif(not _has_turbo_attention(), reason="primus_turbo.pytorch.ops.flash_attn_func does not exist yet")
def test_bench_attention_cpu_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.bench_attention")
    rc = bench.main(["--cpu-smoke", "--quick", "--out", str(tmp_path)])
    assert rc == 0
    rows = load_rows(tmp_path, bench.RESULT_NAME)
    for r in rows:
        assert r["baseline"] == "sdpa-flash"
        for key in ("speedup_vs_cudnn", "speedup_vs_best_peer", "best_peer"):
            assert key in r["extra"], r
    assert {r["op"] for r in rows} == {"attn_fwd", "attn_bwd"}
    assert {r["impl"] for r in rows} == {"sdpa-cudnn", "sdpa-flash", "turbo-default", "turbo-triton"}
    assert {r["extra"]["causal"] for r in rows} == {True, False}
    assert {(r["extra"]["Dqk"], r["extra"]["Dv"]) for r in rows} == {(32, 32), (48, 32)}  # 128 and MLA 192/128, / 4
    # on CPU both peers run SDPA's math backend, and the dispatcher's default must run too; on a GPU
    # SDPA's flash backend has no kernel for head_dim_qk != head_dim_v (MLA rows)
    for r in rows:
        peer_na = torch.cuda.is_available() and r["impl"] == "sdpa-flash" and r["extra"]["Dqk"] != r["extra"]["Dv"]
        if r["impl"] in ("sdpa-flash", "sdpa-cudnn", "turbo-default") and not peer_na:
            assert r["error"] is None, r
            assert r["ms"] > 0 and r["tflops"] is not None
    for r in rows:
        if r["error"] is None:
            assert float(r["snr_db"]) > 30, r
            if r["op"] == "attn_bwd":
                assert float(r["extra"]["snr_dq_db"]) > 30, r
            if r["impl"] == "sdpa-flash":
                assert r["speedup"] == pytest.approx(1.0)
    assert (tmp_path / f"{bench.RESULT_NAME}.md").exists()
