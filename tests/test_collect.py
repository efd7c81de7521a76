"""Tests of fzero.collect, cheapest first: SimWorld -> autograd -> gloo processes -> CUDA.

The equations under test, for a layout ``L`` over ``N`` ranks (see fzero/collect.py):

    gather(shard(p, L, r))   == p                                   on every rank r (bitwise)
    scatter_grads(g_r)[b]    == shard(mean over ranks q of g_q, L, r)[b]
    VJP of gather            == scatter_grads

Inputs are drawn in the pytest process (never `@given` inside ranks) and shipped to the per-rank
bodies in tests/collect_bodies.py, which SimWorld and the gloo pool run alike.
"""

from __future__ import annotations

import itertools
import math
import queue
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import fzero
import fzero.testing as testing
from fzero.collect import Pending, Streams, collectives
from fzero.comm import ring_bytes
from fzero.layout import ShardLayout
from fzero.simworld import SimWorld, SimWorldError
from fzero.testing import TreeSpec, bitwise_equal

import collect_bodies as cb
from dist_pool import WorkerError

FLOATS = (torch.float32, torch.bfloat16, torch.float64)
# The bodies only read their inputs: ranks may share them (copy_args=False) instead of taking
# deep copies of every rank's inputs, which would cost more than the collectives themselves.
SHARE = False
# Each example of the SimWorld properties runs 1-8 rank threads (~0.2 ms per collective per
# rank): they take 3/5 of the profile's examples, keeping the file under a minute in `ci`.
SIM_SETTINGS = settings(max_examples=max(1, settings().max_examples * 3 // 5))


def exact(actual: Tensor, expected: Tensor) -> None:
    """Equal values (``-0.0 == 0.0``), shapes and dtypes; `assert_close` only to explain."""
    same_kind = actual.shape == expected.shape and actual.dtype == expected.dtype
    if not (same_kind and torch.equal(actual, expected)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Drawn inputs and local references


def float_trees(max_size: int = 6) -> st.SearchStrategy[TreeSpec]:
    """A small parameter set of float32 / bfloat16 / float64 tensors (one dtype or mixed),
    trainable and frozen, with tied aliases; shapes include 0-d and empty tensors."""
    return testing.trees(max_size=max_size, allow_large=False, dtypes=FLOATS, mixed_dtypes=None,
                         tie_every=5)


def normal_params(spec: TreeSpec) -> dict[str, Tensor]:
    """`spec`'s parameters with finite N(0, 1) values (for arithmetic), aliases tied."""
    return spec.build("normal")


def random_grads(
    layout: ShardLayout, seed: int, present: float = 0.75, dtype: torch.dtype | None = None
) -> list[dict[str, Tensor]]:
    """Per rank, N(0, 1) gradients under a random subset of the names (aliases included)."""
    gen = torch.Generator().manual_seed(seed)
    by_rank = []
    for _ in range(layout.world_size):
        grads = {}
        for bucket in layout.buckets:
            for entry in bucket.entries:
                for name in entry.names:
                    if float(torch.rand((), generator=gen)) < present:
                        value = torch.randn(entry.shape, generator=gen, dtype=torch.float64)
                        grads[name] = value.to(dtype or bucket.torch_dtype)
        by_rank.append(grads)
    return by_rank


def rank_flat_grad(grads: Mapping[str, Tensor], bucket: Any, dtype: torch.dtype) -> Tensor:
    """One rank's gradient of a bucket as a padded flat buffer: tied names summed (in `dtype`,
    as autograd accumulates), missing names zero."""
    flat = torch.zeros(bucket.padded_numel, dtype=dtype)
    for entry in bucket.entries:
        piece = flat[entry.offset : entry.end]
        for name in entry.names:
            if name in grads:
                piece.add_(grads[name].reshape(-1))
    return flat


def ref_grad_flats(
    layout: ShardLayout,
    grads_by_rank: Sequence[Mapping[str, Tensor]],
    reduce_dtype: torch.dtype | None = None,
) -> list[tuple[Tensor, float]]:
    """Per bucket: the flat ``mean over ranks q of g_q`` (taken in float64, then rounded once
    to the reduce dtype), and an absolute tolerance for another summation order."""
    n = layout.world_size
    out = []
    for bucket in layout.buckets:
        dtype = reduce_dtype or bucket.torch_dtype
        flats = [rank_flat_grad(grads, bucket, dtype) for grads in grads_by_rank]
        mean = (torch.stack([f.double() for f in flats]).sum(0) / n).to(dtype)
        biggest = max((float(f.double().abs().max()) for f in flats if f.numel()), default=0.0)
        out.append((mean, n * torch.finfo(dtype).eps * biggest))
    return out


def check_grad_shards(
    got_by_rank: Sequence[Sequence[Tensor]],
    layout: ShardLayout,
    grads_by_rank: Sequence[Mapping[str, Tensor]],
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """``got_by_rank[r]`` is rank r's `scatter_grads` output: ``shard(mean of g_q, L, r)``,
    exact up to 2 ranks (one addition, then a division by N, each rounded once), within
    summation-order rounding beyond."""
    expected = ref_grad_flats(layout, grads_by_rank, reduce_dtype)
    for rank, got in enumerate(got_by_rank):
        assert len(got) == len(expected) == len(layout.buckets)
        for bucket, shard, (mean, atol) in zip(layout.buckets, got, expected, strict=True):
            lo, hi = bucket.shard_range(rank)
            if layout.world_size <= 2:
                exact(shard, mean[lo:hi])
            else:
                assert shard.dtype == mean.dtype
                torch.testing.assert_close(shard, mean[lo:hi], rtol=0, atol=atol)


def expected_counts(
    layout: ShardLayout, reduce_dtype: torch.dtype | None = None
) -> dict[str, dict[str, dict[str, int]]]:
    """Counter snapshots of `gather_scatter_body` after construction, gather, scatter_grads."""
    n = layout.world_size

    def counts(all_gather: tuple[int, int], reduce_scatter: tuple[int, int]):
        return {
            "bytes": {
                "all_gather": all_gather[0],
                "reduce_scatter": reduce_scatter[0],
                "all_reduce": 0,
                "broadcast": 0,
            },
            "calls": {
                "all_gather": all_gather[1],
                "reduce_scatter": reduce_scatter[1],
                "all_reduce": 0,
                "broadcast": 0,
            },
        }

    fingerprint = ring_bytes("all_gather", n, 8, n)  # one int64 per rank
    gathered = sum(
        ring_bytes("all_gather", b.padded_numel, b.torch_dtype.itemsize, n) for b in layout.buckets
    )
    scattered = sum(
        ring_bytes("reduce_scatter", b.padded_numel, (reduce_dtype or b.torch_dtype).itemsize, n)
        for b in layout.buckets
    )
    k = len(layout.buckets)
    return {
        "construct": counts((fingerprint, 1), (0, 0)),
        "gather": counts((fingerprint + gathered, 1 + k), (0, 0)),
        "scatter_grads": counts((fingerprint + gathered, 1 + k), (scattered, k)),
    }


def check_gathered(got: Mapping[str, Tensor], params: Mapping[str, Tensor], names) -> None:
    """`got` holds exactly `names`, bitwise equal to `params`; aliases are one tensor."""
    assert set(got) == set(names)
    for name in names:
        assert bitwise_equal(got[name], params[name]), name


# ----------------------------------------------------------------------------------------------
# Tier 1: SimWorld, hypothesis over layouts, dtypes and world sizes


@st.composite
def gather_scatter_cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 8))
    spec = draw(float_trees())
    params = spec.build()  # random bit patterns: NaNs, infinities and -0.0 must move bitwise
    layout = fzero.plan(params, n, buckets=draw(testing.policies(spec)))
    k = len(layout.buckets)
    reduce_dtype = draw(st.sampled_from([None, torch.float32]))
    return {
        "layout": layout,
        "params": params,
        "grads_by_rank": random_grads(layout, draw(st.integers(0, 2**31 - 1))),
        "subset": draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=k, unique=True)),
        "async_bucket": draw(st.integers(0, k - 1)),
        "reduce_dtype": reduce_dtype,
    }


