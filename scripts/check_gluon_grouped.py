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
               "pace_ptr": "*i32" if cfg.pace else "*i64",
               "M": "i32", "N": "i32", "K": "i32", "G": "i32", "stride_cm": "i32"}
        consts["B_KMAJOR"] = bool(b_kmajor)
        consts["PACE"] = cfg.pace
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


# ----------------------------------------------------------------------------------------------
# GPU: correctness and timing
# ----------------------------------------------------------------------------------------------
CASES = [  # (G, tokens per expert, N, K, label): forward out [M, N] = a [M, K] @ w[g]^T, w [G, N, K]
    (32, 2048, 4096, 7168, "DSv3 gate_up"),
    (32, 2048, 7168, 2048, "DSv3 down"),
    (16, 2048, 1536, 2048, "Qwen3 gate_up"),
    (16, 2048, 2048, 768, "Qwen3 down"),
]
#: many small groups (DeepSeek-V3 at EP4: 64 local experts, 512 tokens each): ``--cases g64``
CASES_G64 = [
    (64, 512, 4096, 7168, "DSv3-EP4 gate_up"),
    (64, 512, 7168, 2048, "DSv3-EP4 down"),
]
TAIL_ROWS = 100  # unbalanced: rows past group_offs[G], filled with NaN (must never reach a result)
MIN_SNR = 45.0  # bf16 output against the fp32 product
GEMMS = ("fwd", "dgrad", "wgrad", "wgrad_acc")


