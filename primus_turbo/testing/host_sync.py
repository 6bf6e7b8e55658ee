"""A guard against device -> host synchronisation in training hot paths, usable on CPU too.

On CUDA a sync is a call that makes the host wait for the device: ``.item()``, ``.tolist()``,
``bool(t)`` / ``int(t)`` / ``if t:``, ``nonzero`` and ops whose output shape depends on the data
(``masked_select``, ``unique``, boolean-mask indexing). ``torch.cuda.set_sync_debug_mode`` flags
most of them, but only on a GPU. :func:`forbid_host_sync` intercepts the ATen ops behind them with a
``TorchDispatchMode``, so the same check runs on CPU (CI runs the Triton kernels there through the
interpreter): a CPU test that passes under it proves that the Python path issues none of these ops,
whatever the device. On CUDA it also turns on ``set_sync_debug_mode("error")``, which catches
synchronising copies to the host as well.

Host reads that do not dispatch an ATen op on CPU tensors (``.tolist()``, ``.cpu()``, ``.numpy()``,
each a copy to the host and so a sync on CUDA) are caught when the library's own code calls them:
the guard wraps those methods and checks the caller's file (the Triton interpreter, which reads
CPU tensors this way to run a kernel, and the tests are not the library).

Ops a CPU-only branch may legitimately issue (``torch._assert_async`` checks, which are not syncs
on CPU) are not flagged; ops called from inside another op's kernel are not seen (the mode is
suspended while it handles an op), so only what the library's Python code calls is checked.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "SYNC_OPS", "forbid_host_sync"]


class HostSyncError(RuntimeError):
    """An op that would synchronise the host with the device ran under :func:`forbid_host_sync`."""


def _ops(*names: str) -> frozenset:
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(torch.ops.aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            found.append(getattr(op, overload or "default"))
    return frozenset(found)


#: the ATen ops whose result the host needs before it can go on (a scalar read back, or an output
#: shape that depends on the data)
SYNC_OPS = _ops(
    "_local_scalar_dense",              # .item(), .tolist(), bool(t), int(t), float(t)
    "nonzero", "nonzero_static", "argwhere", "masked_select",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "index.Tensor",                     # flagged only with a bool / uint8 mask index (below)
    "repeat_interleave.Tensor",         # a tensor of repeats without output_size
    "bincount", "histc",
)


def _mask_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Guard(TorchDispatchMode):
    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            flagged = True
            if func is torch.ops.aten.index.Tensor:
                flagged = _mask_index(args)
            elif func is torch.ops.aten.repeat_interleave.Tensor:
                flagged = kwargs.get("output_size") is None
            if flagged:
                where = "".join(traceback.format_stack(limit=8)[:-1])
                raise HostSyncError(f"{self.what}: {func} would synchronise the host with the device\n{where}")
        return func(*args, **kwargs)


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # .../primus_turbo
_EXEMPT = (os.path.join(_PKG, "testing") + os.sep, os.path.join(_PKG, "triton", "interpreter.py"))
_HOST_READS = ("tolist", "cpu", "numpy")


def _library_caller() -> bool:
    """Is the caller of the wrapped method (two frames up) the library's own code?"""
    f = sys._getframe(2).f_code.co_filename
    return f.startswith(_PKG + os.sep) and not f.startswith(_EXEMPT)


def _wrap_host_read(name: str, what: str):
    orig = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        if _library_caller():
            where = "".join(traceback.format_stack(limit=8)[:-1])
            raise HostSyncError(f"{what}: Tensor.{name}() copies to the host (a sync on CUDA)\n{where}")
        return orig(self, *args, **kwargs)

    return orig, read


@contextlib.contextmanager
def forbid_host_sync(what: str = "host sync guard") -> Iterator[None]:
    """Raise :class:`HostSyncError` (naming ``what`` and the op, with the Python stack) when code
    in the block issues an op of :data:`SYNC_OPS`, or the library's code reads a tensor to the host
    (``tolist`` / ``cpu`` / ``numpy``); on CUDA also ``set_sync_debug_mode("error")``. Not
    thread-safe (it patches ``torch.Tensor`` methods for the block's duration)."""
    cuda = torch.cuda.is_available()
    prev = torch.cuda.get_sync_debug_mode() if cuda else None
    saved = {}
    for name in _HOST_READS:
        saved[name], wrapped = _wrap_host_read(name, what)
        setattr(torch.Tensor, name, wrapped)
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with _Guard(what):
            yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(prev)
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)
