"""A short driver for Nsight Compute over one 16-bit grouped GEMM (H100/H200): the Gluon kernel or
``torch._grouped_mm`` on the MoE benchmark's DeepSeek-V3 gate_up forward (32 experts x 4096 rows, N
4096, K 7168, ``w [G, N, K]``), with balanced or unbalanced group sizes (scripts/diag_grouped_small.py's
``group_lens``). Each case runs once to warm up, then ``--reps`` times, so ``ncu --launch-skip 1
--launch-count 1`` picks a warm launch:

    ncu --clock-control none --kernel-name regex:gluon_ws --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python scripts/ncu_grouped.py --impl gluon --lens unbalanced128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("gluon", "torch"), default="gluon")
    p.add_argument("--lens", choices=("balanced", "unbalanced", "unbalanced128"), default="balanced")
    p.add_argument("--shape", default="32x4096x4096x7168", help="G x rows per group x N x K")
    p.add_argument("--config", default=None, help="Gluon config (GluonGroupedConfig.parse); default: the kernel's")
    p.add_argument("--reps", type=int, default=1)
    args = p.parse_args()
    from scripts.diag_grouped_small import group_lens

    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import GluonGroupedConfig, grouped_gemm_gluon

    G, m, N, K = (int(v) for v in args.shape.split("x"))
    lens = torch.tensor(group_lens(G, m, args.lens), device="cuda", dtype=torch.int64)
    offs = torch.zeros(G + 1, device="cuda", dtype=torch.int64)
    offs[1:] = torch.cumsum(lens, 0)
    a = torch.randn(G * m, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    cfg = GluonGroupedConfig.parse(args.config) if args.config else None
    offs32 = offs[1:].to(torch.int32)
    if args.impl == "gluon":
        run = lambda: grouped_gemm_gluon(a, w.transpose(1, 2), offs, config=cfg)  # noqa: E731
    else:
        run = lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs32)  # noqa: E731
    for _ in range(1 + args.reps):
        run()
    torch.cuda.synchronize()
    print(f"{args.impl} {args.lens} {args.shape}: done", flush=True)


if __name__ == "__main__":
    main()
