"""MXFP4 grouped GEMM of MoE experts: ``turbo.ops.grouped_gemm_fp4`` (emulated on Hopper).

Semantics as :func:`turbo.ops.grouped_gemm` / :func:`turbo.ops.grouped_gemm_fp8` (rows of ``a``
split into ``G`` consecutive groups by ``group_lens``; group ``g`` times expert ``g``'s weight
``op(b[g])``; rows past ``offs[G]`` zero), with all three GEMMs of training on MXFP4 operands
(E2M1 packed two per byte, one E8M0 scale per 32 elements, docs/low_precision.md), each operand
quantized in 1 x 32 blocks along its GEMM's K, as the dense :func:`turbo.ops.gemm_fp4`:

* output:      M-grouped GEMM of ``a`` (along K) with the weights quantized along K per expert.
* grad_input:  M-grouped GEMM of ``dC`` (along N) with the weights' copy quantized along N.
* grad_weight: variable-K grouped GEMM over each group's tokens. The 32-token blocks must not
  straddle two experts, so ``dC`` and ``a`` are gathered on the device into a token layout whose
  group segments are padded with zero rows to multiples of 32 (static size ``M_total + 32 G``
  rounded up: no host sync and no condition on ``group_lens``) and quantized along the tokens there;
  zero rows change no block's scale and add nothing to the GEMM (the same scheme as MX_BLOCKWISE in
  ``grouped_gemm_fp8``).

Training-recipe options of :class:`Float4QuantConfig`, as in :func:`turbo.ops.gemm_fp4`
(docs/low_precision.md, "MXFP4 training options"):

* ``use_gradient_sr``: ``dC``'s two copies (grad_input's, and grad_weight's in the padded token
  layout) are quantized with stochastic rounding, seeds drawn on the device; the forward keeps RNE.
  Padding rows stay zero (zero is exact, so no rounding moves it).
* ``use_rht``: grad_weight runs on ``a`` and ``dC`` transformed along the tokens, in blocks of 32
  of the padded token layout, with the same 32 random signs (drawn on the device in forward, kept
  for backward). Every block lies inside one expert's segment, so each expert's product is
  preserved: ``(R^T X_g)^T (R^T dY_g) = X_g^T dY_g`` for the orthogonal block-diagonal ``R``; the
  padding rows are zeros inside their block. Forward and grad_input are unchanged.

Pre-quantized weights (quantized once per step, reused across micro-batches, as
``grouped_gemm_fp8`` allows): ``b`` may be a 3-D MXFP4 ``QuantizedTensor`` or a
``QuantizedTensorPair`` (``turbo.ops.gemm_fp4``'s ``mxfp4_weight_pair(w)``: ``data`` each expert
grouped along its last dim, ``data_t`` each expert's transpose grouped along its last dim). One
grouped along the last dim is the forward copy with ``trans_b=True`` (the grad_input copy without),
one grouped along dim 1 the other; a pair supplies both. A copy that the forward or grad_input
needs and ``b`` lacks raises ``ValueError`` naming it. The copies are exactly the on-the-fly ones
(1 x 32 per expert, round-to-nearest-even), so the results are bit-identical; operands quantized
otherwise (FP8 data: ``TypeError``; another granularity or block, stochastic rounding, the Hadamard
transform: ``ValueError``) are refused by name. A ``b`` that ``requires_grad`` gets the weight
gradient (a pair's ``data``; ``main_grad`` read off it), which a framework routes to the parameter.
``a`` stays high precision: its grad_weight copy is quantized along the tokens in the padded
layout, which no pre-quantized tensor holds.

Weights use 1 x 32 blocks like the activations (as ``gemm_fp4``; not Primus-Turbo's 32 x 32 weight
blocks), so K must be a multiple of 32, and N too when grad_input is needed (``ValueError`` naming
the dim). Hopper has no FP4 tensor cores: the TRITON backend decodes E2M1 in-kernel onto bf16
tensor cores, exactly (the fp32 sum of the dequantized products). No host synchronisation.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..backends.grouped_gemm_fp4 import grouped_gemm_fp4_dispatcher, grouped_gemm_fp4_variable_k_dispatcher
from ..backends.grouped_gemm_fp8 import padded_group_layout
from ..core.amp import autocast_dtype, gemm_under_autocast
from ..core.backend import PrecisionType
from ..core.low_precision import Float4QuantConfig, ScalingRecipe
from ..core.quantized_tensor import QuantizedTensor, QuantizedTensorPair
from .gemm import _flag_main_grad, _megatron_dummy_wgrad
from .gemm_fp4 import _check_prequantized, _grad_operand, _is_prequantized, _prequantized_copies, _requires_grad
from .grouped_gemm import _group_offsets
from .grouped_gemm_fp8 import _NoGradCtx, _check_inputs as _check_fp8_inputs, _mx_token_copy, _mx_weight_copies

__all__ = ["grouped_gemm_fp4"]

_BLOCK = 32


def _quant_fp4(x: torch.Tensor, axis: int, sr: bool = False, signs: Optional[torch.Tensor] = None):
    """MXFP4 of ``x`` along ``axis``; ``sr``: stochastic rounding (seed drawn on the device);
    ``signs``: the random Hadamard transform along ``axis`` first."""
    from .quantization import quantize_fp4  # a sibling module: imported late

    recipe = ScalingRecipe(use_sr=sr, use_rht=signs is not None)
    return quantize_fp4(x, axis=axis, scaling_recipe=recipe, rht_signs=signs)


def _mm_eager(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
              group_lens: torch.Tensor, group_offs: torch.Tensor, out_dtype: torch.dtype,
              num_cu: Optional[int]) -> torch.Tensor:
    """M-grouped: ``a_q [M, K/2]`` x ``b_q [G, N, K/2]`` (E2M1 pairs, E8M0 scales per 32) -> ``[M, N]``."""
    return grouped_gemm_fp4_dispatcher.dispatch(
        PrecisionType.FP4, a_q=a_q, a_scale=a_scale, b_q=b_q, b_scale=b_scale, group_lens=group_lens,
        group_offs=group_offs, out_dtype=out_dtype, num_cu=num_cu)


def _vk_eager(x_t: torch.Tensor, x_scale: torch.Tensor, y_t: torch.Tensor, y_scale: torch.Tensor,
              group_lens: torch.Tensor, group_offs: torch.Tensor, out_dtype: torch.dtype, num_cu: Optional[int],
              out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Variable K over the tokens: ``x_t [P, M/2]``, ``y_t [Q, M/2]`` -> ``[G, P, Q]`` (added into ``out``)."""
    return grouped_gemm_fp4_variable_k_dispatcher.dispatch(
        PrecisionType.FP4, x_t=x_t, x_scale=x_scale, y_t=y_t, y_scale=y_scale, group_lens=group_lens,
        group_offs=group_offs, out=out, accumulate=out is not None, out_dtype=out_dtype, num_cu=num_cu)


