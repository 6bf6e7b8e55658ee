"""Launching compiled Triton and Gluon kernels without Triton's per-call binding.

``kernel[grid](*args)`` re-derives on every call what a steady training step never changes: it
binds the arguments to the signature, specializes each one in C++, hashes the result into the
kernel cache key, asks the driver for the current device and stream, reads the launch hooks and
goes through the launcher's Python ``__call__``. On the H200 machine the direct path below saves
14-90 us (median 31 us) of host time per launch (``scripts/diag_grouped_launch.py --ab-launch``,
2026-12-01): a large part of a small expert GEMM's host path (grouped FP8 on the Gluon kernel:
125-225 us per call before, against the vendor op's 25 us).

:func:`launch` keeps, per kernel and per *launch key*, the compiled kernel and its C launch entry,
and from the second launch on calls that entry directly. The launch key is conservative: it holds
everything Triton's specialization can depend on, and more (it never maps two differently
compiled kernels to one entry; a test checks it against Triton's own specialization routine):

* tensors: dtype and whether the data pointer is 16-byte aligned;
* integers: whether equal to 1, whether divisible by 16, and the integer width class;
* booleans and other scalars: the type (floats pass as fp32 whatever the value);
* host tensor descriptors: the base's dtype, block shape, shared layout and padding (their sizes
  and strides are encoded into the TMA descriptor at every launch, never compiled in);
* every keyword (constexprs and compile options) by value, and the device index.

Descriptor arguments still go through Triton's own expansion (one ``cuTensorMapEncodeTiled`` per
descriptor per launch), so their contents are always current. Anything unusual falls back to
Triton's path: launch hooks installed (profilers), kernels that need scratch memory or several
CTAs per program, an argument of a kind the key does not know, a current device other than the
tensors', or a CPU device (the interpreter).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Optional

from contextlib import nullcontext as _nullcontext

import torch

try:
    from triton import knobs
except ImportError:  # no triton: nothing here can launch; the modules that import this still load
    knobs = None

__all__ = ["launch", "launch_key", "launch_keyed", "launch_prepared", "direct_entry", "no_launch_hooks",
           "raw_stream", "set_direct_launch", "tensor_sig", "with_current_context"]

# PRIMUS_TURBO_DIRECT_LAUNCH=0 keeps every launch on Triton's own path (read at import)
_DIRECT = [os.environ.get("PRIMUS_TURBO_DIRECT_LAUNCH", "1").strip() != "0"]


def set_direct_launch(enabled: bool) -> bool:
    """Turns the direct path of :func:`launch` on or off for the process; returns the previous
    setting (A/B timing, or a way around a suspected launcher problem)."""
    prev = _DIRECT[0]
    _DIRECT[0] = bool(enabled)
    return prev

# (id(jit_fn), device index, launch key) -> (direct entry or None, names and defaults of the
# parameters after the positional ones, in signature order)
_ENTRIES: dict = {}
_MAX_ENTRIES = 4096  # shape churn (tests, autotuning sweeps): start over rather than grow

_I32, _I64 = 2**31, 2**63


class _Sig:
    """What the launch needs of a kernel's signature: the positions of its constexpr parameters,
    and per parameter its name, whether it is a constexpr and its default (``_NO`` when none)."""

    __slots__ = ("constexpr_pos", "names", "is_constexpr", "defaults")

    def __init__(self, jit_fn):
        params = getattr(jit_fn, "params", None)
        if params is not None:
            self.names = [p.name for p in params]
            self.is_constexpr = {p.name: bool(p.is_constexpr) for p in params}
            self.defaults = [p.default if p.has_default else _NO for p in params]
        else:  # the interpreter's function object: read the annotations (``tl.constexpr`` or its string)
            sig = list(inspect.signature(getattr(jit_fn, "fn", jit_fn)).parameters.values())
            self.names = [p.name for p in sig]
            self.is_constexpr = {p.name: "constexpr" in str(p.annotation) for p in sig}
            self.defaults = [_NO if p.default is inspect.Parameter.empty else p.default for p in sig]
        self.constexpr_pos = tuple(i for i, n in enumerate(self.names) if self.is_constexpr[n])


_NO = object()
_SIGS: dict = {}  # id(jit_fn) -> _Sig


def _sig(jit_fn) -> _Sig:
    sig = _SIGS.get(id(jit_fn))
    if sig is None:
        sig = _SIGS[id(jit_fn)] = _Sig(jit_fn)
    return sig


def _add_key(parts: list, v: Any) -> None:
    """Appends the specialization-relevant facts of one argument; TypeError for unknown kinds."""
    t = type(v)
    if t is int:
        parts.append((v == 1, v % 16 == 0, -_I32 <= v < _I32, -_I64 <= v < _I64))
    elif isinstance(v, torch.Tensor):
        parts.append(v.dtype)
        parts.append(v.data_ptr() % 16 == 0)
    elif t is bool or t is float or v is None:
        parts.append(t)
    elif isinstance(getattr(v, "base", None), torch.Tensor) and hasattr(v, "block_shape"):
        # a host tensor descriptor: Triton specializes it on dtype, block shape and shared layout
        parts.append((t, v.base.dtype, tuple(v.block_shape), getattr(v, "layout", None),
                      getattr(v, "padding", None)))
    elif isinstance(v, int):  # an int subclass (not bool: caught above)
        _add_key(parts, int(v))
    else:
        raise TypeError(f"no launch key for an argument of type {t.__name__}")


def launch_key(jit_fn, args: tuple, kwargs: dict) -> Optional[tuple]:
    """The conservative specialization key of a launch of ``jit_fn`` (see the module docstring):
    constexprs enter by value, other arguments (positional or keyword) by their specialization
    facts. None when an argument is of a kind it does not cover."""
    sig = _sig(jit_fn)
    parts: list = []
    app = parts.append
    try:
        for v in args:  # the common kinds inline (this runs per launch), the rest in _add_key
            t = type(v)
            if t is int:
                app((v == 1, v % 16 == 0, -_I32 <= v < _I32, -_I64 <= v < _I64))
            elif t is torch.Tensor:
                app(v.dtype)
                app(v.data_ptr() % 16 == 0)
            else:
                _add_key(parts, v)
        for i in sig.constexpr_pos:
            if i < len(args):
                parts.append(args[i])
        for name, v in kwargs.items():
            parts.append(name)
            if sig.is_constexpr.get(name, True):  # constexprs and compile options, by value
                parts.append(v)
            else:
                _add_key(parts, v)
        return tuple(parts)
    except TypeError:
        return None


def no_launch_hooks() -> bool:
    """No launch hook is installed (Triton keeps them as chains that may be empty, or None)."""
    if knobs is None:
        return True
    rt = knobs.runtime
    return not getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook) and \
        not getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook)


def with_current_context(fn, device):
    """``fn()``, retried once after making ``device``'s primary context current on this thread when
    it fails for want of one. Encoding a TMA descriptor (``cuTensorMapEncodeTiled``, a driver call)
    needs a current context, and a thread that has made no CUDA runtime call needing one may have
    none: the autograd engine's device thread, when every allocation of a backward comes from the
    caching allocator's pool and every launch before went through a kept C launcher. The failure
    happens before anything is enqueued, so the retry launches once."""
    try:
        return fn()
    except RuntimeError as exc:
        if "invalid device context" not in str(exc) or not _bind_primary_context(device):
            raise
    return fn()


def _bind_primary_context(device) -> bool:
    """Makes ``device``'s primary context current on this thread when none is (the driver API,
    through ctypes: no sync, nothing enqueued); True when one was bound."""
    if getattr(device, "type", None) != "cuda":
        return False
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or ctx.value:
        return False  # a context is current: the failure is something else
    dev = ctypes.c_int()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if cuda.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return False
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        return False
    return cuda.cuCtxSetCurrent(ctx) == 0


def raw_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


def direct_entry(kernel):
    """A compiled kernel's launch function with every per-kernel argument bound, or None when the
    kernel needs what the direct path does not provide (global or profile scratch memory, several
    CTAs per program, another launcher layout). Descriptor arguments are expanded by the launch
    function itself (Triton's wrapper around the C entry)."""
    run = kernel.run  # loads the module and builds the launcher
    entry = getattr(run, "launch", None)
    if (entry is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or getattr(run, "num_ctas", 1) != 1):
        return None
    return (_cached_descriptors(entry), kernel.function, run.launch_cooperative_grid, run.launch_pdl,
            kernel.packed_metadata)


# (id of the expander, descriptor position, data pointer, shape, strides, padding) -> expanded args
_TMAPS: dict = {}
_MAX_TMAPS = 4096


def _cached_descriptors(entry):
    """``entry`` with its host tensor descriptors expanded through a cache, when ``entry`` is
    Triton's descriptor-expanding wrapper around the C launcher (``wrap_handle_tensordesc``: each
    descriptor becomes a ``cuTensorMapEncodeTiled`` result plus its shape and strides, every
    launch); else ``entry`` itself.

    The encoded map is a pure function of the kernel parameter's metadata (swizzle, element type,
    box: fixed per compiled kernel and position) and the descriptor's data pointer, shape, strides
    and padding, so a launch whose descriptor repeats those reuses the map (a steady training step
    launches on the same weights and, through the caching allocator, mostly the same activation
    addresses). The C launcher copies the map's bytes into the kernel parameters at every launch,
    so reuse never aliases. Anything unexpected in the wrapper keeps Triton's own expansion."""
    try:
        code = entry.__code__
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in entry.__closure__)))
        launcher, positions, metas = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
        expand = entry.__globals__["make_tensordesc_arg"]
        base = entry.__globals__["_BASE_ARGS_FORMAT_LEN"]
    except (AttributeError, KeyError, TypeError, ValueError):
        return entry
    if not callable(launcher) or not isinstance(positions, (set, frozenset)) or metas is None:
        return entry
    if len(metas) != len(positions) or any(m is None for m in metas):
        return entry  # descriptors decomposed in the frontend: nothing encoded to cache
    meta_at = {p: metas[i] for i, p in enumerate(sorted(positions))}
    tag = object()

    def finalize(args):
        final = list(args[:base])
        for i, arg in enumerate(args[base:]):
            meta = meta_at.get(i)
            if meta is None:
                final.append(arg)
                continue
            key = (tag, i, arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), arg.padding)
            parts = _TMAPS.get(key)
            if parts is None:
                parts = with_current_context(lambda: expand(arg, meta), arg.base.device)
                if len(_TMAPS) >= _MAX_TMAPS:
                    _TMAPS.clear()
                _TMAPS[key] = parts
            final.extend(parts)
        return final

    def expanded(*args):
        return launcher(*finalize(args))

    # for prepared launches (:func:`launch_prepared`): the C launcher and the expansion itself
    expanded.launcher, expanded.finalize, expanded.base = launcher, finalize, base
    return expanded


