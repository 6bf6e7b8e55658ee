"""Low-precision formats, scaling recipes and capability checks.

FP8 here is OCP ``float8_e4m3fn`` / ``float8_e5m2`` (what Hopper's tensor cores take). Hopper has
no MX or FP4 tensor cores: MXFP8 and MXFP4 run as exact emulation, and the checks below say so.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple, Optional

import torch

__all__ = [
    "Format",
    "ScalingGranularity",
    "ScalingStrategy",
    "ScaleDtype",
    "ScalingRecipe",
    "MXScalingRecipe",
    "Float8QuantConfig",
    "Float4QuantConfig",
    "MXFP8_BLOCK_SIZE",
    "MXFP4_BLOCK_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "float8_e4m3",
    "float8_e5m2",
    "float4_e2m1fn_x2",
    "is_fp8_dtype",
    "is_fp4_dtype",
    "check_fp8_support",
    "check_fp8_ocp_support",
    "check_mxfp8_support",
    "check_mxfp4_support",
]

MXFP8_BLOCK_SIZE = 32
MXFP4_BLOCK_SIZE = 32
MXFP8_PADDING_ALIGN_SIZE = 128
MXFP4_PADDING_ALIGN_SIZE = 128
DEFAULT_BLOCK_SIZE = 128

float8_e4m3 = torch.float8_e4m3fn
float8_e5m2 = torch.float8_e5m2
float4_e2m1fn_x2 = getattr(torch, "float4_e2m1fn_x2", None)


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    #: E4M3 for forward operands, E5M2 for output gradients in backward
    HYBRID = "HYBRID"
    #: FP4 E2M1, two values packed per byte
    E2M1_X2 = "E2M1_X2"


class ScalingGranularity(enum.Enum):
    TENSORWISE = "TENSORWISE"  # one fp32 scale per tensor
    ROWWISE = "ROWWISE"  # one fp32 scale per row (or column) along an axis
    BLOCKWISE = "BLOCKWISE"  # 1 x block for activations, block x block for weights (DeepSeek-V3)
    MX_BLOCKWISE = "MX_BLOCKWISE"  # OCP MX: 1 x 32 blocks with E8M0 (power-of-two) scales


class ScalingStrategy(enum.Enum):
    DYNAMIC = "DYNAMIC"  # scales from the current tensor's amax


class ScaleDtype(enum.Enum):
    FP32 = "FP32"
    E8M0 = "E8M0"


class ScalingRecipe(NamedTuple):
    use_2d_block: bool = False  # 2-D (block x block) scaling, used for weights
    use_sr: bool = False  # stochastic rounding (MXFP4 gradients)
    use_rht: bool = False  # random Hadamard transform before MXFP4 quantization
    #: AMD AITER/hipBLASLt preshuffled scale layout: accepted for API compatibility, but every op
    #: that takes a recipe raises ``ValueError`` when it is True (see :func:`check_scaling_recipe`)
    shuffle_scale: bool = False
    #: AMD AITER/hipBLASLt preshuffled data layout: likewise rejected when True
    shuffle_out: bool = False


#: the name older Primus-Turbo builds (and code written against them) use for :class:`ScalingRecipe`
MXScalingRecipe = ScalingRecipe


_PRESHUFFLE_FIELDS = (("shuffle_scale", "scale"), ("shuffle_out", "data"))


def check_scaling_recipe(recipe, op: str) -> Optional[ScalingRecipe]:
    """Validate a ``scaling_recipe`` argument of ``op``; return it (None stays None).

    ``TypeError`` unless it is a :class:`ScalingRecipe` or None. ``ValueError`` when it asks for
    an AMD AITER/hipBLASLt preshuffled layout (``shuffle_scale`` / ``shuffle_out``): the kernels
    here read and write plain row-major data and scales only, so the request cannot be honoured.
    The recipe's other fields are each op's to interpret."""
    if recipe is None:
        return None
    if not isinstance(recipe, ScalingRecipe):
        raise TypeError(f"{op}: scaling_recipe must be a ScalingRecipe or None, got {type(recipe).__name__}")
    for field, what in _PRESHUFFLE_FIELDS:
        if getattr(recipe, field):
            raise ValueError(
                f"{op}: ScalingRecipe.{field}=True (AMD AITER/hipBLASLt preshuffled {what} layout) is not "
                f"supported on this platform: the Hopper kernels use plain row-major data and scales; pass "
                f"{field}=False"
            )
    return recipe


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def is_fp4_dtype(dtype: torch.dtype) -> bool:
    return float4_e2m1fn_x2 is not None and dtype == float4_e2m1fn_x2


def _coerce_enum(cls, value, field: str):
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls[value.upper()]
        except KeyError:
            pass
    valid = ", ".join(m.name for m in cls)
    raise ValueError(f"{field}={value!r} is not a {cls.__name__}; valid: {valid}")


@dataclasses.dataclass(frozen=True)
class Float8QuantConfig:
    """How FP8 operands are formed. Frozen and hashable: usable as a cache key.

    ``block_size`` is required for BLOCKWISE (128 in GEMMs) and must be 32 for MX_BLOCKWISE,
    whose scales are E8M0.
    """

    format: Format = Format.E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    strategy: ScalingStrategy = ScalingStrategy.DYNAMIC
    scale_dtype: ScaleDtype = ScaleDtype.FP32
    block_size: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "format", _coerce_enum(Format, self.format, "format"))
        object.__setattr__(self, "granularity", _coerce_enum(ScalingGranularity, self.granularity, "granularity"))
        object.__setattr__(self, "strategy", _coerce_enum(ScalingStrategy, self.strategy, "strategy"))
        object.__setattr__(self, "scale_dtype", _coerce_enum(ScaleDtype, self.scale_dtype, "scale_dtype"))
        if self.format == Format.E2M1_X2:
            raise ValueError("Float8QuantConfig: format E2M1_X2 is FP4; use Float4QuantConfig")
        g = self.granularity
        if g == ScalingGranularity.BLOCKWISE:
            if self.block_size is None:
                object.__setattr__(self, "block_size", DEFAULT_BLOCK_SIZE)
            if not isinstance(self.block_size, int) or self.block_size <= 0 or self.block_size % 16:
                raise ValueError(
                    f"Float8QuantConfig: BLOCKWISE needs a positive block_size that is a multiple of 16, "
                    f"got {self.block_size!r}"
                )
            if self.scale_dtype != ScaleDtype.FP32:
                raise ValueError(f"Float8QuantConfig: BLOCKWISE uses FP32 scales, got {self.scale_dtype.name}")
        elif g == ScalingGranularity.MX_BLOCKWISE:
            if self.block_size is None:
                object.__setattr__(self, "block_size", MXFP8_BLOCK_SIZE)
            if self.block_size != MXFP8_BLOCK_SIZE:
                raise ValueError(f"Float8QuantConfig: MX_BLOCKWISE needs block_size=32, got {self.block_size!r}")
            if self.scale_dtype != ScaleDtype.E8M0:
                object.__setattr__(self, "scale_dtype", ScaleDtype.E8M0)
        else:
            if self.block_size is not None:
                raise ValueError(f"Float8QuantConfig: block_size is only for BLOCKWISE/MX_BLOCKWISE, got {g.name}")
            if self.scale_dtype != ScaleDtype.FP32:
                raise ValueError(f"Float8QuantConfig: {g.name} uses FP32 scales, got {self.scale_dtype.name}")

    def fwd_dtype(self) -> torch.dtype:
        """FP8 dtype of forward operands (activations and weights)."""
        return float8_e5m2 if self.format == Format.E5M2 else float8_e4m3

    def bwd_dtype(self) -> torch.dtype:
        """FP8 dtype of output gradients in backward (E5M2 under HYBRID)."""
        return float8_e4m3 if self.format == Format.E4M3 else float8_e5m2


@dataclasses.dataclass(frozen=True)
class Float4QuantConfig:
    """MXFP4: E2M1 values packed two per byte, one E8M0 scale per 32 elements.

    ``use_preshuffle`` (the reference API's AITER preshuffled layout) must be False: True raises
    ``ValueError``. ``use_rht`` (an extension here, after the reference fields) runs the
    grad_weight GEMM on randomly Hadamard-transformed operands (see :func:`turbo.ops.gemm_fp4`)."""

    format: Format = Format.E2M1_X2
    granularity: ScalingGranularity = ScalingGranularity.MX_BLOCKWISE
    strategy: ScalingStrategy = ScalingStrategy.DYNAMIC
    scale_dtype: ScaleDtype = ScaleDtype.E8M0
    block_size: int = MXFP4_BLOCK_SIZE
    use_gradient_sr: bool = False
    #: AMD AITER preshuffled weight/scale layout: must be False here (``ValueError`` otherwise)
    use_preshuffle: bool = False
    use_rht: bool = False

    def __post_init__(self):
        object.__setattr__(self, "format", _coerce_enum(Format, self.format, "format"))
        object.__setattr__(self, "granularity", _coerce_enum(ScalingGranularity, self.granularity, "granularity"))
        object.__setattr__(self, "strategy", _coerce_enum(ScalingStrategy, self.strategy, "strategy"))
        object.__setattr__(self, "scale_dtype", _coerce_enum(ScaleDtype, self.scale_dtype, "scale_dtype"))
        if self.format != Format.E2M1_X2:
            raise ValueError(f"Float4QuantConfig: format must be E2M1_X2, got {self.format.name}")
        if self.granularity != ScalingGranularity.MX_BLOCKWISE:
            raise ValueError(f"Float4QuantConfig: granularity must be MX_BLOCKWISE, got {self.granularity.name}")
        if self.scale_dtype != ScaleDtype.E8M0:
            raise ValueError(f"Float4QuantConfig: scale_dtype must be E8M0, got {self.scale_dtype.name}")
        if self.block_size != MXFP4_BLOCK_SIZE:
            raise ValueError(f"Float4QuantConfig: block_size must be 32, got {self.block_size!r}")
        if self.use_preshuffle:
            raise ValueError(
                f"Float4QuantConfig: use_preshuffle={self.use_preshuffle!r} (AMD AITER preshuffled FP4 weight and "
                f"scale layout) is not supported on this platform: the Hopper MXFP4 GEMMs read plain row-major "
                f"packed FP4 data and E8M0 scales; use use_preshuffle=False"
            )


def _device_capability(device=None) -> Optional[tuple[int, int]]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def check_fp8_support(device=None) -> tuple[bool, str]:
    """FP8 tensor cores: sm_89 and newer (Hopper is sm_90)."""
    cap = _device_capability(device)
    if cap is None:
        return False, "no CUDA device; FP8 ops run only through the reference/interpreter paths"
    if cap >= (8, 9):
        return True, f"native FP8 (E4M3/E5M2) tensor cores on sm_{cap[0]}{cap[1]}"
    return False, f"sm_{cap[0]}{cap[1]} has no FP8 tensor cores (needs sm_89 or newer)"


def check_fp8_ocp_support(device=None) -> tuple[bool, str]:
    """OCP FP8 (``float8_e4m3fn`` / ``float8_e5m2``, the formats :data:`float8_e4m3` and
    :data:`float8_e5m2` name here): every NVIDIA GPU with FP8 tensor cores uses them (there is no
    FNUZ variant to rule out), so this is :func:`check_fp8_support`."""
    ok, why = check_fp8_support(device)
    return ok, (f"OCP {why}" if ok else why)


def check_mxfp8_support(device=None) -> tuple[bool, str]:
    """MXFP8: native on sm_100+; on Hopper an exact emulation on BF16 tensor cores.

    Hopper has no block-scaled MMA, so the MX path of the Triton FP8 GEMM widens each FP8 tile to
    bf16 with its power-of-two E8M0 scales folded in (exact) and runs a bf16 MMA with fp32
    accumulation (primus_turbo/triton/gemm/gemm_fp8_kernel.py). That kernel serves every FP8
    mode and takes sm_89+ only, hence the same floor here."""
    cap = _device_capability(device)
    if cap is None:
        return False, "no CUDA device"
    if cap >= (10, 0):
        return True, f"native MX block-scaled tensor cores on sm_{cap[0]}{cap[1]}"
    if cap >= (8, 9):
        return True, (f"emulated on sm_{cap[0]}{cap[1]}: FP8 operands widened in-kernel to bf16 with their E8M0 "
                      f"block scales folded in (exact), then a bf16 MMA with fp32 accumulation")
    return False, (f"sm_{cap[0]}{cap[1]} is below sm_89, which the FP8 GEMM kernel (MX emulation included) "
                   f"needs")


def check_mxfp4_support(device=None) -> tuple[bool, str]:
    """MXFP4: native on sm_100+; on Hopper FP4 is decoded in-kernel and computed on 16-bit units."""
    cap = _device_capability(device)
    if cap is None:
        return False, "no CUDA device"
    if cap >= (10, 0):
        return True, f"native FP4 tensor cores on sm_{cap[0]}{cap[1]}"
    if cap >= (8, 0):
        return True, f"emulated on sm_{cap[0]}{cap[1]}: E2M1 decoded in-kernel, computed on BF16 tensor cores"
    return False, f"sm_{cap[0]}{cap[1]} is too old for the MXFP4 emulation (needs sm_80 or newer)"
