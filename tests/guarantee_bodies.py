"""Models, float64 losses, references and per-rank bodies for the tests of fzero's guarantees:
activation checkpointing, ties, divergent ranks, unused parameters, failures, donation,
defaults, stage-3 hooks and buffers (tests/test_checkpointing.py, test_ties.py, ...).

Module-level so that forkserver gloo workers unpickle the bodies by name; every body runs under
`fzero.SimWorld` and `GlooPool` alike (``fn(comm, *args)``), takes this rank's rows of each
*global* batch with `rank_rows`, and returns plain values and CPU tensors.

Every loss here computes in the model's dtype (tests/models.py's losses cast logits to float32,
which limits float64 agreement to float32 rounding), so float64 runs separate real differences
from rounding: the tests hold float64 to 1e-12.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import fzero
from fzero.comm import Comm

from models import TinyGPT, bucket_policy, per_block, seeded

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""fzero.optim.adamw and torch.optim.AdamW hyperparameters (decay on: skipping it is visible)."""
SGD = {"lr": 0.1, "momentum": 0.9}
"""fzero.optim.sgd and torch.optim.SGD hyperparameters."""
F64_ATOL = 1e-12
"""float64 parameters and losses agree with torch.optim within this (absolute; values O(1))."""

OptSpec = tuple[str, dict[str, Any]]
LossFn = Callable[[Callable[..., Tensor], Any], Tensor]


# ----------------------------------------------------------------------------------------------
# Batches and references


def rank_rows(batch: Any, rank: int, world: int) -> Any:
    """Rank `rank`'s contiguous 1/`world` of every tensor of a global batch (dim 0)."""
    tensors = [t for t in pytree.tree_leaves(batch) if isinstance(t, Tensor) and t.dim()]
    rows = tensors[0].shape[0]
    if rows % world:
        raise ValueError(f"{rows} rows do not split over {world} ranks")
    k = rows // world
    return pytree.tree_map(
        lambda t: t[rank * k : (rank + 1) * k] if isinstance(t, Tensor) and t.dim() else t, batch
    )


def torch_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **ADAMW)


def torch_adamw_two_groups(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The GPT rule as torch users write it: no decay for parameters of fewer than 2 dims."""
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        **ADAMW,
    )


def torch_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, **SGD)


class Reference(NamedTuple):
    losses: list[float]  # loss of each applied step, before its update
    params: dict[str, Tensor]  # final parameters, every name (aliases included)


def reference(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Sequence[Any],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = torch_adamw,
    *,
    world: int = 1,
    skip: Sequence[int] = (),
) -> Reference:
    """Single-process torch.optim on a deepcopy of `model`: each step's loss is the mean over
    `world` rank slices of `loss_fn` on that slice (each slice decides its own control flow;
    ``world=1`` is the plain global batch), gradients set to None before each step (so an
    unused parameter is skipped by the optimizer, as torch does). Steps in `skip` are skipped.
    """
    model = copy.deepcopy(model)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for index, batch in enumerate(batches):
        if index in skip:
            continue
        opt.zero_grad(set_to_none=True)
        loss = sum(loss_fn(model, rank_rows(batch, r, world)) for r in range(world)) / world
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return Reference(losses, params)


def max_difference(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """The largest absolute difference over `want`'s names (all must be in `got`)."""
    assert set(want) <= set(got), sorted(set(want) - set(got))
    return max(float((got[n].double() - v.double()).abs().max()) for n, v in want.items())


def assert_parity(got: dict[str, Any], want: Reference, atol: float = F64_ATOL) -> None:
    """A body's ``losses`` and ``params`` equal the reference's within `atol`."""
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(want.losses, dtype=torch.float64), rtol=0, atol=atol,
                               msg=lambda text: f"losses: {text}")
    for name, value in want.params.items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=atol,
                                   msg=lambda text, name=name: f"{name}: {text}")


# ----------------------------------------------------------------------------------------------
# Models