def _tail(names, defaults, kwargs: dict) -> list:
    """The values of the parameters after the positional ones: keyword or default."""
    return [kwargs[n] if n in kwargs else d for n, d in zip(names, defaults)]


#: the C launcher's leading arguments before the kernel's own (grid, stream, function, launch flags,
#: metadata, hooks: Triton's ``_BASE_ARGS_FORMAT``), as :func:`_call_entry` passes them
_HEAD_ARGS = 13


def _call_entry(entry, grid: tuple, index: int, args, tail) -> None:
    """A :func:`direct_entry` called on the device's current stream."""
    fn, function, coop, pdl, packed = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    fn(grid[0], g1, g2, raw_stream(index), function, coop, pdl, None, None, packed, None, None, None, *args, *tail)


def launch(jit_fn, grid: tuple, args: tuple, kwargs: dict, device: torch.device) -> None:
    """``jit_fn[grid](*args, **kwargs)`` on ``device``, through the compiled kernel's C entry from the
    second launch with the same launch key on. ``grid``: a tuple of 1-3 ints (a callable grid takes
    Triton's path); ``args`` the leading parameters, positionally; ``kwargs`` the others (by name,
    any that has no default) and compile options (``num_warps``)."""
    if device.type != "cuda" or not _DIRECT[0] or callable(grid):
        with torch.cuda.device(device) if device.type == "cuda" else _nullcontext():
            jit_fn[grid](*args, **kwargs)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = launch_key(jit_fn, args, kwargs)
    ekey = (id(jit_fn), index, key)
    if key is not None and no_launch_hooks() and torch.cuda.current_device() == index:
        try:
            cached = _ENTRIES.get(ekey)
        except TypeError:  # a constexpr or option value that does not hash: Triton's path
            cached = key = None
        if cached is not None and cached[0] is not None:
            entry, names, defaults = cached
            _call_entry(entry, grid, index, args, _tail(names, defaults, kwargs))
            return
    with torch.cuda.device(index):
        kernel = with_current_context(lambda: jit_fn[grid](*args, **kwargs), device)
    if hasattr(kernel, "result"):  # an asynchronous compilation's future
        kernel = kernel.result()
    if key is not None and kernel is not None:
        sig = _sig(jit_fn)
        names, defaults = sig.names[len(args):], sig.defaults[len(args):]
        # every later parameter needs a keyword or a default (the kwargs' names are in the key)
        ok = all(n in kwargs or d is not _NO for n, d in zip(names, defaults))
        entry = direct_entry(kernel) if ok else None
        if len(_ENTRIES) >= _MAX_ENTRIES:
            _ENTRIES.clear()
        try:  # the jit_fn object stays alive as a module global, so its id is not reused
            _ENTRIES[ekey] = (entry, names, defaults)
        except TypeError:
            pass


