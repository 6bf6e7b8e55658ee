"""The fp32 router GEMM of an MoE layer fed bf16 activations: ``logits = x.float() @ weight.T`` with
fp32-class accuracy on bf16 tensor cores (no fp32 copy of ``x``, no SIMT sgemm).

router_logits(x, weight) -> logits [T, E] float32
    ``x [T, H]`` bfloat16, ``weight [E, H]`` float32 (Megatron's ``moe_router_dtype="fp32"``: the
    router weight and its GEMM in fp32 while the experts run in bf16). Differentiable in both;
    ``x.grad`` is bf16 and ``weight.grad`` fp32, as ``F.linear(x.float(), weight)`` followed by the
    cast back gives them.

Why: the plain form materializes ``x.float()`` (6 bytes of traffic per element of ``x``), runs three
skinny fp32 GEMMs (E = 8-256 columns) on CUDA cores at a fraction of the memory bandwidth, and casts
the fp32 ``dx`` back to bf16. On the H200 these took ~0.6 ms of a 16 ms GPT-OSS-20B MoE layer step
(16384 tokens; H 2880, E 32).

How: an fp32 value ``w`` splits into three bf16 values ``w = hi + mid + lo`` (each the bf16 rounding
of what the previous ones leave; 3 x 8 significand bits cover fp32's 24, and bf16 has fp32's
exponent range), and a product of two bf16 values is exact in fp32. So with ``x`` already bf16:

    logits = (x @ lo.T + x @ mid.T) + x @ hi.T           one GEMM of x with [hi; mid; lo] ([3E, H])
    dW     = (lo_g.T @ x + mid_g.T @ x) + hi_g.T @ x     one GEMM of [hi_g; mid_g; lo_g].T ([3E, T]) with x
    dx     = [hi_g, hi_g, hi_g, mid_g, mid_g, lo_g] @ [hi; mid; lo; hi; mid; hi]   (K = 6E, bf16 out)

with ``g = dlogits`` split the same way. The GEMMs take bf16 operands and accumulate in fp32
(``torch.mm(..., out_dtype=torch.float32)`` on CUDA); the three partial results are summed
smallest first. ``dx`` drops the three cross terms below ``2**-24`` relative (``mid_g @ lo``,
``lo_g @ mid``, ``lo_g @ lo``) and rounds once to bf16. The result differs from the SIMT sgemm only
in the fp32 accumulation order (the tests bound it against an fp64 reference, next to the plain fp32
path's own error). Off CUDA the bf16-operand GEMMs are emulated exactly with fp32 matmuls (the
products are exact either way), so the CPU tests run the same split arithmetic.

Non-finite weights or gradients give NaN where the plain fp32 path could give +-inf (``inf - inf``
in the split); finite inputs whose magnitude is below ~1e-33 lose their lowest bits (the third
term underflows bf16's normal range).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .gemm import _megatron_dummy_wgrad, check_main_grad

__all__ = ["router_logits"]

_MM_DTYPE_OK = {"cuda": None}  # does torch.mm(..., out_dtype=float32) run on CUDA? (None: not tried)


def _split3(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``t`` -> bf16 ``(hi, mid, lo)`` with ``hi + mid + lo == t`` (finite, normal-range values)."""
    hi = t.to(torch.bfloat16)
    r = t - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 operands with fp32 accumulation and an fp32 result."""
    if a.is_cuda and _MM_DTYPE_OK["cuda"] is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _MM_DTYPE_OK["cuda"] = True
            return out
        except (RuntimeError, TypeError):  # a torch without the fp32-output bf16 GEMM
            _MM_DTYPE_OK["cuda"] = False
    return a.float() @ b.float()  # exact products, fp32 sums: the same arithmetic class


def _mm_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 operands, fp32 accumulation, one rounding to bf16."""
    if a.is_cuda:
        return torch.mm(a, b)
    return (a.float() @ b.float()).to(torch.bfloat16)


def _sum3(o: torch.Tensor, e: int, dim: int) -> torch.Tensor:
    """``(lo + mid) + hi`` of the three ``e``-wide slices of ``o`` along ``dim`` (hi first)."""
    hi, mid, lo = o.split(e, dim=dim)
    return (lo + mid) + hi


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, fuse_accum: bool) -> torch.Tensor:
        e = weight.shape[0]
        w3 = torch.cat(_split3(weight), 0)  # [3E, H]
        ctx.save_for_backward(x, weight)
        ctx.fuse_accum = fuse_accum
        return _sum3(_mm_f32(x, w3.t()), e, 1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        e = weight.shape[0]
        gh, gm, gl = _split3(g.float())
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wh, wm, wl = _split3(weight)
            a = torch.cat([gh, gh, gh, gm, gm, gl], 1)  # [T, 6E]
            b = torch.cat([wh, wm, wl, wh, wm, wh], 0)  # [6E, H]
            dx = _mm_bf16(a, b)
        if ctx.needs_input_grad[1]:
            dw = _sum3(_mm_f32(torch.cat([gh, gm, gl], 1).t(), x), e, 0)
            if ctx.fuse_accum:
                weight.main_grad.add_(dw)
                weight.grad_added_to_main_grad = True
                dw = _megatron_dummy_wgrad(weight)
        return dx, dw, None


def router_logits(x: torch.Tensor, weight: torch.Tensor,
                  fuse_bgrad_accum_pattern: Optional[str] = None) -> torch.Tensor:
    """``x.float() @ weight.T`` for bf16 ``x [T, H]`` and fp32 ``weight [E, H]`` (see the module
    docstring); fp32 ``[T, E]``. ``fuse_bgrad_accum_pattern="megatron"``: the weight gradient is added
    into ``weight.main_grad`` (fp32 or bf16), ``weight.grad_added_to_main_grad`` is set and the
    autograd gradient of ``weight`` is a placeholder, as :func:`turbo.ops.gemm` does."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("router_logits: x and weight must be tensors")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: x must be [T, H] and weight [E, H], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.float32:
        raise TypeError(f"router_logits: x must be bfloat16 and weight float32, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"router_logits: x on {x.device}, weight on {weight.device}")
    if fuse_bgrad_accum_pattern not in (None, "megatron"):
        raise ValueError(f"router_logits: fuse_bgrad_accum_pattern must be None or 'megatron', got "
                         f"{fuse_bgrad_accum_pattern!r}")
    fuse = fuse_bgrad_accum_pattern == "megatron" and weight.requires_grad and torch.is_grad_enabled()
    if fuse:
        check_main_grad("router_logits", weight, torch.bfloat16)
    return _RouterLogits.apply(x, weight, fuse)
