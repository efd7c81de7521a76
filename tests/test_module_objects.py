"""What a module's parameter *objects* carry beyond their values: gradient hooks, Python
attributes, references kept outside the module's registry, complex dtypes.

A step binds the state's tensors under the module's registered names (`functional_call`), so
anything attached to the parameter objects themselves, or reached around the registry, is not
what forward computes with. Each case either behaves as plain torch does or raises, naming the
parameter (a probe found all four silently wrong: hooks never fired, attributes read their
defaults, a parameter held in a list trained stale, complex parameters lost their imaginary
part). Models are built inside each rank's function: `SimWorld.run`'s deep copies are tested
apart (`test_simworld_copies_*`).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero

STAGES = (0, 1, 2, 3)


def _loss(call, x):
    return call(x).pow(2).mean()


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


class Scaled(nn.Module):
    """Reads a Python attribute of its parameter in forward (getattr with a default)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Linear(4, 4).double()
        self.h = nn.Linear(4, 1).double()
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        self.a.weight.scale = 2.0

    def forward(self, x):
        return self.h(torch.tanh(getattr(self.a.weight, "scale", 1.0) * self.a(x)))


class Listed(nn.Module):
    """Holds `b.weight` in a plain list too, and reads it from there in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 4).double()
        self.h = nn.Linear(4, 1).double()
        self.held = [self.b.weight]

    def forward(self, x):
        return self.h(torch.tanh(self.a(x)) + x @ self.held[0].T)


def _torch_sgd(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        opt.zero_grad()
        _loss(model, _batch(i)).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _rows(comm, x):
    per = x.shape[0] // comm.world_size
    return x[comm.rank * per:(comm.rank + 1) * per]


def _losses_of_one_step(prepare, stage: int) -> list[float]:
    """Each of 2 ranks' loss of one step on a `Scaled` model that `prepare(model)` changed
    before `fzero.init`."""

    def body(comm):
        model = Scaled()
        prepare(model)
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        state, metrics = fzero.make_train_step(model, _loss)(state, _rows(comm, _batch()))
        return metrics["loss"]

    return fzero.SimWorld(2).run(body)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["register_hook", "post_accumulate"])
def test_a_gradient_hook_on_a_parameter_object_raises_before_anything_moves(stage, kind):
    def body(comm):
        model = Scaled()
        if kind == "register_hook":
            model.a.weight.register_hook(lambda g: g * 3)
        else:
            model.a.weight.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(3))
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        before = fzero.full_params(state)
        step = fzero.make_train_step(model, _loss)
        with pytest.raises(ValueError, match=r"\['a.weight'\] carry gradient hooks"):
            step(state, _rows(comm, _batch()))
        after = fzero.full_params(state)  # the state was not consumed: nothing moved
        assert all(torch.equal(before[n], after[n]) for n in before)
        # an eval step computes no gradient: the hook is irrelevant there
        out = fzero.make_eval_step(model, lambda call, x: call(x))(state, _batch())
        assert out.shape == (6, 1)

    fzero.SimWorld(2).run(body)


def test_a_gradient_hook_on_a_frozen_parameter_is_no_reason_to_raise():
    """A frozen parameter receives no gradient, in torch as in fzero: its hook never fires
    either way."""

    def frozen_after_a_hook(model):
        model.a.weight.register_hook(lambda g: g * 3)
        model.a.weight.requires_grad_(False)

    assert all(loss > 0 for loss in _losses_of_one_step(frozen_after_a_hook, stage=3))


@pytest.mark.parametrize("stage", STAGES)
def test_a_parameters_python_attributes_are_seen_in_forward(stage):
    """`getattr(self.a.weight, "scale", 1.0)` read the default: the bound tensor is not the
    parameter object. The attribute is carried onto it, in train and eval steps, and training
    matches torch.optim."""
    want = _torch_sgd(Scaled(), 3)
    want_out = Scaled()(_batch(9))

    def body(comm):
        model = Scaled()
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        evaluate = fzero.make_eval_step(model, lambda call, x: call(x))
        first = evaluate(state, _batch(9))
        step = fzero.make_train_step(model, _loss)
        for i in range(3):
            state, _ = step(state, _rows(comm, _batch(i)))
        return first, fzero.full_params(state)

    for first, got in fzero.SimWorld(3).run(body):
        torch.testing.assert_close(first, want_out, rtol=0, atol=1e-15)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12)


@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_held_in_a_list_attribute_trains_as_in_torch(stage):
    """Forward read `self.held[0]`, the module's own `b.weight`: a step bound the registered
    names only, so training computed with stale values and lost that gradient (it raised,
    from the gradient left on the module's own object; an eval step, a frozen parameter or a
    buffer held so read stale values silently). A step now binds such references too (an
    attribute, or an item of a list, tuple or dict in one): training and evaluation equal
    torch's, and the list holds the module's own object again afterwards."""
    torch.manual_seed(0)
    want = _torch_sgd(copy.deepcopy(model := Listed()), 3)
    want_out = Listed.forward(copy.deepcopy(model), _batch(9))

    def body(comm, model):
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        evaluate = fzero.make_eval_step(model, lambda call, x: call(x))
        first = evaluate(state, _batch(9))
        step = fzero.make_train_step(model, _loss)
        for i in range(3):
            state, _ = step(state, _rows(comm, _batch(i)))
        return first, fzero.full_params(state), model.held[0] is model.b.weight

    for first, got, restored in fzero.SimWorld(2).run(body, model):
        torch.testing.assert_close(first, want_out, rtol=0, atol=1e-15)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12)
        assert restored


class Closed(Listed):
    """Reads `b.weight` through a closure made in ``__init__``: nothing a step can rebind."""

    def __init__(self) -> None:
        super().__init__()
        weight = self.b.weight
        self.read = lambda: weight

    def forward(self, x):
        return self.h(torch.tanh(self.a(x)) + x @ self.read().T)


@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_reached_through_a_closure_raises(stage):
    """A closure's captured parameter stays the module's own object (stale values): the
    gradient autograd leaves on it gives it away; every rank raises before the update."""

    def body(comm):
        model = Closed()  # here: a deep copy would keep the closure's original parameter
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        before = fzero.full_params(state)
        step = fzero.make_train_step(model, _loss)
        with pytest.raises((ValueError, fzero.StepError), match="b.weight"):
            step(state, _rows(comm, _batch()))
        after = fzero.full_params(state)
        assert all(torch.equal(before[n], after[n]) for n in before)

    fzero.SimWorld(2).run(body)


def test_a_module_parameter_with_an_old_gradient_is_not_mistaken_for_one_reached():
    """A `.grad` the module's parameters held before the step (a plain backward earlier) is
    not a sign of anything: only a gradient set or written during the step is."""

    def with_gradients(model):
        _loss(model, _batch(5)).backward()  # every parameter holds a .grad now

    assert all(loss > 0 for loss in _losses_of_one_step(with_gradients, stage=1))


@pytest.mark.parametrize("stage", STAGES)
def test_a_trainable_complex_parameter_raises_and_a_frozen_one_is_stored_exactly(stage):
    """A complex parameter trained through the real master copy lost its imaginary part
    (torch.optim trains it as its real view). Frozen, it is only stored and gathered."""

    class Rotor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(1)
            self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex128, generator=gen))
            self.h = nn.Linear(4, 1).double()

        def forward(self, x):
            return self.h((x.to(self.w.dtype) @ self.w).abs())

    def body(comm):
        with pytest.raises(TypeError, match=r"\['w'\] are complex"):
            fzero.init(Rotor(), stage=stage, comm=comm, optimizer=fzero.optim.adamw())
        model = Rotor()
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1),
                           trainable=lambda name: name != "w")
        state, _ = fzero.make_train_step(model, _loss)(state, _rows(comm, _batch()))
        return fzero.full_params(state)["w"]

    for w in fzero.SimWorld(2).run(body):
        assert torch.equal(w, Rotor().w.detach())


def test_simworld_copies_refuse_gradient_hooks_and_keep_attributes():
    """`SimWorld.run` deep-copies its arguments per rank, and torch's deep copy of a parameter
    keeps neither its hooks nor its Python attributes: the ranks trained without them. Hooks
    raise, naming the parameter; attributes are copied."""
    hooked = Scaled()
    hooked.a.weight.register_hook(lambda g: g)
    with pytest.raises(ValueError, match=r"'a.weight' of argument 0 would not carry the "
                                         r"gradient hooks"):
        fzero.SimWorld(2).run(lambda comm, model: None, hooked)
    assert fzero.SimWorld(2).run(lambda comm, model: model.a.weight.scale, Scaled()) == [2.0, 2.0]
    shared = fzero.SimWorld(2, copy_args=False).run(lambda comm, model: id(model), hooked)
    assert shared == [id(hooked)] * 2



class Renormed(nn.Module):
    """Replaces its weight's data in forward (a max-norm constraint written `w.data = ...`), or
    converts a submodule (`self.lin.to(dtype)`, as Hugging Face's SwitchTransformers router
    does on every call), when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1).double()
        gen = torch.Generator().manual_seed(2)
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        self.mode = "none"

    def forward(self, x):
        with torch.no_grad():
            if self.mode == "data":
                self.lin.weight.data = self.lin.weight.data.renorm(2, 0, 0.5)
            elif self.mode == "to":
                self.lin.to(torch.float32)
            elif self.mode == "to-own-dtype":  # a no-op conversion
                self.lin.to(torch.float64)
            elif self.mode == "share":  # moves each storage's bytes in place
                self.share_memory()
        return self.lin(x.to(self.lin.weight.dtype)).double()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", ["data", "to"])
