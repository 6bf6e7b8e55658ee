"""The result-file contract every benchmark smoke test checks (benchmarks/common.write_results)."""

from __future__ import annotations

import json
from pathlib import Path

TOP_KEYS = {"gpu", "torch", "triton", "cuda", "date", "rows"}
ROW_KEYS = {"op", "case", "impl", "baseline", "ms", "baseline_ms", "speedup", "tflops", "snr_db", "error", "extra"}


def load_rows(out_dir, name: str) -> list[dict]:
    """The rows of ``out_dir/name.json`` after checking the file's top-level keys, its benchmark
    name, that it has rows, and every row's keys."""
    doc = json.loads((Path(out_dir) / f"{name}.json").read_text())
    assert TOP_KEYS <= set(doc) and doc["benchmark"] == name
    rows = doc["rows"]
    assert rows, "no rows"
    for r in rows:
        assert ROW_KEYS <= set(r), r
    return rows
