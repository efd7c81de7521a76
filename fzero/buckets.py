"""Per-step bucket machinery: parameter leaves over flat buffers, gradient buckets, residency.

[Note: one leaf per parameter]
The parameters handed to `torch.func.functional_call` are one autograd leaf per parameter,
aliasing the bucket's flat storage (``empty(0).set_(storage, offset, shape)``). With views of a
single flat leaf instead, autograd runs the view nodes last and every bucket's gradient stays
alive until the end of backward; with one leaf each, a parameter's AccumulateGrad runs as soon
as its gradient is ready, so a bucket is complete when all its leaves' post-accumulate-grad hooks
have fired, and stage 2 and 3 reduce-scatter it right then.

[Note: collective order]
Every rank must issue the same collectives in the same order. Bucket completion order in
backward, and the forward order prefetching follows, come from the autograd graph and the
module structure, which are the same on every rank; nothing here depends on rank-local data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from fzero.collect import Pending, Streams, all_gather_bucket, reduce_scatter_bucket
from fzero.comm import Comm
from fzero.layout import Bucket, ShardLayout

__all__ = [
    "BucketOrder",
    "EagerReduce",
    "GradBuckets",
    "Resident",
    "leaves_over",
    "trigger_modules",
]


def leaves_over(flat: Tensor, bucket: Bucket) -> list[Tensor]:
    """One tensor per entry aliasing `flat`'s storage (a leaf requiring grad if trainable)."""
    storage = flat.untyped_storage()
    base = flat.storage_offset()
    leaves = []
    with torch.no_grad():
        for entry in bucket.entries:
            leaf = torch.empty(0, dtype=flat.dtype, device=flat.device)
            leaf.set_(storage, base + entry.offset, entry.shape, _contiguous_strides(entry.shape))
            leaves.append(leaf.requires_grad_(bucket.trainable))
    return leaves


class _Completion:
    """Calls `complete(b)` once every leaf of trainable bucket b has accumulated its gradient
    (post-accumulate-grad hooks, counted per bucket while `armed()` is true)."""

    def __init__(
        self,
        layout: ShardLayout,
        leaves: Sequence[Sequence[Tensor]],
        complete: Callable[[int], None],
        armed: Callable[[], bool] = lambda: True,
    ) -> None:
        self.sizes = [len(bucket_leaves) for bucket_leaves in leaves]
        self.complete = complete
        self.armed = armed
        self.ready = [0] * len(layout.buckets)
        self.handles = [
            leaf.register_post_accumulate_grad_hook(self._hook(index))
            for index, bucket in enumerate(layout.buckets)
            if bucket.trainable
            for leaf in leaves[index]
        ]

    def _hook(self, index: int) -> Callable[[Tensor], None]:
        def on_ready(_: Tensor) -> None:
            if self.armed():
                self.ready[index] += 1
                if self.ready[index] == self.sizes[index]:
                    self.complete(index)

        return on_ready

    def reset(self) -> None:
        """Forget the counts (before the next backward)."""
        self.ready = [0] * len(self.ready)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()


