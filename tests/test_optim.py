"""Tests for `fzero.optim`: bitwise parity with torch.optim, decay ranges, schedules, clipping."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from fzero import optim

# --------------------------------------------------------------------------------------------
# Strategies (local: tests/strategies.py belongs to the layout tests)

DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Problem:
    """Drawn tensors: shapes, dtype, number of steps, and a seed for the values."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    steps: int
    seed: int

    def params(self) -> list[Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        return [torch.randn(s, generator=gen, dtype=self.dtype) for s in self.shapes]

    def grads(self) -> list[list[Tensor]]:
        """One list of gradients per step (large and tiny magnitudes mixed)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        out = []
        for _ in range(self.steps):
            scale = 10.0 ** torch.randint(-4, 3, (), generator=gen).item()
            out.append(
                [torch.randn(s, generator=gen, dtype=self.dtype) * scale for s in self.shapes]
            )
        return out


shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
problems = st.builds(
    Problem,
    shapes=st.lists(shapes, min_size=1, max_size=4).map(tuple),
    dtype=st.sampled_from(DTYPES),
    steps=st.integers(1, 10),
    seed=st.integers(0, 2**31 - 1),
)
flat_problems = st.builds(
    Problem,
    shapes=st.lists(st.integers(0, 40).map(lambda n: (n,)), min_size=1, max_size=4).map(tuple),
    dtype=st.sampled_from(DTYPES),
    steps=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
lrs = st.floats(1e-4, 1.0)
betas = st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.9999))
epss = st.floats(1e-10, 1e-3)
wds = st.one_of(st.just(0.0), st.floats(0.0, 0.5))


def assert_bitwise(actual: list[Tensor], expected: list[Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)


def run_fzero(
    opt: optim.Optimizer,
    problem: Problem,
    *,
    lr_at: Callable[[int], float] | None = None,
    decay: optim.DecayRanges | None = None,
) -> tuple[list[Tensor], optim.Moments]:
    params = problem.params()
    moments = opt.init(params)
    for step, grads in enumerate(problem.grads(), start=1):
        lr = None if lr_at is None else lr_at(step)
        assert opt.update(grads, moments, params, step=step, lr=lr, decay=decay) is None
    return params, moments


def run_torch(
    make: Callable[[list[Tensor]], torch.optim.Optimizer],
    problem: Problem,
    *,
    lr_at: Callable[[int], float] | None = None,
) -> tuple[list[Tensor], torch.optim.Optimizer]:
    params = [p.requires_grad_() for p in problem.params()]
    opt = make(params)
    for step, grads in enumerate(problem.grads(), start=1):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        opt.step()
    return [p.detach() for p in params], opt


def torch_state(opt: torch.optim.Optimizer, params: list[Tensor], name: str) -> list[Tensor]:
    return [opt.state[p][name] for p in opt.param_groups[0]["params"]]


# --------------------------------------------------------------------------------------------
# Parity with torch.optim


@pytest.mark.parametrize("foreach", [False, True])
@given(problem=problems, lr=lrs, betas=betas, eps=epss, wd=wds)
def test_adamw_matches_torch(problem, lr, betas, eps, wd, foreach) -> None:
    params, moments = run_fzero(optim.adamw(lr, betas, eps, wd), problem)
    ref, opt = run_torch(
        lambda ps: torch.optim.AdamW(ps, lr, betas, eps, wd, foreach=foreach), problem
    )
    assert_bitwise(params, ref)
    assert_bitwise(list(moments["exp_avg"]), torch_state(opt, ref, "exp_avg"))
    assert_bitwise(list(moments["exp_avg_sq"]), torch_state(opt, ref, "exp_avg_sq"))


@pytest.mark.parametrize("foreach", [False, True])
@given(problem=problems, lr=lrs, betas=betas, eps=epss, wd=wds)
def test_adam_matches_torch(problem, lr, betas, eps, wd, foreach) -> None:
    params, moments = run_fzero(optim.adam(lr, betas, eps, wd), problem)
    ref, opt = run_torch(
        lambda ps: torch.optim.Adam(ps, lr, betas, eps, wd, foreach=foreach), problem
    )
    assert_bitwise(params, ref)
    assert_bitwise(list(moments["exp_avg"]), torch_state(opt, ref, "exp_avg"))
    assert_bitwise(list(moments["exp_avg_sq"]), torch_state(opt, ref, "exp_avg_sq"))


sgd_settings = st.one_of(
    st.tuples(st.just(0.0), st.just(0.0), st.just(False)),  # plain
    st.tuples(st.floats(0.01, 0.99), st.floats(0.0, 0.9), st.just(False)),  # momentum
    st.tuples(st.floats(0.01, 0.99), st.just(0.0), st.just(True)),  # nesterov
)


@pytest.mark.parametrize("foreach", [False, True])
@given(problem=problems, lr=lrs, setting=sgd_settings, wd=wds)
def test_sgd_matches_torch(problem, lr, setting, wd, foreach) -> None:
    momentum, dampening, nesterov = setting
    opt = optim.sgd(lr, momentum, dampening, wd, nesterov)
    params, moments = run_fzero(opt, problem)
    ref, topt = run_torch(
        lambda ps: torch.optim.SGD(ps, lr, momentum, dampening, wd, nesterov, foreach=foreach),
        problem,
    )
    assert_bitwise(params, ref)
    if momentum:
        assert_bitwise(list(moments["momentum_buffer"]), torch_state(topt, ref, "momentum_buffer"))
    else:
        assert moments == {}


@given(problem=problems, warmup=st.integers(0, 5), total=st.integers(5, 12))
def test_schedule_matches_torch_with_lr_set_per_step(problem, warmup, total) -> None:
    schedule = optim.cosine_schedule(3e-2, warmup, total, min_lr=1e-3)
    params, _ = run_fzero(optim.adamw(schedule, weight_decay=0.1), problem)
    ref, _ = run_torch(
        lambda ps: torch.optim.AdamW(ps, 0.0, weight_decay=0.1), problem, lr_at=schedule
    )
    assert_bitwise(params, ref)


@given(problem=problems)
def test_lr_keyword_overrides(problem) -> None:
    def lr_at(step: int) -> float:
        return 0.05 / step

    params, _ = run_fzero(optim.sgd(lr=123.0, momentum=0.9), problem, lr_at=lr_at)
    ref, _ = run_torch(lambda ps: torch.optim.SGD(ps, 0.0, momentum=0.9), problem, lr_at=lr_at)
    assert_bitwise(params, ref)


# --------------------------------------------------------------------------------------------
# Weight-decay ranges against torch.optim with two param groups. Slicing moves elements between
# the vectorised body and the scalar tail of the CPU kernels; both round alike (checked bitwise
# under ATEN_CPU_CAPABILITY=default, avx2 and avx512), so these compare bitwise too.


@st.composite
def flat_problem_with_ranges(draw):
    problem = draw(flat_problems)
    decay = []
    for (n,) in problem.shapes:
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
        # Alternate: cuts[0]:cuts[1] decayed, cuts[2]:cuts[3] decayed, ...
        pairs = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
        decay.append(draw(st.permutations(pairs)))
    return problem, decay


def segments(n: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """Split [0, n) into (start, end, decayed) pieces."""
    marks = sorted({0, n, *(x for r in ranges for x in r)})
    decayed = [False] * n
    for start, end in ranges:
        decayed[start:end] = [True] * (end - start)
    return [(a, b, decayed[a]) for a, b in zip(marks, marks[1:], strict=False) if a < b]


def run_torch_grouped(make, problem: Problem, decay) -> list[Tensor]:
    """torch.optim over slices of the flat params: decayed slices in group 0, others in 1."""
    flat = problem.params()
    pieces = [
        (i, a, b, flat[i][a:b].clone().requires_grad_(), dec)
        for i, ((n,), ranges) in enumerate(zip(problem.shapes, decay, strict=True))
        for a, b, dec in segments(n, list(ranges))
    ]
    if not pieces:  # only empty tensors: nothing to step
        return flat
    opt = make([p for *_, p, dec in pieces if dec], [p for *_, p, dec in pieces if not dec])
    for grads in problem.grads():
        for i, a, b, p, _ in pieces:
            p.grad = grads[i][a:b].clone()
        opt.step()
    out = [torch.empty_like(p) for p in flat]
    for i, a, b, p, _ in pieces:
        out[i][a:b] = p.detach()
    return out


def two_groups(cls, wd, **kwargs):
    def make(decayed, rest):
        groups = [{"params": decayed, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]
        return cls([g for g in groups if g["params"]], **kwargs)

    return make


@given(case=flat_problem_with_ranges(), lr=lrs, wd=st.floats(0.01, 0.5))
def test_adamw_decay_ranges(case, lr, wd) -> None:
    problem, decay = case
    params, _ = run_fzero(optim.adamw(lr, weight_decay=wd), problem, decay=decay)
    ref = run_torch_grouped(two_groups(torch.optim.AdamW, wd, lr=lr), problem, decay)
    assert_bitwise(params, ref)


@given(case=flat_problem_with_ranges(), lr=lrs, wd=st.floats(0.01, 0.5))
def test_adam_decay_ranges(case, lr, wd) -> None:
    problem, decay = case
    params, _ = run_fzero(optim.adam(lr, weight_decay=wd), problem, decay=decay)
    ref = run_torch_grouped(two_groups(torch.optim.Adam, wd, lr=lr), problem, decay)
    assert_bitwise(params, ref)


@given(case=flat_problem_with_ranges(), lr=lrs, wd=st.floats(0.01, 0.5))
def test_sgd_decay_ranges(case, lr, wd) -> None:
    problem, decay = case
    params, _ = run_fzero(optim.sgd(lr, momentum=0.9, weight_decay=wd), problem, decay=decay)
    ref = run_torch_grouped(two_groups(torch.optim.SGD, wd, lr=lr, momentum=0.9), problem, decay)
    assert_bitwise(params, ref)


def test_decay_ranges_all_and_none() -> None:
    problem = Problem(shapes=((7,), (3,)), dtype=torch.float64, steps=3, seed=0)
    everything = [[(0, 7)], [(0, 3)]]
    split = [[(0, 2), (2, 7)], [(0, 1), (1, 3)]]  # adjacent ranges are merged
    nothing = [[], [(1, 1)]]  # empty ranges decay nothing
    full, _ = run_fzero(optim.adamw(0.1, weight_decay=0.3), problem)
    for decay in (everything, split):
        assert_bitwise(run_fzero(optim.adamw(0.1, weight_decay=0.3), problem, decay=decay)[0], full)
    no_wd, _ = run_fzero(optim.adamw(0.1, weight_decay=0.0), problem)
    assert_bitwise(run_fzero(optim.adamw(0.1, weight_decay=0.3), problem, decay=nothing)[0], no_wd)


# --------------------------------------------------------------------------------------------
# State: dtypes, in-place updates, names


@pytest.mark.parametrize("dtype", DTYPES)
def test_init_moments(dtype) -> None:
    params = [torch.zeros(5, dtype=dtype), torch.zeros(0, dtype=dtype)]
    for opt, names in [
        (optim.adamw(), {"exp_avg", "exp_avg_sq"}),
        (optim.adam(), {"exp_avg", "exp_avg_sq"}),
        (optim.sgd(0.1, momentum=0.9), {"momentum_buffer"}),
        (optim.sgd(0.1), set()),
    ]:
        moments = opt.init(params)
        assert type(moments) is dict and set(moments) == names
        for tensors in moments.values():
            assert isinstance(tensors, tuple) and len(tensors) == 2
            for t, p in zip(tensors, params, strict=True):
                assert (t.dtype, t.shape, t.device) == (p.dtype, p.shape, p.device)
                assert not t.any()


def test_adamw_updates_in_place_without_a_params_sized_temporary() -> None:
    """Params and moments are overwritten where they are; the denominator goes into the
    gradients (scratch), so no allocation of the update is more than a few bytes, where
    torch's foreach AdamW allocates one params-sized tensor (577 MiB per rank at 300M, N = 2)."""
    from torch.profiler import ProfilerActivity, profile

    opt = optim.adamw(0.1, weight_decay=0.1)
    params = [torch.randn(2**20), torch.randn(3)]
    grads = [torch.randn(2**20), torch.randn(3)]
    moments = opt.init(params)
    ptrs = [t.data_ptr() for t in (*params, *moments["exp_avg"], *moments["exp_avg_sq"])]
    before = [p.clone() for p in params]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.update(grads, moments, params, step=1)
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert 0 < largest <= 64, largest  # scalars only
    assert [t.data_ptr() for t in (*params, *moments["exp_avg"], *moments["exp_avg_sq"])] == ptrs
    assert all(not torch.equal(a, b) for a, b in zip(params, before, strict=True))


def test_empty_lists() -> None:
    for opt in (optim.adamw(), optim.adam(), optim.sgd(0.1, momentum=0.5)):
        moments = opt.init([])
        opt.update([], moments, [], step=1)
        assert all(v == () for v in moments.values())


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: optim.adamw(lr=-1.0), ValueError, "lr=-1.0"),
        (lambda: optim.adamw(lr="0.1"), TypeError, "lr"),
        (lambda: optim.adamw(eps=-1e-8), ValueError, "eps=-1e-08"),
        (lambda: optim.adamw(betas=(1.0, 0.9)), ValueError, r"betas\[0\]=1.0"),
        (lambda: optim.adam(betas=(0.9, -0.1)), ValueError, r"betas\[1\]=-0.1"),
        (lambda: optim.adam(betas=(0.9,)), ValueError, "betas"),
        (lambda: optim.adam(weight_decay=-0.1), ValueError, "weight_decay=-0.1"),
        (lambda: optim.adam(weight_decay=math.nan), ValueError, "weight_decay=nan"),
        (lambda: optim.sgd(lr=-0.1), ValueError, "lr=-0.1"),
        (lambda: optim.sgd(0.1, momentum=-0.5), ValueError, "momentum=-0.5"),
        (lambda: optim.sgd(0.1, nesterov=True), ValueError, "momentum=0.0"),
        (lambda: optim.sgd(0.1, 0.9, 0.1, nesterov=True), ValueError, "dampening=0.1"),
        (lambda: optim.sgd(0.1, nesterov=1), TypeError, "nesterov"),
    ],
)
def test_bad_hyperparameters(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


def _bad_update(kind: str):
    params = [torch.zeros(4), torch.zeros(6)]
    grads = [torch.ones(4), torch.ones(6)]
    kwargs: dict = {"step": 1}
    if kind == "short grads":
        grads = grads[:1]
    elif kind == "shape":
        grads[1] = torch.ones(5)
    elif kind == "dtype":
        grads[1] = torch.ones(6, dtype=torch.float64)
    elif kind == "moment shape":
        pass  # handled below
    elif kind == "step0":
        kwargs["step"] = 0
    elif kind == "step float":
        kwargs["step"] = 1.0
    elif kind == "lr":
        kwargs["lr"] = -1.0
    elif kind == "decay len":
        kwargs["decay"] = [[(0, 4)]]
    elif kind == "decay bounds":
        kwargs["decay"] = [[(0, 4)], [(2, 7)]]
    elif kind == "decay overlap":
        kwargs["decay"] = [[(0, 4)], [(0, 3), (2, 5)]]
    elif kind == "decay reversed":
        kwargs["decay"] = [[(3, 1)], []]
    return params, grads, kwargs


@pytest.mark.parametrize(
    ("kind", "error", "match"),
    [
        ("short grads", ValueError, r"len\(grads\)=1 does not match len\(params\)=2"),
        ("shape", ValueError, r"grads\[1\] has shape=\(5,\).*expected params\[1\]'s shape=\(6,\)"),
        ("dtype", ValueError, r"grads\[1\].*float64.*float32"),
        ("moment shape", ValueError, r"moments\['exp_avg_sq'\]\[1\]"),
        ("step0", ValueError, "step=0"),
        ("step float", TypeError, "step"),
        ("lr", ValueError, "lr=-1.0"),
        ("decay len", ValueError, r"len\(decay\)=1"),
        ("decay bounds", ValueError, r"decay\[1\] has range \(2, 7\).*numel\(\)=6"),
        ("decay overlap", ValueError, r"decay\[1\] has overlapping ranges \(0, 3\) and \(2, 5\)"),
        ("decay reversed", ValueError, r"decay\[0\] has range \(3, 1\)"),
    ],
)
def test_bad_update_leaves_state_untouched(kind, error, match) -> None:
    opt = optim.adamw(0.1, weight_decay=0.1)
    params, grads, kwargs = _bad_update(kind)
    moments = opt.init(params)
    if kind == "moment shape":
        moments["exp_avg_sq"] = (moments["exp_avg_sq"][0], torch.zeros(2))
    with pytest.raises(error, match=match):
        opt.update(grads, moments, params, **kwargs)
    assert all(not p.any() for p in params)
    assert all(not t.any() for ts in moments.values() for t in ts)


def test_bad_moments() -> None:
    opt = optim.sgd(0.1, momentum=0.9)
    params, grads = [torch.zeros(3)], [torch.ones(3)]
    with pytest.raises(ValueError, match=r"keys \['exp_avg'\], expected \['momentum_buffer'\]"):
        opt.update(grads, {"exp_avg": (torch.zeros(3),)}, params, step=1)
    with pytest.raises(TypeError, match="moments must be the dict"):
        opt.update(grads, [torch.zeros(3)], params, step=1)
    with pytest.raises(TypeError, match="params must be a sequence"):
        opt.init(torch.zeros(3))
    with pytest.raises(ValueError, match=r"params\[0\] must be floating point"):
        opt.init([torch.zeros(3, dtype=torch.int64)])


def test_schedule_returning_negative_lr() -> None:
    opt = optim.sgd(lambda step: -0.1)
    with pytest.raises(ValueError, match=r"lr schedule\(1\)"):
        opt.update([torch.ones(2)], {}, [torch.zeros(2)], step=1)


# --------------------------------------------------------------------------------------------
# Schedules and clipping


def test_cosine_schedule_values() -> None:
    s = optim.cosine_schedule(1.0, warmup_steps=4, total_steps=14, min_lr=0.1)
    assert [s(t) for t in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert s(5) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 10)))
    assert s(14) == 0.1 and s(1000) == 0.1
    values = [s(t) for t in range(4, 20)]
    assert values == sorted(values, reverse=True)
    no_warmup = optim.cosine_schedule(2.0, 0, 10)
    assert no_warmup(1) == pytest.approx(1.0 + math.cos(math.pi / 10))
    assert no_warmup(10) == 0.0
    only_warmup = optim.cosine_schedule(2.0, 10, 10)
    assert only_warmup(5) == 1.0 and only_warmup(10) == 2.0 and only_warmup(11) == 0.0


