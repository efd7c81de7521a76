"""Properties of fzero.update: where each parameter lies in a rank's optimizer tensors, and the
update that skips parameters no rank used (as torch.optim skips a grad-None parameter)."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.testing import layouts, policies, trees
from fzero.update import apply_update, decay_ranges, entry_spans

import guarantee_bodies as gb


def ranks_to_check(world: int) -> list[int]:
    return list(range(world)) if world <= 8 else sorted({0, 1, world // 2, world - 1})


def shard_numel(layout: fzero.ShardLayout, index: int, stage: int) -> int:
    bucket = layout.buckets[index]
    return bucket.padded_numel if stage == 0 else bucket.shard_numel


@given(layouts(), st.sampled_from([0, 1, 2, 3]))
def test_entry_spans_cover_exactly_the_trainable_elements(drawn: Any, stage: int) -> None:
    """Each element of a rank's optimizer tensor that holds a trainable parameter's element is
    in exactly one span, of that parameter; padding is in none."""
    _, layout = drawn
    trainable = [i for i, b in enumerate(layout.buckets) if b.trainable]
    entries = [e for i in trainable for e in layout.buckets[i].entries]
    for rank in ranks_to_check(layout.world_size):
        spans = entry_spans(layout, stage, rank)
        owner: list[list[str | None]] = [
            [None] * shard_numel(layout, i, stage) for i in trainable]
        for span in spans:
            entry = entries[span.entry]
            assert (entry.name, entry.shape) == (span.name, span.shape)
            assert entry in layout.buckets[trainable[span.bucket]].entries
            assert 0 <= span.start <= span.end <= len(owner[span.bucket])
            assert span.start < span.end or stage == 0  # stage 0 lists empty entries too
            for k in range(span.start, span.end):
                assert owner[span.bucket][k] is None, "spans overlap"
                owner[span.bucket][k] = span.name
        for position, index in enumerate(trainable):
            bucket = layout.buckets[index]
            base = 0 if stage == 0 else rank * bucket.shard_numel
            for k, name in enumerate(owner[position]):
                g = base + k  # element of the bucket's flat buffer
                want = next((e.name for e in bucket.entries if e.offset <= g < e.end), None)
                assert name == want, (index, k)


DTYPES = (torch.float64,)


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    """A float64 layout, a stage and rank, random optimizer tensors, per-entry used flags and
    step counts, an optimizer and a decay rule."""
    spec = draw(trees(max_size=12, allow_large=False, dtypes=DTYPES, tie_every=0))
    world = draw(st.integers(1, 5))
    layout = fzero.plan(spec.build("normal"), world, buckets=draw(policies(spec)))
    stage, rank = draw(st.sampled_from([0, 1, 2, 3])), draw(st.integers(0, world - 1))
    trainable = [i for i, b in enumerate(layout.buckets) if b.trainable]
    entries = sum(len(layout.buckets[i].entries) for i in trainable)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    sizes = [shard_numel(layout, i, stage) for i in trainable]
    opt_name = draw(st.sampled_from(["adamw", "sgd"]))
    optimizer = (fzero.optim.adamw(**gb.ADAMW) if opt_name == "adamw"
                 else fzero.optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.01))
    padding = [torch.ones(n, dtype=torch.bool) for n in sizes]
    for span in entry_spans(layout, stage, rank):
        padding[span.bucket][span.start : span.end] = False
    params = [torch.randn(n, generator=gen, dtype=torch.float64) for n in sizes]
    grads = [torch.randn(n, generator=gen, dtype=torch.float64) for n in sizes]
    moments = optimizer.init(params)
    for values in moments.values():
        for t in values:
            t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float64))
    for index, pad in enumerate(padding):  # padding is zero in a state, and stays zero
        for t in (params[index], grads[index], *(v[index] for v in moments.values())):
            t[pad] = 0
    return {
        "layout": layout, "stage": stage, "rank": rank, "optimizer": optimizer,
        "grads": grads, "params": params, "moments": moments,
        "steps": draw(st.lists(st.integers(1, 4), min_size=entries, max_size=entries)),
        "used": draw(st.lists(st.booleans(), min_size=entries, max_size=entries)),
        "decay": draw(st.sampled_from([None, fzero.decay_matrices])),
    }


def cloned(p: dict[str, Any]) -> tuple[list, dict, list]:
    return ([g.clone() for g in p["grads"]],
            {k: tuple(t.clone() for t in v) for k, v in p["moments"].items()},
            [t.clone() for t in p["params"]])


def run_apply(p: dict[str, Any], steps: list[int], used: list[bool]) -> tuple[Any, ...]:
    grads, moments, params = cloned(p)
    spans = entry_spans(p["layout"], p["stage"], p["rank"])
    after = apply_update(p["optimizer"], grads, moments, params, spans=spans, decay=p["decay"],
                         ranges=decay_ranges(spans, len(params), p["decay"]), steps=steps,
                         used=used, lr=None)
    return after, moments, params


@given(problems())
def test_all_used_is_one_optimizer_call(p: dict[str, Any]) -> None:
    step = p["steps"][0] if p["steps"] else 1
    steps = [step] * len(p["steps"])
    after, moments, params = run_apply(p, steps, [True] * len(steps))
    assert after == [step + 1] * len(steps)
    grads, want_moments, want_params = cloned(p)
    spans = entry_spans(p["layout"], p["stage"], p["rank"])
    p["optimizer"].update(grads, want_moments, want_params, step=step + 1,
                          decay=decay_ranges(spans, len(want_params), p["decay"]))
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    for name, values in want_moments.items():
        assert all(torch.equal(a, b) for a, b in zip(moments[name], values, strict=True))


@given(problems())
def test_unused_entries_are_untouched_and_used_ones_count_their_own_steps(
    p: dict[str, Any],
) -> None:
    """Used entries get one update with their own next step number (as if alone, as torch
    keeps a step per parameter); unused entries and padding keep every bit."""
    after, moments, params = run_apply(p, p["steps"], p["used"])
    assert after == [s + 1 if u else s for s, u in zip(p["steps"], p["used"], strict=True)]
    covered = [torch.zeros(t.numel(), dtype=torch.bool) for t in params]
    for span in entry_spans(p["layout"], p["stage"], p["rank"]):
        covered[span.bucket][span.start : span.end] = True
        piece = slice(span.start, span.end)
        grad = p["grads"][span.bucket][piece].clone()
        want_m = {k: (v[span.bucket][piece].clone(),) for k, v in p["moments"].items()}
        want_p = p["params"][span.bucket][piece].clone()
        if p["used"][span.entry]:
            decayed = p["decay"] is None or p["decay"](span.name, span.shape)
            p["optimizer"].update([grad], want_m, [want_p], step=p["steps"][span.entry] + 1,
                                  decay=[[(0, want_p.numel())] if decayed else []])
        assert torch.equal(params[span.bucket][piece], want_p), span.name
        for k, (value,) in want_m.items():
            assert torch.equal(moments[k][span.bucket][piece], value), (k, span.name)
    for index, mask in enumerate(covered):  # padding stays zero
        assert not params[index][~mask].any()
        assert all(not v[index][~mask].any() for v in moments.values())
