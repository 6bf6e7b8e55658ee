"""Grouped (per-expert) linear layer over ``turbo.ops.grouped_gemm`` / ``turbo.ops.grouped_gemm_fp8``."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from ..core.amp import autocast_dtype, autocast_off, cast_inputs
from ..core.low_precision import Float4QuantConfig, Float8QuantConfig
from ..ops.grouped_gemm import grouped_gemm
from ..ops.grouped_gemm_fp4 import grouped_gemm_fp4
from ..ops.grouped_gemm_fp8 import grouped_gemm_fp8, grouped_gemm_fp8_cached_weight, grouped_weight_copies
from .linear import _FP8WeightCache, _fuse_pattern

__all__ = ["GroupedLinear"]


class GroupedLinear(_FP8WeightCache, torch.nn.Module):
    """``num_groups`` independent linear maps (MoE experts) over tokens sorted by group.

    ``GroupedLinear(num_groups, in_features, out_features, device=None, dtype=None, *, config=None)``:
    the positional order is Primus-Turbo's ``(group_num, in_features, out_features, device, dtype)``,
    and the group count may be given as ``num_groups=`` or as Primus-Turbo's ``group_num=`` (exactly
    one of them, TypeError otherwise; ``group_num`` is also a read-only alias attribute). A dtype
    passed where the device goes (the old ``dtype, device`` order) is a TypeError. ``config``
    (keyword only) selects the FP8 / MXFP4 path below.

    ``weight`` is ``[num_groups, out_features, in_features]`` (the ``nn.Linear`` layout per group),
    each group initialised as ``torch.nn.Linear`` would. No bias.

    ``forward(x, group_lens, group_offs=None)``: ``x [M_total, in_features]`` with the rows of group
    ``g`` at ``group_offs[g] : group_offs[g] + group_lens[g]`` (``group_lens`` int64 ``[G]`` on x's
    device); returns ``[M_total, out_features]``, row ``r`` of group ``g`` being ``x[r] @ W[g]^T``
    (rows past ``sum(group_lens)`` give zeros). Runs :func:`turbo.ops.grouped_gemm` (``trans_b=True``),
    :func:`turbo.ops.grouped_gemm_fp8` when ``config`` is a :class:`Float8QuantConfig`, or
    :func:`turbo.ops.grouped_gemm_fp4` (MXFP4, emulated on Hopper) when it is a
    :class:`Float4QuantConfig` (in_features, and out_features when the input needs a gradient,
    multiples of 32).
    With ``weight.main_grad`` present (Megatron) the weight gradient is accumulated into it in the
    kernel epilogue (``fuse_bgrad_accum_pattern="megatron"``).

    FP8 weight cache, ``forward(..., is_first_microbatch=...)`` as Megatron / Transformer Engine pass
    it (ignored in bf16 and MXFP4, which quantize on every call):

    * ``None`` (default): the expert weights are quantized on every call, nothing is cached (any
      cache held is dropped);
    * ``True``: they are quantized (forward copy, and the grad_input copy when a gradient is being
      recorded for the input) and cached;
    * ``False``: the cached copies are reused, no quantization; without a valid cache they are
      built as for ``True``.

    Validity is checked as :class:`Float8Linear` checks it: ``weight.data_ptr()``,
    ``weight._version`` (bumped by ``optimizer.step()`` and other autograd-visible in-place
    updates), dtype, device and config. Writes through ``weight.data`` are invisible to it: pass
    ``True`` on the first micro-batch after each optimizer step (Megatron does) or call
    :meth:`invalidate_weight_cache`. The weight gradient (or ``main_grad`` accumulation) is the
    same with or without the cache: the grad_weight GEMM never reads the weight. The cache holds
    one byte per weight element per copy (two copies while gradients are recorded) plus scales,
    until the next ``None`` call or :meth:`invalidate_weight_cache`.

    ``torch.compile``: the 16-bit path traces whole (``fullgraph=True``; ``grouped_gemm`` is a custom
    op). The FP8 and MXFP4 paths run outside the graph (a graph break, ``fullgraph=False``), with the
    weight cache's eager semantics; see :meth:`forward`.
    """

    def __init__(self, num_groups: Optional[int] = None, in_features: Optional[int] = None,
                 out_features: Optional[int] = None, device=None, dtype=None, *,
                 config: Optional[Float8QuantConfig | Float4QuantConfig] = None, group_num: Optional[int] = None):
        super().__init__()
        if (num_groups is None) == (group_num is None):
            raise TypeError("GroupedLinear: pass the number of groups exactly once, as num_groups (or the first "
                            "positional argument) or as Primus-Turbo's group_num, got "
                            + ("both" if num_groups is not None else "neither"))
        if num_groups is None:
            num_groups = group_num
        for arg, val in (("in_features", in_features), ("out_features", out_features)):
            if val is None:
                raise TypeError(f"GroupedLinear: missing required argument {arg!r}")
        if isinstance(device, torch.dtype) or not (dtype is None or isinstance(dtype, torch.dtype)):
            raise TypeError(f"GroupedLinear: got device={device!r}, dtype={dtype!r}; the positional order is "
                            "(num_groups, in_features, out_features, device, dtype), as Primus-Turbo's")
        for arg, val in (("num_groups", num_groups), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(val, numbers.Integral) or isinstance(val, bool):
                raise TypeError(f"GroupedLinear: {arg} must be an int, got {val!r}")
        if num_groups <= 0 or in_features <= 0 or out_features <= 0:
            raise ValueError(f"GroupedLinear: sizes must be positive, got num_groups={num_groups}, "
                             f"in_features={in_features}, out_features={out_features}")
        if config is not None and not isinstance(config, (Float8QuantConfig, Float4QuantConfig)):
            raise TypeError(f"GroupedLinear: config must be a Float8QuantConfig, a Float4QuantConfig or None, got "
                            f"{type(config).__name__}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.config = config
        self.weight = torch.nn.Parameter(torch.empty(num_groups, out_features, in_features, dtype=dtype,
                                                     device=device))
        self.reset_parameters()

    @property
    def group_num(self) -> int:
        """Primus-Turbo's name of :attr:`num_groups`."""
        return self.num_groups

    def reset_parameters(self) -> None:
        for g in range(self.num_groups):
            torch.nn.init.kaiming_uniform_(self.weight.data[g], a=math.sqrt(5))

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}"
                f", config={self.config}")

    def forward(self, x: torch.Tensor, group_lens: torch.Tensor, group_offs: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"GroupedLinear: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"GroupedLinear: x must be [M_total, {self.in_features}], got {tuple(x.shape)}")
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"GroupedLinear: is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
        w = self.weight
        fuse = _fuse_pattern(w)
        if self.config is None:
            return grouped_gemm(x, w, group_lens, group_offs, trans_b=True, fuse_bgrad_accum_pattern=fuse)
        if isinstance(self.config, Float4QuantConfig):
            return grouped_gemm_fp4(x, w, group_lens, group_offs, trans_b=True, config=self.config,
                                    fuse_bgrad_accum_pattern=fuse)
        if is_first_microbatch is None:
            self.invalidate_weight_cache()
            return grouped_gemm_fp8(x, w, group_lens, group_offs, trans_b=True, config=self.config,
                                    fuse_bgrad_accum_pattern=fuse)
        # under torch.compile the cached branch runs eagerly (the graph breaks around it): the FP8 weight
        # cache's validity check reads the weight's data pointer and version counter, host state dynamo
        # can neither trace nor guard on (a traced check would bake one call's hit or miss into the
        # graph). (Wrapped on use: torch.compiler.disable imports dynamo, which importing the layers
        # does not.)
        run = GroupedLinear._cached_forward
        if torch.compiler.is_compiling():
            run = torch.compiler.disable(run)
        return run(self, x, group_lens, group_offs, is_first_microbatch, fuse)

    def _cached_forward(self, x: torch.Tensor, group_lens: torch.Tensor, group_offs: Optional[torch.Tensor],
                        is_first_microbatch: bool, fuse: Optional[str]) -> torch.Tensor:
        """The FP8 forward of :meth:`forward` with the weight's copies from the micro-batch cache."""
        w = self.weight
        amp = autocast_dtype(x)
        if amp is not None:  # the activation is autocast's; the grouped FP8 op takes one dtype
            if w.dtype != amp:
                raise TypeError(f"GroupedLinear: the FP8 weight cache (is_first_microbatch) under "
                                f"torch.autocast({amp}) needs the weight in {amp}, got {w.dtype}; pass "
                                f"is_first_microbatch=None (the weight quantized every call) or keep it in {amp}")
            (x,) = cast_inputs(amp, x)
            with autocast_off(x):
                return self._cached_forward(x, group_lens, group_offs, is_first_microbatch, fuse)
        if x.dtype != w.dtype:
            raise TypeError(f"GroupedLinear: input dtype {x.dtype} must match the weight's {w.dtype}")
        need_dgrad = torch.is_grad_enabled() and x.requires_grad
        copies = self._cached(is_first_microbatch, need_dgrad,
                              lambda: grouped_weight_copies(w, self.config, need_dgrad))
        return grouped_gemm_fp8_cached_weight(x, w, copies, group_lens, group_offs, trans_b=True, config=self.config,
                                              fuse_bgrad_accum_pattern=fuse)
