"""FP8 GEMM for Hopper: ``C[M, N] (=|+=) (A_q[M, K] * sa) @ (B_q[N, K] * sb)^T`` with fp32 accumulation.

Both operands are canonical K-major FP8 (``float8_e4m3fn`` or ``float8_e5m2``, and A and B may
differ: HYBRID backward multiplies an E5M2 gradient by an E4M3 weight), which is what FP8 ``wgmma``
reads: A tiles ``[BLOCK_M, BLOCK_K]`` straight from ``[M, K]`` and B tiles ``[BLOCK_N, BLOCK_K]``
from ``[N, K]``, transposed in registers for the dot. Scales are the dequantization multipliers of
docs/low_precision.md, one of four modes (a kernel constexpr):

* TENSORWISE: ``sa``, ``sb`` one fp32 each. The K loop is a plain FP8 dot; the epilogue multiplies
  the tile by ``sa * sb``.
* ROWWISE: ``sa [M, 1]``, ``sb [N, 1]`` (``[1, L]`` and ``[L]`` also accepted). Plain FP8 dot; the
  epilogue multiplies by the outer product ``sa[:, None] * sb[None, :]``.
* BLOCKWISE (the DeepSeek-V3 / DeepGEMM recipe): 1 x bs blocks along K (activations,
  ``[rows, ceil(K/bs)]``) or bs x bs blocks (weights, ``[ceil(rows/bs), ceil(K/bs)]``), per operand.
  ``BLOCK_K`` divides ``bs`` (128 for bs = 128). Every K step computes a fresh FP8 dot ``partial``
  and promotes it into the fp32 accumulator with its scales, ``acc += partial * sa[:, kb] * sb[.., kb]``:
  the tensor core's reduced-precision FP8 accumulation never runs longer than one block. When the
  tile's columns lie inside one weight block (``BLOCK_N`` divides bs), ``sb`` is one scalar per K step.
* MX_BLOCKWISE (emulated; Hopper has no block-scaled MMA): ``sa [M, K/32]``, ``sb [N, K/32]`` E8M0.
  Each FP8 tile is widened to bf16 with its power-of-two scales folded in,
  ``bf16(q * 2**(e - 127))``, and the bf16 tiles go through a bf16 dot with fp32 accumulation. This
  is exact: an FP8 value has at most 4 significant bits and multiplying by a power of two only moves
  its exponent; bf16 has fp32's exponent range and 8 significant bits, so the scaled value is a bf16
  exactly whenever it is a normal bf16 (any scale a quantizer derives from bf16/fp32-range data);
  products of two such values have <= 8 significant bits and are exact in fp32. The result is the
  fp32 accumulation of the exactly dequantized products, i.e. what the MX spec defines, with no
  per-32 rescaling of partial sums (which would cost more CUDA-core work per K step than the MMA,
  and would keep the FP8 MMA's reduced-precision accumulation). The scale ``2**(e - 127)`` is built
  from its fp32 bit pattern (``e << 23``; ``e = 0`` is the subnormal ``2**-127``; ``e = 255`` is NaN,
  which OCP MX defines as "the whole block is NaN").

Two kernels share one persistent, GROUP_M-swizzled structure (as the dense GEMM in gemm_kernel.py,
whose tile ordering and epilogue they reuse): ``_gemm_fp8_tma_kernel`` reads A and B through
device-side tensor descriptors (TMA; both operands with unit K stride, 16-byte aligned base and
leading stride), ``_gemm_fp8_ptr_kernel`` is its masked-pointer twin for anything else.
``gemm_fp8_triton`` validates, picks a config (analytic default per mode, or a small first-call
autotune that never touches the caller's buffers) and launches.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional, Union

import torch
import triton
import triton.language as tl
import triton.testing

from primus_turbo.triton import cdiv, next_pow2, is_interpreter
from primus_turbo.triton.interpreter import bf16_dot_fixed

from .gemm_kernel import (
    GemmConfig,
    _COMPILE_ERRORS,
    _autotune_enabled,
    _ensure_allocator,
    _epilogue,
    _grid_programs,
    _storage,
    _tile_coords,
    _tma_ok,
)

__all__ = [
    "FP8_GEMM_MODES",
    "FP8_DTYPES",
    "GemmConfig",
    "check_gemm_fp8_triton",
    "gemm_fp8_triton",
    "gemm_fp8_triton_prechecked",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Scale modes, the kernels' SCALE_MODE constexpr.
_TENSORWISE, _ROWWISE, _BLOCKWISE, _MX = 0, 1, 2, 3
FP8_GEMM_MODES = {"TENSORWISE": _TENSORWISE, "ROWWISE": _ROWWISE, "BLOCKWISE": _BLOCKWISE, "MX_BLOCKWISE": _MX}
_MODE_NAMES = {v: k for k, v in FP8_GEMM_MODES.items()}
MX_BLOCK = 32


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _e8m0_to_fp32(e):
    """E8M0 bytes (as int32, 0..255) -> 2**(e - 127) in fp32, exactly, from the bit pattern."""
    bits = tl.where(e == 0, 0x00400000, e << 23)  # e = 0: the fp32 subnormal 2**-127
    bits = tl.where(e == 255, 0x7FC00000, bits)  # the E8M0 NaN
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mx_widen(q, scale, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """q [ROWS, BLOCK_K] FP8, scale [ROWS, BLOCK_K // 32] powers of two -> bf16(q * scale), exact."""
    x = tl.reshape(q.to(tl.float32), (ROWS, BLOCK_K // 32, 32)) * scale[:, :, None]
    return tl.reshape(x, (ROWS, BLOCK_K)).to(tl.bfloat16)


@triton.jit
def _scaled_mma(
    acc, a, b, ki, off_n, offs_m, offs_n, M, N, K,
    sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbn, stride_sbk,
    SCALE_MODE: tl.constexpr, SCALE_BLOCK: tl.constexpr, A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One K step: acc (+)= a [BM, BK] x b [BN, BK]^T with the mode's in-loop scales."""
    if SCALE_MODE == 2:  # BLOCKWISE: fresh partial per K block, promoted with its scales
        partial = tl.dot(a, b.T)
        kb = (ki * BLOCK_K) // SCALE_BLOCK
        sa = tl.load(sa_ptr + (offs_m // A_SCALE_ROWS).to(tl.int64) * stride_sam + kb * stride_sak,
                     mask=offs_m < M, other=0.0)
        if B_SCALE_ROWS % BLOCK_N == 0:  # the tile's columns share one B scale block
            sb = tl.load(sb_ptr + (off_n // B_SCALE_ROWS).to(tl.int64) * stride_sbn + kb * stride_sbk)
            acc += partial * (sa * sb)[:, None]
        else:
            sb = tl.load(sb_ptr + (offs_n // B_SCALE_ROWS).to(tl.int64) * stride_sbn + kb * stride_sbk,
                         mask=offs_n < N, other=0.0)
            acc += partial * sa[:, None] * sb[None, :]
    elif SCALE_MODE == 3:  # MX: exact power-of-two scales folded into the bf16 widening
        G: tl.constexpr = BLOCK_K // 32
        kg = ki * G + tl.arange(0, G)
        kg_ok = kg < K // 32
        # masked groups (K tail, rows past M/N) read exponent 127, i.e. scale 1, on zero-filled data
        ea = tl.load(sa_ptr + offs_m.to(tl.int64)[:, None] * stride_sam + kg[None, :] * stride_sak,
                     mask=(offs_m < M)[:, None] & kg_ok[None, :], other=127)
        eb = tl.load(sb_ptr + offs_n.to(tl.int64)[:, None] * stride_sbn + kg[None, :] * stride_sbk,
                     mask=(offs_n < N)[:, None] & kg_ok[None, :], other=127)
        a16 = _mx_widen(a, _e8m0_to_fp32(ea.to(tl.int32)), BLOCK_M, BLOCK_K)
        b16 = _mx_widen(b, _e8m0_to_fp32(eb.to(tl.int32)), BLOCK_N, BLOCK_K)
        acc = tl.dot(a16, b16.T, acc)
    else:  # TENSORWISE / ROWWISE: scales wait for the epilogue
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _scale_output(
    acc, off_m, off_n, M, N, sa_ptr, sb_ptr, stride_sam, stride_sbn,
    SCALE_MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Epilogue scaling of TENSORWISE (acc * sa * sb) and ROWWISE (outer product) tiles."""
    if SCALE_MODE == 0:
        acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    elif SCALE_MODE == 1:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        sa = tl.load(sa_ptr + offs_m.to(tl.int64) * stride_sam, mask=offs_m < M, other=0.0)
        sb = tl.load(sb_ptr + offs_n.to(tl.int64) * stride_sbn, mask=offs_n < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def _gemm_fp8_tma_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr,
    M, N, K,
    ld_a, ld_b, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    NUM_SMS: tl.constexpr,
    SCALE_MODE: tl.constexpr, SCALE_BLOCK: tl.constexpr, A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    C_TMA: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """C[M, N] (+)= scaled A[M, K] @ scaled B[N, K]^T; A and B K-major through TMA descriptors."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [ld_a, 1], [BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [ld_b, 1], [BLOCK_N, BLOCK_K])
    C_BLOCK_N: tl.constexpr = BLOCK_N // 2 if EPILOGUE_SUBTILE else BLOCK_N
    if C_TMA:
        c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, C_BLOCK_N])
    else:
        c_desc = c_ptr  # placeholder: pointer stores

    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)

    tile_id_c = start_pid - NUM_SMS  # the epilogue's own tile counter (see gemm_kernel.py)
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            # edge tiles (M, N, K tails) arrive zero-filled from TMA
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            acc = _scaled_mma(acc, a, b, ki, off_n, offs_m, offs_n, M, N, K,
                              sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbn, stride_sbk,
                              SCALE_MODE, SCALE_BLOCK, A_SCALE_ROWS, B_SCALE_ROWS, BLOCK_M, BLOCK_N, BLOCK_K)

        tile_id_c += NUM_SMS
        pid_m_c, pid_n_c = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_m_c = pid_m_c * BLOCK_M
        off_n_c = pid_n_c * BLOCK_N
        acc = _scale_output(acc, off_m_c, off_n_c, M, N, sa_ptr, sb_ptr, stride_sam, stride_sbn,
                            SCALE_MODE, BLOCK_M, BLOCK_N)
        _epilogue(c_desc, c_ptr, acc, off_m_c, off_n_c, M, N, stride_cm, stride_cn,
                  C_TMA, ACCUMULATE, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


@triton.jit
def _gemm_fp8_ptr_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    NUM_SMS: tl.constexpr,
    SCALE_MODE: tl.constexpr, SCALE_BLOCK: tl.constexpr, A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """The TMA kernel's twin for operands TMA cannot describe: masked loads with any strides."""
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)

    tile_id_c = start_pid - NUM_SMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
        b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k = ki * BLOCK_K + offs_k
            k64 = k.to(tl.int64)
            mask_k = k < K
            a = tl.load(a_rows + k64[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_rows + k64[None, :] * stride_bk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc = _scaled_mma(acc, a, b, ki, off_n, offs_m, offs_n, M, N, K,
                              sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbn, stride_sbk,
                              SCALE_MODE, SCALE_BLOCK, A_SCALE_ROWS, B_SCALE_ROWS, BLOCK_M, BLOCK_N, BLOCK_K)

        tile_id_c += NUM_SMS
        pid_m_c, pid_n_c = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_m_c = pid_m_c * BLOCK_M
        off_n_c = pid_n_c * BLOCK_N
        acc = _scale_output(acc, off_m_c, off_n_c, M, N, sa_ptr, sb_ptr, stride_sam, stride_sbn,
                            SCALE_MODE, BLOCK_M, BLOCK_N)
        _epilogue(c_ptr, c_ptr, acc, off_m_c, off_n_c, M, N, stride_cm, stride_cn,
                  False, ACCUMULATE, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------
# Interpreter: small tiles, 3 persistent programs (so multi-tile shapes take several turns).
# BLOCKWISE keeps the real BLOCK_K = 128 (one promotion per scale block); MX takes 64 so a tile
# holds two 32-wide scale groups and the reshape path is exercised.
_INTERPRETER_CONFIGS = {
    _TENSORWISE: GemmConfig(32, 32, 32, group_m=2, num_stages=1, num_warps=4, epilogue_subtile=True),
    _ROWWISE: GemmConfig(32, 32, 32, group_m=2, num_stages=1, num_warps=4, epilogue_subtile=True),
    _BLOCKWISE: GemmConfig(32, 32, 128, group_m=2, num_stages=1, num_warps=4, epilogue_subtile=False),
    _MX: GemmConfig(32, 32, 64, group_m=2, num_stages=1, num_warps=4, epilogue_subtile=True),
}

# sm_90 candidates (227 KiB smem per block). FP8 tiles are 1 byte per element, so a 128x256x128
# stage is 48 KiB: 3 stages + a subtiled 16-bit C staging buffer fit, 4 stages only without
# accumulate. BLOCKWISE keeps BLOCK_K = 128 (one promotion per scale block) and prefers BLOCK_N =
# 128 (one weight scale per tile per K step, as DeepGEMM). MX widens tiles to bf16 in registers,
# so it takes shorter K steps and bf16-sized tiles.
_CANDIDATES = {
    _TENSORWISE: (
        GemmConfig(128, 256, 128, 8, 3, 8, True),
        GemmConfig(128, 256, 128, 8, 3, 8, True, flatten=False),
        GemmConfig(128, 256, 128, 8, 4, 8, True),
        GemmConfig(256, 128, 128, 8, 3, 8, True),
        GemmConfig(128, 128, 128, 8, 4, 8, True),
        GemmConfig(128, 256, 64, 8, 4, 8, True),
        GemmConfig(64, 256, 128, 8, 3, 4, True),
        GemmConfig(64, 128, 128, 8, 4, 4, True),
    ),
    _BLOCKWISE: (  # (128x256 and 256x128 spill here: two accumulators plus the promotion)
        GemmConfig(128, 128, 128, 8, 4, 8, True),
        GemmConfig(128, 128, 128, 8, 3, 8, True),
        GemmConfig(128, 128, 128, 8, 4, 8, True, flatten=False),
        GemmConfig(64, 128, 128, 8, 4, 4, True),
    ),
    _MX: (
        GemmConfig(128, 128, 64, 8, 4, 8, True),
        GemmConfig(128, 128, 128, 8, 3, 8, True),
        GemmConfig(128, 256, 64, 8, 3, 8, True),
        GemmConfig(64, 128, 64, 8, 4, 4, True),
        GemmConfig(128, 64, 64, 8, 4, 4, False),
    ),
}
_CANDIDATES[_ROWWISE] = _CANDIDATES[_TENSORWISE]
# The pointer twin (unaligned operands: byte-wise masked loads, no vector loads) needs smaller
# tiles and no flattening to stay spill-free with an fp32 accumulate epilogue (checked with ptxas).
_PTR_CANDIDATES = {
    _TENSORWISE: (GemmConfig(128, 128, 32, 8, 3, 8, False, use_tma=False, flatten=False),
                  GemmConfig(64, 128, 32, 8, 3, 8, False, use_tma=False, flatten=False),
                  GemmConfig(64, 64, 64, 8, 3, 4, False, use_tma=False, flatten=False)),
    _BLOCKWISE: (GemmConfig(64, 128, 32, 8, 3, 8, False, use_tma=False, flatten=False),
                 GemmConfig(64, 64, 64, 8, 3, 4, False, use_tma=False, flatten=False)),
}
_PTR_CANDIDATES[_ROWWISE] = _PTR_CANDIDATES[_TENSORWISE]
_PTR_CANDIDATES[_MX] = _PTR_CANDIDATES[_BLOCKWISE]
_SAFE_CONFIG = GemmConfig(64, 64, 64, 8, 2, 4, False, use_tma=False, flatten=False)


def _fit_block_k(config: GemmConfig, mode: int, block_size: int) -> GemmConfig:
    """BLOCKWISE needs BLOCK_K to divide the scale block; MX needs a multiple of 32."""
    bk = config.block_k
    if mode == _BLOCKWISE:
        bk = min(bk, block_size)
        while block_size % bk:
            bk //= 2
    elif mode == _MX:
        bk = max(MX_BLOCK, bk)
    return config if bk == config.block_k else dataclasses.replace(config, block_k=bk)


def _default_config(M: int, N: int, K: int, mode: int, accumulate: bool, num_sms: int, tma: bool,
                    block_size: int = 128, b_row_scales: bool = False) -> GemmConfig:
    """Analytic sm_90 config per mode, shrunk for small M/N or when the tiles can't fill the SMs.

    ``b_row_scales``: BLOCKWISE with one B scale per row (1 x bs groups, the wgrad GEMM), where the
    promotion multiplies by a vector of scales; flattening the loops then spills.
    """
    if is_interpreter():
        return _fit_block_k(_INTERPRETER_CONFIGS[mode], mode, block_size)
    if not tma:
        return _fit_block_k(_PTR_CANDIDATES[mode][0], mode, block_size)
    if mode == _BLOCKWISE:
        if M <= 64:
            cfg = GemmConfig(64, 128, 128, 8, 4, 4, True)
        else:
            cfg = GemmConfig(128, 128, 128, 8, 4, 8, True, flatten=not (accumulate or b_row_scales))
        return _fit_block_k(cfg, mode, block_size)
    if mode == _MX:
        if M <= 64:
            return GemmConfig(64, 128, 64, 8, 4, 4, True)
        return GemmConfig(128, 128, 64, 8, 4, 8, True)
    # TENSORWISE / ROWWISE
    if M <= 64:
        return GemmConfig(64, 256, 128, 8, 3, 4, True) if N > 128 else GemmConfig(64, 128, 128, 8, 4, 4, True)
    if N <= 64:
        return GemmConfig(128, 64, 128, 8, 4, 4, False)
    if N <= 128 or cdiv(M, 128) * cdiv(N, 256) < num_sms:
        return GemmConfig(128, 128, 128, 8, 4, 8, True)
    # flattened, an accumulating 128x256 epilogue needs its own C buffer: 273 KiB of smem
    return GemmConfig(128, 256, 128, 8, 3, 8, True, flatten=not accumulate)


def _candidate_configs(M: int, N: int, mode: int, default: GemmConfig, block_size: int) -> list[GemmConfig]:
    pool = [_fit_block_k(c, mode, block_size) for c in (_CANDIDATES if default.use_tma else _PTR_CANDIDATES)[mode]]
    fits = [c for c in pool if c.block_m <= max(64, next_pow2(M))
            and c.block_n <= max(64, next_pow2(N))]
    return [default] + [c for c in dict.fromkeys(fits) if c != default]


# ----------------------------------------------------------------------------------------------
# Scales
# ----------------------------------------------------------------------------------------------
def _mode_of(mode: Union[str, int, object]) -> int:
    """ScalingGranularity member, its name, or the kernel int -> kernel int."""
    if isinstance(mode, int) and not isinstance(mode, bool) and mode in _MODE_NAMES:
        return mode
    name = getattr(mode, "name", mode)
    if isinstance(name, str) and name.upper() in FP8_GEMM_MODES:
        return FP8_GEMM_MODES[name.upper()]
    raise ValueError(f"mode={mode!r} is not one of {', '.join(FP8_GEMM_MODES)}")


@dataclasses.dataclass(frozen=True)
class _Scales:
    """Per-operand scale geometry passed to the kernel."""

    stride_row: int  # stride between scale rows (or entries, for ROWWISE vectors)
    stride_k: int  # stride between K blocks (BLOCKWISE / MX)
    rows: int  # operand rows per scale row: 1, or block_size for a 2-D block (BLOCKWISE)


def _vector_stride(s: torch.Tensor, length: int) -> Optional[int]:
    """Stride between the entries of a [L], [L, 1] or [1, L] scale vector, None if not one."""
    shape = tuple(s.shape)
    if shape == (length,):
        return s.stride(0)
    if shape == (length, 1):
        return s.stride(0)
    if shape == (1, length):
        return s.stride(1)
    return None


def _check_scale(name: str, s, rows: int, K: int, mode: int, block_size: int, device) -> _Scales:
    """Validate one operand's scales; return their geometry. Raises TypeError/ValueError."""
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
    if s.device != device:
        raise ValueError(f"{name} is on {s.device}, the operands on {device}")
    if mode == _MX:
        if s.dtype not in tuple(d for d in (_E8M0, torch.uint8) if d is not None):
            raise TypeError(f"{name}: MX_BLOCKWISE scales must be float8_e8m0fnu (or uint8 bytes), got {s.dtype}")
        want = (rows, K // MX_BLOCK)
        if tuple(s.shape) != want:
            raise ValueError(f"{name}: MX_BLOCKWISE scales must have shape [rows, K/32] = {list(want)}, "
                             f"got {list(s.shape)}")
        return _Scales(s.stride(0), s.stride(1), 1)
    if s.dtype != torch.float32:
        raise TypeError(f"{name}: {_MODE_NAMES[mode]} scales must be float32, got {s.dtype}")
    if mode == _TENSORWISE:
        if s.numel() != 1:
            raise ValueError(f"{name}: TENSORWISE scale must hold one value (0-dim), got shape {list(s.shape)}")
        return _Scales(0, 0, 1)
    if mode == _ROWWISE:
        stride = _vector_stride(s, rows)
        if stride is None:
            raise ValueError(f"{name}: ROWWISE scales must have shape [{rows}, 1] (one per row), got {list(s.shape)}")
        return _Scales(stride, 0, 1)
    # BLOCKWISE: 1 x bs blocks along K ([rows, ceil(K/bs)]) or bs x bs blocks ([ceil(rows/bs), ceil(K/bs)])
    kb = cdiv(K, block_size)
    per_row, per_block = (rows, kb), (cdiv(rows, block_size), kb)
    if s.dim() != 2 or tuple(s.shape) not in (per_row, per_block):
        raise ValueError(
            f"{name}: BLOCKWISE scales must have shape {list(per_row)} (1x{block_size} blocks) or "
            f"{list(per_block)} ({block_size}x{block_size} blocks), got {list(s.shape)}")
    return _Scales(s.stride(0), s.stride(1), 1 if tuple(s.shape) == per_row else block_size)


def _device_ok(device: torch.device) -> Optional[str]:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return f"sm_{cap[0]}{cap[1]} has no FP8 tensor cores (needs sm_89 or newer)"
        return None
    if device.type == "cpu" and is_interpreter():
        return None
    return f"tensors on {device}; needs CUDA (or CPU with TRITON_INTERPRET=1)"


def _validate(a, sa, b, sb, mode, out, out_dtype, accumulate, block_size) -> tuple[int, _Scales, _Scales]:
    """Raise TypeError/ValueError naming the offending values; return (mode, a scales, b scales)."""
    mode = _mode_of(mode)
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got {t.dim()}-D with shape {tuple(t.shape)}")
        if t.dtype not in FP8_DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not float8_e4m3fn or float8_e5m2")
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K:
        raise ValueError(f"K mismatch: a is [M, K] = {list(a.shape)}, b is [N, K] = {list(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"device mismatch: a on {a.device}, b on {b.device}")
    reason = _device_ok(a.device)
    if reason:
        raise ValueError(reason)
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}")
    if mode == _MX:
        if K % MX_BLOCK:
            raise ValueError(f"MX_BLOCKWISE needs K to be a multiple of 32, got K={K}")
        if a.device.type == "cpu" and not bf16_dot_fixed():
            raise ValueError("MX_BLOCKWISE runs a bf16 dot, which the Triton interpreter gets wrong (triton issue "
                             "#11584); call primus_turbo.triton.interpreter.fix_bf16_dot() first")
    sa_geo = _check_scale("a_scale", sa, M, K, mode, block_size, a.device)
    sb_geo = _check_scale("b_scale", sb, N, K, mode, block_size, a.device)
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not one of bfloat16, float16, float32")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an out tensor to accumulate into")
        return mode, sa_geo, sb_geo
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 2 or tuple(out.shape) != (M, N):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(M, N)}")
    if out.device != a.device:
        raise ValueError(f"out on {out.device}, inputs on {a.device}")
    if out.dtype not in _OUT_DTYPES:
        raise TypeError(f"out.dtype={out.dtype} is not one of bfloat16, float16, float32")
    if out_dtype is not None and out_dtype != out.dtype:
        raise ValueError(f"out_dtype={out_dtype} conflicts with out.dtype={out.dtype}")
    if any(s == 0 and n > 1 for s, n in zip(out.stride(), out.shape)):
        raise ValueError(f"out has a zero stride {tuple(out.stride())} (broadcast view)")
    return mode, sa_geo, sb_geo


def check_gemm_fp8_triton(a, sa, b, sb, mode, out=None, out_dtype=None, accumulate=False,
                          block_size: int = 128) -> Optional[str]:
    """None when :func:`gemm_fp8_triton` can run these inputs, else a short reason. Never raises."""
    try:
        _validate(a, sa, b, sb, mode, out, out_dtype, accumulate, block_size)
    except Exception as exc:  # noqa: BLE001 - the contract is "never raises"
        return str(exc)
    return None


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------
def _k_major_tma(t: torch.Tensor) -> bool:
    """TMA can read t [rows, K] as K-major tiles: unit K stride, 16-byte aligned base and rows."""
    col, ld = _storage(t)
    return col is False and t.stride(1) == 1 and _tma_ok(t, col, ld)


def _layout_info(a, b, out) -> tuple[bool, bool]:
    """(A and B readable through TMA, C writable through TMA)."""
    c_col, ld_c = _storage(out)
    return _k_major_tma(a) and _k_major_tma(b), c_col is False and _tma_ok(out, c_col, ld_c)


def _launch(a, sa, b, sb, mode: int, sa_geo: _Scales, sb_geo: _Scales, out, accumulate: bool,
            config: GemmConfig, block_size: int = 128, layout: Optional[tuple] = None) -> torch.Tensor:
    """Run one kernel with an explicit config on validated, non-empty inputs; returns ``out``."""
    M, K = a.shape
    N = b.shape[0]
    tma_ab, c_tma = layout if layout is not None else _layout_info(a, b, out)
    config = _fit_block_k(config, mode, block_size)
    if mode == _MX:  # E8M0 bytes are read as uint8 and decoded in the kernel
        sa, sb = sa.view(torch.uint8), sb.view(torch.uint8)
    num_sms = _grid_programs(a.device)
    grid = (min(num_sms, cdiv(M, config.block_m) * cdiv(N, config.block_n)),)
    common = dict(
        NUM_SMS=num_sms, SCALE_MODE=mode, SCALE_BLOCK=block_size,
        A_SCALE_ROWS=sa_geo.rows, B_SCALE_ROWS=sb_geo.rows, ACCUMULATE=accumulate,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        EPILOGUE_SUBTILE=config.epilogue_subtile, FLATTEN=config.flatten,
        num_stages=config.num_stages, num_warps=config.num_warps,
    )
    scale_strides = (sa_geo.stride_row, sa_geo.stride_k, sb_geo.stride_row, sb_geo.stride_k)
    if config.use_tma and tma_ab:
        if a.is_cuda:
            _ensure_allocator()
        _gemm_fp8_tma_kernel[grid](
            a, b, out, sa, sb, M, N, K, a.stride(0), b.stride(0), out.stride(0), out.stride(1), *scale_strides,
            C_TMA=c_tma, WARP_SPECIALIZE=config.warp_specialize, **common,
        )
    else:
        _gemm_fp8_ptr_kernel[grid](
            a, b, out, sa, sb, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            out.stride(0), out.stride(1), *scale_strides, **common,
        )
    return out


_tuned: dict[tuple, GemmConfig] = {}
_logged: set[tuple] = set()


def _logger() -> logging.Logger:
    try:
        from primus_turbo.pytorch.core.logging import get_logger

        return get_logger()
    except Exception:  # noqa: BLE001
        return logging.getLogger("primus_turbo")


def _log_config(key: tuple, config: GemmConfig, how: str) -> None:
    wanted = os.environ.get("PRIMUS_TURBO_PRINT_CONFIGS", "0").strip().lower() in ("1", "true", "yes", "on")
    if key in _logged or not wanted:
        return
    _logged.add(key)
    _logger().warning("gemm_fp8_triton %s config for %s: %s", how, key, config.short())


def _pick_config(a, sa, b, sb, mode, sa_geo, sb_geo, out, accumulate, block_size, layout) -> GemmConfig:
    M, K = a.shape
    N = b.shape[0]
    tma_ab, c_tma = layout
    # Everything that changes the winner: sizes, operand and output dtypes, mode and scale
    # geometry, TMA eligibility of operands and C, accumulate, device.
    key = (M, N, K, a.dtype, b.dtype, out.dtype, mode, block_size, sa_geo.rows, sb_geo.rows, tma_ab, c_tma,
           accumulate, a.device.index)
    if key in _tuned:
        return _tuned[key]
    default = _default_config(M, N, K, mode, accumulate, _grid_programs(a.device), tma_ab, block_size,
                              mode == _BLOCKWISE and sb_geo.rows == 1)
    if is_interpreter() or not a.is_cuda or not _autotune_enabled() or torch.cuda.is_current_stream_capturing():
        _log_config(key, default, "default")
        return default
    best, best_ms = _tune(a, sa, b, sb, mode, sa_geo, sb_geo, out, accumulate, block_size, layout,
                          _candidate_configs(M, N, mode, default, block_size))
    _tuned[key] = best
    _log_config(key, best, f"autotuned ({best_ms:.3f} ms)")
    return best


def _tune(a, sa, b, sb, mode, sa_geo, sb_geo, out, accumulate, block_size, layout, candidates):
    """Median time of each candidate; the fastest (the first if none runs). Never writes the
    caller's accumulation buffer: accumulate variants run on a zeroed scratch of the same layout."""
    target = out
    if accumulate:
        target = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device).zero_()
    best, best_ms = candidates[0], float("inf")
    for cfg in candidates:
        try:
            ms = triton.testing.do_bench(
                lambda: _launch(a, sa, b, sb, mode, sa_geo, sb_geo, target, accumulate, cfg, block_size, layout),
                warmup=10, rep=40, return_mode="median")
        except Exception:  # noqa: BLE001 - e.g. out of shared memory for this output dtype
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms


def _run(a, sa, b, sb, mode, sa_geo, sb_geo, out, accumulate, block_size):
    layout = _layout_info(a, b, out)
    config = _pick_config(a, sa, b, sb, mode, sa_geo, sb_geo, out, accumulate, block_size, layout)
    try:
        return _launch(a, sa, b, sb, mode, sa_geo, sb_geo, out, accumulate, config, block_size, layout)
    except Exception as exc:  # noqa: BLE001 - compile failures leave out untouched
        compile_failure = isinstance(exc, _COMPILE_ERRORS) or "PassManager" in str(exc)
        if not compile_failure or config == _SAFE_CONFIG or is_interpreter():
            raise
        _logger().warning("gemm_fp8_triton: config %s failed to compile (%s); using %s", config.short(),
                          type(exc).__name__, _SAFE_CONFIG.short())
        return _launch(a, sa, b, sb, mode, sa_geo, sb_geo, out, accumulate, _SAFE_CONFIG, block_size, layout)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def gemm_fp8_triton(
    a_q: torch.Tensor, sa: torch.Tensor, b_q: torch.Tensor, sb: torch.Tensor, mode,
    out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = torch.bfloat16,
    accumulate: bool = False, block_size: int = 128,
) -> torch.Tensor:
    """``C = (a_q * sa) @ (b_q * sb).T`` (or ``out += C``) with fp32 accumulation.

    Args:
        a_q: ``[M, K]`` FP8 (e4m3fn or e5m2), any strides (K-contiguous and 16-byte aligned takes TMA).
        sa: A's dequantization scales for ``mode`` (docs/low_precision.md): TENSORWISE ``[]``;
            ROWWISE ``[M, 1]``; BLOCKWISE ``[M, ceil(K/bs)]`` or ``[ceil(M/bs), ceil(K/bs)]``;
            MX_BLOCKWISE ``[M, K/32]`` E8M0.
        b_q: ``[N, K]`` FP8 (may differ from ``a_q``'s FP8 dtype); ``sb`` likewise with N rows.
        mode: a ``ScalingGranularity`` (or its name).
        out: written (or added into, with ``accumulate``) when given, else allocated.
        out_dtype: bf16, fp16 or fp32; ignored when ``out`` is given.
        accumulate: ``out += C`` in the epilogue, summed in fp32 (out fp32, bf16 or fp16).
        block_size: BLOCKWISE scale block (power of two; 128 is the DeepSeek-V3 recipe).
    """
    if out is not None:
        out_dtype = None  # out's dtype rules
    mode, sa_geo, sb_geo = _validate(a_q, sa, b_q, sb, mode, out, out_dtype, accumulate, block_size)
    return _prechecked(a_q, sa, b_q, sb, mode, sa_geo, sb_geo, out, out_dtype, accumulate, block_size)


def gemm_fp8_triton_prechecked(a_q, sa, b_q, sb, mode, out=None, out_dtype=torch.bfloat16, accumulate=False,
                               block_size: int = 128) -> torch.Tensor:
    """:func:`gemm_fp8_triton` for callers that just ran :func:`check_gemm_fp8_triton` on the same
    arguments (the scale geometry is recomputed, cheaply; nothing raises for valid input)."""
    M, K = a_q.shape
    mode = _mode_of(mode)
    sa_geo = _check_scale("a_scale", sa, M, K, mode, block_size, a_q.device)
    sb_geo = _check_scale("b_scale", sb, b_q.shape[0], K, mode, block_size, a_q.device)
    return _prechecked(a_q, sa, b_q, sb, mode, sa_geo, sb_geo, out, out_dtype, accumulate, block_size)


def _prechecked(a, sa, b, sb, mode, sa_geo, sb_geo, out, out_dtype, accumulate, block_size):
    M, K = a.shape
    N = b.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype or torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out if accumulate else out.zero_()
    if a.is_cuda and a.device.index != torch.cuda.current_device():
        with torch.cuda.device(a.device):
            return _run(a, sa, b, sb, mode, sa_geo, sb_geo, out, accumulate, block_size)
    return _run(a, sa, b, sb, mode, sa_geo, sb_geo, out, accumulate, block_size)
