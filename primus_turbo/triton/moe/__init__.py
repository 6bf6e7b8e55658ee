"""MoE token-permutation Triton kernels: row gather (permute) and weighted row merge (unpermute)."""

from __future__ import annotations

from primus_turbo.triton import triton_available

__all__: list[str] = []

if triton_available():
    from .permute_kernel import gather_rows_launch, merge_rows_launch  # noqa: F401

    __all__ += ["gather_rows_launch", "merge_rows_launch"]
