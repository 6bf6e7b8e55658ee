"""Where the time of the two-copy FP8 quantizer goes (H100/H200): the bf16-pair kernel timed with
parts of its output left out (timing only: those outputs stay unwritten), next to a device copy
of the same input in the same run.

    PYTHONPATH=. python scripts/diag_quant_stages.py [--shape 16384x7168] [--mx] [--cfg 128 128 4] [--opts inreg]
    PYTHONPATH=. python scripts/diag_quant_stages.py --fp4 [--cfg 128 64 4]   # quantize_fp4_with_trans

Rows: full kernel, no scale stores (1), no column-wise copy (2), no row-wise copy (4), and
combinations (``--fp4``, the MXFP4 pair kernel: 0, 2 and 4 only); each as ms and as the ratio of the *full* kernel's bytes to the device copy's rate,
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
    p.add_argument("--fp4", action="store_true", help="the MXFP4 two-copy pair kernel instead")
    p.add_argument("--cfg", nargs=3, type=int, default=None,
                   help="TR TC num_warps (default: the default configuration, its options included)")
    p.add_argument("--masks", nargs="+", type=int, default=[0, 1, 2, 4, 3, 5, 6, 7])
    p.add_argument("--opts", default="", help="pair-kernel options added to each row, e.g. inreg")
    args = p.parse_args()
    import triton

    from primus_turbo.triton.quantization import quant_fp8_kernel as F8
    from primus_turbo.triton.quantization.quant_fp8_packed import fp8_packed_with_trans_launch

    rows, cols = (int(v) for v in args.shape.split("x"))
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    if args.fp4:
        _fp4(x, y, args)
        return
    if args.mx:
        row, col = F8.QuantGrouping(1, 1, 32), F8.QuantGrouping(1, 32, 1)
    else:
        row, col = F8.QuantGrouping(0, 1, 128), F8.QuantGrouping(0, 128, 1)
    if args.cfg:  # a tile of the pair kernel without register cap or options
        base, extra_opts = (*args.cfg, "packed2", 0), []
    else:  # the default configuration, options included (BLOCKWISE: "inreg")
        dflt = tuple(F8.packed_with_trans_config(row)) + (0, "")
        base, extra_opts = dflt[:5], [o for o in dflt[5].split(",") if o]
    opts = extra_opts + [o for o in args.opts.split(",") if o and o not in extra_opts]
    e4 = torch.float8_e4m3fn
    nbytes = x.numel() * 2 + 2 * x.numel() + 2 * (rows * cols // (32 if args.mx else 128)) * (1 if args.mx else 4)
    t_copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=100)
    copy_bw = 4 * x.numel() / t_copy / 1e6
    print(f"{'mode':<26} {'ms':>8} {'x copy (full bytes)':>20}   copy {copy_bw:.0f} GB/s, cfg {base}")
    for m in args.masks:
        cfg = (*base, ",".join(opts + [f"diag{m}"]))
        if m == 0 or args.mx or "inreg" in opts or not (m & 1):
            f = (lambda c=cfg: fp8_packed_with_trans_launch(x, e4, row, col, c))
        else:
            continue  # BLOCKWISE scale stores are not switchable (its scratch path)
        t = triton.testing.do_bench(f, warmup=25, rep=100)
        names = [n for b, n in ((1, "no scales"), (2, "no column copy"), (4, "no row copy")) if m & b]
        print(f"{' + '.join(names) or 'full':<26} {t:8.4f} {nbytes / t / 1e6 / copy_bw:20.3f}", flush=True)


def _fp4(x, y, args) -> None:
    import triton

    from primus_turbo.triton.quantization.quant_fp4_kernel import fp4_packed_default
    from primus_turbo.triton.quantization.quant_fp4_packed import fp4_packed_with_trans_launch

    base = tuple(args.cfg) if args.cfg else fp4_packed_default(True)[:3]
    n = x.numel()
    nbytes = 2 * n + n + 2 * (n // 32)  # bf16 in; two packed copies (half a byte each) and E8M0 scales
    t_copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=100)
    copy_bw = 4 * n / t_copy / 1e6
    print(f"{'mode':<26} {'ms':>8} {'x copy (full bytes)':>20}   copy {copy_bw:.0f} GB/s, cfg {base}")
    for m in (mm for mm in args.masks if mm in (0, 2, 4)):
        t = triton.testing.do_bench(lambda c=(*base, 0, f"diag{m}"): fp4_packed_with_trans_launch(x, c),
                                    warmup=25, rep=100)
        name = {0: "full", 2: "no column copy", 4: "no row copy"}[m]
        print(f"{name:<26} {t:8.4f} {nbytes / t / 1e6 / copy_bw:20.3f}", flush=True)


if __name__ == "__main__":
    main()
