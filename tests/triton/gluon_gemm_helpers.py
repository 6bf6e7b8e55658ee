"""Helpers shared by the Gluon FP8 GEMM tests (test_gemm_fp8_gluon.py, test_grouped_gemm_fp8_gluon.py,
test_grouped_gemm_fp8_variable_k_gluon.py): the sm_90 and Gluon markers, group offsets, an SNR on
the CPU in float64, a mocked platform, the pinned-backend refusal on CPU, the sm_90 compile report
with its common assertions, and the per-row scale operand of a launch."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.triton.gemm import gemm_fp8_gluon as dense
from tests.triton.gluon_compile_child import compile_check_module

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 (Hopper) GPU")
needs_gluon = pytest.mark.skipif(not dense.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")


def sm90_gpu(test):
    """``@sm90`` and ``@pytest.mark.gpu`` in one: a GPU test that runs only on an sm_90 GPU."""
    return sm90(pytest.mark.gpu(test))


def offsets(lens, device):
    """int64 [G+1] offsets of groups of sizes ``lens`` (0 first) on ``device``."""
    offs = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offs[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return offs.to(device)


def snr(ref, out):
    from primus_turbo.testing import snr_db

    return snr_db(ref.double().cpu(), out.double().cpu())


def assert_refused_on_cpu(blockwise_reason, operand_reason, launcher, operands: tuple) -> None:
    """CPU ``operands``: a reason (naming the device and sm_90 where Gluon imports, the operand half
    then None), and ``launcher`` raises ValueError naming itself."""
    reason = blockwise_reason(*operands)
    assert reason is not None
    if dense.GLUON_AVAILABLE:
        assert operand_reason(*operands) is None
        assert "cpu" in reason and "sm_90" in reason, reason
    with pytest.raises(ValueError, match=launcher.__name__):
        launcher(*operands)


def fake_platform(monkeypatch, module) -> dict:
    """``module.gluon_platform_reason`` answers ``state["reason"]`` (None: as on an sm_90 GPU)."""
    state = {"reason": None}
    monkeypatch.setattr(module, "gluon_platform_reason", lambda device: state["reason"])
    return state


def assert_pinned_gluon_raises_on_cpu(dispatcher, kw) -> None:
    """With the grouped GEMM FP8 backend pinned to GLUON, ``dispatcher`` refuses CPU inputs."""
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType

    if ON_SM90:
        pytest.skip("CPU behaviour")
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.GLUON, precision=PrecisionType.FP8)
    try:
        with pytest.raises(ValueError, match="GLUON"):
            dispatcher.resolve(PrecisionType.FP8, **kw)
    finally:
        GlobalBackendManager.reset()


def compile_report(cfg, out_dtype: str, **kind) -> dict:
    """scripts/gluon_compile_check.py's report of ``cfg`` (``kind``: its ``compile_config`` flags);
    skips without ptxas; asserts no spills, no serialized wgmmas, shared memory within sm_90's."""
    mod = compile_check_module()
    try:
        res = mod.compile_config(cfg, out_dtype, **kind)
    except FileNotFoundError as exc:  # no bundled ptxas in this triton wheel
        pytest.skip(f"ptxas not available: {exc}")
    assert res["spill_bytes"] == 0, res
    assert not res["serialized"], res  # ptxas notes C7514/C7515: wgmmas serialized
    assert res["shared"] <= dense.SMEM_LIMIT, res
    return res


def assert_row_scales_arg(args, kwargs, key: str, cfg, shape: list, base) -> None:
    """The per-row B scales of a launch: the TMA descriptor ``kwargs[key]`` of the ``shape`` scale
    grid ``base`` (shared-memory path), or (register path) a unit-stride operand ``args[4]``."""
    if dense.row_scales_via_smem(cfg):
        desc = kwargs[key]
        assert list(desc.shape) == shape and list(desc.block_shape) == [1, cfg.block_n]
        assert torch.equal(desc.base, base)
    else:
        assert key not in kwargs and args[4].stride(0) == 1