def check_gather_scatter_results(case: Mapping[str, Any], results: Sequence[dict]) -> None:
    layout, params = case["layout"], case["params"]
    flats = fzero.flatten(params, layout)
    subset_names = [name for i in case["subset"] for name in layout.buckets[i].names]
    counts = expected_counts(layout, case["reduce_dtype"])
    assert len(results) == layout.world_size
    for rank, res in enumerate(results):
        check_gathered(res["full"], params, layout.names)
        for bucket in layout.buckets:
            for entry in bucket.entries:
                for alias in entry.aliases:
                    assert res["full"][alias] is res["full"][entry.name]
        check_gathered(res["part"], params, subset_names)
        assert bitwise_equal(res["flat"], flats[case["async_bucket"]])
        assert res["counts"] == counts, rank
    grad_shards = [res["grad_shards"] for res in results]
    check_grad_shards(grad_shards, layout, case["grads_by_rank"], case["reduce_dtype"])


@SIM_SETTINGS
@given(gather_scatter_cases())
def test_sim_gather_scatter_grads_and_counters(case: dict[str, Any]) -> None:
    """gather / gather(buckets=...) / gather_async are bitwise; scatter_grads is the mean of
    every rank's gradients (tied names summed, missing ones zero, in `reduce_dtype` if given);
    the counters are exactly the ring bytes of the buckets plus the fingerprint all-gather."""
    layout = case["layout"]
    results = SimWorld(layout.world_size, copy_args=SHARE).run(
        cb.gather_scatter_body,
        layout,
        case["params"],
        case["grads_by_rank"],
        case["subset"],
        case["async_bucket"],
        case["reduce_dtype"],
    )
    check_gather_scatter_results(case, results)


def test_sim_reduce_dtype_float32_for_bfloat16_params() -> None:
    """bfloat16 parameters, float32 reduction: float32 shards, reduced without bfloat16 rounding
    (values whose bfloat16 mean would round away survive)."""
    n = 2
    params = {"w": torch.zeros(7, dtype=torch.bfloat16, requires_grad=True)}
    layout = fzero.plan(params, n)
    grads = [{"w": torch.full((7,), 1.0, dtype=torch.bfloat16)}, {"w": torch.full((7,), 2.0**-9)}]
    grads[1]["w"] = grads[1]["w"].to(torch.bfloat16)
    for reduce_dtype, want in [(torch.float32, (1 + 2.0**-9) / 2), (None, 0.5)]:
        results = SimWorld(n).run(
            cb.gather_scatter_body, layout, params, grads, [0], 0, reduce_dtype
        )
        for rank, res in enumerate(results):
            (shard,) = res["grad_shards"]
            assert shard.dtype == (reduce_dtype or torch.bfloat16)
            lo, hi = layout.buckets[0].shard_range(rank)
            expected = torch.tensor([want if i < 7 else 0.0 for i in range(lo, hi)])
            exact(shard, expected.to(shard.dtype))


