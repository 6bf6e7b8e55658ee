"""The Gluon two-copy FP8 quantizer candidate, MX and BLOCKWISE
(primus_turbo/triton/quantization/quant_fp8_dual_gluon.py).

CPU: what it refuses (with reasons), the opt-in switch, and the sm_90 compile (in a child process
outside the interpreter): no spills, no local memory, no shared-memory stores (the tile arrives by
TMA and both block reductions are in-thread), 16-byte global stores for both copies.
GPU: bit for bit against quant_ref and the bf16-pair kernel (special values, ragged tails, poisoned
outputs), and the op's route under ``PRIMUS_TURBO_FP8_DUAL_GLUON=1``.
"""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.testing import quant_ref as R
from primus_turbo.triton import is_interpreter
from primus_turbo.triton.quantization import quant_fp8_dual_gluon as D
from primus_turbo.triton.quantization import quant_fp8_kernel as F8

from .gluon_compile_child import compile_check_module, rerun_outside_interpreter, warmup_for_sm90
from .quant_special_helpers import code_bits as _bits
from .quant_special_helpers import special_fp8_input as _special

E4M3 = torch.float8_e4m3fn
ROW, COL = F8.QuantGrouping(1, 1, 32), F8.QuantGrouping(1, 32, 1)
BW_ROW, BW_COL = F8.QuantGrouping(0, 1, 128), F8.QuantGrouping(0, 128, 1)
GROUPINGS = {"mx": (ROW, COL, G.MX_BLOCKWISE), "blockwise": (BW_ROW, BW_COL, G.BLOCKWISE)}
needs_gluon = pytest.mark.skipif(not D.GLUON_AVAILABLE, reason="triton.experimental.gluon not importable")
sm90_gpu = pytest.mark.skipif(
    not D.GLUON_AVAILABLE or is_interpreter() or not torch.cuda.is_available()
    or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 (Hopper) GPU")


@needs_gluon
def test_reasons():
    x = torch.randn(256, 512).to(torch.bfloat16)
    assert "sm_90" in D.fp8_dual_gluon_reason(x, E4M3, ROW, COL)  # CPU tensors
    assert "bfloat16" in D.fp8_dual_gluon_reason(x.float(), E4M3, ROW, COL)
    assert "E4M3" in D.fp8_dual_gluon_reason(x, torch.float8_e5m2, ROW, COL)
    rowwise = (F8.QuantGrouping(0, 1, 512), F8.QuantGrouping(0, 256, 1))
    assert "BLOCKWISE" in D.fp8_dual_gluon_reason(x, E4M3, *rowwise)
    assert "BLOCKWISE" in D.fp8_dual_gluon_reason(x, E4M3, ROW, BW_COL)  # mixed groupings
    assert "sm_90" in D.fp8_dual_gluon_reason(x, E4M3, BW_ROW, BW_COL)
    assert "empty" in D.fp8_dual_gluon_reason(x[:0], E4M3, ROW, COL)
    assert "aligned" in D.fp8_dual_gluon_reason(x[:, 1:], E4M3, ROW, COL)
    assert "aligned" in D.fp8_dual_gluon_reason(torch.randn(64, 36).to(torch.bfloat16), E4M3, ROW, COL)
    with pytest.raises(ValueError, match="fp8_dual_gluon: "):
        D.fp8_dual_gluon(x.float(), E4M3, ROW, COL)


@needs_gluon
@pytest.mark.parametrize("kind,shape,grid,even", [("mx", (200, 136), 2 * 5, False), ("mx", (256, 64), 2 * 2, True),
                                                  ("blockwise", (256, 512), 2 * 4, True),
                                                  ("blockwise", (200, 136), 2 * 2, False)])
def test_launcher_arguments(kind, shape, grid, even, monkeypatch):
    """The launcher's grid, outputs and constants for each grouping (the launch itself stubbed)."""
    row, col, _ = GROUPINGS[kind]
    g = row.gc
    seen = []
    monkeypatch.setattr(D, "fp8_dual_gluon_reason", lambda *a: None)
    monkeypatch.setattr(D, "launch", lambda kernel, grid, args, kwargs, device: seen.append((kernel, grid, args, kwargs)))
    rows, cols = shape
    q, s, qt, st = D.fp8_dual_gluon(torch.randn(rows, cols).to(torch.bfloat16), E4M3, row, col)
    (kernel, got_grid, args, kwargs), = seen
    assert kernel is (D._fp8_dual_mx_gluon_kernel if kind == "mx" else D._fp8_dual_blockwise_gluon_kernel)
    assert got_grid == (grid,) and kwargs["EVEN"] is even and kwargs["FP8_MAX"] == 448.0  # grid: every tile
    assert kwargs["STAGES"] == (D.MX_LAUNCH if kind == "mx" else D.BW_LAUNCH)[0]
    assert kwargs.get("EMAX") == (8 if kind == "mx" else None)
    assert args[0].block_shape == ([128, 32] if kind == "mx" else [128, 64])
    assert (q.shape, qt.shape) == ((rows, cols), (cols, rows)) and q.dtype == qt.dtype == E4M3
    sdt = torch.uint8 if kind == "mx" else torch.float32
    assert (s.shape, st.shape, s.dtype, st.dtype) == ((rows, -(-cols // g)), (cols, -(-rows // g)), sdt, sdt)
    assert args[5:] == (rows, cols, grid, -(-cols // g), -(-cols // g), -(-rows // g))


@needs_gluon
def test_persistent_grid(monkeypatch):
    """More tiles than ctas_per_sm x SMs: the grid is that many persistent programs."""
    seen = []
    monkeypatch.setattr(D, "fp8_dual_gluon_reason", lambda *a: None)
    monkeypatch.setattr(D, "launch", lambda kernel, grid, args, kwargs, device: seen.append((grid, args, kwargs)))
    x = torch.randn(4096, 1024).to(torch.bfloat16)  # 32 x 32 MX tiles, 32 x 8 BLOCKWISE tiles
    D.fp8_dual_gluon(x, E4M3, ROW, COL, stages=3, ctas_per_sm=2)
    D.fp8_dual_gluon(x, E4M3, BW_ROW, BW_COL)
    (g_mx, a_mx, k_mx), (g_bw, a_bw, k_bw) = seen
    assert g_mx == (2 * 132,) and a_mx[7] == 32 * 32 and k_mx["STAGES"] == 3
    assert g_bw == (min(32 * 8, D.BW_LAUNCH[1] * 132),) and a_bw[7] == 32 * 8
    with pytest.raises(ValueError, match="stages"):
        D.fp8_dual_gluon(x, E4M3, ROW, COL, stages=0)


def test_switch(monkeypatch):
    monkeypatch.delenv(D.FP8_DUAL_GLUON_ENV, raising=False)
    assert D.fp8_dual_gluon_enabled() is False  # opt-in until validated on a GPU
    monkeypatch.setenv(D.FP8_DUAL_GLUON_ENV, "1")
    assert D.fp8_dual_gluon_enabled() is True
    monkeypatch.setenv(D.FP8_DUAL_GLUON_ENV, "0")
    assert D.fp8_dual_gluon_enabled() is False
    monkeypatch.setenv(D.FP8_DUAL_GLUON_ENV, "maybe")
    with pytest.raises(ValueError, match="maybe"):
        D.fp8_dual_gluon_enabled()


@needs_gluon
@pytest.mark.parametrize("kind", ["mx", "blockwise"])
@pytest.mark.parametrize("rows,cols", [(4096, 7168), (200, 136)])
def test_compiles_for_sm90(kind, rows, cols, monkeypatch, request):
    if rerun_outside_interpreter(request):
        return
    import os
    import re

    import triton

    x = torch.empty(rows, cols, dtype=torch.bfloat16)
    g, tc, sdt = (32, 32, torch.uint8) if kind == "mx" else (128, 128, torch.float32)
    n_sc, n_str, n_tc = -(-cols // g), -(-rows // g), -(-cols // tc)
    n_tiles = -(-rows // 128) * n_tc
    stages = (D.MX_LAUNCH if kind == "mx" else D.BW_LAUNCH)[0]
    outs = (torch.empty(rows, cols, dtype=torch.uint8), torch.empty(rows, n_sc, dtype=sdt),
            torch.empty(cols, rows, dtype=torch.uint8), torch.empty(cols, n_str, dtype=sdt))
    even = rows % 128 == 0 and cols % tc == 0
    if kind == "mx":
        desc = D._desc_unchecked(x, [rows, cols], [x.stride(0), 1], [128, 32], D._smem_layout())
        k = warmup_for_sm90(D._fp8_dual_mx_gluon_kernel, (desc, *outs, rows, cols, n_tiles, n_tc, n_sc, n_str),
                            dict(FP8_MAX=448.0, EMAX=8, EVEN=even, STAGES=stages, num_warps=2), monkeypatch)
    else:
        desc = D._desc_unchecked(x, [rows, cols], [x.stride(0), 1], [128, 64], D._smem_layout(64))
        k = warmup_for_sm90(D._fp8_dual_blockwise_gluon_kernel,
                            (desc, *outs, rows, cols, n_tiles, n_tc, n_sc, n_str),
                            dict(FP8_MAX=448.0, EVEN=even, STAGES=stages, num_warps=4), monkeypatch)
    cc = compile_check_module()
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    try:
        report = cc._ptxas_report(k.asm["ptx"], ptxas)
        sass = cc._sass(k.asm["cubin"], os.path.join(os.path.dirname(ptxas), "cuobjdump"))
    except FileNotFoundError as exc:
        pytest.skip(f"ptxas / cuobjdump not available: {exc}")
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report
    assert "STL" not in sass and "LDL" not in sass and re.search(r"\bSTS", sass) is None
    assert "SHFL.IDX" not in sass  # the codes' layout conversion only renames registers
    if even:
        # MX: 2 rows x 32 code bytes + 2 columns x 32 bytes per thread; BLOCKWISE: a row's 128 bytes
        # + 2 halves x 2 columns x 32 bytes: all as 16-byte stores
        assert len(re.findall(r"STG\.E\.128", sass)) == (8 if kind == "mx" else 16), sass.count("STG")
    # the ring (MX 8 KB, BLOCKWISE 32 KB a stage) and its barriers
    assert k.metadata.shared <= stages * (8192 if kind == "mx" else 32768) + 1024, k.metadata.shared
    # at most ctas_per_sm programs' registers fit an SM's 64 K
    nregs = k.n_regs if hasattr(k, "n_regs") else None
    if nregs:
        ctas = (D.MX_LAUNCH if kind == "mx" else D.BW_LAUNCH)[1]
        assert ctas * nregs * 32 * (2 if kind == "mx" else 4) <= 65536, nregs


def _poisoned(rows, cols, g, sdt):
    n_sc, n_str = -(-cols // g), -(-rows // g)

    def full(shape, dt):
        t = torch.full(shape, 0x55, dtype=torch.uint8, device="cuda")
        return t.view(E4M3) if dt is E4M3 else t if dt is torch.uint8 else t.float().fill_(float("nan"))
    return full((rows, cols), E4M3), full((rows, n_sc), sdt), full((cols, rows), E4M3), full((cols, n_str), sdt)


@sm90_gpu
@pytest.mark.parametrize("kind", ["mx", "blockwise"])
@pytest.mark.parametrize("rows,cols", [(256, 512), (200, 136), (128, 32), (130, 40), (1024, 7168), (992, 7160)])
def test_gpu_bit_exact(kind, rows, cols):
    row, col, gran = GROUPINGS[kind]
    x = _special(rows, cols, "cuda")
    got = D.fp8_dual_gluon(x, E4M3, row, col, out=_poisoned(rows, cols, row.gc,
                                                            torch.uint8 if kind == "mx" else torch.float32))
    xc = x.cpu()
    ref = (*R.quantize_fp8_ref(xc, E4M3, gran), *R.quantize_fp8_ref(xc.t().contiguous(), E4M3, gran))
    for name, o, r in zip(("q", "s", "qt", "st"), got, ref):
        assert tuple(o.shape) == tuple(r.shape), name
        assert torch.equal(_bits(o.cpu()), _bits(r)), (name, int((_bits(o.cpu()) != _bits(r)).sum()))
    pair = F8.fp8_quant_with_trans_launch(x, E4M3, row, col)  # the default (bf16-pair) kernel
    for name, o, p in zip(("q", "s", "qt", "st"), got, pair):
        assert torch.equal(_bits(o), _bits(p)), name


@sm90_gpu
@pytest.mark.parametrize("kind", ["mx", "blockwise"])
def test_gpu_op_route(kind, monkeypatch):
    """The op takes the candidate under the switch and returns the same bytes as without it."""
    ROW, COL, _ = GROUPINGS[kind]
    x = torch.randn(512, 1024, device="cuda").to(torch.bfloat16)
    monkeypatch.setenv(D.FP8_DUAL_GLUON_ENV, "0")
    want = F8.fp8_quant_with_trans_launch(x, E4M3, ROW, COL)
    calls = []
    real = D.fp8_dual_gluon
    monkeypatch.setattr(D, "fp8_dual_gluon", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv(D.FP8_DUAL_GLUON_ENV, "1")
    got = F8.fp8_quant_with_trans_launch(x, E4M3, ROW, COL)
    assert calls == [1]
    for o, w in zip(got, want):
        assert torch.equal(o.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
