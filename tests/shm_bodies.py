"""Per-rank test bodies for `fzero.shm` (through `TorchComm(transport="shm")`), run by GlooPool.

Module-level so spawned workers can unpickle them by name. Bodies that change `fzero.shm`'s
module constants restore them before they return: the workers outlive the test.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from fzero import shm as fshm
from fzero.comm import Comm
from fzero.torchcomm import TorchComm

import comm_bodies as cb


def forced(shm_min_bytes: int = 0, transport: str = "shm") -> TorchComm:
    """A comm over the worker's default group whose chunks of `shm_min_bytes` or more go
    through shared memory (0: every chunk)."""
    return TorchComm(transport=transport, shm_min_bytes=shm_min_bytes)


def used(comm: TorchComm) -> dict[str, Any]:
    """What a comm's shared memory did: its transport, slot count and bytes, channels too."""
    comms = [comm, *comm._channels.values()]
    slots = [c._slots for c in comms if isinstance(c, TorchComm) and c._slots is not None]
    return {
        "transport": comm.transport,
        "slots": sum(s.slots for s in slots),
        "slot_bytes": sum(s.slot_bytes for s in slots),
    }


def every_collective_body(comm: Comm, inputs: list[Tensor], in_place: bool) -> dict[str, Any]:
    """`comm_bodies.every_collective_body` (or `in_place_body`) through shared memory."""
    shm = forced()
    body = cb.in_place_body if in_place else cb.every_collective_body
    return {"results": body(shm, inputs), **used(shm)}


def in_flight_body(
    comm: Comm, inputs: list[Tensor], rounds: int, depth: int, lag: float
) -> dict[str, Any]:
    """`depth` all-gathers and reduce-scatters in flight at once, `rounds` times, waited in
    reverse order; the last rank waits `lag` s before it reads, so a rank that reused a slot
    before its peers had read it would hand them the next round's data. Each collective's data
    differs (scaled by its round and position). Returns the collectives whose results differ
    from their single-process equation, and the slots used."""
    shm = forced()
    n, r = shm.world_size, shm.rank
    s = inputs[0].numel() // n
    wrong = []
    for i in range(rounds):
        issued = []
        for k in range(depth):
            scale = float(1 + i * depth + k)
            gathered = torch.empty(n * s)
            issued.append(("all_gather", i, k, gathered, shm.all_gather(
                gathered, inputs[r][:s] * scale, async_op=True)))
            reduced = torch.empty(s)
            issued.append(("reduce_scatter", i, k, reduced, shm.reduce_scatter(
                reduced, inputs[r] * scale, op="sum", async_op=True)))
        if r == n - 1:
            time.sleep(lag)
        for kind, i_, k, result, work in reversed(issued):
            work.wait()
            scale = float(1 + i_ * depth + k)
            if kind == "all_gather":
                want = torch.cat([x[:s] * scale for x in inputs])
            else:
                want = inputs[0][r * s : (r + 1) * s] * scale
                for x in inputs[1:]:
                    want = want + x[r * s : (r + 1) * s] * scale
            if not torch.equal(result, want):
                wrong.append((kind, i_, k))
    return {"wrong": wrong, **used(shm)}


def open_files() -> list[str]:
    """What this process's descriptors point at (``readlink /proc/self/fd/*``)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (listdir's own descriptor, another thread's)
            pass
    return targets


def slot_descriptors() -> int:
    """How many of this process's descriptors are shared-memory slots (memfds fzero made)."""
    return sum(target.startswith("/memfd:fzero-slot") for target in open_files())


def descriptors_body(comm: Comm, inputs: list[Tensor]) -> dict[str, Any]:
    """Which descriptors a "shm" comm holds: one per slot until every peer has opened it, and
    its pipes; none once the comm is gone (nothing to clean up after any exit)."""
    shm = forced()
    cb.all_gather_body(shm, inputs)  # the handshake and a first slot
    first = slot_descriptors()
    shm.barrier()  # every peer has read the first slot and written its done record
    cb.reduce_scatter_body(shm, inputs, "sum")  # the next acquire drains the pipe
    second = slot_descriptors()
    own = shm._slots._own  # type: ignore[union-attr]
    pipes = {f"pipe:[{os.fstat(fd).st_ino}]" for fd in (own.pipe, *own.writers.values())}
    held = sum(target in pipes for target in open_files())
    slots = shm._slots.slots  # type: ignore[union-attr]
    shm.barrier()  # no rank drops its comm (and pipe) before every rank has counted
    del shm, own
    gc.collect()
    return {"first": first, "second": second, "slots": slots, "pipes": held,
            "after": slot_descriptors(), "pipes_after": sum(t in pipes for t in open_files())}


def slot_rss() -> int:
    """Bytes of shared-memory slots (this rank's own and its peers') resident in this process:
    the Rss of its ``memfd:fzero-slot`` mappings (``/proc/self/smaps``)."""
    total, in_slot = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                in_slot = "memfd:fzero-slot" in line
            elif in_slot and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def slot_rss_body(comm: Comm, inputs: list[Tensor]) -> dict[str, Any]:
    """After an all-gather and a reduce-scatter through shared memory (every peer done
    reading), which slot pages this rank still maps: its own slots, not its peers'."""
    shm = forced()
    cb.all_gather_body(shm, inputs)
    cb.reduce_scatter_body(shm, inputs, "sum")
    shm.barrier()
    return {"rss": slot_rss(), **used(shm)}


@contextlib.contextmanager
def patched(module: Any, **values: Any) -> Iterator[None]:
    """Set attributes of `module` for the block; restore them after."""
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def unshared_body(
    comm: Comm, inputs: list[Tensor], ranks: list[int], why: str
) -> dict[str, Any]:
    """The ranks in `ranks` cannot open the others' memory (`why`: "proc", they see another
    /proc, as in another pid namespace; "inode", what they open is another file, as under an
    unrelated process with the same pid); the others can. A "shm" comm raises on every
    rank at its first large collective, and the group still works afterwards."""
    mine = comm.rank in ranks
    with contextlib.ExitStack() as stack:
        if mine and why == "proc":
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="not-proc-"))
            stack.enter_context(patched(fshm, PROC_DIR=root))
        if mine and why == "inode":
            stack.enter_context(patched(fshm, _peer_path=lambda pid, fd: os.devnull))
        try:
            cb.all_gather_body(forced(), inputs)
            error = None
        except ValueError as exc:
            error = str(exc)
    return {"error": error, "all_gather": cb.all_gather_body(comm, inputs)}


def no_space_body(comm: Comm, inputs: list[Tensor]) -> str | None:
    """/dev/shm fills up when a slot is opened (every rank alike): the error says what to do."""
    shm = forced()
    cb.all_gather_body(shm, inputs)  # handshake and a first slot
    bigger = [torch.cat([x, x]) for x in inputs]

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    with patched(fshm.os, posix_fallocate=full):  # a new slot is the first allocation
        try:
            cb.all_gather_body(shm, bigger)
        except RuntimeError as exc:
            return str(exc)
    return None


def with_comm_body(
    comm: Comm, transport: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> dict[str, Any]:
    """`fn(c, *args, **kwargs)` on a fresh comm with `transport` whose every chunk goes through
    shared memory when that is "shm"; its result and what the comm's shared memory did."""
    fresh = forced(transport=transport)
    return {"result": fn(fresh, *args, **kwargs), **used(fresh)}
