"""gemm_triton against a float64 reference: layouts, dtypes, tails, accumulate, fallbacks, errors.

On CPU the kernels run in the Triton interpreter with one 32x32x32 config and 3 persistent programs,
so every multi-tile shape below exercises the persistent tile loop and the GROUP_M swizzle.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.gemm import gemm_kernel as gk  # noqa: E402
from primus_turbo.triton.gemm import check_gemm_triton, gemm_triton  # noqa: E402

_ON_GPU = torch.cuda.is_available()

# The interpreter turns loop bounds into Python ints through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# Minimum SNR (dB) of the output against the float64 product of the same (rounded) inputs. The
# error is then only fp32 accumulation plus the final rounding to the output dtype. bf16: 45 dB on
# GPU (round-to-nearest output: >= 48 dB for any element). Under the interpreter an fp32 -> bf16
# cast truncates instead of rounding (triton/runtime/interpreter.py casts without a rounding mode),
# which costs 6 dB and allows 42 dB for a single element, so the CPU bar is 41 dB.
MIN_SNR = {
    torch.bfloat16: 45.0 if _ON_GPU else 41.0,
    torch.float16: 50.0,
    torch.float32: 80.0,
}

SHAPES = [(1, 1, 1), (16, 16, 16), (33, 65, 17), (80, 72, 40), (128, 96, 64), (64, 129, 127)]
LAYOUTS = ["NN", "NT", "TN", "TT"]  # first letter: a col-major (T) or not; second: b
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    # On a GPU every small shape would otherwise be timed once per candidate config. The tuner has
    # its own test below (test_autotune_never_touches_accumulation_target, and the GPU tests).
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE", "0")


def snr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref = ref.double().cpu()
    err = (ref - out.double().cpu()).pow(2).sum().item()
    if math.isnan(err):
        return -math.inf
    return math.inf if err == 0 else 10 * math.log10(ref.pow(2).sum().item() / err)


def make_operands(M, N, K, layout, dtype, device):
    """a: [M, K], b: [K, N]; a 'T' layout is the transposed view of a contiguous tensor."""
    a = torch.randn(K, M).to(dtype).to(device).T if layout[0] == "T" else torch.randn(M, K).to(dtype).to(device)
    b = torch.randn(N, K).to(dtype).to(device).T if layout[1] == "T" else torch.randn(K, N).to(dtype).to(device)
    return a, b


def reference(a, b):
    return a.double().cpu() @ b.double().cpu()


def poisoned(M, N, dtype, device):
    return torch.full((M, N), float("nan"), dtype=dtype, device=device)


def cfg(**changes):
    """The config gemm_triton would use here, with some fields changed (CPU: the interpreter config)."""
    return dataclasses.replace(gk._default_config(128, 128, 128, torch.bfloat16, False, 132), **changes)


# ---------------------------------------------------------------------------------------------
# Correctness grid
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, layout, dtype, device):
    M, N, K = shape
    a, b = make_operands(M, N, K, layout, dtype, device)
    out = gemm_triton(a, b, out=poisoned(M, N, dtype, device))
    assert out.dtype == dtype and out.shape == (M, N)
    assert snr_db(reference(a, b), out) >= MIN_SNR[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pointer_kernel_matches_reference(layout, dtype, device):
    """The fallback kernel on the same grid (forced with use_tma=False), with and without subtiling."""
    for M, N, K in [(33, 65, 17), (80, 72, 40)]:
        a, b = make_operands(M, N, K, layout, dtype, device)
        for subtile in (False, True):
            out = gk._launch(a, b, poisoned(M, N, dtype, device), False, cfg(use_tma=False, epilogue_subtile=subtile))
            assert snr_db(reference(a, b), out) >= MIN_SNR[dtype]


@pytest.mark.parametrize("in_dtype,out_dtype", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16),
], ids=str)
def test_out_dtype(in_dtype, out_dtype, device):
    a, b = make_operands(64, 129, 127, "NT", in_dtype, device)
    out = gemm_triton(a, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert snr_db(reference(a, b), out) >= min(MIN_SNR[in_dtype], MIN_SNR[out_dtype])
    given = poisoned(64, 129, out_dtype, device)
    assert gemm_triton(a, b, out=given) is given
    assert snr_db(reference(a, b), given) >= min(MIN_SNR[in_dtype], MIN_SNR[out_dtype])


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "ptr"])
def test_strided_out(use_tma, device):
    """A column-major and a padded out are written through masked pointer stores."""
    a, b = make_operands(80, 72, 40, "NN", torch.bfloat16, device)
    col_major = torch.full((72, 80), float("nan"), dtype=torch.float32, device=device).T
    padded = torch.full((80, 75), float("nan"), dtype=torch.float32, device=device)[:, 1:73]
    for out in (col_major, padded):
        gk._launch(a, b, out, False, cfg(use_tma=use_tma))
        assert snr_db(reference(a, b), out) >= MIN_SNR[torch.float32]  # bf16 products, fp32 sums and output


# ---------------------------------------------------------------------------------------------
# Accumulate
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NN", "TN"])
def test_accumulate(out_dtype, layout, device):
    M, N, K = 80, 72, 40
    a, b = make_operands(M, N, K, layout, torch.bfloat16, device)
    out = torch.randn(M, N, device=device).to(out_dtype)
    old = out.double().cpu()
    assert gemm_triton(a, b, out=out, accumulate=True) is out
    ref = reference(a, b)
    assert snr_db(old + ref, out) >= MIN_SNR[out_dtype]
    gemm_triton(a, b, out=out, accumulate=True)  # accumulates again: old + 2 C, not old + C
    assert snr_db(old + 2 * ref, out) >= MIN_SNR[out_dtype]
    assert snr_db(old + ref, out) < 20


@pytest.mark.parametrize("use_tma,subtile", [(True, True), (True, False), (False, True), (False, False)])
def test_accumulate_kernel_variants(use_tma, subtile, device):
    for dtype in (torch.float32, torch.float16):
        a, b = make_operands(33, 65, 17, "NT", dtype, device)
        out = torch.randn(33, 65, device=device)
        old = out.double().cpu()
        gk._launch(a, b, out, True, cfg(use_tma=use_tma, epilogue_subtile=subtile))
        assert snr_db(old + reference(a, b), out) >= 80


# ---------------------------------------------------------------------------------------------
# Descriptor eligibility: misaligned views take the pointer kernel and stay right
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_aligned_operands_take_tma_kernel(layout, device):
    """Row- and column-major operands with 16-byte aligned strides go through descriptors."""
    for dtype in DTYPES:
        a, b = make_operands(128, 96, 64, layout, dtype, device)
        assert gk._uses_tma(a, b, gk.GemmConfig())


def test_misaligned_views_use_pointer_kernel(device):
    M, N, K = 64, 48, 40
    big_a = torch.randn(M + 1, K + 3).to(torch.bfloat16).to(device)
    big_b = torch.randn(K + 2, N + 5).to(torch.bfloat16).to(device)
    a, b = big_a[1:, 3:], big_b[2:, 5:]  # base pointers and row strides not 16-byte aligned
    assert not gk._uses_tma(a, b, cfg())
    assert snr_db(reference(a, b), gemm_triton(a, b, out=poisoned(M, N, torch.bfloat16, device))) >= MIN_SNR[torch.bfloat16]
    # K = 127 in bf16: contiguous, but a row stride of 254 bytes cannot be described
    a2, b2 = make_operands(64, 32, 127, "NN", torch.bfloat16, device)
    assert not gk._uses_tma(a2, b2, cfg())
    # an aligned sub-view (offset and stride multiples of 16 bytes) keeps the TMA kernel
    big = torch.randn(M + 8, K + 16).to(torch.bfloat16).to(device)
    a3 = big[8:, 8:K + 8]
    b3 = torch.randn(N, K).to(torch.bfloat16).to(device).T
    assert gk._uses_tma(a3, b3, cfg())
    assert snr_db(reference(a3, b3), gemm_triton(a3, b3)) >= MIN_SNR[torch.bfloat16]


def test_no_unit_stride_operand(device):
    """Neither dim contiguous (a strided slice in both dims): pointer kernel."""
    big = torch.randn(130, 90, device=device)
    a = big[::2, ::3]  # [65, 30], strides (180, 3)
    b = torch.randn(30, 20, device=device)
    assert not gk._uses_tma(a, b, cfg())
    assert snr_db(reference(a, b), gemm_triton(a, b)) >= MIN_SNR[torch.float32]


# ---------------------------------------------------------------------------------------------
# Empty dimensions
# ---------------------------------------------------------------------------------------------
def test_k_zero(device):
    a = torch.randn(5, 0, device=device, dtype=torch.bfloat16)
    b = torch.randn(0, 7, device=device, dtype=torch.bfloat16)
    out = gemm_triton(a, b, out=poisoned(5, 7, torch.bfloat16, device))
    assert torch.equal(out, torch.zeros(5, 7, dtype=torch.bfloat16, device=device))
    assert torch.equal(gemm_triton(a, b), torch.zeros(5, 7, dtype=torch.bfloat16, device=device))
    acc = torch.randn(5, 7, device=device)
    before = acc.clone()
    gemm_triton(a, b, out=acc, accumulate=True)
    assert torch.equal(acc, before)


@pytest.mark.parametrize("M,N", [(0, 7), (5, 0), (0, 0)])
def test_m_or_n_zero(M, N, device):
    a = torch.randn(M, 4, device=device)
    b = torch.randn(4, N, device=device)
    assert gemm_triton(a, b).shape == (M, N)
    assert gemm_triton(a, b, out=torch.empty(M, N, device=device), accumulate=True).shape == (M, N)


# ---------------------------------------------------------------------------------------------
# Errors and the eligibility check
# ---------------------------------------------------------------------------------------------
def test_errors(device):
    bf = dict(dtype=torch.bfloat16, device=device)
    a, b = torch.randn(8, 64, **bf), torch.randn(64, 16, **bf)
    with pytest.raises(ValueError, match="K mismatch, a has K=64, b has K=65"):
        gemm_triton(a, torch.randn(65, 16, **bf))
    with pytest.raises(TypeError, match="dtype mismatch, a is torch.bfloat16, b is torch.float16"):
        gemm_triton(a, b.half())
    with pytest.raises(ValueError, match="a must be 2-D, got 3-D"):
        gemm_triton(a[None], b)
    with pytest.raises(TypeError, match="b.dtype=torch.int32"):
        gemm_triton(a, b.int())
    with pytest.raises(TypeError, match="a must be a torch.Tensor, got list"):
        gemm_triton([[1.0]], b)
    with pytest.raises(ValueError, match="accumulate=True needs an out tensor"):
        gemm_triton(a, b, accumulate=True)
    with pytest.raises(TypeError, match="accumulate needs out.dtype float32 or torch.bfloat16, got torch.float16"):
        gemm_triton(a, b, out=torch.empty(8, 16, dtype=torch.float16, device=device), accumulate=True)
    with pytest.raises(ValueError, match=r"out has shape \(16, 8\), expected \(8, 16\)"):
        gemm_triton(a, b, out=torch.empty(16, 8, **bf))
    with pytest.raises(ValueError, match="out_dtype=torch.float32 conflicts with out.dtype=torch.bfloat16"):
        gemm_triton(a, b, out=torch.empty(8, 16, **bf), out_dtype=torch.float32)
    with pytest.raises(TypeError, match="out_dtype=torch.int8"):
        gemm_triton(a, b, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="zero stride"):
        gemm_triton(a, b, out=torch.zeros(1, 16, **bf).expand(8, 16))


def test_check_gemm_triton(device):
    a = torch.randn(8, 32, device=device)
    b = torch.randn(32, 4, device=device)
    assert check_gemm_triton(a, b) is None
    assert check_gemm_triton(a.T.contiguous().T, b.T.contiguous().T) is None
    assert check_gemm_triton(a, b, out=torch.empty(8, 4, device=device, dtype=torch.bfloat16)) is None
    assert check_gemm_triton(a.bfloat16(), b.bfloat16(), out=torch.empty(8, 4, device=device), accumulate=True) is None
    reasons = {
        "int32": check_gemm_triton(a.int(), b.int()),
        "3-D": check_gemm_triton(a[None], b),
        "mismatch": check_gemm_triton(a, b.half()),
        "K": check_gemm_triton(a, b[:31]),
        "no out": check_gemm_triton(a, b, accumulate=True),
        "bad out": check_gemm_triton(a.bfloat16(), b.bfloat16(), out=torch.empty(8, 4, device=device).half(), accumulate=True),
        "not a tensor": check_gemm_triton("a", b),
        "None": check_gemm_triton(None, None),
    }
    for case, reason in reasons.items():
        assert isinstance(reason, str) and reason, case
    assert "int32" in reasons["int32"] and "3-D" in reasons["3-D"] and "K=32" in reasons["K"]


def test_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = check_gemm_triton(torch.randn(2, 2), torch.randn(2, 2))
    assert reason is not None and "CUDA" in reason


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------
def test_config_choices(monkeypatch):
    """The analytic defaults (sm_90) and the autotune candidate lists."""
    monkeypatch.setattr(gk, "is_interpreter", lambda: False)
    for dtype in DTYPES:
        for accumulate in (False, True):
            for tma in (False, True):
                for M, N in [(1, 1), (64, 4096), (4096, 64), (4096, 4096), (16384, 128256), (256, 256)]:
                    c = gk._default_config(M, N, 4096, dtype, accumulate, 132, tma)
                    assert all(v & (v - 1) == 0 for v in (c.block_m, c.block_n, c.block_k)), c
                    assert tma or not c.use_tma
                    candidates = gk._candidate_configs(M, N, dtype, c)
                    assert candidates[0] == c and len(set(candidates)) == len(candidates)
                    assert all(x.use_tma == c.use_tma for x in candidates[1:]) or c.use_tma
    big = gk._default_config(4096, 4096, 4096, torch.bfloat16, False, 132)
    assert (big.block_m, big.block_n, big.block_k, big.num_warps, big.use_tma) == (128, 256, 64, 8, True)
    # exact fp32 runs on the pointer kernel (FMA dot from transposed TMA tiles spills)
    assert not gk._default_config(4096, 4096, 4096, torch.float32, False, 132).use_tma
    assert gk._default_config(4096, 4096, 4096, torch.float32, False, 132, tf32=True).use_tma


# The analytic defaults run without autotune, so each must compile for sm_90 and fit its 227 KiB of
# shared memory without spilling. Triton compiles for a named target without a GPU (its ptxas ships
# in the wheel), but not from interpreter-mode kernels: the check runs in a subprocess without
# TRITON_INTERPRET.
_SM90_COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from primus_turbo.triton.gemm import gemm_kernel as gk

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
results = []
for dt, out, acc, layout, M, N, tma, tf32 in json.loads(sys.argv[1]):
    cfg = gk._default_config(M, N, 4096, DT[dt], acc, 132, tma, tf32)
    kernel = gk._gemm_persistent_tma_kernel if cfg.use_tma and tma else gk._gemm_persistent_ptr_kernel
    ones = {"stride_cn"}
    if kernel is gk._gemm_persistent_ptr_kernel:
        ones |= {"stride_am" if layout[0] == "T" else "stride_ak", "stride_bk" if layout[1] == "T" else "stride_bn"}
    ptr_ty = {"a_ptr": "*" + dt, "b_ptr": "*" + dt, "c_ptr": "*" + out}
    const = dict(NUM_SMS=132, ACCUMULATE=acc, DOT_PRECISION="ieee" if dt == "fp32" and not tf32 else "tf32",
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 EPILOGUE_SUBTILE=cfg.epilogue_subtile, FLATTEN=cfg.flatten)
    if kernel is gk._gemm_persistent_tma_kernel:
        const.update(A_COL=layout[0] == "T", B_COL=layout[1] == "T", C_TMA=True, WARP_SPECIALIZE=cfg.warp_specialize)
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if i in kernel.constexprs or name in ones:
            sig[name] = "constexpr"
            const.setdefault(name, 1)
        else:
            sig[name] = ptr_ty.get(name, "i32")
            # aligned pointers and leading strides; an untuned pointer-kernel case is unaligned
            if tma or name in ("c_ptr", "stride_cm"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx = compiled.asm["ptx"]
    spill = None
    if os.path.exists(PTXAS):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True).stderr
        os.unlink(f.name)
        found = re.search(r"(\d+) bytes spill stores", log)
        spill = int(found.group(1)) if found else None
    results.append(dict(case=[dt, out, acc, layout, M, N, tma, tf32], config=cfg.short(), smem=compiled.metadata.shared,
                        spill=spill, wgmma="wgmma" in ptx, tma_ops="cp.async.bulk.tensor" in ptx))
print("RESULTS " + json.dumps(results))
"""

