"""N simulated ranks in one process: `SimWorld(n).run(fn, *args)` and its `SimComm`.

Each rank runs `fn(comm, *args, **kwargs)` in its own thread (torch kernels release the GIL) with
a `SimComm`, which implements the `fzero.comm.Comm` protocol in memory. It inherits validation
and byte accounting from `CommBase`, so counters and error messages are those of `TorchComm`.

[Note: SimWorld semantics]
- Matching: every rank numbers its collectives 0, 1, 2, ... per channel (`SimComm.channel`);
  the collectives with the same channel and number must agree on kind, sizes, dtype, op and
  src, else every rank fails with an error naming both calls.
- Numerics: reductions add the ranks' tensors in rank order, in the tensors' dtype; "avg" is that
  sum divided by N. At 2 ranks this is bitwise what gloo computes (gloo's AVG is also sum then
  divide); at 3+ ranks gloo sums each chunk in ring order, so results agree within rounding.
- Results are computed into fresh tensors, then copied into each rank's own output: no aliasing
  between ranks, and outputs may alias inputs.
- `async_op=True` really is asynchronous: each rank has a one-thread executor running its
  collectives in issue order; `wait()` blocks on it. Synchronous calls go through the same
  executor, so they are ordered after pending async ones as in torch.distributed.
- Streams are not simulated: a collective on CUDA tensors runs on its executor thread's current
  stream (the device's default stream), not on the stream it was issued from, so a rank that
  reads an output without waiting may still see it filled. Test stream ordering over NCCL.
- Failure: the first exception on any rank aborts the world; collectives pending on the other
  ranks raise at once, and `run` raises `SimWorldError` naming the failing rank, chained to the
  original. A collective that a rank finished without joining fails at once; one that a live rank
  does not join within `timeout` seconds fails naming the collective and the missing ranks.
- Process-global state is shared: ranks are threads of one process, so torch's default RNG is
  one for all of them. Two ranks seeding it at once (`torch.manual_seed`, `fork_rng`) race, and
  may each draw from the other's seed; draw from a per-rank `torch.Generator`, or build seeded
  models under one `threading.Lock`, or before `run` (arguments are deep-copied per rank).
  Dropout draws from that generator too, and torch's parametrization cache
  (`torch.nn.utils.parametrize.cached`) is process-wide: ranks using either are not
  reproducible here; run them as gloo processes.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from fzero.comm import CommBase, Work

__all__ = ["SimComm", "SimWorld", "SimWorldError"]

_MAIN = "main"  # the channel of a `SimComm` made by `SimWorld.run`


class SimWorldError(RuntimeError):
    """A rank of a `SimWorld.run` failed; `__cause__` is its original exception.

    Attributes:
        rank: The failing rank (the lowest one among ranks that failed on their own, rather than
            because another rank's failure aborted the world).
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class _Aborted(RuntimeError):
    """A collective released because another rank failed (a secondary failure)."""


def _mend_parameter_copies(
    args: tuple[Any, ...], kwargs: dict[str, Any], copied: tuple[Any, Any]
) -> None:
    """Put back, or refuse, what torch's deep copy of a parameter drops, in `copied` (a
    ``copy.deepcopy((args, kwargs))``): a parameter's Python attributes (``p.flag = ...``,
    Hugging Face's ``_is_hf_initialized``; forward code may read them) are copied onto the
    copy's parameter; gradient hooks (``p.register_hook``), which a copy would silently lose,
    raise (each rank training without them would differ from the processes it simulates)."""
    pairs = itertools.chain(
        *(_parameter_pairs(a, b, f"argument {i}") for i, (a, b) in enumerate(
            zip(args, copied[0], strict=True))),
        *(_parameter_pairs(a, copied[1][key], f"argument {key}") for key, a in kwargs.items()))
    for name, original, twin in pairs:
        if original._backward_hooks or original._post_accumulate_grad_hooks:
            raise ValueError(
                f"SimWorld.run gives each rank a deep copy of its arguments, and the copy of "
                f"parameter {name} would not carry the gradient hooks registered on it: "
                f"register them inside the rank's function, or build the model there, or "
                f"share the arguments (SimWorld(..., copy_args=False))"
            )
        if original.__dict__ and not twin.__dict__:
            twin.__dict__.update(copy.deepcopy(original.__dict__))


def _parameter_pairs(
    original: Any, copied: Any, where: str
) -> Iterator[tuple[str, Tensor, Tensor]]:
    """The parameters of the modules (and the bare parameters) in `original`, each named and
    with its counterpart in `copied` (its deep copy), through tuples, lists and dicts."""
    if isinstance(original, torch.nn.Module):
        for (name, a), b in zip(original.named_parameters(), copied.parameters(), strict=True):
            yield f"{name!r} of {where}", a, b
    elif isinstance(original, torch.nn.Parameter):
        yield where, original, copied
    elif isinstance(original, tuple | list):
        for index, (a, b) in enumerate(zip(original, copied, strict=True)):
            yield from _parameter_pairs(a, b, f"{where}[{index}]")
    elif isinstance(original, dict):
        for (key, a), b in zip(original.items(), copied.values(), strict=True):
            yield from _parameter_pairs(a, b, f"{where}[{key!r}]")


def _secondary(error: BaseException | None) -> bool:
    """Whether a rank's error only reports another rank's failure (an aborted collective, or
    a `CollectiveError` explaining one)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:  # a cause chain may loop
        if isinstance(error, _Aborted):
            return True
        seen.add(id(error))
        error = error.__cause__
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    """One rank's side of one collective."""

    kind: str
    op: str | None
    src: int | None
    dtype: torch.dtype | None
    in_numel: int
    out_numel: int
    input: Tensor | None
    output: Tensor | None
    label: str | None = None

    def signature(self) -> tuple[object, ...]:
        return (self.kind, self.op, self.src, self.dtype, self.in_numel, self.out_numel,
                self.label)

    def describe(self) -> str:
        parts = [f"input numel={self.in_numel}", f"output numel={self.out_numel}"]
        if self.label is not None:
            parts.insert(0, f"label={self.label!r}")
        if self.dtype is not None:
            parts.append(f"dtype={self.dtype}")
        if self.op is not None:
            parts.append(f"op={self.op!r}")
        if self.src is not None:
            parts.append(f"src={self.src}")
        return f"{self.kind}({', '.join(parts)})"


class _Slot:
    """The meeting point of collective number `seq`."""

    __slots__ = ("calls", "arrived", "done", "error")

    def __init__(self, n: int) -> None:
        self.calls: list[_Call | None] = [None] * n
        self.arrived = 0
        self.done = False
        self.error: BaseException | None = None


@torch.inference_mode()
def _compute(calls: list[_Call]) -> None:
    """Carry out one matched collective: read every input, then write every output (in
    inference mode: an output a rank made under ``torch.inference_mode()`` is an inference
    tensor, which this thread, outside the rank's mode, could not write; gloo writes it)."""
    kind, n = calls[0].kind, len(calls)
    if kind == "barrier":
        return
    if kind == "all_gather":
        full = torch.cat([c.input for c in calls])  # (n * s,), a fresh tensor
    elif kind == "broadcast":
        full = calls[calls[0].src].input.clone()
    else:  # reduce_scatter, all_reduce: reduce the whole inputs in rank order
        op = calls[0].op
        full = calls[0].input.clone()
        for c in calls[1:]:
            if op in ("sum", "avg"):
                full.add_(c.input)
            elif op == "max":
                torch.maximum(full, c.input, out=full)
            else:
                torch.minimum(full, c.input, out=full)
        if op == "avg":
            full.div_(n)
    if kind == "reduce_scatter":
        s = calls[0].out_numel
        for r, c in enumerate(calls):
            c.output.copy_(full[r * s : (r + 1) * s])
    else:
        for c in calls:
            c.output.copy_(full)


def _stop_briefly(threads: list[threading.Thread], seconds: float = 5.0) -> None:
    """Give interrupted ranks `seconds` to reach a collective, which aborts; warn about any
    still busy outside one (they stop at their next collective)."""
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    busy = [t.name for t in threads if t.is_alive()]
    if busy:
        warnings.warn(f"SimWorld.run was interrupted; {busy} still compute outside any "
                      f"collective and stop at their next one (their results are discarded)",
                      RuntimeWarning, stacklevel=3)


class _World:
    """State shared by the ranks of one `SimWorld.run`."""

    def __init__(self, n: int, timeout: float) -> None:
        self.n = n
        self.timeout = timeout
        self.cond = threading.Condition()
        self.slots: dict[tuple[str, int], _Slot] = {}
        self.finished: set[int] = set()
        self.failed_rank: int | None = None
        self.interrupted = False

    @property
    def stopped(self) -> bool:
        """Whether collectives abort: a rank failed, or the caller of `SimWorld.run` was
        interrupted."""
        return self.failed_rank is not None or self.interrupted

    def fail(self, rank: int) -> None:
        with self.cond:
            if self.failed_rank is None:
                self.failed_rank = rank
            self.cond.notify_all()

    def interrupt(self) -> None:
        """The caller stopped waiting (Ctrl-C in a notebook): every collective aborts, so the
        ranks stop at their next one instead of training on, unseen, in the background."""
        with self.cond:
            self.interrupted = True
            self.cond.notify_all()

    def finish(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self.cond.notify_all()

    def _aborted(self, rank: int, seq: str, call: _Call) -> _Aborted:
        why = (f"rank {self.failed_rank} failed" if self.failed_rank is not None
               else "SimWorld.run was interrupted in the thread that called it")
        return _Aborted(f"{call.kind} #{seq} on rank {rank} aborted: {why}")

    def collective(self, rank: int, channel: str, number: int, call: _Call) -> None:
        seq = f"{number}" if channel == _MAIN else f"{number} on channel {channel!r}"
        with self.cond:
            if self.stopped:
                raise self._aborted(rank, seq, call)
            slot = self.slots.setdefault((channel, number), _Slot(self.n))
            for q, other in enumerate(slot.calls):
                if other is not None and other.signature() != call.signature():
                    raise ValueError(
                        f"collective #{seq} differs across ranks: rank {q} called "
                        f"{other.describe()} but rank {rank} called {call.describe()}"
                    )
            slot.calls[rank] = call
            slot.arrived += 1
            last = slot.arrived == self.n
            if last:
                del self.slots[(channel, number)]
            else:
                self._wait(rank, seq, call, slot)
        if last:
            self._complete(slot)
        if slot.error is not None:
            raise RuntimeError(f"{call.kind} #{seq} failed on rank {rank}") from slot.error

    def _complete(self, slot: _Slot) -> None:
        try:
            _compute(slot.calls)  # outside the lock: other slots may progress meanwhile
        except BaseException as exc:  # handed to every rank of the slot
            slot.error = exc
        with self.cond:
            slot.done = True
            self.cond.notify_all()

    def _wait(self, rank: int, seq: str, call: _Call, slot: _Slot) -> None:
        """Wait (holding `cond`) until `slot` completes, the world fails, or time runs out."""
        deadline = time.monotonic() + self.timeout
        while not slot.done:
            if self.stopped:
                raise self._aborted(rank, seq, call)
            if slot.arrived < self.n:
                missing = [q for q, c in enumerate(slot.calls) if c is None]
                gone = [q for q in missing if q in self.finished]
                if gone:
                    raise RuntimeError(
                        f"{call.describe()} #{seq} on rank {rank}: rank(s) {gone} finished "
                        f"without joining it (ranks missing: {missing})"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{call.describe()} #{seq} on rank {rank} timed out after "
                        f"{self.timeout} s: rank(s) {missing} never joined it"
                    )
                self.cond.wait(remaining)
            else:  # everyone is here; the last rank is computing
                self.cond.wait()


class _SimWork:
    """`Work` handle of an asynchronous `SimComm` collective."""

    __slots__ = ("_future", "waited")

    def __init__(self, future: Future[None]) -> None:
        self._future = future
        self.waited = False

    def wait(self) -> None:
        self.waited = True
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


class SimComm(CommBase):
    """In-memory `Comm` for one rank of a `SimWorld` (made by `SimWorld.run`).

    Attributes:
        rank: This rank.
        world_size: Number of simulated ranks.
        counters: Bytes and calls issued by this rank (same accounting as `TorchComm`).
        device: Always CPU (the device `fingerprint_check` and friends allocate on).
    """

    in_place = True  # results are computed into fresh tensors, then copied

    def __init__(self, world: _World, rank: int, channel: str = "") -> None:
        super().__init__(rank, world.n)
        self.device = torch.device("cpu")
        self._world = world
        self._name = channel or _MAIN
        self._seq = 0
        self._issue_lock = threading.Lock()  # collectives may be issued from side-stream threads
        self._issuing = threading.local()  # the label of the collective this thread issues
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix=f"simworld-rank{rank}-{self._name}"
        )
        self._async: list[_SimWork] = []  # failed or not yet done async collectives

    def _open_channel(self, name: str, host: bool) -> SimComm:
        return SimComm(self._world, self.rank, name)  # no collective needed in one process

    def _named(
        self, kind: str, label: str | None, start: Callable[[], Work | None]
    ) -> Work | None:
        # `start` runs in this thread (side-stream threads issue too): it reads the label here.
        self._issuing.label = label
        try:
            return super()._named(kind, label, start)
        finally:
            self._issuing.label = None

    def _submit(self, call: _Call, async_op: bool) -> Work | None:
        # Ranks must agree on what they move, not only on its size: two same-size buckets
        # issued in different orders would otherwise pair silently (gloo cannot tell them
        # apart; here every call's label is compared).
        call = dataclasses.replace(call, label=getattr(self._issuing, "label", None))
        with self._issue_lock:
            seq, self._seq = self._seq, self._seq + 1
            try:
                future = self._executor.submit(
                    self._world.collective, self.rank, self._name, seq, call)
            except RuntimeError as error:  # the executor was shut down when the run ended
                raise RuntimeError(
                    f"{call.describe()} on SimWorld rank {self.rank} after its SimWorld.run "
                    f"ended: a SimComm, and a state built on it (fzero.init inside the run), "
                    f"can run collectives only inside the run that made it. Do what needs "
                    f"them (a step, stage 3's eval or full_params, save) in the rank "
                    f"function, and return plain tensors (e.g. full_params(state))"
                ) from error
        if async_op:
            work = _SimWork(future)
            self._async = [w for w in self._async if not w._future.done() or (
                w._future.exception() is not None and not w.waited)]
            self._async.append(work)
            return work
        future.result()
        return None

    def _drain(self) -> BaseException | None:
        """Let pending collectives finish (channels too); return the first failure of an async
        collective nobody waited for, if any (none once the comm has timed out: it is given
        up then, with the collectives in flight)."""
        failures = [c._drain() for c in self._channels.values() if isinstance(c, SimComm)]
        self._executor.shutdown(wait=True)
        unwaited = [w._future.exception() for w in self._async
                    if not w.waited and not self._fault.text]
        failures.insert(0, next((e for e in unwaited if e is not None), None))
        return next((f for f in failures if f is not None), None)

    def _all_gather(self, output: Tensor, input: Tensor, async_op: bool) -> Work | None:
        call = _Call(
            "all_gather", None, None, input.dtype, input.numel(), output.numel(), input, output
        )
        return self._submit(call, async_op)

    def _reduce_scatter(
        self, output: Tensor, input: Tensor, op: str, async_op: bool
    ) -> Work | None:
        call = _Call(
            "reduce_scatter", op, None, input.dtype, input.numel(), output.numel(), input, output
        )
        return self._submit(call, async_op)

    def _all_reduce(self, tensor: Tensor, op: str, async_op: bool) -> Work | None:
        n = tensor.numel()
        return self._submit(
            _Call("all_reduce", op, None, tensor.dtype, n, n, tensor, tensor), async_op
        )

    def _broadcast(self, tensor: Tensor, src: int, async_op: bool) -> Work | None:
        n = tensor.numel()
        return self._submit(
            _Call("broadcast", None, src, tensor.dtype, n, n, tensor, tensor), async_op
        )

    def barrier(self) -> None:
        """Block until every simulated rank has called `barrier`."""
        self._submit(_Call("barrier", None, None, None, 0, 0, None, None), async_op=False)


class SimWorld:
    """Run a per-rank function on `n` simulated ranks in threads of this process.

    Args:
        n: Number of ranks (world size), at least 1.
        timeout: Seconds a collective waits for a live rank that has not joined it.
        copy_args: Give each rank its own `copy.deepcopy` of `args` and `kwargs`, as separate
            processes would have (a module is then not shared between threads). Set False to
            share them (e.g. for non-leaf tensors, which cannot be deep-copied).

    Raises:
        ValueError: If `n < 1` or `timeout <= 0`.

    Example:
        >>> def body(comm, x):
        ...     out = torch.empty(comm.world_size * x.numel())
        ...     comm.all_gather(out, x + comm.rank)
        ...     return out
        >>> SimWorld(2).run(body, torch.zeros(1))
        [tensor([0., 1.]), tensor([0., 1.])]
    """

    def __init__(self, n: int, *, timeout: float = 30.0, copy_args: bool = True) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"SimWorld needs n >= 1 ranks, got {n=!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"SimWorld needs timeout > 0 seconds, got {timeout=!r}")
        self.n = n
        self.timeout = float(timeout)
        self.copy_args = copy_args

    def __repr__(self) -> str:
        return f"SimWorld({self.n}, timeout={self.timeout})"

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `fn(comm, *args, **kwargs)` once per rank, concurrently; results in rank order.

        Args:
            fn: The per-rank body; `comm` is that rank's `SimComm`.
            *args: Positional arguments for `fn` (deep-copied per rank if `copy_args`).
            **kwargs: Keyword arguments for `fn` (deep-copied per rank if `copy_args`).

        While the ranks run, the process's automatic garbage collection is off (see the note
        in the body: a deadlock inside torch), and back as it was afterwards; a process forked
        meanwhile (a DataLoader's workers) starts with it off, and of two runs at once on
        different threads the first to end turns it back on. `gc.collect()` works throughout.

        Returns:
            `[fn's result on rank 0, ..., on rank n-1]`.

        Raises:
            SimWorldError: If any rank raised (or a collective mismatched or timed out), naming
                the rank, with the original exception as `__cause__`.
            TypeError: If `copy_args` and the arguments cannot be deep-copied.
            ValueError: If `copy_args` and a parameter of a module in the arguments carries
                gradient hooks, which a copy cannot carry (see `_mend_parameter_copies`).
        """
        n = self.n
        if self.copy_args:
            try:
                per_rank = [copy.deepcopy((args, kwargs)) for _ in range(n)]
            except Exception as exc:
                raise TypeError(
                    f"SimWorld.run could not deep-copy the arguments of {fn!r} for each rank "
                    f"({exc}); pass copies that can be, or use SimWorld(..., copy_args=False)"
                ) from exc
            for copied in per_rank:
                _mend_parameter_copies(args, kwargs, copied)
        else:
            per_rank = [(args, kwargs)] * n
        world = _World(n, self.timeout)
        comms = [SimComm(world, r) for r in range(n)]
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n

        def rank_main(r: int) -> None:
            a, kw = per_rank[r]
            try:
                try:
                    results[r] = fn(comms[r], *a, **kw)
                except BaseException as exc:  # reported by run()
                    errors[r] = exc
                    world.fail(r)
                    comms[r]._drain()
                    return
                pending = comms[r]._drain()
                if pending is not None:  # an async collective failed and was never waited on
                    errors[r] = pending
                    world.fail(r)
            finally:
                world.finish(r)

        threads = [
            threading.Thread(target=rank_main, args=(r,), name=f"simworld-rank{r}", daemon=True)
            for r in range(n)
        ]
        # [Note: no garbage collection while ranks run] torch's get_rng_state (which
        # torch.utils.checkpoint calls per region) holds the generator's mutex while it wraps
        # the state in a tensor; an automatic collection there may free an autograd graph,
        # whose destructor lets go of the GIL: another rank thread takes it and waits for that
        # mutex, and neither moves again (two ranks recomputing checkpointed regions hung in
        # a test run). No automatic collection, no such wait: unreachable cycles wait for the
        # end of the run (explicit gc.collect() calls still work).
        collecting = gc.isenabled()
        gc.disable()
        try:
            for t in threads:
                t.start()
            try:
                with world.cond:
                    while len(world.finished) < n and world.failed_rank is None:
                        world.cond.wait()
            except BaseException:  # KeyboardInterrupt: stop the ranks, then let it through
                world.interrupt()
                _stop_briefly(threads)
                raise
            # After a failure, collectives abort at once; a rank busy outside the comm gets a
            # grace.
            grace = time.monotonic() + self.timeout
            for t in threads:
                t.join(max(0.0, grace - time.monotonic()) if world.failed_rank is not None
                       else None)
        finally:
            if collecting:
                gc.enable()
        failed = [r for r in range(n) if errors[r] is not None]
        if not failed:
            return results
        primary = [r for r in failed if not _secondary(errors[r])] or failed
        r = primary[0]
        exc = errors[r]
        raise SimWorldError(
            f"rank {r} of {n} failed in {getattr(fn, '__qualname__', fn)!s}: "
            f"{type(exc).__name__}: {exc}",
            r,
        ) from exc
