"""Buffers follow DDP: ``buffers="broadcast"`` (the default) is
``DistributedDataParallel(broadcast_buffers=True)`` (rank 0's buffers, e.g. BatchNorm's running
statistics, are copied to every rank before each forward), ``buffers="local"`` is
``broadcast_buffers=False`` (each rank keeps its own). Checked in gloo workers, DDP built on the
same default process group, different rows on every rank."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import fzero

import guarantee_bodies as gb

STEPS = 4


def data(world: int) -> list[Any]:
    return gb.mse_batches(STEPS, rows=4 * world, d_in=5, d_out=3)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("buffers", ["broadcast", "local"])
def test_buffers_match_ddp(gloo_pool: Any, buffers: str, world: int) -> None:
    for stage in (0, 3):
        outs = gloo_pool(world).run(gb.ddp_buffers_body, gb.BatchNormNet(), data(world),
                                    stage=stage, buffers=buffers)
        for out in outs:
            ours, ddp = out["ours"], out["ddp"]
            for name, value in ddp["params"].items():
                torch.testing.assert_close(ours["params"][name], value, rtol=0,
                                           atol=gb.F64_ATOL, msg=name)
            assert ours["buffers"].keys() == ddp["buffers"].keys()
            for name, value in ddp["buffers"].items():
                torch.testing.assert_close(ours["buffers"][name], value, rtol=0,
                                           atol=gb.F64_ATOL, msg=name)
        assert outs[0]["ours"]["buffers"]["bn.num_batches_tracked"] == STEPS
        means = [out["ours"]["buffers"]["bn.running_mean"] for out in outs]
        assert not torch.equal(means[0], means[1])  # each rank's last update is its own


def test_broadcast_and_local_differ() -> None:
    """The two policies give different statistics (so the comparisons above tell them apart),
    and the same parameters (training-mode BatchNorm normalizes with batch statistics)."""
    outs = {
        policy: fzero.SimWorld(2).run(gb.train, gb.BatchNormNet(), gb.mse_loss, data(2),
                                      stage=1, opt=("sgd", gb.SGD),
                                      step_kwargs={"buffers": policy})
        for policy in ("broadcast", "local")
    }
    for rank in (0, 1):
        a, b = (outs[p][rank] for p in ("broadcast", "local"))
        gb.assert_parity(a, gb.Reference(b["losses"], b["params"]))
    assert not torch.equal(outs["broadcast"][1]["buffers"]["bn.running_mean"],
                           outs["local"][1]["buffers"]["bn.running_mean"])


def test_local_buffers_are_each_ranks_own() -> None:
    """With "local", rank r's statistics are those of a model that saw only rank r's rows, its
    parameters following the training (recomputed here in one process, without DDP)."""
    world = 2
    batches = data(world)
    out = fzero.SimWorld(world).run(gb.train, gb.BatchNormNet(), gb.mse_loss, batches, stage=3,
                                    opt=("sgd", gb.SGD), step_kwargs={"buffers": "local"})
    model = gb.BatchNormNet()
    opt = gb.torch_sgd(list(model.parameters()))
    shadows = [copy.deepcopy(model) for _ in range(world)]  # rank r's buffers live here
    for batch in batches:
        for rank, shadow in enumerate(shadows):
            with torch.no_grad():
                for mine, trained in zip(shadow.parameters(), model.parameters(), strict=True):
                    mine.copy_(trained)
                shadow(gb.rank_rows(batch, rank, world)[0])  # updates its running statistics
        opt.zero_grad(set_to_none=True)
        # Each rank normalizes with its own rows' batch statistics (the buffers do not matter).
        losses = [gb.mse_loss(model, gb.rank_rows(batch, rank, world)) for rank in range(world)]
        (sum(losses) / world).backward()
        opt.step()
    for rank, shadow in enumerate(shadows):
        for name, value in shadow.named_buffers():
            torch.testing.assert_close(out[rank]["buffers"][name], value, rtol=0,
                                       atol=gb.F64_ATOL, msg=name)


def test_buffers_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="buffers must be one of"):
        fzero.make_train_step(gb.BatchNormNet(), gb.mse_loss, buffers="sync")


# ----------------------------------------------------------------------------------------------
# Buffers that do not match: every rank raises, before anything moves.


def _with_buffer(model: torch.nn.Module, name: str, shape: tuple[int, ...]) -> torch.nn.Module:
    model.register_buffer(name, torch.zeros(shape, dtype=torch.float64))
    return model


def _step_outcome(comm: Any, *, odd_rank: int, odd: str) -> Any:
    """One step of a BatchNormNet whose rank `odd_rank` is made odd after init: ``"model"``
    (its module gains a buffer the state lacks) or ``"state"`` (state and module both carry a
    buffer rank 0 lacks, so only the ranks' fingerprints can tell)."""
    model = gb.BatchNormNet()
    state = fzero.init(model, stage=1, optimizer=gb.make_optimizer(("sgd", gb.SGD)), comm=comm)
    if comm.rank == odd_rank:
        _with_buffer(model, "extra", (4,))
        if odd == "state":
            state = dataclasses.replace(state, buffers={
                **state.buffers, "extra": torch.zeros(4, dtype=torch.float64)})
    step = fzero.make_train_step(model, gb.mse_loss)
    sent = comm.counters.total()
    try:
        step(state, gb.rank_rows(data(comm.world_size)[0], comm.rank, comm.world_size))
    except Exception as exc:  # reported to the test, per rank
        return type(exc).__name__, str(exc), comm.counters.total() - sent
    return None


def test_a_buffer_registered_after_init_raises_naming_it() -> None:
    outcomes = fzero.SimWorld(2).run(_step_outcome, odd_rank=1, odd="model")
    kind, message, _ = outcomes[1]
    assert kind == "ValueError" and "only in the model ['extra']" in message
    kind, message, _ = outcomes[0]
    assert kind == "StepError" and "rank(s) [1] could not start it" in message
    assert [moved for *_, moved in outcomes] == [0, 0]  # no bucket moved (the header is control)


def test_ranks_holding_different_buffers_raise_before_any_broadcast() -> None:
    outcomes = fzero.SimWorld(3).run(_step_outcome, odd_rank=2, odd="state")
    for kind, message, _ in outcomes:
        assert kind == "StepError"
        assert "ranks disagree on the buffers before it started" in message
        assert "nothing was communicated or changed" in message
    assert [moved for *_, moved in outcomes] == [0, 0, 0]  # no buffer broadcast, no bucket


def _init_outcome(comm: Any) -> Any:
    model = gb.BatchNormNet()
    if comm.rank == 1:
        _with_buffer(model, "extra", (4,))
    try:
        fzero.init(model, stage=1, optimizer=gb.make_optimizer(("sgd", gb.SGD)), comm=comm)
    except ValueError as exc:
        return str(exc)
    return None


def test_init_raises_on_every_rank_when_the_buffers_differ() -> None:
    for rank, message in enumerate(fzero.SimWorld(2).run(_init_outcome)):
        assert message is not None and "buffers fingerprint (buffer names, shapes and dtypes) " \
            "differs across ranks" in message, rank


def test_buffers_fingerprint_sees_names_shapes_and_dtypes_not_values() -> None:
    from fzero.bound import buffers_fingerprint
    a = {"x": torch.zeros(3), "n": torch.tensor(0)}
    same_values_aside = {"x": torch.ones(3), "n": torch.tensor(7)}
    assert buffers_fingerprint(a) == buffers_fingerprint(same_values_aside)
    for other in ({"y": torch.zeros(3), "n": torch.tensor(0)},
                  {"x": torch.zeros(4), "n": torch.tensor(0)},
                  {"x": torch.zeros(3, dtype=torch.float64), "n": torch.tensor(0)},
                  {"n": torch.tensor(0), "x": torch.zeros(3)},
                  {"x": torch.zeros(3)}):
        assert buffers_fingerprint(other) != buffers_fingerprint(a), other


# ----------------------------------------------------------------------------------------------
# A buffer the forward reassigns instead of updating in place is kept, as plain torch keeps it.


class Counting(torch.nn.Module):
    """A linear layer counting its forward calls in a buffer it reassigns (not in place), and
    keeping a running mean of its input the same way."""

    def __init__(self, grow: bool = False) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2).double()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(3, dtype=torch.float64))
        self.grow = grow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        self.mean = 0.5 * self.mean + 0.5 * x.mean(0)
        if self.grow:
            self.mean = torch.cat([self.mean, self.mean])
        return self.fc(x)


