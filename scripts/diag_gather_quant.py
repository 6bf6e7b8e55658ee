"""The grouped FP8 wgrad token copy (gather + 128 x 1 quantization + transposed store) on the GPU:
the Hopper Gluon kernel's launch configs against the tl kernel, bit-checked, timed next to the
device copy of the same tensor (ratio = bytes moved per second / the copy's).

    PYTHONPATH=. python scripts/diag_gather_quant.py [--out DIR] [--configs 4,8,4 4,8,2 ...]

Shapes: the MoE layers' wgrad operands at 16384 tokens (GPT-OSS-20B, Mixtral-8x7B, DeepSeek-V3).
Writes ``diag_gather_quant.txt`` (and prints it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

# (name, rows M = tokens x topk, columns, experts)
SHAPES = [
    ("GPT-OSS x / a", 65536, 2880, 32),
    ("GPT-OSS dh", 65536, 5760, 32),
    ("Mixtral x / dy", 32768, 4096, 8),
    ("Mixtral a", 32768, 14336, 8),
    ("Mixtral dh", 32768, 28672, 8),
    ("DeepSeek-V3 x", 131072, 7168, 32),
    ("DeepSeek-V3 dh", 131072, 4096, 32),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--configs", nargs="+", default=["4,8,4", "4,8,2", "2,8,4", "4,4,4", "8,8,4", "2,8,8", "4,8,8"])
    p.add_argument("--only", nargs="+", default=None, help="substrings of shape names")
    args = p.parse_args(argv)
    import triton

    from primus_turbo.pytorch.backends.grouped_gemm_fp8 import padded_group_layout
    from primus_turbo.triton.quantization.gather_quant_gluon import GluonGatherQuantConfig, gather_quant_cols_t_gluon
    from primus_turbo.triton.quantization.gather_quant_kernel import gather_quant_cols_t_launch

    dev = torch.device("cuda")
    dt = torch.float8_e4m3fn
    cfgs = [GluonGatherQuantConfig(*map(int, c.split(","))) for c in args.configs]
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
             "ms (x copy: bytes per second / the device copy's); 'ok' = bytes equal the tl kernel's"]
    head = f"{'shape':<16} {'M x C':>13} {'copy':>7} {'tl':>14}" + "".join(f" {'g' + str(tuple(c)):>16}" for c in cfgs)
    lines.append(head)
    print("\n".join(lines), flush=True)
    for name, m, c, g in SHAPES:
        if args.only and not any(s in name for s in args.only):
            continue
        torch.manual_seed(0)
        x = torch.randn(m, c, device=dev, dtype=torch.bfloat16)
        lens = torch.full((g,), m // g, dtype=torch.int64)
        lens[: g // 2] += 37  # unbalanced, segments not multiples of 128
        lens[g // 2:] -= 37
        offs = torch.zeros(g + 1, dtype=torch.int64, device=dev)
        offs[1:] = torch.cumsum(lens.to(dev), 0)
        src, _ = padded_group_layout(offs, m, 128)
        m_pad = src.numel()
        ref_q, ref_s = gather_quant_cols_t_launch(x, src, dt, 128, gluon=False)
        y = torch.empty_like(x)
        t_copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=60, return_mode="median")
        copy_bps = 2 * x.numel() * 2 / t_copy
        moved = x.numel() * 2 + c * m_pad + 4 * c * (m_pad // 128)

        def fmt(t):
            return f"{t:.4f} {moved / t / copy_bps:.3f}"

        t_tl = triton.testing.do_bench(lambda: gather_quant_cols_t_launch(x, src, dt, 128, gluon=False),
                                       warmup=10, rep=60, return_mode="median")
        row = f"{name:<16} {f'{m}x{c}':>13} {t_copy:7.4f} {fmt(t_tl):>14}"
        for cfg in cfgs:
            if cfg.reason():
                row += f" {'bad cfg':>16}"
                continue
            q = torch.full_like(ref_q.view(torch.uint8), 0x5A).view(dt)
            s = torch.full_like(ref_s, float("nan"))
            try:
                gather_quant_cols_t_gluon(x, src, dt, q, s, cfg)
                ok = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(
                    s.view(torch.int32), ref_s.view(torch.int32))
                t = triton.testing.do_bench(lambda: gather_quant_cols_t_gluon(x, src, dt, q, s, cfg),
                                            warmup=10, rep=60, return_mode="median")
                row += f" {fmt(t) + (' ok' if ok else ' BAD'):>16}"
            except Exception as exc:  # noqa: BLE001 - report and go on
                row += f" {type(exc).__name__[:16]:>16}"
                print(f"  {cfg}: {exc}"[:600], flush=True)
        lines.append(row)
        print(row, flush=True)
        x = y = ref_q = ref_s = None  # free before the next shape
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "diag_gather_quant.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
