"""What a checkpoint keeps of a `ShardState`, and how a loaded state is put back together.

The only module of the package that knows `ShardState`'s fields: a new field is a change here
and nowhere else. `describe` gives the static part as JSON, `shard_tensors` the tensors one rank
writes, `build` the state a load returns.

[Note: what is stored]
A checkpoint is stage-independent. For every bucket b of the layout (N ranks), rank r's file
holds its shard ``[r * s_b, (r + 1) * s_b)`` of each kind of tensor, whatever its stage kept
whole:

    params.<b>        compute dtype, every bucket (frozen ones too)
    master.<b>        the master copy, trainable buckets whose master is separate from params
                      (mixed precision); otherwise the params are the master copy
    moments.<m>.<b>   optimizer moment m, trainable buckets

so every element is on disk once (the bytes are the state's, without the replicas stages 0-2
keep), and any stage reads it back: stage 3 its shard, stages 0-2 the whole buffer from all
files. Gradients are not stored: a step starts by zeroing them.

Every rank's file also holds that rank's buffers (``buffers.<name>``): under
``buffers="local"`` they differ, and a load at the same world size gives each rank its own;
at another world size every rank takes rank 0's. (Checkpoints written before this, marked by
the absence of ``"rank_buffers"`` in the manifest, hold rank 0's only.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fzero.bound import ModuleVersions
from fzero.checkpoint.files import TensorSpec
from fzero.comm import Comm
from fzero.layout import Entry, ShardLayout, _dtype_name, _parse_dtype
from fzero.optim import Optimizer
from fzero.schedule import BucketOrder
from fzero.state import LossScale, ShardConfig, ShardState, with_uncast

__all__ = ["BUFFERS", "MASTER", "MOMENTS", "PARAMS", "Fill", "buffer_tensors", "build",
           "describe", "describe_buffers", "file_specs", "key", "shard_tensors", "stored_dtype",
           "stored_kinds"]

PARAMS = "params"
MASTER = "master"
MOMENTS = "moments"
BUFFERS = "buffers"

Fill = Callable[[str, int, Tensor, int], None]
"""``fill(kind, bucket, out, lo)``: set ``out`` to elements ``[lo, lo + out.numel())`` of
the bucket's padded flat buffer of that kind (``"params"``, ``"master"``, ``"moments.<m>"``)."""


def key(kind: str, bucket: int) -> str:
    """The tensor's name in a shard file: ``key("moments.exp_avg", 3) == "moments.exp_avg.3"``."""
    return f"{kind}.{bucket}"


def describe(state: ShardState, *, optimizer_state: bool = True) -> dict[str, Any]:
    """The static part of a state, as JSON-able data (the same on every rank).

    Args:
        state: the state.
        optimizer_state: whether the master copy and moments are stored.
    """
    config = state.config
    spec = config.optimizer.spec
    separate = [
        index for index, (params, master) in enumerate(zip(state.params, state.master, strict=True))
        if master is not None and not _same_storage(params, master)
    ]
    order = state.bucket_order
    # The master dtype as stored (a config may leave it to be derived from the parameters).
    master_dtype = next((m.dtype for m in state.master if m is not None),
                        config.master_dtype or torch.float32)
    return {
        "stage": state.stage,
        "step": state.step,
        "param_dtype": None if config.param_dtype is None else _dtype_name(config.param_dtype),
        "master_dtype": _dtype_name(master_dtype),
        "reduce_dtype": None if config.reduce_dtype is None else _dtype_name(config.reduce_dtype),
        "optimizer": None if spec is None else spec.to_json(),
        "optimizer_state": optimizer_state,
        "moments": sorted(state.moments) if optimizer_state else [],
        "master": separate if optimizer_state else [],
        "loss_scale": None if state.loss_scale is None else dataclasses.asdict(state.loss_scale),
        "bucket_order": None if order is None else {"forward": list(order.forward),
                                                    "backward": list(order.backward)},
        "skipped": state.skipped,
        "rank_buffers": True,  # every rank's file holds its own buffers
        # ``[alias, name]`` of a buffer registered under several names (stored once, as name).
        "buffer_aliases": [list(pair) for pair in config.buffer_aliases],
        # Buffers registered with persistent=False (None: unknown, a state of a mapping).
        "non_persistent_buffers": (None if config.non_persistent is None
                                   else list(config.non_persistent)),
        # Steps each trainable parameter received, by name, when some differ (unused ones).
        "param_steps": None if state.param_steps is None else dict(zip(
            [e.name for b in state.layout.buckets if b.trainable for e in b.entries],
            state.param_steps, strict=True)),
    }


