"""The network edge: the `Comm` protocol, ring byte accounting and `TorchComm`.

Every collective in fzero goes through an object satisfying `Comm`. Two implementations exist:
`TorchComm` over a `torch.distributed` process group (gloo on CPU, NCCL on CUDA) and
`fzero.simworld.SimComm`, N ranks in one process. Both inherit `CommBase`, which owns input
validation and byte accounting, so the two cannot drift apart.

All collectives act on contiguous 1-D tensors. With N = world_size, x_r the tensor rank r passes
and s = the per-rank (small side) numel, the collectives are, for every rank r:

    all_gather:      output_r[q*s:(q+1)*s] == input_q                   for q in range(N)
    reduce_scatter:  output_r == reduce(input_q[r*s:(r+1)*s] for q in range(N))   ("sum", "avg")
    all_reduce:      tensor_r <- reduce(tensor_q for q in range(N))  ("sum", "avg", "max", "min")
    broadcast:       tensor_r <- tensor_src

"avg" is the sum divided by N (not a sum of pre-divided terms): that is what gloo's and NCCL's
`ReduceOp.AVG` compute. A reduce-scatter's input is scratch: its contents are unspecified
afterwards (`TorchComm` over gloo reduces in place).

[Note: ring accounting]
`CommCounters` charges each rank the bytes it sends in a bandwidth-optimal ring implementation,
at the moment the collective is issued. For P elements of b bytes on the big side of the
collective (the all-gather's output, the reduce-scatter's input, the all-reduce's or the
broadcast's tensor):

    all_gather, reduce_scatter:  (N-1)/N * P * b
    all_reduce:                  2 * (N-1)/N * P * b   (a reduce-scatter, then an all-gather)
    broadcast:                   (N-1)/N * P * b       (scatter from src, then a ring all-gather:
                                                         every rank is charged the all-gather
                                                         phase; the source's scatter phase,
                                                         at most (N-1)/N * P * b more, is not)

Counts are integers: `P * b * (N-1) // N` rounds down, and is exact whenever P is a multiple of N
(fzero pads every bucket to a multiple of N, so its per-step totals are exact).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "ALL_REDUCE_OPS",
    "COLLECTIVES",
    "REDUCE_SCATTER_OPS",
    "Comm",
    "CommBase",
    "CommCounters",
    "LaunchEnv",
    "TorchComm",
    "Work",
    "destroy_distributed",
    "distributed",
    "fingerprint_check",
    "init_distributed",
    "parse_launch_env",
    "ring_bytes",
]

COLLECTIVES: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
"""The kinds of collective `CommCounters` counts, in a fixed order."""
REDUCE_SCATTER_OPS: tuple[str, ...] = ("sum", "avg")
"""Reductions `Comm.reduce_scatter` accepts."""
ALL_REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")
"""Reductions `Comm.all_reduce` accepts."""

TRANSPORTS: tuple[str, ...] = ("single", "per_rank")
"""How `TorchComm` implements all-gather and reduce-scatter (see its docstring)."""

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Collective timeout `init_distributed` passes to the process group by default."""

NO_GROUP_HELP = (
    "TorchComm needs an initialized torch.distributed process group: call "
    "fzero.init_distributed() (or use `with fzero.distributed() as comm:`) first, or "
    "torch.distributed.init_process_group(...) yourself."
)


# ----------------------------------------------------------------------------------------------
# Protocols


@runtime_checkable
class Work(Protocol):
    """Handle of an asynchronous collective (`async_op=True`).

    The results are in the caller's tensors once `wait()` has returned (on CUDA: once the
    current stream reaches the point where `wait()` was called).
    """

    def wait(self) -> None:
        """Block until the collective has completed; re-raise its error if it failed."""
        ...

    def is_completed(self) -> bool:
        """Whether the collective has completed (never blocks)."""
        ...