# Under torch.compile the MXFP4 grouped GEMMs are custom ops with shape-only fakes (as the FP8 ones,
# grouped_gemm_fp8.py); eager calls skip the custom-op dispatch.
grouped_gemm_fp4_impl = torch.library.custom_op("primus_turbo::grouped_gemm_fp4_impl", _mm_eager, mutates_args=())


@grouped_gemm_fp4_impl.register_fake
def _grouped_gemm_fp4_impl_fake(a_q, a_scale, b_q, b_scale, group_lens, group_offs, out_dtype, num_cu):
    return a_q.new_empty((a_q.size(0), b_q.size(1)), dtype=out_dtype)


def _vk_new(x_t: torch.Tensor, x_scale: torch.Tensor, y_t: torch.Tensor, y_scale: torch.Tensor,
            group_lens: torch.Tensor, group_offs: torch.Tensor, out_dtype: torch.dtype,
            num_cu: Optional[int]) -> torch.Tensor:
    return _vk_eager(x_t, x_scale, y_t, y_scale, group_lens, group_offs, out_dtype, num_cu)


grouped_gemm_fp4_variable_k_impl = torch.library.custom_op("primus_turbo::grouped_gemm_fp4_variable_k_impl",
                                                           _vk_new, mutates_args=())


@grouped_gemm_fp4_variable_k_impl.register_fake
def _grouped_gemm_fp4_variable_k_impl_fake(x_t, x_scale, y_t, y_scale, group_lens, group_offs, out_dtype, num_cu):
    return x_t.new_empty((group_offs.numel() - 1, x_t.size(0), y_t.size(0)), dtype=out_dtype)


