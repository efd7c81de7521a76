"""Tests of fzero.shm: gloo's shared-memory transport, against each collective's equation and
against the pairwise transport (bitwise), on 2 and 3 ranks of one host."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

from fzero import shm as fshm

import comm_bodies as cb
import shm_bodies as shb
import step_bodies as sb
from models import TinyGPT, reference_train

pytestmark = pytest.mark.skipif(
    not (hasattr(os, "memfd_create") and os.path.isdir(fshm.PROC_DIR)),
    reason="shared-memory slots need Linux (memfd_create, /proc)",
)

CHUNK = 1031  # per-rank elements (odd: padding-free but unaligned to anything)
STEPS = 6


def exact(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def ref_reduce_scatter(inputs: list[Tensor], op: str, rank: int) -> Tensor:
    """Rank `rank`'s chunk of the sum over ranks, added left to right in rank order."""
    s = inputs[0].numel() // len(inputs)
    acc = inputs[0][rank * s : (rank + 1) * s].clone()
    for x in inputs[1:]:
        acc = acc + x[rank * s : (rank + 1) * s]
    return acc / len(inputs) if op == "avg" else acc


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_their_equations(
    gloo_pool: Any, n: int, dtype: torch.dtype, in_place: bool
) -> None:
    """All-gather and reduce-scatter through shared memory: exactly their single-process
    equations, sums in rank order; all-reduce and broadcast (gloo's own) unchanged."""
    inputs = cb.make_inputs(n, n * CHUNK, dtype)
    for r, res in enumerate(gloo_pool(n).run(shb.every_collective_body, inputs, in_place)):
        assert res["transport"] == "shm" and res["slots"] >= 1  # the data went through a slot
        got = res["results"]
        if in_place:
            exact(got["all_gather"], torch.cat([x[:CHUNK] for x in inputs]))
        else:
            exact(got["all_gather"], torch.cat(inputs))
            exact(got["broadcast"], inputs[n - 1])
        for op in ("sum", "avg"):
            exact(got[f"reduce_scatter/{op}"], ref_reduce_scatter(inputs, op, r))


@pytest.mark.parametrize("n", [2, 3])
def test_transports_agree_bitwise(gloo_pool: Any, n: int) -> None:
    """Pairwise and shared memory: the same bits and the same logical byte counts."""
    inputs = cb.make_inputs(n, n * CHUNK, torch.float32, seed=3)
    by_transport = {
        t: gloo_pool(n).run(shb.with_comm_body, t, cb.every_collective_body, inputs)
        for t in ("pairwise", "shm")
    }
    for pairwise, shared in zip(by_transport["pairwise"], by_transport["shm"], strict=True):
        assert shared["slots"] >= 1 and pairwise["slots"] == 0
        for key, value in pairwise["result"].items():
            if isinstance(value, Tensor):
                exact(shared["result"][key], value)
            else:
                assert shared["result"][key] == value, key


@pytest.mark.parametrize("n", [2, 3])
def test_slots_are_not_reused_before_every_peer_has_read_them(gloo_pool: Any, n: int) -> None:
    """Four all-gathers and four reduce-scatters in flight, ten times over, waited newest
    first, the last rank reading late: every result exact, and the slots are reused (as many as
    were in flight together, not one per collective)."""
    inputs = cb.make_inputs(n, n * CHUNK, torch.float32, seed=5)
    rounds, depth = 10, 4
    for res in gloo_pool(n).run(shb.in_flight_body, inputs, rounds, depth, 0.05):
        assert res["wrong"] == []
        assert depth * 2 <= res["slots"] <= depth * 2 * 2 < rounds * depth * 2


def test_descriptors_are_closed_once_read_and_when_the_comm_goes(gloo_pool: Any) -> None:
    """No names anywhere: a slot's descriptor stays open only until every peer has opened it,
    and a dropped comm leaves no descriptor (nor anything in /dev/shm) behind."""
    inputs = cb.make_inputs(2, 2 * CHUNK, torch.float32)
    for res in gloo_pool(2).run(shb.descriptors_body, inputs):
        assert res["first"] == 1  # slot 0, not yet known to be read
        assert res["second"] == res["slots"] - 1  # slot 0 read by the peer: closed
        assert res["pipes"] == 2  # this rank's pipe, its end of the peer's
        assert res["after"] == res["pipes_after"] == 0


