"""What every op shares: backend dispatch, low-precision formats, environment and logging."""

from .backend import AutoKernelDispatcher, BackendType, GlobalBackendManager, KernelBackend, PrecisionType
from .quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorPair,
    check_quantized_tensor,
    create_quantized_weight,
)
from .low_precision import (
    Float4QuantConfig,
    Float8QuantConfig,
    Format,
    ScaleDtype,
    ScalingGranularity,
    ScalingRecipe,
    ScalingStrategy,
    check_fp8_ocp_support,
    check_fp8_support,
    check_mxfp4_support,
    check_mxfp8_support,
)

__all__ = [
    "AutoKernelDispatcher",
    "BackendType",
    "GlobalBackendManager",
    "KernelBackend",
    "PrecisionType",
    "QuantizedTensor",
    "QuantizedTensorPair",
    "check_quantized_tensor",
    "create_quantized_weight",
    "Float4QuantConfig",
    "Float8QuantConfig",
    "Format",
    "ScaleDtype",
    "ScalingGranularity",
    "ScalingRecipe",
    "ScalingStrategy",
    "check_fp8_ocp_support",
    "check_fp8_support",
    "check_mxfp4_support",
    "check_mxfp8_support",
]