_SM90_CASES = [  # (in, out, accumulate, layout, M, N, tma eligible, tf32)
    ("bf16", "bf16", False, "NN", 4096, 4096, True, False),
    ("bf16", "fp32", True, "TT", 4096, 4096, True, False),
    ("fp16", "fp32", False, "TN", 4096, 4096, True, False),
    ("bf16", "fp32", True, "NT", 64, 4096, True, False),
    ("bf16", "fp32", True, "NN", 4096, 64, True, False),
    ("bf16", "fp32", True, "NN", 1024, 1024, True, False),
    ("bf16", "fp32", True, "TT", 4096, 4096, False, False),
    ("fp32", "fp32", True, "NT", 4096, 4096, True, False),
    ("fp32", "fp32", False, "TT", 32, 4096, True, False),
    ("fp32", "fp32", True, "TT", 4096, 4096, True, True),
]
_SM90_CASES_SLOW = [
    (dt, out, acc, layout, M, N, tma, False)
    for dt, out in [("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")] for acc in (False, True) for layout in LAYOUTS
    for M, N in [(4096, 4096), (64, 4096), (4096, 128), (4096, 64), (1024, 1024)] for tma in (True, False)
    if not (dt == "fp32" and not tma)  # fp32 takes the pointer kernel either way
]


