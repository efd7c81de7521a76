"""Shared-memory slots: how `TorchComm(transport="shm")` moves large chunks between gloo ranks
on one host.

Over loopback TCP, every byte of an all-gather or a reduce-scatter is copied into the kernel by
its sender and out of it by its receiver, with system calls and gloo's threads in between, on
the same cores that compute. Ranks on one host can map each other's memory instead: the sender
copies its data into a *slot* (anonymous shared memory, `os.memfd_create`, that its peers map),
a four-number message over gloo (a *token*: which slot, how large, how to open it) tells each
receiver where it is, each receiver reads it straight out (an all-gather copies its chunk into
place, a reduce-scatter sums it in rank order), then writes a *done* record into the sender's
pipe, which frees the slot. Per byte this takes less CPU time than the pairwise TCP exchange,
but a collective's data sits in a slot from its issue until every peer has read it: a rank
holds the slots of the collectives it has in flight (a reader unmaps what it read, so each
page counts in its owner's RSS alone). The README's tables give both sides.

[Note: slots]
A rank writes only into its own slots and reads only its peers'. A slot holds one collective's
data from its issue until every peer has written its done record, `(reader rank, slot number)`,
into the owner's pipe; the owner drains the pipe without blocking whenever it needs a slot, and
a rank with no free slot large enough opens another (collectives in flight together each hold
their own), so issuing never waits on a peer. (gloo cannot say whether a receive has arrived
without waiting for it; the pipe's system calls also order the reader's last read before the
owner's next write, as a memory fence would.) Slots and pipes have no names: a peer opens one
through ``/proc/<owner pid>/fd/<fd>`` the first time a token names it, and checks its inode
against the token's, so nothing is left behind whatever way a process ends, and a rank can only
ever map what its peer meant. The owner keeps a slot's descriptor open until every peer has read
from it once; when the slots are dropped (their comm is collected, or the process exits) it
first waits, at most the comm's timeout or `RELEASE_WAIT_S`, for its peers to open any slot a
token has told them of (a peer can be a collective behind: the owner has nothing left to wait
for). Slot numbers and sizes travel in the tokens, so the ranks need not allocate alike. Slots
are never shrunk: their bytes are those of the largest collectives that were in flight
together.

[Note: handshake]
That every rank can open every other rank's memory (one host, one pid namespace that shows each
other's ``/proc``, the same user) is tested, not assumed, by `open_shared_slots`: every rank
makes its pipe and a probe slot holding random bytes, sends where they are to every peer, opens
theirs and checks the bytes; a second round of tokens tells every rank whether all of them
succeeded, so every rank decides alike (and `TorchComm` raises on every rank if not).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import select
import struct
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "MIN_CHUNK_BYTES",
    "PROC_DIR",
    "RELEASE_WAIT_S",
    "SharedSlots",
    "open_shared_slots",
    "wait_all",
]

MIN_CHUNK_BYTES = 1 << 20
"""Chunks smaller than this go over TCP, where one message costs about what two tokens and two
copies cost (2 ranks, 2 cores: TCP faster at 128 KiB, even at 256-512 KiB, shared memory
1.3-2x faster from 1 MiB on)."""
RELEASE_WAIT_S = 60.0
"""How long slots that are dropped wait for peers still to open them (without a comm timeout)."""
SLOW_RELEASE_S = 5.0
"""Dropped slots that have waited this long for a live peer warn."""
_LIVENESS_POLL_S = 0.5  # how often a release that waits looks whether its peers still run
PROC_DIR = "/proc"
"""Where a rank finds its peers' descriptors (``<PROC_DIR>/<pid>/fd/<fd>``)."""
_LIBC = ctypes.CDLL(None, use_errno=True)  # madvise: Python's mmap.madvise would need a
# mmap object, which keeps a descriptor of the slot open (until 3.13's trackfd=False)
_SLOT_GRANULE = 1 << 20  # slot sizes round up to this, so close sizes share slots
_DONE = struct.Struct("<ii")  # a done record: (reader's rank, slot number); atomic in a pipe
_PROBE_BYTES = 16

_NO_MEMORY_HELP = (
    "fzero's shared-memory transport could not reserve {nbytes:,} bytes ({error}): the host or "
    "the container's memory limit is reached; use TorchComm(transport='pairwise')."
)


def wait_all(works: Sequence[Any], timeout: timedelta | None) -> None:
    """Wait for each torch `Work` in turn, each wait bounded by `timeout` (None: the group's)."""
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
        wait_all(works, self.timeout)
        return theirs


def _peer_path(pid: int, fd: int) -> str:
    return os.path.join(PROC_DIR, str(pid), "fd", str(fd))