@runtime_checkable
class Comm(Protocol):
    """A communicator: this process's view of a group of `world_size` ranks.

    Every collective must be called by every rank of the group, in the same order, with the same
    sizes and dtype. Tensors are contiguous and 1-D. With `async_op=True` a `Work` handle is
    returned and the call does not wait; otherwise the call returns `None` once done.

    Attributes:
        rank: This process's rank in the group, in `range(world_size)`.
        world_size: Number of ranks N.
        counters: Bytes and calls this rank issued, by kind of collective (ring accounting).
    """

    rank: int
    world_size: int
    counters: CommCounters

    def all_gather(self, output: Tensor, input: Tensor, *, async_op: bool = False) -> Work | None:
        """`output[q*s:(q+1)*s] = input of rank q`, with `output.numel() == N * input.numel()`."""
        ...

    def reduce_scatter(
        self, output: Tensor, input: Tensor, *, op: str = "avg", async_op: bool = False
    ) -> Work | None:
        """`output = op over ranks q of input_q[r*s:(r+1)*s]`, `input.numel() == N * s`."""
        ...

    def all_reduce(self, tensor: Tensor, *, op: str = "sum", async_op: bool = False) -> Work | None:
        """In place: `tensor = op over ranks q of tensor_q`."""
        ...

    def broadcast(self, tensor: Tensor, *, src: int = 0, async_op: bool = False) -> Work | None:
        """In place: `tensor = tensor of rank src`."""
        ...

    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""
        ...


# ----------------------------------------------------------------------------------------------
# Byte accounting


def ring_bytes(kind: str, numel: int, itemsize: int, world_size: int) -> int:
    """Bytes one rank sends for one collective under ring accounting (see the module note).

    Args:
        kind: One of `COLLECTIVES`.
        numel: P, the element count of the big side (all-gather output, reduce-scatter input,
            all-reduce or broadcast tensor).
        itemsize: Bytes per element.
        world_size: N.

    Returns:
        `P * itemsize * (N-1) // N`, twice that (before rounding) for an all-reduce; 0 when N == 1.

    Raises:
        ValueError: On an unknown kind or a negative size, or world_size < 1.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVES}")
    if numel < 0 or itemsize < 0 or world_size < 1:
        raise ValueError(
            f"ring_bytes needs numel >= 0, itemsize >= 0 and world_size >= 1; "
            f"got {numel=}, {itemsize=}, {world_size=}"
        )
    factor = 2 if kind == "all_reduce" else 1
    return factor * numel * itemsize * (world_size - 1) // world_size


def _zeros() -> dict[str, int]:
    return dict.fromkeys(COLLECTIVES, 0)


@dataclass
class CommCounters:
    """Bytes sent and calls issued by one rank, per kind of collective (ring accounting).

    Attributes:
        bytes_sent: Bytes per kind, `ring_bytes` of every collective issued.
        calls: Number of collectives issued per kind.
    """

    bytes_sent: dict[str, int] = field(default_factory=_zeros)
    calls: dict[str, int] = field(default_factory=_zeros)

    def record(self, kind: str, nbytes: int) -> None:
        """Count one collective of `kind` that sends `nbytes`."""
        self.bytes_sent[kind] += nbytes
        self.calls[kind] += 1

    def total(self) -> int:
        """Total bytes sent over all kinds."""
        return sum(self.bytes_sent.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A copy: `{"bytes": {kind: int}, "calls": {kind: int}}` over every kind in COLLECTIVES."""
        return {"bytes": dict(self.bytes_sent), "calls": dict(self.calls)}

    def reset(self) -> None:
        """Set every count back to zero."""
        for kind in COLLECTIVES:
            self.bytes_sent[kind] = 0
            self.calls[kind] = 0


# ----------------------------------------------------------------------------------------------
# Validation (identical for every implementation)


