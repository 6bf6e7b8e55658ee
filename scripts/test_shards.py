#!/usr/bin/env python3
"""Split the test tree into N shards of about equal test counts (whole files, largest first into the
lightest shard) and print shard K's files, so the whole suite can run on the GPU machine in N
calls that each fit the per-call limit (one call ran it to 97% in 560 s with 15 workers):

    python scripts/test_shards.py 1/2 [tests]      # -> the files of shard 1 of 2, one per line

Counts come from ``pytest --collect-only -q`` in this environment (no tests run).
"""

from __future__ import annotations

import collections
import subprocess
import sys


def shard_files(k: int, n: int, paths: list[str]) -> list[str]:
    if not 1 <= k <= n:
        raise ValueError(f"shard {k}/{n}: expected 1 <= K <= N")
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
                         capture_output=True, text=True)
    counts: collections.Counter = collections.Counter()
    for line in out.stdout.splitlines():
        if "::" in line:
            counts[line.split("::", 1)[0]] += 1
    if not counts:
        raise RuntimeError(f"no tests collected from {paths}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    loads = [0] * n
    shards: list[list[str]] = [[] for _ in range(n)]
    for f, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        i = loads.index(min(loads))
        loads[i] += c
        shards[i].append(f)
    return sorted(shards[k - 1])


def main(argv: list[str]) -> int:
    if not argv or "/" not in argv[0]:
        print(__doc__, file=sys.stderr)
        return 2
    k, n = (int(v) for v in argv[0].split("/"))
    for f in shard_files(k, n, argv[1:] or ["tests"]):
        print(f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
