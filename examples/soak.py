"""Soak: thousands of ZeRO-3 steps of the small GPT on 2 gloo ranks leak nothing, and train
bitwise like one torch process.

    python examples/soak.py                      # 2,000 steps, spawns 2 gloo ranks (~5 min)
    python examples/soak.py --steps 200          # what CI runs (tests/test_soak.py)
    torchrun --standalone --nproc-per-node 2 examples/soak.py

Every rank trains the GPT of examples/train_gpt.py (float32, AdamW, a constant learning rate)
with fzero stage 3 on its rows of a seeded stream of global batches. After the warm-up steps
(gloo's threads, fzero's channels and the allocator's pools all exist by then) each rank
records its resident set size, its threads (/proc/self/task) and its open file descriptors
(/proc/self/fd); at the end it records them again, and every `--sample-every` steps in between.
Then one process trains the same model on the same global batches with plain
torch.optim.AdamW, computing the gradient the way the ranks do (see `reference_losses`), and
the losses are compared step by step.

The checks, printed as a table (exit status 1 if any fails):

- RSS at the end, and at every sample after the warm-up, is within `--rss-growth` (1%) of RSS
  after the warm-up, on every rank (measured after `gc.collect()` and glibc's `malloc_trim`, so
  that memory the allocator merely caches does not count: it swings RSS by ~20% here);
- threads and open file descriptors at the end equal those after the warm-up, on every rank;
- every step's loss equals the reference's bitwise at 2 ranks (`--loss-rtol`, default 0; at 3
  or more ranks gloo sums in ring order and rounding differences grow through training, ~10x
  every 60 steps in this model, so pass a tolerance there).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor

import fzero
from fzero.memory import rss_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, GPTConfig, get_batch, load_corpus  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps before the first measurement (default: min(200, steps / 4))")
    ap.add_argument("--sample-every", type=int, default=50)
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn (without torchrun)")
    ap.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-growth", type=float, default=0.01)
    ap.add_argument("--loss-rtol", type=float, default=0.0, help="0: bitwise")
    ap.add_argument("--json", default=None, help="write the measurements here")
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = max(1, min(200, args.steps // 4))
    if not 0 < args.warmup < args.steps:
        ap.error("need 0 < --warmup < --steps")
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    if args.batch_size % world:
        ap.error(f"--batch-size {args.batch_size} must be a multiple of the {world} ranks (each "
                 f"keeps its 1/N of the global batch; the rest would train on no rank)")
    return args


try:  # glibc's malloc_trim: return free heap memory to the system before measuring
    LIBC = ctypes.CDLL("libc.so.6")
    LIBC.malloc_trim  # noqa: B018 (raises AttributeError on another C library)
except (OSError, AttributeError):
    LIBC = None


def loss_fn(call, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean next-byte cross-entropy in the model's own dtype."""
    x, y = batch  # (B, T) each
    return F.cross_entropy(call(x).flatten(0, 1), y.flatten())


def resources() -> dict[str, int]:
    """This process's RSS, threads and open file descriptors; RSS after a garbage collection
    and after glibc has handed its free memory back to the system, so only live memory counts."""
    gc.collect()
    if LIBC is not None:
        LIBC.malloc_trim(0)
    return {"rss": rss_bytes(), "threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd"))}


# -----------------------------------------------------------------------------
# One rank


