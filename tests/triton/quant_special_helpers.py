"""Helpers of the bf16-pair quantizer tests (test_quant_fp8_packed.py, test_quant_fp4_packed.py):
inputs with special values, the sm_90 compile of a launch (no GPU)."""

from __future__ import annotations

import torch

# bf16 bit patterns: -NaN with payload, +NaN with payload, -/+ smallest subnormal
_PAYLOADS = [0xFF81, 0x7FC1, 0x8001, 0x0001]


def special_bf16(rows: int, cols: int, device, values: list, seed: int = 0) -> torch.Tensor:
    """bf16 [rows, cols]: normal rows scaled by 2**-10 .. 2**10 (one power per row), ``values``
    ((index, value) pairs, index as for ``x[index]``) written in fp32, then row 7's first 32 entries set
    to NaN payloads and signed subnormal bit patterns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-10, 11, (rows, 1), generator=g).float())
    for idx, v in values:
        x[idx] = v if isinstance(v, float) else torch.tensor(v)
    x = x.to(torch.bfloat16)
    x[7, 0:32] = torch.tensor(_PAYLOADS * 8, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x.to(device)


def special_fp8_input(rows: int, cols: int, device, seed: int = 0) -> torch.Tensor:
    """The two-copy FP8 quantizer tests' input: :func:`special_bf16` with zero, +-inf and NaN
    entries, a subnormal row, values around E4M3's rounding points and a large column."""
    return special_bf16(rows, cols, device, [
        ((0, slice(0, 40)), 0.0), ((1, 3), float("inf")), ((5, 70), float("-inf")), ((2, 7), float("nan")),
        ((3, slice(None)), 1e-39),
        ((6, slice(0, 32)), [448.0, 1e-30, -7.9, 5.99, 0.0625 * 1.0625, 17.0, 18.0, 19.0] * 4),
        ((slice(None), 9), 3e5)], seed)


def code_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns for bit-exact comparisons: 1-byte codes as uint8 with the E4M3 NaN codes (0x7F /
    0xFF: the sign of a NaN is not part of the contract, the tl kernels' soft conversion and
    quant_ref differ in it) mapped to 0x7F; 4-byte scales as int32."""
    t = t.contiguous()
    if t.element_size() == 1:
        b = t.view(torch.uint8)
        return torch.where((b & 0x7F) == 0x7F, torch.full_like(b, 0x7F), b)
    return t.view(torch.int32)


def sm90_capture(launch):
    """Run ``launch()`` with every Triton launch compiled for sm_90 and not run
    (scripts/quant_sass_stats.py's capture; outside the interpreter). Returns the stats module
    and its captured records (dicts with ``name``, ``error``, ``kernel``)."""
    import importlib.util
    from pathlib import Path

    from triton.runtime.jit import JITFunction

    path = Path(__file__).resolve().parents[2] / "scripts" / "quant_sass_stats.py"
    spec = importlib.util.spec_from_file_location("quant_sass_stats", path)
    S = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(S)
    orig = JITFunction.run
    JITFunction.run = S._capture
    S._SEEN.clear()
    try:
        launch()
    finally:
        JITFunction.run = orig
    return S, list(S._SEEN)


def sm90_kernels(launch) -> list:
    """Run ``launch()`` (quantizer launches on CPU tensors of a GPU shape) with the launches
    compiled for sm_90 and not run (:func:`sm90_capture`). Returns per kernel ``(name, error,
    stats, sass instruction lines)``, stats as quant_sass_stats._stats (registers, spills, ...)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    S, seen = sm90_capture(launch)
    out = []
    for r in seen:
        if r["error"] is not None:
            out.append((r["name"], r["error"], None, []))
            continue
        with tempfile.TemporaryDirectory() as d:
            cubin = Path(d) / "k.cubin"
            cubin.write_bytes(r["kernel"].asm["cubin"])
            sass = subprocess.run([S._BIN + "/cuobjdump", "-sass", str(cubin)], capture_output=True, text=True).stdout
        ins = [ln for ln in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?[A-Z]", ln)]
        out.append((r["name"], None, S._stats(r["kernel"]), ins))
    return out
