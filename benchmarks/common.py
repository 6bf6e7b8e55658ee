"""Shared benchmark plumbing: environment info, timing, result rows and result files.

Timing on CUDA is ``triton.testing.do_bench`` with ``return_mode="median"``: it warms up for
``warmup_ms``, flushes L2 before every repetition, times each repetition with CUDA events for
``rep_ms`` and returns the median. That time includes whatever host time the call needs beyond
the flush's head start (~50-80 us on the H200 machines), so calls with a short device time and a
long Python path measure their host. :func:`set_timing` ("graph") switches to device time alone:
the calls, each after its own L2 flush, captured in a CUDA graph and replayed (:func:`graph_ms`).
Off CUDA (smoke runs only) a ``time.perf_counter`` loop with the same interface is used; its
numbers mean nothing for performance.
"""

from __future__ import annotations

import contextlib
import gc

import datetime as _dt
import json
import math
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

__all__ = [
    "Row",
    "bench_ms",
    "graph_ms",
    "set_timing",
    "geomean",
    "gpu_info",
    "gpu_slug",
    "format_table",
    "geomean_table",
    "write_results",
]


# ---- environment ----------------------------------------------------------------------------
def _triton_version() -> Optional[str]:
    try:
        import triton

        return triton.__version__
    except Exception:  # triton is optional off the GPU
        return None


def gpu_info() -> dict[str, Any]:
    """GPU name and SM count, library versions and the UTC date of the run."""
    info: dict[str, Any] = {
        "gpu": "cpu",
        "sm_count": 0,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = props.name
        info["sm_count"] = props.multi_processor_count
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["compute_capability"] = f"{props.major}.{props.minor}"
    return info


def gpu_slug(name: Optional[str] = None) -> str:
    """A short directory name for a GPU: ``"NVIDIA H200"`` -> ``"h200"``; ``"cpu"`` off CUDA."""
    if name is None:
        name = gpu_info()["gpu"]
    low = name.lower()
    m = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", low.replace("nvidia", " "))
    if m:
        return m.group(1)
    slug = re.sub(r"[^a-z0-9]+", "-", low).strip("-")
    return slug or "unknown"


# ---- timing ---------------------------------------------------------------------------------
_TIMING = ["do_bench"]


def set_timing(mode: str) -> None:
    """``"do_bench"`` (the default: host time included where it shows) or ``"graph"`` (device time
    alone, :func:`graph_ms`; a backward's ``grad_to_none`` tensors get ``.grad = None`` inside every
    captured call, so the graph times what ``do_bench`` does: no gradient accumulation)."""
    if mode not in ("do_bench", "graph"):
        raise ValueError(f"timing must be 'do_bench' or 'graph', got {mode!r}")
    _TIMING[0] = mode


def graph_ms(fn: Callable[[], Any], reps: Optional[int] = None, replays: int = 7) -> float:
    """Device time of one call of ``fn`` in ms with L2 flushed before every call, host excluded:
    ``reps`` (flush, call) pairs captured in one CUDA graph, minus a graph of ``reps`` flushes
    alone; the median over ``replays`` replays of each (one after the other, so drift hits both).
    ``reps`` when None: about 4 ms of calls, 3 to 20. ``fn`` must be capturable (no host
    synchronisation) and is called first, outside the capture."""
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    fn()
    if reps is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        reps = max(3, min(20, int(4.0 / max(start.elapsed_time(end), 1e-3))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        cache.zero_()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                cache.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    times: list = [[], []]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        for i, g in enumerate(graphs):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    del graphs
    return max(statistics.median(times[0]) - statistics.median(times[1]), 0.0) / reps


def _with_grads_reset(fn: Callable[[], Any], tensors: Sequence[torch.Tensor]) -> Callable[[], Any]:
    """``fn`` preceded by ``t.grad = None`` for each tensor: under graph capture each call's
    backward then hands its fresh gradients to ``.grad`` (allocated in the graph's pool, the
    previous call's freed for reuse) instead of adding into them."""

    def step():
        for t in tensors:
            t.grad = None
        return fn()

    return step


def bench_ms(
    fn: Callable[[], Any],
    warmup_ms: float = 25,
    rep_ms: float = 100,
    grad_to_none: Optional[Sequence[torch.Tensor]] = None,
) -> float:
    """Median time of one call of ``fn`` in milliseconds.

    CUDA: ``triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")``
    (``grad_to_none`` tensors get ``.grad = None`` before each repetition, so backward passes
    do not time gradient accumulation). Otherwise: a ``perf_counter`` loop, at least 1 warm-up
    call and 3 timed calls.
    """
    if torch.cuda.is_available():
        if _TIMING[0] == "graph":
            if grad_to_none:
                return graph_ms(_with_grads_reset(fn, grad_to_none))
            return graph_ms(fn)
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))

    def _clear() -> None:
        for t in grad_to_none or ():
            t.grad = None

    t_end = time.perf_counter() + warmup_ms / 1e3
    while True:
        _clear()
        fn()
        if time.perf_counter() >= t_end:
            break
    times: list[float] = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 10_000):
        _clear()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


