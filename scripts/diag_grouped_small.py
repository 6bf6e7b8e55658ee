#!/usr/bin/env python3
"""Why is the Gluon 16-bit grouped forward slow with many small groups? Forward only, bf16,
``w [G, N, K]`` (``trans_b=True``), balanced groups; times ``torch._grouped_mm``, the Gluon kernel
at each config given and the tl kernel, and three probes that separate weight traffic from the
tile schedule:

* ``shared-w``: every expert reads the same weight (``w[:1].expand``: a zero group stride), so the
  weights fit in L2; a large gain over the real run means the kernel is bound by weight reads;
* ``G/4 x 4M``: the same FLOPs with a quarter of the experts, 4x the rows each (the weight bytes
  per FLOP divided by 4);
* ``grid/2``: half the SMs (fewer tiles in flight, so fewer weight tiles competing for L2).

    PYTHONPATH=. python scripts/diag_grouped_small.py [--configs n256k64s3e256 n128k64s6] [--out DIR]
        [--moe --only Mixtral --rounds 5 --no-probes --no-tl --grids]   (interleaved vendor / Gluon A/B)
        [--lens balanced unbalanced unbalanced128]   (Primus' unbalanced draw, with and without partial tiles)

Configs with ``p<D>``: the experimental pacing of grouped_gemm_gluon.py (``default (turbo.ops)`` rows
follow PRIMUS_TURBO_GROUPED_GEMM_PACE).
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

#: (G, rows per group, N, K, label, weight stored K-major): forward rows read ``w [G, N, K]``
#: (K-major), dgrad rows ``w [G, K, N]`` (N-major, the transposed-weight product of the backward)
SHAPES = ((64, 512, 4096, 7168, "DSv3-EP4 gate_up", True), (64, 512, 7168, 2048, "DSv3-EP4 down", True),
          (64, 512, 2048, 7168, "DSv3-EP4 down dgrad", False), (64, 512, 7168, 4096, "DSv3-EP4 gate_up dgrad", False),
          (64, 1024, 4096, 7168, "DSv3-EP4 gate_up t1024", True),
          (64, 2048, 4096, 7168, "DSv3-EP4 gate_up t2048", True), (32, 2048, 4096, 7168, "DSv3-EP8 gate_up", True),
          (16, 2048, 2048, 768, "Qwen3-EP8 down", True))


#: expert GEMMs at 16384 tokens: forward (K-major ``[G, N, K]`` weights) and dgrad (the same
#: weights read N-major) of gate_up and down; DeepSeek-V3, Mixtral and GPT-OSS with the MoE layer
#: benchmark's local experts, Qwen3-30B-A3B with all 128 experts (1024 rows each; the benchmark
#: runs 32)
MOE_SHAPES = (
    (32, 4096, 4096, 7168, "moe DSv3 gate_up", True), (32, 4096, 7168, 2048, "moe DSv3 down", True),
    (32, 4096, 7168, 4096, "moe DSv3 gate_up dgrad", False), (32, 4096, 2048, 7168, "moe DSv3 down dgrad", False),
    (8, 4096, 28672, 4096, "moe Mixtral gate_up", True), (8, 4096, 4096, 14336, "moe Mixtral down", True),
    (8, 4096, 4096, 28672, "moe Mixtral gate_up dgrad", False),
    (8, 4096, 14336, 4096, "moe Mixtral down dgrad", False),
    (32, 2048, 5760, 2880, "moe GPT-OSS gate_up", True), (32, 2048, 2880, 2880, "moe GPT-OSS down", True),
    (32, 2048, 2880, 5760, "moe GPT-OSS gate_up dgrad", False),
    (32, 2048, 2880, 2880, "moe GPT-OSS down dgrad", False),
    (128, 1024, 1536, 2048, "moe Qwen3 gate_up", True), (128, 1024, 2048, 768, "moe Qwen3 down", True),
    (128, 1024, 2048, 1536, "moe Qwen3 gate_up dgrad", False),
    (128, 1024, 768, 2048, "moe Qwen3 down dgrad", False),
)


def _bench(fn, rep_ms: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))


def _snr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref = ref.double()
    err = (out.double() - ref).pow(2).sum().clamp_min(1e-300)
    return float(10 * torch.log10(ref.pow(2).sum() / err))


def group_lens(G: int, m: int, kind: str) -> list[int]:
    """Rows per group summing to ``G * m``: ``balanced`` (all ``m``), ``unbalanced`` (Primus' draw, as
    benchmarks/bench_grouped_gemm.py), ``unbalanced128`` (that draw with every group but the last
    rounded to a multiple of 128, the last taking the rest: the same spread of sizes without the
    partial tiles at group ends, which separates the two costs)."""
    if kind == "balanced":
        return [m] * G
    from benchmarks.bench_grouped_gemm import routing_lens

    lens = routing_lens(G, m, "unbalanced")
    if kind == "unbalanced128":
        lens = [max(128, round(n / 128) * 128) for n in lens[:-1]]
        lens.append(G * m - sum(lens))
        if lens[-1] < 0:
            raise ValueError(f"unbalanced128 draw does not fit G={G} x m={m}")
    elif kind != "unbalanced":
        raise ValueError(f"unknown lens kind {kind!r}")
    return lens


def run_shape(G, m, N, K, label, kmajor, configs, rep_ms, grids, probes, tl=True, rounds=1, lens_kind="balanced"):
    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import GluonGroupedConfig, grouped_gemm_gluon
    from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import grouped_gemm_triton

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    M = G * m
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16, generator=gen) * K ** -0.5
    if not kmajor:  # the same logical [G, K, N] weight stored N-major
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    lens = torch.tensor(group_lens(G, m, lens_kind), device=dev, dtype=torch.int64)
    label = label if lens_kind == "balanced" else f"{label} {lens_kind}"
    offs = torch.zeros(G + 1, device=dev, dtype=torch.int64)
    offs[1:] = torch.cumsum(lens, 0)
    offs32 = offs[1:].to(torch.int32)
    flops = 2.0 * M * N * K
    rows = []

    def add(name, fn, ref=None):
        try:
            out = fn()
            torch.cuda.synchronize()
            snr = _snr(ref, out) if ref is not None else None
            ms = _bench(fn, rep_ms)
            rows.append({"case": label, "impl": name, "ms": ms, "tflops": flops / ms * 1e-9, "snr": snr})
        except Exception as exc:  # a probe that cannot run is reported, not fatal
            rows.append({"case": label, "impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(rows[-1], flush=True)

    ref = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32)
    add("torch", lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32))
    for c in configs:
        cfg = GluonGroupedConfig.parse(c)
        add(f"gluon {c}", lambda cfg=cfg: grouped_gemm_gluon(a, w.transpose(1, 2), offs, config=cfg), ref)
    c0 = GluonGroupedConfig.parse(configs[0])
    for n in grids:
        add(f"gluon {configs[0]} grid {n}",
            lambda n=n: grouped_gemm_gluon(a, w.transpose(1, 2), offs, config=c0, num_programs=n), ref)
    add("default (turbo.ops)", lambda: _default_op(a, w, lens, offs), ref)
    for rnd in range(1, rounds):  # interleaved A/B: the vendor kernel, each Gluon config, the default
        add("torch", lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs32))
        for c in configs:
            cfg = GluonGroupedConfig.parse(c)
            add(f"gluon {c}", lambda cfg=cfg: grouped_gemm_gluon(a, w.transpose(1, 2), offs, config=cfg), ref)
        add("default (turbo.ops)", lambda: _default_op(a, w, lens, offs), ref)
    if tl:
        add("tl", lambda: grouped_gemm_triton(a, w.transpose(1, 2), lens, offs), ref)
    if not probes:
        return rows
    # probes
    ws = w[:1].expand(G, N, K)
    ref_s = torch._grouped_mm(a, w[:1].expand(G, N, K).contiguous().transpose(-2, -1), offs=offs32)
    add("torch shared-w", lambda: torch._grouped_mm(a, ws.transpose(-2, -1), offs=offs32), ref_s)
    add("gluon shared-w", lambda: grouped_gemm_gluon(a, ws.transpose(1, 2), offs, config=c0), ref_s)
    g4 = max(G // 4, 1)
    w4 = w[:g4]
    offs4 = torch.arange(g4 + 1, device=dev, dtype=torch.int64) * (M // g4)
    ref4 = torch._grouped_mm(a, w4.transpose(-2, -1), offs=offs4[1:].to(torch.int32))
    add("torch G/4x4M", lambda: torch._grouped_mm(a, w4.transpose(-2, -1), offs=offs4[1:].to(torch.int32)), ref4)
    add("gluon G/4x4M", lambda: grouped_gemm_gluon(a, w4.transpose(1, 2), offs4, config=c0), ref4)
    return rows


def _default_op(a, w, lens, offs):
    import primus_turbo.pytorch as turbo

    return turbo.ops.grouped_gemm(a, w, lens, group_offs=offs, trans_b=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["n256k64s3e256", "n128k64s6", "n256k64s4"])
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--grids", type=int, nargs="*", default=[66], help="persistent grid caps timed with the first config")
    p.add_argument("--only", nargs="*", default=None, help="shapes whose label contains one of these")
    p.add_argument("--no-probes", action="store_true", help="skip the shared-weight and G/4 probes")
    p.add_argument("--no-tl", action="store_true", help="skip the tl kernel")
    p.add_argument("--moe", action="store_true", help="the MoE layer benchmark's expert GEMMs instead")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the vendor kernel, the Gluon configs and the default this many times, interleaved")
    p.add_argument("--lens", nargs="+", default=["balanced"], choices=("balanced", "unbalanced", "unbalanced128"),
                   help="group sizes (each shape is run with every kind given; see group_lens)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for shape in MOE_SHAPES if args.moe else SHAPES:
        if args.only and not any(o in shape[4] for o in args.only):
            continue
        for kind in args.lens:
            rows += run_shape(*shape, args.configs, args.rep_ms, args.grids, not args.no_probes, not args.no_tl,
                              args.rounds, kind)
            torch.cuda.empty_cache()
    print(f"\n{'case':28s} {'impl':26s} {'ms':>8s} {'TFLOP/s':>8s} {'SNR':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:28s} {r['impl']:26s} ERROR {r['error'][:80]}")
        else:
            snr = "" if r["snr"] is None else f"{r['snr']:.1f}"
            print(f"{r['case']:28s} {r['impl']:26s} {r['ms']:8.3f} {r['tflops']:8.1f} {snr:>6s}")
    if args.rounds > 1:
        import statistics

        print(f"\nmedian over {args.rounds} interleaved rounds, and the ratio to torch._grouped_mm")
        cases = list(dict.fromkeys(r["case"] for r in rows))
        for case in cases:
            ms = {}
            for r in rows:
                if r["case"] == case and "ms" in r:
                    ms.setdefault(r["impl"], []).append(r["ms"])
            base = statistics.median(ms["torch"]) if "torch" in ms else None
            for impl, v in ms.items():
                med = statistics.median(v)
                ratio = f"{base / med:6.3f}" if base else "     -"
                print(f"{case:28s} {impl:26s} {med:8.3f} x{ratio}  (min {min(v):.3f} max {max(v):.3f}, n {len(v)})")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "diag_grouped_small.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
