"""RMSNorm layer over ``turbo.ops.rmsnorm``."""

from __future__ import annotations

import torch

from ..ops.normalization import rmsnorm

__all__ = ["RMSNorm"]


class RMSNorm(torch.nn.Module):
    """``y = x / sqrt(mean(x^2, -1) + eps) * w`` over the last dim (size ``hidden``).

    ``weight`` ``[hidden]`` is the learned gain: ``w = weight`` (initialised to ones), or with
    ``zero_centered=True`` ``w = 1 + weight`` (stored centred on zero, initialised to zeros; the
    Megatron ``apply_layernorm_1p`` convention). ``weight`` may be fp32 with bf16/fp16 inputs.
    """

    def __init__(self, hidden: int, eps: float = 1e-6, zero_centered: bool = False, device=None, dtype=None):
        super().__init__()
        if hidden <= 0:
            raise ValueError(f"RMSNorm: hidden must be positive, got {hidden}")
        self.hidden, self.eps, self.zero_centered = int(hidden), float(eps), bool(zero_centered)
        self.weight = torch.nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered else 1.0)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, zero_centered={self.zero_centered}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != (self.hidden,):
            raise ValueError(f"RMSNorm: input's last dim must be {self.hidden}, got shape {tuple(x.shape)}")
        return rmsnorm(x, self.weight, self.eps, self.zero_centered)
