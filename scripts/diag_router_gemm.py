#!/usr/bin/env python3
"""The MoE router GEMM, forward+backward, at the MoE layer benchmark's shapes (16384 tokens): the
plain fp32 path (``F.linear(x.float(), w)``, what the layer ran before and the baseline runs)
against ``turbo.ops.router_logits`` (bf16 operand splits on tensor cores), with the error of each
against an fp64 reference on the first 1024 tokens.

    PYTHONPATH=. python scripts/diag_router_gemm.py [--out DIR]
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
import torch.nn.functional as F  # noqa: E402

SHAPES = [("DeepSeek-V3", 7168, 32), ("Qwen3-30B-A3B", 2048, 32), ("Mixtral-8x7B", 4096, 8), ("GPT-OSS-20B", 2880, 32)]


def main(argv=None) -> int:
    import triton

    from primus_turbo.pytorch.ops import router_logits

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", type=int, default=16384)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for model, h, e in SHAPES:
        g = torch.Generator(device=dev).manual_seed(h + e)
        x = torch.randn(args.tokens, h, device=dev, generator=g).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(e, h, device=dev, generator=g) * h ** -0.5).requires_grad_(True)
        dlog = torch.randn(args.tokens, e, device=dev, generator=g)
        impls = {"fp32 (plain)": lambda: F.linear(x.float(), w), "router_logits": lambda: router_logits(x, w)}
        r = {"model": model, "T": args.tokens, "H": h, "E": e}
        n = 1024
        x64, w64, g64 = x[:n].detach().double(), w.detach().double(), dlog[:n].double()
        ref, ref_dx, ref_dw = x64 @ w64.T, g64 @ w64, g64.T @ x64
        for name, fn in impls.items():
            x.grad = w.grad = None
            out = fn()
            out.backward(dlog)
            # the wgrad reference over the first n tokens only: recompute on the slice
            xs, ws = x[:n].detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
            (F.linear(xs.float(), ws) if name.startswith("fp32") else router_logits(xs, ws)).backward(dlog[:n])

            def rel(a, b):
                return float((a.detach().double() - b).norm() / b.norm())
            r[name] = {"out_rel_err": rel(out[:n], ref), "dx_rel_err": rel(x.grad[:n], ref_dx),
                       "dw_rel_err": rel(ws.grad, ref_dw)}

            def step(fn=fn):
                x.grad = w.grad = None
                fn().backward(dlog)
            r[name]["ms"] = float(triton.testing.do_bench(step, warmup=20, rep=100))
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'model':16s} {'fp32 ms':>8s} {'split ms':>9s} {'speedup':>8s}  rel err out/dx/dw fp32 | split")
    for r in rows:
        a, b = r["fp32 (plain)"], r["router_logits"]
        errs = lambda d: "/".join(f"{d[k]:.1e}" for k in ("out_rel_err", "dx_rel_err", "dw_rel_err"))  # noqa: E731
        print(f"{r['model']:16s} {a['ms']:8.3f} {b['ms']:9.3f} {a['ms'] / b['ms']:8.2f}  {errs(a)} | {errs(b)}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "diag_router_gemm.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
