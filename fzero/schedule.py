"""Which collectives every rank issues, and in which order (pure: no tensor, no network).

[Note: one collective sequence per channel]
Every rank must issue the same collectives in the same order, with the same sizes, on each
channel (process group) of its comm; otherwise data of different buckets is silently summed
together (equal sizes) or the transport aborts (unequal sizes). fzero never lets that order
depend on what one rank's computation happened to do:

- Reductions of gradients (all stages) run on the main channel in one fixed order per step,
  `reduce_order`. A rank that completes a bucket early waits for the buckets before it; a
  bucket a rank did not use contributes zeros. A rank that skipped a layer still takes part,
  and the average is exactly that of one process which skipped the layer for those samples.
- Stage 3 all-gathers parameters on a channel of its own, following the sequence the previous
  step learned (`BucketOrder`), which is the same on every rank. A rank that needs a bucket
  later in the sequence takes part in the gathers before it (`next_position`) and drops what it
  does not need: skipping a block costs memory traffic, never a mismatch. A rank that needs a
  bucket the rest of the sequence does not hold (a block called again after its release, another
  order, the first step's guess being wrong) first takes part in the rest of the sequence, then
  asks for it in a *round* on a control channel: every rank all-gathers a small `header` (its
  status, the bucket it needs, a fingerprint of the sequence it used) and all of them then
  gather the same buckets, `serve(headers)`, in the same order. Ranks join rounds when they
  leave the sequence or finish the phase, and keep joining (status `DONE`) until
  `phase_over`. A regular step therefore costs one round per phase.
- The last round of a forward also carries the buckets each rank still holds from its last
  uses (up to `HELD_SLOTS`: the last one, and the one before it if still gathered). The
  positions the backward's sequence starts with that every rank holds, `carried`, are not
  gathered again: every rank already has them (as FSDP2 keeps its root module's parameters
  from forward into backward).
- The sequence a rank used (its needs, in order) is the next phase's sequence; the last round
  carries each rank's fingerprint of it, and when ranks used different sequences every rank
  adopts the same `merge` of all of them.
- A rank whose computation raised joins the rounds with status `FAILED`: every rank sees it in
  the same round, and the step raises on every rank before any update (`fzero.consensus`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = [
    "ABORTED",
    "DONE",
    "FAILED",
    "HEADER_WIDTH",
    "HELD_SLOTS",
    "RUNNING",
    "BucketOrder",
    "agreed",
    "carried",
    "failed_ranks",
    "fingerprint",
    "header",
    "merge",
    "next_position",
    "phase_over",
    "reduce_order",
    "serve",
]

RUNNING, DONE, FAILED, ABORTED = 0, 1, 2, 3
"""A rank's status in a gather round: still computing the phase, finished it, failed (its own
computation raised), or stopped because another rank failed."""

HELD_SLOTS = 2
"""Most buckets a rank reports holding at the end of a phase (its last two uses): what fits the
``1 + prefetch`` gathered buckets of the default prefetch."""

HEADER_WIDTH = 4 + HELD_SLOTS
"""Elements of one rank's round header: status, need, a 60-bit fingerprint in two halves, and
the buckets the rank holds for the next phase."""

_HALF = 2**30


class BucketOrder(NamedTuple):
    """The buckets a stage-3 step's forward and backward used, in order of use (consecutive
    repeats collapsed), agreed by every rank: the next step gathers along it."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]


