"""Grouped GEMM benchmark on the routed-expert GEMMs of real MoE LLMs.

For every model in ``MOE_MODELS``, expert parallelism EP in {8, 16, 32} (when experts / EP is an
integer >= 1; ``G = experts / EP`` local experts) and tokens per expert M, the cases of
``moe_gemm_shapes`` (``gate_up``: N = 2 x moe_intermediate, K = hidden; ``down``: N = hidden,
K = moe_intermediate) are timed with balanced routing (every expert gets M rows) and unbalanced
routing (``dist = 0.2 + 0.8 * rand(G)``, normalised, ``lens = round(dist * G * M)`` with the last
group absorbing the rounding; fixed seed). ``a: [G*M, K]`` bf16, expert weights ``w: [G, N, K]``
(``trans_b=True``), ``group_lens`` int64 on the device and ``group_offs`` precomputed for every
implementation:

- ``torch_grouped_mm``: ``torch._grouped_mm(a, w.transpose(-2, -1), offs=group_offs[1:].int())``
  (the peer; torch autograd for fwd+bwd),
- ``turbo-default``: ``turbo.ops.grouped_gemm(a, w, group_lens, group_offs, trans_b=True)``, no pin,
- ``turbo-triton``: the same with the grouped-GEMM backend pinned to TRITON,

forward (``grouped_gemm_fwd``, 2 * sum(group_lens) * N * K flops) and forward+backward
(``grouped_gemm_fwd_bwd``, 3x that). Identical (G, M, N, K, routing) from different models are
timed once. Accuracy: SNR of the forward output (and, for fwd+bwd, of grad_a and grad_w, in
``extra``) on the first up-to-256 rows of each of the first 2 groups against float64.

FP8 (only when ``turbo.ops.grouped_gemm_fp8`` exists; op ``grouped_fp8_fwd_<granularity>``,
balanced routing): the forward on operands quantized once, before timing, by the op's own
quantizers; ``turbo-default`` / ``turbo-triton`` against ``torch._scaled_grouped_mm`` on the same
FP8 operands (TENSORWISE, ROWWISE; when torch has it) and against the BF16 ``torch_grouped_mm``
(BLOCKWISE); ``turbo-gluon`` (opt-in, FP8 only) pins the FP8 GEMM to the Gluon backend;
``extra.speedup_vs_bf16`` is always against the BF16 peer. SNR there is against the
float64 product of the bf16 inputs (quantization error included).

    python benchmarks/bench_grouped_gemm.py --out benchmarks/results/h200
    python benchmarks/bench_grouped_gemm.py --out /tmp/b --tokens 512 1024 2048 4096 8192
    python benchmarks/bench_grouped_gemm.py --out /tmp/b --quick             # Qwen3-30B-A3B, EP 32
    python benchmarks/bench_grouped_gemm.py --out /tmp/b --quick --cpu-smoke # tiny shapes, no GPU
                                                      # ("down" only, FP8 on one case)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
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

from benchmarks.common import Row, finish_run, gpu_slug, set_timing, write_results, print_compute_row  # noqa: E402
from benchmarks.common import error_text as _error_text  # noqa: E402
from benchmarks.common import free_memory as _free  # noqa: E402
from benchmarks.common import record_times, time_interleaved  # noqa: E402
from primus_turbo.testing import MODELS, moe_gemm_shapes, snr_db  # noqa: E402

RESULT_NAME = "grouped_gemm_bf16"
MOE_MODELS = ("DeepSeek-V3", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "Mixtral-8x7B", "GPT-OSS-20B")
EPS = (8, 16, 32)
ALL_TOKENS = (512, 1024, 2048, 4096, 8192)
DEFAULT_TOKENS = (1024, 4096)  # keeps the full H200 run at about five minutes
QUICK_MODELS = ("Qwen3-30B-A3B",)
QUICK_EPS = (32,)
QUICK_TOKENS = (4096,)
CASES = ("gate_up", "down")
ROUTINGS = ("balanced", "unbalanced")
SMOKE_DIV = 64  # --cpu-smoke divides M (tokens per expert), N and K by this (kept multiples of 16)
SMOKE_CASES = ("down",)  # --cpu-smoke without --cases
REF_ROWS = 256  # rows per checked group (first 2 groups) compared with float64
REF_GROUPS = 2
ROUTING_SEED = 1234
PEER = "torch_grouped_mm"
IMPLS = ("torch_grouped_mm", "turbo-default", "turbo-triton")
FP8_ONLY_IMPLS = ("turbo-gluon",)  # the FP8 GEMMs pinned to the Gluon backend (opt-in)
MODES = ("fwd", "fwd_bwd")
FP8_GRANS = ("TENSORWISE", "ROWWISE", "BLOCKWISE")
FP8_PEER = "scaled_grouped_mm"
ROUNDS = 3  # interleaved timing rounds per implementation (median of the round medians); 1 with --cpu-smoke

_rounds = ROUNDS


# ---- cases ----------------------------------------------------------------------------------
def _smoke_dim(x: int, div: int) -> int:
    return max(16, (x // div) // 16 * 16)


def routing_lens(g: int, m: int, routing: str, seed: int = ROUTING_SEED) -> list[int]:
    """Rows per expert (host list) summing to ``g * m``: all ``m``, or Primus' unbalanced draw."""
    if routing == "balanced" or g == 1:
        return [m] * g
    gen = torch.Generator().manual_seed(seed)
    dist = 0.2 + 0.8 * torch.rand(g, generator=gen, dtype=torch.float64)
    dist = dist / dist.sum()
    lens = torch.round(dist * (g * m)).to(torch.int64)
    lens[-1] = g * m - lens[:-1].sum()
    return [int(x) for x in lens]


