"""Hopper (sm_90) Gluon kernel for the 16-bit (bf16 / fp16) M-grouped GEMM of MoE experts.

``out[offs[g]:offs[g+1]] = a[rows of g] @ B[g]`` and ``out[offs[G]:] = 0``: ``a [M_total, K]``
(K contiguous), ``B`` the logical ``[G, K, N]`` weight stored either N-major (``b [G, K, N]``, the
``trans_b=False`` layout, taken by wgmma straight from shared memory) or K-major (``b [G, N, K]``,
``trans_b=True``, and the dgrad's transposed view of a ``[G, K, N]`` weight), ``group_offs [G+1]``
int64 on the device. fp32 accumulation in the tensor cores; the same product as
``_grouped_gemm_kernel`` (grouped_gemm_kernel.py, the ``triton.language`` kernel), only the
summation order differs.

Structure: the FP8 grouped Gluon kernel's (grouped_gemm_fp8_gluon.py: persistent grid, device-side
tile schedule walking ``group_offs``, one TMA producer warp, two consumer warpgroups of 64 rows,
the pseudo-group ``g == G`` zeroing the rows past ``offs[G]``, masked pointer stores for a
warpgroup half that reaches past its group's end) without scales:

* the producer loads per K block (BLOCK_K 64: one 128-byte swizzle row of 16-bit elements) the
  two 64-row A halves and B's ``[BLOCK_K, BLOCK_N]`` (N-major) or ``[BLOCK_N, BLOCK_K]`` (K-major)
  box of expert g through a 3-D descriptor of ``b``, so K and N tails are zero-filled per expert;
* each consumer warpgroup accumulates ``warpgroup_mma`` (m64 x BLOCK_N x 16) asynchronously into
  one fp32 accumulator, keeping one MMA in flight (``warpgroup_mma_wait(1)``) and releasing the
  ring slot of the MMA before;
* epilogue: the accumulator in EPI_N-column pieces (a register-only split of the wgmma layout)
  through shared memory and TMA stores (clipped at N), or masked pointer stores for the group's
  last rows, so no tile writes into the next group's rows.

Requirements (:func:`gluon_grouped_reason`): sm_90, Gluon importable, bf16 or fp16 ``a`` and ``b``
of one dtype, ``a`` K-contiguous, ``b`` with a unit stride on K or N, 16-byte aligned bases and
strides (so K and N multiples of 8), ``group_offs`` int64 ``[G+1]``, an output of the operands'
dtype (or fp32) with 16-byte aligned rows. Offsets are clamped to ``[0, M_total]`` and made
non-decreasing on the device as the tl kernel does.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional

import torch

from primus_turbo.triton.gemm import gemm_fp8_gluon as _dense
from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, gluon_platform_reason
from primus_turbo.triton import launch as _launch
from primus_turbo.triton.launch import launch, launch_keyed, launch_prepared, tensor_sig

__all__ = [
    "GLUON_GROUPED_ENV",
    "GROUPED16_DEFAULT_CONFIG",
    "GROUPED16_SMALL_GROUPS_CONFIG",
    "GluonGroupedConfig",
    "default_grouped16_config",
    "gluon_grouped_enabled",
    "gluon_grouped_operand_reason",
    "gluon_grouped_reason",
    "grouped_gemm_gluon",
]

GLUON_GROUPED_ENV = "PRIMUS_TURBO_GROUPED_GEMM_GLUON"
#: the default config's pacing distance (see pace_default)
PACE_ENV = "PRIMUS_TURBO_GROUPED_GEMM_PACE"
_PACE_VALUES = frozenset(str(d) for d in range(9))
_IN_DTYPES = (torch.bfloat16, torch.float16)
_HALF_M = 64


@dataclasses.dataclass(frozen=True)
class GluonGroupedConfig:
    """Tile and pipeline shape of the 16-bit grouped Gluon kernels. BLOCK_M is 128 (two consumer
    warpgroups of 64 rows; in the variable-K kernel, 128 rows of P); ``block_k`` 64 is one
    128-byte swizzle row; ``epi_n`` the columns of one output staging buffer / TMA store (a
    divisor of ``block_n``); ``c_bufs`` staging buffers per warpgroup; ``consumer_regs`` /
    ``producer_regs`` the setmaxnreg budgets (2 x 128 x consumer + 128 x producer <= 65536)."""

    block_n: int = 256
    block_k: int = 64
    stages: int = 4
    group_m: int = 8
    epi_n: int = 128
    c_bufs: int = 1
    consumer_regs: int = 232
    producer_regs: int = 40
    pace: int = 0

    BLOCK_M = 128

    def smem_bytes(self, out_bytes: int = 2, in_bytes: int = 2) -> int:
        stage = (self.BLOCK_M + self.block_n) * self.block_k * in_bytes
        staging = 2 * self.c_bufs * _HALF_M * self.epi_n * out_bytes
        return _dense._ring_smem_bytes(self.stages, stage, staging)

    def short(self) -> str:
        pace = f"p{self.pace}" if self.pace else ""
        return (f"n{self.block_n}k{self.block_k}s{self.stages}g{self.group_m}e{self.epi_n}c{self.c_bufs}"
                f"r{self.consumer_regs}w{self.producer_regs}{pace}")

    @classmethod
    def parse(cls, text: str) -> "GluonGroupedConfig":
        """``"n256s4"``, ``"n128k64s6"``, ``"n256s3e256"``, ``"n256s4g16e64c2r240w24"``, ``"n256s3e256p2"``
        -> config (n: BLOCK_N, k: BLOCK_K, s: stages, g: GROUP_M, e: EPI_N, c: staging buffers, r / w:
        consumer / producer registers, p: pacing distance, see :func:`_pace`); omitted fields take
        the defaults, ``e`` min(128, n)."""
        m = re.fullmatch(r"n(\d+)(?:k(\d+))?s(\d+)(?:g(\d+))?(?:e(\d+))?(?:c(\d+))?(?:r(\d+))?(?:w(\d+))?"
                         r"(?:p(\d+))?", text.strip())
        if not m:
            raise ValueError(f"bad Gluon grouped config {text!r}; expected e.g. n256s4, n128k64s6, n256s3e256")
        bn, bk, st, g, e, c, r, w, p = m.groups()
        bn = int(bn)
        return cls(bn, int(bk or 64), int(st), int(g or 8), int(e or min(128, bn)), int(c or 1), int(r or 232),
                   int(w or 40), int(p or 0))

    def check(self, out_bytes: int = 2) -> Optional[str]:
        """None when the kernels can be built with this config for an output of ``out_bytes``."""
        if self.block_n not in (64, 128, 256) or self.block_k not in (32, 64):
            return f"block_n must be 64, 128 or 256 and block_k 32 or 64, got {self.block_n}, {self.block_k}"
        if self.epi_n not in (64, 128, 256) or self.epi_n > self.block_n:
            return f"epi_n must be 64, 128 or 256 and at most block_n, got {self.epi_n}"
        bad = _dense._pipeline_reason(self)
        if bad is not None:
            return bad
        if not 0 <= self.pace <= 8:
            return f"pace must be 0 (off) to 8 tiles, got {self.pace}"
        if self.smem_bytes(out_bytes) > _dense.SMEM_LIMIT:
            return f"config {self.short()} needs {self.smem_bytes(out_bytes)} bytes of shared memory, sm_90 has " \
                   f"{_dense.SMEM_LIMIT}"
        return None


# n256k64s3e256: 128 x 256 tiles (each consumer warpgroup one m64n256 accumulator, 128 registers), 3
# stages of 48 KiB, the epilogue in one 256-column piece per warpgroup. H200 (scripts/check_gluon_grouped.py,
# DeepSeek-V3 / Qwen3-30B-A3B EP8, balanced and unbalanced, session 6): geomean over the 8 cases 0.923x
# torch._grouped_mm forward, 0.848 dgrad, 1.096 wgrad, 1.359 wgrad into fp32 main_grad (0.934 fwd+bwd);
# 1.31 / 1.25 / 1.31x our tl kernel. n256k64s4 (two 128-column pieces) measured 0.915 / 0.807 / 1.055,
# n128k64s6 0.882 / 0.848 / 0.995.
GROUPED16_DEFAULT_CONFIG = GluonGroupedConfig(block_n=256, block_k=64, stages=3, group_m=8, epi_n=256, c_bufs=1)
# Many small groups: 128 x 128 tiles. With 128 x 256 tiles, where an average group has at most half a
# wave of tiles (so the grid works on two or more experts at once), the kernel ran at the same speed on
# half the SMs as on all of them, and an L2-resident weight (every expert reading one) did not help: a
# shared bound that grows with the experts in flight, not weight bandwidth or the tensor cores. H200
# (session 8, scripts/diag_grouped_small.py), ms torch._grouped_mm / 128 x 256 / n128k64s5: DeepSeek-V3
# EP4 (64 experts x 512 rows) gate_up forward 2.60 / 4.25 / 2.60, down dgrad 1.33 / 4.16 / 2.14;
# Qwen3-30B-A3B with all 128 experts (x 1024 rows) gate_up 1.21 / 2.69 / 1.34, down 0.74 / 1.11 / 0.66, gate_up
# dgrad 1.18 / 2.13 / 1.20, down dgrad (N 768) 0.66 / 2.69 / 1.37. Above half a wave per group 128 x 256
# stays ahead: EP4 down forward (112 tiles per group) 1.42 / 1.49 / 1.62, 1024 rows per group (128
# tiles) 5.63 / 5.57 / 5.83, EP4 gate_up dgrad (112 tiles) 2.85 / 3.31 / 3.07.
GROUPED16_SMALL_GROUPS_CONFIG = GluonGroupedConfig(block_n=128, block_k=64, stages=5, group_m=8, epi_n=128, c_bufs=1)
# the configs scripts/check_gluon_grouped.py times by default (the default first)
GROUPED16_CANDIDATES = ("n256k64s3e256", "n256k64s4", "n128k64s6", "n128k64s5")


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

    from primus_turbo.triton.gemm.gemm_fp8_gluon import _tile_coords
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_gluon import _group_rows

    #: a paced wait gives up after this many reads of the counter and releases every waiter (_pace)
    PACE_MAX_POLLS = gl.constexpr(4096)
    #: what a released counter jumps by: above any launch's tile count
    PACE_RELEASE = gl.constexpr(1 << 28)

    @gluon.jit
    def _load_stage16(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, a0, a1, b0, b1, b2,
                      STAGES: gl.constexpr):
        """One K block into ring slot ``it % STAGES``: the two A halves (coordinates ``a0`` and
        ``a1``, each a 2-element list) and B's box at [b0, b1, b2] of its 3-D descriptor, under
        the slot's ready barrier (expect: the full boxes; TMA counts zero-filled bytes too)."""
        STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
        s = it % STAGES
        # empty barriers start "one phase behind": the first pass over the ring never waits
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, STAGE_BYTES)
        tma.async_copy_global_to_shared(a_desc, a0, bar, a_bufs.index(2 * s))
        tma.async_copy_global_to_shared(a_desc, a1, bar, a_bufs.index(2 * s + 1))
        tma.async_copy_global_to_shared(b_desc, [b0, b1, b2], bar, b_bufs.index(s))
        return it + 1

    @gluon.jit
    def _group_tiles(offs_ptr, g, G, M, num_pid_n, tile_base, ROWS: gl.constexpr):
        """Group g's rows [m_start, m_end), its row tiles, its tile count and the first of them this
        program takes (tile t of g is global tile tile_base + t, taken by program (tile_base + t)
        % num_programs): the device-side schedule of the tl grouped kernels."""
        num_programs = gl.num_programs(0)
        m_start, m_end = _group_rows(offs_ptr, g, G, M)
        num_pid_m = gl.cdiv(m_end - m_start, ROWS)
        first = (gl.program_id(0) - tile_base % num_programs + num_programs) % num_programs
        return m_start, m_end, num_pid_m, num_pid_m * num_pid_n, first

    @gluon.jit
    def _pace(pace_ptr, j, PACE: gl.constexpr):
        """Opt-in pacing (PACE >= 1): before this program's j-th tile (0-based; its global tile
        index is program_id + j * num_programs), wait until every program has started its
        (j - PACE)-th tile, then count this start. Keeps the persistent programs within PACE tiles
        of each other, so the tiles in flight stay the few consecutive ones of the schedule that
        share weight stripes and activation rows in L2. Every program has a (j - PACE)-th tile when
        it has a j-th one (PACE >= 1, round-robin deal), and the waits end when all programs are
        resident at once: the paced launch has at most one program per SM (the launcher caps the
        grid) and each program needs most of an SM's shared memory. Other work on the GPU (another
        stream's kernel holding SMs) can delay a program's start, so a wait gives up after
        PACE_MAX_POLLS reads (~4 ms, about a hundred tiles' time) and releases every waiter of this
        launch (the counter jumps by PACE_RELEASE): never a hang, at worst one stall per launch.

        No value crosses lanes through shared memory: the counter is read by a volatile load in
        every lane and bumped by atomics whose results are unused."""
        if j >= PACE:
            target = (j - PACE + 1) * gl.num_programs(0)
            polls = 0
            while (gl.load(pace_ptr, volatile=True) < target) & (polls < PACE_MAX_POLLS):
                polls += 1
            if polls >= PACE_MAX_POLLS:
                gl.atomic_add(pace_ptr, PACE_RELEASE, sem="relaxed")
        gl.atomic_add(pace_ptr, 1, sem="relaxed")
        return j + 1

    @gluon.jit
    def _m_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, pace_ptr, M, N, K, G,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr, PACE: gl.constexpr):
        """One warp: the TMA loads of every tile of every real group (the tail needs none)."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KMAJOR else b_desc.block_type.shape[2]
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        it = 0
        tile_base = 0
        j = 0
        for g in range(G):
            m_start, m_end, num_pid_m, tiles_g, first = _group_tiles(offs_ptr, g, G, M, num_pid_n, tile_base,
                                                                     2 * HALF_M)
            for i in range(gl.cdiv(tiles_g - first, gl.num_programs(0))):  # grouped_gemm_kernel: why not range(first, ...)
                t = first + i * gl.num_programs(0)
                if PACE > 0:
                    j = _pace(pace_ptr, j, PACE)
                pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
                off_m = m_start + pid_m * (2 * HALF_M)
                off_n = pid_n * BLOCK_N
                for kk in range(k_tiles):
                    k = kk * BLOCK_K
                    if B_KMAJOR:  # b [G, N, K]: box [1, BLOCK_N, BLOCK_K]
                        it = _load_stage16(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, [off_m, k],
                                           [off_m + HALF_M, k], g, off_n, k, STAGES)
                    else:  # b [G, K, N]: box [1, BLOCK_K, BLOCK_N]
                        it = _load_stage16(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, [off_m, k],
                                           [off_m + HALF_M, k], g, k, off_n, STAGES)
            tile_base += tiles_g

    @gluon.jit
    def _b_operand(b_bufs, s, B_KMAJOR: gl.constexpr):
        """Ring slot s's B as the wgmma's [BLOCK_K, BLOCK_N] operand (a view: a K-major box is
        read transposed, an N-major one as is)."""
        buf = b_bufs.index(s)  # [1, rows, cols], the 3-D box
        buf = buf.reshape([buf.type.shape[1], buf.type.shape[2]])
        if B_KMAJOR:
            op = buf.permute((1, 0))
        else:
            op = buf
        return op

    @gluon.jit
    def _a_operand(a_bufs, s, WG: gl.constexpr, A_KMAJOR: gl.constexpr):
        """Ring slot s's A half of warpgroup WG as the wgmma's [64, BLOCK_K] operand (a view; an
        M-major box, the variable-K kernel's token-major x, is read transposed)."""
        buf = a_bufs.index(2 * s + WG)
        if A_KMAJOR:
            op = buf
        else:
            op = buf.permute((1, 0))
        return op

    @gluon.jit
    def _mma_block(acc, a_bufs, b_bufs, ready, empty, it, first_block, WG: gl.constexpr, STAGES: gl.constexpr,
                   A_KMAJOR: gl.constexpr, B_KMAJOR: gl.constexpr):
        """Issue the MMA of ring position ``it`` (its data ready) into ``acc``, keep it in flight
        and retire the one before (``warpgroup_mma_wait(1)``), releasing that one's slot (none
        before a tile's first block). Returns (acc, it + 1)."""
        s = it % STAGES
        acc = warpgroup_mma(_a_operand(a_bufs, s, WG, A_KMAJOR), _b_operand(b_bufs, s, B_KMAJOR), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if not first_block:
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        return acc, it + 1

    @gluon.jit
    def _mma_drain(acc, empty, it, STAGES: gl.constexpr):
        """Wait for the tile's last MMA and release its slot (``it``: past it)."""
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        return acc

    @gluon.jit
    def _mainloop16(acc, a_bufs, b_bufs, ready, empty, it, k_tiles, WG: gl.constexpr, STAGES: gl.constexpr,
                    A_KMAJOR: gl.constexpr, B_KMAJOR: gl.constexpr):
        """k_tiles (>= 1) K blocks accumulated into acc by the tensor cores. Returns (acc, it)."""
        for kk in range(k_tiles):
            mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
            acc, it = _mma_block(acc, a_bufs, b_bufs, ready, empty, it, kk == 0, WG, STAGES, A_KMAJOR, B_KMAJOR)
        return _mma_drain(acc, empty, it, STAGES), it

    @gluon.jit
    def _halves(x):
        """[R, C] -> its column halves [R, C/2] (columns [0, C/2) and [C/2, C)); register-only
        for the wgmma accumulator layout (a thread holds columns 8j + 2t + {0, 1} for every j)."""
        R: gl.constexpr = x.shape[0]
        C: gl.constexpr = x.shape[1]
        return gl.split(gl.permute(gl.reshape(x, [R, 2, C // 2]), (0, 2, 1)))

    @gluon.jit
    def _store_piece(c_desc, c_bufs, piece, row, col, st, WG: gl.constexpr, C_BUFS: gl.constexpr,
                     REDUCE: gl.constexpr):
        """piece (64 x EPI_N fp32) -> out dtype -> this warpgroup's next staging buffer -> TMA store
        (REDUCE: TMA reduce-add, ``out += piece`` in L2) at [row, col]; returns st + 1. The wait
        frees the buffer the store C_BUFS stores back used (as _dense._store_sub)."""
        c_buf = c_bufs.index(WG * C_BUFS + st % C_BUFS)
        tma.store_wait(pendings=C_BUFS - 1)
        c_buf.store(piece.to(c_desc.dtype))
        fence_async_shared()
        if REDUCE:
            _tma_reduce_add(c_desc, [row, col], c_buf)
        else:
            tma.async_copy_shared_to_global(c_desc, [row, col], c_buf)
        return st + 1

    @gluon.jit
    def _store_tile(c_desc, c_bufs, acc, row, col, st, WG: gl.constexpr, C_BUFS: gl.constexpr,
                    REDUCE: gl.constexpr = False):
        """acc (64 x BLOCK_N fp32) to out[row:row+64, col:col+BLOCK_N] in EPI_N-column pieces
        (1, 2 or 4 of them); TMA clips rows and columns past the descriptor's shape."""
        EPI_N: gl.constexpr = c_desc.block_type.shape[1]
        NP: gl.constexpr = acc.shape[1] // EPI_N
        gl.static_assert(NP == 1 or NP == 2 or NP == 4, "BLOCK_N / EPI_N must be 1, 2 or 4")
        if NP == 1:
            st = _store_piece(c_desc, c_bufs, acc, row, col, st, WG, C_BUFS, REDUCE)
        elif NP == 2:
            lo, hi = _halves(acc)
            st = _store_piece(c_desc, c_bufs, lo, row, col, st, WG, C_BUFS, REDUCE)
            st = _store_piece(c_desc, c_bufs, hi, row, col + EPI_N, st, WG, C_BUFS, REDUCE)
        else:
            lo, hi = _halves(acc)
            q0, q1 = _halves(lo)
            st = _store_piece(c_desc, c_bufs, q0, row, col, st, WG, C_BUFS, REDUCE)
            st = _store_piece(c_desc, c_bufs, q1, row, col + EPI_N, st, WG, C_BUFS, REDUCE)
            q2, q3 = _halves(hi)
            st = _store_piece(c_desc, c_bufs, q2, row, col + 2 * EPI_N, st, WG, C_BUFS, REDUCE)
            st = _store_piece(c_desc, c_bufs, q3, row, col + 3 * EPI_N, st, WG, C_BUFS, REDUCE)
        return st

    @gluon.jit
    def _store_rows_masked(c_ptr, acc, offs_m, mask_m, off_n, N, stride_cm):
        """acc (64 x BLOCK_N fp32, wgmma layout) -> out rows offs_m (where mask_m), columns
        [off_n, off_n + BLOCK_N) below N: pointer stores that never touch another group's rows."""
        BLOCK_N: gl.constexpr = acc.shape[1]
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
        rows = gl.expand_dims(offs_m.to(gl.int64) * stride_cm, 1)
        mask = gl.expand_dims(mask_m, 1) & gl.expand_dims(offs_n < N, 0)
        gl.store(c_ptr + rows + gl.expand_dims(offs_n, 0), acc.to(c_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _m_consumer(c_desc, c_ptr, a_bufs, b_bufs, c_bufs, ready, empty, offs_ptr, M, N, K, G, stride_cm,
                    WG: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                    C_BUFS: gl.constexpr, B_KMAJOR: gl.constexpr):
        """One warpgroup: rows [WG*64, WG*64+64) of every tile of every group, and of the tail."""
        HALF_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        # the accumulator layout of one warpgroup's m64 x BLOCK_N x 16 wgmma
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        it = 0
        st = 0
        tile_base = 0
        for g in range(G + 1):  # g == G: the zeroed rows past offs[G]
            m_start, m_end, num_pid_m, tiles_g, first = _group_tiles(offs_ptr, g, G, M, num_pid_n, tile_base,
                                                                     2 * HALF_M)
            for i in range(gl.cdiv(tiles_g - first, gl.num_programs(0))):  # grouped_gemm_kernel: why not range(first, ...)
                t = first + i * gl.num_programs(0)
                pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
                off_m = m_start + pid_m * (2 * HALF_M) + WG * HALF_M
                off_n = pid_n * BLOCK_N
                acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_layout)
                if g < G:
                    acc, it = _mainloop16(acc, a_bufs, b_bufs, ready, empty, it, k_tiles, WG, STAGES, True,
                                          B_KMAJOR)
                if off_m + HALF_M <= m_end:  # the whole half is in the group: TMA stores (clip at N)
                    st = _store_tile(c_desc, c_bufs, acc, off_m, off_n, st, WG, C_BUFS)
                else:  # the group's last rows: masked stores, the next group's rows untouched
                    offs_m = off_m + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma_layout))
                    _store_rows_masked(c_ptr, acc, offs_m, offs_m < m_end, off_n, N, stride_cm)
            tile_base += tiles_g
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_gemm_gluon_ws_kernel(
        a_desc, b_desc, c_desc, c_ptr, offs_ptr, pace_ptr,
        M, N, K, G, stride_cm,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, C_BUFS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, B_KMAJOR: gl.constexpr, PACE: gl.constexpr,
    ):
        """Persistent, warp-specialized 16-bit M-grouped GEMM. Descriptors: a_desc [64, BLOCK_K]
        boxes of a [M, K]; b_desc [1, BLOCK_N, BLOCK_K] boxes of b [G, N, K] (B_KMAJOR) or
        [1, BLOCK_K, BLOCK_N] of b [G, K, N]; c_desc [64, EPI_N] of out [M, N]; plus the output
        pointer for the masked group-end stores; ``pace_ptr``: a zeroed int32 counter of this
        launch's own when PACE > 0 (see :func:`_pace`), unused otherwise."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KMAJOR else b_desc.block_type.shape[2]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 1, b_desc.block_type.shape[1],
                                                          b_desc.block_type.shape[2]], b_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 * C_BUFS, HALF_M, c_desc.block_type.shape[1]],
                                           c_desc.layout)
        ready, empty = _ring_barriers(STAGES)
        gl.warp_specialize([
            (_m_consumer, (c_desc, c_ptr, a_bufs, b_bufs, c_bufs, ready, empty, offs_ptr, M, N, K, G, stride_cm,
                           0, BLOCK_N, GROUP_M, STAGES, C_BUFS, B_KMAJOR)),
            (_m_consumer, (c_desc, c_ptr, a_bufs, b_bufs, c_bufs, ready, empty, offs_ptr, M, N, K, G, stride_cm,
                           1, BLOCK_N, GROUP_M, STAGES, C_BUFS, B_KMAJOR)),
            (_m_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, pace_ptr, M, N, K, G, GROUP_M,
                           STAGES, B_KMAJOR, PACE)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    @gluon.jit
    def _ring_barriers(STAGES: gl.constexpr):
        """The ring's ready (producer's expect + TMA bytes) and empty (one arrival per consumer
        warpgroup) mbarriers."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        return ready, empty

    from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_variable_k_gluon as _vk8

    # the FP8 wgrad kernel's TMA reduce-add (None where this Triton lacks the op: no accumulation)
    _tma_reduce_add = getattr(_vk8, "_tma_reduce_add", None)


# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
def _rows_ok(t: torch.Tensor, inner: int) -> bool:
    """``t`` has a unit stride on dim ``inner`` and 16-byte aligned base and other strides (TMA)."""
    st = t.stride()
    if st[inner] != 1 or t.data_ptr() % 16:
        return False
    es = t.element_size()
    for d, s in enumerate(st):  # a plain loop: this runs on every launch of small GEMMs
        if d != inner and (s * es) % 16:
            return False
    return True


def _b_kmajor(b: torch.Tensor) -> Optional[bool]:
    """True when the logical [G, K, N] ``b`` is K-contiguous (a [G, N, K] weight or the dgrad's
    view), False when N-contiguous, None when neither with TMA-aligned strides."""
    if _rows_ok(b, 2) and b.size(2) > 1:
        return False
    if _rows_ok(b, 1):
        return True
    return _rows_ok(b, 2) if b.size(2) <= 1 else None


def gluon_grouped_operand_reason(a, b, group_offs, out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """The operand half of :func:`gluon_grouped_reason` (no platform test: checkable on CPU). ``b``
    is the logical ``[G, K, N]`` weight (any of the two layouts above). None when the kernel
    takes these dtypes, shapes, strides and devices."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if a.dim() != 2 or b.dim() != 3:
        return f"a must be [M_total, K] and b [G, K, N], got {tuple(a.shape)} and {tuple(b.shape)}"
    if a.dtype not in _IN_DTYPES or b.dtype != a.dtype:
        return f"a and b must both be bfloat16 or float16, got {a.dtype} and {b.dtype}"
    M, K = a.shape
    G, Kb, N = b.shape
    if Kb != K:
        return f"K mismatch: a is [M, K] = {list(a.shape)}, b is [G, K, N] = {list(b.shape)}"
    if b.device != a.device:
        return "a and b must be on one device"
    if group_offs is not None:  # None: the caller derives it from group_lens on the device
        if not isinstance(group_offs, torch.Tensor) or group_offs.device != a.device:
            return f"group_offs must be a tensor on {a.device}"
        if group_offs.dtype != torch.int64 or group_offs.dim() != 1 or group_offs.numel() != G + 1:
            return f"group_offs must be int64 [G+1] = [{G + 1}], got {group_offs.dtype} {list(group_offs.shape)}"
    if a.numel() and not _rows_ok(a, 1):
        return f"a must be K-contiguous with 16-byte aligned base and rows for TMA (strides {tuple(a.stride())})"
    if b.numel() and _b_kmajor(b) is None:
        return (f"b's matrices must be K- or N-contiguous with 16-byte aligned base and strides for TMA "
                f"(strides {tuple(b.stride())})")
    dtype = out_dtype if out_dtype is not None else a.dtype
    if dtype not in (a.dtype, torch.float32):
        return f"output dtype {dtype} must be the operands' ({a.dtype}) or float32"
    if (N * dtype.itemsize) % 16:
        return f"out rows of N={N} {dtype} elements are not 16-byte aligned for the TMA store"
    return None


def gluon_grouped_reason(a, b, group_offs, out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when :func:`grouped_gemm_gluon` can run these inputs, else why not. Never raises,
    never synchronizes (shapes, dtypes, strides, a cached capability)."""
    return _dense._device_reason(gluon_grouped_operand_reason, gluon_platform_reason, (a, b, group_offs, out_dtype))


def pace_default() -> int:
    """``PRIMUS_TURBO_GROUPED_GEMM_PACE``: the pacing distance of the M-grouped kernel's default config,
    0 (default: off) or 1-8 (explicit ``p<D>`` configs run whatever it says). Read per call; anything
    else raises ValueError naming the value."""
    from primus_turbo.pytorch.core.env import env_str

    v = env_str(PACE_ENV)
    if v not in _PACE_VALUES:
        raise ValueError(f"{PACE_ENV}={v!r}: expected 0 (off) or a pacing distance 1-8")
    return int(v)


def gluon_grouped_enabled() -> bool:
    """``PRIMUS_TURBO_GROUPED_GEMM_GLUON``: False for 0, True for 1 and auto (the backend's checks
    still keep it to sm_90 and the operands it takes). Read per call."""
    from primus_turbo.pytorch.core.env import env_auto_flag

    return env_auto_flag(GLUON_GROUPED_ENV) is not False


def default_grouped16_config(M: int, N: int, G: int, num_programs: int) -> GluonGroupedConfig:
    """The M-grouped kernel's tiles for ``a [M, K]``, ``G`` groups, ``N`` output columns on
    ``num_programs`` persistent programs, from shapes alone (the group sizes stay on the device, so
    the mean ``M / G`` stands for them): :data:`GROUPED16_SMALL_GROUPS_CONFIG` when an average group
    has at most half a wave of 128 x 256 tiles, else :data:`GROUPED16_DEFAULT_CONFIG` (not yet
    fitted to the output dtype). K does not enter: the measured rows did not depend on it."""
    if G > 0:
        rows = -(-M // G)
        tiles = -(-rows // GluonGroupedConfig.BLOCK_M) * -(-N // GROUPED16_DEFAULT_CONFIG.block_n)
        if 2 * tiles <= num_programs:
            return GROUPED16_SMALL_GROUPS_CONFIG
    return GROUPED16_DEFAULT_CONFIG


def default_launch_config(M: int, N: int, G: int, num_programs: int, out_dtype: torch.dtype) -> GluonGroupedConfig:
    """What :func:`grouped_gemm_gluon` runs without a config: :func:`default_grouped16_config` fitted
    to ``out_dtype``, paced at :func:`pace_default`'s distance when that is not 0."""
    cfg = fitted_config(default_grouped16_config(M, N, G, num_programs), out_dtype)
    pace = pace_default()
    return dataclasses.replace(cfg, pace=pace) if pace else cfg


def fitted_config(cfg: GluonGroupedConfig, out_dtype: torch.dtype) -> GluonGroupedConfig:
    """``cfg`` shrunk until it fits next to its staging buffers for ``out_dtype``: narrower
    pieces (epi_n down to 64), one buffer per warpgroup, then fewer stages."""
    return _fitted(cfg, out_dtype.itemsize)


@functools.lru_cache(maxsize=None)
def _fitted(cfg: GluonGroupedConfig, out_bytes: int) -> GluonGroupedConfig:
    while cfg.smem_bytes(out_bytes) > _dense.SMEM_LIMIT and cfg.epi_n > 64:
        cfg = dataclasses.replace(cfg, epi_n=cfg.epi_n // 2)
    if cfg.smem_bytes(out_bytes) > _dense.SMEM_LIMIT and cfg.c_bufs > 1:
        cfg = dataclasses.replace(cfg, c_bufs=1)
    while cfg.smem_bytes(out_bytes) > _dense.SMEM_LIMIT and cfg.stages > 2:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


@functools.lru_cache(maxsize=None)
def _smem_layout(shape: tuple, dtype: torch.dtype):
    """128-byte swizzled NVMMA layout of a TMA box (whole wgmma / TMA rows)."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), _gl_dtype(dtype))


def _desc(t: torch.Tensor, box: list):
    """Host TMA descriptor of ``t`` (its true shape: loads past it zero-fill, stores clip) with
    boxes of ``box``; ``t``'s last stride is 1."""
    return _dense._desc_unchecked(t, list(t.shape), list(t.stride()), box, _smem_layout(tuple(box), t.dtype))


def _kernel_args(a, b, group_offs, out, cfg: GluonGroupedConfig) -> tuple:
    """(positional args, keyword args) of the launch for validated, non-empty inputs."""
    plan = _plan(a, b, group_offs, out.dtype, cfg, out, None, True, with_grid=False)
    return _launch_args(plan, a, b, group_offs, out), plan.kwargs


def _launch_args(plan: "_Plan", a, b, group_offs, out) -> tuple:
    """The positional launch arguments of ``plan`` for this call's tensors: the three host TMA
    descriptors (built every call: they hold the data pointers), the output and offsets."""
    ly_a, ly_b, ly_c = plan.layouts
    a_desc = _dense._desc_unchecked(a, list(a.shape), list(a.stride()), plan.a_box, ly_a)
    bv = b.transpose(1, 2) if plan.kmajor else b  # the storage [G, N, K] when K-major
    b_desc = _dense._desc_unchecked(bv, list(bv.shape), list(bv.stride()), plan.b_box, ly_b)
    c_desc = _dense._desc_unchecked(out, list(out.shape), list(out.stride()), plan.c_box, ly_c)
    # the pacing counter: a fresh one per launch (launches on other streams may run at the same
    # time, and nothing has to reset it); unused (any pointer) without pacing
    pace = torch.zeros(1, dtype=torch.int32, device=a.device) if plan.cfg.pace else group_offs
    return (a_desc, b_desc, c_desc, out, group_offs, pace, plan.M, plan.N, plan.K, plan.G, out.stride(0))


def _launch_reason(a, b, group_offs, out, num_programs) -> Optional[str]:
    """What the launcher needs beyond the operand checks (``b`` is the logical ``[G, K, N]``)."""
    return _dense._grouped_launch_reason(a, b.shape[2], group_offs, out, num_programs)


@functools.lru_cache(maxsize=None)
def _config_problem(cfg: GluonGroupedConfig, out_bytes: int) -> Optional[str]:
    return cfg.check(out_bytes)


def grouped_gemm_gluon(a: torch.Tensor, b: torch.Tensor, group_offs: torch.Tensor,
                       out_dtype: Optional[torch.dtype] = None, config: Optional[GluonGroupedConfig] = None,
                       out: Optional[torch.Tensor] = None, num_programs: Optional[int] = None,
                       checked: bool = False, keep=None) -> torch.Tensor:
    """``out[rows of g] = a[rows of g] @ b[g]``, rows past ``group_offs[G]`` zero (16-bit operands).

    Args:
        a: ``[M_total, K]`` bf16 / fp16, K contiguous (tokens sorted by expert).
        b: the logical ``[G, K, N]`` weights of a's dtype: N-contiguous (stored ``[G, K, N]``) or
            K-contiguous (``w.transpose(1, 2)`` of a ``[G, N, K]`` weight).
        group_offs: ``[G+1]`` int64 on the device (read only there: no host sync).
        out_dtype: a's dtype (default) or float32 (ignored when ``out`` is given).
        config: :class:`GluonGroupedConfig` (when None: :func:`default_grouped16_config`, fitted).
        out: optional contiguous ``[M_total, N]`` output (every row is written, the tail with zeros).
        num_programs: cap on the persistent grid (the op's ``num_cu``); all SMs when None.
        checked: the caller has just had :func:`gluon_grouped_reason` accept these inputs (with this
            ``out_dtype``): only the launcher's own checks run again.
        keep: optional ``(dict, key)``: a prepared launch's record and grid are kept there under
            ``key`` (the caller's own repeat path, :func:`fire`).

    Raises ValueError with :func:`gluon_grouped_reason`'s text on inputs it cannot run.

    Host path: everything decided from the call's signature (the checks' verdict, the config, the
    grid, the launch keywords and the launch key) is kept per signature (:class:`_Plan`); a repeat
    call builds its three descriptors and calls the compiled kernel's entry (small expert GEMMs
    take tens of microseconds on the device, as much as the generic path's Python).
    """
    fk = None
    if out is not None:
        out_dtype = out.dtype
    elif getattr(a, "is_cuda", False):
        try:  # the flat signature of _FAST (a non-tensor argument: the checked path raises)
            fk = ("m16", a.data_ptr(), b.data_ptr(), group_offs.data_ptr(), a.shape, a.stride(), b.shape, b.stride(),
                  group_offs.shape, group_offs.stride(), a.dtype, b.dtype, group_offs.dtype, a.device, b.device,
                  group_offs.device, out_dtype, config, num_programs, checked, _env_raw(PACE_ENV),
                  _env_raw("TRITON_INTERPRET"))
            hit = _FAST.get(fk)
        except (AttributeError, TypeError):
            fk = hit = None
        if hit is not None:
            plan = hit[0]
            o = torch.empty((plan.M, plan.N), dtype=plan.out_dtype, device=a.device)
            if not fire(hit[2].get(o.data_ptr()), o.device.index):
                fast_miss(_grouped_gemm_gluon_ws_kernel, hit, o, lambda: _launch_args(plan, a, b, group_offs, o),
                          (a.data_ptr(), b.data_ptr(), o.data_ptr(), group_offs.data_ptr()))
            return o
    return planned_launch(
        _grouped_gemm_gluon_ws_kernel, a.device, out,
        lambda: ("m16", tensor_sig(a), tensor_sig(b), tensor_sig(group_offs), None if out is None else tensor_sig(out),
                 out_dtype, config, num_programs, checked, _env_raw(PACE_ENV), _env_raw("TRITON_INTERPRET")),
        lambda: _plan(a, b, group_offs, out_dtype, config, out, num_programs, checked),
        lambda plan: torch.empty((plan.M, plan.N), dtype=plan.out_dtype, device=a.device),
        lambda plan, o: _launch_args(plan, a, b, group_offs, o),
        lambda plan, o: None if plan.cfg.pace else (a.data_ptr(), b.data_ptr(), o.data_ptr(), group_offs.data_ptr()),
        fk, keep)


def planned_launch(kernel, device: torch.device, out, key, make_plan, new_out, launch_args, ptrs=None, fk=None,
                   keep=None):
    """The launch of a 16-bit grouped Gluon kernel through its plan: ``key()`` (the call signature;
    an AttributeError / TypeError, as from a non-tensor argument, skips the cache), ``make_plan()``
    (validates, raising ValueError, and plans: its ``empty`` verdict, ``grid`` and ``kwargs``) on a
    miss, ``new_out(plan)`` when ``out`` is None, ``launch_args(plan, out)``; keyed by the signature,
    which fixes every fact the kernel specializes on (a fresh output is 16-byte aligned).
    ``ptrs(plan, out)``: the data pointers of every tensor the launch arguments hold (or None),
    with which the launch is prepared once per signature and pointers (:func:`launch_prepared`).
    ``fk``: the call's flat signature when it allocates its output on CUDA (see :data:`_FAST`);
    a prepared launch is then also kept under it. ``keep``: ``(dict, key)``, where a prepared
    launch's record and grid are also kept for the caller (see :func:`fire`)."""
    try:
        k = key()
        plan = _PLANS.get(k)
    except (AttributeError, TypeError):
        k = plan = None
    if plan is None:
        plan = make_plan()
        if k is not None:
            if len(_PLANS) >= 1024:  # shape churn (tests, sweeps): start over rather than grow
                _PLANS.clear()
            _PLANS[k] = plan
    if out is None:
        out = new_out(plan)
    if plan.empty is not None:
        return out.zero_() if plan.empty == "zero" else out
    p = ptrs(plan, out) if (ptrs is not None and k is not None and device.type == "cuda") else None
    if p is not None:
        launch_prepared(kernel, plan.grid, lambda: launch_args(plan, out), plan.kwargs, device, k, p)
        if fk is not None or keep is not None:
            kept = _kept(kernel, device, k, p, plan.grid)
            if fk is not None:
                if len(_FAST) >= _MAX_FAST:
                    _FAST.clear()
                hit = _FAST[fk] = (plan, k, {})
                _store(hit[2], out.data_ptr(), kept)
            if keep is not None:
                _store(keep[0], keep[1], kept)
    elif k is None:
        launch(kernel, plan.grid, launch_args(plan, out), plan.kwargs, device)
    else:
        launch_keyed(kernel, plan.grid, launch_args(plan, out), plan.kwargs, device, k)
    return out


# A call's flat signature -> (plan, plan key, {output data pointer: kept launch}), for the calls that
# allocate their output on CUDA. The flat signature holds every input tensor's data pointer, shape,
# strides, dtype and device and the call's other arguments: it fixes the plan key (which holds the
# same facts, alignment for the pointer) and, with the new output's pointer, the prepared launch's
# (key, pointers), so a repeat call is the tuple, one lookup, the allocation and the C launcher (the
# generic path builds the plan key, looks up the plan, builds the prepared key and looks it up again:
# ~10 us more per launch on the H100 machine's host, 2026-12-05, scripts/diag_host_layers.py). A kept
# launch is ``(prepared record, grid)``: immutable, no tensor in it.
_FAST: dict = {}
_MAX_FAST = 1024
_MAX_OUTS = 8  # addresses kept per signature (the caching allocator cycles through a few blocks)


def fire(kept, index: int) -> bool:
    """Calls the C launcher of ``kept`` (a ``(record, grid)`` pair kept by :func:`planned_launch`,
    under a caller's ``keep`` or a :data:`_FAST` entry) on device ``index``'s current stream; False
    (nothing launched) when ``kept`` is None or something asks for Triton's path (direct launches
    off, a launch hook, another current device)."""
    if kept is None or not _launch._DIRECT[0] or not _launch.no_launch_hooks() \
            or torch._C._cuda_getDevice() != index:
        return False
    rec, grid = kept
    _launch._call_entry(rec[0], grid, index, rec[1], ())
    return True


def fast_miss(kernel, hit, out: torch.Tensor, args_fn, ptrs: tuple) -> None:
    """The launch of a :data:`_FAST` hit whose output address :func:`fire` could not launch: the
    prepared launch (``ptrs``: every tensor's data pointer among ``args_fn()``), kept then for the
    output's address."""
    plan = hit[0]
    launch_prepared(kernel, plan.grid, args_fn, plan.kwargs, out.device, hit[1], ptrs)
    _store(hit[2], out.data_ptr(), _kept(kernel, out.device, hit[1], ptrs, plan.grid))


def _kept(kernel, device: torch.device, k, ptrs: tuple, grid: tuple):
    """``(record, grid)`` of the prepared launch of ``kernel`` under (``k``, ``ptrs``), or None when
    none was kept (direct launches off, a hook, another current device)."""
    rec = _launch._PREPARED.get((id(kernel), device.index, k, ptrs))
    return None if rec is None else (rec, grid)


def _store(kept: dict, key, value) -> None:
    """``kept[key] = value`` unless value is None, emptied first at :data:`_MAX_OUTS` entries."""
    if value is not None:
        if len(kept) >= _MAX_OUTS:
            kept.clear()
        kept[key] = value


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The signature-determined part of a 16-bit M-grouped launch: sizes, the output dtype, an
    ``empty`` verdict (``"zero"``: zero the output; ``"none"``: nothing to write; None: launch),
    the config, the weight's layout, boxes and shared layouts, grid and launch keywords."""

    M: int
    N: int
    K: int
    G: int
    out_dtype: torch.dtype
    empty: Optional[str] = None
    cfg: Optional[GluonGroupedConfig] = None
    kmajor: bool = False
    a_box: tuple = ()
    b_box: tuple = ()
    c_box: tuple = ()
    layouts: tuple = ()
    grid: tuple = ()
    kwargs: Optional[dict] = None


_PLANS: dict = {}  # signature -> plan (both 16-bit grouped Gluon launchers', keys tagged by kernel)


def _env_raw(name: str):
    """``primus_turbo.pytorch.core.env.env_raw`` (imported on first use: this module loads without the
    torch-side package; an import statement per call would cost ~3 us on the launch path)."""
    fn = _ENV_RAW[0]
    if fn is None:
        from primus_turbo.pytorch.core.env import env_raw as fn

        _ENV_RAW[0] = fn
    return fn(name)


_ENV_RAW: list = [None]


def _plan(a, b, group_offs, out_dtype, config, out, num_programs, checked, with_grid: bool = True) -> _Plan:
    """Validates one call (ValueError naming the problem) and plans its launch (without its grid,
    which needs the device's SM count, unless ``with_grid``)."""
    reason = None if checked else gluon_grouped_reason(a, b, group_offs, out_dtype)
    reason = reason or _launch_reason(a, b, group_offs, out, num_programs)
    if reason is not None:
        raise ValueError(f"grouped_gemm_gluon: {reason}")
    M, K = a.shape
    G, _, N = b.shape
    dtype = out_dtype or a.dtype
    if M == 0 or N == 0:
        return _Plan(M, N, K, G, dtype, empty="none")
    if G == 0 or K == 0:
        return _Plan(M, N, K, G, dtype, empty="zero")
    cfg = config
    sms = _dense._num_sms(a.device) if (with_grid or cfg is None) else 1
    if cfg is None:
        cfg = default_launch_config(M, N, G, min(num_programs or sms, sms), dtype)
    bad = _config_problem(cfg, dtype.itemsize)
    if bad is not None:
        raise ValueError(f"grouped_gemm_gluon: {bad}")
    kmajor = bool(_b_kmajor(b))
    a_box = (_HALF_M, cfg.block_k)
    b_box = (1, cfg.block_n, cfg.block_k) if kmajor else (1, cfg.block_k, cfg.block_n)
    c_box = (_HALF_M, cfg.epi_n)
    kwargs = dict(GROUP_M=cfg.group_m, STAGES=cfg.stages, C_BUFS=cfg.c_bufs, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs, B_KMAJOR=kmajor, PACE=cfg.pace, num_warps=4)
    # a static bound on the tiles (every group may add one partial row tile, plus the tail)
    tiles = (-(-M // cfg.BLOCK_M) + G + 1) * -(-N // cfg.block_n)
    cap = num_programs or sms
    if cfg.pace:  # paced programs wait for each other: never more of them than SMs (all resident)
        cap = min(cap, sms)
    return _Plan(M, N, K, G, dtype, cfg=cfg, kmajor=kmajor, a_box=list(a_box), b_box=list(b_box), c_box=list(c_box),
                 layouts=(_smem_layout(a_box, a.dtype), _smem_layout(b_box, b.dtype), _smem_layout(c_box, dtype)),
                 grid=(min(cap, tiles),) if with_grid else (), kwargs=kwargs)
