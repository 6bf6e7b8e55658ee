"""Hopper Gluon candidate for ``quantize_fp8_with_trans`` of bf16 input to E4M3 with MX groupings
(1 x 32 row blocks and 32 x 1 column blocks, E8M0 scales) or BLOCKWISE ones (1 x 128 / 128 x 1,
fp32 scales): the row-wise copy ``q [rows, cols]`` and the column-wise copy stored transposed,
``qt [cols, rows]``, from one read.

Why another form: the pair kernel (quant_fp8_packed.py) holds its tile in registers in one layout,
so one of the two block reductions crosses threads and warps (shuffles, a shared-memory round trip
and barriers) and the transposed copy is formed by a shared-memory transpose of its words: 0.81x
the device copy on the H200, and with every store left out its loads and reductions alone run at
~2.3 TB/s of input (benchmarks/results/h200/NOTES.md, fourteenth session). Here each program's
``[128, 32]`` tile arrives in shared memory by TMA (no register staging of the load) and is read
from there twice, in the layout each copy wants:

* row pass: a thread holds whole rows of the tile (32 columns = one 1 x 32 block), so the block
  amax, the E8M0 scale and the codes are in-thread; each thread stores 32 code bytes of a row;
* column pass: the tile viewed as ``[4, 32, 32]`` (four 32-row blocks), a thread holding the 32
  rows of one block for 2 adjacent columns (4-byte shared-memory loads), so the column block
  amax is in-thread too; the codes' registers are renamed so a column's 32 rows are
  register-consecutive (a layout of the same thread ownership: no data movement) and each
  thread stores 32 contiguous bytes of two rows of the transposed copy.

For MX no value crosses a thread, there is no barrier but the TMA's, and the two passes compute their
codes from their own loads (forms that store one code value twice miscompile on sm_90 with Triton
3.6: docs/design.md). The scale and the cast are the tl kernels' helpers (``_mx_scales``,
``_fp8_codes``), so the bytes equal the pair kernel's and the reference's.

BLOCKWISE (1 x 128 row blocks, 128 x 1 column blocks, fp32 scales) runs the same plan on a
``[128, 128]`` tile staged as two ``[128, 64]`` TMA boxes: the row pass holds a whole row per thread
(both halves: the block amax and the IEEE-divided scale are formed once per row, by the thread that
owns it); the column pass holds 32 rows of two columns per thread, so a column block's amax is an
in-thread max and a two-step butterfly over the four lanes that share the column.

Status: a candidate, off by default (``PRIMUS_TURBO_FP8_DUAL_GLUON``): compiled for sm_90 on CPU,
not yet run on a GPU. :func:`fp8_dual_gluon_reason` says why a call cannot take it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, gluon_platform_reason
from primus_turbo.triton.launch import launch

from .quant_fp8_kernel import fp8_max_of, mx_emax_of

__all__ = ["FP8_DUAL_GLUON_ENV", "fp8_dual_gluon", "fp8_dual_gluon_enabled", "fp8_dual_gluon_reason"]

FP8_DUAL_GLUON_ENV = "PRIMUS_TURBO_FP8_DUAL_GLUON"
_TR, _TC, _G = 128, 32, 32  # MX: tile rows, tile columns (one 1 x 32 block wide), block
_WARPS = 2  # MX: 64 threads, two rows each in the row pass, one (block, column pair) each in the column pass
_BW, _BW_HALF, _BW_WARPS = 128, 64, 4  # BLOCKWISE: 128 x 128 tiles as two 128 x 64 boxes, 4 warps
# (ring depth, persistent programs per SM): MX 8 KB a stage and ~6 K registers a program;
# BLOCKWISE 32 KB a stage and ~23 K registers a program (two fit an SM's 64 K)
MX_LAUNCH = (4, 6)
BW_LAUNCH = (2, 2)

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from primus_turbo.triton.gemm.gemm_fp8_gluon import _desc_unchecked

    from .quant_fp8_kernel import _abs_bits, _fp8_codes, _fp32_scales, _mx_scales

    @gluon.jit
    def _row_pass(buf, q_ptr, s_ptr, r0, c0, tile_c, rows, cols, n_sc,
                  FP8_MAX: gl.constexpr, EMAX: gl.constexpr, EVEN: gl.constexpr):
        """Rows of the tile: one 1 x 32 block per row, in-thread."""
        TR: gl.constexpr = buf.type.shape[0]
        TC: gl.constexpr = buf.type.shape[1]
        RL: gl.constexpr = gl.BlockedLayout([1, TC], [32, 1], [gl.num_warps(), 1], [1, 0])
        x = buf.load(RL).to(gl.float32)
        mult, byte = _mx_scales(gl.max(_abs_bits(x), axis=1), EMAX)
        codes = _fp8_codes(x * gl.expand_dims(mult, 1), FP8_MAX, True, False)
        r = r0 + gl.arange(0, TR, layout=gl.SliceLayout(1, RL))
        c = c0 + gl.arange(0, TC, layout=gl.SliceLayout(0, RL))
        ptrs = q_ptr + gl.expand_dims(r.to(gl.int64) * cols, 1) + gl.expand_dims(c, 0)
        s_ptrs = s_ptr + r.to(gl.int64) * n_sc + tile_c
        if EVEN:
            gl.store(ptrs, codes)
            gl.store(s_ptrs, byte.to(gl.uint8))
        else:
            gl.store(ptrs, codes, mask=gl.expand_dims(r < rows, 1) & gl.expand_dims(c < cols, 0))
            gl.store(s_ptrs, byte.to(gl.uint8), mask=r < rows)

    @gluon.jit
    def _col_pass(buf, qt_ptr, st_ptr, r0, c0, tile_r, rows, cols, n_str,
                  FP8_MAX: gl.constexpr, EMAX: gl.constexpr, EVEN: gl.constexpr):
        """Columns of the tile: the [NB, 32, TC] view, one 32 x 1 block of two columns per thread."""
        TR: gl.constexpr = buf.type.shape[0]
        TC: gl.constexpr = buf.type.shape[1]
        G: gl.constexpr = 32
        NB: gl.constexpr = TR // G
        LANES_C: gl.constexpr = TC // 2
        # blocks over (lanes, warps), the block's rows in-thread, column pairs over lanes; the
        # pair's two columns register-fastest (4-byte shared-memory loads)
        CL: gl.constexpr = gl.BlockedLayout([1, G, 2], [32 // LANES_C, 1, LANES_C], [gl.num_warps(), 1, 1],
                                            [2, 1, 0])
        # the same ownership with a block's rows register-fastest (the transposed copy's bytes)
        CLT: gl.constexpr = gl.BlockedLayout([1, G, 2], [32 // LANES_C, 1, LANES_C], [gl.num_warps(), 1, 1],
                                             [1, 2, 0])
        gl.static_assert(NB == (32 // LANES_C) * gl.num_warps(), "one 32-row block per thread")
        x = buf.reshape([NB, G, TC]).load(CL).to(gl.float32)
        mult, byte = _mx_scales(gl.max(_abs_bits(x), axis=1), EMAX)  # [NB, TC]
        codes = _fp8_codes(x * gl.expand_dims(mult, 1), FP8_MAX, True, False)
        codes = gl.convert_layout(codes, CLT)
        blk = gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, CLT)))
        rr = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, CLT)))
        cc = gl.arange(0, TC, layout=gl.SliceLayout(0, gl.SliceLayout(1, CLT)))
        r3 = r0 + gl.expand_dims(gl.expand_dims(blk * G, 1) + gl.expand_dims(rr, 0), 2)  # [NB, G, 1]
        c3 = c0 + gl.expand_dims(gl.expand_dims(cc, 0), 1)  # [1, 1, TC]
        ptrs = qt_ptr + c3.to(gl.int64) * rows + r3
        # scales: [NB, TC] in the reduction's layout
        SL: gl.constexpr = gl.SliceLayout(1, CL)
        sb = gl.arange(0, NB, layout=gl.SliceLayout(1, SL))
        sc = c0 + gl.arange(0, TC, layout=gl.SliceLayout(0, SL))
        st_ptrs = st_ptr + gl.expand_dims(sc.to(gl.int64) * n_str, 0) + gl.expand_dims(tile_r * NB + sb, 1)
        if EVEN:
            gl.store(ptrs, codes)
            gl.store(st_ptrs, byte.to(gl.uint8))
        else:
            gl.store(ptrs, codes, mask=(r3 < rows) & (c3 < cols))
            sr = tile_r * NB + sb
            gl.store(st_ptrs, byte.to(gl.uint8),
                     mask=gl.expand_dims(sr * G < rows, 1) & gl.expand_dims(sc < cols, 0))

    @gluon.jit
    def _tile_load(x_desc, bufs, bars, s, t, n_tc, NBOX: gl.constexpr):
        """TMA of tile ``t`` (row-major over [n_tr, n_tc] tiles of NBOX boxes side by side) into
        ring slot ``s`` (buffers ``NBOX * s ..``), completing on ``bars[s]``."""
        TR: gl.constexpr = x_desc.block_type.shape[0]
        TB: gl.constexpr = x_desc.block_type.shape[1]
        bar = bars.index(s)
        mbarrier.expect(bar, NBOX * x_desc.block_type.nbytes)  # TMA counts zero-filled bytes too
        for j in gl.static_range(NBOX):
            tma.async_copy_global_to_shared(x_desc, [(t // n_tc) * TR, (t % n_tc) * (NBOX * TB) + j * TB], bar,
                                            bufs.index(NBOX * s + j))

    @gluon.jit
    def _fp8_dual_mx_gluon_kernel(x_desc, q_ptr, s_ptr, qt_ptr, st_ptr, rows, cols, n_tiles, n_tc, n_sc, n_str,
                                  FP8_MAX: gl.constexpr, EMAX: gl.constexpr, EVEN: gl.constexpr,
                                  STAGES: gl.constexpr):
        """Persistent: program ``pid`` works tiles ``pid, pid + nprog, ...`` of [TR, TC]; each arrives
        in a STAGES-deep shared-memory ring by TMA, issued STAGES tiles ahead, then the row and the
        column pass read it."""
        TR: gl.constexpr = x_desc.block_type.shape[0]
        TC: gl.constexpr = x_desc.block_type.shape[1]
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_my = (n_tiles - pid + nprog - 1) // nprog
        bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, TR, TC], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(bars.index(j), count=1)
        for j in gl.static_range(STAGES):
            if j < n_my:
                _tile_load(x_desc, bufs, bars, j, pid + j * nprog, n_tc, 1)
        for i in range(n_my):
            slot = i % STAGES
            t = pid + i * nprog
            tile_r = t // n_tc
            tile_c = t % n_tc
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            buf = bufs.index(slot)
            _row_pass(buf, q_ptr, s_ptr, tile_r * TR, tile_c * TC, tile_c, rows, cols, n_sc, FP8_MAX, EMAX, EVEN)
            _col_pass(buf, qt_ptr, st_ptr, tile_r * TR, tile_c * TC, tile_r, rows, cols, n_str, FP8_MAX, EMAX, EVEN)
            # every warp has read the slot before the TMA refills it (generic reads, then async writes)
            gl.thread_barrier()
            fence_async_shared()
            if i + STAGES < n_my:
                _tile_load(x_desc, bufs, bars, slot, t + STAGES * nprog, n_tc, 1)
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(j))

    @gluon.jit
    def _bw_row_half(x, scale, q_ptr, r, c, rows, cols, FP8_MAX: gl.constexpr, EVEN: gl.constexpr):
        codes = _fp8_codes(x * gl.expand_dims(scale, 1), FP8_MAX, True, False)
        ptrs = q_ptr + gl.expand_dims(r.to(gl.int64) * cols, 1) + gl.expand_dims(c, 0)
        if EVEN:
            gl.store(ptrs, codes)
        else:
            gl.store(ptrs, codes, mask=gl.expand_dims(r < rows, 1) & gl.expand_dims(c < cols, 0))

    @gluon.jit
    def _bw_col_half(buf, qt_ptr, st_ptr, r0, c0, tile_r, rows, cols, n_str,
                     FP8_MAX: gl.constexpr, EVEN: gl.constexpr):
        """128 x 1 column blocks of one [128, 64] half: 32 rows x 2 columns per thread, four lanes
        along the rows (the amax: in-thread, then two shuffle steps), 32 contiguous bytes of two rows
        of the transposed copy per thread."""
        TR: gl.constexpr = buf.type.shape[0]
        TC: gl.constexpr = buf.type.shape[1]
        W: gl.constexpr = gl.num_warps()
        CL: gl.constexpr = gl.BlockedLayout([TR // 4, 2], [4, 8], [1, W], [1, 0])
        # CL's lanes and warps (a BlockedLayout's order would also reorder the lanes), with a
        # thread's 32 rows register-fastest: the conversion renames registers, the column's 32
        # bytes leave as two 16-byte stores
        CLT: gl.constexpr = gl.DistributedLinearLayout(
            [[1, 0], [2, 0], [4, 0], [8, 0], [16, 0], [0, 1]], [[0, 2], [0, 4], [0, 8], [32, 0], [64, 0]],
            [[0, 16], [0, 32]], [], [128, 64])
        gl.static_assert(TR == 128 and TC == 64 and W == 4, "CLT is written for 128 x 64 halves and 4 warps")
        x = buf.load(CL).to(gl.float32)
        scale, scale_inv = _fp32_scales(gl.max(_abs_bits(x), axis=0), FP8_MAX)  # [TC]
        codes = gl.convert_layout(_fp8_codes(x * gl.expand_dims(scale, 0), FP8_MAX, True, False), CLT)
        r = r0 + gl.arange(0, TR, layout=gl.SliceLayout(1, CLT))
        c = c0 + gl.arange(0, TC, layout=gl.SliceLayout(0, CLT))
        ptrs = qt_ptr + gl.expand_dims(c.to(gl.int64) * rows, 0) + gl.expand_dims(r, 1)
        sc = c0 + gl.arange(0, TC, layout=gl.SliceLayout(0, CL))
        s_ptrs = st_ptr + sc.to(gl.int64) * n_str + tile_r
        if EVEN:
            gl.store(ptrs, codes)
            gl.store(s_ptrs, scale_inv)
        else:
            gl.store(ptrs, codes, mask=gl.expand_dims(r < rows, 1) & gl.expand_dims(c < cols, 0))
            gl.store(s_ptrs, scale_inv, mask=sc < cols)

    @gluon.jit
    def _bw_tile(b0, b1, q_ptr, s_ptr, qt_ptr, st_ptr, r0, c0, tile_r, tile_c, rows, cols, n_sc, n_str,
                 FP8_MAX: gl.constexpr, EVEN: gl.constexpr):
        """Both copies of one [128, 128] tile held as two [128, 64] shared-memory halves."""
        TR: gl.constexpr = b0.type.shape[0]
        TH: gl.constexpr = b0.type.shape[1]
        # row pass: a thread owns one row of both halves
        RL: gl.constexpr = gl.BlockedLayout([1, TH], [32, 1], [gl.num_warps(), 1], [1, 0])
        x0 = b0.load(RL).to(gl.float32)
        x1 = b1.load(RL).to(gl.float32)
        amax = gl.maximum(gl.max(_abs_bits(x0), axis=1), gl.max(_abs_bits(x1), axis=1))
        scale, scale_inv = _fp32_scales(amax, FP8_MAX)
        r = r0 + gl.arange(0, TR, layout=gl.SliceLayout(1, RL))
        c = c0 + gl.arange(0, TH, layout=gl.SliceLayout(0, RL))
        _bw_row_half(x0, scale, q_ptr, r, c, rows, cols, FP8_MAX, EVEN)
        _bw_row_half(x1, scale, q_ptr, r, c + TH, rows, cols, FP8_MAX, EVEN)
        s_ptrs = s_ptr + r.to(gl.int64) * n_sc + tile_c
        if EVEN:
            gl.store(s_ptrs, scale_inv)
        else:
            gl.store(s_ptrs, scale_inv, mask=r < rows)
        # column pass, half by half
        _bw_col_half(b0, qt_ptr, st_ptr, r0, c0, tile_r, rows, cols, n_str, FP8_MAX, EVEN)
        _bw_col_half(b1, qt_ptr, st_ptr, r0, c0 + TH, tile_r, rows, cols, n_str, FP8_MAX, EVEN)

    @gluon.jit
    def _fp8_dual_blockwise_gluon_kernel(x_desc, q_ptr, s_ptr, qt_ptr, st_ptr, rows, cols, n_tiles, n_tc, n_sc,
                                         n_str, FP8_MAX: gl.constexpr, EVEN: gl.constexpr, STAGES: gl.constexpr):
        """Persistent, as the MX kernel: [128, 128] tiles as two [128, 64] TMA boxes in a STAGES-deep
        ring; BLOCKWISE 1 x 128 / 128 x 1."""
        TR: gl.constexpr = x_desc.block_type.shape[0]
        TH: gl.constexpr = x_desc.block_type.shape[1]
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_my = (n_tiles - pid + nprog - 1) // nprog
        bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, TR, TH], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(bars.index(j), count=1)
        for j in gl.static_range(STAGES):
            if j < n_my:
                _tile_load(x_desc, bufs, bars, j, pid + j * nprog, n_tc, 2)
        for i in range(n_my):
            slot = i % STAGES
            t = pid + i * nprog
            tile_r = t // n_tc
            tile_c = t % n_tc
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            _bw_tile(bufs.index(2 * slot), bufs.index(2 * slot + 1), q_ptr, s_ptr, qt_ptr, st_ptr, tile_r * TR,
                     tile_c * (2 * TH), tile_r, tile_c, rows, cols, n_sc, n_str, FP8_MAX, EVEN)
            gl.thread_barrier()
            fence_async_shared()
            if i + STAGES < n_my:
                _tile_load(x_desc, bufs, bars, slot, t + STAGES * nprog, n_tc, 2)
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(j))


def _mx(row, col) -> Optional[bool]:
    """True for MX 1 x 32 / 32 x 1, False for BLOCKWISE 1 x 128 / 128 x 1, None otherwise."""
    key = (row.mode, row.gr, row.gc, col.mode, col.gr, col.gc)
    if key == (1, 1, _G, 1, _G, 1):
        return True
    if key == (0, 1, _BW, 0, _BW, 1):
        return False
    return None


def fp8_dual_gluon_reason(x: torch.Tensor, out_dtype, row, col) -> Optional[str]:
    """None when the candidate takes ``x`` with groupings ``row`` / ``col`` MX (1 x 32 / 32 x 1) or
    BLOCKWISE (1 x 128 / 128 x 1), E4M3: bf16 2-D, unit column stride, 16-byte aligned base and row
    stride (TMA), sm_90."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
        return "x must be a 2-D bfloat16 tensor"
    if out_dtype != torch.float8_e4m3fn:
        return f"out_dtype {out_dtype}: E4M3 only"
    if _mx(row, col) is None:
        return f"groupings {row} / {col}: MX 1 x 32 / 32 x 1 or BLOCKWISE 1 x 128 / 128 x 1 only"
    if x.numel() == 0:
        return "empty input"
    if x.stride(1) != 1 or (x.stride(0) * 2) % 16 or x.data_ptr() % 16:
        return f"x needs unit column stride and 16-byte aligned base and rows (strides {tuple(x.stride())})"
    return gluon_platform_reason(x.device)


