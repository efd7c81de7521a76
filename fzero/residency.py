"""Stage 3's full parameters during one step: gathered just in time along the agreed sequence,
released when no longer needed, gathered again for backward and for recomputation.

[Note: residency]
Each bucket's full flat buffer keeps its tensor, and the parameter leaves aliasing it, for the
whole step; releasing a bucket resizes its storage to zero bytes, gathering it resizes it back.

Which buckets are gathered, and when, follows `fzero.schedule` (see its note): along the
sequence every rank agreed on at the previous phase, one collective per position, each rank
taking part in every position whether it needs that bucket or not; rounds on the control
channel when a rank needs a bucket the rest of the sequence does not hold. What a rank keeps is
its own business (releasing needs no collective):

- Forward: a module's pre-hook marks the buckets of its own parameters active and `need`s them.
  Before gathering, every resident bucket that is not active, not the one needed, not pinned and
  not among the `prefetch` positions already issued ahead is released; afterwards the positions
  up to `prefetch` ahead are issued. At most ``1 + prefetch`` buckets are gathered at once,
  plus those of enclosing modules still running (which own parameters themselves).
- Backward: parameters saved for backward are packed as references (`pack`) and `unpack`
  gathers their bucket again, releasing nothing (one autograd node may unpack parameters of
  two buckets). Between nodes, when a bucket's gradient is complete (`on_grads_complete`),
  every bucket except the one backward works on, the positions ahead and pinned ones is
  released. The buckets forward ended with (its last use, and the one before it if still
  gathered) are not released when backward starts with them and every rank holds them
  (`end_phase(keep=True)`): backward uses them without gathering them again.
- Recomputation (activation checkpointing) runs module forwards during backward: their
  pre-hooks gather and *pin* the buckets for that module (`pinned`, counted by holder),
  because non-reentrant checkpointing keeps the recomputed tensors without packing them. A
  module's pins end when the gradients of its inputs are (a multi-grad hook on its forward's
  inputs: its backward is over), and, for a trainable bucket, when the bucket's gradient is
  complete, unless the module used it in a checkpointed region and its backward is still to
  run (`awaiting`: a recomputed stop-gradient alias may not feed the gradient). Only the
  holder's own pins end: modules sharing a bucket keep theirs. A stop-gradient alias
  (``detach``, ``.data``) taken during recomputation keeps its bucket to the phase's end
  (`aliased`): nothing says when the nodes that read it have run. Any other read of a
  parameter during recomputation (by a module or not) keeps its bucket until forward's nodes
  that made the same read inside a checkpointed region have run (`await_reads`): they read
  the recomputed tensors, which checkpointing saves without fzero's pack hook.
  ``torch.autograd.grad`` and ``torch.autograd.backward`` called inside the guarded phases (a
  penalty, a reentrant checkpoint's backward) run with the guard on: torch would run them
  with the mode off.

Any other read of a parameter (a parent reading a child's weight, a layer whose checkpointed
body reads its own weight during recomputation, as transformers 5's `GradientCheckpointingLayer`
does) is seen by `guard`, a torch function mode active through the step's forward and backward:
a torch function given a parameter of a released bucket first gathers that bucket (a `need`,
like any other, so every rank's collectives still agree). A released bucket's storage has zero
bytes and torch does not check every read of it: without the guard such a read would return
garbage or crash. A view of a parameter (``w[0]``, ``w.T``) counts as the parameter: the guard
finds it through its ``_base``, and so does a stop-gradient alias (``.detach()``, ``.data``) a
step took, in that step or a later one (`FullBuffers.alias`: it views the parameter's current
values, as in torch). A read the guard cannot see (an alias made outside
torch functions: through NumPy, DLPack or ``Tensor.set_``) raises `OutsideOwnerError` where
torch notices the released storage, naming the module and the candidates. The mode
costs a Python round trip per torch call, so it is entered around the user's forward and
backward only, and fzero's own hooks inside them (module hooks, saved-tensor hooks, the gradient
hooks that launch reductions) run `unguarded`: they read parameters knowingly.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, ParamSpec, TypeVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from fzero.collect import Pending, SideStreams, all_gather_bucket
from fzero.comm import Comm
from fzero.flat import alias_leaves, bits
from fzero.layout import ShardLayout
from fzero.schedule import (
    ABORTED,
    DONE,
    FAILED,
    HEADER_WIDTH,
    HELD_SLOTS,
    RUNNING,
    BucketOrder,
    agreed,
    carried,
    failed_ranks,
    header,
    merge,
    next_position,
    phase_over,
    serve,
)

__all__ = [
    "FullBuffers",
    "OutsideOwnerError",
    "PeerFailed",
    "PhaseEnd",
    "Residency",
    "backward_under_guard",
    "trigger_modules",
    "unguarded",
]


class PeerFailed(RuntimeError):
    """Raised into a rank's computation when a round shows that another rank failed."""


class OutsideOwnerError(RuntimeError):
    """A parameter of a released bucket was read outside the modules that own it."""


class PhaseEnd(NamedTuple):
    """What every rank learned at the end of a phase (the same on every rank)."""

    sequence: tuple[int, ...]  # the agreed sequence of bucket uses
    failed: tuple[int, ...]  # ranks whose own computation failed
    aborted: bool  # some rank failed or stopped: the step must not be applied


class _Saved(NamedTuple):
    bucket: int
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


def trigger_modules(model: nn.Module, layout: ShardLayout) -> dict[nn.Module, list[int]]:
    """For each module that directly owns parameters (aliases included), the buckets they are
    stored in: the buckets its forward needs."""
    modules = dict(model.named_modules(remove_duplicate=False))
    triggers: dict[nn.Module, list[int]] = {}
    for index, bucket in enumerate(layout.buckets):
        for name in bucket.names:
            module = modules[name.rsplit(".", 1)[0] if "." in name else ""]
            needs = triggers.setdefault(module, [])
            if index not in needs:
                needs.append(index)
    return triggers


