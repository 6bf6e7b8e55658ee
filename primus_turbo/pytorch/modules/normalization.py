"""RMSNorm layer over ``turbo.ops.rmsnorm``."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from ..ops.normalization import rmsnorm

__all__ = ["RMSNorm"]

_DEFAULT_EPS = 1e-6


def _hidden_of(normalized_shape) -> int:
    """The one normalized dim of ``normalized_shape`` (an int or a one-entry sequence)."""
    if isinstance(normalized_shape, int):
        shape = (normalized_shape,)
    elif isinstance(normalized_shape, (tuple, list, torch.Size)):
        shape = tuple(normalized_shape)
    else:
        raise ValueError(f"RMSNorm: normalized_shape must be one int (the last dim), got {normalized_shape!r}")
    if len(shape) != 1 or isinstance(shape[0], bool) or not isinstance(shape[0], int):
        raise ValueError(f"RMSNorm: normalized_shape must be one int (the last dim; the norm is over one "
                         f"dim only), got {normalized_shape!r}")
    if shape[0] <= 0:
        raise ValueError(f"RMSNorm: normalized_shape must be positive, got {shape[0]}")
    return shape[0]


class RMSNorm(torch.nn.Module):
    """``y = x / sqrt(mean(x^2, -1) + eps) * w`` over the last dim.

    The constructor is the reference API's (and, but for ``zero_centered_gamma``, ``torch.nn.RMSNorm``'s):
    ``RMSNorm(normalized_shape, eps=None, elementwise_affine=True, zero_centered_gamma=False,
    device=None, dtype=None)``.

    Args:
        normalized_shape: the last dim's size, an int or a one-entry sequence (the norm runs over
            one dim).
        eps: added to the mean square; None means 1e-6.
        elementwise_affine: learn a gain ``weight`` ``[hidden]``; False: ``w = 1`` and ``weight`` is
            None (no parameter).
        zero_centered_gamma: ``w = 1 + weight`` (``weight`` stored centred on zero, initialised to
            zeros: Megatron's ``apply_layernorm_1p`` convention); else ``w = weight`` (initialised
            to ones). Needs ``elementwise_affine``.
        device, dtype: of ``weight``; fp32 ``weight`` works with bf16 / fp16 inputs.
        hidden, zero_centered: earlier names of ``normalized_shape`` / ``zero_centered_gamma``,
            keyword only (giving both names of one argument raises).
    """

    def __init__(self, normalized_shape: Union[int, Sequence[int], None] = None, eps: Optional[float] = None,
                 elementwise_affine: bool = True, zero_centered_gamma: bool = False, device=None, dtype=None, *,
                 hidden: Optional[int] = None, zero_centered: Optional[bool] = None):
        super().__init__()
        if hidden is not None:
            if normalized_shape is not None:
                raise ValueError(f"RMSNorm: give normalized_shape or hidden, not both (got {normalized_shape!r} "
                                 f"and {hidden!r})")
            normalized_shape = hidden
        if normalized_shape is None:
            raise TypeError("RMSNorm: normalized_shape (the last dim's size) is required")
        if zero_centered is not None:
            if zero_centered_gamma:
                raise ValueError("RMSNorm: give zero_centered_gamma or zero_centered, not both")
            zero_centered_gamma = zero_centered
        self.hidden = _hidden_of(normalized_shape)
        self.normalized_shape = (self.hidden,)
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))):
            raise ValueError(f"RMSNorm: eps must be a float >= 0 or None, got {eps!r}")
        self.eps = _DEFAULT_EPS if eps is None else float(eps)
        if not 0 <= self.eps < math.inf:
            raise ValueError(f"RMSNorm: eps must be >= 0, got {eps!r} (a finite float)")
        self.elementwise_affine = bool(elementwise_affine)
        self.zero_centered = self.zero_centered_gamma = bool(zero_centered_gamma)
        if self.zero_centered and not self.elementwise_affine:
            raise ValueError("RMSNorm: zero_centered_gamma=True needs elementwise_affine=True (it is how the "
                             "learned weight is stored)")
        if self.elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.hidden, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            # w = 1, as a buffer so that it follows the module's device (fp32: any input dtype takes it)
            self.register_buffer("_unit_gain", torch.ones(self.hidden, device=device, dtype=torch.float32),
                                 persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(0.0 if self.zero_centered else 1.0)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"zero_centered_gamma={self.zero_centered}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"RMSNorm: input must be a torch.Tensor, got {type(x).__name__}")
        if x.shape[-1:] != (self.hidden,):
            raise ValueError(f"RMSNorm: input's last dim must be {self.hidden}, got shape {tuple(x.shape)}")
        gain = self.weight if self.weight is not None else self._unit_gain
        return rmsnorm(x, gain, self.eps, self.zero_centered)
