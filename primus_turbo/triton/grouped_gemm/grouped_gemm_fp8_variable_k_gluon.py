"""Hopper (sm_90) Gluon kernel for the variable-K grouped BLOCKWISE FP8 GEMM: the MoE experts' wgrad.

``out[g] (+)= sum_{kb in group g} (x_t[:, kb] @ y_t[:, kb]^T) * sx[:, kb] (x) sy[:, kb]``, i.e.
``out[g] (+)= (x_t * sx)[:, tokens of g] @ ((y_t * sy)[:, tokens of g])^T`` with fp32 accumulation:
``x_t [P, M_total]`` and ``y_t [Q, M_total]`` FP8, E4M3 or E5M2 each (the column-wise copies of the
wgrad's two operands, stored transposed so the tokens are contiguous; HYBRID's E5M2 output
gradient times the E4M3 activation is one mixed-type ``wgmma``), ``sx [P, M_total/128]`` and
``sy [Q, M_total/128]`` fp32 dequantization multipliers of 1 x 128 token blocks, ``group_offs
[G+1]`` int64 on the device with **every offset a multiple of 128** (the op pads each group's token
segment to whole blocks, so no block straddles two experts; not checkable without a host sync),
``out [G, P, Q]``. The same product as the BLOCKWISE mode of ``_grouped_gemm_fp8_variable_k_kernel``
(grouped_gemm_fp8_kernel.py); only the summation order of the fp32 promotions differs.

Why a second kernel: the tl kernel promotes each 128-token partial right after its dot, so the
tensor cores idle during every promotion (333 TFLOP/s on the H200 for DeepSeek-V3's expert
shapes). This one is the dense Gluon kernel's per-row-B-scale path (``B_ROW_SCALES`` of
triton/gemm/gemm_fp8_gluon.py: one scale per output row from ``sx`` and one per output column from
``sy`` per 128-deep K block, exactly the wgrad's scale structure) walked over a grouped schedule,
and reuses its helpers (``_load_tile``, ``_mainloop_rows``, ``_store_sub``, ``_tile_coords``,
the launcher's ``_column_major_padded``), so a fix there is a fix here:

* persistent grid over the static tile list ``(g, pid_p, pid_q)``, ``G * ceil(P/128) *
  ceil(Q/128)`` tiles taken round-robin (tile ``t`` by program ``t % num_programs``), tiles of one
  expert consecutive and GROUP_M-swizzled inside it (neighbouring CTAs share the expert's token
  slices in L2). Only the K range depends on the device: every partition reads
  ``group_offs[g], group_offs[g+1]`` itself (clamped to ``[0, M_total]`` and non-decreasing, as
  the tl kernel), so the producer and the consumers agree on every tile and nothing is read on the
  host;
* the producer warp TMA-loads x_t rows ``[off_p, off_p + 128)`` (two 64-row halves) and y_t rows
  ``[off_q, off_q + BLOCK_N)`` at token columns ``offs[g] + 128 kb`` into the STAGES-deep ring; rows past
  P or Q arrive zero-filled;
* the two consumer warpgroups run the dense kernel's per-row-B-scale main loop (``_mainloop_rows``:
  pipelined or 256-wide with the token blocks' ``sy`` scales TMA'd into the ring with y_t, or the
  128-wide register path) on their 64 rows, with the scales moved to the group's first token
  block; an empty group runs no main loop;
* epilogue through shared memory and TMA into the ``[G * P, Q]`` view of ``out`` (clipped at Q;
  ``P % 64 == 0`` keeps every warpgroup half inside its expert, and a half wholly past P is not
  stored). Without accumulation an empty group stores zeros. With accumulation (Megatron
  ``main_grad``, fp32) the tile goes out as a TMA **reduce-add** (``cp.reduce.async.bulk.tensor
  .add.f32``): L2 adds it to ``out`` in fp32, the same ``out + acc`` rounding as a load-add-store,
  without reading ``out`` into the SM or stalling on it; an empty group stores nothing (``+= 0``).

Requirements (:func:`gluon_variable_k_blockwise_reason` returns the first that fails): CUDA sm_90,
Gluon importable, FP8 (E4M3 / E5M2) operands with a unit token stride and 16-byte aligned rows, a token
dim that is a multiple of 128, ``P % 64 == 0``, scales of the shapes above (any strides), int64
offsets, an output dtype bf16 / fp16 / fp32 with 16-byte aligned rows of Q elements, ``out``
mergeable into ``[G * P, Q]``, accumulation only into fp32. Anything else goes to the tl kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from primus_turbo.triton.gemm import gemm_fp8_gluon as _dense
from primus_turbo.triton.gemm.gemm_fp8_gluon import (
    GLUON_AVAILABLE,
    SCALE_BLOCK,
    GluonBlockwiseConfig,
    gluon_platform_reason,
)

__all__ = [
    "VARIABLE_K_DEFAULT_CONFIG",
    "gluon_variable_k_blockwise_reason",
    "gluon_variable_k_operand_reason",
    "grouped_gemm_fp8_variable_k_blockwise_gluon",
    "variable_k_default_config",
]

# The pipelined B_ROW_SCALES config (n128s5xr240w24: column scales TMA'd through the ring; see
# _dense.ROW_SCALES_PIPELINED_CONFIG), which fits next to an fp32 staging buffer as is. H200
# (2026-11-30, check_gluon_fp8.py --grouped-wgrad, DeepSeek-V3 EP8): 1.57x the tl kernel and 1.51x
# BF16 torch._grouped_mm, against 1.51x / 1.31x for n256s3c2 and 1.25x / 1.08x for the register
# path n128s6 (the default before), which stay selectable.
VARIABLE_K_DEFAULT_CONFIG = _dense.ROW_SCALES_PIPELINED_CONFIG

_TMA_REDUCE_ERROR = ""
if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from primus_turbo.triton.gemm.gemm_fp8_gluon import (
        SCALE_N,
        _mainloop_rows,
        _store_sub,
        _tile_coords,
    )
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_gluon import _group_rows

    try:
        # Gluon's Hopper ``tma`` module has no reduce store yet, but its op builder has the TMA
        # reduce op (``ttng.async_tma_reduce``, which tl's ``descriptor.atomic_add`` lowers to).
        # A private hook: when a Triton release moves it, accumulation falls back to the tl kernel.
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        _REDUCE_ADD = _ir.DESCRIPTOR_REDUCE_KIND.ADD

        @_builtin
        def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """``global[box at coord] += src`` (shared memory), asynchronous like a TMA store: it
            joins the same bulk group, so ``tma.store_wait`` also waits for it to read ``src``."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_REDUCE_ADD, tensor_desc.handle, coord, src.handle)

        _TMA_REDUCE_OK = True
    except Exception as _exc:  # noqa: BLE001 - any failure means "no TMA reduce here"
        _TMA_REDUCE_OK = False
        _TMA_REDUCE_ERROR = f"{type(_exc).__name__}: {_exc}"
