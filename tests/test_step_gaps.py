"""Behaviours of fzero.step and fzero.bound that no test pinned until a mutation probe of those
two files (2026-11-26) changed one line at a time and every test still passed: each test here
fails on its mutant (named in brackets) and passes on fzero."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fzero

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def _batches(count: int, rows: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 3, generator=g, dtype=torch.float64),
             torch.randn(rows, 2, generator=g, dtype=torch.float64)) for _ in range(count)]


def _mse(call: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(call(x), y)


def _rising(step: int) -> float:
    return 0.05 * step


def _step_schedule_body(comm: Any, model: nn.Module, data: list[Any], stage: int) -> Any:
    state = fzero.init(model, stage=stage, comm=comm,
                       optimizer=fzero.optim.adamw(lr=1.0, weight_decay=0.1))
    step = fzero.make_train_step(model, _mse, lr=_rising)
    rates = []
    for x, y in data:
        n = x.shape[0] // comm.world_size
        rows = slice(comm.rank * n, (comm.rank + 1) * n)
        state, metrics = step(state, (x[rows], y[rows]))
        rates.append(metrics["lr"])
    return rates, fzero.full_params(state)


@pytest.mark.parametrize(("stage", "world"), [(0, 1), (1, 2), (3, 2)])
def test_the_steps_lr_schedule_is_read_at_the_one_based_step(stage: int, world: int) -> None:
    """[S03] make_train_step(lr=schedule) gives step k (1-based) schedule(k), as setting a
    torch optimizer's group lr before its k-th step does (the optimizer's own schedule is
    pinned by test_divergence; the step's `lr=` was not: schedule(k - 1) trained silently
    with every rate one step late, and a schedule that is 0 at step 0 skipped the warm-up)."""
    data = _batches(3)
    model = _mlp()
    ref = _mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1.0, weight_decay=0.1)
    for number, batch in enumerate(data, start=1):
        for group in opt.param_groups:
            group["lr"] = _rising(number)
        opt.zero_grad(set_to_none=True)
        _mse(ref, batch).backward()
        opt.step()
    want = dict(ref.named_parameters())
    for rates, params in fzero.SimWorld(world).run(_step_schedule_body, model, data, stage):
        assert rates == [_rising(k) for k in (1, 2, 3)]
        for name, value in want.items():
            torch.testing.assert_close(params[name], value.detach(), rtol=1e-12, atol=1e-12)


class _NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def _failing_after_forward_body(comm: Any, model: nn.Module, stage: int) -> Any:
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2)) + 5.0

    def failing(call: Any, batch: Any) -> torch.Tensor:
        call(batch).sum()  # BatchNorm updates its running statistics here
        raise RuntimeError("loss_fn failed after the forward")

    before = {name: b.clone() for name, b in state.buffers.items()}
    with pytest.raises(RuntimeError, match="failed after the forward"):
        fzero.make_train_step(model, failing)(state, x)
    after = {name: b.clone() for name, b in state.buffers.items()}
    state, _ = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean())(state, x)
    return before, after


@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_that_raises_leaves_the_states_buffers_unchanged(stage: int) -> None:
    """[S06] A step works on copies of the state's buffers: one whose loss_fn raises after the
    forward updated BatchNorm's running statistics leaves the state as it was ("this rank's
    state is unchanged"), and the state trains on. Without the copy, the failed step's
    running statistics stayed in the state."""
    ((before, after),) = fzero.SimWorld(1).run(_failing_after_forward_body, _NormNet(), stage)
    assert set(before) == set(after)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def _zero_gradient_body(comm: Any, model: nn.Module, stage: int) -> Any:
    state = fzero.init(model, stage=stage, comm=comm,
                       optimizer=fzero.optim.adamw(lr=0.1, weight_decay=0.1))
    step = fzero.make_train_step(model, lambda call, batch: 0.0 * call(batch).sum())
    state, metrics = step(state, torch.ones(2, 3, dtype=torch.float64))
    return metrics, fzero.full_params(state)


@pytest.mark.parametrize(("stage", "world"), [(0, 2), (1, 2), (3, 1)])
def test_a_step_whose_gradients_are_all_zero_is_applied(stage: int, world: int) -> None:
    """[S09] A gradient norm of exactly 0 is finite: the step is applied (AdamW's weight decay
    still shrinks the parameters, as torch's does with zero gradients) and counted, not
    skipped as non-finite."""
    model = _mlp()
    ref = _mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    (0.0 * ref(torch.ones(2, 3, dtype=torch.float64)).sum()).backward()
    opt.step()
    for metrics, params in fzero.SimWorld(world).run(_zero_gradient_body, model, stage):
        assert metrics["grad_norm"] == 0.0
        assert metrics["skipped"] is False and metrics["step"] == 1
        for name, value in ref.named_parameters():
            torch.testing.assert_close(params[name], value.detach(), rtol=1e-12, atol=1e-12)


def _exported_then_trained_body(comm: Any, model: nn.Module, stage: int) -> Any:
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    model.load_state_dict(fzero.full_params(state), strict=False)  # the state's own values
    step = fzero.make_train_step(model, _mse)
    losses = []
    for batch in _batches(3):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return losses


@pytest.mark.parametrize("stage", [0, 3])
def test_the_states_values_exported_into_the_module_are_accepted_for_good(stage: int) -> None:
    """[S48] Values written into the module that equal the state's (its parameters exported
    with load_state_dict) are accepted once: later steps, after updates made the state
    differ from them, do not take the same old write for a new one and raise."""
    (losses,) = fzero.SimWorld(1).run(_exported_then_trained_body, _mlp(), stage)
    assert len(losses) == 3


def _converted_to_the_states_dtype_body(comm: Any, model: nn.Module) -> Any:
    state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1),
                       param_dtype=torch.bfloat16)
    model.to(torch.bfloat16)  # the dtype the state computes in: the same values
    step = fzero.make_train_step(model, lambda call, b: call(b).float().pow(2).mean())
    state, metrics = step(state, torch.ones(2, 3, dtype=torch.bfloat16))
    return metrics["step"]


def test_a_module_converted_to_the_states_own_dtype_trains() -> None:
    """[S53] A module converted after init to the dtype the state holds it in
    (init(param_dtype=bfloat16), then model.to(bfloat16)) holds the state's values: the step
    accepts it, as documented ("to other than the state's own dtype and device" raises)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    assert fzero.SimWorld(2).run(_converted_to_the_states_dtype_body, model) == [1, 1]


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count.double() + 1.5  # reassigned, in another dtype
        return self.lin(x)