class CheckpointedGPT(TinyGPT):
    """tests/models.py's TinyGPT (tied head) with its blocks run through activation
    checkpointing: `mode` is ``"none"``, ``"nonreentrant"`` / ``"reentrant"``
    (`torch.utils.checkpoint.checkpoint` per block) or ``"sequential"``
    (`checkpoint_sequential`, one segment per block; torch runs the last one plainly)."""

    MODES = ("none", "nonreentrant", "reentrant", "sequential")

    def __init__(self, seed: int = 0, mode: str = "none", n_layer: int = 2):
        super().__init__(seed, n_layer=n_layer)
        assert mode in self.MODES, mode
        self.mode = mode
        self.blocks = nn.Sequential(*self.blocks)  # same parameter names: blocks.<i>.*

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))  # (B, T, C)
        if self.mode == "sequential":
            x = checkpoint_sequential(self.blocks, len(self.blocks), x, use_reentrant=False)
        else:
            for block in self.blocks:
                x = block(x) if self.mode == "none" else checkpoint(
                    block, x, use_reentrant=self.mode == "reentrant")
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def gpt_loss(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor]) -> Tensor:
    """TinyGPT's cross-entropy in the logits' own dtype."""
    idx, targets = batch
    return F.cross_entropy(call(idx).flatten(0, 1), targets.flatten())


def gpt_batches(count: int, rows: int = 12) -> list[tuple[Tensor, Tensor]]:
    return [TinyGPT.make_batch(seed, rows) for seed in range(count)]


class InnerBlock(nn.Module):
    """A block that checkpoints its own forward's body, which reads the block's own matrix
    (``mix``, a matmul) before calling its child ``fc`` and its own ``gain`` after (an
    elementwise product, which torch would not bounds-check on a released bucket)."""

    def __init__(self, width: int):
        super().__init__()
        self.mix = nn.Parameter(torch.eye(width) + 0.1 * torch.randn(width, width))
        self.fc = nn.Linear(width, width)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(width))

    def body(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x @ self.mix) * self.gain)

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.body, x, use_reentrant=False)


class InnerCheckpointed(nn.Module):
    """Three `InnerBlock`s between two Linear layers."""

    def __init__(self, seed: int = 0, width: int = 6):
        super().__init__()
        with seeded(seed):
            self.inp = nn.Linear(5, width)
            self.blocks = nn.ModuleList(InnerBlock(width) for _ in range(3))
            self.out = nn.Linear(width, 3)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class RegionReadsChild(nn.Module):
    """A non-reentrant region that reads a child's weight directly (``t @ self.lin.weight``, or
    elementwise, which torch does not bounds-check) and calls another module; `lin` also runs
    after the region, so its bucket is gathered when the region is recomputed. `source` is the
    region's input: a leaf cut from the graph, an input computed by `first`, or the raw batch."""

    def __init__(self, read: str, source: str, seed: int = 0, width: int = 4):
        super().__init__()
        with seeded(seed):
            self.norm = nn.LayerNorm(width)
            self.first = nn.Linear(width, width)
            self.lin = nn.Linear(width, width)
        self.read, self.source = read, source
        self.double()

    def region(self, t: Tensor) -> Tensor:
        if self.read == "elementwise":
            return self.norm((t.unsqueeze(1) * self.lin.weight).sum(-1))
        return self.norm(t @ self.lin.weight)

    def forward(self, x: Tensor) -> Tensor:
        t = {"leaf": lambda: x.detach().requires_grad_(), "computed": lambda: self.first(x),
             "raw": lambda: x}[self.source]()
        h = x + checkpoint(self.region, t, use_reentrant=False)
        h = self.lin(h)
        return self.lin(h) + self.first(h)


class ParentReadsChild(nn.Module):
    """A parent reading its child's weight directly besides calling the child."""

    def __init__(self, width: int):
        super().__init__()
        self.child = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.randn(width) * 0.3 + 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.child(x) * self.gain + 0.3 * (x @ self.child.weight.T)


class NestedReentrantMisuse(nn.Module):
    """The README's reentrant misuse, nested: `p2` runs outside a reentrant region and inside
    it, within a non-reentrant region nested in the reentrant one, beside a second reentrant
    region nested too. Autograd runs more than one backward pass over `p2`'s and `p3`'s
    parameters, which fzero refuses (`LATE_GRADIENT_HELP`)."""

    def __init__(self, seed: int = 0, width: int = 4):
        super().__init__()
        with seeded(seed):
            self.p2, self.p3 = ParentReadsChild(width), ParentReadsChild(width)
            self.norm = nn.LayerNorm(width)
        self.double()

    def outer(self, t: Tensor) -> Tensor:
        u = checkpoint(lambda s: self.p2(self.norm(s) + self.p3(s)), t, use_reentrant=False)
        return u + checkpoint(self.p3, u.detach().requires_grad_(), use_reentrant=True)

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.outer, torch.tanh(self.p2(x)), use_reentrant=True)


