"""The FP8 grouped GEMM kernels (primus_turbo/triton/grouped_gemm/grouped_gemm_fp8_kernel.py) against
float64 products of the dequantized operands: M-grouped (TENSORWISE, ROWWISE, BLOCKWISE; mixed
E4M3 x E5M2) and variable-K (TENSORWISE, ROWWISE), empty and unbalanced groups, the zeroed tail
rows, accumulation, num_cu and input validation."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import ScalingGranularity, ScalingRecipe
from primus_turbo.pytorch.ops.quantization import quantize_fp8
from primus_turbo.testing import grouped_gemm_ref, grouped_gemm_variable_k_ref, snr_db
from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import (
    check_grouped_gemm_fp8_triton,
    grouped_gemm_fp8_triton,
    grouped_gemm_fp8_variable_k_triton,
)

ON_GPU = torch.cuda.is_available()
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# fp32 output: 80 dB on CPU; Hopper's FP8 MMA accumulates with fewer bits than fp32 (75-80 dB
# measured), so 70 dB on the GPU
MIN_SNR = {torch.float32: 70.0 if ON_GPU else 80.0, torch.bfloat16: 45.0 if ON_GPU else 41.0}
LENS = {1: [[64], [0]], 3: [[20, 20, 20], [0, 64, 1]], 8: [[0, 64, 3, 0, 9, 33, 0, 1]]}


def _operands(lens, n, k, mode, device, a_dtype=E4M3, b_dtype=E4M3, extra=0, bs=128):
    """Quantized a [M, K], b [G, N, K] with the kernel's scale shapes, and their dequantized values."""
    G = len(lens)
    M = sum(lens) + extra
    a = torch.randn(M, k, device=device) * torch.rand(M, 1, device=device) * 4
    b = torch.randn(G, n, k, device=device) * (torch.rand(G, n, 1, device=device) + 0.1)
    if mode == "TENSORWISE":
        aq, sa = quantize_fp8(a, a_dtype, ScalingGranularity.TENSORWISE)
        bq, sb = quantize_fp8(b.reshape(G, n * k), b_dtype, ScalingGranularity.ROWWISE, axis=-1)
        bq, sb = bq.view(G, n, k), sb.reshape(G)
        da, db = aq.double() * sa.double(), bq.double() * sb.double()[:, None, None]
    elif mode == "ROWWISE":
        aq, sa = quantize_fp8(a, a_dtype, ScalingGranularity.ROWWISE, axis=-1)
        bq, sb = quantize_fp8(b.reshape(G * n, k), b_dtype, ScalingGranularity.ROWWISE, axis=-1)
        sa, bq, sb = sa.reshape(M), bq.view(G, n, k), sb.reshape(G, n)
        da, db = aq.double() * sa.double()[:, None], bq.double() * sb.double()[:, :, None]
    else:
        aq, sa = quantize_fp8(a, a_dtype, ScalingGranularity.BLOCKWISE, block_size=bs, axis=-1)
        qs = [quantize_fp8(b[g], b_dtype, ScalingGranularity.BLOCKWISE, block_size=bs, axis=-1,
                           scaling_recipe=ScalingRecipe(use_2d_block=True)) for g in range(G)]
        bq, sb = torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
        da = aq.double() * sa.double().repeat_interleave(bs, 1)[:, :k]
        db = bq.double() * sb.double().repeat_interleave(bs, 1)[:, :n].repeat_interleave(bs, 2)[:, :, :k]
    gl = torch.tensor(lens, dtype=torch.int64, device=device)
    return aq, sa, bq, sb, da, db, gl


def _cases():
    i = 0
    for G, ls in LENS.items():
        for lens in ls:
            for mode in ("TENSORWISE", "ROWWISE", "BLOCKWISE"):
                n, k = [(64, 128), (96, 256), (40, 200)][i % 3]
                i += 1
                yield pytest.param(lens, n, k, mode, id=f"G{G}-{lens[:3]}-{n}x{k}-{mode}")


@pytest.mark.parametrize("lens, n, k, mode", list(_cases()))
def test_grouped_fp8_exact(lens, n, k, mode, device):
    aq, sa, bq, sb, da, db, gl = _operands(lens, n, k, mode, device, extra=5)
    ref = grouped_gemm_ref(da, db, gl, trans_b=True)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = grouped_gemm_fp8_triton(aq, sa, bq, sb, mode, gl, out_dtype=out_dtype)
        assert out.dtype == out_dtype and out.shape == (aq.shape[0], n)
        assert snr_db(ref, out) >= MIN_SNR[out_dtype]
        routed = sum(lens)
        assert torch.equal(out[routed:], torch.zeros_like(out[routed:]))


