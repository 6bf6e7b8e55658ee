"""MoE permute benchmark: achieved memory bandwidth of the token permutation ops against a device copy.

For bf16 tokens ``x [T, H]`` routed top-k over E experts (random distinct experts per token, fp32
probs) the following are timed, for each case (default ``16384x7168 top-8 / 32 experts`` and
``4096x4096 top-2 / 8 experts``):

- ``device-copy``: ``y.copy_(x)`` (the peer; its bytes are ``T`` rows read plus ``T`` rows written,
  ``2 * T * H * 2``: the same read + write count as the ops below),
- ``moe_permute``: ``turbo.ops.moe_permute`` with int64 top-k indices, probs, ``num_out_tokens=T*k``,
- ``moe_permute_map``: the same from the bool ``[T, E]`` routing map (``num_out_tokens`` given: no sync),
- ``moe_permute_pad128``: indices form with ``pad_multiple=128`` and ``num_out_tokens=T*k + 127*E``,
- ``moe_unpermute``: merge back with fp32 probs,
- ``primus_moe_permute`` / ``primus_moe_unpermute``: the same ops in Primus-Turbo's call form (top-k
  indices, ``num_permuted_tokens``; the plain merge plus the probs restored per slot),
- ``token_permute`` / ``token_unpermute``: Megatron's mask-based ops (``fused=True``; unpermute with probs).

Byte model (``extra["bytes"]``; GB/s = bytes / time): the compulsory traffic of the call, every
tensor it takes read once and every tensor it returns written once, at full size (computed from the
actual arguments and outputs). Temporaries are not counted, nor are re-reads: permute reads each
token row once, however many experts it goes to (a kernel can load the row once and store it k
times), so with ``R = 2 * H`` bytes per bf16 row, ``n = T * k`` routed pairs and ``N`` output rows
(``n``, or ``T*k + 127*E`` for pad128):

- ``moe_permute``        ``(T + n) R`` + indices int64 ``8n`` + probs ``4n`` + permuted probs ``4n`` +
  row_id_map int32 ``[T, k]`` ``4n``,
- ``moe_permute_map``    ``(T + n) R`` + bool map ``TE`` + dense probs ``4TE`` + permuted probs ``4n`` +
  row_id_map int32 ``[T, E]`` ``4TE``,
- ``moe_permute_pad128`` ``(T + N) R`` + ``8n + 4n`` (indices, probs) + ``4N`` (permuted probs, zero on
  padding) + ``4n`` (row_id_map): every output row is written, padding rows as zeros,
- ``moe_unpermute``      ``(n + T) R`` + row_id_map ``4n`` + probs ``4n`` (the mirror of permute),
- ``primus_moe_permute`` ``(T + n) R`` + ``8n + 4n`` + row_id_map int32 ``[T, E + 1 + k]`` + permuted probs
  ``4n`` + tokens_per_expert int64 ``[E]`` + two int32 ``[1]`` (overflow flag, dispatched count),
- ``primus_moe_unpermute`` ``(n + T) R`` + row_id_map ``[T, E + 1 + k]`` + the ``[1]`` count + permuted
  probs ``4n`` + restored probs ``[T, k]`` ``4n``,
- ``token_permute``      ``(T + n) R`` + bool map ``TE`` + dense probs ``4TE`` + permuted probs ``4n`` +
  row map int32 ``[T, E]`` ``4TE`` + tokens_per_expert ``8E``,
- ``token_unpermute``    ``(n + T) R`` + row map ``4TE`` + dense probs ``4TE``.

The token rows dominate: the rest is under 1 % of the bytes at the default shapes (dense ``[T, E]``
probs are counted whole though only ``k`` per token are needed: about 0.1 % over the minimum). The
copy moves ``2 T R``: an op at the copy's bandwidth shows ``speedup`` 1.0, so permute's ratio is
an achieved-bandwidth ratio, not inflated by counting the token row ``k`` times (which the script
did before: ``2n`` rows for permute, e.g. 1.55x the copy, above HBM peak). The map/index building
(a few small torch ops) is inside the timed call. ``speedup`` is the ratio of an op's GB/s to the
copy's GB/s. Forward calls only: permute's backward is an unpermute without probs and unpermute's
a permute (plus the probs gradients), which move the same token rows as the calls above.
Correctness: each op on the first 256 tokens is compared with ``primus_turbo.testing.permute_ref``
(``snr_db`` = inf when exact; ``extra["mismatches"]``).

    python benchmarks/bench_moe_permute.py --out benchmarks/results/h200
    python benchmarks/bench_moe_permute.py --out /tmp/b --quick             # 4096x4096 top-2 only
    python benchmarks/bench_moe_permute.py --out /tmp/b --quick --cpu-smoke # tiny shapes, no GPU
"""

