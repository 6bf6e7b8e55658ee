"""Dense linear layers: :class:`Linear` (``turbo.ops.gemm``), :class:`Float8Linear` (``turbo.ops.gemm_fp8``)
and :class:`RouterLinear` (``turbo.ops.router_gating_linear``: an fp32 router over 16-bit tokens).

Both are drop-in ``torch.nn.Linear`` subclasses (same parameters, initialisation and state dict):
``y = x @ W^T (+ b)`` for ``x`` of shape ``[..., in_features]`` (flattened to 2-D for the GEMM and
restored afterwards).

Megatron gradient accumulation: when ``weight`` carries a ``main_grad`` tensor (Megatron's
DistributedDataParallel attaches one), the weight-gradient GEMM adds straight into ``main_grad``
(``fuse_bgrad_accum_pattern="megatron"`` of the ops), ``weight.grad_added_to_main_grad`` is set and
the autograd gradient of ``weight`` is a placeholder. No flag is needed: the layers pick this up from
the parameter on every call. The bias gradient always goes through ordinary autograd.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from ..core.low_precision import Float8QuantConfig, ScalingGranularity
from ..core.quantized_tensor import QuantizedTensorPair, create_quantized_weight
from ..core.amp import autocast_dtype, autocast_off, cast_inputs
from ..ops.gemm import _flag_main_grad, _megatron_dummy_wgrad, gemm
from ..ops.gemm_fp8 import _forward as _fp8_forward
from ..ops.gemm_fp8 import _mm as _fp8_mm
from ..ops.gemm_fp8 import _mm_accum as _fp8_mm_accum
from ..ops.gemm_fp8 import _quantize as _fp8_quantize
from ..ops.gemm_fp8 import gemm_fp8
from ..ops.moe_router_gemm import router_gating_linear

__all__ = ["Linear", "Float8Linear", "RouterLinear", "convert_to_float8"]


def _fuse_pattern(weight: torch.Tensor) -> Optional[str]:
    """``"megatron"`` when ``weight`` has a Megatron ``main_grad`` and gets a gradient now."""
    if weight.requires_grad and torch.is_grad_enabled() and getattr(weight, "main_grad", None) is not None:
        return "megatron"
    return None


def _check_features(name: str, in_features, out_features) -> None:
    """Sizes as ``torch.nn.Linear`` takes them (non-negative ints), checked before its ``torch.empty``
    would fail on a negative one."""
    for arg, v in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}: {arg} must be a non-negative int, got {v!r}")


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """``x [..., in_features]`` as ``[rows, in_features]`` (explicit row count: ``reshape(-1, 0)`` of
    an empty last dim is ambiguous)."""
    return x.reshape(math.prod(x.shape[:-1]), in_features)


def _check_x(x: torch.Tensor, in_features: int, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"{name}: input's last dim must be in_features={in_features}, got shape {tuple(x.shape)}")


class Linear(torch.nn.Linear):
    """``y = x @ W^T (+ b)`` through :func:`turbo.ops.gemm` (``trans_b=True``).

    Args as ``torch.nn.Linear``: ``(in_features, out_features, bias=True, device=None, dtype=None)``.
    ``x`` may have any number of leading dims. With ``weight.main_grad`` present (Megatron), the
    weight gradient is accumulated into ``main_grad`` in the GEMM epilogue (see the module docstring).
    Works under ``torch.compile(fullgraph=True)``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        _check_features(type(self).__name__, in_features, out_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_x(x, self.in_features, "Linear")
        lead = x.shape[:-1]
        y = gemm(_rows(x, self.in_features), self.weight, trans_b=True,
                 fuse_bgrad_accum_pattern=_fuse_pattern(self.weight))
        if self.bias is not None:
            y = y + _bias(self.bias, y)
        return y.reshape(*lead, self.out_features)


def _bias(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The bias in the output's dtype: an fp32 bias over a product that ``torch.autocast`` made
    bf16 is added in bf16, as ``F.linear`` does under autocast (without autocast they match)."""
    return bias if bias.dtype == y.dtype else bias.to(y.dtype)


class RouterLinear(Linear):
    """An MoE router's ``H -> E`` projection whose logits are computed in ``router_dtype`` (default:
    the weight's dtype) from activations of another dtype: an fp32 router over bf16 tokens
    (Megatron's ``moe_router_dtype``), with an fp32 weight or a bf16 one
    (``RouterLinear(H, E, dtype=torch.bfloat16, router_dtype=torch.float32)``). The logits come
    from :func:`turbo.ops.router_gating_linear` (no fp32 copy of the activations; the input's
    gradient in the input's dtype). Inputs in the weight's dtype with no other ``router_dtype``
    take :class:`Linear`'s path. Args as :class:`Linear`, plus ``router_dtype``;
    ``weight.main_grad`` is honoured on both paths.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 router_dtype: Optional[torch.dtype] = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if router_dtype is not None and router_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"RouterLinear: router_dtype must be float32, bfloat16, float16 or None, "
                             f"got {router_dtype}")
        self.router_dtype = router_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rd = self.router_dtype or self.weight.dtype
        if x.dtype == self.weight.dtype and rd == self.weight.dtype:
            return super().forward(x)
        _check_x(x, self.in_features, "RouterLinear")
        return router_gating_linear(x, self.weight, self.bias, rd, fuse_bgrad_accum_pattern=_fuse_pattern(self.weight))

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", router_dtype={self.router_dtype}" if self.router_dtype else "")


class _CachedWeightGemmFP8(torch.autograd.Function):
    """``x @ W^T`` in FP8 with ``W`` taken from a cached :class:`QuantizedTensorPair`, while the
    weight gradient still reaches the high-precision parameter ``weight`` (or its ``main_grad``).

    The module keeps its cache internal (the pair is not an autograd input); this bridge runs the same
    three FP8 GEMMs (forward with the cached copy, grad_input with the cached transposed copy,
    grad_weight from the activation's and the output gradient's FP8 copies, which never read the
    weight) and returns the weight gradient for ``weight``.
    """

    @staticmethod
    def forward(ctx, x, weight, pair, out_dtype, gran, fwd_dtype, bwd_dtype, block_size, fuse):
        need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        out, w_for_dgrad, x_for_wgrad = _fp8_forward(x, pair, False, True, out_dtype, gran, fwd_dtype, block_size,
                                                     need_gx, need_gw)
        ctx.gran, ctx.bwd_dtype, ctx.block_size, ctx.fuse = gran, bwd_dtype, block_size, fuse
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.save_for_backward(*w_for_dgrad, *x_for_wgrad, weight if (fuse and need_gw) else None)
        return out  # (weight.grad_added_to_main_grad: set by the caller, see ops.gemm._flag_main_grad)

    @staticmethod
    def backward(ctx, grad_out):
        wq, ws, xq, xs, weight = ctx.saved_tensors
        g, bsz = ctx.gran, ctx.block_size
        need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_row, dy_col = _fp8_quantize(grad_out.contiguous(), ctx.bwd_dtype, g, bsz, False,
                                       need_row=need_gx, need_col=need_gw)
        grad_x = grad_w = None
        if need_gx:  # dX [M, K] = dY [M, N] @ W [N, K]; W's copy [K, N] grouped along N
            grad_x = _fp8_mm(dy_row, (wq, ws), g, ctx.x_dtype, bsz)
        if need_gw:  # dW [N, K] = dY^T @ X; dY's copy [N, M] and X's copy [K, M], grouped along M
            if ctx.fuse:
                _fp8_mm_accum(dy_col, (xq, xs), g, bsz, weight.main_grad)
                grad_w = _megatron_dummy_wgrad(weight)
            else:
                grad_w = _fp8_mm(dy_col, (xq, xs), g, ctx.w_dtype, bsz)
        return grad_x, grad_w, None, None, None, None, None, None, None


class _FP8WeightCache:
    """The ``is_first_microbatch`` cache of a module's FP8 weight copies (Float8Linear,
    GroupedLinear): valid while the weight's pointer, version counter, dtype, device and the
    module's ``config`` are unchanged; ``extra`` (whether the grad_input copy is included) must
    match, except that copies with it also serve calls that do not need it."""

    _weight_cache = None
    _weight_cache_key = None

    def invalidate_weight_cache(self) -> None:
        """Drop the cached quantized weight (the next call quantizes again)."""
        self._weight_cache = None
        self._weight_cache_key = None

    def _key(self, extra: bool):
        w = self.weight
        return (w.data_ptr(), w._version, w.dtype, w.device, self.config, extra)

    def _cached(self, is_first_microbatch: bool, extra: bool, build):
        """The cached copies when valid (and not the first micro-batch), else ``build()``, cached."""
        if not is_first_microbatch and self._weight_cache is not None:
            key = self._weight_cache_key
            if key == self._key(extra) or (not extra and key == self._key(True)):
                return self._weight_cache
        copies = build()
        self._weight_cache, self._weight_cache_key = copies, self._key(extra)
        return copies


# granularities whose weight copy for grad_input (grouped along N) cannot be derived from the
# forward copy by a transpose: the cache must hold the transposed copy (data_t) as well
_NEEDS_T_COPY = (ScalingGranularity.ROWWISE, ScalingGranularity.MX_BLOCKWISE)


class Float8Linear(_FP8WeightCache, torch.nn.Linear):
    """``y = x @ W^T (+ b)`` with all three GEMMs in FP8 (:func:`turbo.ops.gemm_fp8`, ``trans_b=True``).

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``.
        config: :class:`Float8QuantConfig` (default TENSORWISE E4M3).

    ``forward(x, is_first_microbatch=None)`` follows Megatron / Transformer Engine:

    * ``None``: the weight is quantized on every call, nothing is cached (the plain ``gemm_fp8``
      path; any cache held is dropped).
    * ``True``: the weight is quantized (:func:`create_quantized_weight`) and the result cached.
    * ``False``: the cached quantized weight is reused (no quantization); if there is no valid
      cache it is built as for ``True``.

    The cached copy carries the transposed weight (``need_weight_transpose_cache``) only where the
    backward needs it and it cannot be had by transposing the forward copy: ROWWISE and
    MX_BLOCKWISE granularities, when a gradient is being recorded (grad mode on and ``x`` or the
    weight requires grad). TENSORWISE and BLOCKWISE (2-D weight blocks) reuse the forward copy's
    scales for the transpose.

    Cache validity: the cache records ``weight.data_ptr()``, ``weight._version``, the dtype and
    the config; any in-place update through autograd-visible ops (``optimizer.step()`` of the
    ``torch.optim`` optimizers, ``with torch.no_grad(): w.add_(...)``, ``load_state_dict``) bumps
    ``_version``, so a ``False`` call after it re-quantizes. Writes through ``weight.data`` (e.g.
    Megatron's ``param.data.copy_(main_param)``) are invisible to the version counter: Megatron
    passes ``is_first_microbatch=True`` on the first micro-batch after each optimizer step, which
    refreshes the cache; otherwise call :meth:`invalidate_weight_cache`.

    Gradients: with a cached weight the GEMMs run through a small autograd bridge
    (:class:`_CachedWeightGemmFP8`) so the weight gradient still reaches ``weight.grad``, or
    ``weight.main_grad`` when present (Megatron, see the module docstring).

    ``torch.compile``: with ``is_first_microbatch=None`` the layer traces whole (``fullgraph=True``;
    the FP8 GEMMs and quantizers are custom ops). The cached branch (``True`` / ``False``) runs
    outside the graph, a graph break (``fullgraph=False``), so the cache keeps its semantics: its
    validity check reads host state (the weight's data pointer and version counter) that a traced
    graph could not re-check on later calls.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 config: Optional[Float8QuantConfig] = None, device=None, dtype=None):
        _check_features("Float8Linear", in_features, out_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(config)

    def _init_fp8(self, config: Optional[Float8QuantConfig]) -> None:
        """The FP8 state on top of an ``nn.Linear``'s (the constructor's and an in-place conversion's)."""
        if config is not None and not isinstance(config, Float8QuantConfig):
            raise TypeError(f"Float8Linear: config must be a Float8QuantConfig, got {type(config).__name__}")
        self.config = Float8QuantConfig() if config is None else config
        self._weight_cache: Optional[QuantizedTensorPair] = None
        self._weight_cache_key = None

    @classmethod
    def from_float(cls, mod: torch.nn.Linear, config: Optional[Float8QuantConfig] = None,
                   inplace: bool = True) -> "Float8Linear":
        """``mod`` as a :class:`Float8Linear` (the reference API's signature).

        ``inplace=True`` (the default) converts ``mod`` itself and returns it: same object, same
        parameters, hooks and attributes, its class switched (what a model-walking converter
        expects: the parent module keeps its child). ``inplace=False`` returns a new module that
        shares ``mod``'s weight and bias parameters and leaves ``mod`` as it was.
        """
        if not isinstance(mod, torch.nn.Linear):
            raise TypeError(f"Float8Linear.from_float: mod must be a torch.nn.Linear, got {type(mod).__name__}")
        if isinstance(mod, Float8Linear):
            raise TypeError("Float8Linear.from_float: mod is already a Float8Linear")
        if type(mod) is not torch.nn.Linear and inplace:
            # a subclass's own forward / state would be lost to the class switch
            raise TypeError(f"Float8Linear.from_float: inplace conversion takes a plain torch.nn.Linear, got "
                            f"{type(mod).__name__} (pass inplace=False for a new module sharing its parameters)")
        if inplace:
            mod.__class__ = cls
            mod._init_fp8(config)
            return mod
        new = cls(mod.in_features, mod.out_features, bias=False, config=config,
                  device=mod.weight.device, dtype=mod.weight.dtype)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, config={self.config}"

    def _cached_weight(self, is_first_microbatch: bool, need_t: bool) -> QuantizedTensorPair:
        def build():
            with torch.no_grad():
                return create_quantized_weight(self.weight.detach(), self.config.fwd_dtype(), self.config,
                                               need_weight_transpose_cache=need_t)

        return self._cached(is_first_microbatch, need_t, build)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        _check_x(x, self.in_features, "Float8Linear")
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"Float8Linear: is_first_microbatch must be None, True or False, got "
                            f"{is_first_microbatch!r}")
        lead = x.shape[:-1]
        x2 = _rows(x, self.in_features)
        w, cfg = self.weight, self.config
        fuse = _fuse_pattern(w)
        if is_first_microbatch is None or x2.shape[0] == 0:
            if is_first_microbatch is None:
                self.invalidate_weight_cache()
            y = gemm_fp8(x2, w, trans_b=True, config=cfg, fuse_bgrad_accum_pattern=fuse)
        else:
            amp = autocast_dtype(x2)
            if amp is not None:  # (the cached copies are FP8 already: only the activation is autocast's)
                (x2,) = cast_inputs(amp, x2)
            elif x2.dtype != w.dtype:
                raise TypeError(f"Float8Linear: input dtype {x2.dtype} must match the weight's {w.dtype}")
            # under torch.compile the cached branch runs eagerly (the graph breaks around it): its validity
            # check reads the weight's data pointer and version counter, host state dynamo can neither
            # trace nor guard on (a traced check would bake one call's hit or miss into the graph), and
            # the cached copies are QuantizedTensor subclasses held across calls, outside any graph.
            # (Wrapped on use: torch.compiler.disable imports dynamo, which importing the layers does not.)
            run = Float8Linear._cached_forward
            if torch.compiler.is_compiling():
                run = torch.compiler.disable(run)
            y = run(self, x2, is_first_microbatch, fuse)
        if self.bias is not None:
            y = y + _bias(self.bias, y)
        return y.reshape(*lead, self.out_features)

    def _cached_forward(self, x2: torch.Tensor, is_first_microbatch: bool, fuse: Optional[str]) -> torch.Tensor:
        """``x2 @ W^T`` with the weight's FP8 copies from the micro-batch cache (see :meth:`forward`)."""
        if autocast_dtype(x2) is not None:
            with autocast_off(x2):  # (the ATen ops inside keep the dtypes chosen: core/amp.py)
                return self._cached_forward(x2, is_first_microbatch, fuse)
        w, cfg = self.weight, self.config
        grad = torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad)
        need_t = grad and x2.requires_grad and cfg.granularity in _NEEDS_T_COPY
        pair = self._cached_weight(bool(is_first_microbatch), need_t)
        if grad:
            out = _CachedWeightGemmFP8.apply(x2, w, pair, x2.dtype, cfg.granularity.name, cfg.fwd_dtype(),
                                             cfg.bwd_dtype(), int(cfg.block_size or 128), fuse is not None)
            if fuse is not None and w.requires_grad:
                _flag_main_grad(w)
            return out
        return gemm_fp8(x2, pair, trans_b=True, out_dtype=x2.dtype, config=cfg)


