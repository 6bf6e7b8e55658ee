"""The dispatcher's priority rule, env parsing, autotune and its cache, on toy backends."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    GlobalBackendManager,
    KernelBackend,
    PrecisionType,
    TuneCache,
    parse_backend_env,
)

BF16 = PrecisionType.BF16_FP16_FP32
FP8 = PrecisionType.FP8


class _Calls:
    log: list = []


def _make_backend(btype, *, reject=None, raises=False, delay=0.0, autotune=True):
    class _B(KernelBackend):
        backend_type = btype

        @classmethod
        def check(cls, x, **_):
            if raises:
                raise RuntimeError("broken gate")
            if reject is not None and reject(x):
                return f"{btype.name} rejects size {x.numel()}"
            return None

        @classmethod
        def execute(cls, x, out=None, **_):
            _Calls.log.append(btype)
            if delay:
                import time

                time.sleep(delay)
            if out is not None:
                out.add_(1.0)  # an "accumulating" op: a tuned call must never touch caller data
            return btype

    _B.autotune = autotune
    return _B


def _dispatcher(backends, default=BackendType.TORCH, family="gemm", tune_kwargs=None):
    return AutoKernelDispatcher(
        op_name="toy",
        family=family,
        backends=backends,
        make_key=lambda x, **_: (x.numel(),),
        default=lambda **_: default,
        make_tune_kwargs=tune_kwargs,
    )


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("PRIMUS_TURBO_GEMM_BACKEND", "PRIMUS_TURBO_AUTO_TUNE", "PRIMUS_TURBO_GROUPED_GEMM_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    _Calls.log = []


def test_default_is_used_when_it_can_handle():
    d = _dispatcher([_make_backend(BackendType.TRITON), _make_backend(BackendType.TORCH)])
    assert d.dispatch(BF16, x=torch.ones(4)) == BackendType.TORCH


def test_default_checked_backends_are_not_checked_twice():
    """default_checked: one backend or several; those the default returns run without a second
    can_handle() (the default already asked), the others are still checked."""
    checks = []

    def counted(btype):
        b = _make_backend(btype)
        orig = b.check.__func__

        def check(cls, x, **kw):
            checks.append(btype)
            return orig(cls, x, **kw)

        b.check = classmethod(check)
        return b

    backends = [counted(BackendType.TORCH), counted(BackendType.TRITON), counted(BackendType.GLUON)]
    for default, checked, want_checks in ((BackendType.GLUON, (BackendType.TORCH, BackendType.GLUON), 0),
                                          (BackendType.TORCH, BackendType.TORCH, 0),
                                          (BackendType.TRITON, (BackendType.TORCH, BackendType.GLUON), 1),
                                          (BackendType.GLUON, None, 1)):
        d = AutoKernelDispatcher(op_name="toy", family="gemm", backends=backends, make_key=lambda x, **_: (x.numel(),),
                                 default=lambda _d=default, **_: _d, default_checked=checked)
        checks.clear()
        assert d.dispatch(BF16, x=torch.ones(4)) == default
        assert len(checks) == want_checks, (default, checked, checks)


def test_fallback_to_first_that_can_handle_warns_once(caplog):
    torch_b = _make_backend(BackendType.TORCH, reject=lambda x: True)
    d = _dispatcher([torch_b, _make_backend(BackendType.TRITON)])
    with caplog.at_level("WARNING", logger="primus_turbo"):
        assert d.dispatch(BF16, x=torch.ones(4)) == BackendType.TRITON
        assert d.dispatch(BF16, x=torch.ones(4)) == BackendType.TRITON
    msgs = [r for r in caplog.records if "falling back to TRITON" in r.getMessage()]
    assert len(msgs) == 1


def test_no_backend_raises_with_reasons():
    d = _dispatcher([_make_backend(BackendType.TORCH, reject=lambda x: True), _make_backend(BackendType.TRITON, raises=True)])
    with pytest.raises(ValueError, match=r"no backend can run.*TORCH rejects size 4.*TRITON: can_handle check failed"):
        d.dispatch(BF16, x=torch.ones(4))


def test_can_handle_never_raises():
    b = _make_backend(BackendType.TORCH, raises=True)
    assert b.can_handle(x=torch.ones(1)) is False
    assert "broken gate" in b.why_not(x=torch.ones(1))


def test_code_pin_beats_env_and_default(monkeypatch):
    d = _dispatcher([_make_backend(BackendType.TORCH), _make_backend(BackendType.TRITON), _make_backend(BackendType.GLUON)])
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "GLUON")
    assert d.dispatch(BF16, x=torch.ones(2)) == BackendType.GLUON  # env beats default
    GlobalBackendManager.set_gemm_backend(BackendType.TRITON)
    assert d.dispatch(BF16, x=torch.ones(2)) == BackendType.TRITON  # code beats env
    GlobalBackendManager.set_gemm_backend(None)  # clears the pin
    assert d.dispatch(BF16, x=torch.ones(2)) == BackendType.GLUON


def test_pin_per_precision(monkeypatch):
    d = _dispatcher([_make_backend(BackendType.TORCH), _make_backend(BackendType.TRITON)])
    GlobalBackendManager.set_gemm_backend("triton", precision="FP8")
    assert d.dispatch(FP8, x=torch.ones(2)) == BackendType.TRITON
    assert d.dispatch(BF16, x=torch.ones(2)) == BackendType.TORCH
    assert GlobalBackendManager.get_gemm_backend("FP8") == BackendType.TRITON
    assert GlobalBackendManager.get_gemm_backend("BF16") is None


def test_getters_of_every_family(monkeypatch):
    """The grouped-GEMM and attention getters read their own family's pin (code, then environment),
    per precision, and never another family's."""
    monkeypatch.delenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", raising=False)
    monkeypatch.delenv("PRIMUS_TURBO_ATTN_BACKEND", raising=False)
    monkeypatch.delenv("PRIMUS_TURBO_GEMM_BACKEND", raising=False)
    G = GlobalBackendManager
    assert G.get_grouped_gemm_backend() is None and G.get_attn_backend() is None
    G.set_grouped_gemm_backend("gluon", precision="BF16")
    assert G.get_grouped_gemm_backend("BF16") == BackendType.GLUON
    assert G.get_grouped_gemm_backend("FP8") is None and G.get_gemm_backend("BF16") is None
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BACKEND", "TORCH")
    assert G.get_attn_backend() == BackendType.TORCH and G.get_attn_backend("BF16") == BackendType.TORCH
    G.set_attn_backend("triton")
    assert G.get_attn_backend() == BackendType.TRITON  # code beats the environment
    assert G.get_grouped_gemm_backend("BF16") == BackendType.GLUON
    G.reset()
    assert G.get_grouped_gemm_backend("BF16") is None and G.get_attn_backend() == BackendType.TORCH


