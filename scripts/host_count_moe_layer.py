"""Host-side work of one MoELayer training step (forward + backward), counted on a CPU machine.

The layer is the benchmark's ``turbo-bf16`` configuration (``bench_moe_layer.py``): softmax router
in fp32, SwiGLU experts, ``num_out_tokens = T * topk`` (no host sync), no balancing options. A
change to the layer's Python that adds work to this default path shows here as more ATen ops,
device kernels or Triton launches per step, which a CPU machine can count where it cannot time a
GPU (same counting as ``host_count_fp8_linear.py``: torch.profiler CPU events, the interpreter's
launches; kernel bodies run for real, in float32 so the interpreter's dots are exact).

Run it in two trees to compare them (``PYTHONPATH`` picks the tree):

    PYTHONPATH=. python scripts/host_count_moe_layer.py [--t 64 --h 64 --f 64 --e 8 --k 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_count_fp8_linear as hc  # noqa: E402  (the counting helpers)


def count(t: int, h: int, f: int, e: int, k: int, steps: int, dtype: torch.dtype) -> dict:
    import primus_turbo.pytorch as turbo

    torch.manual_seed(0)
    layer = turbo.modules.MoELayer(h, f, e, k, score_function="softmax", router_dtype=torch.float32, dtype=dtype)
    x = torch.randn(t, h, dtype=dtype, requires_grad=True)
    dy = torch.randn(t, h, dtype=dtype)

    def step():
        layer(x, num_out_tokens=t * k).backward(dy)
        x.grad = None
        layer.zero_grad(set_to_none=True)

    return hc.count_step(step, "moe-bf16-default", steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--t", type=int, default=64)
    p.add_argument("--h", type=int, default=64)
    p.add_argument("--f", type=int, default=64)
    p.add_argument("--e", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    r = count(a.t, a.h, a.f, a.e, a.k, a.steps, torch.float32)
    print(hc._table([r]))
    if a.json is not None:
        a.json.write_text(json.dumps(r, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