class ReadsAParameter(nn.Module):
    """A block whose forward reads a parameter it is given (``h @ p.T``), not its own."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor, p: Tensor) -> Tensor:
        return x + 0.1 * (torch.tanh(self.fc(x)) @ p.T)[..., : x.shape[-1]]


class Holder(nn.Module):
    """A parameter of its own (a bucket of its own under `NestedRegions.policy`)."""

    def __init__(self, rows: int, width: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(rows, width) * 0.05)

    def forward(self, x: Tensor) -> Tensor:
        return x + 0.1 * (x @ self.w.T)[..., : x.shape[-1]]


class NestedRegions(nn.Module):
    """`pairs` non-reentrant regions, each around two blocks that read a large parameter of
    their own (`ps`), each block in a non-reentrant region nested in it (`nested`); a large
    layer (`bigs`) between the regions."""

    def __init__(self, pairs: int, nested: bool, width: int = 8, rows: int = 512,
                 vocab: int = 32, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.emb = nn.Embedding(vocab, width)
            self.ps = nn.ModuleList(Holder(rows, width) for _ in range(2 * pairs))
            self.blocks = nn.ModuleList(ReadsAParameter(width) for _ in range(2 * pairs))
            self.bigs = nn.ModuleList(Holder(rows, width) for _ in range(pairs))
            self.head = nn.Linear(width, vocab)
        self.nested = nested
        self.double()

    @staticmethod
    def policy(module: nn.Module) -> bool:
        return isinstance(module, Holder | ReadsAParameter)

    def pair(self, x: Tensor, i: int) -> Tensor:
        for j in (2 * i, 2 * i + 1):
            block = functools.partial(self.blocks[j], p=self.ps[j].w)
            x = checkpoint(block, x, use_reentrant=False) if self.nested else block(x)
        return x

    def forward(self, idx: Tensor) -> Tensor:
        x = self.emb(idx)
        for i, big in enumerate(self.bigs):
            x = big(checkpoint(self.pair, x, i, use_reentrant=False))
        return self.head(x)


def token_loss(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor]) -> Tensor:
    idx, target = batch
    return F.cross_entropy(call(idx).flatten(0, 1), target.flatten())


def token_batches(count: int, rows: int = 4, length: int = 5, vocab: int = 32
                  ) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, vocab, (rows, length), generator=gen),
             torch.randint(0, vocab, (rows, length), generator=gen)) for _ in range(count)]


class SharedInRegions(nn.Module):
    """`shared` runs in two regions checkpointed with ``use_reentrant=True`` when the batch's
    flag says so (each rank's own rows decide), plainly otherwise."""

    def __init__(self, seed: int = 0, width: int = 6):
        super().__init__()
        with seeded(seed):
            self.inp = nn.Linear(5, width)
            self.shared = nn.Linear(width, width)
            self.out = nn.Linear(width, 3)

    def region(self, h: Tensor) -> Tensor:
        return torch.tanh(self.shared(h))

    def forward(self, x: Tensor, reentrant: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = checkpoint(self.region, h, use_reentrant=True) if bool(reentrant.any()) else (
                self.region(h))
        return self.out(h)


def regions_loss(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    x, reentrant, y = batch
    return F.mse_loss(call(x, reentrant), y)


def regions_batches(count: int, world: int, reentrant_ranks: Sequence[int], rows: int = 2
                    ) -> list[tuple[Tensor, Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(3)
    flags = torch.zeros(world * rows, dtype=torch.bool)
    for r in reentrant_ranks:
        flags[r * rows : (r + 1) * rows] = True
    return [(torch.randn(world * rows, 5, generator=gen, dtype=torch.float64), flags,
             torch.randn(world * rows, 3, generator=gen, dtype=torch.float64))
            for _ in range(count)]


class Routed(nn.Module):
    """Data-dependent control flow: ``forward(x, route)`` runs ``blocks[i]`` for each i >= 0 of
    ``route[0]`` in order (a rank's rows carry its route: skip a block, call one twice, run
    them in another order). The blocks have equal sizes, so equal-sized buckets summed into
    each other across ranks would go unnoticed by the transport."""

    def __init__(self, seed: int = 0, width: int = 8, blocks: int = 3):
        super().__init__()
        with seeded(seed):
            self.inp = nn.Linear(5, width)
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
            self.out = nn.Linear(width, 3)

    def forward(self, x: Tensor, route: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))  # (B, width)
        for index in route[0].tolist():
            if index >= 0:
                h = torch.tanh(self.blocks[index](h))
            elif index == FAIL_IN_BACKWARD:
                h = _RaiseInBackward.apply(h)
        return self.out(h)  # (B, 3)


FAIL = -2
"""A route entry that makes `routed_loss` raise `Boom` (a failure on that rank only)."""
FAIL_IN_BACKWARD = -3
"""A route entry whose autograd node raises `Boom` in backward."""
NO_PATH = -4
"""A route entry that makes `routed_loss` leave the model out (a constant loss)."""
INTERRUPT = -5
"""A route entry that makes `routed_loss` raise KeyboardInterrupt (Ctrl-C on that rank)."""


class Boom(Exception):
    """The failure a test injects into one rank's loss_fn or backward."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor) -> Tensor:
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise Boom("backward failed on purpose")


def routed_loss(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    x, route, y = batch
    if bool((route == FAIL).any()):
        raise Boom("loss_fn failed on purpose")
    if bool((route == INTERRUPT).any()):
        raise KeyboardInterrupt("interrupted on purpose")
    if bool((route == NO_PATH).any()):
        return y.pow(2).mean()  # the model left out: no gradient path on this rank
    return F.mse_loss(call(x, route), y)


def routed_batches(routes: Sequence[Sequence[Sequence[int]]], rows: int = 2, seed: int = 0
                   ) -> list[tuple[Tensor, Tensor, Tensor]]:
    """One global batch per step; ``routes[step][rank]`` is that rank's route (its rows)."""
    gen = torch.Generator().manual_seed(seed)
    world = len(routes[0])
    width = max(len(route) for step in routes for route in step)
    batches = []
    for step in routes:
        route = torch.full((world * rows, width), -1)
        for rank, path in enumerate(step):
            route[rank * rows : (rank + 1) * rows, : len(path)] = torch.tensor(path)
        batches.append((torch.randn(world * rows, 5, generator=gen, dtype=torch.float64), route,
                        torch.randn(world * rows, 3, generator=gen, dtype=torch.float64)))
    return batches


class MLP64(nn.Module):
    """A small float64 MLP with a LayerNorm (1-d parameters that decay rules tell apart)."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float64):
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(7, 13)
            self.norm = nn.LayerNorm(13)
            self.fc2 = nn.Linear(13, 5)
        self.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))  # (B, 7) -> (B, 5)


def mse_loss(call: Callable[..., Tensor], batch: Sequence[Tensor]) -> Tensor:
    """Mean squared error in the output's dtype; `batch` is ``(x, y)`` or ``[x, y]``."""
    x, y = batch
    out = call(x)
    return F.mse_loss(out, y.to(out.dtype))


def mse_batches(count: int, rows: int = 12, dtype: torch.dtype = torch.float64, d_in: int = 7,
                d_out: int = 5) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, d_in, generator=gen, dtype=torch.float64).to(dtype),
             torch.randn(rows, d_out, generator=gen, dtype=torch.float64).to(dtype))
            for _ in range(count)]


def scale_by_weight_norm(module: nn.Module, args: tuple[Any, ...]) -> tuple[Tensor]:
    """A weight-norm-style forward pre-hook: reads its module's weight before the forward."""
    (x,) = args
    return (x / module.weight.norm(),)


class PreHooked(nn.Module):
    """Two Linear layers; the second carries the user's own `scale_by_weight_norm` pre-hook."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(7, 9)
            self.fc2 = nn.Linear(9, 5)
        self.fc2.register_forward_pre_hook(scale_by_weight_norm)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class ReadsChild(nn.Module):
    """``parent``'s forward reads ``parent.child.weight`` outside ``child`` (a matmul), after
    running ``parent.other`` or, with `read_first`, before any child module runs. With `own`,
    the parent owns a parameter of its own (``parent.scale``)."""

    def __init__(self, seed: int = 0, own: bool = False, read_first: bool = False):
        super().__init__()
        with seeded(seed):
            self.pre = nn.Linear(5, 5)
            self.parent = Parent(own, read_first)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.parent(torch.tanh(self.pre(x)))


class Parent(nn.Module):
    """See `ReadsChild`."""

    def __init__(self, own: bool, read_first: bool):
        super().__init__()
        self.child = nn.Linear(5, 5)
        self.other = nn.Linear(5, 5)
        self.read_first = read_first
        if own:
            self.scale = nn.Parameter(torch.ones(5))

    def forward(self, h: Tensor) -> Tensor:
        if self.read_first:  # the child's weight, outside child
            h = torch.tanh(self.other(h @ self.child.weight))
        else:
            h = torch.tanh(self.other(h)) @ self.child.weight
        return h * self.scale if hasattr(self, "scale") else h


class RootReadsChild(nn.Module):
    """The root module's own forward reads ``child.weight``: ``read`` is ``"matmul"`` (``h @
    w``), ``"transpose"`` (``h @ w.T``, as F.linear reads it) or ``"elementwise"``."""

    def __init__(self, seed: int = 0, read: str = "matmul"):
        super().__init__()
        with seeded(seed):
            self.child = nn.Linear(5, 5)
            self.other = nn.Linear(5, 5)
        self.read = read
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.other(x))  # (B, 5)
        weight = self.child.weight
        if self.read == "matmul":
            return h @ weight
        if self.read == "transpose":
            return h @ weight.T
        return h * weight.sum()


class KeepsAView(nn.Module):
    """``child``'s forward keeps a transposed view of its weight (``detach``: a detached one);
    the root uses it after ``other`` ran (so ``child``'s bucket, alone, was released in
    between)."""

    def __init__(self, seed: int = 0, detach: bool = False):
        super().__init__()
        with seeded(seed):
            self.child = _ViewKeeper(5, 5)
            self.other = nn.Linear(5, 5)
        self.child.detach = detach
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        h = self.child(x)
        h = torch.tanh(self.other(h))
        return h @ self.child.kept  # a view is traced to its parameter; a detached one is not


class KeepsARow(nn.Module):
    """Keeps a row of ``a.weight`` (a view) across ``b``'s forward, then reads it
    elementwise (no check of torch's that a released storage would fail)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.a = nn.Linear(5, 5)
            self.b = nn.Linear(5, 5)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        row = self.a.weight[0]
        return self.b(torch.tanh(self.a(x))) + (row * 2.0).sum()


class KeepsAnAlias(nn.Module):
    """Takes an alias of ``a.weight`` (``how``: ``detach``, ``data``, or ``set_`` over its
    storage, which no torch function sees) before ``b`` runs and reads it after (``read``: a
    matmul, or elementwise, which torch does not check against a released storage); each in
    its own bucket, ``a``'s is released between. ``across_steps``: the alias is taken at the
    first step only, kept on the module and read at every step."""

    def __init__(self, how: str, read: str, seed: int = 0, across_steps: bool = False):
        super().__init__()
        with seeded(seed):
            self.a = nn.Linear(5, 5)
            self.b = nn.Linear(5, 5)
        self.how, self.read, self.across_steps = how, read, across_steps
        self.kept: Tensor | None = None
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        if self.kept is None or not self.across_steps:
            w = self.a.weight
            self.kept = w.detach() if self.how == "detach" else w.data if self.how == "data" else (
                torch.empty(0, dtype=w.dtype).set_(w.untyped_storage(), w.storage_offset(),
                                                   w.shape, w.stride()))
        h = self.b(torch.tanh(self.a(x)))
        w = self.kept
        return h @ w.T if self.read == "matmul" else h + (w * 2.0).sum()


class _ViewKeeper(nn.Linear):
    detach = False

    def forward(self, x: Tensor) -> Tensor:
        kept = self.weight.T  # a view, taken while the bucket is gathered
        self.kept = kept.detach() if self.detach else kept
        return super().forward(x)


def each_parameter_alone(model: nn.Module) -> list[list[str]]:
    """A bucket policy: every parameter in a bucket of its own."""
    return [[name] for name, _ in model.named_parameters()]


class BatchNormNet(nn.Module):
    """Linear -> BatchNorm1d -> tanh -> Linear: running statistics are buffers."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(5, 6)
            self.bn = nn.BatchNorm1d(6)
            self.fc2 = nn.Linear(6, 3)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


# ----------------------------------------------------------------------------------------------
# Hugging Face models (built from a config: random weights, no download)


def hf_gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )
    with seeded(0):
        return transformers.GPT2LMHeadModel(config).double()


def hf_neox() -> nn.Module:
    import transformers

    config = transformers.GPTNeoXConfig(
        vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=40, max_position_embeddings=16, hidden_dropout=0.0,
        attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )
    with seeded(0):
        return transformers.GPTNeoXForCausalLM(config).double()


def hf_loss(call: Callable[..., Tensor], batch: tuple[Tensor]) -> Tensor:
    """Next-token cross-entropy in the logits' dtype (transformers' own loss upcasts to
    float32, which would limit float64 agreement to float32 rounding)."""
    (ids,) = batch
    logits = call(input_ids=ids).logits  # (B, T, vocab)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def hf_batches(count: int, rows: int = 12) -> list[tuple[Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 61, (rows, 10), generator=gen),) for _ in range(count)]


def enable_hf_checkpointing(model: nn.Module, *, use_reentrant: bool) -> nn.Module:
    """transformers 5's `activation_checkpointing_enable` (4.x: gradient_checkpointing_enable)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # pragma: no cover - transformers 4
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


