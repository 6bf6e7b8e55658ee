"""FP8 softmax attention: ``turbo.ops.flash_attn_fp8_func`` (flash_attn_func's API plus ``fp8_config``).

What is FP8, exactly:

* **Forward**: q, k, v (bf16/fp16) are quantized to FP8 E4M3 with one fp32 scale per
  ``(batch, head, block of block_size tokens)`` (``block_size`` 128 by default; scales are powers of
  two, the largest with ``amax * scale <= 448``). ``Q K^T`` is an FP8 ``tl.dot`` (fp32 accumulation)
  with the q and k scales applied to the fp32 scores; the softmax runs in fp32; ``P`` (in
  ``[0, 1]``) is quantized to E4M3 with the static scale 256 and ``P V`` is an FP8 ``tl.dot`` with V's
  scale (and ``1/256``) applied to the fp32 product. ``O`` is written in q's dtype, the LSE in fp32.
* **Backward** (``PRIMUS_TURBO_ATTN_FP8_BACKWARD``: FP8 by default on CPU; on CUDA once the kernels
  are validated on the GPU, the bf16 backward below until then): FP8 too (flash_attn_fp8_bwd.py). ``dO`` is quantized
  to E4M3 like q (one power-of-two scale per ``(batch, head, block_size query tokens)``); ``P`` is
  recomputed from the FP8 ``Q K^T`` and the saved LSE. The four GEMMs are FP8 x FP8 dots with fp32
  accumulation, each rescaled by per-tile scalars: ``dV += P8^T dO8`` (P at the static scale 256),
  ``dP = dO8 V8^T``, ``dS = P * (dP - delta)`` in fp32 then quantized to E4M3 per kernel tile with a
  dynamic power-of-two scale (tile amax, in registers), ``dQ += dS8 K8``, ``dK += dS8^T Q8``. All scales
  are computed on the device. Otherwise (``PRIMUS_TURBO_ATTN_FP8_BACKWARD=0``) the
  backward is the bf16/fp16 FlashAttention-2 backward (flash_attn_bwd.py) on the **same quantized**
  q, k, v dequantized to the input dtype, with ``dO`` and ``dS`` in the input dtype. Either way only
  the FP8 copies of q, k, v (1 byte per element) plus their scales are kept for backward.

Layouts (bshd / sbhd / bhsd, read through strides), GQA/MQA, causal (bottom-right), sliding windows,
sinks (with a gradient) and ``return_lse`` work as in :func:`flash_attn_func`. Everything stays on
the device: no host synchronisation.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..core.amp import autocast_dtype, autocast_off, cast_inputs
from ..core.low_precision import Float8QuantConfig, Format, ScalingGranularity, ScalingStrategy, check_fp8_support
from .attention import _check_inputs, eager_or_traced

__all__ = ["flash_attn_fp8_func"]

_FN = "flash_attn_fp8_func"
_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_FP8_ATTN_BLOCK = 128
_MAX_HEAD_DIM = 256  # = flash_attn_fwd.MAX_HEAD_DIM (kept here: no triton import)
_BLOCK_SIZES = (32, 64, 128, 256)  # = flash_attn_fp8.FP8_ATTN_BLOCK_SIZES (kept here: no triton import)
#: internal switch, read at each forward call: True runs the FP8 backward kernels
#: (flash_attn_fp8_bwd.py); False the bf16/fp16 backward on the dequantized FP8 q, k, v (for
#: comparison); None follows PRIMUS_TURBO_ATTN_FP8_BACKWARD (docs/env_vars.md)
FP8_BACKWARD: Optional[bool] = None


def _use_fp8_backward(q: torch.Tensor) -> bool:
    if FP8_BACKWARD is not None:
        return bool(FP8_BACKWARD)
    from ..core.env import env_auto_flag

    choice = env_auto_flag("PRIMUS_TURBO_ATTN_FP8_BACKWARD")
    # auto: the FP8 backward kernels transpose FP8 operands for Hopper's K-major FP8 MMA and have
    # only run in the CPU interpreter so far; on CUDA the validated bf16 backward stays the default
    return (not q.is_cuda) if choice is None else choice


def _block_size(fp8_config) -> int:
    """The token-block size of the q/k/v scales, from ``fp8_config`` (None: E4M3, BLOCKWISE 128)."""
    if fp8_config is None:
        return DEFAULT_FP8_ATTN_BLOCK
    if not isinstance(fp8_config, Float8QuantConfig):
        raise TypeError(f"{_FN}: fp8_config must be a Float8QuantConfig or None, got {type(fp8_config).__name__}")
    if fp8_config.format != Format.E4M3:
        raise NotImplementedError(
            f"{_FN}: fp8_config.format={fp8_config.format.name} is not supported; only E4M3 (q, k, v and, in "
            "backward, dO and dS are E4M3 with fine-grained power-of-two scales)"
        )
    if fp8_config.granularity != ScalingGranularity.BLOCKWISE:
        raise NotImplementedError(
            f"{_FN}: fp8_config.granularity={fp8_config.granularity.name} is not supported; only BLOCKWISE "
            "(one scale per token block and head)"
        )
    if fp8_config.strategy != ScalingStrategy.DYNAMIC:
        raise NotImplementedError(f"{_FN}: fp8_config.strategy={fp8_config.strategy.name} is not supported")
    if fp8_config.block_size not in _BLOCK_SIZES:
        raise NotImplementedError(
            f"{_FN}: fp8_config.block_size={fp8_config.block_size} is not supported; one of {_BLOCK_SIZES}"
        )
    return int(fp8_config.block_size)


def _check_device(q, k, v, sink) -> None:
    from primus_turbo.triton.attention import check_flash_attn_triton

    why = check_flash_attn_triton(q, k, v, sink)
    if why is not None:
        raise RuntimeError(f"{_FN}: cannot run: {why}")
    if q.device.type == "cuda":
        ok, why = check_fp8_support(q.device)
        if not ok:
            raise RuntimeError(f"{_FN}: {why}")


def _quantize(q, k, v, blk):
    from primus_turbo.triton.attention.flash_attn_fp8 import quantize_tokens_fp8

    q8, qs = quantize_tokens_fp8(q, blk)
    k8, ks = quantize_tokens_fp8(k, blk)
    v8t, vs = quantize_tokens_fp8(v, blk, transpose_sd=True)
    return q8, k8, v8t, qs, ks, vs


def _fwd_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: Optional[torch.Tensor], softmax_scale: float,
    win_left: int, win_right: int, blk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """``(out, lse, q8, k8, v8t, qs, ks, vs)``: the FP8 forward and the FP8 tensors backward needs."""
    from primus_turbo.triton.attention.flash_attn_fp8 import flash_attn_fp8_fwd_triton

    q8, k8, v8t, qs, ks, vs = _quantize(q, k, v, blk)
    fwd = flash_attn_fp8_fwd_triton
    if q.is_cuda:
        fwd = _gluon_fwd(q8, k8, v8t, qs, ks, vs, blk, sink, softmax_scale, win_left, win_right, q.dtype) or fwd
    out, lse = fwd(q8, k8, v8t, qs, ks, vs, blk, sink, softmax_scale, win_left, win_right, out_dtype=q.dtype)
    return out, lse, q8, k8, v8t, qs, ks, vs


def _gluon_fwd(q8, k8, v8t, qs, ks, vs, blk, sink, softmax_scale, win_left, win_right, out_dtype):
    """The warp-specialized Gluon FP8 forward (sm_90) where ``PRIMUS_TURBO_ATTN_FP8_FWD_GLUON`` asks for
    it and it takes the quantized operands, else None. Same arguments, scales, O and LSE as the
    Triton FP8 forward, so the saved tensors and the backward do not depend on the choice."""
    from primus_turbo.triton.attention.flash_attn_fp8_fwd_gluon import (
        flash_attn_fp8_fwd_gluon, gluon_attn_fp8_fwd_reason, use_gluon_attn_fp8_fwd,
    )

    if not use_gluon_attn_fp8_fwd() or gluon_attn_fp8_fwd_reason(q8, k8, v8t, qs, ks, vs, blk, sink, softmax_scale,
                                                                  win_left, win_right, out_dtype):
        return None
    return flash_attn_fp8_fwd_gluon


flash_attn_fp8_fwd = torch.library.custom_op("primus_turbo::flash_attn_fp8_fwd", _fwd_eager, mutates_args=())


@flash_attn_fp8_fwd.register_fake
def _fwd_fake(q, k, v, sink, softmax_scale, win_left, win_right, blk):
    b, sq, h, d = q.shape
    sk, hk, dv = k.size(1), k.size(2), v.size(3)
    f8 = torch.float8_e4m3fn
    nq, nk = -(-sq // blk), -(-sk // blk)
    return (q.new_empty((b, sq, h, dv)), q.new_empty((b, h, sq), dtype=torch.float32),
            q.new_empty((b, h, sq, d), dtype=f8), q.new_empty((b, hk, sk, d), dtype=f8),
            q.new_empty((b, hk, dv, sk), dtype=f8), q.new_empty((b, h, nq), dtype=torch.float32),
            q.new_empty((b, hk, nk), dtype=torch.float32), q.new_empty((b, hk, nk), dtype=torch.float32))


def _bwd_eager(
    dout: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8t: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor,
    vs: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: Optional[torch.Tensor], softmax_scale: float,
    win_left: int, win_right: int, blk: int, dtype: torch.dtype, fp8_bwd: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsink)`` in ``dtype`` (dsink empty without sinks): the FP8 backward kernels
    (``fp8_bwd``), or the bf16/fp16 backward on the dequantized FP8 operands."""
    if fp8_bwd:
        from primus_turbo.triton.attention.flash_attn_fp8_bwd import flash_attn_fp8_bwd_triton

        dq, dk, dv, dsink = flash_attn_fp8_bwd_triton(
            dout, q8, k8, v8t, qs, ks, vs, out, lse, sink, softmax_scale, blk, win_left, win_right, dtype
        )
    else:
        from primus_turbo.triton.attention import flash_attn_bwd_triton
        from primus_turbo.triton.attention.flash_attn_fp8 import dequantize_tokens_fp8

        qd = dequantize_tokens_fp8(q8, qs, blk, dtype)
        kd = dequantize_tokens_fp8(k8, ks, blk, dtype)
        vd = dequantize_tokens_fp8(v8t, vs, blk, dtype, transpose_sd=True)
        dq, dk, dv, dsink = flash_attn_bwd_triton(
            dout.to(dtype).contiguous(), qd, kd, vd, out, lse, sink, softmax_scale, win_left, win_right
        )
    if dsink is None:  # custom ops return tensors: an empty one stands for "no sink"
        dsink = q8.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsink


flash_attn_fp8_bwd = torch.library.custom_op("primus_turbo::flash_attn_fp8_bwd", _bwd_eager, mutates_args=())


@flash_attn_fp8_bwd.register_fake
def _bwd_fake(dout, q8, k8, v8t, qs, ks, vs, out, lse, sink, softmax_scale, win_left, win_right, blk, dtype,
              fp8_bwd):
    b, h, sq, d = q8.shape
    hk, sk = k8.size(1), k8.size(2)
    dv = v8t.size(2)
    n_sink = 0 if sink is None else sink.numel()
    return (dout.new_empty((b, sq, h, d), dtype=dtype), dout.new_empty((b, sk, hk, d), dtype=dtype),
            dout.new_empty((b, sk, hk, dv), dtype=dtype), dout.new_empty((n_sink,), dtype=torch.float32))


_fwd = eager_or_traced("flash_attn_fp8_fwd", _fwd_eager)
_bwd = eager_or_traced("flash_attn_fp8_bwd", _bwd_eager)


class FlashAttnFp8Function(torch.autograd.Function):
    """FP8 forward and (by default) FP8 backward (see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, softmax_scale, win_left, win_right, blk):
        out, lse, q8, k8, v8t, qs, ks, vs = _fwd(q, k, v, sink, softmax_scale, win_left, win_right, blk)
        ctx.save_for_backward(q8, k8, v8t, qs, ks, vs, out, lse, sink)
        ctx.softmax_scale, ctx.win_left, ctx.win_right, ctx.blk = softmax_scale, win_left, win_right, blk
        ctx.in_dtype = q.dtype
        ctx.fp8_bwd = _use_fp8_backward(q)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q8, k8, v8t, qs, ks, vs, out, lse, sink = ctx.saved_tensors
        dq, dk, dv, dsink = _bwd(dout, q8, k8, v8t, qs, ks, vs, out, lse, sink, ctx.softmax_scale, ctx.win_left,
                                 ctx.win_right, ctx.blk, ctx.in_dtype, ctx.fp8_bwd)
        if sink is None or not ctx.needs_input_grad[3]:
            dsink = None
        else:
            dsink = dsink.to(sink.dtype)
        return dq, dk, dv, dsink, None, None, None, None


def flash_attn_fp8_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    bias: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_attn_probs: bool = False,
    sink: Optional[torch.Tensor] = None,
    fp8_config: Optional[Float8QuantConfig] = None,
):
    """Softmax attention with FP8 (E4M3) forward and backward, block-scaled per token block and head.

    Args:
        q: ``[batch, seq_q, heads_q, head_dim_qk]``; k: ``[batch, seq_kv, heads_kv, head_dim_qk]``;
            v: ``[batch, seq_kv, heads_kv, head_dim_v]``; bfloat16 or float16 (one dtype, one
            device), any strides (bshd, sbhd, bhsd storage); ``heads_q % heads_kv == 0`` (GQA/MQA);
            head dims at most 256.
        dropout_p: must be 0 (NotImplementedError otherwise).
        softmax_scale: defaults to ``1 / sqrt(head_dim_qk)``.
        causal, window_size, sink, return_lse: as :func:`turbo.ops.flash_attn_func` (bottom-right
            aligned masks; ``sink`` fp32 ``[heads_q]`` gets a gradient; the LSE is fp32
            ``[batch, heads_q, seq_q]``, that of the FP8 scores).
        deterministic: accepted; the backward is always deterministic (no atomics).
        bias, alibi_slopes, return_attn_probs: not implemented (NotImplementedError naming them).
        fp8_config: ``Float8QuantConfig`` or None (= E4M3, BLOCKWISE, ``block_size`` 128). Only
            ``format=E4M3``, ``granularity=BLOCKWISE`` with ``block_size`` in 32/64/128/256 are
            supported (NotImplementedError naming the field otherwise).

    What is FP8:
        * q, k, v: E4M3, one fp32 power-of-two scale per ``(batch, head, block_size tokens)``
          (``amax * scale`` in ``(224, 448]``), round to nearest even;
        * ``S = Q K^T``: FP8 x FP8 dot, fp32 accumulation, scales applied to the fp32 scores;
        * softmax in fp32; ``P`` quantized to E4M3 with the static scale 256 (``P`` is in
          ``[0, 1]`` after the max subtraction, FA3-style static scaling), ``P V``: FP8 x FP8
          dot, V's scale applied to the fp32 product;
        * backward: dO quantized to E4M3 per ``(batch, head, block_size tokens)`` (power-of-two
          scales); ``dV = P8^T dO8``, ``dP = dO8 V8^T``, ``dQ = dS8 K8``, ``dK = dS8^T Q8`` are FP8 x
          FP8 dots (fp32 accumulation, per-tile scalar scales), ``dS`` quantized per tile with a
          dynamic power-of-two scale; softmax recomputation and ``dS = P (dP - delta)`` in fp32.

    Returns:
        ``out [batch, seq_q, heads_q, head_dim_v]`` in q's dtype, or ``(out, lse)`` with
        ``return_lse``.

    Runs on the TRITON kernels (CUDA with FP8 tensor cores, sm_89+, or CPU under the Triton
    interpreter); no backend dispatch. On sm_90, ``PRIMUS_TURBO_ATTN_FP8_FWD_GLUON=1`` runs the
    forward's attention kernel as the warp-specialized Gluon FP8 kernel where it takes the inputs
    (same quantization, O and LSE). Under ``torch.autocast`` q, k and v are cast to its dtype first
    (core/amp.py).
    """
    if isinstance(q, torch.Tensor) and (amp := autocast_dtype(q)) is not None:
        q, k, v = cast_inputs(amp, q, k, v)
        with autocast_off(q):
            return flash_attn_fp8_func(q, k, v, dropout_p, softmax_scale, causal, window_size, bias, alibi_slopes,
                                       deterministic, return_lse, return_attn_probs, sink, fp8_config)
    _check_inputs(q, k, v, dropout_p, softmax_scale, window_size, bias, alibi_slopes, return_attn_probs, sink, fn=_FN)
    if q.dtype not in _DTYPES:
        raise TypeError(f"{_FN}: q, k, v must be bfloat16 or float16, got {q.dtype}")
    if q.size(-1) > _MAX_HEAD_DIM or v.size(-1) > _MAX_HEAD_DIM:
        raise NotImplementedError(f"{_FN}: head dims above {_MAX_HEAD_DIM} are not supported, got "
                                  f"head_dim_qk={q.size(-1)}, head_dim_v={v.size(-1)}")
    blk = _block_size(fp8_config)
    _check_device(q, k, v, sink)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.size(-1))
    win_left, win_right = int(window_size[0]), int(window_size[1])
    if causal:
        win_right = 0
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink))
    if needs_grad:
        out, lse = FlashAttnFp8Function.apply(q, k, v, sink, scale, win_left, win_right, blk)
    else:
        out, lse = _fwd(q, k, v, sink, scale, win_left, win_right, blk)[:2]
    return (out, lse) if return_lse else out
