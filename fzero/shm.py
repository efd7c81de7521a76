"""Shared-memory slots: how `TorchComm` moves large chunks between gloo ranks on one host.

Over loopback TCP, every byte of an all-gather or a reduce-scatter is copied into the kernel by
its sender and out of it by its receiver, with system calls and gloo's threads in between, on
the same cores that compute. Ranks that share ``/dev/shm`` can map each other's memory instead:
the sender copies its data into a *slot* (a file there that its peers map), a two-number
message over gloo (a *token*: which slot, how large) tells each receiver where it is, each
receiver reads it straight out (an all-gather copies its chunk into place, a reduce-scatter sums
it in rank order), then writes a *done* record into the sender's pipe, which frees the slot.
Per byte this takes about half the CPU time of the pairwise TCP exchange (the README's
performance notes).

[Note: slots]
A rank writes only into its own slots and reads only its peers'. A slot holds one collective's
data from its issue until every peer has written its done record, `(reader rank, slot number)`,
into the owner's pipe (a FIFO in /dev/shm); the owner drains the pipe without blocking whenever
it needs a slot, and a rank with no free slot large enough opens another (collectives in flight
together each hold their own), so issuing never waits on a peer. (gloo cannot say whether a
receive has arrived without waiting for it; the pipe's system calls also order the reader's
last read before the owner's next write, as a memory fence would.) A receiver maps a peer's
slot the first time a token names it; the owner unlinks the file as soon as every peer has read
from it once (the mappings stay valid). When the slots are dropped (their comm is collected, or
the process exits) the owner first waits, at most the comm's timeout or `RELEASE_WAIT_S`, for
its peers to map any slot a token has told them of (a peer can be a collective behind: the
owner has nothing left to wait for), then unlinks what is left. Slot numbers and sizes travel
in the tokens, so the ranks need not allocate alike. Slots are never shrunk: their bytes are
those of the largest collectives that were in flight together.

[Note: handshake]
That every rank can open every other rank's files (one host and one ``/dev/shm``: not two
containers that share a hostname) is tested, not assumed, by `open_shared_slots`: every rank
creates its pipe under a random name, sends the name to every peer and opens theirs for
writing; a second round of tokens tells every rank whether all of them succeeded, so every rank
decides alike whether to use shared memory, and then each unlinks its pipe's name. A rank whose
``/dev/shm`` has less than `MIN_FREE_BYTES` free says no (a container's default 64 MiB would end
in ENOSPC mid-run).
"""

from __future__ import annotations

import os
import secrets
import select
import shutil
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "MIN_CHUNK_BYTES",
    "MIN_FREE_BYTES",
    "RELEASE_WAIT_S",
    "SHM_DIR",
    "SharedSlots",
    "open_shared_slots",
]

SHM_DIR = "/dev/shm"
"""Where slots live: a tmpfs that every process of the host can map."""
MIN_CHUNK_BYTES = 256 * 1024
"""Chunks smaller than this go over TCP: one message there beats two tokens and two copies."""
MIN_FREE_BYTES = 1 << 30
"""Free space `open_shared_slots` requires of ``/dev/shm`` on every rank."""
RELEASE_WAIT_S = 60.0
"""How long slots that are dropped wait for peers still to map them (without a comm timeout)."""
_SLOT_GRANULE = 1 << 20  # slot sizes round up to this, so close sizes share slots
_DONE = struct.Struct("<ii")  # a done record: (reader's rank, slot number); atomic in a pipe

_SHM_FULL_HELP = (
    "fzero's shared-memory transport could not reserve {nbytes:,} bytes in {dir} ({error}): "
    "give /dev/shm more room (docker: --shm-size) or use TorchComm(transport='pairwise')."
)


def _wait_all(works: Sequence[Any], timeout: timedelta | None) -> None:
    for work in works:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)


class _Link:
    """Point-to-point tokens over a process group (group ranks in, global ranks out)."""

    __slots__ = ("rank", "group", "global_ranks", "timeout")

    def __init__(
        self, rank: int, global_ranks: Sequence[int], group: Any, timeout: timedelta | None
    ) -> None:
        self.rank = rank
        self.global_ranks = list(global_ranks)
        self.group = group
        self.timeout = timeout

    @property
    def peers(self) -> list[int]:
        return [q for q in range(len(self.global_ranks)) if q != self.rank]

    def send(self, token: Tensor, q: int, tag: int) -> Any:
        return dist.isend(token, self.global_ranks[q], group=self.group, tag=tag)

    def recv(self, token: Tensor, q: int, tag: int) -> Any:
        return dist.irecv(token, self.global_ranks[q], group=self.group, tag=tag)

    def post(self, mine: Tensor, tag: int) -> tuple[list[Any], dict[int, Tensor]]:
        """Send `mine` to every peer; post the receives of theirs (same shape and dtype)."""
        theirs = {q: torch.empty_like(mine) for q in self.peers}
        works = [self.send(mine, q, tag) for q in self.peers]
        works += [self.recv(theirs[q], q, tag) for q in self.peers]
        return works, theirs

    def exchange(self, mine: Tensor, tag: int) -> dict[int, Tensor]:
        """`post`, then wait (bounded by `timeout`)."""
        works, theirs = self.post(mine, tag)
        _wait_all(works, self.timeout)
        return theirs


