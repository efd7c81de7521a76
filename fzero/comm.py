"""The network edge's contract: the `Comm` protocol, its validation and ring byte accounting.

Every collective in fzero goes through an object satisfying `Comm`. Two implementations exist:
`fzero.torchcomm.TorchComm` over a `torch.distributed` process group (gloo on CPU, NCCL on CUDA)
and `fzero.simworld.SimComm`, N ranks in one process. Both inherit `CommBase`, which owns input
validation and byte accounting, so the two cannot drift apart.

All collectives act on contiguous 1-D tensors. With N = world_size, x_r the tensor rank r passes
and s = the per-rank (small side) numel, the collectives are, for every rank r:

    all_gather:      output_r[q*s:(q+1)*s] == input_q                   for q in range(N)
    reduce_scatter:  output_r == reduce(input_q[r*s:(r+1)*s] for q in range(N))   ("sum", "avg")
    all_reduce:      tensor_r <- reduce(tensor_q for q in range(N))  ("sum", "avg", "max", "min")
    broadcast:       tensor_r <- tensor_src

"avg" is the sum divided by N (not a sum of pre-divided terms): that is what gloo's
`ReduceOp.AVG` computes (NCCL's multiplies each term by 1/N first for floating types, so its
last bits may differ; fzero's float16 gradient means divide first themselves, as the sum could
overflow: `fzero.collect.predivided`). A reduce-scatter's input is scratch: its contents are
unspecified afterwards (`TorchComm` over gloo reduces in place).

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
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "ALL_REDUCE_OPS",
    "COLLECTIVES",
    "REDUCE_SCATTER_OPS",
    "CollectiveError",
    "CollectiveTimeout",
    "Comm",
    "CommBase",
    "CommCounters",
    "Work",
    "check_comm",
    "describe_parts",
    "differing_parts",
    "fingerprint_check",
    "ring_bytes",
]

COLLECTIVES: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
"""The kinds of collective `CommCounters` counts, in a fixed order."""
REDUCE_SCATTER_OPS: tuple[str, ...] = ("sum", "avg")
"""Reductions `Comm.reduce_scatter` accepts."""
ALL_REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")
"""Reductions `Comm.all_reduce` accepts."""

_DIGESTS_KEPT = 4096  # collective codes a comm remembers the hash of
_SIGNATURE_MODULUS = 2**61 - 1  # a Mersenne prime: signatures fit in an int64


# ----------------------------------------------------------------------------------------------
# Protocols


@runtime_checkable
class Work(Protocol):
    """Handle of an asynchronous collective (`async_op=True`).

    The results are in the caller's tensors once `wait()` has returned (on CUDA: once the
    current stream reaches the point where `wait()` was called). `wait()` may be called again,
    also from another thread: it then returns at once on the host, and on CUDA orders the
    calling thread's current stream as the first call did (`fzero.collect.Pending` waits on a
    helper thread first, then on the thread that reads the output).
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

    def all_gather(
        self, output: Tensor, input: Tensor, *, async_op: bool = False, label: str | None = None
    ) -> Work | None:
        """`output[q*s:(q+1)*s] = input of rank q`, with `output.numel() == N * input.numel()`.
        `label` names what is moved in error messages (every collective takes one); every
        rank passes the same label to the same collective (`SimWorld` checks it, so that two
        same-size tensors issued in different orders on two ranks raise there)."""
        ...

    def reduce_scatter(
        self,
        output: Tensor,
        input: Tensor,
        *,
        op: str = "avg",
        async_op: bool = False,
        label: str | None = None,
    ) -> Work | None:
        """`output = op over ranks q of input_q[r*s:(r+1)*s]`, `input.numel() == N * s`."""
        ...

    def all_reduce(
        self, tensor: Tensor, *, op: str = "sum", async_op: bool = False, label: str | None = None
    ) -> Work | None:
        """In place: `tensor = op over ranks q of tensor_q`."""
        ...

    def broadcast(
        self, tensor: Tensor, *, src: int = 0, async_op: bool = False, label: str | None = None
    ) -> Work | None:
        """In place: `tensor = tensor of rank src`."""
        ...

    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""
        ...

    def channel(self, name: str, *, host: bool = False) -> Comm:
        """A communicator over the same ranks whose collectives form their own sequence.

        Collectives on different channels are matched independently: every rank must issue the
        same sequence on each channel, but the interleaving between channels may differ between
        ranks. ``host=True`` asks for CPU tensors (a gloo group beside NCCL), for small control
        messages that must not wait on the device. Each channel counts its own bytes. The first
        call for a name is a collective (every rank must make it); later calls return the same
        channel.
        """
        ...

    @property
    def signature(self) -> int:
        """A running hash of every collective this comm issued (kind, op, sizes, dtype)."""
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


