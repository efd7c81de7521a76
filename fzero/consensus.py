"""What the ranks of a train step agree on, and the error every rank raises when they do not.

[Note: agreement points]
A step exchanges two small messages on the control channel, so that every rank takes the same
decision from the same data:

- Before any bucket moves, the step `header`: layout fingerprint, stage, step number, number of
  micro-batches, kind of step, fingerprint of the buffers (names, shapes, dtypes), and for a
  train step its learning rate and a fingerprint of its other settings (optimizer
  hyperparameters, clipping, weight-decay rule...). A rank resumed from another checkpoint,
  given another number of micro-batches, another model or another learning rate (each rank
  updates its own part of the model: a rank-dependent schedule would silently train a mix)
  makes every rank raise here, state untouched. The header need not arrive before the
  computation starts, only before the first collective: a train step of stages 0-2 (which
  communicate first in backward) starts it (`HeaderRound`), runs the forward while it
  travels, and checks it before the first reduction or buffer broadcast (its latency hidden);
  stage 3, which gathers before its forward, checks it first.
- After backward and before any update, the `statistics`: this rank's share of the squared
  gradient norm, its loss sum and rows, whether its own computation failed, whether it saw a
  non-finite value, whether it used every parameter, and the signature of the collective
  sequence it issued on each channel. Every rank then knows which ranks failed (all raise
  `StepError`; the failing rank re-raises its own exception), whether the collective sequences
  matched (else all raise: nothing is applied), and which parameters no rank used (the
  optimizer leaves them alone, as torch does for a parameter whose ``grad`` is None).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from fzero.comm import Comm, describe_parts, differing_parts

__all__ = ["Header", "HeaderRound", "StepError", "Statistics", "agree_header",
           "exchange_statistics", "float_bits"]

_MESSAGE_BYTES = 400  # a failing rank's error text, truncated, shown on every rank
_HALF = 2**31


class StepError(RuntimeError):
    """A train step was applied on no rank; the state of the rank raising this is unchanged.

    (The ranks that caused it raise their own error instead; one whose forward wrote a parameter
    in place below stage 3 says that its state already holds the write.)

    Attributes:
        step: the step number (1-based) that failed.
        ranks: the ranks that caused it (failed, or disagreed with rank 0).
    """

    def __init__(self, message: str, *, step: int, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = tuple(ranks)


class Header(NamedTuple):
    """What every rank must agree on before a step moves any bucket."""

    fingerprint: int  # layout fingerprint as an int
    stage: int
    step: int  # the state's step (optimizer steps applied)
    micro_batches: int
    kind: int  # 0: train step, 1: eval step
    buffers: int  # fingerprint of the state's buffer names, shapes and dtypes as an int
    lr: int = 0  # the train step's learning rate: its float64 bits as an int (eval: 0)
    settings: int = 0  # fingerprint of the train step's other settings (eval: 0)
    state: int = 0  # the state's lineage (`fzero.state.ShardState.lineage`)
    rows: int = -1  # the rows a train step's `rows=` declares on this rank (-1: none); the
    # one field ranks need not share: it weighs their losses (`HeaderRound.rows`)


_UNSHARED = frozenset({"rows"})  # `Header` fields that may differ between ranks


def agree_header(
    control: Comm, header: Header, *, what: str, own: BaseException | None = None
) -> None:
    """All-gather every rank's `header` and raise on every rank if any field differs.

    Args:
        control: the control channel.
        header: this rank's header (``micro_batches == 0`` when `own` is set).
        what: the step's name, for messages.
        own: the exception this rank hit before it could start (a check that failed here
            only): it is re-raised here after every rank learned of it.

    Raises:
        StepError: naming the field, each value and the ranks holding it; or the ranks that
            could not start. `own` itself on the rank that hit it.
    """
    HeaderRound(control, header, what=what, own=own).check()


class HeaderRound:
    """`agree_header` in two halves: the all-gather starts at construction, and `check()`
    waits for it and raises as `agree_header` does.

    A step whose first collective comes late (stages 0-2 reduce only in backward) computes
    while the header travels and calls `check()` before its first collective on any channel.
    `check()` may be called any number of times: it waits once, and every later call raises
    the same error again (so every path to a collective stops there) or returns.
    """

    def __init__(
        self, control: Comm, header: Header, *, what: str, own: BaseException | None = None,
        parts: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        n = control.world_size
        if own is not None:
            header = header._replace(micro_batches=0)
        self._what = what
        self._own = own
        self._control = control
        self._parts = dict(parts or {})  # per field: what its value is made of, by name
        self._header = header
        self._every = torch.empty(n * len(header), dtype=torch.int64)
        mine = torch.tensor(list(header), dtype=torch.int64)
        self._work = control.all_gather(self._every, mine, async_op=True,
                                        label=f"of the {what} header")
        self._error: BaseException | None = None
        self._table: list[list[int]] = []

    def check(self) -> None:
        """Wait for every rank's header (once); raise if this step cannot start."""
        if self._work is not None:
            work, self._work = self._work, None
            try:  # a wait that raises (a timeout) is remembered too, as a verdict is
                work.wait()
                self._table = self._every.view(-1, len(self._header)).tolist()
                self._verify(self._table)
            except BaseException as exc:
                self._error = exc
        if self._error is not None:
            raise self._error

    def rows(self) -> list[int]:
        """Every rank's `Header.rows`, once `check()` returned."""
        self.check()
        return [row[Header._fields.index("rows")] for row in self._table]

    def _verify(self, rows: list[list[int]]) -> None:
        what, header = self._what, self._header
        if self._own is not None:
            raise self._own
        unable = [r for r, row in enumerate(rows) if row[3] == 0]
        if unable:
            raise StepError(
                f"{what}: rank(s) {unable} could not start it (their own error says why: a "
                f"consumed state, another model, a batch that does not split or has no rows, "
                f"such as no target token where rows= counts them); nothing was "
                f"communicated or changed",
                step=header.step + 1,
                ranks=unable,
            )
        for field_index, field in enumerate(Header._fields):
            if field in _UNSHARED:
                continue
            values = [row[field_index] for row in rows]
            if len(set(values)) > 1:
                by_value: dict[int, list[int]] = {}
                for rank, value in enumerate(values):
                    by_value.setdefault(value, []).append(rank)
                shown = "; ".join(f"{_show(field, v)} on ranks {r}" for v, r in by_value.items())
                odd = [r for r, v in enumerate(values) if v != values[0]]
                parts = self._parts.get(field)
                named = "" if not parts else "; " + describe_parts(
                    differing_parts(self._control, parts, f"{what} {field}"), parts)
                raise StepError(
                    f"{what}: ranks disagree on the {field.replace('_', ' ')} before it started "
                    f"({shown}){named}; nothing was communicated or changed. "
                    + _HEADER_HINTS.get(field, ""),
                    step=header.step + 1,
                    ranks=odd,
                )


