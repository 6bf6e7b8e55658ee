"""Mixture-of-experts layers: :class:`GroupedMLP` (the experts) and :class:`MoELayer` (router,
permutation, experts, combine), built only from ``turbo.ops`` / ``turbo.modules``.

Data flow of :class:`MoELayer` for ``T`` tokens, ``E`` experts, top-``k`` routing::

    logits [T, E]          = router(x)                                   turbo.modules.RouterLinear
    aux, probs, map [T, E] = fused_group_topk_routing_with_aux_score(logits, ...)
    xp [M, H], pp [M], row_id_map, tokens_per_expert [E]
                           = moe_permute(x, map, probs, num_out_tokens=M, pad_multiple)
    yp [M, H]              = GroupedMLP(xp, tokens_per_expert, pp)
                           = fc2_g( act(fc1_g(xp)) * pp )                 grouped GEMMs per expert g
    y [T, H]               = moe_unpermute(yp, row_id_map)               sum over the token's k rows

so ``y[t] = sum_{e routed} probs[t, e] * fc2_e(act(fc1_e(x[t])))``. The routing weights are applied
inside the fused activation (``swiglu_with_probs`` / ``geglu_with_probs``) rather than in the
combine; both are the same because ``fc2`` is linear without bias, and the activation is where the
probs gradient is cheapest to form (one dot per row, fused with the activation's backward).

Host synchronisation: group sizes (tokens per expert) are computed on the device from the routing
map and only ever read by device kernels. The one size the host must know is ``M``, the number of
permuted rows; see :meth:`MoELayer.forward` for when it is known from shapes and how a caller-given
capacity removes the only possible device->host sync (with ``pad_multiple``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..core.low_precision import Float4QuantConfig, Float8QuantConfig
from ..ops.activation import geglu_with_probs, swiglu_with_probs
from ..ops.grouped_gemm import _offsets
from ..ops.grouped_gemm_glu import glu_fusion_requested, grouped_gemm_glu
from ..ops.moe_permute import moe_permute, moe_unpermute
from ..ops.moe_router import fused_group_topk_routing_with_aux_score, tokens_per_expert_to_mask, update_expert_bias
from .grouped_linear import GroupedLinear
from .linear import RouterLinear, _fuse_pattern

__all__ = ["GroupedMLP", "MoELayer", "update_expert_biases"]

_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss")

_ACTIVATIONS = {"swiglu": swiglu_with_probs, "geglu": geglu_with_probs}
_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs forward hooks (its own or global ones): the fused fc1 +
    activation path does not call the module, so it is taken only without them."""
    from torch.nn.modules import module as _m

    return bool(module._forward_hooks or module._forward_pre_hooks or _m._global_forward_hooks
                or _m._global_forward_pre_hooks)


def _check_positive(name: str, **sizes) -> None:
    for k, v in sizes.items():
        if not _is_int(v) or v <= 0:
            raise ValueError(f"{name}: {k} must be a positive int, got {v!r}")


