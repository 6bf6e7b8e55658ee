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

Varlen suite (``--varlen``: only it, written to ``attention_varlen_bf16``; ``--suite all``: both
suites into ``attention_bf16``): document packing, ``VARLEN_TOKENS`` (16384) tokens per pack in THD
layout (``[total, heads, head_dim]``), ops ``attn_varlen_fwd`` / ``attn_varlen_bwd``. Patterns
(``VARLEN_PATTERNS``, each tiled until the pack is full, the last document cut to fit): uniform 2048,
a seeded long-tailed mix (a few long documents, many short ones), and the issue's 512x4,
128-256-512-1024, 57-311-800-173 and 2048-64-64-64. Head configurations of ``VARLEN_MODELS``
(Llama-3.1-8B 32/8 d128, GPT-OSS-20B 64/8 d64), causal and full. Implementations:

- ``sdpa-nested`` (the peer): SDPA on torch nested jagged tensors
  (``nested_tensor_from_jagged(values, offsets)`` transposed to ``[B, H, j, D]``, built outside the
  timed region) under ``sdpa_kernel([FLASH_ATTENTION])``, or ``[EFFICIENT_ATTENTION]`` when flash
  refuses the case (``extra.sdpa_backend`` says which). The nested path has no GQA, so k/v are
  repeated to ``heads_q`` heads once, outside the timed region (``extra.gqa = "repeat_kv"``; its
  backward then leaves the sum of dk/dv over each head group untimed),
- ``sdpa-cudnn-loop``: a Python loop over the documents of dense SDPA under
  ``sdpa_kernel([CUDNN_ATTENTION])`` (``enable_gqa``, else repeated k/v), outputs concatenated,
- ``turbo-default`` / ``turbo-triton``: ``turbo.ops.flash_attn_varlen_func`` (int32 ``cu_seqlens``,
  ``max_seqlen`` = the longest document), unpinned / pinned to TRITON.

FLOPs count only the attended pairs of each document (the dense formula per document, causal
halved). ``speedup`` is against ``sdpa-nested``; ``extra.speedup_vs_cudnn_loop`` and
``extra.speedup_vs_best_peer`` as for the dense rows. Accuracy: SNR of the output (and dq) against
an fp32 math-SDPA reference computed document by document on the first 2 query heads. With
``--cpu-smoke`` the packs are 256 tokens (document lengths / 16, at least 1) and both peers run
SDPA's math backend; the nested math backend has no causal path, so causal ``sdpa-nested`` rows
record that they need CUDA.

    python benchmarks/bench_attention.py --out benchmarks/results/h200
    python benchmarks/bench_attention.py --out /tmp/v --varlen --warmup-ms 5 --rep-ms 20  # varlen only
    python benchmarks/bench_attention.py --out /tmp/b --suite all                        # both suites
    python benchmarks/bench_attention.py --out /tmp/b --seq 2048 4096 8192 16384
    python benchmarks/bench_attention.py --out /tmp/b --quick             # Llama-3.1-8B + DeepSeek-V3, seq 4096
    python benchmarks/bench_attention.py --out /tmp/b --quick --cpu-smoke # tiny shapes, no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import Row, finish_run, gpu_slug, set_timing, print_compute_row  # noqa: E402
from benchmarks.common import error_text as _error_text  # noqa: E402
from benchmarks.common import free_memory as _free  # noqa: E402
from benchmarks.common import record_times, time_interleaved  # noqa: E402
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

VARLEN_RESULT_NAME = "attention_varlen_bf16"  # the varlen suite run alone
SUITES = ("dense", "varlen")
VARLEN_TOKENS = 16384  # tokens per pack
VARLEN_SMOKE_TOKENS = 256  # --cpu-smoke: packs of 256 tokens, document lengths / VARLEN_SMOKE_DIV (>= 1),
VARLEN_SMOKE_DIV = 16  # so 2 to 13 documents a pack (the Triton interpreter's time grows with their number)
VARLEN_MODELS = ("Llama-3.1-8B", "GPT-OSS-20B")  # 32/8 d128 and 64/8 d64
VARLEN_QUICK_MODELS = ("Llama-3.1-8B",)
VARLEN_PEER = "sdpa-nested"
VARLEN_LOOP = "sdpa-cudnn-loop"
VARLEN_PEERS = (VARLEN_LOOP, VARLEN_PEER)
VARLEN_IMPLS = (VARLEN_LOOP, VARLEN_PEER, "turbo-default", "turbo-triton")


