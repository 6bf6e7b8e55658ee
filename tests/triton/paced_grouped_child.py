"""Child process of test_grouped_gemm_gluon.py::test_m_grouped_paced_is_bit_equal: runs the paced
16-bit Gluon M-grouped kernel (config ``p<D>``) against the unpaced one, so a hang (pacing hung on
the H200 while Triton miscompiled the tile deal, see tests/triton/test_tile_deal.py) fails the test
through the parent's timeout instead of wedging the test worker's CUDA context. Exit status 0 when every check holds.

    python tests/triton/paced_grouped_child.py        (every case below; prints "ok" last)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg  # noqa: E402


#: group sizes: balanced, empty and tiny groups, many groups (the GPU tests' LENS)
CASES = ([512, 512, 512, 512], [0, 1000, 37, 0, 333, 1], [5, 0, 63, 64, 65, 0, 128, 17])


def main() -> int:
    for lens in CASES:
        for kmajor in (True, False):
            for pace in (1, 2):
                bad = check(lens, kmajor, pace)
                if bad:
                    print(f"lens {lens} kmajor {kmajor} pace {pace}: {bad}")
                    return 1
    print("ok")
    return 0


def check(lens, kmajor: bool, pace: int):
    """None when the paced kernel matches the unpaced one bit for bit, else what went wrong."""
    N, K, tail = 384, 200, 7
    torch.manual_seed(0)
    G = len(lens)
    a = torch.randn(sum(lens) + tail, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda").to(torch.bfloat16)
    B = w.transpose(1, 2) if kmajor else w.transpose(1, 2).contiguous()  # logical [G, K, N] either way
    offs = torch.zeros(G + 1, dtype=torch.int64, device="cuda")
    offs[1:] = torch.cumsum(torch.tensor(lens, device="cuda"), 0)
    ref = gg.grouped_gemm_gluon(a, B, offs, config=gg.GluonGroupedConfig.parse("n128k64s5"))
    cfg = gg.GluonGroupedConfig.parse(f"n128k64s5p{pace}")
    real_tiles = sum(-(-n // cfg.BLOCK_M) for n in lens) * -(-N // cfg.block_n)
    bound = (-(-a.shape[0] // cfg.BLOCK_M) + G + 1) * -(-N // cfg.block_n)
    for programs in (None, 3):
        out = torch.full_like(ref, float("nan"))
        args, kwargs = gg._kernel_args(a, B, offs, out, cfg)
        gg._dense._launch_persistent(gg._grouped_gemm_gluon_ws_kernel, a.device, bound, programs, args, kwargs)
        torch.cuda.synchronize()
        if not torch.equal(out, ref):
            return f"paced output differs (programs {programs})"
        if args[5].tolist() != [real_tiles]:
            return f"counter {args[5].tolist()} != [{real_tiles}] (programs {programs})"
    if not torch.equal(gg.grouped_gemm_gluon(a, B, offs, config=cfg), ref):
        return "paced grouped_gemm_gluon differs"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