def _counting_loss(call: Any, batch: torch.Tensor) -> torch.Tensor:
    return call(batch).pow(2).mean()


def _counting_body(comm: Any, *, stage: int, policy: str, grow_rank: int = -1) -> Any:
    model = Counting(grow=comm.rank == grow_rank)
    state = fzero.init(model, stage=stage, optimizer=gb.make_optimizer(("sgd", gb.SGD)),
                       comm=comm)
    step = fzero.make_train_step(model, _counting_loss, accum_steps=2, buffers=policy)
    gen = torch.Generator().manual_seed(comm.rank)
    try:
        for _ in range(3):
            state, _ = step(state, torch.randn(4, 3, dtype=torch.float64, generator=gen))
    except Exception as exc:  # reported to the test, per rank
        return type(exc).__name__, str(exc)
    assert model.calls.item() == 0 and not model.mean.any()  # the module is never mutated
    return {name: b.clone() for name, b in state.buffers.items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("policy", ["broadcast", "local"])
def test_a_reassigned_buffer_is_kept_as_torch_keeps_it(stage: int, policy: str) -> None:
    world = 2
    outs = fzero.SimWorld(world).run(_counting_body, stage=stage, policy=policy)
    # The reference: one plain module per rank seeing that rank's rows, two micro-batches a
    # step; with "broadcast" every micro-batch starts from rank 0's buffers, as DDP's does.
    references = [Counting() for _ in range(world)]
    gens = [torch.Generator().manual_seed(rank) for rank in range(world)]
    for _ in range(3):
        micros = [torch.randn(4, 3, dtype=torch.float64, generator=g).split(2) for g in gens]
        for index in range(2):
            if policy == "broadcast":
                for reference in references[1:]:
                    reference.calls, reference.mean = (references[0].calls.clone(),
                                                       references[0].mean.clone())
            for reference, rank_micros in zip(references, micros, strict=True):
                reference(rank_micros[index])
    for out, reference in zip(outs, references, strict=True):
        assert out["calls"].item() == reference.calls.item() == 6
        torch.testing.assert_close(out["mean"], reference.mean, rtol=0, atol=1e-15)
    assert not torch.equal(outs[0]["mean"], outs[1]["mean"])  # each rank's last update its own


def test_a_buffer_reassigned_with_another_shape_raises_naming_it() -> None:
    outcomes = fzero.SimWorld(2).run(_counting_body, stage=1, policy="broadcast", grow_rank=1)
    kind, message = outcomes[1]
    assert kind == "ValueError"
    assert "buffer 'mean' was reassigned in forward to shape (6,), torch.float64; the state " \
           "keeps it as shape (3,), torch.float64" in message
    kind, message = outcomes[0]
    assert kind == "StepError" and "ValueError: buffer 'mean' was reassigned" in message


_DESCRIPTIONS = st.lists(
    st.tuples(st.sampled_from(["a", "b", "bn.running_mean", "h.0.mask"]),
              st.lists(st.integers(0, 3), max_size=3).map(tuple),
              st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bfloat16])),
    max_size=4, unique_by=lambda d: d[0])


