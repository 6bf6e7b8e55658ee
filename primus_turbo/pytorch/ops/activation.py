"""Gated activations: ``turbo.ops.swiglu``, ``swiglu_with_probs``, ``geglu_with_probs``.

Semantics (fp32 math whatever the storage dtype), for ``x = [a | b]`` split in halves on the last
dim (``a = x[..., :F]`` is the gate, ``b = x[..., F:]``)::

    swiglu(x)                         = silu(a) * b
    swiglu_with_probs(x, p, mask)     = silu(a) * b * p[..., None]       (0 on rows with mask == 0)
    geglu_with_probs(x, p, mask)      = gelu_tanh(a) * b * p[..., None]  (0 on rows with mask == 0)

``gelu_tanh`` is the tanh approximation, ``0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))``
(``F.gelu(approximate="tanh")``). ``x``: bf16 / fp16 / fp32, last dim even; the probs variants take
``x [..., 2F]``, ``probs [...]`` float32 (the MoE router weights of each token-expert row) and an
optional ``row_mask [...]`` (bool or any integer dtype, e.g. Primus-Turbo's int64; 0 = padding row),
where ``[...]`` is ``x.shape[:-1]`` or its flattened ``[T]`` (T = the product of x's leading dims):
the leading dims are flattened (a view when the input is contiguous) and the output is
``[..., F]``, ``dx`` x's shape, ``dprobs`` probs' shape (an empty last dim, F = 0, gives ``[..., 0]``,
zero gradients). Outputs have x's dtype. Backward:
``dx`` (x's dtype) and ``dprobs`` (fp32, reduced over the row in a fixed order); masked rows get
exact zeros in the output, ``dx`` and ``dprobs`` whatever ``x`` / ``probs`` hold there.

Backend: the Triton kernels (primus_turbo/triton/activation) on CUDA and on CPU under the Triton
interpreter; on plain CPU a PyTorch implementation (:func:`act_backend`). The kernel entry points
are ``torch.library`` custom ops (``primus_turbo::glu_fwd_impl``, ``primus_turbo::glu_bwd_impl``)
with fake implementations; eager calls skip the dispatcher.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from primus_turbo.triton import is_interpreter, triton_available

__all__ = ["swiglu", "swiglu_with_probs", "geglu_with_probs", "act_backend"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACTS = {"silu": 0, "gelu_tanh": 1}


def act_backend(x: torch.Tensor) -> str:
    """``"triton"`` on CUDA (and on CPU under ``TRITON_INTERPRET=1``), else ``"torch"``."""
    if triton_available() and (x.is_cuda or (x.device.type == "cpu" and is_interpreter())):
        return "triton"
    return "torch"


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch fallback (fp32 math)
# ----------------------------------------------------------------------------------------------
def _act_grad(a: torch.Tensor, act: int):
    if act == 0:
        sg = torch.sigmoid(a)
        return a * sg, sg * (1.0 + a * (1.0 - sg))
    k0, k1 = math.sqrt(2.0 / math.pi), 0.044715
    t = torch.tanh(k0 * (a + k1 * a ** 3))
    return 0.5 * a * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * k0 * (1.0 + 3.0 * k1 * a * a)


def _torch_fwd(x, act, probs, mask):
    f = x.shape[1] // 2
    a, b = x[:, :f].float(), x[:, f:].float()
    out = _act_grad(a, act)[0] * b
    if probs is not None:
        out = out * probs[:, None]
    if mask is not None:
        out = torch.where(mask[:, None] != 0, out, 0.0)
    return out.to(x.dtype)


def _torch_bwd(dout, x, act, probs, mask):
    f = x.shape[1] // 2
    a, b = x[:, :f].float(), x[:, f:].float()
    g, dg = _act_grad(a, act)
    do = dout.float()
    dp = None
    if probs is not None:
        dp = (do * g * b).sum(1)
        do = do * probs[:, None]
    da, db = do * b * dg, do * g
    if mask is not None:
        keep = mask[:, None] != 0
        da, db = torch.where(keep, da, 0.0), torch.where(keep, db, 0.0)
        if dp is not None:
            dp = torch.where(mask != 0, dp, 0.0)
    return torch.cat([da, db], 1).to(x.dtype), (dp[None] if dp is not None else None)


# ----------------------------------------------------------------------------------------------
# Custom ops (2-D contiguous, validated arguments; probs / mask empty tensors when absent)
# ----------------------------------------------------------------------------------------------
def _fwd_eager(x: torch.Tensor, act: int, probs: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> torch.Tensor:
    rows, f = x.shape[0], x.shape[1] // 2
    if rows == 0 or f == 0:
        return x.new_zeros((rows, f))
    if act_backend(x) == "triton":
        from primus_turbo.triton.activation import glu_fwd_launch

        return glu_fwd_launch(x, act, probs, mask)
    return _torch_fwd(x, act, probs, mask)


glu_fwd_impl = torch.library.custom_op("primus_turbo::glu_fwd_impl", _fwd_eager, mutates_args=())


@glu_fwd_impl.register_fake
def _fwd_fake(x, act, probs, mask):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def _bwd_eager(dout: torch.Tensor, x: torch.Tensor, act: int, probs: Optional[torch.Tensor],
               mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dprobs); dprobs is fp32 [T], or empty without probs."""
    rows, f = x.shape[0], x.shape[1] // 2
    if rows == 0 or f == 0:
        return torch.zeros_like(x), x.new_zeros((rows if probs is not None else 0,), dtype=torch.float32)
    if act_backend(x) == "triton":
        from primus_turbo.triton.activation import glu_bwd_launch

        dx, part = glu_bwd_launch(dout, x, act, probs, mask)
    else:
        dx, part = _torch_bwd(dout, x, act, probs, mask)
    dp = part.sum(0) if part is not None else x.new_empty((0,), dtype=torch.float32)
    return dx, dp


