"""MoE layer benchmark: one full forward+backward step (router, permutation, experts, combine).

Cases: ``T`` tokens of a model's MoE layer on one rank, ``E`` local experts, its top-k, hidden
``H`` and expert width ``F`` (``moe_intermediate``) from ``primus_turbo.testing.MODELS``. The layer
routes the ``T`` tokens over its ``E`` local experts only (no all-to-all), so each local expert gets
``T * topk / E`` rows on average, as in an expert-parallel rank with balanced dispatch. EP (local
experts = experts / EP) per model:

- ``DeepSeek-V3``   (H 7168, F 2048, 256 experts, top-8): EP 8  -> E = 32,
- ``Qwen3-30B-A3B`` (H 2048, F 768,  128 experts, top-8): EP 4  -> E = 32,
- ``Mixtral-8x7B``  (H 4096, F 14336,  8 experts, top-2): EP 1  -> E = 8 (the whole layer),
- ``GPT-OSS-20B``   (H 2880, F 2880,  32 experts, top-4): EP 1  -> E = 32 (the whole layer),

``T`` = 16384 (``--quick``: DeepSeek-V3 only, 8192 tokens). Router: softmax over the ``E`` local
experts, then the top-k probabilities (not renormalized) for every model (DeepSeek-V3's sigmoid
group-limited routing is not modelled), one fp32 router GEMM (``--router-dtype``; an fp32 router
makes the two sides route the same tokens to the same experts except on near-ties). Expert MLP:
SwiGLU, ``fc1 [E, 2F, H]`` (gate rows first), ``fc2 [E, H, F]``, no bias.

Timed per case (``x [T, H]`` bf16, the same upstream gradient ``dy [T, H]``; each step is
``layer(x).backward(dy)``, giving grads of x, the router and both expert weights; all three share
the same parameter tensors, so outputs are comparable):

- ``torch-baseline`` (the peer; what TorchTitan does): ``logits = x.float() @ Wr.T``, softmax,
  ``torch.topk``; ``torch.argsort`` (stable) of the flattened expert ids, ``index_select`` of the
  token rows and probs; int32 cumulative offsets of the tokens per expert, counted with a
  ``scatter_add_`` of ones into an int64 ``[E]`` (exact integer counts, the same as ``bincount``'s;
  ``bincount`` is not used because on CUDA it reads the ids' min / max back to the host, TorchTitan's
  ``histc`` gives float counts); ``torch._grouped_mm(xp, w1.transpose(-2, -1), offs=offs)``;
  ``F.silu(gate) * up * probs`` (bf16); ``torch._grouped_mm`` for fc2; ``zeros.index_add_(0,
  token_ids, y)`` (bf16) back to ``[T, H]``. No host sync on CUDA. Off CUDA (``--cpu-smoke``) the
  grouped GEMMs are a per-expert matmul loop, which reads the counts to the host.
- ``turbo-bf16``: ``turbo.modules.MoELayer(H, F, E, topk, score_function="softmax",
  router_dtype=fp32)`` called with ``num_out_tokens = T * topk`` (no host sync).
- ``turbo-fp8-blockwise``: the same layer with ``config=Float8QuantConfig(granularity="BLOCKWISE",
  block_size=128)`` (both expert grouped GEMMs in FP8; quantization included in the time).
- ``turbo-bf16-pad128`` / ``turbo-fp8-blockwise-pad128`` (opt-in): the same layers with
  ``pad_multiple=128`` (each expert's rows padded to whole 128-row GEMM tiles, as FP8 training
  setups pad the routing), called with the worst-case capacity ``layer.max_permuted_tokens(T)``
  (no host sync); the FLOPs still count the ``T * topk`` routed rows.
- ``turbo-fp8-blockwise-mb`` (opt-in): the FP8 layer called with ``is_first_microbatch=False``, a
  micro-batch after the first of an optimizer step: the expert weights' FP8 copies come from the
  layer's cache (quantized once, on the first timed call) instead of being quantized every step.
  Gradient-accumulation training sees this on every micro-batch but the first.

Timing: interleaved rounds of :func:`benchmarks.common.time_interleaved` (``do_bench`` median, L2
flushed, grads set to None before every repetition); the row's ``ms`` is the median over rounds.

``--variant TAG:VAR=VALUE[,VAR=VALUE...]`` (repeatable) adds ``<impl>@TAG`` for every turbo impl
asked for: the same layer run with those environment settings (an opt-in path, say), timed in the
same interleaved rounds as the plain impl, so the two compare without the run-to-run spread.

FLOPs (``tflops``) count the expert GEMMs only (router, softmax, permutation and combine excluded),
with ``M = T * topk`` routed rows::

    fwd      = 2*M*H*(2F) + 2*M*F*H = 6*M*H*F
    fwd+bwd  = 3 * fwd            = 18*M*H*F     (dgrad and wgrad each cost one forward)

``speedup`` = torch-baseline ms / impl ms; ``extra.speedup_vs_bf16_baseline`` is the same number
(the FP8 layer is compared with the BF16 baseline). Targets of the issue: turbo-bf16 >= 1.3x,
turbo-fp8-blockwise >= 1.6x.

Correctness (not asserted, reported): ``snr_db`` is the SNR of the layer output against the
baseline's on the same inputs and weights; ``extra`` has the SNR of x.grad, of the three weight
grads, the number of tokens whose top-k expert set differs between the baseline's routing and
turbo's router (computed once per case from the shared weights; a near-tie in the logits can flip
an expert, which changes that token's output and gradient completely) and the output / x.grad SNR
over the tokens routed identically. The baseline's bf16 ``index_add_`` combine rounds once per
added expert, turbo accumulates in fp32: the SNR is of the two against each other, not against an
exact reference.

    python benchmarks/bench_moe_layer.py --out benchmarks/results/h200
    python benchmarks/bench_moe_layer.py --out /tmp/b --quick             # DeepSeek-V3, 8192 tokens
    python benchmarks/bench_moe_layer.py --out /tmp/b --quick --cpu-smoke # tiny shapes, no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import Row, finish_run, gpu_slug, print_compute_row  # noqa: E402
from benchmarks.common import error_text as _error_text  # noqa: E402
from benchmarks.common import free_memory as _free  # noqa: E402
from benchmarks.common import time_interleaved  # noqa: E402
from primus_turbo.testing import MODELS, snr_db  # noqa: E402

RESULT_NAME = "moe_layer"
OP = "moe_layer_fwd_bwd"
#: model -> EP (local experts = experts / EP); see the module docstring for the choice.
MODEL_EP = {"DeepSeek-V3": 8, "Qwen3-30B-A3B": 4, "Mixtral-8x7B": 1, "GPT-OSS-20B": 1}
MOE_MODELS = tuple(MODEL_EP)
TOKENS = (16384,)
QUICK_MODELS = ("DeepSeek-V3",)
QUICK_TOKENS = (8192,)
SMOKE_DIV = 64  # --cpu-smoke divides hidden and ffn by this (kept multiples of 16)
SMOKE_TOKENS = 64
SMOKE_EXPERTS = 4
SMOKE_TOPK = 2
PEER = "torch-baseline"
IMPLS = (PEER, "turbo-bf16", "turbo-fp8-blockwise", "turbo-bf16-pad128", "turbo-fp8-blockwise-pad128",
         "turbo-fp8-blockwise-mb")
DEFAULT_IMPLS = IMPLS[:3]
PAD = 128  # the "-pad128" impls: each expert's rows padded to a multiple of PAD (one GEMM tile)
BLOCK_SIZE = 128
ROUNDS = 3  # interleaved timing rounds (median of the round medians); 1 with --cpu-smoke
SEED = 1234

_rounds = ROUNDS


# ---- cases ----------------------------------------------------------------------------------
def _smoke_dim(x: int, div: int) -> int:
    return max(16, (x // div) // 16 * 16)


def build_cases(models: Sequence[str], tokens: Sequence[int], smoke: bool = False) -> list[dict[str, Any]]:
    """One case per (model, tokens): H, F, E (local experts), topk, EP."""
    cases = []
    for t in tokens:
        for name in models:
            cfg = MODELS[name]
            ep = MODEL_EP.get(name, 1)
            h, f, e, k = cfg.hidden, cfg.moe_intermediate, cfg.num_experts // ep, cfg.topk
            tt = t
            if smoke:
                h, f = _smoke_dim(h, SMOKE_DIV), _smoke_dim(f, SMOKE_DIV)
                e, k, tt = min(e, SMOKE_EXPERTS), min(k, SMOKE_TOPK), min(t, SMOKE_TOKENS)
            cases.append({"case": f"{name}:T{tt}:E{e}", "model": name, "T": tt, "H": h, "F": f, "E": e,
                          "topk": k, "ep": ep})
    return cases


def expert_flops(t: int, topk: int, h: int, f: int) -> int:
    """Expert GEMM flops of one forward+backward step: 3 * (2*M*H*2F + 2*M*F*H), M = T*topk."""
    m = t * topk
    return 3 * (2 * m * h * 2 * f + 2 * m * f * h)


# ---- the PyTorch baseline -------------------------------------------------------------------
def expert_counts(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert, int64 ``[E]``, from the flattened expert ids, with no host sync.

    ``torch.bincount`` gives the same counts, but on CUDA it reads the ids' min and max back to the
    host to size its output; a scatter-add of ones into a buffer of known size needs nothing from
    the device. Integer atomics make the counts exact and deterministic. Ids must be in ``[0, E)``
    (``torch.topk`` indices are)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    return counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int64))


def _grouped(a: torch.Tensor, w: torch.Tensor, offs32: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``a [M, K]`` rows grouped by expert times ``w [E, N, K]`` (trans_b) -> ``[M, N]``."""
    if a.is_cuda:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32)
    # CPU (smoke runs): torch._grouped_mm has no CPU backward; a per-expert loop (host sync)
    outs, start = [], 0
    for g, n in enumerate(counts.tolist()):
        outs.append(a[start:start + n] @ w[g].t())
        start += n
    return torch.cat(outs)


