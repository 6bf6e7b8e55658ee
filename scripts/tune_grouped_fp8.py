"""Tile sweep of the grouped FP8 Triton kernels (M-grouped forward/dgrad and the variable-K wgrad)
for one scaling mode on the GPU, at the MoE layer shapes of a model (balanced groups).

    PYTHONPATH=. python scripts/tune_grouped_fp8.py --out /tmp/t [--mode BLOCKWISE --experts 32 --tokens 2048]

Operands are random E4M3 codes with random power-of-two scales (timing does not depend on values);
each candidate's output is compared with the default config's (SNR, so a broken candidate shows).
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

FWD = [(128, 128, 128, 8, 3, 8), (128, 128, 128, 8, 4, 8), (128, 256, 128, 8, 3, 8), (64, 128, 128, 8, 4, 4),
       (128, 128, 64, 8, 4, 8), (256, 128, 128, 8, 3, 8), (64, 256, 128, 8, 3, 4)]
VK = [(128, 128, 64, 8, 4, 8), (128, 128, 128, 8, 3, 8), (128, 128, 128, 8, 4, 8), (128, 256, 64, 8, 3, 8),
      (64, 128, 128, 8, 4, 4), (128, 128, 32, 8, 5, 8), (256, 128, 64, 8, 3, 8)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="BLOCKWISE")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per expert")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    args = p.parse_args(argv)
    import triton

    from primus_turbo.testing import snr_db
    from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_kernel as K

    dev = torch.device("cuda")
    G, T, H, F = args.experts, args.tokens, args.hidden, args.ffn
    M = G * T
    bs = 128
    lens = torch.full((G,), T, dtype=torch.int64, device=dev)
    offs = torch.zeros(G + 1, dtype=torch.int64, device=dev)
    offs[1:] = torch.cumsum(lens, 0)

    def codes(*shape):
        return (torch.randn(*shape, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)

    def scales(*shape):
        return torch.exp2(torch.randint(-8, -4, shape, device=dev).float())

    rows = []
    # (name, N, K) of the M-grouped GEMMs and (name, P, Q) of the wgrads, for gate_up (2F x H) and down
    mm_cases = [("fc1_fwd", 2 * F, H), ("fc2_fwd", H, F), ("fc1_dgrad", H, 2 * F), ("fc2_dgrad", F, H)]
    vk_cases = [("fc1_wgrad", 2 * F, H), ("fc2_wgrad", H, F)]
    for name, n, k in mm_cases:
        a, sa = codes(M, k), scales(M, triton.cdiv(k, bs))
        b, sb = codes(G, n, k), scales(G, triton.cdiv(n, bs), triton.cdiv(k, bs))
        ref = None
        for cfg in FWD:
            c = K.GroupedGemmFP8Config(*cfg)
            row = {"case": name, "cfg": cfg, "M": M, "N": n, "K": k, "G": G}
            try:
                fn = lambda: K.grouped_gemm_fp8_triton(a, sa, b, sb, args.mode, lens, offs, block_size=bs,  # noqa: E731
                                                       config=c)
                out = fn().float()
                ref = out if ref is None else ref
                row["snr_vs_first"] = snr_db(ref, out)
                row["ms"] = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
                row["tflops"] = 2 * M * n * k / row["ms"] / 1e9
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    for name, pp, q in vk_cases:
        x, sx = codes(pp, M), scales(pp, M // bs)
        y, sy = codes(q, M), scales(q, M // bs)
        ref = None
        for cfg in VK:
            c = K.GroupedGemmFP8Config(*cfg)
            row = {"case": name, "cfg": cfg, "M": M, "P": pp, "Q": q, "G": G}
            try:
                fn = lambda: K.grouped_gemm_fp8_variable_k_triton(x, sx, y, sy, args.mode, lens, offs,  # noqa: E731
                                                                  block_size=bs, config=c)
                out = fn().float()
                ref = out if ref is None else ref
                row["snr_vs_first"] = snr_db(ref, out)
                row["ms"] = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
                row["tflops"] = 2 * M * pp * q / row["ms"] / 1e9
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tune_grouped_fp8.json").write_text(json.dumps(rows, indent=1))
    for case in dict.fromkeys(r["case"] for r in rows):
        ok = [r for r in rows if r["case"] == case and "ms" in r]
        if ok:
            b = min(ok, key=lambda r: r["ms"])
            print(f"BEST {case}: {tuple(b['cfg'])} {b['tflops']:.0f} TFLOP/s (first {ok[0]['tflops']:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
