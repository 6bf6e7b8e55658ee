"""Dense GEMM: ``turbo.ops.gemm``.

Semantics, fixed once: ``C[M, N] = op(A) @ op(B)`` where ``op(A) = A`` (``A`` stored ``[M, K]``) or
``A.T`` (``trans_a=True``, stored ``[K, M]``), and likewise ``op(B)`` with ``B`` stored ``[K, N]``
or ``[N, K]`` (``trans_b=True``, the ``nn.Linear`` weight layout). The three GEMMs of training:

* output:      ``C  = op(A) @ op(B)``
* grad_input:  ``dA = dC @ op(B).T``      (stored like ``A``)
* grad_weight: ``dB = op(A).T @ dC``      (stored like ``B``; optionally ``B.main_grad += dB``)

Each GEMM is registered as a ``torch.library`` custom op (``primus_turbo::gemm_impl`` or, for the
accumulating variant, ``primus_turbo::gemm_accum_impl``) with a fake implementation, and traced
code calls it through ``torch.ops`` so ``torch.compile(fullgraph=True)`` works; eager code calls
the same function directly. Each GEMM is dispatched on its own shape key (core/backend.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends.gemm import GEMM_DTYPES, all_gemms_on_torch, gemm_dispatcher, torch_autograd_mm
from ..core.amp import autocast_dtype, gemm_under_autocast
from ..core.backend import PrecisionType
from ..core.quantized_tensor import QuantizedTensor

__all__ = ["gemm"]

_FUSE_PATTERNS = (None, "megatron")


def check_main_grad(op: str, b: torch.Tensor, alt_dtype: torch.dtype, alt_name: Optional[str] = None,
                    name: str = "b") -> None:
    """The Megatron fused-accumulation contract (``fuse_bgrad_accum_pattern='megatron'`` with a weight
    gradient to produce): ``b.main_grad`` exists, matches ``b``'s shape and device, and is float32 or
    ``alt_dtype`` (named ``alt_name`` in the message, ``alt_dtype`` itself by default). ``name``: the
    weight operand's name in the messages."""
    mg = getattr(b, "main_grad", None)
    if not isinstance(mg, torch.Tensor):
        raise ValueError(f"{op}: fuse_bgrad_accum_pattern='megatron' needs {name}.main_grad (a tensor shaped like "
                         f"{name})")
    if mg.shape != b.shape or mg.device != b.device:
        raise ValueError(f"{op}: {name}.main_grad must match {name}, got main_grad {tuple(mg.shape)} on {mg.device}, "
                         f"{name} {tuple(b.shape)} on {b.device}")
    if mg.dtype not in (torch.float32, alt_dtype):
        raise TypeError(f"{op}: {name}.main_grad must be float32 or {alt_name or alt_dtype}, got {mg.dtype}")


def _logical(x: torch.Tensor, trans: bool) -> torch.Tensor:
    return x.t() if trans else x


def _out_shape(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool) -> tuple[int, int, int]:
    m = a.size(1) if trans_a else a.size(0)
    k = a.size(0) if trans_a else a.size(1)
    n = b.size(0) if trans_b else b.size(1)
    return m, n, k


