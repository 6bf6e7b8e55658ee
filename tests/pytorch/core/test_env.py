"""Every PRIMUS_TURBO_* variable the code reads is documented, and the log level is honoured."""

from __future__ import annotations

import pathlib
import re

import pytest

from primus_turbo.pytorch.core import env as env_mod

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_every_env_var_in_code_is_registered_and_documented():
    used = set()
    for path in (ROOT / "primus_turbo").rglob("*.py"):
        used |= set(re.findall(r"PRIMUS_TURBO_[A-Z0-9_]+", path.read_text()))
    used.discard("PRIMUS_TURBO_")
    # per-family names listed in GlobalBackendManager are registered too
    missing = sorted(v for v in used if v not in env_mod.ENV_VARS and not v.endswith("_"))
    assert not missing, f"env vars read but not registered in core/env.py: {missing}"
    doc = (ROOT / "docs" / "env_vars.md").read_text()
    undocumented = sorted(v for v in env_mod.ENV_VARS if v not in doc)
    assert not undocumented, f"env vars missing from docs/env_vars.md: {undocumented}"


def test_unknown_env_var_name_is_an_error():
    with pytest.raises(KeyError, match="PRIMUS_TURBO_NOPE"):
        env_mod.env_str("PRIMUS_TURBO_NOPE")


def test_log_level(monkeypatch):
    import logging

    from primus_turbo.pytorch.core import logging as plog

    logger = logging.getLogger("primus_turbo")
    monkeypatch.setattr(logger, "_primus_turbo_configured", False, raising=False)
    monkeypatch.setenv("PRIMUS_TURBO_LOG_LEVEL", "debug")
    assert plog.get_logger().level == logging.DEBUG
    monkeypatch.setattr(logger, "_primus_turbo_configured", False, raising=False)
    monkeypatch.setenv("PRIMUS_TURBO_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_LOG_LEVEL='LOUD'"):
        plog.get_logger()
    monkeypatch.setattr(logger, "_primus_turbo_configured", False, raising=False)
    monkeypatch.setenv("PRIMUS_TURBO_LOG_LEVEL", "WARNING")
    plog.get_logger()


def test_env_auto_flag(monkeypatch):
    from primus_turbo.pytorch.core.env import env_auto_flag

    name = "PRIMUS_TURBO_PERMUTE_FUSED_MAP"
    monkeypatch.delenv(name, raising=False)
    assert env_auto_flag(name) is None  # default "auto"
    for v, want in (("auto", None), ("1", True), ("ON", True), ("0", False), ("off", False)):
        monkeypatch.setenv(name, v)
        assert env_auto_flag(name) is want
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_PERMUTE_FUSED_MAP='maybe'"):
        env_auto_flag(name)


def test_env_raw_follows_run_time_changes(monkeypatch):
    """env_raw (the dispatchers' settings key) sees os.environ assignments and deletions at once;
    its value is the raw one (bytes on POSIX CPython), equal for equal settings."""
    name = "PRIMUS_TURBO_AUTO_TUNE"
    monkeypatch.delenv(name, raising=False)
    assert env_mod.env_raw(name) is None
    monkeypatch.setenv(name, "1")
    one = env_mod.env_raw(name)
    assert one is not None and one == env_mod.env_raw(name)
    assert one in ("1", b"1")
    monkeypatch.setenv(name, "0")
    assert env_mod.env_raw(name) != one
    monkeypatch.delenv(name)
    assert env_mod.env_raw(name) is None


def test_common_constants_name_registered_variables():
    # primus_turbo.common.constants (the import path Primus's Megatron layers use) names only
    # registered variables, and the backend ones are the ones GlobalBackendManager reads
    import subprocess
    import sys

    from primus_turbo.common import constants as c
    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    names = {n: getattr(c, n) for n in c.__all__}
    assert names and all(n.startswith("ENV_") for n in names)
    assert all(v in env_mod.ENV_VARS for v in names.values()), names
    assert c.ENV_GEMM_BACKEND == GlobalBackendManager._ENV["gemm"]
    assert c.ENV_GROUPED_GEMM_BACKEND == GlobalBackendManager._ENV["grouped_gemm"]
    assert c.ENV_ATTN_BACKEND == GlobalBackendManager._ENV["attn"]
    # names only: importing the module does not import torch
    code = "import sys, primus_turbo.common.constants; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
