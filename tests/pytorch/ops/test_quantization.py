"""FP8 / MXFP4 quantization: Triton kernels bit-exact against primus_turbo.testing.quant_ref, the
reference checked against first principles, special values, error paths, empty inputs, compile.

On a machine without CUDA the ops run the Triton kernels through the interpreter (conftest sets
TRITON_INTERPRET=1), so every comparison below is kernel vs reference.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.core.low_precision import ScalingRecipe
from primus_turbo.pytorch.ops import quantization as Q
from primus_turbo.testing.quant_ref import (
    dequantize_fp4_ref,
    dequantize_fp8_ref,
    fp8_max,
    quantize_fp4_ref,
    quantize_fp8_ref,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 32), (7, 96), (64, 160), (130, 256)]
R2D = ScalingRecipe(use_2d_block=True)

# (id, granularity, kwargs for quantize_fp8 / the reference)
CASES = [
    ("tensorwise", G.TENSORWISE, {}),
    ("rowwise", G.ROWWISE, {"axis": -1}),
    ("rowwise_ax0", G.ROWWISE, {"axis": 0}),
    ("block1x128", G.BLOCKWISE, {"axis": -1}),
    ("block1x128_ax0", G.BLOCKWISE, {"axis": 0}),
    ("block1x32", G.BLOCKWISE, {"axis": -1, "block_size": 32}),
    ("block128x128", G.BLOCKWISE, {"scaling_recipe": R2D}),
    ("mx", G.MX_BLOCKWISE, {"axis": -1}),
    ("mx_ax0", G.MX_BLOCKWISE, {"axis": 0}),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Bit equality, except that NaN positions only have to agree (a NaN's sign is unspecified)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype in (E4M3, E5M2, torch.float32, torch.bfloat16, torch.float16):
        na, nb = torch.isnan(a.float()), torch.isnan(b.float())
        assert torch.equal(na, nb), f"{what}: NaN positions differ"
        ba, bb = _bits(a).clone(), _bits(b).clone()
        ba[na], bb[nb] = 0, 0
    else:
        ba, bb = _bits(a), _bits(b)
    if not torch.equal(ba, bb):
        n = (ba != bb).sum().item()
        idx = (ba != bb).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {n} of {ba.numel()} differ, first at {idx}")


def _sample(shape, dtype, device, seed=0):
    """Normal values with per-row magnitudes spread over ~2**-10..2**10, so blocks see varied scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x * torch.exp2(torch.randint(-10, 11, (shape[0], 1), generator=g).float())
    return x.to(dtype).to(device)


def _case_ok(gran, kw, shape):
    ax = kw.get("axis", -1)
    if gran == G.MX_BLOCKWISE:
        return (shape[0] if ax == 0 else shape[1]) % 32 == 0
    return True


# ---- kernels vs reference -------------------------------------------------------------------
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("out_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_quantize_fp8_bitexact(case, out_dtype, in_dtype, device):
    _, gran, kw = case
    for i, shape in enumerate(SHAPES):
        if not _case_ok(gran, kw, shape):
            continue
        x = _sample(shape, in_dtype, device, seed=i)
        q, s = Q.quantize_fp8(x, out_dtype, gran, **kw)
        q_ref, s_ref = quantize_fp8_ref(x, out_dtype, gran, **kw)
        assert_bits_equal(q, q_ref, f"data {shape}")
        assert_bits_equal(s, s_ref, f"scale {shape}")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dequantize_fp8_bitexact(case, out_dtype, device):
    _, gran, kw = case
    shape = (64, 160)
    for fp8 in FP8:
        x = _sample(shape, torch.bfloat16, device, seed=3)
        q, s = Q.quantize_fp8(x, fp8, gran, **kw)
        d = Q.dequantize_fp8(q, out_dtype, gran, scale_inv=s, **kw)
        d_ref = dequantize_fp8_ref(q, s, gran, out_dtype=out_dtype, **kw)
        assert_bits_equal(d, d_ref, f"dequant {fp8}")


WT_CASES = [
    ("tensorwise", G.TENSORWISE, {}),
    ("rowwise", G.ROWWISE, {}),
    ("block1x128", G.BLOCKWISE, {}),
    ("block1x64", G.BLOCKWISE, {"block_size": 64}),
    ("block128x128", G.BLOCKWISE, {"scaling_recipe": R2D}),
    ("block2d_row_1d_col", G.BLOCKWISE, {"scaling_recipe": R2D, "scaling_recipe_for_trans": ScalingRecipe()}),
    ("mx", G.MX_BLOCKWISE, {}),
]


@pytest.mark.parametrize("out_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", WT_CASES, ids=[c[0] for c in WT_CASES])
def test_quantize_fp8_with_trans_matches_two_quantizations(case, out_dtype, device):
    _, gran, kw = case
    shapes = [(64, 160), (32, 96)] if gran == G.MX_BLOCKWISE else [(7, 96), (130, 256)]
    rec = kw.get("scaling_recipe")
    rec_t = kw.get("scaling_recipe_for_trans", rec)
    bs = kw.get("block_size")
    for in_dtype, shape in zip((torch.bfloat16, torch.float32), shapes):
        x = _sample(shape, in_dtype, device, seed=7)
        q, s, qt, st = Q.quantize_fp8_with_trans(x, out_dtype, gran, **kw)
        q_ref, s_ref = quantize_fp8_ref(x, out_dtype, gran, block_size=bs, scaling_recipe=rec)
        qt_ref, st_ref = quantize_fp8_ref(x.t().contiguous(), out_dtype, gran, block_size=bs, scaling_recipe=rec_t)
        assert qt.shape == (shape[1], shape[0]) and qt.is_contiguous()
        assert_bits_equal(q, q_ref, "row copy")
        assert_bits_equal(s, s_ref, "row scale")
        assert_bits_equal(qt, qt_ref, "col copy")
        assert_bits_equal(st, st_ref, "col scale")
    if rec is not None and rec.use_2d_block and rec_t is rec:
        torch.testing.assert_close(st, s.t().contiguous(), rtol=0, atol=0)  # transposed scale grid


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_quantize_fp4_bitexact(in_dtype, device):
    for axis, shape in ((-1, (7, 96)), (-1, (64, 160)), (0, (64, 160)), (0, (32, 7))):
        x = _sample(shape, in_dtype, device, seed=11)
        p, s = Q.quantize_fp4(x, axis=axis)
        p_ref, s_ref = quantize_fp4_ref(x, axis=axis)
        assert_bits_equal(p.view(torch.uint8), p_ref.view(torch.uint8), f"packed axis={axis} {shape}")
        assert_bits_equal(s, s_ref, f"scale axis={axis}")
        for out_dtype in (torch.float32, torch.bfloat16):
            d = Q.dequantize_fp4(p, out_dtype, scale_inv=s, axis=axis)
            assert_bits_equal(d, dequantize_fp4_ref(p_ref, s_ref, axis=axis, out_dtype=out_dtype), "fp4 dequant")


def test_quantize_fp4_with_trans(device):
    x = _sample((64, 96), torch.bfloat16, device, seed=5)
    p, s, pt, st = Q.quantize_fp4_with_trans(x)
    p_ref, s_ref = quantize_fp4_ref(x)
    pt_ref, st_ref = quantize_fp4_ref(x.t().contiguous())
    assert pt.shape == (96, 32) and st.shape == (96, 2)
    assert_bits_equal(p.view(torch.uint8), p_ref.view(torch.uint8))
    assert_bits_equal(s, s_ref)
    assert_bits_equal(pt.view(torch.uint8), pt_ref.view(torch.uint8))
    assert_bits_equal(st, st_ref)
    # both scale tensors column-major on every path (SR and RHT included, and under compile)
    assert s.t().is_contiguous() and st.t().is_contiguous(), (s.stride(), st.stride())
    for recipe in (ScalingRecipe(use_sr=True), ScalingRecipe(use_rht=True)):
        sg = Q.random_hadamard_signs(device=device) if recipe.use_rht else None
        _, s2, _, st2 = Q.quantize_fp4_with_trans(x, scaling_recipe=recipe, seed=3 if recipe.use_sr else None,
                                                  rht_signs=sg)
        assert s2.t().is_contiguous() and st2.t().is_contiguous(), (recipe, s2.stride(), st2.stride())
    got = torch.compile(lambda t: Q.quantize_fp4_with_trans(t), fullgraph=True, backend="aot_eager")(x)
    for g_, r_ in zip(got, (p, s, pt, st)):
        assert g_.stride() == r_.stride()
        assert_bits_equal(g_.view(torch.uint8), r_.view(torch.uint8))


# ---- the reference against first principles -------------------------------------------------
@pytest.mark.parametrize("out_dtype, mbits", [(E4M3, 3), (E5M2, 2)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_roundtrip_error(case, out_dtype, mbits):
    _, gran, kw = case
    x = _sample((64, 256), torch.float32, "cpu", seed=1)
    q, s = quantize_fp8_ref(x, out_dtype, gran, **kw)
    d = dequantize_fp8_ref(q, s, gran, **kw).double()
    xd = x.double()
    # elements whose scaled value x / scale_inv is a normal, unsaturated FP8 number (MX E4M3 blocks
    # may saturate: amax / 2**shared_exp lies in [256, 512)): RNE error <= half an ulp = 2**-(mbits+1)
    sinv = dequantize_fp8_ref(torch.ones_like(q), s, gran, **kw).double()
    scaled = (xd / sinv).abs()
    min_normal = 2.0 ** (-6 if out_dtype == E4M3 else -14)
    normal = (scaled >= min_normal) & (scaled <= fp8_max(out_dtype))
    assert normal.float().mean() > 0.5
    rel = ((d - xd).abs() / xd.abs())[normal]
    assert rel.max().item() <= 2.0 ** -(mbits + 1) * (1 + 1e-6)
    assert torch.isfinite(d).all()


@pytest.mark.parametrize("out_dtype", FP8, ids=["e4m3", "e5m2"])
def test_reference_tensorwise_scale_is_amax_over_max(out_dtype):
    x = _sample((16, 64), torch.float32, "cpu")
    _, s = quantize_fp8_ref(x, out_dtype, G.TENSORWISE)
    assert s.shape == () and s.dtype == torch.float32
    amax = x.abs().max().double()
    assert abs(s.double() * fp8_max(out_dtype) - amax) <= amax * 2.0 ** -22


@pytest.mark.parametrize("out_dtype, emax", [(E4M3, 8), (E5M2, 15)], ids=["e4m3", "e5m2"])
def test_reference_mx_scales_are_powers_of_two(out_dtype, emax):
    x = _sample((8, 256), torch.float32, "cpu")
    q, s = quantize_fp8_ref(x, out_dtype, G.MX_BLOCKWISE)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (8, 8)
    e = s.view(torch.uint8).long() - 127
    amax = x.abs().reshape(8, 8, 32).amax(-1).double()
    # shared_exp = floor(log2(amax)) - emax: amax / 2**shared_exp lies in [2**emax, 2**(emax+1))
    ratio = amax / torch.pow(2.0, e.double())
    assert ((ratio >= 2.0**emax) & (ratio < 2.0 ** (emax + 1))).all()
    d = dequantize_fp8_ref(q, s, G.MX_BLOCKWISE)
    assert torch.equal(s.float(), torch.pow(2.0, e.float()))  # torch's own E8M0 decoding agrees
    assert ((d.double() - x.double()).abs() <= amax.repeat_interleave(32, 1) * 2.0**-3).all()


def test_reference_hand_examples():
    x = torch.tensor([[0.5, -1.0, 2.0, 4.0]])
    q, s = quantize_fp8_ref(x, E4M3, G.TENSORWISE)  # amax 4: scale 448 / 4 = 112
    assert q.float().tolist() == [[56.0, -112.0, 224.0, 448.0]]
    assert s.item() == pytest.approx(1 / 112, rel=1e-7) and s.dtype == torch.float32
    # E4M3 rounding: 17 lies between 16 and 18 (ulp 2 in [16, 32)): a tie, to even -> 16
    q, _ = quantize_fp8_ref(torch.tensor([[17.0, 19.0, 448.0]]), E4M3, G.ROWWISE)
    assert q.float().tolist() == [[16.0, 20.0, 448.0]]
    # MX: amax 3 -> floor(log2 3) = 1 -> shared_exp = 1 - 8 = -7 -> byte 120; q = x * 128
    xm = torch.ones(1, 32)
    xm[0, 5] = 3.0
    q, s = quantize_fp8_ref(xm, E4M3, G.MX_BLOCKWISE)
    assert s.view(torch.uint8).item() == 120
    assert q[0, 0].item() == 128.0 and q[0, 5].item() == 384.0
    # MXFP4: amax 6 -> shared_exp 0 (byte 127); the midpoints go to the even code
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.3, -6.0, 0.0, -0.0]
    x4 = torch.zeros(1, 32)
    x4[0, : len(vals)] = torch.tensor(vals)
    p, s4 = quantize_fp4_ref(x4)
    assert s4.view(torch.uint8).item() == 127
    b = p.view(torch.uint8)[0].tolist()
    nib = [v for byte in b for v in (byte & 0xF, byte >> 4)]
    assert nib[:12] == [0, 2, 2, 4, 4, 6, 6, 7, 0x9, 0xF, 0x0, 0x8]
    d = dequantize_fp4_ref(p, s4)
    assert d[0, :12].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -6.0, 0.0, -0.0]


# ---- special values -------------------------------------------------------------------------
def _special_input(device):
    x = _sample((4, 256), torch.float32, "cpu", seed=2)
    x[0, :128] = 0.0  # a zero block
    x[1, 3] = float("inf")
    x[1, 200] = float("-inf")
    x[2, 7] = float("nan")
    x[3, :32] = torch.tensor([448.0, 447.9, -460.0] + [1.0] * 29)  # near/above FP8_MAX
    x[3, 32:64] = 1e-3  # subnormal after scaling by an amax of ~448 (E4M3 min normal 2**-6)
    x[3, 33] = 448.0
    x[3, 64:96] = 1e-40  # fp32 subnormals: FP8_MAX / amax overflows, the scale is capped at FLT_MAX
    return x.to(device)


@pytest.mark.parametrize("out_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("tensorwise", "rowwise", "block1x128", "block1x32",
                                                                "mx", "block128x128")], ids=lambda c: c[0])
