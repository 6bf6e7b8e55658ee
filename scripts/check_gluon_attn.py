"""Check and time the warp-specialized Gluon attention forward (triton/attention/flash_attn_fwd_gluon.py).

On an sm_90 GPU (project not installed, PYTHONPATH=. is enough):

    PYTHONPATH=. python scripts/check_gluon_attn.py --out DIR            # correctness, then timing
    PYTHONPATH=. python scripts/check_gluon_attn.py --out DIR --quick    # seq 4096 only
    PYTHONPATH=. python scripts/check_gluon_attn.py --out DIR --configs n128s2p n128s3 n64s4   # + a config sweep
    PYTHONPATH=. python scripts/check_gluon_attn.py --out DIR --configs n128s2o n128s3o  # o: softmax under PV in SASS
    PYTHONPATH=. python scripts/check_gluon_attn.py --compile-only [--dump DIR --sass]   # CPU: sm_90 compile, SASS
    PYTHONPATH=. python scripts/check_gluon_attn.py --compile-only --configs n128s2o     # CPU: those configs' compile
    PYTHONPATH=. python scripts/check_gluon_attn.py --bwd --out DIR       # the Gluon backward instead
    PYTHONPATH=. python scripts/check_gluon_attn.py --bwd --compile-only  # CPU: its sm_90 compile report
    PYTHONPATH=. python scripts/check_gluon_attn.py --fp8 --out DIR       # the Gluon FP8 forward instead
    PYTHONPATH=. python scripts/check_gluon_attn.py --fp8 --compile-only  # CPU: its sm_90 compile report

``--fp8`` checks and times the Gluon FP8 (E4M3) forward (triton/attention/flash_attn_fp8_fwd_gluon.py;
the code is in scripts/check_gluon_attn_fp8.py): child-process correctness against an fp32
reference on the dequantized inputs, the tl FP8 kernel (>= 30 dB) and the bf16 reference (>= 20
dB), the backward through ``flash_attn_fp8_func`` on its O and LSE; then Gluon FP8 vs tl FP8 vs
our bf16 Gluon and tl forwards vs SDPA cuDNN, with the ratio FP8 / bf16; writes
DIR/gluon_attn_fp8.json.

``--bwd`` checks and times the Gluon backward (triton/attention/flash_attn_bwd_gluon.py) the same
way: each variant in a child process first (the tl forward's O and LSE; dq, dk, dv, dsink of the
Gluon backward, with its Gluon dQ kernel and with the tl dQ kernel, into NaN-poisoned buffers,
against fp32 autograd through the reference (>= 40 dB, cases small enough for it) and the tl
backward (>= 40 dB), plus a bitwise rerun), then timing at the forward's shapes: Gluon (both dQ
kernels) vs the tl backward vs SDPA flash and cuDNN backward (autograd.grad of their forward),
TFLOP/s counted as 2.5x the forward's FLOPs; writes DIR/gluon_attn_bwd.json.

1. Correctness: every kernel variant (head dim 64/128, causal or not, bf16/fp16, a sink, GQA,
   seq not a multiple of the block, seq_q != seq_kv with empty causal rows, bshd/sbhd/bhsd
   inputs, one long sequence) runs first in a child process with a timeout, so a hang or a fault
   costs that variant only. Outputs are poisoned (NaN) before the call; O and LSE are compared with
   an fp32 reference (>= 40 dB) and with the ``triton.language`` forward (>= 40 dB), the +inf LSE
   of empty rows must match exactly, and the backward (the tl kernels) run on the Gluon forward's
   O and LSE through ``turbo.ops.flash_attn_func`` must give the gradients it gives with the tl
   forward.
2. Timing (only variants that passed): Gluon vs our tl forward vs SDPA flash (FlashAttention-2)
   and SDPA cuDNN (``torch.nn.attention.sdpa_kernel``) on Llama-like shapes: batch * seq = 16k
   tokens, 32 query heads, head dims 128 and 64, seq 2k-16k, causal and not; median of CUDA-event
   timings. Prints a table and the geometric means; writes DIR/gluon_attn.json. ``--configs``
   adds those tile configs (``GluonAttnConfig.parse``: ``n128s2p``, ``n128s2o``, ``n64s3po``, ...),
   each checked on the bf16 variants it fits first, then timed as ``gluon:<config>``.

The compile report (``--compile-only``, CPU) also counts the exponentials (MUFU.EX2) between each
``S_j`` wait and the following PV wait (``ex2_under_pv``: one number per loop of each consumer
warpgroup): the shipped configs have none or a handful there (ptxas hoists the PV wait above the
softmax); a config with ``o`` must have the whole softmax there, else it is reported as failing.

Exit status 1 if any correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

MIN_SNR = 40.0
TOKENS = 16384
SEQS = (2048, 4096, 8192, 16384)
CHILD_TIMEOUT_S = 300
DEVICE = "cuda"  # the tests' CPU dry run of run_variant swaps in "cpu" (and the tl kernel for the Gluon one)

# (name, B, Sq, Sk, Hq, Hk, D, causal, dtype, sink, layout)
VARIANTS = [
    (f"d{d}_{'causal' if c else 'full'}_{dt}", 2, 1000, 1000, 4, 2, d, c, dt, False, "bshd")
    for d in (64, 128) for c in (False, True) for dt in ("bf16", "fp16")
] + [
    ("d128_causal_sink", 2, 777, 777, 4, 4, 128, True, "bf16", True, "bshd"),
    ("d64_full_sink_gqa8", 1, 513, 700, 8, 1, 64, False, "bf16", True, "bshd"),
    ("d128_causal_sq300_sk1100", 2, 300, 1100, 4, 2, 128, True, "bf16", False, "bshd"),
    ("d128_causal_sq1100_sk300_empty_rows", 2, 1100, 300, 4, 2, 128, True, "bf16", False, "bshd"),
    ("d64_causal_sq1100_sk300_empty_rows", 1, 1100, 300, 2, 1, 64, True, "fp16", False, "bshd"),
    ("d128_full_sbhd", 3, 640, 640, 4, 2, 128, False, "bf16", False, "sbhd"),
    ("d128_causal_bhsd", 2, 640, 640, 4, 2, 128, True, "bf16", False, "bhsd"),
    ("d64_full_bhsd_fp16", 2, 333, 555, 4, 4, 64, False, "fp16", False, "bhsd"),
    ("d128_tiny", 1, 1, 5, 2, 1, 128, False, "bf16", False, "bshd"),
    ("d128_causal_65_129", 2, 65, 129, 2, 2, 128, True, "bf16", False, "bshd"),
    ("d128_causal_long8k", 1, 8192, 8192, 8, 8, 128, True, "bf16", False, "bshd"),
    ("d64_full_long8k", 1, 8192, 8192, 8, 8, 64, False, "bf16", False, "bshd"),
]


# ---------------------------------------------------------------------------------------------
# sm_90 compile (CPU is enough): registers, spills, wgmma count
# ---------------------------------------------------------------------------------------------
def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package): gluon_compile_check's ptxas and
    cuobjdump helpers, and this file's shared helpers for check_gluon_attn_fp8.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, _ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_sm90(fn, sig: dict, consts: dict, name: str, mma: str = "HGMMA", extra=None,
                 dump: str | None = None, sass_out: bool = False, attrs: dict | None = None,
                 options: dict | None = None) -> dict:
    """Compile the Gluon kernel ``fn`` for sm_90 (``sig``: its argument types, ``consts``: its
    constexprs) and report what ptxas and the SASS say: ``regs`` (the launch maxnreg), ``max_reg``
    (highest register any partition touches, after setmaxnreg), ``spill_bytes``, ``<mma>`` (e.g.
    ``hgmma``) / ``local_mem`` (STL/LDL) instruction counts, what ``extra(sass)`` adds (a kernel's
    own schedule checks), ``serialized`` (ptxas notes C7514/C7515), shared memory. The one compile
    path of the bf16 forward, the backward and the FP8 forward reports; with ``dump``, writes
    ttgir/ptx/cubin (and the SASS) as ``<name>.*``. ``attrs``: argument attributes as a launch
    specializes them, ``{(arg index,): [["tt.divisibility", 16]]}`` (none by default). ``options``:
    more compile options (e.g. ``maxnreg``, as a launch passes it)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cc = load_script("gluon_compile_check")
    sig.update({k: "constexpr" for k in consts})
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, **(options or {})))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    report = cc._ptxas_report(k.asm["ptx"], ptxas)
    sass = cc._sass(k.asm["cubin"], os.path.join(os.path.dirname(ptxas), "cuobjdump"))
    used = [int(x) for x in re.findall(r"\bR(\d+)\b", sass)]
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", report)]
    res = dict(variant=name, shared=k.metadata.shared, regs=max(regs) if regs else None,
               max_reg=max(used) + 1 if used else None,
               spill_bytes=sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)))
    res[mma.lower()] = len(re.findall(rf"\b{mma}\.", sass)) if sass else None
    res["local_mem"] = len(re.findall(r"\b(?:STL|LDL)\b", sass)) if sass else None
    res.update(extra(sass) if extra else {})
    res["serialized"] = sorted(set(re.findall(r"\((C75\d\d)\)", report)))
    res["setmaxnreg"] = sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])))
    if dump:
        d = Path(dump)
        d.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (d / f"{name}.{ext}").write_text(k.asm[ext])
        (d / f"{name}.cubin").write_bytes(k.asm["cubin"])
        if sass_out:
            (d / f"{name}.sass").write_text(sass)
    return res


