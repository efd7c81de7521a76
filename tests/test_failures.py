"""A step that cannot be applied raises on every rank, leaves every rank's state unchanged, and
training goes on from that state.

- A rank whose loss_fn (or backward) raises: that rank raises its own exception, the others
  `fzero.StepError` naming the rank and its message; continuing afterwards equals
  single-process torch.optim that skipped that step.
- A rank given another number of micro-batches: `StepError` on every rank before anything
  moves (fzero.consensus's header).
- A rank given a consumed state: that rank its `ValueError`, the others `StepError`.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import fzero

import guarantee_bodies as gb

STAGES = (0, 1, 2, 3)
FULL = [0, 1, 2, -1]  # the free last slot lets `failing_backward` add a raising node
STEPS, BAD_STEP, BAD_RANK = 4, 1, 1
SECONDS = 5.0
"""Every rank raises well within this. The SimWorld runs here time collectives out after it
too (instead of 30 s), so that a rank left waiting fails the test quickly."""


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def world_of(n: int) -> fzero.SimWorld:
    return fzero.SimWorld(n, timeout=SECONDS)


@functools.cache
def batches(world: int) -> list[Any]:
    return gb.routed_batches([[FULL] * world] * STEPS)


@functools.cache
def skipped_reference(world: int) -> gb.Reference:
    return gb.reference(gb.Routed().double(), gb.routed_loss, batches(world), skip=[BAD_STEP])


def check_failed_step(outs: list[dict[str, Any]], world: int, own: str, text: str) -> None:
    """Rank BAD_RANK raised `own`, the others StepError naming it; nothing changed; the rest
    of training equals the reference that skipped that step."""
    want = skipped_reference(world)
    for rank, out in enumerate(outs):
        assert sorted(out["errors"]) == [BAD_STEP], rank
        error = out["errors"][BAD_STEP]
        assert error["unchanged"], rank
        assert error["seconds"] < SECONDS
        if rank == BAD_RANK:
            assert error["type"] == own and text in error["message"]
        else:
            assert error["type"] == "StepError", error
            assert error["ranks"] == (BAD_RANK,) and error["step"] == BAD_STEP + 1
            assert f"rank {BAD_RANK}" in error["message"] and text in error["message"]
        assert out["step"] == STEPS - 1
        gb.assert_parity(out, want)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_loss_fn_raising_on_one_rank(stage: int, world: int) -> None:
    fail = {BAD_STEP: {BAD_RANK: gb.failing_route}}
    outs = world_of(world).run(gb.train_through_failure, gb.Routed().double(),
                                     gb.routed_loss, batches(world), stage=stage, fail=fail)
    check_failed_step(outs, world, "Boom", "loss_fn failed on purpose")


@pytest.mark.parametrize("stage", STAGES)
def test_an_interrupt_on_one_rank_is_told_to_every_rank(stage: int) -> None:
    """A KeyboardInterrupt (not an Exception) in one rank's loss_fn: the others waited out the
    timeout, or (gloo, stages 1-2) that rank's next collective met their reductions and gloo
    aborted its process (a probe). Every rank now learns of it, as of an Exception."""
    fail = {BAD_STEP: {BAD_RANK: gb.interrupting_route}}
    outs = world_of(3).run(gb.train_through_failure, gb.Routed().double(),
                           gb.routed_loss, batches(3), stage=stage, fail=fail)
    check_failed_step(outs, 3, "KeyboardInterrupt", "interrupted on purpose")


@pytest.mark.parametrize("stage", STAGES)
def test_backward_raising_on_one_rank(stage: int) -> None:
    fail = {BAD_STEP: {BAD_RANK: gb.failing_backward}}
    outs = world_of(3).run(gb.train_through_failure, gb.Routed().double(),
                                 gb.routed_loss, batches(3), stage=stage, fail=fail)
    check_failed_step(outs, 3, "Boom", "backward failed on purpose")


@pytest.mark.parametrize("world", [2, 3])
def test_loss_fn_raising_on_one_gloo_rank(gloo_pool: Any, world: int) -> None:
    fail = {BAD_STEP: {BAD_RANK: gb.failing_route}}
    for stage in STAGES:
        outs = gloo_pool(world).run(gb.train_through_failure, gb.Routed().double(),
                                    gb.routed_loss, batches(world), stage=stage, fail=fail)
        check_failed_step(outs, world, "Boom", "loss_fn failed on purpose")


@pytest.mark.parametrize("stage", STAGES)
def test_loss_fn_raising_on_every_rank(stage: int) -> None:
    """Every rank fails alike: each raises its own exception; nothing changes."""
    fail = {BAD_STEP: dict.fromkeys(range(2), gb.failing_route)}
    outs = world_of(2).run(gb.train_through_failure, gb.Routed().double(),
                                 gb.routed_loss, batches(2), stage=stage, fail=fail)
    for out in outs:
        error = out["errors"][BAD_STEP]
        assert error["type"] == "Boom" and error["unchanged"]
        gb.assert_parity(out, skipped_reference(2))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_different_number_of_micro_batches(stage: int, world: int) -> None:
    fail = {BAD_STEP: {BAD_RANK: gb.split_in_two}}
    outs = world_of(world).run(gb.train_through_failure, gb.Routed().double(),
                                     gb.routed_loss, batches(world), stage=stage, fail=fail)
    for out in outs:
        error = out["errors"][BAD_STEP]
        assert error["type"] == "StepError" and error["unchanged"]
        assert error["ranks"] == (BAD_RANK,)
        assert "micro batches" in error["message"] and "nothing was communicated" in (
            error["message"])
        assert error["moved"] == 0
        assert f"2 on ranks [{BAD_RANK}]" in error["message"]
        gb.assert_parity(out, skipped_reference(world))


def test_different_number_of_micro_batches_on_gloo(gloo_pool: Any) -> None:
    """Stages 0-2 check the header (in flight over gloo during the forward) at their first
    reduction, stage 3 before its first gather: every rank raises either way."""
    fail = {BAD_STEP: {BAD_RANK: gb.split_in_two}}
    for stage in STAGES:
        outs = gloo_pool(3).run(gb.train_through_failure, gb.Routed().double(), gb.routed_loss,
                                batches(3), stage=stage, fail=fail)
        assert all(out["errors"][BAD_STEP]["type"] == "StepError" for out in outs)
        gb.assert_parity(outs[0], skipped_reference(3))


def consumed_outcomes(run: Any, stage: int) -> list[dict[str, Any]]:
    model = gb.MLP64()
    data = gb.mse_batches(2)
    outs = run(gb.consumed_state_step, model, data, stage=stage, stale_rank=BAD_RANK)
    want = gb.reference(model, gb.mse_loss, data)
    for rank, out in enumerate(outs):
        error = out["error"]
        if rank == BAD_RANK:
            assert error["type"] == "ValueError" and "consumed by train step 1" in (
                error["message"])
        else:
            assert error["type"] == "StepError" and error["ranks"] == (BAD_RANK,)
            assert "could not start" in error["message"]
        assert out["step"] == 2
        gb.assert_parity({"losses": [out["loss"]], "params": out["params"]},
                         gb.Reference(want.losses[1:], want.params))
    return outs


@pytest.mark.parametrize("stage", STAGES)
def test_consumed_state_on_one_rank(stage: int) -> None:
    consumed_outcomes(world_of(3).run, stage)


def test_consumed_state_on_one_gloo_rank(gloo_pool: Any) -> None:
    for stage in (1, 3):
        consumed_outcomes(gloo_pool(2).run, stage)


def _shape_error_loss(call: Any, batch: Any) -> Any:
    x, route, y = batch
    return (call(x, route) @ torch.ones(7, 1)).sum()  # a torch RuntimeError: shapes mismatch


def _runtime_error_body(comm: Any, stage: int, bad_ranks: tuple[int, ...]) -> Any:
    state = fzero.init(gb.Routed().double(), stage=stage, comm=comm,
                       optimizer=gb.make_optimizer(("sgd", gb.SGD)))
    loss_fn = _shape_error_loss if comm.rank in bad_ranks else gb.routed_loss
    step = fzero.make_train_step(gb.Routed().double(), loss_fn)
    try:
        step(state, gb.rank_rows(batches(comm.world_size)[0], comm.rank, comm.world_size))
    except Exception as error:  # reported to the test, per rank
        if comm.rank in bad_ranks and len(bad_ranks) == comm.world_size:
            raise
        return type(error).__name__, error.__cause__ is error
    return None


@pytest.mark.parametrize("stage", STAGES)
def test_a_torch_runtime_error_in_forward_is_raised_as_it_was(stage: int) -> None:
    """Stage 3 re-raised a RuntimeError that was not a released read as its own cause (a
    cycle), and SimWorld, walking the causes, never returned."""
    outs = world_of(2).run(_runtime_error_body, stage, (1,))
    assert outs == [("StepError", False), ("RuntimeError", False)]
    with pytest.raises(fzero.SimWorldError) as info:
        world_of(2).run(_runtime_error_body, stage, (0, 1))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.__cause__.__cause__ is not info.value.__cause__


class _Interrupt(BaseException):
    """What Ctrl-C raises into a step (KeyboardInterrupt), without stopping pytest."""


class _InterruptInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise _Interrupt


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with gb.seeded(0):
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, interrupt: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(_InterruptInBackward.apply(h) if interrupt else h)


def _two_layer_loss(call: Any, batch: Any) -> torch.Tensor:
    x, y, interrupt = batch
    return torch.nn.functional.mse_loss(call(x, interrupt), y)


def _interrupted_body(comm: Any, model: torch.nn.Module, stage: int, data: list[Any]) -> Any:
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1),
                       buckets=[["a.weight", "a.bias", "b.weight", "b.bias"]])
    step = fzero.make_train_step(model, _two_layer_loss)
    state, _ = step(state, (*data[0], False))
    with pytest.raises(_Interrupt):  # after b's gradients, before a's: the bucket incomplete
        step(state, (*data[1], True))
    state, _ = step(state, (*data[2], False))
    return fzero.full_params(state)


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_interrupted_in_backward_leaves_no_gradient_behind(stage: int) -> None:
    """A BaseException (Ctrl-C) in backward skips the recovery that zeroes a failed step's
    gradients; the leaves a train step keeps from step to step (stage 3 too, since they are
    reused) must not carry the interrupted step's gradients into the next one: without the
    reset before each step, stage 3 trained `b` 0.03-0.06 off torch."""
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 4, dtype=torch.float64, generator=gen),
             torch.randn(4, 2, dtype=torch.float64, generator=gen)) for _ in range(3)]
    [ours] = fzero.SimWorld(1).run(_interrupted_body, _TwoLayers().double(), stage, data)
    want = _TwoLayers().double()
    opt = torch.optim.SGD(want.parameters(), lr=0.1)
    for x, y in (data[0], data[2]):  # the interrupted step is not applied
        opt.zero_grad()
        torch.nn.functional.mse_loss(want(x, False), y).backward()
        opt.step()
    for name, param in want.named_parameters():
        torch.testing.assert_close(ours[name], param.detach(), rtol=0, atol=gb.F64_ATOL)


def _eval_failing_on_rank_1_at_once(comm: Any, model: torch.nn.Module) -> Any:
    """A stage-3 eval step right after init (no sequence agreed yet, one bucket per module)
    whose forward raises on rank 1 in its middle module, while rank 0 goes on to gather the
    last one."""
    buckets = [[f"{m}.weight", f"{m}.bias"] for m in ("fc1", "norm", "fc2")]
    state = fzero.init(model, stage=3, comm=comm, optimizer=fzero.optim.sgd(lr=0.1),
                       buckets=buckets)

    def fail_on_rank_1(module: Any, args: Any) -> None:
        if comm.rank == 1:
            raise ValueError("eval fn failed on rank 1")

    model.norm.register_forward_pre_hook(fail_on_rank_1)
    try:
        fzero.make_eval_step(model, gb.mse_loss)(state, gb.mse_batches(1, rows=2)[0])
        raised = None
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        raised = exc
    return type(raised).__name__, str(raised)


def test_a_stage3_eval_step_failing_on_one_rank_before_any_sequence_raises_step_error() -> None:
    """Before a train step agreed a gather sequence, stage 3 gathers in rounds, and a round
    that showed a failed peer raised fzero's internal `PeerFailed` on the healthy ranks (a
    probe); they raise `StepError` naming the rank, as once a sequence is agreed."""
    healthy, failed = fzero.SimWorld(2).run(_eval_failing_on_rank_1_at_once, gb.MLP64())
    assert failed == ("ValueError", "eval fn failed on rank 1")
    assert healthy[0] == "StepError" and "another rank failed in this eval step" in healthy[1]
