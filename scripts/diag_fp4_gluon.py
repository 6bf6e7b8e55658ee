"""Where the Gluon two-copy MXFP4 kernel's time goes (H200, device time, x the device copy measured
in the same trial): configurations (register cap, tile-row band, persistent programs per SM) and
DIAG variants that leave the transposed words, the row words, the scales or the codes out (timing
only); each full variant is checked bit for bit against the tl pair kernel once.

    PYTHONPATH=. python scripts/diag_fp4_gluon.py [--shapes 16384x7168] [--trials 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402


def main(argv=None) -> int:
    from benchmarks.common import graph_ms
    from primus_turbo.triton.quantization import quant_fp4_gluon as G
    from primus_turbo.triton.quantization import quant_fp4_kernel as F4

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["16384x7168"])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=None,
                   help="cfg:maxnreg:diag[:band[:persist]], e.g. 4,1,4:128:0:4:4")
    args = p.parse_args(argv)
    variants = args.variants or ["4,1,4:128:0:4:4", "4,1,4:128:8:4:4", "4,1,4:128:12:4:4", "4,1,4:0:0", "4,1,4:0:12:4",
                                 "4,1,4:0:4:4", "4,1,8:128:0:4:2"]
    for shape in args.shapes:
        rows, cols = (int(v) for v in shape.split("x"))
        res: dict = {}
        checked: dict = {}
        for _ in range(args.trials):
            x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
            y = torch.empty_like(x)
            copy_bw = 4 * x.numel() / graph_ms(lambda: y.copy_(x))
            nbytes = 3 * x.numel() + 2 * (x.numel() // 32)
            res.setdefault("pair kernel (default before)", []).append(
                nbytes / graph_ms(lambda: F4.fp4_quant_launch(x, True, with_trans=True,
                                                              tile=(128, 64, 4, "packed", 0, "tscale"))) / copy_bw)
            for v in variants:
                c, mr, dg, *ws = v.split(":")
                cfg = tuple(int(t) for t in c.split(","))
                if G.fp4_gluon_reason(x, cfg) is not None:
                    continue
                ex = [int(t) for t in ws]  # band, persist
                if int(dg) == 0 and v not in checked:  # the same bytes as the tl pair kernel
                    want = F4.fp4_quant_launch(x, True, with_trans=True, tile=(128, 64, 4, "packed", 0, "tscale"))
                    got = G._launch(x, cfg, int(mr), int(dg), *ex)
                    checked[v] = all(torch.equal(a, b) for a, b in zip(got, want))
                ms = graph_ms(lambda: G._launch(x, cfg, int(mr), int(dg), *ex))
                res.setdefault(v, []).append(nbytes / ms / copy_bw)
            del x, y
            torch.cuda.empty_cache()
        print(f"\n{shape}: ratio to the copy (bytes of the full two-copy call over its time); min / median / max")
        for k, vals in res.items():
            ok = {True: "bit-exact", False: "MISMATCH"}.get(checked.get(k), "")
            print(f"{k:32s} {min(vals):.3f} / {statistics.median(vals):.3f} / {max(vals):.3f}  {ok}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
