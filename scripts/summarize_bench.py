"""Geomean / min of each impl's speedup in benchmark JSON files, per op, over all rows and over
the rows whose baseline takes at least --min-ms (the host-bound rows separated from the rest).

    python scripts/summarize_bench.py RESULTS.json [...] [--min-ms 0.3 1.0]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import sys


def summarize(paths, min_ms):
    rows = []
    for pattern in paths:
        for path in sorted(glob.glob(pattern)) or [pattern]:
            with open(path) as f:
                rows.extend(json.load(f).get("rows", []))
    groups = {}
    for r in rows:
        if r.get("error") or not r.get("speedup") or r["impl"] == r.get("baseline"):
            continue
        groups.setdefault((r["op"], r["impl"]), []).append(r)
    lines = []
    for (op, impl), rs in sorted(groups.items()):
        for thr in [0.0] + list(min_ms):
            sel = [r["speedup"] for r in rs if (r.get("baseline_ms") or 0.0) >= thr]
            if not sel:
                continue
            g = math.exp(sum(math.log(s) for s in sel) / len(sel))
            below = sum(1 for s in sel if s < 0.98)
            lines.append(f"{op:28s} {impl:18s} peer>={thr:<4g}ms n={len(sel):3d} geomean {g:.3f} "
                         f"min {min(sel):.3f} below0.98 {below}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--min-ms", type=float, nargs="*", default=[0.3, 1.0])
    args = p.parse_args(argv)
    for line in summarize(args.json, args.min_ms):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