def _gemm_eager(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``op(a) @ op(b)`` in ``out_dtype`` through the GEMM dispatcher (no autograd)."""
    m, n, k = _out_shape(a, b, trans_a, trans_b)
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=a.device)
    if k == 0:  # an empty sum: zeros, without a launch
        return torch.zeros((m, n), dtype=out_dtype, device=a.device)
    A, B = _logical(a, trans_a), _logical(b, trans_b)
    return gemm_dispatcher.dispatch(
        PrecisionType.BF16_FP16_FP32, a=A, b=B, out=None, out_dtype=out_dtype, accumulate=False
    )


gemm_impl = torch.library.custom_op("primus_turbo::gemm_impl", _gemm_eager, mutates_args=())


@gemm_impl.register_fake
def _gemm_impl_fake(a, b, trans_a, trans_b, out_dtype):
    m, n, _ = _out_shape(a, b, trans_a, trans_b)
    return a.new_empty((m, n), dtype=out_dtype)


def _gemm_accum_eager(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, c: torch.Tensor) -> None:
    """``c += op(a) @ op(b)``, the sum formed in fp32 and added in the GEMM epilogue."""
    m, n, k = _out_shape(a, b, trans_a, trans_b)
    if m == 0 or n == 0 or k == 0:  # nothing to add
        return
    A, B = _logical(a, trans_a), _logical(b, trans_b)
    gemm_dispatcher.dispatch(PrecisionType.BF16_FP16_FP32, a=A, b=B, out=c, out_dtype=c.dtype, accumulate=True)


gemm_accum_impl = torch.library.custom_op("primus_turbo::gemm_accum_impl", _gemm_accum_eager, mutates_args=("c",))


def _mm(a, b, trans_a, trans_b, out_dtype):
    # Eager calls skip the custom-op dispatcher (~10 us a call); traced code must see the op.
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.gemm_impl(a, b, trans_a, trans_b, out_dtype)
    return _gemm_eager(a, b, trans_a, trans_b, out_dtype)


def _mm_accum(a, b, trans_a, trans_b, c):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.gemm_accum_impl(a, b, trans_a, trans_b, c)
    return _gemm_accum_eager(a, b, trans_a, trans_b, c)


@gemm_accum_impl.register_fake
def _gemm_accum_impl_fake(a, b, trans_a, trans_b, c):
    return None


_dummy_wgrads: dict = {}


def _megatron_dummy_wgrad(weight: torch.Tensor) -> torch.Tensor:
    """The placeholder gradient Megatron expects once the wgrad went into ``main_grad``.

    Returning a tensor (not None) makes autograd fire the parameter's AccumulateGrad and DDP
    grad-ready hooks in order; Megatron's hook skips it because ``grad_added_to_main_grad`` is set.
    ``weight.zero_out_wgrad=True`` (Megatron's option) asks for zeros instead of an empty buffer.
    """
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    key = (tuple(weight.shape), weight.dtype, weight.device)
    buf = _dummy_wgrads.get(key)
    if buf is None:
        buf = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        _dummy_wgrads[key] = buf
    return buf


def _flag_main_grad(b: torch.Tensor) -> None:
    """Megatron's fused-accumulation contract: ``b.grad_added_to_main_grad = True`` once a forward
    whose backward adds ``b``'s gradient into ``b.main_grad`` has run (set with the forward, as
    Primus-Turbo does; Megatron's DDP clears it once per iteration). Every op sets it around its
    autograd Function, never inside its forward or backward: under torch.compile an attribute
    written on an input there is a side effect dynamo cannot keep in the Function's traced graphs
    (``fullgraph=True`` fails, and otherwise the graph breaks)."""
    b.grad_added_to_main_grad = True


class GemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, trans_a, trans_b, out_dtype, fuse_accum):
        ctx.trans_a, ctx.trans_b, ctx.fuse_accum = trans_a, trans_b, fuse_accum
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # grad_input needs B, grad_weight needs A: save only what backward uses.
        ctx.save_for_backward(a if need_b else None, b if (need_a or (need_b and fuse_accum)) else None)
        return _mm(a, b, trans_a, trans_b, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        ta, tb = ctx.trans_a, ctx.trans_b
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            g = grad_out.to(b.dtype)
            # grad_input: dA = dC @ op(B).T, stored like A ([M,K], or [K,M] = op(B) @ dC.T)
            if ta:
                grad_a = _mm(b, g, tb, True, b.dtype)
            else:
                grad_a = _mm(g, b, False, not tb, b.dtype)
        if ctx.needs_input_grad[1]:
            g = grad_out.to(a.dtype)
            # grad_weight: dB = op(A).T @ dC, stored like B ([K,N], or [N,K] = dC.T @ op(A))
            x, y, tx, ty = (g, a, True, ta) if tb else (a, g, not ta, False)
            if ctx.fuse_accum:
                _mm_accum(x, y, tx, ty, b.main_grad)
                grad_b = _megatron_dummy_wgrad(b)  # (the flag: _flag_main_grad, with the forward)
            else:
                grad_b = _mm(x, y, tx, ty, a.dtype)
        # trans_a, trans_b, out_dtype, fuse_accum are not tensors: no gradient
        return grad_a, grad_b, None, None, None, None


def _check_inputs(a, b, trans_a, trans_b, out_dtype, fuse_bgrad_accum_pattern):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gemm: {name} must be a torch.Tensor, got {type(t).__name__}")
        if isinstance(t, QuantizedTensor):
            raise TypeError(f"gemm: {name} is a QuantizedTensor; pass it to gemm_fp8, or its dequantize()")
        if t.dim() != 2:
            raise ValueError(f"gemm: {name} must be 2-D, got {name}.dim()={t.dim()} with shape {tuple(t.shape)}")
        if t.dtype not in GEMM_DTYPES:
            raise TypeError(f"gemm: {name}.dtype must be float32, float16 or bfloat16, got {t.dtype}")
    if a.dtype != b.dtype:
        raise TypeError(f"gemm: a and b must have the same dtype, got a={a.dtype}, b={b.dtype}")
    if a.device != b.device:
        raise ValueError(f"gemm: a and b must be on the same device, got a on {a.device}, b on {b.device}")
    if out_dtype is not None and out_dtype not in GEMM_DTYPES:
        raise TypeError(f"gemm: out_dtype must be float32, float16, bfloat16 or None, got {out_dtype}")
    k_a = a.size(0) if trans_a else a.size(1)
    k_b = b.size(1) if trans_b else b.size(0)
    if k_a != k_b:
        raise ValueError(
            f"gemm: K mismatch, a{tuple(a.shape)} with trans_a={trans_a} has K={k_a}, "
            f"b{tuple(b.shape)} with trans_b={trans_b} has K={k_b}"
        )
    if fuse_bgrad_accum_pattern not in _FUSE_PATTERNS:
        raise ValueError(f"gemm: fuse_bgrad_accum_pattern must be None or 'megatron', got {fuse_bgrad_accum_pattern!r}")
    if fuse_bgrad_accum_pattern == "megatron" and b.requires_grad and torch.is_grad_enabled():
        check_main_grad("gemm", b, b.dtype)


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    fuse_bgrad_accum_pattern: Optional[str] = None,
) -> torch.Tensor:
    """General matrix product ``C = op(A) @ op(B)`` with autograd.

    Args:
        a: ``[M, K]``, or ``[K, M]`` with ``trans_a=True``; float32, float16 or bfloat16; any
            strides (transposed views and sub-views are read in place, never copied).
        b: ``[K, N]``, or ``[N, K]`` with ``trans_b=True`` (an ``nn.Linear`` weight); same dtype
            and device as ``a``.
        trans_a, trans_b: layouts NN, NT, TN (and TT) as flags rather than pre-transposed tensors.
        out_dtype: dtype of ``C``; ``None`` means ``a.dtype``. Accumulation is always fp32
            (fp32 inputs are computed in full fp32, not TF32).
        fuse_bgrad_accum_pattern: ``None`` or ``"megatron"``. With ``"megatron"``, ``b`` carries
            ``b.main_grad`` (``b``'s shape, fp32 or ``b.dtype``): the grad_weight GEMM adds into it
            in its epilogue (``main_grad += dB``), ``b.grad_added_to_main_grad`` is set to True, and
            the gradient returned for ``b`` is a placeholder (Megatron's gradient-accumulation fusion).

    Returns:
        ``C`` of shape ``[M, N]`` and dtype ``out_dtype``.

    Backends: TORCH (cuBLAS; the default) and TRITON; see ``GlobalBackendManager.set_gemm_backend``
    and ``PRIMUS_TURBO_GEMM_BACKEND``. Empty problems launch nothing (K = 0 gives zeros).

    Example::

        >>> import torch, primus_turbo.pytorch as turbo
        >>> x = torch.randn(8, 64); w = torch.randn(32, 64)
        >>> turbo.ops.gemm(x, w, trans_b=True).shape
        torch.Size([8, 32])

    Under ``torch.autocast`` the operands are cast to its dtype first, as for ``torch.mm``
    (core/amp.py).
    """
    if isinstance(a, torch.Tensor) and (amp := autocast_dtype(a)) is not None:
        return gemm_under_autocast(gemm, amp, a, b, trans_a, trans_b, out_dtype,
                                   fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
    _check_inputs(a, b, trans_a, trans_b, out_dtype, fuse_bgrad_accum_pattern)
    out_dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    fuse = fuse_bgrad_accum_pattern == "megatron"
    if not fuse and out_dtype == a.dtype and all_gemms_on_torch(a, b):
        # Every one of the three GEMMs would go to cuBLAS: let PyTorch's own mm and its C++
        # autograd run them, which saves the Python autograd overhead (~50 us a step).
        return torch_autograd_mm(_logical(a, trans_a), _logical(b, trans_b))
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        out = GemmFunction.apply(a, b, bool(trans_a), bool(trans_b), out_dtype, fuse)
        if fuse and b.requires_grad:
            _flag_main_grad(b)
        return out
    return _mm(a, b, bool(trans_a), bool(trans_b), out_dtype)
