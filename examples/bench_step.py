"""Step time and memory of data-parallel trainers side by side, on one model, in one run.

    torchrun --standalone --nproc-per-node 2 examples/bench_step.py --size small
    python examples/bench_step.py --nproc 2 --size small          # the same, without torchrun

Rows: DDP + torch.optim.AdamW; DDP + ZeroRedundancyOptimizer(AdamW); FSDP2 (`fully_shard` per
block, then the root); fzero stages 1, 2, 3; DeepSpeed ZeRO 1, 2, 3 when `deepspeed` imports.
Every row trains the GPT of `train_gpt.py` from the same seed on the same token batches with the
same AdamW hyperparameters (weight decay on matrices only), so the last-step losses agree too.

Each row runs in a fresh set of ``nproc`` spawned processes (gloo on CPU, NCCL on CUDA), so a
row's peak RSS (the kernel's VmHWM high-water mark, reset at exec) is its own. Per step, the
ranks meet at a barrier and then time the step; a step's time is the slowest rank's, and the
table gives the median over ``--steps`` timed steps after ``--warmup`` (min–max). Under torchrun
only rank 0 drives; the others exit at once. State bytes are the persistent model state a rank
owns: parameters, gradients and optimizer state, each storage once (FSDP2 and ZeRO optimizer:
the local shards; fzero: ``metrics["state_bytes"]``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, GPTConfig, loss_fn, num_params  # noqa: E402

import fzero  # noqa: E402

try:
    import deepspeed
except ImportError:  # optional
    deepspeed = None

SIZES = {  # name: (model config, global batch in sequences)
    "small": (GPTConfig(), 16),
    # Short sequences and small batches keep a CPU step to seconds: the comparison is about the
    # trainers' overheads, memory and communication, which scale with Ψ, not with tokens.
    "30m": (GPTConfig(seq_len=128, n_layer=10, n_head=8, d_model=512), 8),
    "300m": (GPTConfig(seq_len=64, n_layer=24, n_head=16, d_model=1024), 4),
}
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.1
TORCH_ROWS = ("ddp", "ddp_zero", "fsdp2")
FZERO_ROWS = ("fzero_1", "fzero_2", "fzero_3")
DEEPSPEED_ROWS = ("deepspeed_1", "deepspeed_2", "deepspeed_3")
LABELS = {
    "ddp": "DDP + AdamW",
    "ddp_zero": "DDP + ZeroRedundancyOptimizer",
    "fsdp2": "FSDP2 fully_shard",
    "fzero_1": "fzero stage 1",
    "fzero_2": "fzero stage 2",
    "fzero_3": "fzero stage 3",
    "deepspeed_1": "DeepSpeed ZeRO-1",
    "deepspeed_2": "DeepSpeed ZeRO-2",
    "deepspeed_3": "DeepSpeed ZeRO-3",
}


# -----------------------------------------------------------------------------
# Measurement helpers (run inside the workers)


def rss_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since exec) from /proc, in MiB; ru_maxrss elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a tensor (a DTensor's shard, a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and ties counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            s = local(t).untyped_storage()
            seen[(s.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def decay_groups(params) -> list[dict]:
    """AdamW groups as fzero decays: matrices (dim >= 2) decayed, biases and norms not."""
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_batches(cfg: GPTConfig, batch: int, count: int, rank: int, world: int, device):
    """``count`` (x, y) pairs: this rank's rows of the same seeded global batches, (B/N, T)."""
    gen = torch.Generator().manual_seed(1234)
    per_rank = batch // world
    out = []
    for _ in range(count):
        tokens = torch.randint(cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
        mine = tokens[rank * per_rank : (rank + 1) * per_rank].to(device)  # (B/N, T + 1)
        out.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    return out


# -----------------------------------------------------------------------------
# One trainer per row: build(model) -> (step(batch) -> loss tensor, state_bytes() -> int)


def build_ddp(model: nn.Module, device, zero: bool):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, gradient_as_bucket_view=True)
    if zero:
        groups = decay_groups(model.parameters())
        opt = ZeroRedundancyOptimizer(
            groups[0]["params"],
            optimizer_class=torch.optim.AdamW,
            lr=LR,
            betas=BETAS,
            weight_decay=WEIGHT_DECAY,
            foreach=True,
        )
        opt.add_param_group(groups[1])
        local_opt = opt.optim
    else:
        opt = local_opt = torch.optim.AdamW(
            decay_groups(model.parameters()), lr=LR, betas=BETAS, foreach=True
        )

    def step(batch):
        opt.zero_grad(set_to_none=False)  # keep the bucket-view gradients: measured below
        loss = loss_fn(ddp, batch)
        loss.backward()
        opt.step()
        return loss.detach()

    def state_bytes():
        params = list(model.parameters())
        moments = [t for s in local_opt.state.values() for t in s.values()]
        return storage_bytes(params + [p.grad for p in params] + moments)

    return step, state_bytes


