"""Tests of fzero.step (make_train_step, make_eval_step, full_params) on SimWorld and gloo ranks.

Every stage must train like single-process torch.optim on the global batch (docs/design.md,
"Numbers we hold ourselves to": <= 1e-5 relative in fp32), measure the stage table's bytes, move the
stage's communication volume, and leave the user's module untouched. Per-rank bodies live in
tests/step_bodies.py; references are computed here with `models.reference_train`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import fzero
from fzero.comm import ring_bytes
from fzero.layout import ShardLayout
from fzero.simworld import SimWorldError

import guarantee_bodies as gb
import step_bodies as sb
from models import MLP, MODELS, FrozenMix, TinyGPT, reference_train, split_batch

STAGES = (0, 1, 2, 3)
WORLD_SIZES = (1, 2, 3, 4)
GLOBAL_BATCH = 12  # divisible by every world size 1..4
PARITY_STEPS = 20
RTOL, ATOL = 1e-5, 1e-6  # docs/design.md: <= 1e-5 relative in fp32


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ----------------------------------------------------------------------------------------------
# References


@functools.cache
def global_batches(name: str, count: int = 4, size: int = GLOBAL_BATCH) -> tuple[Any, ...]:
    cls = MODELS[name] if name in MODELS else getattr(sb, name)
    return tuple(cls.make_batch(seed, size) for seed in range(count))


def model_of(name: str, seed: int = 0) -> nn.Module:
    return (MODELS[name] if name in MODELS else getattr(sb, name))(seed=seed)


def adamw_factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **sb.ADAMW)


def adamw_two_groups(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The usual split: decay matrices and embeddings, not biases and norm weights."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, **sb.ADAMW)


def sgd_factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, **sb.SGD)


FACTORIES = {"adamw": adamw_factory, "adamw_groups": adamw_two_groups, "sgd": sgd_factory}


@functools.cache
def reference(
    name: str, steps: int, opt: str = "adamw", count: int = 4, size: int = GLOBAL_BATCH
) -> Any:
    model = model_of(name)
    return reference_train(
        model, type(model).loss_fn, global_batches(name, count, size), FACTORIES[opt], steps
    )


def reference_with_norms(
    model: nn.Module, batches: Sequence[Any], steps: int, clip: float
) -> tuple[list[float], list[float], dict[str, Tensor]]:
    """`reference_train` with clipping, also returning each step's pre-clip total norm."""
    import copy

    model = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw_factory(trainable)
    losses, norms = [], []
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = type(model).loss_fn(model, batches[i % len(batches)])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, clip).item())
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# Comparisons


def assert_losses(actual: Sequence[float], expected: Sequence[float], rtol: float = RTOL) -> None:
    assert len(actual) == len(expected)
    torch.testing.assert_close(
        torch.tensor(actual, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=rtol,
        atol=ATOL,
    )


def assert_params(
    actual: dict[str, Tensor], expected: dict[str, Tensor], model: nn.Module, rtol: float = RTOL
) -> None:
    """`actual` (full_params) holds every name the model has, aliases included, and matches."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set(actual) == names
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=rtol, atol=ATOL, msg=name)
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = next(n for n, p in model.named_parameters() if p is param)
        assert torch.equal(actual[name], actual[owner]), f"alias {name} differs from {owner}"


def assert_ranks_agree(results: list[dict[str, Any]]) -> None:
    """Every rank reports the same losses and the same full parameters, bitwise."""
    first = results[0]
    for other in results[1:]:
        assert other["losses"] == first["losses"]
        for name, value in first["params"].items():
            assert torch.equal(other["params"][name], value), name


def run(world: int, body: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    return fzero.SimWorld(world).run(body, *args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Parity: every stage x world size x model, 20 steps of AdamW, fp32


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt", "frozen_mix"])
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_parity_with_torch_adamw(stage: int, world: int, name: str) -> None:
    ref = reference(name, PARITY_STEPS)
    model = model_of(name)
    results = run(world, sb.train_body, model, global_batches(name), PARITY_STEPS, stage=stage)
    assert_ranks_agree(results)
    assert_losses(results[0]["losses"], ref.losses)
    assert_params(results[0]["params"], ref.params, model)
    assert results[0]["step"] == PARITY_STEPS
    assert all(not m["skipped"] for m in results[0]["metrics"])
    assert ref.losses[-1] < ref.losses[0]  # the runs compared actually train


@pytest.mark.parametrize("buckets", [None, 100])
@pytest.mark.parametrize(("stage", "world"), [(0, 2), (1, 3), (2, 4), (3, 3)])
def test_decay_matrices_matches_adamw_with_two_param_groups(
    stage: int, world: int, buckets: int | None
) -> None:
    """`decay=fzero.decay_matrices` (none for < 2-dim parameters) is torch's two param groups,
    also when small buckets (a 100-element cap) make shards cut through parameters everywhere;
    the default decays everything, as `torch.optim.AdamW(model.parameters())` (the parity
    tests above)."""
    ref = reference("tiny_gpt", 10, "adamw_groups")
    single = reference("tiny_gpt", 10, "adamw")
    model = TinyGPT()
    results = run(
        world, sb.train_body, model, global_batches("tiny_gpt"), 10, stage=stage,
        decay=fzero.decay_matrices, buckets=buckets,
    )
    if buckets is not None:
        assert len(results[0]["layout"].buckets) > 10
    assert_losses(results[0]["losses"], ref.losses)
    assert_params(results[0]["params"], ref.params, model)
    # The two references differ, so this test tells the rules apart.
    assert not torch.allclose(ref.params["blocks.0.ln1.bias"], single.params["blocks.0.ln1.bias"])


def _spare_the_head(name: str, shape: tuple[int, ...]) -> bool:
    return not name.startswith("lm_head.")


def test_a_decay_rule_that_splits_a_tie_raises() -> None:
    """It was asked about the tie's first name only: sparing ``lm_head.*`` on TinyGPT (whose
    head is its embedding) silently decayed the head through ``tok_emb.weight``."""
    messages = every_rank_raises(2, sb.train_body, TinyGPT(), global_batches("tiny_gpt")[:1],
                                 1, stage=1, decay=_spare_the_head)
    for message in messages:
        assert ("decay= gives the names of one tied tensor different answers, "
                "{'tok_emb.weight': True, 'lm_head.weight': False}") in message


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_on_gloo(gloo_pool: Any, stage: int, world: int) -> None:
    ref = reference("tiny_gpt", PARITY_STEPS)
    model = TinyGPT()
    results = gloo_pool(world).run(
        sb.train_body, model, global_batches("tiny_gpt"), PARITY_STEPS, stage=stage
    )
    assert_ranks_agree(results)
    assert_losses(results[0]["losses"], ref.losses)
    assert_params(results[0]["params"], ref.params, model)


def test_uneven_batches_raise_on_every_gloo_rank(gloo_pool: Any) -> None:
    batch = MLP.make_batch(0, 10)
    per_rank = [tuple(t[:4] for t in batch), tuple(t[4:] for t in batch)]
    outcomes = gloo_pool(2).run(sb.raises_body, sb.uneven_batch_body, MLP(), per_rank, 2)
    for outcome in outcomes:
        assert outcome is not None and outcome[0] == "StepError"
        assert "different sizes" in outcome[1]
    even = [per_rank[0], per_rank[0]]  # the same body with equal sizes runs fine
    assert gloo_pool(2).run(sb.raises_body, sb.uneven_batch_body, MLP(), even, 2) == [None, None]


# ----------------------------------------------------------------------------------------------
# Other optimizers, accumulation, clipping


@pytest.mark.parametrize("stage", STAGES)
def test_sgd_nesterov_parity(stage: int) -> None:
    ref = reference("tiny_gpt", 10, "sgd")
    model = TinyGPT()
    results = run(
        3, sb.train_body, model, global_batches("tiny_gpt"), 10, stage=stage, opt=("sgd", sb.SGD)
    )
    assert_losses(results[0]["losses"], ref.losses)
    assert_params(results[0]["params"], ref.params, model)


@pytest.mark.parametrize("stage", STAGES)
def test_accumulation_equals_one_big_batch(stage: int) -> None:
    """accum_steps=4 over each rank's 24 rows == the reference on the whole 48-row batch."""
    ref = reference("tiny_gpt", 8, "adamw", 2, 48)
    model = TinyGPT()
    results = run(
        2, sb.train_body, model, global_batches("tiny_gpt", 2, 48), 8, stage=stage, accum=4
    )
    assert_losses(results[0]["losses"], ref.losses)
    assert_params(results[0]["params"], ref.params, model)


@pytest.mark.parametrize(("stage", "world"), [(0, 3), (1, 2), (2, 3), (3, 4), (3, 1)])
def test_clipping_matches_clip_grad_norm(stage: int, world: int) -> None:
    clip, steps = 1.0, 10
    model = TinyGPT()
    batches = global_batches("tiny_gpt")
    losses, norms, params = reference_with_norms(model, batches, steps, clip)
    assert sum(n > clip for n in norms) >= steps // 2  # clipping is active on most steps
    results = run(world, sb.train_body, model, batches, steps, stage=stage, clip=clip)
    out = results[0]
    assert_losses(out["losses"], losses)
    assert_params(out["params"], params, model)
    grad_norms = [m["grad_norm"] for m in out["metrics"]]
    assert_losses(grad_norms, norms)  # pre-clip global norms, every step
    unclipped = reference("tiny_gpt", steps)
    assert not torch.allclose(unclipped.params["tok_emb.weight"], params["tok_emb.weight"])


# ----------------------------------------------------------------------------------------------
# Mixed precision

