"""The persistent grouped kernels deal group g's tiles round-robin over the programs from where the
previous groups' tiles ended (tile ``tile_base + t`` to program ``(tile_base + t) % P``), which
keeps every SM's tile count within one of the others' on unbalanced groups.

Triton 3.6 miscompiled the first form of that loop, ``for t in range(first, tiles_g, P)`` with
``first`` computed from the loop-carried ``tile_base``: its remove-layout-conversions pass dropped
``tile_base`` (used only in a nested loop's bound) for its initial 0, so every group's deal
restarted at program 0. Output stayed correct (every partition of a kernel dealt alike) but
programs 0, 1, ... took one tile more per group than the last ones (the 16-bit Gluon kernel lost
10-15% on unbalanced groups, and its paced form waited for tiles that never came). The kernels now
count a program's tiles with ``i`` (``t = first + i * P``). These checks compile each kernel for
sm_90 on CPU and look for the dropped value in the TTGIR: ``tile_base % P`` of the constant 0.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.triton.gluon_compile_child import rerun_outside_interpreter, warmup_for_sm90  # noqa: E402
from tests.triton.gluon_gemm_helpers import needs_gluon  # noqa: E402

_GROUPED = Path(__file__).resolve().parents[2] / "primus_turbo" / "triton" / "grouped_gemm"
# the remainder of a constant zero: what is left of `tile_base % P` once tile_base was dropped
_DROPPED = re.compile(r"arith\.remsi %c0(_i32)?(_\d+)?, ")


def assert_deal_carried(ttgir: str) -> None:
    """The TTGIR still computes the deal's start from the loop-carried tile count."""
    bad = _DROPPED.findall(ttgir)
    assert not bad, "a persistent tile deal lost its loop-carried tile_base (remsi of constant 0)"
    assert "arith.remsi" in ttgir


def test_no_range_from_first_in_grouped_kernels():
    """The source form that triton 3.6 miscompiles is gone from every persistent grouped kernel."""
    offenders = [f"{p.name}:{i + 1}" for p in sorted(_GROUPED.glob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines()) if re.search(r"in range\(first\b", line)]
    assert not offenders, offenders


def test_detector_sees_the_miscompile(request):
    """The pattern in a five-line kernel: the nested loop's start loses the carried value (the
    detector can fail), the counted form keeps it."""
    if rerun_outside_interpreter(request):
        return
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    @triton.jit
    def _restart(out, G, P):
        base = 0
        for g in range(G):
            first = (tl.program_id(0) - base % P + P) % P
            for t in range(first, g + 1, P):
                tl.store(out + t, g)
            base += g + 1

    @triton.jit
    def _counted(out, G, P):
        base = 0
        for g in range(G):
            first = (tl.program_id(0) - base % P + P) % P
            for i in range(tl.cdiv(g + 1 - first, P)):
                tl.store(out + first + i * P, g)
            base += g + 1

    def ttgir(fn):
        src = triton.compiler.ASTSource(fn=fn, signature={"out": "*i32", "G": "i32", "P": "i32"}, constexprs={})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttgir"]

    assert _DROPPED.search(ttgir(_restart)), "triton no longer drops the value: the workaround could go"
    assert_deal_carried(ttgir(_counted))

    # scripts/audit_loop_carried.py (the audit over every recorded launch) sees the same
    import importlib.util

    spec = importlib.util.spec_from_file_location("audit_loop_carried", _GROUPED.parents[2] / "scripts" /
                                                  "audit_loop_carried.py")
    audit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(audit)
    sig = {"out": "*i32", "G": "i32", "P": "i32"}
    assert audit.dropped_by_layout_pass(audit.compile_with_dumps(_restart, sig, {}, {})) == [(1, 0)]
    assert audit.dropped_by_layout_pass(audit.compile_with_dumps(_counted, sig, {}, {})) == []


def _tl_grouped():
    from primus_turbo.triton.grouped_gemm import grouped_gemm_kernel as k

    M, N, K, G = 400, 256, 128, 3
    a = torch.empty(M, K, dtype=torch.bfloat16)
    b = torch.empty(G, K, N, dtype=torch.bfloat16)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    offs = torch.tensor([0, 100, 100, 390])
    args = (a, b, out, offs, M, N, K, G, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
            out.stride(0), out.stride(1))
    kwargs = dict(NUM_PROGRAMS=132, DOT_PRECISION=k._precision(a.dtype), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                  GROUP_M=8, USE_TMA=False, B_KMAJOR=False, num_stages=3, num_warps=8)
    return k._grouped_gemm_kernel, args, kwargs


