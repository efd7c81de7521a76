"""Every public function, given bad input, raises a clear error and changes nothing.

One table: each row calls one public function (`plan`, `shard`, `unshard`, `flatten`,
`unflatten`, `collectives` and its `gather` / `scatter_grads`, `init`, `make_train_step`, the step
itself, `make_eval_step`, `full_params`, `clone_state`, `save`, `load`, `consolidate`, the
`fzero.optim` constructors and their `init` / `update`, `SimWorld`, `TorchComm`) with one wrong
argument: a wrong type, shape, dtype or device (``meta`` where it cannot work), world size or rank;
an empty model, a model with nothing to train, an integer parameter marked trainable,
overlapping tensors, mixed devices, batches that do not split. On every rank of a `SimWorld`, the
row asserts

- the exception's type (ValueError / TypeError, `fzero.StepError` on the ranks that were given
  good input, `fzero.checkpoint.CheckpointError` for files) and that its message names the
  argument or parameter (a regular expression per row);
- that nothing was modified: every tensor the call could reach (the model's parameters and
  buffers, the inputs, the state's parameters, master copy, moments and buffers, its step, skip
  count, loss scale and lease) is bitwise what it was, and every file under the row's directory
  has the same bytes. (The state's gradient buffers are scratch: a step that fails after its
  backward leaves that backward's gradients there, and the next step zeroes them first.)

A row whose call passes silently, hangs, or raises an unclear error is a bug in fzero: it is
marked ``xfail(strict=True)`` with the reason, so the row starts failing (and must be unmarked)
the day it is fixed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

import fzero
from fzero.checkpoint import CheckpointError
from fzero.comm import Comm

import guarantee_bodies as gb
from models import MLP, FrozenMix, split_batch

ROWS = 8  # global batch rows: 4 per rank at N = 2


class Case(NamedTuple):
    """One row: `call(ctx)` must raise `error` with a message matching `match` on every rank.

    `stage` builds ``ctx.state`` at that stage first (None: no state); `setup(ctx)` runs before
    the "nothing changed" snapshot. `others` is ``(type, pattern)`` for ranks that raise another
    error than the rank given the bad input (``bad_rank``: that rank; None: every rank). `bug`
    marks a row fzero does not pass yet.
    """

    name: str
    call: Callable[[Ctx], Any]
    error: type[BaseException] | tuple[type[BaseException], ...]
    match: str
    world: int = 2
    stage: int | None = None
    setup: Callable[[Ctx], Any] | None = None
    bad_rank: int | None = None
    others: tuple[type[BaseException], str] | None = None
    timeout: float = 30.0
    bug: str | None = None


class Ctx:
    """What a row's call works on, for one rank: a model, its parameters, a layout, an
    optimizer, this rank's batch, optionally a state, and a directory shared by the ranks."""

    def __init__(self, comm: Comm, root: str, stage: int | None) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.root = root
        self.model = MLP()
        self.params = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        self.layout = fzero.plan(self.params, comm.world_size)
        self.optimizer = fzero.optim.adamw(lr=1e-2, weight_decay=0.1)
        self.batch = split_batch(MLP.make_batch(0, ROWS), comm.rank, comm.world_size)
        self.held: list[Any] = []  # more tensors the row may touch, snapshotted too
        self.state = None
        if stage is not None:
            self.state = fzero.init(self.model, stage=stage, optimizer=self.optimizer, comm=comm)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def step(self, **kwargs: Any) -> Callable[..., Any]:
        return fzero.make_train_step(self.model, MLP.loss_fn, decay=None, **kwargs)

    def save(self, name: str = "c") -> str:
        fzero.save(self.state, self.path(name))
        return self.path(name)

    def save_two(self) -> None:
        """Two checkpoints of one model: ``c`` (step 0) and ``d`` (one step later)."""
        self.save("c")
        stepped, _ = self.step()(fzero.clone_state(self.state), self.batch)
        fzero.save(stepped, self.path("d"))

    def consume(self) -> None:
        """Take one step and keep the *consumed* input state as ``ctx.state``."""
        old = self.state
        self.new_state, _ = self.step()(old, self.batch)
        self.state = old


# ----------------------------------------------------------------------------------------------
# "Nothing changed": a bitwise snapshot of everything a call can reach


def _bits(t: Tensor) -> Tensor:
    t = t.detach()
    if t.is_meta:
        return torch.tensor([hash((t.shape, t.dtype))])
    return t.contiguous().reshape(-1).view(torch.uint8).clone()


def _tensors(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, Tensor):
        out[prefix] = (tuple(value.shape), value.dtype, str(value.device), _bits(value))
    elif isinstance(value, dict):
        for k, v in value.items():
            _tensors(v, f"{prefix}.{k}", out)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _tensors(v, f"{prefix}[{i}]", out)
    elif value is not None:
        out[prefix] = value


