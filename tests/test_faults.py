"""Faults fail fast and loudly: a stalled rank, non-finite values, a loss scale at its floor.

Every test asserts that *every* rank raises (or, for a stalled rank, that every other rank raises
within the timeout plus a few seconds), naming what went wrong, and never hangs.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import pytest
import torch

import fzero

import fault_bodies as fb
from dist_pool import WorkerError
from models import MLP, split_batch

STAGES = (0, 1, 2, 3)


@pytest.mark.parametrize("stage", STAGES)
def test_sim_stalled_rank_is_named_within_the_timeout(stage: int) -> None:
    """Within one timeout: stages 2 and 3 waited it out twice, in a round that was to tell the
    other ranks of the first, which the missing rank could not join either."""
    # The timeout bounds the first, normal step too: 2 s, not 1, so a loaded machine's thread
    # skew does not time it out (1 s did, 1 in 50 under load); the stall outlasts two of it.
    first, _ = fzero.SimWorld(2, timeout=2.0).run(fb.stall_body, stage, 1, 5.0, None)
    assert first["error"] == "CollectiveTimeout" and first["timeout"], first
    assert 2.0 <= first["after"] < 3.5
    assert "rank(s) [1] never joined it" in first["message"]
    assert "train step 2" in first["message"]  # the comm's scope names the step


def test_sim_stalled_rank_in_a_stage3_eval_step_is_named_within_the_timeout() -> None:
    """Stage 3 evaluates with gathers: after a timeout it ran a round to tell the other rank,
    which timed out too (raised after twice the timeout)."""
    first, _ = fzero.SimWorld(2, timeout=2.0).run(fb.stall_body, 3, 1, 5.0, None, evaluate=True)
    assert first["error"] == "CollectiveTimeout", first
    assert 2.0 <= first["after"] < 3.5
    assert "rank(s) [1] never joined it" in first["message"]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_timeout_while_publishing_the_update_gives_the_state_up(stage: int) -> None:
    """Stages 1-2 gather the updated shards, two buckets in flight: a timeout in the first
    left the second never waited for, and SimWorld failed the run with its raw TimeoutError
    (1 in 4); and the state, updated in part, blamed a Ctrl-C (a probe). The rank raises the
    timeout after one timeout, and its state names what happened."""
    from fzero import step as fstep

    update = fstep._update

    def slow_on_rank_1(state: Any, *args: Any, **kwargs: Any) -> Any:
        out = update(state, *args, **kwargs)
        if state.config.comm.rank == 1 and state.step == 1:
            time.sleep(4.0)
        return out

    def body(comm: Any) -> Any:
        model = MLP()
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm,
                           buckets=lambda m: m is model.fc1)
        step = fzero.make_train_step(model, MLP.loss_fn)
        batch = split_batch(MLP.make_batch(0, 12), comm.rank, comm.world_size)
        state, _ = step(state, batch)
        start = time.monotonic()
        try:
            step(state, batch)
        except fzero.CollectiveTimeout as exc:
            after = time.monotonic() - start
            with pytest.raises(ValueError) as info:
                fzero.clone_state(state)
            return after, str(exc), str(info.value)
        return None

    with mock.patch.object(fstep, "_update", slow_on_rank_1):
        first, _ = fzero.SimWorld(2, timeout=1.5).run(body)
    after, error, reuse = first
    assert 1.5 <= after < 3.0 and "all_gather" in error, first
    assert "train step 2 stopped while it updated this state's tensors in place " \
           "(interrupted, e.g. by Ctrl-C, or a collective of the update failed)" in reuse


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_gloo_stalled_rank_is_named_within_the_timeout(gloo_pool: Any, stage: int) -> None:
    pool = gloo_pool(2)
    pool.run(fb.identity_body)  # workers up before the clock starts
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(fb.stall_body, stage, 1, 20.0, 2.0)
    # Rank 0 raised CollectiveTimeout after ~2 s, naming the only other rank; the pool stopped
    # rank 1 (still asleep) and respawns its workers for the next test.
    assert time.monotonic() - t0 < 2.0 + 8.0
    assert info.value.ranks == [0]
    text = info.value.tracebacks[0]
    assert "CollectiveTimeout" in text and "rank 1 (the only other rank) did not arrive" in text
    assert "train step 2" in text


@pytest.mark.parametrize("stage", STAGES)
def test_too_many_skipped_steps_raise_naming_the_rank(stage: int) -> None:
    outcomes = fzero.SimWorld(2).run(fb.skip_body, stage, 1, 3)
    for out in outcomes:
        assert out["skipped"] == [(True, [1]), (True, [1])]  # two skips are tolerated
        assert out["error"] is not None and "3 steps in a row were skipped" in out["error"]
        assert "rank(s) [1] had a non-finite loss" in out["error"]
        assert out["ranks"] == (1,) and out["step"] == 1
        assert out["state_step"] == 0 and out["state_skipped"] == 2


@pytest.mark.parametrize("stage", STAGES)
def test_nan_parameters_are_named_when_a_step_skips(stage: int) -> None:
    for out in fzero.SimWorld(2).run(fb.nan_parameter_body, stage):
        assert out["error"] is not None
        assert "the parameters themselves hold NaN" in out["error"]
        assert "fc1.weight" in out["error"] or "on another rank" in out["error"]


def test_nan_parameters_are_refused_at_init() -> None:
    model = MLP()
    with torch.no_grad():
        model.fc2.bias[1] = float("inf")

    def body(comm: Any) -> str:
        with pytest.raises(ValueError, match=r"\['fc2.bias'\].*NaN or infinite") as info:
            fzero.init(model, stage=3, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        return str(info.value)

    assert len(fzero.SimWorld(2).run(body)) == 2


@pytest.mark.parametrize("stage", [1, 3])
def test_loss_scale_at_its_floor_raises(stage: int) -> None:
    for out in fzero.SimWorld(2).run(fb.loss_scale_floor_body, stage):
        assert out["error"] is not None and "at its floor 1" in out["error"]


def test_loss_scale_backs_off_to_its_floor_only() -> None:
    scale = fzero.LossScale(scale=4.0, floor=1.0)
    scale = scale.after(False).after(False).after(False)
    assert scale.scale == 1.0 and scale.at_floor


def test_max_skipped_is_validated() -> None:
    with pytest.raises(ValueError, match="max_skipped"):
        fzero.make_train_step(MLP(), MLP.loss_fn, max_skipped=0)
