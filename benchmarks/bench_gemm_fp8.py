"""FP8 GEMM benchmark on the per-layer GEMMs of real dense LLMs (Llama-3.1-8B and -70B).

Two parts:

``fwd`` (op ``fp8_fwd_<granularity>``): the forward GEMM ``out[M, N] = a[M, K] @ w[N, K].T`` on
operands quantized **once, before timing** (quantization time is excluded), for every case of
``dense_gemm_shapes`` at M in {4096, 16384}:

- ``cublas``: ``torch.matmul`` on the bf16 inputs (BF16 cuBLAS),
- ``scaled_mm``: ``torch._scaled_mm`` on the same quantized operands (TENSORWISE, ROWWISE),
- ``turbo-default``: the FP8 GEMM dispatcher with no pin (``_scaled_mm`` for TENSORWISE/ROWWISE,
  our Triton kernel for BLOCKWISE/MX_BLOCKWISE),
- ``turbo-triton``: the same pinned to TRITON.

Baseline per row: ``scaled_mm`` of the same granularity for TENSORWISE/ROWWISE, ``cublas`` (BF16)
for BLOCKWISE/MX and for ``scaled_mm`` itself; ``extra.speedup_vs_bf16`` is always against cuBLAS
BF16. SNR: the first 256 output rows against the float64 product of the *dequantized* operands
(kernel accuracy); ``extra.snr_vs_inputs_db`` against the bf16 inputs (includes quantization).

``fwd_bwd`` (op ``fp8_linear_fwd_bwd``): ``turbo.ops.gemm_fp8`` forward + backward with on-the-fly
quantization **included** (TENSORWISE and BLOCKWISE, E4M3) against BF16 cuBLAS forward + backward
(``torch.matmul`` autograd), at Llama-3.1-8B, M=16384. 6MNK flops. With ``--timing graph`` both
steps (forward + backward, gradients reset per call) are captured in a CUDA graph and replayed:
device time alone, so a row that is host-bound under ``do_bench`` shows what its kernels take.

    python benchmarks/bench_gemm_fp8.py --out benchmarks/results/h200
    python benchmarks/bench_gemm_fp8.py --out /tmp/b --quick             # Llama-3.1-8B, M=4096
    python benchmarks/bench_gemm_fp8.py --out /tmp/b --quick --cpu-smoke # tiny shapes, no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.bench_gemm import build_cases  # noqa: E402
from benchmarks.common import Row, finish_run, gpu_slug, set_timing, print_compute_row  # noqa: E402
from benchmarks.common import error_text as _error_text  # noqa: E402
from benchmarks.common import free_memory as _free  # noqa: E402
from benchmarks.common import time_interleaved  # noqa: E402
from primus_turbo.testing import snr_db  # noqa: E402

RESULT_NAME = "gemm_fp8"
MODELS = ("Llama-3.1-8B", "Llama-3.1-70B")
DEFAULT_M = (4096, 16384)
QUICK_MODELS = ("Llama-3.1-8B",)
QUICK_M = (4096,)
LINEAR_MODEL, LINEAR_M = "Llama-3.1-8B", 16384
SMOKE_DIV = 64
REF_ROWS = 256
GRANS = ("TENSORWISE", "ROWWISE", "BLOCKWISE", "MX_BLOCKWISE", "MXFP4")
LINEAR_GRANS = ("TENSORWISE", "BLOCKWISE")  # the fwd+bwd target; --linear-granularities adds MX ones
ALL_LINEAR_GRANS = ("TENSORWISE", "ROWWISE", "BLOCKWISE", "MX_BLOCKWISE", "MXFP4")
IMPLS = ("cublas", "scaled_mm", "turbo-default", "turbo-triton")
MODES = ("fwd", "fwd_bwd")
ROUNDS = 5  # interleaved timing rounds per implementation (median of the round medians); 1 with --cpu-smoke
E4M3 = torch.float8_e4m3fn


_rounds = ROUNDS




@contextlib.contextmanager
def _pin(backend: Optional[str]):
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

    GlobalBackendManager.reset()
    if backend is not None:
        GlobalBackendManager.set_gemm_backend(BackendType[backend], precision="FP8")
    try:
        yield
    finally:
        GlobalBackendManager.reset()


def _quantize(a: torch.Tensor, w: torch.Tensor, gran: str):
    """(a_q, sa, w_q, sw, dequantized a[:REF_ROWS] and w in fp64) for one granularity."""
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe
    from primus_turbo.pytorch.ops.quantization import quantize_fp8
    from primus_turbo.testing.quant_ref import dequantize_fp8_ref

    if gran == "MXFP4":
        from primus_turbo.pytorch.ops.quantization import quantize_fp4
        from primus_turbo.testing.quant_ref import dequantize_fp4_ref

        a_q, sa = quantize_fp4(a)
        w_q, sw = quantize_fp4(w)
        r = min(REF_ROWS, a.shape[0])
        deq_a = dequantize_fp4_ref(a_q[:r].cpu(), sa[:r].cpu()).double()
        deq_w = dequantize_fp4_ref(w_q.cpu(), sw.cpu()).double()
        return a_q, sa, w_q, sw, deq_a, deq_w
    bs = 128 if gran == "BLOCKWISE" else None
    w_recipe = ScalingRecipe(use_2d_block=True) if gran == "BLOCKWISE" else None
    a_q, sa = quantize_fp8(a, E4M3, gran, block_size=bs)
    w_q, sw = quantize_fp8(w, E4M3, gran, block_size=bs, scaling_recipe=w_recipe)
    r = min(REF_ROWS, a.shape[0])
    sa_r = sa if gran == "TENSORWISE" else sa[:r]
    deq_a = dequantize_fp8_ref(a_q[:r].cpu(), sa_r.cpu(), gran, block_size=bs).double()
    deq_w = dequantize_fp8_ref(w_q.cpu(), sw.cpu(), gran, block_size=bs, scaling_recipe=w_recipe).double()
    return a_q, sa, w_q, sw, deq_a, deq_w


def _fwd_impls(names: Sequence[str], gran: str) -> list[tuple[str, Optional[str], Callable]]:
    """(impl, backend pin or None, fn(a, w, a_q, sa, w_q, sw) -> out) for the fwd part."""
    from primus_turbo.pytorch.ops.gemm_fp4 import _gemm_fp4_eager
    from primus_turbo.pytorch.ops.gemm_fp8 import _gemm_fp8_eager

    def turbo(a, w, a_q, sa, w_q, sw):
        if gran == "MXFP4":
            return _gemm_fp4_eager(a_q, sa, w_q, sw, torch.bfloat16)
        return _gemm_fp8_eager(a_q, sa, w_q, sw, gran, torch.bfloat16, 128)

    def scaled_mm(a, w, a_q, sa, w_q, sw):
        if gran == "TENSORWISE":
            return torch._scaled_mm(a_q, w_q.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
        return torch._scaled_mm(a_q, w_q.t(), scale_a=sa, scale_b=sw.reshape(1, -1), out_dtype=torch.bfloat16)

    out = []
    for name in names:
        if name == "cublas":
            out.append((name, None, lambda a, w, *_: torch.matmul(a, w.t())))
        elif name == "scaled_mm":
            if gran in ("TENSORWISE", "ROWWISE"):
                out.append((name, None, scaled_mm))
        elif name == "turbo-default":
            out.append((name, None, turbo))
        elif name == "turbo-triton":
            out.append((name, "TRITON", turbo))
    return out


def _time_interleaved(steps: dict[int, tuple[Callable, Optional[str]]], warmup_ms, rep_ms, grads=None,
                      per_round: Optional[dict] = None):
    """Median of the per-round medians of each step (steps: key -> (fn, backend pin or None));
    ``per_round``, when given, receives each step's list of round medians."""
    times, errors = time_interleaved(
        {i: (fn, (lambda p=pin: _pin(p))) for i, (fn, pin) in steps.items()}, _rounds, warmup_ms, rep_ms, grads
    )
    if per_round is not None:
        per_round.update(times)
    return {i: statistics.median(ts) for i, ts in times.items()}, errors


