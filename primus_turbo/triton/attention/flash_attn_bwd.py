"""FlashAttention-2 style backward in Triton: two kernels, no atomics, so it is deterministic.

With ``P = exp(S * scale - LSE)`` recomputed from the forward's LSE and
``delta_i = sum_d dO[i, d] * O[i, d]``:

* ``dV = P^T dO``,  ``dP = dO V^T``,  ``dS = P * (dP - delta)``,
* ``dK = scale * dS^T Q``,  ``dQ = scale * dS K``.

``_attn_bwd_dkdv_kernel`` owns a block of keys of one (batch, kv head) and loops over every query
head of its GQA group and every query block that sees it; ``_attn_bwd_dq_kernel`` owns a block of
queries and loops over key blocks. Each output element is written by exactly one program in a
fixed order, so results are bitwise reproducible.

Sink gradient: the sink logit ``s_h`` only enters the denominator, so with
``P_sink(i) = exp(s_h - LSE_i)``, ``dO_i/ds_h = -P_sink(i) * O_i`` and
``dL/ds_h = -sum_{b,i} P_sink(i) * delta_i`` (a small deterministic torch reduction here).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from primus_turbo.triton import is_interpreter

from .flash_attn_fwd import LOG2E, _visible, attn_block_dims, dot_precision, window_flags, _kv_range

__all__ = ["flash_attn_bwd_triton", "flash_attn_varlen_bwd_triton"]


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lh,
    H, HK, SEQ_Q, SEQ_K, GROUP, D_QK, D_V,
    qk_scale, sm_scale, offset, win_left, win_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
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
    else:
        seq_q = SEQ_Q
        seq_k = SEQ_K
        off = offset
        q_row = b * stride_qb
        do_row = b * stride_dob
        k_row = b * stride_kb
        v_row = b * stride_vb
        dk_row = b * stride_dkb
        dv_row = b * stride_dvb

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

    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + q_row + h * stride_qh
        do_base = DO + do_row + h * stride_doh
        if IS_VARLEN:
            row_base = h.to(tl.int64) * stride_lh + q_start
        else:
            row_base = (b * H + h) * seq_q
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < seq_q
            q = tl.load(
                q_base + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
                mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
            )
            do = tl.load(
                do_base + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod,
                mask=m_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0,
            )
            lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
            ok = tl.trans(_visible(offs_m, offs_n, seq_q, seq_k, off, win_left, win_right, HAS_LEFT, HAS_RIGHT))
            pt = tl.where(ok, tl.exp2(st - lse[None, :]), 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)

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
    DOT_PRECISION: tl.constexpr,
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
        q_row = b * stride_qb
        do_row = b * stride_dob
        dq_row = b * stride_dqb
        k_row = b * stride_kb
        v_row = b * stride_vb
        lse_row = pid_bh * SEQ_Q

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
    lse = tl.load(LSE + lse_row + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + lse_row + offs_m, mask=m_ok, other=0.0)
    k_base = K + k_row + hk * stride_kh
    v_base = V + v_row + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)

    lo, hi = _kv_range(pid_m * BLOCK_M, off, win_left, win_right, seq_k, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < seq_k
        k = tl.load(
            k_base + offs_n[:, None] * stride_ks + offs_dqk[None, :] * stride_kd,
            mask=n_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
        )
        vt = tl.load(
            v_base + offs_n[None, :] * stride_vs + offs_dv[:, None] * stride_vd,
            mask=n_ok[None, :] & (offs_dv[:, None] < D_V), other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        ok = _visible(offs_m, offs_n, seq_q, seq_k, off, win_left, win_right, HAS_LEFT, HAS_RIGHT)
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

    dq = dq * sm_scale
    tl.store(
        DQ + dq_row + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_dqk[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK),
    )


def _bwd_config(d_max: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) shared by both backward kernels."""
    if is_interpreter():
        return 32, 32, 4, 1
    if d_max <= 64:
        return 64, 64, 4, 2
    if d_max <= 128:
        return 64, 64, 8, 1
    return 32, 32, 4, 1


