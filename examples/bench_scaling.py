"""Step time and bytes per rank as the world grows: N = 1, 2 measured here, more projected.

    python examples/bench_scaling.py --size small          # N = 1, 2, 8, 64, 1024; stages 0-3
    python examples/bench_scaling.py --size 30m --stages 1,3 --bandwidth 25e9 --latency 5e-6

For each stage and world size N, this process runs fzero's real train step as rank 0 of N ranks
with `nocomm.NoComm` as its comm (collectives local and instant): the layout is planned for N,
the optimizer updates this rank's Ψ/N, the Python per bucket and per message is the step's own.
That measures, at every N, without N processes:

- t_compute(N): the step's time without communication (median over ``--steps``);
- the model-state bytes per rank, on the state's real tensors (``metrics["state_bytes"]``);
- every collective the step issues (kind, size, channel): their ring bytes per rank are what
  fzero's counters charge (``metrics["comm_bytes"]``, ``metrics["control_bytes"]``).

The comm model turns each collective c of P_c elements of b bytes into time, one after another:

    steps_c = N - 1 (all-gather, reduce-scatter, broadcast), 2 (N - 1) (all-reduce)
    bytes_c = steps_c / N * P_c * b                       (ring bytes each rank sends)
    t_comm(N) = sum over c of (steps_c * α + bytes_c / β)
    t_step(N) between max(t_compute, t_comm) (communication hidden) and t_compute + t_comm

α and β default to the ZeRO paper's cluster (Section 10, "Hardware": 400 V100 GPUs, 25 DGX-2
nodes, 800 Gbps internode bandwidth): β = 800 Gbit/s per node / 16 GPUs = 6.25 GB/s per rank, the
ring's bottleneck once it crosses nodes; α = 10 µs per ring step is an assumption (the paper gives
no latency). Within one DGX-2 (N <= 16) NVSwitch is faster, so the model is pessimistic there.

Weak scaling: every rank keeps the per-rank batch of the 2-rank benchmark (`bench_step.SIZES`'s
global batch / 2), so the global batch grows with N. Each rank computes with ``--threads``
threads (1: what a rank gets in the 2-rank benchmark on 2 cores). At the world sizes of
``--measure`` (default 1 and 2) the real step also runs, in that many gloo processes on this
machine, with the same per-rank batch and threads (`bench_step.run_row`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import BETAS, DECAY, EPS, LR, SIZES, WEIGHT_DECAY, make_batches, run_row  # noqa: E402
from nocomm import NoComm  # noqa: E402
from train_gpt import GPT, loss_fn, num_params  # noqa: E402

import fzero  # noqa: E402

PAPER_BETA = 800e9 / 8 / 16  # bytes/s per rank: 800 Gbit/s per DGX-2 node over its 16 GPUs
ASSUMED_ALPHA = 10e-6  # seconds per ring step (an assumption: the paper states no latency)
ELEMENTS_SENT = {0: 2, 1: 2, 2: 2, 3: 3}  # the stage table: elements sent per step, times Ψ
# The ZeRO paper's Table 1 (per-device model-state GB, Ψ = 7.5B, K = 12, mixed precision) at the
# DP degrees it lists; Figure 1 shows the N = 64 column (120, 31.4, 16.6, 1.9 GB).
PAPER_TABLE_1 = {  # N: (stage 1 P_os, stage 2 P_os+g, stage 3 P_os+g+p); stage 0 is 120 at all N
    1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
    64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12),
}


def ring_steps(kind: str, world_size: int) -> int:
    """Messages one rank sends in a ring implementation of `kind` (latency terms)."""
    return 2 * (world_size - 1) if kind == "all_reduce" else world_size - 1


def comm_seconds(log, world_size: int, alpha: float, beta: float) -> float:
    """The comm model's time for the collectives of `log`, one after another."""
    total = 0.0
    for issued in log:
        nbytes = fzero.comm.ring_bytes(issued.kind, issued.numel, issued.dtype.itemsize,
                                       world_size)
        total += ring_steps(issued.kind, world_size) * alpha + nbytes / beta
    return total


def measure_compute(size: str, stage: int, world_size: int, per_rank: int, steps: int,
                    warmup: int) -> dict:
    """Rank 0 of `world_size` with no-op communication: time, state bytes, collectives."""
    cfg, _ = SIZES[size]
    model = GPT(cfg, seed=0)
    comm = NoComm(0, world_size)
    optimizer = fzero.optim.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    state = fzero.init(model, stage=stage, optimizer=optimizer, comm=comm,
                       param_dtype=torch.float32)
    step = fzero.make_train_step(model, loss_fn, decay=DECAY)
    batches = make_batches(cfg, per_rank, warmup + steps, 0, 1, "cpu")  # (per_rank, T) each
    times = []
    for i, batch in enumerate(batches):
        comm.log.clear()  # keeps the last step's collectives
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    data = [c for c in comm.log if not c.channel.endswith("@host")]
    return {
        "compute": statistics.median(times),
        "state_bytes": metrics["state_bytes"],
        "comm_bytes": metrics["comm_bytes"],
        "control_bytes": metrics["control_bytes"],
        "log": list(comm.log),
        "data_collectives": len(data),
        "control_collectives": len(comm.log) - len(data),
    }


