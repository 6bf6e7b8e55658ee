"""MoE token permutation: ``turbo.ops.moe_permute`` / ``moe_unpermute`` and the Megatron-style
``token_permute`` / ``token_unpermute``.

moe_permute(tokens, routing_map, probs=None, num_out_tokens=None, pad_multiple=None, scales=None,
            *, num_experts=None, return_tokens_per_expert=False)
    -> (permuted_tokens, permuted_probs, row_id_map[, permuted_scales][, tokens_per_expert])

``routing_map`` is either the bool multi-hot map ``[T, E]`` or top-k expert indices ``[T, k]``
(int32 / int64, values in ``[0, E)``, distinct within a row; ``num_experts=E`` is then required).
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
    ``merging_probs``.

Backward: permute's token grad is unpermute of the output grad without probs; the probs grad is
the output-probs grad gathered back. Unpermute's grad is the (probs-weighted) permute of the output
grad; the merging-probs grad is ``<permuted_tokens[row], grad_out[t]>`` (fp32).

token_permute(tokens, indices, num_out_tokens=None) -> (permuted_tokens, sorted_indices)
token_unpermute(permuted_tokens, sorted_indices, probs=None, restore_shape=None) -> tokens
    Megatron ``moe_utils.permute/unpermute`` (argsort form): ``sorted_indices`` = stable argsort of the
    flattened ``[T, k]`` indices (optionally cut to ``num_out_tokens``), ``permuted[i] =
    tokens[sorted_indices[i] // k]``; unpermute scatters the rows back to ``[T*k, H]``, weights by
    ``probs [T, k]`` (fp32 math) and sums over ``k``. Without ``probs``, ``k = 1`` unless
    ``restore_shape`` gives ``T`` (then ``k = numel(sorted_indices)//T`` is not inferable when rows
    were dropped: pass probs). Both differentiable.

Backend: Triton kernels (primus_turbo/triton/moe) on CUDA and on CPU under the Triton interpreter;
plain PyTorch indexing elsewhere. On the Triton backend ``moe_permute`` can build the row map, its
inverse and ``tokens_per_expert`` with three kernels (count, scan, assign: see
``primus_turbo/triton/moe/permute_kernel.py``): a handful of allocations and four launches per call
instead of ~35 small torch ops, so small problems are not host-bound. ``PRIMUS_TURBO_PERMUTE_FUSED_MAP``
chooses (default: :func:`auto_fused_map`, from H200 measurements). Token rows and probs move in
one gather launch either way.
The torch backend builds the map with torch ops (``_build_row_id_map`` / ``_inverse``, also the
reference of the kernel tests). Neither reads anything back to the host except the documented
``num_out_tokens=None`` sync.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from primus_turbo.triton import is_interpreter, triton_available

__all__ = ["moe_permute", "moe_unpermute", "token_permute", "token_unpermute", "permute_backend"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


#: auto on CUDA: top-k indices with at most this many routed rows take the map kernels (H200: the
#: 4096x4096 top-2 case runs ~2x faster with them; 16384 tokens top-8 (131072 rows) 1.35x slower)
FUSED_MAP_MAX_INDEX_ROWS = 32768


def auto_fused_map(on_cuda: bool, is_map: bool, routed_rows: int) -> bool:
    """The ``auto`` choice of :func:`_fused_map`: always on CPU (the interpreter, so CI runs the
    kernels); on CUDA for a bool routing map (faster at both measured sizes) and for top-k indices
    up to :data:`FUSED_MAP_MAX_INDEX_ROWS` routed rows."""
    return (not on_cuda) or is_map or routed_rows <= FUSED_MAP_MAX_INDEX_ROWS


def _fused_map(x: torch.Tensor, is_map: bool, routed_rows: int) -> bool:
    """Build the row map with the Triton kernels? (PRIMUS_TURBO_PERMUTE_FUSED_MAP, docs/env_vars.md)"""
    if permute_backend(x) != "triton":
        return False
    from ..core.env import env_auto_flag

    choice = env_auto_flag("PRIMUS_TURBO_PERMUTE_FUSED_MAP")
    return auto_fused_map(x.is_cuda, is_map, routed_rows) if choice is None else choice


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
    for j in range(k):
        r = row_id_map[:, j].long()
        ok = r >= 0
        x = src[r.clamp(min=0)].float()
        if weights is not None:
            x = x * weights[:, j].float()[:, None]
        acc += torch.where(ok[:, None], x, torch.zeros((), device=src.device))
    return acc.to(src.dtype)


def _inverse(row_id_map: torch.Tensor, n_out: int) -> torch.Tensor:
    """``src_idx[o]`` = flat index ``t*K + j`` of the pair in row ``o``, ``-1`` for rows nobody fills."""
    flat = row_id_map.reshape(-1).long()
    pos = torch.arange(flat.numel(), device=flat.device)
    # unrouted pairs (-1) go to distinct slots past n_out: one shared dump slot would make
    # every such write (most of a [T, E] map) collide on one address
    dest = torch.where(flat >= 0, flat, n_out + pos)
    src_idx = torch.full((n_out + flat.numel(),), -1, dtype=torch.int64, device=flat.device)
    src_idx.scatter_(0, dest, pos)
    return src_idx[:n_out]


def _gather_flat(values: torch.Tensor, src_idx: torch.Tensor) -> torch.Tensor:
    """``values.flatten()[src_idx]``, 0 where ``src_idx < 0``."""
    v = values.reshape(-1)[src_idx.clamp(min=0)]
    return torch.where(src_idx >= 0, v, torch.zeros((), dtype=v.dtype, device=v.device))


def _scatter_back(per_row: torch.Tensor, row_id_map: torch.Tensor) -> torch.Tensor:
    """``out[t, j] = per_row[row_id_map[t, j]]``, 0 where the entry is ``-1``."""
    r = row_id_map.long()
    if per_row.numel() == 0:
        return torch.zeros(r.shape, dtype=per_row.dtype, device=per_row.device)
    v = per_row[r.clamp(min=0)]
    return torch.where(r >= 0, v, torch.zeros((), dtype=v.dtype, device=v.device))


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------
def _permute_rows(tokens: torch.Tensor, probs: Optional[torch.Tensor], src_idx: torch.Tensor, k: int,
                  row_id_map: torch.Tensor):
    """``(tokens[src_idx // k], probs.flatten()[src_idx])``, zero where ``src_idx < 0`` (one launch on Triton:
    token-major, each token row read once and written to its ``row_id_map`` rows)."""
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
        k = row_id_map.shape[1]
        n_out = permuted.shape[0]
        src_idx = _inverse(row_id_map, n_out)
        need_perm = ctx.needs_input_grad[0]
        need_probs = probs is not None and ctx.needs_input_grad[2]
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
                return g_perm, None, None
            # weighted rows and the probs-gradient dots in one row-major pass (each output row reads its
            # token's grad row and its own permuted row)
            g_perm, dots = unpermute_bwd_launch(g_out.contiguous(), permuted.contiguous(), src_idx, k, probs,
                                                need_perm, need_probs)
            g_probs = _scatter_back(dots, row_id_map).to(probs.dtype) if need_probs else None
            return g_perm, None, g_probs
        src_tok = torch.where(src_idx >= 0, src_idx // k, src_idx)
        g_perm = g_probs = None
        w = _gather_flat(probs, src_idx).float() if probs is not None else None
        if ctx.needs_input_grad[0]:
            if w is None:
                g_perm = _gather_rows(g_out, src_tok, out_dtype=permuted.dtype)
            else:
                g_perm = _gather_rows(g_out, src_tok, scale=w, out_dtype=permuted.dtype)
        if probs is not None and ctx.needs_input_grad[2]:
            g_rows = _gather_rows(g_out, src_tok)  # [n_out, H], zero on unfilled rows
            dots = (g_rows.float() * permuted.float()).sum(-1)
            g_probs = _scatter_back(dots, row_id_map).to(probs.dtype)
        return g_perm, None, g_probs


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _shape_or_type(x):
    """What an error message reports of an argument: a tensor's shape, else its type's name."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_tokens(tokens: torch.Tensor, op: str, name: str = "tokens") -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"{op}: {name} must be a 2-D tensor [T, H], got {_shape_or_type(tokens)}")


def _check_device(t: Optional[torch.Tensor], name: str, ref: torch.Tensor, ref_name: str, op: str) -> None:
    if isinstance(t, torch.Tensor) and t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device}, {ref_name} on {ref.device}; they must share a device")


