"""Triton kernels of primus-turbo (imported lazily by the op layer).

Helpers here are deliberately light: importing this package does not import triton.
"""

from __future__ import annotations

import functools
import os

__all__ = ["cdiv", "is_interpreter", "next_pow2", "triton_available"]


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for host integers. ``triton.cdiv`` is a constexpr-function object in Triton
    3.6 whose call costs ~2 us of Python: launchers compute grids with these on every call."""
    return (x + y - 1) // y


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for ``n <= 0``), as ``triton.next_power_of_2`` for
    host integers, without its per-call wrapper cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


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
