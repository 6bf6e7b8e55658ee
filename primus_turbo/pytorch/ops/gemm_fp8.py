"""FP8 GEMM with autograd: ``turbo.ops.gemm_fp8``.

Semantics as :func:`turbo.ops.gemm`: ``C[M, N] = op(A) @ op(B)`` with ``op(A) = A`` (stored
``[M, K]``) or ``A.T`` (``trans_a``, stored ``[K, M]``), and ``op(B) = B`` (``[K, N]``) or ``B.T``
(``trans_b``, stored ``[N, K]``: the ``nn.Linear`` weight). ``A`` is the activation, ``B`` the
weight. All three GEMMs of training run in FP8, on the K-major operand layout of
docs/low_precision.md (``a_q [M', K']`` x ``b_q [N', K']``), each operand quantized along its
GEMM's K:

* output:      ``C  = op(A) @ op(B)``        A row-wise, B in whichever copy is K-major along K
* grad_input:  ``dA = dC @ op(B).T``         ``dC`` row-wise (along N), B's copy grouped along N
* grad_weight: ``dB = op(A).T @ dC``         ``dC`` column-wise copy (along M), A's copy along M

A tensor ``X [r, c]`` has two quantized copies: row-wise ``[r, c]`` (groups along c) and the
column-wise copy stored transposed ``[c, r]`` (groups along r), both from
``quantize_fp8_with_trans``; which one a GEMM needs follows from the layout flags, so every layout
(NN, NT, TN, TT) runs without copies of the high-precision tensors. Forward operands use
``config.fwd_dtype()``, the output gradient ``config.bwd_dtype()`` (E5M2 under HYBRID). BLOCKWISE
quantizes activations and gradients in 1 x bs groups and the weight in bs x bs tiles
(``ScalingRecipe(use_2d_block=True)``), so the weight's transposed copy reuses its scales.

Each FP8 GEMM is a ``torch.library`` custom op (``primus_turbo::gemm_fp8_impl``,
``primus_turbo::gemm_fp8_accum_impl``) with a fake, called through ``torch.ops`` when traced so
``torch.compile(fullgraph=True)`` works; eager calls skip the custom-op dispatch.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends.gemm_fp8 import gemm_fp8_dispatcher
from ..core.amp import autocast_dtype, gemm_under_autocast
from ..core.backend import PrecisionType
from ..core.low_precision import Float8QuantConfig, ScalingGranularity, ScalingRecipe
from ..core.quantized_tensor import QuantizedTensor, QuantizedTensorPair
from .gemm import _FUSE_PATTERNS, _flag_main_grad, _megatron_dummy_wgrad, check_main_grad
from . import quantization as _quantization
from .quantization import _transpose_bytes  # FP8 transposes at copy speed (torch's strided copy is not)

__all__ = ["gemm_fp8"]

_HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_G = ScalingGranularity
_MX = "MX_BLOCKWISE"
#: the weight's BLOCKWISE recipe (b x b tiles), built once rather than per quantization
_RECIPE_2D = ScalingRecipe(use_2d_block=True)


# ----------------------------------------------------------------------------------------------
# FP8 GEMM entry points (custom ops)
# ----------------------------------------------------------------------------------------------
def _gemm_fp8_eager(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                    granularity: str, out_dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """``(a_q * a_scale) @ (b_q * b_scale).T`` (both ``[rows, K]``) through the FP8 dispatcher."""
    m, k = a_q.shape
    n = b_q.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros((m, n), dtype=out_dtype, device=a_q.device)
    return gemm_fp8_dispatcher.dispatch(
        PrecisionType.FP8, a_q=a_q, a_scale=a_scale, b_q=b_q, b_scale=b_scale, mode=_G[granularity],
        out=None, out_dtype=out_dtype, accumulate=False, block_size=block_size,
    )


gemm_fp8_impl = torch.library.custom_op("primus_turbo::gemm_fp8_impl", _gemm_fp8_eager, mutates_args=())


@gemm_fp8_impl.register_fake
def _gemm_fp8_impl_fake(a_q, a_scale, b_q, b_scale, granularity, out_dtype, block_size):
    return a_q.new_empty((a_q.shape[0], b_q.shape[0]), dtype=out_dtype)


def _gemm_fp8_accum_eager(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                          granularity: str, block_size: int, c: torch.Tensor) -> None:
    """``c += (a_q * a_scale) @ (b_q * b_scale).T``: TRITON adds in its GEMM epilogue (fp32 sum,
    one rounding into ``c``); TORCH has ``_scaled_mm`` write the product (fp32 where it can) and adds
    it with one ``add_`` (see ``GemmFP8TorchBackend``)."""
    if a_q.shape[0] == 0 or b_q.shape[0] == 0 or a_q.shape[1] == 0:
        return
    gemm_fp8_dispatcher.dispatch(
        PrecisionType.FP8, a_q=a_q, a_scale=a_scale, b_q=b_q, b_scale=b_scale, mode=_G[granularity],
        out=c, out_dtype=c.dtype, accumulate=True, block_size=block_size,
    )


gemm_fp8_accum_impl = torch.library.custom_op("primus_turbo::gemm_fp8_accum_impl", _gemm_fp8_accum_eager,
                                              mutates_args=("c",))


@gemm_fp8_accum_impl.register_fake
def _gemm_fp8_accum_impl_fake(a_q, a_scale, b_q, b_scale, granularity, block_size, c):
    return None


def _mm(A, B, granularity, out_dtype, block_size):
    """A = (q, scale) [M', K'], B = (q, scale) [N', K'] -> [M', N']."""
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.gemm_fp8_impl(A[0], A[1], B[0], B[1], granularity, out_dtype, block_size)
    return _gemm_fp8_eager(A[0], A[1], B[0], B[1], granularity, out_dtype, block_size)


def _mm_accum(A, B, granularity, block_size, c):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.gemm_fp8_accum_impl(A[0], A[1], B[0], B[1], granularity, block_size, c)
    return _gemm_fp8_accum_eager(A[0], A[1], B[0], B[1], granularity, block_size, c)


# ----------------------------------------------------------------------------------------------
# Quantized copies
# ----------------------------------------------------------------------------------------------
def _quant_api():
    """(quantize_fp8, quantize_fp8_with_trans) of turbo.ops, looked up per call (a patched
    module attribute is seen) without a function-level import on the hot path."""
    return _quantization.quantize_fp8, _quantization.quantize_fp8_with_trans


def _orient(s: torch.Tensor, rows: int, k: int, granularity: str, block_size: int, weight: bool) -> torch.Tensor:
    """Scales of a K-major copy ``[rows, K]`` in the orientation the kernel reads (transposed view
    when a quantizer returned them as the ``axis=0`` layout of the source tensor)."""
    if granularity == "TENSORWISE":
        return s
    if granularity == "ROWWISE":
        return s  # [rows], [rows, 1] and [1, rows] are all read as one scale per row
    if granularity == _MX:
        want = (rows, k // 32)
    elif weight:
        want = (-(-rows // block_size), -(-k // block_size))
    else:
        want = (rows, -(-k // block_size))
    if tuple(s.shape) != want and s.dim() == 2 and tuple(s.shape[::-1]) == want:
        return s.t()
    return s


def _quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str, block_size: int, weight: bool,
              need_row: bool, need_col: bool):
    """(row-wise copy, column-wise copy) of ``x [r, c]`` as (q, scale) pairs, None where not needed:
    row-wise ``[r, c]`` grouped along c; column-wise ``[c, r]`` (transposed) grouped along r."""
    if not (need_row or need_col):
        return None, None
    quantize_fp8, quantize_fp8_with_trans = _quant_api()
    g = _G[granularity]
    bs = block_size if granularity == "BLOCKWISE" else None
    recipe = _RECIPE_2D if (weight and granularity == "BLOCKWISE") else None
    r, c = x.shape
    if not need_col:
        q, s = quantize_fp8(x, dtype, g, block_size=bs, axis=-1, scaling_recipe=recipe)
        return (q, _orient(s, r, c, granularity, block_size, weight)), None
    if not need_row:
        # groups down the columns, then an FP8 transpose: the same bits as the with_trans column
        # copy, without the row copy (and without MX's need for whole 32-groups along c as well)
        q, s = quantize_fp8(x, dtype, g, block_size=bs, axis=0, scaling_recipe=recipe)
        return None, (_transpose_bytes(q), _orient(s, c, r, granularity, block_size, weight))
    q, s, qt, st = quantize_fp8_with_trans(x, dtype, g, block_size=bs, scaling_recipe=recipe,
                                           scaling_recipe_for_trans=recipe)
    row = (q, _orient(s, r, c, granularity, block_size, weight)) if need_row else None
    return row, (qt, _orient(st, c, r, granularity, block_size, weight))


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------
def _is_prequantized(x) -> bool:
    return isinstance(x, (QuantizedTensor, QuantizedTensorPair))


def _prequantized_copies(x, name: str, granularity: str, block_size: int, need_row: bool, need_col: bool):
    """(row-wise copy, column-wise copy) of a pre-quantized operand stored ``[r, c]`` (as
    :func:`_quantize` returns them), from a ``QuantizedTensor`` or a ``QuantizedTensorPair``."""
    pair_t = None
    if isinstance(x, QuantizedTensorPair):
        x, pair_t = x.data, x.data_t
    if x.granularity.name != granularity:
        raise ValueError(f"gemm_fp8: {name} was quantized {x.granularity.name}, config says {granularity}")
    if granularity == "BLOCKWISE" and (x.block_size or 128) != block_size:
        raise ValueError(f"gemm_fp8: {name} was quantized with block_size={x.block_size}, config says {block_size}")
    if x.data.dim() != 2:
        raise ValueError(f"gemm_fp8: {name} must be 2-D, got shape {tuple(x.data.shape)}")
    r, c = x.data.shape
    weight = x.scaling_recipe is not None and x.scaling_recipe.use_2d_block
    shared = granularity == "TENSORWISE" or weight  # one grid of scales serves both orientations
    row = col = None
    if x.axis == 0 and not shared:  # groups down the columns: the column-wise copy, transposed
        col = (_transpose_bytes(x.data), _orient(x.scale_inv, c, r, granularity, block_size, weight))
    else:
        row = (x.data, _orient(x.scale_inv, r, c, granularity, block_size, weight))
        if pair_t is not None:
            col = (pair_t.data, _orient(pair_t.scale_inv, c, r, granularity, block_size, weight))
        elif need_col and shared:  # same scales, transposed FP8 data
            col = (_transpose_bytes(x.data), x.scale_inv.t() if x.scale_inv.dim() == 2 else x.scale_inv)
    for needed, have, what in ((need_row, row, "grouped along its last dim"),
                               (need_col, col, "grouped along its first dim (the transposed copy)")):
        if needed and have is None:
            raise ValueError(
                f"gemm_fp8: pre-quantized {name} {list(x.data.shape)} ({granularity}) has no copy {what}, which "
                f"this layout / gradient needs; pass a QuantizedTensorPair with data_t "
                f"(create_quantized_weight(..., need_weight_transpose_cache=True)) or the high-precision tensor")
    return row, col


def _copies(x, name, dtype, granularity, block_size, weight, need_row, need_col):
    if _is_prequantized(x):
        return _prequantized_copies(x, name, granularity, block_size, need_row, need_col)
    return _quantize(x, dtype, granularity, block_size, weight, need_row, need_col)


def _forward(a, b, trans_a, trans_b, out_dtype, granularity, fwd_dtype, block_size, need_ga, need_gb):
    """The forward GEMM; returns (out, B's copy for grad_input, A's copy for grad_weight)."""
    # a [r, c]: the forward reads op(A) [M, K] (row-wise copy, or the column-wise one when
    # trans_a); grad_weight reads op(A).T [K, M] grouped along M (the other copy).
    a_row, a_col = _copies(a, "a", fwd_dtype, granularity, block_size, False,
                           need_row=not trans_a or (need_gb and trans_a), need_col=trans_a or (need_gb and not trans_a))
    # b: the forward reads op(B).T [N, K]; grad_input reads op(B) [K, N] grouped along N.
    b_row, b_col = _copies(b, "b", fwd_dtype, granularity, block_size, True,
                           need_row=trans_b or (need_ga and not trans_b), need_col=not trans_b or (need_ga and trans_b))
    A = a_col if trans_a else a_row
    B = b_row if trans_b else b_col
    out = _mm(A, B, granularity, out_dtype, block_size)
    b_for_dgrad = (b_col if trans_b else b_row) if need_ga else (None, None)
    a_for_wgrad = (a_row if trans_a else a_col) if need_gb else (None, None)
    return out, b_for_dgrad, a_for_wgrad


class GemmFP8Function(torch.autograd.Function):
    """The three FP8 GEMMs of ``C = op(A) @ op(B)``; see the module docstring for the copies used.

    ``a`` / ``b`` are tensors or ``QuantizedTensor`` s (a pre-quantized operand gets its gradient,
    in its logical dtype, like a high-precision one); ``b_t`` is a ``QuantizedTensorPair``'s
    transposed copy, passed on its own so that autograd sees the pair's ``data`` as ``b``."""

    @staticmethod
    def forward(ctx, a, b, b_t, trans_a, trans_b, out_dtype, granularity, fwd_dtype, bwd_dtype, block_size,
                fuse_accum):
        need_ga, need_gb = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.trans_a, ctx.trans_b, ctx.fuse_accum = trans_a, trans_b, fuse_accum
        ctx.granularity, ctx.bwd_dtype, ctx.block_size = granularity, bwd_dtype, block_size
        ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype  # a QuantizedTensor's dtype is its original one
        b_op = QuantizedTensorPair(b, b_t) if b_t is not None else b
        out, b_for_dgrad, a_for_wgrad = _forward(a, b_op, trans_a, trans_b, out_dtype, granularity, fwd_dtype,
                                                 block_size, need_ga, need_gb)
        # only FP8 copies (and their scales) are kept for backward; b itself only for main_grad
        ctx.save_for_backward(*b_for_dgrad, *a_for_wgrad, b if (fuse_accum and need_gb) else None)
        return out  # (b.grad_added_to_main_grad: gemm_fp8 sets it, see gemm._flag_main_grad)

    @staticmethod
    def backward(ctx, grad_out):
        bq, bs_, aq, as_, b = ctx.saved_tensors
        g, bsz = ctx.granularity, ctx.block_size
        need_ga, need_gb = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_row, dy_col = _quantize(grad_out.contiguous(), ctx.bwd_dtype, g, bsz, False,
                                   need_row=need_ga, need_col=need_gb)
        grad_a = grad_b = None
        if need_ga:
            Bd = (bq, bs_)  # op(B) as [K, N], grouped along N
            # dA = dC @ op(B).T, stored like A: [M, K], or [K, M] = op(B) @ dC.T
            grad_a = _mm(Bd, dy_row, g, ctx.a_dtype, bsz) if ctx.trans_a else _mm(dy_row, Bd, g, ctx.a_dtype, bsz)
        if need_gb:
            X = (aq, as_)  # op(A).T as [K, M], grouped along M
            # dB = op(A).T @ dC, stored like B: [K, N], or [N, K] = dC.T @ op(A)
            P, Q = (dy_col, X) if ctx.trans_b else (X, dy_col)
            if ctx.fuse_accum:
                _mm_accum(P, Q, g, bsz, b.main_grad)
                grad_b = _megatron_dummy_wgrad(b)
            else:
                grad_b = _mm(P, Q, g, ctx.b_dtype, bsz)
        return grad_a, grad_b, None, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------