def test_env_per_precision(monkeypatch):
    d = _dispatcher([_make_backend(BackendType.TORCH), _make_backend(BackendType.TRITON)], default=BackendType.GLUON)
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "FP8:TRITON,BF16:TORCH")
    assert d.dispatch(FP8, x=torch.ones(2)) == BackendType.TRITON
    assert d.dispatch(BF16, x=torch.ones(2)) == BackendType.TORCH


def test_pinned_backend_that_cannot_handle_raises():
    d = _dispatcher([_make_backend(BackendType.TORCH), _make_backend(BackendType.TRITON, reject=lambda x: x.numel() > 3)])
    GlobalBackendManager.set_gemm_backend(BackendType.TRITON)
    with pytest.raises(ValueError, match=r"backend TRITON \(from code\) cannot run these inputs: TRITON rejects size 4"):
        d.dispatch(BF16, x=torch.ones(4))


def test_pinned_backend_not_registered_raises(monkeypatch):
    d = _dispatcher([_make_backend(BackendType.TORCH)])
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "GLUON")
    with pytest.raises(ValueError, match=r"GLUON \(from env PRIMUS_TURBO_GEMM_BACKEND\) is not available.*TORCH"):
        d.dispatch(BF16, x=torch.ones(4))


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", {}),
        ("TRITON", {None: (BackendType.TRITON, False)}),
        ("torch", {None: (BackendType.TORCH, False)}),
        ("HIPBLASLT", {None: (BackendType.TORCH, False)}),
        ("autotune", {None: (None, True)}),
        ("FP8:TRITON,BF16:TORCH", {FP8: (BackendType.TRITON, False), BF16: (BackendType.TORCH, False)}),
        ("FP8:autotune,other:TORCH", {FP8: (None, True), None: (BackendType.TORCH, False)}),
        (" fp4 : gluon , fp16:triton ", {PrecisionType.FP4: (BackendType.GLUON, False), BF16: (BackendType.TRITON, False)}),
    ],
)
def test_parse_backend_env(value, expected):
    assert parse_backend_env(value) == expected


@pytest.mark.parametrize(
    "value, match",
    [
        ("CUTLASS", "unknown backend 'CUTLASS'"),
        ("FP9:TRITON", "unknown precision 'FP9'"),
        ("FP8:TRITON,FP8:TORCH", "given twice"),
        ("TRITON,,TORCH", "empty entry"),
    ],
)
def test_parse_backend_env_errors(value, match):
    with pytest.raises(ValueError, match=match):
        parse_backend_env(value, "PRIMUS_TURBO_GEMM_BACKEND")


def test_bad_env_value_raises_at_dispatch(monkeypatch):
    d = _dispatcher([_make_backend(BackendType.TORCH)])
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "NOPE")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_GEMM_BACKEND='NOPE'"):
        d.dispatch(BF16, x=torch.ones(1))


def test_unknown_backend_name_in_code():
    with pytest.raises(ValueError, match="unknown backend 'cutlass'"):
        GlobalBackendManager.set_gemm_backend("cutlass")
    with pytest.raises(TypeError):
        BackendType.parse(3)


