"""Property testing for users: hypothesis strategies and ready-made checks for *your* model.

Needs `hypothesis` (``pip install "fzero[testing]"``). Two one-line checks for a pytest suite:

    from fzero.testing import check_roundtrip, check_step_parity

    def test_my_model_shards_exactly():
        check_roundtrip(MyModel(), world_sizes=(1, 2, 3, 4))

    def test_my_model_trains_like_torch():
        check_step_parity(MyModel(), my_loss_fn, my_global_batches, stages=(0, 1, 2, 3),
                          world_sizes=(1, 2, 3))

`check_roundtrip` asserts that the model's parameters survive ``plan -> shard -> unshard``,
``flatten -> unflatten`` and the collective ``gather`` bit for bit, for every world size and
bucket policy, also with random bit patterns (NaN, inf, -0.0) in place of the values.
`check_step_parity` trains the model in float64 on `SimWorld` ranks with `make_train_step` and
in one process with the matching ``torch.optim`` optimizer on the whole global batch, and asserts
equal losses and parameters (docs/design.md, "Numbers we hold ourselves to").

The strategies draw parameter pytrees (nested names, ties, frozen and trainable entries, 0-d and
empty tensors, float and integer dtypes: `trees`, built into tensors by `TreeSpec.build`), world
sizes (`world_sizes`), bucket policies (`policies`) and planned layouts (`layouts`). Draw in the
test process and pass tensors to ranks: never run ``@given`` inside a rank (shrinking diverges
between ranks and hangs them).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fzero.testing needs hypothesis: pip install 'fzero[testing]' (or pip install hypothesis)"
    ) from exc

import fzero
from fzero.collect import all_gather_bucket

__all__ = [
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "TreeSpec",
    "bitwise_equal",
    "bits",
    "check_roundtrip",
    "check_step_parity",
    "layouts",
    "policies",
    "shapes",
    "trees",
    "world_sizes",
    "worlds_and_trees",
]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32)
def bits(tensor: Tensor) -> Tensor:
    """The tensor's raw bits as integers, for bitwise comparison (NaN-safe); any dtype
    (`fzero.flat.bits` of a contiguous copy)."""
    return fzero.flat.bits(tensor.detach().contiguous())


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Same shape, dtype and bits (NaN payloads and the sign of zero included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """A tensor of `shape` whose elements are uniformly random bit patterns of `dtype`."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        real = _random_bits((*shape, 2), dtype.to_real(), gen)
        return torch.view_as_complex(real)
    width = bits(torch.empty(0, dtype=dtype)).dtype  # an integer type of its width
    info = torch.iinfo(width)
    raw = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64)
    return raw.to(width).view(dtype)


# --------------------------------------------------------------------------------------------
# Strategies


