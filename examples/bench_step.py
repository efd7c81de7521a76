"""Step time and memory of data-parallel trainers side by side, on one model, in one run.

    python examples/bench_step.py --nproc 2 --size small                # every row, 2 rounds
    python examples/bench_step.py --nproc 2 --size 30m --rows ddp,fzero_1 --rounds 3
    python examples/bench_step.py --nproc 2 --size 30m --paired   # per-step ratios, one process set
    torchrun --standalone --nproc-per-node 2 examples/bench_step.py --size small   # the same

Rows: DDP + torch.optim.AdamW; DDP + ZeroRedundancyOptimizer(AdamW); FSDP2 (`fully_shard` per
block, then the root); fzero stages 1, 2, 3 (gloo's default pairwise transport), and again with
``TorchComm(transport="shm")`` on CPU (`fzero.shm`: same-host shared memory); DeepSpeed ZeRO 1,
2, 3 (when `deepspeed` is
installed: ``pip install -e ".[bench]"``; on CPU it runs with ``DS_ACCELERATOR=cpu``, which this
script sets). Every row trains the GPT of `train_gpt.py` with the same weights (`weight_init`,
GPT-2's init drawn module by module from one seed) on the same token batches, in fp32, with
AdamW(lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on the parameters with 2+ dims,
`fzero.decay_matrices`, none on biases and norms): torch rows use
torch.optim.AdamW with two parameter groups, fzero ``decay=fzero.decay_matrices``, DeepSpeed its
own ``"AdamW"`` optimizer (FusedAdam; on CPU a C++ op it compiles on first use) with the same
groups. So the last-step losses agree too.

Each row runs in a fresh set of ``nproc`` spawned processes (gloo on CPU, NCCL on CUDA), so a
row's peak RSS (the kernel's VmHWM high-water mark, reset at exec) is its own; a second column
gives the peak of the timed steps alone (reset after the warm-up), without init. Per step, the
ranks meet at a barrier and then time the step; a step's time is the slowest rank's. A row's
time in one round is the median over ``--steps`` timed steps after ``--warmup``; the rows run
``--rounds`` times, interleaved (every row, then every row again), and the table gives the
median of the round medians and their spread (min–max), so slow drifts of the machine hit every
row alike. Under torchrun only rank 0 drives; the others exit at once.

With ``--paired``, each round runs every row in *one* set of processes instead, one step of
each row in turn (who goes first rotates), and reports each row's median per-step ratio to DDP,
ZeroRedundancyOptimizer and FSDP2 (each step over the reference row's step of the same turn)
with its quartiles: on a machine whose speed drifts within seconds, neighbouring steps see the
same machine, so the ratios are steadier than ratios of separate runs. There are no memory
columns (the rows share the processes) and no DeepSpeed rows.

fzero's rows build the module on ``meta`` and let `fzero.init` materialize it one bucket at a
time (``init_fn=``, sharded init: no full copy of the weights beside the state; fzero calls the
module only as a function; the no-op comm rows for t_compute copy a materialized module
instead); the other trainers materialize the module and use its own tensors as their parameters
(FSDP2 shards them in place).

State bytes are the persistent model state a rank holds after a step: parameters, gradients
and optimizer state, each storage once (FSDP2 and ZeroRedundancyOptimizer: the local shards;
fzero: ``metrics["state_bytes"]``; DeepSpeed: the tensors its ZeRO optimizer holds: parameters
or their partitions, fp32 master partitions, moments, gradient partitions; its reduce buckets,
allocated at ``reduce_bucket_size`` and touched only in part, are scratch, not counted).

For each fzero row a second set of processes measures where the step's time goes, at the
same N, taking turns: a real step (t_step), the same step with `nocomm.NoComm` as its comm
(t_compute: collectives local and instant, so each rank still updates Ψ/N and runs the same
Python), and a replay on the real group of the exact collectives that step issued (t_comm: data
and control channels, alone). Then overlap = 1 - clamp(t_step - t_compute, 0, t_comm) / t_comm,
the share of t_comm hidden behind compute, in [0, 1], and contention = max(0, t_step -
t_compute - t_comm), what the step took beyond both apart (on a CPU, the transport's threads
compete with compute for the cores). Those processes hold two states, the real step's and the
no-op one's: where memory is tight (300M on 24 GiB), ``--no-overlap`` skips them.

The CPU column is the CPU time all of a row's processes used per timed step (every thread,
gloo's included): the work a trainer does, which other processes on the machine change far
less than its wall time. Every row also reports the machine's load: the 1-minute load average
when it started, and the cores used by *other* processes during its timed steps (all busy CPU
time from /proc/stat minus what the row's own processes used, over the wall time). On a shared
machine, ``--quiet CORES`` waits (up to ``--quiet-wait`` seconds) before each row until other
processes use fewer cores, and takes the median over the row's *quiet* rounds only (others below
CORES during its steps; the loaded rounds are shown in brackets), running the rows that have no
quiet round again, up to ``--max-rounds``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import json
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nocomm import NoComm, replay  # noqa: E402
from train_gpt import GPT, GPTConfig, loss_fn, num_params  # noqa: E402

import fzero  # noqa: E402

SIZES = {  # name: (model config, global batch in sequences)
    "tiny": (GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=32), 4),  # CI: runs at all
    # Ten blocks (124 parameters, as 30m) of width 32: compute near zero, so a step's time is
    # the trainer's own fixed cost per step (hooks, Python, collectives): what bounds a small
    # model on a GPU.
    "host": (GPTConfig(seq_len=16, n_layer=10, n_head=2, d_model=32), 4),
    "small": (GPTConfig(), 16),
    # Short sequences and small batches keep a CPU step to seconds: the comparison is about the
    # trainers' overheads, memory and communication, which scale with Ψ, not with tokens.
    "30m": (GPTConfig(seq_len=128, n_layer=10, n_head=8, d_model=512), 8),
    "300m": (GPTConfig(seq_len=64, n_layer=24, n_head=16, d_model=1024), 4),
}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1
SEED = 0  # of the weights (`weight_init`)
DECAY = fzero.decay_matrices  # every row: decay parameters with 2+ dims, not biases and norms
TORCH_ROWS = ("ddp", "ddp_zero", "fsdp2")
FZERO_ROWS = ("fzero_1", "fzero_2", "fzero_3")
SHM_ROWS = ("fzero_1_shm", "fzero_2_shm", "fzero_3_shm")  # TorchComm(transport="shm"): gloo
DEEPSPEED_ROWS = ("deepspeed_1", "deepspeed_2", "deepspeed_3")
COMPUTE = "/compute"  # suffix of the rows that measure an fzero row's t_compute and t_comm
LABELS = {
    "ddp": "DDP + AdamW",
    "ddp_zero": "DDP + ZeroRedundancyOptimizer",
    "fsdp2": "FSDP2 fully_shard",
    "fzero_1": "fzero stage 1",
    "fzero_2": "fzero stage 2",
    "fzero_3": "fzero stage 3",
    "fzero_1_shm": "fzero stage 1, shm",
    "fzero_2_shm": "fzero stage 2, shm",
    "fzero_3_shm": "fzero stage 3, shm",
    "deepspeed_1": "DeepSpeed ZeRO-1",
    "deepspeed_2": "DeepSpeed ZeRO-2",
    "deepspeed_3": "DeepSpeed ZeRO-3",
}
CAPPED = "@"  # an fzero row with its own bucket cap: ``fzero_1@6553600`` (elements)


def base_row(row: str) -> str:
    """The row without its bucket cap (``fzero_1@6553600`` -> ``fzero_1``)."""
    return row.partition(CAPPED)[0]


def label(row: str) -> str:
    """A row's name in the tables (with its bucket cap, if it has one)."""
    base, _, cap = row.partition(CAPPED)
    return LABELS[base] + (f" (buckets of {int(cap):,})" if cap else "")


