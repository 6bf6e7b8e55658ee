"""Smoke test of scripts/tune_gptoss_memory.py (``--cpu-smoke``: tiny shapes through the Triton
interpreter), and of the shape-aware merge_rows launch it sweeps."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="--cpu-smoke runs the kernels through the Triton interpreter")


def _script():
    spec = importlib.util.spec_from_file_location("tune_gptoss_memory", ROOT / "scripts" / "tune_gptoss_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tune_gptoss_memory_cpu_smoke(tmp_path, capsys):
    mod = _script()
    assert mod.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "tune_gptoss_memory.json").read_text())
    rows = [r for r in doc["rows"] if r["kernel"] != "device-copy"]
    kernels = {r["kernel"] for r in rows}
    assert {"merge_rows", "quant_1x128", "quant_128x128", "gather_quant_cols_t", "glu_fwd", "glu_bwd"} <= kernels
    for r in rows:
        assert r["error"] is None, r
        assert r["bit_exact"], r  # every candidate computes the default's bytes
        assert r["ms"] > 0 and r["vs_copy"] > 0
    labels = {r["label"] for r in rows if r["kernel"] == "merge_rows"}
    assert {"default", "4w-1024"} <= labels
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-1].startswith("| glu_bwd |")


def test_merge_rows_launch_override_bit_identical():
    """At H=2880 a swept launch (4 warps x 1024 columns) and the default (8 x 2048) give the same bytes."""
    from primus_turbo.triton.moe.permute_kernel import merge_rows_launch

    g = torch.Generator().manual_seed(0)
    t, k, h = 4, 4, 2880
    src = torch.randn(t * k, h, generator=g).to(torch.bfloat16)
    row_map = torch.randperm(t * k, generator=g).view(t, k).to(torch.int32)
    row_map[1, 2] = -1
    outs = [merge_rows_launch(src, torch.empty(t, h, dtype=torch.bfloat16), row_map, None, **kw)
            for kw in ({}, {"num_warps": 4, "block_c": 1024})]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    ref = torch.zeros(t, h)
    for j in range(k):
        r = row_map[:, j].long()
        ref += torch.where((r >= 0)[:, None], src[r.clamp(min=0)].float(), 0.0)
    assert torch.equal(outs[0], ref.to(torch.bfloat16))


def test_launch_overrides_reject_bad_values():
    from primus_turbo.triton.activation.swiglu_kernel import ACT_SILU, glu_fwd_launch
    from primus_turbo.triton.quantization.gather_quant_kernel import gather_quant_cols_t_launch
    from primus_turbo.triton.moe.permute_kernel import merge_rows_launch
    from primus_turbo.triton.quantization.quant_fp8_kernel import QuantGrouping, fp8_quant_launch, transpose_bytes

    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"tile \(8, 64, 4\)"):
        fp8_quant_launch(x, torch.float8_e4m3fn, QuantGrouping(0, 1, 128), tile=(8, 64, 4))
    with pytest.raises(ValueError, match="tc=48"):
        gather_quant_cols_t_launch(x, torch.arange(32), torch.float8_e4m3fn, 16, tc=48)
    with pytest.raises(ValueError, match=r"\(1, 100, 4\)"):
        glu_fwd_launch(x, ACT_SILU, config=(1, 100, 4))
    with pytest.raises(ValueError, match=r"tile \(8, 128, 3\)"):
        fp8_quant_launch(x, torch.float8_e4m3fn, QuantGrouping(0, 1, 128), tile=(8, 128, 3))
    q = torch.zeros(32, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\(48, 4\)"):
        transpose_bytes(q, torch.empty(64, 32, dtype=torch.uint8), (48, 4))
    with pytest.raises(ValueError, match=r"\(64, 3\)"):
        transpose_bytes(q, torch.empty(64, 32, dtype=torch.uint8), (64, 3))
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        merge_rows_launch(x, torch.empty(4, 64, dtype=torch.bfloat16), torch.zeros(4, 20, dtype=torch.int32),
                          chunk=0)