# ----------------------------------------------------------------------------------------------
# Bodies


def make_optimizer(spec: OptSpec) -> fzero.optim.Optimizer:
    name, kwargs = spec
    return getattr(fzero.optim, name)(**kwargs)


def to_meta(model: nn.Module) -> nn.Module:
    """``model.to("meta")``: drops the module's memory (and unties its tied parameters)."""
    return model.to("meta")


def train(
    comm: Comm,
    model: nn.Module,
    loss_fn: LossFn,
    batches: Sequence[Any],
    *,
    stage: int,
    opt: OptSpec = ("adamw", ADAMW),
    buckets: Any = per_block,
    init_kwargs: dict[str, Any] | None = None,
    step_kwargs: dict[str, Any] | None = None,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    after_init: Callable[[nn.Module], nn.Module] | None = None,
    count_calls: str | None = None,
) -> dict[str, Any]:
    """`fzero.init` then one step per global batch (this rank's rows); what happened.

    Args:
        buckets: the bucket policy; default `models.per_block` (one bucket per block).
        prepare: applied to the model before `init` (e.g. enabling Hugging Face's activation
            checkpointing, which installs hooks that do not pickle).
        after_init: applied to the model after `init`; the step runs what it returns.
        count_calls: a submodule name whose forward calls are counted (a pre-hook).

    Returns:
        ``losses`` and ``metrics`` per step, final ``params`` (`full_params`), ``step``,
        ``param_steps``, ``master_dtype``, ``loss_scale``, ``buffers`` and ``calls``.
    """
    if prepare is not None:
        model = prepare(model)
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(opt), comm=comm,
                       buckets=bucket_policy(model, buckets), **(init_kwargs or {}))
    if after_init is not None:
        model = after_init(model)
    calls = [0]
    if count_calls is not None:
        model.get_submodule(count_calls).register_forward_pre_hook(
            lambda *_: calls.__setitem__(0, calls[0] + 1))
    step = fzero.make_train_step(model, loss_fn, **(step_kwargs or {}))
    losses, metrics = [], []
    for batch in batches:
        local = batch if isinstance(batch, fzero.MicroBatches) else rank_rows(
            batch, comm.rank, comm.world_size)
        state, m = step(state, local)
        losses.append(m["loss"])
        metrics.append(m)
    return {
        "losses": losses,
        "metrics": metrics,
        "params": fzero.full_params(state),
        "step": state.step,
        "param_steps": state.param_steps,
        "master_dtype": state.config.master_dtype,
        "loss_scale": state.loss_scale,
        "buffers": {n: b.clone() for n, b in state.buffers.items()},
        "calls": calls[0],
        "layout": state.layout,
    }


