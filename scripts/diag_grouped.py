#!/usr/bin/env python3
"""Where does a grouped GEMM forward+backward spend its time? For each shape: the wall time
(``do_bench`` median) and per-kernel GPU time (torch.profiler) of ``torch._grouped_mm`` under
autograd and of ``turbo.ops.grouped_gemm`` (default dispatch), plus the host time of one call of
each (a wall time well above the GPU total means the step is host-bound).

    PYTHONPATH=. python scripts/diag_grouped.py --out /tmp/diag [--shape G M N K ...]

Shapes default to the rows where the default dispatch trails the peer. Writes ``diag_grouped.txt``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_fp8_linear import _profile  # noqa: E402

DEFAULT_SHAPES = ((16, 32768, 2048, 768), (16, 32768, 1536, 2048), (8, 4096, 2048, 768))


def _host_us(step, n: int = 50) -> float:
    """Host time of one call: the launches alone, with the GPU kept busy so it never waits on us."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _cprofile(step, n: int = 200, top: int = 25, sorts=("tottime",), with_calls: bool = False):
    """cProfile of ``n`` calls of ``step``: the ``top`` rows under each sort key of ``sorts``
    (with ``with_calls``: and the Python-level calls per step, as a pair)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    for key in sorts:
        stats.sort_stats(key).print_stats(top)
    return (buf.getvalue(), stats.total_calls / n) if with_calls else buf.getvalue()


def _floor_function(tail: bool = False, offs64=None, lens=None, dispatch: bool = False):
    """The least a Python-level grouped GEMM op can cost: an autograd.Function whose forward and
    backward are the three bare ``torch._grouped_mm`` calls (int32 offsets given, no checks, no
    dispatch, no tail rows). ``tail``: plus the tail-row zeroing of the forward output and dgrad;
    ``dispatch``: plus our dispatcher's backend choice for each GEMM (no execution). Together they
    split our op's host time into its parts."""
    from primus_turbo.pytorch.backends.grouped_gemm import (
        grouped_gemm_dispatcher, grouped_gemm_variable_k_dispatcher, zero_tail_rows,
    )
    from primus_turbo.pytorch.core.backend import PrecisionType

    prec = PrecisionType.BF16_FP16_FP32

    class _Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w, offs32):
            ctx.save_for_backward(a, w, offs32)
            if dispatch:
                grouped_gemm_dispatcher.resolve(prec, a=a, b=w.transpose(-2, -1), group_lens=lens,
                                                group_offs=offs64, num_cu=None)
            out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32)
            return zero_tail_rows(out, offs64) if tail else out

        @staticmethod
        def backward(ctx, g):
            a, w, offs32 = ctx.saved_tensors
            if dispatch:
                grouped_gemm_dispatcher.resolve(prec, a=g, b=w, group_lens=lens, group_offs=offs64, num_cu=None)
                grouped_gemm_variable_k_dispatcher.resolve(prec, x=g, y=a, group_lens=lens, group_offs=offs64,
                                                           out=None, accumulate=False, num_cu=None)
            da = torch._grouped_mm(g, w, offs=offs32)
            if tail:
                zero_tail_rows(da, offs64)
            dw = torch._grouped_mm(g.t(), a, offs=offs32)
            return da, dw, None

    return _Bare


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", type=int, nargs=4, action="append", metavar=("G", "M", "N", "K"),
                   help="experts, routed rows, N, K (repeatable)")
    p.add_argument("--host-only", action="store_true",
                   help="only the host time per call, also of a bare Python autograd.Function around "
                        "torch._grouped_mm (the floor of any Python-level op)")
    p.add_argument("--cprofile", action="store_true",
                   help="also a cProfile of 200 host calls of each step (where the host time goes)")
    args = p.parse_args(argv)
    from triton.testing import do_bench

    import primus_turbo.pytorch as turbo

    dev = torch.device("cuda")
    lines = []
    for G, M, N, K in args.shape or DEFAULT_SHAPES:
        lens = torch.full((G,), M // G, dtype=torch.int64, device=dev)
        offs = torch.zeros(G + 1, dtype=torch.int64, device=dev)
        offs[1:] = torch.cumsum(lens, 0)
        offs32 = offs[1:].to(torch.int32)
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) / K**0.5).requires_grad_(True)
        grad = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        if args.host_only:
            floor = _floor_function()
            floor_tail = _floor_function(tail=True, offs64=offs)
            floor_both = _floor_function(tail=True, offs64=offs, lens=lens, dispatch=True)
            for name, step in {
                "bare + tail zeroing fwd+bwd": lambda: floor_tail.apply(a, w, offs32).backward(grad),
                "bare + tail + dispatch fwd+bwd": lambda: floor_both.apply(a, w, offs32).backward(grad),
                "torch fwd": lambda: torch._grouped_mm(a.detach(), w.detach().transpose(-2, -1), offs=offs32),
                "turbo fwd": lambda: turbo.ops.grouped_gemm(a.detach(), w.detach(), lens, offs, trans_b=True),
                "torch fwd+bwd": lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32).backward(grad),
                "bare autograd.Function fwd+bwd": lambda: floor.apply(a, w, offs32).backward(grad),
                "turbo fwd+bwd": lambda: turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True).backward(grad),
            }.items():
                for _ in range(10):
                    step()
                line = f"== G{G} M{M} N{N} K{K} {name}: host {_host_us(step, 200):.1f} us per call"
                print(line, flush=True)
                lines.append(line)
                a.grad = w.grad = None
            continue
        steps = {
            "torch._grouped_mm": lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32).backward(grad),
            "turbo default": lambda: turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True).backward(grad),
            "turbo fwd only": lambda: turbo.ops.grouped_gemm(a.detach(), w.detach(), lens, offs, trans_b=True),
            "torch fwd only": lambda: torch._grouped_mm(a.detach(), w.detach().transpose(-2, -1), offs=offs32),
        }
        for name, step in steps.items():
            for _ in range(3):
                step()
            ms = do_bench(step, warmup=10, rep=50, return_mode="median")
            host = _host_us(step)
            head = f"== G{G} M{M} N{N} K{K} {name}: {ms:.4f} ms wall, host {host:.0f} us per call"
            print(head, flush=True)
            lines += [head, _profile(step), ""]
            if args.cprofile:
                lines += [_cprofile(step), ""]
            a.grad = w.grad = None
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "diag_grouped.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