def snapshot(ctx: Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _tensors(dict(ctx.model.named_parameters()), "model", out)
    _tensors(dict(ctx.model.named_buffers()), "model.buffer", out)
    _tensors(ctx.params, "params", out)
    _tensors(ctx.batch, "batch", out)
    _tensors(ctx.held, "held", out)
    state = ctx.state
    if state is not None:
        # Not `state.grads`: scratch that every step zeroes before its first backward and no
        # one reads between steps (a save does not store them).
        for part in ("params", "master", "moments", "buffers"):
            _tensors(getattr(state, part), f"state.{part}", out)
        for part in ("step", "skipped", "loss_scale", "param_steps", "stage"):
            out[f"state.{part}"] = getattr(state, part)
        out["state.consumed_by"] = state.lease.consumed_by
    if ctx.rank == 0:
        for folder, _, files in os.walk(ctx.root):
            for name in files:
                with open(os.path.join(folder, name), "rb") as f:
                    out[f"file {os.path.relpath(os.path.join(folder, name), ctx.root)}"] = (
                        hashlib.sha256(f.read()).hexdigest())
    return out


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    keys = sorted(set(before) | set(after))
    diff = []
    for key in keys:
        a, b = before.get(key), after.get(key)
        if isinstance(a, tuple) and a and isinstance(a[-1], Tensor):
            same = isinstance(b, tuple) and a[:3] == b[:3] and torch.equal(a[3], b[3])
        else:
            same = a == b
        if not same:
            diff.append(key)
    return diff


def run_case(comm: Comm, case: Case, root: str) -> tuple[str, str, list[str]]:
    """One rank: build, snapshot, call, snapshot; the error's type and message, what changed."""
    ctx = Ctx(comm, root, case.stage)
    if case.setup is not None:
        case.setup(ctx)
    comm.barrier()  # every rank's setup (e.g. a save) is complete before rank 0 hashes files
    before = snapshot(ctx)
    try:
        case.call(ctx)
    except Exception as error:  # what the row checks
        raised: BaseException | None = error
    else:
        raised = None
    comm.barrier()
    after = snapshot(ctx)
    if raised is None:
        return "no error", "", changed(before, after)
    return type(raised).__name__, str(raised), changed(before, after)


# ----------------------------------------------------------------------------------------------
# Helpers the rows use


def _quantized() -> Tensor:
    """A qint8 tensor (torch warns that such tensors are deprecated). Made once, on the main
    thread at import: warnings filters are process-wide, so a `catch_warnings` in one SimWorld
    rank's thread can restore the "error" filter while the other rank's is creating its tensor
    (CI saw torch's deprecation warning escape that way)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8)


QUANTIZED = _quantized()


def meta_module(model: nn.Module) -> nn.Module:
    return model.to("meta")


class Empty(nn.Module):
    """No parameters at all."""

    def forward(self, x: Tensor) -> Tensor:
        return x.sum() * 0


def int_param_model() -> nn.Module:
    model = MLP()
    model.count = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    return model


def mixed_device_model() -> nn.Module:
    model = MLP()
    model.fc2.to("meta")
    return model


def shards(ctx: Ctx) -> list[tuple[Tensor, ...]]:
    return [fzero.shard(ctx.params, ctx.layout, r) for r in range(ctx.layout.world_size)]


def hold(ctx: Ctx, *values: Any) -> Any:
    ctx.held.extend(values)
    return values


def optimizer_inputs(ctx: Ctx) -> None:
    """params, grads and fresh AdamW moments of two flat tensors, held for the snapshot."""
    params = [torch.randn(6, generator=torch.Generator().manual_seed(1)), torch.ones(5)]
    grads = [torch.full((6,), 0.5), torch.full((5,), -0.25)]
    ctx.opt_args = (grads, ctx.optimizer.init(params), params)
    hold(ctx, *ctx.opt_args)


def update(ctx: Ctx, *, grads: Any = None, moments: Any = None, params: Any = None,
           step: Any = 1, **kwargs: Any) -> None:
    g, m, p = ctx.opt_args
    ctx.optimizer.update(g if grads is None else grads, m if moments is None else moments,
                         p if params is None else params, step=step, **kwargs)


def load(ctx: Ctx, **kwargs: Any) -> Any:
    kwargs.setdefault("model", MLP())
    kwargs.setdefault("comm", ctx.comm)
    return fzero.load(ctx.path("c"), **kwargs)


def init(ctx: Ctx, model: Any = None, **kwargs: Any) -> Any:
    kwargs.setdefault("stage", 3)
    kwargs.setdefault("optimizer", ctx.optimizer)
    kwargs.setdefault("comm", ctx.comm)
    return fzero.init(ctx.model if model is None else model, **kwargs)


def per_rank(ctx: Ctx, bad: Any, good: Any) -> Any:
    """`bad` on rank 1, `good` elsewhere."""
    return bad if ctx.rank == 1 else good


def rows(batch: tuple[Tensor, ...], n: int) -> tuple[Tensor, ...]:
    return tuple(t[:n] for t in batch)


def raise_in_init_fn(module: nn.Module) -> None:
    raise ValueError(f"init_fn cannot initialize {type(module).__name__}")


# ----------------------------------------------------------------------------------------------
# The table

VE, TE, SE, CE = ValueError, TypeError, fzero.StepError, CheckpointError

CASES = [
    # --- plan ---------------------------------------------------------------------------------
    Case("plan: world_size 0", lambda c: fzero.plan(c.params, 0), VE, "world_size"),
    Case("plan: world_size a float", lambda c: fzero.plan(c.params, 2.0), VE, "world_size"),
    Case("plan: world_size a bool", lambda c: fzero.plan(c.params, True), VE, "world_size"),
    Case("plan: params an int", lambda c: fzero.plan(3, 2), TE, "params must be an nn.Module"),
    Case("plan: a leaf is a list", lambda c: fzero.plan({"w": [1.0]}, 2), TE,
         "parameter 'w' is a list"),
    Case("plan: a sparse leaf", lambda c: fzero.plan({"s": torch.eye(3).to_sparse()}, 2), TE,
         "parameter 's' is a sparse tensor"),
    Case("plan: a nested leaf", lambda c: fzero.plan(
        {"n": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)],
                                         layout=torch.jagged)}, 2), TE,
         "parameter 'n' is a nested tensor"),
    Case("plan: a quantized leaf", lambda c: fzero.plan({"q": QUANTIZED}, 2), TE,
         "parameter 'q' is a quantized tensor"),
    Case("plan: a bit-packed leaf", lambda c: fzero.plan(
        {"b": torch.zeros(3, dtype=torch.int16).view(torch.bits16)}, 2), TE,
         "parameter 'b' has dtype torch.bits16"),
    Case("plan: a name is not a str", lambda c: fzero.plan({1: torch.zeros(2)}, 2), TE,
         "parameter names must be str"),
    Case("plan: integer parameter marked trainable",
         lambda c: fzero.plan({"n": torch.zeros(3, dtype=torch.int64)}, 2, trainable=["n"]), VE,
         "parameter 'n' is trainable but has dtype torch.int64"),
    Case("plan: trainable names an unknown parameter",
         lambda c: fzero.plan(c.model, 2, trainable={"nope": True}), VE,
         r"trainable= names unknown parameters: \['nope'\]"),
    Case("plan: trainable a str", lambda c: fzero.plan(c.model, 2, trainable="fc1.weight"), TE,
         "trainable must be"),
    Case("plan: buckets a bool", lambda c: fzero.plan(c.model, 2, buckets=True), TE,
         "buckets must be"),
    Case("plan: buckets cap 0", lambda c: fzero.plan(c.model, 2, buckets=0), VE,
         "bucket size cap must be >= 1"),
    Case("plan: buckets a str", lambda c: fzero.plan(c.model, 2, buckets="fc1"), TE,
         "buckets must be"),
    Case("plan: buckets repeat a parameter",
         lambda c: fzero.plan(c.model, 2, buckets=[["fc1.weight", "fc1.bias"],
                                                   ["fc1.weight", "fc2.weight", "fc2.bias"]]),
         VE, r"parameter 'fc1.weight' is in buckets\[0\] and buckets\[1\]"),
    Case("plan: buckets miss a parameter",
         lambda c: fzero.plan(c.model, 2, buckets=[["fc1.weight", "fc1.bias", "fc2.weight"]]),
         VE, r"buckets= lists no bucket for parameters \['fc2.bias'\]"),
    Case("plan: buckets a class with a mapping",
         lambda c: fzero.plan(c.params, 2, buckets=nn.Linear), TE, "needs plan\\(model"),
    Case("plan: cap 0", lambda c: fzero.plan(c.model, 2, cap=0), VE, "cap must be"),
    Case("plan: floor 0", lambda c: fzero.plan(c.model, 2, floor=0), VE, "floor must be"),
    # --- shard / unshard / flatten / unflatten ------------------------------------------------
    Case("bucket_shards: a longer buffer",
         lambda c: fzero.bucket_shards(torch.zeros(c.layout.buckets[0].padded_numel + 2),
                                       c.layout.buckets[0]), VE, "needs a flat buffer"),
    Case("bucket_shards: a 2-D buffer",
         lambda c: fzero.bucket_shards(torch.zeros(c.layout.buckets[0].padded_numel, 1),
                                       c.layout.buckets[0]), VE, "needs a flat buffer"),
    Case("shard: rank == world_size", lambda c: fzero.shard(c.params, c.layout, 2), VE,
         r"rank must be an int in \[0, 2\), got rank=2"),
    Case("shard: rank -1", lambda c: fzero.shard(c.params, c.layout, -1), VE, "rank=-1"),
    Case("shard: rank a bool", lambda c: fzero.shard(c.params, c.layout, True), VE, "rank=True"),
    Case("shard: rank a str", lambda c: fzero.shard(c.params, c.layout, "0"), VE, "rank='0'"),
    Case("shard: params a list", lambda c: fzero.shard(list(c.params.values()), c.layout, 0),
         TE, "params must be a mapping"),
    Case("shard: a parameter missing",
         lambda c: fzero.shard({k: v for k, v in c.params.items() if k != "fc2.bias"}, c.layout,
                               0), VE, "parameter 'fc2.bias' is missing"),
    Case("shard: an unknown parameter",
         lambda c: fzero.shard({**c.params, "extra": torch.zeros(1)}, c.layout, 0), VE,
         r"parameters not in the layout: \['extra'\]"),
    Case("shard: wrong shape",
         lambda c: fzero.shard({**c.params, "fc1.weight": c.params["fc1.weight"].t()}, c.layout,
                               0), VE, r"parameter 'fc1.weight' has shape \(7, 13\)"),
    Case("shard: wrong dtype",
         lambda c: fzero.shard({**c.params, "fc1.bias": c.params["fc1.bias"].double()}, c.layout,
                               0), VE, "parameter 'fc1.bias' has .* dtype torch.float64"),
    Case("shard: mixed devices",
         lambda c: fzero.shard({**c.params, "fc1.bias": c.params["fc1.bias"].to("meta")},
                               c.layout, 0), VE, r"several devices \['cpu', 'meta'\]"),
    Case("flatten: a leaf not a tensor",
         lambda c: fzero.flatten({**c.params, "fc2.bias": [0.0] * 5}, c.layout), TE,
         "parameter 'fc2.bias' is a list"),
    Case("flatten: wrong shape",
         lambda c: fzero.flatten({**c.params, "fc2.bias": torch.zeros(6)}, c.layout), VE,
         r"parameter 'fc2.bias' has shape \(6,\)"),
    Case("unshard: one rank short", lambda c: fzero.unshard(shards(c)[:1], c.layout), VE,
         "one shard list per rank: expected 2, got 1"),
    Case("unshard: a shard too long",
         lambda c: fzero.unshard([shards(c)[0], [torch.zeros(1000)]], c.layout), VE,
         r"shards of rank 1: bucket 0 \('fc1..fc2'\) expects a 1-D float32 tensor"),
    Case("unshard: a shard of another dtype",
         lambda c: fzero.unshard([shards(c)[0], [s.double() for s in shards(c)[1]]], c.layout),
         VE, "shards of rank 1: bucket 0 .* got shape .* dtype torch.float64"),
    Case("unshard: shards on mixed devices",
         lambda c: fzero.unshard([shards(c)[0], [s.to("meta") for s in shards(c)[1]]], c.layout),
         VE, "shards of rank 1.*device"),
    Case("unflatten: one bucket short", lambda c: fzero.unflatten([], c.layout), VE,
         r"flats: expected one tensor per bucket \(1\), got 0"),
    Case("unflatten: a 2-D buffer",
         lambda c: fzero.unflatten([f.view(1, -1) for f in fzero.flatten(c.params, c.layout)],
                                   c.layout), VE, r"flats: bucket 0 .* got shape \(1, 174\)"),
    Case("unflatten: wrong length",
         lambda c: fzero.unflatten([torch.zeros(3)], c.layout), VE,
         "flats: bucket 0 .* of 174 elements, got shape"),
    # --- collectives: gather, scatter_grads ---------------------------------------------------
    Case("collectives: layout for another world size",
         lambda c: fzero.collectives(fzero.plan(c.params, 3), c.comm), VE,
         "planned for world_size=3 but the comm has world_size=2"),
    Case("collectives: ranks planned different layouts",
         lambda c: fzero.collectives(fzero.plan(c.params, 2, buckets=per_rank(c, 100, None)),
                                     c.comm), VE, "layout fingerprint.*rank"),
    Case("collectives: layout not a ShardLayout", lambda c: fzero.collectives({}, c.comm), TE,
         "layout"),
    Case("collectives: comm None", lambda c: fzero.collectives(c.layout, None), TE, "comm"),
    Case("collectives: integer reduce_dtype",
         lambda c: fzero.collectives(c.layout, c.comm, reduce_dtype=torch.int32), TE,
         "reduce_dtype"),
    Case("collectives: float8 reduce_dtype",
         lambda c: fzero.collectives(c.layout, c.comm, reduce_dtype=torch.float8_e5m2), TE,
         "reduce_dtype must be a floating torch.dtype that training computes in"),
    Case("gather: one shard short",
         lambda c: fzero.collectives(c.layout, c.comm).gather([]), VE,
         r"expected one shard per bucket \(1\), got 0"),
    Case("gather: shard of the wrong length",
         lambda c: fzero.collectives(c.layout, c.comm).gather([torch.zeros(5)]), VE,
         r"shard of bucket 0 \('fc1..fc2'\) must be a 1-D float32 tensor of 87 elements"),
    Case("gather: shard of the wrong dtype",
         lambda c: fzero.collectives(c.layout, c.comm).gather(
             [s.double() for s in shards(c)[c.rank]]), VE, "shard of bucket 0 .*float64"),
    Case("gather: non-contiguous shard",
         lambda c: fzero.collectives(c.layout, c.comm).gather(
             [torch.zeros(174)[::2]]), VE, r"shard of bucket 0 \('fc1..fc2'\) must be contiguous"),
    Case("gather: bucket index out of range",
         lambda c: fzero.collectives(c.layout, c.comm).gather(shards(c)[c.rank], buckets=[1]),
         VE, r"buckets must be distinct indices in range\(1\), got \(1,\)"),
    Case("gather: bucket index a bool",
         lambda c: fzero.collectives(c.layout, c.comm).gather(shards(c)[c.rank], buckets=[True]),
         VE, "buckets must be distinct indices"),
    Case("scatter_grads: unknown parameter",
         lambda c: fzero.collectives(c.layout, c.comm).scatter_grads({"w": torch.zeros(2)}), VE,
         "gradient for unknown parameter 'w'"),
    Case("scatter_grads: wrong shape",
         lambda c: fzero.collectives(c.layout, c.comm).scatter_grads(
             {"fc1.bias": torch.zeros(12)}), VE,
         r"gradient of 'fc1.bias' has shape \(12,\), but the parameter has shape \(13,\)"),
    # (cast silently, where torch refuses a .grad of another dtype: a probe)
    Case("scatter_grads: a gradient of another dtype",
         lambda c: fzero.collectives(c.layout, c.comm).scatter_grads(
             {"fc1.bias": torch.zeros(13, dtype=torch.float64)}), VE,
         r"gradient of 'fc1.bias' is torch.float64, but the parameter is torch.float32"),
    Case("scatter_grads: a list, not a mapping",
         lambda c: fzero.collectives(c.layout, c.comm).scatter_grads([torch.zeros(13)]), TE,
         "grads"),
    Case("scatter_grads: a gradient on meta",
         lambda c: fzero.collectives(c.layout, c.comm).scatter_grads(
             {"fc1.bias": torch.ones(13, device="meta")}), VE, "fc1.bias.*meta"),
    # --- init ---------------------------------------------------------------------------------
    Case("init: stage 4", lambda c: init(c, stage=4), VE, "stage must be one of"),
    Case("init: stage a str", lambda c: init(c, stage="3"), VE, "stage must be one of"),
    Case("init: stage a bool", lambda c: init(c, stage=True), VE, "stage must be one of"),
    Case("init: a torch.optim optimizer", lambda c: init(c, optimizer=torch.optim.AdamW), TE,
         "optimizer must be an fzero.optim.Optimizer"),
    Case("init: integer param_dtype", lambda c: init(c, param_dtype=torch.int32), TE,
         "param_dtype must be a floating torch.dtype"),
    Case("init: param_dtype a str", lambda c: init(c, param_dtype="bfloat16"), TE,
         "param_dtype must be a floating torch.dtype"),
    Case("init: integer master_dtype", lambda c: init(c, master_dtype=torch.int64), TE,
         "master_dtype must be a floating torch.dtype"),
    Case("init: integer reduce_dtype", lambda c: init(c, reduce_dtype=torch.int32), TE,
         "reduce_dtype must be a floating torch.dtype"),
    Case("init: float8 param_dtype", lambda c: init(c, param_dtype=torch.float8_e4m3fn), TE,
         "param_dtype must be a floating torch.dtype that training computes in"),
    Case("init: float8 reduce_dtype", lambda c: init(c, reduce_dtype=torch.float8_e5m2), TE,
         "reduce_dtype must be a floating torch.dtype that training computes in"),
    Case("init: float16 reduce_dtype of float32 parameters",
         lambda c: init(c, reduce_dtype=torch.float16), VE,
         "reduce_dtype=torch.float16 needs float16 parameters"),
    Case("init: float16 master_dtype with Adam's eps=1e-8",
         lambda c: init(c, master_dtype=torch.float16), VE,
         r"adamw's eps=1e-08 is 0 in master_dtype=torch.float16"),
    Case("init: Adam's eps=0 (bucket padding would become NaN, a probe)",
         lambda c: init(c, optimizer=fzero.optim.adamw(eps=0.0)), VE,
         r"adamw's eps=0: bucket padding, whose gradient is always zero, would update to "
         r"0/0 = NaN"),
    Case("init: model a list", lambda c: init(c, model=[torch.zeros(2)]), TE,
         "params must be an nn.Module or a mapping"),
    Case("init: integer parameter marked trainable",
         lambda c: init(c, model=int_param_model(), trainable=lambda name: True), VE,
         "parameter 'count' is trainable but has dtype torch.int64"),
    Case("init: meta model without init_fn or load", lambda c: init(c, model=meta_module(MLP())),
         VE, r"parameters \['fc1.weight', .*\] are on the meta device: pass exactly one of"),
    Case("init: both init_fn and load",
         lambda c: init(c, model=meta_module(MLP()), init_fn=lambda m: None,
                        load=lambda names: {}), VE, "pass exactly one of init_fn= .* or load="),
    Case("init: init_fn for a materialized model", lambda c: init(c, init_fn=lambda m: None), VE,
         "init_fn= and load= are for a model on the meta device"),
    Case("init: mixed devices (part on meta)", lambda c: init(c, model=mixed_device_model()), VE,
         r"parameters \['fc2.weight', 'fc2.bias'\] are on the meta device"),
    Case("init: ranks hold different models",
         lambda c: init(c, model=per_rank(c, FrozenMix(), MLP())), VE,
         "layout fingerprint.*rank"),
    Case("init: load= returns a wrong shape",
         lambda c: init(c, model=meta_module(MLP()), load=lambda names: {n: torch.zeros(2)
                                                                         for n in names}),
         VE, r"parameter 'fc1.weight' has shape \(2,\), expected \(13, 7\)", timeout=2.0),
    Case("init: init_fn raises",
         lambda c: init(c, model=meta_module(MLP()), init_fn=raise_in_init_fn), VE,
         "init_fn cannot initialize", timeout=2.0),
    Case("init: device meta", lambda c: init(c, device="meta"), VE, "device"),
    Case("init: comm None", lambda c: init(c, comm=None), TE, "comm"),
    Case("init: a model with no parameters", lambda c: init(c, model=Empty()), VE,
         "no parameters"),
    # --- make_train_step ----------------------------------------------------------------------
    Case("make_train_step: accum_steps 0", lambda c: c.step(accum_steps=0), VE, "accum_steps"),
    Case("make_train_step: accum_steps a float", lambda c: c.step(accum_steps=2.0), VE,
         "accum_steps"),
    Case("make_train_step: accum_steps a bool", lambda c: c.step(accum_steps=True), VE,
         "accum_steps"),
    Case("make_train_step: clip_norm 0", lambda c: c.step(clip_norm=0.0), VE, "clip_norm"),
    Case("make_train_step: clip_norm NaN", lambda c: c.step(clip_norm=float("nan")), VE,
         "clip_norm"),
    Case("make_train_step: clip_norm infinite", lambda c: c.step(clip_norm=float("inf")), VE,
         r"clip_norm must be a positive finite number or None \(no clipping\)"),
    Case("make_train_step: clip_norm a str", lambda c: c.step(clip_norm="1"), VE, "clip_norm"),
    Case("make_train_step: clip_norm a bool", lambda c: c.step(clip_norm=True), VE, "clip_norm"),
    Case("make_train_step: prefetch 3", lambda c: c.step(prefetch=3), VE, "prefetch"),
    Case("make_train_step: buffers policy", lambda c: c.step(buffers="sync"), VE,
         "buffers must be one of"),
    Case("make_train_step: max_skipped 0", lambda c: c.step(max_skipped=0), VE, "max_skipped"),
    Case("make_train_step: decay not callable",
         lambda c: fzero.make_train_step(c.model, MLP.loss_fn, decay=3), TE,
         "decay must be None or a function"),
    Case("make_train_step: model a dict",
         lambda c: fzero.make_train_step(c.params, MLP.loss_fn), TE, "model must be an nn.Module"),
    Case("make_train_step: loss_fn not callable",
         lambda c: fzero.make_train_step(c.model, 3), TE, "loss_fn"),
    Case("make_train_step: lr a str", lambda c: c.step(lr="0.1"), TE, "lr"),
    Case("make_train_step: streams not SideStreams", lambda c: c.step(streams=3), TE, "streams"),
    # --- the step -----------------------------------------------------------------------------
    Case("step: state not a ShardState", lambda c: c.step()(c.params, c.batch), TE,
         "step needs a ShardState", stage=1),
    Case("step: a consumed state", lambda c: c.step()(c.state, c.batch), VE,
         "consumed by train step 1", stage=3, setup=Ctx.consume),
    Case("step: a consumed state on one rank",
         lambda c: c.step()(per_rank(c, c.state, c.new_state), c.batch), VE,
         "consumed by train step 1", stage=3, setup=Ctx.consume, bad_rank=1,
         others=(SE, r"rank\(s\) \[1\] could not start it")),
    Case("step: rows do not split into accum_steps",
         lambda c: c.step(accum_steps=3)(c.state, c.batch), VE,
         r"batch tensor of shape \(4, 7\) does not split into accum_steps=3", stage=3),
    Case("step: batch tensors of different sizes along dim 0, accum_steps 2",
         lambda c: c.step(accum_steps=2)(c.state, (c.batch[0], c.batch[1][:2])), VE,
         r"the batch's tensors differ in size along dim 0 \(\[\(4, 7\), \(2, ", stage=1),
    Case("step: batch without a tensor and accum_steps 2",
         lambda c: c.step(accum_steps=2)(c.state, None), VE,
         "accum_steps=2 needs a batch with tensors", stage=2),
    Case("step: empty MicroBatches", lambda c: c.step()(c.state, fzero.MicroBatches([])), VE,
         r"MicroBatches\(\[\]\) holds no micro-batch", stage=1),
    # (the 3 were used silently: found by a probe)
    Case("step: MicroBatches of 3 and accum_steps 2",
         lambda c: c.step(accum_steps=2)(c.state, fzero.MicroBatches([c.batch] * 3)), VE,
         r"MicroBatches of 3 micro-batches, but the step was built with accum_steps=2", stage=2),
    # (equal weights: not the batch's mean, silently: found by a probe)
    Case("step: MicroBatches of different sizes without weights",
         lambda c: c.step()(c.state, fzero.MicroBatches([rows(c.batch, 3), rows(c.batch, 1)])),
         VE, r"MicroBatches of different sizes along dim 0 \(\[3, 1\]\).*weights=\[3, 1\]",
         stage=1),
    Case("step: MicroBatches weights not one per micro-batch",
         lambda c: c.step()(c.state, fzero.MicroBatches([c.batch] * 2, weights=[1.0])), VE,
         r"weights=...\) needs one positive finite number per micro-batch \(2\); got \[1.0\]",
         stage=3),
    Case("step: MicroBatches weight zero",
         lambda c: c.step()(c.state, fzero.MicroBatches([c.batch] * 2, weights=[1, 0])), VE,
         r"needs one positive finite number per micro-batch \(2\); got \[1, 0\]", stage=2),
    Case("step: MicroBatches weight not a number",
         lambda c: c.step()(c.state, fzero.MicroBatches([c.batch] * 2, weights=[True, 1])),
         VE, r"needs one positive finite number per micro-batch \(2\); got \[True, 1\]",
         stage=0),
    Case("step: ranks given different batch sizes",
         lambda c: c.step()(c.state, per_rank(c, rows(c.batch, 3), c.batch)), SE,
         r"batches of different sizes \(rows per rank \[4, 3\]\)", stage=3),
    Case("step: another model",
         lambda c: fzero.make_train_step(FrozenMix(), MLP.loss_fn)(c.state, c.batch), VE,
         "was built for a different model: parameters only in the state", stage=0),
    Case("step: another model on one rank",
         lambda c: fzero.make_train_step(per_rank(c, FrozenMix(), c.model), MLP.loss_fn)(
             c.state, c.batch), VE, "was built for a different model", stage=3, bad_rank=1,
         others=(SE, r"rank\(s\) \[1\] could not start it")),
    Case("step: a batch of another dtype",
         lambda c: c.step()(c.state, (c.batch[0].double(), c.batch[1])), RuntimeError,
         "same dtype", stage=3),
    Case("step: a batch on meta",
         lambda c: c.step()(c.state, tuple(t.to("meta") for t in c.batch)), RuntimeError,
         "device", stage=2),
    Case("step: a batch of the wrong width on one rank",
         lambda c: c.step()(c.state, per_rank(c, (c.batch[0][:, :5], c.batch[1]), c.batch)),
         RuntimeError, "shapes cannot be multiplied", stage=3, bad_rank=1,
         others=(SE, r"rank\(s\) \[1\] raised")),
    Case("step: a negative learning rate", lambda c: c.step(lr=-1.0)(c.state, c.batch), VE,
         "lr must be a finite number >= 0.0, got lr=-1.0", stage=1),
    Case("step: loss_fn returns a vector",
         lambda c: fzero.make_train_step(c.model, lambda call, b: call(b[0]).sum(0))(
             c.state, c.batch), VE, r"loss_fn must return a scalar .* got shape \(5,\)",
         stage=3),
    Case("step: every rank's batch has no rows",
         lambda c: c.step()(c.state, rows(c.batch, 0)), VE, "rows", stage=1),
    Case("step: a model with no trainable parameter",
         lambda c: fzero.make_train_step(c.model, MLP.loss_fn)(
             init(c, model=c.model, trainable=lambda name: False), c.batch), VE,
         "no trainable parameter"),
    # --- make_eval_step -----------------------------------------------------------------------
    Case("eval step: a consumed state",
         lambda c: fzero.make_eval_step(c.model, MLP.loss_fn)(c.state, c.batch), VE,
         "consumed by train step 1", stage=1, setup=Ctx.consume),
    Case("eval step: a consumed state, stage 3",
         lambda c: fzero.make_eval_step(c.model, MLP.loss_fn)(c.state, c.batch), VE,
         "consumed by train step 1", stage=3, setup=Ctx.consume),
    Case("eval step: another model",
         lambda c: fzero.make_eval_step(FrozenMix(), MLP.loss_fn)(c.state, c.batch), VE,
         "was built for a different model", stage=1),
    Case("eval step: state not a ShardState",
         lambda c: fzero.make_eval_step(c.model, MLP.loss_fn)(c.params, c.batch), TE,
         "needs a ShardState"),
    Case("make_eval_step: prefetch 5", lambda c: fzero.make_eval_step(c.model, MLP.loss_fn,
                                                                      prefetch=5), VE, "prefetch"),
    Case("make_eval_step: model a dict", lambda c: fzero.make_eval_step(c.params, MLP.loss_fn),
         TE, "model must be an nn.Module"),
    # --- full_params, clone_state -------------------------------------------------------------
    Case("full_params: a consumed state", lambda c: fzero.full_params(c.state), VE,
         "full_params: this state was consumed by train step 1", stage=2, setup=Ctx.consume),
    Case("full_params: not a state", lambda c: fzero.full_params(c.params), TE,
         "full_params needs a ShardState"),
    # (each rank's part went into the others' buffers: a silent mix, or a gloo abort; a probe)
    Case("full_params: master on one rank",
         lambda c: fzero.full_params(c.state, master=per_rank(c, True, False)), VE,
         r"full_params call differs across ranks.*they differ in: master=", stage=3),
    Case("full_params: a state of another step on one rank",
         lambda c: fzero.full_params(per_rank(c, c.new_state, c.state)), VE,
         r"full_params call differs across ranks.*the state \(layout, stage, step, lineage\)",
         stage=1,
         setup=lambda c: setattr(c, "new_state", c.step()(fzero.clone_state(c.state),
                                                            c.batch)[0])),
    Case("full_params: a consumed state on one rank",
         lambda c: fzero.full_params(per_rank(c, c.state, c.new_state)), VE,
         "full_params: this state was consumed by train step 1", stage=2, setup=Ctx.consume,
         bad_rank=1, others=(VE, r"full_params call differs .*a live state")),
    Case("clone_state: a consumed state", lambda c: fzero.clone_state(c.state), VE,
         "clone_state: this state was consumed", stage=3, setup=Ctx.consume),
    Case("clone_state: not a state", lambda c: fzero.clone_state(c.model), TE,
         "clone_state needs a ShardState"),
    # --- save, load, consolidate --------------------------------------------------------------
    Case("save: not a state", lambda c: fzero.save(c.params, c.path("s")), TE,
         "save needs a ShardState"),
    Case("save: the path exists", lambda c: fzero.save(c.state, c.path("c")), CE,
         "exists: pass overwrite=True", stage=3, setup=Ctx.save),
    Case("save: extra not JSON", lambda c: fzero.save(c.state, c.path("s"), extra={"x": {1, 2}}),
         TE, "extra must hold JSON values", stage=1),
    Case("save: extra a list", lambda c: fzero.save(c.state, c.path("s"), extra=[1]), TE,
         "extra must be a mapping", stage=1),
    # JSON would turn these into other values, silently: an int key into a string (merging
    # it with a string key that reads alike), a tuple into a list.
    Case("save: extra with an int key",
         lambda c: fzero.save(c.state, c.path("s"), extra={"pos": {0: 5, "0": 7}}), TE,
         r"extra\['pos'\] has the key 0 \(int\), which JSON stores as the string", stage=1),
    Case("save: extra with a tuple",
         lambda c: fzero.save(c.state, c.path("s"), extra={"shape": [1, (2, 3)]}), TE,
         r"extra\['shape'\]\[1\] is a tuple, which JSON stores as a list", stage=1),
    Case("save: a consumed state", lambda c: fzero.save(c.state, c.path("s")), VE,
         "consumed by train step 1", stage=3, setup=Ctx.consume),
    Case("load: no checkpoint there", lambda c: load(c), CE, "no checkpoint at .*c: no such"),
    # (mixed into one state silently at stage 3: a probe)
    Case("load: ranks given different checkpoints",
         lambda c: fzero.load(per_rank(c, c.path("d"), c.path("c")), model=MLP(), comm=c.comm),
         CE, r"load call differs across ranks.*the checkpoint \(its save id, step and world",
         stage=3, setup=Ctx.save_two),
    Case("load: ranks given different stages", lambda c: load(c, stage=per_rank(c, 2, 3)), CE,
         r"load call differs across ranks.*they differ in: stage, dtypes", stage=1,
         setup=Ctx.save),
    Case("load: ranks given different optimizers (a save before their first step would "
         "write each rank's)",
         lambda c: load(c, optimizer=fzero.optim.adamw(lr=per_rank(c, 2e-3, 1e-3))), CE,
         r"load call differs across ranks.*they differ in: the optimizer and its "
         r"hyperparameters", stage=1, setup=Ctx.save),
    Case("load: stage 5", lambda c: load(c, stage=5), VE, "stage must be one of", stage=1,
         setup=Ctx.save),
    Case("load: another model", lambda c: load(c, model=FrozenMix()), CE,
         "is a checkpoint of another model: parameters only in the checkpoint", stage=1,
         setup=Ctx.save),
    Case("load: model an int", lambda c: load(c, model=3), TE, "params must be an nn.Module",
         stage=1, setup=Ctx.save),
    Case("load: a torch.optim optimizer", lambda c: load(c, optimizer=torch.optim.AdamW), TE,
         "optimizer must be an fzero.optim.Optimizer", stage=1, setup=Ctx.save),
    Case("load: optimizer with other moments",
         lambda c: load(c, optimizer=fzero.optim.sgd(lr=0.1, momentum=0.9)), CE,
         r"holds optimizer moments \['exp_avg', 'exp_avg_sq'\]", stage=1, setup=Ctx.save),
    Case("load: buckets cap 0", lambda c: load(c, buckets=0), VE, "bucket size cap", stage=1,
         setup=Ctx.save),
    Case("load: trainable an int", lambda c: load(c, trainable=3), TE, "trainable must be",
         stage=1, setup=Ctx.save),
    Case("load: path an int", lambda c: fzero.load(3, model=MLP(), comm=c.comm), TE, "path"),
    Case("load: integer param_dtype", lambda c: load(c, param_dtype=torch.int32), TE,
         "param_dtype", stage=1, setup=Ctx.save),
    Case("load: integer master_dtype", lambda c: load(c, master_dtype=torch.int64), TE,
         "master_dtype", stage=1, setup=Ctx.save),
    Case("load: integer reduce_dtype", lambda c: load(c, reduce_dtype=torch.int64), TE,
         "reduce_dtype", stage=2, setup=Ctx.save),
    Case("load: float8 master_dtype", lambda c: load(c, master_dtype=torch.float8_e4m3fn), TE,
         "master_dtype must be a floating torch.dtype that training computes in", stage=1,
         setup=Ctx.save),
    Case("load: float16 reduce_dtype of float32 parameters",
         lambda c: load(c, reduce_dtype=torch.float16), VE,
         "reduce_dtype=torch.float16 needs float16 parameters", stage=2, setup=Ctx.save),
    Case("load: float16 master_dtype with Adam's eps=1e-8",
         lambda c: load(c, master_dtype=torch.float16), VE,
         r"adamw's eps=1e-08 is 0 in master_dtype=torch.float16", stage=1, setup=Ctx.save),
    Case("load: device meta", lambda c: load(c, device="meta"), VE, "device", stage=1,
         setup=Ctx.save),
    Case("load: comm None", lambda c: load(c, comm=None), TE, "comm", stage=1, setup=Ctx.save),
    Case("consolidate: another model", lambda c: fzero.consolidate(c.path("c"), model=FrozenMix()),
         CE, "is not a checkpoint of this model", stage=1, setup=Ctx.save),
    Case("consolidate: no checkpoint there", lambda c: fzero.consolidate(c.path("nothing")), CE,
         "no checkpoint at"),
    Case("consolidate: model an int", lambda c: fzero.consolidate(c.path("c"), model=3), TE,
         "model", stage=1, setup=Ctx.save),
    # --- fzero.optim --------------------------------------------------------------------------
    Case("adamw: lr negative", lambda c: fzero.optim.adamw(lr=-1e-3), VE, "lr must be", world=1),
    Case("adamw: lr infinite", lambda c: fzero.optim.adamw(lr=float("inf")), VE, "lr must be",
         world=1),
    Case("adamw: lr a str", lambda c: fzero.optim.adamw(lr="1e-3"), TE, "lr must be a real",
         world=1),
    Case("adamw: beta1 == 1", lambda c: fzero.optim.adamw(betas=(1.0, 0.9)), VE,
         r"betas\[0\] must be", world=1),
    Case("adamw: betas a float", lambda c: fzero.optim.adamw(betas=0.9), VE,
         "betas must be a pair", world=1),
    Case("adamw: eps negative", lambda c: fzero.optim.adamw(eps=-1.0), VE, "eps must be",
         world=1),
    Case("adam: weight_decay negative", lambda c: fzero.optim.adam(weight_decay=-0.1), VE,
         "weight_decay must be", world=1),
    Case("sgd: momentum negative", lambda c: fzero.optim.sgd(lr=0.1, momentum=-0.9), VE,
         "momentum must be", world=1),
    Case("sgd: nesterov an int", lambda c: fzero.optim.sgd(lr=0.1, momentum=0.9, nesterov=1),
         TE, "nesterov must be a bool", world=1),
    Case("sgd: nesterov with dampening",
         lambda c: fzero.optim.sgd(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), VE,
         "nesterov=True needs", world=1),
    Case("optimizer init: integer params",
         lambda c: c.optimizer.init([torch.zeros(3, dtype=torch.int32)]), VE,
         r"params\[0\] must be floating point", world=1),
    Case("optimizer init: a tensor, not a list", lambda c: c.optimizer.init(torch.zeros(3)), TE,
         "params must be a sequence of tensors", world=1),
    Case("update: step 0", lambda c: update(c, step=0), VE, "step must be an int >= 1",
         world=1, setup=optimizer_inputs),
    Case("update: step a float", lambda c: update(c, step=1.0), TE, "step must be an int",
         world=1, setup=optimizer_inputs),
    Case("update: lr NaN", lambda c: update(c, lr=float("nan")), VE, "lr must be a finite",
         world=1, setup=optimizer_inputs),
    Case("update: one gradient short", lambda c: update(c, grads=c.opt_args[0][:1]), VE,
         r"len\(grads\)=1 does not match len\(params\)=2", world=1, setup=optimizer_inputs),
    Case("update: a gradient of the wrong shape",
         lambda c: update(c, grads=[torch.zeros(6), torch.zeros(4)]), VE,
         r"grads\[1\] has shape=\(4,\)", world=1, setup=optimizer_inputs),
    Case("update: an integer gradient",
         lambda c: update(c, grads=[torch.zeros(6, dtype=torch.int64), torch.zeros(5)]), VE,
         r"grads\[0\] has .*dtype=torch.int64", world=1, setup=optimizer_inputs),
    Case("update: a gradient on meta",
         lambda c: update(c, grads=[torch.zeros(6, device="meta"), torch.zeros(5)]), VE,
         r"grads\[0\] has .*device=meta", world=1, setup=optimizer_inputs),
    Case("update: a moment missing", lambda c: update(c, moments={"exp_avg": ()}), VE,
         r"moments has keys \['exp_avg'\]", world=1, setup=optimizer_inputs),
    Case("update: decay range past the end",
         lambda c: update(c, decay=[[(0, 7)], []]), VE, r"decay\[0\] has range \(0, 7\)",
         world=1, setup=optimizer_inputs),
    Case("update: overlapping decay ranges",
         lambda c: update(c, decay=[[(0, 4), (2, 6)], []]), VE, "overlapping ranges",
         world=1, setup=optimizer_inputs),
    Case("update: decay ranges of a non-contiguous parameter",
         lambda c: c.optimizer.update(*c.held, step=1, decay=[[(0, 2)]]), VE,
         r"params\[0\] must be contiguous", world=1,
         setup=lambda c: hold(c, [torch.zeros(2, 3).t()], c.optimizer.init([torch.zeros(2, 3).t()]),
                              [torch.ones(2, 3).t()])),
    Case("update: the same parameter twice",
         lambda c: update(c, grads=[c.opt_args[0][0]] * 2,
                          moments=c.optimizer.init([c.opt_args[2][0]] * 2),
                          params=[c.opt_args[2][0]] * 2), VE, "overlap", world=1,
         setup=optimizer_inputs),
    Case("update: overlapping parameters",
         lambda c: update(c, grads=[torch.ones(4), torch.ones(4)],
                          moments=c.optimizer.init([torch.ones(4)] * 2),
                          params=[c.opt_args[2][0][:4], c.opt_args[2][0][2:]]), VE, "overlap",
         world=1, setup=optimizer_inputs),
    Case("update: one gradient tensor for two parameters",  # (the update writes grads)
         lambda c: update(c, grads=[c.opt_args[0][0]] * 2,
                          moments=c.optimizer.init([torch.ones(6), torch.ones(6)]),
                          params=[torch.ones(6), torch.ones(6)]), VE,
         r"grads\[0\] and grads\[1\] overlap in memory", world=1, setup=optimizer_inputs),
    Case("update: a gradient that is a moment",
         lambda c: update(c, grads=[c.opt_args[1]["exp_avg"][0], c.opt_args[0][1]]), VE,
         r"grads\[0\] and moments\['exp_avg'\]\[0\] overlap in memory", world=1,
         setup=optimizer_inputs),
    Case("update: an expanded gradient",
         lambda c: update(c, grads=[torch.ones(1).expand(6), c.opt_args[0][1]]), VE,
         r"grads\[0\] repeats elements in memory \(an expanded tensor", world=1,
         setup=optimizer_inputs),
    # --- SimWorld, TorchComm ------------------------------------------------------------------
    Case("SimWorld: 0 ranks", lambda c: fzero.SimWorld(0), VE, "SimWorld needs n >= 1", world=1),
    Case("SimWorld: n a float", lambda c: fzero.SimWorld(2.0), VE, "n=2.0", world=1),
    Case("SimWorld: n a str", lambda c: fzero.SimWorld("2"), VE, "n='2'", world=1),
    Case("SimWorld: timeout 0", lambda c: fzero.SimWorld(2, timeout=0), VE,
         "timeout > 0 seconds", world=1),
    Case("SimWorld: timeout NaN", lambda c: fzero.SimWorld(2, timeout=float("nan")), VE,
         "timeout > 0 seconds", world=1),
    Case("SimWorld: timeout a str", lambda c: fzero.SimWorld(2, timeout="1"), VE,
         "timeout", world=1),
    Case("SimWorld.run: fn not callable", lambda c: fzero.SimWorld(2).run(3), fzero.SimWorldError,
         "'int' object is not callable", world=1),
    Case("TorchComm: no process group", lambda c: fzero.TorchComm(), VE,
         "TorchComm needs an initialized torch.distributed process group", world=1),
]


def _param(case: Case) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=case.bug)] if case.bug else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_bad_input_raises_clearly_and_changes_nothing(case: Case, tmp_path) -> None:
    results = fzero.SimWorld(case.world, timeout=case.timeout).run(run_case, case, str(tmp_path))
    for rank, (kind, message, diff) in enumerate(results):
        error, pattern = case.error, case.match
        if case.others is not None and case.bad_rank is not None and rank != case.bad_rank:
            error, pattern = case.others
        names = tuple(e.__name__ for e in (error if isinstance(error, tuple) else (error,)))
        assert kind in names, f"rank {rank}: expected {names}, got {kind}: {message}"
        assert re.search(pattern, message), f"rank {rank}: {pattern!r} not in {message!r}"
        assert not diff, f"rank {rank}: the failed call changed {diff}"


def test_the_readme_gives_the_tables_size() -> None:
    """The README's guarantees quote how many cases this table holds."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    quoted = re.search(r"a table of (\d+) cases in `tests/test_bad_inputs.py`", readme)
    assert quoted is not None and int(quoted.group(1)) == len(CASES)


def test_the_table_covers_every_public_function() -> None:
    """A new public function gets rows, or a reason here why not."""
    covered = {case.name.split(":")[0].split(" ")[0] for case in CASES}
    not_called_with_bad_input = {
        "Bucket", "Entry", "ShardLayout", "ShardState", "LossScale", "Comm", "CommCounters",
        "Work", "Pending", "Collectives", "Streams", "EmulatedStreams", "SimComm",  # types
        "CollectiveError", "CollectiveTimeout", "StepError", "SimWorldError",
        "OutsideOwnerError",  # errors
        "checkpoint", "memory", "optim",  # modules (their functions have rows or own tests)
        "MicroBatches", "decay_matrices",  # a list, a rule
        "distributed", "init_distributed", "destroy_distributed",  # tests/test_comm.py
    }
    aliases = {"update": "optim", "adamw": "optim", "adam": "optim", "sgd": "optim",
               "optimizer": "optim", "eval": "make_eval_step", "SimWorld.run": "SimWorld",
               "step": "make_train_step", "gather": "collectives", "scatter_grads": "collectives"}
    covered |= {aliases.get(name, name) for name in covered}
    missing = set(fzero.__all__) - covered - not_called_with_bad_input
    assert not missing, f"public functions without bad-input rows: {sorted(missing)}"


def test_torch_comm_arguments_over_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TorchComm`'s own arguments, over a one-process gloo group made here."""
    from fzero.launch import _SLURM_VARS, _TORCHRUN_VARS

    for name in (*_TORCHRUN_VARS, *_SLURM_VARS):
        monkeypatch.delenv(name, raising=False)
    with fzero.distributed(backend="gloo"):
        for below in (-1, 0, timedelta(0)):
            with pytest.raises(ValueError, match="timeout must be above 0 seconds"):
                fzero.TorchComm(timeout=below)
        with pytest.raises(TypeError, match="timeout must be a timedelta or seconds"):
            fzero.TorchComm(timeout="5")
        with pytest.raises(
            ValueError, match=r"transport must be one of \('single', 'pairwise', 'shm'\)"
        ):
            fzero.TorchComm(transport="ring")
        for bad in (-1, 1.5, None):
            with pytest.raises(ValueError, match=f"shm_min_bytes must be an int >= 0, got {bad}"):
                fzero.TorchComm(shm_min_bytes=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="Group 3 is not registered"):
            fzero.TorchComm(group=3)


# ----------------------------------------------------------------------------------------------
# requires_grad flipped after the state was built: trainability is fixed with the state.


def _outcome_after_change(
    comm: Any, *, stage: int, change_rank: int, change: Callable[[nn.Module], None],
    prepare: Callable[[nn.Module], None] | None = None,
) -> Any:
    """Train a step, apply `change` to the module on `change_rank`, step again: None, or the
    second step's exception (type name, message) and the bytes it moved, per rank."""
    model = gb.BatchNormNet()
    if prepare is not None:
        prepare(model)
    state = fzero.init(model, stage=stage, optimizer=gb.make_optimizer(("sgd", gb.SGD)),
                       comm=comm)
    step = fzero.make_train_step(model, gb.mse_loss)
    batch = gb.rank_rows(gb.mse_batches(1, rows=4 * comm.world_size, d_in=5, d_out=3)[0],
                         comm.rank, comm.world_size)
    state, _ = step(state, batch)
    if comm.rank == change_rank:
        change(model)
    return _step_outcome(comm, step, state, batch)


def _step_outcome(comm: Any, step: Callable[..., Any], state: Any, batch: Any) -> Any:
    """None if ``step(state, batch)`` ran, else its exception (type name, message) and the
    bytes it moved."""
    sent = comm.counters.total()
    try:
        step(state, batch)
    except Exception as exc:  # reported to the test, per rank
        return type(exc).__name__, str(exc), comm.counters.total() - sent
    return None


def _flip_outcome(comm: Any, *, flip_rank: int, flag: bool) -> Any:
    """Flip ``requires_grad`` of fc1.bias on `flip_rank` between two steps (unfreezing: it
    starts frozen)."""
    return _outcome_after_change(
        comm, stage=2, change_rank=flip_rank,
        change=lambda model: model.fc1.bias.requires_grad_(flag),
        prepare=(lambda model: model.fc1.bias.requires_grad_(False)) if flag else None)


@pytest.mark.parametrize("flag", [False, True])
def test_flipping_requires_grad_after_the_state_was_built_raises(flag: bool) -> None:
    outcomes = fzero.SimWorld(2).run(_flip_outcome, flip_rank=1, flag=flag)
    kind, message, moved = outcomes[1]
    assert kind == "ValueError" and moved == 0
    assert ("the module's requires_grad differs from the flags the state was built with: "
            f"now {{'fc1.bias': {flag}}}") in message
    assert "build a new state" in message
    kind, message, moved = outcomes[0]
    assert kind == "StepError" and "rank(s) [1] could not start it" in message and moved == 0


def test_unchanged_flags_keep_training() -> None:
    outcomes = fzero.SimWorld(2).run(_flip_outcome, flip_rank=5, flag=True)  # no rank flips
    assert outcomes == [None, None]


def _flags_before_init_body(comm: Any) -> None:
    model = gb.BatchNormNet()
    step = fzero.make_train_step(model, gb.mse_loss)
    model.fc1.requires_grad_(False)
    state = fzero.init(model, stage=1, optimizer=gb.make_optimizer(("sgd", gb.SGD)), comm=comm)
    before = fzero.full_params(state)["fc1.weight"].clone()
    batch = gb.mse_batches(1, rows=4, d_in=5, d_out=3)[0]
    state, _ = step(state, batch)
    assert torch.equal(fzero.full_params(state)["fc1.weight"], before)  # frozen, as set
    model.fc1.requires_grad_(True)
    with pytest.raises(ValueError, match="requires_grad differs from the flags the state was"):
        step(state, batch)


def test_flags_set_before_init_are_the_states_own() -> None:
    """The step may be built before the flags are set: what counts is the state's build."""
    fzero.SimWorld(1).run(_flags_before_init_body)


def _saved_net(comm: Any, path: str) -> tuple[nn.Module, Any, fzero.ShardState]:
    """A stage-1 BatchNormNet state, saved to `path`: the module, the optimizer, the state."""
    model = gb.BatchNormNet()
    opt = gb.make_optimizer(("sgd", gb.SGD))
    state = fzero.init(model, stage=1, optimizer=opt, comm=comm)
    fzero.checkpoint.save(state, path)
    return model, opt, state


def _load_flags_body(comm: Any, path: str) -> None:
    model, opt, _ = _saved_net(comm, path)
    model.fc2.requires_grad_(False)  # resumed with fc2 frozen, as a fine-tuning might
    loaded = fzero.checkpoint.load(path, model=model, stage=1, optimizer=opt, comm=comm,
                                   weights_only=True)
    # The model's flags decide (as at init; they were ignored: fc2 trained on, silently).
    trains = {e.name: b.trainable for b in loaded.layout.buckets for e in b.entries}
    assert trains == {"fc1.weight": True, "fc1.bias": True, "bn.weight": True,
                      "bn.bias": True, "fc2.weight": False, "fc2.bias": False}
    fc2 = fzero.full_params(loaded)["fc2.weight"].clone()
    step = fzero.make_train_step(model, gb.mse_loss)
    loaded, _ = step(loaded, gb.mse_batches(1, rows=4, d_in=5, d_out=3)[0])
    assert torch.equal(fzero.full_params(loaded)["fc2.weight"], fc2)
    model.fc2.requires_grad_(True)
    with pytest.raises(ValueError, match=r"requires_grad differs from the flags the state was "
                                         r"built with: now \{'fc2.bias': True, 'fc2.weight': "
                                         r"True\}"):
        step(loaded, gb.mse_batches(1, rows=4, d_in=5, d_out=3)[0])


def test_a_checkpoint_load_takes_the_flags_of_its_model(tmp_path) -> None:
    fzero.SimWorld(1).run(_load_flags_body, str(tmp_path / "c"))


def _unfrozen_load_body(comm: Any, path: str) -> None:
    model = gb.BatchNormNet()
    model.fc2.requires_grad_(False)
    opt = gb.make_optimizer(("sgd", gb.SGD))
    fzero.checkpoint.save(fzero.init(model, stage=2, optimizer=opt, comm=comm), path)
    model.fc2.requires_grad_(True)  # unfrozen for the next phase of a fine-tuning
    with pytest.raises(CheckpointError, match=r"frozen when saved are trainable now .*"
                                              r"\[fc2.bias, fc2.weight\]"):
        fzero.checkpoint.load(path, model=model, optimizer=opt, comm=comm)
    loaded = fzero.checkpoint.load(path, model=model, optimizer=opt, comm=comm,
                                   weights_only=True)
    assert all(b.trainable for b in loaded.layout.buckets)


def test_a_parameter_the_model_unfroze_trains_after_a_load(tmp_path) -> None:
    """It stayed frozen, silently, as saved."""
    fzero.SimWorld(2).run(_unfrozen_load_body, str(tmp_path / "c"))


# ----------------------------------------------------------------------------------------------
# The module's own tensors written after the state was built: a step would ignore them.


def _write_outcome(comm: Any, *, stage: int, write_rank: int, how: str) -> Any:
    """Write into the module's own tensors on `write_rank` between two steps (`how`)."""

    def write(model: nn.Module) -> None:
        with torch.no_grad():
            if how == "load":  # pretrained weights loaded into the template, after init
                model.load_state_dict(gb.BatchNormNet(seed=1).state_dict())
            elif how == "parameter":
                model.fc2.weight.add_(1.0)
            elif how == "buffer":
                model.bn.running_mean.fill_(3.0)
            elif how == "new data":  # the same object over other values: no version bump
                model.fc2.weight.data = model.fc2.weight.data + 1.0
            elif how == "convert":  # the net is float64
                model.float()

    return _outcome_after_change(comm, stage=stage, change_rank=write_rank, change=write)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["load", "parameter", "buffer", "new data", "convert"])
def test_writing_the_modules_tensors_after_the_state_was_built_raises(
    stage: int, how: str
) -> None:
    """The state took the module's values at init; a later load_state_dict, in-place write or
    conversion of the module would be silently ignored (training would go on from the old
    values, in the old dtype)."""
    outcomes = fzero.SimWorld(2).run(_write_outcome, stage=stage, write_rank=1, how=how)
    kind, message, moved = outcomes[1]
    assert kind == "ValueError" and moved == 0, outcomes[1]
    if how == "convert":
        assert "were converted or moved after the state was built" in message
        assert "6 of them, {'bn.bias': 'torch.float64 on cpu -> torch.float32 on cpu'" in message
    else:
        assert "were written in place after the state was built" in message
        expected = {"load": "'bn.running_mean'", "parameter": "['fc2.weight']",
                    "buffer": "['bn.running_mean']", "new data": "['fc2.weight']"}[how]
        assert expected in message
    kind, message, moved = outcomes[0]
    assert kind == "StepError" and "rank(s) [1] could not start it" in message and moved == 0


def _convert_outcome(comm: Any, *, stage: int) -> Any:
    """Build each rank's float64 module from its own seed, init a float32 state (rank 0's
    values on every rank), then convert every rank's module to float32 and step."""
    model = gb.BatchNormNet(seed=comm.rank)
    state = fzero.init(model, stage=stage, optimizer=gb.make_optimizer(("sgd", gb.SGD)),
                       comm=comm, param_dtype=torch.float32)
    model.float()  # the state's own dtype: accepted where the values are the state's
    step = fzero.make_train_step(model, gb.mse_loss)
    batch = gb.rank_rows(gb.mse_batches(1, rows=4 * comm.world_size, d_in=5, d_out=3)[0],
                         comm.rank, comm.world_size)
    return _step_outcome(comm, step, state, batch.float() if isinstance(batch, Tensor) else
                         tuple(t.float() for t in batch))


@pytest.mark.parametrize("stage", [1, 3])
def test_converting_another_ranks_module_after_init_says_why_it_differs(stage: int) -> None:
    """On rank 0 a module converted to the state's dtype holds the state's values and is
    accepted; on rank 1, whose module kept its own values (the state took rank 0's), the same
    conversion raises, and the message says the conversion alone explains it (it said only
    "written in place", which the user never did: found by a review)."""
    outcomes = fzero.SimWorld(2).run(_convert_outcome, stage=stage)
    kind, message, moved = outcomes[1]
    assert kind == "ValueError" and moved == 0, outcomes[1]
    assert "written in place after the state was built" in message
    assert "On this rank (1) the module's tensors ['fc1.bias', " in message
    assert "the state took rank 0's values at init" in message
    kind, message, moved = outcomes[0]
    assert kind == "StepError" and "rank(s) [1] could not start it" in message
    assert "On this rank" not in message


def _data_write_outcome(comm: Any, *, stage: int, write_rank: int | None) -> Any:
    """Build each rank's module from its own seed (rank 0's values are every rank's state),
    write other values into every parameter through `.data` (no version bump) on `write_rank`
    before the first step, then step: None, or the exception (type name, message) and the
    bytes it moved."""
    model = gb.BatchNormNet(seed=comm.rank)
    state = fzero.init(model, stage=stage, optimizer=gb.make_optimizer(("sgd", gb.SGD)),
                       comm=comm)
    if comm.rank == write_rank:  # pretrained weights loaded the old way, after init
        pretrained = dict(gb.BatchNormNet(seed=5).named_parameters())
        for name, tensor in model.named_parameters():
            tensor.data.copy_(pretrained[name])
    step = fzero.make_train_step(model, gb.mse_loss)
    batch = gb.rank_rows(gb.mse_batches(1, rows=4 * comm.world_size, d_in=5, d_out=3)[0],
                         comm.rank, comm.world_size)
    return _step_outcome(comm, step, state, batch)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_write_through_data_before_the_first_step_raises(stage: int) -> None:
    """`p.data.copy_(w)` between `init` and the first step bumps no version counter; rank 0,
    whose module values every rank's state took, compares them with the state's at the first
    step (stage 3: with its shard) and raises, naming the tensors; the other ranks' modules
    (other seeds here) are not the state's values and are not compared."""
    outcomes = fzero.SimWorld(2).run(_data_write_outcome, stage=stage, write_rank=0)
    kind, message, moved = outcomes[0]
    assert kind == "ValueError" and moved == 0, outcomes[0]
    names = "['fc1.bias', 'fc1.weight', 'fc2.bias', 'fc2.weight']" if stage < 3 else "["
    assert f"tensors {names}" in message and "written in place after the state" in message
    assert "a write through .data" in message
    kind, message, moved = outcomes[1]
    assert kind == "StepError" and "rank(s) [0] could not start it" in message and moved == 0
    assert fzero.SimWorld(2).run(_data_write_outcome, stage=stage, write_rank=1) == [None] * 2
    assert fzero.SimWorld(2).run(_data_write_outcome, stage=stage, write_rank=None) == [None] * 2


def _export_body(comm: Any, *, stage: int, export: bool) -> list[Tensor]:
    """Three steps; with `export`, the state's values are copied into the module (and its
    buffers) between steps 1 and 2, as an export for `save_pretrained` might do."""
    model = gb.BatchNormNet()
    state = fzero.init(model, stage=stage, optimizer=gb.make_optimizer(("sgd", gb.SGD)),
                       comm=comm)
    step = fzero.make_train_step(model, gb.mse_loss)
    batches = [gb.rank_rows(b, comm.rank, comm.world_size)
               for b in gb.mse_batches(3, rows=4 * comm.world_size, d_in=5, d_out=3)]
    state, _ = step(state, batches[0])
    if export:
        params = fzero.full_params(state)
        with torch.no_grad():
            for name, tensor in model.named_parameters():
                tensor.copy_(params[name])
            for name, tensor in model.named_buffers():
                tensor.copy_(state.buffers[name])
    for batch in batches[1:]:
        state, _ = step(state, batch)
    return list(fzero.full_params(state).values())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_states_own_values_written_into_the_module_are_accepted(stage: int) -> None:
    """Copying the state's values into the module changes nothing a step reads: allowed, and
    training goes on exactly as without it."""
    exported = fzero.SimWorld(3).run(_export_body, stage=stage, export=True)
    plain = fzero.SimWorld(3).run(_export_body, stage=stage, export=False)
    for mine, theirs in zip(exported, plain, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b)


def _converted_to_the_states_dtype_body(comm: Any, *, convert: bool) -> list[Tensor]:
    """A bfloat16 state of a float32 GPT; with `convert`, the module is converted to bfloat16
    after the first step and its parameters given the state's values as new data."""
    from models import TinyGPT

    model = TinyGPT(n_layer=2)
    state = fzero.init(model, stage=1, optimizer=gb.make_optimizer(("sgd", gb.SGD)),
                       comm=comm, param_dtype=torch.bfloat16, master_dtype=torch.float32)
    step = fzero.make_train_step(model, TinyGPT.loss_fn)
    batches = [TinyGPT.make_batch(seed, 2) for seed in range(3)]
    state, _ = step(state, batches[0])
    if convert:
        params = fzero.full_params(state)
        model.to(torch.bfloat16)  # new data, in the dtype the state computes in
        for name, tensor in model.named_parameters():
            tensor.data = params[name].clone()  # the state's values: nothing is ignored
    for batch in batches[1:]:
        state, _ = step(state, batch)
    return list(fzero.full_params(state, master=True).values())


def test_a_conversion_to_the_states_own_dtype_and_values_is_accepted() -> None:
    converted = fzero.SimWorld(1).run(_converted_to_the_states_dtype_body, convert=True)[0]
    plain = fzero.SimWorld(1).run(_converted_to_the_states_dtype_body, convert=False)[0]
    for a, b in zip(converted, plain, strict=True):
        assert torch.equal(a, b)


def _replaced_body(comm: Any) -> None:
    model = gb.BatchNormNet()
    state = fzero.init(model, stage=1, optimizer=gb.make_optimizer(("sgd", gb.SGD)), comm=comm)
    step = fzero.make_train_step(model, gb.mse_loss)
    batch = gb.mse_batches(1, rows=4, d_in=5, d_out=3)[0]
    old = model.fc1.weight  # replaced by an assignment: the old object is not the module's
    model.fc1.weight = nn.Parameter(old.detach().clone())
    with torch.no_grad():
        old.add_(1.0)
    state, _ = step(state, batch)
    model.to("meta")  # the module's memory dropped: new tensors, nothing to compare
    state, _ = step(state, batch)
    evaluate = fzero.make_eval_step(model, lambda call, b: call(b[0]))
    model.bn.running_var.fill_(2.0)  # a meta tensor: no values to ignore
    model.eval()  # (in training mode BatchNorm would update its statistics: an eval refuses)
    evaluate(state, batch)


def test_tensors_the_module_replaced_or_holds_on_meta_are_not_watched() -> None:
    fzero.SimWorld(1).run(_replaced_body)


def _eval_and_load_body(comm: Any, path: str) -> None:
    model, opt, state = _saved_net(comm, path)
    evaluate = fzero.make_eval_step(model, lambda call, b: call(b[0]))
    batch = gb.mse_batches(1, rows=4, d_in=5, d_out=3)[0]
    with torch.no_grad():
        model.fc1.bias.zero_()
    model.eval()  # (BatchNorm: no statistics updated)
    with pytest.raises(ValueError, match=r"tensors \['fc1.bias'\] were written in place"):
        evaluate(state, batch)
    # A load records the module's tensors as they are then: the write before it counts as seen.
    loaded = fzero.checkpoint.load(path, model=model, stage=1, optimizer=opt, comm=comm)
    evaluate(loaded, batch)
    model.train()
    with torch.no_grad():
        model.fc2.bias.zero_()
    with pytest.raises(ValueError, match=r"tensors \['fc2.bias'\] were written in place"):
        fzero.make_train_step(model, gb.mse_loss)(loaded, batch)


def test_eval_steps_and_loaded_states_watch_the_module_too(tmp_path) -> None:
    fzero.SimWorld(1).run(_eval_and_load_body, str(tmp_path / "c"))


def _tied_write_body(comm: Any, *, stage: int) -> Any:
    """A tied GPT in a bfloat16 state: the state's values exported into the float32 module are
    accepted; then a write into the tied embedding raises, naming both of its names."""
    from models import TinyGPT

    model = TinyGPT(n_layer=2)
    state = fzero.init(model, stage=stage, optimizer=gb.make_optimizer(("sgd", gb.SGD)),
                       comm=comm, param_dtype=torch.bfloat16, master_dtype=torch.float32)
    step = fzero.make_train_step(model, TinyGPT.loss_fn)
    batch = gb.rank_rows(TinyGPT.make_batch(0, 2 * comm.world_size), comm.rank, comm.world_size)
    state, _ = step(state, batch)
    params = fzero.full_params(state)  # bfloat16: exact in the float32 module
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.copy_(params[name])
    state, _ = step(state, batch)
    with torch.no_grad():
        model.tok_emb.weight.mul_(2.0)
    try:
        step(state, batch)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("stage", [1, 3])
def test_a_write_into_a_tied_parameter_names_every_name(stage: int) -> None:
    outcomes = fzero.SimWorld(2).run(_tied_write_body, stage=stage)
    for kind, message in outcomes:
        assert kind == "ValueError", message  # both ranks hold part of the embedding
        assert "['lm_head.weight', 'tok_emb.weight'] were written in place" in message


# ----------------------------------------------------------------------------------------------
# Ranks that would apply different settings: each updates its own part of the model with them.


def _settings_outcome(comm: Any, *, how: str) -> Any:
    """Two steps whose settings differ on rank 1 (`how`): the outcome per rank, with the bytes
    moved and whether the state's values changed."""
    model = gb.BatchNormNet()
    odd = comm.rank == 1
    optimizer = fzero.optim.sgd(lr=0.1, momentum=0.9)
    state = fzero.init(model, stage=2, optimizer=optimizer, comm=comm)
    # `init` and `load` compare the optimizer and master_dtype themselves: a state whose config
    # differs on one rank anyway (built by hand) is still refused by the step.
    if how == "optimizer" and odd:
        config = dataclasses.replace(state.config, optimizer=fzero.optim.sgd(
            lr=0.1, momentum=0.9, weight_decay=0.1))
        state = dataclasses.replace(state, config=config)
    if how == "master_dtype" and odd:  # rank 1 keeps a float32 master of the float64 model
        state = dataclasses.replace(state, config=dataclasses.replace(
            state.config, master_dtype=torch.float32), master=tuple(
                None if m is None else m.float() for m in state.master))
    kwargs: dict[str, Any] = {}
    if how == "schedule":  # a schedule computed from this rank's own data length
        kwargs["lr"] = lambda step: 0.1 * (1 + comm.rank) / step
    elif how == "clip_norm":
        kwargs["clip_norm"] = 1.0 if odd else None
    elif how == "decay":
        kwargs["decay"] = fzero.decay_matrices if odd else None
    elif how == "raising schedule":
        kwargs["lr"] = lambda step: 0.1 / (step - 1 if odd else step)
    step = fzero.make_train_step(model, gb.mse_loss, **kwargs)
    batch = gb.rank_rows(gb.mse_batches(1, rows=4 * comm.world_size, d_in=5, d_out=3)[0],
                         comm.rank, comm.world_size)
    before = [t.clone() for t in state.params]
    sent = comm.counters.total()
    try:
        step(state, batch)
    except Exception as exc:  # reported to the test, per rank
        same = all(torch.equal(a, b) for a, b in zip(before, state.params, strict=True))
        return type(exc).__name__, str(exc), comm.counters.total() - sent, same
    return None


@pytest.mark.parametrize(("how", "field"), [
    ("schedule", "lr"), ("optimizer", "settings"), ("clip_norm", "settings"),
    ("decay", "settings"), ("master_dtype", "settings"),
])
def test_ranks_with_different_step_settings_raise_before_anything_moves(
    how: str, field: str
) -> None:
    """Each rank updates its own shard: a rank-dependent learning rate (a schedule computed
    from the length of the rank's own data), optimizer hyperparameter, clipping, decay rule or
    master dtype (rank 1 keeps a float32 master copy of the float64 model) trained a silent
    mix of settings."""
    for kind, message, moved, same in fzero.SimWorld(3).run(_settings_outcome, how=how):
        assert kind == "StepError" and moved == 0 and same, message
        assert f"ranks disagree on the {field} before it started" in message
        if field == "settings":  # which one, with this rank's value (a probe saw two hashes)
            assert f"; they differ in: {SETTING_NAMES[how]} (this rank: " in message, message
            assert message.count("(this rank: ") == 1, message  # that one only
    if field == "lr":
        assert "0.1 on ranks [0]; 0.2 on ranks [1]; 0.30000000000000004 on ranks [2]" in message


SETTING_NAMES = {
    "optimizer": "the optimizer and its hyperparameters", "clip_norm": "clip_norm",
    "decay": "the parameters the weight-decay rule decays", "master_dtype": "master_dtype",
}


def test_param_dtype_none_and_the_model_s_own_dtype_are_the_same_setting() -> None:
    """`param_dtype=None` on a float32 model and `param_dtype=torch.float32` build the same
    state; the step's settings compared the argument and refused to train (a probe)."""

    def body(comm: Any) -> float:
        model = gb.BatchNormNet().float()
        dtype = torch.float32 if comm.rank == 1 else None
        state = fzero.init(model, stage=2, optimizer=fzero.optim.sgd(lr=0.1), comm=comm,
                           param_dtype=dtype)
        step = fzero.make_train_step(model, gb.mse_loss)
        batch = gb.rank_rows(gb.mse_batches(1, rows=8, d_in=5, d_out=3)[0], comm.rank, 2)
        state, metrics = step(state, tuple(t.float() for t in batch))
        return metrics["loss"]

    losses = fzero.SimWorld(2).run(body)
    assert losses[0] == losses[1]


def test_a_schedule_that_raises_on_one_rank_stops_every_rank() -> None:
    outcomes = fzero.SimWorld(2).run(_settings_outcome, how="raising schedule")
    kind, message, moved, same = outcomes[1]
    assert kind == "ValueError" and moved == 0 and same
    assert "learning rate for step 1 could not be computed: ZeroDivisionError" in message
    kind, message, moved, same = outcomes[0]
    assert kind == "StepError" and "rank(s) [1] could not start it" in message and moved == 0


def test_decay_none_and_a_rule_that_decays_everything_are_the_same_setting() -> None:
    """The step compares what the decay rule selects, not the rule: ``decay=None`` on one rank
    and ``decay=lambda name, shape: True`` on another decay the same parameters, and were
    refused as "settings differ" (the default was compared as None)."""

    def body(comm: Any) -> float:
        model = gb.BatchNormNet().float()
        state = fzero.init(model, stage=1, optimizer=fzero.optim.adamw(lr=0.1), comm=comm)
        decay = None if comm.rank == 0 else (lambda name, shape: True)
        step = fzero.make_train_step(model, gb.mse_loss, decay=decay)
        batch = gb.rank_rows(gb.mse_batches(1, rows=8, d_in=5, d_out=3)[0], comm.rank, 2)
        state, metrics = step(state, tuple(t.float() for t in batch))
        return metrics["loss"]

    losses = fzero.SimWorld(2).run(body)
    assert losses[0] == losses[1]
