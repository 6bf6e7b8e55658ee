"""Hopper (sm_90) Gluon kernel: the MoE experts' first grouped GEMM with the gated activation in its
epilogue (``fc1`` + SwiGLU / GeGLU with probs), 16-bit.

For tokens ``x [M_total, K]`` sorted by expert, ``w [G, 2F, K]`` (per expert the ``nn.Linear``
weight of the gate rows ``[:F]`` and the linear rows ``[F:]``), ``group_offs [G+1]``::

    h[rows of g]   = x[rows of g] @ w[g]^T                      [M_total, 2F], the GEMM's output
    out[r]         = act(a) * b * probs[r]   (0 where row_mask[r] == 0)      [M_total, F]
                     a = h[r, :F], b = h[r, F:] as stored (rounded to the output dtype), math fp32

and the rows past ``group_offs[G]`` of ``h`` zero (``out`` there follows the formula on zeros), which
is exactly ``grouped_gemm`` followed by ``swiglu_with_probs`` / ``geglu_with_probs``
(triton/activation/swiglu_kernel.py: the same fp32 expression, in the same order). ``h`` is kept
for the backward (the activation's gradient reads it); the gain is the activation's pass over
``h`` (2F elements read and F written per row) and its launch.

Structure: the 16-bit M-grouped kernel of grouped_gemm_gluon.py (persistent grid, device-side tile
schedule over ``group_offs``, one TMA producer warp, two consumer warpgroups of 64 rows, the
pseudo-group ``g == G`` for the tail rows) with a 128-column feature tile whose B operand is two
TMA boxes: the gate rows ``[n, n+128)`` and the linear rows ``[F+n, F+n+128)`` of expert g into
the two halves of one ``[256, BLOCK_K]`` ring slot, through descriptors of the ``[G, F, K]`` views
``w[:, :F]`` and ``w[:, F:]`` (so each half zero-fills at F on its own). One m64 x n256 wgmma per
warpgroup and K step then accumulates both halves: columns ``[0, 128)`` of the accumulator are the
gate, ``[128, 256)`` the linear part, split in registers. Epilogue per warpgroup: the two ``h``
pieces and the activation through two rotating staging buffers and TMA stores (descriptors of
``h[:, :F]``, ``h[:, F:]`` and ``out``, clipped at F and M), or masked pointer stores for a
group's last rows.

Requirements (:func:`gluon_glu_reason`): sm_90, Gluon importable, bf16 or fp16 ``x`` and ``w`` of
one dtype, ``x`` K-contiguous, ``w`` contiguous ``[G, 2F, K]``, K and F multiples of 8 (16-byte
aligned TMA rows and half offsets), float32 ``probs [M_total]`` and a bool / uint8 ``row_mask
[M_total]`` on the same device, int64 ``group_offs [G+1]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from primus_turbo.triton.gemm import gemm_fp8_gluon as _dense
from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, gluon_platform_reason
from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as _g16
from primus_turbo.triton.launch import tensor_sig

__all__ = ["GLU_ACTS", "GLU_DEFAULT_CONFIG", "GluonGLUConfig", "gluon_glu_operand_reason", "gluon_glu_reason",
           "grouped_gemm_glu_gluon"]

#: activation name -> the kernel's ACT code (the codes of triton/activation/swiglu_kernel.py)
GLU_ACTS = {"swiglu": 0, "geglu": 1}
_HALF_M = 64
_BLOCK_F = 128


@dataclasses.dataclass(frozen=True)
class GluonGLUConfig:
    """Pipeline shape of the fused kernel: 128 x (2 x 128) tiles, ``stages`` ring slots of 48 KiB,
    ``c_bufs`` staging buffers of 64 x 128 per warpgroup (three pieces per tile), setmaxnreg budgets."""

    stages: int = 3
    group_m: int = 8
    c_bufs: int = 2
    # no spills at 232 / 40, 224 / 56 or 216 / 72 (ptxas, sm_90a); the producer's fourth TMA load
    # gets a little room
    consumer_regs: int = 224
    producer_regs: int = 56

    BLOCK_M = 128
    BLOCK_F = _BLOCK_F
    BLOCK_K = 64

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        stage = (self.BLOCK_M + 2 * self.BLOCK_F) * self.BLOCK_K * elem_bytes
        staging = 2 * self.c_bufs * _HALF_M * self.BLOCK_F * elem_bytes
        return _dense._ring_smem_bytes(self.stages, stage, staging)

    def short(self) -> str:
        return f"glu s{self.stages}g{self.group_m}c{self.c_bufs}r{self.consumer_regs}w{self.producer_regs}"

    def check(self) -> Optional[str]:
        """None when the kernel can be built with this config (the pipeline checks every
        warp-specialized Gluon GEMM config shares, then shared memory)."""
        bad = _dense._pipeline_reason(self)
        if bad is None and self.smem_bytes() > _dense.SMEM_LIMIT:
            bad = (f"config {self.short()} needs {self.smem_bytes()} bytes of shared memory, sm_90 has "
                   f"{_dense.SMEM_LIMIT}")
        return bad


#: 3 stages (144 KiB) + 2 staging buffers per warpgroup (64 KiB): the shared memory of the 16-bit
#: grouped default (n256k64s3e256), whose m64n256 wgmma this kernel issues too.
GLU_DEFAULT_CONFIG = GluonGLUConfig()


if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from primus_turbo.triton.activation.swiglu_kernel import _act_and_grad
    from primus_turbo.triton.gemm.gemm_fp8_gluon import _tile_coords
    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import (
        _group_tiles,
        _halves,
        _mainloop16,
        _ring_barriers,
        _store_piece,
    )

    @gluon.jit
    def _glu_producer(a_desc, bg_desc, bu_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, F, K, G,
                      GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One warp: per K block the two 64-row A halves and the gate and linear B boxes (into the
        two halves of the slot's [1, 256, BLOCK_K] buffer) of every tile of every real group."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_F: gl.constexpr = bg_desc.block_type.shape[1]
        STAGE_BYTES: gl.constexpr = 2 * a_desc.block_type.nbytes + 2 * bg_desc.block_type.nbytes
        num_pid_n = gl.cdiv(F, BLOCK_F)
        k_tiles = gl.cdiv(K, BLOCK_K)
        it = 0
        tile_base = 0
        for g in range(G):
            m_start, m_end, num_pid_m, tiles_g, first = _group_tiles(offs_ptr, g, G, M, num_pid_n, tile_base,
                                                                     2 * HALF_M)
            for i in range(gl.cdiv(tiles_g - first, gl.num_programs(0))):  # grouped_gemm_kernel: why not range(first, ...)
                t = first + i * gl.num_programs(0)
                pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
                off_m = m_start + pid_m * (2 * HALF_M)
                off_n = pid_n * BLOCK_F
                for kk in range(k_tiles):
                    k = kk * BLOCK_K
                    s = it % STAGES
                    # empty barriers start "one phase behind": the first pass over the ring never waits
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    bar = ready.index(s)
                    mbarrier.expect(bar, STAGE_BYTES)
                    tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(2 * s))
                    tma.async_copy_global_to_shared(a_desc, [off_m + HALF_M, k], bar, a_bufs.index(2 * s + 1))
                    buf = b_bufs.index(s)
                    tma.async_copy_global_to_shared(bg_desc, [g, off_n, k], bar, buf.slice(0, BLOCK_F, dim=1))
                    tma.async_copy_global_to_shared(bu_desc, [g, off_n, k], bar, buf.slice(BLOCK_F, BLOCK_F, dim=1))
                    it += 1
            tile_base += tiles_g

    @gluon.jit
    def _glu_act(gate, up, p_ptr, m_ptr, off_m, M, ACT: gl.constexpr):
        """The activation of one 64-row piece, fp32, from the gate and linear halves as ``h``
        stores them (16-bit): ``act(a) * b * probs[row]``, 0 where ``row_mask[row] == 0`` (the
        expression of swiglu_kernel.py's ``_glu_fwd_kernel``, in its order)."""
        R: gl.constexpr = gate.shape[0]
        rows = off_m + gl.arange(0, R, layout=gl.SliceLayout(1, gate.type.layout))
        in_m = rows < M
        p = gl.load(p_ptr + rows, mask=in_m, other=0.0)
        keep = gl.load(m_ptr + rows, mask=in_m, other=0) != 0
        a = gate.to(gl.float32)
        b = up.to(gl.float32)
        act, _ = _act_and_grad(a, ACT)  # the activation kernel's expression; the derivative is dead code
        out = act * b
        out = out * gl.expand_dims(p, 1)
        return gl.where(gl.expand_dims(keep, 1), out, 0.0)

    @gluon.jit
    def _store_masked(ptr, piece, off_m, m_end, off_n, ncols, stride):
        """piece (64 x C fp32, any distributed layout) -> ptr's rows off_m + i (< m_end), columns
        off_n + j (< ncols): pointer stores that never touch another group's rows."""
        R: gl.constexpr = piece.shape[0]
        C: gl.constexpr = piece.shape[1]
        L: gl.constexpr = piece.type.layout
        offs_m = off_m + gl.arange(0, R, layout=gl.SliceLayout(1, L))
        offs_n = off_n + gl.arange(0, C, layout=gl.SliceLayout(0, L))
        rows = gl.expand_dims(offs_m.to(gl.int64) * stride, 1)
        mask = gl.expand_dims(offs_m < m_end, 1) & gl.expand_dims(offs_n < ncols, 0)
        gl.store(ptr + rows + gl.expand_dims(offs_n, 0), piece.to(ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _glu_consumer(hg_desc, hu_desc, o_desc, h_ptr, o_ptr, p_ptr, m_ptr, a_bufs, b_bufs, c_bufs, ready, empty,
                      offs_ptr, M, F, K, G, WG: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      C_BUFS: gl.constexpr, ACT: gl.constexpr):
        """One warpgroup: rows [WG*64, WG*64+64) of every tile of every group, and of the tail."""
        HALF_M: gl.constexpr = o_desc.block_type.shape[0]
        BLOCK_F: gl.constexpr = o_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        out_ty: gl.constexpr = o_desc.dtype
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, 2 * BLOCK_F, 16])
        num_pid_n = gl.cdiv(F, BLOCK_F)
        k_tiles = gl.cdiv(K, BLOCK_K)
        it = 0
        st = 0
        tile_base = 0
        for g in range(G + 1):  # g == G: the rows past offs[G] (h zero, out the formula on zeros)
            m_start, m_end, num_pid_m, tiles_g, first = _group_tiles(offs_ptr, g, G, M, num_pid_n, tile_base,
                                                                     2 * HALF_M)
            for i in range(gl.cdiv(tiles_g - first, gl.num_programs(0))):  # grouped_gemm_kernel: why not range(first, ...)
                t = first + i * gl.num_programs(0)
                pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
                off_m = m_start + pid_m * (2 * HALF_M) + WG * HALF_M
                off_n = pid_n * BLOCK_F
                acc = gl.zeros([HALF_M, 2 * BLOCK_F], gl.float32, mma_layout)
                if g < G:
                    acc, it = _mainloop16(acc, a_bufs, b_bufs, ready, empty, it, k_tiles, WG, STAGES, True, True)
                # rounded once, as h stores them; the fp32 halves die here (register pressure)
                gate, up = _halves(acc)
                gate = gate.to(out_ty)
                up = up.to(out_ty)
                whole = off_m + HALF_M <= m_end  # the whole half is in the group: TMA stores (clip at F)
                if whole:
                    st = _store_piece(hg_desc, c_bufs, gate, off_m, off_n, st, WG, C_BUFS, False)
                    st = _store_piece(hu_desc, c_bufs, up, off_m, off_n, st, WG, C_BUFS, False)
                else:  # the group's last rows: masked stores, the next group's rows untouched
                    _store_masked(h_ptr, gate, off_m, m_end, off_n, F, 2 * F)
                    _store_masked(h_ptr + F, up, off_m, m_end, off_n, F, 2 * F)
                # formed after the h stores are issued: the activation's math covers the wait for
                # the gate piece's staging buffer, which the activation's store reuses
                act = _glu_act(gate, up, p_ptr, m_ptr, off_m, M, ACT)
                if whole:
                    st = _store_piece(o_desc, c_bufs, act, off_m, off_n, st, WG, C_BUFS, False)
                else:
                    _store_masked(o_ptr, act, off_m, m_end, off_n, F, F)
            tile_base += tiles_g
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_gemm_glu_gluon_ws_kernel(
        a_desc, bg_desc, bu_desc, hg_desc, hu_desc, o_desc, h_ptr, o_ptr, p_ptr, m_ptr, offs_ptr,
        M, F, K, G,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, C_BUFS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACT: gl.constexpr,
    ):
        """Persistent, warp-specialized fc1 + gated activation. Descriptors: a_desc [64, BLOCK_K]
        boxes of x [M, K]; bg_desc / bu_desc [1, 128, BLOCK_K] boxes of the [G, F, K] gate / linear
        views of w; hg_desc / hu_desc / o_desc [64, 128] boxes of h[:, :F], h[:, F:] and out [M, F];
        plus h's and out's pointers for the masked group-end stores, probs and the row mask."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_F: gl.constexpr = bg_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(bg_desc.dtype, [STAGES, 1, 2 * BLOCK_F, BLOCK_K], bg_desc.layout)
        c_bufs = gl.allocate_shared_memory(o_desc.dtype, [2 * C_BUFS, HALF_M, BLOCK_F], o_desc.layout)
        ready, empty = _ring_barriers(STAGES)
        gl.warp_specialize([
            (_glu_consumer, (hg_desc, hu_desc, o_desc, h_ptr, o_ptr, p_ptr, m_ptr, a_bufs, b_bufs, c_bufs, ready,
                             empty, offs_ptr, M, F, K, G, 0, GROUP_M, STAGES, C_BUFS, ACT)),
            (_glu_consumer, (hg_desc, hu_desc, o_desc, h_ptr, o_ptr, p_ptr, m_ptr, a_bufs, b_bufs, c_bufs, ready,
                             empty, offs_ptr, M, F, K, G, 1, GROUP_M, STAGES, C_BUFS, ACT)),
            (_glu_producer, (a_desc, bg_desc, bu_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, F, K, G, GROUP_M,
                             STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
def gluon_glu_operand_reason(x, w, group_offs, probs, row_mask) -> Optional[str]:
    """The operand half of :func:`gluon_glu_reason` (checkable on CPU): None when the fused kernel
    takes these dtypes, shapes, strides and devices."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    for name, t in (("x", x), ("w", w), ("group_offs", group_offs), ("probs", probs), ("row_mask", row_mask)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if x.dim() != 2 or w.dim() != 3:
        return f"x must be [M_total, K] and w [G, 2F, K], got {tuple(x.shape)} and {tuple(w.shape)}"
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return f"x and w must both be bfloat16 or float16, got {x.dtype} and {w.dtype}"
    M, K = x.shape
    G, F2, Kw = w.shape
    if Kw != K or F2 % 2:
        return f"w must be [G, 2F, K] with x's K = {K}, got {tuple(w.shape)}"
    F = F2 // 2
    if K % 8 or F % 8:
        return f"K = {K} and F = {F} must be multiples of 8 (16-byte aligned TMA rows)"
    if any(t.device != x.device for t in (w, group_offs, probs, row_mask)):
        return "x, w, group_offs, probs and row_mask must be on one device"
    if not x.is_contiguous() or not w.is_contiguous() or x.data_ptr() % 16 or w.data_ptr() % 16:
        return "x and w must be contiguous with 16-byte aligned bases"
    if group_offs.dtype != torch.int64 or tuple(group_offs.shape) != (G + 1,):
        return f"group_offs must be int64 [G+1] = [{G + 1}], got {group_offs.dtype} {list(group_offs.shape)}"
    if probs.dtype != torch.float32 or tuple(probs.shape) != (M,) or probs.stride(0) != 1:
        return f"probs must be contiguous float32 [M_total] = [{M}], got {probs.dtype} {list(probs.shape)}"
    if row_mask.dtype not in (torch.bool, torch.uint8) or tuple(row_mask.shape) != (M,) or row_mask.stride(0) != 1:
        return (f"row_mask must be contiguous bool / uint8 [M_total] = [{M}], got {row_mask.dtype} "
                f"{list(row_mask.shape)}")
    return None


def gluon_glu_reason(x, w, group_offs, probs, row_mask) -> Optional[str]:
    """None when :func:`grouped_gemm_glu_gluon` can run these inputs, else why not. Never raises,
    never synchronizes."""
    return _dense._device_reason(gluon_glu_operand_reason, gluon_platform_reason,
                                 (x, w, group_offs, probs, row_mask))


@functools.lru_cache(maxsize=None)
def _layout(shape: tuple, dtype: torch.dtype):
    return _g16._smem_layout(shape, dtype)


def _desc(t: torch.Tensor, box: list):
    """Host TMA descriptor of the (possibly strided) view ``t`` with its true shape: loads past it
    zero-fill, stores clip."""
    return _dense._desc_unchecked(t, list(t.shape), list(t.stride()), box, _layout(tuple(box), t.dtype))


def _kernel_args(x, w, group_offs, probs, mask_u8, h, out, act: int, cfg: GluonGLUConfig) -> tuple:
    """(positional args, keyword args) of the launch for validated, non-empty inputs."""
    M, K = x.shape
    G, F2, _ = w.shape
    F = F2 // 2
    bk, bf = cfg.BLOCK_K, cfg.BLOCK_F
    a_desc = _desc(x, [_HALF_M, bk])
    bg_desc = _desc(w[:, :F], [1, bf, bk])
    bu_desc = _desc(w[:, F:], [1, bf, bk])
    hg_desc = _desc(h[:, :F], [_HALF_M, bf])
    hu_desc = _desc(h[:, F:], [_HALF_M, bf])
    o_desc = _desc(out, [_HALF_M, bf])
    args = (a_desc, bg_desc, bu_desc, hg_desc, hu_desc, o_desc, h, out, probs, mask_u8, group_offs, M, F, K, G)
    return args, _launch_kwargs(act, cfg)


def _launch_kwargs(act: int, cfg: GluonGLUConfig) -> dict:
    return dict(GROUP_M=cfg.group_m, STAGES=cfg.stages, C_BUFS=cfg.c_bufs, CONSUMER_REGS=cfg.consumer_regs,
                PRODUCER_REGS=cfg.producer_regs, ACT=act, num_warps=4)


def grouped_gemm_glu_gluon(x: torch.Tensor, w: torch.Tensor, group_offs: torch.Tensor, probs: torch.Tensor,
                           row_mask: torch.Tensor, activation: str = "swiglu",
                           config: Optional[GluonGLUConfig] = None, num_programs: Optional[int] = None,
                           checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, out)``: ``h = grouped_gemm(x, w, trans_b=True)`` (``[M_total, 2F]``, rows past
    ``group_offs[G]`` zero) and ``out = act(h[:, :F]) * h[:, F:] * probs`` (``[M_total, F]``, 0 on
    rows whose ``row_mask`` is 0), from one kernel.

    Args:
        x: ``[M_total, K]`` bf16 / fp16, contiguous (tokens sorted by expert).
        w: ``[G, 2F, K]`` of x's dtype, contiguous (gate rows first, then the linear rows).
        group_offs: ``[G+1]`` int64 on the device (read only there: no host sync).
        probs: float32 ``[M_total]``; row_mask: bool / uint8 ``[M_total]``.
        activation: ``"swiglu"`` or ``"geglu"`` (tanh GELU).
        config: :class:`GluonGLUConfig` (default :data:`GLU_DEFAULT_CONFIG`).
        num_programs: cap on the persistent grid; all SMs when None.
        checked: the caller has just had :func:`gluon_glu_reason` accept these inputs.

    Raises ValueError on inputs the kernel cannot run (the reason's text) or an unknown activation.
    """
    if activation not in GLU_ACTS:
        raise ValueError(f"grouped_gemm_glu_gluon: activation must be one of {sorted(GLU_ACTS)}, got {activation!r}")
    reason = None if checked else gluon_glu_reason(x, w, group_offs, probs, row_mask)
    reason = reason or _dense._num_programs_reason(num_programs)
    cfg = config or GLU_DEFAULT_CONFIG
    reason = reason or cfg.check()
    if reason is not None:
        raise ValueError(f"grouped_gemm_glu_gluon: {reason}")
    M, K = x.shape
    G, F2, _ = w.shape
    F = F2 // 2
    h = torch.empty((M, F2), dtype=x.dtype, device=x.device)
    out = torch.empty((M, F), dtype=x.dtype, device=x.device)
    if M == 0 or F == 0:
        return h, out
    mask_u8 = row_mask.view(torch.uint8) if row_mask.dtype == torch.bool else row_mask
    if G == 0 or K == 0:  # no product: h = 0 and out the activation's formula on it (the kernel needs K > 0)
        from primus_turbo.triton.activation.swiglu_kernel import glu_fwd_launch

        h.zero_()
        return h, glu_fwd_launch(h, GLU_ACTS[activation], probs, mask_u8)
    act = GLU_ACTS[activation]
    tiles = (-(-M // cfg.BLOCK_M) + G + 1) * -(-F // cfg.BLOCK_F)
    _dense._launch_persistent_prepared(
        _grouped_gemm_glu_gluon_ws_kernel, x.device, tiles, num_programs,
        lambda: _kernel_args(x, w, group_offs, probs, mask_u8, h, out, act, cfg)[0], _launch_kwargs(act, cfg),
        *_prepared_key(x, w, group_offs, probs, mask_u8, h, out, act, cfg))
    return h, out


def _prepared_key(x, w, group_offs, probs, mask_u8, h, out, act: int, cfg: GluonGLUConfig) -> tuple:
    """(key, pointers) of the prepared launch (triton/launch.launch_prepared): the key fixes every
    argument of :func:`_kernel_args` but the data pointers (shapes, strides, dtypes and 16-byte
    alignment of every tensor, whence those of the gate / linear half views, the activation and
    the config), so a repeat call skips building and encoding the six descriptors; the pointers
    are those of every tensor and descriptor base among the arguments (the half views' own)."""
    F = w.shape[1] // 2
    sig = tensor_sig
    key = ("glu", sig(x), sig(w), sig(group_offs), sig(probs), sig(mask_u8), sig(h), sig(out), act, cfg)
    ptrs = (x.data_ptr(), w.data_ptr(), w[:, F:].data_ptr(), h.data_ptr(), h[:, F:].data_ptr(), out.data_ptr(),
            probs.data_ptr(), mask_u8.data_ptr(), group_offs.data_ptr())
    return key, ptrs
