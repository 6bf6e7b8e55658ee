"""Check and time the Gluon BLOCKWISE FP8 GEMM on an H100/H200 (one GPU call).

    PYTHONPATH=. python scripts/check_gluon_fp8.py --out DIR [--configs n128s5 n128s6 ...]
        [--shapes 4096x4096x4096 ...] [--quick] [--rep-ms 100]

Per shape (M, N, K): random bf16 ``x [M, K]`` and ``w [N, K]`` are quantized with the project's
quantizers (``turbo.ops.quantize_fp8`` BLOCKWISE: 1 x 128 groups for x, 128 x 128 blocks for w),
the output is poisoned with NaN, and every Gluon config runs and is compared with

* the fp32 product of the dequantized operands (``dequant(x_q) @ dequant(w_q)^T``, TF32 off):
  only the accumulation order differs, so SNR >= 40 dB (bf16 output rounding alone is ~50 dB);
* the ``triton.language`` kernel's output (``gemm_fp8_triton`` BLOCKWISE).

Then ``triton.testing.do_bench`` (median, L2 flushed) times each Gluon config, the tl kernel and
cuBLAS bf16 ``torch.mm(x, w.T)``. A compile or launch failure is reported for that config and
shape, never fatal; so is a hang: each config first runs a small smoke GEMM in a child process
with a time limit (``--smoke-timeout``), and configs that fail it are left out of the sweep.
Prints a table and writes ``DIR/gluon_fp8.json``; exit status 1 if any Gluon config fails or
misses the SNR bar.

``--grouped``: the M-grouped MoE kernel (triton/grouped_gemm/grouped_gemm_fp8_gluon.py) on
DeepSeek-V3 EP8 (G = 32, 2048 rows per group; (N, K) = (4096, 7168) gate_up, (7168, 2048) down)
and Qwen3-30B-A3B (G = 16; (1536, 2048), (2048, 768)) experts, each with balanced groups and one
unbalanced pattern (an empty group, sizes that are not tile multiples, 100 rows past
``group_offs[G]``). Per case: the Gluon output (poisoned with NaN first) must have no NaN, zero
rows past ``group_offs[G]``, SNR >= 40 dB against the fp32 product of the dequantized operands on
sampled rows (the first and last rows of every group) and against the tl grouped BLOCKWISE
kernel's whole output; then the Gluon configs, the tl kernel and ``torch._grouped_mm`` bf16 are
timed. Each config is smoke-tested in a child process first (``--smoke-timeout``). Writes
``DIR/gluon_grouped_fp8.json``. About 60-90 s of GPU time with ``--rep-ms 40``::

    PYTHONPATH=. python scripts/check_gluon_fp8.py --grouped --out DIR --rep-ms 40 --smoke-timeout 120

``--wgrad``: the per-row B scale path (``B_ROW_SCALES``) on the BLOCKWISE FP8 linear's weight
gradient ``dW[N_out, K_in] = dY^T[N_out, T] @ X[T, K_in]`` with T = 16384 tokens, both operands
quantized 1 x 128 along the tokens exactly as ``gemm_fp8``'s backward does (its column-wise
copies), for Llama-3.1-8B's gate_up (``dW [28672, 4096]``) and down (``dW [4096, 14336]``)
projections; shapes are ``M x N x K`` = ``N_out x K_in x T``. Per shape: Gluon (output poisoned
with NaN first) against the fp32 product of the dequantized operands (>= 40 dB) and the tl
kernel's output; timing of each Gluon config, the tl kernel (today's wgrad) and cuBLAS bf16
``dY.t() @ X``. Each config is smoke-tested in a child process first. Writes
``DIR/gluon_fp8_wgrad.json``. Configs: n128 not pipelined (n128s4 ... n128s6: column scales in
registers, the default until 2026-12 was n128s6) or, with the column scales TMA'd through the ring,
pipelined n128 (n128s5xr240w24, the variable-K default) and n256 (n256s3c2, the dense default; n256s3); the smoke run also says
whether a config's output is bit-identical to n128s6's (it should be: the same promotions)::

    PYTHONPATH=. python scripts/check_gluon_fp8.py --wgrad --out DIR --configs n128s6 default n256s3c2 n128s5c2x --rep-ms 60

``--grouped-wgrad``: the variable-K grouped kernel (triton/grouped_gemm/grouped_gemm_fp8_variable_k_gluon.py,
the MoE experts' weight gradient ``dW[g] = dY_g^T X_g``) on DeepSeek-V3 EP8 (G = 32, 2048 tokens
per group: gate_up ``P x Q = 4096 x 7168``, down ``7168 x 2048``), balanced and unbalanced (group 1
empty, sizes not multiples of 128), each once with a bf16 output (poisoned with NaN) and once
accumulating into a random fp32 ``main_grad``. The operands are built as ``grouped_gemm_fp8``
BLOCKWISE builds them (the token layout padded per group to multiples of 128, 1 x 128 token blocks;
``--formats HYBRID`` quantizes dY to E5M2). Per case: no NaN, empty groups zero (or unchanged when
accumulating), SNR >= 40 dB against the fp32 product of the dequantized operands on 32 sampled
rows of every group and against the tl variable-K kernel's whole output; then the Gluon configs,
the tl kernel and bf16 ``torch._grouped_mm(dY^T, X)`` (plus the ``main_grad`` add when
accumulating) are timed (TFLOP/s of the unpadded tokens). Each config is smoke-tested in a child
process first; configs too big for an fp32 staging buffer are skipped in the accumulate cases.
Writes ``DIR/gluon_grouped_wgrad_fp8.json``. About 2-3 min of GPU time with ``--rep-ms 40``::

    PYTHONPATH=. python scripts/check_gluon_fp8.py --grouped-wgrad --out DIR --configs n128s6 default n256s3c2 \
        n256s3 --formats E4M3 HYBRID --rep-ms 40 --smoke-timeout 180
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

SHAPES = [  # (M, N, K, label)
    (4096, 4096, 4096, "square 4k"),
    (16384, 14336, 4096, "Llama-3-8B gate_up"),
    (16384, 4096, 14336, "Llama-3-8B down"),
    (8192, 7168, 2048, "DeepSeek-V3-like"),
    (8192, 4096, 7168, "DeepSeek-V3-like"),
]
QUICK_SHAPES = [(4096, 4096, 4096, "square 4k"), (1000, 1000, 384, "tails")]
WGRAD_TOKENS = 16384
WGRAD_SHAPES = [  # (M, N, K) = (N_out, K_in, tokens) of dW = dY^T X
    (28672, 4096, WGRAD_TOKENS, "Llama-3.1-8B gate_up wgrad"),
    (4096, 14336, WGRAD_TOKENS, "Llama-3.1-8B down wgrad"),
]
WGRAD_QUICK_SHAPES = [(4096, 4096, 4096, "square 4k wgrad"), (1000, 1000, 384, "tails wgrad")]
MIN_SNR_DB = 40.0


def _parse_shape(text: str) -> tuple:
    m, n, k = (int(v) for v in text.lower().split("x"))
    return (m, n, k, "cli")


def _dequant_a(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """1 x 128 groups along K."""
    K = q.shape[1]
    return q.float() * s.repeat_interleave(128, dim=1)[:, :K]


def _dequant_b(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """128 x 128 blocks."""
    N, K = q.shape
    return q.float() * s.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:N, :K]


def _quantize(x: torch.Tensor, w: torch.Tensor):
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe

    a_q, sa = turbo.ops.quantize_fp8(x, torch.float8_e4m3fn, "BLOCKWISE")
    b_q, sb = turbo.ops.quantize_fp8(w, torch.float8_e4m3fn, "BLOCKWISE",
                                     scaling_recipe=ScalingRecipe(use_2d_block=True))
    return a_q, sa, b_q, sb


def _err(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    tail = " | ".join(lines[-4:]) if lines else ""
    return f"{type(exc).__name__}: {tail}"[:600]


def _bench(fn, rep_ms: int) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def _gpu_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return dict(gpu=props.name, sms=props.multi_processor_count, capability=list(torch.cuda.get_device_capability()),
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M:%S"))


def _gluon_entry(res: dict, cfg) -> dict:
    """A new result entry of config ``cfg`` (None: the default), registered in ``res["gluon"]``."""
    entry = {}
    res["gluon"]["default" if cfg is None else cfg.short()] = entry
    return entry


def _failed(entry: dict, exc: BaseException) -> None:
    """Marks ``entry`` failed with ``exc`` and the traceback being handled (call in the except)."""
    entry["ok"] = False
    entry["error"] = _err(exc)
    entry["traceback"] = traceback.format_exc()[-3000:]


def _fp32_ref(fn) -> torch.Tensor:
    """``fn()`` with TF32 off: the fp32 product of the dequantized operands."""
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return fn()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32


def _compare(res: dict, a_q, sa, b_q, sb, ref, cublas, configs: list, flops: float, rep_ms: int, do_time: bool,
             row_scales: bool = False) -> None:
    """Into ``res``: the tl kernel's SNR (and time), cuBLAS bf16's time (``cublas()``), then each Gluon
    config on a NaN-poisoned output: SNR against ``ref`` and the tl output, and time. ``row_scales``:
    per-row B scales (the wgrad path), where a config must also match the tl kernel."""
    from primus_turbo.testing import snr_db
    from primus_turbo.triton.gemm.gemm_fp8_gluon import gemm_fp8_blockwise_gluon
    from primus_turbo.triton.gemm.gemm_fp8_kernel import gemm_fp8_triton

    gluon_kw = dict(allow_b_row_scales=True) if row_scales else {}
    M, N = ref.shape
    # the triton.language kernel (its own config choice, autotune as the environment says)
    tl_out = None
    try:
        tl_out = gemm_fp8_triton(a_q, sa, b_q, sb, "BLOCKWISE", out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        res["tl_snr_db"] = snr_db(ref, tl_out)
        if do_time:
            ms = _bench(lambda: gemm_fp8_triton(a_q, sa, b_q, sb, "BLOCKWISE", out_dtype=torch.bfloat16), rep_ms)
            res["tl_ms"], res["tl_tflops"] = ms, flops / ms / 1e9
    except Exception as exc:  # noqa: BLE001
        res["errors"]["tl"] = _err(exc)

    if do_time:
        try:
            ms = _bench(cublas, rep_ms)
            res["cublas_bf16_ms"], res["cublas_bf16_tflops"] = ms, flops / ms / 1e9
        except Exception as exc:  # noqa: BLE001
            res["errors"]["cublas"] = _err(exc)

    for cfg in configs:
        entry = _gluon_entry(res, cfg)
        try:
            out = torch.full((M, N), float("nan"), device=ref.device, dtype=torch.bfloat16)  # poison
            gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out=out, config=cfg, **gluon_kw)
            torch.cuda.synchronize()
            entry["nan_count"] = int(torch.isnan(out).sum())
            entry["snr_db"] = snr_db(ref, out)
            if tl_out is not None:
                entry["snr_vs_tl_db"] = snr_db(tl_out.float(), out)
            entry["ok"] = entry["nan_count"] == 0 and entry["snr_db"] >= MIN_SNR_DB
            if row_scales:
                entry["ok"] = entry["ok"] and entry.get("snr_vs_tl_db", MIN_SNR_DB) >= MIN_SNR_DB
            if do_time:
                ms = _bench(lambda: gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out=out, config=cfg, **gluon_kw),
                            rep_ms)
                entry["ms"], entry["tflops"] = ms, flops / ms / 1e9
        except Exception as exc:  # noqa: BLE001 - report per config, keep going
            _failed(entry, exc)
        torch.cuda.synchronize()
    del tl_out
    torch.cuda.empty_cache()


def run_shape(M: int, N: int, K: int, label: str, configs: list, rep_ms: int, do_time: bool) -> dict:
    from primus_turbo.triton.gemm.gemm_fp8_gluon import default_config, gluon_blockwise_reason

    dev = torch.device("cuda")
    flops = 2.0 * M * N * K
    res = dict(M=M, N=N, K=K, label=label, gluon={}, errors={})
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    a_q, sa, b_q, sb = _quantize(x, w)
    res["reason"] = gluon_blockwise_reason(a_q, sa, b_q, sb)
    res["default_config"] = default_config(M, N, K).short()

    ref = _fp32_ref(lambda: _dequant_a(a_q, sa) @ _dequant_b(b_q, sb).T)
    wt = w.t()
    _compare(res, a_q, sa, b_q, sb, ref, lambda: torch.mm(x, wt), configs, flops, rep_ms, do_time)
    return res


def _fmt(v, spec=".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def print_table(results: list) -> None:
    head = (f"{'M':>6} {'N':>6} {'K':>6}  {'config':<22} {'SNR dB':>7} {'vs tl':>6} {'TFLOP/s':>8} "
            f"{'tl':>7} {'cuBLAS':>7} {'x tl':>6} {'x cuBLAS':>8}")
    print(head)
    print("-" * len(head))
    for r in results:
        tl, cb = r.get("tl_tflops"), r.get("cublas_bf16_tflops")
        for name, e in r["gluon"].items():
            t = e.get("tflops")
            line = (f"{r['M']:>6} {r['N']:>6} {r['K']:>6}  {name:<22} {_fmt(e.get('snr_db')):>7} "
                    f"{_fmt(e.get('snr_vs_tl_db')):>6} {_fmt(t):>8} {_fmt(tl):>7} {_fmt(cb):>7} "
                    f"{_fmt(t / tl if t and tl else None, '.2f'):>6} {_fmt(t / cb if t and cb else None, '.2f'):>8}")
            if not e.get("ok"):
                line += "  FAIL " + (e.get("error") or f"nan={e.get('nan_count')}")[:160]
            print(line)
        if r["errors"]:
            print(f"{'':>22}  errors: {r['errors']}")
        print(f"{'':>22}  tl SNR {_fmt(r.get('tl_snr_db'))} dB; reason={r.get('reason')}")


SMOKE_SHAPES = [(300, 384, 640), (128, 256, 128)]  # M, N tails incl. a 256-wide tile's empty half


# ----------------------------------------------------------------------------------------------
# --wgrad: per-row B scales (the FP8 linear's weight gradient)
# ----------------------------------------------------------------------------------------------
def _wgrad_operands(dy: torch.Tensor, x: torch.Tensor):
    """dY [T, N_out], X [T, K_in] -> (dY^T q [N_out, T], its scales [N_out, T/128], X^T q [K_in, T],
    its scales [K_in, T/128]): gemm_fp8's own column-wise copies (1 x 128 groups along T)."""
    from primus_turbo.pytorch.ops.gemm_fp8 import _quantize as op_quantize

    _, (a_q, sa) = op_quantize(dy, torch.float8_e4m3fn, "BLOCKWISE", 128, False, need_row=False, need_col=True)
    _, (b_q, sb) = op_quantize(x, torch.float8_e4m3fn, "BLOCKWISE", 128, False, need_row=False, need_col=True)
    return a_q, sa, b_q, sb