def build_fsdp2(model: nn.Module, device, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(decay_groups(model.parameters()), lr=LR, betas=BETAS, foreach=True)

    def step(batch):
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        return loss.detach()

    def state_bytes():
        params = list(model.parameters())
        moments = [t for s in opt.state.values() for t in s.values()]
        return storage_bytes(params + [p.grad for p in params] + moments)

    return step, state_bytes


def build_fzero(model: nn.Module, stage: int):
    comm = fzero.TorchComm()
    optimizer = fzero.optim.adamw(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    state = fzero.init(
        model, stage=stage, optimizer=optimizer, comm=comm, param_dtype=torch.float32
    )
    train_step = fzero.make_train_step(model, loss_fn)
    box = {"state": state, "metrics": {}}

    def step(batch):
        box["state"], box["metrics"] = train_step(box["state"], batch)
        return torch.as_tensor(box["metrics"]["loss"])

    return step, lambda: int(box["metrics"]["state_bytes"])


def build_deepspeed(model: nn.Module, stage: int, micro_batch: int):
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
    }
    opt = torch.optim.AdamW(decay_groups(model.parameters()), lr=LR, betas=BETAS, foreach=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(batch):
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, lambda: -1  # DeepSpeed keeps its partitions internally: not measured


def measure_overlap(cfg: GPTConfig, stage: int, batches, world: int, device) -> dict:
    """The step's two halves alone, on this rank, while the other ranks do the same.

    t_compute: the same fzero step on this rank's batches in a world of one (no communication).
    t_comm: the step's collectives alone on the real group: stage 3 all-gathers every bucket
    twice and reduce-scatters it once, stages 1-2 reduce-scatter and all-gather once each.
    """

    model = GPT(cfg, seed=0).to(device)

    def compute(comm):
        state = fzero.init(model, stage=stage, comm=comm, device=device,
                           optimizer=fzero.optim.adamw(lr=LR, betas=BETAS,
                                                       weight_decay=WEIGHT_DECAY))
        step = fzero.make_train_step(model, loss_fn)
        state, _ = step(state, batches[0])  # warm-up
        times = []
        for b in batches:
            dist.barrier()  # both ranks compute at once, as in the real step
            t0 = time.perf_counter()
            state, _ = step(state, b)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    t_compute = fzero.SimWorld(1, copy_args=False).run(compute)[0]
    comm = fzero.TorchComm()
    layout = fzero.plan(model, world)
    shards = [torch.zeros(b.shard_numel, device=device) for b in layout.buckets]
    gathers = 2 if stage == 3 else 1
    times = []
    for _ in range(len(batches) + 1):
        flats = [torch.zeros(b.padded_numel, device=device) for b in layout.buckets]
        dist.barrier()
        t0 = time.perf_counter()
        pending = [fzero.collect.reduce_scatter_bucket(comm, b, f)
                   for b, f in zip(layout.buckets, flats, strict=True)]
        for _ in range(gathers):
            pending += [fzero.collect.all_gather_bucket(comm, b, s)
                        for b, s in zip(layout.buckets, shards, strict=True)]
        for p in pending:
            p.wait()
        times.append(time.perf_counter() - t0)
    t_comm = statistics.median(times[1:])
    return {"compute": t_compute, "comm": t_comm}


def worker(rank: int, row: str, size: str, world: int, steps: int, warmup: int, rdzv: str):
    """One rank of one row: train, time, measure, write ``{rdzv}.{rank}.json``."""
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, cpus // world))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=f"file://{rdzv}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        cfg, batch = SIZES[size]
        rss_before = rss_mib("VmRSS")
        model = GPT(cfg, seed=0).to(device)
        if row in ("ddp", "ddp_zero"):
            step, state_bytes = build_ddp(model, device, zero=row == "ddp_zero")
        elif row == "fsdp2":
            step, state_bytes = build_fsdp2(model, device, world)
        elif row.startswith("fzero_"):
            step, state_bytes = build_fzero(model, stage=int(row[-1]))
        else:
            step, state_bytes = build_deepspeed(model, int(row[-1]), batch // world)
        batches = make_batches(cfg, batch, warmup + steps, rank, world, device)
        times, losses = [], []
        for i, b in enumerate(batches):
            dist.barrier()
            t0 = time.perf_counter()
            loss = step(b)
            if use_cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        last = torch.tensor([losses[-1]], dtype=torch.float64)
        dist.all_reduce(last)  # the global batch's mean loss: the mean of the ranks' means
        result = {
            "times": times,
            "loss": last.item() / world,
            "state_bytes": state_bytes(),
            "rss_before_mib": rss_before,
            "rss_peak_mib": rss_mib("VmHWM"),
            "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if use_cuda else None,
        }
        if row.startswith("fzero_"):  # after reading the peak RSS: it builds a second state
            del step, state_bytes  # ... so first free this row's (the closures hold it)
            gc.collect()
            result["overlap"] = measure_overlap(cfg, int(row[-1]), batches[warmup:], world,
                                                device)
        with open(f"{rdzv}.{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# The driver


def run_row(row: str, args: argparse.Namespace, tmp: str) -> dict:
    rdzv = os.path.join(tmp, row)
    try:
        mp.spawn(
            worker,
            args=(row, args.size, args.nproc, args.steps, args.warmup, rdzv),
            nprocs=args.nproc,
            join=True,
        )
    except Exception as e:  # a failed row is reported, the others still run
        msg = str(e).strip().splitlines()
        return {"error": msg[-1] if msg else type(e).__name__}
    ranks = []
    for r in range(args.nproc):
        with open(f"{rdzv}.{r}.json") as f:
            ranks.append(json.load(f))
    per_step = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)]  # slowest rank
    return {"ranks": ranks, "per_step": per_step, "median": statistics.median(per_step)}


def fmt_mib(values) -> str:
    values = [round(v) for v in values]
    return f"{values[0]:,}" if len(set(values)) == 1 else " / ".join(f"{v:,}" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--nproc", type=int, default=None, help="ranks per row (default: torchrun's)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row (>= 10)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", default=None, help="comma-separated subset, e.g. ddp,fsdp2")
    args = ap.parse_args()
    if int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun, rank 0 drives every row's fresh processes
    args.nproc = args.nproc or int(os.environ.get("WORLD_SIZE", "2"))
    cfg, batch = SIZES[args.size]
    if batch % args.nproc:
        raise SystemExit(
            f"global batch {batch} of --size {args.size} not divisible by {args.nproc}"
        )

    rows = list(TORCH_ROWS) + list(FZERO_ROWS) + (list(DEEPSPEED_ROWS) if deepspeed else [])
    if args.rows:
        wanted = args.rows.split(",")
        unknown = sorted(set(wanted) - set(LABELS))
        if unknown:
            raise SystemExit(f"unknown --rows {unknown}; choose from {sorted(LABELS)}")
        rows = [r for r in rows if r in wanted]
    skipped: dict[str, str] = {}
    if deepspeed is None:
        print("deepspeed is not importable: DeepSpeed rows skipped")

    psi = num_params(GPT(cfg))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"GPT {cfg.n_layer} layers x d {cfg.d_model}, seq {cfg.seq_len}: Ψ = {psi:,} "
        f"({psi * 4 / 2**20:,.1f} MiB fp32); global batch {batch}; {args.nproc} ranks on {device}, "
        f"{max(1, cpus // args.nproc)} threads each; median of {args.steps} steps after "
        f"{args.warmup} warm-up\n"
    )

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            if row in skipped:
                results[row] = {"error": skipped[row]}
                continue
            t0 = time.perf_counter()
            results[row] = run_row(row, args, tmp)
            status = results[row].get("error") or f"{results[row]['median'] * 1e3:.0f} ms"
            print(f"  {LABELS[row]:<32} {status}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    def ratio(res, base):
        ok = base in results and "median" in results[base]
        return f"{res['median'] / results[base]['median']:.2f}" if ok else "-"

    print(
        "\n| trainer | step ms, median (min–max) | tokens/s | vs DDP | vs FSDP2 "
        "| state MiB/rank | peak RSS MiB/rank (Δ from start) | last loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    tokens = batch * cfg.seq_len
    for row in rows:
        res = results[row]
        if "error" in res:
            print(f"| {LABELS[row]} | skipped: {res['error']} | | | | | | |")
            continue
        ranks = res["ranks"]
        state = [r["state_bytes"] / 2**20 for r in ranks]
        state_txt = "-" if min(state) < 0 else fmt_mib(state)
        peak = fmt_mib([r["rss_peak_mib"] for r in ranks])
        delta = fmt_mib([r["rss_peak_mib"] - r["rss_before_mib"] for r in ranks])
        print(
            f"| {LABELS[row]} | {res['median'] * 1e3:,.0f} ({min(res['per_step']) * 1e3:,.0f}–"
            f"{max(res['per_step']) * 1e3:,.0f}) | {tokens / res['median']:,.0f} "
            f"| {ratio(res, 'ddp')} | {ratio(res, 'fsdp2')} | {state_txt} | {peak} ({delta}) "
            f"| {ranks[0]['loss']:.4f} |"
        )
    if any(r["ranks"][0]["cuda_peak_mib"] for r in results.values() if "ranks" in r):
        print(
            "\nCUDA peak allocated MiB/rank: "
            + ", ".join(
                f"{LABELS[k]} {fmt_mib([r['cuda_peak_mib'] for r in v['ranks']])}"
                for k, v in results.items()
                if "ranks" in v
            )
        )
    overlaps = [(row, results[row]) for row in rows
                if "ranks" in results[row] and results[row]["ranks"][0].get("overlap")]
    if overlaps:
        print("\n| trainer | t_step ms | t_compute ms (world 1) | t_comm ms (collectives alone) "
              "| overlap |")
        print("|---|---:|---:|---:|---:|")
        for row, res in overlaps:
            parts = res["ranks"][0]["overlap"]
            t_step, t_compute, t_comm = res["median"], parts["compute"], parts["comm"]
            overlap = (t_compute + t_comm - t_step) / min(t_compute, t_comm)
            print(f"| {LABELS[row]} | {t_step * 1e3:,.0f} | {t_compute * 1e3:,.0f} "
                  f"| {t_comm * 1e3:,.0f} | {overlap:.2f} |")
        print("overlap = (t_compute + t_comm - t_step) / min(t_compute, t_comm): 1 is perfect, "
              "0 is none. t_compute is a world-1 step, whose optimizer updates all Ψ parameters "
              "instead of Ψ/N, so it overstates the N-rank step's compute and the overlap")
    failed = [row for row in rows if "error" in results[row] and row not in skipped]
    if failed:
        raise SystemExit(f"rows failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
