"""Pure tensor functions: parameters <-> flat padded buckets <-> per-rank shards.

The equations every function here satisfies, for a layout ``L`` with ``N = L.world_size``:

    flatten(p, L)[b]                    == cat(p[e].flatten() for e in bucket b) ++ zeros(padding)
    shard(p, L, r)[b]                   == flatten(p, L)[b][r * s_b:(r + 1) * s_b]
    cat(shard(p, L, r)[b] for r < N)    == flatten(p, L)[b]
    unflatten(flatten(p, L), L)         == p          (views, no copies)
    unshard([shard(p, L, r) for r < N]) == p          (bitwise)

and, on one bucket's flat buffer ``f`` (the train step slices its buffers with these, so the
round-trip laws above are about the code training runs):

    entry_views(f, b)[i]  == unflatten([f], b)[entry i]       (views of f)
    alias_leaves(f, b)[i] == entry_views(f, b)[i]             (a leaf per entry, f's storage)
    shard_view(f, b, r)   == shard(unflatten([f], b), b, r)   (a view of f)

They work on any device, `meta` included, and copy each element once. Results of `flatten`,
`shard` and `unshard` are new tensors outside autograd (the differentiable path is
`fzero.collectives`' gather).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import einops
import torch

from fzero.layout import Bucket, ShardLayout, _check_rank, flatten_names, in_memory

__all__ = [
    "alias_leaves",
    "all_finite",
    "bits",
    "bucket_shards",
    "checksum",
    "entry_views",
    "fingerprint",
    "flatten",
    "shard",
    "shard_view",
    "unflatten",
    "unshard",
]


def flatten(params: Mapping[str, Any], layout: ShardLayout) -> tuple[torch.Tensor, ...]:
    """One flat, zero-padded 1-D tensor per bucket: ``(padded_numel,)`` each.

    Args:
        params: names to tensors (nested mappings allowed), as planned; for tied parameters
            any one name suffices.
        layout: the layout from `plan`.

    Raises:
        ValueError: a parameter is missing or unknown, or its shape or dtype differs from
            the layout.
    """
    tensors = _match(params, layout)
    return tuple(
        _concat(
            [tensors[entry.name].reshape(-1) for entry in bucket.entries],
            bucket.padding,
            bucket,
            device=_device(tensors),
        )
        for bucket in layout.buckets
    )


def unflatten(flats: Sequence[torch.Tensor], layout: ShardLayout) -> dict[str, torch.Tensor]:
    """Views into the flat buckets with the original shapes; aliases map to the same tensor.

    Raises:
        ValueError: wrong number of buckets, or a flat tensor of the wrong length or dtype.
    """
    _check_buffers(flats, layout, "flats", lambda b: b.padded_numel)
    params: dict[str, torch.Tensor] = {}
    for flat, bucket in zip(flats, layout.buckets, strict=True):
        for entry, view in zip(bucket.entries, entry_views(flat, bucket), strict=True):
            params.update(dict.fromkeys(entry.names, view))
    return params


def shard(params: Mapping[str, Any], layout: ShardLayout, rank: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s shard of every bucket: ``(shard_numel,)`` each, padding zero.

    Copies only the elements the rank holds, so sharding a large model never builds its flat
    buffers.

    Raises:
        ValueError: `rank` out of range, or `params` do not match the layout.
    """
    _check_rank(rank, layout.world_size)
    tensors = _match(params, layout)
    device = _device(tensors)
    out = []
    for bucket in layout.buckets:
        pieces = [
            tensors[seg.entry.name].reshape(-1)[
                seg.entry_start : seg.entry_start + seg.shard_end - seg.shard_start
            ]
            for seg in bucket.segments(rank)
        ]
        filled = sum(p.numel() for p in pieces)
        out.append(_concat(pieces, bucket.shard_numel - filled, bucket, device=device))
    return tuple(out)


