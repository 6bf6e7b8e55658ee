"""``turbo.ops.grouped_gemm_glu``: the MoE experts' first grouped GEMM and the gated activation with
routing probs, ``act(x @ W_g^T)`` per expert, as one op with autograd.

``out = glu(grouped_gemm(x, w, group_lens, group_offs, trans_b=True), probs, row_mask)`` where
``glu`` is ``swiglu_with_probs`` or ``geglu_with_probs``. On sm_90 the Gluon kernel
triton/grouped_gemm/grouped_gemm_glu_gluon.py computes the activation in the GEMM's epilogue from the
stored (rounded) GEMM output: the result is the composition's bit for bit when the composition's
GEMM runs the Gluon kernel, and the activation's pass over ``[M, 2F]`` and its launch are saved.
``PRIMUS_TURBO_GROUPED_GEMM_GLU_FUSED``: ``auto`` (default) fuses where the 16-bit grouped default
runs the problem on Gluon (``gluon16_preferred``: small problems and large groups) and the kernel
can run it, ``1`` wherever the kernel can run, ``0`` never. CPU, fp32, a pinned grouped-GEMM backend
other than GLUON and torch.compile compose the two ops. H200 2026-12-02, MoE layer forward +
backward at 16384 tokens, fused vs the composition with the GEMMs on Gluon, two runs: Mixtral-8x7B
54.09 vs 55.63 and 56.21 vs 55.15 ms (within the run-to-run spread), DeepSeek-V3 55.57 vs 56.50 and
56.76 vs 56.93 ms. :class:`turbo.modules.GroupedMLP` (16-bit, no
hooks on its ``linear_fc1``) routes its fc1 and activation through this op when
:func:`glu_fusion_requested` says so.

Backward (both paths): the activation's backward (``dh``, ``dprobs``) from the saved GEMM output,
then the grouped GEMM's grad_input and grad_weight (or ``main_grad`` accumulation).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends.grouped_gemm import gluon16_preferred, grouped_gemm_dispatcher
from ..core.amp import autocast_dtype, gemm_under_autocast
from ..core.backend import BackendType, PrecisionType
from ..core.env import env_auto_flag
from . import activation as _act
from .gemm import _flag_main_grad
from .grouped_gemm import _check_inputs, _group_offsets, grouped_gemm, grouped_gemm_backward

__all__ = ["grouped_gemm_glu"]

_ACTIVATIONS = {"swiglu": (_act.swiglu_with_probs, _act._ACTS["silu"]),
                "geglu": (_act.geglu_with_probs, _act._ACTS["gelu_tanh"])}
_ENV = "PRIMUS_TURBO_GROUPED_GEMM_GLU_FUSED"


def glu_fusion_requested(x: Optional[torch.Tensor] = None, w: Optional[torch.Tensor] = None) -> bool:
    """Whether the fused kernel is wanted for ``x [M, K]`` and ``w [G, 2F, K]``: the switch at 1, or
    ``auto`` and a CUDA problem the 16-bit grouped default runs on Gluon (``gluon16_preferred``). Shapes
    and the switch only (whether the kernel can run is :func:`_fused_module`'s question).
    :class:`turbo.modules.GroupedMLP` routes its fc1 + activation through :func:`grouped_gemm_glu`
    only then; otherwise it calls its ``linear_fc1`` module (hooks included) and the activation op."""
    flag = env_auto_flag(_ENV)
    if flag is not None:
        return flag
    return (x is not None and w is not None and x.is_cuda and x.dim() == 2 and w.dim() == 3
            and gluon16_preferred(x.size(0), w.size(1), x.size(1), w.size(0)))


def _fused_module(x, w, group_offs, probs, mask):
    """The fused kernel's module when it runs this call, else None (see the module docstring)."""
    if not x.is_cuda or torch.compiler.is_compiling() or not glu_fusion_requested(x, w):
        return None
    backend, _source, tune = grouped_gemm_dispatcher.plan(PrecisionType.BF16_FP16_FP32)
    if tune or backend not in (None, BackendType.GLUON):
        return None
    try:
        from primus_turbo.triton.grouped_gemm import grouped_gemm_glu_gluon as mod
        from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import gluon_grouped_enabled
    except ImportError:
        return None
    if not gluon_grouped_enabled() or mod.gluon_glu_reason(x, w, group_offs, probs, mask) is not None:
        return None
    return mod


class _FusedGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, probs, group_lens, group_offs, mask, activation, fuse_accum, mod):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        h, out = mod.grouped_gemm_glu_gluon(x, w, group_offs, probs, mask, activation, checked=True)
        ctx.act, ctx.fuse_accum = _ACTIVATIONS[activation][1], fuse_accum
        ctx.save_for_backward(x if need_w else None, w if (need_x or (need_w and fuse_accum)) else None, h, probs,
                              mask, group_lens, group_offs)
        return out  # (w.grad_added_to_main_grad: grouped_gemm_glu sets it, see gemm._flag_main_grad)

    @staticmethod
    def backward(ctx, dout):
        x, w, h, probs, mask, group_lens, group_offs = ctx.saved_tensors
        dh, dp = _act._bwd(dout.to(h.dtype).contiguous(), h, ctx.act, probs, mask)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x, grad_w = grouped_gemm_backward(dh, x, w, group_lens, group_offs, True, None, None, None,
                                               ctx.fuse_accum, need_x, need_w)
        return grad_x, grad_w, (dp if ctx.needs_input_grad[2] else None), None, None, None, None, None, None