# (id(jit_fn), device index, caller's key) -> (direct entry, the parameters after the positional ones)
_KEYED: dict = {}


# (id(jit_fn), device index, caller's key, caller's pointers) -> (the entry with the C launcher itself
# in place of the descriptor-expanding wrapper, the kernel arguments as the C launcher takes them)
_PREPARED: dict = {}


def launch_prepared(jit_fn, grid: tuple, args_fn, kwargs: dict, device: torch.device, key, ptrs) -> None:
    """:func:`launch_keyed` for launches whose every per-call value is a data pointer: ``ptrs`` (a
    tuple of ints) are the data pointers of every tensor and tensor-descriptor base among the
    arguments, which ``args_fn()`` builds (called on a miss only). With ``key`` fixing everything
    else (shapes, strides, dtypes, constexprs: the caller's signature), the C launcher's argument
    list (descriptors encoded to TMA maps, tensors as their pointers) is a function of
    ``(key, ptrs)`` and is kept: a repeat call costs a dict lookup, the stream query and the C
    call, without building descriptors, re-keying their maps or the launcher's per-pointer driver
    queries (~15 us of a ~40 us launch on the H200 machine's host). Steady training steps repeat
    their pointers (the caching allocator hands the same blocks back); a new pointer is one miss.
    The kept lists hold ints and encoded maps only, never a tensor (nothing is kept alive)."""
    if device.type == "cuda" and _DIRECT[0] and not callable(grid):
        index = device.index if device.index is not None else torch.cuda.current_device()
        pkey = (id(jit_fn), index, key, ptrs)
        rec = _PREPARED.get(pkey)
        if rec is not None and no_launch_hooks() and torch._C._cuda_getDevice() == index:
            _call_entry(rec[0], grid, index, rec[1], ())
            return
        args = args_fn()
        launch_keyed(jit_fn, grid, args, kwargs, device, key)
        hit = _KEYED.get((id(jit_fn), index, key))
        fn = hit[0][0] if hit is not None else None
        if fn is None or not _pointers_of(args) <= set(ptrs):
            return
        entry, tail = hit
        if getattr(fn, "finalize", None) is not None and fn.base == _HEAD_ARGS:  # descriptors: encoded once
            launcher = fn.launcher
            final = fn.finalize((None,) * _HEAD_ARGS + tuple(args) + tuple(tail))[_HEAD_ARGS:]
        elif not any(getattr(v, "base", None) is not None for v in args):  # the C launcher itself
            launcher, final = fn, list(args) + list(tail)
        else:  # descriptors the launcher expands itself: nothing to keep without keeping tensors
            return
        final = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in final]
        if len(_PREPARED) >= _MAX_ENTRIES:
            _PREPARED.clear()
        _PREPARED[pkey] = ((launcher,) + tuple(entry[1:]), final)
        return
    launch_keyed(jit_fn, grid, args_fn(), kwargs, device, key)


