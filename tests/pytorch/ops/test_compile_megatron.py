"""Megatron's fused weight-gradient form (``fuse_bgrad_accum_pattern="megatron"``) under
``torch.compile(fullgraph=True)``, for every op that offers it: the output, the input's gradient
and ``main_grad``'s accumulation equal eager's bit for bit, the returned weight gradient is the
placeholder, and ``grad_added_to_main_grad`` is True after the forward, whether the parameter
had the attribute before (Megatron's DDP sets it False) or not.

The ops set that flag around their autograd Functions (``ops.gemm._flag_main_grad``): written
inside a Function's forward or backward it was a side effect dynamo could not trace, so each of
these calls failed under ``fullgraph=True`` (and broke the graph otherwise)."""

from __future__ import annotations

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float4QuantConfig, Float8QuantConfig, ScalingGranularity

_LENS = [24, 0, 64]  # an empty group; 88 routed rows of 96, so 8 rows past the groups
_M, _K = 96, 64


def _lens(device):
    return torch.tensor(_LENS, dtype=torch.int64, device=device)


_OPS = {
    # name: (weight shape, call(a, w, device))
    "gemm": ((96, _K), lambda a, w, d: turbo.ops.gemm(a, w, trans_b=True, fuse_bgrad_accum_pattern="megatron")),
    "gemm_fp8_rowwise": ((96, _K), lambda a, w, d: turbo.ops.gemm_fp8(
        a, w, trans_b=True, config=Float8QuantConfig(granularity=ScalingGranularity.ROWWISE),
        fuse_bgrad_accum_pattern="megatron")),
    "gemm_fp4": ((96, _K), lambda a, w, d: turbo.ops.gemm_fp4(
        a, w, trans_b=True, config=Float4QuantConfig(), fuse_bgrad_accum_pattern="megatron")),
    "grouped_gemm": ((3, 96, _K), lambda a, w, d: turbo.ops.grouped_gemm(
        a, w, _lens(d), trans_b=True, fuse_bgrad_accum_pattern="megatron")),
    "grouped_gemm_fp8_blockwise": ((3, 96, _K), lambda a, w, d: turbo.ops.grouped_gemm_fp8(
        a, w, _lens(d), config=Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=32),
        fuse_bgrad_accum_pattern="megatron")),
    "grouped_gemm_fp4": ((3, 96, _K), lambda a, w, d: turbo.ops.grouped_gemm_fp4(
        a, w, _lens(d), fuse_bgrad_accum_pattern="megatron")),
    "grouped_gemm_glu": ((3, 64, _K), lambda a, w, d: turbo.ops.grouped_gemm_glu(
        a, w, _lens(d), fuse_bgrad_accum_pattern="megatron")),
    "router_gating_linear": ((8, _K), lambda a, w, d: turbo.ops.router_gating_linear(
        a, w, None, fuse_bgrad_accum_pattern="megatron")),
}


@pytest.mark.parametrize("preset", [False, True], ids=["fresh", "ddp_flag"])
@pytest.mark.parametrize("name", list(_OPS))
def test_megatron_form_compiles_fullgraph(name, preset, device):
    torch.manual_seed(41)
    shape, call = _OPS[name]
    dtype = torch.bfloat16
    a0 = torch.randn(_M, _K, dtype=dtype, device=device)
    w0 = torch.randn(shape, dtype=dtype, device=device) * _K ** -0.5
    mg0 = torch.randn(shape, dtype=torch.float32, device=device)

    def op(a, w):
        return call(a, w, device)

    def run(fn):
        a, w = a0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        w.main_grad = mg0.clone()
        if preset:
            w.grad_added_to_main_grad = False
        out = fn(a, w)
        assert w.grad_added_to_main_grad is True  # set with the forward
        out.backward(torch.randn(out.shape, dtype=out.dtype, device=device, generator=_gen(device)))
        assert w.grad is not None and w.grad.shape == w.shape  # the placeholder reaches the parameter
        return out.detach(), a.grad, w.main_grad

    eager = run(op)
    torch._dynamo.reset()  # `op` is one code object for every case: start its cache over, not recompile
    compiled = run(torch.compile(op, fullgraph=True, backend="aot_eager"))
    assert not torch.equal(eager[2], mg0), "main_grad was not accumulated into"
    for what, x, y in zip(("out", "grad a", "main_grad"), eager, compiled):
        assert x.abs().sum() > 0 and x.dtype == y.dtype and torch.equal(x, y), what


def _gen(device):
    return torch.Generator(device=device).manual_seed(7)
