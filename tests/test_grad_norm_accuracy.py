"""The global gradient norm a step clips with is as accurate in float32 as torch's
``clip_grad_norm_``, against a float64 autograd reference.

A step took ``torch._foreach_norm`` of each whole flat float32 gradient bucket (or shard) and
squared the results in float64. Torch's CPU float32 norm kernel loses accuracy about in
proportion to the tensor's length: a 2M-element bucket's norm came out ~1e-5 relative off (1.2e-4
for `examples/train_gpt.py`'s GPT), where torch's per-parameter ``clip_grad_norm_`` is ~1e-8
off. That error in the clip coefficient was most of train_gpt's float32 drift from
``--reference`` (1.9e-4 in loss over 20 steps; under 1e-6 with an accurate norm). Float64
runs agreed to 1e-13 all along: rounding, not a formula (a probe found it).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import fzero

from models import seeded


class Wide(nn.Module):
    """2.1M parameters in 64 tensors of at most 65K elements: one flat bucket."""

    def __init__(self) -> None:
        super().__init__()
        with seeded(0):
            self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


def loss_fn(call: Any, batch: torch.Tensor) -> torch.Tensor:
    return call(batch).pow(2).mean()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_float32_gradient_norm_is_as_accurate_as_torchs(stage: int, world: int) -> None:
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    reference = Wide().double()  # the exact value: float64 autograd on the whole batch
    loss_fn(reference, x.double()).backward()
    exact = math.sqrt(math.fsum(p.grad.pow(2).sum().item() for p in reference.parameters()))
    plain = Wide()
    loss_fn(plain, x).backward()
    torch_error = abs(float(nn.utils.clip_grad_norm_(plain.parameters(), math.inf)) - exact)

    def body(comm: Any, model: nn.Module) -> float:
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm,
                           buckets=1 << 24)  # one bucket, as train_gpt's GPT
        step = fzero.make_train_step(model, loss_fn, clip_norm=1.0)
        rows = x.shape[0] // comm.world_size
        _, metrics = step(state, x[comm.rank * rows : (comm.rank + 1) * rows])
        return metrics["grad_norm"]

    for got in fzero.SimWorld(world).run(body, Wide()):
        error = abs(got - exact) / exact
        assert error < max(1e-6, 10 * torch_error / exact), (
            f"stage {stage}, N={world}: the float32 gradient norm is {error:.1e} relative off "
            f"the float64 value (torch's clip_grad_norm_: {torch_error / exact:.1e})")
