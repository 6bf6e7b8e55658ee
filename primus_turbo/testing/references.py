"""Plain-PyTorch float64 references for the ops under test.

These are written for clarity, not speed: every input is upcast to float64, the math is the
textbook definition, and results come back in float64 so callers decide how to compare them
(usually with :func:`primus_turbo.testing.numerics.snr_db`).

GEMM convention (the same as ``turbo.ops.gemm``)::

    op(X) = X.T if trans_X else X
    C     = op(A) @ op(B)            op(A): [M, K], op(B): [K, N], C: [M, N]

so ``A`` is stored ``[M, K]`` (or ``[K, M]`` with ``trans_a``) and ``B`` is stored ``[K, N]``
(or ``[N, K]`` with ``trans_b``, the layout of an ``nn.Linear`` weight).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["gemm_ref", "gemm_backward_ref", "grouped_gemm_ref", "grouped_gemm_variable_k_ref"]


def _op(x: torch.Tensor, trans: bool) -> torch.Tensor:
    return x.transpose(-2, -1) if trans else x


def _check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")


def gemm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``op(a) @ op(b)`` computed in float64.

    Shapes: ``a`` is ``[M, K]`` (``[K, M]`` if ``trans_a``), ``b`` is ``[K, N]`` (``[N, K]`` if
    ``trans_b``); the result is ``[M, N]``, float64 unless ``out_dtype`` is given (then the
    float64 result is rounded once to ``out_dtype``).
    """
    _check_2d("a", a)
    _check_2d("b", b)
    a64 = _op(a.detach().to(torch.float64), trans_a)
    b64 = _op(b.detach().to(device=a.device, dtype=torch.float64), trans_b)
    if a64.shape[1] != b64.shape[0]:
        raise ValueError(
            f"inner dimensions differ: op(a) is {tuple(a64.shape)}, op(b) is {tuple(b64.shape)} "
            f"(trans_a={trans_a}, trans_b={trans_b})"
        )
    c = a64 @ b64
    return c if out_dtype is None else c.to(out_dtype)


def gemm_backward_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    grad_out: torch.Tensor,
    trans_a: bool = False,
    trans_b: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``C = op(a) @ op(b)`` given ``dC = grad_out``, in float64.

    With ``op(a)``: ``[M, K]``, ``op(b)``: ``[K, N]`` and ``grad_out``: ``[M, N]``::

        d op(a) = dC @ op(b).T        [M, K]
        d op(b) = op(a).T @ dC        [K, N]

    and each is transposed back when its operand was stored transposed, so ``grad_a`` has
    ``a.shape`` and ``grad_b`` has ``b.shape``.
    """
    _check_2d("a", a)
    _check_2d("b", b)
    _check_2d("grad_out", grad_out)
    a64 = _op(a.detach().to(torch.float64), trans_a)
    b64 = _op(b.detach().to(device=a.device, dtype=torch.float64), trans_b)
    g64 = grad_out.detach().to(device=a.device, dtype=torch.float64)
    m, k = a64.shape
    k2, n = b64.shape
    if k != k2 or tuple(g64.shape) != (m, n):
        raise ValueError(
            f"shape mismatch: op(a) {tuple(a64.shape)}, op(b) {tuple(b64.shape)}, "
            f"grad_out {tuple(g64.shape)} (expected ({m}, {n}))"
        )
    grad_op_a = g64 @ b64.T  # [M, K]
    grad_op_b = a64.T @ g64  # [K, N]
    grad_a = _op(grad_op_a, trans_a)
    grad_b = _op(grad_op_b, trans_b)
    return grad_a.contiguous(), grad_b.contiguous()


def _group_bounds(group_lens: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """[(start, end)] of each group's rows (host-side: a reference may synchronise)."""
    lens = [int(v) for v in group_lens.detach().cpu().tolist()]
    if any(v < 0 for v in lens) or sum(lens) > rows:
        raise ValueError(f"group_lens {lens} must be non-negative and sum to at most {rows}")
    bounds, start = [], 0
    for n in lens:
        bounds.append((start, start + n))
        start += n
    return bounds


def grouped_gemm_ref(
    a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor, trans_b: bool = False
) -> torch.Tensor:
    """MoE grouped GEMM in float64: ``out[rows of g] = a[rows of g] @ op(b[g])``.

    ``a``: ``[M_total, K]``; ``b``: ``[G, K, N]`` (``[G, N, K]`` if ``trans_b``); ``group_lens``:
    ``[G]`` rows per group, taken in order from row 0. Rows past ``sum(group_lens)`` are zero.
    Returns ``[M_total, N]`` float64.
    """
    _check_2d("a", a)
    if b.dim() != 3 or b.size(0) != group_lens.numel():
        raise ValueError(f"b must be [G, ., .] with G={group_lens.numel()}, got shape {tuple(b.shape)}")
    a64 = a.detach().to(torch.float64)
    b64 = _op(b.detach().to(device=a.device, dtype=torch.float64), trans_b)
    if b64.size(1) != a64.size(1):
        raise ValueError(f"K mismatch: a {tuple(a.shape)}, b {tuple(b.shape)} (trans_b={trans_b})")
    out = torch.zeros((a64.size(0), b64.size(2)), dtype=torch.float64, device=a.device)
    for g, (s, e) in enumerate(_group_bounds(group_lens, a64.size(0))):
        out[s:e] = a64[s:e] @ b64[g]
    return out


def grouped_gemm_variable_k_ref(
    x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor
) -> torch.Tensor:
    """Variable-K grouped GEMM in float64 (an MoE weight gradient): ``out[g] = x_g.T @ y_g``.

    ``x``: ``[M_total, P]``, ``y``: ``[M_total, Q]``; ``x_g``/``y_g`` are group ``g``'s rows. An
    empty group gives zeros. Returns ``[G, P, Q]`` float64. (For ``C = grouped_gemm(a, b)``:
    ``dB = grouped_gemm_variable_k_ref(a, dC)``, or ``(dC, a)`` with ``trans_b``.)
    """
    _check_2d("x", x)
    _check_2d("y", y)
    if x.size(0) != y.size(0):
        raise ValueError(f"x and y must have the same rows, got {tuple(x.shape)} and {tuple(y.shape)}")
    x64 = x.detach().to(torch.float64)
    y64 = y.detach().to(device=x.device, dtype=torch.float64)
    out = torch.zeros((group_lens.numel(), x64.size(1), y64.size(1)), dtype=torch.float64, device=x.device)
    for g, (s, e) in enumerate(_group_bounds(group_lens, x64.size(0))):
        out[g] = x64[s:e].T @ y64[s:e]
    return out
