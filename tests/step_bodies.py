"""Per-rank bodies for the train-step tests: `fn(comm, *args)`, run by SimWorld and GlooPool alike.

Module-level (with the extra models and loss functions they use) so forkserver workers can
unpickle them by name. Every body receives the *global* batches and takes its own slice with
`models.split_batch(batch, comm.rank, comm.world_size)`. Results travel back as plain floats,
dicts and CPU tensors; the test module compares them with single-process references.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn

import fzero
from fzero.comm import Comm
from fzero.layout import ShardLayout
from fzero.state import ShardState

from models import TinyGPT, bucket_policy, per_block, seeded, split_batch

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""fzero.optim.adamw and torch.optim.AdamW hyperparameters of the parity runs."""
SGD = {"lr": 5e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
"""fzero.optim.sgd and torch.optim.SGD hyperparameters of the SGD parity runs."""

OptSpec = tuple[str, dict[str, Any]]


def make_optimizer(spec: OptSpec) -> fzero.optim.Optimizer:
    """``("adamw", {...})`` -> `fzero.optim.adamw(**{...})` (specs pickle, closures do not)."""
    name, kwargs = spec
    return getattr(fzero.optim, name)(**kwargs)


# ----------------------------------------------------------------------------------------------
# Extra models (stage-3 residency shapes that tests/models.py does not cover)


def _linear_stack(sizes: Sequence[int], seed: int) -> list[nn.Linear]:
    with seeded(seed):
        return [nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True)]


class Deep(nn.Module):
    """Six Linear layers of different widths in an nn.Sequential: one bucket per layer."""

    sizes = (7, 9, 23, 5, 17, 11, 5)

    def __init__(self, seed: int = 0):
        super().__init__()
        self.layers = nn.Sequential(*_linear_stack(self.sizes, seed))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x  # (B, 7) -> (B, 5)

    @staticmethod
    def make_batch(seed: int, batch_size: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, 7, generator=g), torch.randn(batch_size, 5, generator=g)

    @staticmethod
    def loss_fn(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.mse_loss(call(x), y)


class Reversed(Deep):
    """A ModuleList registered last layer first and run in reverse: forward order is the
    reverse of registration (and bucket) order."""

    def __init__(self, seed: int = 0):
        nn.Module.__init__(self)
        self.layers = nn.ModuleList(_linear_stack(self.sizes, seed)[::-1])

    def forward(self, x: Tensor) -> Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x  # (B, 7) -> (B, 5)


class CalledTwice(Deep):
    """One block whose forward runs twice per step (weight reuse through a second call)."""

    sizes = (7, 9, 9, 5)

    def forward(self, x: Tensor) -> Tensor:
        first, middle, last = self.layers
        x = torch.tanh(first(x))
        x = torch.tanh(middle(x))
        x = torch.tanh(middle(x))  # the same module (and bucket) again
        return last(x)  # (B, 7) -> (B, 5)


class SharedInList(Deep):
    """One module registered twice in an nn.ModuleList (ALBERT-style sharing): [a, b, a]."""

    sizes = (7, 7, 7)

    def __init__(self, seed: int = 0):
        nn.Module.__init__(self)
        a, b = _linear_stack(self.sizes, seed)
        self.layers = nn.ModuleList([a, b, a])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x[:, :5]  # (B, 7) -> (B, 5)


# ----------------------------------------------------------------------------------------------
# Loss functions (module level so they pickle)


def overflow_loss(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """MLP's loss times ``factor.max()``: 1 normally, inf on the batch that must overflow."""
    x, y, factor = batch
    return F.mse_loss(call(x).float(), y) * factor.max()


def per_row_loss(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor]) -> Tensor:
    """Not a scalar: one loss per row."""
    x, y = batch
    return ((call(x).float() - y) ** 2).mean(dim=1)


def constant_loss(call: Callable[..., Tensor], batch: Any) -> Tensor:
    """A scalar that never touches the model."""
    return torch.tensor(1.0)


def no_grad_loss(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor]) -> Tensor:
    """The model's loss computed under torch.no_grad."""
    with torch.no_grad():
        x, y = batch
        return F.mse_loss(call(x).float(), y)


