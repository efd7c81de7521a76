"""Writes through ``.data`` that a separate master copy would drop (`fzero.state.lost_writes`).

Stages 0-2 with parameters apart from their master copy (bfloat16 parameters and a float32
master, or a float16 master under float32 parameters) recompute the parameters from the
master after every update, so a forward's write through ``.data`` (no version counter shows
it) would be dropped silently. A step compares the parameters with their master's cast, and
the buckets whose parameters the state was built apart from that cast (`ShardState.uncast`:
`init`'s and `fzero.load`'s own casts) with a checksum taken then. These tests pin the cases
a single "step 0" baseline got wrong: a checkpoint loaded with a narrower master (a false
alarm on every step), a first-step write under a float16 master, a new step function or a
clone after an error, a write in an eval step, and a skipped step. And the checks a rank's
own part cannot make: a write that reaches some ranks only (the ranks compare a fingerprint
of their full parameters, `fzero.state.params_fingerprint`), and a save of parameters that
hold a write training would drop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

import fzero

STAGES = (0, 1, 2)
LR = 0.1


class Clamps(nn.Module):
    """Two Linear layers; forward clips the first weight through ``.data`` (WGAN style) when
    `clamp` is True, or calls `clamp` on itself when it is a function: writes that bump no
    version counter."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6, dtype=dtype), nn.Linear(6, 2, dtype=dtype)
        # From a generator of its own: SimWorld's ranks are threads sharing torch's global one.
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.rand(param.shape, generator=gen, dtype=torch.float64) - 0.5)
        self.clamp = False

    def forward(self, x: Tensor) -> Tensor:  # (B, 6) -> (B, 2)
        if callable(self.clamp):
            self.clamp(self)
        elif self.clamp:
            self.a.weight.data.clamp_(-0.05, 0.05)
        return self.b(torch.tanh(self.a(x)))


def loss_fn(call: Any, x: Tensor) -> Tensor:
    return call(x).float().pow(2).mean()


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Rank `rank`'s batch of step `step`: the same in every run."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=gen).to(dtype)


def attempt(step: Any, state: fzero.ShardState, x: Tensor) -> tuple[fzero.ShardState, str | None]:
    """One step: the new state and None, or the input state and the error's message."""
    try:
        return step(state, x)[0], None
    except (ValueError, fzero.StepError) as error:
        return state, str(error)


def _lost(message: str | None) -> bool:
    return message is not None and "parameters of buckets ['a..b'] were written during" in message


# --- a checkpoint loaded with a narrower master --------------------------------------------


