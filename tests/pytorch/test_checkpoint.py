"""Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) over the layers: the
forward runs again in the backward, so each layer must give the same output and gradients as
without checkpointing, bit for bit. That rules out randomness and host state that change between
the two forwards: the routing, the FP8 weight cache, the attention's saved LSE, the aux loss. (On
the GPU >= 60 dB instead of bit equality: fp32 atomics may add in another order.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
from primus_turbo.testing import snr_db

BF = torch.bfloat16

_LAYERS = {
    "MoELayer_bf16": (lambda: turbo.modules.MoELayer(32, 32, 4, 2, dtype=BF, aux_loss_coeff=0.01),
                      lambda d: [torch.randn(16, 32, dtype=BF, device=d)]),
    "MoELayer_fp8_blockwise": (lambda: turbo.modules.MoELayer(32, 32, 4, 2, dtype=BF, aux_loss_coeff=0.01,
                                                              config=Float8QuantConfig(
                                                                  granularity=ScalingGranularity.BLOCKWISE,
                                                                  block_size=32)),
                               lambda d: [torch.randn(16, 32, dtype=BF, device=d)]),
    # every balancing / loss option at once (Megatron's moe_layer_recompute with the aux-loss auto-scaler)
    "MoELayer_options": (lambda: turbo.modules.MoELayer(32, 32, 4, 2, dtype=BF, aux_loss_coeff=0.01,
                                                        load_balancing_type="seq_aux_loss", z_loss_coeff=1e-3,
                                                        expert_bias=True, aux_loss_in_backward=True,
                                                        normalize_topk=True, capacity_factor=1.0,
                                                        shared_expert_ffn_hidden_size=16, shared_expert_gate=True),
                         lambda d: [torch.randn(2, 8, 32, dtype=BF, device=d)]),
    "TurboAttention": (lambda: turbo.modules.TurboAttention(causal=True, deterministic=True),
                       lambda d: [torch.randn(1, 16, 2, 32, dtype=BF, device=d) for _ in range(3)]),
    "Float8Linear": (lambda: turbo.modules.Float8Linear(64, 32, config=Float8QuantConfig(), dtype=BF),
                     lambda d: [torch.randn(8, 64, dtype=BF, device=d)]),
}


@pytest.mark.parametrize("name", list(_LAYERS))
def test_checkpointed_layer_matches(name, device):
    torch.manual_seed(71)
    make, inputs = _LAYERS[name]
    with torch.device(device):
        layer = make()
    twin = copy.deepcopy(layer)
    base = inputs(device)
    runs = []
    for mod, ckpt in ((layer, False), (twin, True)):
        xs = [t.clone().requires_grad_() for t in base]
        y = checkpoint(mod, *xs, use_reentrant=False) if ckpt else mod(*xs)
        loss = y.float().square().sum()
        if getattr(mod, "aux_loss", None) is not None:
            loss = loss + mod.aux_loss
        loss.backward()
        runs.append([y.detach()] + [x.grad for x in xs] + [p.grad for p in mod.parameters()])
    for i, (a, b) in enumerate(zip(*runs)):
        assert a is not None and a.abs().sum() > 0, i
        if device == "cuda":  # fp32 atomics (MoE scatters, dQ) may add in another order on the GPU
            assert snr_db(a.double(), b) >= 60.0, (i, snr_db(a.double(), b))
        else:
            assert torch.equal(a, b), i