def build_cases(
    models: Sequence[str],
    eps: Sequence[int],
    tokens: Sequence[int],
    div: int = 1,
    only_cases: Optional[Sequence[str]] = None,
    routings: Sequence[str] = ROUTINGS,
) -> list[dict[str, Any]]:
    """Unique (G, M, N, K, routing), first name kept, the others in ``also``.

    With a single local expert, unbalanced routing is balanced routing: such cases dedupe.
    """
    seen: dict[tuple, dict[str, Any]] = {}
    for m in tokens:
        for model in models:
            n_exp = MODELS[model].num_experts
            for ep in eps:
                if n_exp % ep or n_exp // ep < 1:
                    continue
                for case, g, mm, n, k in moe_gemm_shapes(model, ep, m):
                    if only_cases and case not in only_cases:
                        continue
                    if div > 1:
                        mm, n, k = (_smoke_dim(x, div) for x in (mm, n, k))
                    for routing in routings:
                        eff = "balanced" if g == 1 else routing
                        key = (g, mm, n, k, eff)
                        # tokens per expert in the name: the FP8 rows look their BF16 baseline up by it
                        name = f"{model}:{case}:ep{ep}:t{m}:{routing}"
                        if key in seen:
                            seen[key]["also"].append(name)
                            continue
                        seen[key] = {"case": name, "G": g, "M": mm, "N": n, "K": k, "routing": eff,
                                     "model": model, "ep": ep, "also": []}
    return list(seen.values())


# ---- implementations ------------------------------------------------------------------------
class _Impl:
    def __init__(self, name: str, fn: Optional[Callable], ctx: Callable[[], Any], why_not: Optional[str] = None):
        self.name, self.fn, self.ctx, self.why_not = name, fn, ctx, why_not


