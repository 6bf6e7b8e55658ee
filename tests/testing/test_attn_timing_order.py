"""scripts/check_gluon_attn.py's interleaved timing rounds: every implementation is measured once a
round, in an order rotated each round and reversed every other round (so no implementation always
follows the same one), and the reported time is the median of its round medians."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("check_gluon_attn_t", ROOT / "scripts" / "check_gluon_attn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rounds_change_each_implementations_predecessor(monkeypatch):
    mod = _script()
    calls = []
    times = {"a": iter([3.0, 1.0, 2.0, 9.0]), "b": iter([1.0] * 4), "c": iter([2.0] * 4)}
    monkeypatch.setattr(mod, "_median_ms", lambda fn: next(times[fn()]))
    row = {}
    impls = {n: (lambda n=n: calls.append(n) or n) for n in "abc"}
    impls["peer"] = None  # a peer that could not be set up
    mod.time_impls(row, impls, 2e9, rounds=4, graph=False)
    rounds = [calls[i:i + 3] for i in range(0, 12, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    # a rotation alone yields only the three cyclic neighbour pairs (a, b), (b, c), (c, a)
    pairs = {tuple(r[i - 1:i + 1]) for r in rounds for i in range(1, 3)}
    assert len(pairs) > 3, pairs
    assert row["a"]["ms"] == 3.0 and row["a"]["round_ms"] == [3.0, 1.0, 2.0, 9.0]  # median of 4 = upper middle
    assert row["peer"] == {"error": "cannot run"} and row["timing"] == "events"