def _longtail_pattern(total: int = VARLEN_TOKENS, seed: int = 0, median: float = 400.0, sigma: float = 1.4,
                      shortest: int = 16) -> tuple[int, ...]:
    """Seeded long-tailed document lengths (lognormal, ``shortest`` .. ``total // 2``) summing to ``total``."""
    rng = random.Random(seed)
    out: list[int] = []
    left = total
    while left > 0:
        n = int(min(max(shortest, rng.lognormvariate(math.log(median), sigma)), total // 2, left))
        out.append(n)
        left -= n
    return tuple(out)


# name -> document lengths, tiled over the pack (see doc_lengths)
VARLEN_PATTERNS: dict[str, tuple[int, ...]] = {
    "uniform2048": (2048,),
    "mixed": _longtail_pattern(),  # 23 documents: 4198, 2893, 1495, ... and 7 shorter than 256
    "512x4": (512, 512, 512, 512),
    "128-256-512-1024": (128, 256, 512, 1024),
    "57-311-800-173": (57, 311, 800, 173),
    "2048-64-64-64": (2048, 64, 64, 64),
}
VARLEN_QUICK_PATTERNS = ("uniform2048", "mixed", "57-311-800-173")

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


def _fill_ratios(mode_rows: Sequence[Row], impls: Sequence[_Impl], peers: Sequence[str] = PEERS,
                 peer: str = PEER, second: str = CUDNN, second_key: str = "cudnn") -> None:
    """``speedup`` against ``peer``; ``extra.<second_key>_ms`` / ``speedup_vs_<second_key>`` against
    ``second``; ``extra.best_peer`` / ``speedup_vs_best_peer`` against the faster of ``peers``."""
    peer_ms = {impls[i].name: r.ms for i, r in enumerate(mode_rows) if impls[i].name in peers and r.ms}
    best = min(peer_ms.values()) if peer_ms else None
    flash_ms = peer_ms.get(peer)
    for i, row in enumerate(mode_rows):
        row.baseline_ms = flash_ms
        row.finalize()
        cudnn_ms = peer_ms.get(second)
        row.extra[f"{second_key}_ms"] = cudnn_ms
        row.extra["best_peer"] = min(peer_ms, key=peer_ms.get) if peer_ms else None
        row.extra[f"speedup_vs_{second_key}"] = cudnn_ms / row.ms if (row.ms and cudnn_ms) else None
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
        record_times(mode_rows, times, errors, flops)
        _fill_ratios(mode_rows, impls)
        for row in mode_rows:
            rows.append(row)
            log(row)
        del steps, grads, keep
        _free(device)
    del q, k, v, dout, ref_out, ref_dq
    _free(device)
    return rows


# ---- varlen (document packing) suite -----------------------------------------------------------
def doc_lengths(pattern: Sequence[int], total: int, div: int = 1) -> list[int]:
    """``pattern`` (each length / ``div``, at least 1) tiled until the lengths sum to ``total``;
    the last document is cut to fit."""
    base = [max(1, round(n / div)) for n in pattern]
    out: list[int] = []
    left = total
    while left > 0:
        for n in base:
            if left <= 0:
                break
            out.append(min(n, left))
            left -= out[-1]
    return out


def build_varlen_cases(
    models: Sequence[str], patterns: Sequence[str], smoke: bool = False, causals: Sequence[str] = CAUSALS
) -> list[dict[str, Any]]:
    """One case per head configuration x pattern x causal; every pack holds ``VARLEN_TOKENS`` tokens
    (``smoke``: ``VARLEN_SMOKE_TOKENS``, lengths / ``VARLEN_SMOKE_DIV``, heads and head dims as in
    :func:`build_cases`)."""
    div = VARLEN_SMOKE_DIV if smoke else 1
    total = VARLEN_SMOKE_TOKENS if smoke else VARLEN_TOKENS
    cases: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for hc in head_configs(models):
        hq, hkv, dqk, dv = hc["Hq"], hc["Hkv"], hc["Dqk"], hc["Dv"]
        if smoke:
            hkv = 1 if hkv < hq else 2
            hq = 2
            dqk, dv = max(16, dqk // SMOKE_DIM_DIV), max(16, dv // SMOKE_DIM_DIV)
        for pat in patterns:
            lens = doc_lengths(VARLEN_PATTERNS[pat], total, div)
            for causal in causals:
                key = (tuple(lens), hq, hkv, dqk, dv, causal)
                if key in seen:
                    continue
                seen.add(key)
                cases.append({
                    "case": f"{hc['model']}:{pat}:{causal}", "model": hc["model"], "pattern": pat, "lens": lens,
                    "Hq": hq, "Hkv": hkv, "Dqk": dqk, "Dv": dv, "causal": causal == "causal",
                    "also": list(hc["also"]),
                })
    return cases


def varlen_flops(lens: Sequence[int], hq: int, dqk: int, dv: int, causal: bool, mode: str = "fwd") -> float:
    """The attended pairs of each document only: the sum of :func:`attn_flops` over the documents."""
    return sum(attn_flops(1, n, n, hq, dqk, dv, causal, mode) for n in lens)


class _Pack:
    """Document boundaries of one pack: int32 ``cu`` (turbo), int64 ``offsets`` (nested tensors)."""

    def __init__(self, lens: Sequence[int], device: torch.device):
        self.lens = list(lens)
        starts = [0]
        for n in self.lens:
            starts.append(starts[-1] + n)
        self.bounds = list(zip(starts[:-1], starts[1:]))
        self.total, self.max_len, self.min_len = starts[-1], max(self.lens), min(self.lens)
        self.cu = torch.tensor(starts, dtype=torch.int32, device=device)
        self.offsets = torch.tensor(starts, dtype=torch.int64, device=device)


class _VImpl:
    """A varlen implementation. ``setup(q, k, v, pack, causal, grad, row)`` does the untimed
    preparation and returns ``(call, leaves, ctx)``: ``call()`` -> out ``[total, Hq, Dv]``, ``leaves``
    the tensors whose ``.grad`` the backward fills (``leaves[0]`` is q), ``ctx`` the context to
    time it in."""

    def __init__(self, name: str, setup: Optional[Callable], why_not: Optional[str] = None,
                 note: Optional[str] = None):
        self.name, self.setup, self.why_not, self.note = name, setup, why_not, note


def _leaves(grad: bool, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) if grad else t for t in ts]


def _make_varlen_impls(names: Sequence[str], on_cuda: bool) -> list[_VImpl]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    impls: list[_VImpl] = []
    cpu_note = "math (cpu-smoke stand-in)"
    for name in names:
        if name == VARLEN_PEER:

            def setup_nested(q, k, v, pack, causal, grad, row, on_cuda=on_cuda):
                g = q.size(1) // k.size(1)
                if g > 1:  # the nested path has no GQA: repeat k/v to heads_q, outside the timed region
                    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
                    row.extra["gqa"] = "repeat_kv"
                ql, kl, vl = _leaves(grad, q, k, v)

                def nj(x):  # [total, H, D] -> nested [B, H, j, D] (a view of x)
                    return torch.nested.nested_tensor_from_jagged(
                        x, pack.offsets, min_seqlen=pack.min_len, max_seqlen=pack.max_len).transpose(1, 2)

                qn, kn, vn = nj(ql), nj(kl), nj(vl)

                def call():
                    out = F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal)
                    return out.transpose(1, 2).values()

                if not on_cuda:
                    if causal:
                        raise RuntimeError("skipped on CPU: SDPA on nested jagged tensors has no causal path "
                                           "without CUDA (flash / efficient kernels)")
                    row.extra["sdpa_backend"] = cpu_note
                    return call, [ql, kl, vl], (lambda: sdpa_kernel([SDPBackend.MATH]))
                try:
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        call()
                    row.extra["sdpa_backend"] = "flash"
                    return call, [ql, kl, vl], (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
                except Exception as exc:  # flash refused the case: the efficient kernel instead
                    row.extra["sdpa_backend"] = f"efficient (flash refused: {_error_text(exc)[:160]})"
                    return call, [ql, kl, vl], (lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))

            impls.append(_VImpl(name, setup_nested, note="nested jagged SDPA; GQA k/v repeated outside timing"))
        elif name == VARLEN_LOOP:
            backend = SDPBackend.CUDNN_ATTENTION if on_cuda else SDPBackend.MATH

            def setup_loop(q, k, v, pack, causal, grad, row, backend=backend):
                ctx = (lambda: sdpa_kernel([backend]))
                if not on_cuda:
                    row.extra["sdpa_backend"] = cpu_note
                gqa = q.size(1) != k.size(1)

                def make(ql, kl, vl, use_gqa):
                    def call():
                        return torch.cat([
                            _sdpa_bshd(ql[a:b][None], kl[a:b][None], vl[a:b][None], causal, use_gqa)[0]
                            for a, b in pack.bounds])
                    return call

                ql, kl, vl = _leaves(grad, q, k, v)
                call = make(ql, kl, vl, gqa)
                if gqa:
                    row.extra["gqa"] = "enable_gqa"
                    try:
                        with ctx():
                            call()
                    except Exception:  # enable_gqa refused: repeat k/v once, outside the timed region
                        g = q.size(1) // k.size(1)
                        ql, kl, vl = _leaves(grad, q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))
                        call = make(ql, kl, vl, False)
                        row.extra["gqa"] = "repeat_kv"
                return call, [ql, kl, vl], ctx

            impls.append(_VImpl(name, setup_loop, note="per-document loop of dense SDPA"))
        elif name in ("turbo-default", "turbo-triton"):
            try:
                import primus_turbo.pytorch as turbo
                __import__("primus_turbo.pytorch.ops")
                from primus_turbo.pytorch.core.backend import BackendType as bt  # noqa: N813
                from primus_turbo.pytorch.core.backend import GlobalBackendManager as gbm

                if not hasattr(turbo.ops, "flash_attn_varlen_func"):
                    raise AttributeError("primus_turbo.pytorch.ops.flash_attn_varlen_func is not available")
            except Exception as exc:
                impls.append(_VImpl(name, None, why_not=f"import primus_turbo.pytorch failed: {exc!r}"))
                continue

            @contextlib.contextmanager
            def pin(backend=None, gbm=gbm) -> Iterator[None]:
                gbm.reset()
                if backend is not None:
                    gbm.set_attn_backend(backend)
                try:
                    yield
                finally:
                    gbm.reset()

            ctx = (lambda: pin()) if name == "turbo-default" else (lambda bt=bt: pin(bt.TRITON))

            def setup_turbo(q, k, v, pack, causal, grad, row, ctx=ctx, turbo=turbo):
                ql, kl, vl = _leaves(grad, q, k, v)
                if q.size(1) != k.size(1):
                    row.extra["gqa"] = "native"

                def call():
                    return turbo.ops.flash_attn_varlen_func(ql, kl, vl, pack.cu, pack.cu, pack.max_len, pack.max_len,
                                                            causal=causal, softmax_scale=None)
                return call, [ql, kl, vl], ctx

            impls.append(_VImpl(name, setup_turbo))
        else:
            raise ValueError(f"unknown varlen impl {name!r}; known: {', '.join(VARLEN_IMPLS)}")
    return impls