@dataclass(frozen=True)
class TreeSpec:
    """A drawn parameter set, built into tensors by `build` (cheap to draw and shrink).

    Attributes:
        names: dotted parameter names, in order.
        shapes: one shape per name.
        dtypes: one dtype per name.
        trainable: whether each name requires grad (always False for integer dtypes).
        tied_to: for a tied name, the index of the earlier entry it aliases; else None.
        seed: the seed of the values.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    trainable: tuple[bool, ...]
    tied_to: tuple[int | None, ...]
    seed: int

    def build(self, values: str = "bits") -> dict[str, Tensor]:
        """The tensors: tied names map to the same tensor object.

        Args:
            values: ``"bits"``: random bit patterns (NaNs, infinities and -0.0 included), for
                data movement; ``"normal"``: finite N(0, 1) values, for arithmetic.
        """
        if values not in ("bits", "normal"):
            raise ValueError(f"values must be 'bits' or 'normal', got {values=}")
        gen = torch.Generator().manual_seed(self.seed)
        tensors: dict[str, Tensor] = {}
        for name, shape, dtype, train, tie in zip(
            self.names, self.shapes, self.dtypes, self.trainable, self.tied_to, strict=True
        ):
            if tie is not None:
                tensors[name] = tensors[self.names[tie]]
                continue
            if values == "bits" or not dtype.is_floating_point:
                tensor = _random_bits(shape, dtype, gen)
            else:
                tensor = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
            tensors[name] = tensor.requires_grad_(train)
        return tensors


# Name prefixes with and without list indices (the default bucket policy groups by them).
_PREFIXES = st.sampled_from(
    ["", "a.", "w.", "h.0.", "h.0.attn.", "h.1.", "h.1.mlp.", "h.10.", "b.2.x.", "0.", "1.a."]
)
shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
    st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple),
)
"""Tensor shapes: 0-d, empty (a zero dimension), small 1- to 3-d."""
_LARGE_SHAPES = st.sampled_from([(1 << 16,), (300, 257), (3, 5, 4099)])


@st.composite
def trees(
    draw: st.DrawFn,
    min_size: int = 1,
    max_size: int = 200,
    allow_large: bool = True,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES + INT_DTYPES,
    mixed_dtypes: bool | None = True,
    tie_every: int = 10,
) -> TreeSpec:
    """A random parameter set (`TreeSpec`): nested names, 0-d / empty / large tensors, mixed
    dtypes, frozen and trainable entries, integer (frozen) entries and tied aliases.

    Args:
        min_size, max_size: number of names (mostly up to 12; one draw in eight up to max_size).
        allow_large: now and then one tensor of 64K+ elements.
        dtypes: the dtypes to draw from.
        mixed_dtypes: True: each entry draws its dtype; False: one dtype for all; None: drawn.
        tie_every: about one entry in `tie_every` aliases an earlier one (0: no ties).
    """
    small = min(max_size, max(min_size, 12))
    count = draw(
        st.integers(min_size, small) | st.integers(min_size, max_size)
        if draw(st.integers(0, 7)) == 0
        else st.integers(min_size, small)
    )
    mixed = draw(st.booleans()) if mixed_dtypes is None else mixed_dtypes
    base = None if mixed else draw(st.sampled_from(tuple(dtypes)))
    names = [f"{draw(_PREFIXES)}p{i}" for i in range(count)]
    spec_shapes, spec_dtypes, trainable, tied = [], [], [], []
    large_left = 1 if allow_large and draw(st.booleans()) else 0
    for i in range(count):
        if tie_every and i > 0 and draw(st.integers(0, tie_every - 1)) == 0:
            j = draw(st.integers(0, i - 1))
            while tied[j] is not None:
                j = tied[j]
            spec_shapes.append(spec_shapes[j])
            spec_dtypes.append(spec_dtypes[j])
            trainable.append(trainable[j])
            tied.append(j)
            continue
        if large_left and draw(st.integers(0, 20)) == 0:
            shape, large_left = draw(_LARGE_SHAPES), 0
        else:
            shape = draw(shapes)
        dtype = base if base is not None else draw(st.sampled_from(tuple(dtypes)))
        spec_shapes.append(shape)
        spec_dtypes.append(dtype)
        trainable.append(dtype.is_floating_point and draw(st.booleans()))
        tied.append(None)
    seed = draw(st.integers(0, 2**31 - 1))
    return TreeSpec(
        tuple(names), tuple(spec_shapes), tuple(spec_dtypes), tuple(trainable), tuple(tied), seed
    )


world_sizes = st.integers(0, 9).flatmap(
    lambda i: st.sampled_from([97, 1000]) if i == 0 else st.integers(1, 64)
)
"""Mostly 1..64 ranks; now and then a large world where most ranks hold only padding."""


@st.composite
def worlds_and_trees(draw: st.DrawFn, work_bound: int = 2000) -> tuple[int, TreeSpec]:
    """``(world_size, TreeSpec)`` with ``world_size * entries <= work_bound`` (>= 1 entry).

    Sharding costs world_size x buckets tensor operations; the bound keeps 500 examples in
    seconds, with up to 200 entries at small world sizes and a few at 1000 ranks.
    """
    world = draw(world_sizes)
    return world, draw(trees(max_size=max(2, min(200, work_bound // world))))


@st.composite
def policies(draw: st.DrawFn, spec: TreeSpec) -> Any:
    """A bucket policy for `spec`'s names: the default (None), a size cap, or explicit groups."""
    kind = draw(st.sampled_from(["default", "cap", "explicit"]))
    if kind == "default":
        return None
    if kind == "cap":
        return draw(st.integers(1, 5000))
    stored = [n for n, t in zip(spec.names, spec.tied_to, strict=True) if t is None]
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(stored) - 1)), max_size=8)))
    bounds = [0, *[c for c in cuts if c < len(stored)], len(stored)]
    return [stored[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@st.composite
def layouts(
    draw: st.DrawFn, values: str = "bits", work_bound: int = 2000
) -> tuple[dict[str, Tensor], fzero.ShardLayout]:
    """``(params, layout)``: a random parameter set planned for any world size and policy."""
    world, spec = draw(worlds_and_trees(work_bound=work_bound))
    params = spec.build(values)
    return params, fzero.plan(params, world, buckets=draw(policies(spec)))


# --------------------------------------------------------------------------------------------
# Ready-made checks


def check_roundtrip(
    model: nn.Module,
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    buckets: Sequence[Any] = (None, 1, 4096),
    *,
    gather: bool = True,
) -> int:
    """Assert that `model`'s parameters shard and reassemble bit for bit.

    For every world size N and bucket policy (as `fzero.plan`'s ``buckets=``; ``1`` puts each
    parameter in a bucket of its own): ``unshard([shard(p, L, r) for r < N]) == p`` and
    ``unflatten(flatten(p, L)) == p`` for every name (tied ones included), the layout survives
    JSON, and, with `gather`, the all-gather of every rank's shards on a `SimWorld` of N ranks
    gives every rank ``p``. Each check runs on the model's own values and again on random bit
    patterns of the same shapes and dtypes (NaN, inf and -0.0 must move exactly too).

    Args:
        model: a module with materialized parameters.
        world_sizes: the world sizes to check (odd ones catch padding bugs).
        buckets: the bucket policies to check.
        gather: also check the collective path on in-process ranks.

    Returns:
        The number of layouts checked.

    Raises:
        AssertionError: naming the world size, policy, value kind and parameter that differ.
        ValueError: empty `world_sizes` or `buckets` (nothing would be checked), or a world
            size below 1.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"check_roundtrip needs an nn.Module, got {type(model).__name__}")
    _check_grid("check_roundtrip", world_sizes=world_sizes, buckets=buckets)
    own = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    if any(t.is_meta for t in own.values()):
        raise ValueError("check_roundtrip needs materialized parameters, not the meta device")
    checked = 0
    for n in world_sizes:
        for policy in buckets:
            layout = fzero.plan(model, n, buckets=policy)
            if fzero.ShardLayout.from_json(layout.to_json()) != layout:
                raise AssertionError(f"N={n}, buckets={policy!r}: the layout changes via JSON")
            for kind, params in (("model values", own), ("random bits", _bits_like(layout))):
                where = f"N={n}, buckets={policy!r}, {kind}"
                shards = [fzero.shard(params, layout, r) for r in range(n)]
                _assert_same(fzero.unshard(shards, layout), params, f"{where}, unshard")
                flats = fzero.flatten(params, layout)
                _assert_same(fzero.unflatten(flats, layout), params, f"{where}, unflatten")
                _assert_zero_padding(layout, flats, "flatten", where)
                _assert_zero_padding(layout, [torch.cat([s[b] for s in shards])
                                              for b in range(len(layout.buckets))],
                                     "the shards", where)
                if gather:
                    # The ranks only read their inputs: share them rather than copy them.
                    results = fzero.SimWorld(n, copy_args=False).run(_gather_rank, layout, shards)
                    for rank, full in enumerate(results):
                        _assert_same(full, params, f"{where}, gather on rank {rank}")
            checked += 1
    return checked


def _assert_zero_padding(layout: fzero.ShardLayout, flats: Sequence[Tensor], made: str,
                         where: str) -> None:
    """Every bucket's padding (past its last entry) in `flats` is zero bits."""
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        tail = flat[bucket.numel:]
        if bool((bits(tail) != 0).any()):
            raise AssertionError(f"{where}: the padding of bucket {bucket.label!r} made by "
                                 f"{made} is not zero: {tail.tolist()[:8]}")


def _bits_like(layout: fzero.ShardLayout) -> dict[str, Tensor]:
    """Random bit patterns for every stored parameter of the layout, aliases tied."""
    gen = torch.Generator().manual_seed(0)
    params = {}
    for bucket in layout.buckets:
        for entry in bucket.entries:
            value = _random_bits(entry.shape, bucket.torch_dtype, gen)
            params.update(dict.fromkeys(entry.names, value))
    return params


def _gather_rank(comm: Any, layout: fzero.ShardLayout, shards_by_rank: list) -> dict:
    with torch.no_grad():
        full = fzero.collectives(layout, comm).gather(list(shards_by_rank[comm.rank]))
    return {name: t.clone() for name, t in full.items()}


def _check_grid(what: str, **grids: Sequence[Any]) -> None:
    """Raise unless each of `grids` is non-empty (an empty one checks nothing and passed) and
    its world sizes are ints >= 1."""
    for name, values in grids.items():
        if not len(values):
            raise ValueError(f"{what}: {name} is empty: nothing would be checked")
    for n in grids.get("world_sizes", ()):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{what}: world sizes must be ints >= 1, got {n!r}")


def _widened(tensor: Tensor) -> Tensor:
    """`tensor` in the widest dtype of its kind, for differences (complex keeps its imaginary
    part: ``.double()`` drops it)."""
    return tensor.to(torch.complex128 if tensor.is_complex() else torch.float64)


def _assert_same(got: dict[str, Tensor], want: dict[str, Tensor], where: str) -> None:
    missing = sorted(set(want) - set(got))
    if missing:
        raise AssertionError(f"{where}: parameters missing from the result: {missing[:5]}")
    for name, tensor in want.items():
        if not bitwise_equal(got[name], tensor):
            raise AssertionError(
                f"{where}: parameter {name!r} differs (got shape {tuple(got[name].shape)} "
                f"{got[name].dtype}, want {tuple(tensor.shape)} {tensor.dtype})"
            )


_OPTIMIZERS: dict[str, tuple[Callable[..., Any], Callable[..., torch.optim.Optimizer]]] = {
    "adamw": (fzero.optim.adamw, torch.optim.AdamW),
    "adam": (fzero.optim.adam, torch.optim.Adam),
    "sgd": (fzero.optim.sgd, torch.optim.SGD),
}


def check_step_parity(
    model: nn.Module,
    loss_fn: Callable[[Callable[..., Any], Any], Tensor],
    batches: Sequence[Any],
    *,
    stages: Sequence[int] = (0, 1, 2, 3),
    world_sizes: Sequence[int] = (1, 2, 3),
    optimizer: tuple[str, dict[str, Any]] = ("adamw", {"lr": 1e-3}),
    clip_norm: float | None = None,
    rtol: float = 1e-9,
    atol: float = 1e-12,
) -> dict[tuple[int, int], float]:
    """Assert that fzero trains `model` like single-process ``torch.optim``, in float64.

    A float64 copy of `model` trains on each global batch in `batches` twice: with
    `fzero.make_train_step` on a `SimWorld` of N ranks per stage and N (rank r takes rows
    [r * B / N, (r + 1) * B / N) of every tensor), and in one process with the matching
    ``torch.optim`` optimizer on the whole batch. Losses (before each update), gradient norms
    (before clipping), the final parameters, the optimizer's moments (Adam's update hides
    gradients off by a constant factor, its first moment does not) and the buffers must agree
    within `rtol` / `atol`, the parameters must be finite, and every rank must gather the same
    parameters.
    Weight decay applies to every trainable parameter, as in a single torch param group.
    A model whose forward depends on the batch as a whole (BatchNorm in train mode: each rank
    normalizes its own rows, as under DDP) matches the one-process reference at N = 1 only,
    and one that draws random numbers (dropout in train mode) not at all: check those in
    eval mode, or at ``world_sizes=(1,)``.

    Args:
        model: the module (not modified); parameters with ``requires_grad=False`` stay frozen.
        loss_fn: ``loss_fn(call, batch) -> scalar``, the *mean* over the batch's rows, where
            ``call(*a, **kw)`` runs the model (the model itself for the reference). It should
            compute in the parameters' dtype: a cast to float32 inside (``logits.float()``)
            limits agreement to float32 rounding, and needs ``rtol`` around 1e-5.
        batches: global batches (any pytree of tensors with the batch on dim 0; floating
            tensors are cast to float64), one per step; sizes divisible by every world size.
        stages: ZeRO stages to check.
        world_sizes: world sizes to check.
        optimizer: ``(name, kwargs)`` with name ``"adamw"``, ``"adam"`` or ``"sgd"``; the same
            kwargs build `fzero.optim.<name>` and the torch optimizer.
        clip_norm: clip the global gradient norm, as ``torch.nn.utils.clip_grad_norm_``.
        rtol, atol: tolerances for losses and parameters.

    Returns:
        ``{(stage, world_size): largest absolute parameter difference from torch.optim}``.

    Raises:
        AssertionError: naming the stage, world size, step or parameter that differs.
        ValueError: an unknown optimizer, a batch size not divisible by a world size, or
            empty `stages` or `world_sizes` (nothing would be checked).
    """
    name, kwargs = optimizer
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZERS)}, got {name!r}")
    if not batches:
        raise ValueError("check_step_parity needs at least one global batch")
    _check_grid("check_step_parity", stages=stages, world_sizes=world_sizes)
    batches = [_to_float64(b) for b in batches]
    for n in world_sizes:
        for i, batch in enumerate(batches):
            rows = _rows(batch)
            if rows % n:
                raise ValueError(f"batch {i} has {rows} rows, not divisible by world size {n}")
    model = copy.deepcopy(model).double()
    want_losses, want_norms, want, want_moments, want_buffers = _reference(
        model, loss_fn, batches, _OPTIMIZERS[name][1], kwargs, clip_norm)
    errors = {}
    for stage in stages:
        for n in world_sizes:
            results = fzero.SimWorld(n).run(
                _train_rank, model, loss_fn, batches, stage, name, kwargs, clip_norm
            )
            where = f"stage {stage}, N={n}"
            for rank, (losses, norms, params, _, _) in enumerate(results):
                for what, values, expected in (("loss", losses, want_losses),
                                               ("gradient norm", norms, want_norms)):
                    for step, (got, exp) in enumerate(zip(values, expected, strict=True), 1):
                        if not math.isclose(got, exp, rel_tol=rtol, abs_tol=atol):
                            raise AssertionError(
                                f"{where}, rank {rank}: {what} of step {step} is {got!r}, "
                                f"torch.optim gives {exp!r}"
                            )
                if rank:
                    _assert_same(params, results[0][2], f"{where}: rank {rank} vs rank 0")
            # (moments first: a factor on the gradients shows there, not in Adam's update)
            _compare_state(results[0][3], want_moments, "optimizer moment", rtol, atol, where)
            _compare_state(results[0][4], want_buffers, "buffer", rtol, atol, where)
            errors[(stage, n)] = _compare_params(results[0][2], want, rtol, atol, where)
    return errors


