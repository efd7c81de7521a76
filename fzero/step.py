"""The train step: forward and backward of the user's module on a `ShardState`, ZeRO stages 0-3.

    step = make_train_step(model, loss_fn, accum_steps=1, clip_norm=1.0)
    state, metrics = step(state, batch)     # batch: this rank's 1/N of the global batch

Per micro-batch, ``loss_fn(call, micro_batch)`` computes a scalar loss, where ``call(*a, **kw)``
runs the model's forward on the state's parameters; then backward. The module is bound to the
state's tensors by `torch.func.functional_call` for the whole micro-batch, backward included
(`fzero.bound`), so activation checkpointing recomputes with the right weights. What happens
to gradients and parameters depends on the stage (docs/design.md's table):

- 0: full parameters and gradients; gradients all-reduced (averaged) once per step; every rank
  updates everything (plain data parallelism, the reference).
- 1: full parameters and gradients; gradients reduce-scattered once per step; each rank updates
  its shard of the master copy; updated parameters all-gathered.
- 2: as 1, but each bucket's gradient is reduce-scattered as soon as backward completes it (per
  micro-batch, accumulating into the rank's gradient shard) and the full gradient freed.
- 3: parameters exist only as shards; each bucket is all-gathered just before its module's
  forward and released after, gathered again in backward when autograd needs it (but the ones
  forward ended with, kept), its gradient reduce-scattered when complete (`fzero.residency`).

A step runs in named phases, each a small function below: check the state and the module,
split the batch, agree on the step (`fzero.consensus`), run the micro-batches, exchange the
statistics, then unscale, clip, update and publish. Every collective sequence is fixed or
agreed (`fzero.schedule`): ranks whose computation differs (a skipped layer) still train
exactly, and a rank whose computation raises makes every rank raise `StepError` with its state
unchanged, instead of hanging the others.

The step consumes its input state (`fzero.state.Lease`): use the returned one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import math
import numbers
import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from fzero.bound import (
    Binder,
    GradientWatch,
    buffers_fingerprint,
    carry_attributes,
    check_buffers,
    check_structure,
    claim,
    same_values,
)
from fzero.buckets import Completion, Reducer
from fzero.collect import Pending, SideStreams, Streams, all_gather_bucket
from fzero.comm import CollectiveTimeout, Comm, fingerprint_check
from fzero.consensus import (
    Header,
    HeaderRound,
    StepError,
    agree_header,
    exchange_statistics,
    float_bits,
)
from fzero.flat import alias_leaves, all_finite, bits, entry_views, shard_view, unflatten
from fzero.layout import ShardLayout
from fzero.optim import Schedule, clip_coefficient
from fzero.residency import (
    FullBuffers,
    PeerFailed,
    Residency,
    backward_under_guard,
    trigger_modules,
    unguarded,
)
from fzero.schedule import ABORTED, DONE, FAILED, BucketOrder, reduce_order
from fzero.state import (
    Lease,
    ShardState,
    check_live,
    check_tensors,
    lost_writes,
    params_fingerprint,
    state_bytes,
    state_bytes_theory,
    trainable_only,
)
from fzero.update import apply_update, decay_ranges, entry_spans

__all__ = [
    "MicroBatches",
    "decay_matrices",
    "full_params",
    "make_eval_step",
    "make_train_step",
    "micro_weights",
    "split_batch",
]

LossFn = Callable[[Callable[..., Any], Any], Tensor]
BUFFER_POLICIES = ("broadcast", "local")
REDUCE_PATIENCE = 2.0
"""Stage 3: the most seconds a bucket's reduction waits for the previous one inside backward
(see `fzero.buckets.Reducer`: four times the typical reduction time, at most this)."""
PUBLISH_IN_FLIGHT = 2
"""Stages 1-2 gather the updated parameters with at most this many buckets in flight: a
transport that stages a chunk until its peers have read it (shared memory) then holds two
buckets' chunks, not all Ψ/N; over TCP the window costs nothing measurable (see the README's
performance notes)."""
_CONTROL = "control"
_MOST_ROWS = 2**53  # declared rows travel in the int64 step header and float64 statistics
_GATHER = "stage3.gather"


def decay_matrices(name: str, shape: tuple[int, ...]) -> bool:
    """The GPT weight-decay rule: decay matrices and embeddings (2+ dims), not biases and norm
    weights. Pass ``decay=fzero.decay_matrices`` to `make_train_step` to use it; the default
    decays every parameter, as ``torch.optim.AdamW(model.parameters())`` and optax do."""
    return len(shape) >= 2


def _decay_every(name: str, shape: tuple[int, ...]) -> bool:
    """The default weight-decay rule (``decay=None``): every parameter."""
    return True


def _decayed(layout: ShardLayout, decay: Callable[[str, tuple[int, ...]], bool]
             ) -> tuple[str, ...]:
    """The trainable parameters `decay` selects, a tied tensor asked about all its names.

    Raises:
        ValueError: the names of one tied tensor get different answers: it is one tensor,
            decayed or not as a whole (a rule that spares ``lm_head.*`` on a GPT whose head is
            its embedding decays the head through the embedding's name).
    """
    chosen = []
    for bucket in layout.buckets:
        for entry in bucket.entries if bucket.trainable else ():
            given = {name: bool(decay(name, entry.shape)) for name in entry.names}
            if len(set(given.values())) > 1:
                raise ValueError(
                    f"decay= gives the names of one tied tensor different answers, {given}: "
                    f"they are one tensor, decayed or not as a whole; give all of them the "
                    f"same answer")
            if given[entry.name]:
                chosen.append(entry.name)
    return tuple(chosen)


class MicroBatches(list):
    """Explicit micro-batches for one step: ``step(state, fzero.MicroBatches([mb1, mb2]))``.

    The step's loss is the weighted mean of the micro-batches' losses (one backward each),
    ``sum(w_i * loss_i) / sum(w_i)``. Without `weights` they weigh the same, which equals the
    loss of the whole batch only for micro-batches of equal size, so the step raises when
    their sizes along dim 0 differ (the size of a micro-batch is the most common dim 0 among
    its tensors, a length, another tensor's later dim, losing a tie), or cannot be told (a tie
    nothing breaks, a most common size that is a length, or a nested list of entries with
    tensors, which may be one per row) and their tensors' sizes differ place by place (or by
    the step's declared ``rows=``, which also weighs unequal ones by their rows). Give
    `weights` for unequal ones: their rows when ``loss_fn`` means over rows, their target
    token counts when it means over tokens. Without
    this wrapper a batch is never taken apart by its container's length: it is split along
    dim 0 into `accum_steps`.

    Args:
        micro_batches: the micro-batches, each what ``loss_fn`` takes as its batch.
        weights: one positive finite number per micro-batch, or None (equal weights).
    """

    def __init__(self, micro_batches: Iterable[Any] = (), *,
                 weights: Iterable[float] | None = None) -> None:
        super().__init__(micro_batches)
        self.weights = None if weights is None else tuple(weights)


def make_train_step(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    accum_steps: int = 1,
    clip_norm: float | None = None,
    lr: float | Schedule | None = None,
    prefetch: int = 1,
    decay: Callable[[str, tuple[int, ...]], bool] | None = None,
    buffers: str = "broadcast",
    streams: SideStreams | None = None,
    max_skipped: int = 50,
    rows: Callable[[Any], int] | None = None,
) -> Callable[[ShardState, Any], tuple[ShardState, dict[str, Any]]]:
    """Build ``step(state, batch) -> (state, metrics)`` for `model` (see the module docstring).

    Args:
        model: the module whose forward `call` runs; never mutated. For stage 3 it may live on
            the ``meta`` device (it is only a function there), also after `fzero.init`. Which
            parameters train is fixed by the state: a step raises if a parameter's
            ``requires_grad`` changed since the state was built (it would be ignored).
        loss_fn: ``loss_fn(call, batch) -> scalar loss``, the mean over the batch's rows.
        accum_steps: micro-batches per step: every tensor of the batch is split along dim 0
            into this many equal parts (pass `MicroBatches` to give them explicitly).
        clip_norm: clip the global gradient norm (over all trainable parameters, all ranks) to
            this value, as `torch.nn.utils.clip_grad_norm_`; None: no clipping.
        lr: learning rate or schedule of the 1-based step, overriding the optimizer's.
        prefetch: stage 3: positions gathered ahead of use (0, 1 or 2); bounds memory.
        decay: ``decay(name, shape)``: whether a parameter gets weight decay; None (default):
            every parameter, as torch.optim and optax do; `decay_matrices` for the GPT rule.
            Asked about every name of a tied tensor, which must all get the same answer.
        buffers: ``"broadcast"`` (default, as DDP's ``broadcast_buffers=True``): rank 0's
            buffers (e.g. BatchNorm running statistics) are copied to every rank before each
            micro-batch's forward; ``"local"``: each rank keeps its own.
        streams: where collectives run; default CUDA side streams on a CUDA device, the comm's
            async handles elsewhere; `fzero.collect.EmulatedStreams` to test the ordering on CPU.
        max_skipped: the number of skipped steps in a row that raises: up to
            ``max_skipped - 1`` steps in a row may be skipped (e.g. fp16 loss-scale back-off),
            and the ``max_skipped``-th raises `StepError`, naming the ranks whose loss was not
            finite (1: none may be skipped). A step is skipped when the global gradient norm,
            computed in the master dtype, is not finite: a non-finite gradient, or finite
            ones whose squares overflow it (above ~1.8e19 in float32). A skipped step with
            non-finite *parameters* raises at once.
        rows: ``rows(micro_batch) -> int``, the rows ``loss_fn`` means over (its samples, or
            its target tokens for a mean over tokens), declared: each rank's and micro-batch's
            loss then weighs by its rows (unless `MicroBatches` gives `weights`), so that the
            step is the mean over the global batch's rows also where ranks and micro-batches
            hold different numbers of them (one small round before the first forward). None
            (default): every rank must hold as many rows, told from the tensors' sizes along
            dim 0 (see `MicroBatches`), which a batch that is not one row per sample along
            dim 0 can mislead or leave in doubt (per-image lists of boxes, rotary tables
            ``(T, D)`` with lengths that differ between ranks): declare rows for such batches.

    Returns:
        The step function. ``metrics`` holds ``loss`` (mean over ranks and micro-batches,
        weighted by `MicroBatches` weights or by declared `rows`), ``grad_norm`` (before clipping),
        ``skipped`` (a non-finite gradient norm: no update),
        ``nonfinite_ranks`` (ranks whose loss was not finite), ``lr``, ``step``, ``comm_bytes``
        (this rank's bytes sent for parameters and gradients, ring accounting, charged when a
        collective is issued) and ``comm_bytes_by_kind``, ``control_bytes`` (the step's small
        agreement messages), ``state_bytes``, ``state_bytes_theory``,
        ``gathered_bytes_peak`` (stage 3's full buckets at their largest; 0 otherwise),
        ``grad_bytes_peak`` (stages 2-3: full bucket gradients being reduced, at their
        largest) and ``unused`` (names of trainable parameters no rank used this step);
        with loss scaling (float16), ``loss_scale``: the scale after this step, the one the
        next step uses (halved by a skipped step, as ``GradScaler.get_scale()`` after
        ``update()``).

    Raises:
        ValueError: bad `accum_steps`, `clip_norm`, `prefetch` or `buffers`.
    """
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps=}")
    if clip_norm is not None and (isinstance(clip_norm, bool) or not (
            isinstance(clip_norm, int | float) and 0 < clip_norm < math.inf)):
        raise ValueError(f"clip_norm must be a positive finite number or None (no clipping), "
                         f"got {clip_norm=}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (call, batch) -> scalar loss, got "
                        f"{type(loss_fn).__name__}")
    if lr is not None and not callable(lr) and (
            isinstance(lr, bool) or not isinstance(lr, int | float)):
        raise TypeError(f"lr must be a number, a schedule step -> lr, or None, got {lr!r}")
    if streams is not None and not all(callable(getattr(streams, m, None))
                                       for m in ("launch", "before")):
        raise TypeError(f"streams must be side streams (fzero.Streams, fzero.EmulatedStreams) "
                        f"or None, got {type(streams).__name__}")
    if prefetch not in (0, 1, 2):
        raise ValueError(f"prefetch must be 0, 1 or 2 buckets, got {prefetch=}")
    if isinstance(max_skipped, bool) or not isinstance(max_skipped, int) or max_skipped < 1:
        raise ValueError(f"max_skipped must be an int >= 1, got {max_skipped=}")
    if buffers not in BUFFER_POLICIES:
        raise ValueError(f"buffers must be one of {BUFFER_POLICIES}, got {buffers=}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if decay is not None and not callable(decay):
        raise TypeError(f"decay must be None or a function (name, shape) -> bool, got {decay!r}")
    if rows is not None and not callable(rows):
        raise TypeError(f"rows must be None or a function micro_batch -> int, got {rows!r}")
    binder = Binder(model)
    own_streams: dict[torch.device, Streams | None] = {}  # see _streams_of
    plans: dict[tuple[str, int, int], Any] = {}  # decay ranges per (layout, stage, rank)
    leaves = _LeafCache()  # the leaves of the state's tensors (stage 3: buffers), across steps
    checked_writes = False  # stage 3: whether a step looked for writes bypassing autograd
    decayed: dict[str, tuple[str, ...]] = {}  # per layout: the names `decay` selects

    def settings(state: ShardState) -> dict[str, str]:
        """What else this step applies, which every rank must share, part by part (the
        dtypes of the parameters and buffers are in the layout's and buffers' fingerprints)."""
        fingerprint = state.layout.fingerprint
        if fingerprint not in decayed:  # (None is the rule that decays every parameter)
            decayed[fingerprint] = _decayed(state.layout, decay or _decay_every)
        config, scale = state.config, state.loss_scale
        return {
            "the optimizer and its hyperparameters": config.optimizer.describe(),
            "clip_norm": repr(clip_norm),
            "max_skipped": repr(max_skipped),
            "whether rows= declares the rows": repr(rows is not None),
            "the buffers policy": repr(buffers),
            "the parameters the weight-decay rule decays": repr(decayed[fingerprint]),
            "master_dtype": str(config.master_dtype),
            "reduce_dtype": str(config.reduce_dtype),
            "the fp16 loss scale (scale, good steps)": repr(
                None if scale is None else (scale.scale, scale.good_steps)),
        }

    def step(state: ShardState, batch: Any) -> tuple[ShardState, dict[str, Any]]:
        if not isinstance(state, ShardState):
            raise TypeError(f"step needs a ShardState (from fzero.init), got "
                            f"{type(state).__name__}")
        problem: Exception | None = None
        micro_batches: list[Any] = []
        applied: float | None = None  # the learning rate of this step, on every parameter
        agreed: dict[str, str] = {}  # the settings, part by part
        release: Callable[[], None] | None = None
        named: dict[str, Tensor] = {}  # the module's parameters, by name
        weights: tuple[float, ...] | None = None  # the micro-batches' shares of the loss
        count: int | None = None  # this rank's rows (None: its batch does not tell)
        try:  # the module is released whatever happens, an interrupt included
            try:  # checks that may fail on one rank only: reported to all through the header
                check_live(state, "step")
                check_tensors(state, "step")
                _check_grad_mode()
                release = claim(model, "step")
                named = _check_model(model, state, requires_grad=state.config.requires_grad,
                                     train=True)
                if not state.trainable:
                    raise ValueError("step: the state has no trainable parameter (every "
                                     "parameter is frozen): there is nothing to train; use "
                                     "make_eval_step")
                micro_batches = split_batch(batch, accum_steps, declared=rows is not None)
                counts = None if rows is None else _declared_rows(rows, micro_batches)
                count = _rows(micro_batches) if counts is None else sum(counts)
                if count == 0:  # (also where every tensor's dim 0 is 0)
                    raise ValueError("step: the batch has no rows (dim 0 of its tensors is "
                                     "0, of most of them or of those that are not lengths; "
                                     "or rows(batch) said 0): a mean over no rows is "
                                     "undefined")
                weights = micro_weights(batch, micro_batches, rows=counts)
                # The step's (global, 1-based) number decides the rate, also for a parameter
                # whose own update count lags (unused in earlier steps): that count is only
                # for its moments' bias correction.
                applied = _schedule_lr(lr, state.step + 1)
                if applied is None:  # the optimizer's own rate or schedule
                    applied = _schedule_lr(state.config.optimizer.lr, state.step + 1)
                agreed = settings(state)  # (calls the user's decay rule: any error)
            except Exception as exc:
                problem = exc
            # (tensors made under inference mode could not be trained with afterwards)
            with (torch.inference_mode(False), state.config.comm.scope(
                    f"train step {state.step + 1}")):
                return _train(state, micro_batches, weights, count, problem, applied, agreed,
                              named)
        finally:
            if release is not None:
                release()

    def _train(
        state: ShardState, micro_batches: list[Any], weights: tuple[float, ...] | None,
        count: int | None, problem: Exception | None, applied: float | None,
        agreed: dict[str, str],
        named: dict[str, Tensor],
    ) -> tuple[ShardState, dict[str, Any]]:
        nonlocal checked_writes
        comm = state.config.comm
        control = comm.channel(_CONTROL, host=True)
        declared = rows is not None
        header = HeaderRound(control, _header(state, len(micro_batches), kind=0, lr=applied,
                                              settings=_settings_bits(agreed),
                                              rows=count if declared and count else -1),
                             what="train step", own=problem, parts={"settings": agreed})
        if problem is not None or state.stage == 3 or declared:
            header.check()  # nothing to compute, or a collective comes first (stage 3 gathers),
            # or the ranks' declared rows weigh this rank's loss
        # Otherwise the header travels during the first forward; the first reduction (or any
        # other collective) waits for it, and raises with it: see `[Note: agreement points]`.
        share = 1.0  # this rank's loss's weight in the mean over ranks, times their number
        if declared and count:
            share = comm.world_size * count / sum(header.rows())
        before = _counts(comm)
        control_before = control.counters.total()
        buffers_now = {name: b.clone() for name, b in state.buffers.items()}
        side = streams if streams is not None else _streams_of(own_streams, state.config.device)
        run = _run(state, model, binder, loss_fn, micro_batches, weights, count, share,
                   buffers_now, prefetch, side, sync_buffers=buffers == "broadcast",
                   gate=header.check, leaves=leaves, check_writes=not checked_writes,
                   named=named)
        checked_writes = checked_writes or state.stage == 3
        header.check()  # no-op when a reduction waited for it already
        grads = run.grads
        if run.failure is None and not run.aborted:
            _unscale(grads, state)
        stats = _exchange(state, run, control)
        _raise_if_failed(state, run, stats, declared=declared)
        next_step = state.step + 1
        squared_norm = stats.squared_norm
        grad_norm = math.sqrt(squared_norm) if squared_norm >= 0 else float("nan")
        finite = math.isfinite(grad_norm)
        param_steps = state.param_steps
        used = _used_globally(stats.used, run.used)
        if finite:
            # From the first write on, the input state is neither before nor after the step
            # (an interrupt here must not leave it live: a re-run would apply the batch twice).
            state.lease.consumed_by, state.lease.updating = next_step, True
            if side is not None:
                side.before("optimizer")
            _clip(grads, grad_norm, clip_norm)
            param_steps = _update(state, grads, used, decay, applied, plans)
            _publish(state, run.streams)
        else:
            _check_skip(state, stats, control, max_skipped)
        new_state = dataclasses.replace(
            state,
            step=next_step if finite else state.step,
            loss_scale=state.loss_scale.after(finite) if state.loss_scale is not None else None,
            bucket_order=run.order if run.order is not None else state.bucket_order,
            buffers=buffers_now,
            param_steps=param_steps,
            skipped=0 if finite else state.skipped + 1,
            uncast=() if finite else state.uncast,  # the update cast every parameter
            lease=Lease(),
        )
        state.lease.consumed_by, state.lease.updating = next_step, False
        world = comm.world_size
        by_kind = _counts(comm, before)
        metrics = {
            "loss": stats.loss_sum / world,
            "grad_norm": grad_norm,
            "skipped": not finite,
            "nonfinite_ranks": list(stats.nonfinite),
            "lr": applied,
            "step": new_state.step,
            "comm_bytes": sum(by_kind.values()),
            "comm_bytes_by_kind": by_kind,
            "control_bytes": control.counters.total() - control_before,
            "state_bytes": state_bytes(new_state),
            "state_bytes_theory": state_bytes_theory(new_state),
            "gathered_bytes_peak": run.gathered_peak,
            "grad_bytes_peak": run.grad_peak,
            "unused": _unused_names(state, used),
        }
        if new_state.loss_scale is not None:
            metrics["loss_scale"] = new_state.loss_scale.scale
        return new_state, metrics

    return step


def make_eval_step(
    model: nn.Module, fn: Callable[[Callable[..., Any], Any], Any], *, prefetch: int = 1
) -> Callable[[ShardState, Any], Any]:
    """Build ``evaluate(state, batch) -> fn(call, batch)``: forward only, no gradients.

    For stage 3 the buckets are gathered just in time as in training, and it is a collective:
    every rank must call it (with batches that may run different modules); below stage 3 it is
    local. The state is not consumed and its buffers are not changed: a forward that changes
    a buffer (a module left in training mode) raises, where torch's module would keep the
    change (call ``model.eval()`` first). It may run under
    ``torch.inference_mode()``. A parameter `fn` returns (or a view of one) is, below stage 3,
    a view of the state (as torch returns the live weight: later steps change it); at stage 3,
    whose gathered parameters are released when the step returns, a copy.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(fn):
        raise TypeError(f"fn must be a function (call, batch) -> result, got {type(fn).__name__}")
    if prefetch not in (0, 1, 2):
        raise ValueError(f"prefetch must be 0, 1 or 2 buckets, got {prefetch=}")
    binder = Binder(model)
    own_streams: dict[torch.device, Streams | None] = {}  # see _streams_of
    checked_writes = False  # stage 3: whether an eval looked for writes bypassing autograd
    clean: list[tuple[weakref.ref[Tensor], int]] = []  # stage 3: tensors found not apart

    def evaluate(state: ShardState, batch: Any) -> Any:
        if not isinstance(state, ShardState):
            raise TypeError(f"evaluate needs a ShardState (from fzero.init), got "
                            f"{type(state).__name__}")
        problem: Exception | None = None
        release: Callable[[], None] | None = None
        named: dict[str, Tensor] = {}
        try:
            try:
                check_live(state, "evaluate")
                check_tensors(state, "evaluate")
                release = claim(model, "evaluate")
                named = _check_model(model, state)
                if state.stage == 3 and not _unchanged(clean, state):  # (stages 0-2 check
                    # after their forward, below)
                    written = lost_writes(state)
                    if written:  # e.g. an EMA's lerp_ of bfloat16 shards apart from the master
                        raise _written_through_data(state, written, apart=True)
                    clean[:] = _marks(state)
            except Exception as exc:
                if state.stage < 3:  # local: no collective, so checks raise here
                    raise
                problem = exc
            return _evaluate(state, batch, problem, named)
        finally:
            if release is not None:
                release()

    def _evaluate(state: ShardState, batch: Any, problem: Exception | None,
                  named: dict[str, Tensor]) -> Any:
        nonlocal checked_writes
        if state.stage < 3:
            buffers = {name: b.clone() for name, b in state.buffers.items()}
            leaves = [entry_views(flat, bucket)
                      for flat, bucket in zip(state.params, state.layout.buckets, strict=True)]
            views = _views(leaves)
            with torch.no_grad():
                out = binder.run(_bindings(state, leaves, buffers, named),
                                 lambda: fn(model.__call__, batch),
                                 keep=_kept_names(state), reshaped="drop")
            _check_buffers_unwritten(buffers, state)
            replaced = _replaced(state.layout, leaves, views)
            if replaced:  # torch's module would keep the new data; the state would not
                raise _replaced_data(replaced)
            written = lost_writes(state)
            if written:  # the next update would drop it
                raise _written_through_data(state, written)
            return out
        # Under the caller's torch.inference_mode too: the gathered buffers and leaves are
        # kept for the next step, so they may not become inference tensors; nor may the
        # buffers' copies, which forward may update in place (BatchNorm in train mode).
        with torch.inference_mode(False), torch.no_grad():
            buffers = {name: b.clone() for name, b in state.buffers.items()}
            control = state.config.comm.channel(_CONTROL, host=True)
            agree_header(control, _header(state, 0 if problem else 1, kind=1),
                         what="eval step", own=problem)
            streams = _streams_of(own_streams, state.config.device)
            with _sharded(state, model, prefetch, streams, train=False,
                          check_writes=not checked_writes) as session:
                out = binder.run(_bindings(state, session.leaves, buffers, named),
                                 lambda: session.evaluate(fn, model, batch),
                                 keep=_kept_names(state), reshaped="drop")
            checked_writes = True
            _check_buffers_unwritten(buffers, state)
            # The gathered copy a forward wrote in place is released with its bucket: torch's
            # module would keep the write (nn.Embedding(max_norm=...) in eval), the state not.
            _check_unmodified(session.leaves, session.versions, state)
            if session.written:  # found as the buckets were released, the last ones on exit
                raise _written_through_data(state, session.written)
            replaced = session.residency.buffers.replaced()
            if replaced:  # torch's module would keep the new data; the state would not
                raise _replaced_data(replaced)
            return out

    return evaluate


def _marks(state: ShardState) -> list[tuple[weakref.ref[Tensor], int]]:
    """Each parameter and master buffer of `state` with its version: while they are the same
    tensors at the same versions, `lost_writes` would find what it found (a comparison of
    every shard, a device-to-host copy: 20% of a stage-3 eval of one row on the CPU, a
    review). Only a write through ``.data`` of the state's own tensors goes unseen, which
    no step or documented recipe makes. Empty where a tensor has no version (inference)."""
    tensors = [t for t in (*state.params, *state.master) if t is not None]
    try:
        return [(weakref.ref(t), t._version) for t in tensors]
    except RuntimeError:  # (an inference tensor tracks no version)
        return []


def _unchanged(marks: Sequence[tuple[weakref.ref[Tensor], int]], state: ShardState) -> bool:
    """Whether `state`'s parameters and master buffers are those `marks` saw, unchanged."""
    now = _marks(state)
    return bool(marks) and len(marks) == len(now) and all(
        ref() is not None and ref() is other() and version == seen
        for (ref, version), (other, seen) in zip(marks, now, strict=True))


def _kept_names(state: ShardState) -> list[str]:
    """Every name of the state's buffers, a second name of one tensor included: forward may
    reassign a buffer through either (`Binder.run`'s `keep`)."""
    return [*state.buffers, *(alias for alias, _ in state.config.buffer_aliases)]


def _check_buffers_unwritten(copies: Mapping[str, Tensor], state: ShardState) -> None:
    """Raise if an eval step's forward changed its copies of the state's buffers, in place or
    by reassignment (`Binder.run`'s `keep` copies it in): their bits, not their versions (a
    kernel's own write, such as BatchNorm's running statistics, bumps none; Hugging Face's
    longrope rewrites ``inv_freq`` with the values it holds in every forward, losing nothing)."""
    written = [name for name, copy in copies.items()
               if not torch.equal(bits(copy), bits(state.buffers[name]))]
    if written:
        raise ValueError(
            f"evaluate: forward changed buffer(s) {written[:5]}. An eval step leaves the state "
            f"as it is, so the change would be lost, where torch's module keeps it. A module "
            f"left in training mode does this (BatchNorm's running statistics, spectral_norm's "
            f"power iteration): call model.eval() before evaluating (and model.train() before "
            f"training again); to keep such an update on purpose, run the forward in a train "
            f"step")


def full_params(state: ShardState, *, master: bool = False) -> dict[str, Tensor]:
    """All parameters gathered to full tensors on every rank (a collective for stages 1-3).

    Args:
        state: the state (not consumed by a step).
        master: return the master copy (e.g. fp32) of trainable parameters instead of the
            compute-dtype parameters.

    Returns:
        Names (aliases included) to new tensors (not views of the state). Parameters only:
        the buffers, replicated on every rank, are ``state.buffers`` (by their
        ``named_buffers()`` names, non-persistent ones included: a ``state_dict`` has only the
        persistent ones).

    Raises:
        ValueError: on every rank (stages 1-3), when the ranks' calls differ: a state of
            another layout, stage or step (a clone on one rank), another `master`, or a
            consumed state on some rank (which raises its own error). Each rank gathers its
            part into the others' buffers, so such calls mixed values silently, or aborted a
            gloo process on a size mismatch (a probe).
    """
    if not isinstance(state, ShardState) or state.stage == 0:
        check_live(state, "full_params")  # (stage 0: nothing to gather, nothing to agree)
    else:
        _agree_on_full_params(state, master)
    comm = state.config.comm
    flats: list[Tensor | None] = []
    pending = []
    for index, bucket in enumerate(state.layout.buckets):
        source = _full_params_source(state, index, master)
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


def _full_params_source(state: ShardState, index: int, master: bool) -> Tensor | None:
    """Bucket `index`'s master copy when `full_params` returns it, else None (parameters)."""
    return state.master[index] if master and state.master[index] is not None else None


def _agree_on_full_params(state: ShardState, master: bool) -> None:
    """Raise on every rank unless every rank's `full_params` call gathers alike (one round);
    a rank whose state is consumed raises its own error, the others name it."""
    try:
        check_live(state, "full_params")
        own = None
    except ValueError as error:
        own = error
    call = {
        "the state (layout, stage, step, lineage)": repr(
            (state.layout.fingerprint, state.stage, state.step, state.lineage)),
        "master=": repr(master),
        "the dtypes gathered": repr([
            str((source if source is not None else params).dtype)
            for source, params in zip(
                (_full_params_source(state, i, master) for i in range(len(state.params))),
                state.params, strict=True)]),
        "a live state": "yes" if own is None else f"no: {own}",
    }
    try:
        fingerprint_check(state.config.comm, repr(tuple(call.values())), "full_params call",
                          parts=call)
    except ValueError as error:
        if own is not None:
            raise own from None
        raise ValueError(f"{error}; every rank must call full_params alike") from None
    if own is not None:  # (every rank's state is consumed alike)
        raise own


def split_batch(batch: Any, parts: int, *, declared: bool = False) -> list[Any]:
    """Split a batch into `parts` micro-batches along dim 0 of every tensor in it.

    A `MicroBatches` list is taken as given: any length where `parts` is 1, else exactly
    `parts`. Otherwise the batch (any pytree: tuple, list, dict, ...) is split: every tensor
    along dim 0 into `parts` equal parts; other leaves are shared. A container's length is
    never taken to mean micro-batches, nor is a list nested in it whose entries are records
    (dicts, lists, tuples) with tensors, as many as the batch's rows (per-sample targets):
    that raises, also for entries that are bare tensors where the rows are `declared` (a
    step's ``rows=``: the batch is not one row per sample along dim 0).

    Raises:
        ValueError: a tensor's dim 0 does not divide into `parts`, the tensors' dim 0 sizes
            differ, the batch has no tensor, or `MicroBatches` is empty or holds another
            number of micro-batches than `parts` (> 1) asks for.
    """
    if isinstance(batch, MicroBatches):
        if not batch:
            raise ValueError("MicroBatches([]) holds no micro-batch; give at least one")
        if parts != 1 and len(batch) != parts:
            raise ValueError(
                f"MicroBatches of {len(batch)} micro-batches, but the step was built with "
                f"accum_steps={parts}: give {parts}, or build the step with accum_steps=1 "
                f"(the default), which takes MicroBatches of any length")
        return list(batch)
    if parts == 1:
        return [batch]
    leaves, spec = pytree.tree_flatten(batch)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    if not tensors:
        unknown = " (a mapping type torch's pytree does not take apart, such as Hugging " \
            "Face's BatchEncoding: pass dict(batch))" if _batch_tensors(batch) else ""
        raise ValueError(
            f"accum_steps={parts} needs a batch with tensors to split along dim 0 (or "
            f"fzero.MicroBatches([...]) of explicit micro-batches); got "
            f"{type(batch).__name__}{unknown}"
        )
    for leaf in tensors:
        if leaf.dim() == 0 or leaf.shape[0] % parts:
            raise ValueError(
                f"a batch tensor of shape {tuple(leaf.shape)} does not split into "
                f"accum_steps={parts} equal micro-batches along dim 0"
            )
    if len({leaf.shape[0] for leaf in tensors}) > 1:
        shapes = [tuple(leaf.shape) for leaf in tensors]
        raise ValueError(
            f"the batch's tensors differ in size along dim 0 ({shapes[:5]}): each would be "
            f"cut into accum_steps={parts} parts along dim 0, pairing a micro-batch's rows with "
            f"another part of the others (a tensor that is not one row per sample, such as "
            f"position ids of shape (T,) or cumulative lengths, would be cut too). Keep such "
            f"tensors out of the batch (close over them in loss_fn), or give "
            f"fzero.MicroBatches([...]) explicitly"
        )
    listed = _listed(batch, tensors[0].shape[0], records=not declared)
    if listed is not None:
        raise ValueError(
            f"the batch holds a list with tensors at {listed}, of as many entries as it has "
            f"rows: where they are one per row (per-sample targets, such as an image's "
            f"boxes), accum_steps={parts} would cut each entry's tensors along their dim 0 "
            f"instead of the list into micro-batches of whole entries (where they are batched "
            f"inputs whose number merely equals the rows, the step cannot tell). Give "
            f"fzero.MicroBatches([...]) explicitly")
    split = [leaf.chunk(parts) if isinstance(leaf, Tensor) else None for leaf in leaves]
    return [
        pytree.tree_unflatten(
            [s[i] if s is not None else leaf for s, leaf in zip(split, leaves, strict=True)],
            spec,
        )
        for i in range(parts)
    ]


def _listed(batch: Any, rows: int | None, where: str = "", depth: int = 0, *,
            records: bool = False) -> str | None:
    """Where `batch` nests a list or tuple of entries that each hold a tensor, `rows` of them
    (None: any number), below its top level (a batch ``(ids, labels)`` is two tensors, not
    two rows); None if nowhere, 4 levels deep. Its entries may be one per row (per-image
    boxes): then splitting along dim 0 cuts inside them, and the tensors' sizes along dim 0
    do not tell the rows. (Per-image boxes of 2 rows each beside 2 images were cut in half by
    `split_batch`, each micro-batch pairing one image with half of both images' boxes; ranks
    of 2 and 3 images, with one box each, counted the boxes' dim 0 as 1 row: silently, a
    review and a probe.) With `records`, only entries that are records count (mappings,
    lists, tuples: per-sample target dicts): bare tensors as many as the rows are as likely
    batched inputs, ``((ids, mask), labels)`` of 2 rows (refused when they counted: a
    review)."""
    if depth > 4:
        return None
    if isinstance(batch, Mapping):
        items = [(f"{where}[{key!r}]", value) for key, value in batch.items()]
    elif isinstance(batch, list | tuple):
        if depth > 0 and batch and (rows is None or len(batch) == rows) and all(
                _batch_tensors(entry) and (not records or isinstance(entry, Mapping | list | tuple))
                for entry in batch):
            return where
        items = [(f"{where}[{index}]", value) for index, value in enumerate(batch)]
    else:
        return None
    for place, value in items:
        found = _listed(value, rows, place, depth + 1, records=records)
        if found is not None:
            return found
    return None


def micro_weights(batch: Any, micro_batches: Sequence[Any], *,
                  rows: Sequence[int] | None = None) -> tuple[float, ...] | None:
    """Each micro-batch's share of the step's loss, summing to 1; None for equal shares.

    A `MicroBatches` list has its `weights` (normalized). Otherwise, with `rows` (the
    micro-batches' rows, as a step's ``rows=`` declares them) the shares are those rows';
    without, a batch split along dim 0 has equal parts, and `MicroBatches` none when its
    micro-batches have the same size along dim 0.

    Raises:
        ValueError: `MicroBatches` of different sizes without `weights` (equal weights would
            not be the whole batch's mean), or `weights` that are not one positive finite
            number per micro-batch.
    """
    weights = getattr(batch, "weights", None) if isinstance(batch, MicroBatches) else None
    if weights is None and rows is not None:
        counts = [_count(n, f"rows[{index}]") for index, n in enumerate(rows)]
        if len(counts) != len(micro_batches) or not sum(counts):
            raise ValueError(f"micro_weights: rows= needs one count per micro-batch "
                             f"({len(micro_batches)}), not all 0; got {list(rows)[:8]}")
        return None if len(set(counts)) == 1 else tuple(n / sum(counts) for n in counts)
    if not isinstance(batch, MicroBatches):
        return None
    if weights is None:
        sizes = [_rows([micro]) for micro in micro_batches]
        if None in sizes and len({tuple(_dim0_signature(m)) for m in micro_batches}) > 1:
            unclear = sizes.index(None)
            raise ValueError(
                f"MicroBatches without weights, and the size of micro-batch {unclear + 1} "
                f"cannot be told: its tensors' sizes along dim 0 are "
                f"{_dim0_sizes(micro_batches[unclear])[:8]} (rows, or a length?), and the "
                f"micro-batches' tensors differ in size. Equal weights would be the whole "
                f"batch's mean only for micro-batches of equal size: give each its weight, "
                f"fzero.MicroBatches(parts, weights=[...]) (its rows when loss_fn means over "
                f"rows, its target tokens when over tokens)")
        if None not in sizes and len(set(sizes)) > 1:
            raise ValueError(
                f"MicroBatches of different sizes along dim 0 ({sizes[:8]}): the step would "
                f"average their losses with equal weights, which is not the mean over the "
                f"whole batch's rows. Give each micro-batch its weight, "
                f"fzero.MicroBatches(parts, weights={sizes[:8]}) (its rows, when loss_fn means "
                f"over rows; its target tokens, when over tokens), or micro-batches of equal "
                f"size")
        return None
    values = [_real(w) for w in weights]
    if len(values) != len(micro_batches) or not all(
            w is not None and math.isfinite(w) and w > 0 for w in values):
        raise ValueError(
            f"MicroBatches(weights=...) needs one positive finite number per micro-batch "
            f"({len(micro_batches)}); got {list(weights)[:8]}")
    total = math.fsum(values)
    return tuple(w / total for w in values)


def _declared_rows(rows: Callable[[Any], int], micro_batches: Sequence[Any]) -> list[int]:
    """Each micro-batch's rows as ``rows(micro_batch)`` declares them.

    Raises:
        ValueError: `rows` raised, or gave something that is not an int >= 0, or 0 for a
            micro-batch of a batch that has rows (a mean over none is undefined).
    """
    counts = []
    for index, micro in enumerate(micro_batches):
        where = f"rows(micro-batch {index + 1}/{len(micro_batches)})"
        try:
            value = rows(micro)
        except Exception as exc:  # on this rank only, maybe: the step header reports it to all
            raise ValueError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        counts.append(_count(value, where))
    if 0 in counts and sum(counts):
        raise ValueError(f"rows(micro-batch {counts.index(0) + 1}/{len(counts)}) is 0: its "
                         f"loss would be a mean over no rows; give every micro-batch rows")
    if sum(counts) > _MOST_ROWS:  # (a rank that raised building the header left the others
        # waiting in its all-gather: this raises before, and every rank learns it there)
        raise ValueError(f"rows(...) declared {sum(counts)} rows in all ({counts[:8]}): more "
                         f"than {_MOST_ROWS} cannot be exchanged exactly")
    return counts


def _count(value: Any, what: str) -> int:
    """`value` as an int >= 0: an int, a numpy integer, or an integer tensor of one element.

    Raises:
        ValueError: anything else (a bool, a float, a negative count), naming `what`.
    """
    count = None
    if not isinstance(value, bool) and not (isinstance(value, Tensor) and (
            value.dtype == torch.bool or value.is_meta)):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            count = operator.index(value)
    if count is None or count < 0:
        raise ValueError(f"{what} must be an int >= 0 (the rows loss_fn means over), got "
                         f"{value!r}")
    return count


def _real(value: Any) -> float | None:
    """`value` as a float when it is a real number (a one-element real tensor included; not
    a bool), else None."""
    if isinstance(value, Tensor):
        real = value.numel() == 1 and not (value.is_complex() or value.dtype == torch.bool)
        return float(value) if real else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


# --- running the micro-batches ----------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """What running a step's micro-batches left behind on this rank."""

    losses: list[Tensor]
    weights: tuple[float, ...] | None  # the losses' shares (None: equal)
    share: float  # this rank's loss's weight in the mean over ranks, times their number
    grads: list[Tensor]  # per trainable bucket, reduced (stage 0: full; else this rank's shard)
    used: list[bool]  # per trainable entry, whether this rank's backward reached it
    rows: int  # of this rank's micro-batches, or -1 where they cannot tell (`_rows`)
    shapes: int  # the digest of their tensors' places and dim-0 sizes (`_shape_digest`)
    failure: BaseException | None  # this rank's own exception, if its computation raised
    aborted: bool  # some rank failed (known to every rank at stage 3)
    order: BucketOrder | None  # stage 3: the agreed sequences
    streams: SideStreams | None
    gathered_peak: int
    grad_peak: int


def _run(
    state: ShardState,
    model: nn.Module,
    binder: Binder,
    loss_fn: LossFn,
    micro_batches: Sequence[Any],
    weights: tuple[float, ...] | None,
    rows: int | None,
    share: float,
    buffers: dict[str, Tensor],
    prefetch: int,
    streams: SideStreams | None,
    *,
    sync_buffers: bool,
    gate: Callable[[], None],
    leaves: _LeafCache,
    check_writes: bool = False,
    named: Mapping[str, Tensor],
) -> _Run:
    """Forward and backward of every micro-batch, with the stage's gradient reductions, each
    launched after `gate()` (which raises when the step must not communicate). `named`: the
    module's own parameters (their attributes are carried onto the bound tensors, and they
    must receive no gradient); `weights`: the micro-batches' shares of the loss (None:
    equal); `rows`: theirs (None: they do not tell); `share`: this rank's loss's weight in the
    mean over ranks, times their number (1: the ranks weigh the same)."""
    scale = share * (state.loss_scale.scale if state.loss_scale is not None else 1.0)
    factors = ([scale / len(micro_batches)] * len(micro_batches) if weights is None
               else [scale * weight for weight in weights])
    session_of = (_sharded(state, model, prefetch, streams, train=True,
                           check_writes=check_writes, leaves=leaves.of(state))
                  if state.stage == 3 else _replicated(state, streams, gate, leaves.of(state)))
    losses: list[Tensor] = []
    failure: BaseException | None = None
    comm = state.config.comm
    watch = GradientWatch(named)
    with session_of as session:
        bindings = _bindings(state, session.leaves, buffers, named)
        kept = _kept_names(state)
        for index, micro in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            if session.aborted:  # every rank knows: nobody computes the rest
                continue
            where = f"train step {state.step + 1}, micro-batch {index + 1}/{len(micro_batches)}"
            with comm.scope(where):
                if sync_buffers:
                    _broadcast_buffers(comm, buffers, gate)
                if failure is not None:  # only this rank knows: keep the collective sequence
                    session.skip(last)
                    continue
                try:
                    loss = binder.run(bindings, lambda m=micro, f=factors[index], lt=last:
                                      session.micro_batch(loss_fn, model, m, f, lt),
                                      keep=kept)
                    if loss is not None:
                        losses.append(loss)
                except PeerFailed:  # a round showed another rank failed: stop with everyone
                    session.recover(last, peer=True)
                except CollectiveTimeout:  # a rank is missing: a round to tell the others
                    raise  # would wait out the timeout again (the others time out too)
                except BaseException as exc:  # every rank must learn of it (_raise_if_failed),
                    # a KeyboardInterrupt or SystemExit on one rank too: its next collective
                    # (a save) met the others' reductions (gloo aborted the process), or they
                    # waited out the timeout
                    gate()  # unless the step could not start: then every rank raises that
                    failure = exc
                    session.recover(last, peer=False)
        grads = session.finish()
        replaced, toggled = leaves.replaced(), leaves.toggled()
        if failure is None and not session.aborted:
            failure = _lost_to_the_state(state, session.written, replaced, toggled, watch)
        run = _Run(
            losses=losses,
            weights=weights,
            share=share,
            grads=grads,
            used=[flag for flags, bucket in zip(session.completion.used, state.layout.buckets,
                                                strict=True) if bucket.trainable for flag in flags],
            rows=-1 if rows is None else rows,
            shapes=_shape_digest(micro_batches),
            failure=failure,
            aborted=session.aborted,
            order=session.order,
            streams=session.streams,
            gathered_peak=session.gathered_peak,
            grad_peak=session.reducer.peak_bytes if session.reducer is not None else 0,
        )
    if replaced or toggled:  # those leaves are unusable: the next step builds new ones
        leaves.drop()
    return run


def _lost_to_the_state(
    state: ShardState, written: Sequence[int], replaced: Sequence[str],
    toggled: Sequence[str], watch: GradientWatch,
) -> ValueError | None:
    """Why the step just computed must not be applied, when forward changed or read parameters
    in a way the state does not follow (each would be lost, or stale, silently); else None.
    `written`: buckets written through ``.data`` where that is lost; `replaced`: parameters
    given new data (`_LeafCache.replaced`); `toggled`: parameters whose ``requires_grad``
    forward changed (`_toggled`); `watch`: the module's own parameter objects."""
    if written:
        return _written_through_data(state, written)
    if replaced:
        return _replaced_data(replaced)
    if toggled:
        return ValueError(
            f"forward changed requires_grad of parameters {list(toggled[:5])} (e.g. "
            f"p.requires_grad_(False) to freeze a layer after using it): which parameters "
            f"train is fixed when the state is built (fzero.init's trainable=), and a step "
            f"binds tensors of its own in their place, so the change would be half applied "
            f"(torch leaves the gradient of a parameter frozen after its use None, and skips "
            f"it in the update) and forgotten by the next step. To train another set, build a "
            f"new state (e.g. fzero.init(..., load=) from full_params or a checkpoint, with "
            f"trainable=) and a new step, between steps")
    reached = watch.reached()
    if reached:
        return ValueError(
            f"the module's own parameters {reached[:5]} received gradients in this step: "
            f"forward reached these parameter objects other than through their module "
            f"attributes (a list or dict attribute that holds them, self.__dict__, a "
            f"closure kept from __init__), which a step does not rebind, so it computed "
            f"with the module's values, not the state's (stale after the first update), "
            f"and their gradients were lost. Read parameters through the module attribute "
            f"that registers them (self.proj.weight) in forward")
    return None


def _replaced_data(replaced: Sequence[str]) -> ValueError:
    """The error for parameters whose data forward replaced (`_Leaves.replaced`), in a train
    or an eval step: torch's module would keep the new data, the state does not."""
    return ValueError(
        f"forward replaced the data of parameters {list(replaced[:5])} (`p.data = ...`, or "
        f"`module.to(dtype)` / `.float()` inside forward, which does that, as do "
        f"`module.to(memory_format=...)`, convert_conv2d_weight_memory_format and an RNN's "
        f"flatten_parameters() on CUDA: drop those calls, speed hints that a state's flat, "
        f"contiguous buckets cannot keep): the tensor "
        f"a step binds for a parameter is a view of the state's memory, and one given "
        f"new data no longer is, so the new values (or dtype) would be lost and later "
        f"steps would read stale ones. Write in place instead (`p.data.copy_(...)` "
        f"lands in the state at stages 0-2), or give the parameter, before fzero.init, "
        f"the dtype forward converts it to (e.g. a Hugging Face SwitchTransformers "
        f"router kept in its router_dtype: build the model in those dtypes and leave "
        f"param_dtype unset), so that the conversion is a no-op")


def _written_through_data(state: ShardState, written: Sequence[int], *,
                          apart: bool = False) -> ValueError:
    """The error for buckets `written` through ``.data`` in a step where the write would be
    lost: stage 3's gathered copies (train or eval), or parameters recomputed from a master
    copy (stages 0-2, train)."""
    labels = [state.layout.buckets[i].label for i in written]
    if apart:  # (stage 3's eval step, before it gathers: nothing was written during it)
        return ValueError(
            f"stage 3: this rank's parameters of buckets {labels} stand apart from their "
            f"master copy, from which the next update recomputes them: a tree_map over the "
            f"state changed them, such as an EMA's lerp_ (an EMA of such a state is averaged "
            f"in each leaf's own dtype: read it with fzero.full_params(ema, master=True)), or a "
            f"write through .data. Evaluating them would use values the state does not hold "
            f"in its master copy; rebuild the state from the values you mean (fzero.init, a "
            f"checkpoint)")
    if state.stage == 3:
        why = ("stage 3 writes into a gathered copy it then discards, so the write would be "
               "lost silently. Change parameters between steps (fzero.full_params / a new "
               "state), or use stage 0-2 without a separate master copy, where such a write "
               "lands in the state")
    else:
        why = (f"the update recomputes these parameters from the optimizer's master copy "
               f"(param_dtype {state.params[written[0]].dtype} apart from master_dtype "
               f"{state.config.master_dtype}), so the write would be lost silently. Train "
               f"with param_dtype equal to master_dtype (then the parameters are the master "
               f"copy and the write lands in it, as in torch), or change parameters between "
               f"steps (fzero.full_params / a new state). This rank's parameters already hold "
               f"the write (forward wrote the state's own memory), its master copy does not: "
               f"rebuild the state (a checkpoint, or fzero.init) before training on. (A "
               f"tree_map over the state that changed the parameters apart from their master "
               f"copy, such as an EMA's lerp_, shows the same: an EMA of such a state is "
               f"averaged in each leaf's own dtype; read it with fzero.full_params(ema, "
               f"master=True))")
    return ValueError(
        f"{'stage 3: ' if state.stage == 3 else ''}parameters of buckets {labels} were "
        f"written during the step in a way autograd does not see (through .data, e.g. "
        f"p.data.clamp_(...) in forward): {why}")


class _Leaves:
    """Stages 0-2: the autograd leaves a step binds for a state's tensors (one per parameter,
    aliasing its flat buffer: see `fzero.buckets`), their gradients' homes (stages 0-1: views of
    the full gradient buffers, which autograd accumulates into) and the completion hooks on
    them. They depend only on the state's tensors, which a step updates in place and hands on
    to the next state, so they are built once and reused by every step over those tensors:
    rebuilt each step they cost ~1.7 ms at 124 parameters over 2 ranks (10% of a step whose
    compute is near zero). A leaf's version counter is its own (not its flat buffer's), so the
    optimizer's writes never look like the forward's."""

    def __init__(self, state: ShardState) -> None:
        layout = state.layout
        self.layout, self.stage = layout, state.stage
        self.tensors = [weakref.ref(t) for t in (*state.params, *trainable_only(state.grads))]
        self.leaves = [alias_leaves(flat, bucket)
                       for flat, bucket in zip(state.params, layout.buckets, strict=True)]
        self.homes: list[list[Tensor | None]] = [[None] * len(bucket_leaves)
                                                 for bucket_leaves in self.leaves]
        if state.stage < 2:  # gradients accumulate in place in the full buffers
            for index, bucket in enumerate(layout.buckets):
                grads = state.grads[index]
                if bucket.trainable and grads is not None:
                    self.homes[index] = list(entry_views(grads, bucket))
        self.completion = Completion(layout, self.leaves, lambda index: None)
        self.completion.stop()  # until a step `restart`s it
        self._views = _views(self.leaves)

    def replaced(self) -> list[str]:
        """The parameters whose leaf no longer views its flat buffer: forward replaced its data
        (``p.data = ...``, or ``module.to(dtype)`` inside forward, which does that)."""
        return _replaced(self.layout, self.leaves, self._views)

    def toggled(self) -> list[str]:
        """The parameters whose leaf's ``requires_grad`` forward changed (`_toggled`)."""
        return _toggled(self.layout, self.leaves)

    def fits(self, state: ShardState) -> bool:
        """Whether these are the leaves of `state`'s tensors (the very objects)."""
        tensors = (*state.params, *trainable_only(state.grads))
        return (state.layout is self.layout and state.stage == self.stage
                and len(tensors) == len(self.tensors)
                and all(ref() is t for ref, t in zip(self.tensors, tensors, strict=True)))

    def begin(self) -> None:
        """Before a step: every leaf's gradient at its home (stages 0-1) or absent (stage 2),
        whatever a failed step or the user's code left there."""
        for bucket_leaves, homes in zip(self.leaves, self.homes, strict=True):
            for leaf, home in zip(bucket_leaves, homes, strict=True):
                leaf.grad = home

    def displaced(self) -> list[str]:
        """Stages 0-1: the parameters whose gradient is no longer at its home (the user's code
        set ``.grad``, e.g. ``model.zero_grad()`` inside ``loss_fn``): autograd accumulated
        them elsewhere, and the reduction would miss them."""
        return [entry.name
                for bucket, bucket_leaves, homes in zip(self.layout.buckets, self.leaves,
                                                        self.homes, strict=True)
                for entry, leaf, home in zip(bucket.entries, bucket_leaves, homes, strict=True)
                if home is not None and leaf.grad is not home]

    def close(self) -> None:
        """Remove the hooks (the leaves are not used again)."""
        self.completion.close()


class _ShardedLeaves:
    """Stage 3: the full buffers and parameter leaves a step gathers into
    (`fzero.residency.FullBuffers`), with the completion hooks on the leaves, reused by every
    step over the same layout (as `_Leaves` are at stages 0-2)."""

    def __init__(self, state: ShardState) -> None:
        self.buffers = FullBuffers(state.layout, state.params)
        self.completion = Completion(state.layout, self.buffers.leaves, lambda index: None)
        self.completion.stop()  # until a step `restart`s it
        self._waiter: ThreadPoolExecutor | None = None
        self._waiter_pid = 0

    def waiter(self) -> ThreadPoolExecutor:
        """The thread the steps' reducers wait for reductions on (`fzero.buckets.Reducer`),
        started once per process (one started and joined each step cost 0.5 ms; a forked
        child inherits the executor but not its thread, and would wait for ever)."""
        if self._waiter is None or self._waiter_pid != os.getpid():
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix="fzero-reduce-wait")
            self._waiter_pid = os.getpid()
        return self._waiter

    def fits(self, state: ShardState) -> bool:
        """Whether these serve `state` (its layout, every bucket released)."""
        return state.stage == 3 and self.buffers.fits(state.layout, state.params)

    def replaced(self) -> list[str]:
        """The parameters whose leaf no longer views its full buffer (`FullBuffers.replaced`)."""
        return self.buffers.replaced()

    def toggled(self) -> list[str]:
        """The parameters whose leaf's ``requires_grad`` forward changed (`_toggled`)."""
        return _toggled(self.buffers.layout, self.buffers.leaves)

    def close(self) -> None:
        """Remove the hooks and stop the waiting thread (the leaves are not used again)."""
        self.completion.close()
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)


class _LeafCache:
    """The `_Leaves` (stage 3: `_ShardedLeaves`) of the last state a train step ran on.

    Stages 0-2: the leaves alias that state's tensors and serve no other state; the cache
    refers to the tensors only weakly: once they are gone (the state and its successors
    dropped, e.g. for a loaded checkpoint) the leaves go too, and with them the last hold on
    the tensors' memory. Stage 3: the leaves view full buffers of their own and serve every
    state of the layout (a clone, a rollback), so nothing is watched: a watch on one state's
    tensor fired when that state was collected, possibly by the cyclic garbage collector in
    the middle of a step on another state, and dropped the leaves that step was using (their
    gradient hooks with them: a probe's rollback trained wrong by a whole update)."""

    def __init__(self) -> None:
        self._leaves: _Leaves | _ShardedLeaves | None = None
        self._watch: weakref.ref[Tensor] | None = None
        # A watch's callback runs in whichever thread the garbage collector frees the tensor
        # in: its check and its drop must not interleave with `of` replacing the leaves (it
        # dropped the new ones, which a step was using: that step updated nothing). Reentrant:
        # the collector may run the callback inside `of` itself.
        self._lock = threading.RLock()

    def of(self, state: ShardState) -> Any:
        """The leaves of `state`'s tensors: the cached ones, or new ones replacing them."""
        with self._lock:
            if self._leaves is not None and self._leaves.fits(state):
                return self._leaves
            self.drop()
            if state.stage == 3:
                self._leaves = _ShardedLeaves(state)
                return self._leaves
            leaves = self._leaves = _Leaves(state)
            # The leaves hold the tensors' storage: let go of them when the first tensor dies.
            cache, built = weakref.ref(self), weakref.ref(leaves)
            self._watch = weakref.ref(state.params[0], lambda _: _drop_if(cache, built))
            return leaves

    def release(self, leaves: Any) -> None:
        """Drop `leaves` if they are still the cached ones (a watch's callback), atomically."""
        with self._lock:
            if leaves is not None and self._leaves is leaves:
                self.drop()

    def replaced(self) -> list[str]:
        """The parameters whose cached leaf forward gave new data (see `_Leaves.replaced`)."""
        return self._leaves.replaced() if self._leaves is not None else []

    def toggled(self) -> list[str]:
        """The parameters whose cached leaf's ``requires_grad`` forward changed."""
        return self._leaves.toggled() if self._leaves is not None else []

    def drop(self) -> None:
        """Forget the cached leaves (removing their hooks)."""
        with self._lock:
            if self._leaves is not None:
                self._leaves.close()
            self._leaves = self._watch = None


_View = tuple[int, int, torch.dtype]


def _view(leaf: Tensor) -> _View:
    """Which storage `leaf` views, where in it, and its dtype. The storage object, not the
    address: ``share_memory_()`` moves a storage's bytes in place (a new ``data_ptr()``, the
    same storage)."""
    return leaf.untyped_storage()._cdata, leaf.storage_offset(), leaf.dtype


def _views(leaves: Sequence[Sequence[Tensor]]) -> list[list[_View]]:
    """`_view` of each leaf, per bucket (for `_replaced`)."""
    return [[_view(leaf) for leaf in bucket_leaves] for bucket_leaves in leaves]


def _replaced(layout: ShardLayout, leaves: Sequence[Sequence[Tensor]],
              views: Sequence[Sequence[_View]]) -> list[str]:
    """The parameters whose leaf no longer has the data `views` recorded: forward replaced it
    (``p.data = ...``, or ``module.to(dtype)`` inside forward, which does that)."""
    return [entry.name
            for bucket, bucket_leaves, bucket_views in zip(layout.buckets, leaves, views,
                                                           strict=True)
            for entry, leaf, view in zip(bucket.entries, bucket_leaves, bucket_views,
                                         strict=True)
            if _view(leaf) != view]


def _toggled(layout: ShardLayout, leaves: Sequence[Sequence[Tensor]]) -> list[str]:
    """The parameters whose leaf's ``requires_grad`` is no longer its bucket's (a leaf is
    created requiring grad exactly when its bucket trains): forward set it on the tensor a
    step binds in the parameter's place (``p.requires_grad_(False)``, freezing a layer)."""
    return [entry.name
            for bucket, bucket_leaves in zip(layout.buckets, leaves, strict=True)
            for entry, leaf in zip(bucket.entries, bucket_leaves, strict=True)
            if leaf.requires_grad != bucket.trainable]


def _drop_if(cache: weakref.ref[_LeafCache], leaves: weakref.ref[Any]) -> None:
    """`cache` drops its leaves if they are still `leaves` (a weakref callback: both may be
    gone already)."""
    held = cache()
    if held is not None:
        held.release(leaves())


class _ReplicatedSession:
    """Stages 0-2: full parameters, one leaf per parameter over the flat buffers."""

    @property
    def written(self) -> list[int]:
        """Buckets whose parameters forward wrote through ``.data`` where the write would be
        lost: those with a master copy apart from the parameters (`fzero.state.lost_writes`).
        Elsewhere such a write lands in the state, as in torch."""
        return lost_writes(self.state)

    def __init__(
        self, state: ShardState, streams: SideStreams | None, gate: Callable[[], None],
        leaves: _Leaves,
    ) -> None:
        layout, stage = state.layout, state.stage
        self.state = state
        self.streams = streams
        leaves.begin()
        self.bound = leaves
        self.leaves = leaves.leaves
        self.versions = _versions(self.leaves)
        if stage < 2:  # autograd accumulates into them (stage 2: the reducer copies in)
            torch._foreach_zero_(list(trainable_only(state.grads)))
        mode = ("all_reduce", "scatter_full", "scatter_leaves")[stage]
        self.reducer: Reducer | None = Reducer(
            state.config.comm, layout, self.leaves, state.grads,
            reduce_order(state.trainable, ()), mode=mode,
            reduce_dtype=state.config.reduce_dtype if stage < 2 else None, streams=self.streams,
            gate=gate,
        )
        self.completion = leaves.completion
        self.completion.restart(self.reducer.complete)
        self.aborted = False
        self.order = None
        self.gathered_peak = 0
        self.launched = False  # this round's reductions launched

    def _reduces_now(self, last: bool) -> bool:
        return self.state.stage == 2 or last

    def micro_batch(self, loss_fn: LossFn, model: nn.Module, micro: Any, factor: float,
                    last: bool) -> Tensor:
        self.completion.armed = self._reduces_now(last)
        call = _Call(model.__call__)
        loss = loss_fn(call, micro)
        _check_loss(loss, call)
        _check_unmodified(self.leaves, self.versions, self.state)
        with self.completion.backward():
            if loss.requires_grad:  # (without: this rank's gradients are zero, see `_no_path`)
                (loss * factor).backward()
        displaced = self.bound.displaced()
        if displaced:
            raise ValueError(
                f"the gradient of parameter(s) {displaced[:5]} was replaced during the step "
                f"(model.zero_grad() or p.grad = ... inside loss_fn): fzero accumulates "
                f"gradients in its own buffers and reduces those, so these would be lost. "
                f"Leave .grad alone: a train step starts from zero gradients by itself"
            )
        self._end_micro_batch(last, zero=False)
        return loss.detach()

    def _end_micro_batch(self, last: bool, *, zero: bool) -> None:
        assert self.reducer is not None
        if self._reduces_now(last):
            self.reducer.launch_rest(zero=zero)
            if self.state.stage == 2:
                self.reducer.finish()
        self.completion.reset()

    def recover(self, last: bool, *, peer: bool) -> None:
        """This rank's computation raised mid-micro-batch: finish its collectives with zeros."""
        self._end_micro_batch(last, zero=True)

    def skip(self, last: bool) -> None:
        """A micro-batch after this rank's failure: its collectives, with zeros."""
        self._end_micro_batch(last, zero=True)

    def finish(self) -> list[Tensor]:
        assert self.reducer is not None
        reduced = self.reducer.finish()
        self.completion.stop()
        return reduced

    def close(self) -> None:
        self.completion.stop()  # the hooks stay, for the next step over these leaves


@contextlib.contextmanager
def _replicated(
    state: ShardState, streams: SideStreams | None, gate: Callable[[], None], leaves: _Leaves
) -> Iterator[_ReplicatedSession]:
    session = _ReplicatedSession(state, streams, gate, leaves)
    try:
        yield session
    finally:
        session.close()


class _ShardedSession:
    """Stage 3: parameters gathered just in time (`fzero.residency.Residency`).

    A micro-batch is two phases, forward and backward, each ended on every rank together
    (`Residency.end_phase`). A rank whose computation raises ends its phase as `FAILED`; every
    rank learns it there and stops (`aborted`), so none runs a phase the others skip.
    """

    def __init__(self, state: ShardState, model: nn.Module, prefetch: int,
                 streams: SideStreams | None, train: bool, check_writes: bool = False,
                 leaves: _ShardedLeaves | None = None) -> None:
        comm = state.config.comm
        layout = state.layout
        self.state = state
        self.streams = streams
        self.triggers = trigger_modules(model, layout)
        # The first step has no agreed sequence: it gathers in rounds, learning one.
        order = state.bucket_order or BucketOrder((), ())
        self.residency = Residency(
            data=comm.channel(_GATHER), control=comm.channel(_CONTROL, host=True),
            layout=layout, shards=state.params, streams=self.streams, order=order,
            prefetch=prefetch, check_writes=check_writes,
            buffers=leaves.buffers if leaves is not None else None,
        )
        self.leaves = self.residency.leaves
        if leaves is not None:
            leaves.buffers.begin()
        self.versions = _versions(self.leaves)
        self.reducer: Reducer | None = None
        if train:  # the reducer copies each bucket's first reduction into its shard
            self.reducer = Reducer(comm, layout, self.leaves, state.grads,
                                   reduce_order(state.trainable, order.forward),
                                   mode="scatter_leaves", streams=self.streams,
                                   patience=REDUCE_PATIENCE,
                                   waiter=leaves.waiter() if leaves is not None else None)
        self.reused = leaves is not None  # its completion hooks stay, for the next step
        if leaves is not None:
            self.completion = leaves.completion
            self.completion.restart(unguarded(self._on_complete))
        else:
            self.completion = Completion(layout, self.leaves, unguarded(self._on_complete))
        self.aborted = False
        self.phase: str | None = None  # the phase under way on this rank
        self.hooks = contextlib.ExitStack()
        self.hooks.enter_context(self.residency.module_hooks(self.triggers))
        if train:
            self.hooks.enter_context(self.residency.saved_tensors_hooks())

    @property
    def order(self) -> BucketOrder:
        return self.residency.order

    @property
    def gathered_peak(self) -> int:
        return self.residency.peak_bytes

    @property
    def written(self) -> list[int]:
        """Buckets whose gathered values this rank found written bypassing autograd."""
        return sorted(self.residency.written)

    def _on_complete(self, index: int) -> None:
        self.residency.on_grads_complete(index)
        assert self.reducer is not None
        self.reducer.complete(index)

    def _forward(self, fn: Callable[..., Any], call: Callable[..., Any], model: nn.Module,
                 micro: Any) -> Any:
        self.phase = "forward"
        self.residency.begin("forward")
        try:
            with self.residency.guard(model):
                return fn(call, micro)
        except RuntimeError as error:
            explained = self.residency.explain(error, model)
            if explained is error:  # not a released read: the user's own error, as it was
                raise
            raise explained from error

    def _end_phase(self, status: int, *, keep: bool = False) -> None:
        end = self.residency.end_phase(status, keep=keep)
        self.aborted = self.aborted or end.aborted
        self.phase = None

    def micro_batch(self, loss_fn: LossFn, model: nn.Module, micro: Any, factor: float,
                    last: bool) -> Tensor | None:
        call = _Call(model.__call__)
        loss = self._forward(loss_fn, call, model, micro)
        _check_loss(loss, call)
        _check_unmodified(self.leaves, self.versions, self.state)
        touched = set(self.residency.used)
        self._end_phase(DONE, keep=True)  # backward starts with what forward ended with
        if self.aborted:  # another rank failed in this forward: no rank runs backward
            return None
        self.phase = "backward"
        assert self.reducer is not None
        # This forward's agreed sequence (the same on every rank) orders the reductions.
        self.reducer.reorder(reduce_order(self.state.trainable, self.order.forward))
        self.residency.begin("backward")
        for index in self.state.trainable:
            if index not in touched:  # never gathered: no leaf of it is in the graph
                self.completion.force(index)
        path = loss.requires_grad  # (without one: zero gradients, see `_no_path`)
        with self.residency.guard(model), self.completion.backward():
            try:
                if path:
                    backward_under_guard(loss * factor)
            except RuntimeError as error:
                explained = self.residency.explain(error, model)
                if explained is error:
                    raise
                raise explained from error
        self._end_backward(DONE)
        return loss.detach()

    def _end_backward(self, status: int) -> None:
        assert self.reducer is not None
        self.reducer.launch_rest(zero=status != DONE)
        self._end_phase(status)
        self.reducer.finish()
        self.completion.reset()

    def recover(self, last: bool, *, peer: bool) -> None:
        """This rank stopped mid-phase (it raised, or a round showed that a peer failed): end
        the phase with every rank, which then all stop."""
        status = ABORTED if peer else FAILED
        if self.phase == "forward":
            self._end_phase(status)
        elif self.phase == "backward":
            self._end_backward(status)
        self.aborted = True

    def skip(self, last: bool) -> None:  # pragma: no cover - stage 3 stops every rank at once
        raise AssertionError("stage 3 stops every rank at a failure")

    def evaluate(self, fn: Callable[..., Any], model: nn.Module, batch: Any) -> Any:
        """`fn`'s result; a tensor in it that is a parameter or a view of one is copied (its
        bucket's memory is released after this step, and reused by the next)."""
        gathered = {flat.untyped_storage()._cdata for flat in self.residency.full}

        def copying(call: Callable[..., Any], micro: Any) -> Any:
            return pytree.tree_map_only(
                Tensor, lambda t: t.detach().clone() if _in_storage(t, gathered) else t,
                fn(call, micro))

        try:  # (copied inside forward: a parameter whose bucket was released gathers again)
            out = self._forward(copying, model.__call__, model, batch)
        except PeerFailed:  # a gather round showed another rank failed (before any sequence)
            self._end_phase(ABORTED)
            out = None
        except CollectiveTimeout:  # a rank is missing: no round can tell the others
            raise
        except BaseException:  # (a KeyboardInterrupt on one rank too: see _run)
            self._end_phase(FAILED)
            raise
        else:
            self._end_phase(DONE)
        if self.aborted:
            raise StepError("another rank failed in this eval step (its own error says why)",
                            step=self.state.step, ranks=sorted(self.residency.failed))
        return out

    def finish(self) -> list[Tensor]:
        return [g for g in (self.state.grads[i] for i in self.state.trainable) if g is not None]

    def close(self) -> None:
        self.hooks.close()
        if self.reused:
            self.completion.stop()
        else:
            self.completion.close()
        self.residency.release_all()
        if self.reducer is not None:
            self.reducer.close()


@contextlib.contextmanager
def _sharded(
    state: ShardState, model: nn.Module, prefetch: int, streams: SideStreams | None, *,
    train: bool, check_writes: bool = False, leaves: _ShardedLeaves | None = None,
) -> Iterator[_ShardedSession]:
    session = _ShardedSession(state, model, prefetch, streams, train, check_writes, leaves)
    try:
        yield session
    finally:
        session.close()


def _streams_of(made: dict[torch.device, Streams | None],
                device: torch.device) -> Streams | None:
    """`device`'s side streams, made once per step function (`made` caches them): a new pair
    each step would cycle through the device's pool of streams, which c10d's NCCL streams are
    taken from too, and sooner or later share one with a collective (false ordering)."""
    if device not in made:
        made[device] = Streams.for_device(device)
    return made[device]


def _check_grad_mode() -> None:
    """A train step differentiates the loss: refuse to start where torch would not record."""
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        raise ValueError(
            "step: called with gradients off (torch.no_grad(), torch.inference_mode() or "
            "torch.set_grad_enabled(False) around it): a train step differentiates the loss; "
            "call it outside such a block (make_eval_step is the step without gradients)"
        )


def _in_storage(t: Tensor, storages: set[int]) -> bool:
    """Whether `t` views one of `storages` (by ``_cdata``); False for a tensor without one."""
    try:
        return t.untyped_storage()._cdata in storages
    except (RuntimeError, NotImplementedError):  # sparse, nested: never a bucket's view
        return False


# --- the phases after backward ----------------------------------------------------------------


def _settings_bits(parts: Mapping[str, str]) -> int:
    """The header's fingerprint of a train step's settings (0: none, the step cannot start)."""
    if not parts:
        return 0
    described = repr(tuple(parts.values()))
    return int(hashlib.blake2b(described.encode(), digest_size=8).hexdigest(), 16) >> 4


def _header(
    state: ShardState, micro_batches: int, *, kind: int, lr: float | None = None,
    settings: int = 0, rows: int = -1,
) -> Header:
    """This rank's header (`lr`, `settings`, `rows`: a train step's learning rate, settings and
    declared rows)."""
    fingerprint = int(state.layout.fingerprint, 16) >> 4  # 60 bits: fits an int64
    buffers = int(buffers_fingerprint(state.buffers), 16) >> 4
    return Header(fingerprint, state.stage, state.step, micro_batches, kind, buffers,
                  float_bits(lr) if lr is not None else 0, settings, state.lineage, rows)


def _mean_loss(run: _Run) -> Tensor:
    """This rank's loss: the mean of its micro-batches' losses, weighted by their shares, times
    the rank's share (so that the ranks' sum over their number is the mean over the rows)."""
    losses = torch.stack(run.losses).double()
    if run.weights is None:
        return losses.mean() * run.share
    shares = run.weights[:len(run.losses)]  # (fewer losses only when the step fails anyway)
    return losses @ torch.tensor(shares, dtype=torch.float64, device=losses.device) * run.share


def _exchange(state: ShardState, run: _Run, control: Comm) -> Any:
    comm = state.config.comm
    own = run.failure
    loss = _mean_loss(run) if run.losses and not own else None
    norm = _squared_norm(run.grads, state) if not (own or run.aborted) else None
    high, low = _fingerprint_halves(state) if not own else (None, None)
    loss_sum, squared_norm, high, low = _on_host(loss, norm, high, low)
    channels = [comm, *([comm.channel(_GATHER)] if state.stage == 3 else [])]
    return exchange_statistics(
        control,
        squared_norm=squared_norm,
        loss_sum=loss_sum,
        rows=run.rows,
        shapes=run.shapes,
        failed=None if own is None else f"{type(own).__name__}: {own}",
        nonfinite=not math.isfinite(loss_sum),
        signatures=[c.signature for c in channels],
        used=run.used,
        fingerprint=(int(high) << 32) | int(low),
    )


def _fingerprint_halves(state: ShardState) -> tuple[Tensor | None, Tensor | None]:
    """`fzero.state.params_fingerprint` as two float64 32-bit halves (exact, for `_on_host`):
    every rank holds the same full parameters at stages 0-2, so after forward they differ
    only where a write that bypasses autograd reached some ranks' copies and not others'."""
    total = params_fingerprint(state)
    if total is None:
        return None, None
    return ((total >> 32) & 0xFFFFFFFF).double(), (total & 0xFFFFFFFF).double()


def _no_path(state: ShardState, counts: Sequence[int] | None) -> ValueError | None:
    """The error when no rank's loss reached any trainable parameter (a loss_fn that does not
    use `call`, or runs under torch.no_grad), or None. A rank whose loss has no gradient path
    while another's has one (a branch its batch turned off) contributes zero gradients, as its
    rows contribute nothing to the gradient of the global batch's loss."""
    if counts is None or not state.trainable or any(count > 0 for count in counts):
        return None
    names = _unused_names(state, [False] * len(counts))
    return ValueError(
        f"the loss has no gradient path to any trainable parameter on any rank; these got no "
        f"gradient: {names[:10]}{' ...' if len(names) > 10 else ''} (does loss_fn use "
        f"`call`, and does it run under torch.no_grad?)")


def _raise_if_failed(state: ShardState, run: _Run, stats: Any, *, declared: bool) -> None:
    """Raise on every rank, before any update, if the step cannot be applied (`declared`: the
    step's ``rows=`` declared the ranks' rows, which weighed their losses: they may differ)."""
    step = state.step + 1
    if stats.failed:
        if run.failure is not None:
            raise run.failure
        details = "; ".join(f"rank {r}: {stats.messages.get(r, '?')}" for r in stats.failed)
        raise StepError(
            f"train step {step} was applied on no rank because rank(s) {list(stats.failed)} "
            f"raised ({details}); this rank's state is unchanged",
            step=step, ranks=stats.failed,
        )
    no_path = _no_path(state, stats.used)
    if no_path is not None:
        raise no_path
    if stats.diverged:
        raise StepError(
            f"train step {step}: after forward and backward the parameters of rank(s) "
            f"{list(stats.diverged)} differ from rank 0's, which every rank holds alike at "
            f"stages 0-2 (compared by a fingerprint of the full parameters): a write that "
            f"bypasses autograd (through .data, e.g. p.data.clamp_(...) depending on the "
            f"batch, in forward, in an eval step run on some ranks, or between steps) reached "
            f"some ranks' copies only. Applied, the update would keep only each part's owner's "
            f"values (stages 1-2, trainable parameters) or let each rank train on its own "
            f"values (stage 0, and frozen parameters, which no update rewrites), silently. "
            f"A value each rank should keep for itself belongs in a buffer (with "
            f"buffers='local'), not a parameter. The step "
            f"was applied on no rank; the written copies still hold the write: make such "
            f"writes the same on every rank (or drop them) and rebuild the state (a checkpoint, "
            f"fzero.init)",
            step=step, ranks=list(stats.diverged),
        )
    if stats.mismatched:
        raise StepError(
            f"train step {step}: rank(s) {list(stats.mismatched)} issued a different sequence of "
            f"collectives than rank 0, so gradients of different buckets may have been mixed; "
            f"the step was applied on no rank (state unchanged). This is a bug in fzero or a "
            f"collective issued on fzero's comm from rank-dependent code: please report it",
            step=step, ranks=stats.mismatched,
        )
    world = state.config.comm.world_size
    rows, shapes = stats.rows, stats.shapes
    if declared or len(set(rows)) == 1 and rows[0] >= 0 or len(set(shapes)) == 1:
        return  # weighed by their declared rows, or as many rows everywhere: by the rows the
        # batches tell, or by their tensors' dim-0 sizes place by place (where the rows'
        # count differs then, ties were broken by lengths that differ between ranks: a review)
    if min(rows) >= 0:
        raise StepError(
            f"train step {step}: ranks were given batches of different sizes (rows per rank "
            f"{list(rows)}): give every rank the same number of rows, so that averaging "
            f"gradients over the {world} ranks equals the global batch's mean, or declare "
            f"them (make_train_step(..., rows=lambda batch: ...)) to weigh each rank by its "
            f"rows",
            step=step, ranks=[r for r, n in enumerate(rows) if n != rows[0]],
        )
    unclear = [r for r, n in enumerate(rows) if n < 0]
    raise StepError(
        f"train step {step}: the batches of rank(s) {unclear} do not tell their rows (see "
        f"fzero.MicroBatches: sizes along dim 0 equally common among a micro-batch's tensors, "
        f"such as (ids (B, T), mask (1, 1, T, T)), or a size that is also a length, such as "
        f"rotary tables (T, D) beside ids (B, T)), and the ranks' tensors differ in size "
        f"along dim 0: nothing shows that every rank has as many rows, which averaging "
        f"gradients over the {world} ranks needs to equal the global batch's mean. Give every "
        f"rank as many rows; where they have, keep the tensors that are not one per row out of "
        f"the batch (close over them in loss_fn), or give them a leading dim of 1 "
        f"(positions[None]) where their length differs between ranks; or declare the rows "
        f"(make_train_step(..., rows=lambda batch: ...))",
        step=step, ranks=unclear,
    )


def _check_skip(state: ShardState, stats: Any, control: Comm, max_skipped: int) -> None:
    """A step is being skipped (non-finite gradients): raise when skipping cannot help."""
    step = state.step + 1
    ranks = f"rank(s) {list(stats.nonfinite)} had a non-finite loss" if stats.nonfinite else (
        "every rank's loss was finite: the gradients overflowed")
    flag = torch.tensor([float(_parameters_not_finite(state))], dtype=torch.float64)
    control.all_reduce(flag, op="max", label="of whether the parameters are finite")
    if flag.item():
        names = _nonfinite_parameters(state)
        raise StepError(
            f"train step {step}: the parameters themselves hold NaN or infinite values "
            f"({names[:8] or 'on another rank'}); every step would now be skipped. Load a good "
            f"checkpoint; the step was not applied ({ranks})",
            step=step, ranks=list(stats.nonfinite),
        )
    scale = state.loss_scale
    if scale is not None and scale.at_floor:
        raise StepError(
            f"train step {step}: gradients are not finite although the fp16 loss scale is at "
            f"its floor {scale.floor:g} ({ranks}); loss scaling cannot help any more: the model "
            f"diverged or the data holds NaN or infinity. The step was not applied",
            step=step, ranks=list(stats.nonfinite),
        )
    if state.skipped + 1 >= max_skipped:
        raise StepError(
            f"train step {step}: {state.skipped + 1} steps in a row were skipped for non-finite "
            f"gradients (max_skipped={max_skipped}; {ranks} at this step); training is not "
            f"making progress. The step was not applied",
            step=step, ranks=list(stats.nonfinite),
        )


def _parameters_not_finite(state: ShardState) -> bool:
    return not all(all_finite(p) for p in state.params)


def _nonfinite_parameters(state: ShardState) -> list[str]:
    """Names of parameters with a non-finite value in this rank's part of them."""
    names = []
    for flat, bucket in zip(state.params, state.layout.buckets, strict=True):
        if all_finite(flat):
            continue
        if state.stage < 3:
            views = zip(bucket.entries, entry_views(flat, bucket), strict=True)
            names += [e.name for e, view in views if not all_finite(view)]
        else:
            names += [seg.entry.name for seg in bucket.segments(state.rank)
                      if not all_finite(flat[seg.shard_start : seg.shard_end])]
    return names


def _squared_norm(grads: Sequence[Tensor], state: ShardState) -> Tensor | None:
    """This rank's share of the global squared gradient norm (float64, on the grads' device;
    None for no share)."""
    if not grads or (state.stage == 0 and state.rank != 0):  # stage 0: identical on all ranks
        return None
    master = state.config.master_dtype
    grads = [g if g.dtype == master else g.to(master) for g in grads]
    if grads[0].device.type != "cpu":  # CUDA's kernel is accurate at any length (1e-8 at
        norms = torch.stack(torch._foreach_norm(grads))  # 16.7M elements): one launch
    else:
        norms = torch.cat([_row_norms(g.reshape(-1)) for g in grads])
    return norms.to(torch.float64).pow(2).sum()


_NORM_ROW = 1 << 12
"""Elements per partial norm on the CPU (`_row_norms`)."""


def _row_norms(flat: Tensor) -> Tensor:
    """Norms of `flat`'s consecutive rows of `_NORM_ROW` elements (and of the rest), whose
    float64 sum of squares is its squared norm. Torch's CPU float32 norm of a whole bucket
    loses accuracy in proportion to its length (1e-4 relative at 2M elements, where torch's
    per-parameter ``clip_grad_norm_`` is 1e-6 off): the clip coefficient drifted training off
    torch's. Rows keep each partial sum short, with no temporary the size of the bucket."""
    whole = flat.numel() - flat.numel() % _NORM_ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_ROW), dim=1)
    rest = torch.linalg.vector_norm(flat[whole:]).reshape(1)
    return torch.cat([rows, rest])


