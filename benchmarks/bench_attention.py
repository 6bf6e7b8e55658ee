"""BF16 attention benchmark on the attention shapes of real LLMs.

Head configurations ``(heads_q, heads_kv, d_qk, d_v)`` come from ``MODELS`` (deduplicated, first
model name kept, the others in ``extra.also``): head dims 64 (GPT-OSS), 128 (Llama, Qwen, Mistral,
Mixtral) and 192/128 (DeepSeek MLA). For each, seq in ``--seq`` (default 2048 8192; all: 2048 4096
8192 16384) with ``batch = 16384 // seq`` (16k tokens per case), causal and non-causal, bf16,
bshd layout (``[batch, seq, heads, head_dim]``, contiguous). Implementations:

- ``sdpa-cudnn``: ``F.scaled_dot_product_attention`` under ``sdpa_kernel([CUDNN_ATTENTION])``,
- ``sdpa-flash``: the same under ``sdpa_kernel([FLASH_ATTENTION])`` (FlashAttention-2; the peer),
- ``turbo-default``: ``turbo.ops.flash_attn_func(q, k, v, causal=..., softmax_scale=None)``, no pin,
- ``turbo-triton``: the same with the attention backend pinned to TRITON,
- ``turbo-fp8`` (opt-in: ``--impls ... turbo-fp8``): ``turbo.ops.flash_attn_fp8_func`` (FP8 E4M3 forward,
  block scales per 128 tokens and head; its backward is bf16 on the dequantized FP8 inputs);
  ``extra.speedup_vs_turbo_bf16`` is its ratio to ``turbo-triton`` (our bf16 kernels; measured
  whenever ``turbo-fp8`` is asked for).

The SDPA peers get ``q, k, v`` transposed to ``[b, h, s, d]`` (views, no copies) and handle GQA
with ``enable_gqa=True``. Only if that call fails for a peer is k/v repeated to ``heads_q`` heads,
once, outside the timed region (the row then says ``extra.gqa = "repeat_kv"``). A peer that
cannot run a case (e.g. flash with ``d_qk != d_v``) gets the error in its row.

Forward (``attn_fwd``, inputs without ``requires_grad``) and backward (``attn_bwd``: one forward,
then ``out.backward(dout, retain_graph=True)`` timed with ``grad_to_none=[q, k, v]``) are timed
separately, interleaved over rounds. FLOPs: forward ``2 * B * Sq * Skv * Hq * (d_qk + d_v)``,
halved for causal; backward 2.5x the forward. ``speedup`` is against ``sdpa-flash`` (the issue's
targets are against it); ``extra.speedup_vs_cudnn`` and ``extra.speedup_vs_best_peer`` give the
ratio to ``sdpa-cudnn`` and to the faster peer of the row's case. Accuracy: SNR of each
implementation's forward output (and, for ``attn_bwd``, of dq in ``extra.snr_dq_db``) against an
fp32 SDPA (math backend) reference on the first batch element and the first 2 query heads.

    python benchmarks/bench_attention.py --out benchmarks/results/h200
    python benchmarks/bench_attention.py --out /tmp/b --seq 2048 4096 8192 16384
    python benchmarks/bench_attention.py --out /tmp/b --quick             # Llama-3.1-8B + DeepSeek-V3, seq 4096
    python benchmarks/bench_attention.py --out /tmp/b --quick --cpu-smoke # tiny shapes, no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import Row, finish_run, gpu_slug  # noqa: E402
from benchmarks.common import error_text as _error_text  # noqa: E402
from benchmarks.common import free_memory as _free  # noqa: E402
from benchmarks.common import time_interleaved  # noqa: E402
from primus_turbo.testing import MODELS, snr_db  # noqa: E402

RESULT_NAME = "attention_bf16"
TOKENS = 16384  # batch * seq per case
ALL_SEQS = (2048, 4096, 8192, 16384)
DEFAULT_SEQS = (2048, 8192)  # keeps the GPU run short
QUICK_MODELS = ("Llama-3.1-8B", "DeepSeek-V3")
QUICK_SEQS = (4096,)
SMOKE_SEQ = 64  # --cpu-smoke: seq 64, batch 2, heads 2 (q) / 1 or 2 (kv), head dims / 4
SMOKE_TOKENS = 128
SMOKE_DIM_DIV = 4
REF_HEADS = 2  # query heads (of batch element 0) checked against the fp32 reference
PEER = "sdpa-flash"
CUDNN = "sdpa-cudnn"
PEERS = (CUDNN, PEER)
IMPLS = ("sdpa-cudnn", "sdpa-flash", "turbo-default", "turbo-triton")
OPT_IMPLS = ("turbo-fp8",)  # only when named in --impls
FP8_BASE = "turbo-triton"  # turbo-fp8's extra.speedup_vs_turbo_bf16 is against this row
MODES = ("fwd", "bwd")
CAUSALS = ("full", "causal")
BWD_FLOP_FACTOR = 2.5
ROUNDS = 3  # interleaved timing rounds (median of the round medians); 1 with --cpu-smoke

_rounds = ROUNDS


# ---- cases ----------------------------------------------------------------------------------
def head_configs(models: Sequence[str]) -> list[dict[str, Any]]:
    """Unique (heads_q, heads_kv, d_qk, d_v) over ``models``, first model name kept."""
    seen: dict[tuple[int, int, int, int], dict[str, Any]] = {}
    for name in models:
        c = MODELS[name]
        key = (c.num_heads_q, c.num_heads_kv, c.head_dim_qk, c.head_dim_v)
        if key in seen:
            seen[key]["also"].append(name)
            continue
        seen[key] = {"model": name, "Hq": key[0], "Hkv": key[1], "Dqk": key[2], "Dv": key[3], "also": []}
    return list(seen.values())


def build_cases(
    models: Sequence[str], seqs: Sequence[int], smoke: bool = False, causals: Sequence[str] = CAUSALS
) -> list[dict[str, Any]]:
    """One case per head configuration x seq x causal; ``batch * seq = TOKENS``.

    ``smoke``: seq ``SMOKE_SEQ``, heads 2 / (1, or 2 without GQA), head dims / ``SMOKE_DIM_DIV``.
    """
    cases: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for hc in head_configs(models):
        hq, hkv, dqk, dv = hc["Hq"], hc["Hkv"], hc["Dqk"], hc["Dv"]
        if smoke:
            hkv = 1 if hkv < hq else 2
            hq = 2
            dqk, dv = max(16, dqk // SMOKE_DIM_DIV), max(16, dv // SMOKE_DIM_DIV)
        for seq in ([SMOKE_SEQ] if smoke else seqs):
            batch = max(1, (SMOKE_TOKENS if smoke else TOKENS) // seq)
            for causal in causals:
                key = (batch, seq, hq, hkv, dqk, dv, causal)
                if key in seen:
                    continue
                seen.add(key)
                cases.append({
                    "case": f"{hc['model']}:s{seq}:{causal}", "model": hc["model"], "B": batch, "S": seq,
                    "Hq": hq, "Hkv": hkv, "Dqk": dqk, "Dv": dv, "causal": causal == "causal",
                    "also": list(hc["also"]),
                })
    return cases


def attn_flops(b: int, sq: int, skv: int, hq: int, dqk: int, dv: int, causal: bool, mode: str = "fwd") -> float:
    """2*B*Sq*Skv*Hq*(d_qk+d_v), halved for causal; the backward is 2.5x the forward."""
    f = 2.0 * b * sq * skv * hq * (dqk + dv)
    if causal:
        f /= 2
    return f * (BWD_FLOP_FACTOR if mode == "bwd" else 1.0)


# ---- implementations ------------------------------------------------------------------------
class _Impl:
    def __init__(self, name: str, fn: Optional[Callable], ctx: Callable[[], Any], why_not: Optional[str] = None,
                 note: Optional[str] = None):
        self.name, self.fn, self.ctx, self.why_not, self.note = name, fn, ctx, why_not, note


def _sdpa_bshd(q, k, v, causal: bool, gqa: bool):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=gqa
    )
    return out.transpose(1, 2)


def _make_impls(names: Sequence[str], on_cuda: bool) -> list[_Impl]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    impls: list[_Impl] = []
    turbo = gbm = bt = None
    turbo_err: Optional[str] = None
    if any(n not in PEERS for n in names):
        try:
            import primus_turbo.pytorch as turbo  # noqa: F811
            __import__("primus_turbo.pytorch.ops")  # makes turbo.ops an attribute
            from primus_turbo.pytorch.core.backend import BackendType as bt  # noqa: N813
            from primus_turbo.pytorch.core.backend import GlobalBackendManager as gbm

            if not hasattr(turbo, "ops") or not hasattr(turbo.ops, "flash_attn_func"):
                turbo_err = "primus_turbo.pytorch.ops.flash_attn_func is not available"
        except Exception as exc:
            turbo_err = f"import primus_turbo.pytorch failed: {exc!r}"

    @contextlib.contextmanager
    def pin(backend=None) -> Iterator[None]:
        if gbm is not None:
            gbm.reset()
            if backend is not None:
                gbm.set_attn_backend(backend)
        try:
            yield
        finally:
            if gbm is not None:
                gbm.reset()

    for name in names:
        if name in PEERS:
            if on_cuda:
                backend = SDPBackend.CUDNN_ATTENTION if name == CUDNN else SDPBackend.FLASH_ATTENTION
                note = None
            else:  # --cpu-smoke: neither cuDNN nor flash SDPA exists on CPU
                backend = SDPBackend.MATH
                note = "math (cpu-smoke stand-in)"
            ctx = (lambda b=backend: sdpa_kernel([b]))
            impls.append(_Impl(name, _sdpa_bshd, ctx, note=note))
        elif name in ("turbo-default", "turbo-triton"):
            if turbo_err:
                impls.append(_Impl(name, None, contextlib.nullcontext, turbo_err))
                continue

            def fn(q, k, v, causal, gqa):
                return turbo.ops.flash_attn_func(q, k, v, causal=causal, softmax_scale=None)

            ctx = (lambda: pin()) if name == "turbo-default" else (lambda: pin(bt.TRITON))
            impls.append(_Impl(name, fn, ctx))
        elif name == "turbo-fp8":
            if turbo_err or not hasattr(turbo.ops, "flash_attn_fp8_func"):
                why = turbo_err or "primus_turbo.pytorch.ops.flash_attn_fp8_func is not available"
                impls.append(_Impl(name, None, contextlib.nullcontext, why))
                continue

            def fn_fp8(q, k, v, causal, gqa):
                return turbo.ops.flash_attn_fp8_func(q, k, v, causal=causal, softmax_scale=None)

            impls.append(_Impl(name, fn_fp8, lambda: pin()))
        else:
            raise ValueError(f"unknown impl {name!r}; known: {', '.join(IMPLS + OPT_IMPLS)}")
    return impls


# ---- one case -------------------------------------------------------------------------------
def _reference(q, k, v, dout, causal: bool, g: int, with_grad: bool):
    """fp32 math-SDPA output (and dq) for batch element 0, query heads [0, REF_HEADS)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hs = min(REF_HEADS, q.size(2))
    kv_idx = torch.tensor([h // g for h in range(hs)], device=q.device)
    qs = q[:1, :, :hs].float().detach().clone().requires_grad_(with_grad)
    ks = k[:1].index_select(2, kv_idx).float()
    vs = v[:1].index_select(2, kv_idx).float()
    with sdpa_kernel([SDPBackend.MATH]), torch.enable_grad():
        out = _sdpa_bshd(qs, ks, vs, causal, False)
        dq = None
        if with_grad:
            (dq,) = torch.autograd.grad(out, qs, dout[:1, :, :hs].float())
    return out.detach(), (dq.detach() if dq is not None else None), hs


def _fill_ratios(mode_rows: Sequence[Row], impls: Sequence[_Impl]) -> None:
    peer_ms = {impls[i].name: r.ms for i, r in enumerate(mode_rows) if impls[i].name in PEERS and r.ms}
    best = min(peer_ms.values()) if peer_ms else None
    flash_ms = peer_ms.get(PEER)
    for i, row in enumerate(mode_rows):
        row.baseline_ms = flash_ms
        row.finalize()
        cudnn_ms = peer_ms.get(CUDNN)
        row.extra["cudnn_ms"] = cudnn_ms
        row.extra["best_peer"] = min(peer_ms, key=peer_ms.get) if peer_ms else None
        row.extra["speedup_vs_cudnn"] = cudnn_ms / row.ms if (row.ms and cudnn_ms) else None
        row.extra["speedup_vs_best_peer"] = best / row.ms if (row.ms and best) else None
        if impls[i].name in OPT_IMPLS:
            base = next((r.ms for j, r in enumerate(mode_rows) if impls[j].name == FP8_BASE), None)
            row.extra["speedup_vs_turbo_bf16"] = base / row.ms if (row.ms and base) else None


def run_case(
    case: dict[str, Any],
    impls: Sequence[_Impl],
    modes: Sequence[str],
    device: torch.device,
    warmup_ms: float,
    rep_ms: float,
    log: Callable[[Row], None],
) -> list[Row]:
    b, s, hq, hkv, dqk, dv, causal = (case[x] for x in ("B", "S", "Hq", "Hkv", "Dqk", "Dv", "causal"))
    g = hq // hkv
    gqa = hq != hkv
    extra_base = {"shape": f"b{b} s{s} h{hq}/{hkv} d{dqk}/{dv}", "B": b, "S": s, "Hq": hq, "Hkv": hkv,
                  "Dqk": dqk, "Dv": dv, "causal": causal, "dtype": "bf16", "layout": "bshd",
                  "model": case["model"], "also": case["also"]}
    rows: list[Row] = []
    try:
        gen = torch.Generator(device=device).manual_seed(hash((b, s, hq, hkv, dqk, dv)) & 0x7FFFFFFF)
        q = torch.randn(b, s, hq, dqk, device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(b, s, hkv, dqk, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, s, hkv, dv, device=device, dtype=torch.bfloat16, generator=gen)
        dout = torch.randn(b, s, hq, dv, device=device, dtype=torch.bfloat16, generator=gen)
        ref_out, ref_dq, hs = _reference(q, k, v, dout, causal, g, "bwd" in modes)
    except Exception as exc:  # e.g. out of memory
        for mode in modes:
            for impl in impls:
                row = Row(f"attn_{mode}", case["case"], impl.name, PEER, error=_error_text(exc), extra=dict(extra_base))
                rows.append(row)
                log(row)
        _free(device)
        return rows

    for mode in modes:
        op = f"attn_{mode}"
        flops = attn_flops(b, s, s, hq, dqk, dv, causal, mode)
        mode_rows: list[Row] = []
        steps: dict[int, tuple[Callable, Callable]] = {}
        grads: list[torch.Tensor] = []
        keep: list[Any] = []  # graphs the backward steps replay
        # Pass 1: correctness, which also compiles and tunes every implementation.
        for i, impl in enumerate(impls):
            row = Row(op, case["case"], impl.name, PEER, extra=dict(extra_base))
            mode_rows.append(row)
            if impl.note:
                row.extra["sdpa_backend"] = impl.note
            if impl.why_not:
                row.error = impl.why_not
                continue
            fn = impl.fn
            is_peer = impl.name in PEERS
            if gqa:
                row.extra["gqa"] = "enable_gqa" if is_peer else "native"
            kk, vv, use_gqa = k, v, gqa
            try:
                with impl.ctx():
                    try:
                        if mode == "fwd":
                            out = fn(q, kk, vv, causal, use_gqa)
                        else:
                            qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, kk, vv))
                            out = fn(qg, kg, vg, causal, use_gqa)
                    except Exception:
                        if not (is_peer and gqa):
                            raise
                        # enable_gqa refused by this SDPA backend: repeat k/v once, outside timing
                        kk, vv, use_gqa = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2), False
                        row.extra["gqa"] = "repeat_kv"
                        if mode == "fwd":
                            out = fn(q, kk, vv, causal, use_gqa)
                        else:
                            qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, kk, vv))
                            out = fn(qg, kg, vg, causal, use_gqa)
                    row.snr_db = snr_db(ref_out, out.detach()[:1, :, :hs])
                    if mode == "fwd":
                        del out
                        steps[i] = ((lambda fn=fn, q=q, kk=kk, vv=vv, ug=use_gqa: fn(q, kk, vv, causal, ug)), impl.ctx)
                    else:
                        out.backward(dout, retain_graph=True)
                        row.extra["snr_dq_db"] = snr_db(ref_dq, qg.grad[:1, :, :hs])
                        qg.grad = kg.grad = vg.grad = None
                        grads.extend((qg, kg, vg))
                        keep.append(out)
                        steps[i] = ((lambda out=out, dout=dout: out.backward(dout, retain_graph=True)), impl.ctx)
            except Exception as exc:
                row.error = _error_text(exc)
                if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                    traceback.print_exc()
                _free(device)
        # Pass 2: timing, interleaved over rounds so clock and thermal drift hit every
        # implementation alike; each row keeps the median of its per-round medians.
        times, errors = time_interleaved(steps, _rounds, warmup_ms, rep_ms, grads if mode == "bwd" else None)
        for i, row in enumerate(mode_rows):
            if i in errors:
                row.error = errors[i]
            ts = times.get(i)
            if row.error or not ts:
                continue
            row.ms = statistics.median(ts)
            row.extra["round_ms"] = [round(t, 5) for t in ts]
            row.tflops = flops / (row.ms * 1e-3) / 1e12
        _fill_ratios(mode_rows, impls)
        for row in mode_rows:
            rows.append(row)
            log(row)
        del steps, grads, keep
        _free(device)
    del q, k, v, dout, ref_out, ref_dq
    _free(device)
    return rows


