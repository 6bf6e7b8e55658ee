#!/usr/bin/env python3
"""Megatron's calling form of the 16-bit grouped GEMM, eager forward+backward against the vendor
op doing the same work: ``grouped_gemm(x, w, lens, offs, trans_b=True,
fuse_bgrad_accum_pattern="megatron")`` (the weight gradient added into ``w.main_grad``, fp32, in the
kernel epilogue; a placeholder returned) against ``torch._grouped_mm`` forward+backward followed by
``w.main_grad.add_(w.grad)`` (what a framework does without the fused form). Registry rows
(``benchmarks/bench_grouped_gemm.py``'s grid), ``do_bench`` with host time included, rounds
interleaved; the first step of each row is checked against a float64 reference (output, input
gradient, the accumulated ``main_grad``). Prints a table; ``--out`` writes the rows as JSON.

    PYTHONPATH=. python scripts/diag_megatron_grouped.py [--models ...] [--ep ...] [--tokens ...]
    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/diag_megatron_grouped.py --cpu-smoke --models Qwen3-30B-A3B --ep 32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.bench_grouped_gemm import _inputs, build_cases  # noqa: E402
from benchmarks.common import time_interleaved  # noqa: E402
from primus_turbo.testing import snr_db  # noqa: E402


def _ref(a, w, lens, dc):
    """float64 (out, grad_a, grad_w) of ``out[rows of g] = a[rows of g] @ w[g].T``."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    ga = torch.zeros(a.shape, dtype=torch.float64, device=a.device)
    gw = torch.zeros(w.shape, dtype=torch.float64, device=a.device)
    s = 0
    for g, n in enumerate(lens):
        x, d, wg = a[s:s + n].double(), dc[s:s + n].double(), w[g].double()
        out[s:s + n], ga[s:s + n], gw[g] = x @ wg.T, d @ wg, d.T @ x
        s += n
    return out, ga, gw


def run_case(case, device, rounds: int, warmup_ms: float, rep_ms: float) -> dict:
    import primus_turbo.pytorch as turbo

    lens, _gen, a0, w0, group_lens, group_offs, offs32 = _inputs(case, device)
    a = a0.detach().requires_grad_()
    w_ours = w0.detach().clone().requires_grad_()
    w_peer = w0.detach().clone().requires_grad_()
    for w in (w_ours, w_peer):
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
    dc = torch.randn(a.shape[0], w0.shape[1], dtype=torch.bfloat16, device=device)

    def ours():
        out = turbo.ops.grouped_gemm(a, w_ours, group_lens, group_offs, trans_b=True,
                                     fuse_bgrad_accum_pattern="megatron")
        out.backward(dc)
        w_ours.grad = None
        return out

    def peer():
        out = torch._grouped_mm(a, w_peer.transpose(1, 2), offs=offs32)
        out.backward(dc)
        w_peer.main_grad.add_(w_peer.grad)
        w_peer.grad = None
        return out

    # a checked step each (main_grad zeroed first: it then holds one step's weight gradient)
    ref_out, ref_ga, ref_gw = _ref(a0, w0, lens, dc)
    check = {}
    for name, fn, w in (("ours", ours, w_ours), ("peer", peer, w_peer)):
        for _ in range(2):  # ours: the checked path, then the kept step route
            a.grad = None
            w.main_grad.zero_()
            out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        check[name] = {"out_db": snr_db(ref_out, out), "grad_a_db": snr_db(ref_ga, a.grad),
                       "main_grad_db": snr_db(ref_gw, w.main_grad)}
    times, errors = time_interleaved({"peer": (peer, contextlib.nullcontext), "ours": (ours, contextlib.nullcontext)}, rounds, warmup_ms, rep_ms,
                                     grads=[a])
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"case": case["case"], "G": case["G"], "M": sum(lens), "N": case["N"], "K": case["K"],
            "routing": case["routing"], "times_ms": times, "median_ms": med, "errors": errors, "check": check,
            "ratio": med["peer"] / med["ours"] if "peer" in med and "ours" in med else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["Qwen3-30B-A3B", "GPT-OSS-20B", "DeepSeek-V3"])
    p.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024])
    p.add_argument("--routings", nargs="+", default=["balanced"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=40.0)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    p.add_argument("--cpu-smoke", action="store_true", help="shapes / 16 on CPU, one untimed-quality round")
    args = p.parse_args()
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:  # run under TRITON_INTERPRET=1
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()
        args.rounds, args.warmup_ms, args.rep_ms = 1, 0.0, 0.0
    rows = []
    for case in build_cases(args.models, args.ep, args.tokens, div=16 if args.cpu_smoke else 1,
                            routings=args.routings):
        try:
            rows.append(run_case(case, device, args.rounds, args.warmup_ms, args.rep_ms))
        except Exception as exc:  # a row that fails is reported, the rest still run
            rows.append({"case": case["case"], "error": f"{type(exc).__name__}: {exc}"})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    print("| case | G | M | N | K | peer ms | ours ms | peer/ours | SNR out / dA / main_grad (ours) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    ratios = []
    for r in rows:
        if "error" in r or r.get("ratio") is None:
            print(f"| {r['case']} | error: {r.get('error') or r.get('errors')} |")
            continue
        c = r["check"]["ours"]
        ratios.append(r["ratio"])
        print(f"| {r['case']} | {r['G']} | {r['M']} | {r['N']} | {r['K']} | {r['median_ms']['peer']:.4f} | "
              f"{r['median_ms']['ours']:.4f} | {r['ratio']:.3f} | {c['out_db']:.1f} / {c['grad_a_db']:.1f} / "
              f"{c['main_grad_db']:.1f} |")
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"geomean peer/ours {geo:.3f}, min {min(ratios):.3f} over {len(ratios)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