def _check_tensor(coll: str, rank: int, name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{coll} on rank {rank}: {name} must be a torch.Tensor, got {type(t)!r}")
    if t.dim() != 1:
        raise ValueError(
            f"{coll} on rank {rank}: {name} must be 1-D, got shape {tuple(t.shape)}; "
            f"flatten it first (e.g. {name}.view(-1))"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{coll} on rank {rank}: {name} must be contiguous, got stride {t.stride()}"
        )
    return t


def _check_pair(coll: str, rank: int, output: object, input: object) -> tuple[Tensor, Tensor]:
    out = _check_tensor(coll, rank, "output", output)
    inp = _check_tensor(coll, rank, "input", input)
    if out.dtype != inp.dtype:
        raise TypeError(
            f"{coll} on rank {rank}: output.dtype={out.dtype} differs from input.dtype={inp.dtype}"
        )
    if out.device != inp.device:
        raise ValueError(
            f"{coll} on rank {rank}: output.device={out.device} differs from "
            f"input.device={inp.device}"
        )
    return out, inp


def _check_op(coll: str, rank: int, op: object, allowed: tuple[str, ...], t: Tensor) -> str:
    if op not in allowed:
        raise ValueError(f"{coll} on rank {rank}: op={op!r} is not one of {allowed}")
    if op == "avg" and not (t.is_floating_point() or t.is_complex()):
        raise TypeError(
            f"{coll} on rank {rank}: op='avg' needs a floating-point tensor, got dtype={t.dtype}"
        )
    return str(op)


class CommBase:
    """Validation and byte accounting shared by every `Comm` implementation.

    Subclasses implement `_all_gather`, `_reduce_scatter`, `_all_reduce`, `_broadcast` and
    `barrier`; the public methods validate their arguments (before any communication), count the
    bytes, then call them. Validation only looks at this rank's arguments, so a bad call raises
    on the rank that made it.

    Args:
        rank: This process's rank in `range(world_size)`.
        world_size: Number of ranks, at least 1.

    Raises:
        ValueError: If `world_size < 1` or `rank` is out of range.
    """

    rank: int
    world_size: int
    counters: CommCounters

    def __init__(self, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank=}, {world_size=}")
        self.rank = rank
        self.world_size = world_size
        self.counters = CommCounters()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    def _count(self, kind: str, big: Tensor) -> None:
        self.counters.record(
            kind, ring_bytes(kind, big.numel(), big.element_size(), self.world_size)
        )

    def all_gather(self, output: Tensor, input: Tensor, *, async_op: bool = False) -> Work | None:
        """All-gather: `output[q*s:(q+1)*s] = input_q` on every rank, `s = input.numel()`.

        Args:
            output: Contiguous 1-D tensor of `world_size * input.numel()` elements.
            input: This rank's contiguous 1-D contribution, same dtype and device as `output`.
            async_op: Return a `Work` handle instead of waiting.

        Returns:
            A `Work` handle if `async_op`, else None.

        Raises:
            TypeError: On a non-tensor or mismatched dtypes.
            ValueError: On a wrong shape, layout, device or size.
        """
        out, inp = _check_pair("all_gather", self.rank, output, input)
        if out.numel() != self.world_size * inp.numel():
            raise ValueError(
                f"all_gather on rank {self.rank}: output.numel()={out.numel()} must equal "
                f"world_size * input.numel() = {self.world_size} * {inp.numel()} = "
                f"{self.world_size * inp.numel()}"
            )
        self._count("all_gather", out)
        return self._all_gather(out, inp, async_op)

    def reduce_scatter(
        self, output: Tensor, input: Tensor, *, op: str = "avg", async_op: bool = False
    ) -> Work | None:
        """Reduce-scatter: `output = op over ranks q of input_q[r*s:(r+1)*s]` on rank r.

        Args:
            output: Contiguous 1-D tensor of s elements, receives this rank's reduced chunk.
            input: Contiguous 1-D tensor of `world_size * s` elements, same dtype and device.
                It is scratch: its contents are unspecified afterwards (a transport may reduce
                in place).
            op: "sum" or "avg" (the sum divided by world_size).
            async_op: Return a `Work` handle instead of waiting.

        Returns:
            A `Work` handle if `async_op`, else None.

        Raises:
            TypeError: On a non-tensor, mismatched dtypes, or "avg" on an integer dtype.
            ValueError: On a wrong shape, layout, device, size or op.
        """
        out, inp = _check_pair("reduce_scatter", self.rank, output, input)
        if inp.numel() != self.world_size * out.numel():
            raise ValueError(
                f"reduce_scatter on rank {self.rank}: input.numel()={inp.numel()} must equal "
                f"world_size * output.numel() = {self.world_size} * {out.numel()} = "
                f"{self.world_size * out.numel()}"
            )
        op = _check_op("reduce_scatter", self.rank, op, REDUCE_SCATTER_OPS, out)
        self._count("reduce_scatter", inp)
        return self._reduce_scatter(out, inp, op, async_op)

    def all_reduce(self, tensor: Tensor, *, op: str = "sum", async_op: bool = False) -> Work | None:
        """All-reduce in place: `tensor = op over ranks q of tensor_q` on every rank.

        Args:
            tensor: Contiguous 1-D tensor, overwritten with the result.
            op: "sum", "avg" (the sum divided by world_size), "max" or "min".
            async_op: Return a `Work` handle instead of waiting.

        Returns:
            A `Work` handle if `async_op`, else None.

        Raises:
            TypeError: On a non-tensor or "avg" on an integer dtype.
            ValueError: On a wrong shape, layout or op.
        """
        t = _check_tensor("all_reduce", self.rank, "tensor", tensor)
        op = _check_op("all_reduce", self.rank, op, ALL_REDUCE_OPS, t)
        self._count("all_reduce", t)
        return self._all_reduce(t, op, async_op)

    def broadcast(self, tensor: Tensor, *, src: int = 0, async_op: bool = False) -> Work | None:
        """Broadcast in place: `tensor = tensor_src` on every rank.

        Args:
            tensor: Contiguous 1-D tensor; read on `src`, overwritten elsewhere.
            src: The source rank, in `range(world_size)` (a rank of this group).
            async_op: Return a `Work` handle instead of waiting.

        Returns:
            A `Work` handle if `async_op`, else None.

        Raises:
            TypeError: On a non-tensor or a non-int src.
            ValueError: On a wrong shape or layout, or src out of range.
        """
        t = _check_tensor("broadcast", self.rank, "tensor", tensor)
        if isinstance(src, bool) or not isinstance(src, int):
            raise TypeError(f"broadcast on rank {self.rank}: src must be an int, got {src!r}")
        if not 0 <= src < self.world_size:
            raise ValueError(
                f"broadcast on rank {self.rank}: src={src} is not in range(world_size="
                f"{self.world_size})"
            )
        self._count("broadcast", t)
        return self._broadcast(t, src, async_op)

    def barrier(self) -> None:
        """Block until every rank of the group has called `barrier`."""
        raise NotImplementedError

    # Implementations receive validated arguments and must honour async_op.
    def _all_gather(self, output: Tensor, input: Tensor, async_op: bool) -> Work | None:
        raise NotImplementedError

    def _reduce_scatter(
        self, output: Tensor, input: Tensor, op: str, async_op: bool
    ) -> Work | None:
        raise NotImplementedError

    def _all_reduce(self, tensor: Tensor, op: str, async_op: bool) -> Work | None:
        raise NotImplementedError

    def _broadcast(self, tensor: Tensor, src: int, async_op: bool) -> Work | None:
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------
# torch.distributed


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
    epilogue once."""

    __slots__ = ("_works", "_timeout", "_then")

    def __init__(
        self, work: Any, timeout: timedelta | None, then: Callable[[], object] | None
    ) -> None:
        self._works = work if isinstance(work, list) else [work]
        self._timeout = timeout
        self._then = then

    def wait(self) -> None:
        for work in self._works:
            if self._timeout is None:
                work.wait()
            else:
                work.wait(self._timeout)
        then, self._then = self._then, None
        if then is not None:
            then()

    def is_completed(self) -> bool:
        return all(bool(work.is_completed()) for work in self._works)


def _as_timedelta(timeout: timedelta | float | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=timeout)
    raise TypeError(f"timeout must be a timedelta, positive seconds or None, got {timeout!r}")


class TorchComm(CommBase):
    """`Comm` over a `torch.distributed` process group (gloo on CPU, NCCL on CUDA).

    Uses the single-tensor collectives (`all_gather_single` / `reduce_scatter_single`, or their
    pre-2.13 names), so no per-rank tensor lists are built. "avg" uses `ReduceOp.AVG`; if the
    backend rejects it (gloo before torch 2.13 does, identically on every rank and before any
    communication), this comm switches to SUM followed by a division by world_size, which is
    what AVG computes.

    Args:
        group: The process group; None for the default group.
        timeout: If given, the CPU-side wait of every collective is bounded by it (on NCCL this
            makes `wait()` block the CPU). None: the group's own timeout applies.
        transport: ``"single"`` or ``"per_rank"`` (see above); None picks by backend.

    Attributes:
        group: The process group (None: the default group).
        backend: The group's backend name, e.g. "gloo" or "nccl".
        device: Where this comm's tensors live: the current CUDA device for NCCL, else CPU.

    Raises:
        ValueError: If no process group is initialized or this process is not in `group`.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        timeout: timedelta | float | None = None,
        transport: str | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(NO_GROUP_HELP)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not in {group=}")
        super().__init__(rank, dist.get_world_size(group))
        self.group = group
        self.backend = str(dist.get_backend(group))
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.timeout = _as_timedelta(timeout)
        self._ops = _single_tensor_collectives()
        self._native_avg = True
        if transport is None:
            transport = "per_rank" if self.backend == "gloo" else "single"
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport = transport
        self._global_ranks = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)
        ]

    def _issue(
        self,
        start: Callable[[bool], Any],
        async_op: bool,
        then: Callable[[], object] | None = None,
    ) -> Work | None:
        if async_op or self.timeout is not None or self.transport == "per_rank":
            work = _TorchWork(start(True), self.timeout, then)
            if async_op:
                return work
            work.wait()
            return None
        start(False)
        if then is not None:
            then()
        return None

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

    def _all_gather(self, output: Tensor, input: Tensor, async_op: bool) -> Work | None:
        if self.transport == "per_rank":
            s = input.numel()
            output[self.rank * s : (self.rank + 1) * s].copy_(input)
            works = [
                dist.broadcast(output[q * s : (q + 1) * s], src=src, group=self.group,
                               async_op=True)
                for q, src in enumerate(self._global_ranks)
            ]
            return self._issue(lambda a: works, async_op)
        fn = self._ops.all_gather
        return self._issue(lambda a: fn(output, input, group=self.group, async_op=a), async_op)

    def _reduce_scatter(
        self, output: Tensor, input: Tensor, op: str, async_op: bool
    ) -> Work | None:
        if self.transport == "per_rank":
            s, n = output.numel(), self.world_size
            works = [
                dist.reduce(input[q * s : (q + 1) * s], dst=dst, op=dist.ReduceOp.SUM,
                            group=self.group, async_op=True)
                for q, dst in enumerate(self._global_ranks)
            ]
            mine = input[self.rank * s : (self.rank + 1) * s]

            def finish() -> None:
                output.copy_(mine)
                if op == "avg":
                    output.div_(n)  # what ReduceOp.AVG computes: the sum divided by N

            return self._issue(lambda a: works, async_op, then=finish)
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