def _build_row_id_map(routing_map, num_experts, pad_multiple, num_out_tokens):
    """Device-only map building; returns (row_id_map int32 [T, K], segment lengths [E], total rows or None).

    The running count of each expert's tokens is a scan over tokens. It is done on the
    expert-major [E, T] copy of the mask: torch scans the innermost dimension with all threads
    of a block, while a scan over dim 0 of [T, E] runs one sequential thread per expert column
    (milliseconds at T = 16384)."""
    device = routing_map.device
    t = routing_map.shape[0]
    if routing_map.dtype == torch.bool:
        mask_t = routing_map.t()
    else:
        mask_t = torch.zeros(num_experts, t, dtype=torch.bool, device=device)
        mask_t.scatter_(0, routing_map.t().long(), True)
    m = mask_t.to(torch.int32)                          # [E, T]
    rank = torch.cumsum(m, 1, dtype=torch.int32) - m    # routed tokens of e before t
    counts = m.sum(1, dtype=torch.int32)                # [E]
    seg = (counts + pad_multiple - 1) // pad_multiple * pad_multiple if pad_multiple else counts
    starts = torch.cumsum(seg, 0, dtype=torch.int32) - seg
    dest = torch.where(mask_t, starts[:, None] + rank, -1)  # [E, T]
    if routing_map.dtype != torch.bool:
        dest = dest.gather(0, routing_map.t().long())   # [K, T]
    if num_out_tokens is None:
        num_out_tokens = int(seg.sum())                 # host sync (documented)
    dest = torch.where(dest < num_out_tokens, dest, -1)
    # segments cut by a short num_out_tokens: the lengths count the rows actually in the buffer
    seg = torch.minimum(seg, (num_out_tokens - starts).clamp(min=0))
    return dest.t().contiguous(), seg.to(torch.int64), num_out_tokens