# Measured (TinyGPT, 20 steps, AdamW lr 1e-2, batch 12, every stage and N = 1..4): bf16 vs fp32
# losses differ by at most 0.016 absolute / 0.18 % relative (N=3); the fp32 master copies by at
# most 0.030 absolute (params are O(1)). Bounds below leave ~5x margin.
BF16_LOSS_RTOL = 1e-2
BF16_MASTER_ATOL = 0.15


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "world"), [(0, 2), (1, 3), (2, 4), (3, 2), (3, 3)])
def test_bf16_trains_close_to_fp32(stage: int, world: int) -> None:
    model = TinyGPT()
    batches = global_batches("tiny_gpt")
    fp32 = reference("tiny_gpt", PARITY_STEPS)
    out = run(
        world, sb.train_body, model, batches, PARITY_STEPS, stage=stage,
        param_dtype=torch.bfloat16, master=True,
    )[0]
    check_bf16_close_to_fp32(out, fp32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_on_the_gpu_trains_close_to_fp32(stage: int) -> None:
    """The same on the GPU, one rank: bf16 kernels there, the fp32 master beside them."""
    out = run(1, sb.train_body, TinyGPT().cuda(), global_batches("tiny_gpt"), PARITY_STEPS,
              stage=stage, param_dtype=torch.bfloat16, master=True, device="cuda")[0]
    check_bf16_close_to_fp32(out, reference("tiny_gpt", PARITY_STEPS))


def check_bf16_close_to_fp32(out: dict[str, Any], fp32: Any) -> None:
    """A bf16 run (with `master`) trains, close to the fp32 reference `fp32` but not equal to
    it; its compute copy is its fp32 master rounded to bf16."""
    losses = out["losses"]
    assert sum(losses[-4:]) / 4 < 0.5 * losses[0]  # it trains
    assert_losses(losses, fp32.losses, rtol=BF16_LOSS_RTOL)
    assert losses != pytest.approx(fp32.losses, rel=1e-6)  # and really computed in bf16
    params, master = out["params"], out["master"]
    for name, value in fp32.params.items():
        assert params[name].dtype == torch.bfloat16
        assert master[name].dtype == torch.float32
        torch.testing.assert_close(master[name], value, rtol=0, atol=BF16_MASTER_ATOL)
        # The compute copy is the master rounded to bf16; the master keeps more bits.
        assert torch.equal(master[name].to(torch.bfloat16), params[name])
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in master.values())


def overflow_batches(bad: int, count: int = 6) -> list[tuple[Tensor, Tensor, Tensor]]:
    batches = []
    for i in range(count):
        x, y = MLP.make_batch(i, GLOBAL_BATCH)
        factor = torch.full((GLOBAL_BATCH,), math.inf if i == bad else 1.0)
        batches.append((x.half(), y, factor))
    return batches


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_overflow_skips_exactly_one_step(stage: int) -> None:
    bad = 2
    records = run(2, sb.overflow_body, MLP(), overflow_batches(bad), bad, stage=stage)[0]
    for rec in records:
        i, m = rec["index"], rec["metrics"]
        assert m["skipped"] is (i == bad), (i, m)
        before, after = rec["before"], rec["after"]
        if i == bad:
            assert not math.isfinite(m["grad_norm"])
            assert after["step"] == before["step"] == bad
            assert rec["scale_after"] == rec["scale_before"] / 2 == m["loss_scale"]
            for name, value in before["master"].items():
                assert torch.equal(after["master"][name], value), name
            for key, values in before["moments"].items():
                for old, new in zip(values, after["moments"][key], strict=True):
                    assert (old is None and new is None) or torch.equal(old, new), key
        else:
            assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
            assert after["step"] == before["step"] + 1 == m["step"]
            assert rec["scale_after"] == rec["scale_before"]
            assert any(
                not torch.equal(after["master"][n], v) for n, v in before["master"].items()
            )
    assert records[-1]["after"]["step"] == len(records) - 1


def check_near_top(out: dict[str, Any]) -> None:
    """The step was applied: w = -0.1 * 0.75 (rounded to float16), the scale kept."""
    assert out["skipped"] is False and out["loss_scale"] == 2.0**16, out
    want = torch.full((1, 4), -0.1 * sb.NEAR_TOP).half()
    assert torch.equal(out["weight"], want), (out["weight"], want)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_fp16_gradients_near_the_top_of_their_range_average_without_overflow(
        stage: int, world: int) -> None:
    """Every rank's loss-scaled float16 gradient is 49152, a finite value one process (and DDP,
    which divides before it adds) averages to itself. Added before the division, two of them
    overflowed: the step was skipped and the loss scale halved at every N > 1 (a probe)."""
    for out in run(world, sb.near_top_body, stage=stage):
        check_near_top(out)


def test_fp16_gradients_near_the_top_of_their_range_on_gloo(gloo_pool: Any) -> None:
    for out in gloo_pool(2).run(sb.near_top_body, stage=3):
        check_near_top(out)


def test_fp16_state_starts_with_a_loss_scale_and_bf16_without() -> None:
    half = run(1, sb.init_body, MLP(), stage=1, param_dtype=torch.float16)[0]
    brain = run(1, sb.init_body, MLP(), stage=1, param_dtype=torch.bfloat16)[0]
    assert half.loss_scale == fzero.LossScale()
    assert brain.loss_scale is None


# ----------------------------------------------------------------------------------------------
# Evaluation and full_params


@pytest.mark.parametrize("stage", STAGES)
def test_eval_step_matches_reference_forward(stage: int) -> None:
    steps = 5
    model = TinyGPT()
    batches = global_batches("tiny_gpt")
    probe = TinyGPT.make_batch(99, 6)
    out = run(2, sb.eval_body, model, batches, steps, probe, stage=stage)
    ref = reference("tiny_gpt", steps)
    trained = TinyGPT()
    trained.load_state_dict(ref.params, strict=False)
    expected = TinyGPT.loss_fn(trained, probe).item()
    for rank_out in out:
        assert rank_out["loss"] == pytest.approx(expected, rel=RTOL)
        assert rank_out["again"] == rank_out["loss"]
        assert rank_out["requires_grad"] is False
        assert rank_out["initial"] == pytest.approx(TinyGPT.loss_fn(model, probe).item(), rel=1e-6)
        for name, value in rank_out["params_before"].items():
            assert torch.equal(rank_out["params_after"][name], value)
    assert out[0]["loss"] != pytest.approx(out[0]["initial"], rel=1e-3)


@pytest.mark.parametrize("stage", STAGES)
def test_full_params_before_any_step_are_the_model(stage: int) -> None:
    model = FrozenMix()
    out = run(3, sb.train_body, model, global_batches("frozen_mix"), 0, stage=stage, master=True)
    for rank_out in out:
        for name, param in model.named_parameters(remove_duplicate=False):
            assert torch.equal(rank_out["params"][name], param.detach()), name
            assert torch.equal(rank_out["master"][name], param.detach()), name


# ----------------------------------------------------------------------------------------------
# Measured memory and communication


def x_batch(name: str, dtype: torch.dtype | None, size: int = GLOBAL_BATCH) -> tuple[Tensor, ...]:
    batch = MODELS[name].make_batch(0, size)
    if dtype is None or not batch[0].is_floating_point():
        return batch
    return (batch[0].to(dtype), *batch[1:])


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("name", ["mlp", "tiny_gpt"])
def test_state_bytes_metric_is_table_plus_padding(name: str, dtype: torch.dtype | None) -> None:
    checked_padding = False
    for stage in STAGES:
        for world in WORLD_SIZES:
            metrics = run(
                world, sb.step_once_body, model_of(name), x_batch(name, dtype), stage=stage,
                param_dtype=dtype,
            )
            layout = metrics[0]["layout"]
            pad = sb.padding_bytes(layout, stage)
            checked_padding |= pad > 0
            for m in metrics:
                assert m["state_bytes"] == pytest.approx(m["state_bytes_theory"] + pad, abs=1e-6), (
                    stage, world,
                )
            if world == 1:  # no padding at N=1: the table exactly
                assert metrics[0]["state_bytes"] == metrics[0]["state_bytes_theory"]
    assert checked_padding


def expected_comm(
    layout: ShardLayout, stage: int, accum: int, itemsize: int, *, carried: int = 0
) -> dict[str, int]:
    """Ring bytes per step by kind: docs/design.md's comm column on the padded bucket sizes.

    Stage 3: `carried` backward phases start with the bucket their forward ended with, still
    gathered on every rank (here always the last bucket), and do not gather it again."""
    n = layout.world_size
    each = sum(ring_bytes("all_gather", b.padded_numel, itemsize, n)
               for b in layout.buckets if b.trainable)
    # The step's agreement messages (header, statistics) go on the control channel, counted
    # apart in metrics["control_bytes"].
    out = dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce", "broadcast"), 0)
    if stage == 0:
        out["all_reduce"] += 2 * each
    elif stage == 1:
        out["reduce_scatter"], out["all_gather"] = each, each
    elif stage == 2:
        out["reduce_scatter"], out["all_gather"] = accum * each, each
    else:
        kept = ring_bytes("all_gather", layout.buckets[-1].padded_numel, itemsize, n)
        out["reduce_scatter"] = accum * each
        out["all_gather"] = 2 * accum * each - carried * kept
    return out


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_comm_bytes_per_step_follow_the_table(dtype: torch.dtype | None, accum: int) -> None:
    """The first step (MLP: one bucket). At stage 3 its first backward has no agreed sequence
    yet and gathers again; each later one starts with the bucket still gathered."""
    itemsize = (dtype or torch.float32).itemsize
    for stage in STAGES:
        for world in WORLD_SIZES:
            batch = x_batch("mlp", dtype, 36)  # 36 rows: N * accum divides it for N = 1..4
            metrics = run(world, sb.step_once_body, MLP(), batch, stage=stage, accum=accum,
                          param_dtype=dtype)
            layout = metrics[0]["layout"]
            assert len(layout.buckets) == 1
            carried = accum - 1 if stage == 3 else 0
            want = expected_comm(layout, stage, accum, itemsize, carried=carried)
            for m in metrics:
                assert m["comm_bytes_by_kind"] == want, (stage, world)
                assert m["comm_bytes"] == sum(want.values())
            psi = sum(b.padded_numel for b in layout.buckets)
            factor = {0: 2, 1: 2, 2: accum + 1, 3: 3 * accum - carried}[stage]
            moved = metrics[0]["comm_bytes"]
            assert moved == factor * psi * itemsize * (world - 1) // world
            assert (metrics[0]["control_bytes"] > 0) == (world > 1)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_stage3_backward_keeps_the_buckets_forward_ended_with(world: int, accum: int) -> None:
    """Six one-Linear buckets: from the second step on (an agreed backward sequence), each
    backward starts with the last two layers' buckets, which forward left gathered on every
    rank (its last position prefetches nothing, so the one before stays within 1 + prefetch):
    they are not gathered again, and the parameters end as stage 0's. (Backward never gathers
    the first layer's bucket: its input needs no gradient, so its weight is not needed.)"""
    steps = 3
    out = run(world, sb.train_body, sb.Deep(), global_batches("Deep"), steps, stage=3,
              accum=accum)[0]
    plain = run(world, sb.train_body, sb.Deep(), global_batches("Deep"), steps, stage=0,
                accum=accum)[0]
    torch.testing.assert_close(out["params"], plain["params"], rtol=1e-6, atol=1e-7)
    layout = out["layout"]
    assert [b.names[0] for b in layout.buckets] == [f"layers.{i}.weight" for i in range(6)]
    ring = [ring_bytes("all_gather", b.padded_numel, 4, world) for b in layout.buckets]
    forward, backward, kept = sum(ring), sum(ring[1:]), ring[-1] + ring[-2]
    first, *later = out["metrics"]
    assert first["comm_bytes_by_kind"]["all_gather"] == (
        accum * (forward + backward) - (accum - 1) * kept)
    for m in later:
        assert m["comm_bytes_by_kind"]["all_gather"] == accum * (forward + backward - kept)
        assert m["comm_bytes_by_kind"]["reduce_scatter"] == accum * sum(ring)