def test_forward_that_gives_a_parameter_new_data_raises_and_the_next_step_is_exact(
        stage, mode):
    """`w.data = w.data.renorm(...)` or `module.to(dtype)` in forward detached the cached tensor
    a step binds from the state's memory: the new values were lost, and every later step read
    the first step's values (a probe; Hugging Face's SwitchTransformers router in bfloat16
    never trained at stages 0-1). Every rank raises before the update, and a step after it
    (the forward fixed) trains exactly, on tensors bound afresh."""
    _raises_then_trains_exactly(Renormed, stage, r"replaced the data of parameters \['lin.weight'",
                                switch="mode", bad=mode, fixed="to-own-dtype")


@pytest.fixture
def overwrite_on_conversion():
    """torch's process-wide switch that makes `module.to()` replace parameter objects."""
    was = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    yield
    torch.__future__.set_overwrite_module_params_on_conversion(was)


@pytest.mark.parametrize("stage", STAGES)
def test_a_conversion_in_forward_under_overwrite_on_conversion_is_explained(
        stage, overwrite_on_conversion):
    """With `torch.__future__.set_overwrite_module_params_on_conversion(True)`, `module.to()`
    in forward asserts that every parameter is an nn.Parameter, and the step's bound tensors
    are not: torch's bare AssertionError "param must be a Parameter" came out at every stage.
    It is now a RuntimeError naming the switch and the fixes; the state is unchanged and the
    next steps, without the conversion, train exactly."""
    _raises_then_trains_exactly(Renormed, stage, r"set_overwrite_module_params_on_conversion"
                                r"\(True\) is set", switch="mode", bad="to", fixed="none")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", ["data", "to"])
