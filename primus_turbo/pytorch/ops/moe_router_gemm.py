"""The router GEMM in high precision: ``turbo.ops.router_gating_linear``.

Megatron's ``moe_router_dtype="fp32"`` computes the router logits in fp32 while the activations
are bf16: ``logits = x.float() @ W.float()^T`` (Megatron's own ``router_gating_linear(inp, weight,
bias, router_dtype)``; the weight is fp32, or bf16 like the rest of the model). Done plainly this
casts the whole activation tensor to fp32 (an extra read and a 2x-size write, and an fp32 copy
saved for the backward) and runs three fp32 GEMMs with N = E on the CUDA cores.
:func:`router_gating_linear` gives the same logits without either cost: its Triton kernels
(``primus_turbo/triton/moe/router_gemm_kernel.py``) read the bf16 activations once and split every
fp32 operand into three bf16 pieces whose sum is exact (a bf16 weight is one piece), so bf16
tensor-core products, accumulated in fp32, form the fp32 GEMM. The tensor cores' accumulation inside
one MMA keeps fewer bits than an fp32 FMA chain: on the H200 the logits' relative error is 2-8e-6
against 0.6-1.1e-6 for cuBLAS fp32 (2e-3 for a bf16 router); ``PRIMUS_TURBO_ROUTER_GEMM_FUSED=0``
keeps the PyTorch expression. The saved tensor is the bf16 ``x`` itself.

Semantics, for ``x [..., H]``, ``weight [E, H]`` and ``rd = router_dtype or weight.dtype``::

    logits = x.to(rd) @ weight.to(rd)^T (+ bias.to(rd))          in rd, shape [..., E]
    grad x = (grad @ weight).to(x.dtype);  grad weight = (grad^T @ x).to(weight.dtype);
    grad bias = grad.sum over rows, in bias's dtype

Backends: the fused kernels for bf16 ``x``, ``rd`` fp32 and an fp32 or bf16 ``weight`` (and
``bias``) on CUDA (and on CPU under ``TRITON_INTERPRET=1``); every other case (fp16 ``x``, a 16-bit
``rd``, plain CPU) runs the PyTorch expression above, as does code traced by ``torch.compile``.
With ``fuse_bgrad_accum_pattern="megatron"`` the weight gradient (fp32 on the fused path) is added
into ``weight.main_grad`` (Megatron's ``gradient_accumulation_fusion``) and a placeholder gradient
is returned, as :func:`turbo.ops.gemm` does. No host synchronisation; the weight gradient is
reduced from per-split fp32 partials in a fixed order (deterministic).
"""

from __future__ import annotations

from typing import Optional

import torch

from primus_turbo.triton import is_interpreter, triton_available

from ..core.amp import autocast_dtype, autocast_off
from .gemm import _flag_main_grad, _megatron_dummy_wgrad, check_main_grad

