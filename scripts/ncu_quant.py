"""A short driver for Nsight Compute over the quantizers (H100/H200): each case runs ``--reps``
times after one warm-up call, so ``ncu --launch-skip`` / ``--kernel-name`` can pick one launch.

    ncu --clock-control none --kernel-name regex:quant --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python scripts/ncu_quant.py --cases blockwise_t mx_t copy

Cases: ``copy`` (``y.copy_(x)``, the ceiling), ``blockwise_t`` / ``mx_t`` (``quantize_fp8_with_trans``
BLOCKWISE / MX, E4M3), ``fp4_t`` (``quantize_fp4_with_trans``), ``blockwise`` (1x128 row copy only).
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
    p.add_argument("--cases", nargs="+", default=["copy", "blockwise_t", "mx_t"])
    p.add_argument("--shape", default="16384x7168")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity as SG

    rows, cols = (int(v) for v in args.shape.split("x"))
    x = torch.randn(rows, cols, device=args.device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    e4 = torch.float8_e4m3fn
    runs = {
        "copy": lambda: y.copy_(x),
        "blockwise_t": lambda: turbo.ops.quantize_fp8_with_trans(x, e4, SG.BLOCKWISE, block_size=128),
        "mx_t": lambda: turbo.ops.quantize_fp8_with_trans(x, e4, SG.MX_BLOCKWISE, block_size=32),
        "fp4_t": lambda: turbo.ops.quantize_fp4_with_trans(x),
        "blockwise": lambda: turbo.ops.quantize_fp8(x, e4, SG.BLOCKWISE, block_size=128, axis=-1),
    }
    for name in args.cases:
        for _ in range(1 + args.reps):
            runs[name]()
        if x.is_cuda:
            torch.cuda.synchronize()
        print(f"{name}: done", flush=True)


if __name__ == "__main__":
    main()