def evaluate(comm: Comm, model: nn.Module, loss_fn: LossFn, batch: Any, *, stage: int,
             after_init: Callable[[nn.Module], nn.Module] | None = None) -> float:
    """`fzero.make_eval_step` of `loss_fn` on this rank's rows of `batch`, right after init."""
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("sgd", SGD)), comm=comm,
                       buckets=per_block(model))
    if after_init is not None:
        model = after_init(model)
    evaluate = fzero.make_eval_step(model, loss_fn)
    return evaluate(state, rank_rows(batch, comm.rank, comm.world_size)).item()


def outcome(exc: BaseException) -> dict[str, Any]:
    """What a test needs to know about an exception raised on a rank."""
    return {"type": type(exc).__name__, "message": str(exc), "ranks": getattr(exc, "ranks", None),
            "step": getattr(exc, "step", None)}


def snapshot(state: fzero.ShardState) -> dict[str, Any]:
    """Everything a failed step must leave unchanged (a collective at stages 1-3)."""
    return {
        "params": fzero.full_params(state),
        "master": fzero.full_params(state, master=True),
        "moments": {k: [None if t is None else t.clone() for t in v]
                    for k, v in state.moments.items()},
        "step": state.step,
    }


def same_snapshot(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bitwise equality of two `snapshot`s."""
    if a["step"] != b["step"]:
        return False
    for key in ("params", "master"):
        if a[key].keys() != b[key].keys():
            return False
        if not all(torch.equal(a[key][n], v) for n, v in b[key].items()):
            return False
    return all(
        (x is None and y is None) or torch.equal(x, y)
        for k in a["moments"] for x, y in zip(a["moments"][k], b["moments"][k], strict=True)
    )


def train_through_failure(
    comm: Comm,
    model: nn.Module,
    loss_fn: LossFn,
    batches: Sequence[Any],
    *,
    stage: int,
    fail: dict[int, Any],
    buckets: Any = per_block,
    step_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train on every batch; at step i a rank in ``fail[i]`` gets its batch transformed by
    ``fail[i][rank]`` (a module-level function that makes its loss_fn raise, or its batch
    malformed). A step that raises is recorded, with whether the state stayed bitwise the same
    and the bytes it sent on the main channel (gradients; stage-3 gathers have their own), and
    training continues from the same state."""
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm,
                       buckets=bucket_policy(model, buckets))
    step = fzero.make_train_step(model, loss_fn, **(step_kwargs or {}))
    losses, errors = [], {}
    for index, batch in enumerate(batches):
        local = rank_rows(batch, comm.rank, comm.world_size)
        spoil = fail.get(index, {}).get(comm.rank)
        if spoil is not None:
            local = spoil(local)
        before = snapshot(state)
        start, sent = time.monotonic(), comm.counters.total()
        try:
            state, metrics = step(state, local)
        except (Exception, KeyboardInterrupt) as exc:  # every rank gets here at one step
            seconds, moved = time.monotonic() - start, comm.counters.total() - sent
            errors[index] = {**outcome(exc), "seconds": seconds, "moved": moved,
                             "unchanged": same_snapshot(before, snapshot(state))}
            continue
        losses.append(metrics["loss"])
    return {"losses": losses, "errors": errors, "params": fzero.full_params(state),
            "step": state.step}