def _path(prefix: str, what: int | str) -> str:
    return os.path.join(SHM_DIR, f"{prefix}-{what}")


def _prefix(pid: int, nonce: int) -> str:
    return f"fzero-{pid}-{nonce:x}"


class _Slot:
    """One of this rank's slots: a mapped file, and the peers that have yet to read it."""

    __slots__ = ("number", "data", "unread")

    def __init__(self, number: int, data: Tensor) -> None:
        self.number = number
        self.data = data  # uint8, the whole file
        self.unread: set[int] = set()  # peers that have not yet read the current collective


class _Own:
    """What this rank owns: its slots, the names still linked, its pipe and its peers' pipes.

    Holds no reference to the `SharedSlots` using it, so it can release them when that goes.
    """

    def __init__(self, prefix: str, pipe: int, writers: dict[int, int]) -> None:
        self.prefix = prefix
        self.pipe = pipe  # the read end of this rank's pipe (non-blocking)
        self.writers = writers  # peer -> the write end of its pipe
        self.slots: list[_Slot] = []
        self.linked: set[str] = set()  # names of this rank's slots not yet unlinked

    def unlink(self, path: str) -> None:
        self.linked.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def drain(self) -> None:
        """Take every done record in this rank's pipe (never blocks); unlink the name of a slot
        every peer has now mapped."""
        while True:
            try:
                records = os.read(self.pipe, 64 * _DONE.size)
            except BlockingIOError:
                return
            assert len(records) % _DONE.size == 0, "done records are written whole"
            for q, number in _DONE.iter_unpack(records):
                slot = self.slots[number]
                slot.unread.discard(q)
                path = _path(self.prefix, number)
                if not slot.unread and path in self.linked:
                    self.unlink(path)

    def release(self, wait_s: float) -> None:
        """Unlink every name and close the pipes, once every peer has mapped the slots it was
        told of (waiting at most `wait_s`: a peer still reading may need the name to map it)."""
        deadline = time.monotonic() + wait_s
        while (any(slot.unread and _path(self.prefix, slot.number) in self.linked
                   for slot in self.slots)
               and (left := deadline - time.monotonic()) > 0):
            select.select([self.pipe], [], [], left)
            self.drain()
        for path in list(self.linked):
            self.unlink(path)
        for fd in (self.pipe, *self.writers.values()):
            os.close(fd)
        self.writers.clear()


