"""Gather rows, quantize along the rows, store transposed: the token copy of a grouped FP8 wgrad.

The variable-K (wgrad) GEMM of ``grouped_gemm_fp8`` BLOCKWISE reduces over tokens, so it reads
``x [M_total, C]`` (the activations, or the output gradient) as a column-wise quantized copy in
the padded token layout: rows re-laid by ``src`` (``padded_group_layout``: every expert's segment
padded with zero rows to a multiple of the token block), quantized in ``bs x 1`` blocks (one fp32
scale per token block and column), stored transposed ``[C, M_pad]`` so the reduction dim is
contiguous. Done as three passes (gather, quantize, byte transpose) that is about 4.5 bytes of
traffic per element of ``x`` and per pass a launch; this kernel reads ``x`` once (2 bytes per
element for bf16) and writes the FP8 copy once (1 byte): one program per ``[bs, TC]`` tile of the
padded layout loads the gathered rows, reduces each column's amax over the block, scales, casts
and stores the tile transposed (rows of ``bs`` contiguous bytes).

Bit-identical to the three-pass path: the same scale arithmetic (``_fp32_scales``: IEEE-rounded
``FP8_MAX / amax``, 1 for an all-zero or non-finite block) and the same cast (``_fp8_codes``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, next_pow2, is_interpreter

from .quant_fp8_kernel import _abs_bits, _fp8_codes, _fp32_scales

__all__ = ["gather_quant_cols_t_launch"]

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _gather_quant_cols_t_kernel(
    x_ptr, src_ptr, q_ptr, s_ptr,
    C, M_PAD, stride_x, n_tiles_c,
    FP8_MAX: tl.constexpr, BS: tl.constexpr, TC: tl.constexpr, EVEN_C: tl.constexpr,
    IS_E4M3: tl.constexpr, SOFT: tl.constexpr,
):
    pid = tl.program_id(0)
    tb = pid // n_tiles_c  # token block of the padded layout
    pid_c = pid % n_tiles_c
    rows = tb * BS + tl.arange(0, BS)  # every token block lies wholly inside M_PAD (a multiple of BS)
    cols = pid_c * TC + tl.arange(0, TC)
    src = tl.load(src_ptr + rows)
    keep = src >= 0
    mask = keep[:, None]
    if not EVEN_C:
        mask = mask & (cols < C)[None, :]
    x_ptrs = x_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * stride_x + cols[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    amax_bits = tl.max(_abs_bits(x), axis=0)  # [TC]: one block per column
    scale, scale_inv = _fp32_scales(amax_bits, FP8_MAX)
    codes = _fp8_codes(x * scale[None, :], FP8_MAX, IS_E4M3, SOFT)  # [BS, TC]
    # transposed store: row c of the copy holds this block's BS tokens, contiguous
    q_ptrs = q_ptr + cols.to(tl.int64)[:, None] * M_PAD + rows[None, :]
    s_ptrs = s_ptr + tb.to(tl.int64) * C + cols
    if EVEN_C:
        tl.store(q_ptrs, tl.trans(codes))
        tl.store(s_ptrs, scale_inv)
    else:
        tl.store(q_ptrs, tl.trans(codes), mask=(cols < C)[:, None])
        tl.store(s_ptrs, scale_inv, mask=cols < C)


def gather_quant_cols_t_launch(x: torch.Tensor, src: torch.Tensor, dtype: torch.dtype, block_size: int, *,
                               tc: "int | None" = None, num_warps: "int | None" = None,
                               gluon: "bool | None" = None):
    """``(q_t [C, M_pad] dtype, s [M_pad / block_size, C] fp32 scale_inv)`` with
    ``q_t.T, s`` equal to the BLOCKWISE ``block_size x 1`` quantization of ``x[src]`` (rows with
    ``src < 0`` zero), i.e. of ``gather_rows(x, src)`` along axis 0.

    ``x`` 2-D with unit column stride, float32 / float16 / bfloat16; ``src`` 1-D int32/int64 of
    length ``M_pad``, a multiple of ``block_size`` (a power of two >= 16); ``dtype`` E4M3 or E5M2.
    ``tc`` (columns per tile, a power of two >= 16) / ``num_warps`` override the default launch
    (scripts/tune_gptoss_memory.py sweeps them): every column's block is reduced and stored whole
    by one program whatever the tile width, so the output bytes do not depend on them.

    ``gluon``: run the Hopper Gluon twin (gather_quant_gluon.py, the same bytes; 128-token blocks):
    None = where it runs and PRIMUS_TURBO_GATHER_QUANT_GLUON (docs/env_vars.md) does not say no,
    and no tl override (``tc`` / ``num_warps``) is given; True = required (ValueError naming the
    reason when it cannot run); False = the tl kernel."""
    if x.dim() != 2 or (x.size(1) > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be 2-D with unit column stride, got shape {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if dtype not in _FP8_MAX:
        raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    m_pad = src.numel()
    if src.dim() != 1 or m_pad % block_size:
        raise ValueError(f"src must be 1-D with a multiple of block_size={block_size} entries, got {tuple(src.shape)}")
    if src.device != x.device:
        raise ValueError(f"src on {src.device}, x on {x.device}")
    C = x.size(1)
    q_t = torch.empty((C, m_pad), dtype=dtype, device=x.device)
    s = torch.empty((m_pad // block_size, C), dtype=torch.float32, device=x.device)
    if C == 0 or m_pad == 0:
        return q_t, s
    if gluon is not False and tc is None and num_warps is None:
        from .gather_quant_gluon import (GATHER_QUANT_GLUON_ENV, gather_quant_cols_t_gluon, gather_quant_gluon_reason,
                                         gluon_switch)

        reason = gather_quant_gluon_reason(x, src, dtype, block_size)
        if gluon and reason is not None:
            raise ValueError(f"gather_quant_cols_t_launch(gluon=True): {reason}")
        if reason is None and (gluon or gluon_switch(GATHER_QUANT_GLUON_ENV) is not False):
            gather_quant_cols_t_gluon(x, src, dtype, q_t, s)
            return q_t, s
    elif gluon:
        raise ValueError("gather_quant_cols_t_launch: gluon=True takes no tc / num_warps (tl launch overrides)")
    if tc is not None and (tc < 16 or tc & (tc - 1)):
        raise ValueError(f"tc must be a power of two >= 16, got tc={tc}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got num_warps={num_warps}")
    # tiles of block_size x TC: 64 columns at 128-token blocks keeps 8192 elements per program
    # (at GPT-OSS's C = 2880 / 5760, 64 divides C: no idle column lanes)
    tc = tc or max(16, min(next_pow2(C), 8192 // block_size))
    n_tiles_c = cdiv(C, tc)
    grid = ((m_pad // block_size) * n_tiles_c,)
    _gather_quant_cols_t_kernel[grid](
        x, src, q_t.view(torch.uint8), s, C, m_pad, x.stride(0), n_tiles_c,
        FP8_MAX=_FP8_MAX[dtype], BS=block_size, TC=tc, EVEN_C=(C % tc == 0),
        IS_E4M3=dtype == torch.float8_e4m3fn, SOFT=is_interpreter(), num_warps=num_warps or 4)
    return q_t, s
