#!/usr/bin/env python3
"""merge_rows on the map-form row map of ``moe_unpermute`` (``[T, E]``, one column per expert, k of
them routed), GPT-OSS-20B's step by default (T 16384, H 2880, top-4): the runtime-K loop, the
unrolled terms (E <= 16), the packed map merged in chunks of 2 / 4 / 8 terms (packing launch
included), and the top-k form ``[T, k]`` of the same pairs; bit-identity against the first, and the
device copy of the same bytes.

    PYTHONPATH=. python scripts/diag_merge_map.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402


def main(argv=None) -> int:
    import triton

    from primus_turbo.triton.moe import permute_kernel as pk

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--experts", type=int, nargs="+", default=[32, 8, 64])
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--topk", type=int, default=4)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    t, h, k = 16384, args.hidden, args.topk
    rows = []
    for e in args.experts:
        g = torch.Generator(device=dev).manual_seed(e)
        src = torch.randn(t * k, h, device=dev, dtype=torch.bfloat16, generator=g)
        experts = torch.rand(t, e, device=dev, generator=g).topk(k, dim=1).indices
        row_map = torch.full((t, e), -1, device=dev, dtype=torch.int32)
        dest = torch.randperm(t * k, device=dev, generator=g).view(t, k).to(torch.int32)
        row_map.scatter_(1, experts, dest)
        w = torch.rand(t, e, device=dev, generator=g)
        # the top-k form of the same pairs, ascending expert order (the same sum order)
        exp_sorted = experts.sort(dim=1).values
        topk_map = row_map.gather(1, exp_sorted).contiguous()
        topk_w = w.gather(1, exp_sorted).contiguous()
        nbytes = t * k * h * 2 + t * h * 2 + t * e * 8
        copy_src = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)
        copy_dst = torch.empty_like(copy_src)
        copy_ms = float(triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=10, rep=30))
        impls = [("runtime loop", dict(compact=False), row_map, w)]
        impls += [(f"packed c{c}", dict(compact=True, chunk=c), row_map, w) for c in (2, 4, 8)]
        impls += [("top-k form", dict(), topk_map, topk_w)]
        if e <= pk.MERGE_UNROLL_MAX:
            impls.insert(0, ("unrolled", dict(compact=False), row_map, w))
        outs = {}
        for name, kw, m, ww in impls:
            out = torch.full((t, h), float("nan"), device=dev, dtype=torch.bfloat16)

            def run(out=out, kw=kw, m=m, ww=ww):
                pk.merge_rows_launch(src, out, m, ww, **kw)
            run()
            outs[name] = out
            ms = float(triton.testing.do_bench(run, warmup=10, rep=30))
            rows.append({"experts": e, "topk": k, "hidden": h, "impl": name, "ms": ms, "vs_copy": copy_ms / ms})
        ref = outs[impls[0][0]]
        for r in rows[-len(impls):]:
            r["bit_identical"] = torch.equal(outs[r["impl"]], ref)
            print(r, flush=True)
    print(f"\n{'E':>3s} {'impl':14s} {'ms':>8s} {'vs copy':>8s} bit-identical")
    for r in rows:
        print(f"{r['experts']:3d} {r['impl']:14s} {r['ms']:8.4f} {r['vs_copy']:8.2f} {r['bit_identical']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "diag_merge_map.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
