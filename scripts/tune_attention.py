"""Tile sweep of the Triton attention kernels on the GPU: forward, the dK/dV kernel and the dQ
kernel, per padded head dim (64, 128, 256), causal and not. For each candidate the kernel is
timed (``do_bench`` median) and its output checked against SDPA (SNR); the best candidate per
(head dim) over both mask kinds (geomean time) is printed as the line to paste into
``FWD_CONFIGS`` / ``BWD_CONFIGS``.

    PYTHONPATH=. python scripts/tune_attention.py --out /tmp/tune [--dims 128 64 256] [--quick]

The backward sweeps the dK/dV tiles with the dQ tiles fixed at the current default, then the dQ
tiles with the best dK/dV ones (the two kernels are independent launches).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

# (batch, seq, heads_q, heads_kv, d_qk, d_v) per padded head dim
SHAPES = {64: (4, 4096, 32, 8, 64, 64), 128: (4, 4096, 32, 8, 128, 128), 256: (1, 4096, 32, 32, 192, 128)}
FWD = {
    64: [(128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 8, 3)],
    128: [(128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2), (128, 64, 8, 2)],
}
DKDV = {
    64: [(64, 64, 4, 2), (32, 128, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3)],
    128: [(64, 64, 8, 1), (32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3)],
    256: [(32, 32, 4, 1), (32, 64, 4, 2), (64, 64, 8, 1), (32, 64, 8, 2), (16, 64, 4, 2)],
}
FP8_FWD = {
    64: [(128, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 128, 4, 3)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
}
DQ = {
    64: [(64, 64, 4, 2), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
    128: [(64, 64, 8, 1), (128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3)],
    256: [(32, 32, 4, 1), (64, 32, 4, 2), (64, 64, 8, 1), (64, 32, 8, 2)],
}


def _flops(b, s, hq, dqk, dv, causal, mode):
    f = 2.0 * b * hq * s * s * (dqk + dv) * (0.5 if causal else 1.0)
    return f * (2.5 if mode == "bwd" else 1.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dims", type=int, nargs="+", default=[128, 64, 256])
    p.add_argument("--quick", action="store_true", help="fewer candidates (the first three of each list)")
    p.add_argument("--rep-ms", type=float, default=30)
    p.add_argument("--fp8", action="store_true", help="also sweep the FP8 forward kernel's tiles")
    p.add_argument("--no-bwd", action="store_true", help="skip the backward sweeps")
    args = p.parse_args(argv)
    import triton

    from primus_turbo.testing import snr_db
    from primus_turbo.triton.attention import flash_attn_bwd as B
    from primus_turbo.triton.attention import flash_attn_fp8 as F8
    from primus_turbo.triton.attention import flash_attn_fwd as F

    dev = torch.device("cuda")
    results = []
    best_lines = []
    t0 = time.time()

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=5, rep=args.rep_ms, return_mode="median")

    for d in args.dims:
        b, s, hq, hk, dqk, dv = SHAPES[d]
        cut = (lambda xs: xs[:3]) if args.quick else (lambda xs: xs)
        fwd_t, dkdv_t, dq_t, fp8_t = {}, {}, {}, {}
        default_bwd = B.BWD_CONFIGS[d]
        for causal in (False, True):
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(b, s, hq, dqk, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(b, s, hk, dqk, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(b, s, hk, dv, device=dev, dtype=torch.bfloat16, generator=g)
            dout = torch.randn(b, s, hq, dv, device=dev, dtype=torch.bfloat16, generator=g)
            scale = dqk ** -0.5
            wr = 0 if causal else -1
            # reference: fp32 math SDPA of the same bf16 inputs (GQA by repeating kv heads)
            rep = hq // hk
            qr, kr, vr = (t.float().transpose(1, 2).requires_grad_() for t in
                          (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=scale)
            ref.backward(dout.float().transpose(1, 2))
            ref_out = ref.detach().transpose(1, 2)
            ref_dq = qr.grad.transpose(1, 2)
            ref_dk = kr.grad.transpose(1, 2).reshape(b, s, hk, rep, dqk).sum(3)
            del qr, kr, vr, ref
            out, lse = F.flash_attn_fwd_triton(q, k, v, None, scale, -1, wr)
            for cfg in cut(FWD[d]):
                F.FWD_CONFIGS[d] = cfg
                row = {"kernel": "fwd", "d": d, "causal": causal, "cfg": cfg}
                try:
                    o, _ = F.flash_attn_fwd_triton(q, k, v, None, scale, -1, wr)
                    row["snr"] = snr_db(ref_out, o)
                    row["ms"] = bench(lambda: F.flash_attn_fwd_triton(q, k, v, None, scale, -1, wr))
                    row["tflops"] = _flops(b, s, hq, dqk, dv, causal, "fwd") / row["ms"] / 1e9
                    fwd_t.setdefault(cfg, []).append(row["ms"])
                except Exception as exc:  # out of shared memory / registers: skip the candidate
                    row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                results.append(row)
                print(json.dumps(row), flush=True)
            F.FWD_CONFIGS[d] = FWD[d][0]
            if args.fp8:
                blk = 128
                q8, qsi = F8.quantize_tokens_fp8(q, blk)
                k8, ksi = F8.quantize_tokens_fp8(k, blk)
                v8, vsi = F8.quantize_tokens_fp8(v, blk, transpose_sd=True)

                def run_fp8():
                    return F8.flash_attn_fp8_fwd_triton(q8, k8, v8, qsi, ksi, vsi, blk, None, scale, -1, wr)

                for cfg in cut(FP8_FWD[d]):
                    F8.FP8_FWD_CONFIGS[d] = cfg
                    row = {"kernel": "fp8_fwd", "d": d, "causal": causal, "cfg": cfg}
                    try:
                        row["snr"] = snr_db(ref_out, run_fp8()[0])
                        row["ms"] = bench(run_fp8)
                        row["tflops"] = _flops(b, s, hq, dqk, dv, causal, "fwd") / row["ms"] / 1e9
                        fp8_t.setdefault(cfg, []).append(row["ms"])
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    results.append(row)
                    print(json.dumps(row), flush=True)
                F8.FP8_FWD_CONFIGS[d] = FP8_FWD[d][0]
            if args.no_bwd:
                continue

            def run_bwd():
                return B.flash_attn_bwd_triton(dout, q, k, v, out, lse, None, scale, -1, wr)

            for which, cands in (("dkdv", cut(DKDV[d])), ("dq", cut(DQ[d]))):
                for cfg in cands:
                    fixed_dkdv = default_bwd[0]
                    if which == "dq" and dkdv_t:
                        fixed_dkdv = min(dkdv_t, key=lambda c: sum(map(math.log, dkdv_t[c])))
                    B.BWD_CONFIGS[d] = (cfg, default_bwd[1]) if which == "dkdv" else (fixed_dkdv, cfg)
                    row = {"kernel": which, "d": d, "causal": causal, "cfg": cfg, "with": B.BWD_CONFIGS[d]}
                    try:
                        dq_, dk_, _, _ = run_bwd()
                        row["snr_dq"] = snr_db(ref_dq, dq_)
                        row["snr_dk"] = snr_db(ref_dk, dk_)
                        row["ms"] = bench(run_bwd)
                        row["tflops"] = _flops(b, s, hq, dqk, dv, causal, "bwd") / row["ms"] / 1e9
                        (dkdv_t if which == "dkdv" else dq_t).setdefault(cfg, []).append(row["ms"])
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    results.append(row)
                    print(json.dumps(row), flush=True)
                B.BWD_CONFIGS[d] = default_bwd
            torch.cuda.empty_cache()

        def best(times):
            full = {c: t for c, t in times.items() if len(t) == 2}  # ran with both mask kinds
            return min(full, key=lambda c: sum(map(math.log, full[c]))) if full else None

        line = (f"d{d}: fwd {best(fwd_t)}  dkdv {best(dkdv_t)}  dq {best(dq_t)}  fp8_fwd {best(fp8_t)}"
                f"  ({time.time() - t0:.0f} s)")
        best_lines.append(line)
        print("BEST " + line, flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tune_attention.json").write_text(json.dumps({"results": results, "best": best_lines},
                                                                       indent=1))
    print("\n".join(best_lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