def grouped_gemm_glu(x: torch.Tensor, w: torch.Tensor, group_lens: torch.Tensor,
                     group_offs: Optional[torch.Tensor] = None, probs: Optional[torch.Tensor] = None,
                     row_mask: Optional[torch.Tensor] = None, activation: str = "swiglu",
                     fuse_bgrad_accum_pattern: Optional[str] = None) -> torch.Tensor:
    """MoE experts' ``fc1`` and gated activation: ``act(h[:, :F]) * h[:, F:] * probs`` with
    ``h = grouped_gemm(x, w, group_lens, group_offs, trans_b=True)``, with autograd, no host sync.

    Args:
        x: ``[M_total, K]`` tokens sorted by expert (float32, float16 or bfloat16).
        w: ``[G, 2F, K]`` expert weights in the ``nn.Linear`` layout, gate rows ``[:F]`` then the
            linear rows ``[F:]``; x's dtype and device.
        group_lens: ``[G]`` int64 on x's device; group_offs: ``[G+1]`` (computed when None).
        probs: float32 ``[M_total]`` routing weight per row (None: no weighting); gets a gradient.
        row_mask: bool / integer ``[M_total]``; rows where it is 0 give exact zeros (and zero
            gradients), whatever ``x`` or ``probs`` hold there. None: every row kept.
        activation: ``"swiglu"`` (``silu(gate) * up``) or ``"geglu"`` (tanh GELU).
        fuse_bgrad_accum_pattern: None or ``"megatron"`` (``w.main_grad`` accumulation, as
            :func:`turbo.ops.grouped_gemm`).

    Returns ``[M_total, F]`` in x's dtype: the composition of :func:`turbo.ops.grouped_gemm` and
    :func:`turbo.ops.swiglu_with_probs` / :func:`turbo.ops.geglu_with_probs`, fused on sm_90 (see the
    module docstring for when).
    """
    if isinstance(x, torch.Tensor) and (amp := autocast_dtype(x)) is not None:  # x and w, as grouped_gemm
        return gemm_under_autocast(grouped_gemm_glu, amp, x, w, group_lens, group_offs, probs, row_mask, activation,
                                   fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"grouped_gemm_glu: activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    _check_inputs(x, w, group_lens, group_offs, True, None, fuse_bgrad_accum_pattern, "grouped_gemm_glu", ("x", "w"))
    if w.shape[1] % 2:
        raise ValueError(f"grouped_gemm_glu: w must be [G, 2F, K] with an even row count, got {tuple(w.shape)}")
    glu = _ACTIVATIONS[activation][0]
    m = x.shape[0]
    if probs is None:
        probs = torch.ones(m, dtype=torch.float32, device=x.device)
    _act._check_row_args("grouped_gemm_glu", x, probs, row_mask)
    group_offs = _group_offsets("grouped_gemm_glu", group_lens, group_offs, x)
    if glu_fusion_requested(x, w):
        mask = _act._mask_arg(row_mask) if row_mask is not None else torch.ones(m, dtype=torch.uint8, device=x.device)
        mod = _fused_module(x, w, group_offs, probs, mask)
        if mod is not None:
            fuse = fuse_bgrad_accum_pattern == "megatron"
            out = _FusedGLUFunction.apply(x, w, probs, group_lens, group_offs, mask, activation, fuse, mod)
            if fuse and w.requires_grad and torch.is_grad_enabled():
                _flag_main_grad(w)
            return out
    h = grouped_gemm(x, w, group_lens, group_offs, trans_b=True, fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
    return glu(h, probs, row_mask)
