"""Properties of fzero.schedule's pure functions: the collective order every rank follows."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fzero.schedule import (
    ABORTED,
    DONE,
    FAILED,
    HEADER_WIDTH,
    RUNNING,
    agreed,
    failed_ranks,
    fingerprint,
    header,
    merge,
    next_position,
    phase_over,
    reduce_order,
    serve,
)

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


@given(st.sampled_from([RUNNING, DONE, FAILED, ABORTED]), st.none() | buckets, sequences,
       sequences)
def test_header_carries_the_fingerprint(status: int, need: int | None, used: list[int],
                                        other: list[int]) -> None:
    row = header(status, need, used)
    assert len(row) == HEADER_WIDTH and row[:2] == [status, -1 if need is None else need]
    assert row[2] * 2**30 + row[3] == fingerprint(used) < 2**60
    assert all(0 <= x < 2**31 for x in row[2:])  # fits the int64 exchange with room
    assert agreed([row, header(DONE, None, used)])
    assert agreed([row, header(DONE, None, other)]) == (fingerprint(used) == fingerprint(other))
    if tuple(used) == tuple(other):
        assert agreed([row, header(DONE, None, other)])


def test_header_validates() -> None:
    with pytest.raises(ValueError, match="unknown round status"):
        header(7, None, [])
    with pytest.raises(ValueError, match="need=-2"):
        header(RUNNING, -2, [])


@given(st.sets(buckets, max_size=7).map(sorted), sequences)
def test_reduce_order_is_a_permutation_of_the_trainable(trainable: list[int],
                                                        backward: list[int]) -> None:
    order = reduce_order(trainable, backward)
    assert sorted(order) == trainable
    last = {b: i for i, b in enumerate(backward)}
    seen = [b for b in order if b in last]
    assert seen == sorted(seen, key=last.__getitem__)  # by completion in the agreed backward
    rest = [b for b in order if b not in last]
    assert order == (*seen, *rest) and rest == sorted(rest, reverse=True)
    assert reduce_order(trainable + trainable, backward) == order  # duplicates ignored


@given(sequences, buckets, st.integers(-3, 14))
def test_next_position_is_the_first_occurrence_at_or_after_start(
    sequence: list[int], bucket: int, start: int
) -> None:
    position = next_position(sequence, bucket, start)
    expected = next((i for i in range(len(sequence)) if i >= start and sequence[i] == bucket),
                    None)
    assert position == expected