glu_bwd_impl = torch.library.custom_op("primus_turbo::glu_bwd_impl", _bwd_eager, mutates_args=())


@glu_bwd_impl.register_fake
def _bwd_fake(dout, x, act, probs, mask):
    return torch.empty_like(x), x.new_empty((x.shape[0] if probs is not None else 0,), dtype=torch.float32)


def _fwd(x, act, probs, mask):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.glu_fwd_impl(x, act, probs, mask)
    return _fwd_eager(x, act, probs, mask)


def _bwd(dout, x, act, probs, mask):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.glu_bwd_impl(dout, x, act, probs, mask)
    return _bwd_eager(dout, x, act, probs, mask)


class GLUFunction(torch.autograd.Function):
    """``x [..., 2F]`` -> ``[..., F]``; ``probs`` / ``mask`` (validated) hold one entry per row of the
    flattened ``x`` in any shape; the 2-D kernels see ``x [T, 2F]``, ``probs [T]``, ``mask [T]``
    (reshape: views when contiguous) and the gradients come back in x's and probs' shapes."""

    @staticmethod
    def forward(ctx, x, probs, mask, act):
        shape = x.shape
        # explicit row count: reshape(-1, 0) of an empty last dim is ambiguous
        x2 = x.reshape(math.prod(shape[:-1]), shape[-1]).contiguous()
        p = probs.reshape(-1).contiguous() if probs is not None else None
        m = mask.reshape(-1).contiguous() if mask is not None else None
        out = _fwd(x2, act, p, m)
        ctx.act, ctx.shape, ctx.has_p = act, shape, p is not None
        ctx.p_shape = probs.shape if probs is not None else None
        ctx.save_for_backward(x2, p, m)
        return out.view(*shape[:-1], shape[-1] // 2)

    @staticmethod
    def backward(ctx, dout):
        x2, p, mask = ctx.saved_tensors
        do2 = dout.reshape(x2.shape[0], x2.shape[1] // 2).contiguous()
        dx, dp = _bwd(do2, x2, ctx.act, p, mask)
        return (dx.view(ctx.shape) if ctx.needs_input_grad[0] else None,
                dp.view(ctx.p_shape) if (ctx.has_p and ctx.needs_input_grad[1]) else None, None, None)


def _check_x(op: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: x.dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"{op}: x must be [..., 2F] with an even last dim, got shape {tuple(x.shape)}")


def _check_probs(op: str, x, probs, row_mask):
    """``x [..., 2F]``; ``probs`` float32 and ``row_mask`` (bool / integer or None) each either
    ``x.shape[:-1]`` or its flattened ``[T]`` (Primus-Turbo flattens ``probs`` and takes a 1-D mask)."""
    _check_x(op, x)
    lead = tuple(x.shape[:-1])
    rows = math.prod(lead)
    want = (f"[T] = [{rows}] (x's rows)" if len(lead) == 1 else
            f"x.shape[:-1] = {list(lead)} or its flattened [T] = [{rows}]")
    _check_row_tensors(op, x, probs, row_mask, {lead, (rows,)}, want)


def _check_row_args(op: str, x, probs, row_mask):
    """``probs`` float32 ``[T]`` and ``row_mask`` (bool / integer ``[T]`` or None) for the rows of the
    2-D ``x`` on its device (shared with ``grouped_gemm_glu``, whose ``x`` is the GEMM's input)."""
    _check_row_tensors(op, x, probs, row_mask, {(x.shape[0],)}, f"[T] = [{x.shape[0]}] (x's rows)")


def _check_row_tensors(op: str, x, probs, row_mask, shapes: set, want: str) -> None:
    """``probs`` float32 and ``row_mask`` (bool / integer or None), each of one of ``shapes`` (said
    as ``want``), on ``x``'s device."""
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"{op}: probs must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dtype != torch.float32:
        raise TypeError(f"{op}: probs.dtype must be float32, got {probs.dtype}")
    if tuple(probs.shape) not in shapes:
        raise ValueError(f"{op}: probs must be {want}, got shape {tuple(probs.shape)} (x is {tuple(x.shape)})")
    if probs.device != x.device:
        raise ValueError(f"{op}: x and probs must be on the same device, got {x.device} and {probs.device}")
    if row_mask is not None:
        if not isinstance(row_mask, torch.Tensor):
            raise TypeError(f"{op}: row_mask must be a torch.Tensor or None, got {type(row_mask).__name__}")
        if row_mask.dtype.is_floating_point or row_mask.is_complex():
            raise TypeError(f"{op}: row_mask.dtype must be bool or an integer dtype, got {row_mask.dtype}")
        if tuple(row_mask.shape) not in shapes:
            raise ValueError(f"{op}: row_mask must be {want}, got shape {tuple(row_mask.shape)} "
                             f"(x is {tuple(x.shape)})")
        if row_mask.device != x.device:
            raise ValueError(f"{op}: x and row_mask must be on the same device, got {x.device} and {row_mask.device}")


def _mask_arg(row_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The mask the kernels read: contiguous, bool viewed as uint8, any integer dtype as is (the
    kernels and the torch fallback test ``!= 0``)."""
    if row_mask is None:
        return None
    m = row_mask.contiguous()
    if m.dtype != torch.bool:
        return m
    # eager: a free reinterpretation; inductor (torch 2.11) cannot lower a bool -> uint8 dtype view
    # of a computed mask, so under compile a cast (fused into the mask's producer) instead
    return m.to(torch.uint8) if torch.compiler.is_compiling() else m.view(torch.uint8)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]`` with autograd; ``x [..., 2F]`` -> ``[..., F]`` (x's dtype).

    Example::

        >>> import torch, primus_turbo.pytorch as turbo
        >>> turbo.ops.swiglu(torch.randn(4, 64)).shape
        torch.Size([4, 32])
    """
    _check_x("swiglu", x)
    return GLUFunction.apply(x, None, None, _ACTS["silu"])


def swiglu_with_probs(x: torch.Tensor, probs: torch.Tensor, row_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MoE SwiGLU: ``silu(a) * b * probs[..., None]``, rows with ``row_mask == 0`` exactly 0.

    ``x [..., 2F]`` (bf16/fp16/fp32; typically ``[T, 2F]``), ``probs [...]`` float32, ``row_mask [...]``
    bool / int32 / int64 (any integer dtype) or None, where ``[...]`` is ``x.shape[:-1]`` or its
    flattened ``[T]``. Returns ``[..., F]`` in x's dtype. Gradients flow to ``x`` and ``probs`` (in
    their shapes; masked rows get zero gradients).

    Raises:
        ValueError: odd last dim, or probs / row_mask shapes that are neither ``x.shape[:-1]`` nor
            ``[T]``; TypeError: dtypes (probs not float32, row_mask floating point).
    """
    _check_probs("swiglu_with_probs", x, probs, row_mask)
    return GLUFunction.apply(x, probs, _mask_arg(row_mask), _ACTS["silu"])


def geglu_with_probs(x: torch.Tensor, probs: torch.Tensor, row_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MoE GeGLU with the **tanh approximation** of GELU: ``gelu_tanh(a) * b * probs[..., None]``.

    Arguments as :func:`swiglu_with_probs`.
    """
    _check_probs("geglu_with_probs", x, probs, row_mask)
    return GLUFunction.apply(x, probs, _mask_arg(row_mask), _ACTS["gelu_tanh"])
