"""Public functional API: ``turbo.ops.<op>``. Each op validates, dispatches and wires autograd."""

from .gemm import gemm

__all__ = ["gemm"]
