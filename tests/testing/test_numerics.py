"""Tests for primus_turbo.testing: metrics, references, shape picking."""

from __future__ import annotations

import math

import pytest
import torch

from primus_turbo.testing import (
    SNR_THRESHOLDS,
    assert_snr,
    gemm_backward_ref,
    gemm_ref,
    is_gpu,
    max_abs_err,
    pick_shapes,
    poison_,
    rel_err,
    snr_db,
)

TRANS = [(False, False), (False, True), (True, False), (True, True)]


# ---- snr_db ---------------------------------------------------------------------------------
def test_snr_known_value_60db():
    ref = torch.randn(64, 32, dtype=torch.float64)
    out = ref * (1 + 1e-3)
    assert snr_db(ref, out) == pytest.approx(60.0, abs=1e-6)


def test_snr_scale_free():
    ref = torch.randn(100, dtype=torch.float64) * 1e6
    assert snr_db(ref, ref * (1 + 1e-2)) == pytest.approx(40.0, abs=1e-6)


def test_snr_equal_is_inf():
    ref = torch.randn(8, 8)
    assert snr_db(ref, ref.clone()) == math.inf
    assert snr_db(torch.zeros(4), torch.zeros(4)) == math.inf


def test_snr_mixed_dtypes_in_float64():
    ref = torch.randn(256, 256, dtype=torch.float64)
    out = ref.to(torch.bfloat16)
    snr = snr_db(ref, out)
    # bf16 rounding: 8 significant bits, roughly 50-55 dB on Gaussian data
    assert 45.0 < snr < 60.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_snr_nonfinite_out_is_minus_inf(bad):
    ref = torch.randn(16)
    out = ref.clone()
    out[3] = bad
    assert snr_db(ref, out) == -math.inf


def test_snr_zero_ref_nonzero_out():
    assert snr_db(torch.zeros(4), torch.ones(4)) == -math.inf


def test_snr_rejects_bad_inputs():
    with pytest.raises(ValueError, match="shape"):
        snr_db(torch.zeros(3), torch.zeros(4))
    ref = torch.ones(3)
    ref[0] = float("nan")
    with pytest.raises(ValueError, match="reference"):
        snr_db(ref, torch.ones(3))


# ---- assert_snr -----------------------------------------------------------------------------
def test_assert_snr_passes_and_returns_value():
    ref = torch.randn(32, 32, dtype=torch.float64)
    got = assert_snr(ref, ref * (1 + 1e-3), 59.0)
    assert got == pytest.approx(60.0, abs=1e-6)


def test_assert_snr_fails_with_measured_value():
    ref = torch.randn(32, 32, dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"grad_a: SNR 60\.00 dB is below the required 61\.00 dB"):
        assert_snr(ref, ref * (1 + 1e-3), 61.0, name="grad_a")


def test_assert_snr_nan_fails():
    ref = torch.randn(16)
    out = ref.clone()
    out[0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_snr(ref, out, 0.0)


def test_assert_snr_poisoned_output_fails_any_threshold():
    ref = torch.randn(8, 8)
    out = poison_(torch.empty(8, 8))
    with pytest.raises(AssertionError):
        assert_snr(ref, out, -1000.0)


# ---- rel_err / max_abs_err ------------------------------------------------------------------
def test_rel_err_known_value():
    ref = torch.randn(50, 20, dtype=torch.float64)
    assert rel_err(ref, ref * 1.01) == pytest.approx(0.01, rel=1e-9)
    assert rel_err(ref, ref.clone()) == 0.0


def test_rel_err_nonfinite_and_zero_ref():
    ref = torch.randn(5)
    out = ref.clone()
    out[1] = float("nan")
    assert rel_err(ref, out) == math.inf
    assert rel_err(torch.zeros(3), torch.ones(3)) == math.inf


def test_rel_err_matches_snr():
    ref = torch.randn(64, 64, dtype=torch.float64)
    out = ref + 1e-2 * torch.randn_like(ref)
    assert snr_db(ref, out) == pytest.approx(-20.0 * math.log10(rel_err(ref, out)), rel=1e-9)


def test_max_abs_err():
    ref = torch.zeros(4, 4)
    out = ref.clone()
    out[2, 3] = -0.5
    out[0, 0] = 0.25
    assert max_abs_err(ref, out) == 0.5
    out[1, 1] = float("nan")
    assert max_abs_err(ref, out) == math.inf
    assert max_abs_err(torch.zeros(0), torch.zeros(0)) == 0.0


# ---- poison_ --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_poison_fills_nan_in_place(dtype):
    t = torch.zeros(3, 5, dtype=dtype)
    ptr = t.data_ptr()
    r = poison_(t)
    assert r is t and t.data_ptr() == ptr
    assert torch.isnan(t).all()


def test_poison_view_only_touches_view():
    t = torch.zeros(4, 4)
    poison_(t[1:3])
    assert torch.isnan(t[1:3]).all()
    assert (t[0] == 0).all() and (t[3] == 0).all()


def test_poison_rejects_integer():
    with pytest.raises(TypeError):
        poison_(torch.zeros(3, dtype=torch.int32))


def test_thresholds_present():
    for key, val in {
        "bf16_gemm": 45,
        "fp16_gemm": 50,
        "fp32_gemm": 80,
        "attention": 40,
        "fp8_e4m3": 25,
        "fp8_e5m2": 20,
        "fp8_hybrid": 20,
        "mxfp4": 10,
        "grouped_mxfp4": 8,
    }.items():
        assert SNR_THRESHOLDS[key] == val


# ---- gemm_ref / gemm_backward_ref -----------------------------------------------------------
def _operands(m, n, k, trans_a, trans_b, dtype=torch.float32):
    a = torch.randn((k, m) if trans_a else (m, k), dtype=dtype)
    b = torch.randn((n, k) if trans_b else (k, n), dtype=dtype)
    return a, b


@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_gemm_ref_matches_torch(trans_a, trans_b):
    m, n, k = 17, 23, 31
    a, b = _operands(m, n, k, trans_a, trans_b, torch.float64)
    expect = (a.T if trans_a else a) @ (b.T if trans_b else b)
    got = gemm_ref(a, b, trans_a=trans_a, trans_b=trans_b)
    assert got.dtype == torch.float64 and got.shape == (m, n)
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-12)


