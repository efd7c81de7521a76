"""Tests of fzero.comm and fzero.simworld, cheapest first: pure -> SimWorld -> gloo -> CUDA."""

from __future__ import annotations

import gc
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from fzero import comm as fcomm
from fzero import torchcomm as ftorchcomm
from fzero.comm import COLLECTIVES, Comm, CommCounters, ring_bytes
from fzero.launch import (
    LaunchEnv,
    destroy_distributed,
    distributed,
    init_distributed,
    parse_launch_env,
)
from fzero.simworld import SimWorld, SimWorldError
from fzero.torchcomm import TorchComm

import comm_bodies as cb
from dist_pool import WorkerError

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
WORLD_SIZES = list(range(1, 9))
SHARD = 37  # per-rank elements (odd on purpose)


def exact(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Local references: each collective's single-process equation, reductions in rank order


def ref_reduce(inputs: list[Tensor], op: str) -> Tensor:
    acc = inputs[0].clone()
    for x in inputs[1:]:
        if op in ("sum", "avg"):
            acc = acc + x
        elif op == "max":
            acc = torch.maximum(acc, x)
        else:
            acc = torch.minimum(acc, x)
    return acc / len(inputs) if op == "avg" else acc


def ref_reduce_scatter(inputs: list[Tensor], op: str, rank: int) -> Tensor:
    s = inputs[0].numel() // len(inputs)
    return ref_reduce(inputs, op)[rank * s : (rank + 1) * s]


def order_tolerance(inputs: list[Tensor], op: str) -> float:
    """Bound on the difference between two summation orders (gloo sums in ring order)."""
    n = len(inputs)
    biggest = max(float(x.abs().max()) for x in inputs)
    atol = n * n * torch.finfo(inputs[0].dtype).eps * biggest
    return atol / n if op == "avg" else atol


def expected_counters(n: int, numel: int, itemsize: int) -> dict[str, dict[str, int]]:
    """Counters of `every_collective_body` with per-rank inputs of `numel` elements."""
    per_rank = (n - 1) * numel * itemsize  # (N-1)/N * (N * numel) * b
    return {
        "bytes": {
            "all_gather": per_rank,
            "reduce_scatter": 2 * (n - 1) * (numel // n) * itemsize,
            "all_reduce": 4 * (2 * numel * itemsize * (n - 1) // n),
            "broadcast": numel * itemsize * (n - 1) // n,
        },
        "calls": {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 4, "broadcast": 1},
    }


# ----------------------------------------------------------------------------------------------
# Tier 0: pure functions


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 64])
def test_ring_bytes_matches_formula(n: int) -> None:
    p, b = 12 * n, 2  # P a multiple of N: exact
    assert ring_bytes("all_gather", p, b, n) * n == (n - 1) * p * b
    assert ring_bytes("reduce_scatter", p, b, n) * n == (n - 1) * p * b
    assert ring_bytes("broadcast", p, b, n) * n == (n - 1) * p * b
    assert ring_bytes("all_reduce", p, b, n) * n == 2 * (n - 1) * p * b


def test_ring_bytes_rounds_down_and_validates() -> None:
    assert ring_bytes("all_gather", 5, 4, 3) == 13  # 5*4*2/3 = 13.33
    assert ring_bytes("all_reduce", 5, 4, 3) == 26  # 2*5*4*2/3 = 26.67
    assert ring_bytes("all_gather", 5, 4, 1) == 0
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        ring_bytes("gather", 1, 1, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        ring_bytes("all_gather", 1, 1, 0)


def test_counters_record_snapshot_reset() -> None:
    c = CommCounters()
    assert c.total() == 0 and set(c.snapshot()["bytes"]) == set(COLLECTIVES)
    c.record("all_gather", 10)
    c.record("all_reduce", 5)
    c.record("all_gather", 1)
    snap = c.snapshot()
    assert snap["bytes"]["all_gather"] == 11 and snap["calls"]["all_gather"] == 2
    assert c.total() == 16
    c.reset()
    assert c.total() == 0 and c.calls["all_reduce"] == 0
    assert snap["bytes"]["all_gather"] == 11  # a snapshot is a copy


def test_single_tensor_collectives_resolve_to_new_names(monkeypatch: pytest.MonkeyPatch) -> None:
    if hasattr(dist, "all_gather_single"):
        ops = ftorchcomm._single_tensor_collectives()
        assert ops.all_gather is dist.all_gather_single
        assert ops.reduce_scatter is dist.reduce_scatter_single
        monkeypatch.delattr(dist, "all_gather_single")
        monkeypatch.delattr(dist, "reduce_scatter_single")
    ops = ftorchcomm._single_tensor_collectives()  # torch < 2.13
    assert ops.all_gather is dist.all_gather_into_tensor
    assert ops.reduce_scatter is dist.reduce_scatter_tensor


TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_PORT": "29400"}


def test_parse_launch_env_torchrun_wins_over_slurm() -> None:
    env = parse_launch_env({**SLURM, **TORCHRUN})
    assert env == LaunchEnv("torchrun", 3, 8, 1, "10.0.0.1", 29500)


def test_a_world_size_exported_under_srun_is_named_as_such() -> None:
    """WORLD_SIZE exported by hand under srun (no torchrun): the error said a torchrun launch
    was detected, though torchrun never ran (a probe)."""
    with pytest.raises(ValueError, match="WORLD_SIZE is set, so torchrun's variables are read, "
                                         "but RANK, LOCAL_RANK, MASTER_ADDR not: under srun"):
        parse_launch_env({**SLURM, "WORLD_SIZE": "2"})


def test_parse_launch_env_none() -> None:
    assert parse_launch_env({"PATH": "/bin"}) == LaunchEnv("none", 0, 1, 0, None, None)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("gpu[03-05,9],cpu1", "gpu03"),
        ("node7", "node7"),
        ("a[1-2]-ib,b", "a1-ib"),
        ("rack[2-3]-n[01-04]", "rack2-n01"),
    ],
)
def test_parse_launch_env_slurm_derives_master_addr(nodelist: str, host: str) -> None:
    env = parse_launch_env({**SLURM, "SLURM_JOB_NODELIST": nodelist})
    assert env == LaunchEnv("slurm", 5, 8, 1, host, 29400)
    given_addr = parse_launch_env({**SLURM, "SLURM_NODELIST": nodelist, "MASTER_ADDR": "h0"})
    assert given_addr.master_addr == "h0"


def test_parse_launch_env_slurm_single_task_needs_no_rendezvous() -> None:
    env = parse_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})
    assert env == LaunchEnv("slurm", 0, 1, 0, None, None)


