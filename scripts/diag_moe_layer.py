"""Where the time of a MoE layer step goes: per-kernel GPU time (torch.profiler) of one
forward + backward of ``turbo.modules.MoELayer`` in BF16 and with FP8 BLOCKWISE experts, and the
step's wall time (``do_bench`` median) next to its GPU total (a gap means host-bound launches).

    PYTHONPATH=. python scripts/diag_moe_layer.py --out /tmp/diag [--tokens 8192 --hidden 7168 --ffn 2048 --experts 32 --topk 8] [--gaps] [--host]

Writes ``diag_moe_layer.txt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_fp8_linear import _profile  # noqa: E402
from scripts.diag_grouped import _cprofile, _host_us  # noqa: E402


def _host_profile(step, steps: int = 3, top: int = 30) -> str:
    """Host time per step: ``steps`` steps issued back to back after a sync, timed on the host
    without waiting for the GPU (a few hundred launches fit the launch queue, so the host does not
    block), then a cProfile of the same (by own and by cumulative time): where the Python of a step goes."""
    host_ms = _host_us(step, steps) / 1e3
    text = _cprofile(step, steps, top, sorts=("tottime", "cumulative"))
    text = "\n".join(line[:200] for line in text.splitlines() if line.strip())
    return f"   host {host_ms:.3f} ms per step (no sync; {steps} steps)\n" + text


def _gaps(step, reps: int = 3, top: int = 12, min_gap_us: float = 5.0) -> str:
    """GPU idle time inside a step as ``do_bench`` times it (an L2 flush of 256 MB, then the step,
    no sync between repetitions): from a CUDA-activity trace, per step window (end of the flush to
    the end of the step's last kernel), the idle total, the time to the first kernel, and the
    largest gaps with the kernel that ended each (idle while the host was still issuing)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(3):
        cache.zero_()
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            cache.zero_()
            step()
        torch.cuda.synchronize()
    kern = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA), key=lambda x: x[0])
    flush = [i for i, (a, b, n) in enumerate(kern) if "Fill" in n and b - a > 30]
    lines = []
    for w, i0 in enumerate(flush):
        i1 = flush[w + 1] if w + 1 < len(flush) else len(kern)
        ks = kern[i0 + 1:i1]
        if not ks:
            continue
        t0, t_end = kern[i0][1], max(b for _, b, _ in ks)
        busy, cur_a, cur_b, gaps = 0.0, ks[0][0], ks[0][1], []
        prev_end, prev_name = t0, "(flush)"
        for a, b, n in ks:
            if a - prev_end >= min_gap_us:
                gaps.append((a - prev_end, a - t0, prev_name[:70], n[:70]))
            if a > cur_b:
                busy += cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
            if b >= prev_end:
                prev_end, prev_name = b, n
        busy += cur_b - cur_a
        span = t_end - t0
        lines.append(f"   step {w}: span {span / 1e3:.3f} ms, GPU busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms,"
                     f" first kernel after {(ks[0][0] - t0):.0f} us, {len(ks)} kernels")
        if w == 0:
            for g, at, after, before in sorted(gaps, reverse=True)[:top]:
                lines.append(f"      gap {g:7.1f} us at {at / 1e3:7.3f} ms after {after} | before {before}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--host", action="store_true",
                   help="also the host (Python + launch) time per step and a cProfile of it")
    p.add_argument("--only", nargs="+", default=None, help="subset of: bf16 fp8")
    p.add_argument("--gaps", action="store_true",
                   help="also the GPU idle time inside a do_bench-style step (flush, step) and its largest gaps")
    args = p.parse_args(argv)
    import triton

    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    dev = torch.device("cuda")
    t, h, f, e, k = args.tokens, args.hidden, args.ffn, args.experts, args.topk
    flops = 18 * t * k * h * f
    out = [f"MoE layer step T={t} H={h} F={f} E={e} topk={k} on {torch.cuda.get_device_name()}"]
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    configs = {"bf16": None, "fp8 BLOCKWISE": Float8QuantConfig(granularity="BLOCKWISE", block_size=128)}
    if args.only:
        configs = {n: c for n, c in configs.items() if n.split()[0] in args.only}
    for name, cfg in configs.items():
        layer = turbo.modules.MoELayer(h, f, e, k, score_function="softmax", router_dtype=torch.float32,
                                       config=cfg, dtype=torch.bfloat16, device=dev)

        def step(layer=layer):
            layer(x, num_out_tokens=t * k).backward(dy)
            x.grad = None
            for prm in layer.parameters():
                prm.grad = None

        try:
            ms = triton.testing.do_bench(step, warmup=20, rep=100, return_mode="median")
            out.append(f"\n== {name}: step {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s expert GEMMs)")
            out.append(_profile(step, top=24))
            if args.gaps:
                out.append(_gaps(step))
            if args.host:
                out.append(_host_profile(step))
        except Exception as exc:
            out.append(f"\n== {name}: {type(exc).__name__}: {exc}"[:400])
        print("\n".join(out[-2:]), flush=True)
        del layer
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "diag_moe_layer.txt").write_text("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
