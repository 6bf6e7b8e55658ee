"""The bf16-pair two-copy FP8 quantizer (primus_turbo/triton/quantization/quant_fp8_packed.py).

* The PTX code sequence through its numpy model (emulate_codes) on every bf16 bit pattern and
  several multipliers, against torch's fp32 -> E4M3 conversion of the clamped product.
* The kernel in the interpreter (its SOFT branch, same data flow) against quant_ref: BLOCKWISE
  and MX, even and ragged tiles, zero / inf / NaN / subnormal blocks.
* The sm_90 compile (no GPU; in a child process outside the interpreter): "packed2" stores the
  row-wise words without a shared-memory conversion (fewer STS and instructions than "packed").
* On a GPU: the PTX path against quant_ref.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.testing import quant_ref as R
from primus_turbo.triton import is_interpreter
from primus_turbo.triton.quantization import quant_fp8_kernel as F8
from primus_turbo.triton.quantization import quant_fp8_packed as P

from .gluon_compile_child import rerun_outside_interpreter
from .quant_special_helpers import code_bits as _bits
from .quant_special_helpers import sm90_kernels
from .quant_special_helpers import special_fp8_input as _special

_ALL = np.arange(65536, dtype=np.uint32)
E4M3 = torch.float8_e4m3fn


def _torch_codes(x_bits: np.ndarray, m: float) -> np.ndarray:
    x = torch.from_numpy((x_bits << 16).astype(np.uint32).view(np.float32).copy())
    y = (x * torch.tensor(m, dtype=torch.float32)).clamp(-448.0, 448.0)
    return y.to(E4M3).view(torch.uint8).numpy()


@pytest.mark.parametrize("m", [1.0, 2.0 ** -3, 2.0 ** 7, 448.0 / 3.0, 448.0 / 1e-30, 1.7, 2.0 ** 100])
def test_emulated_codes_exhaustive(m):
    mb = np.float32(m).view(np.uint32)
    h = _ALL.reshape(-1, 4, 4)  # [group, quarter k, element j]
    p0 = [(h[:, k, 0] | (h[:, k, 1] << 16)).astype(np.uint32) for k in range(4)]
    p1 = [(h[:, k, 2] | (h[:, k, 3] << 16)).astype(np.uint32) for k in range(4)]
    mm = [np.full(h.shape[0], mb, dtype=np.uint32)] * 4
    rows, cols = P.emulate_codes(p0, p1, mm, mm)
    want = _torch_codes(_ALL, m).reshape(-1, 4, 4)
    nan = ((_ALL & 0x7FFF) > 0x7F80).reshape(-1, 4, 4)
    want = np.where(nan, 0x7F, want)  # cvt.rn.satfinite: NaN -> 0x7F (quant_ref's code)
    for k in range(4):
        got = np.stack([(rows[k] >> (8 * j)) & 0xFF for j in range(4)], 1)
        assert np.array_equal(got, want[:, k, :]), k
    for j in range(4):
        got = np.stack([(cols[j] >> (8 * k)) & 0xFF for k in range(4)], 1)
        assert np.array_equal(got, want[:, :, j]), j


def test_ptx_text():
    assert P.CODES_PTX.count("cvt.rn.satfinite.e4m3x2.f32") == 16
    assert P.CODES_PTX.count("mul.rn.f32") == 32


def _check(x, mx, cfg):
    row = F8.QuantGrouping(1, 1, 32) if mx else F8.QuantGrouping(0, 1, 128)
    col = F8.QuantGrouping(1, 32, 1) if mx else F8.QuantGrouping(0, 128, 1)
    gran = G.MX_BLOCKWISE if mx else G.BLOCKWISE
    assert P.fp8_packed_ok(x, E4M3, row, col, cfg)
    outs = F8.fp8_quant_with_trans_launch(x, E4M3, row, col, tile=cfg)
    xc = x.cpu()
    ref = (*R.quantize_fp8_ref(xc, E4M3, gran), *R.quantize_fp8_ref(xc.t().contiguous(), E4M3, gran))
    for o, r in zip(outs, ref):
        assert tuple(o.shape) == tuple(r.shape)
        assert torch.equal(_bits(o.cpu()), _bits(r)), int((_bits(o.cpu()) != _bits(r)).sum())


_CASES = [
    (False, (256, 256), (128, 128, 4, "packed")),
    (False, (200, 260), (128, 128, 4, "packed")),
    (False, (128, 384), (128, 256, 8, "packed")),
    (True, (256, 256), (128, 128, 4, "packed")),
    (True, (96, 224), (64, 128, 4, "packed")),
    (True, (64, 128), (32, 256, 4, "packed")),
    # packed2: the row-wise words stored from their own layout (same data flow)
    (False, (256, 256), (128, 128, 4, "packed2")),
    (False, (200, 260), (128, 128, 4, "packed2")),
    (True, (96, 224), (64, 128, 4, "packed2")),
    # packed3 (TC = 128): also the column words without the shared-memory transpose
    (False, (256, 256), (128, 128, 4, "packed3")),
    (False, (200, 260), (128, 128, 4, "packed3")),
    (False, (128, 384), (128, 128, 4, "packed3")),
    (True, (96, 224), (64, 128, 4, "packed3")),
    (True, (128, 256), (128, 128, 4, "packed3")),
    (True, (64, 128), (32, 128, 4, "packed3")),
    # BLOCKWISE scales formed in registers (no scratch)
    (False, (256, 256), (128, 128, 4, "packed2", 0, "inreg")),
    (False, (200, 260), (128, 128, 8, "packed2", 0, "inreg")),
    (False, (384, 256), (128, 128, 4, "packed2", 168, "inreg")),
    # one- and two-warp programs (reductions and the transpose inside a warp or a warp pair; slower on
    # the H200 than the defaults, session 32, and kept here as the smallest programs the kernel takes)
    (True, (96, 224), (32, 128, 1, "packed2")),
    (True, (96, 160), (32, 64, 1, "packed2")),
    (True, (128, 256), (64, 128, 2, "packed2")),
    (False, (256, 260), (128, 128, 2, "packed2", 0, "inreg")),
    # scales stored transposed (whole sectors per tile), returned as transposed views
    (True, (256, 256), (128, 128, 4, "packed2", 0, "tscale")),
    (True, (96, 224), (64, 128, 4, "packed2", 0, "tscale")),
    (False, (256, 256), (128, 128, 4, "packed2", 0, "inreg,tscale")),
    (False, (200, 260), (128, 128, 4, "packed2", 0, "inreg,tscale")),
]


@pytest.mark.skipif(not is_interpreter(), reason="interpreter (SOFT) path; the GPU test runs the PTX")
@pytest.mark.parametrize("mx,shape,cfg", _CASES)
def test_interpreter_vs_ref(mx, shape, cfg):
    _check(_special(*shape, "cpu"), mx, cfg)


@pytest.mark.skipif(not torch.cuda.is_available() or is_interpreter(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mx,shape,cfg", _CASES + [(False, (1024, 7168), (128, 128, 4, "packed", 168)),
                                                  (True, (1024, 7168), (64, 128, 4, "packed")),
                                                  (False, (1024, 7168), (128, 128, 4, "packed2", 168)),
                                                  (False, (1024, 7168), (128, 128, 4, "packed2", 168, "inreg")),
                                                  (False, (1000, 7164), (128, 128, 4, "packed2", 168, "inreg")),
                                                  (True, (1024, 7168), (128, 128, 4, "packed2", 168)),
                                                  (False, (1024, 7168), (128, 128, 4, "packed3", 168)),
                                                  (False, (1000, 7164), (128, 128, 4, "packed3")),
                                                  # MX quantizes 32-row column blocks: a row count
                                                  # that is a multiple of 32 but not of the 64-row tile
                                                  (True, (992, 7168), (64, 128, 4, "packed3")),
                                                  (True, (1024, 7168), (32, 128, 1, "packed2")),
                                                  (True, (992, 7136), (32, 64, 1, "packed2")),
                                                  (True, (1024, 7168), (128, 128, 4, "packed2", 0, "tscale")),
                                                  (True, (992, 7136), (128, 128, 4, "packed2", 0, "tscale")),
                                                  (False, (1000, 7164), (128, 128, 4, "packed2", 168,
                                                                         "inreg,tscale")),
                                                  (False, (1024, 7168), (128, 128, 4, "packed2", 128,
                                                                         "inreg,tscale")),
                                                  (False, (1000, 7164), (128, 128, 4, "packed2", 128,
                                                                         "inreg,tscale"))])
def test_gpu_vs_ref(mx, shape, cfg):
    _check(_special(*shape, "cuda"), mx, cfg)


def test_unknown_option_raises():
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    row, col = F8.QuantGrouping(0, 1, 128), F8.QuantGrouping(0, 128, 1)
    with pytest.raises(ValueError, match="unknown pair-kernel options"):
        P.fp8_packed_with_trans_launch(x, E4M3, row, col, (128, 128, 4, "packed2", 0, "inreg,fast"))


def test_packed3_only_128_column_tiles():
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    bw = F8.QuantGrouping(0, 1, 128), F8.QuantGrouping(0, 128, 1)
    mx = F8.QuantGrouping(1, 1, 32), F8.QuantGrouping(1, 32, 1)
    for g in (bw, mx):
        assert P.fp8_packed_ok(x, E4M3, *g, (128, 128, 4, "packed3"))
        assert F8._dual_ok(256, 256, *g, (128, 128, 4, "packed3"))
        assert not P.fp8_packed_ok(x, E4M3, *g, (128, 256, 8, "packed3"))
        assert not F8._dual_ok(256, 256, *g, (128, 256, 8, "packed3"))


def test_not_covered_falls_back():
    x = torch.zeros(64, 64, dtype=torch.float32)
    row, col = F8.QuantGrouping(0, 1, 128), F8.QuantGrouping(0, 128, 1)
    assert not P.fp8_packed_ok(x, E4M3, row, col, (128, 128, 4, "packed"))


def test_packed2_compiles_with_fewer_shared_stores(request):
    """sm_90 compile (no GPU): "packed2" issues fewer STS and instructions than "packed", and
    "packed3" fewer than "packed2", no spills (a lost contiguity hint would bring the
    shared-memory conversions back silently)."""
    if rerun_outside_interpreter(request):
        return
    x = torch.empty(4096, 7168, dtype=torch.bfloat16)
    for mx in (False, True):
        row = F8.QuantGrouping(1, 1, 32) if mx else F8.QuantGrouping(0, 1, 128)
        col = F8.QuantGrouping(1, 32, 1) if mx else F8.QuantGrouping(0, 128, 1)
        counts = []
        for tag in ("packed", "packed2", "packed3"):
            tile = (64 if mx else 128, 128, 4, tag)
            ((_, err, st, ins),) = sm90_kernels(lambda: F8.fp8_quant_with_trans_launch(x, E4M3, row, col, tile=tile))
            assert err is None, err
            assert st["spill"] == ("0", "0"), st
            counts.append((len(ins), sum(1 for ln in ins if " STS" in ln)))
        for a, b in zip(counts, counts[1:]):
            assert b[0] < a[0] and b[1] < a[1], (mx, counts)
