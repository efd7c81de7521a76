"""A parameter whose gradient is None because a custom autograd.Function (or torch's reentrant
checkpoint) returns None for it is left alone like an unused one, as torch.optim does (its
.grad stays None). AccumulateGrad runs with an undefined gradient and torch still fires
post-accumulate-grad hooks: `fzero.buckets.Completion` counted it used, so AdamW decayed it and
SGD's momentum kept moving it, at every stage (a probe)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fzero


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, block):
        ctx.save_for_backward(x, w)
        ctx.block = block
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (None if ctx.block else (g * x).sum(0)), None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.w = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x, block):
        return _Gate.apply(self.lin(x), self.w, block).sum(-1)


def _loss(call, batch):
    x, block = batch
    return call(x, bool(block[0])).pow(2).mean()


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 4, generator=g, dtype=torch.float64), torch.tensor([b] * 4))
            for b in (0, 1, 1)]  # w: a gradient, then None twice


def _body(comm, model, stage, opt):
    state = fzero.init(model, stage=stage, optimizer=opt, comm=comm)
    step = fzero.make_train_step(model, _loss)
    k = 4 // comm.world_size
    unused = []
    for x, blk in _batches():
        state, metrics = step(state, (x[comm.rank * k:(comm.rank + 1) * k],
                                      blk[comm.rank * k:(comm.rank + 1) * k]))
        unused.append(metrics["unused"])
    return fzero.full_params(state), unused


OPTS = {
    "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
              lambda: fzero.optim.adamw(lr=1e-2, weight_decay=0.1)),
    "sgd-momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                     lambda: fzero.optim.sgd(lr=0.1, momentum=0.9)),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("opt", sorted(OPTS))
def test_none_gradient_from_a_custom_function_leaves_the_parameter_alone(opt, stage, world):
    torch.manual_seed(0)
    model = _Net()
    torch_opt, fzero_opt = OPTS[opt]
    ref = copy.deepcopy(model)
    o = torch_opt(ref.parameters())
    for batch in _batches():
        o.zero_grad(set_to_none=True)
        _loss(ref, batch).backward()
        o.step()
    got, unused = fzero.SimWorld(world).run(_body, model, stage, fzero_opt())[0]
    assert unused == [[], ["w"], ["w"]]  # as a parameter no loss reached
    for name, value in ref.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12, msg=name)


class _ReentrantArg(nn.Module):
    """The same through torch's reentrant checkpoint: a parameter passed as an argument to the
    region and not used by it on this step gets grad None from CheckpointFunction.backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.gate = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def region(self, h, gate, use_gate):
        return torch.tanh(h * gate) if use_gate else torch.tanh(h)

    def forward(self, x, use_gate):
        return checkpoint(self.region, self.lin(x), self.gate, use_gate,
                          use_reentrant=True).sum(-1)


def _flag_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 4, generator=g, dtype=torch.float64), torch.tensor([f] * 4))
            for f in (1, 0, 0)]


def _flag_body(comm, model, stage):
    state = fzero.init(model, stage=stage, comm=comm,
                       optimizer=fzero.optim.adamw(lr=1e-2, weight_decay=0.1))
    step = fzero.make_train_step(model, _loss)
    k = 4 // comm.world_size
    for x, f in _flag_batches():
        state, _ = step(state, (x[comm.rank * k:(comm.rank + 1) * k],
                                f[comm.rank * k:(comm.rank + 1) * k]))
    return fzero.full_params(state)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameter_argument_unused_by_a_reentrant_region_is_left_alone(stage, world):
    torch.manual_seed(0)
    model = _ReentrantArg()
    ref = copy.deepcopy(model)
    o = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in _flag_batches():
        o.zero_grad(set_to_none=True)
        _loss(ref, batch).backward()
        o.step()
    got = fzero.SimWorld(world).run(_flag_body, model, stage)[0]
    for name, value in ref.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12, msg=name)
