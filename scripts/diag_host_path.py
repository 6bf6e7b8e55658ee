#!/usr/bin/env python3
"""Where the host time of a small expert GEMM goes: each piece of ``turbo.ops.grouped_gemm``'s
16-bit path timed alone on the GPU machine (host microseconds per call, the mean of ``--n`` calls
after a warm-up; the GEMMs are small, so the host, not the GPU, sets the pace), next to the bare
``torch._grouped_mm`` and a few plain torch calls that show what one op costs on this host.

    PYTHONPATH=. python scripts/diag_host_path.py --out DIR [--shape G ROWS N K] [--cprofile]

Writes ``DIR/diag_host_path.txt`` (the table, then cProfiles of the whole op when asked).
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

from scripts.diag_grouped import _host_us  # noqa: E402


def _us(fn, n: int) -> float:
    for _ in range(5):  # warm-up: compiles, caches, the allocator's first blocks
        fn()
    return _host_us(fn, n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", type=int, nargs=4, default=(4, 1024, 2048, 768), metavar=("G", "ROWS", "N", "K"))
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args(argv)
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.backends.grouped_gemm import grouped_gemm_dispatcher, zero_tail_rows
    from primus_turbo.pytorch.core.backend import PrecisionType
    # the module (``primus_turbo.pytorch.ops.grouped_gemm`` as an attribute is the op function)
    op = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm")
    from primus_turbo.triton.gemm import gemm_fp8_gluon as dense
    from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg

    G, rows, N, K = args.shape
    M = G * rows
    dev = torch.device("cuda")
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(G, N, K, device=dev) / K**0.5).to(torch.bfloat16)
    B = w.transpose(1, 2)
    lens = torch.full((G,), rows, device=dev, dtype=torch.int64)
    offs = torch.arange(G + 1, device=dev, dtype=torch.int64) * rows
    offs32 = offs[1:].to(torch.int32)
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    prec = PrecisionType.BF16_FP16_FP32
    cfg = gg.fitted_config(gg.default_grouped16_config(M, N, G, dense._num_sms(dev)), torch.bfloat16)
    kargs, kkw = gg._kernel_args(a, B, offs, out, cfg)
    tiles = (-(-M // cfg.BLOCK_M) + G + 1) * -(-N // cfg.block_n)

    steps = [
        ("torch.empty(M, N)", lambda: torch.empty((M, N), dtype=torch.bfloat16, device=dev)),
        ("offs[1:].to(int32)", lambda: offs[1:].to(torch.int32)),
        ("op._offsets(lens)", lambda: op._offsets(lens)),
        ("torch.cumsum(lens)", lambda: torch.cumsum(lens, 0)),
        ("bare torch._grouped_mm", lambda: torch._grouped_mm(a, B, offs=offs32)),
        ("zero_tail_rows(out)", lambda: zero_tail_rows(out, offs)),
        ("op._check_inputs", lambda: op._check_inputs(a, w, lens, offs, True, None, None)),
        ("dispatcher.resolve", lambda: grouped_gemm_dispatcher.resolve(prec, a=a, b=B, group_lens=lens,
                                                                        group_offs=offs, num_cu=None)),
        ("gluon_grouped_reason", lambda: gg.gluon_grouped_reason(a, B, offs)),
        ("gg._launch_reason", lambda: gg._launch_reason(a, B, offs, None, None)),
        ("gg._kernel_args (3 descs)", lambda: gg._kernel_args(a, B, offs, out, cfg)),
        ("launch (prebuilt args)", lambda: dense._launch_persistent(gg._grouped_gemm_gluon_ws_kernel, dev, tiles,
                                                                      None, kargs, kkw)),
        ("grouped_gemm_gluon(checked)", lambda: gg.grouped_gemm_gluon(a, B, offs, checked=True)),
        ("grouped_gemm_gluon(out=)", lambda: gg.grouped_gemm_gluon(a, B, offs, out=out, checked=True)),
        ("op default (offs given)", lambda: turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True)),
        ("op default (offs None)", lambda: turbo.ops.grouped_gemm(a, w, lens, None, trans_b=True)),
    ]
    lines = [f"G {G} rows {rows} N {N} K {K}; host us per call (mean of {args.n})", ""]
    for name, fn in steps:
        try:
            us = _us(fn, args.n)
            lines.append(f"{name:32s} {us:8.1f}")
        except Exception as exc:  # a piece that does not apply here is reported, the rest goes on
            lines.append(f"{name:32s} ERROR {type(exc).__name__}: {exc}"[:200])
        print(lines[-1], flush=True)
    if args.cprofile:
        from scripts.diag_grouped import _cprofile

        lines.append("\n===== op default (offs given)")
        lines.append(_cprofile(lambda: turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True), n=300, top=30,
                               sorts=("tottime", "cumulative")))
    outd = Path(args.out)
    outd.mkdir(parents=True, exist_ok=True)
    (outd / "diag_host_path.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
