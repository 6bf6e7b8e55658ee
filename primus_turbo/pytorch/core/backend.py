"""Backend selection: one priority rule, in one place, for every op family.

An op family (``gemm``, ``grouped_gemm``, ``attn``, ...) owns an :class:`AutoKernelDispatcher`
holding the :class:`KernelBackend` implementations that exist for it. For each call the
dispatcher picks one, in this order:

1. a pin set in code: ``GlobalBackendManager.set_gemm_backend(BackendType.TRITON)``
   (per precision, or for all precisions);
2. a pin from the environment: ``PRIMUS_TURBO_GEMM_BACKEND=TRITON`` or
   ``PRIMUS_TURBO_GEMM_BACKEND=FP8:TRITON,BF16:TORCH`` (``autotune`` allowed as a value);
3. autotune, when asked for by 1./2. or globally (``PRIMUS_TURBO_AUTO_TUNE=1`` /
   ``GlobalBackendManager.set_auto_tune(True)``): every eligible backend is timed once per shape
   key and the fastest is cached (LRU). Never during CUDA-graph capture; accumulating ops are
   tuned on scratch buffers so the caller's data is never touched;
4. the op's default, when it can handle the inputs;
5. the first backend that can handle the inputs, with a one-time warning.

A pinned backend that cannot handle the inputs raises ``ValueError`` saying why: a pin is never
silently ignored.
"""

from __future__ import annotations

import enum
import functools
import math
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import torch

from .env import env_flag, env_raw, env_str
from .logging import get_logger, warn_once

__all__ = [
    "BackendType",
    "PrecisionType",
    "KernelBackend",
    "TuneCache",
    "AutoKernelDispatcher",
    "GlobalBackendManager",
    "parse_backend_env",
    "cuda_capability",
]


class BackendType(enum.Enum):
    """Kinds of implementation. Extensible: add a member, then register a KernelBackend for it."""

    TORCH = "TORCH"  # vendor libraries through PyTorch: cuBLAS(Lt), cuDNN, torch._grouped_mm
    TRITON = "TRITON"  # portable triton.language kernels
    GLUON = "GLUON"  # Hopper-only triton.experimental.gluon kernels

    @classmethod
    def parse(cls, value: Union["BackendType", str]) -> "BackendType":
        if isinstance(value, BackendType):
            return value
        if not isinstance(value, str):
            raise TypeError(f"backend must be a BackendType or str, got {type(value).__name__}")
        name = value.strip().upper()
        # Names used with AMD's Primus-Turbo for the vendor BLAS map to the vendor path here, so
        # scripts written for it keep working.
        name = _BACKEND_ALIASES.get(name, name)
        try:
            return cls[name]
        except KeyError:
            valid = ", ".join(m.name for m in cls)
            raise ValueError(f"unknown backend {value!r}; valid backends: {valid}") from None


_BACKEND_ALIASES = {"CUBLAS": "TORCH", "CUBLASLT": "TORCH", "HIPBLASLT": "TORCH", "PYTORCH": "TORCH"}


class PrecisionType(enum.Enum):
    BF16_FP16_FP32 = "BF16_FP16_FP32"
    FP8 = "FP8"
    FP4 = "FP4"

    @classmethod
    def parse(cls, value: Union["PrecisionType", str]) -> "PrecisionType":
        if isinstance(value, PrecisionType):
            return value
        name = str(value).strip().upper()
        if name in ("BF16", "FP16", "FP32", "BF16_FP16_FP32", "HP"):
            return cls.BF16_FP16_FP32
        try:
            return cls[name]
        except KeyError:
            raise ValueError(
                f"unknown precision {value!r}; valid: BF16 (or FP16, FP32, BF16_FP16_FP32), FP8, FP4"
            ) from None

    @classmethod
    def of_dtype(cls, dtype: torch.dtype) -> "PrecisionType":
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            return cls.FP8
        if getattr(torch, "float4_e2m1fn_x2", None) is not None and dtype == torch.float4_e2m1fn_x2:
            return cls.FP4
        return cls.BF16_FP16_FP32


class KernelBackend:
    """One implementation of one op. Subclasses set ``backend_type`` and implement
    ``check`` (return None when the inputs are supported, else a reason) and ``execute``."""

    backend_type: ClassVar[BackendType]
    #: whether autotune may time this backend (off for ones that are slow to compile per shape)
    autotune: ClassVar[bool] = True

    @classmethod
    def check(cls, **kwargs: Any) -> Optional[str]:
        raise NotImplementedError

    @classmethod
    def why_not(cls, **kwargs: Any) -> Optional[str]:
        """None if the backend can run these inputs, else the reason. Never raises."""
        try:
            return cls.check(**kwargs)
        except Exception as exc:  # a gate must never take the call down
            return f"can_handle check failed: {exc!r}"

    @classmethod
    def can_handle(cls, **kwargs: Any) -> bool:
        return cls.why_not(**kwargs) is None

    @classmethod
    def execute(cls, **kwargs: Any) -> Any:
        raise NotImplementedError