def _varlen_reference(q, k, v, dout, pack: _Pack, causal: bool, with_grad: bool):
    """fp32 math-SDPA output (and dq), document by document, for query heads [0, REF_HEADS)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hs = min(REF_HEADS, q.size(1))
    g = q.size(1) // k.size(1)
    kv_idx = torch.tensor([h // g for h in range(hs)], device=q.device)
    qs = q[:, :hs].float().detach().clone().requires_grad_(with_grad)
    ks, vs = k.index_select(1, kv_idx).float(), v.index_select(1, kv_idx).float()
    with sdpa_kernel([SDPBackend.MATH]), torch.enable_grad():
        out = torch.cat([_sdpa_bshd(qs[a:b][None], ks[a:b][None], vs[a:b][None], causal, False)[0]
                         for a, b in pack.bounds])
        dq = torch.autograd.grad(out, qs, dout[:, :hs].float())[0] if with_grad else None
    return out.detach(), (dq.detach() if dq is not None else None), hs


def run_varlen_case(
    case: dict[str, Any],
    impls: Sequence[_VImpl],
    modes: Sequence[str],
    device: torch.device,
    warmup_ms: float,
    rep_ms: float,
    log: Callable[[Row], None],
) -> list[Row]:
    lens, hq, hkv, dqk, dv, causal = (case[x] for x in ("lens", "Hq", "Hkv", "Dqk", "Dv", "causal"))
    total = sum(lens)
    extra_base = {"shape": f"t{total} n{len(lens)} max{max(lens)} h{hq}/{hkv} d{dqk}/{dv}", "T": total,
                  "docs": len(lens), "max_len": max(lens), "min_len": min(lens), "pattern": case["pattern"],
                  "doc_lens": list(lens), "Hq": hq, "Hkv": hkv, "Dqk": dqk, "Dv": dv, "causal": causal,
                  "dtype": "bf16", "layout": "thd", "model": case["model"], "also": case["also"]}
    rows: list[Row] = []
    try:
        pack = _Pack(lens, device)
        gen = torch.Generator(device=device).manual_seed(hash((tuple(lens), hq, hkv, dqk, dv)) & 0x7FFFFFFF)
        q = torch.randn(total, hq, dqk, device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(total, hkv, dqk, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(total, hkv, dv, device=device, dtype=torch.bfloat16, generator=gen)
        dout = torch.randn(total, hq, dv, device=device, dtype=torch.bfloat16, generator=gen)
        ref_out, ref_dq, hs = _varlen_reference(q, k, v, dout, pack, causal, "bwd" in modes)
    except Exception as exc:  # e.g. out of memory
        for mode in modes:
            for impl in impls:
                row = Row(f"attn_varlen_{mode}", case["case"], impl.name, VARLEN_PEER, error=_error_text(exc),
                          extra=dict(extra_base))
                rows.append(row)
                log(row)
        _free(device)
        return rows

    for mode in modes:
        op = f"attn_varlen_{mode}"
        flops = varlen_flops(lens, hq, dqk, dv, causal, mode)
        mode_rows: list[Row] = []
        steps: dict[int, tuple[Callable, Callable]] = {}
        grads: list[torch.Tensor] = []
        keep: list[Any] = []
        # Pass 1: correctness (and compilation / tuning), untimed preparation of every implementation.
        for i, impl in enumerate(impls):
            row = Row(op, case["case"], impl.name, VARLEN_PEER, extra=dict(extra_base))
            mode_rows.append(row)
            if impl.note:
                row.extra["note"] = impl.note
            if impl.why_not:
                row.error = impl.why_not
                continue
            try:
                call, leaves, ctx = impl.setup(q, k, v, pack, causal, mode == "bwd", row)
                with ctx():
                    out = call()
                    row.snr_db = snr_db(ref_out, out.detach()[:, :hs])
                    if mode == "fwd":
                        del out
                        steps[i] = (call, ctx)
                    else:
                        out.backward(dout, retain_graph=True)
                        row.extra["snr_dq_db"] = snr_db(ref_dq, leaves[0].grad[:, :hs])
                        for t in leaves:
                            t.grad = None
                        grads.extend(leaves)
                        keep.append(out)
                        steps[i] = ((lambda out=out, dout=dout: out.backward(dout, retain_graph=True)), ctx)
            except Exception as exc:
                row.error = _error_text(exc)
                if os.environ.get("PRIMUS_TURBO_BENCH_TRACEBACK"):
                    traceback.print_exc()
                _free(device)
        times, errors = time_interleaved(steps, _rounds, warmup_ms, rep_ms, grads if mode == "bwd" else None)
        record_times(mode_rows, times, errors, flops)
        _fill_ratios(mode_rows, impls, VARLEN_PEERS, VARLEN_PEER, VARLEN_LOOP, "cudnn_loop")
        for row in mode_rows:
            rows.append(row)
            log(row)
        del steps, grads, keep
        _free(device)
    del q, k, v, dout, ref_out, ref_dq, pack
    _free(device)
    return rows


# ---- driver ---------------------------------------------------------------------------------
def _print_row(row: Row) -> None:
    print_compute_row(row, row.extra.get("shape", ""), (8, 28, 26, 15))

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
    p.add_argument("--impls", nargs="+", default=None,
                   help=f"dense suite: subset of {', '.join(IMPLS)}, plus the opt-in {', '.join(OPT_IMPLS)}; "
                        f"varlen suite: subset of {', '.join(VARLEN_IMPLS)} (default: all of a suite's)")
    p.add_argument("--suite", default="dense", help="dense (default), varlen or all")
    p.add_argument("--varlen", action="store_true", help="the varlen (document packing) suite only: --suite varlen")
    p.add_argument("--patterns", nargs="+", default=None,
                   help=f"varlen packing patterns, subset of {', '.join(VARLEN_PATTERNS)} (default all; "
                        f"--quick: {' '.join(VARLEN_QUICK_PATTERNS)})")
    p.add_argument("--modes", nargs="+", default=list(MODES), help=f"subset of {', '.join(MODES)}")
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved timing rounds (default {ROUNDS}; 1 with --cpu-smoke)")
    p.add_argument("--timing", choices=("do_bench", "graph"), default="do_bench",
                   help="do_bench (host time included where it shows) or graph (device time alone: CUDA-graph "
                        "replay with the L2 flushed before each call)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 10; 0 with --cpu-smoke)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition time per round (default 40; 0 with --cpu-smoke)")
    args, _unknown = p.parse_known_args(argv)
    if args.varlen:
        args.suite = "varlen"
    return args


def run(args: argparse.Namespace) -> tuple[Path, list[Row]]:
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_smoke:
        raise SystemExit("bench_attention: no CUDA device; use --cpu-smoke for a functional smoke run")
    if args.cpu_smoke and not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels through the interpreter
    global _rounds
    if args.rounds < 1:
        raise SystemExit(f"bench_attention: --rounds must be >= 1, got {args.rounds}")
    _rounds = 1 if args.cpu_smoke else args.rounds
    if args.timing == "graph" and "bwd" in [x for x in args.modes if x in MODES]:
        # the backward step replays a retained autograd graph (out.backward(dout, retain_graph=True)),
        # whose kernels run outside a CUDA-graph capture's stream: the capture fails
        raise SystemExit("bench_attention: --timing graph times the forward only; add --modes fwd (time the "
                         "backward with do_bench)")
    if args.timing == "graph" and has_cuda:
        set_timing("graph")
    device = torch.device("cuda" if has_cuda else "cpu")
    suites = list(SUITES) if args.suite == "all" else [x for x in SUITES if x == args.suite] or ["dense"]
    causals = [c for c in args.causal if c in CAUSALS] or list(CAUSALS)
    modes = [x for x in args.modes if x in MODES] or list(MODES)
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.cpu_smoke else 10.0)
    rep_ms = args.rep_ms if args.rep_ms is not None else (0.0 if args.cpu_smoke else 40.0)
    out_dir = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()
    given = [x for x in (args.models or ()) if x in MODELS]

    cases: list[dict[str, Any]] = []
    impl_objs: list[_Impl] = []
    if "dense" in suites:
        models = given or (list(QUICK_MODELS) if args.quick else list(MODELS))
        seqs = list(args.seq or (QUICK_SEQS if args.quick else DEFAULT_SEQS))
        names = [x for x in IMPLS + OPT_IMPLS if x in (args.impls or IMPLS)] or list(IMPLS)
        if any(x in OPT_IMPLS for x in names) and FP8_BASE not in names:
            names.insert(0, FP8_BASE)  # turbo-fp8's speedup_vs_turbo_bf16 needs our bf16 kernels' time
        if PEER not in names:
            names.insert(0, PEER)  # the peer is always measured: speedups need it
        cases = build_cases(models, seqs, smoke=args.cpu_smoke, causals=causals)
        impl_objs = _make_impls(names, has_cuda)
    vcases: list[dict[str, Any]] = []
    vimpls: list[_VImpl] = []
    if "varlen" in suites:
        vmodels = given or list(VARLEN_QUICK_MODELS if args.quick else VARLEN_MODELS)
        pats = [x for x in (args.patterns or ()) if x in VARLEN_PATTERNS] or list(
            VARLEN_QUICK_PATTERNS if args.quick else VARLEN_PATTERNS)
        vnames = [x for x in VARLEN_IMPLS if x in (args.impls or VARLEN_IMPLS)] or list(VARLEN_IMPLS)
        if VARLEN_PEER not in vnames:
            vnames.insert(0, VARLEN_PEER)  # the peer is always measured: speedups need it
        vcases = build_varlen_cases(vmodels, pats, smoke=args.cpu_smoke, causals=causals)
        vimpls = _make_varlen_impls(vnames, has_cuda)
    if args.cpu_smoke and not has_cuda:
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()  # the interpreter's bf16 tl.dot is wrong without it (triton issue #11584)
        print("bench_attention: --cpu-smoke on CPU checks that everything runs; timings mean nothing "
              "(the SDPA peers run the math backend).")
    if cases:
        print(f"bench_attention: {len(cases)} cases x {len(modes)} modes x {len(impl_objs)} impls on {device}",
              flush=True)
    if vcases:
        print(f"bench_attention: varlen {len(vcases)} cases x {len(modes)} modes x {len(vimpls)} impls on {device}",
              flush=True)
    rows: list[Row] = []
    for case in cases:
        rows.extend(run_case(case, impl_objs, modes, device, warmup_ms, rep_ms, _print_row))
    for case in vcases:
        rows.extend(run_varlen_case(case, vimpls, modes, device, warmup_ms, rep_ms, _print_row))
    # the varlen suite alone gets its own result name, so it does not overwrite a dense run's results
    path = finish_run(rows, out_dir, RESULT_NAME if "dense" in suites else VARLEN_RESULT_NAME)
    return path, rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
