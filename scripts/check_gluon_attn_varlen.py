"""Check and time the Gluon varlen (packed THD) attention forward (``flash_attn_varlen_fwd_gluon`` in
triton/attention/flash_attn_fwd_gluon.py) against the tl varlen forward and an fp32 reference.

On an sm_90 GPU (project not installed, PYTHONPATH=. is enough):

    PYTHONPATH=. python scripts/check_gluon_attn_varlen.py [--out DIR]        # correctness, then timing
    PYTHONPATH=. python scripts/check_gluon_attn_varlen.py --no-timing        # correctness only
    PYTHONPATH=. python scripts/check_gluon_attn_varlen.py --no-check         # timing only
    PYTHONPATH=. python scripts/check_gluon_attn_varlen.py --configs n128s2p  # + time a tile config
    PYTHONPATH=. python scripts/check_gluon_attn_varlen.py --compile-only [--dump DIR --sass]  # CPU: sm_90 compile

1. Correctness: each case runs in a child process with a timeout (a hang or a fault costs that case
   only). The packs are the four document patterns ``[512]*4``, ``[128, 256, 512, 1024]``,
   ``[57, 311, 800, 173]``, ``[2048, 64, 64, 64]`` and 8 x 2048, causal and full, at heads 32/8 head
   dim 128 and 8/8 head dim 64, plus a sink, a right window, key lengths != query lengths (empty
   causal rows), an empty document, trailing rows no document owns (must come back O = 0,
   LSE = +inf, untouched by the last document's partial tile), fp16, and packs whose k / v rows past
   ``cu_seqlens_k[-1]`` hold NaN and +Inf (``nan_tail``: the output must equal, bitwise, the
   output with those rows finite, and have no NaN: the kernel loads a document's last key block
   shifted back so it never reads them), one of them with documents shorter than the key block. O
   and LSE are poisoned (NaN) before the call and compared per document with an fp32 reference
   (>= 40 dB) and with the tl varlen forward (>= 40 dB); +inf LSE entries must match exactly; each document run alone
   (its own one-document pack) must give its rows of the packed run bitwise; the tl varlen
   backward on the Gluon forward's O and LSE (``flash_attn_varlen_func``, TRITON backend,
   ``PRIMUS_TURBO_ATTN_VARLEN_GLUON`` 0 vs 1) must give the gradients it gives on the tl forward's.
2. Timing (bf16, ``--heads``/``--heads-kv``/``--head-dim``, default Llama-3.1-8B 32/8/128):
   16384-token packs of 8 x 2048 and of each pattern repeated to 16384 tokens, causal and full:
   tl varlen vs Gluon varlen vs a per-document SDPA cuDNN loop (host-side lengths: a
   reference, not a drop-in) and, for the uniform pack, the dense Gluon forward on the [8, 2048]
   view; median of CUDA-event timings, TFLOP/s counted per document. Prints a table and
   the Gluon / tl geomean; writes DIR/gluon_attn_varlen.json.

Exit status 1 if any correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# the dense check's script loader and finite-entry SNR (ref's non-finite entries must match exactly)
from scripts.check_gluon_attn import _snr_finite as snr_finite  # noqa: E402
from scripts.check_gluon_attn import load_script as _load_script  # noqa: E402

MIN_SNR = 40.0
TOKENS = 16384
CHILD_TIMEOUT_S = 300
DEVICE = "cuda"  # the tests' CPU dry run of check_case swaps in "cpu" (and the tl kernel for the Gluon one)
PATTERNS = {"eq512": [512] * 4, "pow2": [128, 256, 512, 1024], "odd": [57, 311, 800, 173],
            "long-first": [2048, 64, 64, 64]}
UNIFORM = [2048] * 8
# (name, lens_q, lens_k (None: = lens_q), Hq, Hk, D, causal, dtype, sink, win_right, extra rows past cu[-1]
#  [, config (None: the default), nan_tail (k / v rows past cu_seqlens_k[-1] NaN / +Inf)])
CASES = [
    (f"{pname}_h{hq}x{hk}_d{d}_{'causal' if c else 'full'}", lens, None, hq, hk, d, c, "bf16", False, -1, 0)
    for pname, lens in list(PATTERNS.items()) + [("uniform2048", UNIFORM)]
    for hq, hk, d in ((32, 8, 128), (8, 8, 64)) for c in (False, True)
] + [
    ("odd_h8x2_d128_causal_sink", [57, 311, 800, 173], None, 8, 2, 128, True, "bf16", True, -1, 0),
    ("odd_h8x8_d64_full_sink_fp16", [57, 311, 800, 173], None, 8, 8, 64, False, "fp16", True, -1, 0),
    ("pow2_h8x2_d128_right100", [128, 256, 512, 1024], None, 8, 2, 128, False, "bf16", False, 100, 0),
    ("cross_h8x2_d128_causal", [300, 1100, 65, 700], [1100, 300, 129, 700], 8, 2, 128, True, "bf16", False, -1, 0),
    ("cross_h4x4_d64_full", [300, 1100, 65], [1100, 300, 129], 4, 4, 64, False, "bf16", False, -1, 0),
    ("empty_doc_h8x2_d128_causal", [200, 0, 333, 1], None, 8, 2, 128, True, "bf16", False, -1, 0),
    ("trailing_rows_h8x2_d128_causal", [100, 250], None, 8, 2, 128, True, "bf16", False, -1, 77),
    ("trailing_rows_h8x8_d64_full", [130, 63], None, 8, 8, 64, False, "fp16", False, -1, 200),
    ("nan_tail_odd_h32x8_d128_causal", [57, 311, 800, 173], None, 32, 8, 128, True, "bf16", False, -1, 200, None,
     True),
    ("nan_tail_short_h8x8_d64_full", [5, 70, 130, 1, 300], None, 8, 8, 64, False, "bf16", False, -1, 100, None, True),
]


# ---------------------------------------------------------------------------------------------
# sm_90 compile (CPU is enough)
# ---------------------------------------------------------------------------------------------
def compile_attn_varlen(head_dim: int, causal: bool, dtype: str = "bf16", sink: bool = False, cfg=None,
                        dump: str | None = None, sass_out: bool = False) -> dict:
    """Compile the varlen kernel (``_attn_fwd_varlen_ws_kernel``) for sm_90; the report of
    check_gluon_attn.compile_sm90 (registers, spills, HGMMA / STL / LDL counts, serialized wgmma,
    shared memory). Argument attributes as the launcher's real ones specialize them (16-byte
    aligned pointers, strides divisible by 16), so the masked O stores of partial tiles vectorize."""
    from triton.experimental.gluon import language as gl

    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa

    cga = _load_script("check_gluon_attn")
    cfg = cfg or fa.default_attn_config(head_dim, causal, varlen=True)
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([1, fa.HALF_M, 1, head_dim], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([1, cfg.block_n, 1, head_dim], gdt)
    q_ty = f"tensordesc<{dtype}[1, {fa.HALF_M}, 1, {head_dim}],{q_layout!r}>"
    kv_ty = f"tensordesc<{dtype}[1, {cfg.block_n}, 1, {head_dim}],{kv_layout!r}>"
    sig = {"q_desc": q_ty, "k_desc": kv_ty, "v_desc": kv_ty, "o_desc": q_ty, "O": f"*{dtype}", "LSE": "*fp32",
           "SINK": "*fp32", "CU_Q": "*i32", "CU_K": "*i32", "H": "i32", "GROUP": "i32", "stride_os": "i32",
           "stride_oh": "i32", "stride_lh": "i32", "win_right": "i32", "qk_scale": "fp32"}
    consts = dict(HAS_RIGHT=bool(causal), HAS_SINK=bool(sink), STAGES=cfg.stages, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs, PINGPONG=cfg.pingpong, OVERLAP=cfg.overlap,
                  NUM_WG=cfg.consumers, EMU=cfg.emu, EMU_DEG=cfg.emu_deg, LAZY=cfg.lazy, SKIP=cfg.skip,
                  HEADS_FASTEST=cfg.heads_fastest)
    name = f"attn_varlen_d{head_dim}_{'causal' if causal else 'full'}_{dtype}{'_sink' if sink else ''}_{cfg.short()}"
    fn = fa._attn_fwd_varlen_ws_kernel
    aligned = ("O", "LSE", "SINK", "CU_Q", "CU_K", "stride_os", "stride_oh", "stride_lh")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return cga.compile_sm90(fn, sig, consts, name, "HGMMA", None, dump, sass_out, attrs=attrs)


def compile_variants() -> list:
    """head dim 64/128 x causal x bf16/fp16, plus the sink path (GQA is a runtime argument)."""
    return [(d, c, dt, False) for d in (64, 128) for c in (False, True) for dt in ("bf16", "fp16")] + [
        (128, True, "bf16", True), (64, False, "fp16", True)]


def compile_report(dump: str | None = None, sass_out: bool = False, configs=()) -> tuple[list, int]:
    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa

    cga = _load_script("check_gluon_attn")
    cfgs = [fa.GluonAttnConfig.parse(t) for t in configs] or [None]
    rows, bad = [], 0
    for cfg in cfgs:
        for d, c, dt, sk in compile_variants():
            if cfg is not None and cfg.check(d) is not None:
                continue
            r = cga.compile_row(rows, f"attn varlen d{d} causal={c} {dt} sink={sk}", f"attn_varlen_d{d}_{c}_{dt}_{sk}",
                                lambda: compile_attn_varlen(d, c, dt, sk, cfg=cfg, dump=dump, sass_out=sass_out))
            if r is None:
                bad += 1
                continue
            flag = cga.mma_flags(r) + ("  SMEM" if r["shared"] > fa.SMEM_LIMIT else "")
            bad += bool(flag)
            print(f"{'FAIL' if flag else 'ok  '} {r['variant']}: smem={r['shared']} launch maxnreg={r['regs']} "
                  f"registers used={r['max_reg']} spill_bytes={r['spill_bytes']} STL/LDL={r['local_mem']} "
                  f"HGMMA={r['hgmma']} setmaxnreg={r['setmaxnreg']}{flag}")
            rows.append(r)
    return rows, bad


# ---------------------------------------------------------------------------------------------
# Inputs and the fp32 reference (shared with tests/triton/test_flash_attn_varlen_gluon.py)
# ---------------------------------------------------------------------------------------------
def cu_seqlens(lens, device):
    import torch

    cu = [0]
    for n in lens:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def poison_tail(k, v, n_k: int) -> None:
    """k / v rows from ``n_k`` (``cu_seqlens_k[-1]``) on, in place: the first half NaN, the rest +Inf."""
    half = n_k + (k.size(0) - n_k + 1) // 2
    for t in (k, v):
        t[n_k:half] = float("nan")
        t[half:] = float("inf")


def make_pack(lens_q, lens_k, Hq, Hk, D, dtype, device, extra_rows: int = 0, seed: int = 0):
    """Random packed q ``[sum(lens_q) + extra_rows, Hq, D]``, k / v ``[sum(lens_k) + extra_rows, Hk, D]``
    (``extra_rows``: rows past ``cu_seqlens[-1]`` that no document owns)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    tq, tk = sum(lens_q) + extra_rows, sum(lens_k) + extra_rows

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return rnd(tq, Hq, D), rnd(tk, Hk, D), rnd(tk, Hk, D)


