"""Stage 3 and the user's own hooks and reads (fzero.residency).

fzero's gathering pre-hooks run before the user's, so a user's forward pre-hook (or forward
hook) that reads its module's weight sees the gathered values and trains like torch. A
parameter read outside any module that owns it is gathered on demand (a torch function mode
sees the read) and trains like torch too, as do views and stop-gradient aliases (``.detach()``,
``.data``) of parameters kept across modules or steps; an alias no torch function made raises
`fzero.OutsideOwnerError` where torch checks the storage.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fzero
import fzero.residency as residency

import guarantee_bodies as gb

STAGES = (0, 1, 2, 3)
STEPS = 3


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def add_weight_mean(module: nn.Module, args: Any, output: Tensor) -> Tensor:
    """A forward hook that reads its module's weight after the forward."""
    return output + module.weight.mean()


def hooked() -> gb.PreHooked:
    model = gb.PreHooked()
    model.fc1.register_forward_hook(add_weight_mean)
    return model


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_users_hooks_read_gathered_weights(stage: int, world: int) -> None:
    """Each parameter in its own bucket, so nothing else keeps fc2's weight gathered."""
    model = hooked()
    data = gb.mse_batches(STEPS)
    want = gb.reference(model, gb.mse_loss, data)
    out = fzero.SimWorld(world).run(gb.train, model, gb.mse_loss, data, stage=stage,
                                    buckets=gb.each_parameter_alone(model))
    gb.assert_parity(out[0], want)


def test_the_hooks_change_the_result() -> None:
    """Without its hooks the same model trains differently: the hooks are really exercised."""
    data = gb.mse_batches(STEPS)
    plain = gb.PreHooked()
    plain.fc2._forward_pre_hooks.clear()
    assert gb.max_difference(gb.reference(hooked(), gb.mse_loss, data).params,
                             gb.reference(plain, gb.mse_loss, data).params) > 1e-3


# ----------------------------------------------------------------------------------------------
# Reading a parameter outside its owner: the torch function guard gathers its bucket


def square(steps: int) -> list[tuple[Tensor, Tensor]]:
    """Batches for the 5 -> 5 models below."""
    return gb.mse_batches(steps, d_in=5, d_out=5)


READERS = {
    "root matmul": lambda: gb.RootReadsChild(read="matmul"),
    "root transpose": lambda: gb.RootReadsChild(read="transpose"),  # w.T: a view first
    "root elementwise": lambda: gb.RootReadsChild(read="elementwise"),  # no bounds check
    "nested reader": lambda: gb.ReadsChild(own=True),
    "reader owning nothing": lambda: gb.ReadsChild(own=False, read_first=True),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_parameter_read_outside_its_owner_trains_exactly(reader: str, world: int) -> None:
    """Every parameter in a bucket of its own, so nothing else keeps the read one gathered: a
    read outside the owning module's hooks (a matmul, a transposed view, an elementwise op,
    which torch would not even bounds-check) gathers its bucket first and trains like torch."""
    model = READERS[reader]()
    data = square(STEPS)
    out = fzero.SimWorld(world).run(gb.train, model, gb.mse_loss, data, stage=3,
                                    buckets=gb.each_parameter_alone(model))
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, data))


def test_a_parameter_read_outside_its_owner_on_gloo(gloo_pool: Any) -> None:
    """The elementwise read that would crash the process, in gloo workers (only they die)."""
    model = gb.RootReadsChild(read="elementwise")
    data = square(STEPS)
    out = gloo_pool(2).run(gb.train, model, gb.mse_loss, data, stage=3,
                           buckets=gb.each_parameter_alone(model))
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, data))


