"""Hopper (sm_90) Gluon backward for softmax attention, warp-specialized (FlashAttention-3 ideas).

Same contract as ``flash_attn_bwd.py``'s :func:`flash_attn_bwd_triton` for the cases it takes: the
gradients ``(dq, dk, dv, dsink)`` of the forward (tl or Gluon, both write the same O and natural-log
LSE). With ``P = exp(S * scale - LSE)``, ``delta_i = rowsum(dO * O)_i`` (the tl preprocess):
``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dK = scale * dS^T Q``,
``dQ = scale * dS K``.

Algorithm: FlashAttention-2's backward (Dao 2023) laid out as FlashAttention-3 lays it out on
Hopper (Shah et al. 2024); the code is ours, and unlike FA3 it has no atomics (deterministic):

* ``_attn_bwd_dkdv_ws_kernel``: one CTA owns 128 keys of one (batch, kv head); each of the two
  consumer warpgroups owns 64 of them (their K and V halves stay in shared memory, dK and dV in
  fp32 registers). One producer warp streams ``BLOCK_M``-row blocks of Q and dO by TMA through a
  STAGES-deep ring (one ready and one empty mbarrier per slot: Q and dO are consumed and released
  together), over every query head of the GQA group, so a kv head's dK / dV sum its q heads in
  registers (no atomics, no second pass). Per block a warpgroup computes, transposed so that its
  keys are the MMA rows, ``S^T = K Q^T`` and ``dP^T = V dO^T`` (both issued before the first
  wait), ``P^T = exp2(S^T * scale * log2 e - LSE * log2 e)``, ``dV += P^T dO`` (P^T from registers
  as the wgmma A operand, issued while dS is computed), ``dS^T = P^T (dP^T - delta)``,
  ``dK += dS^T Q`` (dS^T from registers). The softmax scale multiplies dK once at the end;
  dK / dV go out by TMA store through the K / V buffers (dead by then).
* dQ: ``_attn_bwd_dq_ws_kernel``, the forward's shape: one CTA owns 128 query rows of one
  (batch, q head), two warpgroups of 64; Q and dO halves load once, K and V blocks stream through
  a ring; ``S = Q K^T``, ``dP = dO V^T``, ``dS = P (dP - delta)``, ``dQ += dS K`` (dS from
  registers). ``PRIMUS_TURBO_ATTN_BWD_GLUON_DQ=0`` runs the tl dQ kernel instead (see
  :func:`use_gluon_dq`).

Causal / right-bounded masks (bottom-right aligned, ``diag = seq_k - seq_q + right``): the query
blocks that see none of a CTA's keys are never loaded, only the blocks that cross the diagonal
run the mask arithmetic. Rows past ``seq_q`` (TMA zero fill) get ``LSE = +inf`` (masked load), so
``P = 0`` there; keys past ``seq_k`` only touch dK / dV rows that the TMA store clips, and in the
dQ kernel they are masked.

Sinks cost nothing here: the forward's LSE includes the sink, so P and dS are unchanged; dsink
is the tl backward's torch reduction. Inputs: 4-D TMA descriptors over logical ``[b, s, h, d]``
(bshd / sbhd / bhsd in place), fp16 / bf16, equal head dims 64 or 128, no left window
(:func:`gluon_attn_bwd_reason`; the tl kernels run everything else).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional

import torch

from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, SMEM_LIMIT
from primus_turbo.triton.launch import launch

from .flash_attn_fwd_gluon import _desc, _device_reason, _tma_strides, gluon_attn_operand_reason

__all__ = [
    "GLUON_ATTN_BWD_ENV",
    "GLUON_ATTN_BWD_DQ_ENV",
    "GluonAttnBwdConfig",
    "default_attn_bwd_config",
    "flash_attn_bwd_gluon",
    "gluon_attn_bwd_operand_reason",
    "gluon_attn_bwd_reason",
    "use_gluon_attn_bwd",
    "use_gluon_dq",
]

GLUON_ATTN_BWD_ENV = "PRIMUS_TURBO_ATTN_BWD_GLUON"
GLUON_ATTN_BWD_DQ_ENV = "PRIMUS_TURBO_ATTN_BWD_GLUON_DQ"
LOG2E = 1.4426950408889634
SEQ_ALIGN = 128  # the padded LSE / delta rows: a multiple of every block_m and of the dQ tile
HALF = 64  # rows per consumer warpgroup (one m64 wgmma): keys in the dK/dV kernel, queries in the dQ kernel

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@dataclasses.dataclass(frozen=True)
class GluonAttnBwdConfig:
    """Tiles of the two kernels. dK/dV: 128 keys per CTA (2 x 64), ``block_m`` query rows per ring
    slot, ``stages`` Q + dO slots. dQ: 128 query rows per CTA, ``dq_block_n`` keys per ring slot,
    ``dq_stages`` K + V slots. ``consumer_regs`` / ``producer_regs``: setmaxnreg budgets of both
    kernels (2 x 128 x consumer + 128 x producer <= 65536)."""

    block_m: int = 64
    stages: int = 3
    dq_block_n: int = 64
    dq_stages: int = 3
    consumer_regs: int = 240
    producer_regs: int = 24

    BLOCK_N = 2 * HALF  # keys per dK/dV CTA
    DQ_BLOCK_M = 2 * HALF  # query rows per dQ CTA

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        kv = 2 * self.BLOCK_N * head_dim * elem_bytes
        ring = 2 * self.stages * self.block_m * head_dim * elem_bytes
        return kv + ring + 8 * (2 * self.stages + 1) + 1024  # + barriers, + the swizzle alignment

    def dq_smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        qdo = 2 * self.DQ_BLOCK_M * head_dim * elem_bytes
        ring = 2 * self.dq_stages * self.dq_block_n * head_dim * elem_bytes
        return qdo + ring + 8 * (4 * self.dq_stages + 1) + 1024

    def short(self) -> str:
        return (f"m{self.block_m}s{self.stages}n{self.dq_block_n}t{self.dq_stages}"
                f"r{self.consumer_regs}w{self.producer_regs}")

    @classmethod
    def parse(cls, text: str) -> "GluonAttnBwdConfig":
        """``"m64s3"``, ``"m128s4n64t3"``, ``"m64s3n64t3r232w40"`` -> config (m / s: dK/dV block_m and
        stages, n / t: dQ block_n and stages, r / w: consumer / producer registers per thread)."""
        m = re.fullmatch(r"m(\d+)s(\d+)(?:n(\d+)t(\d+))?(?:r(\d+))?(?:w(\d+))?", text.strip())
        if not m:
            raise ValueError(f"bad Gluon attention backward config {text!r}; expected e.g. m64s3, m128s4n64t3")
        bm, st, bn, t, r, w = m.groups()
        return cls(int(bm), int(st), int(bn or 64), int(t or 3), int(r or 240), int(w or 24))

    def check(self, head_dim: int) -> Optional[str]:
        if self.block_m not in (64, 128) or self.dq_block_n not in (64, 128):
            return f"block_m and dq_block_n must be 64 or 128, got {self.block_m}, {self.dq_block_n}"
        if self.stages < 1 or self.dq_stages < 1:
            return f"stages must be >= 1, got {self.stages}, {self.dq_stages}"
        if any(r % 8 or not 24 <= r <= 256 for r in (self.consumer_regs, self.producer_regs)):
            return f"setmaxnreg counts must be multiples of 8 in [24, 256], got {self.consumer_regs}, {self.producer_regs}"
        if 2 * 128 * self.consumer_regs + 128 * self.producer_regs > 65536:
            return f"registers: 2 x 128 x {self.consumer_regs} + 128 x {self.producer_regs} > 65536"
        for what, need in (("dK/dV", self.smem_bytes(head_dim)), ("dQ", self.dq_smem_bytes(head_dim))):
            if need > SMEM_LIMIT:
                return f"config {self.short()} needs {need} bytes of shared memory for {what} at D={head_dim}"
        return None


#: per head dim; not yet measured on the H200 (scripts/check_gluon_attn.py --bwd times them).
#: D=128, dK/dV: fp32 dK + dV of 64 keys x 128 are 128 registers per thread, so the S^T / dP^T
#: tiles stay 64 x 64 (block_m 64); K + V 64 KB + 3 x 32 KB Q/dO slots. D=64: 128-row query
#: blocks would halve the barrier round trips per FLOP but spill (64 x 128 S^T, dP^T, P^T and
#: their LSE / delta columns), so 64 rows and a deeper ring.
_DEFAULT_CONFIGS = {
    64: GluonAttnBwdConfig(block_m=64, stages=4, dq_block_n=128, dq_stages=3),
    128: GluonAttnBwdConfig(block_m=64, stages=3, dq_block_n=64, dq_stages=3),
}


def default_attn_bwd_config(head_dim: int) -> GluonAttnBwdConfig:
    return _DEFAULT_CONFIGS[head_dim]


# ----------------------------------------------------------------------------------------------
# dK / dV kernel
# ----------------------------------------------------------------------------------------------
if GLUON_AVAILABLE:

    @gluon.jit
    def _q_blocks(n_start, SEQ_Q, diag, HAS_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Query blocks (in block units) of keys [n_start, n_start + BLOCK_N): [lo, mid) cross the
        diagonal (masked), [mid, hi) see every one of those keys. Row i sees key j iff
        ``j <= i + diag`` (HAS_RIGHT), so rows below ``n_start - diag`` see none of them."""
        hi = gl.cdiv(SEQ_Q, BLOCK_M)
        lo = hi * 0
        mid = hi * 0
        if HAS_RIGHT:
            lo = gl.minimum(gl.maximum(n_start - diag, 0) // BLOCK_M, hi)
            mid = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(n_start + BLOCK_N - 1 - diag, 0), BLOCK_M), lo), hi)
        return lo, mid, hi

    @gluon.jit
    def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs,
                       k_smem, v_smem, kv_bar, ready, empty, H, GROUP, SEQ_Q, SEQ_PAD, diag,
                       HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr):
        """One warp: the CTA's K and V (two 64-row halves each) once, then Q, dO, LSE and delta of
        every query block of every q head of the group into ring slot ``it % STAGES``."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
        HALF_N: gl.constexpr = k_desc.block_type.shape[1]
        HK = H // GROUP
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // HK
        hk = pid_bh % HK
        n0 = pid_n * (2 * HALF_N)
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for i in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [b, n0 + i * HALF_N, hk, 0], kv_bar, k_smem.index(i))
            tma.async_copy_global_to_shared(v_desc, [b, n0 + i * HALF_N, hk, 0], kv_bar, v_smem.index(i))
        lo, mid, hi = _q_blocks(n0, SEQ_Q, diag, HAS_RIGHT, BLOCK_M, 2 * HALF_N)
        it = 0
        for g in range(GROUP):
            h = hk * GROUP + g
            row = (b * H + h) * SEQ_PAD
            for m in range(lo, hi):
                s = it % STAGES
                # empty barriers start one phase behind: no wait on the first lap
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [b, m * BLOCK_M, h, 0], ready.index(s), q_bufs.index(s))
                tma.async_copy_global_to_shared(do_desc, [b, m * BLOCK_M, h, 0], ready.index(s), do_bufs.index(s))
                tma.async_copy_global_to_shared(lse_desc, [row + m * BLOCK_M], ready.index(s), lse_bufs.index(s))
                tma.async_copy_global_to_shared(delta_desc, [row + m * BLOCK_M], ready.index(s),
                                                delta_bufs.index(s))
                it += 1

    @gluon.jit
    def _dkdv_step(it, m, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk, dv, offs_n, diag, qk_scale, s_layout: gl.constexpr, a_layout: gl.constexpr, MASKED: gl.constexpr,
                   STAGES: gl.constexpr):
        """One query block's contribution to this warpgroup's 64 keys (``MASKED``: a block that
        crosses the diagonal)."""
        BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
        D_QK: gl.constexpr = q_bufs.type.shape[4]
        D_V: gl.constexpr = do_bufs.type.shape[4]
        HALF_N: gl.constexpr = k.type.shape[0]
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        q = q_bufs.index(s).reshape([BLOCK_M, D_QK])
        do = do_bufs.index(s).reshape([BLOCK_M, D_V])
        zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, s_layout)
        st_tok = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
        if MASKED:
            # a diagonal block: dP^T waits until P^T is masked, so its accumulator is not live
            # next to the mask arithmetic (which would spill); at most a few blocks per CTA and head
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st_tok, ))
        else:
            dpt_tok = warpgroup_mma(v, do.permute((1, 0)), zero, use_acc=False, is_async=True)
            # wgmma groups retire in order: one outstanding = S^T done, dP^T still running
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
        # LSE (base 2) and delta come from shared memory right where they are used (short live
        # ranges: the 240 registers hold dK, dV, S^T / P^T and dP^T); the padding past seq_q
        # holds LSE = +inf, so those columns of P^T are exactly 0
        lse = lse_bufs.index(s).load(gl.SliceLayout(0, s_layout))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
        if MASKED:  # key j (row) is visible from query i (column) iff j <= i + diag
            offs_m = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            ok = gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m + diag, 0)
            pt = gl.where(ok, pt, 0.0)
        pt16 = gl.convert_layout(pt.to(q.dtype), a_layout)
        if MASKED:
            dpt_tok = warpgroup_mma(v, do.permute((1, 0)), zero, use_acc=False, is_async=True)
            dv_tok = warpgroup_mma(pt16, do, dv, is_async=True)
        else:
            dv_tok = warpgroup_mma(pt16, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok, ))
        delta = delta_bufs.index(s).load(gl.SliceLayout(0, s_layout))
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        ds16 = gl.convert_layout(dst.to(q.dtype), a_layout)
        dk_tok = warpgroup_mma(ds16, q, dk, is_async=True)
        dv, dk, pt16, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, pt16, ds16))
        mbarrier.arrive(empty.index(s), count=1)
        return dk, dv

    @gluon.jit
    def _dkdv_consumer(dk_desc, dv_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, kv_bar, ready, empty,
                       H, GROUP, SEQ_Q, diag, qk_scale, sm_scale,
                       WG: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup: keys [WG*64, WG*64+64) of the CTA's 128."""
        BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
        D_QK: gl.constexpr = q_bufs.type.shape[4]
        D_V: gl.constexpr = do_bufs.type.shape[4]
        HALF_N: gl.constexpr = k_smem.type.shape[2]
        dtype: gl.constexpr = q_bufs.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D_QK, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D_V, 16])
        gl.static_assert(D_QK == D_V, "P^T and dS^T share one A-operand layout: D_QK == D_V")
        # the fp32 accumulator fragment of S^T / dS^T is, element for element, the 16-bit A
        # fragment of the next wgmma (k_width 2): no shared-memory round trip
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)

        HK = H // GROUP
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // HK
        hk = pid_bh % HK
        n0 = pid_n * (2 * HALF_N)
        offs_n = n0 + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))

        dk = gl.zeros([HALF_N, D_QK], gl.float32, dk_layout)
        dv = gl.zeros([HALF_N, D_V], gl.float32, dv_layout)
        mbarrier.wait(kv_bar, 0)
        k = k_smem.index(WG).reshape([HALF_N, D_QK])
        v = v_smem.index(WG).reshape([HALF_N, D_V])
        it = 0
        for g in range(GROUP):
            # recomputed per head from kernel arguments: kept live across the loop they would spill
            lo, mid, hi = _q_blocks(n0, SEQ_Q, diag, HAS_RIGHT, BLOCK_M, 2 * HALF_N)
            for m in range(lo, mid):
                dk, dv = _dkdv_step(it, m, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk, dv, offs_n,
                                    diag, qk_scale, s_layout, a_layout, True, STAGES)
                it += 1
            for m in range(mid, hi):
                dk, dv = _dkdv_step(it, m, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk, dv, offs_n,
                                    diag, qk_scale, s_layout, a_layout, False, STAGES)
                it += 1

        # this warpgroup's K / V halves are dead (its last MMAs have retired): stage dK / dV
        # there for the TMA stores, which clip the rows past seq_k
        dk_smem = k_smem.index(WG)
        dv_smem = v_smem.index(WG)
        dk_smem.reshape([HALF_N, D_QK]).store((dk * sm_scale).to(dtype))
        dv_smem.reshape([HALF_N, D_V]).store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [b, n0 + WG * HALF_N, hk, 0], dk_smem)
        tma.async_copy_shared_to_global(dv_desc, [b, n0 + WG * HALF_N, hk, 0], dv_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _attn_bwd_dkdv_ws_kernel(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
        H, GROUP, SEQ_Q, SEQ_PAD,
        diag, qk_scale, sm_scale,
        HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """dK, dV of 128 keys of one (batch, kv head), summed over the group's q heads:
        ``dV = P^T dO``, ``dK = scale * (P^T (dP^T - delta)) Q``.

        Descriptors over logical [B, S, H, D]: q / do boxes [1, BLOCK_M, 1, D], k / v / dk / dv
        boxes [1, 64, 1, D] (a warpgroup's keys); lse / delta: 1-D over fp32 [B * H * SEQ_PAD] (rows
        padded to SEQ_PAD, a multiple of BLOCK_M, so a box never straddles two rows; LSE in base 2,
        +inf in the padding), box [BLOCK_M]. HAS_RIGHT is constexpr: it adds the masked diagonal
        loop."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
        HALF_N: gl.constexpr = k_desc.block_type.shape[1]
        D_QK: gl.constexpr = q_desc.block_type.shape[3]
        D_V: gl.constexpr = v_desc.block_type.shape[3]
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, 1, BLOCK_M, 1, D_QK], q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES, 1, BLOCK_M, 1, D_V], do_desc.layout)
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, 1, HALF_N, 1, D_QK], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, 1, HALF_N, 1, D_V], v_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the producer's expect + TMA bytes
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, kv_bar, ready,
                              empty, H, GROUP, SEQ_Q, diag, qk_scale, sm_scale, 0, HAS_RIGHT, STAGES)),
            (_dkdv_consumer, (dk_desc, dv_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, kv_bar, ready,
                              empty, H, GROUP, SEQ_Q, diag, qk_scale, sm_scale, 1, HAS_RIGHT, STAGES)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
                              delta_bufs, k_smem, v_smem, kv_bar, ready, empty, H, GROUP, SEQ_Q, SEQ_PAD, diag,
                              HAS_RIGHT, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# dQ kernel
# ----------------------------------------------------------------------------------------------
if GLUON_AVAILABLE:

    @gluon.jit
    def _dq_tile(H, SEQ_K, diag, HAS_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(pid_m, b, h, key blocks the tile's rows can see). Causal tiles run the longest rows
        first (grid axis 0 reversed) so the short ones fill the tail; a tile whose rows see no key
        visits no block (its dQ is 0)."""
        pid_m = gl.program_id(0)
        if HAS_RIGHT:
            pid_m = gl.num_programs(0) - 1 - pid_m
        pid_bh = gl.program_id(1)
        hi = SEQ_K
        if HAS_RIGHT:
            hi = gl.minimum(pid_m * BLOCK_M + BLOCK_M + diag, SEQ_K)
        n_blocks = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)
        return pid_m, pid_bh // H, pid_bh % H, n_blocks

    @gluon.jit
    def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready, empty,
                     H, GROUP, SEQ_K, diag, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr):
        """One warp: the tile's Q and dO halves once, then K_j and V_j into ring slot ``j % STAGES``
        (one barrier pair: both are free once this block's dQ MMA, the last to read K, retires)."""
        HALF_M: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
        pid_m, b, h, n_blocks = _dq_tile(H, SEQ_K, diag, HAS_RIGHT, 2 * HALF_M, BLOCK_N)
        hk = h // GROUP
        m0 = pid_m * (2 * HALF_M)
        mbarrier.expect(qdo_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
        for i in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [b, m0 + i * HALF_M, h, 0], qdo_bar, q_smem.index(i))
            tma.async_copy_global_to_shared(do_desc, [b, m0 + i * HALF_M, h, 0], qdo_bar, do_smem.index(i))
        for j in range(n_blocks):
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, j * BLOCK_N, hk, 0], ready.index(s), k_bufs.index(s))
            tma.async_copy_global_to_shared(v_desc, [b, j * BLOCK_N, hk, 0], ready.index(s), v_bufs.index(s))

    @gluon.jit
    def _dq_step(j, q, do, k_bufs, v_bufs, ready, empty, dq, lse, delta, offs_m, SEQ_K, diag, qk_scale,
                 s_layout: gl.constexpr, a_layout: gl.constexpr, HAS_RIGHT: gl.constexpr, MASKED: gl.constexpr,
                 STAGES: gl.constexpr):
        """Key block j's contribution to this warpgroup's 64 dQ rows (``MASKED``: the block crosses
        the diagonal or the end of the keys; keys past seq_k arrive zero-filled but would still
        get ``P = exp2(-LSE)``, which can overflow)."""
        HALF_M: gl.constexpr = q.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[2]
        D_QK: gl.constexpr = k_bufs.type.shape[4]
        D_V: gl.constexpr = v_bufs.type.shape[4]
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        kb = k_bufs.index(s).reshape([BLOCK_N, D_QK])
        vb = v_bufs.index(s).reshape([BLOCK_N, D_V])
        zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
        s_tok = warpgroup_mma(q, kb.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, vb.permute((1, 0)), zero, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        p = gl.exp2(sc * qk_scale - gl.expand_dims(lse, 1))
        if MASKED:
            offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            ok = gl.expand_dims(offs_n < SEQ_K, 0)
            if HAS_RIGHT:
                ok = ok & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m + diag, 1))
            p = gl.where(ok, p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
        ds = p * (dp - gl.expand_dims(delta, 1))
        ds16 = gl.convert_layout(ds.to(q.dtype), a_layout)
        dq_tok = warpgroup_mma(ds16, kb, dq, is_async=True)
        dq, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ds16))
        mbarrier.arrive(empty.index(s), count=1)
        return dq

    @gluon.jit
    def _dq_consumer(dq_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready, empty, LSE2, DELTA,
                     H, SEQ_PAD, SEQ_K, diag, qk_scale, sm_scale,
                     WG: gl.constexpr, HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup: query rows [WG*64, WG*64+64) of the tile."""
        HALF_M: gl.constexpr = q_smem.type.shape[2]
        D_QK: gl.constexpr = q_smem.type.shape[4]
        D_V: gl.constexpr = do_smem.type.shape[4]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[2]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D_QK, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        pid_m, b, h, n_blocks = _dq_tile(H, SEQ_K, diag, HAS_RIGHT, 2 * HALF_M, BLOCK_N)
        m0 = pid_m * (2 * HALF_M) + WG * HALF_M
        offs_m = m0 + gl.arange(0, HALF_M, layout=row_layout)
        row = (b * H + h).to(gl.int64) * SEQ_PAD
        # base-2 LSE and delta padded to SEQ_PAD (a multiple of 128): rows past seq_q (zero-filled
        # Q / dO) read LSE = +inf, so P = 0 and dS = 0 there
        lse = gl.load(LSE2 + row + offs_m)
        delta = gl.load(DELTA + row + offs_m)
        # blocks [0, n_full) are whole and below the diagonal for every row of this warpgroup
        n_full = SEQ_K // BLOCK_N
        if HAS_RIGHT:
            n_full = gl.minimum(n_full, gl.maximum(m0 + diag + 1, 0) // BLOCK_N)
        n_full = gl.minimum(n_full, n_blocks)

        dq = gl.zeros([HALF_M, D_QK], gl.float32, dq_layout)
        mbarrier.wait(qdo_bar, 0)
        q = q_smem.index(WG).reshape([HALF_M, D_QK])
        do = do_smem.index(WG).reshape([HALF_M, D_V])
        for j in range(0, n_full):
            dq = _dq_step(j, q, do, k_bufs, v_bufs, ready, empty, dq, lse, delta, offs_m, SEQ_K, diag, qk_scale,
                          s_layout, a_layout, HAS_RIGHT, False, STAGES)
        for j in range(n_full, n_blocks):
            dq = _dq_step(j, q, do, k_bufs, v_bufs, ready, empty, dq, lse, delta, offs_m, SEQ_K, diag, qk_scale,
                          s_layout, a_layout, HAS_RIGHT, True, STAGES)
        # this warpgroup's Q half is dead (its last S MMA has retired): stage dQ there for the
        # TMA store, which clips the rows past seq_q
        dq_smem = q_smem.index(WG)
        dq_smem.reshape([HALF_M, D_QK]).store((dq * sm_scale).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dq_desc, [b, m0, h, 0], dq_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _attn_bwd_dq_ws_kernel(
        q_desc, k_desc, v_desc, do_desc, dq_desc,
        LSE2, DELTA,
        H, GROUP, SEQ_PAD, SEQ_K,
        diag, qk_scale, sm_scale,
        HAS_RIGHT: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """dQ of 128 query rows of one (batch, q head): ``dQ = scale * (P (dP - delta)) K``.

        Descriptors over logical [B, S, H, D]: q / do / dq boxes [1, 64, 1, D] (a warpgroup's
        rows), k / v boxes [1, BLOCK_N, 1, D]. LSE2 (base 2, +inf padding) and DELTA: fp32
        [B, H, SEQ_PAD]. HAS_RIGHT is constexpr: it adds the diagonal loop and reverses the grid."""
        HALF_M: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
        D_QK: gl.constexpr = q_desc.block_type.shape[3]
        D_V: gl.constexpr = v_desc.block_type.shape[3]
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, 1, HALF_M, 1, D_QK], q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, 1, HALF_M, 1, D_V], do_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, BLOCK_N, 1, D_QK], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, BLOCK_N, 1, D_V], v_desc.layout)
        qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(qdo_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_dq_consumer, (dq_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready, empty, LSE2, DELTA,
                            H, SEQ_PAD, SEQ_K, diag, qk_scale, sm_scale, 0, HAS_RIGHT, STAGES)),
            (_dq_consumer, (dq_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready, empty, LSE2, DELTA,
                            H, SEQ_PAD, SEQ_K, diag, qk_scale, sm_scale, 1, HAS_RIGHT, STAGES)),
            (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready,
                            empty, H, GROUP, SEQ_K, diag, HAS_RIGHT, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
def use_gluon_attn_bwd(q: torch.Tensor, k: torch.Tensor, win_right: int) -> bool:
    """``PRIMUS_TURBO_ATTN_BWD_GLUON`` for logical ``q``/``k`` ``[B, S, H, D]``: 1 runs this backward
    for the TRITON backend's dense backward wherever :func:`gluon_attn_bwd_reason` allows, 0 never,
    auto where it was measured faster than the tl backward on the H200 (2026-11-30): every GQA
    shape (one CTA sums a group's heads: 1.07-1.46x in benchmarks/bench_attention.py), head dim
    128 except causal at <= 2048 queries without GQA (1.15-1.23x; 0.96x there), head dim 64 from
    8192 queries (1.00-1.08x; 0.76-0.94x below, scripts/check_gluon_attn.py --bwd)."""
    from primus_turbo.pytorch.core.env import env_auto_flag

    flag = env_auto_flag(GLUON_ATTN_BWD_ENV)
    if flag is None:
        if q.size(2) > k.size(2):
            return True
        if q.size(-1) == 128:
            return not (win_right == 0 and q.size(1) <= 2048)
        return q.size(1) >= 8192
    return flag


def use_gluon_dq() -> bool:
    """``PRIMUS_TURBO_ATTN_BWD_GLUON_DQ``: which dQ kernel the Gluon backward runs: 1 / auto the Gluon
    one, 0 the ``triton.language`` one (the measured fallback should the Gluon dQ lose on a GPU)."""
    from primus_turbo.pytorch.core.env import env_auto_flag

    return env_auto_flag(GLUON_ATTN_BWD_DQ_ENV) is not False


def gluon_attn_bwd_operand_reason(q, k, v, dout=None, sink=None, softmax_scale: float = 1.0, win_left: int = -1,
                                  win_right: int = -1) -> Optional[str]:
    """The shape / dtype / stride half of :func:`gluon_attn_bwd_reason` (no device test, so it is
    checkable on CPU): the forward's operand conditions and a ``dout`` of q's shape and dtype."""
    reason = gluon_attn_operand_reason(q, k, v, sink, softmax_scale, win_left, win_right)
    if reason is not None:
        return reason.replace("Gluon forward", "Gluon backward")
    if dout is not None and (tuple(dout.shape) != tuple(q.shape) or dout.dtype != q.dtype):
        return f"dout {dout.dtype} {list(dout.shape)} does not match q {q.dtype} {list(q.shape)}"
    if q.size(0) * k.size(2) > 65535:
        return f"batch * heads_kv = {q.size(0) * k.size(2)} exceeds the grid's 65535"
    if q.size(0) * q.size(2) * (-(-q.size(1) // SEQ_ALIGN) * SEQ_ALIGN) >= 2 ** 31:
        return "batch * heads_q * padded seq_q >= 2^31: past the 1-D LSE / delta TMA coordinates"
    return None


def gluon_attn_bwd_reason(q, k, v, dout=None, sink=None, softmax_scale: float = 1.0, win_left: int = -1,
                          win_right: int = -1) -> Optional[str]:
    """None when :func:`flash_attn_bwd_gluon` can run the backward of these inputs on their device,
    else why not. The forward's conditions (fp16/bf16, equal head dims 64/128, no left window,
    positive scale, TMA-aligned q / k / v), a ``dout`` of q's shape and dtype (any strides: one that
    TMA cannot read is copied), and an sm_90 GPU. Never raises, never synchronizes."""
    return _device_reason(gluon_attn_bwd_operand_reason, (q, k, v, dout, sink, softmax_scale, win_left, win_right))


def _padded_rows(lse: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LSE * log2 e, delta)`` as fp32 ``[B, H, Sq_pad]``, ``Sq_pad`` = Sq rounded up to SEQ_ALIGN,
    padded with ``+inf`` / 0: a padded row's P is exactly 0, so no kernel masks the end of the
    queries, and a 1-D TMA box of a row block never reaches into the next row."""
    pad = -lse.size(-1) % SEQ_ALIGN
    lse2 = torch.nn.functional.pad(lse * LOG2E, (0, pad), value=float("inf"))
    return lse2, torch.nn.functional.pad(delta, (0, pad), value=0.0)


