"""Tied parameters: every alias is bound to the state's one tensor, so a module whose ties were
lost on the ``meta`` device (``model.to("meta")`` after `fzero.init`, to drop its memory) trains
exactly; a module whose ties changed while materialized raises, naming the parameters."""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any

import pytest
import torch

import fzero

import guarantee_bodies as gb
from models import FrozenMix, TinyGPT

STAGES = (0, 1, 2, 3)
STEPS = 3


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_to_meta_unties() -> None:
    """The premise: torch's ``to("meta")`` gives each module its own parameter."""
    model = TinyGPT().to("meta")
    assert model.lm_head.weight is not model.tok_emb.weight
    assert model.lm_head.weight.is_meta


@pytest.mark.parametrize("world", [1, 3])
def test_a_meta_state_dict_is_planned_with_its_ties(world: int) -> None:
    """A tied model built on meta: its ``state_dict()`` gives each name of the tie a tensor of
    its own, over one storage, and no address to compare; it was planned untied (the tie's
    elements twice, another fingerprint than the same model's on CPU), silently (a probe).
    Separate meta tensors of one shape stay apart."""
    with torch.device("meta"):
        meta = TinyGPT()
    real = TinyGPT()
    assert meta.lm_head.weight is meta.tok_emb.weight
    planned = fzero.plan(meta.state_dict(), world)
    assert planned.fingerprint == fzero.plan(real.state_dict(), world).fingerprint
    tied = [e.names for b in planned.buckets for e in b.entries if len(e.names) > 1]
    assert tied == [("tok_emb.weight", "lm_head.weight")]
    apart = fzero.plan({"a": torch.empty(4, device="meta"), "b": torch.empty(4, device="meta")},
                       world)
    assert [e.names for b in apart.buckets for e in b.entries] == [("a",), ("b",)]


@functools.cache
def gpt_reference() -> gb.Reference:
    return gb.reference(TinyGPT().double(), gb.gpt_loss, gb.gpt_batches(STEPS))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_meta_after_init_trains_a_tied_gpt_exactly(stage: int, world: int) -> None:
    out = fzero.SimWorld(world).run(gb.train, TinyGPT().double(), gb.gpt_loss,
                                    gb.gpt_batches(STEPS), stage=stage, after_init=gb.to_meta)
    gb.assert_parity(out[0], gpt_reference())
    assert torch.equal(out[0]["params"]["lm_head.weight"], out[0]["params"]["tok_emb.weight"])


@pytest.mark.parametrize("stage", STAGES)
def test_meta_after_init_with_buffers_and_frozen_parameters(stage: int) -> None:
    """FrozenMix reads a float and an int64 buffer and has frozen parameters: the state's
    buffers and frozen values are bound, not the module's meta tensors."""
    model = FrozenMix().double()
    data = gb.mse_batches(STEPS)
    want = gb.reference(model, gb.mse_loss, data)
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, data, stage=stage,
                                after_init=gb.to_meta)
    gb.assert_parity(out[0], want)


@pytest.mark.parametrize("stage", STAGES)
def test_meta_after_init_evaluates_exactly(stage: int) -> None:
    model, batch = TinyGPT().double(), gb.gpt_batches(1)[0]
    losses = fzero.SimWorld(2).run(gb.evaluate, model, gb.gpt_loss, batch, stage=stage,
                                   after_init=gb.to_meta)
    for rank, loss in enumerate(losses):
        assert loss == pytest.approx(gb.gpt_loss(model, gb.rank_rows(batch, rank, 2)).item(),
                                     rel=0, abs=gb.F64_ATOL)


def test_meta_after_init_on_gloo(gloo_pool: Any) -> None:
    for stage in (1, 3):
        out = gloo_pool(2).run(gb.train, TinyGPT().double(), gb.gpt_loss,
                               gb.gpt_batches(STEPS), stage=stage, after_init=gb.to_meta)
        gb.assert_parity(out[0], gpt_reference())


@pytest.mark.parametrize("stage", STAGES)
def test_tie_broken_after_init_raises_naming_the_names(stage: int) -> None:
    batch = gb.gpt_batches(1)[0]
    outs = fzero.SimWorld(2).run(gb.retie_after_init, TinyGPT().double(), batch, stage=stage,
                                 change=gb.untie_head, ranks=[0, 1])
    for out in outs:
        assert out["type"] == "ValueError" and out["unchanged"]
        assert "['tok_emb.weight', 'lm_head.weight']" in out["message"]
        assert "broken after fzero.init" in out["message"]


@pytest.mark.parametrize("stage", [0, 3])
def test_tie_broken_on_one_rank_raises_on_every_rank(stage: int) -> None:
    batch = gb.gpt_batches(1)[0]
    outs = fzero.SimWorld(3).run(gb.retie_after_init, TinyGPT().double(), batch, stage=stage,
                                 change=gb.untie_head, ranks=[2])
    assert outs[2]["type"] == "ValueError" and "lm_head.weight" in outs[2]["message"]
    for out in outs[:2]:
        assert out["type"] == "StepError" and out["ranks"] == (2,)
    assert all(out["unchanged"] for out in outs)