def stored_kinds(record: Mapping[str, Any], layout: ShardLayout) -> list[tuple[str, int]]:
    """``(kind, bucket)`` of every tensor a rank's file holds, in file order."""
    kinds = [(PARAMS, index) for index in range(len(layout.buckets))]
    kinds += [(MASTER, index) for index in record["master"]]
    if record["optimizer_state"]:
        trainable = [i for i, bucket in enumerate(layout.buckets) if bucket.trainable]
        kinds += [(f"{MOMENTS}.{m}", i) for m in record["moments"] for i in trainable]
    return kinds


def stored_dtype(record: Mapping[str, Any], layout: ShardLayout, kind: str, bucket: int
                 ) -> torch.dtype:
    """The dtype a stored tensor of `kind` has (params: the bucket's; else the master dtype)."""
    if kind == PARAMS:
        return layout.buckets[bucket].torch_dtype
    return _parse_dtype(record["master_dtype"])


def file_specs(
    layout: ShardLayout,
    record: Mapping[str, Any],
    buffers: Mapping[str, tuple[str, tuple[int, ...]]],
    rank: int,
) -> list[TensorSpec]:
    """Every tensor rank `rank`'s file holds, in order: its shards, then its buffers (rank 0
    only, in a checkpoint written before every rank stored its own)."""
    specs = [
        TensorSpec(key(kind, index), stored_dtype(record, layout, kind, index),
                   (layout.buckets[index].shard_numel,))
        for kind, index in stored_kinds(record, layout)
    ]
    if rank == 0 or record.get("rank_buffers", False):
        specs += [TensorSpec(key(BUFFERS, name), _parse_dtype(dtype), shape)
                  for name, (dtype, shape) in buffers.items()]
    return specs


def describe_buffers(state: ShardState) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The buffers' dtypes and shapes, for the manifest."""
    return {name: (_dtype_name(b.dtype), tuple(b.shape)) for name, b in state.buffers.items()}


def buffer_tensors(state: ShardState) -> list[tuple[str, Tensor]]:
    """This rank's buffers under their file keys."""
    return [(key(BUFFERS, name), b.detach()) for name, b in state.buffers.items()]


def shard_tensors(state: ShardState, *, optimizer_state: bool = True) -> list[tuple[str, Tensor]]:
    """This rank's shard of every stored tensor: ``(key, 1-D view into the state)``, no copies."""
    rank = state.rank
    record = describe(state, optimizer_state=optimizer_state)
    out = []
    for kind, index in stored_kinds(record, state.layout):
        if kind == PARAMS:
            tensor = state.params[index]
        elif kind == MASTER:
            tensor = state.master[index]
        else:
            tensor = state.moments[kind.removeprefix(MOMENTS + ".")][index]
        bucket = state.layout.buckets[index]
        if tensor.numel() != bucket.shard_numel:  # kept whole: store this rank's shard
            lo, hi = bucket.shard_range(rank)
            tensor = tensor[lo:hi]
        out.append((key(kind, index), tensor.detach()))
    return out


