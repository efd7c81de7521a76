"""Checkpoint save and load time: fzero vs FSDP2 + torch.distributed.checkpoint, side by side.

    python examples/bench_checkpoint.py --size 30m      # also --size small, --size 300m

The GPT of `train_gpt.py` in fp32 with AdamW (parameters and two moments: 12 bytes per
parameter) is sharded over ``--nproc`` gloo ranks, by fzero at ZeRO stage 3 and by FSDP2
(`fully_shard` per block, then the root). For each, in fresh processes:

- save:    every rank writes its shards (``fzero.save`` / ``dcp.save``; both fsync);
- load:    the same ranks build a sharded state (from a ``meta`` model: no initial values) and
           read the checkpoint into it;
- reshard: the same load in one process, from the ``nproc``-rank checkpoint (N -> 1).

Times are the slowest rank's, between barriers; GB/s is the state's bytes (all ranks) over the
time. Each load is checked: the sum of every loaded value equals the saved one. Disk bytes are
the checkpoint directory's. Loads read files the save has just written, so the page cache is
warm for both (dropping it needs root). With ``--repeat R`` the frameworks take turns R times
and the table gives medians: on a virtual disk, writing to blocks the filesystem has not used
before is several times slower than rewriting freed ones, which favours whoever runs second.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, GPTConfig, num_params  # noqa: E402

import fzero  # noqa: E402

SIZES = {  # the models of bench_step.py (which imports DeepSpeed when it can: not here)
    "small": GPTConfig(),
    "30m": GPTConfig(seq_len=128, n_layer=10, n_head=8, d_model=512),
    "300m": GPTConfig(seq_len=64, n_layer=24, n_head=16, d_model=1024),
}
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.1
FRAMEWORKS = {"fzero": "fzero stage 3", "dcp": "FSDP2 + DCP"}


# -----------------------------------------------------------------------------
# fzero: a stage-3 state; save; load into a `meta` skeleton


def fzero_state(cfg, comm):
    model = GPT(cfg, seed=0)
    optimizer = fzero.optim.adamw(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return fzero.init(model, stage=3, optimizer=optimizer, comm=comm)  # the model is not kept


def fzero_sum(state) -> float:
    tensors = list(state.params) + [m for v in state.moments.values() for m in v]
    return sum(float(t.detach().double().sum()) for t in tensors)


def fzero_task(task: str, cfg, path: str, comm) -> dict:
    out = {}
    if task == "save_load":
        state = fzero_state(cfg, comm)
        out["check_saved"] = fzero_sum(state)
        out["save"] = timed(lambda: fzero.save(state, path))
        del state
    box = {}

    def load():
        with torch.device("meta"):
            skeleton = GPT(cfg, seed=0)  # a function only: no memory
        box["state"] = fzero.load(path, model=skeleton, comm=comm)

    out["load"] = timed(load)
    out["check_loaded"] = fzero_sum(box["state"])
    return out


# -----------------------------------------------------------------------------
# FSDP2 + torch.distributed.checkpoint (DCP)


def dcp_state(cfg, world: int, *, meta: bool = False):
    """A sharded model and optimizer (state created), and the state dict DCP saves or loads;
    `meta`: allocated without initial values (the way to build a state that a load fills)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta" if meta else "cpu"):
        model = GPT(cfg, seed=0)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                            foreach=True)
    model_sd, optim_sd = get_state_dict(model, opt)  # creates the (lazy) optimizer state
    return model, opt, {"model": model_sd, "optim": optim_sd}


def dcp_sum(model, opt) -> float:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(t) for s in opt.state.values() for t in s.values() if t.dim() > 0]
    return sum(float(t.detach().double().sum()) for t in tensors)