def _tl_grouped_fp8():
    from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_kernel as k

    M, N, K, G = 400, 256, 256, 3
    a = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    b = torch.empty(G, N, K, dtype=torch.float8_e4m3fn)
    sa = torch.empty(M, K // 128, dtype=torch.float32)
    sb = torch.empty(G, N // 128, K // 128, dtype=torch.float32)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    offs = torch.tensor([0, 100, 100, 390])
    args = (a, b, out, offs, sa, sb, M, N, K, G, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
            out.stride(0), out.stride(1), sa.stride(0), sa.stride(1), *sb.stride())
    kwargs = dict(NUM_PROGRAMS=132, SCALE_MODE=k._BLOCKWISE, SCALE_BLOCK=128, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128,
                  GROUP_M=8, num_stages=3, num_warps=8)
    return k._grouped_gemm_fp8_kernel, args, kwargs


def _tl_grouped_fp4():
    from primus_turbo.triton.grouped_gemm import grouped_gemm_fp4_kernel as k

    M, N, K, G = 400, 256, 256, 3
    a = torch.empty(M, K // 2, dtype=torch.uint8)
    b = torch.empty(G, N, K // 2, dtype=torch.uint8)
    sa = torch.empty(M, K // 32, dtype=torch.uint8)
    sb = torch.empty(G, N, K // 32, dtype=torch.uint8)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    offs = torch.tensor([0, 100, 100, 390])
    args = (a, b, out, offs, sa, sb, M, N, K, G, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
            out.stride(0), out.stride(1), sa.stride(0), sa.stride(1), *sb.stride())
    kwargs = dict(NUM_PROGRAMS=132, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_stages=3, num_warps=8)
    return k._grouped_gemm_fp4_kernel, args, kwargs


def _gluon16(pace):
    def build():
        import dataclasses

        from primus_turbo.triton.grouped_gemm import grouped_gemm_gluon as gg

        a = torch.empty(405, 192, dtype=torch.bfloat16)
        B = torch.empty(3, 136, 192, dtype=torch.bfloat16).transpose(1, 2)
        out = torch.empty(405, 136, dtype=torch.bfloat16)
        cfg = dataclasses.replace(gg.GROUPED16_DEFAULT_CONFIG, pace=pace)
        return (gg._grouped_gemm_gluon_ws_kernel,) + gg._kernel_args(a, B, torch.tensor([0, 100, 100, 400]), out, cfg)
    return build


def _gluon_glu():
    from primus_turbo.triton.grouped_gemm import grouped_gemm_glu_gluon as gf

    x = torch.empty(405, 200, dtype=torch.bfloat16)
    w = torch.empty(3, 272, 200, dtype=torch.bfloat16)
    probs = torch.empty(405, dtype=torch.float32)
    mask = torch.ones(405, dtype=torch.uint8)
    h = torch.empty(405, 272, dtype=torch.bfloat16)
    out = torch.empty(405, 136, dtype=torch.bfloat16)
    return (gf._grouped_gemm_glu_gluon_ws_kernel,) + gf._kernel_args(
        x, w, torch.tensor([0, 100, 100, 400]), probs, mask, h, out, gf.GLU_ACTS["swiglu"], gf.GLU_DEFAULT_CONFIG)


def _gluon_fp8():
    from tests.triton import test_grouped_gemm_fp8_gluon as t8

    (a_q, sa, b_q, sb, offs), _ = t8._operands([100, 0, 200], 384, 640, "cpu", extra_rows=20)
    out = torch.empty(a_q.shape[0], 384, dtype=torch.bfloat16)
    cfg = t8.dense.GluonBlockwiseConfig.parse("n256s3c2")
    return (t8.gg._grouped_gemm_fp8_blockwise_ws_kernel,) + t8.gg._kernel_args(a_q, sa, b_q, sb, offs, out, cfg)


@pytest.mark.parametrize("build", [
    pytest.param(_tl_grouped, id="tl-bf16"),
    pytest.param(_tl_grouped_fp8, id="tl-fp8"),
    pytest.param(_tl_grouped_fp4, id="tl-fp4"),
    pytest.param(_gluon16(0), id="gluon16", marks=needs_gluon),
    pytest.param(_gluon16(1), id="gluon16-paced", marks=needs_gluon),
    pytest.param(_gluon_glu, id="gluon-glu", marks=needs_gluon),
    pytest.param(_gluon_fp8, id="gluon-fp8", marks=needs_gluon),
])
def test_kernel_keeps_its_deal(build, monkeypatch, request):
    """Each persistent grouped kernel, compiled for sm_90 through its launcher's own arguments,
    still computes its deal from the loop-carried tile count."""
    if rerun_outside_interpreter(request):
        return
    kernel, args, kwargs = build()
    assert_deal_carried(warmup_for_sm90(kernel, args, kwargs, monkeypatch).asm["ttgir"])
