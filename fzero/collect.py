"""Bucket collectives: all-gather shards into full parameters, reduce-scatter gradients to shards.

For a layout ``L`` over ``N`` ranks, with ``g_q`` the gradients rank q passes:

    gather(shard(p, L, r))          == unflatten(flatten(p, L), L)          on every rank r
    scatter_grads(g_r)[b]           == shard(mean over q of g_q, L, r)[b]    on every rank r

`gather` is differentiable: its vector-Jacobian product is `scatter_grads` (a reduce-scatter
averaged over ranks), so ``autograd.grad(loss_r(gather(shards_r)), shards_r)`` gives each rank
the gradient of the mean of all ranks' losses with respect to its shard.

[Note: streams]
On CUDA, all-gathers run on one side stream and reduce-scatters on another (`Streams`). A
collective first makes its side stream wait for the current (compute) stream, so its input is
ready; it marks input and output with `record_stream` so the caching allocator does not reuse
them while the side stream may still read or write; and it records an event. `Pending.wait()`
makes the *current* stream wait on that event: the compute stream blocks only at the point of
use. On CPU the same code path uses the comm's async work handles (gloo runs its collectives on
its own threads), and `wait()` blocks the calling thread.

`EmulatedStreams` runs that ordering logic on the CPU: each side stream is a thread that issues
its collectives in order after a random delay and completes them before its next one; an event
is a thread event. A missing `wait()` then reads a buffer the "stream" has not filled yet, and a
parity test shows it as a wrong number, as PyTorch's FSDP tests inject delays before all-gathers
on GPUs. Every place fzero issues a collective goes through `launch` on whichever streams
object it is given (`make_train_step(..., streams=...)`).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from fzero.comm import Comm, Work, check_comm, fingerprint_check
from fzero.flat import unflatten
from fzero.layout import Bucket, ShardLayout, check_dtypes, differentiable, flatten_names

__all__ = [
    "Collectives",
    "EmulatedStreams",
    "Pending",
    "SideStreams",
    "Streams",
    "all_gather_bucket",
    "bucket_label",
    "collectives",
    "reduce_scatter_bucket",
]


ROLES = ("all_gather", "reduce")
"""The side streams: all-gathers of parameters, and reductions of gradients."""


class SideStreams(Protocol):
    """Where collectives run: `launch` issues one on the side stream of a role and returns its
    `Pending`; `before` marks a point of the step (e.g. ``"optimizer"``) a test may delay."""

    def launch(
        self, role: str, output: Tensor, inputs: Sequence[Tensor], issue: Callable[[], Work | None]
    ) -> Pending: ...

    def before(self, point: str) -> None: ...


class Streams:
    """CUDA side streams: one for all-gathers, one for reductions (see the module note).

    `Streams.for_device(device)` returns None off CUDA, where the comm's async handles are the
    only concurrency.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.all_gather = torch.cuda.Stream(device=device)
        self.reduce_scatter = torch.cuda.Stream(device=device)

    @classmethod
    def for_device(cls, device: torch.device | str) -> Streams | None:
        """Side streams on a CUDA device; None for any other device."""
        device = torch.device(device)
        return cls(device) if device.type == "cuda" else None

    def launch(
        self, role: str, output: Tensor, inputs: Sequence[Tensor], issue: Callable[[], Work | None]
    ) -> Pending:
        """Issue a collective on the role's stream once the current stream's work is done."""
        stream = self.all_gather if role == "all_gather" else self.reduce_scatter
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        for tensor in (*inputs, output):
            tensor.record_stream(stream)
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            work = issue()
            event.record(stream)
        return Pending(output, work, event, stream)

    def before(self, point: str) -> None:
        """Nothing to do on a real device."""


class EmulatedStreams:
    """Side streams emulated by CPU threads with random delays (see the module note).

    Args:
        seed: seeds the delays (give each rank its own).
        max_delay: the largest delay, in seconds, before each collective and each `before`.

    Use as a context manager, or call `close` (the threads stop).
    """

    def __init__(self, *, seed: int = 0, max_delay: float = 2e-3) -> None:
        if not max_delay >= 0:
            raise ValueError(f"max_delay must be >= 0 seconds, got {max_delay=}")
        self.max_delay = max_delay
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._threads = {
            role: ThreadPoolExecutor(1, thread_name_prefix=f"fzero-emulated-{role}")
            for role in ROLES
        }

    def __enter__(self) -> EmulatedStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _delay(self) -> float:
        with self._lock:
            return self._rng.uniform(0.0, self.max_delay)

    def launch(
        self, role: str, output: Tensor, inputs: Sequence[Tensor], issue: Callable[[], Work | None]
    ) -> Pending:
        """Issue the collective on the role's thread after a random delay; complete it there."""
        delay = self._delay()

        def run() -> None:
            time.sleep(delay)
            work = issue()
            if work is not None:
                work.wait()

        return Pending(output, _FutureWork(self._threads[role].submit(run)), None)

    def before(self, point: str) -> None:
        """Sleep a random delay at a point of the step (e.g. before the optimizer runs)."""
        time.sleep(self._delay())

    def close(self) -> None:
        """Finish what was launched and stop the threads."""
        for pool in self._threads.values():
            pool.shutdown(wait=True)


