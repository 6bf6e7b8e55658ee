"""Hopper (sm_90) Gluon kernel for the BLOCKWISE FP8 GEMM (DeepSeek-V3 recipe).

``out[M, N] = sum_kb (a[:, kb] @ b[:, kb]^T) * sa[:, kb] * sb[n // 128, kb]`` with fp32
accumulation: ``a`` ``[M, K]`` and ``b`` ``[N, K]`` float8_e4m3fn (K contiguous), ``sa``
``[M, ceil(K/128)]`` fp32 (1 x 128 activation groups), ``sb`` ``[ceil(N/128), ceil(K/128)]`` fp32 (128 x 128 weight
blocks), dequantization multipliers. The same product as the BLOCKWISE mode of
``gemm_fp8_kernel.py``; only the summation order of the fp32 promotions differs.

Why a second kernel: the ``triton.language`` kernel promotes each 128-deep partial with
``acc += tl.dot(a, b.T) * scale``, so every K step waits for its wgmma before the multiply and the
tensor cores idle during the promotion and the restart of the next MMA. This kernel splits the
work so that one warpgroup's promotion overlaps the other's MMA:

* persistent grid, GROUP_M-swizzled tile order (as gemm_kernel.py);
* warp specialization (``gl.warp_specialize``): one producer warp issues the TMA loads of the A and
  B tiles into a STAGES-deep shared-memory ring guarded by ``ready``/``empty`` mbarriers;
* two consumer warpgroups, each owning 64 rows of the 128 x BLOCK_N tile, run async
  ``warpgroup_mma`` into a per-K-block fp32 partial, wait for it, release the ring slot and
  promote it into their fp32 accumulator with the row's A scale times the block's B scale. The
  warpgroups are independent instruction streams, so one's promotion overlaps the other's MMA.
  BLOCK_N = 256 (less L2 traffic per FLOP) runs each K block as two 128-column MMAs through the
  same partial registers, each with its own B scale block;
* scales are read by the consumers straight from global memory (L1/L2-resident, a few bytes per
  row and K block), issued one K block ahead so their latency hides behind the MMA;
* epilogue: bf16 tile through shared memory and a TMA store (which clips the M and N tails),
  waited on only before that buffer is rewritten, i.e. overlapped with the next tile's main loop.

Requirements (``gluon_blockwise_reason`` returns the first one that fails): CUDA sm_90, Gluon
importable, E4M3 operands with unit K stride and 16-byte aligned rows (so K % 16 == 0), scales of
the shapes above, an output (bf16, fp16 or fp32) with 16-byte aligned rows. M, N and K tails are
TMA's zero fill and store clipping; BLOCK_N is a multiple of the 128-column B scale block.
Anything else goes to the ``triton.language`` kernel.

Per-row B scales (``B_ROW_SCALES``): ``sb`` ``[N, ceil(K/128)]``, b's 1 x 128 groups along K, as the
FP8 linear's wgrad presents them (``dW = dY^T X``, both operands grouped along the tokens). The
promotion is the outer product ``(partial * sa[rows]) * sb[cols]``. Two ways to get each thread's
32 column scales per K block: BLOCK_N = 128 not pipelined (``ROW_SCALES_REGISTER_CONFIG``) loads
them from global memory one K block ahead into registers (a unit-stride copy padded to whole
128-column blocks, see ``_column_major_padded``); BLOCK_N = 256 or pipelined (``row_scales_via_smem``,
the default ``ROW_SCALES_DEFAULT_CONFIG``) has the producer TMA the block's BLOCK_N scales into the
ring slot with A and B, and each promotion reads them from shared memory right after its MMA's
wait, so no register holds them across an MMA. Taken by :func:`gluon_blockwise_reason` unless
``PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD=0`` (or ``allow_b_row_scales=False``).

``pipeline=True`` (configs ``...x``, BLOCK_N = 128, both scale kinds) also overlaps inside each warpgroup: the MMA
of block k+1 is issued before block k is waited for (``warpgroup_mma_wait(1)``) and promoted,
so a warpgroup never leaves the tensor core without queued work while it promotes.

Register discipline that makes these compile spill-free, checked with ptxas on CPU by
scripts/gluon_compile_check.py (ptxas notes C7514/C7515 mean it serialized the wgmmas): partial
sets keep fixed roles (no ``part = next`` rotation, which copies an in-flight wgmma's registers),
each MMA is handed the registers of the partial promoted just before it, and each promotion is
pinned before the next MMA (``_pin``) so LLVM cannot sink it below and double the live sets.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Optional

import torch

from primus_turbo.triton.launch import launch, launch_prepared, tensor_sig

__all__ = [
    "DEFAULT_CONFIG",
    "GluonBlockwiseConfig",
    "ROW_SCALES_DEFAULT_CONFIG",
    "ROW_SCALES_PIPELINED_CONFIG",
    "ROW_SCALES_REGISTER_CONFIG",
    "WGRAD_ENV",
    "GLUON_AVAILABLE",
    "default_config",
    "gemm_fp8_blockwise_gluon",
    "gluon_blockwise_reason",
    "gluon_operand_reason",
    "gluon_platform_reason",
]

SCALE_BLOCK = 128
WGRAD_ENV = "PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD"  # enables per-row B scales in gluon_blockwise_reason
SMEM_LIMIT = 232448  # bytes of dynamic shared memory per block on sm_90

try:  # Gluon ships with triton >= 3.4; CPU-only installs may import it but can never run it
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

    GLUON_AVAILABLE = True
    _GLUON_IMPORT_ERROR = ""
except Exception as _exc:  # noqa: BLE001 - any failure means "no Gluon here"
    GLUON_AVAILABLE = False
    _GLUON_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"


def _ring_smem_bytes(stages: int, stage: int, staging: int) -> int:
    """Shared memory of a warp-specialized kernel: ``stages`` ring stages of ``stage`` bytes, the
    output ``staging`` buffers, two mbarriers (8 bytes) a stage, 256 bytes of alignment."""
    return stages * stage + staging + 2 * 8 * stages + 256


def _pipeline_reason(cfg) -> Optional[str]:
    """The checks every warp-specialized Gluon GEMM config shares (this module's and the 16-bit
    grouped ``GluonGroupedConfig``): stages, staging buffers, GROUP_M and the setmaxnreg budgets of
    two 128-thread consumer warpgroups and the producer's warpgroup. None when they hold."""
    if cfg.stages < 2 or cfg.c_bufs not in (1, 2) or cfg.group_m < 1:
        return f"bad config {cfg.short()}: stages >= 2, c_bufs 1 or 2, group_m >= 1"
    if any(r % 8 or not 24 <= r <= 256 for r in (cfg.consumer_regs, cfg.producer_regs)):
        return f"setmaxnreg counts must be multiples of 8 in [24, 256], got {cfg.consumer_regs}, {cfg.producer_regs}"
    if 2 * 128 * cfg.consumer_regs + 128 * cfg.producer_regs > 65536:
        return f"registers: 2 x 128 x {cfg.consumer_regs} + 128 x {cfg.producer_regs} > 65536"
    return None


