"""Softmax attention: ``turbo.ops.flash_attn_func`` (flash-attention's API, as Primus-Turbo offers it).

``q``, ``k``, ``v`` are logical ``[batch, seq, heads, head_dim]`` tensors; any strides are read in
place, so bshd, sbhd (``x.transpose(0, 1)`` of an ``[s, b, h, d]`` tensor) and bhsd
(``x.transpose(1, 2)`` of a ``[b, h, s, d]`` tensor) storage all work without copies.

The backend (core/backend.py, family ``attn``, ``PRIMUS_TURBO_ATTN_BACKEND``) is resolved once per
forward and kept on the autograd context, so a call's backward always runs on the backend that ran
its forward, whatever pins change in between. The TRITON path is registered as ``torch.library``
custom ops (``primus_turbo::flash_attn_triton_fwd`` / ``_bwd``) with fake implementations; traced
code calls them through ``torch.ops``, eager code calls the same functions directly.

``turbo.ops.flash_attn_varlen_func`` is the packed (THD) form: sequences of different lengths laid
end to end, delimited by int32 ``cu_seqlens`` on the device. It never reads ``cu_seqlens`` on the
host (the grid is sized from the caller's ``max_seqlen``), so it runs only on TRITON
(``primus_turbo::flash_attn_varlen_triton_fwd`` / ``_bwd``).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from ..backends.attention import ATTN_DTYPES, AttnTritonBackend, attn_dispatcher
from ..core.amp import autocast_dtype, autocast_off, cast_inputs
from ..core.backend import PrecisionType

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


# ---- TRITON path as custom ops --------------------------------------------------------------
def _triton_fwd_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: Optional[torch.Tensor],
    softmax_scale: float, win_left: int, win_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return AttnTritonBackend.execute(q=q, k=k, v=v, softmax_scale=softmax_scale, sink=sink,
                                     win_left=win_left, win_right=win_right)


flash_attn_triton_fwd = torch.library.custom_op(
    "primus_turbo::flash_attn_triton_fwd", _triton_fwd_eager, mutates_args=()
)


@flash_attn_triton_fwd.register_fake
def _triton_fwd_fake(q, k, v, sink, softmax_scale, win_left, win_right):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.size(-1)))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse


def _triton_bwd_eager(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    sink: Optional[torch.Tensor], softmax_scale: float, win_left: int, win_right: int, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsink = AttnTritonBackend.backward(dout, q, k, v, out, lse, softmax_scale, sink, win_left, win_right,
                                                   deterministic=deterministic)
    if dsink is None:  # custom ops return tensors: an empty one stands for "no sink"
        dsink = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsink


flash_attn_triton_bwd = torch.library.custom_op(
    "primus_turbo::flash_attn_triton_bwd", _triton_bwd_eager, mutates_args=()
)


@flash_attn_triton_bwd.register_fake
def _triton_bwd_fake(dout, q, k, v, out, lse, sink, softmax_scale, win_left, win_right, deterministic=True):
    n_sink = 0 if sink is None else sink.numel()
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty((n_sink,), dtype=torch.float32)


def eager_or_traced(op_name: str, eager):
    """``fn(*args)``: ``eager(*args)`` in eager mode (skips the custom-op dispatcher's overhead), the
    registered ``torch.ops.primus_turbo.<op_name>`` while torch.compile traces (it must see the op)."""
    def call(*args):
        if torch.compiler.is_compiling():
            return getattr(torch.ops.primus_turbo, op_name)(*args)
        return eager(*args)
    return call


_fwd = eager_or_traced("flash_attn_triton_fwd", _triton_fwd_eager)
_bwd = eager_or_traced("flash_attn_triton_bwd", _triton_bwd_eager)


class FlashAttnFunction(torch.autograd.Function):
    """Autograd for the non-native backends (TRITON): the backend chosen in forward runs backward."""

    @staticmethod
    def forward(ctx, q, k, v, sink, softmax_scale, win_left, win_right, backend, deterministic=False):
        out, lse = _fwd(q, k, v, sink, softmax_scale, win_left, win_right)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.softmax_scale, ctx.win_left, ctx.win_right = softmax_scale, win_left, win_right
        ctx.deterministic = deterministic  # True: never the atomic-dQ backward
        ctx.backend = backend  # resolved once, in forward; pins changed later do not move backward
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        if ctx.backend is not AttnTritonBackend:  # only TRITON runs through this Function today
            raise RuntimeError(f"flash_attn: no backward for backend {ctx.backend.backend_type.name}")
        dq, dk, dv, dsink = _bwd(
            dout.contiguous(), q, k, v, out, lse, sink, ctx.softmax_scale, ctx.win_left, ctx.win_right,
            ctx.deterministic,
        )
        if sink is None or not ctx.needs_input_grad[3]:
            dsink = None
        else:
            dsink = dsink.to(sink.dtype)
        return dq, dk, dv, dsink, None, None, None, None, None


# ---- varlen (packed THD) TRITON path ---------------------------------------------------------
def _varlen_fwd_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, sink: Optional[torch.Tensor], softmax_scale: float, win_left: int,
    win_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return AttnTritonBackend.execute(
        q=q, k=k, v=v, softmax_scale=softmax_scale, sink=sink, win_left=win_left, win_right=win_right,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )


flash_attn_varlen_triton_fwd = torch.library.custom_op(
    "primus_turbo::flash_attn_varlen_triton_fwd", _varlen_fwd_eager, mutates_args=()
)


@flash_attn_varlen_triton_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink, softmax_scale,
                     win_left, win_right):
    t, h, _ = q.shape
    return q.new_empty((t, h, v.size(-1))), q.new_empty((h, t), dtype=torch.float32)


def _varlen_bwd_eager(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    sink: Optional[torch.Tensor], softmax_scale: float, win_left: int, win_right: int, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsink = AttnTritonBackend.backward(
        dout, q, k, v, out, lse, softmax_scale, sink, win_left, win_right,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        deterministic=deterministic,
    )
    if dsink is None:
        dsink = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsink


flash_attn_varlen_triton_bwd = torch.library.custom_op(
    "primus_turbo::flash_attn_varlen_triton_bwd", _varlen_bwd_eager, mutates_args=()
)


@flash_attn_varlen_triton_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink,
                     softmax_scale, win_left, win_right, deterministic=True):
    n_sink = 0 if sink is None else sink.numel()
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty((n_sink,), dtype=torch.float32)


_varlen_fwd = eager_or_traced("flash_attn_varlen_triton_fwd", _varlen_fwd_eager)
_varlen_bwd = eager_or_traced("flash_attn_varlen_triton_bwd", _varlen_bwd_eager)


class FlashAttnVarlenFunction(torch.autograd.Function):
    """Autograd for packed (THD) attention; like :class:`FlashAttnFunction`, backward runs on forward's backend."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                win_left, win_right, backend, deterministic=False):
        if cu_seqlens_k is None:  # self-attention's one cu_seqlens, passed once (see flash_attn_varlen_func)
            cu_seqlens_k = cu_seqlens_q
        out, lse = _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink,
                               softmax_scale, win_left, win_right)
        ctx.save_for_backward(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.softmax_scale, ctx.win_left, ctx.win_right = softmax_scale, win_left, win_right
        ctx.backend = backend
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink, cu_q, cu_k = ctx.saved_tensors
        if ctx.backend is not AttnTritonBackend:
            raise RuntimeError(f"flash_attn_varlen: no backward for backend {ctx.backend.backend_type.name}")
        dq, dk, dv, dsink = _varlen_bwd(
            dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_seqlen_q, ctx.max_seqlen_k, sink,
            ctx.softmax_scale, ctx.win_left, ctx.win_right, ctx.deterministic,
        )
        if sink is None or not ctx.needs_input_grad[3]:
            dsink = None
        else:
            dsink = dsink.to(sink.dtype)
        return dq, dk, dv, dsink, None, None, None, None, None, None, None, None, None


# ---- validation -----------------------------------------------------------------------------
def _check_inputs(q, k, v, dropout_p, softmax_scale, window_size, bias, alibi_slopes, return_attn_probs, sink,
                  fn="flash_attn_func"):
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{fn}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0:
        raise NotImplementedError(f"{fn}: dropout_p={dropout_p} > 0 (attention dropout) is not implemented")
    if bias is not None:
        raise NotImplementedError(f"{fn}: bias (an additive attention bias) is not implemented")
    if alibi_slopes is not None:
        raise NotImplementedError(f"{fn}: alibi_slopes (ALiBi) is not implemented")
    if return_attn_probs:
        raise NotImplementedError(f"{fn}: return_attn_probs=True is not implemented (use return_lse=True)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{fn}: {name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(t.shape)}"
            )
        if t.dtype not in ATTN_DTYPES:
            raise TypeError(f"{fn}: {name}.dtype must be bfloat16, float16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    (bq, _, hq, dq), (bk, sk, hk, dk), (bv, sv, hv, _) = q.shape, k.shape, v.shape
    if not bq == bk == bv:
        raise ValueError(f"{fn}: batch sizes differ: q={bq}, k={bk}, v={bv}")
    if sk != sv:
        raise ValueError(f"{fn}: k and v must have the same seq_kv, got k={sk}, v={sv}")
    if hk != hv:
        raise ValueError(f"{fn}: k and v must have the same heads_kv, got k={hk}, v={hv}")
    if hk == 0:
        raise ValueError(f"{fn}: k and v need at least one head, got heads_kv=0 (k shape {tuple(k.shape)})")
    if hq % hk != 0:
        raise ValueError(f"{fn}: heads_q={hq} must be a multiple of heads_kv={hk} (GQA/MQA)")
    if dq != dk:
        raise ValueError(f"{fn}: q and k must have the same head_dim, got q={dq}, k={dk}")
    if dq == 0:  # the default scale 1/sqrt(head_dim) and the kernels' tiles need a non-empty head dim
        raise ValueError(f"{fn}: head_dim_qk must be >= 1, got q shape {tuple(q.shape)}, k shape {tuple(k.shape)}")
    if softmax_scale is not None and (
        not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool) or not math.isfinite(softmax_scale)
    ):
        raise ValueError(f"{fn}: softmax_scale must be a finite float or None, got {softmax_scale!r}")
    if (
        not isinstance(window_size, (tuple, list)) or len(window_size) != 2
        or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window_size)
    ):
        raise ValueError(f"{fn}: window_size must be (left, right) ints >= -1 (-1 = unbounded), got {window_size!r}")
    if sink is not None:
        if not isinstance(sink, torch.Tensor):
            raise TypeError(f"{fn}: sink must be a torch.Tensor or None, got {type(sink).__name__}")
        if tuple(sink.shape) != (hq,):
            raise ValueError(f"{fn}: sink must have shape [heads_q]=({hq},), got {tuple(sink.shape)}")
        if sink.dtype != torch.float32:
            raise TypeError(f"{fn}: sink must be float32, got {sink.dtype}")
        if sink.device != q.device:
            raise ValueError(f"{fn}: sink on {sink.device}, q on {q.device}")