def _reassigned_buffer_body(comm: Any, model: nn.Module) -> Any:
    state = fzero.init(model, stage=0, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    step = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean())
    with pytest.raises(ValueError, match="'count' was reassigned in forward to shape"):
        step(state, torch.ones(2, 3))
    return state.buffers["count"].clone()


def test_a_buffer_reassigned_in_another_dtype_raises() -> None:
    """[B02] A buffer forward reassigns to a tensor of another dtype (int64 -> float64) cannot
    be kept as the state's (which keeps its dtype): the step raises instead of casting the
    new value into the old dtype (1.5 truncated to 1) silently."""
    (count,) = fzero.SimWorld(1).run(_reassigned_buffer_body, _Counter())
    assert count.dtype == torch.int64 and count.item() == 0


def test_same_values_needs_the_same_shape_and_takes_nan_for_nan() -> None:
    """[B09, B10] fzero.bound.same_values: a tensor that would broadcast against the reference
    (shape (1,) against (3,)) does not hold its values; NaN where the reference has NaN does."""
    from fzero.bound import same_values

    assert not same_values(torch.ones(1), torch.ones(3))
    assert not same_values(torch.ones(3, 1), torch.ones(3))
    nan = torch.tensor([float("nan"), 1.0])
    assert same_values(nan.clone(), nan)
    assert same_values(nan.double(), nan)
    assert not same_values(torch.tensor([0.0, 1.0]), nan)


