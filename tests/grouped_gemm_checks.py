"""Shared checks of the grouped low-precision GEMM op tests (FP8 and MXFP4)."""

from __future__ import annotations

import torch

from primus_turbo.testing import grouped_gemm_ref, grouped_gemm_variable_k_ref, snr_db


def check_grouped_op(op, a, b, gl, trans_b, min_snr, out_dtype=None, **kwargs):
    """``op(a, b, gl, trans_b=..., out_dtype=..., **kwargs)`` forward and backward against the float64
    references: output, grad of a, grad of b (SNR >= ``min_snr``); rows past the routed ones zero in
    the output and grad of a; empty groups' weight gradients zero; all-empty routing gives zeros."""
    a = a.detach().requires_grad_()
    b = b.detach().requires_grad_()
    out = op(a, b, gl, trans_b=trans_b, out_dtype=out_dtype, **kwargs)
    n = b.shape[1] if trans_b else b.shape[2]
    assert out.shape == (a.shape[0], n) and out.dtype == (out_dtype or a.dtype)
    routed = int(gl.sum())
    dc = torch.randn_like(out)
    out.backward(dc)
    assert a.grad.shape == a.shape and a.grad.dtype == a.dtype
    assert b.grad.shape == b.shape and b.grad.dtype == b.dtype
    for t in (out, a.grad):
        assert torch.equal(t[routed:], torch.zeros_like(t[routed:]))
    if routed == 0:
        assert not out.any() and not a.grad.any() and not b.grad.any()
        return
    assert snr_db(grouped_gemm_ref(a, b, gl, trans_b), out) >= min_snr
    assert snr_db(grouped_gemm_ref(dc, b, gl, trans_b=not trans_b), a.grad) >= min_snr
    ref_db = grouped_gemm_variable_k_ref(dc, a, gl) if trans_b else grouped_gemm_variable_k_ref(a, dc, gl)
    assert snr_db(ref_db, b.grad) >= min_snr
    for g in range(len(gl)):
        if int(gl[g]) == 0:
            assert not b.grad[g].any()


def check_compiled_matches_eager(op, a0, b0, gl, fuse, backend="aot_eager", **kwargs):
    """``op(a, b, gl, **kwargs)`` (a grouped low-precision GEMM) eager and under
    ``torch.compile(fullgraph=True, backend=backend)``: the output and the gradients of ``a`` and ``b``
    (or, with ``fuse``, ``b.main_grad`` after Megatron's accumulation) equal bit for bit, nonzero, the
    rows past the routed ones zero, and ``grad_added_to_main_grad`` set with ``fuse``. With inductor,
    which generates its own kernels for the glue between our custom ops, >= 60 dB against eager
    instead of bit for bit (a tensor the generated code got wrong reads near 0 dB)."""
    dy = torch.randn(a0.shape[0], b0.shape[1] if kwargs.get("trans_b", True) else b0.shape[2],
                     dtype=a0.dtype, device=a0.device)
    mg0 = torch.randn(b0.shape, dtype=torch.float32, device=b0.device)

    def call(a, b):
        return op(a, b, gl, fuse_bgrad_accum_pattern="megatron" if fuse else None, **kwargs)

    def run(fn):
        a, b = a0.clone().requires_grad_(), torch.nn.Parameter(b0.clone())
        if fuse:
            b.main_grad = mg0.clone()
        out = fn(a, b)
        out.backward(dy)
        assert not fuse or b.grad_added_to_main_grad is True
        return out.detach(), a.grad, (b.main_grad if fuse else b.grad)

    eager = run(call)
    torch._dynamo.reset()  # `call` is one code object for every case: start its cache over, not recompile
    compiled = run(torch.compile(call, fullgraph=True, backend=backend))
    routed = int(gl.sum())
    assert routed < a0.shape[0] and not eager[0][routed:].any()
    for name, x, y in zip(("out", "grad a", "grad b"), eager, compiled):
        assert x.abs().sum() > 0 and x.dtype == y.dtype, name
        if backend == "inductor":
            assert snr_db(x.double(), y) >= 60.0, f"{name}: {snr_db(x.double(), y):.1f} dB against eager"
        else:
            assert torch.equal(x, y), name
