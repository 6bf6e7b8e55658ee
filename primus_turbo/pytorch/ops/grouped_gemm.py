"""Grouped GEMM of MoE experts: ``turbo.ops.grouped_gemm``.

Semantics: rows of ``a`` ``[M_total, K]`` are split into ``G`` consecutive groups by ``group_lens``
(``group_offs`` is its ``[G+1]`` exclusive prefix sum), and group ``g`` is multiplied by expert
``g``'s weight ``op(b[g])`` (``b`` stored ``[G, K, N]``, or ``[G, N, K]`` with ``trans_b=True``)::

    out[offs[g]:offs[g+1]] = a[offs[g]:offs[g+1]] @ op(b[g])        out[offs[G]:] = 0

The three GEMMs of training:

* output:      M-grouped GEMM, ``a`` with ``op(b)``
* grad_input:  M-grouped GEMM, ``dC`` with ``op(b).T`` (the weights read transposed, in place)
* grad_weight: variable-K grouped GEMM, ``dB[g] = a_g.T @ dC_g`` (``dC_g.T @ a_g`` with ``trans_b``),
  where the reduction runs over group ``g``'s rows; optionally ``b.main_grad += dB`` (Megatron).

No host synchronisation anywhere: group sizes are only read on the device (offsets by
``torch.cumsum``, tile schedules inside the kernels), every size and branch comes from shapes, so
the op is CUDA-graph capturable. Each GEMM is a ``torch.library`` custom op with a fake
implementation (for ``torch.compile``); eager calls skip the custom-op dispatcher.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..backends.grouped_gemm import (
    _vendor_offs,
    GLUON_WGRAD_MIN_FLOPS,
    GROUPED_GEMM_DTYPES,
    GroupedGemmGluonBackend,
    GroupedGemmTorchBackend,
    GroupedGemmVariableKTorchBackend,
    _gluon16,
    gluon_wgrad,
    gluon16_large_preferred,
    grouped_gemm_dispatcher,
    grouped_gemm_variable_k_dispatcher,
    zero_tail_rows,
)
from ..core.amp import autocast_dtype, gemm_under_autocast
from ..core.backend import BackendType, GlobalBackendManager, PrecisionType
from ..core.env import env_raw
from ..core.quantized_tensor import QuantizedTensor
from .gemm import _FUSE_PATTERNS, _flag_main_grad, _megatron_dummy_wgrad, check_main_grad

__all__ = ["grouped_gemm"]

_BF16 = PrecisionType.BF16_FP16_FP32
_GLUON_ENV = "PRIMUS_TURBO_GROUPED_GEMM_GLUON"
_PACE_ENV = "PRIMUS_TURBO_GROUPED_GEMM_PACE"  # the Gluon launchers' pacing switch (part of their plan)


def _offsets(group_lens: torch.Tensor) -> torch.Tensor:
    """[G+1] int64 exclusive prefix sum on the device, no sync: on CUDA one Triton launch
    (triton/grouped_gemm/offsets.py; the torch form is three kernels and three dispatches), else
    ``torch.cumsum``."""
    if group_lens.is_cuda and not torch.compiler.is_compiling():
        fn = _offsets_kernel_fn()
        if fn is not None:
            return fn(group_lens)
    offs = torch.zeros(group_lens.numel() + 1, dtype=torch.int64, device=group_lens.device)
    offs[1:] = torch.cumsum(group_lens, 0)
    return offs


def _group_offsets(op: str, group_lens: torch.Tensor, group_offs: Optional[torch.Tensor],
                   a: torch.Tensor) -> torch.Tensor:
    """``group_offs`` (made on the device when None). On CPU, where it costs no sync, async asserts
    check what the device alone knows: no group length is negative, the groups fit ``a``'s rows
    and a given ``group_offs`` is ``group_lens``' exclusive prefix sum. (On CUDA the same checks
    would need a host sync or a fatal device-side assert; the kernels clamp every group to ``a``'s
    rows there, so bad values never reach memory out of bounds.)"""
    given = group_offs is not None
    if not given:
        group_offs = _offsets(group_lens)
    if a.device.type == "cpu" and not torch.compiler.is_compiling():
        torch._assert_async(torch.all(group_lens >= 0), f"{op}: group_lens has a negative entry")
        torch._assert_async(group_offs[-1] <= a.size(0), f"{op}: sum(group_lens) exceeds a.shape[0]")
        if given:
            torch._assert_async(torch.all(group_offs[1:] - group_offs[:-1] == group_lens) & (group_offs[0] == 0),
                                f"{op}: group_offs is not the exclusive prefix sum of group_lens")
    return group_offs


@functools.lru_cache(maxsize=None)
def _offsets_kernel_fn():
    try:
        from primus_turbo.triton.grouped_gemm.offsets import group_offsets_
    except ImportError:  # no triton: the torch form
        return None
    return group_offsets_


# --------------------------------------------------------------------------------------------
# The GEMMs, as custom ops
# --------------------------------------------------------------------------------------------
def _gmm_eager(
    a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor, group_offs: torch.Tensor, trans_b: bool,
    num_cu: Optional[int],
) -> torch.Tensor:
    """M-grouped: ``out[rows of g] = a[rows of g] @ op(b[g])``, rows past ``offs[G]`` zero."""
    B = b.transpose(1, 2) if trans_b else b  # logical [G, K, N], a view
    kw = dict(a=a, b=B, group_lens=group_lens, group_offs=group_offs, num_cu=num_cu)
    return _resolved(kw).execute(**kw)


_DEFAULTS: dict = {}  # _resolved's cache


def _tensor_key(t: Optional[torch.Tensor]):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _resolved(kw: dict):
    """The M-grouped dispatcher's backend for these arguments: its own resolution under a pin or
    autotuning; the default's answer cached per call signature otherwise (what the default and the
    backends' checks read: the settings version, the Gluon switch, the interpreter switch, every
    tensor's shape, strides, dtype, device and 16-byte alignment, ``num_cu``). The resolution costs
    ~12 us of host time a call on the dev host (more on the H200 machine's), a quarter of a small
    no-grad call."""
    backend, _source, tune = grouped_gemm_dispatcher.plan(_BF16)
    if backend is not None or tune:
        return grouped_gemm_dispatcher.resolve(_BF16, **kw)
    key = (GlobalBackendManager._version, env_raw(_GLUON_ENV), env_raw("TRITON_INTERPRET"), _tensor_key(kw["a"]),
           _tensor_key(kw["b"]), _tensor_key(kw["group_lens"]), _tensor_key(kw["group_offs"]), kw["num_cu"])
    impl = _DEFAULTS.get(key)
    if impl is None:
        impl = _remember(_DEFAULTS, key, grouped_gemm_dispatcher.resolve(_BF16, **kw))
    return impl


def _remember(cache: dict, key, value):
    """``cache[key] = value`` (returned), the cache emptied first once it holds 1024 signatures:
    shape churn (tests, sweeps) starts over rather than grows."""
    if len(cache) >= 1024:
        cache.clear()
    cache[key] = value
    return value


grouped_gemm_impl = torch.library.custom_op("primus_turbo::grouped_gemm_impl", _gmm_eager, mutates_args=())


@grouped_gemm_impl.register_fake
def _grouped_gemm_impl_fake(a, b, group_lens, group_offs, trans_b, num_cu):
    n = b.size(1) if trans_b else b.size(2)
    return a.new_empty((a.size(0), n))


def _vk_eager(
    x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor, group_offs: torch.Tensor, num_cu: Optional[int],
) -> torch.Tensor:
    """Variable K: ``out[g] = x[rows of g].T @ y[rows of g]``, ``[G, P, Q]``."""
    return grouped_gemm_variable_k_dispatcher.dispatch(
        _BF16, x=x, y=y, group_lens=group_lens, group_offs=group_offs, out=None,
        accumulate=False, num_cu=num_cu)


grouped_gemm_variable_k_impl = torch.library.custom_op(
    "primus_turbo::grouped_gemm_variable_k_impl", _vk_eager, mutates_args=())


@grouped_gemm_variable_k_impl.register_fake
def _grouped_gemm_variable_k_impl_fake(x, y, group_lens, group_offs, num_cu):
    return x.new_empty((group_offs.numel() - 1, x.size(1), y.size(1)))


def _vk_accum_eager(
    x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor, group_offs: torch.Tensor, c: torch.Tensor,
    num_cu: Optional[int],
) -> None:
    """``c[g] += x[rows of g].T @ y[rows of g]`` (fp32 sum, added in the kernel epilogue)."""
    grouped_gemm_variable_k_dispatcher.dispatch(
        _BF16, x=x, y=y, group_lens=group_lens, group_offs=group_offs, out=c,
        accumulate=True, num_cu=num_cu)


grouped_gemm_variable_k_accum_impl = torch.library.custom_op(
    "primus_turbo::grouped_gemm_variable_k_accum_impl", _vk_accum_eager, mutates_args=("c",))


@grouped_gemm_variable_k_accum_impl.register_fake
def _grouped_gemm_variable_k_accum_impl_fake(x, y, group_lens, group_offs, c, num_cu):
    return None


def _gmm(a, b, group_lens, group_offs, trans_b, num_cu):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.grouped_gemm_impl(a, b, group_lens, group_offs, trans_b, num_cu)
    return _gmm_eager(a, b, group_lens, group_offs, trans_b, num_cu)


def _vk(x, y, group_lens, group_offs, num_cu):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.grouped_gemm_variable_k_impl(x, y, group_lens, group_offs, num_cu)
    return _vk_eager(x, y, group_lens, group_offs, num_cu)


def _vendor_route(a: torch.Tensor, B: torch.Tensor, num_cu, group_offs: Optional[torch.Tensor] = None,
                  trans_b: bool = False) -> Optional[str]:
    """The route of the three GEMMs of this call under the current settings, decided once per
    forward. ``"gluon"``: under the default dispatch (or a TRITON or GLUON pin, whose backends run the
    same kernels there), wherever the 16-bit Gluon kernels can run all
    three (:func:`_gluon_route_ok`), the forward and grad_input on the M-grouped Gluon kernel and
    the grad_weight on the variable-K one, each launched directly (no dispatcher; H200 device time,
    ``benchmarks/bench_grouped_gemm.py --timing graph``, 2026-12-02: 0.984-1.31x
    ``torch._grouped_mm`` over the 96 registry rows forward+backward, 1.016-1.31x forward, where the
    vendor route measured 0.958-1.21x). Otherwise truthy when the three all run on the TORCH
    backends' path: ``"pinned"`` when the user
    pinned TORCH (every GEMM on ``torch._grouped_mm``), ``"default"`` when the default dispatch
    chose it (the grad_weight then takes the Gluon variable-K kernel where
    :func:`gluon_wgrad` gives it the problem, as the variable-K dispatcher's default would); None
    otherwise.

    Where the Gluon route cannot run, the vendor route is asked once per forward: for small expert
    GEMMs under autograd the Python time is what the step costs (the vendor kernels take tens of
    microseconds). Large problems that the default gives to the Gluon kernel (:func:`gluon16_large_preferred`: its
    rule is symmetric in N and K, so it holds for the grad_input GEMM too) take the dispatcher's
    route (None), as do calls where ``group_offs`` is given and the Gluon kernel can run them.
    Sound because the backward's operands follow from the forward's: the grad_input GEMM reads the
    same weight as a transposed view (row- and column-major are both taken, the strides are the same
    numbers), and the grad_weight GEMM reads ``a`` (row-major and aligned: checked here) and the
    contiguous ``[M, N]`` output gradient, whose rows are 16-byte aligned exactly when the forward
    output's are (checked here). One pin covers both dispatchers
    (their family is ``grouped_gemm``); under autotuning every GEMM keeps its own dispatch."""
    if num_cu is not None or torch.compiler.is_compiling():
        return None
    backend, _source, tune = grouped_gemm_dispatcher.plan(_BF16)
    if tune:
        return None
    if backend in _GLUON_ROUTE_BACKENDS and _gluon_route_ok(a, B, group_offs, trans_b):
        return "gluon"
    if backend not in (None, BackendType.TORCH):
        return None
    if (B.size(2) * a.element_size()) % 16:
        return None  # grad_out rows would not be aligned for the vendor grad_weight
    if GroupedGemmTorchBackend.check(a, B, None, None) is not None:
        return None
    if (backend is None and group_offs is not None
            and gluon16_large_preferred(a.size(0), B.size(2), a.size(1), B.size(0))
            and GroupedGemmGluonBackend.check(a, B, None, group_offs) is None):
        return None
    return "default" if backend is None else "pinned"


#: the settings under which the op may take the Gluon route: the default, and the TRITON and GLUON
#: pins, whose backends run the same Gluon kernels wherever those can run (one decision per forward
#: instead of three dispatches)
_GLUON_ROUTE_BACKENDS = (None, BackendType.TRITON, BackendType.GLUON)


def _gluon_route_ok(a: torch.Tensor, B: torch.Tensor, group_offs: Optional[torch.Tensor], trans_b: bool) -> bool:
    """Whether the 16-bit Gluon kernels take all three GEMMs of a call (``B`` the logical
    ``[G, K, N]`` weight): the forward as the M-grouped kernel's own check says (sm_90, dtypes,
    TMA strides, the switch), the grad_input with the output gradient ``[M, N]`` (made contiguous
    and 16-byte aligned by the backward) and the weight read transposed, the grad_weight with ``P``
    (its output rows per expert: N with ``trans_b``, else K) a multiple of 64. Shapes only."""
    if group_offs is None:
        return False
    m16 = _gluon16("grouped_gemm_gluon", a)
    if m16 is None or _gluon16("grouped_gemm_variable_k_gluon", a) is None:
        return False
    if m16.gluon_grouped_reason(a, B, group_offs) is not None:
        return False
    K, N, es = a.size(1), B.size(2), a.element_size()
    if (K * es) % 16 or (N * es) % 16 or m16._b_kmajor(B.transpose(1, 2)) is None:
        return False
    return (N if trans_b else K) % 64 == 0


@functools.lru_cache(maxsize=None)
def _gluon_module(name: str):
    """``primus_turbo.triton.grouped_gemm.<name>`` (imported once :func:`_gluon_route_ok` chose it)."""
    import importlib

    return importlib.import_module(f"primus_turbo.triton.grouped_gemm.{name}")


_ROUTES: dict = {}  # _routed's cache


def _routed(a: torch.Tensor, b: torch.Tensor, trans_b: bool, num_cu, group_offs: Optional[torch.Tensor]):
    """:func:`_vendor_route` of one call, cached by everything its answer reads: the backend
    settings (their version, the Gluon switch), the operands' shapes, strides, dtypes, devices and
    16-byte alignment, and the offsets' (the checks behind it cost tens of microseconds of host
    time per call, as much as a small expert GEMM's device time)."""
    if num_cu is not None or torch.compiler.is_compiling():
        return None
    backend, _source, tune = grouped_gemm_dispatcher.plan(_BF16)
    if tune or (backend not in _GLUON_ROUTE_BACKENDS and backend is not BackendType.TORCH):
        return None
    key = (backend, GlobalBackendManager._version, env_raw(_GLUON_ENV), trans_b, _tensor_key(a), _tensor_key(b),
           _tensor_key(group_offs))
    route = _ROUTES.get(key, _UNSET)
    if route is _UNSET:
        route = _remember(_ROUTES, key, _vendor_route(a, b.transpose(1, 2) if trans_b else b, num_cu, group_offs,
                                                      trans_b))
    return route


_UNSET = object()


def _native_ok(a: torch.Tensor, b: torch.Tensor, trans_b: bool, vendor, fuse: bool) -> bool:
    """Whether a vendor-routed call can leave its backward to torch's own autograd formula of
    ``torch._grouped_mm`` (:func:`_native_vendor`): no fused accumulation into ``main_grad``, every
    size non-zero (the vendor op rejects empty contractions), and a grad_weight the default would
    not give to the Gluon variable-K kernel (below :data:`GLUON_WGRAD_MIN_FLOPS`, or TORCH pinned)."""
    if fuse or vendor not in ("default", "pinned"):
        return False
    m, k = a.shape
    n = b.size(1) if trans_b else b.size(2)
    if m == 0 or k == 0 or n == 0 or b.size(0) == 0:
        return False
    return vendor == "pinned" or 2.0 * m * n * k < GLUON_WGRAD_MIN_FLOPS


def _zero_grad_input_tail(group_offs: torch.Tensor, grad_inputs, grad_outputs):
    """Post-hook of the vendor GEMM's autograd node: its grad_input rows past ``offs[G]`` are left
    unwritten by ``torch._grouped_mm``; the op's contract (those rows of ``a`` take no part) makes
    them zero."""
    ga = grad_inputs[0]
    if ga is None:
        return None
    if ga.stride(1) != 1:
        ga = ga.contiguous()
    zero_tail_rows(ga, group_offs)
    return (ga,) + tuple(grad_inputs[1:])


def _vendor_grad_output(grad_outputs):
    """Pre-hook of the vendor GEMM's autograd node: ``torch._grouped_mm`` takes row- or
    column-major operands only, so an output gradient of another layout (an expanded one, from a
    ``.sum()``; one whose base is not 16-byte aligned) is copied first, as the op's Function form
    does."""
    g = grad_outputs[0]
    if g is None or (g.is_contiguous() and g.data_ptr() % 16 == 0):
        return None
    return (g.clone(memory_format=torch.contiguous_format),)


def _native_vendor(a: torch.Tensor, b: torch.Tensor, group_offs: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """The vendor route of a small problem under autograd: ``torch._grouped_mm`` recorded by torch's
    own autograd, so its backward (grad_input and grad_weight on the same kernel) runs in C++ with
    no Python ``autograd.Function`` around it. The forward's rows past ``offs[G]`` are zeroed in
    place by a kernel autograd does not see (nothing saves the output), the grad_input's by a post
    hook on the GEMM's node. Same kernels and results as :class:`GroupedGemmFunction`'s vendor route;
    for expert GEMMs of tens of microseconds this removes most of the op's host time, which is what
    such a step costs in eager mode."""
    # the offsets clamped to a's rows (one small launch): a group_lens summing past them is not
    # checked on CUDA, and torch._grouped_mm would follow it out of bounds (see _vendor_offs)
    offs = _vendor_offs(group_offs, None, a.size(0))
    out = torch._grouped_mm(a, b.transpose(1, 2) if trans_b else b, offs=offs)
    zero_tail_rows(out, group_offs)
    node = out.grad_fn
    node.register_prehook(_vendor_grad_output)
    if a.requires_grad:
        node.register_hook(functools.partial(_zero_grad_input_tail, group_offs))
    return out


def _vk_accum(x, y, group_lens, group_offs, c, num_cu):
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.grouped_gemm_variable_k_accum_impl(x, y, group_lens, group_offs, c, num_cu)
    return _vk_accum_eager(x, y, group_lens, group_offs, c, num_cu)


def grouped_gemm_backward(g, a, b, group_lens, group_offs, tb, num_cu, vendor, offs32, fuse_accum, need_a, need_b):
    """(grad_a, grad_b) of ``out = grouped_gemm(a, b, ..., trans_b=tb)`` for the output gradient ``g``
    (``a``'s dtype): the grad_input GEMM when ``need_a``, the grad_weight GEMM (or its accumulation
    into ``b.main_grad`` with ``fuse_accum``, returning Megatron's placeholder) when ``need_b``, on the
    route the forward chose (``vendor``, ``offs32``: see :func:`_vendor_route`). Shared with the fused
    fc1 + activation op (``grouped_gemm_glu``), whose backward ends in this GEMM's."""
    grad_a = grad_b = None
    if not g.is_contiguous():
        g = g.contiguous()
    if vendor == "gluon":
        if g.data_ptr() % 16:  # TMA needs a 16-byte aligned base (a slice's gradient may not have one)
            g = g.clone()
        if need_a:  # the logical [G, N, K] weight: b itself with trans_b, else its transposed view
            grad_a = _gluon_module("grouped_gemm_gluon").grouped_gemm_gluon(
                g, b if tb else b.transpose(1, 2), group_offs, checked=True)
        if need_b and not fuse_accum:
            x, y = (g, a) if tb else (a, g)
            grad_b = _gluon_module("grouped_gemm_variable_k_gluon").grouped_gemm_variable_k_gluon(x, y, group_offs)
            need_b = False
    if need_a and grad_a is None:
        # grad_input: dA[rows of g] = dC[rows of g] @ op(b[g]).T; rows past offs[G] get zeros; on the
        # vendor route the logical [G, N, K] weight is b itself with trans_b, else its transposed view
        if vendor and vendor != "gluon":
            grad_a = GroupedGemmTorchBackend.execute(g, b if tb else b.transpose(1, 2), group_lens, group_offs,
                                                     offs32=offs32)
        else:
            grad_a = _gmm(g, b, group_lens, group_offs, not tb, num_cu)
    if need_b:
        # grad_weight, stored like b: [G, K, N] = a_g.T @ dC_g, or [G, N, K] = dC_g.T @ a_g
        x, y = (g, a) if tb else (a, g)
        if fuse_accum:
            _vk_accum(x, y, group_lens, group_offs, b.main_grad, num_cu)
            grad_b = _megatron_dummy_wgrad(b)  # (the flag: the op sets it with the forward)
        elif vendor and vendor != "gluon":
            gluon = gluon_wgrad(x, y, group_offs) if vendor == "default" else None
            if gluon is not None:
                grad_b = gluon.grouped_gemm_variable_k_gluon(x, y, group_offs)
            else:
                grad_b = GroupedGemmVariableKTorchBackend.execute(x, y, group_lens, group_offs, offs32=offs32)
        else:
            grad_b = _vk(x, y, group_lens, group_offs, num_cu)
    return grad_a, grad_b


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------
class GroupedGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_lens, group_offs, trans_b, num_cu, fuse_accum, vendor):
        ctx.trans_b, ctx.num_cu, ctx.fuse_accum, ctx.vendor = trans_b, num_cu, fuse_accum, vendor
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # grad_input needs b, grad_weight needs a (and b for its main_grad)
        ctx.save_for_backward(
            a if need_b else None, b if (need_a or (need_b and fuse_accum)) else None, group_lens, group_offs)
        if vendor == "gluon":
            ctx.offs32 = None
            return _gluon_module("grouped_gemm_gluon").grouped_gemm_gluon(
                a, b.transpose(1, 2) if trans_b else b, group_offs, checked=True)
        if vendor:
            # torch._grouped_mm's int32 offsets, made once here and reused by the backward's GEMMs
            # (each conversion is a launch)
            ctx.offs32 = offs32 = group_offs[1:].to(torch.int32)
            return GroupedGemmTorchBackend.execute(a, b.transpose(1, 2) if trans_b else b, group_lens, group_offs,
                                                   offs32=offs32)
        ctx.offs32 = None
        return _gmm(a, b, group_lens, group_offs, trans_b, num_cu)

    @staticmethod
    def backward(ctx, grad_out):
        a, b, group_lens, group_offs = ctx.saved_tensors
        dtype = a.dtype if a is not None else b.dtype
        g = grad_out if grad_out.dtype == dtype else grad_out.to(dtype)
        grad_a, grad_b = grouped_gemm_backward(g, a, b, group_lens, group_offs, ctx.trans_b, ctx.num_cu, ctx.vendor,
                                               ctx.offs32, ctx.fuse_accum, ctx.needs_input_grad[0],
                                               ctx.needs_input_grad[1])
        return grad_a, grad_b, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _check_inputs(a, b, group_lens, group_offs, trans_b, num_cu, fuse_bgrad_accum_pattern, op: str = "grouped_gemm",
                  names: tuple = ("a", "b")):
    """Raise on bad arguments, naming ``op`` and its operands ``names`` (grouped_gemm_glu's are x, w)."""
    an, bn = names
    for name, t, nd in ((an, a, 2), (bn, b, 3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if isinstance(t, QuantizedTensor):
            raise TypeError(f"{op}: {name} is a QuantizedTensor; pass it to grouped_gemm_fp8, or its dequantize()")
        if t.dim() != nd:
            raise ValueError(f"{op}: {name} must be {nd}-D, got {name}.dim()={t.dim()} with shape {tuple(t.shape)}")
        if t.dtype not in GROUPED_GEMM_DTYPES:
            raise TypeError(f"{op}: {name}.dtype must be float32, float16 or bfloat16, got {t.dtype}")
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: {an} and {bn} must have the same dtype, got {an}={a.dtype}, {bn}={b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{op}: {an} and {bn} must be on the same device, got {an} on {a.device}, {bn} on {b.device}")
    k_b = b.size(2) if trans_b else b.size(1)
    if a.size(1) != k_b:
        raise ValueError(
            f"{op}: K mismatch, {an}{tuple(a.shape)} has K={a.size(1)}, {bn}{tuple(b.shape)} with "
            f"trans_b={trans_b} has K={k_b}")
    _check_groups(op, a, b, group_lens, group_offs, num_cu, fuse_bgrad_accum_pattern, names)


def _check_groups(op: str, a, b, group_lens, group_offs, num_cu, fuse_bgrad_accum_pattern,
                  names: tuple = ("a", "b")) -> None:
    """The checks every grouped op shares once its operands are known tensors (``b`` the ``[G, ...]``
    expert stack): the group tensors (int64, on ``a``'s device, ``[G]`` / ``[G + 1]``), ``num_cu``,
    the fused-accumulation pattern and, when it is on, ``b.main_grad``."""
    an, bn = names
    G = b.size(0)
    for name, t, n in (("group_lens", group_lens, G), ("group_offs", group_offs, G + 1)):
        if t is None and name == "group_offs":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise TypeError(f"{op}: {name} must be int64, got {t.dtype}")
        if t.device != a.device:
            raise ValueError(f"{op}: {name} must be on {an}'s device {a.device}, got {t.device}")
        if t.dim() != 1 or t.numel() != n:
            raise ValueError(
                f"{op}: {name} must be 1-D with {n} entries ({bn} has G={G} experts), got shape {tuple(t.shape)}")
    if num_cu is not None and (not isinstance(num_cu, int) or isinstance(num_cu, bool) or num_cu < 1):
        raise ValueError(f"{op}: num_cu must be None or a positive int, got {num_cu!r}")
    if fuse_bgrad_accum_pattern not in _FUSE_PATTERNS:
        raise ValueError(
            f"{op}: fuse_bgrad_accum_pattern must be None or 'megatron', got {fuse_bgrad_accum_pattern!r}")
    if fuse_bgrad_accum_pattern == "megatron" and b.requires_grad and torch.is_grad_enabled():
        check_main_grad(op, b, b.dtype, name=bn)


def _check_schedule(schedule, num_cu, op: str = "grouped_gemm") -> None:
    """``schedule`` is one of the reference API's two values, and ``"work_steal"`` comes without
    ``num_cu`` (as there)."""
    if schedule not in ("static", "work_steal"):
        raise ValueError(f"{op}: schedule must be 'static' or 'work_steal', got {schedule!r}")
    if schedule == "work_steal" and num_cu is not None:
        raise ValueError(f"{op}: schedule='work_steal' needs num_cu=None, got num_cu={num_cu!r}")


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    group_offs: Optional[torch.Tensor] = None,
    trans_b: bool = False,
    num_cu: Optional[int] = None,
    schedule: str = "static",
    fuse_bgrad_accum_pattern: Optional[str] = None,
) -> torch.Tensor:
    """Grouped GEMM of MoE experts with autograd, without host synchronisation.

    The parameters are in Primus-Turbo's order, ``schedule`` before ``fuse_bgrad_accum_pattern``,
    so code written against it runs unchanged; Megatron passes ``fuse_bgrad_accum_pattern`` by
    keyword. A pattern passed positionally in ``schedule``'s place is refused by name (ValueError),
    never read as a schedule.

    Args:
        a: ``[M_total, K]`` tokens sorted by expert; ``M_total >= sum(group_lens)`` (extra rows are
            ignored and their output rows are zero). float32, float16 or bfloat16.
        b: ``[G, K, N]`` expert weights, or ``[G, N, K]`` with ``trans_b=True``; same dtype/device.
        group_lens: ``[G]`` int64 on ``a``'s device: rows per expert (zero allowed).
        group_offs: ``[G+1]`` int64 exclusive prefix sum of ``group_lens``; computed on the device
            when None.
        trans_b: ``b`` holds ``[N, K]`` matrices (the ``nn.Linear`` layout).
        num_cu: cap on the SMs (persistent programs) the TRITON kernels use, e.g. to leave SMs to
            communication kernels; the TORCH backend does not support it (TRITON then runs). A
            positive int; anything else (0, negative, float, bool, str) raises ValueError.
        fuse_bgrad_accum_pattern: ``None`` or ``"megatron"``: the weight gradient is added into
            ``b.main_grad`` (fp32 or ``b.dtype``) in the kernel epilogue and a placeholder is returned.
        schedule: ``"static"`` or ``"work_steal"`` (the reference API's
            persistent-kernel tile claiming; it needs ``num_cu=None``). Both run the same kernels:
            ours deal the tiles of every group to the persistent programs on the device in equal
            shares (balanced by tiles, whatever the group sizes), so no claiming pass exists to
            switch on; the results are the same either way. Other values raise ValueError.

    Returns:
        ``[M_total, N]`` in ``a.dtype``.

    Values that only the device knows are not checked on CUDA (that would need a sync):
    ``group_lens`` must be non-negative and sum to at most ``M_total``. A sum past ``M_total`` is
    clamped on the device instead: the Triton and Gluon kernels clamp every group to ``[0,
    M_total]`` and the TORCH backends clamp the offsets they give ``torch._grouped_mm`` the same
    way, so the groups that reach past ``a``'s end are cut at its last row and rows past it
    contribute nothing (to the output or either gradient). On CPU async asserts report such
    values instead.

    Backends: GLUON (the warp-specialized sm_90 kernels, bf16 / fp16: the default for every GEMM of
    the call they can run; under autograd the forward, grad_input and grad_weight are then launched
    directly, see ``_vendor_route``), TORCH (``torch._grouped_mm``, CUDA sm_90+ bf16: the default
    where Gluon cannot run and it can) and TRITON (everything else, and CPU through the Triton
    interpreter); see ``GlobalBackendManager.set_grouped_gemm_backend`` and
    ``PRIMUS_TURBO_GROUPED_GEMM_BACKEND``. Small vendor-routed problems under autograd return
    ``torch._grouped_mm``'s output with torch's own backward (see ``_native_vendor``). Under
    ``torch.autocast`` ``a`` and ``b`` are cast to its dtype first (core/amp.py).
    """
    if isinstance(a, torch.Tensor) and (amp := autocast_dtype(a)) is not None:
        return gemm_under_autocast(grouped_gemm, amp, a, b, group_lens, group_offs, trans_b, num_cu, schedule,
                                   fuse_bgrad_accum_pattern=fuse_bgrad_accum_pattern)
    fk = None
    if (num_cu is None and schedule == "static" and torch.is_grad_enabled()
            and (fuse_bgrad_accum_pattern is None or fuse_bgrad_accum_pattern == "megatron")):
        fk = _fast_key(a, b, group_lens, group_offs, trans_b, fuse_bgrad_accum_pattern is not None)
        step = _FAST_ROUTES.get(fk) if fk is not None else None
        if step is not None:
            if group_offs is None:  # derived as the checked path does (one keyed launch, no sync)
                group_offs = _offsets(group_lens)
            out = _GluonStepFunction.apply(a, b, group_offs, step)
            if step.fuse and b.requires_grad:
                _flag_main_grad(b)
            return out
    _check_inputs(a, b, group_lens, group_offs, trans_b, num_cu, fuse_bgrad_accum_pattern)
    if schedule != "static":
        _check_schedule(schedule, num_cu)
    group_offs = _group_offsets("grouped_gemm", group_lens, group_offs, a)
    fuse = fuse_bgrad_accum_pattern == "megatron"
    trans_b = bool(trans_b)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        vendor = _routed(a, b, trans_b, num_cu, group_offs)
        if _native_ok(a, b, trans_b, vendor, fuse):
            return _native_vendor(a, b, group_offs, trans_b)
        if (fk is not None and vendor == "gluon" and a.is_cuda  # the step launches C entries: CUDA only
                and (not fuse or not b.requires_grad or _gluon_accum_ok(a, b, trans_b, group_offs))):
            _remember(_FAST_ROUTES, fk, _GluonStep(a, b, trans_b, fuse))
        out = GroupedGemmFunction.apply(a, b, group_lens, group_offs, trans_b, num_cu, fuse, vendor)
        if fuse and b.requires_grad:
            _flag_main_grad(b)
        return out
    return _gmm(a, b, group_lens, group_offs, trans_b, num_cu)


# _fast_key(...) -> _GluonStep: calls under autograd that passed the checks and took the Gluon route
_FAST_ROUTES: dict = {}


class _GluonStep:
    """The Gluon route of one call signature (see :func:`_fast_key`): the three GEMMs' sizes and,
    per GEMM, the C launch records of the operand and output addresses seen (``grouped_gemm_gluon
    .fire``; at most a few per GEMM, as the caching allocator cycles through its blocks). The
    backward's operands follow from the signature: the output gradient is made contiguous,
    16-byte aligned and of ``a``'s dtype, ``[M, N]``, as :func:`grouped_gemm_backward` does.
    ``fuse``: Megatron's form (``fuse_bgrad_accum_pattern="megatron"``), whose grad_weight the
    variable-K kernel adds into ``b.main_grad`` (fp32; kept only where :func:`_gluon_accum_ok`)."""

    __slots__ = ("tb", "fuse", "M", "N", "K", "G", "dtype", "device", "index", "fwd", "dgrad", "wgrad", "m16",
                 "vk16")

    def __init__(self, a: torch.Tensor, b: torch.Tensor, trans_b: bool, fuse: bool = False):
        self.tb, self.fuse = trans_b, fuse
        self.M, self.K = a.shape
        self.G = b.size(0)
        self.N = b.size(1) if trans_b else b.size(2)
        self.dtype, self.device, self.index = a.dtype, a.device, a.device.index
        self.fwd, self.dgrad, self.wgrad = {}, {}, {}
        self.m16 = _gluon_module("grouped_gemm_gluon")
        self.vk16 = _gluon_module("grouped_gemm_variable_k_gluon")


class _GluonStepFunction(torch.autograd.Function):
    """:class:`GroupedGemmFunction` on the Gluon route for a signature seen before: the same three
    kernels with the same arguments, each launched from its kept C record when its operand and
    output addresses repeat (else through the launcher, which keeps the record). Host time per
    step is what a small expert GEMM's eager step costs."""

    @staticmethod
    def forward(ctx, a, b, group_offs, step):
        ctx.step = step
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(a if need_b else None, b if (need_a or (need_b and step.fuse)) else None, group_offs)
        out = torch.empty((step.M, step.N), dtype=step.dtype, device=step.device)
        key = (a.data_ptr(), b.data_ptr(), group_offs.data_ptr(), out.data_ptr())
        gg = step.m16
        if not gg.fire(step.fwd.get(key), step.index):
            gg.grouped_gemm_gluon(a, b.transpose(1, 2) if step.tb else b, group_offs, out=out, checked=True,
                                  keep=(step.fwd, key))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, group_offs = ctx.saved_tensors
        step = ctx.step
        g = grad_out if grad_out.dtype == step.dtype else grad_out.to(step.dtype)
        if not g.is_contiguous():
            g = g.contiguous()
        if g.data_ptr() % 16:  # TMA needs a 16-byte aligned base (a slice's gradient may not have one)
            g = g.clone()
        gg = step.m16
        index = step.index
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.empty((step.M, step.K), dtype=step.dtype, device=step.device)
            key = (g.data_ptr(), b.data_ptr(), group_offs.data_ptr(), grad_a.data_ptr())
            if not gg.fire(step.dgrad.get(key), index):
                gg.grouped_gemm_gluon(g, b if step.tb else b.transpose(1, 2), group_offs, out=grad_a, checked=True,
                                      keep=(step.dgrad, key))
        if ctx.needs_input_grad[1]:
            x, y = (g, a) if step.tb else (a, g)
            if step.fuse:  # main_grad += the grad_weight, in the kernel epilogue
                mg = b.main_grad
                # its address and layout: the kept record holds the address, the plan the layout
                key = (x.data_ptr(), y.data_ptr(), group_offs.data_ptr(), mg.data_ptr(), mg.shape, mg.stride(),
                       mg.dtype)
                if not gg.fire(step.wgrad.get(key), index):
                    step.vk16.grouped_gemm_variable_k_gluon(x, y, group_offs, out=mg, accumulate=True,
                                                            keep=(step.wgrad, key))
                return grad_a, _megatron_dummy_wgrad(b), None, None
            grad_b = torch.empty((step.G, x.size(1), y.size(1)), dtype=step.dtype, device=step.device)
            key = (x.data_ptr(), y.data_ptr(), group_offs.data_ptr(), grad_b.data_ptr())
            if not gg.fire(step.wgrad.get(key), index):
                step.vk16.grouped_gemm_variable_k_gluon(x, y, group_offs, out=grad_b, keep=(step.wgrad, key))
        return grad_a, grad_b, None, None


def _gluon_accum_ok(a: torch.Tensor, b: torch.Tensor, trans_b: bool, group_offs: torch.Tensor) -> bool:
    """Whether the checked path's fused accumulation (``_vk_accum`` into ``b.main_grad``) of a call
    on the Gluon route runs the 16-bit variable-K kernel, as :class:`_GluonStepFunction` does: the
    default's :func:`gluon_wgrad`, a TRITON pin's backend and a GLUON pin's all give it the problem
    exactly when the kernel takes these operands (a bf16 ``main_grad`` takes the vendor GEMM and an
    ``add_``: such calls stay on the checked path). Shapes only; one probe allocation per signature."""
    mg = getattr(b, "main_grad", None)
    if not isinstance(mg, torch.Tensor) or mg.dtype != torch.float32:
        return False
    n = b.size(1) if trans_b else b.size(2)
    g = torch.empty((a.size(0), n), dtype=a.dtype, device=a.device)  # the backward's output gradient
    x, y = (g, a) if trans_b else (a, g)
    return _gluon_module("grouped_gemm_variable_k_gluon").gluon_variable_k_reason(
        x, y, group_offs, out=mg, accumulate=True) is None


def _fast_key(a, b, group_lens, group_offs, trans_b, fuse: bool = False):
    """The facts that :func:`_check_inputs` and :func:`_routed` read of a call with no ``num_cu``, no
    fused accumulation or Megatron's (``fuse``), and the static schedule under grad mode (offsets given, or None: derived on
    the device, a fresh contiguous ``[G+1]`` int64 tensor either way): the backend settings
    (dispatcher plan, version, the Gluon, pacing and interpreter switches), the four arguments'
    types, shapes, strides, dtypes, devices and 16-byte alignment, ``trans_b`` and which operands
    need grads, and with ``fuse`` (Megatron's form) ``b.main_grad``'s facts (the checks read them).
    A call whose key was seen taking the Gluon route goes straight to
    :class:`_GluonStepFunction` (the checks, the route and the generic launch path cost ~70 us of
    host per forward+backward on the H100 machine's host, 2026-12-05, against a ~40 us GPU step for
    a small expert GEMM). None when compiling, for non-tensor arguments (the checks then raise),
    tensors without strides, a ``trans_b`` other than a bool or int, and with ``fuse`` a weight
    without ``main_grad``."""
    if torch.compiler.is_compiling() or type(trans_b) not in (bool, int):
        return None
    try:
        backend, _source, tune = grouped_gemm_dispatcher.plan(_BF16)
        mg = None
        if fuse:
            mg = b.main_grad  # (an AttributeError without one: the checked path raises or ignores it)
            mg = (type(mg), _tensor_key(mg))
        return (backend, tune, GlobalBackendManager._version, env_raw(_GLUON_ENV), env_raw(_PACE_ENV),
                env_raw("TRITON_INTERPRET"), bool(trans_b), type(a), type(b),
                type(group_lens), type(group_offs), _tensor_key(a), _tensor_key(b), _tensor_key(group_lens),
                _tensor_key(group_offs), a.requires_grad, b.requires_grad, fuse, mg)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, or tensors without strides
        return None