def _narrower_load(comm: Any, path: str, stage: int, clamp: bool) -> dict[str, Any]:
    """Three SGD steps in float32 (the parameters are the master copy), a checkpoint after the
    second; then that checkpoint loaded with a float16 master and the third step again."""
    model = Clamps()
    step = fzero.make_train_step(model, loss_fn)
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=LR))
    losses = []
    for index in range(3):
        if index == 2:
            fzero.save(state, path)
        state, metrics = step(state, batch(comm.rank, index))
        losses.append(metrics["loss"])
    loaded = fzero.load(path, model=model, comm=comm, master_dtype=torch.float16)
    model.clamp = clamp
    uncast = loaded.uncast
    after, error = attempt(step, loaded, batch(comm.rank, 2))
    out = {"uncast": uncast, "error": error, "losses": losses}
    if error is None:
        out["params"] = fzero.full_params(after)
        out["master"] = fzero.full_params(after, master=True)
        out["after_uncast"] = after.uncast
        out["next"] = attempt(step, after, batch(comm.rank, 3))[1]
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_a_checkpoint_loaded_with_a_narrower_master_trains_on(stage: int, tmp_path) -> None:
    """A step >= 1 checkpoint of float32 training loaded with ``master_dtype=torch.float16``:
    the loaded parameters are the saved float32 values, the master their float16 cast, so
    the parameters are not the master's cast. Every step after such a load raised "written
    during the step" on every rank (the check compared them, and only step 0 was excused).
    Now the state knows those buckets (`ShardState.uncast`) and the step trains: its update
    makes the parameters exactly the master's cast, and the next step trains too. Against
    the uninterrupted run: the same loss on the same batch (the forward used the saved
    float32 parameters), and the master within float16's rounding of SGD's update."""
    want = fzero.SimWorld(2).run(_narrower_load, str(tmp_path / "w"), stage, False)
    for out in want:
        assert [index for index, _ in out["uncast"]] == [0]
        assert out["error"] is None and out["next"] is None
        assert out["after_uncast"] == ()
        for name, value in out["params"].items():  # the parameters are the master's cast
            assert torch.equal(value, out["master"][name].float()), name
    # The reference: the same three steps in float32 in one process over the global batch.
    model = Clamps()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for index in range(3):
        x = torch.cat([batch(rank, index) for rank in range(2)])
        loss = model(x).float().pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if index < 2:
            optimizer.step()
        else:
            saved = {n: p.detach().clone() for n, p in model.named_parameters()}
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            last = float(loss.detach())
    for out in want:
        assert out["losses"][2] == pytest.approx(last, rel=1e-6)
        for name, value in out["master"].items():
            expected = (saved[name].half().float() - LR * grads[name]).half()
            torch.testing.assert_close(value, expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize("stage", STAGES)
def test_a_write_through_data_after_a_narrower_load_raises(stage: int, tmp_path) -> None:
    """The buckets such a load built apart from their master are compared with their
    checksum instead: a forward's write through ``.data`` there, which the update would drop,
    still raises on the rank whose part it changed (every rank's, for this clamp)."""
    for out in fzero.SimWorld(2).run(_narrower_load, str(tmp_path / "w"), stage, True):
        assert _lost(out["error"]), out["error"]


# --- first steps ----------------------------------------------------------------------------


def _float16_master(comm: Any, stage: int, clamp_at: int) -> list[str | None]:
    """Two steps with float32 parameters and a float16 master (every bucket apart from its
    master's cast at init), the forward clamping at step `clamp_at`: each step's error."""
    model = Clamps()
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.0),
                       master_dtype=torch.float16)
    assert [index for index, _ in state.uncast] == [0]
    step = fzero.make_train_step(model, loss_fn)
    errors = []
    for index in range(2):
        model.clamp = index == clamp_at
        state, error = attempt(step, state, batch(comm.rank, index))
        errors.append(error)
    return errors


@pytest.mark.parametrize("stage", STAGES)
def test_a_first_step_write_under_a_float16_master_raises(stage: int) -> None:
    """float32 parameters under a float16 master differ from its cast from `init` on, so the
    first step could not compare with the master and left such buckets unchecked: a write
    through ``.data`` in that step was dropped by its update, silently. It raises now (the
    checksum taken at init), as one in the second step does."""
    for clamp_at in (0, 1):
        for errors in fzero.SimWorld(2).run(_float16_master, stage, clamp_at):
            assert _lost(errors[clamp_at]), errors
            assert errors[1 - clamp_at] is None or clamp_at == 0, errors


def _after_an_error(comm: Any, stage: int) -> dict[str, str | None]:
    """bfloat16 parameters, a float32 master: a first step clamping through ``.data`` raises;
    then the same step again, a new step function, and a new one on a clone of the state."""
    model = Clamps()
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=LR),
                       param_dtype=torch.bfloat16)
    model.clamp = True
    x = batch(comm.rank, 0, torch.bfloat16)
    step = fzero.make_train_step(model, loss_fn)
    _, first = attempt(step, state, x)
    model.clamp = False  # the write is in the parameters already
    _, again = attempt(step, state, x)
    _, new_step = attempt(fzero.make_train_step(model, loss_fn), state, x)
    _, clone = attempt(fzero.make_train_step(model, loss_fn), fzero.clone_state(state), x)
    return {"first": first, "again": again, "new step": new_step, "clone": clone}


@pytest.mark.parametrize("stage", STAGES)
def test_a_write_left_by_a_failed_first_step_is_never_trained_on(stage: int) -> None:
    """The first check compared with what the parameters held when a step function first saw
    the state's tensors: a new step function (or one over a `clone_state` copy) built after a
    first step that raised took the write it left for init's, and trained on, its update
    dropping the write. The state itself now carries what init built (`ShardState.uncast`,
    here nothing: bfloat16 of a float32 master is what the parameters were), so every later
    attempt raises until the state is rebuilt."""
    for out in fzero.SimWorld(2).run(_after_an_error, stage):
        for what, error in out.items():
            assert _lost(error), (what, error)


# --- eval steps -----------------------------------------------------------------------------


