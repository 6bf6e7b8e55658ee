"""Dense GEMM for Hopper: persistent Triton kernels, C = A @ B with fp32 accumulation.

Two kernels share one structure (a persistent grid of min(#SMs, #tiles) programs, each walking the
output tiles in GROUP_M-swizzled order so neighbouring programs reuse A/B tiles from L2):

* ``_gemm_persistent_tma_kernel`` reads A and B through device-side tensor descriptors (TMA). It
  handles row- and column-major operands by building the descriptor over the operand's storage and
  transposing the loaded tile in registers; C goes through a descriptor when it is row-major and
  aligned, else through masked pointer stores.
* ``_gemm_persistent_ptr_kernel`` is the fallback for layouts TMA cannot describe (unaligned base
  pointers, leading strides that are not 16-byte multiples, no unit stride): masked ``tl.load`` with
  arbitrary strides.

``gemm_triton`` picks the kernel and a config (analytic default, or a small on-line autotune that
never touches the caller's buffers); ``_launch`` runs one explicit :class:`GemmConfig` (used by
``scripts/tune_gemm_triton.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional

import torch
import triton
import triton.language as tl
import triton.testing

from primus_turbo.triton import cdiv, next_pow2, is_interpreter
from primus_turbo.triton.interpreter import bf16_dot_fixed

__all__ = ["GemmConfig", "check_gemm_triton", "gemm_triton", "gemm_triton_prechecked"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """tile_id -> (pid_m, pid_n): down a band of GROUP_M tile rows, then one column right, so the
    programs running together share a few B columns and one band of A rows in L2."""
    tiles_per_band = GROUP_M * num_pid_n
    band_first_m = (tile_id // tiles_per_band) * GROUP_M
    band_rows = min(num_pid_m - band_first_m, GROUP_M)  # the last band may be shorter
    in_band = tile_id % tiles_per_band
    return band_first_m + in_band % band_rows, in_band // band_rows


@triton.jit
def _split_n(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc[BM, BN] -> (acc[:, :BN/2], acc[:, BN/2:]) without a shared-memory round trip."""
    halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    return tl.split(halves)


