#!/usr/bin/env python3
"""Grouped GEMM forward+backward (bf16, ``w [G, N, K]``, balanced groups) under the op's default
against ``torch._grouped_mm``, with the grad_weight's kernel and the op's autograd form varied:

* ``default``: what the op does (the vendor route; the Gluon variable-K wgrad from
  ``GLUON_WGRAD_MIN_FLOPS`` up, the torch-native form below it);
* ``vendor wgrad``: the threshold raised out of reach (every GEMM on the vendor kernel, the native form);
* ``vendor wgrad, Function``: the same GEMMs through the op's ``autograd.Function``.

Interleaved ``do_bench`` rounds (grads reset each call), then the GPU kernels of one default step
(torch.profiler): device time against wall time tells the wgrad kernel's cost from host time.

    PYTHONPATH=. python scripts/diag_grouped_wgrad_route.py --out DIR [--shape G ROWS N K ...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.common import time_interleaved  # noqa: E402
from scripts.diag_fp8_linear import _profile  # noqa: E402
from scripts.diag_host_autograd import balanced_operands  # noqa: E402

SHAPES = ((1, 4096, 5760, 2880), (1, 1024, 4096, 14336), (4, 1024, 3072, 4096), (8, 1024, 4096, 1536),
          (4, 1024, 5760, 2880), (2, 4096, 2880, 2880), (8, 4096, 2048, 768), (32, 2048, 4096, 7168),
          (8, 2048, 7168, 2048))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", type=int, nargs=4, action="append", metavar=("G", "ROWS", "N", "K"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=float, default=40)
    args = p.parse_args(argv)
    import primus_turbo.pytorch as turbo
    import primus_turbo.pytorch.backends.grouped_gemm as bg

    ops_mod = sys.modules["primus_turbo.pytorch.ops.grouped_gemm"]

    @contextlib.contextmanager
    def patched(vendor_wgrad: bool, function: bool):
        saved = (bg.GLUON_WGRAD_MIN_FLOPS, ops_mod.GLUON_WGRAD_MIN_FLOPS, ops_mod._native_ok)
        if vendor_wgrad:
            bg.GLUON_WGRAD_MIN_FLOPS = ops_mod.GLUON_WGRAD_MIN_FLOPS = float("inf")
        if function:
            ops_mod._native_ok = lambda *x: False
        try:
            yield
        finally:
            bg.GLUON_WGRAD_MIN_FLOPS, ops_mod.GLUON_WGRAD_MIN_FLOPS, ops_mod._native_ok = saved

    dev = torch.device("cuda")
    lines = []
    for G, rows, N, K in args.shape or SHAPES:
        M = G * rows
        lens, offs, offs32, a, w, grad = balanced_operands(G, rows, N, K, dev)

        def op():
            turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True).backward(grad)

        steps = {
            "torch": (lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32).backward(grad),
                      contextlib.nullcontext),
            "default": (op, contextlib.nullcontext),
            "vendor wgrad": (op, lambda: patched(True, False)),
            "vendor wgrad, Function": (op, lambda: patched(True, True)),
        }
        times, errors = time_interleaved(steps, args.rounds, 10, args.rep_ms, [a, w])
        base = statistics.median(times["torch"])
        head = f"== G{G} rows{rows} N{N} K{K} (2MNK {2.0 * M * N * K:.2e})"
        parts = [f"{k} {statistics.median(v):.4f} ms ({base / statistics.median(v):.3f})" for k, v in times.items()]
        line = head + ": " + "; ".join(parts) + (f" errors {errors}" if errors else "")
        print(line, flush=True)
        lines.append(line)
        a.grad = w.grad = None
        lines.append(_profile(lambda: (op(), setattr(a, "grad", None), setattr(w, "grad", None))))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "diag_grouped_wgrad_route.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
