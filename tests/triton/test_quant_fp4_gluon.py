"""The Hopper Gluon two-copy MXFP4 kernel (primus_turbo/triton/quantization/quant_fp4_gluon.py).

* Its per-thread PTX program through the numpy model (``quant_fp4_packed.emulate``, a warp of 32
  lanes with the butterflies): the codes of every bf16 bit pattern for several block multipliers,
  the E8M0 scale of every amax bit pattern, and whole warp tiles (random rows of mixed magnitude,
  inf, +-NaN, -0, subnormal blocks, ties, values that round past 6) against quant_ref, bit for bit.
* The sm_90 compile (no GPU): no spills, no shared memory, no barrier.
* On a GPU: the kernel against quant_ref, every configuration, and the default dispatch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from primus_turbo.testing.quant_ref import _e2m1_encode, quantize_fp4_ref
from primus_turbo.triton.quantization import quant_fp4_gluon as G
from primus_turbo.triton.quantization import quant_fp4_packed as P
from primus_turbo.triton.quantization.quant_fp4_kernel import fp4_quant_launch

from .gluon_compile_child import rerun_outside_interpreter
from .quant_special_helpers import sm90_kernels, special_bf16

_ALL = np.arange(65536, dtype=np.uint32)


def _code_prog():
    """One pair p under multiplier pair m: the program's shared prefix and one code."""
    ops = [("abs_bf", "a", "p"), ("max_bf", "a", "a", "kz"), ("mul_bf", "g", "p", "m"), ("mul_hi", "gs", "g", 1 << 26)]
    return ("p", "m"), ("z",), ops + G._code("a", "m", "gs", "z", "0")


@pytest.mark.parametrize("mexp", [0, 1, -3, 127, -100, 60, -126])
def test_codes_exhaustive(mexp):
    """Every bf16 bit pattern in both halves: nibble = the reference E2M1 code of x * 2**mexp
    (saturated to +-6, NaN -> 0, -0 and small negatives -> 0x8)."""
    x = torch.from_numpy((_ALL << 16).view(np.float32).copy()).double()
    want = _e2m1_encode((x * 2.0 ** mexp).to(torch.float32).double().clamp(-6, 6)).numpy()
    mb = np.uint32((127 + mexp) << 7)
    p = (_ALL | (_ALL[::-1] << 16)).astype(np.uint32)
    with np.errstate(all="ignore"):
        (z,) = P.emulate(_code_prog(), p, np.full_like(p, mb | (mb << 16)))
    assert np.array_equal((z >> 6) & 0xF, want), np.nonzero(((z >> 6) & 0xF) != want)[0][:8]
    assert np.array_equal((z >> 22) & 0xF, want[::-1])
    assert not np.any(z & 0xFC3FFC3F), "bits outside the two nibbles"


def test_scales_exhaustive():
    """Every amax bit pattern (sign clear; NaN as the canonical 0x7fff the amax produces): the
    multiplier and E8M0 byte of the OCP rule (quant_fp8_kernel._mx_scales)."""
    ins, outs, ops = ("z",), ("m", "b"), G._scale("z", "m", "b", "0")
    z = np.concatenate([np.arange(0x7F81, dtype=np.uint32), [0x7FFF]])
    zz = (z | (z[::-1] << 16)).astype(np.uint32)
    with np.errstate(all="ignore"):
        m, b = P.emulate((ins, outs, ops), zz)
    e = (z >> 7).astype(np.int64)
    bad = e == 255
    byte = np.where(bad, 255, np.maximum(e - 2, 0))
    mult = np.where(bad, 0x3F80, (254 - np.minimum(byte, 254)) << 7)
    assert np.array_equal(b & 0xFFFF, byte) and np.array_equal(b >> 16, byte[::-1])
    assert np.array_equal(m & 0xFFFF, mult) and np.array_equal(m >> 16, mult[::-1])