def compile_row(rows: list, label: str, variant: str, compile_fn):
    """One row of a compile report: ``compile_fn()``'s result, or None when it raised (printed as
    ``FAIL <label>`` and recorded in ``rows`` as ``variant`` with the error; the report goes on)."""
    try:
        return compile_fn()
    except Exception as exc:  # noqa: BLE001 - report and go on
        msg = " | ".join(str(exc).strip().splitlines()[-6:])[:2000]
        print(f"FAIL {label}: {type(exc).__name__}: {msg}")
        rows.append(dict(variant=variant, error=msg))
        return None


def mma_flags(r: dict, mma: str = "HGMMA") -> str:
    """The failures every compile report flags: spills or local memory, no wgmma of kind ``mma``,
    wgmmas ptxas serialized."""
    flag = ("  SPILLS" if r["spill_bytes"] or r["local_mem"] else "") + (f"  NO {mma}" if r[mma.lower()] == 0 else "")
    return flag + (f"  WGMMA SERIALIZED {r['serialized']}" if r["serialized"] else "")


def ex2_under_pv(sass: str) -> list:
    """MUFU.EX2 count between each ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (S_j retired, the PV MMA of
    block j-1 still in flight) and the next ``gsb0, 0x0`` wait (the PV MMA retired): the softmax
    exponentials that run under the PV MMA, one number per software-pipelined loop of each consumer
    warpgroup (the full-block loop and the masked one)."""
    import re

    counts, cur = [], None
    for op in re.findall(r"(WARPGROUP\.DEPBAR\.LE gsb0, 0x[01]|MUFU\.EX2)", sass):
        if op.endswith("0x1"):
            cur = 0
        elif op.startswith("MUFU"):
            cur = None if cur is None else cur + 1
        elif cur is not None:
            counts.append(cur)
            cur = None
    return counts