class CollectiveError(RuntimeError):
    """A collective failed: the message names it (kind, number, channel, bucket), what this rank
    was doing (the comm's `scope`), and the transport's own error (its ``__cause__``)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete in time: some rank did not take part. The message names
    the ranks that did not arrive where the transport can tell (always in `SimWorld`; over
    gloo or NCCL only for two ranks, where it can only be the other one)."""


class _Scope:
    """What the ranks are doing (e.g. "train step 12, micro-batch 2/4"), shared by a comm and
    its channels, for error messages."""

    __slots__ = ("text",)

    def __init__(self) -> None:
        self.text = ""


class _Fault:
    """The collective that timed out on a comm, shared by the comm and its channels: after
    it, the ranks' sequences no longer match (some ranks took part, the late one will call it
    later, gloo has closed its connections), so no later collective can succeed."""

    __slots__ = ("text",)

    def __init__(self) -> None:
        self.text = ""


class _Explained:
    """A `Work` whose failures are re-raised as `CollectiveError`, naming the collective."""

    __slots__ = ("_work", "_explain")

    def __init__(self, work: Work, explain: Callable[[BaseException], BaseException]) -> None:
        self._work = work
        self._explain = explain

    def wait(self) -> None:
        try:
            self._work.wait()
        except (CollectiveError, ValueError, TypeError):
            raise
        except Exception as exc:
            raise self._explain(exc) from exc

    def is_completed(self) -> bool:
        return self._work.is_completed()


