"""``torch.compile(dynamic=True, fullgraph=True)``: one graph over several token counts (the
sequence lengths and micro-batch sizes of a training run change), outputs equal to eager's bit
for bit at each. The fakes of the custom ops must take symbolic sizes. SDPA's ``enable_gqa``
refused the SymBool that a head-count comparison gives there."""

from __future__ import annotations

import copy

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity


def _lens(t, device):
    return torch.tensor([t // 2, 0, t - t // 2], dtype=torch.int64, device=device)


_LAYERS = {
    "Linear": (lambda: turbo.modules.Linear(64, 32), lambda t, d: [torch.randn(t, 64, device=d)], None),
    "Float8Linear": (lambda: turbo.modules.Float8Linear(64, 32, config=Float8QuantConfig(), dtype=torch.bfloat16),
                     lambda t, d: [torch.randn(t, 64, dtype=torch.bfloat16, device=d)], None),
    "GroupedMLP": (lambda: turbo.modules.GroupedMLP(3, 64, 32),
                   lambda t, d: [torch.randn(t, 64, device=d), _lens(t, d), torch.rand(t, device=d)], None),
    "GroupedLinear_fp8_blockwise": (
        lambda: turbo.modules.GroupedLinear(3, 64, 32, dtype=torch.bfloat16, config=Float8QuantConfig(
            granularity=ScalingGranularity.BLOCKWISE, block_size=32)),
        lambda t, d: [torch.randn(t, 64, dtype=torch.bfloat16, device=d), _lens(t, d)], None),
    "MoELayer": (lambda: turbo.modules.MoELayer(64, 32, 4, 2), lambda t, d: [torch.randn(t, 64, device=d)],
                 lambda t: dict(num_out_tokens=2 * t)),
    "TurboAttention_gqa": (lambda: turbo.modules.TurboAttention(causal=True),
                           lambda t, d: [torch.randn(1, t, 4, 32, device=d), torch.randn(1, t, 2, 32, device=d),
                                         torch.randn(1, t, 2, 32, device=d)], None),
}


@pytest.mark.parametrize("name", list(_LAYERS))
def test_dynamic_shapes_compile_matches_eager(name, device):
    torch.manual_seed(81)
    make, inputs, kwargs = _LAYERS[name]
    with torch.device(device):
        layer = make()
    compiled = torch.compile(copy.deepcopy(layer), dynamic=True, fullgraph=True, backend="aot_eager")
    for t in (24, 40, 56):
        xs = inputs(t, device)
        kw = kwargs(t) if kwargs else {}
        y, yc = layer(*xs, **kw), compiled(*xs, **kw)
        assert y.abs().sum() > 0 and torch.equal(y, yc), t