def bucket_bytes(layout: ShardLayout) -> list[int]:
    """Each bucket's full (padded) fp32 bytes, largest first."""
    return sorted((b.padded_numel * 4 for b in layout.buckets), reverse=True)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_stage3_gathered_peak_is_bounded_by_prefetch(prefetch: int, world: int) -> None:
    """Six one-Linear buckets: at most 1 + prefetch buckets' full parameters at once."""
    out = run(world, sb.train_body, sb.Deep(), global_batches("Deep"), 3, stage=3,
              prefetch=prefetch)[0]
    layout = out["layout"]
    assert len(layout.buckets) == 6
    sizes = bucket_bytes(layout)
    psi_bytes = sum(ring_bytes("all_gather", b.padded_numel, 4, world) for b in layout.buckets)
    for m in out["metrics"]:
        assert sizes[0] <= m["gathered_bytes_peak"] <= sum(sizes[: prefetch + 1])
        # Forward gathers every bucket once, backward at most once more; one reduce-scatter.
        assert psi_bytes < m["comm_bytes_by_kind"]["all_gather"] <= 2 * psi_bytes
        assert m["comm_bytes_by_kind"]["reduce_scatter"] == psi_bytes


def test_stage3_no_prefetch_holds_one_bucket() -> None:
    """prefetch=0: one bucket at a time, so forward carries only its last one into backward."""
    out = run(2, sb.train_body, sb.Deep(), global_batches("Deep"), 2, stage=3, prefetch=0)[0]
    largest = bucket_bytes(out["layout"])[0]
    assert [m["gathered_bytes_peak"] for m in out["metrics"]] == [largest, largest]
    ring = [ring_bytes("all_gather", b.padded_numel, 4, 2) for b in out["layout"].buckets]
    later = out["metrics"][1]["comm_bytes_by_kind"]["all_gather"]
    assert later == sum(ring) + sum(ring[1:]) - ring[-1]


@pytest.mark.parametrize("prefetch", [1, 2])
def test_stage3_peak_with_a_wrong_first_order_guess(prefetch: int) -> None:
    """Reversed runs its buckets against registration order, the first step's guess: that step
    may prefetch uselessly (one bucket more), never pile buckets up; later steps follow the
    learned order within 1 + prefetch buckets."""
    out = run(2, sb.train_body, sb.Reversed(), global_batches("Reversed"), 3, stage=3,
              prefetch=prefetch)[0]
    sizes = bucket_bytes(out["layout"])
    peaks = [m["gathered_bytes_peak"] for m in out["metrics"]]
    assert peaks[0] <= sum(sizes[: prefetch + 2])
    assert all(peak <= sum(sizes[: prefetch + 1]) for peak in peaks[1:]), peaks


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gathered_peak_is_zero_below_stage3(stage: int) -> None:
    out = run(2, sb.train_body, sb.Deep(), global_batches("Deep"), 2, stage=stage)[0]
    assert [m["gathered_bytes_peak"] for m in out["metrics"]] == [0, 0]


# ----------------------------------------------------------------------------------------------
# Purity, meta skeletons, residency order


@pytest.mark.parametrize("name", ["tiny_gpt", "frozen_mix"])
@pytest.mark.parametrize("stage", STAGES)
def test_module_is_not_mutated(stage: int, name: str) -> None:
    diffs = run(2, sb.purity_body, model_of(name), global_batches(name), 3, stage=stage)
    assert diffs == [[], []]


def test_purity_check_sees_mutations() -> None:
    """The fingerprint used above notices each kind of change it claims to check."""
    model = FrozenMix()
    before = sb.module_fingerprint(model)
    assert sb.fingerprints_equal(before, sb.module_fingerprint(model)) == []
    changes: list[Callable[[FrozenMix], Any]] = [
        lambda m: m.proj.weight.data.add_(1),
        lambda m: setattr(m.proj, "weight", nn.Parameter(m.proj.weight.detach().clone())),
        lambda m: m.scale.add_(1),
        lambda m: setattr(m.head, "extra", 1),
        lambda m: m.head.register_forward_pre_hook(lambda *a: None),
        lambda m: m.register_full_backward_hook(lambda *a: None),
        lambda m: m.head.register_forward_hook(lambda *a: None),
    ]
    for change in changes:
        fresh = FrozenMix()
        base = sb.module_fingerprint(fresh)
        change(fresh)
        assert sb.fingerprints_equal(base, sb.module_fingerprint(fresh)) != []


@pytest.mark.parametrize("name", ["tiny_gpt", "frozen_mix"])
def test_stage3_trains_a_meta_skeleton(name: str) -> None:
    steps = 4
    with torch.device("meta"):
        skeleton = model_of(name)
    assert all(p.is_meta for p in skeleton.parameters())
    model, batches = model_of(name), global_batches(name)
    on_meta = run(2, sb.train_body, model, batches, steps, stage=3, skeleton=skeleton)
    materialized = run(2, sb.train_body, model, batches, steps, stage=3)
    assert on_meta[0]["losses"] == materialized[0]["losses"]
    for key, value in materialized[0]["params"].items():
        assert torch.equal(on_meta[0]["params"][key], value)
    assert_losses(on_meta[0]["losses"], reference(name, steps).losses)


def test_prefetch_depth_does_not_change_numbers() -> None:
    model, batches = TinyGPT(), global_batches("tiny_gpt")
    runs = [run(2, sb.train_body, model, batches, 3, stage=3, prefetch=p)[0] for p in (0, 1, 2)]
    for other in runs[1:]:
        assert other["losses"] == runs[0]["losses"]
        for key, value in runs[0]["params"].items():
            assert torch.equal(other["params"][key], value)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["Reversed", "CalledTwice"])
def test_stage3_forward_order_and_reuse_parity(name: str, world: int) -> None:
    """Forward order unlike registration order, and a block called twice, still train exactly."""
    steps = 6
    ref = reference(name, steps)
    model = model_of(name)
    out = run(world, sb.train_body, model, global_batches(name), steps, stage=3)[0]
    assert_losses(out["losses"], ref.losses)
    assert_params(out["params"], ref.params, model)


def test_stage3_module_registered_twice_in_a_list() -> None:
    """nn.ModuleList([a, b, a]): a's bucket is needed by two list entries (one module)."""
    steps = 4
    ref = reference("SharedInList", steps)
    model = sb.SharedInList()
    out = run(2, sb.train_body, model, global_batches("SharedInList"), steps, stage=3)[0]
    assert_losses(out["losses"], ref.losses)
    assert_params(out["params"], ref.params, model)


# ----------------------------------------------------------------------------------------------
# Bad input: clear errors, decided alike on every rank (nothing hangs)


