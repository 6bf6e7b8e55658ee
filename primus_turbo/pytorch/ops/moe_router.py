"""MoE router ops: ``turbo.ops.fused_group_topk_routing_with_aux_score``, ``indices_to_multihot``,
``tokens_per_expert_to_mask``.

All three are built from on-device PyTorch ops (no ``.item()``, no host sync, no data-dependent
shapes), so they are CUDA-graph and ``torch.compile`` friendly; autograd runs through the torch ops.

Router semantics (Megatron-LM ``topk_routing_with_score_function`` with ``use_pre_softmax=True``
and DeepSeek-V3 group-limited routing), for ``logits [T, E]``, all math in float32::

    score  = sigmoid(logits)                   score_function == "sigmoid"
           = softmax(logits, dim=-1)           score_function == "softmax"
    E is split into ``groups`` contiguous groups of E // groups experts;
    group_score[g] = sum of the top-j expert scores of group g, j = topk // selected_groups
      (Megatron's ``group_limited_topk`` rule, used for both score functions; DeepSeek-V3's
      top-2 sum is the case topk 8 / 4 groups; j is at least 1 and at most E // groups, where
      Megatron's own formula would sum nothing or fail; ``groups == 1`` is plain top-k)
    keep the ``selected_groups`` best groups, then the ``topk`` best experts inside them.
    probs[t, e] = score[t, e] / (sum of the top-k scores of t + 1e-20) * scaling_factor
                                               sigmoid and topk > 1 (Megatron normalizes), or
                                               normalize_topk=True (softmax: the softmax over
                                               the top-k logits)
                = score[t, e] * scaling_factor sigmoid with topk == 1, and softmax
                  (softmax over *all* experts, then the selected scores: "pre-softmax"), or
                  normalize_topk=False
      for the selected experts, 0 elsewhere; routing_map[t, e] = e is selected.
    scores_for_aux_loss = softmax(logits)                                  softmax
                        = sigmoid(logits) / (sum_e sigmoid(logits) + 1e-20)  sigmoid
      (Megatron's ``compute_routing_scores_for_aux_loss``: the full [T, E] score matrix,
      not limited to the selected groups).

Auxiliary-loss-free load balancing (DeepSeek-V3; Megatron's ``moe_router_enable_expert_bias``,
TorchTitan's ``load_balance_coeff``): with ``expert_bias`` (``[E]``), the group scores and the top-k
are taken over ``score + expert_bias``, while ``probs`` keep the unbiased scores of the experts so
chosen; the bias gets no gradient. ``update_expert_bias`` moves it by
``update_rate * sign(mean load - load)`` after each step (see :class:`turbo.modules.MoELayer`).

Tie-breaking is deterministic: among equal scores (equal group scores, equal expert scores) the
lower index wins, for group selection and for expert selection (stable descending sorts).
NaN logits give unspecified routing.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = [
    "fused_group_topk_routing_with_aux_score",
    "indices_to_multihot",
    "tokens_per_expert_to_mask",
    "update_expert_bias",
]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCORE_FUNCTIONS = ("sigmoid", "softmax")
_EPS = 1e-20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _one_of(op: str, name: str, value, alias: str, alias_value):
    """The value of an argument that may be given under ``name`` or under its alias ``alias``, not both."""
    if value is not None and alias_value is not None:
        raise TypeError(f"{op}: got both {name} and its alias {alias}; pass exactly one")
    if value is None and alias_value is None:
        raise TypeError(f"{op}: missing required argument {name} (or its alias {alias})")
    return value if value is not None else alias_value


def _check_router_args(logits, topk, groups, selected_groups, score_function, scaling_factor):
    op = "fused_group_topk_routing_with_aux_score"
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{op}: logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be 2-D [tokens, experts], got shape {tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"{op}: logits.dtype must be float32, bfloat16 or float16, got {logits.dtype}")
    num_experts = logits.shape[1]
    if num_experts < 1:
        raise ValueError(f"{op}: logits must have at least one expert column, got shape {tuple(logits.shape)}")
    for name, v in (("topk", topk), ("groups", groups), ("selected_groups", selected_groups)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")
    if num_experts % groups != 0:
        raise ValueError(f"{op}: experts ({num_experts}) must be divisible by groups ({groups})")
    if selected_groups > groups:
        raise ValueError(f"{op}: selected_groups ({selected_groups}) must be <= groups ({groups})")
    available = selected_groups * (num_experts // groups)
    if topk > available:
        raise ValueError(
            f"{op}: topk ({topk}) exceeds the experts in the selected groups "
            f"(selected_groups {selected_groups} x experts per group {num_experts // groups} = {available})"
        )
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(f"{op}: score_function must be 'sigmoid' or 'softmax', got {score_function!r}")
    if not isinstance(scaling_factor, (int, float)) or isinstance(scaling_factor, bool):
        raise ValueError(f"{op}: scaling_factor must be a float or None, got {scaling_factor!r}")
    if not math.isfinite(scaling_factor):
        raise ValueError(f"{op}: scaling_factor must be finite, got {scaling_factor!r} (the probs would be "
                         f"NaN / inf)")


def _check_expert_bias(op: str, expert_bias, num_experts: int, device: torch.device, other: str = "logits") -> None:
    if not isinstance(expert_bias, torch.Tensor):
        raise TypeError(f"{op}: expert_bias must be a torch.Tensor or None, got {type(expert_bias).__name__}")
    if expert_bias.dim() != 1 or expert_bias.shape[0] != num_experts:
        raise ValueError(f"{op}: expert_bias must be 1-D [{num_experts}] (one entry per expert), got shape "
                         f"{tuple(expert_bias.shape)}")
    if not expert_bias.dtype.is_floating_point:
        raise ValueError(f"{op}: expert_bias must be a floating-point tensor (float32 recommended), got "
                         f"{expert_bias.dtype}")
    if expert_bias.device != device:
        raise ValueError(f"{op}: expert_bias on {expert_bias.device}, {other} on {device}")


def _stable_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim; equal values: lower index first."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


@torch.no_grad()
def _select_experts(scores: torch.Tensor, topk: int, groups: int, selected_groups: int) -> torch.Tensor:
    """``[T, topk]`` int64 indices of the selected experts (group-limited, deterministic ties)."""
    num_tokens, num_experts = scores.shape
    if groups > 1 and selected_groups < groups:
        per_group = num_experts // groups
        grouped = scores.view(num_tokens, groups, per_group)
        # Megatron scores a group by its best topk // selected_groups experts: a group holding that
        # token's share of the top-k on its own outranks one with a single strong expert
        per_pick = min(max(topk // selected_groups, 1), per_group)
        group_scores = grouped.topk(per_pick, dim=-1).values.sum(dim=-1)  # [T, G]
        group_idx = _stable_topk_indices(group_scores, selected_groups)  # [T, Gs]
        group_mask = torch.zeros(num_tokens, groups, dtype=torch.bool, device=scores.device)
        group_mask.scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, groups, per_group).reshape(num_tokens, num_experts)
        scores = scores.masked_fill(~expert_mask, float("-inf"))
    return _stable_topk_indices(scores, topk)


def fused_group_topk_routing_with_aux_score(
    logits: torch.Tensor,
    topk: int,
    groups: Optional[int] = 1,
    selected_groups: Optional[int] = 1,
    score_function: str = "sigmoid",
    scaling_factor: Optional[float] = 1.0,
    *,
    expert_bias: Optional[torch.Tensor] = None,
    normalize_topk: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE router: scores, DeepSeek group-limited top-k, scaled probs and routing map.

    Args:
        logits: ``[T, E]`` float32 / bfloat16 / float16 router logits.
        topk: experts per token; ``topk <= selected_groups * E // groups``.
        groups: number of expert groups (``E % groups == 0``); 1 or ``None`` = no grouping
            (Megatron passes its ``num_groups``, ``None`` when unset).
        selected_groups: groups kept per token (``1 <= selected_groups <= groups``); ``None`` = 1
            (Megatron's ``group_topk`` unset), as in Primus-Turbo.
        score_function: ``"sigmoid"`` or ``"softmax"``.
        scaling_factor: multiplier of the routing probs (``None`` = 1.0).
        expert_bias: optional ``[E]`` floating tensor on ``logits``' device (a float32 buffer in
            practice), added to the scores for the group and expert *selection* only
            (auxiliary-loss-free balancing); ``probs`` and ``scores_for_aux_loss`` stay unbiased and
            the bias receives no gradient. Beyond Primus-Turbo's signature (keyword only).
        normalize_topk: whether the selected scores are divided by their sum (before
            ``scaling_factor``). ``None`` (the reference's rule): sigmoid with ``topk > 1`` yes,
            softmax no. ``True`` with softmax is the softmax over the top-k logits (Megatron's
            default ``moe_router_pre_softmax=False``; Mixtral, Qwen3-MoE ``norm_topk_prob``,
            GPT-OSS); ``False`` never normalizes. Keyword only, beyond Primus-Turbo's signature.

    Returns:
        ``(scores_for_aux_loss [T, E] float32, probs [T, E] float32, routing_map [T, E] bool)``;
        see the module docstring for the exact semantics. Gradients flow to ``logits`` (in its
        dtype) through ``probs`` and ``scores_for_aux_loss``.

    Raises:
        ValueError: bad rank / dtype, ``E % groups != 0``, ``selected_groups > groups``,
            ``topk`` larger than the experts of the selected groups, unknown ``score_function``,
            a non-finite ``scaling_factor`` (NaN / inf), an ``expert_bias`` of the wrong shape,
            dtype or device.
    """
    if scaling_factor is None:
        scaling_factor = 1.0
    # Primus-Turbo maps None (Megatron's unset num_groups / group_topk) to 1, each on its own
    if groups is None:
        groups = 1
    if selected_groups is None:
        selected_groups = 1
    _check_router_args(logits, topk, groups, selected_groups, score_function, scaling_factor)
    if expert_bias is not None:
        _check_expert_bias("fused_group_topk_routing_with_aux_score", expert_bias, logits.shape[1], logits.device)
    if normalize_topk is not None and not isinstance(normalize_topk, bool):
        raise TypeError(f"fused_group_topk_routing_with_aux_score: normalize_topk must be None, True or False, "
                        f"got {normalize_topk!r}")
    if normalize_topk is None:
        normalize_topk = score_function == "sigmoid" and topk > 1
    x = logits.float()
    if score_function == "softmax":
        scores = torch.softmax(x, dim=-1)
    else:
        scores = torch.sigmoid(x)

    routing_scores = scores.detach()
    if expert_bias is not None:
        routing_scores = routing_scores + expert_bias.detach().float()
    top_idx = _select_experts(routing_scores, topk, groups, selected_groups)  # [T, K] int64
    top_scores = scores.gather(1, top_idx)
    if normalize_topk:
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + _EPS)
    if score_function == "sigmoid":
        aux_scores = scores / (scores.sum(dim=-1, keepdim=True) + _EPS)
    else:
        aux_scores = scores
    if scaling_factor != 1.0:
        top_scores = top_scores * float(scaling_factor)

    probs = torch.zeros_like(scores).scatter(1, top_idx, top_scores)
    routing_map = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, top_idx, True)
    return aux_scores, probs, routing_map