@dataclasses.dataclass(frozen=True)
class GluonBlockwiseConfig:
    """Tile and pipeline shape. BLOCK_M is fixed at 128 (two consumer warpgroups of 64 rows) and
    BLOCK_K at the scale block (128), so one partial is one promotion. ``consumer_regs`` and
    ``producer_regs``: the per-thread register budgets the partitions ask for (setmaxnreg); the
    two consumer warpgroups and the producer's warpgroup must fit 65536 registers.
    """

    block_n: int = 128
    stages: int = 5
    group_m: int = 8
    c_bufs: int = 1
    pipeline: bool = False
    consumer_regs: int = 232
    producer_regs: int = 40

    BLOCK_M = 128
    BLOCK_K = SCALE_BLOCK

    def smem_bytes(self, out_bytes: int = 2, b_row_scales: bool = False) -> int:
        stage = self.BLOCK_M * self.BLOCK_K + self.block_n * self.BLOCK_K  # FP8: one byte per element
        if b_row_scales and row_scales_via_smem(self):
            stage += 4 * self.block_n  # the K block's fp32 column scales travel with it
        staging = 2 * self.c_bufs * 64 * SCALE_BLOCK * out_bytes  # per warpgroup: c_bufs 64 x 128 tiles
        return _ring_smem_bytes(self.stages, stage, staging)

    def short(self) -> str:
        return (f"n{self.block_n}s{self.stages}g{self.group_m}c{self.c_bufs}{'x' if self.pipeline else ''}"
                f"r{self.consumer_regs}w{self.producer_regs}")

    @classmethod
    def parse(cls, text: str) -> "GluonBlockwiseConfig":
        """``"n128s5"``, ``"n256s4g16"``, ``"n256s3c2"``, ``"n128s5x"``, ``"n128s5r240w24"`` -> config.

        n: BLOCK_N (128 or 256), s: stages, g: GROUP_M, c: output staging buffers per
        warpgroup, x: two partials in flight per warpgroup (BLOCK_N 128 only), r / w: consumer /
        producer registers per thread."""
        m = re.fullmatch(r"n(\d+)s(\d+)(?:g(\d+))?(?:c(\d+))?(x)?(?:r(\d+))?(?:w(\d+))?", text.strip())
        if not m:
            raise ValueError(f"bad Gluon config {text!r}; expected e.g. n128s5, n256s4g16, n256s3c2, n128s5x, "
                             "n128s5r240w24")
        bn, st, g, c, x, r, w = m.groups()
        return cls(int(bn), int(st), int(g or 8), int(c or 1), bool(x), int(r or 232), int(w or 40))

    def check(self, out_bytes: int = 2, b_row_scales: bool = False) -> Optional[str]:
        """None when the kernel can be built with this config (``b_row_scales``: for the per-row
        B scale path), else why not."""
        if self.block_n not in (128, 256):
            return f"block_n must be 128 or 256 (whole B scale blocks per tile), got {self.block_n}"
        if self.pipeline and self.block_n != 128:
            return f"pipelined partials need block_n 128 (three 64 x block_n fp32 sets), got {self.block_n}"
        bad = _pipeline_reason(self)
        if bad is not None:
            return bad
        if self.smem_bytes(out_bytes, b_row_scales) > SMEM_LIMIT:
            return (f"config {self.short()} needs {self.smem_bytes(out_bytes, b_row_scales)} bytes of shared memory"
                    f"{' (with per-row B scales)' if b_row_scales else ''}, sm_90 has {SMEM_LIMIT}")
        return None


# n256s3c2 (``"n256s3g8c2r232w40"``): 128 x 256 tiles, 3 stages, two staging buffers per warpgroup.
# Measured on the H200 on 2026-11-30 (TFLOP/s; every config bit-identical to the tl kernel in SNR,
# 55.6 dB vs the fp32 product of the dequantized operands):
#                       n256s3c2  n128s5x  n128s6x    tl  cuBLAS bf16
#   4096 x 4096 x 4096      1159     1151     1173   859   765
#   16384 x 14336 x 4096    1034     1068        -   887   689
#   16384 x 4096 x 14336    1038     1043        -   894   679
#   8192 x 7168 x 2048      1111     1103     1134   815   680
#   8192 x 4096 x 7168      1225     1132        -   877   692
# geomean over the tl kernel: n256s3c2 1.283, n128s5x 1.269, n128s6x 1.254, n256s4 1.227,
# n128s6 1.141, n128s5 (the previous default) 1.042. The 256-wide tile halves the A traffic per
# FLOP and the second staging buffer lets the two 128-column stores of a tile overlap.
DEFAULT_CONFIG = GluonBlockwiseConfig(block_n=256, stages=3, group_m=8, c_bufs=2, pipeline=False,
                                      consumer_regs=232, producer_regs=40)

# Per-row B scales (B_ROW_SCALES, the FP8 linear's wgrad and the variable-K MoE wgrad). n128s6, the
# register path (BLOCK_N 128, not pipelined, column scales held in registers one K block ahead), was
# the default until 2026-12: H200 725-750 TFLOP/s dense (1.06x tl), 630-736 grouped (1.33x tl), where
# the forward's pipelined / 256-wide tiles reach 1034-1225. Each MMA there waits for the
# warpgroup's own promotion (twice the forward's work: ``(partial * sa) * sb``, 128 FP32 ops per
# thread and K block), so the tensor core idles unless the other warpgroup covers it. Configs with
# BLOCK_N 256 or ``x`` take the column scales through the ring by TMA instead (no registers held
# across an MMA), which makes room for the pipelined P/Q schedule (three 64 x 128 fp32 sets) or the
# second accumulator. n128s5xr240w24: pipelined, 5 stages (6 do not fit next to the scale boxes),
# 240 consumer registers (the variable-K kernel spills 20-136 bytes at 232; the dense one uses
# 230). ptxas: no spills, no wgmma serialization (C7514/C7515), per K block and thread 64 FMUL +
# 64 FFMA + 16 ld.shared.v2 of scales; the same promotion as the register path, bit-identical
# output. H200 (2026-11-30, check_gluon_fp8.py --wgrad, Llama-3.1-8B wgrad shapes at M 16384, all
# three bit-identical): n128s6 1.05x the tl kernel, n128s5xr240w24 1.14x, n256s3c2 1.19x, so the
# dense default is n256s3c2; the variable-K kernel keeps the pipelined n128 (--grouped-wgrad:
# 1.57x tl against 1.51x for n256s3c2 and 1.25x for n128s6).
ROW_SCALES_REGISTER_CONFIG = GluonBlockwiseConfig(block_n=128, stages=6, group_m=8, c_bufs=1, pipeline=False,
                                                  consumer_regs=232, producer_regs=40)
ROW_SCALES_PIPELINED_CONFIG = GluonBlockwiseConfig(block_n=128, stages=5, group_m=8, c_bufs=1, pipeline=True,
                                                   consumer_regs=240, producer_regs=24)
ROW_SCALES_DEFAULT_CONFIG = GluonBlockwiseConfig(block_n=256, stages=3, group_m=8, c_bufs=2, pipeline=False,
                                                 consumer_regs=232, producer_regs=40)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