__all__ = ["router_gating_linear", "router_gemm_backend"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FUSED_W = (torch.float32, torch.bfloat16)


def router_gemm_backend(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                        router_dtype: Optional[torch.dtype] = None) -> str:
    """``"triton"`` (the fused kernels: bf16 x, fp32 logits, fp32 or bf16 weight) where they
    apply, else ``"torch"``."""
    rd = router_dtype or weight.dtype
    if x.dtype != torch.bfloat16 or rd != torch.float32 or torch.compiler.is_compiling():
        # traced code (torch.compile) gets the PyTorch expression, which the compiler can fuse
        return "torch"
    if weight.dtype not in _FUSED_W or (bias is not None and bias.dtype not in _FUSED_W):
        return "torch"
    from primus_turbo.pytorch.core.env import env_auto_flag

    if env_auto_flag("PRIMUS_TURBO_ROUTER_GEMM_FUSED") is False:
        return "torch"
    if triton_available() and (x.is_cuda or (x.device.type == "cpu" and is_interpreter())):
        return "triton"
    return "torch"


def _check(x, weight, bias, router_dtype, fuse):
    op = "router_gating_linear"
    if router_dtype is not None and router_dtype not in _DTYPES:
        raise ValueError(f"{op}: router_dtype must be float32, bfloat16, float16 or None, got {router_dtype}")
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{op}: {name}.dtype must be float32, bfloat16 or float16, got {t.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D [experts, hidden], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x's last dim must equal weight.shape[1]={weight.shape[1]}, "
                         f"got x shape {tuple(x.shape)}")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"{op}: weight must be non-empty, got shape {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"{op}: x is on {x.device} but weight is on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{op}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(f"{op}: bias must be [{weight.shape[0]}] of weight's dtype {weight.dtype} on "
                             f"{weight.device}, got shape {tuple(bias.shape)}, {bias.dtype} on {bias.device}")
    if fuse not in (None, "megatron"):
        raise ValueError(f"{op}: fuse_bgrad_accum_pattern must be None or 'megatron', got {fuse!r}")
    if fuse == "megatron" and getattr(weight, "main_grad", None) is None:
        raise ValueError(f"{op}: fuse_bgrad_accum_pattern='megatron' needs weight.main_grad")
    if fuse == "megatron" and weight.requires_grad and torch.is_grad_enabled():
        # shape, device and dtype now, not as a broadcasting error (or a silent no-op on another
        # device) in the backward's main_grad.add_
        check_main_grad(op, weight, weight.dtype, name="weight")


class _RouterGatingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rd, fuse):
        h = x.shape[-1]
        x2 = x.reshape(-1, h)
        if x2.shape[0] > 0 and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        backend = router_gemm_backend(x2, weight, bias, rd)
        if x2.shape[0] == 0:
            out = x2.new_empty((0, weight.shape[0]), dtype=rd)
        elif backend == "triton":
            from primus_turbo.triton.moe.router_gemm_kernel import router_fwd_launch

            out = router_fwd_launch(x2, weight.contiguous(), None if bias is None else bias.contiguous())
        else:
            out = torch.nn.functional.linear(x2.to(rd), weight.to(rd), None if bias is None else bias.to(rd))
        ctx.backend, ctx.fuse, ctx.x_shape, ctx.rd = backend, fuse, x.shape, rd
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # the backward reads the 16-bit x itself (never an rd copy) and the weight
        ctx.save_for_backward(x2 if need_gw else None, weight if (need_gx or (fuse and need_gw)) else None)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        need_gx, need_gw, need_gb = ctx.needs_input_grad[:3]
        e = grad.shape[-1]
        g = grad.reshape(-1, e)
        t = g.shape[0]
        fused = ctx.backend == "triton" and t > 0
        if fused:
            g = g.to(torch.float32).contiguous()
        gx = gw = gb = None
        if need_gx:
            if t == 0:
                gx = torch.zeros(ctx.x_shape, dtype=ctx.x_dtype, device=grad.device)
            elif fused:
                from primus_turbo.triton.moe.router_gemm_kernel import router_dx_launch

                gx = router_dx_launch(g, weight.contiguous()).reshape(ctx.x_shape)
            else:
                gx = (g.to(ctx.rd) @ weight.to(ctx.rd)).to(ctx.x_dtype).reshape(ctx.x_shape)
        if need_gw:
            if t == 0:
                dw = torch.zeros((e, x2.shape[1]), dtype=ctx.rd, device=grad.device)
            elif fused:
                from primus_turbo.triton.moe.router_gemm_kernel import router_dw_launch

                dw = router_dw_launch(x2, g).sum(0)
            else:
                dw = g.to(ctx.rd).t() @ x2.to(ctx.rd)
            if ctx.fuse:
                weight.main_grad.add_(dw)
                gw = _megatron_dummy_wgrad(weight)  # (the flag: router_gating_linear sets it with the forward)
            else:
                gw = dw.to(ctx.w_dtype)
        if need_gb:
            gb = g.to(torch.float32).sum(0).to(ctx.b_dtype)
        return gx, gw, gb, None, None


def router_gating_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         router_dtype: Optional[torch.dtype] = None, *,
                         fuse_bgrad_accum_pattern: Optional[str] = None) -> torch.Tensor:
    """Router logits ``x @ weight^T (+ bias)`` computed in ``router_dtype`` (default: weight's
    dtype) from ``x`` of another dtype, without materialising ``x`` in that dtype (see the module
    docstring). The positional order is Megatron's ``router_gating_linear(inp, weight, bias,
    router_dtype)``.

    Args:
        x: ``[..., H]`` activations (bf16 for the fused kernels; any float dtype otherwise).
        weight: ``[E, H]`` router weight (fp32 or bf16 for the fused kernels).
        bias: optional ``[E]`` in weight's dtype.
        router_dtype: dtype of the logits and of the GEMM's math (fp32 for the fused kernels).
        fuse_bgrad_accum_pattern: ``None`` or ``"megatron"``: the weight gradient is added into
            ``weight.main_grad`` and a placeholder gradient is returned.

    Returns:
        ``[..., E]`` logits in ``router_dtype``. Gradients: ``x``'s in ``x.dtype``, ``weight``'s
        and ``bias``'s in their dtypes, with fp32 accumulation on the fused path.
    """
    if isinstance(x, torch.Tensor) and autocast_dtype(x) is not None:
        # the logits' dtype is router_dtype's choice, not autocast's: the body (whose PyTorch path
        # multiplies in router_dtype) runs with autocast off, the inputs as given (core/amp.py)
        with autocast_off(x):
            return router_gating_linear(x, weight, bias, router_dtype, fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
    _check(x, weight, bias, router_dtype, fuse_bgrad_accum_pattern)
    out = _RouterGatingLinear.apply(x, weight, bias, router_dtype or weight.dtype, fuse_bgrad_accum_pattern)
    if fuse_bgrad_accum_pattern == "megatron" and weight.requires_grad and torch.is_grad_enabled():
        _flag_main_grad(weight)
    return out