def reference(q, k, v, lens_q, lens_k, causal: bool, scale: float, sink=None, win_right: int = -1):
    """Per-document fp32 ``attention_ref``: (out ``[sum(lens_q), Hq, D]`` fp32, lse ``[Hq, sum(lens_q)]``)."""
    import torch

    from primus_turbo.testing import attention_ref

    outs, lses = [], []
    cq = ck = 0
    for nq, nk in zip(lens_q, lens_k):
        if nq == 0:
            cq, ck = cq + nq, ck + nk
            continue
        window = (-1, 0 if causal else win_right)
        if nk == 0:  # no key: O = 0, LSE = +inf (or the sink's logit)
            o = torch.zeros(1, nq, q.size(1), v.size(-1), device=q.device)
            lse = (sink.float().view(1, -1, 1).expand(1, -1, nq).clone() if sink is not None
                   else torch.full((1, q.size(1), nq), float("inf"), device=q.device))
        else:
            o, lse = attention_ref(q[cq:cq + nq][None], k[ck:ck + nk][None], v[ck:ck + nk][None], window_size=window,
                                   sink=sink, softmax_scale=scale, return_lse=True, compute_dtype=torch.float32)
        outs.append(o[0].float())
        lses.append(lse[0].float())
        cq, ck = cq + nq, ck + nk
    return torch.cat(outs), torch.cat(lses, dim=1)