def compile_attn(head_dim: int, causal: bool, dtype: str = "bf16", sink: bool = False, cfg=None,
                 dump: str | None = None, sass_out: bool = False) -> dict:
    """Compile the Gluon forward for sm_90 and report what ptxas and the SASS say: ``regs`` (the
    launch maxnreg), ``max_reg`` (highest register any partition touches, after setmaxnreg),
    ``spill_bytes``, ``hgmma`` / ``local_mem`` (STL/LDL) instruction counts, ``serialized``
    (ptxas notes C7514/C7515), ``ex2_under_pv`` (:func:`ex2_under_pv`), ``softmax_ex2`` (the
    exponentials of one block's softmax per thread: P's 64 x BLOCK_N / 128 plus the two alphas),
    shared memory."""
    from triton.experimental.gluon import language as gl

    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa

    cfg = cfg or fa.default_attn_config(head_dim, causal)
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([1, fa.HALF_M, 1, head_dim], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([1, cfg.block_n, 1, head_dim], gdt)
    q_ty = f"tensordesc<{dtype}[1, {fa.HALF_M}, 1, {head_dim}],{q_layout!r}>"
    kv_ty = f"tensordesc<{dtype}[1, {cfg.block_n}, 1, {head_dim}],{kv_layout!r}>"
    sig = {"q_desc": q_ty, "k_desc": kv_ty, "v_desc": kv_ty, "o_desc": q_ty, "LSE": "*fp32", "SINK": "*fp32",
           "H": "i32", "GROUP": "i32", "SEQ_Q": "i32", "SEQ_K": "i32", "offset": "i32", "win_right": "i32",
           "qk_scale": "fp32"}
    consts = dict(HAS_RIGHT=bool(causal), HAS_SINK=bool(sink), STAGES=cfg.stages, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs, PINGPONG=cfg.pingpong, OVERLAP=cfg.overlap,
                  NUM_WG=cfg.consumers, EMU=cfg.emu, EMU_DEG=cfg.emu_deg, LAZY=cfg.lazy, SKIP=cfg.skip,
                  HEADS_FASTEST=cfg.heads_fastest)
    name = f"attn_d{head_dim}_{'causal' if causal else 'full'}_{dtype}{'_sink' if sink else ''}_{cfg.short()}"

    def extra(sass):
        return dict(ex2_under_pv=ex2_under_pv(sass) if sass else None, softmax_ex2=fa.HALF_M * cfg.block_n // 128 + 2)

    return compile_sm90(fa._attn_fwd_ws_kernel, sig, consts, name, "HGMMA", extra, dump, sass_out)


def compile_variants() -> list:
    """Every shipped variant: head dim 64/128 x causal x bf16/fp16, plus the sink path."""
    return [(d, c, dt, False) for d in (64, 128) for c in (False, True) for dt in ("bf16", "fp16")] + [
        (128, True, "bf16", True), (64, False, "fp16", True)]


def compile_report(dump: str | None = None, sass_out: bool = False, configs=()) -> tuple[list, int]:
    """Every shipped variant with its default config; with ``configs`` (config strings), each of
    them instead on the variants whose head dim it fits. A config with ``o`` (overlap) must keep
    the whole softmax between the S and PV waits in every loop."""
    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa

    cfgs = [fa.GluonAttnConfig.parse(t) for t in configs] or [None]
    rows, bad = [], 0
    for cfg in cfgs:
        for d, c, dt, sk in compile_variants():
            if cfg is not None and cfg.check(d) is not None:
                continue
            r = compile_row(rows, f"attn d{d} causal={c} {dt} sink={sk} {cfg.short() if cfg else ''}",
                            f"attn_d{d}_{c}_{dt}_{sk}",
                            lambda: compile_attn(d, c, dt, sk, cfg=cfg, dump=dump, sass_out=sass_out))
            if r is None:
                bad += 1
                continue
            flag = mma_flags(r)
            if cfg is not None and cfg.overlap and r["ex2_under_pv"] is not None and (
                    not r["ex2_under_pv"] or min(r["ex2_under_pv"]) < r["softmax_ex2"]):
                flag += "  SOFTMAX NOT UNDER PV"
            bad += bool(flag)
            print(f"{'FAIL' if flag else 'ok  '} {r['variant']}: smem={r['shared']} launch maxnreg={r['regs']} "
                  f"registers used={r['max_reg']} spill_bytes={r['spill_bytes']} STL/LDL={r['local_mem']} "
                  f"HGMMA={r['hgmma']} EX2 under PV={r['ex2_under_pv']} (softmax {r['softmax_ex2']}) "
                  f"setmaxnreg={r['setmaxnreg']}{flag}")
            rows.append(r)
    return rows, bad


def compile_attn_bwd(kernel: str, head_dim: int, causal: bool, dtype: str = "bf16", cfg=None,
                     dump: str | None = None, sass_out: bool = False) -> dict:
    """Compile one kernel of the Gluon backward (``kernel`` "dkdv" or "dq",
    triton/attention/flash_attn_bwd_gluon.py) for sm_90; same report as :func:`compile_attn`."""
    from triton.experimental.gluon import language as gl

    from primus_turbo.triton.attention import flash_attn_bwd_gluon as fb

    cfg = cfg or fb.default_attn_bwd_config(head_dim)
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]

    def box(rows):
        layout = gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], gdt)
        return f"tensordesc<{dtype}[1, {rows}, 1, {head_dim}],{layout!r}>"

    def row_box(n):
        return f"tensordesc<fp32[{n}],{gl.NVMMASharedLayout.get_default_for([n], gl.float32)!r}>"

    if kernel == "dkdv":
        fn, stages = fb._attn_bwd_dkdv_ws_kernel, cfg.stages
        sig = {"q_desc": box(cfg.block_m), "k_desc": box(fb.HALF), "v_desc": box(fb.HALF), "do_desc": box(cfg.block_m),
               "dk_desc": box(fb.HALF), "dv_desc": box(fb.HALF), "lse_desc": row_box(cfg.block_m),
               "delta_desc": row_box(cfg.block_m), "H": "i32", "GROUP": "i32", "SEQ_Q": "i32", "SEQ_PAD": "i32",
               "diag": "i32", "qk_scale": "fp32", "sm_scale": "fp32"}
    elif kernel == "dq":
        fn, stages = fb._attn_bwd_dq_ws_kernel, cfg.dq_stages
        sig = {"q_desc": box(fb.HALF), "k_desc": box(cfg.dq_block_n), "v_desc": box(cfg.dq_block_n),
               "do_desc": box(fb.HALF), "dq_desc": box(fb.HALF), "LSE2": "*fp32", "DELTA": "*fp32", "H": "i32",
               "GROUP": "i32", "SEQ_PAD": "i32", "SEQ_K": "i32", "diag": "i32", "qk_scale": "fp32",
               "sm_scale": "fp32"}
    else:
        raise ValueError(f"kernel must be 'dkdv' or 'dq', got {kernel!r}")
    consts = dict(HAS_RIGHT=bool(causal), STAGES=stages, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs)
    name = f"attn_bwd_{kernel}_d{head_dim}_{'causal' if causal else 'full'}_{dtype}_{cfg.short()}"
    return compile_sm90(fn, sig, consts, name, "HGMMA", None, dump, sass_out)