def paired_speedup(peer: Sequence[float], own: Sequence[float]) -> Optional[float]:
    """Median over rounds of peer / own, each pair timed back to back in one round: drift in
    clocks or temperature between rounds cancels, which the ratio of the two medians keeps (two
    identical kernels read 0.98-1.02 per row that way)."""
    pairs = [p / o for p, o in zip(peer, own) if o > 0]
    return float(statistics.median(pairs)) if pairs else None


def run_fwd_case(case, impl_names, grans, device, warmup_ms, rep_ms, log) -> list[Row]:
    m, n, k = case["M"], case["N"], case["K"]
    gen = torch.Generator(device=device).manual_seed(hash((m, n, k)) & 0x7FFFFFFF)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device=device, dtype=torch.float32, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    r = min(REF_ROWS, m)
    ref_in = a[:r].double() @ w.double().t()
    flops = 2 * m * n * k
    rows: list[Row] = []
    bf16_ms: Optional[float] = None
    if "cublas" in impl_names:  # the BF16 peer, once per shape
        row = Row("fp8_fwd_bf16", case["case"], "cublas", "cublas",
                  extra={"M": m, "N": n, "K": k, "also": case["also"], "dtype": "bf16"})
        try:
            row.snr_db = snr_db(ref_in, torch.matmul(a[:r], w.t()))
            t, err = _time_interleaved({0: (lambda: torch.matmul(a, w.t()), None)}, warmup_ms, rep_ms)
            row.ms, row.error = t.get(0), err.get(0)
        except Exception as exc:
            row.error = _error_text(exc)
        if row.ms:
            row.tflops, bf16_ms, row.baseline_ms = flops / (row.ms * 1e-3) / 1e12, row.ms, row.ms
        rows.append(row.finalize())
        log(row)
    for gran in grans:
        op = "fp4_fwd_mxfp4" if gran == "MXFP4" else f"fp8_fwd_{gran.lower()}"
        extra = {"M": m, "N": n, "K": k, "also": case["also"], "granularity": gran,
                 "dtype": "e2m1 (MXFP4, emulated)" if gran == "MXFP4" else "e4m3",
                 "quantization": "excluded (operands quantized before timing)"}
        impls = [x for x in _fwd_impls(impl_names, gran) if x[0] != "cublas"]
        baseline = "scaled_mm" if gran in ("TENSORWISE", "ROWWISE") else "cublas"
        if gran in ("MX_BLOCKWISE", "MXFP4") and k % 32:
            for name, _, _ in impls:
                rows.append(Row(op, case["case"], name, baseline, error=f"MX needs K % 32 == 0, K={k}", extra=dict(extra)))
            continue
        try:
            a_q, sa, w_q, sw, deq_a, deq_w = _quantize(a, w, gran)
            ref_deq = deq_a @ deq_w.t()
        except Exception as exc:
            for name, _, _ in impls:
                row = Row(op, case["case"], name, baseline, error=_error_text(exc), extra=dict(extra))
                rows.append(row)
                log(row)
            continue
        mode_rows, steps = [], {}
        for i, (name, pin, fn) in enumerate(impls):
            row = Row(op, case["case"], name, "cublas" if name == "scaled_mm" else baseline, extra=dict(extra))
            mode_rows.append(row)
            try:
                with _pin(pin):
                    out = fn(a, w, a_q, sa, w_q, sw)
                row.snr_db = snr_db(ref_deq, out[:r].cpu())
                row.extra["snr_vs_inputs_db"] = snr_db(ref_in, out[:r])
                del out
                steps[i] = ((lambda fn=fn: fn(a, w, a_q, sa, w_q, sw)), pin)
            except Exception as exc:
                row.error = _error_text(exc)
                if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                    traceback.print_exc()
        rounds: dict = {}
        times, errors = _time_interleaved(steps, warmup_ms, rep_ms, per_round=rounds)
        peer_ms, peer_i = None, None
        for i, row in enumerate(mode_rows):
            if i in errors:
                row.error = errors[i]
            if i in times:
                row.ms = times[i]
                row.tflops = flops / (row.ms * 1e-3) / 1e12
                if bf16_ms:
                    row.extra["speedup_vs_bf16"] = bf16_ms / row.ms
                if impls[i][0] == "scaled_mm":
                    peer_ms, peer_i = row.ms, i
        for i, row in enumerate(mode_rows):
            row.baseline_ms = bf16_ms if row.baseline == "cublas" else peer_ms
            if row.baseline == "scaled_mm" and peer_i in rounds and i in rounds:
                row.extra["paired_speedup"] = paired_speedup(rounds[peer_i], rounds[i])
            rows.append(row.finalize())
            log(row)
        del a_q, sa, w_q, sw, deq_a, deq_w
        _free(device)
    del a, w
    _free(device)
    return rows