# ---- driver ---------------------------------------------------------------------------------
def _print_row(row: Row) -> None:
    shape = row.extra.get("shape", "")
    if row.error:
        print(f"{row.op:8s} {row.case:28s} {shape:26s} {row.impl:14s} ERROR {row.error[:100]}", flush=True)
        return
    sp = f"x{row.speedup:.3f}" if row.speedup else "   -  "
    tf = f"{row.tflops:7.1f} TF" if row.tflops is not None else "      - TF"
    snr = f"{row.snr_db:6.1f} dB" if row.snr_db is not None else "-"
    print(f"{row.op:8s} {row.case:28s} {shape:26s} {row.impl:14s} {row.ms:9.4f} ms {tf} {sp} snr {snr}", flush=True)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    # allow_abbrev=False: an option of another benchmark (bench_gemm's --m) must not match ours by prefix
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--out", default=None, help="result directory (default: benchmarks/results/<gpu-slug>)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_MODELS)} at seq {QUICK_SEQS[0]}")
    p.add_argument("--cpu-smoke", action="store_true",
                   help=f"tiny shapes (seq {SMOKE_SEQ}, 2 query heads, head dims / {SMOKE_DIM_DIV}); runs without a GPU")
    p.add_argument("--seq", type=int, nargs="+", default=None,
                   help=f"sequence lengths (default {' '.join(map(str, DEFAULT_SEQS))}; "
                        f"all: {' '.join(map(str, ALL_SEQS))}); batch = {TOKENS} // seq")
    p.add_argument("--models", nargs="+", default=None, help="models (default: every model in MODELS)")
    # lenient: run_all passes the same options to every benchmark, so values another benchmark
    # knows (but this one does not) are ignored rather than rejected
    p.add_argument("--causal", nargs="+", default=list(CAUSALS), help=f"subset of {', '.join(CAUSALS)}")
    p.add_argument("--impls", nargs="+", default=list(IMPLS),
                   help=f"subset of {', '.join(IMPLS)}, plus the opt-in {', '.join(OPT_IMPLS)}")
    p.add_argument("--modes", nargs="+", default=list(MODES), help=f"subset of {', '.join(MODES)}")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 10; 0 with --cpu-smoke)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition time per round (default 40; 0 with --cpu-smoke)")
    args, _unknown = p.parse_known_args(argv)
    return args