def test_special_values_kernel_matches_reference(case, out_dtype, device):
    _, gran, kw = case
    x = _special_input(device)
    q, s = Q.quantize_fp8(x, out_dtype, gran, **kw)
    q_ref, s_ref = quantize_fp8_ref(x.cpu(), out_dtype, gran, **kw)
    assert_bits_equal(q.cpu(), q_ref, "data")
    assert_bits_equal(s.cpu(), s_ref, "scale")
    d = Q.dequantize_fp8(q, torch.float32, gran, scale_inv=s, **kw)
    assert_bits_equal(d.cpu(), dequantize_fp8_ref(q_ref, s_ref, gran, **kw), "dequant")


def test_special_values_semantics():
    fmax = fp8_max(E4M3)
    x = _special_input("cpu")
    q, s = quantize_fp8_ref(x, E4M3, G.BLOCKWISE, block_size=32)
    assert s[0, 0].item() == 1.0 and (q[0, :128].float() == 0).all()  # zero block: scale_inv 1
    assert s[1, 0].item() == 1.0 and q[1, 3].item() == fmax  # inf: block unscaled, saturates
    assert q[1, 200].item() == -fmax and s[1, 6].item() == 1.0
    assert torch.isnan(q[2, 7].float()) and s[2, 0].item() == 1.0  # NaN stays NaN, block unscaled
    assert q[3, 0].item() == fmax and q[3, 2].item() == -fmax  # 448 -> 448, -460 saturates
    sub = q[3, 34].float().item()  # 1e-3 * 448 / 448 = 1e-3: an E4M3 subnormal (multiple of 2**-9)
    assert 0 < sub < 2.0**-6 and (sub / 2.0**-9).is_integer()
    assert torch.isfinite(q[3, 64:96].float()).all() and (q[3, 64:96].float() > 0).all()
    assert s[3, 2].item() == pytest.approx(1 / torch.finfo(torch.float32).max, rel=1e-6)
    # MX: zero block -> byte 0 (shared_exp -127); inf/NaN blocks -> 0xFF, elements cast unscaled
    qm, sm = quantize_fp8_ref(x, E4M3, G.MX_BLOCKWISE)
    b = sm.view(torch.uint8)
    assert b[0, 0].item() == 0 and b[1, 0].item() == 255 and b[1, 6].item() == 255 and b[2, 0].item() == 255
    assert qm[1, 3].item() == fmax and torch.isnan(qm[2, 7].float())
    assert qm[2, 8].item() == x[2, 8].to(E4M3).item()  # unscaled neighbour of the NaN
    dm = dequantize_fp8_ref(qm, sm, G.MX_BLOCKWISE)
    assert torch.isnan(dm[1, :32]).all() and not torch.isnan(dm[1, 32:64]).any()


def test_special_values_fp4(device):
    x = _special_input(device)
    p, s = Q.quantize_fp4(x)
    p_ref, s_ref = quantize_fp4_ref(x.cpu())
    assert_bits_equal(p.view(torch.uint8).cpu(), p_ref.view(torch.uint8), "fp4 data")
    assert_bits_equal(s.cpu(), s_ref, "fp4 scale")
    b = s_ref.view(torch.uint8)
    assert b[0, 0].item() == 0 and b[1, 0].item() == 255 and b[2, 0].item() == 255
    nib1 = p_ref.view(torch.uint8)[1, 1].item() >> 4  # element 3: +inf, unscaled, saturates to +6
    assert nib1 == 0x7


@pytest.mark.parametrize("with_trans", [False, True])
def test_fp4_rounding_ties_and_boundaries(with_trans, device):
    # every block's amax is 6 (E8M0 scale 1), so values land on the E2M1 grid as given: the
    # midpoints between codes (ties to the even code), points just off them, the segment
    # boundaries 2 and 4, and both signs
    grid = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2499, 0.2501, 0.7499, 0.7501, 1.2499, 1.7501,
            2.4999, 2.5001, 3.4999, 3.5001, 4.9999, 5.0001, 2.0, 4.0, 6.0, 1.0, 0.5, 1.5, 3.0, 5.9999, 1.9999,
            3.9999, 0.1, 4.5]
    row = torch.tensor(grid, dtype=torch.float32)
    row[0] = 6.0  # the block amax
    x = torch.stack([row, -row, row.flip(0), -row.flip(0)] * 8).to(device)  # [32, 32]
    if with_trans:
        p, s, pt, st = Q.quantize_fp4_with_trans(x)
        pt_ref, st_ref = quantize_fp4_ref(x.t().contiguous().cpu())
        assert_bits_equal(pt.view(torch.uint8).cpu(), pt_ref.view(torch.uint8), "fp4 transposed data")
        assert_bits_equal(st.cpu(), st_ref, "fp4 transposed scale")
    else:
        p, s = Q.quantize_fp4(x)
    p_ref, s_ref = quantize_fp4_ref(x.cpu())
    assert_bits_equal(p.view(torch.uint8).cpu(), p_ref.view(torch.uint8), "fp4 data")
    assert_bits_equal(s.cpu(), s_ref, "fp4 scale")
    # decoded magnitudes of row 0: ties to even, neighbours to the nearer code
    d = Q.dequantize_fp4(p, torch.float32, scale_inv=s)[0].cpu()
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, 0.5, 1.0, 1.0, 2.0,
            2.0, 3.0, 3.0, 4.0, 4.0, 6.0, 2.0, 4.0, 6.0, 1.0, 0.5, 1.5, 3.0, 6.0, 2.0, 4.0, 0.0, 4.0]
    assert d.tolist() == want


# ---- API behaviour --------------------------------------------------------------------------
def test_nd_input_and_noncontiguous(device):
    x = _sample((6, 128), torch.bfloat16, device).reshape(2, 3, 128)
    q, s = Q.quantize_fp8(x, E4M3, G.BLOCKWISE, block_size=64)
    assert q.shape == (2, 3, 128) and s.shape == (2, 3, 2)
    q2, s2 = Q.quantize_fp8(x.reshape(6, 128), E4M3, G.BLOCKWISE, block_size=64)
    assert_bits_equal(q.reshape(6, 128), q2)
    assert_bits_equal(s.reshape(6, 2), s2)
    d = Q.dequantize_fp8(q, torch.float32, G.BLOCKWISE, block_size=64, scale_inv=s)
    assert d.shape == (2, 3, 128)
    qt, st = Q.quantize_fp8(x, E4M3, G.TENSORWISE)
    assert qt.shape == x.shape and st.shape == ()
    big = _sample((96, 64), torch.float32, device)
    xt = big.t()  # non-contiguous [64, 96]
    q, s = Q.quantize_fp8(xt, E5M2, G.MX_BLOCKWISE)
    q2, s2 = Q.quantize_fp8(xt.contiguous(), E5M2, G.MX_BLOCKWISE)
    assert_bits_equal(q, q2)
    assert_bits_equal(s, s2)


def test_long_rowwise_path(device):
    # rows longer than the tile kernel holds go through the two-pass kernel
    x = _sample((3, 20000), torch.bfloat16, device)
    q, s = Q.quantize_fp8(x, E4M3, G.ROWWISE)
    q_ref, s_ref = quantize_fp8_ref(x, E4M3, G.ROWWISE)
    assert_bits_equal(q, q_ref)
    assert_bits_equal(s, s_ref)
    x0 = _sample((300, 40), torch.float16, device)
    q, s = Q.quantize_fp8(x0, E5M2, G.ROWWISE, axis=0)
    q_ref, s_ref = quantize_fp8_ref(x0, E5M2, G.ROWWISE, axis=0)
    assert_bits_equal(q, q_ref)
    assert_bits_equal(s, s_ref)
    q, s, qt, st = Q.quantize_fp8_with_trans(x0, E4M3, G.ROWWISE)
    qt_ref, st_ref = quantize_fp8_ref(x0.t().contiguous(), E4M3, G.ROWWISE)
    assert_bits_equal(qt, qt_ref)
    assert_bits_equal(st, st_ref)


# ---- byte transpose (the GEMM ops' K-major copies) -------------------------------------------
# odd sizes (partial 64 x 64 tiles on both dims), a single element, an empty dim, batches
TRANSPOSE_SHAPES = [(1, 1), (65, 130), (3, 67, 129), (5, 0, 7), (2, 64, 64), (1, 200, 33)]


@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_transpose_bytes_kernel(shape, device):
    """dst[..., c, r] = src[..., r, c] exactly, 2-D and batched in one launch, any strides."""
    pytest.importorskip("triton")
    from primus_turbo.triton.quantization import transpose_bytes

    src = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    want = src.transpose(-2, -1)
    dst = torch.full(want.shape, 7, dtype=torch.uint8, device=device).contiguous()  # poisoned
    assert transpose_bytes(src, dst) is dst and torch.equal(dst, want)
    # strided source (a slice of a wider buffer) into a strided destination, FP8 and E8M0 views
    *lead, r, c = shape
    wide = torch.randint(0, 256, (*lead, r, 2 * c + 3), dtype=torch.uint8, device=device)
    src = wide[..., 1:2 * c + 1:2]
    out_buf = torch.zeros((*lead, c, r + 5), dtype=torch.uint8, device=device)
    dst = out_buf[..., 2:r + 2]
    transpose_bytes(src.view(E4M3), dst.view(torch.float8_e8m0fnu))
    assert torch.equal(dst, src.transpose(-2, -1))
    assert not out_buf[..., :2].any() and not out_buf[..., r + 2:].any()  # nothing written outside dst


