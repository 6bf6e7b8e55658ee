"""Router GEMM benchmark: ``turbo.ops.router_gating_linear`` (fp32 router weight over bf16 tokens,
the fused bf16x3-split kernels) against the PyTorch expression it replaces (``x.float() @ W^T``,
fp32 backward GEMMs; ``PRIMUS_TURBO_ROUTER_GEMM_FUSED=0``), timed interleaved in one process.

    PYTHONPATH=. python benchmarks/bench_router_gemm.py [--tokens 16384] [--rounds 5] [--sweep]

Cases: the MoE layer benchmark's router shapes (``T`` tokens, hidden ``H``, ``E`` local experts)
plus DeepSeek-V3 with all 256 experts. Per case: forward ms and forward+backward ms of both, their
ratio (``speedup`` = PyTorch ms / fused ms), and the fused forward's bytes (the bf16 tokens read,
the fp32 logits written) over a device copy's rate measured in the same run. Accuracy (reported):
the relative errors of the logits, of the weight gradient and of the (bf16) grad_input against
float64, for both.

``--sweep``: each kernel alone over a few tilings (GPT-OSS-20B and DeepSeek-V3 with 256 experts),
device time from CUDA graphs, printed best-first, to check the defaults; the default launches also
with do_bench (host time included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.common import Row, bench_ms, finish_run, gpu_info, time_interleaved  # noqa: E402

RESULT_NAME = "router_gemm"
_VAR = "PRIMUS_TURBO_ROUTER_GEMM_FUSED"
CASES = [  # (name, H, E)
    ("DeepSeek-V3 (32 local)", 7168, 32),
    ("DeepSeek-V3 (256)", 7168, 256),
    ("Qwen3-30B-A3B", 2048, 32),
    ("Mixtral-8x7B", 4096, 8),
    ("GPT-OSS-20B", 2880, 32),
]
_SWEEP = ("GPT-OSS-20B", "DeepSeek-V3 (256)")


class _Env:
    def __init__(self, value: str):
        self.value = value

    def __call__(self):
        return self

    def __enter__(self):
        self.prev = os.environ.get(_VAR)
        os.environ[_VAR] = self.value

    def __exit__(self, *exc):
        if self.prev is None:
            os.environ.pop(_VAR, None)
        else:
            os.environ[_VAR] = self.prev


def _accuracy(x, w, g):
    import primus_turbo.pytorch as turbo
    from primus_turbo.testing import rel_err

    x64, w64 = x.detach().double(), w.detach().double()
    ry = x64 @ w64.t()
    rdw = g.double().t() @ x64
    rdx = g.double() @ w64
    out = {}
    for tag, val in (("fused", "1"), ("torch", "0")):
        with _Env(val)():
            xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = turbo.ops.router_gating_linear(xl, wl)
            y.backward(g)
        out[tag] = dict(y_rel=rel_err(ry, y), dw_rel=rel_err(rdw, wl.grad), dx_rel=rel_err(rdx, xl.grad))
    return out


def run_case(name, t, h, e, rounds, warmup, rep):
    import primus_turbo.pytorch as turbo

    dev = torch.device("cuda")
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    w = torch.randn(e, h, device=dev) * h**-0.5
    g = torch.randn(t, e, device=dev) * 1e-3
    acc = _accuracy(x, w, g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    copy_dst = torch.empty_like(x)

    def fwd():
        return turbo.ops.router_gating_linear(xr, wr)

    def step():
        turbo.ops.router_gating_linear(xr, wr).backward(g)

    steps = {
        "copy": (lambda: copy_dst.copy_(x), _Env("1")),
        "fused-fwd": (fwd, _Env("1")), "torch-fwd": (fwd, _Env("0")),
        "fused-step": (step, _Env("1")), "torch-step": (step, _Env("0")),
    }
    times, errors = time_interleaved(steps, rounds, warmup, rep, grads=[xr, wr])
    ms = {k: statistics.median(v) for k, v in times.items()}
    copy_gbps = 2 * x.numel() * 2 / (ms["copy"] * 1e-3) / 1e9
    fwd_bytes = x.numel() * 2 + t * e * 4
    rows = []
    for kind in ("fwd", "step"):
        r = Row(op="router_gemm", case=f"{name} T={t} H={h} E={e} {kind}", impl="turbo-fused",
                baseline="torch-fp32-expression", ms=ms.get(f"fused-{kind}"), baseline_ms=ms.get(f"torch-{kind}"))
        r.extra.update(accuracy=acc, errors=errors, copy_gbps=copy_gbps)
        if kind == "fwd" and r.ms:
            r.gbps = fwd_bytes / (r.ms * 1e-3) / 1e9
            r.extra["fwd_vs_copy"] = r.gbps / copy_gbps
        rows.append(r.finalize())
    return rows


def sweep(t, h, e, rep):
    """Each kernel alone, device time (CUDA graphs, host excluded), over a few tilings; the
    defaults also with do_bench (host included), which shows when a launch is host-bound."""
    from benchmarks.common import set_timing
    from primus_turbo.triton.moe import router_gemm_kernel as k

    dev = torch.device("cuda")
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    w = torch.randn(e, h, device=dev) * h**-0.5
    g = torch.randn(t, e, device=dev)
    res = []

    def _time(kern, kw, fn):
        try:
            res.append((kern, kw, bench_ms(fn, 10, rep)))
        except Exception as exc:  # a tiling past the shared memory, say
            res.append((kern, kw, float("inf")))
            print(f"  {kern} {kw}: {type(exc).__name__}", flush=True)

    for kern, fn in (("fwd", lambda: k.router_fwd_launch(x, w)), ("dx", lambda: k.router_dx_launch(g, w)),
                     ("dw", lambda: k.router_dw_launch(x, g).sum(0))):
        _time(kern + "-eager-default", {}, fn)
    set_timing("graph")
    try:
        for kern, fn in (("fwd", lambda: k.router_fwd_launch(x, w)), ("dx", lambda: k.router_dx_launch(g, w)),
                         ("dw", lambda: k.router_dw_launch(x, g).sum(0))):
            _time(kern + "-graph-default", {}, fn)
        for bt in (64, 128):
            for be in sorted({min(64, max(16, e)), min(128, max(16, e))}):
                for nw in (4, 8):
                    kw = dict(bt=bt, bk=64, be=be, num_warps=nw)
                    _time("fwd", kw, lambda: k.router_fwd_launch(x, w, **kw))
        for bt in (32, 64, 128):
            for bh in (64, 128):
                for nw in (4, 8):
                    kw = dict(bt=bt, bh=bh, num_warps=nw)
                    _time("dx", kw, lambda: k.router_dx_launch(g, w, **kw))
        for bh in (64, 128):
            for nw in (4, 8):
                for per_sm in (1, 2, 4):
                    kw = dict(bh=bh, bt=64, num_warps=nw, progs_per_sm=per_sm)
                    _time("dw", kw, lambda: k.router_dw_launch(x, g, **kw).sum(0))
    finally:
        set_timing("do_bench")
    for kern in ("fwd-eager-default", "fwd-graph-default", "dx-eager-default", "dx-graph-default",
                 "dw-eager-default", "dw-graph-default", "fwd", "dx", "dw"):
        best = sorted((r for r in res if r[0] == kern), key=lambda r: r[2])
        print(f"  {kern}: " + "; ".join(f"{r[2] * 1e3:.1f}us {r[1]}" for r in best[:4]), flush=True)
    return [dict(kernel=r[0], config=r[1], ms=r[2]) for r in res]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup-ms", type=float, default=25)
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    # run_all passes every benchmark's options: the ones this one does not know are ignored
    args, _ = p.parse_known_args(argv)
    if not torch.cuda.is_available():
        print("bench_router_gemm: skipped (it times GPU kernels against cuBLAS; no CUDA device)", flush=True)
        return 0
    info = gpu_info()
    print(f"router GEMM, T={args.tokens}, {info.get('name')}", flush=True)
    rows = []
    for name, h, e in CASES:
        sw = None
        if args.sweep and name in _SWEEP:
            print(f"sweep {name}", flush=True)
            sw = sweep(args.tokens, h, e, 30)
        case_rows = run_case(name, args.tokens, h, e, args.rounds, args.warmup_ms, args.rep_ms)
        if sw is not None:
            case_rows[0].extra["sweep"] = sw
        rows.extend(case_rows)
    print(f"{'case':<52} {'fused ms':>9} {'torch ms':>9} {'x':>6}  fwd/copy  rel err (fused y, dw, dx | torch)")
    for r in rows:
        a = r.extra["accuracy"]
        fc = r.extra.get("fwd_vs_copy")
        print(f"{r.case:<52} {r.ms or float('nan'):9.4f} {r.baseline_ms or float('nan'):9.4f} "
              f"{r.speedup or float('nan'):6.2f}  {'' if fc is None else f'{fc:.2f}':>8}  "
              f"{a['fused']['y_rel']:.1e} {a['fused']['dw_rel']:.1e} {a['fused']['dx_rel']:.1e} | "
              f"{a['torch']['y_rel']:.1e} {a['torch']['dw_rel']:.1e} {a['torch']['dx_rel']:.1e}")
    finish_run(rows, args.out, RESULT_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
