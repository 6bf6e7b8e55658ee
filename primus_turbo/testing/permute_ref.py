"""Plain-PyTorch references for MoE token permutation (per-expert loops; differentiable).

``moe_permute_ref`` returns ``(permuted_tokens, permuted_probs, row_id_map, tokens_per_expert)``
(plus ``permuted_scales`` through ``scales=``) with the semantics of ``turbo.ops.moe_permute`` (top-k
index ``-1``: the slot is not routed, ``row_id_map`` ``-1``);
``moe_unpermute_ref`` accumulates in fp32 in ascending column order of ``row_id_map``;
``token_permute_ref`` / ``token_unpermute_ref`` follow Megatron's mask-based ``moe_utils.permute/unpermute``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["moe_permute_ref", "moe_unpermute_ref", "token_permute_ref", "token_unpermute_ref"]


def _mask(routing_map: torch.Tensor, num_experts: Optional[int]) -> torch.Tensor:
    """The bool ``[T, E]`` map; top-k indices outside ``[0, E)`` (``-1``: the slot is not routed) set
    nothing (not Python's negative indexing, which would route ``-1`` to the last expert)."""
    if routing_map.dtype == torch.bool:
        return routing_map
    t, k = routing_map.shape
    mask = torch.zeros(t, num_experts, dtype=torch.bool, device=routing_map.device)
    for j in range(k):
        idx = routing_map[:, j].long()
        ok = (idx >= 0) & (idx < num_experts)
        mask[torch.arange(t, device=idx.device)[ok], idx[ok]] = True
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
    else:  # slots outside [0, E) read the spare column E (-1: no row)
        idx = routing_map.cpu().long()
        idx = torch.where((idx >= 0) & (idx < e), idx, e)
        row_id_map = torch.cat([dest_te, dest_te.new_full((t, 1), -1)], 1).gather(1, idx)
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


def _token_rows(mask: torch.Tensor, num_out_tokens: Optional[int], drop_and_pad: bool):
    """(token id, expert) of every output row of Megatron's mask-based ``permute`` (-1 on tail rows)."""
    t, e = mask.shape
    toks, exps = [], []
    if drop_and_pad:
        cap = num_out_tokens // e
        for j in range(e):
            col = mask[:, j].tolist()
            order = [i for i in range(t) if col[i]] + [i for i in range(t) if not col[i]]
            toks += order[:cap]
            exps += [j] * cap
    else:
        for j in range(e):
            col = mask[:, j].tolist()
            sel = [i for i in range(t) if col[i]]
            toks += sel
            exps += [j] * len(sel)
        n = len(toks) if num_out_tokens is None or num_out_tokens < 0 else num_out_tokens
        toks, exps = (toks + [-1] * n)[:n], (exps + [-1] * n)[:n]
    return torch.tensor(toks, dtype=torch.long), torch.tensor(exps, dtype=torch.long)


def token_permute_ref(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):
    """Megatron's mask-based ``permute``: rows expert-major, tokens in order within an expert (drop-and-pad:
    each expert's routed then unrouted tokens cut to ``num_out_tokens // E``). Returns ``(permuted,
    permuted_probs, sorted_indices, tokens_per_expert)``; rows past the routed ones are zero (id -1)."""
    mask = routing_map.bool().cpu()
    toks, exps = _token_rows(mask, num_out_tokens, drop_and_pad)
    ok = toks >= 0
    dev = tokens.device
    out = torch.zeros(toks.numel(), tokens.shape[1], dtype=tokens.dtype, device=dev)
    out[ok.to(dev)] = tokens[toks[ok].to(dev)]
    pprobs = None
    if probs is not None:
        pprobs = torch.zeros(toks.numel(), dtype=probs.dtype, device=dev)
        pprobs[ok.to(dev)] = probs[toks[ok].to(dev), exps[ok].to(dev)]
    tpe = torch.bincount(exps[ok], minlength=mask.shape[1])
    return out, pprobs, toks.to(dev), tpe.to(dev)


def token_unpermute_ref(permuted_tokens, routing_map, merging_probs=None, num_tokens=None, drop_and_pad=False):
    """Megatron's mask-based ``unpermute``: each row (times its token's prob for its expert) summed
    back into its token, fp64 accumulation, cast to the rows' dtype."""
    mask = routing_map.bool().cpu()
    t = mask.shape[0] if num_tokens is None else num_tokens
    toks, exps = _token_rows(mask, permuted_tokens.shape[0], drop_and_pad)
    x = permuted_tokens.detach().cpu().double()
    out = torch.zeros(t, x.shape[1], dtype=torch.float64)
    for r in range(toks.numel()):
        if toks[r] < 0:
            continue
        w = 1.0 if merging_probs is None else float(merging_probs[toks[r], exps[r]])
        out[toks[r]] += w * x[r]
    return out.to(permuted_tokens.dtype).to(permuted_tokens.device)
