"""primus_turbo.triton.launch: the cached direct launch of compiled kernels.

The launch key must tell apart every pair of argument lists Triton would compile differently
(dtype, 16-byte alignment, integers equal to 1 or divisible by 16, integer width, constexprs by
value, descriptor block shapes and layouts); the launch itself must give Triton's results, from
the first call (compiling) and from the cached entry, with arguments that change between calls
(new pointers, sizes, constexprs), on CPU through the interpreter and on the GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from primus_turbo.triton import launch as L  # noqa: E402


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    r = alpha * x + y
    if SQUARE:
        r = r * r
    tl.store(out_ptr + offs, r, mask=mask)


def _run(x, y, alpha, square, block=128):
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    n = x.numel()
    grid = (triton.cdiv(n, block),)
    L.launch(_axpy_kernel, grid, (x, y, out, alpha, n), dict(BLOCK=block, SQUARE=square, num_warps=4), x.device)
    return out


@pytest.mark.parametrize("repeat", [3])
def test_launch_matches_reference_across_changing_arguments(device, repeat):
    gen = torch.Generator().manual_seed(5)
    for n in (1, 16, 200, 1000, 4096, 129):
        for square in (False, True):
            for alpha in (0.5, -2.0):
                for _ in range(repeat):  # the first call compiles, later ones take the cached entry
                    x = torch.randn(n, generator=gen).to(device)
                    y = torch.randn(n, generator=gen).to(device)
                    got = _run(x, y, alpha, square)
                    ref = alpha * x.double() + y.double()
                    ref = ref * ref if square else ref
                    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)


def test_launch_unaligned_views(device):
    """A view one element into its storage is not 16-byte aligned: another key, same results."""
    gen = torch.Generator().manual_seed(6)
    base_x = torch.randn(1025, generator=gen).to(device)
    base_y = torch.randn(1025, generator=gen).to(device)
    for x, y in ((base_x[:1024], base_y[:1024]), (base_x[1:], base_y[1:]), (base_x[:1024], base_y[1:])):
        for _ in range(2):
            got = _run(x, y, 1.5, False)
            torch.testing.assert_close(got.double(), 1.5 * x.double() + y.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct entry exists for compiled (CUDA) kernels only")
def test_launch_takes_the_direct_entry_on_cuda():
    x = torch.randn(300, device="cuda")
    y = torch.randn(300, device="cuda")
    _run(x, y, 2.0, False)
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = L.launch_key(_axpy_kernel, (x, y, x, 2.0, 300), dict(BLOCK=128, SQUARE=False, num_warps=4))
    entry, names, defaults = L._ENTRIES[(id(_axpy_kernel), index, key)]
    assert entry is not None and names == ["BLOCK", "SQUARE"]
    got = _run(x, y, 2.0, False)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, 2.0 * x + y)
    out = torch.full_like(x, float("nan"))  # a callable grid takes Triton's own path
    L.launch(_axpy_kernel, lambda meta: (triton.cdiv(300, meta["BLOCK"]),), (x, y, out, 2.0, 300),
             dict(BLOCK=128, SQUARE=False, num_warps=4), x.device)
    torch.testing.assert_close(out, 2.0 * x + y)


@triton.jit(do_not_specialize=["alpha", "n"], do_not_specialize_on_alignment=["x_ptr", "y_ptr", "out_ptr"])
def _axpy_unspecialized_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = alpha * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, r, mask=mask)


def test_launch_keyed_across_changing_arguments(device):
    """launch_keyed with the caller's key (dtype and BLOCK: the kernel specializes on nothing else):
    right from the first call (compiling) and from the keyed entry, with new pointers, sizes and
    unaligned views each call; on CUDA the keyed entry is recorded after the first call."""
    gen = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.float16):
        for n in (1, 17, 300, 1000):
            for off in (0, 1):  # a view one element in: not 16-byte aligned
                x = torch.randn(n + off, generator=gen).to(device=device, dtype=dtype)[off:]
                y = torch.randn(n + off, generator=gen).to(device=device, dtype=dtype)[off:]
                out = torch.full_like(x, float("nan"))
                L.launch_keyed(_axpy_unspecialized_kernel, (triton.cdiv(n, 128),), (x, y, out, 0.5, n),
                               dict(BLOCK=128, num_warps=4), x.device, (dtype, 128))
                torch.testing.assert_close(out.double(), 0.5 * x.double() + y.double(), rtol=2e-3, atol=2e-3)
    if device == "cuda":
        assert sum(k[0] == id(_axpy_unspecialized_kernel) for k in L._KEYED) == 2


def test_launch_key_separates_specializations():
    k = _axpy_kernel
    t = torch.zeros(64)
    kw = dict(BLOCK=128, SQUARE=False, num_warps=4)

    def key(*args, **over):
        return L.launch_key(k, args, {**kw, **over})

    base = key(t, t, t, 1.0, 64)
    assert base == key(torch.ones(64), t, t, 3.0, 128)  # same dtype / alignment, n % 16 == 0 both
    assert base != key(t[1:], t, t, 1.0, 64)  # pointer alignment
    assert base != key(t.half(), t, t, 1.0, 64)  # dtype
    assert base != key(t, t, t, 1.0, 65)  # divisibility by 16
    assert key(t, t, t, 1.0, 65) != key(t, t, t, 1.0, 1)  # the value 1
    assert base != key(t, t, t, 1.0, 2**31 + 16)  # integer width
    assert base != key(t, t, t, 1.0, 64, SQUARE=True)  # constexprs by value
    assert base != key(t, t, t, 1.0, 64, num_warps=8)  # compile options
    assert L.launch_key(k, (t, t, t, 1.0, 64, 128), dict(SQUARE=False)) != \
        L.launch_key(k, (t, t, t, 1.0, 64, 256), dict(SQUARE=False))  # a constexpr passed positionally
    assert L.launch_key(k, (t, t, t, object(), 64), kw) is None  # unknown kinds: Triton's own path


def test_launch_key_descriptors():
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon.language import NVMMASharedLayout

    TD = gluon_hopper.TensorDescriptor
    lay = NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    lay64 = NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    b = torch.zeros(256, 136, dtype=torch.bfloat16)

    def key(t, block, layout, shape=None):
        d = TD(t, list(shape or t.shape), list(t.stride()), block, layout)
        return L.launch_key(_axpy_kernel, (d,), {})

    base = key(a, [64, 64], lay)
    assert base == key(torch.ones(256, 128, dtype=torch.bfloat16), [64, 64], lay)
    assert base != key(a, [128, 64], lay)  # block shape
    assert base != key(a, [64, 64], lay64)  # shared layout
    assert base != key(a.half(), [64, 64], lay)  # dtype
    # the sizes and strides are not specialized on (Triton encodes them into the TMA descriptor at
    # every launch): one entry serves them all
    assert base == key(b, [64, 64], lay) == key(a, [64, 64], lay, shape=[200, 128])


def test_launch_key_refines_tritons_specialization():
    """Wherever Triton's own specialization of an argument differs (the C++ routine its binder
    calls), the launch keys differ too: the cache can never hand one compiled kernel's entry to
    arguments Triton would compile another kernel for."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    spec = getattr(libtriton, "native_specialize_impl", None)
    if spec is None:
        pytest.skip("this triton has no native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    buf = torch.zeros(4096)
    values = [0, 1, 2, 15, 16, 17, 32, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -16, -(2**31) - 16,
              2**63 + 16, True, False, 0.5, 1.0, None, buf, buf[1:], buf[4:], buf.half(), buf.half()[8:],
              buf.to(torch.bfloat16)[3:]]
    try:
        from triton.experimental.gluon.language import NVMMASharedLayout
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as TD

        lay = NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        lay64 = NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        m = torch.zeros(256, 128, dtype=torch.bfloat16)
        values += [TD(m, [256, 128], [128, 1], [64, 64], lay), TD(m, [256, 128], [128, 1], [128, 64], lay),
                   TD(m, [256, 128], [128, 1], [64, 64], lay64), TD(m.half(), [256, 128], [128, 1], [64, 64], lay),
                   TD(m, [200, 120], [128, 1], [64, 64], lay)]
    except ImportError:
        pass

    def triton_spec(v):
        return repr(spec(BaseBackend, v, False, True, True))

    for i, x in enumerate(values):
        for y in values[i + 1:]:
            if triton_spec(x) != triton_spec(y):
                kx = L.launch_key(_axpy_kernel, (x,), {})
                ky = L.launch_key(_axpy_kernel, (y,), {})
                assert kx is not None and ky is not None
                assert kx != ky, (x, y, triton_spec(x), triton_spec(y))


def test_descriptor_expansion_is_cached(monkeypatch):
    """The direct entry of a kernel with host tensor descriptors expands them through a cache: the
    encoded map of a (position, data pointer, shape, strides, padding) is made once and reused, the
    C launcher gets exactly the arguments Triton's own wrapper would give, and a new pointer, shape
    or stride makes a new map. Triton's wrapper is built around a recording launcher; the encoder
    is a stand-in (the real one needs the CUDA driver)."""
    from triton.backends.nvidia import driver as nvd
    from triton.tools.tensor_descriptor import TensorDescriptor

    made = []

    def fake_encode(arg, meta):
        made.append((arg.base.data_ptr(), tuple(arg.shape)))
        if meta is None:
            return [arg.base, *arg.shape, *arg.strides]
        return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), meta["swizzle"]),
                *arg.shape, *arg.strides]

    monkeypatch.setattr(nvd, "make_tensordesc_arg", fake_encode)
    got = []
    signature = {0: "tensordesc<bf16[64, 64]>", 1: "*fp32", 2: "tensordesc<bf16[1, 64, 128]>", 3: "i32"}
    metas = [{"swizzle": 3}, {"swizzle": 2}]
    inner = nvd.wrap_handle_tensordesc(lambda *a: got.append(a), signature, metas)
    direct = L._cached_descriptors(inner)
    assert direct is not inner
    base = tuple(range(nvd._BASE_ARGS_FORMAT_LEN))
    a = torch.zeros(256, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    p = torch.zeros(4)

    def descs(a, w):
        return (TensorDescriptor(a, list(a.shape), list(a.stride()), [64, 64]),
                TensorDescriptor(w, list(w.shape), list(w.stride()), [1, 64, 128]))

    da, dw = descs(a, w)
    direct(*base, da, p, dw, 7)
    inner(*base, da, p, dw, 7)
    assert got[0] == got[1] and len(made) == 4  # Triton's wrapper encodes every call; ours once per map
    da2, dw2 = descs(a, w)  # new descriptor objects, same tensors: the cached maps
    direct(*base, da2, p, dw2, 8)
    assert len(made) == 4 and got[2][:-1] == got[0][:-1] and got[2][-1] == 8
    a2 = torch.zeros(256, 64, dtype=torch.bfloat16)  # another pointer
    direct(*base, *descs(a2, w)[:1], p, dw2, 7)
    assert len(made) == 5 and got[3][len(base)][1] == a2.data_ptr()
    direct(*base, *descs(a[:128], w)[:1], p, dw2, 7)  # another shape, same pointer
    assert len(made) == 6 and got[4][len(base)][2] == (128, 64)
    # a wrapper whose descriptors the frontend decomposes (no metadata): Triton's own expansion
    plain = nvd.wrap_handle_tensordesc(lambda *a: None, signature, None)
    assert L._cached_descriptors(plain) is plain
    # not a descriptor wrapper at all
    assert L._cached_descriptors(print) is print


def test_descriptor_wrapper_exposes_its_expansion(monkeypatch):
    """What launch_prepared builds its kept lists from: the wrapper's C launcher, its base-argument
    count and ``finalize`` (the expansion without the launch), which gives the launcher exactly the
    arguments Triton's own wrapper would; and ``_pointers_of``, the check of the caller's pointers
    (tensors and descriptor bases, nothing else)."""
    from triton.backends.nvidia import driver as nvd
    from triton.tools.tensor_descriptor import TensorDescriptor

    monkeypatch.setattr(nvd, "make_tensordesc_arg",
                        lambda arg, meta: [("map", arg.base.data_ptr(), tuple(arg.shape)), *arg.shape, *arg.strides])
    got = []

    def launcher(*a):
        got.append(a)

    signature = {0: "tensordesc<bf16[64, 64]>", 1: "*fp32", 2: "i32"}
    inner = nvd.wrap_handle_tensordesc(launcher, signature, [{"swizzle": 3}])
    direct = L._cached_descriptors(inner)
    assert direct.launcher is launcher and direct.base == nvd._BASE_ARGS_FORMAT_LEN
    base = tuple(range(nvd._BASE_ARGS_FORMAT_LEN))
    a = torch.zeros(128, 64, dtype=torch.bfloat16)
    p = torch.zeros(4)
    d = TensorDescriptor(a, list(a.shape), list(a.stride()), [64, 64])
    inner(*base, d, p, 5)
    assert tuple(direct.finalize(base + (d, p, 5))) == got[0]
    assert L._pointers_of((d, p, 5, None)) == {a.data_ptr(), p.data_ptr()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="prepared launches exist for CUDA kernels only")
def test_launch_prepared_keeps_pointer_lists():
    """launch_prepared: right on the first call (through launch_keyed) and from its kept list, with
    recurring and new pointers; the kept lists hold ints, never tensors (freed outputs are freed);
    a caller whose pointers miss one of the arguments' tensors gets no kept list."""
    n = 1000
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(n, generator=gen).cuda() for _ in range(3)]
    y = torch.randn(n, generator=gen).cuda()
    kw = dict(BLOCK=128, num_warps=4)
    before = torch.cuda.memory_allocated()
    for i in range(6):
        x = xs[i % 3]
        out = torch.full_like(x, float("nan"))
        args = (x, y, out, 0.5, n)
        L.launch_prepared(_axpy_unspecialized_kernel, (triton.cdiv(n, 128),), lambda: args, kw, x.device,
                          ("prep", torch.float32), (x.data_ptr(), y.data_ptr(), out.data_ptr()))
        torch.testing.assert_close(out, 0.5 * x + y)
        del out, args
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    kept = [v for k, v in L._PREPARED.items() if k[0] == id(_axpy_unspecialized_kernel) and k[2][0] == "prep"]
    assert kept and all(not isinstance(a, torch.Tensor) for rec in kept for a in rec[1])
    out = torch.full_like(y, float("nan"))
    args = (y, y, out, 2.0, n)
    L.launch_prepared(_axpy_unspecialized_kernel, (triton.cdiv(n, 128),), lambda: args, kw, y.device,
                      ("prep-missing", torch.float32), (y.data_ptr(),))  # out's pointer left out
    torch.testing.assert_close(out, 3.0 * y)
    assert not any(k[2][0] == "prep-missing" for k in L._PREPARED)


