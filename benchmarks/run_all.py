"""Run every benchmark into one result directory, then print the summary tables last.

    python benchmarks/run_all.py --out benchmarks/results/h200
    python benchmarks/run_all.py --out /tmp/b --quick
    python benchmarks/run_all.py --out /tmp/b --quick --cpu-smoke   # no GPU needed

Options other than ``--out`` and ``--only`` are passed through to each benchmark.
A benchmark that crashes is reported and the others still run; the exit status is 1 if any did.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import gpu_info, gpu_slug  # noqa: E402

#: (short name, module). Each module has ``main(argv) -> int`` and ``RESULT_NAME``.
BENCHMARKS: list[tuple[str, str]] = [
    ("gemm", "benchmarks.bench_gemm"),
    ("gemm_fp8", "benchmarks.bench_gemm_fp8"),
    ("grouped_gemm", "benchmarks.bench_grouped_gemm"),
    ("quantization", "benchmarks.bench_quantization"),
    ("norm_act", "benchmarks.bench_norm_act"),
    ("moe_permute", "benchmarks.bench_moe_permute"),
    ("router_gemm", "benchmarks.bench_router_gemm"),
    ("moe_layer", "benchmarks.bench_moe_layer"),
    ("attention", "benchmarks.bench_attention"),
]


def geomean_section(md_path: Path) -> Optional[str]:
    """The '## Geomean speedup' section of a result markdown file, or None."""
    if not md_path.exists():
        return None
    text = md_path.read_text()
    m = re.search(r"^## Geomean speedup.*", text, flags=re.M | re.S)
    return m.group(0).rstrip() if m else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="result directory (default: benchmarks/results/<gpu-slug>)")
    p.add_argument("--only", nargs="+", default=None, choices=[n for n, _ in BENCHMARKS])
    args, passthrough = p.parse_known_args(argv)
    if "--cpu-smoke" in passthrough:
        import torch

        if not torch.cuda.is_available():
            # Before anything imports triton (gpu_info does): Triton kernels through the interpreter.
            os.environ.setdefault("TRITON_INTERPRET", "1")
    out = Path(args.out) if args.out else _ROOT / "benchmarks" / "results" / gpu_slug()
    out.mkdir(parents=True, exist_ok=True)
    info = gpu_info()
    print(f"run_all: {info['gpu']} ({info['sm_count']} SMs), torch {info['torch']}, triton {info['triton']}, "
          f"cuda {info['cuda']}, {info['date']} -> {out}", flush=True)

    status: list[tuple[str, str, float, Optional[str]]] = []  # (name, outcome, seconds, result name)
    for name, module_name in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        print(f"\n===== {name} ({module_name}) =====", flush=True)
        t0 = time.time()
        result_name = None
        try:
            mod = importlib.import_module(module_name)
            result_name = getattr(mod, "RESULT_NAME", name)
            rc = mod.main(["--out", str(out), *passthrough])
            outcome = "ok" if not rc else f"exit {rc}"
        except SystemExit as exc:
            outcome = "ok" if not exc.code else f"exit {exc.code}"
        except Exception:
            traceback.print_exc()
            outcome = "crashed"
        status.append((name, outcome, time.time() - t0, result_name))

    print("\n===== summary =====")
    for name, outcome, secs, result_name in status:
        print(f"{name}: {outcome} in {secs:.0f} s")
        section = geomean_section(out / f"{result_name}.md") if result_name else None
        if section:
            print(section)
    return 0 if all(o == "ok" for _, o, _, _ in status) else 1


if __name__ == "__main__":
    sys.exit(main())