class SharedSlots:
    """This rank's slots, pipe and maps of its peers' slots, for one process group.

    Made by `open_shared_slots`, used by `fzero.torchcomm.TorchComm`: see the module's notes.
    Each collective takes one tag, counted alike on every rank. `all_gather` and
    `reduce_scatter` return the works to wait for (the peers' tokens) and the epilogue to run
    then, which reads the peers' slots; every method runs on the thread that issues
    collectives.
    """

    def __init__(self, link: _Link, prefixes: dict[int, str], own: _Own) -> None:
        self._link = link
        self._prefixes = prefixes  # group rank -> the prefix of its files
        self._own = own
        self._maps: dict[tuple[int, int], Tensor] = {}  # (peer, slot number) -> its mapping
        wait_s = RELEASE_WAIT_S if link.timeout is None else link.timeout.total_seconds()
        weakref.finalize(self, own.release, wait_s)

    @property
    def slots(self) -> int:
        """How many slots this rank has opened."""
        return len(self._own.slots)

    @property
    def slot_bytes(self) -> int:
        """Bytes of this rank's own slots (its peers map the same pages)."""
        return sum(slot.data.numel() for slot in self._own.slots)

    def _acquire(self, nbytes: int) -> _Slot:
        """A free slot of at least `nbytes`, unread by every peer from now on."""
        self._own.drain()
        free = [s for s in self._own.slots if not s.unread and s.data.numel() >= nbytes]
        if free:
            slot = min(free, key=lambda s: s.data.numel())
        else:
            slot = self._open_slot(-(-nbytes // _SLOT_GRANULE) * _SLOT_GRANULE)
        slot.unread = set(self._link.peers)
        return slot

    def _open_slot(self, nbytes: int) -> _Slot:
        number = len(self._own.slots)
        path = _path(self._own.prefix, number)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._own.linked.add(path)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC here, not SIGBUS at the first write
        except OSError as exc:
            self._own.unlink(path)
            raise RuntimeError(
                _SHM_FULL_HELP.format(nbytes=nbytes, dir=SHM_DIR, error=exc)) from exc
        finally:
            os.close(fd)
        slot = _Slot(number, torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8))
        self._own.slots.append(slot)
        return slot

    def _announce(self, slot: _Slot, tag: int) -> tuple[list[Any], dict[int, Tensor]]:
        mine = torch.tensor([slot.number, slot.data.numel()], dtype=torch.int64)
        return self._link.post(mine, tag)

    def _read(self, q: int, token: Tensor, start: int, like: Tensor) -> Tensor:
        """Peer q's slot named by `token`, from byte `start`, as much as `like` (its dtype)."""
        number, nbytes = (int(v) for v in token.tolist())
        key = (q, number)
        if key not in self._maps:
            path = _path(self._prefixes[q], number)
            if not os.path.exists(path):
                raise RuntimeError(f"rank {self._link.rank}: rank {q}'s shared-memory slot "
                                   f"{path} is gone (was /dev/shm cleaned during the run?)")
            self._maps[key] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return self._maps[key][start : start + like.nbytes].view(like.dtype)

    def _done(self, tokens: dict[int, Tensor]) -> None:
        """Tell each peer that its slot named in `tokens` has been read."""
        writers = self._own.writers
        for q, token in tokens.items():
            if q not in writers:
                continue
            try:
                os.write(writers[q], _DONE.pack(self._link.rank, int(token[0])))
            except BrokenPipeError:  # q's slots are gone (its comm was dropped): none to free
                os.close(writers.pop(q))

    def all_gather(
        self, chunks: Sequence[Tensor], input: Tensor, tag: int
    ) -> tuple[list[Any], Callable[[], None]]:
        """``chunks[q] <- input of rank q`` for every peer q, once the works are done and the
        epilogue has run (this rank's own chunk is the caller's to fill)."""
        slot = self._acquire(input.nbytes)
        slot.data[: input.nbytes].view(input.dtype).copy_(input)
        works, tokens = self._announce(slot, tag)

        def read() -> None:
            for q, token in tokens.items():
                chunks[q].copy_(self._read(q, token, 0, chunks[q]))
            self._done(tokens)

        return works, read

    def reduce_scatter(
        self, output: Tensor, chunks: Sequence[Tensor], tag: int
    ) -> tuple[list[Any], Callable[[], None]]:
        """``output <- chunks_0[r] + ... + chunks_{N-1}[r]`` summed left to right in rank order
        (every rank's sums have the same bits), once the works are done and the epilogue has
        run; `output` may be this rank's own chunk (in place)."""
        r, s, size = self._link.rank, chunks[0].numel(), chunks[0].nbytes
        peers = self._link.peers
        slot = self._acquire(len(peers) * size)
        staged = slot.data[: len(peers) * size].view(chunks[0].dtype)
        for i, q in enumerate(peers):  # the peers' chunks in rank order; this rank's stays home
            staged[i * s : (i + 1) * s].copy_(chunks[q])
        works, tokens = self._announce(slot, tag)

        def add() -> None:  # rank q staged this rank's chunk r at r's place among q's peers
            theirs = {q: self._read(q, token, (r - (r > q)) * size, output)
                      for q, token in tokens.items()}
            if output.data_ptr() != chunks[r].data_ptr():
                output.copy_(chunks[r])
            before = [theirs[q] for q in range(r)]
            if before:  # (c_0 + ... + c_{r-1}) + c_r: adding two terms commutes exactly
                total = before[0] if len(before) == 1 else torch.add(before[0], before[1])
                for term in before[2:]:
                    total.add_(term)
                output.add_(total)
            for q in range(r + 1, len(chunks)):
                output.add_(theirs[q])
            self._done(tokens)

        return works, add


def open_shared_slots(
    rank: int,
    global_ranks: Sequence[int],
    group: Any,
    tag: int,
    timeout: timedelta | None,
) -> SharedSlots | None:
    """Shared-memory slots for this group if every rank can map every other's, else None.

    A collective over the group (every rank calls it at the same point, with the same `tag`;
    it uses ``tag`` and ``tag + 1``): see the module's [Note: handshake]. Every rank returns
    slots, or every rank returns None.
    """
    link = _Link(rank, global_ranks, group, timeout)
    nonce = secrets.randbits(62)
    prefix = _prefix(os.getpid(), nonce)
    pipe_path, pipe, writers = _path(prefix, "done"), -1, {}
    try:
        os.mkfifo(pipe_path, 0o600)
        # Read and write: opening a FIFO for reading alone blocks until a writer comes.
        pipe = os.open(pipe_path, os.O_RDWR | os.O_NONBLOCK)
        able = shutil.disk_usage(SHM_DIR).free >= MIN_FREE_BYTES
    except OSError:
        able = False
    try:
        theirs = link.exchange(torch.tensor([os.getpid(), nonce], dtype=torch.int64), tag)
        prefixes = {q: _prefix(*(int(v) for v in token.tolist())) for q, token in theirs.items()}
        for q, their_prefix in prefixes.items() if able else ():
            try:
                writers[q] = os.open(_path(their_prefix, "done"), os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                able = False
                break
        votes = link.exchange(torch.tensor([int(able)], dtype=torch.int64), tag + 1)
    finally:  # after the second round every peer has opened it (or given up)
        if pipe >= 0:
            os.unlink(pipe_path)
    if able and all(bool(vote.item()) for vote in votes.values()):
        prefixes[rank] = prefix
        return SharedSlots(link, prefixes, _Own(prefix, pipe, writers))
    for fd in (pipe, *writers.values()):
        if fd >= 0:
            os.close(fd)
    return None
