"""The fused gather + column-block quantize + transposed store of the grouped FP8 wgrad token copy:
bit-identical to the three passes it replaces (gather_rows, quantize_fp8 along axis 0, byte
transpose), padding rows zero, special values as the quantizer defines them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.pytorch.backends.grouped_gemm_fp8 import gather_rows, padded_group_layout  # noqa: E402
from primus_turbo.pytorch.core.low_precision import ScalingGranularity  # noqa: E402
from primus_turbo.pytorch.ops.quantization import quantize_fp8  # noqa: E402
from primus_turbo.triton.quantization.gather_quant_kernel import gather_quant_cols_t_launch  # noqa: E402


def _three_pass(x, src, dtype, bs):
    q, s = quantize_fp8(gather_rows(x, src), dtype, ScalingGranularity.BLOCKWISE, block_size=bs, axis=0)
    return q.view(torch.uint8).t(), s


def _case(lens, c, xdtype, seed, device):
    """(x [sum(lens) + 3, c] with a zero row, inf and NaN, src of its padded layout, block size)."""
    torch.manual_seed(seed)
    m = sum(lens) + 3  # rows past the routed ones are never gathered
    x = (torch.randn(m, c, device=device) * torch.logspace(-3, 3, c, device=device)).to(xdtype)
    if m > 10:
        x[2, :] = 0.0  # a zero row inside a block
        x[7, 3] = float("inf")
        x[9, 5] = float("nan")
    offs = torch.zeros(len(lens) + 1, dtype=torch.int64, device=device)
    offs[1:] = torch.cumsum(torch.tensor(lens, device=device), 0)
    bs = 128 if c != 16 else 32
    src, _poffs = padded_group_layout(offs, m, bs)
    return x, src, bs


@pytest.mark.parametrize("lens,c", [([5, 0, 130, 64], 96), ([128, 256], 200), ([1], 16), ([0, 0], 64)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_matches_the_three_passes(lens, c, xdtype, dtype, device):
    x, src, bs = _case(lens, c, xdtype, len(lens) * 31 + c, device)
    q_t, s = gather_quant_cols_t_launch(x, src, dtype, bs)
    assert q_t.shape == (c, src.numel()) and q_t.dtype == dtype and s.shape == (src.numel() // bs, c)
    ref_q, ref_s = _three_pass(x, src, dtype, bs)
    assert torch.equal(q_t.view(torch.uint8), ref_q)
    assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32))  # NaN scales compare bitwise
    pad = (src < 0).nonzero().flatten()
    if pad.numel():
        assert torch.all(q_t.view(torch.uint8)[:, pad] == 0)


def test_strided_rows_and_errors(device):
    base = torch.randn(300, 160, device=device, dtype=torch.bfloat16)
    x = base[:, :128]  # row stride 160
    src = torch.arange(256, device=device, dtype=torch.int64)
    src[250:] = -1
    q_t, s = gather_quant_cols_t_launch(x, src, torch.float8_e4m3fn, 128)
    ref_q, ref_s = _three_pass(x, src, torch.float8_e4m3fn, 128)
    assert torch.equal(q_t.view(torch.uint8), ref_q) and torch.equal(s, ref_s)
    with pytest.raises(ValueError, match="multiple of block_size"):
        gather_quant_cols_t_launch(x, src[:200], torch.float8_e4m3fn, 128)
    with pytest.raises(ValueError, match="power of two"):
        gather_quant_cols_t_launch(x, src, torch.float8_e4m3fn, 96)
    with pytest.raises(ValueError, match="unit column stride"):
        gather_quant_cols_t_launch(x.t(), src, torch.float8_e4m3fn, 128)
    with pytest.raises(ValueError, match="float8"):
        gather_quant_cols_t_launch(x, src, torch.int8, 128)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        gather_quant_cols_t_launch(x.to(torch.float64), src, torch.float8_e4m3fn, 128)


def _gluon_reason(x, src, dtype, bs):
    from primus_turbo.triton.quantization.gather_quant_gluon import gather_quant_gluon_reason

    return gather_quant_gluon_reason(x, src, dtype, bs)


@pytest.mark.parametrize("lens,c", [([5, 0, 130, 64], 96), ([128, 256], 200), ([700, 1, 300], 2880),
                                    ([1000, 3], 384), ([0, 0], 64)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_gluon_kernel_matches_the_tl_kernel(lens, c, xdtype, dtype, device):
    """The Hopper Gluon twin writes the tl kernel's bytes (codes, scales, zero padding rows), with
    zero rows, inf and NaN inside blocks, partial column tiles and every launch config's layout."""
    x, src, bs = _case(lens, c, xdtype, len(lens) * 17 + c, device)
    reason = _gluon_reason(x, src, torch.float8_e4m3fn, bs)
    if reason is not None:
        pytest.skip(reason)
    from primus_turbo.triton.quantization.gather_quant_gluon import GluonGatherQuantConfig, gather_quant_cols_t_gluon

    ref_q, ref_s = gather_quant_cols_t_launch(x, src, dtype, bs, gluon=False)
    for cfg in (None, GluonGatherQuantConfig(4, 8, 4), GluonGatherQuantConfig(2, 8, 4),
                GluonGatherQuantConfig(4, 4, 2), GluonGatherQuantConfig(8, 8, 4), GluonGatherQuantConfig(1, 8, 4)):
        q_t = torch.full_like(ref_q.view(torch.uint8), 0x5A).view(dtype)  # poisoned
        s = torch.full_like(ref_s, float("nan"))
        if cfg is None:
            q_t, s = gather_quant_cols_t_launch(x, src, dtype, bs, gluon=True)
        else:
            gather_quant_cols_t_gluon(x, src, dtype, q_t, s, cfg)
        assert torch.equal(q_t.view(torch.uint8), ref_q.view(torch.uint8)), cfg
        assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32)), cfg


def test_gluon_kernel_refusals(device):
    x = torch.randn(256, 128, device=device, dtype=torch.bfloat16)
    src = torch.arange(256, device=device, dtype=torch.int64)
    if device == "cpu":
        with pytest.raises(ValueError, match=r"gluon=True\): tensors on cpu"):
            gather_quant_cols_t_launch(x, src, torch.float8_e4m3fn, 128, gluon=True)
    elif _gluon_reason(x, src, torch.float8_e4m3fn, 128) is None:
        with pytest.raises(ValueError, match="128-token blocks only"):
            gather_quant_cols_t_launch(x, src, torch.float8_e4m3fn, 64, gluon=True)
        with pytest.raises(ValueError, match="16-byte aligned"):
            gather_quant_cols_t_launch(torch.randn(256, 129, device=device, dtype=torch.bfloat16)[:, :128], src,
                                       torch.float8_e4m3fn, 128, gluon=True)
    with pytest.raises(ValueError, match="no tc / num_warps"):
        gather_quant_cols_t_launch(x, src, torch.float8_e4m3fn, 128, gluon=True, tc=64)
    from primus_turbo.triton.quantization.gather_quant_gluon import GluonGatherQuantConfig

    assert "spw must be" in GluonGatherQuantConfig(3, 8, 4).reason()
    assert GluonGatherQuantConfig(4, 8, 4).tc == 128 and GluonGatherQuantConfig(4, 8, 2).tc == 64
    assert GluonGatherQuantConfig(1, 8, 4).tc == 32 and GluonGatherQuantConfig(8, 8, 4).tc == 256