@pytest.mark.parametrize("stage", STAGES)
def test_tie_gained_after_init_raises(stage: int) -> None:
    batch = gb.mse_batches(1, d_in=6, d_out=6)[0]
    outs = fzero.SimWorld(2).run(gb.retie_after_init, gb.TwinLinear(), batch, stage=stage,
                                 change=gb.tie_fc2_to_fc1, ranks=[0, 1])
    for out in outs:
        assert out["type"] == "ValueError" and out["unchanged"]
        assert "['fc1.weight', 'fc2.weight']" in out["message"]
        assert "built before the tie" in out["message"]



@pytest.mark.parametrize("world", [1, 2])
def test_stage3_reduces_each_bucket_of_a_tied_gpt_as_soon_as_it_completes(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tied embedding is gathered early in backward (by the head) but completes last (at
    the embedding): reductions follow completion, so no block's gradient waits for it. When
    they waited, every bucket's full gradient stayed alive to the end of backward (a 1.1 GB
    transient at 300M parameters)."""
    events: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
    complete, launch = fzero.buckets.Reducer.complete, fzero.buckets.Reducer._launch

    def logged_complete(self: Any, index: int) -> None:
        events[threading.get_ident()].append(("complete", index))
        complete(self, index)

    def logged_launch(self: Any, index: int, *, zero: bool) -> None:
        events[threading.get_ident()].append(("launch", index))
        launch(self, index, zero=zero)

    monkeypatch.setattr(fzero.buckets.Reducer, "complete", logged_complete)
    monkeypatch.setattr(fzero.buckets.Reducer, "_launch", logged_launch)
    steps = 2
    fzero.SimWorld(world).run(gb.train, TinyGPT(n_layer=3).double(), gb.gpt_loss,
                              gb.gpt_batches(steps), stage=3)
    assert len(events) == world
    buckets = 5  # embeddings (with the tied head), three blocks, the final LayerNorm
    for rank_events in events.values():
        assert len(rank_events) == 2 * buckets * steps
        for position in range(0, len(rank_events), 2):  # each launch follows its completion
            (what, index), launched = rank_events[position : position + 2]
            assert what == "complete" and launched == ("launch", index), rank_events
        assert rank_events[-2:] == [("complete", 0), ("launch", 0)]  # the embedding: last


@pytest.mark.parametrize("buckets", ["per_block", "default"])
@pytest.mark.parametrize("world", [2, 3])
def test_stage3_two_buckets_kept_into_backward_train_exactly(
        world: int, buckets: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3 keeps the last two buckets forward used (a tied GPT: the embedding/head bucket
    and the last block's) for backward instead of gathering them again: in float64 the run
    equals torch.optim's to 1e-12, so nothing backward reads is stale. Both with one bucket per
    block and with the default policy (here two buckets: backward then gathers nothing)."""
    import fzero.residency

    decisions: list[tuple[int, ...]] = []
    plain = fzero.residency.carried

    def recorded(headers: Any, following: Any) -> tuple[int, ...]:
        decisions.append(carry := plain(headers, following))
        return carry

    monkeypatch.setattr(fzero.residency, "carried", recorded)
    policy = gb.per_block if buckets == "per_block" else None
    out = fzero.SimWorld(world).run(gb.train, TinyGPT().double(), gb.gpt_loss,
                                    gb.gpt_batches(STEPS), stage=3, buckets=policy)
    gb.assert_parity(out[0], gpt_reference())
    assert max(len(d) for d in decisions) == 2, decisions


class RegisteredTwice(torch.nn.Module):
    """One Linear reachable under two names, ``mid`` and ``blocks.0``: every parameter of it
    is a tie of two names on one module attribute."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.mid = torch.nn.Linear(4, 4).double()
        self.out = torch.nn.Linear(4, 2).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        self.blocks = torch.nn.ModuleList([self.mid])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


def _twice_loss(call: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((call(x) - y) ** 2).mean()


def _twice_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(2 * world, 4, generator=gen, dtype=torch.float64),
             torch.randn(2 * world, 2, generator=gen, dtype=torch.float64)) for _ in range(2)]


def _registered_twice_body(comm: Any, stage: int) -> Any:
    model = RegisteredTwice()
    before = {name: (p, p.detach().clone())
              for name, p in model.named_parameters(remove_duplicate=False)}
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    step = fzero.make_train_step(model, _twice_loss)
    evaluate = fzero.make_eval_step(model, _twice_loss)
    for batch in _twice_batches(comm.world_size):
        state, _ = step(state, gb.rank_rows(batch, comm.rank, comm.world_size))
        evaluate(state, batch)
    untouched = all(
        now is p and torch.equal(now, value)
        for (name, now), (p, value) in zip(model.named_parameters(remove_duplicate=False),
                                           before.values(), strict=True))
    return untouched, fzero.full_params(state)


@pytest.mark.parametrize("stage", STAGES)
def test_a_module_registered_under_two_names_is_left_as_it_was(stage: int) -> None:
    """functional_call swapped the shared attribute once per name and, restoring in the same
    order, left the state's tensor in the module (stages 0-2: the state's memory, which a
    later load_state_dict overwrote silently; stage 3: a released bucket, a segfault to read);
    the next step after an eval raised 'requires_grad changed'. Train and eval steps now leave
    the module's own Parameters, and train as torch does."""
    reference = RegisteredTwice()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in _twice_batches(2):
        optimizer.zero_grad()
        _twice_loss(reference, (x, y)).backward()
        optimizer.step()
    for untouched, params in fzero.SimWorld(2).run(_registered_twice_body, stage):
        assert untouched
        for name, value in reference.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(params[name], value.detach(), rtol=0, atol=1e-14)


