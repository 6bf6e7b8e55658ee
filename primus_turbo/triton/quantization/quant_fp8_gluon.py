"""Hopper Gluon twin of the one-launch expert-weight copies (``fp8_quant_batched_launch(...,
with_trans=True)``): each 128 x 128 block of ``x [B, rows, cols]`` quantized once (fp32 scale per
block), stored as the forward copy ``q [B, rows, cols]`` and transposed as the grad_input copy
``qt [B, cols, rows]``, from one read of the tile and with no shared-memory transpose.

The tl kernel (``_quant_fp8_tile_batched_kernel`` with ``HAS_T``) cannot pick its layout, so it
reads the tile a second time (from L2) as four row sets to form the transposed 32-bit words
(reusing the forward copy's 8-bit codes miscompiles there: docs/design.md) and lets the compiler
convert the words' layout for the transposed store: ~0.75x the device copy's rate on the H200.

Here the tile is the ``[32 words, 4 bytes, 128 columns]`` view of its 128 rows (row ``4 w + b``)
in gather_quant_gluon.py's layout (thread = ``4 SPW`` consecutive rows x ``VEC`` consecutive
columns, lanes and warps side by side): the block amax is an in-thread max, a butterfly and one
cross-warp step of a scalar; the forward copy stores each thread's ``VEC`` bytes of a row
directly; the transposed copy packs the four codes of rows ``4 w .. 4 w + 3`` of a column into a
32-bit word in-thread, renames registers (no data movement) and stores ``SPW`` words of a column
as one vector. The transposed words come from a second cast of the scaled tile whose scale passes
through an opaque move, so no 8-bit code value feeds both the forward store and the packing: the
forms that share them (one cast; or the forward bytes unpacked from the packed words) wrote wrong
transposed bytes at columns 0, 1, 4, 5, ... of every 128 wherever the forward stores vectorize,
the tl kernel's failure of session 15 again (H200, 2026-12-02,
benchmarks/results/h200/session16/diag_weight_forms_call4.log); ptxas merges the two casts, so
the right form costs nothing (1.18x faster than the tl kernel, 0.90x the device copy, Mixtral
experts). The scale and the casts are the tl kernel's helpers: the bytes are identical (GPU tests).

:func:`weight_copies_gluon_reason` says why a call goes to the tl kernel instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, gluon_platform_reason
from primus_turbo.triton.launch import launch

from .gather_quant_gluon import GluonGatherQuantConfig, _layouts
from .gather_quant_kernel import _FP8_MAX
from .quant_fp8_kernel import _MAX_GRID_Y

__all__ = ["WEIGHT_COPIES_GLUON_ENV", "WEIGHT_COPIES_DEFAULT_CONFIG", "weight_copies_gluon",
           "weight_copies_gluon_reason"]

WEIGHT_COPIES_GLUON_ENV = "PRIMUS_TURBO_FP8_WEIGHT_GLUON"
_BLK = 128
#: 16 rows x 8 columns per thread, 4 warps: one 128 x 128 block per program (a config's tile
#: width must be 128)
WEIGHT_COPIES_DEFAULT_CONFIG = GluonGatherQuantConfig(4, 8, 4)

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .quant_fp8_kernel import _abs_bits, _fp8_codes, _fp32_scales


def weight_copies_gluon_reason(x: torch.Tensor, out_dtype, config: Optional[GluonGatherQuantConfig] = None
                               ) -> Optional[str]:
    """None when the Gluon kernel takes ``x [B, rows, cols]`` (128 x 128 fp32 blocks, the caller's
    ``batched_trans_ok`` passed), else why not."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    reason = gluon_platform_reason(x.device)
    if reason is not None:
        return reason
    if x.dim() != 3:
        return f"x must be 3-D, got shape {tuple(x.shape)}"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        # bf16, fp16 and fp32 weights bit-checked against the Triton kernel on the H200 (2026-12-02)
        return f"x dtype {x.dtype}: bf16, fp16 or fp32 weights"
    if out_dtype not in _FP8_MAX:
        return f"out_dtype {out_dtype}"
    if x.shape[1] % 4:
        return f"rows={x.shape[1]} not a multiple of 4"
    if x.shape[2] > 1 and x.stride(2) != 1:
        return f"x's columns are not contiguous (strides {x.stride()})"
    cfg = config or WEIGHT_COPIES_DEFAULT_CONFIG
    if (reason := cfg.reason()) is not None:
        return reason
    if cfg.tc != _BLK:
        return f"config {tuple(cfg)}: tile width {cfg.tc}, must be 128 (one block per program)"
    return None


