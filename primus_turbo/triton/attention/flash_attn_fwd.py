"""FlashAttention-2 style forward in Triton.

Tensors are *logical* ``[batch, seq, heads, head_dim]`` with arbitrary strides (bshd, sbhd or bhsd
storage are all just stride patterns here, nothing is copied). One program owns ``BLOCK_M`` query
rows of one (batch, query head) and streams the key/value blocks its rows can see, keeping the
running row maximum ``m``, the running denominator ``l`` and the fp32 output accumulator
(online softmax, computed in base 2: ``exp(x) = exp2(x * log2(e))``).

Masking, with ``off = seq_k - seq_q`` (bottom-right alignment, as flash-attention does): query
row ``i`` sees key ``j`` iff ``j <= i + off + right`` (when ``right >= 0``) and
``j >= i + off - left`` (when ``left >= 0``); causal is ``right = 0``. Only the key blocks that can
hold a visible key are visited.

Sink: a per-head logit ``s_h`` that joins the softmax denominator only. It is folded in by
starting the online softmax at ``m = s_h, l = 1`` (one term ``exp(s_h - m)``) with no value row.

Outputs: ``O`` in the input dtype and ``LSE`` (natural log, fp32, ``[batch, heads_q, seq_q]``).
A row that sees no key and has no sink gets ``O = 0`` and ``LSE = +inf`` (so the backward's
``P = exp(S - LSE)`` is 0 there).

Varlen (``IS_VARLEN``, packed THD ``[total, heads, dim]`` tensors): program ``b`` reads its sequence's
row range from the int32 ``cu_seqlens`` on the device (never on the host), uses that sequence's
lengths for masks and bottom-right alignment, and exits at once when its query (backward: key)
block starts past the sequence's end; the grid is sized by the caller's ``max_seqlen``. The LSE is
``[heads_q, total_q]``. The same kernels serve both layouts (the batch stride is 0 for varlen).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, next_pow2, is_interpreter
from primus_turbo.triton.interpreter import bf16_dot_fixed

__all__ = ["check_flash_attn_triton", "flash_attn_fwd_triton", "flash_attn_varlen_fwd_triton", "attn_block_dims",
           "mma_min_block", "LOG2E"]

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@triton.jit
def _kv_range(m_start, offset, win_left, win_right, SEQ_K,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of the key blocks that rows m_start..m_start+BLOCK_M-1 can see (lo a BLOCK_N multiple)."""
    lo = m_start * 0
    hi = m_start * 0 + SEQ_K
    if HAS_LEFT:
        lo = tl.maximum(m_start + offset - win_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m_start + BLOCK_M + offset + win_right, SEQ_K)
    return lo, hi