def every_rank_raises(world: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[str]:
    """Run `fn` on every rank; assert each rank raised ValueError or StepError; return the
    messages."""
    outcomes = run(world, sb.raises_body, fn, *args, **kwargs)
    assert all(o is not None and o[0] in ("ValueError", "StepError") for o in outcomes), outcomes
    return [o[1] for o in outcomes]


@pytest.mark.parametrize("stage", STAGES)
def test_uneven_batches_raise_on_every_rank(stage: int) -> None:
    x, y = MLP.make_batch(0, 9)
    per_rank = [(x[:3], y[:3]), (x[3:], y[3:])]
    for message in every_rank_raises(2, sb.uneven_batch_body, MLP(), per_rank, stage):
        assert "different sizes" in message


def _mapping_loss(call: Callable[..., Tensor], batch: Any) -> Tensor:
    return ((call(batch["x"]) - batch["y"]) ** 2).mean()


def _uneven_mapping_body(comm: Any, wrap: str) -> None:
    """Rank 0 gets 4 rows, rank 1 gets 2, in a mapping: a ``UserDict`` (as Hugging Face's
    BatchEncoding, which torch's pytree takes for one leaf), or a dict whose first tensor is
    not one row per sample."""
    x, y = MLP.make_batch(0, 6)
    rows = slice(0, 4) if comm.rank == 0 else slice(4, 6)
    batch: Any = {"x": x[rows], "y": y[rows]}
    if wrap == "userdict":
        batch = collections.UserDict(batch)
    else:
        batch = {"offsets": torch.zeros(1, 3), **batch}
    model = MLP()
    state = fzero.init(model, stage=2, optimizer=gb.make_optimizer(("sgd", gb.SGD)), comm=comm)
    fzero.make_train_step(model, _mapping_loss)(state, batch)


@pytest.mark.parametrize("wrap", ["userdict", "first tensor not per row"])
def test_uneven_batches_in_a_mapping_raise(wrap: str) -> None:
    """Ranks' rows were counted from the first tensor pytree found: none in a UserDict (1 row
    everywhere), or one of shape (1, ...): unequal batches trained the mean of the ranks'
    means instead of the global mean, silently."""
    for message in every_rank_raises(2, _uneven_mapping_body, wrap):
        assert "rows per rank [4, 2]" in message


class _TokensAndPositions(nn.Module):
    """Token ids (B, T) and positions (T,): one tensor per row, one per position."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(10, 4, dtype=torch.float64)
        self.positions = nn.Embedding(16, 4, dtype=torch.float64)
        self.out = nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, ids: Tensor, positions: Tensor) -> Tensor:
        return self.out(self.tokens(ids) + self.positions(positions)).mean((1, 2))


def _per_row_loss(call: Callable[..., Tensor], batch: Any) -> Tensor:
    ids, positions = batch
    return (call(ids, positions) - (ids.sum(1) % 2).double()) ** 2


def _tokens_and_positions(rows: int, length: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (rows, length), generator=g), torch.arange(length)


def _tokens_and_positions_body(comm: Any, model: nn.Module, shapes: list[tuple[int, int]],
                               stage: int, leading: bool = False) -> dict[str, Tensor]:
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.5), comm=comm)
    step = fzero.make_train_step(model, lambda call, b: _per_row_loss(call, b).mean())
    ids, positions = _tokens_and_positions(*shapes[comm.rank], seed=comm.rank)
    state, _ = step(state, (ids, positions[None] if leading else positions))
    return fzero.full_params(state)


@pytest.mark.parametrize(("stage", "leading"), [(0, False), (3, False), (3, True)])
def test_ranks_padded_to_different_lengths_train_like_torch(stage: int, leading: bool) -> None:
    """Two rows on each rank, padded to lengths 8 and 6, beside positions of shape (T,) (or
    (1, T)): the larger of two equally common sizes along dim 0 counted 8 and 6 rows, and the
    step refused the ranks as of different sizes (a probe). T is a length (ids' dim 1), not
    rows: equal to torch on the whole batch (float64)."""
    model, shapes = _TokensAndPositions(), [(2, 8), (2, 6)]
    got = fzero.SimWorld(2).run(_tokens_and_positions_body, model, shapes, stage, leading)[0]
    reference = copy.deepcopy(model)
    batches = [_tokens_and_positions(*shape, seed=rank) for rank, shape in enumerate(shapes)]
    sum(_per_row_loss(reference, b).mean() for b in batches).div(2).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("leading", [False, True])
def test_ranks_of_different_rows_beside_a_position_tensor_raise(leading: bool) -> None:
    """Ranks of 2 rows (length 4) and 4 rows (length 2) both counted 4 rows (the larger of
    two equally common sizes) and trained the mean of the ranks' means, 0.15 away from
    torch's step on the whole batch, silently (a probe). With positions (1, T) the rows
    cannot be told (B or 1), and the ranks' tensors differ in size: refused too."""
    shapes = [(2, 4), (4, 2)]
    for message in every_rank_raises(2, _tokens_and_positions_body, _TokensAndPositions(),
                                     shapes, 1, leading):
        assert ("do not tell their rows" if leading else "rows per rank [2, 4]") in message


@dataclasses.dataclass
class _Batch:
    ids: Tensor
    labels: Tensor


def test_a_micro_batchs_rows() -> None:
    """`_micro_rows`: the most common dim 0, leaving out a size that is another tensor's later
    dim (a length: rotary tables (T, D) beside ids (B, T) counted T rows, a probe); None where
    two sizes are still equally common (the larger, or the higher-dimensional tensor's, counted
    T rows for (ids (B, T), positions (T,)) and 1 for (ids (B, T), mask (1, 1, T, T)): probes).
    A dataclass's fields count (it counted 1 row on every rank, a probe). `micro_weights`
    raises for MicroBatches whose sizes differ, or cannot be told and their tensors' sizes
    differ (MicroBatches of 4 and 2 rows beside one mask took equal weights, silently, a
    review), and takes equal weights where every micro-batch's tensors have the sizes of the
    others' in the same places."""
    rows = fzero.step._micro_rows
    ids, pos = torch.zeros(2, 8, dtype=torch.long), torch.arange(8)
    mask, table = torch.zeros(1, 1, 8, 8), torch.zeros(8, 4)
    assert rows({"ids": ids, "mask": ids, "pos": torch.zeros(8, 3)}) == 2
    assert rows({"ids": ids, "mask": ids, "pos": pos[None]}) == 2
    assert rows((ids, pos)) == 2 and rows((ids[:1], pos)) == 1  # (T is ids' length)
    assert rows({"ids": ids, "cos": table, "sin": table}) is None  # (T most common, a length)
    assert rows((torch.zeros(8, 8), torch.zeros(1, 8))) is None  # (B = T: ids (T, T))
    assert rows(_Batch(ids, ids[:, 0])) == 2 and rows(_Batch(ids[:1], ids[:1, 0])) == 1
    for unclear in ((ids, pos[None]), (ids, mask), (ids[:, :5], torch.zeros(4, 5, 5)),
                    (torch.zeros(3), torch.zeros(5))):
        assert rows(unclear) is None, unclear
    assert rows(("text", 1.0)) == 1
    assert fzero.step._rows([(ids, ids), (torch.zeros(3), torch.zeros(5))]) is None
    assert fzero.step._rows([(ids, pos), (ids[:1], ids[:1])]) == 3
    unequal = fzero.MicroBatches([(ids, pos), (ids.repeat(2, 1), pos)])
    with pytest.raises(ValueError, match=r"sizes along dim 0 \(\[2, 4\]\).*weights=\[2, 4\]"):
        fzero.step.micro_weights(unequal, list(unequal))
    given = fzero.MicroBatches([(ids, mask), (ids[:1], mask)])
    with pytest.raises(ValueError, match=r"size of micro-batch 1 cannot be told"):
        fzero.step.micro_weights(given, list(given))
    alike = fzero.MicroBatches([(ids, mask), (ids + 1, mask)])
    assert fzero.step.micro_weights(alike, list(alike)) is None
    # (in any order: a dict's keys may come in another, a review)
    labels, weights = torch.zeros(3), torch.zeros(5)
    reordered = fzero.MicroBatches([{"labels": labels, "w": weights},
                                    {"w": weights, "labels": labels}])
    assert fzero.step.micro_weights(reordered, list(reordered)) is None
    digest = fzero.step._shape_digest
    assert digest([reordered[0]]) == digest([reordered[1]])
    as_user_dicts = [collections.UserDict(m) for m in reordered]  # (one pytree leaf each)
    assert digest(as_user_dicts[:1]) == digest(as_user_dicts[1:])
    assert digest(as_user_dicts[:1]) != digest([collections.UserDict(labels=labels,
                                                                     w=weights[:4])])
    digests = [digest([m]) for m in ((ids, mask), (ids, mask[:, :, :6]), (ids.repeat(2, 1), mask))]
    assert digests[0] == digests[1] != digests[2] and 0 <= max(digests) < 2**50


def test_a_batch_without_rows_raises() -> None:
    """Rows of 0 (every tensor's dim 0, or the rows' beside a positions tensor (T,): trained
    with zero gradients and a NaN loss, weight decay and momentum moving the weights, a
    review) raise before anything moves."""
    model = nn.Linear(3, 1, dtype=torch.float64)
    x = torch.ones(2, 3, dtype=torch.float64)

    def body(comm: Any) -> bool:
        state = fzero.init(model, stage=1, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        step = fzero.make_train_step(model, lambda call, b: call(b[0]).pow(2).mean())
        for batch in ((x[:0], x[:0]), (x[:0], torch.arange(3))):
            with pytest.raises(ValueError, match="the batch has no rows"):
                step(state, batch)
        return True

    assert fzero.SimWorld(1).run(body) == [True]


def _images_and_boxes(boxes: Sequence[int], seed: int) -> dict[str, Any]:
    """A detection-like batch: one row per image, and per image a list entry of its boxes."""
    g = torch.Generator().manual_seed(seed)
    return {"images": torch.randn(len(boxes), 3, generator=g, dtype=torch.float64),
            "boxes": [torch.randn(n, 2, generator=g, dtype=torch.float64) for n in boxes]}


def _per_image_loss(call: Callable[..., Tensor], batch: dict[str, Any]) -> Tensor:
    """The mean over images of the squared distance to the mean of the image's boxes."""
    targets = torch.stack([b.mean(0) for b in batch["boxes"]])
    return (call(batch["images"]) - targets).pow(2).sum(1).mean()


def _images(batch: dict[str, Any]) -> int:
    return len(batch["images"])


def _declared_rows_body(comm: Any, model: nn.Module, boxes: list[list[int]], stage: int,
                        declare: bool, extra: int = 0) -> dict[str, Tensor]:
    """One step on `boxes[rank]`, its rows declared (plus `extra` per rank) or not."""
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.5), comm=comm)
    step = fzero.make_train_step(model, _per_image_loss, rows=(
        lambda b: _images(b) + extra * comm.rank) if declare else None)
    state, _ = step(state, _images_and_boxes(boxes[comm.rank], seed=comm.rank))
    return fzero.full_params(state)


@pytest.mark.parametrize("stage", [1, 3])
def test_declared_rows_train_a_batch_of_per_image_boxes_like_torch(stage: int) -> None:
    """Images (2, 3) beside per-image boxes (3, 2) and (1, 2) do not say their rows along dim 0
    (the step counted 1 row, the one size no other tensor's later dim, and refused ranks of 2
    images each as of different sizes; ranks of 2 and 3 images with one box each counted 1
    row on both and trained silently: a probe). A nested list of entries with tensors leaves
    the rows in doubt: ranks whose tensors' sizes differ raise. ``rows=`` declares them:
    equal to torch on the whole batch (float64)."""
    model, boxes = nn.Linear(3, 2, dtype=torch.float64), [[3, 1], [2, 2]]
    for given in (boxes, [[1, 1], [1, 1, 1]]):
        for message in every_rank_raises(2, _declared_rows_body, model, given, stage, False):
            assert "do not tell their rows" in message and "rows=lambda batch" in message
    got = fzero.SimWorld(2).run(_declared_rows_body, model, boxes, stage, True)[0]
    reference = copy.deepcopy(model)
    batches = [_images_and_boxes(b, seed=rank) for rank, b in enumerate(boxes)]
    sum(_per_image_loss(reference, b) for b in batches).div(2).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_declared_rows_weigh_ranks_that_differ(stage: int) -> None:
    """Ranks of 2, 3 and 1 images (as many boxes on the first two): each rank's loss weighs by
    its declared rows, so the step is torch's on the 6 images at once, and the loss reported
    their mean (float64). Undeclared, ranks of different rows raise, naming ``rows=``."""
    model, boxes = nn.Linear(3, 2, dtype=torch.float64), [[3, 3], [2, 2, 2], [5]]
    for message in every_rank_raises(2, _declared_rows_body, model, boxes[:2], 1, False):
        assert "do not tell their rows" in message and "rows=lambda batch" in message

    def body(comm: Any, model: nn.Module) -> tuple[dict[str, Tensor], float]:
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.5), comm=comm)
        step = fzero.make_train_step(model, _per_image_loss, rows=_images)
        state, metrics = step(state, _images_and_boxes(boxes[comm.rank], seed=comm.rank))
        return fzero.full_params(state), metrics["loss"]

    (got, loss), *_ = fzero.SimWorld(3).run(body, model)
    reference = copy.deepcopy(model)
    batches = [_images_and_boxes(b, seed=rank) for rank, b in enumerate(boxes)]
    whole = {"images": torch.cat([b["images"] for b in batches]),
             "boxes": [box for b in batches for box in b["boxes"]]}
    expected = _per_image_loss(reference, whole)
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert loss == pytest.approx(expected.item(), rel=1e-14)
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12)


