"""sm_90 compile checks (no GPU) of the Hopper Gluon copy kernels: the wgrad token copy
(gather_quant_gluon.py) and the expert-weight copies (quant_fp8_gluon.py).

What they guard: the layouts that make these kernels fast (no shared memory for the token copy,
16-byte loads and 16-byte transposed stores, no spills) and, for the weight copies, the second
cast through an opaque scale that keeps the transposed words right on Triton 3.6 (the shared-code
forms miscompile on sm_90: docs/design.md). Their numerics run on the GPU (test_gather_quant.py,
test_quantization.py); Gluon kernels do not run in the interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("triton")

from .gluon_compile_child import rerun_outside_interpreter  # noqa: E402


def _compile(kernel, sig: dict, consts: dict, divisible: tuple, num_warps: int):
    """(ptx, shared bytes, ptxas -v report) of ``kernel`` compiled for sm_90 with 16-divisible
    arguments ``divisible`` (as the GPU JIT specializes aligned pointers and sizes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(sig, **{k: "constexpr" for k in consts})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    k = triton.compile(GluonASTSource(kernel, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("no bundled ptxas")
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(k.asm["ptx"])
        rep = subprocess.run([ptxas, "-v", "-arch=sm_90a", str(p), "-o", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True)
    return k.asm["ptx"], k.metadata.shared, rep.stdout + rep.stderr


def _spills(report: str) -> list:
    return [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]


@pytest.mark.parametrize("cfg", [(4, 8, 2), (4, 8, 4)])
def test_gather_quant_gluon_compiles_without_shared_memory(cfg, request):
    if rerun_outside_interpreter(request):
        return
    from primus_turbo.triton.quantization import gather_quant_gluon as G

    if not G.GLUON_AVAILABLE:
        pytest.skip("no Gluon")
    c = G.GluonGatherQuantConfig(*cfg)
    l3, lst = G._layouts(c)
    ptx, shared, rep = _compile(
        G._gather_quant_cols_t_gluon_kernel,
        {"x_ptr": "*bf16", "src_ptr": "*i64", "q_ptr": "*i32", "s_ptr": "*fp32", "C": "i32", "M_PAD4": "i32",
         "stride_x": "i32", "n_tiles_c": "i32"},
        dict(FP8_MAX=448.0, IS_E4M3=True, EVEN_C=True, TC=c.tc, L3=l3, LST=lst),
        ("x_ptr", "src_ptr", "q_ptr", "s_ptr", "C", "M_PAD4", "stride_x"), c.warps)
    assert shared == 0 and "bar.sync" not in ptx  # no cross-warp step, no shared-memory transpose
    assert all(v == 0 for v in _spills(rep)), rep
    # one 16-byte load per token row (4 SPW rows of VEC = 8 bf16); one 16-byte store per column of
    # the transposed copy, plus the VEC fp32 scales as 16-byte stores
    assert len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)) == 4 * c.spw, ptx.count("ld.global")
    assert len(re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", ptx)) == c.vec + c.vec // 4


def test_weight_copies_gluon_compiles_with_the_second_cast(request):
    if rerun_outside_interpreter(request):
        return
    from primus_turbo.triton.quantization import quant_fp8_gluon as Q
    from primus_turbo.triton.quantization.gather_quant_gluon import GLUON_AVAILABLE, _layouts

    if not GLUON_AVAILABLE:
        pytest.skip("no Gluon")
    c = Q.WEIGHT_COPIES_DEFAULT_CONFIG
    l3, lst = _layouts(c)
    ptx, shared, rep = _compile(
        Q._weight_copies_gluon_kernel,
        {"x_ptr": "*bf16", "q_ptr": "*u8", "qt_ptr": "*i32", "s_ptr": "*fp32", "rows": "i32", "cols": "i32",
         "n_tiles_c": "i32", "n_sr": "i32", "n_sc": "i32", "stride_xb": "i32", "stride_xr": "i32"},
        dict(FP8_MAX=448.0, IS_E4M3=True, L3=l3, LST=lst),
        ("x_ptr", "q_ptr", "qt_ptr", "s_ptr", "rows", "cols", "stride_xb", "stride_xr"), c.warps)
    assert all(v == 0 for v in _spills(rep)), rep
    per_thread = c.spw * 4 * c.vec
    # two casts of the tile (the forward copy's and the transposed words'), the second through the
    # opaque move: one shared cast writes wrong transposed bytes on sm_90 (Triton 3.6)
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 2 * per_thread // 2
    assert re.search(r"mov\.b32 %r\d+, %r\d+;", ptx)
    # forward copy: VEC = 8 bytes of each of the thread's rows; transposed copy: 16 bytes per column
    assert len(re.findall(r"st\.global(?:\.\w+)*\.v2\.b32", ptx)) == 4 * c.spw
    assert len(re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", ptx)) == c.vec
    assert shared <= 64  # only the block amax's cross-warp step
