"""The Triton CPU interpreter (``TRITON_INTERPRET=1``) and its one known wrong result we care about.

The interpreter's bf16 ``tl.dot`` multiplies the raw 16-bit patterns instead of the values
(triton issue #11584), so every bf16 GEMM it runs is garbage. ``fix_bf16_dot()`` is an explicit,
opt-in repair (the test suite and the CPU demo call it; importing primus_turbo never patches
triton): bf16 dot operands are widened to fp32 first, which is exact. Until it is called, our
TRITON backends refuse bf16 under the interpreter instead of returning wrong numbers.
"""

from __future__ import annotations

__all__ = ["fix_bf16_dot", "bf16_dot_fixed"]

_MARK = "_primus_turbo_bf16_dot_fixed"


def bf16_dot_fixed() -> bool:
    """Whether ``fix_bf16_dot()`` has been applied in this process."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    return bool(getattr(interpreter.InterpreterBuilder, _MARK, False))


def fix_bf16_dot() -> None:
    """Make the interpreter's bf16 ``tl.dot`` compute on values (idempotent)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, _MARK, False):
        return
    original = builder.create_dot

    def _as_fp32(handle):
        # bf16 lives in the interpreter as raw uint16 bits; a bf16 is the top half of an fp32.
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = _as_fp32(a)
        if b.dtype == tl.bfloat16:
            b = _as_fp32(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    setattr(builder, _MARK, True)