def test_a_list_of_one_entry_per_row_is_not_cut_into_micro_batches() -> None:
    """Images (2, 3) beside per-image boxes [(2, 2), (2, 2)]: every dim 0 is 2, and
    accum_steps=2 cut each image's boxes in half, pairing each image with half of both
    images' boxes, silently (a review). A nested list of as many entries with tensors as the
    batch has rows is refused; MicroBatches of whole entries train like torch."""
    model = nn.Linear(3, 2, dtype=torch.float64)
    batch = _images_and_boxes([2, 2], seed=0)

    def body(comm: Any, model: nn.Module) -> dict[str, Tensor]:
        state = fzero.init(model, stage=1, optimizer=fzero.optim.sgd(lr=0.5), comm=comm)
        records = {"images": batch["images"], "boxes": [{"boxes": b} for b in batch["boxes"]]}
        for rows, given in ((_images, batch), (None, records), (_images, records)):
            with pytest.raises(ValueError, match=r"a list with tensors at \['boxes'\]"):
                fzero.make_train_step(model, _per_image_loss, accum_steps=2, rows=rows)(
                    state, given)
        parts = fzero.MicroBatches([{"images": batch["images"][i:i + 1],
                                     "boxes": batch["boxes"][i:i + 1]} for i in range(2)])
        state, _ = fzero.make_train_step(model, _per_image_loss)(state, parts)
        return fzero.full_params(state)

    got = fzero.SimWorld(1).run(body, model)[0]
    reference = copy.deepcopy(model)
    _per_image_loss(reference, batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12)
    ids = torch.zeros(2, 4)
    assert fzero.step.split_batch((ids, ids), 2)[0][0].shape == (1, 4)  # (the top level: rows)
    # Bare tensors as many as the rows are as likely batched inputs, ((ids, mask), labels) of
    # 2 rows (refused, a review): they split along dim 0, unless the rows are declared.
    for inputs in (((ids, ids), ids[:, 0]), {"inputs": [ids, ids], "y": ids}):
        assert [len(p) for p in fzero.step.split_batch(inputs, 2)] == [2, 2]
        with pytest.raises(ValueError, match="a list with tensors at"):
            fzero.step.split_batch(inputs, 2, declared=True)


def test_declared_rows_beyond_what_the_header_holds_raise_on_every_rank() -> None:
    """rows() of 2**63 on one rank: the int64 header could not hold it, and that rank raised
    before joining the header's all-gather, leaving the others waiting (a review)."""
    model = nn.Linear(3, 2, dtype=torch.float64)

    def body(comm: Any, model: nn.Module) -> None:
        state = fzero.init(model, stage=1, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        step = fzero.make_train_step(model, _per_image_loss, rows=lambda b: (
            len(b["images"]) if comm.rank == 0 else 2**63))
        step(state, _images_and_boxes([1, 1], seed=comm.rank))

    for message in every_rank_raises(2, body, model):
        assert "could not start" in message or f"more than {2**53}" in message


def _queries_and_passages(query_length: int, passage_length: int, seed: int
                          ) -> dict[str, Tensor]:
    """2 queries and their 4 passages, each padded to its rank's own length."""
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(2, query_length, generator=g, dtype=torch.float64),
            "p": torch.randn(4, passage_length, generator=g, dtype=torch.float64)}


def _query_loss(call: Callable[..., Tensor], batch: dict[str, Tensor]) -> Tensor:
    target = batch["p"].mean(1).view(2, 2).mean(1, keepdim=True)
    return (call(batch["q"].mean(1, keepdim=True)) - target).pow(2).mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_whose_row_counts_differ_by_their_lengths_alone_train(stage: int) -> None:
    """Queries (2, 4) beside passages (4, 3) count 2 rows (4 is a length), queries (2, 3)
    beside passages (4, 2) count 4 (2 is): their tensors have the same sizes along dim 0
    place by place, so as many rows, and they train like torch. A first version of ``rows=``
    refused them (a review)."""
    model, lengths = nn.Linear(1, 1, dtype=torch.float64), [(4, 3), (3, 2)]
    assert [fzero.step._rows([_queries_and_passages(*n, seed=0)]) for n in lengths] == [2, 4]

    def body(comm: Any, model: nn.Module) -> dict[str, Tensor]:
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.5), comm=comm)
        step = fzero.make_train_step(model, _query_loss)
        state, _ = step(state, _queries_and_passages(*lengths[comm.rank], seed=comm.rank))
        return fzero.full_params(state)

    got = fzero.SimWorld(2).run(body, model)[0]
    reference = copy.deepcopy(model)
    batches = [_queries_and_passages(*n, seed=rank) for rank, n in enumerate(lengths)]
    sum(_query_loss(reference, b) for b in batches).div(2).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12)


class _TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8, dtype=torch.float64)
        self.head = nn.Linear(8, 11, dtype=torch.float64)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def _token_mean(call: Callable[..., Tensor], batch: dict[str, Tensor]) -> Tensor:
    """Cross-entropy over the target tokens (labels -100 are padding), as Hugging Face's."""
    logits = call(batch["ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                       ignore_index=-100)


def _tokens(batch: dict[str, Tensor]) -> Tensor:
    return (batch["labels"] != -100).sum()


def _padded_tokens(rows: int, length: int, targets: Sequence[int], seed: int
                   ) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (rows, length), generator=g)
    labels = torch.randint(0, 11, (rows, length), generator=g)
    for row, n in enumerate(targets):
        labels[row, n:] = -100
    return {"ids": ids, "labels": labels}


@pytest.mark.parametrize(("stage", "accum"), [(1, 1), (2, 2), (3, 2)])
def test_declared_target_tokens_make_a_token_mean_exact_across_ranks(stage: int,
                                                                     accum: int) -> None:
    """A token mean over padded sequences: ranks (and micro-batches) hold different numbers of
    target tokens, so the mean of their means is not the global token mean (DDP's answer);
    declared as rows, the target tokens weigh each rank and micro-batch, and the step equals
    torch's on the global batch's tokens (float64), with AdamW over two steps."""
    targets = [[[5, 1, 3, 6], [2, 2, 6, 6]], [[6, 6, 6, 6], [1, 1, 1, 4]]]  # per step, rank

    model = _TokenModel()

    def body(comm: Any, model: nn.Module) -> dict[str, Tensor]:
        state = fzero.init(model, stage=stage, comm=comm,
                           optimizer=fzero.optim.adamw(lr=0.01, weight_decay=0.1))
        step = fzero.make_train_step(model, _token_mean, rows=_tokens, accum_steps=accum)
        for index in range(2):
            state, _ = step(state, _padded_tokens(4, 6, targets[index][comm.rank],
                                                  seed=10 * index + comm.rank))
        return fzero.full_params(state)

    got = fzero.SimWorld(2).run(body, model)[0]
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    for index in range(2):
        parts = [_padded_tokens(4, 6, targets[index][rank], seed=10 * index + rank)
                 for rank in range(2)]
        whole = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        optimizer.zero_grad()
        _token_mean(reference, whole).backward()
        optimizer.step()
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12)


def test_declared_rows_weigh_micro_batches() -> None:
    """MicroBatches of 1 and 3 images weigh 1/4 and 3/4 by their declared rows (without
    `weights`): the step equals torch on the 4 images at once; `weights` still decide where
    given. Bad declarations raise, naming the micro-batch."""
    model = nn.Linear(3, 2, dtype=torch.float64)
    whole = _images_and_boxes([1, 4, 2, 3], seed=0)
    parts = [{"images": whole["images"][a:b], "boxes": whole["boxes"][a:b]}
             for a, b in ((0, 1), (1, 4))]

    def body(comm: Any) -> dict[str, Tensor]:
        state = fzero.init(model, stage=2, optimizer=fzero.optim.sgd(lr=0.5), comm=comm)
        step = fzero.make_train_step(model, _per_image_loss, rows=_images)
        for bad, match in ((lambda b: 1.0, r"rows\(micro-batch 1/2\) must be an int >= 0"),
                           (lambda b: -1, r"must be an int >= 0.*, got -1"),
                           (lambda b: b["missing"], r"rows\(micro-batch 1/2\) raised KeyError"),
                           (lambda b: len(b["images"]) - 1, r"rows\(micro-batch 1/2\) is 0")):
            with pytest.raises(ValueError, match=match):
                fzero.make_train_step(model, _per_image_loss, rows=bad)(
                    state, fzero.MicroBatches(parts))
        assert fzero.step.micro_weights(fzero.MicroBatches(parts, weights=[1, 1]), parts,
                                        rows=[1, 3]) == (0.5, 0.5)
        assert fzero.step.micro_weights(parts[0], parts[:1], rows=[2]) is None
        state, _ = step(state, fzero.MicroBatches(parts))
        return fzero.full_params(state)

    got = fzero.SimWorld(1).run(body)[0]
    reference = copy.deepcopy(model)
    _per_image_loss(reference, whole).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match="rows must be None or a function"):
        fzero.make_train_step(model, _per_image_loss, rows=4)
    count = fzero.step._count  # a review: numpy's 0-d arrays, meta tensors
    assert [count(n, "n") for n in (3, np.int64(3), np.array(3), torch.tensor([3]))] == [3] * 4
    for bad in (True, 3.0, np.float64(3), torch.tensor(3.0), torch.tensor([1, 2]),
                torch.empty((), dtype=torch.long, device="meta")):
        with pytest.raises(ValueError, match="n must be an int >= 0"):
            count(bad, "n")
    for rows in ([1, -1], [0, 0], [1]):
        with pytest.raises(ValueError, match="rows"):
            fzero.step.micro_weights(parts[0], parts, rows=rows)


