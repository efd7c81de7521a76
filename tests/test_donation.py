"""`step` consumes (donates) its input state: reusing it raises, naming the step that consumed
it; `fzero.clone_state` keeps a copy on purpose, views of one storage staying views."""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch

import fzero

import guarantee_bodies as gb

STAGES = (0, 1, 2, 3)


@pytest.mark.parametrize("stage", STAGES)
def test_consumed_state_raises_and_a_clone_keeps_the_old_values(stage: int) -> None:
    model = gb.MLP64()
    data = gb.mse_batches(2)
    out = fzero.SimWorld(2).run(gb.donation_body, model, data, stage=stage)[0]
    for what in ("step", "full_params", "clone_state"):
        error = out["errors"][what]
        assert error["type"] == "ValueError", what
        assert "consumed by train step 1" in error["message"] and "clone_state" in (
            error["message"])
    assert "consumed by train step 2" in out["errors"]["full_params of step 1's state"][
        "message"]
    assert out["kept_unchanged"] and out["kept_step"] == 0
    two = gb.reference(model, gb.mse_loss, data)
    one = gb.reference(model, gb.mse_loss, data[:1])
    gb.assert_parity({"losses": two.losses, "params": out["trained"]}, two)
    gb.assert_parity({"losses": one.losses, "params": out["replayed"]}, one)
    assert out["state2_step"] == 2
    # float64 parameters are their own master copy, in the state and in its clone.
    assert out["sharing"] == ([True] * len(out["sharing"][0]),) * 2


@pytest.mark.parametrize("stage", STAGES)
def test_clone_keeps_separate_master_copies_separate(stage: int) -> None:
    state = fzero.SimWorld(1).run(
        lambda comm: fzero.init(gb.MLP64(dtype=torch.float32), stage=stage, comm=comm,
                                optimizer=fzero.optim.adamw(), param_dtype=torch.bfloat16))[0]
    kept = fzero.clone_state(state)
    for s in (state, kept):
        assert not any(gb.storage_sharing(s))
    for a, b in zip(state.master, kept.master, strict=True):
        assert torch.equal(a, b) and a.untyped_storage().data_ptr() != (
            b.untyped_storage().data_ptr())


def test_pytree_copy_is_live_but_the_consumed_state_is_not() -> None:
    """A tree_map copy made before a step is a fresh, live state (its own lease)."""
    import torch.utils._pytree as pytree

    def body(comm):
        state = fzero.init(gb.MLP64(), stage=1, comm=comm, optimizer=fzero.optim.adamw())
        copy = pytree.tree_map(torch.clone, state)
        step = fzero.make_train_step(gb.MLP64(), gb.mse_loss)
        step(state, gb.mse_batches(1, rows=2)[0])
        fzero.full_params(copy)  # live
        with pytest.raises(ValueError, match="consumed by train step 1"):
            fzero.full_params(state)
        return True

    assert fzero.SimWorld(1).run(body) == [True]


