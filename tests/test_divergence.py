"""Ranks whose computation differs (data-dependent control flow) train exactly.

Each rank's rows carry its route through `guarantee_bodies.Routed`'s equal-sized blocks: skip a
block, call one twice, run them in another order. The reference is single-process torch.optim
on the mean over ranks of each rank's mean loss, each rank's rows deciding its own path, which
is what data parallelism means for such a model. Stages 0-2 reduce in one fixed order with
zeros for unused buckets; stage 3 gathers along one agreed sequence and asks for the rest in
rounds (fzero.schedule).

A parameter that no rank used in a step gets no update at all (torch.optim skips a parameter
whose grad is None): no decay, frozen moments, its own step count (`state.param_steps`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from torch import nn

import fzero

import guarantee_bodies as gb

STAGES = (0, 1, 2, 3)
FULL = [0, 1, 2]


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture
def short_patience(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3: a rank whose backward differs waits for the previous bucket's reduction at most
    four times the typical reduction time (capped by `REDUCE_PATIENCE`) before it moves on
    (fzero.buckets.Reducer), once per deferred bucket. The result must not depend on it: the
    SimWorld matrices cap it at 10 ms, which defers more reductions; the gloo tests keep the
    default."""
    import fzero.step

    monkeypatch.setattr(fzero.step, "REDUCE_PATIENCE", 0.01)


def routes(kind: str, world: int) -> list[list[list[int]]]:
    """Per step, per rank: the route. The first and last ranks diverge at different steps."""
    rest = [FULL] * (world - 1)
    odd = {"skip": ([0, 2], [0, 1], [2]), "twice": ([0, 1, 1, 2], [0, 0, 1, 2], [1, 1]),
           "order": ([2, 1, 0], [1, 0, 2], [0, 2, 1])}[kind]
    return [[FULL] * world, [odd[0], *rest], [*rest, odd[1]], [odd[2], *rest]]


UNUSED = [[FULL], [[0, 2]], [[0, 2]], [FULL], [[0, 2]]]
"""Block 1 used at step 1, by no rank at steps 2, 3 and 5, used again at step 4."""


@functools.cache
def batches(kind: str, world: int) -> list[Any]:
    plan = UNUSED if kind == "unused" else routes(kind, world)
    return gb.routed_batches([step * world if kind == "unused" else step for step in plan])


@functools.cache
def expected(kind: str, world: int) -> gb.Reference:
    return gb.reference(gb.Routed().double(), gb.routed_loss, batches(kind, world), world=world)


def train(world: int, kind: str, stage: int, buckets: Any = None) -> list[dict[str, Any]]:
    return fzero.SimWorld(world).run(gb.train, gb.Routed().double(), gb.routed_loss,
                                     batches(kind, world), stage=stage, buckets=buckets)


# ----------------------------------------------------------------------------------------------
# Divergent ranks


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["skip", "twice", "order"])
def test_divergent_ranks_train_exactly(kind: str, stage: int, world: int,
                                      short_patience: None) -> None:
    out = train(world, kind, stage)
    gb.assert_parity(out[0], expected(kind, world))
    for other in out[1:]:
        assert other["losses"] == out[0]["losses"]
        assert all(torch.equal(other["params"][n], v) for n, v in out[0]["params"].items())
    assert all(m["unused"] == [] for m in out[0]["metrics"])  # some rank used every block


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_skipped_block_with_fine_buckets(stage: int, world: int, short_patience: None) -> None:
    """A 20-element cap: every parameter in a bucket of its own, the blocks' weights in equal
    64-element buckets, each split across ranks."""
    out = train(world, "skip", stage, buckets=20)
    assert len(out[0]["layout"].buckets) == 10
    gb.assert_parity(out[0], expected("skip", world))


@pytest.mark.parametrize("kind", ["twice", "order"])
def test_stage3_reuse_and_reorder_with_fine_buckets(kind: str, short_patience: None) -> None:
    out = train(3, kind, 3, buckets=20)
    gb.assert_parity(out[0], expected(kind, 3))