def compile_bwd_variants() -> list:
    """Every shipped backward kernel: dK/dV and dQ x head dim 64/128 x causal or not x bf16/fp16
    (a sink changes nothing in the kernels: dsink is a torch reduction)."""
    return [(kern, d, c, dt) for kern in ("dkdv", "dq") for d in (64, 128) for c in (False, True)
            for dt in ("bf16", "fp16")]


def compile_bwd_report(dump: str | None = None, sass_out: bool = False) -> tuple[list, int]:
    rows, bad = [], 0
    for kern, d, c, dt in compile_bwd_variants():
        r = compile_row(rows, f"attn bwd {kern} d{d} causal={c} {dt}", f"attn_bwd_{kern}_d{d}_{c}_{dt}",
                        lambda: compile_attn_bwd(kern, d, c, dt, dump=dump, sass_out=sass_out))
        if r is None:
            bad += 1
            continue
        flag = mma_flags(r)
        bad += bool(flag)
        print(f"{'ok  ' if not flag else 'BAD '} {r['variant']}: smem={r['shared']} launch maxnreg={r['regs']} "
              f"registers used={r['max_reg']} spill_bytes={r['spill_bytes']} STL/LDL={r['local_mem']} "
              f"HGMMA={r['hgmma']} setmaxnreg={r['setmaxnreg']}{flag}")
        rows.append(r)
    return rows, bad


# ---------------------------------------------------------------------------------------------
# GPU: one correctness variant (run in a child process)
# ---------------------------------------------------------------------------------------------
def _make(B, Sq, Sk, Hq, Hk, D, dtype, layout, device=None):
    import torch

    device = device or DEVICE

    def one(S, H):
        if layout == "sbhd":
            return torch.randn(S, B, H, D, device=device, dtype=dtype).transpose(0, 1)
        if layout == "bhsd":
            return torch.randn(B, H, S, D, device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(B, S, H, D, device=device, dtype=dtype)

    return one(Sq, Hq), one(Sk, Hk), one(Sk, Hk)


def _snr_finite(ref, out) -> float:
    """SNR in dB over the entries finite in ref (both must agree on which are not)."""
    import torch

    from primus_turbo.testing import snr_db

    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(out)) or not torch.equal(ref[~fin], out[~fin]):
        return float("-inf")
    if not fin.any():
        return float("inf")
    return snr_db(ref[fin].double().cpu(), out[fin].double().cpu())


