"""Test harness shared by every test file.

On a machine without CUDA the Triton kernels run through the Triton interpreter: TRITON_INTERPRET
must be set before triton is imported, so it is set here, at conftest import, before any test
module imports the package. The interpreter's bf16 ``tl.dot`` multiplies raw bit patterns
(triton issue #11584); the suite opts in to ``primus_turbo.triton.interpreter.fix_bf16_dot`` so
bf16 kernels are tested on CPU too (the library never patches triton on its own).
"""

from __future__ import annotations

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard requirement of the tests
    _HAS_CUDA = False

if not _HAS_CUDA:
    # defaulted, not forced: the sm_90 compile checks run this suite in a child process with an
    # explicit TRITON_INTERPRET=0 (tests/triton/gluon_compile_child.py), which must stay as given
    os.environ.setdefault("TRITON_INTERPRET", "1")


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()
    except ImportError:  # triton not installed: TRITON tests skip themselves
        pass


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run every N-th collected test starting at the K-th (1-based): N calls with K = 1..N run "
                          "the whole selection once, each a mix of every file (GPU sessions split the tree so)")
    parser.addoption("--skip-passed", default=None, metavar="RESULT_LOG",
                     help="deselect the tests a PRIMUS_TURBO_TEST_RESULT_LOG file records as passed (resume a run "
                          "that a time limit cut)")


def _shard(text: str) -> tuple:
    """``"K/N"`` -> (K, N) with 1 <= K <= N; a clear error otherwise."""
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard expects K/N with integers, got {text!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {text}: expected 1 <= K <= N")
    return k, n


def pytest_collection_modifyitems(config, items):
    # the shard first, then the resume: a resumed K/N run keeps shard K's tests (skipping first
    # would re-deal the remaining tests across the shards)
    shard = config.getoption("--shard")
    if shard:
        # interleaved by collection order, not whole files: the GPU-heavy files (Gluon kernels,
        # attention) are a few of many, so whole-file shards balanced by test count were 100 s
        # against 500 s on the H200 (session 23); every worker of an xdist run collects the same
        # order, so each keeps the same subset
        k, n = _shard(shard)
        keep = [it for i, it in enumerate(items) if i % n == k - 1]
        dropped = [it for i, it in enumerate(items) if i % n != k - 1]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    passed_log = config.getoption("--skip-passed")
    if passed_log:
        with open(passed_log) as fh:
            done = {line.split(" ", 2)[2].rstrip("\n") for line in fh if line.startswith("passed ")}
        dropped = [it for it in items if it.nodeid in done]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [it for it in items if it.nodeid not in done]
    run_slow = config.getoption("--runslow") or _HAS_CUDA
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA devices")
    skip_slow = pytest.mark.skip(reason="slow on CPU; run with --runslow")
    n_gpu = torch.cuda.device_count() if _HAS_CUDA else 0
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


@pytest.fixture
def device() -> str:
    """The device tests run on: cuda where present, else cpu (Triton via the interpreter)."""
    return "cuda" if _HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Return each test's cached CUDA blocks to the driver: GPU sessions run many pytest workers on
    one card, and a worker's allocator otherwise keeps a large test's float64 references reserved
    (an 80 GB card ran out of memory with 8 workers, session 47)."""
    yield
    if _HAS_CUDA:
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _reset_backends():
    """Every test starts and ends with no backend pins and empty autotune caches."""
    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


def pytest_runtest_logreport(report):
    """With PRIMUS_TURBO_TEST_FAILURE_LOG set, append each failure's report to that file the moment
    it happens (under xdist too): a GPU run cut off by its time limit still leaves every traceback.
    With PRIMUS_TURBO_TEST_RESULT_LOG set, append one line per finished test (outcome, seconds, node
    id): a cut run still says which tests passed, so the next call runs only the rest."""
    if getattr(report, "node", None) is not None:
        return  # the xdist controller's copy of a worker's report: the worker wrote it already
    path = os.environ.get("PRIMUS_TURBO_TEST_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as fh:
            fh.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
    path = os.environ.get("PRIMUS_TURBO_TEST_RESULT_LOG")
    if path and (report.when == "call" or (report.when == "setup" and not report.passed)):
        with open(path, "a") as fh:
            fh.write(f"{report.outcome} {report.duration:.2f} {report.nodeid}\n")