def torch_moe_layer(x: torch.Tensor, wr: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk: int,
                    routing: Optional[dict] = None) -> torch.Tensor:
    """TorchTitan-style MoE layer (softmax top-k, argsort permutation, _grouped_mm, SwiGLU,
    index_add_ combine). ``routing``, when given, receives the top-k expert ids ``[T, topk]``."""
    t, _ = x.shape
    e = w1.shape[0]
    ffn = w1.shape[1] // 2
    logits = F.linear(x.to(wr.dtype), wr)                                  # [T, E]
    scores = torch.softmax(logits.float(), dim=-1)
    probs, idx = torch.topk(scores, topk, dim=-1)                          # [T, k]
    if routing is not None:
        routing["idx"] = idx.detach()
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)                               # expert-major
    token_ids = order // topk
    xp = x.index_select(0, token_ids)                                      # [M, H]
    pp = probs.reshape(-1).index_select(0, order)                          # [M]
    counts = expert_counts(flat, e)                                        # [E] int64, no sync
    offs32 = torch.cumsum(counts, 0).to(torch.int32)
    hdn = _grouped(xp, w1, offs32, counts)                                 # [M, 2F]
    act = F.silu(hdn[:, :ffn]) * hdn[:, ffn:] * pp.to(hdn.dtype).unsqueeze(-1)
    y = _grouped(act, w2, offs32, counts)                                  # [M, H]
    return torch.zeros_like(x).index_add_(0, token_ids, y)


