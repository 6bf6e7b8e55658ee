#!/usr/bin/env python3
"""Time the persistent Gluon two-copy FP8 quantizer (triton/quantization/quant_fp8_dual_gluon.py)
against the default bf16-pair kernel and the device copy, bf16 input, E4M3, MX (1 x 32 / 32 x 1)
and BLOCKWISE (1 x 128 / 128 x 1) blocks, for each launch shape of ``--mx-launch`` /
``--bw-launch`` (``STAGESxCTAS``: ring depth x persistent programs per SM).
Bytes moved as benchmarks/bench_quantization.py counts them (x read once + every output written);
"x copy" is that rate over ``y.copy_(x)``'s (2 x bytes of x) measured in the same run. Every
candidate output is compared with the pair kernel's bit for bit first (a mismatch is printed and
that shape's timing skipped).

    PYTHONPATH=. python scripts/diag_quant_dual_gluon.py [--shapes 16384x7168 8192x14336] [--kinds mx blockwise]
        [--rounds 3] [--mx-launch 4x6 2x12] [--bw-launch 2x2 3x2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["16384x7168", "8192x14336", "4096x7168"])
    p.add_argument("--kinds", nargs="+", default=["mx", "blockwise"], choices=("mx", "blockwise"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=int, default=60)
    p.add_argument("--mx-launch", nargs="+", default=["4x6", "2x12", "3x8", "6x4", "8x3"])
    p.add_argument("--bw-launch", nargs="+", default=["2x2", "3x2", "2x1", "4x1", "6x1"])
    args = p.parse_args(argv)
    import triton

    from primus_turbo.triton.quantization import quant_fp8_dual_gluon as D
    from primus_turbo.triton.quantization import quant_fp8_kernel as F8

    e4 = torch.float8_e4m3fn
    groupings = {"mx": (F8.QuantGrouping(1, 1, 32), F8.QuantGrouping(1, 32, 1)),
                 "blockwise": (F8.QuantGrouping(0, 1, 128), F8.QuantGrouping(0, 128, 1))}
    print(f"{'shape':>12s} {'kind':>9s} {'impl':>6s} {'ms':>8s} {'GB/s':>8s} {'x copy':>7s}", flush=True)
    for shape, kind in [(s, k) for s in args.shapes for k in args.kinds]:
        row, col = groupings[kind]
        rows, cols = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
        y = torch.empty_like(x)
        pair = F8.fp8_quant_with_trans_launch(x, e4, row, col)
        moved = x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in pair)
        impls = {"copy": lambda: y.copy_(x), "pair": lambda: F8.fp8_quant_with_trans_launch(x, e4, row, col)}
        for spec in (args.mx_launch if kind == "mx" else args.bw_launch):
            st, ct = (int(v) for v in spec.split("x"))
            try:
                cand = D.fp8_dual_gluon(x, e4, row, col, stages=st, ctas_per_sm=ct)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - e.g. a ring too large for shared memory
                print(f"{shape:>12s} {kind:>9s} g{spec:>5s} ERROR {type(exc).__name__}: {str(exc)[:120]}")
                continue
            bad = [n for n, a, b in zip(("q", "s", "qt", "st"), pair, cand)
                   if not torch.equal(a.view(torch.uint8), b.view(torch.uint8))]
            if bad:
                print(f"{shape:>12s} {kind:>9s} g{spec:>5s} MISMATCH in {bad}")
                continue
            impls[f"g{spec}"] = (lambda st=st, ct=ct: D.fp8_dual_gluon(x, e4, row, col, stages=st, ctas_per_sm=ct))
        ms = {k: [] for k in impls}
        for rnd in range(args.rounds):
            names = list(impls)
            names = names[rnd % len(names):] + names[:rnd % len(names)]  # rotated: clocks drift under load
            for k in names:
                fn = impls[k]
                ms[k].append(triton.testing.do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median"))
        med = {k: statistics.median(v) for k, v in ms.items()}
        copy_rate = 2 * x.numel() * x.element_size() / med["copy"]
        for k in impls:
            b = 2 * x.numel() * x.element_size() if k == "copy" else moved
            rate = b / med[k]
            print(f"{shape:>12s} {kind:>9s} {k:>6s} {med[k]:8.4f} {rate / 1e6:8.1f} {rate / copy_rate:7.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
