"""Public functional API: ``turbo.ops.<op>``. Each op validates, dispatches and wires autograd."""

from .activation import geglu_with_probs, swiglu, swiglu_with_probs
from .attention import flash_attn_func, flash_attn_varlen_func
from .attention_fp8 import flash_attn_fp8_func
from .gemm import gemm
from .gemm_fp4 import gemm_fp4, mxfp4_weight_pair
from .gemm_fp8 import gemm_fp8
from .grouped_gemm import grouped_gemm
from .grouped_gemm_fp4 import grouped_gemm_fp4
from .grouped_gemm_fp8 import grouped_gemm_fp8
from .grouped_gemm_glu import grouped_gemm_glu
from .moe_permute import moe_permute, moe_unpermute, token_permute, token_unpermute
from .moe_router import (
    fused_group_topk_routing_with_aux_score,
    indices_to_multihot,
    tokens_per_expert_to_mask,
    update_expert_bias,
)
from .moe_router_gemm import router_gating_linear
from .normalization import rmsnorm, rmsnorm_residual
from .quantization import (
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp4_with_trans,
    quantize_fp8,
    quantize_fp8_with_trans,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_fp8_func",
    "gemm",
    "gemm_fp4",
    "mxfp4_weight_pair",
    "gemm_fp8",
    "grouped_gemm",
    "grouped_gemm_fp4",
    "grouped_gemm_fp8",
    "grouped_gemm_glu",
    "quantize_fp8",
    "quantize_fp8_with_trans",
    "dequantize_fp8",
    "quantize_fp4",
    "quantize_fp4_with_trans",
    "dequantize_fp4",
    "rmsnorm",
    "rmsnorm_residual",
    "swiglu",
    "swiglu_with_probs",
    "geglu_with_probs",
    "fused_group_topk_routing_with_aux_score",
    "indices_to_multihot",
    "tokens_per_expert_to_mask",
    "update_expert_bias",
    "router_gating_linear",
    "moe_permute",
    "moe_unpermute",
    "token_permute",
    "token_unpermute",
]
