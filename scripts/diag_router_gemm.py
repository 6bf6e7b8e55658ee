"""Accuracy and speed of the router GEMM kernel's variants on the GPU (why the defaults are what
they are): the forward ``logits = x @ W^T`` (bf16 x, fp32 W) with 1, 2 or 3 bf16 pieces of W,
promotion blocks of 16-64 along H, and fp32 FMA on the CUDA cores (``ieee``), against float64,
next to the PyTorch expression ``x.float() @ W^T`` (cuBLAS fp32); then the two backward kernels'
errors (grad_input in bf16 ulps, weight gradient relative) against the PyTorch backward's.

    PYTHONPATH=. python scripts/diag_router_gemm.py [--shapes 16384,2880,32 16384,4096,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.common import bench_ms  # noqa: E402
from primus_turbo.testing import rel_err  # noqa: E402

FWD_VARIANTS = [
    dict(pieces=3, bk=64), dict(pieces=2, bk=64), dict(pieces=1, bk=64), dict(pieces=3, bk=32),
    dict(pieces=3, bk=16), dict(pieces=3, bk=128), dict(ieee=True, bk=32), dict(ieee=True, bk=16),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["16384,2880,32", "16384,4096,8"])
    args = p.parse_args()
    from primus_turbo.triton.moe import router_gemm_kernel as k

    for spec in args.shapes:
        t, h, e = map(int, spec.split(","))
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        w = torch.randn(e, h, device="cuda") * h**-0.5
        g = torch.randn(t, e, device="cuda") * 1e-3
        ry = x.double() @ w.double().t()
        print(f"T={t} H={h} E={e}", flush=True)
        y = x.float() @ w.t()
        ms = bench_ms(lambda: x.float() @ w.t(), 10, 50)
        print(f"  fwd torch x.float() @ W^T          rel {rel_err(ry, y):.2e}  {ms * 1e3:7.1f} us", flush=True)
        for v in FWD_VARIANTS:
            try:
                y = k.router_fwd_launch(x, w, **v)
                ms = bench_ms(lambda: k.router_fwd_launch(x, w, **v), 10, 50)
                print(f"  fwd {str(v):<32} rel {rel_err(ry, y):.2e}  {ms * 1e3:7.1f} us", flush=True)
            except Exception as exc:
                print(f"  fwd {str(v):<32} {type(exc).__name__}: {str(exc)[:100]}", flush=True)
        rdx, rdw = g.double() @ w.double(), g.double().t() @ x.double()
        ulp = torch.ldexp(torch.ones_like(rdx), torch.frexp(rdx.abs().clamp_min(1e-30))[1] - 8)
        for name, dx, dw in (("torch", (g @ w).to(torch.bfloat16), g.t() @ x.float()),
                             ("fused", k.router_dx_launch(g, w), k.router_dw_launch(x, g).sum(0))):
            print(f"  bwd {name}: dx worst {float(((dx.double() - rdx).abs() / ulp).max()):.3f} ulp, "
                  f"dx rel {rel_err(rdx, dx):.2e}, dw rel {rel_err(rdw, dw):.2e}", flush=True)


if __name__ == "__main__":
    main()