class GroupedMLP(torch.nn.Module):
    """The experts of an MoE layer: per-expert gated MLP over tokens sorted by expert.

    Args:
        num_experts: ``E``, number of (local) experts.
        hidden_size: ``H``, model width (input and output features).
        ffn_hidden_size: ``F``, each expert's intermediate width.
        activation: ``"swiglu"`` (``silu(gate) * up``) or ``"geglu"`` (``gelu_tanh(gate) * up``).
        config: :class:`Float8QuantConfig` to run both grouped GEMMs in FP8 (``grouped_gemm_fp8``),
            :class:`Float4QuantConfig` in MXFP4 (``grouped_gemm_fp4``, emulated on Hopper; H and F
            multiples of 32); ``None`` runs them in the parameters' dtype.
        dtype, device: of the parameters.

    Parameters: ``linear_fc1.weight [E, 2F, H]`` (rows ``[:F]`` are the gate, ``[F:]`` the up
    projection of each expert, the ``[a | b]`` halves of the fused activation) and
    ``linear_fc2.weight [E, H, F]``; both :class:`GroupedLinear`, so a Megatron ``main_grad`` on
    either weight receives the weight gradient (accumulated in the GEMM epilogue).

    ``forward(permuted_tokens, group_lens, probs=None, group_offs=None)``:

    * ``permuted_tokens [M, H]`` (the parameters' dtype): expert ``g``'s rows at
      ``group_offs[g] : group_offs[g] + group_lens[g]``, experts in order; ``M >= sum(group_lens)``.
    * ``group_lens [E]`` int64 on the tokens' device (never read on the host).
    * ``probs [M]`` routing weight of each row (cast to float32; ``None`` = all ones); receives a
      gradient.
    * ``group_offs [E+1]`` int64 exclusive prefix sum of ``group_lens`` (computed on the device
      when ``None``).

    Returns ``[M, H]``: ``out[r] = probs[r] * fc2_g(act(fc1_g(x[r])))`` for row ``r`` of expert
    ``g``; rows past ``sum(group_lens)`` are exactly zero, as are their gradients (the activation
    is given the row mask ``r < sum(group_lens)``, so even garbage or NaN probs there are ignored;
    so are garbage tokens there, except under FP8 TENSORWISE, whose activation scale spans all
    ``M`` rows and so needs them finite).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 config: Optional[Float8QuantConfig | Float4QuantConfig] = None, dtype=None, device=None):
        super().__init__()
        _check_positive("GroupedMLP", num_experts=num_experts, hidden_size=hidden_size,
                        ffn_hidden_size=ffn_hidden_size)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"GroupedMLP: activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if config is not None and not isinstance(config, (Float8QuantConfig, Float4QuantConfig)):
            raise ValueError(f"GroupedMLP: config must be a Float8QuantConfig, a Float4QuantConfig or None, got "
                             f"{type(config).__name__}")
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.activation, self.config = activation, config
        self.linear_fc1 = GroupedLinear(num_experts, hidden_size, 2 * ffn_hidden_size, dtype=dtype, device=device,
                                        config=config)
        self.linear_fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, dtype=dtype, device=device,
                                        config=config)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}, config={self.config}")

    def _check(self, x, group_lens, probs, group_offs) -> None:
        op, w = "GroupedMLP", self.linear_fc1.weight
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"{op}: permuted_tokens must be [M, hidden_size={self.hidden_size}], "
                             f"got shape {tuple(getattr(x, 'shape', ()))}")
        if x.dtype != w.dtype:
            raise ValueError(f"{op}: permuted_tokens dtype {x.dtype} must match the weights' dtype {w.dtype}")
        if x.device != w.device:
            raise ValueError(f"{op}: permuted_tokens on {x.device}, weights on {w.device}")
        e = self.num_experts
        if (not isinstance(group_lens, torch.Tensor) or group_lens.dtype != torch.int64
                or tuple(group_lens.shape) != (e,) or group_lens.device != x.device):
            raise ValueError(f"{op}: group_lens must be int64 [num_experts={e}] on {x.device}, got "
                             f"{getattr(group_lens, 'dtype', type(group_lens).__name__)} "
                             f"{tuple(getattr(group_lens, 'shape', ()))} on {getattr(group_lens, 'device', None)}")
        if group_offs is not None and (not isinstance(group_offs, torch.Tensor) or group_offs.dtype != torch.int64
                                       or tuple(group_offs.shape) != (e + 1,) or group_offs.device != x.device):
            raise ValueError(f"{op}: group_offs must be int64 [num_experts+1={e + 1}] on {x.device}, got "
                             f"{getattr(group_offs, 'dtype', type(group_offs).__name__)} "
                             f"{tuple(getattr(group_offs, 'shape', ()))}")
        if probs is not None:
            if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
                raise ValueError(f"{op}: probs must be a floating-point tensor [M], got "
                                 f"{getattr(probs, 'dtype', type(probs).__name__)}")
            if tuple(probs.shape) != (x.shape[0],) or probs.device != x.device:
                raise ValueError(f"{op}: probs must be [M={x.shape[0]}] on {x.device}, got shape "
                                 f"{tuple(probs.shape)} on {probs.device}")

    def forward(self, permuted_tokens: torch.Tensor, group_lens: torch.Tensor,
                probs: Optional[torch.Tensor] = None, group_offs: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``is_first_microbatch``: the FP8 expert weights' micro-batch cache (see
        :class:`GroupedLinear`); ignored in bf16."""
        self._check(permuted_tokens, group_lens, probs, group_offs)
        m = permuted_tokens.shape[0]
        if group_offs is None:
            group_offs = _offsets(group_lens)  # once, shared by both grouped GEMMs
        if probs is None:
            probs = torch.ones(m, dtype=torch.float32, device=permuted_tokens.device)
        # rows past sum(group_lens): the grouped GEMMs already give zeros there; the mask also
        # zeroes them (and their probs gradient) whatever the caller's probs hold in those rows
        row_mask = tokens_per_expert_to_mask(group_lens, m)
        w1 = self.linear_fc1.weight
        if self.config is None and glu_fusion_requested(permuted_tokens, w1) and not _has_hooks(self.linear_fc1):
            # fc1 + activation in one Gluon kernel
            h = grouped_gemm_glu(permuted_tokens, w1, group_lens, group_offs, probs.float(), row_mask,
                                 self.activation, _fuse_pattern(w1))                       # [M, F]
        else:
            h = self.linear_fc1(permuted_tokens, group_lens, group_offs, is_first_microbatch)  # [M, 2F]
            h = _ACTIVATIONS[self.activation](h, probs.float(), row_mask)      # [M, F], weighted by probs
        return self.linear_fc2(h, group_lens, group_offs, is_first_microbatch)                # [M, H]