class CommBase:
    """Validation, byte accounting and error context shared by every `Comm` implementation.

    Subclasses implement `_all_gather`, `_reduce_scatter`, `_all_reduce`, `_broadcast`,
    `_open_channel` and `barrier`; the public methods validate their arguments (before any
    communication), count the bytes, fold the call into `signature`, then call them. Validation
    only looks at this rank's arguments, so a bad call raises on the rank that made it. A
    failure or timeout of the transport is re-raised as `CollectiveError` /
    `CollectiveTimeout`, naming the collective's kind, its number on its channel, its `label`
    (e.g. the bucket), the comm's `scope` (e.g. the train step) and, where the transport can
    tell, the ranks that did not arrive.

    Args:
        rank: This process's rank in `range(world_size)`.
        world_size: Number of ranks, at least 1.

    Raises:
        ValueError: If `world_size < 1` or `rank` is out of range.
    """

    rank: int
    world_size: int
    counters: CommCounters
    in_place: bool = False
    """Whether an all-gather may take as input this rank's chunk of its own output, and a
    reduce-scatter may write into this rank's chunk of its own input (no extra buffer). Set by
    implementations that are known to handle it."""

    def __init__(self, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank=}, {world_size=}")
        self.rank = rank
        self.world_size = world_size
        self.counters = CommCounters()
        self.name = "main"
        self._signature = 0
        self._digests: dict[tuple[int, str | None, int, str], int] = {}  # `_count`'s, by code
        self._issued = 0
        self._channels: dict[str, Comm] = {}
        self._scope = _Scope()
        self._fault = _Fault()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    @contextlib.contextmanager
    def scope(self, text: str) -> Iterator[None]:
        """Name what the ranks are doing (e.g. ``"train step 12"``) in collective errors of this
        comm and its channels, for the duration of the block."""
        before = self._scope.text
        self._scope.text = text
        try:
            yield
        finally:
            self._scope.text = before

    def _missing_ranks(self) -> str:
        """Which ranks did not arrive at a timed-out collective, as far as this comm knows."""
        if self.world_size == 2:
            return f"rank {1 - self.rank} (the only other rank) did not arrive"
        return ("the transport does not say which ranks did not arrive: look for the rank whose "
                "log stops earliest")

    def _lost_peer(self, error: str) -> str:
        """For a transport error saying a connection broke: which rank that can be, as far as
        this comm knows (the transport names only an address)."""
        lost = ("connection closed", "connection reset", "broken pipe", "read error",
                "write error")
        if not any(word in error.lower() for word in lost):
            return ""
        if self.world_size == 2:
            return (f"; the connection to rank {1 - self.rank} (the only other rank) broke: "
                    f"it most likely exited or crashed (see its log)")
        return ("; a connection to another rank broke: one most likely exited or crashed (the "
                "transport names only its address: look for the rank whose log ends first)")

    def _named(
        self, kind: str, label: str | None, start: Callable[[], Work | None]
    ) -> Work | None:
        """Run an implementation's `start`; give its failures a name (see the class doc)."""
        number = self._issued
        self._issued += 1
        issued_at = time.monotonic()

        def explain(exc: BaseException) -> BaseException:
            where = f" {label}" if label else ""
            channel = "" if self.name == "main" else f" on channel {self.name!r}"
            scope = f" during {self._scope.text}" if self._scope.text else ""
            text = (f"{kind} #{number}{channel}{where}{scope}, rank {self.rank} of "
                    f"{self.world_size}, {time.monotonic() - issued_at:.1f} s after it was "
                    f"issued: {type(exc).__name__}: {exc}")
            if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or (
                    "timeout" in str(exc).lower()):
                missing = "" if "never joined" in str(exc) else f"; {self._missing_ranks()}"
                self._fault.text = self._fault.text or f"{kind} #{number}{channel}{where}{scope}"
                return CollectiveTimeout(text + missing)
            return CollectiveError(text + self._lost_peer(str(exc)))

        if self._fault.text:
            raise CollectiveError(
                f"{kind}{f' {label}' if label else ''} on rank {self.rank}: this comm can no "
                f"longer communicate, since {self._fault.text} timed out (its ranks no longer "
                f"issue matching collectives, and gloo closes the connections, NCCL aborts): "
                f"start the job again (resume from a checkpoint)")
        self._check_open(kind)
        try:
            work = start()
        except (CollectiveError, ValueError, TypeError):
            raise
        except Exception as exc:
            raise explain(exc) from exc
        return None if work is None else _Explained(work, explain)

    def _check_open(self, kind: str) -> None:
        """Raise if this comm can no longer communicate (an implementation's own check)."""

    @property
    def signature(self) -> int:
        """A running hash of every collective issued on this comm: kind, op, numel and dtype.

        Ranks that issued the same collectives in the same order have equal signatures; the
        train step compares them before it applies an update (see `fzero.schedule`).
        """
        return self._signature

    def channel(self, name: str, *, host: bool = False) -> Comm:
        """A communicator over the same ranks whose collectives form their own sequence.

        Collectives on different channels are matched independently: every rank must issue the
        same sequence on each channel, but their interleaving may differ between ranks (stage 3
        all-gathers parameters on one channel while it reduce-scatters gradients on another).
        ``host=True`` asks for a channel whose tensors live on the CPU (gloo beside NCCL), for
        small control messages that must not wait on the device. A channel counts its own
        bytes and has its own `signature`; it shares this comm's `scope`.

        The first call for a name is a collective: every rank must make it, in the same order.
        Later calls return the same channel.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a channel needs a non-empty str name, got {name!r}")
        key = f"{name}@host" if host else name
        if key not in self._channels:
            opened: list[Comm] = []  # (a collective: a rank that never comes times it out)
            self._named("new_group", f"opening channel {key!r}",
                        lambda: opened.append(self._open_channel(key, host)))
            channel = opened[0]
            if isinstance(channel, CommBase):
                channel.name = key
                channel._scope = self._scope
                channel._fault = self._fault
            self._channels[key] = channel
        return self._channels[key]

    def _count(self, kind: str, big: Tensor, op: str | None = None) -> None:
        self.counters.record(
            kind, ring_bytes(kind, big.numel(), big.element_size(), self.world_size)
        )
        code = (COLLECTIVES.index(kind), op, big.numel(), str(big.dtype))
        digest = self._digests.get(code)
        if digest is None:  # a step issues the same few codes every time: hash each once
            digest = int.from_bytes(
                hashlib.blake2b(repr(code).encode(), digest_size=8).digest(), "little")
            if len(self._digests) >= _DIGESTS_KEPT:  # sizes that vary: bounded, not a leak
                self._digests.clear()
            self._digests[code] = digest
        self._signature = (self._signature * 1_000_003 + digest) % _SIGNATURE_MODULUS

    def all_gather(
        self, output: Tensor, input: Tensor, *, async_op: bool = False, label: str | None = None
    ) -> Work | None:
        """All-gather: `output[q*s:(q+1)*s] = input_q` on every rank, `s = input.numel()`.

        Args:
            output: Contiguous 1-D tensor of `world_size * input.numel()` elements.
            input: This rank's contiguous 1-D contribution, same dtype and device as `output`.
            async_op: Return a `Work` handle instead of waiting.
            label: What is moved (e.g. ``"bucket 'blocks.3'"``), for error messages.

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
        return self._named("all_gather", label, lambda: self._all_gather(out, inp, async_op))

    def reduce_scatter(
        self,
        output: Tensor,
        input: Tensor,
        *,
        op: str = "avg",
        async_op: bool = False,
        label: str | None = None,
    ) -> Work | None:
        """Reduce-scatter: `output = op over ranks q of input_q[r*s:(r+1)*s]` on rank r.

        Args:
            output: Contiguous 1-D tensor of s elements, receives this rank's reduced chunk.
            input: Contiguous 1-D tensor of `world_size * s` elements, same dtype and device.
                It is scratch: its contents are unspecified afterwards (a transport may reduce
                in place).
            op: "sum" or "avg" (the sum divided by world_size).
            async_op: Return a `Work` handle instead of waiting.
            label: What is moved, for error messages.

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
        self._count("reduce_scatter", inp, op)
        return self._named("reduce_scatter", label,
                           lambda: self._reduce_scatter(out, inp, op, async_op))

    def all_reduce(
        self, tensor: Tensor, *, op: str = "sum", async_op: bool = False, label: str | None = None
    ) -> Work | None:
        """All-reduce in place: `tensor = op over ranks q of tensor_q` on every rank.

        Args:
            tensor: Contiguous 1-D tensor, overwritten with the result.
            op: "sum", "avg" (the sum divided by world_size), "max" or "min".
            async_op: Return a `Work` handle instead of waiting.
            label: What is reduced, for error messages.

        Returns:
            A `Work` handle if `async_op`, else None.

        Raises:
            TypeError: On a non-tensor or "avg" on an integer dtype.
            ValueError: On a wrong shape, layout or op.
        """
        t = _check_tensor("all_reduce", self.rank, "tensor", tensor)
        op = _check_op("all_reduce", self.rank, op, ALL_REDUCE_OPS, t)
        self._count("all_reduce", t, op)
        return self._named("all_reduce", label, lambda: self._all_reduce(t, op, async_op))

    def broadcast(
        self, tensor: Tensor, *, src: int = 0, async_op: bool = False, label: str | None = None
    ) -> Work | None:
        """Broadcast in place: `tensor = tensor_src` on every rank.

        Args:
            tensor: Contiguous 1-D tensor; read on `src`, overwritten elsewhere.
            src: The source rank, in `range(world_size)` (a rank of this group).
            async_op: Return a `Work` handle instead of waiting.
            label: What is sent, for error messages.

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
        return self._named("broadcast", label, lambda: self._broadcast(t, src, async_op))

    def barrier(self) -> None:
        """Block until every rank of the group has called `barrier`."""
        raise NotImplementedError

    # Implementations receive validated arguments and must honour async_op.
    def _open_channel(self, name: str, host: bool) -> Comm:
        raise NotImplementedError

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
# Consistency checks across ranks


