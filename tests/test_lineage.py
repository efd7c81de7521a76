"""Which state a rank passes: every rank must pass its part of one and the same state.

Two states of one architecture (two `fzero.init` calls: two models, an EMA built with init, two
seeds) have the same layout and step. Stepped in another order on each rank, stage 3 trained a
mix of the two states' shards without an error (no rank holds another's parameters to
compare; stages 0-2 raised, blaming a write through ``.data``). `ShardState.lineage` tells
them apart: steps, `full_params` and `fzero.save` compare it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import fzero

import guarantee_bodies as gb

STAGES = [0, 1, 2, 3]


def _two_states(comm: Any, stage: int) -> tuple[Any, Any, Any]:
    """Two states of one MLP architecture (other weights), and a train step for them."""
    first, second = gb.MLP64(seed=0), gb.MLP64(seed=5)
    a = fzero.init(first, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    b = fzero.init(second, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    return a, b, fzero.make_train_step(first, gb.mse_loss)


def _batch(comm: Any) -> Any:
    return gb.rank_rows(gb.mse_batches(1, rows=4)[0], comm.rank, comm.world_size)


@pytest.mark.parametrize("stage", STAGES)
def test_ranks_that_step_two_states_in_another_order_raise_before_anything_moves(
        stage: int) -> None:
    def body(comm: Any) -> tuple[str, str, bool]:
        a, b, step = _two_states(comm, stage)
        mine = a if comm.rank == 0 else b  # rank 0 steps A first, rank 1 B
        before = [t.clone() for t in mine.params]
        try:
            step(mine, _batch(comm))
        except fzero.StepError as error:
            same = all(x.equal(y) for x, y in zip(before, mine.params, strict=True))
            return type(error).__name__, str(error), same
        return "trained", "", False

    for kind, message, same in fzero.SimWorld(2).run(body):
        assert kind == "StepError" and same, message
        assert "ranks disagree on the state before it started" in message, message
        assert "its part of the same state" in message, message


def test_two_inits_and_two_loads_are_different_states_and_a_rank_s_are_alike(
        tmp_path: Any) -> None:
    def body(comm: Any) -> tuple[int, ...]:
        a, b, step = _two_states(comm, 3)
        a, _ = step(a, _batch(comm))
        path = os.path.join(str(tmp_path), "ckpt")
        fzero.save(a, path)
        model = gb.MLP64()
        first = fzero.load(path, model=model, comm=comm)
        second = fzero.load(path, model=model, comm=comm)
        return a.lineage, b.lineage, first.lineage, second.lineage

    ranks = fzero.SimWorld(2).run(body)
    assert ranks[0] == ranks[1]  # every rank holds its part of the same states
    assert len(set(ranks[0])) == 4  # a step keeps its state's; init and load draw new ones


@pytest.mark.parametrize("stage", [1, 3])
def test_a_clone_is_another_state_and_every_rank_s_clone_the_same(stage: int) -> None:
    """Every rank's clone of one state gets the same lineage (they step it together); a rank
    that steps the clone while another steps the original is told so."""

    def body(comm: Any) -> tuple[str, int]:
        a, _, step = _two_states(comm, stage)
        clone = fzero.clone_state(a)
        both = fzero.clone_state(a)  # cloned again at the same step: the same lineage
        assert clone.lineage == both.lineage != a.lineage
        try:
            step(clone if comm.rank == 0 else a, _batch(comm))
        except fzero.StepError as error:
            return str(error), clone.lineage
        return "trained", clone.lineage

    (first, lineage), (second, other) = fzero.SimWorld(2).run(body)
    assert lineage == other
    assert "ranks disagree on the state" in first and "ranks disagree on the state" in second


def test_full_params_and_save_refuse_ranks_that_pass_different_states(tmp_path: Any) -> None:
    def body(comm: Any) -> tuple[str, str]:
        a, b, _ = _two_states(comm, 3)
        mine = a if comm.rank == 0 else b
        errors = []
        for call in (lambda: fzero.full_params(mine),
                     lambda: fzero.save(mine, os.path.join(str(tmp_path), "mixed"))):
            try:
                call()
            except (ValueError, fzero.checkpoint.CheckpointError) as error:
                errors.append(str(error))
            else:
                errors.append("no error")
        return errors[0], errors[1]

    for gathered, saved in fzero.SimWorld(2).run(body):
        assert "the state (layout, stage, step, lineage)" in gathered, gathered
        assert "the state's lineage" in saved and "nothing was written" in saved, saved
    assert not os.path.exists(os.path.join(str(tmp_path), "mixed"))
