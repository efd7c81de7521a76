"""Gradient buckets: when a bucket's gradient is complete, and its reduction in a fixed order.

[Note: one leaf per parameter]
The parameters handed to the model are one autograd leaf per parameter, aliasing the bucket's
flat storage (`fzero.flat.alias_leaves`). With views of a single flat leaf instead, autograd
runs the view nodes last and every bucket's gradient stays alive until the end of backward;
with one leaf each, a parameter's AccumulateGrad runs as soon as its gradient is ready, so a
bucket is complete when every one of its leaves has fired its post-accumulate-grad hook.

[Note: late gradients]
Within one backward pass autograd accumulates each leaf once. Reentrant activation
checkpointing (``use_reentrant=True``) runs nested backward passes, so a parameter used in two
checkpointed regions (or in one and outside) accumulates twice. If its bucket was already
being reduced, the second part would be lost: `Completion` raises instead, naming the
parameter (non-reentrant checkpointing has a single backward pass and no such limit).

A gradient can reach a parameter only in the step's own backward (`Completion.in_backward`):
one accumulated before it, by a backward pass the user's code ran inside ``loss_fn``
(``loss.backward()``), would start reductions in the middle of forward, out of the agreed
order, and raises instead (``torch.autograd.grad`` accumulates nothing and is fine).

The reductions themselves always run in `fzero.schedule.reduce_order` on every rank (see
`[Note: one collective sequence per channel]` there).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from typing import NamedTuple

import torch
from torch import Tensor

from fzero.collect import (
    Pending,
    SideStreams,
    bucket_label,
    launch,
    predivided,
    reduce_scatter_bucket,
)
from fzero.comm import Comm
from fzero.flat import shard_view
from fzero.layout import ShardLayout

__all__ = ["Completion", "Reducer", "LATE_GRADIENT_HELP", "OUTSIDE_BACKWARD_HELP",
           "OUTSIDE_STEP_HELP", "holds_completion_hooks"]

LATE_GRADIENT_HELP = (
    "parameter {name!r} accumulated a gradient after its bucket {label!r} was already being "
    "reduced: autograd ran more than one backward pass over it, which happens when it is used "
    "in several regions checkpointed with torch.utils.checkpoint(..., use_reentrant=True) (or "
    "in one such region and outside it). Use use_reentrant=False (one backward pass; Hugging "
    "Face: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    "{{'use_reentrant': False}})), or keep the parameter out of reentrant regions."
)

OUTSIDE_BACKWARD_HELP = (
    "parameter {name!r} received a gradient outside the step's backward: loss_fn (or the "
    "model's forward) ran a backward pass itself (loss.backward(), torch.autograd.backward) "
    "over the model's parameters. A train step differentiates the loss loss_fn returns, once, "
    "and reduces the gradients as its backward produces them: return the loss instead (for "
    "several losses, their sum). torch.autograd.grad (a gradient penalty with "
    "create_graph=True) accumulates nothing into parameters and is fine."
)

OUTSIDE_STEP_HELP = (
    "a backward pass outside a train step reached parameter {name!r}: fzero computes "
    "gradients inside step(state, batch) only (a graph kept from a step's forward cannot be "
    "backpropagated later; its gradients would be lost)"
)


def holds_completion_hooks(tensor: Tensor) -> bool:
    """Whether `tensor` is a leaf a step binds in a parameter's place (it carries `Completion`'s
    hooks): found in a module outside a step, a step on it was interrupted while binding."""
    return any(getattr(hook, "completes_a_bucket", False)
               for hook in (tensor._post_accumulate_grad_hooks or {}).values())


class Completion:
    """Watches the leaves of every trainable bucket during backward.

    Calls ``on_complete(b)`` once per backward when every leaf of trainable bucket b has
    accumulated its gradient (while `armed`), records which entries received a gradient at all
    in the step (`used`), and raises on a late gradient (see the module note).

    A leaf reached by autograd with no gradient (a custom ``Function`` or a reentrant
    checkpoint returning None for it) completes its part of the bucket but is not used: torch
    leaves its ``.grad`` None and ``torch.optim`` skips it (no decay, no momentum, no step).
    The post-accumulate-grad hook fires either way, and at stages 0-1 ``.grad`` is bound to
    the flat buffer before backward, so a tensor hook, which sees the incoming gradient, tells.
    """

    def __init__(
        self,
        layout: ShardLayout,
        leaves: Sequence[Sequence[Tensor]],
        on_complete: Callable[[int], None],
    ) -> None:
        self.layout = layout
        self.on_complete = on_complete
        self.armed = True
        self.in_backward = False  # set by the step around its own backward pass
        self.fired = [[False] * len(bucket_leaves) for bucket_leaves in leaves]
        self.ready = [0] * len(layout.buckets)
        self.completed = [False] * len(layout.buckets)
        self.used = [[False] * len(bucket_leaves) for bucket_leaves in leaves]
        watched = [(index, position, leaf) for index, bucket in enumerate(layout.buckets)
                   if bucket.trainable for position, leaf in enumerate(leaves[index])]
        self.handles = [
            *(leaf.register_hook(self._arrival(index, position))
              for index, position, leaf in watched),
            *(leaf.register_post_accumulate_grad_hook(self._hook(index, position))
              for index, position, leaf in watched),
        ]

    def _arrival(self, index: int, position: int) -> Callable[[Tensor | None], None]:
        def on_gradient(grad: Tensor | None) -> None:
            if grad is not None:
                self.used[index][position] = True

        return on_gradient

    def _hook(self, index: int, position: int) -> Callable[[Tensor], None]:
        def on_ready(_: Tensor) -> None:
            if not self.in_backward:
                name = self.layout.buckets[index].entries[position].name
                if self.on_complete is _stopped:
                    raise RuntimeError(OUTSIDE_STEP_HELP.format(name=name))
                raise RuntimeError(OUTSIDE_BACKWARD_HELP.format(name=name))
            if self.completed[index]:
                bucket = self.layout.buckets[index]
                raise RuntimeError(LATE_GRADIENT_HELP.format(
                    name=bucket.entries[position].name, label=bucket.label))
            if self.fired[index][position]:
                return
            self.fired[index][position] = True
            self.ready[index] += 1
            if self.armed and self.ready[index] == len(self.fired[index]):
                self.completed[index] = True
                self.on_complete(index)

        on_ready.completes_a_bucket = True  # type: ignore[attr-defined]  # holds_completion_hooks
        return on_ready

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around the step's own backward pass, the only one where gradients may arrive."""
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = False

    def force(self, index: int) -> None:
        """Complete bucket `index` now: this rank knows none of its leaves can get a gradient in
        this backward (a gradient arriving anyway raises, as a late one does)."""
        if not self.completed[index]:
            self.completed[index] = True
            self.on_complete(index)

    def reset(self) -> None:
        """Forget which leaves fired (before the next backward); `used` stays for the step."""
        for flags in self.fired:
            flags[:] = [False] * len(flags)
        self.ready = [0] * len(self.ready)
        self.completed = [False] * len(self.completed)

    def restart(self, on_complete: Callable[[int], None]) -> None:
        """Watch the same leaves for another step, completing buckets through `on_complete`:
        nothing fired, nothing used yet."""
        self.reset()
        self.used = [[False] * len(flags) for flags in self.fired]
        self.armed = True
        self.on_complete = on_complete

    def stop(self) -> None:
        """Keep the hooks but drop `on_complete` (often a method of the owner, which holds this:
        a reference cycle only the garbage collector would free, every step); a bucket that
        gets a gradient before `restart` (a backward pass outside a step) raises."""
        self.armed = True
        self.on_complete = _stopped

    def close(self) -> None:
        """Remove the hooks, and `stop`."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.stop()


def _stopped(index: int) -> None:
    """`on_complete` between steps: never called (a gradient arriving then raises first)."""


class Reducer:
    """Reduces every trainable bucket's gradient once per round, in a fixed order.

    Modes, by stage:

    - ``"all_reduce"`` (stage 0) and ``"scatter_full"`` (stage 1): ``grads[b]`` is the full
      gradient buffer the leaves accumulate into (their ``.grad`` are views of it); once per
      step (the last micro-batch) each is all-reduced (averaged) or reduce-scattered to this
      rank's shard.
    - ``"scatter_leaves"`` (stages 2 and 3): once per micro-batch each bucket's leaf gradients
      are copied into one flat padded buffer (a leaf without gradient contributes zeros), the
      leaves' ``.grad`` freed, and the buffer reduce-scattered (averaged); the result is copied
      into ``grads[b]``, this rank's gradient shard, by the Reducer's first round and added by
      later ones (micro-batches), so the shards need no zeroing first.

        `complete(b)` marks a bucket ready; buckets are launched strictly in `order`, as soon as
    every bucket before them is. `launch_rest` launches what is left (a bucket some leaf never
    completed, or everything, with zeros, when the rank's own computation failed), `finish`
    waits for all.

    [Note: waiting inside backward]
    To keep one bucket's flat gradient alive at a time, ``"scatter_leaves"`` settles the
    previous reduction before it copies the next bucket; ``"scatter_full"`` does too, so that a
    transport's scratch (gloo's pairwise reduce-scatter receives each peer's chunk into a
    buffer) exists for one bucket at a time, not for every bucket of a slow backward. On one
    channel that cannot deadlock: launches follow one order, so whatever a rank waits for, the
    rank ahead has launched. Stage 3 also gathers on another channel, and a rank whose
    computation differs (a skipped block) may wait there for a rank that waits here: with
    `patience` the wait gives up after four times what the fastest recent reduction took per
    element (times the elements waited for), at most `patience` seconds, and the reduction is
    collected later (`poll`, `finish`), trading memory for progress. Until it is, later launches
    do not wait: on one channel nothing launched after it can finish first, so each such wait
    would give up too (a wait per bucket: 1-2 s per step for a 10-parameter model whose ranks
    exit early at different blocks).

    `gate`, if given, is called before every launch: it raises, and nothing is launched, when
    the step must not communicate (the train step's header, still in flight while the first
    backward runs, disagreed: `fzero.consensus.HeaderRound`).
    """

    def __init__(
        self,
        comm: Comm,
        layout: ShardLayout,
        leaves: Sequence[Sequence[Tensor]],
        grads: Sequence[Tensor | None],
        order: Sequence[int],
        *,
        mode: str,
        reduce_dtype: torch.dtype | None = None,
        streams: SideStreams | None = None,
        patience: float | None = None,
        gate: Callable[[], None] | None = None,
        waiter: ThreadPoolExecutor | None = None,
    ) -> None:
        assert mode in ("all_reduce", "scatter_full", "scatter_leaves"), mode
        self.gate = gate
        self.patience = patience
        # Seconds per element from launch to done of the recent settled reductions (buckets
        # differ in size: a small bucket's time says little of a large one's)
        self.rates: list[float] = []
        # Buckets whose reduction was in flight while a wait gave up: their durations include
        # this rank's stall (and a peer's, waiting for it), so they are not typical.
        self.stalled: set[int] = set()
        # With patience, a thread waits for each reduction on the host (a blocking wait, no
        # polling), so the step can give up waiting without giving up the reduction: `waiter`'s
        # (one thread, kept by the caller from step to step), else one of its own.
        self._own_waiter = waiter is None and patience is not None
        self.waiter = (ThreadPoolExecutor(1, thread_name_prefix="fzero-reduce-wait")
                       if self._own_waiter else waiter if patience is not None else None)
        self.comm = comm
        self.layout = layout
        self.leaves = leaves
        self.grads = grads
        self.order = tuple(order)
        self.mode = mode
        self.reduce_dtype = reduce_dtype
        self.streams = streams
        self.ready = [False] * len(layout.buckets)
        self.next = 0  # position in `order` of the next bucket to launch
        self.pending: list[_Flight] = []
        self.results: dict[int, Tensor] = {}
        # "scatter_leaves": the buckets whose shard holds nothing of this step yet: their first
        # reduction is copied in (no zeroing pass over the shards first), later ones added.
        self.fresh: set[int] = set(self.order) if mode == "scatter_leaves" else set()
        self.spares: list[Tensor] = []  # flat gradient buffers of settled reductions
        self.live_bytes = 0  # flat gradient buffers alive (being reduced)
        self.peak_bytes = 0

    def reorder(self, order: Sequence[int]) -> None:
        """Reduce in `order` from the next round on (every rank alike; none launched yet)."""
        if self.next or self.pending:
            raise RuntimeError("a Reducer's order can change only between rounds")
        if sorted(order) != sorted(self.order):
            raise ValueError(f"a new reduce order must permute the old one, got {tuple(order)}")
        self.order = tuple(order)

    def complete(self, index: int) -> None:
        """Bucket `index`'s gradient is final for this round: launch what the order allows."""
        self.ready[index] = True
        while self.next < len(self.order) and self.ready[self.order[self.next]]:
            self._launch(self.order[self.next], zero=False)
            self.next += 1
        self.poll()

    def launch_rest(self, *, zero: bool = False) -> None:
        """Launch every bucket not yet launched, in order (``zero``: contribute zeros)."""
        while self.next < len(self.order):
            self._launch(self.order[self.next], zero=zero)
            self.next += 1

    def poll(self) -> None:
        """Collect the reductions that have finished, without waiting."""
        still = []
        for flight in self.pending:
            if flight.done():
                self._settle(flight)
            else:
                still.append(flight)
        self.pending = still

    def finish(self) -> list[Tensor]:
        """Wait for every launched reduction; start the next round. Returns, per trainable
        bucket in bucket order, the reduced gradient (stage 0: full; otherwise the shard)."""
        for flight in self.pending:
            self._settle(flight)
        self.pending = []
        for index in sorted(self.fresh):  # not reduced this round: it holds nothing of the step
            grad = self.grads[index]  # (every round launches every bucket: a safety net)
            assert grad is not None
            grad.zero_()
        self.fresh.clear()
        self.stalled.clear()
        self.spares.clear()  # reused within a round only: nothing bucket-sized outlives it
        self.ready = [False] * len(self.ready)
        self.next = 0
        return [self.results.get(i, self.grads[i]) for i in sorted(self.order)]

    def _launch(self, index: int, *, zero: bool) -> None:
        if self.gate is not None:  # raises instead of launching when the step cannot start
            self.gate()
        bucket = self.layout.buckets[index]
        grad = self.grads[index]
        assert grad is not None
        if self.mode == "scatter_leaves":
            self._settle_previous()
            flat = self._scratch(bucket.padded_numel, grad)
            self.live_bytes += flat.numel() * flat.element_size()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            with torch.no_grad():  # one pass: each element is copied or zeroed once
                pieces, sources = [], []
                for entry, leaf in zip(bucket.entries, self.leaves[index], strict=True):
                    grad, leaf.grad = leaf.grad, None
                    piece = flat[entry.offset : entry.end]
                    if grad is None or zero:
                        piece.zero_()
                        continue
                    pieces.append(piece.view(entry.shape))
                    # nn.Embedding(sparse=True): its dense values, as stages 0-1 add them
                    sources.append(grad.to_dense() if grad.is_sparse else grad)
                if pieces:  # one call for the bucket, not a copy (a CUDA launch) per parameter
                    torch._foreach_copy_(pieces, sources)
                flat[bucket.numel :].zero_()  # padding
            out = shard_view(flat, bucket, self.comm.rank) if self.comm.in_place else None
            self._fly(index, reduce_scatter_bucket(self.comm, bucket, flat, out=out,
                                                   streams=self.streams), scratch=flat)
            return
        if zero:
            grad.zero_()
        if self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        if self.mode == "scatter_full":  # the rank's chunk of the full gradient holds its shard
            self._settle_previous()  # the transport's receive buffers: one bucket's at a time
            out = shard_view(grad, bucket, self.comm.rank) if self.comm.in_place else None
            self._fly(index, reduce_scatter_bucket(self.comm, bucket, grad, out=out,
                                                   streams=self.streams))
        else:
            self._fly(index, launch(
                self.streams, "reduce", grad, (grad,),
                lambda g=grad: self.comm.all_reduce(g, op=predivided(self.comm, g, "avg"),
                                                    async_op=True, label=bucket_label(bucket))))

    def _scratch(self, numel: int, like: Tensor) -> Tensor:
        """A ``(numel,)`` buffer for a flat gradient: the smallest spare one that fits (a
        settled reduction's), else a new one. Reusing them spares the allocator a fresh
        bucket-sized block per bucket, which on CPU is mapped and zeroed page by page."""
        fits = [i for i, spare in enumerate(self.spares)
                if spare.numel() >= numel and spare.dtype == like.dtype
                and spare.device == like.device]
        if not fits:
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        best = min(fits, key=lambda i: self.spares[i].numel())
        return self.spares.pop(best)[:numel]

    def _fly(self, index: int, pending: Pending, *, scratch: Tensor | None = None) -> None:
        launched = time.monotonic()

        def wait() -> float:
            pending.wait_host()
            return time.monotonic() - launched

        host = self.waiter.submit(wait) if self.waiter is not None else None
        if self._stalling():  # it cannot finish before the stalled ones
            self.stalled.add(index)
        self.pending.append(_Flight(index, pending, host, scratch))

    def _patience(self, numel: int) -> float:
        """How long to wait for reductions of `numel` elements in all: four times what the
        fastest recent reduction took per element (none that was in flight while a wait gave
        up), within [`_MIN_PATIENCE`, `patience`]; `_FIRST_PATIENCE` before any. A reduction
        that a peer joined only after its own wait gave up took that long too: with the median
        of every reduction, ranks on different paths made each other's waits longer and
        longer, up to `patience` per wait (seconds per step for a 120-parameter model)."""
        assert self.patience is not None
        if not self.rates:
            return min(_FIRST_PATIENCE, self.patience)
        return min(self.patience, max(_MIN_PATIENCE, 4 * min(self.rates) * numel))

    def _stalling(self) -> bool:
        """Whether a reduction a wait gave up on is still in flight."""
        return any(f.index in self.stalled for f in self.pending)

    def _settle_previous(self) -> None:
        """Wait for the reductions in flight (see the note), within `patience` if set."""
        if self.patience is None:
            for flight in self.pending:
                self._settle(flight)
            self.pending = []
            return
        if not self.pending:
            return
        if self._stalling():
            # A wait gave up on these and they are still in flight. Collectives on one channel
            # complete in order, so nothing launched after them can finish first: waiting again
            # would only repeat the stall (a peer on another path waits for this rank to go
            # on). Collect what is done; wait again once they are.
            self.poll()
            return
        numel = sum(self.layout.buckets[f.index].padded_numel for f in self.pending)
        deadline = time.monotonic() + self._patience(numel)
        while self.pending:
            flight = self.pending[0]
            assert flight.host is not None
            try:
                flight.host.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:  # collected later: see the note
                self.stalled.update(f.index for f in self.pending)
                break
            self._settle(self.pending.pop(0))

    def close(self) -> None:
        """After `finish` (or a failure): wait until the waiting thread is done with this
        round's reductions, and stop it if it is the Reducer's own."""
        if self._own_waiter:
            self.waiter.shutdown(wait=True)
        elif self.waiter is not None:  # (a failed round's waits must not outlast it)
            futures_wait([f.host for f in self.pending if f.host is not None])

    def _settle(self, flight: _Flight) -> None:
        index = flight.index
        if flight.host is not None:
            took = flight.host.result()  # re-raises the reduction's error
            size = self.layout.buckets[index].padded_numel
            if index not in self.stalled and size:  # (a bucket of empty parameters: no rate)
                self.rates.append(took / size)
                del self.rates[:-_RATES_KEPT]
        value = flight.pending.wait()
        if self.mode == "scatter_leaves":
            target = self.grads[index]
            assert target is not None
            if index in self.fresh:
                target.copy_(value)
                self.fresh.discard(index)
            else:
                target.add_(value)
            self.live_bytes -= self.layout.buckets[index].padded_numel * value.element_size()
            assert flight.scratch is not None
            self.spares.append(flight.scratch)  # its reduction is done: free for the next
        else:
            self.results[index] = value


_RATES_KEPT = 16  # the recent reductions whose fastest sets the patience
_FIRST_PATIENCE = 0.05  # seconds, before any reduction was timed
_MIN_PATIENCE = 0.005


class _Flight(NamedTuple):
    """A reduction in flight: its bucket, its pending result, and (with patience) the future of
    the thread waiting for it on the host."""

    index: int
    pending: Pending
    host: Future[float] | None
    scratch: Tensor | None  # the flat gradient buffer it reduces, returned to the spares

    def done(self) -> bool:
        return self.host.done() if self.host is not None else self.pending.is_completed()
