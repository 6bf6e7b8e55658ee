"""The 16-bit Gluon grouped GEMMs (triton/grouped_gemm/grouped_gemm_gluon.py, forward / dgrad, and
grouped_gemm_variable_k_gluon.py, the wgrad): compile them for sm_90 on CPU, or check and time them
on an H200 / H100.

CPU (no GPU needed; ptxas from the triton wheel)::

    PYTHONPATH=. python scripts/check_gluon_grouped.py --compile [--dump DIR --sass] [CONFIG ...]

compiles the M-grouped kernel (both B layouts, bf16 and fp16) and the variable-K kernel (bf16 out,
fp32 out, fp32 reduce-add) with each config (default: the shipped ones and the candidates) and
reports shared memory, registers, spills and the SASS counts (HGMMA, TMA, STL/LDL); exit status 1
on a failure, a spill, serialized wgmmas or too much shared memory.

GPU (one command, about two minutes on an H200)::

    PYTHONPATH=. python scripts/check_gluon_grouped.py [--configs n256k64s4,n128k64s6] [--quick]

For DeepSeek-V3 EP8 (G 32 local experts, gate_up N 4096 K 7168, down N 7168 K 2048, 2048 tokens per
expert) and Qwen3-30B-A3B EP8 (G 16, hidden 2048, moe_intermediate 768: gate_up N 1536 K 2048, down
N 2048 K 768), balanced and unbalanced token counts (an empty expert, rows past the last offset):
the forward (trans_b True, the nn.Linear layout), the dgrad (the same weight read N-major), the
wgrad (bf16 out, and fp32 accumulation into main_grad) of every Gluon config against the fp32
reference (SNR), the tl kernel and ``torch._grouped_mm``; then a table of TFLOP/s and ratios, and
the geomeans per GEMM and of forward (fwd) and forward+backward (fwd + dgrad + wgrad time).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


# ----------------------------------------------------------------------------------------------
# CPU: sm_90 compile
# ----------------------------------------------------------------------------------------------
_TY = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


def compile_config(cfg, kind: str = "m", dtype: str = "bf16", out_dtype: str | None = None, b_kmajor: bool = True,
                   accumulate: bool = False, dump: str | None = None, sass_out: bool = False) -> dict:
    """Compile the M-grouped (``kind`` "m"; ``b_kmajor``: B K-contiguous) or the variable-K (``kind``
    "vk"; ``accumulate``: the fp32 reduce-add epilogue) 16-bit kernel for sm_90 with ``cfg`` (a
    GluonGroupedConfig). Returns shared memory, registers, spills, serialized-wgmma notes, SASS counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    gc = _compile_check()
    out_dtype = out_dtype or dtype
    gty = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}
    bn, bk = cfg.block_n, cfg.block_k

    def desc(ty, box):
        layout = gl.NVMMASharedLayout.get_default_for(box, gty[ty])
        return f"tensordesc<{ty}[{', '.join(map(str, box))}],{layout!r}>"

    consts = dict(GROUP_M=cfg.group_m, STAGES=cfg.stages, C_BUFS=cfg.c_bufs, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs)
    if kind == "m":
        from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as mod

        kernel = mod._grouped_gemm_gluon_ws_kernel
        sig = {"a_desc": desc(dtype, [64, bk]),
               "b_desc": desc(dtype, [1, bn, bk] if b_kmajor else [1, bk, bn]),
               "c_desc": desc(out_dtype, [64, cfg.epi_n]), "c_ptr": f"*{out_dtype}", "offs_ptr": "*i64",
               "M": "i32", "N": "i32", "K": "i32", "G": "i32", "stride_cm": "i32"}
        consts["B_KMAJOR"] = bool(b_kmajor)
    else:
        from primus_turbo.triton.grouped_gemm import grouped_gemm_variable_k_gluon as mod

        kernel = mod._grouped_gemm_variable_k_gluon_ws_kernel
        sig = {"x_desc": desc(dtype, [bk, 64]), "y_desc": desc(dtype, [1, bk, bn]),
               "c_desc": desc(out_dtype, [64, cfg.epi_n]), "offs_ptr": "*i64",
               "M": "i32", "P": "i32", "Q": "i32", "G": "i32"}
        consts["ACCUMULATE"] = bool(accumulate)
    sig.update({k: "constexpr" for k in consts})
    k = triton.compile(GluonASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    report = gc._ptxas_report(k.asm["ptx"], ptxas)
    sass = gc._sass(k.asm["cubin"], os.path.join(os.path.dirname(ptxas), "cuobjdump"))
    used = [int(x) for x in re.findall(r"\bR(\d+)\b", sass)]
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", report)]
    res = dict(config=cfg.short(), shared=k.metadata.shared, regs=max(regs) if regs else None,
               max_reg=max(used) + 1 if used else None,
               spill_bytes=sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)),
               serialized=sorted(set(re.findall(r"\((C75\d\d)\)", report))), sass_counts=gc.sass_counts(sass),
               ptxas=report.strip().splitlines()[-3:], ptx=k.asm["ptx"], ttgir=k.asm["ttgir"])
    if dump:
        d = Path(dump)
        d.mkdir(parents=True, exist_ok=True)
        stem = (f"gluon16_{kind}{'_kmajor' if kind == 'm' and b_kmajor else ''}{'_acc' if accumulate else ''}_"
                f"{dtype}_{out_dtype}_{cfg.short()}")
        for ext in ("ttgir", "ptx"):
            (d / f"{stem}.{ext}").write_text(k.asm[ext])
        if sass_out:
            (d / f"{stem}.sass").write_text(sass)
    return res