@given(
    peak=st.floats(0, 10),
    frac=st.floats(0, 1),
    warmup=st.integers(0, 50),
    extra=st.integers(0, 50),
    step=st.integers(1, 200),
)
def test_cosine_schedule_bounds(peak, frac, warmup, extra, step) -> None:
    total = max(warmup + extra, 1)
    s = optim.cosine_schedule(peak, warmup, total, min_lr=peak * frac)
    value = s(step)
    assert 0.0 <= value <= peak * (1 + 1e-12)
    if step > warmup:
        assert value >= peak * frac * (1 - 1e-12)


def test_constant_schedule() -> None:
    s = optim.constant_schedule(3e-4)
    assert s(1) == s(10**9) == 3e-4
    with pytest.raises(ValueError, match="step=0"):
        s(0)
    with pytest.raises(ValueError, match="lr=-1"):
        optim.constant_schedule(-1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warmup_steps": -1}, ValueError, "warmup_steps=-1"),
        ({"warmup_steps": 20}, ValueError, "total_steps=10"),
        ({"total_steps": 0, "warmup_steps": 0}, ValueError, "total_steps=0"),
        ({"total_steps": 10.0}, TypeError, "total_steps"),
        ({"min_lr": 2.0}, ValueError, "min_lr=2.0"),
        ({"peak_lr": -1.0}, ValueError, "peak_lr=-1.0"),
    ],
)
def test_cosine_schedule_errors(kwargs, error, match) -> None:
    args = {"peak_lr": 1.0, "warmup_steps": 2, "total_steps": 10} | kwargs
    with pytest.raises(error, match=match):
        optim.cosine_schedule(**args)


