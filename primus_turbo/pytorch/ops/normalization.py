"""RMSNorm: ``turbo.ops.rmsnorm`` and ``turbo.ops.rmsnorm_residual`` (the fused pre-norm add).

Semantics (fp32 math whatever the storage dtype)::

    w   = gamma            (zero_centered=False)      w = 1 + gamma   (zero_centered=True)
    y   = x / sqrt(mean(x^2, dim=-1) + eps) * w
    rmsnorm_residual: s = x + residual (rounded to x.dtype), y = rmsnorm(s); returns (y, s)

``x`` is ``[..., H]`` (any leading dims; bf16 / fp16 / fp32), ``gamma`` is ``[H]`` of x's dtype or
fp32; ``y`` has x's dtype and shape. Backward gives ``dx`` (and, with a residual, the same tensor
for ``d residual``: both inputs of the add get ``dL/ds``) and ``dgamma`` in gamma's dtype, reduced
over rows from per-program fp32 partials in a fixed order (deterministic, no atomics).

Backend: the Triton kernels (primus_turbo/triton/normalization) on CUDA and on CPU under the
Triton interpreter; on plain CPU a PyTorch implementation (:func:`norm_backend`). The kernel entry
points are ``torch.library`` custom ops (``primus_turbo::rmsnorm_fwd_impl``,
``primus_turbo::rmsnorm_bwd_impl``) with fake implementations, so ``torch.compile(fullgraph=True)``
works; eager calls skip the dispatcher. Non-contiguous inputs are copied first.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from primus_turbo.triton import is_interpreter, triton_available

__all__ = ["rmsnorm", "rmsnorm_residual", "norm_backend"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def norm_backend(x: torch.Tensor) -> str:
    """``"triton"`` on CUDA (and on CPU under ``TRITON_INTERPRET=1``), else ``"torch"``."""
    if triton_available() and (x.is_cuda or (x.device.type == "cpu" and is_interpreter())):
        return "triton"
    return "torch"


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch fallback (fp32 math, same outputs as the kernels up to rounding)
# ----------------------------------------------------------------------------------------------
def _torch_fwd(x, gamma, eps, zero_centered, residual):
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    sf = s.float()
    rstd = torch.rsqrt(sf.square().mean(-1) + eps)
    w = gamma.float() + 1.0 if zero_centered else gamma.float()
    y = (sf * rstd[:, None] * w).to(x.dtype)
    return y, (s if residual is not None else None), rstd


def _torch_bwd(dy, s, gamma, rstd, zero_centered, ds):
    w = gamma.float() + 1.0 if zero_centered else gamma.float()
    xhat = s.float() * rstd[:, None]
    dyf = dy.float()
    dyw = dyf * w
    c = (dyw * xhat).mean(-1, keepdim=True)
    dx = rstd[:, None] * (dyw - xhat * c)
    if ds is not None:
        dx = dx + ds.float()
    return dx.to(s.dtype), (dyf * xhat).sum(0, keepdim=True)


# ----------------------------------------------------------------------------------------------
# Custom ops (2-D contiguous, validated arguments)
# ----------------------------------------------------------------------------------------------
def _fwd_eager(x: torch.Tensor, gamma: torch.Tensor, eps: float, zero_centered: bool,
               residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, s, rstd); without a residual ``s`` is an empty placeholder."""
    if x.shape[0] == 0:
        y, s, rstd = torch.empty_like(x), torch.empty_like(x), x.new_empty((0,), dtype=torch.float32)
    elif norm_backend(x) == "triton":
        from primus_turbo.triton.normalization import rmsnorm_fwd_launch

        y, s, rstd = rmsnorm_fwd_launch(x, gamma, eps, zero_centered, residual)
    else:
        y, s, rstd = _torch_fwd(x, gamma, eps, zero_centered, residual)
    if residual is None:
        s = x.new_empty((0,))
    return y, s, rstd


rmsnorm_fwd_impl = torch.library.custom_op("primus_turbo::rmsnorm_fwd_impl", _fwd_eager, mutates_args=())


@rmsnorm_fwd_impl.register_fake
def _fwd_fake(x, gamma, eps, zero_centered, residual):
    s = torch.empty_like(x) if residual is not None else x.new_empty((0,))
    return torch.empty_like(x), s, x.new_empty((x.shape[0],), dtype=torch.float32)


def _bwd_eager(dy: torch.Tensor, s: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor, zero_centered: bool,
               ds: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dgamma) with dgamma in gamma's dtype."""
    if s.shape[0] == 0:
        return torch.empty_like(s), torch.zeros_like(gamma)
    if norm_backend(s) == "triton":
        from primus_turbo.triton.normalization import rmsnorm_bwd_launch

        dx, part = rmsnorm_bwd_launch(dy, s, gamma, rstd, zero_centered, ds)
    else:
        dx, part = _torch_bwd(dy, s, gamma, rstd, zero_centered, ds)
    return dx, part.sum(0).to(gamma.dtype)


