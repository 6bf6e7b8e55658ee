"""Spread of the two-copy FP8 quantizer's time over fresh allocations (H100/H200).

Each trial allocates a pad of random size first (so the input and the outputs land at other
addresses), a fresh bf16 input, then times every configuration (interleaved, ``do_bench`` median)
and a device copy of the input. Prints, per configuration, the ratio to the copy (full bytes, as
scripts/tune_quant.py counts them) per trial and its min / median / max: a configuration whose
ratio moves between trials by more than the copy's spread depends on where its buffers lie.

    PYTHONPATH=. python scripts/diag_quant_spread.py [--shapes 16384x7168 8192x14336] [--trials 10]
        [--timing graph]

``--timing graph``: device time alone (benchmarks/common.graph_ms: calls captured in a CUDA graph
with an L2 flush before each, the flushes' own graph subtracted); the default ``do_bench`` counts a
call's host time where it outlasts the flush before it. Each configuration's host time per call
(launches queued without waiting, wall clock) is printed too.
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

CONFIGS = {
    "mx": [(128, 128, 4, "packed2"), (64, 128, 4, "packed2", 0, "tscale")],
    # BLOCKWISE: the default (3 programs of 4 warps per SM), 4 programs (128 registers), 3 programs of
    # 8 warps (80 registers); none spills (sm_90 compile)
    "blockwise": [(128, 128, 4, "packed2", 168, "inreg"), (128, 128, 4, "packed2", 168, "inreg,tscale"),
                  (128, 128, 4, "packed2", 128, "inreg,tscale"), (128, 128, 8, "packed2", 80, "inreg,tscale")],
    "fp4": [(128, 64, 4, "packed", 0, "tscale"), ("gluon", 4, 1, 4, 128, 4, 4), ("gluon", 4, 1, 4),
            ("gluon", 4, 1, 8, 128, 4, 2)],
}


def main(argv=None) -> int:
    import triton

    from primus_turbo.triton.quantization import quant_fp4_kernel as F4
    from primus_turbo.triton.quantization import quant_fp8_kernel as F8

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["16384x7168", "8192x14336"])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--kinds", nargs="+", default=list(CONFIGS))
    p.add_argument("--timing", choices=("do_bench", "graph"), default="do_bench")
    args = p.parse_args(argv)
    import time

    from benchmarks.common import graph_ms

    def timed(fn):
        if args.timing == "graph":
            return graph_ms(fn)
        return triton.testing.do_bench(fn, warmup=10, rep=50)

    host: dict = {}
    gen = torch.Generator().manual_seed(1234)
    e4 = torch.float8_e4m3fn
    for shape in args.shapes:
        rows, cols = (int(v) for v in shape.split("x"))
        res: dict = {}
        for t in range(args.trials):
            pad_mb = int(torch.randint(0, 96, (1,), generator=gen))
            pad = torch.empty(pad_mb * (1 << 20) + 256 * int(torch.randint(0, 4096, (1,), generator=gen)),
                              dtype=torch.uint8, device="cuda")
            x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
            y = torch.empty_like(x)
            t_copy = timed(lambda: y.copy_(x))
            copy_bw = 4 * x.numel() / t_copy
            for kind in args.kinds:
                mx = kind == "mx"
                row = F8.QuantGrouping(1, 1, 32) if mx else F8.QuantGrouping(0, 1, 128)
                col = F8.QuantGrouping(1, 32, 1) if mx else F8.QuantGrouping(0, 128, 1)
                if kind == "fp4":  # bf16 read, two E2M1 copies, E8M0 scales of both
                    nbytes = 3 * x.numel() + 2 * (x.numel() // 32)
                else:
                    nbytes = 4 * x.numel() + 2 * (x.numel() // (32 if mx else 128)) * (1 if mx else 4)
                for cfg in CONFIGS[kind]:
                    if kind == "fp4":
                        f = (lambda c=cfg: F4.fp4_quant_launch(x, True, with_trans=True, tile=c))
                    else:
                        f = (lambda c=cfg: F8.fp8_quant_with_trans_launch(x, e4, row, col, tile=c))
                    ms = timed(f)
                    res.setdefault((kind, cfg), []).append(nbytes / ms / copy_bw)
                    if t == 0:  # host time per call: 20 calls queued, then one wait
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(20):
                            f()
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        host[(kind, cfg)] = (t1 - t0) / 20 * 1e6
            res.setdefault(("copy", "TB/s"), []).append(copy_bw / 1e9)
            del pad, x, y
            torch.cuda.empty_cache()
            print(f"{shape} trial {t} pad {pad_mb} MB done", flush=True)
        print(f"\n{shape}: ratio to the copy per trial; min / median / max")
        for (kind, cfg), v in res.items():
            vals = " ".join(f"{a:.3f}" for a in v)
            h = f"host {host[(kind, cfg)]:5.1f} us" if (kind, cfg) in host else ""
            print(f"{kind:10s} {str(cfg):44s} {min(v):.3f} / {statistics.median(v):.3f} / {max(v):.3f}   [{vals}] {h}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