def test_launch_prepared_logic_without_a_gpu(monkeypatch):
    """launch_prepared's bookkeeping with the CUDA side mocked (CPU CI): a miss launches through
    launch_keyed and keeps the C launcher's list (descriptors through ``finalize``, tensors as int
    pointers); a hit calls the kept launcher with the fixed head, the current stream and that list,
    and builds no arguments; pointers that miss a tensor of the arguments keep nothing; a launch
    hook sends every call back through launch_keyed."""
    from types import SimpleNamespace

    from triton.backends.nvidia import driver as nvd
    from triton.tools.tensor_descriptor import TensorDescriptor

    monkeypatch.setattr(nvd, "make_tensordesc_arg",
                        lambda arg, meta: [("map", arg.base.data_ptr()), *arg.shape, *arg.strides])
    launched = []
    inner = nvd.wrap_handle_tensordesc(lambda *a: launched.append(("c", a)),
                                       {0: "tensordesc<bf16[64, 64]>", 1: "*fp32", 2: "i32"}, [{"swizzle": 3}])
    direct = L._cached_descriptors(inner)
    jit_fn = object()
    keyed = []

    def fake_keyed(fn, grid, args, kw, dev, key):
        keyed.append(args)
        L._KEYED[(id(fn), 0, key)] = ((direct, "function", False, False, "packed"), [128])

    hooks = [False]
    monkeypatch.setattr(L, "launch_keyed", fake_keyed)
    monkeypatch.setattr(L, "_DIRECT", [True])
    monkeypatch.setattr(L, "raw_stream", lambda index: 77)
    monkeypatch.setattr(L, "no_launch_hooks", lambda: not hooks[0])
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # absent from CPU builds
    dev = SimpleNamespace(type="cuda", index=0)
    a = torch.zeros(128, 64, dtype=torch.bfloat16)
    p = torch.zeros(4)
    built = []

    def args_fn():
        built.append(1)
        return (TensorDescriptor(a, list(a.shape), list(a.stride()), [64, 64]), p, 5)

    ptrs = (a.data_ptr(), p.data_ptr())
    L.launch_prepared(jit_fn, (3,), args_fn, {}, dev, "k", ptrs)  # miss: launch_keyed, then kept
    assert len(keyed) == 1 and len(built) == 1
    rec = L._PREPARED[(id(jit_fn), 0, "k", ptrs)]
    assert rec[1] == [("map", a.data_ptr()), 128, 64, 64, 1, p.data_ptr(), 5, 128]
    L.launch_prepared(jit_fn, (3, 2), args_fn, {}, dev, "k", ptrs)  # hit: no arguments built
    assert len(keyed) == 1 and len(built) == 1
    assert launched[-1] == ("c", (3, 2, 1, 77, "function", False, False, None, None, "packed", None, None, None,
                                  *rec[1]))
    L.launch_prepared(jit_fn, (3,), args_fn, {}, dev, "k2", (a.data_ptr(),))  # p's pointer missing
    assert len(keyed) == 2 and (id(jit_fn), 0, "k2", (a.data_ptr(),)) not in L._PREPARED
    hooks[0] = True  # a hook installed: launch_keyed every time
    L.launch_prepared(jit_fn, (3,), args_fn, {}, dev, "k", ptrs)
    assert len(keyed) == 3
    for k in [k for k in L._PREPARED if k[0] == id(jit_fn)]:
        del L._PREPARED[k]
    for k in [k for k in L._KEYED if k[0] == id(jit_fn)]:
        del L._KEYED[k]


def test_with_current_context_retries_once_after_binding(monkeypatch):
    """A launch that fails for want of a current CUDA context (a TMA encode on a thread that made
    no runtime call) is retried once after the primary context is bound; other errors, and the
    same error when no context could be bound, propagate unchanged."""
    from types import SimpleNamespace

    from primus_turbo.triton import launch as L

    bound, calls = [], []
    monkeypatch.setattr(L, "_bind_primary_context", lambda device: bound.append(device) or ok[0])
    ok = [True]
    dev = SimpleNamespace(type="cuda", index=0)

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Triton Error [CUDA]: Failed to create tensor map descriptor: invalid device context")
        return "launched"

    assert L.with_current_context(flaky, dev) == "launched" and len(calls) == 2 and bound == [dev]
    with pytest.raises(RuntimeError, match="out of memory"):
        L.with_current_context(lambda: (_ for _ in ()).throw(RuntimeError("out of memory")), dev)
    assert len(bound) == 1
    ok[0] = False
    calls.clear()
    with pytest.raises(RuntimeError, match="invalid device context"):
        L.with_current_context(flaky, dev)
    assert len(calls) == 1 and len(bound) == 2
    assert L._bind_primary_context(SimpleNamespace(type="cpu", index=None)) is False