def run(args: argparse.Namespace) -> tuple[Path, list[Row]]:
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_smoke:
        raise SystemExit("bench_attention: no CUDA device; use --cpu-smoke for a functional smoke run")
    if args.cpu_smoke and not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels through the interpreter
    global _rounds
    _rounds = 1 if args.cpu_smoke else ROUNDS
    device = torch.device("cuda" if has_cuda else "cpu")
    models = [x for x in (args.models or (QUICK_MODELS if args.quick else MODELS)) if x in MODELS] or list(MODELS)
    seqs = list(args.seq or (QUICK_SEQS if args.quick else DEFAULT_SEQS))
    causals = [c for c in args.causal if c in CAUSALS] or list(CAUSALS)
    modes = [x for x in args.modes if x in MODES] or list(MODES)
    names = [x for x in IMPLS + OPT_IMPLS if x in args.impls] or list(IMPLS)
    if any(x in OPT_IMPLS for x in names) and FP8_BASE not in names:
        names.insert(0, FP8_BASE)  # turbo-fp8's speedup_vs_turbo_bf16 needs our bf16 kernels' time
    if PEER not in names:
        names.insert(0, PEER)  # the peer is always measured: speedups need it
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.cpu_smoke else 10.0)
    rep_ms = args.rep_ms if args.rep_ms is not None else (0.0 if args.cpu_smoke else 40.0)
    out_dir = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()

    cases = build_cases(models, seqs, smoke=args.cpu_smoke, causals=causals)
    impl_objs = _make_impls(names, has_cuda)
    if args.cpu_smoke and not has_cuda:
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()  # the interpreter's bf16 tl.dot is wrong without it (triton issue #11584)
        print("bench_attention: --cpu-smoke on CPU checks that everything runs; timings mean nothing "
              "(both SDPA peers run the math backend).")
    print(f"bench_attention: {len(cases)} cases x {len(modes)} modes x {len(impl_objs)} impls on {device}", flush=True)
    rows: list[Row] = []
    for case in cases:
        rows.extend(run_case(case, impl_objs, modes, device, warmup_ms, rep_ms, _print_row))
    path = finish_run(rows, out_dir, RESULT_NAME)
    return path, rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
