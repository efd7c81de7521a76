"""`entry_views`, `alias_leaves`, `shard_view` and `bucket_shards` on one bucket's flat
buffer, against plain slicing, with the buffer placed at an arbitrary offset inside a larger
storage (as a train step's buffers may be).

Reference: entry ``e`` is ``flat[e.offset : e.offset + prod(e.shape)].reshape(e.shape)``;
rank r's shard is ``flat[r * s : (r + 1) * s]`` with ``s = ceil(numel / world)``. Every result
must alias `flat` (a write through it shows in `flat`), and each alias leaf must be its own
autograd leaf, requiring grad exactly when the bucket is trainable.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.flat import alias_leaves, bucket_shards, entry_views, shard_view

SHAPES = [(), (0,), (1,), (3,), (2, 3), (3, 0, 2), (5,), (2, 2, 2)]


@settings(deadline=None, max_examples=60)
@given(shapes=st.lists(st.sampled_from(SHAPES), min_size=1, max_size=5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int32]),
       world=st.integers(1, 9), before=st.integers(0, 5), trainable=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_views_are_plain_slices_of_the_flat_buffer(shapes, dtype, world, before, trainable,
                                                   seed) -> None:
    trainable = trainable and dtype.is_floating_point
    params = {f"m.{i}.w": torch.zeros(s, dtype=dtype).requires_grad_(trainable)
              for i, s in enumerate(shapes)}
    layout = fzero.plan(params, world, buckets=[list(params)])
    (bucket,) = layout.buckets
    numel = sum(math.prod(s) for s in shapes)
    s = math.ceil(numel / world)
    assert (bucket.numel, bucket.shard_numel, bucket.padded_numel) == (numel, s, s * world)

    gen = torch.Generator().manual_seed(seed)
    storage = torch.randint(-100, 100, (before + s * world + 3,), generator=gen).to(dtype)
    flat = storage[before:before + s * world]  # contiguous, at a storage offset

    offset = 0
    views = entry_views(flat, bucket)
    leaves = alias_leaves(flat, bucket)
    for entry, view, leaf, shape in zip(bucket.entries, views, leaves, shapes, strict=True):
        want = flat[offset:offset + math.prod(shape)].reshape(shape)
        offset += math.prod(shape)
        for got in (view, leaf):
            assert got.shape == shape and got.dtype == dtype
            assert torch.equal(got.detach(), want)
        assert leaf.is_leaf and leaf.requires_grad == trainable
        if want.numel():
            with torch.no_grad():  # a write through each shows in the flat buffer
                view.reshape(-1)[0] = 7
                assert flat[entry.offset] == 7
                leaf.reshape(-1)[-1] = 9
                assert flat[entry.end - 1] == 9

    rows = bucket_shards(flat, bucket)
    assert rows.shape == (world, s)
    for r in range(world):
        piece = shard_view(flat, bucket, r)
        assert torch.equal(piece, flat[r * s:(r + 1) * s]) and torch.equal(rows[r], piece)
        if s:
            assert piece.data_ptr() == flat.data_ptr() + r * s * flat.element_size()
            assert rows[r].data_ptr() == piece.data_ptr()
