"""Processes of tests/test_recovery.py that die by SIGKILL at a chosen point of a save.

Module level, so that a forkserver child can unpickle them by name. Each body trains a TinyGPT
on 2 SimWorld ranks, saves a first checkpoint (twice: into the run's directory and into a
`golden` copy the test compares with), trains one more step and starts a second save that kills
the whole process (both ranks) at `point`:

- ``"write"``: rank 1 has written the header and two pieces of its shard file, not the rest;
- ``"publish"``: every shard file and the manifest are on disk in ``<path>.partial``, not yet
  renamed into place;
- ``"replace"``: ``overwrite=True`` of the first checkpoint, killed between moving the old one
  aside (``<path>.old``) and renaming the new one into place.

The kill is a real SIGKILL (no Python cleanup, no ``finally``), sent by the process to itself
at that exact point, so the test is deterministic.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import fzero
from fzero.comm import Comm

from checkpoint_bodies import snapshot
from models import TinyGPT, split_batch
from step_bodies import ADAMW, make_optimizer

POINTS = ("write", "publish", "replace")
BATCHES = [TinyGPT.make_batch(300 + i, 8) for i in range(4)]


def die() -> None:
    """SIGKILL this process now: nothing after this line runs, not even `finally` blocks."""
    os.kill(os.getpid(), signal.SIGKILL)


def _dying_pieces(pieces: Iterable[torch.Tensor], keep: int) -> Iterator[torch.Tensor]:
    for count, piece in enumerate(pieces):
        if count == keep:
            die()
        yield piece


def arm(point: str) -> None:
    """Make the next save die at `point` (see the module docstring)."""
    from fzero.checkpoint import saving

    if point == "write":
        real_write = saving.write_file

        def write_file(path: Any, specs: Any, pieces: Any, *args: Any, **kwargs: Any) -> Any:
            if "shard-00001" in os.fspath(path):
                pieces = _dying_pieces(pieces, keep=2)
            return real_write(path, specs, pieces, *args, **kwargs)

        saving.write_file = write_file
    elif point == "publish":
        saving.fsync_dir = lambda path: die()  # right after the manifest, before the rename
    elif point == "replace":
        real_rename = os.rename

        def rename(src: Any, dst: Any) -> None:
            real_rename(src, dst)
            if os.fspath(dst).endswith(".old"):
                die()

        os.rename = rename
    else:
        raise ValueError(f"unknown kill point {point!r}; expected one of {POINTS}")


def _body(comm: Comm, root: str, golden: str, point: str) -> None:
    model = TinyGPT()
    step = fzero.make_train_step(model, TinyGPT.loss_fn)
    state = fzero.init(model, stage=3, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm)
    for batch in BATCHES[:2]:
        state, _ = step(state, split_batch(batch, comm.rank, comm.world_size))
    first = os.path.join(root, "step-000002")
    fzero.save(state, first)
    fzero.save(state, golden)
    state, _ = step(state, split_batch(BATCHES[2], comm.rank, comm.world_size))
    comm.barrier()  # both ranks saved and stepped before any rank arms the kill
    if comm.rank == 0:
        arm(point)
    comm.barrier()
    if point == "replace":
        fzero.save(state, first, overwrite=True)
    else:
        fzero.save(state, os.path.join(root, "step-000003"))
    raise AssertionError(f"the save did not die at {point!r}")


def crash_during_save(root: str, golden: str, point: str) -> None:
    """The child process: train, save, train, die while saving (see the module docstring)."""
    torch.set_num_threads(1)
    fzero.SimWorld(2).run(_body, root, golden, point)


def load_and_continue(comm: Comm, path: str) -> dict[str, Any]:
    """Load `path`, snapshot it, train on the remaining batches; the losses and final params."""
    model = TinyGPT()
    state = fzero.load(path, model=model, comm=comm)
    loaded = snapshot(state)
    step = fzero.make_train_step(model, TinyGPT.loss_fn)
    losses = []
    for batch in BATCHES[state.step:]:
        state, metrics = step(state, split_batch(batch, comm.rank, comm.world_size))
        losses.append(metrics["loss"])
    return {"loaded": loaded, "losses": losses, "final": fzero.full_params(state)}


def resave(comm: Comm, src: str, dst: str, overwrite: bool = False) -> None:
    """Load `src`, train one step, save to `dst`."""
    model = TinyGPT()
    state = fzero.load(src, model=model, comm=comm)
    step = fzero.make_train_step(model, TinyGPT.loss_fn)
    state, _ = step(state, split_batch(BATCHES[state.step], comm.rank, comm.world_size))
    fzero.save(state, dst, overwrite=overwrite)
