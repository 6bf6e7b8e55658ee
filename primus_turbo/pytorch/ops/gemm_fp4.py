"""MXFP4 GEMM with autograd: ``turbo.ops.gemm_fp4`` (emulated on Hopper: E2M1 decoded in-kernel).

Semantics as :func:`turbo.ops.gemm` / :func:`turbo.ops.gemm_fp8`: ``C[M, N] = op(A) @ op(B)`` with
``op(A) = A`` (stored ``[M, K]``) or ``A.T`` (``trans_a``, stored ``[K, M]``), and ``op(B) = B``
(``[K, N]``) or ``B.T`` (``trans_b``, stored ``[N, K]``: the ``nn.Linear`` weight). ``A`` is the
activation, ``B`` the weight. All three GEMMs of training run on MXFP4 operands (E2M1 packed two
per byte, one E8M0 scale per 32 elements), each operand quantized in 1 x 32 groups along its
GEMM's K, on the K-major layout of docs/low_precision.md (``a_q [M', K'/2]`` x ``b_q [N', K'/2]``):

* output:      ``C  = op(A) @ op(B)``        A grouped along K, B grouped along K
* grad_input:  ``dA = dC @ op(B).T``         ``dC`` grouped along N, B's copy grouped along N
* grad_weight: ``dB = op(A).T @ dC``         ``dC`` grouped along M, A's copy grouped along M

A tensor ``X [r, c]`` has two quantized copies: row-wise ``[r, c/2]`` (groups along c) and the
column-wise copy stored transposed ``[c, r/2]`` (groups along r), from ``quantize_fp4_with_trans``
when both are needed (one read), else from ``quantize_fp4`` (``axis=-1``, or ``axis=0`` with its
bytes transposed). Which copy each GEMM reads follows from the layout flags, so NN, NT, TN and TT
all run without copies of the high-precision tensors.

The weight uses 1 x 32 groups like the activations (Primus-Turbo's AMD kernels use 32 x 32 2-D
blocks for weights, whose transposed copy reuses the scales); 1 x 32 everywhere is the finer OCP
MX grouping, so the weight's two copies are quantized independently (each exactly as
``quantize_fp4`` defines). Therefore K, and for gradients N (grad_input) and M (grad_weight), must
be multiples of 32 (``ValueError`` naming the dim otherwise; no padding).

Training-recipe options of :class:`Float4QuantConfig` (docs/low_precision.md, "MXFP4 training options"):

* ``use_gradient_sr``: the output gradient ``dC`` is quantized with stochastic rounding (unbiased)
  for both backward GEMMs; activations and weights keep RNE. The seed of each quantization is drawn
  on the device from its default generator (``torch.manual_seed`` reproduces a run; no host sync).
* ``use_rht``: the grad_weight GEMM runs on randomly Hadamard-transformed operands: ``op(A).T``
  and ``dC.T`` are both transformed along their shared reduction dim M in blocks of 32
  (``R = diag(s) H_32 / sqrt(32)``, orthogonal, so ``(X R)(dY R)^T = X dY^T``) before their MXFP4
  quantization, which spreads outliers (e.g. of a few tokens) over their block. The 32 random signs
  ``s`` are drawn on the device in forward and kept for backward. The forward and grad_input GEMMs
  are unchanged. A's grad_weight copy is then formed from the transformed tensor (a second read
  of ``a``), and ``dC``'s two copies by two reads.

Pre-quantized operands (quantize a weight once per step, reuse it across micro-batches, as the
FP8 GEMMs allow): ``b`` may be an MXFP4 ``QuantizedTensor`` (``QuantizedTensor.quantize(w,
torch.float4_e2m1fn_x2, MX_BLOCKWISE, axis=...)``) or a ``QuantizedTensorPair(data, data_t)``
whose ``data_t`` is the MXFP4 ``QuantizedTensor`` of ``w.T`` (:func:`mxfp4_weight_pair` builds both
copies from one read); ``a`` may be an MXFP4 ``QuantizedTensor``. The op reads the copy each GEMM
needs from them: a ``QuantizedTensor`` quantized along its last dim is the row-wise copy, one along
dim 0 is the column-wise copy (its bytes transposed here), and a pair's ``data_t`` supplies the
other one. The forward reads ``b``'s copy grouped along K (``axis=-1`` with ``trans_b``, ``axis=0``
without), grad_input the copy grouped along N: without ``data_t`` a ``b`` that the grad_input needs
raises ``ValueError`` naming the missing copy (as does a pre-quantized ``a`` whose grad_weight copy is
needed). Since this library quantizes weights 1 x 32 with round-to-nearest-even and each copy is
exactly :func:`turbo.ops.quantize_fp4`'s, the results are bit-identical to passing the
high-precision tensor. Operands quantized otherwise are refused by name: FP8 data
(``TypeError``), a granularity other than MX_BLOCKWISE, a block other than 32, stochastic rounding
or the Hadamard transform in their ``scaling_recipe``, and ``use_rht`` with a pre-quantized ``a``
whose grad_weight copy would have to be transformed (``ValueError``). A pre-quantized operand that
``requires_grad`` gets its gradient (in its logical dtype; a pair's ``data``, whose ``main_grad``
the fused accumulation reads), which a framework routes to the parameter, as with ``gemm_fp8``.

Each GEMM is a ``torch.library`` custom op (``primus_turbo::gemm_fp4_impl``,
``primus_turbo::gemm_fp4_accum_impl``) with a fake, called through ``torch.ops`` when traced so
``torch.compile(fullgraph=True)`` works; eager calls skip the custom-op dispatch.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends.gemm_fp4 import gemm_fp4_dispatcher
from ..core.amp import autocast_dtype, gemm_under_autocast
from ..core.backend import PrecisionType
from ..core.low_precision import MXFP4_BLOCK_SIZE, Float4QuantConfig, ScalingGranularity, ScalingRecipe
from ..core.quantized_tensor import QuantizedTensor, QuantizedTensorPair, _packed_fp4
from .gemm import _FUSE_PATTERNS, _flag_main_grad, _megatron_dummy_wgrad, check_main_grad
from .gemm_fp8 import _empty_result

__all__ = ["gemm_fp4", "mxfp4_weight_pair"]

_HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 32


# ----------------------------------------------------------------------------------------------
# MXFP4 GEMM entry points (custom ops)
# ----------------------------------------------------------------------------------------------
def _gemm_fp4_eager(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """``deq(a_q, a_scale) @ deq(b_q, b_scale).T`` (packed ``[rows, K/2]``) through the dispatcher."""
    m, kp = a_q.shape
    n = b_q.shape[0]
    if m == 0 or n == 0 or kp == 0:
        return torch.zeros((m, n), dtype=out_dtype, device=a_q.device)
    return gemm_fp4_dispatcher.dispatch(
        PrecisionType.FP4, a_q=a_q, a_scale=a_scale, b_q=b_q, b_scale=b_scale,
        out=None, out_dtype=out_dtype, accumulate=False,
    )


gemm_fp4_impl = torch.library.custom_op("primus_turbo::gemm_fp4_impl", _gemm_fp4_eager, mutates_args=())


@gemm_fp4_impl.register_fake
def _gemm_fp4_impl_fake(a_q, a_scale, b_q, b_scale, out_dtype):
    return a_q.new_empty((a_q.shape[0], b_q.shape[0]), dtype=out_dtype)


def _gemm_fp4_accum_eager(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                          c: torch.Tensor) -> None:
    """``c += deq(a_q) @ deq(b_q).T``, summed in fp32 in the GEMM epilogue."""
    if a_q.shape[0] == 0 or b_q.shape[0] == 0 or a_q.shape[1] == 0:
        return
    gemm_fp4_dispatcher.dispatch(
        PrecisionType.FP4, a_q=a_q, a_scale=a_scale, b_q=b_q, b_scale=b_scale,
        out=c, out_dtype=c.dtype, accumulate=True,
    )


gemm_fp4_accum_impl = torch.library.custom_op("primus_turbo::gemm_fp4_accum_impl", _gemm_fp4_accum_eager,
                                              mutates_args=("c",))


@gemm_fp4_accum_impl.register_fake
def _gemm_fp4_accum_impl_fake(a_q, a_scale, b_q, b_scale, c):
    return None


def _mm(A, B, out_dtype):
    """A = (packed, scale) [M', K'/2], B = (packed, scale) [N', K'/2] -> [M', N']."""
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.gemm_fp4_impl(A[0], A[1], B[0], B[1], out_dtype)
    return _gemm_fp4_eager(A[0], A[1], B[0], B[1], out_dtype)


def _mm_accum(A, B, c):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.gemm_fp4_accum_impl(A[0], A[1], B[0], B[1], c)
    return _gemm_fp4_accum_eager(A[0], A[1], B[0], B[1], c)


# ----------------------------------------------------------------------------------------------
# Quantized copies
# ----------------------------------------------------------------------------------------------
def _transpose_bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous transpose of a 1-byte tensor (packed FP4 / E8M0) by the byte-transpose kernel
    (torch's strided copy of it is far slower)."""
    from .quantization import _transpose_bytes as transpose  # a sibling module: imported late

    return transpose(t)


