"""primus_turbo.triton.cdiv / next_pow2: the host-side twins of triton.cdiv and
triton.next_power_of_2 (which cost ~2 us a call in Triton 3.6) give the same integers."""

from __future__ import annotations

import pytest

from primus_turbo.triton import cdiv, next_pow2

triton = pytest.importorskip("triton")


def test_cdiv_and_next_pow2_match_triton():
    for x in list(range(0, 300)) + [2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_pow2(x) == triton.next_power_of_2(x), x
        for y in (1, 2, 3, 16, 64, 128, 129, 1000):
            assert cdiv(x, y) == triton.cdiv(x, y), (x, y)
