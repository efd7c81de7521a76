"""The same workflow on the GPU and on the CPU, in float64: a GPU run must give the CPU run's
numbers (to rounding), whatever path it takes.

A check that holds on the CPU can break on CUDA alone: ``UntypedStorage.is_shared()`` is always
True for a CUDA storage, so stage 3's guard against shared memory raised on every GPU step
(the CUDA tests on an H200 caught it, 2026-11-27). This workflow exercises the paths a real
fine-tune takes beyond the plain step (a tie, a frozen parameter, a buffer updated in forward,
activation checkpointing, a dataclass output, accumulation, clipping, an eval step, a clone,
an EMA kept by ``tree_map``, a checkpoint saved and loaded) once on each device, over NCCL at
one rank on the GPU and gloo (SimWorld) on the CPU. Skipped cleanly without a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint

import fzero

from models import seeded

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB, WIDTH, SEQ = 11, 8, 5


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


class TiedNet(nn.Module):
    """Embedding tied to the head, a frozen bias, a buffer updated in forward, and a block
    run under activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        with seeded(0):
            self.emb = nn.Embedding(VOCAB, WIDTH)
            self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.LayerNorm(WIDTH))
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
            self.shift = nn.Parameter(torch.randn(WIDTH), requires_grad=False)
        self.head.weight = self.emb.weight
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.double()

    def forward(self, tokens: torch.Tensor) -> Output:
        if self.training:
            self.calls.add_(1)
        hidden = self.emb(tokens) + self.shift
        hidden = checkpoint(self.block, hidden, use_reentrant=False)
        return Output(self.head(hidden))


def loss_fn(call: Any, batch: torch.Tensor) -> torch.Tensor:
    logits = call(batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (4, SEQ), generator=g) for _ in range(4)]


def workflow(comm: Any, stage: int, device: str, path: str) -> dict[str, Any]:
    """Train, clone, evaluate, average, save, load and train on: every number it gives."""
    model = TiedNet().to(device)
    state = fzero.init(model, stage=stage, comm=comm, device=device,
                       optimizer=fzero.optim.adamw(lr=0.05, weight_decay=0.1))
    step = fzero.make_train_step(model, loss_fn, accum_steps=2, clip_norm=0.5)
    evaluate = fzero.make_eval_step(model, loss_fn)
    data = [b.to(device) for b in batches()]
    losses, norms = [], []
    for batch in data[:2]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    ema = fzero.clone_state(state)
    state, metrics = step(state, data[2])
    losses.append(float(metrics["loss"]))
    pytree.tree_map(lambda e, s: e.lerp_(s, 0.25) if e.is_floating_point() else e.copy_(s),
                    ema, state)
    model.eval()  # (an eval step refuses a forward that updates buffers)
    evaluated = [float(evaluate(state, data[3])), float(evaluate(ema, data[3]))]
    model.train()
    fzero.save(state, path, overwrite=True)
    fresh = TiedNet().to(device)
    state = fzero.load(path, model=fresh, comm=comm, device=device)
    state, metrics = fzero.make_train_step(fresh, loss_fn, accum_steps=2, clip_norm=0.5)(
        state, data[3])
    losses.append(float(metrics["loss"]))
    return {"losses": losses, "norms": norms, "evaluated": evaluated,
            "params": {k: v.cpu() for k, v in fzero.full_params(state).items()},
            "ema": {k: v.cpu() for k, v in fzero.full_params(ema).items()},
            "buffers": {k: v.cpu() for k, v in state.buffers.items()}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_gpu_workflow_gives_the_cpus_numbers(bare_env: Any, stage: int, tmp_path) -> None:
    cpu, = fzero.SimWorld(1).run(workflow, stage, "cpu", str(tmp_path / "cpu"))
    with fzero.distributed(backend="nccl") as comm:
        gpu = workflow(comm, stage, "cuda", str(tmp_path / "gpu"))
    for key in ("losses", "norms", "evaluated"):
        assert gpu[key] == pytest.approx(cpu[key], rel=1e-10), key
    for key in ("params", "ema", "buffers"):
        assert gpu[key].keys() == cpu[key].keys(), key
        for name, value in cpu[key].items():
            torch.testing.assert_close(gpu[key][name], value, rtol=1e-10, atol=1e-12,
                                       msg=f"{key} {name}")
