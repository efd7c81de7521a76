"""Nothing is lost when a process dies: a rank SIGKILLed mid-run under `torchrun --max-restarts`
resumes by itself and ends bitwise where the uninterrupted run ends; a process SIGKILLed while
it saves leaves the previous checkpoint complete, found by `latest` and loaded bitwise.

[Note: torchrun restarts on torch 2.13]
torchrun's agent serves the store its workers meet in (its c10d rendezvous by default, its
static one always) and keeps it across restart attempts, the problem of pytorch/pytorch#135712:
through ``env://`` the restarted workers read the killed workers' gloo addresses and failed to
connect ("Connection refused") or hung in `connectFullMesh` until the group's timeout (the first
restart failed in 3 of 3 killed runs of this test's job, and in 2 of 3 runs of a 10-line script
without fzero). `fzero.init_distributed` keeps each attempt's keys under a prefix of its own,
so these tests run torchrun as a user would, with no environment variable.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fzero
from fzero.checkpoint import latest, read_manifest
from fzero.checkpoint.files import ShardFile

import recovery_bodies as rb

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_gpt.py")
STEPS = 12
SAVE_EVERY = 3
GPT = ["--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--warmup-steps", "2",
       "--sample-bytes", "0", "--save-every", str(SAVE_EVERY)]
TIMEOUT = 240

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")


def env() -> dict[str, str]:
    """This checkout's fzero first, one thread per process, and torchrun's own store sharing
    (see the module's note)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    return {**environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def torchrun(ckpt: Path, metrics: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "--max-restarts", "2", SCRIPT, *GPT, "--resume", str(ckpt), "--metrics-json",
            str(metrics)]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc: torchrun's agent starts the workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def environment(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def worker(job: int, rank: int, attempt: int) -> int:
    """The pid of the torchrun worker with this RANK in this restart attempt."""
    for pid in descendants(job):
        found = environment(pid)
        if (found.get("RANK"), found.get("TORCHELASTIC_RESTART_COUNT")) == (str(rank),
                                                                             str(attempt)):
            return pid
    raise AssertionError(f"no worker of rank {rank} in attempt {attempt} under pid {job}")


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor (RNG states too), as ``"<rank>/<key>"``."""
    tensors = {}
    for entry in read_manifest(path).files:
        with ShardFile(path / entry.name) as f:
            tensors.update({f"{entry.rank}/{key}": f.read(key) for key in f.tensors})
    return tensors


@pytest.mark.slow
@needs_proc
def test_torchrun_job_resumes_after_a_rank_is_killed(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed as soon as the save of step 6 begins (its ``.partial`` directory
    appears): torchrun stops rank 0, restarts both, and they resume from the last complete
    checkpoint (step 3, or step 6 if that save completed before the kill landed) and end with
    exactly the uninterrupted run's losses, validation loss and checkpoint, bitwise."""
    whole = subprocess.run(torchrun(tmp_path / "whole", tmp_path / "whole.json"), env=env(),
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    expected = json.loads((tmp_path / "whole.json").read_text())

    ckpt, metrics = tmp_path / "killed", tmp_path / "killed.json"
    job = subprocess.Popen(torchrun(ckpt, metrics), env=env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        marker = ckpt / f"step-{2 * SAVE_EVERY:06d}.partial"
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists():
            assert job.poll() is None and time.monotonic() < deadline, "no save began"
            time.sleep(0.002)
        os.kill(worker(job.pid, rank=1, attempt=0), signal.SIGKILL)
        log = job.communicate(timeout=TIMEOUT)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, log

    done = STEPS - len(json.loads(metrics.read_text())[0]["losses"])
    assert done in (SAVE_EVERY, 2 * SAVE_EVERY), log  # resumed from a complete checkpoint
    assert f"resume {ckpt / f'step-{done:06d}'}: {done} steps done" in log
    assert "exitcode  : -9" in log or "exitcode: -9" in log  # torchrun saw the kill
    resumed = json.loads(metrics.read_text())
    for rank in (0, 1):
        assert resumed[rank]["losses"] == expected[rank]["losses"][done:]  # bitwise
        assert resumed[rank]["val_loss"] == expected[rank]["val_loss"]
    last = f"step-{STEPS:06d}"
    assert sorted(os.listdir(ckpt)) == sorted(os.listdir(tmp_path / "whole"))  # no .partial
    ours, theirs = checkpoint_tensors(ckpt / last), checkpoint_tensors(tmp_path / "whole" / last)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if "/rng." not in key:  # each process seeds its global RNG at random (torch >= 2.13)
            assert torch.equal(ours[key], value), key
    # train_gpt draws nothing from the global RNG: the restarted ranks still hold the states
    # the killed ones saved, restored by the load.
    before = checkpoint_tensors(ckpt / f"step-{done:06d}")
    for rank in (0, 1):
        assert torch.equal(ours[f"{rank}/rng.cpu"], before[f"{rank}/rng.cpu"])
    assert read_manifest(ckpt / last).extra == read_manifest(tmp_path / "whole" / last).extra


def _snapshots_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"]
    for part in ("params", "master", "buffers"):
        assert a[part].keys() == b[part].keys()
        for name, value in a[part].items():
            assert torch.equal(value, b[part][name]), (part, name)
    for moment, values in a["moments"].items():
        for name, value in values.items():
            assert torch.equal(value, b["moments"][moment][name]), (moment, name)


@pytest.mark.slow
@pytest.mark.parametrize("point", rb.POINTS)
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path, point: str) -> None:
    """SIGKILL while rank 1 writes its shard, after the manifest but before the rename, or
    between the two renames of an overwrite: `latest` finds the previous complete checkpoint,
    it loads bitwise as saved and training continues exactly; the next save succeeds."""
    root, golden = tmp_path / "run", tmp_path / "golden"
    child = multiprocessing.get_context("forkserver").Process(
        target=rb.crash_during_save, args=(str(root), str(golden), point))
    child.start()
    child.join(TIMEOUT)
    assert child.exitcode == -signal.SIGKILL, f"exit code {child.exitcode}"

    left = sorted(os.listdir(root))
    if point == "replace":  # the old checkpoint moved aside, the new one complete but unnamed
        assert left == ["step-000002.old", "step-000002.partial"]
        assert (root / "step-000002.partial" / "manifest.json").exists()
        previous = root / "step-000002.old"
    else:
        assert left == ["step-000002", "step-000003.partial"]
        files = os.listdir(root / "step-000003.partial")
        assert ("manifest.json" in files) == (point == "publish")
        if point == "write":  # rank 1's file is half written (same size when complete)
            name = "shard-00001-of-00002.safetensors"
            half = os.path.getsize(root / "step-000003.partial" / name)
            assert 0 < half < os.path.getsize(root / "step-000002" / name)
        previous = root / "step-000002"
    assert latest(root) == str(previous)

    got, want = fzero.SimWorld(2).run(rb.load_and_continue, str(previous))[0], fzero.SimWorld(
        2).run(rb.load_and_continue, str(golden))[0]
    _snapshots_equal(got["loaded"], want["loaded"])
    assert got["losses"] == want["losses"] and len(got["losses"]) == 2
    for name, value in want["final"].items():
        assert torch.equal(got["final"][name], value), name

    # Saving again cleans the interrupted save up (a "replace" leaves its ".old" behind).
    target = root / "step-000002" if point == "replace" else root / "step-000003"
    fzero.SimWorld(2).run(rb.resave, str(previous), str(target), overwrite=True)
    assert sorted(os.listdir(root)) == (["step-000002", "step-000002.old"] if point == "replace"
                                        else ["step-000002", "step-000003"])
    assert latest(root) == str(target) and read_manifest(target).step == 3
