"""Per-rank test bodies for `fzero.comm`: `fn(comm, *args)`, run by SimWorld and GlooPool alike.

Module-level so spawned workers can unpickle them by name. Every body receives the inputs of all
ranks (drawn in the pytest process) and picks its own with `comm.rank`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fzero.comm import Comm, fingerprint_check
from fzero.torchcomm import TorchComm


def make_inputs(world_size: int, numel: int, dtype: torch.dtype, seed: int = 0) -> list[Tensor]:
    """One random 1-D tensor of `numel` elements per rank, reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(numel, generator=g, dtype=torch.float64).to(dtype) for _ in range(world_size)
    ]


def _finish(work: Any) -> None:
    if work is not None:
        work.wait()


def all_gather_body(comm: Comm, inputs: list[Tensor], async_op: bool = False) -> Tensor:
    x = inputs[comm.rank]
    out = torch.full((comm.world_size * x.numel(),), float("nan"), dtype=x.dtype, device=x.device)
    _finish(comm.all_gather(out, x, async_op=async_op))
    return out


def reduce_scatter_body(
    comm: Comm, inputs: list[Tensor], op: str, async_op: bool = False
) -> Tensor:
    x = inputs[comm.rank].clone()  # a reduce-scatter's input is scratch (may be reduced in place)
    out = torch.full((x.numel() // comm.world_size,), float("nan"), dtype=x.dtype, device=x.device)
    _finish(comm.reduce_scatter(out, x, op=op, async_op=async_op))
    return out


def all_reduce_body(comm: Comm, inputs: list[Tensor], op: str, async_op: bool = False) -> Tensor:
    x = inputs[comm.rank].clone()
    _finish(comm.all_reduce(x, op=op, async_op=async_op))
    return x


def broadcast_body(comm: Comm, inputs: list[Tensor], src: int, async_op: bool = False) -> Tensor:
    x = inputs[comm.rank].clone()
    _finish(comm.broadcast(x, src=src, async_op=async_op))
    return x


def every_collective_body(comm: Comm, inputs: list[Tensor]) -> dict[str, Any]:
    """Every collective and op once, in a fixed order; the results and the counters."""
    comm.counters.reset()
    out: dict[str, Any] = {"all_gather": all_gather_body(comm, inputs)}
    for op in ("sum", "avg"):
        out[f"reduce_scatter/{op}"] = reduce_scatter_body(comm, inputs, op)
    for op in ("sum", "avg", "max", "min"):
        out[f"all_reduce/{op}"] = all_reduce_body(comm, inputs, op)
    out["broadcast"] = broadcast_body(comm, inputs, comm.world_size - 1)
    comm.barrier()
    out["counters"] = comm.counters.snapshot()
    out["total"] = comm.counters.total()
    return out


def async_overlap_body(comm: Comm, a: list[Tensor], b: list[Tensor]) -> list[Tensor]:
    """Issue two all-gathers and an all-reduce before waiting on any of them."""
    x, y = a[comm.rank], b[comm.rank]
    out_a = torch.empty(comm.world_size * x.numel(), dtype=x.dtype, device=x.device)
    out_b = torch.empty(comm.world_size * y.numel(), dtype=y.dtype, device=y.device)
    z = x.clone()
    works = [
        comm.all_gather(out_a, x, async_op=True),
        comm.all_gather(out_b, y, async_op=True),
        comm.all_reduce(z, op="sum", async_op=True),
    ]
    for work in works:
        work.wait()
    assert all(work.is_completed() for work in works)
    return [out_a, out_b, z]


def async_is_async_body(comm: Comm, delay: float) -> tuple[float, bool, Tensor]:
    """Rank 0 issues at once, the others after `delay` s: issuing must not wait for them."""
    if comm.rank != 0:
        time.sleep(delay)
    x = torch.full((4,), float(comm.rank))
    out = torch.empty(4 * comm.world_size)
    t0 = time.monotonic()
    work = comm.all_gather(out, x, async_op=True)
    issue_s = time.monotonic() - t0
    done_early = work.is_completed()
    work.wait()
    return issue_s, done_early, out


def fingerprint_body(comm: Comm, values: list[int | str]) -> str | None:
    """`fingerprint_check` on this rank's value; the error text, or None if all agree."""
    try:
        fingerprint_check(comm, values[comm.rank], "layout fingerprint")
    except ValueError as exc:
        return str(exc)
    return None


def raise_on_rank_body(comm: Comm, bad_rank: int) -> int:
    """Rank `bad_rank` raises; the others enter a barrier it never joins."""
    if comm.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    comm.barrier()
    return comm.rank


def identity_body(comm: Comm) -> tuple[int, int, str]:
    return comm.rank, comm.world_size, type(comm).__name__


def avg_fallback_body(comm: TorchComm, inputs: list[Tensor]) -> dict[str, Tensor]:
    """ "avg" through the SUM-then-divide fallback (as on backends without ReduceOp.AVG)."""
    fallback = TorchComm(comm.group)
    fallback._native_avg = False
    out = {
        "reduce_scatter": reduce_scatter_body(fallback, inputs, "avg"),
        "reduce_scatter/async": reduce_scatter_body(fallback, inputs, "avg", async_op=True),
        "all_reduce": all_reduce_body(fallback, inputs, "avg"),
        "all_reduce/async": all_reduce_body(fallback, inputs, "avg", async_op=True),
    }
    return out


def timeout_comm_body(comm: TorchComm, inputs: list[Tensor]) -> dict[str, Any]:
    """`every_collective_body` on a TorchComm whose waits are bounded by a timeout."""
    return every_collective_body(TorchComm(comm.group, timeout=20.0), inputs)


def subgroup_body(comm: TorchComm, inputs: list[Tensor]) -> dict[str, Any] | None:
    """Collectives over the group of the last two ranks (group ranks 0, 1 = global n-2, n-1)."""
    n = comm.world_size
    group = dist.new_group([n - 2, n - 1])  # every rank of the default group must call it
    if comm.rank < n - 2:
        return None
    sub = TorchComm(group)
    sub_inputs = inputs[n - 2 :]  # indexed by group rank
    return {
        "rank": sub.rank,
        "world_size": sub.world_size,
        "all_gather": all_gather_body(sub, sub_inputs),
        "broadcast": broadcast_body(sub, sub_inputs, src=1),
        "all_reduce": all_reduce_body(sub, sub_inputs, "sum"),
    }


def every_collective_by_transport_body(comm: Comm, inputs: list[Tensor]) -> dict[str, Any]:
    """`every_collective_body` once per `TorchComm` transport over the worker's group."""
    from fzero.torchcomm import TRANSPORTS, TorchComm

    return {t: every_collective_body(TorchComm(transport=t), inputs) for t in TRANSPORTS}


def wait_again_body(comm: Comm, inputs: list[Tensor]) -> dict[str, Any]:
    """Per transport and timeout: async collectives waited for on a helper thread, then again
    on this thread (as `fzero.collect.Pending` does); whether the second waits returned within
    10 s, and the results."""
    import threading
    from datetime import timedelta

    from fzero.torchcomm import TRANSPORTS

    out: dict[str, Any] = {}
    mine = inputs[comm.rank]
    for transport in TRANSPORTS:
        for timeout in (None, timedelta(seconds=60)):
            tc = TorchComm(transport=transport, timeout=timeout, shm_min_bytes=0)
            gathered = torch.empty(mine.numel() * comm.world_size, dtype=mine.dtype)
            shard = torch.empty(mine.numel() // comm.world_size, dtype=mine.dtype)
            works = [tc.all_gather(gathered, mine.clone(), async_op=True),
                     tc.reduce_scatter(shard, mine.clone(), op="sum", async_op=True)]
            for work in works:
                helper = threading.Thread(target=work.wait)
                helper.start()
                helper.join()
            again = threading.Thread(target=lambda ws: [w.wait() for w in ws], args=(works,),
                                     daemon=True)
            again.start()
            again.join(10.0)
            out[f"{transport}/{timeout}"] = (not again.is_alive(), gathered, shard)
    return out


def bad_transport_body(comm: Comm) -> None:
    from fzero.torchcomm import TorchComm

    TorchComm(transport="carrier-pigeon")


def in_place_body(comm: Comm, inputs: list[Tensor]) -> dict[str, Tensor]:
    """All-gather whose input is this rank's chunk of the output, and reduce-scatter whose
    output is this rank's chunk of the input (as fzero's buckets use them when `in_place`)."""
    n, r = comm.world_size, comm.rank
    s = inputs[r].numel() // n
    gathered = torch.full((n * s,), float("nan"), dtype=inputs[r].dtype, device=inputs[r].device)
    gathered[r * s : (r + 1) * s] = inputs[r][:s]
    comm.all_gather(gathered, gathered[r * s : (r + 1) * s])
    out: dict[str, Tensor] = {"all_gather": gathered}
    for op in ("sum", "avg"):
        flat = inputs[r].clone()
        comm.reduce_scatter(flat[r * s : (r + 1) * s], flat, op=op, async_op=True).wait()
        out[f"reduce_scatter/{op}"] = flat[r * s : (r + 1) * s].clone()
    return out