@pytest.mark.parametrize("missing", sorted(TORCHRUN))
def test_parse_launch_env_names_missing_torchrun_variable(missing: str) -> None:
    environ = {k: v for k, v in TORCHRUN.items() if k != missing}
    with pytest.raises(ValueError, match=f"torchrun launch detected but .*{missing} is not set"):
        parse_launch_env(environ)  # (the other of RANK and WORLD_SIZE still selects torchrun)
    if missing in ("RANK", "WORLD_SIZE"):  # under srun: the variable was exported by hand
        with pytest.raises(ValueError, match=f"variables are read, but {missing} not: under srun"):
            parse_launch_env({**environ, "SLURM_PROCID": "0"})


@pytest.mark.parametrize("missing", ["SLURM_NTASKS", "SLURM_LOCALID", "MASTER_PORT"])
def test_parse_launch_env_names_missing_slurm_variable(missing: str) -> None:
    environ = {k: v for k, v in SLURM.items() if k != missing}
    environ["SLURM_NODELIST"] = "n1"
    with pytest.raises(ValueError, match=f"slurm launch detected but .*{missing} is not set"):
        parse_launch_env(environ)


def test_parse_launch_env_slurm_without_address() -> None:
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        parse_launch_env(SLURM)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"RANK": "x"}, r"RANK='x' is not an integer"),
        ({"RANK": "8"}, r"rank=8, world_size=8"),
        ({"WORLD_SIZE": "0"}, r"world_size=0"),
        ({"LOCAL_RANK": "-1"}, r"local_rank=-1"),
        ({"MASTER_PORT": "70000"}, r"MASTER_PORT=70000"),
    ],
)
def test_parse_launch_env_rejects_bad_values(change: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_launch_env({**TORCHRUN, **change})


def test_fingerprint_int64() -> None:
    assert fcomm._fingerprint_int64(-5) == -5
    h = fcomm._fingerprint_int64("abc")
    assert h == fcomm._fingerprint_int64("abc") != fcomm._fingerprint_int64("abd")
    assert -(2**63) <= fcomm._fingerprint_int64(2**70) < 2**63


def test_torch_comm_needs_a_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_distributed"):
        TorchComm()


# ----------------------------------------------------------------------------------------------
# Tier 1: SimWorld


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_sim_all_gather(n: int, dtype: torch.dtype) -> None:
    inputs = cb.make_inputs(n, SHARD, dtype)
    for out in SimWorld(n).run(cb.all_gather_body, inputs):
        exact(out, torch.cat(inputs))


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_sim_reduce_scatter(n: int, dtype: torch.dtype, op: str) -> None:
    inputs = cb.make_inputs(n, n * SHARD, dtype)
    for r, out in enumerate(SimWorld(n).run(cb.reduce_scatter_body, inputs, op)):
        exact(out, ref_reduce_scatter(inputs, op, r))


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_sim_all_reduce(n: int, dtype: torch.dtype, op: str) -> None:
    inputs = cb.make_inputs(n, SHARD, dtype)
    for out in SimWorld(n).run(cb.all_reduce_body, inputs, op):
        exact(out, ref_reduce(inputs, op))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_sim_broadcast(n: int, dtype: torch.dtype) -> None:
    inputs = cb.make_inputs(n, SHARD, dtype)
    src = n // 2
    for out in SimWorld(n).run(cb.broadcast_body, inputs, src):
        exact(out, inputs[src])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_sim_counters_follow_ring_formula(n: int, dtype: torch.dtype) -> None:
    numel = n * SHARD
    results = SimWorld(n).run(cb.every_collective_body, cb.make_inputs(n, numel, dtype))
    want = expected_counters(n, numel, dtype.itemsize)
    for res in results:
        assert res["counters"] == want
        assert res["total"] == sum(want["bytes"].values())


@settings(max_examples=40)
@given(
    n=st.integers(1, 8),
    shard=st.integers(0, 40),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(["sum", "avg"]),
    seed=st.integers(0, 2**16),
)
def test_sim_gather_and_scatter_equations(
    n: int, shard: int, dtype: torch.dtype, op: str, seed: int
) -> None:
    small = cb.make_inputs(n, shard, dtype, seed)
    big = cb.make_inputs(n, n * shard, dtype, seed + 1)
    world = SimWorld(n)
    for out in world.run(cb.all_gather_body, small):
        exact(out, torch.cat(small))
    for r, out in enumerate(world.run(cb.reduce_scatter_body, big, op)):
        exact(out, ref_reduce_scatter(big, op, r))


@pytest.mark.parametrize("n", [1, 3])
def test_sim_async_overlap(n: int) -> None:
    a, b = cb.make_inputs(n, 5, torch.float32), cb.make_inputs(n, 7, torch.float32, seed=1)
    for out_a, out_b, z in SimWorld(n).run(cb.async_overlap_body, a, b):
        exact(out_a, torch.cat(a))
        exact(out_b, torch.cat(b))
        exact(z, ref_reduce(a, "sum"))


def test_sim_async_op_does_not_block_the_issuer() -> None:
    results = SimWorld(2).run(cb.async_is_async_body, 0.6)
    issue_s, done_early, out = results[0]
    assert issue_s < 0.3 and not done_early  # rank 1 joins only after 0.6 s
    exact(out, torch.tensor([0.0] * 4 + [1.0] * 4))


def test_sim_results_are_per_rank_and_may_alias_inputs() -> None:
    def body(comm: Any) -> tuple[Tensor, Tensor]:
        n = comm.world_size
        x = torch.arange(4.0 * n) * (comm.rank + 1)
        chunk = x[comm.rank * 4 : (comm.rank + 1) * 4]  # output aliases the input
        comm.reduce_scatter(chunk, x, op="sum")
        gathered = torch.empty(4 * n)
        comm.all_gather(gathered, chunk)
        return chunk.clone(), gathered

    n = 3
    results = SimWorld(n).run(body)
    total = sum(torch.arange(4.0 * n) * (r + 1) for r in range(n))
    for r, (chunk, gathered) in enumerate(results):
        exact(chunk, total[r * 4 : (r + 1) * 4])
        exact(gathered, total)
    assert len({g.data_ptr() for _, g in results}) == n


def test_sim_copies_args_per_rank() -> None:
    x = torch.zeros(3)

    def body(comm: Any, t: Tensor) -> int:
        t.add_(comm.rank + 1)  # would race and leak into the caller if shared
        return t.data_ptr()

    ptrs = SimWorld(3).run(body, x)
    assert len(set(ptrs)) == 3 and x.data_ptr() not in ptrs
    exact(x, torch.zeros(3))
    nonleaf = torch.ones(2, requires_grad=True) * 2
    with pytest.raises(TypeError, match="copy_args=False"):
        SimWorld(2).run(body, nonleaf)


def test_sim_comm_satisfies_protocol() -> None:
    assert SimWorld(2).run(lambda comm: isinstance(comm, Comm)) == [True, True]
    assert SimWorld(2).run(cb.identity_body) == [(0, 2, "SimComm"), (1, 2, "SimComm")]


def test_simworld_validates_arguments() -> None:
    with pytest.raises(ValueError, match="n=0"):
        SimWorld(0)
    with pytest.raises(ValueError, match="timeout=0"):
        SimWorld(2, timeout=0)


f32 = torch.float32


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda c: c.all_gather(torch.empty(5), torch.empty(3)),
            ValueError,
            r"all_gather on rank 0: output.numel\(\)=5 must equal world_size \* input.numel\(\) "
            r"= 2 \* 3 = 6",
        ),
        (
            lambda c: c.reduce_scatter(torch.empty(3), torch.empty(7)),
            ValueError,
            r"reduce_scatter on rank 0: input.numel\(\)=7 must equal world_size \* "
            r"output.numel\(\) = 2 \* 3 = 6",
        ),
        (
            lambda c: c.all_gather(torch.empty(6), torch.empty(3, dtype=torch.float64)),
            TypeError,
            r"all_gather on rank 0: output.dtype=torch.float32 differs from "
            r"input.dtype=torch.float64",
        ),
        (
            lambda c: c.all_gather(torch.empty(6, device="meta"), torch.empty(3)),
            ValueError,
            r"output.device=meta differs from input.device=cpu",
        ),
        (
            lambda c: c.all_reduce(torch.empty(2, 3)),
            ValueError,
            r"all_reduce on rank 0: tensor must be 1-D, got shape \(2, 3\)",
        ),
        (
            lambda c: c.broadcast(torch.empty(8)[::2]),
            ValueError,
            r"broadcast on rank 0: tensor must be contiguous, got stride \(2,\)",
        ),
        (
            lambda c: c.all_reduce([1.0]),
            TypeError,
            r"all_reduce on rank 0: tensor must be a torch.Tensor, got <class 'list'>",
        ),
        (
            lambda c: c.reduce_scatter(torch.empty(1), torch.empty(2), op="max"),
            ValueError,
            r"reduce_scatter on rank 0: op='max' is not one of \('sum', 'avg'\)",
        ),
        (
            lambda c: c.all_reduce(torch.zeros(2, dtype=torch.int64), op="avg"),
            TypeError,
            r"op='avg' needs a floating-point tensor, got dtype=torch.int64",
        ),
        (
            lambda c: c.broadcast(torch.empty(2), src=2),
            ValueError,
            r"broadcast on rank 0: src=2 is not in range\(world_size=2\)",
        ),
    ],
)
def test_sim_validation_errors(call: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(SimWorldError, match="rank 0 of 2") as info:
        SimWorld(2).run(call)
    assert isinstance(info.value.__cause__, error)
    assert info.value.rank == 0
    with pytest.raises(error, match=match):
        raise info.value.__cause__


def test_sim_one_rank_raising_releases_the_others() -> None:
    t0 = time.monotonic()
    with pytest.raises(SimWorldError, match="rank 2 of 4 failed") as info:
        SimWorld(4).run(cb.raise_on_rank_body, 2)
    assert time.monotonic() - t0 < 5  # not the 30 s timeout
    assert info.value.rank == 2
    assert isinstance(info.value.__cause__, ValueError)
    assert "deliberate failure on rank 2" in str(info.value)


def test_sim_bad_call_on_one_rank_only() -> None:
    def body(comm: Any) -> None:
        numel = 5 if comm.rank == 1 else 4
        comm.all_gather(torch.empty(numel), torch.empty(2))

    with pytest.raises(SimWorldError, match="rank 1 of 2") as info:
        SimWorld(2).run(body)
    assert "output.numel()=5" in str(info.value.__cause__)


def test_sim_mismatched_collectives_name_both() -> None:
    def body(comm: Any) -> None:
        x = torch.zeros(4)
        if comm.rank == 0:
            comm.all_gather(torch.empty(8), x)
        else:
            comm.all_reduce(x, op="max")

    with pytest.raises(SimWorldError) as info:
        SimWorld(2).run(body)
    text = str(info.value.__cause__)
    assert "collective #0 differs across ranks" in text
    assert "all_gather(input numel=4, output numel=8, dtype=torch.float32)" in text
    assert "all_reduce(input numel=4, output numel=4, dtype=torch.float32, op='max')" in text


def test_sim_mismatched_sizes_name_both() -> None:
    def body(comm: Any) -> None:
        comm.all_reduce(torch.zeros(3 + comm.rank))

    with pytest.raises(SimWorldError, match="differs across ranks") as info:
        SimWorld(2).run(body)
    assert "input numel=3" in str(info.value) and "input numel=4" in str(info.value)


def test_sim_rank_that_returns_without_joining() -> None:
    def body(comm: Any) -> None:
        if comm.rank == 0:
            comm.all_reduce(torch.zeros(2))

    t0 = time.monotonic()
    with pytest.raises(
        SimWorldError, match=r"finished without joining it \(ranks missing: \[1, 2\]\)"
    ):
        SimWorld(3).run(body)
    assert time.monotonic() - t0 < 5


def test_sim_timeout_names_collective_and_missing_rank() -> None:
    def body(comm: Any) -> None:
        if comm.rank == 1:
            time.sleep(1.5)  # a live rank that is late
        comm.all_reduce(torch.zeros(2))

    t0 = time.monotonic()
    with pytest.raises(SimWorldError, match="rank 0 of 2") as info:
        SimWorld(2, timeout=1.0).run(body)
    assert 1.0 <= time.monotonic() - t0 < 10
    assert isinstance(info.value.__cause__, TimeoutError)
    assert "all_reduce(input numel=2" in str(info.value)
    assert "timed out after 1.0 s: rank(s) [1] never joined it" in str(info.value)


def test_a_comm_that_timed_out_refuses_every_later_collective() -> None:
    """After a timeout the ranks' sequences no longer match (the late rank calls the abandoned
    collective later; gloo closes the connections): a retried step waited out a second
    timeout, and over gloo read "Application timeout caused pair closure" as another missing
    rank (a probe). Every later collective, on any channel of the comm, raises at once,
    naming the one that timed out."""
    def body(comm: Any) -> Any:
        control = comm.channel("control")
        if comm.rank == 1:
            time.sleep(1.5)  # a live rank that is late, then leaves
            return None
        with comm.scope("train step 7"):
            with pytest.raises(fcomm.CollectiveTimeout):
                comm.all_reduce(torch.zeros(2), label="of bucket 'b'")
        errors = []
        for call in (lambda: comm.all_reduce(torch.zeros(2)),
                     lambda: control.all_gather(torch.zeros(4), torch.zeros(2), label="x")):
            start = time.monotonic()
            with pytest.raises(fcomm.CollectiveError) as info:
                call()
            errors.append((str(info.value), time.monotonic() - start))
        return errors

    main, channel = SimWorld(2, timeout=0.5).run(body)[0]  # (#0 opened the channel)
    for text, seconds in (main, channel):
        assert seconds < 0.1 and "this comm can no longer communicate, since all_reduce #1 of " \
               "bucket 'b' during train step 7 timed out" in text, text
    assert channel[0].startswith("all_gather x on rank 0")


def test_an_interrupted_run_stops_its_ranks_at_their_next_collective(tmp_path) -> None:
    """Ctrl-C in a notebook (SIGINT to the thread waiting in `run`) raised KeyboardInterrupt
    at once, but the rank threads trained on in the background and wrote their checkpoint
    later, over the one a re-run had saved meanwhile (a probe). The interrupt aborts every
    collective: each rank stops at its next one, and what follows it never runs."""
    import signal
    import threading

    rounds = [0, 0]
    done = tmp_path / "written after the loop"

    def body(comm: Any) -> None:
        x = torch.ones(4)
        for _ in range(100_000):
            comm.all_reduce(x)
            rounds[comm.rank] += 1
            time.sleep(0.001)
        done.write_text("the ranks were not stopped")

    # Ctrl-C, as Python's own handler turns it into KeyboardInterrupt, sent every 0.3 s until
    # one arrives (a signal lost on a loaded machine failed this test once, the run going on
    # for minutes); later ones are ignored, so none can escape the test.
    interrupted = threading.Event()

    def on_sigint(signum: int, frame: Any) -> None:
        if not interrupted.is_set():
            interrupted.set()
            raise KeyboardInterrupt

    main = threading.get_ident()

    def press() -> None:
        while not interrupted.wait(0.3):
            signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, on_sigint)
    sender = threading.Thread(target=press, daemon=True)
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            SimWorld(2).run(body)
    finally:
        interrupted.set()
        sender.join()
        signal.signal(signal.SIGINT, previous)
    stopped = list(rounds)
    time.sleep(0.3)
    assert rounds == stopped and 0 < min(rounds)
    assert not done.exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("simworld-rank")]


