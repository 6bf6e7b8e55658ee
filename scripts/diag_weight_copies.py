"""The per-step FP8 copies of MoE expert weights on the GPU (H100/H200): BLOCKWISE 128 x 128
forward + grad_input copies from one launch (``PRIMUS_TURBO_FP8_WEIGHT_ONE_READ=1``; the Gluon
kernel, ``PRIMUS_TURBO_FP8_WEIGHT_GLUON=1``, and the tl kernel, ``=0``) against
quantize-then-byte-transpose (``ONE_READ=0``), checked bit for bit against each other and timed
interleaved in one process next to a device copy of the weights.

    PYTHONPATH=. python scripts/diag_weight_copies.py [--models GPT-OSS-20B Mixtral-8x7B] [--rounds 5]
        [--gluon-configs 4,8,4,0 2,8,8,1 ...]

``--gluon-configs spw,vec,warps``: also each Gluon launch config, bit-checked and timed (its own
columns). ``--forms`` first prints, per config, where the Gluon copies differ from the two-pass
ones on small shapes (how the wrong forms of session 16 were located).

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
_GVAR = "PRIMUS_TURBO_FP8_WEIGHT_GLUON"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["GPT-OSS-20B", "Mixtral-8x7B", "DeepSeek-V3"])
    p.add_argument("--experts", type=int, default=None, help="experts per GPU (default: the model's, at most 32)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gluon-configs", nargs="*", default=[])
    p.add_argument("--forms", action="store_true")
    args = p.parse_args()
    from primus_turbo.triton.quantization.gather_quant_gluon import GluonGatherQuantConfig
    from primus_turbo.triton.quantization.quant_fp8_gluon import weight_copies_gluon

    gcfgs = [tuple(map(int, c.split(","))) for c in args.gluon_configs]
    import triton

    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
    from primus_turbo.testing.models import get_model

    gf = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")  # the module, not the op
    cfg = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=128)

    def copies(w, one_read: str, gluon: str = "0"):
        os.environ[_VAR] = one_read
        os.environ[_GVAR] = gluon
        return gf.grouped_weight_copies(w, cfg, True)

    if args.forms:
        _check_forms(gcfgs or [(4, 8, 4)])
    print(f"{'model':<14} {'weight':<8} {'shape':<20} {'gluon ms':>9} {'one-read ms':>11} {'two-pass ms':>11} "
          f"{'g x copy':>8} {'1r x copy':>9} {'2p x copy':>9}" + "".join(f" {str(c):>18}" for c in gcfgs))
    for name in args.models:
        m = get_model(name)
        e = args.experts or min(m.num_experts, 32)
        for wname, shape in (("gate_up", (e, 2 * m.moe_intermediate, m.hidden)),
                             ("down", (e, m.hidden, m.moe_intermediate))):
            w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            y = torch.empty_like(w)
            new, old, glu = copies(w, "1"), copies(w, "0"), copies(w, "1", "1")
            for tag, form in (("tl one-read", new), ("gluon", glu)):
                for a, b in ((form[0][0], old[0][0]), (form[1][0], old[1][0])):
                    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                        print(f"{name} {wname}: the {tag} copies differ from the two-pass ones", flush=True)
                if not (torch.equal(form[0][1], old[0][1]) and torch.equal(form[1][1], old[1][1])):
                    print(f"{name} {wname}: the {tag} scales differ", flush=True)
            fns = {"gluon": lambda w=w: copies(w, "1", "1"), "one": lambda w=w: copies(w, "1"),
                   "two": lambda w=w: copies(w, "0"), "copy": lambda w=w, y=y: y.copy_(w)}
            for c in gcfgs:
                gc = GluonGatherQuantConfig(*c)
                q, s_, qt = weight_copies_gluon(w, torch.float8_e4m3fn, gc)
                ok = (torch.equal(q.view(torch.uint8), old[0][0].view(torch.uint8))
                      and torch.equal(qt.view(torch.uint8), old[1][0].view(torch.uint8)) and torch.equal(s_, old[0][1]))
                fns[c] = (lambda w=w, gc=gc: weight_copies_gluon(w, torch.float8_e4m3fn, gc), ok)
            t = {k: [] for k in fns}
            for r in range(args.rounds):
                keys = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
                for k in keys:
                    fn = fns[k][0] if isinstance(fns[k], tuple) else fns[k]
                    t[k].append(triton.testing.do_bench(fn, warmup=10, rep=50))
            ms = {k: statistics.median(v) for k, v in t.items()}
            n = w.numel()
            copy_rate = 4 * n / ms["copy"]
            row = (f"{name:<14} {wname:<8} {str(tuple(shape)):<20} {ms['gluon']:9.4f} {ms['one']:11.4f} "
                   f"{ms['two']:11.4f} {4 * n / ms['gluon'] / copy_rate:8.3f} {4 * n / ms['one'] / copy_rate:9.3f} "
                   f"{5 * n / ms['two'] / copy_rate:9.3f}")
            for c in gcfgs:
                row += f" {ms[c]:.4f} {4 * n / ms[c] / copy_rate:.3f} {'ok' if fns[c][1] else 'BAD'}"
            print(row, flush=True)
            new = old = None
            torch.cuda.empty_cache()
    os.environ.pop(_VAR, None)
    os.environ.pop(_GVAR, None)


def _check_forms(cfgs) -> None:
    """Per Gluon config, on small weights: mismatching bytes of each copy against the
    two-pass copies and the (row % 128, column % 128) positions of the first few."""
    from primus_turbo.pytorch.ops.quantization import _quantize_fp8_blocks_batched
    from primus_turbo.triton.quantization.gather_quant_gluon import GluonGatherQuantConfig
    from primus_turbo.triton.quantization.quant_fp8_gluon import weight_copies_gluon

    for shape in ((1, 128, 128), (2, 256, 384), (3, 200, 136)):
        torch.manual_seed(1)
        w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        q0, s0 = _quantize_fp8_blocks_batched(w, torch.float8_e4m3fn, 128)
        ref_t = q0.transpose(1, 2).contiguous().view(torch.uint8)
        for c in cfgs:
            nb, r, cc = shape
            out = (torch.full_like(q0.view(torch.uint8), 0x5A).view(q0.dtype), torch.full_like(s0, float("nan")),
                   torch.full((nb, cc, r), 0x5A, dtype=torch.uint8, device="cuda").view(q0.dtype))
            q, s, qt = weight_copies_gluon(w, torch.float8_e4m3fn, GluonGatherQuantConfig(*c), out=out)
            msg = [f"{str(shape):<16} {str(c):<16} scales {'ok' if torch.equal(s, s0) else 'BAD'}"]
            for tag, a, ref, dims in (("fwd", q.view(torch.uint8), q0.view(torch.uint8), (1, 2)),
                                      ("trans", qt.view(torch.uint8), ref_t, (2, 1))):
                bad = (a != ref).nonzero()
                pos = sorted({(int(i[dims[0]]) % 128, int(i[dims[1]]) % 128) for i in bad[:4000]})[:12]
                msg.append(f"{tag} {bad.shape[0]} bad" + (f" (row, col) {pos}" if bad.shape[0] else ""))
            print("  ".join(msg), flush=True)


if __name__ == "__main__":
    main()
