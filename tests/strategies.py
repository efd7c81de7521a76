"""Hypothesis strategies shared by the test modules: random parameter pytrees and layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32)
# Bitwise views: every dtype compared through an integer type of the same width.
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.int64: torch.int64,
    torch.int32: torch.int32,
}


@dataclass(frozen=True)
class TreeSpec:
    """A drawn parameter set, built into tensors by `build` (kept cheap to shrink)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    trainable: tuple[bool, ...]
    tied_to: tuple[int | None, ...]  # index of an earlier entry this name aliases
    seed: int

    def build(self) -> dict[str, torch.Tensor]:
        """Tensors with random bit patterns (NaNs and -0.0 included) and tied aliases."""
        gen = torch.Generator().manual_seed(self.seed)
        tensors: dict[str, torch.Tensor] = {}
        for name, shape, dtype, train, tie in zip(
            self.names, self.shapes, self.dtypes, self.trainable, self.tied_to, strict=True
        ):
            if tie is not None:
                tensors[name] = tensors[self.names[tie]]
                continue
            bits = _BITS[dtype]
            info = torch.iinfo(bits)
            raw = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64)
            tensor = raw.to(bits).view(dtype)
            tensors[name] = tensor.requires_grad_(train)
        return tensors


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers, for bitwise comparison (NaN-safe)."""
    return tensor.detach().contiguous().view(_BITS[tensor.dtype])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# Name prefixes with and without list indices (the default bucket policy groups by them).
_PREFIXES = st.sampled_from(
    ["", "a.", "w.", "h.0.", "h.0.attn.", "h.1.", "h.1.mlp.", "h.10.", "b.2.x.", "0.", "1.a."]
)
shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
    st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple),
)
large_shapes = st.sampled_from([(1 << 16,), (300, 257), (3, 5, 4099)])


@st.composite
def trees(draw, min_size: int = 1, max_size: int = 200, allow_large: bool = True) -> TreeSpec:
    """A random parameter set: nested names, 0-d / empty / large tensors, mixed dtypes,
    frozen and trainable entries, integer (frozen) buffers and tied aliases."""
    # Mostly small trees (cheap to draw and shrink), one in eight up to `max_size` entries.
    small = min(max_size, max(min_size, 12))
    count = draw(
        st.integers(min_size, small) | st.integers(min_size, max_size)
        if draw(st.integers(0, 7)) == 0
        else st.integers(min_size, small)
    )
    names: list[str] = []
    taken: set[str] = set()
    for i in range(count):
        name = f"{draw(_PREFIXES)}p{i}"
        assert name not in taken
        taken.add(name)
        names.append(name)
    spec_shapes, dtypes, trainable, tied = [], [], [], []
    large_left = 1 if allow_large and draw(st.booleans()) else 0
    for i in range(count):
        if i > 0 and draw(st.integers(0, 9)) == 0:  # ~10% tied to an earlier entry
            j = draw(st.integers(0, i - 1))
            while tied[j] is not None:
                j = tied[j]
            spec_shapes.append(spec_shapes[j])
            dtypes.append(dtypes[j])
            trainable.append(trainable[j])
            tied.append(j)
            continue
        if large_left and draw(st.integers(0, 20)) == 0:
            shape, large_left = draw(large_shapes), 0
        else:
            shape = draw(shapes)
        dtype = draw(st.sampled_from(FLOAT_DTYPES + INT_DTYPES))
        train = dtype.is_floating_point and draw(st.booleans())
        spec_shapes.append(shape)
        dtypes.append(dtype)
        trainable.append(train)
        tied.append(None)
    seed = draw(st.integers(0, 2**31 - 1))
    return TreeSpec(
        tuple(names), tuple(spec_shapes), tuple(dtypes), tuple(trainable), tuple(tied), seed
    )


# Mostly 1..64 ranks; now and then a large world where most ranks hold only padding.
world_sizes = st.integers(0, 9).flatmap(
    lambda i: st.sampled_from([97, 1000]) if i == 0 else st.integers(1, 64)
)
# Sharding costs world_size x buckets tensor operations: keep that product bounded so 500
# examples run in seconds, with 200 entries at small world sizes and a few at 1000 ranks.
WORK_BOUND = 2000


@st.composite
def worlds_and_trees(draw):
    """``(world_size, TreeSpec)`` with world_size * entries <= WORK_BOUND (at least 1 entry)."""
    world = draw(world_sizes)
    return world, draw(trees(max_size=max(2, min(200, WORK_BOUND // world))))


@st.composite
def policies(draw, spec: TreeSpec):
    """A bucket policy usable with a plain mapping: default, a size cap, or explicit groups."""
    kind = draw(st.sampled_from(["default", "cap", "explicit"]))
    if kind == "default":
        return None
    if kind == "cap":
        return draw(st.integers(1, 5000))
    stored = [n for n, t in zip(spec.names, spec.tied_to, strict=True) if t is None]
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(stored) - 1)), max_size=8)))
    bounds = [0, *[c for c in cuts if c < len(stored)], len(stored)]
    return [stored[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
