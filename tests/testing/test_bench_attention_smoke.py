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


def test_varlen_cases_and_flops():
    bench = importlib.import_module("benchmarks.bench_attention")
    # every pattern is tiled to fill the pack exactly, the last document cut to fit
    for name, pat in bench.VARLEN_PATTERNS.items():
        lens = bench.doc_lengths(pat, bench.VARLEN_TOKENS)
        assert sum(lens) == bench.VARLEN_TOKENS and min(lens) >= 1, name
    assert sum(bench.VARLEN_PATTERNS["mixed"]) == bench.VARLEN_TOKENS
    assert bench.doc_lengths((57, 311, 800, 173), 1500) == [57, 311, 800, 173, 57, 102]
    assert bench.doc_lengths((2048,), 16384) == [2048] * 8
    assert bench.doc_lengths((57, 311), 10, div=16) == [4, 6]
    cases = bench.build_varlen_cases(list(bench.VARLEN_MODELS), list(bench.VARLEN_PATTERNS))
    assert len(cases) == len(bench.VARLEN_MODELS) * len(bench.VARLEN_PATTERNS) * 2
    assert {(c["Hq"], c["Hkv"], c["Dqk"]) for c in cases} == {(32, 8, 128), (64, 8, 64)}
    smoke = bench.build_varlen_cases(list(bench.VARLEN_MODELS), list(bench.VARLEN_PATTERNS), smoke=True)
    assert all(sum(c["lens"]) == bench.VARLEN_SMOKE_TOKENS for c in smoke)
    # only the attended pairs of each document count (causal halves them)
    assert bench.varlen_flops([8, 4], 2, 16, 16, False) == bench.attn_flops(1, 8, 8, 2, 16, 16, False) + \
        bench.attn_flops(1, 4, 4, 2, 16, 16, False)
    assert bench.varlen_flops([8, 4], 2, 16, 16, True, "bwd") == 2.5 * bench.varlen_flops([8, 4], 2, 16, 16, False) / 2
    assert bench.parse_args(["--varlen"]).suite == "varlen"
    assert bench.parse_args(["--suite", "all"]).suite == "all"
    assert bench.parse_args([]).suite == "dense"


@pytest.mark.skipif(not _has_turbo_attention(), reason="primus_turbo.pytorch.ops.flash_attn_func does not exist yet")
def test_bench_attention_varlen_cpu_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.bench_attention")
    rc = bench.main(["--cpu-smoke", "--varlen", "--quick", "--patterns", "mixed", "2048-64-64-64",
                     "--out", str(tmp_path)])
    assert rc == 0
    assert not (tmp_path / f"{bench.RESULT_NAME}.json").exists()  # varlen alone: its own result name
    rows = load_rows(tmp_path, bench.VARLEN_RESULT_NAME)
    assert {r["op"] for r in rows} == {"attn_varlen_fwd", "attn_varlen_bwd"}
    assert {r["impl"] for r in rows} == set(bench.VARLEN_IMPLS)
    assert {r["extra"]["pattern"] for r in rows} == {"mixed", "2048-64-64-64"}
    assert {r["extra"]["causal"] for r in rows} == {True, False}
    assert len(rows) == 2 * 2 * 2 * len(bench.VARLEN_IMPLS)
    on_cpu = not torch.cuda.is_available()
    for r in rows:
        e = r["extra"]
        assert r["baseline"] == "sdpa-nested" and e["layout"] == "thd"
        assert sum(e["doc_lens"]) == e["T"] == bench.VARLEN_SMOKE_TOKENS
        for key in ("speedup_vs_cudnn_loop", "speedup_vs_best_peer", "best_peer"):
            assert key in e, r
        if r["impl"] == "sdpa-nested":
            assert e["gqa"] == "repeat_kv"  # Llama's 32/8 heads, smoke 2/1: expanded outside timing
            if on_cpu and e["causal"]:
                assert r["error"] and "skipped on CPU" in r["error"], r
                continue
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["tflops"] is not None
        assert float(r["snr_db"]) > 30, r
        if r["op"] == "attn_varlen_bwd":
            assert float(e["snr_dq_db"]) > 30, r
        if e["causal"] and on_cpu:
            assert r["speedup"] is None  # no peer time for the row's case
        else:
            assert r["speedup"] is not None and e["speedup_vs_cudnn_loop"] is not None
            if r["impl"] == "sdpa-nested":
                assert r["speedup"] == pytest.approx(1.0)
    md = (tmp_path / f"{bench.VARLEN_RESULT_NAME}.md").read_text()
    assert "| attn_varlen_fwd | turbo-triton | sdpa-nested |" in md
    assert "| attn_varlen_bwd | turbo-default | sdpa-nested |" in md


@pytest.mark.skipif(not _has_turbo_attention(), reason="primus_turbo.pytorch.ops.flash_attn_func does not exist yet")
def test_bench_attention_both_suites_cpu_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.bench_attention")
    rc = bench.main(["--cpu-smoke", "--suite", "all", "--models", "GPT-OSS-20B", "--patterns", "57-311-800-173",
                     "--causal", "full", "--modes", "fwd", "--out", str(tmp_path)])
    assert rc == 0
    rows = load_rows(tmp_path, bench.RESULT_NAME)  # both suites in one result file
    assert {r["op"] for r in rows} == {"attn_fwd", "attn_varlen_fwd"}
    for r in rows:
        assert r["error"] is None, r
        assert (r["extra"]["Dqk"], r["extra"]["Hkv"]) == (16, 1)  # d64 / 4, GQA 64/8 -> 2/1
    md = (tmp_path / f"{bench.RESULT_NAME}.md").read_text()
    assert "| attn_fwd | turbo-triton | sdpa-flash |" in md
    assert "| attn_varlen_fwd | turbo-triton | sdpa-nested |" in md


def test_bench_attention_timing_and_rounds_options():
    """``--timing graph`` times forward passes only: with the backward mode it stops with a message
    (its step replays a retained autograd graph, which a CUDA-graph capture cannot take);
    ``--rounds`` must be positive. Both are refused before any case is built."""
    bench = importlib.import_module("benchmarks.bench_attention")
    with pytest.raises(SystemExit, match="--timing graph times the forward only"):
        bench.run(bench.parse_args(["--cpu-smoke", "--timing", "graph", "--modes", "fwd", "bwd"]))
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        bench.run(bench.parse_args(["--cpu-smoke", "--rounds", "0"]))
    assert bench.parse_args(["--rounds", "7", "--timing", "graph"]).rounds == 7