def convert_to_float8(model: torch.nn.Module, config: Optional[Float8QuantConfig] = None,
                      module_filter_fn=None) -> torch.nn.Module:
    """Every plain ``torch.nn.Linear`` in ``model`` (``model`` itself included) converted in place to a
    :class:`Float8Linear` with ``config`` (:meth:`Float8Linear.from_float`, ``inplace=True``: the same
    module objects, parameters, hooks and state-dict keys, their class switched), as a training
    script converts a model before wrapping it for data parallelism (torchao's
    ``convert_to_float8_training`` does the same for its own layer). Returns ``model``.

    ``module_filter_fn(module, fqn) -> bool`` chooses which layers convert (``fqn`` is the name in
    ``model.named_modules()``; the usual filter keeps the output head and small layers in 16 bits).
    Subclasses of ``torch.nn.Linear`` (our :class:`Linear`, :class:`RouterLinear`, other libraries'
    layers) are left as they are: switching their class would drop their own ``forward``. Works on a
    model built on the meta device (nothing is quantized until the first call)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_to_float8: model must be a torch.nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, Float8QuantConfig):
        raise TypeError(f"convert_to_float8: config must be a Float8QuantConfig or None, got {type(config).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"convert_to_float8: module_filter_fn must be callable, got {type(module_filter_fn).__name__}")
    # collected first: converting while named_modules() walks would be safe (the objects stay), but
    # a filter that inspects its neighbours should see the model as it was
    chosen = [m for fqn, m in model.named_modules()
              if type(m) is torch.nn.Linear and (module_filter_fn is None or module_filter_fn(m, fqn))]
    for m in chosen:
        Float8Linear.from_float(m, config=config, inplace=True)
    return model
