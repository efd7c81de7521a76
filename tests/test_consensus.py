"""fzero.consensus on SimWorld ranks: every rank takes the same decision from the same data."""

from __future__ import annotations

from typing import Any

import pytest

import fzero
from fzero.consensus import Header, StepError, agree_header, exchange_statistics

HEADER = Header(fingerprint=0xABC, stage=3, step=4, micro_batches=2, kind=0)


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
