"""Gated-activation kernels: SwiGLU and GeGLU (tanh approximation), with optional per-row probs
and row mask (the MoE expert-output weighting), forward and backward.

The 2-D view is ``x[rows, 2F]`` (gate ``a = x[:, :F]``, linear half ``b = x[:, F:]``) and
``out[rows, F]``::

    out = act(a) * b * p          act = silu (SwiGLU) or gelu_tanh (GeGLU); p = probs[row] or 1
    out = 0                       on rows whose row_mask is 0

``gelu_tanh(a) = 0.5 * a * (1 + tanh(sqrt(2/pi) * (a + 0.044715 a^3)))`` (the "tanh" approximation,
``torch.nn.functional.gelu(approximate="tanh")``). Math is fp32.

One program per ``[BLOCK_R, BLOCK_F]`` tile of ``out`` (grid ``(row tiles, column tiles)``): the
forward reads the matching tiles of ``a`` and ``b`` once and writes ``out`` once; the backward reads
``dout``, ``a``, ``b`` once and writes ``da``, ``db`` once, plus (with probs) the tile's partial
``dprobs = sum_f dout * act(a) * b`` in fp32 to ``[column tiles, rows]``, reduced over dim 0 by the
op layer (deterministic, no atomics; one column tile whenever ``F <= 1024`` or a power of two up to 4096,
then it is the result).
Masked rows write exact zeros whatever ``x``/``probs`` hold (NaN included).

Vector accesses: contiguous rows, ``tl.arange`` column offsets: 16-byte accesses when ``F`` is a
multiple of 16 (Triton specializes on divisibility by 16). Offsets are int64. Blocks:
:func:`glu_config` (forward), :func:`glu_bwd_config` (backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from primus_turbo.triton import cdiv, next_pow2

__all__ = ["ACT_SILU", "ACT_GELU_TANH", "glu_config", "glu_bwd_config", "glu_fwd_launch", "glu_bwd_launch"]

ACT_SILU, ACT_GELU_TANH = 0, 1
_MAX_BLOCK_F = 4096
_TARGET_TILE = 4096  # elements of out per program: the backward holds 3 inputs + 2 outputs of it


def glu_config(rows: int, f: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_F, num_warps).

    Heuristic: a whole row when ``F <= 4096`` (BLOCK_F = next power of two), else 4096-column tiles;
    rows stacked to ~4096 output elements per program (the backward touches five tiles of that
    size, ~40 KiB of bf16 in flight). Warps: 4 up to 1024 elements, 8 up to 4096.

    At F = 2880 (GPT-OSS) the one 4096-column tile leaves 30% of the lanes idle; the forward still
    ran at ~0.99x the device copy there, the backward did not (see :func:`glu_bwd_config`).
    scripts/tune_gptoss_memory.py times the alternatives and checks their bytes.
    """
    block_f = min(next_pow2(max(f, 1)), _MAX_BLOCK_F)
    block_r = max(1, min(_TARGET_TILE // block_f, next_pow2(max(rows, 1))))
    n = block_r * block_f
    return block_r, block_f, (4 if n <= 1024 else 8)


def glu_bwd_config(rows: int, f: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_F, num_warps) of the backward: :func:`glu_config`, except where ``F > 1024``
    and 1024-column tiles leave fewer lanes idle than the power-of-two tile, e.g. GPT-OSS's
    F = 2880 (three tiles, 94% of the lanes, against one 4096 tile, 70%): one row of 1024 columns
    per program, 4 warps. H200, [65536, 2 x 2880] with probs (scripts/tune_gptoss_memory.py):
    0.51 ms (0.87x the device copy) against 0.70 ms (0.63x) for glu_config's 1 x 4096 x 8; 2 x 1024
    x 4 measured the same, 4 x 1024 x 8 0.58 ms. dprobs then sums three fp32 partials (a fixed order:
    deterministic, the same for every row count)."""
    br, bf, warps = glu_config(rows, f)
    # lanes used = f / (tiles * tile); 1024-column tiles win where they round f up by less
    if f > 1024 and -(-f // 1024) * 1024 < -(-f // bf) * bf:
        return 1, 1024, 4
    return br, bf, warps


@triton.jit
def _sigmoid(a):
    return 1.0 / (1.0 + tl.exp(-a))


@triton.jit
def _act_and_grad(a, ACT: tl.constexpr):
    """(act(a), act'(a)) in fp32."""
    if ACT == 0:
        sg = _sigmoid(a)
        return a * sg, sg * (1.0 + a * (1.0 - sg))
    else:
        K0: tl.constexpr = 0.7978845608028654  # sqrt(2 / pi)
        K1: tl.constexpr = 0.044715
        z = K0 * (a + K1 * a * a * a)
        t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)  # tanh(z), saturating cleanly at +-1
        g = 0.5 * a * (1.0 + t)
        dg = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * K0 * (1.0 + 3.0 * K1 * a * a)
        return g, dg


@triton.jit
def _glu_fwd_kernel(X, P, M, OUT, n_rows, F, stride_x, stride_o,
                    ACT: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    rmask = rows < n_rows
    m = rmask[:, None] & (cols < F)[None, :]
    xa = X + rows[:, None] * stride_x + cols[None, :]
    a = tl.load(xa, mask=m, other=0.0).to(tl.float32)
    b = tl.load(xa + F, mask=m, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(a, ACT)
    out = act * b
    if HAS_P:
        out = out * tl.load(P + rows, mask=rmask, other=0.0)[:, None]
    if HAS_M:
        keep = tl.load(M + rows, mask=rmask, other=0) != 0
        out = tl.where(keep[:, None], out, 0.0)
    tl.store(OUT + rows[:, None] * stride_o + cols[None, :], out.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _glu_bwd_kernel(DO, X, P, M, DX, DP, n_rows, F, stride_do, stride_x, stride_dx,
                    ACT: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    pid_c = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c.to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    rmask = rows < n_rows
    m = rmask[:, None] & (cols < F)[None, :]
    xa = X + rows[:, None] * stride_x + cols[None, :]
    a = tl.load(xa, mask=m, other=0.0).to(tl.float32)
    b = tl.load(xa + F, mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + rows[:, None] * stride_do + cols[None, :], mask=m, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(a, ACT)
    if HAS_P:
        dpart = tl.sum(do * act * b, axis=1)
        do = do * tl.load(P + rows, mask=rmask, other=0.0)[:, None]
    da = do * b * dact
    db = do * act
    if HAS_M:
        keep = tl.load(M + rows, mask=rmask, other=0) != 0
        da = tl.where(keep[:, None], da, 0.0)
        db = tl.where(keep[:, None], db, 0.0)
        if HAS_P:
            dpart = tl.where(keep, dpart, 0.0)
    dxa = DX + rows[:, None] * stride_dx + cols[None, :]
    tl.store(dxa, da.to(DX.dtype.element_ty), mask=m)
    tl.store(dxa + F, db.to(DX.dtype.element_ty), mask=m)
    if HAS_P:
        tl.store(DP + pid_c.to(tl.int64) * n_rows + rows, dpart, mask=rmask)


def _check_config(config) -> tuple[int, int, int]:
    br, bf, warps = (int(v) for v in config)
    if br < 1 or bf < 16 or br & (br - 1) or bf & (bf - 1) or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"config (BLOCK_R, BLOCK_F, num_warps) must be powers of two with BLOCK_F >= 16 and "
                         f"num_warps <= 16, got {tuple(config)}")
    return br, bf, warps


def glu_fwd_launch(x: torch.Tensor, act: int, probs=None, mask=None, config=None) -> torch.Tensor:
    """``x``: contiguous ``[rows, 2F]``; ``probs`` fp32 ``[rows]``; ``mask`` uint8/int ``[rows]``.
    ``config`` ``(BLOCK_R, BLOCK_F, num_warps)`` overrides :func:`glu_config` (for tuning: the
    forward is elementwise, so any tiling gives the same bytes)."""
    rows, f2 = x.shape
    f = f2 // 2
    out = torch.empty((rows, f), dtype=x.dtype, device=x.device)
    br, bf, warps = glu_config(rows, f) if config is None else _check_config(config)
    grid = (cdiv(rows, br), cdiv(f, bf))
    _glu_fwd_kernel[grid](x, probs if probs is not None else x, mask if mask is not None else x, out, rows, f,
                          x.stride(0), out.stride(0), ACT=act, HAS_P=probs is not None, HAS_M=mask is not None,
                          BLOCK_R=br, BLOCK_F=bf, num_warps=warps)
    return out


def glu_bwd_launch(dout: torch.Tensor, x: torch.Tensor, act: int, probs=None, mask=None, config=None):
    """Returns ``(dx, dprobs_partial)``; ``dprobs_partial`` is fp32 ``[column tiles, rows]`` (sum over
    dim 0) or None without probs. ``config`` ``(BLOCK_R, BLOCK_F, num_warps)`` overrides
    :func:`glu_bwd_config` (for tuning): ``dx`` is elementwise, but with probs a different column
    tiling (or a different reduction layout) may change the fp32 sum order of ``dprobs``."""
    rows, f2 = x.shape
    f = f2 // 2
    dx = torch.empty_like(x)
    br, bf, warps = glu_bwd_config(rows, f) if config is None else _check_config(config)
    grid = (cdiv(rows, br), cdiv(f, bf))
    dp = torch.empty((grid[1], rows), dtype=torch.float32, device=x.device) if probs is not None else None
    _glu_bwd_kernel[grid](dout, x, probs if probs is not None else x, mask if mask is not None else x, dx,
                          dp if dp is not None else dx, rows, f, dout.stride(0), x.stride(0), dx.stride(0),
                          ACT=act, HAS_P=probs is not None, HAS_M=mask is not None,
                          BLOCK_R=br, BLOCK_F=bf, num_warps=warps)
    return dx, dp
