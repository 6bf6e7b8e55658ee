"""Grouped (per-expert) linear layer over ``turbo.ops.grouped_gemm`` / ``turbo.ops.grouped_gemm_fp8``."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..core.low_precision import Float8QuantConfig
from ..ops.grouped_gemm import grouped_gemm
from ..ops.grouped_gemm_fp8 import grouped_gemm_fp8
from .linear import _fuse_pattern

__all__ = ["GroupedLinear"]


class GroupedLinear(torch.nn.Module):
    """``num_groups`` independent linear maps (MoE experts) over tokens sorted by group.

    ``weight`` is ``[num_groups, out_features, in_features]`` (the ``nn.Linear`` layout per group),
    each group initialised as ``torch.nn.Linear`` would. No bias.

    ``forward(x, group_lens, group_offs=None)``: ``x [M_total, in_features]`` with the rows of group
    ``g`` at ``group_offs[g] : group_offs[g] + group_lens[g]`` (``group_lens`` int64 ``[G]`` on x's
    device); returns ``[M_total, out_features]``, row ``r`` of group ``g`` being ``x[r] @ W[g]^T``
    (rows past ``sum(group_lens)`` give zeros). Runs :func:`turbo.ops.grouped_gemm` (``trans_b=True``),
    or :func:`turbo.ops.grouped_gemm_fp8` when ``config`` (a :class:`Float8QuantConfig`) is given.
    With ``weight.main_grad`` present (Megatron) the weight gradient is accumulated into it in the
    kernel epilogue (``fuse_bgrad_accum_pattern="megatron"``).
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, dtype=None, device=None,
                 config: Optional[Float8QuantConfig] = None):
        super().__init__()
        if num_groups <= 0 or in_features <= 0 or out_features <= 0:
            raise ValueError(f"GroupedLinear: sizes must be positive, got num_groups={num_groups}, "
                             f"in_features={in_features}, out_features={out_features}")
        if config is not None and not isinstance(config, Float8QuantConfig):
            raise TypeError(f"GroupedLinear: config must be a Float8QuantConfig or None, got {type(config).__name__}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.config = config
        self.weight = torch.nn.Parameter(torch.empty(num_groups, out_features, in_features, dtype=dtype,
                                                     device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for g in range(self.num_groups):
            torch.nn.init.kaiming_uniform_(self.weight.data[g], a=math.sqrt(5))

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}"
                f", config={self.config}")

    def forward(self, x: torch.Tensor, group_lens: torch.Tensor,
                group_offs: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"GroupedLinear: x must be [M_total, {self.in_features}], got {tuple(x.shape)}")
        fuse = _fuse_pattern(self.weight)
        if self.config is None:
            return grouped_gemm(x, self.weight, group_lens, group_offs, trans_b=True, fuse_bgrad_accum_pattern=fuse)
        return grouped_gemm_fp8(x, self.weight, group_lens, group_offs, trans_b=True, config=self.config,
                                fuse_bgrad_accum_pattern=fuse)
