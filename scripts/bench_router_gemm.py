"""The fp32 router GEMM over 16-bit tokens, forward + backward: ``turbo.ops.router_logits`` (Triton,
reading x as it is) against torch's ``F.linear(x.float(), w)`` (an fp32 copy of x, cuBLAS SIMT GEMMs,
dx converted back), measured in the same run, with launch sweeps of the three kernels.

    PYTHONPATH=. python scripts/bench_router_gemm.py --out /tmp/router      # H200, ~30 s

Rows: (T, H, E) of the MoE layer benchmark's models at 16384 tokens; per row the ms of fwd+bwd for
both, their ratio, the relative error of logits / dx / dw against float64 for both (rows subsampled
for the float64 product), then each kernel's launch candidates (ms, ours only). Writes
``router_gemm.json`` under ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

SHAPES = [(16384, 7168, 32), (16384, 2048, 32), (16384, 4096, 8), (16384, 2880, 32)]  # DSv3, Qwen3, Mixtral, GPT-OSS
FWD = [(64, 32, 4), (128, 32, 4), (64, 64, 4), (32, 64, 4), (128, 32, 8), (128, 64, 8)]
DX = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (32, 128, 4), (128, 128, 8)]
DW = [(64, 64, 4, 512), (64, 128, 4, 512), (128, 64, 4, 512), (64, 64, 4, 1024), (64, 128, 8, 1024)]


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def _rel(a, ref) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import primus_turbo.pytorch as turbo
    from primus_turbo.triton.moe import router_gemm_kernel as K

    dev = torch.device("cuda")
    rows, table = [], []
    for t, h, e in SHAPES:
        g = torch.Generator(device=dev).manual_seed(t + h + e)
        x = torch.randn(t, h, device=dev, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(e, h, device=dev, generator=g) * 0.02).requires_grad_()
        gy = torch.randn(t, e, device=dev, generator=g)

        def ours():
            x.grad = w.grad = None
            turbo.ops.router_logits(x, w).backward(gy)

        def torch_path():
            x.grad = w.grad = None
            torch.nn.functional.linear(x.float(), w).backward(gy)

        ms_ours, ms_torch = _bench(ours), _bench(torch_path)
        # errors vs float64 on 2048 rows (dw over those rows only)
        xs = x.detach()[:2048]
        res = {}
        for name, f in (("ours", lambda a, b: turbo.ops.router_logits(a, b)),
                        ("torch", lambda a, b: torch.nn.functional.linear(a.float(), b))):
            a, b = xs.clone().requires_grad_(), w.detach().clone().requires_grad_()
            y = f(a, b)
            y.backward(gy[:2048])
            a64, b64 = xs.double().requires_grad_(), w.detach().double().requires_grad_()
            y64 = a64 @ b64.t()
            y64.backward(gy[:2048].double())
            res[name] = (_rel(y.detach(), y64.detach()), _rel(a.grad, a64.grad), _rel(b.grad, b64.grad))
        row = {"T": t, "H": h, "E": e, "ms_ours": ms_ours, "ms_torch": ms_torch, "speedup": ms_torch / ms_ours,
               "err_ours": res["ours"], "err_torch": res["torch"], "fwd": {}, "dx": {}, "dw": {}}
        xd, wd = x.detach(), w.detach()
        o = torch.empty(t, e, device=dev)
        for bt, bk, nw in FWD:
            row["fwd"][f"{bt}x{bk}x{nw}"] = _bench(lambda: K.router_fwd_launch(xd, wd, o, bt, bk, nw))
        dx = torch.empty_like(xd)
        for bt, bh, nw in DX:
            row["dx"][f"{bt}x{bh}x{nw}"] = _bench(lambda: K.router_dx_launch(gy, wd, dx, bt, bh, nw))
        for bt, bh, nw, rps in DW:
            part = torch.empty(-(-t // rps), e, h, device=dev)
            row["dw"][f"{bt}x{bh}x{nw}/{rps}"] = _bench(lambda: (K.router_dw_launch(gy, xd, part, rps, bt, bh, nw),
                                                                 part.sum(0)))
        rows.append(row)
        print(json.dumps(row), flush=True)
        best = {k: min(row[k].items(), key=lambda kv: kv[1]) for k in ("fwd", "dx", "dw")}
        table.append(f"| {t}x{h}x{e} | {ms_torch:.4f} | {ms_ours:.4f} | {ms_torch / ms_ours:.2f} | "
                     f"{res['torch'][0]:.1e} / {res['ours'][0]:.1e} | {res['torch'][2]:.1e} / {res['ours'][2]:.1e} | "
                     + " | ".join(f"{best[k][0]} {best[k][1]:.4f}" for k in ("fwd", "dx", "dw")) + " |")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    (out_dir / "router_gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{meta}")
    print("| T x H x E | torch fwd+bwd ms | ours ms | speedup | logits err torch / ours | dw err torch / ours "
          "| best fwd | best dx | best dw |")
    print("|---|---:|---:|---:|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
