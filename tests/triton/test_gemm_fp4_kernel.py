"""gemm_fp4_triton (the emulated MXFP4 GEMM) against a float64 reference on the dequantized
operands, ``dequantize_fp4_ref(A) @ dequantize_fp4_ref(B).T``: tails in M and N, output dtypes,
accumulate, strided operands, scale extremes, empty problems and bad input.

The kernel decodes E2M1 and folds the power-of-two scales in exactly, so only the fp32
accumulation order and the output rounding remain: >= 80 dB for fp32 output; bf16 output >= 45 dB
on GPU and >= 41 dB on CPU (the Triton interpreter truncates fp32 -> bf16 instead of rounding).
On CPU the kernel runs in the interpreter with 32x32x64 tiles and 3 persistent programs, so
multi-tile shapes take the persistent loop several turns.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.testing.quant_ref import dequantize_fp4_ref, quantize_fp4_ref  # noqa: E402
from primus_turbo.triton.gemm import gemm_fp4_kernel as fk  # noqa: E402
from primus_turbo.triton.gemm.gemm_fp4_kernel import check_gemm_fp4_triton, gemm_fp4_triton  # noqa: E402

_ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
MIN_SNR = {torch.float32: 80.0, torch.bfloat16: 45.0 if _ON_GPU else 41.0, torch.float16: 50.0}
E8M0 = torch.float8_e8m0fnu


def snr_db(ref, out):
    from primus_turbo.testing import snr_db as _snr

    return _snr(ref.double().cpu(), out.double().cpu())


def operands(M, N, K, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * 3
    b = torch.randn(N, K, generator=g) / 2
    a_q, sa = quantize_fp4_ref(a)
    b_q, sb = quantize_fp4_ref(b)
    ref = dequantize_fp4_ref(a_q, sa).double() @ dequantize_fp4_ref(b_q, sb).double().T
    return [t.to(device) for t in (a_q, sa, b_q, sb)], ref


@pytest.mark.parametrize("shape", [(70, 90, 192), (64, 96, 96), (33, 17, 32)], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_reference(shape, out_dtype, device):
    M, N, K = shape
    (a_q, sa, b_q, sb), ref = operands(M, N, K, device)
    out = gemm_fp4_triton(a_q, sa, b_q, sb, out_dtype=out_dtype)
    assert out.shape == (M, N) and out.dtype == out_dtype
    assert snr_db(ref, out) >= MIN_SNR[out_dtype], (shape, out_dtype)


def test_fp32_output_is_exact_on_small_k(device):
    # K = 32: one scale per row of A and of B, so every product is a multiple of 0.25 * sa * sb and
    # |sum| <= 32 * 36 of them: all partial sums are exact in fp32, so the kernel equals the float64
    # reference bit for bit, whatever the summation order.
    (a_q, sa, b_q, sb), ref = operands(40, 24, 32, device, seed=3)
    out = gemm_fp4_triton(a_q, sa, b_q, sb, out_dtype=torch.float32)
    assert torch.equal(out.cpu().double(), ref)


def test_uint8_operands_and_default_dtype(device):
    (a_q, sa, b_q, sb), ref = operands(48, 40, 64, device)
    out = gemm_fp4_triton(a_q.view(torch.uint8), sa.view(torch.uint8), b_q.view(torch.uint8), sb.view(torch.uint8))
    assert out.dtype == torch.bfloat16 and snr_db(ref, out) >= MIN_SNR[torch.bfloat16]


def test_every_code_and_scale_decodes_exactly(device):
    # all 16 nibble codes in both nibble positions, with scales from 2**-20 to 2**20
    M, K = 16, 64
    codes = torch.arange(M * K).remainder(16).reshape(M, K)
    codes = codes[:, torch.randperm(K, generator=torch.Generator().manual_seed(1))]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = (torch.arange(M * 2).reshape(M, 2) * 3 % 41 + 107).to(torch.uint8)
    ident_codes = torch.zeros(K, K, dtype=torch.int64)
    ident_codes[torch.arange(K), torch.arange(K)] = 2  # the value 1.0
    ident = (ident_codes[:, 0::2] | (ident_codes[:, 1::2] << 4)).to(torch.uint8)
    ident_s = torch.full((K, 2), 127, dtype=torch.uint8)
    out = gemm_fp4_triton(packed.to(device), scales.to(device), ident.to(device), ident_s.to(device),
                          out_dtype=torch.float32)
    want = dequantize_fp4_ref(packed, scales.view(E8M0)).double()
    assert torch.equal(out.cpu().double(), want)  # A @ I = A: the decode itself, bit for bit


def test_nan_scale_makes_block_nan(device):
    (a_q, sa, b_q, sb), _ = operands(32, 32, 64, device)
    sa = sa.view(torch.uint8).clone()
    sa[3, 1] = 255
    out = gemm_fp4_triton(a_q, sa, b_q, sb, out_dtype=torch.float32).cpu()
    assert torch.isnan(out[3]).all() and not torch.isnan(out[torch.arange(32) != 3]).any()


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_accumulate_twice(acc_dtype, device):
    (a_q, sa, b_q, sb), ref = operands(70, 90, 128, device)
    start = torch.randn(70, 90).to(acc_dtype)
    out = start.clone().to(device)
    gemm_fp4_triton(a_q, sa, b_q, sb, out=out, accumulate=True)
    gemm_fp4_triton(a_q, sa, b_q, sb, out=out, accumulate=True)
    want = start.double() + 2 * ref
    assert out.dtype == acc_dtype
    assert snr_db(want, out) >= (80.0 if acc_dtype == torch.float32 else 40.0)


def test_out_written_and_strided_operands(device):
    (a_q, sa, b_q, sb), ref = operands(64, 48, 128, device)
    # non-contiguous views: every other packed column pair of a wider buffer, transposed scales
    wide = torch.zeros(64, 128, dtype=torch.uint8, device=device)
    wide[:, ::2] = a_q.view(torch.uint8)
    a_view = wide[:, ::2]
    sa_t = sa.view(torch.uint8).t().contiguous().t()
    out_buf = torch.full((48, 64), 7.0, device=device).t()  # column-major C
    res = gemm_fp4_triton(a_view, sa_t, b_q, sb, out=out_buf)
    assert res is out_buf and snr_db(ref, out_buf) >= MIN_SNR[torch.float32]


def test_empty_problems(device):
    (a_q, sa, b_q, sb), _ = operands(32, 32, 64, device)
    assert gemm_fp4_triton(a_q[:0], sa[:0], b_q, sb).shape == (0, 32)
    z = gemm_fp4_triton(a_q[:, :0], sa[:, :0], b_q[:, :0], sb[:, :0], out_dtype=torch.float32)
    assert z.shape == (32, 32) and torch.equal(z.cpu(), torch.zeros(32, 32))


def test_errors(device):
    (a_q, sa, b_q, sb), _ = operands(32, 32, 64, device)
    with pytest.raises(ValueError, match="K to be a multiple of 32, got K=48"):
        gemm_fp4_triton(a_q[:, :24], sa[:, :1], b_q[:, :24], sb[:, :1])
    with pytest.raises(ValueError, match="K mismatch"):
        gemm_fp4_triton(a_q, sa, b_q[:, :16], sb[:, :1])
    with pytest.raises(TypeError, match="not float4_e2m1fn_x2 or uint8"):
        gemm_fp4_triton(a_q.view(torch.uint8).float(), sa, b_q, sb)
    with pytest.raises(ValueError, match=r"a_scale must have shape \[rows, K/32\] = \[32, 2\]"):
        gemm_fp4_triton(a_q, sa[:, :1], b_q, sb)
    with pytest.raises(TypeError, match="b_scale must be float8_e8m0fnu"):
        gemm_fp4_triton(a_q, sa, b_q, sb.view(torch.uint8).float())
    with pytest.raises(ValueError, match="accumulate=True needs an out"):
        gemm_fp4_triton(a_q, sa, b_q, sb, accumulate=True)
    with pytest.raises(ValueError, match="out has shape"):
        gemm_fp4_triton(a_q, sa, b_q, sb, out=torch.empty(32, 31, device=device))
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_fp4_triton(a_q, sa, b_q, sb, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="2-D"):
        gemm_fp4_triton(a_q[0], sa, b_q, sb)
    assert check_gemm_fp4_triton(a_q, sa, b_q, sb) is None
    assert "multiple of 32" in check_gemm_fp4_triton(a_q[:, :8], sa[:, :1], b_q[:, :8], sb[:, :1])
    with pytest.raises(ValueError, match="block_k must be a multiple of 32"):
        gemm_fp4_triton(a_q, sa, b_q, sb, config=fk.GemmConfig(32, 32, 16, 2, 1, 4, False, use_tma=False))


def test_config_variants(device):
    (a_q, sa, b_q, sb), ref = operands(70, 90, 256, device)
    for cfg in (fk.GemmConfig(32, 64, 128, 1, 1, 4, False, use_tma=False, flatten=False),
                fk.GemmConfig(64, 32, 32, 4, 1, 4, True, use_tma=False, flatten=False)):
        out = gemm_fp4_triton(a_q, sa, b_q, sb, out_dtype=torch.float32, config=cfg)
        assert snr_db(ref, out) >= MIN_SNR[torch.float32], cfg


def test_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setattr(fk, "is_interpreter", lambda: False)
    (a_q, sa, b_q, sb), _ = operands(32, 32, 32)
    assert "needs CUDA" in check_gemm_fp4_triton(a_q, sa, b_q, sb)


def test_refused_under_interpreter_until_bf16_fixed(monkeypatch):
    if _ON_GPU:
        pytest.skip("interpreter-only check")
    monkeypatch.setattr(fk, "bf16_dot_fixed", lambda: False)
    (a_q, sa, b_q, sb), _ = operands(32, 32, 32)
    assert "fix_bf16_dot" in check_gemm_fp4_triton(a_q, sa, b_q, sb)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_large(out_dtype):
    (a_q, sa, b_q, sb), ref = operands(2048, 1536, 4096, device="cuda")
    out = gemm_fp4_triton(a_q, sa, b_q, sb, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert snr_db(ref, out) >= MIN_SNR[out_dtype]
