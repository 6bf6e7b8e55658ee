"""Hopper Gluon twin of ``gather_quant_kernel.py``: the padded-layout column copy of a grouped FP8
wgrad operand (gather rows, quantize in ``128 x 1`` token blocks, store transposed), with a layout
chosen so that no value crosses a warp.

Why: the ``triton.language`` kernel cannot pick its register layout. It loads the ``[128, TC]``
tile with warps stacked along the tokens, so every column's amax is a cross-warp reduction through
shared memory, and the transposed store is a second trip through shared memory (``tl.trans``); it
stays at 0.67-0.69x the device copy's bandwidth on the H200 whatever its tile. This kernel: 0.80-0.83x
(2026-12-02, scripts/diag_gather_quant.py, seven MoE wgrad operands).

Here the tile is a 3-D ``[32 words, 4 bytes, TC]`` view of the 128 token rows (token ``4 w + b``)
in one explicit layout: each thread holds ``4 SPW`` consecutive tokens of ``VEC`` consecutive
columns (one 16-byte load per token row for bf16 at ``VEC = 8``), the warp's lanes cover the 128
tokens of ``VEC * 32 / TW`` columns, the warps sit side by side along the columns. So

* a column's amax is an in-thread max over ``4 SPW`` tokens, then a butterfly over the ``TW``
  lanes along the tokens: no shared memory, no barrier;
* the four codes of tokens ``4 w .. 4 w + 3`` of a column are in one thread: packed into one
  little-endian 32-bit word by an in-thread sum of shifted bytes (disjoint bits, so the sum is the
  OR), the word tensor's registers renamed (a register permutation, no data movement:
  ``convert_layout`` between two layouts with the same lanes and warps) so that a thread's ``SPW``
  consecutive words of a column are register-consecutive, and stored as one ``4 SPW``-byte vector
  per column: a warp's store covers whole 128-byte rows of the transposed copy.

The codes are packed and nothing else reads them (forms that also store the codes elsewhere
miscompile on sm_90 with Triton 3.6: docs/design.md). The scale arithmetic and the cast are the tl
kernel's helpers (``_fp32_scales``, ``_fp8_codes``), so the bytes are identical; the GPU tests
compare the two kernels bit for bit.

Only 128-token blocks (the BLOCKWISE wgrad's); :func:`gather_quant_gluon_reason` says why a call
goes to the tl kernel instead.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, gluon_platform_reason
from primus_turbo.triton.launch import launch

from .gather_quant_kernel import _FP8_MAX

__all__ = ["GATHER_QUANT_GLUON_ENV", "GluonGatherQuantConfig", "gather_quant_cols_t_gluon",
           "gather_quant_gluon_reason", "gluon_gather_quant_config", "gluon_switch"]

GATHER_QUANT_GLUON_ENV = "PRIMUS_TURBO_GATHER_QUANT_GLUON"
_BS = 128  # token block (the only one this kernel takes)

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .quant_fp8_kernel import _abs_bits, _fp8_codes, _fp32_scales


class GluonGatherQuantConfig(NamedTuple):
    """``(spw, vec, warps)``: words (4 tokens each) per thread along the tokens, columns per thread,
    warps along the columns. Lanes: ``TW = 32 / spw`` along the tokens, ``32 / TW`` along the
    columns; a tile is ``128 x TC`` with ``TC = vec * (32 / TW) * warps``."""

    spw: int
    vec: int
    warps: int

    @property
    def tw(self) -> int:
        return (_BS // 4) // self.spw

    @property
    def tc(self) -> int:
        return self.vec * (32 // self.tw) * self.warps

    def reason(self) -> Optional[str]:
        if self.spw not in (1, 2, 4, 8) or self.vec not in (1, 2, 4, 8, 16) or self.warps not in (1, 2, 4, 8):
            return f"config {tuple(self)}: spw must be 1/2/4/8, vec 1/2/4/8/16, warps 1/2/4/8"
        return None


def gluon_gather_quant_config(C: int) -> GluonGatherQuantConfig:
    """Default launch: 16 tokens x 8 columns per thread (a 16-byte load per token row and a 16-byte
    store per column), 2 warps: 128 x 64 tiles. H200, 2026-12-02 (scripts/diag_gather_quant.py,
    seven MoE wgrad operands): 0.80-0.83x the device copy against 0.67-0.69x for the tl kernel;
    4 warps (128 x 128) 0.78-0.82, 8 tokens per thread 0.69-0.72, 32 tokens per thread 0.62-0.65."""
    return GluonGatherQuantConfig(4, 8, 2)


def gather_quant_gluon_reason(x: torch.Tensor, src: torch.Tensor, dtype, block_size: int,
                              config: Optional[GluonGatherQuantConfig] = None) -> Optional[str]:
    """None when the Gluon kernel takes this call (after ``gather_quant_cols_t_launch``'s own
    checks passed), else why not."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    reason = gluon_platform_reason(x.device)
    if reason is not None:
        return reason
    if block_size != _BS:
        return f"block_size={block_size}: the Gluon kernel takes 128-token blocks only"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"x dtype {x.dtype}"
    if dtype not in _FP8_MAX:
        return f"dtype {dtype}"
    esz = x.element_size()
    if x.data_ptr() % 16 or (x.size(0) > 1 and (x.stride(0) * esz) % 16):
        return "x's rows are not 16-byte aligned"
    cfg = config or gluon_gather_quant_config(x.size(1))
    return cfg.reason()


def gluon_switch(name: str) -> Optional[bool]:
    """The ``auto`` switch ``name`` of a Gluon copy kernel (True / False when set, None for auto)."""
    from primus_turbo.pytorch.core.env import env_auto_flag

    return env_auto_flag(name)