@pytest.mark.parametrize("dtype", DTYPES)
@given(
    scale=st.floats(1e-4, 1e4),
    max_norm=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**31 - 1),
)
def test_clip_coefficient_matches_clip_grad_norm(dtype, scale, max_norm, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=gen, dtype=dtype) * scale for s in (5, 17, 1)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # the norm it scaled by
    torch.testing.assert_close(total_norm, torch.linalg.vector_norm(torch.cat(grads)))
    coef = optim.clip_coefficient(total_norm, max_norm)
    assert coef.dtype == dtype and coef.ndim == 0 and coef <= 1
    torch._foreach_mul_(grads, coef)
    assert_bitwise(grads, [p.grad for p in params])
    expected = min(1.0, max_norm / (total_norm.item() + 1e-6))
    assert coef.item() == pytest.approx(expected, rel=1e-5)


def test_clip_coefficient_errors_and_nonfinite() -> None:
    assert optim.clip_coefficient(torch.tensor(0.0), 1.0) == 1.0
    assert optim.clip_coefficient(torch.tensor(math.inf), 1.0) == 0.0
    assert optim.clip_coefficient(torch.tensor(math.nan), 1.0).isnan()
    with pytest.raises(TypeError, match="total_norm must be a Tensor"):
        optim.clip_coefficient(3.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_norm=-1.0"):
        optim.clip_coefficient(torch.tensor(3.0), -1.0)


# --------------------------------------------------------------------------------------------
# Specs: what checkpoints record, and rebuilding an optimizer from it


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.adamw(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.2),
        lambda: optim.adam(lr=1e-2, weight_decay=0.05),
        lambda: optim.sgd(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda: optim.sgd(lr=0.5),
    ],
)
@settings(max_examples=20)  # the arithmetic is tested above; this checks the rebuild
@given(problem=problems)
def test_from_spec_rebuilds_the_same_optimizer(make, problem) -> None:
    import json

    opt = make()
    doc = json.loads(json.dumps(opt.spec.to_json()))  # through real JSON text
    spec = optim.OptimizerSpec.from_json(doc)
    assert spec == opt.spec and not spec.schedule
    rebuilt = optim.from_spec(spec)
    assert rebuilt.spec == opt.spec
    expected, expected_moments = run_fzero(opt, problem)
    actual, actual_moments = run_fzero(rebuilt, problem)
    assert_bitwise(actual, expected)
    for name in expected_moments:
        assert_bitwise(list(actual_moments[name]), list(expected_moments[name]))