def unshard(
    shards_by_rank: Sequence[Sequence[torch.Tensor]], layout: ShardLayout
) -> dict[str, torch.Tensor]:
    """Reassemble the parameters from every rank's shards; the inverse of `shard`.

    Args:
        shards_by_rank: ``shards_by_rank[r] == shard(params, layout, r)``.
        layout: the layout.

    Returns:
        Names (aliases included) to tensors, views into freshly assembled flat buckets.

    Raises:
        ValueError: the wrong number of ranks or buckets, or a shard of the wrong length or
            dtype (the message names the rank and bucket).
    """
    if len(shards_by_rank) != layout.world_size:
        raise ValueError(
            f"unshard needs one shard list per rank: expected {layout.world_size}, "
            f"got {len(shards_by_rank)}"
        )
    for rank, shards in enumerate(shards_by_rank):
        _check_buffers(shards, layout, f"shards of rank {rank}", lambda b: b.shard_numel)
    for index, bucket in enumerate(layout.buckets):
        first = shards_by_rank[0][index].device
        for rank, shards in enumerate(shards_by_rank):
            if shards[index].device != first:
                raise ValueError(
                    f"shards of rank {rank}: bucket {index} ({bucket.label!r}) is on "
                    f"{shards[index].device}, rank 0's on {first}: move them to one device"
                )
    flats = []
    with torch.no_grad():  # new tensors outside autograd, whatever the shards require
        for index in range(len(layout.buckets)):
            stacked = torch.stack([shards[index] for shards in shards_by_rank])  # (world, s)
            flats.append(einops.rearrange(stacked, "w s -> (w s)"))  # (world * shard,)
    return unflatten(flats, layout)


