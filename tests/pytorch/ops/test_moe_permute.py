"""turbo.ops.moe_permute / moe_unpermute / token_permute / token_unpermute against the plain-PyTorch
references in primus_turbo.testing.permute_ref (exact data movement; fp32-accumulated merges)."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.ops.moe_permute import (
    moe_permute,
    moe_unpermute,
    token_permute,
    token_unpermute,
)
from primus_turbo.testing import snr_db
from primus_turbo.testing.permute_ref import (
    moe_permute_ref,
    moe_unpermute_ref,
    token_permute_ref,
    token_unpermute_ref,
)

T, E = 64, 16
DEAD = (3, 11)  # experts that never receive a token (zero-length segments)


def _routing(topk: int, form: str, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 97 + topk)
    scores = torch.rand(T, E, generator=g)
    scores[:, list(DEAD)] = -1.0
    idx = scores.topk(topk, dim=1).indices  # distinct experts per row, random order
    probs_k = torch.rand(T, topk, generator=g) + 0.1
    if form == "map":
        rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
        probs = torch.zeros(T, E).scatter_(1, idx, probs_k)
        return rmap.to(device), probs.to(device)
    dt = torch.int32 if form == "int32" else torch.int64
    return idx.to(dt).to(device), probs_k.to(device)


def _kw(form):
    return {} if form == "map" else {"num_experts": E}


@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("pad", [None, 8, 16])
@pytest.mark.parametrize("form", ["map", "int32", "int64"])
@pytest.mark.parametrize("topk", [1, 2, 4, 8])
def test_permute_unpermute_vs_ref(topk, form, pad, hidden, device):
    rmap, probs = _routing(topk, form, device)
    x = torch.randn(T, hidden, device=device)
    ref = moe_permute_ref(x.cpu(), rmap.cpu(), probs.cpu(), pad_multiple=pad, num_experts=E)
    n_out = ref[0].shape[0]
    # caller-supplied size for the indices form with padding (no host sync); None otherwise
    nout_arg = n_out if (form != "map" and pad) else None
    xt = x.clone().requires_grad_(True)
    pt = probs.clone().requires_grad_(True)
    perm, pprobs, row_id_map, tpe = moe_permute(xt, rmap, pt, num_out_tokens=nout_arg, pad_multiple=pad,
                                                return_tokens_per_expert=True, **_kw(form))
    assert perm.shape == (n_out, hidden)
    assert torch.equal(perm.detach().cpu(), ref[0])
    assert torch.equal(pprobs.detach().cpu(), ref[1])
    assert torch.equal(row_id_map.cpu(), ref[2])
    assert torch.equal(tpe.cpu(), ref[3])
    assert row_id_map.dtype == torch.int32 and row_id_map.shape == rmap.shape
    assert int(tpe[list(DEAD)].sum()) == 0
    if pad:
        assert bool((tpe % pad == 0).all())
    # backward of permute vs the reference's autograd
    g1 = torch.randn(n_out, hidden)
    g2 = torch.randn(n_out)
    ((perm * g1.to(device)).sum() + (pprobs * g2.to(device)).sum()).backward()
    xr = x.cpu().clone().requires_grad_(True)
    pr = probs.cpu().clone().requires_grad_(True)
    r = moe_permute_ref(xr, rmap.cpu(), pr, pad_multiple=pad, num_experts=E)
    ((r[0] * g1).sum() + (r[1] * g2).sum()).backward()
    torch.testing.assert_close(xt.grad.cpu(), xr.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(pt.grad.cpu(), pr.grad)
    # unpermute with merging probs, and its backward
    y = torch.randn(n_out, hidden, device=device)
    yt = y.clone().requires_grad_(True)
    mt = probs.clone().requires_grad_(True)
    out = moe_unpermute(yt, row_id_map, mt, restore_shape=(T, hidden))
    yr = y.cpu().clone().requires_grad_(True)
    mr = probs.cpu().clone().requires_grad_(True)
    out_r = moe_unpermute_ref(yr, ref[2], mr)
    torch.testing.assert_close(out.detach().cpu(), out_r.detach(), rtol=1e-6, atol=1e-6)
    go = torch.randn(T, hidden)
    out.backward(go.to(device))
    out_r.backward(go)
    torch.testing.assert_close(yt.grad.cpu(), yr.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mt.grad.cpu(), mr.grad, rtol=1e-5, atol=1e-5)
    # round trip: unpermute(permute(x), probs) == x * sum(probs)
    back = moe_unpermute(perm.detach(), row_id_map, probs)
    torch.testing.assert_close(back.cpu(), (x * probs.sum(1, keepdim=True)).cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["map", "int64"])
def test_no_probs_bf16_roundtrip(form, device):
    rmap, _ = _routing(4, form, device, seed=1)
    x = torch.randn(T, 96, device=device, dtype=torch.bfloat16)
    perm, pprobs, row_id_map = moe_permute(x, rmap, pad_multiple=8, **_kw(form))
    assert pprobs is None
    ref = moe_permute_ref(x.cpu(), rmap.cpu(), pad_multiple=8, num_experts=E)
    assert torch.equal(perm.cpu(), ref[0])
    back = moe_unpermute(perm, row_id_map)
    torch.testing.assert_close(back.float().cpu(), (x.float() * 4).cpu(), rtol=1e-2, atol=1e-2)
    w = torch.rand(T, rmap.shape[1], device=device)
    out = moe_unpermute(perm, row_id_map, w)
    out_r = moe_unpermute_ref(ref[0], ref[2], w.cpu())
    if device == "cpu":
        assert torch.equal(out.cpu(), out_r)  # same fp32 sum, one RNE rounding
    else:  # the GPU kernel may fuse multiply-add: one bf16 ulp
        torch.testing.assert_close(out.float().cpu(), out_r.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("form", ["map", "int32"])
def test_fp8_tokens_and_scales_passthrough(fp8, form, device):
    rmap, probs = _routing(2, form, device, seed=2)
    x = (torch.randn(T, 64, device=device) * 4).to(fp8)
    s2 = torch.rand(T, 2, device=device)
    s1 = torch.rand(T, device=device)
    kw = _kw(form)
    perm, pprobs, rid, ps = moe_permute(x, rmap, probs, pad_multiple=16, scales=s2, **kw)
    ref = moe_permute_ref(x.cpu(), rmap.cpu(), probs.cpu(), pad_multiple=16, scales=s2.cpu(), num_experts=E)
    assert perm.dtype == fp8
    assert torch.equal(perm.cpu().view(torch.uint8), ref[0].view(torch.uint8))
    assert torch.equal(pprobs.cpu(), ref[1])
    assert torch.equal(ps.cpu(), ref[4])
    _, _, _, ps1 = moe_permute(x, rmap, probs, pad_multiple=16, scales=s1, **kw)
    assert ps1.shape == (perm.shape[0],)
    assert torch.equal(ps1.cpu(), ps[:, 0].cpu() * 0 + moe_permute_ref(
        x.cpu(), rmap.cpu(), pad_multiple=16, scales=s1.cpu(), num_experts=E)[4])


def test_num_out_tokens_explicit(device):
    rmap, probs = _routing(2, "map", device, seed=3)
    x = torch.randn(T, 64, device=device)
    ref = moe_permute_ref(x.cpu(), rmap.cpu(), probs.cpu())
    n = ref[0].shape[0]
    # larger: trailing rows are zero
    perm, pp, rid = moe_permute(x, rmap, probs, num_out_tokens=n + 5)
    assert torch.equal(perm[:n].cpu(), ref[0]) and bool((perm[n:] == 0).all()) and bool((pp[n:] == 0).all())
    # smaller (map form, not checkable without a sync): the tail pairs are dropped (-1 in the map)
    perm, pp, rid = moe_permute(x, rmap, probs, num_out_tokens=n - 10)
    assert torch.equal(perm.cpu(), ref[0][: n - 10])
    assert int((rid >= 0).sum()) == n - 10
    refd = moe_permute_ref(x.cpu(), rmap.cpu(), probs.cpu(), num_out_tokens=n - 10)
    assert torch.equal(rid.cpu(), refd[2])
    out = moe_unpermute(perm, rid, probs)
    torch.testing.assert_close(out.cpu(), moe_unpermute_ref(refd[0], refd[2], probs.cpu()))
    # indices form: T*k by default
    idx, pk = _routing(2, "int64", device, seed=3)
    perm, _, _ = moe_permute(x, idx, num_experts=E)
    assert perm.shape[0] == T * 2


def test_empty_and_all_one_expert(device):
    x = torch.randn(T, 64, device=device)
    rmap = torch.zeros(T, E, dtype=torch.bool, device=device)
    perm, _, rid, tpe = moe_permute(x, rmap, return_tokens_per_expert=True)
    assert perm.shape == (0, 64) and bool((rid == -1).all()) and int(tpe.sum()) == 0
    out = moe_unpermute(perm, rid)
    assert bool((out == 0).all())
    idx = torch.full((T, 1), 5, dtype=torch.int32, device=device)
    perm, _, rid = moe_permute(x, idx, num_experts=E, pad_multiple=16, num_out_tokens=T)
    assert torch.equal(perm, x) and torch.equal(rid[:, 0].cpu(), torch.arange(T, dtype=torch.int32))


def test_short_buffer_clips_tokens_per_expert(device):
    # a num_out_tokens below the padded total cuts segments: the returned lengths count only the
    # rows that are in the buffer (they sum to at most num_out_tokens), and match the map
    x = torch.randn(T, 64, device=device)
    rmap, _ = _routing(2, "map", device, seed=5)
    full = moe_permute(x, rmap, pad_multiple=16, return_tokens_per_expert=True)[3]
    cap = int(full.sum()) // 2 + 3
    perm, _, rid, tpe = moe_permute(x, rmap, pad_multiple=16, num_out_tokens=cap, return_tokens_per_expert=True)
    starts = torch.cumsum(full, 0) - full
    want = torch.minimum(full, (cap - starts).clamp(min=0))
    assert perm.shape[0] == cap and int(tpe.sum()) <= cap
    assert torch.equal(tpe.cpu(), want.cpu())
    kept = rid[rid >= 0]
    assert int(kept.max()) < cap


def test_errors(device):
    # every bad input is named with its op and the values involved
    x = torch.randn(T, 64, device=device)
    idx, probs = _routing(2, "int64", device)
    rmap, mprobs = _routing(2, "map", device)
    with pytest.raises(ValueError, match=rf"moe_permute: routing_map has {T} rows, tokens has 10"):
        moe_permute(x[:10], rmap)
    with pytest.raises(ValueError, match="moe_permute: the top-k indices form needs num_experts > 0, got num_exp"):
        moe_permute(x, idx)
    with pytest.raises(TypeError, match="moe_permute: routing_map must be bool or int32/int64, got torch.float32"):
        moe_permute(x, idx.float(), num_experts=E)
    with pytest.raises(ValueError, match=rf"moe_permute: probs shape \({T}, 2\) must match routing_map \({T}, {E}\)"):
        moe_permute(x, rmap, probs)
    with pytest.raises(ValueError, match=rf"num_out_tokens={T * 2 - 1} < T\*k={T * 2}"):
        moe_permute(x, idx, probs, num_out_tokens=T * 2 - 1, num_experts=E)
    with pytest.raises(ValueError, match=rf"moe_permute: num_out_tokens={T} < T\*k"):
        moe_permute(x, idx, num_out_tokens=T, pad_multiple=8, num_experts=E)
    with pytest.raises(ValueError, match="moe_permute: pad_multiple must be >= 1, got 0"):
        moe_permute(x, rmap, pad_multiple=0)
    with pytest.raises(ValueError, match=rf"moe_permute: scales must be \[T\] or \[T, S\] with T={T}, got \({T + 1},"):
        moe_permute(x, rmap, scales=torch.ones(T + 1, device=device))
    with pytest.raises(ValueError, match=rf"moe_permute: num_experts={E + 1} but routing_map has {E} columns"):
        moe_permute(x, rmap, num_experts=E + 1)
    with pytest.raises(ValueError, match=r"moe_permute: tokens must be a 2-D tensor \[T, H\], got \(64,\)"):
        moe_permute(x[0], rmap)
    with pytest.raises(TypeError, match="moe_permute: probs must be floating point, got torch.int64"):
        moe_permute(x.to(torch.float8_e4m3fn), rmap, probs=mprobs.long())
    with pytest.raises(TypeError, match="moe_permute: FP8 tokens .* cannot require grad"):
        moe_permute(torch.randn(T, 64, device=device).to(torch.float8_e4m3fn).requires_grad_(), rmap)
    # operands on another device than the tokens (the meta device stands in for a second device)
    with pytest.raises(ValueError, match=r"moe_permute: routing_map is on meta, tokens on"):
        moe_permute(x, rmap.to("meta"))
    with pytest.raises(ValueError, match=r"moe_permute: probs is on meta, tokens on"):
        moe_permute(x, rmap, mprobs.to("meta"))
    with pytest.raises(ValueError, match=r"moe_permute: scales is on meta, tokens on"):
        moe_permute(x, rmap, scales=torch.ones(T, device="meta"))
    perm, _, rid = moe_permute(x, rmap)
    with pytest.raises(ValueError, match=rf"moe_unpermute: merging_probs shape \({T}, 2\) must match row_id_map"):
        moe_unpermute(perm, rid, probs)
    with pytest.raises(ValueError, match=r"moe_unpermute: row_id_map must be the int \[T, K\] map .* torch.float32"):
        moe_unpermute(perm, rid.float())
    with pytest.raises(TypeError, match="moe_unpermute: permuted_tokens must be bf16/fp16/fp32, got torch.float8"):
        moe_unpermute(perm.to(torch.float8_e4m3fn), rid)
    with pytest.raises(ValueError, match=r"moe_unpermute: row_id_map is on meta, permuted_tokens on"):
        moe_unpermute(perm, rid.to("meta"))
    with pytest.raises(ValueError, match=r"moe_unpermute: merging_probs is on meta"):
        moe_unpermute(perm, rid, mprobs.to("meta"))
    with pytest.raises(TypeError, match=r"token_permute: the second argument is num_out_tokens \(an int\), got a "
                                        r"tensor \(64, 2\)"):
        token_permute(x, idx)
    with pytest.raises(ValueError, match=r"token_permute: routing_map \[T, num_experts\] is required"):
        token_permute(x, 10)
    with pytest.raises(NotImplementedError, match="token_permute: topk_indices is not supported"):
        token_permute(x, 10, topk_indices=idx)
    with pytest.raises(ValueError, match=r"token_permute: routing_map must be \[T=64, num_experts\], got \(3, 16\)"):
        token_permute(x, 10, routing_map=rmap[:3])
    with pytest.raises(TypeError, match="token_permute: routing_map must be bool or integer"):
        token_permute(x, 10, routing_map=rmap.float())
    with pytest.raises(ValueError, match=r"token_permute: routing_map is on meta, tokens on"):
        token_permute(x, 10, routing_map=rmap.to("meta"))
    with pytest.raises(ValueError, match=r"token_permute: probs must be \[T=64, E=16\] like routing_map, got \(64, 2\)"):
        token_permute(x, 10, probs, rmap)
    with pytest.raises(ValueError, match=r"token_permute: drop_and_pad needs num_out_tokens = num_experts \* "
                                         r"capacity \(a multiple of E=16\), got 10"):
        token_permute(x, 10, routing_map=rmap, drop_and_pad=True)
    with pytest.raises(ValueError, match=r"token_unpermute: sorted_indices must be what token_permute returned.*"
                                         rf"\({perm.shape[0]}\).*got \(3,\)"):
        token_unpermute(perm, torch.arange(3, device=device), restore_shape=(T, 64))
    with pytest.raises(ValueError, match=r"token_unpermute: sorted_indices is on meta"):
        token_unpermute(perm, torch.arange(perm.shape[0], device="meta"), restore_shape=(T, 64))
    with pytest.raises(ValueError, match=r"token_unpermute: restore_shape \(or routing_map / the fused row map\)"):
        token_unpermute(perm, torch.arange(perm.shape[0], device=device))
    with pytest.raises(ValueError, match="token_unpermute: merging_probs needs routing_map"):
        token_unpermute(perm, torch.arange(perm.shape[0], device=device), mprobs, (T, 64))
    with pytest.raises(ValueError, match=r"token_unpermute: restore_shape \[64, 7\] must end in hidden 64"):
        token_unpermute(perm, torch.arange(perm.shape[0], device=device), restore_shape=(T, 7))
    with pytest.raises(ValueError, match=r"token_unpermute: drop_and_pad rows come as token ids"):
        token_unpermute(perm, torch.zeros(T, E, dtype=torch.int32, device=device), restore_shape=(T, 64),
                        drop_and_pad=True)


@pytest.mark.parametrize("form", ["map", "int32"])
def test_many_blocks_vs_ref(form, device):
    # several count/assign blocks of the Triton map builder (T = 300 tokens, 600 pairs), a third of
    # the experts empty, padding, and caller sizes above / below the padded total
    t, e, k = 300, 12, 2
    g = torch.Generator().manual_seed(9)
    scores = torch.rand(t, e, generator=g)
    scores[:, ::3] = -1.0
    idx = scores.topk(k, dim=1).indices
    probs_k = torch.rand(t, k, generator=g) + 0.1
    if form == "map":
        rmap = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
        probs = torch.zeros(t, e).scatter_(1, idx, probs_k)
    else:
        rmap, probs = idx.to(torch.int32), probs_k
    x = torch.randn(t, 32, generator=g)
    s1 = torch.rand(t, generator=g)
    ref = moe_permute_ref(x, rmap, probs, pad_multiple=8, scales=s1, num_experts=e)
    n = ref[0].shape[0]
    caps = (None, n + 7) if form != "map" else (None, n + 7, n - 13)
    for cap in caps:
        out = moe_permute(x.to(device), rmap.to(device), probs.to(device), num_out_tokens=cap, pad_multiple=8,
                          scales=s1.to(device), num_experts=e, return_tokens_per_expert=True)
        want = moe_permute_ref(x, rmap, probs, num_out_tokens=cap, pad_multiple=8, scales=s1, num_experts=e)
        rows = want[0].shape[0] if cap is None or cap <= n else n
        assert out[0].shape[0] == (n if cap is None else cap)
        assert torch.equal(out[0][:rows].cpu(), want[0][:rows]) and bool((out[0][rows:] == 0).all())
        assert torch.equal(out[1][:rows].cpu(), want[1][:rows]) and bool((out[1][rows:] == 0).all())
        assert torch.equal(out[2].cpu(), want[2])
        assert torch.equal(out[3][:rows].cpu(), want[4][:rows]) and bool((out[3][rows:] == 0).all())
        seg = ref[3]
        starts = torch.cumsum(seg, 0) - seg
        lim = n if cap is None else cap
        assert torch.equal(out[4].cpu(), torch.minimum(seg, (lim - starts).clamp(min=0)))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("num_out", [None, 100, 200, "drop_and_pad"])
@pytest.mark.parametrize("topk", [1, 2, 8])
def test_token_permute_megatron(topk, num_out, fused, device):
    rmap, mprobs = _routing(topk, "map", device, seed=4)
    routed = int(rmap.sum())
    dp = num_out == "drop_and_pad"
    n_out = E * 6 if dp else num_out   # drop-and-pad: 6 rows per expert (some experts drop, some pad)
    x = torch.randn(T, 96, device=device)
    xt = x.clone().requires_grad_(True)
    pt = mprobs.clone().requires_grad_(True)
    perm, pprobs, sidx, tpe = token_permute(xt, n_out, pt, rmap, drop_and_pad=dp, fused=fused)
    perm_r, pprobs_r, toks_r, tpe_r = token_permute_ref(x.cpu(), rmap.cpu(), mprobs.cpu(), n_out, drop_and_pad=dp)
    assert perm.shape[0] == (routed if n_out is None else n_out)
    assert torch.equal(perm.detach().cpu(), perm_r) and torch.equal(pprobs.detach().cpu(), pprobs_r)
    assert torch.equal(tpe.cpu(), tpe_r)
    if dp or not fused:
        assert sidx.dim() == 1 and torch.equal(sidx.cpu(), toks_r)
    else:
        assert sidx.shape == (T, E) and sidx.dtype == torch.int32
    ok = toks_r >= 0
    if dp:
        exps = torch.arange(E).repeat_interleave(n_out // E)
    else:
        exps = torch.tensor([e for e in range(E) for _ in range(int(tpe_r[e]))] + [-1] * int((~ok).sum()),
                            dtype=torch.long)
    # backward of the permute: each token sums its rows' grads; each row's prob slot gets its grad
    g, gp = torch.randn(perm_r.shape, dtype=torch.float64), torch.randn(pprobs_r.shape)
    torch.autograd.backward([perm, pprobs], [g.float().to(device), gp.to(device)])
    want = torch.zeros(T, 96, dtype=torch.float64).index_add_(0, toks_r[ok], g.float().double()[ok])
    torch.testing.assert_close(xt.grad.cpu().double(), want, rtol=1e-6, atol=1e-6)
    want_p = torch.zeros(T, E)
    want_p[toks_r[ok], exps[ok]] = gp[ok]
    torch.testing.assert_close(pt.grad.cpu(), want_p, rtol=0, atol=0)
    # unpermute with merging probs (+ grads) against an fp64 loop
    y = torch.randn(perm_r.shape)
    yt = y.clone().to(device).requires_grad_(True)
    mt = mprobs.clone().requires_grad_(True)
    out = token_unpermute(yt, sidx, mt, (T, 96), rmap, fused=fused, drop_and_pad=dp)
    out_r = token_unpermute_ref(y, rmap.cpu(), mprobs.cpu(), T, drop_and_pad=dp)
    torch.testing.assert_close(out.detach().cpu(), out_r, rtol=1e-5, atol=1e-5)
    go = torch.randn(T, 96)
    out.backward(go.to(device))
    w = torch.zeros(perm_r.shape[0])
    w[ok] = mprobs.cpu()[toks_r[ok], exps[ok]]
    want_gy = torch.zeros(perm_r.shape)
    want_gy[ok] = go[toks_r[ok]] * w[ok, None]
    torch.testing.assert_close(yt.grad.cpu(), want_gy, rtol=1e-6, atol=1e-6)
    want_gm = torch.zeros(T, E)
    want_gm[toks_r[ok], exps[ok]] = (go[toks_r[ok]] * y[ok]).sum(1)
    torch.testing.assert_close(mt.grad.cpu(), want_gm, rtol=1e-5, atol=1e-5)
    # no probs: a plain sum back (topk 1, nothing dropped: the tokens themselves)
    back = token_unpermute(perm.detach(), sidx, restore_shape=(T, 96), routing_map=None if fused else rmap,
                           fused=fused, drop_and_pad=dp)
    torch.testing.assert_close(back.cpu(), token_unpermute_ref(perm_r, rmap.cpu(), None, T, drop_and_pad=dp),
                               rtol=1e-6, atol=1e-6)
    if topk == 1 and n_out is None:
        assert torch.equal(back.cpu(), x.cpu())


@pytest.mark.parametrize("fused", [False, True])
def test_token_permute_inp_keyword(fused, device):
    """Primus-Turbo names the first parameter ``inp`` in both token_permute and token_unpermute:
    keyword calls give what the positional calls (and the references) give, gradients included."""
    rmap, mprobs = _routing(2, "map", device, seed=6)
    x = torch.randn(T, 96, device=device)
    outs = []
    for by_kw in (False, True):
        xt, pt = x.clone().requires_grad_(True), mprobs.clone().requires_grad_(True)
        if by_kw:
            perm, pprobs, sidx, tpe = token_permute(inp=xt, num_out_tokens=150, probs=pt, routing_map=rmap,
                                                    fused=fused)
            back = token_unpermute(inp=perm, sorted_indices=sidx, merging_probs=pt, restore_shape=(T, 96),
                                   routing_map=rmap, fused=fused)
        else:
            perm, pprobs, sidx, tpe = token_permute(xt, 150, pt, rmap, fused=fused)
            back = token_unpermute(perm, sidx, pt, (T, 96), rmap, fused=fused)
        back.backward(torch.randn(T, 96, generator=torch.Generator().manual_seed(2)).to(device))
        outs.append((perm.detach(), pprobs.detach(), sidx, tpe, back.detach(), xt.grad, pt.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    perm_r, pprobs_r, _, tpe_r = token_permute_ref(x.cpu(), rmap.cpu(), mprobs.cpu(), 150)
    perm, pprobs, sidx, tpe, back = outs[1][:5]
    assert torch.equal(perm.cpu(), perm_r) and torch.equal(pprobs.cpu(), pprobs_r) and torch.equal(tpe.cpu(), tpe_r)
    torch.testing.assert_close(back.cpu(), token_unpermute_ref(perm_r, rmap.cpu(), mprobs.cpu(), T),
                               rtol=1e-5, atol=1e-5)
    # the old parameter names are gone
    with pytest.raises(TypeError, match="unexpected keyword argument 'tokens'"):
        token_permute(tokens=x, num_out_tokens=150, routing_map=rmap)
    with pytest.raises(TypeError, match="unexpected keyword argument 'permuted_tokens'"):
        token_unpermute(permuted_tokens=perm, sorted_indices=sidx, restore_shape=(T, 96), routing_map=rmap)


@pytest.mark.gpu
def test_no_host_sync_cuda():
    dev = "cuda"
    idx, probs = _routing(4, "int64", dev)
    x = torch.randn(T, 128, device=dev, dtype=torch.bfloat16)
    rmap, mprobs = _routing(4, "map", dev)
    n_pad = T * 4 + E * 15
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        perm, pp, rid = moe_permute(x, idx, probs, num_experts=E)
        moe_unpermute(perm, rid, probs)
        perm, pp, rid = moe_permute(x, idx, probs, num_out_tokens=n_pad, pad_multiple=16, num_experts=E)
        moe_unpermute(perm, rid, probs)
        perm, pp, rid = moe_permute(x, rmap, mprobs, num_out_tokens=n_pad, pad_multiple=16)
        moe_unpermute(perm, rid, mprobs)
        p2, pp2, s, _ = token_permute(x, T * 4, mprobs, rmap, fused=True)
        token_unpermute(p2, s, mprobs, x.shape, fused=True)
        p2, pp2, s, _ = token_permute(x, T * 4, mprobs, rmap)
        token_unpermute(p2, s, mprobs, x.shape, rmap)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("form", ["map", "int64"])
@pytest.mark.parametrize("pad", [None, 16])
def test_fused_map_and_torch_map_agree(form, pad, device, monkeypatch):
    # PRIMUS_TURBO_PERMUTE_FUSED_MAP picks the row-map builder (Triton kernels or torch ops); both
    # must give identical outputs and gradients, with the same gather kernels behind them
    x = torch.randn(T, 96, device=device)
    scales = torch.rand(T, 3, device=device)
    rmap, probs = _routing(4, form, device, seed=9)
    kw = dict(_kw(form), pad_multiple=pad, return_tokens_per_expert=True, scales=scales)
    results = []
    for mode in ("1", "0"):
        monkeypatch.setenv("PRIMUS_TURBO_PERMUTE_FUSED_MAP", mode)
        xi = x.clone().requires_grad_()
        pi = probs.clone().requires_grad_()
        out = moe_permute(xi, rmap, pi, **kw)
        perm, pprobs = out[0], out[1]
        (perm * torch.arange(perm.numel(), device=device).reshape(perm.shape).sin()).sum().backward(retain_graph=True)
        pprobs.sum().backward()
        results.append([t.detach() for t in out] + [xi.grad, pi.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("need", ["both", "permuted", "probs"])
def test_unpermute_backward_bf16_vs_fp64(need, device):
    # the fused backward (weighted gather + probs-gradient dots in one pass) against float64
    rmap, probs = _routing(4, "int64", device, seed=3)
    x = torch.randn(T, 80, device=device, dtype=torch.bfloat16)
    perm, _, rid = moe_permute(x, rmap, num_experts=E)
    y = torch.randn(perm.shape, device=device, dtype=torch.bfloat16).requires_grad_(need != "probs")
    w = probs.clone().requires_grad_(need != "permuted")
    out = moe_unpermute(y, rid, w)
    go = torch.randn(out.shape, device=device, dtype=torch.bfloat16)
    out.backward(go)
    y64 = y.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    r = rid.long()
    rows = y64[r.clamp(min=0)] * (r >= 0)[..., None]          # [T, K, H]
    out64 = (rows * w64[..., None]).sum(1)
    out64.backward(go.double())
    if need != "probs":
        assert snr_db(y64.grad, y.grad) >= 45.0
    else:
        assert y.grad is None
    if need != "permuted":
        assert snr_db(w64.grad, w.grad) >= 45.0
    else:
        assert w.grad is None


def test_wide_map_backward_vs_fp64(device):
    # map form wider than the unrolled limit (24 experts, top-3, padded segments): moe_permute's backward
    # (merge) and moe_unpermute's backward (token-major scatter + probs dots) through the packed map
    t, e, k = 50, 24, 3
    g = torch.Generator().manual_seed(21)
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    rmap = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.zeros(t, e).scatter_(1, idx, torch.rand(t, k, generator=g) + 0.1)
    x = torch.randn(t, 40, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
    w = probs.to(device).requires_grad_()
    perm, _, rid = moe_permute(x, rmap.to(device), pad_multiple=8)
    y = perm * 1.5
    out = moe_unpermute(y, rid, w)
    go = torch.randn(out.shape, generator=g).to(device=device, dtype=torch.bfloat16)
    out.backward(go)
    r = rid.long()
    x64 = x.detach().double()
    w64 = w.detach().double().requires_grad_()
    x64.requires_grad_()
    rows = torch.where((r >= 0)[..., None], (x64 * 1.5)[:, None, :].expand(t, e, -1), torch.zeros((), dtype=torch.float64))
    (rows * w64[..., None]).sum(1).backward(go.double())
    assert snr_db(x64.grad, x.grad) >= 40.0
    assert snr_db(w64.grad, w.grad) >= 40.0
    assert bool((w.grad[~rmap.to(device)] == 0).all())


def test_fused_map_choice(monkeypatch):
    """PRIMUS_TURBO_PERMUTE_FUSED_MAP: ``auto`` (unset) and ``1`` take the map kernels wherever the
    Triton backend runs (bool maps and top-k indices of any size), ``0`` the torch builder."""
    import importlib

    mp = importlib.import_module("primus_turbo.pytorch.ops.moe_permute")  # the module, not the op
    x = torch.empty(4, 8)
    monkeypatch.setattr(mp, "permute_backend", lambda t: "triton")
    for value, want in ((None, True), ("auto", True), ("1", True), ("0", False)):
        if value is None:
            monkeypatch.delenv("PRIMUS_TURBO_PERMUTE_FUSED_MAP", raising=False)
        else:
            monkeypatch.setenv("PRIMUS_TURBO_PERMUTE_FUSED_MAP", value)
        assert mp._fused_map(x) is want, value
    monkeypatch.setattr(mp, "permute_backend", lambda t: "torch")
    monkeypatch.setenv("PRIMUS_TURBO_PERMUTE_FUSED_MAP", "1")
    assert mp._fused_map(x) is False


def _no_cpu_asserts(monkeypatch):
    """The CUDA behaviour on CPU: the data checks that run on CPU only (async asserts) switched off."""
    import sys

    monkeypatch.setattr(sys.modules[moe_permute.__module__], "_cpu_assert", lambda *a, **k: None)


@pytest.mark.parametrize("weighted", [False, True])
def test_unpermute_row_map_past_the_buffer(weighted, device, monkeypatch):
    # a row map built for 8+ rows given fewer permuted rows: on CPU a clear error (moe_unpermute and
    # token_unpermute with the fused row map); on CUDA (no sync) the entries past the rows count as not
    # routed: never read (forward) or written (backward), zero probs gradient
    rmap, probs = _routing(2, "int64", device, seed=5)
    x = torch.randn(T, 32, device=device)
    perm, _, rid = moe_permute(x, rmap, num_experts=E)
    n = 40
    short = perm[:n]  # a view: an unmasked read past it would see the real rows behind
    w = probs if weighted else None
    if device == "cpu":
        with pytest.raises(RuntimeError, match=rf"moe_unpermute: row_id_map holds a row index >= "
                                               rf"permuted_tokens.shape\[0\] = {n}"):
            moe_unpermute(short, rid, w)
        rm, mp = _routing(2, "map", device, seed=5)
        p2, _, rid2, _ = token_permute(x, routing_map=rm, fused=True)
        with pytest.raises(RuntimeError, match=rf"token_unpermute: the row map \(sorted_indices\) holds a row "
                                               rf"index >= permuted_tokens.shape\[0\] = {n}"):
            token_unpermute(p2[:n], rid2, mp if weighted else None, fused=True)
        big = rid.clone()
        big[0, 0] = 10 ** 6
        with pytest.raises(RuntimeError, match="moe_unpermute: row_id_map holds a row index"):
            moe_unpermute(perm, big, w)
        _no_cpu_asserts(monkeypatch)
    bad = rid.clone()
    bad[0, 0] = 10 ** 6
    good = torch.where(bad < n, bad, -1)
    y = short.clone().requires_grad_()
    y_ref = short.clone().requires_grad_()
    wp = w.clone().requires_grad_() if weighted else None
    wp_ref = w.clone().requires_grad_() if weighted else None
    out = moe_unpermute(y, bad, wp)
    ref = moe_unpermute(y_ref, good, wp_ref)
    assert torch.equal(out, ref)
    go = torch.randn(out.shape, device=device)
    out.backward(go)
    ref.backward(go)
    assert torch.equal(y.grad, y_ref.grad)
    if weighted:
        assert torch.equal(wp.grad, wp_ref.grad) and bool((wp.grad[bad >= n] == 0).all())


def test_permute_int_args_not_coerced(device):
    # floats and bools are rejected, not rounded (pad_multiple=2.5 used to pad to 2, num_out_tokens=4.7 to 4)
    x = torch.randn(T, 16, device=device)
    rmap, _ = _routing(2, "map", device)
    idx, _ = _routing(2, "int64", device)
    cases = [(dict(pad_multiple=2.5), "pad_multiple must be an int, got 2.5"),
             (dict(pad_multiple=True), "pad_multiple must be an int, got True"),
             (dict(num_out_tokens=4.7), "num_out_tokens must be an int, got 4.7"),
             (dict(num_out_tokens=False), "num_out_tokens must be an int, got False"),
             (dict(num_experts=16.0), "num_experts must be an int, got 16.0")]
    for kw, msg in cases:
        with pytest.raises(TypeError, match=f"moe_permute: {msg}"):
            moe_permute(x, rmap, **kw)
    with pytest.raises(TypeError, match="moe_permute: num_experts must be an int, got 16.0"):
        moe_permute(x, idx, num_experts=16.0)
    with pytest.raises(TypeError, match="moe_permute: num_experts must be an int, got True"):
        moe_permute(x, idx, num_experts=True)
    with pytest.raises(ValueError, match="moe_permute: num_out_tokens must be >= 0, got -3"):
        moe_permute(x, rmap, num_out_tokens=-3)
    # NumPy ints are ints
    np = pytest.importorskip("numpy")
    a = moe_permute(x, idx, num_experts=np.int64(E), pad_multiple=np.int32(8), num_out_tokens=np.int64(T * 2 + E * 7))
    b = moe_permute(x, idx, num_experts=E, pad_multiple=8, num_out_tokens=T * 2 + E * 7)
    assert all(torch.equal(u, v) for u, v in zip(a, b) if u is not None)


def test_unpermute_restore_shape_errors(device):
    x = torch.randn(T, 16, device=device)
    rmap, probs = _routing(2, "map", device)
    perm, _, rid = moe_permute(x, rmap)
    for shape in ((T + 1, 16), (T, 8), (16, T), ()):
        with pytest.raises(ValueError, match=rf"moe_unpermute: restore_shape \[.*\] does not hold {T} tokens of "
                                             rf"hidden 16"):
            moe_unpermute(perm, rid, restore_shape=shape)
    with pytest.raises(ValueError, match=r"moe_unpermute: restore_shape must be a sequence of ints >= 0, got "
                                         r"\(64.0, 16\)"):
        moe_unpermute(perm, rid, restore_shape=(64.0, 16))
    assert moe_unpermute(perm, rid, restore_shape=(2, T // 2, 16)).shape == (2, T // 2, 16)
    # token ids past restore_shape's tokens: a clear error on CPU (no IndexError), dropped on CUDA
    p2, _, sidx, _ = token_permute(x, routing_map=rmap)
    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"token_unpermute: sorted_indices holds a token id >= 10, the "
                                               r"tokens of restore_shape \[10, 16\]"):
            token_unpermute(p2, sidx, restore_shape=(10, 16))
    with pytest.raises(ValueError, match=r"token_unpermute: restore_shape must be a sequence of ints"):
        token_unpermute(p2, sidx, restore_shape=(T, 16.0))


def test_unpermute_drops_ids_past_restore_shape_without_asserts(device, monkeypatch):
    # the CUDA behaviour (no sync): token ids >= T are dropped, never indexed
    if device == "cpu":
        _no_cpu_asserts(monkeypatch)
    x = torch.randn(T, 16, device=device)
    rmap, _ = _routing(2, "map", device)
    p2, _, sidx, _ = token_permute(x, routing_map=rmap)
    t = 10
    out = token_unpermute(p2, sidx, restore_shape=(t, 16))
    keep = (sidx >= 0) & (sidx < t)
    ref = torch.zeros(t, 16, device=device).index_add(0, sidx[keep], p2[keep])
    torch.testing.assert_close(out, ref)


def test_token_unpermute_routing_map_of_other_expert_count(device):
    x = torch.randn(T, 16, device=device)
    rmap, mprobs = _routing(2, "map", device)
    wider = torch.cat([rmap, torch.zeros(T, 4, dtype=torch.bool, device=device)], 1)
    # fused row map [T, E] with a routing map [T, E + 4]
    p2, _, rid, _ = token_permute(x, routing_map=rmap, fused=True)
    with pytest.raises(ValueError, match=rf"token_unpermute: routing_map \[{T}, {E + 4}\] does not match the row "
                                         rf"map \[{T}, {E}\]"):
        token_unpermute(p2, rid, routing_map=wider, fused=True)
    # sorted_indices: merging_probs of E experts with a routing map of E + 4
    p1, _, sidx, _ = token_permute(x, routing_map=rmap)
    with pytest.raises(ValueError, match=rf"token_unpermute: merging_probs has {E} experts, routing_map {E + 4}"):
        token_unpermute(p1, sidx, mprobs, routing_map=wider)
    # drop-and-pad rows (E x capacity) with a routing map whose expert count does not divide them
    pd, _, sd, _ = token_permute(x, E * 3, routing_map=rmap, drop_and_pad=True)
    with pytest.raises(ValueError, match=rf"token_unpermute: drop_and_pad rows \({E * 3}\) must be num_experts "
                                         rf"\({E + 4}, routing_map's columns\)"):
        token_unpermute(pd, sd, routing_map=wider, drop_and_pad=True)
    if device == "cpu":
        # the same rows grouped by another map (8 experts: pairs of the 16 folded): the merge would
        # add other rows; on CPU the data check catches it
        folded = rmap.view(T, E // 2, 2).any(-1)
        with pytest.raises(RuntimeError, match=rf"token_unpermute: sorted_indices do not match routing_map "
                                               rf"\[{T}, {E // 2}\]"):
            token_unpermute(p1, sidx, routing_map=folded)
        # the matching map still merges
        token_unpermute(p1, sidx, routing_map=rmap)


@pytest.mark.parametrize("fused_map", ["1", "0"])
@pytest.mark.parametrize("pad", [None, 8])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_topk_minus_one_is_not_routed(dtype, pad, fused_map, device, monkeypatch):
    # -1 in top-k indices = the slot routed to no expert (Primus-Turbo's indices_to_multihot masks it):
    # no row, row_id_map -1, its prob unused (0 gradient); the reference agrees (it once sent -1 to the
    # last expert through negative indexing)
    monkeypatch.setenv("PRIMUS_TURBO_PERMUTE_FUSED_MAP", fused_map)
    idx, probs = _routing(4, "int64", device, seed=2)
    idx = idx.clone()
    idx[::3, 1] = -1
    idx[5] = -1                 # a token with no expert at all
    idx = idx.to(dtype)
    x = torch.randn(T, 24, device=device)
    ref = moe_permute_ref(x.cpu(), idx.cpu(), probs.cpu(), pad_multiple=pad, num_experts=E)
    n_out = max(ref[0].shape[0], T * 4)  # the indices form sizes for every slot: spare rows past the routed ones
    xt = x.clone().requires_grad_()
    pt = probs.clone().requires_grad_()
    perm, pprobs, rid, tpe = moe_permute(xt, idx, pt, num_out_tokens=n_out, pad_multiple=pad, num_experts=E,
                                         return_tokens_per_expert=True)
    assert torch.equal(rid.cpu(), ref[2]) and bool((rid[idx < 0] == -1).all())
    assert torch.equal(perm[:ref[0].shape[0]].cpu(), ref[0]) and not perm[ref[0].shape[0]:].any()
    assert torch.equal(pprobs[:ref[0].shape[0]].cpu(), ref[1])
    assert torch.equal(tpe.cpu(), ref[3])
    if not pad:
        assert int(tpe.sum()) == int((idx >= 0).sum())
    (perm.sum() + (pprobs * 2).sum()).backward()
    assert bool((pt.grad[idx < 0] == 0).all()) and bool((pt.grad[idx >= 0] == 2).all())
    assert torch.equal(xt.grad.cpu(), (idx >= 0).sum(1, keepdim=True).float().cpu().expand(T, 24))
    # unpermute merges only the routed slots
    out = moe_unpermute(perm, rid, probs)
    torch.testing.assert_close(out.cpu(), moe_unpermute_ref(ref[0], ref[2], probs.cpu()))
    # other values outside [0, E) are an error (on CPU; on CUDA treated as -1)
    if device == "cpu":
        for v in (E, -2):
            bad = idx.clone()
            bad[0, 0] = v
            with pytest.raises(RuntimeError, match=rf"moe_permute: top-k indices must be in \[-1, num_experts={E}\)"):
                moe_permute(x, bad, num_experts=E)


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------
def _compiled_vs_eager(fn, args, fullgraph=True):
    """``fn(*args)`` eager and under ``torch.compile`` (aot_eager), each on its own copies of the leaf
    tensors: the outputs, and the gradients of every input that requires one under one random
    upstream gradient per float output, must be equal bit for bit (both run the same kernels; the
    compiled graph reaches them through the ops' custom ops)."""
    def run(f):
        leaves = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                  for a in args]
        outs = [o for o in f(*leaves) if o is not None]
        gen = torch.Generator().manual_seed(11)
        diff = [o for o in outs if o.requires_grad]
        if diff:
            sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in diff).backward()
        return outs, [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]

    torch._dynamo.reset()
    eager_outs, eager_grads = run(fn)
    comp_outs, comp_grads = run(torch.compile(fn, fullgraph=fullgraph, backend="aot_eager"))
    assert len(eager_outs) == len(comp_outs) and len(eager_grads) == len(comp_grads)
    for i, (a, b) in enumerate(zip(eager_outs + eager_grads, comp_outs + comp_grads)):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), f"output/grad {i} differs"