def _vk_accum(x_t: torch.Tensor, x_scale: torch.Tensor, y_t: torch.Tensor, y_scale: torch.Tensor,
              group_lens: torch.Tensor, group_offs: torch.Tensor, num_cu: Optional[int], out: torch.Tensor) -> None:
    _vk_eager(x_t, x_scale, y_t, y_scale, group_lens, group_offs, out.dtype, num_cu, out)


grouped_gemm_fp4_variable_k_accum_impl = torch.library.custom_op(
    "primus_turbo::grouped_gemm_fp4_variable_k_accum_impl", _vk_accum, mutates_args=("out",))


@grouped_gemm_fp4_variable_k_accum_impl.register_fake
def _grouped_gemm_fp4_variable_k_accum_impl_fake(x_t, x_scale, y_t, y_scale, group_lens, group_offs, num_cu, out):
    return None


def _mm(A, B, group_lens, group_offs, out_dtype, num_cu):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.grouped_gemm_fp4_impl(A[0], A[1], B[0], B[1], group_lens, group_offs,
                                                            out_dtype, num_cu)
    return _mm_eager(A[0], A[1], B[0], B[1], group_lens, group_offs, out_dtype, num_cu)


def _vk(X, Y, group_lens, group_offs, out_dtype, num_cu, out=None):
    if not torch.compiler.is_compiling():
        return _vk_eager(X[0], X[1], Y[0], Y[1], group_lens, group_offs, out_dtype, num_cu, out)
    if out is None:
        return torch.ops.primus_turbo.grouped_gemm_fp4_variable_k_impl(X[0], X[1], Y[0], Y[1], group_lens,
                                                                       group_offs, out_dtype, num_cu)
    torch.ops.primus_turbo.grouped_gemm_fp4_variable_k_accum_impl(X[0], X[1], Y[0], Y[1], group_lens, group_offs,
                                                                  num_cu, out)
    return out


def _weight_copies(b, trans_b: bool, need_dgrad: bool):
    """(forward copy [G, N, K/2] + [G, N, K/32], dgrad copy [G, K, N/2] + [G, K, N/32] or None) of the
    expert weights: quantized here, or read from a pre-quantized ``b`` (``[G, R, C]``: its copy
    grouped along C is the "row" one, along R the "column" one, stored ``[G, C, R/2]``)."""
    if _is_prequantized(b):
        # trans_b: b is [G, N, K] (forward along C = K, dgrad along R = N); else [G, K, N]
        along_c, along_r = _prequantized_copies(b, "b", "grouped_gemm_fp4", need_row=trans_b or need_dgrad,
                                                need_col=not trans_b or need_dgrad)
        return (along_c, along_r) if trans_b else (along_r, along_c)
    return _mx_weight_copies(b, trans_b, _quant_fp4, 2, True, need_dgrad)


