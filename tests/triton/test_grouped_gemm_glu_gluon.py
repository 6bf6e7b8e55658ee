"""The fused fc1 + gated activation Gluon kernel (triton/grouped_gemm/grouped_gemm_glu_gluon.py) and
``turbo.ops.grouped_gemm_glu``.

On CPU: the operand reasons, the op's path choice (fused only where the kernel can run and the rule
gives the GEMM to Gluon) with a mocked platform, and that the launcher's own arguments bind and compile
for sm_90 without spills or serialized wgmmas, with one m64n256 wgmma chain and the TMA loads / stores
expected. On an sm_90 GPU: ``h`` bit-equal to the 16-bit Gluon grouped GEMM and ``out`` bit-equal to
the activation kernel on that ``h`` (so the op equals its composition exactly), against the fp64
reference, with balanced, unbalanced, empty and ragged groups, NaN rows past ``group_offs[G]``,
F and K tails, masked rows with NaN probs, both activations, bitwise repeatability; and the op's
forward and backward against the composition.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from primus_turbo.triton.grouped_gemm import grouped_gemm_glu_gluon as gf  # noqa: E402
from tests.triton.gluon_compile_child import compile_check_module  # noqa: E402
from tests.triton.gluon_compile_child import rerun_outside_interpreter, warmup_for_sm90  # noqa: E402
from tests.triton.gluon_gemm_helpers import needs_gluon, sm90_gpu  # noqa: E402
from tests.triton.gluon_gemm_helpers import offsets as _offsets  # noqa: E402
from tests.triton.gluon_gemm_helpers import snr as _snr  # noqa: E402


def _operands(lens, F, K, device, dtype=torch.bfloat16, tail=0, seed=0):
    """x [sum(lens) + tail, K] (tail rows NaN), w [G, 2F, K], probs (NaN on masked rows), the row
    mask (some rows inside groups masked too), offsets."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    G, M = len(lens), sum(lens) + tail
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(G, 2 * F, K, generator=gen) / K ** 0.5).to(dtype)
    probs = torch.rand(M, generator=gen) + 0.25
    mask = torch.ones(M, dtype=torch.bool)
    mask[sum(lens):] = False
    mask[::7] = False
    probs[~mask] = float("nan")
    if tail:
        x[M - tail:] = float("nan")
    return (x.to(device), w.to(device), probs.to(device), mask.to(device), _offsets(lens, device))