# ---- implementations ------------------------------------------------------------------------
def _turbo_layers(case: dict[str, Any], names: Sequence[str], device: torch.device, router_dtype: torch.dtype,
                  gen: torch.Generator) -> tuple[dict[str, Any], dict[str, str]]:
    """{impl: MoELayer} sharing one set of parameters (the bf16 layer's), and {impl: error}."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    h, f, e, k = case["H"], case["F"], case["E"], case["topk"]
    base = turbo.modules.MoELayer(h, f, e, k, score_function="softmax", router_dtype=router_dtype,
                                  dtype=torch.bfloat16, device=device)
    with torch.no_grad():  # deterministic weights (nn.Linear-like scale)
        for p in (base.router.weight, base.experts.linear_fc1.weight, base.experts.linear_fc2.weight):
            bound = p.shape[-1] ** -0.5
            for sub in (p.unsqueeze(0) if p.dim() == 2 else p):  # one expert at a time (memory)
                sub.copy_((torch.rand(sub.shape, device=device, generator=gen) * 2 - 1) * bound)
    layers: dict[str, Any] = {"turbo-bf16": base}
    errors: dict[str, str] = {}
    for name in names:
        if name == "turbo-bf16":
            continue
        impl = _base_impl(name)
        try:
            cfg = (Float8QuantConfig(granularity="BLOCKWISE", block_size=BLOCK_SIZE)
                   if impl.startswith("turbo-fp8-blockwise") else None)
            layer = turbo.modules.MoELayer(h, f, e, k, score_function="softmax", router_dtype=router_dtype,
                                           config=cfg, pad_multiple=PAD if impl.endswith("-pad128") else None,
                                           dtype=torch.bfloat16, device="meta")
            layer.router.weight = base.router.weight
            layer.experts.linear_fc1.weight = base.experts.linear_fc1.weight
            layer.experts.linear_fc2.weight = base.experts.linear_fc2.weight
            layers[name] = layer
        except Exception as exc:
            errors[name] = _error_text(exc)
    return layers, errors


def _base_impl(name: str) -> str:
    """``turbo-fp8-blockwise@fused`` -> ``turbo-fp8-blockwise`` (a ``--variant`` of an impl)."""
    return name.split("@", 1)[0]


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``TAG:VAR=VALUE[,VAR=VALUE...]`` -> (TAG, {VAR: VALUE}); malformed specs raise naming the spec."""
    tag, sep, body = spec.partition(":")
    pairs = [kv.partition("=") for kv in body.split(",")] if body else []
    if not sep or not tag or "@" in tag or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise ValueError(f"--variant {spec!r}: expected TAG:VAR=VALUE[,VAR=VALUE...]")
    return tag, {k: v for k, _, v in pairs}