def test_an_eval_forward_that_gives_a_parameter_new_data_raises(stage, mode):
    """In an eval step too: torch's module keeps the data its forward gave a parameter, and
    later steps use it; the state never saw it (stages 0-2 bind fresh views per eval, and
    said nothing). Every rank raises; the state is unchanged and a fixed forward evaluates."""

    def body(comm):
        model = Renormed()
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        before = fzero.full_params(state)
        evaluate = fzero.make_eval_step(model, _loss)
        model.mode = mode
        with pytest.raises(ValueError, match=r"replaced the data of parameters \['lin.weight'"):
            evaluate(state, _rows(comm, _batch()))
        model.mode = "to-own-dtype"
        loss = evaluate(state, _rows(comm, _batch()))
        after = fzero.full_params(state)
        assert all(torch.equal(before[n], after[n]) for n in before)
        return float(loss)

    losses = fzero.SimWorld(2).run(body)
    assert all(loss > 0 for loss in losses)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_forward_that_moves_parameters_to_shared_memory_replaces_nothing(stage):
    """``share_memory()`` in forward moves each storage's bytes into shared memory in place:
    the tensors a step binds still view the state's storage, at a new address. Stages 0-2
    compared addresses and raised "replaced the data" in every train and eval step (a
    probe). Two train steps equal torch's SGD with the same forward, and an eval after them
    its loss."""
    reference = Renormed()
    reference.mode = "share"
    want = _torch_sgd(reference, 2)
    want_loss = float(_loss(reference, _batch(5)).detach())

    def body(comm):
        model = Renormed()
        model.mode = "share"
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        step = fzero.make_train_step(model, _loss)
        for i in range(2):
            state, _ = step(state, _rows(comm, _batch(i)))
        loss = fzero.make_eval_step(model, _loss)(state, _batch(5))
        return fzero.full_params(state), float(loss)

    for got, loss in fzero.SimWorld(2).run(body):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12)
        assert loss == pytest.approx(want_loss, rel=1e-12)