@given(_DESCRIPTIONS, _DESCRIPTIONS, st.integers(0, 2**16))
def test_buffers_fingerprint_is_equal_exactly_when_the_descriptions_are(
    first: list[Any], second: list[Any], seed: int
) -> None:
    from fzero.bound import buffers_fingerprint

    gen = torch.Generator().manual_seed(seed)

    def made(description: list[Any]) -> dict[str, torch.Tensor]:  # random values each time
        return {name: torch.randint(-9, 9, shape, generator=gen).to(dtype)
                for name, shape, dtype in description}

    assert buffers_fingerprint(made(first)) == buffers_fingerprint(made(first))
    assert (buffers_fingerprint(made(first)) == buffers_fingerprint(made(second))) == (
        first == second)


class _TransposedBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("mix", torch.arange(9.0).reshape(3, 3).t())  # strides (1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.mix


def _transposed_body(comm: Any, stage: int) -> tuple[torch.Tensor, float]:
    model = _TransposedBuffer()
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    step = fzero.make_train_step(model, lambda call, x: call(x).pow(2).mean())
    state, metrics = step(state, torch.ones(2, 3))
    return state.buffers["mix"], metrics["loss"]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_non_contiguous_buffer_is_taken(stage: int) -> None:
    """init broadcast each buffer as a flat view, which a transposed one (or the base an
    orthogonal parametrization registers) cannot give: torch's raw 'view size' error."""
    want = torch.arange(9.0).reshape(3, 3).t()
    for mix, loss in fzero.SimWorld(2).run(_transposed_body, stage):
        assert torch.equal(mix, want) and loss > 0


