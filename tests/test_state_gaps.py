"""Behaviours no test pinned until a mutation probe of fzero/residency.py, fzero/state.py and
fzero/buckets.py changed one line at a time and the relevant tests still passed: each test
here fails on its mutant (named in brackets) and passes on fzero."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

import fzero

import guarantee_bodies as gb
from models import seeded


class OwnsAndEnclosesStage3(nn.Module):
    """A root that owns a parameter (``scale``, its bucket needed first) and runs three children
    before reading it; `seen` records whether ``scale``'s bucket was still gathered then."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.scale = nn.Parameter(torch.rand(5) + 0.5)
            self.a = nn.Linear(5, 5)
            self.b = nn.Linear(5, 5)
            self.c = nn.Linear(5, 5)
        self.double()
        self.seen: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        h = self.c(torch.tanh(self.b(torch.tanh(self.a(x * 1.0)))))
        # untyped_storage() reads metadata only: it gathers nothing (residency._METADATA)
        self.seen.append(self.scale.untyped_storage().nbytes() > 0)
        return h * self.scale


def _enclosing_body(comm, model, batches):
    buckets = [["scale"], ["a.weight", "a.bias"], ["b.weight", "b.bias"],
               ["c.weight", "c.bias"]]
    out = gb.train(comm, model, gb.mse_loss, batches, stage=3, buckets=buckets)
    return {**out, "seen": list(model.seen)}


def test_stage3_keeps_an_enclosing_modules_own_bucket_while_its_children_run() -> None:
    """[R19: _evict ignores `active`] The module note: at most 1 + prefetch buckets are
    gathered, "plus those of enclosing modules still running (which own parameters
    themselves)". Evicting the root's bucket while its children run still trains like torch
    (the guard gathers it again when read) but gathers it twice per forward."""
    model = OwnsAndEnclosesStage3()
    data = gb.mse_batches(3, d_out=5, d_in=5)
    want = gb.reference(model, gb.mse_loss, data)
    for out in fzero.SimWorld(2).run(_enclosing_body, model, data):
        gb.assert_parity(out, want)
        assert out["seen"] and all(out["seen"]), out["seen"]


def _init_body(comm, model, kwargs):
    try:
        fzero.init(model, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm, **kwargs)
    except ValueError as error:
        return str(error)
    return None


def test_reduce_dtype_float16_needs_a_trainable_float16_parameter() -> None:
    """[S03: check_reduce_dtype counts frozen buckets] Only trainable float16 parameters get a
    loss scale: a frozen float16 parameter beside trainable float32 ones must not make
    reduce_dtype=torch.float16 acceptable (the float32 gradients would reduce in float16
    unscaled, small ones to zero, silently)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).half())
    model[1].requires_grad_(False)
    (message,) = fzero.SimWorld(1).run(_init_body, model,
                                       {"stage": 2, "reduce_dtype": torch.float16})
    assert message is not None and "reduce_dtype=torch.float16 needs float16" in message


def _state_body(comm, model, kwargs):
    state = fzero.init(model, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm, **kwargs)
    return {"master_dtype": state.config.master_dtype,
            "buffers": {n: (b.dtype, b.clone()) for n, b in state.buffers.items()},
            "params": {n: p.clone() for n, p in fzero.full_params(state).items()},
            "loss_scale": state.loss_scale}


def test_param_dtype_casts_floating_buffers_at_init() -> None:
    """[S11: init skips the buffer cast] param_dtype casts floating buffers as
    ``model.to(param_dtype)`` would (integer ones stay)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    (out,) = fzero.SimWorld(1).run(_state_body, model,
                                   {"stage": 1, "param_dtype": torch.bfloat16})
    dtypes = {n: d for n, (d, _) in out["buffers"].items()}
    assert dtypes == {"1.running_mean": torch.bfloat16, "1.running_var": torch.bfloat16,
                      "1.num_batches_tracked": torch.int64}


