"""Host time of one FP8 linear step (``turbo.ops.gemm_fp8`` forward + backward): the wall time of a
step, with the GPU kept busy or not, and the CPU-side profile (torch.profiler, CPU activity) of the
ops that take it, sorted by self time.

    PYTHONPATH=. python scripts/diag_fp8_linear_host.py [--m 16384 --n 4096 --k 4096 --gran TENSORWISE]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--gran", default="TENSORWISE")
    p.add_argument("--cprofile", action="store_true", help="also a cProfile of 20 steps (Python functions by own time)")
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    dev = torch.device("cuda")
    x = torch.randn(args.m, args.k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(args.n, args.k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.m, args.n, device=dev, dtype=torch.bfloat16)
    cfg = Float8QuantConfig(granularity=args.gran)

    def step():
        y = turbo.ops.gemm_fp8(x, w, trans_b=True, config=cfg)
        y.backward(dy)
        x.grad = None
        w.grad = None

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    # host time of a step: the CPU returns from the launches long before the GPU finishes only if
    # the GPU is the bottleneck; time 20 steps enqueued back to back, and the host alone
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    host = (time.perf_counter() - t0) / 20 * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 20 * 1e3
    print(f"{args.gran} M={args.m} N={args.n} K={args.k}: host {host:.3f} ms / step enqueued, wall {wall:.3f} ms / step")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    if args.cprofile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            step()
        pr.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(45)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
