"""``torch.nn.Module`` layers over ``turbo.ops``: ``turbo.modules.<Layer>``.

* :class:`Linear` / :class:`Float8Linear` (``linear.py``): dense ``y = x W^T + b`` over ``gemm`` /
  ``gemm_fp8``; Megatron ``main_grad`` fusion, FP8 weight cache keyed on ``is_first_microbatch``.
* :class:`GroupedLinear` (``grouped_linear.py``): per-expert weights over ``grouped_gemm(_fp8)``.
* :class:`TurboAttention` (``attention.py``): ``flash_attn_func`` in the bshd layout.
* :class:`RMSNorm` (``normalization.py``): ``rmsnorm``.
"""

from .attention import TurboAttention
from .grouped_linear import GroupedLinear
from .linear import Float8Linear, Linear
from .normalization import RMSNorm

__all__ = ["Linear", "Float8Linear", "GroupedLinear", "TurboAttention", "RMSNorm"]