def _unclear_rows_body(comm: Any, model: nn.Module, lengths: list[int]) -> dict[str, Tensor]:
    state = fzero.init(model, stage=1, optimizer=fzero.optim.sgd(lr=0.5), comm=comm)
    step = fzero.make_train_step(
        model, lambda call, b: (call(b[0][:, None]).squeeze(1) * b[1].sum()).pow(2).mean())
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(2, generator=g, dtype=torch.float64)
    state, _ = step(state, (x, torch.ones(lengths[comm.rank], dtype=torch.float64)))
    return fzero.full_params(state)


def test_ranks_whose_rows_cannot_be_told_compare_their_tensors_sizes() -> None:
    """Batches of (2,) and (3,) tensors do not say their rows: ranks whose tensors have equal
    sizes along dim 0 train (whatever their rows, they have as many); a rank whose tensors
    differ, or that can tell where another cannot, is refused."""
    model = nn.Linear(1, 1, dtype=torch.float64)
    outs = fzero.SimWorld(2).run(_unclear_rows_body, model, [3, 3])
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
    assert not torch.equal(outs[0]["weight"], model.weight)  # it trained
    for lengths, unclear in (([3, 4], "[0, 1]"), ([3, 2], "[0]")):
        for message in every_rank_raises(2, _unclear_rows_body, model, lengths):
            assert f"the batches of rank(s) {unclear} do not tell their rows" in message


@pytest.mark.parametrize("stage", [0, 3])
def test_batch_that_does_not_split_into_accum_steps(stage: int) -> None:
    batch = MLP.make_batch(0, 10)  # 5 rows per rank, accum_steps=2
    messages = every_rank_raises(2, sb.step_once_body, MLP(), batch, stage=stage, accum=2)
    for message in messages:
        assert "accum_steps=2" in message and "(5, 7)" in message


@pytest.mark.parametrize("stage", STAGES)
def test_loss_must_be_a_float_scalar(stage: int) -> None:
    batch = MLP.make_batch(0, 4)
    for loss_fn, expect in ((sb.per_row_loss, "shape (2,)"), (sb.int_loss, "torch.int64")):
        messages = every_rank_raises(2, sb.step_once_body, MLP(), batch, stage=stage,
                                     loss_fn=loss_fn)
        for message in messages:
            assert "scalar" in message and expect in message


@pytest.mark.parametrize("stage", STAGES)
def test_loss_without_grad_path_names_parameters(stage: int) -> None:
    batch = MLP.make_batch(0, 4)
    for loss_fn in (sb.constant_loss, sb.no_grad_loss):
        messages = every_rank_raises(2, sb.step_once_body, MLP(), batch, stage=stage,
                                     loss_fn=loss_fn)
        for message in messages:
            assert "fc1.weight" in message and "fc2.bias" in message and "gradient" in message


@pytest.mark.parametrize("stage", [1, 3])
def test_state_of_another_model_is_rejected(stage: int) -> None:
    batch = MLP.make_batch(0, 4)
    wider = MLP(d_hidden=14)
    messages = every_rank_raises(2, sb.step_once_body, MLP(), batch, stage=stage, runner=wider)
    for message in messages:
        assert "fc1.weight" in message and "(14, 7)" in message and "fingerprint" in message
    other = FrozenMix()
    messages = every_rank_raises(2, sb.step_once_body, MLP(), batch, stage=stage, runner=other)
    for message in messages:
        assert "fc1.weight" in message and "head.weight" in message and "fingerprint" in message


def test_step_rejects_a_non_state() -> None:
    step = fzero.make_train_step(MLP(), MLP.loss_fn)
    with pytest.raises(TypeError, match="ShardState"):
        step({"params": ()}, MLP.make_batch(0, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accum_steps": 0}, "accum_steps"),
        ({"accum_steps": 2.0}, "accum_steps"),
        ({"accum_steps": True}, "accum_steps"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"clip_norm": -1.0}, "clip_norm"),
        ({"prefetch": 3}, "prefetch"),
    ],
)
def test_make_train_step_validates_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fzero.make_train_step(MLP(), MLP.loss_fn, **kwargs)


def test_make_train_step_needs_a_module() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        fzero.make_train_step(MLP().forward, MLP.loss_fn)  # type: ignore[arg-type]


def test_failing_step_surfaces_as_simworld_error() -> None:
    """Through SimWorld (no catching in the body): SimWorldError with the ValueError as cause."""
    with pytest.raises(SimWorldError) as info:
        run(2, sb.step_once_body, MLP(), MLP.make_batch(0, 4), stage=2, loss_fn=sb.per_row_loss)
    assert isinstance(info.value.__cause__, ValueError)
    assert "scalar" in str(info.value.__cause__)


def test_split_batch_rank_slices_cover_the_batch() -> None:
    """The tests' rank split (models.split_batch) partitions the global batch in rank order."""
    batch = TinyGPT.make_batch(0, GLOBAL_BATCH)
    for world in WORLD_SIZES:
        parts = [split_batch(batch, r, world) for r in range(world)]
        for i, tensor in enumerate(batch):
            assert torch.equal(torch.cat([p[i] for p in parts]), tensor)


def test_the_loss_and_the_norm_reach_the_host_in_one_copy_with_every_bit() -> None:
    """`_on_host` stacks what is there into one tensor (a GPU waits once, not once per value)
    and returns exactly what a float() of each would, with 0.0 for what is absent."""
    from fzero.step import _on_host

    loss = torch.tensor(1 / 3, dtype=torch.float64)
    norm = torch.tensor(2.0**-60 + 1e-300, dtype=torch.float64)
    assert _on_host(loss, norm) == [float(loss), float(norm)]
    assert _on_host(None, norm) == [0.0, float(norm)]
    assert _on_host(loss, None) == [float(loss), 0.0]
    assert _on_host(None, None) == [0.0, 0.0]
    copies = []
    real_tolist = torch.Tensor.tolist

    def counted(self):  # noqa: ANN001, ANN202
        copies.append(self.shape)
        return real_tolist(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counted)
        _on_host(loss, norm)
    assert copies == [torch.Size([2])]


# ----------------------------------------------------------------------------------------------
# A step frees what it built by reference counting: a reference cycle per step would leave its
# hooks, leaves and threads to the garbage collector, whose pauses then land in later steps.


def _cycles_reaching(layout: ShardLayout) -> list[str]:
    """Collect garbage, and name what only the collector could free that holds `layout` (this
    test's: garbage other tests' threads or tracebacks release meanwhile is not counted)."""
    import gc

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sorted({type(o).__qualname__ for o in gc.garbage
                       if any(r is layout for r in gc.get_referents(o))})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _cycles_after_a_step(comm: Any, *, stage: int) -> tuple[list[str], list[str]]:
    import gc

    model = TinyGPT()
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm)
    step = fzero.make_train_step(model, gb.gpt_loss)
    evaluate = fzero.make_eval_step(model, lambda call, batch: call(batch[0]).sum())
    batch = TinyGPT.make_batch(0, 2)
    state, _ = step(state, batch)  # first-step work (plans, caches) out of the way
    evaluate(state, batch)
    gc.collect()
    gc.disable()
    try:
        state, _ = step(state, batch)
        in_step = _cycles_reaching(state.layout)
        evaluate(state, batch)
        in_eval = _cycles_reaching(state.layout)
    finally:
        gc.enable()
    return in_step, in_eval


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_leaves_no_reference_cycle(stage: int) -> None:
    assert fzero.SimWorld(1).run(_cycles_after_a_step, stage=stage) == [([], [])]


# ----------------------------------------------------------------------------------------------
# A forward that writes a parameter in place (nn.Embedding(max_norm=...)) changes each rank's
# own copy only: stage 3 dropped the change with the gathered bucket, stages 1-2 kept only the
# owner's rows. Every stage raises instead, before any update.


class _MaxNormEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=0.5)  # renormalizes looked-up rows in place
        self.head = nn.Linear(4, 1)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.emb(tokens)).squeeze(-1)


def _in_place_outcome(comm: Any, *, stage: int, accum_steps: int) -> Any:
    torch.manual_seed(0)
    model = _MaxNormEmbedding()
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    before = {n: t.clone() for n, t in fzero.full_params(state).items()}
    step = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean(),
                                 accum_steps=accum_steps)
    try:
        step(state, (torch.arange(4) + 4 * comm.rank) % 10)
    except Exception as exc:  # reported to the test, per rank
        after = fzero.full_params(state)  # the state was not consumed, nor changed
        unchanged = all(torch.equal(after[n], v) for n, v in before.items())
        return type(exc).__name__, str(exc), unchanged
    return None


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_a_parameter_written_in_place_by_forward_raises(stage: int, accum_steps: int) -> None:
    for kind, message, unchanged in fzero.SimWorld(2).run(
            _in_place_outcome, stage=stage, accum_steps=accum_steps):
        assert kind == "ValueError"
        assert "the forward modified parameter(s) ['emb.weight'] in place" in message
        # Stage 3 wrote into a gathered copy; below, the forward wrote into the state itself,
        # and the error says so.
        assert unchanged == (stage == 3)
        assert ("This rank's state already holds the change" in message) == (stage < 3)