else:
    _TMA_REDUCE_OK = False
    _TMA_REDUCE_ERROR = "Gluon is not importable"


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
if GLUON_AVAILABLE:

    @gluon.jit
    def _vk_tile(tile_id, tiles_per_group, num_pid_p, num_pid_q, offs_ptr, G, M,
                 BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr):
        """tile_id -> (g, pid_p, pid_q, first token, K blocks): one function for the producer and
        the consumers, so they agree on every tile."""
        g = tile_id // tiles_per_group
        pid_p, pid_q = _tile_coords(tile_id - g * tiles_per_group, num_pid_p, num_pid_q, GROUP_M)
        k_start, k_end = _group_rows(offs_ptr, g, G, M)
        return g, pid_p, pid_q, k_start, gl.cdiv(k_end - k_start, BLOCK_K)

    @gluon.jit
    def _vk_producer(x_desc, y_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, P, Q, G,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, sy_desc=None, sb_bufs=None):
        """One warp: per tile, the TMA loads of the group's token blocks (none for an empty group);
        with ``sy_desc`` also each block's column scales (see _dense._load_tile)."""
        HALF_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = y_desc.block_type.shape[0]
        num_pid_p = gl.cdiv(P, 2 * HALF_M)
        num_pid_q = gl.cdiv(Q, BLOCK_N)
        tiles_per_group = num_pid_p * num_pid_q
        it = 0
        for tile_id in range(gl.program_id(0), G * tiles_per_group, gl.num_programs(0)):
            g, pid_p, pid_q, k_start, k_tiles = _vk_tile(tile_id, tiles_per_group, num_pid_p, num_pid_q, offs_ptr,
                                                         G, M, BLOCK_K, GROUP_M)
            it = _dense._load_tile(x_desc, y_desc, a_bufs, b_bufs, ready, empty, pid_p * (2 * HALF_M),
                                   pid_q * BLOCK_N, k_tiles, it, STAGES, k_start, sy_desc, sb_bufs)

    @gluon.jit
    def _reduce_sub(c_desc, c_bufs, acc, off_m, off_n, st, WG: gl.constexpr, C_BUFS: gl.constexpr):
        """``_store_sub`` with a TMA reduce-add instead of the store (the same staging-buffer
        rotation; see there): ``out[box] += acc``, added in L2."""
        c_buf = c_bufs.index(WG * C_BUFS + st % C_BUFS)
        tma.store_wait(pendings=C_BUFS - 1)
        c_buf.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_reduce_add(c_desc, [off_m, off_n], c_buf)
        return st + 1

    @gluon.jit
    def _vk_consumer(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sx_ptr, sy_ptr, offs_ptr, M, P, Q, G,
                     stride_sxp, stride_sxk, stride_syk,
                     WG: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, C_BUFS: gl.constexpr,
                     ACCUMULATE: gl.constexpr, PIPELINE: gl.constexpr, sb_bufs=None):
        """One warpgroup: rows [WG*64, WG*64+64) of every tile: MMA, promotion, store. ``sb_bufs``:
        the column scales arrive through the ring (BLOCK_N 256 or PIPELINE, see _dense._mainloop_rows)."""
        HALF_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
        N_SUB: gl.constexpr = BLOCK_N // SCALE_N
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, SCALE_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        num_pid_p = gl.cdiv(P, 2 * HALF_M)
        num_pid_q = gl.cdiv(Q, BLOCK_N)
        tiles_per_group = num_pid_p * num_pid_q
        cols = gl.arange(0, SCALE_N, layout=gl.SliceLayout(0, mma_layout))  # the register path's columns
        it = 0
        st = 0
        for tile_id in range(gl.program_id(0), G * tiles_per_group, gl.num_programs(0)):
            g, pid_p, pid_q, k_start, k_tiles = _vk_tile(tile_id, tiles_per_group, num_pid_p, num_pid_q, offs_ptr,
                                                         G, M, BLOCK_K, GROUP_M)
            off_p = pid_p * (2 * HALF_M) + WG * HALF_M
            off_q = pid_q * BLOCK_N
            acc = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
            acc1 = acc
            if N_SUB == 2:
                acc1 = gl.zeros([HALF_M, SCALE_N], gl.float32, mma_layout)
            if k_tiles > 0:  # an empty group loads nothing: not even block 0's scales (past the end)
                kb0 = k_start // BLOCK_K
                offs_p = off_p + gl.arange(0, HALF_M, layout=row_layout)
                sx_rows = sx_ptr + offs_p.to(gl.int64) * stride_sxp + kb0 * stride_sxk
                # sy (register path): [M_total/128, Q padded to 128] (unit stride along Q), see
                # _column_major_padded
                sy_tile = sy_ptr + kb0.to(gl.int64) * stride_syk + off_q
                acc, acc1, it = _mainloop_rows(acc, acc1, a_bufs, b_bufs, sb_bufs, ready, empty, it, k_tiles,
                                               sx_rows, offs_p < P, sy_tile, cols, stride_sxk, stride_syk, mma_layout,
                                               WG, STAGES, N_SUB, PIPELINE)
            if off_p < P:  # P % 64 == 0: a half is wholly inside expert g's rows or wholly past them
                # a 128-column half wholly past Q (BLOCK_N 256) is clipped away by TMA
                if ACCUMULATE:
                    if k_tiles > 0:  # out[g] += 0 for an empty group: nothing to send
                        st = _reduce_sub(c_desc, c_bufs, acc, g * P + off_p, off_q, st, WG, C_BUFS)
                        if N_SUB == 2:
                            st = _reduce_sub(c_desc, c_bufs, acc1, g * P + off_p, off_q + SCALE_N, st, WG, C_BUFS)
                else:
                    st = _store_sub(c_desc, c_bufs, acc, g * P + off_p, off_q, st, WG, 0, C_BUFS)
                    if N_SUB == 2:
                        st = _store_sub(c_desc, c_bufs, acc1, g * P + off_p, off_q, st, WG, 1, C_BUFS)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_gemm_fp8_variable_k_ws_kernel(
        x_desc, y_desc, c_desc,
        sx_ptr, sy_ptr, offs_ptr,
        M, P, Q, G,
        stride_sxp, stride_sxk, stride_syk,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, C_BUFS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        # constexpr: the reduce-add epilogue replaces the store, and an empty group's tile is skipped
        ACCUMULATE: gl.constexpr,
        PIPELINE: gl.constexpr = False,
        sy_desc=None,
    ):
        """out[g] (+)= sum over g's token blocks kb of (X_kb @ Y_kb^T) * sx[:, kb] (x) sy[:, kb].

        Descriptors: x_desc boxes [64, 128] of x_t [P, M_total], y_desc [BLOCK_N, 128] of y_t
        [Q, M_total], c_desc [64, 128] of the [G * P, Q] output view; sy_desc (BLOCK_N 256 or
        PIPELINE) [1, BLOCK_N] of the [M_total/128, Q] scale grid (sy transposed), the column
        scales then travel through the ring (None: the consumers read them from sy_ptr)."""
        HALF_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = y_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(y_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], y_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 * C_BUFS, HALF_M, SCALE_N], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the producer's expect + TMA bytes
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        # two spellings because warp_specialize's argument tuples cannot carry a None
        if sy_desc is None:
            gl.warp_specialize([
                (_vk_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sx_ptr, sy_ptr, offs_ptr, M, P, Q, G,
                                stride_sxp, stride_sxk, stride_syk, 0, GROUP_M, STAGES, C_BUFS, ACCUMULATE, PIPELINE)),
                (_vk_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sx_ptr, sy_ptr, offs_ptr, M, P, Q, G,
                                stride_sxp, stride_sxk, stride_syk, 1, GROUP_M, STAGES, C_BUFS, ACCUMULATE, PIPELINE)),
                (_vk_producer, (x_desc, y_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, P, Q, G, GROUP_M, STAGES)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            sb_bufs = gl.allocate_shared_memory(sy_desc.dtype, [STAGES, 1, BLOCK_N], sy_desc.layout)
            gl.warp_specialize([
                (_vk_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sx_ptr, sy_ptr, offs_ptr, M, P, Q, G,
                                stride_sxp, stride_sxk, stride_syk, 0, GROUP_M, STAGES, C_BUFS, ACCUMULATE, PIPELINE,
                                sb_bufs)),
                (_vk_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, sx_ptr, sy_ptr, offs_ptr, M, P, Q, G,
                                stride_sxp, stride_sxk, stride_syk, 1, GROUP_M, STAGES, C_BUFS, ACCUMULATE, PIPELINE,
                                sb_bufs)),
                (_vk_producer, (x_desc, y_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, P, Q, G, GROUP_M, STAGES,
                                sy_desc, sb_bufs)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HALF_M = 64
_FP8_OK = (torch.float8_e4m3fn, torch.float8_e5m2)  # wgmma takes either for A and B


def gluon_variable_k_operand_reason(x_t, sx, y_t, sy, group_offs, out: Optional[torch.Tensor] = None,
                                    accumulate: bool = False, out_dtype: Optional[torch.dtype] = torch.bfloat16,
                                    block_size: int = 128) -> Optional[str]:
    """The operand half of :func:`gluon_variable_k_blockwise_reason` (no platform test: checkable on
    CPU). None when dtypes, shapes, strides and devices are ones the kernel takes."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    for name, t in (("x_t", x_t), ("sx", sx), ("y_t", y_t), ("sy", sy), ("group_offs", group_offs)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if block_size != SCALE_BLOCK:
        return f"the Gluon variable-K kernel takes 128-token scale blocks, got block_size={block_size}"
    if x_t.dim() != 2 or y_t.dim() != 2:
        return f"x_t must be [P, M_total] and y_t [Q, M_total], got {tuple(x_t.shape)} and {tuple(y_t.shape)}"
    for name, t in (("x_t", x_t), ("y_t", y_t)):
        if t.dtype not in _FP8_OK:
            return f"{name}.dtype={t.dtype}; the Gluon variable-K kernel takes float8_e4m3fn or float8_e5m2"
    P, M = x_t.shape
    Q = y_t.shape[0]
    if y_t.shape[1] != M:
        return f"token dim mismatch: x_t is [P, M_total] = {list(x_t.shape)}, y_t is [Q, M_total] = {list(y_t.shape)}"
    dev = x_t.device
    if any(t.device != dev for t in (sx, y_t, sy, group_offs)) or (isinstance(out, torch.Tensor) and out.device != dev):
        return "x_t, sx, y_t, sy, group_offs (and out) must be on one device"
    if M % SCALE_BLOCK:
        return f"the token dim M_total={M} must be a multiple of 128 (group segments padded to whole token blocks)"
    if P % _HALF_M:
        return f"P={P} must be a multiple of 64 (a warpgroup's rows of the [G * P, Q] output stay inside one expert)"
    if group_offs.dtype != torch.int64 or group_offs.dim() != 1 or group_offs.numel() < 1:
        return f"group_offs must be int64 [G+1], got {group_offs.dtype} {list(group_offs.shape)}"
    G = group_offs.numel() - 1
    kb = M // SCALE_BLOCK
    if sx.dtype != torch.float32 or tuple(sx.shape) != (P, kb):
        return f"sx must be float32 [P, M_total/128] = {[P, kb]}, got {sx.dtype} {list(sx.shape)}"
    if sy.dtype != torch.float32 or tuple(sy.shape) != (Q, kb):
        return f"sy must be float32 [Q, M_total/128] = {[Q, kb]}, got {sy.dtype} {list(sy.shape)}"
    for name, t in (("x_t", x_t), ("y_t", y_t)):
        if t.numel() and not _dense._tma_rows_ok(t):
            return (f"{name} must be token-contiguous with 16-byte aligned base and rows for TMA "
                    f"(strides {tuple(t.stride())})")
    return variable_k_out_reason(
        out, G, P, Q, accumulate, out_dtype if out_dtype is not None else torch.bfloat16, _OUT_DTYPES,
        "output dtype {dtype} is not one of bfloat16, float16, float32",
        None if _TMA_REDUCE_OK else
        f"accumulation needs Gluon's TMA reduce op, not found in this Triton ({_TMA_REDUCE_ERROR})")


def variable_k_out_reason(out, G: int, P: int, Q: int, accumulate: bool, out_dtype: torch.dtype,
                          out_dtypes: tuple, dtype_error: str, reduce_error: Optional[str]) -> Optional[str]:
    """The output half of the variable-K operand checks (this module's FP8 kernel and the 16-bit
    one, grouped_gemm_variable_k_gluon.py): ``out`` (or, when None, a new one of ``out_dtype``)
    must be ``[G, P, Q]``, mergeable into the ``[G * P, Q]`` view the epilogue stores through, of
    one of ``out_dtypes`` (else ``dtype_error`` formatted with ``dtype``) with 16-byte aligned rows;
    accumulation needs an fp32 ``out`` and the TMA reduce op (``reduce_error`` when it is missing)."""
    if out is not None:
        if not isinstance(out, torch.Tensor):
            return f"out must be a torch.Tensor, got {type(out).__name__}"
        if tuple(out.shape) != (G, P, Q):
            return f"out has shape {tuple(out.shape)}, expected [G, P, Q] = {[G, P, Q]}"
        dtype = out.dtype
        if out.numel() and (out.stride(2) != 1 or (G > 1 and out.stride(0) != P * out.stride(1))
                            or (out.stride(1) * out.element_size()) % 16 or out.data_ptr() % 16):
            return (f"out must be row-contiguous, experts stacked row after row (a [G * P, Q] view), with 16-byte "
                    f"aligned base and rows (strides {tuple(out.stride())})")
    elif accumulate:
        return "accumulate=True needs out"
    else:
        dtype = out_dtype
    if dtype not in out_dtypes:
        return dtype_error.format(dtype=dtype)
    if (Q * dtype.itemsize) % 16:
        return f"out rows of Q={Q} {dtype} elements are not 16-byte aligned for the TMA store"
    if accumulate:
        if dtype != torch.float32:
            # the TMA reduce-add would add a rounded tile in 16 bits (two roundings, where the tl
            # kernel rounds fp32 out + acc once)
            return f"accumulation runs as an fp32 TMA reduce-add: out must be float32, got {dtype}"
        if reduce_error is not None:
            return reduce_error
    return None


def gluon_variable_k_blockwise_reason(x_t, sx, y_t, sy, group_offs, out: Optional[torch.Tensor] = None,
                                      accumulate: bool = False, out_dtype: Optional[torch.dtype] = torch.bfloat16,
                                      block_size: int = 128) -> Optional[str]:
    """None when :func:`grouped_gemm_fp8_variable_k_blockwise_gluon` can run these inputs, else
    why not. Never raises, never synchronizes (shapes, dtypes, strides, a cached capability)."""
    return _dense._device_reason(gluon_variable_k_operand_reason, gluon_platform_reason,
                                 (x_t, sx, y_t, sy, group_offs, out, accumulate, out_dtype, block_size))


def variable_k_default_config(P: int, Q: int, M: int, G: int,
                              out_dtype: torch.dtype = torch.bfloat16) -> GluonBlockwiseConfig:
    """The dense kernel's per-row-B-scale default, fitted next to the staging buffers
    (n128s5xr240w24 for every output dtype)."""
    del P, Q, M, G
    return _dense.default_config(1, 1, 1, out_dtype, b_row_scales=True)


def _kernel_args(x_t, sx, y_t, sy, group_offs, out, cfg: GluonBlockwiseConfig, accumulate: bool) -> tuple:
    """(positional args, keyword args) of the launch for validated, non-empty inputs."""
    P, M = x_t.shape
    Q = y_t.shape[0]
    G = out.shape[0]
    bk = cfg.BLOCK_K
    a_layout, b_layout, c_layout = _dense._layouts(cfg.block_n, out.dtype)
    # global shapes are the true [P, M], [Q, M]: rows past P / Q arrive zero-filled; the token
    # columns of group g are [offs[g], offs[g+1]), whole 128-token boxes
    x_desc = TensorDescriptor(x_t, [P, M], [x_t.stride(0), 1], [_HALF_M, bk], a_layout)
    y_desc = TensorDescriptor(y_t, [Q, M], [y_t.stride(0), 1], [cfg.block_n, bk], b_layout)
    # the experts' outputs as one [G * P, Q] matrix (rows g * P + p); stores clip at Q
    c_desc = TensorDescriptor(out, [G * P, Q], [out.stride(1), 1], [_HALF_M, SCALE_BLOCK], c_layout)
    # PIPELINE: cfg.pipeline (False, the kernel's default, where the scales stay in registers)
    kwargs = _dense._launch_kwargs(cfg, ACCUMULATE=bool(accumulate))
    if _dense.row_scales_via_smem(cfg):
        # the column scales go through the ring by TMA ([M/128, Q] grid, true Q: zeros past it);
        # the kernel reads sy only through the descriptor
        sy_c = sy
        kwargs.update(sy_desc=_dense._scale_grid_desc(sy.t(), cfg.block_n))
    else:
        sy_c = _dense._column_major_padded(sy)  # [M/128, Q padded to 128], unit stride along Q
    args = (x_desc, y_desc, c_desc, sx, sy_c, group_offs, M, P, Q, G,
            sx.stride(0), sx.stride(1), sy_c.stride(1))
    return args, kwargs


def grouped_gemm_fp8_variable_k_blockwise_gluon(x_t: torch.Tensor, sx: torch.Tensor, y_t: torch.Tensor,
                                                sy: torch.Tensor, group_offs: torch.Tensor,
                                                out: Optional[torch.Tensor] = None, accumulate: bool = False,
                                                out_dtype: torch.dtype = torch.bfloat16,
                                                config: Optional[GluonBlockwiseConfig] = None,
                                                num_programs: Optional[int] = None) -> torch.Tensor:
    """``out[g] (+)= (x_t * sx)[:, tokens of g] @ ((y_t * sy)[:, tokens of g])^T``: the MoE wgrad.

    Args:
        x_t: ``[P, M_total]`` float8_e4m3fn or float8_e5m2, tokens contiguous (e.g. dY's
            column-wise copy).
        sx: ``[P, M_total/128]`` float32 multipliers of x_t's 1 x 128 token blocks.
        y_t: ``[Q, M_total]`` float8_e4m3fn or float8_e5m2, tokens contiguous (e.g. X's
            column-wise copy).
        sy: ``[Q, M_total/128]`` float32 multipliers of y_t's 1 x 128 token blocks.
        group_offs: ``[G+1]`` int64 on the device, every entry a multiple of 128 (not checked:
            that needs a host sync; the op pads each group's tokens to whole blocks).
        out: optional ``[G, P, Q]`` output, rows contiguous (a ``[G * P, Q]`` view); every
            ``out[g]`` is written (an empty group's with zeros) unless ``accumulate``.
        accumulate: ``out += ...`` (fp32 ``out`` only: Megatron's ``main_grad``); an empty
            group leaves ``out[g]`` unchanged.
        out_dtype: dtype of the allocated ``out`` (bf16, fp16, fp32; ignored when ``out`` is given).
        config: :class:`GluonBlockwiseConfig` (the dense kernel's per-row-B-scale main loops:
            BLOCK_N 128 or 256, pipelined or not); default when None.
        num_programs: cap on the persistent grid (the op's ``num_cu``); all SMs when None.

    Raises ValueError with :func:`gluon_variable_k_blockwise_reason`'s text on inputs it cannot
    run (callers check first and fall back to ``grouped_gemm_fp8_variable_k_triton``).

    Example::

        >>> # dW[g] = dY[tokens of g]^T @ X[tokens of g], both quantized along the (padded) tokens
        >>> dw = grouped_gemm_fp8_variable_k_blockwise_gluon(dy_t, s_dy, x_t, s_x, poffs)  # [G, N, K]
    """
    if out is not None:
        out_dtype = out.dtype
    reason = (gluon_variable_k_blockwise_reason(x_t, sx, y_t, sy, group_offs, out, accumulate, out_dtype)
              or _dense._num_programs_reason(num_programs))
    if reason is not None:
        raise ValueError(f"grouped_gemm_fp8_variable_k_blockwise_gluon: {reason}")
    P, M = x_t.shape
    Q = y_t.shape[0]
    G = group_offs.numel() - 1
    if out is None:
        out = torch.empty((G, P, Q), dtype=out_dtype, device=x_t.device)
    return launch_variable_k(
        "grouped_gemm_fp8_variable_k_blockwise_gluon", _grouped_gemm_fp8_variable_k_ws_kernel, out, M, accumulate,
        config or (lambda: variable_k_default_config(P, Q, M, G, out.dtype)),
        lambda cfg: cfg.check(out.element_size(), b_row_scales=True),
        lambda cfg: _kernel_args(x_t, sx, y_t, sy, group_offs, out, cfg, accumulate), num_programs)


def launch_variable_k(name: str, kernel, out: torch.Tensor, M: int, accumulate: bool, config, check, kernel_args,
                      num_programs: Optional[int]) -> torch.Tensor:
    """The launch of a variable-K kernel (this module's and the 16-bit one) on validated inputs
    into ``out [G, P, Q]``, returned: nothing for an empty output, zeros (or, accumulating, nothing)
    for no tokens; else ``config`` (a config, or a callable making the default), ``check(cfg)``
    (a reason raised as ValueError naming ``name``) and ``kernel_args(cfg)`` (positional and
    keyword arguments) on a persistent grid over the G * cdiv(P, BLOCK_M) * cdiv(Q, block_n) tiles."""
    G, P, Q = out.shape
    if G == 0 or P == 0 or Q == 0:
        return out
    if M == 0:
        return out if accumulate else out.zero_()
    cfg = config() if callable(config) else config
    bad = check(cfg)
    if bad is not None:
        raise ValueError(f"{name}: {bad}")
    args, kwargs = kernel_args(cfg)
    tiles = G * -(-P // cfg.BLOCK_M) * -(-Q // cfg.block_n)
    _dense._launch_persistent(kernel, out.device, tiles, num_programs, args, kwargs)
    return out
