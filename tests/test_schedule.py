"""Properties of fzero.schedule's pure functions: the collective order every rank follows."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.buckets import Reducer
from fzero.schedule import (
    ABORTED,
    DONE,
    FAILED,
    HEADER_WIDTH,
    HELD_SLOTS,
    RUNNING,
    agreed,
    carried,
    failed_ranks,
    fingerprint,
    header,
    merge,
    next_position,
    phase_over,
    reduce_order,
    serve,
)

import step_bodies as sb
from models import TinyGPT

buckets = st.integers(0, 6)
sequences = st.lists(buckets, max_size=12)


def is_subsequence(small: Sequence[int], big: Sequence[int]) -> bool:
    it = iter(big)
    return all(any(x == y for y in it) for x in small)


def test_is_subsequence_helper() -> None:
    assert is_subsequence([1, 3], [1, 2, 3]) and not is_subsequence([3, 1], [1, 2, 3])
    assert is_subsequence([], []) and not is_subsequence([1, 1], [1])


@given(st.lists(sequences, min_size=1, max_size=4))
def test_merge_is_a_common_supersequence(inputs: list[list[int]]) -> None:
    merged = merge(inputs)
    assert all(is_subsequence(s, merged) for s in inputs)
    assert len(merged) <= sum(len(s) for s in inputs)
    assert merge(inputs) == merged  # a function of the list: every rank merges alike


def lcs(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of a longest common subsequence (the textbook table)."""
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1],
                                                                     table[i + 1][j])
    return table[-1][-1]


@given(sequences, sequences)
def test_merge_of_two_is_shortest(a: list[int], b: list[int]) -> None:
    assert len(merge([a, b])) == len(a) + len(b) - lcs(a, b)


@given(sequences, st.integers(1, 4))
def test_merge_of_equal_sequences_is_the_sequence(sequence: list[int], copies: int) -> None:
    assert merge([sequence] * copies) == tuple(sequence)


@given(sequences, st.data())
def test_a_subsequence_merges_to_the_longer(sequence: list[int], data: st.DataObject) -> None:
    """A rank that skipped blocks used a subsequence: the merge is the others' sequence."""
    keep = data.draw(st.lists(st.booleans(), min_size=len(sequence), max_size=len(sequence)))
    sub = [x for x, k in zip(sequence, keep, strict=True) if k]
    assert merge([sequence, sub]) == tuple(sequence)
    assert merge([sub, sequence]) == tuple(sequence)
    assert merge([sub, sequence, sub]) == tuple(sequence)


def test_merge_examples() -> None:
    assert merge([[0, 1, 2], [2, 1, 0]]) in ((0, 1, 2, 1, 0), (2, 1, 0, 1, 2), (0, 2, 1, 2, 0))
    assert len(merge([[0, 1, 2], [2, 1, 0]])) == 5  # shortest: 3 + 3 - LCS 1
    assert merge([]) == ()


headers = st.lists(
    st.tuples(st.sampled_from([RUNNING, DONE, FAILED, ABORTED]), st.integers(-1, 6)),
    min_size=1, max_size=5,
)


@given(headers)
def test_serve_is_each_need_once_in_rank_order(rows: list[tuple[int, int]]) -> None:
    table = [[status, need, 0, 0] for status, need in rows]
    served = serve(table)
    assert served == serve(table)
    assert len(served) == len(set(served))
    needs = [need for _, need in rows if need >= 0]
    assert set(served) == set(needs)
    assert served == sorted(set(needs), key=needs.index)  # first asked, first served


@given(headers)
def test_round_summaries(rows: list[tuple[int, int]]) -> None:
    table = [[status, need, 0, 0] for status, need in rows]
    assert phase_over(table) == (RUNNING not in [status for status, _ in rows])
    assert failed_ranks(table) == [r for r, (status, _) in enumerate(rows) if status == FAILED]


held_sets = st.lists(buckets, max_size=HELD_SLOTS, unique=True)


@given(st.sampled_from([RUNNING, DONE, FAILED, ABORTED]), st.none() | buckets, sequences,
       sequences, held_sets)