def _to_float64(batch: Any) -> Any:
    return pytree.tree_map(
        lambda x: x.double() if isinstance(x, Tensor) and x.is_floating_point() else x, batch
    )


def _rows(batch: Any) -> int:
    tensors = [x for x in pytree.tree_leaves(batch) if isinstance(x, Tensor) and x.dim()]
    if not tensors:
        raise ValueError(f"a batch needs a tensor with the batch on dim 0, got {batch!r}")
    return tensors[0].shape[0]


def _rank_rows(batch: Any, rank: int, world: int) -> Any:
    per_rank = _rows(batch) // world
    return pytree.tree_map(
        lambda x: x[rank * per_rank : (rank + 1) * per_rank]
        if isinstance(x, Tensor) and x.dim() else x,
        batch,
    )


def _decay_all(name: str, shape: tuple[int, ...]) -> bool:
    return True


def _train_rank(
    comm: Any, model: nn.Module, loss_fn: Callable, batches: list, stage: int, name: str,
    kwargs: dict[str, Any], clip_norm: float | None,
) -> tuple[list[float], list[float], dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    optimizer = _OPTIMIZERS[name][0](**kwargs)
    state = fzero.init(model, stage=stage, optimizer=optimizer, comm=comm,
                       master_dtype=torch.float64)
    step = fzero.make_train_step(model, loss_fn, clip_norm=clip_norm, decay=_decay_all)
    losses, norms = [], []
    for batch in batches:
        state, metrics = step(state, _rank_rows(batch, comm.rank, comm.world_size))
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    buffers = {n: b.clone() for n, b in state.buffers.items()}
    return losses, norms, fzero.full_params(state), _full_moments(state), buffers


def _full_moments(state: fzero.ShardState) -> dict[str, Tensor]:
    """Every optimizer moment gathered, as ``"<moment> of <parameter>"`` (each name of a tie)."""
    out = {}
    for moment, values in state.moments.items():
        for bucket, value in zip(state.layout.buckets, values, strict=True):
            if value is None:  # a frozen bucket
                continue
            flat = value if state.stage == 0 else all_gather_bucket(
                state.config.comm, bucket, value.contiguous()).wait()
            for entry in bucket.entries:
                view = flat[entry.offset : entry.end].view(entry.shape).clone()
                out.update({f"{moment} of {name}": view for name in entry.names})
    return out


def _reference(
    model: nn.Module, loss_fn: Callable, batches: list, factory: Callable, kwargs: dict,
    clip_norm: float | None,
) -> tuple[list[float], list[float], dict[str, Tensor]]:
    """Losses, gradient norms (before clipping), final parameters, optimizer moments (as
    `_full_moments` names them) and buffers of one-process torch."""
    model = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = factory(trainable, **kwargs)
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        grads = [p.grad for p in trainable if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0)
        if clip_norm is not None:
            nn.utils.clip_grad_norm_(trainable, clip_norm)
        opt.step()
        losses.append(loss.item())
    named = dict(model.named_parameters(remove_duplicate=False))
    params = {n: p.detach() for n, p in named.items()}
    moments = {f"{moment} of {n}": value for n, p in named.items()
               for moment, value in opt.state.get(p, {}).items() if moment != "step"}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    return losses, norms, params, moments, buffers


def _compare_state(got: dict[str, Tensor], want: dict[str, Tensor], what: str, rtol: float,
                   atol: float, where: str) -> None:
    """Each of `want` (torch's) against `got` (fzero's) within ``atol + rtol * |want|``;
    integers exactly."""
    for name, value in want.items():
        if name not in got:
            raise AssertionError(f"{where}: {what} {name!r} of torch.optim's run is missing "
                                 f"from fzero's state")
        mine = got[name]
        if not value.is_floating_point():
            if not torch.equal(mine, value):
                raise AssertionError(f"{where}: {what} {name!r} is {mine.tolist()}, torch.optim "
                                     f"gives {value.tolist()}")
            continue
        largest, beyond = _difference(mine, value, rtol, atol)
        if beyond:
            raise AssertionError(f"{where}: {what} {name!r} differs from torch.optim's by up to "
                                 f"{largest:.3g} (rtol={rtol}, atol={atol})")


def _difference(got: Tensor, want: Tensor, rtol: float, atol: float) -> tuple[float, bool]:
    """The largest absolute difference (0 for empty tensors), and whether some element's
    exceeds ``atol + rtol * |want|``."""
    diff = (_widened(got) - _widened(want)).abs()
    if diff.numel() == 0:
        return 0.0, False
    return float(diff.max()), bool((diff > atol + rtol * _widened(want).abs()).any())


def _compare_params(
    got: dict[str, Tensor], want: dict[str, Tensor], rtol: float, atol: float, where: str
) -> float:
    """The largest absolute difference; raises where one exceeds ``atol + rtol * |want|``."""
    worst = 0.0
    for name, value in want.items():
        if name not in got:
            raise AssertionError(f"{where}: parameter {name!r} is missing from full_params")
        for whose, tensor in (("fzero's", got[name]), ("torch.optim's", value)):
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise AssertionError(f"{where}: {whose} parameter {name!r} is not finite")
        largest, beyond = _difference(got[name], value, rtol, atol)
        if beyond:
            raise AssertionError(
                f"{where}: parameter {name!r} differs from torch.optim by up to "
                f"{largest:.3g} (rtol={rtol}, atol={atol})"
            )
        worst = max(worst, largest)
    return worst