from __future__ import annotations

import argparse
import importlib
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

RESULT_NAME = "moe_permute"
CASES = ((16384, 7168, 8, 32), (4096, 4096, 2, 8))  # (tokens, hidden, topk, experts)
QUICK_CASES = ((4096, 4096, 2, 8),)
SMOKE_DIV = 64
CHECK_TOKENS = 256
PAD = 128
PEER = "device-copy"
IMPLS = ("device-copy", "moe_permute", "moe_permute_map", "moe_permute_pad128", "moe_unpermute",
         "primus_moe_permute", "primus_moe_unpermute", "token_permute", "token_unpermute")
ROUNDS = 3


def _routing(t: int, e: int, k: int, device: torch.device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices.to(device)
    probs = (torch.rand(t, k, generator=g) + 0.05).to(device)
    rmap = torch.zeros(t, e, dtype=torch.bool, device=device).scatter_(1, idx, True)
    mprobs = torch.zeros(t, e, device=device).scatter_(1, idx, probs)
    return idx, probs, rmap, mprobs


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (a tensor, or nested tuples / lists; None and ints skipped)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def io_bytes(reads, outputs) -> int:
    """The byte model (module docstring): each distinct input tensor read once, each distinct output
    written once, at full size. An output that is an input handed back (the same memory) moves
    nothing more, so each (address, size) is counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in _tensors(reads) + _tensors(outputs):
        key = (t.data_ptr(), t.numel() * t.element_size())
        if t.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _make(name: str, x, idx, probs, rmap, mprobs, e: int) -> tuple[Callable, Callable, tuple]:
    """(fn() -> outputs, check() -> (mismatches, snr_db), the tensors fn reads) for one op; the bytes
    moved are :func:`io_bytes` of those and fn's outputs."""
    P = importlib.import_module("primus_turbo.pytorch.ops.moe_permute")  # the module: turbo.ops re-exports a function of that name
    from primus_turbo.testing import permute_ref as R
    from primus_turbo.testing.numerics import snr_db

    t = x.shape[0]
    k = idx.shape[1]
    n = t * k
    c = min(CHECK_TOKENS, t)
    xs, ids, ps, rms, mps = x[:c], idx[:c], probs[:c], rmap[:c], mprobs[:c]

    def exact(outs, refs) -> tuple[int, float]:
        bad = 0
        for o, r in zip(outs, refs):
            o, r = o.detach().cpu(), r.detach().cpu()
            if o.shape != r.shape:
                return max(o.numel(), r.numel(), 1), float("-inf")
            bad += int((o.reshape(-1).view(torch.uint8 if o.element_size() == 1 else o.dtype)
                        != r.reshape(-1).view(torch.uint8 if r.element_size() == 1 else r.dtype)).sum())
        return bad, float("inf") if bad == 0 else float("-inf")

    if name == "moe_permute":
        fn = lambda: P.moe_permute(x, idx, probs, num_out_tokens=n, num_experts=e)  # noqa: E731
        chk = lambda: exact(P.moe_permute(xs, ids, ps, num_out_tokens=c * k, num_experts=e),  # noqa: E731
                            R.moe_permute_ref(xs, ids, ps, num_experts=e)[:3])
        return fn, chk, (x, idx, probs)
    if name == "moe_permute_map":
        fn = lambda: P.moe_permute(x, rmap, mprobs, num_out_tokens=n)  # noqa: E731
        chk = lambda: exact(P.moe_permute(xs, rms, mps, num_out_tokens=c * k),  # noqa: E731
                            R.moe_permute_ref(xs, rms, mps)[:3])
        return fn, chk, (x, rmap, mprobs)
    if name == "moe_permute_pad128":
        npad = n + (PAD - 1) * e
        fn = lambda: P.moe_permute(x, idx, probs, num_out_tokens=npad, pad_multiple=PAD, num_experts=e)  # noqa: E731

        def chk():
            ref = R.moe_permute_ref(xs, ids, ps, pad_multiple=PAD, num_experts=e)
            out = P.moe_permute(xs, ids, ps, num_out_tokens=ref[0].shape[0], pad_multiple=PAD, num_experts=e)
            return exact(out[:3], ref[:3])
        return fn, chk, (x, idx, probs)
    if name == "moe_unpermute":
        perm, _, rid = P.moe_permute(x, idx, probs, num_out_tokens=n, num_experts=e)
        fn = lambda: P.moe_unpermute(perm, rid, probs)  # noqa: E731

        def chk():
            pp, _, rr = P.moe_permute(xs, ids, ps, num_out_tokens=c * k, num_experts=e)
            out = P.moe_unpermute(pp, rr, ps)
            ref = R.moe_unpermute_ref(pp, rr, ps)
            bad = int((out.float() != ref.float()).sum())
            return bad, snr_db(ref.float(), out.float())
        return fn, chk, (perm, rid, probs)
    if name == "primus_moe_permute":  # Primus-Turbo's call form: checked against the routing_map form's rows
        kw = dict(num_local_experts=e, num_topk=k, num_permuted_tokens=n)
        fn = lambda: P.moe_permute(x, idx, probs=probs, **kw)  # noqa: E731

        def chk():
            out = P.moe_permute(xs, ids, probs=ps, num_local_experts=e, num_topk=k, num_permuted_tokens=c * k)
            ref = R.moe_permute_ref(xs, ids, ps, num_experts=e)
            return exact([out[0], out[6]], ref[:2])
        return fn, chk, (x, idx, probs)
    if name == "primus_moe_unpermute":  # plain sum plus the probs restored per top-k slot
        perm, rid, _, _, nd, _, pp = P.moe_permute(x, idx, probs=probs, num_local_experts=e, num_topk=k,
                                                   num_permuted_tokens=n)
        fn = lambda: P.moe_unpermute(perm, rid, nd, restore_shape=x.shape, num_local_experts=e,  # noqa: E731
                                     permuted_probs=pp, probs_topk_stride=k)

        def chk():
            pq, rq, _, _, ndq, _, ppq = P.moe_permute(xs, ids, probs=ps, num_local_experts=e, num_topk=k,
                                                      num_permuted_tokens=c * k)
            out, up = P.moe_unpermute(pq, rq, ndq, restore_shape=xs.shape, num_local_experts=e, permuted_probs=ppq,
                                      probs_topk_stride=k)
            ref = R.moe_unpermute_ref(pq, rq[:, :e], None)
            bad = int((out.float() != ref.float()).sum()) + int((up != ps).sum())
            return bad, snr_db(ref.float(), out.float())
        return fn, chk, (perm, rid, nd, pp)
    if name == "token_permute":  # Megatron's mask-based permute, fused=True (the row map, no token ids)
        fn = lambda: P.token_permute(x, n, mprobs, rmap, fused=True)  # noqa: E731
        chk = lambda: exact(P.token_permute(xs, c * k, mps, rms, fused=True)[:2],  # noqa: E731
                            R.token_permute_ref(xs, rms, mps, c * k)[:2])
        return fn, chk, (x, mprobs, rmap)
    if name == "token_unpermute":
        perm, _, rid, _ = P.token_permute(x, n, mprobs, rmap, fused=True)
        fn = lambda: P.token_unpermute(perm, rid, mprobs, x.shape, fused=True)  # noqa: E731

        def chk():
            pp, _, rr, _ = P.token_permute(xs, c * k, mps, rms, fused=True)
            out = P.token_unpermute(pp, rr, mps, xs.shape, fused=True)
            ref = R.token_unpermute_ref(pp, rms, mps, c)
            bad = int((out.float() != ref.float()).sum())
            return bad, snr_db(ref.float(), out.float())
        return fn, chk, (perm, rid, mprobs)
    raise KeyError(name)


def run_case(case_t: tuple[int, int, int, int], impls: Sequence[str], device: torch.device, warmup_ms: float,
             rep_ms: float, log: Callable[[Row], None]) -> list[Row]:
    t, h, k, e = case_t
    gen = torch.Generator(device=device).manual_seed(t * 131 + h)
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16, generator=gen)
    idx, probs, rmap, mprobs = _routing(t, e, k, device, seed=t + h + k + e)
    x_bytes = x.numel() * x.element_size()
    y = torch.empty_like(x)
    case = f"{t}x{h}_top{k}_e{e}"
    extra_base: dict[str, Any] = {"shape": f"{t}x{h}", "topk": k, "experts": e, "dtype": "bf16"}
    steps: dict[str, Callable[[], Any]] = {PEER: lambda: y.copy_(x)}
    moved: dict[str, int] = {PEER: 2 * x_bytes}  # T rows read + T rows written
    out_rows: dict[str, Row] = {PEER: Row("moe_permute", case, PEER, PEER, snr_db=float("inf"), extra=dict(extra_base))}
    for name in impls:
        if name == PEER:
            continue
        row = Row("moe_permute", case, name, PEER, extra=dict(extra_base))
        out_rows[name] = row
        try:
            fn, chk, reads = _make(name, x, idx, probs, rmap, mprobs, e)
            moved[name] = io_bytes(reads, fn())
            bad, snr = chk()
            row.extra["mismatches"] = bad
            row.snr_db = snr
            if bad and name not in ("moe_unpermute", "token_unpermute"):
                row.error = f"{bad} elements differ from permute_ref on the first {CHECK_TOKENS} tokens"
            steps[name] = fn
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
    exact = "exact" if row.snr_db == float("inf") else (row.error or f"snr {row.snr_db}")
    print_bandwidth_row(row, f"{row.case:24s}", 20, exact)

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="result directory (default: benchmarks/results/<gpu-slug>)")
    p.add_argument("--quick", action="store_true", help="only 4096x4096 top-2 over 8 experts")
    p.add_argument("--cpu-smoke", action="store_true", help=f"tiny shapes (dims / {SMOKE_DIV}); runs without a GPU")
    p.add_argument("--permute-ops", nargs="+", default=list(IMPLS), choices=IMPLS, help="which ops to time")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 25; 0 with --cpu-smoke)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench time per round (default 100; 0 with --cpu-smoke)")
    args, _unknown = p.parse_known_args(argv)  # run_all passes other benchmarks' options through
    return args


def run(args: argparse.Namespace) -> tuple[Path, list[Row]]:
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_smoke:
        raise SystemExit("bench_moe_permute: no CUDA device; use --cpu-smoke for a functional smoke run")
    if args.cpu_smoke and not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        print("bench_moe_permute: --cpu-smoke on CPU checks that everything runs; timings mean nothing.")
    device = torch.device("cuda" if has_cuda else "cpu")
    cases = list(QUICK_CASES if args.quick else CASES)
    if args.cpu_smoke:
        cases = [(max(64, t // SMOKE_DIV), max(64, h // SMOKE_DIV), k, e) for t, h, k, e in cases]
    warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.cpu_smoke else 25.0)
    rep_ms = args.rep_ms if args.rep_ms is not None else (0.0 if args.cpu_smoke else 100.0)
    impls = list(args.permute_ops)
    if PEER not in impls:
        impls.insert(0, PEER)
    out_dir = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()
    print(f"bench_moe_permute: {len(cases)} cases x {len(impls)} impls on {device}", flush=True)
    rows: list[Row] = []
    for c in cases:
        rows.extend(run_case(c, impls, device, warmup_ms, rep_ms, _print_row))
    path = finish_run(rows, out_dir, RESULT_NAME)
    return path, rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