def test_stage_3_refuses_a_forward_that_moves_parameters_to_shared_memory():
    """At stage 3 ``share_memory()`` in forward moved a gathered bucket's storage into shared
    memory, which stage 3 then freed (resized to 0) and allocated again: the process died of
    a segmentation fault in the next step (torch cannot resize a shared storage back; a
    probe). Every rank raises instead, in train and eval steps, and the state is unchanged;
    with the call dropped, steps train exactly."""
    _raises_then_trains_exactly(Renormed, 3, "moved bucket .* into shared memory",
                                switch="mode", bad="share", fixed="none")

    def body(comm):
        model = Renormed()
        state = fzero.init(model, stage=3, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        model.mode = "share"
        with pytest.raises((RuntimeError, fzero.StepError), match="shared memory"):
            fzero.make_eval_step(model, _loss)(state, _batch(5))
        model.mode = "none"
        return float(fzero.make_eval_step(model, _loss)(state, _batch(5)))

    want = float(_loss(Renormed(), _batch(5)).detach())
    for loss in fzero.SimWorld(2).run(body):
        assert loss == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("stage", STAGES)
def test_an_eval_step_whose_forward_updates_a_buffer_raises(stage, mode):
    """An eval step whose forward updates a buffer in place (BatchNorm left in train mode
    counts its batches and moves its running statistics): torch's module keeps the update,
    and the eval step, which changes no state, dropped it silently (a probe; before that,
    stage 3 under ``torch.inference_mode()`` raised torch's "Inplace update to inference
    tensor"). It raises now, naming the buffers, under inference mode too, the state as it
    was; after ``model.eval()`` the output equals torch's in eval mode."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    with torch.no_grad():
        want = copy.deepcopy(model).eval()(x)
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad

    def body(comm, model):
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        before = {name: b.clone() for name, b in state.buffers.items()}
        evaluate = fzero.make_eval_step(model, lambda call, b: call(b))
        with context(), pytest.raises(ValueError, match=(
                r"changed buffer\(s\) \['1.running_mean', '1.running_var', '1.num_batches")):
            evaluate(state, x)
        assert all(torch.equal(state.buffers[n], b) for n, b in before.items())
        model.eval()
        with context():
            out = evaluate(state, x)
        return out.clone()

    for out in fzero.SimWorld(2).run(body, model):
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


class _Counting(nn.Module):
    """Counts its calls by reassigning a buffer (``self.calls = self.calls + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2).double()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls = self.calls + 1
        return self.lin(x)


@pytest.mark.parametrize("stage", STAGES)
def test_an_eval_step_whose_forward_reassigns_a_buffer_raises(stage):
    """A buffer reassigned in forward is kept by a train step (torch's module keeps the new
    tensor); an eval step dropped it silently. It raises, naming it."""

    def body(comm):
        model = _Counting()
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        with pytest.raises(ValueError, match=r"changed buffer\(s\) \['calls'\]"):
            fzero.make_eval_step(model, lambda call, b: call(b))(state, torch.ones(3, 4,
                                                                              dtype=torch.float64))
        return int(state.buffers["calls"])

    assert fzero.SimWorld(2).run(body) == [0, 0]


def _raises_then_trains_exactly(build, stage: int, match: str, *, switch: str = "",
                                bad: str = "", fixed: str = "", failing_loss=_loss) -> None:
    """On 2 ranks, a step with `failing_loss` on a `build()` model whose attribute `switch`
    (if any) is `bad` raises (`match`) before the update, the state unchanged; with `switch`
    set to `fixed`, two steps train exactly as torch's SGD on the same model."""
    want = _torch_sgd(build(), 2)

    def body(comm):
        model = build()
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        before = fzero.full_params(state)
        if switch:
            setattr(model, switch, bad)
        with pytest.raises((ValueError, RuntimeError, fzero.StepError), match=match):
            fzero.make_train_step(model, failing_loss)(state, _rows(comm, _batch()))
        after = fzero.full_params(state)
        assert all(torch.equal(before[n], after[n]) for n in before)
        if switch:
            setattr(model, switch, fixed)
        step = fzero.make_train_step(model, _loss)
        for i in range(2):
            state, _ = step(state, _rows(comm, _batch(i)))
        return fzero.full_params(state)

    for got in fzero.SimWorld(2).run(body):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12)


