"""examples/train_gpt.py launched as users launch it: `torchrun --standalone` with 2 processes,
and two torchrun "nodes" on this machine (`--nnodes 2 --node-rank 0/1 --rdzv-endpoint`), which
must train exactly as the one-node run of the same world size."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_gpt.py")
SMALL = ["--steps", "8", "--batch-size", "8", "--seq-len", "32", "--sample-bytes", "0"]
TIMEOUT = 300


def env() -> dict[str, str]:
    """This checkout's fzero first; one intra-op thread per process (2 cores, 2 processes)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def one_node(tmp_path: Path, stage: int, *extra: str) -> list[dict]:
    out = tmp_path / f"one-node-{stage}{'-'.join(extra)}.json"
    subprocess.run(
        torchrun("--standalone", "--nproc-per-node", "2", SCRIPT, *SMALL, "--stage", str(stage),
                 "--metrics-json", str(out), *extra),
        env=env(), check=True, timeout=TIMEOUT, capture_output=True,
    )
    return json.loads(out.read_text())


@pytest.mark.slow
def test_torchrun_standalone_two_processes(tmp_path: Path) -> None:
    ranks = one_node(tmp_path, stage=3)
    assert [r["rank"] for r in ranks] == [0, 1]
    losses = ranks[0]["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses  # it learns
    assert ranks[1]["losses"] == losses  # every rank reports the same global loss
    assert ranks[1]["val_loss"] == ranks[0]["val_loss"]  # and gathered the same parameters


@pytest.mark.slow
def test_a_bfloat16_run_evaluates_and_samples(tmp_path: Path) -> None:
    """The evaluation after training cast the parameters to float32 name by name, which made
    the tied embedding two tensors, and functional_call refused them: every reduced-precision
    run died after its last step."""
    ranks = one_node(tmp_path, 2, "--param-dtype", "bfloat16")
    assert math.isfinite(ranks[0]["val_loss"]) and ranks[1]["val_loss"] == ranks[0]["val_loss"]


def test_a_corpus_shorter_than_the_sequences_is_named(tmp_path: Path) -> None:
    corpus = tmp_path / "small.txt"
    corpus.write_text("x" * 1100)
    done = subprocess.run([sys.executable, SCRIPT, "--steps", "1", "--seq-len", "2000",
                           "--data", str(corpus)], env=env(), timeout=TIMEOUT,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "--seq-len 2000 needs a corpus of at least 6,006 bytes" in (
        done.stderr)


@pytest.mark.slow
def test_torchrun_through_shared_memory_trains_as_pairwise(tmp_path: Path) -> None:
    """`--transport shm` (fzero.distributed(transport="shm")): the same losses, bitwise, as the
    default transport (the shared-memory sums run in the same order). The blocks' bucket sends
    3.6 MB chunks, above `shm_min_bytes`: they go through shared memory."""
    shared = one_node(tmp_path, 2, "--transport", "shm")
    assert [r["losses"] for r in shared] == [r["losses"] for r in one_node(tmp_path, 2)]


@pytest.mark.slow
def test_two_nodes_match_one_node(tmp_path: Path) -> None:
    out = tmp_path / "two-nodes.json"
    endpoint = f"localhost:{free_port()}"
    nodes = [
        subprocess.Popen(
            torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                     "--rdzv-endpoint", endpoint, SCRIPT, *SMALL, "--stage", "2",
                     "--metrics-json", str(out)),
            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=TIMEOUT)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(logs)
    two_nodes = json.loads(out.read_text())
    assert two_nodes == one_node(tmp_path, stage=2)  # bitwise: the same world of 2 ranks


FAKE_SRUN = """#!/bin/bash
# Stand-in for Slurm's srun on one machine: start SLURM_NTASKS local copies of the command,
# each with its SLURM_PROCID and SLURM_LOCALID; fail if any copy fails.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""


@pytest.mark.slow
def test_slurm_sbatch_with_a_local_srun(tmp_path: Path) -> None:
    """examples/slurm.sbatch as Slurm would run it, with `srun` and `scontrol` replaced by local
    stand-ins: the script's rendezvous variables and fzero's Slurm launch path, end to end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    # show hostnames: a large allocation's (`head -n 1` ended the script with SIGPIPE under
    # pipefail, silently, status 141: a probe)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\nseq -f 'node%g' 200000\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    port = free_port()
    while not 20000 <= port < 40000:  # the script derives its port from the job id
        port = free_port()
    out = tmp_path / "slurm.json"
    slurm = {"SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": str(port - 20000),
             "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "1"}
    run_env = {**env(), **slurm, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        run_env.pop(var, None)  # Slurm's variables, not a torchrun's, must drive the launch
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / "slurm.sbatch"), *SMALL, "--stage", "1",
         "--metrics-json", str(out)],
        cwd=ROOT, env=run_env, timeout=TIMEOUT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["losses"][-1] < ranks[0][
        "losses"][0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torchrun_on_the_gpu_trains_as_the_reference(tmp_path: Path) -> None:
    """One rank on the GPU (NCCL), stage 3, with a text sample: the same losses as one process
    of torch.optim.AdamW on the same device."""
    common = [*SMALL[:-2], "--sample-bytes", "16", "--stage", "3"]
    fzero_json, reference_json = tmp_path / "fzero.json", tmp_path / "reference.json"
    subprocess.run(torchrun("--standalone", "--nproc-per-node", "1", SCRIPT, *common,
                            "--metrics-json", str(fzero_json)),
                   env=env(), check=True, timeout=TIMEOUT, capture_output=True)
    subprocess.run([sys.executable, SCRIPT, *common[:-2], "--reference",
                    "--metrics-json", str(reference_json)],
                   env=env(), check=True, timeout=TIMEOUT, capture_output=True)
    ours, = json.loads(fzero_json.read_text())
    ref, = json.loads(reference_json.read_text())
    assert ours["device"].startswith("cuda"), ours
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("argv, said", [
    (["--seq-len", "0"], "--seq-len must be >= 1"),  # trained on NaN losses to the end
    (["--stop-after", "-2", "--resume", "r"], "--stop-after and --sample-bytes must be >= 0"),
    (["--save-every", "-3", "--resume", "r"], "--stop-after and --sample-bytes must be >= 0"),
    (["--sample-bytes", "-1"], "--stop-after and --sample-bytes must be >= 0"),
    # refused by fzero on every rank, as a traceback, after the set-up (a probe)
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--warmup-steps", "-5"], "--warmup-steps >= 0"),
    (["--clip-norm", "-1"], "--clip-norm must be a number >= 0"),
    (["--clip-norm", "nan"], "--clip-norm must be a number >= 0"),
    # failed after all training was done
    (["--metrics-json", "/nonexistent-dir/m.json"], "its directory does not exist"),
    (["--metrics-json", "/"], "a directory, not a file"),  # (passed the check: a review)
])
def test_train_gpt_refuses_sizes_below_their_bound(argv: list[str], said: str, capsys) -> None:
    """Sizes that trained on NaN (``--seq-len 0``) or said "all 2 steps were taken already"
    after none (``--stop-after -2``) are argument errors (a probe)."""
    from train_gpt import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert said in capsys.readouterr().err