class FullBuffers:
    """Each bucket's full flat buffer, whose storage has zero bytes while the bucket is
    released, and the parameter leaves aliasing it (`alias_leaves`).

    They depend only on the layout and the shards' dtypes and device, so a train step builds
    them once and hands them to every step's `Residency` (rebuilt each step, with the gradient
    hooks on the leaves, they cost 1.1 ms of a 22 ms step at 124 parameters and compute near
    zero: see `fits`).
    """

    def __init__(self, layout: ShardLayout, shards: Sequence[Tensor]) -> None:
        self.layout = layout
        self.kinds = [(shard.dtype, shard.device) for shard in shards]
        self.full: list[Tensor] = []
        self.leaves: list[list[Tensor]] = []
        for bucket, (dtype, device) in zip(layout.buckets, self.kinds, strict=True):
            flat = torch.empty(bucket.padded_numel, dtype=dtype, device=device)
            self.leaves.append(alias_leaves(flat, bucket))  # while the storage is allocated
            flat.untyped_storage().resize_(0)
            self.full.append(flat)
        self.bucket_of = {id(leaf): index for index, leaves in enumerate(self.leaves)
                          for leaf in leaves}
        self.nbytes = [f.numel() * f.element_size() for f in self.full]  # each, gathered
        self._storages = [flat.untyped_storage()._cdata for flat in self.full]
        # Stop-gradient aliases of parameters (``w.detach()``, ``w.data``) taken in the steps'
        # forwards and backwards: id -> bucket, while the alias lives.
        self.aliases: dict[int, int] = {}

    def replaced(self) -> list[str]:
        """The parameters whose leaf no longer views its bucket's buffer: forward replaced its
        data (``p.data = ...``, or ``module.to(dtype)`` inside forward, which does that)."""
        return [entry.name
                for bucket, leaves, flat, storage in zip(
                    self.layout.buckets, self.leaves, self.full, self._storages, strict=True)
                for entry, leaf in zip(bucket.entries, leaves, strict=True)
                if leaf.dtype != flat.dtype or leaf.untyped_storage()._cdata != storage]

    def fits(self, layout: ShardLayout, shards: Sequence[Tensor]) -> bool:
        """Whether these serve `layout` and `shards`, and every bucket was released (a step
        that could not release one, its gather failing, leaves it to no later step)."""
        return (layout is self.layout
                and self.kinds == [(shard.dtype, shard.device) for shard in shards]
                and all(flat.untyped_storage().nbytes() == 0 for flat in self.full))

    def begin(self) -> None:
        """Before a step: no leaf holds a gradient, whatever a failed step left there."""
        for leaves in self.leaves:
            for leaf in leaves:
                leaf.grad = None

    def alias(self, tensor: Tensor, index: int) -> None:
        """`tensor` is a stop-gradient alias of a parameter of bucket `index`, taken in a
        step: a later read of it, in that step or a later one, gathers the bucket, as a read of
        the parameter does (it views the parameter's current values, as in torch and at
        stages 0-2, where the update writes the memory it views)."""
        key = id(tensor)
        self.aliases[key] = index
        weakref.finalize(tensor, self.aliases.pop, key, None)

    def alias_bucket(self, tensor: Tensor) -> int | None:
        """The bucket whose memory `tensor` (or the tensor it views) aliases, when it is a
        stop-gradient alias a step took, else None."""
        index = self.aliases.get(id(tensor))
        if index is None and tensor._base is not None:
            index = self.aliases.get(id(tensor._base))
        return index


