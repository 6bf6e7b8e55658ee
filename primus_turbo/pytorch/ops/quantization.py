"""FP8 / MXFP4 quantization: ``turbo.ops.quantize_fp8``, ``dequantize_fp8``, ``quantize_fp4``, ...

The contract (formats, scale shapes and formulas, layouts) is docs/low_precision.md; the
executable definition is ``primus_turbo.testing.quant_ref``, which the Triton kernels match bit
for bit. Every quantizer returns ``scale_inv``, the **dequantization multiplier**
(``x ~= q.float() * scale_inv`` over each block).

Backend: the Triton kernels (primus_turbo/triton/quantization) on CUDA, and on CPU under the
Triton interpreter (``TRITON_INTERPRET=1``); on plain CPU the reference runs, so the API works
everywhere (:func:`quant_backend`). The kernel entry points are ``torch.library`` custom ops
(``primus_turbo::quantize_fp8_impl``, ``quantize_fp8_with_trans_impl``, ``dequantize_fp8_impl``,
``quantize_fp4_impl``, ``quantize_fp4_with_trans_impl``, ``dequantize_fp4_impl``) with fake
implementations, so the functions work under ``torch.compile(fullgraph=True)``.

MXFP4 options (docs/low_precision.md): stochastic rounding (``ScalingRecipe(use_sr=True)`` with a
``seed`` read on the device) and the random Hadamard transform (``ScalingRecipe(use_rht=True)``
with ``rht_signs``; :func:`hadamard_transform`, :func:`random_hadamard_signs`). FP8 raises
``NotImplementedError`` for both. Every op rejects ``ScalingRecipe.shuffle_scale`` /
``shuffle_out`` (AMD AITER/hipBLASLt preshuffled layouts) with ``ValueError``
(:func:`~primus_turbo.pytorch.core.low_precision.check_scaling_recipe`).

Inputs: fp32 / bf16 / fp16. 2-D ``[rows, cols]``; inputs of more dims are accepted for
TENSORWISE and for ``axis=-1`` groupings (leading dims flattened, scales ``[*lead, n_groups]``),
for 1-D groups along any other axis, for BLOCKWISE ``b x b`` tiles per matrix and for MX
``quantize_fp8_with_trans`` per matrix (docs/low_precision.md, "API notes").
Non-contiguous inputs are copied to a contiguous tensor first. Empty inputs launch nothing and
return empty outputs with correctly shaped scales (a TENSORWISE scale of 1).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from primus_turbo.triton import is_interpreter, triton_available

from ..core.low_precision import (
    DEFAULT_BLOCK_SIZE,
    MXFP4_BLOCK_SIZE,
    MXFP8_BLOCK_SIZE,
    ScalingGranularity,
    ScalingRecipe,
    check_scaling_recipe,
)

__all__ = [
    "quantize_fp8",
    "quantize_fp8_with_trans",
    "dequantize_fp8",
    "quantize_fp4",
    "quantize_fp4_with_trans",
    "dequantize_fp4",
    "hadamard_transform",
    "random_hadamard_signs",
    "quant_backend",
]

_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)
#: what quantize_fp4 returns by default: float4_e2m1fn_x2, or uint8 on a torch without it
_FP4_PACKED = _FP4_DTYPE if _FP4_DTYPE is not None else torch.uint8
#: the out_dtype values quantize_fp4 / quantize_fp4_with_trans accept (the same bytes, viewed)
_FP4_OUT_DTYPES = tuple(d for d in (_FP4_DTYPE, torch.uint8) if d is not None)
_E8M0 = torch.float8_e8m0fnu
_G = ScalingGranularity


def quant_backend(x: torch.Tensor) -> str:
    """``"triton"`` on CUDA (and on CPU under ``TRITON_INTERPRET=1``), else ``"reference"``."""
    if triton_available() and (x.is_cuda or (x.device.type == "cpu" and is_interpreter())):
        return "triton"
    return "reference"


# ----------------------------------------------------------------------------------------------
# Validation and shapes
# ----------------------------------------------------------------------------------------------
def _granularity(value, op: str) -> ScalingGranularity:
    if isinstance(value, ScalingGranularity):
        return value
    if isinstance(value, str) and value.upper() in ScalingGranularity.__members__:
        return ScalingGranularity[value.upper()]
    valid = ", ".join(m.name for m in ScalingGranularity)
    raise ValueError(f"{op}: granularity={value!r} is not a ScalingGranularity; valid: {valid}")


def _check_x(x, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{op}: x.dtype must be float32, bfloat16 or float16, got {x.dtype}")


def _check_out_dtype(out_dtype, op: str) -> None:
    if out_dtype not in _FP8_DTYPES:
        raise TypeError(f"{op}: out_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {out_dtype}")


def _norm_axis(axis, ndim: int, op: str) -> int:
    """-1 for the last dim, else the dim's non-negative index (0 for a 2-D input's first dim);
    None means -1. Out-of-range axes raise ``ValueError``."""
    if axis is None:
        return -1
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{op}: axis must be an int or None, got {type(axis).__name__}")
    if axis in (-1, ndim - 1):
        return -1
    if -ndim <= axis < ndim:
        return axis % ndim
    raise ValueError(f"{op}: axis={axis} is out of range for a {ndim}-D input (a dim in [{-ndim}, {ndim - 1}]; "
                     f"-1 is the last)")


def _block_size(g: ScalingGranularity, block_size, op: str) -> int:
    """The block size a granularity uses (0 when it has none)."""
    if g == _G.BLOCKWISE:
        b = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 16 or b > 128 or (b & (b - 1)):
            raise ValueError(f"{op}: BLOCKWISE block_size must be a power of two in [16, 128], got {block_size!r}")
        return b
    if g == _G.MX_BLOCKWISE:
        if block_size not in (None, MXFP8_BLOCK_SIZE):
            raise ValueError(f"{op}: MX_BLOCKWISE block_size must be 32 (or None), got {block_size!r}")
        return MXFP8_BLOCK_SIZE
    if block_size is not None:
        raise ValueError(f"{op}: block_size is only for BLOCKWISE/MX_BLOCKWISE, got block_size={block_size!r} "
                         f"with {g.name}")
    return 0


def _use_2d(g: ScalingGranularity, recipe: Optional[ScalingRecipe], op: str) -> bool:
    if check_scaling_recipe(recipe, op) is None:
        return False
    if recipe.use_sr or recipe.use_rht:
        what = ("ScalingRecipe.use_sr=True (stochastic rounding)" if recipe.use_sr
                else "ScalingRecipe.use_rht=True (random Hadamard transform)")
        raise NotImplementedError(f"{op}: {what} is not implemented for FP8; it is MXFP4-only "
                                  f"(quantize_fp4; scaling_recipe={recipe})")
    return bool(recipe.use_2d_block) and g == _G.BLOCKWISE


def _fp4_recipe(recipe: Optional[ScalingRecipe], op: str) -> tuple[bool, bool]:
    """(use_sr, use_rht) of an MXFP4 recipe; use_2d_block does not apply to MXFP4 (1 x 32 groups)."""
    if check_scaling_recipe(recipe, op) is None:
        return False, False
    return bool(recipe.use_sr), bool(recipe.use_rht)


def _view_2d(shape: tuple, g: ScalingGranularity, axis: int, use_2d: bool, op: str) -> tuple[int, int]:
    """(rows, cols) of the 2-D view the kernels see."""
    if g == _G.TENSORWISE:
        n = math.prod(shape)
        if len(shape) == 2:
            return shape[0], shape[1]
        return (1, n)
    if len(shape) == 2:
        return shape[0], shape[1]
    if len(shape) > 2 and axis == -1 and not use_2d:
        return math.prod(shape[:-1]), shape[-1]
    raise ValueError(f"{op}: expected a 2-D tensor (N-D only with axis=-1 and 1-D blocks), got shape {tuple(shape)}")


def _block(g: ScalingGranularity, b: int, axis: int, use_2d: bool, rows: int, cols: int) -> tuple[int, int]:
    """(br, bc): the block one scale covers, in the 2-D view."""
    if g == _G.TENSORWISE:
        return max(rows, 1), max(cols, 1)
    if g == _G.ROWWISE:
        return (max(rows, 1), 1) if axis == 0 else (1, max(cols, 1))
    if use_2d:
        return b, b
    return (b, 1) if axis == 0 else (1, b)


def _scale_shape(shape: tuple, g, rows, cols, br, bc) -> tuple:
    if g == _G.TENSORWISE:
        return ()
    sr, sc = -(-rows // br), -(-cols // bc)
    if len(shape) > 2:
        return (*shape[:-1], sc)
    return (sr, sc)


def _nd_form(ndim: int, g: ScalingGranularity, axis: int, use_2d: bool) -> Optional[str]:
    """Which N-D form (ndim > 2) an input takes, beyond the flattened-view forms of
    :func:`_view_2d`: ``"tiles"`` (BLOCKWISE ``b x b`` tiles of each matrix over the last two dims),
    ``"along"`` (1-D groups along a non-last ``axis``), or None."""
    if ndim <= 2 or g == _G.TENSORWISE:
        return None
    if use_2d:
        return "tiles"
    return "along" if axis != -1 else None


def _check_nd_form(shape: tuple, g: ScalingGranularity, axis: int, form: Optional[str], op: str) -> None:
    if form == "tiles" and axis not in (-1, len(shape) - 2):
        raise ValueError(f"{op}: BLOCKWISE b x b blocks (use_2d_block) tile the last two dims of each matrix; "
                         f"axis={axis} of a {len(shape)}-D input is a batch dim (use axis -1 or -2, or None)")
    if form == "along" and g == _G.MX_BLOCKWISE and shape[axis] % MXFP8_BLOCK_SIZE:
        raise ValueError(f"{op}: MX_BLOCKWISE needs the quantized dim to be a multiple of 32, got "
                         f"{shape[axis]} (axis={axis}, shape {tuple(shape)})")


def _fp8_scale_shape(shape: tuple, g: ScalingGranularity, b: int, axis: int, use_2d: bool, op: str) -> tuple:
    """The ``scale_inv`` shape :func:`quantize_fp8` returns for an input of ``shape``."""
    form = _nd_form(len(shape), g, axis, use_2d)
    if form == "tiles":  # [*lead, ceil(M/b), ceil(N/b)]
        return (*shape[:-2], -(-shape[-2] // b), -(-shape[-1] // b))
    if form == "along":  # shape with dim `axis` replaced by its number of groups
        n = shape[axis]
        return (*shape[:axis], -(-n // (max(n, 1) if g == _G.ROWWISE else b)), *shape[axis + 1:])
    rows, cols = _view_2d(shape, g, axis, use_2d, op)
    br, bc = _block(g, b, axis, use_2d, rows, cols)
    return _scale_shape(shape, g, rows, cols, br, bc)


def _check_mx_dim(g, axis, rows, cols, op: str) -> None:
    if g != _G.MX_BLOCKWISE:
        return
    n = rows if axis == 0 else cols
    if n % MXFP8_BLOCK_SIZE:
        raise ValueError(f"{op}: MX_BLOCKWISE needs the quantized dim to be a multiple of 32, got "
                         f"{n} (axis={axis}, 2-D view {rows}x{cols})")


_TRITON_QUANT: list = []


def _tq():
    """primus_turbo.triton.quantization (imported on first use: triton is optional). A function-level
    ``from ... import`` costs a few microseconds of import machinery per call on the hot path;
    attributes are still looked up at call time, so patching the module's launchers still works."""
    if not _TRITON_QUANT:
        import primus_turbo.triton.quantization as mod

        _TRITON_QUANT.append(mod)
    return _TRITON_QUANT[0]


