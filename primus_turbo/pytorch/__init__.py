"""primus-turbo's PyTorch API: ``import primus_turbo.pytorch as turbo``.

``turbo.ops`` (functional ops with autograd), ``turbo.modules`` (nn.Module layers), ``turbo.core``
(backend dispatch, low-precision configs) and the dtype aliases below.
"""

from . import core, modules, ops
from .core.backend import BackendType, GlobalBackendManager, PrecisionType
from .core.low_precision import (
    Float4QuantConfig,
    Float8QuantConfig,
    Format,
    ScaleDtype,
    ScalingGranularity,
    float4_e2m1fn_x2,
    float8_e4m3,
    float8_e5m2,
)

__all__ = [
    "core",
    "modules",
    "ops",
    "BackendType",
    "GlobalBackendManager",
    "PrecisionType",
    "Float4QuantConfig",
    "Float8QuantConfig",
    "Format",
    "ScaleDtype",
    "ScalingGranularity",
    "float8_e4m3",
    "float8_e5m2",
    "float4_e2m1fn_x2",
]