@triton.jit
def _store_c(
    c_desc, c_ptr, acc,
    off_m, off_n, M, N, stride_cm, stride_cn,
    C_TMA: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """C[off_m:+BM, off_n:+BN] = acc (or += acc when ACCUMULATE), summed in fp32, cast to C's dtype."""
    if C_TMA:
        # The descriptor clips rows/columns past M/N, and pads the accumulate read with zeros.
        if ACCUMULATE:
            acc += c_desc.load([off_m, off_n]).to(tl.float32)
        c_desc.store([off_m, off_n], acc.to(c_ptr.dtype.element_ty))
    else:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        # int64: M*N outputs can pass 2**31 (e.g. 16384 x 128256).
        ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(
    c_desc, c_ptr, acc,
    off_m, off_n, M, N, stride_cm, stride_cn,
    C_TMA: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
):
    """Write one accumulator tile, optionally as two [BM, BN/2] halves (halves the C staging smem)."""
    if EPILOGUE_SUBTILE:
        acc_lo, acc_hi = _split_n(acc, BLOCK_M, BLOCK_N)
        _store_c(c_desc, c_ptr, acc_lo, off_m, off_n, M, N, stride_cm, stride_cn,
                 C_TMA, ACCUMULATE, BLOCK_M, BLOCK_N // 2)
        _store_c(c_desc, c_ptr, acc_hi, off_m, off_n + BLOCK_N // 2, M, N, stride_cm, stride_cn,
                 C_TMA, ACCUMULATE, BLOCK_M, BLOCK_N // 2)
    else:
        _store_c(c_desc, c_ptr, acc, off_m, off_n, M, N, stride_cm, stride_cn,
                 C_TMA, ACCUMULATE, BLOCK_M, BLOCK_N)


@triton.jit
def _gemm_persistent_tma_kernel(
    # pointers
    a_ptr, b_ptr, c_ptr,
    # sizes
    M, N, K,
    # strides: leading dimension of each operand's storage (its unit-stride dim is implied), C's two
    ld_a, ld_b, stride_cm, stride_cn,
    # meta-parameters
    NUM_SMS: tl.constexpr,
    A_COL: tl.constexpr,  # A stored column-major: storage is [K, M]
    B_COL: tl.constexpr,  # B stored column-major: storage is [N, K]
    C_TMA: tl.constexpr,  # C row-major and aligned: store through a descriptor
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """C[M, N] (+)= A[M, K] @ B[K, N], fp32 accumulation; A, B (and C) through TMA descriptors."""
    # Descriptors are built over the storage, so a column-major operand is loaded as its transpose's
    # tile and flipped in registers (.T), which wgmma consumes as an MN-major operand at no cost.
    # The last stride is the literal 1: a descriptor needs it to be a compile-time 1.
    if A_COL:
        a_desc = tl.make_tensor_descriptor(a_ptr, [K, M], [ld_a, 1], [BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [ld_a, 1], [BLOCK_M, BLOCK_K])
    if B_COL:
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [ld_b, 1], [BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [ld_b, 1], [BLOCK_K, BLOCK_N])
    C_BLOCK_N: tl.constexpr = BLOCK_N // 2 if EPILOGUE_SUBTILE else BLOCK_N
    if C_TMA:
        c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, C_BLOCK_N])
    else:
        c_desc = c_ptr  # placeholder, unused: _store_c takes the pointer path

    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)

    # The epilogue tracks its own tile id instead of reusing the loop's: with FLATTEN the compiler
    # merges tile and K loops into one software pipeline, and the next tile's loads may be issued
    # before this tile's stores; an independent counter keeps the epilogue off that critical path.
    tile_id_c = start_pid - NUM_SMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            # Out-of-bounds parts of edge tiles (M, N, K tails) arrive zero-filled from TMA.
            if A_COL:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_COL:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

        tile_id_c += NUM_SMS
        pid_m_c, pid_n_c = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        _epilogue(c_desc, c_ptr, acc, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N, M, N, stride_cm, stride_cn,
                  C_TMA, ACCUMULATE, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


@triton.jit
def _gemm_persistent_ptr_kernel(
    # pointers
    a_ptr, b_ptr, c_ptr,
    # sizes
    M, N, K,
    # strides (elements, any value)
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    # meta-parameters
    NUM_SMS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """C[M, N] (+)= A[M, K] @ B[K, N], fp32 accumulation; masked pointer loads with arbitrary strides."""
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)

    tile_id_c = start_pid - NUM_SMS  # see the TMA kernel: the epilogue keeps its own tile counter
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        # int64 row/column offsets: offs * stride can pass 2**31 for large operands.
        a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
        b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            # Offsets recomputed from ki (not a running pointer increment) so that BLOCK_K * stride
            # never has to fit in 32 bits.
            k = ki * BLOCK_K + offs_k
            k64 = k.to(tl.int64)
            mask_k = k < K
            a = tl.load(a_rows + k64[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_cols + k64[:, None] * stride_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

        tile_id_c += NUM_SMS
        pid_m_c, pid_n_c = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        _epilogue(c_ptr, c_ptr, acc, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N, M, N, stride_cm, stride_cn,
                  False, ACCUMULATE, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the GEMM kernels."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    epilogue_subtile: bool = True
    use_tma: bool = True  # False forces the pointer kernel even when TMA could be used
    flatten: bool = True  # flatten the tile loop and the K loop into one software pipeline
    warp_specialize: bool = False  # compiler-driven producer/consumer warps (TMA kernel only)

    def short(self) -> str:
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} s{self.num_stages} w{self.num_warps}"
            f"{' sub' if self.epilogue_subtile else ''}{' tma' if self.use_tma else ' ptr'}"
            f"{' flat' if self.flatten else ''}{' ws' if self.warp_specialize else ''}"
        )


# One small config under the CPU interpreter: fast, and the subtile/persistent paths still run.
_INTERPRETER_CONFIG = GemmConfig(32, 32, 32, group_m=2, num_stages=1, num_warps=4, epilogue_subtile=True)
_INTERPRETER_NUM_SMS = 3  # fewer programs than tiles, so the persistent loop takes several turns

# Config notes, from compiling for sm_90 (227 KiB shared memory per block; smem sizes as triton
# 3.6 reports them, 16-bit inputs):
# * 128x256x64, 3 stages, subtiled epilogue: 176 KiB with a 16-bit C, 208 KiB with fp32 C, ~160
#   registers, no spills. 4 stages only fit a 16-bit C without accumulate (224 KiB).
# * FLATTEN keeps the C tile that an accumulating epilogue reads in its own buffer (it overlaps the
#   next tile's loads): 128x256 accumulate into fp32 needs 273 KiB flattened but 208 KiB without.
# * fp32 with exact products ("ieee") runs tl.dot as FMAs; fed from TMA tiles that are transposed
#   in registers it spills kilobytes, so fp32 takes the pointer kernel, which does not.
# * The pointer kernel on unaligned operands cannot use cp.async vectors and spills at 128x256 and
#   at 64x128x64 with 4 warps; 128x128x32 and 64x128x32 with 8 warps do not.
_CANDIDATES_16BIT = (
    GemmConfig(128, 256, 64, 8, 3, 8, True),
    GemmConfig(128, 256, 64, 8, 3, 8, True, flatten=False),
    GemmConfig(128, 256, 64, 8, 4, 8, True),
    GemmConfig(256, 128, 64, 8, 3, 8, True),
    GemmConfig(128, 128, 64, 8, 4, 8, True),
    GemmConfig(128, 128, 128, 8, 3, 8, True),
    GemmConfig(64, 256, 64, 8, 3, 4, True),
    GemmConfig(64, 128, 64, 8, 4, 4, True),
)
_CANDIDATES_FP32 = (
    GemmConfig(128, 128, 32, 8, 3, 8, False, use_tma=False),
    GemmConfig(64, 128, 32, 8, 4, 4, False, use_tma=False),
    GemmConfig(128, 64, 32, 8, 4, 4, False, use_tma=False),
    GemmConfig(64, 64, 32, 8, 4, 4, False, use_tma=False),
)
_PTR_FALLBACK_16BIT = GemmConfig(128, 128, 32, 8, 4, 8, True, use_tma=False)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_NUM_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _default_config(
    M: int, N: int, K: int, dtype: torch.dtype, accumulate: bool, num_sms: int, tma: bool = True, tf32: bool = False,
) -> GemmConfig:
    """Analytic sm_90 config: big wgmma tiles, shrunk for small M/N or when tiles can't fill the SMs.

    ``tma``: both operands can be described by TMA descriptors (else the pointer kernel runs).
    """
    if is_interpreter():
        return _INTERPRETER_CONFIG
    small = M <= 64 or N <= 64
    if dtype == torch.float32:
        if tf32:  # wgmma on tf32 tiles: TMA is fine in every layout
            return GemmConfig(128, 128, 32, 8, 3, 8, False, use_tma=tma)
        return _CANDIDATES_FP32[3] if small else _CANDIDATES_FP32[0]
    if not tma:
        return GemmConfig(64, 128, 32, 8, 4, 8, False, use_tma=False) if small else _PTR_FALLBACK_16BIT
    if M <= 64:
        return GemmConfig(64, 256, 64, 8, 3, 4, True) if N > 128 else GemmConfig(64, 128, 64, 8, 4, 4, True)
    if N <= 64:
        return GemmConfig(128, 64, 64, 8, 4, 4, False)
    if N <= 128 or cdiv(M, 128) * cdiv(N, 256) < num_sms:
        # more, smaller tiles beat idle SMs
        return GemmConfig(128, 128, 64, 8, 4, 8, True)
    return GemmConfig(128, 256, 64, 8, 3, 8, True, flatten=not accumulate)


def _candidate_configs(M: int, N: int, dtype: torch.dtype, default: GemmConfig) -> list[GemmConfig]:
    """The default plus the curated candidates whose tiles are not far larger than the problem.

    Candidates that do not fit a given output dtype / accumulate mode fail to compile and are skipped.
    """
    pool = _CANDIDATES_FP32 if dtype == torch.float32 else _CANDIDATES_16BIT
    if not default.use_tma:  # the pointer kernel runs anyway: tune it, not TMA variants
        pool = [dataclasses.replace(c, use_tma=False) for c in pool]
    fits = [c for c in pool if c.block_m <= max(64, next_pow2(M))
            and c.block_n <= max(64, next_pow2(N))]
    return [default] + [c for c in dict.fromkeys(fits) if c != default]


# ----------------------------------------------------------------------------------------------
# Layout analysis and launch
# ----------------------------------------------------------------------------------------------
def _storage(t: torch.Tensor) -> tuple[Optional[bool], int]:
    """(is_col_major, leading stride) of a 2-D tensor; (None, 0) when no dim has unit stride."""
    rows, cols = t.shape
    if t.stride(1) == 1 or cols == 1:
        return False, t.stride(0)
    if t.stride(0) == 1 or rows == 1:
        return True, t.stride(1)
    return None, 0


def _tma_ok(t: torch.Tensor, col: Optional[bool], ld: int) -> bool:
    """TMA needs a unit last stride, a 16-byte aligned base and 16-byte multiple leading stride."""
    if col is None:
        return False
    inner = t.shape[0] if col else t.shape[1]
    nbytes = t.element_size()
    return t.data_ptr() % 16 == 0 and (ld * nbytes) % 16 == 0 and ld >= inner and ld > 0


def _alloc_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:  # noqa: ARG001
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side descriptors need a global scratch allocator. Triton keeps it in a ContextVar, so a
    thread that never set it (e.g. the autograd engine's backward thread) sees the default null
    allocator: check per call and only install ours where none is set."""
    try:
        from triton.runtime import _allocation

        if _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR:
            return
    except (ImportError, AttributeError):  # private API moved: set ours unconditionally
        pass
    triton.set_allocator(_alloc_scratch)


def _layout_info(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple:
    """(a_col, ld_a, b_col, ld_b, tma_ab, c_col, ld_c, c_tma), computed once per call: the config
    key and the launch both need it, and each piece reads strides and data pointers."""
    a_col, ld_a = _storage(a)
    b_col, ld_b = _storage(b)
    c_col, ld_c = _storage(out)
    tma_ab = _tma_ok(a, a_col, ld_a) and _tma_ok(b, b_col, ld_b)
    c_tma = c_col is False and _tma_ok(out, c_col, ld_c)  # column-major C: pointer stores
    return a_col, ld_a, b_col, ld_b, tma_ab, c_col, ld_c, c_tma


def _uses_tma(a: torch.Tensor, b: torch.Tensor, config: GemmConfig) -> bool:
    """Whether ``_launch`` takes the TMA kernel (both operands describable) or the pointer kernel."""
    return config.use_tma and _tma_ok(a, *_storage(a)) and _tma_ok(b, *_storage(b))


def _launch(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool, config: GemmConfig,
    allow_tf32: bool = False, layout: Optional[tuple] = None,
) -> torch.Tensor:
    """Run one kernel with an explicit config on validated, non-empty inputs; returns ``out``.

    ``layout``: ``_layout_info(a, b, out)`` when the caller already has it."""
    M, K = a.shape
    N = b.shape[1]
    a_col, ld_a, b_col, ld_b, tma_ab, _, _, c_tma = layout if layout is not None else _layout_info(a, b, out)
    use_tma = config.use_tma and tma_ab
    # fp32 defaults to exact fp32 products ("ieee"; tf32 keeps 10 mantissa bits, ~1e-3 relative
    # error, which would fail fp32 accuracy checks). 16-bit inputs ignore the setting.
    precision = "tf32" if (a.dtype != torch.float32 or allow_tf32) else "ieee"
    num_sms = _grid_programs(a.device)
    grid = (min(num_sms, cdiv(M, config.block_m) * cdiv(N, config.block_n)),)
    common = dict(
        NUM_SMS=num_sms, ACCUMULATE=accumulate, DOT_PRECISION=precision,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        EPILOGUE_SUBTILE=config.epilogue_subtile, FLATTEN=config.flatten,
        num_stages=config.num_stages, num_warps=config.num_warps,
    )
    if use_tma:
        if a.is_cuda:
            _ensure_allocator()
        _gemm_persistent_tma_kernel[grid](
            a, b, out, M, N, K, ld_a, ld_b, out.stride(0), out.stride(1),
            A_COL=a_col, B_COL=b_col, C_TMA=c_tma, WARP_SPECIALIZE=config.warp_specialize, **common,
        )
    else:
        _gemm_persistent_ptr_kernel[grid](
            a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            out.stride(0), out.stride(1), **common,
        )
    return out


_tuned: dict[tuple, GemmConfig] = {}
_logged: set[tuple] = set()


def _autotune_enabled() -> bool:
    return os.environ.get("PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


def _logger() -> logging.Logger:
    try:
        from primus_turbo.pytorch.core.logging import get_logger

        return get_logger()
    except Exception:  # noqa: BLE001 - the op layer may be absent or mid-import: same logger name
        return logging.getLogger("primus_turbo")


def _log_config(key: tuple, config: GemmConfig, how: str) -> None:
    if key in _logged or os.environ.get("PRIMUS_TURBO_PRINT_CONFIGS", "0").strip().lower() not in ("1", "true", "yes", "on"):
        return
    _logged.add(key)
    # WARNING level: asking for the configs is asking to see them, whatever the log level.
    _logger().warning("gemm_triton %s config for (M, N, K, dtype, out, layouts, acc)=%s: %s", how, key, config.short())


def _pick_config(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool, allow_tf32: bool, layout: tuple,
) -> GemmConfig:
    M, K = a.shape
    N = b.shape[1]
    a_col, _, b_col, _, tma, c_col, _, c_tma = layout
    # Every input of the winner: sizes, dtypes, layouts, TMA eligibility, accumulate, precision.
    key = (M, N, K, a.dtype, out.dtype, a_col, b_col, c_col, tma, c_tma, accumulate, allow_tf32, a.device.index)
    if key in _tuned:
        return _tuned[key]
    default = _default_config(M, N, K, a.dtype, accumulate, _grid_programs(a.device), tma, allow_tf32)
    if is_interpreter() or not a.is_cuda or not _autotune_enabled() or torch.cuda.is_current_stream_capturing():
        # (no timing is possible inside CUDA-graph capture; the default is not cached, so a later
        # uncaptured call still tunes)
        _log_config(key, default, "default")
        return default
    best, best_ms = _tune(a, b, out, accumulate, allow_tf32, _candidate_configs(M, N, a.dtype, default))
    _tuned[key] = best
    _log_config(key, best, f"autotuned ({best_ms:.3f} ms)")
    return best


def _tune(a, b, out, accumulate: bool, allow_tf32: bool, candidates: list[GemmConfig]) -> tuple[GemmConfig, float]:
    """Median time of each candidate; returns the fastest (the first one if none runs) and its time."""
    # An accumulation target must not see the trial runs: accumulate variants are timed on a zeroed
    # scratch of the same layout. A plain output is overwritten by the real launch anyway: reused.
    target = out
    if accumulate:
        target = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device).zero_()
    best, best_ms = candidates[0], float("inf")
    for cfg in candidates:
        try:
            ms = triton.testing.do_bench(lambda: _launch(a, b, target, accumulate, cfg, allow_tf32), warmup=10,
                                         rep=40, return_mode="median")
        except Exception:  # noqa: BLE001 - e.g. out of shared memory for this output dtype: skip it
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _validate(a, b, out, out_dtype, accumulate) -> None:
    """Raise TypeError/ValueError naming the offending values; return None when gemm_triton can run."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gemm_triton: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"gemm_triton: {name} must be 2-D, got {t.dim()}-D with shape {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"gemm_triton: {name}.dtype={t.dtype} is not one of float16, bfloat16, float32")
    if a.dtype != b.dtype:
        raise TypeError(f"gemm_triton: dtype mismatch, a is {a.dtype}, b is {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm_triton: K mismatch, a has K={a.shape[1]}, b has K={b.shape[0]}")
    if a.device != b.device:
        raise ValueError(f"gemm_triton: device mismatch, a on {a.device}, b on {b.device}")
    if a.device.type != "cuda" and not (a.device.type == "cpu" and is_interpreter()):
        raise ValueError(f"gemm_triton: tensors on {a.device}; needs CUDA (or CPU with TRITON_INTERPRET=1)")
    if a.device.type == "cpu" and a.dtype == torch.bfloat16 and not bf16_dot_fixed():
        raise ValueError(
            "gemm_triton: bf16 under the Triton interpreter gives wrong products (triton issue #11584); "
            "call primus_turbo.triton.interpreter.fix_bf16_dot() first, or use fp16/fp32 on CPU"
        )
    if out_dtype is not None and out_dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"gemm_triton: out_dtype={out_dtype} is not one of float16, bfloat16, float32")
    if out is None:
        if accumulate:
            raise ValueError("gemm_triton: accumulate=True needs an out tensor to accumulate into")
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"gemm_triton: out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 2 or tuple(out.shape) != (a.shape[0], b.shape[1]):
        raise ValueError(f"gemm_triton: out has shape {tuple(out.shape)}, expected {(a.shape[0], b.shape[1])}")
    if out.device != a.device:
        raise ValueError(f"gemm_triton: out on {out.device}, inputs on {a.device}")
    if out.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"gemm_triton: out.dtype={out.dtype} is not one of float16, bfloat16, float32")
    if out_dtype is not None and out_dtype != out.dtype:
        raise ValueError(f"gemm_triton: out_dtype={out_dtype} conflicts with out.dtype={out.dtype}")
    if accumulate and out.dtype not in (torch.float32, a.dtype):
        raise TypeError(f"gemm_triton: accumulate needs out.dtype float32 or {a.dtype}, got {out.dtype}")
    if any(s == 0 and n > 1 for s, n in zip(out.stride(), out.shape)):
        raise ValueError(f"gemm_triton: out has a zero stride {tuple(out.stride())} (broadcast view)")


def check_gemm_triton(a, b, out=None, accumulate=False) -> Optional[str]:
    """None when :func:`gemm_triton` can run these inputs, else a short reason. Never raises."""
    try:
        _validate(a, b, out, None, accumulate)
    except Exception as exc:  # noqa: BLE001 - the contract is "never raises"
        return str(exc).removeprefix("gemm_triton: ")
    return None


def gemm_triton(
    a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
    accumulate: bool = False, *, allow_tf32: bool = False,
) -> torch.Tensor:
    """C = A @ B (A: [M, K], B: [K, N], any strides) with fp32 accumulation.

    ``accumulate=False``: C, cast to ``out.dtype`` / ``out_dtype`` (default ``a.dtype``), is written into
    ``out`` (allocated when None). ``accumulate=True``: ``out += C`` in the kernel epilogue. fp32
    inputs use exact fp32 products unless ``allow_tf32``. Returns ``out``.
    """
    _validate(a, b, out, out_dtype, accumulate)
    return gemm_triton_prechecked(a, b, out, out_dtype, accumulate, allow_tf32=allow_tf32)


def gemm_triton_prechecked(
    a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
    accumulate: bool = False, *, allow_tf32: bool = False,
) -> torch.Tensor:
    """:func:`gemm_triton` without the argument checks, for callers that just ran
    :func:`check_gemm_triton` on the same arguments (the dispatcher does): saves microseconds a call."""
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype or a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:  # empty sum: C = 0
        return out if accumulate else out.zero_()
    if a.is_cuda and a.device.index != torch.cuda.current_device():
        with torch.cuda.device(a.device):  # triton launches on the current device
            return _run(a, b, out, accumulate, allow_tf32)
    return _run(a, b, out, accumulate, allow_tf32)


# Last resort when a tuned/default config does not compile on this GPU/triton: small tiles on the
# plain pointer kernel, no flattening, no subtiling (the simplest code path for the compiler).
_SAFE_CONFIG = GemmConfig(64, 64, 32, 8, 2, 4, False, use_tma=False, flatten=False)


def _run(a, b, out, accumulate, allow_tf32):
    layout = _layout_info(a, b, out)
    config = _pick_config(a, b, out, accumulate, allow_tf32, layout)
    try:
        return _launch(a, b, out, accumulate, config, allow_tf32, layout)
    except Exception as exc:  # noqa: BLE001 - filtered below; compile failures leave out untouched
        compile_failure = isinstance(exc, _COMPILE_ERRORS) or "PassManager" in str(exc)
        if not compile_failure or config == _SAFE_CONFIG or is_interpreter():
            raise
        _logger().warning(
            "gemm_triton: config %s failed to compile (%s: %s); using %s",
            config.short(), type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", _SAFE_CONFIG.short())
        return _launch(a, b, out, accumulate, _SAFE_CONFIG, allow_tf32)


def _compile_errors() -> tuple:
    errors = []
    for module, name in (("triton.compiler.errors", "CompilationError"), ("triton.runtime.errors", "OutOfResources"),
                         ("triton.runtime.errors", "PTXASError")):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


_COMPILE_ERRORS = _compile_errors()