def failing_route(batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Make `routed_loss` raise on this rank."""
    x, route, y = batch
    return x, torch.full_like(route, FAIL), y


def interrupting_route(batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Make `routed_loss` raise KeyboardInterrupt on this rank."""
    x, route, y = batch
    return x, torch.full_like(route, INTERRUPT), y


def failing_backward(batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Make this rank's backward raise (after its forward took part in every gather)."""
    x, route, y = batch
    route = route.clone()
    route[:, -1] = FAIL_IN_BACKWARD
    return x, route, y


def split_in_two(batch: Any) -> fzero.MicroBatches:
    """This rank's rows as two explicit micro-batches (the others use one)."""
    return fzero.MicroBatches(rank_rows(batch, r, 2) for r in range(2))


def consumed_state_step(comm: Comm, model: nn.Module, batches: Sequence[Any], *, stage: int,
                        stale_rank: int) -> dict[str, Any]:
    """Step 1 on every rank; at step 2 rank `stale_rank` passes its consumed step-0 state.
    Then every rank goes on from its live state."""
    state0 = fzero.init(model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)),
                        comm=comm, buckets=per_block(model))
    step = fzero.make_train_step(model, mse_loss)
    local = [rank_rows(b, comm.rank, comm.world_size) for b in batches]
    state1, _ = step(state0, local[0])
    error = None
    try:
        step(state0 if comm.rank == stale_rank else state1, local[1])
    except Exception as exc:
        error = outcome(exc)
    state2, metrics = step(state1, local[1])
    return {"error": error, "step": state2.step, "loss": metrics["loss"],
            "params": fzero.full_params(state2)}


