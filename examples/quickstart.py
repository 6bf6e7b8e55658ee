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


def op_table() -> list[dict]:
    rows = []
    for backend in (None, BackendType.TORCH, BackendType.TRITON):
        for layout in ("NN", "NT", "TN"):
            rows.append(_gemm_case(backend, layout, torch.bfloat16))
    return rows


def main() -> int:
    print(f"primus-turbo on {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU (Triton interpreter)'}; "
          f"torch {torch.__version__}")
    minimal_example()
    rows = op_table()
    cols = ["op", "case", "backend", "snr_db", "ok"] + (["ms", "torch_ms", "speedup", "tflops"] if DEVICE == "cuda" else [])
    print()
    print(" | ".join(f"{c:>9}" if c != "case" else f"{c:<26}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            s = f"{v:.2f}" if isinstance(v, float) else str(v)
            cells.append(f"{s:<26}" if c == "case" else f"{s:>9}")
        print(" | ".join(cells))
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} checks passed (SNR against a float64 reference, out/dA/dB >= 45 dB)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