@functools.lru_cache(maxsize=None)
def _capability_of_index(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of a CUDA device, cached per device index (backend
    checks run on every call; the uncached query is several microseconds of Python)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability_of_index(index)


class TuneCache:
    """LRU map from a shape key to the winning backend."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._data: "OrderedDict[Any, BackendType]" = OrderedDict()

    def get(self, key: Any) -> Optional[BackendType]:
        if key in self._data:
            self._data.move_to_end(key)
            return self._data[key]
        return None

    def put(self, key: Any, value: BackendType) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)
            warn_once(
                f"tune-cache-full-{id(self)}",
                f"autotune cache exceeded {self.capacity} shapes; oldest entries are evicted and re-tuned",
            )

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Any) -> bool:
        return key in self._data


Choice = tuple[Optional[BackendType], bool]  # (pinned backend or None, autotune requested)


def parse_backend_env(value: str, var: str = "PRIMUS_TURBO_*_BACKEND") -> dict[Optional[PrecisionType], Choice]:
    """Parse (a copy of the cached parse: callers may mutate it)."""
    return dict(_parse_backend_env(value, var))


@functools.lru_cache(maxsize=64)
def _parse_backend_env(value: str, var: str) -> dict[Optional[PrecisionType], Choice]:
    """Parse ``TRITON`` / ``autotune`` / ``FP8:TRITON,BF16:TORCH,other:autotune``.

    Returns {precision or None (= every other precision): (backend or None, autotune)}.
    """
    out: dict[Optional[PrecisionType], Choice] = {}
    value = value.strip()
    if not value:
        return out
    for part in value.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"{var}={value!r}: empty entry")
        if ":" in part:
            prec_s, be_s = (s.strip() for s in part.split(":", 1))
            if prec_s.lower() in ("other", "default", "*", "all"):
                prec: Optional[PrecisionType] = None
            else:
                try:
                    prec = PrecisionType.parse(prec_s)
                except ValueError as exc:
                    raise ValueError(f"{var}={value!r}: {exc}") from None
        else:
            prec, be_s = None, part
        if prec in out:
            raise ValueError(f"{var}={value!r}: precision {prec_s if ':' in part else 'other'!r} given twice")
        if be_s.lower() == "autotune":
            out[prec] = (None, True)
        else:
            try:
                out[prec] = (BackendType.parse(be_s), False)
            except ValueError as exc:
                raise ValueError(f"{var}={value!r}: {exc}") from None
    return out


def _lookup(choices: dict[Optional[PrecisionType], Choice], precision: Optional[PrecisionType]) -> Optional[Choice]:
    if precision in choices:
        return choices[precision]
    return choices.get(None)


class GlobalBackendManager:
    """Process-wide backend pins and the autotune switch. All state is class-level."""

    _FAMILIES = ("gemm", "grouped_gemm", "attn", "moe_dispatch_combine")
    _ENV = {
        "gemm": "PRIMUS_TURBO_GEMM_BACKEND",
        "grouped_gemm": "PRIMUS_TURBO_GROUPED_GEMM_BACKEND",
        "attn": "PRIMUS_TURBO_ATTN_BACKEND",
    }
    _pins: dict[str, dict[Optional[PrecisionType], Choice]] = {}
    _auto_tune: Optional[bool] = None
    #: bumped on every change made in code, so dispatchers know when their cached plans are stale
    _version: int = 0
    # weak: a dispatcher made in a test or by a user goes away with its owner
    _dispatchers: "weakref.WeakSet[AutoKernelDispatcher]" = weakref.WeakSet()

    # ---- pins set in code -------------------------------------------------------------------
    @classmethod
    def _set(cls, family: str, backend, precision, auto_tune: bool) -> None:
        prec = None if precision is None else PrecisionType.parse(precision)
        cls._version += 1
        table = cls._pins.setdefault(family, {})
        if backend is None and not auto_tune:
            table.pop(prec, None)  # clear the pin
            return
        table[prec] = (None if backend is None else BackendType.parse(backend), bool(auto_tune and backend is None))

    @classmethod
    def set_gemm_backend(cls, backend=None, precision=None, auto_tune: bool = False) -> None:
        """Pin the GEMM backend (all precisions, or one). ``backend=None, auto_tune=True`` asks
        for autotune; ``backend=None, auto_tune=False`` clears the pin."""
        cls._set("gemm", backend, precision, auto_tune)

    @classmethod
    def set_grouped_gemm_backend(cls, backend=None, precision=None, auto_tune: bool = False) -> None:
        cls._set("grouped_gemm", backend, precision, auto_tune)

    @classmethod
    def set_attn_backend(cls, backend=None, precision=None) -> None:
        cls._set("attn", backend, precision, False)

    @classmethod
    def set_auto_tune(cls, enabled: Optional[bool]) -> None:
        """Global autotune switch; ``None`` defers to ``PRIMUS_TURBO_AUTO_TUNE``."""
        cls._auto_tune = None if enabled is None else bool(enabled)
        cls._version += 1

    # ---- queries ----------------------------------------------------------------------------
    @classmethod
    def get_auto_tune(cls) -> bool:
        if cls._auto_tune is not None:
            return cls._auto_tune
        return env_flag("PRIMUS_TURBO_AUTO_TUNE")

    @classmethod
    def user_choice(cls, family: str, precision: Optional[PrecisionType]) -> tuple[Optional[Choice], str]:
        """The user's choice for a family and precision and where it came from ("code"/"env")."""
        code = _lookup(cls._pins.get(family, {}), precision)
        if code is not None:
            return code, "code"
        var = cls._ENV.get(family)
        if var:
            # cached parse: the variable is read on every call (it may change) but parsed once
            env = _lookup(_parse_backend_env(env_str(var), var), precision)
            if env is not None:
                return env, f"env {var}"
        return None, ""

    @classmethod
    def _get(cls, family: str, precision) -> Optional[BackendType]:
        prec = None if precision is None else PrecisionType.parse(precision)
        choice, _ = cls.user_choice(family, prec)
        return None if choice is None else choice[0]

    @classmethod
    def get_gemm_backend(cls, precision=None) -> Optional[BackendType]:
        """The pinned GEMM backend for ``precision`` (code pin, else the environment variable);
        None when nothing is pinned or autotune is asked for."""
        return cls._get("gemm", precision)

    @classmethod
    def get_grouped_gemm_backend(cls, precision=None) -> Optional[BackendType]:
        """The pinned grouped-GEMM backend for ``precision`` (as :meth:`get_gemm_backend`)."""
        return cls._get("grouped_gemm", precision)

    @classmethod
    def get_attn_backend(cls, precision=None) -> Optional[BackendType]:
        """The pinned attention backend for ``precision`` (as :meth:`get_gemm_backend`)."""
        return cls._get("attn", precision)

    @classmethod
    def register_dispatcher(cls, dispatcher: "AutoKernelDispatcher") -> None:
        cls._dispatchers.add(dispatcher)

    @classmethod
    def reset(cls) -> None:
        """Forget every pin, the autotune switch and every autotune cache."""
        cls._pins = {}
        cls._auto_tune = None
        cls._version += 1
        for d in list(cls._dispatchers):
            d.tune_cache.clear()


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _time_call(fn: Callable[[], Any], on_cuda: bool, warmup: int = 10, iters: int = 20) -> float:
    """Median-free mean time of ``fn`` in ms (autotune only needs an ordering)."""
    for _ in range(warmup):
        fn()
    if on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def scratch_out_tune_kwargs(out=None, **kw) -> dict:
    """``make_tune_kwargs`` of the ops with an optional accumulation target ``out``: autotune times
    the candidates on a zeroed scratch copy, never on the caller's buffer (e.g. Megatron's main_grad)."""
    return dict(kw, out=None if out is None else torch.zeros_like(out))


class AutoKernelDispatcher:
    """Holds the backends of one op and applies the priority rule (module docstring)."""

    def __init__(
        self,
        op_name: str,
        family: str,
        backends: Sequence[type[KernelBackend]],
        make_key: Callable[..., Any],
        default: Callable[..., Optional[BackendType]],
        make_tune_kwargs: Optional[Callable[..., dict]] = None,
        cache_capacity: int = 1024,
        default_checked: Union[None, BackendType, Sequence[BackendType]] = None,
    ):
        # default_checked: the backend(s) that `default` returns only after their own can_handle()
        # said yes (the usual "vendor kernel where it runs" rule): not checked a second time
        if default_checked is None:
            default_checked = ()
        elif isinstance(default_checked, BackendType):
            default_checked = (default_checked,)
        self.default_checked = tuple(default_checked)  # a tuple: `in` is an identity test, no enum hashing
        self.op_name = op_name
        self.family = family
        self.backends: "OrderedDict[BackendType, type[KernelBackend]]" = OrderedDict(
            (b.backend_type, b) for b in backends
        )
        self.make_key = make_key
        self.default = default
        self.make_tune_kwargs = make_tune_kwargs
        self.tune_cache = TuneCache(cache_capacity)
        self._plans: dict = {}
        GlobalBackendManager.register_dispatcher(self)

    def register(self, backend: type[KernelBackend]) -> None:
        self.backends[backend.backend_type] = backend

    def _pinned(self, backend: BackendType, source: str, kwargs: dict) -> type[KernelBackend]:
        impl = self.backends.get(backend)
        if impl is None:
            have = ", ".join(b.name for b in self.backends)
            raise ValueError(
                f"{self.op_name}: backend {backend.name} (from {source}) is not available for this op; "
                f"available: {have}"
            )
        reason = impl.why_not(**kwargs)
        if reason is not None:
            raise ValueError(f"{self.op_name}: backend {backend.name} (from {source}) cannot run these inputs: {reason}")
        return impl

    def plan(self, precision: Optional[PrecisionType]) -> tuple[Optional[BackendType], str, bool]:
        """(pinned backend, where the pin came from, autotune?) for the current settings.

        Cached per (settings version, precision, raw env values): the hot path reads two
        environment strings and does one dict lookup instead of re-deriving the rule.
        """
        var = GlobalBackendManager._ENV.get(self.family)
        state = (
            GlobalBackendManager._version,
            None if precision is None else precision.value,  # enum hashing is slow Python code
            env_raw(var) if var else None,
            env_raw("PRIMUS_TURBO_AUTO_TUNE"),
        )
        plan = self._plans.get(state)
        if plan is None:
            choice, source = GlobalBackendManager.user_choice(self.family, precision)
            backend, tune = choice if choice is not None else (None, False)
            plan = (backend, source, bool(backend is None and (tune or GlobalBackendManager.get_auto_tune())))
            if len(self._plans) > 256:  # settings churn (tests): drop stale plans
                self._plans.clear()
            self._plans[state] = plan
        return plan

    def resolve(self, precision: Optional[PrecisionType], **kwargs: Any) -> type[KernelBackend]:
        backend, source, tune = self.plan(precision)
        if backend is not None:
            return self._pinned(backend, source, kwargs)
        if tune and not _is_capturing():
            winner = self._autotune(kwargs)
            if winner is not None:
                return winner
        default = self.default(**kwargs)
        if default is not None and default in self.backends and (
                default in self.default_checked or self.backends[default].can_handle(**kwargs)):
            return self.backends[default]
        reasons = []
        for impl in self.backends.values():
            reason = impl.why_not(**kwargs)
            if reason is None:
                warn_once(
                    f"{self.op_name}-fallback-{impl.backend_type.name}",
                    f"{self.op_name}: default backend "
                    f"{default.name if default else None} cannot run these inputs; falling back to "
                    f"{impl.backend_type.name}, which may be slower",
                )
                return impl
            reasons.append(f"{impl.backend_type.name}: {reason}")
        raise ValueError(f"{self.op_name}: no backend can run these inputs ({'; '.join(reasons)})")

    def dispatch(self, precision: Optional[PrecisionType], **kwargs: Any) -> Any:
        return self.resolve(precision, **kwargs).execute(**kwargs)

    def _autotune(self, kwargs: dict) -> Optional[type[KernelBackend]]:
        key = self.make_key(**kwargs)
        cached = self.tune_cache.get(key)
        if cached is not None and cached in self.backends and self.backends[cached].can_handle(**kwargs):
            return self.backends[cached]
        candidates = [b for b in self.backends.values() if b.autotune and b.can_handle(**kwargs)]
        if not candidates:
            return None
        if len(candidates) == 1:
            self.tune_cache.put(key, candidates[0].backend_type)
            return candidates[0]
        # Scratch copies of anything the op writes into, so timing never disturbs caller data.
        tune_kwargs = self.make_tune_kwargs(**kwargs) if self.make_tune_kwargs else kwargs
        on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in kwargs.values())
        timings = {}
        for impl in candidates:
            try:
                timings[impl.backend_type] = _time_call(lambda: impl.execute(**tune_kwargs), on_cuda)
            except Exception as exc:  # a backend that fails to run loses the race
                get_logger().debug("%s autotune: %s failed: %r", self.op_name, impl.backend_type.name, exc)
                timings[impl.backend_type] = math.inf
        best = min(timings, key=timings.get)
        if math.isinf(timings[best]):
            return None
        get_logger().info(
            "%s autotune %s: %s", self.op_name, key, ", ".join(f"{b.name}={t:.4f}ms" for b, t in timings.items())
        )
        self.tune_cache.put(key, best)
        return self.backends[best]