def test_a_collective_after_the_run_ended_says_so() -> None:
    """A SimComm (or a state built on it) used after its run returned failed with
    "cannot schedule new futures after shutdown" (a probe): the error names the case."""
    comm = SimWorld(1).run(lambda comm: comm)[0]
    with pytest.raises(Exception, match="after its SimWorld.run ended"):
        comm.all_reduce(torch.ones(2))


def test_sim_unwaited_async_failure_is_reported() -> None:
    def body(comm: Any) -> None:
        x = torch.zeros(2)
        if comm.rank == 0:
            comm.all_gather(torch.empty(4), x, async_op=True)
        else:
            comm.all_reduce(x, async_op=True)

    with pytest.raises(SimWorldError, match="differs across ranks"):
        SimWorld(2).run(body)


@pytest.mark.parametrize("values", [[7, 7, 7, 7], ["ab", "ab", "ab", "ab"]])
def test_fingerprint_check_agreeing(values: list[int | str]) -> None:
    assert SimWorld(4).run(cb.fingerprint_body, values) == [None] * 4


@pytest.mark.parametrize(
    "values", [[7, 7, 8, 7], ["ab", "ab", "ba", "ab"], [2**70, 2**70, 1, 2**70]]
)
def test_fingerprint_check_every_rank_raises(values: list[int | str]) -> None:
    messages = SimWorld(4).run(cb.fingerprint_body, values)
    for rank, message in enumerate(messages):
        assert message is not None
        assert message.startswith("layout fingerprint differs across ranks: rank 0 has ")
        assert "rank 2: " in message and "rank 1:" not in message
        assert f"this is rank {rank}" in message
    if isinstance(values[0], int) and values[0] < 2**63:
        assert "rank 0 has 0x7, but rank 2: 0x8" in messages[0]