def run_gluon(q, k, v, lens_q, lens_k, causal, scale, sink=None, win_right=-1, cfg=None, poison=True):
    """The Gluon varlen forward into NaN-poisoned O and LSE (``poison``)."""
    import torch

    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa

    cq, ck = cu_seqlens(lens_q, q.device), cu_seqlens(lens_k, q.device)
    wr = 0 if causal else win_right
    out = lse = None
    if poison:
        out = torch.full(q.shape[:2] + (v.size(-1),), float("nan"), device=q.device, dtype=q.dtype)
        lse = torch.full((q.size(1), q.size(0)), float("nan"), device=q.device)
    return fa.flash_attn_varlen_fwd_gluon(q, k, v, cq, ck, max(lens_q), max(lens_k), sink, scale, -1, wr, config=cfg,
                                          out=out, lse=lse)


def check_case(spec) -> dict:
    """One correctness case (see the module docstring); a dict with ``ok``."""
    import torch

    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa
    from primus_turbo.triton.attention.flash_attn_fwd import flash_attn_varlen_fwd_triton

    name, lens_q, lens_k, Hq, Hk, D, causal, dt, sink, win_right, extra = spec[:11]
    cfg = fa.GluonAttnConfig.parse(spec[11]) if len(spec) > 11 and spec[11] else None
    nan_tail = bool(len(spec) > 12 and spec[12])
    lens_k = lens_k or lens_q
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    q, k, v = make_pack(lens_q, lens_k, Hq, Hk, D, dtype, DEVICE, extra)
    s = torch.randn(Hq, generator=torch.Generator().manual_seed(1)).to(DEVICE) if sink else None
    scale, wr = D ** -0.5, (0 if causal else win_right)
    cq, ck = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
    reason = fa.gluon_attn_varlen_fwd_reason(q, k, v, cq, ck, max(lens_q), max(lens_k), s, scale, -1, wr)
    if reason is not None:
        return dict(name=name, ok=False, error=f"refused: {reason}")
    if nan_tail:  # the output with finite rows past cu_seqlens_k[-1], then those rows NaN / +Inf
        fin_out, fin_lse = (t.clone() for t in run_gluon(q, k, v, lens_q, lens_k, causal, scale, s, win_right, cfg))
        poison_tail(k, v, sum(lens_k))
    t0 = time.time()
    out, lse = run_gluon(q, k, v, lens_q, lens_k, causal, scale, s, win_right, cfg)
    if q.is_cuda:
        torch.cuda.synchronize()
    res = dict(name=name, first_call_s=round(time.time() - t0, 2),
               nan_out=bool(torch.isnan(out).any()), nan_lse=bool(torch.isnan(lse).any()))
    n = sum(lens_q)
    ref_out, ref_lse = reference(q, k, v, lens_q, lens_k, causal, scale, s, win_right)
    tl_out, tl_lse = flash_attn_varlen_fwd_triton(q, k, v, cq, ck, max(lens_q), max(lens_k), s, scale, -1, wr)
    res.update(snr_out_ref=snr_finite(ref_out, out[:n].float()), snr_lse_ref=snr_finite(ref_lse, lse[:, :n]),
               snr_out_tl=snr_finite(tl_out.float(), out.float()), snr_lse_tl=snr_finite(tl_lse, lse))
    ok = not res["nan_out"] and not res["nan_lse"] and all(
        res[key] >= MIN_SNR for key in ("snr_out_ref", "snr_lse_ref", "snr_out_tl", "snr_lse_tl"))
    if nan_tail:
        res["nan_tail_bitwise"] = bool(torch.equal(out, fin_out) and torch.equal(lse, fin_lse))
        ok = ok and res["nan_tail_bitwise"]
    if extra:  # rows no document owns: exactly O = 0, LSE = +inf
        res["trailing_rows_ok"] = bool((out[n:] == 0).all() and (lse[:, n:] == float("inf")).all())
        ok = ok and res["trailing_rows_ok"]
    # each document alone (a one-document pack of its own rows) gives its rows of the packed run bitwise
    alone_ok, cq_h, ck_h = True, 0, 0
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            o1, l1 = run_gluon(q[cq_h:cq_h + nq], k[ck_h:ck_h + nk], v[ck_h:ck_h + nk], [nq], [nk], causal, scale, s,
                               win_right, cfg)
            alone_ok = alone_ok and torch.equal(o1, out[cq_h:cq_h + nq]) and torch.equal(l1, lse[:, cq_h:cq_h + nq])
        cq_h, ck_h = cq_h + nq, ck_h + nk
    res["alone_bitwise"] = bool(alone_ok)
    ok = ok and alone_ok
    if cfg is None and not extra:  # the op's backward; a pack with unowned rows is the kernel's contract only
        res["snr_grads_vs_tl_fwd"] = _grads_vs_tl_forward(q, k, v, s, lens_q, lens_k, causal, scale, win_right)
        ok = ok and all(x >= MIN_SNR for x in res["snr_grads_vs_tl_fwd"])
    res["ok"] = bool(ok)
    return {key: (round(val, 2) if isinstance(val, float) and math.isfinite(val) else val) for key, val in res.items()}


