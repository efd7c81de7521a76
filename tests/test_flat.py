"""Pure tensor functions: flatten / unflatten / shard / unshard round trips and invariants."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.testing import bitwise_equal, layouts, trees


def _all_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert bitwise_equal(got[name], tensor), name


@given(layouts())
def test_shard_unshard_round_trip_is_bitwise(case):
    params, layout = case
    shards = [fzero.shard(params, layout, r) for r in range(layout.world_size)]
    _all_equal(fzero.unshard(shards, layout), params)


@given(layouts())
def test_flatten_unflatten_round_trip_is_bitwise(case):
    params, layout = case
    _all_equal(fzero.unflatten(fzero.flatten(params, layout), layout), params)


@given(layouts())
def test_shards_concatenate_to_the_zero_padded_flat_buffer(case):
    params, layout = case
    flats = fzero.flatten(params, layout)
    world = layout.world_size
    ranks = range(world) if world <= 64 else [0, 1, world // 2, world - 1]
    shards = {r: fzero.shard(params, layout, r) for r in ranks}
    for index, (flat, bucket) in enumerate(zip(flats, layout.buckets, strict=True)):
        assert flat.shape == (bucket.padded_numel,) and flat.dtype == bucket.torch_dtype
        assert not flat[bucket.numel :].any(), "padding is zero"
        rows = fzero.bucket_shards(flat, bucket)  # (world, shard)
        assert rows.shape == (world, bucket.shard_numel)
        for r, rank_shards in shards.items():
            assert rank_shards[index].shape == (bucket.shard_numel,)
            assert bitwise_equal(rank_shards[index], rows[r])
        if world <= 64:
            assert bitwise_equal(torch.cat([shards[r][index] for r in ranks]), flat)


@given(layouts())
def test_unflatten_returns_views_and_aliases_share_them(case):
    params, layout = case
    flats = fzero.flatten(params, layout)
    views = fzero.unflatten(flats, layout)
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        for entry in bucket.entries:
            view = views[entry.name]
            if view.numel():
                assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            for alias in entry.aliases:
                assert views[alias] is view


@given(trees(max_size=20, allow_large=False), st.integers(1, 8))
def test_meta_tensors_flatten_and_shard(spec, world):
    params = {name: t.to("meta") for name, t in spec.build().items()}
    layout = fzero.plan(params, world)
    for flat, bucket in zip(fzero.flatten(params, layout), layout.buckets, strict=True):
        assert flat.is_meta and flat.shape == (bucket.padded_numel,)
    for index, bucket in enumerate(layout.buckets):
        assert fzero.shard(params, layout, world - 1)[index].shape == (bucket.shard_numel,)


def test_results_are_outside_autograd():
    params = {"w": torch.randn(3, 4, requires_grad=True)}
    layout = fzero.plan(params, 2)
    assert not fzero.flatten(params, layout)[0].requires_grad
    assert not fzero.shard(params, layout, 1)[0].requires_grad
    shards = [[s.requires_grad_() for s in fzero.shard(params, layout, r)] for r in range(2)]
    assert not fzero.unshard(shards, layout)["w"].requires_grad  # (it did: a probe)


def test_most_ranks_hold_only_padding_at_large_world_size():
    params = {"a": torch.arange(5.0)}
    layout = fzero.plan(params, 1000)
    assert layout.buckets[0].shard_numel == 1
    assert fzero.shard(params, layout, 4)[0].tolist() == [4.0]
    assert fzero.shard(params, layout, 999)[0].tolist() == [0.0]


# --- bad input -------------------------------------------------------------------------------


@pytest.fixture
def simple():
    params = {"a": torch.zeros(3, 2), "b": torch.ones(5)}
    return params, fzero.plan(params, 2)


def test_mismatched_params_are_named(simple):
    params, layout = simple
    with pytest.raises(ValueError, match="'b' is missing"):
        fzero.flatten({"a": params["a"]}, layout)
    with pytest.raises(ValueError, match="not in the layout: \\['c'\\]"):
        fzero.flatten({**params, "c": torch.zeros(1)}, layout)
    with pytest.raises(ValueError, match="'a' has shape \\(2, 3\\).*expects \\(3, 2\\)"):
        fzero.shard({**params, "a": torch.zeros(2, 3)}, layout, 0)
    with pytest.raises(ValueError, match="'b'.*float64.*torch.float32"):
        fzero.shard({**params, "b": torch.ones(5, dtype=torch.float64)}, layout, 0)
    with pytest.raises(TypeError, match="'b' is a list"):
        fzero.flatten({**params, "b": [1.0]}, layout)


def test_rank_out_of_range_is_rejected(simple):
    params, layout = simple
    with pytest.raises(ValueError, match="rank=2"):
        fzero.shard(params, layout, 2)


def test_wrong_shards_are_named(simple):
    params, layout = simple
    shards = [fzero.shard(params, layout, r) for r in range(2)]
    with pytest.raises(ValueError, match="one shard list per rank: expected 2, got 1"):
        fzero.unshard(shards[:1], layout)
    with pytest.raises(ValueError, match="shards of rank 1: expected one tensor per bucket"):
        fzero.unshard([shards[0], ()], layout)
    bad = (torch.zeros(shards[1][0].numel() + 1),)
    with pytest.raises(ValueError, match="shards of rank 1: bucket 0 .*expects .* of 6 elem"):
        fzero.unshard([shards[0], bad], layout)


def test_params_on_several_devices_are_rejected():
    params = {"a": torch.zeros(2), "b": torch.zeros(2, device="meta")}
    with pytest.raises(ValueError, match="several devices"):
        fzero.flatten(params, fzero.plan(params, 1))


# ----------------------------------------------------------------------------------------------
# The slicing helpers the train step runs on (one slicing truth with the laws above)


def _sub(layout, index):
    return fzero.ShardLayout((layout.buckets[index],), layout.world_size)


@given(layouts())
def test_entry_views_and_alias_leaves_are_unflatten(case):
    params, layout = case
    for index, (flat, bucket) in enumerate(
        zip(fzero.flatten(params, layout), layout.buckets, strict=True)
    ):
        want = fzero.unflatten([flat], _sub(layout, index))
        views = fzero.flat.entry_views(flat, bucket)
        leaves = fzero.flat.alias_leaves(flat, bucket)
        for entry, view, leaf in zip(bucket.entries, views, leaves, strict=True):
            assert bitwise_equal(view, want[entry.name]) and bitwise_equal(leaf, view)
            assert leaf.is_leaf and leaf.requires_grad == bucket.trainable
            assert leaf.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            if leaf.numel():
                assert leaf.data_ptr() == view.data_ptr()


@given(layouts())
def test_shard_view_is_shard(case):
    params, layout = case
    flats = fzero.flatten(params, layout)
    for rank in range(min(layout.world_size, 8)):
        shards = fzero.shard(params, layout, rank)
        for flat, bucket, want in zip(flats, layout.buckets, shards, strict=True):
            got = fzero.flat.shard_view(flat, bucket, rank)
            assert bitwise_equal(got, want)
            assert got.numel() == 0 or got.data_ptr() == flat.data_ptr() + rank * (
                bucket.shard_numel * flat.element_size()
            )


def test_alias_leaves_write_through_to_the_flat_buffer():
    params = {"a": torch.zeros(2, 3), "b": torch.zeros(5)}
    layout = fzero.plan(params, 3)
    (flat,) = fzero.flatten(params, layout)
    leaves = fzero.flat.alias_leaves(flat, layout.buckets[0])
    with torch.no_grad():
        leaves[1].fill_(7.0)
    assert flat[6:11].eq(7.0).all() and flat[:6].eq(0).all() and flat[11:].eq(0).all()


@given(st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.0, float("inf"), float("-inf"),
                                 float("nan")]), min_size=0, max_size=12),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_all_finite_is_isfinite_all(values: list[float], dtype: torch.dtype) -> None:
    """`all_finite` (no tensor-sized temporary: the minimum and the maximum) agrees with
    ``torch.isfinite(t).all()``, -inf included: a version that looked at the maximum only
    passed every test (a mutation probe), and would have let -inf parameters through."""
    from fzero.flat import all_finite

    tensor = torch.tensor(values, dtype=dtype)
    assert all_finite(tensor) == bool(torch.isfinite(tensor).all())
    assert not all_finite(torch.tensor([1.0, float("-inf"), 2.0], dtype=dtype))


SPECIAL = st.sampled_from([0.0, -0.0, 1.5, -2.0, float("inf"), float("-inf"), float("nan")])


@given(st.lists(st.tuples(SPECIAL, SPECIAL), min_size=0, max_size=12),
       st.sampled_from([torch.complex64, torch.complex128, torch.float8_e4m3fn,
                        torch.float8_e5m2]))
def test_all_finite_of_complex_and_float8_is_isfinite_all(
        values: list[tuple[float, float]], dtype: torch.dtype) -> None:
    """Complex tensors passed as finite whatever they held (a NaN frozen parameter was taken
    by `init`), and float8 ones raised NotImplementedError from torch (no minimum kernel): a
    float8 frozen parameter could not be initialized (a probe). The reference: isfinite of
    each part, float8 widened to float32 first."""
    from fzero.flat import all_finite

    if dtype.is_complex:
        tensor = torch.tensor([complex(a, b) for a, b in values], dtype=dtype)
        want = bool(torch.isfinite(torch.view_as_real(tensor)).all())
    else:
        tensor = torch.tensor([a for a, _ in values], dtype=torch.float32).to(dtype)
        want = bool(torch.isfinite(tensor.float()).all())
    assert all_finite(tensor) == want


def test_a_frozen_float8_parameter_is_initialized_and_a_complex_nan_one_refused() -> None:
    def body(comm: Any, frozen: torch.Tensor) -> str:
        model = torch.nn.Linear(2, 2)
        model.register_parameter("scale", torch.nn.Parameter(frozen, requires_grad=False))
        try:
            fzero.init(model, stage=1, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        except ValueError as error:
            return str(error)
        return "built"

    float8 = torch.ones(3).to(torch.float8_e4m3fn)
    assert fzero.SimWorld(1).run(body, float8) == ["built"]
    (message,) = fzero.SimWorld(1).run(body, torch.tensor([1 + 1j, complex(float("nan"), 0)]))
    assert "scale" in message, message


@given(st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.0, 1e-30, float("inf"), float("nan")]),
                min_size=1, max_size=8),
       st.integers(0, 7),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64,
                        torch.complex64, torch.complex128, torch.int8]),
       st.booleans())
def test_bits_compare_equal_exactly_when_the_bytes_do(values: list[float], flip: int,
                                                      dtype: torch.dtype, scalar: bool) -> None:
    """`bits` views elements as integers of their own width (any width: complex128's 16 bytes
    fall back to bytes, a 0-d one too, which crashed): two tensors' bits are equal exactly
    when their bytes are, so NaN equals NaN and -0.0 differs from 0.0, and the view is of the
    same memory."""
    from fzero.flat import bits

    a = torch.tensor(values[0] if scalar else values).to(dtype)
    b = a.clone()
    b.reshape(-1).view(torch.uint8)[flip % (b.numel() * b.element_size())] ^= 1
    for x, y in ((a, a.clone()), (a, b)):
        assert torch.equal(bits(x), bits(y)) == torch.equal(x.reshape(-1).view(torch.uint8),
                                                            y.reshape(-1).view(torch.uint8))
    assert not torch.equal(bits(a), bits(b))
    assert bits(a).untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert bits(a).element_size() in (a.element_size(), 1)


def test_bits_of_a_zero_dim_complex128_and_its_round_trip() -> None:
    """The shrunk example: torch views no 0-d tensor as a narrower dtype, so `bits` of a 0-d
    complex128 raised, and with it `fzero.testing.check_roundtrip` of a model holding one (a
    probe)."""
    from fzero.flat import bits
    from fzero.testing import check_roundtrip

    z = torch.tensor(1 + 2j, dtype=torch.complex128)
    assert torch.equal(bits(z), z.reshape(1).view(torch.uint8))
    assert not torch.equal(bits(z), bits(torch.tensor(1 - 2j, dtype=torch.complex128)))
    model = torch.nn.Linear(3, 1)
    model.register_parameter("z", torch.nn.Parameter(z, requires_grad=False))
    assert check_roundtrip(model, world_sizes=(1, 2, 3), buckets=(None, 1)) == 6


def _checksum_by_hand(tensor: torch.Tensor) -> int:
    """`checksum`'s definition in Python integers: the sum of mix(bit pattern) times 2i+1,
    mod 2**64, as a signed int64; mix is two xor-shift-multiply rounds on 64-bit words."""
    from fzero.flat import bits

    mask = 2**64 - 1

    def mix(z: int) -> int:
        z &= mask
        for shift, factor in ((31, 0x3F58476D1CE4E5B9), (27, 0x14D049BB133111EB)):
            z = ((z ^ (z >> shift)) * factor) & mask
        return z

    total = sum(mix(int(b)) * (2 * i + 1) for i, b in enumerate(bits(tensor).tolist())) & mask
    return total - 2**64 if total >= 2**63 else total


@given(st.lists(st.floats(allow_nan=True, width=32), min_size=0, max_size=40),
       st.integers(0, 10_000),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64,
                        torch.int8]),
       st.integers(1, 9))
def test_checksum_is_its_definition_and_sees_any_one_byte(values: list[float], flip: int,
                                                          dtype: torch.dtype,
                                                          chunk: int) -> None:
    """`checksum` equals its definition computed by hand whatever the chunk size (patched
    small, so that tensors span several chunks), is equal for equal bits, and changes when
    any one byte changes (the weights are odd, so no single change cancels)."""
    from unittest import mock

    from fzero import flat

    a = torch.tensor(values, dtype=torch.float32).to(dtype)
    with mock.patch.object(flat, "_CHECKSUM_CHUNK", chunk):
        got = int(flat.checksum(a))
        assert got == _checksum_by_hand(a) == int(flat.checksum(a.clone()))
        if a.numel():
            b = a.clone()
            b.view(torch.uint8)[flip % b.view(torch.uint8).numel()] ^= 1 << (flip % 8)
            assert int(flat.checksum(b)) != got


def test_checksum_sees_sign_flips_and_swaps_that_a_plain_sum_misses() -> None:
    """Regression examples of why the elements are mixed and weighted: negating one positive
    and one negative element of equal magnitude, or swapping two, leaves the plain sum of bit
    patterns unchanged; negating two float64 elements adds 2**63 twice, which a weighted sum
    of the raw bits missed too (odd times 2**63 is 2**63 modulo 2**64: found by a probe, a
    float64 model's ``neg_()`` through ``.data``). The checksum changes for each, across the
    real chunk size too (2**20 + 3 elements)."""
    from fzero.flat import bits, checksum

    a = torch.tensor([0.5, -0.5, 2.0, 3.0, 1.0], dtype=torch.bfloat16)
    flipped = torch.tensor([-0.5, 0.5, 2.0, 3.0, 1.0], dtype=torch.bfloat16)
    swapped = torch.tensor([0.5, -0.5, 3.0, 2.0, 1.0], dtype=torch.bfloat16)
    for other in (flipped, swapped):
        assert int(bits(other).long().sum()) == int(bits(a).long().sum())
        assert int(checksum(other)) != int(checksum(a))
    for dtype in (torch.float64, torch.float32):
        x = torch.tensor([0.25, -0.125, -0.375, 0.5, 0.75, -1.5], dtype=dtype)
        for count in (2, 4, 6):
            y = x.clone()
            y[:count] = -y[:count]
            assert int(checksum(y)) != int(checksum(x)), (dtype, count)
    big = torch.randn(2**20 + 3, generator=torch.Generator().manual_seed(0))
    before = int(checksum(big))
    big[-1] = -big[-1]
    assert int(checksum(big)) != before


def _fingerprint_by_definition(x: torch.Tensor, block: int) -> int:
    """`fingerprint` in pure Python: int64 words (elements past the last whole word, or of a
    view not aligned to 8 bytes, at their own width), block b's sum times 2b + 1."""
    from fzero.flat import bits

    size = x.element_size()
    raw = x.contiguous().view(torch.uint8).tolist()
    units: list[int] = []
    if (x.storage_offset() * size) % 8 == 0:
        cut = len(raw) // 8 * 8
        units = [int.from_bytes(bytes(raw[i:i + 8]), "little", signed=True)
                 for i in range(0, cut, 8)]
        tail = [int(b) for b in bits(x.contiguous())[cut // size:].tolist()]
    else:
        tail = [int(b) for b in bits(x.contiguous()).tolist()]
    total, weight = 0, 1
    for group in (units, tail):
        for start in range(0, len(group), block):
            total += weight * sum(group[start:start + block])
            weight += 2
    return total & (2**64 - 1)


@given(st.lists(st.floats(width=32), min_size=0, max_size=300),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       st.integers(0, 7))
def test_fingerprint_is_its_definition(values: list[float], dtype: torch.dtype,
                                       offset: int) -> None:
    """`fingerprint` equals its definition (the bytes as int64 words, block b's sum weighted
    by 2b + 1, modulo 2**64; a tail of fewer than 8 bytes and a misaligned view element by
    element), whatever the tensor's place in its storage; and it changes with any one bit."""
    from fzero.flat import FINGERPRINT_BLOCK, fingerprint

    base = torch.tensor([1.0] * offset + values, dtype=torch.float32).to(dtype)
    x = base[offset:]
    assert int(fingerprint(x)) & (2**64 - 1) == _fingerprint_by_definition(x, FINGERPRINT_BLOCK)
    if x.numel():
        y = x.clone()
        y.view(torch.uint8)[-1] ^= 1
        assert int(fingerprint(y)) != int(fingerprint(x))


def test_fingerprint_chunks_agree_with_its_definition() -> None:
    """Over several chunks and a short last block (the chunked sums and weights line up)."""
    from fzero.flat import FINGERPRINT_BLOCK, fingerprint

    x = torch.randn(2 * 2**21 + 67, generator=torch.Generator().manual_seed(1))
    want = _fingerprint_by_definition(x, FINGERPRINT_BLOCK)
    assert int(fingerprint(x)) & (2**64 - 1) == want


@pytest.mark.parametrize("shape", [(64, 48), (7, 300), (3000,)])
def test_fingerprint_sees_values_moved_between_blocks(shape: tuple[int, ...]) -> None:
    """A permutation of a tensor's own values (``roll``, a transpose's copy) keeps a plain sum
    of its words; the block weights see it once values cross a 512-byte block. Within one
    block it cancels, as documented."""
    from fzero.flat import fingerprint

    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    before = int(fingerprint(x))
    assert int(fingerprint(x.roll(1, 0))) != before
    assert int(fingerprint(x.flip(-1).contiguous())) != before
    words = x.reshape(-1)[:128].view(torch.float64)  # 64 words: one block
    assert int(fingerprint(words.flip(0).contiguous())) == int(fingerprint(words))


# --- inputs the pure functions refuse (each was accepted silently: a probe) --------------------


def _tied() -> tuple[torch.Tensor, fzero.ShardLayout]:
    weight = torch.arange(12.0).view(4, 3)
    return weight, fzero.plan({"emb.weight": weight, "head.weight": weight}, 2)


def test_flatten_and_shard_check_every_name_of_a_tied_tensor() -> None:
    """Only a tied tensor's first given name was checked: its other name with other values,
    another shape or dtype, or no tensor at all was dropped. The same tensor, a view of the
    same memory or equal bits under both names are one tensor and pass."""
    weight, layout = _tied()
    for same in (weight, weight.detach(), weight.clone()):
        params = {"emb.weight": weight, "head.weight": same}
        assert bitwise_equal(fzero.flatten(params, layout)[0][:12], weight.view(-1))
    bad = [(weight + 1, ValueError, "one tied tensor in the layout, but were given different"),
           (torch.zeros(7), ValueError, r"'head.weight' has shape \(7,\)"),
           (weight.double(), ValueError, "'head.weight' has shape .* dtype torch.float64"),
           ("w", TypeError, "'head.weight' is a str")]
    for other, error, match in bad:
        params = {"emb.weight": weight, "head.weight": other}
        for call in (lambda p: fzero.flatten(p, layout), lambda p: fzero.shard(p, layout, 1)):
            with pytest.raises(error, match=match):
                call(params)


def test_a_name_given_twice_raises() -> None:
    """``{"a.b": t1, "a": {"b": t2}}`` was planned as one parameter, one tensor dropped."""
    tree = {"a.b": torch.zeros(3), "a": {"b": torch.ones(3)}}
    with pytest.raises(ValueError, match="parameter name 'a.b' is given twice"):
        fzero.plan(tree, 2)
    layout = fzero.plan({"a": {"b": torch.zeros(3)}}, 2)
    with pytest.raises(ValueError, match="'a.b' is given twice"):
        fzero.flatten(tree, layout)


def test_a_tie_whose_names_differ_in_requires_grad_raises() -> None:
    """``{"emb.weight": p, "head.weight": p.detach()}`` trained or froze the tensor by which
    name came first."""
    p = torch.nn.Parameter(torch.zeros(4, 3))
    for params in ({"emb.weight": p, "head.weight": p.detach()},
                   {"head.weight": p.detach(), "emb.weight": p}):
        with pytest.raises(ValueError, match="one tied tensor differ in requires_grad"):
            fzero.plan(params, 2)
    assert fzero.plan({"emb.weight": p, "head.weight": p.detach()}, 2,
                      trainable=["emb.weight", "head.weight"]).buckets[0].trainable


def test_views_of_a_flat_buffer_check_it_is_one() -> None:
    """A column of a 2-D buffer gave `alias_leaves` other elements than `entry_views` (it
    ignored strides), a shorter slice let it read past the flat's end and `shard_view` return
    nothing (a probe). Another dtype is fine: master copies, gradients and moments."""
    layout = fzero.plan({"a": torch.zeros(2, 3), "b": torch.zeros(3)}, 2, buckets=None)
    bucket = layout.buckets[0]
    n = bucket.padded_numel
    good = torch.arange(float(n))
    assert [t.tolist() for t in fzero.flat.alias_leaves(good, bucket)] == [
        t.tolist() for t in fzero.flat.entry_views(good, bucket)]
    for flat in (torch.zeros(n, 2)[:, 0], torch.zeros(n + 4)[2:-3], torch.zeros(n, 1)):
        for view in (fzero.flat.entry_views, fzero.flat.alias_leaves,
                     lambda f, b: fzero.flat.shard_view(f, b, 1)):
            with pytest.raises(ValueError, match=f"needs a flat buffer, a contiguous 1-D "
                                                 f"tensor of {n} elements"):
                view(flat, bucket)
    master = torch.arange(float(n), dtype=torch.float64)  # another dtype: a master copy's
    assert fzero.flat.alias_leaves(master, bucket)[1].dtype == torch.float64