@triton.jit
def _visible(offs_m, offs_n, SEQ_Q, SEQ_K, offset, win_left, win_right,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[len(offs_m), len(offs_n)] mask of the (query, key) pairs that take part in the softmax."""
    ok = (offs_m[:, None] < SEQ_Q) & (offs_n[None, :] < SEQ_K)
    if HAS_LEFT:
        ok = ok & (offs_n[None, :] >= offs_m[:, None] + offset - win_left)
    if HAS_RIGHT:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + offset + win_right)
    return ok


@triton.jit
def _unmasked_kv_blocks(m_start, lo, hi, offset, win_left, win_right, SEQ_K,
                        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """Split the key blocks ``[lo, hi)`` of query rows ``m_start..m_start+BLOCK_M-1`` into
    ``[lo, a)`` masked, ``[a, b)`` fully visible and in bounds (no mask work at all), ``[b, hi)``
    masked. Interior blocks are most of the work; skipping their mask arithmetic and load masks is
    what lets the loop run at MMA speed. ``a`` and ``b`` are multiples of BLOCK_N, ``lo <= a <= b <= hi``."""
    a = lo
    if HAS_LEFT:  # key n0 visible to the block's last row: n0 >= m_start + BLOCK_M - 1 + offset - left
        first = tl.maximum(m_start + BLOCK_M - 1 + offset - win_left, 0)
        a = tl.maximum(lo, (first + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    b = (SEQ_K // BLOCK_N) * BLOCK_N  # whole key blocks only
    if HAS_RIGHT:  # last key of the block visible to the first row: n0 + BLOCK_N - 1 <= m_start + offset + right
        b = tl.minimum(b, tl.maximum(m_start + offset + win_right + 1, 0) // BLOCK_N * BLOCK_N)
    a = tl.minimum(a, hi)
    b = tl.minimum(tl.maximum(b, a), hi)
    return a, b


@triton.jit
def _running_max(m_i, s, ok, scale, MASKED: tl.constexpr, NEG_SCALE: tl.constexpr):
    """``(m_new, m_safe)``: the running row maximum of the scaled scores ``s * scale`` (``scale`` a
    scalar or one per row, of one sign: ``NEG_SCALE``), taken on the raw scores (the max, or the
    min for a negative scale) and scaled once per row, so the caller's exponent ``s * scale - m``
    is one FMA per score. ``MASKED``: only the ``ok`` pairs count; a row with none keeps ``m_i``
    (its block value is -inf, never inf * scale, which is NaN at scale 0). ``m_safe`` is ``m_new``
    with -inf replaced by 0 for the exponent."""
    if MASKED:
        if NEG_SCALE:
            ext = tl.min(tl.where(ok, s, float("inf")), 1)
            seen = ext != float("inf")
        else:
            ext = tl.max(tl.where(ok, s, float("-inf")), 1)
            seen = ext != float("-inf")
        m_new = tl.maximum(m_i, tl.where(seen, ext * scale, float("-inf")))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        if NEG_SCALE:
            m_new = tl.maximum(m_i, tl.min(s, 1) * scale)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_safe = m_new
    return m_new, m_safe


@triton.jit
def _attn_fwd_step(acc, m_i, l_i, q, k_base, v_base, start_n, offs_m, offs_n0, offs_dqk, offs_dv,
                   stride_ks, stride_kd, stride_vs, stride_vd, seq_q, seq_k, off, win_left, win_right,
                   qk_scale, D_QK, D_V, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   MASKED: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   NEG_SCALE: tl.constexpr):
    """One key block of the online softmax. ``MASKED=False``: the block is whole and every
    (row, key) pair is visible, so no load mask and no score mask."""
    offs_n = start_n + offs_n0
    kt_ptrs = k_base + offs_n[None, :] * stride_ks + offs_dqk[:, None] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd
    if MASKED:
        kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < seq_k) & (offs_dqk[:, None] < D_QK), other=0.0)
    elif EVEN_D:
        kt = tl.load(kt_ptrs)
    else:
        kt = tl.load(kt_ptrs, mask=offs_dqk[:, None] < D_QK, other=0.0)
    # raw scores: the row extreme is taken before scaling, so the scale folds into one FMA per score
    s = tl.dot(q, kt, input_precision=DOT_PRECISION)
    if MASKED:
        ok = _visible(offs_m, offs_n, seq_q, seq_k, off, win_left, win_right, HAS_LEFT, HAS_RIGHT)
        m_new, m_safe = _running_max(m_i, s, ok, qk_scale, True, NEG_SCALE)
        p = tl.where(ok, tl.exp2(s * qk_scale - m_safe[:, None]), 0.0)
    else:  # every score is finite, so the new maximum is too
        m_new, m_safe = _running_max(m_i, s, s, qk_scale, False, NEG_SCALE)
        p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=(offs_n[:, None] < seq_k) & (offs_dv[None, :] < D_V), other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < D_V, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, SINK, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lh,
    H, SEQ_Q, SEQ_K, GROUP, D_QK, D_V,
    qk_scale, offset, win_left, win_right,
    HAS_SINK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, NEG_SCALE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP

    if IS_VARLEN:  # packed THD: sequence b is rows cu[b]..cu[b+1]-1; SEQ_Q / SEQ_K are the max lengths
        q_start = tl.load(CU_Q + b)
        k_start = tl.load(CU_K + b)
        seq_q = tl.load(CU_Q + b + 1) - q_start
        seq_k = tl.load(CU_K + b + 1) - k_start
        off = seq_k - seq_q
        if pid_m * BLOCK_M >= seq_q:  # this query block lies past the end of sequence b
            return
        q_row = q_start.to(tl.int64) * stride_qs
        k_row = k_start.to(tl.int64) * stride_ks
        v_row = k_start.to(tl.int64) * stride_vs
        o_row = q_start.to(tl.int64) * stride_os
        lse_row = h.to(tl.int64) * stride_lh + q_start
    else:
        seq_q = SEQ_Q
        seq_k = SEQ_K
        off = offset
        q_row = b.to(tl.int64) * stride_qb
        k_row = b.to(tl.int64) * stride_kb
        v_row = b.to(tl.int64) * stride_vb
        o_row = b.to(tl.int64) * stride_ob
        lse_row = pid_bh.to(tl.int64) * SEQ_Q

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_ptrs = Q + q_row + h * stride_qh + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < seq_q) & (offs_dqk[None, :] < D_QK), other=0.0)
    k_base = K + k_row + hk * stride_kh
    v_base = V + v_row + hk * stride_vh

    if HAS_SINK:
        sink_log2 = tl.load(SINK + h).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink_log2
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    m_start = pid_m * BLOCK_M
    lo, hi = _kv_range(m_start, off, win_left, win_right, seq_k, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    a, bb = _unmasked_kv_blocks(m_start, lo, hi, off, win_left, win_right, seq_k, HAS_LEFT, HAS_RIGHT,
                                BLOCK_M, BLOCK_N)
    # rows past seq_q (a partial last query block) read zero queries and are never stored
    for start_n in range(lo, a, BLOCK_N):
        acc, m_i, l_i = _attn_fwd_step(acc, m_i, l_i, q, k_base, v_base, start_n, offs_m, offs_n0, offs_dqk,
                                       offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seq_q, seq_k, off,
                                       win_left, win_right, qk_scale, D_QK, D_V, HAS_LEFT, HAS_RIGHT,
                                       True, EVEN_D, DOT_PRECISION, NEG_SCALE)
    for start_n in range(a, bb, BLOCK_N):
        acc, m_i, l_i = _attn_fwd_step(acc, m_i, l_i, q, k_base, v_base, start_n, offs_m, offs_n0, offs_dqk,
                                       offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seq_q, seq_k, off,
                                       win_left, win_right, qk_scale, D_QK, D_V, HAS_LEFT, HAS_RIGHT,
                                       False, EVEN_D, DOT_PRECISION, NEG_SCALE)
    for start_n in range(bb, hi, BLOCK_N):
        acc, m_i, l_i = _attn_fwd_step(acc, m_i, l_i, q, k_base, v_base, start_n, offs_m, offs_n0, offs_dqk,
                                       offs_dv, stride_ks, stride_kd, stride_vs, stride_vd, seq_q, seq_k, off,
                                       win_left, win_right, qk_scale, D_QK, D_V, HAS_LEFT, HAS_RIGHT,
                                       True, EVEN_D, DOT_PRECISION, NEG_SCALE)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) / 1.4426950408889634)
    o_ptrs = O + o_row + h * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m[:, None] < seq_q) & (offs_dv[None, :] < D_V))
    tl.store(LSE + lse_row + offs_m, lse, mask=offs_m < seq_q)


def attn_block_dims(d_qk: int, d_v: int, min_block: int = 16) -> tuple[int, int]:
    """Head dims padded to powers of two (at least ``min_block``: 16, the smallest tl.dot size, or
    :func:`mma_min_block`)."""
    return max(min_block, next_pow2(d_qk)), max(min_block, next_pow2(d_v))


def mma_min_block(t: torch.Tensor) -> int:
    """The smallest head-dim tile the kernels use for ``t``'s inputs: 64 for fp16/bf16 on the GPU,
    else 16. On the H200 (Triton 3.6) a 32-wide bf16/fp16 value tile gave wrong P @ V products
    (head_dim_v 24: every query row that saw more than 16 keys was wrong, 5.7 dB; fp32 inputs,
    which take no tensor-core path, and 64-wide tiles were right), so narrow head dims are padded
    to 64 there: the loads are masked and the extra MMA width is small against the memory traffic
    of such heads."""
    return 64 if t.is_cuda and t.dtype in (torch.float16, torch.bfloat16) else 16


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products ("ieee"), never TF32; the flag is ignored for fp16/bf16.
    return "ieee" if dtype == torch.float32 else "tf32"


def window_flags(win_left: int, win_right: int) -> tuple[bool, bool, int, int]:
    return win_left >= 0, win_right >= 0, max(win_left, 0), max(win_right, 0)


def check_flash_attn_triton(q, k, v, sink=None) -> Optional[str]:
    """None when the Triton kernels can run these (already op-validated) tensors, else a reason."""
    try:
        if q.device.type != "cuda" and not (q.device.type == "cpu" and is_interpreter()):
            return f"tensors on {q.device}; needs CUDA (or CPU with TRITON_INTERPRET=1)"
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} is not one of float16, bfloat16, float32"
        if q.device.type == "cpu" and q.dtype == torch.bfloat16 and not bf16_dot_fixed():
            return (
                "bf16 under the Triton interpreter gives wrong products (triton issue #11584); "
                "call primus_turbo.triton.interpreter.fix_bf16_dot() first"
            )
        if q.size(-1) > MAX_HEAD_DIM or v.size(-1) > MAX_HEAD_DIM:
            return f"head_dim_qk={q.size(-1)}, head_dim_v={v.size(-1)}: at most {MAX_HEAD_DIM} supported"
    except Exception as exc:  # noqa: BLE001 - the contract is "never raises"
        return f"check failed: {exc!r}"
    return None


#: sm_90 forward tiles per padded head dim: (BLOCK_M, BLOCK_N, num_warps, num_stages); measured
#: with scripts/tune_attention.py (benchmarks/results/h200/NOTES.md has the sweep)
FWD_CONFIGS = {64: (128, 64, 4, 3), 128: (64, 64, 4, 3), 256: (128, 64, 8, 2)}
#: fp32 inputs: exact fp32 products ("ieee") run on the FMA pipe, whose unrolled code grows with the
#: tile; with the 16-bit tiles the first fp32 call at head dim 128 compiled for ~2 minutes on the H200
#: machine (fwd + both backward kernels; 150 s on a 2-core host), with these 55 s on that host
#: (scripts/aot_compile_check.py's compile path timed per kernel). fp32 attention is the precise
#: path, not a fast one.
FP32_FWD_CONFIGS = {64: (64, 32, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 1)}


def _fwd_config(d_max: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int]:
    if is_interpreter():
        return 32, 32, 4, 1
    table = FP32_FWD_CONFIGS if dtype == torch.float32 else FWD_CONFIGS
    for d, cfg in sorted(table.items()):
        if d_max <= d:
            return cfg
    return table[max(table)]


def even_head_dims(d_qk: int, d_v: int, min_block: int = 16) -> bool:
    """Head dims equal to their padded block dims: loads need no head-dim mask."""
    block_dqk, block_dv = attn_block_dims(d_qk, d_v, min_block)
    return d_qk == block_dqk and d_v == block_dv


def _launch_fwd(q4, k4, v4, out4, lse, sink, softmax_scale, win_left, win_right,
                B, H, Hk, Sq, Sk, stride_lh, cu_q=None, cu_k=None):
    """One launch of :func:`_attn_fwd_kernel` on logical 4-D stride tuples (varlen: batch stride 0)."""
    (q, qs), (k, ks), (v, vs), (out, os_) = q4, k4, v4, out4
    Dqk, Dv = q.size(-1), v.size(-1)
    min_block = mma_min_block(q)
    block_dqk, block_dv = attn_block_dims(Dqk, Dv, min_block)
    bm, bn, warps, stages = _fwd_config(max(block_dqk, block_dv), q.dtype)
    has_left, has_right, wl, wr = window_flags(win_left, win_right)
    varlen = cu_q is not None
    grid = (cdiv(Sq, bm), B * H)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, sink if sink is not None else lse,
        cu_q if varlen else lse, cu_k if varlen else lse,
        *qs, *ks, *vs, *os_, stride_lh,
        H, Sq, Sk, H // Hk, Dqk, Dv,
        float(softmax_scale) * LOG2E, Sk - Sq, wl, wr,
        HAS_SINK=sink is not None, HAS_LEFT=has_left, HAS_RIGHT=has_right, IS_VARLEN=varlen,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv, EVEN_D=even_head_dims(Dqk, Dv, min_block),
        DOT_PRECISION=dot_precision(q.dtype), NEG_SCALE=softmax_scale < 0, num_warps=warps, num_stages=stages,
    )


def varlen_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """``[total, heads, dim]`` strides as logical ``[batch, seq, heads, dim]`` ones (batch stride unused)."""
    return (0, *t.stride())


def flash_attn_fwd_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: Optional[torch.Tensor],
    softmax_scale: float, win_left: int = -1, win_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward. q ``[B, Sq, Hq, Dqk]``, k ``[B, Sk, Hk, Dqk]``, v ``[B, Sk, Hk, Dv]`` (any
    strides; ``Hq % Hk == 0``), sink fp32 ``[Hq]`` or None; window bounds ``-1`` = unbounded (causal
    is ``win_right = 0``). Returns ``O [B, Sq, Hq, Dv]`` (q's dtype) and ``LSE [B, Hq, Sq]`` fp32."""
    B, Sq, H, Dqk = q.shape
    _, Sk, Hk, Dv = v.shape
    out = torch.empty((B, Sq, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    if B == 0 or Sq == 0 or H == 0:
        return out, lse
    _launch_fwd((q, q.stride()), (k, k.stride()), (v, v.stride()), (out, out.stride()), lse, sink,
                softmax_scale, win_left, win_right, B, H, Hk, Sq, Sk, Sq)
    return out, lse


def flash_attn_varlen_fwd_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, sink: Optional[torch.Tensor], softmax_scale: float,
    win_left: int = -1, win_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (THD) forward. q ``[Tq, Hq, Dqk]``, k ``[Tk, Hk, Dqk]``, v ``[Tk, Hk, Dv]``; sequence ``b``
    is rows ``cu_seqlens[b] .. cu_seqlens[b+1]-1`` (int32 ``[B+1]``, read on the device only), each at
    most ``max_seqlen`` long; masks are bottom-right aligned per sequence. Returns ``O [Tq, Hq, Dv]``
    and ``LSE [Hq, Tq]`` fp32. Rows outside ``cu_seqlens_q[0] .. cu_seqlens_q[-1]`` get ``O = 0``,
    ``LSE = +inf``."""
    Tq, H, _ = q.shape
    Hk, Dv = v.shape[1], v.shape[2]
    B = cu_seqlens_q.numel() - 1
    out = torch.zeros((Tq, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.full((H, Tq), float("inf"), dtype=torch.float32, device=q.device)
    if B <= 0 or Tq == 0 or H == 0 or max_seqlen_q <= 0:
        return out, lse
    _launch_fwd((q, varlen_strides(q)), (k, varlen_strides(k)), (v, varlen_strides(v)), (out, varlen_strides(out)),
                lse, sink, softmax_scale, win_left, win_right, B, H, Hk, int(max_seqlen_q), int(max_seqlen_k),
                lse.stride(0), cu_seqlens_q, cu_seqlens_k)
    return out, lse


def default_softmax_scale(d_qk: int) -> float:
    return 1.0 / math.sqrt(d_qk)