if GLUON_AVAILABLE:

    @gluon.jit
    def _opaque(v):
        """``v`` through a move the compiler cannot see through (no CSE with the original)."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _weight_copies_gluon_kernel(
        x_ptr, q_ptr, qt_ptr, s_ptr,
        rows, cols, n_tiles_c, n_sr, n_sc,
        stride_xb, stride_xr,
        FP8_MAX: gl.constexpr, IS_E4M3: gl.constexpr,
        L3: gl.constexpr, LST: gl.constexpr,
    ):
        W: gl.constexpr = 32
        TC: gl.constexpr = 128
        LWB: gl.constexpr = gl.SliceLayout(2, L3)
        LC: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L3))

        pid = gl.program_id(0)
        b = gl.program_id(1).to(gl.int64)
        pid_r = pid // n_tiles_c
        pid_c = pid % n_tiles_c

        w_i = gl.arange(0, W, layout=gl.SliceLayout(1, LWB))
        b_i = gl.arange(0, 4, layout=gl.SliceLayout(0, LWB))
        r2 = pid_r * 128 + gl.expand_dims(w_i, 1) * 4 + gl.expand_dims(b_i, 0)  # [W, 4] row of the matrix
        r3 = gl.expand_dims(r2, 2)
        cols1 = pid_c * TC + gl.arange(0, TC, layout=LC)
        c3 = gl.expand_dims(gl.expand_dims(cols1, 0), 1)  # [1, 1, TC]
        mask = (r3 < rows) & (c3 < cols)
        x = gl.load(x_ptr + b * stride_xb + r3.to(gl.int64) * stride_xr + c3, mask=mask, other=0.0).to(gl.float32)

        # in-thread (bytes), in-thread + lanes (words), then the columns: only [TC] -> scalar crosses warps
        amax_bits = gl.max(gl.max(gl.max(_abs_bits(x), axis=1), axis=0), axis=0)
        scale, scale_inv = _fp32_scales(amax_bits, FP8_MAX)
        codes = _fp8_codes(x * scale, FP8_MAX, IS_E4M3, False)  # uint8 [W, 4, TC]
        gl.store(q_ptr + b * rows * cols + r3.to(gl.int64) * cols + c3, codes, mask=mask)
        # the transposed words from a second cast whose scale passes through an opaque move: with the
        # forward copy's code values packed instead (also unpacking the forward bytes from the
        # words), the words come out wrong at columns 0, 1, 4, 5, ... of every 128 wherever the
        # forward stores vectorize (H200, Triton 3.6; ptxas merges the two casts again, so this
        # costs nothing)
        codes_t = _fp8_codes(x * _opaque(scale), FP8_MAX, IS_E4M3, False)
        shift = gl.expand_dims(gl.expand_dims(b_i * 8, 0), 2)
        words = gl.sum(codes_t.to(gl.int32) << shift, axis=1)  # [W, TC]: byte b = row 4 w + b
        words = gl.convert_layout(words, LST)
        w_s = pid_r * W + gl.arange(0, W, layout=gl.SliceLayout(1, LST))
        c_s = pid_c * TC + gl.arange(0, TC, layout=gl.SliceLayout(0, LST))
        rows4 = rows // 4
        qt_ptrs = (qt_ptr + b * rows4 * cols + gl.expand_dims(c_s.to(gl.int64) * rows4, 0)
                   + gl.expand_dims(w_s, 1))
        gl.store(qt_ptrs, words, mask=gl.expand_dims(w_s < rows4, 1) & gl.expand_dims(c_s < cols, 0))
        gl.store(s_ptr + b * n_sr * n_sc + pid_r * n_sc + pid_c, scale_inv)


def weight_copies_gluon(x: torch.Tensor, out_dtype: torch.dtype, config: Optional[GluonGatherQuantConfig] = None,
                        out: Optional[tuple] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [B, rows, cols], scale_inv [B, ceil(rows/128), ceil(cols/128)] fp32, qt [B, cols, rows])``,
    bit for bit ``fp8_quant_batched_launch(x, out_dtype, 128 x 128 BLOCKWISE, with_trans=True)``
    (:func:`weight_copies_gluon_reason` None). ``out``: contiguous ``(q, s, qt)`` to fill (tests
    pass poisoned ones)."""
    cfg = config or WEIGHT_COPIES_DEFAULT_CONFIG
    nb, rows, cols = x.shape
    n_sr, n_sc = -(-rows // _BLK), -(-cols // _BLK)
    if out is None:
        q = torch.empty((nb, rows, cols), dtype=out_dtype, device=x.device)
        s = torch.empty((nb, n_sr, n_sc), dtype=torch.float32, device=x.device)
        qt = torch.empty((nb, cols, rows), dtype=out_dtype, device=x.device)
    else:
        q, s, qt = out
    if q.numel() == 0:
        return q, s, qt
    l3, lst = _layouts(cfg)
    for b0 in range(0, nb, _MAX_GRID_Y):  # grid dim 1 limit; one launch for any realistic batch
        nbb = min(_MAX_GRID_Y, nb - b0)
        launch(_weight_copies_gluon_kernel, (n_sr * n_sc, nbb),
               (x[b0:], q[b0:].view(torch.uint8), qt[b0:].view(torch.uint8).view(torch.int32), s[b0:],
                rows, cols, n_sc, n_sr, n_sc, x.stride(0), x.stride(1)),
               dict(FP8_MAX=_FP8_MAX[out_dtype], IS_E4M3=out_dtype == torch.float8_e4m3fn,
                    L3=l3, LST=lst, num_warps=cfg.warps),
               x.device)
    return q, s, qt
