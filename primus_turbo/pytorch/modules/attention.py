"""Attention layer over ``turbo.ops.flash_attn_func`` (bshd layout)."""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.attention import flash_attn_func

__all__ = ["TurboAttention"]


class TurboAttention(torch.nn.Module):
    """Parameter-free softmax attention: ``softmax(q k^T * scale [+ mask], plus sink) v``.

    Args:
        softmax_scale: default ``1 / sqrt(head_dim_qk)``.
        causal: bottom-right aligned causal mask (as flash-attention).
        window_size: ``(left, right)`` sliding window, ``-1`` unbounded.
        deterministic: ask for a bitwise-reproducible backward.
        return_lse: ``forward`` returns ``(out, lse)`` (lse fp32 ``[b, h, s_q]``, not differentiable).

    ``forward(q, k, v, sink=None)``: q ``[b, s_q, h_q, d]``, k ``[b, s_kv, h_kv, d]``, v
    ``[b, s_kv, h_kv, d_v]`` (GQA/MQA when ``h_q % h_kv == 0``); ``sink`` optional fp32 ``[h_q]``
    learned logits (receives a gradient). Returns ``[b, s_q, h_q, d_v]``. See
    :func:`turbo.ops.flash_attn_func` for the backends and limits (no dropout, bias or ALiBi).
    """

    def __init__(self, softmax_scale: Optional[float] = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), deterministic: bool = False, return_lse: bool = False):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.causal = bool(causal)
        self.window_size = (int(window_size[0]), int(window_size[1]))
        self.deterministic = bool(deterministic)
        self.return_lse = bool(return_lse)

    def extra_repr(self) -> str:
        return (f"softmax_scale={self.softmax_scale}, causal={self.causal}, window_size={self.window_size}, "
                f"deterministic={self.deterministic}, return_lse={self.return_lse}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: Optional[torch.Tensor] = None):
        return flash_attn_func(q, k, v, softmax_scale=self.softmax_scale, causal=self.causal,
                               window_size=self.window_size, deterministic=self.deterministic,
                               return_lse=self.return_lse, sink=sink)
