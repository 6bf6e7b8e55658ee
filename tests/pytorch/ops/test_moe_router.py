"""Tests of the MoE router ops against the float64 references in primus_turbo.testing.moe_ref."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.ops.moe_router import (
    fused_group_topk_routing_with_aux_score,
    indices_to_multihot,
    tokens_per_expert_to_mask,
)
from primus_turbo.testing.moe_ref import (
    group_topk_router_ref,
    indices_to_multihot_ref,
    tokens_per_expert_to_mask_ref,
)

ROUTER_CASES = [  # (experts, groups, selected_groups, topk)
    (64, 1, 1, 6),
    (52, 1, 1, 6),
    (112, 8, 3, 8),
    (112, 8, 3, 21),
    (24, 4, 2, 6),
    (64, 4, 2, 8),
    (256, 8, 4, 16),
]


def _check_router(logits, topk, groups, selected_groups, score_function, scaling, atol=1e-6):
    x = logits.detach().clone().requires_grad_(True)
    aux, probs, rmap = fused_group_topk_routing_with_aux_score(
        x, topk, groups=groups, selected_groups=selected_groups, score_function=score_function, scaling_factor=scaling
    )
    xr = logits.detach().cpu().double().requires_grad_(True)
    aux_r, probs_r, rmap_r = group_topk_router_ref(xr, topk, groups, selected_groups, score_function, scaling)

    assert aux.dtype == torch.float32 and probs.dtype == torch.float32 and rmap.dtype == torch.bool
    assert torch.equal(rmap.cpu(), rmap_r)
    assert (rmap.sum(-1) == topk).all()
    assert torch.equal(probs != 0, rmap)  # zeros exactly off the map
    torch.testing.assert_close(probs.cpu().double(), probs_r.detach(), atol=atol, rtol=1e-6)
    torch.testing.assert_close(aux.cpu().double(), aux_r.detach(), atol=atol, rtol=1e-6)

    g = torch.Generator().manual_seed(7)
    gp = torch.randn(probs.shape, generator=g, dtype=torch.float64)
    ga = torch.randn(aux.shape, generator=g, dtype=torch.float64)
    ((probs * gp.to(probs.device, torch.float32)).sum() + (aux * ga.to(aux.device, torch.float32)).sum()).backward()
    ((probs_r * gp).sum() + (aux_r * ga).sum()).backward()
    assert x.grad.dtype == logits.dtype
    tol = 1e-5 if logits.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: "E{}_G{}_S{}_K{}".format(*c))
@pytest.mark.parametrize("num_tokens", [8, 128])
def test_router_matches_reference(device, num_tokens, case, score_function):
    experts, groups, selected, topk = case
    g = torch.Generator().manual_seed(1000 + experts + topk + num_tokens)
    logits = torch.randn(num_tokens, experts, generator=g) * 2.0
    _check_router(logits.to(device), topk, groups, selected, score_function, 1.2)


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_router_bf16_logits(device, score_function):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 64, generator=g)).to(torch.bfloat16).to(device)
    _check_router(logits, 8, 4, 2, score_function, 1.0)


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_router_topk1_and_scaling_none(device, score_function):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 32, generator=g).to(device)
    aux, probs, rmap = fused_group_topk_routing_with_aux_score(
        logits, 1, score_function=score_function, scaling_factor=None
    )
    _check_router(logits, 1, 1, 1, score_function, 1.0)
    s = torch.sigmoid(logits) if score_function == "sigmoid" else torch.softmax(logits, -1)
    # topk == 1: the raw score of the argmax expert (Megatron does not normalize a single expert)
    torch.testing.assert_close(probs.sum(-1), s.max(-1).values, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_router_ties_lowest_index_wins(device, score_function):
    # all-equal logits: groups 0..S-1 and, inside them, the lowest experts win
    logits = torch.zeros(4, 32, device=device)
    _, probs, rmap = fused_group_topk_routing_with_aux_score(logits, 6, 4, 2, score_function, 1.0)
    expected = torch.zeros(4, 32, dtype=torch.bool)
    expected[:, :6] = True
    assert torch.equal(rmap.cpu(), expected)
    # equal group scores, distinct inside: group 1 and group 3 tie with group 0 / 2
    row = torch.full((32,), -5.0)
    row[8:16] = torch.arange(8.0) / 8  # group 1
    row[24:32] = torch.arange(8.0) / 8  # group 3, same scores as group 1
    _, _, rmap = fused_group_topk_routing_with_aux_score(row[None].to(device), 3, 4, 1, score_function, 1.0)
    assert rmap.cpu()[0].nonzero().flatten().tolist() == [13, 14, 15]
    # saturated sigmoid ties (logits 40, 50 both give 1.0 in fp32): lowest index among the ties
    row = torch.zeros(16)
    row[[3, 9, 12]] = torch.tensor([50.0, 40.0, 60.0])
    _, _, rmap = fused_group_topk_routing_with_aux_score(row[None].to(device), 2, 1, 1, "sigmoid", 1.0)
    assert rmap.cpu()[0].nonzero().flatten().tolist() == [3, 9]
    _check_router(torch.zeros(4, 32, device=device), 6, 4, 2, score_function, 1.2)


def test_router_errors():
    x = torch.randn(4, 24)
    with pytest.raises(ValueError, match=r"topk \(13\).*selected_groups 2 x experts per group 6 = 12"):
        fused_group_topk_routing_with_aux_score(x, 13, 4, 2)
    with pytest.raises(ValueError, match=r"topk \(25\)"):
        fused_group_topk_routing_with_aux_score(x, 25)
    with pytest.raises(ValueError, match=r"experts \(24\).*groups \(5\)"):
        fused_group_topk_routing_with_aux_score(x, 2, 5, 1)
    with pytest.raises(ValueError, match=r"selected_groups \(5\).*groups \(4\)"):
        fused_group_topk_routing_with_aux_score(x, 2, 4, 5)
    with pytest.raises(ValueError, match="score_function.*'relu'"):
        fused_group_topk_routing_with_aux_score(x, 2, score_function="relu")
    with pytest.raises(ValueError, match=r"2-D.*\(2, 4, 24\)"):
        fused_group_topk_routing_with_aux_score(torch.randn(2, 4, 24), 2)
    with pytest.raises(ValueError, match="torch.float64"):
        fused_group_topk_routing_with_aux_score(x.double(), 2)
    with pytest.raises(ValueError, match="torch.int32"):
        fused_group_topk_routing_with_aux_score(x.int(), 2)
    with pytest.raises(ValueError, match="topk must be a positive int, got 0"):
        fused_group_topk_routing_with_aux_score(x, 0)
    with pytest.raises(TypeError):
        fused_group_topk_routing_with_aux_score(x.tolist(), 2)


@pytest.mark.parametrize("num_experts", [8, 16])
def test_indices_to_multihot(device, num_experts):
    g = torch.Generator().manual_seed(num_experts)
    T, K = 33, 4
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.3] = -1  # masked (non-local) entries
    idx[0, 0] = num_experts  # out of range: ignored too
    probs = torch.rand(T, K, generator=g)
    p = probs.clone().to(device).requires_grad_(True)
    rmap, dense = indices_to_multihot(idx.to(device), p, num_experts)
    pr = probs.clone().double().requires_grad_(True)
    rmap_r, dense_r = indices_to_multihot_ref(idx, pr, num_experts)
    assert rmap.dtype == torch.bool and dense.dtype == torch.float32
    assert torch.equal(rmap.cpu(), rmap_r)
    torch.testing.assert_close(dense.cpu().double(), dense_r.detach(), atol=0, rtol=0)
    gd = torch.randn(T, num_experts, generator=g, dtype=torch.float64)
    (dense * gd.to(device, torch.float32)).sum().backward()
    (dense_r * gd).sum().backward()
    torch.testing.assert_close(p.grad.cpu().double(), pr.grad, atol=1e-6, rtol=1e-6)
    # round trip with the router's output
    logits = torch.randn(T, num_experts, generator=g).to(device)
    _, rprobs, rmap2 = fused_group_topk_routing_with_aux_score(logits, 2)
    top = rprobs.topk(2, dim=-1)
    rmap3, dense3 = indices_to_multihot(top.indices, top.values, num_experts)
    assert torch.equal(rmap3, rmap2) and torch.equal(dense3, rprobs)


def test_indices_to_multihot_errors():
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="integer dtype"):
        indices_to_multihot(idx.float(), torch.rand(4, 2), 8)
    with pytest.raises(ValueError, match=r"\(4, 3\).*\(4, 2\)"):
        indices_to_multihot(idx, torch.rand(4, 3), 8)
    with pytest.raises(ValueError, match="2-D"):
        indices_to_multihot(idx[0], torch.rand(2), 8)
    with pytest.raises(ValueError, match="num_experts.*0"):
        indices_to_multihot(idx, torch.rand(4, 2), 0)


def test_indices_to_multihot_primus_call_forms(device):
    """Primus-Turbo's ``indices_to_multihot(indices, probs_indices, num_of_local_experts, fused=False)``:
    its keyword names and ``fused`` give exactly the positional result (-1 entries masked), grads too."""
    g = torch.Generator().manual_seed(3)
    T, K, E = 17, 4, 8
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.3] = -1
    idx = idx.to(device)
    probs = torch.rand(T, K, generator=g).to(device)
    gd = torch.randn(T, E, generator=g).to(device)

    def run(*args, **kwargs):
        p = probs.clone().requires_grad_(True)
        args = tuple(p if a is probs else a for a in args)
        kwargs = {n: (p if a is probs else a) for n, a in kwargs.items()}
        rmap, dense = indices_to_multihot(*args, **kwargs)
        (dense * gd).sum().backward()
        return rmap, dense.detach(), p.grad

    ref = run(idx, probs, E)
    assert int(ref[0].sum()) == int((idx >= 0).sum())  # every -1 entry masked
    for args, kwargs in (
        ((idx,), dict(probs_indices=probs, num_of_local_experts=E)),
        ((), dict(indices=idx, probs_indices=probs, num_of_local_experts=E, fused=False)),
        ((idx, probs, E, True), {}),
        ((idx,), dict(probs_indices=probs, num_of_local_experts=E, fused=True)),
        ((idx, probs), dict(num_of_local_experts=E)),
        ((idx,), dict(probs_indices=probs, num_experts=E)),
        ((idx,), dict(probs=probs, num_experts=E, fused=False)),
    ):
        got = run(*args, **kwargs)
        for r, o in zip(ref, got):
            assert torch.equal(r, o), (args, list(kwargs))


def test_indices_to_multihot_alias_errors():
    idx = torch.zeros(4, 2, dtype=torch.int64)
    p = torch.rand(4, 2)
    with pytest.raises(TypeError, match="both probs and its alias probs_indices"):
        indices_to_multihot(idx, p, 8, probs_indices=p)
    with pytest.raises(TypeError, match="both num_experts and its alias num_of_local_experts"):
        indices_to_multihot(idx, p, 8, num_of_local_experts=8)
    with pytest.raises(TypeError, match="both num_experts and its alias num_of_local_experts"):
        indices_to_multihot(idx, probs_indices=p, num_experts=8, num_of_local_experts=8)
    with pytest.raises(TypeError, match=r"missing required argument probs \(or its alias probs_indices\)"):
        indices_to_multihot(idx, num_of_local_experts=8)
    with pytest.raises(TypeError, match=r"missing required argument num_experts \(or its alias num_of_local_experts\)"):
        indices_to_multihot(idx, probs_indices=p)
    with pytest.raises(TypeError, match="fused must be a bool, got 1"):
        indices_to_multihot(idx, p, 8, 1)
    with pytest.raises(TypeError, match="fused must be a bool"):
        indices_to_multihot(idx, probs_indices=p, num_of_local_experts=8, fused="yes")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tokens_per_expert_to_mask(device, dtype):
    for counts, n in (([3, 0, 5, 2], 16), ([0, 0], 4), ([4, 4], 8), ([10, 10], 12), ([1], 0)):
        c = torch.tensor(counts, dtype=dtype)
        m = tokens_per_expert_to_mask(c.to(device), n)
        assert m.dtype == torch.bool and m.shape == (n,)
        assert torch.equal(m.cpu(), tokens_per_expert_to_mask_ref(c, n))
    with pytest.raises(ValueError, match="integer dtype"):
        tokens_per_expert_to_mask(torch.ones(2), 4)
    with pytest.raises(ValueError, match="1-D"):
        tokens_per_expert_to_mask(torch.ones(2, 2, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="num_tokens.*-1"):
        tokens_per_expert_to_mask(torch.ones(2, dtype=torch.int32), -1)


@pytest.mark.gpu
def test_router_ops_no_host_sync():
    dev = "cuda"
    logits = torch.randn(128, 256, device=dev, requires_grad=True)
    idx = torch.randint(-1, 32, (128, 8), device=dev)
    probs = torch.rand(128, 8, device=dev, requires_grad=True)
    counts = torch.randint(0, 10, (32,), device=dev, dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for sf in ("sigmoid", "softmax"):
            aux, p, rmap = fused_group_topk_routing_with_aux_score(logits, 8, 8, 4, sf, 2.5)
            (p.sum() + aux.sum()).backward()
        rmap, dense = indices_to_multihot(idx, probs, 32)
        dense.sum().backward()
        tokens_per_expert_to_mask(counts, 512)
        from primus_turbo.pytorch.ops import update_expert_bias

        bias = torch.zeros(256, device=dev)
        _, p, rmap = fused_group_topk_routing_with_aux_score(logits, 8, 8, 4, "sigmoid", 2.5, expert_bias=bias)
        p.sum().backward()
        update_expert_bias(bias, rmap.sum(0), 1e-3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_group_limit_is_effective(device):
    # the group limit changes the choice on random data (guards against a vacuous group path)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(128, 256, generator=g).to(device)
    _, _, grouped = fused_group_topk_routing_with_aux_score(logits, 16, 8, 4)
    _, _, plain = fused_group_topk_routing_with_aux_score(logits, 16)
    assert not torch.equal(grouped, plain)
    # every selected expert lies in at most 4 of the 8 groups
    assert (grouped.view(128, 8, 32).any(-1).sum(-1) <= 4).all()


def _megatron_group_limited_map(scores, topk, groups, selected):
    """Megatron-LM's ``group_limited_topk`` restated with torch ops, as the routing map: a group's
    score is the sum of its best ``topk // selected`` scores."""
    t, e = scores.shape
    group_scores = scores.view(t, groups, -1).topk(topk // selected, dim=-1).values.sum(-1)
    keep = torch.zeros(t, groups, dtype=torch.bool).scatter_(1, group_scores.topk(selected, dim=-1).indices, True)
    masked = scores.masked_fill(~keep.repeat_interleave(e // groups, dim=1), float("-inf"))
    return torch.zeros(t, e, dtype=torch.bool).scatter_(1, masked.topk(topk, dim=-1).indices, True)


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_group_score_is_megatrons_topk_share(device, score_function):
    """A group is scored by its best topk // selected_groups experts (Megatron), not its best two:
    two strong experts (group 0) lose to four even ones (group 1) when each token takes 4 of 8."""
    strong, weak, even = 1.0, -4.0, 0.6
    logits = torch.tensor([[strong, strong, weak, weak, even, even, even, even]])
    _, _, rmap = fused_group_topk_routing_with_aux_score(logits.to(device), 4, 2, 1, score_function)
    assert rmap.cpu().tolist() == [[False] * 4 + [True] * 4]
    # and on random data, at shapes where the two rules part (Primus-Turbo's own router test cases)
    g = torch.Generator().manual_seed(23)
    for experts, groups, selected, topk in ((64, 4, 2, 8), (256, 8, 4, 16), (112, 8, 3, 21)):
        logits = torch.randn(256, experts, generator=g)
        scores = torch.sigmoid(logits) if score_function == "sigmoid" else torch.softmax(logits, -1)
        _, _, rmap = fused_group_topk_routing_with_aux_score(logits.to(device), topk, groups, selected,
                                                             score_function)
        assert torch.equal(rmap.cpu(), _megatron_group_limited_map(scores, topk, groups, selected))


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_router_none_groups_mean_one(device, score_function):
    """Megatron passes num_groups / group_topk, None when unset: Primus-Turbo maps each None to 1."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(16, 32, generator=g) * 2.0).to(device)

    def run(groups, selected):
        x = logits.clone().requires_grad_(True)
        outs = fused_group_topk_routing_with_aux_score(x, 4, groups, selected, score_function, 1.5)
        gp = torch.randn(outs[1].shape, generator=torch.Generator().manual_seed(5)).to(device)
        ((outs[0] * gp).sum() + (outs[1] * gp).sum()).backward()
        return outs, x.grad

    for groups, selected, same_as in ((None, None, (1, 1)), (4, None, (4, 1)), (None, 1, (1, 1))):
        (aux, probs, rmap), grad = run(groups, selected)
        (aux_r, probs_r, rmap_r), grad_r = run(*same_as)
        assert torch.equal(rmap, rmap_r) and torch.equal(probs, probs_r) and torch.equal(aux, aux_r)
        assert torch.equal(grad, grad_r)
    # keyword form, as Primus-Turbo's signature names them
    _, probs_kw, _ = fused_group_topk_routing_with_aux_score(logits, 4, groups=None, selected_groups=None,
                                                            score_function=score_function, scaling_factor=1.5)
    assert torch.equal(probs_kw, run(1, 1)[0][1].detach())
    # group-limited for real with selected_groups None (= 1): every pick in one group of 8
    _, _, rmap = fused_group_topk_routing_with_aux_score(logits, 4, 4, None, score_function, 1.0)
    picked_groups = rmap.view(16, 4, 8).any(-1).sum(-1)
    assert (picked_groups == 1).all()


def test_router_none_groups_validation():
    x = torch.randn(4, 24)
    # None is 1 for the checks too: selected_groups 2 > groups 1, topk past one group of 6
    with pytest.raises(ValueError, match=r"selected_groups \(2\) must be <= groups \(1\)"):
        fused_group_topk_routing_with_aux_score(x, 2, None, 2)
    with pytest.raises(ValueError, match=r"topk \(7\).*selected_groups 1 x experts per group 6 = 6"):
        fused_group_topk_routing_with_aux_score(x, 7, 4, None)
    # other values keep their checks
    with pytest.raises(ValueError, match="groups must be a positive int, got 0"):
        fused_group_topk_routing_with_aux_score(x, 2, 0, None)
    with pytest.raises(ValueError, match="selected_groups must be a positive int, got 1.0"):
        fused_group_topk_routing_with_aux_score(x, 2, None, 1.0)
    with pytest.raises(ValueError, match="groups must be a positive int, got True"):
        fused_group_topk_routing_with_aux_score(x, 2, True, None)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_router_scaling_factor_must_be_finite(bad):
    # a NaN / inf scaling factor used to give NaN / inf probabilities silently
    with pytest.raises(ValueError, match=rf"fused_group_topk_routing_with_aux_score: scaling_factor must be finite, "
                                         rf"got {bad!r}"):
        fused_group_topk_routing_with_aux_score(torch.randn(4, 8), 2, scaling_factor=bad)


def test_tokens_per_expert_to_mask_negative_count():
    # [5, -3] used to give 2 True rows silently; on CPU (where it costs no sync) it is an error
    with pytest.raises(RuntimeError, match="tokens_per_expert_to_mask: tokens_per_expert has a negative count"):
        tokens_per_expert_to_mask(torch.tensor([5, -3]), 8)
    assert tokens_per_expert_to_mask(torch.zeros(0, dtype=torch.int64), 3).tolist() == [False] * 3


# ----------------------------------------------------------------------------------------------
# Auxiliary-loss-free balancing: expert_bias and update_expert_bias
# ----------------------------------------------------------------------------------------------
def _check_router_bias(logits, bias, topk, groups, selected_groups, score_function, scaling):
    x = logits.detach().clone().requires_grad_(True)
    b = bias.detach().clone().requires_grad_(True)  # a bias that asks for a gradient gets none
    aux, probs, rmap = fused_group_topk_routing_with_aux_score(
        x, topk, groups, selected_groups, score_function, scaling, expert_bias=b)
    xr = logits.detach().cpu().double().requires_grad_(True)
    aux_r, probs_r, rmap_r = group_topk_router_ref(xr, topk, groups, selected_groups, score_function, scaling,
                                                   expert_bias=bias.cpu())
    assert torch.equal(rmap.cpu(), rmap_r)
    assert torch.equal(probs != 0, rmap)
    torch.testing.assert_close(probs.cpu().double(), probs_r.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(aux.cpu().double(), aux_r.detach(), atol=1e-6, rtol=1e-6)
    g = torch.Generator().manual_seed(8)
    gp = torch.randn(probs.shape, generator=g, dtype=torch.float64)
    ga = torch.randn(aux.shape, generator=g, dtype=torch.float64)
    ((probs * gp.to(probs.device, torch.float32)).sum() + (aux * ga.to(aux.device, torch.float32)).sum()).backward()
    ((probs_r * gp).sum() + (aux_r * ga).sum()).backward()
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad, atol=1e-5, rtol=1e-5)
    assert b.grad is None
    return rmap


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
@pytest.mark.parametrize("case", [(64, 1, 1, 6), (112, 8, 3, 8), (64, 4, 2, 8)], ids=lambda c: "E{}_G{}_S{}_K{}".format(*c))
def test_router_expert_bias_matches_reference(device, case, score_function):
    """The bias steers the group and expert selection; probs, aux scores and gradients stay those
    of the unbiased scores for the experts so chosen (float64 reference)."""
    experts, groups, selected, topk = case
    g = torch.Generator().manual_seed(2000 + experts + topk)
    logits = torch.randn(96, experts, generator=g) * 2.0
    spread = 0.3 if score_function == "sigmoid" else 0.3 / experts  # about the scores' own spread
    bias = torch.randn(experts, generator=g) * spread
    rmap = _check_router_bias(logits.to(device), bias.to(device), topk, groups, selected, score_function, 1.7)
    # not vacuous: the bias changed the selection
    _, _, plain = fused_group_topk_routing_with_aux_score(logits.to(device), topk, groups, selected, score_function)
    assert not torch.equal(rmap, plain)


def test_router_expert_bias_forces_and_leaves_probs_unbiased(device):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 16, generator=g).to(device)
    bias = torch.zeros(16, device=device)
    bias[11] = 10.0  # larger than any score gap: expert 11 is in every token's top-2
    _, probs, rmap = fused_group_topk_routing_with_aux_score(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert rmap[:, 11].all()
    s = torch.sigmoid(logits)
    sel = torch.where(rmap, s, torch.zeros_like(s))
    torch.testing.assert_close(probs, sel / sel.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6)
    # bf16 / fp16 biases are accepted (taken to float32)
    _, _, rmap16 = fused_group_topk_routing_with_aux_score(logits, 2, score_function="sigmoid",
                                                           expert_bias=bias.to(torch.bfloat16))
    assert torch.equal(rmap16, rmap)


def test_router_expert_bias_errors():
    x = torch.randn(4, 8)
    op = "fused_group_topk_routing_with_aux_score"
    with pytest.raises(ValueError, match=rf"{op}: expert_bias must be 1-D \[8\] \(one entry per expert\), got shape \(9,\)"):
        fused_group_topk_routing_with_aux_score(x, 2, expert_bias=torch.zeros(9))
    with pytest.raises(ValueError, match=r"got shape \(1, 8\)"):
        fused_group_topk_routing_with_aux_score(x, 2, expert_bias=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="expert_bias must be a floating-point tensor .* got torch.int64"):
        fused_group_topk_routing_with_aux_score(x, 2, expert_bias=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert_bias on meta, logits on cpu"):
        fused_group_topk_routing_with_aux_score(x, 2, expert_bias=torch.zeros(8, device="meta"))
    with pytest.raises(TypeError, match="expert_bias must be a torch.Tensor or None, got list"):
        fused_group_topk_routing_with_aux_score(x, 2, expert_bias=[0.0] * 8)


def test_update_expert_bias_rule(device):
    from primus_turbo.pytorch.ops import update_expert_bias

    bias = torch.tensor([0.5, -0.25, 0.0, 1.0, 0.125], device=device)
    before = bias.clone()
    for counts in (torch.tensor([10, 2, 6, 6, 6]), torch.tensor([10.0, 2.0, 6.0, 6.0, 6.0])):
        new = update_expert_bias(bias, counts.to(device), 0.01)
        # mean load 6: the overloaded expert goes down, the underloaded one up, those at the mean stay
        expected = before + torch.tensor([-0.01, 0.01, 0.0, 0.0, 0.0], device=device)
        assert new.dtype == torch.float32 and torch.equal(new, expected)
        assert torch.equal(bias, before)  # functional: the input is not written
    # only the signs count: every count scaled alike (more micro-batches, a recompute) changes nothing
    c = torch.randint(0, 50, (5,), device=device)
    assert torch.equal(update_expert_bias(bias, c, 1e-3), update_expert_bias(bias, 3 * c, 1e-3))
    assert torch.equal(update_expert_bias(bias, c, 0.0), bias)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(update_rate=-1e-3), ValueError, r"update_rate must be a finite float >= 0, got -0.001"),
    (dict(update_rate=float("nan")), ValueError, r"update_rate must be a finite float >= 0, got nan"),
    (dict(update_rate=True), ValueError, r"update_rate must be a finite float >= 0, got True"),
    (dict(tokens_per_expert=torch.zeros(2, 4)), ValueError, r"tokens_per_expert must be 1-D \[experts\], got shape \(2, 4\)"),
    (dict(tokens_per_expert=torch.zeros(5)), ValueError, r"expert_bias must be 1-D \[5\]"),
    (dict(tokens_per_expert=torch.zeros(4, dtype=torch.bool)), ValueError, "must be a real count tensor, got torch.bool"),
    (dict(tokens_per_expert=[1, 2, 3, 4]), TypeError, "tokens_per_expert must be a torch.Tensor, got list"),
    (dict(expert_bias=torch.zeros(4, dtype=torch.int32)), ValueError, "expert_bias must be a floating-point tensor"),
    (dict(expert_bias=torch.zeros(4, device="meta")), ValueError, "expert_bias on meta, tokens_per_expert on cpu"),
])
def test_update_expert_bias_errors(kwargs, exc, match):
    from primus_turbo.pytorch.ops import update_expert_bias

    args = dict(expert_bias=torch.zeros(4), tokens_per_expert=torch.tensor([1, 2, 3, 4]), update_rate=1e-3)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        update_expert_bias(**args)


def test_expert_bias_balances_a_skewed_router(device):
    """The rule does what it is for: router logits that favour a few experts (a fixed skew plus
    noise), routed with the bias and updated after every batch, end close to balanced."""
    from primus_turbo.pytorch.ops import update_expert_bias

    E, k, T = 16, 2, 512
    g = torch.Generator().manual_seed(9)
    skew = torch.linspace(2.0, -2.0, E)  # expert 0 strongly preferred, expert 15 rarely chosen
    bias = torch.zeros(E, device=device)

    def imbalance(b):
        logits = (skew + torch.randn(T, E, generator=g)).to(device)
        _, _, rmap = fused_group_topk_routing_with_aux_score(logits, k, score_function="sigmoid", expert_bias=b)
        load = rmap.sum(0)
        return load, float(load.max()) / (T * k / E)

    _, start = imbalance(bias)
    for _ in range(150):
        load, _ = imbalance(bias)
        bias = update_expert_bias(bias, load, 0.01)
    _, end = imbalance(bias)
    print(f"max load / mean: {start:.2f} -> {end:.2f}")
    assert start > 3.0 and end < 1.6, (start, end)
    assert bias[0] < 0 < bias[-1]  # the favoured expert was pushed down, the neglected one up


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_router_normalize_topk(device, score_function, normalize):
    """normalize_topk overrides the reference's rule either way; against the float64 reference,
    gradients included. Softmax + True is the softmax over the top-k logits (Mixtral / Qwen3-MoE)."""
    g = torch.Generator().manual_seed(31)
    logits = (torch.randn(64, 32, generator=g) * 2.0).to(device)
    x = logits.clone().requires_grad_(True)
    aux, probs, rmap = fused_group_topk_routing_with_aux_score(x, 4, 4, 2, score_function, 1.5,
                                                               normalize_topk=normalize)
    xr = logits.cpu().double().requires_grad_(True)
    aux_r, probs_r, rmap_r = group_topk_router_ref(xr, 4, 4, 2, score_function, 1.5, normalize_topk=normalize)
    assert torch.equal(rmap.cpu(), rmap_r)
    torch.testing.assert_close(probs.cpu().double(), probs_r.detach(), atol=1e-6, rtol=1e-6)
    gp = torch.randn(probs.shape, generator=g, dtype=torch.float64)
    (probs * gp.to(device, torch.float32)).sum().backward()
    (probs_r * gp).sum().backward()
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad, atol=1e-5, rtol=1e-5)
    sums = probs.sum(-1)
    if normalize:
        torch.testing.assert_close(sums, torch.full_like(sums, 1.5), atol=1e-5, rtol=1e-5)
        if score_function == "softmax":  # = softmax over the selected logits, times the scale
            top = torch.where(rmap, logits, torch.full_like(logits, float("-inf")))
            torch.testing.assert_close(probs, torch.softmax(top, -1) * 1.5, atol=1e-6, rtol=1e-5)
    else:  # the raw selected scores, times the scale
        s = torch.sigmoid(logits) if score_function == "sigmoid" else torch.softmax(logits, -1)
        torch.testing.assert_close(probs, torch.where(rmap, s, torch.zeros_like(s)) * 1.5, atol=1e-6, rtol=1e-6)
        assert not torch.allclose(sums, torch.full_like(sums, 1.5))
    with pytest.raises(TypeError, match="normalize_topk must be None, True or False, got 'yes'"):
        fused_group_topk_routing_with_aux_score(logits, 4, normalize_topk="yes")
