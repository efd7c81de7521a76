"""Defaults that lose no information: a float64 model keeps a float64 master copy, a float16
model gets loss scaling however it got there, weight decay applies to every parameter (as
``torch.optim.AdamW(model.parameters())`` and optax), and a batch is only ever split along
dim 0 (explicit micro-batches are `fzero.MicroBatches`)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

import fzero

import guarantee_bodies as gb

STAGES = (0, 1, 2, 3)
STEPS = 3


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@functools.cache
def mlp_reference(optimizer=gb.torch_adamw) -> gb.Reference:
    return gb.reference(gb.MLP64(), gb.mse_loss, gb.mse_batches(STEPS), optimizer)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_float64_model_gets_a_float64_master_and_torch_defaults(stage: int, world: int) -> None:
    """No master_dtype, no decay rule: float64 master, every parameter decayed, 1e-12."""
    out = fzero.SimWorld(world).run(gb.train, gb.MLP64(), gb.mse_loss, gb.mse_batches(STEPS),
                                    stage=stage)
    assert out[0]["master_dtype"] == torch.float64
    gb.assert_parity(out[0], mlp_reference())


def test_a_float32_master_would_be_visible() -> None:
    """The old default (float32 master for a float64 model) misses the 1e-12 bound by far."""
    out = fzero.SimWorld(2).run(gb.train, gb.MLP64(), gb.mse_loss, gb.mse_batches(STEPS),
                                stage=1, init_kwargs={"master_dtype": torch.float32})[0]
    assert gb.max_difference(out["params"], mlp_reference().params) > 1e-9


def test_param_dtype_float64_of_a_float32_model_gets_a_float64_master() -> None:
    """``param_dtype=torch.float64`` acts as ``model.double()`` would: the master copy is at
    least as wide as the parameters (it was float32, 1e-7 off float64 torch)."""
    model = gb.MLP64(dtype=torch.float32)
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, gb.mse_batches(STEPS), stage=1,
                                init_kwargs={"param_dtype": torch.float64})[0]
    assert out["master_dtype"] == torch.float64
    gb.assert_parity(out, gb.reference(model.double(), gb.mse_loss, gb.mse_batches(STEPS),
                                       gb.torch_adamw))


@pytest.mark.parametrize("opt", [("adamw", {**gb.ADAMW, "eps": 1e-4}), ("sgd", {"lr": 0.1})],
                         ids=["adamw_eps_1e-4", "sgd"])
def test_a_float16_master_trains_with_an_eps_it_can_hold(opt) -> None:
    """``master_dtype=torch.float16`` with Adam's default eps=1e-8 raises at init (0 in float16:
    the bad-input table); an eps float16 holds, or SGD's update without one, trains finite."""
    out = fzero.SimWorld(2).run(gb.train, gb.MLP64(dtype=torch.float32), gb.mse_loss,
                                gb.mse_batches(STEPS, dtype=torch.float32), stage=1, opt=opt,
                                init_kwargs={"master_dtype": torch.float16})[0]
    assert out["master_dtype"] == torch.float16 and out["step"] == STEPS
    assert all(torch.isfinite(p).all() for p in out["params"].values())


@pytest.mark.parametrize("stage", STAGES)
def test_decay_matrices_is_torchs_two_param_groups(stage: int) -> None:
    want = mlp_reference(gb.torch_adamw_two_groups)
    out = fzero.SimWorld(3).run(gb.train, gb.MLP64(), gb.mse_loss, gb.mse_batches(STEPS),
                                stage=stage, step_kwargs={"decay": fzero.decay_matrices})
    gb.assert_parity(out[0], want)
    # The rules differ on the 1-d parameters, so the test tells them apart.
    other = mlp_reference().params["norm.weight"]
    assert float((want.params["norm.weight"] - other).abs().max()) > 1e-6


@pytest.mark.parametrize(
    ("convert", "master", "scaled"),
    [(torch.nn.Module.half, torch.float32, True), (torch.nn.Module.bfloat16, torch.float32, False),
     (torch.nn.Module.float, torch.float32, False), (torch.nn.Module.double, torch.float64, False)],
    ids=["float16", "bfloat16", "float32", "float64"],
)
def test_master_dtype_and_loss_scale_follow_the_model(convert, master, scaled) -> None:
    model = convert(gb.MLP64())
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, [], stage=2)[0]
    assert out["master_dtype"] == master
    assert (out["loss_scale"] == fzero.LossScale()) if scaled else out["loss_scale"] is None


def test_float16_model_trains_with_its_loss_scale() -> None:
    """model.half() without param_dtype: the step scales the loss; here 2**16 overflows the
    first step's float16 gradients, which is skipped and the scale halved (GradScaler's rule),
    and the next steps apply."""
    model = gb.MLP64().half()
    data = gb.mse_batches(3, dtype=torch.float16)
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, data, stage=3)[0]
    metrics = out["metrics"]
    assert [m["skipped"] for m in metrics] == [True, False, False]
    assert [m["loss_scale"] for m in metrics] == [2.0**15] * 3
    assert out["step"] == 2


