"""primus-turbo quick start: the minimal example, then every available op checked against its
float64 reference, on whatever machine this is.

    python examples/quickstart.py

On a CUDA machine it runs on the GPU and also times each op against PyTorch; without one it runs
on the CPU, with the Triton kernels going through the Triton interpreter.
"""

from __future__ import annotations

import os
import sys
import time

import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: the interpreter runs Triton kernels on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A demo should answer in seconds: the Triton GEMM uses its analytic default config instead of
# timing its candidates for every new shape (set PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE=1 to tune).
os.environ.setdefault("PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE", "0")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import primus_turbo.pytorch as turbo  # noqa: E402
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager  # noqa: E402
from primus_turbo.testing import snr_db  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # The interpreter's bf16 tl.dot multiplies bit patterns (triton issue #11584); opt in to the
    # repair so the TRITON rows compute real bf16 products on CPU.
    from primus_turbo.triton.interpreter import fix_bf16_dot

    fix_bf16_dot()


def minimal_example() -> None:
    a = torch.randn(256, 512, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(512, 128, device=DEVICE, dtype=torch.bfloat16)
    c = turbo.ops.gemm(a, b)
    print(f"c = turbo.ops.gemm(a, b): a{tuple(a.shape)} @ b{tuple(b.shape)} -> c{tuple(c.shape)} {c.dtype} on {c.device}")


def _time_ms(fn) -> float:
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _gemm_case(backend, layout, dtype):
    m, n, k = (4096, 4096, 4096) if DEVICE == "cuda" else (64, 48, 32)
    ta, tb = layout[0] == "T", layout[1] == "T"
    a = torch.randn((k, m) if ta else (m, k), device=DEVICE, dtype=dtype, requires_grad=True)
    b = torch.randn((n, k) if tb else (k, n), device=DEVICE, dtype=dtype, requires_grad=True)
    grad = torch.randn(m, n, device=DEVICE, dtype=dtype)
    GlobalBackendManager.reset()
    if backend is not None:
        GlobalBackendManager.set_gemm_backend(backend)
    out = turbo.ops.gemm(a, b, trans_a=ta, trans_b=tb)
    out.backward(grad)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = (a64.t() if ta else a64) @ (b64.t() if tb else b64)
    ref.backward(grad.double())
    snr = min(snr_db(ref, out), snr_db(a64.grad, a.grad), snr_db(b64.grad, b.grad))
    row = {"op": "gemm", "case": f"{layout} {str(dtype).replace('torch.', '')} {m}x{n}x{k}",
           "backend": backend.name if backend else "default", "snr_db": snr, "ok": snr >= 45.0}
    if DEVICE == "cuda":
        A, B = a.detach(), b.detach()
        ms = _time_ms(lambda: turbo.ops.gemm(A, B, trans_a=ta, trans_b=tb))
        peer = _time_ms(lambda: (A.t() if ta else A) @ (B.t() if tb else B))
        row.update(ms=ms, torch_ms=peer, speedup=peer / ms, tflops=2 * m * n * k / ms / 1e9)
    GlobalBackendManager.reset()
    return row


def _quant_case(granularity):
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe
    from primus_turbo.testing import quantize_fp8_ref

    rows, cols = (4096, 7168) if DEVICE == "cuda" else (64, 256)
    x = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
    kw = {"scaling_recipe": ScalingRecipe(use_2d_block=True)} if granularity == "BLOCKWISE_2D" else {}
    g = turbo.ScalingGranularity.BLOCKWISE if granularity == "BLOCKWISE_2D" else turbo.ScalingGranularity[granularity]
    q, s = turbo.ops.quantize_fp8(x, turbo.float8_e4m3, g, **kw)
    q_ref, s_ref = quantize_fp8_ref(x, turbo.float8_e4m3, g, **kw)
    exact = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s.float(), s_ref.float())
    row = {"op": "quantize_fp8", "case": f"{granularity.lower()} {rows}x{cols}", "backend": "default",
           "snr_db": float("inf") if exact else float("-inf"), "ok": exact}
    if DEVICE == "cuda":
        y = torch.empty_like(x)
        ms = _time_ms(lambda: turbo.ops.quantize_fp8(x, turbo.float8_e4m3, g, **kw))
        peer = _time_ms(lambda: y.copy_(x))
        row.update(ms=ms, torch_ms=peer, speedup=peer / ms, tflops=float("nan"))
    return row


def _gemm_fp8_case(granularity):
    m, n, k = (4096, 4096, 4096) if DEVICE == "cuda" else (64, 128, 256)
    cfg = turbo.Float8QuantConfig(granularity=turbo.ScalingGranularity[granularity])
    a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    out = turbo.ops.gemm_fp8(a, b, trans_b=True, config=cfg)
    out.backward(grad)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = a64 @ b64.t()
    ref.backward(grad.double())
    snr = min(snr_db(ref, out), snr_db(a64.grad, a.grad), snr_db(b64.grad, b.grad))
    row = {"op": "gemm_fp8", "case": f"NT e4m3 {granularity.lower()} {m}x{n}x{k}", "backend": "default",
           "snr_db": snr, "ok": snr >= 25.0}
    if DEVICE == "cuda":
        A, B = a.detach(), b.detach()
        ms = _time_ms(lambda: turbo.ops.gemm_fp8(A, B, trans_b=True, config=cfg))
        peer = _time_ms(lambda: A @ B.t())  # what it replaces: the bf16 cuBLAS GEMM
        row.update(ms=ms, torch_ms=peer, speedup=peer / ms, tflops=2 * m * n * k / ms / 1e9)
    return row


def op_table() -> list[dict]:
    rows = []
    for backend in (None, BackendType.TORCH, BackendType.TRITON):
        for layout in ("NN", "NT", "TN"):
            rows.append(_gemm_case(backend, layout, torch.bfloat16))
    for granularity in ("TENSORWISE", "ROWWISE", "BLOCKWISE", "BLOCKWISE_2D", "MX_BLOCKWISE"):
        rows.append(_quant_case(granularity))
    for granularity in ("TENSORWISE", "BLOCKWISE"):
        rows.append(_gemm_fp8_case(granularity))
    return rows


def main() -> int:
    print(f"primus-turbo on {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU (Triton interpreter)'}; "
          f"torch {torch.__version__}")
    minimal_example()
    rows = op_table()
    cols = ["op", "case", "backend", "snr_db", "ok"] + (["ms", "torch_ms", "speedup", "tflops"] if DEVICE == "cuda" else [])
    print()
    width = {"op": 12, "case": 30}
    print(" | ".join(f"{c:<{width[c]}}" if c in width else f"{c:>9}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            s = f"{v:.2f}" if isinstance(v, float) else str(v)
            cells.append(f"{s:<{width[c]}}" if c in width else f"{s:>9}")
        print(" | ".join(cells))
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} checks passed against float64 references (SNR of out, dA, dB: "
          ">= 45 dB for bf16 gemm, >= 25 dB for E4M3 gemm_fp8; quantizers bit-exact, shown as inf)")
    if DEVICE == "cuda":
        print("speedup = PyTorch's time / ours; the peer is the bf16 GEMM for gemm/gemm_fp8 and a device copy "
              "for quantize_fp8 (a ratio of memory traffic, not a like-for-like op)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
