"""``torch.autocast`` for the library's ops, with PyTorch's own rules.

Autocast only rewrites the ATen ops it lists, so a custom op or an autograd Function sees its inputs
as they come. A model whose parameters stay fp32 under ``torch.autocast`` would otherwise run our
GEMMs and attention in fp32. That is the precise path, not the fast one. TorchTitan enables
autocast whenever the parameters are not sharded by FSDP.

So the public ops ask here first:

* GEMM-class ops (``gemm``, ``grouped_gemm``, ``grouped_gemm_glu``, the attention functions) cast
  their floating inputs to the autocast dtype, except float64 (autocast's ``lower_precision_fp``
  rule, as for ``mm`` / ``scaled_dot_product_attention``).
* The FP8 / FP4 GEMMs cast their high-precision inputs the same way (``QuantizedTensor`` s are
  left alone), so they quantize the autocast-dtype values and write that dtype by default, and
  take an fp32 weight with bf16 activations, as their one-dtype rule otherwise refuses.
* Every op runs its body with autocast off. The ATen ops inside (fp32 matmuls of the routers,
  reference paths, ``torch._grouped_mm`` / ``torch._scaled_mm``) then keep the dtypes the op chose.

Gradients flow back through the casts, so fp32 parameters get fp32 gradients, as under autocast
with ``nn.Linear``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["autocast_dtype", "cast_inputs", "autocast_off", "refuse_fused_cast", "gemm_under_autocast"]


def autocast_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` runs GEMM-class ops in on ``t``'s device type, or None when
    autocast is off there (the common case: one C call)."""
    dev = t.device.type
    if dev != "cuda" and dev != "cpu":  # (the library's devices; autocast has no state for "meta")
        return None
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def _castable(t, dtype: torch.dtype) -> bool:
    """Autocast casts ``t``: a floating tensor, not float64, not already ``dtype``; not a
    ``QuantizedTensor``, whose ``.to`` would dequantize it."""
    from .quantized_tensor import QuantizedTensor  # (core siblings: imported on use)

    return (isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor) and t.is_floating_point()
            and t.dtype not in (dtype, torch.float64))


def cast_inputs(dtype: torch.dtype, *tensors):
    """Autocast's cast of each of ``tensors`` (see :func:`_castable`; the rest as they are)."""
    return tuple(t.to(dtype) if _castable(t, dtype) else t for t in tensors)


def autocast_off(t: torch.Tensor):
    """A context with autocast disabled on ``t``'s device type (the op's body then runs as called)."""
    return torch.autocast(t.device.type, enabled=False)


def refuse_fused_cast(op: str, b, dtype: torch.dtype, fuse_bgrad_accum_pattern) -> None:
    """Megatron's fused form accumulates into ``b.main_grad`` through ``b`` itself. Autocast would hand
    the op a cast copy of a weight in another dtype, a copy without ``main_grad``. Raise rather
    than accumulate into the wrong place."""
    if fuse_bgrad_accum_pattern is not None and _castable(b, dtype):
        raise ValueError(
            f"{op}: fuse_bgrad_accum_pattern={fuse_bgrad_accum_pattern!r} under torch.autocast({dtype}) with a "
            f"{b.dtype} weight: autocast would cast the weight to a copy without main_grad; keep the weight in "
            f"{dtype} (Megatron's form) or run without autocast")


def gemm_under_autocast(fn, dtype: torch.dtype, a, b, *rest, fuse_bgrad_accum_pattern=None):
    """A GEMM op ``fn(a, b, *rest, fuse_bgrad_accum_pattern=...)`` called again under autocast: ``a``
    and ``b`` cast to ``dtype``, the body with autocast off, Megatron's fused form refused where ``b``
    would be cast (each GEMM op's entry under autocast)."""
    refuse_fused_cast(fn.__name__, b, dtype, fuse_bgrad_accum_pattern)
    a, b = cast_inputs(dtype, a, b)
    with autocast_off(a):
        return fn(a, b, *rest, fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
