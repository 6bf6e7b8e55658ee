"""turbo.ops.grouped_gemm_fp4 (MoE experts in emulated MXFP4) against float64 references on the
unquantized inputs: forward and both gradients (SNR >= 8 dB, the grouped MXFP4 bar), 1 and 3
experts with balanced, unbalanced and empty groups, both weight layouts, the zeroed tail rows,
Megatron's fused wgrad accumulation, repeatability, the 32-multiple dims and bad input."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float4QuantConfig
from primus_turbo.testing import grouped_gemm_ref, grouped_gemm_variable_k_ref, snr_db
from tests.grouped_gemm_checks import check_grouped_op

MIN_SNR = 8.0
CASES = [  # (group lens, N, K, trans_b, extra tail rows)
    ([64], 64, 128, True, 0),
    ([40, 0, 23], 96, 64, False, 5),
    ([32, 64, 32], 64, 64, True, 3),
    ([0, 0, 0], 64, 64, False, 4),
]


def _make(lens, n, k, trans_b, device, dtype=torch.bfloat16, extra_rows=0):
    G = len(lens)
    a = torch.randn(sum(lens) + extra_rows, k, dtype=dtype, device=device)
    b = torch.randn((G, n, k) if trans_b else (G, k, n), dtype=dtype, device=device) * k ** -0.5
    return a, b, torch.tensor(lens, dtype=torch.int64, device=device)


def _check(a, b, gl, trans_b, out_dtype=None):
    check_grouped_op(turbo.ops.grouped_gemm_fp4, a, b, gl, trans_b, MIN_SNR, out_dtype)


@pytest.mark.parametrize("lens, n, k, trans_b, extra", CASES,
                         ids=[f"G{len(c[0])}-{c[0]}-{'NT' if c[3] else 'NN'}" for c in CASES])
def test_grouped_gemm_fp4(lens, n, k, trans_b, extra, device):
    a, b, gl = _make(lens, n, k, trans_b, device, extra_rows=extra)
    _check(a, b, gl, trans_b)


def test_fp32_inputs_bf16_out(device):
    a, b, gl = _make([33, 0, 31], 64, 64, True, device, dtype=torch.float32, extra_rows=2)
    _check(a, b, gl, True, out_dtype=torch.bfloat16)


def test_megatron_fused_accumulation_and_repeatable(device):
    k, n = 64, 64
    b = (torch.randn((3, n, k), dtype=torch.bfloat16, device=device) * k ** -0.5).requires_grad_()
    b.main_grad = torch.randn(b.shape, dtype=torch.float32, device=device)
    start = b.main_grad.double().clone()
    expected = start.clone()
    for lens in ([20, 0, 31], [5, 40, 2]):
        gl = torch.tensor(lens, dtype=torch.int64, device=device)
        a = torch.randn(sum(lens), k, dtype=torch.bfloat16, device=device, requires_grad=True)
        out = turbo.ops.grouped_gemm_fp4(a, b, gl, fuse_bgrad_accum_pattern="megatron")
        dc = torch.randn_like(out)
        out.backward(dc)
        expected += grouped_gemm_variable_k_ref(dc, a, gl)
        assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=False), a.grad) >= MIN_SNR
        b.grad = None
    assert b.grad_added_to_main_grad is True
    assert snr_db(expected - start, b.main_grad.double() - start) >= MIN_SNR
    a, w, gl = _make([7, 0, 40], 64, 64, True, device)
    offs = torch.tensor([0, 7, 7, 47], dtype=torch.int64, device=device)
    with torch.no_grad():
        ref = turbo.ops.grouped_gemm_fp4(a, w, gl)
        assert torch.equal(turbo.ops.grouped_gemm_fp4(a, w, gl, group_offs=offs, num_cu=1), ref)
    assert torch.equal(turbo.ops.grouped_gemm_fp4(a.clone().requires_grad_(), w, gl), ref)


def test_empty_shapes(device):
    a, b, gl = _make([0, 0], 64, 64, True, device)
    a.requires_grad_()
    b.requires_grad_()
    out = turbo.ops.grouped_gemm_fp4(a, b, gl)
    assert out.shape == (0, 64)
    out.sum().backward()
    assert b.grad.shape == b.shape and not b.grad.any()


def test_bad_inputs(device):
    a, b, gl = _make([3, 4], 48, 64, True, device)  # N = 48: fine without grad_input
    with torch.no_grad():
        assert turbo.ops.grouped_gemm_fp4(a, b, gl).shape == (7, 48)
    with pytest.raises(ValueError, match="grouped_gemm_fp4: MXFP4 needs N to be a multiple of 32"):
        turbo.ops.grouped_gemm_fp4(a.requires_grad_(), b, gl)
    a, b, gl = _make([3, 4], 64, 80, True, device)
    with pytest.raises(ValueError, match="K to be a multiple of 32, got K=80"):
        turbo.ops.grouped_gemm_fp4(a, b, gl)
    a, b, gl = _make([3, 4], 64, 64, True, device)
    with pytest.raises(TypeError, match="int64"):
        turbo.ops.grouped_gemm_fp4(a, b, gl.int())
    with pytest.raises(ValueError, match="K mismatch"):
        turbo.ops.grouped_gemm_fp4(a[:, :32], b, gl)
    with pytest.raises(TypeError, match="Float4QuantConfig"):
        turbo.ops.grouped_gemm_fp4(a, b, gl, config="MXFP4")
    with pytest.raises(NotImplementedError, match="use_rht"):
        turbo.ops.grouped_gemm_fp4(a, b, gl, config=Float4QuantConfig(use_rht=True))
    with pytest.raises(ValueError, match="main_grad"):
        turbo.ops.grouped_gemm_fp4(a, b.clone().requires_grad_(), gl, fuse_bgrad_accum_pattern="megatron")
    with pytest.raises(TypeError, match="dtype"):
        turbo.ops.grouped_gemm_fp4(a.to(torch.float8_e4m3fn), b, gl)


def test_backend_pin(device):
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

    a, b, gl = _make([5, 27], 64, 64, True, device)
    try:
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="FP4")
        assert snr_db(grouped_gemm_ref(a, b, gl, True), turbo.ops.grouped_gemm_fp4(a, b, gl)) >= MIN_SNR
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH, precision="FP4")
        with pytest.raises(ValueError, match="TORCH"):
            turbo.ops.grouped_gemm_fp4(a, b, gl)
    finally:
        GlobalBackendManager.reset()