def run_wgrad_shape(M: int, N: int, K: int, label: str, configs: list, rep_ms: int, do_time: bool) -> dict:
    """dW [M, N] = dY^T [M, K] @ X [K, N] with K the tokens (see the module docstring)."""
    from primus_turbo.triton.gemm.gemm_fp8_gluon import default_config, gluon_blockwise_reason

    dev = torch.device("cuda")
    flops = 2.0 * M * N * K
    res = dict(M=M, N=N, K=K, label=label, gluon={}, errors={})
    torch.manual_seed(0)
    dy = (torch.randn(K, M, device=dev, dtype=torch.float32) * 0.01).to(torch.bfloat16)
    x = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    a_q, sa, b_q, sb = _wgrad_operands(dy, x)
    res["scale_shapes"] = dict(sa=list(sa.shape), sa_strides=list(sa.stride()), sb=list(sb.shape),
                               sb_strides=list(sb.stride()))
    res["reason"] = gluon_blockwise_reason(a_q, sa, b_q, sb, allow_b_row_scales=True)
    res["reason_default_dispatch"] = gluon_blockwise_reason(a_q, sa, b_q, sb)  # the env switch decides
    res["default_config"] = default_config(M, N, K, b_row_scales=True).short()

    ref = _fp32_ref(lambda: _dequant_a(a_q, sa) @ _dequant_a(b_q, sb).T)  # both 1 x 128 along K
    dyt = dy.t()
    _compare(res, a_q, sa, b_q, sb, ref, lambda: torch.mm(dyt, x), configs, flops, rep_ms, do_time,
             row_scales=True)
    return res


