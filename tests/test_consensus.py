"""fzero.consensus on SimWorld ranks: every rank takes the same decision from the same data."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from torch import nn

import fzero
from fzero import consensus
from fzero.consensus import Header, HeaderRound, StepError, agree_header, exchange_statistics

HEADER = Header(fingerprint=0xABC, stage=3, step=4, micro_batches=2, kind=0, buffers=0xDEF,
                lr=consensus.float_bits(1e-3), settings=0x123)


def statistics_body(comm: Any, *, signatures: dict[int, list[int]], used: dict[int, list[bool]],
                    failed: dict[int, str]) -> Any:
    return exchange_statistics(
        comm, squared_norm=float(comm.rank + 1), loss_sum=0.5 * comm.rank, rows=4,
        failed=failed.get(comm.rank), nonfinite=comm.rank == 2,
        signatures=signatures.get(comm.rank, [11, 2**40 + 3]),
        used=used.get(comm.rank, [True, True, True]),
    )


def test_statistics_name_mismatched_ranks_and_count_uses() -> None:
    stats = fzero.SimWorld(4).run(
        statistics_body, signatures={2: [11, 2**40 + 4], 3: [12, 2**40 + 3]},
        used={0: [True, False, False], 3: [False, True, False]}, failed={})
    for s in stats:
        assert s == stats[0]
    s = stats[0]
    assert s.mismatched == (2, 3) and s.failed == () and s.messages == {}
    assert s.squared_norm == 1 + 2 + 3 + 4 and s.loss_sum == 0.5 * (0 + 1 + 2 + 3)
    assert s.rows == (4, 4, 4, 4) and s.nonfinite == (2,)
    assert s.used == (3, 3, 2)  # entry 2: used by ranks 1 and 2 only


def test_statistics_when_everything_agrees() -> None:
    stats = fzero.SimWorld(3).run(statistics_body, signatures={}, used={}, failed={})
    assert stats[0].mismatched == () and stats[0].used is None


def test_high_signature_bits_are_compared() -> None:
    """Signatures travel as two float64 halves: a difference in the high half counts too."""
    stats = fzero.SimWorld(2).run(statistics_body, signatures={1: [11, 2**45 + 3]}, used={},
                                  failed={})
    assert stats[0].mismatched == (1,)


def test_statistics_carry_a_failed_ranks_message_to_every_rank() -> None:
    stats = fzero.SimWorld(3, timeout=5).run(statistics_body, signatures={}, used={},
                                             failed={1: "Boom: ünïcode text"})
    for s in stats:
        assert s.failed == (1,) and s.messages == {1: "Boom: ünïcode text"}


def test_statistics_when_every_rank_failed() -> None:
    stats = fzero.SimWorld(2).run(statistics_body, signatures={}, used={},
                                  failed={0: "A: x", 1: "B: " + "y" * 1000})
    assert stats[0].failed == (0, 1)
    assert stats[0].messages[0] == "A: x" and stats[0].messages[1] == "B: " + "y" * 397


def header_body(comm: Any, *, headers: dict[int, Header], own: dict[int, Exception]) -> Any:
    try:
        agree_header(comm, headers.get(comm.rank, HEADER), what="train step",
                     own=own.get(comm.rank))
    except (StepError, ValueError) as exc:
        return type(exc).__name__, str(exc), getattr(exc, "ranks", None), getattr(exc, "step",
                                                                                  None)
    return None


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("stage", 1, "3 on ranks [0, 1]; 1 on ranks [2]"),
    ("step", 5, "4 on ranks [0, 1]; 5 on ranks [2]"),
    ("micro_batches", 3, "2 on ranks [0, 1]; 3 on ranks [2]"),
    ("kind", 1, "0 on ranks [0, 1]; 1 on ranks [2]"),
    ("fingerprint", 0xABD, "0xabc on ranks [0, 1]; 0xabd on ranks [2]"),
    ("buffers", 0xDEE, "0xdef on ranks [0, 1]; 0xdee on ranks [2]"),
    ("lr", consensus.float_bits(math.nextafter(1e-3, 1.0)),  # one ulp: compared exactly
     "0.001 on ranks [0, 1]; 0.0010000000000000002 on ranks [2]"),
    ("settings", 0x124, "0x123 on ranks [0, 1]; 0x124 on ranks [2]"),
])
def test_header_disagreement_raises_on_every_rank(field: str, value: int, shown: str) -> None:
    odd = HEADER._replace(**{field: value})
    outcomes = fzero.SimWorld(3).run(header_body, headers={2: odd}, own={})
    for rank, (kind, message, ranks, step) in enumerate(outcomes):
        assert kind == "StepError" and ranks == (2,)
        assert step == (6 if field == "step" and rank == 2 else 5)  # the rank's own next step
        assert f"disagree on the {field.replace('_', ' ')} before it started ({shown})" in (
            message)
        assert "nothing was communicated or changed" in message


def test_header_agreement_passes() -> None:
    assert fzero.SimWorld(3).run(header_body, headers={}, own={}) == [None] * 3


def test_a_rank_that_cannot_start_raises_its_own_error_and_the_others_step_error() -> None:
    outcomes = fzero.SimWorld(3).run(header_body, headers={},
                                     own={1: ValueError("consumed state")})
    assert outcomes[1][:2] == ("ValueError", "consumed state")
    for rank in (0, 2):
        kind, message, ranks, _ = outcomes[rank]
        assert kind == "StepError" and ranks == (1,) and "could not start" in message


def test_a_header_round_checks_once_and_raises_the_same_error_again() -> None:
    def body(comm: Any) -> Any:
        odd = HEADER._replace(step=9) if comm.rank == 1 else HEADER
        header = HeaderRound(comm, odd, what="train step")
        issued = comm.counters.total()
        errors = []
        for _ in range(3):  # every path to a collective calls check(): each must stop there
            try:
                header.check()
            except StepError as exc:
                errors.append(exc)
        assert comm.counters.total() == issued  # waiting and raising issue nothing more
        return len(errors), len({id(e) for e in errors})

    assert fzero.SimWorld(2).run(body) == [(3, 1)] * 2


def test_a_header_round_that_times_out_raises_the_timeout_again() -> None:
    """A header a late rank never joins in time: every later `check()` raised nothing, so a
    step launched its first reduction after the timed-out header, waited a second timeout and
    reported that reduction (over gloo: "connection closed by peer", the peer alive). Found by
    a probe."""

    def body(comm: Any) -> Any:
        if comm.rank == 0:
            time.sleep(1.5)  # never joins within rank 1's timeout
            return None
        header = HeaderRound(comm, HEADER, what="train step")
        errors = []
        for _ in range(3):
            try:
                header.check()
            except fzero.CollectiveTimeout as exc:
                errors.append(exc)
        return len(errors), len({id(e) for e in errors}), "train step header" in str(errors[0])

    assert fzero.SimWorld(2, timeout=0.5).run(body) == [None, (3, 1, True)]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_late_rank_times_out_the_header_not_a_reduction(stage: int) -> None:
    """Stages 0-2: the header travels during the forward and the first reduction waits for it;
    a rank late by more than the timeout makes the other raise the header's timeout without
    launching a reduction (before: the reduction's, after two timeouts). The timeout bounds
    init and the first step too: 1.5 s, not less, so a loaded machine's thread skew does not
    time those out (a shorter one did in a test of the same shape)."""
    timeout = 1.5

    def body(comm: Any) -> Any:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        step = fzero.make_train_step(model, lambda call, x: call(x).square().mean())
        state, _ = step(state, torch.ones(2, 4))
        if comm.rank == 0:
            time.sleep(2 * timeout)
            return None
        reductions = comm.counters.total()
        with pytest.raises(fzero.CollectiveTimeout) as info:
            step(state, torch.ones(2, 4))
        return "train step header" in str(info.value), comm.counters.total() == reductions

    assert fzero.SimWorld(2, timeout=timeout).run(body) == [None, (True, True)]


def test_an_agreed_header_round_checks_any_number_of_times() -> None:
    def body(comm: Any) -> int:
        header = HeaderRound(comm, HEADER, what="train step")
        issued = comm.counters.total()
        for _ in range(3):
            header.check()
        return comm.counters.total() - issued

    assert fzero.SimWorld(2).run(body) == [0, 0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_header_travels_while_stages_0_to_2_compute_the_forward(stage: int) -> None:
    """Stages 0-2 issue no collective before backward: the first forward runs while the
    header is in flight (its latency hidden), and the first reduction waits for it. Stage 3
    gathers before its forward, so it waits for the header first. Rank 1 arrives late: rank
    0's forward starts before rank 1 even calls the step in stages 0-2 only (the second step:
    the first opens the control channel, itself a collective)."""
    late = 1.0  # (rank 0's forward must start within late / 2 of its call, also under load)

    def body(comm: Any) -> tuple[float, float]:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        started: list[float] = []

        def loss_fn(call: Any, batch: torch.Tensor) -> torch.Tensor:
            started.append(time.monotonic())
            return call(batch).square().mean()

        step = fzero.make_train_step(model, loss_fn)
        state, _ = step(state, torch.ones(2, 4))
        if comm.rank == 1:
            time.sleep(late)
        called = time.monotonic()
        state, metrics = step(state, torch.ones(2, 4))
        assert metrics["step"] == 2
        return started[1], called

    (forward_0, _), (_, called_1) = fzero.SimWorld(2).run(body)
    if stage == 3:
        assert forward_0 >= called_1
    else:
        assert forward_0 < called_1 - late / 2


@pytest.mark.parametrize("stage", [1, 2])
def test_a_forward_that_raises_while_the_header_disagrees_raises_the_header(stage: int) -> None:
    """Rank 0 cannot start (a consumed state); rank 1 computes meanwhile and its loss_fn
    raises: rank 1 must not report its own error through the statistics round (rank 0 never
    joins it) but raise what the header says, at once."""

    def body(comm: Any) -> tuple[str, str]:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)

        def loss_fn(call: Any, batch: torch.Tensor) -> torch.Tensor:
            if comm.rank == 1 and calls:
                raise RuntimeError("rank 1's forward failed")
            calls.append(1)
            return call(batch).square().mean()

        calls: list[int] = []
        step = fzero.make_train_step(model, loss_fn)
        consumed = state
        state, _ = step(state, torch.ones(2, 4))
        try:
            step(consumed if comm.rank == 0 else state, torch.ones(2, 4))
        except (StepError, ValueError) as exc:
            return type(exc).__name__, str(exc)
        return "none", ""

    (kind_0, _), (kind_1, message_1) = fzero.SimWorld(2, timeout=5.0).run(body)
    assert kind_0 == "ValueError"
    assert kind_1 == "StepError" and "rank(s) [0] could not start" in message_1


@pytest.mark.parametrize("other", [1, 2**32, -1, -(2**63), 2**63 - 1])
def test_parameter_fingerprints_are_compared_in_both_halves(other: int) -> None:
    """The parameters' 64-bit fingerprint travels as two float64 halves of 32 bits (exact): a
    rank whose fingerprint differs from rank 0's in any bit, low or high, negative or not,
    is named `diverged`, and only it; equal ones are not."""
    base = -(2**40) + 12345

    def body(comm: Any) -> Any:
        return exchange_statistics(
            comm, squared_norm=1.0, loss_sum=0.0, rows=4, failed=None, nonfinite=False,
            signatures=[7], used=[True],
            fingerprint=base + other if comm.rank == 2 else base)

    for s in fzero.SimWorld(3).run(body):
        assert s.diverged == (2,) and s.mismatched == ()
    same = fzero.SimWorld(2).run(lambda comm: exchange_statistics(
        comm, squared_norm=1.0, loss_sum=0.0, rows=4, failed=None, nonfinite=False,
        signatures=[7], used=[True], fingerprint=base))
    assert same[0].diverged == ()