def _data_of(x) -> torch.Tensor:
    """The tensor holding x's values (a QuantizedTensor's / pair's FP8 data)."""
    if isinstance(x, QuantizedTensorPair):
        return x.data.data
    return x.data if isinstance(x, QuantizedTensor) else x


def _grad_operand(x):
    """The tensor autograd tracks for operand ``x``: a pair's ``data`` (its ``data_t`` gets no gradient)."""
    return x.data if isinstance(x, QuantizedTensorPair) else x


def _requires_grad(x) -> bool:
    x = _grad_operand(x)
    return isinstance(x, torch.Tensor) and x.requires_grad


def _check_prequantized_fp8(t, name: str, op: str) -> None:
    """A pre-quantized operand must hold FP8 data: an MXFP4 ``QuantizedTensor`` (packed codes,
    whose shape is not the tensor's) is named here instead of failing a shape check later."""
    dtype = getattr(_data_of(t), "dtype", None)
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{op}: a pre-quantized {name} must hold FP8 data (float8_e4m3fn / float8_e5m2), got {dtype}; "
                        "MXFP4 QuantizedTensors go to the MXFP4 GEMMs (gemm_fp4, grouped_gemm_fp4)")


def _check_inputs(a, b, trans_a, trans_b, out_dtype, config, fuse_bgrad_accum_pattern):
    a_in, b_in = a, b
    hp = []
    for name, t in (("a", a), ("b", b)):
        if _is_prequantized(t):
            _check_prequantized_fp8(t, name, "gemm_fp8")
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gemm_fp8: {name} must be a torch.Tensor or a QuantizedTensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"gemm_fp8: {name} must be 2-D, got {name}.dim()={t.dim()} with shape {tuple(t.shape)}")
        if t.dtype not in _HP_DTYPES:
            raise TypeError(
                f"gemm_fp8: {name}.dtype must be float32, float16 or bfloat16 (it is quantized on the fly; pass a "
                f"QuantizedTensor for FP8 data), got {t.dtype}")
        hp.append(t)
    if len(hp) == 2 and a.dtype != b.dtype:
        raise TypeError(f"gemm_fp8: a and b must have the same dtype, got a={a.dtype}, b={b.dtype}")
    if isinstance(a, QuantizedTensorPair):
        raise TypeError("gemm_fp8: a pre-quantized a must be a QuantizedTensor (a QuantizedTensorPair is for b)")
    if isinstance(b, QuantizedTensorPair) and b.data is None:
        raise TypeError("gemm_fp8: b is a QuantizedTensorPair with data=None")
    a_t = _data_of(a)
    b_t = _data_of(b)
    if a_t.device != b_t.device:
        raise ValueError(f"gemm_fp8: a and b must be on the same device, got a on {a_t.device}, b on {b_t.device}")
    a_shape, b_shape = tuple(a_t.shape), tuple(b_t.shape)
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise ValueError(f"gemm_fp8: pre-quantized operands must be 2-D, got a {a_shape}, b {b_shape}")
    a, b = a_t, b_t
    if out_dtype is not None and out_dtype not in _HP_DTYPES:
        raise TypeError(f"gemm_fp8: out_dtype must be float32, float16, bfloat16 or None, got {out_dtype}")
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"gemm_fp8: config must be a Float8QuantConfig or None, got {type(config).__name__}")
    m, k = (a.size(1), a.size(0)) if trans_a else (a.size(0), a.size(1))
    n, k_b = (b.size(0), b.size(1)) if trans_b else (b.size(1), b.size(0))
    if k != k_b:
        raise ValueError(
            f"gemm_fp8: K mismatch, a{tuple(a.shape)} with trans_a={trans_a} has K={k}, "
            f"b{tuple(b.shape)} with trans_b={trans_b} has K={k_b}")
    if fuse_bgrad_accum_pattern not in _FUSE_PATTERNS:
        raise ValueError(
            f"gemm_fp8: fuse_bgrad_accum_pattern must be None or 'megatron', got {fuse_bgrad_accum_pattern!r}")
    grads = torch.is_grad_enabled()
    a_rg, b_rg = _requires_grad(a_in), _requires_grad(b_in)
    if config.granularity == _G.MX_BLOCKWISE:
        # each GEMM quantizes along its own K in groups of 32: K (forward), N (grad_input), M (grad_weight)
        for dim, name, needed in ((k, "K", True), (n, "N", grads and a_rg),
                                  (m, "M", grads and b_rg)):
            if needed and dim % 32:
                raise ValueError(f"gemm_fp8: MX_BLOCKWISE needs {name} to be a multiple of 32, got {name}={dim} "
                                 f"(m, n, k = {m}, {n}, {k})")
    if fuse_bgrad_accum_pattern == "megatron" and b_rg and grads:
        # a pre-quantized b carries main_grad itself (or its pair's data does), as a framework's
        # weight-gradient bridge sets it on the cached buffer
        check_main_grad("gemm_fp8", _grad_operand(b_in), torch.bfloat16, "bfloat16")
    return m, n, k