def test_fingerprint_check_rejects_other_types() -> None:
    with pytest.raises(SimWorldError) as info:
        SimWorld(1).run(fcomm.fingerprint_check, 1.5, "what")
    assert isinstance(info.value.__cause__, TypeError)


# ----------------------------------------------------------------------------------------------
# Tier 2: gloo processes (session-scoped worker pools, see tests/dist_pool.py)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3])
def test_gloo_every_collective(gloo_pool: Any, n: int, dtype: torch.dtype) -> None:
    numel = n * SHARD
    inputs = cb.make_inputs(n, numel, dtype)
    results = gloo_pool(n).run(cb.every_collective_body, inputs)
    simulated = SimWorld(n).run(cb.every_collective_body, inputs)
    for r, (res, sim) in enumerate(zip(results, simulated, strict=True)):
        exact(res["all_gather"], torch.cat(inputs))
        exact(res["broadcast"], inputs[n - 1])
        for op in ("max", "min"):
            exact(res[f"all_reduce/{op}"], ref_reduce(inputs, op))
        for op in ("sum", "avg"):
            rs, ar = res[f"reduce_scatter/{op}"], res[f"all_reduce/{op}"]
            exact(rs, ref_reduce_scatter(inputs, op, r))  # the pairwise transport: rank order
            if n == 2:  # one addition: SimWorld and gloo agree bitwise
                exact(rs, sim[f"reduce_scatter/{op}"])
                exact(ar, sim[f"all_reduce/{op}"])
            else:  # gloo's all-reduce adds in ring order
                atol = order_tolerance(inputs, op)
                torch.testing.assert_close(ar, ref_reduce(inputs, op), rtol=0, atol=atol)
        # gloo's AVG is its own SUM divided by N (not a multiplication by 1/N), at any N
        exact(res["reduce_scatter/avg"], res["reduce_scatter/sum"] / n)
        exact(res["all_reduce/avg"], res["all_reduce/sum"] / n)
        assert res["counters"] == sim["counters"] == expected_counters(n, numel, dtype.itemsize)



