#!/usr/bin/env python3
"""Host time per call of the FP8 grouped op's M-grouped GEMM (``grouped_gemm_fp8``'s ``_mm``: the
dispatcher's resolution, the backend and the Gluon launcher) on a problem whose GPU work is a few
microseconds, so that calls enqueued back to back measure the host path (``interleaved_host_us``:
the enqueue time of N calls divided by N, rounds interleaved; medians and minima), next to ``torch._scaled_grouped_mm`` on the same FP8
operands (TENSORWISE / ROWWISE). Run it with ``PYTHONPATH`` on the tree to measure.

    PYTHONPATH=. python scripts/diag_fp8_mm_host.py [--n 2000] [--rounds 5]
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

from scripts.diag_host_autograd import balanced_operands, interleaved_host_us  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shape", type=int, nargs=4, default=[4, 128, 256, 512], metavar=("G", "ROWS", "N", "K"))
    args = p.parse_args()
    import primus_turbo.pytorch  # noqa: F401

    mod = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")
    G, rows, N, K = args.shape
    dev = torch.device("cuda")
    lens, offs, offs32, a, w, _grad = balanced_operands(G, rows, N, K, dev)
    a, w = a.detach(), w.detach()
    fp8 = torch.float8_e4m3fn
    steps = {}
    for gran in ("TENSORWISE", "ROWWISE", "BLOCKWISE"):
        A = mod._quant_rows(a, fp8, gran, 128)
        B, _ = mod._weight_copies(w, True, fp8, gran, 128, True, False)
        steps[f"ours {gran}"] = (lambda A=A, B=B, gran=gran:
                                 mod._mm(A, B, gran, lens, offs, torch.bfloat16, 128, None))
        if gran != "BLOCKWISE" and hasattr(torch, "_scaled_grouped_mm"):
            sa = A[1].float().reshape(-1).expand(a.shape[0]).contiguous() if A[1].numel() == 1 else \
                A[1].float().reshape(-1).contiguous()
            sb = B[1].float().reshape(G, 1).expand(G, N).contiguous() if B[1].numel() == G else \
                B[1].float().reshape(G, N).contiguous()
            steps[f"torch {gran}"] = (lambda A=A, B=B, sa=sa, sb=sb:
                                      torch._scaled_grouped_mm(A[0], B[0].transpose(-2, -1), sa, sb, offs=offs32,
                                                               out_dtype=torch.bfloat16))
    times = interleaved_host_us(steps, args.rounds, args.n)  # sorted per step
    print(f"shape G{G} rows{rows} N{N} K{K}, {args.n} calls back to back, {args.rounds} rounds (us per call)")
    for k, ts in times.items():
        print(f"{k:22s} median {ts[len(ts) // 2]:7.2f}  min {ts[0]:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
