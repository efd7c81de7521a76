"""`fzero.memory.estimate` against the stage table of docs/design.md, term by term.

The existing tests check the paper's Table 1 and relations between stages (stage 3 = stage
0 / N, monotonicity, equality at N = 1). Here every stage is checked against its own formula,
written out independently with exact rational arithmetic, for any Ψ, N, K and element sizes:

    stage 0: (p + g + K)·Ψ          stage 1: p·Ψ + g·Ψ + K·Ψ/N
    stage 2: p·Ψ + (g + K)·Ψ/N      stage 3: (p + g + K)·Ψ/N

and `estimate_table` is `estimate` row by row, in the given order.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fzero import memory

counts = st.integers(0, 10**13) | st.floats(0, 1e13, allow_nan=False)
sizes = st.integers(0, 16) | st.floats(0, 16, allow_nan=False)


def table(psi, n, k, p, g) -> dict[int, Fraction]:
    psi, k, p, g = map(Fraction, (psi, k, p, g))
    return {0: (p + g + k) * psi, 1: p * psi + g * psi + k * psi / n,
            2: p * psi + (g + k) * psi / n, 3: (p + g + k) * psi / n}


@settings(deadline=None, max_examples=200)
@given(psi=counts, n=st.integers(1, 4096), k=sizes, p=sizes, g=sizes)
def test_each_stage_is_its_formula(psi, n, k, p, g) -> None:
    want = table(psi, n, k, p, g)
    for stage in (0, 1, 2, 3):
        got = memory.estimate(psi, n, stage, k=k, param_bytes=p, grad_bytes=g)
        assert got == pytest.approx(float(want[stage]), rel=1e-12, abs=1e-9), stage


@settings(deadline=None, max_examples=50)
@given(psi=counts, ns=st.lists(st.integers(1, 1024), min_size=1, max_size=6))
def test_table_rows_are_estimates(psi, ns) -> None:
    rows = memory.estimate_table(psi, ns)
    assert [row.world_size for row in rows] == ns
    for row in rows:
        assert tuple(row[1:]) == tuple(memory.estimate(psi, row.world_size, s) for s in range(4))


@pytest.mark.parametrize("stage", [4, -1])
def test_unknown_stage_raises(stage) -> None:
    with pytest.raises(ValueError, match="stage"):
        memory.estimate(1e9, 8, stage)