def build(
    layout: ShardLayout,
    stage: int,
    record: Mapping[str, Any],
    fill: Fill,
    *,
    comm: Comm,
    optimizer: Optimizer,
    param_dtype: torch.dtype | None,
    master_dtype: torch.dtype,
    reduce_dtype: torch.dtype | None,
    device: torch.device,
    buffers: Mapping[str, Callable[[str], Tensor]],
    same_buckets: bool,
    fresh_optimizer: bool,
    requires_grad: tuple[tuple[str, bool], ...] | None = None,
    module_versions: ModuleVersions | None = None,
    buffer_aliases: tuple[tuple[str, str], ...] = (),
    non_persistent: tuple[str, ...] | None = None,
) -> ShardState:
    """The state a load returns: tensors allocated as `fzero.init` lays them out for `stage`
    (see `fzero.state`'s table), values from `fill`, the rest from `record`.

    Args:
        layout: the new layout (its world size is the comm's).
        stage: the new stage.
        record: `describe`'s output, from the manifest.
        fill: reads stored values into a tensor.
        buffers: the model's buffer names, each with a function that reads its stored value.
        same_buckets: the buckets are the stored ones (the learned stage-3 order still applies).
        fresh_optimizer: start the optimizer afresh (zero moments, step 0) instead of reading it.
        requires_grad: the model's flags (`fzero.bound.requires_grad_flags`).
        module_versions: its tensors' version counters (`fzero.bound.module_versions`).
        Others: as for `fzero.init`.
    """
    rank = comm.rank
    params: list[Tensor] = []
    grads: list[Tensor | None] = []
    master: list[Tensor | None] = []
    for index, bucket in enumerate(layout.buckets):
        lo, hi = bucket.shard_range(rank)
        full = stage < 3
        compute = torch.empty(bucket.padded_numel if full else bucket.shard_numel,
                              dtype=bucket.torch_dtype, device=device)
        fill(PARAMS, index, compute, 0 if full else lo)
        params.append(compute)
        if not bucket.trainable:
            grads.append(None)
            master.append(None)
            continue
        if compute.dtype == master_dtype:  # the parameters are the master copy (a view)
            master.append(compute[lo:hi] if stage in (1, 2) else compute)
        else:
            copy = torch.empty(bucket.padded_numel if stage == 0 else bucket.shard_numel,
                               dtype=master_dtype, device=device)
            fill(MASTER, index, copy, 0 if stage == 0 else lo)
            master.append(copy)
        grad_dtype = compute.dtype if stage < 2 else (reduce_dtype or compute.dtype)
        grads.append(torch.zeros(bucket.padded_numel if stage < 2 else bucket.shard_numel,
                                 dtype=grad_dtype, device=device))
    trainable = [m for m in master if m is not None]
    if fresh_optimizer:
        moments = optimizer.init(trainable)
    else:  # shaped like the master copy (the `Moments` contract); every element is read below
        moments = {name: tuple(torch.empty_like(m) for m in trainable)
                   for name in optimizer.init([])}
    moments = {name: _spread(values, master) for name, values in moments.items()}
    if not fresh_optimizer:
        for name, values in moments.items():
            for index, value in enumerate(values):
                if value is not None:  # like the master copy: whole at stage 0, else a shard
                    lo = 0 if stage == 0 else layout.buckets[index].shard_range(rank)[0]
                    fill(f"{MOMENTS}.{name}", index, value, lo)
    loss_scale = None
    if any(b.trainable and b.torch_dtype == torch.float16 for b in layout.buckets):
        saved = record["loss_scale"]  # as fzero.init: whenever some compute is float16
        loss_scale = LossScale(**saved) if saved is not None and not fresh_optimizer else (
            LossScale())
    step = 0 if fresh_optimizer else record["step"]
    param_steps = None
    saved_steps = record.get("param_steps")
    if saved_steps is not None and not fresh_optimizer:
        steps = tuple(_saved_step(saved_steps, entry)
                      for b in layout.buckets if b.trainable for entry in b.entries)
        param_steps = None if all(s == step for s in steps) else steps
    order = record["bucket_order"]
    bucket_order = (
        BucketOrder(tuple(order["forward"]), tuple(order["backward"]))
        if order is not None and same_buckets and stage == 3 else None
    )
    values = {}
    for name, read in buffers.items():
        value = read(name).to(device)
        if param_dtype is not None and value.is_floating_point():
            value = value.to(param_dtype)  # as init casts them
        values[name] = value
    config = ShardConfig(comm, optimizer, param_dtype, master_dtype, reduce_dtype, device,
                         requires_grad, module_versions, buffer_aliases, non_persistent)
    return with_uncast(ShardState(
        layout=layout,
        stage=stage,
        step=step,
        params=tuple(params),
        grads=tuple(grads),
        master=tuple(master),
        moments=moments,
        buffers=values,
        config=config,
        loss_scale=loss_scale,
        bucket_order=bucket_order,
        param_steps=param_steps,
        skipped=0 if fresh_optimizer else record.get("skipped", 0),
    ))


def _saved_step(saved_steps: Mapping[str, int], entry: Entry) -> int:
    """The step count saved for `entry`'s tensor (`steps_by_every_name` keys each count by
    every name the saved tensor had, and a load checks that the model has the saved names, so
    a tie renamed or undone since finds its own). Every trainable entry has one: a parameter
    frozen when saved trains again only with a fresh optimizer, which reads none."""
    if entry.name not in saved_steps:
        raise ValueError(f"the checkpoint records no optimizer step count for parameter "
                         f"{entry.name!r}")
    return saved_steps[entry.name]


def steps_by_every_name(record: Mapping[str, Any], layout: ShardLayout) -> dict[str, Any]:
    """`record` (a manifest's, over the saved `layout`) with its per-parameter step counts
    keyed by every name of each saved tensor (its ties' too), as `build` looks them up: a
    checkpoint keys a tied tensor's count by its first name only."""
    saved_steps = record.get("param_steps")
    if saved_steps is None:
        return dict(record)
    steps = dict(saved_steps)
    for bucket in layout.buckets:
        for entry in bucket.entries:
            if entry.name in saved_steps:
                steps.update(dict.fromkeys(entry.names, saved_steps[entry.name]))
    return {**record, "param_steps": steps}


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _spread(values: Sequence[Tensor], master: Sequence[Tensor | None]) -> tuple[Tensor | None, ...]:
    it = iter(values)
    return tuple(None if m is None else next(it) for m in master)
