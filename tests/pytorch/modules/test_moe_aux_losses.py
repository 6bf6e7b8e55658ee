"""MoELayer's auxiliary losses against float64 references from the layer's own logits: the global
(Switch) and sequence-wise (DeepSeek-V3) load-balancing losses and the router z-loss, their sum in
``aux_loss``, the per-term ``aux_loss_terms``, and the gradients they send to the router weight."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.testing import group_topk_router_ref

H, FF, E, K = 32, 16, 8, 2


def _ref_terms(layer, x, logits_used):
    """float64 terms from the layer's weights (for gradients) and its own logits (for the selection)."""
    shape = x.shape
    x64 = x.detach().reshape(-1, H).double().cpu()  # float64 on the host, whatever the layer's device
    w = layer.router.weight.detach().double().cpu().requires_grad_(True)
    logits_used = logits_used.cpu()
    logits = x64 @ w.t()
    _, _, mask = group_topk_router_ref(logits_used, K, layer.groups, layer.selected_groups, layer.score_function,
                                       1.0 if layer.scaling_factor is None else layer.scaling_factor)
    scores = torch.softmax(logits, -1) if layer.score_function == "softmax" else torch.sigmoid(logits)
    aux_scores = scores if layer.score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
    terms = {}
    if layer.aux_loss_coeff > 0:
        seqs = [slice(None)]
        if layer.load_balancing_type == "seq_aux_loss" and len(shape) == 3:
            s = shape[1]
            seqs = [slice(i * s, (i + 1) * s) for i in range(shape[0])]
        per_seq = []
        for sl in seqs:  # one loop per sequence: independent of the op's reshapes
            m, p = mask[sl], aux_scores[sl]
            n = m.shape[0]
            f = m.sum(0).double() / (n * K)
            per_seq.append(layer.aux_loss_coeff * E * (f * p.mean(0)).sum())
        terms["load_balancing"] = torch.stack(per_seq).mean()
    if layer.z_loss_coeff > 0:
        terms["z_loss"] = layer.z_loss_coeff * (torch.logsumexp(logits, -1) ** 2).mean()
    total = sum(terms.values())
    total.backward()
    return {k: v.detach() for k, v in terms.items()}, total.detach(), w.grad


_CASES = {
    "aux_2d": dict(shape=(48,), kw=dict(aux_loss_coeff=0.01)),
    "aux_3d": dict(shape=(3, 16), kw=dict(aux_loss_coeff=0.01, score_function="sigmoid")),
    "seq_aux_3d": dict(shape=(3, 16), kw=dict(aux_loss_coeff=0.01, load_balancing_type="seq_aux_loss")),
    "seq_aux_sigmoid_groups": dict(shape=(4, 12), kw=dict(aux_loss_coeff=1e-3, load_balancing_type="seq_aux_loss",
                                                          score_function="sigmoid", groups=4, selected_groups=2)),
    "seq_aux_2d_is_global": dict(shape=(40,), kw=dict(aux_loss_coeff=0.01, load_balancing_type="seq_aux_loss")),
    "z_only": dict(shape=(2, 20), kw=dict(z_loss_coeff=1e-3)),
    "seq_aux_and_z": dict(shape=(2, 20), kw=dict(aux_loss_coeff=0.01, load_balancing_type="seq_aux_loss",
                                                 z_loss_coeff=1e-3, router_dtype=torch.float32)),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_aux_losses_match_reference(case, device):
    c = _CASES[case]
    layer = turbo.modules.MoELayer(H, FF, E, K, device=device, **c["kw"])
    box = {}
    layer.router.register_forward_hook(lambda mod, inp, out: box.__setitem__("logits", out.detach()))
    x = torch.randn(*c["shape"], H, device=device) * 2.0
    layer(x)
    ref_terms, ref_total, ref_grad = _ref_terms(layer, x, box["logits"])
    assert set(layer.aux_loss_terms) == set(ref_terms)
    for name, v in ref_terms.items():
        got = layer.aux_loss_terms[name]
        assert got.dim() == 0 and got.dtype == torch.float32 and not got.requires_grad
        torch.testing.assert_close(got.double().cpu(), v, rtol=1e-5, atol=1e-8)
    assert layer.aux_loss.dtype == torch.float32
    torch.testing.assert_close(layer.aux_loss.detach().double().cpu(), ref_total, rtol=1e-5, atol=1e-8)
    layer.router.weight.grad = None
    layer.aux_loss.backward()
    torch.testing.assert_close(layer.router.weight.grad.double().cpu(), ref_grad, rtol=1e-4, atol=1e-8)


def test_seq_aux_loss_differs_from_global(device):
    """Not vacuous: with sequences routed differently, the per-sequence loss is not the global one
    (each sequence here prefers its own experts, so the global load looks balanced)."""
    kw = dict(aux_loss_coeff=0.01)
    a = turbo.modules.MoELayer(H, FF, E, K, device=device, **kw)
    b = turbo.modules.MoELayer(H, FF, E, K, device=device, load_balancing_type="seq_aux_loss", **kw)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 16, H, device=device)
    with torch.no_grad():  # sequence 0 leans to experts 0-3, sequence 1 to 4-7, through feature 0
        a.router.weight[:, 0] = torch.tensor([3.0] * 4 + [-3.0] * 4, device=device)
        b.router.weight.copy_(a.router.weight)
        x[0, :, 0], x[1, :, 0] = 2.0, -2.0
    a(x)
    b(x)
    print(f"global {float(a.aux_loss.detach()):.4f} seq {float(b.aux_loss.detach()):.4f}")
    assert float(b.aux_loss.detach()) > 1.5 * float(a.aux_loss.detach())