@torch.no_grad()
def update_expert_bias(expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor, update_rate: float) -> torch.Tensor:
    """One auxiliary-loss-free balancing step: ``expert_bias + update_rate * sign(mean - load)``.

    Args:
        expert_bias: ``[E]`` floating tensor, the bias the router adds to the scores for selection.
        tokens_per_expert: ``[E]`` routed-token counts (any real dtype; e.g. summed over the
            micro-batches of a step and all-reduced over the data-parallel ranks) on the same device.
        update_rate: the step size (DeepSeek-V3 / Megatron default 1e-3), a finite float >= 0.

    Returns:
        The new bias, a new tensor of ``expert_bias``' dtype: experts loaded above the mean count go
        down by ``update_rate``, those below go up, those at the mean stay (Megatron's
        ``get_updated_expert_bias``). Only the signs of the differences count, so scaling every count
        alike (more micro-batches, a recomputed forward) changes nothing. On-device, no host sync.
    """
    op = "update_expert_bias"
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise TypeError(f"{op}: tokens_per_expert must be a torch.Tensor, got {type(tokens_per_expert).__name__}")
    if tokens_per_expert.dim() != 1:
        raise ValueError(f"{op}: tokens_per_expert must be 1-D [experts], got shape {tuple(tokens_per_expert.shape)}")
    if tokens_per_expert.dtype == torch.bool or tokens_per_expert.is_complex():
        raise ValueError(f"{op}: tokens_per_expert must be a real count tensor, got {tokens_per_expert.dtype}")
    _check_expert_bias(op, expert_bias, tokens_per_expert.shape[0], tokens_per_expert.device, "tokens_per_expert")
    if isinstance(update_rate, bool) or not isinstance(update_rate, (int, float)) \
            or not math.isfinite(update_rate) or update_rate < 0:
        raise ValueError(f"{op}: update_rate must be a finite float >= 0, got {update_rate!r}")
    load = tokens_per_expert.double()  # exact integer counts: "at the mean" is an exact test
    return expert_bias + torch.sign(load.mean() - load).to(expert_bias.dtype) * float(update_rate)