def _eval_writes(comm: Any, stage: int, param_dtype: torch.dtype | None,
                 trained: bool) -> dict[str, Any]:
    """An eval step whose forward clamps through ``.data``, before any train step or after
    one; its error, then the master copy (`full_params(master=True)`)."""
    model = Clamps()
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.0),
                       param_dtype=param_dtype)
    step = fzero.make_train_step(model, loss_fn)
    x = batch(comm.rank, 0, param_dtype or torch.float32)
    if trained:
        state, _ = step(state, x)
    model.clamp = True
    error = None
    try:
        fzero.make_eval_step(model, lambda call, b: call(b))(state, x)
    except ValueError as exc:
        error = str(exc)
    model.clamp = False
    state, after = attempt(step, state, x)
    return {"error": error, "after": after,
            "weight": fzero.full_params(state, master=True)["a.weight"]}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("trained", [False, True])
def test_an_eval_step_write_a_master_copy_would_drop_raises(stage: int, trained: bool) -> None:
    """Below stage 3 an eval step's write through ``.data`` lands in the parameters (as in
    torch, which keeps it in the module): with float32 parameters that is the state, and
    training goes on from the clamped weight. With a separate master copy (bfloat16
    parameters) the next update would drop it: before the first train step that happened
    silently (the first step took the written parameters for init's), after one the next
    train step blamed its own forward. The eval step raises now, naming the bucket."""
    for out in fzero.SimWorld(2).run(_eval_writes, stage, None, trained):
        assert out["error"] is None and out["after"] is None
        assert float(out["weight"].abs().max()) == pytest.approx(0.05)
    for out in fzero.SimWorld(2).run(_eval_writes, stage, torch.bfloat16, trained):
        assert _lost(out["error"]), out["error"]
        assert _lost(out["after"]), out["after"]  # the write is still there: rebuild the state


# --- the field itself ----------------------------------------------------------------------


def _through_a_skipped_step(comm: Any, stage: int) -> dict[str, Any]:
    """float32 parameters under a float16 master: a step on a NaN batch (skipped), then a
    good one. `uncast` before, after each, and the good step's error."""
    model = Clamps()
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=LR),
                       master_dtype=torch.float16)
    step = fzero.make_train_step(model, loss_fn)
    seen = [state.uncast]
    state, metrics = step(state, torch.full((4, 6), float("nan")))
    assert metrics["skipped"]
    seen.append(state.uncast)
    rebuilt = pytree.tree_unflatten(*pytree.tree_flatten(state))
    seen.append(rebuilt.uncast)
    state, error = attempt(step, rebuilt, batch(comm.rank, 1))
    seen.append(state.uncast)
    return {"seen": seen, "error": error}


@pytest.mark.parametrize("stage", STAGES)
def test_uncast_survives_a_skipped_step_and_ends_with_the_first_update(stage: int) -> None:
    """A skipped step (non-finite gradients) updates nothing, so the parameters are still
    init's casts: the state it returns must keep `uncast` (emptied, the good step after it
    raised "written during the step" on parameters nobody wrote), and so must a pytree
    round trip. The first update casts every parameter from its master: empty after it."""
    for out in fzero.SimWorld(2).run(_through_a_skipped_step, stage):
        first, skipped, rebuilt, updated = out["seen"]
        assert [index for index, _ in first] == [0]
        assert skipped == first and rebuilt == first
        assert out["error"] is None and updated == ()


def test_uncast_is_empty_where_the_parameters_are_their_masters_cast() -> None:
    """float32 parameters that are their master (one storage), bfloat16 ones cast from a
    float32 master, and stage 3 (which checks its gathered copies instead): nothing uncast.
    Taking it costs nothing there but one compare."""
    def body(comm: Any) -> list[tuple[tuple[int, int], ...]]:
        model = Clamps()
        return [fzero.init(model, stage=stage, comm=comm, param_dtype=dtype,
                           optimizer=fzero.optim.sgd(lr=LR)).uncast
                for stage in (0, 1, 2, 3) for dtype in (None, torch.bfloat16)]
    for seen in fzero.SimWorld(2).run(body):
        assert seen == [()] * 8


