"""Tests of fzero.state: the ShardState value, `init`, `state_bytes` and `LossScale`.

Cheapest first: pure (LossScale), then `init` on SimWorld ranks (no training step). What a
state holds per stage is the module docstring's table; its measured bytes are the stage table of
docs/design.md plus the padding, which the tests derive from the layout themselves
(`step_bodies.padding_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import fzero
from fzero.layout import first_overlap
from fzero.state import LossScale, ShardState, state_bytes, state_bytes_theory

import step_bodies as sb
from models import MLP, MODELS, FrozenMix, TinyGPT

STAGES = (0, 1, 2, 3)
WORLD_SIZES = (1, 2, 3, 4)


def run(world: int, body: Any, *args: Any, **kwargs: Any) -> list[Any]:
    return fzero.SimWorld(world).run(body, *args, **kwargs)


def state_tensors(state: ShardState) -> list[Tensor]:
    """Every tensor the state holds, in field order (the same object may appear twice)."""
    out: list[Tensor] = [*state.params]
    out += [t for t in state.grads if t is not None]
    out += [t for t in state.master if t is not None]
    out += [t for values in state.moments.values() for t in values if t is not None]
    out += list(state.buffers.values())
    return out


# ----------------------------------------------------------------------------------------------
# LossScale (pure)


def test_loss_scale_backs_off_and_grows() -> None:
    scale = LossScale(scale=1024.0, interval=3)
    assert scale.after(False) == LossScale(scale=512.0, interval=3, good_steps=0)
    grown = scale.after(True).after(True)
    assert grown.scale == 1024.0 and grown.good_steps == 2
    assert grown.after(True) == LossScale(scale=2048.0, interval=3, good_steps=0)
    assert grown.after(False) == LossScale(scale=512.0, interval=3, good_steps=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        scale.scale = 1.0  # type: ignore[misc]


@given(
    finite=st.lists(st.booleans(), max_size=60),
    interval=st.integers(1, 7),
    growth=st.sampled_from([2.0, 4.0]),
    backoff=st.sampled_from([0.5, 0.25]),
    floor=st.sampled_from([0.0, 1.0, 2.0**10]),
)
def test_loss_scale_follows_the_grad_scaler_rule(
    finite: list[bool], interval: int, growth: float, backoff: float, floor: float
) -> None:
    """torch.amp.GradScaler's update rule, replayed step by step, backing off never below
    `floor` (floor 0 is GradScaler's rule exactly)."""
    state = LossScale(
        scale=2.0**16, growth=growth, backoff=backoff, interval=interval, floor=floor
    )
    scale, streak = 2.0**16, 0
    for ok in finite:
        state = state.after(ok)
        if not ok:
            scale, streak = max(scale * backoff, floor), 0
        else:
            streak += 1
            if streak == interval:
                scale, streak = scale * growth, 0
        assert (state.scale, state.good_steps) == (scale, streak)


def test_loss_scale_backs_off_to_the_floor_not_below() -> None:
    """Regression (hypothesis): nine overflows in a row at backoff 0.25 stop at the floor."""
    state = LossScale(scale=2.0**16, backoff=0.25, interval=1)
    for _ in range(9):
        state = state.after(False)
    assert state.scale == 1.0 and state.at_floor


# ----------------------------------------------------------------------------------------------
# ShardState as a value


@pytest.fixture(scope="module")
def states() -> dict[tuple[str, int], ShardState]:
    """Rank 0's state at init, for each model and stage (N = 2)."""
    out = {}
    for name in ("mlp", "tiny_gpt", "frozen_mix"):
        for stage in STAGES:
            out[name, stage] = run(2, sb.init_body, MODELS[name](), stage=stage)[0]
    return out


def test_state_is_a_frozen_dataclass(states: dict[tuple[str, int], ShardState]) -> None:
    state = states["mlp", 1]
    assert dataclasses.is_dataclass(state)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = 3  # type: ignore[misc]
    later = dataclasses.replace(state, step=7)
    assert later.step == 7 and state.step == 0
    assert later.layout is state.layout and later.config is state.config
    assert all(a is b for a, b in zip(state_tensors(later), state_tensors(state), strict=True))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", ["mlp", "tiny_gpt"])
def test_pytree_leaves_are_the_state_tensors(
    states: dict[tuple[str, int], ShardState], name: str, stage: int
) -> None:
    """The leaves are the state's tensors, each memory once: a master copy that is the
    parameters (stages 0 and 3) or a view of their shard (stages 1-2) is rebuilt from them, so
    an in-place update of every leaf (an EMA's ``lerp_``) updates it once (it was a leaf of its
    own, updated twice: a probe)."""
    state = states[name, stage]
    leaves, spec = pytree.tree_flatten(state)
    assert all(isinstance(leaf, Tensor) for leaf in leaves)
    assert len({id(leaf) for leaf in leaves}) == len(leaves)
    assert first_overlap((str(i), leaf) for i, leaf in enumerate(leaves)) is None
    held = {leaf.untyped_storage().data_ptr() for leaf in leaves}
    assert all(t.untyped_storage().data_ptr() in held for t in state_tensors(state))
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, ShardState)
    assert (back.layout, back.stage, back.step, back.config) == (
        state.layout, state.stage, state.step, state.config,
    )
    for field in ("params", "grads"):
        assert all(a is b for a, b in zip(getattr(back, field), getattr(state, field),
                                          strict=True))
    for a, b in zip(back.master, state.master, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
    shapes = pytree.tree_map(lambda t: tuple(t.shape), state)  # a look at it: no tensors
    assert shapes.params == tuple(tuple(p.shape) for p in state.params)


@pytest.mark.parametrize("stage", [1, 3])
def test_pytree_leaves_with_frozen_buckets(
    states: dict[tuple[str, int], ShardState], stage: int
) -> None:
    state = states["frozen_mix", stage]
    leaves = pytree.tree_leaves(state)
    assert all(isinstance(leaf, Tensor) for leaf in leaves), [type(x).__name__ for x in leaves]
    copied = pytree.tree_map(lambda t: t.clone(), state)
    assert copied.grads.count(None) == state.grads.count(None) > 0


@pytest.mark.parametrize("stage", STAGES)
def test_tree_map_round_trip_keeps_layout_stage_step(stage: int) -> None:
    """A tree_map'd copy (after one step, so step and bucket order are set) is a working state:
    same static fields, new but equal tensors, and it trains exactly like the original."""
    batches = [TinyGPT.make_batch(s, 4) for s in range(2)]
    for out in run(2, sb.tree_map_body, TinyGPT(), batches, stage=stage):
        assert all(out["same_static"].values()), out["same_static"]
        assert out["fresh"] and out["equal"]
        assert out["losses"][0] == out["losses"][1]
        original, copied = out["params"]
        for name, value in original.items():
            assert torch.equal(copied[name], value), name


# ----------------------------------------------------------------------------------------------
# What init stores, per stage (the module table)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("stage", STAGES)
def test_init_stores_what_the_stage_table_says(stage: int, dtype: torch.dtype | None) -> None:
    world = 3
    for rank, state in enumerate(run(world, sb.init_body, FrozenMix(), stage=stage,
                                     param_dtype=dtype)):
        assert (state.stage, state.step, state.rank) == (stage, 0, rank)
        assert set(state.moments) == {"exp_avg", "exp_avg_sq"}
        for index, bucket in enumerate(state.layout.buckets):
            full, shard = bucket.padded_numel, bucket.shard_numel
            params = state.params[index]
            assert params.shape == ((shard,) if stage == 3 else (full,))
            assert params.dtype == (dtype or torch.float32)
            if not bucket.trainable:
                assert state.grads[index] is None and state.master[index] is None
                assert all(v[index] is None for v in state.moments.values())
                continue
            grads, master = state.grads[index], state.master[index]
            assert grads.shape == ((full,) if stage < 2 else (shard,))
            assert not grads.any()
            assert master.shape == ((full,) if stage == 0 else (shard,))
            assert master.dtype == torch.float32
            for values in state.moments.values():
                assert values[index].shape == master.shape and not values[index].any()
            shares = master.untyped_storage().data_ptr() == params.untyped_storage().data_ptr()
            assert shares is (dtype is None)  # fp32: the parameters are the master copy
            lo, hi = bucket.shard_range(rank)
            mine = params if stage == 3 else params[lo:hi] if stage else params
            # The master copy holds this rank's part of the parameters, in full precision.
            assert torch.equal(master.to(params.dtype), mine)


def test_init_takes_rank0_values() -> None:
    """Ranks start from different models (same shapes): every rank ends with rank 0's values."""
    models = [FrozenMix(seed=r) for r in range(3)]
    assert not torch.equal(models[0].perm, models[1].perm)
    truth = dict(models[0].named_parameters())
    for stage in (0, 3):
        for out in run(3, sb.init_full_body, models, stage):
            for name, value in truth.items():
                assert torch.equal(out["params"][name], value.detach()), name
            for name, value in models[0].named_buffers():
                assert torch.equal(out["buffers"][name], value), name


# ----------------------------------------------------------------------------------------------
# Measured bytes: the table plus exactly the padding


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("name", ["mlp", "tiny_gpt", "frozen_mix"])
def test_state_bytes_are_table_plus_padding(name: str, dtype: torch.dtype | None) -> None:
    padded = False
    for stage in STAGES:
        for world in WORLD_SIZES:
            for out in run(world, sb.init_bytes_body, MODELS[name](), stage=stage,
                           param_dtype=dtype):
                pad = sb.padding_bytes(out["layout"], stage)
                padded |= pad > 0
                assert out["measured"] == pytest.approx(out["theory"] + pad, abs=1e-6), (
                    stage, world,
                )
    assert padded


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_state_bytes_theory_is_the_table(world: int) -> None:
    """MLP (all trainable): docs/design.md's formulas by hand, K = 12 mixed precision, 8 in fp32."""
    psi = sum(p.numel() for p in MLP().parameters())
    mixed = {0: 16 * psi, 1: 4 * psi + 12 * psi / world, 2: 2 * psi + 14 * psi / world,
             3: 16 * psi / world}
    fp32 = {0: 16 * psi, 1: 8 * psi + 8 * psi / world, 2: 4 * psi + 12 * psi / world,
            3: 16 * psi / world}
    for stage in STAGES:
        for dtype, table in ((torch.bfloat16, mixed), (None, fp32)):
            state = run(world, sb.init_body, MLP(), stage=stage, param_dtype=dtype)[0]
            assert state_bytes_theory(state) == pytest.approx(table[stage], rel=1e-12)
            pad = sb.padding_bytes(state.layout, stage)
            assert state_bytes(state) == pytest.approx(table[stage] + pad, abs=1e-6)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_state_bytes_theory_with_another_reduce_dtype(world: int) -> None:
    """reduce_dtype other than the compute dtype: stages 2-3 keep their gradient shards in it,
    stages 0-1 keep full gradients in the compute dtype (the theory counted them in
    reduce_dtype). By hand, P and G the bytes per element of parameters and gradients."""
    psi = sum(p.numel() for p in MLP().parameters())
    for param_dtype, reduce_dtype, master_k in ((torch.bfloat16, torch.float32, 12),
                                                (None, torch.bfloat16, 8)):
        p = 2 if param_dtype is not None else 4
        g = {0: p, 1: p, 2: reduce_dtype.itemsize, 3: reduce_dtype.itemsize}
        for stage in STAGES:
            table = {0: (p + g[0] + master_k) * psi,
                     1: (p + g[1]) * psi + master_k * psi / world,
                     2: p * psi + (g[2] + master_k) * psi / world,
                     3: (p + g[3] + master_k) * psi / world}
            state = run(world, sb.init_body, MLP(), stage=stage, param_dtype=param_dtype,
                        reduce_dtype=reduce_dtype)[0]
            assert state_bytes_theory(state) == pytest.approx(table[stage], rel=1e-12)
            pad = sb.padding_bytes(state.layout, stage, reduce_dtype=reduce_dtype)
            assert state_bytes(state) == pytest.approx(table[stage] + pad, abs=1e-6)


def test_state_bytes_without_optimizer_moments() -> None:
    """Plain SGD keeps no moments: stage 0 fp32 is params + grads only, 8 bytes per element."""
    sgd = fzero.optim.sgd(lr=0.1)
    state = run(1, sb.init_body, MLP(), stage=0, optimizer=sgd)[0]
    psi = sum(p.numel() for p in MLP().parameters())
    assert state.moments == {}
    assert state_bytes(state) == state_bytes_theory(state) == 8 * psi


@given(
    cap=st.integers(1, 200),
    world=st.integers(1, 5),
    stage=st.sampled_from(STAGES),
    bf16=st.booleans(),
)
def test_state_bytes_with_any_bucketing(cap: int, world: int, stage: int, bf16: bool) -> None:
    """Any bucket size cap (so any number of buckets and paddings), world size and stage."""
    dtype = torch.bfloat16 if bf16 else None
    out = run(world, sb.init_bytes_body, FrozenMix(), stage=stage, param_dtype=dtype,
              buckets=cap)[0]
    pad = sb.padding_bytes(out["layout"], stage)
    assert out["measured"] == pytest.approx(out["theory"] + pad, abs=1e-6)


# ----------------------------------------------------------------------------------------------
# init's bad input: clear errors, raised alike on every rank


def every_rank_raises(world: int, error: str, *args: Any, **kwargs: Any) -> list[str]:
    outcomes = run(world, sb.raises_body, sb.init_body, *args, **kwargs)
    assert all(o is not None and o[0] == error for o in outcomes), outcomes
    return [o[1] for o in outcomes]


@pytest.mark.parametrize("stage", [-1, 4, 10])
def test_init_rejects_unknown_stage(stage: int) -> None:
    for message in every_rank_raises(2, "ValueError", MLP(), stage=stage):
        assert f"stage={stage}" in message and "(0, 1, 2, 3)" in message


@pytest.mark.parametrize("stage", [True, 1.0])
def test_init_rejects_non_int_stage(stage: Any) -> None:
    outcomes = run(2, sb.raises_body, sb.init_body, MLP(), stage=stage)
    assert all(o is not None and o[0] in ("TypeError", "ValueError") for o in outcomes), outcomes


def test_init_rejects_foreign_optimizers() -> None:
    model = MLP()
    torch_adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pair = (fzero.optim.adamw().init, fzero.optim.adamw().update)
    for optimizer in (torch_adamw, torch.optim.AdamW, pair):
        for message in every_rank_raises(2, "TypeError", model, stage=1, optimizer=optimizer):
            assert "fzero.optim" in message


def test_init_rejects_non_float_dtypes() -> None:
    for message in every_rank_raises(1, "TypeError", MLP(), stage=1, param_dtype=torch.int32):
        assert "param_dtype" in message


@pytest.mark.parametrize(
    ("world", "different", "make"),
    [
        (2, [1], lambda: MLP(d_hidden=14)),
        (3, [2], lambda: MLP().double()),
        (4, [1, 3], lambda: TinyGPT()),
    ],
)
def test_init_with_different_models_names_the_ranks(
    world: int, different: list[int], make: Any
) -> None:
    models: list[nn.Module] = [make() if r in different else MLP() for r in range(world)]
    outcomes = run(world, sb.raises_body, sb.init_per_rank_body, models, 1)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None and outcome[0] == "ValueError", outcome
        message = outcome[1]
        assert "layout fingerprint" in message and f"this is rank {rank}" in message
        for r in range(1, world):
            assert (f"rank {r}:" in message) is (r in different), (r, message)


def test_init_with_different_models_raises_on_every_gloo_rank(gloo_pool: Any) -> None:
    """On real processes too: every rank raises (none is left blocked in a collective)."""
    models = [MLP(), MLP(d_hidden=14)]
    outcomes = gloo_pool(2).run(sb.raises_body, sb.init_per_rank_body, models, 3)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None and outcome[0] == "ValueError", outcome
        assert f"this is rank {rank}" in outcome[1] and "rank 1:" in outcome[1]
    # The group is still usable afterwards: the same pool initializes matching models.
    states = gloo_pool(2).run(sb.init_bytes_body, MLP(), stage=3)
    assert states[0]["measured"] == states[1]["measured"] > 0


@pytest.mark.parametrize("stage", STAGES)
def test_an_ema_updated_leaf_by_leaf_is_the_average(stage: int) -> None:
    """``tree_map(lambda e, s: e.lerp_(s, a), ema, state)``: each memory is one leaf, so the
    parameters move by the average's step once (a master copy that is them, or a view of
    them, was a leaf too and moved them twice: 5.6e-3 off after 3 steps, a probe), also
    between states at different step counts (torch's "Node context mismatch" before)."""
    batches = [MLP.make_batch(s, 4) for s in range(3)]
    for out in run(2, sb.ema_body, MLP(), batches, stage=stage, param_dtype=None):
        assert out["steps"] == (0, 3)
        for name, value in out["want"].items():
            torch.testing.assert_close(out["ema"][name], value, rtol=0, atol=0)


def _deep_copies(comm: Any, model: nn.Module) -> Any:
    import copy

    state = fzero.init(model, stage=3, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    copied = copy.deepcopy(state)
    step = fzero.make_train_step(model, type(model).loss_fn)
    copied, _ = step(copied, MLP.make_batch(comm.rank, 2))
    return (copied.config is state.config, fzero.full_params(state),
            fzero.full_params(copied), state.step, copied.step)


def test_deepcopy_of_a_state_is_clone_state() -> None:
    """``copy.deepcopy(state)`` walked into the comm: "cannot pickle '_thread.RLock'" in
    SimWorld, a process group over gloo, and a silently copied comm with one process (a
    probe). It is `clone_state` now: tensors of its own, the same comm."""
    model = MLP()
    for same_config, before, after, step, copied_step in run(2, _deep_copies, model):
        assert same_config and (step, copied_step) == (0, 1)
        assert any(not torch.equal(after[n], v) for n, v in before.items())
        for name, value in dict(model.named_parameters()).items():
            torch.testing.assert_close(before[name], value.detach(), rtol=0, atol=0)