def run_linear_case(case, impl_names, device, warmup_ms, rep_ms, log, grans=LINEAR_GRANS) -> list[Row]:
    """fwd+bwd of y = x @ w.T with quantization included: BF16 cuBLAS vs turbo.ops.gemm_fp8
    (``gemm_fp4`` for ``MXFP4``)."""
    from primus_turbo.pytorch.core.low_precision import Float4QuantConfig, Float8QuantConfig
    from primus_turbo.pytorch.ops.gemm_fp4 import gemm_fp4
    from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8

    m, n, k = case["M"], case["N"], case["K"]
    op = "fp8_linear_fwd_bwd"  # MXFP4 rows too (impl names carry the granularity)
    gen = torch.Generator(device=device).manual_seed(hash((m, n, k, 1)) & 0x7FFFFFFF)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)
    r = min(REF_ROWS, m)
    ref_out = x[:r].detach().double() @ w.detach().double().t()
    ref_gx = grad[:r].double() @ w.detach().double()
    rw = min(REF_ROWS, n)
    ref_gw = grad[:, :rw].double().t() @ x.detach().double()
    extra_base = {"M": m, "N": n, "K": k, "also": case["also"], "quantization": "included"}
    impls: list[tuple[str, Optional[str], Callable]] = []
    if "cublas" in impl_names:
        impls.append(("cublas", None, lambda: torch.matmul(x, w.t())))
    for gran in grans:
        if gran == "MXFP4":
            cfg4 = Float4QuantConfig()
            fn = (lambda cfg4=cfg4: gemm_fp4(x, w, trans_b=True, config=cfg4))
        else:
            cfg = Float8QuantConfig(granularity=gran)
            fn = (lambda cfg=cfg: gemm_fp8(x, w, trans_b=True, config=cfg))
        for name, pin in (("turbo-default", None), ("turbo-triton", "TRITON")):
            if name in impl_names:
                impls.append((f"{name}-{gran.lower()}", pin, fn))
    rows, steps = [], {}
    for i, (name, pin, fn) in enumerate(impls):
        row = Row(op, case["case"], name, "cublas", extra=dict(extra_base))
        rows.append(row)
        try:
            with _pin(pin):
                x.grad = w.grad = None
                out = fn()
                row.snr_db = snr_db(ref_out, out[:r])
                out.backward(grad)
            row.extra["snr_grad_a_db"] = snr_db(ref_gx, x.grad[:r])
            row.extra["snr_grad_w_db"] = snr_db(ref_gw, w.grad[:rw])
            del out
            steps[i] = ((lambda fn=fn: fn().backward(grad)), pin)
        except Exception as exc:
            row.error = _error_text(exc)
            if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                traceback.print_exc()
    times, errors = _time_interleaved(steps, warmup_ms, rep_ms, grads=[x, w])
    base = times.get(0) if impls and impls[0][0] == "cublas" else None
    for i, row in enumerate(rows):
        if i in errors:
            row.error = errors[i]
        if i in times:
            row.ms = times[i]
            row.tflops = 6 * m * n * k / (row.ms * 1e-3) / 1e12
        row.baseline_ms = base
        row.finalize()
        log(row)
    del x, w, grad
    _free(device)
    return rows