def dcp_task(task: str, cfg, path: str, world: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    out = {}
    if task == "save_load":
        model, opt, state = dcp_state(cfg, world)
        out["check_saved"] = dcp_sum(model, opt)
        out["save"] = timed(lambda: dcp.save(state, checkpoint_id=path))
        del model, opt, state
    box = {}

    def load():  # as fzero.load: build the sharded state, then read the checkpoint into it
        model, opt, state = dcp_state(cfg, world, meta=True)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        box.update(model=model, opt=opt)

    out["load"] = timed(load)
    out["check_loaded"] = dcp_sum(box["model"], box["opt"])
    return out


# -----------------------------------------------------------------------------
# Processes


def timed(fn) -> float:
    """Seconds from a barrier to the slowest rank's end of `fn()`."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def worker(rank: int, world: int, framework: str, task: str, size: str, path: str, rdzv: str):
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, cpus // world))
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        cfg = SIZES[size]
        with torch.device("meta"):  # the first meta-device model imports a second of modules
            GPT(cfg)
        if framework == "fzero":
            out = fzero_task(task, cfg, path, fzero.TorchComm())
        else:
            out = dcp_task(task, cfg, path, world)
        for key in ("check_saved", "check_loaded"):  # sums over all ranks
            if key in out:
                total = torch.tensor([out[key]], dtype=torch.float64)
                dist.all_reduce(total)
                out[key] = total.item()
        if rank == 0:
            with open(rdzv + ".json", "w") as f:
                json.dump(out, f)
    finally:
        # Free the trainers' reference cycles now: FSDP2's and DCP's reach process-group
        # state, and freed during interpreter exit they abort gloo (1 run in 3 of DCP's rows).
        gc.collect()
        dist.destroy_process_group()


def run(world: int, framework: str, task: str, size: str, path: str, tmp: str) -> dict:
    rdzv = tempfile.mktemp(prefix=f"{framework}-{task}-", dir=tmp)  # a file store used once
    mp.spawn(worker, args=(world, framework, task, size, path, rdzv), nprocs=world, join=True)
    with open(rdzv + ".json") as f:
        return json.load(f)


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--nproc", type=int, default=2, help="ranks that save (and load)")
    ap.add_argument("--frameworks", default="fzero,dcp", help="comma-separated subset")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=1, help="turns per framework (medians)")
    args = ap.parse_args(argv)
    frameworks = args.frameworks.split(",")
    cfg = SIZES[args.size]
    psi = num_params(GPT(cfg))
    state_bytes = 12 * psi  # fp32 parameters + AdamW's two moments
    print(f"GPT {cfg.n_layer} layers x d {cfg.d_model}: Ψ = {psi:,}; state {state_bytes / 1e9:.3f} "
          f"GB (fp32 params + 2 moments); save and load on {args.nproc} gloo ranks, reshard "
          f"load on 1\n")
    turns: dict[str, list[dict]] = {framework: [] for framework in frameworks}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for turn in range(args.repeat):
            for framework in frameworks:
                path = os.path.join(tmp, f"ckpt-{framework}")
                t0 = time.perf_counter()
                first = run(args.nproc, framework, "save_load", args.size, path, tmp)
                again = run(1, framework, "reshard", args.size, path, tmp)
                for result in (first, again):
                    if abs(result["check_loaded"] - first["check_saved"]) > 1e-6 * max(
                            1.0, abs(first["check_saved"])):
                        raise SystemExit(f"{framework}: loaded values differ from the saved "
                                         f"ones: {result['check_loaded']} vs "
                                         f"{first['check_saved']}")
                turns[framework].append({"save": first["save"], "load": first["load"],
                                         "reshard": again["load"], "disk": disk_bytes(path)})
                shutil.rmtree(path)
                print(f"  turn {turn + 1}: {FRAMEWORKS[framework]:<14} save {first['save']:.2f} s"
                      f", load {first['load']:.2f} s, reshard {again['load']:.2f} s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = {framework: {key: statistics.median(t[key] for t in runs) for key in runs[0]}
            for framework, runs in turns.items()}

    def cell(seconds: float) -> str:
        return f"{seconds:.2f} s ({state_bytes / seconds / 1e9:.2f} GB/s)"

    print(f"\nmedians of {args.repeat} turn(s)")
    print(f"| framework | save, {args.nproc} ranks | load, {args.nproc} ranks | resharded load, "
          f"{args.nproc} -> 1 | disk bytes | disk / state |")
    print("|---|---:|---:|---:|---:|---:|")
    for framework, row in rows.items():
        print(f"| {FRAMEWORKS[framework]} | {cell(row['save'])} | {cell(row['load'])} "
              f"| {cell(row['reshard'])} | {int(row['disk']):,} "
              f"| {row['disk'] / state_bytes:.3f} |")


if __name__ == "__main__":
    main()