@pytest.mark.parametrize("read", ["matmul", "elementwise"])
def test_a_view_kept_across_modules_is_gathered_again(gloo_pool: Any, read: str) -> None:
    """A view of a parameter taken while its bucket was gathered and used after the bucket was
    released: the guard traces it to its parameter (``_base``) and gathers the bucket again. A
    matmul raised OutsideOwnerError; an elementwise read read freed memory (the process
    crashed), hence gloo workers: only they die if it comes back."""
    model, data = (gb.KeepsAView() if read == "matmul" else gb.KeepsARow()), square(STEPS)
    out = gloo_pool(2).run(gb.train, model, gb.mse_loss, data, stage=3,
                           buckets=gb.each_parameter_alone(model))
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, data))


def test_a_detached_view_kept_across_modules_is_gathered_again(gloo_pool: Any) -> None:
    """A detached alias of a parameter's view, taken while its bucket was gathered and read
    after the bucket was released, gathers the bucket again (it raised OutsideOwnerError, or
    crashed the process: gloo workers)."""
    model, data = gb.KeepsAView(detach=True), square(STEPS)
    out = gloo_pool(2).run(gb.train, model, gb.mse_loss, data, stage=3,
                           buckets=gb.each_parameter_alone(model))
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, data))


@pytest.mark.parametrize("read", ["matmul", "elementwise"])
@pytest.mark.parametrize("how", ["detach", "data"])
def test_a_stop_gradient_alias_kept_across_modules_is_gathered_again(
        gloo_pool: Any, how: str, read: str) -> None:
    """``w = a.weight.detach()`` (or ``.data``) taken before ``b`` runs and read after, when
    ``a``'s bucket was released: the guard knows the aliases a step takes and gathers the
    bucket again. A matmul raised OutsideOwnerError; an elementwise read read freed memory
    (the process crashed), hence gloo workers: only they die if it comes back."""
    model, data = gb.KeepsAnAlias(how, read), square(STEPS)
    out = gloo_pool(2).run(gb.train, model, gb.mse_loss, data, stage=3,
                           buckets=gb.each_parameter_alone(model))
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, data))


def test_an_alias_no_torch_function_made_names_the_reader() -> None:
    """An alias over a parameter's storage made with ``Tensor.set_`` (no torch function sees
    it), read by a matmul after its bucket was released: OutsideOwnerError naming the reader
    and the candidates, not torch's message about unallocated data."""
    model = gb.KeepsAnAlias("set_", "matmul")
    outs = fzero.SimWorld(2).run(gb.train_through_failure, model, gb.mse_loss, square(1),
                                 stage=3, fail={}, buckets=gb.each_parameter_alone(model))
    for out in outs:
        error = out["errors"][0]
        assert error["type"] == "OutsideOwnerError" and error["unchanged"], error
        assert "the root module (KeepsAnAlias)" in error["message"]
        assert "'a.weight'" in error["message"] and "Tensor.set_" in error["message"]


@pytest.mark.parametrize("how", ["detach", "data"])
def test_a_stop_gradient_alias_kept_across_steps_reads_the_current_values(
        gloo_pool: Any, how: str) -> None:
    """An alias taken at the first step and read at every later one views the parameter's
    current values, in torch and at stages 0-2 (the update writes the memory it views); at
    stage 3 its bucket is gathered again for it (it read freed memory: a crash, hence gloo
    workers)."""
    model, data = gb.KeepsAnAlias(how, "elementwise", across_steps=True), square(STEPS)
    want = gb.reference(model, gb.mse_loss, data)
    for stage in (0, 3):
        out = gloo_pool(2).run(gb.train, model, gb.mse_loss, data, stage=stage,
                               buckets=gb.each_parameter_alone(model))
        gb.assert_parity(out[0], want)


