"""fzero.testing: the ready-made checks pass on the example GPT and fail when something is wrong;
the strategies draw what they promise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from train_gpt import GPT, GPTConfig

import fzero
from fzero.testing import (
    bitwise_equal,
    check_roundtrip,
    check_step_parity,
    layouts,
    trees,
)

from models import FrozenMix


def loss_fn(call, batch):
    """train_gpt's loss without its cast to float32, so float64 parity is float64-tight."""
    x, y = batch
    return F.cross_entropy(call(x).flatten(0, 1), y.flatten())


def mse(call, batch):
    x, y = batch
    return F.mse_loss(call(x), y)


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(seq_len=8, n_layer=2, n_head=2, d_model=16), seed=0)


def gpt_batches(steps: int = 3, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (rows, 9), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def test_check_roundtrip_on_the_example_gpt() -> None:
    assert check_roundtrip(tiny_gpt(), world_sizes=(1, 2, 3), buckets=(None, 1, 500)) == 9


def test_check_roundtrip_sees_a_broken_unshard(monkeypatch: pytest.MonkeyPatch) -> None:
    unshard = fzero.unshard

    def off_by_one_bit(shards, layout):
        params = unshard(shards, layout)
        name = layout.buckets[-1].entries[-1].name
        params[name] = params[name].clone()
        params[name].view(-1)[:1].view(torch.int32).add_(1)  # flip the lowest bit
        return params

    monkeypatch.setattr(fzero, "unshard", off_by_one_bit)
    with pytest.raises(AssertionError, match=r"N=1, buckets=None, model values, unshard"):
        check_roundtrip(tiny_gpt(), world_sizes=(1,), buckets=(None,))


@pytest.mark.parametrize("optimizer", [("adamw", {"lr": 1e-2, "weight_decay": 0.1}),
                                       ("sgd", {"lr": 0.1, "momentum": 0.9})],
                         ids=["adamw", "sgd"])
def test_check_step_parity_on_the_example_gpt(optimizer) -> None:
    errors = check_step_parity(tiny_gpt(), loss_fn, gpt_batches(), stages=(0, 1, 2, 3),
                               world_sizes=(1, 2, 3), optimizer=optimizer)
    assert set(errors) == {(s, n) for s in range(4) for n in (1, 2, 3)}
    assert max(errors.values()) < 1e-12


def test_check_step_parity_with_frozen_parameters() -> None:
    batches = [FrozenMix.make_batch(seed, 6) for seed in range(3)]
    errors = check_step_parity(FrozenMix(), mse, batches, stages=(1, 3), world_sizes=(2, 3))
    assert max(errors.values()) < 1e-12


def test_check_step_parity_with_clipping_in_float64() -> None:
    """The clip coefficient is computed in the gradients' dtype, as torch does."""
    batches = [FrozenMix.make_batch(seed, 6) for seed in range(3)]
    check_step_parity(FrozenMix(), mse, batches, stages=(0,), world_sizes=(1,), clip_norm=0.05)


def test_check_step_parity_sees_a_loss_that_is_not_a_mean() -> None:
    def summed(call, batch):  # per-rank sums averaged over ranks != the global sum
        x, y = batch
        return F.cross_entropy(call(x).flatten(0, 1), y.flatten(), reduction="sum")

    with pytest.raises(AssertionError, match=r"stage 0, N=2, rank 0: loss of step 1"):
        check_step_parity(tiny_gpt(), summed, gpt_batches(1), stages=(0,), world_sizes=(2,))


def test_check_step_parity_rejects_batches_that_do_not_split() -> None:
    with pytest.raises(ValueError, match="6 rows, not divisible by world size 4"):
        check_step_parity(tiny_gpt(), loss_fn, gpt_batches(1), world_sizes=(4,))


@given(layouts())
def test_layouts_plan_what_they_draw(case) -> None:
    params, layout = case
    assert sorted(layout.names) == sorted(params)
    for bucket in layout.buckets:
        for entry in bucket.entries:
            for name in entry.names:
                assert params[name] is params[entry.name]  # ties are one tensor
            assert tuple(params[entry.name].shape) == entry.shape


@given(trees(max_size=8, allow_large=False, mixed_dtypes=False, tie_every=0))
def test_trees_options(spec) -> None:
    assert len(set(spec.dtypes)) == 1 and all(t is None for t in spec.tied_to)
    normal = spec.build("normal")
    for name, value in spec.build("bits").items():
        assert value.shape == normal[name].shape and value.dtype == normal[name].dtype
        if value.is_floating_point():
            assert torch.isfinite(normal[name]).all()
    assert all(bitwise_equal(t, t.clone()) for t in normal.values())


# What the checks must see: a small deviation anywhere they promise to look. Each of these
# survived a mutation of fzero.testing (a loosened tolerance, the last parameter skipped,
# ranks not compared with each other, only the first loss compared) found by a probe.

LAST = "lm_head.weight"  # the last name the GPT gives a parameter (wte.weight's tie)


@pytest.mark.parametrize(("where", "what", "raised"), [
    ("params", (None, LAST), rf"stage 1, N=2: parameter '{LAST}' differs from torch.optim"),
    ("params", (1, None), r"stage 1, N=2: rank 1 vs rank 0"),
    ("losses", (0, 2), r"stage 1, N=2, rank 0: loss of step 3"),
    ("norms", (1, 1), r"stage 1, N=2, rank 1: gradient norm of step 2"),
])
def test_check_step_parity_sees_a_deviation_of_one_part_in_ten_million(
    monkeypatch: pytest.MonkeyPatch, where: str, what: tuple[int | None, object], raised: str
) -> None:
    from fzero import testing

    real = testing._train_rank
    rank, key = what

    def deviating(comm, *args, **kwargs):
        losses, norms, params, moments, buffers = real(comm, *args, **kwargs)
        if rank is None or comm.rank == rank:  # None: every rank alike
            if where == "params":
                name = key or next(iter(params))
                params = {**params, name: params[name] * (1 + 1e-7)}
            elif where == "norms":
                norms = [*norms[:key], norms[key] * (1 + 1e-7)]
            else:
                losses = [*losses[:key], losses[key] * (1 + 1e-7)]
        return losses, norms, params, moments, buffers

    monkeypatch.setattr(testing, "_train_rank", deviating)
    assert list(dict(tiny_gpt().named_parameters(remove_duplicate=False)))[-1] == LAST
    with pytest.raises(AssertionError, match=raised):
        check_step_parity(tiny_gpt(), loss_fn, gpt_batches(), stages=(1,), world_sizes=(2,))


def test_check_roundtrip_sees_a_nan_payload_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random-bits pass: an unshard that canonicalizes NaN (as ``torch.where(x != x, nan,
    x)`` would) keeps every model value and loses NaN payload bits."""
    unshard = fzero.unshard

    def canonical_nan(shards, layout):
        return {name: torch.where(torch.isnan(p), torch.nan, p)
                for name, p in unshard(shards, layout).items()}

    monkeypatch.setattr(fzero, "unshard", canonical_nan)
    with pytest.raises(AssertionError, match=r"N=1, buckets=None, random bits, unshard"):
        check_roundtrip(tiny_gpt(), world_sizes=(1,), buckets=(None,))


def test_check_roundtrip_sees_a_gather_broken_on_one_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fzero import testing

    real = testing._gather_rank

    def broken_on_rank_1(comm, layout, shards):
        full = real(comm, layout, shards)
        if comm.rank == 1:
            name = next(iter(full))
            full = {**full, name: full[name] + 1}
        return full

    monkeypatch.setattr(testing, "_gather_rank", broken_on_rank_1)
    with pytest.raises(AssertionError, match=r"N=2, buckets=None, model values, gather on rank 1"):
        check_roundtrip(tiny_gpt(), world_sizes=(2,), buckets=(None,))


def test_check_step_parity_sees_gradients_n_times_too_large_under_adam(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adam's update is blind to a constant factor on the gradient, so with the default AdamW
    a reduction that sums instead of averaging passed at every stage (a probe); the gradient
    norm, compared with torch's, shows it."""
    from fzero import testing

    real = testing._train_rank

    def doubled_norms(comm, *args, **kwargs):  # as a summing reduction reports at N = 2
        losses, norms, params, moments, buffers = real(comm, *args, **kwargs)
        return losses, [2 * n for n in norms], params, moments, buffers

    monkeypatch.setattr(testing, "_train_rank", doubled_norms)
    with pytest.raises(AssertionError, match=r"stage 2, N=2, rank 0: gradient norm of step 1"):
        check_step_parity(tiny_gpt(), loss_fn, gpt_batches(1), stages=(2,), world_sizes=(2,))


def test_check_step_parity_sees_nan_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN difference compares False with any tolerance: NaN final parameters passed
    (a probe). Non-finite parameters on either side raise now."""
    from fzero import testing

    real = testing._train_rank

    def nan_params(comm, *args, **kwargs):
        losses, norms, params, moments, buffers = real(comm, *args, **kwargs)
        nan = {n: torch.full_like(p, torch.nan) for n, p in params.items()}
        return losses, norms, nan, moments, buffers

    monkeypatch.setattr(testing, "_train_rank", nan_params)
    with pytest.raises(AssertionError, match=r"stage 1, N=1: fzero's parameter .* is not finite"):
        check_step_parity(tiny_gpt(), loss_fn, gpt_batches(1), stages=(1,), world_sizes=(1,))


def test_check_step_parity_sees_the_optimizer_given_gradients_n_times_too_large(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A factor between the gradient norm and the optimizer (every gradient doubled as the
    update reads it) passed with the default AdamW: its update is blind to the factor and
    the norm was right (a probe). The first moment, compared with torch's, shows it."""
    from fzero import step

    real = step.apply_update

    def doubled(optimizer, grads, *args, **kwargs):
        return real(optimizer, [g * 2 for g in grads], *args, **kwargs)

    def large_loss(call, batch):  # gradients far above eps: the update ignores their scale
        return loss_fn(call, batch) * 1e6

    monkeypatch.setattr(step, "apply_update", doubled)
    with pytest.raises(AssertionError, match=r"stage 2, N=2: optimizer moment 'exp_avg of "):
        check_step_parity(tiny_gpt(), large_loss, gpt_batches(1), stages=(2,),
                          world_sizes=(2,))


class _Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.lin, self.norm = torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def _normed_loss(call: Callable[..., torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    return call(batch).pow(2).mean()


def test_check_step_parity_compares_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers (BatchNorm's running statistics) were never compared: a step that kept the
    old ones passed (a probe). Equal buffers pass; a state that keeps them raises."""
    batches = [torch.randn(8, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    check_step_parity(_Normed(), _normed_loss, batches, stages=(0, 3), world_sizes=(1,))
    from fzero import testing

    real = testing._train_rank

    def stale_buffers(comm, *args, **kwargs):
        losses, norms, params, moments, buffers = real(comm, *args, **kwargs)
        return losses, norms, params, moments, {n: torch.zeros_like(b) for n, b in
                                                buffers.items()}

    monkeypatch.setattr(testing, "_train_rank", stale_buffers)
    with pytest.raises(AssertionError, match=r"stage 0, N=1: buffer 'norm.running_mean'"):
        check_step_parity(_Normed(), _normed_loss, batches, stages=(0,), world_sizes=(1,))


def test_check_roundtrip_sees_padding_that_is_not_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padding must be zero (``fzero.flat``'s equations); an unshard or flatten that keeps
    every value but fills padding with garbage passed (a probe)."""
    flatten = fzero.flatten

    def dirty(params, layout):
        flats = flatten(params, layout)
        for flat, bucket in zip(flats, layout.buckets, strict=True):
            flat[bucket.numel:] = 7
        return flats

    monkeypatch.setattr(fzero, "flatten", dirty)
    with pytest.raises(AssertionError, match=r"N=3, buckets=None, model values: the padding of "
                                             r"bucket .* made by flatten is not zero"):
        check_roundtrip(tiny_gpt(), world_sizes=(3,), buckets=(None,), gather=False)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.uint16, torch.uint32])
def test_check_roundtrip_takes_every_dtype_fzero_shards(dtype: torch.dtype) -> None:
    """Complex, float8 and unsigned parameters raised a bare KeyError (no bitwise view)."""
    model = torch.nn.Linear(3, 5)
    model.weight = torch.nn.Parameter(torch.zeros(5, 3).to(dtype), requires_grad=False)
    assert check_roundtrip(model, world_sizes=(1, 2), buckets=(None,)) == 2


@pytest.mark.parametrize(("call", "message"), [
    (lambda: check_step_parity(tiny_gpt(), loss_fn, gpt_batches(1), stages=()),
     "check_step_parity: stages is empty"),
    (lambda: check_step_parity(tiny_gpt(), loss_fn, gpt_batches(1), world_sizes=()),
     "check_step_parity: world_sizes is empty"),
    (lambda: check_step_parity(tiny_gpt(), loss_fn, gpt_batches(1), world_sizes=(0,)),
     "world sizes must be ints >= 1, got 0"),
    (lambda: check_roundtrip(tiny_gpt(), world_sizes=()), "check_roundtrip: world_sizes is"),
    (lambda: check_roundtrip(tiny_gpt(), buckets=()), "check_roundtrip: buckets is empty"),
], ids=["no stages", "no world sizes", "world size 0", "roundtrip: no world sizes",
        "roundtrip: no policies"])
def test_the_checks_refuse_a_grid_that_checks_nothing(call: Callable[[], Any],
                                                      message: str) -> None:
    """An empty grid checked nothing and passed; a world size 0 divided by zero (a probe)."""
    with pytest.raises(ValueError, match=message):
        call()


def test_check_step_parity_compares_the_imaginary_part_of_complex_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Differences were taken after ``.double()``, which drops the imaginary part: a frozen
    complex parameter gathered conjugated passed (a probe)."""
    from fzero import testing

    class WithPhase(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.phase = torch.nn.Parameter(torch.tensor([1 + 2j]), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.phase.abs()

    batches = [torch.randn(4, 3, generator=torch.Generator().manual_seed(0))]

    def loss(call: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return call(x).pow(2).mean()

    check_step_parity(WithPhase(), loss, batches, stages=(0,), world_sizes=(1,))
    real = testing._train_rank

    def conjugated(comm, *args, **kwargs):
        losses, norms, params, moments, buffers = real(comm, *args, **kwargs)
        return losses, norms, {**params, "phase": params["phase"].conj()}, moments, buffers

    monkeypatch.setattr(testing, "_train_rank", conjugated)
    with pytest.raises(AssertionError, match=r"parameter 'phase' differs from torch.optim"):
        check_step_parity(WithPhase(), loss, batches, stages=(0,), world_sizes=(1,))