def _compile_sm90(cases):
    import json
    import os
    import subprocess
    import sys

    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception as exc:  # pragma: no cover - wheel without the NVIDIA backend
        pytest.skip(f"triton NVIDIA backend unavailable: {exc}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SM90_COMPILE_SCRIPT, json.dumps(cases)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    for r in results:
        dt = r["case"][0]
        assert r["smem"] <= 227 * 1024, r
        assert r["spill"] in (0, None), r
        assert r["wgmma"] or (dt == "fp32" and not r["case"][7]), r  # only exact fp32 runs on FMAs
        assert r["tma_ops"] == (" tma" in r["config"] and r["case"][6]), r


def test_default_configs_compile_for_sm90():
    _compile_sm90(_SM90_CASES)


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~200 sm_90 compiles in one child: past 110 s beside 13 busy workers on the H200 machine
def test_all_default_configs_compile_for_sm90():
    _compile_sm90(_SM90_CASES_SLOW)


def test_autotune_never_touches_accumulation_target(monkeypatch):
    """_tune times candidates on a scratch output when accumulating, skips failing ones, keeps the fastest."""
    import triton.testing

    candidates = [cfg(block_m=64), cfg(block_m=32), cfg(block_m=16), cfg(block_m=128)]
    fake_ms = {64: 3.0, 32: 1.0, 16: 0.5, 128: 2.0}
    launched = []  # (config, output pointer) of every trial launch

    def fake_launch(a, b, out, accumulate, config, allow_tf32=False):
        if config.block_m == 16:
            raise RuntimeError("out of resources")  # the "fastest" fails to compile: must be skipped
        launched.append((config, out.data_ptr()))
        return out.add_(1.0)

    def fake_bench(fn, **kwargs):
        n = len(launched)
        fn()
        fn()
        return fake_ms[launched[n][0].block_m]

    monkeypatch.setattr(gk, "_launch", fake_launch)
    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    a, b = torch.randn(8, 4), torch.randn(4, 8)
    out = torch.randn(8, 8)
    before = out.clone()
    best, ms = gk._tune(a, b, out, True, False, candidates)
    assert (best.block_m, ms) == (32, 1.0)
    assert torch.equal(out, before) and all(ptr != out.data_ptr() for _, ptr in launched)
    # without accumulate the output is simply reused (the real launch overwrites it)
    launched.clear()
    gk._tune(a, b, out, False, False, candidates)
    assert {ptr for _, ptr in launched} == {out.data_ptr()}


def test_print_configs_logs(monkeypatch, caplog, device):
    monkeypatch.setenv("PRIMUS_TURBO_PRINT_CONFIGS", "1")
    gk._logged.clear()
    from primus_turbo.pytorch.core.logging import get_logger

    get_logger()  # configure it first: its first call sets the level from PRIMUS_TURBO_LOG_LEVEL
    with caplog.at_level(logging.INFO, logger="primus_turbo"):
        gemm_triton(torch.randn(17, 9, device=device), torch.randn(9, 5, device=device))
    assert any("gemm_triton" in r.getMessage() and "config" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_4096_bf16(layout, monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE", "1")
    a, b = make_operands(4096, 4096, 4096, layout, torch.bfloat16, "cuda")
    out = gemm_triton(a, b)
    ref = (a.double() @ b.double()).cpu()
    assert snr_db(ref, out) >= 45.0
    acc = torch.randn(4096, 4096, device="cuda")
    old = acc.double().cpu()
    gemm_triton(a, b, out=acc, accumulate=True)  # autotune must not disturb the accumulation target
    assert snr_db(old + ref, acc) >= 80


@pytest.mark.gpu
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "ptr"])
def test_gpu_int64_offsets(use_tma):
    """An output of more than 2**31 elements: the last rows land past the int32 range."""
    M, N, K = 16400, 131072, 32
    a, b = make_operands(M, N, K, "NN", torch.bfloat16, "cuda")
    out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    gk._launch(a, b, out, False, dataclasses.replace(gk._default_config(M, N, K, torch.bfloat16, False, 132),
                                                    use_tma=use_tma))
    tail = (a[-64:].float() @ b.float()).cpu()
    assert snr_db(tail, out[-64:]) >= 45.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only behaviour")
def test_bf16_refused_under_interpreter_until_fixed(monkeypatch):
    """Without the opt-in repair, bf16 under the interpreter is refused, never silently wrong."""
    from triton.runtime import interpreter

    from primus_turbo.triton import interpreter as pt_interp

    monkeypatch.setattr(interpreter.InterpreterBuilder, pt_interp._MARK, False)
    a = torch.randn(8, 16, dtype=torch.bfloat16)
    b = torch.randn(16, 8, dtype=torch.bfloat16)
    assert "triton issue #11584" in gk.check_gemm_triton(a, b)
    with pytest.raises(ValueError, match="fix_bf16_dot"):
        gk.gemm_triton(a, b)
    assert gk.check_gemm_triton(a.half(), b.half()) is None  # fp16 is fine as is
    monkeypatch.setattr(interpreter.InterpreterBuilder, pt_interp._MARK, True)
    assert gk.check_gemm_triton(a, b) is None
