"""Plain-PyTorch references for MoE token permutation (per-expert loops; differentiable).

``moe_permute_ref`` returns ``(permuted_tokens, permuted_probs, row_id_map, tokens_per_expert)``
(plus ``permuted_scales`` through ``scales=``) with the semantics of ``turbo.ops.moe_permute``;
``moe_unpermute_ref`` accumulates in fp32 in ascending column order of ``row_id_map``;
``token_permute_ref`` / ``token_unpermute_ref`` follow Megatron's ``moe_utils.permute/unpermute``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["moe_permute_ref", "moe_unpermute_ref", "token_permute_ref", "token_unpermute_ref"]


def _mask(routing_map: torch.Tensor, num_experts: Optional[int]) -> torch.Tensor:
    if routing_map.dtype == torch.bool:
        return routing_map
    t, k = routing_map.shape
    mask = torch.zeros(t, num_experts, dtype=torch.bool, device=routing_map.device)
    for j in range(k):
        mask[torch.arange(t), routing_map[:, j].long()] = True
    return mask


def moe_permute_ref(tokens, routing_map, probs=None, num_out_tokens=None, pad_multiple=None, scales=None,
                    num_experts=None):
    """Returns (permuted_tokens, permuted_probs, row_id_map, tokens_per_expert[, permuted_scales])."""
    t, h = tokens.shape
    mask = _mask(routing_map, num_experts)
    e = mask.shape[1]
    is_map = routing_map.dtype == torch.bool
    dest_te = torch.full((t, e), -1, dtype=torch.int64)
    src_pairs: list[tuple[int, int]] = []  # (token, j) per output row; (-1, -1) for padding
    seg = []
    for ex in range(e):
        toks = torch.nonzero(mask[:, ex].cpu()).flatten().tolist()
        n = len(toks)
        if pad_multiple:
            n = -(-n // pad_multiple) * pad_multiple
        seg.append(n)
        for tok in toks:
            dest_te[tok, ex] = len(src_pairs)
            if is_map:
                j = ex
            else:
                j = int(torch.nonzero(routing_map[tok].cpu() == ex).flatten()[0])
            src_pairs.append((tok, j))
        src_pairs.extend([(-1, -1)] * (n - len(toks)))
    n_out = len(src_pairs) if num_out_tokens is None else int(num_out_tokens)
    src_pairs = (src_pairs + [(-1, -1)] * max(0, n_out - len(src_pairs)))[:n_out]
    dest_te[dest_te >= n_out] = -1
    if is_map:
        row_id_map = dest_te
    else:
        row_id_map = dest_te.gather(1, routing_map.cpu().long())
    zero_row = torch.zeros(1, h, dtype=tokens.dtype, device=tokens.device)
    rows = [tokens[tok:tok + 1] if tok >= 0 else zero_row for tok, _ in src_pairs]
    permuted = torch.cat(rows, 0) if rows else tokens[:0]
    pprobs = None
    if probs is not None:
        z = torch.zeros((), dtype=probs.dtype, device=probs.device)
        vals = [probs[tok, j] if tok >= 0 else z for tok, j in src_pairs]
        pprobs = torch.stack(vals) if vals else probs.reshape(-1)[:0]
    out = [permuted, pprobs, row_id_map.to(torch.int32).to(tokens.device),
           torch.tensor(seg, dtype=torch.int64, device=tokens.device)]
    if scales is not None:
        s2 = scales.reshape(t, -1)
        zs = torch.zeros(1, s2.shape[1], dtype=s2.dtype, device=s2.device)
        srows = [s2[tok:tok + 1] if tok >= 0 else zs for tok, _ in src_pairs]
        ps = torch.cat(srows, 0) if srows else s2[:0]
        out.append(ps.reshape(-1) if scales.dim() == 1 else ps)
    return tuple(out)


def moe_unpermute_ref(permuted_tokens, row_id_map, merging_probs=None,
                      restore_shape: Optional[Sequence[int]] = None):
    t, k = row_id_map.shape
    h = permuted_tokens.shape[1]
    acc = torch.zeros(t, h, dtype=torch.float32, device=permuted_tokens.device)
    for j in range(k):
        r = row_id_map[:, j].long()
        ok = (r >= 0)[:, None]
        x = permuted_tokens[r.clamp(min=0)].float()
        if merging_probs is not None:
            x = x * merging_probs[:, j].float()[:, None]
        acc = acc + torch.where(ok, x, torch.zeros_like(x))
    out = acc.to(permuted_tokens.dtype)
    return out.reshape(tuple(restore_shape)) if restore_shape is not None else out


def token_permute_ref(tokens, indices, num_out_tokens=None):
    """Megatron ``permute``: stable argsort of the flattened indices."""
    if indices.dim() == 1:
        indices = indices[:, None]
    topk = indices.shape[1]
    flat = indices.reshape(-1)
    sorted_indices = torch.argsort(flat, stable=True)
    if num_out_tokens is not None:
        sorted_indices = sorted_indices[:num_out_tokens]
    return tokens.index_select(0, sorted_indices // topk), sorted_indices


def token_unpermute_ref(permuted_tokens, sorted_indices, probs=None, restore_shape=None):
    """Megatron ``unpermute``: index_copy back, weight by probs (fp32), sum over top-k."""
    if probs is not None:
        if probs.dim() == 1:
            probs = probs[:, None]
        n, topk = probs.numel(), probs.shape[1]
    elif restore_shape is not None:
        t = 1
        for d in tuple(restore_shape)[:-1]:
            t *= int(d)
        n, topk = permuted_tokens.shape[0], max(1, permuted_tokens.shape[0] // max(t, 1))
        n = t * topk
    else:
        n, topk = permuted_tokens.shape[0], 1
    h = permuted_tokens.shape[1]
    un = torch.zeros(n, h, dtype=torch.float32, device=permuted_tokens.device)
    un = un.index_copy(0, sorted_indices, permuted_tokens.float()).reshape(-1, topk, h)
    if probs is not None:
        un = un * probs.float().unsqueeze(-1)
    out = un.sum(1).to(permuted_tokens.dtype)
    return out.reshape(tuple(restore_shape)) if restore_shape is not None else out