def _print_row(row: Row) -> None:
    e = row.extra
    sp = f"x{row.speedup:.3f} vs {row.baseline}" if row.speedup else "   -  "
    if e.get("paired_speedup") is not None:
        sp += f" (paired x{e['paired_speedup']:.3f})"
    print_compute_row(row, f"{e.get('M')}x{e.get('N')}x{e.get('K')}", (22, 26, 18, 26), sp)

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="result directory (default: benchmarks/results/<gpu-slug>)")
    p.add_argument("--quick", action="store_true", help="Llama-3.1-8B at M=4096 (fwd_bwd at M=4096 too)")
    p.add_argument("--cpu-smoke", action="store_true", help=f"tiny shapes (M, N, K / {SMOKE_DIV}); runs without a GPU")
    p.add_argument("--m", type=int, nargs="+", default=None, help="token counts of the fwd part (default 4096 16384)")
    p.add_argument("--models", nargs="+", default=None, help=f"models (default: {' '.join(MODELS)})")
    p.add_argument("--cases", nargs="+", default=None, help="only these cases (qkv attn_out gate_up down lm_head)")
    p.add_argument("--granularities", nargs="+", default=list(GRANS), choices=GRANS)
    p.add_argument("--linear-granularities", nargs="+", default=list(LINEAR_GRANS), choices=ALL_LINEAR_GRANS,
                   help="granularities of the fwd_bwd part (MXFP4: turbo.ops.gemm_fp4)")
    # lenient: run_all passes the same options to every benchmark, so names another benchmark
    # knows (but this one does not) are ignored rather than rejected
    p.add_argument("--impls", nargs="+", default=list(IMPLS), help=f"subset of {', '.join(IMPLS)}")
    p.add_argument("--modes", nargs="+", default=list(MODES), help=f"subset of {', '.join(MODES)}")
    p.add_argument("--timing", choices=("do_bench", "graph"), default="do_bench",
                   help="do_bench (host time included where it shows) or graph (device time alone, CUDA-graph "
                        "replay with L2 flushed per call; fwd_bwd steps captured whole, backward included)")
    p.add_argument("--rounds", type=int, default=None, help=f"interleaved timing rounds (default {ROUNDS}; 1 with --cpu-smoke)")
    p.add_argument("--warmup-ms", type=float, default=None)
    p.add_argument("--rep-ms", type=float, default=None)
    args, _unknown = p.parse_known_args(argv)
    return args