def _on_host(*values: Tensor | None) -> list[float]:
    """Float64 scalars (None: 0.0) as Python floats, in one device-to-host copy: each copy
    waits for the device, and the step needs the loss and the norm at the same point."""
    present = [v for v in values if v is not None]
    if not present:
        return [0.0] * len(values)
    device = present[0].device
    copied = iter(torch.stack([v.to(device) for v in present]).tolist())
    return [next(copied) if v is not None else 0.0 for v in values]


def _unscale(grads: list[Tensor], state: ShardState) -> None:
    master = state.config.master_dtype
    for i, grad in enumerate(grads):
        if grad.dtype != master:
            grads[i] = grad.to(master)
    if state.loss_scale is not None and state.loss_scale.scale != 1.0:
        torch._foreach_mul_(grads, 1.0 / state.loss_scale.scale)


def _clip(grads: list[Tensor], grad_norm: float, clip_norm: float | None) -> None:
    """Scale by torch.nn.utils.clip_grad_norm_'s coefficient, computed in the gradients'
    dtype as torch does (a float32 coefficient would differ from float64 torch by ~1e-11)."""
    if clip_norm is not None and grads:
        norm = torch.tensor(grad_norm, dtype=grads[0].dtype)
        torch._foreach_mul_(grads, clip_coefficient(norm, clip_norm))


