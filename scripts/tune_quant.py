"""Sweep the launch configurations of the slow quantizers on the GPU (H100/H200).

For bf16 ``x`` of ``[16384, 7168]`` and ``[4096, 7168]`` (``--shapes`` to change), every candidate
configuration of

- ``with_trans_blockwise``: ``quantize_fp8_with_trans`` BLOCKWISE (1x128 row copy + 128x1 column copy),
- ``with_trans_mx``: ``quantize_fp8_with_trans`` MX (1x32 + 32x1),
- ``fp4``: ``quantize_fp4`` (MXFP4 along rows),
- ``fp4_with_trans``: ``quantize_fp4_with_trans``

is timed with ``triton.testing.do_bench`` (median) and reported as GB/s (bytes read + bytes
written, as benchmarks/bench_quantization.py counts them) and as the ratio to a device copy
(``y.copy_(x)`` of the same input, timed in the same run before and after each quantizer's sweep).
The default configuration's output is checked bit for bit against ``primus_turbo.testing.quant_ref``
(the whole tensor), and every candidate's output bit for bit against the default's; a candidate
that fails to compile or to match is reported and skipped. ``generic`` candidates are the kernels
that ran before the two-copy kernels (kept as a fallback for shapes those do not cover).

    PYTHONPATH=. python scripts/tune_quant.py --out DIR [--only fp4 fp4_with_trans] [--shapes 16384x7168]
        [--match packed]

``packed`` candidates (``(TR, TC, num_warps, "packed"[, maxnreg])``) are the bf16-pair MXFP4
kernels of quant_fp4_packed.py (bf16 input only; two elements per instruction, ~12 SASS
instructions per element instead of 21 for ``quantize_fp4``, ~25 instead of 42 with the
transposed copy), and for ``with_trans_*`` the bf16-pair FP8 kernel of quant_fp8_packed.py;
``packed2`` candidates (``--match packed2``) are that FP8 kernel with the row-wise words stored
from their own layout, ``packed3`` (128-column tiles) also the column words without the
shared-memory transpose (fewer shared-memory round trips: SASS counts in quant_fp8_kernel's
``WITH_TRANS_CANDIDATES`` comment, scripts/quant_sass_stats.py).

Writes ``DIR/tune_quant.json`` and prints a table; the defaults are set in one function per
module: ``quant_fp8_kernel.packed_with_trans_config`` (bf16 -> E4M3 BLOCKWISE / MX, the pair
kernel), ``quant_fp8_kernel.with_trans_config`` (the tl kernels) and ``quant_fp4_kernel.fp4_config``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

QUANTIZERS = ("with_trans_blockwise", "with_trans_mx", "fp4", "fp4_with_trans")
SHAPES = ((16384, 7168), (4096, 7168))


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.element_size() == 4 else t


def _mismatch(outs, refs) -> int:
    """Number of differing elements (bit patterns; NaN scales compare by bits too)."""
    n = 0
    for o, r in zip(outs, refs):
        if tuple(o.shape) != tuple(r.shape):
            return max(o.numel(), r.numel(), 1)
        n += int((_bits(o) != _bits(r)).sum())
    return n


def _cases(name: str):
    """(candidates [(label, cfg)], run(x, cfg) -> outputs, ref(x) -> outputs)."""
    from primus_turbo.testing import quant_ref as R
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
    from primus_turbo.triton.quantization import quant_fp4_kernel as F4
    from primus_turbo.triton.quantization import quant_fp8_kernel as F8

    e4m3 = torch.float8_e4m3fn
    if name.startswith("with_trans"):
        mx = name.endswith("mx")
        row = F8.QuantGrouping(1, 1, 32) if mx else F8.QuantGrouping(0, 1, 128)
        col = F8.QuantGrouping(1, 32, 1) if mx else F8.QuantGrouping(0, 128, 1)
        gran = G.MX_BLOCKWISE if mx else G.BLOCKWISE

        def run(x, cfg):
            return F8.fp8_quant_with_trans_launch(x, e4m3, row, col, tile=cfg)

        def ref(x):
            return (*R.quantize_fp8_ref(x, e4m3, gran), *R.quantize_fp8_ref(x.t().contiguous(), e4m3, gran))

        def candidates(rows, cols):
            # bf16 input: the pair kernel's default (the tl kernel's where that does not apply)
            default = F8.packed_with_trans_config(row) or F8.with_trans_config(rows, cols, row, col)
            out = [("default " + str(default), None)]
            for cfg in F8.WITH_TRANS_CANDIDATES:
                if cfg != default and F8._dual_ok(rows, cols, row, col, cfg):
                    out.append((str(cfg), cfg))
            for edge, nw in ((128, 4), (128, 8), (64, 4)):  # the generic tile kernel (square tile)
                if edge >= max(row.gc, col.gr):
                    out.append((f"generic ({edge}, {nw})", (edge, nw)))
            return out

        return candidates, run, ref
    with_trans = name == "fp4_with_trans"

    def run(x, cfg):
        return F4.fp4_quant_launch(x, True, with_trans=with_trans, tile=cfg)

    def ref(x):
        if with_trans:
            return (*R.quantize_fp4_ref(x), *R.quantize_fp4_ref(x.t().contiguous()))
        return R.quantize_fp4_ref(x)

    def candidates(rows, cols):
        default = F4.fp4_config(rows, cols, True, with_trans)
        out = [("default " + str(default), None)]
        for cfg in (F4.FP4_WITH_TRANS_CANDIDATES if with_trans else F4.FP4_CANDIDATES):
            if cfg != default:
                out.append((str(cfg), cfg))
        if with_trans:
            for cfg in ((64, 64, 4), (32, 64, 4), (64, 128, 8)):  # the generic kernel
                out.append((f"generic {cfg}", (*cfg, "generic")))
        return out

    return candidates, run, ref


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="result directory")
    p.add_argument("--only", nargs="+", choices=QUANTIZERS, default=list(QUANTIZERS))
    p.add_argument("--shapes", nargs="+", default=[f"{r}x{c}" for r, c in SHAPES], help="e.g. 16384x7168")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--no-ref", action="store_true", help="skip the reference check of the default config")
    p.add_argument("--match", nargs="+", default=None,
                   help="time only the candidates whose label contains one of these strings (the default "
                        "config always runs: it is the bit-exactness baseline), e.g. --match packed")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="functional check without a GPU: Triton interpreter, tiny shapes, timings meaningless")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        args.shapes = ["256x256"]
    elif not torch.cuda.is_available():
        raise SystemExit("tune_quant: needs a CUDA device (or --cpu-smoke)")
    import triton

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    rows_out: list[dict] = []

    def bench(fn) -> float:
        if args.cpu_smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for shape_s in args.shapes:
        rows, cols = (int(v) for v in shape_s.lower().split("x"))
        gen = torch.Generator(device=dev).manual_seed(rows * 131 + cols)
        x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16, generator=gen)
        # per-row magnitudes over 2**-10..2**10 so blocks see varied scales (as the tests do)
        x *= torch.exp2(torch.randint(-10, 11, (rows, 1), device=dev, generator=gen).to(torch.bfloat16))
        y = torch.empty_like(x)
        for name in args.only:
            copy_ms = [bench(lambda: y.copy_(x))]
            candidates, run, ref = _cases(name)
            base = None
            results = []
            for label, cfg in candidates(rows, cols):
                if args.match and cfg is not None and not any(m in label for m in args.match):
                    continue
                r = {"quantizer": name, "shape": [rows, cols], "config": label, "cfg": cfg, "error": None}
                try:
                    outs = run(x, cfg)
                    sync()
                    if cfg is None:
                        base = [o.clone() for o in outs]
                        if not args.no_ref:
                            bad = _mismatch(outs, ref(x))
                            r["ref_mismatches"] = bad
                            if bad:
                                r["error"] = f"default config differs from quant_ref in {bad} elements"
                    elif base is not None:
                        bad = _mismatch(outs, base)
                        r["mismatches_vs_default"] = bad
                        if bad:
                            r["error"] = f"{bad} elements differ from the default config's output"
                    nbytes = _nbytes(x) + _nbytes(*outs)
                    del outs
                    if r["error"] is None:
                        ms = bench(lambda cfg=cfg: run(x, cfg))
                        r.update(ms=ms, gbps=nbytes / ms / 1e6, bytes=nbytes)
                except Exception as exc:  # a config that fails to compile or launch: reported, sweep goes on
                    r["error"] = f"{type(exc).__name__}: {exc}"[:400]
                    traceback.print_exc(limit=2)
                results.append(r)
            copy_ms.append(bench(lambda: y.copy_(x)))
            copy_gbps = 2 * _nbytes(x) / (sum(copy_ms) / len(copy_ms)) / 1e6
            for r in results:
                r["copy_gbps"] = copy_gbps
                r["copy_ms"] = copy_ms
                if r.get("gbps"):
                    r["vs_copy"] = r["gbps"] / copy_gbps
                rows_out.append(r)
                if r.get("gbps"):
                    print(f"{name:22s} {rows}x{cols:<6d} {r['config']:28s} {r['ms']:8.4f} ms {r['gbps']:8.1f} GB/s "
                          f"x{r['vs_copy']:.3f} of copy ({copy_gbps:.0f} GB/s)", flush=True)
                else:
                    print(f"{name:22s} {rows}x{cols:<6d} {r['config']:28s} ERROR {r['error']}", flush=True)
        x = y = None  # free the case before the next shape
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    info = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter smoke run)", "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = out_dir / "tune_quant.json"
    path.write_text(json.dumps({"info": info, "rows": rows_out}, indent=1, default=str))
    print("\n| quantizer | shape | default x copy | best config | best ms | best GB/s | best x copy |")
    print("|---|---|---:|---|---:|---:|---:|")
    keys = sorted({(r["quantizer"], tuple(r["shape"])) for r in rows_out})
    for q, shape in keys:
        ok = [r for r in rows_out if r["quantizer"] == q and tuple(r["shape"]) == shape and r.get("gbps")]
        dflt = next((r for r in ok if r["cfg"] is None), None)
        if not ok:
            print(f"| {q} | {shape[0]}x{shape[1]} | - | (all failed) | | | |")
            continue
        best = max(ok, key=lambda r: r["gbps"])
        d = f"{dflt['vs_copy']:.3f}" if dflt else "failed"
        print(f"| {q} | {shape[0]}x{shape[1]} | {d} | {best['config']} | {best['ms']:.4f} | {best['gbps']:.0f} | "
              f"{best['vs_copy']:.3f} |")
    print(f"\n{path}\nSet the winners in quant_fp8_kernel.with_trans_config / quant_fp4_kernel.fp4_config.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
