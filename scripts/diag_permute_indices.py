"""Where the time of ``moe_permute`` from top-k indices goes at the benchmark's large case (16384 x 7168,
top-8 of 32): per-kernel GPU time (torch.profiler) of the indices form with the torch row-map builder
and with the fused Triton map kernels (``PRIMUS_TURBO_PERMUTE_FUSED_MAP``), next to the bool-map form,
and the Primus-Turbo form (``num_local_experts``) both ways. Every variant's tokens must equal the first's.

    PYTHONPATH=. python scripts/diag_permute_indices.py [--t 16384 --h 7168 --k 8 --e 32]

Prints each variant's kernels (ms per call, summed over 10 calls / 10) and its do_bench time.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_fp8_linear import _profile  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--t", type=int, default=16384)
    p.add_argument("--h", type=int, default=7168)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--e", type=int, default=32)
    args = p.parse_args(argv)
    import triton

    import primus_turbo.pytorch as turbo

    P = turbo.ops

    t, h, k, e = args.t, args.h, args.k, args.e
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices.to(dev)
    probs = (torch.rand(t, k, generator=g) + 0.05).to(dev)
    rmap = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, idx, True)
    mprobs = torch.zeros(t, e, device=dev).scatter_(1, idx, probs)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    n = t * k
    variants = {
        "indices, torch map builder": ("0", lambda: P.moe_permute(x, idx, probs, num_out_tokens=n, num_experts=e)),
        "indices, fused map kernels": ("1", lambda: P.moe_permute(x, idx, probs, num_out_tokens=n, num_experts=e)),
        "bool map (auto)": (None, lambda: P.moe_permute(x, rmap, mprobs, num_out_tokens=n)),
        # Primus-Turbo's form returns the [T, E + 1 + k] map (written by the assign kernel when fused)
        "Primus form, indices, torch map builder": ("0", lambda: P.moe_permute(
            x, idx, num_local_experts=e, num_topk=k, num_permuted_tokens=n, probs=probs)[:1]),
        "Primus form, indices, fused map kernels": ("1", lambda: P.moe_permute(
            x, idx, num_local_experts=e, num_topk=k, num_permuted_tokens=n, probs=probs)[:1]),
    }
    ref = None
    for name, (flag, fn) in variants.items():
        if flag is None:
            os.environ.pop("PRIMUS_TURBO_PERMUTE_FUSED_MAP", None)
        else:
            os.environ["PRIMUS_TURBO_PERMUTE_FUSED_MAP"] = flag
        out = fn()
        if ref is None:
            ref = out[0]
        ok = torch.equal(out[0], ref)
        ms = triton.testing.do_bench(fn, warmup=25, rep=200)
        print(f"== {name}: do_bench {ms:.4f} ms, tokens equal to the first variant: {ok}")
        print(_profile(fn, n=10, top=16), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