@pytest.mark.parametrize("mode", ["TENSORWISE", "ROWWISE", "BLOCKWISE"])
def test_grouped_fp8_mixed_dtypes_offsets_num_cu(mode, device):
    lens = [7, 0, 30, 12]
    aq, sa, bq, sb, da, db, gl = _operands(lens, 48, 160, mode, device, a_dtype=E5M2, b_dtype=E4M3, extra=3)
    ref = grouped_gemm_ref(da, db, gl, trans_b=True)
    offs = torch.zeros(5, dtype=torch.int64, device=device)
    offs[1:] = gl.cumsum(0)
    outs = [grouped_gemm_fp8_triton(aq, sa, bq, sb, mode, gl, offs, out_dtype=torch.float32, num_cu=c)
            for c in (None, 1, 2)]
    for out in outs:
        assert snr_db(ref, out) >= MIN_SNR[torch.float32]
        assert torch.equal(out, outs[0])  # the schedule does not change any tile's sum
    # strided (non-contiguous) weights: the dgrad-style transposed view of a [G, K, N] copy
    bt = bq.transpose(1, 2).contiguous().transpose(1, 2)
    if mode != "BLOCKWISE":
        out = grouped_gemm_fp8_triton(aq, sa, bt, sb, mode, gl, out_dtype=torch.float32)
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("mode", ["TENSORWISE", "ROWWISE"])
@pytest.mark.parametrize("lens", [[64], [20, 0, 31], [0, 64, 3, 0, 9, 33, 0, 1]], ids=lambda l: f"G{len(l)}")
def test_grouped_fp8_variable_k_exact(lens, mode, device):
    G, P, Q = len(lens), 96, 64
    M = sum(lens) + 4
    x = torch.randn(M, P, device=device) * (torch.rand(1, P, device=device) + 0.1)
    y = torch.randn(M, Q, device=device) * 3
    gl = torch.tensor(lens, dtype=torch.int64, device=device)
    if mode == "TENSORWISE":
        (xq, sx), (yq, sy) = (quantize_fp8(t, d, ScalingGranularity.TENSORWISE) for t, d in ((x, E5M2), (y, E4M3)))
        dx, dy = xq.double() * sx.double(), yq.double() * sy.double()
    else:
        (xq, sx), (yq, sy) = (quantize_fp8(t, d, ScalingGranularity.ROWWISE, axis=0) for t, d in ((x, E5M2), (y, E4M3)))
        dx, dy = xq.double() * sx.double(), yq.double() * sy.double()
        sx, sy = sx.reshape(P), sy.reshape(Q)
    ref = grouped_gemm_variable_k_ref(dx, dy, gl)
    xt, yt = xq.t().contiguous(), yq.t().contiguous()
    out = grouped_gemm_fp8_variable_k_triton(xt, sx, yt, sy, mode, gl, out_dtype=torch.float32)
    assert out.shape == (G, P, Q) and snr_db(ref, out) >= MIN_SNR[torch.float32]
    for g, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[g], torch.zeros_like(out[g]))
    bf = grouped_gemm_fp8_variable_k_triton(xt, sx, yt, sy, mode, gl, out_dtype=torch.bfloat16)
    assert snr_db(ref, bf) >= MIN_SNR[torch.bfloat16]
    acc = torch.randn(G, P, Q, device=device)
    expected = acc.double() + ref
    grouped_gemm_fp8_variable_k_triton(xt, sx, yt, sy, mode, gl, out=acc, accumulate=True)
    assert snr_db(expected, acc) >= MIN_SNR[torch.float32]


def test_grouped_fp8_validation(device):
    aq, sa, bq, sb, _, _, gl = _operands([4, 5], 32, 64, "ROWWISE", device)
    assert check_grouped_gemm_fp8_triton(aq, sa, bq, sb, "ROWWISE", gl) is None
    assert "K mismatch" in check_grouped_gemm_fp8_triton(aq, sa, bq[:, :, :32], sb, "ROWWISE", gl)
    assert "int64" in check_grouped_gemm_fp8_triton(aq, sa, bq, sb, "ROWWISE", gl.int())
    assert "entries" in check_grouped_gemm_fp8_triton(aq, sa, bq, sb, "ROWWISE", gl[:1])
    assert "b_scale" in check_grouped_gemm_fp8_triton(aq, sa, bq, sb[:1], "ROWWISE", gl)
    assert "not supported" in check_grouped_gemm_fp8_triton(aq, sa, bq, sb, "MX_BLOCKWISE", gl)
    assert "float8" in check_grouped_gemm_fp8_triton(aq.float(), sa, bq, sb, "ROWWISE", gl)
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_gemm_fp8_triton(aq, sa, bq[:, :, :32], sb, "ROWWISE", gl)
