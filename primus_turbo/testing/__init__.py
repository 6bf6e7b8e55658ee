"""Testing helpers: error metrics, float64 references, shape selection and real model shapes.

Used by the test suite and the benchmarks; importing it pulls in torch only (no Triton).
"""

from .models import (
    DENSE_BENCH_MODELS,
    MODELS,
    MOE_BENCH_MODELS,
    ModelConfig,
    dense_gemm_shapes,
    get_model,
    moe_gemm_shapes,
)
from .numerics import SNR_THRESHOLDS, assert_snr, max_abs_err, poison_, rel_err, snr_db
from .quant_ref import (
    dequantize_fp4_ref,
    dequantize_fp8_ref,
    fp8_max,
    quantize_fp4_ref,
    quantize_fp8_ref,
)
from .references import (
    attention_mask_ref,
    attention_ref,
    gemm_backward_ref,
    gemm_ref,
    grouped_gemm_ref,
    grouped_gemm_variable_k_ref,
    rmsnorm_ref,
    swiglu_ref,
    swiglu_with_probs_ref,
    geglu_with_probs_ref,
)
from .permute_ref import moe_permute_ref, moe_unpermute_ref, token_permute_ref, token_unpermute_ref
from .moe_ref import group_topk_router_ref, indices_to_multihot_ref, tokens_per_expert_to_mask_ref
from .shapes import is_gpu, pick_shapes

__all__ = [
    "moe_permute_ref",
    "moe_unpermute_ref",
    "token_permute_ref",
    "token_unpermute_ref",
    "group_topk_router_ref",
    "indices_to_multihot_ref",
    "tokens_per_expert_to_mask_ref",
    # numerics
    "SNR_THRESHOLDS",
    "snr_db",
    "rel_err",
    "max_abs_err",
    "assert_snr",
    "poison_",
    # references
    "gemm_ref",
    "gemm_backward_ref",
    "grouped_gemm_ref",
    "grouped_gemm_variable_k_ref",
    "attention_ref",
    "attention_mask_ref",
    "rmsnorm_ref",
    "swiglu_ref",
    "swiglu_with_probs_ref",
    "geglu_with_probs_ref",
    # quantization references
    "fp8_max",
    "quantize_fp8_ref",
    "dequantize_fp8_ref",
    "quantize_fp4_ref",
    "dequantize_fp4_ref",
    # shapes
    "is_gpu",
    "pick_shapes",
    # models
    "ModelConfig",
    "MODELS",
    "DENSE_BENCH_MODELS",
    "MOE_BENCH_MODELS",
    "get_model",
    "dense_gemm_shapes",
    "moe_gemm_shapes",
]