def int_loss(call: Callable[..., Tensor], batch: tuple[Tensor, Tensor]) -> Tensor:
    """A scalar of an integer dtype."""
    x, _ = batch
    return call(x).argmax()


# ----------------------------------------------------------------------------------------------
# Bodies


def train_body(
    comm: Comm,
    model: nn.Module,
    batches: Sequence[Any],
    steps: int,
    *,
    stage: int,
    opt: OptSpec = ("adamw", ADAMW),
    accum: int = 1,
    clip: float | None = None,
    param_dtype: torch.dtype | None = None,
    decay: Callable[[str, tuple[int, ...]], bool] | None = None,
    prefetch: int = 1,
    loss_fn: Callable[..., Tensor] | None = None,
    skeleton: nn.Module | None = None,
    buckets: Any = per_block,
    loss_scale: float | None = None,
    master: bool = False,
    emulated_delay: float | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Train `steps` steps on this rank's slices of `batches` (cycled); report what happened.

    Args:
        buckets: the bucket policy; default `models.per_block` (one bucket per block).
        skeleton: the module the step runs (e.g. on the meta device); the state is built from
            `model` either way.
        loss_scale: replace the fp16 state's initial loss scale.
        master: also return `full_params(state, master=True)`.
        emulated_delay: run collectives on `fzero.EmulatedStreams` with delays up to this many
            seconds (seeded by rank).
        device: where the state and the batches live (default: the comm's device); the
            parameters come back on the CPU.

    Returns:
        ``losses`` and ``metrics`` per step, final ``params`` (`full_params`), ``master`` when
        asked, the final ``step``, and the ``layout``.
    """
    state = fzero.init(
        model, stage=stage, optimizer=make_optimizer(opt), comm=comm,
        buckets=bucket_policy(model, buckets),
        param_dtype=param_dtype, device=device,
    )
    if loss_scale is not None:
        assert state.loss_scale is not None
        state = _with_scale(state, loss_scale)
    streams = (fzero.EmulatedStreams(seed=comm.rank, max_delay=emulated_delay)
               if emulated_delay is not None else None)
    kwargs: dict[str, Any] = {"accum_steps": accum, "clip_norm": clip, "prefetch": prefetch,
                              "decay": decay, "streams": streams}
    runner = skeleton if skeleton is not None else model
    step = fzero.make_train_step(runner, loss_fn or type(model).loss_fn, **kwargs)
    losses, metrics = [], []
    for i in range(steps):
        local = split_batch(batches[i % len(batches)], comm.rank, comm.world_size)
        if device is not None:
            local = pytree.tree_map(lambda t: t.to(device), local)
        state, m = step(state, local)
        losses.append(m["loss"])
        metrics.append(m)
    if streams is not None:
        streams.close()
    out = {
        "losses": losses,
        "metrics": metrics,
        "params": {k: v.cpu() for k, v in fzero.full_params(state).items()},
        "step": state.step,
        "layout": state.layout,
    }
    if master:
        out["master"] = {k: v.cpu() for k, v in fzero.full_params(state, master=True).items()}
    return out


def _with_scale(state: ShardState, scale: float) -> ShardState:
    assert state.loss_scale is not None
    return dataclasses.replace(
        state, loss_scale=dataclasses.replace(state.loss_scale, scale=scale)
    )


def snapshot_state(state: ShardState) -> dict[str, Any]:
    """Clones of what a step may change: full master values and every moment shard."""
    return {
        "master": fzero.full_params(state, master=True),
        "moments": {
            k: [None if t is None else t.clone() for t in v] for k, v in state.moments.items()
        },
        "step": state.step,
    }


NEAR_TOP = 0.75
"""d loss / d w of `near_top_loss` for every weight: scaled by 65536, 49152, which float16 holds
(its largest is 65504) but twice of which it does not."""


def near_top_loss(call: Callable[..., Tensor], batch: tuple[Tensor]) -> Tensor:
    (x,) = batch
    return call(x).float().mean() * NEAR_TOP


def near_top_body(comm: Comm, *, stage: int) -> dict[str, Any]:
    """One float16 step of a zero ``Linear(4, 1)`` on rows of ones at loss scale 65536 (SGD, lr
    0.1): each rank's scaled gradient is 49152 everywhere."""
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    model.half()
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    assert state.loss_scale is not None and state.loss_scale.scale == 2.0**16
    step = fzero.make_train_step(model, near_top_loss)
    state, metrics = step(state, (torch.ones(2, 4, dtype=torch.float16),))
    return {"skipped": metrics["skipped"], "loss_scale": metrics["loss_scale"],
            "weight": fzero.full_params(state)["weight"]}


def overflow_body(
    comm: Comm, model: nn.Module, batches: Sequence[Any], bad_step: int, *, stage: int
) -> list[dict[str, Any]]:
    """fp16 training where step `bad_step` overflows; per step: metrics and before/after state."""
    state = fzero.init(
        model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm,
        param_dtype=torch.float16,
    )
    state = _with_scale(state, 2.0**10)
    step = fzero.make_train_step(model, overflow_loss)
    records = []
    for i, batch in enumerate(batches):
        before = snapshot_state(state)
        scale_before = state.loss_scale.scale if state.loss_scale is not None else None
        state, m = step(state, split_batch(batch, comm.rank, comm.world_size))
        after = snapshot_state(state)
        records.append({
            "index": i,
            "metrics": {k: m[k] for k in ("loss", "skipped", "step", "loss_scale", "grad_norm")},
            "scale_before": scale_before,
            "scale_after": state.loss_scale.scale if state.loss_scale is not None else None,
            "before": before,
            "after": after,
        })
    return records


def eval_body(
    comm: Comm, model: nn.Module, batches: Sequence[Any], steps: int, probe: Any, *, stage: int
) -> dict[str, Any]:
    """Train `steps` steps, then evaluate `probe` (the whole batch on every rank) twice."""
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm)
    step = fzero.make_train_step(model, type(model).loss_fn)
    evaluate = fzero.make_eval_step(model, type(model).loss_fn)
    first = evaluate(state, probe)
    train_losses = []
    for i in range(steps):
        state, m = step(state, split_batch(batches[i % len(batches)], comm.rank, comm.world_size))
        train_losses.append(m["loss"])
    params_before = fzero.full_params(state)
    loss = evaluate(state, probe)
    again = evaluate(state, probe)
    return {
        "initial": first.item(),
        "train_losses": train_losses,
        "loss": loss.item(),
        "again": again.item(),
        "requires_grad": loss.requires_grad,
        "params_before": params_before,
        "params_after": fzero.full_params(state),
    }


def module_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Everything a step must leave alone: parameters and buffers (identity and values), each
    submodule's attribute names and hook dicts, and torch's global module hooks."""
    from torch.nn.modules import module as module_mod

    hook_attrs = (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
        "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called", "_state_dict_hooks", "_load_state_dict_pre_hooks",
    )
    return {
        "params": [
            (name, id(p), p.requires_grad, p.grad is None, p.device.type, p.detach().clone())
            for name, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [
            (name, id(b), b.detach().clone())
            for name, b in model.named_buffers(remove_duplicate=False)
        ],
        "modules": [
            (name, id(m), sorted(vars(m)), m.training,
             {attr: dict(getattr(m, attr, {})) for attr in hook_attrs})
            for name, m in model.named_modules(remove_duplicate=False)
        ],
        "global_hooks": [
            len(getattr(module_mod, attr))
            for attr in (
                "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks", "_global_parameter_registration_hooks",
                "_global_module_registration_hooks", "_global_buffer_registration_hooks",
            )
        ],
    }


def fingerprints_equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The differences between two `module_fingerprint`s, as readable strings (empty: equal)."""
    diffs = []
    if [x[:5] for x in a["params"]] != [x[:5] for x in b["params"]]:
        diffs.append(f"parameter identity/flags: {[x[:5] for x in b['params']]}")
    for (name, *_, va), (_, *_, vb) in zip(a["params"], b["params"], strict=True):
        if not (va.is_meta or torch.equal(va, vb)):
            diffs.append(f"parameter {name} values changed")
    if [x[:2] for x in a["buffers"]] != [x[:2] for x in b["buffers"]]:
        diffs.append("buffer identity")
    for (name, _, va), (_, _, vb) in zip(a["buffers"], b["buffers"], strict=True):
        if not (va.is_meta or torch.equal(va, vb)):
            diffs.append(f"buffer {name} values changed")
    if a["modules"] != b["modules"]:
        diffs.append("submodule attributes or hooks changed")
    if a["global_hooks"] != b["global_hooks"]:
        diffs.append(f"global hooks {a['global_hooks']} -> {b['global_hooks']}")
    return diffs


def purity_body(
    comm: Comm, model: nn.Module, batches: Sequence[Any], steps: int, *, stage: int
) -> list[str]:
    """Train a few steps (and evaluate once); return how the module changed (nothing, we hope)."""
    before = module_fingerprint(model)
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm)
    step = fzero.make_train_step(model, type(model).loss_fn, accum_steps=2)
    evaluate = fzero.make_eval_step(model, type(model).loss_fn)
    for i in range(steps):
        state, _ = step(state, split_batch(batches[i % len(batches)], comm.rank, comm.world_size))
    evaluate(state, split_batch(batches[0], comm.rank, comm.world_size))
    return fingerprints_equal(before, module_fingerprint(model))


