"""``QuantizedTensor``: FP8 (or MXFP4) data with its dequantization scales and how they were formed.

A ``torch.Tensor`` wrapper subclass whose shape and dtype are the original tensor's: it holds
``data`` (FP8 / packed MXFP4), ``scale_inv`` (the dequantization multiplier, shapes as in
docs/low_precision.md) and the quantization parameters needed to interpret them, and autograd
carries a gradient for it (the GEMM ops compute one when it ``requires_grad``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from .low_precision import (
    DEFAULT_BLOCK_SIZE,
    MXFP4_BLOCK_SIZE,
    MXFP8_BLOCK_SIZE,
    Float8QuantConfig,
    ScalingGranularity,
    ScalingRecipe,
    check_scaling_recipe,
    is_fp4_dtype,
)

__all__ = ["QuantizedTensor", "QuantizedTensorPair", "create_quantized_weight", "check_quantized_tensor"]

_G = ScalingGranularity


def _ops():
    from primus_turbo.pytorch.ops import quantization  # lazy: ops imports core

    return quantization


def _packed_fp4(dtype: torch.dtype) -> bool:
    """MXFP4 data: ``float4_e2m1fn_x2``, or ``uint8`` where torch has no FP4 dtype (FP8 data never is)."""
    return dtype == torch.uint8 or is_fp4_dtype(dtype)


class QuantizedTensor(torch.Tensor):
    """FP8 (or MXFP4) ``data`` + ``scale_inv`` + the parameters they were quantized with, as a
    ``torch.Tensor`` wrapper subclass: its ``shape`` and ``dtype`` are the original tensor's (the
    logical tensor it stands for; ``real_dtype`` is the stored FP8 / FP4 dtype), so autograd can
    carry a gradient for it. The GEMM ops take it as an operand and, when it ``requires_grad``,
    return that operand's gradient (in ``dtype``, shaped ``shape``), so a framework can route the
    weight gradient of a cached quantized weight through its own autograd bridge.

    It supports the ops autograd needs (``detach``, ``alias``), ``view`` / ``reshape`` that keep
    the scale groups whole (new leading dims over the quantized last dim, any shape of a one-scale
    TENSORWISE tensor; autograd reshapes the gradient back), ``t()`` / ``transpose`` of a 2-D
    TENSORWISE tensor, ``clone()``, ``.to(device)`` and ``.to(dtype)`` / ``.float()`` (which
    dequantize); every other torch op raises ``NotImplementedError`` naming the op (call
    :meth:`dequantize` first), never computing on the raw codes.

    Attributes:
        data: FP8 tensor (``float8_e4m3fn`` / ``float8_e5m2``) shaped like the original; for MXFP4
            the packed ``float4_e2m1fn_x2`` codes of :func:`turbo.ops.quantize_fp4` (two per byte
            along ``axis``: ``[rows, cols/2]`` or ``[rows/2, cols]``). Also ``_data`` / ``qdata``.
        scale_inv: dequantization multiplier per block (fp32; ``float8_e8m0fnu`` for MX).
        granularity: ``ScalingGranularity``.
        block_size: BLOCKWISE / MX block (None otherwise).
        axis: the dim the groups run along: -1 (the last dim; always for TENSORWISE) or the dim's
            non-negative index (0 for a 2-D tensor's columns, 1 for the M dim of ``[G, M, N]``);
            ``quantized_axis`` is the same dim, non-negative.
        orig_dtype: dtype of the tensor that was quantized (= ``dtype``; ``dequantize()`` returns it).
        real_dtype: ``data.dtype``.
        scaling_recipe: ``ScalingRecipe`` (``use_2d_block`` for BLOCKWISE weights) or None.
        group_lens, group_offs: a *grouped* tensor (``quantize(..., group_lens=...)``, as Primus-Turbo
            makes MoE activations): the ``[G]`` rows per group of a 2-D ``[M, K]`` tensor whose rows
            are sorted by expert, and their ``[G + 1]`` int64 exclusive prefix sum (computed on the
            device, no sync). ``grouped_gemm_fp8`` takes the offsets from such an ``a``. None for a
            tensor that is not grouped; ``is_grouped_tensor`` (also ``_is_grouped_tensor``) tells.
    """

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        granularity: ScalingGranularity,
        *,
        block_size: Optional[int] = None,
        axis: int = -1,
        orig_dtype: torch.dtype = torch.bfloat16,
        scaling_recipe: Optional[ScalingRecipe] = None,
        shape: Optional[Sequence[int]] = None,
        requires_grad: bool = False,
        group_lens: Optional[torch.Tensor] = None,
        group_offs: Optional[torch.Tensor] = None,
        is_grouped_tensor: Optional[bool] = None,
    ):
        check_scaling_recipe(scaling_recipe, "QuantizedTensor")
        for name, t in (("data", data), ("scale_inv", scale_inv)):
            if not isinstance(t, torch.Tensor) or isinstance(t, QuantizedTensor):
                raise TypeError(f"QuantizedTensor: {name} must be a plain torch.Tensor, got {type(t).__name__}")
        if not isinstance(granularity, ScalingGranularity):
            raise TypeError(f"QuantizedTensor: granularity must be a ScalingGranularity, got {granularity!r}")
        if orig_dtype not in _HP_DTYPES:
            raise TypeError(f"QuantizedTensor: orig_dtype must be float32, float16 or bfloat16, got {orig_dtype}")
        if shape is None:
            shape = _logical_shape(data, axis)
        if is_grouped_tensor and group_lens is None:
            raise ValueError("QuantizedTensor: is_grouped_tensor=True needs group_lens")
        if is_grouped_tensor is False and group_lens is not None:
            raise ValueError("QuantizedTensor: group_lens given with is_grouped_tensor=False")
        if group_lens is not None:
            group_offs = _check_groups(data, tuple(shape), granularity, axis, scaling_recipe, group_lens, group_offs)
        elif group_offs is not None:
            raise ValueError("QuantizedTensor: group_offs needs group_lens")
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=orig_dtype, device=data.device, requires_grad=requires_grad
        )
        self._data = data
        self._scale_inv = scale_inv
        self._granularity = granularity
        self._block_size = block_size
        self._axis = axis
        self._scaling_recipe = scaling_recipe
        self._group_lens = group_lens
        self._group_offs = group_offs
        self._is_grouped_tensor = group_lens is not None  # the reference API's attribute name
        return self

    # the stored pieces and the parameters (read-only: a new tensor is made for new values)
    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return self._data

    @property
    def qdata(self) -> torch.Tensor:
        return self._data

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._scale_inv

    @property
    def granularity(self) -> ScalingGranularity:
        return self._granularity

    @property
    def block_size(self) -> Optional[int]:
        return self._block_size

    @property
    def axis(self) -> int:
        return self._axis

    @property
    def quantized_axis(self) -> int:
        return self._axis % self._data.dim() if self._data.dim() else 0

    @property
    def orig_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def real_dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def scaling_recipe(self) -> Optional[ScalingRecipe]:
        return self._scaling_recipe

    @property
    def group_lens(self) -> Optional[torch.Tensor]:
        return self._group_lens

    @property
    def group_offs(self) -> Optional[torch.Tensor]:
        return self._group_offs

    @property
    def is_grouped_tensor(self) -> bool:
        return self._is_grouped_tensor

    def _like(self, data: torch.Tensor, scale_inv: torch.Tensor, shape=None, axis=None) -> "QuantizedTensor":
        """A QuantizedTensor with this one's parameters and new storage (no autograd history); the
        group lengths and offsets go along (moved to ``data``'s device)."""
        gl = go = None
        if self._group_lens is not None:
            gl, go = self._group_lens.to(data.device), self._group_offs.to(data.device)
        return QuantizedTensor(data, scale_inv, self._granularity, block_size=self._block_size,
                               axis=self._axis if axis is None else axis, orig_dtype=self.dtype,
                               scaling_recipe=self._scaling_recipe,
                               shape=tuple(self.shape) if shape is None else shape, group_lens=gl, group_offs=go)

    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        dest_dtype: torch.dtype,
        granularity: ScalingGranularity,
        *,
        axis: Optional[int] = None,
        group_lens: Optional[torch.Tensor] = None,
        block_size: Optional[int] = None,
        scaling_recipe: Optional[ScalingRecipe] = None,
    ) -> "QuantizedTensor":
        """Quantize ``x`` with :func:`turbo.ops.quantize_fp8` (same arguments and defaults; N-D
        inputs as there: e.g. ``[G, N, K]`` expert weights with ``axis=-2``, each matrix's column-wise
        groups, for MX / BLOCKWISE / ROWWISE, or ``b x b`` tiles per matrix with ``use_2d_block``).
        Computed without autograd; the result ``requires_grad`` as ``x`` does (it is a new leaf: a
        gradient the GEMMs give it lands in its ``.grad``, not ``x``'s).

        ``dest_dtype=float4_e2m1fn_x2``: MXFP4 of a 2-D ``x`` with :func:`turbo.ops.quantize_fp4`
        (``MX_BLOCKWISE``, ``block_size`` 32 or None, ``axis`` -1 or 0; ``ScalingRecipe(use_sr=True)``
        rounds stochastically). As there, ``use_2d_block`` does not apply: the groups are 1 x 32,
        as :func:`turbo.ops.gemm_fp4` quantizes weights, so ``quantize(...).dequantize()`` is the
        QDQ of this library's MXFP4 forward. ``use_rht`` raises ``NotImplementedError``
        (``dequantize()`` could not undo the transform). :func:`turbo.ops.gemm_fp4` takes the result
        as an operand (``axis=-1`` / ``0``: the copy grouped along that dim; RNE only, bit-identical
        to its on-the-fly quantization), the FP8 GEMMs refuse it by name. ``shuffle_scale`` /
        ``shuffle_out`` (AMD preshuffled layouts) raise ``ValueError``.

        ``group_lens`` (``[G]`` int32 / int64 on ``x``'s device) makes a grouped tensor of a 2-D ``[M, K]``
        ``x`` whose rows are sorted by group (MoE tokens; ``sum(group_lens) <= M``, rows past the groups
        allowed): the codes and scales are exactly the ungrouped ones, as only scale groups that never
        cross a group boundary are allowed: TENSORWISE, and ROWWISE / BLOCKWISE (1 x b) / MX along the
        last dim (``axis=-1``, each row on its own), and ROWWISE along the rows (``axis=0``: one scale per
        column over all rows, constant along every group's reduction). Blocks along the rows, 2-D blocks
        and MXFP4 raise ``ValueError``. The tensor carries ``group_lens`` and their offsets (computed on
        the device); ``grouped_gemm_fp8`` takes the offsets from it."""
        check_scaling_recipe(scaling_recipe, "QuantizedTensor.quantize")
        if isinstance(x, QuantizedTensor):
            raise TypeError("QuantizedTensor.quantize: x is already a QuantizedTensor; dequantize() it first")
        g = _ops()._granularity(granularity, "QuantizedTensor.quantize")
        if group_lens is not None:
            if is_fp4_dtype(dest_dtype):
                raise ValueError("QuantizedTensor.quantize: group_lens (a grouped tensor) is for FP8 activations; "
                                 "MXFP4 tensors cannot be grouped")
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                raise ValueError(f"QuantizedTensor.quantize: a grouped tensor (group_lens) is a 2-D [M, K] tensor "
                                 f"of rows sorted by group, got shape {tuple(getattr(x, 'shape', ()))}")
            # the checks that do not need the codes, before any work
            ax0 = -1 if g == _G.TENSORWISE else _ops()._norm_axis(axis, 2, "QuantizedTensor.quantize")
            _check_group_scheme(g, ax0, scaling_recipe)
        with torch.no_grad():
            if is_fp4_dtype(dest_dtype):
                return cls._quantize_fp4(x, g, axis, block_size, scaling_recipe)
            if g == _G.BLOCKWISE and block_size is None:
                block_size = DEFAULT_BLOCK_SIZE
            if g == _G.MX_BLOCKWISE and block_size is None:
                block_size = MXFP8_BLOCK_SIZE
            data, scale_inv = _ops().quantize_fp8(
                x, dest_dtype, g, block_size=block_size, axis=axis, scaling_recipe=scaling_recipe
            )
        ax = -1 if g == _G.TENSORWISE else _ops()._norm_axis(axis, x.dim(), "QuantizedTensor.quantize")
        return cls(data, scale_inv, g, block_size=block_size, axis=ax, orig_dtype=x.dtype,
                   scaling_recipe=scaling_recipe, shape=tuple(x.shape), requires_grad=x.requires_grad,
                   group_lens=group_lens)

    @classmethod
    def _quantize_fp4(cls, x, g, axis, block_size, recipe) -> "QuantizedTensor":
        op = "QuantizedTensor.quantize"
        if g != _G.MX_BLOCKWISE:
            raise ValueError(f"{op}: float4_e2m1fn_x2 (MXFP4) needs granularity MX_BLOCKWISE, got {g.name}")
        if block_size not in (None, MXFP4_BLOCK_SIZE):
            raise ValueError(f"{op}: MXFP4 blocks are {MXFP4_BLOCK_SIZE} elements, got block_size={block_size}")
        if recipe is not None and recipe.use_rht:
            raise NotImplementedError(f"{op}: ScalingRecipe(use_rht=True) for MXFP4: dequantize() would return the "
                                      "Hadamard transform of the input; use turbo.ops.quantize_fp4 with rht_signs")
        data, scale_inv = _ops().quantize_fp4(x, axis=axis, scaling_recipe=recipe)
        ax = 0 if axis in (0, -2) else -1  # quantize_fp4 checked x is 2-D and the axis valid
        return cls(data, scale_inv, g, block_size=MXFP4_BLOCK_SIZE, axis=ax, orig_dtype=x.dtype,
                   scaling_recipe=recipe, shape=tuple(x.shape), requires_grad=x.requires_grad)

    def dequantize(self, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``data * scale_inv`` per block, in ``out_dtype`` (default: ``orig_dtype``); a plain
        tensor without autograd history."""
        with torch.no_grad():
            return self._dequantize(out_dtype or self.dtype)

    def _dequantize(self, out_dtype: torch.dtype) -> torch.Tensor:
        if _packed_fp4(self._data.dtype):
            return _ops().dequantize_fp4(self._data, out_dtype, self._granularity, block_size=self._block_size,
                                         axis=self._axis, scale_inv=self._scale_inv,
                                         scaling_recipe=self._scaling_recipe)
        if self._data.dim() == 3 and self._axis == -1 and not (self._granularity == _G.BLOCKWISE
                                                                and not self._use_2d()):
            # the per-expert scale forms of create_quantized_weight too (TENSORWISE [G], ROWWISE [G, N])
            return _dequantize_experts(self, out_dtype)
        return _ops().dequantize_fp8(
            self._data, out_dtype, self._granularity, block_size=self._block_size,
            axis=self._axis, scale_inv=self._scale_inv, scaling_recipe=self._scaling_recipe,
        )

    def _use_2d(self) -> bool:
        return self._scaling_recipe is not None and bool(self._scaling_recipe.use_2d_block)

    def __repr__(self, *, tensor_contents=None) -> str:
        extra = f", block_size={self._block_size}" if self._block_size else ""
        if self._use_2d():
            extra += ", 2d_block"
        if self._group_lens is not None:
            extra += f", groups={self._group_lens.numel()}"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, real_dtype={self._data.dtype}, "
            f"granularity={self._granularity.name}{extra}, axis={self._axis}, "
            f"scale_inv={tuple(self._scale_inv.shape)} {self._scale_inv.dtype}, device={self._data.device}{grad})"
        )

    # --- torch.compile / serialisation of the wrapper ---------------------------------------
    def __tensor_flatten__(self):
        meta = {"granularity": self._granularity, "block_size": self._block_size, "axis": self._axis,
                "orig_dtype": self.dtype, "scaling_recipe": self._scaling_recipe}
        inner = ["_data", "_scale_inv"]
        if self._group_lens is not None:
            inner += ["_group_lens", "_group_offs"]
        return inner, meta

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return QuantizedTensor(inner["_data"], inner["_scale_inv"], meta["granularity"], block_size=meta["block_size"],
                               axis=meta["axis"], orig_dtype=meta["orig_dtype"],
                               scaling_recipe=meta["scaling_recipe"], shape=tuple(outer_size),
                               group_lens=inner.get("_group_lens"), group_offs=inner.get("_group_offs"))

    # Python-level torch functions go straight to the dispatcher (autograd included), where
    # __torch_dispatch__ below decides what a quantized tensor can do.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _DISPATCH.get(func)
        if handler is not None:
            return handler(func, *args, **kwargs)
        raise NotImplementedError(
            f"QuantizedTensor does not support {func} (it holds quantized codes): call .dequantize() for a "
            f"high-precision tensor, or pass it to a turbo GEMM op")


_HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_group_scheme(g: ScalingGranularity, axis: int, recipe: Optional[ScalingRecipe]) -> None:
    """A grouped tensor's scale groups must never cross a group boundary (rows are the groups')."""
    if g == _G.TENSORWISE or (g == _G.ROWWISE and axis in (0, 1, -1)):
        return
    if axis in (1, -1) and not (g == _G.BLOCKWISE and recipe is not None and recipe.use_2d_block):
        return
    where = "in 2-D blocks" if axis in (1, -1) else f"in blocks along axis={axis} (the rows)"
    raise ValueError(f"QuantizedTensor: a grouped tensor (group_lens) cannot hold {g.name} scales {where}: "
                     f"their blocks would cross group boundaries; quantize in 1 x b blocks along the last dim (axis=-1)")


def _check_groups(data, shape, g, axis, recipe, group_lens, group_offs) -> torch.Tensor:
    """Checks a grouped tensor's metadata (shapes, dtypes, devices: no device values are read) and
    returns its ``group_offs`` (made on the device from ``group_lens`` when None)."""
    op = "QuantizedTensor"
    if len(shape) != 2 or data.dim() != 2:
        raise ValueError(f"{op}: a grouped tensor (group_lens) must be 2-D [M, K], got shape {list(shape)}")
    if _packed_fp4(data.dtype):
        raise ValueError(f"{op}: MXFP4 tensors cannot be grouped (group_lens is for FP8 activations)")
    _check_group_scheme(g, axis, recipe)
    if not isinstance(group_lens, torch.Tensor) or group_lens.dim() != 1 or \
            group_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: group_lens must be a 1-D int32 / int64 tensor, got "
                         f"{type(group_lens).__name__ if not isinstance(group_lens, torch.Tensor) else f'{group_lens.dtype} {list(group_lens.shape)}'}")
    if group_lens.device != data.device:
        raise ValueError(f"{op}: group_lens is on {group_lens.device}, the data on {data.device}")
    if group_offs is not None and (not isinstance(group_offs, torch.Tensor) or group_offs.dim() != 1 or
                                   group_offs.numel() != group_lens.numel() + 1 or
                                   group_offs.dtype not in (torch.int32, torch.int64) or group_offs.device != data.device):
        raise ValueError(f"{op}: group_offs must be the [G + 1] = [{group_lens.numel() + 1}] int32 / int64 exclusive "
                         f"prefix sum of group_lens on {data.device}, got "
                         f"{f'{group_offs.dtype} {list(group_offs.shape)} on {group_offs.device}' if isinstance(group_offs, torch.Tensor) else type(group_offs).__name__}")
    from ..ops.grouped_gemm import _group_offsets  # lazy: ops imports core

    # made on the device when None; on CPU (no sync there) the values are checked as the grouped GEMMs do
    return _group_offsets(op, group_lens.long(), group_offs, data).long()


def _logical_shape(data: torch.Tensor, axis: int) -> tuple:
    """The shape of the tensor ``data`` stands for: packed MXFP4 holds two values per byte along ``axis``."""
    shape = list(data.shape)
    if _packed_fp4(data.dtype) and shape:
        shape[axis] *= 2
    return tuple(shape)


def _alias(func, t, *args, **kwargs):
    return t._like(t._data, t._scale_inv)


def _view(func, t, size, *args, **kwargs):
    """``view`` / ``reshape`` that keeps every scale group whole: any shape for a one-scale
    TENSORWISE tensor; otherwise new leading dims over an unchanged last dim when the groups run
    along the last dim (ROWWISE, 1 x b BLOCKWISE, MX), e.g. ``[B, S, H] -> [B * S, H]``. The scales
    are reshaped alongside (a view where the data allows one)."""
    size = list(size)
    if size.count(-1) == 1:
        known = 1
        for d in size:
            known *= d if d != -1 else 1
        size[size.index(-1)] = t.numel() // known if known else 0
    size = tuple(size)
    if size == tuple(t.shape):
        return _alias(func, t)
    if t._group_lens is not None:
        raise NotImplementedError(
            f"QuantizedTensor: view / reshape of a grouped tensor from {tuple(t.shape)} to {size}: its group_lens "
            f"count rows of the 2-D [M, K] tensor")
    d, s = t._data, t._scale_inv
    op = torch.Tensor.view if func is not torch.ops.aten.reshape.default else torch.Tensor.reshape
    fp8 = not _packed_fp4(d.dtype)
    if fp8 and math.prod(size) == t.numel() and t._granularity == _G.TENSORWISE and s.numel() == 1:
        return t._like(op(d, size), s, shape=size)
    along_last = d.dim() >= 1 and t.quantized_axis == d.dim() - 1 and not t._use_2d()
    if (fp8 and along_last and t._granularity != _G.TENSORWISE and size and size[-1] == t.shape[-1]
            and math.prod(size) == t.numel() and tuple(s.shape[:-1]) == tuple(d.shape[:-1])):
        return t._like(op(d, size), op(s, (*size[:-1], s.shape[-1])), shape=size, axis=-1)
    raise NotImplementedError(
        f"QuantizedTensor: view / reshape from {tuple(t.shape)} to {size} would regroup the scales "
        f"({t._granularity.name}, axis={t._axis}); only new leading dims over the quantized last dim (or any shape "
        f"of a one-scale TENSORWISE tensor) keep them whole: quantize the reshaped high-precision tensor instead")


def _transpose2d(func, t, *args, **kwargs):
    if t.dim() != 2:
        raise NotImplementedError(f"QuantizedTensor: {func} of a {t.dim()}-D tensor (only 2-D transposes)")
    if func is torch.ops.aten.transpose.int and sorted(d % 2 for d in args[:2]) != [0, 1]:
        return _alias(func, t)
    if func is torch.ops.aten.permute.default and [d % 2 for d in args[0]] == [0, 1]:
        return _alias(func, t)
    if t._group_lens is not None:
        raise NotImplementedError("QuantizedTensor.t() of a grouped tensor: its group_lens count rows, which a "
                                  "transpose makes columns")
    if t._granularity != _G.TENSORWISE:
        raise NotImplementedError(
            f"QuantizedTensor.t(): {t._granularity.name} scales are grouped along one axis, so the transpose needs "
            f"re-quantized data; use turbo.ops.quantize_fp8_with_trans to get both copies from one read")
    r, c = t.shape
    return t._like(t._data.t(), t._scale_inv, shape=(c, r))


def _clone(func, t, *args, **kwargs):
    return t._like(t._data.clone(), t._scale_inv.clone())


def _to_copy(func, t, *args, dtype=None, device=None, layout=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    if dtype is not None:  # a high-precision tensor of the values: .float(), .to(torch.bfloat16)
        out = t._dequantize(dtype if dtype in _HP_DTYPES else torch.float32)
        out = out.to(dtype) if out.dtype != dtype else out
        return out.to(device, non_blocking=non_blocking) if device is not None else out
    if device is None:
        return _clone(func, t)
    return t._like(t._data.to(device, non_blocking=non_blocking), t._scale_inv.to(device, non_blocking=non_blocking))


def _refuse_inplace(func, t, *args, **kwargs):
    raise NotImplementedError(
        f"QuantizedTensor: {func} would write into quantized codes; quantize a new tensor instead")


_aten = torch.ops.aten
_DISPATCH = {
    _aten.detach.default: _alias,
    _aten.alias.default: _alias,
    _aten.view.default: _view,
    _aten._unsafe_view.default: _view,
    _aten.reshape.default: _view,
    _aten.t.default: _transpose2d,
    _aten.transpose.int: _transpose2d,
    _aten.permute.default: _transpose2d,
    _aten.clone.default: _clone,
    _aten._to_copy.default: _to_copy,
    _aten.copy_.default: _refuse_inplace,
}


class QuantizedTensorPair(NamedTuple):
    """A quantized weight and, when asked for, its transposed copy (``None`` otherwise)."""

    data: QuantizedTensor
    data_t: Optional[QuantizedTensor] = None


def _weight_scheme(config: Float8QuantConfig) -> tuple[ScalingGranularity, Optional[int], Optional[ScalingRecipe]]:
    g = config.granularity
    if g == _G.BLOCKWISE:
        return g, config.block_size or DEFAULT_BLOCK_SIZE, ScalingRecipe(use_2d_block=True)
    if g == _G.MX_BLOCKWISE:
        return g, MXFP8_BLOCK_SIZE, None
    return g, None, None


def create_quantized_weight(
    weight: torch.Tensor,
    dest_dtype: torch.dtype,
    quant_config: Optional[Float8QuantConfig] = None,
    need_weight_transpose_cache: bool = False,
    *,
    config: Optional[Float8QuantConfig] = None,
) -> QuantizedTensorPair:
    """Quantize a ``[N, K]`` weight for the FP8 GEMMs (groups along K), or a ``[G, N, K]`` stack of
    expert weights for ``grouped_gemm_fp8`` (each expert quantized on its own).

    ``quant_config`` (the reference API's name; ``config=`` is accepted as a keyword alias, not
    both) is the GEMM's ``Float8QuantConfig``.

    BLOCKWISE weights use ``b x b`` 2-D blocks (``quant_config.block_size``, 128 by default), MX weights
    1 x 32 along K, TENSORWISE/ROWWISE as configured (ROWWISE: one scale per output row). With
    ``need_weight_transpose_cache`` the transposed copy ``[K, N]`` (groups along N, for dgrad) is
    built in the same pass by ``quantize_fp8_with_trans``.

    Expert stacks ``[G, N, K]`` (the ``trans_b=True`` layout of ``grouped_gemm_fp8``): scales as the
    grouped kernels read them, per expert: TENSORWISE ``[G]`` (one per expert), ROWWISE ``[G, N]``,
    BLOCKWISE ``[G, ceil(N/b), ceil(K/b)]``, MX ``[G, N, K/32]``; the transposed copy is ``[G, K, N]``
    with ``[G]``, ``[G, K]``, ``[G, ceil(K/b), ceil(N/b)]`` (a transposed view of the same blocks) or
    ``[G, K, N/32]``. Pass the pair to ``grouped_gemm_fp8`` as ``b`` to skip the weight's
    quantization.

    The copies ``requires_grad`` as ``weight`` does (new leaves, as ``QuantizedTensor.quantize``
    makes them): a GEMM then gives ``data`` the weight gradient, which a framework's autograd bridge
    routes to the parameter (or its ``main_grad``); ``data_t`` gets none.

    Returns:
        ``QuantizedTensorPair(data, data_t)``; ``data_t`` is None unless asked for.
    """
    if config is not None:
        if quant_config is not None:
            raise TypeError("create_quantized_weight: got both quant_config and config (its alias); pass one")
        quant_config = config
    if quant_config is None:
        raise TypeError("create_quantized_weight: missing the quant_config argument (a Float8QuantConfig)")
    config = quant_config
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"create_quantized_weight: quant_config must be a Float8QuantConfig, got "
                        f"{type(config).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3):
        raise ValueError(f"create_quantized_weight: weight must be 2-D [N, K] or 3-D [G, N, K] (experts), got shape "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    g, b, recipe = _weight_scheme(config)
    if weight.dim() == 3:
        from ..ops.grouped_gemm_fp8 import _grouped_copies  # lazy: ops imports core

        fwd, dgr = _grouped_copies(weight, dest_dtype, g.name, b or DEFAULT_BLOCK_SIZE, need_weight_transpose_cache)
        mk = lambda c: QuantizedTensor(c[0], c[1], g, block_size=b, axis=-1, orig_dtype=weight.dtype,  # noqa: E731
                                       scaling_recipe=recipe, requires_grad=weight.requires_grad)
        return QuantizedTensorPair(mk(fwd), mk(dgr) if dgr is not None else None)
    ops = _ops()
    if not need_weight_transpose_cache:
        q = QuantizedTensor.quantize(weight, dest_dtype, g, block_size=b, scaling_recipe=recipe)
        return QuantizedTensorPair(q, None)
    q, s, qt, st = ops.quantize_fp8_with_trans(weight, dest_dtype, g, block_size=b, scaling_recipe=recipe)
    mk = lambda d, sc: QuantizedTensor(d, sc, g, block_size=b, axis=-1, orig_dtype=weight.dtype,  # noqa: E731
                                       scaling_recipe=recipe, requires_grad=weight.requires_grad)
    return QuantizedTensorPair(mk(q, s), mk(qt, st))


def check_quantized_tensor(qt: QuantizedTensor, config: Float8QuantConfig, axis: Optional[int] = None,
                           scaling_recipe: Optional[ScalingRecipe] = None) -> None:
    """Raise ``ValueError`` unless ``qt`` was quantized as ``config`` says (granularity, block
    size, scale dtype and shape) and, when given, along ``axis`` and with ``scaling_recipe``.

    ``scaling_recipe`` is compared with the recipe ``qt`` records (None meaning the default
    ``ScalingRecipe()``) field by field, as far as a field changes the quantization of ``qt``:
    ``use_2d_block`` for BLOCKWISE (``b x b`` vs ``1 x b`` blocks; :func:`turbo.ops.quantize_fp8`
    ignores it for the other granularities, so it is not compared there), ``use_sr`` and ``use_rht``
    always. ``shuffle_scale`` / ``shuffle_out`` raise ``ValueError`` (AMD preshuffled layouts are
    not supported here)."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"check_quantized_tensor: expected a QuantizedTensor, got {type(qt).__name__}")
    if qt.granularity != config.granularity:
        raise ValueError(f"check_quantized_tensor: granularity {qt.granularity.name} != config's "
                         f"{config.granularity.name}")
    if config.granularity in (_G.BLOCKWISE, _G.MX_BLOCKWISE) and qt.block_size != config.block_size:
        raise ValueError(f"check_quantized_tensor: block_size {qt.block_size} != config's {config.block_size}")
    want_sd = torch.float8_e8m0fnu if config.granularity == _G.MX_BLOCKWISE else torch.float32
    if qt.scale_inv.dtype != want_sd:
        raise ValueError(f"check_quantized_tensor: scale_inv.dtype {qt.scale_inv.dtype} != {want_sd} for "
                         f"{config.granularity.name}")
    if qt.data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"check_quantized_tensor: data.dtype must be an FP8 dtype, got {qt.data.dtype}")
    if axis is not None and qt.granularity != _G.TENSORWISE:
        ax = _ops()._norm_axis(axis, qt.data.dim(), "check_quantized_tensor")
        if qt.axis != ax:
            raise ValueError(f"check_quantized_tensor: quantized along axis={qt.axis}, expected axis={ax}")
    want = [_scale_shape(qt)]
    if qt.data.dim() == 3 and qt.axis == -1 and qt.granularity in (_G.TENSORWISE, _G.ROWWISE):
        want.append(tuple(qt.data.shape[:1 if qt.granularity == _G.TENSORWISE else 2]))  # per expert
    if tuple(qt.scale_inv.shape) not in want:
        raise ValueError(f"check_quantized_tensor: scale_inv shape {tuple(qt.scale_inv.shape)} != expected "
                         f"{want[0]} for data {tuple(qt.data.shape)}")
    if scaling_recipe is not None:
        _check_recipe_matches(qt, check_scaling_recipe(scaling_recipe, "check_quantized_tensor"))