def _quantize(x: torch.Tensor, need_row: bool, need_col: bool, sr: bool = False):
    """(row-wise copy, column-wise copy) of ``x [r, c]`` as (packed, scale) pairs, or None each:
    row ``[r, c/2]`` + ``[r, c/32]``; column ``[c, r/2]`` + ``[c, r/32]`` (groups along r).
    ``sr``: stochastic rounding (seeds drawn on the device)."""
    from . import quantization as q

    recipe = ScalingRecipe(use_sr=True) if sr else None
    if need_row and need_col:
        p, s, pt, st = q.quantize_fp4_with_trans(x, scaling_recipe=recipe)
        return (p, s), (pt, st)
    if need_row:
        return q.quantize_fp4(x, scaling_recipe=recipe), None
    if need_col:
        p, s = q.quantize_fp4(x, axis=0, scaling_recipe=recipe)  # [r/2, c] + [r/32, c]
        return None, (_transpose_bytes(p), _transpose_bytes(s))
    return None, None


# ----------------------------------------------------------------------------------------------
# Pre-quantized (MXFP4 QuantizedTensor) operands
# ----------------------------------------------------------------------------------------------
def _is_prequantized(x) -> bool:
    return isinstance(x, (QuantizedTensor, QuantizedTensorPair))


def _grad_operand(x):
    """The tensor autograd tracks for operand ``x``: a pair's ``data`` (its ``data_t`` gets no gradient)."""
    return x.data if isinstance(x, QuantizedTensorPair) else x