def _grads_vs_tl_forward(q, k, v, s, lens_q, lens_k, causal, scale, win_right) -> list:
    """flash_attn_varlen_func on TRITON with PRIMUS_TURBO_ATTN_VARLEN_GLUON 0 and 1: SNR of O and of
    each gradient (the tl varlen backward on the Gluon forward's O and LSE vs on the tl forward's)."""
    import torch

    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa

    dout = torch.randn(q.shape[:2] + (v.size(-1),), generator=torch.Generator().manual_seed(2)).to(q)
    cq, ck = cu_seqlens(lens_q, q.device), cu_seqlens(lens_k, q.device)
    window = (-1, win_right) if not causal else (-1, -1)
    got = {}
    old = os.environ.get(fa.GLUON_ATTN_VARLEN_ENV)
    GlobalBackendManager.set_attn_backend("TRITON")
    try:
        for flag in ("0", "1"):
            os.environ[fa.GLUON_ATTN_VARLEN_ENV] = flag
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            ss = s.detach().clone().requires_grad_() if s is not None else None
            o = turbo.ops.flash_attn_varlen_func(qq, kk, vv, cq, ck, max(lens_q), max(lens_k), softmax_scale=scale,
                                                 causal=causal, window_size=window, sink=ss, deterministic=True)
            o.backward(dout)
            got[flag] = [o.detach()] + [t.grad for t in (qq, kk, vv, ss) if t is not None]
    finally:
        GlobalBackendManager.set_attn_backend(None)
        if old is None:
            os.environ.pop(fa.GLUON_ATTN_VARLEN_ENV, None)
        else:
            os.environ[fa.GLUON_ATTN_VARLEN_ENV] = old
    return [round(snr_finite(a.float(), b.float()), 1) for a, b in zip(got["0"], got["1"])]


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def tile_pattern(pattern, tokens: int = TOKENS) -> list:
    """``pattern`` repeated until the pack holds ``tokens`` tokens (the last document cut to fit)."""
    lens, total = [], 0
    while total < tokens:
        for n in pattern:
            n = min(n, tokens - total)
            if n <= 0:
                break
            lens.append(n)
            total += n
    return lens