@pytest.mark.parametrize("n", [2, 3])
def test_gloo_works_waited_for_again_return_at_once(gloo_pool: Any, n: int) -> None:
    """Stage 3 waits for a reduction on a helper thread, then again on the thread that reads
    it: the second wait must return at once, with every transport and timeout (a second wait
    on gloo's point-to-point works waited for a message that never came: stage 3 over
    ``transport="shm"`` hung)."""
    inputs = cb.make_inputs(n, n * SHARD, torch.float32)
    for r, res in enumerate(gloo_pool(n).run(cb.wait_again_body, inputs)):
        assert len(res) == 6, res.keys()
        for key, (returned, gathered, shard) in res.items():
            assert returned, f"rank {r}: a second wait() hung ({key})"
            exact(gathered, torch.cat(inputs))
            torch.testing.assert_close(shard, ref_reduce_scatter(inputs, "sum", r), rtol=0,
                                       atol=order_tolerance(inputs, "sum"))  # gloo's ring order


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_transports_agree(gloo_pool: Any, n: int) -> None:
    """Pairwise sends (gloo's default) and the single-tensor collectives: the same results
    (bitwise at 2 ranks, one addition; pairwise always sums in rank order) and the same
    logical byte counts."""
    inputs = cb.make_inputs(n, n * SHARD, torch.float32)
    for r, res in enumerate(gloo_pool(n).run(cb.every_collective_by_transport_body, inputs)):
        pairwise, single = res["pairwise"], res["single"]
        exact(pairwise["all_gather"], single["all_gather"])
        for op in ("sum", "avg"):
            got, want = pairwise[f"reduce_scatter/{op}"], single[f"reduce_scatter/{op}"]
            exact(got, ref_reduce_scatter(inputs, op, r))
            if n == 2:
                exact(got, want)
            else:  # gloo's own reduce-scatter adds in its ring order
                torch.testing.assert_close(want, got, rtol=0, atol=order_tolerance(inputs, op))
        assert pairwise["counters"] == single["counters"]


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_collectives_in_place(gloo_pool: Any, n: int) -> None:
    """fzero's buckets gather into, and reduce out of, the rank's own chunk of one buffer: the
    default (pairwise) transport gives what separate tensors give, summing in rank order."""
    inputs = cb.make_inputs(n, n * SHARD, torch.float32)
    for r, res in enumerate(gloo_pool(n).run(cb.in_place_body, inputs)):
        exact(res["all_gather"], torch.cat([x[:SHARD] for x in inputs]))
        for op in ("sum", "avg"):
            want = ref_reduce_scatter(inputs, op, r)
            exact(res[f"reduce_scatter/{op}"], want)  # summed in rank order, as the reference


def test_unknown_transport_is_rejected(gloo_pool: Any) -> None:
    with pytest.raises(WorkerError, match="transport must be one of"):
        gloo_pool(2).run(cb.bad_transport_body)


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_single_collectives(gloo_pool: Any, n: int) -> None:
    pool = gloo_pool(n)
    small = cb.make_inputs(n, SHARD, torch.float32)
    big = cb.make_inputs(n, n * SHARD, torch.float32)
    for out in pool.run(cb.all_gather_body, small, async_op=True):
        exact(out, torch.cat(small))
    for r, out in enumerate(pool.run(cb.reduce_scatter_body, big, "sum", async_op=True)):
        torch.testing.assert_close(out, ref_reduce_scatter(big, "sum", r))
    for out in pool.run(cb.broadcast_body, small, 1, async_op=True):
        exact(out, small[1])
    for out in pool.run(cb.all_reduce_body, small, "max", async_op=True):
        exact(out, ref_reduce(small, "max"))


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_async_overlap(gloo_pool: Any, n: int) -> None:
    a, b = cb.make_inputs(n, 5, torch.float32), cb.make_inputs(n, 7, torch.float32, seed=1)
    for out_a, out_b, z in gloo_pool(n).run(cb.async_overlap_body, a, b):
        exact(out_a, torch.cat(a))
        exact(out_b, torch.cat(b))
        torch.testing.assert_close(z, ref_reduce(a, "sum"))


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_avg_fallback_matches_native_avg(gloo_pool: Any, n: int) -> None:
    inputs = cb.make_inputs(n, n * SHARD, torch.float32)
    pool = gloo_pool(n)
    native = pool.run(cb.every_collective_body, inputs)
    fallback = pool.run(cb.avg_fallback_body, inputs)
    for nat, fb in zip(native, fallback, strict=True):
        for key in ("reduce_scatter", "reduce_scatter/async"):
            exact(fb[key], nat["reduce_scatter/avg"])
        for key in ("all_reduce", "all_reduce/async"):
            exact(fb[key], nat["all_reduce/avg"])


def test_gloo_comm_with_timeout_and_subgroup(gloo_pool: Any) -> None:
    n = 3
    inputs = cb.make_inputs(n, n * SHARD, torch.float32)
    pool = gloo_pool(n)
    for res, ref in zip(
        pool.run(cb.timeout_comm_body, inputs),
        pool.run(cb.every_collective_body, inputs),
        strict=True,
    ):
        assert res.keys() == ref.keys()
        for key, value in ref.items():
            if isinstance(value, Tensor):
                exact(res[key], value)
            else:
                assert res[key] == value
    results = pool.run(cb.subgroup_body, inputs)
    assert results[0] is None
    sub_inputs = inputs[1:]
    for sub_rank, res in enumerate(results[1:]):
        assert (res["rank"], res["world_size"]) == (sub_rank, 2)
        exact(res["all_gather"], torch.cat(sub_inputs))
        exact(res["broadcast"], sub_inputs[1])
        exact(res["all_reduce"], sub_inputs[0] + sub_inputs[1])


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_fingerprint_check(gloo_pool: Any, n: int) -> None:
    pool = gloo_pool(n)
    assert pool.run(cb.fingerprint_body, ["x"] * n) == [None] * n
    values = [5] * (n - 1) + [6]
    for message in pool.run(cb.fingerprint_body, values):
        assert f"rank 0 has 0x5, but rank {n - 1}: 0x6" in message
    assert pool.run(cb.identity_body) == [(r, n, "TorchComm") for r in range(n)]


def test_gloo_worker_error_names_rank_and_pool_recovers(gloo_pool: Any) -> None:
    pool = gloo_pool(2)
    starts = pool.starts
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"failed on rank\(s\) \[1\]") as info:
        pool.run(cb.raise_on_rank_body, 1)
    assert time.monotonic() - t0 < 10
    assert info.value.ranks == [1]
    assert "ValueError: deliberate failure on rank 1" in info.value.tracebacks[1]
    assert isinstance(info.value.__cause__, ValueError)
    assert pool.run(cb.identity_body) == [(0, 2, "TorchComm"), (1, 2, "TorchComm")]
    assert pool.starts == starts + 1


# ----------------------------------------------------------------------------------------------
# init_distributed in this process