# -----------------------------------------------------------------------------
# Measurement helpers


def cpu_seconds() -> float:
    """CPU time this process used so far (all its threads: gloo's too), user + system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_busy_seconds() -> float | None:
    """CPU seconds every process on the machine has used (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores the machine keeps busy now, sampled over `seconds` (this driver sleeps meanwhile)."""
    before = machine_busy_seconds()
    time.sleep(seconds)
    after = machine_busy_seconds()
    return None if before is None or after is None else (after - before) / seconds


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a tensor (a DTensor's shard, a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and ties counted once; a
    DTensor by its local shard)."""
    return fzero.memory.storage_bytes(local(t) for t in tensors if t is not None)


def reachable_tensors(root, depth: int, skip: tuple[str, ...]) -> list[torch.Tensor]:
    """Tensors reachable from `root` through containers and the attributes of DeepSpeed and
    torch.optim objects (not modules: their parameters are listed apart), `depth` levels deep,
    except attributes whose name contains one of `skip`."""
    found, seen = [], set()

    def visit(obj, level: int) -> None:
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            return
        if level == 0 or id(obj) in seen or isinstance(obj, nn.Module):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, list | tuple):
            children = list(obj)
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim")):
            children = [v for k, v in vars(obj).items() if not any(s in k for s in skip)]
        else:
            return
        for child in children:
            visit(child, level - 1)

    visit(root, depth)
    return found