class GradBuckets:
    """Collects each trainable bucket's gradient as its leaves' gradients become ready.

    When every leaf of a bucket has accumulated (post-accumulate-grad hook), its gradients are
    copied into one flat padded buffer, the leaves' ``.grad`` freed, and the buffer
    reduce-scattered (averaged) asynchronously; `finish` waits and adds each rank's result into
    ``grads[b]`` (its gradient shard, accumulating over micro-batches). `on_complete(b)` runs
    right after a bucket's reduce-scatter is issued.
    """

    def __init__(
        self,
        comm: Comm,
        layout: ShardLayout,
        leaves: Sequence[Sequence[Tensor]],
        grads: Sequence[Tensor | None],
        streams: Streams | None,
        on_complete: Callable[[int], None] | None = None,
    ) -> None:
        self.comm = comm
        self.on_complete = on_complete
        self.layout = layout
        self.leaves = leaves
        self.grads = grads
        self.streams = streams
        self.done = [False] * len(layout.buckets)
        self.pending: list[tuple[int, Pending]] = []
        self.live_bytes = 0  # full flat gradient buffers alive (being reduced)
        self.peak_bytes = 0
        self.completion = _Completion(layout, leaves, self._reduce)

    def _reduce(self, index: int) -> None:
        bucket = self.layout.buckets[index]
        target = self.grads[index]
        assert target is not None and not self.done[index]
        # One reduce-scatter in flight: it overlapped this bucket's backward; settle it before
        # flattening this one, so at most this bucket's leaf gradients and its flat copy (two
        # buckets' worth) are alive.
        while self.pending:
            self._settle(*self.pending.pop(0))
        leaves = self.leaves[index]
        flat = torch.empty(bucket.padded_numel, dtype=target.dtype, device=target.device)
        self.live_bytes += flat.numel() * flat.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        with torch.no_grad():  # one pass: each element is copied or zeroed once
            for entry, leaf in zip(bucket.entries, leaves, strict=True):
                piece = flat[entry.offset : entry.end]
                if leaf.grad is None:  # unused in this backward: a zero gradient
                    piece.zero_()
                else:
                    piece.view(entry.shape).copy_(leaf.grad)
                    leaf.grad = None
            flat[bucket.numel :].zero_()  # padding
        self.done[index] = True
        self.pending.append(
            (index, reduce_scatter_bucket(self.comm, bucket, flat, streams=self.streams))
        )
        if self.on_complete is not None:
            self.on_complete(index)

    def _settle(self, index: int, pending: Pending) -> None:
        target = self.grads[index]
        assert target is not None
        target.add_(pending.wait())
        self.live_bytes -= self.layout.buckets[index].padded_numel * target.element_size()

    def finish(self) -> None:
        """After a backward: reduce the buckets some of whose leaves got no gradient, wait all.

        Buckets none of whose leaves got a gradient are skipped (on every rank alike: the
        graph decides). Ready for the next micro-batch afterwards.
        """
        ready = self.completion.ready
        for index, bucket in enumerate(self.layout.buckets):
            if bucket.trainable and not self.done[index] and ready[index] > 0:
                self._reduce(index)
        while self.pending:
            self._settle(*self.pending.pop(0))
        self.completion.reset()
        self.done = [False] * len(self.layout.buckets)

    def close(self) -> None:
        """Remove the hooks."""
        self.completion.close()


class EagerReduce:
    """Stages 0-1: start each bucket's gradient reduction as soon as the step's last backward
    has completed it, so communication overlaps the rest of backward (as DDP does).

    The full gradient buffers ``grads[b]`` accumulate in place over micro-batches (the leaves'
    ``.grad`` are views of them); once `armed`, the last post-accumulate-grad hook of a bucket
    starts its all-reduce (stage 0) or reduce-scatter (stage 1), averaged over ranks. `results`
    starts the buckets no hook completed (some parameter got no gradient), in bucket order, and
    waits for all.
    """

    def __init__(
        self,
        comm: Comm,
        layout: ShardLayout,
        leaves: Sequence[Sequence[Tensor]],
        grads: Sequence[Tensor | None],
        *,
        scatter: bool,
        reduce_dtype: torch.dtype | None,
        streams: Streams | None,
    ) -> None:
        self.comm = comm
        self.layout = layout
        self.grads = grads
        self.scatter = scatter
        self.reduce_dtype = reduce_dtype
        self.streams = streams
        self.armed = False
        self.started: dict[int, Any] = {}
        self.completion = _Completion(layout, leaves, self._start, armed=lambda: self.armed)

    def _start(self, index: int) -> None:
        grad = self.grads[index]
        assert grad is not None and index not in self.started
        if self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        if self.scatter:
            self.started[index] = reduce_scatter_bucket(
                self.comm, self.layout.buckets[index], grad, streams=self.streams
            )
        else:
            self.started[index] = _Reduced(grad, self.comm.all_reduce(grad, op="avg",
                                                                        async_op=True))

    def results(self) -> list[Tensor]:
        """Per trainable bucket, in order: the reduced gradient (stage 0: full, 1: shard)."""
        trainable = [i for i, b in enumerate(self.layout.buckets) if b.trainable]
        for index in trainable:
            if index not in self.started:
                self._start(index)
        return [self.started[index].wait() for index in trainable]

    def close(self) -> None:
        """Remove the hooks."""
        self.completion.close()