@contextlib.contextmanager
def _env(settings: dict[str, str]):
    """Environment settings for the duration of one implementation's call (restored after)."""
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _turbo_routing(layer, x: torch.Tensor) -> torch.Tensor:
    """The routing map ``[T, E]`` bool MoELayer computes for ``x`` (its router and top-k op)."""
    from primus_turbo.pytorch.ops.moe_router import fused_group_topk_routing_with_aux_score

    with torch.no_grad():
        rw = layer.router.weight
        logits = layer.router(x.to(rw.dtype))
        _, _, rmap = fused_group_topk_routing_with_aux_score(logits, layer.topk, 1, 1, "softmax", None)
    return rmap.bool()


def _snr_rows(ref: torch.Tensor, out: torch.Tensor, keep: Optional[torch.Tensor]) -> Optional[float]:
    if keep is None or not bool(keep.any()):
        return None
    return snr_db(ref[keep], out[keep])


# ---- one case -------------------------------------------------------------------------------
def run_case(case: dict[str, Any], names: Sequence[str], device: torch.device, router_dtype: torch.dtype,
             warmup_ms: float, rep_ms: float, log: Callable[[Row], None],
             variants: Optional[dict[str, dict[str, str]]] = None) -> list[Row]:
    _free(device)  # whatever the previous case left
    t, h, f, e, k = case["T"], case["H"], case["F"], case["E"], case["topk"]
    flops = expert_flops(t, k, h, f)
    extra_base = {"model": case["model"], "T": t, "H": h, "F": f, "E": e, "topk": k, "ep": case["ep"],
                  "M": t * k, "shape": f"T{t}xH{h}xF{f}xE{e}xk{k}", "dtype": "bf16",
                  "router_dtype": str(router_dtype).replace("torch.", ""), "flops": flops,
                  "flops_formula": "18*T*topk*H*F (expert GEMMs, fwd+bwd)"}
    rows = {n: Row(OP, case["case"], n, PEER, extra=dict(extra_base)) for n in names}
    variants = variants or {}

    def env_of(name: str) -> dict[str, str]:
        return variants[name.split("@", 1)[1]] if "@" in name else {}

    for n, r in rows.items():
        if env_of(n):
            r.extra["env"] = env_of(n)
        if _base_impl(n).endswith("-pad128"):
            r.extra.update(pad_multiple=PAD)
        if n.startswith("turbo-fp8-blockwise"):
            r.extra.update(granularity="BLOCKWISE", block_size=BLOCK_SIZE, dtype="e4m3 experts, bf16 rest")
        if _base_impl(n).endswith("-mb"):
            r.extra["weights"] = "FP8 copies cached (is_first_microbatch=False)"
    layers: dict[str, Any] = {}
    x = dy = None
    try:
        gen = torch.Generator(device=device).manual_seed(SEED)
        turbo_names = [n for n in names if n != PEER]
        layers, lerr = _turbo_layers(case, turbo_names, device, router_dtype, gen)
        for n, err in lerr.items():
            rows[n].error = err
        base = layers["turbo-bf16"]
        wr, w1, w2 = base.router.weight, base.experts.linear_fc1.weight, base.experts.linear_fc2.weight
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
        dy = torch.randn(t, h, device=device, dtype=torch.bfloat16, generator=gen)
    except Exception as exc:
        for r in rows.values():
            r.error = r.error or _error_text(exc)
        if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
            traceback.print_exc()
        layers.clear()
        _free(device)
        out_rows = list(rows.values())
        for r in out_rows:
            log(r)
        return out_rows

    params = [x, wr, w1, w2]
    m_cap = t * k

    def fwd(name: str, routing: Optional[dict] = None) -> torch.Tensor:
        if name == PEER:
            return torch_moe_layer(x, wr, w1, w2, k, routing)
        layer = layers[name]
        # padded layers: the worst-case capacity (rows past the padded segments are zero): no host sync
        cap = layer.max_permuted_tokens(t) if layer.pad_multiple else m_cap
        if _base_impl(name).endswith("-mb"):  # a later micro-batch: the cached FP8 expert weights
            return layer(x, num_out_tokens=cap, is_first_microbatch=False)
        return layer(x, num_out_tokens=cap)

    # Pass 1: correctness (and compilation / autotuning of every implementation).
    ref: dict[str, torch.Tensor] = {}
    keep_rows: Optional[torch.Tensor] = None
    steps: dict[str, tuple[Callable, Callable]] = {}
    for name in names:
        row = rows[name]
        if row.error:
            continue
        try:
            for p in params:
                p.grad = None
            routing: dict = {}
            with _env(env_of(name)):
                out = fwd(name, routing)
                out.backward(dy)
            got = {"out": out.detach(), "x": x.grad, "router": wr.grad, "fc1": w1.grad, "fc2": w2.grad}
            del out
            if name == PEER:
                ref = got
                if "turbo-bf16" in layers:
                    mask = torch.zeros(t, e, dtype=torch.bool, device=device)
                    mask.scatter_(1, routing["idx"], True)
                    same = (mask == _turbo_routing(layers["turbo-bf16"], x)).all(dim=1)
                    keep_rows = same
                    n_diff = int((~same).sum())
                    for r in rows.values():
                        r.extra["routing_mismatch_tokens"] = n_diff
            elif ref:
                row.snr_db = snr_db(ref["out"], got["out"])
                for key in ("x", "router", "fc1", "fc2"):
                    if ref[key] is not None and got[key] is not None:
                        row.extra[f"snr_grad_{key}_db"] = snr_db(ref[key], got[key])
                row.extra["snr_out_same_routing_db"] = _snr_rows(ref["out"], got["out"], keep_rows)
                row.extra["snr_grad_x_same_routing_db"] = _snr_rows(ref["x"], got["x"], keep_rows)
                row.extra["snr_vs"] = PEER
            del got
            steps[name] = ((lambda name=name: fwd(name).backward(dy)), (lambda name=name: _env(env_of(name))))
        except Exception as exc:
            row.error = _error_text(exc)
            if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                traceback.print_exc()
            _free(device)
    ref = {}
    keep_rows = None
    for p in params:
        p.grad = None
    _free(device)

    # Pass 2: timing, interleaved over rounds.
    times, errors = time_interleaved(steps, _rounds, warmup_ms, rep_ms, params)
    baseline_ms = statistics.median(times[PEER]) if times.get(PEER) else None
    out_rows = []
    for name in names:
        row = rows[name]
        if name in errors:
            row.error = errors[name]
        ts = times.get(name)
        if not row.error and ts:
            row.ms = statistics.median(ts)
            row.extra["round_ms"] = [round(v, 5) for v in ts]
            row.tflops = flops / (row.ms * 1e-3) / 1e12
        row.baseline_ms = baseline_ms
        row.finalize()
        if row.speedup is not None and name != PEER:
            row.extra["speedup_vs_bf16_baseline"] = row.speedup
        out_rows.append(row)
        log(row)
    steps.clear()
    layers.clear()
    params.clear()
    _free(device)
    return out_rows