def _grouping_uncached(g, br, bc):
    mode = {_G.TENSORWISE: 2, _G.MX_BLOCKWISE: 1}.get(g, 0)
    return _tq().QuantGrouping(mode, br, bc)


_grouping_cached = functools.lru_cache(maxsize=1024)(_grouping_uncached)


def _grouping(g, br, bc):
    """The kernels' QuantGrouping of (granularity, block rows, block cols), cached per value (two
    per quantization on the hot path); symbolic sizes (unhashable) are built each time."""
    try:
        return _grouping_cached(g, br, bc)
    except TypeError:
        return _grouping_uncached(g, br, bc)


def _scale_dtype(g) -> torch.dtype:
    return _E8M0 if g == _G.MX_BLOCKWISE else torch.float32


def _empty_scale(shape, g, device) -> torch.Tensor:
    if g == _G.TENSORWISE:
        return torch.ones((), dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=_scale_dtype(g), device=device)


# ----------------------------------------------------------------------------------------------
# Custom ops (eager bodies take validated, normalized arguments)
# ----------------------------------------------------------------------------------------------
def _quantize_fp8_eager(x: torch.Tensor, out_dtype: torch.dtype, granularity: str, block_size: int, axis: int,
                        use_2d_block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = _G[granularity]
    shape = tuple(x.shape)
    rows, cols = _view_2d(shape, g, axis, use_2d_block, "quantize_fp8")
    br, bc = _block(g, block_size, axis, use_2d_block, rows, cols)
    s_shape = _scale_shape(shape, g, rows, cols, br, bc)
    if x.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device), _empty_scale(s_shape, g, x.device)
    if quant_backend(x) == "reference":
        from primus_turbo.testing.quant_ref import quantize_fp8_ref

        return quantize_fp8_ref(x, out_dtype, g, block_size=block_size or None, axis=axis,
                                scaling_recipe=ScalingRecipe(use_2d_block=use_2d_block))
    q, s = _tq().fp8_quant_launch(x.contiguous().view(rows, cols), out_dtype, _grouping(g, br, bc))
    if g == _G.MX_BLOCKWISE:
        s = s.view(_E8M0)
    return q.view(shape), s.view(s_shape)


quantize_fp8_impl = torch.library.custom_op("primus_turbo::quantize_fp8_impl", _quantize_fp8_eager, mutates_args=())


@quantize_fp8_impl.register_fake
def _quantize_fp8_fake(x, out_dtype, granularity, block_size, axis, use_2d_block):
    g = _G[granularity]
    shape = tuple(x.shape)
    rows, cols = _view_2d(shape, g, axis, use_2d_block, "quantize_fp8")
    br, bc = _block(g, block_size, axis, use_2d_block, rows, cols)
    s_shape = _scale_shape(shape, g, rows, cols, br, bc)
    return x.new_empty(shape, dtype=out_dtype), x.new_empty(s_shape, dtype=_scale_dtype(g))


