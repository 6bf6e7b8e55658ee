"""Host-side work of one FP8 linear training step, counted on a CPU machine.

The step is ``y = turbo.ops.gemm_fp8(x, w, trans_b=True, config=Float8QuantConfig(granularity=G))``
then ``y.backward(dy)`` (an ``nn.Linear`` forward + backward). On the H200 at Llama-3.1-8B attn_out
this step is host-bound, so what matters is how much the host does per step, which a CPU machine
can count even where it cannot time a GPU:

* ATen ops per step, by name (torch.profiler's CPU events): the top-level ones (those our Python
  calls; an op's own sub-ops are inside its cost) by name, and the total with nested ones. Ops
  that run a kernel on CUDA (leaf ops other than allocations and views, e.g. ``fill_`` under
  ``zeros``, ``copy_`` under ``clone``) are counted separately: each is a CUDA launch there.
* Triton kernel launches per step, by kernel (the interpreter's ``InterpretedFunction.run`` is
  wrapped; every launch path of primus_turbo ends there on CPU). Ops the interpreter issues to
  run a kernel are not counted: they do not exist on CUDA.
* Host syncs per step (``aten._local_scalar_dense``: ``.item()`` and friends; must be 0).
* ``--time``: the Python-side time of a step with the kernel bodies skipped (the interpreter's run
  becomes a no-op: outputs are garbage, the host path is the real one), optionally ``--cprofile``.

CPU vs CUDA (what differs, read from the code):

* GEMM backend: on CUDA the default is TORCH (``torch._scaled_mm``) for TENSORWISE / ROWWISE and
  GLUON (sm_90 only) for BLOCKWISE. Here TORCH refuses non-CUDA tensors and GLUON needs sm_90, so
  the default resolves to TRITON. ``--backend cuda`` counts the CUDA route instead: TENSORWISE /
  ROWWISE through the TORCH backend's ``execute`` (``torch._scaled_mm`` runs on CPU) with its
  CUDA-only checks replaced by the CUDA answer, BLOCKWISE through a stand-in for the Gluon kernel
  that allocates the output and records one launch (its launcher's own host work, three TMA
  descriptors and the direct C-entry launch, is not counted).
* Launch path: on CUDA ``primus_turbo.triton.launch.launch`` calls the compiled kernel's C entry
  (no ATen ops); here every launch goes through ``jit_fn[grid]`` into the interpreter. Launch
  counts are the same; launch cost is not modelled.
* The autograd backward runs on the calling thread here and on the autograd engine's device
  thread on CUDA (same ops).

    PYTHONPATH=. python scripts/host_count_fp8_linear.py [--m 256 --n 256 --k 256]
        [--gran TENSORWISE BLOCKWISE ROWWISE] [--backend auto|cuda|TRITON|TORCH|GLUON] [--time [--cprofile]]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported


# ops that only allocate or re-describe memory: no device work on CUDA
_NO_DEVICE_WORK = {
    "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "view", "_unsafe_view", "t",
    "transpose", "as_strided", "unsqueeze", "squeeze", "reshape", "_reshape_alias", "alias", "detach", "expand",
    "slice", "select", "permute", "resize_", "lift_fresh", "contiguous", "_local_scalar_dense", "zeros",
    "clone", "to", "_to_copy", "new_zeros", "copy",
}
# composite ops whose device work is theirs even where the profiler shows children
_KERNEL_OPS = {"_scaled_mm"}
_INTERP = "host_count::interpreted_kernel"
_STANDIN = "host_count::stand_in"


class _State:
    counting = False  # inside a measured step
    noop = False
    launches: collections.Counter = collections.Counter()


def _wrap_interpreter() -> None:
    from triton.runtime import interpreter

    orig = interpreter.InterpretedFunction.run
    if getattr(orig, "_host_count", False):
        return

    def run(self, *args, **kwargs):
        if _State.counting:
            _State.launches[getattr(self.fn, "__name__", str(self.fn))] += 1
        if _State.noop:
            return None
        # the interpreter's own torch ops (argument copies) do not exist on CUDA: marked, not counted
        with torch.profiler.record_function(_INTERP):
            return orig(self, *args, **kwargs)

    run._host_count = True
    interpreter.InterpretedFunction.run = run


@contextlib.contextmanager
def _cuda_route():
    """The CUDA default GEMM route on CPU (see the module docstring): TORCH for TENSORWISE /
    ROWWISE, a stand-in for the Gluon kernel for BLOCKWISE."""
    from primus_turbo.pytorch.backends import gemm_fp8 as be
    from primus_turbo.pytorch.core.backend import BackendType
    from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G

    torch_cls, gluon_cls = be.GemmFP8TorchBackend, be.GemmFP8GluonBackend
    saved = (torch_cls.__dict__["check"], gluon_cls.__dict__["check"], gluon_cls.__dict__["execute"])

    def torch_check(cls, a_q=None, a_scale=None, b_q=None, b_scale=None, mode=None, out=None, out_dtype=None,
                    accumulate=False, block_size=128, **_):
        # the CUDA answer for what the real check decides from the device: sm_90, CUDA tensors
        g = be._granularity(mode)
        if g not in (G.TENSORWISE, G.ROWWISE) or (g == G.ROWWISE and (out_dtype or torch.bfloat16) != torch.bfloat16
                                                   and not accumulate):
            return "not TORCH on CUDA either"
        if a_q.dtype == torch.float8_e5m2 and b_q.dtype == torch.float8_e5m2:
            return "cuBLASLt has no E5M2 x E5M2 FP8 GEMM"
        if g == G.ROWWISE and (a_q.dtype != torch.float8_e4m3fn or b_q.dtype != torch.float8_e4m3fn):
            return "row-wise: E4M3 only"
        return be._common_check(a_q, a_scale, b_q, b_scale, mode, out, out_dtype, accumulate)

    def gluon_check(cls, a_q=None, b_q=None, mode=None, accumulate=False, block_size=128, **kw):
        g = be._granularity(mode)
        if g != G.BLOCKWISE or accumulate or block_size != 128:
            return "not GLUON on CUDA either"
        if a_q.dtype != torch.float8_e4m3fn or b_q.dtype != torch.float8_e4m3fn:
            return "E4M3 only"
        return None

    def gluon_execute(cls, a_q=None, b_q=None, out=None, out_dtype=None, **_):
        if _State.counting:
            _State.launches["_gemm_fp8_blockwise_ws_kernel (stand-in)"] += 1
        if out is not None:
            return out
        return torch.empty((a_q.shape[0], b_q.shape[0]), dtype=out_dtype or torch.bfloat16, device=a_q.device)

    real_scaled_mm = torch._scaled_mm

    def scaled_mm(a, b, scale_a=None, scale_b=None, out_dtype=None, **kw):
        # torch._scaled_mm runs on CPU, but slowly (seconds at 256^3 on uninitialized codes); the
        # stand-in keeps the op's name in the profile and its output allocation
        with torch.profiler.record_function("aten::_scaled_mm"):
            return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype, device=a.device)

    torch._scaled_mm = scaled_mm
    torch_cls.check = classmethod(torch_check)
    gluon_cls.check = classmethod(gluon_check)
    gluon_cls.execute = classmethod(gluon_execute)
    try:
        yield BackendType
    finally:
        torch_cls.check, gluon_cls.check, gluon_cls.execute = saved
        torch._scaled_mm = real_scaled_mm


def _step_fn(gran: str, m: int, n: int, k: int, dtype: torch.dtype):
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, dtype=dtype)
    cfg = Float8QuantConfig(granularity=gran)

    def step():
        y = turbo.ops.gemm_fp8(x, w, trans_b=True, config=cfg)
        y.backward(dy)
        x.grad = None
        w.grad = None

    return step


def _tally(events, steps: int) -> dict:
    """Per-step counts from the profiler's CPU events: top-level ATen ops by name (an op called
    inside another ATen op is that op's business), every ATen op, and the device work (leaf ops
    that run a kernel on CUDA). Ops inside an interpreted kernel are left out."""
    top: collections.Counter = collections.Counter()
    device: collections.Counter = collections.Counter()
    n_all = syncs = 0
    top_dev = set()

    def walk(ev, under_aten, top_name):
        nonlocal n_all, syncs
        name = ev.name
        if name == _INTERP:
            return
        if name.startswith("aten::"):
            short = name[6:]
            n_all += 1
            if short == "_local_scalar_dense":
                syncs += 1
            if not under_aten:
                top[short] += 1
                top_name = short
            leaf = not any(c.name.startswith("aten::") for c in ev.cpu_children)
            if short in _KERNEL_OPS or (leaf and short not in _NO_DEVICE_WORK):
                device[short] += 1
                top_dev.add(top_name)
                return
            under_aten = True
        for c in ev.cpu_children:
            walk(c, under_aten, top_name)

    for ev in events:
        if ev.cpu_parent is None:
            walk(ev, False, None)
    per = lambda c: {k: v / steps for k, v in c.items()}  # noqa: E731
    return dict(ops=per(top), device_ops=per(device), ops_with_device_work=sorted(top_dev),
                all_ops=n_all / steps, host_syncs=syncs / steps)


def count(gran: str, m: int, n: int, k: int, dtype: torch.dtype, steps: int) -> dict:
    return count_step(_step_fn(gran, m, n, k, dtype), gran, steps)


def count_step(step, label: str, steps: int) -> dict:
    """Per-step ATen ops, device kernels, Triton launches and host syncs of ``step()`` (after two
    warm-up calls), as a row of :func:`_table` named ``label``."""
    from torch.profiler import ProfilerActivity, profile

    _wrap_interpreter()
    step()  # compile / first-call work is not a steady step's
    step()
    _State.launches = collections.Counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _State.counting = True
        try:
            for _ in range(steps):
                step()
        finally:
            _State.counting = False
    res = _tally(prof.events(), steps)
    launches = {name: c / steps for name, c in _State.launches.items()}
    return dict(
        granularity=label, launches=launches, total_ops=sum(res["ops"].values()),
        total_device_ops=sum(res["device_ops"].values()), total_triton_launches=sum(launches.values()), **res,
    )


def host_time(gran: str, m: int, n: int, k: int, dtype: torch.dtype, steps: int, cprofile: bool) -> dict:
    """Python-side time of a step with the kernel bodies skipped (median of 5 rounds)."""
    step = _step_fn(gran, m, n, k, dtype)
    step()
    _State.noop = True
    try:
        for _ in range(3):
            step()
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            rounds.append((time.perf_counter() - t0) / steps * 1e6)
        rounds.sort()
        out = dict(granularity=gran, us_per_step=rounds[len(rounds) // 2], rounds_us=rounds)
        if cprofile:
            import cProfile
            import io
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            for _ in range(steps):
                step()
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
            out["cprofile"] = buf.getvalue()
    finally:
        _State.noop = False
    return out


def _table(results: list) -> str:
    grans = [r["granularity"] for r in results]
    op_names = sorted({n for r in results for n in r["ops"]})
    dev_names = sorted({n for r in results for n in r["device_ops"]})
    kern_names = sorted({n for r in results for n in r["launches"]})
    rows = [("top-level ATen ops (* = device work on CUDA)", None)]
    rows += [(("  * " if any(n in r["ops_with_device_work"] for r in results) else "    ") + n,
              [r["ops"].get(n, 0) for r in results]) for n in op_names]
    rows += [("device kernels of those ops", None)]
    rows += [("    " + n, [r["device_ops"].get(n, 0) for r in results]) for n in dev_names]
    rows += [("Triton launches", None)]
    rows += [("    " + n, [r["launches"].get(n, 0) for r in results]) for n in kern_names]
    rows += [("totals", None)]
    rows += [("    top-level ATen ops", [r["total_ops"] for r in results]),
             ("    ATen ops incl. nested", [r["all_ops"] for r in results]),
             ("    ATen device kernels", [r["total_device_ops"] for r in results]),
             ("    Triton launches", [r["total_triton_launches"] for r in results]),
             ("    launches on CUDA (kernels + Triton)",
              [r["total_device_ops"] + r["total_triton_launches"] for r in results]),
             ("    host syncs", [r["host_syncs"] for r in results])]
    w = max(len(name) for name, _ in rows) + 2
    lines = [f"{'per step':<{w}}" + "".join(f"{g:>12}" for g in grans)]
    for name, vals in rows:
        lines.append(name if vals is None else f"{name:<{w}}" + "".join(f"{v:>12g}" for v in vals))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--gran", nargs="+", default=["TENSORWISE", "BLOCKWISE", "ROWWISE"])
    p.add_argument("--backend", default="cuda",
                   help="cuda (the CUDA default route, emulated: see the docstring), auto (this machine's "
                        "default), or a backend pinned for FP8: TRITON, TORCH, GLUON")
    p.add_argument("--steps", type=int, default=3, help="counted steps (counts are per step)")
    p.add_argument("--time", action="store_true", help="also the Python-side time of a step, kernels skipped")
    p.add_argument("--time-steps", type=int, default=50)
    p.add_argument("--cprofile", action="store_true", help="with --time: a cProfile of the timed steps")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args(argv)
    if args.cprofile and not args.time:
        p.error("--cprofile needs --time")

    from primus_turbo.triton import is_interpreter

    if is_interpreter():
        from primus_turbo.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()
        _wrap_interpreter()
    elif args.time:
        p.error("--time skips kernel bodies through the Triton interpreter: run it on CPU (TRITON_INTERPRET=1)")
    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    dtype = getattr(torch, args.dtype)
    backend = args.backend.upper()
    route = _cuda_route() if backend == "CUDA" else contextlib.nullcontext()
    if backend not in ("CUDA", "AUTO"):
        GlobalBackendManager.set_gemm_backend(backend, precision="FP8")
    results, timings = [], []
    try:
        with route:
            for g in args.gran:
                results.append(count(g, args.m, args.n, args.k, dtype, args.steps))
                if args.time:
                    timings.append(host_time(g, args.m, args.n, args.k, dtype, args.time_steps, args.cprofile))
    finally:
        if backend not in ("CUDA", "AUTO"):
            GlobalBackendManager.set_gemm_backend(None, precision="FP8")
    print(f"FP8 linear step (gemm_fp8 trans_b=True, fwd + bwd), M={args.m} N={args.n} K={args.k} {args.dtype}, "
          f"backend {args.backend}, {'CPU (Triton interpreter)' if is_interpreter() else 'CUDA'}")
    print(_table(results))
    for t in timings:
        print(f"\n{t['granularity']}: Python-side time {t['us_per_step']:.1f} us / step, kernel bodies skipped "
              f"(rounds {', '.join(f'{v:.0f}' for v in t['rounds_us'])})")
        if "cprofile" in t:
            print(t["cprofile"])
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results=results, timings=[
            {k: v for k, v in t.items() if k != "cprofile"} for t in timings]), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
