"""Hopper (sm_90) Gluon kernel for the 16-bit (bf16 / fp16) variable-K grouped GEMM: the MoE wgrad.

``out[g] (+)= x[rows of g]^T @ y[rows of g]`` for ``x [M_total, P]``, ``y [M_total, Q]`` (row-major:
the activation and the output gradient as the forward and the dgrad use them), ``group_offs
[G+1]`` int64 on the device (any offsets: no padding of the groups), ``out [G, P, Q]``; fp32
accumulation in the tensor cores, optionally added into an fp32 ``out`` (Megatron's ``main_grad``).
The same product as ``_grouped_gemm_variable_k_kernel`` (grouped_gemm_kernel.py); only the
summation order differs.

Structure: the FP8 variable-K Gluon kernel's (grouped_gemm_fp8_variable_k_gluon.py: static tile
list ``(g, pid_p, pid_q)`` taken round-robin by a persistent grid, tiles of one expert consecutive
and GROUP_M-swizzled, every partition reading the group's token range from ``group_offs`` itself,
epilogue through the ``[G * P, Q]`` view of ``out`` with a TMA store, or a TMA reduce-add when
accumulating) with the 16-bit kernels' main loop (grouped_gemm_gluon.py, wgmma accumulating in
registers, one MMA in flight):

* the producer loads, per BLOCK_K tokens, x's ``[BLOCK_K, 64]`` boxes at columns ``off_p`` and
  ``off_p + 64`` (the two consumer warpgroups' A, token-major: wgmma reads it transposed) and y's
  ``[BLOCK_K, BLOCK_N]`` box (B, N-major, taken as is);
* token blocks start at ``offs[g] + i * BLOCK_K`` (TMA takes any row coordinate), except the last
  one, which ends at ``offs[g+1]``: it starts at ``offs[g+1] - BLOCK_K`` and so reloads tokens of
  block i - 1 (or, for a group shorter than BLOCK_K, the previous groups' tokens or zeros before
  row 0). Before its MMA each consumer warpgroup zeroes those leading rows in shared memory in
  BOTH operand boxes, its own x box and the shared y box (``_zero_skipped``), so they add exactly
  nothing: zeroing one operand only would turn an Inf or NaN of another expert's token (or a
  counted token's) in the other operand into a NaN (0 * Inf) in this expert's gradient. Only
  these boundary blocks are touched; full blocks run the plain loop. No block ever reads a row at
  or past ``offs[g+1]``: rows past ``offs[G]`` (uninitialized in a capacity-padded buffer,
  possibly NaN) are never loaded.
* an empty group runs no main loop: its tile stores zeros, or, accumulating, nothing.

Requirements (:func:`gluon_variable_k_reason`): sm_90, Gluon importable, x and y bf16 or fp16 of
one dtype, row-major with 16-byte aligned base and rows (P and Q multiples of 8), ``P % 64 == 0``
(a warpgroup's 64 rows of the ``[G * P, Q]`` view stay inside one expert), int64 offsets, ``out``
of x's dtype or fp32 with 16-byte aligned rows of Q elements, mergeable into ``[G * P, Q]``,
accumulation only into fp32.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from primus_turbo.triton.gemm import gemm_fp8_gluon as _dense
from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, gluon_platform_reason
from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as _m
from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_variable_k_gluon import variable_k_out_reason
from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import GluonGroupedConfig
from primus_turbo.triton.launch import tensor_sig

__all__ = [
    "VARIABLE_K16_DEFAULT_CONFIG",
    "gluon_variable_k_operand_reason",
    "gluon_variable_k_reason",
    "grouped_gemm_variable_k_gluon",
]

# 128 (P) x 256 (Q) tiles, 4 stages of 48 KiB: the forward's default. Not yet measured on the GPU
# (scripts/check_gluon_grouped.py times the candidates).
VARIABLE_K16_DEFAULT_CONFIG = _m.GROUPED16_DEFAULT_CONFIG
_HALF_M = 64

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from primus_turbo.triton.gemm.gemm_fp8_gluon import _tile_coords
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_gluon import _group_rows
    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import (
        _load_stage16,
        _mma_block,
        _mma_drain,
        _ring_barriers,
        _store_tile,
    )

    @gluon.jit
    def _vk_tile16(tile_id, tiles_per_group, num_pid_p, num_pid_q, offs_ptr, G, M, GROUP_M: gl.constexpr):
        """tile_id -> (g, pid_p, pid_q, first token, end token): one function for the producer and
        the consumers, so they agree on every tile."""
        g = tile_id // tiles_per_group
        pid_p, pid_q = _tile_coords(tile_id - g * tiles_per_group, num_pid_p, num_pid_q, GROUP_M)
        k_start, k_end = _group_rows(offs_ptr, g, G, M)
        return g, pid_p, pid_q, k_start, k_end

    @gluon.jit
    def _vk_grid(P, Q, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(tile rows, tile columns, tiles) of one expert's [P, Q] output."""
        num_pid_p = gl.cdiv(P, BLOCK_M)
        num_pid_q = gl.cdiv(Q, BLOCK_N)
        return num_pid_p, num_pid_q, num_pid_p * num_pid_q

    @gluon.jit
    def _vk16_producer(x_desc, y_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, P, Q, G,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One warp: per tile, the TMA loads of the group's token blocks (none for an empty group)."""
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
        HALF_M: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = y_desc.block_type.shape[2]
        num_pid_p, num_pid_q, tiles_per_group = _vk_grid(P, Q, 2 * HALF_M, BLOCK_N)
        it = 0
        for tile_id in range(gl.program_id(0), G * tiles_per_group, gl.num_programs(0)):
            g, pid_p, pid_q, k_start, k_end = _vk_tile16(tile_id, tiles_per_group, num_pid_p, num_pid_q, offs_ptr,
                                                         G, M, GROUP_M)
            off_p = pid_p * (2 * HALF_M)
            off_q = pid_q * BLOCK_N
            for kk in range(gl.cdiv(k_end - k_start, BLOCK_K)):
                # the last block ends at k_end (see the module docstring); may start before row 0
                k = gl.minimum(k_start + kk * BLOCK_K, k_end - BLOCK_K)
                it = _load_stage16(x_desc, y_desc, a_bufs, b_bufs, ready, empty, it, [k, off_p],
                                   [k, off_p + HALF_M], 0, k, off_q, STAGES)

    @gluon.jit
    def _zero_rows(buf, n):
        """Rows [0, n) of a shared [BLOCK_K, C] box (C a multiple of 64) to zero, in [16, 64]
        pieces (8 elements a thread: one 16-byte vector); pieces wholly at or past row n are not
        touched. A piece that straddles n writes its rows >= n back unchanged. No fence here
        (:func:`_zero_skipped`)."""
        ROWS: gl.constexpr = buf.type.shape[0]
        COLS: gl.constexpr = buf.type.shape[1]
        gl.static_assert(ROWS % 16 == 0 and COLS % 64 == 0, "box must be [16 i, 64 j]")
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [16, 64], 4 warps
        rows = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, layout)), 1)
        for r in gl.static_range(ROWS // 16):
            if r * 16 < n:
                for c in gl.static_range(COLS // 64):
                    piece = buf.slice(r * 16, 16, dim=0).slice(c * 64, 64, dim=1)
                    vals = piece.load(layout)
                    piece.store(gl.where(rows + r * 16 >= n, vals, gl.zeros_like(vals)))

    @gluon.jit
    def _zero_skipped(a_buf, b_buf, n):
        """Rows [0, n) of both operand boxes of a group's last token block (the tokens already
        counted, another group's, or TMA's zeros before row 0) to zero, made visible to the wgmma
        (the async proxy) for the whole warpgroup before it is issued. Zeroing x alone is not
        enough: a zeroed x row times a y row holding Inf is NaN in the MMA (and the other way
        round). x's box is this warpgroup's own; y's box is shared by both warpgroups, so both
        zero it: each writes zeros to rows < n and, in a straddling piece, the values already
        there to rows >= n, so whichever order the two warpgroups' stores and wgmma reads take,
        every read sees the same bytes (zeros below n, the loaded tokens from n on)."""
        _zero_rows(a_buf, n)
        _zero_rows(b_buf, n)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _vk16_mainloop(acc, a_bufs, b_bufs, ready, empty, it, k_tiles, skip, WG: gl.constexpr,
                       STAGES: gl.constexpr):
        """The group's k_tiles (>= 1) token blocks into acc; the last block's first ``skip`` rows
        (already counted, or another group's) zeroed in this warpgroup's x box and in the y box
        first (only there: every other block runs the plain wgmma loop)."""
        for kk in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if kk == k_tiles - 1:
                if skip > 0:
                    b_buf = b_bufs.index(s)  # [1, BLOCK_K, BLOCK_N], the 3-D box
                    _zero_skipped(a_bufs.index(2 * s + WG),
                                  b_buf.reshape([b_buf.type.shape[1], b_buf.type.shape[2]]), skip)
            acc, it = _mma_block(acc, a_bufs, b_bufs, ready, empty, it, kk == 0, WG, STAGES, False, False)
        return _mma_drain(acc, empty, it, STAGES), it

    @gluon.jit
    def _vk16_consumer(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, offs_ptr, M, P, Q, G,
                       WG: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, C_BUFS: gl.constexpr,
                       ACCUMULATE: gl.constexpr):
        """One warpgroup: rows [WG*64, WG*64+64) of every tile: MMAs, then store or reduce-add."""
        HALF_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[1]
        BLOCK_N: gl.constexpr = b_bufs.type.shape[3]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        num_pid_p, num_pid_q, tiles_per_group = _vk_grid(P, Q, 2 * HALF_M, BLOCK_N)
        it = 0
        st = 0
        for tile_id in range(gl.program_id(0), G * tiles_per_group, gl.num_programs(0)):
            g, pid_p, pid_q, k_start, k_end = _vk_tile16(tile_id, tiles_per_group, num_pid_p, num_pid_q, offs_ptr,
                                                         G, M, GROUP_M)
            off_p = pid_p * (2 * HALF_M) + WG * HALF_M
            k_tiles = gl.cdiv(k_end - k_start, BLOCK_K)
            acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_layout)
            if k_tiles > 0:
                acc, it = _vk16_mainloop(acc, a_bufs, b_bufs, ready, empty, it, k_tiles,
                                         k_start + k_tiles * BLOCK_K - k_end, WG, STAGES)
            if off_p < P:  # P % 64 == 0: a half is wholly inside expert g's rows or wholly past them
                if ACCUMULATE:
                    if k_tiles > 0:  # out[g] += 0 for an empty group: nothing to send
                        st = _store_tile(c_desc, c_bufs, acc, g * P + off_p, pid_q * BLOCK_N, st, WG, C_BUFS, True)
                else:
                    st = _store_tile(c_desc, c_bufs, acc, g * P + off_p, pid_q * BLOCK_N, st, WG, C_BUFS)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_gemm_variable_k_gluon_ws_kernel(
        x_desc, y_desc, c_desc, offs_ptr,
        M, P, Q, G,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, C_BUFS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACCUMULATE: gl.constexpr,
    ):
        """out[g] (+)= x[tokens of g]^T @ y[tokens of g]. Descriptors: x_desc [BLOCK_K, 64] boxes of
        x [M, P]; y_desc [1, BLOCK_K, BLOCK_N] of y as [1, M, Q]; c_desc [64, EPI_N] of the
        [G * P, Q] output view."""
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
        HALF_M: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = y_desc.block_type.shape[2]
        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BLOCK_K, HALF_M], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(y_desc.dtype, [STAGES, 1, BLOCK_K, BLOCK_N], y_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 * C_BUFS, HALF_M, c_desc.block_type.shape[1]],
                                           c_desc.layout)
        ready, empty = _ring_barriers(STAGES)
        gl.warp_specialize([
            (_vk16_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, offs_ptr, M, P, Q, G, 0, GROUP_M, STAGES,
                              C_BUFS, ACCUMULATE)),
            (_vk16_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, offs_ptr, M, P, Q, G, 1, GROUP_M, STAGES,
                              C_BUFS, ACCUMULATE)),
            (_vk16_producer, (x_desc, y_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, P, Q, G, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
def gluon_variable_k_operand_reason(x, y, group_offs, out: Optional[torch.Tensor] = None, accumulate: bool = False,
                                    out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """The operand half of :func:`gluon_variable_k_reason` (no platform test: checkable on CPU).
    None when dtypes, shapes, strides and devices are ones the kernel takes."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    for name, t in (("x", x), ("y", y), ("group_offs", group_offs)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        return f"x must be [M_total, P] and y [M_total, Q], got {tuple(x.shape)} and {tuple(y.shape)}"
    if x.dtype not in _m._IN_DTYPES or y.dtype != x.dtype:
        return f"x and y must both be bfloat16 or float16, got {x.dtype} and {y.dtype}"
    dev = x.device
    if y.device != dev or group_offs.device != dev or (isinstance(out, torch.Tensor) and out.device != dev):
        return "x, y, group_offs (and out) must be on one device"
    P, Q = x.shape[1], y.shape[1]
    if P % _HALF_M:
        return f"P={P} must be a multiple of 64 (a warpgroup's rows of the [G * P, Q] output stay inside one expert)"
    if group_offs.dtype != torch.int64 or group_offs.dim() != 1 or group_offs.numel() < 1:
        return f"group_offs must be int64 [G+1], got {group_offs.dtype} {list(group_offs.shape)}"
    G = group_offs.numel() - 1
    for name, t in (("x", x), ("y", y)):
        if t.numel() and not _m._rows_ok(t, 1):
            return f"{name} must be row-major with 16-byte aligned base and rows for TMA (strides {tuple(t.stride())})"
    return variable_k_out_reason(
        out, G, P, Q, accumulate, out_dtype if out_dtype is not None else x.dtype, (x.dtype, torch.float32),
        f"output dtype {{dtype}} must be the operands' ({x.dtype}) or float32",
        None if getattr(_m, "_tma_reduce_add", None) is not None else
        "accumulation needs Gluon's TMA reduce op, not found in this Triton")


def gluon_variable_k_reason(x, y, group_offs, out: Optional[torch.Tensor] = None, accumulate: bool = False,
                            out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when :func:`grouped_gemm_variable_k_gluon` can run these inputs, else why not. Never
    raises, never synchronizes (shapes, dtypes, strides, a cached capability)."""
    return _dense._device_reason(gluon_variable_k_operand_reason, gluon_platform_reason,
                                 (x, y, group_offs, out, accumulate, out_dtype))


def _kernel_args(x, y, group_offs, out, cfg: GluonGroupedConfig, accumulate: bool) -> tuple:
    """(positional args, keyword args) of the launch for validated, non-empty inputs."""
    plan = _plan(x, y, group_offs, out, accumulate, out.dtype, cfg, None, True, with_grid=False)
    return _launch_args(plan, x, y, group_offs, out), plan.kwargs


def grouped_gemm_variable_k_gluon(x: torch.Tensor, y: torch.Tensor, group_offs: torch.Tensor,
                                  out: Optional[torch.Tensor] = None, accumulate: bool = False,
                                  out_dtype: Optional[torch.dtype] = None,
                                  config: Optional[GluonGroupedConfig] = None,
                                  num_programs: Optional[int] = None, keep=None) -> torch.Tensor:
    """``out[g] (+)= x[rows of g]^T @ y[rows of g]``: the MoE wgrad with 16-bit operands.

    Args:
        x: ``[M_total, P]`` bf16 / fp16, row-major (tokens sorted by expert).
        y: ``[M_total, Q]`` of x's dtype, row-major.
        group_offs: ``[G+1]`` int64 on the device (any offsets; read only there: no host sync).
        out: optional ``[G, P, Q]`` output, rows contiguous (a ``[G * P, Q]`` view); every
            ``out[g]`` is written (an empty group's with zeros) unless ``accumulate``.
        accumulate: ``out += ...`` (fp32 ``out`` only: Megatron's ``main_grad``); an empty group
            leaves ``out[g]`` unchanged.
        out_dtype: dtype of the allocated ``out`` (x's dtype by default, or float32).
        config: :class:`GluonGroupedConfig` (VARIABLE_K16_DEFAULT_CONFIG fitted when None).
        num_programs: cap on the persistent grid (the op's ``num_cu``); all SMs when None.
        keep: optional ``(dict, key)``: a prepared launch's record and grid are kept there under
            ``key`` (the caller's own repeat path, ``grouped_gemm_gluon.fire``).

    Raises ValueError with :func:`gluon_variable_k_reason`'s text on inputs it cannot run.
    """
    fk = None
    if out is not None:
        out_dtype = out.dtype
    elif getattr(x, "is_cuda", False):
        try:  # the flat signature of _m._FAST (a non-tensor argument: the checked path raises)
            fk = ("vk16", x.data_ptr(), y.data_ptr(), group_offs.data_ptr(), x.shape, x.stride(), y.shape, y.stride(),
                  group_offs.shape, group_offs.stride(), x.dtype, y.dtype, group_offs.dtype, x.device, y.device,
                  group_offs.device, bool(accumulate), out_dtype, config, num_programs, _m._env_raw("TRITON_INTERPRET"))
            hit = _m._FAST.get(fk)
        except (AttributeError, TypeError):
            fk = hit = None
        if hit is not None:
            plan = hit[0]
            o = torch.empty((plan.G, plan.P, plan.Q), dtype=plan.out_dtype, device=x.device)
            if not _m.fire(hit[2].get(o.data_ptr()), o.device.index):
                _m.fast_miss(_grouped_gemm_variable_k_gluon_ws_kernel, hit, o,
                             lambda: _launch_args(plan, x, y, group_offs, o),
                             (x.data_ptr(), y.data_ptr(), o.data_ptr(), group_offs.data_ptr()))
            return o
    return _m.planned_launch(
        _grouped_gemm_variable_k_gluon_ws_kernel, x.device, out,
        lambda: ("vk16", tensor_sig(x), tensor_sig(y), tensor_sig(group_offs), None if out is None else tensor_sig(out),
                 bool(accumulate), out_dtype, config, num_programs, _m._env_raw("TRITON_INTERPRET")),
        lambda: _plan(x, y, group_offs, out, accumulate, out_dtype, config, num_programs),
        lambda plan: torch.empty((plan.G, plan.P, plan.Q), dtype=plan.out_dtype, device=x.device),
        lambda plan, o: _launch_args(plan, x, y, group_offs, o),
        lambda plan, o: (x.data_ptr(), y.data_ptr(), o.data_ptr(), group_offs.data_ptr()),
        fk, keep)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The signature-determined part of a 16-bit variable-K launch (see the M-grouped ``_Plan``)."""

    M: int
    P: int
    Q: int
    G: int
    out_dtype: torch.dtype
    empty: Optional[str] = None
    cfg: Optional[GluonGroupedConfig] = None
    boxes: tuple = ()
    layouts: tuple = ()
    grid: tuple = ()
    kwargs: Optional[dict] = None


def _plan(x, y, group_offs, out, accumulate, out_dtype, config, num_programs, checked: bool = False,
          with_grid: bool = True) -> _Plan:
    """Validates one call (ValueError naming the problem; ``checked``: the operands were) and plans
    its launch (without its grid, which needs the device's SM count, unless ``with_grid``)."""
    reason = ((None if checked else gluon_variable_k_reason(x, y, group_offs, out, accumulate, out_dtype))
              or _dense._num_programs_reason(num_programs))
    if reason is not None:
        raise ValueError(f"grouped_gemm_variable_k_gluon: {reason}")
    M, P = x.shape
    Q = y.shape[1]
    G = group_offs.numel() - 1
    dtype = out_dtype or x.dtype
    if G == 0 or P == 0 or Q == 0:
        return _Plan(M, P, Q, G, dtype, empty="none")
    if M == 0:
        return _Plan(M, P, Q, G, dtype, empty="none" if accumulate else "zero")
    cfg = config or _m.fitted_config(VARIABLE_K16_DEFAULT_CONFIG, dtype)
    bad = cfg.check(dtype.itemsize) or (
        f"pace is an option of the M-grouped kernel only, got {cfg.short()}" if cfg.pace else None)
    if bad is not None:
        raise ValueError(f"grouped_gemm_variable_k_gluon: {bad}")
    boxes = ((cfg.block_k, _HALF_M), (1, cfg.block_k, cfg.block_n), (_HALF_M, cfg.epi_n))
    layouts = (_m._smem_layout(boxes[0], x.dtype), _m._smem_layout(boxes[1], y.dtype), _m._smem_layout(boxes[2], dtype))
    kwargs = dict(GROUP_M=cfg.group_m, STAGES=cfg.stages, C_BUFS=cfg.c_bufs, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs, ACCUMULATE=bool(accumulate), num_warps=4)
    tiles = G * -(-P // cfg.BLOCK_M) * -(-Q // cfg.block_n)
    grid = (min(num_programs or _dense._num_sms(x.device), tiles),) if with_grid else ()
    return _Plan(M, P, Q, G, dtype, cfg=cfg, boxes=tuple(list(b) for b in boxes), layouts=layouts, grid=grid,
                 kwargs=kwargs)


def _launch_args(plan: _Plan, x, y, group_offs, out) -> tuple:
    """The positional launch arguments of ``plan`` for this call's tensors (descriptors built every
    call: they hold the data pointers)."""
    bx, by, bc = plan.boxes
    lx, ly, lc = plan.layouts
    y3 = y.unsqueeze(0)
    # the experts' outputs as one [G * P, Q] matrix (rows g * P + p); stores clip at Q
    c2 = out.as_strided((plan.G * plan.P, plan.Q), (out.stride(1), 1))
    return (_dense._desc_unchecked(x, list(x.shape), list(x.stride()), bx, lx),
            _dense._desc_unchecked(y3, list(y3.shape), list(y3.stride()), by, ly),
            _dense._desc_unchecked(c2, list(c2.shape), list(c2.stride()), bc, lc),
            group_offs, plan.M, plan.P, plan.Q, plan.G)
