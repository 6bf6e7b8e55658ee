"""Tile sweep of the Triton attention kernels on the GPU: forward, the dK/dV kernel and the dQ
kernel, per padded head dim (64, 128, 256), causal and not. For each candidate the kernel is
timed (``do_bench`` median) and its output checked against SDPA (SNR); the best candidate per
(head dim) over both mask kinds (geomean time) is printed as the line to paste into
``FWD_CONFIGS`` / ``BWD_CONFIGS``.

    PYTHONPATH=. python scripts/tune_attention.py --out /tmp/tune [--dims 128 64 256] [--quick]

The backward sweeps the dK/dV tiles with the dQ tiles fixed at the current default, then the dQ
tiles with the best dK/dV ones (the two kernels are independent launches).

``--bwd-variant atomic`` instead times the one-kernel backward with atomic dQ accumulation
(``PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ=1``) for each candidate tile of ATOMIC (or ``--atomic-tiles``)
against the two-kernel backward at the current BWD_CONFIGS and SDPA's FlashAttention-2 backward,
printing TFLOP/s, the speedups over both and the line for ``BWD_ATOMIC_CONFIGS``; no forward sweep:

    PYTHONPATH=. python scripts/tune_attention.py --out /tmp/tune_atomic --bwd-variant atomic [--dims 128]
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

# one-kernel (atomic dQ) backward tiles: (BLOCK_M, BLOCK_N, num_warps, num_stages)
ATOMIC = {
    64: [(64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2), (64, 64, 8, 3)],
    128: [(64, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 1), (128, 128, 8, 1), (64, 64, 8, 2),
          (32, 128, 4, 2)],
    256: [(64, 64, 8, 1), (32, 64, 4, 2), (64, 32, 4, 2), (32, 128, 8, 1), (64, 64, 8, 2), (64, 128, 8, 1)],
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
    p.add_argument("--bwd-variant", choices=("two", "atomic"), default="two",
                   help="two: the forward / dK/dV / dQ tile sweeps; atomic: time the one-kernel atomic-dQ "
                        "backward per tile against the two-kernel one (and SDPA)")
    p.add_argument("--atomic-tiles", nargs="+", default=None, metavar="M,N,WARPS,STAGES",
                   help="atomic tiles to time instead of the ATOMIC table, e.g. 64,128,8,2 128,64,8,2")
    args = p.parse_args(argv)
    if args.bwd_variant == "atomic":
        return _atomic_main(args)
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


def _inputs(d, causal, dev):
    """bf16 q, k, v, dout of SHAPES[d] and the fp32-math SDPA gradients (dq, dk, dv; GQA summed)."""
    b, s, hq, hk, dqk, dv = SHAPES[d]
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, s, hq, dqk, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hk, dqk, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, hk, dv, device=dev, dtype=torch.bfloat16, generator=g)
    dout = torch.randn(b, s, hq, dv, device=dev, dtype=torch.bfloat16, generator=g)
    rep = hq // hk
    qr, kr, vr = (t.float().transpose(1, 2).requires_grad_() for t in
                  (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=dqk ** -0.5)
    ref.backward(dout.float().transpose(1, 2))
    grads = (qr.grad.transpose(1, 2), kr.grad.transpose(1, 2).reshape(b, s, hk, rep, dqk).sum(3),
             vr.grad.transpose(1, 2).reshape(b, s, hk, rep, dv).sum(3))
    return (q, k, v, dout), grads


def _atomic_main(args) -> int:
    """``--bwd-variant atomic``: TFLOP/s of the one-kernel atomic-dQ backward per tile vs the two-kernel one."""
    import triton

    from primus_turbo.testing import snr_db
    from primus_turbo.triton.attention import flash_attn_bwd as B
    from primus_turbo.triton.attention import flash_attn_fwd as F

    dev = torch.device("cuda")
    results, best_lines = [], []
    t0 = time.time()

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=5, rep=args.rep_ms, return_mode="median")

    for d in args.dims:
        b, s, hq, hk, dqk, dv = SHAPES[d]
        tiles = ([tuple(int(x) for x in t.split(",")) for t in args.atomic_tiles] if args.atomic_tiles
                 else ATOMIC[d][:3] if args.quick else ATOMIC[d])
        default_atomic = B.BWD_ATOMIC_CONFIGS[d]
        times, two_times, sdpa_times = {}, [], []
        for causal in (False, True):
            (q, k, v, dout), ref = _inputs(d, causal, dev)
            scale = dqk ** -0.5
            wr = 0 if causal else -1
            out, lse = F.flash_attn_fwd_triton(q, k, v, None, scale, -1, wr)
            flops = _flops(b, s, hq, dqk, dv, causal, "bwd")

            def run(atomic):
                return B.flash_attn_bwd_triton(dout, q, k, v, out, lse, None, scale, -1, wr, deterministic=not atomic,
                                               atomic_dq=atomic)

            def record(row, fn, grads=True):
                try:
                    if grads:
                        for name, x, r in zip(("snr_dq", "snr_dk", "snr_dv"), fn(), ref):
                            row[name] = round(snr_db(r, x), 1)
                    row["ms"] = bench(fn)
                    row["tflops"] = round(flops / row["ms"] / 1e9, 1)
                except Exception as exc:  # out of shared memory / registers: skip the candidate
                    row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                results.append(row)
                print(json.dumps(row), flush=True)
                return row.get("ms")

            two_ms = record({"kernel": "bwd_two", "d": d, "causal": causal, "cfg": B.BWD_CONFIGS[d]},
                            lambda: run(False))
            two_times.append(two_ms)
            # SDPA's FlashAttention-2 backward (the peer of benchmarks/bench_attention.py, the 1.3x target's
            # baseline): enable_gqa, else k/v repeated to heads_q; a row with "error" if flash refuses the case
            from torch.nn.attention import SDPBackend, sdpa_kernel

            o = sdpa_fn = qt = kt = vt = sdpa_ms = None
            for gqa in ((True, False) if hq != hk else (False,)):
                rep_kv = (lambda t: t) if gqa or hq == hk else (lambda t: t.repeat_interleave(hq // hk, 2))  # noqa: E731
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, rep_kv(k), rep_kv(v)))
                try:
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                             scale=scale, enable_gqa=gqa)
                    break
                except Exception as exc:  # noqa: BLE001 - flash may refuse (GQA, head dim 192 != 128)
                    o, err = None, f"{type(exc).__name__}: {exc}"[:200]
            if o is not None:
                sdpa_fn = lambda: torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2),  # noqa: E731
                                                      retain_graph=True)
                sdpa_ms = record({"kernel": "bwd_sdpa_flash", "d": d, "causal": causal}, sdpa_fn, grads=False)
            else:
                print(json.dumps({"kernel": "bwd_sdpa_flash", "d": d, "causal": causal, "error": err}), flush=True)
            o = sdpa_fn = qt = kt = vt = None  # noqa: F841 - free the graph before the atomic runs
            sdpa_times.append(sdpa_ms)
            for cfg in tiles:
                B.BWD_ATOMIC_CONFIGS[d] = cfg
                row = {"kernel": "bwd_atomic", "d": d, "causal": causal, "cfg": cfg}
                ms = record(row, lambda: run(True))
                if ms is not None:
                    times.setdefault(cfg, []).append(ms)
                    if two_ms:
                        vs_sdpa = f", {sdpa_ms / ms:.3f}x SDPA flash" if sdpa_ms else ""
                        print(f"  d{d} causal={causal} atomic {cfg}: {row['tflops']} TFLOP/s, "
                              f"{two_ms / ms:.3f}x the two-kernel backward{vs_sdpa}", flush=True)
            B.BWD_ATOMIC_CONFIGS[d] = default_atomic
            q = k = v = dout = ref = out = lse = None  # free before the next mask kind's inputs
            torch.cuda.empty_cache()
        full = {c: t for c, t in times.items() if len(t) == 2}
        geo = lambda ts: math.exp(sum(map(math.log, ts)) / len(ts))  # noqa: E731
        if full and all(two_times):
            best = min(full, key=lambda c: geo(full[c]))
            vs_sdpa = (f", {geo(sdpa_times) / geo(full[best]):.3f}x SDPA flash" if all(sdpa_times) else "")
            line = (f"d{d}: atomic {best}  {geo(two_times) / geo(full[best]):.3f}x the two-kernel backward"
                    f"{vs_sdpa} (geomean over causal and not)  ({time.time() - t0:.0f} s)")
        else:
            line = f"d{d}: atomic: no tile ran with both mask kinds"
        best_lines.append(line)
        print("BEST " + line, flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tune_attention_atomic.json").write_text(
            json.dumps({"results": results, "best": best_lines}, indent=1))
    print("\n".join(best_lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