@pytest.mark.parametrize("form", ["map", "int32"])
def test_torch_compile_fullgraph(form, device):
    """With num_out_tokens given every output shape follows from the input shapes: permute (padded,
    with probs) and unpermute (merging probs) trace whole, forward and backward equal to eager."""
    topk, pad, h = 2, 8, 32
    rmap, probs = _routing(topk, form, device, seed=5)
    n_out = T * topk + E * (pad - 1)   # the worst case: nothing dropped, no host sync
    kw = _kw(form)

    def f(x, rmap, p, w):
        perm, pp, rid, tpe = moe_permute(x, rmap, p, num_out_tokens=n_out, pad_multiple=pad,
                                         return_tokens_per_expert=True, **kw)
        out = moe_unpermute(perm * 3.0, rid, w, restore_shape=(2, T // 2, h))
        return perm, pp, rid, tpe, out

    x = torch.randn(T, h, device=device, requires_grad=True)
    w = torch.rand(rmap.shape, device=device, requires_grad=True)
    _compiled_vs_eager(f, (x, rmap, probs.clone().requires_grad_(), w))


def test_torch_compile_fullgraph_other_forms(device):
    """The Primus-Turbo form (top-k indices with -1 slots, a capacity, top-k probs), FP8 tokens with
    their scales, and Megatron's token_permute / token_unpermute (fused row map) trace whole too."""
    topk, h = 2, 32
    idx, probs = _routing(topk, "int64", device, seed=6)
    idx = idx.clone()
    idx[::4, 1] = -1
    rmap, dense = _routing(topk, "map", device, seed=7)
    cap = T * topk + E * 15

    def primus(x, idx, p):
        perm, rid, tpe, overflow, nd, _ps, pp = moe_permute(x, idx, num_local_experts=E, num_topk=topk,
                                                            pad_multiple=16, num_permuted_tokens=cap, probs=p)
        out, up = moe_unpermute(perm * 2.0, rid, nd, restore_shape=x.shape, num_local_experts=E,
                                permuted_probs=pp * 0.5, probs_topk_stride=topk)
        return perm, rid, tpe, overflow, pp, out, up

    def fp8(x8, idx, s):
        perm, _pp, rid, ps = moe_permute(x8, idx, None, num_out_tokens=cap, pad_multiple=16, scales=s,
                                         num_experts=E)
        return perm, rid, ps

    def megatron(x, rmap, p):
        perm, pp, rid, tpe = token_permute(x, num_out_tokens=T * topk, probs=p, routing_map=rmap, fused=True)
        out = token_unpermute(perm * 2.0, rid, merging_probs=p, restore_shape=x.shape, routing_map=rmap,
                              fused=True)
        return perm, pp, rid, tpe, out

    x = torch.randn(T, h, device=device, requires_grad=True)
    _compiled_vs_eager(primus, (x, idx, probs.clone().requires_grad_()))
    x8 = (torch.randn(T, h, device=device) * 4).to(torch.float8_e4m3fn)
    _compiled_vs_eager(fp8, (x8, idx, torch.rand(T, 2, device=device)))
    _compiled_vs_eager(megatron, (x, rmap, dense.clone().requires_grad_()))


def test_torch_compile_data_dependent_size(device):
    """Without num_out_tokens the map form's row count is data (one host sync): under torch.compile
    the graph breaks there (fullgraph=False) and the result is still eager's."""
    rmap, probs = _routing(2, "map", device, seed=8)

    def f(x, rmap, p):
        perm, pp, rid = moe_permute(x, rmap, p, pad_multiple=8)
        return perm, pp, rid, moe_unpermute(perm, rid, p)

    x = torch.randn(T, 32, device=device, requires_grad=True)
    _compiled_vs_eager(f, (x, rmap, probs.clone().requires_grad_()), fullgraph=False)