# ----------------------------------------------------------------------------------------------
# Consistency checks across ranks


def _fingerprint_int64(value: int | str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def fingerprint_check(comm: Comm, value: int | str, what: str) -> None:
    """Raise on every rank if `value` is not the same on all ranks of `comm`.

    All-gathers one int64 per rank (the value itself if it fits, else a 64-bit hash of its repr)
    and compares every rank's with rank 0's. Every rank sees the same gathered tensor, so every
    rank decides alike: all raise or none does, and the group stays usable either way. It is a
    collective: every rank must call it.

    Args:
        comm: The communicator; its `device` attribute, if any, places the tensors (CPU else).
        value: An int or a str, e.g. a layout fingerprint.
        what: What the value is, for the error message (e.g. "layout fingerprint").

    Raises:
        TypeError: If `value` is not an int or a str.
        ValueError: Naming the ranks whose value differs from rank 0's, with both values.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(
            f"fingerprint_check({what!r}): value must be an int or a str, got {value!r}"
        )
    device = getattr(comm, "device", torch.device("cpu"))
    mine = torch.tensor([_fingerprint_int64(value)], dtype=torch.int64, device=device)
    every = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather(every, mine)
    values = every.tolist()
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        shown = ", ".join(f"rank {r}: {values[r]:#x}" for r in differ)
        raise ValueError(
            f"{what} differs across ranks: rank 0 has {values[0]:#x}, but {shown} "
            f"(this is rank {comm.rank}, whose {what} is {value!r})"
        )


# ----------------------------------------------------------------------------------------------
# Launching


class LaunchEnv(NamedTuple):
    """Where this process sits in a launch, as read from the environment.

    Attributes:
        launcher: "torchrun" (RANK/WORLD_SIZE/...), "slurm" (SLURM_PROCID/...) or "none".
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank on this node (selects the CUDA device).
        master_addr: Rendezvous host (None when world_size == 1 outside torchrun).
        master_port: Rendezvous port (None when world_size == 1 outside torchrun).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def _require(
    environ: Mapping[str, str], name: str, launcher: str, expected: tuple[str, ...]
) -> str:
    value = environ.get(name)
    if value is None or value == "":
        raise ValueError(
            f"{launcher} launch detected but environment variable {name} is not set; "
            f"expected all of {', '.join(expected)}"
        )
    return value


def _env_int(
    environ: Mapping[str, str], name: str, launcher: str, expected: tuple[str, ...]
) -> int:
    value = _require(environ, name, launcher, expected)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: "gpu[03-05,9],cpu1" -> "gpu03", "a[1-2]-ib" -> "a1-ib"."""
    depth = 0
    end = len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    return re.sub(r"\[([^\],-]*)[^\]]*\]", r"\1", first)


def parse_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Read rank, world size and rendezvous address from a launcher's environment (pure).

    torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) win when RANK
    or WORLD_SIZE is set; else Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and
    MASTER_ADDR, MASTER_PORT; MASTER_ADDR defaults to the first host of SLURM_JOB_NODELIST or
    SLURM_NODELIST) when SLURM_PROCID is set; else a single-process world.

    Args:
        environ: The environment, e.g. `os.environ`.

    Returns:
        The parsed `LaunchEnv`.

    Raises:
        ValueError: Naming a missing or malformed variable, or an inconsistent rank.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        launcher, expected = "torchrun", _TORCHRUN_VARS
        rank = _env_int(environ, "RANK", launcher, expected)
        world_size = _env_int(environ, "WORLD_SIZE", launcher, expected)
        local_rank = _env_int(environ, "LOCAL_RANK", launcher, expected)
        addr: str | None = _require(environ, "MASTER_ADDR", launcher, expected)
        port: int | None = _env_int(environ, "MASTER_PORT", launcher, expected)
    elif "SLURM_PROCID" in environ:
        launcher = "slurm"
        expected = (*_SLURM_VARS, "MASTER_PORT")
        rank = _env_int(environ, "SLURM_PROCID", launcher, expected)
        world_size = _env_int(environ, "SLURM_NTASKS", launcher, expected)
        local_rank = _env_int(environ, "SLURM_LOCALID", launcher, expected)
        addr = port = None
        if world_size > 1:
            nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
            addr = environ.get("MASTER_ADDR") or (nodelist and _first_slurm_host(nodelist))
            if not addr:
                raise ValueError(
                    "slurm launch detected but neither MASTER_ADDR nor SLURM_JOB_NODELIST / "
                    "SLURM_NODELIST is set: export MASTER_ADDR=<first node's hostname>"
                )
            port = _env_int(environ, "MASTER_PORT", launcher, expected)
    else:
        return LaunchEnv("none", 0, 1, 0, None, None)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ValueError(
            f"{launcher} environment is inconsistent: need 0 <= rank < world_size and "
            f"local_rank >= 0, got {rank=}, {world_size=}, {local_rank=}"
        )
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return LaunchEnv(launcher, rank, world_size, local_rank, addr, port)


def _pick_device(
    backend: str, local_rank: int, device: torch.device | str | int | None
) -> torch.device:
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank < count:
        return torch.device("cuda", local_rank)
    if count == 1:  # one GPU bound per task (e.g. srun --gpus-per-task=1)
        return torch.device("cuda", 0)
    raise ValueError(
        f"LOCAL_RANK={local_rank} but only {count} CUDA devices are visible; "
        f"pass device=... to init_distributed"
    )


def init_distributed(
    backend: str | None = None,
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    device: torch.device | str | int | None = None,
) -> TorchComm:
    """Initialize the default process group from the launcher's environment.

    Reads torchrun's or Slurm's variables (see `parse_launch_env`); with neither, makes a
    single-process world (rank 0 of 1, in-memory store) so scripts run without a launcher.
    If the default group already exists, returns a `TorchComm` over it.

    A process that exits without destroying its group aborts under gloo: prefer
    `with fzero.distributed() as comm:`, or call `destroy_distributed()` at the end.

    Args:
        backend: "nccl" or "gloo"; None: nccl if CUDA is available, else gloo.
        timeout: Timeout of every collective of the group.
        device: CUDA device for this process (NCCL); None: `cuda:LOCAL_RANK` for nccl, CPU
            otherwise. A CUDA device is made current with `torch.cuda.set_device`.

    Returns:
        A `TorchComm` over the default group.

    Raises:
        ValueError: On a missing or malformed launcher variable, or no usable CUDA device.
    """
    if dist.is_initialized():
        return TorchComm()
    env = parse_launch_env(os.environ)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dev = _pick_device(backend, env.local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = dev
    if env.launcher == "torchrun":
        dist.init_process_group(init_method="env://", **kwargs)
    elif env.world_size == 1:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        host = f"[{env.master_addr}]" if ":" in str(env.master_addr) else env.master_addr
        dist.init_process_group(
            init_method=f"tcp://{host}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            **kwargs,
        )
    return TorchComm()


def destroy_distributed() -> None:
    """Destroy the default process group if there is one (no-op otherwise)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(
    backend: str | None = None,
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    device: torch.device | str | int | None = None,
) -> Iterator[TorchComm]:
    """`init_distributed` for a `with` block; destroys the group on exit if it created it.

    Args:
        backend: As in `init_distributed`.
        timeout: As in `init_distributed`.
        device: As in `init_distributed`.

    Yields:
        A `TorchComm` over the default group.
    """
    created = not dist.is_initialized()
    comm = init_distributed(backend, timeout=timeout, device=device)
    try:
        yield comm
    finally:
        if created:
            destroy_distributed()
