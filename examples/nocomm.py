"""A `Comm` that moves nothing, and a replay of what it was asked to move, for the benchmarks.

`NoComm(rank, world_size)` is rank ``rank`` of a world of ``world_size`` ranks in which every
collective is local and instant. Values stay plausible and every rank looks identical to
itself, so fzero's step runs exactly as at that world size (the layout is planned for N, the
optimizer updates Ψ/N, the agreement checks pass) without sending a byte:

    all_gather:      output = input tiled N times      (every rank "sent" this rank's shard)
    reduce_scatter:  output = input[r*s:(r+1)*s]       (the mean of N equal contributions)
    all_reduce, broadcast: the tensor is kept          (N equal contributions)
    barrier:         returns at once

Byte accounting and the signature come from `fzero.comm.CommBase` as for a real comm, so
``metrics["comm_bytes"]`` and ``metrics["state_bytes"]`` are those of a real N-rank step. Each
collective is appended to ``log`` as an `Issued` record; `replay` issues the same sequence on a
real `fzero.TorchComm` to time the step's communication alone.

    comm = NoComm(rank, world_size)
    state = fzero.init(model, stage=1, optimizer=opt, comm=comm)
    comm.log.clear(); state, metrics = step(state, batch)     # compute only
    seconds = replay(fzero.TorchComm(), comm.log)             # the same collectives, alone
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import Tensor

from fzero.comm import CommBase, Work


class Issued(NamedTuple):
    """One collective as issued: on which channel, what kind, the sizes, and how."""

    channel: str  # "main", or a channel's key ("control@host", "stage3.gather")
    kind: str  # "all_gather", "reduce_scatter", "all_reduce", "broadcast"
    numel: int  # the big side: all-gather output, reduce-scatter input, the tensor otherwise
    small: int  # the small side: all-gather input, reduce-scatter output; == numel otherwise
    dtype: torch.dtype
    op: str | None  # the reduction, for reduce-scatter and all-reduce
    async_op: bool


class _Done:
    """The `Work` of a collective that completed when it was issued."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class NoComm(CommBase):
    """Rank `rank` of a `world_size`-rank world whose collectives are local (see the module).

    Args:
        rank: this rank, in ``range(world_size)``.
        world_size: N, the world size the step is planned and accounted for.
        log: the list every collective (of this comm and its channels) is appended to.
        device: where states built over this comm live (a real comm's ``device``: the GPU for
            NCCL); the CPU by default.
    """

    in_place = True  # as fzero's gloo transport: in-place reduce-scatter and all-gather

    def __init__(self, rank: int, world_size: int, log: list[Issued] | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(rank, world_size)
        self.log: list[Issued] = [] if log is None else log
        self.device = torch.device(device)

    def _record(self, kind: str, big: Tensor, small: Tensor, op: str | None,
                async_op: bool) -> Work | None:
        self.log.append(Issued(self.name, kind, big.numel(), small.numel(), big.dtype, op,
                               async_op))
        return _Done() if async_op else None

    def _open_channel(self, name: str, host: bool) -> NoComm:
        return NoComm(self.rank, self.world_size, log=self.log,
                      device="cpu" if host else self.device)

    def _all_gather(self, output: Tensor, input: Tensor, async_op: bool) -> Work | None:
        n, s = self.world_size, input.numel()
        mine = output[self.rank * s : (self.rank + 1) * s]
        source = input.clone() if input.data_ptr() == mine.data_ptr() else input
        output.view(n, s).copy_(source.expand(n, s))  # (N, s): this rank's shard N times
        return self._record("all_gather", output, input, None, async_op)

    def _reduce_scatter(self, output: Tensor, input: Tensor, op: str,
                        async_op: bool) -> Work | None:
        s = output.numel()
        mine = input[self.rank * s : (self.rank + 1) * s]
        if mine.data_ptr() != output.data_ptr():
            output.copy_(mine)  # the mean of N equal chunks is the chunk
        return self._record("reduce_scatter", input, output, op, async_op)

    def _all_reduce(self, tensor: Tensor, op: str, async_op: bool) -> Work | None:
        return self._record("all_reduce", tensor, tensor, op, async_op)

    def _broadcast(self, tensor: Tensor, src: int, async_op: bool) -> Work | None:
        return self._record("broadcast", tensor, tensor, None, async_op)

    def barrier(self) -> None:
        """Nothing to wait for."""


def open_channels(comm: CommBase, log: list[Issued]) -> dict[str, CommBase]:
    """The real comm's channel for every channel named in `log` (a collective: every rank must
    call it with the same log; call it before timing, channels are created once)."""
    channels: dict[str, CommBase] = {"main": comm}
    for issued in log:
        if issued.channel not in channels:
            name, _, host = issued.channel.partition("@")
            channels[issued.channel] = comm.channel(name, host=host == "host")  # type: ignore[assignment]
    return channels


def replay(comm: CommBase, log: list[Issued]) -> float:
    """Issue every collective of `log` on the real `comm`, in order, and return the seconds
    until all completed.

    Asynchronous ones are issued without waiting (as the step issues them) and collected at
    the end; blocking ones (the step's small agreement messages) block. Buffers are allocated
    once per size before the clock starts and reused (their values do not matter). A
    collective: every rank must replay the same log.
    """
    channels = open_channels(comm, log)
    buffers: dict[tuple, tuple[Tensor, Tensor]] = {}
    for issued in log:
        key = (issued.channel, issued.kind, issued.numel, issued.small, issued.dtype)
        if key not in buffers:
            device = getattr(channels[issued.channel], "device", "cpu")  # host channels: CPU
            big = torch.zeros(issued.numel, dtype=issued.dtype, device=device)
            small = big if issued.small == issued.numel else torch.zeros(
                issued.small, dtype=issued.dtype, device=device)
            buffers[key] = (big, small)
    pending = []
    t0 = time.perf_counter()
    for issued in log:
        big, small = buffers[(issued.channel, issued.kind, issued.numel, issued.small,
                              issued.dtype)]
        chan = channels[issued.channel]
        a = issued.async_op
        if issued.kind == "all_gather":
            work = chan.all_gather(big, small, async_op=a)
        elif issued.kind == "reduce_scatter":
            work = chan.reduce_scatter(small, big, op=issued.op or "avg", async_op=a)
        elif issued.kind == "all_reduce":
            work = chan.all_reduce(big, op=issued.op or "sum", async_op=a)
        else:
            work = chan.broadcast(big, src=0, async_op=a)
        if work is not None:
            pending.append(work)
    for work in pending:
        work.wait()
    if any(big.is_cuda for big, _ in buffers.values()):
        torch.cuda.synchronize()  # NCCL's wait() only orders streams: wait for the GPU too
    return time.perf_counter() - t0
