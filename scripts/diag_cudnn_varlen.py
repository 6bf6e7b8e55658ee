#!/usr/bin/env python3
"""Probe: does ``torch.ops.aten._cudnn_attention_forward`` with ragged offsets (packed THD q/k/v,
int32 ``cu_seqlens`` on the device, no host sync) run on this torch / GPU, agree with our varlen
forward, and how fast is it? A candidate vendor backend for ``flash_attn_varlen_func``; this
torch build's own ``torch.nn.attention.varlen`` keeps it switched off, so it is only probed here.

    PYTHONPATH=. python scripts/diag_cudnn_varlen.py [--out DIR]

For each pack (16384 tokens) and head configuration: the cuDNN ragged forward with the k/v heads as
given (GQA) and with k/v repeated to the query heads (MHA), our default varlen forward, SNR of
each against ours, TFLOP/s.
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

PACKS = {"uniform2048": [2048] * 8, "mixed": [128, 256, 512, 1024] * 8, "2048-64-64-64": [2048, 64, 64, 64] * 7}
HEADS = ((32, 8, 128), (64, 8, 64))


def _snr(ref, out) -> float:
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum().clamp_min(1e-300)))


def _flops(lens, h, d, causal) -> float:
    f = sum(4.0 * n * n * h * d for n in lens)
    return f / 2 if causal else f


def main(argv=None) -> int:
    import triton

    import primus_turbo.pytorch as turbo

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for pack, lens in PACKS.items():
        lens = lens[: max(1, len(lens))]
        total = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
        mx = max(lens)
        for hq, hk, d in HEADS:
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(total, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(total, hk, d, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(total, hk, d, device=dev, dtype=torch.bfloat16, generator=g)
            krep, vrep = (t.repeat_interleave(hq // hk, dim=1).contiguous() for t in (k, v))
            for causal in (False, True):
                case = f"{pack} {hq}/{hk} d{d} {'causal' if causal else 'full'}"
                ours = lambda: turbo.ops.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal)  # noqa: E731
                ref = ours()
                fl = _flops(lens, hq, d, causal)
                cands = {
                    "ours": ours,
                    "cudnn-gqa": lambda: torch.ops.aten._cudnn_attention_forward(
                        q, k, v, None, cu, cu, mx, mx, False, 0.0, causal, False, scale=d ** -0.5)[0],
                    "cudnn-mha": lambda: torch.ops.aten._cudnn_attention_forward(
                        q, krep, vrep, None, cu, cu, mx, mx, False, 0.0, causal, False, scale=d ** -0.5)[0],
                }
                for name, fn in cands.items():
                    row = {"case": case, "impl": name}
                    try:
                        out = fn()
                        torch.cuda.synchronize()
                        row["shape"] = list(out.shape)
                        row["snr_vs_ours"] = _snr(ref, out.reshape(ref.shape)) if out.numel() == ref.numel() else None
                        ms = float(triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median"))
                        row.update(ms=ms, tflops=fl / ms * 1e-9)
                    except Exception as exc:  # a probe: report and go on
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
                    print(row, flush=True)
    print(f"\n{'case':36s} {'impl':10s} {'TFLOP/s':>8s} {'SNR vs ours':>12s}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:36s} {r['impl']:10s} ERROR {r['error'][:70]}")
        else:
            snr = "-" if r.get("snr_vs_ours") is None else f"{r['snr_vs_ours']:.1f}"
            print(f"{r['case']:36s} {r['impl']:10s} {r['tflops']:8.1f} {snr:>12s}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "diag_cudnn_varlen.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