def fingerprint(sequence: Sequence[int]) -> int:
    """A 60-bit fingerprint of a sequence of bucket indices (the same in every process)."""
    digest = hashlib.blake2b(repr(tuple(sequence)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _HALF**2


def header(
    status: int, need: int | None, used: Sequence[int], held: Sequence[int] = ()
) -> list[int]:
    """One rank's round header: ``[status, need or -1, fingerprint(used) in two halves,
    *held]``, `held` (the buckets this rank keeps gathered into the next phase, at most
    `HELD_SLOTS`, distinct) padded with -1.

    Raises:
        ValueError: an unknown status, a negative bucket index, or more or repeated `held`.
    """
    if status not in (RUNNING, DONE, FAILED, ABORTED):
        raise ValueError(f"unknown round status {status!r}")
    for name, index in (("need", need), *(("held", h) for h in held)):
        if index is not None and index < 0:
            raise ValueError(f"bucket indices are >= 0, got {name}={index}")
    if len(held) > HELD_SLOTS or len(set(held)) != len(held):
        raise ValueError(f"held must be at most {HELD_SLOTS} distinct buckets, got {held!r}")
    value = fingerprint(used)
    return [status, -1 if need is None else need, value // _HALF, value % _HALF,
            *held, *[-1] * (HELD_SLOTS - len(held))]


def serve(headers: Sequence[Sequence[int]]) -> list[int]:
    """The buckets every rank gathers after a round, in order: each rank's need, in rank order,
    each bucket once. A pure function of the headers, which every rank receives alike."""
    order: list[int] = []
    for row in headers:
        if row[1] >= 0 and row[1] not in order:
            order.append(row[1])
    return order


def phase_over(headers: Sequence[Sequence[int]]) -> bool:
    """Whether no rank is still computing the phase (then nobody needs anything either)."""
    return all(row[0] != RUNNING for row in headers)


def failed_ranks(headers: Sequence[Sequence[int]]) -> list[int]:
    """Ranks whose own computation failed."""
    return [rank for rank, row in enumerate(headers) if row[0] == FAILED]


def agreed(headers: Sequence[Sequence[int]]) -> bool:
    """Whether every rank used the same sequence in the phase (equal fingerprints)."""
    return len({(row[2], row[3]) for row in headers}) == 1


def carried(headers: Sequence[Sequence[int]], following: Sequence[int]) -> tuple[int, ...]:
    """The positions the next phase need not gather: the longest start of the `following`
    sequence made of distinct buckets that every rank holds (on every row); empty when the
    sequence starts with a bucket some rank does not hold."""
    held = set.intersection(*({i for i in row[4 : 4 + HELD_SLOTS] if i >= 0}
                              for row in headers)) if headers else set()
    prefix: list[int] = []
    for index in following:
        if index not in held or index in prefix:
            break
        prefix.append(index)
    return tuple(prefix)


def next_position(sequence: Sequence[int], bucket: int, start: int) -> int | None:
    """The first position at or after `start` where `sequence` holds `bucket`, or None."""
    for position in range(max(start, 0), len(sequence)):
        if sequence[position] == bucket:
            return position
    return None


def merge(sequences: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """A common supersequence of `sequences` (each is a subsequence of the result).

    Folds a shortest common supersequence of two sequences over the list in order, so the
    result depends only on the list: every rank that merges the same list gets the same result.
    A rank that skipped a block used a subsequence of the others' sequence, which is then the
    merge itself.
    """
    merged: tuple[int, ...] = ()
    for sequence in sequences:
        merged = _supersequence(merged, tuple(sequence))
    return merged


def _supersequence(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """A shortest common supersequence of `a` and `b`, preferring `a`'s element on ties."""
    n, m = len(a), len(b)
    # length[i][j]: length of a shortest common supersequence of a[i:] and b[j:]
    length = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i == n or j == m:
                length[i][j] = (n - i) + (m - j)
            elif a[i] == b[j]:
                length[i][j] = 1 + length[i + 1][j + 1]
            else:
                length[i][j] = 1 + min(length[i + 1][j], length[i][j + 1])
    out: list[int] = []
    i = j = 0
    while i < n or j < m:
        if i < n and j < m and a[i] == b[j]:
            out.append(a[i])
            i, j = i + 1, j + 1
        elif j == m or (i < n and length[i + 1][j] <= length[i][j + 1]):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return tuple(out)


def reduce_order(trainable: Iterable[int], forward: Sequence[int]) -> tuple[int, ...]:
    """The fixed order a step reduces its trainable buckets in, on every rank.

    Backward completes a bucket's gradient once it has gone back past the bucket's *first* use
    in forward (the last one it reaches): a tied embedding first used by the input layer and
    again by the output head completes at the very end, however early the head's backward
    gathers it. Buckets are therefore ordered by their first position in the agreed forward
    sequence, latest first. Buckets the forward never used have no gradient and are complete at
    once: they go first, highest index first, which is also the whole order when no sequence
    is known (stages 0-2, which reverse the parameter order as autograd mostly does).

    Args:
        trainable: indices of the trainable buckets.
        forward: the agreed forward sequence (`BucketOrder.forward`), or empty.

    Returns:
        Every trainable bucket exactly once.
    """
    buckets = sorted(set(trainable))
    first: dict[int, int] = {}
    for position, bucket in enumerate(forward):
        first.setdefault(bucket, position)
    unused = sorted((b for b in buckets if b not in first), reverse=True)
    used = sorted((b for b in buckets if b in first), key=lambda b: -first[b])
    return (*unused, *used)
