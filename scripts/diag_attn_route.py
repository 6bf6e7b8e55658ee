#!/usr/bin/env python3
"""Time ``turbo.ops.flash_attn_func`` (the op, its default dispatch) under two values of an
environment switch, interleaved in one run: e.g. the TRITON forward's Gluon route
(``PRIMUS_TURBO_ATTN_FWD_GLUON``) auto vs 0 on GPT-OSS-style head dim 64 attention with sinks,
which SDPA cannot run (so the default is our TRITON backend there).

Device time: each measurement replays a CUDA graph of 8 calls (scripts/check_gluon_attn.py's
``_graph_ms``); rounds interleaved with the order rotated. Forward, and forward + backward
(``torch.autograd.grad`` of the output). Outputs of the two settings are compared first (SNR).

    PYTHONPATH=. python scripts/diag_attn_route.py [--env PRIMUS_TURBO_ATTN_FWD_GLUON] [--values auto 0]
        [--heads 64 --heads-kv 8 --head-dim 64 --seq 2048 4096 8192 --tokens 16384] [--sink] [--causal]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="PRIMUS_TURBO_ATTN_FWD_GLUON")
    p.add_argument("--values", nargs="+", default=["auto", "0"])
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--sink", action="store_true")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    import torch

    import primus_turbo.pytorch as turbo
    from primus_turbo.testing import snr_db
    from scripts.check_gluon_attn import _graph_ms, _median_ms
    H, Hk, D = args.heads, args.heads_kv, args.head_dim
    print(f"{'seq':>6} {'B':>3} {'mode':>8} " + " ".join(f"{args.env}={v:>5}" for v in args.values)
          + "   (TFLOP/s; in brackets: time / the first setting's)", flush=True)
    for S in args.seq:
        B = max(1, args.tokens // S)
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for h in (H, Hk, Hk))
        sink = torch.randn(H, device="cuda", generator=g).requires_grad_() if args.sink else None
        dout = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        pairs = S * (S + 1) / 2 if args.causal else S * S
        flops = 4.0 * B * H * pairs * D

        def fwd():
            return turbo.ops.flash_attn_func(q, k, v, causal=args.causal, sink=sink)

        def fwd_bwd():
            o = fwd()
            ins = (q, k, v) + ((sink,) if sink is not None else ())
            return torch.autograd.grad(o, ins, dout)

        outs = {}
        for val in args.values:
            os.environ[args.env] = val
            with torch.no_grad():
                outs[val] = fwd().float()
        ref = outs[args.values[0]]
        snrs = {val: snr_db(ref, o) for val, o in outs.items()}
        for mode, fn, fl in (("fwd", fwd, flops), ("fwd+bwd", fwd_bwd, 3.5 * flops)):
            per = {val: [] for val in args.values}
            for r in range(args.rounds):
                order = args.values[r % len(args.values):] + args.values[:r % len(args.values)]
                for val in order:
                    os.environ[args.env] = val
                    try:
                        per[val].append(_graph_ms(fn))
                        how = "graph"
                    except Exception as exc:  # noqa: BLE001 - a path that cannot be captured
                        torch.cuda.synchronize()
                        per[val].append(_median_ms(fn))
                        how = f"events ({type(exc).__name__})"
            ms = {val: statistics.median(t) for val, t in per.items()}
            first = ms[args.values[0]]
            cells = " ".join(f"{fl / ms[val] / 1e9:8.1f} ({ms[val] / first:.3f})" for val in args.values)
            print(f"{S:>6} {B:>3} {mode:>8} {cells}  [{how}]", flush=True)
        print(f"{'':>6} {'':>3} {'snr dB':>8} " + " ".join(
            f"{snrs[v]:8.1f}" if math.isfinite(snrs[v]) else f"{'same':>8}" for v in args.values), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
