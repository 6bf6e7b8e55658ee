"""The per-step FP8 copies of MoE expert weights on the GPU (H100/H200): BLOCKWISE 128 x 128
forward + grad_input copies from one launch (``PRIMUS_TURBO_FP8_WEIGHT_ONE_READ=1``) against
quantize-then-byte-transpose (``=0``), checked bit for bit against each other and timed
interleaved in one process next to a device copy of the weights.

    PYTHONPATH=. python scripts/diag_weight_copies.py [--models GPT-OSS-20B Mixtral-8x7B] [--rounds 5]

Per model and weight (gate_up ``[E, 2 I, H]``, down ``[E, H, I]``; E the model's experts, at most
32): ms of each form, their ratio, and each form's bytes (read + written: 4 and 5 per weight
element) over the device copy's rate.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

_VAR = "PRIMUS_TURBO_FP8_WEIGHT_ONE_READ"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["GPT-OSS-20B", "Mixtral-8x7B", "DeepSeek-V3"])
    p.add_argument("--experts", type=int, default=None, help="experts per GPU (default: the model's, at most 32)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    import triton

    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
    from primus_turbo.testing.models import get_model

    gf = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")  # the module, not the op
    cfg = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=128)

    def copies(w, one_read: str):
        os.environ[_VAR] = one_read
        return gf.grouped_weight_copies(w, cfg, True)

    print(f"{'model':<14} {'weight':<8} {'shape':<20} {'one-read ms':>11} {'two-pass ms':>11} {'ratio':>6} "
          f"{'1r x copy':>9} {'2p x copy':>9}")
    for name in args.models:
        m = get_model(name)
        e = args.experts or min(m.num_experts, 32)
        for wname, shape in (("gate_up", (e, 2 * m.moe_intermediate, m.hidden)),
                             ("down", (e, m.hidden, m.moe_intermediate))):
            w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            y = torch.empty_like(w)
            new, old = copies(w, "1"), copies(w, "0")
            for a, b in ((new[0][0], old[0][0]), (new[1][0], old[1][0])):
                if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    raise SystemExit(f"{name} {wname}: the one-read copies differ from the two-pass ones")
            if not (torch.equal(new[0][1], old[0][1]) and torch.equal(new[1][1], old[1][1])):
                raise SystemExit(f"{name} {wname}: the scales differ")
            fns = {"one": lambda w=w: copies(w, "1"), "two": lambda w=w: copies(w, "0"),
                   "copy": lambda w=w, y=y: y.copy_(w)}
            t = {k: [] for k in fns}
            for r in range(args.rounds):
                keys = list(fns)[r % 3:] + list(fns)[:r % 3]
                for k in keys:
                    t[k].append(triton.testing.do_bench(fns[k], warmup=10, rep=50))
            ms = {k: statistics.median(v) for k, v in t.items()}
            n = w.numel()
            copy_rate = 4 * n / ms["copy"]
            print(f"{name:<14} {wname:<8} {str(tuple(shape)):<20} {ms['one']:11.4f} {ms['two']:11.4f} "
                  f"{ms['two'] / ms['one']:6.3f} {4 * n / ms['one'] / copy_rate:9.3f} "
                  f"{5 * n / ms['two'] / copy_rate:9.3f}", flush=True)
            new = old = None
            torch.cuda.empty_cache()
    os.environ.pop(_VAR, None)


if __name__ == "__main__":
    main()
