"""``torch.nn.Module`` layers over ``turbo.ops``: ``turbo.modules.<Layer>``.

* :class:`Linear` / :class:`Float8Linear` (``linear.py``): dense ``y = x W^T + b`` over ``gemm`` /
  ``gemm_fp8``; Megatron ``main_grad`` fusion, FP8 weight cache keyed on ``is_first_microbatch``;
  :class:`RouterLinear`, an fp32 (or other-dtype) router over 16-bit tokens (``router_gating_linear``);
  :func:`convert_to_float8` swaps a model's ``torch.nn.Linear`` layers for :class:`Float8Linear`.
* :class:`GroupedLinear` (``grouped_linear.py``): per-expert weights over ``grouped_gemm(_fp8)``.
* :class:`TurboAttention` (``attention.py``): ``flash_attn_func`` in the bshd layout.
* :class:`RMSNorm` (``normalization.py``): ``rmsnorm``.
* :class:`GroupedMLP` / :class:`MoELayer` (``moe.py``): MoE experts (grouped fc1, SwiGLU/GeGLU with
  routing probs, grouped fc2; bf16 or FP8) and the full layer (router, ``moe_permute``, experts,
  ``moe_unpermute``, optional load-balancing loss or auxiliary-loss-free expert bias, with
  :func:`update_expert_biases` for a whole model), with no host sync when given a capacity.
"""

from .attention import TurboAttention
from .grouped_linear import GroupedLinear
from .linear import Float8Linear, Linear, RouterLinear, convert_to_float8
from .moe import GroupedMLP, MoELayer, update_expert_biases
from .normalization import RMSNorm

__all__ = ["Linear", "Float8Linear", "RouterLinear", "convert_to_float8", "GroupedLinear", "TurboAttention", "RMSNorm",
           "GroupedMLP", "MoELayer", "update_expert_biases"]
