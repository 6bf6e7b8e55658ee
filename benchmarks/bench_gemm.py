"""BF16 GEMM benchmark on the per-layer GEMMs of real dense LLMs.

For every model in ``DENSE_BENCH_MODELS`` and every case of ``dense_gemm_shapes`` (``qkv``,
``attn_out``, ``gate_up``, ``down``, ``lm_head``) at each M (tokens), ``out = a @ w.T`` with
``a: [M, K]`` and an ``nn.Linear``-style weight ``w: [N, K]`` (``trans_b=True``) is timed for:

- ``cublas``: ``torch.matmul(a, w.t())`` (the peer; plain torch autograd for fwd+bwd),
- ``turbo-default``: ``turbo.ops.gemm(a, w, trans_b=True)`` with no backend pin,
- ``turbo-triton``: the same with the GEMM backend pinned to TRITON,

forward only (``gemm_fwd``, 2MNK flops) and forward+backward (``gemm_fwd_bwd``, 6MNK flops).
Identical (M, N, K) from different models are timed once. Accuracy: SNR of the forward output
(and, for fwd+bwd, of both gradients, in ``extra``) on the first 256 rows against float64.

    python benchmarks/bench_gemm.py --out benchmarks/results/h200
    python benchmarks/bench_gemm.py --out /tmp/b --quick            # Llama-3.1-8B, M=4096
    python benchmarks/bench_gemm.py --out /tmp/b --quick --cpu-smoke # tiny shapes, no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.common import Row, finish_run, gpu_slug, print_compute_row  # noqa: E402
from benchmarks.common import error_text as _error_text  # noqa: E402
from benchmarks.common import free_memory as _free  # noqa: E402
from benchmarks.common import record_times, time_interleaved  # noqa: E402
from primus_turbo.testing import DENSE_BENCH_MODELS, dense_gemm_shapes, snr_db  # noqa: E402

RESULT_NAME = "gemm_bf16"
DEFAULT_M = (4096, 16384)
QUICK_MODELS = ("Llama-3.1-8B",)
QUICK_M = (4096,)
SMOKE_DIV = 64  # --cpu-smoke divides M, N and K by this
REF_ROWS = 256  # rows of the output (and of grad_a / grad_w) checked against float64
PEER = "cublas"
IMPLS = ("cublas", "turbo-default", "turbo-triton")
MODES = ("fwd", "fwd_bwd")
ROUNDS = 5  # interleaved timing rounds per implementation (median of the round medians)


# ---- cases ----------------------------------------------------------------------------------
def build_cases(
    models: Sequence[str], ms: Sequence[int], div: int = 1, only_cases: Optional[Sequence[str]] = None
) -> list[dict[str, Any]]:
    """Unique (M, N, K) over models x cases x M, first name kept, the others in ``also``."""
    seen: dict[tuple[int, int, int], dict[str, Any]] = {}
    for m in ms:
        for model in models:
            for case, mm, n, k in dense_gemm_shapes(model, m):
                if only_cases and case not in only_cases:
                    continue
                shape = tuple(max(16, x // div) for x in (mm, n, k)) if div > 1 else (mm, n, k)
                name = f"{model}:{case}"
                if shape in seen:
                    seen[shape]["also"].append(name)
                    continue
                seen[shape] = {"case": name, "M": shape[0], "N": shape[1], "K": shape[2], "also": []}
    return list(seen.values())


# ---- implementations ------------------------------------------------------------------------
class _Impl:
    def __init__(self, name: str, fn: Optional[Callable], ctx: Callable[[], Any], why_not: Optional[str] = None):
        self.name, self.fn, self.ctx, self.why_not = name, fn, ctx, why_not


def _make_impls(names: Sequence[str]) -> list[_Impl]:
    impls: list[_Impl] = []
    turbo_err: Optional[str] = None
    turbo = gbm = backend_type = None
    if any(n != PEER for n in names):
        try:
            import primus_turbo.pytorch as turbo  # noqa: F811
            import primus_turbo.pytorch.ops  # noqa: F401  (makes turbo.ops an attribute)
            from primus_turbo.pytorch.core.backend import BackendType as backend_type  # noqa: N813
            from primus_turbo.pytorch.core.backend import GlobalBackendManager as gbm

            if not hasattr(turbo, "ops") or not hasattr(turbo.ops, "gemm"):
                turbo_err = "primus_turbo.pytorch.ops.gemm is not available"
        except Exception as exc:
            turbo_err = f"import primus_turbo.pytorch failed: {exc!r}"

    @contextlib.contextmanager
    def no_pin() -> Iterator[None]:
        if gbm is not None:
            gbm.reset()
        try:
            yield
        finally:
            if gbm is not None:
                gbm.reset()

    @contextlib.contextmanager
    def pin_triton() -> Iterator[None]:
        gbm.reset()
        gbm.set_gemm_backend(backend_type.TRITON)
        try:
            yield
        finally:
            gbm.reset()

    for name in names:
        if name == PEER:
            impls.append(_Impl(name, lambda a, w: torch.matmul(a, w.t()), contextlib.nullcontext))
        elif name in ("turbo-default", "turbo-triton"):
            if turbo_err:
                impls.append(_Impl(name, None, contextlib.nullcontext, turbo_err))
                continue
            fn = lambda a, w: turbo.ops.gemm(a, w, trans_b=True)  # noqa: E731
            impls.append(_Impl(name, fn, no_pin if name == "turbo-default" else pin_triton))
        else:
            raise ValueError(f"unknown impl {name!r}; known: {', '.join(IMPLS)}")
    return impls


# ---- one case -------------------------------------------------------------------------------
def _snr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return snr_db(ref, out.detach())




def run_case(
    case: dict[str, Any],
    impls: Sequence[_Impl],
    modes: Sequence[str],
    device: torch.device,
    warmup_ms: float,
    rep_ms: float,
    log: Callable[[Row], None],
) -> list[Row]:
    m, n, k = case["M"], case["N"], case["K"]
    extra_base = {"M": m, "N": n, "K": k, "dtype": "bf16", "trans_b": True, "also": case["also"]}
    rows: list[Row] = []
    gen = torch.Generator(device=device).manual_seed(hash((m, n, k)) & 0x7FFFFFFF)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device=device, dtype=torch.float32, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    r = min(REF_ROWS, m)
    w64 = w.double()
    ref_out = a[:r].double() @ w64.t()  # [r, N]

    for mode in modes:
        op = f"gemm_{mode}"
        flops = (2 if mode == "fwd" else 6) * m * n * k
        grad = a_g = w_g = None
        ref_ga = ref_gw = None
        try:
            if mode == "fwd_bwd":
                grad = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)
                a_g = a.detach().clone().requires_grad_(True)
                w_g = w.detach().clone().requires_grad_(True)
                rw = min(REF_ROWS, n)
                ref_ga = grad[:r].double() @ w64  # grad_a[:r]: [r, K]
                ref_gw = grad[:, :rw].double().t() @ a.double()  # grad_w[:rw]: [rw, K]
        except Exception as exc:  # e.g. out of memory for the references
            for impl in impls:
                row = Row(op, case["case"], impl.name, PEER, error=_error_text(exc), extra=dict(extra_base))
                rows.append(row)
                log(row)
            _free(device)
            continue

        baseline_ms: Optional[float] = None
        mode_rows: list[Row] = []
        steps: dict[int, Callable[[], Any]] = {}
        # Pass 1: correctness, which also compiles and tunes every implementation.
        for i, impl in enumerate(impls):
            row = Row(op, case["case"], impl.name, PEER, extra=dict(extra_base))
            mode_rows.append(row)
            if impl.why_not:
                row.error = impl.why_not
                continue
            fn = impl.fn
            try:
                with impl.ctx():
                    if mode == "fwd":
                        out = fn(a, w)
                        row.snr_db = _snr(ref_out, out[:r])
                        del out
                        steps[i] = (lambda fn=fn: fn(a, w))
                    else:
                        a_g.grad = w_g.grad = None
                        out = fn(a_g, w_g)
                        row.snr_db = _snr(ref_out, out[:r])
                        out.backward(grad)
                        del out
                        row.extra["snr_grad_a_db"] = _snr(ref_ga, a_g.grad[:r])
                        row.extra["snr_grad_w_db"] = _snr(ref_gw, w_g.grad[: ref_gw.shape[0]])
                        steps[i] = (lambda fn=fn: fn(a_g, w_g).backward(grad))
            except Exception as exc:
                row.error = _error_text(exc)
                if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                    traceback.print_exc()
                _free(device)
        # Pass 2: timing, interleaved over rounds so clock and thermal drift hit every
        # implementation alike; each row keeps the median of its per-round medians.
        grads = [a_g, w_g] if mode == "fwd_bwd" else None
        times, errors = time_interleaved(
            {i: (step, impls[i].ctx) for i, step in steps.items()}, ROUNDS, warmup_ms, rep_ms, grads
        )
        record_times(mode_rows, times, errors, flops)
        for i, row in enumerate(mode_rows):
            if row.ms is not None and impls[i].name == PEER:
                baseline_ms = row.ms
        for row in mode_rows:
            row.baseline_ms = baseline_ms
            row.finalize()
            rows.append(row)
            log(row)
        del grad, a_g, w_g, ref_ga, ref_gw
        _free(device)
    del a, w, w64, ref_out
    _free(device)
    return rows


# ---- driver ---------------------------------------------------------------------------------
def _print_row(row: Row) -> None:
    e = row.extra
    print_compute_row(row, f"{e.get('M')}x{e.get('N')}x{e.get('K')}", (13, 26, 20, 14))

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="result directory (default: benchmarks/results/<gpu-slug>)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_MODELS)} at M={QUICK_M[0]}")
    p.add_argument("--cpu-smoke", action="store_true", help=f"tiny shapes (M, N, K / {SMOKE_DIV}); runs without a GPU")
    p.add_argument("--m", type=int, nargs="+", default=None, help=f"token counts (default {' '.join(map(str, DEFAULT_M))})")
    p.add_argument("--models", nargs="+", default=None, help="models (default: DENSE_BENCH_MODELS)")
    p.add_argument("--cases", nargs="+", default=None, help="only these cases (qkv attn_out gate_up down lm_head)")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 25; 0 with --cpu-smoke)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition time per round (default 60; 0 with --cpu-smoke)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[Path, list[Row]]:
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_smoke:
        raise SystemExit("bench_gemm: no CUDA device; use --cpu-smoke for a functional smoke run")
    if args.cpu_smoke and not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels through the interpreter
    device = torch.device("cuda" if has_cuda else "cpu")
    models = list(args.models or (QUICK_MODELS if args.quick else DENSE_BENCH_MODELS))
    ms = list(args.m or (QUICK_M if args.quick else DEFAULT_M))
    div = SMOKE_DIV if args.cpu_smoke else 1
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.cpu_smoke else 25.0)
    rep_ms = args.rep_ms if args.rep_ms is not None else (0.0 if args.cpu_smoke else 60.0)
    impls = list(args.impls)
    if PEER not in impls:
        impls.insert(0, PEER)  # the peer is always measured: speedups need it
    out_dir = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()

    cases = build_cases(models, ms, div, args.cases)
    impl_objs = _make_impls(impls)
    if args.cpu_smoke and not has_cuda:
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()  # the interpreter's bf16 tl.dot is wrong without it (triton issue #11584)
        print("bench_gemm: --cpu-smoke on CPU checks that everything runs; timings mean nothing.")
    print(f"bench_gemm: {len(cases)} unique shapes x {len(args.modes)} modes x {len(impl_objs)} impls on {device}", flush=True)
    rows: list[Row] = []
    for case in cases:
        rows.extend(run_case(case, impl_objs, args.modes, device, warmup_ms, rep_ms, _print_row))
    path = finish_run(rows, out_dir, RESULT_NAME)
    return path, rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