def _open_checked(pid: int, fd: int, inode: int, flags: int) -> int:
    """Open another process's descriptor through /proc; raise OSError unless it is the file
    `inode` names (another pid namespace can show an unrelated process under that pid)."""
    mine = os.open(_peer_path(pid, fd), flags)
    if os.fstat(mine).st_ino != inode:
        os.close(mine)
        raise OSError(f"{_peer_path(pid, fd)} is not the file its owner named")
    return mine


def _map(fd: int, nbytes: int) -> Tensor:
    """`nbytes` of the shared memory behind descriptor `fd`, as a uint8 tensor (MAP_SHARED)."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


class _PeerMap:
    """This rank's mapping of a peer's slot. After each read its pages are unmapped again
    (`forget`): the peer's slot stays in the peer's RSS alone, the data stays in the slot, and
    the next read maps the pages anew (one minor fault per 16 pages: the kernel maps a
    file's neighbouring pages with each fault)."""

    __slots__ = ("data",)

    def __init__(self, fd: int, nbytes: int) -> None:
        self.data = _map(fd, nbytes)  # page-aligned: a mapping of its own

    def forget(self, start: int, nbytes: int) -> None:
        """Unmap the pages holding bytes ``[start, start + nbytes)`` (their data stays)."""
        first = start - start % mmap.PAGESIZE
        end = min(-(-(start + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE, self.data.numel())
        if end > first and _LIBC.madvise(
            ctypes.c_void_p(self.data.data_ptr() + first), ctypes.c_size_t(end - first),
            mmap.MADV_DONTNEED,
        ):
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of a peer's slot failed")


def _new_memory(nbytes: int) -> int:
    """A descriptor of `nbytes` of fresh anonymous shared memory, reserved up front."""
    fd = os.memfd_create("fzero-slot", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # ENOSPC / ENOMEM here, not SIGBUS at the first write
    except OSError as exc:
        os.close(fd)
        raise RuntimeError(_NO_MEMORY_HELP.format(nbytes=nbytes, error=exc)) from exc
    return fd


class _Slot:
    """One of this rank's slots: its memory, and the peers that have yet to read it."""

    __slots__ = ("number", "data", "fd", "inode", "unread")

    def __init__(self, number: int, data: Tensor, fd: int) -> None:
        self.number = number
        self.data = data  # uint8, the whole slot
        self.fd = fd  # open until every peer has read the slot once (then -1)
        self.inode = os.fstat(fd).st_ino  # what a peer checks when it opens the slot
        self.unread: set[int] = set()  # peers that have not yet read the current collective


class _Own:
    """What this rank owns: its slots, its pipe and its ends of its peers' pipes.

    Holds no reference to the `SharedSlots` using it, so it can release them when that goes.
    """

    def __init__(self, pipe: int, writers: dict[int, int], pids: dict[int, int]) -> None:
        self.pipe = pipe  # the read end of this rank's pipe (non-blocking)
        self.writers = writers  # peer -> the write end of its pipe
        self.pids = pids  # peer -> its process id
        self.slots: list[_Slot] = []

    def drain(self) -> None:
        """Take every done record in this rank's pipe (never blocks); close the descriptor of a
        slot every peer has now opened."""
        while True:
            try:
                records = os.read(self.pipe, 64 * _DONE.size)
            except BlockingIOError:
                return
            if not records:  # every peer's end is closed (their comms are gone)
                return
            assert len(records) % _DONE.size == 0, "done records are written whole"
            for q, number in _DONE.iter_unpack(records):
                slot = self.slots[number]
                slot.unread.discard(q)
                if not slot.unread and slot.fd >= 0:
                    os.close(slot.fd)
                    slot.fd = -1

    def release(self, wait_s: float) -> None:
        """Close every descriptor, once every live peer has opened the slots it was told of
        (waiting at most `wait_s`: a peer still to read needs the descriptor to open it; a
        peer whose process has ended never will). Waiting longer than `SLOW_RELEASE_S` warns,
        naming the ranks waited for."""
        start = time.monotonic()
        warned = False
        while waited := self._waited_for():
            now = time.monotonic()
            if now - start >= wait_s:
                break
            if not warned and now - start >= SLOW_RELEASE_S:
                warnings.warn(
                    f"fzero's shared-memory slots wait for rank(s) {sorted(waited)} to open a "
                    f"slot they were told of (at most {wait_s:.0f} s in all)", stacklevel=2)
                warned = True
            select.select([self.pipe], [], [], min(_LIVENESS_POLL_S, start + wait_s - now))
            self.drain()
        for fd in (*(slot.fd for slot in self.slots), self.pipe, *self.writers.values()):
            if fd >= 0:
                os.close(fd)
        for slot in self.slots:
            slot.fd = -1
        self.writers.clear()

    def _waited_for(self) -> set[int]:
        """Live peers that have yet to open a slot of this rank's (dead ones are forgotten)."""
        waited = set().union(*(slot.unread for slot in self.slots if slot.fd >= 0))
        for q in waited - {q for q in waited if _alive(self.pids[q])}:
            for slot in self.slots:
                slot.unread.discard(q)
            waited.discard(q)
        return waited


def _alive(pid: int) -> bool:
    """Whether process `pid` is running (not gone, not a zombie awaiting its parent)."""
    try:
        with open(os.path.join(PROC_DIR, str(pid), "stat")) as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class SharedSlots:
    """This rank's slots, pipe and maps of its peers' slots, for one process group.

    Made by `open_shared_slots`, used by `fzero.torchcomm.TorchComm`: see the module's notes.
    Each collective takes one tag, counted alike on every rank. `all_gather` and
    `reduce_scatter` return the works to wait for (the peers' tokens) and the epilogue to run
    then, which reads the peers' slots; every method runs on the thread that issues
    collectives.
    """

    def __init__(self, link: _Link, own: _Own) -> None:
        self._link = link
        self._own = own
        self._maps: dict[tuple[int, int], _PeerMap] = {}  # (peer, slot number) -> its map
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
            size = -(-nbytes // _SLOT_GRANULE) * _SLOT_GRANULE
            fd = _new_memory(size)
            slot = _Slot(len(self._own.slots), _map(fd, size), fd)
            self._own.slots.append(slot)
        slot.unread = set(self._link.peers)
        return slot

    def _announce(self, slot: _Slot, tag: int) -> tuple[list[Any], dict[int, Tensor]]:
        """Send every peer the token of `slot`: number, size and, until every peer has opened
        it, its descriptor and inode (-1, 0 after)."""
        opening = (slot.fd, slot.inode) if slot.fd >= 0 else (-1, 0)
        mine = torch.tensor([slot.number, slot.data.numel(), *opening], dtype=torch.int64)
        return self._link.post(mine, tag)

    def _read(self, q: int, token: Tensor, start: int, like: Tensor) -> Tensor:
        """Peer q's slot named by `token`, from byte `start`, as much as `like` (its dtype)."""
        number, nbytes, fd, inode = (int(v) for v in token.tolist())
        key = (q, number)
        if key not in self._maps:
            try:
                mine = _open_checked(self._own.pids[q], fd, inode, os.O_RDWR)
            except OSError as exc:
                raise RuntimeError(
                    f"rank {self._link.rank} cannot open rank {q}'s shared-memory slot "
                    f"{number} ({exc}): did rank {q} exit?") from exc
            try:
                self._maps[key] = _PeerMap(mine, nbytes)
            finally:
                os.close(mine)
        return self._maps[key].data[start : start + like.nbytes].view(like.dtype)

    def _done(self, tokens: dict[int, Tensor], start: int | dict[int, int], nbytes: int) -> None:
        """Unmap what was read of each peer's slot named in `tokens` (`nbytes` from `start`,
        or from ``start[q]``), then tell the peer that it has been read."""
        writers = self._own.writers
        for q, token in tokens.items():
            first = start if isinstance(start, int) else start[q]
            self._maps[(q, int(token[0]))].forget(first, nbytes)
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
            self._done(tokens, 0, input.nbytes)

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
            starts = {q: (r - (r > q)) * size for q in tokens}
            theirs = {q: self._read(q, token, starts[q], output) for q, token in tokens.items()}
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
            self._done(tokens, starts, size)

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
    pipe, write_end = os.pipe()
    os.set_blocking(pipe, False)
    probe_bytes = secrets.token_bytes(_PROBE_BYTES)
    probe = _new_memory(_PROBE_BYTES)
    os.pwrite(probe, probe_bytes, 0)
    opened: list[int] = []
    writers: dict[int, int] = {}
    try:
        mine = [os.getpid(), write_end, os.fstat(write_end).st_ino, probe,
                os.fstat(probe).st_ino, *probe_bytes]
        theirs = link.exchange(torch.tensor(mine, dtype=torch.int64), tag)
        able = True
        for q, token in theirs.items():
            pid, their_pipe, pipe_inode, their_probe, probe_inode, *expected = token.tolist()
            try:
                probe_fd = _open_checked(pid, their_probe, probe_inode, os.O_RDONLY)
                opened.append(probe_fd)
                if os.pread(probe_fd, _PROBE_BYTES, 0) != bytes(expected):
                    raise OSError("the probe's bytes differ")
                writers[q] = _open_checked(pid, their_pipe, pipe_inode, os.O_WRONLY)
                os.set_blocking(writers[q], False)
            except OSError:
                able = False
                break
        votes = link.exchange(torch.tensor([int(able)], dtype=torch.int64), tag + 1)
    finally:  # after the second round every peer has opened them (or given up)
        for fd in (write_end, probe, *opened):
            os.close(fd)
    if able and all(bool(vote.item()) for vote in votes.values()):
        pids = {q: int(token[0]) for q, token in theirs.items()}
        return SharedSlots(link, _Own(pipe, writers, pids))
    for fd in (pipe, *writers.values()):
        os.close(fd)
    return None