class _AuxLossInBackward(torch.autograd.Function):
    """Identity on the layer output whose backward also seeds the auxiliary loss with ``scale``
    (Megatron's ``MoEAuxLossAutoScaler``): the aux loss trains the router without the training
    loop adding it to the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (aux,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux, ctx.scale), None


class MoELayer(torch.nn.Module):
    """Token-choice top-k mixture of experts: router, permutation, :class:`GroupedMLP`, combine.

    Args:
        hidden_size: ``H``.
        ffn_hidden_size: ``F``, each expert's intermediate width.
        num_experts: ``E``.
        topk: experts per token (``1 <= topk <= selected_groups * E // groups``).
        score_function: ``"softmax"`` or ``"sigmoid"``; see
            :func:`turbo.ops.fused_group_topk_routing_with_aux_score` for how probs are formed
            (softmax over all experts then the top-k entries; sigmoid normalized over the top-k).
        groups, selected_groups: DeepSeek-V3 group-limited routing (``groups=1``: plain top-k).
        normalize_topk: divide each token's selected scores by their sum (``None``: sigmoid with
            topk > 1 yes, softmax no; ``True`` with softmax = the softmax over the top-k logits,
            as Mixtral, Qwen3-MoE and GPT-OSS route and Megatron does by default).
        scaling_factor: multiplier of the routing probs (``None`` = 1).
        activation: ``"swiglu"`` or ``"geglu"`` (:class:`GroupedMLP`).
        config: :class:`Float8QuantConfig` (or :class:`Float4QuantConfig`, MXFP4) for the expert GEMMs
            (the router stays in high precision).
        pad_multiple: pad each expert's row segment to a multiple of this (e.g. 16/32/128 for FP8
            kernels that want aligned groups); padding rows are zero tokens with zero probs.
        aux_loss_coeff: coefficient of the load-balancing loss (0 = not computed).
        load_balancing_type: ``"aux_loss"`` (over all the call's tokens, Switch Transformer) or
            ``"seq_aux_loss"`` (per sequence, then averaged: DeepSeek-V3's sequence-wise loss);
            Megatron's ``moe_router_load_balancing_type`` names.
        z_loss_coeff: coefficient of the router z-loss (ST-MoE; Megatron's ``moe_z_loss_coeff``;
            0 = not computed).
        router_dtype: dtype of the router weight and of its GEMM (e.g. ``torch.float32`` for an
            fp32 router with bf16 experts, Megatron's ``moe_router_dtype``); default ``dtype``.
        expert_bias: auxiliary-loss-free load balancing (DeepSeek-V3; Megatron's
            ``moe_router_enable_expert_bias``): a float32 ``[E]`` buffer ``expert_bias`` is added to
            the scores for the expert selection only (see below).
        expert_bias_update_rate: the bias step of :meth:`update_expert_bias` (Megatron's
            ``moe_router_bias_update_rate``, default 1e-3).
        shared_expert_ffn_hidden_size: width of the shared experts (DeepSeek-V3, Qwen2-MoE; Megatron's
            ``moe_shared_expert_intermediate_size``), a dense MLP every token goes through, added to the
            routed output; ``None`` = none.
        shared_expert_gate: scale the shared experts' output by ``sigmoid(x @ w_g^T)`` per token
            (Qwen2-MoE; Megatron's ``moe_shared_expert_gate``).
        aux_loss_in_backward: see the auxiliary losses below.
        capacity_factor: per-expert capacity ``C = ceil(T * topk / E * capacity_factor)`` (Megatron's
            ``moe_expert_capacity_factor``); an expert's routed (token, expert) pairs beyond ``C`` are
            dropped (they add nothing to their token's output; its other experts keep their probs,
            not renormalized). ``None`` = dropless.
        token_drop_policy: which pairs an over-full expert keeps: ``"probs"`` the ``C`` highest
            routing probs (ties: the earlier token), ``"position"`` the ``C`` earliest tokens
            (Megatron's ``moe_token_drop_policy``).
        dtype, device: of the parameters.

    Submodules: ``router`` (:class:`turbo.modules.RouterLinear` ``H -> E``, no bias: with an fp32
    ``router_dtype`` over bf16 tokens it runs ``turbo.ops.router_gating_linear``, fp32-accurate
    logits without an fp32 copy of the tokens), ``experts`` (:class:`GroupedMLP`) and, with shared
    experts, ``shared_experts`` (a one-group :class:`GroupedMLP`, weights ``[1, 2F_s, H]`` and
    ``[1, H, F_s]``, same activation and ``config`` as the routed experts) and ``shared_expert_gate``
    (``nn.Linear(H, 1)``).

    Auxiliary losses. Every forward sets ``self.aux_loss``, the 0-dim float32 sum of the enabled
    terms below (``None`` when none is), and ``self.aux_loss_terms``, each term by name, detached,
    for logging. It carries a gradient to the router weight; add it to the training loss
    (``loss = task_loss + layer.aux_loss``).

    * ``"load_balancing"`` (``aux_loss_coeff > 0``; Megatron's ``switch_load_balancing_loss_func``)::

        aux_loss_coeff * E * sum_e f_e * P_e
        f_e = (tokens routed to e) / (T * topk)          (not differentiable)
        P_e = mean over tokens of scores_for_aux_loss[:, e]   (softmax, or sigmoid / row sum)

      which is ``aux_loss_coeff`` for perfectly balanced routing. With
      ``load_balancing_type="seq_aux_loss"`` the same is formed for each sequence of a
      ``[B, S, H]`` input (``T = S``, counts and means over that sequence's tokens) and averaged
      over the ``B`` sequences (Megatron's ``sequence_load_balancing_loss_func``); a ``[T, H]``
      input is one sequence.
    * ``"z_loss"`` (``z_loss_coeff > 0``): ``z_loss_coeff * mean_t logsumexp(logits[t])^2`` over the
      router's logits in float32 (keeps them small; Megatron's ``z_loss_func``).

    With ``aux_loss_in_backward=True`` the layer output carries the auxiliary loss instead
    (Megatron's ``MoEAuxLossAutoScaler``): the output's backward also back-propagates
    ``aux_loss_backward_scale * aux_loss`` (default scale 1.0; set it to what the main loss is scaled
    by, e.g. ``1 / num_microbatches``), so the training loop adds nothing and ``self.aux_loss`` is
    detached, for logging only.

    ``self.tokens_per_expert`` (int64 ``[E]`` on device, detached, padding excluded) holds the last
    forward's routing counts for load monitoring: the pairs each expert processed (after capacity
    drops). The auxiliary losses and the expert-bias counts read the router's choice (before drops).

    Auxiliary-loss-free balancing (``expert_bias=True``): the router selects on
    ``score + self.expert_bias`` and weights by the unbiased scores. Every forward in training mode
    with gradients enabled adds its routing counts to the buffer ``local_tokens_per_expert``
    (float32 ``[E]``; not saved in the state dict; a forward that activation checkpointing recomputes
    may add them again, which doubles every count alike and leaves the update's signs unchanged);
    after the optimizer step call
    :meth:`update_expert_bias` (or :func:`update_expert_biases` on the whole model, one all-reduce):
    it sums the counts over the data-parallel ranks, moves each expert's bias by
    ``expert_bias_update_rate * sign(mean - count)`` and zeroes the counts, all on the device.
    ``expert_bias`` is a persistent buffer (checkpointed); both buffers stay float32 when the module is
    cast (``layer.to(torch.bfloat16)``) and move with it. Under ``torch.nn.parallel.DDP`` pass
    ``broadcast_buffers=False``, or rank 0's buffers overwrite the others' counts every forward.

    ``torch.compile``: the layer traces whole (``fullgraph=True``) when the permuted row count is known
    without reading data, i.e. no ``pad_multiple`` or an int ``num_out_tokens`` (see :meth:`forward`),
    and its experts run in the parameters' dtype: every op on that path is a PyTorch expression or
    reaches its kernels through ``torch.library`` custom ops. With ``pad_multiple`` and no
    capacity the padded total is read back (the documented sync) outside the graph, and FP8 / MXFP4
    experts run outside it (see :class:`GroupedLinear`): graph breaks, so ``fullgraph=False``. Either
    way the numbers are the eager layer's.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, topk: int, *,
                 score_function: str = "softmax", groups: int = 1, selected_groups: int = 1,
                 scaling_factor: Optional[float] = None, activation: str = "swiglu",
                 config: Optional[Float8QuantConfig | Float4QuantConfig] = None, pad_multiple: Optional[int] = None,
                 aux_loss_coeff: float = 0.0, router_dtype: Optional[torch.dtype] = None,
                 expert_bias: bool = False, expert_bias_update_rate: float = 1e-3,
                 load_balancing_type: str = "aux_loss", z_loss_coeff: float = 0.0,
                 normalize_topk: Optional[bool] = None, aux_loss_in_backward: bool = False,
                 shared_expert_ffn_hidden_size: Optional[int] = None, shared_expert_gate: bool = False,
                 capacity_factor: Optional[float] = None, token_drop_policy: str = "probs",
                 dtype=None, device=None):
        super().__init__()
        op = "MoELayer"
        _check_positive(op, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, num_experts=num_experts,
                        topk=topk, groups=groups, selected_groups=selected_groups)
        if topk > num_experts:
            raise ValueError(f"{op}: topk={topk} exceeds num_experts={num_experts}")
        if num_experts % groups:
            raise ValueError(f"{op}: num_experts={num_experts} must be divisible by groups={groups}")
        if selected_groups > groups:
            raise ValueError(f"{op}: selected_groups={selected_groups} must be <= groups={groups}")
        if topk > selected_groups * (num_experts // groups):
            raise ValueError(f"{op}: topk={topk} exceeds the experts of the selected groups "
                             f"(selected_groups={selected_groups} x {num_experts // groups} per group)")
        if score_function not in _SCORE_FUNCTIONS:
            raise ValueError(f"{op}: score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
        if scaling_factor is not None and (isinstance(scaling_factor, bool)
                                           or not isinstance(scaling_factor, (int, float))):
            raise ValueError(f"{op}: scaling_factor must be a float or None, got {scaling_factor!r}")
        if scaling_factor is not None and not math.isfinite(scaling_factor):
            raise ValueError(f"{op}: scaling_factor must be finite, got {scaling_factor!r} (the routing probs would "
                             f"be NaN / inf)")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"{op}: activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if config is not None and not isinstance(config, (Float8QuantConfig, Float4QuantConfig)):
            raise ValueError(f"{op}: config must be a Float8QuantConfig, a Float4QuantConfig or None, got "
                             f"{type(config).__name__}")
        if pad_multiple is not None and (not _is_int(pad_multiple) or pad_multiple < 1):
            raise ValueError(f"{op}: pad_multiple must be a positive int or None, got {pad_multiple!r}")
        for name, v in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{op}: {name} must be a finite float >= 0, got {v!r}")
        if load_balancing_type not in _LOAD_BALANCING_TYPES:
            raise ValueError(f"{op}: load_balancing_type must be one of {list(_LOAD_BALANCING_TYPES)}, got "
                             f"{load_balancing_type!r}")
        if router_dtype is not None and router_dtype not in _DTYPES:
            raise ValueError(f"{op}: router_dtype must be float32, bfloat16, float16 or None, got {router_dtype}")
        if normalize_topk is not None and not isinstance(normalize_topk, bool):
            raise TypeError(f"{op}: normalize_topk must be None, True or False, got {normalize_topk!r}")
        if shared_expert_ffn_hidden_size is not None and (not _is_int(shared_expert_ffn_hidden_size)
                                                          or shared_expert_ffn_hidden_size < 1):
            raise ValueError(f"{op}: shared_expert_ffn_hidden_size must be a positive int or None, got "
                             f"{shared_expert_ffn_hidden_size!r}")
        if not isinstance(shared_expert_gate, bool):
            raise TypeError(f"{op}: shared_expert_gate must be True or False, got {shared_expert_gate!r}")
        if shared_expert_gate and shared_expert_ffn_hidden_size is None:
            raise ValueError(f"{op}: shared_expert_gate=True needs shared_expert_ffn_hidden_size")
        if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                            or not isinstance(capacity_factor, (int, float))
                                            or not math.isfinite(capacity_factor) or capacity_factor <= 0):
            raise ValueError(f"{op}: capacity_factor must be a finite float > 0 or None, got {capacity_factor!r}")
        if token_drop_policy not in ("probs", "position"):
            raise ValueError(f"{op}: token_drop_policy must be 'probs' or 'position', got {token_drop_policy!r}")
        if not isinstance(aux_loss_in_backward, bool):
            raise TypeError(f"{op}: aux_loss_in_backward must be True or False, got {aux_loss_in_backward!r}")
        if not isinstance(expert_bias, bool):
            raise TypeError(f"{op}: expert_bias must be True or False, got {expert_bias!r}")
        if isinstance(expert_bias_update_rate, bool) or not isinstance(expert_bias_update_rate, (int, float)) \
                or not math.isfinite(expert_bias_update_rate) or expert_bias_update_rate < 0:
            raise ValueError(f"{op}: expert_bias_update_rate must be a finite float >= 0, got "
                             f"{expert_bias_update_rate!r}")
        self.hidden_size, self.ffn_hidden_size, self.num_experts, self.topk = (hidden_size, ffn_hidden_size,
                                                                               num_experts, topk)
        self.score_function, self.groups, self.selected_groups = score_function, groups, selected_groups
        self.scaling_factor = None if scaling_factor is None else float(scaling_factor)
        self.pad_multiple = None if pad_multiple in (None, 1) else int(pad_multiple)
        self.aux_loss_coeff = float(aux_loss_coeff)
        self.load_balancing_type = load_balancing_type
        self.z_loss_coeff = float(z_loss_coeff)
        self.normalize_topk = normalize_topk
        self.aux_loss_in_backward = aux_loss_in_backward
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.token_drop_policy = token_drop_policy
        self.aux_loss_backward_scale = 1.0
        self.router = RouterLinear(hidden_size, num_experts, bias=False, device=device,
                             dtype=router_dtype if router_dtype is not None else dtype)
        self.experts = GroupedMLP(num_experts, hidden_size, ffn_hidden_size, activation=activation, config=config,
                                  dtype=dtype, device=device)
        # shared experts: one dense MLP over every token, as a one-group GroupedMLP so the experts'
        # precision (config), activation and micro-batch weight cache apply to it unchanged; the
        # optional sigmoid gate becomes that group's row weights (probs)
        self.shared_experts = None if shared_expert_ffn_hidden_size is None else GroupedMLP(
            1, hidden_size, shared_expert_ffn_hidden_size, activation=activation, config=config, dtype=dtype,
            device=device)
        self.shared_expert_gate = torch.nn.Linear(hidden_size, 1, bias=False, dtype=dtype, device=device) \
            if shared_expert_gate else None
        self.aux_loss: Optional[torch.Tensor] = None
        self.aux_loss_terms: dict = {}
        self.tokens_per_expert: Optional[torch.Tensor] = None
        self.expert_bias_update_rate = float(expert_bias_update_rate)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(num_experts, dtype=torch.float32, device=device), persistent=False)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None

    _FP32_BUFFERS = ("expert_bias", "local_tokens_per_expert")

    def _apply(self, fn, recurse=True):
        # module-wide dtype casts (model.to(torch.bfloat16), .half()) must not reach the balancing
        # state: 1e-3 steps vanish against a bf16 bias of magnitude ~1 and bf16 counts stop being
        # exact past 256. Keep them float32 (Megatron does the same), wherever fn moved them.
        before = {n: self._buffers.get(n) for n in self._FP32_BUFFERS if self._buffers.get(n) is not None}
        out = super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device)
        return out

    def __getstate__(self):
        # the last forward's aux_loss belongs to that step's autograd graph: deepcopy refuses such a
        # tensor and pickling would drag the graph along; a copy (an EMA twin, a saved module)
        # starts without it, as a freshly built layer does
        state = super().__getstate__()
        state["aux_loss"] = None
        return state

    def reset_parameters(self) -> None:
        """Zero this layer's own balancing state (``expert_bias``, ``local_tokens_per_expert``); the
        router and the experts have their own ``reset_parameters`` (TorchTitan's meta-device init
        calls each module's)."""
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()
                self.local_tokens_per_expert.zero_()

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """One balancing step (call after the optimizer step): the counts accumulated since the
        last call are summed over ``group`` (default: the default process group when
        ``torch.distributed`` is initialised, else this process alone), the bias moves by
        ``expert_bias_update_rate * sign(mean - count)`` (:func:`turbo.ops.update_expert_bias`) and
        the counts are zeroed. Every rank of the group must call it. No host sync."""
        if self.expert_bias is None:
            raise RuntimeError("MoELayer.update_expert_bias: the layer was built without expert_bias=True")
        update_expert_biases([self], group=group)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, topk={self.topk}, score_function={self.score_function!r}, "
                f"groups={self.groups}, selected_groups={self.selected_groups}, "
                f"scaling_factor={self.scaling_factor}, pad_multiple={self.pad_multiple}, "
                f"aux_loss_coeff={self.aux_loss_coeff}"
                + (f", load_balancing_type={self.load_balancing_type!r}" if self.load_balancing_type != "aux_loss" else "")
                + (f", z_loss_coeff={self.z_loss_coeff}" if self.z_loss_coeff > 0 else "")
                + (f", normalize_topk={self.normalize_topk}" if self.normalize_topk is not None else "")
                + (", aux_loss_in_backward=True" if self.aux_loss_in_backward else "")
                + (f", shared_expert_ffn_hidden_size={self.shared_experts.ffn_hidden_size}"
                   if self.shared_experts is not None else "")
                + (f", capacity_factor={self.capacity_factor}, token_drop_policy={self.token_drop_policy!r}"
                   if self.capacity_factor is not None else "")
                + (f", expert_bias_update_rate={self.expert_bias_update_rate}" if self.expert_bias is not None else ""))

    def expert_capacity(self, num_tokens: int) -> Optional[int]:
        """``C = ceil(T * topk / E * capacity_factor)`` pairs per expert (``None`` without a capacity
        factor), from shapes only."""
        if self.capacity_factor is None:
            return None
        return math.ceil(int(num_tokens) * self.topk / self.num_experts * self.capacity_factor)

    def _capacity_mask(self, probs: torch.Tensor, routing_map: torch.Tensor, cap: int) -> torch.Tensor:
        """``[T, E]`` bool: the routed pairs each expert keeps under capacity ``cap`` (device ops only)."""
        if self.token_drop_policy == "position":
            return routing_map & (torch.cumsum(routing_map.to(torch.int32), dim=0) <= cap)
        # the cap highest probs of each expert's column; unrouted entries rank last
        key = torch.where(routing_map, probs, torch.full_like(probs, float("-inf")))
        top = torch.sort(key, dim=0, descending=True, stable=True).indices[:cap]           # [cap, E]
        keep = torch.zeros_like(routing_map).scatter_(0, top, True)
        return routing_map & keep

    def max_permuted_tokens(self, num_tokens: int) -> int:
        """Worst-case permuted rows for ``num_tokens`` tokens: ``T*topk + E*(pad_multiple-1)``.

        Passing it as ``num_out_tokens`` never drops a token and needs no host sync.
        """
        pad = self.pad_multiple or 1
        return int(num_tokens) * self.topk + (self.num_experts * (pad - 1) if pad > 1 else 0)

    def forward(self, hidden_states: torch.Tensor, num_out_tokens: Optional[int] = None,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``hidden_states [B, S, H]`` or ``[T, H]`` -> same shape and dtype.

        ``is_first_microbatch`` (FP8 experts; ignored in bf16): ``None`` quantizes the expert
        weights on every call; ``True`` quantizes and caches them; ``False`` reuses the cache
        (Megatron / Transformer Engine semantics, see :class:`GroupedLinear`).

        ``num_out_tokens`` is ``M``, the rows of the permuted buffer the experts run on:

        * ``None`` without ``pad_multiple``: ``T * topk``, known from shapes (every token is routed
          to exactly ``topk`` experts): **no host sync**.
        * ``None`` with ``pad_multiple``: the exact padded total, which depends on the routing and
          is read back once (**one device->host sync**, inside ``moe_permute``).
        * an int (a capacity, e.g. ``T * topk`` or :meth:`max_permuted_tokens`): the buffer has that
          many rows and nothing is read back: the whole layer, forward and backward, runs without
          a host sync (CUDA-graph friendly). Must be ``>= T * topk``. Rows past the routed (and
          padded) tokens are zero and cost only the zero-fill; with ``pad_multiple`` a capacity
          below :meth:`max_permuted_tokens` may not hold every padded segment: the (token, expert)
          pairs that do not fit are dropped (they contribute nothing to their token's output).
        """
        op = "MoELayer"
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() not in (2, 3) \
                or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"{op}: hidden_states must be [batch, seq, {self.hidden_size}] or "
                             f"[tokens, {self.hidden_size}], got shape {tuple(getattr(hidden_states, 'shape', ()))}")
        w = self.experts.linear_fc1.weight
        if hidden_states.dtype != w.dtype:
            raise ValueError(f"{op}: hidden_states dtype {hidden_states.dtype} must match the experts' dtype {w.dtype}")
        if hidden_states.device != w.device:
            raise ValueError(f"{op}: hidden_states on {hidden_states.device}, the layer's parameters on {w.device}")
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"{op}: is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        t, k, e = x.shape[0], self.topk, self.num_experts
        if num_out_tokens is not None:
            if not _is_int(num_out_tokens) or num_out_tokens < t * k:
                raise ValueError(f"{op}: num_out_tokens={num_out_tokens!r} must be an int >= tokens*topk="
                                 f"{t}*{k}={t * k}")
        elif self.pad_multiple is None:
            num_out_tokens = t * k

        logits = self.router(x)                                   # [T, E] in the router's dtype
        aux_scores, probs, routing_map = fused_group_topk_routing_with_aux_score(
            logits, k, self.groups, self.selected_groups, self.score_function, self.scaling_factor,
            expert_bias=self.expert_bias, normalize_topk=self.normalize_topk)
        chosen = routing_map  # the router's choice: the aux loss and the balancing counts read it
        cap = self.expert_capacity(t)
        dropping = cap is not None and cap < t
        if dropping:
            routing_map = self._capacity_mask(probs, routing_map, cap)
            probs = torch.where(routing_map, probs, torch.zeros_like(probs))

        permuted, permuted_probs, row_id_map, group_lens = moe_permute(
            x, routing_map, probs, num_out_tokens=num_out_tokens, pad_multiple=self.pad_multiple,
            return_tokens_per_expert=True)
        m = permuted.shape[0]
        if self.pad_multiple is not None and num_out_tokens is not None \
                and num_out_tokens < self.max_permuted_tokens(t):
            # a short capacity cuts the padded segments at row m (moe_permute drops those pairs):
            # clip the group lengths the same way, on the device
            ends = torch.cumsum(group_lens, 0).clamp(max=m)
            group_lens = torch.diff(ends, prepend=ends.new_zeros(1))
        y = self.experts(permuted, group_lens, permuted_probs, is_first_microbatch=is_first_microbatch)  # [M, H]
        # probs were applied in the activation: the combine is the plain sum of each token's rows
        out = moe_unpermute(y, row_id_map, None, restore_shape=shape)
        if self.shared_experts is not None:
            lens = torch.full((1,), t, dtype=torch.int64, device=x.device)
            gate = None if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x).float()).view(t)
            out = out + self.shared_experts(x, lens, gate, is_first_microbatch=is_first_microbatch).view(shape)

        self.tokens_per_expert = routing_map.sum(0).detach()                   # [E] int64, after any drop
        counts = chosen.sum(0) if dropping else self.tokens_per_expert                    # the router's choice
        if self.local_tokens_per_expert is not None and self.training and torch.is_grad_enabled():
            # a recomputed forward (activation checkpointing) counts again; every count doubles
            # alike, which leaves the signs the update reads unchanged
            with torch.no_grad():
                self.local_tokens_per_expert.add_(counts.to(torch.float32))
        terms = {}
        if self.aux_loss_coeff > 0:
            if t == 0:
                terms["load_balancing"] = aux_scores.sum() * 0.0
            elif self.load_balancing_type == "seq_aux_loss" and hidden_states.dim() == 3 and shape[0] > 1:
                b, sq = shape[0], shape[1]
                seq_counts = chosen.view(b, sq, e).sum(1).to(aux_scores.dtype)                # [B, E]
                scale = e * self.aux_loss_coeff / (k * sq * sq * b)
                terms["load_balancing"] = (aux_scores.view(b, sq, e).sum(1) * seq_counts).sum() * scale
            else:  # all the call's tokens (one sequence for "seq_aux_loss")
                scale = e * self.aux_loss_coeff / (k * t * t)
                terms["load_balancing"] = (aux_scores.sum(0) * counts.to(aux_scores.dtype)).sum() * scale
        if self.z_loss_coeff > 0:
            z = torch.logsumexp(logits.float(), dim=-1)
            terms["z_loss"] = (z * z).sum() * (self.z_loss_coeff / t) if t > 0 else z.sum() * 0.0
        self.aux_loss = None
        for term in terms.values():
            self.aux_loss = term if self.aux_loss is None else self.aux_loss + term
        self.aux_loss_terms = {name: term.detach() for name, term in terms.items()}
        if self.aux_loss_in_backward and self.aux_loss is not None:
            if self.aux_loss.requires_grad:
                scale = float(self.aux_loss_backward_scale)
                out = _AuxLossInBackward.apply(out, self.aux_loss, scale)
            self.aux_loss = self.aux_loss.detach()
        return out


@torch.no_grad()
def update_expert_biases(model, group=None) -> int:
    """:meth:`MoELayer.update_expert_bias` for every balancing :class:`MoELayer` in ``model`` (a module,
    or an iterable of layers), with one all-reduce of all their counts over ``group`` (default: the
    default process group when ``torch.distributed`` is initialised, else none). Call it after the
    optimizer step on every rank of the group. Returns the number of layers updated."""
    layers = list(model.modules()) if isinstance(model, torch.nn.Module) else list(model)
    layers = [m for m in layers if isinstance(m, MoELayer) and m.expert_bias is not None]
    if not layers:
        return 0
    counts = [m.local_tokens_per_expert for m in layers]
    devices = {c.device for c in counts}
    if len(devices) > 1:
        raise ValueError(f"update_expert_biases: the layers' buffers are on several devices {sorted(map(str, devices))}")
    flat = torch.cat(counts)
    if group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(flat, group=group)
    for m, c in zip(layers, flat.split([c.numel() for c in counts])):
        m.expert_bias.copy_(update_expert_bias(m.expert_bias, c, m.expert_bias_update_rate))
        m.local_tokens_per_expert.zero_()
    return len(layers)
