"""The FP8 grouped GEMM kernels (primus_turbo/triton/grouped_gemm/grouped_gemm_fp8_kernel.py) against
float64 products of the dequantized operands: M-grouped (TENSORWISE, ROWWISE, BLOCKWISE; mixed
E4M3 x E5M2) and variable-K (TENSORWISE, ROWWISE, and BLOCKWISE 1 x bs token blocks on the padded
group layout), empty and unbalanced groups, the zeroed tail rows, accumulation, num_cu and input
validation."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.backends.grouped_gemm_fp8 import gather_rows, padded_group_layout
from primus_turbo.pytorch.core.low_precision import ScalingGranularity, ScalingRecipe
from primus_turbo.pytorch.ops.quantization import quantize_fp8
from primus_turbo.testing import grouped_gemm_ref, grouped_gemm_variable_k_ref, snr_db
from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import (
    GroupedGemmFP8Config,
    check_grouped_gemm_fp8_triton,
    check_grouped_gemm_fp8_variable_k_triton,
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


def _quant_wgrad_operands(x, y, mode):
    """x (E5M2) and y (E4M3) ``[M, P]`` / ``[M, Q]`` quantized per tensor or per column (along the
    tokens): ``(xq, sx, dx, yq, sy, dy)`` with the dequantized float64 copies and the kernel's
    scale shapes (``[]`` or ``[P]`` / ``[Q]``)."""
    if mode == "TENSORWISE":
        (xq, sx), (yq, sy) = (quantize_fp8(t, d, ScalingGranularity.TENSORWISE) for t, d in ((x, E5M2), (y, E4M3)))
    else:
        (xq, sx), (yq, sy) = (quantize_fp8(t, d, ScalingGranularity.ROWWISE, axis=0) for t, d in ((x, E5M2), (y, E4M3)))
    dx, dy = xq.double() * sx.double(), yq.double() * sy.double()
    if mode != "TENSORWISE":
        sx, sy = sx.reshape(x.shape[1]), sy.reshape(y.shape[1])
    return xq, sx, dx, yq, sy, dy


@pytest.mark.parametrize("mode", ["TENSORWISE", "ROWWISE"])
@pytest.mark.parametrize("lens", [[64], [20, 0, 31], [0, 64, 3, 0, 9, 33, 0, 1]], ids=lambda l: f"G{len(l)}")
def test_grouped_fp8_variable_k_exact(lens, mode, device):
    G, P, Q = len(lens), 96, 64
    M = sum(lens) + 4
    x = torch.randn(M, P, device=device) * (torch.rand(1, P, device=device) + 0.1)
    y = torch.randn(M, Q, device=device) * 3
    gl = torch.tensor(lens, dtype=torch.int64, device=device)
    xq, sx, dx, yq, sy, dy = _quant_wgrad_operands(x, y, mode)
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


# Group offsets of every alignment from a first offset of 3 (as the bf16 kernel's test): head-only,
# head + tail, head + body + tail, single-row, empty and aligned-start groups
UNALIGNED_FIRST = 3
UNALIGNED_LENS = [0, 5, 37, 16, 0, 70, 1, 12, 100]


@pytest.mark.parametrize("mode", ["TENSORWISE", "ROWWISE"])
def test_grouped_fp8_variable_k_unaligned_offsets(mode, device):
    """The K loop's masked head up to a multiple of 16, unmasked whole BLOCK_K steps and masked tail
    on token-contiguous operands, with the op layer's row stride rounded up to 16 and a plain
    contiguous odd one, at BLOCK_K 32 and 64."""
    from primus_turbo.pytorch.ops.quantization import _transpose_bytes

    G, P, Q = len(UNALIGNED_LENS), 48, 40
    M = UNALIGNED_FIRST + sum(UNALIGNED_LENS) + 5  # 249: not a multiple of 16
    x = torch.randn(M, P, device=device) * (torch.rand(1, P, device=device) + 0.1)
    y = torch.randn(M, Q, device=device) * 3
    gl = torch.tensor(UNALIGNED_LENS, dtype=torch.int64, device=device)
    offs = torch.full((G + 1,), UNALIGNED_FIRST, dtype=torch.int64, device=device)
    offs[1:] += gl.cumsum(0)
    xq, sx, dx, yq, sy, dy = _quant_wgrad_operands(x, y, mode)
    ref = grouped_gemm_variable_k_ref(dx[UNALIGNED_FIRST:], dy[UNALIGNED_FIRST:], gl)
    aligned = _transpose_bytes(xq, 16), _transpose_bytes(yq, 16)
    assert aligned[0].stride() == (256, 1) and torch.equal(aligned[0].view(torch.uint8), xq.view(torch.uint8).t())
    first = None
    for xt, yt in (aligned, (xq.t().contiguous(), yq.t().contiguous())):
        for bk in (32, 64):
            cfg = GroupedGemmFP8Config(32, 32, bk, group_m=2, num_stages=1, num_warps=4)
            out = grouped_gemm_fp8_variable_k_triton(xt, sx, yt, sy, mode, gl, offs, out_dtype=torch.float32,
                                                     config=cfg)
            assert out.shape == (G, P, Q) and snr_db(ref, out) >= MIN_SNR[torch.float32], bk
            for g, n in enumerate(UNALIGNED_LENS):
                if n == 0:
                    assert torch.equal(out[g], torch.zeros_like(out[g]))
            if bk == 32:
                first = out if first is None else first
                assert torch.equal(out, first)  # the row stride changes no sum
    acc = torch.randn(G, P, Q, device=device)
    expected = acc.double() + ref
    grouped_gemm_fp8_variable_k_triton(*aligned[:1], sx, aligned[1], sy, mode, gl, offs, out=acc, accumulate=True,
                                       num_cu=1)
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


# ----------------------------------------------------------------------------------------------
# BLOCKWISE variable-K (wgrad): 1 x bs token blocks on the padded group layout
# ----------------------------------------------------------------------------------------------
def _blockwise_token_copy(x, src, dtype, bs):
    """The padded layout's column-wise copy stored transposed ([C, M_pad], fp32 scales [C, M_pad/bs])
    and its dequantized value ([M_pad, C], float64)."""
    q, s = quantize_fp8(gather_rows(x, src), dtype, ScalingGranularity.BLOCKWISE, block_size=bs, axis=0)
    deq = q.double() * s.double().repeat_interleave(bs, 0)
    return q.t().contiguous(), s.t().contiguous(), deq


@pytest.mark.parametrize("lens, bs", [([300], 128), ([130, 0, 77], 128), ([0, 5, 64], 64)],
                         ids=["G1-300", "G3-unbalanced-empty", "G3-bs64"])
def test_grouped_fp8_variable_k_blockwise_exact(lens, bs, device):
    """out[g] = dequant(x_t)[:, segment g] @ dequant(y_t)[:, segment g].T with each segment padded
    to a multiple of bs: every K step is promoted with its two token-block scales."""
    G, P, Q = len(lens), 96, 64
    M = sum(lens) + 6  # tail rows past offs[G] are dropped by the layout
    x = torch.randn(M, P, device=device) * (torch.rand(M, 1, device=device) * 4 + 0.1)  # scales vary by block
    y = torch.randn(M, Q, device=device) * 3
    gl = torch.tensor(lens, dtype=torch.int64, device=device)
    offs = torch.zeros(G + 1, dtype=torch.int64, device=device)
    offs[1:] = gl.cumsum(0)
    src, poffs = padded_group_layout(offs, M, bs)
    assert not (poffs % bs).any() and src.numel() % bs == 0
    xt, sx, dx = _blockwise_token_copy(x, src, E5M2, bs)
    yt, sy, dy = _blockwise_token_copy(y, src, E4M3, bs)
    # each padded segment's blocks are the per-segment quantization of that group's tokens alone
    for g in range(G):
        s, e, ps = int(offs[g]), int(offs[g + 1]), int(poffs[g])
        if e > s:
            seg = torch.zeros(-(-(e - s) // bs) * bs, P, device=device)
            seg[: e - s] = x[s:e]
            _, _, dseg = _blockwise_token_copy(seg, torch.arange(seg.shape[0], device=device), E5M2, bs)
            assert torch.equal(dseg, dx[ps:ps + seg.shape[0]])
    ref = grouped_gemm_variable_k_ref(dx, dy, poffs[1:] - poffs[:-1])
    assert check_grouped_gemm_fp8_variable_k_triton(xt, sx, yt, sy, "BLOCKWISE", gl, poffs, block_size=bs) is None
    run = lambda **kw: grouped_gemm_fp8_variable_k_triton(xt, sx, yt, sy, "BLOCKWISE", gl, poffs,  # noqa: E731
                                                          block_size=bs, **kw)
    out = run(out_dtype=torch.float32)
    assert out.shape == (G, P, Q) and snr_db(ref, out) >= MIN_SNR[torch.float32]
    for g, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[g], torch.zeros_like(out[g]))
    assert snr_db(ref, run(out_dtype=torch.bfloat16)) >= MIN_SNR[torch.bfloat16]
    assert torch.equal(run(out_dtype=torch.float32, num_cu=1), out)  # the schedule changes no tile's sum
    # BLOCK_K 32 < bs: several K steps per token block, each promoted with that block's scales
    small_k = GroupedGemmFP8Config(32, 32, 32, group_m=2, num_stages=1, num_warps=4)
    assert snr_db(ref, run(out_dtype=torch.float32, config=small_k)) >= MIN_SNR[torch.float32]
    acc = torch.randn(G, P, Q, device=device)
    expected = acc.double() + ref
    run(out=acc, accumulate=True)
    assert snr_db(expected, acc) >= MIN_SNR[torch.float32]


@pytest.mark.parametrize("bs", [32, 64])
def test_grouped_fp8_variable_k_blockwise_small_blocks(bs, device):
    """BLOCKWISE on padded segments of 0 to several token blocks at BLOCK_K = bs and 32 (whole
    unmasked steps from each block-aligned group start, no head or tail; a step never leaves its
    token block), and a token dim longer than the last segment. (BLOCK_K 16 is not tested: an FP8
    dot needs K >= 32 on sm_90.)"""
    lens = [0, 40, 7, 0, 64, 1, 33]
    G, P, Q = len(lens), 48, 40
    M = sum(lens) + 3
    x = torch.randn(M, P, device=device) * (torch.rand(M, 1, device=device) * 4 + 0.1)
    y = torch.randn(M, Q, device=device) * 3
    gl = torch.tensor(lens, dtype=torch.int64, device=device)
    offs = torch.zeros(G + 1, dtype=torch.int64, device=device)
    offs[1:] = gl.cumsum(0)
    src, poffs = padded_group_layout(offs, M, bs)
    xt, sx, dx = _blockwise_token_copy(x, src, E5M2, bs)
    yt, sy, dy = _blockwise_token_copy(y, src, E4M3, bs)
    ref = grouped_gemm_variable_k_ref(dx, dy, poffs[1:] - poffs[:-1])
    for bk in sorted({bs, 32}):
        cfg = GroupedGemmFP8Config(32, 32, bk, group_m=2, num_stages=1, num_warps=4)
        out = grouped_gemm_fp8_variable_k_triton(xt, sx, yt, sy, "BLOCKWISE", gl, poffs, out_dtype=torch.float32,
                                                 block_size=bs, config=cfg)
        assert snr_db(ref, out) >= MIN_SNR[torch.float32], bk
        for g, n in enumerate(lens):
            if n == 0:
                assert torch.equal(out[g], torch.zeros_like(out[g]))


def test_grouped_fp8_variable_k_blockwise_validation(device):
    x = torch.randn(256, 64, device=device)
    src = torch.arange(256, device=device)
    xt, sx, _ = _blockwise_token_copy(x, src, E4M3, 128)
    gl = torch.tensor([100, 28], dtype=torch.int64, device=device)
    offs = torch.tensor([0, 128, 256], dtype=torch.int64, device=device)
    check = check_grouped_gemm_fp8_variable_k_triton
    assert check(xt, sx, xt, sx, "BLOCKWISE", gl, offs) is None
    assert "multiple of block_size" in check(xt[:, :200], sx, xt[:, :200], sx, "BLOCKWISE", gl, offs)
    assert "x_scale" in check(xt, sx[:, :1], xt, sx, "BLOCKWISE", gl, offs)
    assert "y_scale" in check(xt, sx, xt, sx[:1], "BLOCKWISE", gl, offs)
    assert "[64, 4]" in check(xt, sx, xt, sx, "BLOCKWISE", gl, offs, block_size=64)  # scales of 64-token blocks
    assert "float32" in check(xt, sx.half(), xt, sx, "BLOCKWISE", gl, offs)
    assert "power of two" in check(xt, sx, xt, sx, "BLOCKWISE", gl, offs, block_size=96)
    with pytest.raises(ValueError, match="multiple of block_size"):
        grouped_gemm_fp8_variable_k_triton(xt[:, :200], sx, xt[:, :200], sx, "BLOCKWISE", gl, offs)