def test_spec_of_a_schedule_needs_the_schedule_again() -> None:
    schedule = optim.cosine_schedule(1e-2, warmup_steps=2, total_steps=10)
    opt = optim.adamw(lr=schedule, weight_decay=0.1)
    assert opt.spec is not None and opt.spec.schedule
    assert "lr" not in dict(opt.spec.hyperparameters)
    with pytest.raises(ValueError, match="learning-rate schedule .* pass lr="):
        optim.from_spec(opt.spec)
    rebuilt = optim.from_spec(opt.spec, lr=schedule)
    assert rebuilt.lr is schedule and rebuilt.spec == opt.spec
    assert optim.from_spec(optim.adamw(lr=1e-3).spec, lr=5e-4).spec.hyperparameters[0] == (
        "lr", 5e-4
    )


def test_from_spec_rejects_unknown_names_and_non_specs() -> None:
    with pytest.raises(ValueError, match="'lion'; fzero.optim can rebuild"):
        optim.from_spec(optim.OptimizerSpec("lion", ()))
    with pytest.raises(TypeError, match="OptimizerSpec"):
        optim.from_spec({"name": "adamw"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an optimizer spec"):
        optim.OptimizerSpec.from_json({"name": "adamw"})
    assert optim.Optimizer(lambda p: {}, lambda *a, **k: None, lambda s: 0.1).spec is None


def test_describe_names_the_constructor_and_every_hyperparameter() -> None:
    """What ranks compare before training together (`init`, `load`, the step's settings)."""
    text = optim.adamw(lr=2e-3, betas=(0.9, 0.95)).describe()
    assert "'name': 'adamw'" in text and "'lr': 0.002" in text and "[0.9, 0.95]" in text
    assert text != optim.adamw(lr=1e-3, betas=(0.9, 0.95)).describe()
    hand_made = optim.Optimizer(init=lambda p: {}, update=lambda *a, **k: None,
                                lr=lambda step: 0.1)
    assert hand_made.describe() == "None"