class Residency:
    """Stage 3's full parameters for one step (see the module note).

    Args:
        data: the channel the parameter all-gathers run on.
        control: the (host) channel rounds run on.
        layout: the layout.
        shards: this rank's parameter shard per bucket.
        streams: CUDA side streams, or None.
        order: the agreed sequences of the previous step (or a first guess).
        prefetch: positions gathered ahead of use.
        check_writes: compare this rank's part of each bucket with its shard when releasing
            it, noting in `written` the buckets written bypassing autograd (through ``.data``,
            which bumps no version counter a leaf shows); costs a read of the shard. Without
            it, the buckets whose parameters' ``.data`` the guard saw taken in this step
            (`data_taken`) are compared all the same, on every release for the rest of the
            step (an alias taken in forward writes into the bucket gathered again later).
        buffers: the full buffers and leaves to gather into (every bucket released), or None
            for new ones.
    """

    def __init__(
        self,
        *,
        data: Comm,
        control: Comm,
        layout: ShardLayout,
        shards: Sequence[Tensor],
        streams: SideStreams | None,
        order: BucketOrder,
        prefetch: int,
        check_writes: bool = False,
        buffers: FullBuffers | None = None,
    ) -> None:
        self.data = data
        self.control = control
        self.layout = layout
        self.shards = shards
        self.streams = streams
        self.order = order
        self.prefetch = prefetch
        self.check_writes = check_writes
        self.written: set[int] = set()
        self.data_taken: set[int] = set()
        if buffers is None:
            buffers = FullBuffers(layout, shards)
        self.buffers = buffers
        self.full = buffers.full
        self.leaves = buffers.leaves
        self.bucket_of = buffers.bucket_of
        self.nbytes = buffers.nbytes
        self.frozen = {i for i, b in enumerate(layout.buckets) if not b.trainable}
        self.allocated: set[int] = set()
        self.resident: set[int] = set()
        self.fresh: set[int] = set()  # gathered by a position, not used since
        self.inflight: dict[int, list[Pending]] = {}
        self.by_pointer: dict[int, int] = {}
        self.active = [0] * len(layout.buckets)
        # Per bucket, its recomputation pins by holder: the module whose recomputed forward
        # used it (released when that module's backward is done), None (a read outside the
        # module hooks, released with the phase or a complete gradient), or `_ALIASED` (a
        # stop-gradient alias taken: released with the phase).
        self.pinned: list[collections.Counter[object]] = [
            collections.Counter() for _ in layout.buckets]
        # Modules whose forward use inside a checkpointed region has a backward still to run
        # (`_unpin_after_backward`): a complete gradient keeps their pins (see
        # `on_grads_complete`). Forward's hooks fire in backward: cleared when a step starts.
        self.awaiting: collections.Counter[nn.Module] = collections.Counter()
        # Per bucket, the nodes of forward's graph still to run whose torch function read one
        # of its parameters inside a checkpointed region (`await_reads`): their recomputed
        # saved tensors read the bucket. Counted by forward, so cleared when forward begins.
        self.read_nodes: collections.Counter[int] = collections.Counter()
        self.forwards = 0  # forwards begun: a node hook of an earlier graph counts nothing
        self._own_pack: int | None = None  # id of the pack hook `saved_tensors_hooks` made
        self.stack: list[nn.Module] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase = "forward"
        self.sequence: tuple[int, ...] = ()
        self.issued = 0
        self.cursor = -1
        self.rounds = True  # no phase begun: nothing may be gathered
        self.used: list[int] = []
        self.current: int | None = None
        self.failed: set[int] = set()
        self.aborted = False
        self.carried: tuple[int, ...] = ()  # kept gathered from the last phase into the next
        self.inner_backwards = 0  # `torch.autograd.grad` calls of forward under way

    # -- phases --

    def begin(self, phase: str) -> None:
        """Start a ``"forward"`` or ``"backward"`` phase: gather along the agreed sequence,
        issuing the first `prefetch` positions now (the first ones are already there when the
        previous phase carried them: see `end_phase`)."""
        assert phase in ("forward", "backward"), phase
        if phase == "forward":
            self.awaiting.clear()  # (an earlier micro-batch's: fired, or their graph is gone)
            self.read_nodes.clear()
            self.forwards += 1
        self.phase = phase
        self.sequence = self.order.forward if phase == "forward" else self.order.backward
        self.issued = 0  # positions of the sequence issued so far
        self.cursor = -1  # position of the latest use
        self.rounds = False  # left the sequence: every miss is a round
        self.used: list[int] = []
        self.current: int | None = None
        self.failed: set[int] = set()
        self.aborted = False
        carried, self.carried = self.carried, ()
        if carried:  # gathered by every rank, kept: the first positions are issued
            assert self.sequence[: len(carried)] == carried, (self.sequence, carried)
            self.issued = len(carried)
            self.fresh.update(carried)
        self._issue_until(self.prefetch - 1)

    def end_phase(self, status: int = DONE, *, keep: bool = False) -> PhaseEnd:
        """Finish the phase on this rank (`DONE`, `FAILED` or `ABORTED`): take part in the rest
        of the sequence and in rounds until every rank is done, agree on the sequence used
        (it becomes the phase's sequence in `order`), and release everything.

        With `keep` (a forward that backward follows), the buckets this rank used last (the
        last one, and the one before it if still gathered, within ``1 + prefetch``) stay
        gathered when every rank holds the same ones and backward's agreed sequence starts
        with them: backward then uses them without gathering them again (`carried`, decided
        from the last round's headers alike on every rank)."""
        assert not keep or self.phase == "forward", self.phase
        self._leave_sequence()
        held = self._held() if keep and status == DONE else ()
        while True:
            headers = self._round(status, None, held=held)
            if phase_over(headers):
                break
        sequence = tuple(self.used) if agreed(headers) else self._merge_sequences()
        result = PhaseEnd(sequence, tuple(sorted(self.failed)), self.aborted)
        carry = carried(headers, self.order.backward) if keep and not self.aborted else ()
        self.release_all(but=carry)
        for index in carry:
            self._wait(index)  # a gather of the rest of the sequence may have rewritten it
        self.carried = carry
        self.active = [0] * len(self.active)
        for pins in self.pinned:
            pins.clear()
        self.stack.clear()
        self.order = (
            BucketOrder(sequence, self.order.backward) if self.phase == "forward"
            else BucketOrder(self.order.forward, sequence)
        )
        return result

    def _held(self) -> tuple[int, ...]:
        """What this rank can keep for the next phase: the bucket of its last use if still
        gathered, then those of the uses before it that still are, the latest first; at most
        `HELD_SLOTS` and ``1 + prefetch`` (the gathered budget)."""
        if self.current is None or self.current not in self.resident:
            return ()
        limit = min(HELD_SLOTS, 1 + self.prefetch)
        return (self.current, *self._latest_gathered(limit - 1, besides={self.current}))

    def _latest_gathered(self, count: int, *, besides: Collection[int]) -> list[int]:
        """Up to `count` buckets of this rank's latest uses that are still gathered, the latest
        first, none of `besides`."""
        found: list[int] = []
        for index in reversed(self.used):
            if len(found) >= count:
                break
            if index in self.resident and index not in besides and index not in found:
                found.append(index)
        return found

    def _merge_sequences(self) -> tuple[int, ...]:
        """Ranks used different sequences: every rank gathers all of them and merges alike."""
        n = self.control.world_size
        mine = torch.tensor([len(self.used)], dtype=torch.int64)
        lengths = torch.empty(n, dtype=torch.int64)
        self.control.all_gather(lengths, mine, label=f"of {self.phase} sequence lengths")
        width = max(int(lengths.max()), 1)
        padded = torch.full((width,), -1, dtype=torch.int64)
        padded[: len(self.used)] = torch.tensor(self.used, dtype=torch.int64)
        every = torch.empty(n * width, dtype=torch.int64)
        self.control.all_gather(every, padded, label=f"of {self.phase} sequences")
        rows = every.view(n, width).tolist()
        sizes = lengths.tolist()
        return merge([row[: int(size)] for row, size in zip(rows, sizes, strict=True)])

    # -- gathering --

    def _allocate(self, index: int) -> None:
        if index in self.allocated:
            return
        storage = self.full[index].untyped_storage()
        storage.resize_(self.nbytes[index])
        self.by_pointer[storage.data_ptr()] = index
        self.allocated.add(index)
        self.live_bytes += self.nbytes[index]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _gather(self, index: int) -> None:
        """Issue one all-gather of bucket `index` (a position or a served bucket)."""
        self._allocate(index)
        self.inflight.setdefault(index, []).append(all_gather_bucket(
            self.data, self.layout.buckets[index], self.shards[index], out=self.full[index],
            streams=self.streams,
        ))
        self.fresh.add(index)

    def _issue_until(self, position: int) -> None:
        """Issue every position of the sequence up to `position` (inclusive) not yet issued."""
        last = min(position, len(self.sequence) - 1)
        while self.issued <= last:
            self._gather(self.sequence[self.issued])
            self.issued += 1

    def _wait(self, index: int) -> None:
        for pending in self.inflight.pop(index, []):
            pending.wait()
        self.resident.add(index)

    def release(self, index: int) -> None:
        """Free bucket `index`'s full parameters (waiting first for its gathers in flight)."""
        for pending in self.inflight.pop(index, []):
            pending.wait()
        self.resident.discard(index)
        self.fresh.discard(index)
        if index in self.allocated:
            if self.check_writes or index in self.data_taken:
                lo, hi = self.layout.buckets[index].shard_range(self.data.rank)
                if not torch.equal(bits(self.full[index][lo:hi]), bits(self.shards[index])):
                    self.written.add(index)
            storage = self.full[index].untyped_storage()
            # A shared CPU storage resized to 0 and back crashes the process (torch); CUDA
            # storages report is_shared() always (IPC-able) and resize as any other.
            if storage.device.type == "cpu" and storage.is_shared():
                raise RuntimeError(_SHARED_HELP.format(label=self.layout.buckets[index].label))
            self.by_pointer.pop(storage.data_ptr(), None)
            storage.resize_(0)
            self.allocated.discard(index)
            self.live_bytes -= self.nbytes[index]

    def release_all(self, *, but: Collection[int] = ()) -> None:
        """Free every gathered or in-flight bucket (`but` these)."""
        for index in sorted(self.allocated | set(self.inflight)):
            if index not in but:
                self.release(index)

    def _ahead(self) -> set[int]:
        """Buckets of positions issued ahead of the latest use (prefetched)."""
        return set(self.sequence[self.cursor + 1 : self.issued]) if not self.rounds else set()

    def _evict(self, keep: set[int]) -> None:
        for index in sorted(self.allocated):
            if index not in keep and not self.active[index] and not self.pinned[index]:
                self.release(index)

    def _pass(self, position: int) -> None:
        """Take part in the positions before `position` that are not issued yet, releasing
        each bucket this rank does not hold for a use right away (one bucket at a time)."""
        while self.issued < position:
            index = self.sequence[self.issued]
            self._gather(index)
            self.issued += 1
            if index != self.current and not self.active[index] and not self.pinned[index]:
                self.release(index)

    def _leave_sequence(self) -> None:
        if not self.rounds:
            self._pass(len(self.sequence))
            self.rounds = True

    def _round(
        self, status: int, need: int | None, *, held: Sequence[int] = ()
    ) -> list[list[int]]:
        """One round on the control channel; every rank then gathers the served buckets."""
        n = self.control.world_size
        mine = torch.tensor(header(status, need, self.used, held), dtype=torch.int64)
        every = torch.empty(n * HEADER_WIDTH, dtype=torch.int64)
        self.control.all_gather(every, mine, label=f"of a {self.phase} gather round")
        headers = every.view(n, HEADER_WIDTH).tolist()
        self.failed.update(failed_ranks(headers))
        if any(row[0] in (FAILED, ABORTED) for row in headers):
            self.aborted = True
        for index in serve(headers):
            self._gather(index)
        return headers

    # -- uses --

    def need(self, index: int, *, evict: bool, pin: bool = False,
             holder: nn.Module | None = None) -> None:
        """Make bucket `index` resident for a use by this rank's computation; `pin`: keep it so
        for `holder` (a recomputation's use, see `pinned`)."""
        if pin:
            self.pinned[index][holder] += 1
        self.current = index
        if index in self.fresh:  # a position's gather (prefetched or in flight): consume it
            self.fresh.discard(index)
            self._record(index)
            position = next_position(self.sequence, index, self.cursor + 1)
            if position is not None and position < self.issued and not self.rounds:
                self.cursor = position
        elif index not in self.resident and index not in self.inflight:  # a miss
            self._record(index)
            position = None if self.rounds else next_position(self.sequence, index, self.issued)
            if position is None:  # off the sequence: take part in its rest, then ask
                self._leave_sequence()
                if evict:
                    self._evict(self._keeping(index))
                self._round(RUNNING, index)
                self.fresh.discard(index)
                if self.aborted:
                    self._wait(index)
                    raise PeerFailed(
                        f"rank(s) {sorted(self.failed) or '?'} failed during this step's "
                        f"{self.phase}; this rank stops computing it"
                    )
            else:  # later in the sequence: take part in the positions before it
                self.cursor = position
                if evict:
                    self._evict(self._keeping(index))
                self._pass(position)
                self._issue_until(position)
                self.fresh.discard(index)
        if not self.rounds:
            if evict:
                self._evict(self._keeping(index))
            self._issue_until(self.cursor + self.prefetch)
        self._wait(index)

    def _keeping(self, index: int) -> set[int]:
        """What a forward use of bucket `index` keeps gathered: it, the positions issued
        ahead, and, while the positions it will prefetch leave room in the ``1 + prefetch``
        budget (near the end of the sequence), the buckets of the latest uses before it: the
        first ones backward needs, which `end_phase` can then carry into backward instead of
        gathering them again. Off the sequence (rounds serve other ranks' needs too) it keeps
        only `index` and what is ahead."""
        keep = {index, *self._ahead()}
        if self.rounds:
            return keep
        coming = keep | set(self.sequence[self.cursor + 1 : self.cursor + 1 + self.prefetch])
        return keep | set(self._latest_gathered(1 + self.prefetch - len(coming), besides=coming))

    @property
    def recomputing(self) -> bool:
        """Whether forward code runs inside a backward (activation checkpointing's
        recomputation, a tensor hook): in the backward phase, or in a `torch.autograd.grad`
        that forward called (a gradient penalty). Its uses pin their buckets, which the
        recomputed graph's saved tensors read, instead of evicting others (until their
        gradients are complete, or the phase ends)."""
        return self.phase == "backward" or self.inner_backwards > 0

    def _record(self, index: int) -> None:
        if not self.used or self.used[-1] != index:
            self.used.append(index)

    # -- forward: module hooks --

    @contextlib.contextmanager
    def module_hooks(self, triggers: dict[nn.Module, list[int]]) -> Iterator[None]:
        """Gather the buckets of each module's own parameters before its forward (in forward
        and in recomputation during backward); hooks run before the module's own, and the
        post-hooks even when the forward raises."""

        def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
            self.stack.append(module)
            needs = triggers[module]
            recompute = self.recomputing
            for index in needs:
                self.active[index] += 1
            for index in needs:
                self.need(index, evict=not recompute, pin=recompute, holder=module)
            if not torch.is_grad_enabled():
                return
            frozen = [i for i in needs if i in self.frozen]
            if not recompute and self._checkpointed():  # its recomputation will pin them all
                self._unpin_after_backward(module, needs, args, kwargs, counted=True)
            elif frozen:
                self._unpin_after_backward(module, frozen, args, kwargs)

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.stack and self.stack[-1] is module:
                self.stack.pop()
            for index in triggers[module]:
                self.active[index] = max(0, self.active[index] - 1)

        pre, post = unguarded(pre), unguarded(post)
        handles = []
        try:
            for module in triggers:
                handles.append(module.register_forward_pre_hook(pre, prepend=True,
                                                                with_kwargs=True))
                handles.append(module.register_forward_hook(post, with_kwargs=True,
                                                            always_call=True))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _foreign_hooks(self) -> tuple[Any, Any] | None:
        """The innermost saved-tensor hooks, (pack, unpack), when they are not stage 3's own."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top if top is not None and id(top[0]) != self._own_pack else None  # (alive
        # while it is on top: an id is not reused then)

    def _checkpointed(self) -> bool:
        """Whether forward runs under saved-tensor hooks other than stage 3's own: inside a
        non-reentrant checkpointed region (whose recomputation in backward pins buckets)."""
        return self._foreign_hooks() is not None

    def _region_graph(self) -> bool:
        """Whether the torch functions run now build a graph that backward runs, inside a
        non-reentrant checkpointed region: the region's forward (a step's forward, or a
        reentrant region's recomputation, whose graph its own backward runs), not the
        region's recomputation (whose graph is never differentiated: the forward's graph
        reads the tensors it saves), nor the forward of a region nested in one being
        recomputed (its hooks are on top then: counted, its reads held their buckets to the
        end of backward, one more per enclosing region recomputed, a probe)."""
        top = self._foreign_hooks()
        if top is None or _qualname(top[1]).startswith(_RECOMPUTATION_HOOKS):
            return False
        return not (self.recomputing and _inside_recomputation())

    def _unpin_after_backward(self, module: nn.Module, buckets: list[int], args: Any,
                              kwargs: Any, *, counted: bool = False) -> None:
        """Once backward has computed the gradients of `module`'s inputs, the module is done
        with its frozen `buckets` (they get no gradient of their own to mark it): drop one of
        its recomputation pins on each and release what nothing else holds. Registered on a
        forward's inputs: with non-reentrant checkpointing it fires for the original forward's
        use (the recomputed graph is not differentiated), with reentrant checkpointing for the
        recomputation's. Only `module`'s pins: other modules sharing a frozen bucket may still
        read it (clearing the bucket's pins released one whose recomputed saved tensors a
        later node read: a crash, a probe found, with Hugging Face's checkpointing of a block
        partly frozen). `counted`: a forward use in a checkpointed region, for all the
        module's buckets, which a complete gradient does not unpin until it fires (a stop-
        gradient ``self.w.detach()`` there is recomputed as an alias that an earlier node reads
        after ``w``'s gradient completes through its other use: a crash, a probe found). A
        module whose forward inputs need no gradient (or, outside recomputation, are leaves)
        has no node to hook: its frozen buckets' pins last until the phase ends, and its
        trainable ones end with their gradients (a stop-gradient alias it takes is kept by
        `aliased`; counting it as awaiting held every such bucket to the end of backward, an
        embedding looked up in each checkpointed block: a probe)."""
        # A leaf's hook cannot run inside torch.autograd.grad (torch refuses), which forward's
        # graph may meet (a penalty); a reentrant recomputation's inputs are leaves, and its
        # graph meets only the region's own torch.autograd.backward (a recomputed graph of a
        # non-reentrant region is never differentiated). Without them, a reentrant region's
        # frozen buckets stayed gathered to the end of backward (a probe).
        leaves = self.recomputing
        inputs = [
            x for x in (*args, *kwargs.values())
            if isinstance(x, Tensor) and x.requires_grad and (leaves or x.grad_fn is not None)
        ]
        if not inputs:
            return
        if counted:
            self.awaiting[module] += 1

        def done(_: Any) -> None:
            if counted and self.awaiting[module] > 0:
                self.awaiting[module] -= 1
            for index in buckets:
                pins = self.pinned[index]
                if pins[module] > 0:
                    pins[module] -= 1
                    if not pins[module]:
                        del pins[module]
            self._release_unheld()

        torch.autograd.graph.register_multi_grad_hook(inputs, unguarded(done), mode="all")

    def _release_unheld(self) -> None:
        """In backward, after pins ended: release every bucket nothing holds (not pinned, not
        the one backward works on, not a position ahead)."""
        if self.phase == "backward":
            self._evict({*([self.current] if self.current is not None else []),
                         *self._ahead()})

    # -- backward: saved tensors and completed gradients --

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context that saves parameters for backward as references (`pack`, `unpack`)."""
        pack = unguarded(self.pack)  # (not kept on self: a bound method there is a cycle)
        self._own_pack = id(pack)
        return torch.autograd.graph.saved_tensors_hooks(pack, unguarded(self.unpack))

    def pack(self, tensor: Tensor) -> Any:
        """Saved-tensor pack hook: parameters of a bucket are saved as a reference."""
        index = self.by_pointer.get(_storage_pointer(tensor))
        if index is None or tensor.device != self.full[index].device:
            return tensor
        return _Saved(index, tensor.storage_offset(), tensor.shape, tensor.stride())

    def unpack(self, saved: Any) -> Tensor:
        """Saved-tensor unpack hook: gather the bucket again if it was released."""
        if not isinstance(saved, _Saved):
            return saved
        self.need(saved.bucket, evict=False)
        flat = self.full[saved.bucket]
        out = torch.empty(0, dtype=flat.dtype, device=flat.device)
        return out.set_(flat.untyped_storage(), saved.offset, saved.shape, saved.stride)

    def on_grads_complete(self, index: int) -> None:
        """Between autograd nodes: a bucket's gradient is complete; unpin it and release all
        but the bucket backward works on, the positions ahead and pinned buckets. Pins of
        modules whose backward is still to run (`awaiting`) stay: their recomputed tensors may
        alias the bucket without feeding its gradient."""
        pins = self.pinned[index]
        for holder in [h for h in pins if h is None or (
                h not in _UNTIL_READ and not self.awaiting[h])]:
            del pins[holder]
        if self.phase == "backward":
            keep = self._ahead()
            if self.current is not None and self.current != index:
                keep.add(self.current)
            self._evict(keep)

    # -- errors --

    def guard(self, model: nn.Module) -> _Guard:
        """The torch function mode that gathers a parameter's bucket before any torch function
        reads it (see the module note); enter it around the user's forward and backward (and
        run fzero's own hooks inside them `unguarded`)."""
        return _Guard(self, model)

    def read(self, index: int) -> None:
        """A torch function is about to read a parameter of bucket `index` outside the hooks
        (a use like any other: of a bucket not gathered yet, in flight, or kept for this phase's
        first position and not used since)."""
        if self.recomputing and self.read_nodes[index]:
            self.pinned[index][_READ] = 1
        if index not in self.resident or index in self.inflight or index in self.fresh:
            self.need(index, evict=False, pin=self.recomputing,
                      holder=self.stack[-1] if self.stack else None)

    def await_reads(self, buckets: Collection[int], node: Any) -> None:
        """Forward, inside a checkpointed region: the torch function whose backward is `node`
        read parameters of `buckets`. Its recomputation reads them again, and the recomputed
        tensors it saves alias the buckets without a pack hook of fzero's (checkpointing's own
        hooks keep them) until `node` has run, whether or not a module hook holds them
        (``t @ self.lin.weight`` in a region, with ``lin`` gathered by its own use: a complete
        gradient of another bucket released it under the saved tensor, a segfault or an
        error, a probe found). So a read during recomputation pins the bucket (`read`) until
        every such node of the bucket has run (or the phase ends: a node that never runs)."""
        forwards = self.forwards
        for index in buckets:
            self.read_nodes[index] += 1

        def ran(*_: Any) -> None:
            if self.forwards != forwards:  # an earlier forward's graph
                return
            for index in buckets:
                self.read_nodes[index] -= 1
                if self.read_nodes[index] <= 0:
                    del self.read_nodes[index]
                    self.pinned[index].pop(_READ, None)
            self._release_unheld()

        node.register_hook(unguarded(ran))

    def aliased(self, index: int) -> None:
        """A stop-gradient alias of a parameter of bucket `index` (``w.detach()``, ``w.data``)
        was taken: during recomputation its bucket stays until the phase ends. The alias does
        not feed the bucket's gradient, so neither a complete gradient nor the end of a
        module's backward says that the nodes reading it have run (recomputed before the
        module that owns it, such an alias was read released: a segfault, a probe found)."""
        if self.recomputing:
            self.pinned[index][_ALIASED] += 1

    def settle(self, tensor: Tensor) -> None:
        """Wait for the gather in flight into the memory `tensor` views, if any. A view of a
        parameter kept from an earlier use (``w = self.x.weight.t()`` read after other modules
        ran) reads its bucket's memory directly: released, the read fails and is explained
        (`explain`); gathered again by a prefetch, it would read the gather half done."""
        if tensor.layout != torch.strided or tensor.is_meta:
            return
        index = self.by_pointer.get(_storage_pointer(tensor))
        if index is not None and index in self.inflight:
            self._wait(index)

    def explain(self, error: RuntimeError, model: nn.Module) -> RuntimeError:
        """`error`, or one that says what stage 3 has to do with it: an `OutsideOwnerError`
        when it is torch's complaint about reading a released bucket's parameter, a
        RuntimeError naming the saved-tensor hooks when ``torch.func`` refuses them."""
        if _SAVED_HOOKS_REFUSED in str(error):
            return RuntimeError(
                f"stage 3 saves parameters for backward as references, through saved-tensor "
                f"hooks (backward gathers a released bucket again), and torch.func's "
                f"transforms refuse to run under such hooks ({error}). Inside a stage-3 step, "
                f"differentiate with torch.autograd.grad(..., create_graph=True) instead of "
                f"torch.func.grad / vjp / jacrev / hessian (torch.func.vmap and jacfwd run), "
                f"or train at stage 0-2")
        if not _released_read(error):
            return error
        if self.phase == "backward":
            return OutsideOwnerError(
                f"stage 3: backward read a parameter of a bucket that was released, saved for "
                f"backward where fzero did not see it: inside forward, a "
                f"torch.autograd.graph.saved_tensors_hooks context of your own that keeps the "
                f"tensor itself (the innermost hooks win, so fzero's, which save a parameter as "
                f"a reference and gather it again, were not called; hooks that copy, such as "
                f"torch.autograd.graph.save_on_cpu, are fine), or an alias of a parameter made "
                f"where fzero does not see it (through NumPy, DLPack or Tensor.set_). Torch's "
                f"error: {error}")
        reader = self.stack[-1] if self.stack else model
        paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        prefix = paths.get(id(reader), "")
        candidates = [
            entry.name
            for index, bucket in enumerate(self.layout.buckets)
            if index not in self.allocated
            for entry in bucket.entries
            for name in entry.names
            if name.startswith(f"{prefix}.") or not prefix
        ]
        where = f"module {prefix!r} ({type(reader).__name__})" if prefix else (
            f"the root module ({type(reader).__name__}) or code outside any module")
        return OutsideOwnerError(
            f"stage 3: {where} read a parameter of a bucket that was released, through a path "
            f"fzero does not see (an alias made outside torch functions: through NumPy, DLPack "
            f"or Tensor.set_); it is one of {candidates[:8]}"
            f"{' ...' if len(candidates) > 8 else ''}. Read the parameter itself, a view of it "
            f"or a .detach() of it where you need it (any torch function given one gathers its "
            f"bucket first), or keep such aliases within one module's forward."
        )


