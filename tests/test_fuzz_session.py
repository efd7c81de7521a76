"""Fuzzed training sessions: any interleaving of steps, accumulation, resharding save / load,
freezing and unfreezing, evaluation and rollback trains exactly like one torch process.

A hypothesis `RuleBasedStateMachine` drives a live `SimWorld` session of a float64 TinyGPT
(tied embeddings, two blocks) with a float64 loss. Its rules:

- ``train``: one step on a fresh global batch (N·k rows, k drawn);
- ``train_accumulated``: one step of 2-3 micro-batches, split by ``accum_steps`` or passed as
  `fzero.MicroBatches`;
- ``reshard``: `fzero.save` on every rank, then `fzero.load` into a new world of 1-4 ranks, at
  any stage and bucket policy (given the frozen blocks as ``trainable=``: the session's modules
  keep ``requires_grad=True``, and a load takes the model's flags by default);
- ``freeze`` / ``unfreeze``: save, then load with ``trainable=`` some blocks frozen (the saved
  moments of the rest are kept; torch keeps training the others with theirs) or everything
  trainable again (``weights_only=True``: a fresh optimizer, as the reference builds a new one);
- ``evaluate``: `make_eval_step` on each rank's rows; the mean over ranks equals the reference's
  loss on the global batch;
- ``roll_back``: `clone_state`, a step on the original (which it consumes, and which must equal
  the reference's trial step on a copy), then training continues from the clone.

Invariant after every rule: `full_params` equals the reference model (one process,
`torch.optim.SGD` with momentum or `torch.optim.AdamW`, the same global batches) within 1e-12,
and the state's step count equals the reference optimizer's.

[Note: one live session]
Ranks are threads of a `SimWorld.run` that stays alive between rules: each rank executes the
commands the state machine (in the pytest thread) puts on its queue, so states live in memory
from rule to rule and a save / load happens only where a rule asks for one. Hypothesis draws in
the pytest thread only; the ranks never see it. A rank that raises ends the session, and the
rule that sent the command fails with that rank's error.

Run time is bounded by ``max_examples`` (30 sessions under HYPOTHESIS_PROFILE=ci, 6 otherwise)
and ``stateful_step_count`` (15 rules per session); world sizes and rows are small.
"""

from __future__ import annotations

import copy
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import Tensor

import fzero

from models import TinyGPT, split_batch

TOLERANCE = 1e-12
GROUPS = ("tok_emb", "pos_emb", "blocks.0", "blocks.1", "ln_f")
"""What freezing acts on: a name prefix each (tok_emb freezes the tied lm_head with it)."""
OPTIMIZERS = {
    "sgd": (lambda: fzero.optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.01),
            lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adamw": (lambda: fzero.optim.adamw(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
              lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95),
                                               weight_decay=0.1)),
}
COMMAND_TIMEOUT = 120.0