def retie_after_init(comm: Comm, model: nn.Module, batch: Any, *, stage: int,
                     change: Callable[[nn.Module], None], ranks: Sequence[int]) -> Any:
    """`init` from `model`, then `change` the module on `ranks`, then one step: the outcome."""
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("sgd", SGD)), comm=comm,
                       buckets=per_block(model))
    if comm.rank in ranks:
        change(model)
    step = fzero.make_train_step(model, mse_loss if not isinstance(model, TinyGPT) else gpt_loss)
    before = snapshot(state)
    try:
        step(state, rank_rows(batch, comm.rank, comm.world_size))
    except Exception as exc:
        return {**outcome(exc), "unchanged": same_snapshot(before, snapshot(state))}
    return None


def untie_head(model: nn.Module) -> None:
    """Break TinyGPT's tie: the head gets its own materialized copy of the embedding."""
    model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())


def tie_fc2_to_fc1(model: nn.Module) -> None:
    """Tie two same-shaped weights that the state stores apart."""
    model.fc2.weight = model.fc1.weight


class TwinLinear(nn.Module):
    """Two Linear(6, 6) layers (same shapes, so a tie between them is possible)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(6, 6)
            self.fc2 = nn.Linear(6, 6)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def donation_body(comm: Comm, model: nn.Module, batches: Sequence[Any], *, stage: int
                  ) -> dict[str, Any]:
    """Consumed states raise; `clone_state` keeps the old values while training goes on."""
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm,
                       buckets=per_block(model))
    step = fzero.make_train_step(model, mse_loss)
    local = [rank_rows(b, comm.rank, comm.world_size) for b in batches]
    kept = fzero.clone_state(state)
    kept_values = snapshot(kept)
    shared = storage_sharing(state), storage_sharing(kept)
    state1, _ = step(state, local[0])
    errors = {}
    for what, use in (("step", lambda: step(state, local[1])),
                      ("full_params", lambda: fzero.full_params(state)),
                      ("clone_state", lambda: fzero.clone_state(state))):
        try:
            use()
        except Exception as exc:
            errors[what] = outcome(exc)
    state2, _ = step(state1, local[1])
    try:
        fzero.full_params(state1)
    except Exception as exc:
        errors["full_params of step 1's state"] = outcome(exc)
    # The copy still holds step 0's values after two steps, and trains on its own.
    kept_after = snapshot(kept)
    again, _ = step(kept, local[0])
    return {
        "errors": errors,
        "kept_unchanged": same_snapshot(kept_values, kept_after),
        "kept_step": kept.step,
        "trained": fzero.full_params(state2),
        "state2_step": state2.step,
        "replayed": fzero.full_params(again),
        "sharing": shared,
    }


def storage_sharing(state: fzero.ShardState) -> list[bool]:
    """Per trainable bucket: whether the master copy shares the parameters' storage."""
    return [
        master.untyped_storage().data_ptr() == params.untyped_storage().data_ptr()
        for master, params in zip(state.master, state.params, strict=True)
        if master is not None
    ]


