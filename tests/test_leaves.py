"""Stages 0-2 bind one autograd leaf per parameter over the state's flat buffers, with its
gradient's home in the full gradient buffer (stages 0-1) and hooks that launch a bucket's
reduction once all its leaves have their gradient. A train step builds these once per set of
state tensors and reuses them while the states it returns hold the same tensors.

What must hold: the reuse changes no number (any interleaving of states through one step
function equals one step function per state, bitwise); a new state gets its own leaves and a
dropped one takes its leaves' hold on memory with it; whatever a step leaves on a leaf (a
failure, a backward outside a step) does not reach the next step; and a gradient moved away
from its home by the user's code raises instead of being lost."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import fzero

import guarantee_bodies as gb

STAGES = [0, 1, 2]


def _batches(comm: Any, count: int = 4) -> list[Any]:
    return [gb.rank_rows(b, comm.rank, comm.world_size)
            for b in gb.mse_batches(count, rows=4 * comm.world_size, d_in=5, d_out=3)]


def _state(comm: Any, stage: int, seed: int = 0) -> tuple[Any, fzero.ShardState]:
    model = gb.BatchNormNet(seed=seed)
    return model, fzero.init(model, stage=stage, optimizer=gb.make_optimizer(("sgd", gb.SGD)),
                             comm=comm)


def _values(state: fzero.ShardState) -> list[Tensor]:
    return [t.clone() for t in fzero.full_params(state).values()]


def _leaf_seen(model: Any, seen: list[Tensor]) -> Callable[..., Tensor]:
    """`gb.mse_loss`, recording the tensor the module's fc1.weight is bound to."""

    def loss_fn(call: Callable[..., Tensor], batch: Any) -> Tensor:
        seen.append(model.fc1.weight)
        return gb.mse_loss(call, batch)

    return loss_fn


def _interleaved_body(comm: Any, *, stage: int, shared: bool) -> list[list[Tensor]]:
    """Two states from different weights, stepped alternately: through one step function
    (`shared`) or one each."""
    model, first = _state(comm, stage, seed=0)
    _, second = _state(comm, stage, seed=1)
    steps = [fzero.make_train_step(model, gb.mse_loss)]
    steps.append(steps[0] if shared else fzero.make_train_step(model, gb.mse_loss))
    states = [first, second]
    for batch in _batches(comm):
        for i in (0, 1):
            states[i], _ = steps[i](states[i], batch)
    return [_values(s) for s in states]


@pytest.mark.parametrize("stage", STAGES)
def test_states_interleaved_through_one_step_train_as_with_one_step_each(stage: int) -> None:
    shared = fzero.SimWorld(2).run(_interleaved_body, stage=stage, shared=True)
    separate = fzero.SimWorld(2).run(_interleaved_body, stage=stage, shared=False)
    for ours, theirs in zip(shared, separate, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)


def _reuse_body(comm: Any, *, stage: int) -> None:
    model, state = _state(comm, stage)
    seen: list[Tensor] = []
    step = fzero.make_train_step(model, _leaf_seen(model, seen))
    batches = _batches(comm)
    state, _ = step(state, batches[0])
    state, _ = step(state, batches[1])
    assert seen[0] is seen[1]  # the next state holds the same tensors: the same leaves
    assert seen[0] is not model.fc1.weight  # bound only during the step
    old = weakref.ref(seen[0])
    seen.clear()
    _, other = _state(comm, stage, seed=1)
    other, _ = step(other, batches[2])  # another state's tensors: other leaves
    assert seen[0] is not old()
    seen.clear()
    state, _ = step(state, batches[3])  # back again: rebuilt, and still exact (next test)
    assert old() is None and seen[0] is not None
    leaf = weakref.ref(seen[0])
    seen.clear()
    del state  # the last state over these tensors: its leaves must not keep them alive
    gc.collect()
    assert leaf() is None


@pytest.mark.parametrize("stage", STAGES)
def test_leaves_live_as_long_as_their_states_tensors(stage: int) -> None:
    fzero.SimWorld(1).run(_reuse_body, stage=stage)


def _zero_grad_body(comm: Any, *, stage: int) -> Any:
    model, state = _state(comm, stage)

    def loss_fn(call: Callable[..., Tensor], batch: Any) -> Tensor:
        model.zero_grad()  # sets the bound leaves' .grad to None
        return gb.mse_loss(call, batch)

    step = fzero.make_train_step(model, loss_fn, accum_steps=2)
    before = _values(state)
    try:
        step(state, _batches(comm)[0])
    except ValueError as exc:
        assert all(torch.equal(a, b) for a, b in zip(before, _values(state), strict=True))
        return str(exc)
    return None


