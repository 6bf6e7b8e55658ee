"""MoELayer's auxiliary-loss-free balancing (``expert_bias=True``): the buffers, what a forward
counts, the update, the model-wide helper (one all-reduce over data-parallel ranks), meta-device
init, torch.compile, and that it balances a skewed layer. The routing itself against the float64
reference: test_moe.py::test_moe_layer_matches_ref[sigmoid_expert_bias_fp32] and the router op tests."""

from __future__ import annotations

import copy

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.ops import update_expert_bias
from primus_turbo.testing.dist import run_ranks

H, FF, E, K = 32, 16, 8, 2


def _layer(device, **kw):
    kw.setdefault("score_function", "sigmoid")
    return turbo.modules.MoELayer(H, FF, E, K, expert_bias=True, device=device, **kw)


def test_buffers_and_state_dict(device):
    layer = _layer(device, expert_bias_update_rate=0.01)
    assert layer.expert_bias.dtype == torch.float32 and layer.expert_bias.shape == (E,)
    assert layer.local_tokens_per_expert.dtype == torch.float32
    assert not layer.expert_bias.any() and not layer.local_tokens_per_expert.any()
    sd = layer.state_dict()
    assert "expert_bias" in sd and "local_tokens_per_expert" not in sd  # the bias is checkpointed
    assert "expert_bias_update_rate=0.01" in repr(layer)
    plain = turbo.modules.MoELayer(H, FF, E, K, device=device)
    assert plain.expert_bias is None and "expert_bias" not in plain.state_dict()
    with pytest.raises(RuntimeError, match="built without expert_bias=True"):
        plain.update_expert_bias()
    # a checkpoint restores the bias
    with torch.no_grad():
        layer.expert_bias.copy_(torch.randn(E, device=device))
    twin = _layer(device)
    twin.load_state_dict(layer.state_dict())
    assert torch.equal(twin.expert_bias, layer.expert_bias)


def test_forward_counts_only_training_steps(device):
    layer = _layer(device)
    x1, x2 = torch.randn(24, H, device=device), torch.randn(2, 10, H, device=device)
    layer(x1)
    c1 = layer.tokens_per_expert.clone()
    layer(x2).sum().backward()
    c2 = layer.tokens_per_expert.clone()
    assert torch.equal(layer.local_tokens_per_expert, (c1 + c2).float())
    with torch.no_grad():
        layer(x1)                       # evaluation under no_grad: not counted
    layer.eval()
    layer(x2)                           # eval mode: not counted
    layer.train()
    assert torch.equal(layer.local_tokens_per_expert, (c1 + c2).float())


def test_update_moves_bias_and_clears_counts(device):
    layer = _layer(device, expert_bias_update_rate=0.05)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.randn(E, device=device) * 0.1)
    for _ in range(3):
        layer(torch.randn(20, H, device=device))
    counts, bias = layer.local_tokens_per_expert.clone(), layer.expert_bias.clone()
    layer.update_expert_bias()
    assert torch.equal(layer.expert_bias, update_expert_bias(bias, counts, 0.05))
    assert not torch.equal(layer.expert_bias, bias)
    assert not layer.local_tokens_per_expert.any()


def test_bias_steers_the_layer(device):
    layer = _layer(device)
    x = torch.randn(40, H, device=device)
    with torch.no_grad():
        layer.expert_bias[5] = 10.0
    y = layer(x)
    assert int(layer.tokens_per_expert[5]) == 40  # every token takes expert 5
    with torch.no_grad():
        layer.expert_bias.zero_()
    y0 = layer(x)
    assert int(layer.tokens_per_expert[5]) < 40 and not torch.equal(y, y0)


def test_update_expert_biases_on_a_model(device):
    model = torch.nn.Sequential(_layer(device), turbo.modules.MoELayer(H, FF, E, K, device=device),
                                _layer(device, expert_bias_update_rate=0.2))
    x = torch.randn(30, H, device=device)
    model(x)
    a, c = model[0], model[2]
    ca, cc = a.local_tokens_per_expert.clone(), c.local_tokens_per_expert.clone()
    assert turbo.modules.update_expert_biases(model) == 2
    assert torch.equal(a.expert_bias, update_expert_bias(torch.zeros(E, device=device), ca, 1e-3))
    assert torch.equal(c.expert_bias, update_expert_bias(torch.zeros(E, device=device), cc, 0.2))
    assert turbo.modules.update_expert_biases(torch.nn.Linear(2, 2)) == 0


def test_meta_init_zeroes_the_buffers(device):
    with torch.device("meta"):
        layer = _layer(None)
    layer.to_empty(device=device)
    with torch.no_grad():
        layer.expert_bias.fill_(float("nan"))
        layer.local_tokens_per_expert.fill_(float("nan"))
    for mod in layer.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    assert not layer.expert_bias.any() and not layer.local_tokens_per_expert.any()


