"""The benchmarks keep working: `examples/nocomm.py` (the no-op comm that measures a step's
compute at any world size, and the replay that times its collectives alone) behaves as a step
at that world size, and every bench script runs end to end at a tiny size (numbers not
asserted: only that each requested row produced one)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_step import split_step
from hypothesis import given
from hypothesis import strategies as st
from nocomm import NoComm, replay
from train_gpt import GPT, GPTConfig, loss_fn

import fzero

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT = 300
TINY = GPTConfig(seq_len=8, n_layer=1, n_head=2, d_model=16)


def env() -> dict[str, str]:
    """This checkout's fzero first; one intra-op thread per process (2 cores, 2 processes)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], env=env(), cwd=ROOT, timeout=TIMEOUT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (rows, TINY.seq_len + 1),
                           generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


# -----------------------------------------------------------------------------
# NoComm: local collectives with the values a world of identical ranks would compute


def test_nocomm_collectives_are_those_of_identical_ranks() -> None:
    comm = NoComm(1, 3)
    out = torch.full((6,), -1.0)
    comm.all_gather(out, torch.tensor([1.0, 2.0]))
    assert out.tolist() == [1.0, 2.0] * 3  # every rank "sent" this rank's shard
    out[2:4] = torch.tensor([5.0, 6.0])  # in place: the input is this rank's chunk
    comm.all_gather(out, out[2:4])
    assert out.tolist() == [5.0, 6.0] * 3
    shard = torch.empty(2)
    work = comm.reduce_scatter(shard, torch.arange(6.0), op="avg", async_op=True)
    work.wait()
    assert shard.tolist() == [2.0, 3.0]  # the mean of 3 equal chunks 1 is chunk 1
    x = torch.tensor([4.0])
    comm.all_reduce(x, op="sum")
    comm.broadcast(x, src=2)
    assert x.tolist() == [4.0]
    kinds = [issued.kind for issued in comm.log]
    assert kinds == ["all_gather", "all_gather", "reduce_scatter", "all_reduce", "broadcast"]
    assert comm.counters.bytes_sent["all_gather"] == 2 * 4 * 4  # 2 x (N-1)/N * 6 floats
    comm.channel("control", host=True).all_gather(torch.empty(3), torch.ones(1))
    assert comm.log[-1].channel == "control@host"  # channels log into the same list


def steps_on(comm: fzero.Comm, model: torch.nn.Module, stage: int) -> dict:
    """Two steps of `model` at `stage` on `comm` (the second follows stage 3's agreed
    sequence); what the last one held, sent and issued."""
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm)
    step = fzero.make_train_step(model, loss_fn, decay=fzero.decay_matrices)
    for seed in range(2):
        if isinstance(comm, NoComm):
            comm.log.clear()
        state, metrics = step(state, batch(2, seed))
    keys = ("state_bytes", "comm_bytes", "comm_bytes_by_kind", "control_bytes")
    return {k: metrics[k] for k in keys} | {"signature": comm.signature}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nocomm_step_is_rank_0_of_a_real_world(stage: int) -> None:
    """Rank 0 of 3 with no-op communication holds and sends what rank 0 of a real 3-rank world
    does (state bytes measured on tensors, ring bytes charged), issuing the same collectives."""
    model = GPT(TINY, seed=0)
    real = fzero.SimWorld(3).run(steps_on, model, stage)[0]  # each rank its own module copy
    assert steps_on(NoComm(0, 3), model, stage) == real


def test_replay_issues_the_steps_collectives() -> None:
    """Replaying a step's log on a real world charges the bytes the step charged."""
    comm = NoComm(0, 2)
    sent = steps_on(comm, GPT(TINY, seed=0), 3)
    log = list(comm.log)

    def replayed(real: fzero.Comm) -> int:
        assert replay(real, log) >= 0
        return real.counters.total() + real.channel("stage3.gather").counters.total()

    assert fzero.SimWorld(2, copy_args=False).run(replayed) == [sent["comm_bytes"]] * 2


# -----------------------------------------------------------------------------
# The split of a step into hidden communication and contention


@given(st.floats(0, 10), st.floats(0, 10), st.floats(0, 10))
def test_split_step_accounts_for_the_whole_step(t_step: float, t_compute: float,
                                                t_comm: float) -> None:
    overlap, contention = split_step(t_step, t_compute, t_comm)
    assert 0 <= overlap <= 1 and contention >= 0
    if t_step >= t_compute and t_comm > 0:  # compute + the exposed comm + contention = the step
        exposed = (1 - overlap) * t_comm
        assert math.isclose(t_compute + exposed + contention, t_step, rel_tol=1e-9,
                            abs_tol=1e-12)


def test_split_step_cases() -> None:
    assert split_step(10.0, 10.0, 2.0) == (1.0, 0.0)  # communication entirely hidden
    assert split_step(12.0, 10.0, 2.0) == (0.0, 0.0)  # serial: compute, then communication
    assert split_step(11.0, 10.0, 2.0) == (0.5, 0.0)
    assert split_step(15.0, 10.0, 2.0) == (0.0, 3.0)  # 3 beyond both apart: contention
    assert split_step(9.0, 10.0, 2.0) == (1.0, 0.0)  # faster than compute alone: noise


# -----------------------------------------------------------------------------
# Each bench script, end to end at a tiny size


def table_rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows by their first cell (a label may head a row in several tables)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > 1 and not set(cells[0]) <= {"-", ":"}:
            rows.setdefault(cells[0], []).append(line)
    return rows