class Freezing(nn.Module):
    """Freezes its first layer in forward when told to: after using it (``"after"``), or
    before (``"before"``): progressive freezing written inside the model."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.a = nn.Linear(4, 4).double()
        self.h = nn.Linear(4, 1).double()
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        self.freeze = "never"

    def forward(self, x):
        if self.freeze == "before":
            self.a.weight.requires_grad_(False)
        out = self.h(torch.tanh(self.a(x)))
        if self.freeze == "after":
            self.a.weight.requires_grad_(False)
        return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("when", ["after", "before"])
def test_forward_that_freezes_a_parameter_raises_and_the_next_step_is_exact(stage, when):
    """``requires_grad_(False)`` in forward acts on the tensor a step binds, not on the state:
    frozen after its use, torch leaves its gradient None and AdamW skips it, but fzero's
    gradient hook still fired and the update applied weight decay and stale moments to it
    (silently 8e-3 off torch, a probe); frozen before its use, the cached bound tensor stayed
    frozen until the next rebuild (a clone, a load) unfroze it. Every rank raises before the
    update, and a step after it (the forward fixed) trains exactly, on tensors bound afresh."""
    _raises_then_trains_exactly(Freezing, stage,
                                r"changed requires_grad of parameters \['a.weight'\]",
                                switch="freeze", bad=when, fixed="never")


def _backward_then_loss(call, x):
    """Runs backward itself and returns the loss (as a single-process loop would)."""
    loss = _loss(call, x)
    loss.backward(retain_graph=True)
    return loss


@pytest.mark.parametrize("stage", STAGES)
def test_a_backward_pass_inside_loss_fn_raises_and_the_next_step_is_exact(stage):
    """``loss.backward()`` inside loss_fn accumulated gradients in the middle of forward:
    stages 0-2 raised a message about reentrant checkpointing (the second accumulation), stage
    3 "a Reducer's order can change only between rounds" (a probe). Every rank raises, naming
    the first parameter and the fix, before anything moves; the next step is exact."""
    _raises_then_trains_exactly(Scaled, stage, "received a gradient outside the step's backward",
                                failing_loss=_backward_then_loss)


@pytest.mark.parametrize("stage", STAGES)
def test_a_module_left_holding_bound_tensors_by_an_interrupt_says_so(stage, monkeypatch):
    """Ctrl-C inside functional_call's swap (torch undoes a partial swap on an Exception, not
    on KeyboardInterrupt) left the step's leaves in the module: every later step raised that
    its parameters "carry gradient hooks", which the user never registered (a probe). The
    error says what happened and what to do; a new module trains on the same state."""
    from torch.nn.utils import _named_member_accessor as accessor

    swap, calls = accessor.swap_tensor, [0]

    def interrupted_swap(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # one parameter swapped in, then the interrupt
            raise KeyboardInterrupt
        return swap(*args, **kwargs)

    def body(comm):
        model = Scaled()
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        step = fzero.make_train_step(model, _loss)
        state, _ = step(state, _batch())
        monkeypatch.setattr(accessor, "swap_tensor", interrupted_swap)
        with pytest.raises(KeyboardInterrupt):
            step(state, _batch(1))
        monkeypatch.setattr(accessor, "swap_tensor", swap)
        with pytest.raises(ValueError, match="a step on it was interrupted"):
            step(state, _batch(1))
        fresh = Scaled()
        state, _ = fzero.make_train_step(fresh, _loss)(state, _batch(1))
        return fzero.full_params(state)

    got = fzero.SimWorld(1).run(body)[0]
    for name, value in _torch_sgd(Scaled(), 2).items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12)


# --- references a step binds besides the registered names ----------------------------------


class HeldElsewhere(nn.Module):
    """A buffer held in a list and updated in place in forward, a frozen parameter held in a
    dict, and `b.weight` cached by forward on its first call (``self._w = self.b.weight``):
    in torch each is the live tensor."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 4).double()
        self.h = nn.Linear(4, 1).double()
        self.emb = nn.Parameter(torch.zeros(4, dtype=torch.float64), requires_grad=False)
        self.register_buffer("gain", torch.ones(4, dtype=torch.float64))
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64))
        self._bufs = [self.gain]
        self._frozen = {"emb": self.emb}
        self._scaled = (0.5, self.gain)  # a tuple is replaced whole (it is immutable)
        self._w: torch.Tensor | None = None

    def forward(self, x):
        if self._w is None:
            self._w = self.b.weight
        if self.training:
            self.gain.mul_(0.9)
        hidden = torch.tanh(self.a(x) + self._frozen["emb"]) * self._bufs[0]
        hidden = hidden + self._scaled[0] * self._scaled[1]
        return self.h(torch.tanh(torch.nn.functional.linear(hidden, self._w, self.b.bias)))


