#!/usr/bin/env python3
"""Device time (CUDA-graph replay) of the 16-bit Gluon grouped kernel per config against
``torch._grouped_mm`` on a few small expert GEMMs (balanced groups, weights ``[G, N, K]``).

    PYTHONPATH=. python scripts/diag_grouped16_configs.py [--shape G ROWS N K ...] [--configs n128k64s5 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_grouped_fp8_case import _graph_ms  # noqa: E402

DEFAULT_SHAPES = ((4, 1024, 1536, 2048), (8, 1024, 1536, 2048), (16, 1024, 1536, 2048), (8, 1024, 2048, 768))
DEFAULT_CONFIGS = ("default", "n128k64s5", "n128k64s6", "n128k64s4", "n256k64s3e256", "n256k64s4")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, action="append", metavar=("G", "ROWS", "N", "K"))
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    args = p.parse_args(argv)
    from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg

    dev = torch.device("cuda")
    for G, rows, N, K in args.shape or DEFAULT_SHAPES:
        M = G * rows
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(G, N, K, device=dev) / K**0.5).to(torch.bfloat16)
        offs = torch.arange(G + 1, device=dev, dtype=torch.int64) * rows
        offs32 = offs[1:].to(torch.int32)
        B = w.transpose(1, 2)
        vendor = _graph_ms(lambda: torch._grouped_mm(a, B, offs=offs32))
        line = f"G{G:3d} rows{rows:5d} N{N:5d} K{K:5d} vendor {vendor:.4f} |"
        for name in args.configs:
            cfg = None if name == "default" else gg.GluonGroupedConfig.parse(name)
            try:
                ms = _graph_ms(lambda: gg.grouped_gemm_gluon(a, B, offs, config=cfg))
                line += f" {name} {ms:.4f} ({vendor / ms:.2f}x)"
            except Exception as exc:  # a config that does not fit: say so, go on
                line += f" {name} error {type(exc).__name__}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