def test_autotune_picks_fastest_and_caches(monkeypatch):
    slow = _make_backend(BackendType.TORCH, delay=0.002)
    fast = _make_backend(BackendType.TRITON)
    d = _dispatcher([slow, fast])
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
    assert d.dispatch(BF16, x=torch.ones(3)) == BackendType.TRITON
    assert len(d.tune_cache) == 1 and (3,) in d.tune_cache
    _Calls.log = []
    assert d.dispatch(BF16, x=torch.ones(3)) == BackendType.TRITON
    assert _Calls.log == [BackendType.TRITON]  # cached: no second tuning round
    GlobalBackendManager.reset()
    assert len(d.tune_cache) == 0


def test_autotune_requested_by_pin_and_env(monkeypatch):
    d = _dispatcher([_make_backend(BackendType.TORCH, delay=0.002), _make_backend(BackendType.TRITON)])
    GlobalBackendManager.set_gemm_backend(None, auto_tune=True)
    assert d.dispatch(BF16, x=torch.ones(5)) == BackendType.TRITON
    GlobalBackendManager.reset()
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "BF16:autotune")
    assert d.dispatch(BF16, x=torch.ones(6)) == BackendType.TRITON
    assert d.dispatch(FP8, x=torch.ones(6)) == BackendType.TORCH  # not asked for FP8: default


def test_set_auto_tune_overrides_env(monkeypatch):
    d = _dispatcher([_make_backend(BackendType.TORCH, delay=0.002), _make_backend(BackendType.TRITON)])
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
    GlobalBackendManager.set_auto_tune(False)
    assert d.dispatch(BF16, x=torch.ones(7)) == BackendType.TORCH
    assert GlobalBackendManager.get_auto_tune() is False


def test_autotune_failing_backend_loses():
    class Broken(_make_backend(BackendType.TRITON)):
        @classmethod
        def execute(cls, x, **_):
            raise RuntimeError("kernel failed")

    d = _dispatcher([_make_backend(BackendType.TORCH, delay=0.001), Broken])
    GlobalBackendManager.set_auto_tune(True)
    assert d.dispatch(BF16, x=torch.ones(8)) == BackendType.TORCH


def test_autotune_skips_backends_that_opt_out():
    d = _dispatcher([_make_backend(BackendType.TORCH, delay=0.002), _make_backend(BackendType.TRITON, autotune=False)])
    GlobalBackendManager.set_auto_tune(True)
    assert d.dispatch(BF16, x=torch.ones(9)) == BackendType.TORCH


def test_autotune_never_touches_caller_accumulator():
    d = _dispatcher(
        [_make_backend(BackendType.TORCH, delay=0.001), _make_backend(BackendType.TRITON)],
        tune_kwargs=lambda x, out=None, **_: dict(x=x, out=torch.zeros_like(out)),
    )
    GlobalBackendManager.set_auto_tune(True)
    acc = torch.zeros(3)
    d.dispatch(BF16, x=torch.ones(10), out=acc)
    # 60 tuning calls went to the scratch buffer; the real call added exactly once
    assert torch.equal(acc, torch.ones(3))


def test_autotune_skipped_during_graph_capture(monkeypatch):
    import primus_turbo.pytorch.core.backend as backend_mod

    monkeypatch.setattr(backend_mod, "_is_capturing", lambda: True)
    d = _dispatcher([_make_backend(BackendType.TORCH, delay=0.002), _make_backend(BackendType.TRITON)])
    GlobalBackendManager.set_auto_tune(True)
    assert d.dispatch(BF16, x=torch.ones(11)) == BackendType.TORCH
    assert len(d.tune_cache) == 0


def test_tune_cache_is_lru():
    c = TuneCache(capacity=2)
    c.put("a", BackendType.TORCH)
    c.put("b", BackendType.TRITON)
    assert c.get("a") == BackendType.TORCH  # "a" now most recent
    c.put("c", BackendType.GLUON)
    assert "b" not in c and "a" in c and "c" in c


def test_precision_parse_and_of_dtype():
    assert PrecisionType.parse("bf16") is BF16
    assert PrecisionType.parse("FP32") is BF16
    assert PrecisionType.of_dtype(torch.float8_e4m3fn) is FP8
    assert PrecisionType.of_dtype(torch.bfloat16) is BF16
    with pytest.raises(ValueError, match="unknown precision"):
        PrecisionType.parse("int8")


def test_grouped_gemm_family_is_separate(monkeypatch):
    d = _dispatcher([_make_backend(BackendType.TORCH), _make_backend(BackendType.TRITON)], family="grouped_gemm")
    GlobalBackendManager.set_gemm_backend(BackendType.TRITON)
    assert d.dispatch(BF16, x=torch.ones(2)) == BackendType.TORCH
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "TRITON")
    assert d.dispatch(BF16, x=torch.ones(2)) == BackendType.TRITON