def _torch_momentum(model: nn.Module, batches: list[int], rollback_after: int | None):
    """Torch SGD with momentum over `batches`; with `rollback_after`, the model and optimizer
    go back to their copy taken after that many steps, before the next batch."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    losses, backup = [], None
    for index, seed in enumerate(batches):
        if index == rollback_after:
            backup = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        if index == (rollback_after or 0) + 1 and backup is not None:
            model.load_state_dict(backup[0])
            opt.load_state_dict(backup[1])
        opt.zero_grad()
        loss = _loss(model, _batch(seed))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    # (torch registered the cache as a second name of b.weight: all names, for comparing)
    return losses, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("stage", STAGES)
def test_references_held_outside_the_registry_read_the_state(stage, tmp_path):
    """Each of `HeldElsewhere`'s references read the module's own tensor while a step bound
    the registered names only: the buffer's in-place updates were lost, the frozen parameter
    read the fresh module's values after a load, and the cache kept the tensor of the step
    that filled it (an eval step's, or a state's dropped by a rollback), so `b.weight` never
    trained. All silent (a probe). Now: an eval step first, a checkpoint loaded into a fresh
    module, a rollback, and every loss and parameter equals torch's."""
    path = str(tmp_path / "ckpt")
    model = HeldElsewhere()
    want_eval = copy.deepcopy(model).eval()(_batch(9)).detach()
    # torch: steps on batches 0, 1 (a clone after the first), rollback, then 2, 3
    want_losses, want = _torch_momentum(copy.deepcopy(model), [0, 1, 2, 3], rollback_after=1)

    def body(comm, model):
        state = fzero.init(model, stage=stage, comm=comm,
                           optimizer=fzero.optim.sgd(lr=0.1, momentum=0.9))
        model.eval()
        first = fzero.make_eval_step(model, lambda call, x: call(x))(state, _batch(9))
        model.train()
        fzero.save(state, path)
        fresh = HeldElsewhere()
        with torch.no_grad():
            fresh.emb.add_(5.0)  # not the checkpoint's: a stale read would show
        state = fzero.load(path, model=fresh, comm=comm)
        step = fzero.make_train_step(fresh, _loss)
        losses = []
        state, metrics = step(state, _batch(0))
        losses.append(metrics["loss"])
        backup = fzero.clone_state(state)
        state, metrics = step(state, _batch(1))
        losses.append(metrics["loss"])
        state = backup
        for seed in (2, 3):
            state, metrics = step(state, _batch(seed))
            losses.append(metrics["loss"])
        # afterwards the module holds its own tensors again, as torch's would
        assert fresh._bufs[0] is fresh.gain and fresh._scaled[1] is fresh.gain
        assert fresh._frozen["emb"] is fresh.emb and fresh._w is fresh.b.weight
        return first, losses, fzero.full_params(state)

    (first, losses, got), = fzero.SimWorld(1).run(body, model)
    torch.testing.assert_close(first, want_eval, rtol=0, atol=1e-15)
    assert losses == pytest.approx(want_losses, rel=1e-12)
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=1e-12)


def _spectral() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    torch.nn.utils.parametrizations.spectral_norm(model[0])
    return model


@pytest.mark.parametrize("stage", STAGES)
def test_an_eval_step_refuses_spectral_norms_power_iteration_in_training_mode(stage):
    """spectral_norm's power iteration updates its ``_u`` and ``_v`` buffers in every forward
    in training mode; an eval step dropped the update, and the next train steps started from
    other vectors than torch's (1.4e-3 off after 4 steps, a probe). It raises now; in eval mode
    the steps and the evaluation equal torch's (SGD with momentum, float64)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 5, generator=g, dtype=torch.float64),
             torch.randn(6, 3, generator=g, dtype=torch.float64)) for _ in range(3)]
    model = _spectral()  # (built here: its _u draws from torch's global generator)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        (reference(x) - y).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():
        want = reference.eval()(data[0][0])

    def loss(call, batch):
        x, y = batch
        return (call(x) - y).pow(2).mean()

    def body(comm, model):
        state = fzero.init(model, stage=stage, comm=comm,
                           optimizer=fzero.optim.sgd(lr=0.1, momentum=0.9))
        step = fzero.make_train_step(model, loss)
        evaluate = fzero.make_eval_step(model, lambda call, x: call(x))
        for x, y in data:
            state, _ = step(state, (x[comm.rank * 3 : comm.rank * 3 + 3],
                                    y[comm.rank * 3 : comm.rank * 3 + 3]))
        with pytest.raises(ValueError, match=r"changed buffer\(s\) \['0.parametrizations"):
            evaluate(state, data[0][0])
        model.eval()
        return evaluate(state, data[0][0]).clone()

    for got in fzero.SimWorld(2).run(body, model):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


class _TieInForward(nn.Module):
    """Ties its head to its embedding in forward, as some code does on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6).double()
        self.head = nn.Linear(6, 12, bias=False).double()

    def forward(self, idx):
        self.head.weight = self.emb.weight
        return self.head(torch.tanh(self.emb(idx)))


