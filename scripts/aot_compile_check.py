"""Compile every Triton kernel a CPU test run launches for sm_90 (H100/H200), without a GPU.

The CPU interpreter checks what a kernel computes, not that the GPU compiler accepts it: a kernel
can pass every CPU test and then fail to compile (or need more shared memory than an SM has) on
the first GPU call. This script closes that gap in two steps:

    # 1. run tests under the interpreter, recording each launch's kernel, argument types and
    #    constexprs (not the data)
    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/aot_compile_check.py record /tmp/launches.json \\
        -- tests/pytorch/ops/test_moe_permute.py -q -p no:cacheprovider
    # 2. compile each distinct launch for sm_90 (PTX, then cubin with the bundled ptxas)
    PYTHONPATH=. python scripts/aot_compile_check.py compile /tmp/launches.json [--configs gpu]

``--configs gpu`` additionally recompiles each kernel with its GPU constexpr values: ``SOFT=False``
(the hardware-conversion path the interpreter never takes) and, kernel by kernel, GPU-sized tiles
in place of the interpreter's small ones (GPU_OVERRIDES). Prints one line per distinct compile and a
summary; exits 1 if any compile failed or needs more than the H200's 227 KiB of shared memory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

SMEM_LIMIT = 232448  # bytes of shared memory per block on sm_90

_TORCH_TO_TRITON = {
    "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64",
    "torch.float8_e4m3fn": "fp8e4nv", "torch.float8_e5m2": "fp8e5", "torch.uint8": "u8", "torch.int8": "i8",
    "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64", "torch.bool": "i1",
}


def _arg_type(v) -> str:
    import torch

    if isinstance(v, torch.Tensor):
        return "*" + _TORCH_TO_TRITON[str(v.dtype)]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    if v is None:
        return "none"
    return "other:" + type(v).__name__


def record(out_path: str, pytest_args: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("record needs TRITON_INTERPRET=1 (the launches are captured from the interpreter)", file=sys.stderr)
        return 2
    import pytest
    import triton.runtime.interpreter as interp

    seen: dict = {}
    original = interp.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        names = self.arg_names
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        consts, sig = {}, {}
        params = __import__("inspect").signature(fn).parameters
        for n in names:
            p = params[n]
            ann = str(p.annotation)
            v = bound.get(n, p.default)
            if "constexpr" in ann:
                consts[n] = v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
            else:
                sig[n] = _arg_type(v)
        opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        key = json.dumps([fn.__module__, fn.__qualname__, sig, consts, opts], sort_keys=True, default=str)
        seen[key] = seen.get(key, 0) + 1
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = run
    rc = pytest.main(pytest_args)
    entries = []
    for key, count in seen.items():
        mod, name, sig, consts, opts = json.loads(key)
        entries.append({"module": mod, "kernel": name, "signature": sig, "constexprs": consts, "options": opts,
                        "launches": count})
    Path(out_path).write_text(json.dumps(entries, indent=1))
    print(f"recorded {len(entries)} distinct launches ({sum(seen.values())} in all) -> {out_path}; pytest exit {rc}")
    return 0


#: GPU-sized constexprs to try in place of the interpreter's small tiles (kernel -> overrides)
GPU_OVERRIDES: dict[str, list[dict]] = {
    "_grouped_gemm_kernel": [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64),
                             dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64)],
    "_grouped_gemm_variable_k_kernel": [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64),
                                        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64)],
    "_grouped_gemm_fp8_variable_k_kernel": [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)],
    "_grouped_gemm_fp4_variable_k_kernel": [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)],
    "_attn_fp8_fwd_kernel": [dict(BLOCK_M=128, BLOCK_N=128), dict(BLOCK_M=64, BLOCK_N=128)],
    "_attn_fwd_kernel": [dict(BLOCK_M=64, BLOCK_N=64), dict(BLOCK_M=128, BLOCK_N=64)],
    # the two-kernel tiles, then the atomic-dQ variant's (BWD_ATOMIC_CONFIGS; recorded with its warps / stages)
    "_attn_bwd_dkdv_kernel": [dict(BLOCK_M=32, BLOCK_N=64), dict(BLOCK_M=32, BLOCK_N=128),
                              dict(BLOCK_M=64, BLOCK_N=128), dict(BLOCK_M=64, BLOCK_N=64),
                              dict(BLOCK_M=128, BLOCK_N=64)],
    "_attn_bwd_dq_kernel": [dict(BLOCK_M=128, BLOCK_N=32), dict(BLOCK_M=64, BLOCK_N=32)],
    "_attn_fp8_bwd_dkdv_kernel": [dict(BLOCK_M=64, BLOCK_N=64)],
    "_attn_fp8_bwd_dq_kernel": [dict(BLOCK_M=64, BLOCK_N=64)],
}
#: constexprs whose GPU value differs from the interpreter's (kernels take a soft-float path there)
GPU_VALUES = {"SOFT": False}


def compile_all(path: str, gpu_configs: bool) -> int:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    entries = json.loads(Path(path).read_text())
    jobs = []
    for e in entries:
        jobs.append((e, e["constexprs"], "recorded"))
        if gpu_configs:
            gpu_vals = {k: v for k, v in GPU_VALUES.items() if k in e["constexprs"]}
            if gpu_vals:
                jobs.append((e, dict(e["constexprs"], **gpu_vals), f"gpu {gpu_vals}"))
            for ov in GPU_OVERRIDES.get(e["kernel"], []):
                if all(k in e["constexprs"] for k in ov):
                    jobs.append((e, dict(e["constexprs"], **ov, **gpu_vals), f"gpu {dict(ov, **gpu_vals)}"))
    done, failed, over = set(), 0, 0
    for e, consts, how in jobs:
        sig = {k: v for k, v in e["signature"].items() if v != "none"}
        # None arguments are constexpr None in a compiled kernel
        consts = dict(consts, **{k: None for k, v in e["signature"].items() if v == "none"})
        sig.update({k: "constexpr" for k in consts})
        key = json.dumps([e["module"], e["kernel"], sig, consts, e["options"]], sort_keys=True, default=str)
        if key in done:
            continue
        done.add(key)
        label = f"{e['module'].rsplit('.', 1)[-1]}.{e['kernel']} {how} {consts}"
        try:
            fn = getattr(importlib.import_module(e["module"]), e["kernel"])
            opts = {"num_warps": e["options"].get("num_warps", 4), "num_stages": e["options"].get("num_stages", 3)}
            k = triton.compile(ASTSource(fn, sig, consts), target=target, options=opts)
            shared = k.metadata.shared
            flag = ""
            if shared > SMEM_LIMIT:
                over += 1
                flag = f"  SHARED MEMORY {shared} > {SMEM_LIMIT}"
            print(f"ok   {label[:200]} smem={shared}{flag}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on
            failed += 1
            print(f"FAIL {label[:200]}\n     {type(exc).__name__}: {str(exc).splitlines()[-1][:300] if str(exc) else ''}",
                  flush=True)
    print(f"\n{len(done)} compiles for sm_90: {failed} failed, {over} over the shared-memory limit")
    return 1 if failed or over else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] not in ("record", "compile"):
        print(__doc__)
        return 2
    if argv[0] == "record":
        rest = argv[2:]
        if rest and rest[0] == "--":
            rest = rest[1:]
        return record(argv[1], rest)
    return compile_all(argv[1], "--configs" in argv and argv[argv.index("--configs") + 1] == "gpu")


if __name__ == "__main__":
    raise SystemExit(main())
