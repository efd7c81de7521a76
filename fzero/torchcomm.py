"""`TorchComm`: the `fzero.comm.Comm` protocol over a `torch.distributed` process group.

gloo on CPU, NCCL on CUDA. Validation and ring byte accounting come from `fzero.comm.CommBase`;
this module only moves bytes.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor

from fzero.comm import CommBase, Work
from fzero.shm import MIN_CHUNK_BYTES, SharedSlots, open_shared_slots, wait_all

__all__ = ["NO_GROUP_HELP", "TRANSPORTS", "TorchComm", "choose_transport"]

TRANSPORTS: tuple[str, ...] = ("single", "pairwise", "shm")
"""How `TorchComm` implements all-gather and reduce-scatter (see its docstring)."""

NO_SHARED_MEMORY_HELP = (
    "TorchComm(transport='shm') needs every rank of the group on one host, run by one user, "
    "in one pid namespace (each must open the others' memory through /proc/<pid>/fd); some "
    "rank could not. Use transport='pairwise' (gloo's default)."
)

NO_GROUP_HELP = (
    "TorchComm needs an initialized torch.distributed process group: call "
    "fzero.init_distributed() (or use `with fzero.distributed() as comm:`) first, or "
    "torch.distributed.init_process_group(...) yourself."
)


_MAX_TAG = 2**31 - 1


class _SingleTensorCollectives(NamedTuple):
    all_gather: Callable[..., Any]
    reduce_scatter: Callable[..., Any]


def _single_tensor_collectives() -> _SingleTensorCollectives:
    """torch >= 2.13 names them `*_single`; the old names (2.6 - 2.12) warn from 2.13 on."""
    if hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single"):
        return _SingleTensorCollectives(dist.all_gather_single, dist.reduce_scatter_single)
    return _SingleTensorCollectives(dist.all_gather_into_tensor, dist.reduce_scatter_tensor)


def _reduce_op(op: str) -> Any:
    if op == "sum":
        return dist.ReduceOp.SUM
    if op == "avg":
        return dist.ReduceOp.AVG
    if op == "max":
        return dist.ReduceOp.MAX
    if op == "min":
        return dist.ReduceOp.MIN
    raise AssertionError(f"unvalidated op {op!r}")


class _TorchWork:
    """Torch `Work`s (one or several) whose `wait()` returns None, then runs an optional
    epilogue once.

    The first `wait()` waits for the works on the host (within the timeout, if any) and runs the
    epilogue. A later one does not wait on the host again (gloo's point-to-point works would
    wait for a second message that never comes); on NCCL (``streams``) it makes the calling
    thread's current stream wait for the works, as NCCL's own `wait()` without a timeout does,
    so a thread other than the first waiter may read the results."""

    __slots__ = ("_works", "_timeout", "_then", "_streams", "_done")

    def __init__(
        self, work: Any, timeout: timedelta | None, then: Callable[[], object] | None,
        streams: bool = False,
    ) -> None:
        self._works = work if isinstance(work, list) else [work]
        self._timeout = timeout
        self._then = then
        self._streams = streams
        self._done = False

    def wait(self) -> None:
        if self._done:
            if self._streams:
                for work in self._works:
                    work.wait()  # no timeout: NCCL orders the current stream, no host wait
            return
        wait_all(self._works, self._timeout)
        self._done = True
        then, self._then = self._then, None
        if then is not None:
            then()

    def is_completed(self) -> bool:
        return self._done or all(bool(work.is_completed()) for work in self._works)


def _group_timeout(group: Any, device: torch.device) -> timedelta | None:
    """The timeout `group` (None: the default group) was created with, or None where this
    torch does not tell (`ProcessGroup` keeps it in its backend's options)."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        timeout = pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def as_timeout(timeout: timedelta | float | None) -> timedelta | None:
    """`timeout` as a timedelta: given as one or as seconds (None stays None).

    Raises:
        TypeError: neither a timedelta nor a number of seconds.
        ValueError: not above zero (a zero timeout fails every wait at once, a negative one
            failed the rendezvous with a message about connecting to rank 0).
    """
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a timedelta or seconds, got {timeout!r}")
    if not seconds > 0:  # (NaN too)
        raise ValueError(f"timeout must be above 0 seconds, got {timeout!r}")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def choose_transport(transport: str | None, backend: str) -> str:
    """The transport a `TorchComm` over `backend` uses when asked for `transport` (None: the
    backend's default, "pairwise" on gloo and "single" elsewhere).

    Raises:
        ValueError: an unknown transport, or "pairwise" / "shm" on another backend than gloo:
            shm moves CPU tensors, and pairwise's ungrouped receives and sends would deadlock
            on NCCL, which runs a rank's point-to-point operations one after another on one
            stream (each rank's first receive waits for a send queued behind its peer's
            receive).
    """
    if transport is None:
        return "pairwise" if backend == "gloo" else "single"
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport != "single" and backend != "gloo":
        why = ("moves CPU tensors" if transport == "shm" else
               "issues ungrouped point-to-point receives and sends, which NCCL would run one "
               "after another (each rank's first receive waiting for a send queued behind its "
               "peer's receive)")
        raise ValueError(f"transport={transport!r} {why}: it needs gloo, not {backend}; use "
                         f"transport='single' (the default there)")
    return transport


class TorchComm(CommBase):
    """`Comm` over a `torch.distributed` process group (gloo on CPU, NCCL on CUDA).

    All-gather and reduce-scatter have three transports:

    - ``"single"`` (NCCL's default): the single-tensor collectives (`all_gather_single` /
      `reduce_scatter_single`, or their pre-2.13 names), no per-rank tensor lists.
    - ``"pairwise"`` (gloo's default, gloo only): every rank sends each other rank the chunk
      that rank needs and receives its own directly (`isend` / `irecv`, one tag per
      collective, counted alike on every rank, so collectives in flight together never take
      each other's messages): one round of messages, (N-1)/N of the data each way, as a ring. A
      reduce-scatter receives the N-1 chunks into a scratch buffer and sums all N in rank
      order (the same bits whichever rank sums); an all-gather receives straight into the
      output. gloo's own single-tensor collectives, and one gloo reduce or broadcast per rank,
      are 1.2-2x slower on the same bytes (see the README's performance notes).
    - ``"shm"`` (gloo, every rank on one host; asked for, never the default): as pairwise, but
      chunks of at least `shm_min_bytes` go through shared memory (`fzero.shm`): each rank
      copies its data into a slot its peers have mapped, and small tokens over gloo say where
      and when; a reduce-scatter sums straight from the peers' slots, in the same order and to
      the same bits as pairwise. Faster (less CPU per byte), but each collective in flight
      holds a slot of its own data until every peer has read it (a reader unmaps what it
      read, so a slot counts in its owner's RSS alone): a few buckets' chunks per rank.
      At the first such collective the ranks test, together, that every rank can map every
      other's memory; if any cannot (several hosts, another container's pid namespace) every
      rank raises.

    Every transport works in place (`in_place`) except "single" over gloo.

    "avg" uses `ReduceOp.AVG` (pairwise: the sum divided by N, which is what gloo's AVG
    computes; NCCL's multiplies by 1/N first, see `fzero.comm`); if
    the backend rejects it (gloo before torch 2.13 does, identically on every rank and before
    any communication), this comm switches to SUM followed by a division by world_size.

    Args:
        group: The process group; None for the default group.
        timeout: If given, the CPU-side wait of every collective is bounded by it (on NCCL this
            makes `wait()` block the CPU). None: the group's own timeout applies.
        transport: ``"single"``, ``"pairwise"`` or ``"shm"`` (see above); None picks by
            backend: "pairwise" on gloo, "single" on NCCL.
        shm_min_bytes: "shm": the smallest chunk (bytes each rank sends each peer) that goes
            through shared memory; smaller ones go pairwise over TCP. Channels inherit it.

    Attributes:
        group: The process group (None: the default group).
        backend: The group's backend name, e.g. "gloo" or "nccl".
        device: Where this comm's tensors live: the current CUDA device for NCCL, else CPU.

    Raises:
        ValueError: If no process group is initialized or this process is not in `group`, or
            `timeout` is not above zero; with ``transport="shm"``, at the first large
            collective, on every rank, if some rank cannot map another's memory.
        TypeError: `timeout` neither a timedelta nor seconds.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        timeout: timedelta | float | None = None,
        transport: str | None = None,
        shm_min_bytes: int = MIN_CHUNK_BYTES,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(NO_GROUP_HELP)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not in {group=}")
        super().__init__(rank, dist.get_world_size(group))
        # Collect garbage at exit while the interpreter is still whole. A train step's objects
        # form reference cycles (closures, hooks) that reach process groups and tensors; freed
        # only during finalization, they abort gloo processes after a clean run ("terminate
        # called without an active exception": 1 exit in 5 for examples/bench_scale.py).
        atexit.unregister(gc.collect)  # once per process, however many comms it makes
        atexit.register(gc.collect)
        self.group = group
        # The process group itself, also for the default one: a later `init_process_group`
        # (a second `with fzero.distributed()` block) makes a new default group.
        self._process_group = group if group is not None else c10d._get_default_group()
        self.backend = str(dist.get_backend(group))
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.timeout = as_timeout(timeout)
        self._ops = _single_tensor_collectives()
        self._native_avg = True
        transport = choose_transport(transport, self.backend)
        if not isinstance(shm_min_bytes, int) or shm_min_bytes < 0:
            raise ValueError(f"shm_min_bytes must be an int >= 0, got {shm_min_bytes!r}")
        self.transport = transport
        self.shm_min_bytes = shm_min_bytes
        self._slots: SharedSlots | None = None  # "shm": made at the first large collective
        # The pairwise transport copies the input into the output's chunk (a no-op when they
        # alias) and reduces into this rank's chunk in place. NCCL documents its in-place
        # all-gather and reduce-scatter (the rank's chunk of the full buffer as its shard), as
        # FSDP2 uses it: no shard-sized copy or buffer per bucket. gloo's single-tensor
        # collectives are not relied on for aliasing.
        self.in_place = transport != "single" or self.backend == "nccl"
        self._tag = 0  # pairwise: one tag per collective, the same on every rank
        self._global_ranks = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)
        ]

    def _issue(
        self,
        start: Callable[[bool], Any],
        async_op: bool,
        then: Callable[[], object] | None = None,
    ) -> Work | None:
        if async_op or self.timeout is not None or self.transport != "single":
            work = _TorchWork(start(True), self.timeout, then, self.device.type == "cuda")
            if async_op:
                return work
            work.wait()
            return None
        start(False)
        if then is not None:
            then()
        return None

    def _open_channel(self, name: str, host: bool) -> TorchComm:
        backend = "gloo" if host else self.backend
        # Over the default group every process takes part in creating the channel (torch's
        # group bookkeeping then stays in step on every rank); over a subgroup, its members.
        group = dist.new_group(
            ranks=self._global_ranks,
            backend=backend,
            # this comm's own timeout, else its group's: a new group's default would be
            # torch's 30 minutes, so a stuck peer would hang the control and gather channels
            # long after `fzero.distributed(timeout=...)` said to give up
            timeout=self.timeout or _group_timeout(self.group, self.device),
            use_local_synchronization=self.group is not None,
            group_desc=f"fzero:{name}",
        )
        transport = None if backend != self.backend else self.transport
        return TorchComm(group, timeout=self.timeout, transport=transport,
                         shm_min_bytes=self.shm_min_bytes)

    def _check_open(self, kind: str) -> None:
        if not dist.is_initialized() or self._process_group not in c10d._world.pg_map:
            raise ValueError(
                f"{kind} on a TorchComm whose process group was destroyed (the `with "
                f"fzero.distributed() as comm:` block ended, or destroy_distributed() ran): "
                f"use the comm inside the block that made it")

    def _reduce(
        self, start: Callable[[Any, bool], Any], op: str, result: Tensor, async_op: bool
    ) -> Work | None:
        if op == "avg" and self._native_avg:
            try:
                return self._issue(lambda a: start(dist.ReduceOp.AVG, a), async_op)
            except (RuntimeError, ValueError) as exc:
                if "AVG" not in str(exc):
                    raise
                self._native_avg = False
        if op == "avg":
            n = self.world_size
            return self._issue(
                lambda a: start(dist.ReduceOp.SUM, a), async_op, then=lambda: result.div_(n)
            )
        torch_op = _reduce_op(op)
        return self._issue(lambda a: start(torch_op, a), async_op)

    def _next_tag(self, count: int = 1) -> int:
        """The first of `count` consecutive tags for the next collective (alike on every
        rank)."""
        if self._tag + count >= _MAX_TAG:
            self._tag = 0
        tag, self._tag = self._tag + 1, self._tag + count
        return tag

    def _shared(self, chunk_bytes: int) -> SharedSlots | None:
        """The shared-memory slots, when this collective's chunks should go through them."""
        if self.transport != "shm" or chunk_bytes < self.shm_min_bytes or self.world_size == 1:
            return None
        if self._slots is None:
            self._slots = open_shared_slots(
                self.rank, self._global_ranks, self.group, self._next_tag(2), self.timeout)
            if self._slots is None:
                raise ValueError(NO_SHARED_MEMORY_HELP)
        return self._slots

    def _exchange(self, sends: list[Tensor], recvs: list[Tensor]) -> list[Any]:
        """Pairwise: send ``sends[q]`` to and receive ``recvs[q]`` from every other rank q
        (lists indexed by group rank; this rank's entries are ignored).

        Every receive is posted before any send: gloo then reads a peer's message straight
        into its destination as it arrives, while this thread is still writing its own (a
        send writes into the socket from the calling thread; 7 MiB all-gathers between two
        processes took 0.1-1 ms less this way round)."""
        tag = self._next_tag()
        peers = [(q, peer) for q, peer in enumerate(self._global_ranks) if q != self.rank]
        works = [dist.irecv(recvs[q], peer, group=self.group, tag=tag) for q, peer in peers]
        works += [dist.isend(sends[q], peer, group=self.group, tag=tag) for q, peer in peers]
        return works

    def _all_gather(self, output: Tensor, input: Tensor, async_op: bool) -> Work | None:
        if self.transport != "single":
            s, n = input.numel(), self.world_size
            chunks = list(output.view(n, s).unbind(0))  # (split(0) would give one chunk)
            if chunks[self.rank].data_ptr() != input.data_ptr():  # not gathered in place
                chunks[self.rank].copy_(input)
            slots = self._shared(input.nbytes)
            if slots is not None:
                works, read = slots.all_gather(chunks, input, self._next_tag())
                return self._issue(lambda a: works, async_op, then=read)
            works = self._exchange([input] * n, chunks)
            return self._issue(lambda a: works, async_op)
        fn = self._ops.all_gather
        return self._issue(lambda a: fn(output, input, group=self.group, async_op=a), async_op)

    def _reduce_scatter(
        self, output: Tensor, input: Tensor, op: str, async_op: bool
    ) -> Work | None:
        if self.transport != "single":
            s, n = output.numel(), self.world_size
            chunks = list(input.view(n, s).unbind(0))
            slots = self._shared(output.nbytes)
            if slots is not None:
                works, add = slots.reduce_scatter(output, chunks, self._next_tag())

                def add_then_average() -> None:
                    add()
                    if op == "avg":
                        output.div_(n)

                return self._issue(lambda a: works, async_op, then=add_then_average)
            received = input.new_empty((n - 1, s))  # each peer's chunk of this rank's shard
            rows = iter(received)
            works = self._exchange(chunks, [chunk if q == self.rank else next(rows)
                                            for q, chunk in enumerate(chunks)])

            def add() -> None:  # in rank order, as one rank adding all chunks would
                if output.data_ptr() != chunks[self.rank].data_ptr():  # not in place
                    output.copy_(chunks[self.rank])
                before, after = received[: self.rank], received[self.rank :]
                if len(before):  # (c_0 + ... + c_{r-1}) + c_r: addition commutes exactly
                    for row in before[1:]:
                        before[0].add_(row)
                    output.add_(before[0])
                for row in after:
                    output.add_(row)
                if op == "avg":
                    output.div_(n)

            return self._issue(lambda a: works, async_op, then=add)
        fn = self._ops.reduce_scatter

        def start(torch_op: Any, a: bool) -> Any:
            return fn(output, input, op=torch_op, group=self.group, async_op=a)

        return self._reduce(start, op, output, async_op)

    def _all_reduce(self, tensor: Tensor, op: str, async_op: bool) -> Work | None:
        def start(torch_op: Any, a: bool) -> Any:
            return dist.all_reduce(tensor, op=torch_op, group=self.group, async_op=a)

        return self._reduce(start, op, tensor, async_op)

    def _broadcast(self, tensor: Tensor, src: int, async_op: bool) -> Work | None:
        global_src = src if self.group is None else dist.get_global_rank(self.group, src)
        return self._issue(
            lambda a: dist.broadcast(tensor, src=global_src, group=self.group, async_op=a),
            async_op,
        )

    def barrier(self) -> None:
        """Block until every rank of the group has called `barrier`."""
        device_ids = [self.device.index] if self.backend == "nccl" else None
        dist.barrier(group=self.group, device_ids=device_ids)


