"""FP8 grouped GEMM for MoE experts: persistent Triton kernels with a device-side tile schedule.

Both kernels read K-major FP8 operands (docs/low_precision.md, "GEMM operand layouts") and
accumulate in fp32; group sizes are only read on the device (no host synchronisation), exactly as
the bf16 kernels of ``grouped_gemm_kernel.py`` whose schedule they mirror.

* ``_grouped_gemm_fp8_kernel`` (forward and dgrad, M-grouped)::

      C[offs[g]:offs[g+1]] = (A_q * sa)[rows of g] @ ((B_q[g] * sb[g]))^T        C[offs[G]:] = 0

  ``A_q [M_total, K]``, ``B_q [G, N, K]`` (any strides; K-major is what FP8 ``wgmma`` reads fast).
  Scale modes (the ``SCALE_MODE`` constexpr):

  - 0 TENSORWISE: ``sa`` one fp32, ``sb [G]`` one fp32 per expert; epilogue ``acc * sa * sb[g]``.
  - 1 ROWWISE: ``sa [M_total]`` (per token row), ``sb [G, N]`` (per expert output row); epilogue
    outer product.
  - 2 BLOCKWISE: ``sa [M_total, ceil(K/bs)]`` (1 x bs blocks along each row; group segments are row
    ranges, so a block never straddles two experts) and ``sb [G, ceil(N/bs), ceil(K/bs)]`` (bs x bs
    tiles per expert). ``BLOCK_K`` divides ``bs``; every K step's FP8 dot is promoted into the fp32
    accumulator with its scales (as the dense kernel in ``gemm/gemm_fp8_kernel.py``).
  - 3 MX_BLOCKWISE (emulated: Hopper has no block-scaled MMA): ``sa [M_total, K/32]``,
    ``sb [G, N, K/32]`` E8M0 bytes (uint8 views). Each FP8 tile is widened to bf16 with its
    power-of-two scales folded in and goes through a bf16 dot with fp32 accumulation: exact (see
    the MX notes of ``gemm/gemm_fp8_kernel.py``, whose helpers are reused). K % 32 == 0.

* ``_grouped_gemm_fp8_variable_k_kernel`` (wgrad): ``C[g] (+)= (X_t * sx)[:, rows of g] @
  ((Y_t * sy)[:, rows of g])^T`` for ``X_t [P, M_total]``, ``Y_t [Q, M_total]`` (the column-wise
  quantized copies, stored transposed so the reduction dim is contiguous) and ``C [G, P, Q]``.
  Modes 0 (``sx``, ``sy`` one fp32 each), 1 (``sx [P]``, ``sy [Q]``: one scale per column of
  the untransposed tensor, over all tokens), 2 (BLOCKWISE: ``sx [P, M_total/bs]``,
  ``sy [Q, M_total/bs]`` fp32, 1 x bs blocks along the reduction dim; ``BLOCK_K`` divides ``bs`` and
  every K step's FP8 dot is promoted into the fp32 accumulator with its two scales, as mode 2 of
  the M-grouped kernel) and 3 (MX: ``sx [P, M_total/32]``, ``sy [Q, M_total/32]`` E8M0, 32-token
  blocks along the reduction dim). Modes 2 and 3 need **every group offset to be a multiple of
  the token block** (bs / 32), so no block straddles two experts: the op layer feeds a token layout
  whose group segments are padded with zero rows to multiples of it, which cannot be checked here
  without a host sync; optional ``C +=`` epilogue (Megatron ``main_grad``). Each group's token
  range is walked as a masked head step up to a multiple of 16, unmasked whole ``BLOCK_K`` steps
  and a masked tail step (``_token_split``): a load masked along the contiguous token dim, or from
  an offset of unknown alignment, is a 1-byte scalar load, the unmasked body loads 16-byte vectors.

Masked pointer loads (any strides), no tensor descriptors yet.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, is_interpreter
from primus_turbo.triton.gemm.gemm_fp8_kernel import _e8m0_to_fp32, _mx_widen
from primus_turbo.triton.interpreter import bf16_dot_fixed

# persistent-grid size and device guard: the same as the 16-bit kernels'
from .grouped_gemm_kernel import _group_span, _num_programs, _run_on_device, _swizzle, _token_split, group_offsets

__all__ = [
    "GroupedGemmFP8Config",
    "GROUPED_FP8_MODES",
    "check_grouped_gemm_fp8_triton",
    "check_grouped_gemm_fp8_variable_k_triton",
    "grouped_gemm_fp8_triton",
    "grouped_gemm_fp8_variable_k_triton",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_MX_SCALE_DTYPES = tuple(d for d in (_E8M0, torch.uint8) if d is not None)
_TENSORWISE, _ROWWISE, _BLOCKWISE, _MX = 0, 1, 2, 3
GROUPED_FP8_MODES = {"TENSORWISE": _TENSORWISE, "ROWWISE": _ROWWISE, "BLOCKWISE": _BLOCKWISE, "MX_BLOCKWISE": _MX}
MX_BLOCK = 32


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _grouped_gemm_fp8_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, sa_ptr, sb_ptr,
    M, N, K, G,
    stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
    NUM_PROGRAMS: tl.constexpr,
    SCALE_MODE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    tile_base = 0
    for g in range(0, G + 1):  # g == G: the zeroed tail rows
        m_start, m_end, num_pid_m, tiles_g, first = _group_span(offs_ptr, g, G, M, num_pid_n, tile_base, BLOCK_M,
                                                                NUM_PROGRAMS)
        g64 = tl.cast(tl.minimum(g, G - 1), tl.int64)
        b_g = b_ptr + g64 * stride_bg
        sb_g = sb_ptr + g64 * stride_sbg
        for i in range(tl.cdiv(tiles_g - first, NUM_PROGRAMS)):  # grouped_gemm_kernel: why not range(first, ...)
            t = first + i * NUM_PROGRAMS
            pid_m, pid_n = _swizzle(t, num_pid_m, num_pid_n, GROUP_M)
            rows = m_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_m = rows < m_end
            mask_n = cols < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if g < G:
                a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
                b_rows = b_g + cols.to(tl.int64)[:, None] * stride_bn
                for ki in range(k_tiles):
                    k = ki * BLOCK_K + offs_k
                    k64 = k.to(tl.int64)
                    mask_k = k < K
                    a = tl.load(a_rows + k64[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                    b = tl.load(b_rows + k64[None, :] * stride_bk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                    if SCALE_MODE == 2:
                        partial = tl.dot(a, tl.trans(b))
                        kb = (ki * BLOCK_K) // SCALE_BLOCK
                        sa = tl.load(sa_ptr + rows.to(tl.int64) * stride_sam + kb * stride_sak, mask=mask_m, other=0.0)
                        sb = tl.load(sb_g + (cols // SCALE_BLOCK).to(tl.int64) * stride_sbn + kb * stride_sbk,
                                     mask=mask_n, other=0.0)
                        acc += partial * sa[:, None] * sb[None, :]
                    elif SCALE_MODE == 3:  # MX: exact power-of-two scales folded into the bf16 widening
                        NG: tl.constexpr = BLOCK_K // 32
                        kg = ki * NG + tl.arange(0, NG)
                        kg_ok = kg < K // 32
                        # masked groups read exponent 127 (scale 1) on zero-filled data
                        ea = tl.load(sa_ptr + rows.to(tl.int64)[:, None] * stride_sam + kg[None, :] * stride_sak,
                                     mask=mask_m[:, None] & kg_ok[None, :], other=127)
                        eb = tl.load(sb_g + cols.to(tl.int64)[:, None] * stride_sbn + kg[None, :] * stride_sbk,
                                     mask=mask_n[:, None] & kg_ok[None, :], other=127)
                        a16 = _mx_widen(a, _e8m0_to_fp32(ea.to(tl.int32)), BLOCK_M, BLOCK_K)
                        b16 = _mx_widen(b, _e8m0_to_fp32(eb.to(tl.int32)), BLOCK_N, BLOCK_K)
                        acc = tl.dot(a16, tl.trans(b16), acc)
                    else:
                        acc = tl.dot(a, tl.trans(b), acc)
                if SCALE_MODE == 0:
                    acc = acc * (tl.load(sa_ptr) * tl.load(sb_g))
                elif SCALE_MODE == 1:
                    sa = tl.load(sa_ptr + rows.to(tl.int64) * stride_sam, mask=mask_m, other=0.0)
                    sb = tl.load(sb_g + cols.to(tl.int64) * stride_sbn, mask=mask_n, other=0.0)
                    acc = acc * sa[:, None] * sb[None, :]
            c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
        tile_base += tiles_g


@triton.jit
def _vk_fp8_step(
    acc, x_rows, y_rows, sx_ptr, sy_ptr, ps, qs, mask_p, mask_q, r0, r_hi,
    stride_xm, stride_ym, stride_sx, stride_sy, stride_sxk, stride_syk,
    SCALE_MODE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr,
):
    """One K step of the variable-K kernel over tokens ``[r0, r0 + BLOCK_K)`` (``[r0, r_hi)`` when
    MASKED). MASKED is constexpr so the unmasked body carries no token mask at all: a mask along
    the contiguous token dim (constancy 1) forces 1-byte scalar loads."""
    r = r0 + tl.arange(0, BLOCK_K)
    r64 = r.to(tl.int64)
    if MASKED:
        mask_r = r < r_hi
        x = tl.load(x_rows + r64[None, :] * stride_xm, mask=mask_p[:, None] & mask_r[None, :], other=0.0)
        y = tl.load(y_rows + r64[None, :] * stride_ym, mask=mask_q[:, None] & mask_r[None, :], other=0.0)
    else:
        x = tl.load(x_rows + r64[None, :] * stride_xm, mask=mask_p[:, None], other=0.0)
        y = tl.load(y_rows + r64[None, :] * stride_ym, mask=mask_q[:, None], other=0.0)
    if SCALE_MODE == 2:  # BLOCKWISE: SCALE_BLOCK-token blocks (group offsets are multiples of it)
        # BLOCK_K divides SCALE_BLOCK and r0 is a multiple of BLOCK_K past a block-aligned group
        # start: the step lies in the token block r0 // SCALE_BLOCK; promote it into fp32 with its
        # scales
        partial = tl.dot(x, tl.trans(y))
        kb = r0 // SCALE_BLOCK
        sxb = tl.load(sx_ptr + ps.to(tl.int64) * stride_sx + kb * stride_sxk, mask=mask_p, other=0.0)
        syb = tl.load(sy_ptr + qs.to(tl.int64) * stride_sy + kb * stride_syk, mask=mask_q, other=0.0)
        acc += partial * sxb[:, None] * syb[None, :]
    elif SCALE_MODE == 3:  # MX: 32-token blocks (group offsets are multiples of 32)
        NG: tl.constexpr = BLOCK_K // 32
        rg = r0 // 32 + tl.arange(0, NG)
        if MASKED:  # groups past r_hi read exponent 127 (scale 1) on zero-filled data
            rg_ok = rg * 32 < r_hi
            ex = tl.load(sx_ptr + ps.to(tl.int64)[:, None] * stride_sx + rg[None, :] * stride_sxk,
                         mask=mask_p[:, None] & rg_ok[None, :], other=127)
            ey = tl.load(sy_ptr + qs.to(tl.int64)[:, None] * stride_sy + rg[None, :] * stride_syk,
                         mask=mask_q[:, None] & rg_ok[None, :], other=127)
        else:
            ex = tl.load(sx_ptr + ps.to(tl.int64)[:, None] * stride_sx + rg[None, :] * stride_sxk,
                         mask=mask_p[:, None], other=127)
            ey = tl.load(sy_ptr + qs.to(tl.int64)[:, None] * stride_sy + rg[None, :] * stride_syk,
                         mask=mask_q[:, None], other=127)
        x16 = _mx_widen(x, _e8m0_to_fp32(ex.to(tl.int32)), BLOCK_M, BLOCK_K)
        y16 = _mx_widen(y, _e8m0_to_fp32(ey.to(tl.int32)), BLOCK_N, BLOCK_K)
        acc = tl.dot(x16, tl.trans(y16), acc)
    else:
        acc = tl.dot(x, tl.trans(y), acc)
    return acc


@triton.jit
def _grouped_gemm_fp8_variable_k_kernel(
    x_ptr, y_ptr, c_ptr, offs_ptr, sx_ptr, sy_ptr,
    M, P, Q, G,
    stride_xp, stride_xm, stride_yq, stride_ym, stride_cg, stride_cp, stride_cq, stride_sx, stride_sy,
    stride_sxk, stride_syk,
    NUM_PROGRAMS: tl.constexpr,
    SCALE_MODE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(P, BLOCK_M)
    num_pid_n = tl.cdiv(Q, BLOCK_N)
    tiles_per_group = num_pid_m * num_pid_n
    total = G * tiles_per_group
    for tile_id in range(pid, total, NUM_PROGRAMS):
        g = tile_id // tiles_per_group
        pid_m, pid_n = _swizzle(tile_id % tiles_per_group, num_pid_m, num_pid_n, GROUP_M)
        r_start = tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), M).to(tl.int32)
        r_end = tl.maximum(tl.minimum(tl.load(offs_ptr + g + 1), M).to(tl.int32), r_start)
        ps = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        qs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_p = ps < P
        mask_q = qs < Q
        x_rows = x_ptr + ps.to(tl.int64)[:, None] * stride_xp
        y_rows = y_ptr + qs.to(tl.int64)[:, None] * stride_yq
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # head (masked), body of whole 16-aligned steps (unmasked: 16-byte vector loads along the
        # contiguous tokens), tail (masked): see _token_split. BLOCKWISE / MX group offsets are
        # multiples of the token block (>= 16), so their head is empty and every step stays in one
        # token block; the tail is a partial MX step at most (BLOCK_K divides a BLOCKWISE block)
        body_start, head_end, n_body, tail_start = _token_split(r_start, r_end, 16, BLOCK_K)
        if r_start < head_end:
            acc = _vk_fp8_step(acc, x_rows, y_rows, sx_ptr, sy_ptr, ps, qs, mask_p, mask_q, r_start, head_end,
                               stride_xm, stride_ym, stride_sx, stride_sy, stride_sxk, stride_syk,
                               SCALE_MODE, SCALE_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K, True)
        for i in range(n_body):
            r0 = tl.multiple_of(body_start + i * BLOCK_K, 16)
            acc = _vk_fp8_step(acc, x_rows, y_rows, sx_ptr, sy_ptr, ps, qs, mask_p, mask_q, r0, r_end,
                               stride_xm, stride_ym, stride_sx, stride_sy, stride_sxk, stride_syk,
                               SCALE_MODE, SCALE_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K, False)
        if tail_start < r_end:
            acc = _vk_fp8_step(acc, x_rows, y_rows, sx_ptr, sy_ptr, ps, qs, mask_p, mask_q, tail_start, r_end,
                               stride_xm, stride_ym, stride_sx, stride_sy, stride_sxk, stride_syk,
                               SCALE_MODE, SCALE_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K, True)
        if SCALE_MODE == 0:
            acc = acc * (tl.load(sx_ptr) * tl.load(sy_ptr))
        elif SCALE_MODE == 1:
            sx = tl.load(sx_ptr + ps.to(tl.int64) * stride_sx, mask=mask_p, other=0.0)
            sy = tl.load(sy_ptr + qs.to(tl.int64) * stride_sy, mask=mask_q, other=0.0)
            acc = acc * sx[:, None] * sy[None, :]
        c_ptrs = (c_ptr + tl.cast(g, tl.int64) * stride_cg + ps.to(tl.int64)[:, None] * stride_cp
                  + qs.to(tl.int64)[None, :] * stride_cq)
        mask = mask_p[:, None] & mask_q[None, :]
        if ACCUMULATE:
            acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GroupedGemmFP8Config:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8


_INTERPRETER_CONFIG = GroupedGemmFP8Config(32, 32, 32, group_m=2, num_stages=1, num_warps=4)
# MX: BLOCK_K 64 so a tile holds two 32-wide scale groups (the reshape path runs)
_INTERPRETER_CONFIG_MX = GroupedGemmFP8Config(32, 32, 64, group_m=2, num_stages=1, num_warps=4)
# BLOCKWISE variable-K: whole token blocks per K step (padded segments are block multiples, and the
# interpreter's cost is per step); BLOCK_K is capped at block_size below
_INTERPRETER_CONFIG_VK_BLOCKWISE = GroupedGemmFP8Config(64, 64, 128, group_m=2, num_stages=1, num_warps=4)
def _default_config(m_avg: int, n: int, mode: int, block_size: int, variable_k: bool) -> GroupedGemmFP8Config:
    """Static-shape analytic config (sm_90, FP8 tiles of 1 byte per element)."""
    if is_interpreter():
        cfg = _INTERPRETER_CONFIG_MX if mode == _MX else _INTERPRETER_CONFIG
        if mode == _BLOCKWISE and variable_k:
            cfg = _INTERPRETER_CONFIG_VK_BLOCKWISE
    elif mode == _MX:  # tiles are widened to bf16 in registers: bf16-sized tiles, shorter K steps
        cfg = GroupedGemmFP8Config(128, 128, 64, 8, 3, 8) if (variable_k or m_avg > 64) else \
            GroupedGemmFP8Config(64, 128, 64, 8, 3, 4)
    elif variable_k and mode == _BLOCKWISE:  # whole 128-token scale blocks per step: 331-373 vs
        cfg = GroupedGemmFP8Config(128, 128, 128, 8, 3, 8)  # 246-251 TFLOP/s at BLOCK_K 64 (H200 sweep)
    elif variable_k:
        cfg = GroupedGemmFP8Config(128, 128, 64, 8, 4, 8)
    elif m_avg <= 64:
        cfg = GroupedGemmFP8Config(64, 128, 128, 8, 4, 4)
    else:
        cfg = GroupedGemmFP8Config(128, 128, 128, 8, 3, 8)
    if mode == _BLOCKWISE and block_size % cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=min(cfg.block_k, block_size))
    return cfg


# ----------------------------------------------------------------------------------------------
# Validation (shapes, dtypes, devices only: never a device value)
# ----------------------------------------------------------------------------------------------
def _mode_of(mode) -> int:
    name = str(getattr(mode, "name", mode)).upper()
    if name not in GROUPED_FP8_MODES:
        raise ValueError(f"scaling granularity {name} is not supported by the grouped FP8 kernels "
                         f"(supported: {', '.join(GROUPED_FP8_MODES)})")
    return GROUPED_FP8_MODES[name]


def _device_ok(device: torch.device) -> None:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"sm_{cap[0]}{cap[1]} has no FP8 tensor cores (needs sm_89 or newer)")
        return
    if not (device.type == "cpu" and is_interpreter()):
        raise ValueError(f"tensors on {device}; needs CUDA (or CPU with TRITON_INTERPRET=1)")


def _check_offsets(group_lens, group_offs, G: int, device) -> None:
    for gname, t, n in (("group_lens", group_lens, G), ("group_offs", group_offs, G + 1)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{gname} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise TypeError(f"{gname} must be int64, got {t.dtype}")
        if t.dim() != 1 or t.numel() != n:
            raise ValueError(f"{gname} must be 1-D with {n} entries, got shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{gname} on {t.device}, operands on {device}")
    if group_lens is None and group_offs is None:
        raise ValueError("group_lens or group_offs is needed")


def _check_scale(name, s, want: tuple, device, mx: bool = False) -> None:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
    if mx and s.dtype not in _MX_SCALE_DTYPES:
        raise TypeError(f"{name}: {s.dtype} scales are not supported by MX_BLOCKWISE (float8_e8m0fnu or uint8 "
                        "bytes needed)")
    if not mx and s.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {s.dtype}")
    if s.device != device:
        raise ValueError(f"{name} on {s.device}, operands on {device}")
    if tuple(s.shape) != want:
        raise ValueError(f"{name} must have shape {list(want)}, got {list(s.shape)}")


def _check_mx_interpreter(device) -> None:
    if device.type == "cpu" and not bf16_dot_fixed():
        raise ValueError("MX_BLOCKWISE runs a bf16 dot, which the Triton interpreter gets wrong (triton issue "
                         "#11584); call primus_turbo.triton.interpreter.fix_bf16_dot() first")


def _validate(a, sa, b, sb, mode, group_lens, group_offs, out_dtype, block_size) -> int:
    mode = _mode_of(mode)
    for n, t, d in (("a", a, 2), ("b", b, 3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != d:
            raise ValueError(f"{n} must be {d}-D, got shape {tuple(t.shape)}")
        if t.dtype not in FP8_DTYPES:
            raise TypeError(f"{n}.dtype={t.dtype} is not float8_e4m3fn or float8_e5m2")
    M, K = a.shape
    G, N, Kb = b.shape
    if Kb != K:
        raise ValueError(f"K mismatch: a is [M, K] = {list(a.shape)}, b is [G, N, K] = {list(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"device mismatch: a on {a.device}, b on {b.device}")
    _device_ok(a.device)
    _check_offsets(group_lens, group_offs, G, a.device)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not one of bfloat16, float16, float32")
    if mode == _TENSORWISE:
        _check_scale("a_scale", sa.reshape(()) if isinstance(sa, torch.Tensor) and sa.numel() == 1 else sa, (),
                     a.device)
        _check_scale("b_scale", sb, (G,), a.device)
    elif mode == _ROWWISE:
        _check_scale("a_scale", sa, (M,), a.device)
        _check_scale("b_scale", sb, (G, N), a.device)
    elif mode == _MX:
        if K % MX_BLOCK:
            raise ValueError(f"MX_BLOCKWISE needs K to be a multiple of 32, got K={K}")
        _check_mx_interpreter(a.device)
        _check_scale("a_scale", sa, (M, K // MX_BLOCK), a.device, mx=True)
        _check_scale("b_scale", sb, (G, N, K // MX_BLOCK), a.device, mx=True)
    else:
        if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}")
        kb = cdiv(K, block_size)
        _check_scale("a_scale", sa, (M, kb), a.device)
        _check_scale("b_scale", sb, (G, cdiv(N, block_size), kb), a.device)
    return mode


def _validate_variable_k(xt, sx, yt, sy, mode, group_lens, group_offs, out, accumulate, out_dtype,
                         block_size=128) -> int:
    mode = _mode_of(mode)
    for n, t in (("x_t", xt), ("y_t", yt)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{n} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype not in FP8_DTYPES:
            raise TypeError(f"{n}.dtype={t.dtype} is not float8_e4m3fn or float8_e5m2")
    if xt.shape[1] != yt.shape[1] or xt.device != yt.device:
        raise ValueError(f"x_t {tuple(xt.shape)} on {xt.device} and y_t {tuple(yt.shape)} on {yt.device} "
                         "must share the token dim (dim 1) and device")
    _device_ok(xt.device)
    G = group_lens.numel() if isinstance(group_lens, torch.Tensor) else group_offs.numel() - 1
    _check_offsets(group_lens, group_offs, G, xt.device)
    P, Q = xt.shape[0], yt.shape[0]
    if mode == _TENSORWISE:
        _check_scale("x_scale", sx, (), xt.device)
        _check_scale("y_scale", sy, (), xt.device)
    elif mode == _MX:
        Mt = xt.shape[1]
        if Mt % MX_BLOCK:
            raise ValueError(f"MX_BLOCKWISE needs the token dim of x_t / y_t to be a multiple of 32 (a layout "
                             f"with group segments padded to multiples of 32), got {Mt}")
        _check_mx_interpreter(xt.device)
        _check_scale("x_scale", sx, (P, Mt // MX_BLOCK), xt.device, mx=True)
        _check_scale("y_scale", sy, (Q, Mt // MX_BLOCK), xt.device, mx=True)
    elif mode == _BLOCKWISE:
        Mt = xt.shape[1]
        if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"BLOCKWISE needs block_size to be a power of two >= 16, got {block_size!r}")
        if Mt % block_size:
            raise ValueError(f"BLOCKWISE needs the token dim of x_t / y_t to be a multiple of block_size={block_size} "
                             f"(a layout with group segments padded to multiples of it), got {Mt}")
        _check_scale("x_scale (BLOCKWISE)", sx, (P, Mt // block_size), xt.device)
        _check_scale("y_scale (BLOCKWISE)", sy, (Q, Mt // block_size), xt.device)
    else:
        _check_scale("x_scale", sx, (P,), xt.device)
        _check_scale("y_scale", sy, (Q,), xt.device)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out")
        if out_dtype not in _OUT_DTYPES:
            raise TypeError(f"out_dtype={out_dtype} is not one of bfloat16, float16, float32")
        return mode
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (G, P, Q) or out.device != xt.device:
        raise ValueError(f"out must be a tensor of shape {(G, P, Q)} on {xt.device}")
    if out.dtype not in _OUT_DTYPES:
        raise TypeError(f"out.dtype={out.dtype} is not one of bfloat16, float16, float32")
    return mode


def check_grouped_gemm_fp8_triton(a, sa, b, sb, mode, group_lens, group_offs=None, out_dtype=torch.bfloat16,
                                  block_size=128) -> Optional[str]:
    """None when :func:`grouped_gemm_fp8_triton` can run these inputs, else a reason. Never raises."""
    try:
        _validate(a, sa, b, sb, mode, group_lens, group_offs, out_dtype, block_size)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return None


def check_grouped_gemm_fp8_variable_k_triton(xt, sx, yt, sy, mode, group_lens, group_offs=None, out=None,
                                             accumulate=False, out_dtype=torch.bfloat16,
                                             block_size=128) -> Optional[str]:
    try:
        _validate_variable_k(xt, sx, yt, sy, mode, group_lens, group_offs, out, accumulate, out_dtype, block_size)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def grouped_gemm_fp8_triton(
    a_q: torch.Tensor, sa: torch.Tensor, b_q: torch.Tensor, sb: torch.Tensor, mode,
    group_lens: Optional[torch.Tensor], group_offs: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16, block_size: int = 128, num_cu: Optional[int] = None,
    config: Optional[GroupedGemmFP8Config] = None, *, checked: bool = False,
) -> torch.Tensor:
    """``out[rows of g] = (a_q * sa)[rows of g] @ (b_q[g] * sb[g]).T``, rows past ``offs[G]`` zero.

    ``a_q [M_total, K]`` and ``b_q [G, N, K]`` FP8 (e4m3fn / e5m2, may differ). Scales (fp32
    dequantization multipliers): TENSORWISE ``sa []``, ``sb [G]``; ROWWISE ``sa [M_total]``,
    ``sb [G, N]``; BLOCKWISE ``sa [M_total, ceil(K/bs)]``, ``sb [G, ceil(N/bs), ceil(K/bs)]``;
    MX_BLOCKWISE ``sa [M_total, K/32]``, ``sb [G, N, K/32]`` E8M0 (K % 32 == 0).
    No host synchronisation.
    """
    if not checked:
        mode = _validate(a_q, sa, b_q, sb, mode, group_lens, group_offs, out_dtype, block_size)
    else:
        mode = _mode_of(mode)
    if group_offs is None:
        group_offs = group_offsets(group_lens)
    M, K = a_q.shape
    G, N, _ = b_q.shape
    out = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    if M == 0 or N == 0:
        return out
    if G == 0 or K == 0:
        return out.zero_()
    cfg = config or _default_config(max(1, M // G), N, mode, block_size, False)
    if mode == _BLOCKWISE and block_size % cfg.block_k:
        raise ValueError(f"BLOCKWISE needs BLOCK_K ({cfg.block_k}) to divide block_size ({block_size})")
    if mode == _MX and cfg.block_k % MX_BLOCK:
        raise ValueError(f"MX_BLOCKWISE needs BLOCK_K ({cfg.block_k}) to be a multiple of 32")
    programs = _num_programs(a_q.device, num_cu)
    max_tiles = (cdiv(M, cfg.block_m) + G + 1) * cdiv(N, cfg.block_n)
    grid = (min(programs, max_tiles),)
    if mode == _TENSORWISE:
        sa_strides, sb_strides = (0, 0), (sb.stride(0), 0, 0)
    elif mode == _ROWWISE:
        sa_strides, sb_strides = (sa.stride(0), 0), (sb.stride(0), sb.stride(1), 0)
    elif mode == _MX:  # E8M0 bytes are read as uint8 and decoded in the kernel
        sa, sb = sa.view(torch.uint8), sb.view(torch.uint8)
        sa_strides, sb_strides = tuple(sa.stride()), tuple(sb.stride())
    else:
        sa_strides, sb_strides = (sa.stride(0), sa.stride(1)), tuple(sb.stride())

    def launch():
        _grouped_gemm_fp8_kernel[grid](
            a_q, b_q, out, group_offs, sa, sb, M, N, K, G,
            a_q.stride(0), a_q.stride(1), b_q.stride(0), b_q.stride(1), b_q.stride(2), out.stride(0), out.stride(1),
            *sa_strides, *sb_strides,
            NUM_PROGRAMS=grid[0], SCALE_MODE=mode, SCALE_BLOCK=block_size,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_stages=cfg.num_stages, num_warps=cfg.num_warps,
        )
        return out

    return _run_on_device(a_q.device, launch)


def grouped_gemm_fp8_variable_k_triton(
    x_t: torch.Tensor, sx: torch.Tensor, y_t: torch.Tensor, sy: torch.Tensor, mode,
    group_lens: Optional[torch.Tensor], group_offs: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None, accumulate: bool = False, out_dtype: torch.dtype = torch.bfloat16,
    num_cu: Optional[int] = None, config: Optional[GroupedGemmFP8Config] = None, *, block_size: int = 128,
    checked: bool = False,
) -> torch.Tensor:
    """``out[g] (+)= (x_t * sx)[:, rows of g] @ ((y_t * sy)[:, rows of g]).T``: ``[G, P, Q]``.

    ``x_t [P, M_total]``, ``y_t [Q, M_total]`` FP8 (the reduction runs along dim 1, over the
    group's tokens); TENSORWISE ``sx``, ``sy`` 0-dim, ROWWISE ``sx [P]``, ``sy [Q]``, BLOCKWISE
    ``sx [P, M_total/bs]``, ``sy [Q, M_total/bs]`` fp32 (1 x ``block_size`` blocks along the tokens,
    ``M_total % bs == 0``), MX_BLOCKWISE ``sx [P, M_total/32]``, ``sy [Q, M_total/32]`` E8M0.
    BLOCKWISE and MX need every group offset to be a multiple of the token block (not checked: it
    would need a host sync; the op layer pads group segments). An empty group gives zeros (or
    leaves ``out[g]`` unchanged when accumulating). No host synchronisation.
    """
    if not checked:
        mode = _validate_variable_k(x_t, sx, y_t, sy, mode, group_lens, group_offs, out, accumulate, out_dtype,
                                    block_size)
    else:
        mode = _mode_of(mode)
    G = group_lens.numel() if group_lens is not None else group_offs.numel() - 1
    if group_offs is None:
        group_offs = group_offsets(group_lens)
    P, M = x_t.shape
    Q = y_t.shape[0]
    if out is None:
        out = torch.empty((G, P, Q), dtype=out_dtype, device=x_t.device)
    if G == 0 or P == 0 or Q == 0:
        return out
    if M == 0:
        return out if accumulate else out.zero_()
    cfg = config or _default_config(max(1, M // G), Q, mode, block_size, True)
    if cfg.block_k < 16:  # the head step covers up to 15 tokens (to the next multiple of 16)
        raise ValueError(f"the variable-K kernel needs BLOCK_K >= 16, got {cfg.block_k}")
    if mode == _BLOCKWISE and block_size % cfg.block_k:
        raise ValueError(f"BLOCKWISE needs BLOCK_K ({cfg.block_k}) to divide block_size ({block_size})")
    if mode == _MX and cfg.block_k % MX_BLOCK:
        raise ValueError(f"MX_BLOCKWISE needs BLOCK_K ({cfg.block_k}) to be a multiple of 32")
    programs = _num_programs(x_t.device, num_cu)
    grid = (min(programs, G * cdiv(P, cfg.block_m) * cdiv(Q, cfg.block_n)),)
    ssx = 0 if mode == _TENSORWISE else sx.stride(0)
    ssy = 0 if mode == _TENSORWISE else sy.stride(0)
    ssxk = ssyk = 0
    if mode == _MX:  # E8M0 bytes are read as uint8 and decoded in the kernel
        sx, sy = sx.view(torch.uint8), sy.view(torch.uint8)
    if mode in (_MX, _BLOCKWISE):  # [P, M_total / block], [Q, M_total / block]
        ssx, ssxk, ssy, ssyk = sx.stride(0), sx.stride(1), sy.stride(0), sy.stride(1)

    def launch():
        _grouped_gemm_fp8_variable_k_kernel[grid](
            x_t, y_t, out, group_offs, sx, sy, M, P, Q, G,
            x_t.stride(0), x_t.stride(1), y_t.stride(0), y_t.stride(1),
            out.stride(0), out.stride(1), out.stride(2), ssx, ssy, ssxk, ssyk,
            NUM_PROGRAMS=grid[0], SCALE_MODE=mode, SCALE_BLOCK=block_size if mode == _BLOCKWISE else MX_BLOCK,
            ACCUMULATE=accumulate,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_stages=cfg.num_stages, num_warps=cfg.num_warps,
        )
        return out

    return _run_on_device(x_t.device, launch)
