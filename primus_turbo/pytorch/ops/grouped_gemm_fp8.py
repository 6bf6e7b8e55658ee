"""FP8 grouped GEMM of MoE experts: ``turbo.ops.grouped_gemm_fp8``.

Semantics as :func:`turbo.ops.grouped_gemm` (rows of ``a`` split into ``G`` consecutive groups by
``group_lens``; group ``g`` times expert ``g``'s weight ``op(b[g])``; rows past ``offs[G]`` zero),
with every operand quantized on the fly to FP8 and the GEMMs run on K-major FP8 operands
(docs/low_precision.md):

* output:      M-grouped FP8 GEMM of ``a`` (row-wise along K) with the weights quantized along K
  (``[G, N, K]``).
* grad_input:  M-grouped FP8 GEMM of ``dC`` (quantized along N with ``config.bwd_dtype()``, E5M2
  under HYBRID) with the weights quantized along N (``[G, K, N]``).
* grad_weight: variable-K grouped GEMM over each group's rows, in FP8 for every granularity.
  TENSORWISE / ROWWISE run it on the column-wise copies of ``dC`` and ``a`` (stored transposed
  ``[cols, M_total]``, one scale per column over all routed tokens for ROWWISE; one per tensor for
  TENSORWISE). BLOCKWISE quantizes along the tokens in 1 x ``block_size`` blocks **per group
  segment**, exactly as MX below (with ``block_size``-token blocks instead of 32): ``dC`` (E5M2
  under HYBRID) and ``a`` are gathered into the padded token layout (``padded_group_layout`` with
  ``align = block_size``: ``round_up(M_total + block_size G, block_size)`` rows), quantized along
  the tokens (fp32 scales ``[cols, M_pad/block_size]``) and reduced by the BLOCKWISE mode of the
  FP8 variable-K kernel, which promotes every K step into fp32 with the two operands' scales of
  that step's token block (as the M-grouped BLOCKWISE kernel does along K).
* MX_BLOCKWISE (OCP MXFP8: 1 x 32 blocks, E8M0 scales, each operand quantized along its GEMM's K;
  emulated exactly on Hopper's bf16 tensor cores, as the dense ``gemm_fp8``): forward along K,
  grad_input along N (the weights' dgrad copy is quantized along N per expert), and grad_weight in
  MXFP8 too, with **per-group-segment** 32-token blocks: ``dC`` and ``a`` are gathered on the
  device into a token layout whose group segments are padded with zero rows to multiples of 32
  (``padded_group_layout``: a static size ``M_total + 32 G`` rounded up, so no host sync and no
  condition on ``group_lens``), then quantized along the tokens. Zero rows change no block's amax,
  so every block is exactly the MX quantization of its group's tokens (a group's last block may
  be partial, as BLOCKWISE's partial tail blocks); the padding adds nothing to the GEMM. K must be
  a multiple of 32, and N too when grad_input is needed (``ValueError`` naming the dim).

Scales: activations and gradients TENSORWISE one scale over the whole tensor, ROWWISE one per token
row, BLOCKWISE 1 x ``block_size`` along K (a group segment is a row range, so no block straddles two
experts). Weights: TENSORWISE one scale per expert, ROWWISE one per expert row, BLOCKWISE
``block_size`` x ``block_size`` tiles per expert (the dgrad copy is the FP8 transpose with the
transposed tile scales; TENSORWISE likewise reuses its per-expert scale). All scales are computed
on the device by the quantization kernels: no host synchronisation anywhere.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..backends.grouped_gemm_fp8 import (
    gather_rows,
    grouped_gemm_fp8_dispatcher,
    grouped_gemm_fp8_variable_k_dispatcher,
    padded_group_layout,
)
from ..core.amp import autocast_dtype, gemm_under_autocast
from ..core.backend import GlobalBackendManager, PrecisionType
from ..core.env import env_auto_flag, env_raw
from ..core.low_precision import Float8QuantConfig, ScalingGranularity, ScalingRecipe
from .gemm import _flag_main_grad, _megatron_dummy_wgrad, check_main_grad
from ..core.quantized_tensor import QuantizedTensor, QuantizedTensorPair
from .gemm_fp8 import _check_prequantized_fp8, _grad_operand, _is_prequantized
from .grouped_gemm import _check_groups, _group_offsets, _remember, _tensor_key

__all__ = ["grouped_gemm_fp8", "grouped_gemm_fp8_cached_weight", "grouped_weight_copies"]

_HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SUPPORTED = ("TENSORWISE", "ROWWISE", "BLOCKWISE", "MX_BLOCKWISE")
_MX = "MX_BLOCKWISE"
_MX_BLOCK = 32
_G = ScalingGranularity


def _quantize_fp8(*args, **kwargs):
    from .quantization import quantize_fp8  # a sibling module: imported late

    return quantize_fp8(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Quantized copies (scales in the shapes the grouped FP8 kernels read)
# ----------------------------------------------------------------------------------------------
def _quant_rows(x: torch.Tensor, dtype, gran: str, bs: int):
    """``x [M, C]`` grouped along C: (q [M, C], scale [] / [M] / [M, ceil(C/bs)])."""
    if gran == "TENSORWISE":
        return _quantize_fp8(x, dtype, _G.TENSORWISE)
    if gran == "ROWWISE":
        q, s = _quantize_fp8(x, dtype, _G.ROWWISE, axis=-1)
        return q, s.reshape(x.shape[0])
    if gran == _MX:
        return _quantize_fp8(x, dtype, _G.MX_BLOCKWISE, axis=-1)  # s: [M, C/32] E8M0
    return _quantize_fp8(x, dtype, _G.BLOCKWISE, block_size=bs, axis=-1)


def _transpose_bytes(t: torch.Tensor, row_align: int = 1) -> torch.Tensor:
    """Transpose of the last two dims of a 1-byte tensor (FP8 / packed FP4 / E8M0), ``[R, C]`` or
    ``[G, R, C]``, by the byte-transpose kernel (torch's strided copy of it is far slower)."""
    from .quantization import _transpose_bytes as transpose  # a sibling module: imported late

    return transpose(t, row_align)


# ----------------------------------------------------------------------------------------------
# MX (MXFP8 and, shared with grouped_gemm_fp4, MXFP4): 1 x 32 blocks along each GEMM's K
# ----------------------------------------------------------------------------------------------
def _mx_weight_copies(b: torch.Tensor, trans_b: bool, quant, pack: int, need_fwd: bool, need_dgrad: bool):
    """(forward copy [G, N, K/pack] + [G, N, K/32], dgrad copy [G, K, N/pack] + [G, K, N/32]).

    ``quant(x2d, axis)`` quantizes a 2-D tensor in 1 x 32 blocks along ``axis`` (packing ``pack``
    values per byte along it). ``b`` is viewed as ``[G * R, C]``; blocks along R never straddle two
    experts because R (K or N) is a multiple of 32 whenever a copy along it is needed."""
    G, R, C = b.shape
    b2 = b.contiguous().reshape(G * R, C)

    def along_c():  # [G, R, C/pack], scales [G, R, C/32]
        q, s = quant(b2, -1)
        return q.view(G, R, C // pack), s.view(G, R, C // _MX_BLOCK)

    def along_r():  # [G, C, R/pack], scales [G, C, R/32]
        q, s = quant(b2, 0)
        return _transpose_bytes(q.view(G, R // pack, C)), _transpose_bytes(s.view(G, R // _MX_BLOCK, C))

    # trans_b: b is [G, N, K] (forward along C = K, dgrad along R = N); else [G, K, N] (the reverse)
    fwd = (along_c() if trans_b else along_r()) if need_fwd else None
    dgr = (along_r() if trans_b else along_c()) if need_dgrad else None
    return fwd, dgr


def _mx_token_copy(x: torch.Tensor, src: torch.Tensor, quant, pack: int, blockwise=None):
    """The column-wise copy of ``x [M_total, C]`` in the padded token layout ``src``, stored
    transposed: ``[C, M_pad/pack]`` + scales ``[C, M_pad/blk]`` (token blocks inside one group:
    32 for MX, E8M0 bytes; ``block_size`` for BLOCKWISE, fp32). BLOCKWISE scales stay a transposed
    view (unit stride along C): both variable-K kernels take any scale strides, then read a K
    block's scales for consecutive rows as one coalesced vector, and the Gluon kernel's
    column-scale layout needs no copy (``_column_major_padded``, C % 128 == 0).

    ``blockwise=(fp8 dtype, block_size)`` (BLOCKWISE): one fused gather + quantize + transposed
    store pass where the Triton kernels run (bit-identical; a third of the memory traffic of the
    three passes)."""
    if blockwise is not None and _gather_quant_runs(x):
        from primus_turbo.triton.quantization.gather_quant_kernel import gather_quant_cols_t_launch

        q_t, s = gather_quant_cols_t_launch(x, src, *blockwise)
        return q_t, s.t()
    q, s = quant(gather_rows(x, src), 0)  # [M_pad/pack, C], [M_pad/blk, C]
    return _transpose_bytes(q), (_transpose_bytes(s) if s.element_size() == 1 else s.t())


def _gather_quant_runs(x: torch.Tensor) -> bool:
    """The fused gather + quantize kernel can run on ``x`` (2-D, unit column stride, Triton, eager)."""
    if torch.compiler.is_compiling() or x.dim() != 2 or (x.size(1) > 1 and x.stride(1) != 1):
        return False
    from primus_turbo.pytorch.ops.moe_permute import permute_backend

    return permute_backend(x) == "triton"


def _quant_fp8_mx(dtype):
    return lambda x, axis: _quantize_fp8(x, dtype, _G.MX_BLOCKWISE, axis=axis)


def _token_quant(gran: str, dtype, bs: int):
    """(token block, quantizer) of the padded-layout wgrad copies: MX 32, BLOCKWISE ``bs`` (fp32 scales)."""
    if gran == _MX:
        return _MX_BLOCK, _quant_fp8_mx(dtype)
    return bs, lambda x, axis: _quantize_fp8(x, dtype, _G.BLOCKWISE, block_size=bs, axis=axis)


def _quant_cols_t(x: torch.Tensor, dtype, gran: str, row_copy=None):
    """The column-wise copy of ``x [M, C]`` stored transposed: (q [C, M], scale [] / [C]).

    q's rows start at multiples of 16 bytes (a row stride rounded up to 16): the variable-K kernel
    reads each group's tokens from arbitrary offsets and vectorizes only with a 16-divisible stride."""
    if gran == "TENSORWISE":
        q, s = row_copy if row_copy is not None else _quantize_fp8(x, dtype, _G.TENSORWISE)
        return _transpose_bytes(q, 16), s
    q, s = _quantize_fp8(x, dtype, _G.ROWWISE, axis=0)  # s: [1, C]
    return _transpose_bytes(q, 16), s.reshape(x.shape[1])


def _quant_weight(w: torch.Tensor, dtype, gran: str, bs: int):
    """``w [G, R, C]`` grouped along C per expert: (q [G, R, C], scale [G] / [G, R] / [G, R/bs, C/bs])."""
    G, R, C = w.shape
    w = w.contiguous()
    if gran == "TENSORWISE":  # one scale per expert: a row-wise quantization of [G, R*C]
        q, s = _quantize_fp8(w.reshape(G, R * C), dtype, _G.ROWWISE, axis=-1)
        return q.view(G, R, C), s.reshape(G)
    if gran == "ROWWISE":
        q, s = _quantize_fp8(w.reshape(G * R, C), dtype, _G.ROWWISE, axis=-1)
        return q.view(G, R, C), s.reshape(G, R)
    recipe = ScalingRecipe(use_2d_block=True)
    if R % bs == 0:
        # the bs x bs tiles of [G * R, C] never straddle two experts: one launch, the same blocks
        # (and bytes) as quantizing each expert alone
        q, s = _quantize_fp8(w.reshape(G * R, C), dtype, _G.BLOCKWISE, block_size=bs, axis=-1,
                             scaling_recipe=recipe)
        return q.view(G, R, C), s.view(G, R // bs, s.shape[-1])
    # the last bs x bs block row of each expert covers R % bs rows: one batched launch over the
    # experts, the same blocks (and bytes) as quantizing each expert alone (the reference
    # backend, without Triton, loops over the experts)
    from .quantization import _quantize_fp8_blocks_batched  # a sibling module: imported late

    return _quantize_fp8_blocks_batched(w, dtype, bs)


def _weight_one_read(w_nk: torch.Tensor, bs: int) -> bool:
    """Form the BLOCKWISE forward and grad_input copies of ``w_nk [G, N, K]`` in one launch?
    Where the kernel can (128 x 128 blocks, N % 4 == 0: the kernel module's ``batched_trans_ok``)
    and PRIMUS_TURBO_FP8_WEIGHT_ONE_READ (docs/env_vars.md) does not say no (auto: yes)."""
    return bs == 128 and w_nk.shape[1] % 4 == 0 and env_auto_flag("PRIMUS_TURBO_FP8_WEIGHT_ONE_READ") is not False


def _weight_copies(b: torch.Tensor, trans_b: bool, dtype, gran: str, bs: int, need_fwd: bool, need_dgrad: bool):
    """(forward copy [G, N, K], dgrad copy [G, K, N]) as (q, scale) pairs, None where not needed."""
    if gran == _MX:
        return _mx_weight_copies(b, trans_b, _quant_fp8_mx(dtype), 1, need_fwd, need_dgrad)
    w_nk = b if trans_b else b.transpose(1, 2)  # [G, N, K] view
    if gran == "ROWWISE":  # each orientation has its own row scales
        fwd = _quant_weight(w_nk, dtype, gran, bs) if need_fwd else None
        dgr = _quant_weight(w_nk.transpose(1, 2), dtype, gran, bs) if need_dgrad else None
        return fwd, dgr
    # TENSORWISE / BLOCKWISE (bs x bs tiles): one quantization serves both orientations
    if gran == "BLOCKWISE" and need_dgrad and _weight_one_read(w_nk, bs):
        # both copies in one launch: 4 bytes per weight element from DRAM against 5 for
        # quantize-then-transpose, one launch fewer (H200, Mixtral experts: ~0.96x the time)
        from .quantization import _quantize_fp8_blocks_batched_t  # a sibling module: imported late

        q, s, qt = _quantize_fp8_blocks_batched_t(w_nk, dtype, bs)
        return ((q, s) if need_fwd else None), (qt, s.transpose(1, 2))
    q, s = _quant_weight(w_nk, dtype, gran, bs)
    dgr = None
    if need_dgrad:
        dgr = (_transpose_bytes(q), s if gran == "TENSORWISE" else s.transpose(1, 2))
    return ((q, s) if need_fwd else None), dgr


def _mm_eager(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor, gran: str,
              group_lens: torch.Tensor, group_offs: torch.Tensor, out_dtype: torch.dtype, bs: int,
              num_cu: Optional[int]) -> torch.Tensor:
    """M-grouped: ``out[rows of g] = (a_q * a_scale)[rows of g] @ (b_q[g] * b_scale[g]).T``, ``b_q [G, N', K']``."""
    kw = dict(a_q=a_q, a_scale=a_scale, b_q=b_q, b_scale=b_scale, mode=gran, group_lens=group_lens,
              group_offs=group_offs, out_dtype=out_dtype, block_size=bs, num_cu=num_cu)
    return _dispatch(grouped_gemm_fp8_dispatcher, _MM_ENVS, kw)


def _vk_fp8_eager(x_t: torch.Tensor, x_scale: torch.Tensor, y_t: torch.Tensor, y_scale: torch.Tensor, gran: str,
                  group_lens: torch.Tensor, group_offs: torch.Tensor, out_dtype: torch.dtype, num_cu: Optional[int],
                  bs: int, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Variable K: ``out[g] = x_t[:, rows of g] @ y_t[:, rows of g].T`` (``[G, P, Q]``), added into
    ``out`` when given."""
    kw = dict(x_t=x_t, x_scale=x_scale, y_t=y_t, y_scale=y_scale, mode=gran, group_lens=group_lens,
              group_offs=group_offs, out=out, accumulate=out is not None, out_dtype=out_dtype, num_cu=num_cu,
              block_size=bs)
    return _dispatch(grouped_gemm_fp8_variable_k_dispatcher, _VK_ENVS, kw)


# Under torch.compile the FP8 grouped GEMMs are custom ops with shape-only fakes (the launches read
# data pointers and host-side caches a graph cannot trace); eager calls skip the custom-op dispatch.
grouped_gemm_fp8_impl = torch.library.custom_op("primus_turbo::grouped_gemm_fp8_impl", _mm_eager, mutates_args=())


@grouped_gemm_fp8_impl.register_fake
def _grouped_gemm_fp8_impl_fake(a_q, a_scale, b_q, b_scale, gran, group_lens, group_offs, out_dtype, bs, num_cu):
    return a_q.new_empty((a_q.size(0), b_q.size(1)), dtype=out_dtype)


def _vk_fp8_new(x_t: torch.Tensor, x_scale: torch.Tensor, y_t: torch.Tensor, y_scale: torch.Tensor, gran: str,
                group_lens: torch.Tensor, group_offs: torch.Tensor, out_dtype: torch.dtype, num_cu: Optional[int],
                bs: int) -> torch.Tensor:
    return _vk_fp8_eager(x_t, x_scale, y_t, y_scale, gran, group_lens, group_offs, out_dtype, num_cu, bs)


grouped_gemm_fp8_variable_k_impl = torch.library.custom_op("primus_turbo::grouped_gemm_fp8_variable_k_impl",
                                                           _vk_fp8_new, mutates_args=())


@grouped_gemm_fp8_variable_k_impl.register_fake
def _grouped_gemm_fp8_variable_k_impl_fake(x_t, x_scale, y_t, y_scale, gran, group_lens, group_offs, out_dtype,
                                           num_cu, bs):
    return x_t.new_empty((group_offs.numel() - 1, x_t.size(0), y_t.size(0)), dtype=out_dtype)


def _vk_fp8_accum(x_t: torch.Tensor, x_scale: torch.Tensor, y_t: torch.Tensor, y_scale: torch.Tensor, gran: str,
                  group_lens: torch.Tensor, group_offs: torch.Tensor, num_cu: Optional[int], bs: int,
                  out: torch.Tensor) -> None:
    _vk_fp8_eager(x_t, x_scale, y_t, y_scale, gran, group_lens, group_offs, out.dtype, num_cu, bs, out)


grouped_gemm_fp8_variable_k_accum_impl = torch.library.custom_op(
    "primus_turbo::grouped_gemm_fp8_variable_k_accum_impl", _vk_fp8_accum, mutates_args=("out",))


@grouped_gemm_fp8_variable_k_accum_impl.register_fake
def _grouped_gemm_fp8_variable_k_accum_impl_fake(x_t, x_scale, y_t, y_scale, gran, group_lens, group_offs, num_cu,
                                                 bs, out):
    return None


def _mm(A, B, gran, group_lens, group_offs, out_dtype, bs, num_cu):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.grouped_gemm_fp8_impl(A[0], A[1], B[0], B[1], gran, group_lens, group_offs,
                                                            out_dtype, bs, num_cu)
    return _mm_eager(A[0], A[1], B[0], B[1], gran, group_lens, group_offs, out_dtype, bs, num_cu)


def _vk_fp8(X, Y, gran, group_lens, group_offs, out_dtype, num_cu, out=None, bs=128):
    if not torch.compiler.is_compiling():
        return _vk_fp8_eager(X[0], X[1], Y[0], Y[1], gran, group_lens, group_offs, out_dtype, num_cu, bs, out)
    if out is None:
        return torch.ops.primus_turbo.grouped_gemm_fp8_variable_k_impl(X[0], X[1], Y[0], Y[1], gran, group_lens,
                                                                       group_offs, out_dtype, num_cu, bs)
    torch.ops.primus_turbo.grouped_gemm_fp8_variable_k_accum_impl(X[0], X[1], Y[0], Y[1], gran, group_lens,
                                                                  group_offs, num_cu, bs, out)
    return out


def _dispatch(dispatcher, envs: tuple, kw: dict):
    """``dispatcher.dispatch(FP8, **kw)`` through :func:`_resolved` (every FP8 grouped GEMM of the op
    goes through here)."""
    return _resolved(dispatcher, envs, kw).execute(**kw)


_DEFAULTS: dict = {}  # _resolved's cache
# the switches the two dispatchers' defaults and their backends' checks read
_MM_ENVS = ("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON", "PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED", "TRITON_INTERPRET")
_VK_ENVS = ("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_WGRAD", "TRITON_INTERPRET")


def _resolved(dispatcher, envs: tuple, kw: dict):
    """``dispatcher``'s backend for the arguments ``kw`` (the M-grouped or the variable-K FP8 one):
    its own resolution under a pin or autotuning; the default's answer cached per call signature
    otherwise, keyed by what the default and the backends' checks read (the settings version, the
    switches ``envs``, every tensor argument's shape, strides, dtype, device and 16-byte alignment,
    the other arguments' values). The default's checks (the Gluon kernels' operand and platform
    reasons, then the TRITON or vendor backend's) cost tens of microseconds of host a call, as
    much as a small expert GEMM's device time; a repeat call goes straight to the backend, whose
    M-grouped Gluon launchers keep their launch per flat signature (``grouped_gemm_fp8_gluon._FAST``)."""
    backend, _source, tune = dispatcher.plan(PrecisionType.FP8)
    if backend is not None or tune or torch.compiler.is_compiling():  # (traced: no data pointers)
        return dispatcher.resolve(PrecisionType.FP8, **kw)
    try:
        key = (dispatcher.op_name, GlobalBackendManager._version, *map(env_raw, envs),
               *[_tensor_key(v) if isinstance(v, torch.Tensor) else v for v in kw.values()])
        impl = _DEFAULTS.get(key)
    except (AttributeError, TypeError, RuntimeError):  # unhashable or stride-less arguments
        return dispatcher.resolve(PrecisionType.FP8, **kw)
    if impl is None:
        impl = _remember(_DEFAULTS, key, dispatcher.resolve(PrecisionType.FP8, **kw))
    return impl


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------
class GroupedGemmFP8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_lens, group_offs, trans_b, out_dtype, gran, fwd_dtype, bwd_dtype, bs, num_cu,
                fuse_accum, w_copies=None, a_row=None):
        """``a`` / ``b``: tensors or ``QuantizedTensor`` s (their dtype is the original one); ``w_copies``
        the weight's FP8 copies when made already (a cache or a pre-quantized ``b``), ``a_row`` the
        forward copy of a pre-quantized ``a`` (whose column-wise copy, for ``b``'s gradient, does
        not exist: the caller refuses that case)."""
        need_ga, need_gb = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.trans_b, ctx.gran, ctx.bwd_dtype, ctx.bs, ctx.num_cu = trans_b, gran, bwd_dtype, bs, num_cu
        ctx.fuse_accum, ctx.a_dtype, ctx.b_dtype = fuse_accum, a.dtype, b.dtype
        if a_row is None:
            a_row = _quant_rows(a, fwd_dtype, gran, bs)
        elif need_gb:
            raise RuntimeError("grouped_gemm_fp8: b's gradient needs a's column-wise copy, which a pre-quantized a "
                               "lacks")
        if w_copies is None:
            w_fwd, w_dgrad = _weight_copies(b, trans_b, fwd_dtype, gran, bs, True, need_ga)
        else:  # the weight's copies quantized earlier (GroupedLinear's micro-batch cache)
            w_fwd, w_dgrad = w_copies
            if need_ga and w_dgrad is None:
                raise RuntimeError("grouped_gemm_fp8: the cached weight copies lack the grad_input copy")
        out = _mm(a_row, w_fwd, gran, group_lens, group_offs, out_dtype, bs, num_cu)
        saved_w = w_dgrad if need_ga else (None, None)
        src = poffs = None
        if need_gb and gran in (_MX, "BLOCKWISE"):
            # per-group-segment token blocks (MX 32, BLOCKWISE bs): the padded token layout
            blk, quant = _token_quant(gran, fwd_dtype, bs)
            src, poffs = padded_group_layout(group_offs, a.size(0), blk)
            saved_a = _mx_token_copy(a, src, quant, 1, (fwd_dtype, bs) if gran == "BLOCKWISE" else None)
        elif need_gb:
            saved_a = _quant_cols_t(a, fwd_dtype, gran, a_row)
        else:
            saved_a = (None, None)
        ctx.save_for_backward(*saved_w, *saved_a, group_lens, group_offs, src, poffs,
                              b if (fuse_accum and need_gb) else None)
        return out  # (b.grad_added_to_main_grad: set by _run)

    @staticmethod
    def backward(ctx, grad_out):
        wq, ws, aq_t, as_t, group_lens, group_offs, src, poffs, b = ctx.saved_tensors
        gran, bs, num_cu = ctx.gran, ctx.bs, ctx.num_cu
        grad_out = grad_out.contiguous()
        grad_a = grad_b = None
        dy_row = None
        if ctx.needs_input_grad[0]:
            dy_row = _quant_rows(grad_out, ctx.bwd_dtype, gran, bs)
            # dA[rows of g] = dC[rows of g] @ op(b[g]).T; rows past offs[G] come back zero
            grad_a = _mm(dy_row, (wq, ws), gran, group_lens, group_offs, ctx.a_dtype, bs, num_cu)
        if ctx.needs_input_grad[1]:
            fuse = ctx.fuse_accum
            if gran in (_MX, "BLOCKWISE"):  # on the padded token layout of forward (offsets poffs)
                dy_col = _mx_token_copy(grad_out, src, _token_quant(gran, ctx.bwd_dtype, bs)[1], 1,
                                        (ctx.bwd_dtype, bs) if gran == "BLOCKWISE" else None)
                A = (aq_t, as_t)
                X, Y = (dy_col, A) if ctx.trans_b else (A, dy_col)
                if fuse:
                    _vk_fp8(X, Y, gran, group_lens, poffs, b.main_grad.dtype, num_cu, out=b.main_grad, bs=bs)
                else:
                    grad_b = _vk_fp8(X, Y, gran, group_lens, poffs, ctx.b_dtype, num_cu, bs=bs)
            else:
                tw_row = dy_row if (gran == "TENSORWISE" and dy_row is not None) else None
                dy_col = _quant_cols_t(grad_out, ctx.bwd_dtype, gran, tw_row)
                A = (aq_t, as_t)
                X, Y = (dy_col, A) if ctx.trans_b else (A, dy_col)
                if fuse:
                    _vk_fp8(X, Y, gran, group_lens, group_offs, b.main_grad.dtype, num_cu, out=b.main_grad)
                else:
                    grad_b = _vk_fp8(X, Y, gran, group_lens, group_offs, ctx.b_dtype, num_cu)
            if fuse:  # (b.grad_added_to_main_grad was set with the forward, by _run)
                grad_b = _megatron_dummy_wgrad(b)
        return grad_a, grad_b, None, None, None, None, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _check_mx_dims(op: str, a, b, trans_b: bool) -> None:
    """MX quantizes each GEMM's K in blocks of 32: K (forward), N (grad_input). The tokens (the
    grad_weight K) need nothing: their blocks are per group segment in a padded layout."""
    m, k = a.shape
    n = b.size(1) if trans_b else b.size(2)
    if m * n * k * b.size(0) == 0:  # nothing is quantized
        return
    grads = torch.is_grad_enabled()
    for dim, name, needed in ((k, "K", True), (n, "N", grads and a.requires_grad)):
        if needed and dim % _MX_BLOCK:
            raise ValueError(f"{op}: MX needs {name} to be a multiple of 32, got {name}={dim} (a{tuple(a.shape)}, "
                             f"b{tuple(b.shape)}, trans_b={trans_b})")


def _check_inputs(a, b, group_lens, group_offs, trans_b, out_dtype, config, num_cu, fuse_bgrad_accum_pattern):
    """Raise on bad arguments. ``a`` / ``b`` may be pre-quantized (a ``QuantizedTensor`` /
    ``QuantizedTensorPair``): their FP8 data stands in for the shape and device checks here; their
    format is checked by :func:`_prequantized_rows` / :func:`_prequantized_weight`."""
    op = "grouped_gemm_fp8"
    hp = {}
    for name, t, nd in (("a", a, 2), ("b", b, 3)):
        if _is_prequantized(t):
            if name == "a" and not isinstance(t, QuantizedTensor):
                raise TypeError(f"{op}: a pre-quantized a must be a QuantizedTensor (a QuantizedTensorPair is for b)")
            if isinstance(t, QuantizedTensorPair) and not isinstance(t.data, QuantizedTensor):
                raise TypeError(f"{op}: b is a QuantizedTensorPair whose data is {type(t.data).__name__}, "
                                f"not a QuantizedTensor")
            _check_prequantized_fp8(t, name, op)
            data = _grad_operand(t).data
            if data.dim() != nd:
                raise ValueError(f"{op}: a pre-quantized {name} must hold {nd}-D data, got shape {tuple(data.shape)}")
            # the QuantizedTensor (shaped like its data, FP8) stands for the operand from here on:
            # its requires_grad and main_grad are the ones the gradient checks below read
            if name == "a":
                a = t
            else:
                if not trans_b:
                    raise ValueError(f"{op}: a pre-quantized b must be the [G, N, K] expert stack (trans_b=True)")
                b = _grad_operand(t)
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor or a QuantizedTensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise ValueError(f"{op}: {name} must be {nd}-D, got shape {tuple(t.shape)}")
        if t.dtype not in _HP_DTYPES:
            raise TypeError(f"{op}: {name}.dtype must be float32, float16 or bfloat16 (quantized on the fly; "
                            f"FP8 data goes in a QuantizedTensor), got {t.dtype}")
        hp[name] = t.dtype
    if len(hp) == 2 and a.dtype != b.dtype:
        raise TypeError(f"{op}: a and b must have the same dtype, got a={a.dtype}, b={b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{op}: a and b must be on the same device, got a on {a.device}, b on {b.device}")
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"{op}: config must be a Float8QuantConfig or None, got {type(config).__name__}")
    gran = config.granularity.name
    if gran not in _SUPPORTED:
        raise ValueError(f"{op}: granularity {gran} is not supported (supported: {', '.join(_SUPPORTED)})")
    if out_dtype is not None and out_dtype not in _HP_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float32, float16, bfloat16 or None, got {out_dtype}")
    k_b = b.size(2) if trans_b else b.size(1)
    if a.size(1) != k_b:
        raise ValueError(f"{op}: K mismatch, a{tuple(a.shape)} has K={a.size(1)}, b{tuple(b.shape)} with "
                         f"trans_b={trans_b} has K={k_b}")
    if gran == _MX:
        _check_mx_dims(op, a, b, trans_b)
    if gran == "BLOCKWISE" and config.block_size < 32:
        # a K step of the kernels stays inside one scale block, and an FP8 MMA step on sm_90 is 32 deep
        raise ValueError(f"{op}: BLOCKWISE needs block_size >= 32, got {config.block_size}")
    _check_groups(op, a, b, group_lens, group_offs, num_cu, fuse_bgrad_accum_pattern)


def grouped_gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    group_offs: Optional[torch.Tensor] = None,
    trans_b: bool = True,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[Float8QuantConfig] = None,
    num_cu: Optional[int] = None,
    fuse_bgrad_accum_pattern: Optional[str] = None,
) -> torch.Tensor:
    """FP8 grouped GEMM of MoE experts with autograd, without host synchronisation.

    Args:
        a: ``[M_total, K]`` tokens sorted by expert (bf16/fp16/fp32, quantized on the fly);
            ``M_total >= sum(group_lens)``, the extra rows' outputs (and gradients) are zero. Under
            TENSORWISE the activation scale covers all of ``a``, extra rows included.
        b: ``[G, N, K]`` expert weights with ``trans_b=True`` (the default, ``nn.Linear`` layout),
            or ``[G, K, N]``; same dtype and device.
        group_lens: ``[G]`` int64 on ``a``'s device (zero allowed); ``group_offs`` its ``[G+1]``
            exclusive prefix sum, computed on the device when None.
        out_dtype: dtype of the output (default ``a.dtype``); gradients come back in the inputs' dtypes.
        config: :class:`Float8QuantConfig` (default TENSORWISE E4M3): E4M3, E5M2 or HYBRID (E4M3
            forward operands, E5M2 output gradient); TENSORWISE, ROWWISE, BLOCKWISE
            (``block_size``, 128 by default) or MX_BLOCKWISE (1 x 32 E8M0 blocks, emulated exactly;
            K, and N when grad_input is needed, multiples of 32).
        num_cu: cap on the persistent programs (SMs) of the kernels.
        fuse_bgrad_accum_pattern: ``None`` or ``"megatron"``: the weight gradient is added into
            ``b.main_grad`` (fp32 or ``b.dtype``) in the kernel epilogue and a placeholder is returned.

    Pre-quantized operands: ``b`` may be a ``QuantizedTensorPair`` / ``QuantizedTensor`` of the
    ``[G, N, K]`` expert stack (``create_quantized_weight(w, dtype, config,
    need_weight_transpose_cache=...)``, with ``trans_b=True``) and ``a`` a ``QuantizedTensor`` of
    ``[M_total, K]`` quantized along K (``QuantizedTensor.quantize(x, dtype, granularity, axis=-1,
    block_size=...)``, optionally ``group_lens=`` to make it a grouped tensor, whose group offsets
    the call then reuses), in ``config``'s granularity, block size and forward dtype. A pre-quantized
    operand that requires grad gets its gradient in its original dtype (a pair's ``data`` does;
    fused accumulation reads ``main_grad`` off it); ``a``'s gradient needs ``b``'s transposed copy
    for ROWWISE / MX; a pre-quantized ``a`` cannot feed a gradient of ``b`` (that needs the
    high-precision tokens), which raises ValueError.

    Forward, grad_input and grad_weight run in FP8 (BLOCKWISE and MX grad_weight on a token layout
    padded per group to whole token blocks: see the module docstring). Backends: TRITON (persistent
    kernels with a device-side group schedule; CPU through the Triton interpreter; the default
    except below) and TORCH (``torch._scaled_grouped_mm``, sm_90: the forward/grad_input default for
    TENSORWISE / ROWWISE with E4M3 operands and bf16 output; the wgrad by pin or autotune) and GLUON
    (sm_90 warp-specialized kernels: the default for the BLOCKWISE forward, E4M3 grad_input and
    grad_weight, ``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON=0`` / ``..._GLUON_WGRAD=0`` turn them off;
    TENSORWISE / ROWWISE with ``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED=1``).
    """
    if isinstance(a, torch.Tensor) and (amp := autocast_dtype(a)) is not None:  # core/amp.py
        return gemm_under_autocast(grouped_gemm_fp8, amp, a, b, group_lens, group_offs, trans_b, out_dtype, config,
                                   num_cu, fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
    config = Float8QuantConfig() if config is None else config
    _check_inputs(a, b, group_lens, group_offs, trans_b, out_dtype, config, num_cu, fuse_bgrad_accum_pattern)
    if isinstance(a, QuantizedTensor) and a.is_grouped_tensor:
        group_offs = _grouped_a_offsets(a, group_lens, group_offs)
    if _is_prequantized(a) or _is_prequantized(b):
        return _run_prequantized(a, b, group_lens, group_offs, trans_b, out_dtype, config, num_cu,
                                 fuse_bgrad_accum_pattern)
    return _run(a, b, group_lens, group_offs, trans_b, out_dtype, config, num_cu, fuse_bgrad_accum_pattern, None)


# ----------------------------------------------------------------------------------------------
# Pre-quantized operands
# ----------------------------------------------------------------------------------------------
def _check_fp8(op: str, name: str, qt, gran: str, bs: int, dtype) -> None:
    if qt.granularity.name != gran:
        raise ValueError(f"{op}: {name} was quantized {qt.granularity.name}, config says {gran}")
    want_bs = bs if gran == "BLOCKWISE" else (_MX_BLOCK if gran == _MX else None)
    if want_bs is not None and (qt.block_size or 128) != want_bs:
        raise ValueError(f"{op}: {name} was quantized with block_size={qt.block_size}, config says {want_bs}")
    if qt.data.dtype != dtype:
        raise ValueError(f"{op}: {name} holds {qt.data.dtype} data, config's forward operands are {dtype}")


def _scale_as(op: str, name: str, s: torch.Tensor, shape: tuple, mx: bool) -> torch.Tensor:
    """``s`` in ``shape`` (a size-1 scale broadcast per expert where ``shape`` is ``(G,)``)."""
    want = torch.float8_e8m0fnu if mx else torch.float32
    if s.dtype != want:
        raise ValueError(f"{op}: {name}'s scale_inv must be {want}, got {s.dtype}")
    if s.numel() == 1 and len(shape) == 1:
        return s.reshape(1).expand(shape).contiguous()
    if s.numel() != math.prod(shape) or (s.dim() == len(shape) and tuple(s.shape) != shape):
        raise ValueError(f"{op}: {name}'s scale_inv must be {list(shape)}, got {list(s.shape)}")
    return s if s.dim() == len(shape) else s.reshape(shape)


def _weight_scale_shape(gran: str, G: int, R: int, C: int, bs: int) -> tuple:
    """Scale shape of a ``[G, R, C]`` expert copy grouped along C (see create_quantized_weight)."""
    if gran == "TENSORWISE":
        return (G,)
    if gran == "ROWWISE":
        return (G, R)
    if gran == _MX:
        return (G, R, C // _MX_BLOCK)
    return (G, -(-R // bs), -(-C // bs))


def _prequantized_weight(b, gran: str, bs: int, dtype, need_dgrad: bool):
    """(forward copy, grad_input copy or None) of a pre-quantized ``[G, N, K]`` weight
    (``create_quantized_weight`` of the expert stack): checked, in the kernels' layouts."""
    op = "grouped_gemm_fp8"
    qt, qt_t = (b.data, b.data_t) if type(b).__name__ == "QuantizedTensorPair" else (b, None)
    _check_fp8(op, "b", qt, gran, bs, dtype)
    G, N, K = qt.data.shape
    fwd = (qt.data, _scale_as(op, "b", qt.scale_inv, _weight_scale_shape(gran, G, N, K, bs), gran == _MX))
    dgr = None
    if need_dgrad:
        if qt_t is not None:
            _check_fp8(op, "b.data_t", qt_t, gran, bs, dtype)
            if tuple(qt_t.data.shape) != (G, K, N):
                raise ValueError(f"{op}: b.data_t must be [G, K, N] = {[G, K, N]}, got {list(qt_t.data.shape)}")
            shape_t = _weight_scale_shape(gran, G, K, N, bs)
            dgr = (qt_t.data, _scale_as(op, "b.data_t", qt_t.scale_inv, shape_t, gran == _MX))
        elif gran in ("TENSORWISE", "BLOCKWISE"):  # one grid of scales serves both orientations
            dgr = (_transpose_bytes(fwd[0]), fwd[1] if gran == "TENSORWISE" else fwd[1].transpose(1, 2))
        else:
            raise ValueError(f"{op}: the grad_input of a needs b's transposed copy, which {gran} cannot take from "
                             f"the forward copy; pass create_quantized_weight(..., need_weight_transpose_cache=True)")
    return fwd, dgr


def _prequantized_rows(a, gran: str, bs: int, dtype):
    """The forward copy of a pre-quantized ``[M, K]`` activation (groups along K), checked."""
    op = "grouped_gemm_fp8"
    _check_fp8(op, "a", a, gran, bs, dtype)
    if a.axis not in (-1, 1) and gran != "TENSORWISE":
        raise ValueError(f"{op}: a must be quantized along its last dim (axis=-1), got axis={a.axis}")
    M, K = a.data.shape
    shape = {"TENSORWISE": (), "ROWWISE": (M,), _MX: (M, K // _MX_BLOCK)}.get(gran, (M, -(-K // bs)))
    s = a.scale_inv
    if gran == "TENSORWISE":
        if s.numel() != 1 or s.dtype != torch.float32:
            raise ValueError(f"{op}: a's TENSORWISE scale_inv must be one float32 value, got {s.dtype} "
                             f"{list(s.shape)}")
        return a.data, s
    return a.data, _scale_as(op, "a", s, shape, gran == _MX)


def _grouped_a_offsets(a, group_lens: torch.Tensor, group_offs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A grouped ``a`` (``QuantizedTensor.quantize(..., group_lens=...)``) brings its group offsets, so none
    are computed again; its group count must match ``group_lens`` (the values too, on CPU, where
    checking costs no sync). ``group_offs`` given to the call wins."""
    op = "grouped_gemm_fp8"
    if a.group_lens.numel() != group_lens.numel():
        raise ValueError(f"{op}: a is a grouped tensor of {a.group_lens.numel()} groups, group_lens has "
                         f"{group_lens.numel()}")
    if a.device.type == "cpu" and group_lens.numel() and not torch.compiler.is_compiling():
        torch._assert_async(torch.all(a.group_lens.long() == group_lens.long()),
                            f"{op}: a's group_lens differ from the group_lens argument")
    return a.group_offs if group_offs is None else group_offs


def _run_prequantized(a, b, group_lens, group_offs, trans_b, out_dtype, config, num_cu, fuse_bgrad_accum_pattern):
    """grouped_gemm_fp8 with a pre-quantized ``a`` and / or ``b``. Each operand that requires a
    gradient gets one (a ``QuantizedTensor``'s in its original dtype), except ``b``'s when ``a`` is
    pre-quantized: that gradient needs the tokens' column-wise copy, which the high-precision ``a``
    gives and a quantized one does not."""
    gran, bs, dtype = config.granularity.name, int(config.block_size or 128), config.fwd_dtype()
    a_pre, b_pre = _is_prequantized(a), _is_prequantized(b)  # b pre-quantized: trans_b checked already
    bt = _grad_operand(b)  # the tensor autograd tracks for b (a pair's data)
    grad = torch.is_grad_enabled()
    a_grad, b_grad = grad and a.requires_grad, grad and bt.requires_grad
    if a_pre and b_grad:
        raise ValueError("grouped_gemm_fp8: b's gradient needs the high-precision a (its column-wise copy over the "
                         "tokens); pass a as a tensor, or b without requires_grad (b.detach() / torch.no_grad())")
    out_dtype = out_dtype or a.dtype  # a QuantizedTensor's dtype is its original one
    copies = None
    if b_pre:
        copies = _prequantized_weight(b, gran, bs, dtype, a_grad)
        G, N = copies[0][0].shape[:2]
    else:
        G, N = b.size(0), (b.size(1) if trans_b else b.size(2))
    M, K = a.shape
    if M == 0 or N == 0 or K == 0 or G == 0:
        out = torch.zeros((M, N), dtype=out_dtype, device=a.device)
        for t, needed in ((a, a_grad), (bt, b_grad)):
            if needed:  # zero gradients of the right shapes (a QuantizedTensor's .to() dequantizes)
                out = out + t.to(out_dtype).reshape(-1)[:0].sum()
        return out
    a_row = _prequantized_rows(a, gran, bs, dtype) if a_pre else None
    if not (a_grad or b_grad):  # the forward GEMM alone
        group_offs = _group_offsets("grouped_gemm_fp8", group_lens, group_offs, a)
        if a_row is None:
            a_row = _quant_rows(a, dtype, gran, bs)
        if copies is None:
            copies = _weight_copies(b.detach(), trans_b, dtype, gran, bs, True, False)
        return _mm(a_row, copies[0], gran, group_lens, group_offs, out_dtype, bs, num_cu)
    return _run(a, bt, group_lens, group_offs, trans_b, out_dtype, config, num_cu,
                fuse_bgrad_accum_pattern, copies, a_row)


def grouped_weight_copies(b: torch.Tensor, config: Float8QuantConfig, need_dgrad: bool, trans_b: bool = True):
    """The FP8 copies of the expert weights ``b`` that :func:`grouped_gemm_fp8` forms on every call
    (``config``'s forward dtype and granularity): ``(forward copy, grad_input copy or None)``, each a
    ``(data, scale)`` pair in the layouts the grouped kernels read. Computed without autograd, for
    a cache that reuses them across micro-batches (:class:`turbo.modules.GroupedLinear`)."""
    if not trans_b:
        b = b.transpose(1, 2)
    return _grouped_copies(b, config.fwd_dtype(), config.granularity.name, int(config.block_size or 128),
                           need_dgrad)


def _is_copy(c) -> bool:
    """``c`` has the form of one of :func:`grouped_weight_copies`'s copies: ``(3-D data, scale)``."""
    return isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], torch.Tensor) and c[0].dim() == 3


def _grouped_copies(w_nk: torch.Tensor, dtype, gran: str, bs: int, need_dgrad: bool):
    """:func:`_weight_copies` of a ``[G, N, K]`` weight, without autograd."""
    with torch.no_grad():
        return _weight_copies(w_nk.detach(), True, dtype, gran, bs, True, bool(need_dgrad))


def grouped_gemm_fp8_cached_weight(
    a: torch.Tensor,
    b: torch.Tensor,
    w_copies: tuple,
    group_lens: torch.Tensor,
    group_offs: Optional[torch.Tensor] = None,
    trans_b: bool = True,
    config: Optional[Float8QuantConfig] = None,
    fuse_bgrad_accum_pattern: Optional[str] = None,
) -> torch.Tensor:
    """:func:`grouped_gemm_fp8` with the weight's FP8 copies taken from ``w_copies`` (made by
    :func:`grouped_weight_copies` from the same ``b``, ``trans_b`` and ``config``) instead of
    quantizing ``b`` again; the weight gradient still reaches ``b`` (or ``b.main_grad``): the
    grad_weight GEMM reads the activations' and the output gradient's copies, never the weight.
    The caller owns the copies' validity (they must match ``b``'s current values)."""
    config = Float8QuantConfig() if config is None else config
    if _is_prequantized(a) or _is_prequantized(b):
        raise TypeError("grouped_gemm_fp8_cached_weight: a and b must be high-precision tensors "
                        "(pre-quantized operands go to grouped_gemm_fp8)")
    _check_inputs(a, b, group_lens, group_offs, trans_b, None, config, None, fuse_bgrad_accum_pattern)
    if (not isinstance(w_copies, tuple) or len(w_copies) != 2 or not _is_copy(w_copies[0])
            or not (w_copies[1] is None or _is_copy(w_copies[1]))):
        raise TypeError("grouped_gemm_fp8_cached_weight: w_copies must be grouped_weight_copies(...)'s "
                        "(forward copy, grad_input copy or None)")
    return _run(a, b, group_lens, group_offs, trans_b, None, config, None, fuse_bgrad_accum_pattern, w_copies)


def _run(a, b, group_lens, group_offs, trans_b, out_dtype, config, num_cu, fuse_bgrad_accum_pattern, w_copies,
         a_row=None):
    """The op after its checks; ``w_copies``: the weight's FP8 copies when already made, ``a_row``
    a pre-quantized ``a``'s forward copy."""
    group_offs = _group_offsets("grouped_gemm_fp8", group_lens, group_offs, a)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    fuse = fuse_bgrad_accum_pattern == "megatron"
    gran = config.granularity.name
    bs = int(config.block_size or 128)
    M, K = a.shape
    G = b.size(0)
    N = b.size(1) if trans_b else b.size(2)
    grads = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if M == 0 or N == 0 or K == 0 or G == 0:
        # nothing to quantize or launch: zeros, with (zero) gradients of the right shapes
        out = a.new_zeros((M, N), dtype=out_dtype)
        if grads:
            if fuse and b.requires_grad:
                b.grad_added_to_main_grad = True
            out = out + (a.reshape(-1)[:0].sum() + b.reshape(-1)[:0].sum()).to(out_dtype)
        return out
    args = (group_lens, group_offs, bool(trans_b), out_dtype, gran, config.fwd_dtype(), config.bwd_dtype(), bs,
            num_cu, fuse, w_copies, a_row)
    if grads:
        out = GroupedGemmFP8Function.apply(a, b, *args)
        if fuse and b.requires_grad:
            _flag_main_grad(b)
        return out
    with torch.no_grad():
        return GroupedGemmFP8Function.forward(_NoGradCtx(), a, b, *args)


class _NoGradCtx:
    """A stand-in autograd context for inference calls (nothing is saved)."""

    needs_input_grad = (False, False)

    def save_for_backward(self, *tensors):
        pass