def _used_globally(counts: Sequence[int] | None, mine: Sequence[bool]) -> list[bool]:
    return [True] * len(mine) if counts is None else [c > 0 for c in counts]


def _update(
    state: ShardState,
    grads: list[Tensor],
    used: list[bool],
    decay: Callable[[str, tuple[int, ...]], bool] | None,
    lr: float,
    plans: dict[tuple[str, int, int], Any],
) -> tuple[int, ...] | None:
    """The optimizer step on this rank's master shards; returns the new `param_steps`."""
    key = (state.layout.fingerprint, state.stage, state.rank)
    if key not in plans:
        spans = entry_spans(state.layout, state.stage, state.rank)
        plans[key] = (spans, decay_ranges(spans, len(state.trainable), decay))
    spans, ranges = plans[key]
    steps = list(state.param_steps) if state.param_steps is not None else [state.step] * len(used)
    after = apply_update(
        state.config.optimizer, grads,
        {name: tuple(trainable_only(values)) for name, values in state.moments.items()},
        trainable_only(state.master), spans=spans, decay=decay, ranges=ranges, steps=steps,
        used=used, lr=lr,
    )
    return None if all(s == state.step + 1 for s in after) else tuple(after)


def _publish(state: ShardState, streams: SideStreams | None) -> None:
    """Make the compute-dtype parameters reflect the updated master copy."""
    comm = state.config.comm
    pending: list[Pending] = []
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
        if separate:
            shard = master.to(params.dtype)
        else:  # the rank's chunk of params is its updated shard: gather in place if we may
            shard = shard_view(params, bucket, state.rank)
            shard = shard if comm.in_place else shard.clone()
        if len(pending) == PUBLISH_IN_FLIGHT:
            _wait_first(pending)
        pending.append(all_gather_bucket(comm, bucket, shard, out=params, streams=streams))
    while pending:
        _wait_first(pending)