@pytest.mark.slow
def test_bench_step_runs() -> None:
    out = run(str(EXAMPLES / "bench_step.py"), "--nproc", "2", "--size", "tiny", "--steps", "1",
              "--warmup", "1", "--rounds", "1", "--rows", "ddp,fzero_2,fzero_3_shm")
    rows = table_rows(out)
    for label in ("DDP + AdamW", "fzero stage 2", "fzero stage 3, shm"):  # time (round spread)
        assert re.match(r"\| [^|]+ \| [\d.,]+ \([\d.,]+\) \|", rows[label][0]), rows[label]
    overlap = rows["fzero stage 2"][1]  # t_step, t_compute, t_comm, collectives, overlap, ...
    assert re.fullmatch(r"\| fzero stage 2( \| [\d.,]+){6} \|", overlap), overlap  # contention
    assert 0 <= float(overlap.split("|")[6]) <= 1, overlap
    # --buckets: size-capped buckets of 2,000 elements instead of the default policy's one
    # bucket (small blocks and the tied embedding merged) issue more collectives.
    capped = table_rows(run(str(EXAMPLES / "bench_step.py"), "--nproc", "2", "--size", "tiny",
                            "--steps", "1", "--warmup", "1", "--rounds", "1", "--rows", "fzero_2",
                            "--buckets", "2000"))
    count = int(overlap.split("|")[5])
    assert int(capped["fzero stage 2"][1].split("|")[5]) > count, (capped, overlap)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_step_runs_on_the_gpu() -> None:
    """One rank on the GPU (NCCL): every row, and the split of fzero's steps, produce numbers
    (the loss all-reduce and the no-op comm's state once sat on the CPU there)."""
    out = run(str(EXAMPLES / "bench_step.py"), "--nproc", "1", "--size", "tiny", "--steps", "1",
              "--warmup", "1", "--rounds", "1", "--rows", "ddp,fsdp2,fzero_1,fzero_3")
    rows = table_rows(out)
    assert "1 ranks on cuda" in out, out
    for label in ("DDP + AdamW", "FSDP2 fully_shard", "fzero stage 1", "fzero stage 3"):
        assert re.match(r"\| [^|]+ \| [\d.,]+ \([\d.,]+\) \|", rows[label][0]), rows[label]
    assert re.fullmatch(r"\| fzero stage 3( \| [\d.,]+){6} \|", rows["fzero stage 3"][1]), out


@pytest.mark.slow
def test_bench_step_paired_runs() -> None:
    """--paired: the rows share processes, a step of each in turn; each row gets a median step
    time and a per-step ratio to each reference row (1.00 against itself); the losses agree.
    A row may carry its own bucket cap (``fzero_1@2000``), beside the default policy's."""
    out = run(str(EXAMPLES / "bench_step.py"), "--nproc", "2", "--size", "tiny", "--steps", "2",
              "--warmup", "1", "--rounds", "1", "--paired", "--rows",
              "ddp,fsdp2,fzero_3,fzero_1@2000")
    rows = table_rows(out)
    ratio = r"[\d.]+ \([\d.]+–[\d.]+\)"
    assert re.fullmatch(rf"\| DDP \+ AdamW \| [\d.,]+ \| 1\.00 \| {ratio} \| [\d.]+ \|",
                        rows["DDP + AdamW"][0]), out
    for label in ("fzero stage 3", "fzero stage 1 (buckets of 2,000)"):
        assert re.fullmatch(rf"\| {re.escape(label)} \| [\d.,]+ \| {ratio} \| {ratio} \| "
                            rf"[\d.]+ \|", rows[label][0]), out
    assert len({row[0].rsplit("|", 2)[1] for row in rows.values() if "loss" not in row[0]}) == 1
    assert "(2 turns)" in out


@pytest.mark.slow
def test_bench_scaling_runs() -> None:
    out = run(str(EXAMPLES / "bench_scaling.py"), "--size", "tiny", "--stages", "3",
              "--world-sizes", "1,2,5", "--measure", "2", "--steps", "1", "--warmup", "1")
    rows = table_rows(out)
    assert [len(rows[n]) for n in ("1", "2", "5")] == [2, 2, 2], out  # stage 3, paper
    assert re.search(r"\| [\d.,]+ \|$", rows["2"][0]), rows["2"]  # measured at N = 2
    assert rows["5"][0].endswith("| - |") and rows["1"][1].count("/ 120") == 4, out


@pytest.mark.slow
def test_bench_collectives_runs() -> None:
    for transport in ("pairwise", "shm"):
        out = run(str(EXAMPLES / "bench_collectives.py"), "--mib", "1", "--buckets", "2",
                  "--warmup", "0", "--repeats", "5", "--transport", transport)
        assert f"transport {transport}," in out, out
        assert len([r for r in table_rows(out) if "gather" in r or "scatter" in r]) == 4, out


def test_bench_flat_runs() -> None:
    out = run(str(EXAMPLES / "bench_flat.py"), "--gib", "0.002", "--repeats", "1",
              "--world-size", "3")
    assert len([r for r in table_rows(out) if "fzero." in r]) == 4, out


@pytest.mark.slow
def test_bench_scale_runs() -> None:
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              str(EXAMPLES / "bench_scale.py"), "--layers", "1", "--d-model", "64",
              "--seq-len", "8", "--steps", "1")
    assert "0" in table_rows(out) and "1" in table_rows(out), out  # a row per rank
