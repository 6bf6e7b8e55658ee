#!/usr/bin/env python3
"""Host time of ``turbo.ops.grouped_gemm`` (no-grad forward, and forward+backward under autograd), as the grouped GEMM
benchmark runs it (grads reset to None each step), next to ``torch._grouped_mm``: the mean host
time per step with the GPU kept busy (steps interleaved over ``--rounds`` rounds: the host's speed
drifts between runs on a shared machine, so only same-round comparisons hold), the Python function
calls per step, and a full cProfile (sorted by internal and by cumulative time) of the op's step.
``turbo fwd+bwd (Function)`` is the op with its torch-native vendor form turned off.

    PYTHONPATH=. python scripts/diag_host_autograd.py --out DIR [--shape G ROWS N K ...]

Writes ``DIR/diag_host_autograd.txt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_grouped import _cprofile, _host_us  # noqa: E402


def balanced_operands(G: int, rows: int, N: int, K: int, dev: torch.device):
    """(group_lens, group_offs, int32 offsets, a [G*rows, K], w [G, N, K] (both needing grads),
    output gradient [G*rows, N]) for ``G`` experts of ``rows`` rows each, bf16."""
    M = G * rows
    lens = torch.full((G,), rows, dtype=torch.int64, device=dev)
    offs = torch.arange(G + 1, device=dev, dtype=torch.int64) * rows
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) / K**0.5).requires_grad_(True)
    grad = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    return lens, offs, offs[1:].to(torch.int32), a, w, grad


def interleaved_host_us(steps: dict, rounds: int, n: int) -> dict:
    """Each step warmed up, then its host time per call (:func:`_host_us`, ``n`` calls) in every one
    of ``rounds`` rounds over all steps; name -> sorted times."""
    for step in steps.values():
        for _ in range(10):
            step()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_host_us(step, n))
    return {name: sorted(ts) for name, ts in times.items()}


def median_line(label: str, ts: list, unit: str = "step") -> str:
    """``== label: host <median> us per <unit> (median of R rounds; min <min>)``, printed too."""
    line = f"== {label}: host {ts[len(ts) // 2]:.1f} us per {unit} (median of {len(ts)} rounds; min {ts[0]:.1f})"
    print(line, flush=True)
    return line


def profile_lines(label: str, step, top: int, sorts=("tottime", "cumulative")) -> list:
    """A header with the Python-level calls per step and the cProfile of 200 steps."""
    text, calls = _cprofile(step, 200, top, sorts, with_calls=True)
    return [f"\n===== {label}: {calls:.0f} Python-level calls per step", text]


def write_lines(out: str, name: str, lines: list) -> None:
    outd = Path(out)
    outd.mkdir(parents=True, exist_ok=True)
    (outd / name).write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", type=int, nargs=4, action="append", metavar=("G", "ROWS", "N", "K"))
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--top", type=int, default=70)
    p.add_argument("--profile-first-only", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import primus_turbo.pytorch as turbo

    dev = torch.device("cuda")
    lines = []
    for si, (G, rows, N, K) in enumerate(args.shape or [(4, 512, 4096, 1536)]):
        lens, offs, offs32, a, w, grad = balanced_operands(G, rows, N, K, dev)

        def reset():
            a.grad = w.grad = None

        steps = {
            "torch fwd": lambda: torch._grouped_mm(a.detach(), w.detach().transpose(-2, -1), offs=offs32),
            "turbo fwd": lambda: turbo.ops.grouped_gemm(a.detach(), w.detach(), lens, offs, trans_b=True),
            "torch fwd+bwd": lambda: (reset(), torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32).backward(grad)),
            "turbo fwd+bwd": lambda: (reset(), turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True).backward(grad)),
            "turbo fwd+bwd (offs None)": lambda: (reset(), turbo.ops.grouped_gemm(a, w, lens, None, trans_b=True)
                                                  .backward(grad)),
        }
        ops_mod = sys.modules["primus_turbo.pytorch.ops.grouped_gemm"]
        native_ok = getattr(ops_mod, "_native_ok", None)

        def function_form():
            reset()
            if native_ok is not None:
                ops_mod._native_ok = lambda *x: False
            try:
                turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True).backward(grad)
            finally:
                if native_ok is not None:
                    ops_mod._native_ok = native_ok

        steps["turbo fwd+bwd (Function)"] = function_form
        times = interleaved_host_us(steps, args.rounds, args.n)
        from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

        pinned = {"turbo fwd [TORCH pinned]": steps["turbo fwd"], "turbo fwd [TRITON pinned]": steps["turbo fwd"],
                  "turbo fwd+bwd [TORCH pinned]": steps["turbo fwd+bwd"]}
        for name, backend in (("turbo fwd [TORCH pinned]", BackendType.TORCH),
                              ("turbo fwd [TRITON pinned]", BackendType.TRITON),
                              ("turbo fwd+bwd [TORCH pinned]", BackendType.TORCH)):
            GlobalBackendManager.set_grouped_gemm_backend(backend)
            try:
                for _ in range(10):
                    pinned[name]()
                times[name] = sorted(_host_us(pinned[name], args.n) for _ in range(args.rounds))
            finally:
                GlobalBackendManager.set_grouped_gemm_backend(None)
        for name, ts in times.items():
            lines.append(median_line(f"G{G} rows{rows} N{N} K{K} {name}", sorted(ts)))
        if si == 0 or not args.profile_first_only:
            for name in ("torch fwd", "turbo fwd", "torch fwd+bwd", "turbo fwd+bwd"):
                lines += profile_lines(f"G{G} rows{rows} N{N} K{K} {name}", steps[name], args.top)
    write_lines(args.out, "diag_host_autograd.txt", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
