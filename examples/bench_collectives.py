"""Bandwidth of fzero's bucketed collectives against one raw collective over the same bytes.

    python examples/bench_collectives.py              # ~272 MiB float32 model, 2 gloo ranks
    python examples/bench_collectives.py --mib 32 --repeats 9

Two processes (torch.multiprocessing, file:// rendezvous, gloo) hold the shards of a GPT-like
float32 model planned into ~12 buckets (`fzero.plan(..., buckets=cap)`). Each operation runs
`--warmup` times, then `--repeats` times between barriers; a repeat's time is the slowest
rank's. The table shows the median (min–max) and the bandwidth: bytes each rank sends under ring
accounting ((N-1)/N of the big side of an all-gather or reduce-scatter) per second.

- ``raw all_gather_single``: one all-gather of a buffer as large as all buckets together
  (padding included), output preallocated: the best a flat implementation can do.
- ``fzero gather``: ``gather(shards)``: one all-gather per bucket, all issued before the first
  wait, into fresh buffers, then viewed as parameters.
- ``raw reduce_scatter_single``: one AVG reduce-scatter of the same total size, preallocated.
- ``fzero scatter_grads``: ``scatter_grads(grads)``: per bucket, the gradients copied into a
  flat buffer, then an AVG reduce-scatter; all issued before the first wait.

``vs raw`` is fzero's bandwidth over the raw collective's (target >= 0.9). Workers run torch
with one intra-op thread (``--threads``): with two ranks on a small machine, gloo's own
threads and the ranks' copies otherwise fight for the same cores and the timings scatter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fzero
from fzero.collect import collectives
from fzero.comm import ring_bytes
from fzero.torchcomm import TRANSPORTS

D_MODEL, VOCAB = 1024, 8192


def transformer_shapes(mib: float) -> dict[str, tuple[int, ...]]:
    """GPT-like parameter shapes totalling about `mib` MiB of float32 (at least one block)."""
    d = D_MODEL
    block = {
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.qkv.weight": (3 * d, d),
        "attn.qkv.bias": (3 * d,),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.fc.weight": (4 * d, d),
        "mlp.fc.bias": (4 * d,),
        "mlp.proj.weight": (d, 4 * d),
        "mlp.proj.bias": (d,),
    }
    block_numel = sum(torch.Size(s).numel() for s in block.values())
    embed_numel = VOCAB * d + 2 * d
    n_blocks = max(1, round((mib * 2**20 / 4 - embed_numel) / block_numel))
    shapes = {"tok_emb.weight": (VOCAB, d)}
    for i in range(n_blocks):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    return shapes


def plan_layout(mib: float, world_size: int, buckets: int) -> fzero.ShardLayout:
    """Plan on `meta` tensors (no memory) with a size cap giving about `buckets` buckets."""
    meta = {
        name: torch.empty(shape, device="meta") for name, shape in transformer_shapes(mib).items()
    }
    total = sum(t.numel() for t in meta.values())
    return fzero.plan(meta, world_size, buckets=-(-total // buckets))


def single_tensor_ops() -> tuple[Callable[..., object], Callable[..., object]]:
    """`all_gather_single` / `reduce_scatter_single`, or their names before torch 2.13."""
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single, dist.reduce_scatter_single
    return dist.all_gather_into_tensor, dist.reduce_scatter_tensor


def timed(fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    """Seconds per call on this rank, each call started together on every rank."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return times


def worker(rank: int, world_size: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        run(rank, world_size, args)
    finally:
        dist.destroy_process_group()  # gloo aborts the process otherwise


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    n = world_size
    layout = plan_layout(args.mib, n, args.buckets)
    comm = fzero.TorchComm(transport=args.transport)
    gather, scatter_grads, _ = collectives(layout, comm)
    gen = torch.Generator().manual_seed(rank)
    shards = [torch.randn(b.shard_numel, generator=gen) for b in layout.buckets]
    grads = {  # this rank's full gradients, one tensor per parameter
        e.name: torch.randn(e.shape, generator=gen) for b in layout.buckets for e in b.entries
    }
    padded = layout.padded_numel  # one raw buffer as large as all buckets together
    all_gather_single, reduce_scatter_single = single_tensor_ops()
    ag_in, ag_out = torch.randn(padded // n, generator=gen), torch.empty(padded)
    rs_in, rs_out = torch.randn(padded, generator=gen), torch.empty(padded // n)

    def fzero_bytes(kind: str) -> int:
        return sum(ring_bytes(kind, b.padded_numel, 4, n) for b in layout.buckets)

    rows = [  # (name, bytes each rank sends, fn, index of the baseline row)
        ("raw all_gather_single", ring_bytes("all_gather", padded, 4, n),
         lambda: all_gather_single(ag_out, ag_in), None),
        (f"fzero gather ({len(layout.buckets)} buckets)", fzero_bytes("all_gather"),
         lambda: gather(shards), 0),
        ("raw reduce_scatter_single (avg)", ring_bytes("reduce_scatter", padded, 4, n),
         lambda: reduce_scatter_single(rs_out, rs_in, op=dist.ReduceOp.AVG), None),
        (f"fzero scatter_grads ({len(layout.buckets)} buckets)", fzero_bytes("reduce_scatter"),
         lambda: scatter_grads(grads), 2),
    ]  # fmt: skip
    medians: list[float] = []
    lines = []
    for name, nbytes, fn, base in rows:
        mine = torch.tensor(timed(fn, args.warmup, args.repeats), dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a repeat lasts as long as its slowest rank
        times = mine.tolist()
        med = statistics.median(times)
        medians.append(med)
        rate = nbytes / med
        ratio = f"{medians[base] / med * nbytes / rows[base][1]:.2f}" if base is not None else "—"
        lines.append(
            f"| {name} | {nbytes / 2**20:,.1f} MiB | {med * 1e3:,.1f} "
            f"({min(times) * 1e3:,.1f}–{max(times) * 1e3:,.1f}) | {rate / 1e9:.2f} | {ratio} |"
        )
    if rank == 0:
        numel = layout.numel
        print(
            f"gloo, {n} ranks, {numel * 4 / 2**20:,.1f} MiB float32 ({numel:,} parameters) in "
            f"{len(layout.buckets)} buckets, padded {padded:,}; torch {torch.__version__}, "
            f"transport {comm.transport}, {args.threads} thread(s) per rank; median of "
            f"{args.repeats} after {args.warmup} warm-up\n"
        )
        print("| operation | sent per rank | median ms (min–max) | GB/s | vs raw |")
        print("|---|---:|---:|---:|---:|")
        print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256.0, help="model size in MiB of float32")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--buckets", type=int, default=12, help="about this many buckets")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--transport", choices=TRANSPORTS, default=None,
                    help="TorchComm's transport (default: gloo's, shm where it works)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    args = ap.parse_args()
    if args.repeats < 5:
        ap.error("--repeats must be at least 5")
    # Inherited by the spawned workers before they import torch.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="fzero-bench-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(worker, args=(args.world_size, init_file, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
