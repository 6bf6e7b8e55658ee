#!/usr/bin/env python3
"""merge_rows on the map-form row map of ``moe_unpermute`` (``[T, E]``, one column per expert, k of
them routed): the runtime-K loop (``K_STATIC = 0``) against the unrolled terms (``K_STATIC = E``),
bit for bit, with the device copy of the same bytes; GPT-OSS-20B's step (T 16384, H 2880, E 32,
top-4).

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
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    t, h, k = 16384, 2880, 4
    rows = []
    for e in args.experts:
        g = torch.Generator(device=dev).manual_seed(e)
        src = torch.randn(t * k, h, device=dev, dtype=torch.bfloat16, generator=g)
        experts = torch.rand(t, e, device=dev, generator=g).topk(k, dim=1).indices
        row_map = torch.full((t, e), -1, device=dev, dtype=torch.int32)
        row_map.scatter_(1, experts, torch.randperm(t * k, device=dev, generator=g).view(t, k).to(torch.int32))
        w = torch.rand(t, e, device=dev, generator=g)
        nbytes = t * k * h * 2 + t * h * 2 + t * e * 8
        copy_src = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)
        copy_dst = torch.empty_like(copy_src)
        copy_ms = float(triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=10, rep=30))
        nw = pk.MERGE_NUM_WARPS
        bc = pk.col_block(h, 2, nw)  # merge_rows_launch's default launch
        outs = {}
        for name, ks in (("runtime loop", 0), ("unrolled", e)):
            out = torch.full((t, h), float("nan"), device=dev, dtype=torch.bfloat16)

            def run(out=out, ks=ks):
                pk._merge_rows_kernel[(t,)](src, out, row_map, w, t, e, h, src.stride(0), out.stride(0), HAS_W=True,
                                            K_STATIC=ks, BLOCK_T=1, BLOCK_C=bc, num_warps=nw)
            run()
            outs[name] = out
            ms = float(triton.testing.do_bench(run, warmup=10, rep=30))
            rows.append({"experts": e, "impl": name, "ms": ms, "vs_copy": copy_ms / ms})
        lib = pk.merge_rows_launch(src, torch.empty(t, h, device=dev, dtype=torch.bfloat16), row_map, w)
        same = torch.equal(outs["runtime loop"], outs["unrolled"]) and torch.equal(lib, outs["runtime loop"])
        for r in rows[-2:]:
            r["bit_identical"] = same
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
