"""Planning a parameter pytree into padded, flat, rank-sharded buckets (pure: no tensor is touched).

A `ShardLayout` is static metadata: which parameter lives in which bucket at which offset, how far
each bucket is padded so that it splits evenly over `world_size` ranks, and a fingerprint that is
the same on every rank and every run for the same model and world size.

[Note: bucket arithmetic]
A bucket holds `numel` elements; it is padded with zeros to `padded_numel`, the next multiple of
`world_size`, and rank r owns elements [r * shard_numel, (r + 1) * shard_numel) of the padded flat
buffer. Padding therefore adds fewer than `world_size` elements per bucket. All arithmetic is on
Python ints, so buckets beyond 2**31 elements are exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "DEFAULT_BUCKET_CAP",
    "DEFAULT_BUCKET_CAP_CUDA",
    "DEFAULT_BUCKET_FLOOR",
    "LAYOUT_FORMAT",
    "LAYOUT_VERSION",
    "STAGE2_MIN_BUCKETS",
    "STAGE2_MIN_CAP_CUDA",
    "Bucket",
    "Entry",
    "Segment",
    "ShardLayout",
    "TRAINING_DTYPES",
    "check_dtypes",
    "differentiable",
    "first_overlap",
    "flatten_names",
    "in_memory",
    "plan",
]

LAYOUT_FORMAT = "fzero.ShardLayout"
LAYOUT_VERSION = 1
# Parameters outside any block are grouped in module order into buckets of at most this many
# elements (a single larger parameter gets a bucket of its own).
DEFAULT_BUCKET_CAP = 2**24
# The default policy merges consecutive small blocks until a bucket holds this many elements:
# every bucket costs a fixed amount per collective and step (the transport's per-op latency,
# the hooks, the Python), which dominates below about a million elements (4 MiB in fp32).
DEFAULT_BUCKET_FLOOR = 2**20
# On a GPU a collective costs 0.1-0.3 ms of host time (c10d, NCCL, side-stream events) and a
# bucket's update several kernel launches, while the data moves at hundreds of GB/s: at stages
# 0-2 on CUDA `fzero.init`'s default groups parameters in order into buckets of at most this
# many elements (256 MiB in fp32), whatever the blocks: these stages gather nothing in
# forward. On one H200 (one rank) stage 1 went from 1.28x DDP's step time to 0.99x at 30M
# parameters (10 buckets to 1) and from 1.20x to 1.00x at 300M (24 to 5). DeepSpeed's ZeRO-1/2
# default is 5e8 elements. Stage 3 keeps one bucket per block: a bucket is gathered whole, so a
# larger one raises its peak memory.
DEFAULT_BUCKET_CAP_CUDA = 2**26
# Stage 2 holds its gradient shards (1/N of the gradient) and, while reducing, about two
# buckets' worth (one bucket's leaf gradients and its flat copy, or that copy in flight while
# the next bucket's leaves fill), three at worst: with buckets of at most 1/8 of the trainable
# elements that stays below the whole gradient stage 1 keeps from N = 2 on (1/2 + 3/8 < 1).
# So on CUDA its trainable buckets are also at most 1/STAGE2_MIN_BUCKETS of the trainable
# elements, but at least STAGE2_MIN_CAP_CUDA (16 MiB in fp32: below that the bytes do not
# matter on a GPU and the host cost does).
STAGE2_MIN_BUCKETS = 8
STAGE2_MIN_CAP_CUDA = 2**22

_INDEX_COMPONENT = re.compile(r"^\d+$")

BucketPolicy = None | int | type | Callable[[nn.Module], bool] | Sequence[Sequence[str]]
TrainableMask = None | Mapping[str, bool] | Callable[[str], bool] | Collection[str]


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored parameter inside a bucket.

    Attributes:
        name: the parameter's name (the first name under which it was seen).
        shape: its shape.
        dtype: its dtype name, e.g. ``"float32"`` (always the bucket's dtype).
        offset: index of its first element in the bucket's flat buffer.
        aliases: other names of the same tensor (tied weights), stored once.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        """One past the index of its last element in the bucket's flat buffer."""
        return self.offset + self.numel

    @property
    def names(self) -> tuple[str, ...]:
        """The name and every alias."""
        return (self.name, *self.aliases)