class Headless(gb.Routed):
    """`Routed` without its head: forward ends in the last block of the rank's route, so ranks
    on different routes end their forward in different buckets."""

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (B, width)
        for index in route[0].tolist():
            if index >= 0:
                h = torch.tanh(self.blocks[index](h))
        return h[:, :3]  # (B, 3); `out` is never used


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["skip", "order"])
def test_stage3_keeps_a_bucket_for_backward_only_when_every_rank_holds_it(
        kind: str, world: int, short_patience: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3 keeps the buckets forward ended with for backward only if every rank ended in
    them and backward's agreed sequence starts with them. "skip": ranks end in different blocks at
    some steps and in the same one at others, so both decisions are taken; "order": at every
    step the ranks end in different blocks or the merged backward sequence starts elsewhere, so
    nothing is kept. Training is exact either way."""
    import fzero.residency

    decisions: list[tuple[int, ...]] = []

    def recorded(headers: Any, following: Any) -> tuple[int, ...]:
        decisions.append(carry := gb_carried(headers, following))
        return carry

    gb_carried = fzero.residency.carried
    monkeypatch.setattr(fzero.residency, "carried", recorded)
    data = batches(kind, world)
    out = fzero.SimWorld(world).run(gb.train, Headless().double(), gb.routed_loss, data,
                                    stage=3)
    want = gb.reference(Headless().double(), gb.routed_loss, data, world=world)
    gb.assert_parity(out[0], want)
    for other in out[1:]:
        assert other["losses"] == out[0]["losses"]
    kept = [d for d in decisions if d]
    assert () in decisions and (kept if kind == "skip" else not kept), decisions


def test_reference_tells_paths_apart() -> None:
    """The per-rank paths matter: the same batches with every rank on the full route train
    differently, and so does one global batch with rank 0's route for everyone."""
    world = 3
    want = expected("skip", world)
    plain = gb.reference(gb.Routed().double(), gb.routed_loss, batches("skip", world), world=1)
    all_full = gb.reference(gb.Routed().double(), gb.routed_loss,
                            gb.routed_batches([[FULL] * world] * 4), world=world)
    assert gb.max_difference(plain.params, want.params) > 1e-4
    assert gb.max_difference(all_full.params, want.params) > 1e-4


@pytest.mark.parametrize("world", [2, 3])
def test_divergent_ranks_on_gloo(gloo_pool: Any, world: int) -> None:
    for stage in STAGES:
        for kind in ("skip", "order"):
            out = gloo_pool(world).run(gb.train, gb.Routed().double(), gb.routed_loss,
                                       batches(kind, world), stage=stage)
            gb.assert_parity(out[0], expected(kind, world))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_divergent_ranks_on_gloo_with_fine_buckets(gloo_pool: Any, world: int) -> None:
    for stage in STAGES:
        out = gloo_pool(world).run(gb.train, gb.Routed().double(), gb.routed_loss,
                                   batches("skip", world), stage=stage, buckets=20)
        gb.assert_parity(out[0], expected("skip", world))


@pytest.mark.parametrize("kind", ["skip", "twice", "order"])
def test_stage3_eval_with_divergent_ranks(kind: str, short_patience: None) -> None:
    """The eval step is a collective at stage 3 too; each rank gets its own path's loss."""
    world, model = 3, gb.Routed().double()
    for batch in batches(kind, world)[1:]:
        losses = fzero.SimWorld(world).run(gb.evaluate, model, gb.routed_loss, batch, stage=3)
        for rank, loss in enumerate(losses):
            want = gb.routed_loss(model, gb.rank_rows(batch, rank, world)).item()
            assert loss == pytest.approx(want, rel=0, abs=gb.F64_ATOL)


# ----------------------------------------------------------------------------------------------
# Parameters no rank used


@pytest.mark.parametrize("buckets", [None, 20])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_unused_parameters_follow_torch(stage: int, world: int, buckets: Any) -> None:
    """AdamW with weight decay: torch leaves a grad-None parameter alone (no decay, moments
    frozen) and its bias corrections then count its own steps; fzero does the same."""
    out = train(world, "unused", stage, buckets=buckets)
    gb.assert_parity(out[0], expected("unused", world))
    unused = ["blocks.1.weight", "blocks.1.bias"]
    assert [m["unused"] for m in out[0]["metrics"]] == [[], unused, unused, [], unused]
    names = [e.name for b in out[0]["layout"].buckets if b.trainable for e in b.entries]
    steps = dict(zip(names, out[0]["param_steps"], strict=True))
    assert steps == {n: 2 if n.startswith("blocks.1.") else 5 for n in names}
    assert out[0]["step"] == 5


NO_PATH = [gb.NO_PATH]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_a_rank_whose_loss_leaves_the_model_out_contributes_zeros(
        stage: int, world: int, short_patience: None) -> None:
    """A rank whose batch turns the model off (its loss has no gradient path) contributes zero
    gradients, as its rows do to the gradient of the mean of every rank's loss; other ranks
    train on. It raised 'no gradient path' on that rank, stopping every rank."""
    plan = [[FULL] * world, [NO_PATH, *[FULL] * (world - 1)], [*[FULL] * (world - 1), NO_PATH],
            [NO_PATH, *[[0, 2]] * (world - 1)]]
    data = gb.routed_batches(plan)
    want = gb.reference(gb.Routed().double(), gb.routed_loss, data, world=world)
    for buckets in (None, 20):
        out = fzero.SimWorld(world).run(gb.train, gb.Routed().double(), gb.routed_loss, data,
                                        stage=stage, buckets=buckets)
        gb.assert_parity(out[0], want)
        assert [m["unused"] for m in out[0]["metrics"]][3] == ["blocks.1.weight",
                                                               "blocks.1.bias"]


@pytest.mark.parametrize("stage", STAGES)
def test_no_rank_with_a_gradient_path_raises_on_every_rank(stage: int) -> None:
    """When no rank's loss reaches a trainable parameter (a loss_fn that forgot `call`), every
    rank raises naming the parameters, and the state is unchanged; the next step trains."""
    data = gb.routed_batches([[NO_PATH] * 2, [FULL] * 2])
    outs = fzero.SimWorld(2).run(gb.train_through_failure, gb.Routed().double(),
                                 gb.routed_loss, data, stage=stage, fail={})
    for out in outs:
        assert list(out["errors"]) == [0] and len(out["losses"]) == 1 and out["step"] == 1
        error = out["errors"][0]
        assert error["type"] == "ValueError" and error["unchanged"], error
        assert "no gradient path" in error["message"] and "'inp.weight'" in error["message"]


def test_unused_reference_differs_from_zero_gradients() -> None:
    """What fzero did before: a zero gradient instead of none, so decay and moments go on."""
    data = batches("unused", 1)
    want = expected("unused", 1)
    model = gb.Routed().double()
    opt = gb.torch_adamw(list(model.parameters()))
    for batch in data:
        opt.zero_grad(set_to_none=False)  # keeps zeros where a gradient existed
        gb.routed_loss(model, batch).backward()
        opt.step()
    stepped = {n: p.detach() for n, p in model.named_parameters()}
    assert gb.max_difference(stepped, want.params) > 1e-3


def test_unused_parameters_then_more_steps_keep_parity() -> None:
    """After the per-parameter counts diverged, ordinary steps keep using them."""
    plan = UNUSED + [[FULL]] * 3
    data = gb.routed_batches([step * 2 for step in plan])
    want = gb.reference(gb.Routed().double(), gb.routed_loss, data, world=2)
    out = fzero.SimWorld(2).run(gb.train, gb.Routed().double(), gb.routed_loss, data, stage=3)
    gb.assert_parity(out[0], want)
    assert out[0]["param_steps"] is not None and max(out[0]["param_steps"]) == 8


def _rising(step: int) -> float:
    """A learning-rate schedule of the 1-based step."""
    return 0.01 * step


def _scheduled_body(comm: Any, stage: int, data: list[Any]) -> dict[str, torch.Tensor]:
    model = gb.Routed().double()
    optimizer = fzero.optim.adamw(lr=_rising, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    state = fzero.init(model, stage=stage, comm=comm, optimizer=optimizer)
    step = fzero.make_train_step(model, gb.routed_loss)
    for batch in data:
        state, _ = step(state, gb.rank_rows(batch, comm.rank, comm.world_size))
    return fzero.full_params(state)


@pytest.mark.parametrize("stage", STAGES)
def test_a_schedule_gives_a_lagging_parameter_the_steps_rate(stage: int) -> None:
    """The optimizer's own schedule is read at the step's number for every parameter, as
    torch's per-group rate: a parameter unused in earlier steps was given the rate of its own
    update count (step 4 applied schedule(2) to block 1, and every later step lagged too);
    its count is only for its moments' bias correction."""
    data = batches("unused", 2)
    model = gb.Routed().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.1)
    for number, batch in enumerate(data, start=1):
        for group in optimizer.param_groups:
            group["lr"] = _rising(number)
        optimizer.zero_grad(set_to_none=True)
        loss = sum(gb.routed_loss(model, gb.rank_rows(batch, r, 2)) for r in range(2)) / 2
        loss.backward()
        optimizer.step()
    want = {n: p.detach() for n, p in model.named_parameters()}
    for params in fzero.SimWorld(2).run(_scheduled_body, stage, data):
        assert gb.max_difference(params, want) < 1e-12


class EarlyExit(torch.nn.Module):
    """Eight one-Linear blocks; a micro-batch runs the first ``depth`` of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(8))
        self.out = torch.nn.Linear(4, 2, dtype=torch.float64)

    def forward(self, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks[: int(depth[0])]:
            h = torch.tanh(block(h))
        return self.out(h)


def early_exit_loss(call: Any, batch: Any) -> torch.Tensor:
    """The mean loss of ``calls[0]`` forward calls on shifted inputs."""
    x, depth, calls, y = batch
    n = int(calls[0])
    return sum(torch.nn.functional.mse_loss(call(x + 0.1 * k, depth), y) for k in range(n)) / n


EXITS = [[[(8, 1), (1, 1)], [(8, 2), (1, 1)]], [[(2, 3), (0, 3)], [(8, 1), (8, 3)]]]
"""Per step, per rank: (depth, calls) of its two micro-batches."""


def early_exit_batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s 4 rows at step `step`: two micro-batches of 2 rows, each on its path."""
    gen = torch.Generator().manual_seed(10 * step + rank)
    rows = [row for micro in EXITS[step][rank] for row in (micro, micro)]
    return (torch.randn(4, 4, dtype=torch.float64, generator=gen),
            torch.tensor([d for d, _ in rows]), torch.tensor([c for _, c in rows]),
            torch.randn(4, 2, dtype=torch.float64, generator=gen))


def early_exit_body(comm: Any, model: EarlyExit) -> dict[str, torch.Tensor]:
    state = fzero.init(model, stage=3, optimizer=fzero.optim.sgd(lr=0.1), comm=comm,
                       buckets=gb.each_parameter_alone(model))
    step = fzero.make_train_step(model, early_exit_loss, accum_steps=2)
    for s in range(len(EXITS)):
        state, _ = step(state, early_exit_batch(s, comm.rank))
    return {name: t.clone() for name, t in fzero.full_params(state).items()}


def early_exit_reference() -> dict[str, torch.Tensor]:
    """torch.optim.SGD on the mean over ranks and micro-batches of each one's loss."""
    model = EarlyExit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(len(EXITS)):
        opt.zero_grad(set_to_none=True)
        losses = [early_exit_loss(model, [t[half : half + 2] for t in early_exit_batch(s, r)])
                  for r in range(2) for half in (0, 2)]
        (sum(losses) / len(losses)).backward()
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def test_ranks_on_different_paths_do_not_stall_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3 with the default patience, ranks exiting early at different blocks and calling
    the model a different number of times: a rank's wait for a reduction that a peer joined only
    after its own wait gave up counted as a typical reduction time, so the waits grew to
    `REDUCE_PATIENCE` (2 s) each; a step took 30 s and the collectives timed out (a probe
    found it). Within a 20 s collective timeout now, the same numbers as with waits capped at
    10 ms, and torch's."""
    import fzero.step

    default = fzero.SimWorld(2, timeout=20).run(early_exit_body, EarlyExit())
    monkeypatch.setattr(fzero.step, "REDUCE_PATIENCE", 0.01)
    short = fzero.SimWorld(2, timeout=20).run(early_exit_body, EarlyExit())
    want = early_exit_reference()
    for ours, capped in zip(default, short, strict=True):
        assert ours.keys() == capped.keys() == want.keys()
        for name, value in capped.items():
            assert torch.equal(ours[name], value), name
            torch.testing.assert_close(value, want[name], rtol=0, atol=gb.F64_ATOL)


@pytest.mark.parametrize("cut", ["detach", "leaf"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_loss_cut_from_the_graph_on_one_rank_raises_on_every_rank(stage: int,
                                                                    cut: str) -> None:
    """Rank 1's loss_fn runs the model and returns ``loss.detach()``: torch raises in backward
    (DDP on that rank); fzero took it for a batch with no gradient path and trained on with
    rank 1's gradient zero (a probe). A loss that never ran the model still contributes zeros
    (`test_a_rank_whose_loss_leaves_the_model_out_contributes_zeros`)."""

    def body(comm: Any) -> tuple[str, str, bool]:
        model = gb.MLP64()
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)

        def loss_fn(call: Any, batch: Any) -> torch.Tensor:
            loss = gb.mse_loss(call, batch)
            if comm.rank == 1 and cut == "leaf":  # a new leaf requiring grad: cut too
                return torch.tensor(loss.item(), dtype=loss.dtype, requires_grad=True)
            return loss.detach() if comm.rank == 1 else loss

        before = [t.clone() for t in state.params]
        try:
            fzero.make_train_step(model, loss_fn)(
                state, gb.rank_rows(gb.mse_batches(1, rows=4)[0], comm.rank, 2))
        except Exception as error:
            same = all(x.equal(y) for x, y in zip(before, state.params, strict=True))
            return type(error).__name__, str(error), same
        return "trained", "", False

    (kind0, message0, same0), (kind1, message1, same1) = fzero.SimWorld(2).run(body)
    assert kind1 == "ValueError" and "cut from the graph" in message1 and same1, message1
    assert kind0 == "StepError" and "rank(s) [1]" in message0 and same0, message0


@dataclasses.dataclass
class _Prediction:
    """A model output that torch's pytree does not look into (a plain dataclass)."""

    mean: torch.Tensor


class _Wrapped(nn.Module):
    """`gb.MLP64` whose forward returns a `_Prediction` or a `torch.distributions.Normal`."""

    def __init__(self, output: str) -> None:
        super().__init__()
        self.inner, self.output = gb.MLP64(), output

    def forward(self, x: torch.Tensor) -> Any:
        mean = self.inner(x)
        if self.output == "dataclass":
            return _Prediction(mean)
        return torch.distributions.Normal(mean, torch.ones_like(mean))


@pytest.mark.parametrize("output", ["dataclass", "distribution"])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_loss_cut_from_an_output_that_is_no_pytree_raises(stage: int, output: str) -> None:
    """As above, with the model's output a dataclass or a `torch.distributions` object, which
    torch's pytree takes as one leaf: the check saw no tensor that required grad, and rank 1's
    cut loss trained silently with its gradient zero (a probe)."""

    def body(comm: Any) -> tuple[str, str]:
        model = _Wrapped(output)
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)

        def loss_fn(call: Any, batch: Any) -> torch.Tensor:
            x, y = batch
            out = call(x)
            loss = ((out.mean - y) ** 2).mean()
            return loss.detach() if comm.rank == 1 else loss

        try:
            fzero.make_train_step(model, loss_fn)(
                state, gb.rank_rows(gb.mse_batches(1, rows=4)[0], comm.rank, 2))
        except Exception as error:
            return type(error).__name__, str(error)
        return "trained", ""

    (kind0, message0), (kind1, message1) = fzero.SimWorld(2).run(body)
    assert kind1 == "ValueError" and "cut from the graph" in message1, message1
    assert kind0 == "StepError" and "rank(s) [1]" in message0, message0
