#!/usr/bin/env python3
"""Small expert GEMMs: the vendor grouped kernels against our op's default and its Gluon path,
timed three ways to tell device time from host time: ``do_bench`` median with the L2 flushed
(what the benchmarks report), CUDA-graph replay (device time alone) and the host time of one call
(the launches alone, the GPU kept busy).

Per shape (G experts x rows, N, K; weights ``[G, N, K]``, balanced groups):

* bf16: ``torch._grouped_mm`` on precomputed int32 offsets (the bare peer), ``turbo.ops.grouped_gemm``
  default, and with TRITON pinned (the Gluon kernel on sm_90);
* FP8 TENSORWISE / ROWWISE (operands quantized once by the op's quantizers): ``torch._scaled_grouped_mm``
  (bare), the op's GEMM through its dispatcher by default and with GLUON pinned.

    PYTHONPATH=. python scripts/diag_grouped_launch.py --out /tmp/d [--shape G ROWS N K ...] [--cprofile]

Writes ``diag_grouped_launch.json`` and ``.txt`` (a table, and cProfiles when asked).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_grouped import _cprofile, _host_us  # noqa: E402
from scripts.diag_grouped_fp8_case import _graph_ms  # noqa: E402

# the host-bound rows of session 11's grouped forward benchmark, and a few larger controls
DEFAULT_SHAPES = ((4, 1024, 2048, 768), (8, 1024, 2048, 768), (16, 1024, 2048, 768), (1, 1024, 2880, 2880),
                  (1, 1024, 5760, 2880), (4, 1024, 1536, 2048), (4, 1024, 4096, 1536), (4, 1024, 2880, 2880),
                  (4, 1024, 3072, 4096), (8, 1024, 7168, 2048), (8, 4096, 1536, 2048), (1, 1024, 4096, 14336))


@contextlib.contextmanager
def _pin(backend, precision):
    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    GlobalBackendManager.set_grouped_gemm_backend(backend, precision=precision)
    try:
        yield
    finally:
        GlobalBackendManager.reset()


def _measure(fn, ctx) -> dict:
    from triton.testing import do_bench

    with ctx():
        fn()
        bench = [do_bench(fn, warmup=10, rep=30, return_mode="median") for _ in range(3)]
        return dict(bench_ms=statistics.median(bench), graph_ms=_graph_ms(fn), host_us=_host_us(fn, 100))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", type=int, nargs=4, action="append", metavar=("G", "ROWS", "N", "K"))
    p.add_argument("--grans", nargs="*", default=["TENSORWISE", "ROWWISE"])
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--cprofile", action="store_true", help="cProfiles of the Gluon paths on the first shape")
    p.add_argument("--ab-launch", action="store_true",
                   help="also the host time of the Gluon paths with the direct launch off and on, interleaved")
    args = p.parse_args(argv)
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.backend import BackendType, PrecisionType

    op = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")
    dev = torch.device("cuda")
    fp8 = torch.float8_e4m3fn
    none = contextlib.nullcontext
    recs, lines, profiles = [], [], []
    for i, (G, rows, N, K) in enumerate(args.shape or DEFAULT_SHAPES):
        M = G * rows
        gen = torch.Generator(device=dev).manual_seed(i)
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(G, N, K, device=dev, generator=gen) / K**0.5).to(torch.bfloat16)
        lens = torch.full((G,), rows, device=dev, dtype=torch.int64)
        offs = torch.arange(G + 1, device=dev, dtype=torch.int64) * rows
        offs32 = offs[1:].to(torch.int32)
        tag = f"G{G:3d} rows{rows:5d} N{N:5d} K{K:5d}"
        groups = []
        if not args.no_bf16:
            groups.append(("bf16", {
                "vendor": (lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32), none),
                "default": (lambda: turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True), none),
                "gluon": (lambda: turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True),
                          lambda: _pin(BackendType.TRITON, PrecisionType.BF16_FP16_FP32)),
            }))
        for gran in args.grans:
            aq, sa = op._quant_rows(a, fp8, gran, 128)
            (wq, sw), _ = op._weight_copies(w, True, fp8, gran, 128, True, False)
            sa_sg = sa.float().reshape(-1).expand(M).contiguous()
            sw_sg = sw.float().reshape(G, -1).expand(G, N).contiguous() if sw.numel() != 1 else \
                sw.float().reshape(1, 1).expand(G, N).contiguous()

            def mm(aq=aq, sa=sa, wq=wq, sw=sw, gran=gran):
                return op._mm((aq, sa), (wq, sw), gran, lens, offs, torch.bfloat16, 128, None)

            groups.append((gran, {
                "vendor": (lambda aq=aq, wq=wq, sa_sg=sa_sg, sw_sg=sw_sg: torch._scaled_grouped_mm(
                    aq, wq.transpose(-2, -1), sa_sg, sw_sg, offs=offs32, out_dtype=torch.bfloat16), none),
                "default": (mm, none),
                "gluon": (mm, lambda: _pin(BackendType.GLUON, PrecisionType.FP8)),
            }))
        for kind, steps in groups:
            with steps["vendor"][1]():
                ref = steps["vendor"][0]().float()
            rec = dict(G=G, rows=rows, N=N, K=K, kind=kind)
            for name, (fn, ctx) in steps.items():
                with ctx():
                    got = fn().float()
                rec[f"{name}_rel_diff"] = float((got - ref).norm() / ref.norm())
                for k, v in _measure(fn, ctx).items():
                    rec[f"{name}_{k}"] = v
                if args.ab_launch and name == "gluon":
                    from primus_turbo.triton.launch import set_direct_launch

                    with ctx():
                        off, on = [], []
                        for _ in range(5):
                            for flag, acc in ((False, off), (True, on)):
                                prev = set_direct_launch(flag)
                                fn()
                                acc.append(_host_us(fn, 100))
                                set_direct_launch(prev)
                    rec["gluon_host_us_direct_off"] = statistics.median(off)
                    rec["gluon_host_us_direct_on"] = statistics.median(on)
                if args.cprofile and i == 0 and name != "vendor":
                    with ctx():
                        profiles.append(f"===== {tag} {kind} {name}\n" + _cprofile(fn, n=200, top=25))
            recs.append(rec)
            v = rec
            line = (f"{tag} {kind:10s} | bench v {v['vendor_bench_ms']:.4f} d {v['default_bench_ms']:.4f} "
                    f"g {v['gluon_bench_ms']:.4f} | d/v {v['vendor_bench_ms'] / v['default_bench_ms']:.3f} "
                    f"g/v {v['vendor_bench_ms'] / v['gluon_bench_ms']:.3f} | graph v {v['vendor_graph_ms']:.4f} "
                    f"d {v['default_graph_ms']:.4f} g {v['gluon_graph_ms']:.4f} | host us v {v['vendor_host_us']:.0f} "
                    f"d {v['default_host_us']:.0f} g {v['gluon_host_us']:.0f} | rel g {v['gluon_rel_diff']:.1e}")
            if "gluon_host_us_direct_on" in v:
                line += f" | g host direct off {v['gluon_host_us_direct_off']:.0f} on {v['gluon_host_us_direct_on']:.0f}"
            print(line, flush=True)
            lines.append(line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_grouped_launch.json").write_text(json.dumps(recs, indent=1))
    (out / "diag_grouped_launch.txt").write_text("\n".join(lines + profiles) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