def tensor_sig(t: torch.Tensor) -> tuple:
    """What a keyed or prepared launch depends on of a tensor argument besides its data pointer:
    shape, strides, dtype, device and 16-byte alignment (Triton specializes on the alignment)."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _pointers_of(args) -> set:
    """The data pointers of the tensors and tensor-descriptor bases among ``args`` (what
    :func:`launch_prepared` checks its caller's ``ptrs`` against before keeping a list)."""
    out = set()
    for v in args:
        t = v if isinstance(v, torch.Tensor) else getattr(v, "base", None)
        if isinstance(t, torch.Tensor):
            out.add(t.data_ptr())
    return out


def launch_keyed(jit_fn, grid: tuple, args: tuple, kwargs: dict, device: torch.device, key) -> None:
    """:func:`launch` for the small fixed-signature kernels a hot path launches every call (the
    grouped GEMM's tail zeroing and offsets): the caller's hashable ``key`` replaces
    :func:`launch_key`, so a hit costs a dict lookup, the stream query and the C entry (~2 us of
    Python instead of ~15-25 on the H200 machine's host).

    The caller guarantees that ``key`` determines every fact Triton specializes this launch on
    and every value in ``kwargs``: in practice kernels whose non-constexpr parameters are all
    ``do_not_specialize`` / ``do_not_specialize_on_alignment``, keyed by their tensors' dtypes,
    their integers' width class and their constexprs. A miss goes through :func:`launch` (compiling
    on first use) and then records the entry :func:`launch` made for the same launch."""
    if device.type == "cuda" and _DIRECT[0] and not callable(grid):
        index = device.index if device.index is not None else torch.cuda.current_device()
        hit = _KEYED.get((id(jit_fn), index, key))
        if hit is not None and no_launch_hooks() and torch._C._cuda_getDevice() == index:
            _call_entry(hit[0], grid, index, args, hit[1])
            return
        launch(jit_fn, grid, args, kwargs, device)
        full = launch_key(jit_fn, args, kwargs)
        cached = _ENTRIES.get((id(jit_fn), index, full)) if full is not None else None
        if cached is not None and cached[0] is not None:
            entry, names, defaults = cached
            if len(_KEYED) >= _MAX_ENTRIES:
                _KEYED.clear()
            _KEYED[(id(jit_fn), index, key)] = (entry, _tail(names, defaults, kwargs))
        return
    launch(jit_fn, grid, args, kwargs, device)
