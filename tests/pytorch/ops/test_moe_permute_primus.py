"""turbo.ops.moe_permute / moe_unpermute in the Primus-Turbo form (``num_local_experts`` given):
``(permuted_tokens, row_id_map, tokens_per_expert, overflow_flag, num_dispatched_tokens,
permuted_scaling_factor, permuted_probs)`` and ``(out, unpermuted_probs)``, against a row layout
built here with Python loops (expert-major, token order within an expert, per-expert padding, a
capacity cut) and fp64 sums."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.ops.moe_permute import moe_permute, moe_unpermute

T, E, H = 48, 8, 64
DEAD = 5  # an expert that never receives a token


def _routing(topk: int, form: str, device: str, seed: int = 0, unrouted=(), minus_one: bool = False):
    """Top-k routing of T tokens; ``unrouted`` tokens get no local expert; ``minus_one`` marks one slot
    of every third token -1 (a slot routed to an expert of another rank, as an EP dispatch gives)."""
    g = torch.Generator().manual_seed(seed * 31 + topk)
    scores = torch.rand(T, E, generator=g)
    scores[:, DEAD] = -1.0
    idx = scores.topk(topk, dim=1).indices
    if minus_one:
        idx[::3, 0] = -1
    idx[list(unrouted)] = -1
    probs_k = torch.rand(T, topk, generator=g) + 0.1
    mask = torch.zeros(T, E + 1, dtype=torch.bool).scatter_(1, torch.where(idx < 0, E, idx), True)[:, :E]
    dense_probs = torch.zeros(T, E + 1).scatter_(1, torch.where(idx < 0, E, idx), probs_k)[:, :E]
    emap = mask if form == "map" else idx.to(torch.int32 if form == "int32" else torch.int64)
    return emap.to(device), mask, idx, probs_k, dense_probs


def _layout(mask: torch.Tensor, pad: int):
    """(src_token, src_expert) of every row (-1 on padding rows) and the padded per-expert lengths."""
    src_t, src_e, lens = [], [], []
    for e in range(E):
        toks = [t for t in range(T) if bool(mask[t, e])]
        n = len(toks)
        seg = -(-n // pad) * pad if pad else n
        src_t += toks + [-1] * (seg - n)
        src_e += [e] * n + [-1] * (seg - n)
        lens.append(seg)
    return torch.tensor(src_t, dtype=torch.long), torch.tensor(src_e, dtype=torch.long), lens


@pytest.fixture(params=["1", "0"], ids=["fused_map", "torch_map"])
def map_mode(request, monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_PERMUTE_FUSED_MAP", request.param)
    return request.param


@pytest.mark.parametrize("pad", [0, 8])
@pytest.mark.parametrize("form,layout", [("map", "routing_map"), ("int32", "topk"), ("int64", "topk"),
                                         ("int64", "routing_map")])
def test_permute_unpermute_vs_layout(form, layout, pad, map_mode, device):
    topk = 3
    emap, mask, idx, probs_k, dense_probs = _routing(topk, form, device, unrouted=(7,), minus_one=form != "map")
    src_t, src_e, lens = _layout(mask, pad)
    n = src_t.numel()
    x = torch.randn(T, H, dtype=torch.float64).to(torch.bfloat16)
    probs_in = (probs_k if layout == "topk" else dense_probs).to(device)
    xt = x.to(device).requires_grad_(True)
    pt = probs_in.clone().requires_grad_(True)
    out = moe_permute(xt, emap, num_local_experts=E, num_topk=0 if form == "map" else topk, pad_multiple=pad,
                      probs=pt, probs_layout=layout)
    assert len(out) == 7
    perm, rid, tpe, overflow, ndisp, pscale, pprobs = out
    real = src_t >= 0
    want = torch.zeros(n, H, dtype=torch.bfloat16)
    want[real] = x[src_t[real]]
    assert perm.shape == (n, H) and torch.equal(perm.cpu(), want)
    assert tpe.dtype == torch.int64 and tpe.cpu().tolist() == lens
    assert int(overflow) == 0 and overflow.dtype == torch.int32
    assert int(ndisp) == T
    assert pscale is None
    want_p = torch.zeros(n)
    want_p[real] = dense_probs[src_t[real], src_e[real]]
    assert torch.equal(pprobs.detach().cpu(), want_p)

    # permute backward: each token gets the sum of its rows' grads; each routed prob its row's grad
    g = torch.randn(n, H, dtype=torch.float64)
    gp = torch.randn(n)
    torch.autograd.backward([perm, pprobs], [g.to(torch.bfloat16).to(device), gp.to(device)])
    g_tok = torch.zeros(T, H, dtype=torch.float64)
    g_tok.index_add_(0, src_t[real], g.to(torch.bfloat16).double()[real])
    assert torch.allclose(xt.grad.cpu().double(), g_tok, rtol=1e-2, atol=1e-2)
    g_dense = torch.zeros(T, E)
    g_dense[src_t[real], src_e[real]] = gp[real]
    want_gp = g_dense if layout == "routing_map" else torch.where(
        idx >= 0, g_dense.gather(1, idx.clamp(min=0)), torch.zeros(()))
    assert torch.equal(pt.grad.cpu(), want_gp)

    # unpermute: an unweighted sum of each token's rows, the probs restored in the permute's layout
    y = torch.randn(n, H, dtype=torch.float64)
    yt = y.to(torch.bfloat16).to(device).requires_grad_(True)
    ppt = torch.rand(n).to(device).requires_grad_(True)
    stride = topk if layout == "topk" else 0
    back, uprobs = moe_unpermute(yt, rid, ndisp, restore_shape=xt.shape, num_local_experts=E,
                                 permuted_probs=ppt, probs_topk_stride=stride, pad_multiple=pad)
    want_out = torch.zeros(T, H, dtype=torch.float64)
    want_out.index_add_(0, src_t[real], y.to(torch.bfloat16).double()[real])
    assert back.dtype == torch.bfloat16 and back.shape == (T, H)
    assert torch.allclose(back.cpu().double(), want_out, rtol=1e-2, atol=1e-2)
    assert torch.equal(back[7].cpu(), torch.zeros(H, dtype=torch.bfloat16))   # unrouted token
    up_dense = torch.zeros(T, E)
    up_dense[src_t[real], src_e[real]] = ppt.detach().cpu()[real]
    want_up = up_dense if layout == "routing_map" else torch.where(
        idx >= 0, up_dense.gather(1, idx.clamp(min=0)), torch.zeros(()))
    assert torch.equal(uprobs.detach().cpu(), want_up)
    go = torch.randn(T, H)
    gu = torch.randn(want_up.shape)
    torch.autograd.backward([back, uprobs], [go.to(torch.bfloat16).to(device), gu.to(device)])
    want_gy = torch.zeros(n, H, dtype=torch.bfloat16)
    want_gy[real] = go.to(torch.bfloat16)[src_t[real]]
    assert torch.equal(yt.grad.cpu(), want_gy)   # padding rows: zero
    g_up = gu if layout == "routing_map" else torch.zeros(T, E + 1).scatter_(
        1, torch.where(idx < 0, E, idx), gu)[:, :E]
    want_gpp = torch.zeros(n)
    want_gpp[real] = g_up[src_t[real], src_e[real]]
    assert torch.equal(ppt.grad.cpu(), want_gpp)


@pytest.mark.parametrize("form", ["map", "int64"])
@pytest.mark.parametrize("pad", [0, 8])
def test_capacity_and_overflow(form, pad, map_mode, device):
    topk = 2
    emap, mask, *_ = _routing(topk, form, device, seed=3)
    src_t, _src_e, lens = _layout(mask, pad)
    total = src_t.numel()
    x = torch.randn(T, H, device=device)
    kw = dict(num_local_experts=E, num_topk=0 if form == "map" else topk, pad_multiple=pad,
              probs_layout="routing_map")
    starts = [sum(lens[:e]) for e in range(E)]
    for cap, flag in [(total, 0), (total + 24, 0), (total - 1, 1), (total // 2, 1), (1, 1)]:
        perm, rid, tpe, overflow, *_ = moe_permute(x, emap, num_permuted_tokens=cap, **kw)
        assert perm.shape == (cap, H)
        assert int(overflow) == flag, (cap, total)
        keep = min(cap, total)
        want = torch.zeros(cap, H)
        st = src_t[:keep]
        want[:keep][st >= 0] = x.cpu()[st[st >= 0]]
        assert torch.equal(perm.cpu(), want)   # the leading rows survive; the tail past the routed rows is zero
        assert tpe.cpu().tolist() == [max(0, min(lens[e], cap - starts[e])) for e in range(E)]
        # dropped pairs come back as nothing: unpermute sums only the rows that were kept
        back, _ = moe_unpermute(perm, rid, None, restore_shape=(T, H), num_local_experts=E)
        want_back = torch.zeros(T, H, dtype=torch.float64)
        kept = st >= 0
        want_back.index_add_(0, st[kept], x.cpu().double()[st[kept]])
        assert torch.allclose(back.cpu().double(), want_back, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_tokens_and_scaling_factor(fp8, device):
    emap, mask, idx, probs_k, _ = _routing(2, "int64", device, seed=5)
    src_t, _, _ = _layout(mask, 16)
    x = (torch.randn(T, H) * 4).to(fp8).to(device)
    sf = torch.rand(T, 2, device=device) + 0.5
    perm, rid, tpe, overflow, _, psf, pprobs = moe_permute(
        x, emap, num_local_experts=E, num_topk=2, pad_multiple=16, scaling_factor=sf, scales_per_token=2,
        use_fp8=True, probs=probs_k.to(device))
    real = src_t >= 0
    assert perm.dtype == fp8
    assert torch.equal(perm.cpu()[real].view(torch.uint8), x.cpu()[src_t[real]].view(torch.uint8))
    assert torch.equal(perm.cpu()[~real].view(torch.uint8), torch.zeros_like(perm.cpu()[~real].view(torch.uint8)))
    want = torch.zeros(src_t.numel(), 2)
    want[real] = sf.cpu()[src_t[real]]
    assert torch.equal(psf.cpu(), want)


def test_empty_dispatch(device):
    x = torch.randn(0, H, device=device, requires_grad=True)
    emap = torch.zeros(0, E, dtype=torch.bool, device=device)
    probs = torch.rand(0, E, device=device, requires_grad=True)
    perm, rid, tpe, overflow, ndisp, psf, pprobs = moe_permute(
        x, emap, num_local_experts=E, pad_multiple=8, probs=probs, probs_layout="routing_map")
    assert perm.shape == (0, H) and pprobs.shape == (0,) and psf is None
    assert tpe.cpu().tolist() == [0] * E and int(overflow) == 0 and int(ndisp) == 0
    torch.autograd.backward([perm, pprobs], [torch.zeros_like(perm), torch.zeros_like(pprobs)])
    assert x.grad.shape == (0, H) and probs.grad.shape == (0, E)
    y = torch.randn(0, H, device=device, requires_grad=True)
    out, up = moe_unpermute(y, rid, ndisp, restore_shape=(0, H), num_local_experts=E,
                            permuted_probs=torch.rand(0, device=device))
    assert out.shape == (0, H) and up.shape == (0, E)
    out.backward(torch.zeros_like(out))
    assert y.grad.shape == (0, H)


def test_matches_routing_map_form(device):
    # the two forms share the permutation: same rows and segment lengths
    emap, mask, idx, probs_k, _ = _routing(4, "int64", device, seed=8)
    x = torch.randn(T, H, device=device)
    a = moe_permute(x, emap, probs_k.to(device), pad_multiple=8, num_experts=E, num_out_tokens=T * 4 + E * 7,
                    return_tokens_per_expert=True)
    b = moe_permute(x, topk_indices=emap, num_local_experts=E, num_topk=4, pad_multiple=8,
                    num_permuted_tokens=T * 4 + E * 7, probs=probs_k.to(device))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[6]) and torch.equal(a[3], b[2])


def test_errors(device):
    x = torch.randn(T, H, device=device)
    emap, mask, idx, probs_k, dense = _routing(2, "int64", device)
    rmap = mask.to(device)
    cases = [
        (lambda: moe_permute(x, emap, num_local_experts=0), ValueError, "num_local_experts must be a positive"),
        (lambda: moe_permute(x, num_local_experts=E), ValueError, "exactly one of expert_map"),
        (lambda: moe_permute(x, emap, expert_map=emap, num_local_experts=E), ValueError, "exactly one"),
        (lambda: moe_permute(x, rmap[:, :5], num_local_experts=E), ValueError, "5 columns, num_local_experts=8"),
        (lambda: moe_permute(x, emap, num_local_experts=E, num_topk=3), ValueError, "num_topk=3 but"),
        (lambda: moe_permute(x, emap.float(), num_local_experts=E), TypeError, "bool or int32/int64"),
        (lambda: moe_permute(x, topk_indices=rmap, num_local_experts=E), TypeError, "topk_indices must be"),
        (lambda: moe_permute(x, emap[:4], num_local_experts=E), ValueError, "T=48"),
        (lambda: moe_permute(x, emap, num_local_experts=E, probs_layout="dense"), ValueError, "probs_layout"),
        (lambda: moe_permute(x, rmap, num_local_experts=E, probs=dense.to(device)), ValueError,
         "probs_layout='topk' needs top-k indices"),
        (lambda: moe_permute(x, emap, num_local_experts=E, probs=dense.to(device)), ValueError,
         r"must be \[48, 2\], got \[48, 8\]"),
        (lambda: moe_permute(x, emap, num_local_experts=E, probs=probs_k.to(device).int()), TypeError,
         "floating-point"),
        (lambda: moe_permute(x, emap, num_local_experts=E, pad_multiple=-8), ValueError, "pad_multiple"),
        (lambda: moe_permute(x, emap, num_local_experts=E, scaling_factor=torch.ones(T, 1, device=device)),
         ValueError, "only with use_fp8=True"),
        (lambda: moe_permute(x, emap, num_local_experts=E, use_fp8=True), TypeError, "1-byte FP8 tokens"),
        (lambda: moe_permute(x.to(torch.float8_e4m3fn), emap, num_local_experts=E, use_fp8=True,
                             scaling_factor=torch.ones(T, 2, device=device)), ValueError, "scales_per_token > 0"),
        (lambda: moe_permute(x.to(torch.float8_e4m3fn), emap, num_local_experts=E, use_fp8=True,
                             scaling_factor=torch.ones(T, 3, device=device), scales_per_token=2), ValueError,
         "scales_per_token=2"),
        (lambda: moe_permute(x, emap, num_local_experts=E, num_out_tokens=96), ValueError,
         "num_out_tokens belong to the routing_map form"),
        (lambda: moe_permute(x, emap, num_experts=E, num_permuted_tokens=96), ValueError,
         "num_permuted_tokens belong to the Primus-Turbo form"),
    ]
    if device != "cpu":
        cases.append((lambda: moe_permute(x, emap.cpu(), num_local_experts=E), ValueError, "expert_map is on"))
    perm, rid, _, _, nd, _, pp = moe_permute(x, emap, num_local_experts=E, num_topk=2, probs=probs_k.to(device))
    n = perm.shape[0]
    cases += [
        (lambda: moe_unpermute(perm, rid, nd, num_local_experts=E), ValueError, "restore_shape"),
        (lambda: moe_unpermute(perm, rid, nd, restore_shape=(T + 1, H), num_local_experts=E), ValueError,
         "does not hold 48 tokens"),
        (lambda: moe_unpermute(perm, rid[:, :4], nd, restore_shape=(T, H), num_local_experts=E), ValueError,
         "row_id_map must be the int32 map"),
        (lambda: moe_unpermute(perm, rid[:, :E + 1], nd, restore_shape=(T, H), num_local_experts=E), ValueError,
         "row_id_map has 9 columns"),
        (lambda: moe_unpermute(perm, rid.long(), nd, restore_shape=(T, H), num_local_experts=E), ValueError,
         "int32"),
        (lambda: moe_unpermute(perm, rid, 48, restore_shape=(T, H), num_local_experts=E), TypeError,
         "num_dispatched_tokens_tensor"),
        (lambda: moe_unpermute(perm, rid, nd, restore_shape=(T, H), num_local_experts=E, permuted_probs=pp[:3]),
         ValueError, f"one entry per permuted row \\({n}\\)"),
        (lambda: moe_unpermute(perm, rid, nd, restore_shape=(T, H), num_local_experts=E, permuted_probs=pp,
                               probs_topk_stride=4), ValueError, "top-2 indices"),
        (lambda: moe_unpermute(perm, rid, permuted_probs=pp), ValueError, "Primus-Turbo form"),
        (lambda: moe_unpermute(perm.int(), rid, nd, restore_shape=(T, H), num_local_experts=E), TypeError,
         "bf16/fp16/fp32"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()


@pytest.mark.parametrize("form,stride", [("int64", 0), ("int64", 3), ("map", 0)])
def test_unpermute_num_dispatched_tokens_keyword(form, stride, device):
    """``num_dispatched_tokens_tensor=`` by keyword (Primus-Turbo's name) gives what the third
    positional argument gives (outputs and gradients), and matches an fp64 sum of the layout."""
    topk = 3
    emap, mask, idx, probs_k, dense_probs = _routing(topk, form, device, seed=9, minus_one=form != "map")
    x = torch.randn(T, H, device=device)
    probs = probs_k if form != "map" else dense_probs
    perm, rid, _, _, nd, _, pp = moe_permute(x, emap, num_local_experts=E, pad_multiple=8, probs=probs.to(device),
                                             probs_layout="topk" if form != "map" else "routing_map")
    y = torch.randn(perm.shape, generator=torch.Generator().manual_seed(3)).to(device)
    gq = torch.rand(pp.shape, generator=torch.Generator().manual_seed(4)).to(device)
    res = []
    for by_kw in (False, True):
        yt, qt = y.clone().requires_grad_(True), gq.clone().requires_grad_(True)
        kw = dict(restore_shape=(T, H), num_local_experts=E, permuted_probs=qt, probs_topk_stride=stride)
        if by_kw:
            out, up = moe_unpermute(yt, rid, num_dispatched_tokens_tensor=nd, **kw)
        else:
            out, up = moe_unpermute(yt, rid, nd, **kw)
        g = torch.Generator().manual_seed(5)
        torch.autograd.backward([out, up], [torch.randn(out.shape, generator=g).to(device),
                                            torch.randn(up.shape, generator=g).to(device)])
        res.append((out.detach(), up.detach(), yt.grad, qt.grad))
    for a, b in zip(*res):
        assert torch.equal(a, b)
    # fp64 reference of the merge: each token sums its rows
    src_t, _, _ = _layout(mask, 8)
    want = torch.zeros(T, H, dtype=torch.float64)
    ok = src_t >= 0
    want.index_add_(0, src_t[ok], y.cpu().double()[ok])
    torch.testing.assert_close(res[1][0].cpu().double(), want, rtol=1e-6, atol=1e-6)


def test_unpermute_num_dispatched_tokens_keyword_errors(device):
    x = torch.randn(T, H, device=device)
    emap, mask, idx, probs_k, dense = _routing(2, "int64", device)
    perm, rid, _, _, nd, _, pp = moe_permute(x, emap, num_local_experts=E, num_topk=2)
    with pytest.raises(TypeError, match="got num_dispatched_tokens_tensor both as the third positional argument "
                                        "and by keyword"):
        moe_unpermute(perm, rid, nd, restore_shape=(T, H), num_local_experts=E, num_dispatched_tokens_tensor=nd)
    with pytest.raises(TypeError, match="num_dispatched_tokens_tensor belongs to the Primus-Turbo form, which needs "
                                        "num_local_experts"):
        moe_unpermute(perm, rid, restore_shape=(T, H), num_dispatched_tokens_tensor=nd)
    with pytest.raises(TypeError, match="num_dispatched_tokens_tensor must be the tensor moe_permute returned"):
        moe_unpermute(perm, rid, restore_shape=(T, H), num_local_experts=E, num_dispatched_tokens_tensor=T)


@pytest.mark.gpu
def test_no_host_sync_with_capacity():
    dev = "cuda"
    emap, mask, idx, probs_k, dense = _routing(2, "int64", dev, minus_one=True)
    rmap, probs_k, dense = mask.to(dev), probs_k.to(dev), dense.to(dev)   # copies before the check
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    cap = T * 2 + E * 15
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for em, kw in ((emap, dict(num_topk=2, probs=probs_k)),
                       (rmap, dict(probs=dense, probs_layout="routing_map"))):
            perm, rid, tpe, of, nd, _, pp = moe_permute(x, em, num_local_experts=E, pad_multiple=16,
                                                        num_permuted_tokens=cap, **kw)
            out, up = moe_unpermute(perm, rid, nd, restore_shape=x.shape, num_local_experts=E, permuted_probs=pp,
                                    probs_topk_stride=kw.get("num_topk", 0), pad_multiple=16)
            (out.float().sum() + up.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_unpermute_row_map_past_the_buffer(device, monkeypatch):
    """A row map built for more rows than permuted_tokens holds: on CPU a clear error; on CUDA (no sync)
    those entries are not routed (the merge never reads past the rows; unpermuted probs 0 there). A slot
    column outside [0, E] (not a map moe_permute returns) likewise."""
    import sys

    x = torch.randn(T, H, device=device)
    emap, mask, idx, probs_k, _ = _routing(2, "int64", device, minus_one=True)
    perm, rid, _, _, nd, _, pp = moe_permute(x, emap, num_local_experts=E, num_topk=2, probs=probs_k.to(device))
    n = 30
    short, pshort = perm[:n], pp[:n]
    kw = dict(restore_shape=(T, H), num_local_experts=E, permuted_probs=pshort, probs_topk_stride=2)
    badcol = rid.clone()
    badcol[0, E + 1] = E + 5
    if device == "cpu":
        with pytest.raises(RuntimeError, match=rf"moe_unpermute: row_id_map holds a row index >= "
                                               rf"permuted_tokens.shape\[0\] = {n}"):
            moe_unpermute(short, rid, nd, **kw)
        with pytest.raises(RuntimeError, match=rf"moe_unpermute: row_id_map's slot columns \(after column {E}\) must "
                                               rf"be in \[0, num_local_experts={E}\]"):
            moe_unpermute(perm, badcol, nd, restore_shape=(T, H), num_local_experts=E)
        monkeypatch.setattr(sys.modules[moe_unpermute.__module__], "_cpu_assert", lambda *a, **k: None)
    good = torch.where(rid < n, rid, -1)
    for stride in (0, 2):
        kw["probs_topk_stride"] = stride
        out, up = moe_unpermute(short, rid, nd, **kw)
        out_r, up_r = moe_unpermute(short, good, nd, **kw)
        assert torch.equal(out, out_r) and torch.equal(up, up_r)
    out, _ = moe_unpermute(perm, badcol, nd, restore_shape=(T, H), num_local_experts=E)
    fixed = rid.clone()
    fixed[0, E + 1] = E           # the spare column: no row
    assert torch.equal(out, moe_unpermute(perm, fixed, nd, restore_shape=(T, H), num_local_experts=E)[0])


def test_int_args_not_coerced(device):
    x = torch.randn(T, H, device=device)
    emap = _routing(2, "int64", device)[0]
    with pytest.raises(TypeError, match=r"moe_permute: num_permuted_tokens must be an int, got 100.5"):
        moe_permute(x, emap, num_local_experts=E, num_permuted_tokens=100.5)
    with pytest.raises(TypeError, match=r"moe_permute: num_topk must be an int, got 2.0"):
        moe_permute(x, emap, num_local_experts=E, num_topk=2.0)
    with pytest.raises(ValueError, match=r"moe_permute: num_permuted_tokens must be >= -1, got -5"):
        moe_permute(x, emap, num_local_experts=E, num_permuted_tokens=-5)
    with pytest.raises(ValueError, match=r"moe_permute: pad_multiple must be an int >= 0, got 2.5"):
        moe_permute(x, emap, num_local_experts=E, pad_multiple=2.5)
