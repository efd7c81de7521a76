"""`ShardState`: everything a rank owns for training, as one immutable value; and `init`.

Per bucket b of the layout, with ``s_b`` its shard numel and ``P_b`` its padded numel:

| field   | stage 0            | stage 1            | stage 2            | stage 3            |
|---------|--------------------|--------------------|--------------------|--------------------|
| params  | (P_b,) full        | (P_b,) full        | (P_b,) full        | (s_b,) shard       |
| grads   | (P_b,) full        | (P_b,) full        | (s_b,) shard       | (s_b,) shard       |
| master  | (P_b,) full        | (s_b,) shard       | (s_b,) shard       | (s_b,) shard       |
| moments | like master        | like master        | like master        | like master        |

`params` are in the compute dtype (``param_dtype``) for every bucket; `grads`, `master` and each
moment exist for trainable buckets only (None elsewhere). When the compute dtype is the master
dtype, ``master[b]`` is a view of ``params[b]`` (the parameters are the master copy: no second
copy); otherwise it is an fp32 copy. Memory is counted per storage, so views count once
(`state_bytes`), which is what the stage table of docs/design.md predicts.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import secrets
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from fzero import memory
from fzero.bound import (
    ModuleVersions,
    buffer_aliases,
    buffers_fingerprint,
    check_shared_memory,
    module_versions,
    non_persistent_buffers,
    requires_grad_flags,
    same_values,
)
from fzero.comm import Comm, check_comm, fingerprint_check
from fzero.flat import all_finite, bits, checksum, fingerprint, flatten, shard_view
from fzero.layout import (
    DEFAULT_BUCKET_CAP_CUDA,
    STAGE2_MIN_BUCKETS,
    STAGE2_MIN_CAP_CUDA,
    Bucket,
    Entry,
    ShardLayout,
    check_dtypes,
    flatten_names,
    plan,
)
from fzero.optim import Optimizer

__all__ = [
    "Lease",
    "LossScale",
    "ShardConfig",
    "ShardState",
    "STAGES",
    "default_buckets",
    "check_dtypes",
    "check_finite",
    "check_live",
    "check_optimizer_dtype",
    "check_tensors",
    "check_reduce_dtype",
    "clone_lineage",
    "clone_state",
    "default_master_dtype",
    "init",
    "layout_bytes_theory",
    "lost_writes",
    "params_fingerprint",
    "shared_lineage",
    "state_bytes",
    "state_bytes_theory",
    "with_uncast",
]

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True, slots=True)
class LossScale:
    """Dynamic loss scaling for float16 compute (the `torch.amp.GradScaler` rule).

    The loss is multiplied by `scale` before backward. A step with non-finite gradients is
    skipped and the scale multiplied by `backoff`, but never below `floor`; after `interval`
    finite steps in a row it is multiplied by `growth`. A step whose gradients are not finite
    although the scale is at its floor raises (`fzero.StepError`): scaling cannot help any more,
    and a scale stuck at 1 that silently stops training is what DeepSpeed#697 reports.
    """

    scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000
    good_steps: int = 0
    floor: float = 1.0

    @property
    def at_floor(self) -> bool:
        """Whether the scale cannot back off any further."""
        return self.scale <= self.floor

    def after(self, finite: bool) -> LossScale:
        """The scale state after a step whose gradients were (not) all finite."""
        if not finite:
            scale = max(self.scale * self.backoff, self.floor)
            return dataclasses.replace(self, scale=scale, good_steps=0)
        if self.good_steps + 1 >= self.interval:
            return dataclasses.replace(self, scale=self.scale * self.growth, good_steps=0)
        return dataclasses.replace(self, good_steps=self.good_steps + 1)


@dataclass(frozen=True)
class ShardConfig:
    """Static settings of a state: how it communicates, updates and stores numbers."""

    comm: Comm
    optimizer: Optimizer
    param_dtype: torch.dtype | None
    master_dtype: torch.dtype
    reduce_dtype: torch.dtype | None
    device: torch.device
    # The module's (name, requires_grad) pairs when the state was built from one: a step raises
    # if a flag changed since (trainability is fixed by the layout; a flip would be ignored).
    requires_grad: tuple[tuple[str, bool], ...] | None = None
    # The module's own tensors' version counters then: a step raises if one was written since
    # with values other than the state's (they would be ignored: `fzero.bound.ModuleVersions`).
    module_versions: ModuleVersions | None = field(default=None, compare=False, repr=False)
    # ``(alias, name)`` for each buffer the module registered under several names
    # (`fzero.bound.buffer_aliases`): a step binds the alias to the state's buffer `name`.
    buffer_aliases: tuple[tuple[str, str], ...] = ()
    # The module's buffers registered with ``persistent=False`` (None: built from a mapping of
    # tensors, unknown). A checkpoint records them, so that a load can tell a buffer saved
    # persistent (its value is data) from one the loading module derives itself.
    non_persistent: tuple[str, ...] | None = None


class Lease:
    """Whether a state still owns its tensors: a train step consumes (donates) its input.

    [Note: donation]
    ``step(state, batch)`` updates the input state's tensors in place and returns a new state
    over the same storage, as a JAX function with donated arguments does: optimizer memory
    never doubles. The input state is then *consumed*: using it again (a step, `full_params`,
    a save) raises, naming the step that consumed it, instead of silently reading the new
    values. `clone_state` keeps a copy on purpose (for a rollback, an EMA, a comparison).

    A state rebuilt from its pytree leaves (``tree_map(lambda t: t, state)``, or a map that
    keeps some of the tensors a step updates) shares the lease of the state it came from, as
    it shares the tensors: after a step consumed either, both are consumed. A map that made
    new tensors for all of them (``tree_map(torch.clone, state)``) is a live state of its own.
    """

    __slots__ = ("consumed_by", "updating")

    def __init__(self) -> None:
        self.consumed_by: int | None = None  # the step number that consumed the state
        # From the first in-place write of that step's update until it returned: left True,
        # the step was interrupted there (Ctrl-C), and the tensors hold part of an update.
        self.updating = False

    def __repr__(self) -> str:
        return f"Lease(consumed_by={self.consumed_by}, updating={self.updating})"


@dataclass(frozen=True)
class ShardState:
    """One rank's training state for ZeRO stage `stage` (see the module docstring's table).

    A pytree: the tensors (params, grads, master, moments, buffers) are its leaves; layout,
    stage, step, loss scale and config are static. Train steps consume their input state (see
    `Lease`) and return a new one made with `dataclasses.replace`.
    """

    layout: ShardLayout
    stage: int
    step: int
    params: tuple[Tensor, ...]
    grads: tuple[Tensor | None, ...]
    master: tuple[Tensor | None, ...]
    moments: dict[str, tuple[Tensor | None, ...]]
    buffers: dict[str, Tensor]
    config: ShardConfig
    loss_scale: LossScale | None = None
    bucket_order: Any = None
    """Stage 3: a `fzero.schedule.BucketOrder`, the sequences of bucket uses the last step's
    forward and backward agreed on (the next step gathers along them); None before the first."""
    param_steps: tuple[int, ...] | None = None
    """Optimizer steps each trainable entry received (in layout order), when some parameter
    went unused by every rank in some step and so was not updated (as torch.optim skips a
    parameter whose grad is None); None while every entry received `step` updates."""
    skipped: int = 0
    """Steps skipped in a row because the gradients were not finite (0 after a good step)."""
    uncast: tuple[tuple[int, int], ...] = ()
    """Stages 0-2: the trainable buckets whose parameters, in this rank's part, were not their
    master copy's cast when the state was built (`init`'s or `fzero.load`'s own casts: a
    float16 master under float32 parameters, a float64 module's values cast to a float32
    master and to bfloat16 parameters, a checkpoint loaded with a narrower master_dtype), each
    with the `fzero.flat.checksum` of that part then. Empty after the first update, which
    makes every parameter its master's cast (`lost_writes` relies on both)."""
    lineage: int = 0
    """Which state this is, the same on every rank: drawn by rank 0 at `init` and `fzero.load`
    (`shared_lineage`), kept by the steps, derived by `clone_state` (`clone_lineage`). Steps,
    saves and `full_params` compare it, so ranks that pass different states (two models of one
    architecture, stepped in another order on each rank) are told so, at stage 3 too, where no
    rank holds the others' parameters to compare."""
    lease: Lease = field(default_factory=Lease, compare=False, repr=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardState:
        """`clone_state`: a copy with tensors of its own, on the same comm (a deep copy walked
        into the comm: a lock or a process group that does not copy, or a second comm)."""
        return clone_state(self)

    @property
    def trainable(self) -> tuple[int, ...]:
        """Indices of the trainable buckets."""
        return tuple(i for i, b in enumerate(self.layout.buckets) if b.trainable)

    @property
    def rank(self) -> int:
        """This rank."""
        return self.config.comm.rank


def _own_part(state: ShardState, index: int) -> Tensor:
    """This rank's part of bucket `index`'s parameters (stage 3 holds only that part)."""
    params = state.params[index]
    return params if state.stage == 3 else shard_view(params, state.layout.buckets[index],
                                                      state.rank)


def _apart_from_master(state: ShardState, skip: Collection[int] = ()) -> list[int]:
    """The trainable buckets (but `skip`) whose parameters differ, in this rank's part, from
    their master copy cast to the parameters' dtype (those with a separate master copy only).
    A read of the rank's part of each such bucket, one device-to-host copy for all of them.
    (Stage 3 too: an EMA's lerp_ over its bfloat16 shards left them apart from the master's
    EMA, and eval steps and saves used them silently where stages 0-2 refuse.)"""
    differs: list[tuple[int, Tensor]] = []
    for index, bucket in enumerate(state.layout.buckets):
        master, params = state.master[index], state.params[index]
        if index in skip or master is None or (master.untyped_storage().data_ptr()
                                               == params.untyped_storage().data_ptr()):
            continue  # skipped, no master, or the parameters are the master copy
        mine = _own_part(state, index)
        kept = shard_view(master, bucket, state.rank) if state.stage == 0 else master
        differs.append((index, torch.ne(bits(mine), bits(kept.to(mine.dtype))).any()))
    if not differs:
        return []
    flags = torch.stack([flag for _, flag in differs]).tolist()
    return [index for (index, _), flag in zip(differs, flags, strict=True) if flag]


def _own_checksums(state: ShardState, indices: Sequence[int]) -> list[int]:
    """`fzero.flat.checksum` of this rank's part of the parameters of buckets `indices`."""
    if not indices:
        return []
    sums = [checksum(_own_part(state, i)) for i in indices]
    return torch.stack(sums).tolist()


def with_uncast(state: ShardState) -> ShardState:
    """`state` with `ShardState.uncast` taken from its tensors now: for a state just built
    (`init`, `fzero.load`), before any step or write."""
    apart = _apart_from_master(state)
    return dataclasses.replace(
        state, uncast=tuple(zip(apart, _own_checksums(state, apart), strict=True)))


def lost_writes(state: ShardState) -> list[int]:
    """The trainable buckets whose parameters were written, in this rank's part,
    where the next update would drop the write: those with a separate master copy, which the
    update casts the parameters from. A write through ``.data`` shows in no version counter,
    so the parameters are compared with their master's cast (which they are after every
    update), and those of `ShardState.uncast` buckets with their checksum instead. One
    device-to-host copy, two where the state has `uncast` buckets (before its first update)."""
    known = dict(state.uncast)
    written = _apart_from_master(state, skip=known)
    sums = _own_checksums(state, list(known))
    written += [index for (index, was), now in zip(known.items(), sums, strict=True)
                if now != was]
    return sorted(written)


def params_fingerprint(state: ShardState) -> Tensor | None:
    """Stages 0-2 over several ranks: a 0-d int64 fingerprint of this rank's full parameters
    (the `fzero.flat.fingerprint` of every bucket, added), on their device; None at stage 3 or
    one rank. Every rank holds the same full parameters from `init` and after every update,
    so fingerprints that differ show a write that bypassed autograd (through ``.data``)
    reaching some ranks' copies only. One read of the parameters (Ψ elements)."""
    if state.stage == 3 or state.config.comm.world_size == 1:
        return None
    total = torch.zeros((), dtype=torch.int64, device=state.params[0].device)
    for params in state.params:
        total += fingerprint(params)
    return total


def check_reduce_dtype(reduce_dtype: torch.dtype | None, layout: ShardLayout) -> None:
    """Raise if `reduce_dtype` is float16 while no trainable parameter is: only float16
    parameters get a loss scale, and without one gradients below float16's range would reduce
    to zero, silently."""
    if reduce_dtype == torch.float16 and not any(
            b.trainable and b.torch_dtype == torch.float16 for b in layout.buckets):
        raise ValueError(
            "reduce_dtype=torch.float16 needs float16 parameters (param_dtype=torch.float16): "
            "only they get a loss scale, and without one gradients below float16's range "
            "(6e-8) would reduce to zero silently; use torch.bfloat16 to halve the reduction's "
            "bytes"
        )


def check_optimizer_dtype(optimizer: Optimizer, master_dtype: torch.dtype) -> None:
    """Raise if the optimizer's ``eps`` is zero in `master_dtype`, where its update runs (Adam's
    default 1e-8 in float16): Adam divides by ``sqrt(v) + eps``, so an element whose gradient is
    exactly zero would update to 0/0 = NaN while the step reports success. ``eps=0`` too: the
    padding of every bucket the world size does not divide has a zero gradient at every step
    (torch, without padding, gives NaN only on elements whose gradient is zero)."""
    eps = dict(optimizer.spec.hyperparameters).get("eps") if optimizer.spec else None
    if eps is None or torch.tensor(eps, dtype=master_dtype):
        return
    tiny = torch.finfo(master_dtype).smallest_normal
    name = optimizer.spec.name
    if not eps:
        raise ValueError(
            f"{name}'s eps=0: bucket padding, whose gradient is always zero, would update to "
            f"0/0 = NaN (as, in torch too, would any element whose gradient is exactly zero). "
            f"Pass eps >= {tiny:g}"
        )
    raise ValueError(
        f"{name}'s eps={eps:g} is 0 in master_dtype={master_dtype} (its smallest normal "
        f"number is {tiny:g}): an element whose gradient is exactly zero would update to "
        f"0/0 = NaN. Keep a float32 master (the default), or pass eps >= {tiny:g}"
    )


def state_device(device: torch.device | str | None, comm: Comm) -> torch.device:
    """Where a state lives: `device`, else the comm's device (CPU for gloo); never ``meta``."""
    resolved = torch.device(device if device is not None else getattr(comm, "device", "cpu"))
    if resolved.type == "meta":
        raise ValueError(
            "device='meta' cannot hold a training state (it has no values); the model may live "
            "on meta, the state needs a real device (default: the comm's)"
        )
    return resolved


def default_buckets(
    stage: int, device: torch.device, planned: ShardLayout
) -> list[list[str]] | None:
    """The bucket policy `init` uses when given ``buckets=None``, from `planned`, the layout of
    `fzero.plan`'s own default (one bucket per block, small blocks merged).

    On CUDA at stages 0-2: the parameters in `planned`'s order, grouped into buckets of at most
    `DEFAULT_BUCKET_CAP_CUDA` elements (a GPU's fixed host cost per collective and bucket
    outweighs finer overlap, and these stages gather nothing in forward, so blocks mean nothing
    to them). At stage 2 a trainable bucket is also at most a `STAGE2_MIN_BUCKETS`-th of the
    trainable elements (at least `STAGE2_MIN_CAP_CUDA`), so that its gradient shards and the
    buckets it reduces at once (two or three) stay below stage 1's full gradient from two ranks
    on; frozen buckets keep the larger cap (a model mostly frozen would otherwise be cut into
    many small buckets, each a fixed cost per step). Otherwise None: `planned` as it is, which
    stage 3 needs (a bucket is gathered whole) and the CPU keeps (a collective's fixed cost is
    small next to its compute).
    """
    if device.type != "cuda" or stage == 3:
        return None
    trainable_cap = DEFAULT_BUCKET_CAP_CUDA
    if stage == 2:
        trainable = sum(bucket.numel for bucket in planned.buckets if bucket.trainable)
        share = -(-trainable // STAGE2_MIN_BUCKETS)
        trainable_cap = min(DEFAULT_BUCKET_CAP_CUDA, max(STAGE2_MIN_CAP_CUDA, share))
    groups: list[list[str]] = []
    filled = {True: 0, False: 0}  # elements in the open group, by trainability
    for bucket in planned.buckets:
        cap = trainable_cap if bucket.trainable else DEFAULT_BUCKET_CAP_CUDA
        for entry in bucket.entries:
            if not groups or (filled[bucket.trainable] + entry.numel > cap
                              and filled[bucket.trainable] > 0):
                groups.append([])
                filled = {True: 0, False: 0}
            groups[-1].extend(entry.names)
            filled[bucket.trainable] += entry.numel
    return groups


def _on_rank0(comm: Comm, make: Callable[[], Any], what: str) -> Any:
    """`make()` on rank 0 (which alone runs `init_fn` / `load`), its success shared with every
    rank first: if it raised, rank 0 re-raises it and every other rank raises too, instead of
    waiting in the broadcast that would have followed."""
    value, error = None, None
    if comm.rank == 0:
        try:
            value = make()
        except Exception as caught:  # shared below, then re-raised
            error = caught
    else:
        value = make()  # other ranks only allocate (see _bucket_source)
    device = getattr(comm, "device", "cpu")
    status = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    comm.broadcast(status, src=0, label=f"of whether rank 0 could initialize {what}")
    if not status.item():
        return value
    text = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:400] if error else b""
    message = torch.zeros(400, dtype=torch.uint8, device=device)
    if text:
        message[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    comm.broadcast(message, src=0, label="of rank 0's initialization error")
    if error is not None:
        raise error
    said = bytes(message.tolist()).rstrip(b"\0").decode("utf-8", "replace")
    raise ValueError(f"init: rank 0's init_fn / load= raised while initializing {what}: {said}; "
                     f"nothing was built")


def check_finite(flat: Tensor, bucket: Bucket) -> None:
    """Raise if a bucket's flat values hold NaN or infinity, naming the parameters.

    Raises:
        ValueError: naming every parameter with a non-finite value (a bad checkpoint or
            initializer): a NaN parameter would make every later step skip or spread.
    """
    if all_finite(flat):
        return
    bad = [entry.name for entry in bucket.entries
           if not all_finite(flat[entry.offset : entry.end])]
    raise ValueError(
        f"parameters {bad} (bucket {bucket.label!r}) hold NaN or infinite values; fix the "
        f"initializer or the checkpoint they come from before training"
    )


def _raise_overflow(values: Tensor, bucket: Bucket, dtype: torch.dtype) -> None:
    """Raise naming the parameters of a bucket whose finite `values` overflow `dtype` (a
    float32 value of 1e5 is infinite in float16: the first step then blamed the parameters)."""
    bad = [entry.name for entry in bucket.entries
           if not all_finite(values[entry.offset : entry.end].to(dtype))]
    raise ValueError(
        f"parameters {bad} (bucket {bucket.label!r}) hold values beyond "
        f"{str(dtype).removeprefix('torch.')}'s range (largest {torch.finfo(dtype).max:g}), "
        f"which param_dtype= would make infinite; train in a wider dtype (bfloat16 has "
        f"float32's range) or rescale them")


def check_live(state: Any, what: str) -> None:
    """Raise unless `state` is a `ShardState` that no train step has consumed.

    Raises:
        TypeError: not a ShardState.
        ValueError: consumed (see `Lease`), naming the step that consumed it.
    """
    if not isinstance(state, ShardState):
        raise TypeError(f"{what} needs a ShardState (from fzero.init), got {type(state).__name__}")
    consumed = state.lease.consumed_by
    if consumed is not None and state.lease.updating:
        raise ValueError(
            f"{what}: train step {consumed} stopped while it updated this state's tensors in "
            f"place (interrupted, e.g. by Ctrl-C, or a collective of the update failed), "
            f"before it returned the new state: they hold part "
            f"of that update, so neither the state before the step nor the one after. Go on "
            f"from a checkpoint, or from a copy kept before the step with "
            f"fzero.clone_state(state)"
        )
    if consumed is not None:
        raise ValueError(
            f"{what}: this state was consumed by train step {consumed}, which updated its "
            f"tensors in place and returned the new state (like a donated argument in JAX). "
            f"Use the state that step returned, or keep a copy before the step with "
            f"fzero.clone_state(state)"
        )


def check_tensors(state: ShardState, what: str) -> None:
    """Raise unless the state's parameters and master copies are the tensors its layout and
    config describe (dtype, size): a ``tree_map`` that converted them (``t.float()`` on a
    float64 state) ran forward and backward and failed in the update, naming internal
    buffers."""
    for index, bucket in enumerate(state.layout.buckets):
        numel = bucket.shard_numel if state.stage == 3 else bucket.padded_numel
        for kind, tensor, dtype, size in (
                ("parameter buffer", state.params[index], bucket.torch_dtype, numel),
                ("master copy", state.master[index], state.config.master_dtype, None)):
            if tensor is None:
                continue
            if not isinstance(tensor, Tensor) or tensor.dtype != dtype or (
                    size is not None and tensor.numel() != size):
                got = (f"{tensor.dtype} of {tensor.numel()} elements"
                       if isinstance(tensor, Tensor) else type(tensor).__name__)
                want = f"{dtype}{'' if size is None else f' of {size} elements'}"
                raise ValueError(
                    f"{what}: bucket {bucket.label!r} holds a {kind} of {got}, but the state "
                    f"was built with {want}: its tensors were replaced (a tree_map that "
                    f"converted them?). Convert a model with fzero.init's param_dtype= / "
                    f"master_dtype=, or fzero.load a checkpoint with them")


def clone_state(state: ShardState) -> ShardState:
    """A copy of `state` with its own tensors (views of one storage stay views of one copy).

    Keep one before a train step when you need the old values afterwards (a rollback, an EMA, a
    comparison): the step consumes its input state.

    Raises:
        TypeError, ValueError: `state` is not a live ShardState.
    """
    check_live(state, "clone_state")
    tensors = (state.params, state.grads, state.master, state.moments, state.buffers)
    params, grads, master, moments, buffers = copy.deepcopy(tensors)  # one memo: views kept
    versions = state.config.module_versions
    if versions is not None:  # the copies hold the module's values as much as the originals
        versions.cloned([*zip(state.params, params, strict=True),
                         *zip(state.buffers.values(), buffers.values(), strict=True)])
    return dataclasses.replace(
        state, params=params, grads=grads, master=master, moments=moments, buffers=buffers,
        lineage=clone_lineage(state), lease=Lease(),
    )


def shared_lineage(comm: Comm) -> int:
    """A new state's `ShardState.lineage`: 62 random bits drawn on rank 0 and broadcast (a
    collective). Drawn from the OS, not torch's generator, which building a state must not
    advance."""
    value = torch.tensor([secrets.randbits(62) if comm.rank == 0 else 0], dtype=torch.int64,
                         device=getattr(comm, "device", "cpu"))
    comm.broadcast(value, src=0, label="of the new state's lineage")
    return int(value.item())


def clone_lineage(state: ShardState) -> int:
    """The lineage of `state`'s clone: derived from its lineage and step, so every rank's clone
    of one state gets the same one, which is not the original's (a rank that steps the clone
    while another steps the original is told so)."""
    digest = hashlib.blake2b(f"{state.lineage}:{state.step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _flatten_state(state: ShardState) -> tuple[list[Any], Any]:
    """The state's tensors as pytree children, each memory once: a master copy that is the
    parameters themselves (stages 0 and 3) or their shard's view (stages 1-2) is left out and
    rebuilt from them (a ``tree_map`` of an in-place update, an EMA's ``lerp_``, applied it
    twice to such a bucket, silently: a probe). The step count, loss scale and other scalars
    are the context's values, not its structure, so states at different steps map together."""
    # torch's pytree treats None as a leaf: frozen buckets' absent tensors go in the context.
    present = tuple(g is not None for g in state.grads)
    aliased = tuple(_master_alias(state, index) for index in range(len(state.params)))
    children = [
        state.params,
        _present(state.grads),
        _present(tuple(None if how else m for m, how in zip(state.master, aliased,
                                                             strict=True))),
        {name: _present(values) for name, values in state.moments.items()},
        state.buffers,
    ]
    scalars = _Scalars(state.step, state.loss_scale, state.bucket_order, state.param_steps,
                       state.skipped, state.uncast, state.lineage)
    context = (state.layout, state.stage, state.config, present, aliased, scalars,
               _Origin(state.lease, _updated(state.params, state.master, state.moments)))
    return children, context


def _unflatten_state(children: Any, context: Any) -> ShardState:
    params, grads, master, moments, buffers = children
    layout, stage, config, present, aliased, scalars, origin = context
    own = iter(master)
    master = tuple(
        None if not is_present
        else params[index] if how == _SAME
        else _shard_of(params[index], layout.buckets[index], config.comm.rank) if how
        else next(own)
        for index, (is_present, how) in enumerate(zip(present, aliased, strict=True)))
    moments = {name: _absent(values, present) for name, values in moments.items()}
    return ShardState(
        layout, stage, scalars.step, tuple(params), _absent(grads, present), master, moments,
        dict(buffers), config, scalars.loss_scale, scalars.bucket_order, scalars.param_steps,
        scalars.skipped, scalars.uncast, scalars.lineage,
        lease=origin.lease_for(_updated(params, master, moments)),
    )


_SAME, _SHARD = "params", "shard of params"


def _shard_of(params: Any, bucket: Bucket, rank: int) -> Any:
    """The rank's shard view of a bucket's parameters (a `_SHARD` master); a leaf that a
    ``tree_map`` made something else (a shape, for a look at the state) stands for itself."""
    return shard_view(params, bucket, rank) if isinstance(params, Tensor) else params


def _master_alias(state: ShardState, index: int) -> str | None:
    """How bucket `index`'s master copy aliases its parameters: `_SAME` (it is them),
    `_SHARD` (this rank's shard view of them), or None (a tensor of its own, or none)."""
    master, params = state.master[index], state.params[index]
    if master is None:
        return None
    if master is params:
        return _SAME
    lo, hi = state.layout.buckets[index].shard_range(state.rank)
    if (master.dtype == params.dtype and master.device == params.device
            and master.is_contiguous() and master.numel() == hi - lo and params.dim() == 1
            and master.numel() and master.data_ptr() == params.data_ptr()
            + lo * params.element_size()):
        return _SHARD
    return None


@dataclass(frozen=True)
class _Scalars:
    """A state's values that are not tensors nor structure (in its pytree context): equal to
    any other, so that ``tree_map(f, ema, state)`` maps states at different steps, taking the
    first's."""

    step: int
    loss_scale: Any
    bucket_order: Any
    param_steps: tuple[int, ...] | None
    skipped: int
    uncast: tuple[tuple[int, int], ...]
    lineage: int

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Scalars)

    def __hash__(self) -> int:
        return 0


def _updated(params: Sequence[Tensor], master: Sequence[Tensor | None],
             moments: Mapping[str, Sequence[Tensor | None]]) -> list[Tensor]:
    """The tensors of a state that a train step writes in place (see `Lease`)."""
    return [t for t in itertools.chain(params, master, *moments.values()) if t is not None]


class _Origin:
    """In a state's pytree context: its lease and the tensors a step would update in place, so
    that a state rebuilt over any of the same tensors shares the lease (`Lease`). Compares
    equal to any other, so that states' tree specs still match (``tree_map(f, a, b)``)."""

    __slots__ = ("lease", "tensors")

    def __init__(self, lease: Lease, tensors: Sequence[Tensor]) -> None:
        self.lease = lease
        self.tensors = [weakref.ref(t) for t in tensors]

    def lease_for(self, tensors: Sequence[Tensor]) -> Lease:
        """The origin's lease if `tensors` share one with it, else a new one."""
        held = {id(t) for t in (ref() for ref in self.tensors) if t is not None}
        return self.lease if any(id(t) in held for t in tensors) else Lease()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Origin)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"_Origin({self.lease})"


def _present(values: tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
    return tuple(v for v in values if v is not None)


def _absent(values: Sequence[Tensor], present: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    it = iter(values)
    return tuple(next(it) if p else None for p in present)


pytree.register_pytree_node(
    ShardState, _flatten_state, _unflatten_state, serialized_type_name="fzero.ShardState"
)


def init(
    model: nn.Module | Mapping[str, Tensor],
    *,
    stage: int,
    optimizer: Optimizer,
    comm: Comm,
    buckets: Any = None,
    param_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    trainable: Any = None,
    device: torch.device | str | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    load: Callable[[Sequence[str]], Mapping[str, Tensor]] | None = None,
) -> ShardState:
    """Build a rank's `ShardState` from a model or a state dict (a collective).

    Rank 0's values are the truth: every bucket is broadcast from rank 0, one bucket at a time,
    and each rank keeps what its stage stores (see the module table). All ranks must call it.

    A model on the ``meta`` device is materialized bucket by bucket (sharded init, like
    DeepSpeed's ``zero.Init`` or FSDP2's meta-device init): only one bucket's full values exist
    at a time, so peak memory is one bucket plus the shards. Its values come from `init_fn` or
    `load`.

    Args:
        model: the `nn.Module` (its parameters and buffers), or a mapping of parameter names to
            tensors (then the model has no buffers, and trainability comes from `trainable`
            or ``requires_grad``).
        stage: ZeRO stage: 0 (plain data parallelism, the reference), 1, 2 or 3.
        optimizer: an `fzero.optim` optimizer.
        comm: the communicator (`fzero.TorchComm`, or a `SimWorld` rank's comm).
        buckets: bucket policy, as for `fzero.plan` (whose `separate_tied` is ``stage == 3``:
            in stages 0-2 a small tied embedding shares its neighbor's bucket). ``None``:
            `default_buckets`, which on CUDA at stages 0-2 caps buckets at 2**26 elements (at
            stage 2 also at an eighth of the trainable ones) instead of one per block: each
            collective costs a GPU step host time.
        param_dtype: compute dtype of floating parameters and buffers (e.g.
            ``torch.bfloat16``, as ``model.to(param_dtype)`` would); default their own dtypes.
        master_dtype: dtype of the optimizer's copy of trainable parameters and its moments;
            default the wider of the parameters' own dtype and `param_dtype`, but at least
            float32 (float64 stays float64, as torch.optim keeps it, also for a float32 model
            given ``param_dtype=torch.float64``; bfloat16 and float16 get a float32 master
            copy). One dtype for the whole state: float32 parameters beside float64 ones are
            updated in float64 and rounded back.
        reduce_dtype: dtype gradients are reduced in (default: the compute dtype). Stages 2-3
            also keep the reduced shards in it, so micro-batches accumulate in it; stages 0-1
            accumulate them in the compute dtype, in ``.grad`` (autograd's own accumulation, as
            single-process torch and DDP do) and cast for the reduction. ``float16`` needs
            float16 parameters (their loss scale keeps small gradients above its range).
        trainable: which parameters train, as for `fzero.plan` (default ``requires_grad``).
        device: where the state lives; default the comm's device (CPU for gloo).
        init_fn: for a ``meta`` model: ``init_fn(module)`` initializes, in place and under
            ``torch.no_grad()``, the module's *own* parameters and buffers (materialized with
            uninitialized memory; its children stay on ``meta``, where operations are free
            no-ops). It is called once per module that owns parameters, in
            ``model.modules()`` order whatever the bucket order (a bucket that needs a module
            first initializes every module before it, each kept until its last bucket), then
            for modules owning buffers. With the same seed, the values equal those of
            materializing the whole model and calling `init_fn` on each of ``model.modules()``
            in order, except that a tied parameter is initialized once, by its first owner.
        load: for a ``meta`` model: ``load(names) -> {name: tensor}`` returns the values of the
            named parameters (one bucket at a time) and, last, of the buffers. Called on rank 0
            only (its values are broadcast), so a checkpoint is read once. Likewise `init_fn`
            runs on rank 0 only.

    Returns:
        The state at step 0, with zero gradients and fresh optimizer moments.

    Raises:
        ValueError: `stage` is not 0-3, or ranks planned different layouts (parameter names,
            shapes or dtypes differ across ranks): every rank raises, naming the ranks. Also
            when `init_fn` leaves a parameter or buffer of a meta model unwritten, or `load`
            returns no value for one: every rank raises, naming it.
        TypeError: `optimizer` is not an `fzero.optim.Optimizer`, or a trainable parameter is
            complex (the optimizers are real: store it as real, `torch.view_as_real`).
    """
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage=}")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be an fzero.optim.Optimizer (e.g. fzero.optim.adamw()), "
            f"got {type(optimizer).__name__}"
        )
    check_dtypes(param_dtype=param_dtype, reduce_dtype=reduce_dtype, master_dtype=master_dtype)
    check_comm(comm, "init")
    if isinstance(model, nn.Module):
        check_shared_memory(model)
    device = state_device(device, comm)
    source_layout = plan(model, comm.world_size, buckets=buckets, trainable=trainable,
                         separate_tied=stage == 3)
    if buckets is None:
        policy = default_buckets(stage, device, source_layout)
        if policy is not None:
            source_layout = plan(model, comm.world_size, buckets=policy, trainable=trainable,
                                 separate_tied=stage == 3)
    if not source_layout.buckets:
        raise ValueError("init: the model has no parameters: there is nothing to train")
    _check_real(source_layout)
    layout = source_layout.cast(param_dtype) if param_dtype is not None else source_layout
    if master_dtype is None:
        master_dtype = default_master_dtype(source_layout, layout)
    check_reduce_dtype(reduce_dtype, layout)
    check_optimizer_dtype(optimizer, master_dtype)
    # What the first step would compare, compared now: a save, `full_params` or an eval step
    # before it would otherwise run on states built differently.
    settings = {
        "stage": str(stage),
        "master_dtype": str(master_dtype),
        "reduce_dtype": str(reduce_dtype),
        "the optimizer and its hyperparameters": optimizer.describe(),
    }
    fingerprint_check(comm, "|".join([layout.fingerprint, *settings.values()]),
                      "layout fingerprint", parts={**layout.parts(), **settings})
    module_buffers = dict(model.named_buffers()) if isinstance(model, nn.Module) else {}
    fingerprint_check(comm, buffers_fingerprint(module_buffers), "buffers fingerprint (buffer "
                      "names, shapes and dtypes)")
    source = _bucket_source(model, comm.rank, device, init_fn, load, source_layout)
    params, grads, master = [], [], []
    for index, bucket in enumerate(source_layout.buckets):
        truth = _on_rank0(comm, lambda b=bucket: source(b), f"bucket {bucket.label!r}")
        comm.broadcast(truth, src=0, label=f"of bucket {bucket.label!r}'s initial values")
        check_finite(truth, bucket)  # every rank holds rank 0's values: all decide alike
        cast = layout.buckets[index].torch_dtype
        if cast != truth.dtype and not all_finite(truth.to(cast)):  # (whole: alike too)
            _raise_overflow(truth, bucket, cast)
        # Stage 3 keeps a copy of its shard, so the full buffer is freed after this bucket.
        kept = _keep(truth, bucket, comm.rank, full=stage < 3)
        compute = kept.to(layout.buckets[index].torch_dtype, copy=stage == 3)
        params.append(compute)
        if not bucket.trainable:
            grads.append(None)
            master.append(None)
            continue
        if compute.dtype == master_dtype:  # the parameters are the master copy
            master.append(_keep(compute, bucket, comm.rank, full=stage != 1 and stage != 2))
        else:
            master.append(_keep(truth, bucket, comm.rank, full=stage == 0).to(master_dtype,
                                                                               copy=True))
        # Stages 0-1 accumulate full gradients in place in the compute dtype (autograd's own
        # accumulation); stages 2-3 keep reduced shards, in `reduce_dtype` when given.
        grad_dtype = compute.dtype if stage < 2 else (reduce_dtype or compute.dtype)
        numel = bucket.padded_numel if stage < 2 else bucket.shard_numel
        grads.append(torch.zeros(numel, dtype=grad_dtype, device=device))
    trainable_master = [m for m in master if m is not None]
    moments = optimizer.init(trainable_master)
    moments = {name: _spread(values, master) for name, values in moments.items()}
    buffers = _on_rank0(comm, lambda: _buffers(model, comm.rank, device, init_fn, load),
                        "the buffers")
    if param_dtype is not None:  # as model.to(param_dtype) would
        buffers = {n: b.to(param_dtype) if b.is_floating_point() else b for n, b in buffers.items()}
    # Contiguous: broadcast and checkpoints move them as flat bytes (a transposed buffer, or
    # the base an orthogonal parametrization registers, has other strides).
    buffers = {name: value.contiguous() for name, value in buffers.items()}
    for value in buffers.values():
        if value.numel():
            comm.broadcast(value.view(-1), src=0)
    # Rank 0's module values are every rank's state (broadcast above): its first step compares.
    taken = ([*params, *buffers.values()] if comm.rank == 0 and init_fn is None and load is None
             else [])
    config = ShardConfig(comm, optimizer, param_dtype, master_dtype, reduce_dtype, device,
                         requires_grad_flags(model), module_versions(model, taken_into=taken),
                         buffer_aliases(model), non_persistent_buffers(model))
    float16 = any(b.trainable and b.torch_dtype == torch.float16 for b in layout.buckets)
    loss_scale = LossScale() if float16 else None  # however the model got to float16
    return with_uncast(ShardState(
        layout, stage, 0, tuple(params), tuple(grads), tuple(master), moments, buffers, config,
        loss_scale, lineage=shared_lineage(comm),
    ))


def state_bytes(state: ShardState) -> int:
    """Model-state bytes this rank owns: params, grads, master and moments, each storage once."""
    tensors = [*state.params, *state.grads, *state.master]
    tensors += [t for values in state.moments.values() for t in values]
    return memory.storage_bytes(tensors)


def state_bytes_theory(state: ShardState) -> float:
    """The bytes docs/design.md's stage table gives this state's model, N, stage and dtypes
    (`layout_bytes_theory` of its layout)."""
    return layout_bytes_theory(
        state.layout, state.stage, master_dtype=state.config.master_dtype,
        moments=len(state.moments), reduce_dtype=state.config.reduce_dtype)


def layout_bytes_theory(layout: ShardLayout, stage: int, *, master_dtype: torch.dtype,
                        moments: int, reduce_dtype: torch.dtype | None) -> float:
    """Per-rank model-state bytes the stage table gives `layout`'s parameters at `stage` over
    its world size: trainable buckets as the table, with ``K = master bytes (where the
    bucket's dtype is not the master's) + moments x master bytes`` and each bucket's own
    element size; frozen buckets hold only their values (sharded at stage 3). Padding is not
    included (`state_bytes` measures it). Pure: also for a checkpoint's layout at another N.
    """
    world = layout.world_size
    total = 0.0
    for bucket in layout.buckets:
        size = bucket.torch_dtype.itemsize
        if not bucket.trainable:
            total += bucket.numel * size / (world if stage == 3 else 1)
            continue
        # Stages 0-1 keep full gradients in the compute dtype (see init's reduce_dtype).
        grad_bytes = (reduce_dtype.itemsize if reduce_dtype is not None and stage >= 2
                      else size)
        k = master_dtype.itemsize * (moments + int(bucket.torch_dtype != master_dtype))
        total += memory.estimate(bucket.numel, world, stage, k=k, param_bytes=size,
                                 grad_bytes=grad_bytes)
    return total


# --- where initial values come from ------------------------------------------------------------


def _bucket_source(
    model: nn.Module | Mapping[str, Tensor],
    rank: int,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
    load: Callable[[Sequence[str]], Mapping[str, Tensor]] | None,
    layout: ShardLayout,
) -> Callable[[Bucket], Tensor]:
    """``source(bucket) -> (padded_numel,)`` flat values of the bucket on `device`, called for
    `layout`'s buckets in order.

    For a meta model, only rank 0 initializes or loads: the other ranks' values would be
    overwritten by its broadcast, so they get an uninitialized buffer of the right size (and
    an `init_fn` drawing from a seeded global RNG draws the same numbers whatever N is).
    Modules are initialized once each and in ``model.modules()`` order, whatever the bucket
    order (a frozen module's bucket after its trainable neighbours', an explicit list in
    another order, a size cap between a weight and its bias): a module a bucket needs first
    initializes every module before it, and each is kept until its last bucket has taken its
    values. Otherwise `init_fn`'s random draws would come in another order, or twice, and the
    values would differ from a materialized model's. (In module order, that keeps one module.)
    """
    tensors = (
        dict(model.named_parameters(remove_duplicate=False))
        if isinstance(model, nn.Module) else flatten_names(model)
    )
    meta = [name for name, t in tensors.items() if t.is_meta]
    if not meta:
        if init_fn is not None or load is not None:
            raise ValueError("init_fn= and load= are for a model on the meta device; this "
                             "model's parameters are materialized already")
        return lambda bucket: _flat_of(bucket, {e.name: tensors[e.name] for e in bucket.entries},
                                       device)
    if (init_fn is None) == (load is None):
        raise ValueError(
            f"parameters {meta[:5]} are on the meta device: pass exactly one of init_fn= "
            f"(initialize each module's own parameters) or load= (read them by name)"
        )
    if load is None and not isinstance(model, nn.Module):
        raise TypeError("init_fn= needs the nn.Module (on the meta device), not a state dict")

    owned = _owners([entry.name for bucket in layout.buckets for entry in bucket.entries])
    started: dict[str, tuple[nn.Module, set[str]]] = {}  # initialized, names still to take
    order = ([prefix for prefix, _ in model.named_modules() if prefix in owned]
             if isinstance(model, nn.Module) else [])
    order += [prefix for prefix in owned if prefix not in order]
    position = {prefix: k for k, prefix in enumerate(order)}
    done = 0  # how many of `order` are initialized

    def initialize_through(last: int) -> None:
        nonlocal done
        assert init_fn is not None and isinstance(model, nn.Module)
        for prefix in order[done : last + 1]:
            started[prefix] = (_materialized(model.get_submodule(prefix), device, init_fn),
                               set(owned[prefix]))
        done = max(done, last + 1)

    def materialized(bucket: Bucket) -> Tensor:
        if rank != 0:  # overwritten by rank 0's broadcast: no values needed
            return torch.empty(bucket.padded_numel, dtype=bucket.torch_dtype, device=device)
        if load is not None:
            values = load([entry.name for entry in bucket.entries])
            return _flat_of(bucket, _pick(values, bucket.entries, "load"), device)
        assert init_fn is not None and isinstance(model, nn.Module)
        names = [e.name for e in bucket.entries]
        initialize_through(max((position[prefix] for prefix in _owners(names)), default=-1))
        return _flat_of(bucket, _initialized(model, names, device, init_fn, started, owned),
                        device)

    return materialized


def _buffers(
    model: nn.Module | Mapping[str, Tensor],
    rank: int,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
    load: Callable[[Sequence[str]], Mapping[str, Tensor]] | None,
) -> dict[str, Tensor]:
    """The model's buffers on `device` (rank 0's values are broadcast afterwards)."""
    if not isinstance(model, nn.Module):
        return {}
    named = dict(model.named_buffers())
    if not any(b.is_meta for b in named.values()):
        return {name: b.detach().to(device).clone() for name, b in named.items()}
    if rank != 0:  # overwritten by rank 0's broadcast
        return {n: torch.empty(b.shape, dtype=b.dtype, device=device) for n, b in named.items()}
    if load is not None:
        values = load(list(named))
        missing = [name for name in named if name not in values]
        if missing:
            saved = set(model.state_dict())
            transient = [name for name in missing if name not in saved]
            raise ValueError(
                f"load() returned no value for buffers {missing[:5]}"
                + (f"; {transient[:5]} are non-persistent (registered with persistent=False: "
                   f"Hugging Face's rotary inv_freq, position_ids, ...), so no checkpoint file "
                   f"holds them: have load() return them too, e.g. from the same module built "
                   f"on the CPU" if transient else ""))
        return {n: values[n].detach().to(device, b.dtype).clone() for n, b in named.items()}
    assert init_fn is not None
    return _initialized(model, list(named), device, init_fn, {}, _owners(list(named)))


def _initialized(
    model: nn.Module, names: Sequence[str], device: torch.device,
    init_fn: Callable[[nn.Module], None],
    started: dict[str, tuple[nn.Module, set[str]]],
    owned: Mapping[str, Sequence[str]],
) -> dict[str, Tensor]:
    """The values of parameters and buffers `names` of a meta `model` on `device`: each owning
    module materialized alone and initialized by `init_fn` (`_materialized`), once across
    calls: `owned` lists every name each module owns over all of them, and `started` keeps a
    module until the calls have taken all its names.

    Raises:
        ValueError: `init_fn` left some of them unwritten (a module type it does not handle):
            their fresh memory would silently become the state's values. A floating tensor is
            filled with NaN before `init_fn` runs and must hold none after (so a write through
            ``.data`` counts); an integer one is filled with `_unwritten_fill` and must not hold
            only that; a bool one is not checked.
    """
    values: dict[str, Tensor] = {}
    for prefix, these in _owners(names).items():
        module, remaining = started.pop(prefix, None) or (
            _materialized(model.get_submodule(prefix), device, init_fn), set(owned[prefix]))
        for name in these:
            values[name] = getattr(module, name.rsplit(".", 1)[-1]).detach()
        remaining -= set(these)
        if remaining:  # its other names come in a later bucket
            started[prefix] = (module, remaining)
    left = [name for name, value in values.items() if _unwritten(value)]
    if left:
        owners = sorted({type(model.get_submodule(n.rsplit(".", 1)[0]) if "." in n else model)
                         .__name__ for n in left})
        raise ValueError(
            f"init_fn left {len(left)} tensor(s) uninitialized, {left[:5]} (of modules "
            f"{owners[:5]}): they still hold the fill fzero puts in fresh memory (NaN). init_fn "
            f"is called once per module with that module's own parameters and buffers "
            f"materialized; it must set every one of them, whatever the module's type"
        )
    return values


def _owners(names: Sequence[str]) -> dict[str, list[str]]:
    """Group dotted names by the module that owns them, in first-seen order."""
    owners: dict[str, list[str]] = {}
    for name in names:
        owners.setdefault(name.rsplit(".", 1)[0] if "." in name else "", []).append(name)
    return owners


def _materialized(
    module: nn.Module, device: torch.device, init_fn: Callable[[nn.Module], None]
) -> nn.Module:
    """A copy of `module` with its own parameters and buffers on `device`, initialized by
    `init_fn` (over a fill that tells what it left unwritten: `_unwritten`)."""
    shadow = copy.deepcopy(module)  # meta: no memory
    shadow.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for tensor in itertools.chain(shadow.parameters(recurse=False),
                                      shadow.buffers(recurse=False)):
            if tensor.dtype != torch.bool:
                tensor.fill_(_unwritten_fill(tensor.dtype))
        init_fn(shadow)
    return shadow


def _unwritten_fill(dtype: torch.dtype) -> float | int:
    """What fresh memory of `dtype` is filled with before `init_fn` runs: NaN, or an integer
    no buffer holds throughout (the smallest signed value, the largest unsigned one)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


def _unwritten(tensor: Tensor) -> bool:
    """Whether `tensor`, filled by `_materialized` before `init_fn` ran, still holds the fill
    (floating: any NaN; integer: nothing but the fill; bool: never said)."""
    if tensor.numel() == 0 or tensor.dtype == torch.bool:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(tensor.isnan().any())
    return bool((tensor == _unwritten_fill(tensor.dtype)).all())


def _pick(
    values: Mapping[str, Tensor], entries: Sequence[Entry], what: str
) -> dict[str, Tensor]:
    picked = {}
    for entry in entries:
        given = [n for n in entry.names if n in values]
        if not given:
            raise ValueError(f"{what}() returned no value for parameter {entry.name!r}")
        first = values[given[0]]
        differ = [n for n in given[1:]
                  if values[n] is not first and not same_values(values[n].detach(),
                                                                first.detach())]
        if differ:
            raise ValueError(
                f"{what}() returned different values for {[given[0], *differ]}, which the "
                f"model ties (one tensor): one of them would be dropped. Return one value for "
                f"a tie, or untie the names in the model"
            )
        picked[entry.name] = first
    return picked


def _flat_of(bucket: Bucket, values: Mapping[str, Tensor], device: torch.device) -> Tensor:
    """The bucket's values flattened and padded, on `device`."""
    sub = ShardLayout((bucket,), bucket.world_size)
    cast = {}
    for entry in bucket.entries:
        value = values[entry.name].detach()
        if tuple(value.shape) != entry.shape:
            raise ValueError(
                f"parameter {entry.name!r} has shape {tuple(value.shape)}, expected {entry.shape}"
            )
        cast[entry.name] = value.to(device=device, dtype=bucket.torch_dtype)
    (flat,) = flatten(cast, sub)
    return flat


# --- helpers ---------------------------------------------------------------------------------


def _keep(flat: Tensor, bucket: Bucket, rank: int, *, full: bool) -> Tensor:
    """`flat` itself when the stage keeps it whole, else this rank's shard (a view)."""
    return flat if full else shard_view(flat, bucket, rank)


def _check_real(layout: ShardLayout) -> None:
    """Raise if a trainable parameter is complex: the master copy, the moments and the
    optimizers are real, and a complex parameter trained through them would silently lose its
    imaginary part (a frozen one is only stored and gathered, which is exact)."""
    complex_ = [e.name for b in layout.buckets if b.trainable and b.torch_dtype.is_complex
                for e in b.entries]
    if complex_:
        raise TypeError(
            f"init: trainable parameters {complex_[:5]} are complex: fzero's master copy, "
            f"moments and optimizers are real, so training them would drop their imaginary "
            f"part. Store such a parameter as a real one of shape (..., 2) "
            f"(torch.view_as_real) and view it as complex in forward (torch.view_as_complex), "
            f"or freeze it (trainable=)"
        )


def default_master_dtype(*layouts: ShardLayout) -> torch.dtype:
    """The trainable parameters' widest floating dtype in any of `layouts` (the model's own,
    and the one cast to ``param_dtype``), but at least float32."""
    widest = torch.float32
    for bucket in (b for layout in layouts for b in layout.buckets):
        dtype = bucket.torch_dtype
        if bucket.trainable and dtype.is_floating_point and dtype.itemsize > widest.itemsize:
            widest = dtype
    return widest


def _spread(values: tuple[Tensor, ...], master: list[Tensor | None]) -> tuple[Tensor | None, ...]:
    """Per-trainable-bucket values back to one slot per bucket (None for frozen buckets)."""
    it = iter(values)
    return tuple(None if m is None else next(it) for m in master)


def trainable_only(values: tuple[Tensor | None, ...]) -> list[Tensor]:
    """The non-None entries (one per trainable bucket), in bucket order."""
    return [v for v in values if v is not None]

