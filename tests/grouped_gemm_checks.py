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
