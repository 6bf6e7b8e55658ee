"""Float64 plain-PyTorch references of the MoE router ops (clarity first, not speed).

The selection is written as a per-token Python loop over sorted ``(score, index)`` pairs, so it
is independent of the op's vectorized implementation; the probabilities are float64 torch ops so
autograd gives reference gradients.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["group_topk_router_ref", "indices_to_multihot_ref", "tokens_per_expert_to_mask_ref"]


def _best(values, k):
    """Indices of the k largest values; ties: the lower index first."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    return order[:k]


def group_topk_router_ref(
    logits: torch.Tensor,
    topk: int,
    groups: int = 1,
    selected_groups: int = 1,
    score_function: str = "sigmoid",
    scaling_factor: float = 1.0,
    expert_bias: torch.Tensor = None,
    normalize_topk: bool = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``fused_group_topk_routing_with_aux_score`` in float64.

    Returns ``(scores_for_aux_loss, probs, routing_map)``: float64, float64, bool, all ``[T, E]``.
    Rules: sigmoid or softmax scores; group score = sum of the group's ``topk // selected_groups``
    best scores (Megatron's ``group_limited_topk``; clamped to [1, E // groups]); keep the
    ``selected_groups`` best groups; top-k experts among them; sigmoid probs normalized over the
    top-k (when topk > 1), softmax probs are the softmax scores; both times ``scaling_factor``.
    Aux scores: softmax, or sigmoid divided by its row sum. ``expert_bias``: the group and
    expert selection rank ``score + bias``; the probs keep the unbiased scores. ``normalize_topk``:
    None = the rule above, True / False = always / never divide the selected scores by their sum.
    """
    x = logits.double()
    num_tokens, num_experts = x.shape
    per_group = num_experts // groups
    if score_function == "softmax":
        scores = torch.softmax(x, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(x)
    else:
        raise ValueError(score_function)

    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    per_pick = min(max(topk // selected_groups, 1), per_group)  # Megatron: topk // group_topk
    ranked = scores if expert_bias is None else scores + expert_bias.detach().to(scores.device).double()
    for t in range(num_tokens):
        row = ranked[t].tolist()
        group_scores = []
        for g in range(groups):
            members = row[g * per_group : (g + 1) * per_group]
            group_scores.append(sum(sorted(members, reverse=True)[:per_pick]))
        kept_groups = _best(group_scores, selected_groups)
        candidates = [e for g in sorted(kept_groups) for e in range(g * per_group, (g + 1) * per_group)]
        cand_scores = [row[e] for e in candidates]
        chosen = [candidates[i] for i in _best(cand_scores, topk)]
        routing_map[t, chosen] = True
    routing_map = routing_map.to(logits.device)

    selected = torch.where(routing_map, scores, torch.zeros_like(scores))
    if normalize_topk is None:
        normalize_topk = score_function == "sigmoid" and topk > 1
    if normalize_topk:
        selected = selected / (selected.sum(dim=-1, keepdim=True) + 1e-20)
    if score_function == "sigmoid":
        aux = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        aux = scores
    probs = selected * scaling_factor
    return aux, probs, routing_map


def indices_to_multihot_ref(
    indices: torch.Tensor, probs: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``indices_to_multihot``: loop; out-of-range indices (e.g. -1) ignored,
    duplicate indices in a row sum their probs. Returns (bool map, float64 dense probs)."""
    num_tokens, k = indices.shape
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    dense = torch.zeros(num_tokens, num_experts, dtype=torch.float64)
    p = probs.double()
    for t in range(num_tokens):
        for j in range(k):
            e = int(indices[t, j])
            if 0 <= e < num_experts:
                routing_map[t, e] = True
                dense[t, e] = dense[t, e] + p[t, j]
    return routing_map, dense


def tokens_per_expert_to_mask_ref(tokens_per_expert: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Reference of ``tokens_per_expert_to_mask``: the first ``sum(counts)`` of ``num_tokens`` rows."""
    total = int(tokens_per_expert.sum())
    return torch.tensor([i < total for i in range(num_tokens)], dtype=torch.bool)
