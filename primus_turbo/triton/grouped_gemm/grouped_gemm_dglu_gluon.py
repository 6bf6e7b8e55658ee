"""Hopper (sm_90) Gluon kernel: the MoE experts' second grouped GEMM's grad_input with the gated
activation's backward in its epilogue (``fc2`` dgrad + SwiGLU / GeGLU backward with probs), 16-bit.

The backward of ``y = grouped_gemm(glu(h, probs, row_mask), w2, trans_b=True)`` for ``dy [M_total, H]``,
``w2 [G, H, F]`` (per expert the ``nn.Linear`` weight of fc2), the saved fc1 output ``h [M_total, 2F]``
(gate ``a = h[:, :F]``, linear half ``b = h[:, F:]``), ``group_offs [G+1]``::

    d[rows of g]  = round16(dy[rows of g] @ w2[g])                 [M_total, F], never stored
    dh[r, :F]     = d * probs[r] * b * act'(a)
    dh[r, F:]     = d * probs[r] * act(a)        (both 0 where row_mask[r] == 0)
    dp_part[j, r] = sum over the columns of tile j of d * act(a) * b     (0 where row_mask[r] == 0)

with ``d = 0`` on the rows past ``group_offs[G]``; ``dprobs = dp_part.sum(0)``. ``d`` is rounded to
the operands' dtype before use, as the composition stores it (``grouped_gemm``'s grad_input, then
``glu_bwd_launch`` of triton/activation/swiglu_kernel.py, whose fp32 expression this epilogue
evaluates in the same order): ``dh`` is the composition's bit for bit when the composition's grad_input
runs the 16-bit Gluon kernel; ``dprobs`` sums the same terms in another order. Saved: the
grad_input's store and the activation backward's read of ``[M_total, F]``, and a launch.

Structure: the 16-bit M-grouped kernel of grouped_gemm_gluon.py (persistent grid, device-side tile
schedule over ``group_offs``, its TMA producer warp with an N-major B box ``[1, BLOCK_K, BLOCK_N]`` of
``w2`` read as the logical ``[G, K=H, N=F]`` weight, two consumer warpgroups of 64 rows, the
pseudo-group ``g == G`` for the tail rows). Epilogue per warpgroup, in 64-column pieces of the
accumulator (a register-only split of the wgmma layout): the matching ``a`` and ``b`` of ``h`` by
pointer loads in the accumulator's layout, the activation's backward in fp32, ``dh``'s two pieces
through rotating staging buffers and TMA stores (descriptors of ``dh[:, :F]`` and ``dh[:, F:]``,
clipped at F and M) or masked pointer stores for a group's last rows, and the row sums of the
tile's ``dprobs`` part stored once per tile (rows of its own group only).

Requirements (:func:`gluon_dglu_reason`): sm_90, Gluon importable, bf16 or fp16 ``dy``, ``w2`` and ``h``
of one dtype, all contiguous with 16-byte aligned bases, H and F multiples of 8, float32 ``probs
[M_total]``, a bool / uint8 ``row_mask [M_total]``, int64 ``group_offs [G+1]``, one device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from primus_turbo.triton.gemm import gemm_fp8_gluon as _dense
from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, gluon_platform_reason
from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as _g16

__all__ = ["DGLU_DEFAULT_CONFIG", "GluonDGLUConfig", "gluon_dglu_operand_reason", "gluon_dglu_reason",
           "grouped_gemm_dglu_gluon"]

_HALF_M = 64


@dataclasses.dataclass(frozen=True)
class GluonDGLUConfig:
    """Pipeline shape: 128 x ``block_n`` tiles over K = H in 64-deep ring stages of
    ``(128 + block_n) x 64`` elements; per consumer warpgroup one 64 x ``block_n`` handoff buffer of
    the rounded grad_input, and h's two 64 x ``block_n`` boxes for the epilogue warpgroup;
    ``slab`` rows of a half per epilogue step; setmaxnreg budgets of the consumer, epilogue and
    producer warpgroups."""

    block_n: int = 128
    stages: int = 4
    group_m: int = 8
    slab: int = 16
    consumer_regs: int = 128
    epilogue_regs: int = 128
    producer_regs: int = 24
    # h's boxes by TMA from the epilogue warpgroup, else pointer loads a slab ahead
    h_tma: bool = False

    BLOCK_M = 128
    BLOCK_K = 64

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        stage = (self.BLOCK_M + self.block_n) * self.BLOCK_K * elem_bytes
        staging = (4 if self.h_tma else 3) * _HALF_M * self.block_n * elem_bytes  # handoff buffers, h's boxes
        return _dense._ring_smem_bytes(self.stages, stage, staging) + 3 * 8

    def short(self) -> str:
        return (f"dglu n{self.block_n}s{self.stages}g{self.group_m}l{self.slab}r{self.consumer_regs}"
                f"e{self.epilogue_regs}w{self.producer_regs}{'t' if self.h_tma else ''}")

    def check(self) -> Optional[str]:
        """None when the kernel can be built with this config."""
        if self.stages < 2 or self.group_m < 1 or self.slab not in (8, 16, 32, 64):
            return f"bad config {self.short()}: stages >= 2, group_m >= 1, slab 8, 16, 32 or 64"
        if self.block_n not in (64, 128, 256):
            return f"config {self.short()}: block_n must be 64, 128 or 256"
        regs = (self.consumer_regs, self.epilogue_regs, self.producer_regs)
        if any(r % 8 or not 24 <= r <= 256 for r in regs):
            return f"setmaxnreg counts must be multiples of 8 in [24, 256], got {regs}"
        if 128 * (2 * self.consumer_regs + self.epilogue_regs + self.producer_regs) > 65536:
            return f"registers: 128 x (2 x {regs[0]} + {regs[1]} + {regs[2]}) > 65536"
        if self.smem_bytes() > _dense.SMEM_LIMIT:
            return (f"config {self.short()} needs {self.smem_bytes()} bytes of shared memory, sm_90 has "
                    f"{_dense.SMEM_LIMIT}")
        return None


#: m64n128 wgmmas over a 4-stage ring (128 KiB), 64 KiB of handoff and h boxes
DGLU_DEFAULT_CONFIG = GluonDGLUConfig()


if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from primus_turbo.triton.activation.swiglu_kernel import _act_and_grad
    from primus_turbo.triton.gemm.gemm_fp8_gluon import _tile_coords
    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import (
        _group_tiles,
        _m_producer,
        _mainloop16,
        _ring_barriers,
    )

    @gluon.jit
    def _dglu_mma(d_bufs, d_ready, d_empty, a_bufs, b_bufs, ready, empty, offs_ptr, M, F, K, G, WG: gl.constexpr,
                  BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One consumer warpgroup: rows [WG*64, WG*64+64) of every tile of every group (and of the
        tail, whose product is 0): the main loop, then the accumulator rounded to 16 bits into this
        warpgroup's handoff buffer once the epilogue warpgroup has released it; then the next tile."""
        HALF_M: gl.constexpr = d_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        num_pid_n = gl.cdiv(F, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        it = 0
        j = 0
        tile_base = 0
        for g in range(G + 1):
            m_start, m_end, num_pid_m, tiles_g, first = _group_tiles(offs_ptr, g, G, M, num_pid_n, tile_base,
                                                                     2 * HALF_M)
            for i in range(gl.cdiv(tiles_g - first, gl.num_programs(0))):  # grouped_gemm_kernel: why not range(first, ...)
                acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_layout)
                if g < G:
                    acc, it = _mainloop16(acc, a_bufs, b_bufs, ready, empty, it, k_tiles, WG, STAGES, True, False)
                # rounded as the composition stores its grad_input before the activation reads it
                d = acc.to(d_bufs.dtype)
                mbarrier.wait(d_empty.index(WG), (j & 1) ^ 1)  # starts one phase behind: no wait at first
                d_bufs.index(WG).store(d)
                gl.thread_barrier()  # every thread's part is in shared memory before the one arrival
                mbarrier.arrive(d_ready.index(WG), count=1)
                j += 1
            tile_base += tiles_g

    @gluon.jit
    def _dglu_slab_loads(h_ptr, p_ptr, m_ptr, row0, cols, in_f, M, F, SLAB: gl.constexpr, layout: gl.constexpr):
        """h's gate and linear values (16-bit, 0 past M and F), probs and the keep mask of rows
        [row0, row0 + SLAB) and the tile's columns."""
        rows = row0 + gl.arange(0, SLAB, layout=gl.SliceLayout(1, layout))
        in_m = rows < M
        mask = gl.expand_dims(in_m, 1) & in_f
        ha = h_ptr + gl.expand_dims(rows.to(gl.int64) * (2 * F), 1) + gl.expand_dims(cols, 0)
        a = gl.load(ha, mask=mask, other=0.0)
        b = gl.load(ha + F, mask=mask, other=0.0)
        p = gl.load(p_ptr + rows, mask=in_m, other=0.0)
        keep = gl.load(m_ptr + rows, mask=in_m, other=0) != 0
        return a, b, p, keep

    @gluon.jit
    def _dglu_epilogue(hg_desc, hu_desc, d_bufs, h_bufs, d_ready, d_empty, h_bar, dh_ptr, h_ptr, p_ptr, m_ptr,
                       dp_ptr, offs_ptr, M, F, G, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, SLAB: gl.constexpr,
                       ACT: gl.constexpr, H_TMA: gl.constexpr):
        """The epilogue warpgroup: for every tile, each consumer half in turn: h's gate and linear
        boxes by TMA (issued before waiting for the half's grad_input, so they land while the main
        loop runs), then in SLAB-row steps the activation's backward (fp32, swiglu_kernel.py's
        ``_glu_bwd_kernel`` expression in its order), ``dh`` by coalesced pointer stores of the
        group's own rows, the dprobs row sums of the tile's columns."""
        HALF_M: gl.constexpr = d_bufs.type.shape[1]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        H_BYTES: gl.constexpr = 2 * hg_desc.block_type.nbytes
        num_pid_n = gl.cdiv(F, BLOCK_N)
        j = 0
        tile_base = 0
        for g in range(G + 1):
            m_start, m_end, num_pid_m, tiles_g, first = _group_tiles(offs_ptr, g, G, M, num_pid_n, tile_base,
                                                                     2 * HALF_M)
            for i in range(gl.cdiv(tiles_g - first, gl.num_programs(0))):  # grouped_gemm_kernel: why not range(first, ...)
                t = first + i * gl.num_programs(0)
                pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
                off_n = pid_n * BLOCK_N
                cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
                in_f = gl.expand_dims(cols < F, 0)
                for wg in gl.static_range(2):
                    off_m = m_start + pid_m * (2 * HALF_M) + wg * HALF_M
                    if H_TMA:
                        # h's boxes of this half (TMA zero-fills past M and F); the boxes' previous
                        # reads ended before the last arrival on d_empty (thread barrier), ordered for
                        # the async proxy by the fence
                        fence_async_shared()
                        mbarrier.expect(h_bar, H_BYTES)
                        tma.async_copy_global_to_shared(hg_desc, [off_m, off_n], h_bar, h_bufs.index(0))
                        tma.async_copy_global_to_shared(hu_desc, [off_m, off_n], h_bar, h_bufs.index(1))
                        mbarrier.wait(d_ready.index(wg), j & 1)
                        mbarrier.wait(h_bar, (2 * j + wg) & 1)
                    else:
                        # the first slab's h, probs and mask are loaded before the wait for the half's
                        # grad_input; each later slab's while the one before is worked on
                        na, nb, npp, nk = _dglu_slab_loads(h_ptr, p_ptr, m_ptr, off_m, cols, in_f, M, F, SLAB,
                                                           layout)
                        mbarrier.wait(d_ready.index(wg), j & 1)
                    for s in gl.static_range(HALF_M // SLAB):
                        rows = off_m + s * SLAB + gl.arange(0, SLAB, layout=gl.SliceLayout(1, layout))
                        in_m = rows < M
                        do = d_bufs.index(wg).slice(s * SLAB, SLAB, dim=0).load(layout).to(gl.float32)
                        if H_TMA:
                            a = h_bufs.index(0).slice(s * SLAB, SLAB, dim=0).load(layout).to(gl.float32)
                            b = h_bufs.index(1).slice(s * SLAB, SLAB, dim=0).load(layout).to(gl.float32)
                            p = gl.load(p_ptr + rows, mask=in_m, other=0.0)
                            keep = gl.load(m_ptr + rows, mask=in_m, other=0) != 0
                        else:
                            a = na.to(gl.float32)
                            b = nb.to(gl.float32)
                            p = npp
                            keep = nk
                            if s + 1 < HALF_M // SLAB:
                                na, nb, npp, nk = _dglu_slab_loads(h_ptr, p_ptr, m_ptr, off_m + (s + 1) * SLAB, cols,
                                                                   in_f, M, F, SLAB, layout)
                        act, dact = _act_and_grad(a, ACT)
                        dpart = gl.sum(do * act * b, axis=1)
                        do = do * gl.expand_dims(p, 1)
                        k2 = gl.expand_dims(keep, 1)
                        dga = gl.where(k2, do * b * dact, 0.0)
                        dgb = gl.where(k2, do * act, 0.0)
                        own = rows < m_end  # never another group's rows
                        st_mask = gl.expand_dims(own, 1) & in_f
                        dha = dh_ptr + gl.expand_dims(rows.to(gl.int64) * (2 * F), 1) + gl.expand_dims(cols, 0)
                        gl.store(dha, dga.to(dh_ptr.dtype.element_ty), mask=st_mask)
                        gl.store(dha + F, dgb.to(dh_ptr.dtype.element_ty), mask=st_mask)
                        gl.store(dp_ptr + pid_n.to(gl.int64) * M + rows, gl.where(keep, dpart, 0.0), mask=own)
                    gl.thread_barrier()  # every read of the handoff buffer and h's boxes is done
                    mbarrier.arrive(d_empty.index(wg), count=1)
                j += 1
            tile_base += tiles_g

    @gluon.jit
    def _grouped_gemm_dglu_gluon_ws_kernel(
        a_desc, b_desc, hg_desc, hu_desc, dh_ptr, h_ptr, p_ptr, m_ptr, dp_ptr, offs_ptr,
        M, F, K, G,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, SLAB: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        EPILOGUE_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACT: gl.constexpr, H_TMA: gl.constexpr,
    ):
        """Persistent, warp-specialized fc2 grad_input + gated activation backward: two consumer
        warpgroups (main loops), one epilogue warpgroup, one TMA producer warp. Descriptors:
        a_desc [64, BLOCK_K] boxes of dy [M, K]; b_desc [1, BLOCK_K, BLOCK_N] boxes of w2 [G, K, F];
        hg_desc / hu_desc [64, BLOCK_N] boxes of h[:, :F] and h[:, F:] (their layout is also the
        handoff buffers'); plus dh's pointer, probs, the row mask and the dprobs parts
        [cdiv(F, BLOCK_N), M]."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[2]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 1, BLOCK_K, BLOCK_N], b_desc.layout)
        d_bufs = gl.allocate_shared_memory(hg_desc.dtype, [2, HALF_M, BLOCK_N], hg_desc.layout)
        h_bufs = gl.allocate_shared_memory(hg_desc.dtype, [2 if H_TMA else 1, HALF_M, BLOCK_N], hg_desc.layout)
        ready, empty = _ring_barriers(STAGES)
        d_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        d_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        h_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for w in gl.static_range(2):
            mbarrier.init(d_ready.index(w), count=1)
            mbarrier.init(d_empty.index(w), count=1)
        mbarrier.init(h_bar, count=1)
        gl.warp_specialize([
            (_dglu_mma, (d_bufs, d_ready, d_empty, a_bufs, b_bufs, ready, empty, offs_ptr, M, F, K, G, 0, BLOCK_N,
                         GROUP_M, STAGES)),
            (_dglu_mma, (d_bufs, d_ready, d_empty, a_bufs, b_bufs, ready, empty, offs_ptr, M, F, K, G, 1, BLOCK_N,
                         GROUP_M, STAGES)),
            (_dglu_epilogue, (hg_desc, hu_desc, d_bufs, h_bufs, d_ready, d_empty, h_bar, dh_ptr, h_ptr, p_ptr, m_ptr,
                              dp_ptr, offs_ptr, M, F, G, BLOCK_N, GROUP_M, SLAB, ACT, H_TMA)),
            # the 16-bit grouped kernel's producer, unpaced (its pace pointer is never read)
            (_m_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, offs_ptr, M, F, K, G, GROUP_M,
                           STAGES, False, 0)),
        ], [4, 4, 1], [CONSUMER_REGS, EPILOGUE_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
def gluon_dglu_operand_reason(dy, w2, h, group_offs, probs, row_mask) -> Optional[str]:
    """The operand half of :func:`gluon_dglu_reason` (checkable on CPU): None when the fused kernel
    takes these dtypes, shapes, strides and devices."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    for name, t in (("dy", dy), ("w2", w2), ("h", h), ("group_offs", group_offs), ("probs", probs),
                    ("row_mask", row_mask)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if dy.dim() != 2 or w2.dim() != 3 or h.dim() != 2:
        return (f"dy must be [M_total, H], w2 [G, H, F] and h [M_total, 2F], got {tuple(dy.shape)}, "
                f"{tuple(w2.shape)} and {tuple(h.shape)}")
    if dy.dtype not in (torch.bfloat16, torch.float16) or w2.dtype != dy.dtype or h.dtype != dy.dtype:
        return f"dy, w2 and h must all be bfloat16 or all float16, got {dy.dtype}, {w2.dtype} and {h.dtype}"
    M, H = dy.shape
    G, Hw, F = w2.shape
    if Hw != H or tuple(h.shape) != (M, 2 * F):
        return (f"w2 must be [G, H={H}, F] and h [M_total={M}, 2F], got w2 {tuple(w2.shape)} and h "
                f"{tuple(h.shape)}")
    if H % 8 or F % 8:
        return f"H = {H} and F = {F} must be multiples of 8 (16-byte aligned TMA rows)"
    if any(t.device != dy.device for t in (w2, h, group_offs, probs, row_mask)):
        return "dy, w2, h, group_offs, probs and row_mask must be on one device"
    if any(not t.is_contiguous() or t.data_ptr() % 16 for t in (dy, w2, h)):
        return "dy, w2 and h must be contiguous with 16-byte aligned bases"
    if group_offs.dtype != torch.int64 or tuple(group_offs.shape) != (G + 1,):
        return f"group_offs must be int64 [G+1] = [{G + 1}], got {group_offs.dtype} {list(group_offs.shape)}"
    if probs.dtype != torch.float32 or tuple(probs.shape) != (M,) or probs.stride(0) != 1:
        return f"probs must be contiguous float32 [M_total] = [{M}], got {probs.dtype} {list(probs.shape)}"
    if row_mask.dtype not in (torch.bool, torch.uint8) or tuple(row_mask.shape) != (M,) or row_mask.stride(0) != 1:
        return (f"row_mask must be contiguous bool / uint8 [M_total] = [{M}], got {row_mask.dtype} "
                f"{list(row_mask.shape)}")
    return None


def gluon_dglu_reason(dy, w2, h, group_offs, probs, row_mask) -> Optional[str]:
    """None when :func:`grouped_gemm_dglu_gluon` can run these inputs, else why not. Never raises,
    never synchronizes."""
    return _dense._device_reason(gluon_dglu_operand_reason, gluon_platform_reason,
                                 (dy, w2, h, group_offs, probs, row_mask))


@functools.lru_cache(maxsize=None)
def _layout(shape: tuple, dtype: torch.dtype):
    return _g16._smem_layout(shape, dtype)


def _desc(t: torch.Tensor, box: list):
    """Host TMA descriptor of the (possibly strided) view ``t`` with its true shape: loads past it
    zero-fill, stores clip."""
    return _dense._desc_unchecked(t, list(t.shape), list(t.stride()), box, _layout(tuple(box), t.dtype))


def _kernel_args(dy, w2, h, group_offs, probs, mask_u8, dh, dp, act: int, cfg: GluonDGLUConfig) -> tuple:
    """(positional args, keyword args) of the launch for validated, non-empty inputs."""
    M, H = dy.shape
    G, _, F = w2.shape
    bk, bn = cfg.BLOCK_K, cfg.block_n
    a_desc = _desc(dy, [_HALF_M, bk])
    b_desc = _desc(w2, [1, bk, bn])
    hg_desc = _desc(h[:, :F], [_HALF_M, bn])
    hu_desc = _desc(h[:, F:], [_HALF_M, bn])
    args = (a_desc, b_desc, hg_desc, hu_desc, dh, h, probs, mask_u8, dp, group_offs, M, F, H, G)
    kwargs = dict(GROUP_M=cfg.group_m, STAGES=cfg.stages, SLAB=cfg.slab, CONSUMER_REGS=cfg.consumer_regs,
                  EPILOGUE_REGS=cfg.epilogue_regs, PRODUCER_REGS=cfg.producer_regs, ACT=act, H_TMA=cfg.h_tma,
                  num_warps=4)
    return args, kwargs


def grouped_gemm_dglu_gluon(dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, group_offs: torch.Tensor,
                            probs: torch.Tensor, row_mask: torch.Tensor, activation: str = "swiglu",
                            config: Optional[GluonDGLUConfig] = None, num_programs: Optional[int] = None,
                            checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh, dp_part)``: the gradient of ``h`` and the ``[cdiv(F, block_n), M_total]`` float32
    parts of the gradient of ``probs`` (``dprobs = dp_part.sum(0)``) for
    ``y = grouped_gemm(act(h[:, :F]) * h[:, F:] * probs (0 where row_mask is 0), w2, trans_b=True)``
    and its output gradient ``dy``, from one kernel (see the module docstring).

    Args:
        dy: ``[M_total, H]`` bf16 / fp16, contiguous.
        w2: ``[G, H, F]`` of dy's dtype, contiguous (fc2's ``nn.Linear`` weights).
        h: ``[M_total, 2F]`` of dy's dtype, contiguous (fc1's output: gate columns, then the linear ones).
        group_offs: ``[G+1]`` int64 on the device (read only there: no host sync).
        probs: float32 ``[M_total]``; row_mask: bool / uint8 ``[M_total]``.
        activation: ``"swiglu"`` or ``"geglu"`` (tanh GELU).
        config: :class:`GluonDGLUConfig` (default :data:`DGLU_DEFAULT_CONFIG`).
        num_programs: cap on the persistent grid; all SMs when None.
        checked: the caller has just had :func:`gluon_dglu_reason` accept these inputs.

    Raises ValueError on inputs the kernel cannot run (the reason's text) or an unknown activation.
    """
    from primus_turbo.triton.grouped_gemm.grouped_gemm_glu_gluon import GLU_ACTS

    if activation not in GLU_ACTS:
        raise ValueError(f"grouped_gemm_dglu_gluon: activation must be one of {sorted(GLU_ACTS)}, got "
                         f"{activation!r}")
    reason = None if checked else gluon_dglu_reason(dy, w2, h, group_offs, probs, row_mask)
    reason = reason or _dense._num_programs_reason(num_programs)
    cfg = config or DGLU_DEFAULT_CONFIG
    reason = reason or cfg.check()
    if reason is not None:
        raise ValueError(f"grouped_gemm_dglu_gluon: {reason}")
    M, H = dy.shape
    G, _, F = w2.shape
    n_parts = -(-F // cfg.block_n)
    dh = torch.empty((M, 2 * F), dtype=dy.dtype, device=dy.device)
    dp = torch.empty((n_parts, M), dtype=torch.float32, device=dy.device)
    if M == 0 or F == 0:
        dh.zero_()
        dp.zero_()
        return dh, dp
    mask_u8 = row_mask.view(torch.uint8) if row_mask.dtype == torch.bool else row_mask
    if G == 0 or H == 0:  # no product: d = 0, the activation's backward on it (the kernel needs K > 0)
        from primus_turbo.triton.activation.swiglu_kernel import glu_bwd_launch

        dh, part = glu_bwd_launch(torch.zeros((M, F), dtype=dy.dtype, device=dy.device), h, GLU_ACTS[activation],
                                  probs, mask_u8)
        return dh, part
    args, kwargs = _kernel_args(dy, w2, h, group_offs, probs, mask_u8, dh, dp, GLU_ACTS[activation], cfg)
    tiles = (-(-M // cfg.BLOCK_M) + G + 1) * n_parts
    _dense._launch_persistent(_grouped_gemm_dglu_gluon_ws_kernel, dy.device, tiles, num_programs, args, kwargs)
    return dh, dp