def _eval_in_place(comm: Any, *, stage: int, model: nn.Module, tokens: Tensor) -> Any:
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    evaluate = fzero.make_eval_step(model, lambda call, b: call(b))
    before = fzero.full_params(state)["emb.weight"]
    try:
        out = evaluate(state, tokens)
    except ValueError as exc:
        return str(exc), torch.equal(fzero.full_params(state)["emb.weight"], before)
    return out, fzero.full_params(state)["emb.weight"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_written_in_place_by_an_eval_forward(stage: int) -> None:
    """torch's module keeps what an eval forward writes in place (nn.Embedding(max_norm=...)
    renormalizes the rows it looks up). Below stage 3 the forward reads the state's own
    tensors, so the state keeps it too, exactly as torch's; stage 3 wrote into the gathered
    copy and released it with the write, silently (a probe: the rows stayed 3.3 off torch's,
    and training went on from them). Stage 3 now raises, the state unchanged."""
    torch.manual_seed(0)
    model = _MaxNormEmbedding()
    with torch.no_grad():
        model.emb.weight.mul_(4)  # every row above max_norm: a lookup renormalizes it
    tokens = torch.tensor([1, 2, 3, 1])
    reference = copy.deepcopy(model)
    with torch.no_grad():
        want = reference(tokens)
    got, weight = fzero.SimWorld(1).run(_eval_in_place, stage=stage, model=model,
                                        tokens=tokens)[0]
    if stage == 3:
        assert "the forward modified parameter(s) ['emb.weight'] in place" in got
        assert weight is True  # unchanged
        return
    assert torch.equal(got, want)
    assert torch.equal(weight, reference.emb.weight)
    assert not torch.equal(weight, model.emb.weight)  # the rows did change


class _ClampsThroughData(nn.Module):
    """Clips its first weight through ``.data`` in forward (WGAN style), which bumps no version
    counter; from the second forward on with ``later=True``."""

    def __init__(self, later: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 2)
        self.later, self.calls = later, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if not self.later or self.calls > 1:
            self.a.weight.data.clamp_(-0.05, 0.05)
        return self.b(torch.tanh(self.a(x)))


def _clamped_outcome(comm: Any, *, stage: int, param_dtype: torch.dtype | None,
                     later: bool) -> dict[str, Any]:
    """Two SGD steps at lr 0 (the weights move only by the clamp); each step's error, whether
    the master copy stayed as it was, and the master weight after."""
    model = _ClampsThroughData(later)
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.0), comm=comm,
                       param_dtype=param_dtype)
    step = fzero.make_train_step(model, lambda call, x: call(x).float().pow(2).mean())
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(comm.rank))
    errors = []
    for call in range(2):
        before = fzero.full_params(state, master=True)
        try:
            state, _ = step(state, x.to(param_dtype or torch.float32))
        except ValueError as error:
            after = fzero.full_params(state, master=True)
            errors.append((call, str(error),
                           all(torch.equal(after[n], v) for n, v in before.items())))
    return {"errors": errors, "weight": fzero.full_params(state, master=True)["a.weight"]}


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("later", [False, True])
def test_a_write_through_data_is_kept_or_raises_when_a_master_copy_would_drop_it(
        stage: int, later: bool) -> None:
    """Stages 0-2 train the state's own memory, so a forward's write through ``.data`` lands
    in it, as in torch: with float32 parameters the clamp holds. With a master copy apart from
    the parameters (bfloat16 parameters, float32 master), the update recomputed the
    parameters from the master copy and the clamp was dropped, silently (the weight kept
    its 0.35). Every rank raises instead, naming the bucket, before the update: the master
    copy is unchanged (the parameters hold the write, and the error says so). Also on the
    very first step (``later=False``), which used to go unchecked (`init` casts both from the
    module's values, which need not make the parameters their master's cast: the state
    records where they differ, `ShardState.uncast`). A retry of that step after its error
    raises again (the write it left is not mistaken for init's)."""
    for out in fzero.SimWorld(2).run(_clamped_outcome, stage=stage, param_dtype=None,
                                     later=later):
        assert out["errors"] == []
        assert float(out["weight"].abs().max()) == pytest.approx(0.05)
    for out in fzero.SimWorld(2).run(_clamped_outcome, stage=stage,
                                     param_dtype=torch.bfloat16, later=later):
        assert [call for call, _, _ in out["errors"]] == ([1] if later else [0, 1]), (
            out["errors"])
        for _, message, unchanged in out["errors"]:
            assert "parameters of buckets ['a..b'] were written during the step" in message
            assert "master copy" in message and "rebuild the state" in message
            assert unchanged
        assert float(out["weight"].abs().max()) > 0.3  # never clamped, never updated


def _fp16_one_step(comm: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                   stage: int) -> tuple[float, dict[str, torch.Tensor]]:
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1),
                       param_dtype=torch.float16)
    assert state.loss_scale is not None
    # 1024: these gradients times the default 65536 overflow fp16 (that step would be skipped)
    state = dataclasses.replace(state, loss_scale=fzero.LossScale(scale=1024.0))
    step = fzero.make_train_step(
        model, lambda call, b: torch.nn.functional.mse_loss(call(b[0].half()).float(), b[1]))
    rows = x.shape[0] // comm.world_size
    mine = slice(comm.rank * rows, (comm.rank + 1) * rows)
    state, metrics = step(state, (x[mine], y[mine]))
    return metrics["grad_norm"], fzero.full_params(state, master=True)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_gradients_are_unscaled_before_the_norm_and_the_update(stage: int) -> None:
    """fp16 compute multiplies the loss by the scale (65536): the gradients must be divided
    by it again before the norm, clipping and the update. Without the division a step
    reported a norm the scale times torch's and moved the weights by as much, and no test saw it
    (a mutation probe): the one fp16 test looked at skipped steps only. Against fp32 torch,
    within fp16's rounding."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    want = copy.deepcopy(model)
    torch.nn.functional.mse_loss(want(x), y).backward()
    want_norm = float(torch.nn.utils.get_total_norm([p.grad for p in want.parameters()]))
    torch.optim.SGD(want.parameters(), lr=0.1).step()
    for norm, params in run(2, _fp16_one_step, model, x, y, stage):
        assert norm == pytest.approx(want_norm, rel=1e-2)
        for name, value in want.named_parameters():
            torch.testing.assert_close(params[name].float(), value.detach(), rtol=0, atol=2e-3)


def _input_gradient_penalty(call: Callable[..., Tensor], batch: Any) -> Tensor:
    """MSE plus an R1-style penalty: the squared gradient of the output with respect to the
    input, taken inside the loss with ``create_graph=True`` (GAN critics, WGAN-GP)."""
    x, y = batch
    x = x.clone().requires_grad_()
    out = call(x)
    (dx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return torch.nn.functional.mse_loss(out, y) + 0.5 * dx.pow(2).sum(1).mean()


def _penalty_steps(comm: Any, model: nn.Module, batches: Sequence[Any], stage: int) -> Any:
    state = fzero.init(model, stage=stage, comm=comm, buckets=nn.Linear,
                       optimizer=fzero.optim.sgd(lr=0.1, momentum=0.9))
    step = fzero.make_train_step(model, _input_gradient_penalty)
    losses = []
    for batch in batches:
        state, metrics = step(state, split_batch(batch, comm.rank, comm.world_size))
        losses.append(metrics["loss"])
    return losses, fzero.full_params(state)


@pytest.mark.parametrize("stage", STAGES)
def test_a_gradient_penalty_inside_the_loss_trains_as_torch(stage: int) -> None:
    """A loss that differentiates the model's output with respect to its input inside forward
    (``autograd.grad(..., create_graph=True)``, as a GAN critic's R1 / gradient penalty) runs a
    first backward through every module before the step's own: stage 3's gathers and stage 2's
    reductions must neither fire early nor miss the penalty's second-order terms. float64,
    against torch.optim.SGD on the global batch, over 1-3 ranks (probed: exact to 3e-17)."""
    model = MLP(seed=3).double()
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(6, 7, generator=gen, dtype=torch.float64),
                torch.randn(6, 5, generator=gen, dtype=torch.float64)) for _ in range(3)]
    want = reference_train(model, _input_gradient_penalty, batches,
                           lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), steps=3)
    for n in (1, 2, 3):
        for losses, params in fzero.SimWorld(n).run(_penalty_steps, model, batches, stage):
            assert losses == pytest.approx(want.losses, rel=1e-13)
            for name, value in want.params.items():
                torch.testing.assert_close(params[name], value, rtol=1e-13, atol=1e-15)


class _CheckpointedInner(nn.Module):
    """A block whose forward is a non-reentrant checkpoint of a method reading its own
    parameter elementwise (no module hook of its own runs in the recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.g = nn.Parameter(torch.full((5,), 1.1))

    def body(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x) * self.g)

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


class _PenaltyPaths(nn.Module):
    """What a gradient penalty's inner backward runs besides plain autograd nodes:
    ``"inner"``, a checkpointed block (`_CheckpointedInner`); ``"lambda"``, a checkpoint of a
    lambda over two children, from the root; ``"hook"``, a tensor hook reading a parameter
    elementwise."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.kind = kind
        self.a, self.b = nn.Linear(5, 5), (_CheckpointedInner() if kind == "inner"
                                           else nn.Linear(5, 5))
        self.c = nn.Linear(5, 3)
        self.double()
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.5)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "lambda":
            return self.c(torch.utils.checkpoint.checkpoint(
                lambda t: torch.tanh(self.b(torch.tanh(self.a(t)))), x, use_reentrant=False))
        h = torch.tanh(self.a(x))
        if self.kind == "hook" and h.requires_grad:
            h.register_hook(lambda g: g * (1 + 0.1 * self.a.bias))
        return self.c(torch.tanh(self.b(h)))


def _input_gradient_penalty_by(form: str) -> Callable[[Callable[..., Tensor], Any], Tensor]:
    """`_input_gradient_penalty` with its ``autograd.grad`` called in another form: ``"plain"``,
    ``"batched"`` (``is_grads_batched``, a batch of one cotangent) or ``"edge"`` (the input
    given as its ``GradientEdge``)."""
    if form == "plain":
        return _input_gradient_penalty

    def loss_fn(call: Callable[..., Tensor], batch: Any) -> Tensor:
        x, y = batch
        x = x.clone().requires_grad_()
        out = call(x)
        if form == "batched":
            (dx,) = torch.autograd.grad(out.sum(), x, grad_outputs=torch.ones(1, dtype=x.dtype),
                                        create_graph=True, is_grads_batched=True)
            dx = dx[0]
        else:
            (dx,) = torch.autograd.grad(out.sum(), torch.autograd.graph.get_gradient_edge(x),
                                        create_graph=True)
        return torch.nn.functional.mse_loss(out, y) + 0.5 * dx.pow(2).sum(1).mean()

    return loss_fn


def _penalty_paths_steps(comm: Any, model: nn.Module, batches: Sequence[Any],
                         prefetch: int, form: str) -> Any:
    state = fzero.init(model, stage=3, comm=comm, buckets=1,  # one bucket per parameter
                       optimizer=fzero.optim.sgd(lr=0.1, momentum=0.9))
    step = fzero.make_train_step(model, _input_gradient_penalty_by(form), prefetch=prefetch)
    losses = []
    for batch in batches:
        state, metrics = step(state, split_batch(batch, comm.rank, comm.world_size))
        losses.append(metrics["loss"])
    return losses, fzero.full_params(state)


@pytest.mark.parametrize("kind", ["inner", "lambda", "hook"])
def test_a_gradient_penalty_through_recomputation_and_hooks_at_stage_3(kind: str) -> None:
    """The penalty's ``autograd.grad`` is a torch function: torch ran stage 3's gathering
    guard's handler with the guard switched off, so the inner backward's recomputation and
    tensor hooks read released buckets unguarded: the process crashed (segmentation fault) or
    raised blaming a ``.detach()`` alias (a probe). It now runs with the guard on, its
    recomputation pinning what it gathers: equal to torch, float64, 1-2 ranks, prefetch 0-1;
    so do batched gradients and gradient edges (which still ran unguarded, and crashed alike),
    at 2 ranks."""
    model = _PenaltyPaths(kind)
    gen = torch.Generator().manual_seed(8)
    batches = [(torch.randn(6, 5, generator=gen, dtype=torch.float64),
                torch.randn(6, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    want = reference_train(model, _input_gradient_penalty, batches,
                           lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), steps=2)
    runs = [(n, prefetch, "plain") for n in (1, 2) for prefetch in (0, 1)]
    runs += [(2, 0, "batched"), (2, 1, "edge")]
    for n, prefetch, form in runs:
        for losses, params in fzero.SimWorld(n).run(_penalty_paths_steps, model, batches,
                                                     prefetch, form):
            assert losses == pytest.approx(want.losses, rel=1e-12)
            for name, value in want.params.items():
                torch.testing.assert_close(params[name], value, rtol=1e-12, atol=1e-14)


def exact(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _eval_returns_parameters(comm: Any, model: nn.Module, batch: Any, stage: int) -> Any:
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.5))
    before = fzero.full_params(state)
    weight = fzero.make_eval_step(model, lambda call, x: model.fc1.weight)(state, None)
    out, view = fzero.make_eval_step(
        model, lambda call, x: (call(x), model.fc1.weight.T))(state, batch[0])
    values = weight.clone(), view.clone()
    step = fzero.make_train_step(model, MLP.loss_fn)
    state, _ = step(state, split_batch(batch, comm.rank, comm.world_size))
    return before["fc1.weight"], values, (weight.sum().item(), view.sum().item()), out


@pytest.mark.parametrize("stage", STAGES)
def test_an_eval_step_may_return_a_parameter(stage: int) -> None:
    """An eval function returning a parameter (or a view of one) got at stage 3 a tensor whose
    memory the step released as it returned: reading it crashed the process (a probe). Stage 3
    returns a copy now; below it, the tensor is a view of the state, as torch returns the live
    weight. Either way the values are the parameter's, readable after later steps."""
    model = MLP(seed=1)
    batch = MLP.make_batch(0, 6)
    for want, (weight, view), _, out in run(2, _eval_returns_parameters, model, batch, stage):
        exact(weight, want)
        exact(view, want.T)
        assert out.shape == (6, 5) and not weight.requires_grad


def _steps_around_inference_mode(comm: Any, model: nn.Module, batch: Any, stage: int,
                                 inference: bool) -> Any:
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.5))
    step = fzero.make_train_step(model, MLP.loss_fn)
    evaluate = fzero.make_eval_step(model, lambda call, x: call(x))
    mine = split_batch(batch, comm.rank, comm.world_size)
    refused = []
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            try:
                step(state, mine)
            except (ValueError, fzero.StepError) as exc:
                refused.append(str(exc))
    with torch.inference_mode() if inference else contextlib.nullcontext():
        out = evaluate(state, batch[0])
    state, metrics = step(state, mine)
    return refused, out.clone(), fzero.full_params(state), metrics["loss"]