def _wait_first(pending: list[Pending]) -> None:
    """Wait for the first of `pending` and drop it; if that raises, wait for the rest too
    (they are issued: a failure of theirs must not go unseen, SimWorld reports a work never
    waited for) and raise the first error. After a timeout the comm is given up (`Comm`:
    it refuses every later collective), and so are the rest: waiting for them would take
    another timeout."""
    try:
        pending.pop(0).wait()
    except CollectiveTimeout:
        raise
    except BaseException:
        while pending:
            with contextlib.suppress(Exception):
                pending.pop(0).wait()
        raise


# --- small helpers ----------------------------------------------------------------------------


def _bindings(
    state: ShardState, leaves: Sequence[Sequence[Tensor]], buffers: Mapping[str, Tensor],
    parameters: Mapping[str, Tensor],
) -> dict[str, Tensor]:
    """Every parameter name, aliases included, to its leaf, which takes the Python attributes
    of the module's parameter of that name (`parameters`: `carry_attributes`); and the
    buffers."""
    named: dict[str, Tensor] = {}
    for bucket, bucket_leaves in zip(state.layout.buckets, leaves, strict=True):
        for entry, leaf in zip(bucket.entries, bucket_leaves, strict=True):
            for name in entry.names:
                named[name] = leaf
    named.update(buffers)
    for alias, name in state.config.buffer_aliases:  # one tensor in two submodules
        named[alias] = buffers[name]
    carry_attributes(named, parameters)
    return named