@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_gemm_ref_upcasts_low_precision(trans_a, trans_b):
    a, b = _operands(8, 12, 16, trans_a, trans_b, torch.bfloat16)
    got = gemm_ref(a, b, trans_a, trans_b)
    a64, b64 = a.double(), b.double()
    expect = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-12)


def test_gemm_ref_out_dtype_and_errors():
    a, b = _operands(4, 6, 8, False, True)
    out = gemm_ref(a, b, trans_b=True, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 6)
    with pytest.raises(ValueError, match="inner"):
        gemm_ref(a, b)  # b is [N, K] but trans_b not set
    with pytest.raises(ValueError, match="2-D"):
        gemm_ref(torch.zeros(2, 3, 4), torch.zeros(4, 5))


@pytest.mark.parametrize("trans_a,trans_b", TRANS)
def test_gemm_backward_ref_matches_autograd(trans_a, trans_b):
    m, n, k = 13, 9, 21
    a, b = _operands(m, n, k, trans_a, trans_b, torch.float64)
    a.requires_grad_(True)
    b.requires_grad_(True)
    c = (a.T if trans_a else a) @ (b.T if trans_b else b)
    grad = torch.randn(m, n, dtype=torch.float64)
    c.backward(grad)
    ga, gb = gemm_backward_ref(a, b, grad, trans_a=trans_a, trans_b=trans_b)
    assert ga.shape == a.shape and gb.shape == b.shape
    assert ga.dtype == gb.dtype == torch.float64
    torch.testing.assert_close(ga, a.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(gb, b.grad, rtol=0, atol=1e-12)


def test_gemm_backward_ref_shape_check():
    a, b = _operands(4, 6, 8, False, False)
    with pytest.raises(ValueError, match="grad_out"):
        gemm_backward_ref(a, b, torch.zeros(6, 4))


# ---- shapes ---------------------------------------------------------------------------------
def test_is_gpu():
    assert not is_gpu("cpu")
    assert not is_gpu(torch.device("cpu"))
    assert not is_gpu(torch.zeros(1))
    assert is_gpu("cuda")
    assert is_gpu("cuda:1")
    assert is_gpu(torch.device("cuda", 0))
    assert is_gpu(None) == torch.cuda.is_available()


def test_pick_shapes():
    cpu, gpu = [(16, 16, 16)], [(4096, 4096, 4096), (8192, 8192, 8192)]
    assert pick_shapes(cpu, gpu, "cpu") == cpu
    assert pick_shapes(cpu, gpu, "cuda") == gpu
    assert pick_shapes(cpu, gpu, None) == (gpu if torch.cuda.is_available() else cpu)
    got = pick_shapes(cpu, gpu, "cpu")
    got.append((1, 1, 1))
    assert cpu == [(16, 16, 16)]  # a fresh list, the caller's is untouched


def test_pick_shapes_device_fixture(device):
    shapes = pick_shapes(["small"], ["large"], device)
    assert shapes == (["large"] if device == "cuda" else ["small"])