@pytest.mark.parametrize("stage", [0, 1])
def test_a_gradient_moved_from_its_home_raises(stage: int) -> None:
    """Stages 0-1 accumulate into the full gradient buffer through each leaf's ``.grad``;
    ``model.zero_grad()`` inside ``loss_fn`` replaced it, and autograd put the gradient in a
    new tensor the reduction never saw (the trained weights differed from torch's)."""
    for message in fzero.SimWorld(2).run(_zero_grad_body, stage=stage):
        assert message is not None and "was replaced during the step" in message
        assert "'fc1.weight'" in message


def _zero_grad_trains_body(comm: Any, *, stage: int, zero: bool) -> list[Tensor]:
    model, state = _state(comm, stage)

    def loss_fn(call: Callable[..., Tensor], batch: Any) -> Tensor:
        if zero:
            model.zero_grad()
        return gb.mse_loss(call, batch)

    step = fzero.make_train_step(model, loss_fn, accum_steps=2)
    for batch in _batches(comm):
        state, _ = step(state, batch)
    return _values(state)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_inside_loss_fn_changes_nothing_where_gradients_are_copied_out(
    stage: int,
) -> None:
    """Stages 2-3 copy each micro-batch's gradients out of ``.grad`` and clear it: a
    ``zero_grad()`` before the backward finds nothing to lose."""
    with_zero = fzero.SimWorld(2).run(_zero_grad_trains_body, stage=stage, zero=True)
    plain = fzero.SimWorld(2).run(_zero_grad_trains_body, stage=stage, zero=False)
    for ours, theirs in zip(with_zero, plain, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _leftovers_body(comm: Any, *, stage: int, stray: bool) -> list[Tensor]:
    """Steps with, between them, a failed step and (with `stray`) a backward pass through a
    graph kept from a step's forward, which must raise and change nothing."""
    model, state = _state(comm, stage)
    kept: list[Tensor] = []
    fail = [False]

    def loss_fn(call: Callable[..., Tensor], batch: Any) -> Tensor:
        x, _ = batch
        kept.append(call(x).square().sum())  # another graph over the same leaves
        loss = gb.mse_loss(call, batch)
        if fail[0]:  # the user's own backward: gradients land, and the step raises
            loss.backward()
        return loss

    step = fzero.make_train_step(model, loss_fn)
    batches = _batches(comm)
    state, _ = step(state, batches[0])
    fail[0] = True
    with pytest.raises(RuntimeError, match="outside the step's backward"):
        step(state, batches[1])
    fail[0] = False
    if stray:  # right before a step: whatever it leaves must not be accumulated into
        with pytest.raises(RuntimeError, match="outside a train step"):
            kept[0].backward()
    for batch in batches[1:]:
        state, _ = step(state, batch)
    return _values(state)


@pytest.mark.parametrize("stage", STAGES)
def test_what_a_step_leaves_on_the_leaves_does_not_reach_the_next(stage: int) -> None:
    with_stray = fzero.SimWorld(1).run(_leftovers_body, stage=stage, stray=True)
    without = fzero.SimWorld(1).run(_leftovers_body, stage=stage, stray=False)

    def plain_body(comm: Any) -> list[Tensor]:
        model, state = _state(comm, stage)
        step = fzero.make_train_step(model, gb.mse_loss)
        batches = _batches(comm)
        for batch in batches:
            state, _ = step(state, batch)
        return _values(state)

    plain = fzero.SimWorld(1).run(plain_body)
    for run in (with_stray, without):
        assert all(torch.equal(a, b) for a, b in zip(run[0], plain[0], strict=True))


class SparseEmbedding(torch.nn.Module):
    """An embedding with sparse gradients (``sparse=True``) under a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(7, 4, sparse=True, dtype=torch.float64)
        self.head = torch.nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embed(tokens)).squeeze(-1).mean(-1)


def sparse_loss(call: Callable[..., Tensor], batch: Any) -> Tensor:
    tokens, target = batch
    return ((call(tokens) - target) ** 2).mean()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_sparse_gradient_trains_as_its_dense_values(stage: int) -> None:
    """``nn.Embedding(sparse=True)`` gives its weight a sparse gradient: every stage reduces its
    dense values, as torch.optim.SGD applies them (stages 2-3 copied it into the bucket with
    ``copy_``, which raised "copy_() between dense and sparse Tensors")."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 7, (4, 3), generator=gen),
                torch.randn(4, dtype=torch.float64, generator=gen)) for _ in range(3)]
    want = gb.reference(SparseEmbedding(), sparse_loss, batches,
                        lambda params: torch.optim.SGD(params, lr=0.1))
    for out in fzero.SimWorld(2).run(gb.train, SparseEmbedding(), sparse_loss, batches,
                                     stage=stage, opt=("sgd", {"lr": 0.1})):
        gb.assert_parity(out, want)
