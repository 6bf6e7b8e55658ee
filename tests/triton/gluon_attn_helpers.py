"""Helpers shared by the Gluon attention tests (test_flash_attn_gluon.py, test_flash_attn_bwd_gluon.py,
test_flash_attn_fp8_gluon.py): the sm_90 marker, the check scripts as modules, random q / k / v in
the op's layouts, and an SNR that first requires both sides to agree on the non-finite entries."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) GPU")


@functools.lru_cache(maxsize=None)
def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package), loaded once: its sm_90 compile
    reports and input builders."""
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def qkv(B, Sq, Sk, Hq, Hk, D, dtype=torch.bfloat16, layout="bshd", device="cpu"):
    """Random logical ``[B, S, H, D]`` q, k, v; ``sbhd`` / ``bhsd``: views of tensors stored that way
    (the check script's own inputs, so the tests and the GPU check build them alike)."""
    return load_script("check_gluon_attn")._make(B, Sq, Sk, Hq, Hk, D, dtype, layout, device)


def snr_finite(ref, out):
    """SNR in dB over ref's finite entries, after asserting that out has the same non-finite
    entries (the +inf LSE of empty causal rows must match exactly)."""
    from primus_turbo.testing import snr_db

    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out)), "non-finite entries differ"
    assert torch.equal(ref[~fin], out[~fin])
    return snr_db(ref[fin].double().cpu(), out[fin].double().cpu()) if fin.any() else float("inf")