def test_transpose_bytes_kernel_errors(device):
    pytest.importorskip("triton")
    from primus_turbo.triton.quantization import transpose_bytes

    src = torch.zeros(4, 6, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="transposed shape"):
        transpose_bytes(src, torch.empty(4, 6, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        transpose_bytes(src, torch.empty(1, 6, 4, dtype=torch.uint8, device=device))
    with pytest.raises(TypeError, match="1-byte"):
        transpose_bytes(src.half(), torch.empty(6, 4, dtype=torch.float16, device=device))


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_transpose_bytes_op_helper(interpret, monkeypatch, device):
    """The op layer's byte transpose: the kernel (CUDA, interpreter) or torch's copy elsewhere, same
    bytes; ``row_align`` pads the row stride of the result only."""
    if interpret == "0":
        if device != "cpu":
            pytest.skip("the reference path is the CPU one without the interpreter")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert Q.quant_backend(torch.zeros(1)) == "reference"
    x = torch.randint(0, 256, (3, 45, 70), dtype=torch.uint8, device=device).view(E5M2)
    t = Q._transpose_bytes(x)
    assert t.dtype == E5M2 and t.shape == (3, 70, 45) and t.is_contiguous()
    assert torch.equal(t.view(torch.uint8), x.view(torch.uint8).transpose(1, 2))
    t16 = Q._transpose_bytes(x[1], row_align=16)
    assert t16.shape == (70, 45) and t16.stride() == (48, 1)
    assert torch.equal(t16.view(torch.uint8), x[1].view(torch.uint8).t())
    assert Q._transpose_bytes(x[:, :0]).shape == (3, 70, 0)


def test_reference_fallback_without_interpreter(monkeypatch):
    x = _sample((32, 64), torch.bfloat16, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert Q.quant_backend(x) == "reference"
    q, s = Q.quantize_fp8(x, E4M3, G.MX_BLOCKWISE)
    p, ps = Q.quantize_fp4(x)
    if torch.cuda.is_available():
        return  # Triton was imported for the GPU here: the interpreter cannot be switched on now
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Q.quant_backend(x) == "triton"
    q2, s2 = Q.quantize_fp8(x, E4M3, G.MX_BLOCKWISE)
    assert_bits_equal(q, q2)
    assert_bits_equal(s, s2)
    p2, ps2 = Q.quantize_fp4(x)
    assert_bits_equal(p.view(torch.uint8), p2.view(torch.uint8))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_empty_inputs(case, device):
    _, gran, kw = case
    for shape in ((0, 64), (64, 0)):
        if gran == G.MX_BLOCKWISE and (shape[0] if kw.get("axis", -1) == 0 else shape[1]) % 32:
            continue
        x = torch.empty(shape, dtype=torch.bfloat16, device=device)
        q, s = Q.quantize_fp8(x, E4M3, gran, **kw)
        q_ref, s_ref = quantize_fp8_ref(x.cpu(), E4M3, gran, **kw)
        assert q.shape == shape and s.shape == s_ref.shape and s.dtype == s_ref.dtype
        d = Q.dequantize_fp8(q, torch.bfloat16, gran, scale_inv=s, **kw)
        assert d.shape == shape
    x = torch.empty((0, 64), device=device)
    q, s, qt, st = Q.quantize_fp8_with_trans(x, E4M3, G.BLOCKWISE)
    assert q.shape == (0, 64) and s.shape == (0, 1) and qt.shape == (64, 0) and st.shape == (64, 0)
    p, ps = Q.quantize_fp4(torch.empty((0, 64), device=device))
    assert p.shape == (0, 32) and ps.shape == (0, 2)


def test_errors():
    x = torch.randn(8, 64)
    with pytest.raises(TypeError, match="x.dtype must be"):
        Q.quantize_fp8(x.to(torch.int32), E4M3, G.TENSORWISE)
    with pytest.raises(TypeError, match="out_dtype must be"):
        Q.quantize_fp8(x, torch.bfloat16, G.TENSORWISE)
    with pytest.raises(ValueError, match="granularity='COLWISE'"):
        Q.quantize_fp8(x, E4M3, "COLWISE")
    with pytest.raises(ValueError, match="multiple of 32, got 8"):
        Q.quantize_fp8(x, E4M3, G.MX_BLOCKWISE, axis=0)
    with pytest.raises(ValueError, match="block_size must be 32"):
        Q.quantize_fp8(x, E4M3, G.MX_BLOCKWISE, block_size=16)
    with pytest.raises(ValueError, match="power of two in \\[16, 128\\], got 100"):
        Q.quantize_fp8(x, E4M3, G.BLOCKWISE, block_size=100)
    with pytest.raises(ValueError, match="block_size is only for"):
        Q.quantize_fp8(x, E4M3, G.ROWWISE, block_size=128)
    with pytest.raises(ValueError, match="axis=3 is out of range for a 3-D input"):
        Q.quantize_fp8(x.reshape(2, 4, 64), E4M3, G.ROWWISE, axis=3)
    with pytest.raises(ValueError, match="axis=2"):
        Q.quantize_fp8(x, E4M3, G.ROWWISE, axis=2)
    with pytest.raises(ValueError, match="expected a 2-D tensor"):
        Q.quantize_fp8(x.reshape(-1), E4M3, G.BLOCKWISE)
    with pytest.raises(NotImplementedError, match="stochastic rounding"):
        Q.quantize_fp8(x, E4M3, G.BLOCKWISE, scaling_recipe=ScalingRecipe(use_sr=True))
    with pytest.raises(ValueError, match="x must be 2-D"):
        Q.quantize_fp8_with_trans(x.reshape(2, 4, 64), E4M3, G.BLOCKWISE)
    with pytest.raises(ValueError, match="multiple of 32, got 8"):
        Q.quantize_fp8_with_trans(x, E4M3, G.MX_BLOCKWISE)
    q, s = Q.quantize_fp8(x, E4M3, G.BLOCKWISE)
    with pytest.raises(ValueError, match=r"scale_inv has shape \(8, 1\), expected \(1, 64\)"):
        Q.dequantize_fp8(q, torch.float32, G.BLOCKWISE, axis=0, scale_inv=s)
    with pytest.raises(TypeError, match="x must be a float8"):
        Q.dequantize_fp8(x, torch.float32, G.BLOCKWISE, scale_inv=s)
    with pytest.raises(TypeError, match="out_dtype must be float32"):
        Q.dequantize_fp8(q, E4M3, G.BLOCKWISE, scale_inv=s)
    with pytest.raises(TypeError, match="scale_inv.dtype must be"):
        Q.dequantize_fp8(q, torch.float32, G.BLOCKWISE, scale_inv=s.double())
    with pytest.raises(ValueError, match="MXFP4 needs the quantized dim to be a multiple of 32, got 8"):
        Q.quantize_fp4(x, axis=0)
    with pytest.raises(ValueError, match="x must be 2-D"):
        Q.quantize_fp4(x.reshape(-1))
    p, ps = Q.quantize_fp4(x)
    with pytest.raises(ValueError, match="scale_inv has shape"):
        Q.dequantize_fp4(p, torch.float32, scale_inv=ps[:, :1])
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        Q.dequantize_fp4(p, torch.float32, scale_inv=ps.float())


@pytest.mark.parametrize("gran, kw, shape", [
    (G.BLOCKWISE, {}, (64, 256)),                       # scale [64, 2]
    (G.BLOCKWISE, {"scaling_recipe": R2D}, (256, 384)),  # scale [2, 3]
    (G.MX_BLOCKWISE, {}, (64, 256)),                    # scale [64, 8]
    (G.ROWWISE, {"axis": -1}, (48, 96)),                # scale [48, 1]
], ids=["block1x128", "block128x128", "mx", "rowwise"])
def test_dequantize_scale_shape_is_strict(gran, kw, shape, device):
    """A scale of the right size in the wrong shape (transposed, or regrouped) is refused, naming
    both shapes: accepted, it would pair scales with the wrong blocks. Shapes that differ only
    by size-1 dims hold every scale at the same flat position and dequantize bit-identically."""
    x = _sample(shape, torch.float32, device, seed=7)
    q, s = Q.quantize_fp8(x, E4M3, gran, **kw)
    good = Q.dequantize_fp8(q, torch.float32, gran, scale_inv=s, **kw)
    assert _snr_db(x, good) >= 25
    want = re.escape(str(tuple(s.shape)))
    wrong = []
    if s.dim() == 2 and s.shape[0] > 1 and s.shape[1] > 1:
        wrong.append(s.t().contiguous())                          # transposed, same numel
    wrong.append(s.reshape(-1))                                   # flattened
    wrong.append(s.reshape(2, -1) if s.numel() % 2 == 0 else s.reshape(1, -1, 1))
    wrong = [w for w in wrong if tuple(d for d in w.shape if d != 1) != tuple(d for d in s.shape if d != 1)]
    assert wrong, "no wrongly shaped scale to try for this case"
    for w in wrong:
        assert w.numel() == s.numel()
        with pytest.raises(ValueError, match=rf"scale_inv has shape {re.escape(str(tuple(w.shape)))}, "
                                             rf"expected {want}"):
            Q.dequantize_fp8(q, torch.float32, gran, scale_inv=w, **kw)
    # size-1 dims added or dropped (e.g. a flat ROWWISE scale [M] for [M, 1]): the same values
    for same in (s.squeeze(), s.unsqueeze(0)):
        assert torch.equal(Q.dequantize_fp8(q, torch.float32, gran, scale_inv=same, **kw), good)


def test_torch_compile_fullgraph(device):
    x = _sample((64, 256), torch.bfloat16, device)

    def f(t):
        q, s = Q.quantize_fp8(t, E4M3, G.BLOCKWISE)
        return Q.dequantize_fp8(q, torch.float32, G.BLOCKWISE, scale_inv=s), s

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    d, s = compiled(x)
    d_ref, s_ref = f(x)
    assert_bits_equal(d, d_ref)
    assert_bits_equal(s, s_ref)


# ---- N-D forms: groups along a non-last axis, b x b tiles per matrix, MX copies per matrix ----
def _sample_nd(shape, dtype, device, seed=0):
    """:func:`_sample` of the rows of ``shape`` (magnitudes spread per last-dim row), reshaped."""
    rows = math.prod(shape[:-1])
    return _sample((rows, shape[-1]), dtype, device, seed=seed).reshape(shape)


def _snr_db(x: torch.Tensor, d: torch.Tensor) -> float:
    x, d = x.double(), d.double()
    return 10 * math.log10((x * x).sum().item() / max(((x - d) ** 2).sum().item(), 1e-300))


def _per_matrix(x, fn):
    """``fn`` on every ``[M, N]`` matrix of ``x [*lead, M, N]``, each output stacked back to ``[*lead, ...]``."""
    lead = x.shape[:-2]
    outs = [fn(m) for m in x.reshape(-1, *x.shape[-2:])]

    def stack(ts):  # 1-byte dtypes through uint8 (CUDA has no cat of strided E8M0)
        one = ts[0].element_size() == 1
        out = torch.stack([t.view(torch.uint8) if one else t for t in ts]).reshape(*lead, *ts[0].shape)
        return out.view(ts[0].dtype) if one else out

    if isinstance(outs[0], torch.Tensor):
        return stack(outs)
    return tuple(stack(o) for o in zip(*outs))


# (shape, axis): each of the three routes: [a, l] rows (only size-1 dims after the axis),
# [a * l, c] columns (one matrix before the axis), the moved axis (a copy, then a byte transpose)
ROWWISE_ND = [((2, 3, 40, 5), 0), ((2, 3, 40, 5), 1), ((2, 3, 40, 5), -2), ((3, 40, 1), 1), ((1, 40, 7), -2),
              ((2, 300, 3), 1)]


@pytest.mark.parametrize("shape, axis", ROWWISE_ND, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else f"ax{v}")
def test_rowwise_any_axis_nd(shape, axis, device):
    """ROWWISE along any axis of an N-D tensor: the moved-axis quantization (``movedim(axis, -1)``,
    groups along the last dim) moved back, bit for bit; scales keep the axis as a 1."""
    for i, (in_dtype, out_dtype) in enumerate([(torch.bfloat16, E4M3), (torch.float32, E5M2)]):
        x = _sample_nd(shape, in_dtype, device, seed=10 + i)
        q, s = Q.quantize_fp8(x, out_dtype, G.ROWWISE, axis=axis)
        want_s = list(shape)
        want_s[axis] = 1
        assert q.shape == x.shape and q.is_contiguous() and tuple(s.shape) == tuple(want_s) and s.is_contiguous()
        qm, sm = Q.quantize_fp8(x.movedim(axis, -1).contiguous(), out_dtype, G.ROWWISE, axis=-1)
        assert_bits_equal(q, qm.movedim(-1, axis).contiguous(), "data")
        assert_bits_equal(s, sm.movedim(-1, axis).contiguous(), "scale")
        for od in (torch.float32, torch.bfloat16):
            d = Q.dequantize_fp8(q, od, G.ROWWISE, axis=axis, scale_inv=s)
            dm = Q.dequantize_fp8(qm, od, G.ROWWISE, axis=-1, scale_inv=sm)
            assert_bits_equal(d, dm.movedim(-1, axis).contiguous(), "dequant")
        if out_dtype == E4M3:
            assert _snr_db(x, Q.dequantize_fp8(q, torch.float32, G.ROWWISE, axis=axis, scale_inv=s)) >= 25


# (granularity, block_size, shape, axis): MX and 1-D BLOCKWISE down each matrix's columns; blocks
# dividing M (the [G * M, N] view) and a ragged last block (the moved axis), 3-D and 4-D
BLOCKS_ALONG = [
    ("mx_3d", G.MX_BLOCKWISE, None, (3, 64, 96), 1),
    ("mx_3d_neg", G.MX_BLOCKWISE, None, (2, 32, 40), -2),
    ("mx_4d", G.MX_BLOCKWISE, None, (2, 2, 64, 32), 2),
    ("mx_4d_ax1", G.MX_BLOCKWISE, None, (2, 32, 3, 16), 1),
    ("block32_3d", G.BLOCKWISE, 32, (3, 64, 40), -2),
    ("block32_ragged", G.BLOCKWISE, 32, (3, 48, 40), 1),
    ("block128_ragged", G.BLOCKWISE, None, (2, 130, 24), 1),
]


@pytest.mark.parametrize("case", BLOCKS_ALONG, ids=[c[0] for c in BLOCKS_ALONG])
def test_blocks_along_non_last_axis_nd(case, device):
    """MX / 1-D BLOCKWISE along a non-last axis of an N-D tensor: for ``axis = -2``, each matrix
    quantized by the 2-D op with ``axis=0`` (scales ``[*lead, ceil(M/b), N]``); any axis equals
    the moved-axis quantization moved back. Dequantization inverts it bit for bit."""
    _, gran, bs, shape, axis = case
    b = bs or (32 if gran == G.MX_BLOCKWISE else 128)
    for i, (in_dtype, out_dtype) in enumerate([(torch.bfloat16, E4M3), (torch.float32, E5M2)]):
        x = _sample_nd(shape, in_dtype, device, seed=20 + i)
        q, s = Q.quantize_fp8(x, out_dtype, gran, block_size=bs, axis=axis)
        want_s = list(shape)
        want_s[axis] = -(-shape[axis] // b)
        assert q.shape == x.shape and q.is_contiguous() and tuple(s.shape) == tuple(want_s) and s.is_contiguous()
        if axis in (-2, len(shape) - 2):  # the 2-D op on every matrix
            q_ref, s_ref = _per_matrix(x, lambda m: Q.quantize_fp8(m, out_dtype, gran, block_size=bs, axis=0))
        else:
            qm, sm = Q.quantize_fp8(x.movedim(axis, -1).contiguous(), out_dtype, gran, block_size=bs, axis=-1)
            q_ref, s_ref = qm.movedim(-1, axis).contiguous(), sm.movedim(-1, axis).contiguous()
        assert_bits_equal(q, q_ref, "data")
        assert_bits_equal(s, s_ref, "scale")
        d = Q.dequantize_fp8(q, torch.bfloat16, gran, block_size=bs, axis=axis, scale_inv=s)
        if axis in (-2, len(shape) - 2):
            d_ref = torch.stack([Q.dequantize_fp8(qi, torch.bfloat16, gran, block_size=bs, axis=0, scale_inv=si)
                                 for qi, si in zip(q.reshape(-1, *shape[-2:]), s.reshape(-1, *s.shape[-2:]))])
            assert_bits_equal(d, d_ref.reshape(shape), "dequant")
        else:
            d_ref = Q.dequantize_fp8(qm, torch.bfloat16, gran, block_size=bs, axis=-1, scale_inv=sm)
            assert_bits_equal(d, d_ref.movedim(-1, axis).contiguous(), "dequant")
        if out_dtype == E4M3:
            assert _snr_db(x, Q.dequantize_fp8(q, torch.float32, gran, block_size=bs, axis=axis, scale_inv=s)) >= 25


@pytest.mark.parametrize("shape, bs", [((3, 64, 96), 32), ((3, 48, 80), 32), ((2, 2, 40, 136), 16),
                                       ((1, 200, 64), None), ((2, 130, 40), None)],
                         ids=["aligned", "ragged", "4d", "one", "ragged128"])
def test_2d_tiles_batched_nd(shape, bs, device):
    """BLOCKWISE ``b x b`` tiles (use_2d_block) of every matrix of ``[*lead, M, N]``: the 2-D op on
    each matrix, scales ``[*lead, ceil(M/b), ceil(N/b)]`` (M % b == 0: one launch on ``[G * M,
    N]``; otherwise the batched launch). axis None / -1 / -2 are the same; dequantize inverts."""
    b = bs or 128
    for i, (in_dtype, out_dtype) in enumerate([(torch.bfloat16, E4M3), (torch.float16, E5M2)]):
        x = _sample_nd(shape, in_dtype, device, seed=30 + i)
        q, s = Q.quantize_fp8(x, out_dtype, G.BLOCKWISE, block_size=bs, scaling_recipe=R2D)
        assert q.shape == x.shape and tuple(s.shape) == (*shape[:-2], -(-shape[-2] // b), -(-shape[-1] // b))
        q_ref, s_ref = _per_matrix(x, lambda m: Q.quantize_fp8(m, out_dtype, G.BLOCKWISE, block_size=bs,
                                                               scaling_recipe=R2D))
        assert_bits_equal(q, q_ref, "data")
        assert_bits_equal(s, s_ref, "scale")
        q2, s2 = Q.quantize_fp8(x, out_dtype, G.BLOCKWISE, block_size=bs, scaling_recipe=R2D, axis=-2)
        assert_bits_equal(q2, q)
        assert_bits_equal(s2, s)
        for od in (torch.float32, torch.bfloat16):
            d = Q.dequantize_fp8(q, od, G.BLOCKWISE, block_size=bs, scaling_recipe=R2D, scale_inv=s)
            d_ref = torch.stack([Q.dequantize_fp8(qi, od, G.BLOCKWISE, block_size=bs, scaling_recipe=R2D, scale_inv=si)
                                 for qi, si in zip(q.reshape(-1, *shape[-2:]), s.reshape(-1, *s.shape[-2:]))])
            assert_bits_equal(d, d_ref.reshape(shape), "dequant")
        if out_dtype == E4M3:
            d = Q.dequantize_fp8(q, torch.float32, G.BLOCKWISE, block_size=bs, scaling_recipe=R2D, scale_inv=s)
            assert _snr_db(x, d) >= 25


@pytest.mark.parametrize("shape", [(3, 64, 96), (2, 2, 32, 64), (1, 32, 32)], ids=["3d", "4d", "one"])
def test_with_trans_mx_nd(shape, device):
    """quantize_fp8_with_trans MX of ``[*lead, M, N]``: every matrix's four outputs as the 2-D op
    gives them (``[*lead, M, N]``, ``[*lead, M, N/32]``, ``[*lead, N, M]``, ``[*lead, N, M/32]``),
    bit for bit, each matrix's scales column-major like the 2-D op's."""
    for i, (in_dtype, out_dtype) in enumerate([(torch.bfloat16, E4M3), (torch.float32, E5M2)]):
        x = _sample_nd(shape, in_dtype, device, seed=40 + i)
        got = Q.quantize_fp8_with_trans(x, out_dtype, G.MX_BLOCKWISE)
        *lead, m, n = shape
        assert [tuple(t.shape) for t in got] == [(*lead, m, n), (*lead, m, n // 32), (*lead, n, m), (*lead, n, m // 32)]
        assert got[0].is_contiguous() and got[2].is_contiguous()
        ref = _per_matrix(x, lambda mat: Q.quantize_fp8_with_trans(mat, out_dtype, G.MX_BLOCKWISE))
        for k, (g_, r_) in enumerate(zip(got, ref)):
            assert_bits_equal(g_, r_, f"output {k}")
        for k in (1, 3):  # each matrix's scales column-major, as the 2-D op returns them
            assert all(blk.t().is_contiguous() for blk in got[k].reshape(-1, *got[k].shape[-2:])), got[k].stride()
        if out_dtype == E4M3:
            q, s, qt, st = got
            assert _snr_db(x, Q.dequantize_fp8(q, torch.float32, G.MX_BLOCKWISE, scale_inv=s)) >= 25
            assert _snr_db(x.transpose(-1, -2), Q.dequantize_fp8(qt, torch.float32, G.MX_BLOCKWISE, scale_inv=st)) >= 25


def test_nd_forms_empty(device):
    for shape in ((2, 0, 64), (0, 64, 32), (2, 64, 0)):
        x = torch.empty(shape, dtype=torch.bfloat16, device=device)
        for gran, kw, s_shape in ((G.ROWWISE, {"axis": 1}, (shape[0], min(shape[1], 1), shape[2])),
                                  (G.MX_BLOCKWISE, {"axis": -2}, (shape[0], shape[1] // 32, shape[2])),
                                  (G.BLOCKWISE, {"block_size": 32, "scaling_recipe": R2D},
                                   (shape[0], -(-shape[1] // 32), -(-shape[2] // 32)))):
            q, s = Q.quantize_fp8(x, E4M3, gran, **kw)
            assert q.shape == shape and tuple(s.shape) == s_shape, (gran, shape, s.shape)
            assert Q.dequantize_fp8(q, torch.float32, gran, scale_inv=s, **kw).shape == shape
        q, s, qt, st = Q.quantize_fp8_with_trans(x, E4M3, G.MX_BLOCKWISE)
        assert q.shape == shape and qt.shape == (shape[0], shape[2], shape[1])
        assert s.shape == (shape[0], shape[1], shape[2] // 32) and st.shape == (shape[0], shape[2], shape[1] // 32)


def test_nd_forms_errors():
    x = _sample_nd((2, 48, 64), torch.float32, "cpu", seed=50)
    with pytest.raises(ValueError, match="axis=-4 is out of range for a 3-D input"):
        Q.quantize_fp8(x, E4M3, G.MX_BLOCKWISE, axis=-4)
    with pytest.raises(ValueError, match=r"multiple of 32, got 48 \(axis=1"):
        Q.quantize_fp8(x, E4M3, G.MX_BLOCKWISE, axis=1)
    with pytest.raises(ValueError, match="tile the last two dims of each matrix; axis=0 of a 3-D input is a batch dim"):
        Q.quantize_fp8(x, E4M3, G.BLOCKWISE, axis=0, scaling_recipe=R2D)
    with pytest.raises(ValueError, match="MX_BLOCKWISE only"):
        Q.quantize_fp8_with_trans(x, E4M3, G.BLOCKWISE)
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        Q.quantize_fp8_with_trans(x, E4M3, G.MX_BLOCKWISE)
    q, s = Q.quantize_fp8(x, E4M3, G.ROWWISE, axis=1)
    assert s.shape == (2, 1, 64)
    with pytest.raises(ValueError, match=r"scale_inv has shape \(2, 1, 64\), expected \(1, 48, 64\)"):
        Q.dequantize_fp8(q, torch.float32, G.ROWWISE, axis=0, scale_inv=s)
    with pytest.raises(ValueError, match="batch dim"):
        Q.dequantize_fp8(q, torch.float32, G.BLOCKWISE, axis=0, scale_inv=s, scaling_recipe=R2D)
    with pytest.raises(ValueError, match="x must be 2-D"):
        Q.quantize_fp4(x)  # MXFP4 stays 2-D


def test_nd_forms_torch_compile(device):
    x = _sample_nd((2, 64, 40), torch.bfloat16, device, seed=60)

    def f(t):
        q, s = Q.quantize_fp8(t, E4M3, G.ROWWISE, axis=1)  # the moved-axis route (byte transposes)
        q2, s2 = Q.quantize_fp8(t, E4M3, G.BLOCKWISE, block_size=32, axis=-2)
        q3, s3 = Q.quantize_fp8(t[:, :48], E4M3, G.BLOCKWISE, block_size=32, scaling_recipe=R2D)
        return (Q.dequantize_fp8(q, torch.float32, G.ROWWISE, axis=1, scale_inv=s),
                Q.dequantize_fp8(q2, torch.float32, G.BLOCKWISE, block_size=32, axis=-2, scale_inv=s2),
                Q.dequantize_fp8(q3, torch.float32, G.BLOCKWISE, block_size=32, scaling_recipe=R2D, scale_inv=s3),
                s, s2, s3, *Q.quantize_fp8_with_trans(t[..., :32], E4M3, G.MX_BLOCKWISE))

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    for k, (g_, r_) in enumerate(zip(got, f(x))):
        assert g_.shape == r_.shape and g_.stride() == r_.stride(), (k, g_.stride(), r_.stride())
        assert_bits_equal(g_, r_, f"output {k}")


def test_nd_forms_reference_backend(monkeypatch):
    """Without the interpreter (plain CPU: the reference quantizer) the N-D forms give the same bytes."""
    x = _sample_nd((2, 48, 64), torch.bfloat16, "cpu", seed=70)
    calls = [lambda t: Q.quantize_fp8(t, E4M3, G.ROWWISE, axis=1),
             lambda t: Q.quantize_fp8(t, E4M3, G.MX_BLOCKWISE, axis=-1),
             lambda t: Q.quantize_fp8(t[:, :32], E4M3, G.MX_BLOCKWISE, axis=1),
             lambda t: Q.quantize_fp8(t, E4M3, G.BLOCKWISE, block_size=32, scaling_recipe=R2D),
             lambda t: Q.quantize_fp8_with_trans(t[:, :32], E4M3, G.MX_BLOCKWISE)]
    want = [c(x) for c in calls]
    if torch.cuda.is_available():
        return  # the interpreter cannot be switched off here once Triton runs on the GPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert Q.quant_backend(x) == "reference"
    for k, c in enumerate(calls):
        for g_, r_ in zip(c(x), want[k]):
            assert_bits_equal(g_, r_, f"call {k}")


# ---- MXFP4 stochastic rounding and the random Hadamard transform ---------------------------
SR = ScalingRecipe(use_sr=True)
RHT = ScalingRecipe(use_rht=True)


def _u8(t):
    return t.view(torch.uint8).cpu()


def _deq4(p, s, axis=-1):
    return dequantize_fp4_ref(p.cpu(), s.cpu(), axis=axis).double()


@pytest.mark.parametrize("axis", [-1, 0])
def test_fp4_sr_rounds_to_a_neighbour(axis, device):
    # every SR code is the round-down or the round-up code of its element (the reference with
    # rand = 1 / rand = 0), the scales are the RNE scales bit for bit, and both directions occur
    x = _sample((64, 256), torch.float32, "cpu", seed=4)
    x[:4] = _special_input("cpu")  # zero, inf, NaN blocks
    x = x.to(device)
    p, s = Q.quantize_fp4(x, axis=axis, scaling_recipe=SR, seed=123)
    p_rne, s_rne = quantize_fp4_ref(x.cpu(), axis=axis)
    assert_bits_equal(s.cpu(), s_rne, "SR scales are the RNE scales")
    down = quantize_fp4_ref(x.cpu(), axis=axis, rand=torch.ones(x.shape))[0]
    up = quantize_fp4_ref(x.cpu(), axis=axis, rand=torch.zeros(x.shape))[0]
    d, d_dn, d_up = (_deq4(t, s_rne, axis) for t in (p, down, up))
    nan = torch.isnan(d_dn)
    assert torch.equal(torch.isnan(d), nan)
    ok = (d == d_dn) | (d == d_up)
    assert ok[~nan].all()
    assert ((d == d_up) & (d_up != d_dn)).any() and ((d == d_dn) & (d_up != d_dn)).any()
    assert (d_dn.abs() <= d_up.abs())[~nan].all()
    # a value on the grid never moves (the down and up codes agree)
    same = (d_dn == d_up) & ~nan
    assert torch.equal(d[same], d_dn[same])


def test_fp4_sr_is_unbiased(device):
    # a block whose amax is 6 (E8M0 scale 1) holding off-grid values that RNE rounds *down*: RNE
    # is biased by -0.2 .. -0.6 per element; the mean of SR over 4096 independent roundings (rows)
    # is within 6 sigma of x for every element
    vals = [6.0, 0.2, 0.7, 1.2, 1.7, 2.4, 3.4, 4.8, 0.1, 0.6, 1.1, 1.6, 2.2, 3.2, 4.4, 4.9]
    row = torch.tensor(vals + [-v for v in vals], dtype=torch.float32)
    n = 4096
    x = row.repeat(n, 1).to(device)
    p, s = Q.quantize_fp4(x, scaling_recipe=SR, seed=7)
    d = _deq4(p, s)
    r = row.double()
    mean = d.mean(0)
    lo = _deq4(*quantize_fp4_ref(row[None], rand=torch.ones(1, 32)))[0]
    hi = _deq4(*quantize_fp4_ref(row[None], rand=torch.zeros(1, 32)))[0]
    pr = torch.where(hi.abs() > lo.abs(), (r.abs() - lo.abs()) / (hi.abs() - lo.abs()), torch.zeros_like(r))
    sigma = (hi - lo).abs() * (pr * (1 - pr)).sqrt() / math.sqrt(n)
    assert ((mean - r).abs() <= 6 * sigma + 1e-12).all(), (mean - r)
    rne = _deq4(*quantize_fp4_ref(row[None]))[0]
    bias_rne = (rne - r) * r.sign()  # every magnitude but 6 is rounded down by RNE
    assert (bias_rne[1:16] <= -0.09).all() and bias_rne.mean() < -0.25
    assert ((mean - r) * r.sign()).mean().abs() < 0.02  # SR: no systematic bias (sigma ~0.002)


def test_fp4_sr_seeds(device):
    x = _sample((64, 128), torch.bfloat16, device, seed=9)
    a = Q.quantize_fp4(x, scaling_recipe=SR, seed=5)
    b = Q.quantize_fp4(x, scaling_recipe=SR, seed=torch.tensor([5], device=device))
    c = Q.quantize_fp4(x, scaling_recipe=SR, seed=6)
    assert_bits_equal(_u8(a[0]), _u8(b[0]), "same seed, same result")
    assert (_u8(a[0]) != _u8(c[0])).float().mean() > 0.1  # another seed differs
    assert_bits_equal(a[1], c[1])  # the scales are deterministic
    # the default seed is drawn on the device from its generator: torch.manual_seed reproduces it
    torch.manual_seed(0)
    d = Q.quantize_fp4(x, scaling_recipe=SR)
    torch.manual_seed(0)
    e = Q.quantize_fp4(x, scaling_recipe=SR)
    assert_bits_equal(_u8(d[0]), _u8(e[0]))
    gen = torch.Generator(device=device).manual_seed(3)
    f = Q.quantize_fp4(x, scaling_recipe=SR, seed=gen)
    gen.manual_seed(3)
    assert_bits_equal(_u8(f[0]), _u8(Q.quantize_fp4(x, scaling_recipe=SR, seed=gen)[0]))
    # SR off: RNE, bit for bit (use_sr=False recipe and the default)
    p, sc = Q.quantize_fp4(x, scaling_recipe=ScalingRecipe())
    assert_bits_equal(_u8(p), _u8(quantize_fp4_ref(x.cpu())[0]))
    # axis=0 is axis=-1 of the transpose (same stream); with_trans: the transposed copy uses seed + 1
    p0, _ = Q.quantize_fp4(x, axis=0, scaling_recipe=SR, seed=5)
    pt, _ = Q.quantize_fp4(x.t().contiguous(), scaling_recipe=SR, seed=5)
    assert_bits_equal(_u8(p0).t().contiguous(), _u8(pt))
    q, qs, qt, qst = Q.quantize_fp4_with_trans(x, scaling_recipe=SR, seed=5)
    assert_bits_equal(_u8(q), _u8(a[0]))
    assert_bits_equal(_u8(qt), _u8(Q.quantize_fp4(x.t().contiguous(), scaling_recipe=SR, seed=6)[0]))
    # only the transposed copy stochastic
    q, _, qt, _ = Q.quantize_fp4_with_trans(x, scaling_recipe_for_trans=SR, seed=5)
    assert_bits_equal(_u8(q), _u8(quantize_fp4_ref(x.cpu())[0]))
    assert_bits_equal(_u8(qt), _u8(Q.quantize_fp4(x.t().contiguous(), scaling_recipe=SR, seed=6)[0]))


def test_hadamard_transform_is_orthogonal(device):
    sg = Q.random_hadamard_signs(32, generator=torch.Generator().manual_seed(0)).to(device)
    assert set(sg.tolist()) <= {-1.0, 1.0}
    eye = torch.eye(32, dtype=torch.float64, device=device)
    r = Q.hadamard_transform(eye, sg)  # the rows of I map to the rows of R
    torch.testing.assert_close(r @ r.T, eye, rtol=0, atol=1e-14)
    torch.testing.assert_close(r.abs(), torch.full_like(r, 32 ** -0.5), rtol=0, atol=1e-15)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(16, 96, generator=g, dtype=torch.float64).to(device)
    b = torch.randn(8, 96, generator=g, dtype=torch.float64).to(device)
    torch.testing.assert_close(Q.hadamard_transform(a, sg) @ Q.hadamard_transform(b, sg).T, a @ b.T,
                               rtol=0, atol=1e-12)
    # axis=0 is the transform of the columns; fp32 / bf16 inputs give fp32
    torch.testing.assert_close(Q.hadamard_transform(a.t(), sg, axis=0), Q.hadamard_transform(a, sg).t(),
                               rtol=0, atol=0)
    y = Q.hadamard_transform(a.to(torch.bfloat16), sg)
    assert y.dtype == torch.float32 and y.shape == a.shape
    # blocks of 16 too (any power of two)
    s16 = sg[:16]
    torch.testing.assert_close(Q.hadamard_transform(a, s16) @ Q.hadamard_transform(b, s16).T, a @ b.T,
                               rtol=0, atol=1e-12)


def test_fp4_rht_reduces_error_on_outliers(device):
    # an outlier-heavy operand (about one 40-sigma element per 32-block): its block scale crushes
    # the other elements; the transform spreads the outlier so the MXFP4 product is more accurate
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    x = x + (torch.rand(64, 256, generator=g) < 1 / 32) * 40 * torch.randn(64, 256, generator=g).sign()
    y = torch.randn(48, 256, generator=g)
    x, y = x.to(device), y.to(device)
    ref = x.double().cpu() @ y.double().cpu().T
    sg = Q.random_hadamard_signs(32, device=device, generator=torch.Generator(device=device).manual_seed(1))
    plain = _deq4(*Q.quantize_fp4(x)) @ _deq4(*Q.quantize_fp4(y)).T
    rht = (_deq4(*Q.quantize_fp4(x, scaling_recipe=RHT, rht_signs=sg))
           @ _deq4(*Q.quantize_fp4(y, scaling_recipe=RHT, rht_signs=sg)).T)
    err_plain, err_rht = (plain - ref).norm(), (rht - ref).norm()
    assert err_rht < 0.8 * err_plain, (err_rht, err_plain)
    # the quantized transform is the transform then quantize_fp4, along either axis
    hx = Q.hadamard_transform(x, sg, axis=0)
    p, s = Q.quantize_fp4(x, axis=0, scaling_recipe=RHT, rht_signs=sg)
    p_ref, s_ref = quantize_fp4_ref(hx.cpu(), axis=0)
    assert_bits_equal(_u8(p), _u8(p_ref))
    assert_bits_equal(s.cpu(), s_ref)
    # with_trans: each copy is transformed along its own quantized dim; SR and RHT combine
    q, qs, qt, qst = Q.quantize_fp4_with_trans(x, scaling_recipe=ScalingRecipe(use_sr=True, use_rht=True),
                                               seed=3, rht_signs=sg)
    r1 = Q.quantize_fp4(x, scaling_recipe=ScalingRecipe(use_sr=True, use_rht=True), seed=3, rht_signs=sg)
    r2 = Q.quantize_fp4(x.t().contiguous(), scaling_recipe=ScalingRecipe(use_sr=True, use_rht=True), seed=4,
                        rht_signs=sg)
    assert_bits_equal(_u8(q), _u8(r1[0]))
    assert_bits_equal(_u8(qt), _u8(r2[0]))
    assert_bits_equal(qst.cpu(), r2[1].cpu())


def test_fp4_sr_rht_reference_fallback(monkeypatch):
    # plain CPU (no interpreter): the reference runs, SR from torch's CPU generator seeded with the
    # seed (reproducible; not the kernel's Philox stream), values still neighbours
    x = _sample((32, 64), torch.float32, "cpu", seed=8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a = Q.quantize_fp4(x, scaling_recipe=SR, seed=11)
    b = Q.quantize_fp4(x, scaling_recipe=SR, seed=11)
    assert_bits_equal(_u8(a[0]), _u8(b[0]))
    down = _deq4(*quantize_fp4_ref(x, rand=torch.ones(x.shape)))
    up = _deq4(*quantize_fp4_ref(x, rand=torch.zeros(x.shape)))
    d = _deq4(*a)
    assert ((d == down) | (d == up)).all()
    sg = Q.random_hadamard_signs(32)
    p, s = Q.quantize_fp4(x, scaling_recipe=RHT, rht_signs=sg)
    assert_bits_equal(_u8(p), _u8(quantize_fp4_ref(Q.hadamard_transform(x, sg))[0]))


def test_fp4_sr_rht_errors():
    x = torch.randn(64, 96)
    sg = Q.random_hadamard_signs(32)
    with pytest.raises(ValueError, match="seed is only used with stochastic rounding"):
        Q.quantize_fp4(x, seed=1)
    with pytest.raises(ValueError, match="rht_signs is only used"):
        Q.quantize_fp4(x, rht_signs=sg)
    with pytest.raises(ValueError, match="needs rht_signs"):
        Q.quantize_fp4(x, scaling_recipe=RHT)
    with pytest.raises(ValueError, match="needs rht_signs"):
        Q.quantize_fp4_with_trans(x, scaling_recipe_for_trans=RHT)
    with pytest.raises(ValueError, match=r"int seed must be in \[0, 2\*\*62\)"):
        Q.quantize_fp4(x, scaling_recipe=SR, seed=-1)
    with pytest.raises(ValueError, match="must hold one integer"):
        Q.quantize_fp4(x, scaling_recipe=SR, seed=torch.tensor([1.0]))
    with pytest.raises(TypeError, match="seed must be None, an int"):
        Q.quantize_fp4(x, scaling_recipe=SR, seed="1")
    # the transformed dim must be a multiple of the Hadamard block
    with pytest.raises(ValueError, match="multiple of the Hadamard block 64"):
        Q.quantize_fp4(x, scaling_recipe=RHT, rht_signs=Q.random_hadamard_signs(64))
    with pytest.raises(ValueError, match="multiple of the Hadamard block 32"):
        Q.hadamard_transform(torch.randn(8, 48), sg)
    with pytest.raises(ValueError, match="power of two in \\[2, 256\\], got 24"):
        Q.hadamard_transform(x, torch.ones(24))
    with pytest.raises(ValueError, match="power of two"):
        Q.random_hadamard_signs(12)
    # FP8 keeps both options unimplemented, naming the option
    with pytest.raises(NotImplementedError, match="use_rht=True"):
        Q.quantize_fp8(x, E4M3, G.BLOCKWISE, scaling_recipe=RHT)
    with pytest.raises(NotImplementedError, match="use_sr=True"):
        Q.quantize_fp8_with_trans(x, E4M3, G.MX_BLOCKWISE, scaling_recipe=SR)


def test_fp4_sr_torch_compile(device):
    x = _sample((64, 128), torch.bfloat16, device)
    sg = Q.random_hadamard_signs(32, device=device)

    def f(t, seed):
        return Q.quantize_fp4(t, scaling_recipe=ScalingRecipe(use_sr=True, use_rht=True), seed=seed, rht_signs=sg)

    seed = torch.tensor([17], device=device)
    p, s = torch.compile(f, fullgraph=True, backend="aot_eager")(x, seed)
    p_ref, s_ref = f(x, seed)
    assert_bits_equal(_u8(p), _u8(p_ref))
    assert_bits_equal(s, s_ref)


# ---- GPU: real shapes -----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bitexact_large_gpu(case):
    _, gran, kw = case
    x = _sample((4096, 7168), torch.bfloat16, "cuda")
    for fp8 in FP8:
        q, s = Q.quantize_fp8(x, fp8, gran, **kw)
        q_ref, s_ref = quantize_fp8_ref(x, fp8, gran, **kw)
        assert_bits_equal(q, q_ref)
        assert_bits_equal(s, s_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("case", WT_CASES, ids=[c[0] for c in WT_CASES])
def test_with_trans_large_gpu(case):
    _, gran, kw = case
    x = _sample((4096, 7168), torch.bfloat16, "cuda")
    q, s, qt, st = Q.quantize_fp8_with_trans(x, E4M3, gran, **kw)
    rec = kw.get("scaling_recipe")
    qt_ref, st_ref = quantize_fp8_ref(x.t().contiguous(), E4M3, gran, block_size=kw.get("block_size"),
                                      scaling_recipe=kw.get("scaling_recipe_for_trans", rec))
    assert_bits_equal(qt, qt_ref)
    assert_bits_equal(st, st_ref)
    q_ref, s_ref = quantize_fp8_ref(x, E4M3, gran, block_size=kw.get("block_size"), scaling_recipe=rec)
    assert_bits_equal(q, q_ref, "row copy")
    assert_bits_equal(s, s_ref, "row scale")
    p, ps, pt, pst = Q.quantize_fp4_with_trans(x)
    assert_bits_equal(p.view(torch.uint8), quantize_fp4_ref(x)[0].view(torch.uint8))
    assert_bits_equal(pt.view(torch.uint8), quantize_fp4_ref(x.t().contiguous())[0].view(torch.uint8))
    assert math.isfinite(float(s.float().sum()))


# ---- one-read two-copy kernels: tile configurations, tails, fallbacks ------------------------
def _launch_with_trans(x, out_dtype, gran, tile, block_size=None):
    from primus_turbo.triton.quantization.quant_fp8_kernel import QuantGrouping, fp8_quant_with_trans_launch

    mode = 1 if gran == G.MX_BLOCKWISE else 0
    b = 32 if gran == G.MX_BLOCKWISE else (block_size or 128)
    return fp8_quant_with_trans_launch(x, out_dtype, QuantGrouping(mode, 1, b), QuantGrouping(mode, b, 1), tile=tile)


def _with_trans_refs(x, out_dtype, gran, block_size=None):
    q, s = quantize_fp8_ref(x, out_dtype, gran, block_size=block_size)
    qt, st = quantize_fp8_ref(x.t().contiguous(), out_dtype, gran, block_size=block_size)
    return q, s, qt, st


# (granularity, block_size, shape, tile): exact tile grids (the unmasked path), partial tiles on
# either dim, shapes smaller than one tile, and every default
WT_TILE_CASES = [
    (G.BLOCKWISE, None, (128, 128), (128, 128, 4)),
    (G.BLOCKWISE, None, (256, 384), (128, 128, 4)),
    (G.BLOCKWISE, None, (132, 200), (128, 128, 4)),   # row and column tails, partial blocks
    (G.BLOCKWISE, None, (8, 136), (128, 128, 4)),     # fewer rows than one tile
    (G.BLOCKWISE, None, (256, 256), (256, 128, 8)),
    (G.BLOCKWISE, None, (128, 256), (128, 256, 8)),
    (G.BLOCKWISE, 64, (192, 320), (64, 128, 4)),
    (G.BLOCKWISE, 64, (68, 64), (64, 64, 4)),
    (G.MX_BLOCKWISE, None, (64, 128), (64, 128, 4)),
    (G.MX_BLOCKWISE, None, (96, 160), (64, 128, 4)),  # tails on both dims
    (G.MX_BLOCKWISE, None, (128, 256), (32, 256, 4)),
    (G.MX_BLOCKWISE, None, (64, 64), (32, 64, 2)),
    (G.MX_BLOCKWISE, None, (32, 96), (128, 128, 8)),  # tile taller and wider than x
    # BLOCKWISE with the scales staged through the per-program scratch
    (G.BLOCKWISE, None, (256, 384), (128, 128, 4, 168, "staged")),
    (G.BLOCKWISE, None, (132, 200), (128, 128, 4, 0, "staged")),
    (G.BLOCKWISE, None, (8, 136), (128, 128, 8, 0, "staged")),
    (G.BLOCKWISE, None, (256, 512), (128, 256, 8, 0, "staged")),
    (G.BLOCKWISE, 64, (192, 320), (64, 128, 4, 0, "staged")),
    (G.BLOCKWISE, 64, (68, 64), (128, 64, 4, 0, "staged")),
]


@pytest.mark.parametrize("case", WT_TILE_CASES,
                         ids=lambda c: f"{c[0].name}-{c[1]}-{c[2][0]}x{c[2][1]}-{'_'.join(map(str, c[3]))}")
def test_with_trans_two_copy_kernel_tiles(case, device):
    gran, bs, shape, tile = case
    for out_dtype, in_dtype in ((E4M3, torch.bfloat16), (E5M2, torch.float32)):
        x = _sample(shape, in_dtype, device, seed=shape[0] + shape[1])
        x[1, 2] = float("nan")
        x[2, 5] = float("inf")
        x[3, 0] = -0.0
        outs = _launch_with_trans(x, out_dtype, gran, tile, bs)
        refs = _with_trans_refs(x, out_dtype, gran, bs)
        for what, o, r in zip(("row copy", "row scale", "col copy", "col scale"), outs, refs):
            assert_bits_equal(o.view(r.dtype) if o.dtype != r.dtype else o, r, f"{what} {tile} {out_dtype}")


def test_with_trans_default_config_and_fallbacks(device):
    from primus_turbo.triton.quantization import quant_fp8_kernel as K

    row, col = K.QuantGrouping(0, 1, 128), K.QuantGrouping(0, 128, 1)
    assert K.with_trans_config(16384, 7168, row, col) == (128, 128, 4, 168, "staged")
    assert K.with_trans_config(16384, 7168, K.QuantGrouping(1, 1, 32), K.QuantGrouping(1, 32, 1)) == (64, 128, 4)
    assert K._dual_ok(16384, 7168, row, col, (128, 128, 4))
    assert not K._dual_ok(130, 256, row, col, (128, 128, 4))  # rows % 4: generic kernel
    assert not K._dual_ok(128, 256, row, col, (64, 128, 4))   # tile shorter than a column block
    assert not K._dual_ok(128, 256, K.QuantGrouping(0, 128, 128), K.QuantGrouping(0, 128, 128), (128, 128, 4))
    assert not K._dual_ok(128, 256, K.QuantGrouping(1, 1, 32), K.QuantGrouping(1, 32, 1), (64, 128, 4, 0, "staged"))
    # bf16 -> E4M3 BLOCKWISE / MX take the bf16-pair kernel by default; other groupings do not
    assert K.packed_with_trans_config(row) == (128, 128, 4, "packed2", 128, "inreg,tscale")
    assert K.packed_with_trans_config(K.QuantGrouping(1, 1, 32)) == (64, 128, 4, "packed2", 0, "tscale")
    assert K.packed_with_trans_config(K.QuantGrouping(0, 1, 64)) is None
    # the default on bf16 (the pair kernel, ragged edges included) and on fp16 (the tl kernel) agree
    # with the reference bit for bit, NaN / Inf / -0 included
    for dtype, shape in ((torch.bfloat16, (200, 260)), (torch.bfloat16, (224, 288)), (torch.bfloat16, (256, 384)),
                         (torch.float16, (224, 288))):
        for gran in (G.BLOCKWISE, G.MX_BLOCKWISE) if shape[0] % 32 == 0 and shape[1] % 32 == 0 else (G.BLOCKWISE,):
            x = _sample(shape, dtype, device, seed=shape[0] + 7)
            x[1, 2], x[2, 5], x[3, 0] = float("nan"), float("-inf"), -0.0
            outs = _launch_with_trans(x, E4M3, gran, None)
            for what, o, r in zip(("row copy", "row scale", "col copy", "col scale"), outs,
                                  _with_trans_refs(x, E4M3, gran)):
                assert_bits_equal(o.view(r.dtype) if o.dtype != r.dtype else o, r, f"{what} {dtype} {shape} {gran}")
    # rows % 4 != 0 and the generic (square tile) override give the same bytes as the reference
    for shape, tile in (((130, 256), None), ((128, 256), (128, 4))):
        x = _sample(shape, torch.float16, device, seed=4)
        outs = _launch_with_trans(x, E4M3, G.BLOCKWISE, tile)
        for o, r in zip(outs, _with_trans_refs(x, E4M3, G.BLOCKWISE)):
            assert_bits_equal(o, r, f"{shape} {tile}")


FP4_WT_TILES = [(64, 128, 4), (32, 256, 4, 128), (32, 64, 2), (128, 64, 4), (64, 64, 4, "generic")]


@pytest.mark.parametrize("tile", FP4_WT_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("shape", [(64, 128), (96, 160), (32, 32)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp4_with_trans_two_copy_kernel_tiles(shape, tile, device):
    from primus_turbo.triton.quantization.quant_fp4_kernel import fp4_quant_launch

    x = _sample(shape, torch.bfloat16, device, seed=shape[0])
    x[0, 1] = float("nan")
    x[4, 9] = float("-inf")
    x[7, 3] = -0.0
    outs = fp4_quant_launch(x, True, with_trans=True, tile=tile)
    p_ref, s_ref = quantize_fp4_ref(x)
    pt_ref, st_ref = quantize_fp4_ref(x.t().contiguous())
    for what, o, r in zip(("data", "scale", "t data", "t scale"), outs, (p_ref, s_ref, pt_ref, st_ref)):
        assert_bits_equal(o.view(torch.uint8), r.view(torch.uint8), f"{what} {tile}")


def test_fp4_with_trans_two_copy_kernel_sr_matches_generic(device):
    # stochastic rounding is keyed by element position, so the two-copy kernel and the generic
    # kernel draw the same uniforms: bit-identical outputs (also with a fp32 input and tails)
    from primus_turbo.triton.quantization.quant_fp4_kernel import fp4_quant_launch

    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    for shape, dtype in (((64, 128), torch.bfloat16), ((96, 96), torch.float32)):
        x = _sample(shape, dtype, device, seed=9)
        for sr, sr_t in ((True, True), (False, True), (True, False)):
            a = fp4_quant_launch(x, True, with_trans=True, tile=(64, 64, 4), seed=seed, sr=sr, sr_t=sr_t)
            b = fp4_quant_launch(x, True, with_trans=True, tile=(64, 64, 4, "generic"), seed=seed, sr=sr, sr_t=sr_t)
            for o, r in zip(a, b):
                assert_bits_equal(o, r, f"{shape} sr={sr} sr_t={sr_t}")


def test_fp4_e2m1_encoder_every_bf16(device):
    # every finite bf16 magnitude (both signs) through the single-copy kernel: blocks of 32 whose
    # amax is 4..8 put each value on the E2M1 grid's scale as given (block amax 6 -> scale 1)
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    vals = bits[bits.abs() <= 6.0]
    n = (vals.numel() + 30) // 31 * 31
    vals = torch.cat([vals, torch.zeros(n - vals.numel())]).view(-1, 31)
    x = torch.cat([torch.full((vals.shape[0], 1), 6.0), vals], dim=1)  # amax 6 per block
    x = torch.cat([x, -x]).to(torch.bfloat16).to(device)
    p, s = Q.quantize_fp4(x)
    p_ref, s_ref = quantize_fp4_ref(x)
    assert_bits_equal(p.view(torch.uint8), p_ref.view(torch.uint8), "fp4 data")
    assert_bits_equal(s, s_ref, "fp4 scale")


def test_fp4_config_defaults():
    from primus_turbo.triton.quantization import quant_fp4_kernel as K

    assert K.fp4_config(16384, 7168, True, True) == (64, 128, 4, 128)
    assert K.fp4_config(16384, 7168, True, False) == (8, 1024, 4)
    for cfg in K.FP4_WITH_TRANS_CANDIDATES:
        if cfg[0] == "gluon":  # ("gluon", TWP, WI, WP): quant_fp4_gluon.py's tiles
            from primus_turbo.triton.quantization.quant_fp4_gluon import gluon_tile

            tr, tc = gluon_tile(cfg[1:])
        else:
            tr, tc = cfg[:2]
        assert tr % 32 == 0 and tc % 32 == 0


def test_two_copy_launchers_strided_input(device):
    # a view with a non-unit column stride takes the generic kernels (the two-copy kernels read
    # 16-byte row vectors): same bytes as the contiguous input through the two-copy kernels
    from primus_turbo.triton.quantization.quant_fp4_kernel import fp4_quant_launch

    big = _sample((128, 64), torch.bfloat16, device, seed=2)
    xt = big.t()  # [64, 128], strides (1, 64)
    for a, b in zip(_launch_with_trans(xt, E4M3, G.MX_BLOCKWISE, None),
                    _launch_with_trans(xt.contiguous(), E4M3, G.MX_BLOCKWISE, None)):
        assert_bits_equal(a, b, "fp8 mx")
    for a, b in zip(fp4_quant_launch(xt, True, with_trans=True), fp4_quant_launch(xt.contiguous(), True, with_trans=True)):
        assert_bits_equal(a, b, "fp4")


# ---- BLOCKWISE b x b blocks of a batch of matrices (grouped-GEMM expert weights) in one launch -
def _expert_weights(nb, r, c, in_dtype, device, seed):
    """[nb, r, c] with per-expert magnitudes, a few large outliers per expert and one all-zero
    b x b block per expert (expert 0: the partial last block row's first block; others: the first
    block), so zero blocks (scale 1) and outlier-dominated blocks both occur."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(nb, r, c, generator=gen) * torch.exp2(torch.randint(-8, 9, (nb, 1, 1), generator=gen).float())
    for e in range(nb):
        idx = torch.randint(0, r * c, (4,), generator=gen)
        w[e].view(-1)[idx] = torch.randn(4, generator=gen).sign() * 3.0e4 * (1 + torch.rand(4, generator=gen))
        r0 = (r - 1) // 128 * 128 if e == 0 else 0
        w[e, r0:r0 + 128, :128] = 0.0
    return w.to(in_dtype).to(device)


BATCHED_CASES = [(nb, r, c, 128) for nb in (1, 3) for r in (200, 64, 130, 320) for c in (128, 200, 384)]
BATCHED_CASES += [(3, r, 200, 32) for r in (200, 64, 130, 320)]


@pytest.mark.parametrize("nb, r, c, bs", BATCHED_CASES, ids=[f"G{n}-R{r}-C{c}-b{b}" for n, r, c, b in BATCHED_CASES])
def test_blocks_batched_matches_per_matrix(nb, r, c, bs, device):
    """One batched launch (b x b blocks of every matrix of [B, R, C], any R) is bit-identical to
    quantizing each matrix alone and stacking: data bytes and fp32 scales, zero blocks included."""
    for i, (in_dtype, out_dtype) in enumerate([(torch.float32, E4M3), (torch.bfloat16, E5M2),
                                               (torch.bfloat16, E4M3), (torch.float32, E5M2)]):
        w = _expert_weights(nb, r, c, in_dtype, device, seed=1000 * r + 10 * c + nb + i)
        q, s = Q._quantize_fp8_blocks_batched(w, out_dtype, bs)
        per = [Q.quantize_fp8(w[e], out_dtype, G.BLOCKWISE, block_size=bs, scaling_recipe=R2D) for e in range(nb)]
        nr, nc = -(-r // bs), -(-c // bs)
        assert q.shape == (nb, r, c) and q.dtype == out_dtype and q.is_contiguous()
        assert s.shape == (nb, nr, nc) and s.dtype == torch.float32 and s.is_contiguous()
        assert torch.equal(q.view(torch.uint8), torch.stack([p[0] for p in per]).view(torch.uint8))
        assert torch.equal(s, torch.stack([p[1] for p in per]))
        if bs == 128:  # the zero blocks have scale_inv 1; the first per-matrix check ran the kernel
            assert s[0, nr - 1, 0] == 1.0 and (nb == 1 or bool((s[1:, 0, 0] == 1.0).all()))


@pytest.mark.parametrize("nb, r, c", [(1, 200, 128), (3, 132, 200), (2, 320, 384), (3, 64, 136), (2, 256, 96)])
def test_blocks_batched_with_trans(nb, r, c, device):
    """The transposed codes from the same launch equal the forward codes transposed, bit for bit,
    and the forward copy and scales equal the one-copy launch's (R a multiple of 4 and of 16 or
    not, ragged C, zero blocks, a strided input)."""
    for i, (in_dtype, out_dtype) in enumerate([(torch.bfloat16, E4M3), (torch.float32, E5M2)]):
        w = _expert_weights(nb, r, c, in_dtype, device, seed=97 * r + c + i)
        # special values: the transposed copy forms its block scales again from a second read
        w[-1, 1, 2], w[-1, r - 1, c - 1], w[0, 3, 1] = float("nan"), float("inf"), float("-inf")
        q0, s0 = Q._quantize_fp8_blocks_batched(w, out_dtype, 128)
        q, s, qt = Q._quantize_fp8_blocks_batched_t(w, out_dtype, 128)
        assert qt.shape == (nb, c, r) and qt.dtype == out_dtype and qt.is_contiguous()
        assert_bits_equal(q, q0)
        assert_bits_equal(s, s0)
        assert_bits_equal(qt, q0.transpose(1, 2).contiguous())
        # the [G, K, N] weights seen as [G, N, K]: a strided view reads the same values
        _, _, qt2 = Q._quantize_fp8_blocks_batched_t(w.transpose(1, 2).contiguous().transpose(1, 2), out_dtype, 128)
        assert_bits_equal(qt2, qt)
    from primus_turbo.triton.quantization import QuantGrouping, fp8_quant_batched_launch

    with pytest.raises(ValueError, match="128 x 128 fp32 blocks"):
        fp8_quant_batched_launch(w, E4M3, QuantGrouping(1, 1, 32), with_trans=True)
    with pytest.raises(ValueError, match="128 x 128 fp32 blocks"):
        fp8_quant_batched_launch(w, E4M3, QuantGrouping(0, 64, 64), with_trans=True)
    with pytest.raises(ValueError, match="rows % 4"):
        fp8_quant_batched_launch(w[:, :r - 2], E4M3, QuantGrouping(0, 128, 128), with_trans=True)
    qe, se, qte = Q._quantize_fp8_blocks_batched_t(torch.empty((2, 0, 128), device=device), E4M3, 128)
    assert qe.shape == (2, 0, 128) and qte.shape == (2, 128, 0) and se.shape == (2, 0, 1)


def test_blocks_batched_launcher_strides_empty_and_reference(device, monkeypatch):
    from primus_turbo.triton.quantization import QuantGrouping, fp8_quant_batched_launch

    w = _expert_weights(3, 200, 160, torch.bfloat16, device, seed=7)
    q, s = fp8_quant_batched_launch(w, E4M3, QuantGrouping(0, 128, 128))
    # a strided view (the [G, K, N] weights seen as [G, N, K]) reads the same values
    qt, st = fp8_quant_batched_launch(w.transpose(1, 2).contiguous().transpose(1, 2), E4M3, QuantGrouping(0, 128, 128))
    assert torch.equal(q.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s, st)
    # MX 1 x 32 through the same kernel: each matrix as alone
    qm, sm = fp8_quant_batched_launch(w, E4M3, QuantGrouping(1, 1, 32))
    for e in range(3):
        q1, s1 = Q.quantize_fp8(w[e], E4M3, G.MX_BLOCKWISE)
        assert torch.equal(qm[e].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(sm[e], s1.view(torch.uint8))
    for shape in ((0, 64, 128), (2, 0, 128), (2, 64, 0)):
        qe, se = Q._quantize_fp8_blocks_batched(torch.empty(shape, device=device), E4M3, 128)
        assert qe.shape == shape and se.shape == (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    with pytest.raises(ValueError, match="3-D"):
        fp8_quant_batched_launch(w[0], E4M3, QuantGrouping(0, 128, 128))
    with pytest.raises(ValueError, match="fit one tile"):
        fp8_quant_batched_launch(w, E4M3, QuantGrouping(2, 1, 1))
    if torch.cuda.is_available():
        return  # the interpreter cannot be switched off for the reference comparison here
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert Q.quant_backend(w) == "reference"
    qr, sr = Q._quantize_fp8_blocks_batched(w, E4M3, 128)  # the per-matrix reference loop
    assert_bits_equal(qr, q)
    assert_bits_equal(sr, s)


def test_blocks_batched_torch_compile(device):
    w = _expert_weights(2, 200, 128, torch.bfloat16, device, seed=3)
    compiled = torch.compile(lambda t: Q._quantize_fp8_blocks_batched(t, E4M3, 128), fullgraph=True,
                             backend="aot_eager")
    q, s = compiled(w)
    q2, s2 = Q._quantize_fp8_blocks_batched(w, E4M3, 128)
    assert_bits_equal(q, q2)
    assert_bits_equal(s, s2)
    compiled_t = torch.compile(lambda t: Q._quantize_fp8_blocks_batched_t(t, E4M3, 128), fullgraph=True,
                               backend="aot_eager")
    q3, s3, qt3 = compiled_t(w)
    assert_bits_equal(q3, q2)
    assert_bits_equal(s3, s2)
    assert_bits_equal(qt3, q2.transpose(1, 2).contiguous())


@pytest.mark.parametrize("nb, r, c", [(1, 200, 128), (3, 132, 200), (2, 320, 384), (3, 64, 136), (2, 512, 1024)])
def test_blocks_batched_with_trans_gluon(nb, r, c, device):
    """The Hopper Gluon weight copies write the tl kernel's bytes into poisoned outputs (ragged
    rows and columns with 16-divisible columns, where the forward stores vectorize, special values,
    every launch config with a 128-wide tile)."""
    from primus_turbo.triton.quantization.gather_quant_gluon import GluonGatherQuantConfig
    from primus_turbo.triton.quantization.quant_fp8_gluon import weight_copies_gluon, weight_copies_gluon_reason

    for i, (in_dtype, out_dtype) in enumerate([(torch.bfloat16, E4M3), (torch.bfloat16, E5M2),
                                               (torch.float16, E4M3), (torch.float32, E5M2)]):
        w = _expert_weights(nb, r, c, in_dtype, device, seed=31 * r + c + i)
        w[-1, 1, 2], w[-1, r - 1, c - 1], w[0, 3, 1] = float("nan"), float("inf"), float("-inf")
        reason = weight_copies_gluon_reason(w, out_dtype)
        if reason is not None:
            pytest.skip(reason)
        q0, s0 = Q._quantize_fp8_blocks_batched(w, out_dtype, 128)
        for cfg in (GluonGatherQuantConfig(4, 8, 4), GluonGatherQuantConfig(2, 8, 8), GluonGatherQuantConfig(4, 4, 8),
                    GluonGatherQuantConfig(8, 4, 4)):
            out = (torch.full_like(q0.view(torch.uint8), 0x5A).view(out_dtype), torch.full_like(s0, float("nan")),
                   torch.full((nb, c, r), 0x5A, dtype=torch.uint8, device=device).view(out_dtype))
            q, s, qt = weight_copies_gluon(w, out_dtype, cfg, out=out)
            assert_bits_equal(q, q0)
            assert_bits_equal(s, s0)
            assert_bits_equal(qt, q0.transpose(1, 2).contiguous())


def test_blocks_batched_with_trans_gluon_refusals(device):
    from primus_turbo.triton.quantization.gather_quant_gluon import GluonGatherQuantConfig
    from primus_turbo.triton.quantization.quant_fp8_gluon import weight_copies_gluon_reason

    w = torch.randn(2, 256, 128, device=device, dtype=torch.bfloat16)
    if device == "cpu":
        assert "needs a CUDA sm_90" in weight_copies_gluon_reason(w, E4M3)
        return
    if weight_copies_gluon_reason(w, E4M3) is not None:
        pytest.skip(weight_copies_gluon_reason(w, E4M3))
    assert "not a multiple of 4" in weight_copies_gluon_reason(w[:, :254], E4M3)
    assert "not contiguous" in weight_copies_gluon_reason(w.transpose(1, 2), E4M3)
    assert "must be 128" in weight_copies_gluon_reason(w, E4M3, GluonGatherQuantConfig(4, 8, 2))
    assert "out_dtype" in weight_copies_gluon_reason(w, torch.int8)
    assert weight_copies_gluon_reason(w.float(), E4M3) is None
    assert weight_copies_gluon_reason(w.half(), E4M3) is None
    assert "bf16, fp16 or fp32" in weight_copies_gluon_reason(w.double(), E4M3)



# ---- quantize_fp8_with_trans: column-major MX / 1-D BLOCKWISE scales on every path --------------
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (256, 384)),   # the bf16-pair kernel
                                         (torch.bfloat16, (200, 260)),   # pair kernel, ragged tiles
                                         (torch.float16, (224, 288)),    # the tl two-copy kernel
                                         (torch.bfloat16, (130, 256)),   # rows % 4: the generic kernel
                                         (torch.bfloat16, (0, 256))])    # empty
@pytest.mark.parametrize("gran", [G.BLOCKWISE, G.MX_BLOCKWISE])
def test_with_trans_scales_column_major(device, dtype, shape, gran):
    """MX and 1-D BLOCKWISE scales come back column-major with the reference's values, whichever
    kernel ran; 2-D BLOCKWISE (weights) and ROWWISE stay row-major."""
    if gran == G.MX_BLOCKWISE and (shape[0] % 32 or shape[1] % 32):
        pytest.skip("MX needs rows and cols % 32")
    x = _sample(shape, dtype, device, seed=shape[0] + 3) if shape[0] else torch.empty(shape, dtype=dtype,
                                                                                     device=device)
    q, s, qt, st = Q.quantize_fp8_with_trans(x, E4M3, gran)
    refs = _with_trans_refs(x, E4M3, gran) if shape[0] else None
    for what, t, r in (("row scale", s, refs and refs[1]), ("col scale", st, refs and refs[3])):
        assert t.dim() == 2 and t.t().is_contiguous(), (what, tuple(t.shape), t.stride())
        if r is not None:
            assert_bits_equal(t.view(r.dtype) if t.dtype != r.dtype else t, r, f"{what} {dtype} {shape} {gran}")
    if shape[0] and gran == G.BLOCKWISE and shape[0] % 128 == 0 and shape[1] % 128 == 0:
        w2d = ScalingRecipe(use_2d_block=True)
        _, s2, _, st2 = Q.quantize_fp8_with_trans(x, E4M3, gran, scaling_recipe=w2d)
        assert s2.is_contiguous() and st2.is_contiguous()
        _, sr, _, str_ = Q.quantize_fp8_with_trans(x, E4M3, G.ROWWISE)
        assert sr.is_contiguous() and str_.is_contiguous()


@pytest.mark.parametrize("gran", [G.BLOCKWISE, G.MX_BLOCKWISE])
def test_with_trans_compile_matches_eager_strides(device, gran):
    """The fake implementation promises the strides the eager kernels return (a compiled graph reads
    the scales through those strides)."""
    x = _sample((256, 384), torch.bfloat16, device, seed=9)

    def f(t):
        q, s, qt, st = Q.quantize_fp8_with_trans(t, E4M3, gran)
        d = Q.dequantize_fp8(qt, torch.float32, gran, scale_inv=st)
        return s, st, d, s.float().sum(0) if gran == G.BLOCKWISE else s.view(torch.uint8).float().sum(0)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    ref = f(x)
    for g_, r_ in zip(got, ref):
        assert g_.stride() == r_.stride()
        assert_bits_equal(g_.view(torch.uint8) if g_.dtype == torch.float8_e8m0fnu else g_,
                          r_.view(torch.uint8) if r_.dtype == torch.float8_e8m0fnu else r_)


# ---- the reference API's forms: positional out_dtype / granularity, block_size, recipes --------
FP4_PACKED = getattr(torch, "float4_e2m1fn_x2", None) or torch.uint8
SHUFFLES = [ScalingRecipe(shuffle_scale=True), ScalingRecipe(shuffle_out=True),
            ScalingRecipe(use_2d_block=True, shuffle_scale=True, shuffle_out=True)]


@pytest.mark.parametrize("axis", [-1, 0])
def test_fp4_reference_signatures_match_short_forms(axis, device):
    x = _sample((64, 96), torch.bfloat16, device, seed=21)
    p, s = Q.quantize_fp4(x, axis=axis)
    for gran in (G.MX_BLOCKWISE, "MX_BLOCKWISE", "mx_blockwise"):
        for bs in (None, 32):
            p2, s2 = Q.quantize_fp4(x, FP4_PACKED, gran, block_size=bs, axis=axis, scaling_recipe=None)
            assert p2.dtype == p.dtype
            assert_bits_equal(p2.view(torch.uint8), p.view(torch.uint8), f"{gran} {bs}")
            assert_bits_equal(s2, s)
    p3, s3 = Q.quantize_fp4(x, None, G.MX_BLOCKWISE, axis=axis)  # None: the default packed dtype
    assert p3.dtype == FP4_PACKED and torch.equal(p3.view(torch.uint8), p.view(torch.uint8))
    pu, su = Q.quantize_fp4(x, torch.uint8, axis=axis)  # the same bytes, viewed as uint8
    assert pu.dtype == torch.uint8 and torch.equal(pu, p.view(torch.uint8)) and torch.equal(su, s)
    d = Q.dequantize_fp4(p, torch.float32, scale_inv=s, axis=axis)
    for args, kw in (((G.MX_BLOCKWISE,), dict(block_size=32)), (("MX_BLOCKWISE",), {}), ((), dict(block_size=None)),
                     ((G.MX_BLOCKWISE,), dict(block_size=32, scaling_recipe=ScalingRecipe()))):
        assert_bits_equal(Q.dequantize_fp4(p, torch.float32, *args, axis=axis, scale_inv=s, **kw), d, str(args))
    assert_bits_equal(Q.dequantize_fp4(pu, torch.float32, G.MX_BLOCKWISE, axis=axis, scale_inv=su), d, "uint8")


def test_fp4_with_trans_reference_signature_matches_short_form(device):
    x = _sample((64, 96), torch.bfloat16, device, seed=22)
    ref = Q.quantize_fp4_with_trans(x)
    for out_dtype in (FP4_PACKED, None, torch.uint8):
        got = Q.quantize_fp4_with_trans(x, out_dtype, G.MX_BLOCKWISE, block_size=32, scaling_recipe=None,
                                        scaling_recipe_for_trans=None)
        assert got[0].dtype == got[2].dtype == (out_dtype or FP4_PACKED)
        for g_, r_ in zip(got, ref):
            assert g_.stride() == r_.stride()
            assert_bits_equal(g_.view(torch.uint8), r_.view(torch.uint8), str(out_dtype))
    # stochastic rounding with a fixed seed, and the RHT path (two reads): the same as the short form
    sg = Q.random_hadamard_signs(32, device=device, generator=torch.Generator(device).manual_seed(1))
    for rec, kw in ((ScalingRecipe(use_sr=True), dict(seed=9)), (ScalingRecipe(use_rht=True), dict(rht_signs=sg))):
        a = Q.quantize_fp4_with_trans(x, scaling_recipe=rec, **kw)
        b = Q.quantize_fp4_with_trans(x, torch.uint8, "MX_BLOCKWISE", block_size=32, scaling_recipe=rec, **kw)
        for g_, r_ in zip(b, a):
            assert_bits_equal(g_.view(torch.uint8), r_.view(torch.uint8), str(rec))


def test_fp4_reference_signature_under_compile(device):
    x = _sample((64, 128), torch.bfloat16, device, seed=23)

    def f(t):
        p, s = Q.quantize_fp4(t, torch.uint8, G.MX_BLOCKWISE, block_size=32, axis=-1)
        return p, Q.dequantize_fp4(p, torch.float32, G.MX_BLOCKWISE, block_size=32, axis=-1, scale_inv=s)

    p, d = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    p_ref, d_ref = f(x)
    assert p.dtype == torch.uint8 and torch.equal(p, p_ref)
    assert_bits_equal(d, d_ref)


def test_fp4_reference_signature_errors():
    x = torch.randn(64, 96)
    p, s = Q.quantize_fp4(x)
    for fn in (lambda **k: Q.quantize_fp4(x, **k), lambda **k: Q.quantize_fp4_with_trans(x, **k),
               lambda **k: Q.dequantize_fp4(p, torch.float32, scale_inv=s, **k)):
        with pytest.raises(ValueError, match="MXFP4 needs granularity MX_BLOCKWISE, got granularity=BLOCKWISE"):
            fn(granularity=G.BLOCKWISE)
        with pytest.raises(ValueError, match="MXFP4 needs granularity MX_BLOCKWISE, got granularity=TENSORWISE"):
            fn(granularity="tensorwise")
        with pytest.raises(ValueError, match="granularity='COLWISE' is not a ScalingGranularity"):
            fn(granularity="COLWISE")
        with pytest.raises(ValueError, match=r"MXFP4 block_size must be 32 \(or None\), got block_size=16"):
            fn(block_size=16)
        with pytest.raises(ValueError, match=r"MXFP4 block_size must be 32 \(or None\), got block_size=True"):
            fn(block_size=True)
    for fn, op in ((Q.quantize_fp4, "quantize_fp4"), (Q.quantize_fp4_with_trans, "quantize_fp4_with_trans")):
        for bad in (E4M3, torch.bfloat16, torch.int8):
            with pytest.raises(TypeError, match=rf"{op}: out_dtype must be the packed FP4 dtype, "
                                                rf".*torch.uint8.*got out_dtype={bad}"):
                fn(x, bad)


@pytest.mark.parametrize("recipe", SHUFFLES, ids=["shuffle_scale", "shuffle_out", "both"])
def test_preshuffle_recipes_are_rejected_by_every_op(recipe):
    field = "shuffle_scale" if recipe.shuffle_scale else "shuffle_out"
    msg = rf"ScalingRecipe\.{field}=True \(AMD AITER/hipBLASLt preshuffled .* not supported on this platform"
    x = torch.randn(64, 128)
    q, s = Q.quantize_fp8(x, E4M3, G.BLOCKWISE)
    p, ps = Q.quantize_fp4(x)
    calls = {
        "quantize_fp8": lambda: Q.quantize_fp8(x, E4M3, G.BLOCKWISE, scaling_recipe=recipe),
        "quantize_fp8_with_trans": lambda: Q.quantize_fp8_with_trans(x, E4M3, G.MX_BLOCKWISE, scaling_recipe=recipe),
        "quantize_fp8_with_trans ": lambda: Q.quantize_fp8_with_trans(x, E4M3, G.BLOCKWISE,
                                                                      scaling_recipe_for_trans=recipe),
        "dequantize_fp8": lambda: Q.dequantize_fp8(q, torch.float32, G.BLOCKWISE, scale_inv=s, scaling_recipe=recipe),
        "quantize_fp4": lambda: Q.quantize_fp4(x, scaling_recipe=recipe),
        "quantize_fp4_with_trans": lambda: Q.quantize_fp4_with_trans(x, scaling_recipe=recipe),
        "quantize_fp4_with_trans  ": lambda: Q.quantize_fp4_with_trans(x, scaling_recipe_for_trans=recipe),
        "dequantize_fp4": lambda: Q.dequantize_fp4(p, torch.float32, scale_inv=ps, scaling_recipe=recipe),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=rf"{op.strip()}: {msg}"):
            call()


@pytest.mark.parametrize("axis", [-1, 0])
def test_dequantize_fp4_scaling_recipe(axis, device):
    x = torch.randn((64, 96), generator=torch.Generator().manual_seed(24)).to(device)
    p, s = Q.quantize_fp4(x, axis=axis)
    d = Q.dequantize_fp4(p, torch.bfloat16, scale_inv=s, axis=axis)
    # use_sr (rounding only) and use_2d_block (MXFP4 groups are 1 x 32 here) change nothing in the dequantization
    for rec in (ScalingRecipe(use_sr=True), ScalingRecipe(use_2d_block=True)):
        got = Q.dequantize_fp4(p, torch.bfloat16, G.MX_BLOCKWISE, block_size=32, axis=axis, scale_inv=s,
                               scaling_recipe=rec)
        assert_bits_equal(got, d, str(rec))
    # use_rht with the signs: the transform is undone (the inverse of hadamard_transform, in fp32)
    sg = Q.random_hadamard_signs(32, device=device, generator=torch.Generator(device).manual_seed(2))
    pr, sr = Q.quantize_fp4(x, axis=axis, scaling_recipe=RHT, rht_signs=sg)
    got = Q.dequantize_fp4(pr, torch.float32, G.MX_BLOCKWISE, axis=axis, scale_inv=sr, scaling_recipe=RHT,
                           rht_signs=sg)
    plain = Q.dequantize_fp4(pr, torch.float32, axis=axis, scale_inv=sr)  # the transformed-domain values
    torch.testing.assert_close(Q.hadamard_transform(got, sg, axis=axis), plain, rtol=1e-5, atol=1e-5)
    err_rht = (got.double() - x.double()).norm() / x.double().norm()
    err_transformed = (plain.double() - x.double()).norm() / x.double().norm()
    assert err_rht < 0.2 and err_transformed > 0.9, (err_rht, err_transformed)
    assert Q.dequantize_fp4(pr, torch.bfloat16, axis=axis, scale_inv=sr, scaling_recipe=RHT,
                            rht_signs=sg).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"dequantize_fp4: ScalingRecipe\(use_rht=True\) needs rht_signs"):
        Q.dequantize_fp4(pr, torch.float32, axis=axis, scale_inv=sr, scaling_recipe=RHT)
    with pytest.raises(ValueError, match=r"dequantize_fp4: rht_signs is only used with ScalingRecipe\(use_rht=True\)"):
        Q.dequantize_fp4(pr, torch.float32, axis=axis, scale_inv=sr, rht_signs=sg)
    with pytest.raises(TypeError, match="dequantize_fp4: scaling_recipe must be a ScalingRecipe or None, got dict"):
        Q.dequantize_fp4(pr, torch.float32, axis=axis, scale_inv=sr, scaling_recipe={})


# ---- TENSORWISE amax without a zero-filled buffer; scales written twice (S_TWICE) -------------
def _amax_partials_ref(x: torch.Tensor, progs: int, block: int = 4096) -> torch.Tensor:
    """Slot p: max |x| bits over blocks p, p + progs, ... (the amax kernel's split), 0 if none."""
    bits = x.float().contiguous().view(-1).view(torch.int32) & 0x7FFFFFFF
    n_iters = -(-(-(-bits.numel() // block)) // progs)
    pad = torch.zeros(n_iters * progs * block, dtype=torch.int32, device=bits.device)
    pad[:bits.numel()] = bits
    return pad.view(n_iters, progs, block).amax(dim=(0, 2))


# (rows, cols): one program, several, and more blocks than programs (a loop per program on CPU)
AMAX_SHAPES = [(3, 50), (64, 300), (200, 260)]


@pytest.mark.parametrize("special", ["random", "negative", "inf", "nan", "zeros"])
@pytest.mark.parametrize("shape", AMAX_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_amax_partials_overwrite_poisoned_buffer(shape, special, device):
    from primus_turbo.triton.quantization import quant_fp8_kernel as K

    x = _sample(shape, torch.bfloat16, device, seed=sum(shape))
    n = x.numel()
    if special == "negative":  # the largest magnitude is negative, in the last program's range
        x.view(-1)[n - 1] = -3.0e4
    elif special == "inf":
        x.view(-1)[n // 2] = float("-inf")
    elif special == "nan":  # NaN beats +inf (its bits lie above)
        x.view(-1)[0] = float("inf")
        x.view(-1)[n - 1] = float("nan")
    elif special == "zeros":
        x.zero_()
    progs = K.amax_programs(x)
    # poison: every slot must be written (0x7FFFFFFF is above every |x| bit pattern, NaNs included)
    partials = torch.full((progs,), 0x7FFFFFFF, dtype=torch.int32, device=device)
    K.amax_launch(x, partials)
    got, want = partials.cpu(), _amax_partials_ref(x, progs).cpu()
    if special == "nan":  # a NaN's payload bits are the device's (CUDA keeps bf16 0x7FFF); NaN it must be
        nan = want > 0x7F800000
        assert bool(nan.any()) and bool((got[nan] > 0x7F800000).all()), (got, want)
        got, want = got[~nan], want[~nan]
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="partials must be"):
        K.amax_launch(x, torch.zeros(progs + 1, dtype=torch.int32, device=device))


@pytest.mark.parametrize("special", ["random", "negative", "inf", "nan"])
@pytest.mark.parametrize("out_dtype", FP8, ids=["e4m3", "e5m2"])
def test_tensorwise_multi_partial_amax_matches_reference(out_dtype, special, device):
    """Inputs large enough for several amax partials (the tile kernel reduces them all): both the
    one-copy and the with_trans op match the reference bit for bit, and the copies share a scale."""
    x = _sample((200, 260), torch.float32, device, seed=5)
    if special == "negative":
        x[-1, -1] = -1.0e6
    elif special == "inf":
        x[100, 3] = float("inf")
    elif special == "nan":
        x[0, 0] = float("-inf")
        x[-1, -1] = float("nan")
    q, s = Q.quantize_fp8(x, out_dtype, G.TENSORWISE)
    q_ref, s_ref = quantize_fp8_ref(x, out_dtype, G.TENSORWISE)
    assert_bits_equal(q, q_ref, "data")
    assert_bits_equal(s, s_ref, "scale")
    q2, s2, qt, st = Q.quantize_fp8_with_trans(x, out_dtype, G.TENSORWISE)
    assert_bits_equal(q2, q_ref, "row copy")
    assert_bits_equal(s2, s_ref, "row scale")
    assert_bits_equal(qt, q_ref.t().contiguous(), "column copy")
    assert_bits_equal(st, s_ref, "column scale")
    assert st.data_ptr() != s2.data_ptr()  # custom-op outputs never alias


@pytest.mark.parametrize("case", [("tensorwise", G.TENSORWISE, 0), ("block128x128", G.BLOCKWISE, 128),
                                  ("block32x32", G.BLOCKWISE, 32)], ids=lambda c: c[0])
def test_fp8_quant_launch_scales_twice(case, device):
    """``st``: the same scales, transposed, written by the same launch into a poisoned buffer."""
    from primus_turbo.triton.quantization import quant_fp8_kernel as K

    _, gran, b = case
    x = _sample((96, 200), torch.bfloat16, device, seed=11)
    grouping = K.QuantGrouping(2, 96, 200) if gran == G.TENSORWISE else K.QuantGrouping(0, b, b)
    n_sr, n_sc = grouping.scale_grid(96, 200)
    shape = () if gran == G.TENSORWISE else (n_sc, n_sr)
    st = torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    q, s = K.fp8_quant_launch(x, E4M3, grouping, st=st)
    q1, s1 = K.fp8_quant_launch(x, E4M3, grouping)
    assert_bits_equal(q, q1, "data")
    assert_bits_equal(s, s1, "scale")
    assert_bits_equal(st, s1 if gran == G.TENSORWISE else s1.t().contiguous(), "scale written twice")
    q_ref, s_ref = quantize_fp8_ref(x, E4M3, gran, **({} if gran == G.TENSORWISE else
                                                     {"block_size": b, "scaling_recipe": R2D}))
    assert_bits_equal(s, s_ref, "scale vs reference")


def test_fp8_quant_launch_scales_twice_errors(device):
    from primus_turbo.triton.quantization import quant_fp8_kernel as K

    x = _sample((8, 64), torch.float32, device)
    with pytest.raises(ValueError, match="TENSORWISE needs a contiguous x"):
        K.fp8_quant_launch(x.t(), E4M3, K.QuantGrouping(2, 64, 8))
    long_row = K.QuantGrouping(0, 1, 1 << 20)  # a ROWWISE row past one tile: the two-pass kernel
    with pytest.raises(ValueError, match="st .* needs blocks that fit a tile"):
        K.fp8_quant_launch(x, E4M3, long_row, st=torch.empty(1, 8, device=device))