def moe_permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None,
                num_out_tokens: Optional[int] = None, pad_multiple: Optional[int] = None,
                scales: Optional[torch.Tensor] = None, *, num_experts: Optional[int] = None,
                return_tokens_per_expert: bool = False):
    """Group tokens by expert (see the module docstring)."""
    op = "moe_permute"
    _check_tokens(tokens, op)
    if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2:
        raise ValueError(f"{op}: routing_map must be a 2-D bool [T, E] map or int32/int64 [T, k] indices, got "
                         f"{_shape_or_type(routing_map)}")
    t, _h = tokens.shape
    if routing_map.shape[0] != t:
        raise ValueError(f"{op}: routing_map has {routing_map.shape[0]} rows, tokens has {t}")
    _check_device(routing_map, "routing_map", tokens, "tokens", op)
    is_map = routing_map.dtype == torch.bool
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
    else:
        raise TypeError(f"{op}: routing_map must be bool or int32/int64, got {routing_map.dtype}")
    k = routing_map.shape[1]
    if pad_multiple is not None:
        if int(pad_multiple) < 1:
            raise ValueError(f"{op}: pad_multiple must be >= 1, got {pad_multiple}")
        pad_multiple = int(pad_multiple) if int(pad_multiple) > 1 else None
    if num_out_tokens is not None:
        num_out_tokens = int(num_out_tokens)
        if num_out_tokens < 0:
            raise ValueError(f"{op}: num_out_tokens must be >= 0, got {num_out_tokens}")
        if not is_map and num_out_tokens < t * k:
            raise ValueError(f"{op}: num_out_tokens={num_out_tokens} < T*k={t * k}: every top-k pair needs a row")
    elif not is_map and pad_multiple is None:
        num_out_tokens = t * k
    if tokens.dtype not in _FLOAT_DTYPES and tokens.element_size() != 1:
        raise TypeError(f"{op}: tokens dtype {tokens.dtype} not supported (bf16/fp16/fp32 or a 1-byte FP8 type)")
    if tokens.element_size() == 1 and tokens.requires_grad:
        raise TypeError(f"{op}: FP8 tokens ({tokens.dtype}) are moved as data only; they cannot require grad")
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

    if _fused_map(tokens, is_map, t * k):
        from primus_turbo.triton.moe import permute_kernel as pk

        routing_map = routing_map.contiguous()
        state = pk.permute_map_scan_launch(routing_map, e, pad_multiple, num_out_tokens)
        seg = state[1]
        n_out = int(state[0][-1]) if num_out_tokens is None else num_out_tokens  # host sync (documented)
        row_id_map, src_idx = pk.permute_map_assign_launch(routing_map, e, state, n_out)
    else:
        row_id_map, seg, n_out = _build_row_id_map(routing_map, e, pad_multiple, num_out_tokens)
        src_idx = _inverse(row_id_map, n_out)
    permuted, pprobs = _PermuteFn.apply(tokens, probs, row_id_map, src_idx, k)
    result = [permuted, pprobs, row_id_map]
    if scales is not None:
        s2 = scales.detach().reshape(t, -1)
        ps = _gather_rows(s2, src_idx, row_div=k)
        result.append(ps.reshape(n_out) if scales.dim() == 1 else ps)
    if return_tokens_per_expert:
        result.append(seg)
    return tuple(result)


