"""Where the time of an FP8 linear step goes: per-kernel GPU time (torch.profiler) of one forward +
backward of ``turbo.ops.gemm_fp8`` (quantization included) next to the BF16 ``torch.matmul`` step.

    PYTHONPATH=. python scripts/diag_fp8_linear.py --out /tmp/diag [--m 16384 --n 28672 --k 4096]

Prints, per granularity, the GPU time of each kernel of a step (summed over 5 steps, divided by
5) and the step's wall time; writes ``diag_fp8_linear.txt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402


def _profile(step, n: int = 5, top: int = 14) -> str:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    rows = []
    total = 0.0
    for e in prof.key_averages():
        t = e.device_time_total / n / 1e3  # ms per step
        if t <= 0:
            continue
        total += t
        rows.append((t, e.count // n, e.key[:110]))
    rows.sort(reverse=True)
    lines = [f"  {t:8.3f} ms  x{c:<3d} {k}" for t, c, k in rows[:top]]
    lines.append(f"  {total:8.3f} ms  GPU total per step")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--n", type=int, default=28672)
    p.add_argument("--k", type=int, default=4096)
    args = p.parse_args(argv)
    import triton

    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    dev = torch.device("cuda")
    m, n, k = args.m, args.n, args.k
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    out = [f"FP8 linear step M={m} N={n} K={k} on {torch.cuda.get_device_name()}"]

    def bf16_step():
        y = torch.matmul(x, w.t())
        y.backward(dy)

    steps = {"bf16 cuBLAS": (bf16_step, None)}
    for gran in ("TENSORWISE", "BLOCKWISE"):
        cfg = Float8QuantConfig(granularity=gran)
        for pin in (None, "TRITON"):
            def step(cfg=cfg):
                y = turbo.ops.gemm_fp8(x, w, trans_b=True, config=cfg)
                y.backward(dy)
            steps[f"{gran} {'default' if pin is None else pin}"] = (step, pin)
    for name, (fn, pin) in steps.items():
        GlobalBackendManager.reset()
        if pin is not None:
            GlobalBackendManager.set_gemm_backend(BackendType[pin], PrecisionType.FP8)
        try:
            ms = triton.testing.do_bench(lambda: (fn(), setattr(x, "grad", None), setattr(w, "grad", None)),
                                         warmup=20, rep=100, return_mode="median")
            out.append(f"\n== {name}: step {ms:.3f} ms ({6 * m * n * k / ms / 1e9:.0f} TFLOP/s)")
            out.append(_profile(lambda: (fn(), setattr(x, "grad", None), setattr(w, "grad", None))))
        except Exception as exc:
            out.append(f"\n== {name}: {type(exc).__name__}: {exc}"[:400])
        print("\n".join(out[-2:]), flush=True)
    GlobalBackendManager.reset()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "diag_fp8_linear.txt").write_text("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