def _scale_shape(qt: QuantizedTensor) -> tuple:
    """The scale shape :func:`turbo.ops.quantize_fp8` gives ``qt.data``'s shape with ``qt``'s parameters."""
    ops = _ops()
    g = qt.granularity
    b = qt.block_size if g in (_G.BLOCKWISE, _G.MX_BLOCKWISE) else 0
    if g == _G.BLOCKWISE and not b:
        b = DEFAULT_BLOCK_SIZE
    use_2d = g == _G.BLOCKWISE and qt._use_2d()
    return tuple(ops._fp8_scale_shape(tuple(qt.data.shape), g, b, qt.axis, use_2d, "check_quantized_tensor"))


def _check_recipe_matches(qt: QuantizedTensor, recipe: ScalingRecipe) -> None:
    have = qt.scaling_recipe if qt.scaling_recipe is not None else ScalingRecipe()
    fields = ("use_sr", "use_rht") if qt.granularity != _G.BLOCKWISE else ("use_2d_block", "use_sr", "use_rht")
    for f in fields:
        if bool(getattr(recipe, f)) != bool(getattr(have, f)):
            raise ValueError(f"check_quantized_tensor: scaling_recipe.{f}={getattr(recipe, f)!r} but the tensor was "
                             f"quantized with {f}={getattr(have, f)!r} (its scaling_recipe: {qt.scaling_recipe})")


def _dequantize_experts(qt: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``dequantize()`` of a ``[G, R, C]`` expert stack (scales per expert, see
    :func:`create_quantized_weight`)."""
    G, R, C = qt.data.shape
    s = qt.scale_inv
    g = qt.granularity
    if g == _G.MX_BLOCKWISE:
        flat = _ops().dequantize_fp8(qt.data.reshape(G * R, C), out_dtype, g, block_size=qt.block_size, axis=-1,
                                     scale_inv=s.reshape(G * R, -1))
        return flat.view(G, R, C)
    x = qt.data.float()
    if g == _G.TENSORWISE:
        x = x * s.float().reshape(-1, 1, 1)
    elif g == _G.ROWWISE:
        x = x * s.float().reshape(G, R, 1)
    else:  # BLOCKWISE: b x b blocks per expert
        b = qt.block_size or DEFAULT_BLOCK_SIZE
        full = s.float().repeat_interleave(b, 1).repeat_interleave(b, 2)[:, :R, :C]
        x = x * full
    return x.to(out_dtype)