def loss_fn(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean next-token cross-entropy in the model's float64 (TinyGPT's own casts to float32)."""
    idx, targets = batch
    return F.cross_entropy(call(idx).flatten(0, 1), targets.flatten())


def group_of(name: str) -> str:
    return next(g for g in GROUPS if name == g or name.startswith(g + "."))


class Session:
    """`world` SimWorld ranks running commands until closed (see the module's note)."""

    def __init__(self, world: int, skeleton: torch.nn.Module) -> None:
        self.world = world
        self.models = [copy.deepcopy(skeleton) for _ in range(world)]  # one module per thread
        self.inboxes: list[queue.Queue[Any]] = [queue.Queue() for _ in range(world)]
        self.replies: queue.Queue[tuple[int, bool, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._world, name="fuzz-session", daemon=True)
        self.thread.start()

    def _world(self) -> None:
        try:
            fzero.SimWorld(self.world, timeout=COMMAND_TIMEOUT, copy_args=False).run(self._rank)
        except fzero.SimWorldError:
            pass  # the failing rank already replied with its error

    def _rank(self, comm: fzero.Comm) -> None:
        ctx: dict[str, Any] = {"comm": comm, "model": self.models[comm.rank], "steps": {}}
        while True:
            command = self.inboxes[comm.rank].get()
            if command is None:
                return
            try:
                reply = command(ctx)
            except BaseException as error:
                self.replies.put((comm.rank, False, error))
                raise
            self.replies.put((comm.rank, True, reply))

    def run(self, command: Callable[[dict[str, Any]], Any]) -> list[Any]:
        """`command(ctx)` on every rank; the replies in rank order."""
        for inbox in self.inboxes:
            inbox.put(command)
        replies: list[Any] = [None] * self.world
        for _ in range(self.world):
            try:
                rank, ok, reply = self.replies.get(timeout=COMMAND_TIMEOUT)
            except queue.Empty:
                raise AssertionError("a session rank did not answer in time") from None
            if not ok:
                raise AssertionError(f"rank {rank} of the session raised") from reply
            replies[rank] = reply
        return replies

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        self.thread.join(COMMAND_TIMEOUT)


def train_step(ctx: dict[str, Any], accum: int) -> Callable[..., Any]:
    if accum not in ctx["steps"]:
        ctx["steps"][accum] = fzero.make_train_step(ctx["model"], loss_fn, accum_steps=accum,
                                                    decay=None)
    return ctx["steps"][accum]


class FuzzedSession(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="fzero-fuzz-")
        self.saves = 0
        self.session: Session | None = None
        self.skeleton = TinyGPT(d_model=8, n_layer=2, n_head=2).double()
        self.reference = copy.deepcopy(self.skeleton)

    # --- the reference ------------------------------------------------------------------------

    def fresh_reference_optimizer(self) -> None:
        trainable = [p for p in self.reference.parameters() if p.requires_grad]
        self.torch_opt = OPTIMIZERS[self.opt_name][1](trainable)
        self.torch_steps = 0

    def reference_step(self, batch: tuple[Tensor, Tensor]) -> float:
        self.torch_opt.zero_grad(set_to_none=True)
        loss = loss_fn(self.reference, batch)
        loss.backward()
        self.torch_opt.step()
        self.torch_steps += 1
        return loss.item()

    def batch(self, seed: int, rows_per_rank: int) -> tuple[Tensor, Tensor]:
        return TinyGPT.make_batch(seed, rows_per_rank * self.world)

    # --- rules --------------------------------------------------------------------------------

    @initialize(world=st.integers(1, 4), stage=st.integers(0, 3),
                opt_name=st.sampled_from(sorted(OPTIMIZERS)))
    def start(self, world: int, stage: int, opt_name: str) -> None:
        self.world, self.stage, self.opt_name = world, stage, opt_name
        self.frozen: set[str] = set()
        self.fresh_reference_optimizer()
        self.session = Session(world, self.skeleton)
        optimizer = OPTIMIZERS[opt_name][0]

        def build(ctx: dict[str, Any]) -> None:
            ctx["state"] = fzero.init(ctx["model"], stage=stage, optimizer=optimizer(),
                                      comm=ctx["comm"])

        self.session.run(build)

    @rule(seed=st.integers(0, 10**6), rows=st.integers(1, 3))
    def train(self, seed: int, rows: int) -> None:
        batch = self.batch(seed, rows)

        def step(ctx: dict[str, Any]) -> float:
            comm = ctx["comm"]
            ctx["state"], metrics = train_step(ctx, 1)(
                ctx["state"], split_batch(batch, comm.rank, comm.world_size))
            return metrics["loss"]

        losses = self.session.run(step)
        expected = self.reference_step(batch)
        assert losses == pytest.approx([expected] * self.world, rel=TOLERANCE, abs=TOLERANCE)

    @rule(seed=st.integers(0, 10**6), accum=st.integers(2, 3), rows=st.integers(1, 2),
          explicit=st.booleans())
    def train_accumulated(self, seed: int, accum: int, rows: int, explicit: bool) -> None:
        batch = self.batch(seed, accum * rows)

        def step(ctx: dict[str, Any]) -> float:
            comm = ctx["comm"]
            mine = split_batch(batch, comm.rank, comm.world_size)
            if explicit:
                micro = fzero.MicroBatches(zip(*(t.chunk(accum) for t in mine), strict=True))
                ctx["state"], metrics = train_step(ctx, 1)(ctx["state"], micro)
            else:
                ctx["state"], metrics = train_step(ctx, accum)(ctx["state"], mine)
            return metrics["loss"]

        losses = self.session.run(step)
        expected = self.reference_step(batch)  # the global batch's mean: the same objective
        assert losses == pytest.approx([expected] * self.world, rel=TOLERANCE, abs=TOLERANCE)

    def save_and_reload(self, world: int, **load_kwargs: Any) -> None:
        """Save on every rank, close the world, load into a new world of `world` ranks."""
        self.saves += 1
        path = os.path.join(self.dir, f"ckpt-{self.saves}")
        self.session.run(lambda ctx: fzero.save(ctx["state"], path))
        self.session.close()
        self.world = world
        self.session = Session(world, self.skeleton)

        def load(ctx: dict[str, Any]) -> None:
            ctx["state"] = fzero.load(path, model=ctx["model"], comm=ctx["comm"],
                                      optimizer=OPTIMIZERS[self.opt_name][0](), **load_kwargs)

        self.session.run(load)

    @rule(world=st.integers(1, 4), stage=st.integers(0, 3),
          buckets=st.sampled_from([None, 64, 400]))
    def reshard(self, world: int, stage: int, buckets: int | None) -> None:
        self.stage = stage
        # The session's modules keep requires_grad=True: what is frozen is said each time
        # (a load takes the model's flags by default, as init does).
        self.save_and_reload(world, stage=stage, buckets=buckets, trainable=self.flags())

    @precondition(lambda self: len(self.frozen) < len(GROUPS) - 1)
    @rule(data=st.data())
    def freeze(self, data: st.DataObject) -> None:
        trainable = [g for g in GROUPS if g not in self.frozen]
        more = data.draw(st.sets(st.sampled_from(trainable), min_size=1,
                                 max_size=len(trainable) - 1), label="freeze")
        self.frozen |= more
        flags = self.flags()
        for name, p in self.reference.named_parameters():
            p.requires_grad_(flags[name])
            p.grad = None  # torch.optim skips it from now on, keeping its moments unused
        self.save_and_reload(self.world, trainable=flags)

    def flags(self) -> dict[str, bool]:
        """Which parameters train now, by primary name (ties once)."""
        return {n: group_of(n) not in self.frozen for n, _ in self.reference.named_parameters()}

    @precondition(lambda self: bool(self.frozen))
    @rule()
    def unfreeze(self) -> None:
        self.frozen = set()
        self.reference.requires_grad_(True)
        self.fresh_reference_optimizer()  # weights_only: both start a fresh optimizer
        self.save_and_reload(self.world, trainable=lambda name: True, weights_only=True)

    @rule(seed=st.integers(0, 10**6), rows=st.integers(1, 3))
    def evaluate(self, seed: int, rows: int) -> None:
        batch = self.batch(seed, rows)

        def evaluate(ctx: dict[str, Any]) -> float:
            comm = ctx["comm"]
            evaluator = fzero.make_eval_step(ctx["model"], loss_fn)
            return float(evaluator(ctx["state"], split_batch(batch, comm.rank, comm.world_size)))

        losses = self.session.run(evaluate)
        with torch.no_grad():
            expected = loss_fn(self.reference, batch).item()
        assert sum(losses) / self.world == pytest.approx(expected, rel=TOLERANCE, abs=TOLERANCE)

    @rule(seed=st.integers(0, 10**6), rows=st.integers(1, 2))
    def roll_back(self, seed: int, rows: int) -> None:
        """A step on the original state, then training goes on from a clone taken before it."""
        batch = self.batch(seed, rows)
        trial = copy.deepcopy((self.reference, self.torch_opt, self.torch_steps))
        self.reference_step(batch)
        stepped = {n: p.detach().clone() for n, p in self.reference.named_parameters()}
        self.reference, self.torch_opt, self.torch_steps = trial

        def step_and_roll_back(ctx: dict[str, Any]) -> dict[str, Tensor]:
            comm = ctx["comm"]
            kept = fzero.clone_state(ctx["state"])
            after, _ = train_step(ctx, 1)(ctx["state"], split_batch(batch, comm.rank,
                                                                     comm.world_size))
            with pytest.raises(ValueError, match="consumed by train step"):
                fzero.full_params(ctx["state"])
            params = fzero.full_params(after)
            ctx["state"] = kept
            return params

        for params in self.session.run(step_and_roll_back):
            for name, value in stepped.items():
                torch.testing.assert_close(params[name], value, rtol=0, atol=TOLERANCE)

    # --- the invariant ------------------------------------------------------------------------

    @invariant()
    def parameters_equal_the_reference(self) -> None:
        if self.session is None:
            return
        replies = self.session.run(lambda ctx: (fzero.full_params(ctx["state"]),
                                                ctx["state"].step))
        expected = dict(self.reference.named_parameters(remove_duplicate=False))
        for params, step in replies:
            assert step == self.torch_steps
            assert params.keys() == expected.keys()
            for name, value in expected.items():
                torch.testing.assert_close(params[name], value.detach(), rtol=0, atol=TOLERANCE,
                                           msg=lambda m, n=name: f"{n}: {m}")

    def teardown(self) -> None:
        if self.session is not None:
            self.session.close()
        shutil.rmtree(self.dir, ignore_errors=True)


FuzzedSession.TestCase.settings = settings(
    settings.default,
    max_examples=30 if os.environ.get("HYPOTHESIS_PROFILE") == "ci" else 6,
    stateful_step_count=15,
    deadline=None,
)
test_fuzzed_session = FuzzedSession.TestCase