def test_init_distributed_single_process_fallback(bare_env: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    with distributed(backend="gloo", timeout=timedelta(seconds=30)) as comm:
        assert (comm.rank, comm.world_size, comm.backend) == (0, 1, "gloo")
        assert init_distributed().world_size == 1  # an existing group is reused
        with distributed() as inner:  # does not own the group: leaves it alone
            assert inner.rank == 0
        assert dist.is_initialized()
        res = cb.every_collective_body(comm, cb.make_inputs(1, 4, torch.float32))
        exact(res["all_gather"], cb.make_inputs(1, 4, torch.float32)[0])
        assert res["total"] == 0 and res["counters"]["calls"]["all_reduce"] == 4
        assert init_distributed(transport="shm").transport == "shm"  # for the returned comm
        with pytest.raises(ValueError, match="transport must be one of"):
            init_distributed(transport="ring")
    assert not dist.is_initialized()
    destroy_distributed()  # a no-op without a group
    # the comm after its block: a message saying so (torch's named no comm or block)
    with pytest.raises(ValueError, match="all_reduce on a TorchComm whose process group was "
                                         "destroyed .* use the comm inside the block"):
        comm.all_reduce(torch.zeros(2))
    # ... and inside a later block, whose new group is not its (torch's "Group ... is not
    # registered" or a gloo connection error, which rank got which by chance: a probe)
    with distributed(backend="gloo", timeout=timedelta(seconds=30)), pytest.raises(
            ValueError, match="all_reduce on a TorchComm whose process group was destroyed"):
        comm.all_reduce(torch.zeros(2))


def test_channels_time_out_as_the_group_does(bare_env: pytest.MonkeyPatch) -> None:
    """`fzero.distributed(timeout=T)`: fzero's own channels (the control rounds, stage 3's
    gathers) are new process groups, which torch gives its 30-minute default unless told; a
    stuck peer then hung a stage-3 step for as long as it was stuck, whatever T said (found by
    a probe). They inherit the comm's timeout, else its group's."""
    cpu = torch.device("cpu")
    with distributed(backend="gloo", timeout=timedelta(seconds=7)) as comm:
        assert comm.timeout is None  # waits are the group's own: no host-side bound
        for channel in (comm.channel("control", host=True), comm.channel("stage3.gather")):
            assert ftorchcomm._group_timeout(channel.group, cpu) == timedelta(seconds=7)
        own = TorchComm(timeout=3.0)
        assert ftorchcomm._group_timeout(own.channel("x").group, cpu) == timedelta(seconds=3)
    assert ftorchcomm._group_timeout(object(), cpu) is None  # a torch that does not tell


def test_torch_comm_collects_garbage_before_the_interpreter_exits(
    bare_env: pytest.MonkeyPatch,
) -> None:
    """A train step's reference cycles hold process groups; freed during finalization they
    abort the process (gloo: "terminate called without an active exception", 1 exit in 5 for
    bench_scale.py). Every TorchComm has them collected at exit, once however many exist."""
    import atexit
    import gc

    registered: list[object] = []
    bare_env.setattr(atexit, "register", registered.append)
    bare_env.setattr(atexit, "unregister", lambda f: registered.remove(f) if f in registered
                     else None)
    for _ in range(2):
        with distributed(backend="gloo"):
            pass
    assert registered == [gc.collect]


def test_init_distributed_from_torchrun_env(bare_env: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        bare_env.setenv(name, value)
    with distributed(backend="gloo") as comm:
        assert (comm.rank, comm.world_size) == (0, 1)
        x = torch.arange(3.0)
        comm.broadcast(x)
        exact(x, torch.arange(3.0))
    assert not dist.is_initialized()


def test_torchrun_restart_attempts_meet_in_the_agents_store_under_their_own_prefix(
    bare_env: pytest.MonkeyPatch,
) -> None:
    """torchrun's agent serves the store its workers meet in (its static rendezvous always, its
    c10d one by default) and keeps it across restarts: with ``env://`` a restarted group read
    the dead workers' keys and failed to connect or hung (pytorch/pytorch#135712), so fzero
    refused every restart, and told the user to set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which
    the static rendezvous ignores (a probe). Each attempt now keeps its keys under a prefix of
    its own: attempts 0 and 1 of a job meet in one agent store here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "TORCHELASTIC_MAX_RESTARTS": "2"}.items():
        bare_env.setenv(name, value)
    for attempt in ("0", "1"):
        bare_env.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        with distributed(backend="gloo", timeout=20) as comm:
            x = torch.ones(2)
            comm.all_reduce(x)
            exact(x, torch.ones(2))
        assert agent.check([f"fzero/attempt{attempt}/fzero/world_size/0"])
    assert not dist.is_initialized()


def test_a_restart_of_several_nodes_sharing_the_agents_store_is_refused_with_what_works(
    bare_env: pytest.MonkeyPatch,
) -> None:
    """Several nodes do not count restart attempts alike (torch's agent restarts a healthy
    node for another's failure without counting it), so a prefix per attempt would split
    the group: such a restart is refused at once, naming the launch that restarts (c10d with
    the store sharing off), and rank 0 warns at the first attempt (a review)."""
    from fzero.launch import _check_restart_store

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2",
                        "TORCHELASTIC_MAX_RESTARTS": "2",
                        "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        bare_env.setenv(name, value)
    with pytest.raises(RuntimeError, match="this process is restart 1 of a torchrun job.*"
                                           "--rdzv-backend c10d.*DISABLE_SHARE_RDZV"):
        init_distributed(backend="gloo")
    assert not dist.is_initialized()
    first = {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "2", "RANK": "0"}
    with pytest.warns(RuntimeWarning, match="a restart of this job would be refused"):
        _check_restart_store(first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per job: rank 0's
        _check_restart_store({**first, "RANK": "1"})
        _check_restart_store({**first, "TORCHELASTIC_MAX_RESTARTS": "0"})


def test_a_rank_started_twice_is_told_so_at_once() -> None:
    """Two processes that read one rank (SLURM_PROCID=1 twice, or a RANK exported by hand): the
    second waited out the whole timeout and then blamed a missing rank (a probe)."""
    from fzero.launch import LaunchEnv, _agree_on_world_size

    store = dist.HashStore()
    store.add("fzero/world_size/claimed/1", 1)  # the first process of rank 1 came first
    env = LaunchEnv("slurm", 1, 2, 0, "127.0.0.1", 29500)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 was started twice: another process of this "
                                           "job read SLURM_PROCID=1 too"):
        _agree_on_world_size(store, env, timedelta(seconds=30))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("launcher", ["slurm", "torchrun"])
def test_a_rendezvous_nobody_else_joins_says_how_ranks_start(
    bare_env: pytest.MonkeyPatch, launcher: str
) -> None:
    """An sbatch script run without `srun` is one process of SLURM_NTASKS: it waited the whole
    timeout and failed with torch's "1/2 clients joined" (a probe). The error says how each
    launcher starts every rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    names = (("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if launcher == "slurm"
             else ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    for name, value in zip(names, ("0", "2", "0"), strict=True):
        bare_env.setenv(name, value)
    bare_env.setenv("MASTER_ADDR", "127.0.0.1")
    bare_env.setenv("MASTER_PORT", str(port))
    with pytest.raises(RuntimeError) as info:
        init_distributed(backend="gloo", timeout=timedelta(seconds=1))
    assert isinstance(info.value.__cause__, dist.DistStoreError)
    assert f"rank 0 of 2 waited 1 s at the rendezvous (127.0.0.1:{port}" in str(info.value)
    assert ("srun" if launcher == "slurm" else "torchrun --nnodes") in str(info.value)
    assert not dist.is_initialized()


def test_a_rank_that_cannot_reach_the_rendezvous_is_told_so(
    bare_env: pytest.MonkeyPatch
) -> None:
    """A rank other than 0 with no rank 0 to connect to got torch's bare DistNetworkError
    (a client socket timeout and two C++ stack traces), not fzero's help (a probe)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket closes
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        bare_env.setenv(name, value)
    with pytest.raises(RuntimeError) as info:
        init_distributed(backend="gloo", timeout=timedelta(seconds=1))
    assert isinstance(info.value.__cause__, dist.DistNetworkError)
    assert str(info.value).startswith(
        f"rank 1 of 2 could not connect to the rendezvous (127.0.0.1:{port}, launcher "
        f"torchrun) (DistNetworkError: ")
    assert "the store is opened by rank 0 on that host and port" in str(info.value)
    assert not dist.is_initialized()


_DISAGREEING_RANK = """
import sys, time
from datetime import timedelta
from fzero.launch import init_distributed
start = time.monotonic()
try:
    init_distributed(backend="gloo", timeout=timedelta(seconds=60))
except RuntimeError as exc:
    print(exc)
    print(f"raised after {time.monotonic() - start:.1f} s")
    sys.exit(3)
"""


def _raised_after(out: str) -> float:
    """The seconds `_DISAGREEING_RANK` spent in `init_distributed` before it raised."""
    return float(re.findall(r"raised after ([0-9.]+) s", out)[-1])


def _start_ranks(script: str, names: tuple[str, str, str], sizes: dict[int, str]
                 ) -> list[subprocess.Popen[str]]:
    """One process per rank of `sizes` (rank -> the world size it reads) running `script`,
    with the launcher variables `names` (rank, world size, local rank) set by hand."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return [subprocess.Popen(
        [sys.executable, "-c", script],
        env={**base, names[0]: str(rank), names[1]: size, names[2]: "0",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank, size in sizes.items()]


@pytest.mark.parametrize("launcher", ["slurm", "torchrun"])
def test_ranks_that_read_different_world_sizes_are_told_so_at_once(launcher: str) -> None:
    """Ranks 0-2 of a job, one of which read a larger world size (a WORLD_SIZE or SLURM_NTASKS
    exported by hand): every rank raises within seconds, naming what each read. Torch's
    rendezvous let rank 0 pass and hang in gloo's first connection, and the others wait out
    their timeout (75 s with a 15 s timeout, with a hint about srun that did not apply)."""
    names = (("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if launcher == "slurm"
             else ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    variable = names[1]
    procs = _start_ranks(_DISAGREEING_RANK, names, {0: "3", 1: "4", 2: "3"})
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [3, 3, 3], outs
    # Within half the 60 s timeout (a rank that waits it out would report 60 or more); time
    # measured inside each rank, as a loaded machine can take seconds to start Python and torch.
    assert all(_raised_after(out) < 30 for out in outs), outs
    told = (f"rank 0 read {variable}=3 but rank(s) [1] read [4]",  # rank 0 compared them all
            f"rank 1 read {variable}=4 but rank 0 read {variable}=3")  # or heard from rank 1
    assert told[1] in outs[1], outs[1]
    assert all(any(text in out for text in told) for out in outs), outs
    assert all("disagree on its world size" in out for out in outs)
    # Rank 0 reads the larger size: it waited its whole timeout for a rank that never comes,
    # while the rank that read less knew at once (a probe); it now hears so from that rank.
    procs = _start_ranks(_DISAGREEING_RANK, names, {0: "3", 1: "2"})
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [3, 3], outs
    assert all(_raised_after(out) < 30 for out in outs), outs
    assert all(f"rank 1 read {variable}=2 but rank 0 read {variable}=3" in out
               for out in outs), outs


_TWO_GROUPS = """
from datetime import timedelta
import torch
import fzero
for block in range(2):
    with fzero.distributed(backend="gloo", timeout=timedelta(seconds=20)) as comm:
        x = torch.ones(1)
        comm.all_reduce(x, op="sum")
        print(f"block {block}: {x.item()}", flush=True)
"""


def test_a_second_group_in_the_same_processes_rendezvouses_afresh() -> None:
    """Two ``with fzero.distributed()`` blocks in a row in the same two processes, on the same
    port: rank 0's first store (kept by the first block's comm) serves the second group too,
    and neither the world-size agreement's keys nor gloo's of the first group may leak into
    the second (rank 0 could not open a second server, and a rank read the first group's keys
    and hung in gloo's connection: a probe)."""
    procs = _start_ranks(_TWO_GROUPS, ("RANK", "WORLD_SIZE", "LOCAL_RANK"), {0: "2", 1: "2"})
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("block 0: 2.0" in out and "block 1: 2.0" in out for out in outs), outs


def test_init_distributed_names_missing_variable(bare_env: pytest.MonkeyPatch) -> None:
    bare_env.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE is not set"):
        init_distributed(backend="gloo")
    assert not dist.is_initialized()


def test_init_distributed_takes_seconds_and_refuses_a_timeout_not_above_zero(
        bare_env: pytest.MonkeyPatch) -> None:
    """Seconds, as `TorchComm(timeout=)` takes, failed in the store's constructor (TypeError
    from pybind) or in the world-size agreement (AttributeError); a timedelta of 0 or less
    failed the rendezvous saying rank 0's store could not be reached (a probe)."""
    for bad, error in ((timedelta(0), ValueError), (timedelta(seconds=-5), ValueError),
                       (float("nan"), ValueError), ("5", TypeError), (True, TypeError)):
        with pytest.raises(error, match="timeout must be"):
            init_distributed(backend="gloo", timeout=bad)
        assert not dist.is_initialized()
    with distributed(backend="gloo", timeout=5) as comm:
        assert comm.world_size == 1
        assert ftorchcomm._group_timeout(None, comm.device) == timedelta(seconds=5)


# ----------------------------------------------------------------------------------------------
# Tier 3: CUDA (NCCL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_every_collective(bare_env: pytest.MonkeyPatch) -> None:
    inputs = [x.cuda() for x in cb.make_inputs(1, 8, torch.float32)]
    with distributed(backend="nccl") as comm:
        assert comm.device.type == "cuda"
        res = cb.every_collective_body(comm, inputs)
        for key, value in res.items():
            if isinstance(value, Tensor):
                assert value.is_cuda
                exact(value, inputs[0][: value.numel()] if "scatter" in key else inputs[0])
        res = cb.async_overlap_body(comm, inputs, inputs)
        torch.cuda.synchronize()
        exact(res[0], inputs[0])
        # NCCL gathers into, and reduces out of, the rank's own chunk of one buffer
        assert comm.in_place
        res = cb.in_place_body(comm, inputs)
        exact(res["all_gather"], inputs[0][: res["all_gather"].numel()])
        for op in ("sum", "avg"):
            exact(res[f"reduce_scatter/{op}"], inputs[0][: res[f"reduce_scatter/{op}"].numel()])
        cb.fingerprint_body(comm, ["same"])


@pytest.mark.parametrize(("world", "named"), [
    (2, "the connection to rank 1 (the only other rank) broke: it most likely exited"),
    (3, "a connection to another rank broke: one most likely exited or crashed"),
])
def test_a_broken_connection_says_which_rank_it_can_be(world: int, named: str) -> None:
    """gloo names only the peer's address when a rank dies ("Connection reset by peer
    [127.0.0.1]:8357"); with two ranks the dead one can only be the other (a probe saw a
    rank's death reported by address only)."""
    comm = fcomm.CommBase(0, world)  # the error context every implementation shares

    def start() -> None:
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:8357: Connection reset by peer")

    with pytest.raises(fcomm.CollectiveError) as info:
        comm._named("all_gather", "of the step statistics", start)
    assert not isinstance(info.value, fcomm.CollectiveTimeout)
    assert named in str(info.value)

    def other() -> None:
        raise RuntimeError("input sizes differ")

    with pytest.raises(fcomm.CollectiveError) as info:
        comm._named("all_gather", None, other)
    assert "broke" not in str(info.value)


@pytest.mark.parametrize(("transport", "backend", "chosen"), [
    (None, "gloo", "pairwise"), (None, "nccl", "single"), ("single", "nccl", "single"),
    ("single", "gloo", "single"), ("pairwise", "gloo", "pairwise"), ("shm", "gloo", "shm"),
])
def test_choose_transport_defaults_and_keeps_what_the_backend_runs(transport, backend,
                                                                    chosen) -> None:
    assert ftorchcomm.choose_transport(transport, backend) == chosen


@pytest.mark.parametrize(("transport", "match"), [
    ("pairwise", "ungrouped point-to-point"), ("shm", "moves CPU tensors")])
def test_pairwise_and_shm_are_refused_off_gloo(transport: str, match: str) -> None:
    """Pairwise was accepted on NCCL, where its ungrouped receives and sends would deadlock
    (NCCL runs a rank's point-to-point operations in order on one stream: a static review)."""
    with pytest.raises(ValueError, match=f"{match}.*it needs gloo, not nccl"):
        ftorchcomm.choose_transport(transport, "nccl")
    with pytest.raises(ValueError, match="transport must be one of"):
        ftorchcomm.choose_transport("ring", "gloo")


def _reference_signature(codes: list[tuple[int, str | None, int, str]]) -> int:
    """The running hash of `CommBase.signature`, computed from scratch for every collective."""
    import hashlib

    signature = 0
    for code in codes:
        digest = hashlib.blake2b(repr(code).encode(), digest_size=8).digest()
        signature = (signature * 1_000_003 + int.from_bytes(digest, "little")) % (2**61 - 1)
    return signature


def test_signature_equals_the_uncached_hash_also_past_the_cache(monkeypatch) -> None:
    """A comm hashes each collective's (kind, op, numel, dtype) once and reuses it: the
    signature must stay the from-scratch hash, for a reused hash before and after the bounded
    cache was cleared, and the cache must stay within its bound."""
    monkeypatch.setattr(fcomm, "_DIGESTS_KEPT", 3)
    sizes = (4, 4, 8, 12, 16, 4, 4)  # hit, three misses, a clear at 16, a miss, a hit

    def body(comm: Comm) -> tuple[int, int]:
        for n in sizes:
            comm.all_reduce(torch.ones(n), op="sum")
        return comm.signature, len(comm._digests)

    codes = [(COLLECTIVES.index("all_reduce"), "sum", n, "torch.float32") for n in sizes]
    [(signature, kept)] = SimWorld(1).run(body)
    assert signature == _reference_signature(codes)
    assert kept <= 3


def _open_a_channel_that_times_out(comm: Comm) -> Any:
    def late(key: str, host: bool) -> Comm:
        raise RuntimeError("Wait timeout")  # torch's store barrier in new_group

    comm._open_channel = late  # type: ignore[method-assign]
    with comm.scope("train step 1"):
        try:
            comm.channel("control", host=True)
        except fcomm.CollectiveTimeout as error:
            return str(error)
    return None


def test_opening_a_channel_that_times_out_raises_collective_timeout() -> None:
    """A rank late to the first step: opening fzero's channel (a new process group) timed out
    with torch's bare ``RuntimeError: Wait timeout``, naming no collective or step (a probe).
    It is a `CollectiveTimeout` naming the channel and the step."""
    for message in SimWorld(2).run(_open_a_channel_that_times_out):
        assert message is not None and "opening channel 'control@host' during train step 1" in (
            message) and "Wait timeout" in message


def test_simworld_ranks_run_without_automatic_garbage_collection() -> None:
    """Two ranks recomputing checkpointed regions hung in a test run: torch's get_rng_state
    held the generator's mutex while an automatic collection freed an autograd graph, whose
    destructor let go of the GIL, which the other rank took to wait for that mutex. Ranks run
    with automatic collection off (explicit `gc.collect()` still works), restored after the
    run, also after a rank raised."""
    def body(comm: Any) -> tuple[bool, int]:
        return gc.isenabled(), gc.collect() >= 0

    assert gc.isenabled()
    assert SimWorld(2).run(body) == [(False, True)] * 2
    assert gc.isenabled()

    def failing(comm: Any) -> None:
        raise RuntimeError("rank failed")

    with pytest.raises(SimWorldError):
        SimWorld(2).run(failing)
    assert gc.isenabled()
    gc.disable()
    try:
        SimWorld(1).run(body)
        assert not gc.isenabled()  # (left as it was)
    finally:
        gc.enable()
