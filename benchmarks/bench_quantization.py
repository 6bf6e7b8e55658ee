"""Quantization benchmark: achieved memory bandwidth of each quantizer against a device copy.

For bf16 ``x`` of each shape (default ``[4096, 7168]``, ``[16384, 7168]``, ``[16384, 4096]``,
``[8192, 14336]``) the following are timed:

- ``device-copy``: ``y.copy_(x)`` (the peer; GB/s = 2 * bytes of x),
- ``tensorwise``, ``rowwise``, ``blockwise_1x128``, ``blockwise_128x128``, ``mx``: ``quantize_fp8``
  to E4M3,
- ``with_trans_blockwise``, ``with_trans_mx``: ``quantize_fp8_with_trans`` (both copies),
- ``fp4``, ``fp4_with_trans``: MXFP4.

GB/s counts the bytes each call must move: x read (twice for TENSORWISE, whose amax pass reads it
before the scale+cast pass), every output written, scales included. ``speedup`` is the ratio of a
quantizer's GB/s to the copy's GB/s (1.0 = copy speed). Correctness: the same quantizer on the first
256 rows is compared bit for bit with ``primus_turbo.testing.quant_ref`` (``snr_db`` = inf when
exact; ``extra["mismatches"]`` counts differing bytes of data + scales).

    python benchmarks/bench_quantization.py --out benchmarks/results/h200
    python benchmarks/bench_quantization.py --out /tmp/b --quick             # [4096, 7168] only
    python benchmarks/bench_quantization.py --out /tmp/b --quick --cpu-smoke # tiny shapes, no GPU
    python benchmarks/bench_quantization.py --out /tmp/b --timing graph      # device time alone

Under ``do_bench`` (the default) a call's host time counts where it exceeds the L2 flush that runs
before it on the GPU: at the smaller shapes the ops' Python path (validation, allocation, the
launch) shows in every quantizer's row and not in the copy's; ``--timing graph`` measures device
time alone.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.common import Row, finish_run, gpu_slug, print_bandwidth_row  # noqa: E402
from benchmarks.common import bandwidth_rows, set_timing  # noqa: E402
from benchmarks.common import error_text as _error_text  # noqa: E402

RESULT_NAME = "quantization"
SHAPES = ((4096, 7168), (16384, 7168), (16384, 4096), (8192, 14336))
QUICK_SHAPES = ((4096, 7168),)
SMOKE_DIV = 64  # --cpu-smoke divides each dim by this (rounded up to a multiple of 64)
CHECK_ROWS = 256  # rows of x the bit-exactness check runs on
PEER = "device-copy"
IMPLS = (
    "device-copy", "tensorwise", "rowwise", "blockwise_1x128", "blockwise_128x128", "mx",
    "with_trans_blockwise", "with_trans_mx", "fp4", "fp4_with_trans",
)
ROUNDS = 3  # interleaved timing rounds (median of the round medians)


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _make(name: str) -> tuple[Callable, Callable]:
    """(fn(x) -> outputs, ref(x) -> outputs) for one quantizer."""
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe
    from primus_turbo.pytorch.ops import quantization as Q
    from primus_turbo.testing import quant_ref as R

    e4m3 = torch.float8_e4m3fn
    r2d = ScalingRecipe(use_2d_block=True)
    table: dict[str, tuple[Callable, Callable]] = {
        "tensorwise": (lambda x: Q.quantize_fp8(x, e4m3, G.TENSORWISE),
                       lambda x: R.quantize_fp8_ref(x, e4m3, G.TENSORWISE)),
        "rowwise": (lambda x: Q.quantize_fp8(x, e4m3, G.ROWWISE),
                    lambda x: R.quantize_fp8_ref(x, e4m3, G.ROWWISE)),
        "blockwise_1x128": (lambda x: Q.quantize_fp8(x, e4m3, G.BLOCKWISE),
                            lambda x: R.quantize_fp8_ref(x, e4m3, G.BLOCKWISE)),
        "blockwise_128x128": (lambda x: Q.quantize_fp8(x, e4m3, G.BLOCKWISE, scaling_recipe=r2d),
                              lambda x: R.quantize_fp8_ref(x, e4m3, G.BLOCKWISE, scaling_recipe=r2d)),
        "mx": (lambda x: Q.quantize_fp8(x, e4m3, G.MX_BLOCKWISE),
               lambda x: R.quantize_fp8_ref(x, e4m3, G.MX_BLOCKWISE)),
        "with_trans_blockwise": (
            lambda x: Q.quantize_fp8_with_trans(x, e4m3, G.BLOCKWISE),
            lambda x: (*R.quantize_fp8_ref(x, e4m3, G.BLOCKWISE),
                       *R.quantize_fp8_ref(x.t().contiguous(), e4m3, G.BLOCKWISE))),
        "with_trans_mx": (
            lambda x: Q.quantize_fp8_with_trans(x, e4m3, G.MX_BLOCKWISE),
            lambda x: (*R.quantize_fp8_ref(x, e4m3, G.MX_BLOCKWISE),
                       *R.quantize_fp8_ref(x.t().contiguous(), e4m3, G.MX_BLOCKWISE))),
        "fp4": (lambda x: Q.quantize_fp4(x), lambda x: R.quantize_fp4_ref(x)),
        "fp4_with_trans": (lambda x: Q.quantize_fp4_with_trans(x),
                           lambda x: (*R.quantize_fp4_ref(x), *R.quantize_fp4_ref(x.t().contiguous()))),
    }
    return table[name]


def _mismatches(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> int:
    n = 0
    for o, r in zip(outs, refs):
        o, r = o.detach().cpu(), r.detach().cpu()
        if o.shape != r.shape:
            return max(o.numel(), r.numel(), 1)
        if o.element_size() == 1:
            o, r = o.view(torch.uint8), r.view(torch.uint8)
        n += int((o != r).sum())
    return n



def run_shape(shape: tuple[int, int], impls: Sequence[str], device: torch.device, warmup_ms: float,
              rep_ms: float, log: Callable[[Row], None]) -> list[Row]:
    rows, cols = shape
    gen = torch.Generator(device=device).manual_seed(rows * 131 + cols)
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16, generator=gen)
    x_bytes = _nbytes(x)
    y = torch.empty_like(x)
    extra_base: dict[str, Any] = {"shape": f"{rows}x{cols}", "dtype": "bf16"}
    case = f"{rows}x{cols}"
    steps: dict[str, Callable[[], Any]] = {PEER: lambda: y.copy_(x)}
    moved: dict[str, int] = {PEER: 2 * x_bytes}
    out_rows: dict[str, Row] = {PEER: Row("quantize", case, PEER, PEER, snr_db=float("inf"), extra=dict(extra_base))}
    for name in impls:
        if name == PEER:
            continue
        row = Row("quantize", case, name, PEER, extra=dict(extra_base))
        out_rows[name] = row
        try:
            fn, ref = _make(name)
            outs = fn(x)
            moved[name] = x_bytes * (2 if name == "tensorwise" else 1) + _nbytes(*outs)
            del outs
            xs = x[:CHECK_ROWS].contiguous()
            bad = _mismatches(fn(xs), ref(xs))
            row.extra["mismatches"] = bad
            row.snr_db = float("inf") if bad == 0 else None
            if bad:
                row.error = f"{bad} bytes differ from quant_ref on x[:{CHECK_ROWS}]"
            steps[name] = (lambda fn=fn: fn(x))
        except Exception as exc:
            row.error = _error_text(exc)
            if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                traceback.print_exc()
    result = bandwidth_rows(steps, out_rows, moved, PEER, ROUNDS, warmup_ms, rep_ms, log)
    del x, y
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _print_row(row: Row) -> None:
    # the error line keeps the case name; a timed line leads with the shape
    label = row.case if row.error and row.ms is None else row.extra.get("shape", "")
    exact = "exact" if row.snr_db == float("inf") else (row.error or "-")
    print_bandwidth_row(row, f"{label:14s}", 22, exact)

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="result directory (default: benchmarks/results/<gpu-slug>)")
    p.add_argument("--quick", action="store_true", help="only [4096, 7168]")
    p.add_argument("--cpu-smoke", action="store_true", help=f"tiny shapes (dims / {SMOKE_DIV}); runs without a GPU")
    p.add_argument("--quantizers", nargs="+", default=list(IMPLS), choices=IMPLS,
                   help="which to time (named so as not to clash with bench_gemm's --impls under run_all)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 25; 0 with --cpu-smoke)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench time per round (default 100; 0 with --cpu-smoke)")
    p.add_argument("--timing", choices=("do_bench", "graph"), default="do_bench",
                   help="do_bench (a call's host time shows where it exceeds the L2 flush's head start: small "
                        "shapes) or graph (device time alone: CUDA-graph replay, L2 flushed before every call)")
    args, _unknown = p.parse_known_args(argv)  # run_all passes the GEMM options through: ignore them
    return args


def run(args: argparse.Namespace) -> tuple[Path, list[Row]]:
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_smoke:
        raise SystemExit("bench_quantization: no CUDA device; use --cpu-smoke for a functional smoke run")
    if args.cpu_smoke and not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        print("bench_quantization: --cpu-smoke on CPU checks that everything runs; timings mean nothing.")
    device = torch.device("cuda" if has_cuda else "cpu")
    shapes = list(QUICK_SHAPES if args.quick else SHAPES)
    if args.cpu_smoke:
        shapes = [tuple(max(64, -(-(d // SMOKE_DIV) // 64) * 64) for d in s) for s in shapes]
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.cpu_smoke else 25.0)
    rep_ms = args.rep_ms if args.rep_ms is not None else (0.0 if args.cpu_smoke else 100.0)
    impls = list(args.quantizers)
    if PEER not in impls:
        impls.insert(0, PEER)
    out_dir = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()
    if args.timing == "graph" and has_cuda:
        set_timing("graph")
    print(f"bench_quantization: {len(shapes)} shapes x {len(impls)} impls on {device}, {args.timing} timing",
          flush=True)
    rows: list[Row] = []
    try:
        for shape in shapes:
            rows.extend(run_shape(shape, impls, device, warmup_ms, rep_ms, _print_row))
    finally:
        set_timing("do_bench")
    for row in rows:  # what measured the row: without CUDA the perf_counter loop, whatever was asked
        row.extra["timing"] = args.timing if has_cuda else "perf_counter"
    path = finish_run(rows, out_dir, RESULT_NAME)
    return path, rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
