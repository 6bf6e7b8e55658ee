"""Attention layer over ``turbo.ops.flash_attn_func`` / ``turbo.ops.flash_attn_fp8_func`` (bshd layout)."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from ..core.low_precision import Float8QuantConfig
from ..ops.attention import flash_attn_func
from ..ops.attention_fp8 import _block_size as _fp8_attn_block_size
from ..ops.attention_fp8 import flash_attn_fp8_func

__all__ = ["TurboAttention"]


class TurboAttention(torch.nn.Module):
    """Parameter-free softmax attention: ``softmax(q k^T * scale [+ mask], plus sink) v``.

    The constructor takes Primus-Turbo's parameters in Primus-Turbo's order, so positional calls
    written for Primus-Turbo bind the same way here (``TurboAttention(0.0, None, True)`` is
    ``dropout_p=0.0, softmax_scale=None, causal=True``).

    Args:
        dropout_p: must be 0 (attention dropout is not implemented: NotImplementedError).
        softmax_scale: default ``1 / sqrt(head_dim_qk)``.
        causal: bottom-right aligned causal mask (as flash-attention).
        window_size: ``(left, right)`` sliding window, ``-1`` unbounded.
        alibi_slopes: must be None (ALiBi is not implemented: NotImplementedError).
        deterministic: ask for a bitwise-reproducible backward.
        return_lse: ``forward`` returns ``(out, lse)`` (lse fp32 ``[b, h, s_q]``, not differentiable).
        return_attn_probs: must be False (NotImplementedError; use ``return_lse``).
        fp8_config: None runs :func:`turbo.ops.flash_attn_func`; a :class:`Float8QuantConfig` runs
            :func:`turbo.ops.flash_attn_fp8_func` with it (FP8 E4M3 forward and backward; only
            ``format=E4M3, granularity=BLOCKWISE`` with ``block_size`` 32/64/128/256 is supported,
            checked here: NotImplementedError naming the field otherwise; q/k/v bf16 or fp16).
        ulysses_group, ring_group: must be None: context parallelism (Ulysses all-to-all / ring
            attention) is not implemented (NotImplementedError).

    The unsupported options raise at construction, not at the first forward.

    ``forward(q, k, v, bias=None, sink=None)``: q ``[b, s_q, h_q, d]``, k ``[b, s_kv, h_kv, d]``, v
    ``[b, s_kv, h_kv, d_v]`` (GQA/MQA when ``h_q % h_kv == 0``); ``bias`` is Primus-Turbo's
    additive attention bias, passed to the op, which raises NotImplementedError for anything but
    None; ``sink`` (keyword; an extension, not in Primus-Turbo) optional fp32 ``[h_q]`` learned
    logits (receives a gradient). Returns ``[b, s_q, h_q, d_v]``. See
    :func:`turbo.ops.flash_attn_func` / :func:`turbo.ops.flash_attn_fp8_func` for the backends and
    limits.
    """

    def __init__(self, dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), alibi_slopes: Optional[torch.Tensor] = None,
                 deterministic: bool = False, return_lse: bool = False, return_attn_probs: bool = False,
                 fp8_config: Optional[Float8QuantConfig] = None, ulysses_group=None, ring_group=None):
        super().__init__()
        name = type(self).__name__
        if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
            raise TypeError(f"{name}: dropout_p must be a float, got {dropout_p!r}")
        if dropout_p != 0:
            raise NotImplementedError(f"{name}: dropout_p={dropout_p} is not implemented (attention dropout); "
                                      "only dropout_p=0.0 is supported")
        if alibi_slopes is not None:
            raise NotImplementedError(f"{name}: alibi_slopes (ALiBi) is not implemented; only alibi_slopes=None "
                                      "is supported")
        if return_attn_probs:
            raise NotImplementedError(f"{name}: return_attn_probs={return_attn_probs!r} is not implemented "
                                      "(use return_lse=True for the log-sum-exp)")
        if ulysses_group is not None or ring_group is not None:
            given = ", ".join(n for n, g in (("ulysses_group", ulysses_group), ("ring_group", ring_group))
                              if g is not None)
            raise NotImplementedError(f"{name}: context parallelism (Ulysses / ring attention) is not implemented; "
                                      f"{given} must be None")
        if softmax_scale is not None and (not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool)
                                          or not math.isfinite(softmax_scale)):
            raise ValueError(f"{name}: softmax_scale must be a finite float or None, got {softmax_scale!r}")
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1
                           for w in window_size)):
            raise ValueError(f"{name}: window_size must be (left, right) ints >= -1 (-1 = unbounded), "
                             f"got {window_size!r}")
        if fp8_config is not None:
            if not isinstance(fp8_config, Float8QuantConfig):
                raise TypeError(f"{name}: fp8_config must be a Float8QuantConfig or None, got "
                                f"{type(fp8_config).__name__}")
            _fp8_attn_block_size(fp8_config)  # the FP8 op's own check: NotImplementedError naming the field
        self.dropout_p = float(dropout_p)
        self.softmax_scale = softmax_scale
        self.causal = bool(causal)
        self.window_size = (int(window_size[0]), int(window_size[1]))
        self.deterministic = bool(deterministic)
        self.return_lse = bool(return_lse)
        self.return_attn_probs = False
        self.fp8_config = fp8_config

    def extra_repr(self) -> str:
        return (f"dropout_p={self.dropout_p}, softmax_scale={self.softmax_scale}, causal={self.causal}, "
                f"window_size={self.window_size}, deterministic={self.deterministic}, "
                f"return_lse={self.return_lse}, fp8_config={self.fp8_config}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor] = None,
                sink: Optional[torch.Tensor] = None):
        kwargs = dict(dropout_p=self.dropout_p, softmax_scale=self.softmax_scale, causal=self.causal,
                      window_size=self.window_size, bias=bias, deterministic=self.deterministic,
                      return_lse=self.return_lse, sink=sink)
        if self.fp8_config is not None:
            return flash_attn_fp8_func(q, k, v, fp8_config=self.fp8_config, **kwargs)
        return flash_attn_func(q, k, v, **kwargs)