def moe_unpermute(permuted_tokens: torch.Tensor, row_id_map: torch.Tensor,
                  merging_probs: Optional[torch.Tensor] = None,
                  restore_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Merge each token's expert rows back (see the module docstring)."""
    op = "moe_unpermute"
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
        out = out.reshape(tuple(restore_shape))
    return out


def token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: Optional[int] = None):
    """Megatron ``permute``: returns ``(permuted_tokens, sorted_indices)``."""
    op = "token_permute"
    _check_tokens(tokens, op)
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{op}: indices must be a tensor, got {type(indices).__name__}")
    if indices.dim() == 1:
        indices = indices[:, None]
    if indices.dim() != 2 or indices.shape[0] != tokens.shape[0]:
        raise ValueError(f"{op}: indices must be [T, k] with T={tokens.shape[0]}, got {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: indices must be int32/int64, got {indices.dtype}")
    _check_device(indices, "indices", tokens, "tokens", op)
    t, k = indices.shape
    n = t * k if num_out_tokens is None else int(num_out_tokens)
    if not 0 <= n <= t * k:
        raise ValueError(f"{op}: num_out_tokens must be in [0, T*k={t * k}], got {n}")
    sorted_indices = torch.argsort(indices.reshape(-1), stable=True)[:n]
    # row_id_map[t, j] = position of pair t*k+j in the sorted order (-1 when cut off)
    row_id_map = torch.full((t * k,), -1, dtype=torch.int64, device=indices.device)
    row_id_map.scatter_(0, sorted_indices, torch.arange(n, device=indices.device))
    row_id_map = row_id_map.view(t, k).to(torch.int32)
    permuted, _ = _PermuteFn.apply(tokens, None, row_id_map, sorted_indices, k)
    return permuted, sorted_indices


def token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                    probs: Optional[torch.Tensor] = None,
                    restore_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Megatron ``unpermute``: scatter back, weight by ``probs [T, k]``, sum over k."""
    op = "token_unpermute"
    _check_tokens(permuted_tokens, op, "permuted_tokens")
    if permuted_tokens.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: permuted_tokens must be bf16/fp16/fp32, got {permuted_tokens.dtype}")
    if not isinstance(sorted_indices, torch.Tensor) or sorted_indices.dim() != 1 \
            or sorted_indices.numel() != permuted_tokens.shape[0]:
        raise ValueError(f"{op}: sorted_indices must be 1-D with one entry per permuted row "
                         f"({permuted_tokens.shape[0]}), got {_shape_or_type(sorted_indices)}")
    _check_device(sorted_indices, "sorted_indices", permuted_tokens, "permuted_tokens", op)
    _check_device(probs, "probs", permuted_tokens, "permuted_tokens", op)
    if probs is not None:
        if probs.dim() == 1:
            probs = probs[:, None]
        t, k = probs.shape
    elif restore_shape is not None:
        t = 1
        for d in tuple(restore_shape)[:-1]:
            t *= int(d)
        k = permuted_tokens.shape[0] // t if t else 1
    else:
        t, k = permuted_tokens.shape[0], 1
    row_id_map = torch.full((t * k,), -1, dtype=torch.int64, device=sorted_indices.device)
    row_id_map.scatter_(0, sorted_indices.long(),
                        torch.arange(sorted_indices.numel(), device=sorted_indices.device))
    row_id_map = row_id_map.view(t, k).to(torch.int32)
    out = _UnpermuteFn.apply(permuted_tokens, row_id_map, probs.contiguous() if probs is not None else None)
    if restore_shape is not None:
        out = out.reshape(tuple(restore_shape))
    return out