def _launch_bwd(q, k, v, dout, lse, delta, dq, dk, dv, strides, softmax_scale, win_left, win_right,
                B, H, Hk, Sq, Sk, stride_lh, cu_q=None, cu_k=None):
    """Both backward kernels on logical 4-D stride tuples ``strides = (q, k, v, dout, dq, dk, dv)``."""
    qs, ks, vs, dos, dqs, dks, dvs = strides
    Dqk, Dv = q.size(-1), v.size(-1)
    block_dqk, block_dv = attn_block_dims(Dqk, Dv)
    bm, bn, warps, stages = _bwd_config(max(block_dqk, block_dv))
    has_left, has_right, wl, wr = window_flags(win_left, win_right)
    varlen = cu_q is not None
    cu_q, cu_k = (cu_q, cu_k) if varlen else (lse, lse)
    common = dict(
        HAS_LEFT=has_left, HAS_RIGHT=has_right, IS_VARLEN=varlen, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_DQK=block_dqk, BLOCK_DV=block_dv, DOT_PRECISION=dot_precision(q.dtype), num_warps=warps,
        num_stages=stages,
    )
    qk_scale = float(softmax_scale) * LOG2E
    _attn_bwd_dkdv_kernel[(triton.cdiv(Sk, bn), B * Hk)](
        q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k,
        *qs, *ks, *vs, *dos, *dks, *dvs, stride_lh,
        H, Hk, Sq, Sk, H // Hk, Dqk, Dv,
        qk_scale, float(softmax_scale), Sk - Sq, wl, wr, **common,
    )
    _attn_bwd_dq_kernel[(triton.cdiv(Sq, bm), B * H)](
        q, k, v, dout, lse, delta, dq, cu_q, cu_k,
        *qs, *ks, *vs, *dos, *dqs, stride_lh,
        H, Sq, Sk, H // Hk, Dqk, Dv,
        qk_scale, float(softmax_scale), Sk - Sq, wl, wr, **common,
    )


def flash_attn_bwd_triton(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, sink: Optional[torch.Tensor], softmax_scale: float, win_left: int = -1, win_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of :func:`flash_attn_fwd_triton`: ``(dq, dk, dv, dsink)`` (dsink fp32 ``[Hq]`` or None)."""
    B, Sq, H, Dqk = q.shape
    _, Sk, Hk, Dv = v.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    # delta_i = rowsum(dO * O) in fp32, as [B, H, Sq] like the LSE
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    dsink = None
    if sink is not None:
        p_sink = torch.exp(sink.float().view(1, H, 1) - lse)  # 0 where LSE = +inf
        dsink = -(p_sink * delta).sum(dim=(0, 2))
    if B == 0 or H == 0 or Sq == 0 or Sk == 0:  # nothing to launch: every gradient is an empty sum
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return dq, dk, dv, dsink
    strides = tuple(t.stride() for t in (q, k, v, dout, dq, dk, dv))
    _launch_bwd(q, k, v, dout, lse, delta, dq, dk, dv, strides, softmax_scale, win_left, win_right,
                B, H, Hk, Sq, Sk, Sq)
    return dq, dk, dv, dsink


def flash_attn_varlen_bwd_triton(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    sink: Optional[torch.Tensor], softmax_scale: float, win_left: int = -1, win_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of :func:`flash_attn_varlen_fwd_triton` (packed ``[T, H, D]`` tensors, LSE ``[Hq, Tq]``).
    Rows outside the ``cu_seqlens`` ranges get zero gradients."""
    Tq, H, _ = q.shape
    Hk = v.shape[1]
    B = cu_seqlens_q.numel() - 1
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1).contiguous()  # [H, Tq] like the LSE
    dsink = None
    if sink is not None:
        p_sink = torch.exp(sink.float().view(H, 1) - lse)  # 0 where LSE = +inf
        dsink = -(p_sink * delta).sum(dim=1)
    if B <= 0 or H == 0 or Tq == 0 or k.shape[0] == 0 or max_seqlen_q <= 0 or max_seqlen_k <= 0:
        return dq, dk, dv, dsink
    strides = tuple((0, *t.stride()) for t in (q, k, v, dout, dq, dk, dv))
    _launch_bwd(q, k, v, dout, lse, delta, dq, dk, dv, strides, softmax_scale, win_left, win_right,
                B, H, Hk, int(max_seqlen_q), int(max_seqlen_k), lse.stride(0), cu_seqlens_q, cu_seqlens_k)
    return dq, dk, dv, dsink