# ---- driver ---------------------------------------------------------------------------------
def _print_row(row: Row) -> None:
    print_compute_row(row, row.extra.get("shape", ""), (18, 28, 32, 20))

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="result directory (default: benchmarks/results/<gpu-slug>)")
    p.add_argument("--quick", action="store_true",
                   help=f"only {', '.join(QUICK_MODELS)} at {QUICK_TOKENS[0]} tokens")
    p.add_argument("--cpu-smoke", action="store_true",
                   help=f"tiny shapes (hidden, ffn / {SMOKE_DIV}, {SMOKE_TOKENS} tokens, <= {SMOKE_EXPERTS} "
                        f"experts, top-{SMOKE_TOPK}); runs without a GPU")
    # lenient: run_all passes the same options to every benchmark, so names another benchmark
    # knows (but this one does not) are ignored rather than rejected
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help=f"tokens per step (default {' '.join(map(str, TOKENS))})")
    p.add_argument("--models", nargs="+", default=None, help=f"models (default: {' '.join(MOE_MODELS)})")
    p.add_argument("--impls", nargs="+", default=list(DEFAULT_IMPLS),
                   help=f"subset of {', '.join(IMPLS)} (default: the first three)")
    p.add_argument("--router-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the router weight and GEMM on both sides (default fp32)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 100; 0 with --cpu-smoke)")
    p.add_argument("--rep-ms", type=float, default=None,
                   help="do_bench repetition time per round (default 400; 0 with --cpu-smoke)")
    p.add_argument("--variant", action="append", default=[], metavar="TAG:VAR=VALUE[,VAR=VALUE...]",
                   help="also time every turbo impl asked for as <impl>@TAG under these environment settings")
    args, _unknown = p.parse_known_args(argv)
    return args