def _requires_grad(x) -> bool:
    return bool(_grad_operand(x).requires_grad)


def _check_mxfp4_qt(qt, what: str, op: str, nd: int) -> None:
    """Raise unless ``qt`` is an ``nd``-D MXFP4 ``QuantizedTensor`` quantized as this library's MXFP4
    GEMMs quantize operands (1 x 32 E8M0 groups along one of its last two dims, round-to-nearest-even,
    no transform), so that reading its codes gives the on-the-fly result bit for bit."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"{op}: {what} must be a QuantizedTensor, got {type(qt).__name__}")
    dt = qt.data.dtype
    if dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{op}: {what} holds FP8 data ({dt}); FP8-only QuantizedTensors go to the FP8 GEMMs "
                        f"(gemm_fp8 / grouped_gemm_fp8): {op} takes MXFP4 ones (QuantizedTensor.quantize(x, "
                        f"torch.float4_e2m1fn_x2, ScalingGranularity.MX_BLOCKWISE))")
    if not _packed_fp4(dt):
        raise TypeError(f"{op}: {what} must hold packed MXFP4 data (float4_e2m1fn_x2 or uint8), got {dt}")
    if qt.granularity != ScalingGranularity.MX_BLOCKWISE:
        raise ValueError(f"{op}: {what} was quantized {qt.granularity.name}; MXFP4 operands are MX_BLOCKWISE")
    if qt.block_size != MXFP4_BLOCK_SIZE:
        raise ValueError(f"{op}: {what} was quantized with block_size={qt.block_size}; {op} groups operands "
                         f"1 x {MXFP4_BLOCK_SIZE}")
    if qt.scale_inv.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"{op}: {what}.scale_inv must be float8_e8m0fnu (MX scales), got {qt.scale_inv.dtype}")
    recipe = qt.scaling_recipe
    # the op quantizes operands with round-to-nearest-even and no transform: an operand quantized
    # otherwise would silently give a result that quantizing the high-precision tensor never gives
    if recipe is not None and recipe.use_sr:
        raise ValueError(f"{op}: {what} was quantized with stochastic rounding (scaling_recipe.use_sr=True); "
                         f"{op} quantizes operands with round-to-nearest-even: quantize it without use_sr")
    if recipe is not None and recipe.use_rht:
        raise ValueError(f"{op}: {what} was quantized after a Hadamard transform (scaling_recipe.use_rht=True); "
                         f"{op} takes untransformed operands (its use_rht option transforms in the backward)")
    if qt.group_lens is not None:
        raise ValueError(f"{op}: {what} is a grouped tensor (group_lens); MXFP4 operands cannot be grouped")
    if qt.data.dim() != nd or qt.dim() != nd:
        raise ValueError(f"{op}: {what} must be {nd}-D, got data of shape {tuple(qt.data.shape)}")
    ax = qt.quantized_axis
    if ax < nd - 2:
        raise ValueError(f"{op}: {what} is quantized along dim {ax}; the groups must run along one of the last "
                         f"two dims ({nd - 2} or {nd - 1}) of each matrix")
    shape = list(qt.shape)
    packed = list(shape)
    packed[ax] //= 2
    scales = list(shape)
    scales[ax] //= MXFP4_BLOCK_SIZE
    if shape[ax] % MXFP4_BLOCK_SIZE or list(qt.data.shape) != packed or list(qt.scale_inv.shape) != scales:
        raise ValueError(f"{op}: {what} of shape {tuple(shape)} quantized along dim {ax} must hold data {packed} "
                         f"and scale_inv {scales} (dim {ax} a multiple of 32), got data {list(qt.data.shape)}, "
                         f"scale_inv {list(qt.scale_inv.shape)}")


def _check_prequantized(x, name: str, op: str, nd: int) -> None:
    """Check a pre-quantized operand: a ``QuantizedTensor``, or (``b`` only) a ``QuantizedTensorPair``
    whose ``data_t`` stands for the transpose of each matrix of ``data``."""
    if isinstance(x, QuantizedTensorPair):
        if name != "b":
            raise TypeError(f"{op}: a pre-quantized {name} must be a QuantizedTensor (a QuantizedTensorPair is for b)")
        _check_mxfp4_qt(x.data, f"{name}.data", op, nd)
        if x.data_t is not None:
            _check_mxfp4_qt(x.data_t, f"{name}.data_t", op, nd)
            want = (*x.data.shape[:-2], x.data.shape[-1], x.data.shape[-2])
            if tuple(x.data_t.shape) != want:
                raise ValueError(f"{op}: {name}.data_t must stand for the transpose of {name}.data "
                                 f"{tuple(x.data.shape)}, i.e. have shape {want}, got {tuple(x.data_t.shape)}")
            if x.data_t.device != x.data.device:
                raise ValueError(f"{op}: {name}.data is on {x.data.device}, {name}.data_t on {x.data_t.device}")
        return
    _check_mxfp4_qt(x, name, op, nd)


def _fp4_view(t: torch.Tensor) -> torch.Tensor:
    from .quantization import _FP4_PACKED  # a sibling module: imported late

    return t if t.dtype == _FP4_PACKED else t.view(_FP4_PACKED)  # uint8 storage: the same bytes


def _qt_copies(qt: QuantizedTensor):
    """(copy grouped along the last dim, copy grouped along the second-last dim stored transposed),
    one of them None, of an MXFP4 ``QuantizedTensor`` ``[..., r, c]``, as :func:`_quantize` returns
    them: ``[..., r, c/2]`` + ``[..., r, c/32]``, or ``[..., c, r/2]`` + ``[..., c, r/32]``."""
    q, s = _fp4_view(qt.data), qt.scale_inv
    if qt.quantized_axis == qt.data.dim() - 1:
        return (q, s), None
    from .quantization import _transpose_bytes as transpose  # batched for [G, r, c] too

    return None, (transpose(q), transpose(s))


def _prequantized_copies(x, name: str, op: str, need_row: bool, need_col: bool):
    """(row-wise copy, column-wise copy) of a pre-quantized operand ``[..., r, c]`` (as
    :func:`_quantize` returns them) from a ``QuantizedTensor`` or a ``QuantizedTensorPair``: a
    pair's ``data_t`` stands for the transpose, so its row-wise copy is the column-wise one of
    ``data`` and the reverse."""
    pair_t = None
    if isinstance(x, QuantizedTensorPair):
        x, pair_t = x.data, x.data_t
    row, col = _qt_copies(x)
    if pair_t is not None:
        t_row, t_col = _qt_copies(pair_t)
        row = t_col if row is None else row
        col = t_row if col is None else col
    for needed, have, what, axis in ((need_row, row, "grouped along its last dim", -1),
                                     (need_col, col, "grouped along its second-last dim", -2)):
        if needed and have is None:
            raise ValueError(
                f"{op}: pre-quantized {name} {list(x.shape)} (quantized along dim {x.quantized_axis}) has no copy "
                f"{what} (axis={axis}), which this layout / gradient needs; pass b as a QuantizedTensorPair with "
                f"data_t (mxfp4_weight_pair(w)), a QuantizedTensor quantized along that dim, or the "
                f"high-precision tensor")
    return row, col


def _copies(x, name, need_row, need_col):
    if _is_prequantized(x):
        return _prequantized_copies(x, name, "gemm_fp4", need_row, need_col)
    return _quantize(x, need_row, need_col)


def mxfp4_weight_pair(weight: torch.Tensor, need_weight_transpose_cache: bool = True) -> QuantizedTensorPair:
    """Quantize a weight once for :func:`gemm_fp4` (``[r, c]``) or :func:`grouped_gemm_fp4`
    (``[G, r, c]`` experts), exactly as the ops quantize it on the fly (1 x 32, round-to-nearest-even).

    ``data`` is grouped along the last dim (the forward's copy for ``trans_b=True``); with
    ``need_weight_transpose_cache`` (default) ``data_t`` stands for the transpose (each expert's)
    grouped along its last dim, i.e. ``weight`` grouped along its second-last dim (the grad_input
    copy for ``trans_b=True``, the forward copy otherwise). Both come from one read of ``weight``.
    The copies ``requires_grad`` as ``weight`` does (new leaves): the GEMM gives ``data`` the
    weight gradient, for a framework to route to the parameter; ``data_t`` gets none."""
    from . import quantization as q

    op = "mxfp4_weight_pair"
    if isinstance(weight, QuantizedTensor) or not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3):
        raise ValueError(f"{op}: weight must be a 2-D [r, c] or 3-D [G, r, c] high-precision tensor, got "
                         f"{type(weight).__name__} of shape {tuple(getattr(weight, 'shape', ()))}")
    G = 1 if weight.dim() == 2 else weight.size(0)
    r, c = weight.shape[-2:]
    for dim, name, needed in ((c, "last", True), (r, "second-last", need_weight_transpose_cache)):
        if needed and dim % MXFP4_BLOCK_SIZE:
            raise ValueError(f"{op}: the {name} dim of weight {tuple(weight.shape)} must be a multiple of 32, "
                             f"got {dim}")
    lead = tuple(weight.shape[:-2])
    with torch.no_grad():
        w2 = weight.contiguous().reshape(G * r, c)  # experts stacked: a 32-row group never straddles two
        if need_weight_transpose_cache:
            p, s, pt, st = q.quantize_fp4_with_trans(w2)  # [G r, c/2], [G r, c/32], [c, G r/2], [c, G r/32]
            if G > 1:  # each expert's transposed copy: [G, c, r/2] from the stacked one
                pt = pt.view(c, G, r // 2).transpose(0, 1).contiguous()
                st = st.view(c, G, r // MXFP4_BLOCK_SIZE).transpose(0, 1).contiguous()
        else:
            p, s = q.quantize_fp4(w2)
    mk = lambda d, sc, shape: QuantizedTensor(  # noqa: E731
        d, sc, ScalingGranularity.MX_BLOCKWISE, block_size=MXFP4_BLOCK_SIZE, axis=-1, orig_dtype=weight.dtype,
        shape=shape, requires_grad=weight.requires_grad)
    data = mk(p.view(*lead, r, c // 2), s.view(*lead, r, c // MXFP4_BLOCK_SIZE), tuple(weight.shape))
    if not need_weight_transpose_cache:
        return QuantizedTensorPair(data, None)
    return QuantizedTensorPair(data, mk(pt.view(*lead, c, r // 2), st.view(*lead, c, r // MXFP4_BLOCK_SIZE),
                                        (*lead, c, r)))


def _quantize_rht(x: torch.Tensor, along_rows: bool, signs: torch.Tensor, sr: bool = False):
    """The grad_weight copy of ``x`` after the random Hadamard transform along the reduction dim M:
    ``x [M, c]`` (``along_rows``: transformed and grouped along its rows, stored ``[c, M/2]``) or
    ``x [c, M]`` (along its columns, ``[c, M/2]``); (packed, scale) with scales ``[c, M/32]``."""
    from . import quantization as q

    recipe = ScalingRecipe(use_sr=sr, use_rht=True)
    if along_rows:
        p, s = q.quantize_fp4(x, axis=0, scaling_recipe=recipe, rht_signs=signs)
        return _transpose_bytes(p), _transpose_bytes(s)
    return q.quantize_fp4(x, scaling_recipe=recipe, rht_signs=signs)


def _forward(a, b, trans_a, trans_b, out_dtype, need_ga, need_gb, rht_signs=None):
    """The forward GEMM; returns (out, B's copy for grad_input, A's copy for grad_weight).
    ``rht_signs``: A's grad_weight copy is of the random Hadamard transform of op(A).T along M."""
    rht = rht_signs is not None and need_gb
    wgrad_copy = need_gb and not rht  # A's grad_weight copy comes from the one-read quantization
    # a [r, c]: the forward reads op(A) [M, K] grouped along K (row copy, or the column copy when
    # trans_a); grad_weight reads op(A).T [K, M] grouped along M (the other copy).
    a_row, a_col = _copies(a, "a", need_row=not trans_a or (wgrad_copy and trans_a),
                           need_col=trans_a or (wgrad_copy and not trans_a))
    # b: the forward reads op(B).T [N, K] grouped along K; grad_input reads op(B) [K, N] along N.
    b_row, b_col = _copies(b, "b", need_row=trans_b or (need_ga and not trans_b),
                           need_col=not trans_b or (need_ga and trans_b))
    A = a_col if trans_a else a_row
    B = b_row if trans_b else b_col
    out = _mm(A, B, out_dtype)
    b_for_dgrad = (b_col if trans_b else b_row) if need_ga else (None, None)
    if rht:
        a_for_wgrad = _quantize_rht(a, not trans_a, rht_signs)  # a [M, K]: along its rows; [K, M]: cols
    else:
        a_for_wgrad = (a_row if trans_a else a_col) if need_gb else (None, None)
    return out, b_for_dgrad, a_for_wgrad


class GemmFP4Function(torch.autograd.Function):
    """The three MXFP4 GEMMs of ``C = op(A) @ op(B)``; see the module docstring for the copies used.

    ``a`` / ``b`` are tensors or MXFP4 ``QuantizedTensor`` s (a pre-quantized operand gets its
    gradient, in its logical dtype, like a high-precision one); ``b_t`` is a ``QuantizedTensorPair``'s
    transposed copy, passed on its own so that autograd sees the pair's ``data`` as ``b``."""

    @staticmethod
    def forward(ctx, a, b, b_t, trans_a, trans_b, out_dtype, fuse_accum, gradient_sr=False, use_rht=False):
        need_ga, need_gb = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.trans_a, ctx.trans_b, ctx.fuse_accum = trans_a, trans_b, fuse_accum
        ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
        ctx.gradient_sr = gradient_sr
        signs = None
        if use_rht and need_gb:
            from .quantization import random_hadamard_signs

            signs = random_hadamard_signs(_BLOCK, device=a.device)  # drawn on the device, no sync
        b_op = QuantizedTensorPair(b, b_t) if b_t is not None else b
        out, b_for_dgrad, a_for_wgrad = _forward(a, b_op, trans_a, trans_b, out_dtype, need_ga, need_gb, signs)
        # only the packed copies (and their scales) are kept for backward; b itself only for main_grad
        ctx.save_for_backward(*b_for_dgrad, *a_for_wgrad, b if (fuse_accum and need_gb) else None, signs)
        return out  # (b.grad_added_to_main_grad: gemm_fp4 sets it, see gemm._flag_main_grad)

    @staticmethod
    def backward(ctx, grad_out):
        bq, bs_, aq, as_, b, signs = ctx.saved_tensors
        need_ga, need_gb = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = grad_out.contiguous()
        if signs is not None and need_gb:
            # grad_weight reads dC.T [N, M] transformed along M with A's signs; grad_input plain dC
            dy_row = _quantize(dy, need_row=need_ga, need_col=False, sr=ctx.gradient_sr)[0]
            dy_col = _quantize_rht(dy, True, signs, sr=ctx.gradient_sr)
        else:
            dy_row, dy_col = _quantize(dy, need_row=need_ga, need_col=need_gb, sr=ctx.gradient_sr)
        grad_a = grad_b = None
        if need_ga:
            Bd = (bq, bs_)  # op(B) as [K, N/2], grouped along N
            # dA = dC @ op(B).T, stored like A: [M, K], or [K, M] = op(B) @ dC.T
            grad_a = _mm(Bd, dy_row, ctx.a_dtype) if ctx.trans_a else _mm(dy_row, Bd, ctx.a_dtype)
        if need_gb:
            X = (aq, as_)  # op(A).T as [K, M/2], grouped along M
            # dB = op(A).T @ dC, stored like B: [K, N], or [N, K] = dC.T @ op(A)
            P, Q = (dy_col, X) if ctx.trans_b else (X, dy_col)
            if ctx.fuse_accum:
                _mm_accum(P, Q, b.main_grad)
                grad_b = _megatron_dummy_wgrad(b)
            else:
                grad_b = _mm(P, Q, ctx.b_dtype)
        return grad_a, grad_b, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------
def _check_inputs(a, b, trans_a, trans_b, out_dtype, config, fuse_bgrad_accum_pattern):
    if not isinstance(config, Float4QuantConfig):
        raise TypeError(f"gemm_fp4: config must be a Float4QuantConfig or None, got {type(config).__name__}")
    a_in, b_in = a, b
    hp = 0
    for name, t in (("a", a), ("b", b)):
        if _is_prequantized(t):
            _check_prequantized(t, name, "gemm_fp4", 2)
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gemm_fp4: {name} must be a torch.Tensor (bf16/fp16/fp32, quantized on the fly) or an "
                            f"MXFP4 QuantizedTensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"gemm_fp4: {name} must be 2-D, got {name}.dim()={t.dim()} with shape {tuple(t.shape)}")
        if t.dtype not in _HP_DTYPES:
            raise TypeError(f"gemm_fp4: {name}.dtype must be float32, float16 or bfloat16, got {t.dtype}")
        hp += 1
    # from here a QuantizedTensor (a pair's data) stands for its operand: logical shape and dtype
    a, b = _grad_operand(a), _grad_operand(b)
    if hp == 2 and a.dtype != b.dtype:
        raise TypeError(f"gemm_fp4: a and b must have the same dtype, got a={a.dtype}, b={b.dtype}")
    if a.device != b.device:
        raise ValueError(f"gemm_fp4: a and b must be on the same device, got a on {a.device}, b on {b.device}")
    if out_dtype is not None and out_dtype not in _HP_DTYPES:
        raise TypeError(f"gemm_fp4: out_dtype must be float32, float16, bfloat16 or None, got {out_dtype}")
    m, k = (a.size(1), a.size(0)) if trans_a else (a.size(0), a.size(1))
    n, k_b = (b.size(0), b.size(1)) if trans_b else (b.size(1), b.size(0))
    if k != k_b:
        raise ValueError(f"gemm_fp4: K mismatch, a{tuple(a.shape)} with trans_a={trans_a} has K={k}, "
                         f"b{tuple(b.shape)} with trans_b={trans_b} has K={k_b}")
    if fuse_bgrad_accum_pattern not in _FUSE_PATTERNS:
        raise ValueError(
            f"gemm_fp4: fuse_bgrad_accum_pattern must be None or 'megatron', got {fuse_bgrad_accum_pattern!r}")
    grads = torch.is_grad_enabled()
    # each GEMM quantizes along its own K in groups of 32: K (forward), N (grad_input), M (grad_weight);
    # an empty problem quantizes nothing
    nonempty = m * n * k != 0
    for dim, name, needed in ((k, "K", True), (n, "N", grads and a.requires_grad), (m, "M", grads and b.requires_grad)):
        if nonempty and needed and dim % _BLOCK:
            raise ValueError(f"gemm_fp4: MXFP4 needs {name} to be a multiple of 32, got {name}={dim} "
                             f"(m, n, k = {m}, {n}, {k})")
    if (nonempty and grads and config.use_rht and _is_prequantized(a_in) and b.requires_grad):
        raise ValueError("gemm_fp4: config.use_rht transforms op(A) before quantizing its grad_weight copy, which a "
                         "pre-quantized a cannot give; pass the high-precision a or use_rht=False")
    if fuse_bgrad_accum_pattern == "megatron" and b.requires_grad and grads:
        # a pre-quantized b carries main_grad itself (a pair's data), as a framework's bridge sets it
        check_main_grad("gemm_fp4", b, torch.bfloat16, "bfloat16")
    return m, n, k


def gemm_fp4(
    a: torch.Tensor,
    b: torch.Tensor,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[Float4QuantConfig] = None,
    fuse_bgrad_accum_pattern: Optional[str] = None,
) -> torch.Tensor:
    """MXFP4 matrix product ``C = op(A) @ op(B)`` with autograd; every GEMM of training in MXFP4.

    Args:
        a: ``[M, K]``, or ``[K, M]`` with ``trans_a=True``; the activation, bf16/fp16/fp32,
            quantized on the fly (1 x 32 E8M0 groups along each GEMM's K).
        b: ``[K, N]``, or ``[N, K]`` with ``trans_b=True`` (an ``nn.Linear`` weight); same dtype;
            also 1 x 32 groups (not Primus' 32 x 32 weight blocks; see the module docstring).
        trans_a, trans_b: layouts NN, NT, TN, TT.
        out_dtype: dtype of ``C`` (default ``a.dtype``). Gradients come back in the inputs' dtypes.
        config: :class:`Float4QuantConfig` (default). ``use_gradient_sr``: stochastic rounding
            of the output gradient for both backward GEMMs; ``use_rht``: grad_weight on random
            Hadamard-transformed operands (along M, blocks of 32). Both only affect backward.
        fuse_bgrad_accum_pattern: ``None`` or ``"megatron"``: grad_weight is added into
            ``b.main_grad`` (fp32 or bf16) in the GEMM epilogue, ``b.grad_added_to_main_grad`` is
            set and ``b``'s returned gradient is a placeholder (as :func:`turbo.ops.gemm`).

    Pre-quantized operands: ``b`` may be an MXFP4 ``QuantizedTensor`` or ``QuantizedTensorPair``
    (:func:`mxfp4_weight_pair`), ``a`` an MXFP4 ``QuantizedTensor``, quantized as the op would
    (1 x 32, RNE, no transform; else ``ValueError`` / ``TypeError`` naming the mismatch): the results are
    bit-identical to passing the high-precision tensors, and one that requires grad gets its
    gradient (module docstring), as long as the copies that gradient needs are at hand (else
    ``ValueError`` at the forward).

    Returns:
        ``C`` of shape ``[M, N]``, dtype ``out_dtype``.

    K must be a multiple of 32; with gradients, N (grad_input) and M (grad_weight) too. Hopper has
    no FP4 tensor cores: the TRITON backend decodes E2M1 in-kernel onto bf16 tensor cores, exactly
    (the result is the fp32 sum of the dequantized products).
    """
    if isinstance(a, torch.Tensor) and (amp := autocast_dtype(a)) is not None:  # core/amp.py
        return gemm_under_autocast(gemm_fp4, amp, a, b, trans_a, trans_b, out_dtype, config,
                                   fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
    config = Float4QuantConfig() if config is None else config
    m, n, k = _check_inputs(a, b, trans_a, trans_b, out_dtype, config, fuse_bgrad_accum_pattern)
    if out_dtype is None:
        out_dtype = a.dtype
    fuse = fuse_bgrad_accum_pattern == "megatron"
    if m == 0 or n == 0 or k == 0:
        # a QuantizedTensor's .to() dequantizes, so its (zero) gradient still reaches it
        return _empty_result(a, _grad_operand(b), trans_a, trans_b, out_dtype, fuse)
    if torch.is_grad_enabled() and (_requires_grad(a) or _requires_grad(b)):
        b_t = b.data_t if isinstance(b, QuantizedTensorPair) else None
        bt = _grad_operand(b)
        out = GemmFP4Function.apply(a, bt, b_t, bool(trans_a), bool(trans_b), out_dtype, fuse,
                                    bool(config.use_gradient_sr), bool(config.use_rht))
        if fuse and bt.requires_grad:
            _flag_main_grad(bt)
        return out
    return _forward(a, b, bool(trans_a), bool(trans_b), out_dtype, False, False)[0]