def test_pytree_alias_shares_the_lease() -> None:
    """A state rebuilt over the same tensors (an identity tree_map, or one that copies only
    some of them) shares the lease: after a step consumed either, both raise instead of
    re-applying the step to tensors it already updated. A map over two states still works."""
    import torch.utils._pytree as pytree

    def body(comm):
        model = gb.MLP64()
        step = fzero.make_train_step(model, gb.mse_loss)
        batch = gb.mse_batches(1, rows=2)[0]
        errors = []
        for consume in ("original", "alias", "partial"):
            state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.adamw())
            if consume == "partial":  # new moments, the same parameters: still one state
                ids = {id(t) for t in state.params}
                alias = pytree.tree_map(
                    lambda t, ids=ids: t if id(t) in ids else t.clone(), state)
            else:
                alias = pytree.tree_map(lambda t: t, state)
            used, other = (alias, state) if consume == "alias" else (state, alias)
            new = step(used, batch)[0]
            with pytest.raises(ValueError, match="consumed by train step 1"):
                step(other, batch)
            with pytest.raises(ValueError, match="consumed by train step 1"):
                fzero.full_params(other)
            errors.append(consume)
        difference = pytree.tree_map(torch.sub, new, fzero.clone_state(new))
        assert all(not t.any() for t in pytree.tree_leaves(difference))
        fzero.full_params(difference)  # new tensors: a live state of its own
        return errors

    assert fzero.SimWorld(1).run(body) == [["original", "alias", "partial"]]


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_on_a_module_another_step_runs_on_raises(stage: int) -> None:
    """Two steps at once on one nn.Module object (SimWorld ranks sharing a module from an
    enclosing scope) would each bind their state's tensors into it and read the other's:
    silently wrong, and the module left holding a state's tensor. A step (and an eval step)
    raises while another holds the module; the claim ends with the step, also a failed one."""
    from fzero.bound import claim

    def body(comm):
        model = gb.MLP64()
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        step = fzero.make_train_step(model, gb.mse_loss)
        evaluate = fzero.make_eval_step(model, lambda call, batch: call(batch[0]))
        batch = gb.mse_batches(1, rows=2)[0]
        claims: list = []  # held by another thread, as another rank's step would
        other = threading.Thread(target=lambda: claims.append(claim(model, "another step")))
        other.start()
        other.join()
        for run in (lambda: step(state, batch), lambda: evaluate(state, batch)):
            with pytest.raises(ValueError, match="another step is running on this nn.Module"):
                run()
        claims[0]()
        # a step called inside another's loss_fn, on the same module, in the same thread
        release = claim(model, "the outer step")
        for run in (lambda: step(state, batch), lambda: evaluate(state, batch)):
            with pytest.raises(ValueError, match="already running in this thread .* its own "
                                                 "module: make_eval_step\\(copy.deepcopy"):
                run()
        release()
        with pytest.raises(ValueError, match="no rows"):
            step(state, [t[:0] for t in batch])
        evaluate(state, batch)
        state, _ = step(state, batch)
        return state.step, [key for key in vars(model) if key.startswith("_fzero_step")]

    assert fzero.SimWorld(1).run(body) == [(1, [])]


def test_a_module_copied_during_a_step_trains_in_a_step_of_its_own() -> None:
    """A loss function that deep-copies the module (a teacher or EMA snapshot) copies the key
    the running step set in its ``__dict__``: the copy must not look busy for ever."""
    copies = []

    def loss_fn(call, batch):
        if not copies:
            copies.append(copy.deepcopy(call.__self__))  # call: the module's __call__
        return gb.mse_loss(call, batch)

    def body(comm):
        model = gb.MLP64()
        batch = gb.mse_batches(1, rows=2)[0]
        state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        state, _ = fzero.make_train_step(model, loss_fn)(state, batch)
        twin, = copies
        twin_state = fzero.init(twin, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        twin_state, _ = fzero.make_train_step(twin, gb.mse_loss)(twin_state, batch)
        return state.step, twin_state.step

    assert fzero.SimWorld(1).run(body) == [(1, 1)]


@pytest.mark.parametrize("stage", STAGES)
def test_a_rollback_is_exact_when_the_dropped_state_is_collected_during_the_next_step(stage):
    """Rolling back (`clone_state`, step the original, drop it, step the clone) must give the
    clone's step the same result as the original's. Stage 3's cached full buffers and leaves,
    reused by every state of a layout, were watched through a tensor of the first state they
    served: collected by the cyclic garbage collector in the middle of a step on the clone,
    it dropped the leaves (and their gradient hooks) that step was using, and the clone
    trained wrong by a whole update (found by the fuzzed session: freeze, reload, roll back
    twice). Here the collection is forced inside the loss function."""
    from models import TinyGPT

    def collecting(call, batch):
        gc.collect()  # the dropped state goes now, in the middle of the step
        return torch.nn.functional.cross_entropy(call(batch[0]).flatten(0, 1),
                                                 batch[1].flatten())

    def body(comm, model):
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.adamw(lr=1e-2))
        step = fzero.make_train_step(model, collecting)
        batch = TinyGPT.make_batch(0, 1)
        results = []
        for _ in range(3):
            kept = fzero.clone_state(state)
            after, _ = step(state, batch)
            results.append(fzero.full_params(after))
            cycle = [after]
            cycle.append(cycle)  # only the cyclic collector frees it
            state = kept
            del after, cycle
        return results

    torch.manual_seed(0)
    model = TinyGPT(d_model=8, n_layer=2, n_head=2).double()
    gc.disable()
    try:
        first, *again = fzero.SimWorld(1).run(body, model)[0]
    finally:
        gc.enable()
    for result in again:
        for name, value in first.items():
            assert torch.equal(result[name], value), name