@functools.lru_cache(maxsize=None)
def _layouts(cfg: GluonGatherQuantConfig):
    """(L3, LST) of config ``cfg``: the ``[word, byte, column]`` tile layout (thread = spw words x 4
    bytes x vec columns, columns fastest; lanes tw along the words, 32 / tw along the columns;
    warps along the columns) and the packed words' layout: LST has L3's lanes and warps (so the
    conversion only renames registers) with each thread's spw words of a column register-consecutive."""
    spw, vec, nw, tw = cfg.spw, cfg.vec, cfg.warps, cfg.tw
    tcl = 32 // tw
    l3 = gl.BlockedLayout([spw, 4, vec], [tw, 1, tcl], [1, 1, nw], [2, 1, 0])

    def bits(n):
        return range(n.bit_length() - 1)

    reg = [[1 << i, 0] for i in bits(spw)] + [[0, 1 << i] for i in bits(vec)]
    lane = [[0, vec << i] for i in bits(tcl)] + [[spw << i, 0] for i in bits(tw)]
    warp = [[0, (vec * tcl) << i] for i in bits(nw)]
    lst = gl.DistributedLinearLayout(reg, lane, warp, [], [_BS // 4, cfg.tc])
    return l3, lst


if GLUON_AVAILABLE:

    @gluon.jit
    def _gather_quant_cols_t_gluon_kernel(
        x_ptr, src_ptr, q_ptr, s_ptr,
        C, M_PAD4, stride_x, n_tiles_c,
        FP8_MAX: gl.constexpr, IS_E4M3: gl.constexpr, EVEN_C: gl.constexpr,
        TC: gl.constexpr, L3: gl.constexpr, LST: gl.constexpr,
    ):
        W: gl.constexpr = 32  # 32-bit words of a 128-token block
        LWB: gl.constexpr = gl.SliceLayout(2, L3)  # [word, byte]
        LWC: gl.constexpr = gl.SliceLayout(1, L3)  # [word, column]: the packed words
        LC: gl.constexpr = gl.SliceLayout(0, LWC)  # [column]

        pid = gl.program_id(0)
        tb = pid // n_tiles_c  # token block of the padded layout
        pid_c = pid % n_tiles_c
        c0 = pid_c * TC

        w_i = gl.arange(0, W, layout=gl.SliceLayout(1, LWB))
        b_i = gl.arange(0, 4, layout=gl.SliceLayout(0, LWB))
        rows = tb * 128 + gl.expand_dims(w_i, 1) * 4 + gl.expand_dims(b_i, 0)  # [W, 4]
        src = gl.load(src_ptr + rows)
        keep3 = gl.expand_dims(src >= 0, 2)  # [W, 4, 1]
        row_off = gl.expand_dims(gl.maximum(src, 0).to(gl.int64) * stride_x, 2)
        cols = c0 + gl.arange(0, TC, layout=LC)
        cols3 = gl.expand_dims(gl.expand_dims(cols, 0), 1)  # [1, 1, TC]
        mask = keep3
        if not EVEN_C:
            mask = mask & (cols3 < C)
        x = gl.load(x_ptr + row_off + cols3, mask=mask, other=0.0).to(gl.float32)  # [W, 4, TC]

        amax_bits = gl.max(gl.max(_abs_bits(x), axis=1), axis=0)  # [TC]: in-thread, then lanes
        scale, scale_inv = _fp32_scales(amax_bits, FP8_MAX)
        scale3 = gl.expand_dims(gl.expand_dims(scale, 0), 1)
        codes = _fp8_codes(x * scale3, FP8_MAX, IS_E4M3, False).to(gl.int32)  # [W, 4, TC]
        shift = gl.expand_dims(gl.expand_dims(b_i * 8, 0), 2)
        words = gl.sum(codes << shift, axis=1)  # [W, TC] int32, byte b = token 4 w + b
        words = gl.convert_layout(words, LST)

        w_s = gl.arange(0, W, layout=gl.SliceLayout(1, LST))
        c_s = c0 + gl.arange(0, TC, layout=gl.SliceLayout(0, LST))
        q_ptrs = q_ptr + gl.expand_dims(c_s.to(gl.int64) * M_PAD4, 0) + (tb * W + gl.expand_dims(w_s, 1))
        s_ptrs = s_ptr + tb.to(gl.int64) * C + cols
        if EVEN_C:
            gl.store(q_ptrs, words)
            gl.store(s_ptrs, scale_inv)
        else:
            gl.store(q_ptrs, words, mask=gl.expand_dims(c_s < C, 0))
            gl.store(s_ptrs, scale_inv, mask=cols < C)


def gather_quant_cols_t_gluon(x: torch.Tensor, src: torch.Tensor, dtype: torch.dtype, q_t: torch.Tensor,
                              s: torch.Tensor, config: Optional[GluonGatherQuantConfig] = None) -> None:
    """Fill ``q_t [C, M_pad]`` (FP8) and ``s [M_pad / 128, C]`` (fp32) as
    ``gather_quant_cols_t_launch`` does (its checks done, :func:`gather_quant_gluon_reason` None)."""
    C, m_pad = x.size(1), src.numel()
    cfg = config or gluon_gather_quant_config(C)
    n_tiles_c = -(-C // cfg.tc)
    grid = ((m_pad // _BS) * n_tiles_c,)
    l3, lst = _layouts(cfg)
    launch(_gather_quant_cols_t_gluon_kernel, grid,
           (x, src, q_t.view(torch.int32), s, C, m_pad // 4, x.stride(0), n_tiles_c),
           dict(FP8_MAX=_FP8_MAX[dtype], IS_E4M3=dtype == torch.float8_e4m3fn, EVEN_C=C % cfg.tc == 0,
                TC=cfg.tc, L3=l3, LST=lst, num_warps=cfg.warps),
           x.device)
