"""`fzero.launch._first_slurm_host` and `parse_launch_env` against an independent Slurm
hostlist expander.

Slurm's compressed hostlists (``scontrol show hostnames`` expands them) are comma-separated
host expressions; each expression is literal text and bracket groups, a group being
comma-separated numbers and zero-padded ranges ``lo-hi`` (the width of ``lo`` is kept). An
expression with several groups is their Cartesian product, the leftmost varying slowest. The
rendezvous host is the first host of the expansion. Drawn hostlists use nested prefixes
(``rack[1-2]-n[03-04]``), suffixes (``a[1-2]-ib``), dashes and dots in literals, single
numbers and ranges mixed in one group, and zero padding.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fzero.launch import _first_slurm_host, parse_launch_env

LITERAL = st.text(string.ascii_lowercase + string.digits + "-_.", min_size=1, max_size=5)


@st.composite
def groups(draw: st.DrawFn) -> str:
    items = []
    for _ in range(draw(st.integers(1, 3))):
        width = draw(st.integers(1, 3))
        lo = draw(st.integers(0, 10**width - 1))
        if draw(st.booleans()):
            hi = draw(st.integers(lo, 10**width - 1))
            items.append(f"{lo:0{width}d}-{hi:0{width}d}")
        else:
            items.append(f"{lo:0{width}d}")
    return "[" + ",".join(items) + "]"


@st.composite
def expressions(draw: st.DrawFn) -> str:
    parts = [draw(LITERAL)]
    for _ in range(draw(st.integers(0, 3))):
        parts.append(draw(groups()))
        if draw(st.booleans()):
            parts.append(draw(LITERAL))
    return "".join(parts)


def expand(hostlist: str) -> Iterator[str]:
    """The hosts of a Slurm hostlist, in order (an independent, full expander; lazy, as a
    drawn hostlist may name millions of hosts)."""
    depth, start = 0, 0
    for i, ch in enumerate(hostlist + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            yield from _expand_one(hostlist[start:i].strip())
            start = i + 1


def first(hostlist: str) -> str:
    return next(expand(hostlist))


def _expand_one(expression: str) -> Iterator[str]:
    choices: list[list[str]] = []
    rest = expression
    while rest:
        if rest[0] == "[":
            close = rest.index("]")
            numbers = []
            for item in rest[1:close].split(","):
                lo, _, hi = item.partition("-")
                width = len(lo)
                numbers += [f"{n:0{width}d}" for n in range(int(lo), int(hi or lo) + 1)]
            choices.append(numbers)
            rest = rest[close + 1:]
        else:
            cut = rest.find("[") if "[" in rest else len(rest)
            choices.append([rest[:cut]])
            rest = rest[cut:]
    return ("".join(p) for p in itertools.product(*choices))


@pytest.mark.parametrize(("hostlist", "want"), [
    ("gpu[03-05,9],cpu1", "gpu03"),
    ("a[1-2]-ib", "a1-ib"),
    ("rack[1-2]-n[03-04]", "rack1-n03"),
    ("n[9,003-005]", "n9"),
    ("node-a.b", "node-a.b"),
    ("x[0]y", "x0y"),
])
def test_documented_examples(hostlist: str, want: str) -> None:
    assert first(hostlist) == want
    assert _first_slurm_host(hostlist) == want


@settings(deadline=None, max_examples=200)
@given(st.lists(expressions(), min_size=1, max_size=3))
def test_first_host_is_the_first_of_the_expansion(exprs: list[str]) -> None:
    hostlist = ",".join(exprs)
    assert _first_slurm_host(hostlist) == first(hostlist)


@settings(deadline=None, max_examples=100)
@given(st.lists(expressions(), min_size=1, max_size=3), st.integers(2, 64), st.data())
def test_slurm_env_rendezvous_at_the_first_host(exprs, ntasks, data) -> None:
    """Without MASTER_ADDR, a multi-task Slurm launch meets at the first host of
    SLURM_JOB_NODELIST (preferred over SLURM_NODELIST); MASTER_ADDR wins when set."""
    rank = data.draw(st.integers(0, ntasks - 1))
    port = data.draw(st.integers(1, 65535))
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks),
           "SLURM_LOCALID": str(rank % 8), "MASTER_PORT": str(port),
           "SLURM_JOB_NODELIST": ",".join(exprs), "SLURM_NODELIST": "other[7-8]"}
    got = parse_launch_env(env)
    assert got == ("slurm", rank, ntasks, rank % 8, first(",".join(exprs)), port)
    assert parse_launch_env({**env, "MASTER_ADDR": "h"}).master_addr == "h"
    del env["SLURM_JOB_NODELIST"]
    assert parse_launch_env(env).master_addr == "other7"


def test_a_step_on_part_of_the_allocation_meets_at_the_step_s_first_node() -> None:
    """SLURM_PROCID counts the step's tasks: in ``srun -N1 -w gpu02`` inside a two-node job,
    rank 0 runs on gpu02, where the job's first node gpu01 was named (the ranks waited out the
    timeout; a probe). The step's node list wins over the job's."""
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "MASTER_PORT": "29500",
           "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_STEP_NODELIST": "gpu02",
           "SLURM_NODELIST": "gpu[01-02]"}
    assert parse_launch_env(env).master_addr == "gpu02"
    del env["SLURM_STEP_NODELIST"]
    assert parse_launch_env(env).master_addr == "gpu01"


def test_the_expander_itself() -> None:
    assert list(expand("gpu[03-05,9],cpu1")) == ["gpu03", "gpu04", "gpu05", "gpu9", "cpu1"]
    assert list(expand("r[1-2]-n[08-09]")) == ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]
