"""The optimizer update of a train step, over the rank's optimizer tensors (pure: no network).

Stage 0 updates full buffers, stages 1-3 this rank's shards. The layout says where each
parameter lies in them (`entry_spans`), which is all the update needs beyond the optimizer:

- weight decay applies to the entries the ``decay(name, shape)`` rule selects (`decay_ranges`);
- an entry that no rank used this step (its gradient is None in torch) is left alone, moments
  included, and its own step count stops: `torch.optim` skips a parameter whose ``grad`` is
  None, so after such a step its bias corrections differ from the others'. `apply_update` then
  calls the optimizer once per distinct step count, on views of the used entries only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from torch import Tensor

from fzero.layout import ShardLayout
from fzero.optim import Moments, Optimizer

__all__ = ["DecayRule", "Span", "apply_update", "decay_ranges", "entry_spans"]

DecayRule = Callable[[str, tuple[int, ...]], bool]


class Span(NamedTuple):
    """Where one trainable entry lies in its bucket's optimizer tensor on this rank."""

    bucket: int  # position among the trainable buckets
    entry: int  # index over all trainable entries, in layout order
    name: str
    shape: tuple[int, ...]
    start: int
    end: int


def entry_spans(layout: ShardLayout, stage: int, rank: int) -> list[Span]:
    """Every trainable entry's element range in this rank's optimizer tensors (the full flat
    buffer at stage 0, the rank's shard otherwise); entries outside the shard have no span."""
    spans = []
    counter = 0
    trainable = [b for b in layout.buckets if b.trainable]
    for position, bucket in enumerate(trainable):
        first = counter
        counter += len(bucket.entries)
        if stage == 0:
            for i, entry in enumerate(bucket.entries):
                spans.append(Span(position, first + i, entry.name, entry.shape, entry.offset,
                                  entry.end))
            continue
        index = {id(entry): first + i for i, entry in enumerate(bucket.entries)}
        for segment in bucket.segments(rank):
            entry = segment.entry
            spans.append(Span(position, index[id(entry)], entry.name, entry.shape,
                              segment.shard_start, segment.shard_end))
    return spans


def decay_ranges(spans: Sequence[Span], buckets: int, decay: DecayRule | None) -> list[list[
        tuple[int, int]]] | None:
    """Per trainable bucket, the ranges of its optimizer tensor that get weight decay;
    None (everything, padding included, which stays zero) when `decay` is None."""
    if decay is None:
        return None
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(buckets)]
    for span in spans:
        if decay(span.name, span.shape):
            ranges[span.bucket].append((span.start, span.end))
    return ranges


def apply_update(
    optimizer: Optimizer,
    grads: Sequence[Tensor],
    moments: Moments,
    params: Sequence[Tensor],
    *,
    spans: Sequence[Span],
    decay: DecayRule | None,
    ranges: list[list[tuple[int, int]]] | None,
    steps: Sequence[int],
    used: Sequence[bool],
    lr: float,
) -> list[int]:
    """One optimizer step in place on `params` and `moments` (donated; `grads` are scratch).

    Args:
        optimizer: the `fzero.optim` optimizer.
        grads, moments, params: per trainable bucket, this rank's optimizer tensors.
        spans: `entry_spans` of the layout for this stage and rank.
        decay: the weight-decay rule, for the per-entry path.
        ranges: `decay_ranges` of the spans and rule (cached by the caller).
        steps: per trainable entry, the updates it received so far.
        used: per trainable entry, whether some rank's backward reached it this step.
        lr: the step's learning rate, for every entry (a schedule's value at the step's own
            number: an entry whose update count lags, unused in earlier steps, takes that
            count for its moments' bias correction only).

    Returns:
        The per-entry step counts after this step.
    """
    after = [s + 1 if u else s for s, u in zip(steps, used, strict=True)]
    if all(used) and len(set(steps)) <= 1:  # the common case: one call over whole tensors
        step = (steps[0] if steps else 0) + 1
        optimizer.update(grads, moments, params, step=step, lr=lr, decay=ranges)
        return after
    groups: dict[int, list[Span]] = {}
    for span in spans:
        if used[span.entry] and span.end > span.start:
            groups.setdefault(steps[span.entry] + 1, []).append(span)
    for step, members in sorted(groups.items()):
        views = [(span.bucket, span.start, span.end) for span in members]
        optimizer.update(
            [grads[b][lo:hi] for b, lo, hi in views],
            {name: tuple(values[b][lo:hi] for b, lo, hi in views)
             for name, values in moments.items()},
            [params[b][lo:hi] for b, lo, hi in views],
            step=step,
            lr=lr,
            decay=[[(0, span.end - span.start)] if decay is None or decay(span.name, span.shape)
                   else [] for span in members],
        )
    return after