# ---- results --------------------------------------------------------------------------------
@dataclass
class Row:
    """One timed (op, case, impl) measurement against a peer (``baseline``) from the same run."""

    op: str
    case: str
    impl: str
    baseline: str
    ms: Optional[float] = None
    baseline_ms: Optional[float] = None
    speedup: Optional[float] = None  # baseline_ms / ms: > 1 means faster than the peer
    tflops: Optional[float] = None
    gbps: Optional[float] = None
    snr_db: Optional[float] = None
    error: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def finalize(self) -> "Row":
        """Fill ``speedup`` from ``ms`` and ``baseline_ms`` when both are known."""
        if self.ms and self.baseline_ms and self.ms > 0:
            self.speedup = self.baseline_ms / self.ms
        return self

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(asdict(self))


def print_compute_row(row: Row, shape: str, widths: Sequence[int], speedup: Optional[str] = None) -> None:
    """One progress line of a compute-bound benchmark: op, case, shape and impl in columns of
    ``widths``, then ms, TFLOP/s, the speedup (``speedup`` replaces the default ``x<ratio>``
    text) and the SNR; or the error."""
    op_w, case_w, shape_w, impl_w = widths
    head = f"{row.op:{op_w}s} {row.case:{case_w}s} {shape:{shape_w}s} {row.impl:{impl_w}s}"
    if row.error:
        print(f"{head} ERROR {row.error[:100]}", flush=True)
        return
    if speedup is None:
        speedup = f"x{row.speedup:.3f}" if row.speedup else "   -  "
    tf = f"{row.tflops:7.1f} TF" if row.tflops is not None else "      - TF"
    snr = f"{row.snr_db:6.1f} dB" if row.snr_db is not None else "-"
    print(f"{head} {row.ms:9.4f} ms {tf} {speedup} snr {snr}", flush=True)


def print_bandwidth_row(row: Row, label: str, impl_w: int, last: str) -> None:
    """One progress line of a memory-bound benchmark: ``label`` (its own width), impl, ms, GB/s,
    the speedup and ``last`` (exactness or SNR); a row with an error and no time prints the error."""
    head = f"{label} {row.impl:{impl_w}s}"
    if row.error and row.ms is None:
        print(f"{head} ERROR {row.error[:100]}", flush=True)
        return
    sp = f"x{row.speedup:.3f}" if row.speedup else "  -   "
    bw = f"{row.gbps:8.1f} GB/s" if row.gbps else "       - GB/s"
    ms = f"{row.ms:9.4f} ms" if row.ms is not None else "        - ms"
    print(f"{head} {ms} {bw} {sp} {last}", flush=True)


