"""Where the time of the two-copy FP8 quantizer goes (H100/H200): the bf16-pair kernel timed with
parts of its output left out (timing only: those outputs stay unwritten), next to a device copy
of the same input in the same run.

    PYTHONPATH=. python scripts/diag_quant_stages.py [--shape 16384x7168] [--mx] [--cfg 128 128 4] [--opts pk]

Rows: full kernel, no scale stores (1), no column-wise copy (2), no row-wise copy (4), and
combinations; each as ms and as the ratio of the *full* kernel's bytes to the device copy's rate,
so a row's gain over the full kernel is what that part costs.
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
    p.add_argument("--shape", default="16384x7168")
    p.add_argument("--mx", action="store_true")
    p.add_argument("--cfg", nargs=3, type=int, default=None, help="TR TC num_warps")
    p.add_argument("--masks", nargs="+", type=int, default=[0, 1, 2, 4, 3, 5, 6, 7])
    p.add_argument("--opts", default="", help="pair-kernel options added to each row, e.g. pk or inreg")
    args = p.parse_args()
    import triton

    from primus_turbo.triton.quantization import quant_fp8_kernel as F8
    from primus_turbo.triton.quantization.quant_fp8_packed import fp8_packed_with_trans_launch

    rows, cols = (int(v) for v in args.shape.split("x"))
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    if args.mx:
        row, col = F8.QuantGrouping(1, 1, 32), F8.QuantGrouping(1, 32, 1)
    else:
        row, col = F8.QuantGrouping(0, 1, 128), F8.QuantGrouping(0, 128, 1)
    base = tuple(args.cfg) if args.cfg else F8.packed_with_trans_config(row)[:3]
    e4 = torch.float8_e4m3fn
    nbytes = x.numel() * 2 + 2 * x.numel() + 2 * (rows * cols // (32 if args.mx else 128)) * (1 if args.mx else 4)
    t_copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=100)
    copy_bw = 4 * x.numel() / t_copy / 1e6
    print(f"{'mode':<26} {'ms':>8} {'x copy (full bytes)':>20}   copy {copy_bw:.0f} GB/s, cfg {base}")
    for m in args.masks:
        cfg = (*base, "packed2", 0, ",".join(o for o in (args.opts, f"diag{m}") if o))
        if m == 0 or args.mx or "inreg" in args.opts or not (m & 1):
            f = (lambda c=cfg: fp8_packed_with_trans_launch(x, e4, row, col, c))
        else:
            continue  # BLOCKWISE scale stores are not switchable (its scratch path)
        t = triton.testing.do_bench(f, warmup=25, rep=100)
        names = [n for b, n in ((1, "no scales"), (2, "no column copy"), (4, "no row copy")) if m & b]
        print(f"{' + '.join(names) or 'full':<26} {t:8.4f} {nbytes / t / 1e6 / copy_bw:20.3f}", flush=True)


if __name__ == "__main__":
    main()