def test_byte_counts_worked_example() -> None:
    """Ring accounting by hand: N = 4, float32 buckets of 10 and 7 elements (padded 12 and 8),
    a float64 bucket of 3 (padded 4)."""
    params = {
        "h.0.w": torch.zeros(10, requires_grad=True),
        "h.1.w": torch.zeros(7, requires_grad=True),
        "h.2.w": torch.zeros(3, dtype=torch.float64, requires_grad=True),
    }
    layout = fzero.plan(params, 4, floor=1)
    assert [b.padded_numel for b in layout.buckets] == [12, 8, 4]
    grads = [{} for _ in range(4)]
    (res, *_) = SimWorld(4).run(cb.gather_scatter_body, layout, params, grads, [0], 1, None)
    fingerprint = 4 * 8 * 3 // 4  # N int64s; each rank sends (N-1)/N of them
    buckets = 12 * 4 * 3 // 4 + 8 * 4 * 3 // 4 + 4 * 8 * 3 // 4  # 36 + 24 + 24
    assert res["counts"]["construct"]["bytes"]["all_gather"] == fingerprint
    assert res["counts"]["gather"]["bytes"]["all_gather"] == fingerprint + buckets == 108
    assert res["counts"]["scatter_grads"]["bytes"]["reduce_scatter"] == buckets == 84
    assert res["counts"]["scatter_grads"]["calls"] == {
        "all_gather": 4,
        "reduce_scatter": 3,
        "all_reduce": 0,
        "broadcast": 0,
    }


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_sim_two_gather_async_in_flight(n: int) -> None:
    params = normal_params(
        TreeSpec(
            ("h.0.a", "h.1.b", "h.2.c"),
            ((3, 5), (7,), (2,)),
            (torch.float32,) * 3,
            (True,) * 3,
            (None,) * 3,
            seed=n,
        )
    )
    layout = fzero.plan(params, n, floor=1)
    flats = fzero.flatten(params, layout)
    for first, second in [(0, 1), (2, 0), (1, 1)]:
        for out_a, out_b, again, same in SimWorld(n).run(
            cb.two_async_gathers_body, layout, params, first, second
        ):
            assert bitwise_equal(out_a, flats[first]) and bitwise_equal(out_b, flats[second])
            assert same and again is not None


# ----------------------------------------------------------------------------------------------
# Tier 2: autograd through gather