def raises_body(comm: Comm, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `fn(comm, *args)`; return ``(type name, message)`` of what it raised, else None."""
    try:
        fn(comm, *args, **kwargs)
    except (ValueError, TypeError, fzero.StepError) as exc:
        return type(exc).__name__, str(exc)
    return None


def init_per_rank_body(comm: Comm, models: Sequence[nn.Module], stage: int) -> ShardState:
    """`init` with rank r's own model ``models[r]``."""
    return fzero.init(
        models[comm.rank], stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm
    )


def uneven_batch_body(comm: Comm, model: nn.Module, batches: Sequence[Any], stage: int) -> None:
    """One step where rank r gets ``batches[r]`` (their sizes differ)."""
    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm)
    step = fzero.make_train_step(model, type(model).loss_fn)
    step(state, batches[comm.rank])


def step_once_body(
    comm: Comm,
    model: nn.Module,
    batch: Any,
    *,
    stage: int,
    runner: nn.Module | None = None,
    loss_fn: Callable[..., Tensor] | None = None,
    accum: int = 1,
    param_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Init and one step on this rank's slice of `batch`; `runner` runs instead of `model`.

    Returns the step's metrics, plus the state's ``layout``.
    """
    state = fzero.init(
        model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm,
        param_dtype=param_dtype,
    )
    step = fzero.make_train_step(
        runner if runner is not None else model, loss_fn or type(model).loss_fn,
        accum_steps=accum,
    )
    state, metrics = step(state, split_batch(batch, comm.rank, comm.world_size))
    return {**metrics, "layout": state.layout}


def init_body(comm: Comm, model: nn.Module, **kwargs: Any) -> ShardState:
    """`fzero.init` with an adamw optimizer unless one is given."""
    kwargs.setdefault("optimizer", make_optimizer(("adamw", ADAMW)))
    return fzero.init(model, comm=comm, **kwargs)


def init_bytes_body(comm: Comm, model: nn.Module, **kwargs: Any) -> dict[str, Any]:
    """`fzero.init`, then the state's measured and table bytes and its layout."""
    from fzero.state import state_bytes, state_bytes_theory

    state = init_body(comm, model, **kwargs)
    return {
        "measured": state_bytes(state),
        "theory": state_bytes_theory(state),
        "layout": state.layout,
    }


def init_full_body(comm: Comm, models: Sequence[nn.Module], stage: int) -> dict[str, Any]:
    """`init` from rank r's own ``models[r]``; the full parameters and buffers it ends with."""
    state = init_per_rank_body(comm, models, stage)
    return {"params": fzero.full_params(state), "buffers": dict(state.buffers)}


def tree_map_body(
    comm: Comm, model: nn.Module, batches: Sequence[Any], *, stage: int
) -> dict[str, Any]:
    """One step, then a `tree_map(clone)` copy of the state; one more step from each."""
    import torch.utils._pytree as pytree

    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)), comm=comm)
    step = fzero.make_train_step(model, type(model).loss_fn)
    local = [split_batch(b, comm.rank, comm.world_size) for b in batches]
    state, _ = step(state, local[0])
    copied = pytree.tree_map(lambda t: t.clone(), state)
    static = ("layout", "stage", "step", "config", "loss_scale", "bucket_order")
    same_static = {k: getattr(copied, k) == getattr(state, k) for k in static}
    leaves, copied_leaves = pytree.tree_leaves(state), pytree.tree_leaves(copied)
    fresh = all(a is not b for a, b in zip(leaves, copied_leaves, strict=True))
    equal = all(torch.equal(a, b) for a, b in zip(leaves, copied_leaves, strict=True))
    copied, m_copy = step(copied, local[1])
    state, m_orig = step(state, local[1])
    return {
        "same_static": same_static,
        "fresh": fresh,
        "equal": equal,
        "losses": (m_orig["loss"], m_copy["loss"]),
        "params": (fzero.full_params(state), fzero.full_params(copied)),
    }