def test_header_carries_the_fingerprint(status: int, need: int | None, used: list[int],
                                        other: list[int], held: list[int]) -> None:
    row = header(status, need, used, held)
    assert len(row) == HEADER_WIDTH and row[:2] == [status, -1 if need is None else need]
    assert row[2] * 2**30 + row[3] == fingerprint(used) < 2**60
    assert all(0 <= x < 2**31 for x in row[2:4])  # fits the int64 exchange with room
    assert row[4:] == held + [-1] * (HELD_SLOTS - len(held))
    assert agreed([row, header(DONE, None, used)])
    assert agreed([row, header(DONE, None, other)]) == (fingerprint(used) == fingerprint(other))
    if tuple(used) == tuple(other):
        assert agreed([row, header(DONE, None, other)])


def test_header_validates() -> None:
    with pytest.raises(ValueError, match="unknown round status"):
        header(7, None, [])
    with pytest.raises(ValueError, match="need=-2"):
        header(RUNNING, -2, [])
    with pytest.raises(ValueError, match="held=-1"):
        header(DONE, None, [], [-1])
    with pytest.raises(ValueError, match="at most 2 distinct"):
        header(DONE, None, [], [3, 3])
    with pytest.raises(ValueError, match="at most 2 distinct"):
        header(DONE, None, [], [1, 2, 3])


@given(st.lists(held_sets, min_size=1, max_size=4), sequences)
def test_carried_is_what_every_rank_holds_and_the_next_phase_starts_with(
        held: list[list[int]], following: list[int]) -> None:
    rows = [header(DONE, None, [], h) for h in held]
    carry = carried(rows, following)
    # a start of the next phase's sequence, of distinct buckets every rank holds
    assert tuple(following[: len(carry)]) == carry and len(set(carry)) == len(carry)
    assert all(set(carry) <= set(h) for h in held)
    # the longest such start: the next position is not held by some rank, or repeats one kept
    rest = following[len(carry):]
    assert not rest or any(rest[0] not in h for h in held) or rest[0] in carry


def test_carried_examples() -> None:
    done = [header(DONE, None, [0, 1], [1]), header(DONE, None, [0, 1], [1])]
    assert carried(done, (1, 0)) == (1,)
    assert carried(done, (0, 1)) == ()  # backward starts elsewhere
    assert carried(done, ()) == ()  # no sequence yet (the first step)
    assert carried([done[0], header(DONE, None, [0, 1])], (1, 0)) == ()  # rank 1 holds none
    assert carried([done[0], header(DONE, None, [0, 1], [0])], (1, 0)) == ()
    two = [header(DONE, None, [0, 1], [1, 0]), header(DONE, None, [1, 0], [0, 1])]
    assert carried(two, (1, 0, 2)) == (1, 0)  # both, in backward's order
    assert carried(two, (1, 2, 0)) == (1,)  # the second position is not held
    assert carried(two, (1, 1)) == (1,)  # a bucket is carried once
    assert carried([two[0], done[0]], (1, 0)) == (1,)  # what every rank holds
    assert carried([two[0], done[0]], (0, 1)) == ()  # rank 1 does not hold 0


@given(st.sets(buckets, max_size=7).map(sorted), sequences)
def test_reduce_order_is_a_permutation_of_the_trainable(trainable: list[int],
                                                        forward: list[int]) -> None:
    order = reduce_order(trainable, forward)
    assert sorted(order) == trainable
    first = {}
    for position, bucket in enumerate(forward):
        first.setdefault(bucket, position)
    unused = [b for b in order if b not in first]
    used = [b for b in order if b in first]
    assert order == (*unused, *used) and unused == sorted(unused, reverse=True)
    positions = [first[b] for b in used]  # by completion: the latest first use completes first
    assert positions == sorted(positions, reverse=True)
    assert reduce_order(trainable + trainable, forward) == order  # duplicates ignored


def test_reduce_order_puts_a_tied_embedding_last() -> None:
    # A tied GPT's forward: embedding bucket 0, blocks 1-3, the head (bucket 0 again). Its
    # gradient completes only when backward reaches the embedding, after every block: the
    # first use, not the last, decides. (Ordered by the last use, bucket 0 went first and
    # every block's gradient waited for the end of backward: the whole model's gradients
    # alive at once.)
    assert reduce_order([0, 1, 2, 3, 4], [0, 1, 2, 3, 0]) == (4, 3, 2, 1, 0)
    assert reduce_order([0, 1, 2], []) == (2, 1, 0)  # no sequence: reverse parameter order