def flash_attn_func(
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
):
    """Softmax attention ``softmax(q k^T * scale [+ mask], plus sink) v`` with autograd.

    Args:
        q: ``[batch, seq_q, heads_q, head_dim_qk]``; k: ``[batch, seq_kv, heads_kv, head_dim_qk]``;
            v: ``[batch, seq_kv, heads_kv, head_dim_v]``. bfloat16, float16 or float32 (one dtype,
            one device), any strides. ``heads_q % heads_kv == 0`` (GQA/MQA: query head ``h`` reads kv
            head ``h // (heads_q // heads_kv)``); ``head_dim_v`` may differ from ``head_dim_qk``.
        dropout_p: must be 0 (dropout is not implemented: NotImplementedError).
        softmax_scale: defaults to ``1 / sqrt(head_dim_qk)``.
        causal: query ``i`` sees keys ``j <= i + seq_kv - seq_q`` (bottom-right aligned, as
            flash-attention); sets the window's right bound to 0.
        window_size: ``(left, right)``; query ``i`` sees keys in
            ``[i + off - left, i + off + right]`` with ``off = seq_kv - seq_q``; ``-1`` is unbounded.
        bias, alibi_slopes, return_attn_probs: not implemented (NotImplementedError naming them).
        deterministic: ask for a bitwise-reproducible backward: on CUDA this flag keeps the call off
            SDPA, and TRITON runs its two-kernel backward (no atomics). It is on whenever
            ``torch.use_deterministic_algorithms(True)`` is in force. With ``False`` TRITON may run
            (fp16 / bf16) the one-kernel backward that accumulates dQ with fp32 atomics
            (``PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ``; off by default).
        return_lse: also return the log-sum-exp ``[batch, heads_q, seq_q]`` fp32 (natural log,
            including the sink; ``+inf`` for a row that sees no key and has no sink). Not
            differentiable.
        sink: float32 ``[heads_q]`` learned logits, one extra term ``exp(sink[h])`` in each row's
            softmax denominator (no value); receives a gradient.

    Returns:
        ``out [batch, seq_q, heads_q, head_dim_v]`` in q's dtype, or ``(out, lse)`` with
        ``return_lse``. A row that sees no key (and has no sink) gives zeros.

    Backends: TORCH (SDPA; the default wherever it can run the call: no sink, window, LSE or
    deterministic-on-CUDA request, and no empty causal rows) and TRITON (everything else); pin with
    ``GlobalBackendManager.set_attn_backend`` or ``PRIMUS_TURBO_ATTN_BACKEND``. Under
    ``torch.autocast`` q, k and v are cast to its dtype first, as for SDPA (core/amp.py).
    """
    if isinstance(q, torch.Tensor) and (amp := autocast_dtype(q)) is not None:
        q, k, v = cast_inputs(amp, q, k, v)  # (sink stays float32)
        with autocast_off(q):
            return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, bias, alibi_slopes,
                                   deterministic, return_lse, return_attn_probs, sink)
    _check_inputs(q, k, v, dropout_p, softmax_scale, window_size, bias, alibi_slopes, return_attn_probs, sink)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.size(-1))
    win_left, win_right = int(window_size[0]), int(window_size[1])
    if causal:
        win_right = 0
    deterministic = _deterministic(deterministic)
    kwargs = dict(
        q=q, k=k, v=v, sink=sink, softmax_scale=scale, win_left=win_left, win_right=win_right,
        return_lse=bool(return_lse), deterministic=deterministic,
    )
    backend = attn_dispatcher.resolve(PrecisionType.BF16_FP16_FP32, **kwargs)
    if backend.native_autograd:  # SDPA: PyTorch's autograd keeps its backward on SDPA
        return backend.execute(**kwargs)  # never with return_lse: TORCH's check() refuses it
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, sink)
    )
    if needs_grad:
        out, lse = FlashAttnFunction.apply(q, k, v, sink, scale, win_left, win_right, backend, deterministic)
    else:
        out, lse = _fwd(q, k, v, sink, scale, win_left, win_right)
    return (out, lse) if return_lse else out