@functools.lru_cache(maxsize=None)
def _row_layout(block: int):
    return gl.NVMMASharedLayout.get_default_for([block], gl.float32)


def _row_desc(t: torch.Tensor, block: int):
    flat = t.view(-1)
    return TensorDescriptor(flat, [flat.numel()], [1], [block], _row_layout(block))


def _dkdv_args(q, k, v, dout, dk, dv, lse2, delta2, softmax_scale: float, win_right: int,
               cfg: GluonAttnBwdConfig) -> tuple:
    """(grid, positional args, keyword args) of the dK/dV launch for validated, non-empty inputs
    (``lse2`` / ``delta2`` from :func:`_padded_rows`)."""
    B, Sq, H, _ = q.shape
    Sk, Hk = k.size(1), k.size(2)
    args = (_desc(q, cfg.block_m), _desc(k, HALF), _desc(v, HALF), _desc(dout, cfg.block_m), _desc(dk, HALF),
            _desc(dv, HALF), _row_desc(lse2, cfg.block_m), _row_desc(delta2, cfg.block_m), H, H // Hk, Sq,
            lse2.size(-1), Sk - Sq + max(win_right, 0), float(softmax_scale) * LOG2E, float(softmax_scale))
    kwargs = dict(HAS_RIGHT=win_right >= 0, STAGES=cfg.stages, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs, num_warps=4)
    return (-(-Sk // cfg.BLOCK_N), B * Hk), args, kwargs


def _dq_args(q, k, v, dout, dq, lse2, delta2, softmax_scale: float, win_right: int,
             cfg: GluonAttnBwdConfig) -> tuple:
    """(grid, positional args, keyword args) of the dQ launch for validated, non-empty inputs."""
    B, Sq, H, _ = q.shape
    Sk, Hk = k.size(1), k.size(2)
    args = (_desc(q, HALF), _desc(k, cfg.dq_block_n), _desc(v, cfg.dq_block_n), _desc(dout, HALF), _desc(dq, HALF),
            lse2, delta2, H, H // Hk, lse2.size(-1), Sk, Sk - Sq + max(win_right, 0), float(softmax_scale) * LOG2E,
            float(softmax_scale))
    kwargs = dict(HAS_RIGHT=win_right >= 0, STAGES=cfg.dq_stages, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs, num_warps=4)
    return (-(-Sq // cfg.DQ_BLOCK_M), B * H), args, kwargs


def _destination(name: str, t: Optional[torch.Tensor], shape: tuple, q: torch.Tensor) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if (tuple(t.shape) != shape or t.dtype != q.dtype or t.device != q.device or not t.is_contiguous()
            or t.data_ptr() % 16):
        raise ValueError(f"flash_attn_bwd_gluon: {name} must be contiguous, 16-byte aligned {q.dtype} {list(shape)} "
                         f"on {q.device}, "
                         f"got {t.dtype} {list(t.shape)} strides {tuple(t.stride())} on {t.device}")
    return t


def flash_attn_bwd_gluon(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, sink: Optional[torch.Tensor], softmax_scale: float, win_left: int = -1,
                         win_right: int = -1, config: Optional[GluonAttnBwdConfig] = None,
                         gluon_dq: Optional[bool] = None, dq: Optional[torch.Tensor] = None,
                         dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Attention backward on Hopper: the gradients ``(dq, dk, dv, dsink)`` of the forward that wrote
    ``out [B, Sq, Hq, D]`` and ``lse [B, Hq, Sq]`` (fp32, natural log, contiguous) from q
    ``[B, Sq, Hq, D]``, k / v ``[B, Sk, Hk, D]`` (fp16/bf16, D 64 or 128, TMA-aligned strides,
    ``Hq % Hk == 0``); ``dout`` like ``out`` (copied when TMA cannot read its strides). ``win_left``
    must be -1, ``win_right`` -1 or >= 0 (causal: 0). dq / dk / dv are contiguous in q's dtype,
    dsink fp32 ``[Hq]`` or None. No atomics: bitwise reproducible. ``gluon_dq``: the Gluon dQ
    kernel (True) or the tl one (False); None asks :func:`use_gluon_dq`. ``dq`` / ``dk`` / ``dv``:
    optional contiguous destinations of those shapes and q's dtype.

    Raises ValueError with :func:`gluon_attn_bwd_reason`'s text for inputs it does not take.

    Example::

        >>> if gluon_attn_bwd_reason(q, k, v, dout, None, scale, -1, 0) is None:
        ...     dq, dk, dv, _ = flash_attn_bwd_gluon(dout, q, k, v, out, lse, None, scale, -1, 0)
    """
    from .flash_attn_bwd import _delta, _launch_dq

    reason = gluon_attn_bwd_reason(q, k, v, dout, sink, softmax_scale, win_left, win_right)
    if reason is not None:
        raise ValueError(f"flash_attn_bwd_gluon: {reason}")
    B, Sq, H, D = q.shape
    Sk, Hk = k.size(1), k.size(2)
    if tuple(lse.shape) != (B, H, Sq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"flash_attn_bwd_gluon: lse must be contiguous float32 {[B, H, Sq]}, got {lse.dtype} "
                         f"{list(lse.shape)} strides {tuple(lse.stride())}")
    cfg = config or default_attn_bwd_config(D)
    bad = cfg.check(D)
    if bad is not None:
        raise ValueError(f"flash_attn_bwd_gluon: {bad}")
    if _tma_strides(dout) is None:  # e.g. the expanded gradient of a sum (zero strides), or a misaligned view
        dout = dout.clone(memory_format=torch.contiguous_format)
    dq, dk, dv = (_destination(name, t, shape, q) for name, t, shape in
                  (("dq", dq, (B, Sq, H, D)), ("dk", dk, (B, Sk, Hk, D)), ("dv", dv, (B, Sk, Hk, D))))
    delta = _delta(out, dout, varlen=False)  # [B, H, Sq] fp32, like the LSE
    dsink = None
    if sink is not None:  # as flash_attn_bwd_triton: dL/ds_h = -sum_{b,i} P_sink(i) delta_i
        p_sink = torch.exp(sink.float().view(1, H, 1) - lse)  # 0 where LSE = +inf
        dsink = -(p_sink * delta).sum(dim=(0, 2))
    if B == 0 or H == 0 or Sq == 0:  # nothing to launch: every gradient is an empty sum
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return dq, dk, dv, dsink
    with torch.cuda.device(q.device):
        lse2, delta2 = _padded_rows(lse, delta)
        grid, args, kwargs = _dkdv_args(q, k, v, dout, dk, dv, lse2, delta2, softmax_scale, win_right, cfg)
        launch(_attn_bwd_dkdv_ws_kernel, grid, args, kwargs, q.device)
        if use_gluon_dq() if gluon_dq is None else gluon_dq:
            grid, args, kwargs = _dq_args(q, k, v, dout, dq, lse2, delta2, softmax_scale, win_right, cfg)
            launch(_attn_bwd_dq_ws_kernel, grid, args, kwargs, q.device)
        else:
            strides = tuple(t.stride() for t in (q, k, v, dout, dq, dk, dv))
            _launch_dq(q, k, v, dout, lse, delta, dq, strides, softmax_scale, win_left, win_right, B, H, Hk, Sq, Sk,
                       Sq)
    return dq, dk, dv, dsink
