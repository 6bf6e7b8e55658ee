"""Host cost of small grouped-GEMM forward+backward steps, for an A/B of two source trees.

Run once per tree (``PYTHONPATH=<tree> python scripts/ab_grouped_host.py LABEL``): for each small
registry shape it times back-to-back eager steps (``out = grouped_gemm(...); out.backward(g)``,
one synchronize at the end, so the per-step time is host time where the host is the bottleneck),
alternating our op with ``torch._grouped_mm`` in several rounds (median of the rounds), then lists
the CUDA kernels one step of ours launches (torch.profiler). Prints two lines per shape, and for one
shape a cProfile table of where the Python host time goes."""
import cProfile
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import primus_turbo.pytorch as turbo

LABEL = sys.argv[1] if len(sys.argv) > 1 else "tree"
# (name, G, rows per group, N, K): Qwen3-30B-A3B / GPT-OSS-20B at EP 16 / 32, 1024 tokens per expert
SHAPES = [("qwen3_down_ep16", 8, 1024, 2048, 768), ("qwen3_gate_up_ep32", 4, 1024, 1536, 2048),
          ("qwen3_down_ep32", 4, 1024, 2048, 768), ("gptoss_gate_up_ep32", 1, 1024, 5760, 2880)]
ITERS, ROUNDS = 200, 5


def step_turbo(a, b, lens, g):
    turbo.ops.grouped_gemm(a, b, lens, trans_b=True).backward(g)


def step_torch(a, b, offs, g):
    torch._grouped_mm(a, b.transpose(1, 2), offs=offs).backward(g)


def per_step_us(fn, *args):
    for _ in range(10):
        fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(ITERS):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / ITERS * 1e6


def main():
    dev = "cuda"
    for name, G, m, N, K in SHAPES:
        a = torch.randn(G * m, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        lens = torch.full((G,), m, device=dev, dtype=torch.int64)
        offs = torch.cumsum(lens, 0).to(torch.int32)
        g = torch.randn(G * m, N, device=dev, dtype=torch.bfloat16)
        ours, peer = [], []
        for _ in range(ROUNDS):
            ours.append(per_step_us(step_turbo, a, b, lens, g))
            peer.append(per_step_us(step_torch, a, b, offs, g))
        us, peer_us = statistics.median(ours), statistics.median(peer)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step_turbo(a, b, lens, g)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{LABEL:6s} {name:22s} ours {us:8.1f} us  torch {peer_us:8.1f} us  "
              f"ratio {peer_us / us:.3f}  kernels {len(kernels)}", flush=True)
        print(f"{LABEL:6s}   kernels: " + "; ".join(k[:40] for k in kernels), flush=True)
        if name == SHAPES[1][0]:  # where the host time of one shape goes (Python functions)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(ITERS):
                step_turbo(a, b, lens, g)
            torch.cuda.synchronize()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
