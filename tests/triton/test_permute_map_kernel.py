"""build_permute_map_launch (count -> scan -> assign kernels) against the torch map builder of
turbo.ops.moe_permute (``_build_row_id_map`` + ``_inverse``, the torch-backend path), and the fused
token-row + probs gather (``gather_rows_launch(row_div=K, probs=...)``), and the token-major scatter
(``scatter_rows_launch``: permute forward, unpermute backward) against torch."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.pytorch.ops import moe_permute as _op  # noqa: E402  (the function: loads the module)
from primus_turbo.triton import is_interpreter  # noqa: E402
from primus_turbo.triton.moe import permute_kernel as pk  # noqa: E402
from primus_turbo.triton.moe.permute_kernel import (  # noqa: E402
    build_permute_map_launch,
    gather_rows_launch,
    permute_map_blocks,
    scatter_rows_launch,
)

# the package re-exports a function named moe_permute: take the module itself
M = sys.modules[_op.__module__]

SMALL_BLOCKS = (16, 4)  # (BLOCK_T, BLOCK_E): many blocks / expert tiles on small inputs


def _small_blocks(e):
    return SMALL_BLOCKS if e <= 8 else (16, 64)  # the interpreter pays per expert tile


def _routing(t, e, k, form, mode, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=g)
    if mode == "one":  # every token to expert e // 2 (first choice)
        scores[:, e // 2] = 2.0
    elif mode == "dead":  # a third of the experts never chosen while others are left
        scores[:, ::3] = -1.0
    idx = scores.topk(k, dim=1).indices
    if form == "map":
        return torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
    perm = torch.randperm(k, generator=g)  # random slot order within a row
    idx = idx[:, perm]
    if mode == "dead" and k > 1:  # some slots routed nowhere (-1: another rank's expert)
        idx[torch.rand(t, k, generator=g) < 0.2] = -1
    return idx.to(torch.int32 if form == "int32" else torch.int64)


def _reference(rmap, e, pad, n_out):
    rid, seg, n = M._build_row_id_map(rmap, e, pad, n_out)
    return rid, seg, M._inverse(rid, n), n


def _check(rmap, e, pad, n_out, blocks=None, **kw):
    rid_r, seg_r, src_r, n_r = _reference(rmap, e, pad, n_out)
    rid, tpe, src, n = build_permute_map_launch(rmap, e, pad, n_out, blocks=blocks, **kw)
    assert n == n_r
    assert rid.dtype == torch.int32 and rid.shape == rmap.shape
    assert tpe.dtype == torch.int64 and tpe.shape == (e,)
    assert src.dtype == torch.int64 and src.shape == (n,)
    assert torch.equal(rid, rid_r)
    assert torch.equal(tpe, seg_r)
    assert torch.equal(src, src_r)


CASES = [  # (T, E, k)
    (37, 1, 1), (50, 3, 1), (50, 3, 2), (100, 8, 2), (65, 8, 8), (130, 64, 2), (70, 64, 8),
    (90, 256, 1), (40, 256, 8),
]


@pytest.mark.parametrize("form", ["map", "int32", "int64"])
@pytest.mark.parametrize("t,e,k", CASES)
def test_map_vs_torch(t, e, k, form, device):
    for mode, pad in (("rand", None), ("dead", 4), ("one", 3)):
        rmap = _routing(t, e, k, form, mode, seed=t * 7 + e + k).to(device)
        total = int(M._build_row_id_map(rmap, e, pad, None)[2])
        for n_out in (None, total, total + 9, max(total - 11, 0), total // 3):
            blocks = _small_blocks(e) if n_out == total else None
            _check(rmap, e, pad, n_out, blocks)


@pytest.mark.parametrize("form", ["map", "int64"])
def test_map_block_sizes(form, device, monkeypatch):
    t, e, k = 77, 24, 3
    rmap = _routing(t, e, k, form, "dead", seed=11).to(device)
    with monkeypatch.context() as mp:  # the sizes picked on a GPU, for this and for large problems
        mp.setattr(pk, "_interp", lambda: False)
        gpu = {permute_map_blocks(form == "map", ee, tt, kk) for ee, tt, kk in
               ((e, t, k), (256, 65536, 8), (8, 4096, 2), (256, 16384, 8))}
    assert ((512, 16) if form == "map" else (512, 8)) in gpu
    for blocks in [(4, 8), (8, 4), (32, 16), (128, 32), (1, 1), permute_map_blocks(form == "map", e)] + sorted(gpu):
        for pad in (None, 8):
            _check(rmap, e, pad, None, blocks)
            _check(rmap, e, pad, 150, blocks)


@pytest.mark.parametrize("form", ["map", "int32"])
def test_map_torch_scan_fallback(form, device):
    # large problems scan the per-block counts with torch ops instead of the single-program kernel
    t, e, k = 90, 20, 3
    rmap = _routing(t, e, k, form, "dead", seed=3).to(device)
    for pad in (None, 4):
        for n_out in (None, 100, 500):
            _check(rmap, e, pad, n_out, (16, 8), scan_max=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_indices_out_of_range_slots_route_nowhere(dtype, device):
    # values outside [0, E) other than -1 break the contract (checked by moe_permute on CPU); the
    # kernels, like the torch builder, give such slots no row
    t, e, k = 40, 6, 3
    g = torch.Generator().manual_seed(8)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    bad = torch.rand(t, k, generator=g) < 0.3
    idx[bad] = torch.tensor([-1, -7, e, e + 5, 2 ** 30])[torch.randint(0, 5, (int(bad.sum()),), generator=g)]
    rmap = idx.to(dtype).to(device)
    for blocks in (None, SMALL_BLOCKS, (8, 2)):
        for pad in (None, 4):
            for n_out in (None, 50):
                _check(rmap, e, pad, n_out, blocks)


def _full_reference(rmap, e, rid):
    # the [T, E + 1 + k] map as built with torch ops from the [T, k] row map
    t, k = rmap.shape
    full = rid.new_full((t, e + 1 + k), -1)
    col = torch.where(rid >= 0, rmap.to(rid.dtype), e)
    full[:, e + 1:] = col
    full.scatter_(1, col.long(), rid)
    return full


@pytest.mark.parametrize("t,e,k", [(50, 3, 2), (70, 64, 8), (33, 7, 7), (0, 4, 2)])
def test_full_map_of_the_assign_launch(t, e, k, device):
    rmap = _routing(t, e, k, "int64", "dead", seed=t + e).to(device) if t else \
        torch.zeros(0, k, dtype=torch.int64, device=device)
    for blocks in (None, (16, 4)):
        for pad, n_out in ((None, None), (4, 20), (None, t * k + 5)):
            state = pk.permute_map_scan_launch(rmap, e, pad, n_out, blocks)
            n = int(state[0][-1]) if n_out is None else n_out
            poison = torch.full((t, e + 1 + k), 12345, dtype=torch.int32, device=device)
            rid, src, full = pk.permute_map_assign_launch(rmap, e, state, n, full_map=True)
            assert full.shape == poison.shape and full.dtype == torch.int32
            rid2, src2 = pk.permute_map_assign_launch(rmap, e, state, n)
            assert torch.equal(rid, rid2) and torch.equal(src, src2)
            assert torch.equal(full, _full_reference(rmap, e, rid))


def test_map_launch_argument_errors(device):
    rmap = torch.zeros(4, 3, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="blocks must be"):
        pk.permute_map_scan_launch(rmap, 3, None, None, (16, 4, 16))
    with pytest.raises(ValueError, match="blocks must be"):
        pk.permute_map_scan_launch(rmap, 3, None, None, (12, 4))
    state = pk.permute_map_scan_launch(rmap, 3, None, 4)
    with pytest.raises(ValueError, match="full_map"):
        pk.permute_map_assign_launch(rmap, 3, state, 4, full_map=True)


def test_map_no_experts(device):
    rmap = torch.zeros(6, 0, dtype=torch.bool, device=device)
    rid, tpe, src, n = build_permute_map_launch(rmap, 0, None, None)
    assert rid.shape == (6, 0) and tpe.shape == (0,) and src.shape == (0,) and n == 0


@pytest.mark.parametrize("form", ["map", "int32"])
def test_map_empty(form, device):
    e = 5
    for t, k in ((0, 2), (9, 0), (0, 0)):
        if form == "map":
            rmap = torch.zeros(t, e, dtype=torch.bool, device=device)
        else:
            rmap = torch.zeros(t, k, dtype=torch.int32, device=device)
        for n_out in (None, 0, 6):
            _check(rmap, e, 4, n_out)
    # a map that routes nothing
    rmap = torch.zeros(20, e, dtype=torch.bool, device=device)
    for n_out in (None, 0, 7):
        _check(rmap, e, None, n_out, SMALL_BLOCKS)


def test_fused_gather_rows_and_probs(device):
    t, h, k, n_out = 45, 40, 3, 160
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, h, generator=g).to(device)
    probs = torch.rand(t, k, generator=g).to(device)
    src = torch.randint(-1, t * k, (n_out,), generator=g).to(device)
    out = torch.empty(n_out, h, device=device)
    pout = torch.empty(n_out, device=device)
    gather_rows_launch(x.view(torch.int32), out.view(torch.int32), src, row_div=k, probs=probs, probs_out=pout)
    ok = src >= 0
    want = torch.where(ok[:, None], x[(src.clamp(min=0) // k)], torch.zeros(()))
    assert torch.equal(out, want)
    assert torch.equal(pout, torch.where(ok, probs.reshape(-1)[src.clamp(min=0)], torch.zeros(())))


@pytest.mark.parametrize("k,weighted,block_t,compact,chunk,keep", [
    (1, True, None, None, None, 0.75), (8, True, None, None, None, 0.75), (8, False, 4, None, None, 0.75),
    (20, True, None, None, None, 0.75),       # wide: packed and merged in chunks (the default above 16)
    (20, True, None, False, None, 0.75),      # wide through the runtime loop
    (8, True, 4, True, 2, 0.75),              # packing forced on a narrow map, chunks of 2, 4 tokens a block
    (32, True, None, None, None, 0.125),      # map form: one column per expert, ~4 of 32 routed
    (32, False, 4, None, 8, 0.125),
    (24, True, None, None, None, 0.0)])       # nothing routed: zero rows
def test_merge_rows_kernel_matches_reference(k, weighted, block_t, compact, chunk, keep):
    """merge_rows_launch (unrolled terms for k <= MERGE_UNROLL_MAX; above it the map packed per token
    and merged in unrolled chunks, or the runtime loop) against the fp32 sum in ascending j of the
    torch path: fp32 output, so the two agree bit for bit (the weighted sum on a GPU to its FMA
    rounding); rows marked -1 (dropped or unrouted pairs) contribute nothing; the output is poisoned
    first."""
    g = torch.Generator().manual_seed(100 + k)
    t, h, n_src = 7, 200, 40  # h not a power of two: a masked column step
    src = torch.randn(n_src, h, generator=g)
    row_map = torch.randint(0, n_src, (t, k), generator=g, dtype=torch.int32)
    row_map[torch.rand(t, k, generator=g) >= keep] = -1
    row_map[0, :] = -1  # a token with no entry at all
    row_map[1, -1] = 3  # the last column used
    w = torch.rand(t, k, generator=g) if weighted else None
    # the kernel on the GPU where there is one (outside the interpreter Triton takes no CPU tensors)
    dev = "cuda" if torch.cuda.is_available() and not is_interpreter() else "cpu"
    out = torch.full((t, h), float("nan"), device=dev)
    pk.merge_rows_launch(src.to(dev), out, row_map.to(dev), None if w is None else w.to(dev), block_t=block_t,
                         compact=compact, chunk=chunk)
    out = out.cpu()
    ref = torch.zeros(t, h)
    for j in range(k):
        r = row_map[:, j].long()
        x = src[r.clamp(min=0)] * (w[:, j:j + 1] if weighted else 1.0)
        ref += torch.where((r >= 0)[:, None], x, torch.zeros(()))
    if dev == "cuda" and weighted:
        # the GPU contracts w * x + acc into one FMA (one rounding instead of two): ulps apart
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("k,weighted", [(32, True), (5, False), (200, True)])
def test_compact_map_kernel(k, weighted):
    """compact_map_launch packs each token's kept entries (>= 0) to the front in ascending column
    order, with their weights, and counts them; the slots past the count are not part of the contract."""
    g = torch.Generator().manual_seed(7 + k)
    t = 37  # more than one block of tokens, a partial last block
    row_map = torch.randint(0, 1000, (t, k), generator=g, dtype=torch.int32)
    row_map[torch.rand(t, k, generator=g) < 0.8] = -1
    row_map[3, :] = -1
    w = torch.rand(t, k, generator=g) if weighted else None
    dev = "cuda" if torch.cuda.is_available() and not is_interpreter() else "cpu"
    cmap, cw, n = pk.compact_map_launch(row_map.to(dev), None if w is None else w.to(dev))
    assert n.dtype == torch.int32 and (cw is None) == (w is None)
    for i in range(t):
        keep = (row_map[i] >= 0).nonzero().flatten()
        assert int(n[i]) == keep.numel()
        assert torch.equal(cmap[i, :keep.numel()].cpu(), row_map[i, keep])
        if weighted:
            assert torch.equal(cw[i, :keep.numel()].cpu(), w[i, keep])


def _random_map(t, k, keep, n_pad, seed):
    """A random injective [T, K] row map (``keep`` of the entries routed) into ``routed + n_pad`` rows,
    the unfilled rows scattered among the routed ones; and its inverse ``src_idx`` (-1 on unfilled rows)."""
    g = torch.Generator().manual_seed(seed)
    routed = torch.rand(t, k, generator=g) < keep
    n = int(routed.sum())
    n_out = n + n_pad
    rows = torch.randperm(n_out, generator=g)[:n]
    rid = torch.full((t * k,), -1, dtype=torch.int32)
    rid[routed.reshape(-1)] = rows.to(torch.int32)
    src = torch.full((n_out,), -1, dtype=torch.int64)
    src[rows] = torch.nonzero(routed.reshape(-1)).reshape(-1)
    return rid.view(t, k), src


@pytest.mark.parametrize("k,keep,n_pad,compact", [
    (1, 1.0, 0, None), (4, 0.75, 9, None), (8, 1.0, 3, None),
    (20, 0.75, 5, None),         # wide: packed, chunks looped to the block's largest count
    (8, 0.75, 5, True),          # packing forced on a narrow map
    (20, 0.75, 5, False),        # wide through the runtime loop
    (32, 0.125, 40, None),       # map form: one column per expert, ~4 of 32 routed
    (24, 0.0, 7, None)])         # nothing routed: only zero rows
def test_scatter_rows_vs_ref(k, keep, n_pad, compact, device):
    t, h = 37, 72
    g = torch.Generator().manual_seed(k * 7 + n_pad)
    rid, src = _random_map(t, k, keep, n_pad, seed=k + n_pad)
    n_out = src.shape[0]
    x = torch.randn(t, h, generator=g)
    x[3, 5] = float("nan")  # moved bit-exactly
    w = torch.rand(t, k, generator=g) + 0.25
    perm = torch.randn(n_out, h, generator=g)
    ok = src >= 0
    tok = src.clamp(min=0) // k
    wflat = w.reshape(-1)[src.clamp(min=0)]
    want_copy = torch.where(ok[:, None], x[tok], torch.zeros(()))
    want_w = torch.where(ok, wflat, torch.zeros(()))
    xs = x.nan_to_num()
    want_scaled = torch.where(ok[:, None], xs[tok] * wflat[:, None], torch.zeros(()))
    want_dot = torch.where(ok, (xs[tok].double() * perm.double()).sum(1), torch.zeros((), dtype=torch.float64))
    d = lambda a: a.to(device)  # noqa: E731
    # raw bits + the weights copied
    out = torch.full((n_out, h), float("nan"), device=device)
    pout = torch.full((n_out,), float("nan"), device=device)
    scatter_rows_launch(d(x).view(torch.int32), d(rid), d(src), out=out.view(torch.int32), weights=d(w),
                        probs_out=pout, compact=compact)
    assert torch.equal(out.view(torch.int32).cpu(), want_copy.view(torch.int32))
    assert torch.equal(pout.cpu(), want_w)
    # weighted rows + dots with the permuted rows
    out = torch.full((n_out, h), float("nan"), device=device)
    dot = torch.full((n_out,), float("nan"), device=device)
    scatter_rows_launch(d(xs), d(rid), d(src), out=out, weights=d(w), scale_by_weights=True, permuted=d(perm),
                        dot=dot, compact=compact)
    torch.testing.assert_close(out.cpu(), want_scaled, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dot.cpu().double(), want_dot, rtol=1e-5, atol=1e-5)
    # bf16 weighted rows: one fp32 product, rounded once
    xb = xs.to(torch.bfloat16)
    outb = torch.full((n_out, h), float("nan"), device=device, dtype=torch.bfloat16)
    scatter_rows_launch(d(xb), d(rid), d(src), out=outb, weights=d(w), scale_by_weights=True, compact=compact)
    want_b = torch.where(ok[:, None], xb[tok].float() * wflat[:, None], torch.zeros(())).to(torch.bfloat16)
    assert torch.equal(outb.cpu(), want_b)


def test_scatter_rows_errors(device):
    rid, src = _random_map(5, 2, 1.0, 0, seed=1)
    x = torch.randn(5, 8, device=device)
    out = torch.empty(src.shape[0], 8, device=device)
    with pytest.raises(ValueError, match="scale_by_weights needs weights"):
        scatter_rows_launch(x, rid.to(device), src.to(device), out=out, scale_by_weights=True)
    with pytest.raises(ValueError, match="probs_out needs weights"):
        scatter_rows_launch(x, rid.to(device), src.to(device), probs_out=torch.empty(src.shape[0], device=device))
    with pytest.raises(ValueError, match="dot needs permuted"):
        scatter_rows_launch(x, rid.to(device), src.to(device), dot=torch.empty(src.shape[0], device=device))
    for kw, msg in ((dict(num_warps=3), "num_warps must be"), (dict(block_t=3), "block_t must be"),
                    (dict(block_c=8), "block_c must be"), (dict(block_c=96), "block_c must be")):
        with pytest.raises(ValueError, match=msg):
            scatter_rows_launch(x, rid.to(device), src.to(device), out=out, **kw)


@pytest.mark.parametrize("k,compact", [(2, None), (20, None), (4, True)])
def test_merge_and_scatter_mask_rows_past_the_buffer(k, compact, device):
    """A row map built for a larger buffer (entries >= the rows given, e.g. ``permuted[:4]`` with a map of
    8 rows) never reaches memory out of bounds: merge_rows treats those entries as unrouted (reads
    nothing past ``src``), scatter_rows skips them (writes nothing past ``out``). The buffers are views
    of a larger tensor, so an unmasked access would read / overwrite the rows behind them."""
    t, h, n_src = 6, 40, 4
    g = torch.Generator().manual_seed(11 + k)
    big = torch.randn(n_src + 8, h, generator=g)
    row_map = torch.full((t, k), -1, dtype=torch.int32)
    row_map[:, 0] = torch.arange(t) % n_src
    row_map[1, -1] = n_src + 2          # past the buffer
    row_map[4, k // 2] = n_src + 7
    if k > 2:
        row_map[2, 1] = 10 ** 6         # far past it
    w = torch.rand(t, k, generator=g)
    ok = (row_map >= 0) & (row_map < n_src)
    good = torch.where(ok, row_map, -1)
    d = lambda a: a.to(device)  # noqa: E731
    src = d(big)[:n_src]
    for weights in (None, w):
        out = torch.full((t, h), float("nan"), device=device)
        pk.merge_rows_launch(src, out, d(row_map), None if weights is None else d(weights), compact=compact)
        ref = torch.zeros(t, h, device=device)
        pk.merge_rows_launch(src, ref, d(good), None if weights is None else d(weights), compact=compact)
        assert torch.equal(out, ref)
    # scatter (unpermute's backward): out is a view of a larger buffer, its rows behind must stay untouched.
    # A row map gives each row one source: tokens 4 and 5 would share rows 0 and 1 with tokens 0 and 1
    # (two writers of one row, an order the GPU does not fix), so they route only past the buffer here.
    row_map[4:, 0] = -1
    ok = (row_map >= 0) & (row_map < n_src)
    good = torch.where(ok, row_map, -1)
    x = torch.randn(t, h, generator=g)
    src_idx = torch.full((n_src,), -1, dtype=torch.int64)
    flat = torch.arange(t * k).view(t, k)
    src_idx[good[ok].long()] = flat[ok]
    back = torch.full((n_src + 8, h), 7.0, device=device)
    out = back[:n_src]
    pout = torch.full((n_src + 8,), 7.0, device=device)
    scatter_rows_launch(d(x), d(row_map), d(src_idx), out=out, weights=d(w), scale_by_weights=True,
                        probs_out=pout[:n_src], compact=compact)
    assert bool((back[n_src:] == 7.0).all()) and bool((pout[n_src:] == 7.0).all())
    want = torch.zeros(n_src, h)
    want[good[ok].long()] = x[ok.nonzero()[:, 0]] * w[ok][:, None]
    torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-6)