def _flops(lens, H, D, causal) -> float:
    return sum(4.0 * H * D * (n * (n + 1) / 2 if causal else n * n) for n in lens)


def time_packs(heads_q, heads_kv, D, configs=(), gluon_ok=True, graph: bool = False, rounds: int = 3,
               packs=None, masks=("full", "causal")) -> list:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from primus_turbo.triton.attention import flash_attn_fwd_gluon as fa
    from primus_turbo.triton.attention.flash_attn_fwd import flash_attn_varlen_fwd_triton

    cga = _load_script("check_gluon_attn")
    cga.TIMING.update(graph=graph, rounds=rounds)
    rows = []
    all_packs = [("uniform2048", UNIFORM)] + [(name, tile_pattern(p)) for name, p in PATTERNS.items()]
    unknown = set(packs or ()) - {name for name, _ in all_packs}
    if unknown:
        raise ValueError(f"unknown packs {sorted(unknown)}; choose from {[name for name, _ in all_packs]}")
    packs = [(name, lens) for name, lens in all_packs if not packs or name in packs]
    print(f"{'pack':<12} {'mask':<6} {'docs':>4}  " + "  ".join(f"{n:>12}" for n in
          ["tl", "gluon", "gluon/tl", "cudnn_loop", "dense_gluon"] + [f"g:{c}" for c in configs]) + "   (TFLOP/s)")
    for pname, lens in packs:
        for causal in [c for c, m in ((False, "full"), (True, "causal")) if m in masks]:
            q, k, v = make_pack(lens, lens, heads_q, heads_kv, D, torch.bfloat16, "cuda")
            cu = cu_seqlens(lens, "cuda")
            mx = max(lens)
            scale, wr = D ** -0.5, (0 if causal else -1)
            impls = {"tl": lambda: flash_attn_varlen_fwd_triton(q, k, v, cu, cu, mx, mx, None, scale, -1, wr)}
            if gluon_ok:
                impls["gluon"] = lambda: fa.flash_attn_varlen_fwd_gluon(q, k, v, cu, cu, mx, mx, None, scale, -1, wr)
            bounds = [0]
            for n in lens:
                bounds.append(bounds[-1] + n)
            views = [tuple(t[a:b].unsqueeze(0).transpose(1, 2) for t in (q, k, v)) for a, b in zip(bounds, bounds[1:])]

            def cudnn_loop():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return [F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                                           enable_gqa=heads_q != heads_kv) for qt, kt, vt in views]

            impls["cudnn_loop"] = cudnn_loop
            if len(set(lens)) == 1:
                B, S = len(lens), lens[0]
                q4, k4, v4 = (t.view(B, S, t.size(1), D) for t in (q, k, v))
                impls["dense_gluon"] = lambda: fa.flash_attn_fwd_gluon(q4, k4, v4, None, scale, -1, wr)
            for text in configs:
                cfg = fa.GluonAttnConfig.parse(text)
                if gluon_ok and cfg.check(D) is None:
                    impls[f"g:{text}"] = lambda cfg=cfg: fa.flash_attn_varlen_fwd_gluon(q, k, v, cu, cu, mx, mx, None,
                                                                                       scale, -1, wr, config=cfg)
            row = dict(pack=pname, causal=causal, docs=len(lens), lens=lens if len(lens) <= 16 else None,
                       Hq=heads_q, Hk=heads_kv, D=D)
            cga.time_impls(row, impls, _flops(lens, heads_q, D, causal))
            impls.clear()
            if "ms" in row.get("gluon", {}) and "ms" in row.get("tl", {}):
                row["gluon_over_tl"] = round(row["tl"]["ms"] / row["gluon"]["ms"], 3)

            def cell(key):
                if key == "gluon/tl":
                    return f"{row['gluon_over_tl']:>11.3f}x" if "gluon_over_tl" in row else f"{'-':>12}"
                r = row.get(key)
                return f"{r['tflops']:>12.1f}" if r and "tflops" in r else f"{('err' if r else '-'):>12}"

            print(f"{pname:<12} {'causal' if causal else 'full':<6} {len(lens):>4}  " + "  ".join(
                cell(kk) for kk in ["tl", "gluon", "gluon/tl", "cudnn_loop", "dense_gluon"]
                + [f"g:{c}" for c in configs]), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for gluon_attn_varlen.json")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--only", nargs="*", default=None, help="correctness cases whose name contains one of these")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the correctness pass (timing only)")
    p.add_argument("--graph", action="store_true",
                   help="time device time alone (CUDA-graph replay of 8 calls) instead of events around each call")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (order rotated each round)")
    p.add_argument("--configs", nargs="*", default=[], help="extra Gluon tile configs to check and time (e.g. n128s2p)")
    p.add_argument("--packs", nargs="*", default=None,
                   help="time only these packs (uniform2048 and the pattern names: eq512, pow2, odd, long-first)")
    p.add_argument("--masks", nargs="*", default=["full", "causal"], choices=["full", "causal"])
    p.add_argument("--compile-only", action="store_true", help="sm_90 compile report only (no GPU needed)")
    p.add_argument("--dump", default=None, help="with --compile-only: write ttgir/ptx/cubin (and --sass) here")
    p.add_argument("--sass", action="store_true")
    p.add_argument("--timeout", type=int, default=CHILD_TIMEOUT_S)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child is not None:
        print("RESULT " + json.dumps(check_case(json.loads(args.child))), flush=True)
        return 0
    if args.compile_only:
        _, bad = compile_report(args.dump, args.sass, args.configs)
        return 1 if bad else 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: run with --compile-only on a CPU machine")
        return 1
    cga = _load_script("check_gluon_attn")
    result = dict(env=cga._env_info(), min_snr_db=MIN_SNR)
    print(result["env"])
    ok_all, gluon_ok = True, True
    if not args.no_check:
        print("correctness (each case in a child process):")
        checks = []
        specs = [list(c) for c in CASES] + [list(c[:11]) + [t] + list(c[12:]) for t in args.configs for c in CASES
                                             if c[7] == "bf16" and c[5] in (64, 128)]
        for spec in specs:
            name = spec[0] + (f":{spec[11]}" if len(spec) > 11 and spec[11] else "")
            if args.only and not any(o in name for o in args.only):
                continue
            r = cga.run_child(Path(__file__).resolve(), "--child", spec, args.timeout)
            r["name"] = name
            checks.append(r)
            detail = r.get("error") or " ".join(f"{k}={v}" for k, v in r.items() if k not in ("name", "ok"))
            print(f"  {'ok  ' if r.get('ok') else 'FAIL'} {name}: {detail}", flush=True)
        result["correctness"] = checks
        ok_all = all(r.get("ok") for r in checks)
        gluon_ok = any(r.get("ok") for r in checks)
    if not args.no_timing:
        print(f"timing (bf16, {args.heads}/{args.heads_kv} heads, head dim {args.head_dim}, {TOKENS}-token packs):")
        rows = time_packs(args.heads, args.heads_kv, args.head_dim, args.configs, gluon_ok, args.graph, args.rounds,
                          args.packs, args.masks)
        result["timing"] = rows
        result["geomean_gluon_over_tl"] = cga.geomean_speedup(rows, "gluon", "tl")
        result["geomean_gluon_over_cudnn_loop"] = cga.geomean_speedup(rows, "gluon", "cudnn_loop")
        print(f"geomean gluon/tl = {result['geomean_gluon_over_tl']}, "
              f"gluon/cudnn_loop = {result['geomean_gluon_over_cudnn_loop']}")
    cga.write_result(args.out, "gluon_attn_varlen.json", result)
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