class GroupedGemmFP4Function(torch.autograd.Function):
    """``b`` is a tensor or an MXFP4 ``QuantizedTensor`` (which gets its gradient like a
    high-precision one); ``b_t`` is a ``QuantizedTensorPair``'s transposed copy, passed on its own
    so that autograd sees the pair's ``data`` as ``b``."""

    @staticmethod
    def forward(ctx, a, b, b_t, group_lens, group_offs, trans_b, out_dtype, num_cu, fuse_accum, gradient_sr=False,
                use_rht=False):
        need_ga, need_gb = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.trans_b, ctx.num_cu, ctx.fuse_accum = trans_b, num_cu, fuse_accum
        ctx.gradient_sr = gradient_sr
        ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
        a_row = _quant_fp4(a, -1)  # [M, K/2] + [M, K/32]
        w_fwd, w_dgrad = _weight_copies(QuantizedTensorPair(b, b_t) if b_t is not None else b, trans_b, need_ga)
        out = _mm(a_row, w_fwd, group_lens, group_offs, out_dtype, num_cu)
        saved_w = w_dgrad if need_ga else (None, None)
        src = poffs = signs = None
        saved_a = (None, None)
        if need_gb:
            if use_rht:
                from .quantization import random_hadamard_signs

                signs = random_hadamard_signs(_BLOCK, device=a.device)  # drawn on the device, no sync
            src, poffs = padded_group_layout(group_offs, a.size(0), _BLOCK)
            # [K, M_pad/2] + [K, M_pad/32]; with RHT of the padded tokens' 32-blocks (one expert each)
            saved_a = _mx_token_copy(a, src, functools.partial(_quant_fp4, signs=signs), 2)
        ctx.save_for_backward(*saved_w, *saved_a, group_lens, group_offs, src, poffs,
                              b if (fuse_accum and need_gb) else None, signs)
        return out  # (b.grad_added_to_main_grad: set by grouped_gemm_fp4, as in grouped_gemm_fp8._run)

    @staticmethod
    def backward(ctx, grad_out):
        wq, ws, aq_t, as_t, group_lens, group_offs, src, poffs, b, signs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            dy_row = _quant_fp4(grad_out, -1, sr=ctx.gradient_sr)  # [M, N/2] + [M, N/32]
            # dA[rows of g] = dC[rows of g] @ op(b[g]).T; rows past offs[G] come back zero
            grad_a = _mm(dy_row, (wq, ws), group_lens, group_offs, ctx.a_dtype, ctx.num_cu)
        if ctx.needs_input_grad[1]:
            dy_col = _mx_token_copy(grad_out, src, functools.partial(_quant_fp4, sr=ctx.gradient_sr, signs=signs), 2)
            A = (aq_t, as_t)
            X, Y = (dy_col, A) if ctx.trans_b else (A, dy_col)
            if ctx.fuse_accum:
                _vk(X, Y, group_lens, poffs, b.main_grad.dtype, ctx.num_cu, out=b.main_grad)
                grad_b = _megatron_dummy_wgrad(b)  # (b.grad_added_to_main_grad: set with the forward)
            else:
                grad_b = _vk(X, Y, group_lens, poffs, ctx.b_dtype, ctx.num_cu)
        return grad_a, grad_b, None, None, None, None, None, None, None, None, None


def _check_inputs(a, b, group_lens, group_offs, trans_b, out_dtype, config, num_cu, fuse_bgrad_accum_pattern):
    op = "grouped_gemm_fp4"
    if not isinstance(config, Float4QuantConfig):
        raise TypeError(f"{op}: config must be a Float4QuantConfig or None, got {type(config).__name__}")
    if isinstance(a, (QuantizedTensor, QuantizedTensorPair)) or not isinstance(a, torch.Tensor):
        # a's grad_weight copy is quantized along the tokens of the padded layout: no pre-quantized form
        raise TypeError(f"{op}: a must be a torch.Tensor (bf16/fp16/fp32, quantized on the fly; pre-quantized "
                        f"operands are for b only), got {type(a).__name__}")
    if _is_prequantized(b):
        _check_prequantized(b, "b", op, 3)
        # the shared checks below read shape, dtype, device, requires_grad and main_grad: a zero-byte
        # stand-in with the QuantizedTensor's (a pair's data's) logical ones
        q = _grad_operand(b)
        b = torch.empty((), dtype=q.dtype, device=q.device).expand(q.shape)
        if q.requires_grad:
            b.requires_grad_()
        if hasattr(q, "main_grad"):
            b.main_grad = q.main_grad
    elif not isinstance(b, torch.Tensor):
        raise TypeError(f"{op}: b must be a torch.Tensor (bf16/fp16/fp32, quantized on the fly) or an MXFP4 "
                        f"QuantizedTensor / QuantizedTensorPair, got {type(b).__name__}")
    # the shared checks (types, devices, shapes, offsets, num_cu, main_grad) and MX's 32-multiples
    from ..core.low_precision import Float8QuantConfig, ScalingGranularity

    try:
        _check_fp8_inputs(a, b, group_lens, group_offs, trans_b, out_dtype,
                          Float8QuantConfig(granularity=ScalingGranularity.MX_BLOCKWISE), num_cu,
                          fuse_bgrad_accum_pattern)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("grouped_gemm_fp8", op).replace("MX needs", "MXFP4 needs")) from None


