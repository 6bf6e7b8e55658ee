"""Attention backends: TORCH (``F.scaled_dot_product_attention``: cuDNN / flash / efficient / math,
and what runs on plain CPU) and TRITON (our FlashAttention-2 style kernels, primus_turbo/triton/attention;
on sm_90 its dense forward and backward run the warp-specialized Gluon kernels where those take the
inputs and were measured faster (``PRIMUS_TURBO_ATTN_FWD_GLUON`` / ``PRIMUS_TURBO_ATTN_BWD_GLUON``;
the rules are ``use_gluon_attn_fwd`` / ``use_gluon_attn_bwd``; 1 wherever they run, 0 never), and its
varlen forward the Gluon varlen kernel (``PRIMUS_TURBO_ATTN_VARLEN_GLUON``, rule
``use_gluon_attn_varlen_fwd``: auto on every pack at head dim 128 and from ``max_seqlen_q >= 2048`` at
head dim 64, 1 wherever it runs, 0 never)).

Every backend takes already-validated, *logical* ``[batch, seq, heads, head_dim]`` tensors (any
strides) and the normalised mask bounds ``win_left`` / ``win_right`` (``-1`` = unbounded, causal
folded in as ``win_right = 0``). Forward and backward of one call must run on one backend, so the op
resolves the backend once per forward and keeps it on the autograd context:

* TORCH runs SDPA under PyTorch's own autograd (its backward is SDPA's backward);
* TRITON's ``forward`` returns ``(out, lse)`` and its ``backward`` the gradients of that forward.

Varlen (packed THD, ``flash_attn_varlen_func``) calls carry ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32
device tensors) and ``max_seqlen_q`` / ``max_seqlen_k`` (host ints); only TRITON runs them (SDPA
would need the lengths on the host).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.nn.functional as F

from ..core.backend import AutoKernelDispatcher, BackendType, KernelBackend

__all__ = ["ATTN_DTYPES", "AttnTorchBackend", "AttnTritonBackend", "attn_dispatcher"]

ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _bottom_right_mask(seq_q: int, seq_k: int, win_left: int, win_right: int, device) -> torch.Tensor:
    """bool [seq_q, seq_k], True where query i may attend key j (flash-attention's alignment)."""
    i = torch.arange(seq_q, device=device).view(-1, 1)
    j = torch.arange(seq_k, device=device).view(1, -1)
    off = seq_k - seq_q
    mask = torch.ones((seq_q, seq_k), dtype=torch.bool, device=device)
    if win_right >= 0:
        mask &= j <= i + off + win_right
    if win_left >= 0:
        mask &= j >= i + off - win_left
    return mask


class AttnTorchBackend(KernelBackend):
    """``F.scaled_dot_product_attention`` with PyTorch's autograd (``enable_gqa`` for GQA/MQA)."""

    backend_type = BackendType.TORCH
    native_autograd: ClassVar[bool] = True

    @classmethod
    def check(cls, q, k, v, sink=None, win_left=-1, win_right=-1, return_lse=False, deterministic=False,
              cu_seqlens_q=None, **_):
        if cu_seqlens_q is not None:
            return "varlen (packed THD) attention: SDPA would need the sequence lengths on the host (a device sync)"
        if q.dtype not in ATTN_DTYPES:
            return f"dtype {q.dtype} is not one of float16, bfloat16, float32"
        if sink is not None:
            return "SDPA has no attention sinks"
        if return_lse:
            return "SDPA does not return the LSE"
        if win_left >= 0:
            return f"SDPA has no sliding window (window left={win_left})"
        if win_right > 0:
            return f"SDPA has no sliding window (window right={win_right})"
        if win_right == 0 and q.size(1) > k.size(1):
            return f"causal with seq_q={q.size(1)} > seq_kv={k.size(1)} leaves rows with no key (SDPA gives NaN there)"
        if deterministic and q.is_cuda:
            return "SDPA's CUDA backward is not guaranteed deterministic"
        return None

    @classmethod
    def execute(cls, q, k, v, softmax_scale, win_right=-1, **_) -> torch.Tensor:
        """``out [B, Sq, Hq, Dv]``, differentiable through PyTorch's autograd."""
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        kw = dict(scale=softmax_scale)
        if q.size(2) != k.size(2):  # (branched on: under dynamic shapes the comparison is a SymBool, which
            kw["enable_gqa"] = True  # SDPA's bool argument refuses; the branch specializes the head counts)
        if win_right == 0 and q.size(1) == k.size(1):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, **kw)
        elif win_right == 0:
            mask = _bottom_right_mask(q.size(1), k.size(1), -1, 0, q.device)
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, **kw)
        else:
            out = F.scaled_dot_product_attention(qt, kt, vt, **kw)
        return out.transpose(1, 2)