class KeptAcrossPrefetch(nn.Module):
    """Keeps a view of ``x.weight`` across another module's forward. That module's use
    releases x's bucket and the prefetch gathers it again at once; the view reads that memory
    directly (the first step reads the parameter itself: its rounds could not know)."""

    def __init__(self) -> None:
        super().__init__()
        with gb.seeded(0):
            self.a = nn.Linear(5, 5).double()
            self.x = nn.Linear(5, 5).double()
            self.out = nn.Linear(5, 5).double()
        self.calls = 0

    def forward(self, inp: Tensor) -> Tensor:
        self.calls += 1
        kept = self.x.weight.t()
        h = torch.tanh(self.a(inp))
        h = torch.tanh(h @ (kept if self.calls > 1 else self.x.weight.t()))
        return self.out(torch.tanh(self.x(h)))


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_kept_view_waits_for_a_prefetch_in_flight(prefetch: int) -> None:
    """It read the gather half done: 4e-3 to 9e-2 off torch without an error (every run on
    gloo, a race in SimWorld). The guard now waits for a gather in flight into the memory any
    argument views."""
    data = square(5)
    want = gb.reference(KeptAcrossPrefetch(), gb.mse_loss, data)
    for _ in range(3):
        model = KeptAcrossPrefetch()
        outs = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, data, stage=3,
                                     step_kwargs={"prefetch": prefetch},
                                     buckets=gb.each_parameter_alone(model))
        gb.assert_parity(outs[0], want)


class ClampsThroughData(nn.Module):
    """Clips a weight in forward through ``.data`` (WGAN style): plain torch keeps the write."""

    def __init__(self) -> None:
        super().__init__()
        with gb.seeded(0):
            self.a = nn.Linear(5, 5).double()
            self.out = nn.Linear(5, 5).double()

    def forward(self, inp: Tensor) -> Tensor:
        self.a.weight.data.clamp_(-0.2, 0.2)
        return self.out(torch.tanh(self.a(inp)))


def test_a_write_through_data_in_forward_raises_at_stage_3() -> None:
    """Stage 3 wrote it into a gathered copy it then discarded: 0.22 off torch, silently.
    Stages 0-2 write into the state itself, as torch does."""
    data = square(3)
    want = gb.reference(ClampsThroughData(), gb.mse_loss, data)
    outs = fzero.SimWorld(2).run(gb.train, ClampsThroughData(), gb.mse_loss, data, stage=0)
    gb.assert_parity(outs[0], want)
    outs = fzero.SimWorld(2).run(gb.train_through_failure, ClampsThroughData(), gb.mse_loss,
                                 data[:1], stage=3, fail={})
    errors = [out["errors"][0] for out in outs]
    assert all(error["unchanged"] for error in errors)
    # The rank whose part of the bucket the clamp changed raises it; the other, StepError.
    assert {error["type"] for error in errors} <= {"ValueError", "StepError"}
    assert any(error["type"] == "ValueError" for error in errors)
    for error in errors:
        assert "were written during the step in a way autograd does not see" in (
            error["message"])