@st.composite
def grad_cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 8))
    spec = draw(float_trees())
    params = normal_params(spec)
    layout = fzero.plan(params, n, buckets=draw(testing.policies(spec)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    weights_by_rank = []
    for _ in range(n):  # each rank's loss uses a random subset of the names (aliases too)
        chosen = [name for name in params if float(torch.rand((), generator=gen)) < 0.7]
        weights_by_rank.append(
            {
                name: torch.randn(params[name].shape, generator=gen).to(params[name].dtype)
                for name in (chosen or [next(iter(params))])
            }
        )
    return {"layout": layout, "params": params, "weights_by_rank": weights_by_rank}


@SIM_SETTINGS
@given(grad_cases())
def test_sim_gather_backward_is_scatter_grads(case: dict[str, Any]) -> None:
    """autograd.grad(loss_r(gather(shards_r)), shards_r) == scatter_grads(d loss_r / d params)
    on every rank; exact unless three or more names are tied to one entry (then the two paths
    may sum their gradients in different orders)."""
    layout = case["layout"]
    results = SimWorld(layout.world_size, copy_args=SHARE).run(
        cb.grad_through_gather_body, layout, case["params"], case["weights_by_rank"]
    )
    most_names = max(len(e.names) for b in layout.buckets for e in b.entries)
    # Each name contributes 2 * w * p to its entry's gradient: bound the reordering error.
    scale = max(
        sum(
            float((2 * w.double() * case["params"][name].detach().double()).abs().sum())
            for name, w in weights.items()
        )
        for weights in case["weights_by_rank"]
    )
    for through_gather, scattered in results:
        assert len(through_gather) == len(scattered) == len(layout.buckets)
        for a, b in zip(through_gather, scattered, strict=True):
            if most_names <= 2:
                exact(a, b)
            else:
                atol = most_names * torch.finfo(a.dtype).eps * scale
                torch.testing.assert_close(a, b, rtol=0, atol=atol)


def adjoint_params() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(7)
    params = {
        "emb.w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
        "h.0.w": torch.randn(4, 4, generator=gen, dtype=torch.float64),
        "h.0.b": torch.randn(3, generator=gen, dtype=torch.float64),
        "h.1.w": torch.randn(7, generator=gen, dtype=torch.float64),
    }
    params["head.w"] = params["emb.w"]  # tied
    return params


@pytest.mark.parametrize("n", range(1, 9))
def test_sim_adjoint_identity_float64(n: int) -> None:
    """sum_q <v_q, gather_q(x)> == N * sum_r <scatter_grads(v)_r, x_r> (gather's adjoint is
    N times the averaging reduce-scatter), up to float64 rounding."""
    params = adjoint_params()
    layout = fzero.plan(params, n, buckets=[["emb.w", "h.0.w"], ["h.0.b"], ["h.1.w"]])
    v_by_rank = random_grads(layout, seed=100 + n, present=0.8)
    results = SimWorld(n).run(cb.adjoint_body, layout, params, v_by_rank)
    lhs = sum(q_lhs for q_lhs, _ in results)
    rhs = n * sum(r_rhs for _, r_rhs in results)
    scale = sum(float(v.abs().sum()) for vs in v_by_rank for v in vs.values()) * 4
    assert math.isclose(lhs, rhs, rel_tol=0, abs_tol=1e-13 * scale), (lhs, rhs)


class RankServers:
    """N SimWorld ranks that stay alive across calls (`cb.serve_rank_body`), driven by queues.

    `SimWorld.run` blocks until every rank returns, so it runs in a background thread; `call`
    hands each rank its command and returns the ranks' replies in rank order.
    """

    def __init__(self, layout: ShardLayout, timeout: float = 60.0) -> None:
        self.layout = layout
        self.n = layout.world_size
        self.timeout = timeout
        self.commands: list[queue.Queue] = [queue.Queue() for _ in range(self.n)]
        self.replies: list[queue.Queue] = [queue.Queue() for _ in range(self.n)]
        self.keys = itertools.count()
        self.error: BaseException | None = None
        self.results: list[Any] | None = None
        self.thread = threading.Thread(target=self._main, name="rank-servers", daemon=True)

    def _main(self) -> None:
        world = SimWorld(self.n, timeout=self.timeout, copy_args=False)
        try:
            self.results = world.run(cb.serve_rank_body, self.layout, self.commands, self.replies)
        except BaseException as exc:  # re-raised by call() / __exit__
            self.error = exc
            for box in self.replies:
                box.put(("error", exc))

    def __enter__(self) -> RankServers:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for box in self.commands:
            box.put(("stop",))
        self.thread.join(self.timeout)
        assert not self.thread.is_alive(), "rank servers did not stop"
        if self.error is not None and exc_info[0] is None:
            raise self.error

    def call(self, commands: Sequence[tuple]) -> list[Any]:
        for box, command in zip(self.commands, commands, strict=True):
            box.put(command)
        out = []
        for box in self.replies:
            kind, value = box.get(timeout=self.timeout)
            if kind == "error":
                raise RuntimeError("a rank server failed") from value
            out.append(value)
        return out


class GlobalGather(torch.autograd.Function):
    """F(x_0, ..., x_{N-1}) = (1/N) * cat over ranks q of gather_q(x), x_r rank r's shards
    (concatenated). Forward and backward run every rank concurrently; the backward is each
    rank's own autograd through `collectives`' gather."""

    @staticmethod
    def forward(ctx: Any, servers: RankServers, *xs: Tensor) -> Tensor:  # type: ignore[override]
        sizes = [b.shard_numel for b in servers.layout.buckets]
        key = next(servers.keys)
        outs = servers.call([("forward", key, x.detach().split(sizes)) for x in xs])
        ctx.servers, ctx.key = servers, key
        return torch.cat(outs) / servers.n

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        servers: RankServers = ctx.servers
        vs = grad.contiguous().chunk(servers.n)  # v_q for rank q, not scaled: see test docstring
        grads = servers.call([("backward", ctx.key, v) for v in vs])
        return (None, *(torch.cat(g) for g in grads))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gradcheck_global_gather_float64(n: int) -> None:
    """gradcheck of the global function F = (1/N) cat_q gather_q(x).

    dF/dx_r stacks N copies of (1/N) d gather/d x_r, so F's VJP with (v_0, ..., v_{N-1}) at
    rank r is the shard r of mean_q v_q: exactly what each rank's backward through gather
    (scatter_grads, an average) returns for its own v_q. Odd sizes exercise the padding, and a
    tied alias appears twice in the output.
    """
    gen = torch.Generator().manual_seed(n)
    params = {
        "a": torch.randn(3, generator=gen, dtype=torch.float64),
        "b": torch.randn(2, 2, generator=gen, dtype=torch.float64),
        "c": torch.randn(5, generator=gen, dtype=torch.float64),
    }
    params["a_tied"] = params["a"]
    layout = fzero.plan(params, n, buckets=[["a", "b"], ["c"]])
    xs = [
        torch.cat(fzero.shard(params, layout, r)).requires_grad_() for r in range(layout.world_size)
    ]
    with RankServers(layout) as servers:
        assert torch.autograd.gradcheck(
            lambda *x: GlobalGather.apply(servers, *x), xs, eps=1e-6, atol=1e-7, rtol=1e-5
        )
        (out,) = [GlobalGather.apply(servers, *xs)]
        expected = torch.cat([params[name].reshape(-1) for name in layout.names])
        exact(out, expected.repeat(n) / n)


# ----------------------------------------------------------------------------------------------
# Tier 3: bad input, rejected before any communication


def bad_input_params() -> dict[str, Tensor]:
    params = {
        "h.0.w": torch.randn(3, 4, requires_grad=True),
        "h.1.b": torch.randn(5, requires_grad=True),
    }
    params["tied.w"] = params["h.0.w"]
    return params


BAD_INPUT = {  # case -> message pattern (every one a ValueError); N = 3, bucket 1 is 'h.1'
    "gather/wrong length": r"shard of bucket 1 \('h\.1'\) must be a 1-D float32 tensor of 2 "
    r"elements, got shape \(3,\) dtype torch\.float32",
    "gather/wrong dtype": r"shard of bucket 1 \('h\.1'\) .* got shape \(2,\) dtype torch\.float16",
    "gather/not a tensor": r"shard of bucket 1 \('h\.1'\) .* got list",
    "gather/too few shards": r"expected one shard per bucket \(2\), got 1",
    "gather/bucket out of range": r"buckets must be distinct indices in range\(2\), got \(0, 2\)",
    "gather/negative bucket": r"buckets must be distinct indices in range\(2\), got \(-1,\)",
    "gather/repeated bucket": r"buckets must be distinct indices in range\(2\), got \(0, 0\)",
    "gather_async/wrong length": r"shard of bucket 1 \('h\.1'\) .* got shape \(3,\)",
    "scatter_grads/wrong shape": r"gradient of 'h\.0\.w' has shape \(4, 3\), but the parameter "
    r"has shape \(3, 4\)",
    "scatter_grads/tied alias wrong shape": r"gradient of 'tied\.w' has shape \(12,\)",
    "scatter_grads/unknown name": r"gradient for unknown parameter 'nope\.w'",
    "scatter_grads/not a tensor": r"gradient of 'h\.1\.b' has shape list",
    "scatter_grads/bucket out of range": r"buckets must be distinct indices in range\(2\)",
}


def check_all_ranks_raise(results: Sequence[tuple[str, str, bool]], pattern: str) -> None:
    for rank, (kind, message, silent) in enumerate(results):
        assert kind == "ValueError", (rank, kind, message)
        assert re.search(pattern, message), message
        assert silent, f"rank {rank} communicated before raising"


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_sim_bad_input_raises_on_every_rank_before_communicating(case: str) -> None:
    n = 3
    params = bad_input_params()
    layout = fzero.plan(params, n)
    assert [b.label for b in layout.buckets] == ["h.0", "h.1"]
    results = SimWorld(n).run(cb.bad_call_body, [layout] * n, params, case)
    check_all_ranks_raise(results, BAD_INPUT[case])


def test_sim_world_size_mismatch_raises_before_communicating() -> None:
    params = bad_input_params()
    layout = fzero.plan(params, 3)
    results = SimWorld(2).run(cb.bad_call_body, [layout] * 2, params, None)
    check_all_ranks_raise(
        results, r"layout is planned for world_size=3 but the comm has world_size=2"
    )


def test_sim_layout_mismatch_lists_differing_ranks() -> None:
    n = 4
    params = bad_input_params()
    layout = fzero.plan(params, n)
    other = fzero.plan(params, n, buckets=[["h.0.w", "h.1.b"]])
    assert other.fingerprint != layout.fingerprint
    layouts = [layout, layout, other, other]
    for rank, (kind, message, _) in enumerate(
        SimWorld(n).run(cb.bad_call_body, layouts, params, None)
    ):
        assert kind == "ValueError"
        assert re.match(r"layout fingerprint differs across ranks: rank 0 has -?0x", message)
        assert re.search(r"but rank 2: -?0x\w+, rank 3: -?0x", message)
        assert "rank 1:" not in message
        # what differs, as init says (the hashes alone said nothing: a probe)
        assert "they differ in: how parameters are bucketed (buckets=)" in message
        assert f"this is rank {rank}" in message
    with pytest.raises(SimWorldError, match="rank 0 of 4") as info:
        SimWorld(n).run(cb.construct_body, layouts)
    assert isinstance(info.value.__cause__, ValueError)
    assert SimWorld(n).run(cb.construct_body, [layout] * n) == [2] * n


def _gather_in_rank_order(comm: Any, orders: Sequence[Sequence[int]],
                          buckets: Any = (("a",), ("b",))) -> list[Tensor]:
    params = {"fc.a": torch.full((4,), 1.0), "fc.b": torch.full((4,), 2.0)}  # same sizes
    layout = fzero.plan(params, comm.world_size, buckets=buckets)
    gather_async = collectives(layout, comm).gather_async
    shards = fzero.shard(params, layout, comm.rank)
    return [gather_async(shards, index).wait() for index in orders[comm.rank]]


@pytest.mark.parametrize("buckets", [[["fc.a"], ["fc.b"]], 4], ids=["lists", "cap"])
def test_sim_same_size_buckets_gathered_in_different_orders_raise(buckets: Any) -> None:
    """Rank 0 gathers bucket 0 then 1, rank 1 the reverse: the calls have equal sizes and
    dtypes, so they paired and each rank got the other bucket's values in its first gather,
    with no error. SimWorld now compares what each call moves (its label) too, which names
    the bucket's first parameter: a size cap that splits one module labels both halves
    alike ('fc'), and those paired silently still (a probe)."""
    assert [[t.tolist() for t in r] for r in SimWorld(2).run(
        _gather_in_rank_order, [[0, 1], [0, 1]], buckets)] == [[[1.0] * 4, [2.0] * 4]] * 2
    with pytest.raises(SimWorldError) as info:
        SimWorld(2).run(_gather_in_rank_order, [[0, 1], [1, 0]], buckets)
    message = str(info.value.__cause__)
    assert re.search(r"collective #\d+ differs across ranks: rank \d called all_gather\("
                     r"label=\"of bucket '[\w.]+' \(from fc\.[ab]\)\"", message), message
    assert "(from fc.a)" in message and "(from fc.b)" in message


@pytest.mark.parametrize(
    "case", ["gather_async/bucket out of range", "gather_async/negative bucket"]
)
def test_sim_gather_async_rejects_bucket_out_of_range(case: str) -> None:
    n = 3
    params = bad_input_params()
    layout = fzero.plan(params, n)
    results = SimWorld(n).run(cb.bad_call_body, [layout] * n, params, case)
    check_all_ranks_raise(results, r"buckets must be distinct indices in range\(2\)")


def integer_bucket_case(n: int) -> tuple[ShardLayout, dict[str, Tensor]]:
    params = {"w": torch.randn(5, requires_grad=True), "steps": torch.arange(3)}
    layout = fzero.plan(params, n)
    assert [b.dtype for b in layout.buckets] == ["float32", "int64"]
    return layout, params


def test_sim_gather_backward_with_integer_bucket() -> None:
    n = 2
    layout, params = integer_bucket_case(n)
    outs = SimWorld(n).run(cb.integer_bucket_body, layout, params)
    for out in outs:
        assert not isinstance(out["backward"], Exception), out["backward"]
    w_only = fzero.plan({"w": params["w"]}, n)
    check_grad_shards(
        [out["backward"] for out in outs], w_only, [{"w": 2 * params["w"].detach()}] * n
    )


def test_sim_scatter_grads_with_integer_bucket() -> None:
    n = 2
    layout, params = integer_bucket_case(n)
    outs = SimWorld(n).run(cb.integer_bucket_body, layout, params)
    for out in outs:
        assert not isinstance(out["scatter_grads"], Exception), out["scatter_grads"]
        int_shard = out["scatter_grads"][1]
        assert int_shard.numel() == layout.buckets[1].shard_numel and not int_shard.any()
    w_only = fzero.plan({"w": params["w"]}, n)
    float_shards = [out["scatter_grads"][:1] for out in outs]
    check_grad_shards(float_shards, w_only, [{"w": 2 * params["w"].detach()}] * n)


def check_complex_bucket(outs: Sequence[dict[str, Any]], n: int) -> None:
    """Each rank's shard gradients equal the shards of the mean over ranks of the full
    gradients (torch.autograd on the full parameters); scatter_grads averages a complex
    gradient and gives the real bucket zeros."""
    layout, params = complex_case(n)
    full = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    mean = sum(cb.complex_loss(full, r) for r in range(n)) / n
    want = dict(zip(full, torch.autograd.grad(mean, list(full.values())), strict=True))
    for rank, out in enumerate(outs):
        for got, expected in zip(out["backward"], fzero.shard(want, layout, rank), strict=True):
            assert got is not None and got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        c_shard, w_shard = out["scatter_grads"]
        torch.testing.assert_close(c_shard, fzero.shard(want, layout, rank)[0],
                                   rtol=0, atol=1e-6)
        assert not w_shard.any()


def complex_case(n: int) -> tuple[ShardLayout, dict[str, Tensor]]:
    params = {"c": torch.tensor([1 + 2j, -1 + 0.5j, 3 - 1j], dtype=torch.complex64),
              "w": torch.tensor([1.0, 2.0, 3.0])}
    layout = fzero.plan(params, n, buckets=[["c"], ["w"]], trainable=lambda name: True)
    assert [(b.dtype, b.trainable) for b in layout.buckets] == [("complex64", True),
                                                              ("float32", True)]
    return layout, params


@pytest.mark.parametrize("n", [1, 2, 3])
def test_sim_a_trainable_complex_bucket_gets_its_gradient(n: int) -> None:
    """gather's backward gave a trainable complex shard no gradient, and scatter_grads
    refused its gradient calling it an integer parameter (a probe)."""
    check_complex_bucket(SimWorld(n).run(cb.complex_bucket_body, *complex_case(n)), n)


def test_gloo_a_trainable_complex_bucket_gets_its_gradient(gloo_pool: Any) -> None:
    check_complex_bucket(gloo_pool(2).run(cb.complex_bucket_body, *complex_case(2)), 2)


def test_sim_scatter_grads_counts_a_tied_gradient_once_per_tensor() -> None:
    """The gradients of gather's output dict (its tied names map to one tensor, and
    ``autograd.grad`` returns one tensor for both) doubled a tied weight's gradient in
    scatter_grads; two separate leaves' gradients must still be summed (a probe). Also: a
    gradient for an integer parameter raises (its shard came back as this rank's own values,
    not zeros), and ``buckets=[True, False]`` is not read as indices 1, 0."""
    gen = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(4, 3, dtype=torch.float64, generator=gen),
              "steps": torch.arange(2)}
    params["head"] = params["emb"]
    x = torch.randn(5, 4, dtype=torch.float64, generator=gen)
    emb = params["emb"].clone().requires_grad_()
    ((x @ emb) @ emb.T).pow(2).sum().backward()  # the reference: one tied tensor
    n = 2
    layout = fzero.plan(params, n, trainable=lambda name: name != "steps")
    outs = SimWorld(n).run(cb.tied_grads_body, params, x)
    for key in ("shared", "separate"):
        got = fzero.unshard([out[key] for out in outs], layout)
        torch.testing.assert_close(got["emb"], emb.grad, rtol=1e-14, atol=0)
    for out in outs:
        assert out["same_object"]
        assert "gradient given for 'steps', a int64 parameter" in out["integer"]
        assert "buckets must be distinct indices in range(2), got (True, False)" in out["bool"]


# ----------------------------------------------------------------------------------------------
# Tier 4: gloo processes (session-scoped pools, see tests/dist_pool.py)


def gloo_case(n: int) -> dict[str, Any]:
    """float32 and bfloat16 trainable buckets, a frozen float32 one, a tied alias; odd sizes."""
    gen = torch.Generator().manual_seed(n)
    params = {
        "emb.w": torch.randn(11, 3, generator=gen),
        "h.0.w": torch.randn(5, 7, generator=gen),
        "h.0.b": torch.randn(7, generator=gen),
        "h.1.w": torch.randn(13, generator=gen).to(torch.bfloat16),
        "norm.w": torch.randn(9, generator=gen),
    }
    for name, p in params.items():
        p.requires_grad_(name != "norm.w")
    params["head.w"] = params["emb.w"]
    layout = fzero.plan(params, n)
    k = len(layout.buckets)
    return {
        "layout": layout,
        "params": params,
        "grads_by_rank": random_grads(layout, seed=10 + n),
        "subset": [k - 1, 0],
        "async_bucket": 1,
        "reduce_dtype": None,
    }


def run_gather_scatter(run: Any, case: Mapping[str, Any]) -> list[dict]:
    keys = ("layout", "params", "grads_by_rank", "subset", "async_bucket", "reduce_dtype")
    return run(cb.gather_scatter_body, *(case[k] for k in keys))


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
@pytest.mark.parametrize("n", [2, 3])
def test_gloo_gather_scatter_grads(gloo_pool: Any, n: int, reduce_dtype: Any) -> None:
    """gloo matches the local reference; SimWorld and gloo agree bitwise at 2 ranks (one
    addition, then gloo's AVG divides by N as SimWorld does), within rounding at 3."""
    case = {**gloo_case(n), "reduce_dtype": reduce_dtype}
    layout = case["layout"]
    assert {b.dtype for b in layout.buckets} == {"float32", "bfloat16"}
    results = run_gather_scatter(gloo_pool(n).run, case)
    check_gather_scatter_results(case, results)  # exact at 2 ranks, within rounding at 3
    simulated = run_gather_scatter(SimWorld(n).run, case)
    for res, sim in zip(results, simulated, strict=True):
        assert res["counts"] == sim["counts"]
        for bucket, got, want in zip(
            layout.buckets, res["grad_shards"], sim["grad_shards"], strict=True
        ):
            if n == 2:
                exact(got, want)
            else:
                eps = torch.finfo(got.dtype).eps
                torch.testing.assert_close(got, want, rtol=4 * eps, atol=4 * eps)
            assert got.dtype == (reduce_dtype or bucket.torch_dtype)


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_gather_backward_and_async_overlap(gloo_pool: Any, n: int) -> None:
    case = gloo_case(n)
    layout, params = case["layout"], case["params"]
    pool = gloo_pool(n)
    weights = [{name: torch.ones_like(p) * (q + 1) for name, p in params.items()} for q in range(n)]
    for through_gather, scattered in pool.run(cb.grad_through_gather_body, layout, params, weights):
        for a, b in zip(through_gather, scattered, strict=True):
            exact(a, b)
    flats = fzero.flatten(params, layout)
    for out_a, out_b, _, same in pool.run(cb.two_async_gathers_body, layout, params, 2, 0):
        assert bitwise_equal(out_a, flats[2]) and bitwise_equal(out_b, flats[0]) and same


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gloo_second_order_through_gather_raises(gloo_pool: Any, n: int) -> None:
    """A gradient penalty on the parameters (differentiating the gradient that gather's backward
    made) was silently wrong at N >= 2 on gloo (the reduce-scatter's arithmetic was traced,
    the other ranks' terms not: errors of half the reference's size; a probe). It raises, on
    every rank and at every N, saying what to do instead."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, dtype=torch.float64, generator=gen)
    x = torch.randn(4, 5, dtype=torch.float64, generator=gen)
    for message in gloo_pool(n).run(cb.double_backward_body, w, x):
        assert "create_graph=True" in message and "not differentiable" in message, message
        assert "gathered full parameters" in message
    assert SimWorld(2).run(cb.double_backward_body, w, x)[0] == message


def test_gather_backward_reduces_in_reduce_dtype() -> None:
    """`collectives(reduce_dtype=float32)` applied to scatter_grads only: gather's backward
    reduced bfloat16 gradients in bfloat16 (a probe: 256 + 1 - 256 + 1 over 4 ranks gave 0.25,
    not 0.5). Both reduce in float32 now; gather's backward hands autograd the shard's dtype."""
    w = torch.zeros(8, dtype=torch.bfloat16)
    grads = [torch.full((8,), v) for v in (256.0, 1.0, -256.0, 1.0)]
    for through_gather, scattered in SimWorld(4).run(cb.reduce_dtype_body, w, grads):
        assert through_gather.dtype == torch.bfloat16 and scattered.dtype == torch.float32
        assert through_gather.float().tolist() == scattered.tolist() == [0.5, 0.5]


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_a_bucket_of_empty_parameters(gloo_pool: Any, n: int) -> None:
    """A bucket holding only zero-size parameters raised IndexError on gloo at N >= 2 (its
    0-element chunks: ``split(0)`` gives one chunk, not N; a probe). It moves nothing, as on
    SimWorld."""
    params = {"e.0.w": torch.zeros(0, 4), "a.0.w": torch.ones(5)}
    layout = fzero.plan(params, n, floor=1, trainable=lambda name: True)
    assert [b.numel for b in layout.buckets] == [0, 5]
    outs = gloo_pool(n).run(cb.empty_bucket_body, params)
    assert all(shapes == [(0, 4), (5,)] for shapes, _ in outs)
    grads = fzero.unshard([grad_shards for _, grad_shards in outs], layout)
    exact(grads["e.0.w"], torch.zeros(0, 4))
    exact(grads["a.0.w"], torch.full((5,), (n + 1) / 2))  # the mean over ranks of rank + 1


def test_gloo_layout_mismatch_raises_on_every_rank(gloo_pool: Any) -> None:
    n = 2
    case = gloo_case(n)
    layout = case["layout"]
    other = fzero.plan(case["params"], n, buckets=1000)
    assert other.fingerprint != layout.fingerprint
    pool = gloo_pool(n)
    with pytest.raises(WorkerError) as info:
        pool.run(cb.construct_body, [layout, other])
    assert info.value.ranks == [0, 1]  # both raised: neither was left waiting
    assert isinstance(info.value.__cause__, ValueError)
    assert re.search(r"fingerprint differs across ranks: rank 0 has -?0x", str(info.value))
    assert re.search(r"but rank 1: -?0x", str(info.value))
    k = len(layout.buckets)
    assert pool.run(cb.construct_body, [layout, layout]) == [k, k]  # the pool respawned


# ----------------------------------------------------------------------------------------------
# Tier 5: streams, CUDA


def test_no_side_streams_off_cuda() -> None:
    assert Streams.for_device("cpu") is None
    assert Streams.for_device(torch.device("meta")) is None


class ThreadRecordingWork:
    """A finished `Work` that records the thread of each `wait()`."""

    def __init__(self) -> None:
        self.waited_on: list[str] = []

    def wait(self) -> None:
        self.waited_on.append(threading.current_thread().name)

    def is_completed(self) -> bool:
        return True


def test_pending_waits_on_the_thread_that_uses_the_output() -> None:
    """A reduction waited for on the host by a helper thread (stage 3's patience) is waited for
    again by `wait()` on the thread that reads it: on CUDA only that orders the reader's stream
    (NCCL's `wait()` orders the stream current on its caller's thread)."""
    work = ThreadRecordingWork()
    pending = Pending(torch.zeros(3), work, None)
    helper = threading.Thread(target=pending.wait_host, name="helper")
    helper.start()
    helper.join()
    assert pending.is_completed() and work.waited_on == ["helper"]
    pending.wait_host()  # once on the host is enough
    assert work.waited_on == ["helper"]
    pending.wait()
    pending.wait()  # twice is harmless
    assert work.waited_on == ["helper", threading.current_thread().name]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gather_async_on_side_stream(bare_env: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    streams = Streams.for_device("cuda")
    assert streams is not None
    assert streams.all_gather != streams.reduce_scatter
    backend = "nccl" if dist.is_nccl_available() else "gloo"
    params = {"a": torch.randn(7, 3, device="cuda"), "b": torch.randn(5, device="cuda")}
    layout = fzero.plan(params, 1, buckets=[["a"], ["b"]])
    with fzero.distributed(backend=backend) as comm:
        gather, scatter_grads, gather_async = collectives(layout, comm, streams=streams)
        current = torch.cuda.current_stream()
        assert streams.all_gather != current and streams.reduce_scatter != current
        shards = fzero.shard(params, layout, 0)
        pending = [gather_async(shards, i) for i in range(2)]
        flats = [p.wait() for p in pending]  # the current stream waits on the side stream
        for flat, shard in zip(flats, shards, strict=True):
            assert flat.is_cuda
            exact(flat, shard)
        full = gather(shards)
        for name, value in params.items():
            exact(full[name], value)
        grads = scatter_grads({name: 2 * value for name, value in params.items()})
        for grad, shard in zip(grads, shards, strict=True):
            exact(grad, 2 * shard)
        torch.cuda.synchronize()
    assert not dist.is_initialized()


def _nested_and_dotted(comm: Any) -> Any:
    params = {"l1": {"weight": torch.arange(6.0).view(2, 3), "bias": torch.ones(2)}}
    layout = fzero.plan(params, comm.world_size)
    scatter = fzero.collectives(layout, comm).scatter_grads
    nested = {"l1": {"weight": torch.full((2, 3), 2.0), "bias": torch.full((2,), 3.0)}}
    dotted = {"l1.weight": torch.full((2, 3), 2.0), "l1.bias": torch.full((2,), 3.0)}
    return scatter(nested), scatter(dotted)


def test_scatter_grads_takes_nested_gradients_as_plan_takes_parameters() -> None:
    """A nested mapping of gradients raised "gradient for unknown parameter 'l1'", though
    `plan`, `flatten` and `shard` take nested parameters (a probe)."""
    for nested, dotted in fzero.SimWorld(3).run(_nested_and_dotted):
        for a, b in zip(nested, dotted, strict=True):
            exact(a, b)
