"""The three GEMMs of an FP8 linear step timed one by one: records the (quantized) operands of the
forward, dgrad and wgrad GEMMs of one ``turbo.ops.gemm_fp8`` forward + backward, then times each
GEMM alone in device time (``benchmarks.common.graph_ms``: CUDA graph, L2 flushed) next to the
BF16 cuBLAS GEMM of the same role. Shows which of the three holds a step back (the BLOCKWISE
wgrad reads per-row scales on both operands, a second promotion multiply per K block).

    PYTHONPATH=. python scripts/diag_fp8_linear_gemms.py [--m 16384] [--nk 6144,4096 4096,4096]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--nk", nargs="+", default=["6144,4096", "4096,4096"])
    p.add_argument("--granularities", nargs="+", default=["BLOCKWISE", "TENSORWISE"])
    args = p.parse_args(argv)
    import primus_turbo.pytorch as turbo
    from benchmarks.common import graph_ms
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    mod = importlib.import_module("primus_turbo.pytorch.ops.gemm_fp8")  # the module, not the op

    dev = torch.device("cuda")
    print(f"FP8 linear GEMMs one by one, M={args.m}, {torch.cuda.get_device_name()}, device time (graph)")
    print(f"{'shape':>22s} {'gran':>10s} {'gemm':>6s} {'ms':>8s} {'TFLOP/s':>8s} {'bf16 ms':>8s} {'x bf16':>7s}")
    for nk in args.nk:
        n, k = (int(v) for v in nk.split(","))
        m = args.m
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        xd, wd = x.detach(), w.detach()
        bf16 = {"fwd": lambda: xd @ wd.t(), "dgrad": lambda: dy @ wd, "wgrad": lambda: dy.t() @ xd}
        bf16_ms = {r: graph_ms(f) for r, f in bf16.items()}
        flops = 2.0 * m * n * k
        for gran in args.granularities:
            calls = []
            orig = mod._mm

            def rec(A, B, g, out_dtype, bs, _orig=orig):
                calls.append((A, B, g, out_dtype, bs))
                return _orig(A, B, g, out_dtype, bs)

            mod._mm = rec
            try:
                y = turbo.ops.gemm_fp8(x, w, trans_b=True, config=Float8QuantConfig(granularity=gran))
                y.backward(dy)
            finally:
                mod._mm = orig
            torch.cuda.synchronize()
            for role, (A, B, g, od, bs) in zip(("fwd", "dgrad", "wgrad"), calls):
                ms = graph_ms(lambda: orig(A, B, g, od, bs))
                print(f"{m}x{n}x{k:>6d} {gran:>10s} {role:>6s} {ms:8.4f} {flops / ms / 1e9:8.1f} "
                      f"{bf16_ms[role]:8.4f} {bf16_ms[role] / ms:7.3f}   A{list(A[0].shape)} B{list(B[0].shape)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