def _compile_check():
    """scripts/gluon_compile_check.py as a module (ptxas report, SASS dump and counts)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gluon_compile_check", _ROOT / "scripts" / "gluon_compile_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the kernels and operand kinds --compile builds per config: (kind, dtype, out dtype, b_kmajor, accumulate)
COMPILE_VARIANTS = (
    ("m", "bf16", "bf16", True, False),
    ("m", "bf16", "bf16", False, False),
    ("m", "fp16", "fp16", True, False),
    ("vk", "bf16", "bf16", False, False),
    ("vk", "bf16", "fp32", False, False),
    ("vk", "bf16", "fp32", False, True),
)


def compile_main(configs, dump=None, sass=False) -> int:
    from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg

    bad = 0
    for text in configs:
        for kind, dt, odt, kmaj, acc in COMPILE_VARIANTS:
            cfg = gg.fitted_config(gg.GluonGroupedConfig.parse(text), {"bf16": _bf16(), "fp16": _bf16(),
                                                                       "fp32": _fp32()}[odt])
            name = f"{kind}{'/kmajor' if kind == 'm' and kmaj else '/nmajor' if kind == 'm' else ''}" \
                   f"{'/acc' if acc else ''} {dt}->{odt} {cfg.short()}"
            try:
                r = compile_config(cfg, kind, dt, odt, kmaj, acc, dump, sass)
            except Exception as exc:  # noqa: BLE001 - report and go on
                bad += 1
                msg = str(exc).strip().splitlines()
                print(f"FAIL {name}: {type(exc).__name__}: {' | '.join(msg[-6:])[:2000]}")
                continue
            flag = ("  OVER SMEM" if r["shared"] > 232448 else "") + ("  SPILLS" if r["spill_bytes"] else "")
            flag += f"  WGMMA SERIALIZED {r['serialized']}" if r["serialized"] else ""
            bad += bool(flag)
            print(f"ok   {name}: smem={r['shared']} maxnreg={r['regs']} regs used={r['max_reg']} "
                  f"spill_bytes={r['spill_bytes']}{flag}")
            print("      SASS:", " ".join(f"{k}={v}" for k, v in r["sass_counts"].items()))
    return 1 if bad else 0


def _bf16():
    import torch

    return torch.bfloat16


def _fp32():
    import torch

    return torch.float32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", default=None)
    p.add_argument("--compile", action="store_true", help="compile for sm_90 on CPU (no GPU)")
    p.add_argument("--dump", default=None)
    p.add_argument("--sass", action="store_true")
    args = p.parse_args(argv)
    from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg

    configs = args.configs or [gg.GROUPED16_DEFAULT_CONFIG.short()]
    if args.compile:
        return compile_main(configs, args.dump, args.sass)
    raise SystemExit("GPU mode: not yet")


if __name__ == "__main__":
    raise SystemExit(main())
