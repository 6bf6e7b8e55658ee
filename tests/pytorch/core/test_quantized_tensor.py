"""QuantizedTensor: quantize/dequantize round trips, t(), repr; create_quantized_weight; checks."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingRecipe
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.core.quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorPair,
    check_quantized_tensor,
    create_quantized_weight,
)
from primus_turbo.testing.quant_ref import dequantize_fp8_ref, quantize_fp8_ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _x(shape, device, dtype=torch.bfloat16):
    return torch.randn(shape, device=device).to(dtype)


@pytest.mark.parametrize(
    "gran, kw",
    [(G.TENSORWISE, {}), (G.ROWWISE, {}), (G.ROWWISE, {"axis": 0}), (G.BLOCKWISE, {}),
     (G.BLOCKWISE, {"scaling_recipe": ScalingRecipe(use_2d_block=True)}), (G.MX_BLOCKWISE, {"axis": 0})],
)
def test_round_trip(gran, kw, device):
    x = _x((64, 160), device)
    qt = QuantizedTensor.quantize(x, E4M3, gran, **kw)
    assert qt.shape == x.shape and qt.real_dtype == qt.data.dtype == E4M3 and qt.device == x.device
    assert qt.dtype == qt.orig_dtype == x.dtype  # the logical dtype: the tensor it stands for
    assert qt.orig_dtype == torch.bfloat16
    q_ref, s_ref = quantize_fp8_ref(x, E4M3, gran, **kw)
    assert torch.equal(qt.data.view(torch.uint8), q_ref.view(torch.uint8))
    d = qt.dequantize()
    assert d.dtype == torch.bfloat16
    d_ref = dequantize_fp8_ref(q_ref, s_ref, gran, out_dtype=torch.bfloat16, **kw)
    assert torch.equal(d, d_ref)
    assert (d.float() - x.float()).abs().max() <= x.float().abs().max() * 2.0**-3
    assert qt.dequantize(torch.float32).dtype == torch.float32
    check_quantized_tensor(qt, Float8QuantConfig(granularity=gran, block_size=qt.block_size if gran in
                                                 (G.BLOCKWISE, G.MX_BLOCKWISE) else None), axis=kw.get("axis"))
    r = repr(qt)
    assert "QuantizedTensor(shape=(64, 160)" in r and gran.name in r


def test_transpose(device):
    x = _x((32, 64), device)
    qt = QuantizedTensor.quantize(x, E5M2, G.TENSORWISE)
    t = qt.t()
    assert t.shape == (64, 32) and t.scale_inv is qt.scale_inv
    assert torch.equal(t.dequantize(), qt.dequantize().t())
    for gran in (G.ROWWISE, G.BLOCKWISE, G.MX_BLOCKWISE):
        with pytest.raises(NotImplementedError, match="quantize_fp8_with_trans"):
            QuantizedTensor.quantize(x, E4M3, gran).t()


@pytest.mark.parametrize(
    "config, scale_shape, scale_t_shape",
    [
        (Float8QuantConfig(granularity=G.TENSORWISE), (), ()),
        (Float8QuantConfig(granularity=G.ROWWISE), (96, 1), (256, 1)),
        (Float8QuantConfig(granularity=G.BLOCKWISE), (1, 2), (2, 1)),
        (Float8QuantConfig(granularity=G.BLOCKWISE, block_size=64), (2, 4), (4, 2)),
        (Float8QuantConfig(granularity=G.MX_BLOCKWISE), (96, 8), (256, 3)),
    ],
    ids=["tensorwise", "rowwise", "block128", "block64", "mx"],
)
def test_create_quantized_weight(config, scale_shape, scale_t_shape, device):
    w = _x((96, 256), device)  # [N, K]
    pair = create_quantized_weight(w, E4M3, config)
    assert isinstance(pair, QuantizedTensorPair) and pair.data_t is None
    assert pair.data.shape == (96, 256) and tuple(pair.data.scale_inv.shape) == scale_shape
    assert pair.data.granularity == config.granularity
    check_quantized_tensor(pair.data, config, axis=-1)
    pair = create_quantized_weight(w, E4M3, config, need_weight_transpose_cache=True)
    assert pair.data_t.shape == (256, 96) and tuple(pair.data_t.scale_inv.shape) == scale_t_shape
    check_quantized_tensor(pair.data_t, config)
    # the transposed copy is the weight's transpose quantized on its own
    recipe = ScalingRecipe(use_2d_block=True) if config.granularity == G.BLOCKWISE else None
    q_ref, s_ref = quantize_fp8_ref(w.t().contiguous(), E4M3, config.granularity, block_size=config.block_size,
                                    scaling_recipe=recipe)
    assert torch.equal(pair.data_t.data.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(pair.data_t.scale_inv.view(torch.uint8) if s_ref.dtype != torch.float32
                       else pair.data_t.scale_inv, s_ref.view(torch.uint8) if s_ref.dtype != torch.float32 else s_ref)
    if config.granularity == G.BLOCKWISE:  # 2-D blocks: the transposed scale grid
        assert torch.equal(pair.data_t.scale_inv, pair.data.scale_inv.t())


def test_check_quantized_tensor_errors(device):
    x = _x((64, 128), device)
    qt = QuantizedTensor.quantize(x, E4M3, G.BLOCKWISE)
    with pytest.raises(ValueError, match="granularity BLOCKWISE != config's ROWWISE"):
        check_quantized_tensor(qt, Float8QuantConfig(granularity=G.ROWWISE))
    with pytest.raises(ValueError, match="block_size 128 != config's 64"):
        check_quantized_tensor(qt, Float8QuantConfig(granularity=G.BLOCKWISE, block_size=64))
    with pytest.raises(ValueError, match="axis=-1, expected axis=0"):
        check_quantized_tensor(qt, Float8QuantConfig(granularity=G.BLOCKWISE), axis=0)
    bad = QuantizedTensor(qt.data, qt.scale_inv[:, :0], G.BLOCKWISE, block_size=128)
    with pytest.raises(ValueError, match="scale_inv shape"):
        check_quantized_tensor(bad, Float8QuantConfig(granularity=G.BLOCKWISE))
    bad = QuantizedTensor(qt.data, qt.scale_inv.double(), G.BLOCKWISE, block_size=128)
    with pytest.raises(ValueError, match="scale_inv.dtype"):
        check_quantized_tensor(bad, Float8QuantConfig(granularity=G.BLOCKWISE))
    with pytest.raises(TypeError, match="expected a QuantizedTensor"):
        check_quantized_tensor(x, Float8QuantConfig())
    with pytest.raises(TypeError, match="Float8QuantConfig"):
        create_quantized_weight(x, E4M3, "BLOCKWISE")
    with pytest.raises(ValueError, match="weight must be 2-D"):
        create_quantized_weight(x.reshape(-1), E4M3, Float8QuantConfig())


# ---- MXFP4 ----------------------------------------------------------------------------------
FP4 = getattr(torch, "float4_e2m1fn_x2", None)
needs_fp4 = pytest.mark.skipif(FP4 is None, reason="this torch has no float4_e2m1fn_x2")


@needs_fp4
@pytest.mark.parametrize("axis", [-1, 0])
def test_mxfp4_round_trip(axis, device):
    from primus_turbo.pytorch.ops.quantization import dequantize_fp4, quantize_fp4
    from primus_turbo.testing import snr_db

    x = _x((64, 96), device)
    qt = QuantizedTensor.quantize(x, FP4, G.MX_BLOCKWISE, axis=axis)
    q, s = quantize_fp4(x, axis=axis)
    assert qt.real_dtype == FP4 and qt.dtype == x.dtype and qt.shape == x.shape and qt.granularity == G.MX_BLOCKWISE and qt.block_size == 32 and qt.axis == axis
    assert torch.equal(qt.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(qt.scale_inv, s)
    d = qt.dequantize()
    assert d.dtype == torch.bfloat16 and d.shape == x.shape
    assert torch.equal(d, dequantize_fp4(q, torch.bfloat16, scale_inv=s, axis=axis))
    assert snr_db(x.double(), qt.dequantize(torch.float32)) >= 10.0
    assert "float4_e2m1fn_x2" in repr(qt)


@needs_fp4
def test_mxfp4_qdq_in_primus_weight_form(device):
    # the call Primus's MXFP4 weight de-oscillation makes: use_2d_block does not apply to MXFP4 here
    # (1 x 32 groups, as gemm_fp4 quantizes weights), so the QDQ is that of the forward's weight copy
    w = _x((64, 128), device)
    qdq = QuantizedTensor.quantize(w, FP4, G.MX_BLOCKWISE, block_size=32,
                                   scaling_recipe=ScalingRecipe(use_2d_block=True), axis=-1).dequantize()
    assert torch.equal(qdq, QuantizedTensor.quantize(w, FP4, G.MX_BLOCKWISE).dequantize())
    # stochastic rounding: reproducible under torch.manual_seed, and not the RNE result
    torch.manual_seed(0)
    a = QuantizedTensor.quantize(w, FP4, G.MX_BLOCKWISE, scaling_recipe=ScalingRecipe(use_sr=True)).dequantize()
    torch.manual_seed(0)
    b = QuantizedTensor.quantize(w, FP4, G.MX_BLOCKWISE, scaling_recipe=ScalingRecipe(use_sr=True)).dequantize()
    assert torch.equal(a, b) and not torch.equal(a, qdq)


@needs_fp4
def test_mxfp4_bad_input(device):
    x = _x((64, 96), device)
    with pytest.raises(ValueError, match="needs granularity MX_BLOCKWISE, got BLOCKWISE"):
        QuantizedTensor.quantize(x, FP4, G.BLOCKWISE)
    with pytest.raises(ValueError, match="MXFP4 blocks are 32 elements, got block_size=16"):
        QuantizedTensor.quantize(x, FP4, G.MX_BLOCKWISE, block_size=16)
    with pytest.raises(NotImplementedError, match="use_rht=True"):
        QuantizedTensor.quantize(x, FP4, G.MX_BLOCKWISE, scaling_recipe=ScalingRecipe(use_rht=True))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedTensor.quantize(_x((64, 48), device), FP4, G.MX_BLOCKWISE)
    with pytest.raises(ValueError, match="2-D"):
        QuantizedTensor.quantize(_x((2, 64, 64), device), FP4, G.MX_BLOCKWISE)
    # the GEMM ops take FP8 QuantizedTensors only: an MXFP4 one is named, not misread
    import primus_turbo.pytorch as turbo

    qt = QuantizedTensor.quantize(x, FP4, G.MX_BLOCKWISE)
    with pytest.raises(ValueError, match="FP8 dtype"):
        check_quantized_tensor(qt, Float8QuantConfig(granularity=G.MX_BLOCKWISE, block_size=32))
    w = _x((64, 96), device)
    mx = Float8QuantConfig(granularity=G.MX_BLOCKWISE, block_size=32)
    with pytest.raises(TypeError, match=r"gemm_fp8: a pre-quantized a must hold FP8 data .* got torch.float4_e2m1"):
        turbo.ops.gemm_fp8(qt, w, trans_b=True, config=mx)
    with pytest.raises(TypeError, match="grouped_gemm_fp8: a pre-quantized a must hold FP8 data"):
        turbo.ops.grouped_gemm_fp8(qt, w.reshape(1, 64, 96), torch.tensor([64], device=device), config=mx)


# ---- the reference API's forms --------------------------------------------------------------
def test_quantized_tensor_pair_data_t_defaults_to_none(device):
    qt = QuantizedTensor.quantize(_x((32, 64), device), E4M3, G.TENSORWISE)
    pair = QuantizedTensorPair(qt)
    assert pair.data is qt and pair.data_t is None and pair == QuantizedTensorPair(qt, None)
    assert QuantizedTensorPair._field_defaults == {"data_t": None}
    data, data_t = pair
    assert data is qt and data_t is None


@pytest.mark.parametrize("need_t", [False, True])
def test_create_quantized_weight_quant_config_name(need_t, device):
    w = _x((64, 128), device)
    cfg = Float8QuantConfig(granularity=G.BLOCKWISE)
    base = create_quantized_weight(w, E4M3, cfg, need_t)
    for kw in (dict(quant_config=cfg), dict(config=cfg)):
        got = create_quantized_weight(w, E4M3, need_weight_transpose_cache=need_t, **kw)
        for a, b in zip(got, base):
            if b is None:
                assert a is None
                continue
            assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
            assert torch.equal(a.scale_inv, b.scale_inv) and a.scaling_recipe == b.scaling_recipe
    with pytest.raises(TypeError, match="got both quant_config and config"):
        create_quantized_weight(w, E4M3, cfg, config=cfg)
    with pytest.raises(TypeError, match="missing the quant_config argument"):
        create_quantized_weight(w, E4M3)
    with pytest.raises(TypeError, match="quant_config must be a Float8QuantConfig, got str"):
        create_quantized_weight(w, E4M3, config="BLOCKWISE")


def test_check_quantized_tensor_scaling_recipe(device):
    x = _x((64, 128), device)
    blk = Float8QuantConfig(granularity=G.BLOCKWISE)
    q2d = QuantizedTensor.quantize(x, E4M3, G.BLOCKWISE, scaling_recipe=ScalingRecipe(use_2d_block=True))
    q1d = QuantizedTensor.quantize(x, E4M3, G.BLOCKWISE)  # records no recipe: the default one
    check_quantized_tensor(q2d, blk, scaling_recipe=ScalingRecipe(use_2d_block=True))
    check_quantized_tensor(q1d, blk, axis=-1, scaling_recipe=ScalingRecipe())
    with pytest.raises(ValueError, match=r"scaling_recipe.use_2d_block=False but the tensor was quantized with "
                                         r"use_2d_block=True"):
        check_quantized_tensor(q2d, blk, scaling_recipe=ScalingRecipe())
    with pytest.raises(ValueError, match=r"scaling_recipe.use_2d_block=True but the tensor was quantized with "
                                         r"use_2d_block=False \(its scaling_recipe: None\)"):
        check_quantized_tensor(q1d, blk, scaling_recipe=ScalingRecipe(use_2d_block=True))
    with pytest.raises(ValueError, match=r"scaling_recipe.use_sr=True but the tensor was quantized with use_sr=False"):
        check_quantized_tensor(q1d, blk, scaling_recipe=ScalingRecipe(use_sr=True))
    # MX weights (create_quantized_weight) are 1 x 32 whatever use_2d_block says: it is not compared there
    mx = Float8QuantConfig(granularity=G.MX_BLOCKWISE)
    w = create_quantized_weight(x, E4M3, mx).data
    check_quantized_tensor(w, mx, scaling_recipe=ScalingRecipe(use_2d_block=True))
    check_quantized_tensor(w, mx, scaling_recipe=ScalingRecipe())
    with pytest.raises(ValueError, match=r"scaling_recipe.use_rht=True but the tensor was quantized with "
                                         r"use_rht=False"):
        check_quantized_tensor(w, mx, scaling_recipe=ScalingRecipe(use_rht=True))
    with pytest.raises(ValueError, match=r"check_quantized_tensor: ScalingRecipe.shuffle_scale=True \(AMD AITER"):
        check_quantized_tensor(w, mx, scaling_recipe=ScalingRecipe(shuffle_scale=True))


@pytest.mark.parametrize("field", ["shuffle_scale", "shuffle_out"])
def test_quantized_tensor_rejects_preshuffle(field, device):
    x = _x((64, 128), device)
    rec = ScalingRecipe(use_2d_block=True, **{field: True})
    msg = rf"ScalingRecipe.{field}=True \(AMD AITER/hipBLASLt preshuffled .* not supported on this platform"
    with pytest.raises(ValueError, match=rf"QuantizedTensor.quantize: {msg}"):
        QuantizedTensor.quantize(x, E4M3, G.BLOCKWISE, scaling_recipe=rec)
    if FP4 is not None:
        with pytest.raises(ValueError, match=rf"QuantizedTensor.quantize: {msg}"):
            QuantizedTensor.quantize(x, FP4, G.MX_BLOCKWISE, scaling_recipe=rec)
    qt = QuantizedTensor.quantize(x, E4M3, G.BLOCKWISE)
    with pytest.raises(ValueError, match=rf"QuantizedTensor: {msg}"):
        QuantizedTensor(qt.data, qt.scale_inv, G.BLOCKWISE, block_size=128, scaling_recipe=rec)


# ---- 3-D weights: the column-wise copy of [G, N, K] expert weights ---------------------------
def _snr_db(x, d):
    x, d = x.double(), d.double()
    return 10 * torch.log10((x * x).sum() / ((x - d) ** 2).sum()).item()


COLWISE_3D = [
    ("mx", G.MX_BLOCKWISE, {}),
    ("block128_ragged", G.BLOCKWISE, {}),
    ("block32", G.BLOCKWISE, {"block_size": 32}),
    ("rowwise", G.ROWWISE, {}),
    ("block64_2d", G.BLOCKWISE, {"block_size": 64, "scaling_recipe": ScalingRecipe(use_2d_block=True)}),
]


@pytest.mark.parametrize("gran, kw", [c[1:] for c in COLWISE_3D], ids=[c[0] for c in COLWISE_3D])
def test_quantize_3d_weights_along_axis_minus_2(gran, kw, device):
    """``QuantizedTensor.quantize(w [G, N, K], ..., axis=-2)`` (Megatron's column-wise copy for MX /
    BLOCKWISE, ROWWISE's re-quantization along -2): every expert as the 2-D ``axis=0`` quantization
    of its matrix (``b x b`` tiles: axis ignored), bit for bit; dequantize() inverts it per expert."""
    w = _x((3, 160, 96), device)
    qt = QuantizedTensor.quantize(w, E4M3, gran, axis=-2, **kw)
    assert qt.shape == w.shape and qt.axis == 1 and qt.orig_dtype == torch.bfloat16
    per = [QuantizedTensor.quantize(w[i], E4M3, gran, axis=0, **kw) for i in range(3)]
    u8 = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731  (bytes of FP8 / E8M0)
    assert torch.equal(u8(qt.data), torch.stack([u8(p.data) for p in per]))
    s_ref = torch.stack([u8(p.scale_inv) for p in per])
    assert qt.scale_inv.shape == s_ref.shape and torch.equal(u8(qt.scale_inv), s_ref)
    d = qt.dequantize()
    assert d.dtype == torch.bfloat16 and torch.equal(d, torch.stack([p.dequantize() for p in per]))
    assert _snr_db(w, qt.dequantize(torch.float32)) >= 25
    cfg = Float8QuantConfig(granularity=gran, block_size=qt.block_size if gran != G.ROWWISE else None)
    check_quantized_tensor(qt, cfg, axis=-2)
    check_quantized_tensor(qt, cfg, axis=1)
    with pytest.raises(ValueError, match="quantized along axis=1, expected axis=-1"):
        check_quantized_tensor(qt, cfg, axis=-1)


def test_quantize_3d_weights_other_forms(device):
    """3-D BLOCKWISE 1 x b along the last dim dequantizes per row (not as b x b tiles); the expert
    stacks of create_quantized_weight pass check_quantized_tensor; bad axes are named."""
    w = _x((2, 64, 96), device)
    qt = QuantizedTensor.quantize(w, E4M3, G.BLOCKWISE, block_size=32)
    assert qt.scale_inv.shape == (2, 64, 3)
    want = torch.stack([QuantizedTensor.quantize(m, E4M3, G.BLOCKWISE, block_size=32).dequantize() for m in w])
    assert torch.equal(qt.dequantize(), want)
    for cfg in (Float8QuantConfig(granularity=G.TENSORWISE), Float8QuantConfig(granularity=G.ROWWISE),
                Float8QuantConfig(granularity=G.BLOCKWISE), Float8QuantConfig(granularity=G.MX_BLOCKWISE)):
        pair = create_quantized_weight(w, E4M3, cfg, need_weight_transpose_cache=True)
        check_quantized_tensor(pair.data, cfg, axis=-1)
        check_quantized_tensor(pair.data_t, cfg)
    with pytest.raises(ValueError, match="axis=3 is out of range for a 3-D input"):
        QuantizedTensor.quantize(w, E4M3, G.MX_BLOCKWISE, axis=3)
    with pytest.raises(ValueError, match="batch dim"):
        QuantizedTensor.quantize(w, E4M3, G.BLOCKWISE, axis=0, scaling_recipe=ScalingRecipe(use_2d_block=True))
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        QuantizedTensor.quantize(w[:, :48], E4M3, G.MX_BLOCKWISE, axis=-2)


# ---------------------------------------------------------------------------------------------
# A torch.Tensor wrapper subclass: logical shape / dtype, the ops it allows, autograd
# ---------------------------------------------------------------------------------------------
def test_tensor_subclass_semantics(device):
    x = _x((64, 96), device).requires_grad_()
    qt = QuantizedTensor.quantize(x, E4M3, G.ROWWISE, axis=-1)
    assert isinstance(qt, torch.Tensor) and qt.requires_grad and qt.is_leaf and qt.grad_fn is None
    assert qt.shape == x.shape and qt.dtype == torch.bfloat16 and qt.real_dtype == E4M3 and qt.dim() == 2
    assert qt.quantized_axis == 1 and qt.qdata is qt.data and qt.numel() == x.numel()
    # detach / alias keep the storage and the parameters
    d = qt.detach()
    assert isinstance(d, QuantizedTensor) and not d.requires_grad and d.data is qt.data
    assert d.scale_inv is qt.scale_inv and d.granularity == qt.granularity and d.axis == qt.axis
    assert isinstance(qt.view(64, 96), QuantizedTensor) and isinstance(qt.view(-1, 96), QuantizedTensor)
    # high-precision copies dequantize; a device move stays quantized; clone owns its storage
    ref = qt.dequantize(torch.float32)
    assert torch.equal(qt.float(), ref) and torch.equal(qt.to(torch.float32), ref)
    moved = qt.to(device)
    assert isinstance(moved, QuantizedTensor) and torch.equal(moved.data.view(torch.uint8), qt.data.view(torch.uint8))
    c = qt.detach().clone()
    assert isinstance(c, QuantizedTensor) and c.data.data_ptr() != qt.data.data_ptr()
    assert torch.equal(c.dequantize(), qt.dequantize())
    # nothing computes on the codes: every other op names itself and points at dequantize()
    for bad in (lambda t: t + 1, lambda t: t.sum(), lambda t: torch.matmul(t, torch.ones(96, 4, dtype=t.dtype)),
                lambda t: t.view(96, 64), lambda t: t.reshape(32, 192), lambda t: t[0]):
        with pytest.raises(NotImplementedError, match="QuantizedTensor"):
            bad(qt.detach())
    with pytest.raises(NotImplementedError, match="write into quantized codes"):
        qt.detach().copy_(x.detach())
    # TENSORWISE transposes share the scale; the grouped ones need re-quantized data
    tw = QuantizedTensor.quantize(x.detach(), E4M3, G.TENSORWISE)
    assert tw.T.shape == (96, 64) and torch.equal(tw.T.dequantize(), tw.dequantize().t())
    # gradients through the allowed ops reach the leaf in its logical dtype
    qt.float().sum().backward()
    assert qt.grad is not None and qt.grad.dtype == torch.bfloat16 and torch.equal(qt.grad, torch.ones_like(x))
    assert x.grad is None  # quantize() made a new leaf


def test_constructor_checks(device):
    x = _x((32, 64), device)
    q, s = torch.zeros(32, 64, device=device).to(E4M3), torch.ones((), device=device)
    qt = QuantizedTensor(q, s, G.TENSORWISE, orig_dtype=torch.float16)
    assert qt.dtype == torch.float16 and qt.shape == (32, 64) and not qt.requires_grad
    with pytest.raises(TypeError, match="granularity must be a ScalingGranularity"):
        QuantizedTensor(q, s, "TENSORWISE")
    with pytest.raises(TypeError, match="orig_dtype must be"):
        QuantizedTensor(q, s, G.TENSORWISE, orig_dtype=E4M3)
    with pytest.raises(TypeError, match="data must be a plain torch.Tensor"):
        QuantizedTensor(qt, s, G.TENSORWISE)
    with pytest.raises(TypeError, match="already a QuantizedTensor"):
        QuantizedTensor.quantize(qt, E4M3, G.TENSORWISE)
    assert "real_dtype=torch.float8_e4m3fn" in repr(QuantizedTensor.quantize(x, E4M3, G.TENSORWISE))


def test_flatten_unflatten_round_trip(device):
    qt = QuantizedTensor.quantize(_x((64, 256), device), E4M3, G.BLOCKWISE,
                                  scaling_recipe=ScalingRecipe(use_2d_block=True))
    names, meta = qt.__tensor_flatten__()
    back = QuantizedTensor.__tensor_unflatten__({n: getattr(qt, n) for n in names}, meta, qt.shape, qt.stride())
    assert isinstance(back, QuantizedTensor) and back.shape == qt.shape and back.dtype == qt.dtype
    assert back.scaling_recipe == qt.scaling_recipe and torch.equal(back.dequantize(), qt.dequantize())
    # deepcopy and torch.save / load keep the codes, scales and parameters
    import copy

    for other in (copy.deepcopy(qt), _saved_and_loaded(qt)):
        assert isinstance(other, QuantizedTensor) and other.granularity == qt.granularity
        assert other.scaling_recipe == qt.scaling_recipe and other.shape == qt.shape
        assert torch.equal(other.data.view(torch.uint8), qt.data.view(torch.uint8))
        assert torch.equal(other.dequantize(), qt.dequantize())


def _saved_and_loaded(t):
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


_BRIDGE_CFGS = {
    "tensorwise": Float8QuantConfig(),
    "rowwise": Float8QuantConfig(granularity=G.ROWWISE),
    "blockwise": Float8QuantConfig(granularity=G.BLOCKWISE, block_size=128),
    "mx": Float8QuantConfig(granularity=G.MX_BLOCKWISE, block_size=32),
}


class _WeightGradBridge(torch.autograd.Function):
    """A framework's bridge, as Primus's Megatron integration writes it: the GEMM runs on the
    cached quantized weight, whose gradient this function adds into the parameter's main_grad
    (every micro-batch) and answers with a placeholder gradient for the parameter itself."""

    @staticmethod
    def forward(ctx, x, weight, qw, qw_t):
        ctx.weight = weight
        return x, qw, qw_t

    @staticmethod
    def backward(ctx, grad_x, grad_qw, grad_qw_t):
        w = ctx.weight
        if grad_qw is not None:
            w.main_grad.add_(grad_qw)
        w.grad_added_to_main_grad = True
        return grad_x, torch.zeros_like(w), None, None


@pytest.mark.parametrize("name", list(_BRIDGE_CFGS))
def test_cached_weight_bridge_matches_the_weight_path(name, device):
    """gemm_fp8 with a cached QuantizedTensorPair that requires grad gives that buffer the weight
    gradient (bit-identical to the high-precision weight's); a bridge routes it into main_grad over
    three micro-batches, equal to the sum of the on-the-fly gradients."""
    from primus_turbo.pytorch.ops import gemm_fp8

    cfg = _BRIDGE_CFGS[name]
    w = torch.nn.Parameter(_x((64, 128), device))
    w.main_grad = torch.zeros(64, 128, device=device)
    w.grad_added_to_main_grad = False
    xs = [_x((96, 128), device) for _ in range(3)]
    dys = [_x((96, 64), device) for _ in range(3)]
    want_main = torch.zeros(64, 128, device=device)
    want = []
    for x, dy in zip(xs, dys):
        xi = x.clone().requires_grad_()
        wi = w.detach().clone().requires_grad_()
        y = gemm_fp8(xi, wi, trans_b=True, config=cfg)
        y.backward(dy)
        want.append((y.detach(), xi.grad))
        want_main += wi.grad.float()
    pair = create_quantized_weight(w, cfg.fwd_dtype(), cfg, need_weight_transpose_cache=True)
    assert pair.data.requires_grad and pair.data.dtype == w.dtype and pair.data.shape == w.shape
    for (x, dy), (y_ref, gx_ref) in zip(zip(xs, dys), want):
        xi = x.clone().requires_grad_()
        xb, qw, qw_t = _WeightGradBridge.apply(xi, w, pair.data, pair.data_t)
        assert isinstance(qw, QuantizedTensor) and qw.grad_fn is not None
        y = gemm_fp8(xb, QuantizedTensorPair(qw, qw_t), trans_b=True, config=cfg)
        y.backward(dy)
        assert torch.equal(y.detach(), y_ref) and torch.equal(xi.grad, gx_ref)
    assert w.grad_added_to_main_grad and torch.equal(w.main_grad, want_main)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise"])
def test_fused_accumulation_into_cached_weight_main_grad(name, device):
    """fuse_bgrad_accum_pattern='megatron' with a pre-quantized b: the GEMM reads main_grad off
    the quantized buffer (where a bridge copies it) and adds the gradient there."""
    from primus_turbo.pytorch.ops import gemm_fp8

    cfg = _BRIDGE_CFGS[name]
    w = _x((64, 128), device)
    x, dy = _x((96, 128), device), _x((96, 64), device)
    wi = w.clone().requires_grad_()  # the high-precision weight's fused path is the reference
    wi.main_grad = torch.full((64, 128), 0.5, device=device)
    wi.grad_added_to_main_grad = False
    gemm_fp8(x.clone().requires_grad_(), wi, trans_b=True, config=cfg,
             fuse_bgrad_accum_pattern="megatron").backward(dy)
    pair = create_quantized_weight(w.clone().requires_grad_(), cfg.fwd_dtype(), cfg,
                                   need_weight_transpose_cache=True)
    pair.data.main_grad = torch.full((64, 128), 0.5, device=device)
    pair.data.grad_added_to_main_grad = False
    gemm_fp8(x.clone().requires_grad_(), pair, trans_b=True, config=cfg,
             fuse_bgrad_accum_pattern="megatron").backward(dy)
    assert pair.data.grad_added_to_main_grad and not torch.equal(pair.data.main_grad, torch.full_like(wi.main_grad, 0.5))
    assert torch.equal(pair.data.main_grad, wi.main_grad)
    bad = create_quantized_weight(w.clone().requires_grad_(), cfg.fwd_dtype(), cfg)
    with pytest.raises(ValueError, match="main_grad"):
        gemm_fp8(x, bad, trans_b=True, config=cfg, fuse_bgrad_accum_pattern="megatron")


def test_quantized_activation_gets_its_gradient(device):
    """A QuantizedTensor a that requires grad gets dA, bit-identical to the high-precision path."""
    from primus_turbo.pytorch.ops import gemm_fp8

    cfg = _BRIDGE_CFGS["blockwise"]
    x, w, dy = _x((96, 128), device), _x((64, 128), device), _x((96, 64), device)
    xi = x.clone().requires_grad_()
    gemm_fp8(xi, w, trans_b=True, config=cfg).backward(dy)
    qa = QuantizedTensor.quantize(x.clone().requires_grad_(), E4M3, G.BLOCKWISE, axis=-1, block_size=128)
    gemm_fp8(qa, w, trans_b=True, config=cfg).backward(dy)
    assert qa.grad.dtype == torch.bfloat16 and torch.equal(qa.grad, xi.grad)


def test_other_gemms_refuse_quantized_tensors(device):
    from primus_turbo.pytorch.ops import gemm, gemm_fp4, grouped_gemm

    qt = QuantizedTensor.quantize(_x((64, 128), device), E4M3, G.TENSORWISE)
    b = _x((128, 64), device)
    with pytest.raises(TypeError, match="QuantizedTensor; pass it to gemm_fp8"):
        gemm(qt, b)
    with pytest.raises(TypeError, match="FP8-only"):
        gemm_fp4(qt, b)
    gl = torch.tensor([32, 32], device=device)
    with pytest.raises(TypeError, match="pass it to grouped_gemm_fp8"):
        grouped_gemm(qt, _x((2, 128, 64), device), gl)


@pytest.mark.parametrize("gran, kw", [(G.TENSORWISE, {}), (G.ROWWISE, {}), (G.BLOCKWISE, {"block_size": 128}),
                                      (G.MX_BLOCKWISE, {"block_size": 32})])
def test_leading_dim_reshape_keeps_groups(gran, kw, device):
    """[B, S, H] -> [B * S, H] of an activation quantized along H: a view of data and scales, the
    same values, and gemm_fp8 on it gives the 3-D leaf the gradient of the flattened tensor."""
    from primus_turbo.pytorch.ops import gemm_fp8

    x = _x((2, 48, 256), device).requires_grad_()
    axis = None if gran == G.TENSORWISE else -1
    qt = QuantizedTensor.quantize(x, E4M3, gran, axis=axis, **kw)
    flat = qt.view(96, 256)
    assert isinstance(flat, QuantizedTensor) and flat.shape == (96, 256) and flat.data.data_ptr() == qt.data.data_ptr()
    assert torch.equal(flat.dequantize(), qt.dequantize().view(96, 256))
    assert torch.equal(qt.reshape(-1, 256).dequantize(), flat.dequantize())
    cfg = Float8QuantConfig(granularity=gran, block_size=kw.get("block_size"))
    w, dy = _x((64, 256), device), _x((96, 64), device)
    gemm_fp8(flat, w, trans_b=True, config=cfg).backward(dy)
    xr = x.detach().view(96, 256).requires_grad_()
    gemm_fp8(xr, w, trans_b=True, config=cfg).backward(dy)
    assert qt.grad.shape == x.shape and torch.equal(qt.grad.view(96, 256), xr.grad)
    if gran != G.TENSORWISE:  # regrouping the scales is refused
        with pytest.raises(NotImplementedError, match="regroup the scales"):
            qt.view(96, 2, 128)
    with pytest.raises(NotImplementedError, match="regroup the scales"):
        QuantizedTensor.quantize(x.detach()[0], E4M3, G.ROWWISE, axis=0).view(24, 512)