def test_no_terms_no_aux_loss(device):
    layer = turbo.modules.MoELayer(H, FF, E, K, device=device)
    layer(torch.randn(10, H, device=device))
    assert layer.aux_loss is None and layer.aux_loss_terms == {}


def test_empty_input_terms_are_zero(device):
    layer = turbo.modules.MoELayer(H, FF, E, K, device=device, aux_loss_coeff=0.01, z_loss_coeff=1e-3,
                                   load_balancing_type="seq_aux_loss")
    x = torch.randn(0, H, device=device, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, H)
    assert float(layer.aux_loss) == 0.0 and set(layer.aux_loss_terms) == {"load_balancing", "z_loss"}
    layer.aux_loss.backward()
    assert layer.router.weight.grad is not None and not layer.router.weight.grad.any()


def test_compiled_losses_match_eager(device):
    import copy

    torch._dynamo.reset()
    layer = turbo.modules.MoELayer(H, FF, E, K, device=device, aux_loss_coeff=0.01, z_loss_coeff=1e-3,
                                   load_balancing_type="seq_aux_loss", score_function="sigmoid")
    twin = copy.deepcopy(layer)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 12, H, device=device)
    layer(x)
    compiled(x)
    assert torch.equal(layer.aux_loss, twin.aux_loss)
    for name in ("load_balancing", "z_loss"):
        assert torch.equal(layer.aux_loss_terms[name], twin.aux_loss_terms[name])


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_aux_loss_in_backward_equals_adding_it(device, scale):
    """aux_loss_in_backward=True: backward of the output alone gives the router the gradient of
    loss + scale * aux_loss (what a loop adding the loss by hand gets); aux_loss is then detached."""
    import copy

    kw = dict(aux_loss_coeff=0.05, z_loss_coeff=1e-2, load_balancing_type="seq_aux_loss", score_function="sigmoid")
    plain = turbo.modules.MoELayer(H, FF, E, K, device=device, **kw)
    auto = turbo.modules.MoELayer(H, FF, E, K, device=device, aux_loss_in_backward=True, **kw)
    auto.load_state_dict(plain.state_dict())
    auto.aux_loss_backward_scale = scale
    x = torch.randn(2, 12, H, device=device)
    y1, y2 = plain(x), auto(x)
    assert torch.equal(y1, y2)
    dy = torch.randn_like(y1)
    ((y1 * dy).sum() + scale * plain.aux_loss).backward()
    (y2 * dy).sum().backward()
    assert not auto.aux_loss.requires_grad and torch.equal(auto.aux_loss, plain.aux_loss.detach())
    g1, g2 = plain.router.weight.grad, auto.router.weight.grad
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-7)
    # not vacuous: the aux terms' share of the router gradient is visible
    bare = copy.deepcopy(plain)
    bare.router.weight.grad = None
    (bare(x) * dy).sum().backward()
    assert (bare.router.weight.grad - g1).abs().max() > 1e-4 * scale
    with pytest.raises(TypeError, match="aux_loss_in_backward must be True or False, got 'yes'"):
        turbo.modules.MoELayer(H, FF, E, K, device=device, aux_loss_in_backward="yes")


def test_deepcopy_and_pickle_after_a_forward(device):
    """A layer that ran a forward holds that step's aux_loss (part of its graph); deepcopy (an EMA
    twin) and pickling still work, and the copy starts without it."""
    import copy
    import io

    layer = turbo.modules.MoELayer(H, FF, E, K, device=device, aux_loss_coeff=0.01, expert_bias=True)
    layer(torch.randn(10, H, device=device))
    assert layer.aux_loss.requires_grad
    twin = copy.deepcopy(layer)
    assert twin.aux_loss is None and layer.aux_loss is not None
    assert torch.equal(twin.router.weight, layer.router.weight) and torch.equal(twin.expert_bias, layer.expert_bias)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.aux_loss is None and torch.equal(back.router.weight, layer.router.weight)
    twin(torch.randn(10, H, device=device))
    assert twin.aux_loss is not None
