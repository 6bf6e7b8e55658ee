"""The benchmarks' timing switch: bad values and unsupported combinations are refused."""

from __future__ import annotations

import pytest

from benchmarks import common


def test_set_timing_rejects_unknown_modes():
    with pytest.raises(ValueError, match="timing must be"):
        common.set_timing("wall")
    common.set_timing("do_bench")


def test_graph_timing_is_forward_only():
    from benchmarks import bench_grouped_gemm as b

    with pytest.raises(SystemExit, match="forward only"):
        b.run(b.parse_args(["--cpu-smoke", "--timing", "graph", "--modes", "fwd", "fwd_bwd", "--fp8"]))