def decay_groups(model: nn.Module) -> list[dict]:
    """AdamW parameter groups by `DECAY`, the rule fzero's rows pass as ``decay=``."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if DECAY(n, tuple(p.shape))],
         "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in named if not DECAY(n, tuple(p.shape))], "weight_decay": 0.0},
    ]


def weight_init(model: nn.Module):
    """``init(module)``: GPT-2 init of one module's *own* parameters (N(0, 0.02) matrices, the
    residual projections' scaled by 1/sqrt(2 * n_layer); LayerNorm weights 1, biases 0), each
    parameter once (a tied one by its first owner). Called on every module in
    ``model.modules()`` order after ``torch.manual_seed(SEED)``, it gives a materialized model
    the values that ``fzero.init(meta_model, init_fn=init)`` gives its state, bucket by bucket."""
    scaled = 0.02 / (2 * len(model.blocks)) ** 0.5
    for name, module in model.named_modules():  # an attribute: fzero passes init a copy
        if name.endswith("proj"):
            module.init_std = scaled

    def init(module: nn.Module) -> None:
        with torch.no_grad():
            for name, p in module.named_parameters(recurse=False):
                if p.dim() >= 2:
                    nn.init.normal_(p, std=getattr(module, "init_std", 0.02))
                elif name == "weight":
                    nn.init.ones_(p)
                else:
                    nn.init.zeros_(p)

    return init


def materialized(cfg: GPTConfig, device) -> nn.Module:
    """The GPT, materialized on `device`, with `weight_init`'s values."""
    model = GPT(cfg, seed=0).to(device)
    init = weight_init(model)
    seen: set[int] = set()
    torch.manual_seed(SEED)
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        if own:
            seen.update(id(p) for p in own)
            init(module)
    return model


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
    groups = decay_groups(model)
    if zero:
        opt = ZeroRedundancyOptimizer(
            groups[0]["params"], optimizer_class=torch.optim.AdamW, lr=LR, betas=BETAS,
            eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True,
        )
        opt.add_param_group(groups[1])
        local_opt = opt.optim
    else:
        opt = local_opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=True)

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
    opt = torch.optim.AdamW(decay_groups(model), lr=LR, betas=BETAS, eps=EPS, foreach=True)

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


def build_fzero(model: nn.Module, stage: int, comm, buckets: int | None):
    """From a `meta` model, fzero materializes the weights one bucket at a time (`init_fn`), so
    no full copy of them ever exists beside the state. From a materialized one (the no-op comm
    rows: init's broadcast from rank 0 does nothing there) it copies them, and the module then
    moves to `meta` to drop its own 4Ψ bytes."""
    optimizer = fzero.optim.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    on_meta = next(model.parameters()).is_meta
    torch.manual_seed(SEED)
    state = fzero.init(
        model, stage=stage, optimizer=optimizer, comm=comm, param_dtype=torch.float32,
        buckets=buckets, init_fn=weight_init(model) if on_meta else None,
    )
    model.to("meta")
    train_step = fzero.make_train_step(model, loss_fn, decay=DECAY)
    box = {"state": state, "metrics": {}}

    def step(batch):
        box["state"], box["metrics"] = train_step(box["state"], batch)
        return torch.as_tensor(box["metrics"]["loss"])

    return step, lambda: int(box["metrics"]["state_bytes"])


def build_deepspeed(model: nn.Module, stage: int, micro_batch: int):
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {  # DeepSpeed's own AdamW (FusedAdam), the groups' decay as the others'
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "zero_optimization": {"stage": stage},  # DeepSpeed's defaults otherwise; fp32
        "steps_per_print": 10**9,
    }
    engine, optimizer, *_ = deepspeed.initialize(
        model=model, model_parameters=decay_groups(model), config=config
    )

    def step(batch):
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def state_bytes():
        params = list(model.parameters())
        owned = [getattr(p, "ds_tensor", p) for p in params] + [p.grad for p in params]
        return storage_bytes(owned + reachable_tensors(optimizer, 6, skip=("ipg",)))

    return step, state_bytes


# -----------------------------------------------------------------------------
# One rank of one row