def _emulate_tile(x: torch.Tensor, twp: int) -> tuple:
    """One warp's tile (8 * 32 / twp rows x 8 * twp columns) through the program, its outputs
    scattered as the kernel's stores do."""
    twi = 32 // twp
    rows, cols = 8 * twi, 8 * twp
    u = x.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
    pairs = u[:, 0::2] | (u[:, 1::2] << 16)
    lane = np.arange(32)
    ti, tp = lane // twp, lane % twp
    ins = [pairs[8 * ti + k, 4 * tp + r][None, :] for k in range(8) for r in range(4)]
    with np.errstate(all="ignore"):
        outs = P.emulate(G.dual_prog(twp), *ins)
    a = np.stack(outs[:32])[:, 0, :]
    b = np.stack(outs[32:])[:, 0, :]
    p = np.zeros((rows, cols // 8), np.uint32)
    pt = np.zeros((cols, rows // 8), np.uint32)
    s = np.zeros((rows, cols // 32), np.uint8)
    st = np.zeros((cols, rows // 32), np.uint8)
    for ln in range(32):
        i, q = ti[ln], tp[ln]
        for k in range(8):
            p[8 * i + k, q] = a[4 * k, ln]
        for r in range(4):
            for h in range(2):
                pt[2 * (4 * q + r) + h, i] = b[4 * h + r, ln]
        for j in range(4):  # scale words: lanes 0, 1 of a block's four (row octets 0, 1 of four)
            if q % 4 < 2:
                s[8 * i + 4 * (q % 2) + j, q // 4] = (a[1, ln] >> (8 * j)) & 0xFF
            if i % 4 < 2:
                st[8 * q + 4 * (i % 2) + j, i // 4] = (b[8, ln] >> (8 * j)) & 0xFF
    return p.view(np.uint8).reshape(rows, -1), s, pt.view(np.uint8).reshape(cols, -1), st


@pytest.mark.parametrize("twp", [4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_program_tiles_match_reference(twp, seed):
    rows, cols = 8 * 32 // twp, 8 * twp
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-30, 30, (rows, 1), generator=g).float())
    x = x.bfloat16()
    if seed:
        x[0, 3], x[7, 1], x[1, 7], x[2, 9] = float("inf"), float("-inf"), float("nan"), -float("nan")
        x[3, :] = -0.0
        x[4, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        x[5, :] = 1e-39
        x[6, 5] = -2e-39
        x[10, :4] = torch.tensor([448.0, 1e-30, -7.9, 5.99])
        x[:, 5 + seed] = torch.randn(rows, generator=g) * 1e30
    got = _emulate_tile(x, twp)
    ref = (*quantize_fp4_ref(x), *quantize_fp4_ref(x.t().contiguous()))
    for name, o, r in zip(("data", "scale", "data_t", "scale_t"), got, ref):
        r = r.view(torch.uint8).numpy()
        assert o.shape == r.shape and np.array_equal(o, r), f"{name}: {np.count_nonzero(o != r)} bytes differ"


def test_reason_and_tile(monkeypatch):
    assert G.gluon_tile((4, 1, 4)) == (64, 128) and G.gluon_tile((8, 2, 2)) == (64, 128)
    assert G.gluon_tile(G.FP4_GLUON_DEFAULT) == (64, 128)
    x = torch.zeros(64, 128, dtype=torch.bfloat16)
    cuda_ok = G.fp4_gluon_reason(x) is None
    if not cuda_ok:  # on this machine the platform says no, after every input check passed
        assert "cuda" in G.fp4_gluon_reason(x).lower() or "gluon" in G.fp4_gluon_reason(x).lower()
    assert "bf16" in G.fp4_gluon_reason(x.float())
    assert "bf16" in G.fp4_gluon_reason(x[None])
    assert "64 x 128 tile" in G.fp4_gluon_reason(torch.zeros(96, 128, dtype=torch.bfloat16))
    assert "64 x 128 tile" in G.fp4_gluon_reason(torch.zeros(0, 128, dtype=torch.bfloat16))
    assert "contiguous" in G.fp4_gluon_reason(torch.zeros(128, 64, dtype=torch.bfloat16).t())
    assert "configuration" in G.fp4_gluon_reason(x, (2, 1, 4))
    assert "configuration" in G.fp4_gluon_reason(x, (4, 0, 4))
    assert "configuration" in G.fp4_gluon_reason(x, (4, 1, 4, 128))
    with pytest.raises(ValueError, match="twp must be 4 or 8"):
        G.dual_prog(2)
    if not cuda_ok:
        with pytest.raises(ValueError, match="fp4_gluon_with_trans_launch"):
            G.fp4_gluon_with_trans_launch(x)
    # the switch: auto / 1 / 0, anything else rejected naming the variable
    from primus_turbo.triton.quantization.gather_quant_gluon import gluon_switch

    monkeypatch.setenv(G.FP4_GLUON_ENV, "maybe")
    with pytest.raises(ValueError, match=G.FP4_GLUON_ENV):
        gluon_switch(G.FP4_GLUON_ENV)
    monkeypatch.setenv(G.FP4_GLUON_ENV, "0")
    assert gluon_switch(G.FP4_GLUON_ENV) is False


def test_compiles_for_sm90(request):
    """sm_90 compile of every configuration (no GPU): no spills, the bf16x2 arithmetic and the
    butterflies in the SASS, 128-bit loads, one barrier per tile (the row words' pass through
    shared memory) and no other shared-memory traffic."""
    if rerun_outside_interpreter(request):
        return
    x = torch.empty(4096, 7168, dtype=torch.bfloat16)

    kernels = sm90_kernels(lambda: [G.launch_config(x, cfg) for cfg in G.FP4_GLUON_CANDIDATES])
    assert len(kernels) == len(G.FP4_GLUON_CANDIDATES)
    for cfg, (name, err, st, ins) in zip(G.FP4_GLUON_CANDIDATES, kernels):
        assert err is None, err
        assert name == "_mxfp4_dual_gluon_kernel"
        assert st["spill"] == ("0", "0") or cfg[3:4] == (96,), (cfg, st)
        sass = "\n".join(ins)
        persistent = len(cfg) == 6 and cfg[5] > 0
        assert "HFMA2" in sass and "HMNMX2" in sass and sass.count("SHFL.BFLY") == 16
        assert sass.count("LDG.E.128") == (16 if persistent else 8), cfg
        assert sass.count("BAR.SYNC") == (2 if persistent else 1), cfg
        assert "STG.E.128" in sass and "STS.U8" not in sass and "LDS.U8" not in sass


def _special(rows, cols, device, seed=0):
    return special_bf16(rows, cols, device, [
        ((0, slice(0, 32)), 0.0), ((1, 3), float("inf")), ((1, 40), float("-inf")), ((2, 7), float("nan")),
        ((2, 9), -float("nan")), ((3, slice(0, 32)), 1e-39), ((3, 5), -2e-39), ((4, slice(32, 64)), -0.0),
        ((5, slice(0, 32)), [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4),
        ((6, slice(0, 32)), [448.0, 1e-30, -7.9, 5.99] * 8), ((70, slice(64, 96)), 3e38)], seed)


def _check(out, x):
    ref = (*quantize_fp4_ref(x.cpu()), *quantize_fp4_ref(x.t().contiguous().cpu()))
    for o, r, n in zip(out, ref, ("data", "scale", "data_t", "scale_t")):
        o, r = o.view(torch.uint8).cpu(), r.view(torch.uint8)
        assert o.shape == r.shape and torch.equal(o, r), \
            f"{n}: {(o != r).sum().item()} differ, first {(o != r).nonzero()[:4].tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", G.FP4_GLUON_CANDIDATES)
@pytest.mark.parametrize("shape", [(256, 1024), (512, 7168)])
def test_gpu_matches_reference(cfg, shape):
    x = _special(*shape, "cuda", seed=5)
    if G.fp4_gluon_reason(x, cfg) is not None:
        pytest.skip(G.fp4_gluon_reason(x, cfg))
    out = G.fp4_gluon_with_trans_launch(x, cfg)
    assert out[1].stride() == (1, shape[0]) and out[3].stride() == (1, shape[1])  # column-major scales
    _check(out, x)


@pytest.mark.gpu
def test_gpu_default_dispatch():
    """The default with_trans launch takes the Gluon kernel where it covers the shape, the tl pair
    kernel elsewhere: the same bytes."""
    x = _special(512, 1024, "cuda", seed=7)
    assert G.fp4_gluon_reason(x) is None
    _check(fp4_quant_launch(x, True, with_trans=True), x)
    y = _special(96, 160, "cuda", seed=8)  # not a multiple of the tile: the pair kernel
    assert G.fp4_gluon_reason(y) is not None
    _check(fp4_quant_launch(y, True, with_trans=True), y)


@pytest.mark.gpu
def test_gpu_switch_off(monkeypatch):
    """PRIMUS_TURBO_FP4_GLUON=0: the default launch never reaches the Gluon kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Gluon kernel ran with the switch off")

    monkeypatch.setenv(G.FP4_GLUON_ENV, "0")
    monkeypatch.setattr(G, "fp4_gluon_with_trans_launch", refuse)
    x = _special(512, 1024, "cuda", seed=9)
    _check(fp4_quant_launch(x, True, with_trans=True), x)
