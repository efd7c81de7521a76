"""`fzero.checkpoint.mapping.reads` / `regroup`: resharding N -> M for every 1 <= N, M <= 5,
against an independent reference.

The stored shards and the wanted ranges are computed here with plain torch from the
definition (a bucket's flat buffer is its entries' elements in order, zero-padded to a
multiple of the world size; rank r holds the r-th equal slice), never with `fzero.shard` or
`fzero.flatten`. Parameters have odd sizes, so almost every bucket is padded at both ends, and
include 0-d, 0-element and tied ones.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.checkpoint.mapping import compare, reads, regroup

WORLDS = range(1, 6)


def reference_flat(params: dict[str, torch.Tensor], bucket: fzero.layout.Bucket,
                   world: int) -> torch.Tensor:
    pieces = [params[e.name].reshape(-1) for e in bucket.entries]
    n = sum(p.numel() for p in pieces)
    padded = math.ceil(n / world) * world
    return torch.cat([*pieces, torch.zeros(padded - n, dtype=bucket.torch_dtype)])


def reference_shards(params, layout: fzero.ShardLayout) -> list[list[torch.Tensor]]:
    """shards[r][b]: rank r's slice of bucket b's padded flat buffer."""
    flats = [reference_flat(params, b, layout.world_size) for b in layout.buckets]
    return [[f.view(layout.world_size, -1)[r].clone() for f in flats]
            for r in range(layout.world_size)]


@st.composite
def models(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shapes = draw(st.lists(st.sampled_from([(), (0,), (1,), (3,), (5,), (2, 3), (7,), (4, 0),
                                            (11,)]), min_size=1, max_size=6))
    params: dict[str, torch.Tensor] = {}
    for i, shape in enumerate(shapes):
        params[f"layer.{i}.w"] = torch.randn(shape, generator=gen, dtype=torch.float64)
    if draw(st.booleans()):  # a tied name: the same tensor object under a second name
        params["head.w"] = params[draw(st.sampled_from(sorted(params)))]
    return params


@settings(deadline=None, max_examples=30)
@given(models(), st.none() | st.integers(1, 12), st.none() | st.integers(1, 12))
def test_reads_rebuild_every_range_for_every_world_pair(params, old_cap, new_cap) -> None:
    for old_world in WORLDS:
        old = fzero.plan(params, old_world, buckets=old_cap)
        stored = reference_shards(params, old)
        located = old.locate()
        for new_world in WORLDS:
            new = regroup(old, new_world, new_cap)
            assert not compare(old, new)
            assert new.world_size == new_world
            for index, bucket in enumerate(new.buckets):
                want = reference_flat(params, bucket, new_world)
                s = bucket.shard_numel
                for lo, hi in [(r * s, (r + 1) * s) for r in range(new_world)] + [
                        (0, len(want)), (0, 0)]:
                    out = torch.zeros(hi - lo, dtype=torch.float64)
                    written = torch.zeros(hi - lo, dtype=torch.int64)
                    for r in reads(old, new, index, lo, hi, located=located):
                        assert 0 <= r.start < r.stop <= old.buckets[r.bucket].shard_numel
                        out[r.at:r.at + r.stop - r.start] = stored[r.rank][r.bucket][
                            r.start:r.stop]
                        written[r.at:r.at + r.stop - r.start] += 1
                    assert torch.equal(out, want[lo:hi]), (old_world, new_world, index, lo)
                    # every parameter element read exactly once, padding never
                    real = (torch.arange(lo, hi) < bucket.numel).long()
                    assert torch.equal(written, real)