_ALIASED = object()
"""The holder of `Residency.aliased`'s pins, which only the phase's end drops."""

_READ = object()
"""The holder of `Residency.read`'s pins during recomputation, which the nodes that read the
bucket drop when they have run (`Residency.await_reads`)."""

_CHECKPOINT_MODULE = "torch.utils.checkpoint"
"""The module whose hooks recompute non-reentrant regions (`_inside_recomputation`)."""

_RECOMPUTATION_HOOKS = "_recomputation_hook."
"""How the qualified names of torch.utils.checkpoint's hooks for a non-reentrant region's
recomputation begin."""

_UNTIL_READ = (_ALIASED, _READ)
"""Holders whose pins a complete gradient does not drop: their tensors do not feed it."""

_METADATA = frozenset({
    "__set__", "size", "dim", "numel", "nelement", "stride", "storage_offset",
    "is_contiguous", "untyped_storage", "data_ptr", "element_size", "is_floating_point",
    "is_complex", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "__len__", "__hash__",
})
"""Torch functions that read a tensor's metadata only: reading a parameter's shape or
registering a hook on it gathers nothing."""

_DATA_PROPERTIES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
"""Properties that give a view of the data: reading them gathers, as any other read."""


@functools.lru_cache(maxsize=4096)
def _reads_data(func: Any) -> bool:
    """Whether torch function `func` reads its tensors' data (a pure function of `func`,
    remembered: the guard asks for every torch call of a step)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: .grad or .shape read nothing, .T views the data
        return _property(func) in _DATA_PROPERTIES
    return name not in _METADATA


@functools.lru_cache(maxsize=4096)
def _detaches(func: Any) -> bool:
    """Whether torch function `func` returns its tensor's memory cut off from autograd
    (``detach``, the ``.data`` getter): no gradient says when such an alias is done."""
    return getattr(func, "__name__", "") == "detach" or _takes_data(func)


@functools.lru_cache(maxsize=4096)
def _takes_data(func: Any) -> bool:
    """Whether torch function `func` is the ``.data`` getter (remembered, as `_reads_data`)."""
    return getattr(func, "__name__", "") == "__get__" and _property(func) == "data"


def _property(getter: Any) -> str:
    """The name of the tensor property whose ``__get__`` `getter` is."""
    return getattr(getattr(getter, "__self__", None), "__name__", "")


class _Guard(TorchFunctionMode):
    """Gathers a released bucket before a torch function reads one of its parameters (see the
    module note); turns an unexplained read of a released bucket into `OutsideOwnerError`."""

    def __init__(self, residency: Residency, model: nn.Module) -> None:
        super().__init__()
        self.residency = residency
        self.model = model

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        residency = self.residency
        read: list[int] = []
        detached: int | None = None
        if _reads_data(func):
            bucket_of = residency.bucket_of
            aliases = residency.buffers.aliases
            for value in (*args, *kwargs.values()) if kwargs else args:
                for item in value if isinstance(value, list | tuple) else (value,):
                    if not isinstance(item, Tensor):
                        continue
                    index = bucket_of.get(id(item))
                    if index is None:
                        base = item._base
                        if base is not None:  # a view of a parameter, kept
                            index = bucket_of.get(id(base))
                        if index is None and aliases:
                            index = residency.buffers.alias_bucket(item)
                    if index is not None:
                        residency.read(index)
                        read.append(index)
                        if _detaches(func):
                            residency.aliased(index)
                            detached = index
                        if _takes_data(func):
                            residency.data_taken.add(index)  # writes through it bump nothing
                    elif residency.inflight:
                        residency.settle(item)
        try:
            if func is torch.autograd.grad:
                return _grad_under_guard(self, args, kwargs)
            if func is torch.autograd.backward and residency.phase == "backward":
                return _backward_under_guard(self, args, kwargs)
            result = func(*args, **kwargs)
        except RuntimeError as error:
            if _released_read(error):
                raise residency.explain(error, self.model) from error
            raise
        if read and residency._region_graph():
            node = _node_of(result)
            if node is not None:
                residency.await_reads(read, node)
        if detached is not None and isinstance(result, Tensor):
            residency.buffers.alias(result, detached)
        return result


def _qualname(function: Any) -> str:
    return getattr(function, "__qualname__", "")


def _inside_recomputation() -> bool:
    """Whether torch.utils.checkpoint recomputes a non-reentrant region further up this
    thread's stack: its saved-tensor unpack hook runs the region's function again (the only
    trace it leaves: saved-tensor hooks show only the innermost, a nested region's own)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "unpack_hook" and (
                frame.f_globals.get("__name__") == _CHECKPOINT_MODULE):
            return True
        frame = frame.f_back
    return False