@pytest.mark.parametrize("stage", STAGES)
def test_tying_weights_in_forward_raises_naming_the_parameter_and_the_fix(stage):
    """A tie made in forward (``self.head.weight = self.emb.weight``) raised torch's bare
    "cannot assign 'torch.DoubleTensor' as parameter 'weight'" (a probe): it names the
    parameter and the fix now, nothing updated."""
    idx = torch.randint(0, 12, (4, 5), generator=torch.Generator().manual_seed(0))

    def loss(call, batch):
        logits = call(batch)
        return F.cross_entropy(logits[:, :-1].reshape(-1, 12), batch[:, 1:].reshape(-1))

    def body(comm):
        model = _TieInForward()
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        before = fzero.full_params(state)
        with pytest.raises((ValueError, fzero.StepError), match=r"parameter 'head\.weight'"):
            fzero.make_train_step(model, loss)(state, idx)
        after = fzero.full_params(state)
        assert all(torch.equal(before[n], after[n]) for n in before)

    fzero.SimWorld(2).run(body)


class _ParametrizedRNN(nn.Module):
    """An LSTM or GRU whose recurrent weight is weight-normalized (a parametrization)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.r = {"lstm": nn.LSTM, "gru": nn.GRU}[kind](8, 6, batch_first=True).double()
        torch.nn.utils.parametrizations.weight_norm(self.r, "weight_hh_l0")
        self.h = nn.Linear(6, 3).double()

    def forward(self, x):
        return self.h(self.r(x)[0][:, -1])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_parametrized_recurrent_weight_trains_as_in_torch(kind, stage):
    """The RNN's ``_flat_weights`` list keeps the weight it had before the parametrization,
    which shares memory with the parametrization's ``original1``: `fzero.init` refused it as
    an alias that would go stale (a probe), but torch's RNN forward reads its weights into that
    list again whenever one is another tensor (always, for a parametrized one). It trains as
    torch does (SGD with momentum, two ranks, float64)."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(6, 5, 8, generator=g, dtype=torch.float64),
             torch.randn(6, 3, generator=g, dtype=torch.float64)) for _ in range(3)]
    model = _ParametrizedRNN(kind)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        (reference(x) - y).pow(2).mean().backward()
        opt.step()

    def body(comm):
        model = _ParametrizedRNN(kind)  # built here: a deep copy reads _flat_weights anew
        model.load_state_dict(values)  # (in place; the ranks' threads share torch's generator)
        state = fzero.init(model, stage=stage, comm=comm,
                           optimizer=fzero.optim.sgd(lr=0.1, momentum=0.9))
        step = fzero.make_train_step(model, lambda call, b: (call(b[0]) - b[1]).pow(2).mean())
        for x, y in data:
            rows = slice(comm.rank * 3, comm.rank * 3 + 3)
            state, _ = step(state, (x[rows], y[rows]))
        return fzero.full_params(state)

    values = copy.deepcopy(model.state_dict())
    for got in fzero.SimWorld(2).run(body):
        for name, value in reference.named_parameters():
            torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=1e-12)


