"""Train a model that plain data parallelism cannot hold, with ZeRO stage 3, on this machine.

    torchrun --standalone --nproc-per-node 2 examples/bench_scale.py            # ~1.0B params
    torchrun --standalone --nproc-per-node 2 examples/bench_scale.py --layers 2 # a quick check

DDP + AdamW in fp32 keeps 16 bytes per parameter on every rank (parameters 4, gradients 4, two
Adam moments 8): for the default 1.0B-parameter GPT that is 16 GB per rank, 32 GB for 2 ranks,
more than this 24 GiB machine has, so the script states the prediction and does not start DDP.
ZeRO stage 3 keeps 16 bytes / N per parameter: 8 GB per rank. The model is built on the
``meta`` device and materialized bucket by bucket (`fzero.init(..., init_fn=...)`), so the full
model never exists in one process; then a few steps train on one fixed batch, so the loss falls
fast. The closing table compares each rank's measured state bytes with the paper's formula and
reports the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, GPTConfig, loss_fn  # noqa: E402

import fzero  # noqa: E402

GIB = 2**30


def init_weights(module: nn.Module) -> None:
    """GPT-2 style init of a module's own parameters (called by fzero one module at a time)."""
    for name, p in module.named_parameters(recurse=False):
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
        elif name == "weight":
            nn.init.ones_(p)
        else:
            nn.init.zeros_(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)  # 1e-3 overshoots by step 3 at 1B
    args = ap.parse_args()
    torch.set_num_threads(1)

    with fzero.distributed() as comm:
        world, master = comm.world_size, comm.rank == 0
        cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.layers, d_model=args.d_model,
                        n_head=max(1, args.d_model // 128))
        with torch.device("meta"):
            model = GPT(cfg, seed=0)  # (a function only: no memory)
        psi = sum(p.numel() for p in model.parameters())
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        ddp_bytes = fzero.memory.estimate(psi, world, 0, k=8, param_bytes=4, grad_bytes=4)
        zero3_bytes = fzero.memory.estimate(psi, world, 3, k=8, param_bytes=4, grad_bytes=4)
        if master:
            print(f"model  GPT {cfg.n_layer} layers x d {cfg.d_model}: Ψ = {psi / 1e9:.2f}B "
                  f"parameters; {world} ranks on a machine with {total_memory / GIB:.1f} GiB")
            verdict = "does not fit: not started" if ddp_bytes * world > total_memory else "fits"
            print(f"DDP    + AdamW fp32 needs 16Ψ = {ddp_bytes / GIB:.1f} GiB per rank, "
                  f"{ddp_bytes * world / GIB:.1f} GiB in all: {verdict}")
            print(f"ZeRO-3 needs 16Ψ/N = {zero3_bytes / GIB:.1f} GiB per rank")

        t0 = time.perf_counter()
        torch.manual_seed(0)
        state = fzero.init(model, stage=3, comm=comm, optimizer=fzero.optim.adamw(lr=args.lr),
                           init_fn=init_weights)
        if master:
            print(f"init   sharded, bucket by bucket: {time.perf_counter() - t0:.1f} s, peak "
                  f"RSS {fzero.memory.peak_rss_bytes() / GIB:.2f} GiB on rank 0")
        step = fzero.make_train_step(model, loss_fn, clip_norm=1.0)
        gen = torch.Generator().manual_seed(comm.rank)
        x = torch.randint(0, cfg.vocab_size, (1, args.seq_len + 1), generator=gen)
        batch = (x[:, :-1], x[:, 1:])  # one fixed batch per rank: the loss must fall
        for i in range(1, args.steps + 1):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            if master:
                print(f"step   {i}/{args.steps}: loss {metrics['loss']:.4f}, "
                      f"{time.perf_counter() - t0:.1f} s, gathered peak "
                      f"{metrics['gathered_bytes_peak'] / GIB:.2f} GiB")
        row = torch.tensor([metrics["state_bytes"], metrics["state_bytes_theory"],
                            fzero.memory.peak_rss_bytes()], dtype=torch.float64)
        rows = torch.empty(world * 3, dtype=torch.float64)
        comm.all_gather(rows, row)
        if master:
            print("\n| rank | state bytes | paper 16Ψ/N | measured/paper | peak RSS |")
            print("|---:|---:|---:|---:|---:|")
            for r, (state_b, theory, rss) in enumerate(rows.view(world, 3).tolist()):
                print(f"| {r} | {state_b / GIB:.3f} GiB | {theory / GIB:.3f} GiB | "
                      f"{state_b / theory:.5f} | {rss / GIB:.2f} GiB |")


if __name__ == "__main__":
    main()