@given(sequences, buckets, st.integers(-3, 14))
def test_next_position_is_the_first_occurrence_at_or_after_start(
    sequence: list[int], bucket: int, start: int
) -> None:
    position = next_position(sequence, bucket, start)
    expected = next((i for i in range(len(sequence)) if i >= start and sequence[i] == bucket),
                    None)
    assert position == expected


def test_reducer_reorders_only_between_rounds_and_only_to_a_permutation() -> None:
    def body(comm: Any) -> tuple[int, ...]:
        params = {f"w{i}": torch.ones(3) for i in range(3)}
        layout = fzero.plan(params, comm.world_size, buckets=[["w0"], ["w1"], ["w2"]])
        leaves = [[torch.ones(3, requires_grad=True)] for _ in range(3)]
        grads = [torch.zeros(b.padded_numel // comm.world_size) for b in layout.buckets]
        reducer = Reducer(comm, layout, leaves, grads, (2, 1, 0), mode="scatter_leaves")
        with pytest.raises(ValueError, match="must permute the old one"):
            reducer.reorder((2, 1))
        reducer.reorder((0, 2, 1))
        reducer.complete(0)  # launched: the order is in use until `finish`
        with pytest.raises(RuntimeError, match="only between rounds"):
            reducer.reorder((2, 1, 0))
        reducer.launch_rest()
        reducer.finish()
        reducer.reorder((2, 1, 0))
        return reducer.order

    assert fzero.SimWorld(2).run(body) == [(2, 1, 0), (2, 1, 0)]


def test_reducer_reuses_one_flat_buffer_for_buckets_reduced_one_after_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stages 2 and 3 copy each bucket's gradient into a flat buffer to reduce it: a settled
    reduction's buffer serves the next bucket (a fresh bucket-sized block per bucket costs page
    faults on CPU: 11% of a 300M-parameter stage-2 step)."""
    flats: list[Any] = []  # their storages, kept alive: a freed block's address may come back
    real = fzero.buckets.reduce_scatter_bucket

    def logged(comm: Any, bucket: Any, flat: torch.Tensor, **kwargs: Any) -> Any:
        flats.append(flat.untyped_storage())
        return real(comm, bucket, flat, **kwargs)

    monkeypatch.setattr(fzero.buckets, "reduce_scatter_bucket", logged)

    def body(comm: Any) -> list[list[float]]:
        params = {"w0": torch.ones(4), "w1": torch.ones(3), "w2": torch.ones(4)}
        layout = fzero.plan(params, comm.world_size, buckets=[["w0"], ["w1"], ["w2"]])
        leaves = [[torch.zeros(b.numel)] for b in layout.buckets]
        for i, [leaf] in enumerate(leaves):
            leaf.grad = torch.full_like(leaf, float(i + comm.rank))
        grads = [torch.zeros(b.padded_numel // comm.world_size) for b in layout.buckets]
        reducer = Reducer(comm, layout, leaves, grads, (2, 1, 0), mode="scatter_leaves")
        for index in (2, 1, 0):
            reducer.complete(index)
        return [g.tolist() for g in reducer.finish()]

    rank0, rank1 = fzero.SimWorld(2).run(body)  # the mean of i + rank: i + 0.5, padding 0
    assert rank0 == [[0.5] * 2, [1.5] * 2, [2.5] * 2]
    assert rank1 == [[0.5] * 2, [1.5, 0.0], [2.5] * 2]
    assert len(flats) == 6 and len({f.data_ptr() for f in flats}) == 2  # one per rank


@pytest.mark.parametrize("stage", [2, 3])
def test_no_flat_gradient_buffer_outlives_its_step(stage: int, gloo_pool: Any) -> None:
    """The spare buffers are dropped when a round ends, not when the garbage collector reaches
    the step's reference cycles (until then, at 1.8M parameters on gloo, stage 3 grew by one
    7 MB bucket per step)."""
    alive, launched = zip(*gloo_pool(2).run(sb.flat_buffers_alive_after_steps, stage, 3),
                          strict=True)
    assert alive == (0, 0) and launched == (3 * 4, 3 * 4)  # 3 steps, 4 trainable buckets


class Unfinished:
    """A collective's `Pending` that completes only when waited for, as a slow transport's
    would: records whether it was."""

    def __init__(self, pending: Any) -> None:
        self.pending, self.waited = pending, False

    def wait(self) -> Any:
        self.waited = True
        return self.pending.wait()

    def wait_host(self) -> None:
        self.waited = True
        self.pending.wait_host()

    def is_completed(self) -> bool:
        return self.waited


def test_stage1_reducer_settles_each_reduction_before_launching_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stage 1 reduce-scatters each bucket's full gradient as backward completes it. gloo's
    pairwise transport receives every peer's chunk into a scratch buffer, so reductions left in
    flight for a whole backward held one such buffer per bucket (+335 MiB per rank at 300M
    parameters): the previous reduction is settled before the next launches."""
    live: dict[int, list[Any]] = {0: [], 1: []}
    outstanding: dict[int, list[int]] = {0: [], 1: []}  # per rank, unsettled at each launch
    real = fzero.buckets.reduce_scatter_bucket

    def logged(comm: Any, bucket: Any, flat: torch.Tensor, **kwargs: Any) -> Any:
        outstanding[comm.rank].append(sum(not p.waited for p in live[comm.rank]))
        live[comm.rank].append(Unfinished(real(comm, bucket, flat, **kwargs)))
        return live[comm.rank][-1]

    monkeypatch.setattr(fzero.buckets, "reduce_scatter_bucket", logged)

    def body(comm: Any) -> list[list[float]]:
        params = {"w0": torch.ones(4), "w1": torch.ones(3), "w2": torch.ones(4)}
        layout = fzero.plan(params, comm.world_size, buckets=[["w0"], ["w1"], ["w2"]])
        leaves = [[torch.zeros(b.numel)] for b in layout.buckets]
        grads = [torch.full((b.padded_numel,), float(i + comm.rank))
                 for i, b in enumerate(layout.buckets)]
        reducer = Reducer(comm, layout, leaves, grads, (2, 1, 0), mode="scatter_full")
        for index in (2, 1, 0):
            reducer.complete(index)
        return [g.tolist() for g in reducer.finish()]

    rank0, rank1 = fzero.SimWorld(2).run(body)  # the mean of i + rank: i + 0.5
    assert rank0 == [[0.5] * 2, [1.5] * 2, [2.5] * 2]
    assert rank1 == [[0.5] * 2, [1.5] * 2, [2.5] * 2]
    assert outstanding == {0: [0, 0, 0], 1: [0, 0, 0]}