def fp8_dual_gluon_enabled() -> bool:
    """``PRIMUS_TURBO_FP8_DUAL_GLUON``: 1 runs the candidate where it can; auto / 0 do not (not
    yet validated on a GPU). Read per call."""
    from primus_turbo.pytorch.core.env import env_auto_flag

    return env_auto_flag(FP8_DUAL_GLUON_ENV) is True


@functools.lru_cache(maxsize=None)
def _smem_layout(cols: int = _TC):
    return gl.NVMMASharedLayout.get_default_for([_TR, cols], gl.bfloat16)


def _sm_count(device: torch.device) -> int:
    """SMs of ``device`` (132 where it is not CUDA: the sm_90 compile tests only build the launch)."""
    if device.type != "cuda":
        return 132
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fp8_dual_gluon(x: torch.Tensor, out_dtype, row, col, out: Optional[tuple] = None,
                   stages: Optional[int] = None, ctas_per_sm: Optional[int] = None) -> tuple:
    """``(q, s, qt, st)`` as ``fp8_packed_with_trans_launch`` returns them for E4M3: MX (``s``
    ``[rows, ceil(cols/32)]`` and ``st`` ``[cols, ceil(rows/32)]`` E8M0 bytes as uint8) or BLOCKWISE
    (``[rows, ceil(cols/128)]`` / ``[cols, ceil(rows/128)]`` fp32 scale_inv). ``out``: the four
    outputs to fill (tests pass poisoned ones). Raises ValueError when :func:`fp8_dual_gluon_reason`
    refuses. ``stages`` (ring depth) and ``ctas_per_sm`` (persistent programs per SM) default to
    :data:`MX_LAUNCH` / :data:`BW_LAUNCH`."""
    reason = fp8_dual_gluon_reason(x, out_dtype, row, col)
    if reason is not None:
        raise ValueError(f"fp8_dual_gluon: {reason}")
    rows, cols = x.shape
    if _mx(row, col):
        g, box, sdt, kernel = _G, [_TR, _TC], torch.uint8, _fp8_dual_mx_gluon_kernel
        consts = dict(EMAX=mx_emax_of(out_dtype), num_warps=_WARPS)
        d_stages, d_ctas = MX_LAUNCH
    else:
        g, box, sdt, kernel = _BW, [_BW, _BW_HALF], torch.float32, _fp8_dual_blockwise_gluon_kernel
        consts = dict(num_warps=_BW_WARPS)
        d_stages, d_ctas = BW_LAUNCH
    stages = d_stages if stages is None else int(stages)
    ctas_per_sm = d_ctas if ctas_per_sm is None else int(ctas_per_sm)
    if stages < 1 or ctas_per_sm < 1:
        raise ValueError(f"fp8_dual_gluon: stages and ctas_per_sm must be >= 1, got {stages}, {ctas_per_sm}")
    # a program's columns: one MX block, or a BLOCKWISE block (as two boxes); its rows: _TR (= _BW)
    n_sc, n_str = -(-cols // g), -(-rows // g)
    if out is None:
        dev = x.device
        q = torch.empty((rows, cols), dtype=out_dtype, device=dev)
        s = torch.empty((rows, n_sc), dtype=sdt, device=dev)
        qt = torch.empty((cols, rows), dtype=out_dtype, device=dev)
        st = torch.empty((cols, n_str), dtype=sdt, device=dev)
    else:
        q, s, qt, st = out
    n_tc = n_sc
    n_tiles = -(-rows // _TR) * n_tc
    desc = _desc_unchecked(x, [rows, cols], [x.stride(0), 1], box, _smem_layout(box[1]))
    launch(kernel, (min(n_tiles, ctas_per_sm * _sm_count(x.device)),),
           (desc, q.view(torch.uint8), s, qt.view(torch.uint8), st, rows, cols, n_tiles, n_tc, n_sc, n_str),
           dict(FP8_MAX=fp8_max_of(out_dtype), EVEN=rows % _TR == 0 and cols % g == 0, STAGES=stages, **consts),
           x.device)
    return q, s, qt, st
