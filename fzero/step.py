"""The train step: `torch.func.functional_call` forward and backward for ZeRO stages 0-3.

    step = make_train_step(model, loss_fn, accum_steps=1, clip_norm=1.0)
    state, metrics = step(state, batch)     # batch: this rank's 1/N of the global batch

Per micro-batch, ``loss_fn(call, micro_batch)`` computes a scalar loss, where ``call(*a, **kw)``
runs the model's forward on the state's parameters; then backward. What happens to gradients
and parameters depends on the stage (DESIGN.md's table):

- 0: full parameters and gradients; gradients all-reduced (averaged) once per step; every rank
  updates everything (plain data parallelism, the reference).
- 1: full parameters and gradients; gradients reduce-scattered once per step; each rank updates
  its shard of the master copy; updated parameters all-gathered.
- 2: as 1, but each bucket's gradient is reduce-scattered as soon as backward completes it (per
  micro-batch, accumulating into the rank's gradient shard) and the full gradient freed.
- 3: parameters exist only as shards; each bucket is all-gathered just before its module's
  forward and released after it, re-gathered in backward when autograd needs it, its gradient
  reduce-scattered when complete (`fzero.buckets.Resident`).

Then, on every stage: one all-reduce of four scalars (squared gradient norm, loss, batch rows and
rows squared) gives the global gradient norm, the mean loss and a check that every rank had the
same batch size; non-finite gradients skip the update (and back off the fp16 loss scale);
gradients are clipped to `clip_norm`; the optimizer updates the master shards in place.

The module is never mutated: its parameters are substituted by `functional_call` for the call's
duration, and the stage-3 forward hooks are removed when the step ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.func import functional_call

from fzero.buckets import (
    BucketOrder,
    EagerReduce,
    GradBuckets,
    Resident,
    leaves_over,
    trigger_modules,
)
from fzero.collect import Streams, all_gather_bucket
from fzero.flat import unflatten
from fzero.layout import Bucket, Entry
from fzero.optim import Schedule, clip_coefficient
from fzero.state import ShardState, state_bytes, state_bytes_theory, trainable_only

__all__ = ["default_decay", "full_params", "make_eval_step", "make_train_step", "split_batch"]

LossFn = Callable[[Callable[..., Any], Any], Tensor]


def default_decay(name: str, shape: tuple[int, ...]) -> bool:
    """Weight decay for matrices and embeddings (2+ dims); none for biases and norm weights."""
    return len(shape) >= 2


def make_train_step(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    accum_steps: int = 1,
    clip_norm: float | None = None,
    lr: float | Schedule | None = None,
    prefetch: int = 1,
    decay: Callable[[str, tuple[int, ...]], bool] = default_decay,
) -> Callable[[ShardState, Any], tuple[ShardState, dict[str, Any]]]:
    """Build ``step(state, batch) -> (state, metrics)`` for `model` (see the module docstring).

    Args:
        model: the module whose forward `call` runs; never mutated. For stage 3 it may live on
            the ``meta`` device (it is only a function there).
        loss_fn: ``loss_fn(call, batch) -> scalar loss``, the mean over the batch's rows.
        accum_steps: micro-batches per step: the batch is split along dim 0 of every tensor
            in it, or is a list of exactly `accum_steps` micro-batches.
        clip_norm: clip the global gradient norm (over all trainable parameters, all ranks) to
            this value, as `torch.nn.utils.clip_grad_norm_`; None: no clipping.
        lr: learning rate or schedule of the 1-based step, overriding the optimizer's.
        prefetch: stage 3: buckets all-gathered ahead of use (0, 1 or 2); bounds memory.
        decay: ``decay(name, shape)``: whether a parameter gets weight decay.

    Returns:
        The step function. ``metrics`` holds ``loss`` (mean over ranks and micro-batches),
        ``grad_norm`` (before clipping), ``skipped`` (non-finite gradients: no update), ``lr``,
        ``step``, ``comm_bytes`` (this rank's bytes sent, ring accounting) and
        ``comm_bytes_by_kind``, ``state_bytes``, ``state_bytes_theory`` and
        ``gathered_bytes_peak`` (stage 3's full buckets at their largest; 0 otherwise) and
        ``grad_bytes_peak`` (stages 2-3: full bucket gradients being reduced, at their largest).

    Raises:
        ValueError: bad `accum_steps`, `clip_norm` or `prefetch`.
    """
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps=}")
    if clip_norm is not None and not (isinstance(clip_norm, int | float) and clip_norm > 0):
        raise ValueError(f"clip_norm must be a positive number or None, got {clip_norm=}")
    if prefetch not in (0, 1, 2):
        raise ValueError(f"prefetch must be 0, 1 or 2 buckets, got {prefetch=}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")

    def step(state: ShardState, batch: Any) -> tuple[ShardState, dict[str, Any]]:
        _check_state(state, model)
        comm = state.config.comm
        micro_batches = split_batch(batch, accum_steps)
        before = comm.counters.snapshot()["bytes"]
        streams = Streams.for_device(state.config.device)
        for grad in trainable_only(state.grads):
            grad.zero_()
        scale = state.loss_scale.scale if state.loss_scale is not None else 1.0

        losses = []
        with _session(state, model, streams, prefetch) as session:
            for index, micro in enumerate(micro_batches):
                loss = session.forward(loss_fn, micro)
                _check_loss(loss, state)
                session.backward(loss * (scale / accum_steps), index == len(micro_batches) - 1)
                losses.append(loss.detach().to(torch.float64))
            grads = session.info["reduced"]()

        master_dtype = state.config.master_dtype
        grads = [g if g.dtype == master_dtype else g.to(master_dtype) for g in grads]
        if scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)
        rows = _rows(micro_batches)
        stats = torch.stack([
            _squared_norm(grads, state),
            torch.stack(losses).mean(),
            torch.tensor(float(rows), dtype=torch.float64, device=state.config.device),
            torch.tensor(float(rows) ** 2, dtype=torch.float64, device=state.config.device),
        ])
        comm.all_reduce(stats, op="sum")
        squared_norm, loss_sum, rows_sum, rows_sq_sum = stats.tolist()
        world = comm.world_size
        if abs(rows_sq_sum * world - rows_sum**2) > 1e-6 * max(1.0, rows_sum**2):
            raise ValueError(
                f"ranks were given batches of different sizes (mean {rows_sum / world:g} rows, "
                f"sum of squares {rows_sq_sum:g}): give every rank the same number of rows, so "
                f"that averaging gradients over ranks equals the global batch's mean"
            )
        grad_norm = math.sqrt(squared_norm) if squared_norm >= 0 else float("nan")
        finite = math.isfinite(grad_norm)
        next_step = state.step + 1
        step_lr = _resolve_lr(lr, next_step)
        if finite:
            if clip_norm is not None:  # torch.nn.utils.clip_grad_norm_'s coefficient
                coef = float(clip_coefficient(torch.tensor(grad_norm), clip_norm))
                torch._foreach_mul_(grads, coef)
            masters = trainable_only(state.master)
            moments = {k: trainable_only(v) for k, v in state.moments.items()}
            state.config.optimizer.update(
                grads, moments, masters, step=next_step, lr=step_lr,
                decay=_decay_ranges(state, decay),
            )
            _publish(state, streams)
        session_info = session.info
        after = comm.counters.snapshot()["bytes"]
        by_kind = {kind: after[kind] - before[kind] for kind in after}
        new_state = dataclasses.replace(
            state,
            step=next_step if finite else state.step,
            loss_scale=state.loss_scale.after(finite) if state.loss_scale is not None else None,
            bucket_order=session_info.get("order", state.bucket_order),
        )
        metrics = {
            "loss": loss_sum / world,
            "grad_norm": grad_norm,
            "skipped": not finite,
            "lr": step_lr if step_lr is not None else _optimizer_lr(state, next_step),
            "step": new_state.step,
            "comm_bytes": sum(by_kind.values()),
            "comm_bytes_by_kind": by_kind,
            "state_bytes": state_bytes(new_state),
            "state_bytes_theory": state_bytes_theory(new_state),
            "gathered_bytes_peak": session_info.get("gathered_bytes_peak", 0),
            "grad_bytes_peak": session_info.get("grad_bytes_peak", 0),
        }
        if new_state.loss_scale is not None:
            metrics["loss_scale"] = new_state.loss_scale.scale
        return new_state, metrics

    return step


def make_eval_step(
    model: nn.Module, fn: Callable[[Callable[..., Any], Any], Any], *, prefetch: int = 1
) -> Callable[[ShardState, Any], Any]:
    """Build ``evaluate(state, batch) -> fn(call, batch)``: forward only, no gradients.

    For stage 3 the buckets are gathered just in time as in training (a collective: every rank
    must call it with a batch that runs the same modules).
    """

    def evaluate(state: ShardState, batch: Any) -> Any:
        _check_state(state, model)
        streams = Streams.for_device(state.config.device)
        with torch.no_grad(), _session(state, model, streams, prefetch, train=False) as session:
            return session.forward(fn, batch)

    return evaluate


def full_params(state: ShardState, *, master: bool = False) -> dict[str, Tensor]:
    """All parameters gathered to full tensors on every rank (a collective for stages 1-3).

    Args:
        state: the state.
        master: return the master copy (e.g. fp32) of trainable parameters instead of the
            compute-dtype parameters.

    Returns:
        Names (aliases included) to new tensors (not views of the state).
    """
    comm = state.config.comm
    flats = []
    pending = []
    for index, bucket in enumerate(state.layout.buckets):
        source = state.master[index] if master and state.master[index] is not None else None
        params = state.params[index]
        if source is None and state.stage < 3:
            flats.append(params.detach().clone())
        elif source is not None and state.stage == 0:
            flats.append(source.detach().clone())
        else:
            shard = source if source is not None else params
            pending.append((index, all_gather_bucket(comm, bucket, shard.detach().contiguous())))
            flats.append(None)
    for index, handle in pending:
        flats[index] = handle.wait()
    layout = state.layout
    if master:
        layout = dataclasses.replace(layout, buckets=tuple(
            bucket.cast(flat.dtype) for bucket, flat in zip(layout.buckets, flats, strict=True)))
    return unflatten(flats, layout)


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Split a batch into `parts` micro-batches.

    A list of exactly `parts` items is taken as the micro-batches. Otherwise every tensor in the
    batch (any pytree: tuple, dict, ...) is split along dim 0 into equal parts; other leaves are
    shared.

    Raises:
        ValueError: a tensor's dim 0 does not divide into `parts`, or the batch has no tensor.
    """
    if parts == 1:
        return [batch]
    if isinstance(batch, list) and len(batch) == parts:
        return batch
    leaves, spec = pytree.tree_flatten(batch)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    if not tensors:
        raise ValueError(
            f"accum_steps={parts} needs a batch with tensors to split along dim 0, or a list of "
            f"{parts} micro-batches; got {type(batch).__name__}"
        )
    for leaf in tensors:
        if leaf.dim() == 0 or leaf.shape[0] % parts:
            raise ValueError(
                f"a batch tensor of shape {tuple(leaf.shape)} does not split into "
                f"accum_steps={parts} equal micro-batches along dim 0"
            )
    split = [leaf.chunk(parts) if isinstance(leaf, Tensor) else None for leaf in leaves]
    return [
        pytree.tree_unflatten(
            [s[i] if s is not None else leaf for s, leaf in zip(split, leaves, strict=True)],
            spec,
        )
        for i in range(parts)
    ]


# --- sessions: forward and backward for one step ----------------------------------------------


class _Session(NamedTuple):
    forward: Callable[[Callable[..., Any], Any], Any]
    backward: Callable[[Tensor, bool], None]  # (loss, last micro-batch of the step)
    info: dict[str, Any]  # "reduced": () -> reduced gradients; peaks and learned order


@contextlib.contextmanager
def _session(
    state: ShardState,
    model: nn.Module,
    streams: Streams | None,
    prefetch: int,
    *,
    train: bool = True,
) -> Iterator[_Session]:
    if state.stage < 3:
        with _replicated(state, model, streams, train) as session:
            yield session
    else:
        with _sharded(state, model, streams, prefetch, train) as session:
            yield session


@contextlib.contextmanager
def _replicated(
    state: ShardState, model: nn.Module, streams: Streams | None, train: bool
) -> Iterator[_Session]:
    """Stages 0-2: full parameters. Gradients accumulate in place in full buffers, reduced
    bucket by bucket during the step's last backward (0: all-reduce, 1: reduce-scatter), or
    are reduce-scattered into shards bucket by bucket during every backward (2)."""
    layout = state.layout
    leaves = [
        leaves_over(flat, bucket) if train else _views(flat, bucket)
        for flat, bucket in zip(state.params, layout.buckets, strict=True)
    ]
    comm = state.config.comm
    grad_buckets = eager = None
    if train and state.stage < 2:
        for index, bucket in enumerate(layout.buckets):
            if bucket.trainable:
                for entry, leaf in zip(bucket.entries, leaves[index], strict=True):
                    leaf.grad = _entry_view(state.grads[index], entry)  # accumulates in place
        eager = EagerReduce(comm, layout, leaves, state.grads, scatter=state.stage == 1,
                            reduce_dtype=state.config.reduce_dtype, streams=streams)
    elif train:
        grad_buckets = GradBuckets(comm, layout, leaves, state.grads, streams)
    named = _named(layout.buckets, leaves)

    def call(*args: Any, **kwargs: Any) -> Any:
        return functional_call(model, (named, state.buffers), args, kwargs)

    def forward(fn: Callable[..., Any], batch: Any) -> Any:
        return fn(call, batch)

    def backward(loss: Tensor, last: bool) -> None:
        if eager is not None:
            eager.armed = last
        loss.backward()
        if grad_buckets is not None:
            grad_buckets.finish()

    def reduced() -> list[Tensor]:
        if eager is not None:
            return eager.results()
        return [state.grads[i] for i, b in enumerate(layout.buckets) if b.trainable]

    info: dict[str, Any] = {"reduced": reduced}
    try:
        yield _Session(forward, backward, info)
    finally:
        for helper in (grad_buckets, eager):
            if helper is not None:
                helper.close()
        if grad_buckets is not None:
            info["grad_bytes_peak"] = grad_buckets.peak_bytes


@contextlib.contextmanager
def _sharded(
    state: ShardState, model: nn.Module, streams: Streams | None, prefetch: int, train: bool
) -> Iterator[_Session]:
    """Stage 3: parameters gathered just in time (see `fzero.buckets.Resident`)."""
    layout = state.layout
    triggers = trigger_modules(model, layout)
    order = state.bucket_order or _registration_order(model, triggers)
    resident = Resident(state.config.comm, layout, state.params, streams, order, prefetch)
    if not train:
        for leaves in resident.leaves:
            for leaf in leaves:
                leaf.requires_grad_(False)
    grad_buckets = (
        GradBuckets(state.config.comm, layout, resident.leaves, state.grads, streams,
                    on_complete=resident.on_grads_complete)
        if train else None
    )
    named = _named(layout.buckets, resident.leaves)
    info: dict[str, Any] = {
        "reduced": lambda: [state.grads[i] for i, b in enumerate(layout.buckets) if b.trainable]
    }

    def call(*args: Any, **kwargs: Any) -> Any:
        with resident.forward_hooks(triggers):
            return functional_call(model, (named, state.buffers), args, kwargs)

    def forward(fn: Callable[..., Any], batch: Any) -> Any:
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(resident.pack, resident.unpack)
            if train else contextlib.nullcontext()
        )
        with hooks:
            out = fn(call, batch)
        if train:
            resident.after_forward()
        else:
            resident.release_all()
        return out

    def backward(loss: Tensor, last: bool) -> None:
        loss.backward()
        assert grad_buckets is not None
        grad_buckets.finish()
        resident.after_backward()

    try:
        yield _Session(forward, backward, info)
    finally:
        resident.release_all()
        if grad_buckets is not None:
            grad_buckets.close()
            info["grad_bytes_peak"] = grad_buckets.peak_bytes
        learned = resident.learned
        info["order"] = learned if learned.forward else state.bucket_order
        info["gathered_bytes_peak"] = resident.peak_bytes


# --- after backward ---------------------------------------------------------------------------


def _squared_norm(grads: Sequence[Tensor], state: ShardState) -> Tensor:
    """This rank's share of the global squared gradient norm (float64 scalar)."""
    device = state.config.device
    if not grads or (state.stage == 0 and state.rank != 0):  # stage 0: identical on all ranks
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(list(grads))
    return torch.stack(norms).to(torch.float64).pow(2).sum()


def _publish(state: ShardState, streams: Streams | None) -> None:
    """Make the compute-dtype parameters reflect the updated master copy."""
    comm = state.config.comm
    pending = []
    for index, bucket in enumerate(state.layout.buckets):
        master = state.master[index]
        if master is None:
            continue
        params = state.params[index]
        separate = master.untyped_storage().data_ptr() != params.untyped_storage().data_ptr()
        if state.stage in (0, 3):
            if separate:
                params.copy_(master)
            continue
        lo, hi = bucket.shard_range(state.rank)
        shard = master.to(params.dtype) if separate else params[lo:hi].clone()
        pending.append(all_gather_bucket(comm, bucket, shard, out=params, streams=streams))
    for handle in pending:
        handle.wait()


def _decay_ranges(
    state: ShardState, decay: Callable[[str, tuple[int, ...]], bool]
) -> list[list[tuple[int, int]]]:
    """Per trainable bucket, the element ranges of the optimizer's tensor that get decay."""
    ranges = []
    for bucket in state.layout.buckets:
        if not bucket.trainable:
            continue
        if state.stage == 0:
            ranges.append([(e.offset, e.end) for e in bucket.entries if decay(e.name, e.shape)])
        else:
            ranges.append([
                (seg.shard_start, seg.shard_end)
                for seg in bucket.segments(state.rank)
                if decay(seg.entry.name, seg.entry.shape)
            ])
    return ranges


# --- checks and small helpers -----------------------------------------------------------------


def _check_state(state: Any, model: nn.Module) -> None:
    if not isinstance(state, ShardState):
        raise TypeError(f"expected a ShardState (from fzero.init), got {type(state).__name__}")
    located = state.layout.locate()
    named = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(located) - set(named))
    extra = sorted(set(named) - set(located))
    wrong = sorted(
        f"{name}: state {located[name][1].shape} vs model {tuple(t.shape)}"
        for name, t in named.items()
        if name in located and tuple(t.shape) != located[name][1].shape
    )
    if missing or extra or wrong:
        raise ValueError(
            f"the state (layout fingerprint {state.layout.fingerprint}) was built for a "
            f"different model: parameters only in the state {missing[:5]}, only in the model "
            f"{extra[:5]}, shapes differing {wrong[:5]}"
        )


