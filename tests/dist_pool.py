"""A pool of long-lived spawned gloo workers: `GlooPool(n).run(fn, *args) -> per-rank results`.

Spawning processes and importing torch costs seconds, so a pool is started once per world size
per test session (see the `gloo_pool` fixture in conftest.py) and reused by every test body.
`fn(comm, *args, **kwargs)` runs on every worker with a `fzero.TorchComm` over a gloo group,
exactly the calling convention of `fzero.SimWorld.run`, so one body runs under both. `fn` must
be importable by name (a module-level function, e.g. in tests/comm_bodies.py); arguments and
results travel pickled (CPU tensors are fine).

[Note: failures]
A gloo group is unusable after a failed or timed-out collective, and a rank that raises alone
leaves the others blocked. So when any worker raises, dies or misses the pool's deadline, the
pool kills every worker (gathering the errors that arrive within a short grace first), raises
`WorkerError` with each failing rank's traceback, and spawns fresh workers on its next call.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp

__all__ = ["GlooPool", "WorkerError"]

_GRACE = 0.5  # seconds to collect the other ranks' errors once one rank has reported one


class WorkerError(RuntimeError):
    """A pool call failed: a rank raised, died or missed the deadline.

    Attributes:
        ranks: The ranks that failed, ascending.
        tracebacks: Traceback text per failing rank ("" for a dead or silent rank).
    """

    def __init__(self, message: str, ranks: list[int], tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.tracebacks = tracebacks


def _worker_main(rank: int, world_size: int, init_file: str, conn: Any, timeout_s: float) -> None:
    """Body of one worker process: join the group, then run jobs until told to stop."""
    import torch
    import torch.distributed as dist

    from fzero.torchcomm import TorchComm

    torch.set_num_threads(1)  # several workers share few cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        comm = TorchComm()
        conn.send_bytes(pickle.dumps(("ready", None)))
        while True:
            job = conn.recv_bytes()
            if not job:
                break
            try:
                fn, args, kwargs = pickle.loads(job)
                reply = ("ok", fn(comm, *args, **kwargs))
                payload = pickle.dumps(reply)
            except BaseException as exc:
                text = "".join(traceback.format_exception(exc))
                try:
                    cause = pickle.dumps(exc)
                    pickle.loads(cause)
                except Exception:
                    cause = None
                payload = pickle.dumps(("error", (text, cause)))
            conn.send_bytes(payload)
    finally:
        # Free the trainers' reference cycles now: FSDP2's and DCP's reach process-group
        # state, and freed during interpreter exit they abort gloo (1 run in 3 of DCP's rows).
        gc.collect()
        dist.destroy_process_group()  # gloo aborts the process otherwise


class GlooPool:
    """Long-lived gloo worker processes of one world size, started on first use.

    Args:
        world_size: Number of worker processes (ranks).
        timeout: Hard limit in seconds on each `run` call (and on start-up).
        collective_timeout: Timeout of the workers' gloo group, in seconds.
        start_method: "forkserver" (default: a clean server process imports torch once, workers
            fork from it, so a respawn after a failure takes milliseconds) or "spawn".
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 60.0,
        collective_timeout: float = 30.0,
        start_method: str = "forkserver",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"GlooPool needs world_size >= 1, got {world_size=}")
        self.world_size = world_size
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self.start_method = start_method
        self.starts = 0  # how many times workers were spawned
        self.last_start_s = 0.0  # seconds the last start took
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._tmpdir: str | None = None

    def __repr__(self) -> str:
        return f"GlooPool({self.world_size}, alive={bool(self._procs)}, starts={self.starts})"

    def _start(self) -> None:
        t0 = time.monotonic()
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The server imports torch once; every (re)spawned worker is then a cheap fork of it.
            ctx.set_forkserver_preload(["torch", "torch.distributed", "fzero.comm", __name__])
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="fzero-gloo-")
        self.starts += 1
        init_file = os.path.join(self._tmpdir, f"rendezvous-{self.starts}")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, init_file, child, self.collective_timeout),
                name=f"gloo-worker-{self.world_size}-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        replies = self._collect(time.monotonic() + self.timeout, "start-up")
        assert all(kind == "ready" for kind, _ in replies)
        self.last_start_s = time.monotonic() - t0

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `fn(comm, *args, **kwargs)` on every worker; results in rank order.

        Args:
            fn: A module-level function (pickled by name).
            *args: Positional arguments, pickled to every worker.
            **kwargs: Keyword arguments, pickled to every worker.

        Returns:
            `[fn's result on rank 0, ..., on rank world_size - 1]`.

        Raises:
            WorkerError: If a rank raised (its traceback text included, the original exception
                as `__cause__` when it pickles), died, or the call ran past `timeout`.
        """
        job = pickle.dumps((fn, args, kwargs))
        if not self._procs:
            self._start()
        deadline = time.monotonic() + self.timeout
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a dead worker is reported by _collect
                conn.send_bytes(job)
        name = getattr(fn, "__qualname__", repr(fn))
        return [value for _, value in self._collect(deadline, name)]

    def _collect(self, deadline: float, what: str) -> list[tuple[str, Any]]:
        n = self.world_size
        replies: list[tuple[str, Any] | None] = [None] * n
        failures: dict[int, str] = {}
        causes: dict[int, BaseException] = {}
        pending = set(range(n))
        while pending:
            if failures:  # the others are probably blocked in a collective: don't wait long
                deadline = min(deadline, time.monotonic() + _GRACE)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            handles = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            wait(handles, remaining)
            for r in sorted(pending):
                conn, proc = self._conns[r], self._procs[r]
                try:
                    if conn.poll(0):
                        kind, value = pickle.loads(conn.recv_bytes())
                    elif not proc.is_alive():
                        failures[r] = f"worker died (exit code {proc.exitcode})"
                        pending.discard(r)
                        continue
                    else:
                        continue
                except (EOFError, OSError) as exc:
                    failures[r] = f"worker connection lost: {exc!r}"
                    pending.discard(r)
                    continue
                pending.discard(r)
                if kind == "error":
                    text, cause = value
                    failures[r] = text
                    if cause is not None:
                        causes[r] = pickle.loads(cause)
                else:
                    replies[r] = (kind, value)
        if not failures and all(reply is not None for reply in replies):
            return replies  # type: ignore[return-value]
        silent = [r for r in range(n) if replies[r] is None and r not in failures]
        self._kill()
        ranks = sorted(failures)
        parts = [f"--- rank {r} ---\n{failures[r]}" for r in ranks]
        if silent:
            parts.append(f"rank(s) {silent} gave no answer (blocked, or past the deadline)")
        message = (
            f"GlooPool({n}) {what} failed on rank(s) {ranks or silent}; workers respawn on the "
            f"next call\n" + "\n".join(parts)
        )
        error = WorkerError(message, ranks or silent, {r: failures.get(r, "") for r in ranks})
        first = next((causes[r] for r in ranks if r in causes), None)
        if first is not None:
            raise error from first
        raise error

    def _kill(self) -> None:
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        """Stop the workers (each destroys its process group) and remove the rendezvous dir."""
        if self._procs:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(b"")
            for proc in self._procs:
                proc.join(10)
            if any(proc.is_alive() for proc in self._procs):
                self._kill()
            for conn in self._conns:
                conn.close()
            self._procs, self._conns = [], []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
