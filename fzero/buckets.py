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
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from fzero.collect import Pending, Streams, all_gather_bucket, reduce_scatter_bucket
from fzero.comm import Comm
from fzero.layout import Bucket, ShardLayout

__all__ = ["BucketOrder", "GradBuckets", "Resident", "leaves_over", "trigger_modules"]

# In flight at once: a bucket being reduced plus the next one (bounds gradient memory).
MAX_PENDING_REDUCES = 2


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


class GradBuckets:
    """Collects each trainable bucket's gradient as its leaves' gradients become ready.

    When every leaf of a bucket has accumulated (post-accumulate-grad hook), its gradients are
    copied into one flat padded buffer, the leaves' ``.grad`` freed, and the buffer
    reduce-scattered (averaged) asynchronously; `finish` waits and adds each rank's result into
    ``grads[b]`` (its gradient shard, accumulating over micro-batches).
    """

    def __init__(
        self,
        comm: Comm,
        layout: ShardLayout,
        leaves: Sequence[Sequence[Tensor]],
        grads: Sequence[Tensor | None],
        streams: Streams | None,
    ) -> None:
        self.comm = comm
        self.layout = layout
        self.leaves = leaves
        self.grads = grads
        self.streams = streams
        self.ready = [0] * len(layout.buckets)
        self.done = [False] * len(layout.buckets)
        self.pending: list[tuple[int, Pending]] = []
        self.live_bytes = 0  # full flat gradient buffers alive (being reduced)
        self.peak_bytes = 0
        self.handles = [
            leaf.register_post_accumulate_grad_hook(self._hook(index))
            for index, bucket in enumerate(layout.buckets)
            if bucket.trainable
            for leaf in leaves[index]
        ]

    def _hook(self, index: int) -> Any:
        def on_ready(_: Tensor) -> None:
            self.ready[index] += 1
            if self.ready[index] == len(self.leaves[index]):
                self._reduce(index)

        return on_ready

    def _reduce(self, index: int) -> None:
        bucket = self.layout.buckets[index]
        target = self.grads[index]
        assert target is not None and not self.done[index]
        leaves = self.leaves[index]
        flat = torch.zeros(bucket.padded_numel, dtype=target.dtype, device=target.device)
        self.live_bytes += flat.numel() * flat.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        with torch.no_grad():
            for entry, leaf in zip(bucket.entries, leaves, strict=True):
                if leaf.grad is not None:
                    flat[entry.offset : entry.end].view(entry.shape).copy_(leaf.grad)
                    leaf.grad = None
        self.done[index] = True
        self.pending.append(
            (index, reduce_scatter_bucket(self.comm, bucket, flat, streams=self.streams))
        )
        while len(self.pending) > MAX_PENDING_REDUCES:
            self._settle(*self.pending.pop(0))

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
        for index, bucket in enumerate(self.layout.buckets):
            if bucket.trainable and not self.done[index] and self.ready[index] > 0:
                self._reduce(index)
        while self.pending:
            self._settle(*self.pending.pop(0))
        self.ready = [0] * len(self.layout.buckets)
        self.done = [False] * len(self.layout.buckets)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()


def trigger_modules(model: nn.Module, layout: ShardLayout) -> dict[nn.Module, list[int]]:
    """For each bucket, the module whose forward needs it: the deepest common ancestor of every
    name (aliases included) stored in the bucket."""
    modules = dict(model.named_modules(remove_duplicate=False))
    triggers: dict[nn.Module, list[int]] = {}
    for index, bucket in enumerate(layout.buckets):
        paths = [name.split(".")[:-1] for name in bucket.names]
        common = paths[0]
        for path in paths[1:]:
            common = common[: _shared(common, path)]
        module = modules[".".join(common)]
        triggers.setdefault(module, []).append(index)
    return triggers


class BucketOrder(NamedTuple):
    """The order buckets were first needed in a step's forward and in its backward."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]


class _Saved(NamedTuple):
    bucket: int
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


class Resident:
    """Stage 3's full parameters: gathered just in time, released after use, re-gathered for
    backward, with up to `prefetch` buckets gathered ahead along the order the previous step
    used (forward and backward orders are learned separately: backward needs only the buckets
    whose parameters autograd saved, e.g. not an embedding's).

    Each bucket's full flat buffer keeps its tensor (and the parameter leaves aliasing it) for
    the whole step; its storage is resized to zero bytes whenever the bucket is released.
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
        self.position = (
            {bucket: i for i, bucket in enumerate(order.forward)},
            {bucket: i for i, bucket in enumerate(order.backward)},
        )
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
        self.current: int | None = None  # the bucket backward is working on
        self.in_backward = False
        self.seen: tuple[list[int], list[int]] = ([], [])  # first-use orders this step
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

    def gather(self, index: int) -> None:
        """Make bucket `index` resident (waiting for its all-gather)."""
        if index in self.resident:
            return
        self._issue(index)
        self.inflight.pop(index).wait()
        self.resident.add(index)
        seen = self.seen[self.in_backward]
        if index not in seen:
            seen.append(index)

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
        self.current = None

    @property
    def learned(self) -> BucketOrder:
        """This step's first-use orders (the next step prefetches along them)."""
        return BucketOrder(tuple(self.seen[0]), tuple(self.seen[1]))

    def _prefetch(self, index: int) -> None:
        order = self.order[self.in_backward]
        at = self.position[self.in_backward].get(index)
        if at is None:
            return
        for ahead in order[at + 1 : at + 1 + self.prefetch]:
            self._issue(ahead)

    # -- forward: module hooks --

    @contextlib.contextmanager
    def forward_hooks(self, triggers: dict[nn.Module, list[int]]) -> Iterator[None]:
        """Gather each bucket before its trigger module's forward, release it after."""

        def pre(module: nn.Module, args: Any) -> None:
            for index in triggers[module]:
                self.gather(index)
                self.active[index] += 1
                self._prefetch(index)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            for index in triggers[module]:
                self.active[index] -= 1
                if self.active[index] == 0:
                    self.release(index)

        handles = []
        try:
            for module in triggers:
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post))
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- backward: saved tensors --

    def pack(self, tensor: Tensor) -> Any:
        """Saved-tensor pack hook: parameters of a bucket are saved as a reference."""
        index = self.by_pointer.get(tensor.untyped_storage().data_ptr())
        if index is None or tensor.device != self.full[index].device:
            return tensor
        return _Saved(index, tensor.storage_offset(), tensor.shape, tensor.stride())

    def unpack(self, saved: Any) -> Tensor:
        """Saved-tensor unpack hook: re-gather a released bucket, prefetch the previous one."""
        if not isinstance(saved, _Saved):
            return saved
        index = saved.bucket
        if self.current is not None and self.current != index and not self.active[self.current]:
            self.release(self.current)
        self.current = index
        self.gather(index)
        self._prefetch(index)
        flat = self.full[index]
        out = torch.empty(0, dtype=flat.dtype, device=flat.device)
        return out.set_(flat.untyped_storage(), saved.offset, saved.shape, saved.stride)

    def after_forward(self) -> None:
        """Release everything, then start gathering the bucket backward needs first."""
        self.release_all()
        self.in_backward = True
        if self.order.backward and self.prefetch:
            self._issue(self.order.backward[0])

    def after_backward(self) -> None:
        """Release everything; the next micro-batch starts a forward."""
        self.release_all()
        self.in_backward = False


def _shared(a: list[str], b: list[str]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
