"""Host cost of the grouped GEMM's derived offsets (``group_offs=None``, the Megatron calling form):
whether the offsets kernel's launch takes the keyed direct path (``triton/launch.launch_keyed``), what
a call costs on the host, and the op's no-grad forward and forward+backward with and without given
offsets, interleaved over rounds in one process.

    PYTHONPATH=. python scripts/diag_host_offsets.py --out /tmp/diag [--rounds 5]

Writes ``diag_host_offsets.txt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from scripts.diag_host_autograd import interleaved_host_us, median_line, profile_lines, write_lines  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=300)
    args = p.parse_args(argv)
    import primus_turbo.pytorch as turbo
    from primus_turbo.triton import launch as L
    from primus_turbo.triton.grouped_gemm import offsets as O

    dev = torch.device("cuda")
    lines = []
    G, rows, N, K = 4, 512, 4096, 1536
    lens = torch.full((G,), rows, dtype=torch.int64, device=dev)
    offs = O.group_offsets_(lens)
    offs = O.group_offsets_(lens)
    keyed = [(k, v) for k, v in L._KEYED.items() if k[0] == id(O._offsets_kernel)]
    entries = [(k[2], v[0] is not None) for k, v in L._ENTRIES.items() if k[0] == id(O._offsets_kernel)]
    lines.append(f"offsets kernel: keyed entries {len(keyed)}; launch() entries {entries}")
    a = torch.randn(G * rows, K, dtype=torch.bfloat16, device=dev, requires_grad=True)
    w = torch.randn(G, N, K, dtype=torch.bfloat16, device=dev, requires_grad=True)
    grad = torch.randn(G * rows, N, dtype=torch.bfloat16, device=dev)

    def reset():
        a.grad = w.grad = None

    steps = {
        "group_offsets_": lambda: O.group_offsets_(lens),
        "torch cumsum": lambda: torch.cumsum(lens, 0),
        "fwd offs given": lambda: turbo.ops.grouped_gemm(a.detach(), w.detach(), lens, offs, trans_b=True),
        "fwd offs None": lambda: turbo.ops.grouped_gemm(a.detach(), w.detach(), lens, None, trans_b=True),
        "fwd+bwd offs given": lambda: (reset(), turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True).backward(grad)),
        "fwd+bwd offs None": lambda: (reset(), turbo.ops.grouped_gemm(a, w, lens, None, trans_b=True).backward(grad)),
    }
    times = interleaved_host_us(steps, args.rounds, args.n)
    lines += [median_line(name, ts, "call") for name, ts in times.items()]
    for name in ("group_offsets_", "fwd offs None"):
        lines += profile_lines(name, steps[name], 30, ("tottime",))
    write_lines(args.out, "diag_host_offsets.txt", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
