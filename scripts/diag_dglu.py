"""The fused fc2 grad_input + gated-activation backward Gluon kernel
(triton/grouped_gemm/grouped_gemm_dglu_gluon.py) against its composition (the 16-bit Gluon grouped
grad_input, then the activation backward kernel): bit-equality of dh, dprobs within fp32 summation
order, and the time of each at MoE-layer shapes, per config.

    PYTHONPATH=. python scripts/diag_dglu.py [--out DIR] [--configs "block_n=128" "block_n=256,stages=3" ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from primus_turbo.triton.activation.swiglu_kernel import glu_bwd_launch  # noqa: E402
from primus_turbo.triton.grouped_gemm import grouped_gemm_dglu_gluon as dg  # noqa: E402
from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg  # noqa: E402

# (name, experts, routed rows, H, F): the MoE layer's 16384-token shapes
SHAPES = [("Mixtral-8x7B", 8, 32768, 4096, 14336), ("DeepSeek-V3", 32, 131072, 7168, 2048),
          ("GPT-OSS-20B", 32, 65536, 2880, 2880), ("Qwen3-30B-A3B", 128, 131072, 2048, 768)]


def _operands(G, M, H, F, seed=0, unbalanced=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if unbalanced:
        w = torch.rand(G, generator=gen, device="cuda") + 0.1
        lens = (w / w.sum() * (M - 37)).long()
    else:
        lens = torch.full((G,), (M - 37) // G, dtype=torch.long, device="cuda")
    offs = torch.zeros(G + 1, dtype=torch.long, device="cuda")
    offs[1:] = lens.cumsum(0)
    dy = torch.randn(M, H, generator=gen, device="cuda").bfloat16()
    w2 = (torch.randn(G, H, F, generator=gen, device="cuda") / F ** 0.5).bfloat16()
    h = torch.randn(M, 2 * F, generator=gen, device="cuda").bfloat16()
    probs = torch.rand(M, generator=gen, device="cuda") + 0.1
    mask = (torch.arange(M, device="cuda") < offs[-1]).to(torch.uint8)
    mask[::11] = 0
    return dy, w2, h, offs, probs, mask


def _composition(dy, w2, h, offs, probs, mask, act):
    d = gg.grouped_gemm_gluon(dy, w2, offs, checked=True)
    return glu_bwd_launch(d, h, act, probs, mask)


def _time(fn, iters=20):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", nargs="*", default=["block_n=128", "block_n=128,stages=5", "block_n=256",
                                                     "block_n=256,stages=3"])
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--one-check", action="store_true", help="one small correctness case per config")
    args = ap.parse_args()
    cfgs = [dg.GluonDGLUConfig(**eval(f"dict({c})")) for c in args.configs]
    rows = []
    # correctness at small shapes: every config, balanced / unbalanced, both activations
    cases = [(3, 1000, 136, 200), (5, 2000, 512, 768), (8, 700, 256, 2880 // 8)]
    for cfg in ([] if args.no_checks else cfgs):
        for (G, M, H, F) in (cases[1:2] if args.one_check else cases):
            for unb in ((True,) if args.one_check else (False, True)):
                for act in ((0,) if args.one_check else (0, 1)):
                    dy, w2, h, offs, probs, mask = _operands(G, M, H, F, unbalanced=unb)
                    dh, dp = dg.grouped_gemm_dglu_gluon(dy, w2, h, offs, probs, mask, ["swiglu", "geglu"][act],
                                                        config=cfg)
                    rh, rp = _composition(dy, w2, h, offs, probs, mask, act)
                    eq = torch.equal(dh, rh)
                    dpe = (dp.sum(0) - rp.sum(0)).abs().max().item() / max(rp.sum(0).abs().max().item(), 1e-9)
                    ok = eq and dpe < 1e-5
                    print(f"check {cfg.short()} G{G} M{M} H{H} F{F} unb={unb} act={act}: dh equal {eq}, "
                          f"dprobs rel err {dpe:.2e} {'ok' if ok else 'FAIL'}", flush=True)
                    rows.append(dict(kind="check", config=cfg.short(), G=G, M=M, H=H, F=F, unbalanced=unb, act=act,
                                     dh_equal=eq, dp_rel=dpe, ok=ok))
    for name, G, M, H, F in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        dy, w2, h, offs, probs, mask = _operands(G, M, H, F)
        t_gemm = _time(lambda: gg.grouped_gemm_gluon(dy, w2, offs, checked=True))
        d = gg.grouped_gemm_gluon(dy, w2, offs, checked=True)
        t_glu = _time(lambda: glu_bwd_launch(d, h, 0, probs, mask))
        t_comp = _time(lambda: _composition(dy, w2, h, offs, probs, mask, 0))
        flops = 2.0 * M * H * F
        for cfg in cfgs:
            t = _time(lambda: dg.grouped_gemm_dglu_gluon(dy, w2, h, offs, probs, mask, "swiglu", config=cfg,
                                                         checked=True))
            r = dict(kind="time", shape=name, G=G, M=M, H=H, F=F, config=cfg.short(), fused_ms=t, comp_ms=t_comp,
                     gemm_ms=t_gemm, glu_bwd_ms=t_glu, speedup=t_comp / t, fused_tflops=flops / t / 1e9,
                     gemm_tflops=flops / t_gemm / 1e9)
            rows.append(r)
            torch.cuda.synchronize()
            print(f"time {name} {cfg.short()}: fused {t:.3f} ms ({r['fused_tflops']:.0f} TFLOP/s) | composition "
                  f"{t_comp:.3f} (gemm {t_gemm:.3f} = {r['gemm_tflops']:.0f} TFLOP/s, glu bwd {t_glu:.3f}) | "
                  f"x{r['speedup']:.3f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, f"diag_dglu_{os.getpid()}.json").write_text(json.dumps(dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1))
    bad = [r for r in rows if r["kind"] == "check" and not r["ok"]]
    print(f"checks: {sum(r['kind'] == 'check' for r in rows) - len(bad)} ok, {len(bad)} failed")


if __name__ == "__main__":
    main()