rmsnorm_bwd_impl = torch.library.custom_op("primus_turbo::rmsnorm_bwd_impl", _bwd_eager, mutates_args=())


@rmsnorm_bwd_impl.register_fake
def _bwd_fake(dy, s, gamma, rstd, zero_centered, ds):
    return torch.empty_like(s), torch.empty_like(gamma)


def _fwd(x, gamma, eps, zero_centered, residual):
    # Eager calls skip the custom-op dispatcher; traced code must see the op.
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.rmsnorm_fwd_impl(x, gamma, eps, zero_centered, residual)
    return _fwd_eager(x, gamma, eps, zero_centered, residual)


def _bwd(dy, s, gamma, rstd, zero_centered, ds):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.rmsnorm_bwd_impl(dy, s, gamma, rstd, zero_centered, ds)
    return _bwd_eager(dy, s, gamma, rstd, zero_centered, ds)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, residual, eps, zero_centered):
        shape = x.shape
        h = shape[-1]
        x2 = x.reshape(-1, h).contiguous()
        r2 = residual.reshape(-1, h).contiguous() if residual is not None else None
        y, s, rstd = _fwd(x2, gamma.contiguous(), eps, zero_centered, r2)
        has_res = residual is not None
        ctx.zero_centered, ctx.has_res, ctx.shape = zero_centered, has_res, shape
        ctx.save_for_backward(s if has_res else x2, gamma, rstd)
        if has_res:
            return y.view(shape), s.view(shape)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy, ds=None):
        s, gamma, rstd = ctx.saved_tensors
        h = ctx.shape[-1]
        dy2 = dy.reshape(-1, h).contiguous()
        ds2 = ds.reshape(-1, h).contiguous() if (ctx.has_res and ds is not None) else None
        dx, dgamma = _bwd(dy2, s, gamma, rstd, ctx.zero_centered, ds2)
        dx = dx.view(ctx.shape)
        dres = dx if (ctx.has_res and ctx.needs_input_grad[2]) else None
        return (dx if ctx.needs_input_grad[0] else None, dgamma if ctx.needs_input_grad[1] else None,
                dres, None, None)


def _check(op, x, gamma, eps, zero_centered, residual=None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(gamma, torch.Tensor):
        raise TypeError(f"{op}: gamma must be a torch.Tensor, got {type(gamma).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: x.dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must be [..., H] with H >= 1, got shape {tuple(x.shape)}")
    if gamma.dim() != 1 or gamma.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: gamma must be [H] = [{x.shape[-1]}] (x's last dim), got shape {tuple(gamma.shape)}")
    if gamma.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{op}: gamma.dtype must be x.dtype ({x.dtype}) or float32, got {gamma.dtype}")
    if gamma.device != x.device:
        raise ValueError(f"{op}: x and gamma must be on the same device, got x on {x.device}, gamma on {gamma.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        # inf would silently give y = 0 (and zero gradients), NaN NaNs
        raise ValueError(f"{op}: eps must be a non-negative float (finite), got {eps!r}")
    if not isinstance(zero_centered, bool):
        raise TypeError(f"{op}: zero_centered must be a bool, got {type(zero_centered).__name__}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{op}: residual must be a torch.Tensor, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual.dtype must equal x.dtype ({x.dtype}), got {residual.dtype}")
        if residual.device != x.device:
            raise ValueError(f"{op}: x and residual must be on the same device, got {x.device} and {residual.device}")


def rmsnorm(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim with autograd: ``y = x / sqrt(mean(x^2) + eps) * w``.

    Args:
        x: ``[..., H]``, float32 / bfloat16 / float16.
        gamma: ``[H]``, x's dtype or float32 (dgamma comes back in gamma's dtype).
        eps: added to the mean square.
        zero_centered: ``w = 1 + gamma`` (gamma stored centred on zero) instead of ``w = gamma``.

    Returns:
        ``y``, x's shape and dtype.

    Example::

        >>> import torch, primus_turbo.pytorch as turbo
        >>> x = torch.randn(4, 64); g = torch.ones(64)
        >>> turbo.ops.rmsnorm(x, g).shape
        torch.Size([4, 64])
    """
    _check("rmsnorm", x, gamma, eps, zero_centered)
    return RMSNormFunction.apply(x, gamma, None, float(eps), zero_centered)


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6,
                     zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused pre-norm residual step: ``s = x + residual`` (rounded to x.dtype), ``y = rmsnorm(s)``.

    Returns ``(y, s)``: ``s`` is the next residual stream. One kernel reads x and residual once and
    writes y and s once; the backward adds the gradient flowing into ``s`` to the norm's gradient
    and returns it for both ``x`` and ``residual``. Arguments as :func:`rmsnorm`; ``residual`` has
    x's shape and dtype.
    """
    _check("rmsnorm_residual", x, gamma, eps, zero_centered, residual)
    return RMSNormFunction.apply(x, gamma, residual, float(eps), zero_centered)
