"""The MX grouped GEMM kernels against float64 products of the dequantized operands: the
MX_BLOCKWISE mode of grouped_gemm_fp8_kernel.py (M-grouped and variable-K) and the MXFP4 kernels
of grouped_gemm_fp4_kernel.py; the 32-aligned padded token layout the variable-K kernels need
(padded_group_layout / gather_rows); validation.

The kernels fold the power-of-two scales in exactly, so only the fp32 accumulation order remains:
fp32 output >= 80 dB against the float64 reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.pytorch.backends.grouped_gemm_fp8 import gather_rows, padded_group_layout  # noqa: E402
from primus_turbo.pytorch.core.low_precision import ScalingGranularity  # noqa: E402
from primus_turbo.pytorch.ops.quantization import quantize_fp4, quantize_fp8  # noqa: E402
from primus_turbo.testing import grouped_gemm_ref, grouped_gemm_variable_k_ref, snr_db  # noqa: E402
from primus_turbo.testing.quant_ref import dequantize_fp4_ref  # noqa: E402
from primus_turbo.triton.grouped_gemm.grouped_gemm_fp4_kernel import (  # noqa: E402
    check_grouped_gemm_fp4_triton,
    check_grouped_gemm_fp4_variable_k_triton,
    grouped_gemm_fp4_triton,
    grouped_gemm_fp4_variable_k_triton,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import (  # noqa: E402
    check_grouped_gemm_fp8_triton,
    check_grouped_gemm_fp8_variable_k_triton,
    grouped_gemm_fp8_triton,
    grouped_gemm_fp8_variable_k_triton,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MX = ScalingGranularity.MX_BLOCKWISE
MIN_SNR = 80.0


def _mx_scale(s: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, s.view(torch.uint8).double() - 127)


def _deq8(q, s, axis=-1):
    """float64 values of an MXFP8 tensor (scales along ``axis`` in blocks of 32)."""
    return q.double() * _mx_scale(s).repeat_interleave(32, dim=axis)


def _quant(kind, x, axis, dtype=E4M3):
    """(q, s, dequantized float64) of a 2-D tensor in MX blocks of 32 along ``axis``."""
    if kind == "fp8":
        q, s = quantize_fp8(x, dtype, MX, axis=axis)
        return q, s, _deq8(q, s, axis)
    q, s = quantize_fp4(x, axis=axis)
    return q, s, dequantize_fp4_ref(q, s, axis=axis).double()


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8).t().contiguous().view(x.dtype)


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("lens, n, k", [([64], 64, 128), ([0, 40, 23], 96, 64)], ids=["G1", "G3"])
def test_grouped_mx_exact(kind, lens, n, k, device):
    G, M = len(lens), sum(lens) + 5
    a = torch.randn(M, k, device=device) * (torch.rand(M, 1, device=device) * 4 + 0.1)
    b = torch.randn(G * n, k, device=device) * (torch.rand(G * n, 1, device=device) + 0.1)
    aq, sa, da = _quant(kind, a, -1)
    bq, sb, db = _quant(kind, b, -1, E5M2)
    bq, sb, db = bq.view(G, n, -1), sb.view(G, n, -1), db.view(G, n, k)
    gl = torch.tensor(lens, dtype=torch.int64, device=device)
    ref = grouped_gemm_ref(da, db, gl, trans_b=True)
    if kind == "fp8":
        assert check_grouped_gemm_fp8_triton(aq, sa, bq, sb, "MX_BLOCKWISE", gl) is None
        outs = [grouped_gemm_fp8_triton(aq, sa, bq, sb, "MX_BLOCKWISE", gl, out_dtype=torch.float32, num_cu=c)
                for c in (None, 1)]
    else:
        assert check_grouped_gemm_fp4_triton(aq, sa, bq, sb, gl) is None
        outs = [grouped_gemm_fp4_triton(aq, sa, bq, sb, gl, out_dtype=torch.float32, num_cu=c) for c in (None, 1)]
    for out in outs:
        assert out.shape == (M, n) and snr_db(ref, out) >= MIN_SNR
        assert torch.equal(out[sum(lens):], torch.zeros_like(out[sum(lens):]))
        assert torch.equal(out, outs[0])


def test_padded_group_layout(device):
    offs = torch.tensor([0, 5, 5, 40, 41], dtype=torch.int64, device=device)  # 3 rows past offs[G]
    src, poffs = padded_group_layout(offs, 44, 32)
    assert poffs.tolist() == [0, 32, 32, 96, 128]
    assert src.numel() == 32 * ((44 + 32 * 4 + 31) // 32)
    want = [-1] * src.numel()
    want[0:5] = range(0, 5)
    want[32:67] = range(5, 40)
    want[96] = 40
    assert src.tolist() == want
    src2, poffs2 = padded_group_layout(offs, 44, 16, nonempty=True)
    assert poffs2.tolist() == [0, 16, 32, 80, 96]  # the empty group gets 16 zero rows
    x = torch.randn(44, 3, device=device).to(E4M3)
    g = gather_rows(x, src)
    assert g.dtype == E4M3 and torch.equal(g[32:64].float(), x[5:37].float()) and not g[5:32].float().any()
    gt = gather_rows(x.t().contiguous(), src, dim=1)
    assert torch.equal(gt.float(), g.t().float())


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("lens", [[64], [20, 0, 45], [70, 0, 10]], ids=["G1", "G3", "G3-body-and-tail"])
def test_grouped_mx_variable_k_exact(kind, lens, device):
    """wgrad on the padded layout: 32-token blocks inside each group; equals the per-group
    MX quantization of each segment (zero padding rows change no block). At BLOCK_K 64 a 96-token
    segment is one unmasked step and a masked 32-token tail step, a 32-token one a tail alone."""
    G, P, Q = len(lens), 96, 64
    M = sum(lens) + 4
    x = torch.randn(M, P, device=device) * (torch.rand(1, P, device=device) + 0.1)
    y = torch.randn(M, Q, device=device) * 3
    gl = torch.tensor(lens, dtype=torch.int64, device=device)
    offs = torch.zeros(G + 1, dtype=torch.int64, device=device)
    offs[1:] = gl.cumsum(0)
    src, poffs = padded_group_layout(offs, M, 32)
    xq, sx, dx = _quant(kind, gather_rows(x, src), 0, E5M2)
    yq, sy, dy = _quant(kind, gather_rows(y, src), 0)
    # the padded layout's blocks are the per-segment quantization of each group alone
    for g in range(G):
        s, e, ps = int(offs[g]), int(offs[g + 1]), int(poffs[g])
        if e > s:
            seg = torch.zeros(-(-(e - s) // 32) * 32, P, device=device)
            seg[: e - s] = x[s:e]
            _, _, dseg = _quant(kind, seg, 0, E5M2)
            assert torch.equal(dseg, dx[ps:ps + seg.shape[0]])
    ref = grouped_gemm_variable_k_ref(dx, dy, poffs[1:] - poffs[:-1])
    xt, yt, sxt, syt = _t(xq), _t(yq), _t(sx), _t(sy)
    if kind == "fp8":
        assert check_grouped_gemm_fp8_variable_k_triton(xt, sxt, yt, syt, "MX_BLOCKWISE", gl, poffs) is None
        run = lambda **kw: grouped_gemm_fp8_variable_k_triton(xt, sxt, yt, syt, "MX_BLOCKWISE", gl, poffs, **kw)  # noqa: E731
    else:
        assert check_grouped_gemm_fp4_variable_k_triton(xt, sxt, yt, syt, gl, poffs) is None
        run = lambda **kw: grouped_gemm_fp4_variable_k_triton(xt, sxt, yt, syt, gl, poffs, **kw)  # noqa: E731
    out = run(out_dtype=torch.float32)
    assert out.shape == (G, P, Q) and snr_db(ref, out) >= MIN_SNR
    for g, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[g], torch.zeros_like(out[g]))
    acc = torch.randn(G, P, Q, device=device)
    expected = acc.double() + ref
    run(out=acc, accumulate=True)
    assert snr_db(expected, acc) >= MIN_SNR


def test_grouped_mx_validation(device):
    a = torch.randn(8, 64, device=device)
    b = torch.randn(2 * 32, 64, device=device)
    aq, sa = quantize_fp8(a, E4M3, MX, axis=-1)
    bq, sb = quantize_fp8(b, E4M3, MX, axis=-1)
    bq, sb = bq.view(2, 32, 64), sb.view(2, 32, 2)
    gl = torch.tensor([3, 5], dtype=torch.int64, device=device)
    assert check_grouped_gemm_fp8_triton(aq, sa, bq, sb, "MX_BLOCKWISE", gl) is None
    assert "not supported" in check_grouped_gemm_fp8_triton(aq, sa.float(), bq, sb, "MX_BLOCKWISE", gl)
    assert "b_scale" in check_grouped_gemm_fp8_triton(aq, sa, bq, sb[:, :, :1], "MX_BLOCKWISE", gl)
    assert "multiple of 32" in check_grouped_gemm_fp8_triton(aq[:, :48], sa, bq[:, :, :48], sb, "MX_BLOCKWISE", gl)
    assert "multiple of 32" in check_grouped_gemm_fp8_variable_k_triton(
        aq.t()[:, :4], sa, aq.t()[:, :4], sa, "MX_BLOCKWISE", gl)
    assert "BLOCKWISE" in check_grouped_gemm_fp8_variable_k_triton(aq.t(), sa, aq.t(), sa, "BLOCKWISE", gl)
    pa, ps = quantize_fp4(a)
    pb, pbs = quantize_fp4(b)
    pb, pbs = pb.view(2, 32, 32), pbs.view(2, 32, 2)
    assert check_grouped_gemm_fp4_triton(pa, ps, pb, pbs, gl) is None
    assert "K mismatch" in check_grouped_gemm_fp4_triton(pa[:, :16], ps, pb, pbs, gl)
    assert "multiple of 32" in check_grouped_gemm_fp4_triton(pa[:, :8], ps, pb[:, :, :8], pbs, gl)
    assert "e8m0" in check_grouped_gemm_fp4_triton(pa, ps.float(), pb, pbs, gl)
    assert "packed" in check_grouped_gemm_fp4_triton(pa.view(torch.uint8).float(), ps, pb, pbs, gl)
    assert "int64" in check_grouped_gemm_fp4_triton(pa, ps, pb, pbs, gl.int())
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_gemm_fp4_triton(pa[:, :16], ps, pb, pbs, gl)