def test_a_frozen_float64_parameter_does_not_widen_the_master_dtype() -> None:
    """[S20: default_master_dtype counts frozen buckets] The default master dtype follows the
    *trainable* parameters: a frozen float64 one beside float32 trainable ones keeps float32
    (a float64 master would double the optimizer's memory)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).double())
    model[1].requires_grad_(False)
    outs = fzero.SimWorld(2).run(_state_body, model, {"stage": 2})
    assert [out["master_dtype"] for out in outs] == [torch.float32, torch.float32]


class _EmptyIntBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("ids", torch.zeros(0, dtype=torch.int64))


def _init_fn(module: nn.Module) -> None:
    for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        if tensor.is_floating_point():
            tensor.fill_(0.25)


def test_init_fn_need_not_write_an_empty_integer_buffer() -> None:
    """[S18: _unwritten without its empty check] An empty tensor holds no fill: an empty
    integer buffer (``(x == fill).all()`` is True for no elements) is not 'left
    uninitialized' by init_fn."""
    with torch.device("meta"):
        model = _EmptyIntBuffer()
    (out,) = fzero.SimWorld(1).run(_state_body, model, {"stage": 1, "init_fn": _init_fn})
    assert out["buffers"]["ids"][0] == torch.int64 and out["buffers"]["ids"][1].numel() == 0
    assert all(bool((p == 0.25).all()) for p in out["params"].values())



def _write_buffer_after_init(comm, model, batches):
    state = fzero.init(model, stage=1, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm)
    model.bn.running_mean.add_(1.0)  # the module's buffer, after init
    step = fzero.make_train_step(model, gb.mse_loss)
    try:
        step(state, gb.rank_rows(batches[0], comm.rank, comm.world_size))
    except ValueError as error:
        return str(error)
    return None


def test_init_copies_the_modules_buffers() -> None:
    """[S16: init keeps the module's own buffer tensors] The state's buffers are copies: a
    write into the module's buffer after init is not the state's (the step raises, naming it,
    as it does for parameters), and does not silently land in the state."""
    model = gb.BatchNormNet()
    data = gb.mse_batches(1, d_in=5, d_out=3)
    for message in fzero.SimWorld(2).run(_write_buffer_after_init, model, data):
        assert message is not None and "bn.running_mean" in message, message


def test_a_frozen_float16_parameter_gets_no_loss_scale() -> None:
    """[S14: init's loss scale counts frozen buckets] Only trainable float16 parameters need a
    loss scale; frozen float16 ones beside float32 trainable ones must not scale the loss."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).half())
    model[1].requires_grad_(False)
    outs = fzero.SimWorld(2).run(_state_body, model, {"stage": 3})
    assert [out["loss_scale"] for out in outs] == [None, None]


def _frozen_but_embeddings(model: nn.Module) -> nn.Module:
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("blocks."))
    return model


def test_stage3_recomputation_of_frozen_blocks_keeps_the_gathered_bound() -> None:
    """[R28: a frozen bucket's pin never ends] Recomputation pins the buckets it gathers; a
    frozen bucket gets no gradient, so its pin ends when the gradients of the module's inputs
    are complete (a multi-grad hook). Without that, every frozen block recomputed stays
    gathered to the end of backward: the whole model, not one block."""
    n_layer, prefetch = 4, 1
    model = _frozen_but_embeddings(gb.CheckpointedGPT(mode="nonreentrant",
                                                      n_layer=n_layer).double())
    out = fzero.SimWorld(2).run(gb.train, model, gb.gpt_loss, gb.gpt_batches(2), stage=3,
                                buckets=200)[0]
    gb.assert_parity(out, gb.reference(model, gb.gpt_loss, gb.gpt_batches(2)))
    layout = out["layout"]
    sizes = sorted((b.padded_numel * 8 for b in layout.buckets), reverse=True)
    block = sum(b.padded_numel * 8 for b in layout.buckets
                if any(name.startswith("blocks.1.") for name in b.names))
    for m in out["metrics"]:
        assert m["gathered_bytes_peak"] <= block + sum(sizes[: prefetch + 1]), (
            m["gathered_bytes_peak"], block, sizes[:2])


class _AdapterBlock(nn.Module):
    """A frozen LayerNorm and Linear, and a trainable adapter (LoRA-style fine-tuning)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(width), nn.Linear(width, width)
        self.adapter = nn.Linear(width, width, bias=False)
        self.ln.requires_grad_(False)
        self.fc.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(x)
        return x + torch.tanh(self.fc(h)) + self.adapter(h)


class _ReentrantAdapters(nn.Module):
    def __init__(self, blocks: int = 6, width: int = 32) -> None:
        super().__init__()
        with gb.seeded(0):
            self.inp = nn.Linear(width, width)
            self.blocks = nn.ModuleList(_AdapterBlock(width) for _ in range(blocks))
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return x


@pytest.mark.parametrize("prefetch", [0, 1])
def test_stage3_reentrant_recomputation_of_frozen_blocks_keeps_the_gathered_bound(
        prefetch: int) -> None:
    """A reentrant region's recomputed inputs are leaves, on which the hook that ends a frozen
    bucket's recomputation pin was not registered for a while (leaf hooks fail inside
    ``torch.autograd.grad``): every block's frozen bucket stayed gathered to the end of
    backward (a probe: 61,952 bytes, all six, against 26,112 without the skip)."""
    model = _ReentrantAdapters()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 32, generator=gen, dtype=torch.float64),
                torch.randn(4, 32, generator=gen, dtype=torch.float64)) for _ in range(2)]
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, batches, stage=3,
                                opt=("sgd", gb.SGD), step_kwargs={"prefetch": prefetch},
                                buckets=lambda m: isinstance(m, _AdapterBlock))[0]
    gb.assert_parity(out, gb.reference(model, gb.mse_loss, batches, gb.torch_sgd))
    frozen, adapter = (32 * 32 + 3 * 32) * 8, 32 * 32 * 8
    for m in out["metrics"]:
        assert m["gathered_bytes_peak"] <= (prefetch + 2) * frozen + adapter, m


