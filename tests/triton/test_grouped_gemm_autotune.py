"""The grouped GEMM's per-shape tuning logic (primus_turbo/triton/grouped_gemm/grouped_gemm_kernel.py),
with the timer and the launches replaced: picks the fastest candidate, skips candidates that fail,
caches per key, never tunes when switched off, and times balanced synthetic groups only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.grouped_gemm import grouped_gemm_kernel as gk  # noqa: E402


@pytest.fixture
def tuner(monkeypatch):
    monkeypatch.setattr(gk, "is_interpreter", lambda: False)
    monkeypatch.setattr(gk.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gk, "_tuned", {})
    monkeypatch.delenv("PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE", raising=False)
    times = {}
    monkeypatch.setattr(gk, "_time_ms", lambda fn: times[fn()])
    return times


def test_picks_fastest_and_caches(tuner):
    pool = gk._CANDIDATES_16BIT
    default = gk.GroupedGemmConfig(128, 128, 32, 8, 4, 8)
    fastest = pool[2]
    tuner.update({c: 2.0 for c in pool})
    tuner[default] = 3.0
    tuner[fastest] = 1.0
    ran = []

    def run(cfg):
        ran.append(cfg)
        return cfg

    dev = torch.device("cuda")
    assert gk._pick_config(("k1",), default, torch.bfloat16, dev, run) == fastest
    assert ran[0] == default and set(ran) == set(pool) | {default}
    ran.clear()
    assert gk._pick_config(("k1",), default, torch.bfloat16, dev, run) == fastest
    assert ran == []  # cached: no second tuning


def test_failing_candidates_are_skipped(tuner):
    default = gk._CANDIDATES_FP32[0]
    tuner.update({c: 5.0 for c in gk._CANDIDATES_FP32})
    bad = gk._CANDIDATES_FP32[1]

    def run(cfg):
        if cfg == bad:
            raise RuntimeError("out of shared memory")
        return cfg

    tuner[gk._CANDIDATES_FP32[3]] = 1.0
    assert gk._pick_config(("k2",), default, torch.float32, torch.device("cuda"), run) == gk._CANDIDATES_FP32[3]


def test_no_tuning_when_off_or_on_cpu(tuner, monkeypatch):
    default = gk._CANDIDATES_16BIT[0]

    def run(cfg):
        raise AssertionError("must not run")

    assert gk._pick_config(("k3",), default, torch.bfloat16, torch.device("cpu"), run) == default
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE", "0")
    assert gk._pick_config(("k3",), default, torch.bfloat16, torch.device("cuda"), run) == default
    assert ("k3",) not in gk._tuned  # a default is not cached: a later enabled call still tunes


def test_balanced_offsets():
    offs = gk._balanced_offsets(1000, 7, torch.device("cpu"))
    lens = offs.diff()
    assert int(offs[0]) == 0 and int(offs[-1]) == 1000 and int(lens.max() - lens.min()) <= 1


def test_candidate_with_other_output_is_never_picked(tuner, monkeypatch):
    """With ``same``, a candidate whose output differs from the default's is skipped however fast."""
    default = gk._CANDIDATES_16BIT[0]
    wrong, good = gk._CANDIDATES_TMA[0], gk._CANDIDATES_16BIT[3]
    speed = {c: 5.0 for c in gk._CANDIDATES_16BIT + gk._CANDIDATES_TMA}
    speed[wrong], speed[good] = 0.5, 1.0
    last = []

    def run(cfg):
        last.append(cfg)
        return torch.full((4,), 9.0 if cfg == wrong else 1.0)

    monkeypatch.setattr(gk, "_time_ms", lambda fn: (fn(), speed[last[-1]])[1])
    got = gk._pick_config(("k4",), default, torch.bfloat16, torch.device("cuda"), run, gk._CANDIDATES_TMA, gk._close)
    assert got == good
    assert wrong in last  # it ran (its output was compared), it was not chosen


def test_close():
    r = torch.randn(64, 64)
    assert gk._close(r, r + 1e-4 * r.abs().max())
    assert not gk._close(r, r * 1.5)
    bad = r.clone()
    bad[0, 0] = float("nan")
    assert not gk._close(r, bad)