def entry_views(flat: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    """Views of a bucket's ``(padded_numel,)`` flat buffer, one per entry, in its shape."""
    _check_flat(flat, bucket, "entry_views")
    return [flat[entry.offset : entry.end].view(entry.shape) for entry in bucket.entries]


def alias_leaves(flat: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    """One new tensor per entry aliasing `flat`'s storage at the entry's offset, in its shape.

    Unlike `entry_views`, each is its own autograd leaf (``requires_grad`` when the bucket is
    trainable): its gradient accumulates as soon as it is ready, not when a view node of one
    flat leaf runs at the end of backward (see `fzero.buckets`). Create them while the storage
    is allocated: `set_` checks bounds, so a storage resized to 0 bytes cannot be aliased.
    """
    _check_flat(flat, bucket, "alias_leaves")
    storage = flat.untyped_storage()
    base = flat.storage_offset()
    leaves = []
    with torch.no_grad():
        for entry in bucket.entries:
            leaf = torch.empty(0, dtype=flat.dtype, device=flat.device)
            leaf.set_(storage, base + entry.offset, entry.shape, _contiguous_strides(entry.shape))
            leaves.append(leaf.requires_grad_(bucket.trainable))
    return leaves


def shard_view(flat: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
    """Rank `rank`'s ``(shard_numel,)`` slice of a bucket's padded flat buffer (a view)."""
    _check_flat(flat, bucket, "shard_view")
    lo, hi = bucket.shard_range(rank)
    return flat[lo:hi]


_WIDENED_CHUNK = 1 << 20  # float8 elements `all_finite` widens to float32 at a time


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite (no NaN, no infinity; a complex one's real and imaginary
    parts both), without a tensor-sized temporary: NaN and infinities propagate into the
    minimum and maximum. (Complex tensors passed as finite, and float8 ones raised: torch has
    no minimum of them; they are widened a chunk at a time.)"""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.element_size() == 1:  # float8
        return all(_finite_range(chunk.float()) for chunk in flat.split(_WIDENED_CHUNK))
    return _finite_range(flat)


def _finite_range(flat: torch.Tensor) -> bool:
    low, high = torch.aminmax(flat)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s elements as integers of their own width (a view): comparing them compares
    bit patterns, so NaN equals the same NaN and -0.0 differs from 0.0 (and an integer
    compare is several times faster than one over bytes). A width no integer has (complex128)
    gives bytes, along a last dimension a 0-d tensor first gets (torch views no 0-d tensor
    as a narrower dtype: a 0-d complex128 parameter crashed `check_roundtrip`, a probe)."""
    integer = _INTEGER_OF_WIDTH.get(tensor.element_size())
    if integer is not None:
        return tensor.view(integer)
    return (tensor.unsqueeze(0) if tensor.dim() == 0 else tensor).view(torch.uint8)


_CHECKSUM_CHUNK = 1 << 20
_MIX = (0x3F58476D1CE4E5B9, 0x14D049BB133111EB)  # odd: multiplying by one is a bijection


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 summary of a tensor's bits, on its device, for comparing a tensor with
    itself later: the sum over elements of a mix of their bit pattern (`bits`, sign-extended
    to 64 bits) times ``2 * position + 1``, modulo 2**64. The mix (two xor-shift-multiply
    rounds, as splitmix64's finalizer) is a bijection, and the weights are odd, so a change to
    any one element always changes the sum; it spreads a change over all 64 bits, so changes
    to several elements (sign flips, a swap) cancel only by coincidence. Computed in chunks
    of 2**20 elements, so it allocates at most a few such int64 buffers at a time."""
    flat = bits(tensor.detach().reshape(-1))
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start in range(0, flat.numel(), _CHECKSUM_CHUNK):
        z = flat[start:start + _CHECKSUM_CHUNK].to(torch.int64)
        for shift, factor in zip((31, 27), _MIX, strict=True):
            z = (z ^ _shift_right(z, shift)) * factor
        weights = torch.arange(2 * start + 1, 2 * (start + z.numel()), 2,
                               dtype=torch.int64, device=tensor.device)
        total += (z * weights).sum()
    return total


def _shift_right(z: torch.Tensor, shift: int) -> torch.Tensor:
    """A logical right shift of int64 `z` (torch's ``>>`` copies the sign bit)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 fingerprint of a contiguous tensor's bytes, on its device, for comparing
    copies that should be equal (the ranks' full parameters): the bytes read as int64 words (a
    tail of fewer than 8 bytes, or a view not aligned to 8 bytes, as elements of their own
    width), summed in blocks of `FINGERPRINT_BLOCK` (512 bytes of words), block ``b``'s sum
    times ``2 * b + 1``, all modulo 2**64. One read of the tensor and temporaries of 1/64 of a
    chunk (7.5 ms per 120 MB on one CPU core, as a plain sum); exact integer arithmetic, so it
    does not depend on threads or reduction order. A change to any one word always changes it
    (an odd weight times a nonzero change is nonzero modulo 2**64); changes to several, a
    clamp, a rescale, values moved from one block to another (``roll`` of anything larger than
    a block) cancel only by coincidence. Values permuted within one block, or shifted balanced
    in sign within one, cancel exactly (`checksum` sees those, at 60 times the cost); so do,
    compared across copies, equally many rescales by the same power of two in one block (each
    moves its word by the same multiple of 2**52 in float64: copy A halving one element and
    copy B another of the same block fingerprint alike, a probe found)."""
    flat = tensor.detach().reshape(-1)
    aligned = flat.storage_offset() * flat.element_size() % 8 == 0
    words = flat.numel() * flat.element_size() // 8 if aligned else 0
    head = words * 8 // flat.element_size()
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    weight = 1
    if head:
        weight = _add_weighted_blocks(total, flat[:head].view(torch.int64), weight)
    if head < flat.numel():
        _add_weighted_blocks(total, bits(flat[head:]), weight)
    return total


FINGERPRINT_BLOCK = 64


def _add_weighted_blocks(total: torch.Tensor, units: torch.Tensor, weight: int) -> int:
    """Add to `total` the sums of `units` (integers) in blocks of `FINGERPRINT_BLOCK`, a last
    shorter one included, times the odd weights ``weight, weight + 2, ...``; return the weight
    after the last block. Chunked, so the temporaries stay small."""
    chunk = _CHECKSUM_CHUNK  # a multiple of the block: only the last chunk has a short block
    for start in range(0, units.numel(), chunk):
        part = units[start:start + chunk]
        full = part.numel() // FINGERPRINT_BLOCK * FINGERPRINT_BLOCK
        sums = part[:full].view(-1, FINGERPRINT_BLOCK).sum(1, dtype=torch.int64)
        if full < part.numel():
            sums = torch.cat([sums, part[full:].sum(dtype=torch.int64).reshape(1)])
        weights = torch.arange(weight, weight + 2 * sums.numel(), 2, dtype=torch.int64,
                               device=units.device)
        total += (sums * weights).sum()
        weight += 2 * sums.numel()
    return weight


def bucket_shards(flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """A ``(world_size, shard_numel)`` view of a bucket's padded flat buffer; row r is rank r's.

    Raises:
        ValueError: `flat` is not the bucket's flat buffer (1-D, contiguous, ``padded_numel``
            elements): a longer one gave longer rows, silently.
    """
    _check_flat(flat, bucket, "bucket_shards")
    return einops.rearrange(flat, "(w s) -> w s", w=bucket.world_size)


# --- helpers ---------------------------------------------------------------------------------


def _concat(
    pieces: list[torch.Tensor], padding: int, bucket: Bucket, *, device: torch.device
) -> torch.Tensor:
    """``cat(pieces) ++ zeros(padding)`` into one new buffer of the bucket's dtype."""
    out = torch.empty(
        sum(p.numel() for p in pieces) + padding, dtype=bucket.torch_dtype, device=device
    )
    filled = out.numel() - padding
    with torch.no_grad():  # data movement only: the result is a new tensor outside autograd
        if pieces:
            torch.cat(pieces, out=out[:filled])
        out[filled:].zero_()
    return out


def _match(params: Mapping[str, Any], layout: ShardLayout) -> dict[str, torch.Tensor]:
    """Check `params` against the layout; map each stored entry name to its tensor."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a mapping of names to tensors, got {type(params).__name__}"
        )
    given = flatten_names(params)
    located = layout.locate()
    unknown = sorted(set(given) - set(located))
    if unknown:
        raise ValueError(f"parameters not in the layout: {unknown}")
    tensors: dict[str, torch.Tensor] = {}
    for bucket in layout.buckets:
        for entry in bucket.entries:
            name = next((n for n in entry.names if n in given), None)
            if name is None:
                raise ValueError(
                    f"parameter {entry.name!r} is missing (layout bucket {bucket.label!r})"
                )
            for other in (n for n in entry.names if n in given):
                _check_tensor(other, given[other], entry.shape, bucket.torch_dtype)
                if other != name and not _same_tensor(given[other], given[name]):
                    raise ValueError(
                        f"parameters {name!r} and {other!r} are one tied tensor in the layout, "
                        f"but were given different values: one name's would be dropped; give "
                        f"one of them, or the same tensor under both")
            tensors[entry.name] = given[name]
    return tensors


def _check_tensor(name: str, tensor: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise unless `tensor` is a tensor of `shape` and `dtype` (parameter `name`)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"parameter {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ValueError(
            f"parameter {name!r} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; "
            f"the layout expects {shape} and {dtype}")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two names' tensors are one: the same object, the same memory, or equal bits."""
    if a is b:
        return True
    if not (in_memory(a) and in_memory(b)):  # (meta: no values to tell apart)
        return not (in_memory(a) or in_memory(b))
    if a.device != b.device:
        return False
    same_view = (a.is_conj(), a.is_neg()) == (b.is_conj(), b.is_neg())  # (else other values)
    return (same_view and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()) or (
        torch.equal(bits(a.resolve_conj().resolve_neg()), bits(b.resolve_conj().resolve_neg())))


def _check_flat(flat: torch.Tensor, bucket: Bucket, what: str) -> None:
    """Raise unless `flat` is laid out as a bucket's flat buffer: 1-D, contiguous,
    ``padded_numel`` elements (a column of a 2-D buffer or a shorter slice gave views of other
    memory, silently). Any dtype: a master copy, gradients or moments are such buffers too."""
    if not (isinstance(flat, torch.Tensor) and flat.dim() == 1 and flat.is_contiguous()
            and flat.numel() == bucket.padded_numel):
        got = (f"shape {tuple(flat.shape)}, stride {flat.stride()}"
               if isinstance(flat, torch.Tensor) else type(flat).__name__)
        raise ValueError(
            f"{what}: bucket {bucket.label!r} needs a flat buffer, a contiguous 1-D tensor of "
            f"{bucket.padded_numel} elements; got {got}")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _device(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(
            f"parameters are on several devices {sorted(map(str, devices))}; move them to one first"
        )
    return devices.pop() if devices else torch.device("cpu")


def _check_buffers(buffers, layout: ShardLayout, what: str, expected_numel) -> None:
    if len(buffers) != len(layout.buckets):
        raise ValueError(
            f"{what}: expected one tensor per bucket ({len(layout.buckets)}), got {len(buffers)}"
        )
    for index, (buffer, bucket) in enumerate(zip(buffers, layout.buckets, strict=True)):
        numel = expected_numel(bucket)
        if (
            not isinstance(buffer, torch.Tensor)
            or buffer.dim() != 1
            or buffer.numel() != numel
            or buffer.dtype != bucket.torch_dtype
        ):
            got = (
                f"shape {tuple(buffer.shape)} dtype {buffer.dtype}"
                if isinstance(buffer, torch.Tensor)
                else type(buffer).__name__
            )
            raise ValueError(
                f"{what}: bucket {index} ({bucket.label!r}) expects a 1-D {bucket.dtype} tensor "
                f"of {numel} elements, got {got}"
            )