def _quantize_fp8_blocks_batched_eager(x: torch.Tensor, out_dtype: torch.dtype, block_size: int
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    nb, rows, cols = x.shape
    s_shape = (nb, -(-rows // block_size), -(-cols // block_size))
    if x.numel() == 0:
        return torch.empty(tuple(x.shape), dtype=out_dtype, device=x.device), torch.empty(
            s_shape, dtype=torch.float32, device=x.device)
    if quant_backend(x) == "reference":  # no Triton kernel here: each matrix alone
        from primus_turbo.testing.quant_ref import quantize_fp8_ref

        qs = [quantize_fp8_ref(x[i], out_dtype, _G.BLOCKWISE, block_size=block_size, axis=-1,
                               scaling_recipe=ScalingRecipe(use_2d_block=True)) for i in range(nb)]
        return torch.stack([q for q, _ in qs]), torch.stack([sc for _, sc in qs])
    from primus_turbo.triton.quantization import fp8_quant_batched_launch

    return fp8_quant_batched_launch(x, out_dtype, _grouping(_G.BLOCKWISE, block_size, block_size))


quantize_fp8_blocks_batched_impl = torch.library.custom_op(
    "primus_turbo::quantize_fp8_blocks_batched_impl", _quantize_fp8_blocks_batched_eager, mutates_args=()
)


@quantize_fp8_blocks_batched_impl.register_fake
def _quantize_fp8_blocks_batched_fake(x, out_dtype, block_size):
    nb, rows, cols = x.shape
    return (x.new_empty(tuple(x.shape), dtype=out_dtype),
            x.new_empty((nb, -(-rows // block_size), -(-cols // block_size)), dtype=torch.float32))


def _quantize_fp8_blocks_batched(x: torch.Tensor, out_dtype: torch.dtype, block_size: int
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """BLOCKWISE ``b x b`` quantization of every matrix of ``x [B, R, C]`` (grouped-GEMM expert
    weights): ``(q [B, R, C], scale_inv [B, ceil(R/b), ceil(C/b)] fp32)``, bit-identical to
    ``quantize_fp8(x[i], out_dtype, BLOCKWISE, block_size=b, scaling_recipe=ScalingRecipe(
    use_2d_block=True))`` for each ``i`` stacked, for any R (blocks never straddle two matrices;
    the last block row of each covers ``R % b`` rows). One Triton launch on CUDA / under the
    interpreter; the per-matrix reference otherwise. Arguments are validated by the caller."""
    return _call(torch.ops.primus_turbo.quantize_fp8_blocks_batched_impl, _quantize_fp8_blocks_batched_eager,
                 x, out_dtype, block_size)


def _quantize_fp8_blocks_batched_t_eager(x: torch.Tensor, out_dtype: torch.dtype, block_size: int
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.numel() == 0 or quant_backend(x) == "reference":
        q, s = _quantize_fp8_blocks_batched_eager(x, out_dtype, block_size)
        return q, s, q.transpose(1, 2).contiguous()
    from primus_turbo.triton.quantization import fp8_quant_batched_launch

    return fp8_quant_batched_launch(x, out_dtype, _grouping(_G.BLOCKWISE, block_size, block_size), with_trans=True)


quantize_fp8_blocks_batched_t_impl = torch.library.custom_op(
    "primus_turbo::quantize_fp8_blocks_batched_t_impl", _quantize_fp8_blocks_batched_t_eager, mutates_args=()
)


@quantize_fp8_blocks_batched_t_impl.register_fake
def _quantize_fp8_blocks_batched_t_fake(x, out_dtype, block_size):
    nb, rows, cols = x.shape
    return (*_quantize_fp8_blocks_batched_fake(x, out_dtype, block_size),
            x.new_empty((nb, cols, rows), dtype=out_dtype))


def _quantize_fp8_blocks_batched_t(x: torch.Tensor, out_dtype: torch.dtype, block_size: int
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_quantize_fp8_blocks_batched` plus each matrix's codes transposed, ``qt [B, C, R]``
    (``q.transpose(1, 2)`` bit for bit; its scales are ``scale.transpose(1, 2)``, the b x b blocks
    transposing with the matrix), in one launch (``x`` read once from DRAM): the forward and
    grad_input copies of grouped-GEMM expert weights. Needs 128 x 128 blocks and R % 4 == 0
    (validated by the caller)."""
    return _call(torch.ops.primus_turbo.quantize_fp8_blocks_batched_t_impl, _quantize_fp8_blocks_batched_t_eager,
                 x, out_dtype, block_size)


def _with_trans_shapes(rows, cols, g, b, use_2d, use_2d_t):
    """(row blocks, column blocks, scale shape, transposed scale shape), cached per value (the
    per-call shape arithmetic of the hot path); symbolic sizes (unhashable) are computed each time."""
    try:
        return _with_trans_shapes_cached(rows, cols, g, b, use_2d, use_2d_t)
    except TypeError:
        return _with_trans_shapes_uncached(rows, cols, g, b, use_2d, use_2d_t)


def _with_trans_shapes_uncached(rows, cols, g, b, use_2d, use_2d_t):
    br, bc = _block(g, b, -1, use_2d, rows, cols)
    tbr, tbc = _block(g, b, 0, use_2d_t, rows, cols)  # column copy's blocks, in x's coordinates
    if g == _G.TENSORWISE:
        return (br, bc), (tbr, tbc), (), ()
    s_shape = (-(-rows // br), -(-cols // bc))
    st_shape = (-(-cols // tbc), -(-rows // tbr))  # stored transposed
    return (br, bc), (tbr, tbc), s_shape, st_shape


_with_trans_shapes_cached = functools.lru_cache(maxsize=1024)(_with_trans_shapes_uncached)


def _col_major_scales(g, use_2d: bool) -> bool:
    """Whether :func:`quantize_fp8_with_trans` returns a copy's scales column-major: MX and 1-D
    BLOCKWISE blocks (see its docstring)."""
    return g == _G.MX_BLOCKWISE or (g == _G.BLOCKWISE and not use_2d)


def _is_column_major(s: torch.Tensor) -> bool:
    """``s.t().is_contiguous()`` of a 2-D ``s``, from its sizes and strides (no ``t`` op per call)."""
    r, c = s.shape
    if r == 0 or c == 0:
        return True
    s0, s1 = s.stride()
    return (r == 1 or s0 == 1) and (c == 1 or s1 == r)


def _column_major(s: torch.Tensor) -> torch.Tensor:
    """``s`` (2-D) with the same shape and values, stored column-major (a copy only where it is not)."""
    return s if _is_column_major(s) else s.t().contiguous().t()


def _quantize_fp8_with_trans_eager(x: torch.Tensor, out_dtype: torch.dtype, granularity: str, block_size: int,
                                   use_2d_block: bool, use_2d_block_t: bool
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, s, qt, st = _quantize_fp8_with_trans_any_layout(x, out_dtype, granularity, block_size, use_2d_block,
                                                       use_2d_block_t)
    g = _G[granularity]
    if _col_major_scales(g, use_2d_block):
        s = _column_major(s)
    if _col_major_scales(g, use_2d_block_t):
        st = _column_major(st)
    return q, s, qt, st


def _quantize_fp8_with_trans_any_layout(x: torch.Tensor, out_dtype: torch.dtype, granularity: str,
                                        block_size: int, use_2d_block: bool, use_2d_block_t: bool
                                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _G[granularity]
    rows, cols = x.shape
    (br, bc), (tbr, tbc), s_shape, st_shape = _with_trans_shapes(rows, cols, g, block_size, use_2d_block,
                                                                 use_2d_block_t)
    dev = x.device
    if x.numel() == 0:
        return (torch.empty((rows, cols), dtype=out_dtype, device=dev), _empty_scale(s_shape, g, dev),
                torch.empty((cols, rows), dtype=out_dtype, device=dev), _empty_scale(st_shape, g, dev))
    if quant_backend(x) == "reference":
        from primus_turbo.testing.quant_ref import quantize_fp8_ref

        q, s = quantize_fp8_ref(x, out_dtype, g, block_size=block_size or None, axis=-1,
                                scaling_recipe=ScalingRecipe(use_2d_block=use_2d_block))
        qt, st = quantize_fp8_ref(x.t().contiguous(), out_dtype, g, block_size=block_size or None, axis=-1,
                                  scaling_recipe=ScalingRecipe(use_2d_block=use_2d_block_t))
        return q, s, qt, st
    q, s, qt, st = _tq().fp8_quant_with_trans_launch(x.contiguous(), out_dtype, _grouping(g, br, bc),
                                                     _grouping(g, tbr, tbc))
    if g == _G.MX_BLOCKWISE:
        s, st = s.view(_E8M0), st.view(_E8M0)
    return q, s, qt, st


quantize_fp8_with_trans_impl = torch.library.custom_op(
    "primus_turbo::quantize_fp8_with_trans_impl", _quantize_fp8_with_trans_eager, mutates_args=()
)


@quantize_fp8_with_trans_impl.register_fake
def _quantize_fp8_with_trans_fake(x, out_dtype, granularity, block_size, use_2d_block, use_2d_block_t):
    g = _G[granularity]
    rows, cols = x.shape
    _, _, s_shape, st_shape = _with_trans_shapes(rows, cols, g, block_size, use_2d_block, use_2d_block_t)
    sd = _scale_dtype(g)

    def scale(shape, use_2d):
        if _col_major_scales(g, use_2d):
            return x.new_empty(shape[::-1], dtype=sd).t()
        return x.new_empty(shape, dtype=sd)

    return (x.new_empty((rows, cols), dtype=out_dtype), scale(s_shape, use_2d_block),
            x.new_empty((cols, rows), dtype=out_dtype), scale(st_shape, use_2d_block_t))


def _dequantize_fp8_eager(x: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype, granularity: str,
                          block_size: int, axis: int, use_2d_block: bool) -> torch.Tensor:
    g = _G[granularity]
    shape = tuple(x.shape)
    if x.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device)
    rows, cols = _view_2d(shape, g, axis, use_2d_block, "dequantize_fp8")
    br, bc = _block(g, block_size, axis, use_2d_block, rows, cols)
    if quant_backend(x) == "reference":
        from primus_turbo.testing.quant_ref import dequantize_fp8_ref

        return dequantize_fp8_ref(x, scale_inv, g, block_size=block_size or None, axis=axis,
                                  scaling_recipe=ScalingRecipe(use_2d_block=use_2d_block), out_dtype=out_dtype)
    from primus_turbo.triton.quantization import fp8_dequant_launch

    s = scale_inv
    if g != _G.TENSORWISE:
        s = s.contiguous().view(-(-rows // br), -(-cols // bc))
        if g == _G.MX_BLOCKWISE:
            s = s.view(torch.uint8)
    out = fp8_dequant_launch(x.contiguous().view(rows, cols), s.contiguous(), _grouping(g, br, bc), out_dtype)
    return out.view(shape)


dequantize_fp8_impl = torch.library.custom_op(
    "primus_turbo::dequantize_fp8_impl", _dequantize_fp8_eager, mutates_args=()
)


@dequantize_fp8_impl.register_fake
def _dequantize_fp8_fake(x, scale_inv, out_dtype, granularity, block_size, axis, use_2d_block):
    return x.new_empty(x.shape, dtype=out_dtype)


def _fp4_packed_dtype() -> torch.dtype:
    return _FP4_DTYPE if _FP4_DTYPE is not None else torch.uint8


def _fp4_shapes(rows: int, cols: int, axis: int):
    if axis == 0:
        return (rows // 2, cols), (rows // MXFP4_BLOCK_SIZE, cols)
    return (rows, cols // 2), (rows, cols // MXFP4_BLOCK_SIZE)


def _sr_uniforms_ref(x: torch.Tensor, axis: int, seed: torch.Tensor) -> torch.Tensor:
    """The reference backend's SR uniforms (shaped like x): torch's CPU generator seeded with the
    seed, drawn in the view whose rows are the quantized vectors. Reproducible for a given seed,
    but not the Triton kernel's Philox stream."""
    g = torch.Generator().manual_seed(int(seed.reshape(-1)[0].item()))
    rows, cols = x.shape
    if axis == 0:
        return torch.rand((cols, rows), generator=g).t()
    return torch.rand((rows, cols), generator=g)


def _quantize_fp4_eager(x: torch.Tensor, axis: int, seed: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of x along axis; stochastic rounding keyed by ``seed`` (one int64 on x's device) when given."""
    rows, cols = x.shape
    p_shape, s_shape = _fp4_shapes(rows, cols, axis)
    if x.numel() == 0:
        return (torch.empty(p_shape, dtype=torch.uint8, device=x.device).view(_fp4_packed_dtype()),
                torch.empty(s_shape, dtype=_E8M0, device=x.device))
    if quant_backend(x) == "reference":
        from primus_turbo.testing.quant_ref import quantize_fp4_ref

        rand = None if seed is None else _sr_uniforms_ref(x, axis, seed).to(x.device)
        return quantize_fp4_ref(x, axis=axis, rand=rand)
    from primus_turbo.triton.quantization import fp4_quant_launch

    p, s = fp4_quant_launch(x.contiguous(), axis == -1, seed=seed, sr=seed is not None)
    return p.view(_fp4_packed_dtype()), s.view(_E8M0)


quantize_fp4_impl = torch.library.custom_op("primus_turbo::quantize_fp4_impl", _quantize_fp4_eager, mutates_args=())


@quantize_fp4_impl.register_fake
def _quantize_fp4_fake(x, axis, seed=None):
    p_shape, s_shape = _fp4_shapes(x.shape[0], x.shape[1], axis)
    return x.new_empty(p_shape, dtype=_fp4_packed_dtype()), x.new_empty(s_shape, dtype=_E8M0)


def _quantize_fp4_with_trans_eager(x: torch.Tensor, seed: Optional[torch.Tensor] = None, sr: bool = False,
                                   sr_t: bool = False
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both copies from one read; SR of the row copy keyed by ``seed``, of the transposed copy by
    ``seed + 1`` (``sr`` / ``sr_t``)."""
    rows, cols = x.shape
    if x.numel() == 0 or quant_backend(x) == "reference":
        p, s = _quantize_fp4_eager(x, -1, seed if sr else None)
        pt, st = _quantize_fp4_eager(x.t().contiguous(), -1, seed + 1 if sr_t else None)
        return p, _column_major(s), pt, _column_major(st)
    from primus_turbo.triton.quantization import fp4_quant_launch

    p, s, pt, st = fp4_quant_launch(x.contiguous(), True, with_trans=True, seed=seed, sr=sr, sr_t=sr_t)
    d = _fp4_packed_dtype()
    # the scales column-major on every path (see quantize_fp4_with_trans)
    return p.view(d), _column_major(s.view(_E8M0)), pt.view(d), _column_major(st.view(_E8M0))


quantize_fp4_with_trans_impl = torch.library.custom_op(
    "primus_turbo::quantize_fp4_with_trans_impl", _quantize_fp4_with_trans_eager, mutates_args=()
)


@quantize_fp4_with_trans_impl.register_fake
def _quantize_fp4_with_trans_fake(x, seed=None, sr=False, sr_t=False):
    rows, cols = x.shape
    d = _fp4_packed_dtype()
    return (x.new_empty((rows, cols // 2), dtype=d), x.new_empty((cols // 32, rows), dtype=_E8M0).t(),
            x.new_empty((cols, rows // 2), dtype=d), x.new_empty((rows // 32, cols), dtype=_E8M0).t())


def _dequantize_fp4_eager(x: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype, axis: int) -> torch.Tensor:
    rows, cols = (x.shape[0] * 2, x.shape[1]) if axis == 0 else (x.shape[0], x.shape[1] * 2)
    if x.numel() == 0:
        return torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    if quant_backend(x) == "reference":
        from primus_turbo.testing.quant_ref import dequantize_fp4_ref

        return dequantize_fp4_ref(x, scale_inv, axis=axis, out_dtype=out_dtype)
    from primus_turbo.triton.quantization import fp4_dequant_launch

    return fp4_dequant_launch(x.contiguous().view(torch.uint8), scale_inv.contiguous().view(torch.uint8),
                              axis == -1, out_dtype)


dequantize_fp4_impl = torch.library.custom_op(
    "primus_turbo::dequantize_fp4_impl", _dequantize_fp4_eager, mutates_args=()
)


@dequantize_fp4_impl.register_fake
def _dequantize_fp4_fake(x, scale_inv, out_dtype, axis):
    shape = (x.shape[0] * 2, x.shape[1]) if axis == 0 else (x.shape[0], x.shape[1] * 2)
    return x.new_empty(shape, dtype=out_dtype)


def _call(op, eager, *args):
    # Eager calls skip the custom-op dispatcher; traced code must see the op.
    if torch.compiler.is_compiling():
        return op(*args)
    return eager(*args)


# ----------------------------------------------------------------------------------------------
# Byte transpose of quantized data (the GEMM ops' K-major copies)
# ----------------------------------------------------------------------------------------------
def _transpose_bytes(t: torch.Tensor, row_align: int = 1) -> torch.Tensor:
    """``t.transpose(-2, -1)`` of a 1-byte tensor (FP8, packed FP4, E8M0) as a new tensor:
    ``[R, C] -> [C, R]`` or batched ``[G, R, C] -> [G, C, R]``.

    The Triton byte-transpose kernel (one launch for any G, near copy speed) on CUDA and under the
    interpreter; torch's copy of the uint8 view on CPU without it. torch's eager strided copy of a
    byte transpose runs far below copy speed, which is why the kernel exists. ``row_align > 1``: the
    result's rows start at multiples of ``row_align`` elements (it is a ``[..., :R]`` view of a
    buffer whose rows are rounded up), so a kernel reading it sees a 16-divisible row stride
    (16-byte vectors) whatever R.

    Under torch.compile it is a custom op, so compiled code runs the same kernel as eager (and
    inductor never sees the uint8 <-> FP8 / FP4 dtype views, which its codegen handles unevenly
    across torch versions: a bool -> uint8 view failed to lower in torch 2.11).
    """
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.transpose_bytes(t, row_align)
    return _transpose_bytes_eager(t, row_align)


def _transposed_bytes_buffer(t: torch.Tensor, row_align: int) -> torch.Tensor:
    """The uint8 result buffer of a byte transpose of ``t`` (rows rounded up to ``row_align``)."""
    *lead, r, c = t.shape
    rp = -(-r // row_align) * row_align if r else r
    buf = torch.empty((*lead, c, rp), dtype=torch.uint8, device=t.device)
    return buf[..., :r] if rp != r else buf


def _transpose_bytes_eager(t: torch.Tensor, row_align: int) -> torch.Tensor:
    out = _transposed_bytes_buffer(t, row_align)
    src = t.view(torch.uint8)
    if quant_backend(t) != "triton":
        out.copy_(src.transpose(-2, -1))
    else:
        _tq().transpose_bytes(src, out)
    return out.view(t.dtype)


transpose_bytes_impl = torch.library.custom_op("primus_turbo::transpose_bytes", _transpose_bytes_eager,
                                               mutates_args=())


@transpose_bytes_impl.register_fake
def _transpose_bytes_fake(t, row_align):
    return _transposed_bytes_buffer(t, row_align).view(t.dtype)


# ----------------------------------------------------------------------------------------------
# N-D forms, built from the 2-D ops by reshapes, byte transposes and the batched launch
# ----------------------------------------------------------------------------------------------
def _along_dims(shape: tuple, axis: int) -> tuple[int, int, int]:
    """``x`` seen as ``[a, l, c]``: the dims before ``axis``, ``axis`` itself, the dims after it."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def _along_view(g: ScalingGranularity, b: int, a: int, l: int, c: int) -> Optional[int]:
    """Which 2-D view of ``[a, l, c]`` forms each ``[l, c]`` matrix's groups along ``l`` exactly as
    alone: ``-1``: ``[a, l]`` grouped along its rows (``c == 1``); ``0``: ``[a * l, c]`` grouped
    down its columns (one matrix, or blocks of ``b`` dividing ``l``: none straddles two matrices);
    None: neither (a ROWWISE column or a block would span matrices)."""
    if c == 1:
        return -1
    if a == 1 or (g != _G.ROWWISE and l % b == 0):
        return 0
    return None


def _quantize_fp8_along(x: torch.Tensor, out_dtype: torch.dtype, g: ScalingGranularity, b: int, axis: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """ROWWISE / 1-D BLOCKWISE / MX groups along a non-last ``axis`` of an N-D ``x``: equal to the
    quantization of ``x.movedim(axis, -1)`` along its last dim, moved back (data in x's shape,
    scales shaped like x with dim ``axis`` holding the groups)."""
    shape = tuple(x.shape)
    s_shape = _fp8_scale_shape(shape, g, b, axis, False, "quantize_fp8")
    if x.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device), _empty_scale(s_shape, g, x.device)
    a, l, c = _along_dims(shape, axis)
    view = _along_view(g, b, a, l, c)
    op = torch.ops.primus_turbo.quantize_fp8_impl
    if view == -1:
        q, s = _call(op, _quantize_fp8_eager, x.reshape(a, l), out_dtype, g.name, b, -1, False)
    elif view == 0:
        q, s = _call(op, _quantize_fp8_eager, x.reshape(a * l, c), out_dtype, g.name, b, 0, False)
    else:  # the moved axis as rows of [a * c, l] (a copy of x), the codes transposed back
        xt = x.reshape(a, l, c).transpose(1, 2).reshape(a * c, l)
        qt, st = _call(op, _quantize_fp8_eager, xt, out_dtype, g.name, b, -1, False)
        q = _transpose_bytes(qt.view(a, c, l))
        s = st.view(a, c, -1).transpose(1, 2).contiguous()
    return q.view(shape), s.view(s_shape)


def _dequantize_fp8_along(x: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype, g: ScalingGranularity,
                          b: int, axis: int) -> torch.Tensor:
    """The inverse of :func:`_quantize_fp8_along` (the same views)."""
    shape = tuple(x.shape)
    if x.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device)
    a, l, c = _along_dims(shape, axis)
    n = _fp8_scale_shape(shape, g, b, axis, False, "dequantize_fp8")[axis]
    view = _along_view(g, b, a, l, c)
    op = torch.ops.primus_turbo.dequantize_fp8_impl
    if view == -1:
        out = _call(op, _dequantize_fp8_eager, x.reshape(a, l), scale_inv.reshape(a, n), out_dtype, g.name, b, -1,
                    False)
    elif view == 0:
        out = _call(op, _dequantize_fp8_eager, x.reshape(a * l, c), scale_inv.reshape(a * n, c), out_dtype, g.name,
                    b, 0, False)
    else:
        xt = _transpose_bytes(x.reshape(a, l, c)).view(a * c, l)
        st = scale_inv.reshape(a, n, c).transpose(1, 2).reshape(a * c, n)
        out = _call(op, _dequantize_fp8_eager, xt, st, out_dtype, g.name, b, -1, False)
        out = out.view(a, c, l).transpose(1, 2)
    return out.reshape(shape)


def _quantize_fp8_tiles(x: torch.Tensor, out_dtype: torch.dtype, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BLOCKWISE ``b x b`` tiles of every matrix of ``x [*lead, M, N]``: ``(q [*lead, M, N],
    scale_inv [*lead, ceil(M/b), ceil(N/b)])``, each matrix quantized as alone."""
    shape = tuple(x.shape)
    *lead, m, n = shape
    p = math.prod(lead)
    s_shape = (*lead, -(-m // b), -(-n // b))
    if x.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device), _empty_scale(s_shape, _G.BLOCKWISE, x.device)
    if p == 1 or m % b == 0:  # the tiles of [p * m, n] never straddle two matrices
        q, s = _call(torch.ops.primus_turbo.quantize_fp8_impl, _quantize_fp8_eager, x.reshape(p * m, n), out_dtype,
                     _G.BLOCKWISE.name, b, -1, True)
    else:  # each matrix's last tile row covers m % b rows: the batched launch
        q, s = _quantize_fp8_blocks_batched(x.reshape(p, m, n), out_dtype, b)
    return q.view(shape), s.view(s_shape)


def _dequantize_fp8_tiles(x: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype, b: int) -> torch.Tensor:
    """The inverse of :func:`_quantize_fp8_tiles`."""
    shape = tuple(x.shape)
    if x.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device)
    *lead, m, n = shape
    p, nr, nc = math.prod(lead), -(-m // b), -(-n // b)
    s = scale_inv.reshape(p, nr, nc)
    op = torch.ops.primus_turbo.dequantize_fp8_impl
    if p == 1 or m % b == 0:
        out = _call(op, _dequantize_fp8_eager, x.reshape(p * m, n), s.reshape(p * nr, nc), out_dtype,
                    _G.BLOCKWISE.name, b, -1, True)
    else:  # every row takes its tile row's scales: 1 x b blocks of [p * m, n], the same products
        rows = s.repeat_interleave(b, dim=1)[:, :m].reshape(p * m, nc)
        out = _call(op, _dequantize_fp8_eager, x.reshape(p * m, n), rows, out_dtype, _G.BLOCKWISE.name, b, -1,
                    False)
    return out.view(shape)


def _quantize_fp8_with_trans_mx_nd(x: torch.Tensor, out_dtype: torch.dtype
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8_with_trans` MX of every matrix of ``x [*lead, M, N]`` (M, N % 32 == 0):
    the one-read 2-D op on ``[p * M, N]``, whose 32 x 1 column blocks never straddle two matrices;
    the transposed copies ``[p, N, M]`` are its ``[N, p * M]`` copy with the matrices' columns
    regrouped (a byte copy), and each matrix's scales are column-major as the 2-D op's."""
    *lead, m, n = x.shape
    p, k = math.prod(lead), MXFP8_BLOCK_SIZE
    q, s, qt, st = _call(torch.ops.primus_turbo.quantize_fp8_with_trans_impl, _quantize_fp8_with_trans_eager,
                         x.reshape(p * m, n), out_dtype, _G.MX_BLOCKWISE.name, k, False, False)
    s = s.t().reshape(n // k, p, m).permute(1, 0, 2).contiguous().transpose(1, 2).reshape(*lead, m, n // k)
    qt = qt.view(n, p, m).permute(1, 0, 2).contiguous().view(*lead, n, m)
    st = st.reshape(n, p, m // k).permute(1, 0, 2).reshape(*lead, n, m // k)
    return q.view(x.shape), s, qt, st


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def quantize_fp8(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity,
    *,
    block_size: Optional[int] = None,
    axis: Optional[int] = None,
    scaling_recipe: Optional[ScalingRecipe] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to FP8 with dynamic scales (docs/low_precision.md).

    Args:
        x: ``[rows, cols]`` float32, bfloat16 or float16, or N-D (see below).
        out_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        granularity: ``ScalingGranularity`` (or its name): TENSORWISE, ROWWISE, BLOCKWISE, MX_BLOCKWISE.
        block_size: BLOCKWISE block, a power of two in [16, 128] (default 128); MX_BLOCKWISE: 32 or None.
        axis: ``-1`` (default; groups along the last dim) or any other dim (``0``: groups down the
            columns of a 2-D ``x``). Ignored by TENSORWISE; ``b x b`` tiles accept -1 / -2 (of an
            N-D ``x``, a batch axis raises).
        scaling_recipe: ``ScalingRecipe(use_2d_block=True)`` gives BLOCKWISE ``b x b`` tiles (weights).

    N-D ``x``: TENSORWISE has one scale; ``axis=-1`` groups flatten the leading dims (scales
    ``[*lead, n_groups]``); groups along another dim ``k`` equal those of ``x.movedim(k, -1)``
    moved back: scales shaped like ``x`` with dim ``k`` holding the groups (ROWWISE ``1``, BLOCKWISE
    ``ceil(n/b)``, MX ``n/32``), e.g. MX ``[G, M, N]`` with ``axis=-2``: ``[G, M/32, N]``, each
    matrix as the 2-D ``axis=0`` op. ``b x b`` tiles of ``[*lead, M, N]``: each matrix on its own,
    scales ``[*lead, ceil(M/b), ceil(N/b)]``.

    Returns:
        ``(x_fp8, scale_inv)``: ``x_fp8`` shaped like ``x``; ``scale_inv`` the dequantization
        multiplier per block: ``[]`` fp32 (TENSORWISE), ``[rows, 1]`` / ``[1, cols]`` (ROWWISE),
        ``[rows, ceil(cols/b)]`` / ``[ceil(rows/b), cols]`` / ``[ceil(rows/b), ceil(cols/b)]``
        (BLOCKWISE 1 x b along -1 / along 0 / b x b), ``[rows, cols/32]`` / ``[rows/32, cols]``
        ``float8_e8m0fnu`` (MX_BLOCKWISE; the quantized dim must be a multiple of 32).

    Raises:
        TypeError: wrong dtypes. ValueError: bad axis, block size, shape or granularity.

    Example::

        >>> x = torch.randn(4, 256)
        >>> q, s = turbo.ops.quantize_fp8(x, torch.float8_e4m3fn, ScalingGranularity.BLOCKWISE)
        >>> q.shape, s.shape
        (torch.Size([4, 256]), torch.Size([4, 2]))
    """
    op = "quantize_fp8"
    _check_x(x, op)
    _check_out_dtype(out_dtype, op)
    g = _granularity(granularity, op)
    ax = _norm_axis(axis, x.dim(), op) if g != _G.TENSORWISE else -1
    b = _block_size(g, block_size, op)
    use_2d = _use_2d(g, scaling_recipe, op)
    form = _nd_form(x.dim(), g, ax, use_2d)
    if form is not None:
        _check_nd_form(tuple(x.shape), g, ax, form, op)
        return _quantize_fp8_tiles(x, out_dtype, b) if form == "tiles" else _quantize_fp8_along(x, out_dtype, g, b, ax)
    rows, cols = _view_2d(tuple(x.shape), g, ax, use_2d, op)
    _check_mx_dim(g, ax, rows, cols, op)
    return _call(torch.ops.primus_turbo.quantize_fp8_impl, _quantize_fp8_eager, x, out_dtype, g.name, b, ax, use_2d)


def quantize_fp8_with_trans(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity,
    *,
    block_size: Optional[int] = None,
    scaling_recipe: Optional[ScalingRecipe] = None,
    scaling_recipe_for_trans: Optional[ScalingRecipe] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row-wise copy of ``x`` and its column-wise copy stored transposed, from one read of ``x``.

    ``(x_row, scale_row)`` equals ``quantize_fp8(x, ..., axis=-1)`` and ``(x_col_t, scale_col_t)``
    equals ``quantize_fp8(x.t().contiguous(), ..., axis=-1)`` (with ``scaling_recipe_for_trans``),
    bit for bit. TENSORWISE: both share one scale. BLOCKWISE ``b x b`` (``use_2d_block``): the
    transposed copy has the transposed scale grid. ROWWISE needs whole rows and whole columns, so
    it reads ``x`` twice (two launches); the other granularities read it once.

    Args:
        x: ``[rows, cols]`` float32 / bfloat16 / float16; MX_BLOCKWISE also takes ``[*lead, rows,
            cols]``: every matrix's four outputs as the 2-D op gives them (``[*lead, rows, cols]``,
            ``[*lead, rows, cols/32]``, ``[*lead, cols, rows]``, ``[*lead, cols, rows/32]``; each
            matrix's scales column-major as the 2-D op's).
        out_dtype, granularity, block_size: as :func:`quantize_fp8`. MX needs rows and cols % 32 == 0.
        scaling_recipe: recipe of the row-wise copy; ``scaling_recipe_for_trans`` of the column-wise
            copy (default: the same as ``scaling_recipe``).

    Returns:
        ``(x_row [rows, cols], scale_row, x_col_t [cols, rows], scale_col_t)``; scales are
        dequantization multipliers shaped as :func:`quantize_fp8` gives for ``x`` and ``x.t()``.
        MX and 1-D BLOCKWISE scales (``1 x b`` / ``b x 1``) are returned column-major (the
        transposes of contiguous tensors: stride 1 along the first dim), on every backend: the
        kernel writes each tile's scales as whole 32-byte sectors that way (bf16 [16384, 7168] on
        the H200, device time: 0.81 -> 0.91x the device copy for MX, 0.80 -> 0.90 for BLOCKWISE
        with its register cap). Same shapes and values; ``.contiguous()`` gives the row-major copy.
    """
    op = "quantize_fp8_with_trans"
    _check_x(x, op)
    g, b, use_2d, use_2d_t = _with_trans_args(out_dtype, granularity, block_size, scaling_recipe,
                                              scaling_recipe_for_trans)
    if x.dim() < 2 or (x.dim() > 2 and g != _G.MX_BLOCKWISE):
        raise ValueError(f"{op}: x must be 2-D (N-D [..., rows, cols] for MX_BLOCKWISE only), got shape "
                         f"{tuple(x.shape)} with {g.name}")
    rows, cols = x.shape[-2:]
    _check_mx_dim(g, -1, rows, cols, op)
    _check_mx_dim(g, 0, rows, cols, op)
    if x.dim() > 2:
        return _quantize_fp8_with_trans_mx_nd(x, out_dtype)
    return _call(torch.ops.primus_turbo.quantize_fp8_with_trans_impl, _quantize_fp8_with_trans_eager,
                 x, out_dtype, g.name, b, use_2d, use_2d_t)


def _with_trans_args_uncached(out_dtype, granularity, block_size, scaling_recipe, scaling_recipe_for_trans):
    op = "quantize_fp8_with_trans"
    _check_out_dtype(out_dtype, op)
    g = _granularity(granularity, op)
    b = _block_size(g, block_size, op)
    use_2d = _use_2d(g, scaling_recipe, op)
    use_2d_t = _use_2d(g, scaling_recipe_for_trans if scaling_recipe_for_trans is not None else scaling_recipe, op)
    return g, b, use_2d, use_2d_t


_with_trans_args_cached = functools.lru_cache(maxsize=256)(_with_trans_args_uncached)


def _with_trans_args(out_dtype, granularity, block_size, scaling_recipe, scaling_recipe_for_trans):
    """The validated (granularity, block size, use_2d, use_2d_t) of :func:`quantize_fp8_with_trans`'s
    non-tensor arguments, cached per value: the same few combinations repeat every training step.
    Invalid values raise on every call (exceptions are not cached); an unhashable argument is
    validated uncached, which raises the argument's own error."""
    key = (out_dtype, granularity, block_size, scaling_recipe, scaling_recipe_for_trans)
    if torch.compiler.is_compiling():  # dynamo traces neither hash() nor the cache: validate as given
        return _with_trans_args_uncached(*key)
    try:
        hash(key)
    except TypeError:  # validated as given: the argument's own error, not a hashing one
        return _with_trans_args_uncached(*key)
    return _with_trans_args_cached(*key)


def dequantize_fp8(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity,
    *,
    block_size: Optional[int] = None,
    axis: Optional[int] = None,
    scale_inv: torch.Tensor,
    scaling_recipe: Optional[ScalingRecipe] = None,
) -> torch.Tensor:
    """``x * scale_inv`` over each block (fp32 product, then cast to ``out_dtype``).

    Args:
        x: FP8 tensor as :func:`quantize_fp8` returned it (any of its forms, N-D included).
        out_dtype: float32, bfloat16 or float16.
        granularity, block_size, axis, scaling_recipe: those ``x`` was quantized with.
        scale_inv: the dequantization multipliers :func:`quantize_fp8` returned (E8M0 for MX;
            byte 255 dequantizes its block to NaN), in that shape; size-1 dims may be added or
            dropped (a ROWWISE ``[M]`` for ``[M, 1]``), any other shape raises ``ValueError``.

    Returns:
        The dequantized tensor, shaped like ``x``, in ``out_dtype``.
    """
    op = "dequantize_fp8"
    if not isinstance(x, torch.Tensor) or x.dtype not in _FP8_DTYPES:
        raise TypeError(f"{op}: x must be a float8_e4m3fn or float8_e5m2 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if out_dtype not in _IN_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    g = _granularity(granularity, op)
    ax = _norm_axis(axis, x.dim(), op) if g != _G.TENSORWISE else -1
    b = _block_size(g, block_size, op)
    use_2d = _use_2d(g, scaling_recipe, op)
    form = _nd_form(x.dim(), g, ax, use_2d)
    if form is not None:
        _check_nd_form(tuple(x.shape), g, ax, form, op)
    else:
        rows, cols = _view_2d(tuple(x.shape), g, ax, use_2d, op)
        _check_mx_dim(g, ax, rows, cols, op)
    if not isinstance(scale_inv, torch.Tensor):
        raise TypeError(f"{op}: scale_inv must be a torch.Tensor, got {type(scale_inv).__name__}")
    if scale_inv.device != x.device:
        raise ValueError(f"{op}: scale_inv is on {scale_inv.device}, x on {x.device}")
    want = tuple(_fp8_scale_shape(tuple(x.shape), g, b, ax, use_2d, op))
    got = tuple(scale_inv.shape)
    if got != want:
        # Size-1 dims do not change which scale sits at which flat position (a ROWWISE [M] for
        # [M, 1], a TENSORWISE [1] for []), so those forms are reshaped and accepted. Any other
        # shape of the same size (a transposed [nb, M] for [M, nb]) would pair scales with the
        # wrong blocks and give wrong values without an error, so it is refused.
        if tuple(d for d in got if d != 1) != tuple(d for d in want if d != 1):
            raise ValueError(f"{op}: scale_inv has shape {got}, expected {want} (size-1 dims may be added or "
                             f"dropped) for {g.name} of x{tuple(x.shape)}; a scale with the same number of "
                             f"elements in another shape (e.g. transposed) is not accepted")
        scale_inv = scale_inv.reshape(want)
    if scale_inv.dtype != _scale_dtype(g):
        raise TypeError(f"{op}: scale_inv.dtype must be {_scale_dtype(g)} for {g.name}, got {scale_inv.dtype}")
    if form == "tiles":
        return _dequantize_fp8_tiles(x, scale_inv, out_dtype, b)
    if form == "along":
        return _dequantize_fp8_along(x, scale_inv, out_dtype, g, b, ax)
    return _call(torch.ops.primus_turbo.dequantize_fp8_impl, _dequantize_fp8_eager,
                 x, scale_inv, out_dtype, g.name, b, ax, use_2d)


def _check_fp4_input(x, axis, op: str) -> int:
    _check_x(x, op)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D, got shape {tuple(x.shape)}")
    ax = _norm_axis(axis, 2, op)
    n = x.shape[0] if ax == 0 else x.shape[1]
    if n % MXFP4_BLOCK_SIZE:
        raise ValueError(f"{op}: MXFP4 needs the quantized dim to be a multiple of 32, got {n} (axis={ax})")
    return ax


_SEED_HIGH = 2 ** 62  # drawn / accepted seeds lie in [0, 2**62): ``seed + 1`` never overflows int64


def _sr_seed(seed, device: torch.device, op: str) -> torch.Tensor:
    """The stochastic-rounding seed as a one-element int64 tensor on ``device``, without a host sync.

    ``None``: drawn on the device from its default generator (``torch.manual_seed`` reproduces it);
    a ``torch.Generator`` (on ``device``): drawn from it; an ``int`` in [0, 2**62): filled on the
    device; a one-element integer tensor on ``device``: used as is (cast to int64)."""
    if seed is None or isinstance(seed, torch.Generator):
        if isinstance(seed, torch.Generator) and torch.device(seed.device).type != torch.device(device).type:
            raise ValueError(f"{op}: the seed generator is on {seed.device}, x on {device}")
        return torch.randint(0, _SEED_HIGH, (1,), dtype=torch.int64, device=device, generator=seed)
    if isinstance(seed, bool) or not isinstance(seed, (int, torch.Tensor)):
        raise TypeError(f"{op}: seed must be None, an int, a one-element integer tensor or a torch.Generator, "
                        f"got {type(seed).__name__}")
    if isinstance(seed, int):
        if not 0 <= seed < _SEED_HIGH:
            raise ValueError(f"{op}: an int seed must be in [0, 2**62), got {seed}")
        return torch.full((1,), seed, dtype=torch.int64, device=device)
    if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype.is_complex or seed.dtype == torch.bool:
        raise ValueError(f"{op}: a seed tensor must hold one integer, got shape {tuple(seed.shape)} {seed.dtype}")
    if seed.device != torch.device(device):
        raise ValueError(f"{op}: the seed tensor is on {seed.device}, x on {device}")
    return seed.reshape(1).to(torch.int64)


def _hadamard_matrix(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Sylvester's ``n x n`` Hadamard matrix of +-1 (n a power of two): ``H H^T = n I``."""
    h = torch.ones((1, 1), dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def _check_signs(signs, op: str) -> int:
    if not isinstance(signs, torch.Tensor) or signs.dim() != 1:
        raise TypeError(f"{op}: rht_signs must be a 1-D tensor of +-1 (random_hadamard_signs), got "
                        f"{getattr(signs, 'shape', type(signs).__name__)}")
    n = signs.numel()
    if n < 2 or n > 256 or n & (n - 1):
        raise ValueError(f"{op}: the Hadamard block (len(rht_signs)) must be a power of two in [2, 256], got {n}")
    return n


def random_hadamard_signs(block_size: int = MXFP4_BLOCK_SIZE, *, device=None,
                          generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``block_size`` random signs (+-1, fp32) on ``device`` for :func:`hadamard_transform`: drawn
    on the device (no host sync) from ``generator`` or the device's default generator."""
    if not isinstance(block_size, int) or block_size < 2 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"random_hadamard_signs: block_size must be a power of two in [2, 256], got {block_size!r}")
    bits = torch.randint(0, 2, (block_size,), device=device, generator=generator)
    return (bits * 2 - 1).to(torch.float32)


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor, *, axis: int = -1) -> torch.Tensor:
    """Random Hadamard transform of ``x`` along ``axis`` in blocks of ``n = len(signs)`` elements.

    Every block ``v`` (``n`` consecutive elements of the vectors along ``axis``) becomes
    ``v @ R`` with ``R = diag(signs) @ H_n / sqrt(n)`` (``H_n`` Sylvester's Hadamard matrix): an
    orthogonal map (``R R^T = I``), the same for every block. So for two operands transformed along
    their common reduction dim, ``hadamard_transform(A, s) @ hadamard_transform(B, s).T == A @ B.T``
    (exactly, up to rounding): the GEMM result is unchanged while outliers are spread over their
    block, which lowers the MXFP4 quantization error of both operands.

    Args:
        x: 2-D float tensor; ``x.shape[axis]`` must be a multiple of ``n``.
        signs: 1-D tensor of +-1 (:func:`random_hadamard_signs`), ``n`` a power of two in [2, 256].
        axis: ``-1`` (the rows' vectors) or ``0`` (the columns').

    Returns:
        The transformed tensor, ``[rows, cols]`` contiguous, float32 (float64 for a float64 ``x``),
        computed as a blockwise matmul (torch ops: no host sync, traceable).
    """
    return _hadamard(x, signs, axis, "hadamard_transform", inverse=False)


def _hadamard(x: torch.Tensor, signs: torch.Tensor, axis: int, op: str, inverse: bool) -> torch.Tensor:
    """:func:`hadamard_transform` (``v @ R``), or with ``inverse`` its inverse ``v @ R^T``."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{op}: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D, got shape {tuple(x.shape)}")
    ax = _norm_axis(axis, 2, op)
    n = _check_signs(signs, op)
    length = x.shape[0] if ax == 0 else x.shape[1]
    if length % n:
        raise ValueError(f"{op}: the transformed dim ({length}, axis={ax}) must be a multiple of the Hadamard "
                         f"block {n}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    r = _hadamard_matrix(n, dt, x.device) * signs.to(device=x.device, dtype=dt)[:, None] * (1.0 / math.sqrt(n))
    if inverse:
        r = r.t()
    xt = x.t() if ax == 0 else x
    y = (xt.to(dt).reshape(xt.shape[0], xt.shape[1] // n, n) @ r).reshape(xt.shape)
    return y.t().contiguous() if ax == 0 else y


def _fp4_mx_args(granularity, block_size, op: str) -> None:
    """MXFP4 takes MX_BLOCKWISE (the enum or its name) with 32-element blocks only."""
    g = _granularity(granularity, op)
    if g != _G.MX_BLOCKWISE:
        raise ValueError(f"{op}: MXFP4 needs granularity MX_BLOCKWISE, got granularity={g.name}")
    if block_size is not None and (isinstance(block_size, bool) or block_size != MXFP4_BLOCK_SIZE):
        raise ValueError(f"{op}: MXFP4 block_size must be {MXFP4_BLOCK_SIZE} (or None), got block_size={block_size!r}")


def _fp4_out_dtype(out_dtype, op: str) -> torch.dtype:
    """The packed dtype a quantizer returns: ``None`` means the default (:data:`_FP4_PACKED`)."""
    if out_dtype is None:
        return _FP4_PACKED
    if out_dtype not in _FP4_OUT_DTYPES:
        names = " or ".join(f"torch.{str(d).split('.')[-1]}" for d in _FP4_OUT_DTYPES)
        raise TypeError(f"{op}: out_dtype must be the packed FP4 dtype, {names} (or None for the default "
                        f"{_FP4_PACKED}), got out_dtype={out_dtype}")
    return out_dtype


def quantize_fp4(
    x: torch.Tensor, out_dtype: Optional[torch.dtype] = _FP4_PACKED, granularity=_G.MX_BLOCKWISE, *,
    block_size: Optional[int] = None, axis: Optional[int] = None, scaling_recipe: Optional[ScalingRecipe] = None,
    seed=None, rht_signs: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (E2M1, RNE, saturating to +-6; one E8M0 scale per 32 elements along ``axis``).

    The reference API's form ``quantize_fp4(x, out_dtype, granularity, *, block_size, axis,
    scaling_recipe)`` and the short form ``quantize_fp4(x, axis=...)`` give the same result.

    Args:
        x: ``[rows, cols]`` float32 / bfloat16 / float16; the quantized dim a multiple of 32.
        out_dtype: the packed dtype of the result: ``torch.float4_e2m1fn_x2`` (the default; on a
            torch without it ``uint8``) or ``torch.uint8`` (the same bytes, viewed as uint8); None
            means the default. Anything else raises ``TypeError``.
        granularity: ``ScalingGranularity.MX_BLOCKWISE`` (or its name), the only one MXFP4 has;
            anything else raises ``ValueError``.
        block_size: 32 or None (``ValueError`` otherwise).
        axis: ``-1`` (default) or ``0``: the dim that is blocked and packed.
        scaling_recipe: ``ScalingRecipe(use_sr=True)``: stochastic rounding of the elements
            (unbiased: each rounds to one of its two neighbouring E2M1 values with probability
            proportional to the proximity; scales and saturation as with RNE).
            ``ScalingRecipe(use_rht=True)``: quantize ``hadamard_transform(x, rht_signs, axis=axis)``
            (the other operand of the product must be transformed with the same signs).
            ``use_2d_block`` does not apply to MXFP4 (ignored: the groups are 1 x 32).
            ``shuffle_scale`` / ``shuffle_out`` (AMD preshuffled layouts) raise ``ValueError``.
        seed: stochastic rounding only: ``None`` (drawn on the device from its default generator,
            so ``torch.manual_seed`` reproduces it), an ``int`` in [0, 2**62), a one-element integer
            tensor on x's device or a ``torch.Generator``. Never read on the host (no sync). A
            given seed gives the same result on every call; element ``(i, j)`` of the view whose
            rows are the quantized vectors uses Philox(seed, i * n_cols + j), so
            ``quantize_fp4(x, axis=0, seed=s)`` is ``quantize_fp4(x.t(), seed=s)`` transposed.
            (The reference backend on plain CPU draws from torch's CPU generator seeded with it.)
        rht_signs: with ``use_rht``: the +-1 signs of the transform (:func:`random_hadamard_signs`;
            length 32, or another power of two dividing the quantized dim).

    Returns:
        ``(x_fp4, scale_inv)``: ``x_fp4`` ``[rows, cols/2]`` (axis=-1) or ``[rows/2, cols]`` (axis=0),
        ``torch.float4_e2m1fn_x2`` (``uint8`` on torch without it), element ``2i`` of the quantized
        axis in the low nibble; ``scale_inv`` ``float8_e8m0fnu`` ``[rows, cols/32]`` or ``[rows/32, cols]``.
    """
    op = "quantize_fp4"
    _fp4_mx_args(granularity, block_size, op)
    want = _fp4_out_dtype(out_dtype, op)
    ax = _check_fp4_input(x, axis, op)
    sr, rht = _fp4_recipe(scaling_recipe, op)
    if seed is not None and not sr:
        raise ValueError(f"{op}: seed is only used with stochastic rounding (ScalingRecipe(use_sr=True))")
    if rht_signs is not None and not rht:
        raise ValueError(f"{op}: rht_signs is only used with ScalingRecipe(use_rht=True)")
    if rht:
        if rht_signs is None:
            raise ValueError(f"{op}: ScalingRecipe(use_rht=True) needs rht_signs (random_hadamard_signs())")
        x = hadamard_transform(x, rht_signs, axis=ax)
    seed_t = _sr_seed(seed, x.device, op) if sr and x.numel() else None
    p, s = _call(torch.ops.primus_turbo.quantize_fp4_impl, _quantize_fp4_eager, x, ax, seed_t)
    return (p if p.dtype == want else p.view(want)), s


def quantize_fp4_with_trans(
    x: torch.Tensor, out_dtype: Optional[torch.dtype] = _FP4_PACKED, granularity=_G.MX_BLOCKWISE, *,
    block_size: Optional[int] = None, scaling_recipe: Optional[ScalingRecipe] = None,
    scaling_recipe_for_trans: Optional[ScalingRecipe] = None, seed=None,
    rht_signs: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 row-wise copy ``[rows, cols/2]`` and column-wise copy stored transposed
    ``[cols, rows/2]`` (with scales ``[rows, cols/32]`` and ``[cols, rows/32]``) from one read
    of ``x``; equal to ``quantize_fp4(x)`` and ``quantize_fp4(x.t().contiguous())``. rows and
    cols must be multiples of 32. ``out_dtype``, ``granularity`` and ``block_size`` are validated
    as in :func:`quantize_fp4` (the reference API's positional form), and so are both recipes.

    ``scaling_recipe`` applies to the row-wise copy, ``scaling_recipe_for_trans`` to the
    transposed one (default: the same). With stochastic rounding the row copy equals
    ``quantize_fp4(x, ..., seed=s)`` and the transposed one ``quantize_fp4(x.t().contiguous(), ...,
    seed=s + 1)``, where ``s`` is ``seed`` as :func:`quantize_fp4` takes it (an int, a tensor, or
    drawn on the device). With ``use_rht`` (needs ``rht_signs``) a copy is the quantization of the
    transform along its own quantized dim; the two copies are then formed by two reads of ``x``.

    Both scale tensors are returned column-major (the transposes of contiguous tensors), as
    :func:`quantize_fp8_with_trans` returns its MX scales: the one-read kernel stores each tile's
    scales as whole 32-byte sectors that way (bf16 [16384, 7168] on the H200, device time:
    0.620 -> 0.666x the device copy). Same shapes and values; ``.contiguous()`` gives row-major."""
    op = "quantize_fp4_with_trans"
    _fp4_mx_args(granularity, block_size, op)
    want = _fp4_out_dtype(out_dtype, op)
    _check_fp4_input(x, -1, op)
    _check_fp4_input(x, 0, op)
    recipe_t = scaling_recipe_for_trans if scaling_recipe_for_trans is not None else scaling_recipe
    sr, rht = _fp4_recipe(scaling_recipe, op)
    sr_t, rht_t = _fp4_recipe(recipe_t, op)
    if seed is not None and not (sr or sr_t):
        raise ValueError(f"{op}: seed is only used with stochastic rounding (ScalingRecipe(use_sr=True))")
    if rht_signs is not None and not (rht or rht_t):
        raise ValueError(f"{op}: rht_signs is only used with ScalingRecipe(use_rht=True)")
    if (rht or rht_t) and rht_signs is None:
        raise ValueError(f"{op}: ScalingRecipe(use_rht=True) needs rht_signs (random_hadamard_signs())")
    seed_t = _sr_seed(seed, x.device, op) if (sr or sr_t) and x.numel() else None
    if rht or rht_t:
        p, s = quantize_fp4(x, scaling_recipe=scaling_recipe, seed=seed_t if sr else None,
                            rht_signs=rht_signs if rht else None)
        pt, st = quantize_fp4(x.t().contiguous(), scaling_recipe=recipe_t, seed=seed_t + 1 if sr_t else None,
                              rht_signs=rht_signs if rht_t else None)
        s, st = _column_major(s), _column_major(st)
    else:
        p, s, pt, st = _call(torch.ops.primus_turbo.quantize_fp4_with_trans_impl, _quantize_fp4_with_trans_eager,
                             x, seed_t, sr, sr_t)
    if p.dtype != want:
        p, pt = p.view(want), pt.view(want)
    return p, s, pt, st


def dequantize_fp4(
    x: torch.Tensor, out_dtype: torch.dtype, granularity=_G.MX_BLOCKWISE, *, block_size: Optional[int] = None,
    axis: Optional[int] = None, scale_inv: torch.Tensor, scaling_recipe: Optional[ScalingRecipe] = None,
    rht_signs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Unpack MXFP4 ``x`` (as :func:`quantize_fp4` returned it) times its E8M0 ``scale_inv``.

    Args:
        x: packed ``float4_e2m1fn_x2`` (or ``uint8``) codes, ``[rows, cols/2]`` (axis=-1) or
            ``[rows/2, cols]`` (axis=0).
        out_dtype: float32 / bfloat16 / float16.
        granularity: ``MX_BLOCKWISE`` (or its name); ``block_size``: 32 or None (``ValueError``
            otherwise), as :func:`quantize_fp4` takes them.
        axis: the axis ``x`` was quantized along (-1 or 0).
        scale_inv: the E8M0 scales :func:`quantize_fp4` returned.
        scaling_recipe: the recipe ``x`` was quantized with. ``use_sr`` changes only how values were
            rounded, so it has no effect here; ``use_2d_block`` has none either (MXFP4 groups are
            1 x 32 here, as :func:`quantize_fp4` forms them; ``scale_inv``'s shape is checked).
            ``use_rht=True`` needs ``rht_signs`` (the signs ``x`` was transformed with) and undoes
            the transform: the result is ``hadamard_transform``'s inverse of the dequantized values,
            an approximation of the original tensor (computed in fp32, then cast). Without
            ``rht_signs`` it raises ``ValueError`` rather than return transformed-domain values.
            ``shuffle_scale`` / ``shuffle_out`` raise ``ValueError`` (AMD preshuffled layouts).
        rht_signs: with ``use_rht`` only (``ValueError`` otherwise).

    Returns ``[rows, cols]`` in ``out_dtype``."""
    op = "dequantize_fp4"
    _fp4_mx_args(granularity, block_size, op)
    _, rht = _fp4_recipe(scaling_recipe, op)
    if rht_signs is not None and not rht:
        raise ValueError(f"{op}: rht_signs is only used with ScalingRecipe(use_rht=True)")
    if rht and rht_signs is None:
        raise ValueError(f"{op}: ScalingRecipe(use_rht=True) needs rht_signs (the signs x was quantized with) to "
                         f"undo the random Hadamard transform; without them the values would stay transformed")
    if not isinstance(x, torch.Tensor) or x.dtype not in tuple(d for d in (_FP4_DTYPE, torch.uint8) if d is not None):
        raise TypeError(f"{op}: x must be a float4_e2m1fn_x2 (or uint8) packed tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if out_dtype not in _IN_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D, got shape {tuple(x.shape)}")
    ax = _norm_axis(axis, 2, op)
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype != _E8M0:
        raise TypeError(f"{op}: scale_inv must be a float8_e8m0fnu tensor, got "
                        f"{getattr(scale_inv, 'dtype', type(scale_inv).__name__)}")
    rows, cols = (x.shape[0] * 2, x.shape[1]) if ax == 0 else (x.shape[0], x.shape[1] * 2)
    want = _fp4_shapes(rows, cols, ax)[1]
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{op}: scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for packed "
                         f"x{tuple(x.shape)} with axis={ax}")
    if rht:
        _check_signs(rht_signs, op)
        d = _call(torch.ops.primus_turbo.dequantize_fp4_impl, _dequantize_fp4_eager, x, scale_inv, torch.float32, ax)
        return _hadamard(d, rht_signs, ax, op, inverse=True).to(out_dtype)
    return _call(torch.ops.primus_turbo.dequantize_fp4_impl, _dequantize_fp4_eager, x, scale_inv, out_dtype, ax)