def measure_real(size: str, stage: int, world_size: int, per_rank: int, threads: int,
                 steps: int, warmup: int, tmp: str) -> float | str:
    """The real step in `world_size` gloo processes: median step time (slowest rank), or why
    it did not run."""
    args = argparse.Namespace(size=size, nproc=world_size, steps=steps, warmup=warmup,
                              timeout=600.0, profile=None, batch=per_rank * world_size,
                              threads=threads)
    res = run_row(f"fzero_{stage}", args, tmp)
    return res.get("error") or res["median"]


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.0995 else f"{seconds * 1e3:,.2g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="small")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--world-sizes", default="1,2,8,64,1024")
    ap.add_argument("--measure", default="1,2", help="world sizes also run for real, here")
    ap.add_argument("--bandwidth", type=float, default=PAPER_BETA, help="β, bytes/s per rank")
    ap.add_argument("--latency", type=float, default=ASSUMED_ALPHA, help="α, s per ring step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    worlds = [int(n) for n in args.world_sizes.split(",")]
    measured = [int(n) for n in args.measure.split(",") if n]
    cfg, global_batch = SIZES[args.size]
    per_rank = max(1, global_batch // 2)
    psi = num_params(GPT(cfg))
    torch.set_num_threads(args.threads)

    print(f"$ python {shlex.join(['examples/bench_scaling.py', *sys.argv[1:]])}")
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; load "
          f"average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"GPT {cfg.n_layer} layers x d {cfg.d_model}, seq {cfg.seq_len}: Ψ = {psi:,}; fp32 "
          f"AdamW (K = 8); {per_rank} sequences per rank; {args.threads} thread(s) per rank; "
          f"comm model β = {args.bandwidth / 1e9:.2f} GB/s, α = {args.latency * 1e6:.0f} µs\n")

    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages:
            print(f"**Stage {stage}**\n")
            print("| N | state MiB/rank (measured) | formula | comm MiB/rank/step (ring) | "
                  "formula | collectives: data + control | t_compute ms (measured) | "
                  "t_comm ms (model) | t_step ms projected (hidden – serial) | t_step ms "
                  "measured here |")
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for n in worlds:
                res = measure_compute(args.size, stage, n, per_rank, args.steps, args.warmup)
                formula = fzero.memory.estimate(psi, n, stage, k=8, param_bytes=4, grad_bytes=4)
                sent = ELEMENTS_SENT[stage] * psi * 4 * (n - 1) / n
                t_comm = comm_seconds(res["log"], n, args.latency, args.bandwidth)
                t_compute = res["compute"]
                real = "-"
                if n in measured:
                    got = measure_real(args.size, stage, n, per_rank, args.threads, args.steps,
                                       args.warmup, tmp)
                    real = got if isinstance(got, str) else fmt_ms(got)
                print(f"| {n} | {res['state_bytes'] / 2**20:,.2f} | {formula / 2**20:,.2f} "
                      f"| {res['comm_bytes'] / 2**20:,.2f} | {sent / 2**20:,.2f} "
                      f"| {res['data_collectives']} + {res['control_collectives']} "
                      f"| {fmt_ms(t_compute)} | {fmt_ms(t_comm)} "
                      f"| {fmt_ms(max(t_compute, t_comm))} – {fmt_ms(t_compute + t_comm)} "
                      f"| {real} |", flush=True)
            print()

    print("The stage table at the paper's Ψ = 7.5B, K = 12 (mixed precision), GB per rank: "
          "fzero.memory.estimate / the paper's Table 1 where it lists that N\n")
    print("| N | stage 0 | stage 1 | stage 2 | stage 3 |")
    print("|---:|---:|---:|---:|---:|")
    for n in worlds:
        cells = []
        for stage in (0, 1, 2, 3):
            ours = fzero.memory.estimate(7.5e9, n, stage, k=12) / 1e9
            paper = 120 if stage == 0 else PAPER_TABLE_1.get(n, (None,) * 3)[stage - 1]
            cells.append(f"{ours:.3g} / {paper:g}" if paper is not None else f"{ours:.3g} / -")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