class AttnTritonBackend(KernelBackend):
    """Our FlashAttention-2 style kernels: forward writes O and LSE; two-kernel deterministic backward, or
    (``deterministic=False`` and ``PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ``) one kernel with atomic dQ."""

    backend_type = BackendType.TRITON
    native_autograd: ClassVar[bool] = False

    @classmethod
    def check(cls, q, k, v, sink=None, **_) -> Optional[str]:
        try:
            from primus_turbo.triton.attention import check_flash_attn_triton
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_flash_attn_triton(q, k, v, sink)

    @classmethod
    def execute(cls, q, k, v, softmax_scale, sink=None, win_left=-1, win_right=-1, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, **_):
        """``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq] fp32)``; no autograd. With ``cu_seqlens_q`` (varlen):
        packed ``[T, H, D]`` tensors, ``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32)``."""
        from primus_turbo.triton.attention import flash_attn_fwd_triton, flash_attn_varlen_fwd_triton

        if cu_seqlens_q is not None:
            out_lse = _gluon_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink,
                                        softmax_scale, win_left, win_right)
            if out_lse is not None:
                return out_lse
            return flash_attn_varlen_fwd_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                sink, softmax_scale, win_left, win_right)
        if q.is_cuda:
            out_lse = _gluon_fwd(q, k, v, sink, softmax_scale, win_left, win_right)
            if out_lse is not None:
                return out_lse
        return flash_attn_fwd_triton(q, k, v, sink, softmax_scale, win_left, win_right)

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, softmax_scale, sink=None, win_left=-1, win_right=-1,
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, deterministic=True):
        """``(dq, dk, dv, dsink)`` of :meth:`execute` (dsink fp32 ``[Hq]`` or None). ``deterministic=False``
        lets the one-kernel atomic-dQ backward run where ``PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ`` selects it."""
        from primus_turbo.triton.attention import flash_attn_bwd_triton, flash_attn_varlen_bwd_triton

        if cu_seqlens_q is not None:
            return flash_attn_varlen_bwd_triton(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k, sink, softmax_scale, win_left, win_right,
                                                deterministic=deterministic)
        if q.is_cuda:
            grads = _gluon_bwd(dout, q, k, v, out, lse, sink, softmax_scale, win_left, win_right)
            if grads is not None:
                return grads
        return flash_attn_bwd_triton(dout, q, k, v, out, lse, sink, softmax_scale, win_left, win_right,
                                     deterministic=deterministic)


def _gluon_fwd(q, k, v, sink, softmax_scale, win_left, win_right):
    """The warp-specialized Gluon forward (sm_90) where ``PRIMUS_TURBO_ATTN_FWD_GLUON`` allows it (auto:
    where it was measured faster, 1: wherever it takes the inputs) and it takes the inputs, else None.
    Its O and LSE are the Triton forward's, so TRITON's backward runs on them unchanged."""
    from primus_turbo.triton.attention.flash_attn_fwd_gluon import (
        flash_attn_fwd_gluon, gluon_attn_fwd_reason, use_gluon_attn_fwd,
    )

    if not use_gluon_attn_fwd(q, win_right) or gluon_attn_fwd_reason(q, k, v, sink, softmax_scale, win_left,
                                                                    win_right):
        return None
    return flash_attn_fwd_gluon(q, k, v, sink, softmax_scale, win_left, win_right)


def _gluon_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink, softmax_scale, win_left,
                      win_right):
    """The Gluon varlen forward (sm_90) where ``PRIMUS_TURBO_ATTN_VARLEN_GLUON`` allows it for this
    ``max_seqlen_q``, window and head dim (``use_gluon_attn_varlen_fwd``; auto: where it was measured
    faster on the H200; 1: always) and
    ``gluon_attn_varlen_fwd_reason`` takes the inputs (the dense Gluon forward's rules), else None.
    Its O ``[Tq, Hq, D]`` and LSE ``[Hq, Tq]`` are the tl varlen forward's, so the varlen backward
    runs on them unchanged."""
    from primus_turbo.triton.attention.flash_attn_fwd_gluon import (
        flash_attn_varlen_fwd_gluon, gluon_attn_varlen_fwd_reason, use_gluon_attn_varlen_fwd,
    )

    if not use_gluon_attn_varlen_fwd(max_seqlen_q, win_right, q.size(-1)) or gluon_attn_varlen_fwd_reason(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink, softmax_scale, win_left,
            win_right) is not None:
        return None
    return flash_attn_varlen_fwd_gluon(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink,
                                       softmax_scale, win_left, win_right)


def _gluon_bwd(dout, q, k, v, out, lse, sink, softmax_scale, win_left, win_right):
    """The warp-specialized Gluon backward (sm_90) where ``PRIMUS_TURBO_ATTN_BWD_GLUON`` allows it (auto:
    where it was measured faster, ``use_gluon_attn_bwd``) and it takes the inputs, else None. It has no atomics, so it serves ``deterministic=True`` as well."""
    from primus_turbo.triton.attention.flash_attn_bwd_gluon import (
        flash_attn_bwd_gluon, gluon_attn_bwd_reason, use_gluon_attn_bwd,
    )

    if not use_gluon_attn_bwd(q, k, win_right) or gluon_attn_bwd_reason(q, k, v, dout, sink, softmax_scale, win_left, win_right):
        return None
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        return None
    return flash_attn_bwd_gluon(dout, q, k, v, out, lse, sink, softmax_scale, win_left, win_right)


def _make_key(q, k, v, sink=None, win_left=-1, win_right=-1, return_lse=False, cu_seqlens_q=None,
              max_seqlen_q=0, max_seqlen_k=0, **_):
    varlen = None if cu_seqlens_q is None else (cu_seqlens_q.numel(), max_seqlen_q, max_seqlen_k)
    return (
        tuple(q.shape), tuple(k.shape), v.size(-1), q.dtype, sink is not None, win_left, win_right,
        bool(return_lse), q.device.type, varlen,
    )


def _default(**kwargs) -> BackendType:
    # SDPA (cuDNN / FlashAttention-2 on the H200) wherever it can run the call: on the shapes it
    # takes our kernels measured about its speed or below (benchmarks/results/h200/NOTES.md); our
    # kernels for what it cannot run (sinks, windows, the LSE, a deterministic CUDA backward).
    return BackendType.TORCH if AttnTorchBackend.can_handle(**kwargs) else BackendType.TRITON


attn_dispatcher = AutoKernelDispatcher(
    op_name="flash_attn",
    family="attn",
    backends=[AttnTorchBackend, AttnTritonBackend],
    make_key=_make_key,
    default=_default,
    default_checked=BackendType.TORCH,
)