def test_a_state_replaced_by_hand_keeps_its_uncast() -> None:
    """`dataclasses.replace` (e.g. a new loss scale) carries `uncast` over: it describes the
    tensors, which the replacement keeps."""
    def body(comm: Any) -> bool:
        state = fzero.init(Clamps(), stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=LR),
                           master_dtype=torch.float16)
        return dataclasses.replace(state, skipped=0).uncast == state.uncast != ()
    assert fzero.SimWorld(1).run(body) == [True]


# --- writes that reach some ranks only -------------------------------------------------------


def _one_rank_writes(comm: Any, stage: int, param_dtype: torch.dtype | None,
                     where: str) -> dict[str, Any]:
    """Rank 0 alone fills ``a.bias`` with 7 through ``.data`` (in bucket 'a', whose last
    elements lie in the last rank's part), in a train step's forward or in an eval step
    before it; the train step's error, whether no update was applied, and whether the save
    after it was refused."""
    model = Clamps()
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=LR),
                       param_dtype=param_dtype)
    x = batch(comm.rank, 0, param_dtype or torch.float32)
    write = (lambda m: m.a.bias.data.fill_(7.0)) if comm.rank == 0 else None
    if where == "eval":
        model.clamp = write
        fzero.make_eval_step(model, lambda call, b: call(b))(state, x)
        model.clamp = None
    else:
        model.clamp = write
    before = fzero.full_params(state, master=True)
    _, error = attempt(fzero.make_train_step(model, loss_fn), state, x)
    after = fzero.full_params(state, master=True)
    refused = None
    try:
        fzero.save(state, "unused")  # a collective: every rank refuses
    except fzero.checkpoint.CheckpointError as exc:
        refused = str(exc)
    # No update: every other parameter as it was (a.bias holds the write where the
    # parameters are the master copy).
    unchanged = all(torch.equal(after[n], v) for n, v in before.items() if n != "a.bias")
    return {"error": error, "unchanged": unchanged, "refused": refused}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("where", ["train", "eval"])
def test_a_write_that_reaches_some_ranks_only_raises_on_every_rank(
        stage: int, param_dtype: torch.dtype | None, where: str, tmp_path, monkeypatch) -> None:
    """Every rank holds the full parameters at stages 0-2, and the master check reads only
    its own part: a write through ``.data`` on some ranks only (one that depends on the batch,
    or an eval step run on rank 0 alone) into another rank's part was dropped by the update
    (stages 1-2 gather each part from its owner; a bfloat16 rank's own master lacks it too)
    or trained each rank on its own values (stage 0, float32), silently (a probe). The ranks
    now compare a fingerprint of their full parameters in the step's statistics round: every
    rank raises before any update, naming the ranks that differ, and `fzero.save` of such a
    state refuses on every rank instead of storing part of the write as trained state."""
    monkeypatch.chdir(tmp_path)
    for world in (2, 3):
        for out in fzero.SimWorld(world).run(_one_rank_writes, stage, param_dtype, where):
            assert out["error"] is not None, out
            assert ("differ from rank 0's" in out["error"]
                    or "were written during" in out["error"]), out["error"]
            assert out["unchanged"]
            assert out["refused"] is not None and "nothing was written" in out["refused"]
            assert "a write outside a train step" in out["refused"], out["refused"]
            assert "rank(s) []" not in out["refused"], out["refused"]  # only what applies
    assert not list(tmp_path.iterdir())


def _save_after_an_error(comm: Any, stage: int, path: str) -> dict[str, Any]:
    """A first step clamping through ``.data`` raises (bfloat16 parameters, float32 master);
    then a save of that state."""
    model = Clamps()
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=LR),
                       param_dtype=torch.bfloat16)
    model.clamp = lambda m: m.a.weight.data.clamp_(-0.05, 0.05)
    _, error = attempt(fzero.make_train_step(model, loss_fn), state,
                       batch(comm.rank, 0, torch.bfloat16))
    try:
        fzero.save(state, path)
        refused = None
    except fzero.checkpoint.CheckpointError as exc:
        refused = str(exc)
    return {"error": error, "refused": refused}