def _turbo():
    """(turbo module, GlobalBackendManager, BackendType, error text or None)."""
    try:
        import primus_turbo.pytorch as turbo
        import primus_turbo.pytorch.ops  # noqa: F401  (makes turbo.ops an attribute)
        from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

        if not hasattr(turbo, "ops") or not hasattr(turbo.ops, "grouped_gemm"):
            return turbo, GlobalBackendManager, BackendType, "primus_turbo.pytorch.ops.grouped_gemm is not available"
        return turbo, GlobalBackendManager, BackendType, None
    except Exception as exc:
        return None, None, None, f"import primus_turbo.pytorch failed: {exc!r}"


@contextlib.contextmanager
def _pin(gbm, backend=None, precision=None) -> Iterator[None]:
    if gbm is not None:
        gbm.reset()
        if backend is not None:
            gbm.set_grouped_gemm_backend(backend, precision=precision)
    try:
        yield
    finally:
        if gbm is not None:
            gbm.reset()


def _torch_grouped_mm(a, w, group_lens, group_offs, offs32):
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32)


def _make_impls(names: Sequence[str]) -> list[_Impl]:
    impls: list[_Impl] = []
    turbo = gbm = bt = None
    turbo_err: Optional[str] = None
    if any(n != PEER for n in names):
        turbo, gbm, bt, turbo_err = _turbo()
    for name in names:
        if name == PEER:
            why = None if hasattr(torch, "_grouped_mm") else f"torch {torch.__version__} has no _grouped_mm"
            impls.append(_Impl(name, _torch_grouped_mm, contextlib.nullcontext, why))
        elif name in ("turbo-default", "turbo-triton"):
            if turbo_err:
                impls.append(_Impl(name, None, contextlib.nullcontext, turbo_err))
                continue

            def fn(a, w, group_lens, group_offs, offs32):
                return turbo.ops.grouped_gemm(a, w, group_lens, group_offs, trans_b=True)

            if name == "turbo-default":
                ctx = lambda: _pin(gbm)  # noqa: E731
            else:
                ctx = lambda: _pin(gbm, bt.TRITON)  # noqa: E731
            impls.append(_Impl(name, fn, ctx))
        else:
            raise ValueError(f"unknown impl {name!r}; known: {', '.join(IMPLS)}")
    return impls


# ---- helpers --------------------------------------------------------------------------------


def _time_interleaved(steps: dict[int, tuple[Callable, Callable]], warmup_ms, rep_ms, grads=None):
    """Per-round times of each step (steps: key -> (fn, context factory)); see time_interleaved."""
    return time_interleaved(steps, _rounds, warmup_ms, rep_ms, grads)


def _ref_rows(lens: Sequence[int]) -> list[tuple[int, int, int]]:
    """(group, first row, end row) of the checked rows: up to REF_ROWS of each of the first
    REF_GROUPS non-empty groups."""
    out, start = [], 0
    for g, n in enumerate(lens):
        if n > 0 and len(out) < REF_GROUPS:
            out.append((g, start, start + min(REF_ROWS, n)))
        start += n
    return out