def run(args: argparse.Namespace) -> tuple[Path, list[Row]]:
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_smoke:
        raise SystemExit("bench_gemm_fp8: no CUDA device; use --cpu-smoke for a functional smoke run")
    if args.cpu_smoke and not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()  # MX runs a bf16 dot: wrong under the interpreter without it
        print("bench_gemm_fp8: --cpu-smoke on CPU checks that everything runs; timings mean nothing.")
    global _rounds
    _rounds = args.rounds if args.rounds else (1 if args.cpu_smoke else ROUNDS)
    device = torch.device("cuda" if has_cuda else "cpu")
    models = list(args.models or (QUICK_MODELS if args.quick else MODELS))
    ms = list(args.m or (QUICK_M if args.quick else DEFAULT_M))
    div = SMOKE_DIV if args.cpu_smoke else 1
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.cpu_smoke else 25.0)
    rep_ms = args.rep_ms if args.rep_ms is not None else (0.0 if args.cpu_smoke else 60.0)
    impls = [i for i in args.impls if i in IMPLS]
    if "cublas" not in impls:
        impls.insert(0, "cublas")  # the BF16 peer is always measured: speedups need it
    modes = [m for m in args.modes if m in MODES]
    if args.timing == "graph" and has_cuda:
        set_timing("graph")
    out_dir = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()

    rows: list[Row] = []
    if "fwd" in modes:
        cases = build_cases(models, ms, div, args.cases)
        print(f"bench_gemm_fp8: fwd: {len(cases)} unique shapes x {len(args.granularities)} granularities on {device}",
              flush=True)
        for case in cases:
            new = run_fwd_case(case, impls, args.granularities, device, warmup_ms, rep_ms, _print_row)
            for r in new:
                r.extra["timing"] = args.timing
            rows.extend(new)
    if "fwd_bwd" in modes:
        lm = QUICK_M[0] if args.quick else LINEAR_M
        cases = build_cases([LINEAR_MODEL], [lm], div, args.cases)
        print(f"bench_gemm_fp8: fp8 linear fwd+bwd (quantization included): {len(cases)} shapes", flush=True)
        for case in cases:
            rows.extend(run_linear_case(case, impls, device, warmup_ms, rep_ms, _print_row,
                                        grans=args.linear_granularities))
    path = finish_run(rows, out_dir, RESULT_NAME)
    paired = {}
    for r in rows:
        if r.extra.get("paired_speedup") is not None:
            paired.setdefault((r.op, r.impl), []).append(r.extra["paired_speedup"])
    for (op, impl), v in sorted(paired.items()):
        print(f"paired speedup vs scaled_mm (median over rounds of the back-to-back ratio): {op} {impl}: "
              f"min {min(v):.3f} max {max(v):.3f} over {len(v)} rows", flush=True)
    return path, rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
