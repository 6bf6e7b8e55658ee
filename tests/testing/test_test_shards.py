"""scripts/test_shards.py: whole files, every file in exactly one shard, loads balanced."""

from __future__ import annotations

import importlib.util
import subprocess
import types
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "test_shards.py"


def _module():
    spec = importlib.util.spec_from_file_location("test_shards", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_collect(counts):
    lines = [f"{f}::test_{i}" for f, c in counts.items() for i in range(c)]

    def run(*args, **kwargs):
        return types.SimpleNamespace(stdout="\n".join(lines + ["", f"{sum(counts.values())} tests collected"]),
                                     stderr="", returncode=0)
    return run


def test_shards_partition_whole_files(monkeypatch):
    mod = _module()
    counts = {"tests/a.py": 50, "tests/b.py": 30, "tests/c.py": 25, "tests/d.py": 5, "tests/e.py": 1}
    monkeypatch.setattr(subprocess, "run", _fake_collect(counts))
    shards = [mod.shard_files(k, 2, ["tests"]) for k in (1, 2)]
    assert sorted(shards[0] + shards[1]) == sorted(counts)  # every file once
    loads = [sum(counts[f] for f in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 5, loads
    assert mod.shard_files(1, 1, ["tests"]) == sorted(counts)


def test_shards_bad_arguments(monkeypatch):
    mod = _module()
    monkeypatch.setattr(subprocess, "run", _fake_collect({}))
    with pytest.raises(RuntimeError, match="no tests collected"):
        mod.shard_files(1, 2, ["tests"])
    with pytest.raises(ValueError, match="shard 3/2"):
        mod.shard_files(3, 2, ["tests"])
