"""RMSNorm / SwiGLU / GeGLU benchmark: achieved memory bandwidth, forward and backward, against a device copy.

Cases (bf16): RMSNorm on ``[16384, 4096]`` and ``[16384, 7168]``; SwiGLU and GeGLU on ``x [32768, 2 x 2048]``.
Timed per case, interleaved in the same run:

- ``device-copy``: ``y.copy_(x)`` of the case's input (the peer; GB/s = 2 * bytes of x),
- RMSNorm cases: ``rmsnorm_fwd``, ``rmsnorm_bwd``, ``rmsnorm_residual_fwd``, ``rmsnorm_residual_bwd``,
- SwiGLU case: ``swiglu_fwd``, ``swiglu_bwd``, ``swiglu_probs_fwd``, ``swiglu_probs_bwd`` (probs and a
  row mask with 10 % padding rows), and ``geglu_probs_fwd``, ``geglu_probs_bwd``
  (``geglu_with_probs``: tanh-approximated GELU, the same probs and mask; these rows have ``op``
  ``"geglu"``). There is no plain ``geglu`` op (only ``swiglu`` has a variant without probs).

Backward rows time the backward kernel entry alone (the saved tensors are made once). GB/s counts
the bytes each call must move (every tensor read once and written once: RMSNorm fwd x, gamma -> y,
rstd; bwd dy, x, gamma, rstd -> dx (+ the dgamma partials); the residual variants add residual / s
and ds; SwiGLU / GeGLU fwd x -> out, bwd dout, x -> dx, plus probs / mask / dprobs: the GeGLU rows
count exactly what the ``swiglu_probs`` rows do). ``speedup`` is the
GB/s ratio to the copy. Correctness: each op on the first 256 rows against the float64 reference
of primus_turbo.testing (``snr_db``; bwd: the SNR of dx).

    python benchmarks/bench_norm_act.py --out benchmarks/results/h200
    python benchmarks/bench_norm_act.py --out /tmp/b --quick             # one case of each op
    python benchmarks/bench_norm_act.py --out /tmp/b --quick --cpu-smoke # tiny shapes, no GPU
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
from benchmarks.common import bandwidth_rows  # noqa: E402
from benchmarks.common import error_text as _error_text  # noqa: E402

RESULT_NAME = "norm_act"
CASES = (("rmsnorm", 16384, 4096), ("rmsnorm", 16384, 7168), ("swiglu", 32768, 2 * 2048))
QUICK_CASES = (("rmsnorm", 16384, 4096), ("swiglu", 32768, 2 * 2048))
SMOKE_DIV = 64  # --cpu-smoke divides each dim by this (at least 64)
CHECK_ROWS = 256
PEER = "device-copy"
NORM_IMPLS = ("rmsnorm_fwd", "rmsnorm_bwd", "rmsnorm_residual_fwd", "rmsnorm_residual_bwd")
ACT_IMPLS = ("swiglu_fwd", "swiglu_bwd", "swiglu_probs_fwd", "swiglu_probs_bwd", "geglu_probs_fwd",
             "geglu_probs_bwd")
IMPLS = (PEER, *NORM_IMPLS, *ACT_IMPLS)
ROUNDS = 3
EPS = 1e-6


def _nbytes(*ts: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _snr_of(fn: Callable, ref: Callable) -> float:
    from primus_turbo.testing import snr_db

    return snr_db(ref(), fn())


def _norm_impl(name: str, x: torch.Tensor, gen: torch.Generator):
    """(step, bytes moved, snr check)."""
    from primus_turbo.pytorch.ops import normalization as N
    from primus_turbo.testing import rmsnorm_ref

    rows, h = x.shape
    g = torch.randn(h, device=x.device, dtype=x.dtype, generator=gen)
    res = "residual" in name
    r = torch.randn(x.shape, device=x.device, dtype=x.dtype, generator=gen) if res else None
    xs, rs = x[:CHECK_ROWS], (r[:CHECK_ROWS] if res else None)
    if name.endswith("_fwd"):
        def step():
            return N._fwd_eager(x, g, EPS, False, r)

        y, s, rstd = step()
        moved = _nbytes(x, r, g, y, rstd) + (_nbytes(s) if res else 0)

        def check():
            y_s, s_s, _ = N._fwd_eager(xs, g, EPS, False, rs)
            return _snr_of(lambda: y_s, lambda: rmsnorm_ref(s_s if res else xs, g, EPS))
        return step, moved, check
    y, s, rstd = N._fwd_eager(x, g, EPS, False, r)
    s = s if res else x
    dy = torch.randn(x.shape, device=x.device, dtype=x.dtype, generator=gen)
    ds = torch.randn(x.shape, device=x.device, dtype=x.dtype, generator=gen) if res else None

    def step():
        return N._bwd_eager(dy, s, g, rstd, False, ds)

    dx, dg = step()
    moved = _nbytes(dy, s, g, rstd, dx, ds, dg)

    def check():
        s64 = s[:CHECK_ROWS].double().requires_grad_()
        rmsnorm_ref(s64, g, EPS).backward(dy[:CHECK_ROWS].double())
        ref = s64.grad + (ds[:CHECK_ROWS].double() if res else 0)
        dx_s, _ = N._bwd_eager(dy[:CHECK_ROWS].contiguous(), s[:CHECK_ROWS].contiguous(), g,
                               rstd[:CHECK_ROWS].contiguous(), False,
                               ds[:CHECK_ROWS].contiguous() if res else None)
        return _snr_of(lambda: dx_s, lambda: ref)
    return step, moved, check


def _act_impl(name: str, x: torch.Tensor, gen: torch.Generator):
    from primus_turbo.pytorch.ops import activation as A
    from primus_turbo.testing import geglu_with_probs_ref, swiglu_with_probs_ref

    # the activation code the kernels take (A._ACTS: silu 0, gelu_tanh 1) and its float64 reference
    geglu = name.startswith("geglu")
    act = A._ACTS["gelu_tanh" if geglu else "silu"]
    ref_fn = geglu_with_probs_ref if geglu else swiglu_with_probs_ref
    rows = x.shape[0]
    probs = mask = None
    if "probs" in name:
        probs = torch.rand(rows, device=x.device, generator=gen)
        mask = (torch.rand(rows, device=x.device, generator=gen) > 0.1).view(torch.uint8)
    pc = probs[:CHECK_ROWS] if probs is not None else None
    mc = mask[:CHECK_ROWS] if mask is not None else None
    ones = torch.ones(min(rows, CHECK_ROWS), device=x.device)
    xs = x[:CHECK_ROWS]
    if name.endswith("_fwd"):
        def step():
            return A._fwd_eager(x, act, probs, mask)

        out = step()
        moved = _nbytes(x, probs, mask, out)

        def check():
            return _snr_of(lambda: A._fwd_eager(xs, act, pc, mc),
                           lambda: ref_fn(xs, pc if pc is not None else ones, mc))
        return step, moved, check
    dout = torch.randn(rows, x.shape[1] // 2, device=x.device, dtype=x.dtype, generator=gen)

    def step():
        return A._bwd_eager(dout, x, act, probs, mask)

    dx, dp = step()
    moved = _nbytes(dout, x, probs, mask, dx, dp)

    def check():
        x64 = xs.double().requires_grad_()
        ref_fn(x64, pc if pc is not None else ones, mc).backward(dout[:CHECK_ROWS].double())
        return _snr_of(lambda: A._bwd_eager(dout[:CHECK_ROWS].contiguous(), xs, act, pc, mc)[0], lambda: x64.grad)
    return step, moved, check


def run_case(case: tuple[str, int, int], device: torch.device, warmup_ms: float, rep_ms: float,
             impls: Sequence[str], log: Callable[[Row], None]) -> list[Row]:
    op, rows, cols = case
    gen = torch.Generator(device=device).manual_seed(rows * 131 + cols)
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16, generator=gen)
    y = torch.empty_like(x)
    name = f"{op} {rows}x{cols}"
    extra_base: dict[str, Any] = {"shape": f"{rows}x{cols}", "dtype": "bf16", "op": op}
    steps: dict[str, Callable[[], Any]] = {PEER: lambda: y.copy_(x)}
    moved: dict[str, int] = {PEER: 2 * _nbytes(x)}
    out_rows: dict[str, Row] = {PEER: Row(op, name, PEER, PEER, snr_db=float("inf"), extra=dict(extra_base))}
    mine = [i for i in (NORM_IMPLS if op == "rmsnorm" else ACT_IMPLS) if i in impls]
    for impl in mine:
        row_op = "geglu" if impl.startswith("geglu") else op  # GeGLU rows ride on the SwiGLU case's shape
        row = Row(row_op, name, impl, PEER, extra=dict(extra_base, op=row_op))
        out_rows[impl] = row
        try:
            make = _norm_impl if op == "rmsnorm" else _act_impl
            step, nbytes, check = make(impl, x, gen)
            moved[impl] = nbytes
            row.snr_db = check()
            steps[impl] = step
        except Exception as exc:
            row.error = _error_text(exc)
            if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                traceback.print_exc()
    result = bandwidth_rows(steps, out_rows, moved, PEER, ROUNDS, warmup_ms, rep_ms, log)
    del x, y, steps
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _print_row(row: Row) -> None:
    print_bandwidth_row(row, f"{row.case:22s}", 22, f"{row.snr_db:.1f} dB" if row.snr_db is not None else "-")

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="result directory (default: benchmarks/results/<gpu-slug>)")
    p.add_argument("--quick", action="store_true", help="one RMSNorm and one SwiGLU/GeGLU case")
    p.add_argument("--cpu-smoke", action="store_true", help=f"tiny shapes (dims / {SMOKE_DIV}); runs without a GPU")
    p.add_argument("--norm-act-impls", nargs="+", default=list(IMPLS), choices=IMPLS, help="which to time")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 25; 0 with --cpu-smoke)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench time per round (default 100; 0 with --cpu-smoke)")
    args, _unknown = p.parse_known_args(argv)  # run_all passes other benchmarks' options through
    return args


def run(args: argparse.Namespace) -> tuple[Path, list[Row]]:
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_smoke:
        raise SystemExit("bench_norm_act: no CUDA device; use --cpu-smoke for a functional smoke run")
    if args.cpu_smoke and not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        print("bench_norm_act: --cpu-smoke on CPU checks that everything runs; timings mean nothing.")
    device = torch.device("cuda" if has_cuda else "cpu")
    cases = list(QUICK_CASES if args.quick else CASES)
    if args.cpu_smoke:
        cases = [(op, max(64, r // SMOKE_DIV), max(64, c // SMOKE_DIV)) for op, r, c in cases]
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.cpu_smoke else 25.0)
    rep_ms = args.rep_ms if args.rep_ms is not None else (0.0 if args.cpu_smoke else 100.0)
    out_dir = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()
    print(f"bench_norm_act: {len(cases)} cases on {device}", flush=True)
    rows: list[Row] = []
    for case in cases:
        rows.extend(run_case(case, device, warmup_ms, rep_ms, args.norm_act_impls, _print_row))
    path = finish_run(rows, out_dir, RESULT_NAME)
    return path, rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
