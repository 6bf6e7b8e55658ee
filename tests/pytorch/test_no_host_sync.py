"""The training hot paths issue no device -> host synchronisation (the project's rule): each op's
forward and backward, in its documented no-sync form (e.g. ``num_out_tokens`` given to the
permutations), runs under ``primus_turbo.testing.host_sync.forbid_host_sync``, which flags
``.item()`` / ``bool(t)`` / ``nonzero`` / mask indexing and the library's own host reads on CPU
too (CI), and adds ``torch.cuda.set_sync_debug_mode("error")`` on a GPU. Inputs are built before the
guarded block; the documented syncs themselves are checked to be caught."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float4QuantConfig, Float8QuantConfig
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.testing.host_sync import HostSyncError, forbid_host_sync

O = turbo.ops
BF16 = torch.bfloat16


def _r(dev, *shape, grad=False, dtype=BF16):
    t = torch.randn(*shape, device=dev).to(dtype)
    return t.requires_grad_() if grad else t


def _topk(dev, t, e, k):
    return torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(dev)


def _backward(*outs):
    sum(o.float().sum() for o in outs).backward()


# name -> setup(device) returning a closure that runs forward + backward
CASES = {}


def _case(name):
    def reg(fn):
        CASES[name] = fn
        return fn
    return reg


@_case("gemm")
def _gemm(dev):
    a, b = _r(dev, 64, 96, grad=True), _r(dev, 96, 80, grad=True)
    return lambda: _backward(O.gemm(a, b))


for _g in ("TENSORWISE", "ROWWISE", "BLOCKWISE", "MX_BLOCKWISE"):
    @_case(f"gemm_fp8_{_g}")
    def _gemm_fp8(dev, g=_g):
        a, b = _r(dev, 64, 128, grad=True), _r(dev, 96, 128, grad=True)
        cfg = Float8QuantConfig(granularity=G[g], block_size=32 if g == "BLOCKWISE" else None)
        return lambda: _backward(O.gemm_fp8(a, b, trans_b=True, config=cfg))

    @_case(f"grouped_gemm_fp8_{_g}")
    def _grouped_fp8(dev, g=_g):
        a, b = _r(dev, 56, 128, grad=True), _r(dev, 3, 64, 128, grad=True)
        gl = torch.tensor([20, 0, 28], device=dev)
        cfg = Float8QuantConfig(granularity=G[g], block_size=32 if g == "BLOCKWISE" else None)
        return lambda: _backward(O.grouped_gemm_fp8(a, b, gl, config=cfg))


@_case("gemm_fp4")
def _gemm_fp4(dev):
    a, b = _r(dev, 64, 128, grad=True), _r(dev, 96, 128, grad=True)
    return lambda: _backward(O.gemm_fp4(a, b, trans_b=True, config=Float4QuantConfig()))


@_case("grouped_gemm")
def _grouped(dev):
    a, b = _r(dev, 56, 64, grad=True), _r(dev, 3, 64, 32, grad=True)
    gl = torch.tensor([20, 0, 28], device=dev)
    return lambda: _backward(O.grouped_gemm(a, b, gl))


@_case("grouped_gemm_fp4")
def _grouped_fp4(dev):
    a, b = _r(dev, 48, 128, grad=True), _r(dev, 3, 64, 128, grad=True)
    gl = torch.tensor([20, 0, 28], device=dev)
    return lambda: _backward(O.grouped_gemm_fp4(a, b, gl, config=Float4QuantConfig()))


@_case("flash_attn")
def _attn(dev):
    q, k, v = _r(dev, 2, 64, 4, 64, grad=True), _r(dev, 2, 64, 2, 64, grad=True), _r(dev, 2, 64, 2, 64, grad=True)
    return lambda: _backward(O.flash_attn_func(q, k, v, causal=True))


@_case("flash_attn_varlen")
def _attn_varlen(dev):
    q, k, v = _r(dev, 96, 4, 64, grad=True), _r(dev, 96, 2, 64, grad=True), _r(dev, 96, 2, 64, grad=True)
    cu = torch.tensor([0, 40, 96], dtype=torch.int32, device=dev)
    return lambda: _backward(O.flash_attn_varlen_func(q, k, v, cu, cu, 56, 56, causal=True))


@_case("flash_attn_fp8")
def _attn_fp8(dev):
    q, k, v = (_r(dev, 1, 64, 2, 64, grad=True) for _ in range(3))
    return lambda: _backward(O.flash_attn_fp8_func(q, k, v, causal=True))


@_case("router")
def _router(dev):
    logits = _r(dev, 64, 16, grad=True, dtype=torch.float32)

    def run():
        scores, probs, _map = O.fused_group_topk_routing_with_aux_score(logits, 4, groups=4, selected_groups=2)
        _backward(scores, probs)
    return run


@_case("router_expert_bias")
def _router_bias(dev):
    logits = _r(dev, 64, 16, grad=True, dtype=torch.float32)
    bias = torch.randn(16, device=dev) * 0.1

    def run():
        scores, probs, rmap = O.fused_group_topk_routing_with_aux_score(logits, 4, groups=4, selected_groups=2,
                                                                        expert_bias=bias)
        _backward(scores, probs)
        O.update_expert_bias(bias, rmap.sum(0), 1e-3)
    return run


@_case("moe_permute_indices")
def _permute_indices(dev):
    x, idx = _r(dev, 40, 32, grad=True), _topk(dev, 40, 8, 2)
    idx[3, 1] = -1  # a slot routed nowhere
    p = torch.rand(40, 2, device=dev, requires_grad=True)

    def run():
        y, pp, rid = O.moe_permute(x, idx, p, num_experts=8)
        _backward(O.moe_unpermute(y * pp[:, None].to(BF16), rid, p, restore_shape=(40, 32)))
    return run


@_case("moe_permute_map_padded")
def _permute_map(dev):
    x = _r(dev, 40, 32, grad=True)
    m = torch.zeros(40, 8, dtype=torch.bool, device=dev).scatter_(1, _topk(dev, 40, 8, 2), True)

    def run():
        y, _pp, rid, tpe = O.moe_permute(x, m, num_out_tokens=160, pad_multiple=8, return_tokens_per_expert=True)
        _backward(O.moe_unpermute(y, rid))
    return run


@_case("moe_permute_primus")
def _permute_primus(dev):
    x, idx = _r(dev, 40, 32, grad=True), _topk(dev, 40, 8, 2)
    p = torch.rand(40, 2, device=dev, requires_grad=True)

    def run():
        out = O.moe_permute(x, idx, num_local_experts=8, num_topk=2, num_permuted_tokens=120, probs=p)
        merged, probs_back = O.moe_unpermute(out[0], out[1], num_local_experts=8, restore_shape=(40, 32),
                                             permuted_probs=out[6], probs_topk_stride=2)
        _backward(merged, probs_back)
    return run


@_case("token_permute")
def _token_permute(dev):
    x = _r(dev, 40, 32, grad=True)
    m = torch.zeros(40, 8, dtype=torch.bool, device=dev).scatter_(1, _topk(dev, 40, 8, 2), True)
    p = torch.rand(40, 8, device=dev, requires_grad=True)

    def run():
        y, _pp, rmap, _tpe = O.token_permute(x, num_out_tokens=80, routing_map=m, fused=True)
        _backward(O.token_unpermute(y, rmap, p, restore_shape=(40, 32), routing_map=m, fused=True))
    return run


@_case("glu_with_probs")
def _glu(dev):
    x, p = _r(dev, 64, 128, grad=True), torch.rand(64, device=dev, requires_grad=True)
    mask = torch.tensor([10, 20, 5], device=dev)

    def run():
        row_mask = O.tokens_per_expert_to_mask(mask, 64)
        _backward(O.swiglu_with_probs(x, p, row_mask), O.geglu_with_probs(x, p, None))
    return run


@_case("rmsnorm")
def _norm(dev):
    x, res, gamma = _r(dev, 64, 128, grad=True), _r(dev, 64, 128, grad=True), _r(dev, 128, grad=True)
    return lambda: _backward(O.rmsnorm(x, gamma), *O.rmsnorm_residual(x, res, gamma))


@_case("quantizers")
def _quant(dev):
    x = _r(dev, 128, 256)

    def run():
        for g in G:
            O.quantize_fp8(x, torch.float8_e4m3fn, g, axis=None if g == G.TENSORWISE else -1)
        O.quantize_fp8_with_trans(x, torch.float8_e4m3fn, G.BLOCKWISE)
        O.quantize_fp4(x)
    return run


@_case("moe_layer_bf16")
def _moe(dev):
    layer = turbo.modules.MoELayer(64, 96, 8, 2, dtype=BF16, device=dev)
    x = _r(dev, 32, 64, grad=True)
    return lambda: _backward(layer(x, num_out_tokens=64))


@_case("moe_layer_fp8_blockwise")
def _moe_fp8(dev):
    cfg = Float8QuantConfig(granularity=G.BLOCKWISE, block_size=32)
    layer = turbo.modules.MoELayer(128, 128, 4, 2, dtype=BF16, device=dev, config=cfg, pad_multiple=32)
    x = _r(dev, 32, 128, grad=True)
    return lambda: _backward(layer(x, num_out_tokens=32 * 2 + 4 * 32))


@_case("float8_linear_microbatches")
def _f8_linear(dev):
    lin = turbo.modules.Float8Linear(128, 64, config=Float8QuantConfig(), dtype=BF16, device=dev)
    x = _r(dev, 32, 128, grad=True)

    def run():
        for first in (True, False):
            _backward(lin(x, is_first_microbatch=first))
    return run


@_case("grouped_linear")
def _grouped_linear(dev):
    gl_mod = turbo.modules.GroupedLinear(3, 64, 32, dtype=BF16, device=dev)
    x, gl = _r(dev, 48, 64, grad=True), torch.tensor([20, 0, 28], device=dev)
    return lambda: _backward(gl_mod(x, gl))


@pytest.mark.parametrize("name", list(CASES))
def test_hot_path_has_no_host_sync(name, device):
    run = CASES[name](device)
    with forbid_host_sync(name):
        run()


def test_documented_syncs_are_caught(device):
    """The guard is live for the ops above: the forms documented to read a total back do trip it."""
    x = _r(device, 10, 4)
    m = torch.ones(10, 3, dtype=torch.bool, device=device)
    with pytest.raises(HostSyncError, match="moe_permute without num_out_tokens"):
        with forbid_host_sync("moe_permute without num_out_tokens"):
            O.moe_permute(x, m)
    with pytest.raises(HostSyncError):
        with forbid_host_sync("token_permute without num_out_tokens"):
            O.token_permute(x, routing_map=m)


def _leaves(run) -> list:
    """The tensors ``run`` differentiates: its closure's leaf tensors that require grad and the
    parameters of its closure's modules."""
    out = []
    for cell in run.__closure__ or ():
        v = cell.cell_contents
        if isinstance(v, torch.Tensor) and v.requires_grad and v.is_leaf:
            out.append(v)
        elif isinstance(v, torch.nn.Module):
            out.extend(p for p in v.parameters() if p.requires_grad)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_hot_path_captures_in_a_cuda_graph(name):
    """No sync also means capturable: the forward + backward is captured in one CUDA graph and a
    replay gives the eager gradients (the same kernels in the same order; atomics may reorder fp32
    sums, hence SNR >= 60 dB rather than equality)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from primus_turbo.testing import snr_db

    run = CASES[name]("cuda")
    leaves = _leaves(run)

    def step():
        for t in leaves:
            t.grad = None
        run()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, allocates, autotunes) off the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    eager = [t.grad.detach().clone() if t.grad is not None else None for t in leaves]
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        run()
    for t in leaves:  # the graph's gradient buffers, poisoned before the replay writes them
        if t.grad is not None:
            t.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for t, want in zip(leaves, eager):
        if want is None:
            continue
        assert t.grad is not None and torch.isfinite(t.grad).all()
        assert snr_db(want.double(), t.grad.double()) >= 60, name