def _pick(t: torch.Tensor, spans: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    return torch.cat([t[s:e] for _, s, e in spans])


# ---- one case (BF16) ------------------------------------------------------------------------
def _inputs(case: dict[str, Any], device: torch.device):
    g, m, n, k = case["G"], case["M"], case["N"], case["K"]
    lens = routing_lens(g, m, case["routing"])
    gen = torch.Generator(device=device).manual_seed(hash((g, m, n, k, case["routing"])) & 0x7FFFFFFF)
    a = torch.randn(sum(lens), k, device=device, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(g, n, k, device=device, dtype=torch.float32, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    group_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    group_offs = torch.zeros(g + 1, dtype=torch.int64, device=device)
    group_offs[1:] = torch.cumsum(group_lens, 0)
    offs32 = group_offs[1:].to(torch.int32)
    return lens, gen, a, w, group_lens, group_offs, offs32


def run_case(
    case: dict[str, Any],
    impls: Sequence[_Impl],
    modes: Sequence[str],
    device: torch.device,
    warmup_ms: float,
    rep_ms: float,
    log: Callable[[Row], None],
) -> list[Row]:
    g, m, n, k = case["G"], case["M"], case["N"], case["K"]
    lens, gen, a, w, group_lens, group_offs, offs32 = _inputs(case, device)
    total = sum(lens)
    extra_base = {"G": g, "M": total, "N": n, "K": k, "tokens_per_expert": m, "routing": case["routing"],
                  "group_lens_min": min(lens), "group_lens_max": max(lens), "dtype": "bf16", "trans_b": True,
                  "also": case["also"]}
    spans = _ref_rows(lens)
    w64 = w.double()
    ref_out = torch.cat([a[s:e].double() @ w64[gi].t() for gi, s, e in spans])
    rows: list[Row] = []
    args = (group_lens, group_offs, offs32)

    for mode in modes:
        op = f"grouped_gemm_{mode}"
        flops = (2 if mode == "fwd" else 6) * total * n * k
        grad = a_g = w_g = ref_ga = ref_gw = None
        rw = min(REF_ROWS, n)
        try:
            if mode == "fwd_bwd":
                grad = torch.randn(total, n, device=device, dtype=torch.bfloat16, generator=gen)
                a_g = a.detach().clone().requires_grad_(True)
                w_g = w.detach().clone().requires_grad_(True)
                ref_ga = torch.cat([grad[s:e].double() @ w64[gi] for gi, s, e in spans])
                offs_h = [0]
                for x in lens:
                    offs_h.append(offs_h[-1] + x)
                ref_gw = torch.cat([grad[offs_h[gi]:offs_h[gi + 1], :rw].double().t()
                                    @ a[offs_h[gi]:offs_h[gi + 1]].double() for gi, _, _ in spans])
        except Exception as exc:  # e.g. out of memory for the references
            for impl in impls:
                row = Row(op, case["case"], impl.name, PEER, error=_error_text(exc), extra=dict(extra_base))
                rows.append(row)
                log(row)
            _free(device)
            continue

        mode_rows: list[Row] = []
        steps: dict[int, tuple[Callable, Callable]] = {}
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
                        out = fn(a, w, *args)
                        row.snr_db = snr_db(ref_out, _pick(out.detach(), spans))
                        del out
                        steps[i] = ((lambda fn=fn: fn(a, w, *args)), impl.ctx)
                    else:
                        a_g.grad = w_g.grad = None
                        out = fn(a_g, w_g, *args)
                        row.snr_db = snr_db(ref_out, _pick(out.detach(), spans))
                        out.backward(grad)
                        del out
                        row.extra["snr_grad_a_db"] = snr_db(ref_ga, _pick(a_g.grad, spans))
                        row.extra["snr_grad_w_db"] = snr_db(ref_gw, torch.cat([w_g.grad[gi, :rw] for gi, _, _ in spans]))
                        steps[i] = ((lambda fn=fn: fn(a_g, w_g, *args).backward(grad)), impl.ctx)
            except Exception as exc:
                row.error = _error_text(exc)
                if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                    traceback.print_exc()
                _free(device)
        # Pass 2: timing, interleaved over rounds.
        times, errors = _time_interleaved(steps, warmup_ms, rep_ms, [a_g, w_g] if mode == "fwd_bwd" else None)
        baseline_ms: Optional[float] = None
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


# ---- one case (FP8 forward) -----------------------------------------------------------------
def _fp8_impls(impl_names: Sequence[str], gran: str):
    """(impl, ctx, fn(a, w, quantized, args) -> out, baseline) for one granularity, or an error text."""
    turbo, gbm, bt, err = _turbo()
    if err:
        return err
    if not hasattr(turbo.ops, "grouped_gemm_fp8"):
        return None  # not there (yet): the FP8 part is skipped
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    cfg = Float8QuantConfig(granularity=gran)
    mod = importlib.import_module(turbo.ops.grouped_gemm_fp8.__module__)
    internals = all(hasattr(mod, x) for x in ("_quant_rows", "_weight_copies", "_mm"))

    def turbo_fn(a, w, q, group_lens, group_offs, offs32):
        if q is not None:  # the GEMM alone on operands quantized before timing
            bs = cfg.block_size or 128
            return mod._mm(q["a"], q["w"], gran, group_lens, group_offs, torch.bfloat16, bs, None)
        return turbo.ops.grouped_gemm_fp8(a, w, group_lens, group_offs, trans_b=True, config=cfg)

    def scaled_fn(a, w, q, group_lens, group_offs, offs32):
        return torch._scaled_grouped_mm(q["a_sg"], q["w"][0].transpose(-2, -1), q["sa_sg"], q["sw_sg"],
                                        offs=offs32, out_dtype=torch.bfloat16)

    baseline = FP8_PEER if gran in ("TENSORWISE", "ROWWISE") and hasattr(torch, "_scaled_grouped_mm") else PEER
    out = []
    if FP8_PEER in impl_names and baseline == FP8_PEER:
        out.append((FP8_PEER, contextlib.nullcontext, scaled_fn, PEER))
    for name in ("turbo-default", "turbo-triton", "turbo-gluon"):
        if name in impl_names:
            pin = {"turbo-default": None, "turbo-triton": bt.TRITON, "turbo-gluon": bt.GLUON}[name]
            out.append((name, (lambda pin=pin: _pin(gbm, pin, "FP8")), turbo_fn, baseline))
    return out, cfg, mod, internals


def _quantize_grouped(a, w, gran, cfg, mod) -> dict[str, Any]:
    fp8 = torch.float8_e4m3fn
    bs = cfg.block_size or 128
    q: dict[str, Any] = {"a": mod._quant_rows(a, fp8, gran, bs)}
    q["w"], _ = mod._weight_copies(w, True, fp8, gran, bs, True, False)
    if gran in ("TENSORWISE", "ROWWISE"):  # _scaled_grouped_mm wants per-row / per-(expert, column) scales
        (aq, sa), (wq, sw) = q["a"], q["w"]
        g, n, _ = wq.shape
        q["a_sg"] = aq
        q["sa_sg"] = sa.float().reshape(-1).expand(aq.shape[0]).contiguous() if sa.numel() == 1 else \
            sa.float().reshape(aq.shape[0]).contiguous()
        q["sw_sg"] = sw.float().reshape(g, 1).expand(g, n).contiguous() if sw.numel() == g else \
            sw.float().reshape(g, n).contiguous()
    return q


def run_fp8_case(case, impl_names, grans, device, warmup_ms, rep_ms, log, bf16_ms_of) -> list[Row]:
    g, m, n, k = case["G"], case["M"], case["N"], case["K"]
    rows: list[Row] = []
    plans = {}
    for gran in grans:
        try:
            plans[gran] = _fp8_impls(impl_names, gran)
        except Exception as exc:
            plans[gran] = _error_text(exc)
    if all(p is None for p in plans.values()):
        return rows
    lens, _gen, a, w, group_lens, group_offs, offs32 = _inputs(case, device)
    total = sum(lens)
    spans = _ref_rows(lens)
    w64 = w.double()
    ref = torch.cat([a[s:e].double() @ w64[gi].t() for gi, s, e in spans])
    flops = 2 * total * n * k
    bf16_ms = bf16_ms_of(case)
    args = (group_lens, group_offs, offs32)
    for gran, plan in plans.items():
        if plan is None:
            continue
        op = f"grouped_fp8_fwd_{gran.lower()}"
        extra = {"G": g, "M": total, "N": n, "K": k, "tokens_per_expert": m, "routing": case["routing"],
                 "granularity": gran, "dtype": "e4m3", "trans_b": True, "also": case["also"]}
        if isinstance(plan, str):
            row = Row(op, case["case"], "turbo-default", PEER, error=plan, extra=extra)
            rows.append(row)
            log(row)
            continue
        impls, cfg, mod, internals = plan
        q = None
        qerr = None
        if internals:
            try:
                q = _quantize_grouped(a, w, gran, cfg, mod)
                extra["quantization"] = "excluded (operands quantized before timing)"
            except Exception as exc:
                qerr = _error_text(exc)
        if q is None:
            extra["quantization"] = "included (turbo.ops.grouped_gemm_fp8)"
        mode_rows, steps = [], {}
        for i, (name, ctx, fn, baseline) in enumerate(impls):
            row = Row(op, case["case"], name, baseline, extra=dict(extra))
            mode_rows.append(row)
            if name == FP8_PEER and q is None:
                row.error = qerr or "no pre-quantized operands for torch._scaled_grouped_mm"
                continue
            try:
                with ctx():
                    out = fn(a, w, q, *args)
                row.snr_db = snr_db(ref, _pick(out.detach(), spans))
                del out
                steps[i] = ((lambda fn=fn: fn(a, w, q, *args)), ctx)
            except Exception as exc:
                row.error = _error_text(exc)
                if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                    traceback.print_exc()
        times, errors = _time_interleaved(steps, warmup_ms, rep_ms)
        peer_ms = None
        record_times(mode_rows, times, errors, flops)
        for row in mode_rows:
            if row.ms is None:
                continue
            if bf16_ms:
                row.extra["speedup_vs_bf16"] = bf16_ms / row.ms
            if row.impl == FP8_PEER:
                peer_ms = row.ms
        for row in mode_rows:
            row.baseline_ms = bf16_ms if row.baseline == PEER else peer_ms
            rows.append(row.finalize())
            log(row)
        del q
        _free(device)
    del a, w, w64, ref
    _free(device)
    return rows


# ---- driver ---------------------------------------------------------------------------------
def _print_row(row: Row) -> None:
    e = row.extra
    print_compute_row(row, f"{e.get('G')}x{e.get('M')}x{e.get('N')}x{e.get('K')}", (26, 40, 24, 17))

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="result directory (default: benchmarks/results/<gpu-slug>)")
    p.add_argument("--quick", action="store_true",
                   help=f"only {', '.join(QUICK_MODELS)} at EP {QUICK_EPS[0]}, {QUICK_TOKENS[0]} tokens per expert")
    p.add_argument("--cpu-smoke", action="store_true",
                   help=f"tiny shapes (tokens, N, K / {SMOKE_DIV}); runs without a GPU")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help=f"tokens per expert (default {' '.join(map(str, DEFAULT_TOKENS))}; "
                        f"all: {' '.join(map(str, ALL_TOKENS))})")
    p.add_argument("--ep", type=int, nargs="+", default=None, help=f"expert parallelism (default {' '.join(map(str, EPS))})")
    p.add_argument("--models", nargs="+", default=None, help=f"models (default: {' '.join(MOE_MODELS)})")
    # lenient: run_all passes the same options to every benchmark, so names another benchmark
    # knows (but this one does not) are ignored rather than rejected
    p.add_argument("--cases", nargs="+", default=None, help=f"subset of {', '.join(CASES)}")
    p.add_argument("--routings", nargs="+", default=list(ROUTINGS), help=f"subset of {', '.join(ROUTINGS)}")
    p.add_argument("--impls", nargs="+", default=list(IMPLS) + [FP8_PEER],
                   help=f"subset of {', '.join(IMPLS)}, {FP8_PEER}; FP8 only: {', '.join(FP8_ONLY_IMPLS)}")
    p.add_argument("--modes", nargs="+", default=list(MODES), help=f"subset of {', '.join(MODES)}")
    p.add_argument("--fp8", nargs="*", default=None,
                   help=f"FP8 granularities (default {' '.join(FP8_GRANS)}; '--fp8' alone: none)")
    p.add_argument("--timing", choices=("do_bench", "graph"), default="do_bench",
                   help="do_bench (host time included where it shows) or graph (device time alone, CUDA-graph "
                        "replay with L2 flushed per call; forward+backward with the grads reset in every call)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 10; 0 with --cpu-smoke)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"interleaved timing rounds per implementation (default {ROUNDS}; 1 with --cpu-smoke)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition time per round (default 40; 0 with --cpu-smoke)")
    args, _unknown = p.parse_known_args(argv)
    return args


def run(args: argparse.Namespace) -> tuple[Path, list[Row]]:
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_smoke:
        raise SystemExit("bench_grouped_gemm: no CUDA device; use --cpu-smoke for a functional smoke run")
    if args.cpu_smoke and not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels through the interpreter
    global _rounds
    _rounds = 1 if args.cpu_smoke else (args.rounds or ROUNDS)
    device = torch.device("cuda" if has_cuda else "cpu")
    models = [x for x in (args.models or (QUICK_MODELS if args.quick else MOE_MODELS)) if x in MODELS]
    eps = list(args.ep or (QUICK_EPS if args.quick else EPS))
    tokens = list(args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS))
    cases_sel = [c for c in (args.cases or ()) if c in CASES] or None  # none of ours: all of ours
    if cases_sel is None and args.cpu_smoke:
        cases_sel = list(SMOKE_CASES)  # the interpreter is slow: one case (both routings) is enough
    routings = [r for r in args.routings if r in ROUTINGS] or list(ROUTINGS)
    modes = [x for x in args.modes if x in MODES] or list(MODES)
    if args.timing == "graph" and has_cuda:
        set_timing("graph")
    names = [x for x in args.impls if x in IMPLS]
    if PEER not in names:
        names.insert(0, PEER)  # the peer is always measured: speedups need it
    # the FP8 peer is always measured too; turbo-gluon (FP8 pinned to GLUON) exists for FP8 only
    fp8_names = [FP8_PEER] + [x for x in names if x != PEER] + [x for x in args.impls if x in FP8_ONLY_IMPLS]
    grans = list(FP8_GRANS) if args.fp8 is None else [x.upper() for x in args.fp8 if x.upper() in FP8_GRANS]
    div = SMOKE_DIV if args.cpu_smoke else 1
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.cpu_smoke else 10.0)
    rep_ms = args.rep_ms if args.rep_ms is not None else (0.0 if args.cpu_smoke else 40.0)
    out_dir = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()

    cases = build_cases(models, eps, tokens, div, cases_sel, routings)
    impl_objs = _make_impls(names)
    if args.cpu_smoke and not has_cuda:
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()  # the interpreter's bf16 tl.dot is wrong without it (triton issue #11584)
        print("bench_grouped_gemm: --cpu-smoke on CPU checks that everything runs; timings mean nothing.")
    print(f"bench_grouped_gemm: {len(cases)} unique cases x {len(modes)} modes x {len(impl_objs)} impls on {device}",
          flush=True)
    rows: list[Row] = []
    for case in cases:
        new = run_case(case, impl_objs, modes, device, warmup_ms, rep_ms, _print_row)
        for r in new:
            r.extra["timing"] = args.timing
        rows.extend(new)
        write_results(rows, out_dir, RESULT_NAME)  # after every case: a run cut short keeps its rows

    if grans and "fwd" in modes:
        bf16 = {(r.case, r.impl): r.ms for r in rows if r.op == "grouped_gemm_fwd"}
        fp8_cases = [c for c in cases if c["routing"] == "balanced"]
        if args.cpu_smoke:
            fp8_cases = fp8_cases[:1]
        for case in fp8_cases:
            new = run_fp8_case(case, fp8_names, grans, device, warmup_ms, rep_ms, _print_row,
                               lambda c: bf16.get((c["case"], PEER)))
            for r in new:
                r.extra["timing"] = args.timing
            rows.extend(new)
            write_results(rows, out_dir, RESULT_NAME)

    path = finish_run(rows, out_dir, RESULT_NAME)
    return path, rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
