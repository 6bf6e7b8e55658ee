"""Compile the Gluon BLOCKWISE FP8 GEMM for sm_90 on a machine without a GPU.

Gluon kernels cannot run in the Triton interpreter, so this is the CPU-side check that they
compile: ttgir -> PTX -> cubin with the bundled ptxas, for each config given, and reports
shared memory, registers and spills (ptxas ``-v`` output and the cubin's metadata).

    PYTHONPATH=. python scripts/gluon_compile_check.py [n128s5 n128s4 ...] [--dump DIR] [--sass] [--grouped]
        [--row-scales] [--variable-k [--accumulate]]

``--grouped`` compiles the M-grouped MoE kernel (triton/grouped_gemm/grouped_gemm_fp8_gluon.py),
``--row-scales`` the dense kernel's per-row B scale path (the FP8 linear's wgrad; n128 configs not
pipelined hold the column scales in registers, n256 and pipelined ones TMA them through the ring),
``--variable-k`` the variable-K grouped kernel (the MoE wgrad,
triton/grouped_gemm/grouped_gemm_fp8_variable_k_gluon.py; the same main loops), ``--accumulate`` its
reduce-add epilogue (fp32 output). With ``--sass`` the report also counts the SASS instructions
that matter (wgmma, TMA loads / stores / reduces, local-memory STL / LDL).

``--attn`` compiles every variant of the attention forward (triton/attention/flash_attn_fwd_gluon.py;
configs are ignored) and checks its SASS: HGMMA present, no local-memory STL/LDL. ``--attn-bwd``
does the same for the attention backward's dK/dV and dQ kernels (triton/attention/flash_attn_bwd_gluon.py).
``--attn-fp8`` compiles the FP8 attention forward (triton/attention/flash_attn_fp8_fwd_gluon.py) and
checks its SASS: QGMMA present, no STL/LDL, registers, the softmax between the S and PV waits,
no write to an in-flight wgmma's A registers.

Exit status 1 if any config fails to compile, spills, has ptxas serialize its wgmmas (notes
C7514/C7515: accumulator registers touched while an MMA is in flight), or needs more shared
memory than sm_90 has.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def _ptxas_report(ptx: str, ptxas: str) -> str:
    """ptxas -v on the PTX: register count, spill stores/loads per entry function."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        Path(src).write_text(ptx)
        out = subprocess.run([ptxas, "-v", "-arch=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
        return out.stdout + out.stderr


def compile_config(cfg, out_dtype: str = "bf16", dump: str | None = None, sass_out: bool = False,
                   grouped: bool = False, row_scales: bool = False, variable_k: bool = False, col_scale: bool = False,
                   accumulate: bool = False) -> dict:
    """Compile the dense kernel (or, ``grouped``, the M-grouped MoE kernel of
    triton/grouped_gemm/grouped_gemm_fp8_gluon.py; ``variable_k``, the variable-K wgrad kernel of
    triton/grouped_gemm/grouped_gemm_fp8_variable_k_gluon.py, with ``accumulate`` its reduce-add
    epilogue) for sm_90 with config ``cfg``; ``row_scales``: the dense kernel's B_ROW_SCALES path
    (per-row B scales, the FP8 linear's wgrad); ``col_scale``: the M-grouped kernel's COL_SCALE path
    (per-column weight scales, ROWWISE)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon import language as gl

    from primus_turbo.triton.gemm import gemm_fp8_gluon as g

    a_layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, 128], gl.float8e4nv)
    c_ty = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[out_dtype]
    c_layout = gl.NVMMASharedLayout.get_default_for([64, 128], c_ty)
    sig = {
        "a_desc": f"tensordesc<fp8e4nv[64, 128],{a_layout!r}>",
        "b_desc": f"tensordesc<fp8e4nv[{cfg.block_n}, 128],{b_layout!r}>",
        "c_desc": f"tensordesc<{out_dtype}[64, 128],{c_layout!r}>",
    }
    if variable_k:
        from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_variable_k_gluon as vk

        kernel = vk._grouped_gemm_fp8_variable_k_ws_kernel
        sig = {"x_desc": sig["a_desc"], "y_desc": sig["b_desc"], "c_desc": sig["c_desc"],
               "sx_ptr": "*fp32", "sy_ptr": "*fp32", "offs_ptr": "*i64", "M": "i32", "P": "i32", "Q": "i32",
               "G": "i32", "stride_sxp": "i32", "stride_sxk": "i32", "stride_syk": "i32"}
    elif grouped:
        from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_gluon as gg

        kernel = gg._grouped_gemm_fp8_blockwise_ws_kernel
        sig.update({"c_ptr": f"*{out_dtype}", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "offs_ptr": "*i64",
                    "sc_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "G": "i32", "stride_cm": "i32",
                    "stride_sam": "i32", "stride_sak": "i32", "stride_sbg": "i32", "stride_sbn": "i32",
                    "stride_sbk": "i32", "stride_scg": "i32"})
    else:
        kernel = g._gemm_fp8_blockwise_ws_kernel
        sig.update({"sa_ptr": "*fp32", "sb_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                    "stride_sam": "i32", "stride_sak": "i32", "stride_sbn": "i32", "stride_sbk": "i32"})
    consts = dict(GROUP_M=cfg.group_m, STAGES=cfg.stages, C_BUFS=cfg.c_bufs, PIPELINE=cfg.pipeline, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs)
    if variable_k:
        consts["ACCUMULATE"] = bool(accumulate)
    elif accumulate:
        raise ValueError("accumulate is a path of the variable-K kernel only")
    if grouped and not variable_k:
        consts["COL_SCALE"] = bool(col_scale)
    elif col_scale:
        raise ValueError("col_scale is a path of the M-grouped kernel only")
    if row_scales:
        if grouped or variable_k:
            raise ValueError("row_scales is a path of the dense kernel only")
        consts["B_ROW_SCALES"] = True
    sig.update({k: "constexpr" for k in consts})
    if (row_scales or variable_k) and g.row_scales_via_smem(cfg):  # column scales TMA'd through the ring
        sig["sy_desc" if variable_k else "sb_desc"] = f"tensordesc<fp32[1, {cfg.block_n}],{g._sb_layout()!r}>"
    src = GluonASTSource(kernel, sig, consts)
    opts = dict(num_warps=4)  # the default partition's warps; Triton sets .maxnreg for all 12
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    md = k.metadata
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    report = _ptxas_report(k.asm["ptx"], ptxas)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", report)]
    sass = _sass(k.asm["cubin"], os.path.join(os.path.dirname(ptxas), "cuobjdump"))
    used = [int(x) for x in re.findall(r"\bR(\d+)\b", sass)]
    res = dict(config=cfg.short(), shared=md.shared, num_warps=md.num_warps, regs=max(regs) if regs else None,
               max_reg=max(used) + 1 if used else None, spill_bytes=sum(spills), sass_counts=sass_counts(sass),
               serialized=sorted(set(re.findall(r"\((C75\d\d)\)", report))),
               setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"]))),
               ptxas=report.strip().splitlines()[-3:])
    if dump:
        d = Path(dump)
        d.mkdir(parents=True, exist_ok=True)
        kind = "vk_acc_" if variable_k and accumulate else "vk_" if variable_k else "grouped_" if grouped else ""
        stem = f"gluon_fp8_{kind}{'rows_' if row_scales else ''}{'cols_' if col_scale else ''}{out_dtype}_{cfg.short()}"
        for ext in ("ttgir", "llir", "ptx"):
            (d / f"{stem}.{ext}").write_text(k.asm[ext])
        (d / f"{stem}.cubin").write_bytes(k.asm["cubin"])
        if sass_out:
            (d / f"{stem}.sass").write_text(sass)
    return res


_SASS_OPS = {  # what -> SASS opcodes (an opcode also matches with ".<suffix>"s)
    "wgmma": ("HGMMA", "QGMMA"),     # warpgroup MMA: 16-bit / FP8 operands
    "tma_load": ("UTMALDG",),        # TMA global -> shared
    "tma_store": ("UTMASTG",),       # TMA shared -> global
    "tma_reduce": ("UTMAREDG",),     # TMA reduce (add) shared -> global
    "local_store": ("STL",),         # spills / local arrays
    "local_load": ("LDL",),
}


def sass_counts(sass: str) -> dict:
    """How many instructions of each kind in _SASS_OPS the SASS holds (empty SASS: all zero)."""
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, flags=re.M)
    base = [op.split(".")[0] for op in ops]
    return {name: sum(b in codes for b in base) for name, codes in _SASS_OPS.items()}


def _sass(cubin: bytes, cuobjdump: str) -> str:
    """SASS of the cubin (empty when the bundled cuobjdump is missing)."""
    if not os.path.exists(cuobjdump):
        return ""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        out = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True)
        return out.stdout


def main(argv=None) -> int:
    from primus_turbo.triton.gemm import gemm_fp8_gluon as g

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", default=["n128s5", "n128s6", "n128s4c2", "n128s5x", "n128s6x", "n256s4", "n256s3c2"])
    p.add_argument("--out-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--dump", default=None, help="write ttgir/ptx/cubin (and --sass) here")
    p.add_argument("--sass", action="store_true")
    p.add_argument("--attn", action="store_true",
                   help="the attention forward (triton/attention/flash_attn_fwd_gluon.py), every shipped variant: "
                        "registers, spills (STL/LDL), HGMMA count")
    p.add_argument("--attn-bwd", action="store_true",
                   help="the attention backward (triton/attention/flash_attn_bwd_gluon.py): dK/dV and dQ kernels, "
                        "every shipped variant: registers, spills (STL/LDL), HGMMA count")
    p.add_argument("--attn-fp8", action="store_true",
                   help="the FP8 attention forward (triton/attention/flash_attn_fp8_fwd_gluon.py), every shipped "
                        "variant: registers, spills (STL/LDL), QGMMA count, softmax/PV overlap")
    p.add_argument("--grouped", action="store_true",
                   help="the M-grouped MoE kernel (triton/grouped_gemm/grouped_gemm_fp8_gluon.py) instead")
    p.add_argument("--row-scales", action="store_true",
                   help="the dense kernel's B_ROW_SCALES path (per-row B scales: the FP8 linear's wgrad)")
    p.add_argument("--variable-k", action="store_true",
                   help="the variable-K grouped kernel (the MoE wgrad, grouped_gemm_fp8_variable_k_gluon.py)")
    p.add_argument("--accumulate", action="store_true",
                   help="with --variable-k: the reduce-add (out +=) epilogue; needs --out-dtype fp32")
    args = p.parse_args(argv)
    if args.attn_fp8:
        import importlib.util

        spec = importlib.util.spec_from_file_location("check_gluon_attn_fp8", _ROOT / "scripts" / "check_gluon_attn_fp8.py")
        fp8 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fp8)
        return 1 if fp8.compile_report(args.dump, args.sass)[1] else 0
    if args.attn or args.attn_bwd:  # the attention compile checks live with their GPU check script
        import importlib.util

        spec = importlib.util.spec_from_file_location("check_gluon_attn", _ROOT / "scripts" / "check_gluon_attn.py")
        attn = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(attn)
        report = attn.compile_bwd_report if args.attn_bwd else attn.compile_report
        return 1 if report(args.dump, args.sass)[1] else 0
    if (args.variable_k or args.row_scales) and args.configs == p.get_default("configs"):
        # per-row B scales: the register path (n128, not pipelined) and the shared-memory one
        # (pipelined, 256-wide; the default n128s5xr240w24)
        args.configs = ["n128s6", "n128s5", "n128s4", "n128s5xr240w24", "n128s4xr240w24", "n256s3c2", "n256s3"]
        if args.out_dtype == "fp32":  # do not fit next to fp32 staging buffers
            args.configs = [c for c in args.configs if c not in ("n128s6", "n256s3c2")]
    bad = 0
    for text in args.configs:
        cfg = g.GluonBlockwiseConfig.parse(text)
        try:
            r = compile_config(cfg, args.out_dtype, args.dump, args.sass, grouped=args.grouped,
                               row_scales=args.row_scales, variable_k=args.variable_k, accumulate=args.accumulate)
        except Exception as exc:  # noqa: BLE001 - report and go on
            bad += 1
            msg = str(exc).strip().splitlines()
            print(f"FAIL {cfg.short()}: {type(exc).__name__}: {' | '.join(msg[-6:])[:2000]}")
            continue
        over = r["shared"] > g.SMEM_LIMIT
        flag = ("  OVER SMEM" if over else "") + ("  SPILLS" if r["spill_bytes"] else "")
        flag += f"  WGMMA SERIALIZED {r['serialized']}" if r["serialized"] else ""
        bad += bool(flag)
        print(f"ok   {r['config']}: smem={r['shared']} launch maxnreg={r['regs']} registers used (any "
              f"partition)={r['max_reg']} spill_bytes={r['spill_bytes']} setmaxnreg={r['setmaxnreg']}{flag}")
        if args.sass:
            print("      SASS:", " ".join(f"{k}={v}" for k, v in r["sass_counts"].items()))
        for line in r["ptxas"]:
            print("     ", line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