@pytest.mark.parametrize("stage", STAGES)
def test_list_batch_with_accumulation_is_split_along_dim_0(stage: int) -> None:
    """``[x, y]`` with ``accum_steps=2`` is two halves of x with the matching halves of y (never
    x and y as two micro-batches), so it equals one big batch."""
    data = [list(batch) for batch in gb.mse_batches(STEPS, rows=8)]
    want = gb.reference(gb.MLP64(), gb.mse_loss, data)
    out = fzero.SimWorld(2).run(gb.train, gb.MLP64(), gb.mse_loss, data, stage=stage,
                                step_kwargs={"accum_steps": 2})
    gb.assert_parity(out[0], want)


@pytest.mark.parametrize("stage", STAGES)
def test_explicit_micro_batches(stage: int) -> None:
    data = gb.mse_batches(STEPS)
    out = fzero.SimWorld(2).run(gb.micro_batches_body, gb.MLP64(), data, stage=stage, parts=3)
    gb.assert_parity(out[0], mlp_reference())


def _weighted_micro_batches(comm: Any, model: nn.Module, batches: Any, *, stage: int,
                            as_tensors: bool) -> dict[str, Any]:
    """Each rank's 6 rows as micro-batches of 4 and 2 rows, weighted by their rows."""
    local = []
    for batch in batches:
        x, y = gb.rank_rows(batch, comm.rank, comm.world_size)
        weights = [torch.tensor(4), torch.tensor(2.0)] if as_tensors else [4, 2]
        local.append(fzero.MicroBatches([(x[:4], y[:4]), (x[4:], y[4:])], weights=weights))
    return gb.train(comm, model, gb.mse_loss, local, stage=stage)


@pytest.mark.parametrize("stage", STAGES)
def test_micro_batches_of_different_sizes_weighted_by_their_rows(stage: int) -> None:
    """MicroBatches of 4 and 2 rows with ``weights=[4, 2]`` equal the whole batch (float64),
    loss metric included; plain Python numbers or one-element tensors. Without weights they
    were averaged with equal weights, silently another objective (a probe): that raises now
    (`test_bad_inputs`)."""
    want = mlp_reference()
    for as_tensors in (False, True):
        out = fzero.SimWorld(2).run(_weighted_micro_batches, gb.MLP64(), gb.mse_batches(STEPS),
                                    stage=stage, as_tensors=as_tensors)
        gb.assert_parity(out[0], want)


def test_micro_weights_are_shares_of_the_loss() -> None:
    """`micro_weights`: None for a split batch or equal MicroBatches, normalized shares for
    given weights, an error naming the sizes for unequal ones without weights (the size of a
    micro-batch is its most common dim 0, so a (1, T) position tensor does not decide)."""
    x, pos = torch.zeros(6, 2), torch.zeros(1, 5)
    split = fzero.step.split_batch(x, 2)
    assert fzero.step.micro_weights(x, split) is None
    equal = fzero.MicroBatches([(x[:3], x[:3], pos), (x[3:], x[3:], pos)])
    assert fzero.step.micro_weights(equal, list(equal)) is None
    weighted = fzero.MicroBatches([x[:4], x[4:]], weights=(3, 1))
    assert fzero.step.micro_weights(weighted, list(weighted)) == (0.75, 0.25)
    unequal = fzero.MicroBatches([(x[:4], x[:4], pos), (x[4:], x[4:], pos)])
    with pytest.raises(ValueError, match=r"different sizes along dim 0 \(\[4, 2\]\)"):
        fzero.step.micro_weights(unequal, list(unequal))
    unclear = fzero.MicroBatches([(x[:4], pos), (x[4:], pos)])  # 4 or 1? 2 or 1?
    with pytest.raises(ValueError, match=r"size of micro-batch 1 cannot be told"):
        fzero.step.micro_weights(unclear, list(unclear))
    for bad in ([1, float("nan")], [1, -1], [1, "2"], [1, torch.ones(2)], [1, 2, 3]):
        given = fzero.MicroBatches([x[:4], x[4:]], weights=bad)
        with pytest.raises(ValueError, match="one positive finite number per micro-batch"):
            fzero.step.micro_weights(given, list(given))


def test_micro_batches_validation() -> None:
    with pytest.raises(ValueError, match="holds no micro-batch"):
        fzero.step.split_batch(fzero.MicroBatches([]), 1)
    x = torch.zeros(6, 2)
    assert len(fzero.step.split_batch(fzero.MicroBatches([x, x, x]), 1)) == 3
    assert len(fzero.step.split_batch(fzero.MicroBatches([x, x, x]), 3)) == 3
    with pytest.raises(ValueError, match="MicroBatches of 3 micro-batches, but the step was "
                                         "built with accum_steps=2"):
        fzero.step.split_batch(fzero.MicroBatches([x, x, x]), 2)
    assert [t.shape[0] for t in fzero.step.split_batch([x, x], 2)[0]] == [3, 3]