def _empty_result(a, b, trans_a, trans_b, out_dtype, fuse):
    """M, N or K = 0: no quantization and no launch (K = 0 gives zeros); autograd still gives
    gradients of the right shapes (zeros), and the fusion flag is set as a real wgrad would."""
    if fuse and b.requires_grad and torch.is_grad_enabled():
        b.grad_added_to_main_grad = True
    A, B = a.to(out_dtype), b.to(out_dtype)
    return (A.t() if trans_a else A) @ (B.t() if trans_b else B)


def gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[Float8QuantConfig] = None,
    fuse_bgrad_accum_pattern: Optional[str] = None,
) -> torch.Tensor:
    """FP8 matrix product ``C = op(A) @ op(B)`` with autograd; every GEMM of training in FP8.

    Args:
        a: ``[M, K]``, or ``[K, M]`` with ``trans_a=True``; the activation, bf16/fp16/fp32,
            quantized on the fly.
        b: ``[K, N]``, or ``[N, K]`` with ``trans_b=True`` (an ``nn.Linear`` weight); same dtype.
        trans_a, trans_b: layouts NN, NT, TN, TT (every granularity).
        out_dtype: dtype of ``C`` (default ``a.dtype``). Gradients come back in the inputs' dtypes.
        config: :class:`Float8QuantConfig` (default: TENSORWISE E4M3). ``format`` E4M3, E5M2 or
            HYBRID (E4M3 forward, E5M2 output gradient); ``granularity`` TENSORWISE, ROWWISE,
            BLOCKWISE (1 x 128 activations / gradients, 128 x 128 weights; ``block_size``) or
            MX_BLOCKWISE (1 x 32 E8M0, emulated exactly on Hopper; needs K, and for gradients N
            and M, to be multiples of 32).
        fuse_bgrad_accum_pattern: ``None`` or ``"megatron"``: grad_weight is added into
            ``b.main_grad`` (fp32 or bf16), ``b.grad_added_to_main_grad`` is set and ``b``'s
            returned gradient is a placeholder (as :func:`turbo.ops.gemm`). How the add is done
            depends on the wgrad GEMM's backend. TRITON adds in its GEMM epilogue: its fp32
            accumulator plus ``main_grad``, one rounding into ``main_grad``'s dtype. TORCH
            (``torch._scaled_mm``, the TENSORWISE / ROWWISE default on GPU where it runs the
            wgrad) cannot add into its output: it writes ``dB`` to an fp32 temporary and one
            ``main_grad.add_`` follows, so each micro-batch is still rounded once. The exception
            is ROWWISE where this torch build's ``_scaled_mm`` cannot write fp32 row-wise (its
            CUTLASS kernel writes bf16 only; torch uses cuBLASLt instead on sm_90 from cuBLASLt
            12.9): there each micro-batch's ``dB`` is rounded to bf16 before the add (pin
            ``FP8:TRITON`` to avoid it). The backend finds out which by running ``_scaled_mm``
            once on tiny tensors.

    Pre-quantized operands: ``a`` may be a ``QuantizedTensor`` and ``b`` a ``QuantizedTensor`` or
    ``QuantizedTensorPair`` (``create_quantized_weight``), quantized as ``config`` says; the results
    are bit-identical to quantizing on the fly. One that requires grad gets its gradient in its
    original dtype (a pair's ``data``; fused accumulation reads ``main_grad`` off it), as long as
    the copies that gradient needs are at hand (else ``ValueError`` at the forward).

    Returns:
        ``C`` of shape ``[M, N]``, dtype ``out_dtype``.

    Backends (``PRIMUS_TURBO_GEMM_BACKEND=FP8:TRITON`` or ``set_gemm_backend(..., precision="FP8")``):
    TORCH (``torch._scaled_mm``, on CUDA and, where this torch's ``_scaled_mm`` runs them, on CPU;
    the default for TENSORWISE and ROWWISE where it can run them, except CPU tensors under the
    Triton interpreter, which go to TRITON),
    GLUON (Hopper sm_90 only; BLOCKWISE E4M3 without accumulation: the default for the forward
    GEMM and, with E4M3 gradients, the dgrad) and TRITON (every granularity; the default for the
    rest: MX_BLOCKWISE, the BLOCKWISE wgrad, HYBRID's E5M2 dgrad, non-Hopper devices).
    """
    if isinstance(a, torch.Tensor) and (amp := autocast_dtype(a)) is not None:  # core/amp.py
        return gemm_under_autocast(gemm_fp8, amp, a, b, trans_a, trans_b, out_dtype, config,
                                   fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
    config = Float8QuantConfig() if config is None else config
    m, n, k = _check_inputs(a, b, trans_a, trans_b, out_dtype, config, fuse_bgrad_accum_pattern)
    if out_dtype is None:
        out_dtype = a.dtype  # a QuantizedTensor's dtype is its original one
    fuse = fuse_bgrad_accum_pattern == "megatron"
    if m == 0 or n == 0 or k == 0:
        # a QuantizedTensor's .to() dequantizes, so its (zero) gradient still reaches it
        return _empty_result(a, _grad_operand(b), trans_a, trans_b, out_dtype, fuse)
    args = (bool(trans_a), bool(trans_b), out_dtype, config.granularity.name, config.fwd_dtype())
    block_size = int(config.block_size or 128)
    if torch.is_grad_enabled() and (_requires_grad(a) or _requires_grad(b)):
        b_t = b.data_t if isinstance(b, QuantizedTensorPair) else None
        bt = _grad_operand(b)
        out = GemmFP8Function.apply(a, bt, b_t, *args, config.bwd_dtype(), block_size, fuse)
        if fuse and bt.requires_grad:
            _flag_main_grad(bt)
        return out
    return _forward(a, b, *args, block_size, False, False)[0]
