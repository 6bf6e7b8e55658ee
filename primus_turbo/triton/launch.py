"""Launching compiled Triton and Gluon kernels without Triton's per-call binding.

``kernel[grid](*args)`` re-derives on every call what a steady training step never changes: it
binds the arguments to the signature, specializes each one in C++, hashes the result into the
kernel cache key, asks the driver for the current device and stream, reads the launch hooks and
goes through the launcher's Python ``__call__``. Measured on the H200 machine that is 25-35 us of
host time per launch, the largest single part of a small expert GEMM's host path (grouped FP8 on
the Gluon kernel: 125-225 us per call against the vendor op's 25 us).

:func:`launch` keeps, per kernel and per *launch key*, the compiled kernel and its C launch entry,
and from the second launch on calls that entry directly. The launch key is conservative: it holds
everything Triton's specialization can depend on, and more (it never maps two differently
compiled kernels to one entry):

* tensors: dtype and whether the data pointer is 16-byte aligned;
* integers: whether equal to 1, whether divisible by 16, and the integer width class;
* booleans and other scalars: the type (floats pass as fp32 whatever the value);
* host tensor descriptors: the base's dtype and alignment, block shape, shared layout, padding,
  and which shape / stride entries are divisible by 16;
* every keyword (constexprs and compile options) by value, and the device index.

Descriptor arguments still go through Triton's own expansion (one ``cuTensorMapEncodeTiled`` per
descriptor per launch), so their contents are always current. Anything unusual falls back to
Triton's path: launch hooks installed (profilers), kernels that need scratch memory or several
CTAs per program, an argument of a kind the key does not know, a current device other than the
tensors', or a CPU device (the interpreter).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

try:
    from triton import knobs
except ImportError:  # no triton: nothing here can launch; the modules that import this still load
    knobs = None

__all__ = ["launch", "launch_key", "direct_entry", "no_launch_hooks", "raw_stream"]

# (id(jit_fn), device index, launch key) -> (direct entry or None, the parameters after the
# positional ones, in signature order: constexprs and defaults, fixed by the key)
_ENTRIES: dict = {}
_MAX_ENTRIES = 4096  # shape churn (tests, autotuning sweeps): start over rather than grow


def _int_class(v: int) -> int:
    return 0 if -(2**31) <= v < 2**31 else (1 if -(2**63) <= v < 2**63 else 2)


def _arg_key(v: Any):
    """The specialization-relevant facts of one argument, or raises TypeError for unknown kinds."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return ("b",)
    if isinstance(v, int):
        return ("i", v == 1, v % 16 == 0, _int_class(v))
    if isinstance(v, float):
        return ("f",)
    if v is None:
        return ("n",)
    base = getattr(v, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(v, "block_shape"):  # a host tensor descriptor
        return ("d", type(v), base.dtype, base.data_ptr() % 16 == 0, tuple(v.block_shape),
                getattr(v, "layout", None), getattr(v, "padding", None),
                tuple(s % 16 == 0 for s in v.shape), tuple(s % 16 == 0 for s in v.strides))
    raise TypeError(f"no launch key for an argument of type {type(v).__name__}")


_CONSTEXPR_POS: dict = {}  # id(jit_fn) -> positions of its constexpr parameters


def _constexpr_positions(jit_fn) -> tuple:
    params = getattr(jit_fn, "params", None)
    if params is not None:
        return tuple(p.num for p in params if p.is_constexpr)
    # the interpreter's function object: read the annotations (``tl.constexpr`` or its string)
    sig = inspect.signature(getattr(jit_fn, "fn", jit_fn))
    return tuple(i for i, p in enumerate(sig.parameters.values()) if "constexpr" in str(p.annotation))


def launch_key(jit_fn, args: tuple, kwargs: dict) -> Optional[tuple]:
    """The conservative specialization key of a launch of ``jit_fn`` (see the module docstring):
    constexprs passed positionally enter by value. None when an argument is of a kind it does not
    cover."""
    pos = _CONSTEXPR_POS.get(id(jit_fn))
    if pos is None:
        pos = _CONSTEXPR_POS[id(jit_fn)] = _constexpr_positions(jit_fn)
    try:
        return (tuple(_arg_key(v) for v in args), tuple(args[i] for i in pos if i < len(args)),
                tuple(kwargs.items()))
    except TypeError:
        return None


def no_launch_hooks() -> bool:
    """No launch hook is installed (Triton keeps them as chains that may be empty, or None)."""
    if knobs is None:
        return True
    rt = knobs.runtime
    return not getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook) and \
        not getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook)


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
    return (entry, kernel.function, run.launch_cooperative_grid, run.launch_pdl, kernel.packed_metadata)


def _tail(jit_fn, n_pos: int, kwargs: dict) -> Optional[tuple]:
    """The values of the parameters after the ``n_pos`` positional ones, in signature order (the
    keyword or the parameter's default), or None when one has neither."""
    tail = []
    for p in jit_fn.params[n_pos:]:
        name = p.name
        if name in kwargs:
            tail.append(kwargs[name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


def launch(jit_fn, grid: tuple, args: tuple, kwargs: dict, device: torch.device) -> None:
    """``jit_fn[grid](*args, **kwargs)`` on ``device``, through the compiled kernel's C entry from the
    second launch with the same launch key on. ``args`` are the leading parameters, positionally;
    ``kwargs`` every other parameter that has no default, plus compile options (``num_warps``, ...)."""
    if device.type != "cuda":
        jit_fn[grid](*args, **kwargs)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = launch_key(jit_fn, args, kwargs)
    if key is not None and no_launch_hooks() and torch.cuda.current_device() == index:
        cached = _ENTRIES.get((id(jit_fn), index, key))
        if cached is not None:
            entry, tail = cached
            if entry is not None:
                fn, function, coop, pdl, packed = entry
                g = tuple(grid) + (1, 1)
                fn(g[0], g[1], g[2], raw_stream(index), function, coop, pdl, None, None, packed, None, None, None,
                   *args, *tail)
                return
    with torch.cuda.device(index):
        kernel = jit_fn[grid](*args, **kwargs)
    if hasattr(kernel, "result"):  # an asynchronous compilation's future
        kernel = kernel.result()
    if key is not None and kernel is not None and (id(jit_fn), index, key) not in _ENTRIES:
        tail = _tail(jit_fn, len(args), kwargs)
        entry = direct_entry(kernel) if tail is not None else None
        if len(_ENTRIES) >= _MAX_ENTRIES:
            _ENTRIES.clear()
        # the jit_fn object stays alive as a module global, so its id is not reused
        _ENTRIES[(id(jit_fn), index, key)] = (entry, tail)