class _NanBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 2)
        self.register_buffer("fill", torch.tensor([float("nan"), 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.fill.nan_to_num(0.0)


def _nan_buffer_reloaded_body(comm: Any, model: nn.Module) -> Any:
    state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    model.load_state_dict({**fzero.full_params(state), **state.buffers})  # the state's values
    step = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean())
    state, metrics = step(state, torch.ones(2, 2))
    return metrics["step"]


def test_state_values_with_nan_written_back_into_the_module_are_accepted() -> None:
    """[B10] A buffer holding NaN (a fill value), written back into the module with the state's
    own values, holds the state's values: the step accepts it, NaN matching NaN."""
    assert fzero.SimWorld(1).run(_nan_buffer_reloaded_body, _NanBuffer()) == [1]


class _HeldInAClosure(nn.Module):
    """Forward reaches `b.weight` through a closure, around the module's registry (a step
    binds a reference held in an attribute or a list; a closure's it cannot)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 3).double()
        self.b = nn.Linear(3, 1, bias=False).double()
        weight = self.b.weight
        self.held = lambda: weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) @ self.held().t()


def _reached_with_an_old_gradient_body(comm: Any, model: nn.Module, stage: int) -> Any:
    x = torch.ones(2, 3, dtype=torch.float64)
    model(x).pow(2).mean().backward()  # the module's own parameters hold a .grad now
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    step = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean())
    with pytest.raises((ValueError, fzero.StepError), match="b.weight"):
        step(state, x)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_parameter_reached_around_the_registry_raises_also_when_it_had_a_gradient(
        stage: int) -> None:
    """[B17] A parameter the forward reaches around the module's registry is found by the
    gradient autograd leaves on the module's own object; when that object already held a
    .grad (an earlier plain backward), autograd adds into it in place: the step must see the
    in-place write (the gradient's version), not only a new .grad object."""
    # Not copied: a copy's closure would still hold the original module's parameter.
    fzero.SimWorld(1, copy_args=False).run(_reached_with_an_old_gradient_body,
                                           _HeldInAClosure(), stage)


def _skips_apart_body(comm: Any, model: nn.Module) -> Any:
    state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    step = fzero.make_train_step(model, lambda call, b: (call(b[0]) * b[1]).pow(2).mean(),
                                 max_skipped=2)
    x = torch.ones(2, 3, dtype=torch.float64)
    skipped = []
    for factor in (float("nan"), 1.0, float("nan"), 1.0):
        state, metrics = step(state, (x, torch.full((2, 1), factor, dtype=torch.float64)))
        skipped.append((metrics["skipped"], state.skipped))
    return skipped


def test_max_skipped_counts_skips_in_a_row_only() -> None:
    """[S12] max_skipped bounds the steps skipped *in a row*: an applied step resets the count,
    so two skips apart never reach max_skipped=2 (the count kept growing across applied steps
    and raised StepError at the second skip)."""
    for skipped in fzero.SimWorld(2).run(_skips_apart_body, _mlp()):
        assert skipped == [(True, 1), (False, 0), (True, 1), (False, 0)]


def _loaded_into_the_module_later_body(comm: Any, model: nn.Module) -> Any:
    state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    step = fzero.make_train_step(model, _mse)
    batch = _batches(1)[0]
    state, _ = step(state, batch)
    other = {name: torch.full_like(t, 0.5) for name, t in model.state_dict().items()}
    model.load_state_dict(other)  # in place: the same tensor objects, new values
    with pytest.raises((ValueError, fzero.StepError), match="were written in place"):
        step(state, batch)


def test_weights_loaded_into_the_module_after_a_step_raise() -> None:
    """[B24] model.load_state_dict(...) after the first step writes the module's own tensors in
    place (same objects, same memory): a step would silently ignore them, so it raises; the
    tensors' version counters show the write (their data pointers do not change)."""
    fzero.SimWorld(1).run(_loaded_into_the_module_later_body, _mlp())


def _state_written_before_the_first_step_body(comm: Any, model: nn.Module) -> Any:
    state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    with torch.no_grad():  # the state's own tensors take other values (an in-place load)
        for flat in state.params:
            flat.add_(0.25)
        for master in state.master:
            if master is not None and master.data_ptr() != state.params[0].data_ptr():
                master.add_(0.25)
    step = fzero.make_train_step(model, _mse)
    state, metrics = step(state, _batches(1)[0])
    return metrics["step"]


def test_a_state_written_after_init_trains_without_comparing_the_module() -> None:
    """[B22] The first step compares the module's values with those the state took from it,
    to see a .data write into the module after init, unless the state's own tensors were
    written since: then they, not the module, hold the values to train, and the module's old
    values are no reason to raise."""
    assert fzero.SimWorld(1).run(_state_written_before_the_first_step_body, _mlp()) == [1]
