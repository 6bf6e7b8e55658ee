"""MXFP4 grouped GEMM for MoE experts (emulated on Hopper): persistent Triton kernels with a
device-side tile schedule, E2M1 decoded in-kernel onto bf16 tensor cores.

The schedules are those of ``grouped_gemm_fp8_kernel.py`` (and of the bf16 kernels in
``grouped_gemm_kernel.py``); the decode is that of the dense MXFP4 GEMM (``gemm/gemm_fp4_kernel.py``,
whose ``_fp4_widen`` is reused): each packed byte tile is split into its nibbles, every value is
built from its bit pattern, multiplied by its block's power-of-two E8M0 scale and cast to bf16,
exactly; the bf16 dot accumulates the exact products in fp32. Operands are the canonical K-major
MXFP4 layout of docs/low_precision.md (element ``2i`` of K in the low nibble of byte ``i``).

* ``_grouped_gemm_fp4_kernel`` (forward and dgrad, M-grouped)::

      C[offs[g]:offs[g+1]] = deq(A_q, sa)[rows of g] @ deq(B_q[g], sb[g])^T        C[offs[G]:] = 0

  ``A_q [M_total, K/2]``, ``sa [M_total, K/32]``, ``B_q [G, N, K/2]``, ``sb [G, N, K/32]``; K % 32 == 0.

* ``_grouped_gemm_fp4_variable_k_kernel`` (wgrad)::

      C[g] (+)= deq(X_t, sx)[:, rows of g] @ deq(Y_t, sy)[:, rows of g]^T

  ``X_t [P, M_total/2]``, ``sx [P, M_total/32]``, ``Y_t [Q, M_total/2]``, ``sy [Q, M_total/32]``
  (the column-wise copies stored transposed: tokens are the packed, blocked dim) and ``C [G, P, Q]``.
  **Every group offset must be a multiple of 32** (so no 32-token block, and no packed byte,
  straddles two experts): the op layer feeds a token layout whose group segments are padded with
  zero rows to multiples of 32. It cannot be checked here without a host synchronisation.

Group sizes are only read on the device (no host synchronisation). Masked pointer loads.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, is_interpreter
from primus_turbo.triton.gemm.gemm_fp4_kernel import (  # the dense MXFP4 GEMM's dtypes and decoder
    _OUT_DTYPES, _SCALE_DTYPES, FP4_PACKED_DTYPES, MX_BLOCK, _fp4_widen,
)
from primus_turbo.triton.interpreter import bf16_dot_fixed

from . import grouped_gemm_fp8_kernel as _fp8k
from .grouped_gemm_fp8_kernel import GroupedGemmFP8Config as GroupedGemmFP4Config
from .grouped_gemm_kernel import _group_span, _swizzle, _token_split, group_offsets

__all__ = [
    "GroupedGemmFP4Config",
    "check_grouped_gemm_fp4_triton",
    "check_grouped_gemm_fp4_variable_k_triton",
    "grouped_gemm_fp4_triton",
    "grouped_gemm_fp4_variable_k_triton",
]



# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _grouped_gemm_fp4_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, sa_ptr, sb_ptr,
    M, N, K, G,
    stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    BKP: tl.constexpr = BLOCK_K // 2
    NG: tl.constexpr = BLOCK_K // 32
    KP = K // 2
    KG = K // 32
    offs_kp = tl.arange(0, BKP)
    offs_g = tl.arange(0, NG)
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
                sa_rows = sa_ptr + rows.to(tl.int64)[:, None] * stride_sam
                sb_rows = sb_g + cols.to(tl.int64)[:, None] * stride_sbn
                for ki in range(k_tiles):
                    kp = ki * BKP + offs_kp
                    kp64 = kp.to(tl.int64)
                    mask_k = kp < KP
                    kg = ki * NG + offs_g
                    mask_g = kg < KG
                    # masked bytes are 0 (+0); masked scales 127 (2**0): padding adds nothing
                    a = tl.load(a_rows + kp64[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0)
                    b = tl.load(b_rows + kp64[None, :] * stride_bk, mask=mask_n[:, None] & mask_k[None, :], other=0)
                    ea = tl.load(sa_rows + kg[None, :] * stride_sak, mask=mask_m[:, None] & mask_g[None, :],
                                 other=127)
                    eb = tl.load(sb_rows + kg[None, :] * stride_sbk, mask=mask_n[:, None] & mask_g[None, :],
                                 other=127)
                    a16 = _fp4_widen(a, ea, BLOCK_M, BLOCK_K)
                    b16 = _fp4_widen(b, eb, BLOCK_N, BLOCK_K)
                    acc = tl.dot(a16, tl.trans(b16), acc)
            c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
        tile_base += tiles_g


@triton.jit
def _vk_fp4_step(
    acc, x_rows, y_rows, sx_rows, sy_rows, mask_p, mask_q, rp0, rg0, r_hi,
    stride_xm, stride_ym, stride_sxm, stride_sym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr,
):
    """One K step of the variable-K kernel: BLOCK_K tokens from packed byte ``rp0`` and 32-token
    block ``rg0`` (tokens past ``r_hi`` read as zero bytes with scale 1 when MASKED). MASKED is
    constexpr so the unmasked body carries no token mask: a mask along the contiguous token dim
    forces 1-byte scalar loads."""
    BKP: tl.constexpr = BLOCK_K // 2
    NG: tl.constexpr = BLOCK_K // 32
    rp = rp0 + tl.arange(0, BKP)  # packed byte index along the tokens
    rp64 = rp.to(tl.int64)
    rg = rg0 + tl.arange(0, NG)
    if MASKED:
        mask_r = rp * 2 < r_hi
        mask_g = rg * 32 < r_hi
        x = tl.load(x_rows + rp64[None, :] * stride_xm, mask=mask_p[:, None] & mask_r[None, :], other=0)
        y = tl.load(y_rows + rp64[None, :] * stride_ym, mask=mask_q[:, None] & mask_r[None, :], other=0)
        ex = tl.load(sx_rows + rg[None, :] * stride_sxm, mask=mask_p[:, None] & mask_g[None, :], other=127)
        ey = tl.load(sy_rows + rg[None, :] * stride_sym, mask=mask_q[:, None] & mask_g[None, :], other=127)
    else:
        x = tl.load(x_rows + rp64[None, :] * stride_xm, mask=mask_p[:, None], other=0)
        y = tl.load(y_rows + rp64[None, :] * stride_ym, mask=mask_q[:, None], other=0)
        ex = tl.load(sx_rows + rg[None, :] * stride_sxm, mask=mask_p[:, None], other=127)
        ey = tl.load(sy_rows + rg[None, :] * stride_sym, mask=mask_q[:, None], other=127)
    x16 = _fp4_widen(x, ex, BLOCK_M, BLOCK_K)
    y16 = _fp4_widen(y, ey, BLOCK_N, BLOCK_K)
    return tl.dot(x16, tl.trans(y16), acc)


@triton.jit
def _grouped_gemm_fp4_variable_k_kernel(
    x_ptr, y_ptr, c_ptr, offs_ptr, sx_ptr, sy_ptr,
    M, P, Q, G,
    stride_xp, stride_xm, stride_yq, stride_ym, stride_cg, stride_cp, stride_cq,
    stride_sxp, stride_sxm, stride_syq, stride_sym,
    NUM_PROGRAMS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """M is the (unpacked) token count; x_t / y_t are packed along it. Offsets are multiples of 32."""
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
        sx_rows = sx_ptr + ps.to(tl.int64)[:, None] * stride_sxp
        sy_rows = sy_ptr + qs.to(tl.int64)[:, None] * stride_syq
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # head (masked), body of whole steps from a multiple of 32 tokens = 16 packed bytes
        # (unmasked: 16-byte vector loads along the contiguous tokens), tail (masked): see
        # _token_split. Offsets are multiples of 32, so the head is empty; the tail is a partial
        # step of whole 32-token blocks
        body_start, head_end, n_body, tail_start = _token_split(r_start, r_end, 32, BLOCK_K)
        if r_start < head_end:
            acc = _vk_fp4_step(acc, x_rows, y_rows, sx_rows, sy_rows, mask_p, mask_q, r_start // 2, r_start // 32,
                               head_end, stride_xm, stride_ym, stride_sxm, stride_sym, BLOCK_M, BLOCK_N, BLOCK_K, True)
        for i in range(n_body):
            r0 = body_start + i * BLOCK_K
            acc = _vk_fp4_step(acc, x_rows, y_rows, sx_rows, sy_rows, mask_p, mask_q, tl.multiple_of(r0 // 2, 16),
                               r0 // 32, r_end, stride_xm, stride_ym, stride_sxm, stride_sym,
                               BLOCK_M, BLOCK_N, BLOCK_K, False)
        if tail_start < r_end:
            acc = _vk_fp4_step(acc, x_rows, y_rows, sx_rows, sy_rows, mask_p, mask_q, tail_start // 2,
                               tail_start // 32, r_end, stride_xm, stride_ym, stride_sxm, stride_sym,
                               BLOCK_M, BLOCK_N, BLOCK_K, True)
        c_ptrs = (c_ptr + tl.cast(g, tl.int64) * stride_cg + ps.to(tl.int64)[:, None] * stride_cp
                  + qs.to(tl.int64)[None, :] * stride_cq)
        mask = mask_p[:, None] & mask_q[None, :]
        if ACCUMULATE:
            acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------
# Interpreter: small tiles, BLOCK_K 64 (two scale groups per tile), 3 persistent programs.
_INTERPRETER_CONFIG = GroupedGemmFP4Config(32, 32, 64, group_m=2, num_stages=1, num_warps=4)


def _default_config(m_avg: int, variable_k: bool) -> GroupedGemmFP4Config:
    """Static-shape analytic config (sm_90; the decode runs on CUDA cores, as the dense MXFP4 GEMM)."""
    if is_interpreter():
        return _INTERPRETER_CONFIG
    if not variable_k and m_avg <= 64:
        return GroupedGemmFP4Config(64, 128, 64, 8, 3, 4)
    return GroupedGemmFP4Config(128, 128, 64, 8, 3, 8)


# ----------------------------------------------------------------------------------------------
# Validation (shapes, dtypes, devices only: never a device value)
# ----------------------------------------------------------------------------------------------
def _device_ok(device: torch.device) -> None:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 0):
            raise ValueError(f"sm_{cap[0]}{cap[1]} has no bf16 tensor cores for the MXFP4 emulation "
                             "(needs sm_80 or newer)")
        return
    if device.type == "cpu" and is_interpreter():
        if not bf16_dot_fixed():
            raise ValueError("the MXFP4 grouped GEMM runs a bf16 dot, which the Triton interpreter gets wrong "
                             "(triton issue #11584); call primus_turbo.triton.interpreter.fix_bf16_dot() first")
        return
    raise ValueError(f"tensors on {device}; needs CUDA (or CPU with TRITON_INTERPRET=1)")


def _check_packed(name, t, dim) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in FP4_PACKED_DTYPES:
        raise TypeError(f"{name}.dtype={t.dtype} is not float4_e2m1fn_x2 or uint8 (packed E2M1)")


def _check_scale(name, s, want: tuple, device) -> None:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
    if s.dtype not in _SCALE_DTYPES:
        raise TypeError(f"{name} must be float8_e8m0fnu (or uint8 bytes), got {s.dtype}")
    if s.device != device:
        raise ValueError(f"{name} on {s.device}, operands on {device}")
    if tuple(s.shape) != want:
        raise ValueError(f"{name} must have shape {list(want)}, got {list(s.shape)}")


def _validate(a, sa, b, sb, group_lens, group_offs, out_dtype) -> None:
    _check_packed("a", a, 2)
    _check_packed("b", b, 3)
    M, KP = a.shape
    G, N, KPb = b.shape
    if KPb != KP:
        raise ValueError(f"K mismatch: a is packed [M, K/2] = {list(a.shape)}, b is [G, N, K/2] = {list(b.shape)}")
    K = 2 * KP
    if K % MX_BLOCK:
        raise ValueError(f"MXFP4 needs K to be a multiple of 32, got K={K} (packed width {KP})")
    if a.device != b.device:
        raise ValueError(f"device mismatch: a on {a.device}, b on {b.device}")
    _device_ok(a.device)
    _fp8k._check_offsets(group_lens, group_offs, G, a.device)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not one of bfloat16, float16, float32")
    _check_scale("a_scale", sa, (M, K // MX_BLOCK), a.device)
    _check_scale("b_scale", sb, (G, N, K // MX_BLOCK), a.device)


def _validate_variable_k(xt, sx, yt, sy, group_lens, group_offs, out, accumulate, out_dtype) -> None:
    _check_packed("x_t", xt, 2)
    _check_packed("y_t", yt, 2)
    if xt.shape[1] != yt.shape[1] or xt.device != yt.device:
        raise ValueError(f"x_t {tuple(xt.shape)} on {xt.device} and y_t {tuple(yt.shape)} on {yt.device} "
                         "must share the packed token dim (dim 1) and device")
    _device_ok(xt.device)
    G = group_lens.numel() if isinstance(group_lens, torch.Tensor) else group_offs.numel() - 1
    _fp8k._check_offsets(group_lens, group_offs, G, xt.device)
    P, Q, M = xt.shape[0], yt.shape[0], 2 * xt.shape[1]
    if M % MX_BLOCK:
        raise ValueError(f"MXFP4 needs the token dim to be a multiple of 32 (a layout with group segments padded "
                         f"to multiples of 32), got {M} (packed width {xt.shape[1]})")
    _check_scale("x_scale", sx, (P, M // MX_BLOCK), xt.device)
    _check_scale("y_scale", sy, (Q, M // MX_BLOCK), xt.device)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out")
        if out_dtype not in _OUT_DTYPES:
            raise TypeError(f"out_dtype={out_dtype} is not one of bfloat16, float16, float32")
        return
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (G, P, Q) or out.device != xt.device:
        raise ValueError(f"out must be a tensor of shape {(G, P, Q)} on {xt.device}")
    if out.dtype not in _OUT_DTYPES:
        raise TypeError(f"out.dtype={out.dtype} is not one of bfloat16, float16, float32")


def check_grouped_gemm_fp4_triton(a, sa, b, sb, group_lens, group_offs=None,
                                  out_dtype=torch.bfloat16) -> Optional[str]:
    """None when :func:`grouped_gemm_fp4_triton` can run these inputs, else a reason. Never raises."""
    try:
        _validate(a, sa, b, sb, group_lens, group_offs, out_dtype)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return None


def check_grouped_gemm_fp4_variable_k_triton(xt, sx, yt, sy, group_lens, group_offs=None, out=None,
                                             accumulate=False, out_dtype=torch.bfloat16) -> Optional[str]:
    try:
        _validate_variable_k(xt, sx, yt, sy, group_lens, group_offs, out, accumulate, out_dtype)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def grouped_gemm_fp4_triton(
    a_q: torch.Tensor, sa: torch.Tensor, b_q: torch.Tensor, sb: torch.Tensor,
    group_lens: Optional[torch.Tensor], group_offs: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16, num_cu: Optional[int] = None,
    config: Optional[GroupedGemmFP4Config] = None, *, checked: bool = False,
) -> torch.Tensor:
    """``out[rows of g] = deq(a_q, sa)[rows of g] @ deq(b_q[g], sb[g]).T``, rows past ``offs[G]`` zero.

    ``a_q [M_total, K/2]``, ``b_q [G, N, K/2]`` packed E2M1 (``float4_e2m1fn_x2`` or ``uint8``);
    ``sa [M_total, K/32]``, ``sb [G, N, K/32]`` E8M0. K % 32 == 0. No host synchronisation.
    """
    if not checked:
        _validate(a_q, sa, b_q, sb, group_lens, group_offs, out_dtype)
    if group_offs is None:
        group_offs = group_offsets(group_lens)
    M, KP = a_q.shape
    G, N, _ = b_q.shape
    K = 2 * KP
    out = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    if M == 0 or N == 0:
        return out
    if G == 0 or K == 0:
        return out.zero_()
    cfg = config or _default_config(max(1, M // G), False)
    if cfg.block_k % MX_BLOCK:
        raise ValueError(f"MXFP4 needs BLOCK_K ({cfg.block_k}) to be a multiple of 32")
    a_q, b_q, sa, sb = (t.view(torch.uint8) for t in (a_q, b_q, sa, sb))
    programs = _fp8k._num_programs(a_q.device, num_cu)
    max_tiles = (cdiv(M, cfg.block_m) + G + 1) * cdiv(N, cfg.block_n)
    grid = (min(programs, max_tiles),)

    def launch():
        _grouped_gemm_fp4_kernel[grid](
            a_q, b_q, out, group_offs, sa, sb, M, N, K, G,
            a_q.stride(0), a_q.stride(1), b_q.stride(0), b_q.stride(1), b_q.stride(2), out.stride(0), out.stride(1),
            sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), sb.stride(2),
            NUM_PROGRAMS=grid[0],
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_stages=cfg.num_stages, num_warps=cfg.num_warps,
        )
        return out

    return _fp8k._run_on_device(a_q.device, launch)


def grouped_gemm_fp4_variable_k_triton(
    x_t: torch.Tensor, sx: torch.Tensor, y_t: torch.Tensor, sy: torch.Tensor,
    group_lens: Optional[torch.Tensor], group_offs: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None, accumulate: bool = False, out_dtype: torch.dtype = torch.bfloat16,
    num_cu: Optional[int] = None, config: Optional[GroupedGemmFP4Config] = None, *, checked: bool = False,
) -> torch.Tensor:
    """``out[g] (+)= deq(x_t, sx)[:, rows of g] @ deq(y_t, sy)[:, rows of g].T``: ``[G, P, Q]``.

    ``x_t [P, M_total/2]``, ``y_t [Q, M_total/2]`` packed along the tokens, ``sx [P, M_total/32]``,
    ``sy [Q, M_total/32]`` E8M0; every group offset a multiple of 32 (not checked: it would need a
    host sync). An empty group gives zeros (or leaves ``out[g]`` unchanged when accumulating).
    """
    if not checked:
        _validate_variable_k(x_t, sx, y_t, sy, group_lens, group_offs, out, accumulate, out_dtype)
    G = group_lens.numel() if group_lens is not None else group_offs.numel() - 1
    if group_offs is None:
        group_offs = group_offsets(group_lens)
    P, MP = x_t.shape
    Q = y_t.shape[0]
    M = 2 * MP
    if out is None:
        out = torch.empty((G, P, Q), dtype=out_dtype, device=x_t.device)
    if G == 0 or P == 0 or Q == 0:
        return out
    if M == 0:
        return out if accumulate else out.zero_()
    cfg = config or _default_config(max(1, M // G), True)
    if cfg.block_k % MX_BLOCK:
        raise ValueError(f"MXFP4 needs BLOCK_K ({cfg.block_k}) to be a multiple of 32")
    x_t, y_t, sx, sy = (t.view(torch.uint8) for t in (x_t, y_t, sx, sy))
    programs = _fp8k._num_programs(x_t.device, num_cu)
    grid = (min(programs, G * cdiv(P, cfg.block_m) * cdiv(Q, cfg.block_n)),)

    def launch():
        _grouped_gemm_fp4_variable_k_kernel[grid](
            x_t, y_t, out, group_offs, sx, sy, M, P, Q, G,
            x_t.stride(0), x_t.stride(1), y_t.stride(0), y_t.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            sx.stride(0), sx.stride(1), sy.stride(0), sy.stride(1),
            NUM_PROGRAMS=grid[0], ACCUMULATE=accumulate,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_stages=cfg.num_stages, num_warps=cfg.num_warps,
        )
        return out

    return _fp8k._run_on_device(x_t.device, launch)