def worker(rank: int, spec: dict) -> None:
    """One rank of one row: train, time, measure, write ``{rdzv}.{rank}.json``."""
    world = spec["world"]
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(spec.get("threads") or max(1, cpus // world))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=f"file://{spec['rdzv']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=spec["timeout"]),
        device_id=device if use_cuda else None,  # NCCL: this rank's GPU, not guessed from rank
    )
    try:
        run = run_paired if spec.get("paired") else run_rank
        result = run(rank, spec, device, use_cuda)
        with open(f"{spec['rdzv']}.{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        # Free the trainers' reference cycles now: FSDP2's and DCP's reach process-group
        # state, and freed during interpreter exit they abort gloo (1 run in 3 of DCP's rows).
        gc.collect()
        dist.destroy_process_group()


def model_and_batch(spec: dict) -> tuple[GPTConfig, int]:
    """The row's model config and global batch (in sequences): the size's, or ``spec["batch"]``."""
    cfg, batch = SIZES[spec["size"]]
    return cfg, spec.get("batch") or batch


def build_row(row: str, spec: dict, device: torch.device, rank: int):
    """Row `row`'s trainer on this rank: ``(step, state_bytes, nocomm)`` (`nocomm`: the no-op
    comm of a t_compute row, else None)."""
    cfg, batch = model_and_batch(spec)
    world = spec["world"]
    compute = row.endswith(COMPUTE)  # a t_compute row: the same step, no-op communication
    row, _, cap = row.removesuffix(COMPUTE).partition(CAPPED)
    buckets = int(cap) if cap else spec.get("buckets")
    if row.startswith("fzero_") and not compute:
        with torch.device("meta"):
            model = GPT(cfg, seed=0)
    else:
        model = materialized(cfg, device)
    nocomm = None
    if row in ("ddp", "ddp_zero"):
        step, state_bytes = build_ddp(model, device, zero=row == "ddp_zero")
    elif row == "fsdp2":
        step, state_bytes = build_fsdp2(model, device, world)
    elif row.startswith("fzero_"):
        stage = int(row[len("fzero_")])
        if compute:
            comm = nocomm = NoComm(rank, world, device=device)
        else:
            comm = fzero.TorchComm(transport="shm" if row in SHM_ROWS else None)
        step, state_bytes = build_fzero(model, stage, comm, buckets)
    else:
        step, state_bytes = build_deepspeed(model, int(row[-1]), batch // world)
    return step, state_bytes, nocomm


def run_paired(rank: int, spec: dict, device: torch.device, use_cuda: bool) -> dict:
    """Every row of ``spec["paired"]`` in these processes, one step of each in turn (who goes
    first rotates), so that neighbouring steps of two rows see the same machine: per row, the
    step times (index i of every row is the same turn) and the last loss."""
    rows, world = spec["paired"], spec["world"]
    cfg, batch = model_and_batch(spec)
    nn.init.normal_(torch.empty(1, device="meta"))  # as run_rank: the same imports up front
    steps = {row: build_row(row, spec, device, rank)[0] for row in rows}
    batches = make_batches(cfg, batch, spec["warmup"] + spec["steps"], rank, world, device)
    times: dict[str, list[float]] = {row: [] for row in rows}
    losses: dict[str, float] = {}
    for i, b in enumerate(batches):
        for row in rows[i % len(rows):] + rows[: i % len(rows)]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = steps[row](b)
            if use_cuda:
                torch.cuda.synchronize()
            if i >= spec["warmup"]:
                times[row].append(time.perf_counter() - t0)
            losses[row] = float(loss)
    last = torch.tensor([losses[row] for row in rows], dtype=torch.float64, device=device)
    dist.all_reduce(last)  # per row, the global batch's mean loss
    return {"paired": {row: {"times": times[row], "loss": last[k].item() / world}
                       for k, row in enumerate(rows)}}


def run_rank(rank: int, spec: dict, device: torch.device, use_cuda: bool) -> dict:
    """One row's steps in these processes: per-step times, peak RSS, CPU time, state bytes.
    A t_compute row (``fzero_k/compute``) times three things in turn instead (`_overlap_turns`)."""
    row, world, steps, warmup = spec["row"], spec["world"], spec["steps"], spec["warmup"]
    cfg, batch = model_and_batch(spec)
    # The first random init on the meta device imports ~830 modules of torch (+70 MiB): every
    # row pays it up front, so the rows that build on meta (fzero's) are not charged alone.
    nn.init.normal_(torch.empty(1, device="meta"))
    rss_before = fzero.memory.rss_bytes() / 2**20
    step, state_bytes, nocomm = build_row(row, spec, device, rank)
    batches = make_batches(cfg, batch, warmup + steps, rank, world, device)
    turn = (_overlap_turns(step, nocomm, build_row(row.removesuffix(COMPUTE), spec, device,
                                                   rank)[0], use_cuda)
            if nocomm is not None else None)
    profile = cProfile.Profile() if spec["profile"] and rank == 0 else None
    times, losses, parts = [], [], []
    for i, b in enumerate(batches):
        if i == warmup:
            # The peak so far (init, warm-up) is kept; the timed steps get a peak of their own.
            peak_before_steps = fzero.memory.peak_rss_bytes()
            fzero.memory.reset_peak_rss()
            cpu0, busy0, wall0 = cpu_seconds(), machine_busy_seconds(), time.perf_counter()
            if profile is not None:
                profile.enable()
        if turn is not None:
            loss, seconds = turn(i, b)
            parts.append(seconds)
        else:
            dist.barrier()
            t0 = time.perf_counter()
            loss = step(b)
            if use_cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        if i >= warmup:
            times.append(seconds if turn is None else seconds["step"])
        losses.append(float(loss))
    wall, cpu, busy1 = time.perf_counter() - wall0, cpu_seconds() - cpu0, machine_busy_seconds()
    if profile is not None:
        profile.disable()
        profile.dump_stats(os.path.join(spec["profile"], f"{row.replace('/', '.')}.prof"))
    last = torch.tensor([losses[-1]], dtype=torch.float64, device=device)  # NCCL: on the GPU
    dist.all_reduce(last)  # the global batch's mean loss: the mean of the ranks' means
    result = {
        "times": times,
        "loss": last.item() / world,
        "state_bytes": state_bytes(),
        "rss_before_mib": rss_before,
        "rss_peak_mib": max(peak_before_steps, fzero.memory.peak_rss_bytes()) / 2**20,
        "rss_steps_peak_mib": fzero.memory.peak_rss_bytes() / 2**20,
        "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if use_cuda else None,
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "machine_busy_seconds": None if busy0 is None or busy1 is None else busy1 - busy0,
    }
    if turn is not None:
        result["compute_times"] = [p["compute"] for p in parts[warmup:]]
        result["comm_times"] = [p["comm"] for p in parts[warmup:]]
        result["collectives"] = len(nocomm.log)
    return result


def _overlap_turns(compute, nocomm: NoComm, step, use_cuda: bool):
    """``turn(i, batch) -> (loss, {"step": s, "compute": s, "comm": s})``: one real step, the
    same step with the no-op comm (t_compute) and a replay of the collectives that step issued
    on a real comm (t_comm), in an order that rotates with `i`. Neighbouring parts see the same
    machine, so the split holds on a machine whose speed drifts (separate runs of one row
    differ by up to 60% here). The first turn's compute step runs first: it records the log."""
    real = fzero.TorchComm()  # the replay's own (its channels open in the first, warm-up turn)

    def run_compute(b):
        nocomm.log.clear()  # keeps this step's collectives
        return compute(b)

    def run_comm(b):
        return replay(real, list(nocomm.log))  # synchronizes the GPU itself

    def turn(i: int, b):
        parts = [("compute", run_compute), ("comm", run_comm), ("step", step)]
        parts = parts[i % 3:] + parts[: i % 3]
        seconds, loss = {}, None
        for name, fn in parts:
            dist.barrier()
            t0 = time.perf_counter()
            out = fn(b)
            if use_cuda:
                torch.cuda.synchronize()
            seconds[name] = time.perf_counter() - t0
            if name == "comm":
                seconds[name] = out  # the collectives alone, not the replay's buffers
            if name == "step":
                loss = out
        return loss, seconds

    return turn


# -----------------------------------------------------------------------------
# The driver


def spawn_ranks(row: str, args: argparse.Namespace, tmp: str, **extra) -> list[dict] | str:
    """Run `worker` for `row` in ``--nproc`` fresh processes: each rank's result, or the error."""
    rdzv = os.path.join(tmp, f"{row.replace('/', '.')}.{time.monotonic_ns()}")
    spec = dict(row=row, size=args.size, world=args.nproc, steps=args.steps,
                warmup=args.warmup, rdzv=rdzv, timeout=args.timeout, profile=args.profile,
                batch=getattr(args, "batch", None), threads=getattr(args, "threads", None),
                buckets=getattr(args, "buckets", None), **extra)
    try:
        mp.spawn(worker, args=(spec,), nprocs=args.nproc, join=True)
    except Exception as e:  # a failed row is reported, the others still run
        msg = [line for line in str(e).strip().splitlines() if line.strip()]
        return msg[-1] if msg else type(e).__name__
    ranks = []
    for r in range(args.nproc):
        with open(f"{rdzv}.{r}.json") as f:
            ranks.append(json.load(f))
    return ranks


def run_row(row: str, args: argparse.Namespace, tmp: str) -> dict:
    """One row in fresh processes; its ranks' results, per-step times (the slowest rank's)."""
    ranks = spawn_ranks(row, args, tmp)
    if isinstance(ranks, str):
        return {"error": ranks}
    per_step = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)]  # slowest rank
    out = {"ranks": ranks, "per_step": per_step, "median": statistics.median(per_step)}
    out["cpu_per_step"] = sum(r["cpu_seconds"] for r in ranks) / len(per_step)
    busy = ranks[0]["machine_busy_seconds"]
    if busy is not None:  # cores other processes used while this row's steps ran
        wall = max(r["wall_seconds"] for r in ranks)
        out["others_cores"] = max(0.0, (busy - sum(r["cpu_seconds"] for r in ranks)) / wall)
    for part in ("compute", "comm"):  # a t_compute row's other parts, the slowest rank's
        if f"{part}_times" in ranks[0]:
            slowest = [max(ts) for ts in zip(*(r[f"{part}_times"] for r in ranks), strict=True)]
            out[f"{part}_median"] = statistics.median(slowest)
    return out


def run_paired_rounds(rows: list[str], args: argparse.Namespace, tmp: str) -> dict:
    """``--paired``: every round, all `rows` in one fresh set of processes, a step of each in
    turn. Per row: every step's time (the slowest rank's), the ratio of each step to the
    neighbouring step of every other row, and the last loss."""
    times: dict[str, list[float]] = {row: [] for row in rows}
    losses: dict[str, float] = {}
    for rnd in range(args.rounds):
        t0 = time.perf_counter()
        ranks = spawn_ranks("paired", args, tmp, paired=rows)
        if isinstance(ranks, str):
            raise SystemExit(f"paired round {rnd + 1} failed: {ranks}")
        for row in rows:
            per_rank = [r["paired"][row]["times"] for r in ranks]
            times[row] += [max(ts) for ts in zip(*per_rank, strict=True)]
            losses[row] = ranks[0]["paired"][row]["loss"]
        print(f"  round {rnd + 1}: " + ", ".join(
            f"{label(row)} {fmt_ms(statistics.median(times[row][-args.steps:]))} ms"
            for row in rows) + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"times": times, "losses": losses}


def print_paired(rows: list[str], paired: dict) -> None:
    """The ``--paired`` table: median step times, and each row's median per-step ratio to the
    reference rows (with the quartiles of those ratios)."""
    times, bases = paired["times"], [b for b in ("ddp", "ddp_zero", "fsdp2") if b in rows]

    def ratio(row: str, base: str) -> str:
        if row == base:
            return "1.00"
        q1, q2, q3 = statistics.quantiles(  # inclusive: within the ratios, never beyond
            [t / u for t, u in zip(times[row], times[base], strict=True)], n=4,
            method="inclusive")
        return f"{q2:.2f} ({q1:.2f}–{q3:.2f})"

    heads = {"ddp": "vs DDP", "ddp_zero": "vs ZeRO-opt", "fsdp2": "vs FSDP2"}
    print("\n| trainer | step ms (median) | " + " | ".join(
        f"{heads[b]}: median per-step ratio (quartiles)" for b in bases) + " | last loss |")
    print("|---|---:|" + "---:|" * len(bases) + "---:|")
    for row in rows:
        print(f"| {label(row)} | {fmt_ms(statistics.median(times[row]))} | "
              + " | ".join(ratio(row, b) for b in bases)
              + f" | {paired['losses'][row]:.4f} |")
    print(f"Each step of a row is divided by the step of the reference row in the same turn "
          f"({len(times[rows[0]])} turns); every turn runs one step of every row in these "
          f"processes, so a slow spell of the machine hits both sides of a ratio.")


def wait_until_quiet(args: argparse.Namespace) -> float | None:
    """Wait (at most --quiet-wait s) until other processes use < --quiet cores; return the
    cores they used at the last sample."""
    deadline = time.monotonic() + args.quiet_wait
    while True:
        cores = busy_cores()
        if args.quiet is None or cores is None or cores < args.quiet:
            return cores
        if time.monotonic() > deadline:
            print(f"  (still {cores:.2f} cores busy after {args.quiet_wait:.0f} s: measuring "
                  f"anyway)", flush=True)
            return cores
        time.sleep(5)


def fmt_mib(values) -> str:
    """MiB per rank: one number when the ranks agree, else each rank's."""
    digits = 0 if max(abs(v) for v in values) >= 100 else 1
    shown = [f"{v:,.{digits}f}" for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.0995 else f"{seconds * 1e3:,.1f}"


def is_quiet(result: dict, quiet: float | None) -> bool:
    """Whether other processes used fewer than `quiet` cores during the row's timed steps."""
    return "ranks" in result and (quiet is None or result.get("others_cores", 0.0) < quiet)


def summarize(rounds: list[dict], quiet: float | None) -> dict:
    """A row over its rounds: median of the (quiet) round medians, worst peak RSS."""
    done = [r for r in rounds if "ranks" in r]
    if not done:
        return {"error": next((r["error"] for r in rounds if "error" in r), "did not run")}
    used = [r for r in done if is_quiet(r, quiet)] or done
    nranks = len(done[0]["ranks"])
    out = {
        "median": statistics.median(r["median"] for r in used),
        "medians": [(r["median"], r in used) for r in done],
        "cpu": statistics.median(r["cpu_per_step"] for r in used),
        "peak": [max(r["ranks"][k]["rss_peak_mib"] for r in done) for k in range(nranks)],
        "delta": [max(r["ranks"][k]["rss_peak_mib"] - r["ranks"][k]["rss_before_mib"]
                      for r in done) for k in range(nranks)],
        "steps_peak": [max(r["ranks"][k]["rss_steps_peak_mib"] for r in done)
                       for k in range(nranks)],
        "state": [done[-1]["ranks"][k]["state_bytes"] / 2**20 for k in range(nranks)],
        "loss": done[-1]["ranks"][0]["loss"],
        "others": [r["others_cores"] for r in done if "others_cores" in r],
        "load": [r["load"] for r in done if r.get("load") is not None],
        "cuda": [r["ranks"][0]["cuda_peak_mib"] for r in done],
        "failed_rounds": len(rounds) - len(done),
    }
    if "comm_median" in done[0]:
        out["compute"] = statistics.median(r["compute_median"] for r in used)
        out["comm"] = statistics.median(r["comm_median"] for r in used)
        out["collectives"] = done[0]["ranks"][0]["collectives"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="small")
    ap.add_argument("--nproc", type=int, default=None, help="ranks per row (default: torchrun's)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row and round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="times every row runs, interleaved")
    ap.add_argument("--max-rounds", type=int, default=None,
                    help="with --quiet: run rows without a quiet round again, up to this many")
    ap.add_argument("--rows", default=None,
                    help="comma-separated subset, e.g. ddp,fsdp2; an fzero row may take its own "
                         "bucket cap in elements (fzero_1@6553600) beside the default's")
    ap.add_argument("--no-overlap", action="store_true", help="skip fzero's t_compute/t_comm")
    ap.add_argument("--quiet", type=float, default=None, metavar="CORES",
                    help="before each row, wait until other processes use fewer cores")
    ap.add_argument("--quiet-wait", type=float, default=900.0, help="seconds to wait at most")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="write a cProfile of rank 0's timed steps per row to DIR")
    ap.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    ap.add_argument("--paired", action="store_true",
                    help="run the rows in one set of processes, one step of each in turn, and "
                         "report per-step ratios (no memory columns; no DeepSpeed rows)")
    ap.add_argument("--buckets", type=int, default=None, metavar="ELEMENTS",
                    help="fzero rows: buckets=ELEMENTS (size-capped buckets) instead of the "
                         "default policy (fzero.state.default_buckets: one bucket per block, "
                         "small blocks merged; stages 0-2 on CUDA buckets of at most 2**26)")
    args = ap.parse_args()
    if int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun, rank 0 drives every row's fresh processes
    args.nproc = args.nproc or int(os.environ.get("WORLD_SIZE", "2"))
    cfg, batch = SIZES[args.size]
    if batch % args.nproc:
        raise SystemExit(
            f"global batch {batch} of --size {args.size} not divisible by {args.nproc}"
        )
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit("--rounds and --steps must be at least 1")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the workers

    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    rows = list(TORCH_ROWS) + list(FZERO_ROWS) + list(SHM_ROWS) + list(DEEPSPEED_ROWS)
    if args.rows:
        wanted = args.rows.split(",")
        unknown = sorted({base_row(r) for r in wanted} - set(LABELS))
        capped = [r for r in wanted if CAPPED in r]
        bad = [r for r in capped if base_row(r) not in FZERO_ROWS + SHM_ROWS
               or not r.partition(CAPPED)[2].isdigit() or int(r.partition(CAPPED)[2]) < 1]
        if unknown or bad:
            raise SystemExit(f"unknown --rows {unknown or bad}; choose from {sorted(LABELS)} "
                             f"(an fzero row may take a bucket cap: fzero_1{CAPPED}6553600)")
        rows = [r for r in rows if r in wanted] + capped
    skipped = {} if has_deepspeed else {
        r: "deepspeed is not installed (pip install -e '.[bench]')" for r in DEEPSPEED_ROWS}
    if torch.cuda.is_available():
        skipped.update({r: "the shared-memory transport is gloo's (CPU)" for r in rows
                        if base_row(r) in SHM_ROWS})
    runs = [r for r in rows if r not in skipped]
    if args.paired:
        runs = [r for r in runs if r not in DEEPSPEED_ROWS]
        if len(runs) < 2 or args.steps < 2:
            raise SystemExit("--paired needs two or more torch or fzero rows and --steps >= 2")
    elif not args.no_overlap:
        runs += [r + COMPUTE for r in rows if base_row(r) in FZERO_ROWS]

    psi = num_params(GPT(cfg))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    versions = f"torch {torch.__version__}"
    if has_deepspeed:
        from importlib.metadata import version

        versions += f", deepspeed {version('deepspeed')}"
    print(f"$ python {shlex.join(['examples/bench_step.py', *sys.argv[1:]])}")
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {versions}; {cpus} cores; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"GPT {cfg.n_layer} layers x d {cfg.d_model}, seq {cfg.seq_len}: Ψ = {psi:,} "
        f"({psi * 4 / 2**20:,.1f} MiB fp32); global batch {batch}; {args.nproc} ranks on {device}, "
        f"{max(1, cpus // args.nproc)} threads each; per round the median of {args.steps} steps "
        f"after {args.warmup} warm-up; {args.rounds} rounds, interleaved"
        + (f"; medians over the rounds in which other processes used < {args.quiet} cores "
           f"(up to {args.max_rounds or args.rounds} rounds)" if args.quiet is not None else "")
        + "\n"
    )

    if args.paired:
        with tempfile.TemporaryDirectory() as tmp:
            print_paired(runs, run_paired_rounds(runs, args, tmp))
        return
    per_round: dict[str, list[dict]] = {r: [] for r in runs}
    with tempfile.TemporaryDirectory() as tmp:
        rnd, todo = 0, runs
        while todo:
            for row in todo:
                others = wait_until_quiet(args) if args.quiet is not None else None
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                res = run_row(row, args, tmp)
                res["load"] = load
                per_round[row].append(res)
                name = label(row.removesuffix(COMPUTE)) + (" (compute)" if COMPUTE in row
                                                           else "")
                status = res.get("error") or f"{fmt_ms(res['median'])} ms"
                if "compute_median" in res:  # a t_compute row times three things in turn
                    status = (f"t_step {status}, t_compute {fmt_ms(res['compute_median'])} ms, "
                              f"t_comm {fmt_ms(res['comm_median'])} ms")
                quiet = f", others {others:.2f} cores before" if others is not None else ""
                if "others_cores" in res:
                    quiet += f", others {res['others_cores']:.2f} cores during"
                print(f"  round {rnd + 1}: {name:<38} {status}  ({time.perf_counter() - t0:.0f}"
                      f" s, load {load:.2f}{quiet})", flush=True)
            rnd += 1
            todo = runs if rnd < args.rounds else [
                row for row in runs
                if rnd < (args.max_rounds or args.rounds)
                and not any(is_quiet(r, args.quiet) for r in per_round[row])
            ]
    results = {row: summarize(per_round[row], args.quiet) for row in runs}
    results.update({row: {"error": why} for row, why in skipped.items() if row in rows})
    print_tables(rows, results, args, cfg, batch)
    failed = [row for row in rows if "error" in results[row] and row not in skipped]
    if failed:
        raise SystemExit(f"rows failed: {', '.join(failed)}")


def print_tables(rows, results, args, cfg, batch) -> None:
    def ratio(res, base):
        ok = base in results and "median" in results[base]
        return f"{res['median'] / results[base]['median']:.2f}" if ok else "-"

    print(
        "\n| trainer | step ms: median of rounds (each round's; [loaded]) | tokens/s | vs DDP "
        "| vs ZeRO-opt | vs FSDP2 | CPU ms/step, all ranks | state MiB/rank "
        "| peak RSS MiB/rank (Δ from start) | peak RSS in timed steps | last loss "
        "| load 1 min / others' cores |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    tokens = batch * cfg.seq_len
    for row in rows:
        res = results[row]
        if "error" in res:
            print(f"| {label(row)} | not run: {res['error']} | | | | | | | | | | |")
            continue
        state = "-" if min(res["state"]) < 0 else fmt_mib(res["state"])
        rounds = ", ".join(fmt_ms(m) if used else f"[{fmt_ms(m)}]" for m, used in res["medians"])
        failed = f"; {res['failed_rounds']} round(s) failed" if res["failed_rounds"] else ""
        load = "/".join(f"{x:.1f}" for x in res["load"])
        others = "/".join(f"{x:.2f}" for x in res["others"]) or "-"
        print(
            f"| {label(row)} | {fmt_ms(res['median'])} ({rounds}{failed}) "
            f"| {tokens / res['median']:,.0f} | {ratio(res, 'ddp')} | {ratio(res, 'ddp_zero')} "
            f"| {ratio(res, 'fsdp2')} | {fmt_ms(res['cpu'])} | {state} | {fmt_mib(res['peak'])} "
            f"({fmt_mib(res['delta'])}) | {fmt_mib(res['steps_peak'])} | {res['loss']:.4f} "
            f"| {load} / {others} |"
        )
    cuda = [(row, results[row]) for row in rows if any(results[row].get("cuda") or [])]
    if cuda:
        print("\nCUDA peak allocated MiB (rank 0, worst round): " + ", ".join(
            f"{label(row)} {max(res['cuda']):,.0f}" for row, res in cuda))

    overlaps = [(row, results[row + COMPUTE]) for row in rows
                if base_row(row) in FZERO_ROWS and "comm" in results.get(row + COMPUTE, {})]
    if overlaps:
        print("\n| trainer | t_step ms | t_compute ms (no-op comm, same N) "
              "| t_comm ms (its collectives alone) | collectives per step | overlap "
              "| contention ms |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for row, parts in overlaps:
            t_step, t_compute, t_comm = parts["median"], parts["compute"], parts["comm"]
            hidden, contention = split_step(t_step, t_compute, t_comm)
            print(f"| {label(row)} | {fmt_ms(t_step)} | {fmt_ms(t_compute)} | {fmt_ms(t_comm)} "
                  f"| {parts['collectives']} | {hidden:.2f} | {fmt_ms(contention)} |")
        print("All three from the same processes, a step of each in turn (median of the turns; "
              "t_step here is the row's step in those processes). overlap = the share of "
              "t_comm hidden behind compute: 1 - clamp(t_step - t_compute, 0, t_comm) / t_comm. "
              "contention = what the step took beyond t_compute + t_comm (compute and the "
              "transport's threads on the same cores), 0 when none.")


def split_step(t_step: float, t_compute: float, t_comm: float) -> tuple[float, float]:
    """``(overlap, contention)`` of a step that took `t_step` where its compute alone takes
    `t_compute` and its communication alone `t_comm`: the share of t_comm hidden behind compute,
    in [0, 1], and the seconds beyond t_compute + t_comm (>= 0)."""
    exposed = t_step - t_compute  # what communication added to the step
    overlap = 1.0 - min(max(exposed, 0.0), t_comm) / t_comm if t_comm > 0 else 1.0
    return overlap, max(0.0, exposed - t_comm)


if __name__ == "__main__":
    main()
