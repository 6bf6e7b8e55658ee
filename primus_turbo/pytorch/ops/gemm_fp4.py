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

Operands are high-precision tensors, quantized here: ``QuantizedTensor`` operands are taken by the
FP8 GEMMs only (an MXFP4 ``QuantizedTensor`` is for storage and ``dequantize()``).

Each GEMM is a ``torch.library`` custom op (``primus_turbo::gemm_fp4_impl``,
``primus_turbo::gemm_fp4_accum_impl``) with a fake, called through ``torch.ops`` when traced so
``torch.compile(fullgraph=True)`` works; eager calls skip the custom-op dispatch.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends.gemm_fp4 import gemm_fp4_dispatcher
from ..core.backend import PrecisionType
from ..core.low_precision import Float4QuantConfig, ScalingRecipe
from ..core.quantized_tensor import QuantizedTensor
from .gemm import _FUSE_PATTERNS, _megatron_dummy_wgrad, check_main_grad
from .gemm_fp8 import _empty_result

__all__ = ["gemm_fp4"]

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
    a_row, a_col = _quantize(a, need_row=not trans_a or (wgrad_copy and trans_a),
                             need_col=trans_a or (wgrad_copy and not trans_a))
    # b: the forward reads op(B).T [N, K] grouped along K; grad_input reads op(B) [K, N] along N.
    b_row, b_col = _quantize(b, need_row=trans_b or (need_ga and not trans_b),
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
    """The three MXFP4 GEMMs of ``C = op(A) @ op(B)``; see the module docstring for the copies used."""

    @staticmethod
    def forward(ctx, a, b, trans_a, trans_b, out_dtype, fuse_accum, gradient_sr=False, use_rht=False):
        need_ga, need_gb = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.trans_a, ctx.trans_b, ctx.fuse_accum = trans_a, trans_b, fuse_accum
        ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
        ctx.gradient_sr = gradient_sr
        signs = None
        if use_rht and need_gb:
            from .quantization import random_hadamard_signs

            signs = random_hadamard_signs(_BLOCK, device=a.device)  # drawn on the device, no sync
        out, b_for_dgrad, a_for_wgrad = _forward(a, b, trans_a, trans_b, out_dtype, need_ga, need_gb, signs)
        # only the packed copies (and their scales) are kept for backward; b itself only for main_grad
        ctx.save_for_backward(*b_for_dgrad, *a_for_wgrad, b if (fuse_accum and need_gb) else None, signs)
        if fuse_accum and need_gb:
            b.grad_added_to_main_grad = True
        return out

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
                b.grad_added_to_main_grad = True
                grad_b = _megatron_dummy_wgrad(b)
            else:
                grad_b = _mm(P, Q, ctx.b_dtype)
        return grad_a, grad_b, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------
def _check_inputs(a, b, trans_a, trans_b, out_dtype, config, fuse_bgrad_accum_pattern):
    if not isinstance(config, Float4QuantConfig):
        raise TypeError(f"gemm_fp4: config must be a Float4QuantConfig or None, got {type(config).__name__}")
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or isinstance(t, QuantizedTensor):
            raise TypeError(f"gemm_fp4: {name} must be a torch.Tensor (bf16/fp16/fp32, quantized on the fly; "
                            f"QuantizedTensor operands are FP8-only: the FP8 GEMMs take them), got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"gemm_fp4: {name} must be 2-D, got {name}.dim()={t.dim()} with shape {tuple(t.shape)}")
        if t.dtype not in _HP_DTYPES:
            raise TypeError(f"gemm_fp4: {name}.dtype must be float32, float16 or bfloat16, got {t.dtype}")
    if a.dtype != b.dtype:
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
    if fuse_bgrad_accum_pattern == "megatron" and b.requires_grad and grads:
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

    Returns:
        ``C`` of shape ``[M, N]``, dtype ``out_dtype``.

    K must be a multiple of 32; with gradients, N (grad_input) and M (grad_weight) too. Hopper has
    no FP4 tensor cores: the TRITON backend decodes E2M1 in-kernel onto bf16 tensor cores, exactly
    (the result is the fp32 sum of the dequantized products).
    """
    config = Float4QuantConfig() if config is None else config
    m, n, k = _check_inputs(a, b, trans_a, trans_b, out_dtype, config, fuse_bgrad_accum_pattern)
    if out_dtype is None:
        out_dtype = a.dtype
    fuse = fuse_bgrad_accum_pattern == "megatron"
    if m == 0 or n == 0 or k == 0:
        return _empty_result(a, b, trans_a, trans_b, out_dtype, fuse)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return GemmFP4Function.apply(a, b, bool(trans_a), bool(trans_b), out_dtype, fuse,
                                     bool(config.use_gradient_sr), bool(config.use_rht))
    return _forward(a, b, bool(trans_a), bool(trans_b), out_dtype, False, False)[0]