class ClampsThroughDataLater(ClampsThroughData):
    """Clips through ``.data`` from its second forward on: a step function compares every
    bucket with its shard on its first step only, so only the guard seeing ``.data`` taken
    finds this write."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, inp: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 1:
            return self.out(torch.tanh(self.a(inp)))
        return super().forward(inp)


class ReadsThroughData(ClampsThroughData):
    """Reads a weight through ``.data`` in forward (a logged norm), writes nothing."""

    def forward(self, inp: Tensor) -> Tensor:
        self.norm = float(self.a.weight.data.norm())
        return self.out(torch.tanh(self.a(inp)))


def test_a_write_through_data_after_the_first_step_raises_at_stage_3() -> None:
    """The write check ran on a step function's first step only: a clamp that began on the
    second step was lost with the gathered copy, silently (the state kept training unclamped
    weights). Every rank raises at that step, the state unchanged."""
    outs = fzero.SimWorld(2).run(gb.train_through_failure, ClampsThroughDataLater(),
                                 gb.mse_loss, square(3), stage=3, fail={})
    for out in outs:
        assert sorted(out["errors"]) == [1, 2], out["errors"]  # every step that clamps
        for error in out["errors"].values():
            assert error["unchanged"]
            assert error["type"] in ("ValueError", "StepError")
    assert any(error["type"] == "ValueError" for out in outs for error in out["errors"].values())
    assert all("written during the step in a way autograd does not see" in error["message"]
               for out in outs for error in out["errors"].values())


def test_reading_through_data_in_forward_trains_like_torch_at_stage_3() -> None:
    """The guard compares the buckets whose ``.data`` was taken: reading it changes nothing."""
    data = square(3)
    want = gb.reference(ReadsThroughData(), gb.mse_loss, data)
    outs = fzero.SimWorld(2).run(gb.train, ReadsThroughData(), gb.mse_loss, data, stage=3)
    gb.assert_parity(outs[0], want)


def _evaluate_outcome(comm: Any, model: nn.Module, stage: int, x: Tensor) -> dict[str, Any]:
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    evaluate = fzero.make_eval_step(model, lambda call, batch: call(batch))
    try:
        evaluate(state, x)
        raised = None
    except ValueError as error:
        raised = str(error)
    return {"raised": raised, "weight": fzero.full_params(state)["a.weight"]}


def test_a_write_through_data_in_an_eval_step_lands_in_the_state_or_raises() -> None:
    """An eval step's forward writing through ``.data``: in torch the write stays in the
    module. Below stage 3 it lands in the state (the bound tensors view it); stage 3 lost it
    with the gathered copy, silently; it raises on a rank whose part the write changed, and
    the state is unchanged."""
    x = square(1)[0][0][:2]
    initial = ClampsThroughData().a.weight.detach().clone()
    for stage in (0, 1, 2):
        outs = fzero.SimWorld(2).run(_evaluate_outcome, ClampsThroughData(), stage, x)
        for out in outs:
            assert out["raised"] is None
            torch.testing.assert_close(out["weight"], initial.clamp(-0.2, 0.2), rtol=0, atol=0)
    outs = fzero.SimWorld(2).run(_evaluate_outcome, ClampsThroughData(), 3, x)
    assert any(out["raised"] is not None for out in outs)
    for out in outs:
        assert out["raised"] is None or "written during the step" in out["raised"]
        torch.testing.assert_close(out["weight"], initial, rtol=0, atol=0)


class WritesThroughDLPack(ClampsThroughData):
    """Clamps a weight through a DLPack alias in forward: a tensor of its own version counter,
    and no ``.data`` the guard could see."""

    def forward(self, inp: Tensor) -> Tensor:
        with torch.no_grad():
            torch.from_dlpack(self.a.weight.detach()).clamp_(-0.2, 0.2)
        return self.out(torch.tanh(self.a(inp)))


def test_a_write_no_check_sees_in_an_eval_steps_first_run_raises_at_stage_3() -> None:
    """Stage 3 compares every released bucket with its shard on a step function's first step
    (what no version counter and no ``.data`` shows): train steps did, eval steps did not,
    though the README said both, and such a write was lost with the gathered copy silently.
    Stages 0-2 keep it, as torch's module does; stage 3 raises, the state unchanged."""
    x = square(1)[0][0][:2]
    initial = WritesThroughDLPack().a.weight.detach().clone()
    out = fzero.SimWorld(1).run(_evaluate_outcome, WritesThroughDLPack(), 0, x)[0]
    assert out["raised"] is None
    torch.testing.assert_close(out["weight"], initial.clamp(-0.2, 0.2), rtol=0, atol=0)
    out = fzero.SimWorld(1).run(_evaluate_outcome, WritesThroughDLPack(), 3, x)[0]
    assert out["raised"] is not None and "written during the step" in out["raised"]
    torch.testing.assert_close(out["weight"], initial, rtol=0, atol=0)


class BiasReadInBackward(nn.Module):
    """Two Linear layers; the loss adds nothing but makes backward read the head's bias first,
    through a gradient hook: a read the guard sees, not a saved tensor (a Linear's backward does
    not save its bias)."""

    def __init__(self) -> None:
        super().__init__()
        with gb.seeded(0):
            self.a = nn.Linear(4, 8)
            self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.a(x)))  # (B, 4) -> (B, 3)


