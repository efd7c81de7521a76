"""flatten / shard / unshard / unflatten on tensors of every memory layout, against an
independent reference.

The existing flat tests draw contiguous tensors only (`fzero.testing.trees`). Here parameters
are transposed, expanded (stride 0), channels_last, strided slices, disjoint views of one
shared storage, conjugate views, 0-d and 0-element tensors, of float16/bfloat16/float32/
float64/complex64/int64/bool, in nested mappings whose keys hold dots, for world sizes up to
larger than the number of elements.

The reference is written from the module docstring of `fzero.flat` alone:

    flatten(p, L)[b]  == cat(p[e].flatten() for e in bucket b) ++ zeros(padding)
    shard(p, L, r)[b] == flatten(p, L)[b][r * s_b:(r + 1) * s_b]

computed with plain torch (``contiguous().reshape(-1)``, ``torch.cat``, ``torch.zeros``); only
the bucket grouping (which names, in which order) is taken from the layout, and the layout's
own arithmetic (offsets, padding, shard sizes) is checked against first principles.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.int64, torch.bool)
KINDS = ("contiguous", "scalar", "empty", "transposed", "expanded", "channels_last",
         "strided", "conj")


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical values as bytes, in row-major order (independent of memory)."""
    t = t.detach().resolve_conj().resolve_neg()
    t = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))  # stride 1, even for 1 element
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=gen)
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.complex128).to(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def make(kind: str, dims: tuple[int, int], dtype: torch.dtype, gen: torch.Generator
         ) -> torch.Tensor:
    """A tensor of the given memory kind (falls back to contiguous where it cannot be made)."""
    a, b = dims
    if kind == "scalar":
        return values((), dtype, gen)
    if kind == "empty":
        return values((a, 0, b), dtype, gen)
    if kind == "transposed":
        return values((b, a), dtype, gen).t()
    if kind == "expanded":
        return values((1, b), dtype, gen).expand(a, b)
    if kind == "channels_last":
        return values((2, b, a, 2), dtype, gen).contiguous(memory_format=torch.channels_last)
    if kind == "strided":
        return values((a, 2 * b + 1), dtype, gen)[:, 1::2]
    if kind == "conj" and dtype.is_complex:
        return values((a, b), dtype, gen).conj()  # a lazy conjugate view
    return values((a, b), dtype, gen)


@st.composite
def trees(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A nested mapping (keys may hold dots) and the same leaves under their dotted names.

    Some leaves are disjoint slices of one shared storage (they are distinct parameters)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    count = draw(st.integers(0, 7))
    shared_count = draw(st.integers(0, min(3, count)))
    shared_rows = [draw(st.integers(0, 4)) for _ in range(shared_count)]
    shared_dtype = draw(st.sampled_from(DTYPES))
    storage = values((sum(shared_rows), 3), shared_dtype, gen)
    tree: dict[str, Any] = {}
    flat: dict[str, torch.Tensor] = {}
    row = 0
    for i in range(count):
        if i < shared_count:  # a view of the shared storage: rows [row, row + n)
            tensor = storage[row:row + shared_rows[i]]
            row += shared_rows[i]
        else:
            kind = draw(st.sampled_from(KINDS))
            dims = (draw(st.integers(1, 4)), draw(st.integers(1, 5)))
            tensor = make(kind, dims, draw(st.sampled_from(DTYPES)), gen)
        path = draw(st.sampled_from([("p",), ("a.b",), ("blocks", "0"), ("x", "y.z")]))
        key = f"{path[-1]}{i}"
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[key] = tensor
        flat[".".join((*path[:-1], key))] = tensor
    return tree, flat


def reference_flats(flat: dict[str, torch.Tensor], layout: fzero.ShardLayout
                    ) -> list[torch.Tensor]:
    out = []
    for bucket in layout.buckets:
        pieces = [flat[e.name].detach().resolve_conj().contiguous().reshape(-1)
                  for e in bucket.entries]
        n = sum(p.numel() for p in pieces)
        padded = math.ceil(n / layout.world_size) * layout.world_size
        dtype = pieces[0].dtype if pieces else torch.float32
        out.append(torch.cat([*pieces, torch.zeros(padded - n, dtype=dtype)]))
    return out


@settings(deadline=None, max_examples=60)
@given(trees(), st.integers(1, 7) | st.sampled_from([50, 97]), st.integers(1, 40) | st.none())
def test_flatten_shard_unshard_match_the_reference(case, world, cap) -> None:
    tree, flat = case
    layout = fzero.plan(tree, world, buckets=cap)

    # The layout, from first principles: every name once, in one bucket of its dtype.
    stored = [e for b in layout.buckets for e in b.entries]
    assert sorted(e.name for e in stored) == sorted(flat)
    for bucket in layout.buckets:
        offset = 0
        for entry in bucket.entries:
            tensor = flat[entry.name]
            assert entry.shape == tuple(tensor.shape) and bucket.torch_dtype == tensor.dtype
            assert entry.offset == offset
            offset += tensor.numel()
        assert bucket.numel == offset
        assert bucket.shard_numel == math.ceil(offset / world)
        assert bucket.padded_numel % world == 0 and 0 <= bucket.padding < world

    want = reference_flats(flat, layout)
    got = fzero.flatten(tree, layout)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert same_bits(g, w)

    shards = [fzero.shard(tree, layout, r) for r in range(world)]
    for index, w in enumerate(want):
        s = len(w) // world
        for r in range(world):
            assert same_bits(shards[r][index], w[r * s:(r + 1) * s]), (index, r)

    back = fzero.unshard(shards, layout)
    assert set(back) == set(flat)
    for name, tensor in flat.items():
        assert same_bits(back[name], tensor), name

    again = fzero.unflatten(want, layout)  # views of the given flat buffers
    for (index, entry) in (layout.locate()[n] for n in flat):
        view = again[entry.name]
        base = want[index]
        assert same_bits(view, flat[entry.name])
        if view.numel():
            assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 6), st.integers(1, 12), st.sampled_from(DTYPES))
def test_world_larger_than_the_model(numel, world, dtype) -> None:
    """A bucket of fewer elements than ranks: the first ``numel`` ranks hold one element each
    (shard size 1), the others padding only, which is zero."""
    gen = torch.Generator().manual_seed(numel * 31 + world)
    params = {"w": values((numel,), dtype, gen)}
    layout = fzero.plan(params, world)
    shards = [fzero.shard(params, layout, r)[0] for r in range(world)]
    expect_size = math.ceil(numel / world)
    for r, s in enumerate(shards):
        assert s.shape == (expect_size,) and s.dtype == dtype
        lo = r * expect_size
        real = params["w"][lo:lo + expect_size]
        assert same_bits(s[:real.numel()], real)
        assert not s[real.numel():].any()  # padding is zero
    assert same_bits(fzero.unshard([[s] for s in shards], layout)["w"], params["w"])