@pytest.mark.parametrize(("n", "ranks", "why"), [
    (2, [1], "proc"), (2, [0, 1], "proc"), (3, [0], "proc"), (3, [2], "inode"),
])  # fmt: skip
def test_ranks_that_cannot_share_memory_raise_together(
    gloo_pool: Any, n: int, ranks: list[int], why: str
) -> None:
    """Some ranks cannot open the others' memory (another pid namespace, or another process
    under the same pid): every rank raises, with the fix, and the group stays usable."""
    inputs = cb.make_inputs(n, n * CHUNK, torch.float32)
    for res in gloo_pool(n).run(shb.unshared_body, inputs, ranks, why):
        assert res["error"] is not None
        assert "needs every rank of the group on one host" in res["error"]
        assert "transport='pairwise'" in res["error"]
        exact(res["all_gather"], torch.cat(inputs))


def test_a_reader_unmaps_what_it_read_of_its_peers_slots(gloo_pool: Any) -> None:
    """Each page of a slot is resident in its owner alone once read: a reader maps a peer's
    slot only while it reads, so RSS counts the bytes in flight once, not once per rank."""
    inputs = cb.make_inputs(2, 1_200_000, torch.float32)  # 4.8 MB per rank: a 5 MiB slot
    for res in gloo_pool(2).run(shb.slot_rss_body, inputs):
        assert res["slot_bytes"] >= 4_800_000
        assert res["rss"] <= res["slot_bytes"]  # this rank's own slot; none of its peer's


def test_dropped_slots_wait_for_live_peers_only() -> None:
    """Dropped slots wait for a peer still to open one, and warn when that takes long; a peer
    whose process has ended is not waited for."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    for pid, wait_s in ((ended.pid, 30.0), (os.getpid(), 1.0)):
        pipe, write_end = os.pipe()
        os.set_blocking(pipe, False)
        own = fshm._Own(pipe, {}, {1: pid})
        fd = fshm._new_memory(fshm.MIN_CHUNK_BYTES)
        own.slots.append(fshm._Slot(0, fshm._map(fd, fshm.MIN_CHUNK_BYTES), fd))
        own.slots[0].unread = {1}  # told rank 1 of it; rank 1 has not opened it
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with shb.patched(fshm, SLOW_RELEASE_S=0.2):
                own.release(wait_s)
        waited = time.monotonic() - start
        os.close(write_end)
        assert own.slots[0].fd == -1  # closed either way
        if pid == ended.pid:
            assert waited < 5.0 and not caught  # not 30 s
        else:
            assert waited >= wait_s
            assert any("rank(s) [1]" in str(w.message) for w in caught)


def test_memory_that_cannot_be_reserved_raises_with_the_fix(gloo_pool: Any) -> None:
    inputs = cb.make_inputs(2, 2 * 300_000, torch.float32)  # a slot larger than the first
    for message in gloo_pool(2).run(shb.no_space_body, inputs):
        assert message is not None
        assert "could not reserve" in message and "transport='pairwise'" in message


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "world"), [(1, 3), (2, 2), (3, 2), (3, 3)])
def test_training_through_shared_memory_is_bitwise_pairwise(
    gloo_pool: Any, stage: int, world: int
) -> None:
    """Every chunk of a train step (stage 3's gathers on their channel too) through shared
    memory: the same bits as the pairwise transport, and the reference's parameters."""
    model = TinyGPT()
    batches = [TinyGPT.make_batch(seed, 12) for seed in range(3)]
    runs = {
        t: gloo_pool(world).run(
            shb.with_comm_body, t, sb.train_body, model, batches, STEPS, stage=stage)
        for t in ("pairwise", "shm")
    }  # fmt: skip
    for pairwise, shared in zip(runs["pairwise"], runs["shm"], strict=True):
        assert shared["slots"] >= (2 if stage == 3 else 1) and pairwise["slots"] == 0
        assert shared["result"]["losses"] == pairwise["result"]["losses"]
        for name, value in pairwise["result"]["params"].items():
            exact(shared["result"]["params"][name], value)
    ref = reference_train(model, TinyGPT.loss_fn, batches,
                          lambda ps: torch.optim.AdamW(ps, **sb.ADAMW), STEPS)
    for name, value in ref.params.items():  # docs/design.md: <= 1e-5 relative in fp32
        torch.testing.assert_close(runs["shm"][0]["result"]["params"][name], value,
                                   rtol=1e-5, atol=1e-6, msg=name)