def _node_of(result: Any) -> Any:
    """The autograd node of a torch function's `result` (a tensor, or a sequence whose tensors
    share it), or None."""
    for item in result if isinstance(result, list | tuple) else (result,):
        if isinstance(item, Tensor):
            return item.grad_fn
    return None


_P = ParamSpec("_P")
_R = TypeVar("_R")


def unguarded(hook: Callable[_P, _R]) -> Callable[_P, _R]:
    """`hook`, fzero's own code that a module or autograd calls inside the guarded forward and
    backward, run with torch functions dispatched straight to torch.

    fzero's hooks read parameters and gradients knowingly; under the guard each of their tensor
    calls (a ``.grad``, a ``.dtype``, a ``copy_``) would take a Python round trip through the
    mode, and they make most of a step's calls: 680 of 775 on the 1.8M-parameter GPT, 8% of its
    step time. Torch functions of tensor subclasses are dispatched straight to torch as well,
    which the hooks' plain flat buffers and leaves never need. The user's torch dispatch modes
    are off too: selective activation checkpointing counts and caches the ops of its region
    by their order, and fzero's own (a gather round's header, a gather's copies), which
    recomputation issues differently from forward, made it raise (a probe).
    """

    @functools.wraps(hook)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with torch._C.DisableTorchFunction():
            if not torch._C._len_torch_dispatch_stack():
                return hook(*args, **kwargs)
            with _disable_current_modes():
                return hook(*args, **kwargs)

    return run


