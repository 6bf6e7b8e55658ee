"""MXFP4 GEMM for Hopper (emulated): ``C[M, N] (=|+=) deq(A_q) @ deq(B_q)^T`` with fp32 accumulation.

Hopper has no FP4 (or MX block-scaled) tensor cores, so the kernel decodes FP4 in registers and
runs the bf16 tensor cores. Operands are the canonical K-major MXFP4 layout of
docs/low_precision.md: ``a_q [M, K/2]`` and ``b_q [N, K/2]`` packed E2M1 (``float4_e2m1fn_x2`` or
``uint8``; element ``2i`` of K in the low nibble of byte ``i``, ``2i+1`` in the high nibble, sign in
bit 3), with E8M0 scales ``sa [M, K/32]``, ``sb [N, K/32]`` (the byte ``e`` means ``2**(e - 127)``).

Per K step the kernel loads a ``[BLOCK_M, BLOCK_K/2]`` byte tile of A (and B likewise), splits each
byte into its two nibbles and builds each value's fp32 bit pattern with integer arithmetic
(magnitude codes 1..7 are ``0.5, 1, 1.5, 2, 3, 4, 6``: exponent ``c >> 1`` and one mantissa bit
``c & 1``), multiplies by the block's power-of-two scale (built from its bit pattern, as the MXFP8
path of gemm_fp8_kernel.py does), interleaves the nibbles back into K order and casts to bf16. This
is exact: an E2M1 value has at most 2 significant bits, and a power of two only moves its exponent,
so the scaled value is a bf16 whenever it lies in bf16's normal range (fp32's exponent range: any
scale a quantizer derives from bf16/fp32 data). The bf16 tiles go through a bf16 dot with fp32
accumulation; products of two such values have <= 4 significant bits and are exact in fp32, so the
result is the fp32 sum of the exactly dequantized products, i.e. what the MX spec defines (no
per-32 rescaling of partial sums). An E8M0 byte 255 (NaN) makes its whole block NaN; 0 is the fp32
subnormal ``2**-127``.

One persistent, GROUP_M-swizzled kernel (the tile order and epilogue of gemm_kernel.py, reused by
import) with masked pointer loads (any strides; M and N tails; K must be a multiple of 32). A TMA
variant is future work: the byte tiles are small and the decode, not the load, dominates.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, is_interpreter
from primus_turbo.triton.interpreter import bf16_dot_fixed

from .gemm_fp8_kernel import _e8m0_to_fp32
from .gemm_kernel import GemmConfig, _epilogue, _grid_programs, _tile_coords

__all__ = ["GemmConfig", "FP4_PACKED_DTYPES", "check_gemm_fp4_triton", "gemm_fp4_triton",
           "gemm_fp4_triton_prechecked"]

_FP4 = getattr(torch, "float4_e2m1fn_x2", None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
FP4_PACKED_DTYPES = tuple(d for d in (_FP4, torch.uint8) if d is not None)
_SCALE_DTYPES = tuple(d for d in (_E8M0, torch.uint8) if d is not None)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MX_BLOCK = 32


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _e2m1_to_fp32(c):
    """E2M1 nibbles (int32, 0..15) -> their fp32 values, exactly, from the bit pattern."""
    code = c & 7
    e = code >> 1
    m = code & 1
    # e > 0: (1 + m/2) * 2**(e - 1) -> biased exponent e + 126, mantissa MSB m; e = 0: m * 0.5
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    bits = bits | ((c & 8) << 28)  # sign
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_widen(p, e, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """p [ROWS, BLOCK_K/2] packed bytes, e [ROWS, BLOCK_K/32] E8M0 bytes -> bf16 [ROWS, BLOCK_K]."""
    BKP: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 32
    p = p.to(tl.int32)
    scale = _e8m0_to_fp32(e.to(tl.int32))[:, :, None]  # byte i belongs to group i // 16
    lo = tl.reshape(_e2m1_to_fp32(p & 0xF), (ROWS, G, 16)) * scale
    hi = tl.reshape(_e2m1_to_fp32((p >> 4) & 0xF), (ROWS, G, 16)) * scale
    x = tl.join(tl.reshape(lo, (ROWS, BKP)), tl.reshape(hi, (ROWS, BKP)))  # [ROWS, BKP, 2]: K order
    return tl.reshape(x, (ROWS, BLOCK_K)).to(tl.bfloat16)


@triton.jit
def _gemm_fp4_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    NUM_SMS: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """C[M, N] (+)= deq(A[M, K/2]) @ deq(B[N, K/2])^T; strides in bytes of the packed operands."""
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    BKP: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 32
    KP = K // 2
    KG = K // 32
    offs_kp = tl.arange(0, BKP)
    offs_g = tl.arange(0, G)

    tile_id_c = start_pid - NUM_SMS  # the epilogue's own tile counter (see gemm_kernel.py)
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
        b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
        sa_rows = sa_ptr + offs_m.to(tl.int64)[:, None] * stride_sam
        sb_rows = sb_ptr + offs_n.to(tl.int64)[:, None] * stride_sbn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            kp = ki * BKP + offs_kp
            kp64 = kp.to(tl.int64)
            mask_k = kp < KP
            kg = ki * G + offs_g
            mask_g = kg < KG
            # masked bytes are 0 (the value +0); masked scales 127 (2**0): padding adds nothing
            a = tl.load(a_rows + kp64[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0)
            b = tl.load(b_rows + kp64[None, :] * stride_bk, mask=mask_n[:, None] & mask_k[None, :], other=0)
            ea = tl.load(sa_rows + kg[None, :] * stride_sak, mask=mask_m[:, None] & mask_g[None, :], other=127)
            eb = tl.load(sb_rows + kg[None, :] * stride_sbk, mask=mask_n[:, None] & mask_g[None, :], other=127)
            a16 = _fp4_widen(a, ea, BLOCK_M, BLOCK_K)
            b16 = _fp4_widen(b, eb, BLOCK_N, BLOCK_K)
            acc = tl.dot(a16, b16.T, acc)

        tile_id_c += NUM_SMS
        pid_m_c, pid_n_c = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        _epilogue(c_ptr, c_ptr, acc, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N, M, N, stride_cm, stride_cn,
                  False, ACCUMULATE, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------
# Interpreter: small tiles, BLOCK_K 64 (two scale groups per tile, so the group reshape runs), 3
# persistent programs (multi-tile shapes take several turns).
_INTERPRETER_CONFIG = GemmConfig(32, 32, 64, group_m=2, num_stages=1, num_warps=4, epilogue_subtile=True,
                                 use_tma=False, flatten=False)
# sm_90: the decode runs on CUDA cores in registers (like the MXFP8 emulation), so bf16-sized
# tiles with moderate K steps. Not yet tuned on the H200 (no autotune: a fixed analytic choice).
_GPU_SMALL_M = GemmConfig(64, 128, 64, 8, 3, 4, True, use_tma=False, flatten=False)
_GPU_DEFAULT = GemmConfig(128, 128, 64, 8, 3, 8, True, use_tma=False, flatten=False)


def _default_config(M: int, N: int) -> GemmConfig:
    if is_interpreter():
        return _INTERPRETER_CONFIG
    return _GPU_SMALL_M if M <= 64 else _GPU_DEFAULT


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _device_ok(device: torch.device) -> Optional[str]:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 0):
            return f"sm_{cap[0]}{cap[1]} has no bf16 tensor cores for the MXFP4 emulation (needs sm_80 or newer)"
        return None
    if device.type == "cpu" and is_interpreter():
        if not bf16_dot_fixed():
            return ("the MXFP4 GEMM runs a bf16 dot, which the Triton interpreter gets wrong (triton issue "
                    "#11584); call primus_turbo.triton.interpreter.fix_bf16_dot() first")
        return None
    return f"tensors on {device}; needs CUDA (or CPU with TRITON_INTERPRET=1)"


def _validate(a, sa, b, sb, out, out_dtype, accumulate) -> None:
    """Raise TypeError/ValueError naming the offending values."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (packed [rows, K/2]), got shape {tuple(t.shape)}")
        if t.dtype not in FP4_PACKED_DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not float4_e2m1fn_x2 or uint8 (packed E2M1)")
    M, KP = a.shape
    N = b.shape[0]
    if b.shape[1] != KP:
        raise ValueError(f"K mismatch: a is packed [M, K/2] = {list(a.shape)}, b is [N, K/2] = {list(b.shape)}")
    K = 2 * KP
    if K % MX_BLOCK:
        raise ValueError(f"MXFP4 needs K to be a multiple of 32, got K={K} (packed width {KP})")
    if a.device != b.device:
        raise ValueError(f"device mismatch: a on {a.device}, b on {b.device}")
    reason = _device_ok(a.device)
    if reason:
        raise ValueError(reason)
    for name, s, rows in (("a_scale", sa, M), ("b_scale", sb, N)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
        if s.dtype not in _SCALE_DTYPES:
            raise TypeError(f"{name} must be float8_e8m0fnu (or uint8 bytes), got {s.dtype}")
        if tuple(s.shape) != (rows, K // MX_BLOCK):
            raise ValueError(f"{name} must have shape [rows, K/32] = {[rows, K // MX_BLOCK]}, got {list(s.shape)}")
        if s.device != a.device:
            raise ValueError(f"{name} is on {s.device}, the operands on {a.device}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not one of bfloat16, float16, float32")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an out tensor to accumulate into")
        return
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
    if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
        raise ValueError(f"out has a zero stride {tuple(out.stride())} (broadcast view)")


def check_gemm_fp4_triton(a, sa, b, sb, out=None, out_dtype=None, accumulate=False) -> Optional[str]:
    """None when :func:`gemm_fp4_triton` can run these inputs, else a short reason. Never raises."""
    try:
        _validate(a, sa, b, sb, out, out_dtype, accumulate)
    except Exception as exc:  # noqa: BLE001 - the contract is "never raises"
        return str(exc)
    return None


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------
def _launch(a, sa, b, sb, out, accumulate: bool, config: GemmConfig) -> torch.Tensor:
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    sa, sb = sa.view(torch.uint8), sb.view(torch.uint8)
    M, N, K = a.shape[0], b.shape[0], 2 * a.shape[1]
    num_sms = _grid_programs(a.device)
    grid = (min(num_sms, cdiv(M, config.block_m) * cdiv(N, config.block_n)),)
    _gemm_fp4_kernel[grid](
        a, b, out, sa, sb, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        NUM_SMS=num_sms, ACCUMULATE=accumulate,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        EPILOGUE_SUBTILE=config.epilogue_subtile, FLATTEN=config.flatten,
        num_stages=config.num_stages, num_warps=config.num_warps,
    )
    return out


def gemm_fp4_triton(
    a_q: torch.Tensor, sa: torch.Tensor, b_q: torch.Tensor, sb: torch.Tensor,
    out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = torch.bfloat16,
    accumulate: bool = False, config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """``C = deq(a_q, sa) @ deq(b_q, sb).T`` (or ``out += C``) with fp32 accumulation.

    Args:
        a_q: ``[M, K/2]`` packed E2M1 (``float4_e2m1fn_x2`` or ``uint8``), any strides; K % 32 == 0.
        sa: ``[M, K/32]`` E8M0 scales (``float8_e8m0fnu`` or their ``uint8`` bytes).
        b_q: ``[N, K/2]`` packed E2M1; ``sb`` ``[N, K/32]``.
        out: written (or added into, with ``accumulate``) when given, else allocated.
        out_dtype: bf16, fp16 or fp32; ignored when ``out`` is given.
        accumulate: ``out += C`` in the epilogue, summed in fp32.
        config: a launch config (tests); default: the analytic choice.
    """
    if out is not None:
        out_dtype = None
    _validate(a_q, sa, b_q, sb, out, out_dtype, accumulate)
    return gemm_fp4_triton_prechecked(a_q, sa, b_q, sb, out, out_dtype, accumulate, config)


def gemm_fp4_triton_prechecked(a_q, sa, b_q, sb, out=None, out_dtype=torch.bfloat16, accumulate=False,
                               config: Optional[GemmConfig] = None) -> torch.Tensor:
    """:func:`gemm_fp4_triton` for callers that just ran :func:`check_gemm_fp4_triton`."""
    M, KP = a_q.shape
    N = b_q.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype or torch.bfloat16, device=a_q.device)
    if M == 0 or N == 0:
        return out
    if KP == 0:
        return out if accumulate else out.zero_()
    config = config or _default_config(M, N)
    if config.block_k % MX_BLOCK or config.block_k < MX_BLOCK:
        raise ValueError(f"config.block_k must be a multiple of 32, got {config.block_k}")
    if a_q.is_cuda and a_q.device.index != torch.cuda.current_device():
        with torch.cuda.device(a_q.device):
            return _launch(a_q, sa, b_q, sb, out, accumulate, config)
    return _launch(a_q, sa, b_q, sb, out, accumulate, config)