class _EmbeddingPerBlock(nn.Module):
    """Each block looks up an embedding of the ids inside a checkpointed region (per-block
    position or type embeddings): a module whose inputs need no gradient."""

    def __init__(self, blocks: int = 6, checkpointed: bool = True) -> None:
        super().__init__()
        with gb.seeded(0):
            self.embs = nn.ModuleList(nn.Embedding(8, 8) for _ in range(blocks))
            self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))
        self.checkpointed = checkpointed
        self.double()

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        h = x
        for emb, lin in zip(self.embs, self.lins, strict=True):
            looked_up = (torch.utils.checkpoint.checkpoint(emb, ids, use_reentrant=False)
                         if self.checkpointed else emb(ids))
            h = torch.tanh(lin(h + looked_up))
        return h


def _embedding_loss(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    x, ids, y = batch
    return torch.nn.functional.mse_loss(call(x, ids), y)


def test_stage3_checkpointed_modules_without_gradient_inputs_keep_the_gathered_bound() -> None:
    """A module in a checkpointed region whose inputs need no gradient has no hook to end its
    pins; counting it as awaiting its backward kept each such bucket gathered to the end of
    backward (six embeddings: seven buckets at once, against two without checkpointing: a
    probe). Its trainable bucket is released when its gradient is complete."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=gen, dtype=torch.float64),
                torch.randint(0, 8, (4,), generator=gen),
                torch.randn(4, 8, generator=gen, dtype=torch.float64)) for _ in range(2)]
    peaks = {}
    for checkpointed in (False, True):
        model = _EmbeddingPerBlock(checkpointed=checkpointed)
        out = fzero.SimWorld(1).run(
            gb.train, model, _embedding_loss, batches, stage=3, opt=("sgd", gb.SGD),
            step_kwargs={"prefetch": 0},
            buckets=lambda m: isinstance(m, (nn.Linear, nn.Embedding)))[0]
        gb.assert_parity(out, gb.reference(model, _embedding_loss, batches, gb.torch_sgd))
        peaks[checkpointed] = max(m["gathered_bytes_peak"] for m in out["metrics"])
    assert peaks[True] <= peaks[False], peaks


class Gate(nn.Module):
    """Owns ``scale`` and runs the child its caller picks (``a`` or ``c``) before reading it;
    `seen` records whether ``scale``'s bucket was still gathered then."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(5) + 0.5)
        self.a = nn.Linear(5, 5)
        self.c = nn.Linear(5, 5)
        self.seen: list[bool] = []

    def forward(self, h: Tensor, child: int) -> Tensor:
        h = torch.tanh((self.a if child == 0 else self.c)(h))
        # untyped_storage() reads metadata only: it gathers nothing (residency._METADATA)
        self.seen.append(self.scale.untyped_storage().nbytes() > 0)
        return h * self.scale


class GatedRoute(nn.Module):
    """``forward(x, route)`` follows ``route[0]`` (a rank's rows carry its route): 0 and 1 run
    ``gate`` through its child ``a`` or ``c``, 2 runs ``t`` (-1 pads a route)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.gate = Gate()
            self.t = nn.Linear(5, 5)
        self.double()

    def forward(self, x: Tensor, route: Tensor) -> Tensor:
        h = x
        for code in route[0].tolist():
            if code in (0, 1):
                h = self.gate(h, code)
            elif code == 2:
                h = torch.tanh(self.t(h))
        return h[:, :3]


def _gated_body(comm, model, batches, prefetch):
    buckets = [["gate.scale"], ["gate.a.weight", "gate.a.bias"],
               ["gate.c.weight", "gate.c.bias"], ["t.weight", "t.bias"]]
    out = gb.train(comm, model, gb.routed_loss, batches, stage=3, opt=("sgd", gb.SGD),
                   buckets=buckets, step_kwargs={"prefetch": prefetch})
    return {**out, "seen": list(model.gate.seen)}


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_stage3_passing_over_a_running_modules_position_keeps_its_bucket(
        world: int, prefetch: int) -> None:
    """[R21: _pass ignores `active`] The first step learns the sequence gate, a, t, gate, c
    (``gate`` runs twice, ``t`` between evicts its bucket). The next steps run ``gate`` once,
    through ``c``: its use jumps ahead in the sequence and takes part in the positions of ``t``
    and of ``gate``'s second use on the way. ``gate`` is still running (its bucket is active):
    the bucket that position gathers must stay, not be released under it. Training is exact
    either way (the guard gathers ``scale`` again when read)."""
    data = gb.routed_batches([[[0, 2, 1]] * world, [[1, 2]] * world, [[1, 2]] * world])
    want = gb.reference(GatedRoute(), gb.routed_loss, data, gb.torch_sgd, world=world)
    for out in fzero.SimWorld(world).run(_gated_body, GatedRoute(), data, prefetch):
        gb.assert_parity(out, want)
        assert out["seen"] == [True] * 4, out["seen"]


class Chain(nn.Module):
    """``forward(x, route)`` runs ``blocks[i]`` for each i >= 0 of ``route[0]`` in order and
    ends in the last one (no head of its own)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))
        self.double()

    def forward(self, x: Tensor, route: Tensor) -> Tensor:
        h = x
        for index in route[0].tolist():
            if index >= 0:
                h = torch.tanh(self.blocks[index](h))
        return h[:, :3]


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("world", [1, 2])
def test_stage3_carries_the_last_bucket_the_sequence_uses_again(
        world: int, prefetch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """[R21: _pass ignores `current`] Step 1 runs blocks 0, 1, 0, 1: forward's sequence ends
    with block 1's bucket twice. Step 2 runs blocks 0, 1: forward ends in block 1's first
    position, and finishing the phase takes part in the positions left, block 1's second one
    among them. That gather lands in the bucket this rank just used, which it still holds:
    keeping it, every rank reports it held and backward (which starts with block 1) does not
    gather it again (`carried`). Releasing it there leaves nothing to carry."""
    import fzero.residency

    decisions: list[tuple[int, ...]] = []
    real_carried = fzero.residency.carried

    def recorded(headers, following):
        decisions.append(carry := real_carried(headers, following))
        return carry

    monkeypatch.setattr(fzero.residency, "carried", recorded)
    data = gb.routed_batches([[[0, 1, 0, 1]] * world, [[0, 1]] * world])
    want = gb.reference(Chain(), gb.routed_loss, data, gb.torch_sgd, world=world)
    outs = fzero.SimWorld(world).run(gb.train, Chain(), gb.routed_loss, data, stage=3,
                                     opt=("sgd", gb.SGD), step_kwargs={"prefetch": prefetch})
    for out in outs:
        gb.assert_parity(out, want)
    # one decision per rank per step; the first step (rounds only) carries nothing
    assert len(decisions) == 2 * world, decisions
    block1 = next(i for i, b in enumerate(outs[0]["layout"].buckets)
                  if "blocks.1.weight" in b.names)
    assert all(d[:1] == (block1,) for d in decisions[world:]), decisions


class ShiftAfterChildren(nn.Module):
    """A root that owns ``shift`` (its bucket needed first) and adds it after three children
    have run; the addition saves nothing for backward, which starts with ``c``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.shift = nn.Parameter(torch.rand(5))
            self.a = nn.Linear(5, 5)
            self.b = nn.Linear(5, 5)
            self.c = nn.Linear(5, 5)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) + self.shift


def _shift_body(comm, model, batches):
    buckets = [["shift"], ["a.weight", "a.bias"], ["b.weight", "b.bias"], ["c.weight", "c.bias"]]
    state = fzero.init(model, stage=3, optimizer=fzero.optim.sgd(**gb.SGD), comm=comm,
                       buckets=buckets)
    step = fzero.make_train_step(model, gb.mse_loss, prefetch=0)
    losses, orders, gathered = [], [], []
    for batch in batches:
        state, m = step(state, gb.rank_rows(batch, comm.rank, comm.world_size))
        losses.append(m["loss"])
        orders.append(state.bucket_order)
        gathered.append(m["comm_bytes_by_kind"]["all_gather"])
    return {"losses": losses, "params": fzero.full_params(state), "orders": orders,
            "gathered": gathered,
            "bucket_bytes": [b.padded_numel * 8 for b in state.layout.buckets]}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stage3_a_read_of_a_bucket_in_use_is_no_new_use(world: int) -> None:
    """[R24: a use that jumps ahead in the sequence leaves its bucket `fresh`] With prefetch 0
    every forward use gathers its position then. ``shift``'s bucket, used first, stays gathered
    while the root runs its children; reading ``shift`` after them is no new use: forward's
    sequence stays shift, a, b, c, and forward ends in ``c``, which backward starts with and
    keeps (``a`` gets no input gradient: backward never reads its weight). Counting the read as
    a use (the bucket still marked as a position's gather not used since) adds a position to
    every later forward, and ends forward in ``shift``'s bucket, which backward does not start
    with: two more gathers per step."""
    data = gb.mse_batches(3, d_out=5, d_in=5)
    want = gb.reference(ShiftAfterChildren(), gb.mse_loss, data, gb.torch_sgd)
    for out in fzero.SimWorld(world).run(_shift_body, ShiftAfterChildren(), data):
        gb.assert_parity(out, want)
        for order in out["orders"]:
            assert (tuple(order.forward), tuple(order.backward)) == ((0, 1, 2, 3), (3, 2)), (
                order)
        # after the first step: forward gathers every bucket once, backward b again (c is
        # kept from forward); ring accounting charges (N - 1) / N of each
        sizes = out["bucket_bytes"]
        want_bytes = (sum(sizes) + sizes[2]) * (world - 1) // world
        assert out["gathered"][1:] == [want_bytes] * 2, (out["gathered"], want_bytes)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_state_whose_tensors_a_tree_map_converted_is_refused_before_forward(
        stage: int) -> None:
    """``tree_map(lambda t: t.float(), state)`` on a float64 state ran forward and backward and
    failed in the update naming internal buffers ('grads[0] ... expected params[0]'s ...'), a
    probe; the step and the eval step now name the bucket and what it was built with."""

    def body(comm: Any) -> list[str]:
        model = gb.MLP64()
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        converted = torch.utils._pytree.tree_map(
            lambda t: t.float() if t.is_floating_point() else t, state)
        batch = tuple(t.float() for t in gb.mse_batches(1, rows=4)[0])
        messages = []
        for run in (fzero.make_train_step(model, gb.mse_loss),
                    fzero.make_eval_step(model, gb.mse_loss)):
            with pytest.raises(ValueError) as caught:
                run(converted, batch)
            messages.append(str(caught.value))
        return messages

    for message in fzero.SimWorld(1).run(body)[0]:
        assert "holds a parameter buffer of torch.float32" in message, message
        assert "was built with torch.float64" in message, message


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_ema_of_a_bfloat16_state_keeps_its_master_exact_and_eval_says_why_it_refuses(
        stage: int, tmp_path: Any) -> None:
    """The README's EMA recipe lerps every leaf in its own dtype. Over a bfloat16 state with a
    float32 master, the master's EMA is exact (checked against an EMA of each step's
    `full_params(master=True)`), while the bfloat16 parameters' EMA stands apart from it:
    eval steps and saves refuse such a state, and said only that something wrote through
    ``.data`` (a probe); they name the tree_map now. Stage 3 evaluated, saved and exported
    the bfloat16-rounded EMA silently (a probe): it refuses too."""

    def body(comm: Any) -> tuple[bool, str, str]:
        model = gb.MLP64(dtype=torch.float32)
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.adamw(lr=1e-2),
                           comm=comm, param_dtype=torch.bfloat16)
        ema = fzero.clone_state(state)
        want = {n: t.clone() for n, t in fzero.full_params(state, master=True).items()}
        step = fzero.make_train_step(model, gb.mse_loss)
        for batch in gb.mse_batches(4, rows=4, dtype=torch.bfloat16):
            state, _ = step(state, gb.rank_rows(batch, comm.rank, comm.world_size))
            torch.utils._pytree.tree_map(
                lambda e, s: e.lerp_(s, 0.01) if e.is_floating_point() else e.copy_(s),
                ema, state)
            for name, value in fzero.full_params(state, master=True).items():
                want[name].lerp_(value, 0.01)
        got = fzero.full_params(ema, master=True)
        exact = all(torch.equal(got[n], want[n]) for n in want)
        evaluate = fzero.make_eval_step(model, gb.mse_loss)
        with pytest.raises((ValueError, fzero.StepError)) as caught:
            evaluate(ema, gb.rank_rows(gb.mse_batches(1, rows=4, dtype=torch.bfloat16)[0],
                                       comm.rank, comm.world_size))
        with pytest.raises((ValueError, fzero.checkpoint.CheckpointError)) as unsaved:
            fzero.save(ema, str(tmp_path / "ema"))
        return exact, str(caught.value), str(unsaved.value)

    for exact, message, saving in fzero.SimWorld(2).run(body):
        assert exact
        assert "EMA" in message and "master=True" in message, message
        assert "master=True" in saving, saving
    assert not os.path.exists(tmp_path / "ema")


def test_a_stage_3_eval_compares_parameters_with_their_master_once_until_they_change() -> None:
    """Stage 3's eval step compares every shard with its master copy's cast (one pass and a
    device-to-host copy: 20% of an eval of one row on the CPU, a review); it does so again
    only once the state's tensors changed (another state, a step, a tree_map's lerp_)."""
    calls = []
    real = fzero.step.lost_writes

    def counted(state: Any) -> list[int]:
        calls.append(state.rank)
        return real(state)

    def body(comm: Any) -> str:
        model = gb.MLP64(dtype=torch.float32)
        state = fzero.init(model, stage=3, optimizer=fzero.optim.adamw(lr=1e-2), comm=comm,
                           param_dtype=torch.bfloat16)
        batch = gb.rank_rows(gb.mse_batches(1, rows=4, dtype=torch.bfloat16)[0], comm.rank,
                             comm.world_size)
        evaluate = fzero.make_eval_step(model, gb.mse_loss)
        for _ in range(3):
            evaluate(state, batch)
        state, _ = fzero.make_train_step(model, gb.mse_loss)(state, batch)
        evaluate(state, batch)
        ema = fzero.clone_state(state)
        evaluate(ema, batch)
        state, _ = fzero.make_train_step(model, gb.mse_loss)(state, batch)
        torch.utils._pytree.tree_map(
            lambda e, s: e.lerp_(s, 0.3) if e.is_floating_point() else e.copy_(s), ema, state)
        with pytest.raises((ValueError, fzero.StepError)) as caught:
            evaluate(ema, batch)
        return str(caught.value)

    with mock.patch("fzero.step.lost_writes", counted):
        for message in fzero.SimWorld(2).run(body):
            assert "stand apart from their master copy" in message or "rank(s)" in message
    assert sorted(calls) == [0] * 4 + [1] * 4  # init's state, after the step, the clone, lerped


@pytest.mark.parametrize("stage", [0, 3])
def test_init_refuses_values_param_dtype_would_make_infinite(stage: int) -> None:
    """A float32 value of 1e5 is infinite in float16: `init(param_dtype=torch.float16)` took
    it, and the first step raised that the parameters themselves hold NaN or infinite values,
    naming a checkpoint as the likely cause (a probe)."""
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[0, 0] = 1e5

    def body(comm: Any) -> str:
        with pytest.raises(ValueError) as caught:
            fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm,
                       param_dtype=torch.float16)
        return str(caught.value)

    for message in fzero.SimWorld(2).run(body):
        assert "parameters ['weight']" in message and "beyond float16's range" in message
    fzero.SimWorld(2).run(lambda comm: fzero.init(  # bfloat16 has float32's range
        model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm,
        param_dtype=torch.bfloat16))