def _json_safe(v: Any) -> Any:
    """JSON has no inf/nan: write them as the strings "inf", "-inf", "nan" (e.g. SNR of an
    exact result is +inf)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of the positive finite values (NaN when there are none)."""
    vals = [v for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    if not vals:
        return float("nan")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return format(v, spec)


def _shape_of(row: Row) -> str:
    e = row.extra
    if all(k in e for k in ("M", "N", "K")):
        return f"{e['M']}x{e['N']}x{e['K']}"
    return e.get("shape", "")


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table of the rows."""
    lines = [
        "| op | case | shape (MxNxK) | impl | ms | baseline | baseline ms | speedup | TFLOPS | SNR dB | error |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        err = (r.error or "").replace("|", "\\|").replace("\n", " ")
        if len(err) > 120:
            err = err[:117] + "..."
        lines.append(
            f"| {r.op} | {r.case} | {_shape_of(r)} | {r.impl} | {_fmt(r.ms, '.4f')} | {r.baseline} | "
            f"{_fmt(r.baseline_ms, '.4f')} | {_fmt(r.speedup, '.3f')} | {_fmt(r.tflops, '.1f')} | "
            f"{_fmt(r.snr_db, '.1f')} | {err} |"
        )
    return "\n".join(lines)


def geomean_table(rows: Sequence[Row]) -> str:
    """Markdown table of the geomean speedup per (op, impl), peers themselves left out."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r.impl == r.baseline:
            continue
        groups.setdefault((r.op, r.impl), []).append(r)
    lines = [
        "| op | impl | vs | geomean speedup | min | max | cases ok | errors |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for (op, impl), rs in groups.items():
        sp = [r.speedup for r in rs if r.speedup]
        errors = sum(1 for r in rs if r.error)
        baseline = rs[0].baseline
        lines.append(
            f"| {op} | {impl} | {baseline} | {_fmt(geomean(sp), '.3f') if sp else '-'} | "
            f"{_fmt(min(sp), '.3f') if sp else '-'} | {_fmt(max(sp), '.3f') if sp else '-'} | "
            f"{len(sp)} | {errors} |"
        )
    return "\n".join(lines)


def write_results(rows: Sequence[Row], out_dir: "str | os.PathLike[str]", name: str) -> Path:
    """Write ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.md``; return the JSON path.

    JSON: the :func:`gpu_info` keys (``gpu``, ``sm_count``, ``torch``, ``triton``, ``cuda``,
    ``date``, ...) at top level, then ``rows``, a list of :meth:`Row.to_dict` dicts.
    Markdown: the environment, the full table, then the geomean speedup per (op, impl).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = gpu_info()
    doc = dict(info)
    doc["benchmark"] = name
    doc["rows"] = [r.to_dict() for r in rows]
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    env = ", ".join(f"{k} {info[k]}" for k in ("gpu", "sm_count", "torch", "triton", "cuda", "date"))
    md = [
        f"# {name}",
        "",
        env,
        "",
        format_table(rows),
        "",
        f"## Geomean speedup ({name})",
        "",
        geomean_table(rows),
        "",
    ]
    (out / f"{name}.md").write_text("\n".join(md))
    return json_path


def finish_run(rows: Sequence[Row], out_dir: "str | os.PathLike[str]", name: str) -> Path:
    """End of every benchmark run: write ``name``.json/.md, print the full table and the geomean
    table, and say where the results are. Returns the .json path."""
    path = write_results(rows, out_dir, name)
    print()
    print(format_table(rows))
    print()
    print(f"## Geomean speedup ({name})")
    print(geomean_table(rows))
    print(f"\nresults: {path} and {path.with_suffix('.md')}", flush=True)
    return path


def record_times(rows, times: dict, errors: dict, flops: float) -> None:
    """Write :func:`time_interleaved`'s result into the rows it timed (``rows[key]``, a list or a
    dict): the error of a step that raised; else the median of its per-round times, the rounds
    and TFLOP/s. A row that already carries an error (from its correctness pass) stays untimed."""
    for k, err in errors.items():
        rows[k].error = err
    for k, ts in times.items():
        row = rows[k]
        if row.error or not ts:
            continue
        row.ms = statistics.median(ts)
        row.extra["round_ms"] = [round(t, 5) for t in ts]
        row.tflops = flops / (row.ms * 1e-3) / 1e12


def error_text(exc: BaseException) -> str:
    """One line for a result row's ``error`` field (at most 500 characters)."""
    msg = f"{type(exc).__name__}: {exc}".strip()
    return msg if len(msg) <= 500 else msg[:497] + "..."


def free_memory(device: torch.device) -> None:
    """Drop what the last case allocated before the next one (large shapes follow each other)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_interleaved(
    steps: dict,
    rounds: int,
    warmup_ms: float,
    rep_ms: float,
    grads: Optional[Sequence[torch.Tensor]] = None,
) -> tuple[dict, dict]:
    """Time several implementations of one case fairly.

    ``steps`` maps a key to ``(fn, ctx)``, ``ctx()`` giving the context manager to time ``fn`` in
    (a backend pin, say). Each round times every step once with :func:`bench_ms`; the order
    rotates every round so clock and thermal drift hit every implementation alike. Returns
    ``({key: [ms per round]}, {key: error text})``; a step that raises is dropped from then on.
    """
    times: dict = {k: [] for k in steps}
    errors: dict = {}
    keys = list(steps)
    for rnd in range(rounds):
        shift = rnd % len(keys) if keys else 0
        for k in keys[shift:] + keys[:shift]:
            if k in errors:
                continue
            fn, ctx = steps[k]
            try:
                with ctx():
                    times[k].append(bench_ms(fn, warmup_ms, rep_ms, grad_to_none=grads))
            except Exception as exc:
                errors[k] = error_text(exc)
    return {k: ts for k, ts in times.items() if ts and k not in errors}, errors


def bandwidth_rows(
    steps: dict,
    rows: dict,
    moved: dict,
    peer: str,
    rounds: int,
    warmup_ms: float,
    rep_ms: float,
    log: Callable[["Row"], None],
) -> list:
    """Time memory-bound ops against a device copy and fill their rows.

    ``steps``: name -> fn (the peer included); ``rows``: name -> Row, in output order;
    ``moved``: name -> bytes read plus written. Each row gets the median of its per-round times,
    GB/s, and ``speedup`` = its GB/s over the copy's GB/s (a bandwidth ratio, not a time ratio).
    """
    times, errors = time_interleaved(
        {k: (fn, contextlib.nullcontext) for k, fn in steps.items()}, rounds, warmup_ms, rep_ms
    )
    for k, err in errors.items():
        rows[k].error = err
    copy_ms = statistics.median(times[peer]) if times.get(peer) else None
    copy_gbps = moved[peer] / (copy_ms * 1e-3) / 1e9 if copy_ms else None
    result = []
    for k, row in rows.items():
        ts = times.get(k)
        if ts:
            row.ms = statistics.median(ts)
            row.gbps = moved[k] / (row.ms * 1e-3) / 1e9
            row.extra["bytes"] = moved[k]
            row.extra["round_ms"] = [round(t, 5) for t in ts]
        row.baseline_ms = copy_ms
        if row.gbps and copy_gbps:
            row.speedup = row.gbps / copy_gbps
        result.append(row)
        log(row)
    return result