def padding_bytes(layout: ShardLayout, stage: int, moment_bytes: int = 8,
                  reduce_dtype: torch.dtype | None = None) -> float:
    """Bytes the padding adds to a rank's state, per docs/design.md's table (what each stage
    keeps full and what it keeps as shards). fp32 AdamW keeps params (which double as the master
    copy), grads and two 4-byte moments; mixed precision adds a separate fp32 master. A full
    storage holds a bucket's whole padding, a shard 1/N of it. Stages 2-3 keep gradient shards
    in `reduce_dtype` when given."""
    n = layout.world_size
    total = 0.0
    for bucket in layout.buckets:
        pad, size = bucket.padding, bucket.torch_dtype.itemsize
        if not bucket.trainable:
            total += pad * size / (n if stage == 3 else 1)
            continue
        master = 4 if bucket.torch_dtype != torch.float32 else 0
        grad = reduce_dtype.itemsize if reduce_dtype is not None else size
        full, sharded = {  # bytes per element kept full, kept as shards
            0: (size + size + master + moment_bytes, 0),
            1: (size + size, master + moment_bytes),
            2: (size, grad + master + moment_bytes),
            3: (0, size + grad + master + moment_bytes),
        }[stage]
        total += pad * full + pad * sharded / n
    return total


def flat_buffers_alive_after_steps(comm: Comm, stage: int, steps: int) -> tuple[int, int]:
    """`steps` steps of a 2-block TinyGPT with the garbage collector off: how many of the flat
    gradient buffers the steps reduced are still alive, and how many there were."""
    import gc
    import weakref

    flats: list[weakref.ref] = []
    real = fzero.buckets.reduce_scatter_bucket

    def logged(comm: Any, bucket: Any, flat: Tensor, **kwargs: Any) -> Any:
        flats.append(weakref.ref(flat if flat._base is None else flat._base))
        return real(comm, bucket, flat, **kwargs)

    model = TinyGPT(n_layer=2)
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm,
                       buckets=per_block(model))
    step = fzero.make_train_step(model, TinyGPT.loss_fn)
    fzero.buckets.reduce_scatter_bucket = logged
    gc.disable()
    try:
        for seed in range(steps):
            batch = split_batch(TinyGPT.make_batch(seed, 4), comm.rank, comm.world_size)
            state, _ = step(state, batch)
        return sum(ref() is not None for ref in flats), len(flats)
    finally:
        gc.enable()
        fzero.buckets.reduce_scatter_bucket = real


def ema_body(comm: Comm, model: nn.Module, batches: Sequence[Any], *, stage: int,
             param_dtype: torch.dtype | None) -> dict[str, Any]:
    """An EMA kept as a `clone_state` copy, updated after every step by an in-place ``lerp_``
    of each of its pytree leaves towards the trained state's (at another step count), and
    the same average computed from `full_params` alone."""
    import torch.utils._pytree as pytree

    state = fzero.init(model, stage=stage, optimizer=make_optimizer(("adamw", ADAMW)),
                       comm=comm, param_dtype=param_dtype)
    ema = fzero.clone_state(state)
    want = {name: value.clone() for name, value in fzero.full_params(ema).items()}
    step = fzero.make_train_step(model, type(model).loss_fn)
    for batch in batches:
        state, _ = step(state, split_batch(batch, comm.rank, comm.world_size))
        pytree.tree_map(lambda e, s: e.lerp_(s, 0.25), ema, state)
        for name, value in fzero.full_params(state).items():
            want[name].lerp_(value, 0.25)
    return {"ema": fzero.full_params(ema), "want": want, "steps": (ema.step, state.step)}