def _fingerprint_int64(value: int | str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def check_comm(comm: object, what: str) -> Comm:
    """`comm` itself if it is a communicator, else a TypeError naming `what` needs one."""
    if not isinstance(comm, Comm):
        raise TypeError(
            f"{what} needs comm=, a communicator (fzero.TorchComm, or the comm a SimWorld rank "
            f"gets), got {type(comm).__name__}"
        )
    return comm


def fingerprint_check(
    comm: Comm, value: int | str, what: str, parts: Mapping[str, str] | None = None
) -> None:
    """Raise on every rank if `value` is not the same on all ranks of `comm`.

    All-gathers one int64 per rank (the value itself if it fits, else a 64-bit hash of its repr)
    and compares every rank's with rank 0's. Every rank sees the same gathered tensor, so every
    rank decides alike: all raise or none does, and the group stays usable either way. It is a
    collective: every rank must call it.

    Args:
        comm: The communicator; its `device` attribute, if any, places the tensors (CPU else).
        value: An int or a str, e.g. a layout fingerprint.
        what: What the value is, for the error message (e.g. "layout fingerprint").
        parts: What `value` is made of, by name (the same names on every rank): when the
            values differ, one more collective finds the parts that do, and the error names
            them with this rank's value of each (`differing_parts`).

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
    comm.all_gather(every, mine, label=f"of the {what}")
    values = every.tolist()
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        shown = ", ".join(f"rank {r}: {values[r]:#x}" for r in differ)
        named = "" if parts is None else "; " + describe_parts(
            differing_parts(comm, parts, what), parts)
        raise ValueError(
            f"{what} differs across ranks: rank 0 has {values[0]:#x}, but {shown} (this is "
            f"rank {comm.rank}){named}"
        )


def differing_parts(comm: Comm, parts: Mapping[str, str], what: str) -> list[str]:
    """The names of `parts` whose values are not the same on every rank (a collective: one
    int64 hash per part; every rank must pass the same names, in the same order, and gets the
    same answer)."""
    device = getattr(comm, "device", torch.device("cpu"))
    mine = torch.tensor([_fingerprint_int64(v) for v in parts.values()], dtype=torch.int64,
                        device=device)
    every = torch.empty(comm.world_size * len(parts), dtype=torch.int64, device=device)
    comm.all_gather(every, mine, label=f"of the parts of the {what}")
    rows = every.view(comm.world_size, len(parts)).tolist()
    return [name for column, name in enumerate(parts)
            if len({row[column] for row in rows}) > 1]


def describe_parts(names: Sequence[str], parts: Mapping[str, str], limit: int = 300) -> str:
    """``"they differ in: <name> (this rank: <value>), ..."`` for the parts `names`."""
    if not names:
        return "no part of it differs (a hash collision or a bug: please report it)"
    shown = [f"{name} (this rank: {_clipped(parts[name], limit)})" for name in names]
    return "they differ in: " + ", ".join(shown)


def _clipped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


