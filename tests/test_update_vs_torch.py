"""`fzero.update.apply_update` over every rank's shards (stages 0-3) against `torch.optim`
on the unsharded parameters, over several steps in float64.

The existing update tests compare `apply_update` with calls of fzero's own optimizer. Here the
reference is `torch.optim.AdamW` / `torch.optim.SGD` on plain tensors, with the usual two
parameter groups (``fzero.decay_matrices``: matrices decayed, vectors and scalars not) and a
parameter that no rank used in a step given ``grad = None`` (torch.optim skips it: no update,
no moment change, no step count). The shards are cut from the flat buffers here with plain
torch, and the result is reassembled the same way, so neither side uses fzero's flat helpers.
"""

from __future__ import annotations

import functools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.update import apply_update, decay_ranges, entry_spans

SHAPES = [(), (1,), (3,), (2, 3), (5,), (3, 1), (4, 2), (0,), (7,)]


def flat_of(tensors: dict[str, torch.Tensor], bucket, world: int) -> torch.Tensor:
    pieces = [tensors[e.name].reshape(-1) for e in bucket.entries]
    n = sum(p.numel() for p in pieces)
    padded = math.ceil(n / world) * world
    return torch.cat([*pieces, torch.zeros(padded - n, dtype=torch.float64)])


def rank_tensor(flat: torch.Tensor, world: int, rank: int, stage: int) -> torch.Tensor:
    return flat.clone() if stage == 0 else flat.view(world, -1)[rank].clone()


@settings(deadline=None, max_examples=20)
@given(
    shapes=st.lists(st.sampled_from(SHAPES), min_size=1, max_size=5),
    world=st.integers(1, 4),
    stage=st.sampled_from([0, 1, 2, 3]),
    cap=st.none() | st.integers(1, 10),
    kind=st.sampled_from(["adamw", "sgd"]),
    used=st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_sharded_update_matches_torch_optim(shapes, world, stage, cap, kind, used, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    names = [f"blocks.{i}.p" for i in range(len(shapes))]
    init = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in zip(
        names, shapes, strict=True)}
    lr, wd = 0.05, 0.1
    if kind == "adamw":
        opt = fzero.optim.adamw(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
        make = functools.partial(torch.optim.AdamW, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    else:
        opt = fzero.optim.sgd(lr=lr, momentum=0.9, weight_decay=wd, nesterov=True)
        make = functools.partial(torch.optim.SGD, lr=lr, momentum=0.9, nesterov=True)

    # torch reference: two groups, decay by fzero.decay_matrices' documented rule (2+ dims)
    ref = {n: t.clone().requires_grad_() for n, t in init.items()}
    decayed = [ref[n] for n in names if ref[n].dim() >= 2]
    other = [ref[n] for n in names if ref[n].dim() < 2]
    torch_opt = make([{"params": decayed, "weight_decay": wd},
                      {"params": other, "weight_decay": 0.0}])

    layout = fzero.plan({n: t.clone().requires_grad_() for n, t in init.items()}, world,
                        buckets=cap)
    buckets = [b for b in layout.buckets if b.trainable]
    entry_names = [e.name for b in buckets for e in b.entries]
    ranks = []
    for rank in range(world):
        spans = entry_spans(layout, stage, rank)
        params = [rank_tensor(flat_of(init, b, world), world, rank, stage) for b in buckets]
        ranks.append({"spans": spans, "params": params, "moments": opt.init(params),
                      "ranges": decay_ranges(spans, len(buckets), fzero.decay_matrices),
                      "steps": [0] * len(entry_names)})

    for mask in used:
        grads = {n: torch.randn(init[n].shape, generator=gen, dtype=torch.float64)
                 for n in names}
        use = {n: mask[i] for i, n in enumerate(names)}
        for n in names:
            ref[n].grad = grads[n].clone() if use[n] else None
        torch_opt.step()
        # what a reduction leaves for an unused parameter: zeros
        reduced = {n: grads[n] if use[n] else torch.zeros_like(grads[n]) for n in names}
        for rank, r in enumerate(ranks):
            g = [rank_tensor(flat_of(reduced, b, world), world, rank, stage) for b in buckets]
            r["steps"] = apply_update(
                opt, g, r["moments"], r["params"], spans=r["spans"], decay=fzero.decay_matrices,
                ranges=r["ranges"], steps=r["steps"], used=[use[n] for n in entry_names], lr=lr)

    for index, bucket in enumerate(buckets):
        if stage == 0:
            flat = ranks[0]["params"][index]
            for r in ranks[1:]:  # stage 0: every rank holds (and updates) the same buffer
                assert torch.equal(r["params"][index], flat)
        else:
            flat = torch.cat([r["params"][index] for r in ranks])
        assert not flat[bucket.numel:].any(), "padding must stay zero"
        for entry in bucket.entries:
            got = flat[entry.offset:entry.end].view(entry.shape)
            torch.testing.assert_close(got, ref[entry.name].detach(), rtol=0, atol=0,
                                       msg=lambda m, e=entry: f"{e.name}: {m}")
