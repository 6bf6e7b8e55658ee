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

__all__ = [
    "gemm_ref",
    "gemm_backward_ref",
    "grouped_gemm_ref",
    "grouped_gemm_variable_k_ref",
    "attention_ref",
    "attention_mask_ref",
    "rmsnorm_ref",
    "swiglu_ref",
    "swiglu_with_probs_ref",
    "geglu_with_probs_ref",
]


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


def attention_mask_ref(
    seq_q: int, seq_kv: int, causal: bool = False, window_size: tuple[int, int] = (-1, -1), device=None
) -> torch.Tensor:
    """``[seq_q, seq_kv]`` bool mask, True where query ``i`` may attend key ``j``.

    Flash-attention's convention: bottom-right aligned (``off = seq_kv - seq_q``); ``j <= i + off +
    right`` when ``right >= 0`` and ``j >= i + off - left`` when ``left >= 0``; ``-1`` is unbounded and
    ``causal`` sets ``right = 0``.
    """
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seq_q, device=device).view(-1, 1)
    j = torch.arange(seq_kv, device=device).view(1, -1)
    off = seq_kv - seq_q
    mask = torch.ones((seq_q, seq_kv), dtype=torch.bool, device=device)
    if right >= 0:
        mask &= j <= i + off + right
    if left >= 0:
        mask &= j >= i + off - left
    return mask


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
):
    """Softmax attention written out with plain torch ops, in ``compute_dtype`` (float64 by default).

    ``q``: ``[B, Sq, Hq, Dqk]``, ``k``: ``[B, Sk, Hk, Dqk]``, ``v``: ``[B, Sk, Hk, Dv]`` with
    ``Hq % Hk == 0`` (query head ``h`` reads kv head ``h // (Hq // Hk)``); mask as in
    :func:`attention_mask_ref`; ``sink``: ``[Hq]`` logits that join each row's softmax denominator
    only. Differentiable (autograd flows to the inputs through the upcast). Returns ``out``
    ``[B, Sq, Hq, Dv]`` and, with ``return_lse``, ``lse`` ``[B, Hq, Sq]`` (natural log, including the
    sink). A row that sees no key and has no sink gets ``out = 0`` and ``lse = +inf``.
    Pass ``compute_dtype=q.dtype`` to get the same math in low precision (PyTorch's own error).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, S, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, sq, hq, dqk = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if hq % hk != 0:
        raise ValueError(f"heads_q={hq} must be a multiple of heads_kv={hk}")
    scale = softmax_scale if softmax_scale is not None else dqk ** -0.5
    qf = q.to(compute_dtype)
    kf = k.to(device=q.device, dtype=compute_dtype).repeat_interleave(hq // hk, dim=2)
    vf = v.to(device=q.device, dtype=compute_dtype).repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    mask = attention_mask_ref(sq, sk, causal, window_size, device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    if sink is not None:
        col = sink.to(device=q.device, dtype=compute_dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)
        lse = torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe.unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    if not return_lse:
        return out
    return out, torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse)


def rmsnorm_ref(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, zero_centered: bool = False) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * w`` in float64, ``w = 1 + gamma`` when ``zero_centered``.

    Differentiable (use ``requires_grad`` float64 copies for reference gradients). For the residual
    variant pass the (rounded) sum ``x + residual`` as ``x``.
    """
    x64, g64 = x.to(torch.float64), gamma.to(device=x.device, dtype=torch.float64)
    w = g64 + 1.0 if zero_centered else g64
    return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w


def _glu_ref(x: torch.Tensor, act, probs: Optional[torch.Tensor], row_mask: Optional[torch.Tensor]) -> torch.Tensor:
    x64 = x.to(torch.float64)
    f = x64.shape[-1] // 2
    out = act(x64[..., :f]) * x64[..., f:]
    if probs is not None:
        out = out * probs.to(device=x.device, dtype=torch.float64)[:, None]
    if row_mask is not None:
        out = torch.where(row_mask.to(x.device)[:, None] != 0, out, torch.zeros((), dtype=torch.float64, device=x.device))
    return out


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]`` in float64 (differentiable)."""
    return _glu_ref(x, torch.nn.functional.silu, None, None)


def swiglu_with_probs_ref(x: torch.Tensor, probs: torch.Tensor, row_mask: Optional[torch.Tensor] = None
                          ) -> torch.Tensor:
    """``silu(a) * b * probs[:, None]`` in float64, 0 on rows whose ``row_mask`` is 0."""
    return _glu_ref(x, torch.nn.functional.silu, probs, row_mask)


def geglu_with_probs_ref(x: torch.Tensor, probs: torch.Tensor, row_mask: Optional[torch.Tensor] = None
                         ) -> torch.Tensor:
    """``gelu_tanh(a) * b * probs[:, None]`` in float64 (GELU's tanh approximation), 0 on masked rows."""
    return _glu_ref(x, lambda a: torch.nn.functional.gelu(a, approximate="tanh"), probs, row_mask)
