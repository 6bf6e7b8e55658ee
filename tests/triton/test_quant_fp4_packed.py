"""The bf16-pair MXFP4 kernels (primus_turbo/triton/quantization/quant_fp4_packed.py).

* The PTX sequences, run through their numpy model on every bf16 bit pattern, against the
  reference encoder (quant_ref._e2m1_encode) for several block scales: row words, column words,
  the block amax.
* The kernels in the interpreter (their SOFT branch: same data flow, fp32 nibble code) against
  quant_ref, with special values, even and ragged tiles.
* The sm_90 compile (no GPU needed; in a child process outside the interpreter): no spills, the
  bf16x2 instructions present.
* On a GPU: the real PTX path against quant_ref with special values (-NaN, subnormal blocks, -0).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from primus_turbo.testing.quant_ref import _e2m1_encode, quantize_fp4_ref
from primus_turbo.triton.quantization import quant_fp4_packed as P
from primus_turbo.triton.quantization.quant_fp4_kernel import fp4_quant_launch

from .gluon_compile_child import rerun_outside_interpreter
from .quant_special_helpers import sm90_kernels, special_bf16

_ALL = np.arange(65536, dtype=np.uint32)


def _ref_codes(mexp: int) -> np.ndarray:
    x = torch.from_numpy((_ALL << 16).view(np.float32).copy()).double()
    y = (x * 2.0 ** mexp).to(torch.float32).double().clamp(-6, 6)
    return _e2m1_encode(y).numpy()


@pytest.mark.parametrize("mexp", [0, 1, -3, 127, -100, 60])
def test_emulated_sequences_exhaustive(mexp):
    mb = np.uint32((127 + mexp) << 7)
    want = _ref_codes(mexp)
    h = _ALL.reshape(-1, 8)
    pairs = [(h[:, 2 * j] | (h[:, 2 * j + 1] << 16)).astype(np.uint32) for j in range(4)]
    m2 = np.full(h.shape[0], mb | (mb << 16), dtype=np.uint32)
    with np.errstate(all="ignore"):
        (w,) = P.emulate(P.ROW_WORD_PROG, *pairs, m2)
    got = np.stack([(w >> (4 * i)) & 0xF for i in range(8)], 1).reshape(-1)
    assert np.array_equal(got, want), np.nonzero(got != want)[0][:8]
    hc = _ALL.reshape(-1, 8, 2)  # [word, row k, column h]
    ps = [(hc[:, k, 0] | (hc[:, k, 1] << 16)).astype(np.uint32) for k in range(8)]
    with np.errstate(all="ignore"):
        we, wo = P.emulate(P.COL_WORDS_PROG, *ps, m2[: hc.shape[0]])
    ge = np.stack([(we >> (4 * k)) & 0xF for k in range(8)], 1)
    go = np.stack([(wo >> (4 * k)) & 0xF for k in range(8)], 1)
    got = np.stack([ge, go], 2).reshape(-1)
    assert np.array_equal(got, want), np.nonzero(got != want)[0][:8]


def test_emulated_amax_exponent():
    h = _ALL.reshape(-1, 8)
    pairs = [(h[:, 2 * j] | (h[:, 2 * j + 1] << 16)).astype(np.uint32) for j in range(4)]
    with np.errstate(all="ignore"):
        (am,) = P.emulate(P.AMAX_WORD_PROG, *pairs)
    want = np.max(h & 0x7FFF, axis=1)
    assert np.array_equal((am >> 23) & 0xFF, (want >> 7) & 0xFF)
    assert np.array_equal(np.minimum(am >> 16, 0x7F81), np.minimum(want, 0x7F81))  # NaN above inf


def _special(rows, cols, device, seed=0):
    return special_bf16(rows, cols, device, [
        ((0, slice(0, 32)), 0.0), ((1, 3), float("inf")), ((1, 40), float("-inf")), ((2, 7), float("nan")),
        ((2, 9), -float("nan")),
        ((3, slice(0, 32)), 1e-39),  # a subnormal block (E8M0 byte 0, multiplier 2**127)
        ((3, 5), -2e-39), ((4, slice(32, 64)), -0.0),
        ((5, slice(0, 32)), [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4),  # ties
        ((6, slice(0, 32)), [448.0, 1e-30, -7.9, 5.99] * 8)], seed)


def _check(x, tile, with_trans):
    out = fp4_quant_launch(x, True, with_trans=with_trans, tile=tile)
    ref = quantize_fp4_ref(x.cpu())
    names = ["data", "scale"]
    if with_trans:
        ref = (*ref, *quantize_fp4_ref(x.t().contiguous().cpu()))
        names += ["data_t", "scale_t"]
    for o, r, n in zip(out, ref, names):
        o, r = o.view(torch.uint8).cpu(), r.view(torch.uint8)
        assert torch.equal(o, r), f"{tile} {n}: {(o != r).sum().item()} differ, first {(o != r).nonzero()[:4].tolist()}"


@pytest.mark.parametrize("shape", [(64, 192), (40, 1056), (8, 64)])
@pytest.mark.parametrize("tile", [(8, 1024, 4, "packed"), (4, 64, 4, "packed"), (16, 32, 4, "packed")])
def test_packed_single_copy(shape, tile, device):
    _check(_special(*shape, device), tile, False)


@pytest.mark.parametrize("shape", [(64, 192), (96, 160), (32, 64)])
@pytest.mark.parametrize("tile", [(64, 128, 4, "packed"), (32, 64, 4, "packed"), (128, 64, 4, "packed", 128),
                                  (32, 128, 1, "packed"), (64, 64, 2, "packed"),
                                  (128, 64, 4, "packed", 0, "tscale"), (64, 128, 4, "packed", 0, "tscale")])
def test_packed_with_trans(shape, tile, device):
    _check(_special(*shape, device), tile, True)


def test_packed_falls_back(device):
    """fp32 input or stochastic rounding: the tl kernels run with the same tile."""
    x = _special(64, 64, device).float()
    _check(x, (8, 1024, 4, "packed"), False)
    _check(x, (64, 64, 4, "packed"), True)
    assert not P.fp4_packed_ok(x, False) and P.fp4_packed_ok(x.bfloat16(), True)
    assert not P.fp4_packed_ok(x[:40].bfloat16(), True) and P.fp4_packed_ok(x[:40].bfloat16(), False)


def test_packed_compiles_for_sm90(request):
    """Compile both kernels for sm_90 (no GPU): bf16x2 arithmetic in the SASS, no local memory."""
    if rerun_outside_interpreter(request):
        return
    x = torch.empty(4096, 7168, dtype=torch.bfloat16)
    kernels = sm90_kernels(lambda: (fp4_quant_launch(x, True, tile=(8, 1024, 4, "packed")),
                                    fp4_quant_launch(x, True, with_trans=True, tile=(64, 128, 4, "packed"))))
    assert [k[0] for k in kernels] == ["_quant_mxfp4_packed_kernel", "_quant_mxfp4_packed_dual_kernel"]
    for _, err, st, ins in kernels:
        assert err is None, err
        assert st["spill"] == ("0", "0"), st
        sass = "\n".join(ins)
        assert re.search(r"HFMA2\.BF16", sass) and "HMNMX2" in sass and "LDL" not in sass and "STL" not in sass


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 7168), (96, 160)])
def test_packed_gpu_matches_reference(shape):
    x = _special(*shape, "cuda", seed=3)
    for tile in ((8, 1024, 4, "packed"), (16, 1024, 8, "packed"), (4, 64, 4, "packed")):
        _check(x, tile, False)
    for tile in ((64, 128, 4, "packed"), (32, 256, 4, "packed"), (128, 64, 4, "packed"), (32, 128, 1, "packed"),
                 (32, 64, 1, "packed"), (64, 128, 2, "packed")):
        _check(x, tile, True)