def train_rank(args: argparse.Namespace) -> dict | None:
    """Train on this rank; rank 0 returns every rank's measurements."""
    torch.set_num_threads(1)  # two ranks share two cores
    dtype = getattr(torch, args.dtype)
    with fzero.distributed() as comm:
        data, _ = load_corpus(None)
        gen = torch.Generator().manual_seed(args.seed + 1)  # the same stream on every rank
        model = GPT(GPTConfig(seq_len=args.seq_len), seed=args.seed).to(dtype)
        optimizer = fzero.optim.adamw(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        state = fzero.init(model, stage=args.stage, optimizer=optimizer, comm=comm)
        step = fzero.make_train_step(model, loss_fn, decay=None)

        losses, samples, start = [], [], None
        t0 = time.perf_counter()
        for i in range(1, args.steps + 1):
            batch = get_batch(data, gen, args.batch_size, args.seq_len, comm.rank,
                              comm.world_size)
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            if i == args.warmup:
                start = resources()
                t0 = time.perf_counter()
            elif i > args.warmup and (i % args.sample_every == 0 or i == args.steps):
                samples.append({"step": i, **resources()})
            if comm.rank == 0 and (i % 100 == 0 or i == args.steps):
                print(f"step {i:>6}/{args.steps}  loss {losses[-1]:.4f}  "
                      f"rss {rss_bytes() / 2**20:,.1f} MiB", flush=True)
        mine = {"rank": comm.rank, "losses": losses, "start": start, "samples": samples,
                "seconds_per_step": (time.perf_counter() - t0) / (args.steps - args.warmup)}
        every = [None] * comm.world_size
        dist.all_gather_object(every, mine)
    return every if mine["rank"] == 0 else None


def spawned_rank(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = train_rank(args)
    if ranks is not None:
        with open(out, "w") as f:
            json.dump(ranks, f)


# -----------------------------------------------------------------------------
# The reference: one process, torch.optim.AdamW, the same global batches


def reference_losses(args: argparse.Namespace, world: int) -> list[float]:
    """The losses of plain torch.optim.AdamW on the same global batches.

    The gradient of the global batch's mean loss is computed as fzero's ranks compute it: the
    mean over the `world` row blocks of each block's mean-loss gradient, summed in block order
    and divided by `world` (gloo's average). Mathematically that is the global batch's
    gradient; with the same operations in the same order it is also the same bits at 2 ranks
    (at 3 or more gloo sums in ring order), so the comparison holds for any number of steps
    (rounding differences, however small, grow ~10x every 60 steps in this model).
    """
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    data, _ = load_corpus(None)
    gen = torch.Generator().manual_seed(args.seed + 1)
    model = GPT(GPTConfig(seq_len=args.seq_len), seed=args.seed).to(dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=True)
    losses = []
    for _ in range(args.steps):
        x, y = get_batch(data, gen, args.batch_size, args.seq_len, 0, 1)  # (B, T) each
        total, grads = 0.0, None
        for xs, ys in zip(x.chunk(world), y.chunk(world), strict=True):  # the ranks' rows
            loss = loss_fn(model, (xs, ys))
            block = torch.autograd.grad(loss, params)
            grads = block if grads is None else [g + b for g, b in zip(grads, block, strict=True)]
            total += loss.item()
        for p, g in zip(params, grads, strict=True):
            p.grad = g / world
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / world)
    return losses


# -----------------------------------------------------------------------------
# The checks


def report(args: argparse.Namespace, ranks: list[dict], reference: list[float]) -> dict:
    rows, ok = [], True
    for r in ranks:
        start, end = r["start"], r["samples"][-1]
        worst = max(s["rss"] for s in r["samples"])
        growth = end["rss"] / start["rss"] - 1
        worst_growth = worst / start["rss"] - 1
        same = (end["threads"], end["fds"]) == (start["threads"], start["fds"])
        passed = worst_growth <= args.rss_growth and same
        ok &= passed
        rows.append({"rank": r["rank"], "rss_start_mib": start["rss"] / 2**20,
                     "rss_end_mib": end["rss"] / 2**20, "rss_growth": growth,
                     "rss_worst_growth": worst_growth, "threads": [start["threads"],
                                                                   end["threads"]],
                     "fds": [start["fds"], end["fds"]], "ms_per_step":
                     r["seconds_per_step"] * 1e3, "passed": passed,
                     "rss_mib": [[s["step"], s["rss"] / 2**20] for s in r["samples"]]})
    losses = ranks[0]["losses"]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)]
    agree = all(r["losses"] == losses for r in ranks) and max(rel) <= args.loss_rtol
    ok &= agree and all(math.isfinite(x) for x in losses)
    print(f"\nsoak: {args.steps} steps ({args.warmup} warm-up), stage {args.stage}, "
          f"{len(ranks)} gloo ranks, {args.dtype}, global batch {args.batch_size} x "
          f"{args.seq_len}")
    print("| rank | RSS after warm-up | RSS at the end | growth (worst sample) | threads | "
          "open fds | ms/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['rank']} | {row['rss_start_mib']:,.1f} MiB | {row['rss_end_mib']:,.1f} "
              f"MiB | {row['rss_growth']:+.3%} ({row['rss_worst_growth']:+.3%}) | "
              f"{row['threads'][0]} -> {row['threads'][1]} | {row['fds'][0]} -> "
              f"{row['fds'][1]} | {row['ms_per_step']:.0f} |")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; reference {reference[0]:.4f} -> "
          f"{reference[-1]:.4f}; largest relative difference {max(rel):.2e} at step "
          f"{rel.index(max(rel)) + 1} (allowed {args.loss_rtol:g})")
    print("PASSED" if ok else "FAILED")
    return {"passed": ok, "ranks": rows, "loss_max_rel_diff": max(rel), "losses": losses,
            "reference": reference, "args": vars(args)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        ranks = train_rank(args)
        if ranks is None:
            return 0
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fzero-soak-{os.getpid()}.json")
        mp.spawn(spawned_rank, args=(args, port, out), nprocs=args.nproc)
        with open(out) as f:
            ranks = json.load(f)
        os.remove(out)
    result = report(args, ranks, reference_losses(args, len(ranks)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
