"""The reference API's import path of :class:`Float8Linear`
(``primus_turbo.pytorch.modules.linear_fp8``); the layer lives in ``linear.py``."""

from .linear import Float8Linear

__all__ = ["Float8Linear"]