def _check_loss(loss: Any, state: ShardState) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = f"shape {tuple(loss.shape)} dtype {loss.dtype}" if isinstance(loss, Tensor) else (
            type(loss).__name__)
        raise ValueError(f"loss_fn must return a scalar floating-point tensor, got {got}")
    if not loss.requires_grad:
        names = [e.name for b in state.layout.buckets if b.trainable for e in b.entries]
        raise ValueError(
            f"the loss has no gradient path to any trainable parameter; these got no "
            f"gradient: {names[:10]}{' ...' if len(names) > 10 else ''} (does loss_fn use "
            f"`call`, and does it run under torch.no_grad?)"
        )


def _rows(micro_batches: Sequence[Any]) -> int:
    rows = 0
    for micro in micro_batches:
        leaves = [x for x in pytree.tree_leaves(micro) if isinstance(x, Tensor) and x.dim()]
        rows += leaves[0].shape[0] if leaves else 1
    return rows


def _resolve_lr(lr: float | Schedule | None, step: int) -> float | None:
    if lr is None:
        return None
    return float(lr(step)) if callable(lr) else float(lr)


def _optimizer_lr(state: ShardState, step: int) -> float | None:
    return _resolve_lr(state.config.optimizer.lr, step)


def _named(buckets: Sequence[Bucket], leaves: Sequence[Sequence[Tensor]]) -> dict[str, Tensor]:
    """Primary names to leaves (functional_call ties the aliases itself)."""
    return {
        entry.name: leaf
        for bucket, bucket_leaves in zip(buckets, leaves, strict=True)
        for entry, leaf in zip(bucket.entries, bucket_leaves, strict=True)
    }


def _views(flat: Tensor, bucket: Bucket) -> list[Tensor]:
    return [_entry_view(flat, entry) for entry in bucket.entries]


def _entry_view(flat: Tensor, entry: Entry) -> Tensor:
    return flat[entry.offset : entry.end].view(entry.shape)


def _registration_order(model: nn.Module, triggers: dict[nn.Module, list[int]]) -> BucketOrder:
    """First-step guess: forward in module registration order, backward in reverse."""
    rank = {id(m): i for i, (_, m) in enumerate(model.named_modules(remove_duplicate=False))}
    forward: list[int] = []
    for module in sorted(triggers, key=lambda m: rank[id(m)]):
        for index in triggers[module]:
            if not forward or forward[-1] != index:
                forward.append(index)
    return BucketOrder(tuple(forward), tuple(forward[::-1]))
