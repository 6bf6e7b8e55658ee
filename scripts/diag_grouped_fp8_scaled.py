#!/usr/bin/env python3
"""TENSORWISE / ROWWISE M-grouped FP8: the Gluon kernel (the BLOCKWISE kernel with broadcast scales)
against ``torch._scaled_grouped_mm`` per shape, timed three ways to tell device time from host time:
``do_bench`` median (what the benchmarks report), CUDA-graph replay (device time only), and the host
time of one call (launches alone, the GPU kept busy). Balanced groups; operands quantized once by
the op's own quantizers. Optionally a cProfile of the Gluon call's host path.

    PYTHONPATH=. python scripts/diag_grouped_fp8_scaled.py --out /tmp/d [--shape G ROWS N K ...] [--cprofile]

Writes ``diag_grouped_fp8_scaled.json`` (one record per shape and granularity) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_grouped import _cprofile, _host_us  # noqa: E402
from scripts.diag_grouped_fp8_case import _graph_ms  # noqa: E402

# session 11 call 2 rows where the Gluon kernel lost or won oddly, plus controls
DEFAULT_SHAPES = ((4, 1024, 3072, 4096), (8, 1024, 3072, 4096), (16, 1024, 3072, 4096), (1, 1024, 2880, 2880),
                  (8, 4096, 1536, 2048), (1, 1024, 4096, 14336), (32, 1024, 4096, 7168), (4, 4096, 2880, 2880),
                  (32, 2048, 5760, 2880), (32, 2048, 2880, 2880))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", type=int, nargs=4, action="append", metavar=("G", "ROWS", "N", "K"))
    p.add_argument("--grans", nargs="+", default=["TENSORWISE", "ROWWISE"])
    p.add_argument("--cprofile", action="store_true", help="cProfile of the Gluon call on the first shape")
    args = p.parse_args(argv)
    from triton.testing import do_bench

    from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_gluon as gg

    op = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")
    dev = torch.device("cuda")
    fp8 = torch.float8_e4m3fn
    recs, lines = [], []
    for i, (G, rows, N, K) in enumerate(args.shape or DEFAULT_SHAPES):
        M = G * rows
        gen = torch.Generator(device=dev).manual_seed(i)
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(G, N, K, device=dev, generator=gen) / K**0.5).to(torch.bfloat16)
        offs = torch.arange(G + 1, device=dev, dtype=torch.int64) * rows
        offs32 = offs[1:].to(torch.int32)
        flops = 2.0 * M * N * K
        for gran in args.grans:
            aq, sa = op._quant_rows(a, fp8, gran, 128)
            (wq, sw), _ = op._weight_copies(w, True, fp8, gran, 128, True, False)
            sa_sg = sa.float().reshape(-1).expand(M).contiguous()
            sw_sg = sw.float().reshape(-1).expand(G * N if sw.numel() == 1 else -1).reshape(G, -1)
            sw_sg = sw_sg.expand(G, N).contiguous()
            steps = {
                "vendor": lambda: torch._scaled_grouped_mm(aq, wq.transpose(-2, -1), sa_sg, sw_sg, offs=offs32,
                                                           out_dtype=torch.bfloat16),
                "gluon": lambda: gg.grouped_gemm_fp8_scaled_gluon(aq, sa, wq, sw, offs, gran),
            }
            ref = steps["vendor"]().float()
            got = steps["gluon"]().float()
            rel = float((got - ref).norm() / ref.norm())
            rec = dict(G=G, rows=rows, N=N, K=K, gran=gran, rel_diff_vs_vendor=rel)
            for name, fn in steps.items():
                bench = [do_bench(fn, warmup=10, rep=40, return_mode="median") for _ in range(3)]
                rec[f"{name}_bench_ms"] = statistics.median(bench)
                rec[f"{name}_graph_ms"] = _graph_ms(fn)
                rec[f"{name}_host_us"] = _host_us(fn, 100)
                rec[f"{name}_tflops_graph"] = flops / rec[f"{name}_graph_ms"] / 1e9
            recs.append(rec)
            line = (f"G{G:3d} rows{rows:5d} N{N:5d} K{K:5d} {gran:10s} | bench v {rec['vendor_bench_ms']:.4f} "
                    f"g {rec['gluon_bench_ms']:.4f} ({rec['vendor_bench_ms'] / rec['gluon_bench_ms']:.3f}x) | graph v "
                    f"{rec['vendor_graph_ms']:.4f} g {rec['gluon_graph_ms']:.4f} "
                    f"({rec['vendor_graph_ms'] / rec['gluon_graph_ms']:.3f}x) | host us v {rec['vendor_host_us']:.0f} "
                    f"g {rec['gluon_host_us']:.0f} | rel {rel:.1e}")
            print(line, flush=True)
            lines.append(line)
            if args.cprofile and i == 0:
                lines.append(_cprofile(steps["gluon"], n=200, top=30, sorts=("tottime", "cumulative")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_grouped_fp8_scaled.json").write_text(json.dumps(recs, indent=1))
    (out / "diag_grouped_fp8_scaled.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
