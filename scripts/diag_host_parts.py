#!/usr/bin/env python3
"""Host time of the pieces of one ``turbo.ops.grouped_gemm`` forward+backward on the Gluon route
(the default for 16-bit operands on sm_90), each timed alone without a profiler (cProfile inflates
Python-heavy paths several-fold): the op's checks and route decision, one output allocation, each
of the three Gluon launches, a bare ``autograd.Function`` round trip, and the whole step next to
``torch._grouped_mm`` under torch's own autograd; the FP8 (BLOCKWISE, ROWWISE) and fused fc1 + SwiGLU
Gluon launches of the same GEMM; the launches and the step also without the prepared launches
(``launch.launch_prepared``: each call builds and expands its descriptors).
Medians over ``--rounds`` interleaved rounds (the host's speed drifts between runs; only
same-round comparisons hold).

    PYTHONPATH=. python scripts/diag_host_parts.py [--shape G ROWS N K] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_host_autograd import balanced_operands, interleaved_host_us  # noqa: E402


class _Canned(torch.autograd.Function):
    """An autograd node over the op's real operands whose backward returns gradients computed
    beforehand: the engine's cost with the real grad accumulation and no GEMM."""

    @staticmethod
    def forward(ctx, x, w, out, ga, gw):
        ctx.g = (ga, gw)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        return ctx.g[0], ctx.g[1], None, None, None


class _Noop(torch.autograd.Function):
    """An autograd node with no work: what a Python Function costs the engine per step."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=[4, 512, 4096, 1536], metavar=("G", "ROWS", "N", "K"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=300)
    args = p.parse_args(argv)
    import primus_turbo.pytorch as turbo
    import importlib

    op = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm")  # the module (the package exports the op)
    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import grouped_gemm_gluon
    from primus_turbo.triton.grouped_gemm.grouped_gemm_variable_k_gluon import grouped_gemm_variable_k_gluon

    G, rows, N, K = args.shape
    dev = torch.device("cuda")
    lens, offs, offs32, a, w, grad = balanced_operands(G, rows, N, K, dev)
    ad, wd = a.detach(), w.detach()
    M = a.size(0)
    xs = torch.randn(8, 8, device=dev, requires_grad=True)
    ws = torch.randn(8, 8, device=dev, requires_grad=True)
    gs = torch.randn(8, 8, device=dev)

    def reset():
        a.grad = w.grad = None

    def noop_step():
        xs.grad = ws.grad = None
        _Noop.apply(xs, ws).backward(gs)

    out0 = torch.empty(M, N, device=dev, dtype=a.dtype)
    ga0, gw0 = torch.empty_like(a), torch.empty_like(w)

    def canned_step():
        reset()
        _Canned.apply(a, w, out0, ga0, gw0).backward(grad)

    gmod = importlib.import_module("primus_turbo.triton.grouped_gemm.grouped_gemm_gluon")
    f8mod = importlib.import_module("primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_gluon")
    glumod = importlib.import_module("primus_turbo.triton.grouped_gemm.grouped_gemm_glu_gluon")
    launch_mod = importlib.import_module("primus_turbo.triton.launch")
    prepared = launch_mod.launch_prepared

    def unprepared(jit_fn, grid, args_fn, kwargs, device, key, ptrs):  # launch_keyed, as before
        launch_mod.launch_keyed(jit_fn, grid, args_fn(), kwargs, device, key)

    def without_prepared(step):
        """``step`` with every launcher's prepared launch replaced by the keyed one (the 16-bit
        launchers before session 35; the FP8 and fused GLU launchers went through the generic
        ``launch`` before session 36, a little slower still)."""
        def run():
            for mod in (gmod, f8mod, glumod):
                mod.launch_prepared = unprepared
            try:
                step()
            finally:
                for mod in (gmod, f8mod, glumod):
                    mod.launch_prepared = prepared
        return run

    # FP8 operands of the same GEMM (values do not matter to the host path): BLOCKWISE 1 x 128 /
    # 128 x 128 scales, and ROWWISE [M] / [G, N] scales on the same kernel
    e4m3 = torch.float8_e4m3fn
    a8 = ad.to(e4m3)
    w8 = wd.to(e4m3)
    sa8 = torch.rand(M, -(-K // 128), device=dev) + 0.5
    sw8 = torch.rand(G, -(-N // 128), -(-K // 128), device=dev) + 0.5
    ra8, rw8 = torch.rand(M, device=dev) + 0.5, torch.rand(G, N, device=dev) + 0.5
    # the fused fc1 + SwiGLU of w [G, N, K] read as gate / linear halves (F = N / 2)
    probs = torch.rand(M, device=dev) + 0.25
    mask = torch.ones(M, dtype=torch.bool, device=dev)

    steps = {
        "torch.empty [M, N]": lambda: torch.empty((M, N), dtype=a.dtype, device=dev),
        "_check_inputs": lambda: op._check_inputs(a, w, lens, offs, True, None, None),
        "_routed": lambda: op._routed(a, w, True, None, offs),
        "gluon forward launch": lambda: grouped_gemm_gluon(ad, wd.transpose(1, 2), offs, checked=True),
        "gluon dgrad launch": lambda: grouped_gemm_gluon(grad, wd, offs, checked=True),
        "gluon wgrad launch": lambda: grouped_gemm_variable_k_gluon(grad, ad, offs),
        "Function round trip (no work)": noop_step,
        "Function round trip (real grads)": canned_step,
        "backward body (no engine)": lambda: op.grouped_gemm_backward(grad, ad, wd, lens, offs, True, None, "gluon",
                                                                      None, False, True, True),
        "op no-grad forward": lambda: turbo.ops.grouped_gemm(ad, wd, lens, offs, trans_b=True),
        "op forward under grad": lambda: turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True),
        "op fwd+bwd": lambda: (reset(), turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True).backward(grad)),
        "torch fwd+bwd": lambda: (reset(), torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32).backward(grad)),
        "torch fwd": lambda: torch._grouped_mm(ad, wd.transpose(-2, -1), offs=offs32),
        "fp8 blockwise gluon launch": lambda: f8mod.grouped_gemm_fp8_blockwise_gluon(a8, sa8, w8, sw8, offs,
                                                                                     checked=True),
        "fp8 rowwise gluon launch": lambda: f8mod.grouped_gemm_fp8_scaled_gluon(a8, ra8, w8, rw8, offs, "ROWWISE",
                                                                                checked=True),
        "fused glu launch": lambda: glumod.grouped_gemm_glu_gluon(ad, wd, offs, probs, mask, checked=True),
    }
    for name in ("gluon forward launch", "op fwd+bwd", "fp8 blockwise gluon launch", "fp8 rowwise gluon launch",
                 "fused glu launch"):
        steps[f"{name} (unprepared)"] = without_prepared(steps[name])
    assert op._routed(a, w, True, None, offs) == "gluon", "these shapes should take the Gluon route"
    times = interleaved_host_us(steps, args.rounds, args.n)
    print(f"host us per call, G{G} x {rows} rows x N{N} x K{K}, median (min) of {args.rounds} rounds")
    for name, ts in times.items():
        print(f"{name:32s} {ts[len(ts) // 2]:8.1f} ({ts[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