def grouped_gemm_fp4(
    a: torch.Tensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    group_offs: Optional[torch.Tensor] = None,
    trans_b: bool = True,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[Float4QuantConfig] = None,
    num_cu: Optional[int] = None,
    fuse_bgrad_accum_pattern: Optional[str] = None,
) -> torch.Tensor:
    """MXFP4 grouped GEMM of MoE experts with autograd, without host synchronisation.

    Args:
        a: ``[M_total, K]`` tokens sorted by expert (bf16/fp16/fp32, quantized on the fly);
            ``M_total >= sum(group_lens)``, the extra rows' outputs (and gradients) are zero.
        b: ``[G, N, K]`` expert weights with ``trans_b=True`` (the default, ``nn.Linear`` layout),
            or ``[G, K, N]``; same dtype and device. Or pre-quantized: a 3-D MXFP4
            ``QuantizedTensor`` / ``QuantizedTensorPair`` (module docstring), bit-identical results.
        group_lens: ``[G]`` int64 on ``a``'s device (zero allowed, any values: no multiple of 32
            needed); ``group_offs`` its ``[G+1]`` exclusive prefix sum, computed on the device when None.
        out_dtype: dtype of the output (default ``a.dtype``); gradients come back in the inputs' dtypes.
        config: :class:`Float4QuantConfig` (default). ``use_gradient_sr``: stochastic rounding of
            ``dC`` for both backward GEMMs; ``use_rht``: grad_weight on ``a`` and ``dC`` randomly
            Hadamard-transformed along each expert's tokens (module docstring).
        num_cu: cap on the persistent programs (SMs) of the kernels.
        fuse_bgrad_accum_pattern: ``None`` or ``"megatron"``: the weight gradient is added into
            ``b.main_grad`` (fp32 or ``b.dtype``) in the kernel epilogue and a placeholder is returned.

    K must be a multiple of 32; with a gradient for ``a``, N too. Backend: TRITON (E2M1 decoded
    in-kernel, bf16 tensor cores; CPU through the Triton interpreter).
    """
    if isinstance(a, torch.Tensor) and (amp := autocast_dtype(a)) is not None:  # core/amp.py
        return gemm_under_autocast(grouped_gemm_fp4, amp, a, b, group_lens, group_offs, trans_b, out_dtype, config,
                                   num_cu, fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
    config = Float4QuantConfig() if config is None else config
    _check_inputs(a, b, group_lens, group_offs, trans_b, out_dtype, config, num_cu, fuse_bgrad_accum_pattern)
    group_offs = _group_offsets("grouped_gemm_fp4", group_lens, group_offs, a)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    fuse = fuse_bgrad_accum_pattern == "megatron"
    b_t = b.data_t if isinstance(b, QuantizedTensorPair) else None
    b = _grad_operand(b)  # a pair's data carries the gradient
    M, K = a.shape
    G = b.size(0)
    N = b.size(1) if trans_b else b.size(2)
    grads = torch.is_grad_enabled() and (a.requires_grad or _requires_grad(b))
    if M == 0 or N == 0 or K == 0 or G == 0:
        out = a.new_zeros((M, N), dtype=out_dtype)
        if grads:
            if fuse and b.requires_grad:
                b.grad_added_to_main_grad = True
            # a QuantizedTensor's .to() to another dtype dequantizes, so its (zero) gradient still reaches it
            bz = b.to(torch.float64) if isinstance(b, QuantizedTensor) else b
            out = out + (a.reshape(-1)[:0].sum() + bz.reshape(-1)[:0].sum()).to(out_dtype)
        return out
    args = (group_lens, group_offs, bool(trans_b), out_dtype, num_cu, fuse)
    if grads:
        out = GroupedGemmFP4Function.apply(a, b, b_t, *args, bool(config.use_gradient_sr), bool(config.use_rht))
        if fuse and _requires_grad(b):
            _flag_main_grad(b)
        return out
    with torch.no_grad():
        return GroupedGemmFP4Function.forward(_NoGradCtx(), a, b, b_t, *args)