class _FutureWork:
    """A `Work` over a future: `wait()` re-raises what the job raised."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


class Pending:
    """A collective in flight; `wait()` returns its output once it may be used.

    Waiting twice is harmless; the second call returns at once.
    """

    __slots__ = ("_event", "_output", "_work", "_host_done", "_stream")

    def __init__(self, output: Tensor, work: Work | None, event: Any | None,
                 stream: Any | None = None) -> None:
        self._output = output
        self._work = work
        self._event = event
        self._host_done = False
        self._stream = stream  # the CUDA side stream it was issued on, if any

    def wait_host(self) -> None:
        """Block until the collective is done on the host (not the stream part of `wait`);
        may run on another thread, once.

        A CUDA collective's `wait()` (NCCL) does not block the host: it makes the stream
        current on the calling thread wait for the collective. On a helper thread that is the
        device's default stream, usually the compute stream, which would then stall until the
        collective is done (no overlap): so the wait runs with the collective's own side
        stream current, which orders nothing the step computes on.
        """
        if self._work is not None and not self._host_done:
            if self._stream is None:
                self._work.wait()
            else:
                with torch.cuda.stream(self._stream):
                    self._work.wait()
            self._host_done = True

    def wait(self) -> Tensor:
        """Block (CPU) or make the current stream wait (CUDA) until the output is ready.

        The work is waited for on this thread even when `wait_host` ran on another: a CUDA
        collective's `wait()` (NCCL without a timeout) orders the stream current on the thread
        that calls it, so a wait on a helper thread ordered that thread's stream only, and a
        step running on a stream of the user's own would read the output unordered. Waiting
        again for a finished collective returns at once.
        """
        work, self._work = self._work, None
        if work is not None:
            work.wait()
        if self._event is not None:
            stream = torch.cuda.current_stream(self._output.device)
            stream.wait_event(self._event)
            self._output.record_stream(stream)
            self._event = None
        return self._output

    def is_completed(self) -> bool:
        """Whether `wait()` would return without blocking the host (never blocks)."""
        return self._work is None or self._host_done or bool(self._work.is_completed())


def launch(
    streams: SideStreams | None,
    role: str,
    output: Tensor,
    inputs: Sequence[Tensor],
    issue: Callable[[], Work | None],
) -> Pending:
    """Issue a collective on `streams` (or directly, with the comm's async handle)."""
    if streams is None:
        return Pending(output, issue(), None)
    return streams.launch(role, output, inputs, issue)


def all_gather_bucket(
    comm: Comm,
    bucket: Bucket,
    shard: Tensor,
    *,
    out: Tensor | None = None,
    streams: SideStreams | None = None,
) -> Pending:
    """Start the all-gather of one bucket: every rank's shard into the padded flat buffer.

    Args:
        comm: the communicator.
        bucket: the bucket (gives the sizes).
        shard: this rank's ``(shard_numel,)`` shard.
        out: the ``(padded_numel,)`` buffer to fill; allocated when None.
        streams: side streams (CUDA, emulated) or None.

    Returns:
        A `Pending` whose `wait()` returns the flat buffer: ``out[r*s:(r+1)*s] == shard_r``.
    """
    if out is None:
        out = shard.new_empty(bucket.padded_numel)
    return launch(streams, "all_gather", out, (shard,),
                  lambda: comm.all_gather(out, shard, async_op=True,
                                          label=bucket_label(bucket)))


def bucket_label(bucket: Bucket) -> str:
    """What a bucket's collective moves, for its label: the bucket's label and its first
    parameter (labels repeat where a size cap splits one module; names do not, so ranks that
    issue two buckets in different orders are told apart where labels are compared)."""
    return f"of bucket {bucket.label!r} (from {bucket.entries[0].name})"


def reduce_scatter_bucket(
    comm: Comm,
    bucket: Bucket,
    flat: Tensor,
    *,
    out: Tensor | None = None,
    op: str = "avg",
    streams: SideStreams | None = None,
) -> Pending:
    """Start the reduce-scatter of one bucket's flat gradient into this rank's shard.

    Args:
        comm: the communicator.
        bucket: the bucket (gives the sizes).
        flat: this rank's ``(padded_numel,)`` gradient, padding zero.
        out: the ``(shard_numel,)`` output; allocated (flat's dtype) when None.
        op: ``"avg"`` (data-parallel mean) or ``"sum"``.
        streams: side streams (CUDA, emulated) or None.

    Returns:
        A `Pending` whose `wait()` returns ``op over ranks q of flat_q[r*s:(r+1)*s]``.
    """
    if out is None:
        out = flat.new_empty(bucket.shard_numel)
    return launch(streams, "reduce", out, (flat,),
                  lambda: comm.reduce_scatter(out, flat, op=predivided(comm, flat, op),
                                              async_op=True, label=bucket_label(bucket)))


def predivided(comm: Comm, tensor: Tensor, op: str) -> str:
    """The op that reduces `tensor` (a reduction's input, overwritten) to `op`'s result: for
    the mean of a float16 tensor, ``"sum"`` of the tensor first divided by N in place, else
    `op` itself.

    "avg" adds before it divides (`fzero.comm`): N loss-scaled float16 gradients below
    65504 each could add up to infinity, and the step be skipped where one process (and DDP,
    which divides first, and NCCL's own average, which multiplies by 1/N first) keeps a finite
    mean (a probe: at N = 2, a scaled gradient of 49152 skipped the step and halved the loss
    scale). Other dtypes keep the sum's single rounding: bfloat16 and wider have the range."""
    if op == "avg" and tensor.dtype == torch.float16 and comm.world_size > 1:
        tensor.div_(comm.world_size)
        return "sum"
    return op


class Collectives(NamedTuple):
    """The layout-bound collectives returned by `collectives`: ``gather(shards, buckets=None)
    -> {name: full parameter}`` (differentiable), ``scatter_grads(grads, buckets=None) ->
    grad shards`` (averaged over ranks) and ``gather_async(shards, bucket) -> Pending`` (one
    bucket's flat buffer, for prefetch)."""

    gather: Callable[..., dict[str, Tensor]]
    """``gather(shards, buckets=None) -> {name: full parameter}`` (differentiable)."""
    scatter_grads: Callable[..., tuple[Tensor, ...]]
    """``scatter_grads(grads, buckets=None) -> grad shards``, averaged over ranks."""
    gather_async: Callable[[Sequence[Tensor], int], Pending]
    """``gather_async(shards, bucket) -> Pending`` of that bucket's flat buffer, for prefetch."""


def collectives(
    layout: ShardLayout,
    comm: Comm,
    *,
    streams: SideStreams | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> Collectives:
    """Bind `gather` / `scatter_grads` to a layout and a communicator.

    A collective itself: every rank all-gathers the layout's fingerprint, and all raise if any
    rank planned a different layout (the message lists the ranks and what differs), before any
    bucket moves.

    Args:
        layout: the layout every rank planned.
        comm: the communicator (``comm.world_size`` must equal ``layout.world_size``).
        streams: CUDA side streams; by default created for the comm's device when it is CUDA.
        reduce_dtype: dtype gradients are reduced in (e.g. float32 for bfloat16 parameters),
            by `scatter_grads` and by `gather`'s backward; default each bucket's own dtype.
            `scatter_grads` returns shards in this dtype; `gather`'s backward hands autograd
            the shard's own dtype. `gather` is differentiable once: a gradient it produced
            cannot itself be differentiated (``create_graph=True`` raises).

    Returns:
        `Collectives` ``(gather, scatter_grads, gather_async)``.

    Raises:
        ValueError: the world sizes differ, or ranks planned different layouts.
    """
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"collectives: layout must be a ShardLayout (from fzero.plan), got "
                        f"{type(layout).__name__}")
    check_comm(comm, "collectives")
    check_dtypes(reduce_dtype=reduce_dtype)
    if comm.world_size != layout.world_size:
        raise ValueError(
            f"the layout is planned for world_size={layout.world_size} but the comm has "
            f"world_size={comm.world_size}"
        )
    fingerprint_check(comm, layout.fingerprint, "layout fingerprint", parts=layout.parts())
    if streams is None:
        streams = Streams.for_device(getattr(comm, "device", "cpu"))
    located = layout.locate()
    device = torch.device(getattr(comm, "device", "cpu"))

    def gather_async(shards: Sequence[Tensor], bucket: int) -> Pending:
        (bucket,) = _bucket_indices(layout, [bucket], len(shards))
        _check_shard(shards[bucket], layout, bucket)
        return all_gather_bucket(comm, layout.buckets[bucket], shards[bucket], streams=streams)

    def gather(
        shards: Sequence[Tensor], buckets: Sequence[int] | None = None
    ) -> dict[str, Tensor]:
        """Full parameters of `buckets` (default all): views into fresh flat buffers.

        Every bucket's all-gather is issued before the first is waited on. Backward
        reduce-scatters the gradient of every shard that requires grad (mark the same shards
        on every rank, e.g. the trainable buckets'); frozen shards cost no communication.
        """
        indices = _bucket_indices(layout, buckets, len(shards))
        for index in indices:
            _check_shard(shards[index], layout, index)
        flats = _GatherBuckets.apply(
            _Context(layout, comm, streams, indices, reduce_dtype), *shards)
        full = dict.fromkeys(range(len(layout.buckets)))
        full.update(zip(indices, flats, strict=True))
        sub = ShardLayout(tuple(layout.buckets[i] for i in indices), layout.world_size)
        return unflatten([full[i] for i in indices], sub)

    def scatter_grads(
        grads: Mapping[str, Tensor], buckets: Sequence[int] | None = None
    ) -> tuple[Tensor, ...]:
        """Gradient shards of `buckets` (default all), averaged over ranks.

        Missing gradients count as zero; padding is zero. Integer and bool buckets have no
        gradient: their shards are zeros, without communication (a gradient given for such a
        parameter raises); complex ones have theirs, averaged as any other. A tied
        parameter's gradient is summed over its names, the same tensor given under several of
        them counted once (``autograd.grad`` returns one tensor for repeated inputs, as for
        ``gather``'s aliases). Every reduce-scatter is issued before the first is waited on.
        """
        indices = _bucket_indices(layout, buckets, len(layout.buckets))
        grads = _check_grads(grads, layout, located, device)
        pending = []
        for i in indices:
            bucket = layout.buckets[i]
            if not differentiable(bucket.torch_dtype):
                pending.append(_Ready(torch.zeros(bucket.shard_numel, dtype=bucket.torch_dtype,
                                                  device=device)))
                continue
            flat = _flat_grad(grads, bucket, reduce_dtype, device)
            pending.append(reduce_scatter_bucket(comm, bucket, flat, streams=streams))
        return tuple(p.wait() for p in pending)

    return Collectives(gather, scatter_grads, gather_async)


# --- the differentiable all-gather -----------------------------------------------------------


class _Context(NamedTuple):
    layout: ShardLayout
    comm: Comm
    streams: SideStreams | None
    indices: tuple[int, ...]
    reduce_dtype: torch.dtype | None


class _GatherBuckets(torch.autograd.Function):
    """All-gather of the chosen buckets; backward reduce-scatters the flat gradients (mean)."""

    @staticmethod
    def forward(ctx: Any, info: _Context, *shards: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.info = info
        ctx.num_shards = len(shards)
        ctx.device = shards[0].device if shards else None
        pending = [
            all_gather_bucket(info.comm, info.layout.buckets[i], shards[i], streams=info.streams)
            for i in info.indices
        ]
        return tuple(p.wait() for p in pending)

    @staticmethod
    def backward(ctx: Any, *flat_grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        info: _Context = ctx.info
        if torch.is_grad_enabled() and any(f is not None and f.requires_grad for f in flat_grads):
            # (`once_differentiable` would not do: its error node has no path to the shards,
            # so autograd.grad(..., shards) skips it and drops the second-order term silently)
            raise RuntimeError(
                "backward through fzero's gather with create_graph=True, on a gradient that "
                "itself requires grad: the reduce-scatter is not differentiable, so a "
                "second-order term (gradient penalty on the parameters, Hessian-vector "
                "product) would be wrong. Differentiate with respect to the gathered full "
                "parameters instead (detach them into leaves), or use create_graph=False"
            )
        grads: list[Tensor | None] = [None] * ctx.num_shards
        pending = []
        for index, flat in zip(info.indices, flat_grads, strict=True):
            bucket = info.layout.buckets[index]
            if not ctx.needs_input_grad[1 + index] or not differentiable(bucket.torch_dtype):
                continue  # a shard that does not require grad (frozen) gets none, unsent
            dtype = info.reduce_dtype or bucket.torch_dtype
            if flat is None:  # every rank takes part: a missing gradient is a zero gradient
                flat = torch.zeros(bucket.padded_numel, dtype=dtype,
                                   device=ctx.device)  # (on CUDA too: not the CPU default)
            pending.append((index, reduce_scatter_bucket(
                info.comm, bucket, flat.to(dtype).contiguous(), streams=info.streams)))
        for index, p in pending:  # back in the shard's dtype, as autograd expects
            grads[index] = p.wait().to(info.layout.buckets[index].torch_dtype)
        return (None, *grads)


# --- helpers ---------------------------------------------------------------------------------


class _Ready(NamedTuple):
    """A result that needs no communication, waited on like a `Pending`."""

    value: Tensor

    def wait(self) -> Tensor:
        return self.value


def _bucket_indices(
    layout: ShardLayout, buckets: Sequence[int] | None, given: int
) -> tuple[int, ...]:
    if given != len(layout.buckets):
        raise ValueError(
            f"expected one shard per bucket ({len(layout.buckets)}), got {given}"
        )
    if buckets is None:
        return tuple(range(len(layout.buckets)))
    indices = tuple(buckets)
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < len(layout.buckets)]
    if bad or len(set(indices)) != len(indices):
        raise ValueError(
            f"buckets must be distinct indices in range({len(layout.buckets)}), got {indices}"
        )
    return indices


def _check_shard(shard: Tensor, layout: ShardLayout, index: int) -> None:
    bucket = layout.buckets[index]
    if (
        not isinstance(shard, Tensor)
        or shard.dim() != 1
        or shard.numel() != bucket.shard_numel
        or shard.dtype != bucket.torch_dtype
    ):
        got = (
            f"shape {tuple(shard.shape)} dtype {shard.dtype}"
            if isinstance(shard, Tensor)
            else type(shard).__name__
        )
        raise ValueError(
            f"shard of bucket {index} ({bucket.label!r}) must be a 1-D {bucket.dtype} tensor of "
            f"{bucket.shard_numel} elements, got {got}"
        )
    if not shard.is_contiguous():
        raise ValueError(f"shard of bucket {index} ({bucket.label!r}) must be contiguous (a "
                         f"collective reads it as one block of memory): pass .contiguous()")


def _check_grads(
    grads: Mapping[str, Tensor], layout: ShardLayout, located: Mapping[str, Any],
    device: torch.device,
) -> dict[str, Tensor]:
    """`grads` by dotted name (nested mappings flattened, as `plan` takes them), checked
    against the layout: known names, the parameters' shapes, dtypes and the comm's device."""
    if not isinstance(grads, Mapping):
        raise TypeError(f"scatter_grads needs a mapping of parameter names to gradients, got "
                        f"{type(grads).__name__}")
    grads = flatten_names(grads)
    for name, grad in grads.items():
        if name not in located:
            raise ValueError(f"gradient for unknown parameter {name!r}")
        entry = located[name][1]
        if not isinstance(grad, Tensor) or tuple(grad.shape) != entry.shape:
            got = tuple(grad.shape) if isinstance(grad, Tensor) else type(grad).__name__
            raise ValueError(
                f"gradient of {name!r} has shape {got}, but the parameter has shape {entry.shape}"
            )
        if grad.device != device:
            raise ValueError(
                f"gradient of {name!r} is on {grad.device}, but the comm's tensors are on "
                f"{device}: move it there first"
            )
        dtype = layout.buckets[located[name][0]].torch_dtype
        if not differentiable(dtype):
            raise ValueError(
                f"gradient given for {name!r}, a {entry.dtype} parameter: integer and bool "
                f"parameters have no gradient (their shards come back as zeros)"
            )
        if grad.dtype != dtype:
            raise ValueError(
                f"gradient of {name!r} is {grad.dtype}, but the parameter is {dtype} (torch "
                f"refuses a .grad of another dtype too): cast it, or compute it in {dtype}"
            )
    return grads


def _flat_grad(
    grads: Mapping[str, Tensor], bucket: Bucket, dtype: torch.dtype | None, device: torch.device
) -> Tensor:
    """The bucket's gradient as one flat padded buffer on the comm's device (so every rank
    builds the same buffers, whatever gradients it was given); a missing gradient is zero.

    Tied parameters' gradients (under any of their names) are summed, as autograd would, but
    one tensor given under several names counts once: it is the gradient of the one tensor
    those names share (``autograd.grad`` returns the same tensor for a repeated input).
    """
    flat = torch.zeros(bucket.padded_numel, dtype=dtype or bucket.torch_dtype, device=device)
    with torch.no_grad():
        for entry in bucket.entries:
            piece = flat[entry.offset : entry.end].view(entry.shape)
            added: list[Tensor] = []
            for name in entry.names:
                grad = grads.get(name)
                if grad is not None and not any(grad is seen for seen in added):
                    piece.add_(grad)
                    added.append(grad)
    return flat