class _HoldsCount(nn.Module):
    """A Linear layer holding the buffer ``count``; `counts`: adds 1 to it in place per call
    (every holder of the tensor sees it), else adds it to the input."""

    def __init__(self, d_in: int, d_out: int, count: Tensor, counts: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out, dtype=torch.float64)
        self.register_buffer("count", count)
        self.counts = counts

    def forward(self, x: Tensor) -> Tensor:
        if self.counts:
            self.count.add_(1.0)
            return torch.tanh(self.fc(x))
        return self.fc(x + 0.1 * self.count)


class SharedCount(nn.Module):
    """One buffer tensor registered in two submodules (``a.count is b.count``): `a` counts its
    calls in place, `b` reads the count, as torch's modules share the tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        count = torch.zeros(6, dtype=torch.float64)
        self.a, self.b = _HoldsCount(5, 6, count, True), _HoldsCount(6, 3, count, False)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_buffer_of_two_submodules_is_one_tensor_as_in_torch(stage: int, world: int) -> None:
    """`b` reads the count `a` updated (it read the module's own, never-updated tensor: the
    losses were 0.1-1 off torch's); also with the module moved to meta after init, which gives
    each name a tensor of its own."""
    model = SharedCount()
    assert model.a.count is model.b.count
    batches = gb.mse_batches(STEPS, rows=4 * world, d_in=5, d_out=3)
    want = gb.reference(model, gb.mse_loss, batches, gb.torch_sgd)
    for after_init in (None, lambda m: m.to("meta")):
        outs = fzero.SimWorld(world).run(gb.train, model, gb.mse_loss, batches, stage=stage,
                                         opt=("sgd", gb.SGD), after_init=after_init)
        for out in outs:
            gb.assert_parity(out, want)
            assert list(out["buffers"]) == ["a.count"]
            assert out["buffers"]["a.count"].eq(STEPS).all()


def test_a_loaded_state_binds_a_buffer_of_two_submodules_as_one(tmp_path) -> None:
    """`fzero.load` finds the buffer's second name in the model it is given, as init does."""
    batches = gb.mse_batches(2, rows=4, d_in=5, d_out=3)

    def body(comm: Any) -> Any:
        model = SharedCount()
        step = fzero.make_train_step(model, gb.mse_loss)
        state = fzero.init(model, stage=1, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        state, _ = step(state, batches[0])
        fzero.save(state, str(tmp_path / "c"))
        state, through = step(state, batches[1])
        fresh = SharedCount()
        loaded = fzero.load(str(tmp_path / "c"), model=fresh, comm=comm)
        _, resumed = fzero.make_train_step(fresh, gb.mse_loss)(loaded, batches[1])
        return through["loss"], resumed["loss"]

    (through, resumed), = fzero.SimWorld(1).run(body)
    want = gb.reference(SharedCount(), gb.mse_loss, batches, gb.torch_sgd).losses[1]
    assert through == resumed == pytest.approx(want, rel=0, abs=gb.F64_ATOL)
