"""Quantization configs are frozen, validated and hashable; capability checks tell the truth."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import (
    Float4QuantConfig,
    Float8QuantConfig,
    Format,
    ScaleDtype,
    ScalingGranularity,
    check_fp8_ocp_support,
    check_fp8_support,
    check_mxfp4_support,
    check_mxfp8_support,
)


def test_dtype_aliases():
    assert turbo.float8_e4m3 is torch.float8_e4m3fn
    assert turbo.float8_e5m2 is torch.float8_e5m2
    assert turbo.float4_e2m1fn_x2 is getattr(torch, "float4_e2m1fn_x2", None)


def test_fp8_config_defaults_and_hash():
    a = Float8QuantConfig()
    assert a.format is Format.E4M3 and a.granularity is ScalingGranularity.TENSORWISE
    assert a.block_size is None and a.scale_dtype is ScaleDtype.FP32
    b = Float8QuantConfig(format="e4m3", granularity="tensorwise")
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.format = Format.E5M2  # type: ignore[misc]


def test_fp8_config_blockwise_and_mx():
    blk = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE)
    assert blk.block_size == 128
    mx = Float8QuantConfig(granularity=ScalingGranularity.MX_BLOCKWISE)
    assert mx.block_size == 32 and mx.scale_dtype is ScaleDtype.E8M0


def test_fp8_config_dtypes():
    assert Float8QuantConfig(format=Format.HYBRID).fwd_dtype() is torch.float8_e4m3fn
    assert Float8QuantConfig(format=Format.HYBRID).bwd_dtype() is torch.float8_e5m2
    assert Float8QuantConfig(format=Format.E5M2).fwd_dtype() is torch.float8_e5m2
    assert Float8QuantConfig(format=Format.E4M3).bwd_dtype() is torch.float8_e4m3fn


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(granularity=ScalingGranularity.MX_BLOCKWISE, block_size=64), "MX_BLOCKWISE needs block_size=32, got 64"),
        (dict(granularity=ScalingGranularity.BLOCKWISE, block_size=100), "multiple of 16, got 100"),
        (dict(granularity=ScalingGranularity.TENSORWISE, block_size=128), "block_size is only for"),
        (dict(granularity=ScalingGranularity.ROWWISE, scale_dtype=ScaleDtype.E8M0), "ROWWISE uses FP32 scales"),
        (dict(format="E3M4"), "format='E3M4' is not a Format"),
        (dict(format=Format.E2M1_X2), "use Float4QuantConfig"),
    ],
)
def test_fp8_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Float8QuantConfig(**kwargs)


def test_fp4_config():
    c = Float4QuantConfig()
    assert c.block_size == 32 and c.scale_dtype is ScaleDtype.E8M0 and hash(c) == hash(Float4QuantConfig())
    with pytest.raises(ValueError, match="block_size must be 32"):
        Float4QuantConfig(block_size=16)
    with pytest.raises(ValueError, match="granularity must be MX_BLOCKWISE"):
        Float4QuantConfig(granularity=ScalingGranularity.TENSORWISE)


@pytest.mark.parametrize("check", [check_fp8_support, check_fp8_ocp_support, check_mxfp8_support,
                                   check_mxfp4_support])
def test_capability_checks_tell_the_truth(check):
    ok, reason = check()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    if not torch.cuda.is_available():
        assert ok is False and "no CUDA device" in reason
    else:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) == (9, 0):
            assert ok is True
            if check is check_fp8_ocp_support:
                assert reason.startswith("OCP")
            elif check is not check_fp8_support:
                assert "emulated" in reason  # Hopper has no MX/FP4 tensor cores


def test_mx_scaling_recipe_is_the_older_name():
    from primus_turbo.pytorch.core.low_precision import MXScalingRecipe, ScalingRecipe

    assert MXScalingRecipe is ScalingRecipe
    assert MXScalingRecipe(use_sr=True) == ScalingRecipe(use_sr=True)


# ---- reference-API fields: ScalingRecipe.shuffle_*, Float4QuantConfig.use_preshuffle ----------
def test_scaling_recipe_has_the_reference_fields_in_order():
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe

    assert ScalingRecipe._fields == ("use_2d_block", "use_sr", "use_rht", "shuffle_scale", "shuffle_out")
    assert ScalingRecipe() == (False,) * 5
    r = ScalingRecipe(True, False, False, False, False)  # positional, as the reference allows
    assert r.use_2d_block and not r.shuffle_scale and not r.shuffle_out


@pytest.mark.parametrize("field", ["shuffle_scale", "shuffle_out"])
def test_check_scaling_recipe_rejects_preshuffle(field):
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe, check_scaling_recipe

    assert check_scaling_recipe(None, "op") is None
    ok = ScalingRecipe(use_2d_block=True, use_sr=True, use_rht=True)
    assert check_scaling_recipe(ok, "op") is ok
    with pytest.raises(ValueError, match=rf"my_op: ScalingRecipe\.{field}=True \(AMD AITER/hipBLASLt preshuffled .*"
                                         rf"not supported on this platform"):
        check_scaling_recipe(ScalingRecipe(**{field: True}), "my_op")
    with pytest.raises(TypeError, match="my_op: scaling_recipe must be a ScalingRecipe or None, got tuple"):
        check_scaling_recipe((False, False), "my_op")


def test_fp4_config_use_preshuffle():
    names = [f.name for f in dataclasses.fields(Float4QuantConfig)]
    assert names == ["format", "granularity", "strategy", "scale_dtype", "block_size", "use_gradient_sr",
                     "use_preshuffle", "use_rht"]
    c = Float4QuantConfig(use_preshuffle=False)
    assert c == Float4QuantConfig() and c.use_preshuffle is False
    # the reference's positional order: ..., block_size, use_gradient_sr, use_preshuffle
    assert Float4QuantConfig(Format.E2M1_X2, ScalingGranularity.MX_BLOCKWISE, "DYNAMIC", ScaleDtype.E8M0, 32, True,
                             False) == Float4QuantConfig(use_gradient_sr=True)
    with pytest.raises(ValueError, match=r"Float4QuantConfig: use_preshuffle=True \(AMD AITER preshuffled .*"
                                         r"not supported on this platform"):
        Float4QuantConfig(use_preshuffle=True)
