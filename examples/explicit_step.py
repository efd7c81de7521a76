"""A ZeRO-3 train step written by hand from fzero's public pieces, equal to `make_train_step`.

    python examples/explicit_step.py                                    # 4 SimWorld ranks
    torchrun --standalone --nproc-per-node 2 examples/explicit_step.py  # 2 gloo processes

Each rank keeps only its shard of every bucket: the parameters, and AdamW's moments for them.
One step all-gathers the shards into full parameters (`gather`), runs the model on them with
`torch.func.functional_call`, and differentiates the loss with respect to the *shards*. `gather`
is differentiable and its backward is `scatter_grads`, a reduce-scatter that averages over
ranks, so each rank receives the gradient of the global-batch loss for exactly the elements it
owns, and the optimizer updates them in place. That is all of ZeRO-3's arithmetic
(docs/design.md, "How stage 3 works").

What `fzero.make_train_step` adds on top: it gathers one bucket at a time, just before the
module that uses it, and frees it afterwards (peak: one or two buckets instead of the whole
model); it reduce-scatters each bucket's gradient as soon as backward completes it; and it
accumulates micro-batches, clips, skips non-finite steps and measures bytes. The numbers are the
same: `main` trains the GPT of train_gpt.py in float64 with both and checks that losses and
parameters agree bitwise (tests/test_explicit_step.py asserts it on SimWorld and gloo ranks).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, GPTConfig, get_batch, load_corpus, loss_fn  # noqa: E402

import fzero  # noqa: E402

# -----------------------------------------------------------------------------
# The step: plan, shard, gather (differentiable), functional_call, autograd, fzero.optim


class Sharded(NamedTuple):
    shards: list[Tensor]  # this rank's (shard_numel,) slice of every bucket, padding zero
    moments: dict[str, tuple[Tensor, ...]]  # optimizer state of the trainable shards
    step: int  # optimizer steps taken


def init(model: nn.Module, layout: fzero.ShardLayout, rank: int, optimizer) -> Sharded:
    """This rank's shards of the model's parameters, and fresh optimizer moments for them."""
    shards = list(fzero.shard(dict(model.named_parameters()), layout, rank))
    trainable = [s for s, b in zip(shards, layout.buckets, strict=True) if b.trainable]
    return Sharded(shards, optimizer.init(trainable), 0)


def make_step(model: nn.Module, loss_fn, layout: fzero.ShardLayout, comm, optimizer, decay):
    """``step(sharded, batch) -> (sharded, mean loss over ranks)``; updates shards in place."""
    gather = fzero.collectives(layout, comm).gather  # (checks that all ranks planned alike)
    buffers = dict(model.named_buffers())
    trainable = [i for i, b in enumerate(layout.buckets) if b.trainable]
    # Weight decay for the elements of this rank's shards that belong to decayed parameters.
    decay_ranges = [
        [(seg.shard_start, seg.shard_end) for seg in layout.buckets[i].segments(comm.rank)
         if decay(seg.entry.name, seg.entry.shape)]
        for i in trainable
    ]

    def step(state: Sharded, batch: Any) -> tuple[Sharded, float]:
        leaves = [s.detach().requires_grad_(b.trainable)
                  for s, b in zip(state.shards, layout.buckets, strict=True)]
        params = gather(leaves)  # {name: full parameter}, tied names share one tensor

        def call(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, (params, buffers), args, kwargs)

        loss = loss_fn(call, batch)  # this rank's rows of the global batch
        # d(mean over ranks of the loss) / d(this rank's shards): gather's backward is
        # scatter_grads, one reduce-scatter (averaged) per bucket.
        grads = torch.autograd.grad(loss, [leaves[i] for i in trainable])
        with torch.no_grad():
            optimizer.update(list(grads), state.moments, [state.shards[i] for i in trainable],
                             step=state.step + 1, decay=decay_ranges)
        mean = loss.detach().to(torch.float64).reshape(1)  # collectives take 1-D tensors
        comm.all_reduce(mean, op="avg")
        return state._replace(step=state.step + 1), mean.item()

    return step


# -----------------------------------------------------------------------------
# Side by side with fzero.make_train_step


def compare(comm, model: nn.Module, loss_fn, batches: list[Any]) -> dict[str, Any]:
    """Train `model` with both steps on the same global batches; this rank's results.

    Rank r takes rows [r * B / N, (r + 1) * B / N) of every tensor of each global batch.
    """
    optimizer = fzero.optim.adamw(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    layout = fzero.plan(model, comm.world_size)
    by_hand = init(model, layout, comm.rank, optimizer)
    step_by_hand = make_step(model, loss_fn, layout, comm, optimizer, fzero.decay_matrices)

    state = fzero.init(model, stage=3, optimizer=optimizer, comm=comm,
                       master_dtype=torch.float64)
    step = fzero.make_train_step(model, loss_fn, decay=fzero.decay_matrices)

    hand_losses, fzero_losses = [], []
    for batch in batches:
        if batch[0].shape[0] % comm.world_size:  # the last rows would be dropped, silently
            raise ValueError(f"a global batch of {batch[0].shape[0]} rows does not split over "
                             f"{comm.world_size} ranks: run a world size that divides it")
        rows = batch[0].shape[0] // comm.world_size
        mine = tuple(t[comm.rank * rows : (comm.rank + 1) * rows] for t in batch)
        by_hand, loss = step_by_hand(by_hand, mine)
        state, metrics = step(state, mine)
        hand_losses.append(loss)
        fzero_losses.append(metrics["loss"])
    same = all(torch.equal(a, b) for a, b in zip(by_hand.shards, state.params, strict=True))
    return {"by_hand": hand_losses, "make_train_step": fzero_losses, "same_shards": same}


def main() -> None:
    # Built before any rank starts: SimWorld's ranks are threads sharing one global RNG.
    model = GPT(GPTConfig(seq_len=32, n_layer=2, d_model=64), seed=0).double()
    tokens, _ = load_corpus(None)  # the standard library's source, as bytes
    gen = torch.Generator().manual_seed(1)
    batches = [get_batch(tokens, gen, 8, 32, rank=0, world=1) for _ in range(5)]  # global
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: one process per rank
        with fzero.distributed() as comm:
            result, rank = compare(comm, model, loss_fn, batches), comm.rank
    else:  # 4 ranks as threads of this process, each with its own copy of the model
        result, rank = fzero.SimWorld(4).run(compare, model, loss_fn, batches)[0], 0
    if rank == 0:
        pairs = zip(result["by_hand"], result["make_train_step"], strict=True)
        for i, (a, b) in enumerate(pairs, 1):
            print(f"step {i}: loss by hand {a:.17g}   make_train_step {b:.17g}   equal {a == b}")
        print(f"parameter shards bitwise equal: {result['same_shards']}")


if __name__ == "__main__":
    main()