def test_torch_compile_counts_like_eager(device):
    """fullgraph compile (aot_eager) routes with the bias and updates the count buffer in place
    exactly as the eager layer does."""
    torch._dynamo.reset()
    layer = _layer(device)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.randn(E, device=device) * 0.3)
    twin = copy.deepcopy(layer)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        x = torch.randn(24, H, device=device, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y, y2 = layer(x), compiled(x2)
        dy = torch.randn_like(y)
        y.backward(dy)
        y2.backward(dy)
        assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    assert torch.equal(layer.local_tokens_per_expert, twin.local_tokens_per_expert)
    assert layer.local_tokens_per_expert.sum() == 2 * 24 * K


def test_balances_a_skewed_layer(device):
    """Training-free check of the loop a trainer runs (forward, then update after each step): a layer
    whose router strongly prefers a few experts ends close to balanced."""
    torch.manual_seed(0)
    layer = _layer(device, expert_bias_update_rate=0.02)
    with torch.no_grad():
        layer.router.weight.zero_()
    base = torch.linspace(2.0, -2.0, E, device=device)  # a constant logit skew through a constant feature
    with torch.no_grad():
        layer.router.weight[:, 0] = base

    def step():
        x = torch.randn(64, H, device=device) * 0.5
        x[:, 0] = 1.0
        with torch.no_grad():
            layer.router.weight[:, 1:] = torch.randn(E, H - 1, device=device) * 0.2  # noise per step
        layer(x)
        return float(layer.tokens_per_expert.max()) / (64 * K / E)

    start = step()
    layer.update_expert_bias()
    for _ in range(60):
        step()
        layer.update_expert_bias()
    end = sum(step() for _ in range(4)) / 4
    print(f"max load / mean: {start:.2f} -> {end:.2f}")
    assert start > 2.5 and end < 1.7, (start, end)


def _dist_body(rank, world, dev, work_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_layer(dev), _layer(dev, expert_bias_update_rate=0.1))
    counts = [torch.tensor([3.0, 0, 1, 9, 4, 4, 2, 1]), torch.tensor([1.0, 5, 5, 0, 2, 8, 0, 3])]
    other = [torch.arange(8.0), torch.full((8,), 2.0)]
    with torch.no_grad():  # each rank saw its own tokens
        model[0].local_tokens_per_expert.copy_(counts[rank])
        model[1].local_tokens_per_expert.copy_(other[rank])
    assert turbo.modules.update_expert_biases(model) == 2
    zero = torch.zeros(8)
    # every rank gets the update of the summed counts, so the biases stay identical
    assert torch.equal(model[0].expert_bias, update_expert_bias(zero, counts[0] + counts[1], 1e-3))
    assert torch.equal(model[1].expert_bias, update_expert_bias(zero, other[0] + other[1], 0.1))
    assert not model[0].local_tokens_per_expert.any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a gloo (CPU) check; the GPU path is the same all_reduce")
def test_update_sums_counts_over_ranks():
    run_ranks(_dist_body)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(expert_bias=1), TypeError, "MoELayer: expert_bias must be True or False, got 1"),
    (dict(expert_bias=True, expert_bias_update_rate=-0.1), ValueError,
     r"expert_bias_update_rate must be a finite float >= 0, got -0.1"),
    (dict(expert_bias=True, expert_bias_update_rate=float("inf")), ValueError,
     r"expert_bias_update_rate must be a finite float >= 0, got inf"),
])
def test_bad_args(kwargs, exc, match, device):
    with pytest.raises(exc, match=match):
        turbo.modules.MoELayer(H, FF, E, K, device=device, **kwargs)


def test_buffers_stay_float32_under_module_casts(device):
    """model.to(bf16) / .half() cast parameters, not the balancing state: a bf16 bias near 1 would
    swallow 1e-3 steps (its spacing there is 2**-7) and bf16 counts stop being exact past 256."""
    layer = _layer(device)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.linspace(-1.0, 1.0, E, device=device) + 1e-4)
    bias = layer.expert_bias.clone()
    layer.to(torch.bfloat16)
    assert layer.router.weight.dtype == torch.bfloat16
    assert layer.expert_bias.dtype == torch.float32 and torch.equal(layer.expert_bias, bias)
    assert layer.local_tokens_per_expert.dtype == torch.float32
    layer(torch.randn(24, H, device=device, dtype=torch.bfloat16))
    assert float(layer.local_tokens_per_expert.sum()) == 24 * K
    layer.update_expert_bias()
    assert not torch.equal(layer.expert_bias, bias)  # the 1e-3 steps land
    layer.half()
    assert layer.expert_bias.dtype == torch.float32 and layer.experts.linear_fc1.weight.dtype == torch.float16