def test_a_watch_callback_in_another_thread_never_drops_the_leaves_a_step_uses():
    """Stages 0-2 watch a state's first tensor to let go of its cached leaves when it dies. The
    cyclic garbage collector runs that callback in whichever thread it collects in: between
    the callback's check and its drop, the stepping thread replaced the leaves, and the drop
    took the new ones, with their gradient hooks: the step updated nothing and called every
    parameter unused (a probe, forcing the interleaving as here: a trace function pauses the
    collecting thread inside the callback after its check)."""
    import inspect
    import sys
    import time

    import fzero.step as fs

    source, first = inspect.getsourcelines(fs._LeafCache.release)
    pause_at = first + next(i for i, line in enumerate(source) if "self.drop()" in line)

    def body(comm, model, race):
        checked, stepping = threading.Event(), threading.Event()

        def tracer(frame, event, arg):
            if frame.f_code is not fs._LeafCache.release.__code__:
                return None

            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == pause_at:
                    checked.set()  # the check passed: the old leaves were the cached ones
                    stepping.wait(1.0)  # preempted here while the rank starts its step
                    time.sleep(0.05)
                return local
            return local

        def collect():
            sys.settrace(tracer)
            gc.collect()
            sys.settrace(None)

        def loss_fn(call, batch):
            if race:
                stepping.set()
                time.sleep(0.3)  # the step goes on while the collecting thread resumes
            return ((call(batch[0]) - batch[1]) ** 2).mean()

        state = fzero.init(model, stage=0, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        step = fzero.make_train_step(model, loss_fn)
        batch = gb.mse_batches(1, rows=4)[0]
        state, _ = step(state, batch)  # leaves cached for the state's tensors
        kept = fzero.clone_state(state)  # go on from a clone (a rollback)
        collector = None
        if race:
            cycle = [state]
            cycle.append(cycle)  # the old state only in a reference cycle
            del state, cycle
            collector = threading.Thread(target=collect)
            collector.start()
            assert checked.wait(5.0), "the watch's callback never ran"
        after, metrics = step(kept, batch)
        if collector is not None:
            collector.join()
        return fzero.full_params(after), metrics["unused"]

    gc.disable()
    try:
        calm, _ = fzero.SimWorld(1).run(body, gb.MLP64(), False)[0]
        raced, unused = fzero.SimWorld(1).run(body, gb.MLP64(), True)[0]
    finally:
        gc.enable()
    assert unused == []
    for name, value in calm.items():
        assert torch.equal(raced[name], value), name


@pytest.mark.parametrize("stage", STAGES)
def test_weights_loaded_through_data_after_init_raise_also_when_a_clone_trains(stage):
    """Weights written into the module through ``.data`` after ``init`` (which bumps no version
    counter) are found by the first step, which compares the module's values with the state
    tensors that took them. Those were held weakly, and a dropped one read as "the state was
    written since": replacing the state with its clone before the first step turned the check
    off, and the clone trained the old values silently (a probe). A clone holds the values as
    much as its original does."""

    def body(comm, model):
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        with torch.no_grad():
            for p in model.parameters():
                p.data.copy_(torch.full_like(p, 0.5))  # "pretrained weights", loaded too late
        state = fzero.clone_state(state)  # the original is dropped
        step = fzero.make_train_step(model, gb.mse_loss)
        # rank 0 compares (every rank's state took rank 0's values); the others learn of it
        expected = "written in place after" if comm.rank == 0 else r"rank\(s\) \[0\]"
        with pytest.raises((ValueError, fzero.StepError), match=expected):
            step(state, gb.mse_batches(1, rows=2)[0])

    fzero.SimWorld(2).run(body, gb.MLP64())


def _interrupted_in_the_update(comm, model, data, stage, monkeypatch_publish) -> dict:
    """One step, then a second interrupted (KeyboardInterrupt) between its optimizer update
    and its return; what the input state of that second step does then."""
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.adamw(lr=1e-2), comm=comm)
    step = fzero.make_train_step(model, gb.mse_loss)
    state, _ = step(state, gb.rank_rows(data[0], comm.rank, comm.world_size))
    monkeypatch_publish()
    try:
        step(state, gb.rank_rows(data[1], comm.rank, comm.world_size))
    except KeyboardInterrupt:
        pass
    errors = {}
    for what, use in (("step", lambda: step(state, data[1])),
                      ("full_params", lambda: fzero.full_params(state))):
        try:
            use()
        except ValueError as error:
            errors[what] = str(error)
    return errors


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_interrupted_after_its_update_leaves_no_live_state(stage, monkeypatch) -> None:
    """Ctrl-C between the optimizer update (in place) and the step's return left the input
    state live, with its old step number: re-running the loop from that batch applied it
    twice, silently (a probe, in a one-rank notebook world). The state is consumed from the
    update's first write on, and using it says the step was interrupted."""
    import fzero.step as step_module

    publish = step_module._publish

    def interrupt_once() -> None:
        def interrupted(*args, **kwargs):
            monkeypatch.setattr(step_module, "_publish", publish)
            raise KeyboardInterrupt

        monkeypatch.setattr(step_module, "_publish", interrupted)

    errors = fzero.SimWorld(1).run(_interrupted_in_the_update, gb.MLP64(), gb.mse_batches(2),
                                   stage, interrupt_once)[0]
    assert sorted(errors) == ["full_params", "step"]
    for message in errors.values():
        assert "train step 2 stopped while it updated" in message and "clone_state" in message