def _broadcast_buffers(
    comm: Comm, buffers: Mapping[str, Tensor], gate: Callable[[], None]
) -> None:
    """Rank 0's buffers onto every rank, as one broadcast of their bytes (after `gate()`)."""
    if comm.world_size == 1 or not buffers:
        return
    tensors = [b for b in buffers.values() if b.numel()]
    if not tensors:
        return
    gate()
    parts = [b.detach().reshape(-1).contiguous().view(torch.uint8) for b in tensors]
    flat = torch.cat(parts)  # (total bytes,)
    comm.broadcast(flat, src=0, label="of rank 0's buffers")
    offset = 0
    with torch.no_grad():
        for tensor, part in zip(tensors, parts, strict=True):
            size = part.numel()
            if tensor.is_contiguous():
                tensor.view(-1).view(torch.uint8).copy_(flat[offset : offset + size])
            else:
                tensor.copy_(flat[offset : offset + size].clone().view(tensor.dtype)
                             .view(tensor.shape))
            offset += size


def _counts(comm: Comm, before: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes sent per kind on the data channels (main and stage 3's gathers)."""
    totals = dict(comm.counters.bytes_sent)
    if _GATHER in getattr(comm, "_channels", {}):
        for kind, value in comm.channel(_GATHER).counters.bytes_sent.items():
            totals[kind] += value
    if before is None:
        return totals
    return {kind: totals[kind] - before[kind] for kind in totals}


def _unused_names(state: ShardState, used: Sequence[bool]) -> list[str]:
    names = [e.name for b in state.layout.buckets if b.trainable for e in b.entries]
    return [name for name, flag in zip(names, used, strict=True) if not flag]


class _Call:
    """The ``call`` a train step's loss_fn gets: the module's forward, noting whether an output
    required grad (`graphed`), so that a loss cut from the graph is told apart from a loss
    whose rank's batch took no path through the trainable parameters (`_check_loss`)."""

    __slots__ = ("forward", "graphed")

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward
        self.graphed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.forward(*args, **kwargs)
        if not self.graphed and torch.is_grad_enabled():
            self.graphed = _requires_grad_anywhere(out)
        return out

    def __getattr__(self, name: str) -> Any:
        """The bound forward's own attributes (``call.__self__``: the module)."""
        return getattr(object.__getattribute__(self, "forward"), name)


@unguarded  # (under stage 3's guard each ``.requires_grad`` is a Python round trip)
def _requires_grad_anywhere(out: Any, depth: int = 0) -> bool:
    """Whether a tensor in `out` requires grad: its pytree leaves, and the fields of a leaf
    that is a dataclass or a `torch.distributions.Distribution` (which torch's pytree takes
    whole; a few levels deep)."""
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, Tensor):
            if leaf.requires_grad:
                return True
        elif depth < 4 and _requires_grad_anywhere(_fields(leaf), depth + 1):
            return True
    return False


def _fields(value: Any) -> list[Any]:
    """The values of a dataclass instance's fields or a distribution's attributes (an output
    whose tensors torch's pytree does not see); nothing for anything else."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, field.name, None) for field in dataclasses.fields(value)]
    if isinstance(value, torch.distributions.Distribution):
        return list(vars(value).values())
    return []


def _check_loss(loss: Any, call: _Call) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = f"shape {tuple(loss.shape)} dtype {loss.dtype}" if isinstance(loss, Tensor) else (
            type(loss).__name__)
        raise ValueError(f"loss_fn must return a scalar floating-point tensor, got {got}")
    if call.graphed and loss.grad_fn is None:  # (also a new leaf that requires grad:
        # ``torch.tensor(loss.item(), requires_grad=True)`` is cut from the graph too)
        raise ValueError(
            "loss_fn's loss does not require grad, but the model's output did: the loss was cut "
            "from the graph (.detach(), .item(), torch.tensor(...), or computed under "
            "torch.no_grad), and this rank's rows would add no gradient (torch raises in "
            "backward here). Return the loss computed from `call`'s output; a batch that should "
            "add nothing can return 0 * output.sum()")


def _check_model(
    model: nn.Module, state: ShardState, *,
    requires_grad: Sequence[tuple[str, bool]] | None = None, train: bool = False,
) -> dict[str, Tensor]:
    """Raise if `model` is not the one `state` was built for (parameters, ties, buffers; and
    given `requires_grad`, the flags it was built with; for a train step, no gradient hooks on
    its parameters). Returns its parameters by name (`check_structure`)."""
    named = check_structure(model, state.layout, requires_grad=requires_grad, train=train)
    check_buffers(model, state.buffers, state.config.buffer_aliases)
    _check_module_writes(model, state)
    return named


def _check_module_writes(model: nn.Module, state: ShardState) -> None:
    """Raise if the module's own tensors were converted or moved since the state was built (to
    other than the state's own dtype and device), or written in place or given new data that
    differ from the state's values (`fzero.bound.ModuleVersions`): a step would ignore them.
    Values equal to the state's (its parameters exported into the module) are accepted.
    Stage 3 compares this rank's shard only; a rank that sees a difference raises, and the step
    header makes every rank raise with it."""
    versions = state.config.module_versions
    if versions is None:
        return
    written = {**versions.unverified(model), **versions.written(model)}
    if not written:
        versions.verified()
        return
    located = state.layout.locate()
    owner = dict(state.config.buffer_aliases)
    converted = {}
    for name, tensor in written.items():
        now, before = (tensor.dtype, tensor.device), versions.kind(name)
        if now not in (before, _state_kind(state, owner.get(name, name), located)):
            converted[name] = f"{before[0]} on {before[1]} -> {now[0]} on {now[1]}"
    if converted:
        raise ValueError(
            f"the module's own tensors were converted or moved after the state was built, "
            f"{len(converted)} of them, {dict(sorted(converted.items())[:5])} "
            f"(model.to(dtype), model.half(), model.cuda(), ...). A step computes with the "
            f"state's tensors, in the dtypes and on the device they were built with "
            f"(fzero.init's param_dtype, master_dtype, device), and never reads the module's "
            f"tensors again: convert or move the model "
            f"before fzero.init, or pass the dtypes and device to it"
        )
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in written.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    differ = []
    for names in by_tensor.values():
        tensor = written[names[0]]
        known = [n for n in (owner.get(n, n) for n in names) if n in located or n in state.buffers]
        if not known or not _holds_state_values(state, known[0], tensor.detach()):
            differ += names
    if differ:
        moved = sorted(n for n in differ
                       if (written[n].dtype, written[n].device) != versions.kind(n))
        # fzero.init gives every rank rank 0's values: another rank's module held its own
        # values from the start, so a conversion alone leaves them other than the state's
        converted_here = (
            f" On this rank ({state.rank}) the module's tensors {moved[:5]} were also "
            f"converted or moved (model.to(...), model.cuda()) after fzero.init, which alone "
            f"gives this message when the module's own values were never rank 0's: the "
            f"state took rank 0's values at init. Convert or move the module before "
            f"fzero.init, build it from the same seed on every rank, or move it to 'meta' "
            f"after init (a step never reads it)." if moved and state.rank != 0 else "")
        raise ValueError(
            f"the module's own tensors {sorted(differ)[:5]} were written in place after the "
            f"state was built (model.load_state_dict(...), a copy_ under no_grad, a write "
            f"through .data) and now hold other values than the state's. A step trains the "
            f"state's tensors and never reads the module's values again, so these would be "
            f"silently ignored. If you meant to train from them, build the state again "
            f"from the module (fzero.init) or load them into it (fzero.init(..., load=), a "
            f"checkpoint). If they are another state's values (an EMA or snapshot evaluated "
            f"in plain torch, a second seed initialized in place), keep this state's module "
            f"apart: give that state or evaluation a module of its own "
            f"(copy.deepcopy(model)), or copy this state's values back into the module "
            f"(load_state_dict(fzero.full_params(state)), which is accepted) before its "
            f"next step. To read the state's values, use fzero.full_params(state)."
            f"{converted_here}"
        )
    versions.accept(written)
    versions.verified()


def _state_kind(state: ShardState, name: str, located: Mapping[str, tuple[int, Any]]
                ) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device in which the state holds parameter or buffer `name` (None: it
    holds none)."""
    held = (state.buffers.get(name) if name in state.buffers
            else state.params[located[name][0]] if name in located else None)
    return None if held is None else (held.dtype, held.device)


def _holds_state_values(state: ShardState, name: str, tensor: Tensor) -> bool:
    """Whether the module's `tensor` (parameter or buffer `name`) holds the state's values, in
    the state's dtype (stage 3: in this rank's shard)."""
    if name in state.buffers:
        return same_values(tensor, state.buffers[name])
    index, entry = state.layout.locate()[name]
    flat = state.params[index]
    if state.stage < 3:
        return same_values(tensor, flat[entry.offset : entry.end].view(entry.shape))
    values = tensor.reshape(-1)
    return all(
        same_values(values[seg.entry_start : seg.entry_start + seg.shard_end - seg.shard_start],
                    flat[seg.shard_start : seg.shard_end])
        for seg in state.layout.buckets[index].segments(state.rank) if seg.entry == entry)


def _versions(leaves: Sequence[Sequence[Tensor]]) -> list[list[int]]:
    """Each leaf's version counter (bumped by any in-place write to it)."""
    return [[leaf._version for leaf in bucket_leaves] for bucket_leaves in leaves]


def _check_unmodified(
    leaves: Sequence[Sequence[Tensor]], versions: Sequence[Sequence[int]], state: ShardState
) -> None:
    """Raise if the forward wrote a parameter in place (``nn.Embedding(max_norm=...)``, a
    ``clamp_`` under ``no_grad``): each rank changes only its own copy of the rows it touched,
    which a sharded state cannot keep (stage 3 drops the gathered copy; stages 1-2 publish the
    owner's shard over it; plain DDP lets the replicas drift apart)."""
    changed = [entry.name
               for bucket, bucket_leaves, before in zip(state.layout.buckets, leaves, versions,
                                                        strict=True)
               for entry, leaf, version in zip(bucket.entries, bucket_leaves, before,
                                               strict=True)
               if leaf._version != version]
    if changed:
        held = (" This rank's state already holds the change (below stage 3 the forward reads "
                "the state's own tensors): rebuild it (a checkpoint, or fzero.init) before "
                "training on." if state.stage < 3 else "")
        raise ValueError(
            f"the forward modified parameter(s) {changed[:5]} in place (e.g. "
            f"nn.Embedding(max_norm=...), or an in-place op under torch.no_grad): each rank "
            f"would change only its own copy, which sharded training cannot keep consistent "
            f"with single-process torch. Compute the constrained value out of place instead "
            f"(e.g. with torch.nn.utils.parametrize).{held}"
        )


def _rows(micro_batches: Sequence[Any]) -> int | None:
    """The rows of a rank's micro-batches; None when a micro-batch cannot tell
    (`_micro_rows`)."""
    rows = 0
    for micro in micro_batches:
        size = _micro_rows(micro)
        if size is None:
            return None
        rows += size
    return rows


def _micro_rows(micro: Any) -> int | None:
    """A micro-batch's rows, or None where its tensors do not tell (`_rows_of`), or where it
    nests a list of entries with tensors, which may be one per row (`_listed`)."""
    if _listed(micro, None) is not None:
        return None
    return _rows_of([t for t in _batch_tensors(micro) if t.dim()])


def _rows_of(tensors: Sequence[Tensor]) -> int | None:
    """The rows of tensors of a dimension: the size along dim 0 that most of them share, so
    that a tensor that is not one row per sample (position ids of shape (1, T) beside two
    (B, T) tensors) does not decide; 1 for no tensor. A size that is a later dim of a tensor
    of another size along dim 0 is a length (T in ``(ids (B, T), positions (T,))``), not rows:
    between equally common sizes it loses to one that is not (``(ids (1, T), positions
    (T,))``: 1). None where that leaves a doubt, for the ranks to compare their tensors'
    sizes instead (`_shape_digest`): two sizes equally common that no length tells apart
    (``(ids (B, T), mask (1, 1, T, T))``, B or 1), a most common size that is a length
    (rotary tables ``(T, D)`` twice beside ids ``(B, T)``), or one that is also a later dim of
    a tensor of its own size along dim 0 (``ids (T, T)`` beside ``positions (1, T)``: B = T).
    (The larger of equally common sizes counted T rows for ``(ids (B, T), positions (T,))``,
    the most common counted the rotary tables' T, and a length rule without these doubts
    counted 1 row where B equalled T: probes and a review.)"""
    if not tensors:
        return 1
    counts = collections.Counter(t.shape[0] for t in tensors)
    later: dict[int, set[int]] = {}  # size -> the sizes along dim 0 of tensors with it later
    for tensor in tensors:
        for size in tensor.shape[1:]:
            later.setdefault(size, set()).add(tensor.shape[0])

    def length(size: int) -> bool:
        return bool(later.get(size, set()) - {size})

    def doubtful(size: int) -> bool:  # a length, but also a later dim of a tensor of its own
        return length(size) and size in later[size]  # size along dim 0 (ids (T, T): B = T)

    most = max(counts.values())
    tied = [size for size, n in counts.items() if n == most]
    kept = tied if len(tied) == 1 else [size for size in tied if not length(size)]
    if len(kept) != 1 or length(kept[0]) or any(doubtful(size) for size in tied):
        return None
    return kept[0]


def _shape_digest(micro_batches: Sequence[Any]) -> int:
    """A 50-bit digest (exact in the float64 the statistics travel in) of the places and sizes
    along dim 0 of a rank's micro-batches' tensors (`_dim0_signature`): ranks whose digests
    are equal have as many rows whatever their rows are, as long as rows lie along dim 0."""
    sizes = repr([_dim0_signature(micro) for micro in micro_batches]).encode()
    return int.from_bytes(hashlib.sha256(sizes).digest()[:8], "big") >> 14


def _dim0_signature(micro: Any) -> list[tuple[str, int]]:
    """Each tensor's place in a micro-batch and size along dim 0, in order of place: equal for
    micro-batches whose tensors in the same places have the same sizes, whatever order a
    dict's keys come in (the sizes alone in pytree order told two equal dicts apart, in order
    of size made (ids (2, 4), positions (4,)) equal to (ids (4, 2), positions (2,)): a review
    and a probe)."""
    return sorted((where, t.shape[0]) for where, t in _placed_tensors(micro) if t.dim())


def _dim0_sizes(micro: Any) -> list[int]:
    """The sizes along dim 0 of a micro-batch's tensors of a dimension, in pytree order."""
    return [t.shape[0] for t in _batch_tensors(micro) if t.dim()]


def _batch_tensors(batch: Any) -> list[Tensor]:
    """Every tensor in `batch` (`_placed_tensors`, without their places)."""
    return [tensor for _, tensor in _placed_tensors(batch, places=False)]


def _placed_tensors(batch: Any, depth: int = 0, *, places: bool = True
                    ) -> list[tuple[str, Tensor]]:
    """Every tensor in `batch` with its place (a pytree path; a leaf's index for a pytree type
    registered without key paths; "" without `places`, which the row count does not need):
    its pytree leaves, and the values of what pytree takes for single leaves: mappings
    (Hugging Face's ``BatchEncoding``, what tokenizers and collators return, is a
    ``UserDict``) and dataclass instances (their fields: a batch of one counted one row on
    every rank, a probe), 4 levels deep."""
    paths = None
    if places:
        try:
            flat = pytree.tree_flatten_with_path(batch)[0]
            paths, values = [path for path, _ in flat], [leaf for _, leaf in flat]
        except ValueError:  # (a node type registered without flatten_with_keys_fn)
            values = pytree.tree_leaves(batch)
    else:
        values = pytree.tree_leaves(batch)
    found: list[tuple[str, Tensor]] = []
    for index, leaf in enumerate(values):
        if not isinstance(leaf, Tensor | Mapping) and not (
                dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)):
            continue
        where = ("" if not places else pytree.keystr(paths[index]) if paths is not None
                 else f"<{index}>")
        if isinstance(leaf, Tensor):
            found.append((where, leaf))
            continue
        if depth >= 4:
            continue
        inner = dict(leaf) if isinstance(leaf, Mapping) else {
            f.name: getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)}
        found += [(where + w, t) for w, t in _placed_tensors(inner, depth + 1, places=places)]
    return found


def _schedule_lr(lr: float | Schedule | None, step: int) -> float | None:
    """The learning rate `lr` gives step `step` (None: none given).

    Raises:
        ValueError: the schedule raised, or gave something that is not a number, or a number
            that is not finite and >= 0 (checked here, among the step's checks: the
            optimizer would refuse it only once the step has begun its update).
    """
    if lr is None:
        return None
    try:
        value = float(lr(step)) if callable(lr) else float(lr)
    except Exception as exc:  # on this rank only, maybe: the step header reports it to all
        raise ValueError(f"the learning rate for step {step} could not be computed: "
                         f"{type(exc).__name__}: {exc}") from exc
    if not (math.isfinite(value) and value >= 0.0):
        where = f" (the schedule's value for step {step})" if callable(lr) else ""
        raise ValueError(f"lr must be a finite number >= 0.0, got lr={value!r}{where}")
    return value
