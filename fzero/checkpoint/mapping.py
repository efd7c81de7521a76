"""Resharding as pure arithmetic: which stored element ranges fill a range of a new layout.

A checkpoint stores, for every bucket ``b`` of its layout ``O`` (N ranks), rank q's shard
``shard(p, O, q)[b]`` in rank q's file. A state for a new layout ``L`` (M ranks; other buckets,
even) needs some range ``[lo, hi)`` of ``flatten(p, L)[c]`` for each of its buckets ``c``: the
whole buffer, or its own shard. `reads` lists the copies that build it:

    for r in reads(O, L, c, lo, hi):
        out[r.at : r.at + r.stop - r.start] = shard(p, O, r.rank)[r.bucket][r.start : r.stop]

leaves ``out == flatten(p, L)[c][lo:hi]`` everywhere but the padding (elements past the
bucket's last entry, which are zero). That is ``unshard`` with the old layout followed by
``shard`` with the new one, without ever assembling a bucket: every element is read once,
from the one file that holds it. Reads are merged where they are contiguous on both sides, so
an unchanged layout needs one read per stored shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from fzero.layout import Entry, ShardLayout, plan

__all__ = ["Mismatch", "Read", "compare", "meta_params", "reads", "regroup"]


class Read(NamedTuple):
    """One copy: elements ``[start, stop)`` of old rank `rank`'s shard of old bucket `bucket`,
    to position `at` of the destination range."""

    rank: int
    bucket: int
    start: int
    stop: int
    at: int


def reads(
    old: ShardLayout,
    new: ShardLayout,
    bucket: int,
    lo: int,
    hi: int,
    *,
    located: Mapping[str, tuple[int, Entry]] | None = None,
) -> tuple[Read, ...]:
    """The copies that fill ``flatten(p, new)[bucket][lo:hi]`` from `old`'s shards.

    Args:
        old: the stored layout (its world size and buckets).
        new: the wanted layout; every entry must exist in `old` under one of its names, with
            the same shape (see `compare`).
        bucket: index of the bucket in `new`.
        lo, hi: the element range of its padded flat buffer, ``0 <= lo <= hi <= padded_numel``.
        located: ``old.locate()``, when the caller has it already.

    Returns:
        The reads in destination order; positions past the bucket's entries (padding) get none.

    Raises:
        ValueError: the range is out of bounds, or an entry of `new` is not in `old`.
    """
    target = new.buckets[bucket]
    if not 0 <= lo <= hi <= target.padded_numel:
        raise ValueError(
            f"range [{lo}, {hi}) is outside bucket {bucket} ({target.padded_numel} elements)"
        )
    located = old.locate() if located is None else located
    out: list[Read] = []
    for entry in target.entries:
        start, stop = max(entry.offset, lo), min(entry.end, hi)
        if start >= stop:
            continue
        source = next((located[n] for n in entry.names if n in located), None)
        if source is None:
            raise ValueError(f"parameter {entry.name!r} is not in the stored layout")
        old_index, old_entry = source
        shard = old.buckets[old_index].shard_numel
        # The entry's elements [start - offset, stop - offset) sit at these old flat positions:
        position, end = (old_entry.offset + start - entry.offset,
                         old_entry.offset + stop - entry.offset)
        at = start - lo
        while position < end:
            rank = position // shard
            piece_end = min(end, (rank + 1) * shard)
            _append(out, Read(rank, old_index, position - rank * shard, piece_end - rank * shard,
                              at))
            at += piece_end - position
            position = piece_end
    return tuple(out)


def _append(out: list[Read], read: Read) -> None:
    if out:
        last = out[-1]
        if (last.rank, last.bucket, last.stop) == (read.rank, read.bucket, read.start) and (
            last.at + last.stop - last.start == read.at
        ):
            out[-1] = last._replace(stop=read.stop)
            return
    out.append(read)


class Mismatch(NamedTuple):
    """How two layouts' parameters differ (names include aliases)."""

    only_old: tuple[str, ...]
    only_new: tuple[str, ...]
    shapes: tuple[str, ...]  # "name: old shape vs new shape"
    # Names one tensor in the new layout but separate tensors, with values of their own, in the
    # old (a tie gained; a tie lost is no mismatch: each name reads the one stored tensor).
    ties: tuple[tuple[str, ...], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.only_old or self.only_new or self.shapes or self.ties)


def compare(old: ShardLayout, new: ShardLayout) -> Mismatch:
    """Names only in one layout, names whose shapes differ, and ties only `new` has."""
    a, b = old.locate(), new.locate()
    shapes = [f"{name}: {a[name][1].shape} vs {b[name][1].shape}"
              for name in a.keys() & b.keys() if a[name][1].shape != b[name][1].shape]
    ties = [entry.names for bucket in new.buckets for entry in bucket.entries
            if len({a[name][1].name for name in entry.names if name in a}) > 1]
    return Mismatch(
        tuple(sorted(a.keys() - b.keys())), tuple(sorted(b.keys() - a.keys())),
        tuple(sorted(shapes)), tuple(sorted(ties)),
    )


def meta_params(layout: ShardLayout) -> dict[str, torch.Tensor]:
    """``meta`` tensors standing for the layout's parameters: names (aliases as the same
    tensor), shapes, dtypes and ``requires_grad`` as planned, in the layout's order."""
    params: dict[str, torch.Tensor] = {}
    for bucket in layout.buckets:
        for entry in bucket.entries:
            tensor = torch.empty(entry.shape, dtype=bucket.torch_dtype, device="meta")
            if bucket.trainable:
                tensor.requires_grad_(True)
            params.update(dict.fromkeys(entry.names, tensor))
    return params


def regroup(layout: ShardLayout, world_size: int, buckets: Any = None) -> ShardLayout:
    """`layout` over `world_size` ranks: the same buckets, or re-planned under `buckets`.

    Args:
        layout: a stored layout.
        world_size: the new number of ranks.
        buckets: None to keep the buckets; else a policy for `fzero.plan` over the stored
            parameters (an int size cap, or lists of names: there is no module to match
            classes or predicates against).

    Raises:
        TypeError, ValueError: as `fzero.plan` for a bad policy.
    """
    if buckets is None:
        return layout.with_world_size(world_size)
    params = meta_params(layout)
    trainable = {name: t.requires_grad for name, t in params.items()}
    return plan(params, world_size, buckets=buckets, trainable=trainable)