def stalled_round(comm: Any, joined: Any, patience: float) -> tuple[list[Any], list[float]]:
    """Three buckets reduced with `patience`; rank 1 launches its reductions only once rank 0
    has launched all of its own (a peer on another path, waiting for this rank to go on)."""
    params = {f"w{i}": torch.ones(4) for i in range(3)}
    layout = fzero.plan(params, comm.world_size, buckets=[["w0"], ["w1"], ["w2"]])
    leaves = [[torch.zeros(b.numel)] for b in layout.buckets]
    for i, [leaf] in enumerate(leaves):
        leaf.grad = torch.full_like(leaf, float(i + comm.rank))
    grads = [torch.zeros(b.shard_numel) for b in layout.buckets]
    reducer = Reducer(comm, layout, leaves, grads, (2, 1, 0), mode="scatter_leaves",
                      patience=patience)
    if comm.rank == 1:
        assert joined.wait(timeout=30)
    for index in (2, 1, 0):
        reducer.complete(index)
    if comm.rank == 0:
        joined.set()
    out = [g.tolist() for g in reducer.finish()]
    reducer.close()
    return out, reducer.rates


def test_a_stalled_reduction_is_waited_for_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3 settles the previous reduction before copying the next bucket, within a patience.
    Once a wait gave up, what was launched after it cannot finish first (one channel, in
    order): each later launch waited its full patience again, 20 times per micro-batch for a
    model whose ranks exit early at different blocks (1-2 s per step of a 10-parameter model).
    A rank now waits once, collects the stalled reductions when they are done, and times none
    of them (their durations are the stall's, not a reduction's)."""
    waits: dict[int, int] = {0: 0, 1: 0}
    real = Reducer._patience

    def counted(self: Reducer, numel: int) -> float:
        waits[self.comm.rank] += 1
        return real(self, numel)

    monkeypatch.setattr(Reducer, "_patience", counted)
    joined = threading.Event()
    (out0, rates0), (out1, rates1) = fzero.SimWorld(2, copy_args=False).run(stalled_round, joined,
                                                                           0.05)
    assert out0 == out1 == [[0.5, 0.5], [1.5, 1.5], [2.5, 2.5]]  # the mean of i + rank
    assert waits[0] == 1  # before: 2, one per launch after the first
    assert rates0 == []  # every reduction of rank 0 was in flight during its stall
    assert len(rates1) == 3  # rank 1's were not: each took what a reduction takes


def test_scatter_leaves_copies_the_first_round_and_adds_the_rest() -> None:
    """Stages 2-3 do not zero the gradient shards before a step: each bucket's first reduction
    is copied into its shard, later micro-batches' are added; a bucket no round reduced (none
    does in a step: every round launches every bucket) is zeroed rather than left stale."""

    def body(comm: Any) -> list[list[float]]:
        params = {"w0": torch.ones(4), "w1": torch.ones(4)}  # no padding: alike on each rank
        layout = fzero.plan(params, comm.world_size, buckets=[["w0"], ["w1"]])
        leaves = [[torch.zeros(b.numel, requires_grad=True)] for b in layout.buckets]
        grads = [torch.full((b.shard_numel,), 99.0) for b in layout.buckets]  # stale values
        reducer = Reducer(comm, layout, leaves, grads, (1, 0), mode="scatter_leaves")
        out = []
        for round_ in (1, 2):  # two micro-batches: gradients round + rank on every leaf
            for bucket_leaves, bucket in zip(leaves, layout.buckets, strict=True):
                bucket_leaves[0].grad = torch.full((bucket.numel,), float(round_ + comm.rank))
            for index in (1, 0):
                reducer.complete(index)
            out.append([g.tolist() for g in reducer.finish()])
        idle = Reducer(comm, layout, leaves, grads, (1, 0), mode="scatter_leaves")
        out.append([g.tolist() for g in idle.finish()])  # nothing reduced: zeros, not 99
        return out

    for first, second, idle in fzero.SimWorld(2).run(body):  # means: round + 0.5
        assert first == [[1.5, 1.5], [1.5, 1.5]]
        assert second == [[4.0, 4.0], [4.0, 4.0]]  # 1.5 + 2.5
        assert idle == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_publish_with_a_bounded_window(
    monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    """After the optimizer step, stages 1-2 all-gather every updated bucket. A transport that
    stages each chunk until its peers have read it (shared memory) held Ψ/N for the whole
    publish when all were issued before any was waited: at most `PUBLISH_IN_FLIGHT` are in
    flight at each launch, and the parameters are those of the unwindowed run."""
    live: dict[int, list[Unfinished]] = {0: [], 1: []}
    outstanding: dict[int, list[int]] = {0: [], 1: []}
    real = fzero.step.all_gather_bucket

    def logged(comm: Any, bucket: Any, shard: torch.Tensor, **kwargs: Any) -> Any:
        outstanding[comm.rank].append(sum(not p.waited for p in live[comm.rank]))
        live[comm.rank].append(Unfinished(real(comm, bucket, shard, **kwargs)))
        return live[comm.rank][-1]

    model = TinyGPT(n_layer=3)
    batches = [TinyGPT.make_batch(seed, 4) for seed in range(2)]
    expected = fzero.SimWorld(2).run(sb.train_body, model, batches, 2, stage=stage)
    monkeypatch.setattr(fzero.step, "all_gather_bucket", logged)
    got = fzero.SimWorld(2).run(sb.train_body, model, batches, 2, stage=stage)
    buckets = len(got[0]["layout"].buckets)
    for rank in (0, 1):
        assert len(outstanding[rank]) >= 2 * buckets  # every bucket, each step
        assert max(outstanding[rank]) == fzero.step.PUBLISH_IN_FLIGHT - 1  # + the new one
        assert got[rank]["losses"] == expected[rank]["losses"]
        for name, value in expected[rank]["params"].items():
            torch.testing.assert_close(got[rank]["params"][name], value, rtol=0, atol=0)