def _fp8_script():
    """scripts/check_gluon_fp8.py as a module (its timing helper and unbalanced group sizes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_gluon_fp8", _ROOT / "scripts" / "check_gluon_fp8.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _operands(G, rows, N, K, pattern, seed=0):
    """a [M, K], w [G, N, K], dy [M, N] (bf16, cuda), lens, offs; the unbalanced pattern has an
    empty expert, sizes that are not multiples of 64 and TAIL_ROWS NaN rows past offs[G]."""
    import torch

    lens = _fp8_script()._group_lens(G, rows, pattern)
    tail = TAIL_ROWS if pattern == "unbalanced" else 0
    M = sum(lens) + tail
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(G, N, K, device="cuda", generator=gen) / K ** 0.5).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", generator=gen).to(torch.bfloat16)
    if tail:
        a[M - tail:] = float("nan")
        dy[M - tail:] = float("nan")
    offs = torch.zeros(G + 1, dtype=torch.int64)
    offs[1:] = torch.tensor(lens).cumsum(0)
    return a, w, dy, lens, offs.cuda()


def _refs(a, w, dy, lens):
    """fp32 (TF32 off) references: fwd [M, N], dgrad [M, K] (rows past offs[G] zero), wgrad [G, N, K]."""
    import torch

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        fwd = torch.zeros(a.shape[0], w.shape[1], device="cuda")
        dgrad = torch.zeros(a.shape[0], w.shape[2], device="cuda")
        wgrad = torch.zeros(w.shape, device="cuda")
        start = 0
        for g, n in enumerate(lens):
            ag, dg, wg = a[start:start + n].float(), dy[start:start + n].float(), w[g].float()
            fwd[start:start + n] = ag @ wg.T
            dgrad[start:start + n] = dg @ wg
            wgrad[g] = dg.T @ ag
            start += n
        return dict(fwd=fwd, dgrad=dgrad, wgrad=wgrad)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _calls(a, w, dy, offs, cfg, main_grad):
    """The four GEMMs of one config (None: the tl kernel, "torch": torch._grouped_mm) as callables."""
    import torch

    if cfg == "torch":
        offs32 = offs[1:].to(torch.int32)
        return dict(fwd=lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs32),
                    dgrad=lambda: torch._grouped_mm(dy, w, offs=offs32),
                    wgrad=lambda: torch._grouped_mm(dy.t(), a, offs=offs32),
                    wgrad_acc=lambda: main_grad.add_(torch._grouped_mm(dy.t(), a, offs=offs32)))
    if cfg is None:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (
            grouped_gemm_triton, grouped_gemm_variable_k_triton,
        )

        return dict(fwd=lambda: grouped_gemm_triton(a, w.transpose(1, 2), None, offs),
                    dgrad=lambda: grouped_gemm_triton(dy, w, None, offs),
                    wgrad=lambda: grouped_gemm_variable_k_triton(dy, a, None, offs),
                    wgrad_acc=lambda: grouped_gemm_variable_k_triton(dy, a, None, offs, out=main_grad,
                                                                     accumulate=True))
    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import fitted_config, grouped_gemm_gluon
    from primus_turbo.triton.grouped_gemm.grouped_gemm_variable_k_gluon import grouped_gemm_variable_k_gluon

    c32 = fitted_config(cfg, torch.float32)
    return dict(fwd=lambda: grouped_gemm_gluon(a, w.transpose(1, 2), offs, config=cfg),
                dgrad=lambda: grouped_gemm_gluon(dy, w, offs, config=cfg),
                wgrad=lambda: grouped_gemm_variable_k_gluon(dy, a, offs, config=cfg),
                wgrad_acc=lambda: grouped_gemm_variable_k_gluon(dy, a, offs, out=main_grad, accumulate=True,
                                                                config=c32))


def _check(name, out, ref, lens) -> dict:
    """SNR of ``out`` against ``ref`` (rows past offs[G] of an M-grouped output must be exact zeros)."""
    from primus_turbo.testing import snr_db

    res = dict(snr=round(snr_db(ref, out), 1))
    if name in ("fwd", "dgrad"):
        res["tail_zero"] = bool((out[sum(lens):] == 0).all())
    return res


def run_case(case, pattern, configs, rep_ms, do_time=True, bases=True) -> dict:
    """One case: every GEMM of the tl kernel and torch._grouped_mm (``bases``) and of each Gluon
    config, checked against the fp32 reference and (``do_time``) timed."""
    import torch

    G, rows, N, K, label = case
    fp8 = _fp8_script()
    a, w, dy, lens, offs = _operands(G, rows, N, K, pattern)
    refs = _refs(a, w, dy, lens)
    tokens = sum(lens)
    flops = 2.0 * tokens * N * K
    res = dict(label=label, pattern=pattern, G=G, N=N, K=K, tokens=tokens, impl={})
    mg0 = torch.randn(G, N, K, device="cuda")
    for cfg in ([None, "torch"] if bases else []) + list(configs):
        name = "tl" if cfg is None else cfg if cfg == "torch" else cfg.short()
        entry = res["impl"].setdefault(name, {})
        main_grad = mg0.clone()
        calls = _calls(a, w, dy, offs, cfg, main_grad)
        for gemm, fn in calls.items():
            e = entry.setdefault(gemm, {})
            try:
                if gemm == "wgrad_acc":
                    main_grad.copy_(mg0)
                out = fn()
                torch.cuda.synchronize()
                if cfg != "torch":  # torch._grouped_mm leaves the tail rows unwritten
                    ref = refs[gemm] if gemm != "wgrad_acc" else refs["wgrad"] + mg0
                    e.update(_check(gemm, out, ref, lens))
                    if cfg is not None and gemm != "wgrad_acc":  # bitwise repeatability
                        e["repeat_equal"] = bool(torch.equal(fn(), out))
                if do_time:
                    e["tflops"] = round(flops / fp8._bench(fn, rep_ms) / 1e9, 1)
            except Exception as exc:  # noqa: BLE001 - report and go on
                e["error"] = fp8._err(exc)
    return res


def _ok(name, gemm, e) -> bool:
    if "error" in e:
        return False
    if name == "torch":
        return True
    return e.get("snr", 0) >= MIN_SNR and e.get("tail_zero", True) and e.get("repeat_equal", True)


def _geo(xs):
    import math

    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def print_table(results, configs) -> int:
    names = [c.short() for c in configs]
    bad = []
    hdr = f"{'case':<28}{'gemm':<10}{'tl':>7}{'torch':>7}" + "".join(f"{n[:14]:>16}" for n in names)
    print("\nTFLOP/s (SNR dB) and best Gluon / torch, / tl\n" + hdr + f"{'best/torch':>11}{'best/tl':>9}")
    for r in results:
        for gemm in GEMMS:
            tl, to = r["impl"]["tl"].get(gemm, {}), r["impl"]["torch"].get(gemm, {})
            row = f"{r['label'] + ' ' + r['pattern'][:3]:<28}{gemm:<10}{tl.get('tflops', 0):>7.0f}{to.get('tflops', 0):>7.0f}"
            best = 0.0
            for n in names:
                e = r["impl"][n].get(gemm, {})
                ok = _ok(n, gemm, e)
                if not ok:
                    bad.append((r["label"], r["pattern"], gemm, n, e))
                best = max(best, e.get("tflops", 0) if ok else 0)
                row += f"{e.get('tflops', 0):>8.0f}({e.get('snr', float('nan')):>5.1f}){'!' if not ok else ' '}"
            row += f"{best / to['tflops'] if to.get('tflops') else float('nan'):>11.3f}"
            row += f"{best / tl['tflops'] if tl.get('tflops') else float('nan'):>9.3f}"
            if not _ok("tl", gemm, tl):
                row += "  (tl check failed)"
            print(row)
    # geomeans: per config and per GEMM, and of whole steps (fwd; fwd + dgrad + wgrad by summed time)
    print()
    for base in ("torch", "tl"):
        for n in names + ["best"]:
            parts = []
            for gemm in GEMMS:
                xs = [_pick(r, n, gemm) / r["impl"][base][gemm]["tflops"] for r in results
                      if r["impl"][base].get(gemm, {}).get("tflops")]
                parts.append(f"{gemm} {_geo(xs):.3f}")
            # speedup of the forward + backward (fwd + dgrad + wgrad times) per case
            step = [_step(r, base, ("fwd", "dgrad", "wgrad")) / _step(r, n, ("fwd", "dgrad", "wgrad"))
                    for r in results if _step(r, n, ("fwd", "dgrad", "wgrad"))]
            print(f"geomean {n:<26} / {base:<5}: " + ", ".join(parts) + f"; fwd+bwd {_geo(step):.3f}")
    for b in bad:
        print("FAILED", b[:4], {k: v for k, v in b[4].items() if k != "tflops"})
    return 1 if bad else 0


def _pick(r, n, gemm) -> float:
    """TFLOP/s of config n (or "best": the fastest config that passed) on one GEMM of result r."""
    if n == "best":
        return max((e[gemm].get("tflops", 0) for k, e in r["impl"].items() if k not in ("tl", "torch")
                    and _ok(k, gemm, e.get(gemm, {}))), default=0)
    e = r["impl"][n].get(gemm, {})
    return e.get("tflops", 0) if _ok(n, gemm, e) else 0


def _step(r, n, gemms) -> float:
    """Milliseconds-like sum of 1/TFLOP/s over ``gemms`` (0 when one is missing)."""
    t = [_pick(r, n, g) if n not in ("tl", "torch") else r["impl"][n].get(g, {}).get("tflops", 0) for g in gemms]
    return 0 if not all(t) else sum(1 / x for x in t)


def smoke(config_text: str) -> int:
    """Small unbalanced problem (empty expert, odd sizes, NaN tail rows), every GEMM; in a child
    process with a timeout (a hung kernel must not take the whole check down)."""
    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import GluonGroupedConfig

    cfg = GluonGroupedConfig.parse(config_text)
    worst = float("inf")
    for case in ((5, 300, 384, 256, "small"), (4, 200, 192, 136, "tails")):
        r = run_case(case, "unbalanced", [cfg], 0, do_time=False, bases=False)
        for gemm in GEMMS:
            e = r["impl"][cfg.short()][gemm]
            if not _ok(cfg.short(), gemm, e):
                print(f"SMOKE {config_text} {case[-1]} {gemm}: {e}")
                return 1
            worst = min(worst, e["snr"])
    print(f"SMOKE {config_text} ok, worst snr {worst:.1f} dB")
    return 0


def gpu_main(args) -> int:
    import subprocess
    import time

    import torch

    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import GROUPED16_CANDIDATES, GluonGroupedConfig

    fp8 = _fp8_script()
    print(fp8._gpu_info(), flush=True)
    texts = args.configs or list(GROUPED16_CANDIDATES)
    configs = []
    for t in texts:
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--smoke", t], capture_output=True,
                               text=True, timeout=args.smoke_timeout, env=dict(os.environ))
            ok, msg = r.returncode == 0, " | ".join((r.stdout + r.stderr).strip().splitlines()[-3:])[:600]
        except subprocess.TimeoutExpired:
            ok, msg = False, f"timed out after {args.smoke_timeout} s (deadlock?)"
        print(f"smoke {t}: {'ok' if ok else 'FAILED'} ({time.time() - t0:.0f} s) {msg}", flush=True)
        if ok:
            configs.append(GluonGroupedConfig.parse(t))
    cases = CASES[:1] + CASES[3:] if args.quick else CASES
    if args.cases == "g64":
        cases = CASES_G64
    elif args.cases == "all":
        cases = cases + CASES_G64
    results = []
    for case in cases:
        for pattern in ("balanced", "unbalanced"):
            t0 = time.time()
            results.append(run_case(case, pattern, configs, args.rep_ms))
            print(f"{case[-1]} {pattern}: {time.time() - t0:.0f} s", flush=True)
            torch.cuda.empty_cache()
    rc = print_table(results, configs)
    if args.out:
        import json

        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "check_gluon_grouped.json").write_text(json.dumps(results, indent=1, default=str))
    return rc or (len(configs) < len(texts))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", default=None, help="Gluon configs (GluonGroupedConfig.parse strings)")
    p.add_argument("--compile", action="store_true", help="compile for sm_90 on CPU (no GPU)")
    p.add_argument("--dump", default=None)
    p.add_argument("--sass", action="store_true")
    p.add_argument("--smoke", default=None, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="DeepSeek-V3 gate_up and Qwen3 down only")
    p.add_argument("--cases", choices=("ep8", "g64", "all"), default="ep8",
                   help="ep8: DeepSeek-V3 / Qwen3 EP8 (default); g64: 64 experts x 512 tokens; all: both")
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--smoke-timeout", type=int, default=90)
    p.add_argument("--out", default=None, help="write check_gluon_grouped.json here")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke(args.smoke)
    from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg

    if args.compile:
        return compile_main(args.configs or list(gg.GROUPED16_CANDIDATES),
                            args.dump, args.sass)
    return gpu_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