def bias_read_body(comm: fzero.Comm, steps: int) -> list[tuple[int, int]]:
    model = BiasReadInBackward()
    state = fzero.init(model, stage=3, optimizer=fzero.optim.sgd(lr=0.1), comm=comm, buckets=20)
    assert [b.names for b in state.layout.buckets][-1] == ("head.bias",)

    def loss_fn(call: Any, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        out = call(x)
        out.register_hook(lambda grad: grad + 0 * model.head.bias.sum())
        return torch.nn.functional.mse_loss(out, y)

    step = fzero.make_train_step(model, loss_fn)
    generator = torch.Generator().manual_seed(0)
    sent = []
    for _ in range(steps):
        batch = (torch.randn(4, 4, generator=generator), torch.randn(4, 3, generator=generator))
        state, metrics = step(state, batch)
        sent.append((metrics["comm_bytes_by_kind"]["all_gather"], metrics["control_bytes"]))
    return sent


def test_a_kept_bucket_read_first_by_the_guard_counts_as_its_use() -> None:
    """Forward ends with the head's bias bucket and backward's first use of it is a read the
    guard sees: that read consumes the kept bucket like any use, so every step after the first
    sends the same (the bias kept, no extra round). Counted only on unpacks, the read went
    unrecorded, and every other step lost the sequence and asked for the bias in a round."""
    sent = fzero.SimWorld(2).run(bias_read_body, 6)[0]
    first, *later = sent
    assert len(set(later)) == 1, sent
    assert later[0][0] < first[0]  # the bias is not gathered again in backward


def test_the_guard_sees_the_users_calls_not_fzeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard (a torch function mode: a Python round trip per torch call) is active through
    the user's forward and backward only, and fzero's own hooks inside them (gathering,
    unpacking saved parameters, launching reductions) bypass it: of the calls it sees, those
    made from fzero's code are only the two that start backward. Through the guard, fzero's
    hooks made 680 of the 775 calls of a step of the 1.8M-parameter GPT (8% of its time).

    The guard's handler is wrapped (once, for both ranks' threads) to record each torch
    function it sees and the file of the code that called it: the first frame outside torch's
    own Python code."""
    torch_dir = str(Path(torch.__file__).parent)
    fzero_dir = str(Path(fzero.__file__).parent)
    seen: list[tuple[str, str]] = []
    handler = residency._Guard.__torch_function__

    def recording(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
            frame = frame.f_back
        caller = frame.f_code.co_filename if frame is not None else "?"
        seen.append((getattr(func, "__name__", repr(func)), caller))
        return handler(self, func, types, args, kwargs)

    monkeypatch.setattr(residency._Guard, "__torch_function__", recording)
    model = gb.RootReadsChild(read="matmul")
    fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, square(2), stage=3,
                          buckets=gb.each_parameter_alone(model))
    from_fzero = sorted({name for name, caller in seen if caller.startswith(fzero_dir)})
    from_user = [name for name, caller in seen if not caller.startswith(fzero_dir)]
    assert from_fzero == ["mul", "ones_like"], from_fzero  # loss * factor, backward's seed
    assert "matmul" in from_user  # the root's read of its child's weight is seen


class Transformed(nn.Module):
    """Three 5 -> 5 layers; the middle one is applied through a torch transform or a tensor
    kind stage 3's hooks must let pass: ``vmap`` over an ensemble of its weights, a sparse
    adjacency (``torch.sparse.mm``), forward-mode AD (``jacfwd``), ``torch.func.grad``, an
    ``inference_mode`` region, or saved-tensor hooks of the user's own."""

    def __init__(self, how: str) -> None:
        super().__init__()
        with gb.seeded(0):
            self.a, self.b, self.c = (nn.Linear(5, 5).double() for _ in range(3))
        self.how = how

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.a(x))
        w = self.b.weight
        if self.how == "vmap":
            x = torch.vmap(lambda wi: torch.tanh(x @ wi.t()))(torch.stack([w, 0.5 * w])).mean(0)
        elif self.how == "sparse":
            n = x.shape[0]
            rows = torch.arange(n)
            adj = torch.sparse_coo_tensor(torch.stack([torch.cat([rows, rows]),
                                                       torch.cat([rows, (rows + 1) % n])]),
                                          torch.full((2 * n,), 0.5, dtype=x.dtype), (n, n),
                                          check_invariants=True)
            x = torch.sparse.mm(adj, self.b(x))
        elif self.how == "jacfwd":
            x = x + torch.func.jacfwd(lambda v: torch.tanh(v @ w.t()))(x[0]).sum(0)
        elif self.how == "func.grad":
            x = x + torch.func.grad(lambda v: torch.tanh(v @ w.t()).sum())(x)
        elif self.how == "inference_mode":  # the bucket's first reader: a statistic
            with torch.inference_mode():
                scale = float(torch.tanh(self.b(x)).abs().mean())
            x = self.b(x) * scale
        elif self.how == "own saved hooks":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                x = self.b(x)
        return self.c(x)