WGRAD_SMOKE_SHAPES = [(300, 200, 640), (256, 384, 128), (130, 136, 336)]  # M, N, K tails; N not a 128 multiple


def smoke_wgrad(config_text: str) -> int:
    """Child-process check of one config of the per-row B scale path on small wgrad problems."""
    from primus_turbo.testing import snr_db
    from primus_turbo.triton.gemm.gemm_fp8_gluon import GluonBlockwiseConfig, gemm_fp8_blockwise_gluon

    cfg = None if config_text == "default" else GluonBlockwiseConfig.parse(config_text)
    worst, bad, same = float("inf"), [], True
    torch.backends.cuda.matmul.allow_tf32 = False
    for M, N, K in WGRAD_SMOKE_SHAPES:
        torch.manual_seed(0)
        dy = (torch.randn(K, M, device="cuda") * 0.01).to(torch.bfloat16)
        x = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        a_q, sa, b_q, sb = _wgrad_operands(dy, x)
        ref = _dequant_a(a_q, sa) @ _dequant_a(b_q, sb).T
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out=out, config=cfg, allow_b_row_scales=True)
        torch.cuda.synchronize()
        if torch.isnan(out).any():
            bad.append((M, N, K))
        worst = min(worst, snr_db(ref, out.float().nan_to_num(0.0)))
        # every B_ROW_SCALES config runs the same fp32 promotions in the same order: informational
        ref_cfg = GluonBlockwiseConfig.parse("n128s6")
        same = same and torch.equal(out, gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, config=ref_cfg,
                                                                  allow_b_row_scales=True))
    print(f"SMOKE wgrad {config_text} snr_db={worst:.1f} bad={bad} bit_identical_to_n128s6={same}")
    return 0 if worst >= MIN_SNR_DB and not bad else 1


def smoke(config_text: str) -> int:
    """Child-process check of one config on small shapes (a deadlocked kernel only hangs this)."""
    from primus_turbo.testing import snr_db
    from primus_turbo.triton.gemm.gemm_fp8_gluon import GluonBlockwiseConfig, gemm_fp8_blockwise_gluon

    cfg = None if config_text == "default" else GluonBlockwiseConfig.parse(config_text)
    worst = float("inf")
    for M, N, K in SMOKE_SHAPES:
        torch.manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
        a_q, sa, b_q, sb = _quantize(x, w)
        torch.backends.cuda.matmul.allow_tf32 = False
        ref = _dequant_a(a_q, sa) @ _dequant_b(b_q, sb).T
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, out=out, config=cfg)
        torch.cuda.synchronize()
        worst = min(worst, snr_db(ref, out))
    print(f"SMOKE {config_text} snr_db={worst:.1f}")
    return 0 if worst >= MIN_SNR_DB else 1


