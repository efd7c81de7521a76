"""Per-rank bodies of tests/test_faults.py (module level: gloo workers unpickle them by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

import fzero
from fzero.comm import Comm

from models import MLP, split_batch

BATCH = 12


def stall_body(comm: Comm, stage: int, stalled: int, stall_s: float,
               timeout_s: float | None, *, evaluate: bool = False) -> dict[str, Any]:
    """Two steps (train steps, or eval steps with `evaluate`); at the second, rank `stalled`
    stops taking part for `stall_s` seconds.

    Over gloo, a `TorchComm` with `timeout_s` bounds every wait, and the ranks that time out
    re-raise (the pool then stops the stalled rank and respawns its workers, whose groups a
    timeout leaves unusable). In SimWorld each rank returns what it raised and when (seconds
    after the second step started).
    """
    if timeout_s is not None:
        comm = fzero.TorchComm(timeout=timeout_s)
    model = MLP()
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    calls = [0]

    def loss_fn(call: Any, batch: Any) -> Tensor:
        calls[0] += 1
        if calls[0] == 2 and comm.rank == stalled:
            time.sleep(stall_s)  # alive, but not taking part
        return MLP.loss_fn(call, batch)

    step = (fzero.make_eval_step if evaluate else fzero.make_train_step)(model, loss_fn)
    batch = split_batch(MLP.make_batch(0, BATCH), comm.rank, comm.world_size)
    first = step(state, batch)
    state = state if evaluate else first[0]
    t0 = time.monotonic()
    try:
        step(state, batch)
    except Exception as exc:
        if timeout_s is not None:
            raise
        return {"error": type(exc).__name__, "message": str(exc),
                "after": time.monotonic() - t0, "timeout": isinstance(exc, TimeoutError)}
    return {"error": None, "after": time.monotonic() - t0}


def identity_body(comm: Comm) -> int:
    """Nothing but the rank: proves the workers are up."""
    return comm.rank


def skip_body(comm: Comm, stage: int, nan_rank: int, max_skipped: int) -> dict[str, Any]:
    """Rank `nan_rank` feeds NaN inputs every step: steps are skipped until the limit."""
    model = MLP()
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    step = fzero.make_train_step(model, MLP.loss_fn, max_skipped=max_skipped)
    x, y = split_batch(MLP.make_batch(0, BATCH), comm.rank, comm.world_size)
    if comm.rank == nan_rank:
        x = torch.full_like(x, float("nan"))
    skipped = []
    try:
        for _ in range(max_skipped + 2):
            state, metrics = step(state, (x, y))
            skipped.append((metrics["skipped"], metrics["nonfinite_ranks"]))
    except fzero.StepError as exc:
        return {"skipped": skipped, "error": str(exc), "step": exc.step, "ranks": exc.ranks,
                "state_step": state.step, "state_skipped": state.skipped}
    return {"skipped": skipped, "error": None}


def nan_parameter_body(comm: Comm, stage: int) -> dict[str, Any]:
    """A state whose parameter turns NaN after init (as from a bad checkpoint): the step that
    skips says so, naming the parameter, on every rank."""
    model = MLP()
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    with torch.no_grad():
        for flat in state.params:
            flat.fill_(float("nan"))  # every rank's part: the whole model is NaN
    step = fzero.make_train_step(model, MLP.loss_fn)
    batch = split_batch(MLP.make_batch(0, BATCH), comm.rank, comm.world_size)
    try:
        step(state, batch)
    except fzero.StepError as exc:
        return {"error": str(exc)}
    return {"error": None}


def loss_scale_floor_body(comm: Comm, stage: int) -> dict[str, Any]:
    """fp16 state whose scale is already at its floor, and an input that overflows fp16."""
    model = MLP()
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm,
                       param_dtype=torch.float16)
    assert state.loss_scale is not None
    import dataclasses

    state = dataclasses.replace(state, loss_scale=dataclasses.replace(state.loss_scale,
                                                                      scale=1.0))
    step = fzero.make_train_step(model, MLP.loss_fn)
    x, y = split_batch(MLP.make_batch(0, BATCH), comm.rank, comm.world_size)
    try:
        step(state, (x.half() * 6e4, y))
    except fzero.StepError as exc:
        return {"error": str(exc)}
    return {"error": None}
