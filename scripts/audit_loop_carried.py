"""Audit compiled kernels for loop-carried values that Triton's layout pass drops.

Triton 3.6's ``tritongpu-remove-layout-conversions`` pass drops a loop-carried scalar whose only use
is a nested loop's bound and substitutes its initial value (tests/triton/test_tile_deal.py has a
five-line reproducer). The result can still be correct -- the persistent grouped kernels' tile deal
restarted at program 0 in every group, output right, SMs unevenly loaded -- so numerical tests do not
catch it. This script compiles kernels for sm_90 with MLIR's per-pass dumps and reports every
remove-layout-conversions run after which a module has fewer ``scf.for`` / ``scf.while`` loop-carried
values than before it (canonicalization runs earlier, so a truly dead value is already gone).

    # launches recorded from a CPU test run (scripts/aot_compile_check.py record), then:
    PYTHONPATH=. python scripts/audit_loop_carried.py /tmp/launches.json [--only NAME ...]

Exit status 1 when a compile loses a loop-carried value (or fails).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

PASS = "TritonGPURemoveLayoutConversions"
_ITER_ARGS = re.compile(r"iter_args\(([^()]*)\)")
_WHILE = re.compile(r"scf\.while \(([^()]*)\)")


def carried_values(ir: str) -> int:
    """Loop-carried values in an MLIR module's text: the ``%a = %b`` pairs of every ``iter_args``
    (scf.for) and ``scf.while`` operand list."""
    return sum(m.group(1).count("=") for m in _ITER_ARGS.finditer(ir)) + \
        sum(m.group(1).count("=") for m in _WHILE.finditer(ir))


def dropped_by_layout_pass(dump: str) -> list[tuple[int, int]]:
    """(before, after) loop-carried counts for each run of the layout pass that lost some."""
    chunks = dump.split("// -----// IR Dump Before ")
    out = []
    for i, chunk in enumerate(chunks[:-1]):
        if chunk.startswith(PASS):
            before, after = carried_values(chunk), carried_values(chunks[i + 1])
            if after < before:
                out.append((before, after))
    return out


def compile_with_dumps(fn, sig: dict, consts: dict, opts: dict) -> str:
    """The MLIR per-pass dumps (stderr, captured at the file-descriptor level) of one sm_90 compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.environ["MLIR_ENABLE_DUMP"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=opts)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.environ.pop("MLIR_ENABLE_DUMP", None)
        tmp.seek(0)
        return tmp.read().decode(errors="replace")


def main(argv=None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(__doc__)
        return 2
    only = argv[argv.index("--only") + 1:] if "--only" in argv else None
    entries = json.loads(Path(argv[0]).read_text())
    done, bad = set(), 0
    for e in entries:
        if only and e["kernel"] not in only:
            continue
        sig = {k: v for k, v in e["signature"].items() if v != "none"}
        consts = dict(e["constexprs"], **{k: None for k, v in e["signature"].items() if v == "none"})
        sig.update({k: "constexpr" for k in consts})
        key = json.dumps([e["module"], e["kernel"], sig, consts], sort_keys=True, default=str)
        if key in done:
            continue
        done.add(key)
        label = f"{e['module'].rsplit('.', 1)[-1]}.{e['kernel']}"
        opts = {"num_warps": e["options"].get("num_warps", 4), "num_stages": e["options"].get("num_stages", 3)}
        try:
            lost = dropped_by_layout_pass(compile_with_dumps(getattr(importlib.import_module(e["module"]),
                                                                     e["kernel"]), sig, consts, opts))
        except Exception as exc:  # noqa: BLE001 - report and go on
            bad += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[-1][:200] if str(exc) else ''}")
            continue
        if lost:
            bad += 1
            print(f"LOST {label} {consts}: loop-carried values {lost}", flush=True)
        else:
            print(f"ok   {label}", flush=True)
    print(f"\n{len(done)} compiles audited, {bad} with a dropped loop-carried value or a failure")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