def _ref(x, w, probs, mask, lens, act):
    h = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for g, n in enumerate(lens):
        h[start:start + n] = x[start:start + n].double() @ w[g].double().T
        start += n
    F = w.shape[1] // 2
    a, b = h[:, :F], h[:, F:]
    if act == "swiglu":
        y = torch.nn.functional.silu(a)
    else:
        y = torch.nn.functional.gelu(a, approximate="tanh")
    out = y * b * probs.double()[:, None]
    return h, torch.where(mask[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------
def test_operand_reasons():
    x, w, probs, mask, offs = _operands([10, 20], 64, 32, "cpu")
    ok = gf.gluon_glu_operand_reason
    if not gf.GLUON_AVAILABLE:
        pytest.skip("gluon not importable")
    assert ok(x, w, offs, probs, mask) is None
    assert "bfloat16 or float16" in ok(x.float(), w.float(), offs, probs, mask)
    assert "[G, 2F, K]" in ok(x, w[:, :-1], offs, probs, mask)
    assert "multiples of 8" in ok(x[:, :30].contiguous(), w[:, :, :30].contiguous(), offs, probs, mask)
    assert "int64" in ok(x, w, offs.int(), probs, mask)
    assert "float32" in ok(x, w, offs, probs.double(), mask)
    assert "row_mask" in ok(x, w, offs, probs, mask.long())
    assert "contiguous" in ok(x, w.transpose(1, 2).contiguous().transpose(1, 2), offs, probs, mask)
    assert "CUDA sm_90" in gf.gluon_glu_reason(x, w, offs, probs, mask)


def test_op_path_choice(monkeypatch):
    """The fused kernel where it can run (never on CPU) and no other grouped-GEMM backend is pinned:
    with the switch at 1, or at auto where the 16-bit grouped default runs the problem on Gluon
    (gluon16_preferred); never at 0."""
    import importlib

    op = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_glu")  # the module, not the op
    x, w, probs, mask, offs = _operands([10, 20], 64, 32, "cpu")
    u8 = mask.view(torch.uint8)
    assert not op.glu_fusion_requested(x, w)  # auto, CPU
    assert op._fused_module(x, w, offs, probs, u8) is None
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(gf, "gluon_glu_reason", lambda *a: None)
    assert op.glu_fusion_requested(x, w) and not op.glu_fusion_requested()  # auto: a small problem
    assert op._fused_module(x, w, offs, probs, u8) is gf
    monkeypatch.setattr(op, "gluon16_preferred", lambda *a: False)  # a problem the vendor kernel gets
    assert not op.glu_fusion_requested(x, w)
    assert op._fused_module(x, w, offs, probs, u8) is None
    monkeypatch.setenv(op._ENV, "0")
    assert not op.glu_fusion_requested(x, w)
    assert op._fused_module(x, w, offs, probs, u8) is None
    monkeypatch.setenv(op._ENV, "1")
    assert op.glu_fusion_requested() and op.glu_fusion_requested(x, w)
    assert op._fused_module(x, w, offs, probs, u8) is gf
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "TORCH")
    assert op._fused_module(x, w, offs, probs, u8) is None
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "GLUON")
    assert op._fused_module(x, w, offs, probs, u8) is gf
    monkeypatch.delenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND")
    monkeypatch.setattr(gf, "gluon_glu_reason", lambda *a: "no")
    assert op._fused_module(x, w, offs, probs, u8) is None
    monkeypatch.setattr(gf, "gluon_glu_reason", lambda *a: None)
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_GLUON", "0")
    assert op._fused_module(x, w, offs, probs, u8) is None


@needs_gluon
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_launcher_arguments_bind_and_compile_for_sm90(act, monkeypatch, request):
    """The launcher's own arguments (strided views of w and h as TMA descriptors, pointers, probs
    and mask) bind and compile for sm_90: shared memory within sm_90's, no spills, no serialized
    wgmmas, the m64n256 wgmma, 4 TMA loads per K block and 3 stores per warpgroup."""
    if rerun_outside_interpreter(request):
        return
    x, w, probs, mask, offs = _operands([100, 0, 300], 200, 136, "cpu", tail=5)
    h = torch.empty(x.shape[0], 400, dtype=x.dtype)
    out = torch.empty(x.shape[0], 200, dtype=x.dtype)
    args, kwargs = gf._kernel_args(x, w, offs, probs, mask.view(torch.uint8), h, out, gf.GLU_ACTS[act],
                                   gf.GLU_DEFAULT_CONFIG)
    kernel = warmup_for_sm90(gf._grouped_gemm_glu_gluon_ws_kernel, args, kwargs, monkeypatch)
    assert kernel.metadata.shared <= 232448 and kernel.metadata.num_warps == 12
    import os

    import triton

    chk = compile_check_module()
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("ptxas not available")
    report = chk._ptxas_report(kernel.asm["ptx"], ptxas)
    import re

    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", report)]
    assert sum(spills) == 0, report
    assert not re.findall(r"\((C75\d\d)\)", report), report
    assert "m64n256k16.f32.bf16.bf16" in kernel.asm["ptx"]
    counts = chk.sass_counts(chk._sass(kernel.asm["cubin"], os.path.join(os.path.dirname(ptxas), "cuobjdump")))
    if any(counts.values()):
        assert counts["tma_load"] == 4 and counts["tma_store"] == 6, counts
        assert counts["local_store"] == 0 and counts["local_load"] == 0, counts


