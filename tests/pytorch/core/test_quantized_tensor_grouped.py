"""Grouped QuantizedTensors (``QuantizedTensor.quantize(x, ..., group_lens=...)``, the reference API's
MoE activations): the codes and scales of the ungrouped tensor plus the group lengths and offsets,
kept through the wrapper ops, refused where scale blocks would cross groups, and reused by
``grouped_gemm_fp8``."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingRecipe
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.core.quantized_tensor import QuantizedTensor, create_quantized_weight
from primus_turbo.pytorch.ops import grouped_gemm as _gg_mod  # noqa: F401
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8

E4M3 = torch.float8_e4m3fn
_GG = __import__("sys").modules["primus_turbo.pytorch.ops.grouped_gemm"]

SCHEMES = [  # (granularity, quantize kwargs): scale groups that never cross a row group
    (G.TENSORWISE, {}),
    (G.ROWWISE, {"axis": -1}),
    (G.ROWWISE, {"axis": 0}),
    (G.BLOCKWISE, {"axis": -1, "block_size": 32}),
    (G.MX_BLOCKWISE, {"axis": -1}),
]


def _rows(lens, k, device, extra=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(sum(lens) + extra, k, generator=g) * 3).to(torch.bfloat16).to(device)
    return x, torch.tensor(lens, dtype=torch.int64, device=device)


@pytest.mark.parametrize("gran, kw", SCHEMES, ids=lambda v: getattr(v, "name", str(v)))
def test_grouped_quantize_is_the_ungrouped_quantization_plus_groups(gran, kw, device):
    x, gl = _rows([5, 0, 17, 9], 96, device, extra=3)
    plain = QuantizedTensor.quantize(x, E4M3, gran, **kw)
    qt = QuantizedTensor.quantize(x, E4M3, gran, group_lens=gl, **kw)
    assert qt.is_grouped_tensor and qt._is_grouped_tensor and not plain.is_grouped_tensor
    assert plain.group_lens is None and plain.group_offs is None
    assert qt.group_lens is gl
    assert qt.group_offs.dtype == torch.int64 and qt.group_offs.tolist() == [0, 5, 5, 22, 31]
    assert qt.shape == x.shape and qt.dtype == x.dtype and qt.granularity == gran
    assert torch.equal(qt.data.view(torch.uint8), plain.data.view(torch.uint8))
    assert torch.equal(qt.scale_inv.reshape(-1).view(torch.uint8), plain.scale_inv.reshape(-1).view(torch.uint8))
    assert torch.equal(qt.dequantize(), plain.dequantize())
    assert "groups=4" in repr(qt)


def test_grouped_int32_lens_and_given_offsets(device):
    x, gl = _rows([4, 6], 64, device)
    gl32 = gl.to(torch.int32)
    qt = QuantizedTensor.quantize(x, E4M3, G.ROWWISE, axis=-1, group_lens=gl32)
    assert qt.group_offs.tolist() == [0, 4, 10] and qt.group_offs.dtype == torch.int64
    offs = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    built = QuantizedTensor(qt.data, qt.scale_inv, G.ROWWISE, axis=-1, group_lens=gl32, group_offs=offs,
                            is_grouped_tensor=True)
    assert built.group_offs.dtype == torch.int64 and built.group_offs.tolist() == [0, 4, 10]


@pytest.mark.parametrize("gran, kw, match", [
    (G.BLOCKWISE, {"axis": 0, "block_size": 32}, "along axis=0"),
    (G.BLOCKWISE, {"block_size": 32, "scaling_recipe": ScalingRecipe(use_2d_block=True)}, "2-D blocks"),
    (G.MX_BLOCKWISE, {"axis": 0}, "along axis=0"),
])
def test_grouped_refuses_blocks_across_groups(gran, kw, match, device):
    x, gl = _rows([32, 32], 64, device)
    with pytest.raises(ValueError, match=match):
        QuantizedTensor.quantize(x, E4M3, gran, group_lens=gl, **kw)


def test_grouped_argument_errors(device):
    x, gl = _rows([3, 5], 64, device)
    with pytest.raises(ValueError, match="2-D"):
        QuantizedTensor.quantize(x.reshape(2, 4, 64), E4M3, G.ROWWISE, group_lens=gl)
    with pytest.raises(ValueError, match="int32 / int64"):
        QuantizedTensor.quantize(x, E4M3, G.ROWWISE, group_lens=gl.float())
    with pytest.raises(ValueError, match="1-D"):
        QuantizedTensor.quantize(x, E4M3, G.ROWWISE, group_lens=gl.reshape(1, 2))
    with pytest.raises(ValueError, match="MXFP4"):
        QuantizedTensor.quantize(x, torch.float4_e2m1fn_x2, G.MX_BLOCKWISE, group_lens=gl)
    q = QuantizedTensor.quantize(x, E4M3, G.ROWWISE)
    with pytest.raises(ValueError, match="needs group_lens"):
        QuantizedTensor(q.data, q.scale_inv, G.ROWWISE, is_grouped_tensor=True)
    with pytest.raises(ValueError, match="is_grouped_tensor=False"):
        QuantizedTensor(q.data, q.scale_inv, G.ROWWISE, group_lens=gl, is_grouped_tensor=False)
    with pytest.raises(ValueError, match="group_offs needs group_lens"):
        QuantizedTensor(q.data, q.scale_inv, G.ROWWISE, group_offs=torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"\[G \+ 1\] = \[3\]"):
        QuantizedTensor(q.data, q.scale_inv, G.ROWWISE, group_lens=gl,
                        group_offs=torch.zeros(2, dtype=torch.int64, device=device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the value checks run where they cost no sync (CPU)")
def test_grouped_value_checks_on_cpu():
    x, _ = _rows([3, 5], 64, "cpu")
    with pytest.raises(RuntimeError, match="negative"):
        QuantizedTensor.quantize(x, E4M3, G.ROWWISE, group_lens=torch.tensor([9, -1]))
    with pytest.raises(RuntimeError, match="exceeds"):
        QuantizedTensor.quantize(x, E4M3, G.ROWWISE, group_lens=torch.tensor([4, 5]))


def test_grouped_wrapper_ops_keep_or_refuse_the_groups(device):
    x, gl = _rows([7, 0, 9], 64, device, extra=2)
    qt = QuantizedTensor.quantize(x, E4M3, G.TENSORWISE, group_lens=gl)
    for other in (qt.detach(), qt.clone(), qt.view(qt.shape), qt.to(device), copy.deepcopy(qt)):
        assert other.is_grouped_tensor and other.group_lens.tolist() == [7, 0, 9]
        assert other.group_offs.tolist() == [0, 7, 7, 16]
        assert torch.equal(other.data.view(torch.uint8), qt.data.view(torch.uint8))
    buf = io.BytesIO()
    torch.save(qt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.is_grouped_tensor and loaded.group_offs.tolist() == [0, 7, 7, 16]
    inner, meta = qt.__tensor_flatten__()
    assert inner == ["_data", "_scale_inv", "_group_lens", "_group_offs"]
    back = QuantizedTensor.__tensor_unflatten__({n: getattr(qt, n) for n in inner}, meta, qt.shape, None)
    assert back.is_grouped_tensor and torch.equal(back.group_offs, qt.group_offs)
    with pytest.raises(NotImplementedError, match="grouped tensor"):
        qt.view(2, -1)
    with pytest.raises(NotImplementedError, match="grouped tensor"):
        qt.t()
    assert torch.equal(qt.float(), qt.dequantize(torch.float32))  # dequantizing ops are unaffected


CFGS = {
    "tensorwise": (Float8QuantConfig(), {}),
    "rowwise": (Float8QuantConfig(granularity=G.ROWWISE), {"axis": -1}),
    "blockwise": (Float8QuantConfig(granularity=G.BLOCKWISE, block_size=32), {"axis": -1, "block_size": 32}),
    "mx": (Float8QuantConfig(granularity=G.MX_BLOCKWISE), {"axis": -1}),
}


@pytest.mark.parametrize("name", list(CFGS))
def test_grouped_gemm_fp8_takes_a_grouped_activation(name, device, monkeypatch):
    """A grouped ``a`` gives the ungrouped one's output and dA bit for bit, and its offsets are
    reused (no prefix sum is computed for the call)."""
    cfg, kw = CFGS[name]
    x, gl = _rows([20, 0, 41], 128, device, extra=5, seed=3)
    b = (torch.randn(3, 96, 128) * 128 ** -0.5).to(torch.bfloat16).to(device)
    dy = torch.randn(x.shape[0], 96).to(torch.bfloat16).to(device)
    plain = QuantizedTensor.quantize(x.clone().requires_grad_(), cfg.fwd_dtype(), cfg.granularity, **kw)
    want = grouped_gemm_fp8(plain, b, gl, config=cfg)
    want.backward(dy)
    grouped = QuantizedTensor.quantize(x.clone().requires_grad_(), cfg.fwd_dtype(), cfg.granularity, group_lens=gl,
                                       **kw)
    calls = []
    real = _GG._offsets
    monkeypatch.setattr(_GG, "_offsets", lambda lens: calls.append(1) or real(lens))
    got = grouped_gemm_fp8(grouped, b, gl, config=cfg)
    got.backward(dy)
    assert calls == []
    assert torch.equal(got, want.detach()) and torch.equal(grouped.grad, plain.grad)
    with torch.no_grad():
        pair = create_quantized_weight(b, cfg.fwd_dtype(), cfg)
        assert torch.equal(grouped_gemm_fp8(grouped, pair, gl, config=cfg), want.detach())


def test_grouped_gemm_fp8_group_mismatch(device):
    cfg, kw = CFGS["rowwise"]
    x, gl = _rows([4, 4], 64, device)
    b = torch.randn(2, 32, 64).to(torch.bfloat16).to(device)
    qt = QuantizedTensor.quantize(x, cfg.fwd_dtype(), cfg.granularity, group_lens=gl, **kw)
    with pytest.raises(ValueError, match="grouped tensor of 2 groups, group_lens has 3"):
        grouped_gemm_fp8(qt, torch.randn(3, 32, 64).to(torch.bfloat16).to(device),
                         torch.tensor([4, 4, 0], device=device), config=cfg)
    if device == "cpu":  # the values are compared where that costs no sync
        with pytest.raises(RuntimeError, match="differ from the group_lens argument"):
            grouped_gemm_fp8(qt, b, torch.tensor([3, 5], device=device), config=cfg)
