#!/usr/bin/env python3
"""Sweep GEMM kernel configs against cuBLAS on the current GPU (written for H200 / sm_90).

    PYTHONPATH=. python3 scripts/tune_gemm_triton.py --out DIR [--quick] [--jobs 12]

For every shape (bf16, M in {4096, 16384}, LLM (N, K) pairs) and layout (NN: a, b row-major; NT: b is
the transposed view of an [N, K] weight, the Linear forward; TN: a is the transposed view of [K, M])
it times each candidate config of ``gemm_kernel._launch`` and ``torch.matmul`` on the same views,
checks every candidate's output against ``torch.matmul``, prints the best config per shape with
TFLOP/s and the ratio to cuBLAS, and writes every number to DIR/tune_gemm_triton.json.

Compilation dominates a cold run, so candidates are first compiled in parallel worker processes
(on small problems with the same specialization; the triton cache is shared on disk).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from primus_turbo.triton.gemm import gemm_kernel as gk  # noqa: E402

G = gk.GemmConfig
CANDIDATES = [
    G(128, 256, 64, 8, 3, 8, True),  # analytic default for these shapes
    G(128, 256, 64, 8, 3, 8, True, flatten=False),
    G(128, 256, 64, 8, 4, 8, True),
    G(128, 256, 64, 8, 3, 8, False),
    G(128, 256, 64, 16, 3, 8, True),
    G(128, 256, 64, 4, 3, 8, True),
    G(256, 128, 64, 8, 3, 8, True),
    G(128, 128, 64, 8, 4, 8, True),
    G(128, 128, 64, 8, 5, 4, False),
    G(128, 128, 128, 8, 3, 8, True),
    G(64, 256, 64, 8, 4, 4, True),
    G(128, 256, 64, 8, 3, 8, True, flatten=False, warp_specialize=True),
    G(128, 256, 64, 8, 3, 8, True, warp_specialize=True),
    G(128, 256, 64, 8, 3, 8, True, use_tma=False),
    G(128, 128, 64, 8, 4, 8, True, use_tma=False),
]
NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (10240, 8192), (57344, 8192),
      (8192, 28672)]
PRECOMPILE_SIZE = 512  # M = N = K of the compile run: a multiple of 16, like every tuned shape, so
# the kernels get the same divisibility specialization and the real runs hit the compile cache
MIN_SNR_DB = 40.0  # bf16 out vs bf16 cuBLAS: two independent roundings, ~46 dB expected


def make_operands(M, N, K, layout, dtype=torch.bfloat16):
    a = torch.randn(K, M, device="cuda", dtype=dtype).T if layout[0] == "T" else torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype).T if layout[1] == "T" else torch.randn(K, N, device="cuda", dtype=dtype)
    return a, b


def snr_db(ref, out, rows=2048):
    """SNR in dB of out against ref, in row chunks so that 16384 x 128256 outputs fit in memory."""
    sig = err = 0.0
    for i in range(0, ref.shape[0], rows):
        r, o = ref[i:i + rows].float(), out[i:i + rows].float()
        sig += r.pow(2).sum().item()
        err += (r - o).pow(2).sum().item()
    if math.isnan(err):
        return -math.inf
    return math.inf if err == 0 else 10 * math.log10(sig / err)


def _precompile(job):
    """Worker: compile one (config, layout) by running it on a small problem; returns an error or None."""
    cfg, layout = job
    try:
        n = PRECOMPILE_SIZE
        a, b = make_operands(n, n, n, layout)
        out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        gk._launch(a, b, out, False, G(**cfg))
        torch.cuda.synchronize()
        ref = torch.matmul(a, b)
        if snr_db(ref, out) < MIN_SNR_DB:
            return f"wrong result at {n}^3 (snr {snr_db(ref, out):.1f} dB)"
        return None
    except Exception as exc:  # noqa: BLE001 - reported per config
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for tune_gemm_triton.json")
    parser.add_argument("--quick", action="store_true", help="M=4096 and layout NT only")
    parser.add_argument("--layouts", default="NN,NT,TN")
    parser.add_argument("--ms", default="4096,16384")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="parallel compile workers")
    parser.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=40, help="do_bench rep (ms)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_gemm_triton.py needs a CUDA GPU")
    import triton
    from triton.testing import do_bench

    os.makedirs(args.out, exist_ok=True)
    layouts = ["NT"] if args.quick else args.layouts.split(",")
    ms = [4096] if args.quick else [int(m) for m in args.ms.split(",")]
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")

    # 1. compile every (config, layout) in parallel; a failure flags the pair for the whole sweep
    jobs = [(dataclasses.asdict(c), lay) for c in CANDIDATES for lay in layouts]
    with mp.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        errors = dict(zip([(G(**c), lay) for c, lay in jobs], pool.map(_precompile, jobs)))
    for (c, lay), err in errors.items():
        if err:
            print(f"  [skip] {lay} {c.short()}: {err}")
    print(f"compiled {len(jobs)} (config, layout) pairs in {time.time() - t_start:.0f} s")

    # 2. time everything
    results = []
    for M in ms:
        for N, K in NK:
            for lay in layouts:
                a, b = make_operands(M, N, K, lay)
                flop = 2.0 * M * N * K
                ref = torch.matmul(a, b)
                t_cublas = do_bench(lambda: torch.matmul(a, b), warmup=args.warmup, rep=args.rep, return_mode="median")
                row = dict(M=M, N=N, K=K, layout=lay, cublas_ms=t_cublas, cublas_tflops=flop / t_cublas * 1e-9, configs=[])
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                default = gk._default_config(M, N, K, torch.bfloat16, False, props.multi_processor_count)
                for cfg in CANDIDATES + ([default] if default not in CANDIDATES else []):
                    entry = dict(config=dataclasses.asdict(cfg), name=cfg.short(), is_default=cfg == default)
                    if errors.get((cfg, lay)):
                        entry.update(ok=False, error=errors[(cfg, lay)])
                        row["configs"].append(entry)
                        continue
                    try:
                        out.fill_(float("nan"))
                        gk._launch(a, b, out, False, cfg)
                        snr = snr_db(ref, out)
                        t = do_bench(lambda: gk._launch(a, b, out, False, cfg), warmup=args.warmup, rep=args.rep,
                                     return_mode="median")
                        entry.update(ok=snr >= MIN_SNR_DB, snr_db=snr, ms=t, tflops=flop / t * 1e-9,
                                     ratio=t_cublas / t)
                        if snr < MIN_SNR_DB:
                            entry["error"] = f"wrong result: snr {snr:.1f} dB"
                    except Exception as exc:  # noqa: BLE001
                        entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                    row["configs"].append(entry)
                good = [e for e in row["configs"] if e.get("ok")]
                best = max(good, key=lambda e: e["tflops"]) if good else None
                row["best"] = best["name"] if best else None
                row["best_tflops"] = best["tflops"] if best else 0.0
                row["best_ratio"] = best["ratio"] if best else 0.0
                dflt = next((e for e in row["configs"] if e["is_default"] and e.get("ok")), None)
                row["default_ratio"] = dflt["ratio"] if dflt else 0.0
                results.append(row)
                bad = [e["name"] for e in row["configs"] if not e.get("ok") and "wrong" in e.get("error", "")]
                print(f"M={M:6d} N={N:6d} K={K:6d} {lay}: cuBLAS {row['cublas_tflops']:6.1f} TFLOP/s | best "
                      f"{row['best_tflops']:6.1f} ({row['best_ratio']:.3f}x) {row['best']} | default "
                      f"{row['default_ratio']:.3f}x" + (f" | WRONG: {bad}" if bad else ""), flush=True)
                del a, b, ref, out
                torch.cuda.empty_cache()

    # 3. summaries: geomean ratio to cuBLAS of the per-shape best, the default, and each single config
    def geomean(xs):
        xs = [x for x in xs if x > 0]
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else 0.0

    per_config = {}
    for c in CANDIDATES:
        ratios = [next((e.get("ratio", 0.0) for e in r["configs"] if e["name"] == c.short() and e.get("ok")), 0.0)
                  for r in results]
        per_config[c.short()] = dict(geomean_ratio=geomean(ratios), complete=all(x > 0 for x in ratios))
    summary = dict(
        geomean_best_ratio=geomean([r["best_ratio"] for r in results]),
        geomean_default_ratio=geomean([r["default_ratio"] for r in results]),
        per_layout_best={lay: geomean([r["best_ratio"] for r in results if r["layout"] == lay]) for lay in layouts},
        per_config=per_config,
        seconds=time.time() - t_start,
    )
    print("\nsingle-config geomean ratio to cuBLAS (all shapes):")
    for name, s in sorted(per_config.items(), key=lambda kv: -kv[1]["geomean_ratio"]):
        print(f"  {s['geomean_ratio']:.3f}x {'' if s['complete'] else '(incomplete) '}{name}")
    print(f"geomean ratio: best per shape {summary['geomean_best_ratio']:.3f}x, analytic default "
          f"{summary['geomean_default_ratio']:.3f}x; per layout (best) "
          + ", ".join(f"{k} {v:.3f}x" for k, v in summary["per_layout_best"].items()))
    path = os.path.join(args.out, "tune_gemm_triton.json")
    with open(path, "w") as f:
        json.dump(dict(device=props.name, num_sms=props.multi_processor_count, torch=torch.__version__,
                       triton=triton.__version__, candidates=[dataclasses.asdict(c) for c in CANDIDATES],
                       results=results, summary=summary), f, indent=1)
    print(f"wrote {path} ({summary['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
