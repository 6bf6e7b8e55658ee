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
    # geglu_with_probs: forward and backward rows on the SwiGLU case's x, counted like swiglu_probs
    by = {r["impl"]: r for r in doc["rows"] if r["case"].startswith("swiglu")}
    for d in ("fwd", "bwd"):
        geglu, swiglu = by[f"geglu_probs_{d}"], by[f"swiglu_probs_{d}"]
        assert geglu["op"] == "geglu" and geglu["extra"]["op"] == "geglu", geglu
        assert geglu["extra"]["bytes"] == swiglu["extra"]["bytes"], (geglu, swiglu)
    rows, cols = (int(v) for v in by["geglu_probs_fwd"]["extra"]["shape"].split("x"))
    # fwd: x bf16 [T, 2F], probs fp32 [T], mask uint8 [T] -> out bf16 [T, F]
    assert by["geglu_probs_fwd"]["extra"]["bytes"] == rows * cols * 2 + rows * 4 + rows + rows * cols // 2 * 2
    # bwd: dout [T, F], x [T, 2F], probs, mask -> dx [T, 2F], dprobs fp32 [T]
    assert by["geglu_probs_bwd"]["extra"]["bytes"] == (rows * cols // 2 * 2 + 2 * rows * cols * 2 + rows * 4
                                                       + rows + rows * 4)


def test_geglu_rows_use_the_gelu_kernel(monkeypatch):
    """The geglu rows call the kernels with the gelu_tanh code (not SwiGLU's) and check against
    geglu_with_probs_ref: a wrong activation code would show as a low SNR, this pins the call."""
    import torch

    bench = importlib.import_module("benchmarks.bench_norm_act")
    from primus_turbo.pytorch.ops import activation as A

    seen = []
    orig_fwd, orig_bwd = A._fwd_eager, A._bwd_eager
    monkeypatch.setattr(A, "_fwd_eager", lambda x, act, p, m: seen.append(("fwd", act)) or orig_fwd(x, act, p, m))
    monkeypatch.setattr(A, "_bwd_eager", lambda d, x, act, p, m: seen.append(("bwd", act)) or orig_bwd(d, x, act, p, m))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, dtype=torch.bfloat16, generator=gen)
    for name in ("geglu_probs_fwd", "geglu_probs_bwd"):
        seen.clear()
        _step, _moved, check = bench._act_impl(name, x, gen)
        assert check() >= 40.0
        assert seen and all(act == A._ACTS["gelu_tanh"] for _, act in seen), seen