if GLUON_AVAILABLE:
    SCALE_N = gl.constexpr(SCALE_BLOCK)  # columns per B scale block = columns per wgmma

    @gluon.jit
    def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
        """tile_id -> (pid_m, pid_n), GROUP_M tile rows per band (L2 reuse, as gemm_kernel.py)."""
        tiles_per_band = GROUP_M * num_pid_n
        band_first_m = (tile_id // tiles_per_band) * GROUP_M
        band_rows = gl.minimum(num_pid_m - band_first_m, GROUP_M)
        in_band = tile_id % tiles_per_band
        return band_first_m + in_band % band_rows, in_band // band_rows

    @gluon.jit
    def _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_b, k_tiles, it,
                   STAGES: gl.constexpr, k0=0, sb_desc=None, sb_bufs=None):
        """The TMA loads of one output tile: per K block, A rows [off_m, off_m + 2 * HALF_M) as two
        halves and B rows [off_b, off_b + BLOCK_N) into ring slot ``it % STAGES``, K columns from
        ``k0`` on (a group's token range in the variable-K grouped kernel; 0, a constant, for the
        dense and M-grouped ones). Returns the next ring position.

        ``sb_desc`` (per-row B scales staged through shared memory, see
        ``_mainloop_row_scales_smem``): also the block's BLOCK_N column scales, row ``k // 128``
        of the ``[K blocks, N]`` scale grid, into ``sb_bufs`` slot s under the same barrier."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
        for kk in range(k_tiles):
            s = it % STAGES
            # empty barriers start "one phase behind": the first pass over the ring never waits
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            if sb_desc is None:
                mbarrier.expect(bar, STAGE_BYTES)
            else:
                mbarrier.expect(bar, STAGE_BYTES + sb_desc.block_type.nbytes)
            k = k0 + kk * BLOCK_K
            # rows past M arrive zero-filled and still count their full box bytes
            tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(2 * s))
            tma.async_copy_global_to_shared(a_desc, [off_m + HALF_M, k], bar, a_bufs.index(2 * s + 1))
            tma.async_copy_global_to_shared(b_desc, [off_b, k], bar, b_bufs.index(s))
            if sb_desc is not None:
                # columns past N arrive as zeros (never stored); k0 is a multiple of BLOCK_K
                tma.async_copy_global_to_shared(sb_desc, [k // BLOCK_K, off_b], bar, sb_bufs.index(s))
            it += 1
        return it

    @gluon.jit
    def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
                  BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, sb_desc=None, sb_bufs=None):
        """One warp: TMA A (two 64-row halves) and B tiles into the ring, STAGES blocks ahead."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        num_pid_m = gl.cdiv(M, 2 * HALF_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        num_tiles = num_pid_m * num_pid_n
        k_tiles = gl.cdiv(K, BLOCK_K)  # a K tail arrives zero-filled
        it = 0
        for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * (2 * HALF_M)
            off_n = pid_n * BLOCK_N
            it = _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k_tiles, it, STAGES, 0,
                            sb_desc, sb_bufs)

    @gluon.jit
    def _issue(a_bufs, b_bufs, s, regs, use_acc, WG: gl.constexpr, SUB: gl.constexpr):
        """Start the warpgroup's async MMA of ring slot ``s`` against B columns
        [SUB*128, SUB*128+128) of the tile, into ``regs``. ``use_acc`` is always false (a fresh
        partial; ``regs`` only names the registers to reuse, so no zeros are materialized)."""
        b = b_bufs.index(s)
        if b_bufs.type.shape[1] > SCALE_N:
            b = b.slice(SUB * SCALE_N, SCALE_N, dim=0)
        return warpgroup_mma(a_bufs.index(2 * s + WG), b.permute((1, 0)), regs, use_acc=use_acc, is_async=True)

    @gluon.jit
    def _load_scales(sa_rows, mask_m, sb0, sb1, kb, stride_sak, stride_sbk, N_SUB: gl.constexpr):
        """K block kb's promotion factors: sa[rows, kb] * sb[n block, kb], one per 128 columns."""
        sa = gl.load(sa_rows + kb * stride_sak, mask=mask_m, other=0.0)
        scale0 = sa * gl.load(sb0 + kb * stride_sbk)
        if N_SUB == 2:
            scale1 = sa * gl.load(sb1 + kb * stride_sbk)
        else:
            scale1 = scale0
        return scale0, scale1

    @gluon.jit
    def _pin(x):
        """x, through an opaque side-effecting move per element. The wgmma is side-effecting
        inline asm too, so LLVM may not sink the arithmetic that produced x below the next MMA
        (it does otherwise, and then the partial being promoted and the next MMA's registers are
        live together: a second 64 x 128 fp32 set, spilled). ptxas removes the moves."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _mainloop(acc0, acc1, regs, a_bufs, b_bufs, ready, empty, it, k_tiles,
                  sa_rows, mask_m, sb0, sb1, stride_sak, stride_sbk,
                  WG: gl.constexpr, STAGES: gl.constexpr, N_SUB: gl.constexpr):
        """Per K block: MMA into a fresh partial, wait, promote (the default loop). With N_SUB = 2
        the tile's two 128-column halves go one after the other through the same partial
        registers: two 64 x 128 accumulators and one partial fit in 232 registers, two partials
        would not. The two consumer warpgroups run this independently, so the warp scheduler
        overlaps one's promotion with the other's MMA. The scales of block kb+1 are loaded while
        block kb computes: used right away, their L2 latency would sit in front of every MMA."""
        scale0, scale1 = _load_scales(sa_rows, mask_m, sb0, sb1, 0, stride_sak, stride_sbk, N_SUB)
        # False, but not to the compiler: with a constant False ptxas knows the second half's MMA
        # ignores the partial registers and hoists it above the first half's promotion, which
        # needs a second partial (256 registers in all) and spills. A runtime predicate keeps the
        # registers an input, so the MMA waits for the promotion that reads them.
        no_acc = k_tiles < 0
        for kb in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            part = _issue(a_bufs, b_bufs, s, regs, False, WG, 0)
            next0, next1 = _load_scales(sa_rows, mask_m, sb0, sb1, gl.minimum(kb + 1, k_tiles - 1),
                                        stride_sak, stride_sbk, N_SUB)
            regs = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            if N_SUB == 1:
                mbarrier.arrive(empty.index(s), count=1)  # the slot's last reader in this warpgroup
            acc0 = acc0 + regs * gl.expand_dims(scale0, 1)
            if N_SUB == 2:
                acc0 = _pin(acc0)
                part = _issue(a_bufs, b_bufs, s, regs, no_acc, WG, 1)
                regs = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                mbarrier.arrive(empty.index(s), count=1)
                acc1 = acc1 + regs * gl.expand_dims(scale1, 1)
            scale0 = next0
            scale1 = next1
            it += 1
        return acc0, acc1, it

    @gluon.jit
    def _retire(acc, part, scale, empty, s, PENDING: gl.constexpr):
        """Wait until at most PENDING MMAs are in flight (so ``part``'s is done), release its ring
        slot, promote it. Returns (acc, the partial's registers for reuse)."""
        done = warpgroup_mma_wait(num_outstanding=PENDING, deps=(part, ))
        mbarrier.arrive(empty.index(s), count=1)
        acc = _pin(acc + done * gl.expand_dims(scale, 1))
        return acc, done

    @gluon.jit
    def _mainloop_pipelined(acc, regs_p, regs_q, a_bufs, b_bufs, ready, empty, it, k_tiles,
                            sa_rows, mask_m, sb0, stride_sak, stride_sbk,
                            WG: gl.constexpr, STAGES: gl.constexpr):
        """Two partials, P and Q, alternate over the K blocks: block k+1 is issued into one
        before block k, in the other, is waited for (``num_outstanding=1``) and promoted, so the
        warpgroup always has an MMA queued while it promotes. Unrolled by two so P and Q keep
        fixed registers (a rotating ``part = next`` copies an in-flight wgmma's registers and
        ptxas serializes every wgmma, note C7514); each MMA takes the registers of the partial
        promoted just before (runtime-false use_acc, see _mainloop) and each promotion is pinned
        before the next MMA (see _pin). Needs three 64 x 128 fp32 sets: BLOCK_N = 128 only."""
        no_acc = k_tiles < 0
        scale_p, unused = _load_scales(sa_rows, mask_m, sb0, sb0, 0, stride_sak, stride_sbk, 1)
        s_p = it % STAGES
        mbarrier.wait(ready.index(s_p), (it // STAGES) & 1)
        p = _issue(a_bufs, b_bufs, s_p, regs_p, no_acc, WG, 0)
        it += 1
        for kb in range(1, k_tiles - 1, 2):
            # block kb -> Q; retire P (block kb - 1)
            scale_q, unused = _load_scales(sa_rows, mask_m, sb0, sb0, kb, stride_sak, stride_sbk, 1)
            s_q = it % STAGES
            mbarrier.wait(ready.index(s_q), (it // STAGES) & 1)
            q = _issue(a_bufs, b_bufs, s_q, regs_q, no_acc, WG, 0)
            it += 1
            acc, regs_p = _retire(acc, p, scale_p, empty, s_p, 1)
            # block kb + 1 -> P; retire Q (block kb)
            scale_p, unused = _load_scales(sa_rows, mask_m, sb0, sb0, kb + 1, stride_sak, stride_sbk, 1)
            s_p = it % STAGES
            mbarrier.wait(ready.index(s_p), (it // STAGES) & 1)
            p = _issue(a_bufs, b_bufs, s_p, regs_p, no_acc, WG, 0)
            it += 1
            acc, regs_q = _retire(acc, q, scale_q, empty, s_q, 1)
        if k_tiles % 2 == 0:  # one block left: it goes to Q
            scale_q, unused = _load_scales(sa_rows, mask_m, sb0, sb0, k_tiles - 1, stride_sak, stride_sbk, 1)
            s_q = it % STAGES
            mbarrier.wait(ready.index(s_q), (it // STAGES) & 1)
            q = _issue(a_bufs, b_bufs, s_q, regs_q, no_acc, WG, 0)
            it += 1
            acc, regs_p = _retire(acc, p, scale_p, empty, s_p, 1)
            acc, regs_q = _retire(acc, q, scale_q, empty, s_q, 0)
        else:
            acc, regs_p = _retire(acc, p, scale_p, empty, s_p, 0)
        return acc, regs_p, regs_q, it

    @gluon.jit
    def _mainloop_row_scales(acc, regs, a_bufs, b_bufs, ready, empty, it, k_tiles, sa_rows, mask_m, sb_tile, cols,
                             stride_sak, stride_sbk, WG: gl.constexpr, STAGES: gl.constexpr):
        """B_ROW_SCALES (the wgrad's B, 1 x 128 groups along K: one scale per output column and
        K block; BLOCK_N = 128, not pipelined): per K block MMA into a fresh partial, wait,
        promote with the outer product ``sa[rows] x sb[cols]``. Both scale vectors of block kb+1
        (the column vector: 32 registers per thread) are loaded while block kb's MMA runs.

        ``sb_tile`` points at the tile's first column of K block 0; columns are unit-stride and
        padded to whole 128-column blocks by the launcher, so ``sb_tile + kb * stride_sbk + cols``
        is one scalar base plus per-thread constant offsets (no pointer or mask vectors, which
        cost 96 registers and spill) and a tile past N reads zeros of the padding."""
        sa = gl.load(sa_rows, mask=mask_m, other=0.0)
        sbv = gl.load(sb_tile + cols)
        for kb in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            part = _issue(a_bufs, b_bufs, s, regs, False, WG, 0)
            kn = gl.minimum(kb + 1, k_tiles - 1)
            next_sa = gl.load(sa_rows + kn * stride_sak, mask=mask_m, other=0.0)
            next_sbv = gl.load(sb_tile + kn * stride_sbk + cols)
            regs = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            mbarrier.arrive(empty.index(s), count=1)
            acc = acc + (regs * gl.expand_dims(sa, 1)) * gl.expand_dims(sbv, 0)
            sa = next_sa
            sbv = next_sbv
            it += 1
        return acc, it

    @gluon.jit
    def _col_scales(sb_bufs, s, LAYOUT: gl.constexpr, SUB: gl.constexpr):
        """Ring slot s's column scales of B columns [SUB*128, SUB*128+128) as a [1, 128] tensor in
        the partial's layout (each thread reads its 32 columns, 16 ld.shared.v2; the rows
        broadcast), loaded right before the promotion that uses them: no register holds them
        across an MMA."""
        buf = sb_bufs.index(s)
        if sb_bufs.type.shape[2] > SCALE_N:
            buf = buf.slice(SUB * SCALE_N, SCALE_N, dim=1)
        return buf.load(LAYOUT)

    @gluon.jit
    def _mainloop_row_scales_smem(acc0, acc1, regs, a_bufs, b_bufs, sb_bufs, ready, empty, it, k_tiles, sa_rows,
                                  mask_m, stride_sak, LAYOUT: gl.constexpr, WG: gl.constexpr, STAGES: gl.constexpr,
                                  N_SUB: gl.constexpr):
        """B_ROW_SCALES with the column scales staged through shared memory (the producer TMAs each
        K block's BLOCK_N scales into the ring slot with A and B): ``_mainloop``'s schedule, so
        BLOCK_N = 256 runs as two 128-column MMAs through one partial. The register path
        (``_mainloop_row_scales``) keeps two K blocks' column vectors (64 registers) live across
        the MMA, which leaves no room for a second accumulator; here they are read after the
        wait and dead after the promotion. The promotion is the same ``(partial * sa) * sb`` as
        there, so the result is bit-identical. The slot is released after its scales are read
        (``mbarrier.arrive`` releases the ld.shared before it)."""
        sa = gl.load(sa_rows, mask=mask_m, other=0.0)
        no_acc = k_tiles < 0  # runtime False: see _mainloop
        for kb in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            part = _issue(a_bufs, b_bufs, s, regs, False, WG, 0)
            next_sa = gl.load(sa_rows + gl.minimum(kb + 1, k_tiles - 1) * stride_sak, mask=mask_m, other=0.0)
            regs = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            sbv = _col_scales(sb_bufs, s, LAYOUT, 0)
            if N_SUB == 1:
                mbarrier.arrive(empty.index(s), count=1)
            acc0 = acc0 + (regs * gl.expand_dims(sa, 1)) * sbv
            if N_SUB == 2:
                acc0 = _pin(acc0)
                part = _issue(a_bufs, b_bufs, s, regs, no_acc, WG, 1)
                regs = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                sbv = _col_scales(sb_bufs, s, LAYOUT, 1)
                mbarrier.arrive(empty.index(s), count=1)
                acc1 = acc1 + (regs * gl.expand_dims(sa, 1)) * sbv
            sa = next_sa
            it += 1
        return acc0, acc1, it

    @gluon.jit
    def _retire_rows(acc, part, sa, sb_bufs, empty, s, LAYOUT: gl.constexpr, PENDING: gl.constexpr):
        """``_retire`` for per-row B scales: wait (at most PENDING MMAs left in flight), read the
        slot's column scales, release the slot, promote with ``sa x sb``."""
        done = warpgroup_mma_wait(num_outstanding=PENDING, deps=(part, ))
        sbv = _col_scales(sb_bufs, s, LAYOUT, 0)
        mbarrier.arrive(empty.index(s), count=1)
        acc = _pin(acc + (done * gl.expand_dims(sa, 1)) * sbv)
        return acc, done

    @gluon.jit
    def _mainloop_row_scales_pipelined(acc, regs_p, regs_q, a_bufs, b_bufs, sb_bufs, ready, empty, it, k_tiles,
                                       sa_rows, mask_m, stride_sak, LAYOUT: gl.constexpr, WG: gl.constexpr,
                                       STAGES: gl.constexpr):
        """B_ROW_SCALES, pipelined (configs ``...x``, BLOCK_N = 128): ``_mainloop_pipelined``'s P/Q
        schedule (block k+1's MMA is queued before block k is promoted) with the column scales
        read from the ring slot at the promotion (see ``_mainloop_row_scales_smem``): the three
        64 x 128 fp32 sets take 192 registers, which leaves no room for a held column vector.
        Each block's two row scales are loaded when its MMA is issued, one MMA ahead of use."""
        no_acc = k_tiles < 0
        sa_p = gl.load(sa_rows, mask=mask_m, other=0.0)
        s_p = it % STAGES
        mbarrier.wait(ready.index(s_p), (it // STAGES) & 1)
        p = _issue(a_bufs, b_bufs, s_p, regs_p, no_acc, WG, 0)
        it += 1
        for kb in range(1, k_tiles - 1, 2):
            # block kb -> Q; retire P (block kb - 1)
            sa_q = gl.load(sa_rows + kb * stride_sak, mask=mask_m, other=0.0)
            s_q = it % STAGES
            mbarrier.wait(ready.index(s_q), (it // STAGES) & 1)
            q = _issue(a_bufs, b_bufs, s_q, regs_q, no_acc, WG, 0)
            it += 1
            acc, regs_p = _retire_rows(acc, p, sa_p, sb_bufs, empty, s_p, LAYOUT, 1)
            # block kb + 1 -> P; retire Q (block kb)
            sa_p = gl.load(sa_rows + (kb + 1) * stride_sak, mask=mask_m, other=0.0)
            s_p = it % STAGES
            mbarrier.wait(ready.index(s_p), (it // STAGES) & 1)
            p = _issue(a_bufs, b_bufs, s_p, regs_p, no_acc, WG, 0)
            it += 1
            acc, regs_q = _retire_rows(acc, q, sa_q, sb_bufs, empty, s_q, LAYOUT, 1)
        if k_tiles % 2 == 0:  # one block left: it goes to Q
            sa_q = gl.load(sa_rows + (k_tiles - 1) * stride_sak, mask=mask_m, other=0.0)
            s_q = it % STAGES
            mbarrier.wait(ready.index(s_q), (it // STAGES) & 1)
            q = _issue(a_bufs, b_bufs, s_q, regs_q, no_acc, WG, 0)
            it += 1
            acc, regs_p = _retire_rows(acc, p, sa_p, sb_bufs, empty, s_p, LAYOUT, 1)
            acc, regs_q = _retire_rows(acc, q, sa_q, sb_bufs, empty, s_q, LAYOUT, 0)
        else:
            acc, regs_p = _retire_rows(acc, p, sa_p, sb_bufs, empty, s_p, LAYOUT, 0)
        return acc, regs_p, regs_q, it

    @gluon.jit
    def _mainloop_rows(acc0, acc1, a_bufs, b_bufs, sb_bufs, ready, empty, it, k_tiles, sa_rows, mask_m, sb_tile,
                       cols, stride_sak, stride_sbk, LAYOUT: gl.constexpr, WG: gl.constexpr, STAGES: gl.constexpr,
                       N_SUB: gl.constexpr, PIPELINE: gl.constexpr):
        """The B_ROW_SCALES main loop of one tile, for the dense and the variable-K kernel:
        ``sb_bufs`` None (BLOCK_N 128, not pipelined) -> the register path ``_mainloop_row_scales``
        (column scales from global memory at ``sb_tile + cols``, unit stride, padded to whole
        128-column blocks); else the shared-memory one, pipelined or not. Returns (acc0, acc1, it)."""
        regs = gl.zeros(acc0.shape, gl.float32, LAYOUT)  # per tile: not live across the epilogue
        if sb_bufs is None:
            gl.static_assert(N_SUB == 1 and not PIPELINE, "register column scales: BLOCK_N 128, not pipelined")
            acc0, it = _mainloop_row_scales(acc0, regs, a_bufs, b_bufs, ready, empty, it, k_tiles, sa_rows, mask_m,
                                            sb_tile, cols, stride_sak, stride_sbk, WG, STAGES)
        elif PIPELINE:
            gl.static_assert(N_SUB == 1, "pipelined partials: BLOCK_N 128")
            regs_q = gl.zeros(acc0.shape, gl.float32, LAYOUT)
            acc0, regs, regs_q, it = _mainloop_row_scales_pipelined(acc0, regs, regs_q, a_bufs, b_bufs, sb_bufs,
                                                                    ready, empty, it, k_tiles, sa_rows, mask_m,
                                                                    stride_sak, LAYOUT, WG, STAGES)
        else:
            acc0, acc1, it = _mainloop_row_scales_smem(acc0, acc1, regs, a_bufs, b_bufs, sb_bufs, ready, empty, it,
                                                       k_tiles, sa_rows, mask_m, stride_sak, LAYOUT, WG, STAGES,
                                                       N_SUB)
        return acc0, acc1, it

    @gluon.jit
    def _store_sub(c_desc, c_bufs, acc, off_m, off_n, st, WG: gl.constexpr, SUB: gl.constexpr,
                   C_BUFS: gl.constexpr):
        """acc (64 x 128 fp32) -> out dtype -> staging buffer -> TMA store; returns st + 1.

        ``st`` counts this warpgroup's stores; they rotate over its C_BUFS buffers, so the store
        that last read the buffer is C_BUFS stores old and waiting until at most C_BUFS - 1 are
        in flight frees it. The wait sits here, not after the store, so the store overlaps the
        next main loop."""
        c_buf = c_bufs.index(WG * C_BUFS + st % C_BUFS)
        tma.store_wait(pendings=C_BUFS - 1)
        c_buf.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n + SUB * SCALE_N], c_buf)
        return st + 1

    @gluon.jit
    def _consumer(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sa_ptr, sb_ptr, M, N, K,
                  stride_sam, stride_sak, stride_sbn, stride_sbk,
                  WG: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  C_BUFS: gl.constexpr, PIPELINE: gl.constexpr, B_ROW_SCALES: gl.constexpr, sb_bufs=None):
        """One warpgroup: rows [WG*64, WG*64+64) of every tile: MMA, promotion, store."""
        HALF_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        N_SUB: gl.constexpr = BLOCK_N // SCALE_N
        # wgmma m64n128k32 over the warpgroup's 64 rows: one instruction per 32 of K
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, SCALE_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        num_pid_m = gl.cdiv(M, 2 * HALF_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        num_tiles = num_pid_m * num_pid_n
        k_tiles = gl.cdiv(K, BLOCK_K)  # a K tail arrives zero-filled
        last_nb = gl.cdiv(N, SCALE_N) - 1
        it = 0
        st = 0
        for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * (2 * HALF_M) + WG * HALF_M
            off_n = pid_n * BLOCK_N
            offs_m = off_m + gl.arange(0, HALF_M, layout=row_layout)
            mask_m = offs_m < M
            sa_rows = sa_ptr + offs_m.to(gl.int64) * stride_sam
            # each 128 columns of the tile lie in one B scale block; a half past N (its columns
            # are zero-filled and never stored) reads the last block's scale instead
            sb0 = sb_ptr + (pid_n * N_SUB) * stride_sbn
            sb1 = sb_ptr + gl.minimum(pid_n * N_SUB + 1, last_nb) * stride_sbn
            acc0 = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
            acc1 = acc0
            if N_SUB == 2:
                acc1 = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
            # the partial's registers, handed to each MMA (which ignores their values); created per
            # tile so they are not live across the epilogue
            regs = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
            if B_ROW_SCALES:
                # per-row B scales: [ceil(K/128), N padded to 128] (stride_sbn is 1) read by the
                # consumers, or (sb_bufs) TMA'd into the ring by the producer
                cols = gl.arange(0, SCALE_N, layout=gl.SliceLayout(0, mma_layout))
                acc0, acc1, it = _mainloop_rows(acc0, acc1, a_bufs, b_bufs, sb_bufs, ready, empty, it, k_tiles,
                                                sa_rows, mask_m, sb_ptr + off_n, cols, stride_sak, stride_sbk,
                                                mma_layout, WG, STAGES, N_SUB, PIPELINE)
            elif PIPELINE:
                regs_q = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
                acc0, regs, regs_q, it = _mainloop_pipelined(acc0, regs, regs_q, a_bufs, b_bufs, ready, empty, it,
                                                             k_tiles, sa_rows, mask_m, sb0, stride_sak, stride_sbk,
                                                             WG, STAGES)
            else:
                acc0, acc1, it = _mainloop(acc0, acc1, regs, a_bufs, b_bufs, ready, empty, it, k_tiles,
                                           sa_rows, mask_m, sb0, sb1, stride_sak, stride_sbk, WG, STAGES, N_SUB)
            st = _store_sub(c_desc, c_bufs, acc0, off_m, off_n, st, WG, 0, C_BUFS)
            if N_SUB == 2:
                st = _store_sub(c_desc, c_bufs, acc1, off_m, off_n, st, WG, 1, C_BUFS)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm_fp8_blockwise_ws_kernel(
        a_desc, b_desc, c_desc,
        sa_ptr, sb_ptr,
        M, N, K,
        stride_sam, stride_sak, stride_sbn, stride_sbk,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, C_BUFS: gl.constexpr, PIPELINE: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, B_ROW_SCALES: gl.constexpr = False,
        sb_desc=None,
    ):
        """out = sum_kb (A_kb @ B_kb^T) * sa[:, kb] * sb[n/128, kb]: persistent, warp-specialized.

        Descriptors: a_desc boxes [64, 128] (a warpgroup's rows), b_desc [BLOCK_N, 128],
        c_desc [64, 128] (one warpgroup's rows of one 128-column scale block); with B_ROW_SCALES
        optionally sb_desc [1, BLOCK_N] over the [ceil(K/128), N] column-scale grid (the scales
        then travel through the ring; None: the consumers read them from sb_ptr)."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 * C_BUFS, HALF_M, SCALE_N], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the producer's expect + TMA bytes
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        # two spellings because warp_specialize's argument tuples cannot carry a None
        if sb_desc is None:
            gl.warp_specialize([
                (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sa_ptr, sb_ptr, M, N, K,
                             stride_sam, stride_sak, stride_sbn, stride_sbk, 0, BLOCK_N, GROUP_M, STAGES, C_BUFS,
                             PIPELINE, B_ROW_SCALES)),
                (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sa_ptr, sb_ptr, M, N, K,
                             stride_sam, stride_sak, stride_sbn, stride_sbk, 1, BLOCK_N, GROUP_M, STAGES, C_BUFS,
                             PIPELINE, B_ROW_SCALES)),
                (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_N, GROUP_M, STAGES)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.static_assert(B_ROW_SCALES, "sb_desc: per-row B scales only")
            sb_bufs = gl.allocate_shared_memory(sb_desc.dtype, [STAGES, 1, BLOCK_N], sb_desc.layout)
            gl.warp_specialize([
                (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sa_ptr, sb_ptr, M, N, K,
                             stride_sam, stride_sak, stride_sbn, stride_sbk, 0, BLOCK_N, GROUP_M, STAGES, C_BUFS,
                             PIPELINE, B_ROW_SCALES, sb_bufs)),
                (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sa_ptr, sb_ptr, M, N, K,
                             stride_sam, stride_sak, stride_sbn, stride_sbk, 1, BLOCK_N, GROUP_M, STAGES, C_BUFS,
                             PIPELINE, B_ROW_SCALES, sb_bufs)),
                (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_N, GROUP_M, STAGES, sb_desc,
                             sb_bufs)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HALF_M = 64


def _tma_rows_ok(t: torch.Tensor) -> bool:
    """TMA can address t [rows, cols] by rows: unit inner stride, 16-byte aligned base and rows."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def gluon_blockwise_reason(a, sa, b, sb, out: Optional[torch.Tensor] = None,
                           out_dtype: Optional[torch.dtype] = torch.bfloat16,
                           allow_b_row_scales: Optional[bool] = None) -> Optional[str]:
    """None when :func:`gemm_fp8_blockwise_gluon` can run these inputs, else why not. Never raises,
    never synchronizes: dtypes, shapes, strides and the (cached) platform of the device.

    ``allow_b_row_scales``: whether per-row B scales (``sb`` ``[N, ceil(K/128)]``, the FP8
    linear's wgrad) are taken; None reads ``PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD`` (auto: yes)."""
    return _device_reason(gluon_operand_reason, gluon_platform_reason,
                          (a, sa, b, sb, out, out_dtype, allow_b_row_scales))


def _device_reason(operand_reason, platform_reason, args: tuple) -> Optional[str]:
    """``operand_reason(*args)``, then ``platform_reason`` (the caller's module's
    :func:`gluon_platform_reason`, looked up there at call time) on the device of ``args[0]``; any
    exception becomes the reason (the ``*_reason`` contract of the Gluon GEMM kernels: never raises,
    never synchronizes). Shared by the dense, the M-grouped and the variable-K grouped kernels."""
    try:
        reason = operand_reason(*args)
        if reason is None:
            reason = platform_reason(args[0].device)
        return reason
    except Exception as exc:  # noqa: BLE001 - the contract is "never raises"
        return f"{type(exc).__name__}: {exc}"


def _grouped_launch_reason(a, n: int, group_offs, out, num_programs) -> Optional[str]:
    """What an M-grouped launcher needs beyond its operand checks (shared by the FP8 and 16-bit
    grouped kernels): the offsets themselves, a usable ``out`` of ``[M_total, n]``, ``num_programs``."""
    if group_offs is None:
        return "group_offs [G+1] on the device is needed"
    if out is not None:
        M = a.shape[0]
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != (M, n) or not out.is_contiguous()
                or out.device != a.device or out.data_ptr() % 16):
            return f"out must be a contiguous, 16-byte aligned [M_total, N] = {[M, n]} tensor on {a.device}"
    return _num_programs_reason(num_programs)


def _num_programs_reason(num_programs) -> Optional[str]:
    """None when ``num_programs`` (a cap on a persistent grid) is None or a positive int."""
    if num_programs is not None and (not isinstance(num_programs, int) or num_programs < 1):
        return f"num_programs must be a positive int, got {num_programs!r}"
    return None


def gluon_platform_reason(device: torch.device) -> Optional[str]:
    """None when Gluon kernels can run on ``device`` (CUDA sm_90, Gluon importable, not under
    the Triton interpreter), else why not. Cached per (device, TRITON_INTERPRET)."""
    if device.type != "cuda":
        return f"tensors on {device}; the Gluon kernel needs a CUDA sm_90 (Hopper) GPU"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _platform_reason(index, os.environ.get("TRITON_INTERPRET") == "1")


@functools.lru_cache(maxsize=None)
def _platform_reason(index: int, interpret: bool) -> Optional[str]:
    if not GLUON_AVAILABLE:
        return f"triton.experimental.gluon is not importable ({_GLUON_IMPORT_ERROR})"
    if interpret:
        return "TRITON_INTERPRET=1: Gluon kernels do not run in the Triton interpreter"
    cap = _capability(index)
    if cap != (9, 0):
        return f"the Gluon kernel is built for sm_90 (H100/H200), this GPU is sm_{cap[0]}{cap[1]}"
    return None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def wgrad_enabled() -> bool:
    """``PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD``: 1 and auto take per-row B scales (the wgrad), 0 does
    not. Auto is on since the H200 measurement (2026-11-30): 55.6 dB like the tl kernel, 1.06x it
    alone and the BLOCKWISE FP8 linear step (Llama-3.1-8B gate_up, M 16384) 16.24 -> 13.53 ms."""
    from primus_turbo.pytorch.core.env import env_auto_flag

    return env_auto_flag(WGRAD_ENV) is not False


def _is_b_row_scales(sb, N: int, K: int) -> bool:
    """sb is one scale per row of b and K block ([N, ceil(K/128)]) rather than per 128 x 128
    block. N = 1 reads as blocks (the same numbers either way)."""
    kb = -(-K // SCALE_BLOCK)
    return N > 1 and sb.dim() == 2 and tuple(sb.shape) == (N, kb) and -(-N // SCALE_BLOCK) != N


def gluon_operand_reason(a, sa, b, sb, out: Optional[torch.Tensor] = None,
                         out_dtype: Optional[torch.dtype] = torch.bfloat16,
                         allow_b_row_scales: Optional[bool] = None) -> Optional[str]:
    """The operand half of :func:`gluon_blockwise_reason` (no device or platform test, so it is
    checkable on CPU): None when the dtypes, shapes and strides are ones the kernel takes."""
    if not GLUON_AVAILABLE:
        return f"triton.experimental.gluon is not importable ({_GLUON_IMPORT_ERROR})"
    for name, t in (("a", a), ("sa", sa), ("b", b), ("sb", sb)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            return f"{name} must be 2-D, got shape {tuple(t.shape)}"
        if t.dtype != torch.float8_e4m3fn:
            return f"{name}.dtype={t.dtype}; the Gluon kernel takes float8_e4m3fn only"
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K:
        return f"K mismatch: a is [M, K] = {list(a.shape)}, b is [N, K] = {list(b.shape)}"
    dev = a.device
    if sa.device != dev or b.device != dev or sb.device != dev or (out is not None and getattr(out, "device", dev) != dev):
        devices = {t.device for t in (a, sa, b, sb) + ((out,) if isinstance(out, torch.Tensor) else ())}
        return f"tensors on several devices: {sorted(str(d) for d in devices)}"
    kb = -(-K // SCALE_BLOCK)
    if sa.dtype != torch.float32 or sa.dim() != 2 or tuple(sa.shape) != (M, kb):
        return (f"sa must be float32 [M, ceil(K/128)] = {[M, kb]} (1x128 groups), "
                f"got {sa.dtype} {list(sa.shape)}")
    nb = -(-N // SCALE_BLOCK)
    if sb.dtype == torch.float32 and _is_b_row_scales(sb, N, K):
        if not (wgrad_enabled() if allow_b_row_scales is None else allow_b_row_scales):
            return (f"sb {list(sb.shape)} is per-row (1x128 groups of b along K: the wgrad); the Gluon kernel "
                    f"takes sb as [ceil(N/128), ceil(K/128)] = {[nb, kb]} (128x128 blocks), and per-row scales "
                    f"not with {WGRAD_ENV}=0")
    elif sb.dtype != torch.float32 or sb.dim() != 2 or tuple(sb.shape) != (nb, kb):
        return (f"sb must be float32 [ceil(N/128), ceil(K/128)] = {[nb, kb]} (128x128 blocks), "
                f"got {sb.dtype} {list(sb.shape)}")
    for name, t in (("a", a), ("b", b)):
        if t.numel() and not _tma_rows_ok(t):
            return (f"{name} must be K-contiguous with 16-byte aligned base and rows for TMA "
                    f"(strides {tuple(t.stride())}, K={K})")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            return f"out must be a torch.Tensor, got {type(out).__name__}"
        if tuple(out.shape) != (M, N):
            return f"out has shape {tuple(out.shape)}, expected {(M, N)}"
        dtype = out.dtype
        if out.numel() and not _tma_rows_ok(out):
            return f"out must be row-contiguous with 16-byte aligned base and rows (strides {tuple(out.stride())})"
    else:
        dtype = out_dtype if out_dtype is not None else torch.bfloat16
    if dtype not in _OUT_DTYPES:
        return f"output dtype {dtype} is not one of bfloat16, float16, float32"
    if out is None and (N * dtype.itemsize) % 16:
        return f"out rows of N={N} {dtype} elements are not 16-byte aligned for the TMA store"
    return None


def default_config(M: int, N: int, K: int, out_dtype: torch.dtype = torch.bfloat16,
                   b_row_scales: bool = False) -> GluonBlockwiseConfig:
    """DEFAULT_CONFIG (``b_row_scales``: ROW_SCALES_DEFAULT_CONFIG), shrunk until it fits next to
    the output staging buffers: first one staging buffer per warpgroup, then fewer stages (fp32
    output: n256s3 with one buffer; per-row B scales: n256s3c2, n256s3 with an fp32 output)."""
    del M, N, K
    return _fitted_default(out_dtype, bool(b_row_scales))


@functools.lru_cache(maxsize=None)
def _fitted_default(out_dtype: torch.dtype, b_row_scales: bool = False) -> GluonBlockwiseConfig:
    out_bytes = out_dtype.itemsize
    cfg = ROW_SCALES_DEFAULT_CONFIG if b_row_scales else DEFAULT_CONFIG
    if cfg.smem_bytes(out_bytes, b_row_scales) > SMEM_LIMIT and cfg.c_bufs > 1:
        cfg = dataclasses.replace(cfg, c_bufs=1)
    while cfg.smem_bytes(out_bytes, b_row_scales) > SMEM_LIMIT and cfg.stages > 2:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


_NUM_SMS: dict = {}


def _launch_persistent(kernel, device: torch.device, tiles: int, num_programs: Optional[int], args: tuple,
                       kwargs: dict) -> None:
    """Launches ``kernel`` on ``device`` as a persistent grid: one program per SM (at most
    ``num_programs``, when given), no more than ``tiles``."""
    launch(kernel, (min(num_programs or _num_sms(device), tiles),), args, kwargs, device)


def _launch_persistent_prepared(kernel, device: torch.device, tiles: int, num_programs: Optional[int], args_fn,
                                kwargs: dict, key, ptrs) -> None:
    """:func:`_launch_persistent` through ``launch.launch_prepared``: ``args_fn()`` builds the
    arguments (on a miss only), ``key`` fixes everything of them but the data pointers ``ptrs``."""
    launch_prepared(kernel, (min(num_programs or _num_sms(device), tiles),), args_fn, kwargs, device, key, ptrs)


def _launch_kwargs(cfg: "GluonBlockwiseConfig", **extra) -> dict:
    """The launch keywords every Gluon GEMM kernel takes from ``cfg`` (and 4 warps), plus ``extra``."""
    return dict(GROUP_M=cfg.group_m, STAGES=cfg.stages, C_BUFS=cfg.c_bufs, PIPELINE=cfg.pipeline,
                CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, num_warps=4, **extra)


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def gemm_fp8_blockwise_gluon(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                             out: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                             config: Optional[GluonBlockwiseConfig] = None,
                             allow_b_row_scales: Optional[bool] = None) -> torch.Tensor:
    """``out = (a * sa) @ (b * sb)^T`` for BLOCKWISE-quantized FP8 operands on Hopper.

    Args:
        a: ``[M, K]`` float8_e4m3fn, K contiguous (the activation).
        sa: ``[M, ceil(K/128)]`` float32 dequantization multipliers of a's 1 x 128 groups.
        b: ``[N, K]`` float8_e4m3fn, K contiguous (the weight).
        sb: ``[ceil(N/128), ceil(K/128)]`` float32 multipliers of b's 128 x 128 blocks, or, where
            per-row B scales are allowed, ``[N, ceil(K/128)]``: b's 1 x 128 groups (the wgrad).
        out: ``[M, N]`` bf16/fp16/fp32, rows contiguous and 16-byte aligned; allocated when None.
        out_dtype: dtype of the allocated ``out`` (ignored when ``out`` is given).
        config: tile/pipeline choice (:class:`GluonBlockwiseConfig`); analytic default when None.
        allow_b_row_scales: take per-row ``sb`` (the B_ROW_SCALES path); None reads
            ``PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD`` (auto: on).

    Raises ValueError with :func:`gluon_blockwise_reason`'s text when the inputs are not
    supported (callers check first and fall back to ``gemm_fp8_triton``).

    Example::

        >>> a_q, sa = turbo.ops.quantize_fp8(x, torch.float8_e4m3fn, "BLOCKWISE")       # 1 x 128
        >>> b_q, sb = turbo.ops.quantize_fp8(w, torch.float8_e4m3fn, "BLOCKWISE",
        ...                                  scaling_recipe=ScalingRecipe(use_2d_block=True))  # 128 x 128
        >>> y = gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb)  # [M, N] bf16
    """
    if out is not None:
        out_dtype = out.dtype
    reason = gluon_blockwise_reason(a, sa, b, sb, out, out_dtype, allow_b_row_scales)
    if reason is not None:
        raise ValueError(f"gemm_fp8_blockwise_gluon: {reason}")
    return _gemm_checked(a, sa, b, sb, out, out_dtype, config)


def gemm_fp8_blockwise_gluon_prechecked(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                                        out: Optional[torch.Tensor] = None,
                                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """:func:`gemm_fp8_blockwise_gluon` with the default config and per-row B scales as the
    environment says, for a caller that has just run :func:`gluon_blockwise_reason` on these very
    arguments and got None (the FP8 dispatcher's check): the check is not repeated per call."""
    return _gemm_checked(a, sa, b, sb, out, out.dtype if out is not None else out_dtype, None)


def _gemm_checked(a, sa, b, sb, out, out_dtype, config) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    rows = _is_b_row_scales(sb, N, K)
    cfg = config or default_config(M, N, K, out.dtype, rows)
    bad = cfg.check(out.element_size(), rows)
    if bad is not None:
        raise ValueError(f"gemm_fp8_blockwise_gluon: {bad}")
    # no torch.cuda.device() context: launch() launches on a.device's index itself (a context
    # switch per call was host time)
    _launch(a, sa, b, sb, out, cfg)
    return out


_GL_DTYPES = {}
if GLUON_AVAILABLE:
    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
                  torch.float8_e4m3fn: gl.float8e4nv}


def row_scales_via_smem(cfg: "GluonBlockwiseConfig") -> bool:
    """Whether the B_ROW_SCALES path of ``cfg`` stages the column scales through shared memory
    (TMA'd with each K block: BLOCK_N 256 or pipelined, which have no registers to hold them)
    rather than the consumers' registers (BLOCK_N 128, not pipelined)."""
    return cfg.block_n > SCALE_BLOCK or cfg.pipeline


def _sb_layout():
    """Shared layout of the [1, BLOCK_N] fp32 column-scale box: unswizzled, so each thread's
    column pair is one 8-byte ld.shared."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _scale_grid_desc(s_t: torch.Tensor, block_n: int):
    """TMA descriptor of a per-row B scale grid ``s_t`` ``[K blocks, N]`` fp32 (unit stride along
    N), box [1, block_n]; a copy where TMA cannot address it (16-byte aligned base and row
    stride). The true N is the global extent: columns past it arrive as zeros."""
    if not (s_t.stride(1) == 1 and (s_t.stride(0) * 4) % 16 == 0 and s_t.data_ptr() % 16 == 0):
        kb, n = s_t.shape
        buf = torch.zeros((kb, -(-n // 4) * 4), dtype=torch.float32, device=s_t.device)
        buf[:, :n].copy_(s_t)
        s_t = buf[:, :n]
    return TensorDescriptor(s_t, list(s_t.shape), [s_t.stride(0), 1], [1, block_n], _sb_layout())


def _desc_unchecked(t: torch.Tensor, shape: list, strides: list, block: list, layout):
    """A host TMA descriptor built without ``TensorDescriptor``'s own validation, for operands a
    ``*_reason`` check has already accepted (16-byte aligned base and strides, unit last stride,
    positive sizes): a few microseconds per descriptor on the launch path of small GEMMs."""
    d = TensorDescriptor.__new__(TensorDescriptor)
    d.__dict__.update(base=t, shape=shape, strides=strides, block_shape=block, layout=layout, padding="zero")
    return d


@functools.lru_cache(maxsize=None)
def _layouts(block_n: int, out_dtype: torch.dtype) -> tuple:
    """Shared-memory layouts of the A, B and C boxes (128-byte swizzle: whole wgmma/TMA rows)."""
    return (gl.NVMMASharedLayout.get_default_for([_HALF_M, SCALE_BLOCK], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([block_n, SCALE_BLOCK], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([_HALF_M, SCALE_BLOCK], _GL_DTYPES[out_dtype]))


def _kernel_args(a, sa, b, sb, out, cfg: GluonBlockwiseConfig) -> tuple:
    """(positional args, keyword args) of the kernel launch for validated, non-empty inputs."""
    M, K = a.shape
    N = b.shape[0]
    bn, bk = cfg.block_n, cfg.BLOCK_K
    a_layout, b_layout, c_layout = _layouts(bn, out.dtype)
    # the descriptors' global shapes are the true [M, K], [N, K], [M, N]: TMA zero-fills loads past
    # them (M, N and K tails) and clips stores
    a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [_HALF_M, bk], a_layout)
    b_desc = TensorDescriptor(b, [N, K], [b.stride(0), 1], [bn, bk], b_layout)
    c_desc = TensorDescriptor(out, [M, N], [out.stride(0), 1], [_HALF_M, SCALE_BLOCK], c_layout)
    rows = _is_b_row_scales(sb, N, K)
    sb_desc = None
    if rows and row_scales_via_smem(cfg):
        sb_desc = _scale_grid_desc(sb.t(), bn)  # the kernel reads sb only through the descriptor
    elif rows:
        sb = _column_major_padded(sb)
    args = (a_desc, b_desc, c_desc, sa, sb, M, N, K, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    kwargs = _launch_kwargs(cfg, B_ROW_SCALES=rows)
    if sb_desc is not None:
        kwargs["sb_desc"] = sb_desc
    return args, kwargs


def _column_major_padded(sb: torch.Tensor) -> torch.Tensor:
    """Per-row B scales [N, kb] as the B_ROW_SCALES path reads them: unit stride along N and N
    padded with zeros to whole 128-column blocks (a view of a [kb, N_pad] buffer). Returned as
    is when already so (e.g. the transpose of a [kb, N] scale grid with N % 128 == 0); else one
    small copy (N x kb x 4 bytes, no host sync)."""
    N, kb = sb.shape
    if sb.stride(0) == 1 and N % SCALE_BLOCK == 0:
        return sb
    n_pad = -(-N // SCALE_BLOCK) * SCALE_BLOCK
    buf = torch.zeros((kb, n_pad), dtype=sb.dtype, device=sb.device)
    buf[:, :N].copy_(sb.t())
    return buf.t()[:N]


def _prepared_key(a, sa, b, sb, out, cfg: GluonBlockwiseConfig, rows: bool) -> "Optional[tuple]":
    """(key, pointers) of :func:`_launch`'s prepared launch (triton/launch.launch_prepared), or
    None where :func:`_kernel_args` would copy a scale tensor or pass the keyword descriptor
    ``sb_desc`` (per-row B scales not yet column-major, or staged through shared memory): there
    the argument list is not a function of (key, pointers). The key fixes the shapes, strides,
    dtypes and 16-byte alignment of every tensor and the config; the pointers are those of every
    tensor and descriptor base among the arguments. Block scales (the forward and dgrad) always
    qualify; per-row scales (the wgrad) when column-major, N a multiple of 128 and read from
    registers. ``rows``: :func:`_is_b_row_scales` of these operands."""
    N = b.shape[0]
    if rows and (row_scales_via_smem(cfg) or sb.stride(0) != 1 or N % SCALE_BLOCK):
        return None
    sig = tensor_sig
    key = ("f8dense", sig(a), sig(sa), sig(b), sig(sb), sig(out), cfg)
    return key, (a.data_ptr(), sa.data_ptr(), b.data_ptr(), sb.data_ptr(), out.data_ptr())


def _launch(a, sa, b, sb, out, cfg: GluonBlockwiseConfig) -> None:
    M, N = out.shape
    tiles = -(-M // cfg.BLOCK_M) * -(-N // cfg.block_n)
    rows = _is_b_row_scales(sb, N, a.shape[1])
    prepared = _prepared_key(a, sa, b, sb, out, cfg, rows)
    if prepared is not None:
        # a repeat call with the same shapes and pointers (a steady training step) skips building
        # the three descriptors, re-keying the launch and encoding the TMA maps
        _launch_persistent_prepared(_gemm_fp8_blockwise_ws_kernel, a.device, tiles, None,
                                    lambda: _kernel_args(a, sa, b, sb, out, cfg)[0],
                                    _launch_kwargs(cfg, B_ROW_SCALES=rows),
                                    *prepared)
        return
    args, kwargs = _kernel_args(a, sa, b, sb, out, cfg)
    grid = (min(_num_sms(a.device), tiles),)  # persistent: at most one CTA per SM
    launch(_gemm_fp8_blockwise_ws_kernel, grid, args, kwargs, a.device)