def test_op_composition_on_cpu_matches_reference():
    """Off the fused path the op is grouped_gemm then the activation: forward and gradients of x,
    w and probs against the fp64 reference (fp32 operands through the Triton interpreter)."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.triton import is_interpreter

    if not is_interpreter():
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")

    lens = [6, 0, 11, 3]
    x, w, probs, mask, offs = _operands(lens, 24, 16, "cpu", dtype=torch.float32, tail=2)
    x = x.nan_to_num(0.0)  # the fp64 reference's matmul would spread NaN rows' gradients
    x.requires_grad_(True)
    w.requires_grad_(True)
    probs = probs.nan_to_num(0.5).requires_grad_(True)
    out = turbo.ops.grouped_gemm_glu(x, w, offs[1:] - offs[:-1], offs, probs, mask, "swiglu")
    xr, wr, pr = (t.detach().double().requires_grad_(True) for t in (x, w, probs))
    _, ref = _ref(xr, wr, pr, mask, lens, "swiglu")
    assert _snr(ref, out) >= 60
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.double())
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (probs.grad, pr.grad)):
        assert _snr(want, got) >= 60


def test_op_asks_for_the_fused_kernel_only_when_requested(monkeypatch):
    """With the switch at auto / 0 the op never looks for the fused kernel (nor builds its mask);
    at 1 it does, and runs the composition where the kernel cannot run (CPU)."""
    import importlib

    import primus_turbo.pytorch as turbo
    from primus_turbo.triton import is_interpreter

    if not is_interpreter():
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
    op = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_glu")
    x, w, probs, mask, offs = _operands([6, 10], 16, 16, "cpu", dtype=torch.float32)
    probs = probs.nan_to_num(1.0)
    calls = []
    real = op._fused_module
    monkeypatch.setattr(op, "_fused_module", lambda *a: calls.append(a) or real(*a))
    outs = []
    for flag in ("auto", "0", "1"):
        monkeypatch.setenv(op._ENV, flag)
        outs.append(turbo.ops.grouped_gemm_glu(x, w, offs[1:] - offs[:-1], offs, probs, mask))
        assert len(calls) == (1 if flag == "1" else 0), flag
    assert calls[0][4].dtype == torch.uint8  # the kernel's mask form
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_grouped_mlp_routes_through_the_op_only_when_requested(monkeypatch):
    """GroupedMLP calls its linear_fc1 module and the activation op when fusion is not wanted (auto
    on CPU, or the switch at 0) and whenever linear_fc1 has forward hooks (they fire); else it calls
    grouped_gemm_glu (the composition on CPU), with the same result."""
    from primus_turbo.pytorch.modules import GroupedMLP
    from primus_turbo.pytorch.modules import moe as moe_mod
    from primus_turbo.triton import is_interpreter

    if not is_interpreter():
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    mlp = GroupedMLP(3, 32, 16, dtype=torch.float32)
    lens = torch.tensor([5, 0, 9])
    x = torch.randn(16, 32)
    probs = torch.rand(16)
    hooked, calls = [], []
    handle = mlp.linear_fc1.register_forward_hook(lambda *a: hooked.append(1))
    real = moe_mod.grouped_gemm_glu
    monkeypatch.setattr(moe_mod, "grouped_gemm_glu", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = mlp(x, lens, probs)
    assert hooked == [1] and not calls
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_GLU_FUSED", "1")
    assert torch.equal(mlp(x, lens, probs), ref)
    assert hooked == [1, 1] and not calls  # a hook on linear_fc1 keeps the module path
    handle.remove()
    out = mlp(x, lens, probs)
    assert calls == [1] and hooked == [1, 1]
    assert torch.equal(out, ref)
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_GLU_FUSED", "0")
    mlp(x, lens, probs)
    assert calls == [1]


def test_op_errors():
    import primus_turbo.pytorch as turbo
    from primus_turbo.triton import is_interpreter

    if not is_interpreter():
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")

    x, w, probs, mask, offs = _operands([4, 4], 16, 16, "cpu", dtype=torch.float32)
    lens = offs[1:] - offs[:-1]
    with pytest.raises(ValueError, match="activation"):
        turbo.ops.grouped_gemm_glu(x, w, lens, offs, probs, mask, "relu")
    with pytest.raises(ValueError, match="even"):
        turbo.ops.grouped_gemm_glu(x, w[:, :-1], lens, offs, probs, mask)
    with pytest.raises(TypeError, match="probs"):
        turbo.ops.grouped_gemm_glu(x, w, lens, offs, probs.double(), mask)
    with pytest.raises(ValueError, match="probs"):
        turbo.ops.grouped_gemm_glu(x, w, lens, offs, probs[:-1], mask)
    with pytest.raises(TypeError, match="row_mask"):
        turbo.ops.grouped_gemm_glu(x, w, lens, offs, probs, mask.float())
    with pytest.raises(ValueError, match="row_mask"):
        turbo.ops.grouped_gemm_glu(x, w, lens, offs, probs, mask[:-1])
    with pytest.raises(ValueError, match=r"grouped_gemm_glu: K mismatch, x\(8, 16\) has K=16, w\(2, 16, 32\)"):
        turbo.ops.grouped_gemm_glu(x, w.transpose(1, 2), lens, offs, probs, mask)
    with pytest.raises(TypeError, match="grouped_gemm_glu: x must be a torch.Tensor, got list"):
        turbo.ops.grouped_gemm_glu([x], w, lens, offs, probs, mask)
    with pytest.raises(ValueError, match=r"grouped_gemm_glu: group_lens must be 1-D with 2 entries \(w has G=2"):
        turbo.ops.grouped_gemm_glu(x, w, lens[:1], None, probs, mask)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
from tests.triton.test_grouped_gemm_gluon import LENS  # noqa: E402 (the 16-bit Gluon kernel's group patterns)


@sm90_gpu
@pytest.mark.parametrize("pattern", list(LENS))
@pytest.mark.parametrize("F,K", [(256, 512), (200, 136), (128, 72)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_fused_equals_gluon_gemm_then_activation(pattern, F, K, dtype, act):
    from primus_turbo.triton.activation.swiglu_kernel import glu_fwd_launch
    from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg

    lens = LENS[pattern]
    x, w, probs, mask, offs = _operands(lens, F, K, "cuda", dtype, tail=7)
    assert gf.gluon_glu_reason(x, w, offs, probs, mask) is None
    h, out = gf.grouped_gemm_glu_gluon(x, w, offs, probs, mask, act)
    h_ref = gg.grouped_gemm_gluon(x, w.transpose(1, 2), offs, config=gg.GROUPED16_DEFAULT_CONFIG)
    assert torch.equal(h, h_ref), (pattern, F, K)
    assert torch.all(h[sum(lens):] == 0)
    o_ref = glu_fwd_launch(h_ref, gf.GLU_ACTS[act], probs, mask.view(torch.uint8))
    assert torch.equal(out, o_ref), (pattern, F, K, (out.float() - o_ref.float()).abs().max())
    assert torch.all(out[~mask] == 0)
    h64, o64 = _ref(x.nan_to_num(0.0), w, probs.nan_to_num(0.0), mask, lens, act)
    keep = mask.nonzero().squeeze(1)
    assert _snr(h64[:sum(lens)], h[:sum(lens)]) >= 40
    assert _snr(o64[keep], out[keep]) >= 40
    h2, o2 = gf.grouped_gemm_glu_gluon(x, w, offs, probs, mask, act, num_programs=3)
    assert torch.equal(h2, h) and torch.equal(o2, out)


@sm90_gpu
@pytest.mark.parametrize("fuse", [False, True])
def test_op_fused_forward_backward_equals_composition(fuse, monkeypatch):
    """The op on the fused path (switch at 1) against grouped_gemm + swiglu_with_probs with every
    16-bit GEMM pinned to Gluon: forward, grad x, grad w (or main_grad), grad probs bit-equal."""
    import primus_turbo.pytorch as turbo

    lens = [300, 0, 517, 64, 129]
    x, w, probs, mask, offs = _operands(lens, 256, 384, "cuda", tail=9)
    x = x.nan_to_num(0.0)
    probs = probs.nan_to_num(1.0)
    glens = offs[1:] - offs[:-1]
    dout = torch.randn(x.shape[0], 256, device="cuda").to(x.dtype)
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "BF16:GLUON")

    def run(fused):
        monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_GLU_FUSED", "1" if fused else "0")
        xx, ww, pp = (t.clone().requires_grad_(True) for t in (x, w, probs))
        if fuse:
            ww.main_grad = torch.full(ww.shape, 0.5, dtype=torch.float32, device="cuda")
        out = turbo.ops.grouped_gemm_glu(xx, ww, glens, offs, pp, mask, "swiglu",
                                         "megatron" if fuse else None)
        out.backward(dout)
        return out, xx.grad, (ww.main_grad if fuse else ww.grad), pp.grad

    fused, ref = run(True), run(False)
    for a, b in zip(fused, ref):
        assert torch.equal(a, b)


@needs_gluon
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_prepared_key_covers_the_launch_arguments(act):
    """The prepared launch's key and pointers (``_prepared_key``): the pointers cover every tensor
    and descriptor base among the kernel's arguments, the gate / linear half views' own included
    (else ``launch_prepared`` keeps nothing); new tensors of the same signature give the same key
    and their own pointers; another F, a misaligned output or the other activation give another key."""
    from primus_turbo.triton import launch as L

    def operands(F, seed):
        x, w, probs, mask, offs = _operands([100, 0, 300], F, 136, "cpu", tail=5, seed=seed)
        h = torch.empty(x.shape[0], 2 * F, dtype=x.dtype)
        out = torch.empty(x.shape[0], F, dtype=x.dtype)
        return x, w, offs, probs, mask.view(torch.uint8), h, out

    code, cfg = gf.GLU_ACTS[act], gf.GLU_DEFAULT_CONFIG
    ops = operands(200, 0)
    key, ptrs = gf._prepared_key(*ops, code, cfg)
    args, kwargs = gf._kernel_args(*ops, code, cfg)
    assert L._pointers_of(args) and L._pointers_of(args) <= set(ptrs)
    assert kwargs["ACT"] == code
    hash(key)
    again = operands(200, 1)
    key2, ptrs2 = gf._prepared_key(*again, code, cfg)
    assert key2 == key and ptrs2 != ptrs
    assert gf._prepared_key(*operands(208, 0), code, cfg)[0] != key
    assert gf._prepared_key(*ops, 1 - code, cfg)[0] != key
    raw = torch.empty(ops[6].numel() + 8, dtype=ops[6].dtype)
    shifted = raw[1:1 + ops[6].numel()].view(ops[6].shape)  # 2 bytes past a 16-byte boundary
    assert gf._prepared_key(*ops[:6], shifted, code, cfg)[0] != key


@sm90_gpu
def test_prepared_launches_follow_the_pointers():
    """Repeated launches through the prepared path: a signature's first call, repeats on the same
    operands (a kept list: the allocator hands the outputs' blocks back) and new operands of the
    same signature all equal a fresh launch with the prepared lists cleared, and the kept lists
    hold no tensor."""
    from primus_turbo.triton import launch as L

    lens, F, K = [300, 0, 451, 200], 256, 512
    for seed in range(3):
        x, w, probs, mask, offs = _operands(lens, F, K, "cuda", tail=7, seed=seed)
        for _ in range(2):
            h, out = gf.grouped_gemm_glu_gluon(x, w, offs, probs, mask, "swiglu")
            saved = dict(L._PREPARED)
            L._PREPARED.clear()  # the same launch built from scratch
            h_ref, o_ref = gf.grouped_gemm_glu_gluon(x, w, offs, probs, mask, "swiglu")
            L._PREPARED.update(saved)
            assert torch.equal(h, h_ref) and torch.equal(out, o_ref)
            h64, _ = _ref(x.nan_to_num(0.0), w, probs.nan_to_num(0.0), mask, lens, "swiglu")
            assert _snr(h64[:sum(lens)], h[:sum(lens)]) >= 40
    kept = [rec for key, rec in L._PREPARED.items() if key[0] == id(gf._grouped_gemm_glu_gluon_ws_kernel)]
    assert kept and all(not isinstance(v, torch.Tensor) for rec in kept for v in rec[1])