class _Reduced(NamedTuple):
    """An in-place all-reduce in flight; `wait()` returns its tensor."""

    tensor: Tensor
    work: Any

    def wait(self) -> Tensor:
        self.work.wait()
        return self.tensor


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


class BucketOrder(NamedTuple):
    """The sequence in which a step's forward and its backward used buckets (consecutive
    repeats collapsed); the next step prefetches along it."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]


class _Saved(NamedTuple):
    bucket: int
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


class Resident:
    """Stage 3's full parameters: gathered just in time, released when no longer needed,
    re-gathered for backward, with `prefetch` buckets gathered ahead.

    [Note: residency]
    Each bucket's full flat buffer keeps its tensor (and the parameter leaves aliasing it) for
    the whole step; releasing a bucket resizes its storage to zero bytes.

    Forward: a module's pre-hook marks the buckets holding its own parameters active and
    touches them: each is gathered (or its prefetch waited on), every other resident bucket
    that is neither active nor among the next `prefetch` buckets of the learned forward
    sequence is released, and those next buckets are prefetched. So at most ``1 + prefetch``
    buckets (plus those of enclosing modules still running, which own parameters themselves)
    are gathered at once.

    Backward: autograd unpacks saved parameters through `unpack`, which touches the bucket
    without releasing anything (one autograd node may unpack parameters of two buckets, and both
    must stay valid until it has run). Buckets are released between nodes, when a bucket's
    gradients are complete (`on_grads_complete`): every resident bucket except the one backward
    is working on (unless that is the completed one) and the next `prefetch` of the learned
    backward sequence. A bucket needed again later is gathered again.

    The learned sequences come from the previous step; a step that runs differently only
    prefetches less well (every rank alike: the sequences derive from the graph).
    """

    def __init__(
        self,
        comm: Comm,
        layout: ShardLayout,
        shards: Sequence[Tensor],
        streams: Streams | None,
        order: BucketOrder,
        prefetch: int,
    ) -> None:
        self.comm = comm
        self.layout = layout
        self.shards = shards
        self.streams = streams
        self.order = order
        self.prefetch = prefetch
        self.full: list[Tensor] = []
        self.leaves: list[list[Tensor]] = []
        for bucket, shard in zip(layout.buckets, shards, strict=True):
            flat = torch.empty(bucket.padded_numel, dtype=shard.dtype, device=shard.device)
            self.leaves.append(leaves_over(flat, bucket))  # while the storage is allocated
            flat.untyped_storage().resize_(0)
            self.full.append(flat)
        self.nbytes = [f.numel() * f.element_size() for f in self.full]
        self.inflight: dict[int, Pending] = {}
        self.resident: set[int] = set()
        self.by_pointer: dict[int, int] = {}
        self.active = [0] * len(layout.buckets)
        self.phase = 0  # 0: forward, 1: backward
        self.cursor: int | None = None  # position in the learned sequence of this phase
        self.used: tuple[list[int], list[int]] = ([], [])  # this step's use sequences
        self.live_bytes = 0
        self.peak_bytes = 0

    # -- gathering and releasing --

    def _issue(self, index: int) -> None:
        if index in self.resident or index in self.inflight:
            return
        storage = self.full[index].untyped_storage()
        storage.resize_(self.nbytes[index])
        self.by_pointer[storage.data_ptr()] = index
        self.live_bytes += self.nbytes[index]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.inflight[index] = all_gather_bucket(
            self.comm, self.layout.buckets[index], self.shards[index], out=self.full[index],
            streams=self.streams,
        )

    def _gather(self, index: int) -> None:
        if index in self.resident:
            return
        self._issue(index)
        self.inflight.pop(index).wait()
        self.resident.add(index)

    def release(self, index: int) -> None:
        """Free bucket `index`'s full parameters (waiting first if its gather is in flight)."""
        if index in self.inflight:
            self.inflight.pop(index).wait()
        elif index not in self.resident:
            return
        self.resident.discard(index)
        storage = self.full[index].untyped_storage()
        self.by_pointer.pop(storage.data_ptr(), None)
        storage.resize_(0)
        self.live_bytes -= self.nbytes[index]

    def release_all(self) -> None:
        """Free every gathered or in-flight bucket (in bucket order, alike on every rank)."""
        for index in sorted({*self.resident, *self.inflight}):
            self.release(index)

    # -- the learned sequences --

    @property
    def learned(self) -> BucketOrder:
        """This step's use sequences (the next step prefetches along them)."""
        return BucketOrder(tuple(self.used[0]), tuple(self.used[1]))

    def _advance(self, index: int) -> None:
        """Record a use of `index` and move the cursor to it in the learned sequence."""
        used = self.used[self.phase]
        if used and used[-1] == index:
            return
        used.append(index)
        sequence = self.order[self.phase]
        at = self.cursor
        if at is not None and at + 1 < len(sequence) and sequence[at + 1] == index:
            self.cursor = at + 1
            return
        start = 0 if at is None else at + 1
        found = [i for i in range(start, len(sequence)) if sequence[i] == index]
        if not found:
            found = [i for i in range(len(sequence)) if sequence[i] == index]
        self.cursor = found[0] if found else None

    def _upcoming(self, current: int) -> list[int]:
        """The next `prefetch` distinct buckets after the cursor, other than `current`."""
        if self.cursor is None or not self.prefetch:
            return []
        ahead: list[int] = []
        for index in self.order[self.phase][self.cursor + 1 :]:
            if index != current and index not in ahead:
                ahead.append(index)
                if len(ahead) == self.prefetch:
                    break
        return ahead

    def _touch(self, index: int, *, evict: bool) -> None:
        self._advance(index)
        upcoming = self._upcoming(index)
        if evict:  # before gathering: the released bucket's memory is reused
            self._evict(keep={index, *upcoming})
        self._gather(index)
        for ahead in upcoming:
            self._issue(ahead)

    def _evict(self, keep: set[int]) -> None:
        for index in sorted(self.resident | set(self.inflight)):
            if index not in keep and not self.active[index]:
                self.release(index)

    # -- forward: module hooks --

    @contextlib.contextmanager
    def forward_hooks(self, triggers: dict[nn.Module, list[int]]) -> Iterator[None]:
        """Gather the buckets of each module's own parameters before its forward."""

        def pre(module: nn.Module, args: Any) -> None:
            needs = triggers[module]
            for index in needs:
                self.active[index] += 1
            for index in needs:
                self._touch(index, evict=True)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            for index in triggers[module]:
                self.active[index] -= 1

        handles = []
        try:
            for module in triggers:
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post))
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- backward: saved tensors and completed gradients --

    def pack(self, tensor: Tensor) -> Any:
        """Saved-tensor pack hook: parameters of a bucket are saved as a reference."""
        index = self.by_pointer.get(tensor.untyped_storage().data_ptr())
        if index is None or tensor.device != self.full[index].device:
            return tensor
        return _Saved(index, tensor.storage_offset(), tensor.shape, tensor.stride())

    def unpack(self, saved: Any) -> Tensor:
        """Saved-tensor unpack hook: (re-)gather the bucket, prefetch the next ones."""
        if not isinstance(saved, _Saved):
            return saved
        self._touch(saved.bucket, evict=False)
        flat = self.full[saved.bucket]
        out = torch.empty(0, dtype=flat.dtype, device=flat.device)
        return out.set_(flat.untyped_storage(), saved.offset, saved.shape, saved.stride)

    def on_grads_complete(self, index: int) -> None:
        """Between autograd nodes: release all but the bucket backward works on (unless it is
        the one just completed) and the ones it needs next."""
        if self.phase == 1:
            current = self.used[1][-1] if self.used[1] else index
            keep = set(self._upcoming(current))
            if current != index:
                keep.add(current)
            self._evict(keep=keep)

    def after_forward(self) -> None:
        """Release everything, then start gathering the bucket backward needs first."""
        self.release_all()
        self.phase, self.cursor = 1, None
        if self.order.backward and self.prefetch:
            self._issue(self.order.backward[0])

    def after_backward(self) -> None:
        """Release everything; the next micro-batch starts a forward."""
        self.release_all()
        self.phase, self.cursor = 0, None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