def micro_batches_body(comm: Comm, model: nn.Module, batches: Sequence[Any], *, stage: int,
                       parts: int) -> dict[str, Any]:
    """Each rank's rows as `parts` explicit `fzero.MicroBatches`."""
    local = [fzero.MicroBatches(rank_rows(rank_rows(b, comm.rank, comm.world_size), r, parts)
                                for r in range(parts)) for b in batches]
    return train(comm, model, mse_loss, local, stage=stage)


def ddp_buffers_body(comm: Comm, model: nn.Module, batches: Sequence[Any], *, stage: int,
                     buffers: str) -> dict[str, Any]:
    """fzero (``buffers=``) and DDP (``broadcast_buffers=`` to match) from the same model on the
    same rows: final parameters and this rank's buffers from both."""
    from torch.nn.parallel import DistributedDataParallel

    ours = train(comm, copy.deepcopy(model), mse_loss, batches, stage=stage,
                 opt=("sgd", SGD), step_kwargs={"buffers": buffers})
    ddp = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=buffers == "broadcast")
    opt = torch_sgd(list(ddp.parameters()))
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        mse_loss(ddp, rank_rows(batch, comm.rank, comm.world_size)).backward()
        opt.step()
    return {
        "ours": {"params": ours["params"], "buffers": ours["buffers"]},
        "ddp": {"params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
                "buffers": {n: b.clone() for n, b in ddp.module.named_buffers()}},
    }
