"""Test harness shared by every test file.

On a machine without CUDA the Triton kernels run through the Triton interpreter: TRITON_INTERPRET
must be set before triton is imported, so it is set here, at conftest import, before any test
module imports the package. The interpreter's bf16 ``tl.dot`` multiplies raw bit patterns
(triton issue #11584); ``_shim_interpreter_bf16_dot`` upcasts bf16 dot operands to fp32 so bf16
kernels are tested on CPU too. The shim lives in the test setup only; the library never patches
triton.
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
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _shim_interpreter_bf16_dot() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_primus_turbo_bf16_shim", False):
        return
    original = builder.create_dot

    def _as_fp32(handle):
        # bf16 lives in the interpreter as raw uint16 bits; bf16 is the top half of an fp32.
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = _as_fp32(a)
        if b.dtype == tl.bfloat16:
            b = _as_fp32(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    builder._primus_turbo_bf16_shim = True


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _shim_interpreter_bf16_dot()
    except ImportError:  # triton not installed: TRITON tests skip themselves
        pass


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
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
