"""Gluon compile checks under the Triton interpreter: run the test again in a child process.

CPU CI runs the suite with ``TRITON_INTERPRET=1`` (tests/conftest.py), and Triton decides at
decoration time whether ``@gluon.jit`` builds a real JIT function; under the interpreter the
kernel's helpers are interpreted stand-ins and the sm_90 compile fails in the frontend ("Did you
forget to add @triton.gluon.jit?"). These checks only need the compiler, not a GPU, so
:func:`rerun_outside_interpreter` runs the same test id in a child pytest with
``TRITON_INTERPRET=0`` (conftest leaves an explicit value alone) and passes, skips or fails with
it. Without it a warm Triton cache hid the problem: a cached cubin skips the frontend.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from primus_turbo.triton import is_interpreter

_ROOT = Path(__file__).resolve().parents[2]


def rerun_outside_interpreter(request) -> bool:
    """True when the test already ran in the child (the caller returns); False outside the
    interpreter, where the caller runs its body itself."""
    if not is_interpreter():
        return False
    env = dict(os.environ, TRITON_INTERPRET="0")
    for var in list(env):  # an xdist worker's identity must not leak into the child session
        if var.startswith("PYTEST_XDIST") or var == "PYTEST_ADDOPTS":
            env.pop(var)
    cmd = [sys.executable, "-m", "pytest", request.node.nodeid, "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-p", "no:randomly", "-rs"]
    proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    if proc.returncode == 0 and re.search(r"\b1 passed\b", summary):
        return True
    if proc.returncode == 0 and re.search(r"\b1 skipped\b", summary):
        reason = re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", out)
        pytest.skip(f"(child process) {reason[-1] if reason else summary}")
    pytest.fail(f"child pytest outside the interpreter failed (exit {proc.returncode}):\n{out[-6000:]}")


def compile_check_module():
    """scripts/gluon_compile_check.py as a module (its compile_config / compile_grouped helpers)."""
    import importlib.util

    path = _ROOT / "scripts" / "gluon_compile_check.py"
    spec = importlib.util.spec_from_file_location("gluon_compile_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def warmup_for_sm90(kernel, args, kwargs, monkeypatch):
    """``kernel.warmup`` with a launcher's real arguments under a stand-in sm_90 CUDA driver: the
    JIT binds them and compiles, as the first GPU call would up to the launch. Returns the compiled
    kernel; the binder's per-device cache is dropped afterwards."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    if not hasattr(driver, "_active"):
        pytest.skip("triton's driver registry has changed")
    monkeypatch.setattr(driver, "_active", _Sm90())
    try:
        return kernel.warmup(*args, grid=(1,), **kwargs)
    finally:
        kernel.device_caches.clear()