class _Rewrites(nn.Module):
    """Buffers an eval-mode forward writes without changing what a later forward sees: a table
    rewritten in place with the values it holds (Hugging Face's longrope ``inv_freq``), and a
    non-persistent cache regrown for a longer input (M2M100's positional table)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 4, dtype=torch.float64))
        self.register_buffer("table", torch.arange(3, dtype=torch.float64), persistent=False)

    def forward(self, x):
        self.freq.copy_(torch.where(self.freq > 5.0, self.freq * 2, self.freq))  # no change
        if x.shape[0] > self.table.numel():  # a cache of a function of the length
            self.table = torch.arange(x.shape[0], dtype=torch.float64)
        return self.lin(x * self.freq) + self.table[: x.shape[0], None]


@pytest.mark.parametrize("stage", STAGES)
def test_an_eval_step_accepts_rewrites_that_lose_nothing(stage):
    """The version-counter check raised on longrope's same-value rewrite, and the eval step's
    `keep` raised on the regrown cache (a review): both lose nothing, and plain torch's outputs
    come out."""
    model = _Rewrites().eval()
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = copy.deepcopy(model)(x)

    def body(comm, model):
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        return fzero.make_eval_step(model, lambda call, b: call(b))(state, x).clone()

    for got in fzero.SimWorld(2).run(body, model):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


class _SharedCounter(nn.Module):
    """One buffer registered in two submodules (``a.b`` and ``c.b``), reassigned through the
    second name in forward."""

    def __init__(self) -> None:
        super().__init__()
        shared = torch.zeros(1, dtype=torch.float64)
        self.a, self.c = nn.Module(), nn.Module()
        self.a.register_buffer("b", shared)
        self.c.register_buffer("b", shared)
        self.lin = nn.Linear(1, 1).double()

    def forward(self, x):
        self.c.b = self.c.b + 1
        return self.lin(x) * self.c.b


@pytest.mark.parametrize("stage", STAGES)
def test_a_buffer_reassigned_through_its_second_name_is_kept(stage):
    """`keep` listed the buffers' first names only: a reassignment through the second name was
    dropped at the binding's end, silently, by train and eval steps (a review). A train step
    keeps it now as torch's module does (the counter reaches 2 after two steps, the losses
    equal torch's), and an eval step raises."""
    x = torch.ones(2, 1, dtype=torch.float64)
    model = _SharedCounter()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for _ in range(2):
        opt.zero_grad()
        loss = reference(x).pow(2).mean()
        loss.backward()
        opt.step()
        want.append(loss.item())

    def body(comm, model):
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        step = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean())
        losses = []
        for _ in range(2):
            state, metrics = step(state, x)
            losses.append(metrics["loss"])
        with pytest.raises(ValueError, match=r"changed buffer\(s\) \['a.b'\]"):
            fzero.make_eval_step(model, lambda call, b: call(b))(state, x)
        return losses, float(state.buffers["a.b"])

    for losses, count in fzero.SimWorld(1).run(body, model):
        assert losses == pytest.approx(want, rel=1e-12) and count == 2.0


class _Scripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.jit.script(nn.Linear(4, 4).double())
        self.b = nn.Linear(4, 1).double()

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_scripted_submodule_trains_as_in_torch():
    """A ``torch.jit.script``-ed submodule's ``_parameters`` is a wrapper without ``.get``: a
    faster lookup that assumed a dict broke every step on it (a review). Plain attribute
    reads: its steps equal torch's."""
    xs = [torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(3)]
    model = _Scripted()
    reference = _Scripted()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for x in xs:
        opt.zero_grad()
        loss = reference(x).pow(2).mean()
        loss.backward()
        opt.step()
        want.append(loss.item())

    def body(comm):
        state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        step = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean())
        losses = []
        for x in xs:
            state, metrics = step(state, x)
            losses.append(metrics["loss"])
        return losses

    assert fzero.SimWorld(1).run(body)[0] == pytest.approx(want, rel=1e-12)


class _AssignsElsewhere(nn.Module):
    """Assigns a plain tensor to a parameter slot in forward: of its head, which it also holds
    under a second name (``blocks.0``), or of a helper module outside the model."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6).double()
        self.head = nn.Linear(6, 12, bias=False).double()
        self.blocks = nn.ModuleList([self.head])
        self.where = where
        self.__dict__["helper"] = nn.Linear(6, 12, bias=False).double()  # not a submodule

    def forward(self, idx):
        target = self.head if self.where == "head" else self.__dict__["helper"]
        target.weight = self.emb.weight.detach() * 1.0
        return self.head(self.emb(idx))


@pytest.mark.parametrize("where", ["head", "helper"])
def test_an_assigned_parameter_is_named_by_its_first_name_and_torchs_own_error_stays(where):
    """The tie-in-forward message named the last of a module's names (``blocks.0.weight``, not
    the state's ``head.weight``), and blamed fzero for torch's own refusal on a module outside
    the model (a review). It names the first; torch's TypeError passes through unchanged."""
    idx = torch.randint(0, 12, (2, 3), generator=torch.Generator().manual_seed(0))

    def body(comm):
        model = _AssignsElsewhere(where)
        state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
        step = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean())
        if where == "head":
            with pytest.raises(ValueError, match=r"parameter 'head\.weight'"):
                step(state, idx)
        else:
            with pytest.raises(TypeError, match=r"cannot assign .* as parameter 'weight'"):
                step(state, idx)

    fzero.SimWorld(1).run(body)
