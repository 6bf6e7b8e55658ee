"""Shape selection shared by tests: small shapes on CPU (Triton interpreter), real ones on GPU.

Every test that has both a quick CPU variant and a realistic GPU variant picks its shapes
through :func:`pick_shapes`, so the rule lives in one place.
"""

from __future__ import annotations

from typing import Sequence, TypeVar, Union

import torch

__all__ = ["is_gpu", "pick_shapes"]

T = TypeVar("T")

DeviceLike = Union[str, torch.device, torch.Tensor, None]


def is_gpu(device: DeviceLike = None) -> bool:
    """Whether ``device`` is a CUDA device.

    ``device`` may be a string (``"cuda"``, ``"cuda:1"``, ``"cpu"``), a ``torch.device``, a
    tensor (its device is used) or ``None``, meaning the device tests run on: CUDA when
    available, else the CPU.
    """
    if device is None:
        return torch.cuda.is_available()
    if isinstance(device, torch.Tensor):
        device = device.device
    return torch.device(device).type == "cuda"


def pick_shapes(cpu_shapes: Sequence[T], gpu_shapes: Sequence[T], device: DeviceLike = None) -> list[T]:
    """``gpu_shapes`` when ``device`` is a CUDA device, else ``cpu_shapes`` (as a new list).

    With ``device=None`` (e.g. inside ``pytest.mark.parametrize`` at collection time) the choice
    follows ``torch.cuda.is_available()``.
    """
    return list(gpu_shapes) if is_gpu(device) else list(cpu_shapes)