def _buggy_decay(name: str, shape: tuple[int, ...]) -> bool:
    return {"0.weight": True}[name]  # a user's bug: KeyError for every other name


def _step_after_a_failed_check(comm, model, data) -> list[str]:
    state = fzero.init(model, stage=1, optimizer=fzero.optim.adamw(lr=1e-2), comm=comm)
    rows = gb.rank_rows(data[0], comm.rank, comm.world_size)
    outcomes = []
    try:
        fzero.make_train_step(model, gb.mse_loss, decay=_buggy_decay)(state, rows)
    except Exception as error:  # noqa: BLE001
        outcomes.append(type(error).__name__)
    state, _ = fzero.make_train_step(model, gb.mse_loss, decay=fzero.decay_matrices)(state, rows)
    fzero.make_eval_step(model, lambda call, batch: call(batch[0]))(state, rows)
    return outcomes


def test_an_error_of_any_kind_in_a_steps_checks_leaves_the_module_free() -> None:
    """A decay rule raising KeyError (anything but TypeError or ValueError) in a step's checks
    left the module marked as running for ever: every later step or eval on it, from new step
    functions too, raised "already running in this thread" (a probe; a Ctrl-C there too). The
    error reaches every rank, and the module is free for the next step."""
    outs = fzero.SimWorld(2).run(_step_after_a_failed_check, gb.MLP64(), gb.mse_batches(1))
    assert all(out in (["KeyError"], ["StepError"]) for out in outs), outs
    assert ["KeyError"] in outs
