#!/usr/bin/env python3
"""One M-grouped BLOCKWISE FP8 case of ``check_gluon_fp8.py --grouped``, timed several ways to tell a
slow kernel from host time: ``do_bench`` (three rounds), the same call replayed from a CUDA graph
(no host work in the timed loop), and variants of the group sizes (the unbalanced pattern without
its tail rows, without its empty group, and balanced).

    PYTHONPATH=. python scripts/diag_grouped_fp8_case.py [--case G ROWS N K] [--out DIR]

Default case: Qwen3-30B-A3B's down GEMM (G 16, 2048 rows per group, N 2048, K 768), which read
0.377 ms unbalanced against 0.136 ms balanced in session 9 (0.155 both in session 4).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402


def _graph_ms(fn, reps: int = 50) -> float:
    """Mean ms of ``fn`` replayed from a CUDA graph of ``reps`` calls (after a warm-up)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * reps)


def main(argv=None) -> int:
    import triton

    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_gluon import grouped_gemm_fp8_blockwise_gluon
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_triton
    from scripts.check_gluon_fp8 import GROUPED_TAIL_ROWS, _group_lens, _group_offsets, _quantize_grouped

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", type=int, nargs=4, default=[16, 2048, 2048, 768], metavar=("G", "ROWS", "N", "K"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    G, rows, N, K = args.case
    dev = torch.device("cuda")
    unb = _group_lens(G, rows, "unbalanced")
    no_empty = list(unb)
    no_empty[0] -= 200
    no_empty[1] = 200
    variants = [("unbalanced + tail", unb, GROUPED_TAIL_ROWS), ("unbalanced, no tail", unb, 0),
                ("unbalanced, no empty group", no_empty, GROUPED_TAIL_ROWS), ("balanced", [rows] * G, 0),
                ("balanced + tail", [rows] * G, GROUPED_TAIL_ROWS)]
    rows_out = []
    torch.manual_seed(0)
    w = (torch.randn(G, N, K, device=dev) * 0.02).to(torch.bfloat16)
    for name, lens, tail in variants:
        M = sum(lens) + tail
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        a_q, sa, b_q, sb = _quantize_grouped(x, w)
        offs = _group_offsets(lens, dev)
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * sum(lens) * N * K
        r = {"variant": name, "M": M, "lens": lens}
        for impl, fn in (("gluon", lambda: grouped_gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, offs, out=out)),
                         ("tl", lambda: grouped_gemm_fp8_triton(a_q, sa, b_q, sb, "BLOCKWISE", None, offs,
                                                                out_dtype=torch.bfloat16))):
            fn()
            torch.cuda.synchronize()
            r[f"{impl}_bench_ms"] = [float(triton.testing.do_bench(fn, warmup=10, rep=40)) for _ in range(3)]
            r[f"{impl}_graph_ms"] = _graph_ms(fn)
            r[f"{impl}_graph_tflops"] = flops / r[f"{impl}_graph_ms"] / 1e9
        rows_out.append(r)
        print(json.dumps(r), flush=True)
    print(f"\ncase G {G} rows {rows} N {N} K {K}")
    print(f"{'variant':28s} {'gluon do_bench ms (3)':>26s} {'graph':>7s} {'TFLOP/s':>8s} {'tl graph':>9s}")
    for r in rows_out:
        b = " ".join(f"{v:.3f}" for v in r["gluon_bench_ms"])
        print(f"{r['variant']:28s} {b:>26s} {r['gluon_graph_ms']:7.3f} {r['gluon_graph_tflops']:8.0f} "
              f"{r['tl_graph_ms']:9.3f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "diag_grouped_fp8_case.json").write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