@pytest.mark.parametrize("stage", STAGES)
def test_inference_mode_and_no_grad_around_steps(stage: int) -> None:
    """A train step under torch.no_grad or torch.inference_mode raises before anything moves,
    saying gradients are off (it said "no gradient path", and under inference mode it left
    cached tensors behind that broke every later step); an eval step under inference mode
    works at every stage (stage 3 raised a collective error) and training goes on exactly."""
    model = MLP(seed=2)
    batch = MLP.make_batch(1, 6)
    plain = run(2, _steps_around_inference_mode, model, batch, stage, False)
    under = run(2, _steps_around_inference_mode, model, batch, stage, True)
    for (refused, out, params, loss), (_, out_i, params_i, loss_i) in zip(plain, under,
                                                                          strict=True):
        assert len(refused) == 2
        assert all("called with gradients off" in message for message in refused), refused
        exact(out_i, out)
        assert loss_i == loss
        for name, value in params.items():
            exact(params_i[name], value)


class _WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + self.empty.sum()


def _empty_bucket_steps(comm: Any, model: nn.Module, x: Tensor, stage: int) -> Any:
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1),
                       buckets=[["lin.weight", "lin.bias"], ["empty"]])
    step = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean())
    for _ in range(2):
        state, _ = step(state, split_batch((x,), comm.rank, comm.world_size)[0])
    return fzero.full_params(state)


@pytest.mark.parametrize("stage", STAGES)
def test_a_bucket_of_an_empty_parameter_trains(stage: int) -> None:
    """A bucket holding only a zero-size parameter: stage 3 raised ZeroDivisionError (its
    reduction's rate per element; a probe), and gloo could not split its 0-element chunks."""
    torch.manual_seed(0)
    model = _WithEmpty()
    x = torch.randn(4, 3)
    want = copy.deepcopy(model)
    opt = torch.optim.SGD(want.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        want(x).pow(2).mean().backward()
        opt.step()
    for params in run(2, _empty_bucket_steps, model, x, stage):
        for name, value in want.named_parameters():
            torch.testing.assert_close(params[name], value.detach(), rtol=1e-6, atol=1e-7)



def _waiter_threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.name.startswith("fzero-reduce-wait")}


def _stage_3_steps_on_one_waiter(comm: Any, model: nn.Module) -> list[set[int]]:
    state = fzero.init(model, stage=3, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    step = fzero.make_train_step(model, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    batch = split_batch((torch.ones(4, 3), torch.zeros(4, 2)), comm.rank, comm.world_size)
    seen = []
    for _ in range(3):
        state, _metrics = step(state, batch)
        seen.append(_waiter_threads())
    return seen


def test_stage_3_steps_wait_for_reductions_on_one_thread() -> None:
    """Stage 3 waits for its reductions on a helper thread (the reducer's patience). A new one
    started and joined every step cost 0.5 ms of host time; the train step now keeps one for
    all its steps, and it ends with the step function."""
    before = _waiter_threads()
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    seen = fzero.SimWorld(1).run(_stage_3_steps_on_one_waiter, model)[0]
    ours = seen[0] - before
    assert len(ours) == 1  # the step's thread
    assert seen[1] - before == seen[2] - before == ours  # the same one every step
    gc.collect()
    deadline = time.monotonic() + 10
    while ours & _waiter_threads() and time.monotonic() < deadline:
        time.sleep(0.01)  # (it exits once it sees its executor collected)
    assert not ours & _waiter_threads()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_a_waiting_thread_of_its_own() -> None:
    """The kept waiting thread does not cross a fork (the child inherits the executor, not its
    thread): a child that steps on would queue its waits for ever. `waiter()` starts one of the
    child's own."""
    leaves = object.__new__(fzero.step._ShardedLeaves)  # (only its waiter: no state needed)
    leaves._waiter, leaves._waiter_pid = None, 0
    assert leaves.waiter().submit(lambda: 7).result(timeout=10) == 7
    parents = leaves.waiter()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if a wait runs on a new executor
        ok = False
        try:
            ok = leaves.waiter() is not parents and (
                leaves.waiter().submit(lambda: 7).result(timeout=10) == 7)
        finally:
            os._exit(0 if ok else 1)  # (never returns into pytest in the child)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert leaves.waiter() is parents
    parents.shutdown(wait=True)


class _Pair:
    """A batch type registered with torch's pytree without key paths."""

    def __init__(self, ids: Tensor, positions: Tensor) -> None:
        self.ids, self.positions = ids, positions


def test_a_batch_type_registered_without_key_paths_has_rows() -> None:
    """A pytree node type registered without ``flatten_with_keys_fn`` made the step raise
    torch's "Did not find a flatten_with_keys_fn" once rows compared tensors' places (a
    review): its leaves are placed by index."""
    import torch.utils._pytree as pytree

    if _Pair not in pytree.SUPPORTED_NODES:
        pytree.register_pytree_node(_Pair, lambda p: ([p.ids, p.positions], None),
                                    lambda leaves, _: _Pair(*leaves))
    ids, pos = torch.zeros(4, 8), torch.zeros(1, 8)
    assert fzero.step._micro_rows(_Pair(ids, ids)) == 4
    assert fzero.step._dim0_signature(_Pair(ids, pos)) == [("<0>", 4), ("<1>", 1)]
    assert fzero.step._shape_digest([_Pair(ids, pos)]) != fzero.step._shape_digest(
        [_Pair(ids[:2], pos)])
