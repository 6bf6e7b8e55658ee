"""Hopper (sm_90) Gluon kernel for the M-grouped BLOCKWISE FP8 GEMM of MoE experts.

``out[offs[g]:offs[g+1]] = (a * sa)[rows of g] @ (b[g] * sb[g])^T`` and ``out[offs[G]:] = 0``:
``a [M_total, K]`` float8_e4m3fn (K contiguous) with 1 x 128 scales ``sa [M_total, ceil(K/128)]``
fp32, ``b [G, N, K]`` float8_e4m3fn (K contiguous: the ``trans_b=True`` weight layout, or the
dgrad copy ``[G, K, N]`` the op already keeps) with 128 x 128 scales
``sb [G, ceil(N/128), ceil(K/128)]`` fp32, ``group_offs [G+1]`` int64 on the device. The same
product as the BLOCKWISE mode of ``grouped_gemm_fp8_kernel.py`` (the ``triton.language`` kernel);
only the summation order of the fp32 promotions differs.

Structure: the dense Gluon kernel's (``triton/gemm/gemm_fp8_gluon.py``, whose main loops, scale
loads and TMA-store epilogue are reused), walked over a device-side tile schedule:

* persistent grid; every partition (producer warp, two consumer warpgroups) walks the groups in
  order, reading ``group_offs`` from global memory, and takes the tiles ``t`` of group ``g`` with
  ``(tile_base + t) % num_programs == program_id`` (the schedule of the tl grouped kernels), so
  no group size is ever read on the host and the three partitions agree on every tile;
* the producer warp issues TMA loads of A (two 64-row halves at the group's row offset) and B
  (a ``[G * N, K]`` view of the experts, rows ``g * N + off_n``) into a STAGES-deep ring guarded
  by ready/empty mbarriers. A rows past the group's end belong to the next group (or are
  zero-filled past M_total); they only feed output rows that are not stored. B rows past N of a
  partial column tile likewise only feed columns that are not stored;
* the two consumer warpgroups run the dense kernel's main loop (wgmma into a fresh partial per
  128-deep K block, promotion with ``sa[row, kb] * sb[g, n/128, kb]``);
* epilogue: a warpgroup half whose 64 rows all lie in the group goes through shared memory and a
  TMA store (clipped at N); a half that reaches past the group's end is stored from registers
  with masked pointer stores (rows < group end, cols < N), so no tile ever writes into the next
  group's rows. The pseudo-group ``g == G`` covers rows ``[offs[G], M_total)`` with zero tiles
  (no loads, no MMAs), the output-tail contract of the tl kernels.

Requirements (``gluon_grouped_blockwise_reason``): sm_90, Gluon importable, E4M3 operands with
unit K stride and 16-byte aligned rows, ``b``'s expert and row dims mergeable into one ``[G * N,
K]`` view, scales of the shapes above, ``group_offs`` int64 ``[G+1]`` on the same device, an
output dtype (bf16, fp16 or fp32) whose rows of N elements are 16-byte aligned. Offsets are
clamped to ``[0, M_total]`` and made non-decreasing on the device as the tl kernel does.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from primus_turbo.triton.gemm import gemm_fp8_gluon as _dense
from primus_turbo.triton.gemm.gemm_fp8_gluon import (
    GLUON_AVAILABLE,
    SCALE_BLOCK,
    GluonBlockwiseConfig,
    gluon_platform_reason,
)
from primus_turbo.triton.launch import launch_prepared, tensor_sig

__all__ = [
    "GROUPED_DEFAULT_CONFIG",
    "grouped_gemm_fp8_blockwise_gluon",
    "grouped_gemm_fp8_scaled_gluon",
    "gluon_grouped_scaled_reason",
    "gluon_grouped_blockwise_reason",
    "gluon_grouped_operand_reason",
    "grouped_default_config",
]

# n128s5x (``"n128s5g8c1xr232w40"``): 128 x 128 tiles, 5 stages, each consumer warpgroup issuing the
# wgmma of K block k+1 before promoting block k. Measured on the H200 on 2026-11-30 with
# scripts/check_gluon_fp8.py --grouped (DeepSeek-V3 EP8 gate_up/down, Qwen3-30B-A3B gate_up/down;
# balanced and unbalanced with an empty group and rows past the last offset; 55.6 dB vs the fp32
# reference, tails exactly zero): geomean 1.818x the tl grouped BLOCKWISE kernel and 1.404x BF16
# torch._grouped_mm, against 1.739x / 1.343x for the dense default n256s3c2.
GROUPED_DEFAULT_CONFIG = _dense.GluonBlockwiseConfig(block_n=128, stages=5, group_m=8, c_bufs=1, pipeline=True,
                                                     consumer_regs=232, producer_regs=40)

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from primus_turbo.triton.gemm.gemm_fp8_gluon import (
        SCALE_N,
        _mainloop,
        _mainloop_pipelined,
        _store_sub,
        _tile_coords,
    )

    @gluon.jit
    def _group_rows(offs_ptr, g, G, M):
        """[m_start, m_end) of group g, clamped to [0, M] and non-decreasing; g == G: the tail
        [offs[G], M) (as the tl grouped kernel)."""
        m_start = gl.load(offs_ptr + g)
        m_next = gl.load(offs_ptr + gl.minimum(g + 1, G))
        m_start = gl.minimum(gl.maximum(m_start, 0), M).to(gl.int32)
        if g < G:
            m_end = gl.minimum(m_next, M).to(gl.int32)
        else:
            m_end = M
        m_end = gl.maximum(m_end, m_start)
        return m_start, m_end

    @gluon.jit
    def _g_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, K, G,
                    BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One warp: the TMA loads of every tile of every real group (the tail needs none)."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        num_programs = gl.num_programs(0)
        pid = gl.program_id(0)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        it = 0
        tile_base = 0
        for g in range(G):
            m_start, m_end = _group_rows(offs_ptr, g, G, M)
            num_pid_m = gl.cdiv(m_end - m_start, 2 * HALF_M)
            tiles_g = num_pid_m * num_pid_n
            first = (pid - tile_base % num_programs + num_programs) % num_programs
            for i in range(gl.cdiv(tiles_g - first, num_programs)):  # grouped_gemm_kernel: why not range(first, ...)
                t = first + i * num_programs
                pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
                off_m = m_start + pid_m * (2 * HALF_M)
                off_b = g * N + pid_n * BLOCK_N  # row of the [G * N, K] expert view
                it = _dense._load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_b, k_tiles, it,
                                       STAGES)
            tile_base += tiles_g

    @gluon.jit
    def _store_masked(c_ptr, acc, offs_m, mask_m, off_n, N, stride_cm, SUB: gl.constexpr):
        """acc (64 x 128 fp32, wgmma layout) -> out rows offs_m (where mask_m), columns
        [off_n + SUB*128, +128) below N: pointer stores that never touch another group's rows."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, SCALE_N, 32])
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        offs_n = off_n + SUB * SCALE_N + gl.arange(0, SCALE_N, layout=col_layout)
        rows = gl.expand_dims(offs_m.to(gl.int64) * stride_cm, 1)
        cols = gl.expand_dims(offs_n, 0)
        mask = gl.expand_dims(mask_m, 1) & gl.expand_dims(offs_n < N, 0)
        gl.store(c_ptr + rows + cols, acc.to(c_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _g_consumer(c_desc, c_ptr, a_bufs, b_bufs, c_bufs, ready, empty, sa_ptr, sb_ptr, offs_ptr, sc_ptr, M, N, K, G,
                    stride_cm, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk, stride_scg,
                    WG: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                    C_BUFS: gl.constexpr, PIPELINE: gl.constexpr, COL_SCALE: gl.constexpr):
        """One warpgroup: rows [WG*64, WG*64+64) of every tile of every group, and of the tail.
        COL_SCALE: the finished tile is multiplied by one scale per output column (``sc[g, n]``,
        the ROWWISE weight scales), after the promotions."""
        HALF_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        N_SUB: gl.constexpr = BLOCK_N // SCALE_N
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, SCALE_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        num_programs = gl.num_programs(0)
        pid = gl.program_id(0)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        last_nb = gl.cdiv(N, SCALE_N) - 1
        it = 0
        st = 0
        tile_base = 0
        for g in range(G + 1):  # g == G: the zeroed rows past offs[G]
            m_start, m_end = _group_rows(offs_ptr, g, G, M)
            num_pid_m = gl.cdiv(m_end - m_start, 2 * HALF_M)
            tiles_g = num_pid_m * num_pid_n
            first = (pid - tile_base % num_programs + num_programs) % num_programs
            sb_g = sb_ptr + gl.minimum(g, G - 1).to(gl.int64) * stride_sbg
            for i in range(gl.cdiv(tiles_g - first, num_programs)):  # grouped_gemm_kernel: why not range(first, ...)
                t = first + i * num_programs
                pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
                off_m = m_start + pid_m * (2 * HALF_M) + WG * HALF_M
                off_n = pid_n * BLOCK_N
                offs_m = off_m + gl.arange(0, HALF_M, layout=row_layout)
                mask_m = offs_m < m_end
                sa_rows = sa_ptr + offs_m.to(gl.int64) * stride_sam
                sb0 = sb_g + (pid_n * N_SUB) * stride_sbn
                sb1 = sb_g + gl.minimum(pid_n * N_SUB + 1, last_nb) * stride_sbn
                acc0 = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
                acc1 = acc0
                if N_SUB == 2:
                    acc1 = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
                if g < G:
                    regs = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
                    if PIPELINE:
                        regs_q = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
                        acc0, regs, regs_q, it = _mainloop_pipelined(
                            acc0, regs, regs_q, a_bufs, b_bufs, ready, empty, it, k_tiles, sa_rows, mask_m, sb0,
                            stride_sak, stride_sbk, WG, STAGES)
                    else:
                        acc0, acc1, it = _mainloop(acc0, acc1, regs, a_bufs, b_bufs, ready, empty, it, k_tiles,
                                                   sa_rows, mask_m, sb0, sb1, stride_sak, stride_sbk, WG, STAGES,
                                                   N_SUB)
                    if COL_SCALE:
                        sc_g = sc_ptr + g.to(gl.int64) * stride_scg
                        cols = off_n + gl.arange(0, SCALE_N, layout=col_layout)
                        acc0 = acc0 * gl.expand_dims(gl.load(sc_g + cols, mask=cols < N, other=0.0), 0)
                        if N_SUB == 2:
                            cols = cols + SCALE_N
                            acc1 = acc1 * gl.expand_dims(gl.load(sc_g + cols, mask=cols < N, other=0.0), 0)
                if off_m + HALF_M <= m_end:  # the whole half is in the group: TMA store (clips at N)
                    st = _store_sub(c_desc, c_bufs, acc0, off_m, off_n, st, WG, 0, C_BUFS)
                    if N_SUB == 2:
                        st = _store_sub(c_desc, c_bufs, acc1, off_m, off_n, st, WG, 1, C_BUFS)
                else:  # the group's last rows: masked stores, the next group's rows untouched
                    _store_masked(c_ptr, acc0, offs_m, mask_m, off_n, N, stride_cm, 0)
                    if N_SUB == 2:
                        _store_masked(c_ptr, acc1, offs_m, mask_m, off_n, N, stride_cm, 1)
            tile_base += tiles_g
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_gemm_fp8_blockwise_ws_kernel(
        a_desc, b_desc, c_desc, c_ptr,
        sa_ptr, sb_ptr, offs_ptr, sc_ptr,
        M, N, K, G,
        stride_cm, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk, stride_scg,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, C_BUFS: gl.constexpr, PIPELINE: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, COL_SCALE: gl.constexpr = False,
    ):
        """Persistent, warp-specialized M-grouped BLOCKWISE GEMM; descriptors as the dense
        kernel's (a_desc [64, 128] boxes, b_desc [BLOCK_N, 128] boxes of the [G * N, K] view,
        c_desc [64, 128] boxes), plus the output pointer for the masked group-end stores.
        TENSORWISE / ROWWISE run as the same product with broadcast scales (zero strides, see
        ``_scaled_views``) and, for per-column weight scales, ``sc [G, N]`` (COL_SCALE)."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 * C_BUFS, HALF_M, SCALE_N], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_g_consumer, (c_desc, c_ptr, a_bufs, b_bufs, c_bufs, ready, empty, sa_ptr, sb_ptr, offs_ptr, sc_ptr,
                           M, N, K, G, stride_cm, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
                           stride_scg, 0, BLOCK_N, GROUP_M, STAGES, C_BUFS, PIPELINE, COL_SCALE)),
            (_g_consumer, (c_desc, c_ptr, a_bufs, b_bufs, c_bufs, ready, empty, sa_ptr, sb_ptr, offs_ptr, sc_ptr,
                           M, N, K, G, stride_cm, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
                           stride_scg, 1, BLOCK_N, GROUP_M, STAGES, C_BUFS, PIPELINE, COL_SCALE)),
            (_g_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, K, G, BLOCK_N, GROUP_M,
                           STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HALF_M = 64


def _rows_16(t: torch.Tensor, row_stride: int) -> bool:
    return (row_stride * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def gluon_grouped_operand_reason(a, sa, b, sb, group_offs, out_dtype: Optional[torch.dtype] = torch.bfloat16,
                                 block_size: int = 128) -> Optional[str]:
    """The operand half of :func:`gluon_grouped_blockwise_reason` (no platform test: checkable on
    CPU). None when dtypes, shapes, strides and devices are ones the kernel takes."""
    for name, t in (("sa", sa), ("sb", sb)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if block_size != SCALE_BLOCK:
        return f"the Gluon grouped kernel takes 128-wide scale blocks, got block_size={block_size}"
    reason = _ab_reason(a, b, group_offs, out_dtype)
    if reason is not None:
        return reason
    M, K = a.shape
    G, N, _ = b.shape
    if sa.device != a.device or sb.device != a.device:
        return "a, sa, b and sb must be on one device"
    kb = -(-K // SCALE_BLOCK)
    nb = -(-N // SCALE_BLOCK)
    if sa.dtype != torch.float32 or tuple(sa.shape) != (M, kb):
        return f"sa must be float32 [M_total, ceil(K/128)] = {[M, kb]}, got {sa.dtype} {list(sa.shape)}"
    if sb.dtype != torch.float32 or tuple(sb.shape) != (G, nb, kb):
        return f"sb must be float32 [G, ceil(N/128), ceil(K/128)] = {[G, nb, kb]}, got {sb.dtype} {list(sb.shape)}"
    return None


def _ab_reason(a, b, group_offs, out_dtype: Optional[torch.dtype]) -> Optional[str]:
    """The FP8 operands, the offsets and the output dtype (what every form of the kernel needs)."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if a.dim() != 2 or b.dim() != 3:
        return f"a must be [M_total, K] and b [G, N, K], got {tuple(a.shape)} and {tuple(b.shape)}"
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.float8_e4m3fn:
            return f"{name}.dtype={t.dtype}; the Gluon grouped kernel takes float8_e4m3fn only"
    M, K = a.shape
    G, N, Kb = b.shape
    if Kb != K:
        return f"K mismatch: a is [M, K] = {list(a.shape)}, b is [G, N, K] = {list(b.shape)}"
    dev = a.device
    if b.device != dev:
        return "a and b must be on one device"
    if group_offs is not None:  # None: the caller derives it from group_lens on the device
        if not isinstance(group_offs, torch.Tensor) or group_offs.device != dev:
            return f"group_offs must be a tensor on {dev}"
        if group_offs.dtype != torch.int64 or group_offs.dim() != 1 or group_offs.numel() != G + 1:
            return f"group_offs must be int64 [G+1] = [{G + 1}], got {group_offs.dtype} {list(group_offs.shape)}"
    if a.numel() and not (a.stride(1) == 1 and _rows_16(a, a.stride(0))):
        return f"a must be K-contiguous with 16-byte aligned base and rows for TMA (strides {tuple(a.stride())})"
    if b.numel():
        if b.stride(2) != 1 or not _rows_16(b, b.stride(1)):
            return f"b must be K-contiguous with 16-byte aligned base and rows for TMA (strides {tuple(b.stride())})"
        if G > 1 and b.stride(0) != N * b.stride(1):
            return (f"b's experts must be stacked row after row (stride(0) == N * stride(1)) for the [G * N, K] "
                    f"view, strides {tuple(b.stride())}")
    dtype = out_dtype if out_dtype is not None else torch.bfloat16
    if dtype not in _OUT_DTYPES:
        return f"output dtype {dtype} is not one of bfloat16, float16, float32"
    if (N * dtype.itemsize) % 16:
        return f"out rows of N={N} {dtype} elements are not 16-byte aligned for the TMA store"
    return None


def gluon_grouped_blockwise_reason(a, sa, b, sb, group_offs, out_dtype: Optional[torch.dtype] = torch.bfloat16,
                                   block_size: int = 128) -> Optional[str]:
    """None when :func:`grouped_gemm_fp8_blockwise_gluon` can run these inputs, else why not.
    Never raises, never synchronizes (shapes, dtypes, strides, a cached capability)."""
    return _dense._device_reason(gluon_grouped_operand_reason, gluon_platform_reason,
                                 (a, sa, b, sb, group_offs, out_dtype, block_size))


def grouped_default_config(M: int, N: int, K: int, G: int,
                           out_dtype: torch.dtype = torch.bfloat16) -> GluonBlockwiseConfig:
    """GROUPED_DEFAULT_CONFIG, shrunk to fit next to the output staging buffers (as the dense one)."""
    del M, N, K, G
    return _fitted(out_dtype)


@functools.lru_cache(maxsize=None)
def _fitted(out_dtype: torch.dtype) -> GluonBlockwiseConfig:
    import dataclasses

    cfg = GROUPED_DEFAULT_CONFIG
    out_bytes = out_dtype.itemsize
    if cfg.smem_bytes(out_bytes) > _dense.SMEM_LIMIT and cfg.c_bufs > 1:
        cfg = dataclasses.replace(cfg, c_bufs=1)
    while cfg.smem_bytes(out_bytes) > _dense.SMEM_LIMIT and cfg.stages > 2:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


def _kernel_args(a, sa, b, sb, group_offs, out, cfg: GluonBlockwiseConfig, sc: Optional[torch.Tensor] = None) -> tuple:
    """(positional args, keyword args) of the launch for validated, non-empty inputs; ``sc``: the
    ``[G, N]`` per-column weight scales of ROWWISE (COL_SCALE), None otherwise."""
    M, K = a.shape
    G, N, _ = b.shape
    bn, bk = cfg.block_n, cfg.BLOCK_K
    a_layout, b_layout, c_layout = _dense._layouts(bn, out.dtype)
    desc = _dense._desc_unchecked  # the operands passed the *_reason checks
    a_desc = desc(a, [M, K], [a.stride(0), 1], [_HALF_M, bk], a_layout)
    # the experts as one [G * N, K] matrix (rows g * N + n); a K tail zero-fills per row
    b_desc = desc(b, [G * N, K], [b.stride(1), 1], [bn, bk], b_layout)
    c_desc = desc(out, [M, N], [out.stride(0), 1], [_HALF_M, SCALE_BLOCK], c_layout)
    args = (a_desc, b_desc, c_desc, out, sa, sb, group_offs, sa if sc is None else sc, M, N, K, G,
            out.stride(0), sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), sb.stride(2),
            0 if sc is None else sc.stride(0))
    return args, _dense._launch_kwargs(cfg, COL_SCALE=sc is not None)


def _launch_reason(a, b, group_offs, out, num_programs) -> Optional[str]:
    """What the launcher needs beyond the operand checks (``b`` is ``[G, N, K]``)."""
    return _dense._grouped_launch_reason(a, b.shape[1], group_offs, out, num_programs)


def grouped_gemm_fp8_blockwise_gluon(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                                     group_offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                                     config: Optional[GluonBlockwiseConfig] = None,
                                     out: Optional[torch.Tensor] = None,
                                     num_programs: Optional[int] = None, checked: bool = False) -> torch.Tensor:
    """``out[rows of g] = (a * sa)[rows of g] @ (b[g] * sb[g])^T``, rows past ``group_offs[G]`` zero.

    Args:
        a: ``[M_total, K]`` float8_e4m3fn, K contiguous (tokens sorted by expert).
        sa: ``[M_total, ceil(K/128)]`` float32 multipliers of a's 1 x 128 groups.
        b: ``[G, N, K]`` float8_e4m3fn, K contiguous, experts stacked (``b.view(G * N, K)`` valid).
        sb: ``[G, ceil(N/128), ceil(K/128)]`` float32 multipliers of b's 128 x 128 blocks.
        group_offs: ``[G+1]`` int64 on the device (read only there: no host sync).
        out_dtype: bf16, fp16 or fp32 (ignored when ``out`` is given).
        config: :class:`GluonBlockwiseConfig` (the dense kernel's; default when None).
        out: optional contiguous ``[M_total, N]`` output (every row is written, the tail with zeros).
        num_programs: cap on the persistent grid (``num_cu`` of the op); all SMs when None.
        checked: the caller has just had :func:`gluon_grouped_blockwise_reason` accept these inputs
            (a backend's check): only the launcher's own checks run again (host time of small GEMMs).

    Raises ValueError with :func:`gluon_grouped_blockwise_reason`'s text on inputs it cannot run.
    """
    fk = None
    if out is not None:
        out_dtype = out.dtype
    elif getattr(a, "is_cuda", False):
        fk = _flat_key("bw", a, sa, b, sb, group_offs, out_dtype, config, num_programs)
        o = _fast(fk)
        if o is not None:
            return o
    reason = None if checked else gluon_grouped_blockwise_reason(a, sa, b, sb, group_offs, out_dtype)
    reason = reason or _launch_reason(a, b, group_offs, out, num_programs)
    if reason is not None:
        raise ValueError(f"grouped_gemm_fp8_blockwise_gluon: {reason}")
    return _launch(a, sa, b, sb, group_offs, out_dtype, config, out, num_programs, None,
                   "grouped_gemm_fp8_blockwise_gluon", fk, (a, sa, b, sb, group_offs))


def _launch(a, sa, b, sb, group_offs, out_dtype, config, out, num_programs, sc, who: str, fk=None,
            inputs: tuple = ()) -> torch.Tensor:
    """The launch of checked inputs (both entry points). ``fk``: the call's flat signature
    (:func:`_flat_key`; it allocates its output on CUDA) and ``inputs`` the caller's tensors: the
    prepared launch is then kept under it (:data:`_FAST`) when every pointer it holds is one of
    theirs, the new output's or a persistent one (no per-call copy of a scale among them)."""
    M, K = a.shape
    G, N, _ = b.shape
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if G == 0 or K == 0:
        return out.zero_()
    cfg = config or grouped_default_config(M, N, K, G, out_dtype)
    bad = cfg.check(out.element_size())
    if bad is not None:
        raise ValueError(f"{who}: {bad}")
    # a static bound on the tiles (every group may add one partial row tile, plus the tail)
    tiles = (-(-M // cfg.BLOCK_M) + G + 1) * -(-N // cfg.block_n)
    grid = (min(num_programs or _dense._num_sms(a.device), tiles),)
    key, ptrs = _prepared_key(a, sa, b, sb, group_offs, out, cfg, sc)
    launch_prepared(_grouped_gemm_fp8_blockwise_ws_kernel, grid,
                    lambda: _kernel_args(a, sa, b, sb, group_offs, out, cfg, sc)[0],
                    _dense._launch_kwargs(cfg, COL_SCALE=sc is not None), a.device, key, ptrs)
    if fk is not None:
        own = {t.data_ptr() for t in inputs}
        own.add(out.data_ptr())
        own.update(t.data_ptr() for t in _ONES.values())  # persistent (allocated by _scaled_views)
        if own.issuperset(ptrs):
            kept = _gg._kept(_grouped_gemm_fp8_blockwise_ws_kernel, a.device, key, ptrs, grid)
            if kept is not None:
                hit = _FAST.get(fk)
                if hit is None:
                    if len(_FAST) >= _gg._MAX_FAST:
                        _FAST.clear()
                    hit = _FAST[fk] = ((M, N), out.dtype, a.device, {})
                _gg._store(hit[3], out.data_ptr(), kept)
    return out


# A call's flat signature (every input tensor's data pointer, shape, strides, dtype and device, the
# mode and the other arguments; see :func:`_flat_key`) -> (output shape, output dtype, device, {output
# data pointer: kept launch}), for calls that allocate their output on CUDA: a repeat call is the tuple,
# one lookup, the allocation and the C launcher (``grouped_gemm_gluon.fire``), where the generic path
# re-derives the scale views, the config and the prepared key (as the 16-bit launchers' ``_FAST``).
_FAST: dict = {}


def _flat_key(tag: str, a, sa, b, sb, group_offs, out_dtype, config, num_programs) -> Optional[tuple]:
    """The flat signature of a launcher call (None for non-tensor arguments: the checked path then
    raises). ``tag`` names the entry point and, for the scaled one, its mode."""
    try:
        return (tag, a.data_ptr(), sa.data_ptr(), b.data_ptr(), sb.data_ptr(), group_offs.data_ptr(), a.shape,
                a.stride(), sa.shape, sa.stride(), b.shape, b.stride(), sb.shape, sb.stride(), group_offs.shape,
                group_offs.stride(), a.dtype, sa.dtype, b.dtype, sb.dtype, group_offs.dtype, a.device, sa.device,
                b.device, sb.device, group_offs.device, out_dtype, config, num_programs,
                _gg._env_raw("TRITON_INTERPRET"))
    except (AttributeError, TypeError, RuntimeError):
        return None


def _fast(fk) -> Optional[torch.Tensor]:
    """The output of a :data:`_FAST` hit launched from its kept record, or None (no hit, or no
    record for the new output's address, or :func:`fire` declined: the caller takes its path)."""
    hit = _FAST.get(fk) if fk is not None else None
    if hit is None:
        return None
    shape, dtype, device, kept = hit
    o = torch.empty(shape, dtype=dtype, device=device)
    if _gg.fire(kept.get(o.data_ptr()), o.device.index):
        return o
    return None


def _prepared_key(a, sa, b, sb, group_offs, out, cfg: GluonBlockwiseConfig, sc) -> tuple:
    """(key, pointers) of :func:`_launch`'s prepared launch (triton/launch.launch_prepared): the key
    fixes every argument of :func:`_kernel_args` but the data pointers (shapes, strides, dtypes and
    16-byte alignment of every tensor, the config, the column-scale switch), so the C launcher's
    argument list is a function of (key, pointers) and a repeat call skips building and encoding
    the three descriptors; the pointers are those of every tensor and descriptor base among the
    arguments."""
    sig = tensor_sig
    key = ("f8", sig(a), sig(sa), sig(b), sig(sb), sig(group_offs), sig(out), None if sc is None else sig(sc), cfg)
    ptrs = (a.data_ptr(), sa.data_ptr(), b.data_ptr(), sb.data_ptr(), group_offs.data_ptr(), out.data_ptr(),
            sa.data_ptr() if sc is None else sc.data_ptr())
    return key, ptrs


# ----------------------------------------------------------------------------------------------
# TENSORWISE / ROWWISE on the same kernel
# ----------------------------------------------------------------------------------------------
_ONES: dict = {}


def _one(device: torch.device) -> torch.Tensor:
    """A persistent fp32 ``[1]`` tensor holding 1.0 on ``device`` (never written after creation,
    so CUDA-graph replays read the same value)."""
    key = (device.type, device.index)
    t = _ONES.get(key)
    if t is None:
        t = _ONES[key] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def gluon_grouped_scaled_scale_reason(a, a_scale, b, b_scale, mode) -> Optional[str]:
    """None when ``mode`` is TENSORWISE or ROWWISE and the scales have a form the kernel takes:
    ``a_scale`` one value or one per row of ``a`` (``[M_total]`` / ``[M_total, 1]``); ``b_scale``
    one value, one per expert (``[G]``) or one per expert row (``[G, N]`` / ``[G, N, 1]``)."""
    if mode not in ("TENSORWISE", "ROWWISE"):
        return f"the scaled Gluon grouped path serves TENSORWISE / ROWWISE, not {mode}"
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if a.dim() != 2 or b.dim() != 3:
        return f"a must be [M_total, K] and b [G, N, K], got {tuple(a.shape)} and {tuple(b.shape)}"
    M = a.size(0)
    G, N = b.size(0), b.size(1)
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if not t.is_floating_point() or t.dtype.itemsize < 2:
            return f"{name} must be a float tensor, got {t.dtype}"
    if a_scale.numel() not in (1, M):
        return f"a_scale must hold 1 or M_total={M} values, got shape {tuple(a_scale.shape)}"
    if b_scale.numel() not in (1, G, G * N):
        return f"b_scale must hold 1, G={G} or G*N={G * N} values, got shape {tuple(b_scale.shape)}"
    return None


def _scaled_views(a, a_scale, b, b_scale):
    """TENSORWISE / ROWWISE scales as the BLOCKWISE kernel's operands: ``sa [M, ceil(K/128)]``
    and ``sb [G, ceil(N/128), ceil(K/128)]`` as broadcast views (zero strides: every K block is
    promoted by the same factors), and ``sc [G, N]`` for per-row weight scales (applied to the
    finished tile, COL_SCALE) or None. Returns (sa, sb, sc)."""
    M, K = a.shape
    G, N, _ = b.shape
    kb, nb = -(-K // SCALE_BLOCK), -(-N // SCALE_BLOCK)
    f32 = torch.float32
    sa = a_scale if a_scale.dtype == f32 else a_scale.float()
    sa = sa.reshape(1, 1).expand(M, kb) if sa.numel() == 1 else sa.reshape(M, 1).expand(M, kb)
    sbf = b_scale if b_scale.dtype == f32 else b_scale.float()
    n = sbf.numel()
    sc = None
    if n == G * N and N != 1 and n != 1:
        sc = sbf.reshape(G, N).contiguous()
        sbf, n = _one(b.device), 1
    # one factor, or one per expert
    sb = sbf.reshape(1, 1, 1).expand(G, nb, kb) if n == 1 else sbf.reshape(G, 1, 1).expand(G, nb, kb)
    return sa, sb, sc


def gluon_grouped_scaled_operand_reason(a, a_scale, b, b_scale, group_offs, mode: str,
                                        out_dtype: Optional[torch.dtype] = torch.bfloat16) -> Optional[str]:
    """The operand half of :func:`gluon_grouped_scaled_reason` (no platform test: checkable on CPU)."""
    reason = gluon_grouped_scaled_scale_reason(a, a_scale, b, b_scale, mode)
    if reason is not None:
        return reason
    if a_scale.device != a.device or b_scale.device != a.device:
        return "a, a_scale, b and b_scale must be on one device"
    # the scale views the launch builds (_scaled_views) have the kernel's shapes by construction
    return _ab_reason(a, b, group_offs, out_dtype)


def gluon_grouped_scaled_reason(a, a_scale, b, b_scale, group_offs, mode: str,
                                out_dtype: Optional[torch.dtype] = torch.bfloat16) -> Optional[str]:
    """None when :func:`grouped_gemm_fp8_scaled_gluon` can run these inputs, else why not.
    Never raises, never synchronizes."""
    return _dense._device_reason(gluon_grouped_scaled_operand_reason, gluon_platform_reason,
                                 (a, a_scale, b, b_scale, group_offs, mode, out_dtype))


def grouped_gemm_fp8_scaled_gluon(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                                  group_offs: torch.Tensor, mode: str, out_dtype: torch.dtype = torch.bfloat16,
                                  config: Optional[GluonBlockwiseConfig] = None,
                                  out: Optional[torch.Tensor] = None,
                                  num_programs: Optional[int] = None, checked: bool = False) -> torch.Tensor:
    """TENSORWISE / ROWWISE M-grouped FP8 GEMM on the BLOCKWISE kernel:
    ``out[rows of g] = (a * a_scale)[rows of g] @ (b[g] * b_scale[g])^T``, rows past
    ``group_offs[G]`` zero.

    ``a_scale``: one multiplier, or one per row of ``a``; ``b_scale``: one, one per expert, or
    one per expert row (``[G, N]``: ROWWISE, applied to the finished tile). Each 128-deep K
    block's fp32 partial is promoted into the accumulator as in BLOCKWISE (here with the same
    factors every block), which keeps the sum in IEEE fp32. Other arguments as
    :func:`grouped_gemm_fp8_blockwise_gluon` (``checked``: :func:`gluon_grouped_scaled_reason` has
    just accepted the inputs); raises ValueError naming what it cannot run.
    """
    fk = None
    if out is not None:
        out_dtype = out.dtype
    elif getattr(a, "is_cuda", False):
        fk = _flat_key(("sc", mode), a, a_scale, b, b_scale, group_offs, out_dtype, config, num_programs)
        o = _fast(fk)
        if o is not None:
            return o
    reason = None if checked else gluon_grouped_scaled_reason(a, a_scale, b, b_scale, group_offs, mode, out_dtype)
    reason = reason or _launch_reason(a, b, group_offs, out, num_programs)
    if reason is not None:
        raise ValueError(f"grouped_gemm_fp8_scaled_gluon: {reason}")
    sa, sb, sc = _scaled_views(a, a_scale, b, b_scale)
    return _launch(a, sa, b, sb, group_offs, out_dtype, config, out, num_programs, sc,
                   "grouped_gemm_fp8_scaled_gluon", fk, (a, a_scale, b, b_scale, group_offs))


# last: the 16-bit launcher module imports this one's ``_group_rows`` (a cycle either way round)
from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as _gg  # noqa: E402