def _save_on_meta_then_load(comm: Any, model: Any, path: str, stage: int,
                            load_kwargs: dict[str, Any]) -> dict[str, Any]:
    """One step, ``model.to("meta")`` (the README's pattern), save, load with `load_kwargs`
    (another bucket policy or trainable set), the remaining steps."""
    batches = gb.gpt_batches(STEPS)
    state = fzero.init(model, stage=stage, optimizer=gb.make_optimizer(("sgd", gb.SGD)),
                       comm=comm)
    model.to("meta")
    step = fzero.make_train_step(model, gb.gpt_loss)
    state, first = step(state, gb.rank_rows(batches[0], comm.rank, comm.world_size))
    fzero.save(state, path)
    state = fzero.load(path, model=model, comm=comm, **load_kwargs)
    losses = [first["loss"]]
    for batch in batches[1:]:
        state, metrics = step(state, gb.rank_rows(batch, comm.rank, comm.world_size))
        losses.append(metrics["loss"])
    return {"losses": losses, "params": fzero.full_params(state), "layout": state.layout}


@pytest.mark.parametrize("load_kwargs", [
    {"buckets": 1}, {"buckets": 200}, {"trainable": lambda name: True},
], ids=["one-element-cap", "cap", "trainable"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_load_with_another_policy_keeps_a_tie_the_meta_model_lost(
    tmp_path: Any, stage: int, load_kwargs: dict[str, Any]
) -> None:
    """After ``model.to("meta")`` each name of a tied weight has its own tensor; a load with
    a new bucket policy or trainable set planned on those names stored the tie as two
    parameters, which trained apart (a probe: the embedding 0.26 off after two steps). The
    checkpoint's ties are kept."""
    want = gb.reference(TinyGPT().double(), gb.gpt_loss, gb.gpt_batches(STEPS), gb.torch_sgd)
    out = fzero.SimWorld(2).run(_save_on_meta_then_load, TinyGPT().double(),
                                str(tmp_path / "c"), stage, load_kwargs)[0]
    assert any(e.aliases for b in out["layout"].buckets for e in b.entries)
    gb.assert_parity(out, want)
    assert torch.equal(out["params"]["lm_head.weight"], out["params"]["tok_emb.weight"])


def _load_with_one_name_frozen(comm: Any, path: str, frozen: str, trainable: Any) -> str:
    model = TinyGPT().double()
    state = fzero.init(model, stage=3, optimizer=gb.make_optimizer(("sgd", gb.SGD)), comm=comm)
    fzero.save(state, path)
    model.to("meta")  # each name of the tie now holds its own tensor
    model.get_parameter(frozen).requires_grad_(False)
    try:
        fzero.load(path, model=model, comm=comm, trainable=trainable)
    except fzero.checkpoint.CheckpointError as error:
        return str(error)
    return "loaded"


@pytest.mark.parametrize("frozen", ["tok_emb.weight", "lm_head.weight"])
def test_a_load_on_meta_refuses_a_tie_whose_names_differ_in_requires_grad(
    tmp_path: Any, frozen: str
) -> None:
    """A tie the meta model lost is restored by `load`, which then read the flags of the
    restored copy: the first name's flag decided, so freezing `lm_head.weight` trained the tied
    embedding anyway, silently (a probe: 0.097 moved in 2 steps); plan refuses the same flags.
    Every rank raises, naming the names and flags; an explicit `trainable=` decides instead."""
    for message in fzero.SimWorld(2).run(_load_with_one_name_frozen, str(tmp_path / "c"),
                                         frozen, None):
        assert message.startswith("('tok_emb.weight', 'lm_head.weight') are one tied tensor "
                                  "in the checkpoint"), message
        assert f"'{frozen}': False" in message
    assert fzero.SimWorld(2).run(_load_with_one_name_frozen, str(tmp_path / "d"), frozen,
                                 lambda name: True) == ["loaded"] * 2