def run(args: argparse.Namespace) -> tuple[Path, list[Row]]:
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_smoke:
        raise SystemExit("bench_moe_layer: no CUDA device; use --cpu-smoke for a functional smoke run")
    if args.cpu_smoke and not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    global _rounds
    _rounds = 1 if args.cpu_smoke else ROUNDS
    device = torch.device("cuda" if has_cuda else "cpu")
    models = [x for x in (args.models or (QUICK_MODELS if args.quick else MOE_MODELS)) if x in MODELS]
    tokens = list(args.tokens or (QUICK_TOKENS if args.quick else TOKENS))
    names = [x for x in IMPLS if x in args.impls] or list(DEFAULT_IMPLS)  # none of ours: the default ones
    for must in ("turbo-bf16", PEER):  # the peer gives the speedups, turbo-bf16 owns the weights
        if must not in names:
            names.insert(0, must)
    names = [x for x in IMPLS if x in names]
    variants = dict(parse_variant(v) for v in args.variant)
    names += [f"{n}@{tag}" for tag in variants for n in list(names) if n != PEER]
    router_dtype = torch.float32 if args.router_dtype == "fp32" else torch.bfloat16
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.cpu_smoke else 100.0)
    rep_ms = args.rep_ms if args.rep_ms is not None else (0.0 if args.cpu_smoke else 400.0)
    out_dir = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()

    cases = build_cases(models, tokens, smoke=args.cpu_smoke)
    if args.cpu_smoke and not has_cuda:
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()  # the interpreter's bf16 tl.dot is wrong without it (triton issue #11584)
        print("bench_moe_layer: --cpu-smoke on CPU checks that everything runs; timings mean nothing.")
    print(f"bench_moe_layer: {len(cases)} cases x {len(names)} impls on {device}", flush=True)
    rows: list[Row] = []
    for case in cases:
        rows.extend(run_case(case, names, device, router_dtype, warmup_ms, rep_ms, _print_row, variants))

    path = finish_run(rows, out_dir, RESULT_NAME)
    return path, rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
