#!/usr/bin/env python3
"""Host time of one 16-bit grouped Gluon launch, layer by layer, and of the autograd round trip
around it: where a small expert GEMM's forward+backward spends the host time that makes eager
steps of tens of microseconds of GPU work host-bound.

Layers of the forward launch, innermost first (each includes the ones before it):
  * the C launcher alone, called with the prepared argument list (``launch._call_entry``);
  * ``launch.launch_prepared`` on a hit (its key tuple, hook check, device and stream queries);
  * ``grouped_gemm_gluon(checked=True)`` (the plan key, plan lookup, output allocation, pointers);
  * the op's no-grad forward, its forward under grad, and forward+backward.
Next to them: torch's own forward (no grad and under grad) and forward+backward of
``torch._grouped_mm``, and the engine's round trip over a Python ``autograd.Function`` against a
native node with no work (CUDA tensors, so the engine's device thread takes the backward).
Medians (minima) over interleaved rounds.

    PYTHONPATH=. python scripts/diag_host_layers.py [--shape G ROWS N K] [--rounds 7]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_host_autograd import balanced_operands, interleaved_host_us  # noqa: E402
from scripts.diag_host_parts import _Noop  # noqa: E402  (a no-work Python Function)


def _trace(op, gmod, turbo, a, w, lens, offs, grad, reset, xs, ws, gs, n: int) -> None:
    """Labelled timestamps across forward+backward steps of the op and of the no-work Function:
    the call, the Function's forward and backward entry and exit (the backward on the engine's
    device thread), and inside each 16-bit Gluon launch its plan lookup, output allocation and
    prepared launch. Prints the median gap before each stamp (us), in step order."""
    import time

    stamps: list = []
    clock = time.perf_counter_ns

    def mark(label):
        stamps.append((label, clock()))

    def wrap_fn(cls):
        fwd, bwd = cls.forward, cls.backward

        def forward(ctx, *xs_):
            mark("fwd entry")
            out = fwd(ctx, *xs_)
            mark("fwd exit")
            return out

        def backward(ctx, *gs_):
            mark("bwd entry")
            out = bwd(ctx, *gs_)
            mark("bwd exit")
            return out

        cls.forward, cls.backward = staticmethod(forward), staticmethod(backward)
        return lambda: (setattr(cls, "forward", fwd), setattr(cls, "backward", bwd))

    planned, prepared = gmod.planned_launch, gmod.launch_prepared

    def planned_launch(kernel, device, out, key, make_plan, new_out, launch_args, *rest):
        mark("launcher entry")

        def new_out2(plan):
            mark("plan found")
            o = new_out(plan)
            mark("allocated")
            return o

        r = planned(kernel, device, out, key, make_plan, new_out2, launch_args, *rest)
        mark("launcher exit")
        return r

    def launch_prepared(*args_):
        mark("prepared entry")
        prepared(*args_)
        mark("prepared exit")

    for label, cls, step, g in (
            # repeats of a seen signature run _GluonStepFunction where it exists (session 43 on)
            ("op", getattr(op, "_GluonStepFunction", op.GroupedGemmFunction),
             lambda: turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True), grad),
            ("no-work Function", _Noop, lambda: _Noop.apply(xs, ws), gs)):
        undo = wrap_fn(cls)
        gmod.planned_launch, gmod.launch_prepared = planned_launch, launch_prepared
        seqs = []
        try:
            for i in range(n + 20):
                reset()
                xs.grad = ws.grad = None
                stamps.clear()
                mark("call")
                out = step()
                mark("returned")
                out.backward(g)
                mark("backward() returned")
                if i >= 20:
                    seqs.append(list(stamps))
        finally:
            undo()
            gmod.planned_launch, gmod.launch_prepared = planned, prepared
        torch.cuda.synchronize()
        labels = [lb for lb, _ in seqs[0]]
        same = [sq for sq in seqs if [lb for lb, _ in sq] == labels]
        print(f"trace, {label}: median us before each stamp over {len(same)} of {len(seqs)} steps")
        for j in range(1, len(labels)):
            col = sorted(sq[j][1] - sq[j - 1][1] for sq in same)
            print(f"  {labels[j]:24s} {col[len(col) // 2] / 1e3:8.1f}")
        tot = sorted(sq[-1][1] - sq[0][1] for sq in same)
        print(f"  {'total':24s} {tot[len(tot) // 2] / 1e3:8.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=[4, 512, 4096, 1536], metavar=("G", "ROWS", "N", "K"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--n", type=int, default=300)
    args = p.parse_args(argv)
    import primus_turbo.pytorch as turbo

    op = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm")
    gmod = importlib.import_module("primus_turbo.triton.grouped_gemm.grouped_gemm_gluon")
    lmod = importlib.import_module("primus_turbo.triton.launch")

    G, rows, N, K = args.shape
    dev = torch.device("cuda")
    index = torch.cuda.current_device()
    lens, offs, offs32, a, w, grad = balanced_operands(G, rows, N, K, dev)
    ad, wd = a.detach(), w.detach()
    bk = wd.transpose(1, 2)
    M = a.size(0)
    assert op._routed(a, w, True, None, offs) == "gluon", "these shapes should take the Gluon route"

    # one fixed output, so the prepared record of the forward launch is found again
    out = torch.empty(M, N, device=dev, dtype=a.dtype)
    before = set(lmod._PREPARED)
    gmod.grouped_gemm_gluon(ad, bk, offs, out=out, checked=True)
    gmod.grouped_gemm_gluon(ad, bk, offs, out=out, checked=True)
    new = [k for k in lmod._PREPARED if k not in before]
    assert len(new) == 1, f"expected one new prepared record, got {len(new)}"
    pkey = new[0]
    rec = lmod._PREPARED[pkey]
    plan_key = pkey[2]
    plan = gmod._PLANS[plan_key]
    kernel = gmod._grouped_gemm_gluon_ws_kernel
    ptrs = pkey[3]

    def args_fn():
        raise AssertionError("a hit never builds its arguments")

    xs = torch.randn(8, 8, device=dev, requires_grad=True)
    ws = torch.randn(8, 8, device=dev, requires_grad=True)
    gs = torch.randn(8, 8, device=dev)

    def reset():
        a.grad = w.grad = None

    def noop_step():
        xs.grad = ws.grad = None
        _Noop.apply(xs, ws).backward(gs)

    def native_step():
        xs.grad = ws.grad = None
        (xs * 1).backward(gs)

    steps = {
        "raw_stream": lambda: lmod.raw_stream(index),
        "_cuda_getDevice": torch._C._cuda_getDevice,
        "no_launch_hooks": lmod.no_launch_hooks,
        "plan key (4 tensor_sig + env)": lambda: ("m16", lmod.tensor_sig(ad), lmod.tensor_sig(bk),
                                                  lmod.tensor_sig(offs), lmod.tensor_sig(out), None, None, None,
                                                  True, gmod._env_raw(gmod.PACE_ENV), gmod._env_raw("TRITON_INTERPRET")),
        "torch.empty [M, N]": lambda: torch.empty((M, N), dtype=a.dtype, device=dev),
        "C launcher (prepared list)": lambda: lmod._call_entry(rec[0], plan.grid, index, rec[1], ()),
        "launch_prepared hit": lambda: lmod.launch_prepared(kernel, plan.grid, args_fn, plan.kwargs, dev, plan_key,
                                                            ptrs),
        "grouped_gemm_gluon (out given)": lambda: gmod.grouped_gemm_gluon(ad, bk, offs, out=out, checked=True),
        "grouped_gemm_gluon (allocates)": lambda: gmod.grouped_gemm_gluon(ad, bk, offs, checked=True),
        "op no-grad forward": lambda: turbo.ops.grouped_gemm(ad, wd, lens, offs, trans_b=True),
        "op forward under grad": lambda: turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True),
        "op fwd+bwd": lambda: (reset(), turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True).backward(grad)),
        "backward body (no engine)": lambda: op.grouped_gemm_backward(grad, ad, wd, lens, offs, True, None, "gluon",
                                                                      None, False, True, True),
        "torch no-grad forward": lambda: torch._grouped_mm(ad, wd.transpose(-2, -1), offs=offs32),
        "torch forward under grad": lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32),
        "torch fwd+bwd": lambda: (reset(), torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32).backward(grad)),
        "Python Function round trip": noop_step,
        "native node round trip (mul)": native_step,
    }
    times = interleaved_host_us(steps, args.rounds, args.n)
    _trace(op, gmod, turbo, a, w, lens, offs, grad, reset, xs, ws, gs, args.n)
    print(f"host us per call, G{G} x {rows} rows x N{N} x K{K}, {torch.cuda.get_device_name()}, "
          f"median (min) of {args.rounds} rounds")
    for name, ts in times.items():
        print(f"{name:34s} {ts[len(ts) // 2]:8.1f} ({ts[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