# torch.func's jacfwd reaches torch.jit.script inside torch (deprecated there, not here)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("how, world", [("vmap", 2), ("sparse", 2), ("jacfwd", 1),
                                        ("inference_mode", 2)])
def test_transforms_and_sparse_tensors_in_forward_train_like_torch_at_stage_3(how, world):
    """Stage 3's guard and saved-tensor hook asked every tensor for its storage: under
    ``vmap`` (a batched tensor), with a sparse tensor saved for backward, or a forward-mode
    dual tensor, torch raised "Cannot access storage" (a probe): none is a bucket's view.
    A bucket gathered first inside ``torch.inference_mode()`` failed under SimWorld only (its
    threads wrote an inference tensor outside the mode; gloo writes it from C++).
    (Forward-mode AD levels are global to the process, not per thread: two SimWorld ranks
    running ``jacfwd`` at once break each other, in torch itself, so that case runs one.)"""
    data = square(2)  # each rank's rows are a graph of their own: the reference's world too
    want = gb.reference(Transformed(how), gb.mse_loss, data, world=world)
    outs = fzero.SimWorld(world).run(gb.train, Transformed(how), gb.mse_loss, data, stage=3,
                                     buckets=gb.each_parameter_alone(Transformed(how)))
    gb.assert_parity(outs[0], want)


@pytest.mark.parametrize("how, message", [
    ("func.grad", "differentiate with torch.autograd.grad"),
    ("own saved hooks", "saved_tensors_hooks context of your own"),
])
def test_what_stage_3_cannot_run_raises_naming_its_saved_tensor_hooks(how, message) -> None:
    """``torch.func.grad`` refuses to run under saved-tensor hooks, which stage 3 installs;
    saved-tensor hooks of the user's own hide the saved parameters from stage 3's, and backward
    read a released bucket ("setStorage ... out of bounds for storage of size 0"). Both said
    nothing about fzero; each raises on every rank before the update, saying what to do."""
    outs = fzero.SimWorld(2).run(gb.train_through_failure, Transformed(how), gb.mse_loss,
                                 square(1), stage=3, fail={},
                                 buckets=gb.each_parameter_alone(Transformed(how)))
    errors = [out["errors"][0] for out in outs]
    assert all(error["unchanged"] for error in errors)
    assert any(message in error["message"] for error in errors), errors
    for stage in (0, 2):  # the same model trains like torch below stage 3
        want = gb.reference(Transformed(how), gb.mse_loss, square(2), world=2)
        outs = fzero.SimWorld(2).run(gb.train, Transformed(how), gb.mse_loss, square(2),
                                     stage=stage)
        gb.assert_parity(outs[0], want)
