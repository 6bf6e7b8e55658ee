"""Static cost of the quantizer launch configurations on sm_90, without a GPU.

Every candidate configuration of the slow quantizers (the ones scripts/tune_quant.py times) is
launched on empty CPU tensors of a GPU shape with the launches intercepted: each kernel is
compiled for sm_90 exactly as the GPU JIT would specialise it (divisibility-by-16 and ``== 1``
argument specialisation taken from the real arguments), then ``ptxas -v`` gives registers and
spills and ``cuobjdump -sass`` the instruction count. Printed per configuration: registers,
spill bytes, shared memory, SASS instructions per element per thread (the kernels are
straight-line code, so this is the issued instruction count; in brackets the kernel's total)
and the programs per SM that the registers allow. No timing: the GPU sweep is scripts/tune_quant.py.

    PYTHONPATH=. python scripts/quant_sass_stats.py [--shape 16384x7168] [--only fp4 ...]

``--only fp4_gluon``: the Hopper Gluon two-copy MXFP4 kernel's configurations (quant_fp4_gluon.py).
``--only blocks_batched`` (not in the default list): the one-launch kernel for 128 x 128 blocks of
32 expert weights ``[32, rows, cols]`` next to the 2-D kernel on one expert (the same tile).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_TARGET = GPUTarget("cuda", 90, 32)
_BACKEND = make_backend(_TARGET)
_SEEN: list[dict] = []
_BATCH = 32  # experts of the blocks_batched case (GPT-OSS-20B: 32; --shape 2880x2880)


def _capture(self, *args, grid, warmup, **kwargs):
    """JITFunction.run stand-in: specialise as the GPU JIT does, compile for sm_90, launch nothing."""
    kwargs.setdefault("debug", False)
    binder = create_function_from_signature(self.signature, self.params, _BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(_BACKEND, kwargs, bound, specialization, options)
    try:
        src = ASTSource
        if getattr(self, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource as src
        k = triton.compile(src(self, signature, constexprs, attrs), target=_TARGET, options=options.__dict__)
        err = None
    except Exception as exc:  # noqa: BLE001 - reported
        k, err = None, exc
    _SEEN.append({"name": self.fn.__name__, "grid": grid, "num_warps": options.num_warps, "kernel": k, "error": err})


def _stats(k) -> dict:
    d = tempfile.mkdtemp()
    ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
    Path(ptx).write_text(k.asm["ptx"])
    Path(cubin).write_bytes(k.asm["cubin"])
    info = subprocess.run([os.path.join(_BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o",
                           os.path.join(d, "o.cubin")], capture_output=True, text=True)
    info = info.stdout + info.stderr  # where ptxas -v reports differs between CUDA releases
    sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    n = sum(1 for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?[A-Z]", line))
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    out = {"regs": int(regs.group(1)) if regs else 0, "spill": spill.groups() if spill else ("?", "?"),
           "smem": k.metadata.shared, "sass": n}
    if not (regs and spill):  # unparsed: keep what ptxas said, so a failing check shows why
        out["ptxas"] = info.strip()[-400:]
    return out


def _cases(name: str, x: torch.Tensor):
    from primus_turbo.triton.quantization import quant_fp4_kernel as F4
    from primus_turbo.triton.quantization import quant_fp8_kernel as F8

    rows, cols = x.shape
    if name == "blocks_batched":  # grouped-GEMM weights [G, R, C], 128 x 128 blocks: batched kernel vs one expert
        g = F8.QuantGrouping(0, 128, 128)
        w = torch.empty(_BATCH, rows, cols, dtype=x.dtype)
        return ["batched", "per-expert"], lambda cfg: (
            F8.fp8_quant_batched_launch(w, torch.float8_e4m3fn, g) if cfg == "batched"
            else F8.fp8_quant_launch(w[0], torch.float8_e4m3fn, g))
    if name == "fp4_gluon":  # the Hopper Gluon two-copy MXFP4 kernel
        from primus_turbo.triton.quantization import quant_fp4_gluon as FG

        return [None] + list(FG.FP4_GLUON_CANDIDATES), lambda cfg: FG.launch_config(x, cfg or FG.FP4_GLUON_DEFAULT)
    if name.startswith("with_trans"):
        mx = name.endswith("mx")
        row = F8.QuantGrouping(1, 1, 32) if mx else F8.QuantGrouping(0, 1, 128)
        col = F8.QuantGrouping(1, 32, 1) if mx else F8.QuantGrouping(0, 128, 1)
        cands = [None] + [c for c in F8.WITH_TRANS_CANDIDATES if F8._dual_ok(rows, cols, row, col, c)]
        cands += [(128, 4), (128, 8), (64, 4)]
        return cands, lambda cfg: F8.fp8_quant_with_trans_launch(x, torch.float8_e4m3fn, row, col, tile=cfg)
    wt = name == "fp4_with_trans"
    cands = [None] + list(F4.FP4_WITH_TRANS_CANDIDATES if wt else F4.FP4_CANDIDATES)
    if wt:
        cands += [(64, 64, 4, "generic"), (64, 128, 8, "generic")]
    def launch(cfg):
        if cfg is not None and cfg[0] == "gluon":  # the Gluon kernel (CPU tensors skip its dispatch)
            from primus_turbo.triton.quantization import quant_fp4_gluon as FG

            return FG.launch_config(x, tuple(cfg[1:]))
        return F4.fp4_quant_launch(x, True, with_trans=wt, tile=cfg)

    return cands, launch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="16384x7168")
    p.add_argument("--only", nargs="+", default=["with_trans_blockwise", "with_trans_mx", "fp4", "fp4_with_trans"])
    p.add_argument("--match", nargs="+", default=None,
                   help="only the candidates whose label contains one of these strings (default always runs)")
    args = p.parse_args(argv)
    rows, cols = (int(v) for v in args.shape.split("x"))
    x = torch.empty(rows, cols, dtype=torch.bfloat16)
    original = JITFunction.run
    JITFunction.run = _capture
    failed = 0
    try:
        for name in args.only:
            cands, call = _cases(name, x)
            for cfg in cands:
                if args.match and cfg is not None and not any(m in str(cfg) for m in args.match):
                    continue
                _SEEN.clear()
                call(cfg)
                for r in _SEEN:
                    label = f"{name:20s} {'default' if cfg is None else str(cfg):28s} {r['name']:30s}"
                    if r["error"] is not None:
                        failed += 1
                        print(f"{label} FAILED {type(r['error']).__name__}: {str(r['error'])[-200:]}")
                        continue
                    st = _stats(r["kernel"])
                    threads = 32 * r["num_warps"]
                    per_thread = rows * cols / r["grid"][0] / threads  # per matrix (a batched grid's axis 1)
                    progs = min(65536 // max(st["regs"] * threads, 1), 2048 // threads)
                    print(f"{label} regs {st['regs']:3d} spill {st['spill'][0]:>4s}/{st['spill'][1]:>4s} B "
                          f"smem {st['smem']:6d} SASS/elem {st['sass'] / per_thread:5.1f} ({st['sass']:5d}) programs/SM {progs}",
                          flush=True)
    finally:
        JITFunction.run = original
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