_HEADER_HINTS = {
    "fingerprint": "Every rank must build its state from the same model and bucket policy.",
    "stage": "Every rank must use the same stage.",
    "step": "Every rank must resume from the same checkpoint and call the step as often.",
    "micro_batches": "Every rank must split its batch into the same number of micro-batches.",
    "kind": "Every rank must call the same kind of step (train or eval) at the same time.",
    "buffers": "Every rank must hold the same buffers (names, shapes, dtypes): rank 0's are "
               "broadcast into the others' byte for byte.",
    "lr": "Every rank must use the same learning rate at every step: each updates its own "
          "part of the model with it (a schedule must not depend on the rank, e.g. on the "
          "length of the rank's own data).",
    "settings": "Every rank must train with the same settings: the optimizer and its "
                "hyperparameters, clip_norm, max_skipped, the buffers policy, the "
                "weight-decay rule and the state's master_dtype and reduce_dtype.",
    "state": "Every rank must pass its part of the same state: states from two fzero.init or "
             "fzero.load calls, or a state and its clone_state copy, are different states "
             "even when they hold the same values.",
}


def float_bits(value: float) -> int:
    """A float64's bits as an int64 (for a header: equal exactly when the floats are)."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


_HEX_FIELDS = ("fingerprint", "buffers", "settings", "state")  # shown in hexadecimal


def _show(field: str, value: int) -> str:
    if field == "lr":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    return f"{value:#x}" if field in _HEX_FIELDS else str(value)


class Statistics(NamedTuple):
    """The step's statistics, the same on every rank."""

    squared_norm: float  # sum over ranks of their shares
    loss_sum: float  # sum over ranks of their mean micro-batch losses
    rows: tuple[int, ...]  # per rank
    failed: tuple[int, ...]  # ranks whose own computation raised
    messages: dict[int, str]  # their error texts (truncated)
    nonfinite: tuple[int, ...]  # ranks that saw a non-finite loss or gradient
    mismatched: tuple[int, ...]  # ranks whose collective sequence differs from rank 0's
    used: tuple[int, ...] | None  # per trainable entry, ranks that used it; None: all, all
    diverged: tuple[int, ...] = ()  # ranks whose parameters' fingerprint differs from rank 0's
    shapes: tuple[int, ...] = ()  # per rank, the digest of its batch's tensors' dim-0 sizes