def run_variant(spec) -> dict:
    import torch

    import primus_turbo.pytorch as turbo
    from primus_turbo.testing import attention_ref
    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa
    from primus_turbo.triton.attention.flash_attn_fwd import flash_attn_fwd_triton

    name, B, Sq, Sk, Hq, Hk, D, causal, dt, sink, layout = spec[:11]
    cfg = fa.GluonAttnConfig.parse(spec[11]) if len(spec) > 11 else None  # a non-default tile config
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    torch.manual_seed(0)
    q, k, v = _make(B, Sq, Sk, Hq, Hk, D, dtype, layout)
    s = torch.randn(Hq, device=DEVICE, dtype=torch.float32) if sink else None
    scale = D ** -0.5
    wr = 0 if causal else -1
    reason = fa.gluon_attn_fwd_reason(q, k, v, s, scale, -1, wr)
    if reason is not None:
        return dict(name=name, ok=False, error=f"refused: {reason}")
    out = torch.full((B, Sq, Hq, D), float("nan"), device=DEVICE, dtype=dtype)
    lse = torch.full((B, Hq, Sq), float("nan"), device=DEVICE, dtype=torch.float32)
    t0 = time.time()
    out, lse = fa.flash_attn_fwd_gluon(q, k, v, s, scale, -1, wr, config=cfg, out=out, lse=lse)
    torch.cuda.synchronize()
    first_s = time.time() - t0
    tl_out, tl_lse = flash_attn_fwd_triton(q, k, v, s, scale, -1, wr)
    # fp32 reference on at most 4 query heads (the long cases would not fit a [B, H, S, S] fp32 score tensor)
    hr = min(Hq, 4 if Sq * Sk <= 2 ** 22 else 1)
    g = Hq // Hk
    kr, vr = k[:, :, : -(-hr // g)], v[:, :, : -(-hr // g)]
    sr = s[:hr] if s is not None else None
    ref_out, ref_lse = attention_ref(q[:, :, :hr], kr, vr, causal=causal, sink=sr, softmax_scale=scale,
                                     return_lse=True, compute_dtype=torch.float32)
    res = dict(name=name, first_call_s=round(first_s, 2),
               nan_out=bool(torch.isnan(out).any()), nan_lse=bool(torch.isnan(lse).any()),
               snr_out_ref=_snr_finite(ref_out.float(), out[:, :, :hr].float()),
               snr_lse_ref=_snr_finite(ref_lse.float(), lse[:, :hr]),
               snr_out_tl=_snr_finite(tl_out.float(), out.float()),
               snr_lse_tl=_snr_finite(tl_lse, lse))
    ok = not res["nan_out"] and not res["nan_lse"] and all(
        res[key] >= MIN_SNR for key in ("snr_out_ref", "snr_lse_ref", "snr_out_tl", "snr_lse_tl"))
    # the tl backward on this forward's O and LSE, through the op (TRITON backend pinned)
    if cfg is None and Sq * Sk <= 2 ** 22 and not (causal and Sq > Sk):
        from primus_turbo.pytorch.core.backend import GlobalBackendManager

        grads = {}
        dout = torch.randn(B, Sq, Hq, D, device=DEVICE, dtype=dtype)
        for flag in ("0", "1"):
            os.environ[fa.GLUON_ATTN_ENV] = flag
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            ss = s.detach().clone().requires_grad_() if s is not None else None
            GlobalBackendManager.set_attn_backend("TRITON")
            try:
                o = turbo.ops.flash_attn_func(qq, kk, vv, softmax_scale=scale, causal=causal, sink=ss,
                                              deterministic=True)
                o.backward(dout)
            finally:
                GlobalBackendManager.set_attn_backend(None)
            grads[flag] = [t.grad for t in (qq, kk, vv, ss) if t is not None]
        os.environ.pop(fa.GLUON_ATTN_ENV, None)
        res["snr_grads_vs_tl_fwd"] = [round(_snr_finite(a.float(), b.float()), 1) for a, b in zip(grads["0"], grads["1"])]
        ok = ok and all(x >= MIN_SNR for x in res["snr_grads_vs_tl_fwd"])
    res["ok"] = bool(ok)
    return {key: (round(val, 2) if isinstance(val, float) and math.isfinite(val) else val) for key, val in res.items()}


def run_bwd_variant(spec) -> dict:
    """One backward correctness variant (child process): see the module docstring."""
    import torch

    from primus_turbo.testing import attention_ref
    from primus_turbo.triton.attention import flash_attn_bwd_gluon as fb
    from primus_turbo.triton.attention.flash_attn_bwd import flash_attn_bwd_triton
    from primus_turbo.triton.attention.flash_attn_fwd import flash_attn_fwd_triton

    name, B, Sq, Sk, Hq, Hk, D, causal, dt, sink, layout = spec[:11]
    cfg = fb.GluonAttnBwdConfig.parse(spec[11]) if len(spec) > 11 else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    torch.manual_seed(0)
    q, k, v = _make(B, Sq, Sk, Hq, Hk, D, dtype, layout)
    s = torch.randn(Hq, device=DEVICE, dtype=torch.float32) if sink else None
    scale = D ** -0.5
    wr = 0 if causal else -1
    out, lse = flash_attn_fwd_triton(q, k, v, s, scale, -1, wr)
    dout = torch.randn_like(out)
    reason = fb.gluon_attn_bwd_reason(q, k, v, dout, s, scale, -1, wr)
    if reason is not None:
        return dict(name=name, ok=False, error=f"refused: {reason}")
    tl = flash_attn_bwd_triton(dout, q, k, v, out, lse, s, scale, -1, wr)
    ref = None
    if B * Hq * Sq * Sk <= 2 ** 25:  # fp32 autograd through the reference: [B, H, Sq, Sk] scores
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        sr = s.detach().clone().requires_grad_() if s is not None else None
        o = attention_ref(*leaves, causal=causal, sink=sr, softmax_scale=scale, compute_dtype=torch.float32)
        o.backward(dout.float())
        ref = [t.grad for t in leaves] + ([sr.grad] if sr is not None else [])
    res, ok = dict(name=name), True
    for gluon_dq in (True, False):
        tag = "gdq" if gluon_dq else "tldq"
        poison = [torch.full(t.shape, float("nan"), device=DEVICE, dtype=dtype) for t in (q, k, v)]
        t0 = time.time()
        got = fb.flash_attn_bwd_gluon(dout, q, k, v, out, lse, s, scale, -1, wr, config=cfg, gluon_dq=gluon_dq,
                                      dq=poison[0], dk=poison[1], dv=poison[2])
        torch.cuda.synchronize()
        res[f"first_call_s_{tag}"] = round(time.time() - t0, 2)
        names = ("dq", "dk", "dv", "dsink")[:len(got) if s is not None else 3]
        res[f"nan_{tag}"] = [n for n, g in zip(names, got) if not torch.isfinite(g).all()]
        res[f"snr_tl_{tag}"] = [round(_snr_finite(t.float(), g.float()), 1) for t, g in zip(tl, got) if g is not None]
        ok = ok and not res[f"nan_{tag}"] and all(x >= MIN_SNR for x in res[f"snr_tl_{tag}"])
        if ref is not None:
            res[f"snr_ref_{tag}"] = [round(_snr_finite(r, g.float()), 1) for r, g in zip(ref, got) if g is not None]
            ok = ok and all(x >= MIN_SNR for x in res[f"snr_ref_{tag}"])
        again = fb.flash_attn_bwd_gluon(dout, q, k, v, out, lse, s, scale, -1, wr, config=cfg, gluon_dq=gluon_dq)
        res[f"bitwise_{tag}"] = all(torch.equal(a, b) for a, b in zip(got[:3], again[:3]))
        ok = ok and res[f"bitwise_{tag}"]
    res["ok"] = bool(ok)
    return res


def run_child(script: Path, flag: str, spec, timeout: int) -> dict:
    """Run ``script flag <spec as JSON>`` in a child process (so a hang or a fault costs that
    variant only) and return the dict it prints on its ``RESULT`` line, or a failed row with the
    timeout or the child's output tail."""
    cmd = [sys.executable, str(script), flag, json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=_ROOT)
    except subprocess.TimeoutExpired:
        return dict(name=spec[0], ok=False, error=f"timed out after {timeout} s (hang?)")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
    return dict(name=spec[0], ok=False, error=f"exit {proc.returncode}: " + " | ".join(tail)[-3000:])


def _run_child(spec, timeout: int, bwd: bool = False) -> dict:
    return run_child(Path(__file__).resolve(), "--child-bwd" if bwd else "--child", spec, timeout)


def check_variants(variants, args, run, parse_config) -> tuple[list, set]:
    """The correctness pass of every check: each of ``variants`` (those ``--only`` keeps) through
    ``run(spec)`` (a child process), then each ``--configs`` config (``parse_config(text)``) on the
    bf16 variants whose head dim (``spec[6]``) it fits, named ``<variant>:<config>``. Prints a line
    per check; returns the result rows and the names that passed."""
    checks, passed = [], set()
    if getattr(args, "no_check", False):  # timing only: the kernels were checked elsewhere (pytest)
        names = {spec[0] for spec in variants}
        passed = names | {f"{n}:{t}" for n in names for t in args.configs}
        print("  skipped (--no-check): every variant and config is timed")
        return checks, passed
    for spec in variants:
        if args.only and not any(o in spec[0] for o in args.only):
            continue
        r = run(spec)
        checks.append(r)
        if r.get("ok"):
            passed.add(r["name"])
        detail = r.get("error") or " ".join(f"{k}={v}" for k, v in r.items() if k not in ("name", "ok"))
        print(f"  {'ok  ' if r.get('ok') else 'FAIL'} {r['name']}: {detail}", flush=True)
    for text in args.configs:  # each extra config: its own children on the bf16 variants it fits
        cfg = parse_config(text)
        for spec in variants:
            if not spec[0].endswith("_bf16") or cfg.check(spec[6]) is not None:
                continue
            r = run(list(spec) + [text])
            r["name"] = f"{spec[0]}:{text}"
            checks.append(r)
            if r.get("ok"):
                passed.add(r["name"])
            print(f"  {'ok  ' if r.get('ok') else 'FAIL'} {r['name']}: {r.get('error') or ''}", flush=True)
    return checks, passed


# ---------------------------------------------------------------------------------------------
# GPU: timing
# ---------------------------------------------------------------------------------------------
def _median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _flops(B, S, H, D, causal) -> float:
    pairs = S * (S + 1) / 2 if causal else S * S
    return 4.0 * B * H * pairs * D


def _graph_ms(fn, calls: int = 8, reps: int = 5) -> float:
    """Device time of one call of ``fn``: ``calls`` calls captured in one CUDA graph, the replay
    timed ``reps`` times (median, divided by ``calls``). No host time and no launch gaps inside the
    timed window, so configs of the same kernel compare on device time alone."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    times.sort()
    return times[len(times) // 2]


#: defaults of :func:`time_impls` set from the command line (``--graph``, ``--rounds``)
TIMING = {"graph": False, "rounds": 3}


def time_impls(row: dict, impls: dict, flops: float, rounds: Optional[int] = None, graph: Optional[bool] = None) -> str:
    """Median time and TFLOP/s of each of ``impls`` (name -> callable; None: a peer that could not
    be set up at this shape) into ``row``; returns the printed TFLOP/s cells. ``rounds`` interleaved
    rounds, the order rotated each round (and reversed every other one), each impl's time the median
    of its round medians: the clocks move under sustained load (power limit), so one pass in a fixed
    order favours whichever runs first. ``graph``: each measurement is :func:`_graph_ms` (device
    time) instead of :func:`_median_ms` (events around each eager call, host time included).
    ``rounds`` / ``graph`` default to :data:`TIMING`."""
    graph = TIMING["graph"] if graph is None else graph
    rounds = TIMING["rounds"] if rounds is None else rounds
    measure = _graph_ms if graph else _median_ms
    row["timing"] = "graph" if graph else "events"
    names = [n for n, fn in impls.items() if fn is not None]
    for name, fn in impls.items():
        if fn is None:
            row[name] = dict(error="cannot run")
    per = {n: [] for n in names}
    for r in range(max(1, rounds)):
        # rotated each round, and reversed every other round: a rotation alone keeps each
        # implementation's neighbours, and what ran just before shows at the 3-6% level (session 28)
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        if r % 2:
            order.reverse()
        for name in order:
            if name not in per:
                continue
            try:
                per[name].append(measure(impls[name]))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run this shape
                row[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                del per[name]
    for name, times in per.items():
        ms = sorted(times)[len(times) // 2]
        row[name] = dict(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1), round_ms=[round(t, 4) for t in times])
    return "  ".join(f"{n}={row[n]['tflops']:6.1f}" if "tflops" in row[n] else f"{n}=  err" for n in impls)


def geomean_speedup(rows, a: str, b: str):
    """Geometric mean over ``rows`` of time(b) / time(a), the speedup of a over b (None when no row
    timed both)."""
    r = [row[b]["ms"] / row[a]["ms"] for row in rows if "ms" in row.get(a, {}) and "ms" in row.get(b, {})]
    return round(math.exp(sum(math.log(x) for x in r) / len(r)), 3) if r else None


def write_result(out: str | None, filename: str, result: dict) -> None:
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / filename).write_text(json.dumps(result, indent=1))
        print(f"wrote {out / filename}")


def time_shapes(seqs, head_dims, heads_q, heads_kv, passed: set, configs=()) -> list:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa
    from primus_turbo.triton.attention.flash_attn_fwd import flash_attn_fwd_triton

    rows = []
    for D in head_dims:
        for causal in (False, True):
            gluon_ok = f"d{D}_{'causal' if causal else 'full'}_bf16" in passed
            for S in seqs:
                B = max(1, TOKENS // S)
                q, k, v = _make(B, S, S, heads_q, heads_kv, D, torch.bfloat16, "bshd")
                scale, wr = D ** -0.5, (0 if causal else -1)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                gqa = heads_q != heads_kv
                impls = {"tl": lambda: flash_attn_fwd_triton(q, k, v, None, scale, -1, wr)}
                if gluon_ok:
                    impls["gluon"] = lambda: fa.flash_attn_fwd_gluon(q, k, v, None, scale, -1, wr)
                for text in configs:  # the --configs sweep: the ones that passed their own checks
                    cfg = fa.GluonAttnConfig.parse(text)
                    if f"d{D}_{'causal' if causal else 'full'}_bf16:{text}" in passed:
                        impls[f"gluon:{text}"] = lambda cfg=cfg: fa.flash_attn_fwd_gluon(q, k, v, None, scale, -1, wr,
                                                                                        config=cfg)
                for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    def sdpa(be=be):
                        with sdpa_kernel([be]):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                                                  enable_gqa=gqa)
                    impls[name] = sdpa
                row = dict(D=D, causal=causal, B=B, S=S, Hq=heads_q, Hk=heads_kv)
                cells = time_impls(row, impls, _flops(B, S, heads_q, D, causal))
                rows.append(row)
                impls.clear()  # the closures hold this shape's tensors
                print(f"  D={D:3d} {'causal' if causal else 'full  '} B={B:2d} S={S:5d}  TFLOP/s  {cells}", flush=True)
    return rows


def time_bwd_shapes(seqs, head_dims, heads_q, heads_kv, passed: set, configs=()) -> list:
    """Backward timing at the forward's shapes: Gluon (Gluon dQ, tl dQ, each --configs config) vs
    the tl backward vs SDPA flash / cuDNN (``autograd.grad`` of their forward, so their own
    preprocess included, as ours includes delta)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from primus_turbo.triton.attention import flash_attn_bwd_gluon as fb
    from primus_turbo.triton.attention.flash_attn_bwd import flash_attn_bwd_triton
    from primus_turbo.triton.attention.flash_attn_fwd import flash_attn_fwd_triton

    rows = []
    for D in head_dims:
        for causal in (False, True):
            gluon_ok = f"d{D}_{'causal' if causal else 'full'}_bf16" in passed
            for S in seqs:
                B = max(1, TOKENS // S)
                q, k, v = _make(B, S, S, heads_q, heads_kv, D, torch.bfloat16, "bshd")
                scale, wr = D ** -0.5, (0 if causal else -1)
                out, lse = flash_attn_fwd_triton(q, k, v, None, scale, -1, wr)
                dout = torch.randn_like(out)
                impls = {"tl": lambda: flash_attn_bwd_triton(dout, q, k, v, out, lse, None, scale, -1, wr)}
                if gluon_ok:
                    impls["gluon"] = lambda: fb.flash_attn_bwd_gluon(dout, q, k, v, out, lse, None, scale, -1, wr,
                                                                     gluon_dq=True)
                    impls["gluon_tldq"] = lambda: fb.flash_attn_bwd_gluon(dout, q, k, v, out, lse, None, scale, -1,
                                                                          wr, gluon_dq=False)
                    for text in configs:
                        cfg = fb.GluonAttnBwdConfig.parse(text)
                        if cfg.check(D) is None:
                            impls[f"gluon:{text}"] = lambda cfg=cfg: fb.flash_attn_bwd_gluon(
                                dout, q, k, v, out, lse, None, scale, -1, wr, config=cfg, gluon_dq=True)
                qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                gqa = heads_q != heads_kv
                for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel([be]):
                            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                                               enable_gqa=gqa)
                    except Exception as exc:  # noqa: BLE001 - a peer that cannot run this shape
                        impls[name] = None
                        print(f"    {name}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    do_t = dout.transpose(1, 2)
                    impls[name] = lambda o=o, do_t=do_t: torch.autograd.grad(o, (qt, kt, vt), do_t, retain_graph=True)
                row = dict(D=D, causal=causal, B=B, S=S, Hq=heads_q, Hk=heads_kv)
                cells = time_impls(row, impls, 2.5 * _flops(B, S, heads_q, D, causal))
                rows.append(row)
                impls.clear()
                print(f"  bwd D={D:3d} {'causal' if causal else 'full  '} B={B:2d} S={S:5d}  TFLOP/s  {cells}",
                      flush=True)
    return rows


def _bwd_geomeans(rows) -> dict:
    out = {}
    for a in ("gluon", "gluon_tldq", "tl"):
        for b in ("sdpa_flash", "sdpa_cudnn", "tl"):
            r = geomean_speedup(rows, a, b) if a != b else None
            if r is not None:
                out[f"{a}_over_{b}"] = r
    return out


def _geomeans(rows) -> dict:
    # speedup of the first over the second (time ratio second / first)
    out = {}
    for a, b in (("gluon", "sdpa_flash"), ("tl", "sdpa_flash"), ("gluon", "tl"), ("gluon", "sdpa_cudnn"),
                 ("tl", "sdpa_cudnn")):
        r = geomean_speedup(rows, a, b)
        if r is not None:
            out[f"{a}_over_{b}"] = r
    return out


def _env_info() -> dict:
    import torch
    import triton

    info = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def check_and_time(args, result, variants, run, parse_config, time_fn, geomeans_fn, json_name: str,
                   what: str = "", timing_note: str = "bf16, bshd") -> int:
    """The driver of every mode (forward, backward, FP8 forward): the correctness pass in child
    processes (``check_variants``), then, unless ``--no-timing``, ``time_fn(seqs, head_dims, heads,
    heads_kv, passed, configs)`` on what passed and ``geomeans_fn`` of its rows; writes
    ``json_name``. Exit status 1 if any correctness check failed."""
    print(f"{what}correctness (each variant in a child process):")
    checks, passed = check_variants(variants, args, run, parse_config)
    result["correctness"] = checks
    if not args.no_timing:
        seqs = args.seq or ([4096] if args.quick else list(SEQS))
        print(f"{what}timing ({timing_note}, {args.heads}/{args.heads_kv} heads, {TOKENS} tokens per case):")
        rows = time_fn(seqs, args.head_dims, args.heads, args.heads_kv, passed, args.configs)
        result["timing"] = rows
        result["geomean_speedup"] = geomeans_fn(rows)
        print("geomean speedups:", result["geomean_speedup"])
    write_result(args.out, json_name, result)
    return 0 if all(r.get("ok") for r in checks) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for gluon_attn.json")
    p.add_argument("--quick", action="store_true", help="timing at seq 4096 only")
    p.add_argument("--seq", type=int, nargs="*", default=None)
    p.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=32)
    p.add_argument("--only", nargs="*", default=None, help="correctness variants whose name contains one of these")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--no-check", action="store_true",
                   help="skip the correctness children (timing only, of kernels checked elsewhere, e.g. by pytest)")
    p.add_argument("--configs", nargs="*", default=[],
                   help="extra Gluon tile configs to check and time, e.g. n128s3 n64s4 n128s2r232w40 n128s2o n64s3po "
                        "(p: ping-pong, o: softmax kept under the PV MMA); with --compile-only: compile these instead")
    p.add_argument("--compile-only", action="store_true", help="sm_90 compile report only (no GPU needed)")
    p.add_argument("--dump", default=None, help="with --compile-only: write ttgir/ptx/cubin (and --sass) here")
    p.add_argument("--sass", action="store_true")
    p.add_argument("--timeout", type=int, default=CHILD_TIMEOUT_S)
    p.add_argument("--bwd", action="store_true", help="the Gluon backward (flash_attn_bwd_gluon.py) instead")
    p.add_argument("--fp8", action="store_true",
                   help="the Gluon FP8 forward (flash_attn_fp8_fwd_gluon.py) instead; scripts/check_gluon_attn_fp8.py")
    p.add_argument("--graph", action="store_true",
                   help="time device time alone (CUDA-graph replay of 8 calls) instead of events around each call")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (order rotated each round)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-bwd", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    TIMING.update(graph=args.graph, rounds=args.rounds)

    if args.child is not None or args.child_bwd is not None:
        res = run_variant(json.loads(args.child)) if args.child else run_bwd_variant(json.loads(args.child_bwd))
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if args.fp8:  # its own module: this file holds the bf16 forward and backward checks
        return load_script("check_gluon_attn_fp8").main(args)
    if args.compile_only:
        if args.bwd:
            _, bad = compile_bwd_report(args.dump, args.sass)
        else:
            _, bad = compile_report(args.dump, args.sass, args.configs)
        return 1 if bad else 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: run with --compile-only on a CPU machine")
        return 1
    result = dict(env=_env_info(), min_snr_db=MIN_SNR)
    print(f"{result['env']}")
    if args.bwd:
        from primus_turbo.triton.attention import flash_attn_bwd_gluon as fb

        return check_and_time(args, result, VARIANTS, lambda spec: _run_child(spec, args.timeout, bwd=True),
                              fb.GluonAttnBwdConfig.parse, time_bwd_shapes, _bwd_geomeans, "gluon_attn_bwd.json",
                              what="backward ")
    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa

    return check_and_time(args, result, VARIANTS, lambda spec: _run_child(spec, args.timeout),
                          fa.GluonAttnConfig.parse, time_shapes, _geomeans, "gluon_attn.json")


if __name__ == "__main__":
    raise SystemExit(main())
