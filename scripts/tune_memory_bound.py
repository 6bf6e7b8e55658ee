"""Sweep launch configurations of the memory-bound kernels on the GPU and report GB/s against a
device copy measured in the same run.

    PYTHONPATH=. python scripts/tune_memory_bound.py --out /tmp/tune

Sweeps (bf16 inputs):
- ``rmsnorm_bwd``: BLOCK_R x num_warps x programs per SM (dgamma partials summed, as the op does);
- ``fp4`` / ``fp4_with_trans``: MXFP4 tile (TR, TC, num_warps);
- ``fp8_with_trans_*``: square tile edge and num_warps of the two-copy FP8 quantizer;
- ``merge_rows``: the weighted top-k merge of moe_unpermute (BLOCK_T x num_warps), T tokens of
  H 7168 from T x 8 permuted rows, bytes = rows read + tokens written; every config's output is
  compared bit for bit with the default's.
Writes ``tune_memory_bound.json`` and prints the best configuration per sweep last. Correctness
is not checked here (the tests and the benchmarks do that); every config's outputs are the same
function of x, only the launch differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402


def _bench(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def _host_profile(dev, out_dir: Path) -> None:
    """Host time per call of small (host-bound) quantizer calls, and where it goes (cProfile)."""
    import cProfile
    import pstats
    import time

    from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
    from primus_turbo.pytorch.ops import quantization as Q

    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    cases = {
        "tensorwise": lambda: Q.quantize_fp8(x, torch.float8_e4m3fn, G.TENSORWISE),
        "blockwise": lambda: Q.quantize_fp8(x, torch.float8_e4m3fn, G.BLOCKWISE),
        "with_trans_blockwise": lambda: Q.quantize_fp8_with_trans(x, torch.float8_e4m3fn, G.BLOCKWISE),
        "empty_like": lambda: torch.empty_like(x),
    }
    lines = []
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        lines.append(f"host us/call {name}: {(t1 - t0) / 200 * 1e6:.1f}")
    print("\n".join(lines), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        cases["blockwise"]()
    prof.disable()
    torch.cuda.synchronize()
    path = out_dir / "host_profile_blockwise.txt"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n\n")
        pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(35)
    print(f"host profile: {path}", flush=True)


def _sweep_merge_rows(dev, copy_gbps, record, rows) -> None:
    from primus_turbo.triton.moe.permute_kernel import merge_rows_launch

    k, h = 8, 7168
    for t in (8192, 16384):
        shape = (t, h)
        copy = copy_gbps(shape)
        rows.append({"sweep": "device-copy", "shape": list(shape), "gbps": copy})
        src = torch.randn(t * k, h, device=dev, dtype=torch.bfloat16)
        row_map = torch.randperm(t * k, device=dev).view(t, k).to(torch.int32)
        w = torch.rand(t, k, device=dev)
        out = torch.empty(t, h, device=dev, dtype=torch.bfloat16)
        ref = merge_rows_launch(src, out, row_map, w).clone()
        nbytes = (t * k * h + t * h) * 2
        for bt in (1, 2, 4, 8):
            for nw in (2, 4, 8):
                def fn(bt=bt, nw=nw):
                    return merge_rows_launch(src, out, row_map, w, block_t=bt, num_warps=nw)
                record("merge_rows", shape, {"block_t": bt, "num_warps": nw}, nbytes, fn, copy)
                if rows[-1].get("error") is None and not torch.equal(out, ref):
                    rows[-1]["error"] = "output differs from the default config's"
                    print("  ^ output differs from the default config's", flush=True)
        src = out = None  # noqa: F841
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="+", default=None)
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from primus_turbo.triton.normalization.rmsnorm_kernel import rmsnorm_bwd_launch
    from primus_turbo.triton.quantization.quant_fp4_kernel import fp4_quant_launch
    from primus_turbo.triton.quantization.quant_fp8_kernel import QuantGrouping, fp8_quant_with_trans_launch

    dev = torch.device("cuda")
    rows: list[dict] = []

    def want(name: str) -> bool:
        return args.only is None or name in args.only

    def copy_gbps(shape) -> float:
        x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        return _gbps(2 * x.numel() * 2, _bench(lambda: y.copy_(x)))

    def record(sweep, shape, cfg, nbytes, fn, copy):
        try:
            ms = _bench(fn)
            r = {"sweep": sweep, "shape": list(shape), "config": cfg, "ms": ms, "gbps": _gbps(nbytes, ms),
                 "vs_copy": _gbps(nbytes, ms) / copy, "error": None}
        except Exception as exc:  # a config the compiler rejects: recorded, the sweep goes on
            r = {"sweep": sweep, "shape": list(shape), "config": cfg, "error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(r)
        print(json.dumps(r), flush=True)

    if want("merge_rows"):
        _sweep_merge_rows(dev, copy_gbps, record, rows)

    for shape in ((16384, 4096), (16384, 7168)):
        copy = copy_gbps(shape)
        rows.append({"sweep": "device-copy", "shape": list(shape), "gbps": copy})
        x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        n = x.numel()
        if want("rmsnorm_bwd"):
            dy = torch.randn_like(x)
            g = torch.randn(shape[1], device=dev, dtype=torch.bfloat16)
            rstd = torch.rand(shape[0], device=dev, dtype=torch.float32) + 0.5
            nbytes = 3 * n * 2  # dy, x read; dx written
            for br in (1, 2, 4, 8):
                for nw in (4, 8, 16):
                    for per_sm in (2, 4, 8, 16):
                        def fn(br=br, nw=nw, per_sm=per_sm):
                            _, part = rmsnorm_bwd_launch(dy, x, g, rstd, False, None, block_r=br, num_warps=nw,
                                                         progs_per_sm=per_sm)
                            return part.sum(0)
                        record("rmsnorm_bwd", shape, {"block_r": br, "num_warps": nw, "progs_per_sm": per_sm},
                               nbytes, fn, copy)
        if want("fp4"):
            nbytes = n * 2 + n // 2 + n // 32
            for tile in ((4, 1024, 4), (8, 1024, 4), (8, 1024, 8), (16, 1024, 8), (16, 1024, 16), (16, 512, 8),
                         (32, 256, 8), (32, 512, 16)):
                record("fp4", shape, {"tile": tile}, nbytes, lambda tile=tile: fp4_quant_launch(x, True, tile=tile), copy)
        if want("fp4_with_trans"):
            nbytes = n * 2 + 2 * (n // 2 + n // 32)
            for tile in ((32, 32, 4), (32, 64, 4), (64, 64, 4), (64, 64, 8), (64, 128, 8), (128, 64, 8),
                         (128, 128, 8), (128, 128, 16)):
                record("fp4_with_trans", shape, {"tile": tile}, nbytes,
                       lambda tile=tile: fp4_quant_launch(x, True, with_trans=True, tile=tile), copy)
        e4m3 = torch.float8_e4m3fn
        groupings = {
            "fp8_with_trans_1x128": (QuantGrouping(0, 1, 128), QuantGrouping(0, 128, 1), (128,)),
            "fp8_with_trans_128x128": (QuantGrouping(0, 128, 128), QuantGrouping(0, 128, 128), (128,)),
            "fp8_with_trans_mx": (QuantGrouping(1, 1, 32), QuantGrouping(1, 32, 1), (32, 64, 128)),
        }
        for name, (row, col, edges) in groupings.items():
            if not want(name):
                continue
            n_scale = 2 * n // 32 if row.mode == 1 else 2 * 4 * n // 128
            nbytes = n * 2 + 2 * n + n_scale
            for edge in edges:
                for nw in (4, 8, 16):
                    record(name, shape, {"edge": edge, "num_warps": nw}, nbytes,
                           lambda edge=edge, nw=nw, row=row, col=col: fp8_quant_with_trans_launch(
                               x, e4m3, row, col, tile=(edge, nw)), copy)
        x = None  # noqa: F841  (free the case before the next shape)
        torch.cuda.empty_cache()

    if want("host"):
        _host_profile(dev, out_dir)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        pass
    (out_dir / "tune_memory_bound.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print("\n| sweep | shape | best config | ms | GB/s | vs copy | worst vs copy |")
    print("|---|---|---|---:|---:|---:|---:|")
    keys = sorted({(r["sweep"], tuple(r["shape"])) for r in rows if r["sweep"] != "device-copy"})
    for sweep, shape in keys:
        ok = [r for r in rows if r["sweep"] == sweep and tuple(r["shape"]) == shape and r.get("error") is None]
        if not ok:
            print(f"| {sweep} | {shape} | (all failed) | | | | |")
            continue
        best = max(ok, key=lambda r: r["gbps"])
        worst = min(ok, key=lambda r: r["gbps"])
        print(f"| {sweep} | {shape[0]}x{shape[1]} | {best['config']} | {best['ms']:.4f} | {best['gbps']:.0f} | "
              f"{best['vs_copy']:.3f} | {worst['vs_copy']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
