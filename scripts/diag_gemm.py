#!/usr/bin/env python3
"""Where does a GEMM forward+backward spend its time? Times the three training GEMMs one by one
(our Triton kernel and cuBLAS) and profiles the whole op, for a few shapes.

    PYTHONPATH=. PRIMUS_TURBO_PRINT_CONFIGS=1 python3 scripts/diag_gemm.py
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.triton.gemm.gemm_kernel import gemm_triton


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def main(shapes):
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        cases = {
            "fwd  a@w.T (NT)": ((a, w.t()), (m, n, k)),
            "dgrad g@w  (NN)": ((g, w), (m, k, n)),
            "wgrad g.T@a (TN)": ((g.t(), a), (n, k, m)),
        }
        for name, ((x, y), (mm, nn, kk)) in cases.items():
            t_tri = do_bench(lambda: gemm_triton(x, y), warmup=25, rep=100, return_mode="median")
            t_cub = do_bench(lambda: torch.mm(x, y), warmup=25, rep=100, return_mode="median")
            print(f"{m}x{n}x{k} {name}: triton {tflops(mm, nn, kk, t_tri):6.1f} TF  cublas {tflops(mm, nn, kk, t_cub):6.1f} TF  ratio {t_cub / t_tri:.3f}")
        a.requires_grad_(True)
        w.requires_grad_(True)
        for pin in (BackendType.TRITON, BackendType.TORCH):
            GlobalBackendManager.reset()
            GlobalBackendManager.set_gemm_backend(pin)

            def step():
                turbo.ops.gemm(a, w, trans_b=True).backward(g)

            step()
            t = do_bench(step, warmup=25, rep=100, grad_to_none=[a, w], return_mode="median")
            print(f"{m}x{n}x{k} op fwd+bwd {pin.name}: {t:.4f} ms = {3 * tflops(m, n, k, t):6.1f} TF")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    a.grad = w.grad = None
                    step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
        GlobalBackendManager.reset()


if __name__ == "__main__":
    main([(4096, 4096, 4096), (4096, 6144, 4096)] if len(sys.argv) < 2 else [tuple(map(int, s.split("x"))) for s in sys.argv[1:]])