class _IndicesToMultihot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices: torch.Tensor, probs: torch.Tensor, num_experts: int):
        valid = (indices >= 0) & (indices < num_experts)
        safe_idx = torch.where(valid, indices, torch.zeros_like(indices)).long()
        src = torch.where(valid, probs, torch.zeros_like(probs))
        dense = torch.zeros(indices.shape[0], num_experts, dtype=probs.dtype, device=probs.device)
        dense.scatter_add_(1, safe_idx, src)
        hits = torch.zeros(indices.shape[0], num_experts, dtype=torch.int32, device=indices.device)
        hits.scatter_add_(1, safe_idx, valid.to(torch.int32))
        ctx.save_for_backward(safe_idx, valid)
        ctx.mark_non_differentiable(hits)
        return hits > 0, dense

    @staticmethod
    def backward(ctx, grad_map, grad_dense):
        safe_idx, valid = ctx.saved_tensors
        if grad_dense is None:
            return None, None, None
        g = grad_dense.gather(1, safe_idx)
        return None, torch.where(valid, g, torch.zeros_like(g)), None


def indices_to_multihot(
    indices: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    num_experts: Optional[int] = None,
    fused: bool = False,
    *,
    probs_indices: Optional[torch.Tensor] = None,
    num_of_local_experts: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert indices -> multi-hot routing map and dense probs.

    Primus-Turbo's call forms work too: ``indices_to_multihot(indices, probs_indices,
    num_of_local_experts, fused=False)``, positional (same order) or with its keyword names.

    Args:
        indices: ``[T, K]`` integer expert indices; entries outside ``[0, num_experts)`` (e.g. the
            ``-1`` DeepEP uses for experts on other ranks) are ignored.
        probs: ``[T, K]`` floating probabilities matching ``indices``; keyword alias
            ``probs_indices`` (Primus-Turbo's name). Exactly one of the two (TypeError otherwise).
        num_experts: number of (local) experts E; keyword alias ``num_of_local_experts``
            (Primus-Turbo's name). Exactly one of the two (TypeError otherwise).
        fused: bool, accepted for Primus-Turbo compatibility (where it selects its Triton kernel
            over a PyTorch composition); it has no effect here: this op always runs the same
            implementation and gives the same result for either value.

    Returns:
        ``(routing_map [T, E] bool, dense_probs [T, E] probs.dtype)``: ``routing_map[t, e]`` is True
        iff some valid ``indices[t, k] == e``; ``dense_probs[t, e]`` is the sum of the matching
        ``probs[t, k]`` (a single value when a row's indices are distinct, the normal case), 0
        elsewhere. Backward: ``dprobs[t, k] = ddense[t, indices[t, k]]`` (0 for ignored entries).
    """
    op = "indices_to_multihot"
    probs = _one_of(op, "probs", probs, "probs_indices", probs_indices)
    num_experts = _one_of(op, "num_experts", num_experts, "num_of_local_experts", num_of_local_experts)
    if not isinstance(fused, bool):
        raise TypeError(f"{op}: fused must be a bool, got {fused!r}")
    if not isinstance(indices, torch.Tensor) or not isinstance(probs, torch.Tensor):
        raise TypeError(f"{op}: indices and probs must be torch.Tensor")
    if indices.dim() != 2:
        raise ValueError(f"{op}: indices must be 2-D [tokens, topk], got shape {tuple(indices.shape)}")
    if indices.dtype.is_floating_point or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(f"{op}: indices.dtype must be an integer dtype, got {indices.dtype}")
    if tuple(probs.shape) != tuple(indices.shape):
        raise ValueError(
            f"{op}: probs shape {tuple(probs.shape)} must equal indices shape {tuple(indices.shape)}"
        )
    if not probs.dtype.is_floating_point:
        raise ValueError(f"{op}: probs.dtype must be floating point, got {probs.dtype}")
    if probs.device != indices.device:
        raise ValueError(f"{op}: indices and probs must be on the same device, got {indices.device} and {probs.device}")
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    return _IndicesToMultihot.apply(indices, probs, num_experts)


def tokens_per_expert_to_mask(tokens_per_expert: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Row mask of a permuted-token buffer from per-expert token counts.

    Interpretation (Primus-Turbo's use: the ``row_mask`` of ``swiglu_with_probs`` /
    ``geglu_with_probs`` for a buffer of ``num_tokens`` rows sized for the worst case, e.g. DeepEP
    ``num_worst_tokens``, where expert e's rows follow expert e-1's and only the first
    ``sum(tokens_per_expert)`` rows hold tokens)::

        mask[i] = i < sum(tokens_per_expert)        for i in [0, num_tokens)

    Args:
        tokens_per_expert: ``[E]`` integer counts (on device; never read on the host).
        num_tokens: rows of the buffer (Python int).

    Returns:
        ``[num_tokens]`` bool mask on ``tokens_per_expert``'s device (counts beyond
        ``num_tokens`` saturate: every row is True).

    Counts must be non-negative: on CPU an async assert checks it (RuntimeError naming the op); on
    CUDA it is not checked (that would need a host sync) and a negative count lowers the sum.
    """
    op = "tokens_per_expert_to_mask"
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise TypeError(f"{op}: tokens_per_expert must be a torch.Tensor, got {type(tokens_per_expert).__name__}")
    if tokens_per_expert.dim() != 1:
        raise ValueError(f"{op}: tokens_per_expert must be 1-D [experts], got shape {tuple(tokens_per_expert.shape)}")
    if (
        tokens_per_expert.dtype.is_floating_point
        or tokens_per_expert.is_complex()
        or tokens_per_expert.dtype == torch.bool
    ):
        raise ValueError(f"{op}: tokens_per_expert.dtype must be an integer dtype, got {tokens_per_expert.dtype}")
    if not _is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"{op}: num_tokens must be a non-negative int, got {num_tokens!r}")
    if tokens_per_expert.device.type == "cpu" and not torch.compiler.is_compiling() and tokens_per_expert.numel():
        # free on CPU (no device sync); on CUDA see the docstring
        torch._assert_async(tokens_per_expert.min() >= 0,
                            f"{op}: tokens_per_expert has a negative count (counts of tokens per expert are >= 0)")
    total = tokens_per_expert.sum(dtype=torch.int64)
    rows = torch.arange(num_tokens, device=tokens_per_expert.device, dtype=torch.int64)
    return rows < total