@pytest.mark.parametrize("stage", STAGES)
def test_a_save_after_a_lost_write_error_refuses(stage: int, tmp_path) -> None:
    """A step that raised "written during the step" leaves the write in the parameters, apart
    from the master copy. A save then stored both, and `fzero.load` took the difference for
    its own cast (`ShardState.uncast`): the next step trained on and dropped the write,
    silently (a probe). `fzero.save` now refuses such a state on every rank, writing
    nothing."""
    path = tmp_path / "ckpt"
    for out in fzero.SimWorld(2).run(_save_after_an_error, stage, str(path)):
        assert _lost(out["error"])
        assert out["refused"] is not None and "apart from their master" in out["refused"]
        assert "['a..b']" in out["refused"]
    assert not path.exists()


def _float64_flip(comm: Any, stage: int, count: int) -> str | None:
    """A float64 model under a float32 master (its buckets `uncast` at init): a first step
    negating `count` weights through ``.data``; its error."""
    model = Clamps(torch.float64)
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.0),
                       master_dtype=torch.float32)
    assert [index for index, _ in state.uncast] == [0]
    model.clamp = lambda m: m.a.weight.data.view(-1)[:count].neg_()
    return attempt(fzero.make_train_step(model, loss_fn), state,
                   batch(comm.rank, 0, torch.float64))[1]


@pytest.mark.parametrize("stage", STAGES)
def test_even_sign_flips_of_float64_parameters_are_seen_before_the_first_update(
        stage: int) -> None:
    """The first checksum summed raw bit patterns times odd weights: a float64 sign flip adds
    2**63, and two of them 2**64 = 0, so negating an even number of weights in a `uncast`
    bucket went unseen and the update dropped it (a probe). The checksum mixes each pattern
    first: any count raises."""
    for count in (1, 2, 4, 36):
        for error in fzero.SimWorld(1).run(_float64_flip, stage, count):
            assert _lost(error), (count, error)


class RunningCentre(nn.Module):
    """A Linear layer and a frozen parameter its forward moves toward the batch's mean
    through ``.data`` (a running statistic kept as a Parameter, not a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 2)
        self.centre = nn.Parameter(torch.zeros(6), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:  # (B, 6) -> (B, 2)
        self.centre.data.mul_(0.9).add_(0.1 * x.mean(0))
        return self.a(x - self.centre)


def test_a_frozen_parameter_each_rank_moves_on_its_own_raises_naming_buffers() -> None:
    """A frozen parameter written per rank through ``.data`` (each rank's batch mean) differs
    between ranks after forward: under DDP each rank would keep its own, under fzero the
    ranks compute with different values and a checkpoint keeps one rank's part of each.
    Every rank raises and the message points to a buffer with ``buffers='local'``, which is
    what such a per-rank value is."""
    def body(comm: Any, stage: int) -> str | None:
        model = RunningCentre()
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=LR))
        return attempt(fzero.make_train_step(model, loss_fn), state, batch(comm.rank, 0))[1]
    for stage in STAGES:
        for error in fzero.SimWorld(2).run(body, stage):
            assert error is not None and "differ from rank 0's" in error
            assert "buffers='local'" in error


class Wide(nn.Module):
    """One 64 x 64 Linear layer (32 blocks of the fingerprint); forward calls `write` on
    itself when it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 6)
        self.b = nn.Linear(6, 2)
        self.write: Any = None

    def forward(self, x: Tensor) -> Tensor:  # (B, 6) -> (B, 2)
        if self.write is not None:
            self.write(self)
        return self.b(torch.tanh(self.a(torch.cat([x] * 11, 1)[:, :64])))


@pytest.mark.parametrize("stage", STAGES)
def test_a_permutation_on_some_ranks_only_raises(stage: int) -> None:
    """Rank 0 alone rolls a weight's rows through ``.data`` (a permutation of its own values,
    spanning both ranks' parts): a plain sum of the parameters' words did not change, so the
    ranks' fingerprints agreed and the write went unseen on rank 1 (the update then kept
    rank 0's rolled part only, or stage 0 trained each rank on its own values). The
    fingerprint weights 512-byte blocks by their position: every rank raises."""
    def body(comm: Any) -> str | None:
        gen = torch.Generator().manual_seed(0)  # SimWorld's ranks share torch's global one
        model = Wide()
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen))
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=LR))
        if comm.rank == 0:
            model.write = lambda m: m.a.weight.data.copy_(m.a.weight.data.roll(1, 0))
        return attempt(fzero.make_train_step(model, loss_fn), state, batch(comm.rank, 0))[1]
    for error in fzero.SimWorld(2).run(body):
        assert error is not None and "differ from rank 0's" in error, error
