"""MoE token permutation: ``turbo.ops.moe_permute`` / ``moe_unpermute`` and the Megatron-style
``token_permute`` / ``token_unpermute``.

moe_permute(tokens, routing_map, probs=None, num_out_tokens=None, pad_multiple=None, scales=None,
            *, num_experts=None, return_tokens_per_expert=False)
    -> (permuted_tokens, permuted_probs, row_id_map[, permuted_scales][, tokens_per_expert])

``routing_map`` is either the bool multi-hot map ``[T, E]`` or top-k expert indices ``[T, k]``
(int32 / int64, values in ``[0, E)`` or ``-1`` for a slot routed to no expert (as Primus-Turbo's
``indices_to_multihot`` masks it: no row, ``row_id_map`` entry ``-1``, its prob unused), distinct within
a row; ``num_experts=E`` is then required). Other values are an error: an async assert on CPU; on CUDA
(no host sync) they are treated as ``-1``. ``num_experts``, ``num_out_tokens`` and ``pad_multiple`` are
ints (a float or bool raises TypeError, nothing is rounded).
Let ``K`` be ``E`` (map form) or ``k`` (indices form). The output groups the routed (token, expert)
pairs expert-major: expert 0's tokens first, then expert 1's, ...; within an expert the tokens keep
their order (stable). With ``pad_multiple=p`` each expert's segment is padded with zero rows up to
a multiple of ``p`` (a zero-token expert has an empty segment). Rows past the last segment, up to
``num_out_tokens``, are zero.

- ``num_out_tokens``: number of output rows, padding included. When given, nothing is read back
  to the host (CUDA-graph / async friendly). When ``None``: indices form without padding uses
  ``T * k`` (from shapes, no sync); the map form, or any form with ``pad_multiple``, reads the exact
  total back to the host (**one device->host sync**). For the indices form it must be at least
  ``T * k`` (checked). For the map form it is not checked (that would need a sync): (token, expert)
  pairs whose destination row is ``>= num_out_tokens`` are dropped, and their ``row_id_map`` entry is
  ``-1`` (so unpermute treats them as dropped).
- ``probs``: same shape as ``routing_map`` (``[T, E]`` dense probs for the map form, ``[T, k]`` for
  indices). ``permuted_probs[o]`` is the prob of the pair in row ``o`` (0 on padding rows); ``None``
  when ``probs`` is None. Differentiable.
- ``scales``: per-row quantization scales ``[T]`` or ``[T, S]`` of FP8 ``tokens``; moved exactly like
  the tokens (bits copied; zero on padding rows). FP8 tokens are data movement only (no autograd).
- ``row_id_map``: int32, shape of ``routing_map``: ``row_id_map[t, j]`` = the output row of the pair
  (token ``t``, expert ``e`` = ``j`` for the map form or ``routing_map[t, j]`` for indices), ``-1``
  when the pair is not routed (map form) or dropped.
- ``tokens_per_expert`` (``return_tokens_per_expert=True``): int64 ``[E]`` segment lengths, padding
  included (the group lengths for a grouped GEMM), on device.

moe_unpermute(permuted_tokens, row_id_map, merging_probs=None, restore_shape=None)
    ``out[t] = sum_j merging_probs[t, j] * permuted_tokens[row_id_map[t, j]]`` over ``j`` with
    ``row_id_map[t, j] >= 0`` (weights 1 without probs), fp32 accumulation in ascending ``j``, cast to
    ``permuted_tokens``' dtype; ``out`` is ``[T, H]`` or reshaped to ``restore_shape``.
    ``merging_probs`` has ``row_id_map``'s shape. Differentiable in ``permuted_tokens`` and
    ``merging_probs``. ``restore_shape`` must be ``[..., H]`` holding the ``T`` tokens (ValueError).
    A ``row_id_map`` entry ``>= permuted_tokens.shape[0]`` (a map built for a larger buffer) is an
    error on CPU (async assert); on CUDA (no host sync) the kernels mask it: the entry counts as not
    routed, nothing is read or written out of bounds, and its probs gradient is 0. The same holds for
    both ``moe_unpermute`` forms and ``token_unpermute``.

Backward: permute's token grad is unpermute of the output grad without probs; the probs grad is
the output-probs grad gathered back. Unpermute's grad is the (probs-weighted) permute of the output
grad; the merging-probs grad is ``<permuted_tokens[row], grad_out[t]>`` (fp32).

Primus-Turbo form (selected by passing ``num_local_experts``; Primus-Turbo's call, argument for argument):

moe_permute(tokens, expert_map, *, num_local_experts, num_topk=0, pad_multiple=0, num_permuted_tokens=-1,
            scaling_factor=None, probs=None, probs_layout="topk", scales_per_token=0, use_fp8=False)
    -> (permuted_tokens, row_id_map, tokens_per_expert, overflow_flag, num_dispatched_tokens,
        permuted_scaling_factor, permuted_probs)

``expert_map`` (also accepted as ``routing_map=`` or ``topk_indices=``) is the bool ``[T, E]`` map
(``E = num_local_experts``) or top-k indices ``[T, k]`` whose entries outside ``[0, E)`` (``-1``: the slot
went to another rank's expert, as an EP dispatch returns them) route nowhere; ``num_topk`` is 0 or ``k``.
The rows are those of the other form (expert-major, token order, padding to ``pad_multiple`` per expert,
0 = none). ``num_permuted_tokens > 0`` sizes the buffer with no host sync (pairs past it are dropped,
``tokens_per_expert`` counts only the rows kept, ``overflow_flag`` int32 ``[1]`` is 1 when the padded
total exceeds it, on device); ``-1`` (or 0) reads the padded total back (one sync). ``probs``:
``[T, k]`` with ``probs_layout="topk"`` (top-k indices only), ``[T, E]`` with ``"routing_map"``;
``permuted_probs`` is 1-D, one per row (0 on padding). FP8 ``tokens`` with ``use_fp8=True`` carry
``scaling_factor [T, scales_per_token]`` along (``permuted_scaling_factor``, zero on padding);
``scaling_factor`` without ``use_fp8`` raises. ``num_dispatched_tokens`` is ``T`` as an int32 ``[1]`` device
tensor. ``row_id_map`` is int32 ``[T, E]`` (the row of each (token, local expert) pair, ``-1`` if none)
for a bool map; ``[T, E + 1 + k]`` for indices: those ``E`` columns, a spare column ``E`` (``-1``), then
each slot's column (``E`` for a slot with no row), so ``moe_unpermute`` reads each slot's row with one
gather and restores the probs in either layout. It is meant for ``moe_unpermute``.

moe_unpermute(permuted_tokens, row_id_map, num_dispatched_tokens_tensor=None, *, restore_shape,
              num_local_experts, permuted_probs=None, probs_topk_stride=0, pad_multiple=0)
    -> (out, unpermuted_probs)

``num_dispatched_tokens_tensor`` may also be passed by keyword (Primus-Turbo's name), only in this form
(with ``num_local_experts``) and not together with a third positional argument (TypeError otherwise).

``out[t]`` is the plain (unweighted) sum of token ``t``'s rows (fp32 accumulation), reshaped to
``restore_shape``; a token with no row gets zeros. ``unpermuted_probs`` (when ``permuted_probs`` is given)
puts each row's value back at its pair: ``[T, E]`` with ``probs_topk_stride=0``, ``[T, k]`` (the permute's
slots, 0 on ``-1`` slots) with ``probs_topk_stride=k``. Both outputs are differentiable; the gradient
of padding and dropped rows is zero (so ``pad_multiple`` is accepted and not needed).
``num_dispatched_tokens_tensor`` is accepted for the call's shape and not read (``restore_shape`` gives
``T``).

token_permute(inp, num_out_tokens=None, probs=None, routing_map=None, topk_indices=None,
              drop_and_pad=False, fused=False, return_tokens_per_expert=False)
    -> (permuted_tokens, permuted_probs, sorted_indices, tokens_per_expert)
token_unpermute(inp, sorted_indices, merging_probs=None, restore_shape=None, routing_map=None,
                fused=False, drop_and_pad=False) -> tokens
    Megatron's mask-based ``moe_utils.permute`` / ``unpermute`` in Primus-Turbo's call form (argument
    names included: ``inp`` is the tokens ``[T, H]`` for ``token_permute``, the permuted tokens for
    ``token_unpermute``).
    ``routing_map`` ``[T, E]`` (bool, or integers with nonzero = routed) is required (``topk_indices``:
    NotImplementedError, no expert count; ``moe_permute`` takes indices). The rows are ``moe_permute``'s
    (expert-major, token order, no padding); ``num_out_tokens`` sizes the output (rows past the routed
    ones are zero, routed rows past it dropped; ``None`` / ``-1``: the routed count, one host sync).
    ``probs`` is ``[T, E]``; ``permuted_probs`` its value per row. The third output is ``sorted_indices``
    (int64, the token of each row, ``-1`` on rows past the routed ones) with ``fused=False``, the int32
    ``[T, E]`` row map with ``fused=True`` (no extra launches); ``tokens_per_expert`` (int64 ``[E]``, rows
    per expert) is always returned (``return_tokens_per_expert`` is accepted for the call's shape).
    ``drop_and_pad=True`` (``num_out_tokens = E * capacity``): each expert gets ``capacity`` rows, its
    routed tokens first then unrouted ones as filler, in token order, routed tokens past the capacity
    dropped (Megatron's layout; plain torch ops).
    ``token_unpermute`` sums each token's rows, weighted by ``merging_probs [T, E]`` (fp32 accumulation),
    to ``restore_shape`` (needed unless the row map or ``routing_map`` gives ``T``). With the row map,
    or ``sorted_indices`` and ``routing_map``, it is the same merge kernel as ``moe_unpermute``
    (deterministic); ``sorted_indices`` without ``routing_map`` (no probs then) and drop-and-pad rows
    are summed by token id with fp32 atomic adds on CUDA. Both differentiable (tokens and probs).
    ``token_unpermute`` checks what the shapes tell: a ``routing_map`` whose ``[T, E]`` differs from the
    fused row map's, or from ``merging_probs``', or (drop-and-pad) whose ``E`` does not divide the rows,
    raises ValueError. On CPU async asserts also check the data: the row map's rows fit ``inp``,
    ``sorted_indices`` are the rows ``routing_map`` places (same map), token ids are below ``T``; on
    CUDA such entries are dropped (never indexed).

Backend: Triton kernels (primus_turbo/triton/moe) on CUDA and on CPU under the Triton interpreter;
plain PyTorch indexing elsewhere. On the Triton backend ``moe_permute`` can build the row map, its
inverse and ``tokens_per_expert`` with three kernels (count, scan, assign: see
``primus_turbo/triton/moe/permute_kernel.py``): a handful of allocations and four launches per call
instead of ~35 small torch ops, so small problems are not host-bound. ``PRIMUS_TURBO_PERMUTE_FUSED_MAP``
chooses (default: the kernels, from H200 measurements; see :func:`_fused_map`). Token rows and probs move in
one gather launch either way.
The torch backend builds the map with torch ops (``_build_row_id_map`` / ``_inverse``, also the
reference of the kernel tests). Neither reads anything back to the host except the documented
``num_out_tokens=None`` sync.

``torch.compile``: the kernel launches (row map, gather, merge and their backward) are
``torch.library`` custom ops (``primus_turbo::moe_permute_maps``, ``moe_permute_rows``,
``moe_gather_rows``, ``moe_merge_rows``, ``moe_unpermute_bwd``) with fake implementations, so every
form traces with ``fullgraph=True`` when its row count is known without reading data:
``num_out_tokens`` / ``num_permuted_tokens`` given, or the indices form without padding (``T * k``).
Otherwise the row count is data: the map is built outside the graph at the documented sync (a graph
break, so ``fullgraph=False``). The data checks that run as CPU async asserts are skipped while
tracing.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch

from primus_turbo.triton import is_interpreter, triton_available

__all__ = ["moe_permute", "moe_unpermute", "token_permute", "token_unpermute", "permute_backend"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fused_map(x: torch.Tensor) -> bool:
    """Build the row map with the Triton kernels? (PRIMUS_TURBO_PERMUTE_FUSED_MAP, docs/env_vars.md)
    ``auto``: yes, wherever the Triton backend runs (on CPU through the interpreter, so CI runs the
    kernels), for a bool map and top-k indices of any size. H200, 16384 tokens top-8 (131072 routed
    rows), do_bench of the whole permute (2026-12-05): top-k indices 0.606 ms with the kernels
    against 1.088 with the torch builder at 32 experts, 0.796 against 0.834 at 256; the
    Primus-Turbo form 0.616 / 0.794 against 1.660 / 1.494. (Before the indices kernels built
    one-hot tiles they lost at this size, and indices problems over 32768 rows took the torch
    builder.)"""
    if permute_backend(x) != "triton":
        return False
    from ..core.env import env_auto_flag

    choice = env_auto_flag("PRIMUS_TURBO_PERMUTE_FUSED_MAP")
    return True if choice is None else choice


def permute_backend(x: torch.Tensor) -> str:
    """``"triton"`` on CUDA (and on CPU under ``TRITON_INTERPRET=1``), else ``"torch"``."""
    if triton_available() and (x.is_cuda or (x.device.type == "cpu" and is_interpreter())):
        return "triton"
    return "torch"


# ----------------------------------------------------------------------------------------------
# Row movement (Triton or torch)
# ----------------------------------------------------------------------------------------------
def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(_INT_VIEW[x.element_size()])


def _gather_rows(src: torch.Tensor, src_row: torch.Tensor, scale: Optional[torch.Tensor] = None,
                 out_dtype: Optional[torch.dtype] = None, row_div: int = 1) -> torch.Tensor:
    """``out[o] = src[src_row[o] // row_div] (* scale[o])``, zero rows where ``src_row < 0``. src 2-D."""
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.moe_gather_rows(src, src_row, scale, out_dtype, row_div)
    return _gather_rows_eager(src, src_row, scale, out_dtype, row_div)


def _gather_rows_eager(src: torch.Tensor, src_row: torch.Tensor, scale: Optional[torch.Tensor],
                       out_dtype: Optional[torch.dtype], row_div: int) -> torch.Tensor:
    src = src.contiguous()
    n_out, h = src_row.shape[0], src.shape[1]
    out_dtype = out_dtype or src.dtype
    if permute_backend(src) == "triton":
        from primus_turbo.triton.moe import gather_rows_launch

        if scale is None:  # raw bits: exact for every dtype
            out = torch.empty(n_out, h, dtype=out_dtype, device=src.device)
            gather_rows_launch(_bits(src), _bits(out), src_row, row_div=row_div)
        else:
            out = torch.empty(n_out, h, dtype=out_dtype, device=src.device)
            gather_rows_launch(src, out, src_row, scale.float().contiguous(), row_div=row_div)
        return out
    if row_div != 1:
        src_row = torch.where(src_row >= 0, src_row // row_div, src_row)
    if src.shape[0] == 0:
        return torch.zeros(n_out, h, dtype=out_dtype, device=src.device)
    valid = src_row >= 0
    rows = src[src_row.clamp(min=0).long()]
    if scale is not None:
        rows = (rows.float() * scale.float()[:, None]).to(out_dtype)
    return _bits_where(valid, rows)


def _bits_where(valid: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    b = _bits(rows)
    return torch.where(valid[:, None], b, torch.zeros((), dtype=b.dtype, device=b.device)).view(rows.dtype)


def _merge_rows(src: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * src[row_id_map[t, j]]`` (fp32 accumulation, ascending j)."""
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.moe_merge_rows(src, row_id_map, weights)
    return _merge_rows_eager(src, row_id_map, weights)


def _merge_rows_eager(src: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    src = src.contiguous()
    t, k = row_id_map.shape
    h = src.shape[1]
    if permute_backend(src) == "triton":
        from primus_turbo.triton.moe import merge_rows_launch

        out = torch.empty(t, h, dtype=src.dtype, device=src.device)
        w = weights.contiguous() if weights is not None else None
        merge_rows_launch(src, out, row_id_map.contiguous(), w)
        return out
    acc = torch.zeros(t, h, dtype=torch.float32, device=src.device)
    if src.shape[0] == 0:
        return acc.to(src.dtype)
    n_src = src.shape[0]
    for j in range(k):
        r = row_id_map[:, j].long()
        ok = (r >= 0) & (r < n_src)  # a row past src (a bad map) is not routed, as in the kernel
        x = src[torch.where(ok, r, 0)].float()
        if weights is not None:
            x = x * weights[:, j].float()[:, None]
        acc += torch.where(ok[:, None], x, torch.zeros((), device=src.device))
    return acc.to(src.dtype)


def _inverse(row_id_map: torch.Tensor, n_out: int) -> torch.Tensor:
    """``src_idx[o]`` = flat index ``t*K + j`` of the pair in row ``o``, ``-1`` for rows nobody fills."""
    flat = row_id_map.reshape(-1).long()
    pos = torch.arange(flat.numel(), device=flat.device)
    # unrouted pairs (-1) go to distinct slots past n_out: one shared dump slot would make
    # every such write (most of a [T, E] map) collide on one address. Entries >= n_out (a bad map:
    # the merge skips them) too, so the scatter never indexes out of bounds.
    dest = torch.where((flat >= 0) & (flat < n_out), flat, n_out + pos)
    src_idx = torch.full((n_out + flat.numel(),), -1, dtype=torch.int64, device=flat.device)
    src_idx.scatter_(0, dest, pos)
    return src_idx[:n_out]


def _gather_flat(values: torch.Tensor, src_idx: torch.Tensor) -> torch.Tensor:
    """``values.flatten()[src_idx]``, 0 where ``src_idx < 0``."""
    v = values.reshape(-1)[src_idx.clamp(min=0)]
    return torch.where(src_idx >= 0, v, torch.zeros((), dtype=v.dtype, device=v.device))


def _scatter_back(per_row: torch.Tensor, row_id_map: torch.Tensor) -> torch.Tensor:
    """``out[t, j] = per_row[row_id_map[t, j]]``, 0 where the entry is ``-1`` (or past ``per_row``)."""
    r = row_id_map.long()
    if per_row.numel() == 0:
        return torch.zeros(r.shape, dtype=per_row.dtype, device=per_row.device)
    ok = (r >= 0) & (r < per_row.shape[0])  # rows past per_row (a bad map): 0, as the merge skips them
    v = per_row[torch.where(ok, r, 0)]
    return torch.where(ok, v, torch.zeros((), dtype=v.dtype, device=v.device))


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------
def _permute_rows(tokens: torch.Tensor, probs: Optional[torch.Tensor], src_idx: torch.Tensor, k: int,
                  row_id_map: torch.Tensor):
    """``(tokens[src_idx // k], probs.flatten()[src_idx])``, zero where ``src_idx < 0`` (one launch on Triton:
    token-major, each token row read once and written to its ``row_id_map`` rows)."""
    if torch.compiler.is_compiling():
        out, pprobs = torch.ops.primus_turbo.moe_permute_rows(tokens, probs, src_idx, k, row_id_map)
        return out, (pprobs if probs is not None else None)
    return _permute_rows_eager(tokens, probs, src_idx, k, row_id_map)


def _permute_rows_eager(tokens: torch.Tensor, probs: Optional[torch.Tensor], src_idx: torch.Tensor, k: int,
                        row_id_map: torch.Tensor):
    if permute_backend(tokens) == "triton":
        from primus_turbo.triton.moe.permute_kernel import scatter_rows_launch

        tokens = tokens.contiguous()
        n_out = src_idx.shape[0]
        out = torch.empty(n_out, tokens.shape[1], dtype=tokens.dtype, device=tokens.device)
        pprobs = None
        if probs is not None:
            probs = probs.contiguous()
            pprobs = torch.empty(n_out, dtype=probs.dtype, device=probs.device)
        scatter_rows_launch(_bits(tokens), row_id_map.contiguous(), src_idx, out=_bits(out), weights=probs,
                            probs_out=pprobs)
        return out, pprobs
    out = _gather_rows(tokens, src_idx, row_div=k)
    return out, (_gather_flat(probs, src_idx) if probs is not None else None)


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, probs, row_id_map, src_idx, k):
        out, pprobs = _permute_rows(tokens, probs, src_idx, k, row_id_map)
        ctx.save_for_backward(row_id_map)
        ctx.has_probs = probs is not None
        ctx.tok_dtype = tokens.dtype
        ctx.mark_non_differentiable(row_id_map)
        return out, pprobs

    @staticmethod
    def backward(ctx, g_out, g_pprobs):
        (row_id_map,) = ctx.saved_tensors
        g_tok = g_probs = None
        if ctx.needs_input_grad[0]:
            g_tok = _merge_rows(g_out, row_id_map, None).to(ctx.tok_dtype)
        if ctx.has_probs and ctx.needs_input_grad[1]:
            if g_pprobs is None:
                g_probs = torch.zeros(row_id_map.shape, device=row_id_map.device)
            else:
                g_probs = _scatter_back(g_pprobs, row_id_map)
        return g_tok, g_probs, None, None, None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, row_id_map, probs):
        out = _merge_rows(permuted, row_id_map, probs)
        ctx.save_for_backward(permuted, row_id_map, probs)
        return out

    @staticmethod
    def backward(ctx, g_out):
        permuted, row_id_map, probs = ctx.saved_tensors
        need_perm = ctx.needs_input_grad[0]
        need_probs = probs is not None and ctx.needs_input_grad[2]
        if not (need_perm or need_probs):
            return None, None, None
        g_perm, g_probs = _unpermute_bwd(g_out, permuted, row_id_map, probs, need_perm, need_probs)
        return g_perm, None, g_probs


def _unpermute_bwd(g_out, permuted, row_id_map, probs, need_perm: bool, need_probs: bool):
    """``(grad of permuted or None, grad of probs or None)`` of the (weighted) merge."""
    if torch.compiler.is_compiling():
        g_perm, g_probs = torch.ops.primus_turbo.moe_unpermute_bwd(g_out, permuted, row_id_map, probs, need_perm,
                                                                   need_probs)
        return (g_perm if need_perm else None), (g_probs if need_probs else None)
    return _unpermute_bwd_eager(g_out, permuted, row_id_map, probs, need_perm, need_probs)


def _unpermute_bwd_eager(g_out, permuted, row_id_map, probs, need_perm: bool, need_probs: bool):
    k = row_id_map.shape[1]
    n_out = permuted.shape[0]
    src_idx = _inverse(row_id_map, n_out)
    if permute_backend(permuted) == "triton":
        from primus_turbo.triton.moe.permute_kernel import scatter_rows_launch, unpermute_bwd_launch

        if probs is None:
            # plain copies, token-major: each grad row read once and written to the token's rows
            # (raw bits); the row-major gather reads it k times
            g_perm = None
            if need_perm:
                g_perm = torch.empty(permuted.shape, dtype=permuted.dtype, device=permuted.device)
                scatter_rows_launch(_bits(g_out.to(permuted.dtype).contiguous()), row_id_map, src_idx,
                                    out=_bits(g_perm))
            return g_perm, None
        # weighted rows and the probs-gradient dots in one row-major pass (each output row reads its
        # token's grad row and its own permuted row)
        g_perm, dots = unpermute_bwd_launch(g_out.contiguous(), permuted.contiguous(), src_idx, k, probs,
                                            need_perm, need_probs)
        g_probs = _scatter_back(dots, row_id_map).to(probs.dtype) if need_probs else None
        return g_perm, g_probs
    src_tok = torch.where(src_idx >= 0, src_idx // k, src_idx)
    g_perm = g_probs = None
    w = _gather_flat(probs, src_idx).float() if probs is not None else None
    if need_perm:
        g_perm = _gather_rows_eager(g_out, src_tok, w, permuted.dtype, 1)
    if need_probs:
        g_rows = _gather_rows_eager(g_out, src_tok, None, None, 1)  # [n_out, H], zero on unfilled rows
        dots = (g_rows.float() * permuted.float()).sum(-1)
        g_probs = _scatter_back(dots, row_id_map).to(probs.dtype)
    return g_perm, g_probs


# ----------------------------------------------------------------------------------------------
# torch.compile: the kernel launches as torch.library custom ops
# ----------------------------------------------------------------------------------------------
# Traced, the helpers above would take dynamo into the kernels' host-side launch code (and, under
# the Triton interpreter, run the kernels on fake tensors), so each one that launches a kernel is
# also a custom op with a fake (shape-only) implementation; the helpers call the op only while
# compiling (eager calls skip the dispatcher, as the other turbo ops do). Absent optional outputs
# come back as empty tensors (a custom op returns tensors only). The ops take validated arguments;
# every output shape follows from the inputs' shapes and the int arguments, so a permute whose row
# count is known (given, or T * k) traces whole.
def _gather_rows_op(src: torch.Tensor, src_row: torch.Tensor, scale: Optional[torch.Tensor],
                    out_dtype: Optional[torch.dtype], row_div: int) -> torch.Tensor:
    return _gather_rows_eager(src, src_row, scale, out_dtype, row_div)


moe_gather_rows = torch.library.custom_op("primus_turbo::moe_gather_rows", _gather_rows_op, mutates_args=())


@moe_gather_rows.register_fake
def _gather_rows_fake(src, src_row, scale, out_dtype, row_div):
    return src.new_empty((src_row.shape[0], src.shape[1]), dtype=out_dtype or src.dtype)


def _merge_rows_op(src: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    return _merge_rows_eager(src, row_id_map, weights)


moe_merge_rows = torch.library.custom_op("primus_turbo::moe_merge_rows", _merge_rows_op, mutates_args=())


@moe_merge_rows.register_fake
def _merge_rows_fake(src, row_id_map, weights):
    return src.new_empty((row_id_map.shape[0], src.shape[1]))


def _permute_rows_op(tokens: torch.Tensor, probs: Optional[torch.Tensor], src_idx: torch.Tensor, k: int,
                     row_id_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, pprobs = _permute_rows_eager(tokens, probs, src_idx, k, row_id_map)
    return out, (pprobs if pprobs is not None else tokens.new_empty((0,), dtype=torch.float32))


moe_permute_rows = torch.library.custom_op("primus_turbo::moe_permute_rows", _permute_rows_op, mutates_args=())


@moe_permute_rows.register_fake
def _permute_rows_fake(tokens, probs, src_idx, k, row_id_map):
    n_out = src_idx.shape[0]
    pprobs = probs.new_empty((n_out,)) if probs is not None else tokens.new_empty((0,), dtype=torch.float32)
    return tokens.new_empty((n_out, tokens.shape[1])), pprobs


def _unpermute_bwd_op(g_out: torch.Tensor, permuted: torch.Tensor, row_id_map: torch.Tensor,
                      probs: Optional[torch.Tensor], need_perm: bool,
                      need_probs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g_perm, g_probs = _unpermute_bwd_eager(g_out, permuted, row_id_map, probs, need_perm, need_probs)
    return (g_perm if g_perm is not None else permuted.new_empty((0,)),
            g_probs if g_probs is not None else permuted.new_empty((0,), dtype=torch.float32))


moe_unpermute_bwd = torch.library.custom_op("primus_turbo::moe_unpermute_bwd", _unpermute_bwd_op, mutates_args=())


@moe_unpermute_bwd.register_fake
def _unpermute_bwd_fake(g_out, permuted, row_id_map, probs, need_perm, need_probs):
    g_perm = permuted.new_empty(permuted.shape) if need_perm else permuted.new_empty((0,))
    g_probs = (probs.new_empty(row_id_map.shape) if need_probs and probs is not None
               else permuted.new_empty((0,), dtype=torch.float32))
    return g_perm, g_probs


def _permute_maps_op(routing_map: torch.Tensor, num_experts: int, pad_multiple: int, n_out: int,
                     full_map: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rid, src_idx, seg, total, full, _n = _permute_maps_eager(routing_map, num_experts, pad_multiple or None, n_out,
                                                             full_map)
    return rid, src_idx, seg, total, (full if full is not None else rid.new_empty((0,)))


moe_permute_maps = torch.library.custom_op("primus_turbo::moe_permute_maps", _permute_maps_op, mutates_args=())


@moe_permute_maps.register_fake
def _permute_maps_fake(routing_map, num_experts, pad_multiple, n_out, full_map):
    t, k = routing_map.shape
    i32 = dict(dtype=torch.int32, device=routing_map.device)
    return (torch.empty((t, k), **i32), torch.empty((n_out,), dtype=torch.int64, device=routing_map.device),
            torch.empty((num_experts,), dtype=torch.int64, device=routing_map.device), torch.empty((1,), **i32),
            torch.empty((t, num_experts + 1 + k) if full_map else (0,), **i32))


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _shape_or_type(x):
    """What an error message reports of an argument: a tensor's shape, else its type's name."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_tokens(tokens: torch.Tensor, op: str, name: str = "tokens") -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"{op}: {name} must be a 2-D tensor [T, H], got {_shape_or_type(tokens)}")


def _check_token_dtype(tokens: torch.Tensor, op: str) -> None:
    if tokens.dtype not in _FLOAT_DTYPES and tokens.element_size() != 1:
        raise TypeError(f"{op}: tokens dtype {tokens.dtype} not supported (bf16/fp16/fp32 or a 1-byte FP8 type)")
    if tokens.element_size() == 1 and tokens.requires_grad:
        raise TypeError(f"{op}: FP8 tokens ({tokens.dtype}) are moved as data only; they cannot require grad")


def _check_device(t: Optional[torch.Tensor], name: str, ref: torch.Tensor, ref_name: str, op: str) -> None:
    if isinstance(t, torch.Tensor) and t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device}, {ref_name} on {ref.device}; they must share a device")


def _cpu_assert(x: torch.Tensor, cond, msg: str) -> None:
    """Checks that need the data: run on CPU only, where an async assert costs no device sync (the
    project's rule: no host sync on CUDA paths). On CUDA the kernels mask the bad entries instead
    (documented per op)."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        torch._assert_async(cond() if callable(cond) else cond, msg)


def _check_rows_fit(row_id_map: torch.Tensor, n_rows: int, op: str, name: str = "row_id_map") -> None:
    """CPU: every row index of ``row_id_map`` is a row of the ``n_rows`` permuted tokens given."""
    if row_id_map.numel():
        _cpu_assert(row_id_map, lambda: row_id_map.max() < n_rows,
                    f"{op}: {name} holds a row index >= permuted_tokens.shape[0] = {n_rows}: it was built for a "
                    f"larger permuted buffer than the {n_rows} rows given")


def _int_arg(v, name: str, op: str, lo: int) -> int:
    """A Python (or NumPy) int ``>= lo``; bool and float are rejected (TypeError), not coerced."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {v!r} ({type(v).__name__})")
    v = int(v)
    if v < lo:
        raise ValueError(f"{op}: {name} must be >= {lo}, got {v}")
    return v


def _shape_arg(restore_shape, op: str) -> tuple:
    """``restore_shape`` as a tuple of ints ``>= 0`` (TypeError / ValueError naming it otherwise)."""
    try:
        dims = tuple(restore_shape)
    except TypeError:
        raise TypeError(f"{op}: restore_shape must be a sequence of ints, got {restore_shape!r}") from None
    if any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in dims):
        raise ValueError(f"{op}: restore_shape must be a sequence of ints >= 0, got {restore_shape!r}")
    return tuple(int(d) for d in dims)


def _restore_shape(restore_shape, t: int, h: int, op: str) -> tuple:
    """``restore_shape`` checked to hold the ``[t, h]`` merged tokens: ``[..., h]`` with ``t`` rows."""
    dims = _shape_arg(restore_shape, op)
    if not dims or dims[-1] != h or math.prod(dims[:-1]) != t:
        raise ValueError(f"{op}: restore_shape {list(dims)} does not hold {t} tokens of hidden {h} (the "
                         f"merged output is [{t}, {h}])")
    return dims


def _build_row_id_map(routing_map, num_experts, pad_multiple, num_out_tokens, return_total=False):
    """Device-only map building; returns (row_id_map int32 [T, K], segment lengths [E], rows in the
    buffer[, the padded total before any cut: int32 [1] on device, with ``return_total``]).

    The running count of each expert's tokens is a scan over tokens. It is done on the
    expert-major [E, T] copy of the mask: torch scans the innermost dimension with all threads
    of a block, while a scan over dim 0 of [T, E] runs one sequential thread per expert column
    (milliseconds at T = 16384)."""
    device = routing_map.device
    t = routing_map.shape[0]
    if routing_map.dtype == torch.bool:
        mask_t = routing_map.t()
    else:
        # indices outside [0, E) (-1: a token's slot routed to no local expert) are unrouted, as in
        # the kernels: they land in a spare row E that is cut off
        idx = routing_map.t().long()
        idx_t = torch.where((idx >= 0) & (idx < num_experts), idx, num_experts)   # [k, T]
        mask_t = torch.zeros(num_experts + 1, t, dtype=torch.bool, device=device)
        mask_t.scatter_(0, idx_t, True)
        mask_t = mask_t[:num_experts]
    m = mask_t.to(torch.int32)                          # [E, T]
    rank = torch.cumsum(m, 1, dtype=torch.int32) - m    # routed tokens of e before t
    counts = m.sum(1, dtype=torch.int32)                # [E]
    seg = (counts + pad_multiple - 1) // pad_multiple * pad_multiple if pad_multiple else counts
    starts = torch.cumsum(seg, 0, dtype=torch.int32) - seg
    dest = torch.where(mask_t, starts[:, None] + rank, -1)  # [E, T]
    if routing_map.dtype != torch.bool:
        dest = torch.cat([dest, dest.new_full((1, t), -1)]).gather(0, idx_t)   # [K, T]
    total = seg.sum(dtype=torch.int32).reshape(1)       # padded rows before any cut, on device
    if num_out_tokens is None:
        num_out_tokens = int(total)                     # host sync (documented)
    dest = torch.where(dest < num_out_tokens, dest, -1)
    # segments cut by a short num_out_tokens: the lengths count the rows actually in the buffer
    seg = torch.minimum(seg, (num_out_tokens - starts).clamp(min=0))
    if return_total:
        return dest.t().contiguous(), seg.to(torch.int64), num_out_tokens, total
    return dest.t().contiguous(), seg.to(torch.int64), num_out_tokens


def moe_permute(tokens: torch.Tensor, routing_map: Optional[torch.Tensor] = None,
                probs: Optional[torch.Tensor] = None, num_out_tokens: Optional[int] = None,
                pad_multiple: Optional[int] = None, scales: Optional[torch.Tensor] = None, *,
                num_experts: Optional[int] = None, return_tokens_per_expert: bool = False,
                num_local_experts: Optional[int] = None, expert_map: Optional[torch.Tensor] = None,
                topk_indices: Optional[torch.Tensor] = None, num_topk: int = 0, num_permuted_tokens: int = -1,
                scaling_factor: Optional[torch.Tensor] = None, probs_layout: str = "topk",
                scales_per_token: int = 0, use_fp8: bool = False):
    """Group tokens by expert (see the module docstring). Passing ``num_local_experts`` selects the
    Primus-Turbo form (``expert_map``, ``num_permuted_tokens``, ``scaling_factor``, ...; a 7-tuple)."""
    op = "moe_permute"
    primus_only = dict(expert_map=expert_map, topk_indices=topk_indices, num_topk=num_topk or None,
                       num_permuted_tokens=None if num_permuted_tokens == -1 else num_permuted_tokens,
                       scaling_factor=scaling_factor, probs_layout=None if probs_layout == "topk" else probs_layout,
                       scales_per_token=scales_per_token or None, use_fp8=use_fp8 or None)
    if num_local_experts is not None:
        te_only = dict(num_out_tokens=num_out_tokens, scales=scales, num_experts=num_experts,
                       return_tokens_per_expert=return_tokens_per_expert or None)
        bad = sorted(n for n, v in te_only.items() if v is not None)
        if bad:
            raise ValueError(f"{op}: {', '.join(bad)} belong to the routing_map form; with num_local_experts "
                             f"(the Primus-Turbo form) use num_permuted_tokens, scaling_factor")
        return _moe_permute_primus(tokens, routing_map, expert_map, topk_indices, num_local_experts, num_topk,
                                   pad_multiple, num_permuted_tokens, scaling_factor, probs, probs_layout,
                                   scales_per_token, use_fp8)
    bad = sorted(n for n, v in primus_only.items() if v is not None)
    if bad:
        raise ValueError(f"{op}: {', '.join(bad)} belong to the Primus-Turbo form, which needs num_local_experts")
    _check_tokens(tokens, op)
    if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2:
        raise ValueError(f"{op}: routing_map must be a 2-D bool [T, E] map or int32/int64 [T, k] indices, got "
                         f"{_shape_or_type(routing_map)}")
    t, _h = tokens.shape
    if routing_map.shape[0] != t:
        raise ValueError(f"{op}: routing_map has {routing_map.shape[0]} rows, tokens has {t}")
    _check_device(routing_map, "routing_map", tokens, "tokens", op)
    is_map = routing_map.dtype == torch.bool
    if num_experts is not None:
        num_experts = _int_arg(num_experts, "num_experts", op, 0)
    if is_map:
        e = routing_map.shape[1]
        if num_experts is not None and num_experts != e:
            raise ValueError(f"{op}: num_experts={num_experts} but routing_map has {e} columns")
    elif routing_map.dtype in (torch.int32, torch.int64):
        if num_experts is None or num_experts <= 0:
            raise ValueError(f"{op}: the top-k indices form needs num_experts > 0, got num_experts={num_experts}")
        e = num_experts
        if routing_map.shape[1] > e:
            raise ValueError(f"{op}: top-k {routing_map.shape[1]} exceeds num_experts {e}")
        # -1 = the slot is not routed (as Primus-Turbo's indices_to_multihot); other values outside
        # [0, E) are a caller's bug: checked on CPU, treated as -1 by the map builders on CUDA
        if routing_map.numel():
            _cpu_assert(routing_map, lambda: ((routing_map >= -1) & (routing_map < e)).all(),
                        f"{op}: top-k indices must be in [-1, num_experts={e}) (-1: the slot is not routed)")
    else:
        raise TypeError(f"{op}: routing_map must be bool or int32/int64, got {routing_map.dtype}")
    k = routing_map.shape[1]
    if pad_multiple is not None:
        pad_multiple = _int_arg(pad_multiple, "pad_multiple", op, 1)
        pad_multiple = pad_multiple if pad_multiple > 1 else None
    if num_out_tokens is not None:
        num_out_tokens = _int_arg(num_out_tokens, "num_out_tokens", op, 0)
        if not is_map and num_out_tokens < t * k:
            raise ValueError(f"{op}: num_out_tokens={num_out_tokens} < T*k={t * k}: every top-k pair needs a row")
    elif not is_map and pad_multiple is None:
        num_out_tokens = t * k
    _check_token_dtype(tokens, op)
    if probs is not None:
        if probs.shape != routing_map.shape:
            raise ValueError(f"{op}: probs shape {tuple(probs.shape)} must match routing_map "
                             f"{tuple(routing_map.shape)}")
        if not probs.dtype.is_floating_point:
            raise TypeError(f"{op}: probs must be floating point, got {probs.dtype}")
        _check_device(probs, "probs", tokens, "tokens", op)
        probs = probs.contiguous()
    if scales is not None:
        if scales.dim() not in (1, 2) or scales.shape[0] != t:
            raise ValueError(f"{op}: scales must be [T] or [T, S] with T={t}, got {tuple(scales.shape)}")
        _check_device(scales, "scales", tokens, "tokens", op)

    permuted, pprobs, row_id_map, pscales, seg, _total = _permute_core(tokens, routing_map, probs, e,
                                                                       num_out_tokens, pad_multiple, scales)
    result = [permuted, pprobs, row_id_map]
    if scales is not None:
        result.append(pscales)
    if return_tokens_per_expert:
        result.append(seg)
    return tuple(result)


def _permute_core(tokens, routing_map, probs, e, num_out_tokens, pad_multiple, scales, full_map=False):
    """The checked permutation: ``(permuted, permuted_probs, row_id_map, permuted_scales, tokens_per_expert,
    padded total before any cut (int32 [1] on device))``. ``num_out_tokens=None`` reads the total back
    (the documented sync). ``full_map`` (top-k indices): ``row_id_map`` is Primus-Turbo's
    ``[T, E + 1 + k]`` map instead of ``[T, k]``."""
    t, k = routing_map.shape
    row_id_map, src_idx, seg, total, full, n_out = _permute_maps(routing_map, e, pad_multiple, num_out_tokens,
                                                                 full_map)
    permuted, pprobs = _PermuteFn.apply(tokens, probs, row_id_map, src_idx, k)
    pscales = None
    if scales is not None:
        s2 = scales.detach().reshape(t, -1)
        ps = _gather_rows(s2, src_idx, row_div=k)
        pscales = ps.reshape(n_out) if scales.dim() == 1 else ps
    return permuted, pprobs, row_id_map if full is None else full, pscales, seg, total


def _permute_maps(routing_map, e, pad_multiple, num_out_tokens, full_map):
    """``(row_id_map, src_idx, tokens_per_expert, padded total (int32 [1]), full map or None, n_out)``: the
    row map, its inverse and the segment lengths (see :func:`_permute_maps_eager`)."""
    if torch.compiler.is_compiling():
        if num_out_tokens is None:
            # the row count is data (the documented sync): built outside the graph, which breaks here
            # (wrapped on use: torch.compiler.disable imports dynamo, which importing the ops does not)
            return torch.compiler.disable(_permute_maps_eager)(routing_map, e, pad_multiple, None, full_map)
        rid, src_idx, seg, total, full = torch.ops.primus_turbo.moe_permute_maps(
            routing_map, e, pad_multiple or 0, num_out_tokens, full_map)
        return rid, src_idx, seg, total, (full if full_map else None), num_out_tokens
    return _permute_maps_eager(routing_map, e, pad_multiple, num_out_tokens, full_map)


def _permute_maps_eager(routing_map, e, pad_multiple, num_out_tokens, full_map):
    """The maps built by the Triton kernels (:func:`_fused_map`) or torch ops; ``num_out_tokens=None``
    reads the padded total back (the documented host sync). ``full_map`` (top-k indices): also
    Primus-Turbo's ``[T, E + 1 + k]`` map."""
    full = None
    if _fused_map(routing_map):
        from primus_turbo.triton.moe import permute_kernel as pk

        routing_map = routing_map.contiguous()
        state = pk.permute_map_scan_launch(routing_map, e, pad_multiple, num_out_tokens)
        seg, total = state[1], state[0][-1:]
        n_out = int(total) if num_out_tokens is None else num_out_tokens  # host sync (documented)
        maps = pk.permute_map_assign_launch(routing_map, e, state, n_out, full_map=full_map)
        row_id_map, src_idx = maps[:2]
        full = maps[2] if full_map else None
    else:
        row_id_map, seg, n_out, total = _build_row_id_map(routing_map, e, pad_multiple, num_out_tokens,
                                                          return_total=True)
        src_idx = _inverse(row_id_map, n_out)
        if full_map:
            full = _full_map_torch(routing_map, row_id_map, e)
    return row_id_map, src_idx, seg, total, full, n_out


def _full_map_torch(indices, rid, e):
    """Primus-Turbo's ``[T, E + 1 + k]`` map from the ``[T, k]`` row map (the assign kernel writes it
    directly): the row of each (token, local expert) pair, a spare column ``E`` (``-1``), then each
    slot's column (``E`` when the slot has no row), so ``moe_unpermute`` reads the slots' rows with one
    gather and can restore the probs in either layout."""
    t, k = rid.shape
    full = rid.new_full((t, e + 1 + k), -1)
    col = torch.where(rid >= 0, indices.to(rid.dtype), e)   # a slot has a row only if its expert is local
    full[:, e + 1:] = col
    full.scatter_(1, col.long(), rid)      # no-row slots write their -1 into the spare column
    return full


def moe_unpermute(permuted_tokens: torch.Tensor, row_id_map: torch.Tensor,
                  merging_probs: Optional[torch.Tensor] = None,
                  restore_shape: Optional[Sequence[int]] = None, *, num_local_experts: Optional[int] = None,
                  permuted_probs: Optional[torch.Tensor] = None, probs_topk_stride: int = 0,
                  pad_multiple: int = 0, num_dispatched_tokens_tensor: Optional[torch.Tensor] = None):
    """Merge each token's expert rows back (see the module docstring). Passing ``num_local_experts``
    selects the Primus-Turbo form: the third argument is then ``num_dispatched_tokens_tensor`` (also
    accepted by that keyword, valid only in this form) and the result ``(out, unpermuted_probs)``."""
    op = "moe_unpermute"
    if num_dispatched_tokens_tensor is not None:
        if num_local_experts is None:
            raise TypeError(f"{op}: num_dispatched_tokens_tensor belongs to the Primus-Turbo form, which needs "
                            f"num_local_experts (without it the third argument is merging_probs)")
        if merging_probs is not None:
            raise TypeError(f"{op}: got num_dispatched_tokens_tensor both as the third positional argument and "
                            f"by keyword; pass it once")
        merging_probs = num_dispatched_tokens_tensor
    if num_local_experts is not None:
        return _moe_unpermute_primus(permuted_tokens, row_id_map, merging_probs, restore_shape,
                                     num_local_experts, permuted_probs, probs_topk_stride)
    if permuted_probs is not None or probs_topk_stride:
        raise ValueError(f"{op}: permuted_probs / probs_topk_stride belong to the Primus-Turbo form, which "
                         f"needs num_local_experts")
    _check_tokens(permuted_tokens, op, "permuted_tokens")
    if permuted_tokens.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: permuted_tokens must be bf16/fp16/fp32, got {permuted_tokens.dtype}")
    if not isinstance(row_id_map, torch.Tensor) or row_id_map.dim() != 2 \
            or row_id_map.dtype not in (torch.int32, torch.int64):
        dtype = f" {row_id_map.dtype}" if isinstance(row_id_map, torch.Tensor) else ""
        raise ValueError(f"{op}: row_id_map must be the int [T, K] map returned by moe_permute, got "
                         f"{_shape_or_type(row_id_map)}{dtype}")
    _check_device(row_id_map, "row_id_map", permuted_tokens, "permuted_tokens", op)
    row_id_map = row_id_map.to(torch.int32).contiguous()
    _check_rows_fit(row_id_map, permuted_tokens.shape[0], op)
    if restore_shape is not None:
        restore_shape = _restore_shape(restore_shape, row_id_map.shape[0], permuted_tokens.shape[1], op)
    if merging_probs is not None:
        if merging_probs.shape != row_id_map.shape:
            raise ValueError(f"{op}: merging_probs shape {tuple(merging_probs.shape)} must match row_id_map "
                             f"{tuple(row_id_map.shape)}")
        if not merging_probs.dtype.is_floating_point:
            raise TypeError(f"{op}: merging_probs must be floating point, got {merging_probs.dtype}")
        _check_device(merging_probs, "merging_probs", permuted_tokens, "permuted_tokens", op)
        merging_probs = merging_probs.contiguous()
    out = _UnpermuteFn.apply(permuted_tokens, row_id_map, merging_probs)
    if restore_shape is not None:
        out = out.reshape(restore_shape)
    return out


def _routing_mask(routing_map, t: int, op: str, ref: torch.Tensor, ref_name: str) -> torch.Tensor:
    """A ``[T, E]`` routing map (bool, or integers where nonzero = routed) as bool."""
    if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2 or routing_map.shape[0] != t:
        raise ValueError(f"{op}: routing_map must be [T={t}, num_experts], got {_shape_or_type(routing_map)}")
    if routing_map.dtype.is_floating_point or routing_map.is_complex():
        raise TypeError(f"{op}: routing_map must be bool or integer (nonzero = routed), got {routing_map.dtype}")
    _check_device(routing_map, "routing_map", ref, ref_name, op)
    return routing_map if routing_map.dtype == torch.bool else routing_map != 0


def _map_rows(routing_mask: torch.Tensor, n_out: int) -> torch.Tensor:
    """The row map ``moe_permute`` builds for a bool ``[T, E]`` map and ``n_out`` rows (int32 ``[T, E]``)."""
    t, e = routing_mask.shape
    if torch.compiler.is_compiling():
        return torch.ops.primus_turbo.moe_permute_maps(routing_mask, e, 0, n_out, False)[0]
    if _fused_map(routing_mask):
        from primus_turbo.triton.moe import permute_kernel as pk

        routing_mask = routing_mask.contiguous()
        state = pk.permute_map_scan_launch(routing_mask, e, None, n_out)
        return pk.permute_map_assign_launch(routing_mask, e, state, n_out)[0]
    return _build_row_id_map(routing_mask, e, None, n_out)[0]


def _drop_and_pad_rows(mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """Megatron's drop-and-pad order: per expert its routed tokens then its unrouted ones, both in token
    order, cut to ``capacity``: int64 token ids ``[E * capacity]``."""
    order = torch.argsort(mask.t().to(torch.int8), dim=1, descending=True, stable=True)
    return order[:, :capacity].reshape(-1)


def token_permute(inp: torch.Tensor, num_out_tokens: Optional[int] = None, probs: Optional[torch.Tensor] = None,
                  routing_map: Optional[torch.Tensor] = None, topk_indices: Optional[torch.Tensor] = None,
                  drop_and_pad: bool = False, fused: bool = False, return_tokens_per_expert: bool = False):
    """Megatron's mask-based ``permute`` (Primus-Turbo's ``token_permute``); see the module docstring.

    ``inp``: the tokens ``[T, H]`` (Primus-Turbo's parameter name; error messages call it ``tokens``)."""
    op = "token_permute"
    tokens = inp
    _check_tokens(tokens, op)
    _check_token_dtype(tokens, op)
    if isinstance(num_out_tokens, torch.Tensor):
        raise TypeError(f"{op}: the second argument is num_out_tokens (an int), got a tensor "
                        f"{tuple(num_out_tokens.shape)}: pass the [T, E] map as routing_map=..., or top-k indices "
                        f"to moe_permute(tokens, indices, num_experts=E)")
    if topk_indices is not None:
        raise NotImplementedError(f"{op}: topk_indices is not supported (the expert count is not known from "
                                  f"them): pass routing_map, or use moe_permute(tokens, indices, num_experts=E)")
    if routing_map is None:
        raise ValueError(f"{op}: routing_map [T, num_experts] is required")
    t = tokens.shape[0]
    mask = _routing_mask(routing_map, t, op, tokens, "tokens")
    e = mask.shape[1]
    if num_out_tokens is not None and (isinstance(num_out_tokens, bool) or not isinstance(num_out_tokens, int)):
        raise TypeError(f"{op}: num_out_tokens must be an int or None, got {type(num_out_tokens).__name__}")
    n = None if num_out_tokens is None or num_out_tokens < 0 else int(num_out_tokens)
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (t, e):
            raise ValueError(f"{op}: probs must be [T={t}, E={e}] like routing_map, got {_shape_or_type(probs)}")
        if not probs.dtype.is_floating_point:
            raise TypeError(f"{op}: probs must be floating point, got {probs.dtype}")
        _check_device(probs, "probs", tokens, "tokens", op)
    if drop_and_pad:
        if n is None or n % e:
            raise ValueError(f"{op}: drop_and_pad needs num_out_tokens = num_experts * capacity (a multiple of "
                             f"E={e}), got {num_out_tokens!r}")
        cap = n // e
        sorted_indices = _drop_and_pad_rows(mask, cap)
        permuted = tokens.index_select(0, sorted_indices)
        pprobs = None
        if probs is not None:
            expert = torch.arange(e, device=tokens.device).repeat_interleave(cap)
            pprobs = probs[sorted_indices, expert]
        tpe = torch.full((e,), cap, dtype=torch.int64, device=tokens.device)
        return permuted, pprobs, sorted_indices, tpe
    permuted, pprobs, rid, _ps, tpe, _total = _permute_core(tokens, mask, probs, e, n, None, None)
    if fused:
        return permuted, pprobs, rid, tpe
    # the token of each row (-1 on rows past the routed ones): Megatron's sorted_indices
    n_out = permuted.shape[0]
    tok = torch.arange(t, device=tokens.device).unsqueeze(1).expand(t, e)
    src = torch.full((n_out + 1,), -1, dtype=torch.int64, device=tokens.device)
    src.scatter_(0, torch.where(rid >= 0, rid.long(), n_out).reshape(-1), tok.reshape(-1))
    return permuted, pprobs, src[:n_out], tpe


def token_unpermute(inp: torch.Tensor, sorted_indices: torch.Tensor,
                    merging_probs: Optional[torch.Tensor] = None, restore_shape: Optional[Sequence[int]] = None,
                    routing_map: Optional[torch.Tensor] = None, fused: bool = False,
                    drop_and_pad: bool = False) -> torch.Tensor:
    """Megatron's mask-based ``unpermute`` (Primus-Turbo's ``token_unpermute``); see the module docstring.

    ``inp``: the permuted tokens ``[N, H]`` (Primus-Turbo's parameter name; error messages call it
    ``permuted_tokens``)."""
    op = "token_unpermute"
    permuted_tokens = inp
    _check_tokens(permuted_tokens, op, "permuted_tokens")
    if permuted_tokens.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: permuted_tokens must be bf16/fp16/fp32, got {permuted_tokens.dtype}")
    n, h = permuted_tokens.shape
    if not isinstance(sorted_indices, torch.Tensor) or sorted_indices.dtype not in (torch.int32, torch.int64) \
            or sorted_indices.dim() not in (1, 2) or (sorted_indices.dim() == 1 and sorted_indices.numel() != n):
        raise ValueError(f"{op}: sorted_indices must be what token_permute returned: 1-D token ids, one per "
                         f"permuted row ({n}), or the int32 [T, E] row map of fused=True; got "
                         f"{_shape_or_type(sorted_indices)}")
    _check_device(sorted_indices, "sorted_indices", permuted_tokens, "permuted_tokens", op)
    is_map = sorted_indices.dim() == 2
    if is_map and drop_and_pad:
        raise ValueError(f"{op}: drop_and_pad rows come as token ids (1-D sorted_indices), got the [T, E] row map")
    if restore_shape is not None:
        restore_shape = _shape_arg(restore_shape, op)
        t = math.prod(restore_shape[:-1])
        if not restore_shape or restore_shape[-1] != h:
            raise ValueError(f"{op}: restore_shape {list(restore_shape)} must end in hidden {h}")
    elif is_map:
        t = sorted_indices.shape[0]
    elif routing_map is not None and isinstance(routing_map, torch.Tensor) and routing_map.dim() == 2:
        t = routing_map.shape[0]
    else:
        raise ValueError(f"{op}: restore_shape (or routing_map / the fused row map) is needed for the token count")
    if is_map and sorted_indices.shape[0] != t:
        raise ValueError(f"{op}: the row map has {sorted_indices.shape[0]} tokens, restore_shape {t}")
    mask = _routing_mask(routing_map, t, op, permuted_tokens, "permuted_tokens") if routing_map is not None else None
    if merging_probs is not None:
        if not isinstance(merging_probs, torch.Tensor) or merging_probs.dim() != 2 or merging_probs.shape[0] != t:
            raise ValueError(f"{op}: merging_probs must be [T={t}, num_experts], got {_shape_or_type(merging_probs)}")
        if not merging_probs.dtype.is_floating_point:
            raise TypeError(f"{op}: merging_probs must be floating point, got {merging_probs.dtype}")
        _check_device(merging_probs, "merging_probs", permuted_tokens, "permuted_tokens", op)
        if not is_map and mask is None:
            raise ValueError(f"{op}: merging_probs needs routing_map (which expert each row belongs to)")
    if mask is not None:
        # what the shapes tell without reading data: the routing map must be the one the rows were
        # permuted with (same expert count)
        e = mask.shape[1]
        if is_map and tuple(mask.shape) != tuple(sorted_indices.shape):
            raise ValueError(f"{op}: routing_map {list(mask.shape)} does not match the row map "
                             f"{list(sorted_indices.shape)} token_permute(fused=True) returned: unpermute with "
                             f"the routing map (expert count) the tokens were permuted with")
        if merging_probs is not None and merging_probs.shape[1] != e:
            raise ValueError(f"{op}: merging_probs has {merging_probs.shape[1]} experts, routing_map {e}")
        if drop_and_pad and n % e:
            raise ValueError(f"{op}: drop_and_pad rows ({n}) must be num_experts ({e}, routing_map's columns) x "
                             f"capacity: the rows were permuted with another expert count")
    if is_map:
        if merging_probs is not None and merging_probs.shape != sorted_indices.shape:
            raise ValueError(f"{op}: merging_probs {list(merging_probs.shape)} must match the row map "
                             f"{list(sorted_indices.shape)}")
        rid = sorted_indices.to(torch.int32).contiguous()
        _check_rows_fit(rid, n, op, "the row map (sorted_indices)")
    elif mask is not None and not drop_and_pad:
        rid = _map_rows(mask, n)
        if n:
            # CPU: the rows routing_map places must be the rows sorted_indices names (same map, same
            # expert count); on CUDA this would need a sync, and a different map merges other rows
            def same_rows():
                r = rid.long()
                ok = r >= 0
                tok = torch.arange(t, device=r.device).unsqueeze(1)
                hit = torch.where(ok, sorted_indices.long()[torch.where(ok, r, 0)] == tok, True)
                return hit.all() & (ok.sum() == (sorted_indices >= 0).sum())
            _cpu_assert(rid, same_rows, f"{op}: sorted_indices do not match routing_map [{t}, {e}]: the tokens were "
                                        f"permuted with another routing map (expert count)")
    else:
        # token ids alone (no map) or drop-and-pad rows: fp32 sums by token id (atomic adds on CUDA)
        ids = sorted_indices.long()
        if n:
            _cpu_assert(ids, lambda: ids.max() < t, f"{op}: sorted_indices holds a token id >= {t}, the tokens of "
                                                    f"restore_shape {list(restore_shape or (t, h))}")
        ok = (ids >= 0) & (ids < t)   # CUDA: ids past the tokens are dropped, never indexed
        ids = torch.where(ok, ids, 0)
        rows = permuted_tokens.float()
        if drop_and_pad and merging_probs is not None:
            e = merging_probs.shape[1]
            if n % e:
                raise ValueError(f"{op}: drop_and_pad rows ({n}) must be num_experts ({e}) x capacity")
            expert = torch.arange(e, device=rows.device).repeat_interleave(n // e)
            rows = rows * merging_probs[ids, expert].float().unsqueeze(1)
        out = torch.zeros(t, h, dtype=torch.float32, device=rows.device)
        out = out.index_add(0, ids, torch.where(ok.unsqueeze(1), rows, 0.0))
        out = out.to(permuted_tokens.dtype)
        return out.reshape(restore_shape) if restore_shape is not None else out
    out = _UnpermuteFn.apply(permuted_tokens, rid,
                             merging_probs.contiguous() if merging_probs is not None else None)
    return out.reshape(restore_shape) if restore_shape is not None else out


# ----------------------------------------------------------------------------------------------
# Primus-Turbo form
# ----------------------------------------------------------------------------------------------
def _positive_int(v, name: str, op: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")
    return v


def _moe_permute_primus(tokens, routing_map, expert_map, topk_indices, e, num_topk, pad_multiple,
                        num_permuted_tokens, scaling_factor, probs, probs_layout, scales_per_token, use_fp8):
    """``moe_permute`` with ``num_local_experts`` (module docstring, "Primus-Turbo form")."""
    op = "moe_permute"
    _check_tokens(tokens, op)
    _check_token_dtype(tokens, op)
    given = [(n, v) for n, v in (("expert_map", expert_map), ("routing_map", routing_map),
                                 ("topk_indices", topk_indices)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"{op}: pass exactly one of expert_map / routing_map / topk_indices, got "
                         f"{[n for n, _ in given] or 'none'}")
    name, emap = given[0]
    # the second positional argument (the routing map slot of the other form) is Primus-Turbo's
    # expert_map: a bool map or top-k indices, told apart by dtype
    name = "topk_indices" if name == "topk_indices" else "expert_map"
    e = _positive_int(e, "num_local_experts", op)
    num_topk = _int_arg(num_topk, "num_topk", op, 0)
    cap = _int_arg(num_permuted_tokens, "num_permuted_tokens", op, -1)
    if probs_layout not in ("topk", "routing_map"):
        raise ValueError(f"{op}: probs_layout must be 'topk' or 'routing_map', got {probs_layout!r}")
    t = tokens.shape[0]
    if not isinstance(emap, torch.Tensor) or emap.dim() != 2 or emap.shape[0] != t:
        raise ValueError(f"{op}: {name} must be a bool [T, num_local_experts] map or int32/int64 [T, topk] "
                         f"indices with T={t}, got {_shape_or_type(emap)}")
    _check_device(emap, name, tokens, "tokens", op)
    is_map = emap.dtype == torch.bool
    if is_map:
        if name == "topk_indices":
            raise TypeError(f"{op}: topk_indices must be int32/int64, got {emap.dtype}")
        if emap.shape[1] != e:
            raise ValueError(f"{op}: {name} has {emap.shape[1]} columns, num_local_experts={e}")
    elif emap.dtype in (torch.int32, torch.int64):
        k = emap.shape[1]
        if num_topk not in (0, emap.shape[1]):
            raise ValueError(f"{op}: num_topk={num_topk} but {name} has {emap.shape[1]} columns")
    else:
        raise TypeError(f"{op}: {name} must be bool or int32/int64, got {emap.dtype}")
    if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, (int, type(None))) or (pad_multiple or 0) < 0:
        raise ValueError(f"{op}: pad_multiple must be an int >= 0, got {pad_multiple!r}")
    pad = int(pad_multiple) if pad_multiple and pad_multiple > 1 else None
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or not probs.dtype.is_floating_point:
            raise TypeError(f"{op}: probs must be a floating-point tensor, got "
                            f"{getattr(probs, 'dtype', type(probs).__name__)}")
        _check_device(probs, "probs", tokens, "tokens", op)
        if probs_layout == "topk" and is_map:
            raise ValueError(f"{op}: probs_layout='topk' needs top-k indices as the expert map (a bool routing "
                             f"map has no top-k order); pass probs [T, {e}] with probs_layout='routing_map'")
        want = (t, emap.shape[1]) if probs_layout == "topk" else (t, e)
        if tuple(probs.shape) != want:
            raise ValueError(f"{op}: probs with probs_layout={probs_layout!r} must be {list(want)}, got "
                             f"{list(probs.shape)}")
        if not is_map and probs_layout == "routing_map":
            probs = probs.gather(1, emap.long().clamp(0, e - 1))   # each slot's prob (-1 slots: unused)
    scales = None
    if scaling_factor is not None:
        if not use_fp8:
            raise ValueError(f"{op}: scaling_factor is moved with the tokens only with use_fp8=True")
        if isinstance(scales_per_token, bool) or not isinstance(scales_per_token, int) or scales_per_token <= 0:
            raise ValueError(f"{op}: use_fp8 with a scaling_factor needs scales_per_token > 0, got "
                             f"{scales_per_token!r}")
        if not isinstance(scaling_factor, torch.Tensor) or scaling_factor.numel() != t * scales_per_token \
                or scaling_factor.shape[0] != t:
            raise ValueError(f"{op}: scaling_factor must be [T={t}, scales_per_token={scales_per_token}], got "
                             f"{_shape_or_type(scaling_factor)}")
        _check_device(scaling_factor, "scaling_factor", tokens, "tokens", op)
        scales = scaling_factor.reshape(t, scales_per_token)
    if use_fp8 and tokens.element_size() != 1:
        raise TypeError(f"{op}: use_fp8=True needs 1-byte FP8 tokens, got {tokens.dtype}")
    if use_fp8 and probs is not None and probs.requires_grad:
        raise TypeError(f"{op}: use_fp8=True moves FP8 tokens as data only; probs cannot require grad there")
    permuted, pprobs, rid, pscales, seg, total = _permute_core(tokens, emap, probs, e, cap if cap > 0 else None,
                                                               pad, scales, full_map=not is_map)
    dev = tokens.device
    if cap > 0:
        overflow = (total > cap).to(torch.int32)
    else:
        overflow = torch.zeros(1, dtype=torch.int32, device=dev)
    num_dispatched = torch.full((1,), t, dtype=torch.int32, device=dev)
    return permuted, rid, seg, overflow, num_dispatched, pscales, pprobs


def _moe_unpermute_primus(permuted_tokens, row_id_map, num_dispatched_tokens_tensor, restore_shape, e,
                          permuted_probs, probs_topk_stride):
    """``moe_unpermute`` with ``num_local_experts`` (module docstring, "Primus-Turbo form")."""
    op = "moe_unpermute"
    _check_tokens(permuted_tokens, op, "permuted_tokens")
    if permuted_tokens.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: permuted_tokens must be bf16/fp16/fp32, got {permuted_tokens.dtype}")
    e = _positive_int(e, "num_local_experts", op)
    if not isinstance(row_id_map, torch.Tensor) or row_id_map.dim() != 2 or row_id_map.dtype != torch.int32 \
            or row_id_map.shape[1] < e:
        raise ValueError(f"{op}: row_id_map must be the int32 map moe_permute returned with num_local_experts="
                         f"{e} ([T, {e}] or [T, {e} + 1 + topk]), got {_shape_or_type(row_id_map)}"
                         f"{' ' + str(row_id_map.dtype) if isinstance(row_id_map, torch.Tensor) else ''}")
    _check_device(row_id_map, "row_id_map", permuted_tokens, "permuted_tokens", op)
    if num_dispatched_tokens_tensor is not None and not isinstance(num_dispatched_tokens_tensor, torch.Tensor):
        raise TypeError(f"{op}: num_dispatched_tokens_tensor must be the tensor moe_permute returned, got "
                        f"{type(num_dispatched_tokens_tensor).__name__}")
    t, w = row_id_map.shape
    k = w - e - 1 if w > e else 0          # top-k slots of an indices-form map ([T, E + 1 + k])
    if w != e and k < 1:
        raise ValueError(f"{op}: row_id_map has {w} columns: moe_permute with num_local_experts={e} gives {e} "
                         f"(routing map) or {e} + 1 + topk (top-k indices)")
    h = permuted_tokens.shape[1]
    if restore_shape is None:
        raise ValueError(f"{op}: restore_shape (the dispatched tokens' shape) is required with num_local_experts")
    restore_shape = _restore_shape(restore_shape, t, h, op)
    if permuted_probs is not None:
        if not isinstance(permuted_probs, torch.Tensor) or permuted_probs.dim() != 1 \
                or permuted_probs.shape[0] != permuted_tokens.shape[0]:
            raise ValueError(f"{op}: permuted_probs must be 1-D with one entry per permuted row "
                             f"({permuted_tokens.shape[0]}), got {_shape_or_type(permuted_probs)}")
        _check_device(permuted_probs, "permuted_probs", permuted_tokens, "permuted_tokens", op)
        if probs_topk_stride and probs_topk_stride != k:
            raise ValueError(f"{op}: probs_topk_stride={probs_topk_stride} but row_id_map holds "
                             f"{'no top-k indices (a routing-map permute)' if k == 0 else f'top-{k} indices'}")
    # a map built for more rows than permuted_tokens holds (CPU: checked; CUDA: those entries are not
    # routed, the merge never reads past the rows)
    _check_rows_fit(row_id_map[:, :e + 1], permuted_tokens.shape[0], op)
    # the map the merge walks: each slot's row (top-k form) or each local expert's (routing map)
    if k:
        cols = row_id_map[:, e + 1:].long()
        col_ok = (cols >= 0) & (cols <= e)
        _cpu_assert(cols, lambda: col_ok.all(), f"{op}: row_id_map's slot columns (after column {e}) must be in "
                    f"[0, num_local_experts={e}]: not a map moe_permute returned")
        slots = row_id_map.gather(1, torch.where(col_ok, cols, e))   # CUDA: a bad column reads the spare -1
    else:
        slots = row_id_map
    out = _UnpermuteFn.apply(permuted_tokens, slots, None).reshape(restore_shape)
    if permuted_probs is None:
        return out, None
    r = slots if probs_topk_stride else row_id_map[:, :e]
    # differentiable, also with no permuted rows: entries -1 (or past the rows) read a zero appended
    n = permuted_probs.shape[0]
    padded = torch.cat([permuted_probs, permuted_probs.new_zeros(1)])
    return out, padded[torch.where((r >= 0) & (r < n), r.long(), n)]
