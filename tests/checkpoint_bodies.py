"""Per-rank bodies for the checkpoint tests: `fn(comm, *args)`, run by SimWorld and GlooPool.

Module-level so forkserver workers unpickle them by name. Every body gets the *global* batches
and slices its rows with `models.split_batch`; the batch of global step i is
``batches[i % len(batches)]``, so a resumed run draws exactly the uninterrupted run's batches.
Results travel back as floats, dicts and CPU tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import fzero
from fzero.comm import Comm
from fzero.state import ShardState

from models import bucket_policy, per_block, seeded, split_batch
from step_bodies import ADAMW, OptSpec, make_optimizer


def _train(comm: Comm, model: nn.Module, state: ShardState, batches: Sequence[Any], start: int,
           steps: int, runner: nn.Module | None = None,
           loss_fn: Callable[..., Tensor] | None = None) -> tuple[ShardState, list[float]]:
    """`steps` steps from global step `start`; the losses."""
    step = fzero.make_train_step(runner if runner is not None else model,
                                 loss_fn or type(model).loss_fn)
    losses = []
    for i in range(start, start + steps):
        state, metrics = step(state, split_batch(batches[i % len(batches)], comm.rank,
                                                 comm.world_size))
        losses.append(metrics["loss"])
    return state, losses


def snapshot(state: ShardState, *, moments: bool = True) -> dict[str, Any]:
    """Full parameters, full master copy, full moments (if asked) and the static fields."""
    layout = state.layout
    gathered = {}
    for name, values in state.moments.items() if moments else ():  # gathered like the master
        probe = dataclasses.replace(state, master=values)
        gathered[name] = fzero.full_params(probe, master=True)
    return {
        "params": fzero.full_params(state),
        "master": fzero.full_params(state, master=True),
        "moments": {n: {k: v for k, v in m.items() if _trainable(layout, k)}
                    for n, m in gathered.items()},
        "buffers": {k: v.clone() for k, v in state.buffers.items()},
        "step": state.step,
        "loss_scale": state.loss_scale,
        "stage": state.stage,
        "bucket_order": state.bucket_order,
    }


def _trainable(layout: Any, name: str) -> bool:
    index, _ = layout.locate()[name]
    return layout.buckets[index].trainable


def train_save_body(
    comm: Comm,
    model: nn.Module,
    batches: Sequence[Any],
    steps: int,
    path: str,
    *,
    stage: int,
    opt: OptSpec = ("adamw", ADAMW),
    param_dtype: torch.dtype | None = None,
    buckets: Any = per_block,
    loss_scale: fzero.LossScale | None = None,
    extra: dict[str, Any] | None = None,
    optimizer_state: bool = True,
    loss_fn: Callable[..., Tensor] | None = None,
) -> dict[str, Any]:
    """Init, train `steps` steps, save to `path`; the losses and a snapshot of the saved state.
    `buckets` defaults to `models.per_block` (one bucket per block)."""
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(opt), comm=comm,
                       buckets=bucket_policy(model, buckets), param_dtype=param_dtype)
    if loss_scale is not None:
        state = dataclasses.replace(state, loss_scale=loss_scale)
    state, losses = _train(comm, model, state, batches, 0, steps, loss_fn=loss_fn)
    fzero.save(state, path, extra=extra, optimizer_state=optimizer_state)
    return {"losses": losses, "saved": snapshot(state)}


def resume_body(
    comm: Comm,
    model: nn.Module,
    batches: Sequence[Any],
    paths: Sequence[str],
    steps: int,
    *,
    stage: int | None = None,
    runner: nn.Module | None = None,
    **load_kwargs: Any,
) -> list[dict[str, Any]]:
    """For each checkpoint: load (with `model`, e.g. on meta), snapshot, train `steps` more."""
    out = []
    for path in paths:
        state = fzero.load(path, model=runner if runner is not None else model, comm=comm,
                           stage=stage, **load_kwargs)
        loaded = snapshot(state)
        start = fzero.checkpoint.read_manifest(path).step
        state, losses = _train(comm, model, state, batches, start, steps, runner)
        out.append({"loaded": loaded, "losses": losses, "final": snapshot(state, moments=False),
                    "layout": state.layout})
    return out


def run_body(
    comm: Comm,
    model: nn.Module,
    batches: Sequence[Any],
    steps: int,
    *,
    stage: int,
    opt: OptSpec = ("adamw", ADAMW),
    param_dtype: torch.dtype | None = None,
    loss_scale: fzero.LossScale | None = None,
) -> dict[str, Any]:
    """The uninterrupted run: init and train `steps` steps."""
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(opt), comm=comm,
                       param_dtype=param_dtype)
    if loss_scale is not None:
        state = dataclasses.replace(state, loss_scale=loss_scale)
    state, losses = _train(comm, model, state, batches, 0, steps)
    return {"losses": losses, "final": snapshot(state, moments=False)}


def rng_body(comm: Comm, model: nn.Module, path: str, *, save: bool) -> list[float]:
    """Seed each rank differently and save (or load, restoring the RNG); then draw numbers."""
    if save:
        torch.manual_seed(1000 + comm.rank)
        state = fzero.init(model, stage=3, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm)
        fzero.save(state, path)
    else:
        torch.manual_seed(12345)  # overwritten by the load
        fzero.load(path, model=model, comm=comm)
    return torch.rand(4).tolist()


def load_error_body(comm: Comm, model: nn.Module, path: str, **kwargs: Any) -> tuple[str, str]:
    """Load and return ``(type, message)`` of what it raised (every rank must raise)."""
    try:
        fzero.load(path, model=model, comm=comm, **kwargs)
    except (ValueError, TypeError) as error:
        return type(error).__name__, str(error)
    raise AssertionError(f"rank {comm.rank}: load of {path} did not raise")


def save_error_body(comm: Comm, model: nn.Module, path: str, **kwargs: Any) -> tuple[str, str]:
    """Init and save, returning ``(type, message)`` of what the save raised."""
    state = fzero.init(model, stage=2, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm)
    try:
        fzero.save(state, path, **kwargs)
    except (ValueError, TypeError) as error:
        return type(error).__name__, str(error)
    raise AssertionError(f"rank {comm.rank}: save to {path} did not raise")


class Wide(nn.Module):
    """`layers` square Linear layers in an nn.Sequential: one bucket of width**2 + width
    elements per layer (the memory-bound tests' model)."""

    def __init__(self, layers: int = 8, width: int = 1024, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def init_save_body(comm: Comm, model: nn.Module, path: str, *, stage: int,
                   **save_kwargs: Any) -> None:
    """`fzero.init`, then save (no training)."""
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm)
    fzero.save(state, path, **save_kwargs)
