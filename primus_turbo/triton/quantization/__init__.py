"""Quantization Triton kernels: FP8 (TENSORWISE, ROWWISE, BLOCKWISE, MX) and MXFP4, quantize and
dequantize, including the one-read row-wise + transposed column-wise variants."""

from __future__ import annotations

from primus_turbo.triton import triton_available

__all__: list[str] = []

if triton_available():
    from .quant_fp4_kernel import fp4_dequant_launch, fp4_quant_launch  # noqa: F401
    from .quant_fp8_kernel import (  # noqa: F401
        QuantGrouping,
        batched_trans_ok,
        fp8_dequant_launch,
        fp8_quant_batched_launch,
        fp8_quant_launch,
        fp8_quant_with_trans_launch,
        tile_config,
        transpose_bytes,
    )

    __all__ += [
        "QuantGrouping",
        "fp8_quant_launch",
        "batched_trans_ok",
        "fp8_quant_batched_launch",
        "fp8_quant_with_trans_launch",
        "fp8_dequant_launch",
        "fp4_quant_launch",
        "fp4_dequant_launch",
        "tile_config",
        "transpose_bytes",
    ]