def backward_under_guard(loss: Tensor) -> None:
    """``loss.backward()`` for a scalar loss, with the guard (a torch function mode) kept active
    for the Python code backward runs, i.e. recomputation under activation checkpointing.

    ``Tensor.backward`` itself dispatches to the active mode, whose handler runs with the mode
    switched off, so the whole backward would run unguarded; the engine entry point that
    ``torch.autograd.backward`` ends in does not dispatch.
    """
    torch.autograd.graph._engine_run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
        accumulate_grad=True,
    )


def _grad_under_guard(guard: _Guard, args: Any, kwargs: Mapping[str, Any]) -> Any:
    """``torch.autograd.grad(*args, **kwargs)`` called in the guarded forward (a gradient
    penalty in ``loss_fn``), run with the guard active, as `backward_under_guard` runs the
    step's own backward: torch calls the mode's handler with the mode switched off, so the
    inner backward's recomputation (non-reentrant checkpointing) and tensor hooks would read
    released buckets unguarded (a crash, or an error blaming an alias). The engine entry point
    ``grad`` ends in does not dispatch; the arguments are prepared as ``grad`` prepares them,
    gradient edges and batched gradients (``is_grads_batched``, a vmap over the engine call)
    included."""
    bound = _GRAD_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    outputs, inputs = given["outputs"], given["inputs"]
    allow_unused, materialize = given["allow_unused"], given["materialize_grads"]
    if materialize and allow_unused is False:
        return torch.autograd.grad(*args, **kwargs)  # torch's own error (the mode is off here)
    if allow_unused is None:
        allow_unused = materialize
    keys = list(inputs) if type(inputs) is dict else None
    outputs = _as_tuple(outputs)
    inputs = tuple(inputs.values()) if keys is not None else _as_tuple(inputs)
    if not inputs:
        return torch.autograd.grad(*args, **kwargs)  # torch's own error
    batched = given["is_grads_batched"]
    grads, retain_graph, create_graph = _engine_arguments(outputs, given["grad_outputs"], given,
                                                          batched=batched)

    def vjp(grad_outputs: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
        return torch.autograd.graph._engine_run_backward(
            outputs, grad_outputs, retain_graph, create_graph, inputs, allow_unused,
            accumulate_grad=False)

    guard.residency.inner_backwards += 1
    try:
        with guard:
            if batched:
                result = torch._vmap_internals._vmap(
                    vjp, 0, 0, allow_none_pass_through=True)(grads)
            else:
                result = vjp(grads)
    finally:
        guard.residency.inner_backwards -= 1
    if materialize:
        if any(r is None and not isinstance(x, Tensor)
               for r, x in zip(result, inputs, strict=True)):
            raise RuntimeError(
                "materialize_grads cannot be used when the given input is a GradientEdge")
        result = tuple(r if r is not None else torch.zeros_like(x, requires_grad=create_graph)
                       for r, x in zip(result, inputs, strict=True))
    return dict(zip(keys, result, strict=True)) if keys is not None else result


_GRAD_SIGNATURE = inspect.signature(torch.autograd.grad)


def _backward_under_guard(guard: _Guard, args: Any, kwargs: Mapping[str, Any]) -> None:
    """``torch.autograd.backward(*args, **kwargs)`` called during the step's backward (a
    reentrant checkpoint's backward differentiates its recomputed region so), run with the
    guard active, as `_grad_under_guard` runs a penalty's: in torch's call the mode is off, so
    a checkpoint nested in that region recomputed, or a hook read, parameters of released
    buckets unguarded (a segmentation fault, a probe found). Arguments as torch prepares them
    (its handler gets them normalized); the deprecated ``grad_variables`` goes to torch."""
    bound = _BACKWARD_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    if given["grad_variables"] is not None:
        return torch.autograd.backward(*args, **kwargs)  # (the mode is off here)
    tensors = _as_tuple(given["tensors"])
    inputs = given["inputs"]
    inputs = () if inputs is None else (
        tuple(inputs.values()) if type(inputs) is dict else _as_tuple(inputs))
    if given["inputs"] is not None and not inputs:
        return torch.autograd.backward(*args, **kwargs)  # torch's own error
    grads, retain_graph, create_graph = _engine_arguments(tensors, given["grad_tensors"], given)
    with guard:
        torch.autograd.graph._engine_run_backward(
            tensors, grads, retain_graph, create_graph, inputs, allow_unreachable=True,
            accumulate_grad=True)
    return None


_BACKWARD_SIGNATURE = inspect.signature(torch.autograd.backward)


def _engine_arguments(roots: tuple[Any, ...], cotangents: Any, given: Mapping[str, Any], *,
                      batched: bool = False) -> tuple[tuple[Tensor, ...], bool, bool]:
    """The engine's cotangents for `roots`, its ``retain_graph`` and ``create_graph``, as
    ``torch.autograd.grad`` and ``backward`` prepare them from their arguments `given`."""
    grads = torch.autograd._make_grads(
        roots, torch.autograd._tensor_or_tensors_to_tuple(cotangents, len(roots)),
        is_grads_batched=batched)
    create_graph = given["create_graph"]
    retain_graph = create_graph if given["retain_graph"] is None else given["retain_graph"]
    return grads, retain_graph, create_graph


def _as_tuple(value: Any) -> tuple[Any, ...]:
    """A tensor (or gradient edge) as a one-tuple, a sequence of them as a tuple."""
    if isinstance(value, Tensor | torch.autograd.graph.GradientEdge):
        return (value,)
    return tuple(value)


_SHARED_HELP = (
    "stage 3: forward moved bucket {label!r}'s gathered parameters into shared memory "
    "(Module.share_memory() or Tensor.share_memory_()): stage 3 frees each bucket's memory "
    "after its use and allocates it again, which torch cannot do for a shared storage (the "
    "process crashes). Drop that call from forward: a stage-3 state keeps the parameters in "
    "fzero's shards (to hand a model to other processes, share fzero.full_params(state) or "
    "a checkpoint), or train at stage 0-2"
)

_SAVED_HOOKS_REFUSED = "don't yet support saved tensor hooks"
"""Part of torch's error when ``torch.func.grad`` (vjp, jacrev, hessian) runs under
saved-tensor hooks."""


def _storage_pointer(tensor: Tensor) -> int | None:
    """Where `tensor`'s storage starts; None for a tensor without a storage of its own to
    show (sparse, nested, functorch's batched tensors under ``vmap``, forward-mode dual
    tensors), which is never a view of a bucket."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _released_read(error: BaseException) -> bool:
    """Whether `error` is torch's complaint about a tensor over a zero-byte storage."""
    text = str(error)
    return "not allocated" in text or "storage of size 0" in text