def _deterministic(deterministic) -> bool:
    """The call's ``deterministic``, or PyTorch's global switch: a script that runs
    ``torch.use_deterministic_algorithms(True)`` (Megatron's ``--deterministic-mode``) gets the
    reproducible backward (off SDPA, no atomic dQ) without passing the flag to each call."""
    return bool(deterministic) or torch.are_deterministic_algorithms_enabled()


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Shape / dtype / device checks that need no host sync (cu_seqlens' values are never read)."""
    fn = "flash_attn_varlen_func"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{fn}: {name} must be 3-D [total_tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if k.size(0) != v.size(0):
        raise ValueError(f"{fn}: k and v must have the same total_k, got k={k.size(0)}, v={v.size(0)}")
    if q.size(2) == 0 or k.size(2) == 0:
        raise ValueError(f"{fn}: head_dim_qk must be >= 1, got q shape {tuple(q.shape)}, k shape {tuple(k.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{fn}: {name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{fn}: {name} must be 1-D [batch + 1], got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{fn}: {name} on {cu.device}, q on {q.device}")
        if not cu.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"{fn}: cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries, got "
            f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}"
        )
    # a sequence cannot be longer than the packed tensor: the only length check possible without a sync
    for name, m, total_name, total in (("max_seqlen_q", max_seqlen_q, "total_q", q.size(0)),
                                       ("max_seqlen_k", max_seqlen_k, "total_k", k.size(0))):
        if not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < 0:
            raise ValueError(f"{fn}: {name} must be a python int >= 0, got {m!r}")
        if m > total:
            raise ValueError(f"{fn}: {name}={m} exceeds {total_name}={total}")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
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
):
    """Softmax attention over packed variable-length sequences (THD layout), with autograd.

    Args:
        q: ``[total_q, heads_q, head_dim_qk]``; k: ``[total_k, heads_kv, head_dim_qk]``;
            v: ``[total_k, heads_kv, head_dim_v]`` (one dtype and device, any strides).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` on q's device, non-decreasing, starting at 0:
            sequence ``b`` is q rows ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1`` attending k/v rows
            ``cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1``. Their values are only read on the device
            (no host sync), so they are not validated: the caller guarantees them.
        max_seqlen_q, max_seqlen_k: python ints >= every sequence's length (they size the grid;
            rows of a longer sequence past ``max_seqlen`` are not computed).
        causal / window_size / sink / softmax_scale / deterministic: as :func:`flash_attn_func`, with
            the bottom-right alignment applied per sequence (``off = seqlen_k[b] - seqlen_q[b]``).
        dropout_p, bias, alibi_slopes, return_attn_probs: not implemented (NotImplementedError).
        return_lse: also return the LSE ``[heads_q, total_q]`` fp32 (flash-attention's varlen layout).

    Returns:
        ``out [total_q, heads_q, head_dim_v]`` or ``(out, lse)``. Rows outside
        ``cu_seqlens_q[0] .. cu_seqlens_q[-1]`` get zeros (LSE ``+inf``) and zero gradients.

    Backend: TRITON only (the TORCH/SDPA backend declines varlen: it would need a host sync).
    Under ``torch.autocast`` q, k and v are cast to its dtype first (core/amp.py).
    """
    if isinstance(q, torch.Tensor) and (amp := autocast_dtype(q)) is not None:
        q, k, v = cast_inputs(amp, q, k, v)
        with autocast_off(q):
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                          softmax_scale, causal, window_size, bias, alibi_slopes, deterministic,
                                          return_lse, return_attn_probs, sink)
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # the dense checks on [1, total, heads, dim] views cover dtype/device/heads/head-dim/window/sink
    _check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), dropout_p, softmax_scale, window_size, bias,
                  alibi_slopes, return_attn_probs, sink, fn="flash_attn_varlen_func")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.size(-1))
    win_left, win_right = int(window_size[0]), int(window_size[1])
    if causal:
        win_right = 0
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    deterministic = _deterministic(deterministic)
    kwargs = dict(
        q=q, k=k, v=v, sink=sink, softmax_scale=scale, win_left=win_left, win_right=win_right,
        return_lse=bool(return_lse), deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
    )
    backend = attn_dispatcher.resolve(PrecisionType.BF16_FP16_FP32, **kwargs)
    if backend is not AttnTritonBackend:  # only TRITON can handle varlen; a future backend must be wired here
        raise RuntimeError(f"flash_attn_varlen_func: backend {backend.backend_type.name} has no varlen path")
    args = (cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink))
    if needs_grad:
        # one tensor passed as both cu_seqlens (self-attention) goes in once: torch.compile cannot
        # trace an autograd.Function that receives the same tensor twice
        fargs = (cu_seqlens_q, None if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k, max_q, max_k)
        out, lse = FlashAttnVarlenFunction.apply(q, k, v, sink, *fargs, scale, win_left, win_right, backend,
                                                 deterministic)
    else:
        out, lse = _varlen_fwd(q, k, v, *args, sink, scale, win_left, win_right)
    return (out, lse) if return_lse else out