def _run_smoke(config_text: str, timeout_s: int, grouped: bool = False, wgrad: bool = False,
               grouped_wgrad: bool = False) -> tuple:
    """(ok, message) of ``smoke`` (``grouped``: ``smoke_grouped``, ``wgrad``: ``smoke_wgrad``,
    ``grouped_wgrad``: ``smoke_grouped_wgrad``) in a child process."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--smoke", config_text] + (["--grouped"] if grouped else [])
    cmd += ["--wgrad"] if wgrad else []
    cmd += ["--grouped-wgrad"] if grouped_wgrad else []
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return False, f"smoke test timed out after {timeout_s} s (deadlock or very slow compile)"
    text = (r.stdout + r.stderr).strip().splitlines()
    return r.returncode == 0, " | ".join(text[-3:])[:600]


def _smoke_configs(args, tag: str = "", validate=None, **kind) -> tuple:
    """(configs that pass, smoke results by config string): each of ``args.configs`` parsed (bad
    strings fail here, early), ``validate(text, cfg)`` if given, then smoked in a child process
    (``kind``: ``_run_smoke``'s flags); ``tag`` prefixes the config in the progress line."""
    from primus_turbo.triton.gemm.gemm_fp8_gluon import GluonBlockwiseConfig

    configs, smoke_results = [], {}
    for c in args.configs:
        cfg = None if c == "default" else GluonBlockwiseConfig.parse(c)
        if validate is not None:
            validate(c, cfg)
        ok, msg = _run_smoke(c, args.smoke_timeout, **kind)
        smoke_results[c] = dict(ok=ok, message=msg)
        print(f"smoke {tag}{c}: {'ok' if ok else 'FAILED'}  {msg}", flush=True)
        if ok:
            configs.append(cfg)
    return configs, smoke_results


def _timed(run, failed) -> dict:
    """``run()``'s result dict (``failed(exc)``'s if it raises) with the seconds it took."""
    t0 = time.time()
    try:
        r = run()
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the reference
        r = failed(exc)
    r["seconds"] = round(time.time() - t0, 1)
    return r


def _finish(args, json_name: str, info: dict, smoke_results: dict, results: list, bases: tuple, unit: str,
            gluon_id, case_id, case_key: str) -> int:
    """The geomean Gluon/base ratios over ``unit``, the JSON report, the failures; exit status.
    ``gluon_id(r)`` / ``case_id(r)`` name a result in the failure list of a config / of the whole
    case (``case_key`` in its errors)."""
    for base in bases:
        ratios = {}
        for r in results:
            for name, e in r["gluon"].items():
                if e.get("tflops") and r.get(f"{base}_tflops"):
                    ratios.setdefault(name, []).append(e["tflops"] / r[f"{base}_tflops"])
        for name, rs in ratios.items():
            print(f"geomean Gluon/{base} {name}: {math.exp(sum(map(math.log, rs)) / len(rs)):.3f} over {len(rs)} {unit}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / json_name
    path.write_text(json.dumps(dict(info=info, env={k: v for k, v in os.environ.items() if k.startswith("PRIMUS_")},
                                    smoke=smoke_results, results=results), indent=1, default=str))
    print(f"\nwrote {path}")
    bad = [gluon_id(r) + (n,) for r in results for n, e in r["gluon"].items() if not e.get("ok")]
    bad += [("smoke", c) for c, v in smoke_results.items() if not v["ok"]]
    bad += [case_id(r) + (case_key,) for r in results if case_key in r["errors"]]
    if bad:
        print(f"FAILED: {bad}")
    return 1 if bad else 0


def _group_offsets(lens: list, device) -> torch.Tensor:
    """int64 [G+1] offsets of the groups of sizes ``lens`` (0 first), on ``device``."""
    offs = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offs[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return offs.to(device)


# ----------------------------------------------------------------------------------------------
# --grouped: the M-grouped MoE kernel
# ----------------------------------------------------------------------------------------------
GROUPED_CASES = [  # (G, rows per group, N, K, label)
    (32, 2048, 4096, 7168, "DeepSeek-V3 EP8 gate_up"),
    (32, 2048, 7168, 2048, "DeepSeek-V3 EP8 down"),
    (16, 2048, 1536, 2048, "Qwen3-30B-A3B gate_up"),
    (16, 2048, 2048, 768, "Qwen3-30B-A3B down"),
]
#: --moe-cases gpt-oss: GPT-OSS-20B's MoE layer step (16384 tokens, top-4, 32 experts: 2048 rows per
#: expert, hidden = ffn = 2880): gate_up forward, down forward (= both dgrads' N x K up to order),
#: gate_up dgrad
GROUPED_CASES_GPTOSS = [
    (32, 2048, 5760, 2880, "GPT-OSS-20B gate_up"),
    (32, 2048, 2880, 2880, "GPT-OSS-20B down"),
    (32, 2048, 2880, 5760, "GPT-OSS-20B gate_up dgrad"),
]
GROUPED_TAIL_ROWS = 100  # rows past group_offs[G] in the unbalanced pattern (must come back zero)
GROUPED_SAMPLE_ROWS = 16  # reference rows at each end of every group


def _group_lens(G: int, rows: int, pattern: str) -> list:
    """Balanced: ``rows`` each. Unbalanced: the same total, group 1 empty, the others spread
    0.25x-1.75x by a fixed generator (sizes that are not multiples of 64 or 128)."""
    if pattern == "balanced":
        return [rows] * G
    gen = torch.Generator().manual_seed(1234)
    w = torch.rand(G, generator=gen) * 1.5 + 0.25
    w[1] = 0.0
    lens = (w / w.sum() * rows * G).floor().long()
    lens[0] += rows * G - int(lens.sum())
    return [int(v) for v in lens]


def _quantize_grouped(x: torch.Tensor, w: torch.Tensor):
    """x [M, K] 1 x 128; w [G, N, K] 128 x 128 per expert (the op's weight quantizer: one launch,
    also where N % 128 != 0, e.g. GPT-OSS's 2880)."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.ops.grouped_gemm_fp8 import _quant_weight

    a_q, sa = turbo.ops.quantize_fp8(x, torch.float8_e4m3fn, "BLOCKWISE")
    b_q, sb = _quant_weight(w, torch.float8_e4m3fn, "BLOCKWISE", 128)
    return a_q, sa, b_q, sb


def _grouped_ref_rows(a_q, sa, b_q, sb, lens: list) -> tuple:
    """(row indices, fp32 reference rows): the first and last GROUPED_SAMPLE_ROWS rows of each group."""
    idx, refs = [], []
    start = 0
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for g, n in enumerate(lens):
            if n:
                r = sorted(set(range(start, start + min(n, GROUPED_SAMPLE_ROWS)))
                           | set(range(max(start, start + n - GROUPED_SAMPLE_ROWS), start + n)))
                rows = torch.tensor(r, device=a_q.device)
                refs.append(_dequant_a(a_q[rows], sa[rows]) @ _dequant_b(b_q[g], sb[g]).T)
                idx.append(rows)
            start += n
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return torch.cat(idx), torch.cat(refs)


def run_grouped_case(G: int, rows: int, N: int, K: int, label: str, pattern: str, configs: list, rep_ms: int,
                     do_time: bool) -> dict:
    from primus_turbo.testing import snr_db
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_gluon import (
        gluon_grouped_blockwise_reason, grouped_default_config, grouped_gemm_fp8_blockwise_gluon,
    )
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_triton

    dev = torch.device("cuda")
    lens = _group_lens(G, rows, pattern)
    tail = GROUPED_TAIL_ROWS if pattern != "balanced" else 0
    M = sum(lens) + tail
    flops = 2.0 * sum(lens) * N * K
    res = dict(G=G, rows=rows, N=N, K=K, M=M, label=label, pattern=pattern, lens=lens, gluon={}, errors={})
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(G, N, K, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    a_q, sa, b_q, sb = _quantize_grouped(x, w)
    offs = _group_offsets(lens, dev)
    end = int(offs[-1])
    res["reason"] = gluon_grouped_blockwise_reason(a_q, sa, b_q, sb, offs)
    res["default_config"] = grouped_default_config(M, N, K, G).short()
    rows_idx, ref = _grouped_ref_rows(a_q, sa, b_q, sb, lens)

    tl_out = None
    try:
        tl_out = grouped_gemm_fp8_triton(a_q, sa, b_q, sb, "BLOCKWISE", None, offs, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        res["tl_snr_db"] = snr_db(ref, tl_out[rows_idx])
        if do_time:
            ms = _bench(lambda: grouped_gemm_fp8_triton(a_q, sa, b_q, sb, "BLOCKWISE", None, offs,
                                                        out_dtype=torch.bfloat16), rep_ms)
            res["tl_ms"], res["tl_tflops"] = ms, flops / ms / 1e9
    except Exception as exc:  # noqa: BLE001
        res["errors"]["tl"] = _err(exc)

    if do_time:
        try:
            wt = w.transpose(-2, -1)
            offs32 = offs[1:].to(torch.int32)
            ms = _bench(lambda: torch._grouped_mm(x, wt, offs=offs32), rep_ms)
            res["bf16_ms"], res["bf16_tflops"] = ms, flops / ms / 1e9
        except Exception as exc:  # noqa: BLE001
            res["errors"]["grouped_mm_bf16"] = _err(exc)

    for cfg in configs:
        entry = _gluon_entry(res, cfg)
        try:
            out = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)  # poison
            grouped_gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, offs, config=cfg, out=out)
            torch.cuda.synchronize()
            entry["nan_count"] = int(torch.isnan(out).sum())
            entry["tail_nonzero"] = int((out[end:] != 0).sum())
            entry["snr_db"] = snr_db(ref, out[rows_idx])
            if tl_out is not None:
                entry["snr_vs_tl_db"] = snr_db(tl_out.float(), out)
            entry["ok"] = (entry["nan_count"] == 0 and entry["tail_nonzero"] == 0 and entry["snr_db"] >= MIN_SNR_DB
                           and entry.get("snr_vs_tl_db", MIN_SNR_DB) >= MIN_SNR_DB)
            if do_time:
                ms = _bench(lambda: grouped_gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, offs, config=cfg, out=out),
                            rep_ms)
                entry["ms"], entry["tflops"] = ms, flops / ms / 1e9
        except Exception as exc:  # noqa: BLE001
            _failed(entry, exc)
        torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return res


def print_grouped_table(results: list) -> None:
    head = (f"{'case':<26} {'pattern':<10} {'config':<22} {'SNR dB':>7} {'vs tl':>6} {'TFLOP/s':>8} "
            f"{'tl':>7} {'bf16':>7} {'x tl':>6} {'x bf16':>7}")
    print(head)
    print("-" * len(head))
    for r in results:
        tl, bf = r.get("tl_tflops"), r.get("bf16_tflops")
        for name, e in r["gluon"].items():
            t = e.get("tflops")
            line = (f"{r['label']:<26} {r['pattern']:<10} {name:<22} {_fmt(e.get('snr_db')):>7} "
                    f"{_fmt(e.get('snr_vs_tl_db')):>6} {_fmt(t):>8} {_fmt(tl):>7} {_fmt(bf):>7} "
                    f"{_fmt(t / tl if t and tl else None, '.2f'):>6} {_fmt(t / bf if t and bf else None, '.2f'):>7}")
            if not e.get("ok"):
                line += "  FAIL " + (e.get("error") or f"nan={e.get('nan_count')} tail={e.get('tail_nonzero')}")[:160]
            print(line)
        if r["errors"]:
            print(f"{'':>26}  errors: {r['errors']}")
        print(f"{'':>26}  tl SNR {_fmt(r.get('tl_snr_db'))} dB; reason={r.get('reason')}")


# small grouped smoke cases: (lens, N, K, rows past offs[G]): empty and partial groups, N and K tails
GROUPED_SMOKE = [([300, 0, 1, 129, 64], 384, 640, 20), ([256, 256], 256, 256, 0), ([70, 5], 136, 336, 3)]


def smoke_grouped(config_text: str) -> int:
    """Child-process check of one config on small grouped problems (a deadlock only hangs this)."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.low_precision import ScalingRecipe
    from primus_turbo.testing import snr_db
    from primus_turbo.triton.gemm.gemm_fp8_gluon import GluonBlockwiseConfig
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_gluon import grouped_gemm_fp8_blockwise_gluon

    cfg = None if config_text == "default" else GluonBlockwiseConfig.parse(config_text)
    worst, bad = float("inf"), []
    torch.backends.cuda.matmul.allow_tf32 = False
    for lens, N, K, tail in GROUPED_SMOKE:
        torch.manual_seed(0)
        G, M = len(lens), sum(lens) + tail
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(G, N, K, device="cuda") * 0.02).to(torch.bfloat16)
        a_q, sa = turbo.ops.quantize_fp8(x, torch.float8_e4m3fn, "BLOCKWISE")
        qs = [turbo.ops.quantize_fp8(w[g], torch.float8_e4m3fn, "BLOCKWISE",
                                     scaling_recipe=ScalingRecipe(use_2d_block=True)) for g in range(G)]
        b_q = torch.stack([q for q, _ in qs])
        sb = torch.stack([s for _, s in qs])
        offs = _group_offsets(lens, "cuda")
        ref = torch.zeros(M, N, device="cuda")
        start = 0
        for g, n in enumerate(lens):
            ref[start:start + n] = _dequant_a(a_q[start:start + n], sa[start:start + n]) @ _dequant_b(b_q[g], sb[g]).T
            start += n
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        grouped_gemm_fp8_blockwise_gluon(a_q, sa, b_q, sb, offs, config=cfg, out=out)
        torch.cuda.synchronize()
        if torch.isnan(out).any() or (out[sum(lens):] != 0).any():
            bad.append((lens, N, K))
        worst = min(worst, snr_db(ref, out.float().nan_to_num(0.0)))
    print(f"SMOKE grouped {config_text} snr_db={worst:.1f} bad={bad}")
    return 0 if worst >= MIN_SNR_DB and not bad else 1


def main_grouped(args) -> int:
    configs, smoke_results = _smoke_configs(args, "grouped ", grouped=True)
    info = _gpu_info()
    print(json.dumps(info))
    results = []
    cases = GROUPED_CASES_GPTOSS if args.moe_cases == "gpt-oss" else GROUPED_CASES
    for G, rows, N, K, label in cases:
        for pattern in args.patterns:
            r = _timed(lambda: run_grouped_case(G, rows, N, K, label, pattern, configs, args.rep_ms, not args.no_time),
                       lambda exc: dict(G=G, rows=rows, N=N, K=K, label=label, pattern=pattern, gluon={},
                                        errors={"case": _err(exc)}))
            results.append(r)
            print(f"done {label} {pattern} in {r['seconds']} s", flush=True)
    print()
    print_grouped_table(results)
    case_id = lambda r: (r["label"], r["pattern"])  # noqa: E731
    return _finish(args, "gluon_grouped_fp8.json", info, smoke_results, results, ("tl", "bf16"), "cases",
                   case_id, case_id, "case")


# ----------------------------------------------------------------------------------------------
# --grouped-wgrad: the variable-K grouped kernel (the MoE experts' weight gradient)
# ----------------------------------------------------------------------------------------------
GROUPED_WGRAD_CASES = [  # (G, tokens per group, P, Q, label): dW[g] [P, Q] = dY_g^T [P, T_g] @ X_g [T_g, Q]
    (32, 2048, 4096, 7168, "DeepSeek-V3 EP8 gate_up wgrad"),  # dW of w1/w3 [2 x 2048, 7168] per expert
    (32, 2048, 7168, 2048, "DeepSeek-V3 EP8 down wgrad"),     # dW of w2 [7168, 2048] per expert
]
GROUPED_WGRAD_CASES_GPTOSS = [
    (32, 2048, 5760, 2880, "GPT-OSS-20B gate_up wgrad"),
    (32, 2048, 2880, 2880, "GPT-OSS-20B down wgrad"),
]
GROUPED_WGRAD_SAMPLE_ROWS = 32  # reference rows of P per group (spread over P, first and last included)


def _grouped_wgrad_operands(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, dy_dtype):
    """dY [T, P], X [T, Q], offsets [G+1] -> the operands grouped_gemm_fp8 BLOCKWISE hands its
    variable-K dispatcher: both gathered into the token layout padded per group to multiples of 128
    (``padded_group_layout``) and quantized 1 x 128 along the tokens, stored transposed
    (``[P, M_pad]``, ``[P, M_pad/128]``; ``[Q, M_pad]``, ...), and the padded offsets."""
    from primus_turbo.pytorch.backends.grouped_gemm_fp8 import padded_group_layout
    from primus_turbo.pytorch.ops.grouped_gemm_fp8 import _mx_token_copy, _token_quant

    src, poffs = padded_group_layout(offs, dy.shape[0], 128)
    x_t, sx = _mx_token_copy(dy, src, _token_quant("BLOCKWISE", dy_dtype, 128)[1], 1)
    y_t, sy = _mx_token_copy(x, src, _token_quant("BLOCKWISE", torch.float8_e4m3fn, 128)[1], 1)
    return x_t, sx, y_t, sy, poffs


def _grouped_wgrad_ref_rows(x_t, sx, y_t, sy, poffs: torch.Tensor, P: int) -> tuple:
    """(row indices of P, reference [G, rows, Q] fp32 of the dequantized operands, TF32 off)."""
    rows = torch.linspace(0, P - 1, GROUPED_WGRAD_SAMPLE_ROWS, device=x_t.device).round().long().unique()
    offs = poffs.tolist()
    xs = x_t[rows].float() * sx[rows].repeat_interleave(128, dim=1)
    refs = []
    for g in range(len(offs) - 1):
        a, b = offs[g], offs[g + 1]
        yd = y_t[:, a:b].float() * sy[:, a // 128:b // 128].repeat_interleave(128, dim=1)
        refs.append(_fp32_ref(lambda: xs[:, a:b] @ yd.T))
    return rows, torch.stack(refs)


def _grouped_wgrad_check(entry: dict, out: torch.Tensor, base, rows, ref, tl_out, empty: list) -> None:
    """Into ``entry``: NaNs, empty groups (zero, or unchanged from ``base`` when accumulating),
    SNR against the sampled reference and the tl kernel's whole output, ok."""
    from primus_turbo.testing import snr_db

    got = out.float() if base is None else out - base
    entry["nan_count"] = int(torch.isnan(out).sum())
    if base is None:
        entry["empty_groups_nonzero"] = int(sum(int((out[g] != 0).sum()) for g in empty))
    else:
        entry["empty_groups_changed"] = int(sum(int((out[g] != base[g]).sum()) for g in empty))
    entry["snr_db"] = snr_db(ref, got[:, rows])
    if tl_out is not None:
        entry["snr_vs_tl_db"] = snr_db(tl_out.float() if base is None else tl_out - base, got)
    entry["ok"] = (entry["nan_count"] == 0 and not entry.get("empty_groups_nonzero")
                   and not entry.get("empty_groups_changed") and entry["snr_db"] >= MIN_SNR_DB
                   and entry.get("snr_vs_tl_db", MIN_SNR_DB) >= MIN_SNR_DB)


def run_grouped_wgrad_case(G: int, rows: int, P: int, Q: int, label: str, pattern: str, fmt: str, accumulate: bool,
                           configs: list, rep_ms: int, do_time: bool) -> dict:
    """One case: bf16 output (``accumulate=False``, poisoned with NaN) or fp32 ``main_grad``
    accumulation (``out += dW`` into a random fp32 tensor); Gluon configs, the tl variable-K
    kernel and bf16 ``torch._grouped_mm`` (``dY^T @ X`` per group, unpadded) timed."""
    from primus_turbo.testing import snr_db
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_variable_k_triton
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_variable_k_gluon import (
        gluon_variable_k_blockwise_reason, grouped_gemm_fp8_variable_k_blockwise_gluon, variable_k_default_config,
    )

    dev = torch.device("cuda")
    lens = _group_lens(G, rows, pattern)
    T = sum(lens)
    out_dtype = torch.float32 if accumulate else torch.bfloat16
    flops = 2.0 * T * P * Q
    res = dict(G=G, rows=rows, P=P, Q=Q, T=T, label=label, pattern=pattern, format=fmt, accumulate=accumulate,
               lens=lens, gluon={}, errors={})
    torch.manual_seed(0)
    dy = (torch.randn(T, P, device=dev, dtype=torch.float32) * 0.01).to(torch.bfloat16)
    x = torch.randn(T, Q, device=dev, dtype=torch.bfloat16)
    offs = _group_offsets(lens, dev)
    dy_dtype = torch.float8_e5m2 if fmt == "HYBRID" else torch.float8_e4m3fn
    x_t, sx, y_t, sy, poffs = _grouped_wgrad_operands(dy, x, offs, dy_dtype)
    res["M_pad"] = x_t.shape[1]
    empty = [g for g, n in enumerate(lens) if n == 0]
    base = torch.randn(G, P, Q, device=dev) * 0.1 if accumulate else None
    probe = base.clone() if accumulate else None
    res["reason"] = gluon_variable_k_blockwise_reason(x_t, sx, y_t, sy, poffs, out=probe, accumulate=accumulate,
                                                      out_dtype=out_dtype)
    res["default_config"] = variable_k_default_config(P, Q, x_t.shape[1], G, out_dtype).short()
    del probe
    rows_idx, ref = _grouped_wgrad_ref_rows(x_t, sx, y_t, sy, poffs, P)

    def tl_call(out=None):
        return grouped_gemm_fp8_variable_k_triton(x_t, sx, y_t, sy, "BLOCKWISE", None, poffs, out=out,
                                                  accumulate=accumulate, out_dtype=out_dtype)

    tl_out = None
    try:
        tl_out = tl_call(base.clone() if accumulate else None)
        torch.cuda.synchronize()
        res["tl_snr_db"] = snr_db(ref, (tl_out - base if accumulate else tl_out.float())[:, rows_idx])
        if do_time:
            scratch = base.clone() if accumulate else torch.empty(G, P, Q, device=dev, dtype=out_dtype)
            ms = _bench(lambda: tl_call(scratch), rep_ms)
            res["tl_ms"], res["tl_tflops"] = ms, flops / ms / 1e9
            del scratch
    except Exception as exc:  # noqa: BLE001
        res["errors"]["tl"] = _err(exc)

    if do_time:
        try:
            dyt = dy.t()
            offs32 = offs[1:].to(torch.int32)
            if accumulate:  # what a bf16 run would do for main_grad: the product, then one add
                main_grad = base.clone()
                ms = _bench(lambda: main_grad.add_(torch._grouped_mm(dyt, x, offs=offs32)), rep_ms)
                del main_grad
            else:
                ms = _bench(lambda: torch._grouped_mm(dyt, x, offs=offs32), rep_ms)
            res["bf16_ms"], res["bf16_tflops"] = ms, flops / ms / 1e9
        except Exception as exc:  # noqa: BLE001
            res["errors"]["grouped_mm_bf16"] = _err(exc)

    for cfg in configs:
        entry = _gluon_entry(res, cfg)
        if cfg is not None and cfg.check(out_dtype.itemsize, b_row_scales=True) is not None:
            entry.update(ok=True, skipped=cfg.check(out_dtype.itemsize, b_row_scales=True))
            continue
        try:
            if accumulate:
                out = base.clone()
            else:
                out = torch.full((G, P, Q), float("nan"), device=dev, dtype=out_dtype)  # poison
            grouped_gemm_fp8_variable_k_blockwise_gluon(x_t, sx, y_t, sy, poffs, out=out, accumulate=accumulate,
                                                        config=cfg)
            torch.cuda.synchronize()
            _grouped_wgrad_check(entry, out, base, rows_idx, ref, tl_out, empty)
            if do_time:
                ms = _bench(lambda: grouped_gemm_fp8_variable_k_blockwise_gluon(
                    x_t, sx, y_t, sy, poffs, out=out, accumulate=accumulate, config=cfg), rep_ms)
                entry["ms"], entry["tflops"] = ms, flops / ms / 1e9
        except Exception as exc:  # noqa: BLE001
            _failed(entry, exc)
        torch.cuda.synchronize()
    del tl_out, base
    torch.cuda.empty_cache()
    return res


def print_grouped_wgrad_table(results: list) -> None:
    head = (f"{'case':<30} {'pattern':<10} {'fmt':<6} {'out':<8} {'config':<20} {'SNR dB':>7} {'vs tl':>6} "
            f"{'TFLOP/s':>8} {'tl':>7} {'bf16':>7} {'x tl':>6} {'x bf16':>7}")
    print(head)
    print("-" * len(head))
    for r in results:
        tl, bf = r.get("tl_tflops"), r.get("bf16_tflops")
        mode = "fp32 +=" if r.get("accumulate") else "bf16"
        for name, e in r["gluon"].items():
            if e.get("skipped"):
                continue
            t = e.get("tflops")
            line = (f"{r['label']:<30} {r['pattern']:<10} {r.get('format', ''):<6} {mode:<8} {name:<20} "
                    f"{_fmt(e.get('snr_db')):>7} {_fmt(e.get('snr_vs_tl_db')):>6} {_fmt(t):>8} {_fmt(tl):>7} "
                    f"{_fmt(bf):>7} {_fmt(t / tl if t and tl else None, '.2f'):>6} "
                    f"{_fmt(t / bf if t and bf else None, '.2f'):>7}")
            if not e.get("ok"):
                line += "  FAIL " + (e.get("error") or f"nan={e.get('nan_count')} empty="
                                     f"{e.get('empty_groups_nonzero', e.get('empty_groups_changed'))}")[:160]
            print(line)
        if r["errors"]:
            print(f"{'':>30}  errors: {r['errors']}")
        print(f"{'':>30}  tl SNR {_fmt(r.get('tl_snr_db'))} dB; reason={r.get('reason')}")


# small smoke cases: (unpadded group sizes, P, Q, accumulate): empty groups first / inside / last,
# sizes that are not 128 multiples (padded like the op), P % 128 == 64, Q not a multiple of 128
GROUPED_WGRAD_SMOKE = [([300, 0, 1, 129, 64, 0], 192, 200, False), ([256, 256], 256, 256, True),
                       ([0, 70, 5], 128, 136, True), ([128] * 5, 64, 384, False)]


def smoke_grouped_wgrad(config_text: str) -> int:
    """Child-process check of one config on small variable-K problems (a deadlock only hangs this)."""
    from primus_turbo.testing import snr_db
    from primus_turbo.triton.gemm.gemm_fp8_gluon import GluonBlockwiseConfig
    from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_variable_k_gluon import (
        grouped_gemm_fp8_variable_k_blockwise_gluon,
    )

    cfg = None if config_text == "default" else GluonBlockwiseConfig.parse(config_text)
    worst, bad = float("inf"), []
    torch.backends.cuda.matmul.allow_tf32 = False
    for lens, P, Q, accumulate in GROUPED_WGRAD_SMOKE:
        out_dtype = torch.float32 if accumulate else torch.bfloat16
        if cfg is not None and cfg.check(out_dtype.itemsize, b_row_scales=True) is not None:
            continue
        torch.manual_seed(0)
        G, T = len(lens), sum(lens)
        dy = (torch.randn(T, P, device="cuda") * 0.01).to(torch.bfloat16)
        x = torch.randn(T, Q, device="cuda", dtype=torch.bfloat16)
        offs = _group_offsets(lens, "cuda")
        x_t, sx, y_t, sy, poffs = _grouped_wgrad_operands(dy, x, offs, torch.float8_e4m3fn)
        po = poffs.tolist()
        ref = torch.zeros(G, P, Q, device="cuda")
        xd = x_t.float() * sx.repeat_interleave(128, dim=1)
        yd = y_t.float() * sy.repeat_interleave(128, dim=1)
        for g in range(G):
            ref[g] = xd[:, po[g]:po[g + 1]] @ yd[:, po[g]:po[g + 1]].T
        base = torch.randn(G, P, Q, device="cuda") if accumulate else None
        out = base.clone() if accumulate else torch.full((G, P, Q), float("nan"), device="cuda", dtype=out_dtype)
        grouped_gemm_fp8_variable_k_blockwise_gluon(x_t, sx, y_t, sy, poffs, out=out, accumulate=accumulate,
                                                    config=cfg)
        torch.cuda.synchronize()
        got = out - base if accumulate else out.float()
        empty = [g for g, n in enumerate(lens) if n == 0]
        if torch.isnan(out).any() or any((got[g] != 0).any() for g in empty):
            bad.append((lens, P, Q, accumulate))
        worst = min(worst, snr_db(ref, got.nan_to_num(0.0)))
    print(f"SMOKE grouped-wgrad {config_text} snr_db={worst:.1f} bad={bad}")
    return 0 if worst >= MIN_SNR_DB and not bad else 1


def main_grouped_wgrad(args) -> int:
    def validate(c, cfg):
        if cfg is not None and cfg.check(2, b_row_scales=True) is not None and cfg.check(4, b_row_scales=True):
            raise SystemExit(f"--grouped-wgrad config {c}: {cfg.check(2, b_row_scales=True)}")

    configs, smoke_results = _smoke_configs(args, "grouped-wgrad ", validate, grouped_wgrad=True)
    info = _gpu_info()
    print(json.dumps(info))
    results = []
    cases = GROUPED_WGRAD_CASES_GPTOSS if args.moe_cases == "gpt-oss" else GROUPED_WGRAD_CASES
    runs = [(case, pattern, fmt, acc) for case in cases for fmt in args.formats
            for pattern in args.patterns for acc in (False, True)]
    for (G, rows, P, Q, label), pattern, fmt, acc in runs:
        def failed(exc):
            r = dict(G=G, rows=rows, P=P, Q=Q, label=label, pattern=pattern, format=fmt, accumulate=acc, gluon={},
                     errors={"case": _err(exc)})
            torch.cuda.empty_cache()
            return r

        r = _timed(lambda: run_grouped_wgrad_case(G, rows, P, Q, label, pattern, fmt, acc, configs, args.rep_ms,
                                                  not args.no_time), failed)
        results.append(r)
        print(f"done {label} {pattern} {fmt} {'accumulate' if acc else 'bf16'} in {r['seconds']} s", flush=True)
    print()
    print_grouped_wgrad_table(results)
    return _finish(args, "gluon_grouped_wgrad_fp8.json", info, smoke_results, results, ("tl", "bf16"), "cases",
                   lambda r: (r["label"], r["pattern"], r.get("format"), r.get("accumulate")),
                   lambda r: (r["label"], r["pattern"]), "case")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for gluon_fp8.json (required unless --smoke)")
    p.add_argument("--smoke", default=None, help=argparse.SUPPRESS)  # child-process mode, see smoke()
    p.add_argument("--smoke-timeout", type=int, default=240, help="seconds per config for the smoke test")
    p.add_argument("--configs", nargs="*", default=["default"],
                   help="Gluon configs to sweep: 'default' and/or strings like n128s5, n128s6g16, n128s4r240w24")
    p.add_argument("--shapes", nargs="*", default=None, help="MxNxK strings (default: the five model shapes)")
    p.add_argument("--quick", action="store_true", help="two small shapes, correctness and timing")
    p.add_argument("--no-time", action="store_true", help="correctness only")
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--grouped", action="store_true",
                   help="the M-grouped MoE kernel on DeepSeek-V3 / Qwen3 expert shapes (see the module docstring)")
    p.add_argument("--wgrad", action="store_true",
                   help="the per-row B scale path on Llama-3.1-8B wgrad shapes (see the module docstring)")
    p.add_argument("--grouped-wgrad", action="store_true",
                   help="the variable-K grouped kernel (MoE wgrad) on DeepSeek-V3 EP8 expert shapes (see the module "
                        "docstring)")
    p.add_argument("--moe-cases", default="default", choices=["default", "gpt-oss"],
                   help="--grouped / --grouped-wgrad: the DeepSeek-V3 / Qwen3 cases, or GPT-OSS-20B's layer step")
    p.add_argument("--patterns", nargs="*", default=["balanced", "unbalanced"], choices=["balanced", "unbalanced"],
                   help="--grouped / --grouped-wgrad: group-size patterns")
    p.add_argument("--formats", nargs="*", default=["E4M3"], choices=["E4M3", "HYBRID"],
                   help="--grouped-wgrad: E4M3 dY and/or HYBRID's E5M2 dY")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.smoke is not None:
        if args.grouped_wgrad:
            return smoke_grouped_wgrad(args.smoke)
        if args.wgrad:
            return smoke_wgrad(args.smoke)
        return smoke_grouped(args.smoke) if args.grouped else smoke(args.smoke)
    if args.out is None:
        p.error("--out is required")
    if args.grouped:
        return main_grouped(args)
    if args.grouped_wgrad:
        return main_grouped_wgrad(args)
    def validate(c, cfg):
        if args.wgrad and cfg is not None and cfg.check(2, b_row_scales=True) is not None:
            p.error(f"--wgrad config {c}: {cfg.check(2, b_row_scales=True)}")

    configs, smoke_results = _smoke_configs(args, "", validate, wgrad=args.wgrad)
    if args.wgrad:
        default_shapes, quick_shapes, run_fn = WGRAD_SHAPES, WGRAD_QUICK_SHAPES, run_wgrad_shape
        json_name = "gluon_fp8_wgrad.json"
    else:
        default_shapes, quick_shapes, run_fn = SHAPES, QUICK_SHAPES, run_shape
        json_name = "gluon_fp8.json"
    shapes = [_parse_shape(s) for s in args.shapes] if args.shapes else (quick_shapes if args.quick else default_shapes)
    info = _gpu_info()
    print(json.dumps(info))
    results = []
    for M, N, K, label in shapes:
        r = _timed(lambda: run_fn(M, N, K, label, configs, args.rep_ms, not args.no_time),
                   lambda exc: dict(M=M, N=N, K=K, label=label, gluon={}, errors={"shape": _err(exc)}))
        results.append(r)
        print(f"done {M}x{N}x{K} in {r['seconds']} s", flush=True)
    print()
    print_table(results)
    shape_id = lambda r: (r["M"], r["N"], r["K"])  # noqa: E731
    return _finish(args, json_name, info, smoke_results, results, ("tl", "cublas_bf16"), "shapes",
                   shape_id, shape_id, "shape")


if __name__ == "__main__":
    raise SystemExit(main())
