"""examples/explicit_step.py: a ZeRO-3 step written by hand from fzero's public pieces (`plan`,
`shard`, `collectives`, `functional_call`, autograd, `fzero.optim`) equals `make_train_step` at
stage 3 bitwise: same losses, same parameter shards, in float64, on SimWorld and gloo ranks."""

from __future__ import annotations

from typing import Any

import explicit_step
import pytest
import torch
from train_gpt import GPT, GPTConfig, loss_fn

import fzero

from models import FrozenMix

STEPS = 3
GLOBAL_BATCH = 8


def gpt_case() -> tuple[Any, ...]:
    """The example GPT (tied embeddings, LayerNorms), tiny, in float64, and its batches."""
    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32), seed=0).double()
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, 17), generator=torch.Generator().manual_seed(0))
    return model, loss_fn, [(tokens[:, :-1], tokens[:, 1:])] * STEPS  # one batch, learnt


def frozen_case() -> tuple[Any, ...]:
    """Frozen parameters between trainable ones, and buffers."""
    model = FrozenMix(seed=0).double()
    batches = [tuple(t.double() for t in FrozenMix.make_batch(s, GLOBAL_BATCH))
               for s in range(STEPS)]
    return model, FrozenMix.loss_fn, batches


def assert_bitwise(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["by_hand"] == result["make_train_step"], f"rank {rank}"
        assert result["same_shards"], f"rank {rank}: parameter shards differ"
    assert all(r["by_hand"] == results[0]["by_hand"] for r in results), "ranks disagree"


@pytest.mark.parametrize("case", [gpt_case, frozen_case], ids=["gpt", "frozen-mix"])
def test_explicit_step_equals_make_train_step_on_simworld(case) -> None:
    model, loss, batches = case()
    results = fzero.SimWorld(4).run(explicit_step.compare, model, loss, batches)
    assert_bitwise(results)
    assert results[0]["by_hand"][-1] < results[0]["by_hand"][0]  # it trains


def test_explicit_step_equals_make_train_step_on_gloo(gloo_pool: Any) -> None:
    model, loss, batches = gpt_case()
    assert_bitwise(gloo_pool(2).run(explicit_step.compare, model, loss, batches))


def test_a_global_batch_that_does_not_split_over_the_ranks_raises() -> None:
    """At 3 ranks each took 8 // 3 rows and the last 2 were dropped, and the comparison still
    said equal (a probe)."""
    model, loss, batches = gpt_case()
    with pytest.raises(fzero.SimWorldError, match="8 rows does not split over 3 ranks"):
        fzero.SimWorld(3).run(explicit_step.compare, model, loss, batches[:1])
