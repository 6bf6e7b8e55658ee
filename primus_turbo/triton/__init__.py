"""Triton kernels of primus-turbo (imported lazily by the op layer).

Helpers here are deliberately light: importing this package does not import triton.
"""

from __future__ import annotations

import functools
import os

__all__ = ["is_interpreter", "triton_available"]


def is_interpreter() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when ``import triton`` succeeds (cached: the answer cannot change within a process)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True