def exchange_statistics(
    control: Comm,
    *,
    squared_norm: float,
    loss_sum: float,
    rows: int,
    shapes: int = 0,
    failed: str | None,
    nonfinite: bool,
    signatures: Sequence[int],
    used: Sequence[bool],
    fingerprint: int = 0,
) -> Statistics:
    """All-gather every rank's statistics (a collective on the control channel).

    Args:
        control: the control channel.
        squared_norm: this rank's share of the global squared gradient norm.
        loss_sum: this rank's loss: the mean of its micro-batches' losses (weighted by their
            shares), times its share of the mean over ranks times their number (1 unless a
            train step's ``rows=`` weighs the ranks by their rows).
        rows: rows of this rank's batch (-1: it cannot tell).
        shapes: a digest (below 2**50) of its batch's tensors' places and dim-0 sizes.
        failed: this rank's error text if its computation raised, else None.
        nonfinite: whether this rank saw a non-finite loss or gradient.
        signatures: the running signature of each channel this step used, in a fixed order.
        used: per trainable entry, whether this rank's backward reached it.
        fingerprint: a 64-bit fingerprint of what every rank should hold alike (stages 0-2:
            the full parameters, `fzero.flat.fingerprint`); 0 where there is none.

    Returns:
        The same `Statistics` on every rank.
    """
    n = control.world_size
    all_used = all(used)
    word = fingerprint % 2**64  # two 32-bit halves: exact in float64
    vector = [squared_norm, loss_sum, float(rows), float(failed is not None), float(nonfinite),
              float(all_used), float(word >> 32), float(word & 0xFFFFFFFF), float(shapes)]
    for signature in signatures:
        vector += [float(signature // _HALF), float(signature % _HALF)]
    mine = torch.tensor(vector, dtype=torch.float64)
    every = torch.empty(n * len(vector), dtype=torch.float64)
    control.all_gather(every, mine, label="of the step statistics")
    table = every.view(n, len(vector)).tolist()

    failed_ranks = tuple(r for r in range(n) if table[r][3])
    messages: dict[int, str] = {}
    if failed_ranks:  # a second exchange, only when some rank failed: its error text
        text = (failed or "").encode("utf-8", "replace")[:_MESSAGE_BYTES]
        buffer = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if text:  # a healthy rank sends zeros
            buffer[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        texts = torch.empty(n * _MESSAGE_BYTES, dtype=torch.uint8)
        control.all_gather(texts, buffer, label="of the failed ranks' errors")
        for r in failed_ranks:
            raw = bytes(texts[r * _MESSAGE_BYTES : (r + 1) * _MESSAGE_BYTES].tolist())
            messages[r] = raw.rstrip(b"\0").decode("utf-8", "replace")
    counts: tuple[int, ...] | None = None
    if not all(row[5] for row in table):  # some rank left a parameter unused: who used what
        flags = torch.tensor([float(u) for u in used], dtype=torch.float64)
        control.all_reduce(flags, op="sum", label="of the parameters each rank used")
        counts = tuple(int(c) for c in flags.tolist())
    reference = table[0][9:]
    return Statistics(
        squared_norm=sum(row[0] for row in table),
        loss_sum=sum(row[1] for row in table),
        rows=tuple(int(row[2]) for row in table),
        failed=failed_ranks,
        messages=messages,
        nonfinite=tuple(r for r in range(n) if table[r][4]),
        mismatched=tuple(r for r in range(n) if table[r][9:] != reference),
        used=counts,
        diverged=tuple(r for r in range(n) if table[r][6:8] != table[0][6:8]),
        shapes=tuple(int(row[8]) for row in table),
    )
