"""gemm_fp8_triton against a float64 reference on the dequantized operands: every scale mode and
FP8 dtype pair, tails, accumulate, the pointer twin, scale validation and errors.

The reference is ``dequant(A) @ dequant(B).T`` in float64, so the only error left is the fp32
accumulation order and the output rounding: >= 80 dB for fp32 output on CPU. On Hopper the FP8
tensor-core MMA accumulates with fewer bits than fp32 (about 14 mantissa bits inside one wgmma
K-chunk, the reason DeepGEMM promotes to fp32 registers), measured 75-80 dB here, so the GPU bar
for fp32 output is 70 dB. bf16 output: >= 45 dB on GPU;
the Triton interpreter casts fp32 -> bf16 by truncation instead of rounding (see
test_gemm_kernel.py), which costs ~6 dB, so the CPU bar is 41 dB. On CPU every kernel runs in the
interpreter with small tiles (32x32, BLOCK_K 128 for BLOCKWISE, 64 for MX) and 3 persistent
programs, so the multi-tile shapes below take the persistent loop several turns.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.gemm import gemm_fp8_kernel as fk  # noqa: E402
from primus_turbo.triton.gemm.gemm_fp8_kernel import check_gemm_fp8_triton, gemm_fp8_triton  # noqa: E402
from tests.fp8_quant_helpers import E4M3, E5M2, E8M0, dequantize, quantize  # noqa: E402

_ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

MODES = ["TENSORWISE", "ROWWISE", "BLOCKWISE", "MX_BLOCKWISE"]
DTYPE_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)]
FP32_DB = 70.0 if _ON_GPU else 80.0
MIN_SNR = {torch.float32: FP32_DB, torch.bfloat16: 45.0 if _ON_GPU else 41.0, torch.float16: 50.0}
# (M, N, K): tails in M and N everywhere, K tails (not for MX, whose K is a multiple of 32)
SHAPES = {
    "TENSORWISE": [(70, 90, 200), (64, 96, 64)],
    "ROWWISE": [(70, 90, 200), (64, 96, 64)],
    "BLOCKWISE": [(70, 90, 200), (48, 160, 256)],
    "MX_BLOCKWISE": [(70, 90, 192), (64, 96, 96)],
}


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE", "0")


def snr_db(ref, out):
    from primus_turbo.testing import snr_db as _snr

    return _snr(ref.double().cpu(), out.double().cpu())


def operands(M, N, K, mode, a_dtype=E4M3, b_dtype=E4M3, device="cpu", b_weight=True, block=128):
    """Quantized A [M, K] (activation groups) and B [N, K] (weight blocks when b_weight)."""
    a = torch.randn(M, K) * 3
    b = torch.randn(N, K) / 2
    a_q, sa = quantize(a, mode, a_dtype, weight=False, block=block)
    b_q, sb = quantize(b, mode, b_dtype, weight=b_weight, block=block)
    ref = dequantize(a_q, sa, mode, block) @ dequantize(b_q, sb, mode, block).T
    return [t.to(device) for t in (a_q, sa, b_q, sb)], ref


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=lambda p: f"{str(p[0])[-5:]}x{str(p[1])[-5:]}")
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_reference(mode, pair, device):
    for i, (M, N, K) in enumerate(SHAPES[mode]):
        (a_q, sa, b_q, sb), ref = operands(M, N, K, mode, *pair, device=device)
        out_dtype = torch.float32 if i == 0 else torch.bfloat16
        out = gemm_fp8_triton(a_q, sa, b_q, sb, mode, out_dtype=out_dtype)
        assert out.shape == (M, N) and out.dtype == out_dtype
        assert snr_db(ref, out) >= MIN_SNR[out_dtype], (mode, M, N, K, out_dtype)


@pytest.mark.parametrize("mode", MODES)
def test_fp16_output_and_default_dtype(mode, device):
    (a_q, sa, b_q, sb), ref = operands(40, 72, 64, mode, device=device)
    out = gemm_fp8_triton(a_q, sa, b_q, sb, mode)
    assert out.dtype == torch.bfloat16
    out = gemm_fp8_triton(a_q, sa, b_q, sb, mode, out_dtype=torch.float16)
    assert out.dtype == torch.float16 and snr_db(ref, out) >= MIN_SNR[torch.float16]


def test_blockwise_scale_geometries(device):
    """B with 1x128 groups (wgrad: an activation as B), A with 128x128 blocks, and block_size 64."""
    M, N, K = 130, 72, 320
    (a_q, sa, b_q, sb), ref = operands(M, N, K, "BLOCKWISE", device=device, b_weight=False)
    assert sb.shape == (N, 3)
    assert snr_db(ref, gemm_fp8_triton(a_q, sa, b_q, sb, "BLOCKWISE", out_dtype=torch.float32)) >= FP32_DB
    # A as 128x128 blocks (both operands weight-like)
    a = torch.randn(M, K)
    a_q2, sa2 = quantize(a, "BLOCKWISE", E4M3, weight=True)
    b_q2, sb2 = quantize(torch.randn(N, K), "BLOCKWISE", E5M2, weight=True)
    ref2 = dequantize(a_q2, sa2, "BLOCKWISE") @ dequantize(b_q2, sb2, "BLOCKWISE").T
    assert sa2.shape == (2, 3)
    out2 = gemm_fp8_triton(a_q2.to(device), sa2.to(device), b_q2.to(device), sb2.to(device), "BLOCKWISE",
                           out_dtype=torch.float32)
    assert snr_db(ref2, out2) >= FP32_DB
    # 64-wide blocks: BLOCK_K shrinks to divide the block
    (a_q3, sa3, b_q3, sb3), ref3 = operands(M, N, K, "BLOCKWISE", device=device, block=64)
    assert sa3.shape == (M, 5) and sb3.shape == (2, 5)
    out3 = gemm_fp8_triton(a_q3, sa3, b_q3, sb3, "BLOCKWISE", out_dtype=torch.float32, block_size=64)
    assert snr_db(ref3, out3) >= FP32_DB


def test_blockwise_scales_are_applied_per_block(device):
    """Scales that differ by 2**20 between K blocks: a kernel applying one scale per tile fails."""
    M, N, K = 32, 32, 256
    a_q = torch.randn(M, K).clamp(-4, 4).to(E4M3)
    b_q = torch.randn(N, K).clamp(-4, 4).to(E4M3)
    sa = torch.tensor([[1.0, 2.0 ** -20]]).repeat(M, 1)
    sa[5] = torch.tensor([3.0, 0.5])
    sb = torch.tensor([[2.0 ** 10, 1.0]])
    deq_a = a_q.double() * sa.double().repeat_interleave(128, 1)
    deq_b = b_q.double() * sb.double().repeat_interleave(128, 1)
    out = gemm_fp8_triton(a_q.to(device), sa.to(device), b_q.to(device), sb.to(device), "BLOCKWISE",
                          out_dtype=torch.float32)
    assert snr_db(deq_a @ deq_b.T, out) >= FP32_DB


def test_mx_scale_extremes(device):
    """E8M0 bytes 0 (2**-127), 254 (2**127) on small values, and 255 (NaN: the row turns NaN)."""
    M, N, K = 8, 16, 64
    a_q = torch.full((M, K), 0.5).to(E4M3)
    b_q = torch.full((N, K), 1.0).to(E4M3)
    ea = torch.full((M, 2), 127, dtype=torch.uint8)
    eb = torch.full((N, 2), 127, dtype=torch.uint8)
    ea[1, 0] = 0  # 0.5 * 2**-127 = 2**-128 (subnormal in fp32 and bf16, still exact)
    ea[1, 1] = 127 + 100
    eb[2, 1] = 127 + 20
    ea[3, 1] = 255  # NaN
    out = gemm_fp8_triton(a_q.to(device), ea.view(E8M0).to(device), b_q.to(device), eb.view(E8M0).to(device),
                          "MX_BLOCKWISE", out_dtype=torch.float32).cpu()
    # out[i, j] = sum over the two K groups of 32 * 0.5 * 1 * 2**(ea[i, g] - 127) * 2**(eb[j, g] - 127)
    pa = torch.exp2(ea.double() - 127)
    pb = torch.exp2(eb.double() - 127)
    expected = 16 * (pa[:, None, 0] * pb[None, :, 0] + pa[:, None, 1] * pb[None, :, 1])
    assert expected[1, 2] == 16 * (2.0 ** -127 + 2.0 ** 120)
    assert torch.isnan(out[3]).all() and torch.isfinite(out[torch.arange(M) != 3]).all()
    keep = torch.arange(M) != 3
    assert torch.allclose(out[keep].double(), expected[keep], rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_accumulate_twice(mode, acc_dtype, device):
    M, N, K = 40, 72, 128
    (a_q, sa, b_q, sb), ref = operands(M, N, K, mode, E5M2, E4M3, device=device)
    start = torch.randn(M, N).to(acc_dtype)
    out = start.clone().to(device)
    for _ in range(2):
        res = gemm_fp8_triton(a_q, sa, b_q, sb, mode, out=out, accumulate=True)
        assert res is out
    expected = start.double() + 2 * ref
    assert snr_db(expected, out) >= (FP32_DB if acc_dtype == torch.float32 else 38.0)


@pytest.mark.parametrize("mode", MODES)
def test_misaligned_views_use_pointer_kernel(mode, device, monkeypatch):
    """Sub-views with unaligned base / leading stride, and a non-K-contiguous A, run the twin."""
    M, N, K = 36, 40, 96
    (a_q, sa, b_q, sb), ref = operands(M, N, K, mode, device=device)
    big_a = torch.zeros(M + 1, K + 3, dtype=a_q.dtype, device=device)
    big_a[1:, 1:K + 1] = a_q
    a_view = big_a[1:, 1:K + 1]
    a_col = a_q.t().contiguous().t()  # K stride M: no unit K stride
    launched = []
    orig_ptr = fk._gemm_fp8_ptr_kernel
    orig_tma = fk._gemm_fp8_tma_kernel

    class _Spy:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(fk, "_gemm_fp8_ptr_kernel", _Spy(orig_ptr, "ptr"))
    monkeypatch.setattr(fk, "_gemm_fp8_tma_kernel", _Spy(orig_tma, "tma"))
    for a in (a_view, a_col):
        out = gemm_fp8_triton(a, sa, b_q, sb, mode, out_dtype=torch.float32)
        assert snr_db(ref, out) >= FP32_DB
    assert launched == ["ptr", "ptr"]
    out = gemm_fp8_triton(a_q, sa, b_q, sb, mode, out_dtype=torch.float32)
    assert launched[-1] == "tma" and snr_db(ref, out) >= FP32_DB
    # a column-major (strided) output takes pointer stores inside the TMA kernel
    out_t = torch.empty(N, M, device=device).t()
    gemm_fp8_triton(a_q, sa, b_q, sb, mode, out=out_t)
    assert snr_db(ref, out_t) >= FP32_DB


def test_forced_pointer_config_and_subtile_variants(device):
    (a_q, sa, b_q, sb), ref = operands(50, 70, 160, "TENSORWISE", device=device)
    base = fk._default_config(50, 70, 160, fk._TENSORWISE, False, 3, True)
    for cfg in (dataclasses.replace(base, use_tma=False), dataclasses.replace(base, epilogue_subtile=False),
                dataclasses.replace(base, flatten=False)):
        out = torch.full((50, 70), float("nan"), device=device)
        mode, ga, gb = fk._validate(a_q, sa, b_q, sb, "TENSORWISE", out, None, False, 128)
        fk._launch(a_q, sa, b_q, sb, mode, ga, gb, out, False, cfg)
        assert snr_db(ref, out) >= FP32_DB, cfg


def test_scale_layouts_accepted(device):
    """ROWWISE scales as [M, 1], [M] or [1, M] (a transposed copy's scale), strided views too."""
    M, N, K = 24, 40, 64
    (a_q, sa, b_q, sb), ref = operands(M, N, K, "ROWWISE", device=device)
    for sa_v, sb_v in ((sa.reshape(-1), sb.reshape(1, -1)), (sa.t(), sb),
                       (torch.cat([sa, sa], 1)[:, :1], sb.reshape(-1))):
        out = gemm_fp8_triton(a_q, sa_v, b_q, sb_v, "ROWWISE", out_dtype=torch.float32)
        assert snr_db(ref, out) >= FP32_DB
    # BLOCKWISE scales as a transposed view (the weight's transposed copy reuses the scales)
    (a_q, sa, b_q, sb), ref = operands(M, 200, 300, "BLOCKWISE", device=device)
    sb_t = sb.t().contiguous().t()
    out = gemm_fp8_triton(a_q, sa, b_q, sb_t, "BLOCKWISE", out_dtype=torch.float32)
    assert snr_db(ref, out) >= FP32_DB


def test_empty_problems(device):
    (a_q, sa, b_q, sb), _ = operands(8, 16, 32, "TENSORWISE", device=device)
    assert gemm_fp8_triton(a_q[:0], sa, b_q, sb, "TENSORWISE").shape == (0, 16)
    z = gemm_fp8_triton(a_q[:, :0], sa, b_q[:, :0], sb, "TENSORWISE", out_dtype=torch.float32)
    assert torch.equal(z, torch.zeros(8, 16, device=device))
    acc = torch.ones(8, 16, device=device)
    gemm_fp8_triton(a_q[:, :0], sa, b_q[:, :0], sb, "TENSORWISE", out=acc, accumulate=True)
    assert torch.equal(acc, torch.ones(8, 16, device=device))


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def test_bad_scale_shapes_rejected(device):
    M, N, K = 16, 24, 64
    a_q = torch.zeros(M, K, device=device).to(E4M3)
    b_q = torch.zeros(N, K, device=device).to(E4M3)
    f32 = dict(device=device, dtype=torch.float32)
    cases = [
        ("TENSORWISE", torch.ones(2, **f32), torch.ones((), **f32), "TENSORWISE scale must hold one value"),
        ("ROWWISE", torch.ones(M, 2, **f32), torch.ones(N, 1, **f32), r"a_scale: ROWWISE scales must have shape \[16, 1\]"),
        ("ROWWISE", torch.ones(M, 1, **f32), torch.ones(M, 1, **f32), r"b_scale: ROWWISE .*\[24, 1\]"),
        ("BLOCKWISE", torch.ones(M, 2, **f32), torch.ones(1, 1, **f32), r"a_scale: BLOCKWISE scales must have shape \[16, 1\]"),
        ("BLOCKWISE", torch.ones(M, 1, **f32), torch.ones(2, 1, **f32), r"b_scale: BLOCKWISE .*\[24, 1\] .* or \[1, 1\]"),
        ("MX_BLOCKWISE", torch.ones(M, 1, device=device).to(E8M0), torch.ones(N, 2, device=device).to(E8M0),
         r"a_scale: MX_BLOCKWISE scales must have shape \[rows, K/32\] = \[16, 2\]"),
        ("MX_BLOCKWISE", torch.ones(M, 2, **f32), torch.ones(N, 2, **f32), "must be float8_e8m0fnu"),
        ("TENSORWISE", torch.ones((), device=device, dtype=torch.float64), torch.ones((), **f32), "must be float32"),
        ("ROWWISE", [1.0], torch.ones(N, 1, **f32), "a_scale must be a torch.Tensor"),
    ]
    for mode, sa, sb, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            gemm_fp8_triton(a_q, sa, b_q, sb, mode)
        reason = check_gemm_fp8_triton(a_q, sa, b_q, sb, mode)
        assert reason is not None and reason


def test_errors(device):
    a_q = torch.zeros(16, 64, device=device).to(E4M3)
    b_q = torch.zeros(24, 64, device=device).to(E4M3)
    s = torch.ones((), device=device)
    with pytest.raises(TypeError, match="a.dtype=torch.bfloat16 is not float8"):
        gemm_fp8_triton(a_q.to(torch.bfloat16), s, b_q, s, "TENSORWISE")
    with pytest.raises(ValueError, match=r"K mismatch: a is \[M, K\] = \[16, 64\], b is \[N, K\] = \[24, 32\]"):
        gemm_fp8_triton(a_q, s, b_q[:, :32], s, "TENSORWISE")
    with pytest.raises(ValueError, match="b must be 2-D"):
        gemm_fp8_triton(a_q, s, b_q[0], s, "TENSORWISE")
    with pytest.raises(ValueError, match="mode='COLWISE' is not one of"):
        gemm_fp8_triton(a_q, s, b_q, s, "COLWISE")
    with pytest.raises(ValueError, match="MX_BLOCKWISE needs K to be a multiple of 32, got K=48"):
        gemm_fp8_triton(a_q[:, :48], s, b_q[:, :48], s, "MX_BLOCKWISE")
    with pytest.raises(ValueError, match=r"out has shape \(16, 16\), expected \(16, 24\)"):
        gemm_fp8_triton(a_q, s, b_q, s, "TENSORWISE", out=torch.empty(16, 16, device=device))
    with pytest.raises(TypeError, match="out.dtype=torch.int32"):
        gemm_fp8_triton(a_q, s, b_q, s, "TENSORWISE", out=torch.empty(16, 24, device=device, dtype=torch.int32))
    with pytest.raises(ValueError, match="accumulate=True needs an out tensor"):
        gemm_fp8_triton(a_q, s, b_q, s, "TENSORWISE", accumulate=True)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        gemm_fp8_triton(a_q, torch.ones(16, 1, device=device), b_q, torch.ones(1, 1, device=device), "BLOCKWISE",
                        block_size=96)
    with pytest.raises(TypeError, match="out_dtype=torch.int8"):
        gemm_fp8_triton(a_q, s, b_q, s, "TENSORWISE", out_dtype=torch.int8)
    # the check never raises, whatever it is given
    assert check_gemm_fp8_triton(None, None, None, None, None)
    assert check_gemm_fp8_triton(a_q, s, b_q, s, "TENSORWISE") is None
    assert "a must be a torch.Tensor" in check_gemm_fp8_triton([1], s, b_q, s, "TENSORWISE")


def test_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setattr(fk, "is_interpreter", lambda: False)
    a_q = torch.zeros(4, 32).to(E4M3)
    reason = check_gemm_fp8_triton(a_q, torch.ones(()), a_q, torch.ones(()), "TENSORWISE")
    assert reason is not None and "CUDA" in reason


def test_mx_refused_under_interpreter_until_bf16_fixed(monkeypatch):
    monkeypatch.setattr(fk, "bf16_dot_fixed", lambda: False)
    if _ON_GPU:
        pytest.skip("interpreter only")
    a_q = torch.zeros(4, 32).to(E4M3)
    e = torch.full((4, 1), 127, dtype=torch.uint8).view(E8M0)
    reason = check_gemm_fp8_triton(a_q, e, a_q, e, "MX_BLOCKWISE")
    assert reason is not None and "fix_bf16_dot" in reason


# ---------------------------------------------------------------------------------------------
# Configs and autotune
# ---------------------------------------------------------------------------------------------
def test_config_choices(monkeypatch):
    monkeypatch.setattr(fk, "is_interpreter", lambda: False)
    for mode in range(4):
        for accumulate in (False, True):
            for tma in (False, True):
                for M, N in [(1, 1), (64, 4096), (4096, 64), (4096, 4096), (16384, 128256), (256, 256)]:
                    c = fk._default_config(M, N, 4096, mode, accumulate, 132, tma)
                    assert all(v & (v - 1) == 0 for v in (c.block_m, c.block_n, c.block_k)), c
                    assert tma or not c.use_tma
                    if mode == fk._BLOCKWISE:
                        assert 128 % c.block_k == 0 and (c.block_k == 128 or not tma)
                    if mode == fk._MX:
                        assert c.block_k % 32 == 0
                    cands = fk._candidate_configs(M, N, mode, c, 128)
                    assert cands[0] == c and len(set(cands)) == len(cands)
    big = fk._default_config(4096, 4096, 4096, fk._TENSORWISE, False, 132, True)
    assert (big.block_m, big.block_n, big.block_k, big.num_warps) == (128, 256, 128, 8)
    blk = fk._default_config(4096, 4096, 4096, fk._BLOCKWISE, False, 132, True)
    assert (blk.block_m, blk.block_n, blk.block_k) == (128, 128, 128)
    # BLOCK_K follows a smaller BLOCKWISE block
    assert fk._fit_block_k(blk, fk._BLOCKWISE, 64).block_k == 64


def test_autotune_never_touches_accumulation_target(monkeypatch):
    import triton.testing

    candidates = [fk._CANDIDATES[0][0], fk._CANDIDATES[0][3], fk._CANDIDATES[0][4]]
    fake_ms = {candidates[0]: 3.0, candidates[1]: 1.0, candidates[2]: 0.5}
    launched = []

    def fake_launch(a, sa, b, sb, mode, ga, gb, out, accumulate, config, block_size=128, layout=None):
        if config is candidates[2]:
            raise RuntimeError("out of resources")
        launched.append((config, out.data_ptr()))
        return out.add_(1.0)

    def fake_bench(fn, **kwargs):
        n = len(launched)
        fn()
        return fake_ms[launched[n][0]]

    monkeypatch.setattr(fk, "_launch", fake_launch)
    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    out = torch.randn(8, 8)
    before = out.clone()
    best, ms = fk._tune(None, None, None, None, 0, None, None, out, True, 128, None, candidates)
    assert (best, ms) == (candidates[1], 1.0)
    assert torch.equal(out, before) and all(ptr != out.data_ptr() for _, ptr in launched)


# The analytic defaults run untuned, so each must compile for sm_90 with FP8 (or, for MX, bf16)
# wgmma, fit 227 KiB of shared memory and not spill. Compiled for a named target in a subprocess
# without TRITON_INTERPRET (as test_gemm_kernel.py does for the dense kernel).
_SM90_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from primus_turbo.triton.gemm import gemm_fp8_kernel as fk

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
results = []
for mode, M, N, acc, out, a_dt, b_dt, tma, brows in json.loads(sys.argv[1]):
    cfg = fk._default_config(M, N, 4096, mode, acc, 132, tma, 128, mode == 2 and brows == 1)
    kernel = fk._gemm_fp8_tma_kernel if cfg.use_tma and tma else fk._gemm_fp8_ptr_kernel
    sdt = "*u8" if mode == 3 else "*fp32"
    ptr_ty = {"a_ptr": "*" + a_dt, "b_ptr": "*" + b_dt, "c_ptr": "*" + out, "sa_ptr": sdt, "sb_ptr": sdt}
    const = dict(NUM_SMS=132, SCALE_MODE=mode, SCALE_BLOCK=128, A_SCALE_ROWS=1, B_SCALE_ROWS=brows, ACCUMULATE=acc,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 EPILOGUE_SUBTILE=cfg.epilogue_subtile, FLATTEN=cfg.flatten)
    ones = {"stride_cn"}
    if kernel is fk._gemm_fp8_tma_kernel:
        const.update(C_TMA=True, WARP_SPECIALIZE=cfg.warp_specialize)
    else:
        ones |= {"stride_ak", "stride_bk"}
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if i in kernel.constexprs or name in ones:
            sig[name] = "constexpr"
            const.setdefault(name, 1)
        else:
            sig[name] = ptr_ty.get(name, "i32")
            if (tma and not name.startswith("stride_s")) or name in ("c_ptr", "stride_cm"):
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
    wgmma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.f32\.(\w+)\.(\w+)", ptx)))
    results.append(dict(case=[mode, M, N, acc, out, a_dt, b_dt, tma, brows], config=cfg.short(),
                        smem=compiled.metadata.shared, spill=spill, wgmma=wgmma, tma_ops="cp.async.bulk.tensor" in ptx))
print("RESULTS " + json.dumps(results))
"""

_SM90_CASES = [  # (mode, M, N, accumulate, out, a dtype, b dtype, TMA eligible, B scale rows)
    (0, 4096, 4096, False, "bf16", "fp8e4nv", "fp8e4nv", True, 1),
    (0, 4096, 4096, True, "fp32", "fp8e5", "fp8e4nv", True, 1),
    (1, 4096, 4096, True, "fp32", "fp8e4nv", "fp8e4nv", True, 1),
    (1, 64, 4096, False, "bf16", "fp8e4nv", "fp8e4nv", True, 1),
    (2, 4096, 4096, False, "bf16", "fp8e4nv", "fp8e4nv", True, 128),
    (2, 4096, 4096, True, "fp32", "fp8e5", "fp8e4nv", True, 1),
    (2, 4096, 4096, False, "bf16", "fp8e5", "fp8e4nv", True, 1),
    (3, 4096, 4096, False, "bf16", "fp8e4nv", "fp8e4nv", True, 1),
    (3, 4096, 4096, True, "fp32", "fp8e5", "fp8e4nv", True, 1),
    (0, 4096, 4096, True, "fp32", "fp8e4nv", "fp8e4nv", False, 1),
    (2, 4096, 4096, True, "fp32", "fp8e4nv", "fp8e4nv", False, 1),
    (3, 4096, 4096, True, "fp32", "fp8e4nv", "fp8e4nv", False, 1),
]
_FP8_NAMES = {"fp8e4nv": "e4m3", "fp8e5": "e5m2"}


def test_default_configs_compile_for_sm90():
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
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, json.dumps(_SM90_CASES)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in json.loads(proc.stdout.split("RESULTS ", 1)[1]):
        mode, a_dt, b_dt, tma = r["case"][0], r["case"][5], r["case"][6], r["case"][7]
        assert r["smem"] <= 227 * 1024, r
        assert r["spill"] in (0, None), r
        # FP8 operands straight into wgmma (mixed E5M2 x E4M3 too); MX as exact bf16
        want = ["bf16", "bf16"] if mode == 3 else [_FP8_NAMES[a_dt], _FP8_NAMES[b_dt]]
        assert r["wgmma"] == [want], r
        assert r["tma_ops"] == tma, r


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes, and torch._scaled_mm as a peer
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("pair", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3xe4m3", "e5m2xe4m3"])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_4096(mode, pair, monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE", "1")
    M = N = K = 4096
    (a_q, sa, b_q, sb), ref = operands(M, N, K, mode, *pair, device="cuda")
    # TENSORWISE/ROWWISE accumulate a whole K in the FP8 wgmma's reduced-precision accumulator
    # (Triton's sm_90 default, like _scaled_mm's use_fast_accum=True); BLOCKWISE promotes every
    # 128 and MX runs exact bf16 products: their bars are the exact-accumulation ones.
    exact = mode in ("BLOCKWISE", "MX_BLOCKWISE")
    out = gemm_fp8_triton(a_q, sa, b_q, sb, mode, out_dtype=torch.bfloat16)
    assert snr_db(ref, out) >= (45.0 if exact else 40.0)
    out32 = gemm_fp8_triton(a_q, sa, b_q, sb, mode, out_dtype=torch.float32)
    assert snr_db(ref, out32) >= (70.0 if exact else 40.0)
    acc = torch.randn(M, N, device="cuda")
    start = acc.clone()
    gemm_fp8_triton(a_q, sa, b_q, sb, mode, out=acc, accumulate=True)
    assert snr_db(start.double().cpu() + ref, acc) >= (60.0 if exact else 40.0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["TENSORWISE", "ROWWISE"])
def test_gpu_matches_scaled_mm(mode):
    M, N, K = 4096, 4096, 4096
    (a_q, sa, b_q, sb), ref = operands(M, N, K, mode, device="cuda")
    if mode == "TENSORWISE":
        peer = torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    else:
        peer = torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb.reshape(1, -1), out_dtype=torch.bfloat16)
    ours = gemm_fp8_triton(a_q, sa, b_q, sb, mode, out_dtype=torch.bfloat16)
    # _scaled_mm defaults to split (promoted) accumulation; ours accumulates fast (see test_gpu_4096)
    assert snr_db(ref, ours) >= snr_db(ref, peer) - 6.0
    assert snr_db(peer.double(), ours) >= 40.0