class Segment(NamedTuple):
    """The part of one entry that falls inside one rank's shard.

    ``shard[shard_start:shard_end] == entry.flatten()[entry_start:entry_start + length]``.
    """

    entry: Entry
    entry_start: int
    shard_start: int
    shard_end: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """An ordered group of parameters of one dtype and one trainability, flattened together.

    Attributes:
        label: a human-readable name (e.g. ``"blocks.0"``), for messages and reports.
        entries: the stored parameters, in order, contiguous from offset 0.
        dtype: dtype name of every entry, e.g. ``"bfloat16"``.
        trainable: whether its parameters receive gradients and optimizer state.
        world_size: the number of ranks it is sharded over.
    """

    label: str
    entries: tuple[Entry, ...]
    dtype: str
    trainable: bool
    world_size: int

    @property
    def numel(self) -> int:
        """Elements stored, padding excluded."""
        return self.entries[-1].end if self.entries else 0

    @property
    def padded_numel(self) -> int:
        """Elements in the flat buffer: `numel` rounded up to a multiple of `world_size`."""
        return self.shard_numel * self.world_size

    @property
    def shard_numel(self) -> int:
        """Elements each rank holds."""
        return -(-self.numel // self.world_size)

    @property
    def padding(self) -> int:
        """Zero elements appended after the last entry (fewer than `world_size`)."""
        return self.padded_numel - self.numel

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a `torch.dtype`."""
        return _parse_dtype(self.dtype)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name stored in the bucket, aliases included, in entry order."""
        return tuple(name for entry in self.entries for name in entry.names)

    def cast(self, dtype: torch.dtype) -> Bucket:
        """The same bucket stored in `dtype`."""
        name = _dtype_name(dtype)
        entries = tuple(dataclasses.replace(e, dtype=name) for e in self.entries)
        return dataclasses.replace(self, entries=entries, dtype=name)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The half-open range of the padded flat buffer that `rank` holds."""
        _check_rank(rank, self.world_size)
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """The pieces of entries that fall in `rank`'s shard, in order (padding excluded)."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for entry in self.entries:
            start, end = max(entry.offset, lo), min(entry.end, hi)
            if start < end:
                pieces.append(Segment(entry, start - entry.offset, start - lo, end - lo))
        return tuple(pieces)


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """How a parameter pytree is split into buckets and sharded over `world_size` ranks.

    Static, hashable metadata; build it with `plan`. Equal layouts have equal fingerprints on
    every rank and every run.
    """

    buckets: tuple[Bucket, ...]
    world_size: int
    version: int = LAYOUT_VERSION
    # Derived once on first use (a train step reads both every step); not part of equality.
    _fingerprint: str | None = field(default=None, init=False, repr=False, compare=False)
    _located: dict[str, tuple[int, Entry]] | None = field(
        default=None, init=False, repr=False, compare=False)

    @property
    def numel(self) -> int:
        """Parameter elements stored (tied parameters once), padding excluded."""
        return sum(bucket.numel for bucket in self.buckets)

    @property
    def padded_numel(self) -> int:
        """Elements of all flat buffers, padding included."""
        return sum(bucket.padded_numel for bucket in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements each rank holds over all buckets."""
        return sum(bucket.shard_numel for bucket in self.buckets)

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter name, aliases included, in bucket order."""
        return tuple(name for bucket in self.buckets for name in bucket.names)

    @property
    def trainable_numel(self) -> int:
        """Elements of the trainable buckets, padding excluded."""
        return sum(bucket.numel for bucket in self.buckets if bucket.trainable)

    def locate(self) -> Mapping[str, tuple[int, Entry]]:
        """Map every name (aliases included) to ``(bucket index, entry)`` (read-only)."""
        if self._located is None:
            located = {
                name: (index, entry)
                for index, bucket in enumerate(self.buckets)
                for entry in bucket.entries
                for name in entry.names
            }
            object.__setattr__(self, "_located", located)
        assert self._located is not None
        return MappingProxyType(self._located)

    @property
    def fingerprint(self) -> str:
        """A stable 16-hex-digit hash of everything that defines the layout."""
        if self._fingerprint is None:
            digest = hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()[:16]
            object.__setattr__(self, "_fingerprint", digest)
        assert self._fingerprint is not None
        return self._fingerprint

    def parts(self) -> dict[str, str]:
        """What the fingerprint covers, part by part, as text (for naming what differs when
        two layouts' fingerprints do: `fzero.comm.fingerprint_check`)."""
        entries = sorted(((e, b) for b in self.buckets for e in b.entries),
                         key=lambda pair: pair[0].name)
        return {
            "parameter names, shapes and dtypes": repr(
                [(e.name, list(e.shape), b.dtype) for e, b in entries]),
            "tied names (aliases)": repr([(e.name, list(e.aliases)) for e, _ in entries
                                          if e.aliases]),
            "which parameters are trainable (requires_grad, trainable=)": repr(
                [e.name for e, b in entries if b.trainable]),
            "how parameters are bucketed (buckets=)": repr(
                [[e.name for e in b.entries] for b in self.buckets]),
            "world size": str(self.world_size),
        }

    def to_json(self, indent: int | None = 1) -> str:
        """Serialize to JSON text; `ShardLayout.from_json` is its exact inverse."""
        doc = {
            "format": LAYOUT_FORMAT,
            "version": self.version,
            "world_size": self.world_size,
            "buckets": [
                {
                    "label": bucket.label,
                    "dtype": bucket.dtype,
                    "trainable": bucket.trainable,
                    "entries": [
                        [entry.name, list(entry.shape), entry.offset, list(entry.aliases)]
                        for entry in bucket.entries
                    ],
                }
                for bucket in self.buckets
            ],
        }
        separators = (",", ":") if indent is None else None
        return json.dumps(doc, indent=indent, separators=separators)

    @classmethod
    def from_json(cls, text: str) -> ShardLayout:
        """Parse the output of `to_json`, rejecting other formats and versions."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"layout JSON does not parse: {error}") from error
        if not isinstance(doc, dict) or doc.get("format") != LAYOUT_FORMAT:
            raise ValueError(
                f"not an fzero layout: expected format={LAYOUT_FORMAT!r}, "
                f"got {doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r}"
            )
        if doc.get("version") != LAYOUT_VERSION:
            raise ValueError(
                f"layout version {doc.get('version')!r} is not supported by this fzero "
                f"(it reads version {LAYOUT_VERSION}); re-plan the layout or upgrade fzero"
            )
        try:
            world_size = doc["world_size"]
            _check_world_size(world_size)
            buckets = []
            for raw in doc["buckets"]:
                dtype, trainable = raw["dtype"], raw["trainable"]
                torch_dtype = _parse_dtype(dtype)
                if not isinstance(trainable, bool):
                    raise ValueError(f"bucket {raw['label']!r}: trainable must be true or "
                                     f"false, got {trainable!r}")
                if trainable and not differentiable(torch_dtype):
                    raise ValueError(f"bucket {raw['label']!r} is trainable but of dtype "
                                     f"{dtype}")
                entries = tuple(_entry_from_json(raw["label"], dtype, *fields)
                                for fields in raw["entries"])
                if not isinstance(raw["label"], str):
                    raise TypeError(f"a bucket label must be a string, got {raw['label']!r}")
                buckets.append(Bucket(raw["label"], entries, dtype, trainable, world_size))
        except (KeyError, TypeError, ValueError) as error:  # another writer's JSON, or edited
            raise ValueError(f"malformed layout JSON: {type(error).__name__}: {error}") from error
        layout = cls(tuple(buckets), world_size)
        _check_contiguous(layout)
        return layout

    def cast(self, dtype: torch.dtype) -> ShardLayout:
        """The same layout with every floating-point bucket stored in `dtype`."""
        buckets = tuple(
            b.cast(dtype) if b.torch_dtype.is_floating_point else b for b in self.buckets
        )
        return ShardLayout(buckets, self.world_size, self.version)

    def with_world_size(self, world_size: int) -> ShardLayout:
        """The same buckets sharded over another number of ranks (for resharding)."""
        _check_world_size(world_size)
        buckets = tuple(dataclasses.replace(b, world_size=world_size) for b in self.buckets)
        return ShardLayout(buckets, world_size, self.version)


def plan(
    params: Mapping[str, Any] | nn.Module,
    world_size: int,
    *,
    buckets: BucketPolicy = None,
    trainable: TrainableMask = None,
    cap: int = DEFAULT_BUCKET_CAP,
    floor: int = DEFAULT_BUCKET_FLOOR,
    separate_tied: bool = True,
) -> ShardLayout:
    """Plan how `params` are flattened into buckets and sharded over `world_size` ranks.

    Pure: reads names, shapes, dtypes and `requires_grad` only, so `meta` tensors plan too.

    Args:
        params: an `nn.Module` (its parameters, tied ones once), or a mapping of names to
            tensors, possibly nested (flattened to dotted names). The same tensor under two
            names (one object; in a mapping also two viewing the same memory, as a
            ``state_dict()`` gives a tied weight) is stored once, the later names as aliases.
        world_size: number of ranks (>= 1).
        buckets: the bucket policy. ``None``: one bucket per element of every list container
            (a name component that is an integer, as `nn.ModuleList` and `nn.Sequential` make),
            the other parameters grouped in order under `cap` elements; then consecutive
            groups smaller than `floor` are merged (see `floor`). A module class or a
            predicate ``fn(module) -> bool`` (needs a module): one bucket per outermost matching
            submodule, the rest grouped under `cap`. An int: a size cap in elements. A list of
            lists of names: exactly these groups, covering every parameter once.
        trainable: which parameters train. ``None``: ``requires_grad``. Otherwise a mapping
            name -> bool, a predicate ``fn(name) -> bool``, or a collection of trainable names.
            A tied tensor trains as a whole: a mapping or collection may name any of its names,
            a predicate is asked about all of them, and flags that disagree raise.
        cap: the size cap (elements) for grouped parameters under the default policies.
        floor: under ``buckets=None``, consecutive groups of one kind (trainable or frozen,
            one dtype) are merged into one bucket until it holds `floor` elements (a last one
            of its kind left under `floor` joins the bucket before), so a model of small
            blocks gets few buckets (each costs a fixed amount per collective and step), of
            about `floor` elements; a group holding a tied parameter stays alone if
            `separate_tied`.
            ``floor=1`` merges nothing: one bucket per block.
        separate_tied: keep a group holding a tied parameter (used in two places) out of the
            `floor` merge. Stage 3 gathers a bucket at each use, so a tied embedding merged
            into the first block's bucket would gather that block again for the output head;
            stages 0-2 gather nothing in forward, and `fzero.init` passes False for them (a
            tied embedding's gradient is complete at the end of backward, as its first
            block's is: merging costs no overlap and saves two collectives per step).

    Returns:
        The layout. Within a group, trainable and frozen parameters, and parameters of
        different dtypes, go to separate buckets; buckets follow parameter order.

    Raises:
        TypeError: a leaf is not a tensor, or a policy has the wrong type.
        ValueError: `world_size` < 1, a trainable parameter is not floating point, an
            explicit bucket list names unknown, repeated or missing parameters, or `trainable`
            names unknown ones or disagrees with itself on a tied tensor, or two parameters
            share memory without being one tensor.
    """
    _check_world_size(world_size)
    module = params if isinstance(params, nn.Module) else None
    tensors = _named_tensors(params)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap must be a positive int of elements, got {cap=}")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
        raise ValueError(f"floor must be a positive int of elements, got {floor=}")

    # Tied parameters: the first name owns the storage, later names are aliases.
    primary: dict[object, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, tensor in tensors.items():
        owner = primary.setdefault(id(tensor) if module else _tie_key(tensor), name)
        aliases.setdefault(owner, [])
        if owner != name:
            aliases[owner].append(name)
    alias_of = {alias: owner for owner, names in aliases.items() for alias in names}
    stored = list(aliases)
    _check_no_partial_overlap({name: tensors[name] for name in stored})

    is_trainable = _trainable_predicate(trainable, tensors, aliases)
    for name in stored:
        tensor = tensors[name]
        if is_trainable(name) and not differentiable(tensor.dtype):
            raise ValueError(
                f"parameter {name!r} is trainable but has dtype {tensor.dtype}; only floating "
                f"point parameters can train (mark it frozen with requires_grad=False or "
                f"trainable=...)"
            )

    groups = _group(stored, tensors, alias_of, buckets, module, cap)
    if buckets is None and floor > 1:
        groups = _merge_small(groups, tensors, aliases, is_trainable, floor,
                              separate_tied=separate_tied)
    out = []
    for label, names in groups:
        out.extend(_split_group(label, names, tensors, aliases, is_trainable, world_size))
    return ShardLayout(tuple(out), world_size)


def flatten_names(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a nested mapping to dotted names: ``{"a": {"b": x}} -> {"a.b": x}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str):
            raise TypeError(f"parameter names must be str, got {key!r} under {prefix!r}")
        name = f"{prefix}{key}"
        inner = flatten_names(value, f"{name}.") if isinstance(value, Mapping) else {name: value}
        twice = sorted(set(inner) & set(flat))
        if twice:
            raise ValueError(f"parameter name {twice[0]!r} is given twice (as a dotted key "
                             f"and through nested mappings): which tensor is meant?")
        flat.update(inner)
    return flat


# --- helpers ---------------------------------------------------------------------------------


def differentiable(dtype: torch.dtype) -> bool:
    """Whether parameters of `dtype` have gradients (and so may be trainable): floating and
    complex ones, not integer or bool ones."""
    return dtype.is_floating_point or dtype.is_complex


def _tie_key(tensor: torch.Tensor) -> object:
    """What makes two names of a mapping one tensor: the same object, or the same elements in
    memory (a ``state_dict()`` or ``detach()`` makes a new tensor object per name of a tied
    weight; planned apart, the two would train apart). A meta tensor has no address, but the
    names of a tied one still share one storage object (a meta model's ``state_dict()`` was
    planned untied: another layout than the same model's on CPU, silently: a probe). Empty
    tensors and subclasses have no elements to share. (A module's parameters are tied by
    identity, as torch ties them.) A conjugate or negative view of the same memory holds
    other values: not a tie (one was read as the other, silently: a probe)."""
    if tensor.numel() == 0 or type(tensor) not in (torch.Tensor, nn.Parameter):
        return id(tensor)
    where = (("meta", tensor.untyped_storage()._cdata, tensor.storage_offset())
             if tensor.is_meta else (tensor.device, tensor.data_ptr()))
    return (*where, tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.is_conj(),
            tensor.is_neg())


def first_overlap(
    tensors: Iterable[tuple[str, torch.Tensor]],
    counts: Callable[[str, str], bool] | None = None,
) -> tuple[str, str] | None:
    """The labels of two of the labelled `tensors` whose memory overlaps, or None; with
    `counts`, only a pair it accepts. Each is taken by the span of bytes its elements lie in
    (a strided view's span also covers the elements it skips, so two views that interleave
    without sharing an element count too); distinct storages never overlap in the address
    space. Empty tensors overlap nothing."""
    spans = []
    for label, t in tensors:
        if t.numel() == 0:
            continue
        start = t.data_ptr()
        extent = t.numel() if t.is_contiguous() else 1 + sum(
            (size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        spans.append((start, start + extent * t.element_size(), label))
    spans.sort(key=lambda span: span[:2])
    reaching: list[tuple[int, int, str]] = []  # earlier spans that reach past this start
    for span in spans:
        reaching = [other for other in reaching if other[1] > span[0]]
        for other in reaching:
            if counts is None or counts(other[2], span[2]):
                return other[2], span[2]
        reaching.append(span)
    return None


def in_memory(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements have addresses to compare: not meta, not a subclass (which
    may have no storage)."""
    return not tensor.is_meta and type(tensor) in (torch.Tensor, nn.Parameter)


def _check_no_partial_overlap(tensors: Mapping[str, torch.Tensor]) -> None:
    """Distinct parameters (ties already merged) share no element: two views of one memory
    shaped apart would be planned, sharded and trained as two parameters (`first_overlap`)."""
    pair = first_overlap((name, t) for name, t in tensors.items() if in_memory(t))
    if pair is not None:
        raise ValueError(
            f"parameters {pair[0]!r} and {pair[1]!r} share memory but are not one tensor: they "
            f"would be stored and trained as two; give each its own memory, or the same tensor "
            f"under both names to tie them"
        )


def _named_tensors(params: Mapping[str, Any] | nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(params, nn.Module):
        flat = dict(params.named_parameters(remove_duplicate=False))
    elif not isinstance(params, Mapping):
        raise TypeError(
            f"params must be an nn.Module or a mapping of names to tensors, "
            f"got {type(params).__name__}"
        )
    else:
        flat = flatten_names(params)
    for name, value in flat.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"parameter {name!r} is a {type(value).__name__}, expected a torch.Tensor"
            )
        _check_storable(name, value)
    return flat


def _check_storable(name: str, tensor: torch.Tensor) -> None:
    """Raise, naming the parameter, unless `tensor` is a dense strided tensor of a dtype whose
    elements can be copied into a flat buffer and padded (sparse, nested, MKL-DNN and
    quantized tensors, and the bit-packed dtypes, failed deep inside `plan` or `shard` with
    torch's own errors: a probe)."""
    kind = ("nested" if tensor.is_nested else "MKL-DNN" if tensor.is_mkldnn
            else "quantized" if tensor.is_quantized
            else None if tensor.layout == torch.strided else "sparse")
    if kind is not None:
        raise TypeError(
            f"parameter {name!r} is a {kind} tensor ({tensor.layout}); fzero stores dense "
            f"strided tensors, flattened into buckets: convert it (e.g. .to_dense(), "
            f"dequantize) or keep it out of the parameters")
    if tensor.dtype in _PACKED_DTYPES:
        raise TypeError(
            f"parameter {name!r} has dtype {tensor.dtype}, whose elements pack several values "
            f"or carry no arithmetic; fzero cannot pad a flat buffer of it: store it as "
            f"uint8 (tensor.view(torch.uint8)) and view it back in forward")


_PACKED_DTYPES = frozenset(
    getattr(torch, name) for name in (
        "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", "float4_e2m1fn_x2")
    if hasattr(torch, name))
"""Dtypes a flat buffer cannot be padded in (torch implements no fill for them)."""


def _trainable_predicate(
    trainable: TrainableMask, tensors: Mapping[str, torch.Tensor],
    aliases: Mapping[str, list[str]],
) -> Callable[[str], bool]:
    """Whether each parameter trains under `trainable`, a tied tensor decided by all its names.

    A tied tensor is one tensor: it trains or not as a whole. A mapping or a collection may
    name any of its names (the others follow); a predicate is asked about every name.

    Raises:
        ValueError: `trainable` names parameters the model does not have, or gives the names of
            one tied tensor different flags (``lm_head.*`` on a GPT whose head is its
            embedding: training the head trains the embedding).
        TypeError: `trainable` is none of the accepted kinds.
    """
    if trainable is None:
        for owner, others in aliases.items():
            flags = {name: tensors[name].requires_grad for name in (owner, *others)}
            if len(set(flags.values())) > 1:
                raise ValueError(
                    f"the names of one tied tensor differ in requires_grad, {flags} (one of "
                    f"them a detach() or a state_dict() entry?): they are one tensor, which "
                    f"trains or not as a whole; give them the same flag, or say which train "
                    f"with trainable=")
        return lambda name: tensors[name].requires_grad
    opinion = _opinion(trainable, tensors)
    decided: dict[str, bool] = {}
    for owner, others in aliases.items():
        given = {name: opinion(name) for name in (owner, *others)}
        flags = {flag for flag in given.values() if flag is not None}
        if len(flags) > 1:
            raise ValueError(
                f"trainable= gives the names of one tied tensor different flags, {given}: they "
                f"are one tensor, which trains or not as a whole (training one name trains "
                f"the others); give all of them the same flag"
            )
        decided.update(dict.fromkeys(given, flags.pop() if flags else False))
    return decided.__getitem__


def _opinion(
    trainable: Any, tensors: Mapping[str, torch.Tensor]
) -> Callable[[str], bool | None]:
    """What `trainable` says of one name: True, False, or None (a mapping or a collection
    that does not name it)."""
    if callable(trainable):
        return lambda name: bool(trainable(name))
    if not isinstance(trainable, Mapping | Collection) or isinstance(trainable, str):
        raise TypeError(
            f"trainable must be None, a mapping, a predicate or a collection of names, "
            f"got {type(trainable).__name__}"
        )
    unknown = sorted(set(trainable) - set(tensors))
    if unknown:
        raise ValueError(f"trainable= names unknown parameters: {unknown}")
    if isinstance(trainable, Mapping):
        flags = {name: bool(flag) for name, flag in trainable.items()}
        return flags.get
    chosen = frozenset(trainable)
    return lambda name: True if name in chosen else None


def _group(
    stored: list[str],
    tensors: Mapping[str, torch.Tensor],
    alias_of: Mapping[str, str],
    policy: BucketPolicy,
    module: nn.Module | None,
    cap: int,
) -> list[tuple[str, list[str]]]:
    """Split the stored names into labelled groups, in parameter order."""
    if policy is None:
        return _group_by_block(stored, tensors, _list_element_prefix, cap)
    if isinstance(policy, bool):
        raise TypeError(
            f"buckets must be None, an int, a class, a predicate or lists, got {policy}"
        )
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"a bucket size cap must be >= 1 element, got buckets={policy}")
        return _group_by_block(stored, tensors, lambda name: None, policy)
    if isinstance(policy, type) or callable(policy):
        if module is None:
            raise TypeError(
                "buckets= as a module class or predicate needs plan(model, ...) with the "
                "nn.Module itself, not a mapping of its parameters"
            )
        matches = policy if not isinstance(policy, type) else (lambda m: isinstance(m, policy))
        prefixes = _matching_prefixes(module, matches)
        return _group_by_block(stored, tensors, lambda n: _longest_prefix(n, prefixes), cap)
    if isinstance(policy, Sequence) and not isinstance(policy, str):
        return _explicit_groups(stored, alias_of, policy)
    raise TypeError(
        f"buckets must be None, an int, a module class, a predicate or a list of lists of "
        f"names, got {type(policy).__name__}"
    )


def _group_by_block(
    stored: list[str],
    tensors: Mapping[str, torch.Tensor],
    block_of: Callable[[str], str | None],
    cap: int,
) -> list[tuple[str, list[str]]]:
    """Consecutive parameters of one block form a group; the others fill groups up to `cap`,
    each labelled by its first and last parameters (`_span_label`)."""
    groups: list[tuple[str | None, list[str]]] = []  # label None: filled, labelled at the end
    current_block: str | None = None
    filled = 0
    for name in stored:
        block = block_of(name)
        numel = tensors[name].numel()
        if block is not None:
            if not groups or current_block != block:
                groups.append((block, []))
            current_block = block
        elif not groups or current_block is not None or (filled + numel > cap and filled > 0):
            groups.append((None, []))
            current_block, filled = None, 0
        groups[-1][1].append(name)
        filled += numel
    return [(_span_label(names) if label is None else label, names) for label, names in groups]


def _span_label(names: Sequence[str]) -> str:
    """A label for parameters in order, from the first's and the last's module: ``"wte"``,
    ``"tok_emb..pos_emb"``. The first's module alone misnamed a group that held others'
    parameters too (a frozen ``teacher.*`` bucket was labelled ``student``, and errors named
    the wrong module)."""
    first, last = (n.rsplit(".", 1)[0] if "." in n else n for n in (names[0], names[-1]))
    return first if first == last else f"{first}..{last}"


def _merge_small(
    groups: list[tuple[str, list[str]]],
    tensors: Mapping[str, torch.Tensor],
    aliases: Mapping[str, list[str]],
    is_trainable: Callable[[str], bool],
    floor: int,
    *,
    separate_tied: bool,
) -> list[tuple[str, list[str]]]:
    """Merge consecutive groups of one and the same kind into buckets: a group joins the
    bucket before while that bucket holds fewer than `floor` elements, and a bucket left
    under `floor` (the last of its kind) joins the one before. So a merged bucket is one group
    with fewer than `floor` elements on each side of it, however many small groups follow (a
    group of 2**19 elements used to join a bucket of any size: every block of a deep model of
    small blocks was one bucket, which stage 3 gathered whole). A group of mixed kinds, or
    holding a tied parameter when `separate_tied`, stays alone. Labels become
    ``"first..last"``."""

    def kind(names: list[str]) -> tuple[bool, torch.dtype] | None:
        kinds = {(is_trainable(n), tensors[n].dtype) for n in names}
        tied = separate_tied and any(aliases[n] for n in names)
        return next(iter(kinds)) if len(kinds) == 1 and not tied else None

    # labels, names, size, kind (None: never merged)
    Merged = tuple[list[str], list[str], int, tuple[bool, torch.dtype] | None]

    def join(before: Merged, after: Merged) -> Merged:
        return ([*before[0], *after[0]], before[1] + after[1], before[2] + after[2], after[3])

    filled: list[Merged] = []
    for label, names in groups:
        this: Merged = ([label], list(names), sum(tensors[n].numel() for n in names),
                        kind(names))
        if filled and this[3] is not None and filled[-1][3] == this[3] and filled[-1][2] < floor:
            filled[-1] = join(filled[-1], this)
        else:
            filled.append(this)
    merged: list[Merged] = []
    for this in filled:
        if (merged and this[3] is not None and merged[-1][3] == this[3]
                and this[2] < floor):  # (so the one before holds `floor` or more)
            merged[-1] = join(merged[-1], this)
        else:
            merged.append(this)
    # A merged group says where it starts and ends, even when both ends share a label ("h.0"
    # twice, around another group, is "h.0..h.0": it holds more than h.0).
    return [(labels[0] if len(labels) == 1 else f"{labels[0]}..{labels[-1]}", names)
            for labels, names, _, _ in merged]


def _list_element_prefix(name: str) -> str | None:
    """``"h.3.attn.weight" -> "h.3"``: the shortest prefix ending in an integer component."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if _INDEX_COMPONENT.match(part):
            return ".".join(parts[: i + 1])
    return None


def _matching_prefixes(module: nn.Module, matches: Callable[[nn.Module], bool]) -> list[str]:
    prefixes: list[str] = []
    for name, sub in module.named_modules(remove_duplicate=False):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            continue  # nested inside an outer match: it belongs to that bucket
        if matches(sub):
            prefixes.append(name)
    return prefixes


def _longest_prefix(name: str, prefixes: Sequence[str]) -> str | None:
    found = [p for p in prefixes if p == "" or name.startswith(p + ".")]
    return max(found, key=len) if found else None


def _explicit_groups(
    stored: list[str], alias_of: Mapping[str, str], policy: Sequence[Sequence[str]]
) -> list[tuple[str, list[str]]]:
    known = set(stored) | set(alias_of)
    seen: dict[str, tuple[int, str]] = {}  # stored name -> (bucket, the name that placed it)
    groups = []
    for index, group in enumerate(policy):
        if isinstance(group, str) or not isinstance(group, Sequence):
            raise TypeError(f"buckets[{index}] must be a list of names, got {group!r}")
        names = []
        for name in group:
            if name not in known:
                raise ValueError(f"buckets[{index}] names unknown parameter {name!r}")
            owner = alias_of.get(name, name)
            if owner in seen:
                where, placed = seen[owner]
                if placed == name:
                    raise ValueError(
                        f"parameter {name!r} is in buckets[{where}] and buckets[{index}]")
                if where != index:
                    raise ValueError(
                        f"parameter {name!r} is in buckets[{index}], but it is tied to "
                        f"{placed!r} (one tensor) in buckets[{where}]: a tied tensor lives "
                        f"in one bucket; list its names together or name one of them")
                continue  # another name of a tie already in this bucket (Bucket.names lists
                # every name, so a layout's own bucket names are a valid buckets= list)
            seen[owner] = (index, name)
            names.append(owner)
        groups.append((f"bucket{index}", names))
    missing = [name for name in stored if name not in seen]
    if missing:
        raise ValueError(f"buckets= lists no bucket for parameters {missing}")
    return groups


def _split_group(
    label: str,
    names: list[str],
    tensors: Mapping[str, torch.Tensor],
    aliases: Mapping[str, list[str]],
    is_trainable: Callable[[str], bool],
    world_size: int,
) -> Iterator[Bucket]:
    """One bucket per (trainable, dtype) kind in the group, kinds in first-seen order."""
    kinds: dict[tuple[bool, str], list[str]] = {}
    for name in names:
        kinds.setdefault((is_trainable(name), _dtype_name(tensors[name].dtype)), []).append(name)
    for (train, dtype), members in kinds.items():
        # split: each part named by what it holds, unless the group's label (its block) does
        own = (label if len(kinds) == 1 or all(n.startswith(f"{label}.") for n in members)
               else _span_label(members))
        entries, offset = [], 0
        for name in members:
            shape = tuple(int(d) for d in tensors[name].shape)
            entries.append(Entry(name, shape, dtype, offset, tuple(aliases[name])))
            offset += math.prod(shape)
        suffix = "" if len(kinds) == 1 else f"[{'trainable' if train else 'frozen'},{dtype}]"
        yield Bucket(own + suffix, tuple(entries), dtype, train, world_size)


def _entry_from_json(label: Any, dtype: str, name: Any, shape: Any, offset: Any,
                     aliases: Any) -> Entry:
    """One entry of `ShardLayout.from_json`, its fields' types checked (aliases given as a
    string became one alias per character; a float shape gave a float size)."""

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(name, str):
        raise TypeError(f"bucket {label!r}: an entry's name must be a string, got {name!r}")
    if not isinstance(shape, list) or not all(whole(size) for size in shape):
        raise TypeError(f"entry {name!r}: shape must be a list of sizes, got {shape!r}")
    if not whole(offset):
        raise TypeError(f"entry {name!r}: offset must be a whole number, got {offset!r}")
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise TypeError(f"entry {name!r}: aliases must be a list of names, got {aliases!r}")
    return Entry(name, tuple(shape), dtype, offset, tuple(aliases))


def _check_contiguous(layout: ShardLayout) -> None:
    names: set[str] = set()
    for bucket in layout.buckets:
        offset = 0
        for entry in bucket.entries:
            if entry.offset != offset or any(d < 0 for d in entry.shape):
                raise ValueError(f"layout entry {entry.name!r} has an inconsistent offset/shape")
            offset = entry.end
            if names & set(entry.names) or len(set(entry.names)) < len(entry.names):
                raise ValueError(f"layout names parameter {entry.name!r} twice")
            names.update(entry.names)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in layout")
    return dtype


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size=}")


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank=}")


TRAINING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The floating dtypes a state computes, reduces and updates in (torch has no arithmetic for
the float8 types on every device: a step would fail in a kernel)."""


def check_dtypes(**dtypes: torch.dtype | None) -> None:
    """Raise unless every given dtype is one of `TRAINING_DTYPES` or None (names the
    argument)."""
    for what, dtype in dtypes.items():
        if dtype is not None and not (isinstance(dtype, torch.dtype)
                                      and dtype in TRAINING_DTYPES):
            raise TypeError(f"{what} must be a floating torch.dtype that training computes "
                            f"in ({', '.join(map(str, TRAINING_DTYPES))}) or None, got "
                            f"{dtype!r}")
