"""FlashAttention-2 style backward in Triton: two kernels without atomics (deterministic), or one
kernel that accumulates dQ with fp32 atomics (fewer MMAs, not bitwise reproducible).

With ``P = exp(S * scale - LSE)`` recomputed from the forward's LSE and
``delta_i = sum_d dO[i, d] * O[i, d]``:

* ``dV = P^T dO``,  ``dP = dO V^T``,  ``dS = P * (dP - delta)``,
* ``dK = scale * dS^T Q``,  ``dQ = scale * dS K``.

``_attn_bwd_dkdv_kernel`` owns a block of keys of one (batch, kv head) and loops over every query
head of its GQA group and every query block that sees it; ``_attn_bwd_dq_kernel`` owns a block of
queries and loops over key blocks. Each output element is written by exactly one program in a
fixed order, so results are bitwise reproducible. That recomputes S, P and dP in both kernels: 7 MMAs
per (query block, key block) pair.

The one-kernel variant (``_attn_bwd_dkdv_kernel`` with ``ATOMIC_DQ``, chosen by :func:`use_atomic_dq`: fp16 /
bf16, never for ``deterministic=True``) runs the dK/dV kernel and also adds each pair's ``scale * dS K`` into a
zeroed fp32 dQ accumulator with relaxed atomics (5 MMAs per pair); a cast copies it into dQ.

Sink gradient: the sink logit ``s_h`` only enters the denominator, so with
``P_sink(i) = exp(s_h - LSE_i)``, ``dO_i/ds_h = -P_sink(i) * O_i`` and
``dL/ds_h = -sum_{b,i} P_sink(i) * delta_i`` (a small deterministic torch reduction here).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, next_pow2, is_interpreter

from .flash_attn_fwd import (
    LOG2E, _kv_range, _unmasked_kv_blocks, _visible, attn_block_dims, dot_precision, even_head_dims, mma_min_block,
    window_flags,
)

__all__ = ["flash_attn_bwd_triton", "flash_attn_varlen_bwd_triton"]


@triton.jit
def _unmasked_q_blocks(n_start, lo, hi, offset, win_left, win_right, SEQ_Q, SEQ_K,
                       HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """The dK/dV twin of ``_unmasked_kv_blocks``: split the query blocks ``[lo, hi)`` that see keys
    ``n_start..n_start+BLOCK_N-1`` into masked ``[lo, a)``, fully visible and in bounds ``[a, b)``,
    masked ``[b, hi)`` (``a``, ``b`` multiples of BLOCK_M)."""
    a = lo
    if HAS_RIGHT:  # row i sees the block's last key once i >= n_start + BLOCK_N - 1 - offset - right
        first = tl.maximum(n_start + BLOCK_N - 1 - offset - win_right, 0)
        a = tl.maximum(lo, (first + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    if n_start + BLOCK_N > SEQ_K:  # a partial key block: every step masks
        a = hi
    b = (SEQ_Q // BLOCK_M) * BLOCK_M  # whole query blocks only
    if HAS_LEFT:  # row i still sees the block's first key while i <= n_start - offset + left
        b = tl.minimum(b, tl.maximum(n_start - offset + win_left + 1, 0) // BLOCK_M * BLOCK_M)
    a = tl.minimum(a, hi)
    b = tl.minimum(tl.maximum(b, a), hi)
    return a, b


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, start_m, offs_m0, offs_n, offs_dqk,
               offs_dv, stride_qs, stride_qd, stride_dos, stride_dod, stride_dqas, stride_dqad, seq_q, seq_k, off,
               win_left, win_right, qk_scale, sm_scale, D_QK, D_V, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """One query block's contribution to a key block's dK and dV (``MASKED=False``: whole block,
    every pair visible: no masks). ``ATOMIC_DQ``: also add the block pair's ``scale * dS K`` to the
    fp32 dQ accumulator at ``dqa_base`` (relaxed fp32 atomics: the one-kernel backward)."""
    offs_m = start_m + offs_m0
    q_ptrs = q_base + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd
    do_ptrs = do_base + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod
    if MASKED:
        m_ok = offs_m < seq_q
        q = tl.load(q_ptrs, mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)
        do = tl.load(do_ptrs, mask=m_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        lse = tl.load(lse_base + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
    else:
        if EVEN_D:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
        else:
            q = tl.load(q_ptrs, mask=offs_dqk[None, :] < D_QK, other=0.0)
            do = tl.load(do_ptrs, mask=offs_dv[None, :] < D_V, other=0.0)
        lse = tl.load(lse_base + offs_m) * 1.4426950408889634
        delta = tl.load(delta_base + offs_m)
    st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
    pt = tl.exp2(st - lse[None, :])
    if MASKED:
        ok = tl.trans(_visible(offs_m, offs_n, seq_q, seq_k, off, win_left, win_right, HAS_LEFT, HAS_RIGHT))
        pt = tl.where(ok, pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)
    if ATOMIC_DQ:
        dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=DOT_PRECISION) * sm_scale  # [BLOCK_M, BLOCK_DQK]
        dqa_ptrs = dqa_base + offs_m[:, None] * stride_dqas + offs_dqk[None, :] * stride_dqad
        if MASKED:
            tl.atomic_add(dqa_ptrs, dq, mask=(offs_m[:, None] < seq_q) & (offs_dqk[None, :] < D_QK), sem="relaxed")
        elif EVEN_D:
            tl.atomic_add(dqa_ptrs, dq, sem="relaxed")
        else:
            tl.atomic_add(dqa_ptrs, dq, mask=offs_dqk[None, :] < D_QK, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQA, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_dqab, stride_dqas, stride_dqah, stride_dqad,
    stride_lh,
    H, HK, SEQ_Q, SEQ_K, GROUP, D_QK, D_V,
    qk_scale, sm_scale, offset, win_left, win_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """One key block of one (batch, kv head): dK and dV over every query head of its GQA group and
    every query block that sees it. ``ATOMIC_DQ=False``: the deterministic two-kernel backward (dQ
    comes from ``_attn_bwd_dq_kernel``; ``DQA`` and its strides are unused placeholders). ``True``: the
    one-kernel backward, which also adds each pair's ``scale * dS K`` (fp32, relaxed atomics) into the
    zeroed fp32 dQ accumulator ``DQA`` (5 MMAs per block pair instead of the two kernels' 7)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK

    if IS_VARLEN:  # packed THD: see _attn_fwd_kernel
        q_start = tl.load(CU_Q + b)
        k_start = tl.load(CU_K + b)
        seq_q = tl.load(CU_Q + b + 1) - q_start
        seq_k = tl.load(CU_K + b + 1) - k_start
        off = seq_k - seq_q
        if pid_n * BLOCK_N >= seq_k:  # this key block lies past the end of sequence b
            return
        q_row = q_start.to(tl.int64) * stride_qs
        do_row = q_start.to(tl.int64) * stride_dos
        k_row = k_start.to(tl.int64) * stride_ks
        v_row = k_start.to(tl.int64) * stride_vs
        dk_row = k_start.to(tl.int64) * stride_dks
        dv_row = k_start.to(tl.int64) * stride_dvs
        dqa_row = q_start.to(tl.int64) * stride_dqas
    else:
        seq_q = SEQ_Q
        seq_k = SEQ_K
        off = offset
        q_row = b.to(tl.int64) * stride_qb
        do_row = b.to(tl.int64) * stride_dob
        k_row = b.to(tl.int64) * stride_kb
        v_row = b.to(tl.int64) * stride_vb
        dk_row = b.to(tl.int64) * stride_dkb
        dv_row = b.to(tl.int64) * stride_dvb
        dqa_row = b.to(tl.int64) * stride_dqab

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < seq_k

    k = tl.load(
        K + k_row + hk * stride_kh + offs_n[:, None] * stride_ks + offs_dqk[None, :] * stride_kd,
        mask=n_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
    )
    v = tl.load(
        V + v_row + hk * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
        mask=n_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # query rows that can see keys n_start..n_start+BLOCK_N-1 (the transpose of the forward's range)
    n_start = pid_n * BLOCK_N
    lo = n_start * 0
    hi = n_start * 0 + seq_q
    if HAS_RIGHT:
        lo = tl.maximum(n_start - off - win_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(n_start + BLOCK_N - off + win_left, seq_q)
    a, bb = _unmasked_q_blocks(n_start, lo, hi, off, win_left, win_right, seq_q, seq_k, HAS_LEFT, HAS_RIGHT,
                               BLOCK_M, BLOCK_N)

    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + q_row + h * stride_qh
        do_base = DO + do_row + h * stride_doh
        dqa_base = DQA + dqa_row + h.to(tl.int64) * stride_dqah
        if IS_VARLEN:
            row_base = h.to(tl.int64) * stride_lh + q_start
        else:
            row_base = (b * H + h).to(tl.int64) * seq_q
        lse_base = LSE + row_base
        delta_base = DELTA + row_base
        for start_m in range(lo, a, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, start_m, offs_m0,
                                offs_n, offs_dqk, offs_dv, stride_qs, stride_qd, stride_dos, stride_dod, stride_dqas,
                                stride_dqad, seq_q, seq_k, off, win_left, win_right, qk_scale, sm_scale, D_QK, D_V,
                                HAS_LEFT, HAS_RIGHT, True, EVEN_D, DOT_PRECISION, ATOMIC_DQ)
        for start_m in range(a, bb, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, start_m, offs_m0,
                                offs_n, offs_dqk, offs_dv, stride_qs, stride_qd, stride_dos, stride_dod, stride_dqas,
                                stride_dqad, seq_q, seq_k, off, win_left, win_right, qk_scale, sm_scale, D_QK, D_V,
                                HAS_LEFT, HAS_RIGHT, False, EVEN_D, DOT_PRECISION, ATOMIC_DQ)
        for start_m in range(bb, hi, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, start_m, offs_m0,
                                offs_n, offs_dqk, offs_dv, stride_qs, stride_qd, stride_dos, stride_dod, stride_dqas,
                                stride_dqad, seq_q, seq_k, off, win_left, win_right, qk_scale, sm_scale, D_QK, D_V,
                                HAS_LEFT, HAS_RIGHT, True, EVEN_D, DOT_PRECISION, ATOMIC_DQ)

    dk = dk * sm_scale
    tl.store(
        DK + dk_row + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_dqk[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty), mask=n_ok[:, None] & (offs_dqk[None, :] < D_QK),
    )
    tl.store(
        DV + dv_row + hk * stride_dvh + offs_n[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & (offs_dv[None, :] < D_V),
    )



@triton.jit
def _dq_step(dq, q, do, lse, delta, k_base, v_base, start_n, offs_m, offs_n0, offs_dqk, offs_dv,
             stride_ks, stride_kd, stride_vs, stride_vd, seq_q, seq_k, off, win_left, win_right, qk_scale,
             D_QK, D_V, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASKED: tl.constexpr,
             EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key block's contribution to a query block's dQ (``MASKED=False``: no masks)."""
    offs_n = start_n + offs_n0
    k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_dqk[None, :] * stride_kd
    vt_ptrs = v_base + offs_n[None, :] * stride_vs + offs_dv[:, None] * stride_vd
    if MASKED:
        n_ok = offs_n < seq_k
        k = tl.load(k_ptrs, mask=n_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)
        vt = tl.load(vt_ptrs, mask=n_ok[None, :] & (offs_dv[:, None] < D_V), other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        vt = tl.load(vt_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_dqk[None, :] < D_QK, other=0.0)
        vt = tl.load(vt_ptrs, mask=offs_dv[:, None] < D_V, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        ok = _visible(offs_m, offs_n, seq_q, seq_k, off, win_left, win_right, HAS_LEFT, HAS_RIGHT)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_lh,
    H, SEQ_Q, SEQ_K, GROUP, D_QK, D_V,
    qk_scale, sm_scale, offset, win_left, win_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP

    if IS_VARLEN:  # packed THD: see _attn_fwd_kernel
        q_start = tl.load(CU_Q + b)
        k_start = tl.load(CU_K + b)
        seq_q = tl.load(CU_Q + b + 1) - q_start
        seq_k = tl.load(CU_K + b + 1) - k_start
        off = seq_k - seq_q
        if pid_m * BLOCK_M >= seq_q:  # this query block lies past the end of sequence b
            return
        q_row = q_start.to(tl.int64) * stride_qs
        do_row = q_start.to(tl.int64) * stride_dos
        dq_row = q_start.to(tl.int64) * stride_dqs
        k_row = k_start.to(tl.int64) * stride_ks
        v_row = k_start.to(tl.int64) * stride_vs
        lse_row = h.to(tl.int64) * stride_lh + q_start
    else:
        seq_q = SEQ_Q
        seq_k = SEQ_K
        off = offset
        q_row = b.to(tl.int64) * stride_qb
        do_row = b.to(tl.int64) * stride_dob
        dq_row = b.to(tl.int64) * stride_dqb
        k_row = b.to(tl.int64) * stride_kb
        v_row = b.to(tl.int64) * stride_vb
        lse_row = pid_bh.to(tl.int64) * SEQ_Q

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < seq_q

    q = tl.load(
        Q + q_row + h * stride_qh + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
        mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
    )
    do = tl.load(
        DO + do_row + h * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod,
        mask=m_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0,
    )
    # rows past seq_q (a partial last block) compute garbage that is never stored
    lse = tl.load(LSE + lse_row + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + lse_row + offs_m, mask=m_ok, other=0.0)
    k_base = K + k_row + hk * stride_kh
    v_base = V + v_row + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)

    m_start = pid_m * BLOCK_M
    lo, hi = _kv_range(m_start, off, win_left, win_right, seq_k, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    a, bb = _unmasked_kv_blocks(m_start, lo, hi, off, win_left, win_right, seq_k, HAS_LEFT, HAS_RIGHT,
                                BLOCK_M, BLOCK_N)
    for start_n in range(lo, a, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, start_n, offs_m, offs_n0, offs_dqk, offs_dv,
                      stride_ks, stride_kd, stride_vs, stride_vd, seq_q, seq_k, off, win_left, win_right,
                      qk_scale, D_QK, D_V, HAS_LEFT, HAS_RIGHT, True, EVEN_D, DOT_PRECISION)
    for start_n in range(a, bb, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, start_n, offs_m, offs_n0, offs_dqk, offs_dv,
                      stride_ks, stride_kd, stride_vs, stride_vd, seq_q, seq_k, off, win_left, win_right,
                      qk_scale, D_QK, D_V, HAS_LEFT, HAS_RIGHT, False, EVEN_D, DOT_PRECISION)
    for start_n in range(bb, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, start_n, offs_m, offs_n0, offs_dqk, offs_dv,
                      stride_ks, stride_kd, stride_vs, stride_vd, seq_q, seq_k, off, win_left, win_right,
                      qk_scale, D_QK, D_V, HAS_LEFT, HAS_RIGHT, True, EVEN_D, DOT_PRECISION)

    dq = dq * sm_scale
    tl.store(
        DQ + dq_row + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_dqk[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK),
    )


@triton.jit
def _attn_bwd_delta_kernel(O, DO, DELTA, S, H, D,
                           stride_ob, stride_os, stride_oh, stride_od,
                           stride_db, stride_ds, stride_dh, stride_dd,
                           stride_lb, stride_lh,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """``delta[b, h, s] = sum_d dO[b, s, h, d] * O[b, s, h, d]`` in fp32, one read of each (torch's
    ``(dO.float() * O.float()).sum(-1)`` materialises three fp32 copies first)."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    s64 = offs_s.to(tl.int64)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h * stride_oh + s64[:, None] * stride_os + offs_d[None, :] * stride_od,
                mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_db + h * stride_dh + s64[:, None] * stride_ds
                 + offs_d[None, :] * stride_dd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + s64, delta, mask=offs_s < S)


def _delta(out: torch.Tensor, dout: torch.Tensor, varlen: bool) -> torch.Tensor:
    """fp32 ``rowsum(dO * O)`` laid out like the LSE: ``[B, H, S]`` (varlen: ``[H, T]``)."""
    if varlen:  # [T, H, D] as one logical batch
        out4, dout4 = out.unsqueeze(0), dout.unsqueeze(0)
    else:
        out4, dout4 = out, dout
    B, S, H, D = out4.shape
    delta = torch.empty((H, S) if varlen else (B, H, S), dtype=torch.float32, device=out.device)
    if delta.numel() == 0:
        return delta
    stride_lb, stride_lh = (0, S) if varlen else (H * S, S)
    block_s = 32 if is_interpreter() else 64
    _attn_bwd_delta_kernel[(cdiv(S, block_s), B * H)](
        out4, dout4, delta, S, H, D, *out4.stride(), *dout4.stride(), stride_lb, stride_lh,
        BLOCK_S=block_s, BLOCK_D=max(16, next_pow2(D)), num_warps=4)
    return delta


#: sm_90 backward tiles per padded head dim: ((dK/dV kernel), (dQ kernel)), each
#: (BLOCK_M, BLOCK_N, num_warps, num_stages); measured with scripts/tune_attention.py
BWD_CONFIGS = {
    64: ((32, 128, 4, 3), (64, 32, 4, 3)),
    128: ((32, 64, 4, 3), (128, 32, 4, 3)),
    256: ((32, 64, 4, 2), (64, 32, 4, 2)),
}
#: fp32 inputs (FMA-pipe "ieee" products; see flash_attn_fwd.FP32_FWD_CONFIGS): small tiles keep the
#: first call's compile short (head dim 128 on a 2-core host: dK/dV 63 -> 21 s, dQ 55 -> 19 s)
FP32_BWD_CONFIGS = {
    64: ((32, 32, 4, 2), (64, 32, 4, 2)),
    128: ((32, 32, 4, 2), (64, 32, 4, 2)),
    256: ((32, 32, 4, 1), (32, 32, 4, 1)),
}


#: sm_90 tiles of the one-kernel (atomic dQ) backward per padded head dim: (BLOCK_M, BLOCK_N,
#: num_warps, num_stages). Not yet measured: time them with ``scripts/tune_attention.py --bwd-variant atomic``.
BWD_ATOMIC_CONFIGS = {
    64: (64, 128, 8, 2),
    128: (64, 128, 8, 2),
    256: (64, 64, 8, 1),
}


def _by_head_dim(table: dict, d_max: int):
    for d, cfg in sorted(table.items()):
        if d_max <= d:
            return cfg
    return table[max(table)]


def _bwd_config(d_max: int, dtype: torch.dtype = torch.bfloat16):
    """((BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel, the same of the dQ kernel)."""
    if is_interpreter():
        return (32, 32, 4, 1), (32, 32, 4, 1)
    return _by_head_dim(FP32_BWD_CONFIGS if dtype == torch.float32 else BWD_CONFIGS, d_max)


def _bwd_atomic_config(d_max: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the one-kernel (atomic dQ) backward. Under the
    interpreter the tiles are small but num_warps / num_stages are the GPU's: the interpreter ignores
    them and scripts/aot_compile_check.py compiles the recorded launches with them."""
    cfg = _by_head_dim(BWD_ATOMIC_CONFIGS, d_max)
    return (32, 32, *cfg[2:]) if is_interpreter() else cfg


def use_atomic_dq(deterministic: bool, dtype: torch.dtype, atomic_dq: Optional[bool] = None) -> bool:
    """Whether a backward runs the one-kernel variant with atomic dQ accumulation (the only place
    this is decided). The two-kernel path, whatever else says, for

    * ``deterministic=True``: fp32 atomics add in a run-dependent order;
    * fp32 inputs: its fp32 tiles would need about twice the shared memory of the 16-bit tiles
      BWD_ATOMIC_CONFIGS holds (and fp32 training is not what the variant is for).

    Otherwise an explicit ``atomic_dq`` wins, then ``PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ`` (``1`` / ``0``;
    ``auto``, the default: the two-kernel path until the atomic variant is measured on the H200).
    For fp16 / bf16 the variant covers every case the two-kernel path does (masks, GQA, sinks,
    varlen, head_dim_qk != head_dim_v, padded head dims, layouts)."""
    if deterministic or dtype not in (torch.float16, torch.bfloat16):
        return False
    if atomic_dq is not None:
        return bool(atomic_dq)
    from primus_turbo.pytorch.core.env import env_auto_flag

    choice = env_auto_flag("PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ")
    return bool(choice)  # auto (None): two-kernel


def _dq_accumulator(dq: torch.Tensor) -> torch.Tensor:
    """The atomic variant's zeroed fp32 dQ accumulator, laid out like ``dq``."""
    return torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)


def _dq_epilogue(dq: torch.Tensor, dq_acc: torch.Tensor) -> None:
    """Cast the fp32 accumulator into ``dq`` (nothing to do on the two-kernel path, where it is ``dq``)."""
    if dq_acc is not dq:
        dq.copy_(dq_acc)


def _launch_common(q, v, win_left, win_right, softmax_scale, varlen: bool):
    """What every backward launch shares: ``(head-dim tile for the config tables, window bounds wl,
    wr, the base-2 score scale, the kernels' common constexprs)``."""
    Dqk, Dv = q.size(-1), v.size(-1)
    min_block = mma_min_block(q)  # narrow 16-bit head dims padded to 64 on the GPU (see mma_min_block)
    block_dqk, block_dv = attn_block_dims(Dqk, Dv, min_block)
    has_left, has_right, wl, wr = window_flags(win_left, win_right)
    common = dict(
        HAS_LEFT=has_left, HAS_RIGHT=has_right, IS_VARLEN=varlen, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv,
        EVEN_D=even_head_dims(Dqk, Dv, min_block), DOT_PRECISION=dot_precision(q.dtype),
    )
    return max(block_dqk, block_dv), wl, wr, float(softmax_scale) * LOG2E, common


def _launch_bwd(q, k, v, dout, lse, delta, dq, dk, dv, strides, softmax_scale, win_left, win_right,
                B, H, Hk, Sq, Sk, stride_lh, cu_q=None, cu_k=None, atomic=False):
    """The backward kernels on logical 4-D stride tuples ``strides = (q, k, v, dout, dq, dk, dv)``:
    the dK/dV and dQ kernels, or (``atomic``) the one kernel, with ``dq`` then a zeroed fp32 accumulator."""
    qs, ks, vs, dos, dqs, dks, dvs = strides
    Dqk, Dv = q.size(-1), v.size(-1)
    varlen = cu_q is not None
    block, wl, wr, qk_scale, common = _launch_common(q, v, win_left, win_right, softmax_scale, varlen)
    cu_q, cu_k = (cu_q, cu_k) if varlen else (lse, lse)
    if atomic:
        bm, bn, warps, stages = _bwd_atomic_config(block)
        _attn_bwd_dkdv_kernel[(cdiv(Sk, bn), B * Hk)](
            q, k, v, dout, lse, delta, dk, dv, dq, cu_q, cu_k,
            *qs, *ks, *vs, *dos, *dks, *dvs, *dqs, stride_lh,
            H, Hk, Sq, Sk, H // Hk, Dqk, Dv,
            qk_scale, float(softmax_scale), Sk - Sq, wl, wr,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, ATOMIC_DQ=True, **common,
        )
        return
    (bm1, bn1, warps1, stages1), _ = _bwd_config(block, q.dtype)
    _attn_bwd_dkdv_kernel[(cdiv(Sk, bn1), B * Hk)](
        q, k, v, dout, lse, delta, dk, dv, dk, cu_q, cu_k,
        *qs, *ks, *vs, *dos, *dks, *dvs, 0, 0, 0, 0, stride_lh,
        H, Hk, Sq, Sk, H // Hk, Dqk, Dv,
        qk_scale, float(softmax_scale), Sk - Sq, wl, wr,
        BLOCK_M=bm1, BLOCK_N=bn1, num_warps=warps1, num_stages=stages1, ATOMIC_DQ=False, **common,
    )
    _launch_dq(q, k, v, dout, lse, delta, dq, strides, softmax_scale, win_left, win_right, B, H, Hk, Sq, Sk,
               stride_lh, cu_q if varlen else None, cu_k if varlen else None)


def _launch_dq(q, k, v, dout, lse, delta, dq, strides, softmax_scale, win_left, win_right,
               B, H, Hk, Sq, Sk, stride_lh, cu_q=None, cu_k=None):
    """The dQ kernel alone (the two-kernel backward's second launch; the Gluon backward's dQ)."""
    qs, ks, vs, dos, dqs, _, _ = strides
    Dqk, Dv = q.size(-1), v.size(-1)
    varlen = cu_q is not None
    block, wl, wr, qk_scale, common = _launch_common(q, v, win_left, win_right, softmax_scale, varlen)
    cu_q, cu_k = (cu_q, cu_k) if varlen else (lse, lse)
    _, (bm2, bn2, warps2, stages2) = _bwd_config(block, q.dtype)
    _attn_bwd_dq_kernel[(cdiv(Sq, bm2), B * H)](
        q, k, v, dout, lse, delta, dq, cu_q, cu_k,
        *qs, *ks, *vs, *dos, *dqs, stride_lh,
        H, Sq, Sk, H // Hk, Dqk, Dv,
        qk_scale, float(softmax_scale), Sk - Sq, wl, wr,
        BLOCK_M=bm2, BLOCK_N=bn2, num_warps=warps2, num_stages=stages2, **common,
    )


def flash_attn_bwd_triton(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, sink: Optional[torch.Tensor], softmax_scale: float, win_left: int = -1, win_right: int = -1,
    deterministic: bool = True, atomic_dq: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of :func:`flash_attn_fwd_triton`: ``(dq, dk, dv, dsink)`` (dsink fp32 ``[Hq]`` or None).

    ``deterministic=False`` allows the one-kernel variant with atomic dQ accumulation where
    :func:`use_atomic_dq` picks it (fp16 / bf16; ``atomic_dq`` forces it on or off); ``True``, the
    default here, is always the bitwise-reproducible two-kernel backward."""
    B, Sq, H, Dqk = q.shape
    _, Sk, Hk, Dv = v.shape
    atomic = use_atomic_dq(deterministic, q.dtype, atomic_dq)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    # delta_i = rowsum(dO * O) in fp32, as [B, H, Sq] like the LSE
    delta = _delta(out, dout, varlen=False)
    dsink = None
    if sink is not None:
        p_sink = torch.exp(sink.float().view(1, H, 1) - lse)  # 0 where LSE = +inf
        dsink = -(p_sink * delta).sum(dim=(0, 2))
    if B == 0 or H == 0 or Sq == 0 or Sk == 0:  # nothing to launch: every gradient is an empty sum
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return dq, dk, dv, dsink
    dq_acc = _dq_accumulator(dq) if atomic else dq
    strides = tuple(t.stride() for t in (q, k, v, dout, dq_acc, dk, dv))
    _launch_bwd(q, k, v, dout, lse, delta, dq_acc, dk, dv, strides, softmax_scale, win_left, win_right,
                B, H, Hk, Sq, Sk, Sq, atomic=atomic)
    _dq_epilogue(dq, dq_acc)
    return dq, dk, dv, dsink


def flash_attn_varlen_bwd_triton(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    sink: Optional[torch.Tensor], softmax_scale: float, win_left: int = -1, win_right: int = -1,
    deterministic: bool = True, atomic_dq: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of :func:`flash_attn_varlen_fwd_triton` (packed ``[T, H, D]`` tensors, LSE ``[Hq, Tq]``).
    Rows outside the ``cu_seqlens`` ranges get zero gradients. ``deterministic`` / ``atomic_dq``: as
    :func:`flash_attn_bwd_triton`."""
    Tq, H, _ = q.shape
    Hk = v.shape[1]
    B = cu_seqlens_q.numel() - 1
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    delta = _delta(out, dout, varlen=True)  # [H, Tq] like the LSE
    dsink = None
    if sink is not None:
        p_sink = torch.exp(sink.float().view(H, 1) - lse)  # 0 where LSE = +inf
        dsink = -(p_sink * delta).sum(dim=1)
    if B <= 0 or H == 0 or Tq == 0 or k.shape[0] == 0 or max_seqlen_q <= 0 or max_seqlen_k <= 0:
        return dq, dk, dv, dsink
    atomic = use_atomic_dq(deterministic, q.dtype, atomic_dq)
    dq_acc = _dq_accumulator(dq) if atomic else dq
    strides = tuple((0, *t.stride()) for t in (q, k, v, dout, dq_acc, dk, dv))
    _launch_bwd(q, k, v, dout, lse, delta, dq_acc, dk, dv, strides, softmax_scale, win_left, win_right,
                B, H, Hk, int(max_seqlen_q), int(max_seqlen_k), lse.stride(0), cu_seqlens_q, cu_seqlens_k,
                atomic=atomic)
    _dq_epilogue(dq, dq_acc)
    return dq, dk, dv, dsink
