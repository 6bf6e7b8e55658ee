"""Error metrics for comparing an op's output with a high-precision reference.

All metrics are computed in float64 on the reference's device, whatever the input dtypes, so a
bf16 output is judged against an fp64 reference without the comparison itself adding error.

The main metric is the signal-to-noise ratio in decibels::

    snr_db(ref, out) = 10 * log10( ||ref||^2 / ||ref - out||^2 )

It is scale-free (a 1e-3 relative perturbation is 60 dB whatever the magnitude of ``ref``) and
summarises the whole tensor in one number, which suits low-precision formats whose element-wise
error varies widely. A NaN or inf anywhere in ``out`` gives ``-inf`` so every threshold fails.
"""

from __future__ import annotations

import contextlib
import math

import torch

__all__ = [
    "poisoned_allocations",
    "SNR_THRESHOLDS",
    "snr_db",
    "rel_err",
    "max_abs_err",
    "assert_snr",
    "poison_",
]

#: Minimum SNR (dB) an output must reach against an fp64 reference, by kind of op / precision.
#: bf16/fp16/fp32 GEMM thresholds assume the reference is computed from the *same* (already
#: rounded) inputs, so the only error is accumulation order and the final output rounding.
SNR_THRESHOLDS: dict[str, float] = {
    "bf16_gemm": 45.0,
    "fp16_gemm": 50.0,
    "fp32_gemm": 80.0,  # ieee fp32 (no TF32): our own kernels must not silently use TF32
    "attention": 40.0,
    "fp8_e4m3": 25.0,
    "fp8_e5m2": 20.0,
    "fp8_hybrid": 20.0,  # E4M3 forward, E5M2 gradients: bounded by the E5M2 side
    "mxfp4": 10.0,
    "grouped_mxfp4": 8.0,
}


def _pair_f64(ref: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(ref, torch.Tensor) or not isinstance(out, torch.Tensor):
        raise TypeError(f"expected tensors, got {type(ref).__name__} and {type(out).__name__}")
    if ref.shape != out.shape:
        raise ValueError(f"shape mismatch: ref {tuple(ref.shape)} vs out {tuple(out.shape)}")
    ref64 = ref.detach().to(torch.float64)
    out64 = out.detach().to(device=ref64.device, dtype=torch.float64)
    if not bool(torch.isfinite(ref64).all()):
        raise ValueError("the reference contains NaN or inf; fix the reference, not the threshold")
    return ref64, out64


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def snr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``out`` against ``ref`` in dB, computed in float64.

    Returns ``+inf`` when ``out`` equals ``ref`` exactly and ``-inf`` when ``out`` holds a NaN or
    inf (or when ``ref`` is all zeros and ``out`` is not). Shapes must match.
    """
    ref64, out64 = _pair_f64(ref, out)
    if not _finite(out64):
        return float("-inf")
    noise = float(torch.sum((ref64 - out64) ** 2))
    signal = float(torch.sum(ref64 * ref64))
    if noise == 0.0:
        return float("inf")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * math.log10(signal / noise)


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Relative Frobenius error ``||out - ref|| / ||ref||`` in float64.

    ``0.0`` when equal; ``inf`` when ``out`` is non-finite or ``ref`` is zero and ``out`` is not.
    """
    ref64, out64 = _pair_f64(ref, out)
    if not _finite(out64):
        return float("inf")
    diff = float(torch.linalg.vector_norm(out64 - ref64))
    if diff == 0.0:
        return 0.0
    norm = float(torch.linalg.vector_norm(ref64))
    if norm == 0.0:
        return float("inf")
    return diff / norm


def max_abs_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Largest element-wise ``|out - ref|`` in float64; ``inf`` when ``out`` is non-finite."""
    ref64, out64 = _pair_f64(ref, out)
    if ref64.numel() == 0:
        return 0.0
    if not _finite(out64):
        return float("inf")
    return float((out64 - ref64).abs().max())


def assert_snr(ref: torch.Tensor, out: torch.Tensor, min_db: float, name: str = "out") -> float:
    """Raise ``AssertionError`` (with the measured values) unless ``snr_db(ref, out) >= min_db``.

    Returns the measured SNR so callers can log it.
    """
    snr = snr_db(ref, out)
    if not snr >= min_db:  # written so a NaN SNR would fail too
        n_bad = int((~torch.isfinite(out.detach())).sum()) if out.is_floating_point() else 0
        detail = f"; {n_bad} non-finite element(s)" if n_bad else f"; rel_err {rel_err(ref, out):.3e}"
        raise AssertionError(
            f"{name}: SNR {snr:.2f} dB is below the required {min_db:.2f} dB "
            f"(shape {tuple(out.shape)}, dtype {out.dtype}{detail})"
        )
    return snr


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a floating-point tensor with NaN in place and return it.

    Use on output buffers before a kernel writes them: any element the kernel forgets to write
    stays NaN and fails every SNR check.
    """
    if not t.is_floating_point():
        raise TypeError(f"poison_ needs a floating-point tensor, got {t.dtype}")
    with torch.no_grad():
        t.fill_(float("nan"))
    return t


@contextlib.contextmanager
def poisoned_allocations(monkeypatch):
    """Within the block, every floating tensor (2+ bytes per element) allocated through
    ``torch.empty`` / ``torch.empty_like`` starts as NaN: an element a kernel forgets to write
    fails the SNR checks. For ops that allocate their own outputs; ``monkeypatch`` is pytest's."""
    empty, empty_like = torch.empty, torch.empty_like

    def _poison(t):
        if t.is_floating_point() and t.dtype.itemsize > 1:
            t.fill_(float("nan"))
        return t

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *a, **kw: _poison(empty(*a, **kw)))
        m.setattr(torch, "empty_like", lambda *a, **kw: _poison(empty_like(*a, **kw)))
        yield
