"""tests/conftest.py's run selection for GPU sessions: ``--shard K/N`` (every N-th collected test,
the N shards a partition of the selection) and ``--skip-passed`` (leave out what a result log
records as passed), and the ``PRIMUS_TURBO_TEST_RESULT_LOG`` record itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_TESTS = "".join(f"def test_{i}():\n    assert {i} >= 0\n\n\n" for i in range(7))


@pytest.fixture
def target(tmp_path) -> str:
    """Seven trivial tests in a file of their own, run with the suite's conftest as a plugin."""
    f = tmp_path / "test_seven.py"
    f.write_text(_TESTS)
    return str(f)


def _pytest(*args, env=None):
    run_env = dict(os.environ, **(env or {}))
    run_env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-p",
                           "tests.conftest", *args],
                          cwd=_ROOT, capture_output=True, text=True, env=run_env)


def _collected(target, *args) -> list:
    out = _pytest("--collect-only", "-q", target, *args)
    assert out.returncode in (0, 5), out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_shards_partition_the_selection(target):
    everything = _collected(target)
    assert len(everything) == 7, everything
    shards = [_collected(target, "--shard", f"{k}/3") for k in (1, 2, 3)]
    assert sorted(sum(shards, [])) == sorted(everything)  # each test in exactly one shard
    assert all(abs(len(s) - len(everything) / 3) < 1 for s in shards), [len(s) for s in shards]
    assert shards[0] == everything[0::3]  # interleaved in collection order
    assert _collected(target, "--shard", "1/1") == everything


@pytest.mark.parametrize("bad", ["0/2", "3/2", "x/2", "2"])
def test_shard_bad_values_name_the_value(bad, target):
    out = _pytest("--collect-only", "-q", target, "--shard", bad)
    assert out.returncode != 0
    assert "--shard" in (out.stdout + out.stderr)


def test_result_log_and_skip_passed(tmp_path, target):
    log = tmp_path / "results.log"
    everything = _collected(target)
    out = _pytest("-q", target, "--shard", "1/2", env={"PRIMUS_TURBO_TEST_RESULT_LOG": str(log)})
    assert out.returncode == 0, out.stdout[-2000:]
    lines = log.read_text().splitlines()
    ran = everything[0::2]
    assert sorted(line.split(" ", 2)[2] for line in lines) == sorted(ran)
    assert all(line.split(" ", 2)[0] == "passed" and float(line.split(" ", 2)[1]) >= 0 for line in lines)
    # a failed record is not skipped: only "passed" lines count
    log.write_text("\n".join(lines) + f"\nfailed 0.10 {everything[1]}\n")
    assert _collected(target, "--skip-passed", str(log)) == [t for t in everything if t not in ran]


def test_resumed_shard_keeps_its_own_tests(tmp_path, target):
    """``--shard K/N --skip-passed LOG`` runs shard K's tests that LOG does not record as passed: the
    shard is taken before the passed tests leave, so a resumed shard never picks up another shard's
    tests (session 32: skipping first re-dealt the remaining tests across the shards)."""
    everything = _collected(target)
    shard2 = everything[1::3]  # shard 2/3: the 2nd, 5th tests
    log = tmp_path / "results.log"
    log.write_text(f"passed 0.01 {shard2[0]}\npassed 0.01 {everything[0]}\n")  # a cut run of shard 2
    assert _collected(target, "--shard", "2/3", "--skip-passed", str(log)) == shard2[1:]


def test_result_log_under_xdist_has_one_line_per_test(tmp_path, target):
    """Workers write their own reports; the controller's copies of them are not written again."""
    pytest.importorskip("xdist")
    log = tmp_path / "results.log"
    run_env = dict(os.environ, PRIMUS_TURBO_TEST_RESULT_LOG=str(log))
    run_env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.conftest", "-q",
                          "-n", "2", target], cwd=_ROOT, capture_output=True, text=True, env=run_env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line.split(" ", 2)[2] for line in log.read_text().splitlines()]
    assert sorted(ids) == sorted(_collected(target)), ids
