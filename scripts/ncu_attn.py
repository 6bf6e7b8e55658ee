"""A short driver for Nsight Compute over the Gluon attention forwards (H100/H200): each case runs
``--reps`` times after one warm-up call, so ``ncu --launch-skip`` / ``--kernel-name`` can pick one
launch of the case's kernel.

    ncu --clock-control none --kernel-name regex:attn --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats python scripts/ncu_attn.py --case fp8 --head-dim 64 --seq 4096

Cases: ``fp8`` (the Gluon FP8 forward on the op's quantized operands; ``--config`` picks a
``GluonAttnFp8Config``, the default otherwise) and ``bf16`` (the bf16 Gluon forward, ``--config`` a
``GluonAttnConfig``). 32 heads and 16384 tokens (batch = 16384 / seq), bshd, as
``scripts/check_gluon_attn_fp8.py --compare`` times them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--config", default=None)
    p.add_argument("--reps", type=int, default=1)
    a = p.parse_args()
    from primus_turbo.pytorch.ops import attention_fp8 as opf8
    from primus_turbo.triton.attention import flash_attn_fp8_fwd_gluon as f8
    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa

    B, S, H, D = max(1, a.tokens // a.seq), a.seq, a.heads, a.head_dim
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale, wr = D ** -0.5, (0 if a.causal else -1)
    if a.case == "fp8":
        args = (*opf8._quantize(q, k, v, 128), 128, None, scale, -1, wr)
        cfg = f8.GluonAttnFp8Config.parse(a.config) if a.config else None
        reason = f8.gluon_attn_fp8_fwd_reason(*args, config=cfg)
        if reason:
            raise SystemExit(f"cannot run: {reason}")

        def run():
            return f8.flash_attn_fp8_fwd_gluon(*args, config=cfg)
    else:
        cfg = fa.GluonAttnConfig.parse(a.config) if a.config else None

        def run():
            return fa.flash_attn_fwd_gluon(q, k, v, None, scale, -1, wr, config=cfg)
    for _ in range(1 + a.reps):
        run()
    torch.cuda.synchronize()
    print(f"{a.case} D={D} S={S} B={B} H={H} causal={a.causal} config={a.config or 'default'}: done", flush=True)


if __name__ == "__main__":
    main()
