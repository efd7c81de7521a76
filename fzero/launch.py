"""Launching: where this process sits in a torchrun or Slurm job, and the process group.

`parse_launch_env` is pure (an environment mapping in, a `LaunchEnv` out);
`init_distributed` / `distributed` create the default process group from it and return a
`fzero.TorchComm` over it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fzero.torchcomm import TorchComm, as_timeout

__all__ = [
    "DEFAULT_TIMEOUT",
    "LaunchEnv",
    "destroy_distributed",
    "distributed",
    "init_distributed",
    "parse_launch_env",
]

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Collective timeout `init_distributed` passes to the process group by default."""


class LaunchEnv(NamedTuple):
    """Where this process sits in a launch, as read from the environment.

    Attributes:
        launcher: "torchrun" (RANK/WORLD_SIZE/...), "slurm" (SLURM_PROCID/...) or "none".
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank on this node (selects the CUDA device).
        master_addr: Rendezvous host (None when world_size == 1 outside torchrun).
        master_port: Rendezvous port (None when world_size == 1 outside torchrun).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def _require(
    environ: Mapping[str, str], name: str, launcher: str, expected: tuple[str, ...]
) -> str:
    value = environ.get(name)
    if value is None or value == "":
        raise ValueError(
            f"{launcher} launch detected but environment variable {name} is not set; "
            f"expected all of {', '.join(expected)}"
        )
    return value


def _env_int(
    environ: Mapping[str, str], name: str, launcher: str, expected: tuple[str, ...]
) -> int:
    value = _require(environ, name, launcher, expected)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: "gpu[03-05,9],cpu1" -> "gpu03", "a[1-2]-ib" -> "a1-ib"."""
    depth = 0
    end = len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    return re.sub(r"\[([^\],-]*)[^\]]*\]", r"\1", first)


def parse_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Read rank, world size and rendezvous address from a launcher's environment (pure).

    torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) win when RANK
    or WORLD_SIZE is set; else Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and
    MASTER_ADDR, MASTER_PORT; MASTER_ADDR defaults to the first host of SLURM_STEP_NODELIST,
    SLURM_JOB_NODELIST or SLURM_NODELIST) when SLURM_PROCID is set; else a single-process world.

    Args:
        environ: The environment, e.g. `os.environ`.

    Returns:
        The parsed `LaunchEnv`.

    Raises:
        ValueError: Naming a missing or malformed variable, or an inconsistent rank.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        launcher, expected = "torchrun", _TORCHRUN_VARS
        missing = [name for name in _TORCHRUN_VARS if not environ.get(name)]
        if missing and "SLURM_PROCID" in environ:  # not torchrun: a variable exported by hand
            raise ValueError(
                f"{' and '.join(n for n in ('RANK', 'WORLD_SIZE') if n in environ)} is set, "
                f"so torchrun's variables are read, but {', '.join(missing)} not: under srun "
                f"without torchrun, unset RANK and WORLD_SIZE (exported by hand?) so that "
                f"Slurm's SLURM_PROCID and SLURM_NTASKS are read")
        rank = _env_int(environ, "RANK", launcher, expected)
        world_size = _env_int(environ, "WORLD_SIZE", launcher, expected)
        local_rank = _env_int(environ, "LOCAL_RANK", launcher, expected)
        addr: str | None = _require(environ, "MASTER_ADDR", launcher, expected)
        port: int | None = _env_int(environ, "MASTER_PORT", launcher, expected)
    elif "SLURM_PROCID" in environ:
        launcher = "slurm"
        expected = (*_SLURM_VARS, "MASTER_PORT")
        rank = _env_int(environ, "SLURM_PROCID", launcher, expected)
        world_size = _env_int(environ, "SLURM_NTASKS", launcher, expected)
        local_rank = _env_int(environ, "SLURM_LOCALID", launcher, expected)
        addr = port = None
        if world_size > 1:
            # The step's nodes first: SLURM_PROCID counts the step's tasks, and a step on part
            # of the allocation (`srun -N1 -w gpu02` in a two-node job) has its rank 0 on the
            # step's first node, not the job's.
            nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                        or environ.get("SLURM_NODELIST"))
            addr = environ.get("MASTER_ADDR") or (nodelist and _first_slurm_host(nodelist))
            if not addr:
                raise ValueError(
                    "slurm launch detected but neither MASTER_ADDR nor SLURM_STEP_NODELIST / "
                    "SLURM_JOB_NODELIST / SLURM_NODELIST is set: export "
                    "MASTER_ADDR=<first node's hostname>"
                )
            port = _env_int(environ, "MASTER_PORT", launcher, expected)
    else:
        return LaunchEnv("none", 0, 1, 0, None, None)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ValueError(
            f"{launcher} environment is inconsistent: need 0 <= rank < world_size and "
            f"local_rank >= 0, got {rank=}, {world_size=}, {local_rank=}"
        )
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return LaunchEnv(launcher, rank, world_size, local_rank, addr, port)


def _pick_device(
    backend: str, local_rank: int, device: torch.device | str | int | None
) -> torch.device:
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank < count:
        return torch.device("cuda", local_rank)
    if count == 1:  # one GPU bound per task (e.g. srun --gpus-per-task=1)
        return torch.device("cuda", 0)
    raise ValueError(
        f"LOCAL_RANK={local_rank} but only {count} CUDA devices are visible; "
        f"pass device=... to init_distributed"
    )


def init_distributed(
    backend: str | None = None,
    *,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    device: torch.device | str | int | None = None,
    transport: str | None = None,
) -> TorchComm:
    """Initialize the default process group from the launcher's environment.

    Reads torchrun's or Slurm's variables (see `parse_launch_env`); with neither, makes a
    single-process world (rank 0 of 1, in-memory store) so scripts run without a launcher.
    If the default group already exists, returns a `TorchComm` over it. Every rank checks
    that the others read its world size and that no other process read its rank; on one
    node under torchrun's agent store each restart attempt meets under a prefix of its own
    (so ``--max-restarts`` works there with any rendezvous; several nodes need
    ``--rdzv-backend c10d`` and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for it).

    A process that exits without destroying its group aborts under gloo: prefer
    `with fzero.distributed() as comm:`, or call `destroy_distributed()` at the end.

    Args:
        backend: "nccl" or "gloo"; None: nccl if CUDA is available, else gloo.
        timeout: Timeout of every collective of the group (a timedelta, or seconds), and of
            the rendezvous.
        device: CUDA device for this process (NCCL); None: `cuda:LOCAL_RANK` for nccl, CPU
            otherwise. A CUDA device is made current with `torch.cuda.set_device`.
        transport: The returned comm's transport (`TorchComm`): None for the backend's
            default, ``"shm"`` for shared memory between gloo ranks of one host.

    Returns:
        A `TorchComm` over the default group.

    Raises:
        ValueError: On a missing or malformed launcher variable, no usable CUDA device, or a
            timeout not above zero.
        TypeError: A timeout neither a timedelta nor seconds.
        RuntimeError: The rendezvous failed: a rank missing past the timeout, an unreachable
            store, ranks that read different world sizes, or a rank started twice.
    """
    timeout = as_timeout(timeout) or DEFAULT_TIMEOUT  # (seconds too, as TorchComm's)
    if dist.is_initialized():
        return TorchComm(transport=transport)
    env = parse_launch_env(os.environ)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dev = _pick_device(backend, env.local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = dev
    # Under torchrun the agent may serve the store itself (its static rendezvous always, its
    # c10d one unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and keeps it across restarts. On
    # one node each attempt keeps its keys under a prefix of its own, or a restarted group
    # would read the dead workers' addresses (`env://` did: every restart failed to connect or
    # hung). Several nodes do not count attempts alike (a healthy node restarted for another's
    # failure may not count it): there `_check_restart_store` refuses restarts.
    agent = env.launcher == "torchrun" and (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    nodes = int(os.environ.get("GROUP_WORLD_SIZE") or 1)
    try:
        if agent and nodes > 1:
            _check_restart_store(os.environ)
            dist.init_process_group(init_method="env://", **kwargs)  # the agent's own store
        elif env.world_size == 1 and not agent:
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        else:
            store: dist.Store = dist.TCPStore(
                str(env.master_addr), int(env.master_port or 0),
                is_master=env.rank == 0 and not agent, timeout=timeout,
                wait_for_workers=False, multi_tenant=True)  # (as torch's: a second group in
            # this process shares the server the first one's store runs)
            if agent:
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
                store = dist.PrefixStore(f"fzero/attempt{attempt}", store)
            group = _agree_on_world_size(store, env, timeout)
            dist.init_process_group(store=dist.PrefixStore(f"fzero/{group}", store),
                                    rank=env.rank, world_size=env.world_size, **kwargs)
    except dist.DistStoreError as exc:  # the rendezvous timed out: not every rank came
        raise RuntimeError(_rendezvous_help(env, timeout)) from exc
    except dist.DistNetworkError as exc:  # this rank could not reach or open the store
        raise RuntimeError(_rendezvous_help(env, timeout, exc)) from exc
    return TorchComm(transport=transport)


_WORLD_KEY = "fzero/world_size/"
"""Store keys of `_agree_on_world_size`: each rank's world size, a mismatch a rank found,
rank 0's verdict, and the count of ranks that read it."""


def _agree_on_world_size(store: dist.Store, env: LaunchEnv, timeout: timedelta) -> int:
    """Raise on every rank when ranks read different world sizes from their environment; else
    return the number of this group among those the store's server has seen, the same on
    every rank.

    Torch's rendezvous would let each rank wait for as many peers as it read: those that read
    more wait out the timeout, and rank 0 passes and hangs in the backend's first connection
    (a gloo timeout long after, with a hint about srun that did not apply: a probe). Here every
    rank writes what it read; a rank that reads another size than rank 0's says so at once;
    rank 0 compares what arrives and publishes its verdict, which each rank reads and
    acknowledges. Rank 0 then deletes the keys, so that a later group in the same processes
    (which share the store's server) agrees afresh; the group's number keeps the backend's own
    keys apart from an earlier group's too (a second ``with fzero.distributed()`` read a dead
    group's addresses and hung in gloo's connection: a probe). Ranks beyond the world rank 0
    read cannot be waited for: they raise, and the others run as the world rank 0 read."""
    variable = "SLURM_NTASKS" if env.launcher == "slurm" else "WORLD_SIZE"
    verdict_key, mismatch_key, read_key = (f"{_WORLD_KEY}{name}"
                                           for name in ("verdict", "mismatch", "read"))
    claim_key = f"{_WORLD_KEY}claimed/{env.rank}"
    if store.add(claim_key, 1) > 1:  # (the first process of this rank goes on)
        own = "SLURM_PROCID" if env.launcher == "slurm" else "RANK"
        raise RuntimeError(
            f"rank {env.rank} was started twice: another process of this job read "
            f"{own}={env.rank} too and joined first. Every process must read a rank of its own "
            f"(under Slurm from the one `srun` that starts them all, not a RANK exported by "
            f"hand; under torchrun its own variables)")
    store.set(f"{_WORLD_KEY}{env.rank}", str(env.world_size))
    if env.rank != 0:
        first = int(store.get(f"{_WORLD_KEY}0"))
        if first != env.world_size:
            verdict = (f"rank {env.rank} read {variable}={env.world_size} but rank 0 read "
                       f"{variable}={first}")
            store.set(mismatch_key, verdict)
        else:
            verdict = store.get(verdict_key).decode()
        store.add(read_key, 1)
        if not verdict.startswith(_AGREED):
            raise RuntimeError(_WORLD_HELP.format(verdict=verdict))
        return int(verdict.removeprefix(_AGREED))
    others = [f"{_WORLD_KEY}{r}" for r in range(1, env.world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(others) and not store.check([mismatch_key]):
        if time.monotonic() > deadline:  # a rank missing: the rendezvous' help
            raise dist.DistStoreError(f"wait timeout after {timeout}, keys: {others}")
        time.sleep(0.01)
    if store.check([mismatch_key]):
        verdict = store.get(mismatch_key).decode()
    else:
        read = {r: int(store.get(key)) for r, key in enumerate(others, start=1)}
        differ = {r: n for r, n in read.items() if n != env.world_size}
        verdict = f"{_AGREED}{store.add(f'{_WORLD_KEY}groups', 1)}" if not differ else (
            f"rank 0 read {variable}={env.world_size} but rank(s) {sorted(differ)} read "
            f"{sorted(set(differ.values()))}")
    store.set(verdict_key, verdict)
    agreed = verdict.startswith(_AGREED)
    # Every rank reads the verdict before rank 0 deletes it (or, raising, exits and takes the
    # store's server with it); after a mismatch, a rank still missing gets a grace period.
    grace = timeout.total_seconds() if agreed else min(timeout.total_seconds(), 10.0)
    deadline = time.monotonic() + grace
    while store.add(read_key, 0) < len(others) and time.monotonic() < deadline:
        time.sleep(0.01)
    claims = [f"{_WORLD_KEY}claimed/{r}" for r in range(env.world_size)]
    for key in (*others, *claims, verdict_key, mismatch_key, read_key):  # (rank 0's own
        store.delete_key(key)  # stays, for a rank beyond its world that comes late: it raises)
    if not agreed:
        raise RuntimeError(_WORLD_HELP.format(verdict=verdict))
    return int(verdict.removeprefix(_AGREED))


_AGREED = "agreed: group "
"""How rank 0's verdict begins when every rank read its world size (the group's number
follows)."""


_WORLD_HELP = (
    "the processes of this job disagree on its world size: {verdict}. Every process must read "
    "the same: under Slurm, SLURM_NTASKS from the one `srun` that starts them all (not a "
    "WORLD_SIZE or SLURM_NTASKS exported by hand), under torchrun its own variables"
)


def _rendezvous_help(env: LaunchEnv, timeout: timedelta,
                     network: Exception | None = None) -> str:
    """Why a rendezvous could time out, for this launcher; `network`: the error of a rank
    that could not connect to the store (or, rank 0, open it), which a rank other than 0 got
    as torch's bare socket timeout (a probe)."""
    started = (
        "a Slurm batch script runs once; its processes start with `srun` (one task per rank: "
        "`srun python train.py` inside `sbatch --ntasks N`), and run without srun it is one "
        "process that waits for the others"
        if env.launcher == "slurm" else
        "every process must be started (torchrun --nnodes N on every node, with the same "
        "--rdzv-endpoint) and reach the rendezvous host"
    )
    where = f"({env.master_addr}:{env.master_port}, launcher {env.launcher})"
    if network is not None:
        first = str(network).strip().splitlines()[0] if str(network).strip() else ""
        return (
            f"rank {env.rank} of {env.world_size} could not connect to the rendezvous {where} "
            f"({type(network).__name__}: {first}): the store is opened by rank 0 on that host "
            f"and port; it must be started, reachable from this host, and the only program on "
            f"that port (a port in use makes rank 0 fail at once); {started}"
        )
    return (
        f"rank {env.rank} of {env.world_size} waited {timeout.total_seconds():g} s at the "
        f"rendezvous {where} and not every rank arrived: {started}"
    )


RESTART_STORE_CAUSE = (
    "the workers of a torchrun job on several nodes meet in the agent's store, which torch "
    "keeps across restarts with the dead workers' addresses (pytorch/pytorch#135712), and "
    "its nodes do not count restarts alike. Launch every node with `--rdzv-backend c10d` and "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (each attempt's rank 0 "
    "then serves a store of its own); torchrun's default static rendezvous (`--master-addr` "
    "or `--rdzv-endpoint` without `--rdzv-backend`) always shares its store"
)


def _check_restart_store(environ: Mapping[str, str]) -> None:
    """Several nodes sharing torchrun's agent store: refuse a restart, which would rendezvous
    through a stale store, and warn (global rank 0) at the first attempt of a job that allows
    restarts it could not make."""
    count = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if count not in ("", "0"):
        raise RuntimeError(f"this process is restart {count} of a torchrun job, which cannot "
                           f"rendezvous: " + RESTART_STORE_CAUSE)
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts not in ("", "0") and environ.get("RANK", "0") == "0":
        warnings.warn(f"torchrun --max-restarts {restarts}: a restart of this job would be "
                      f"refused, since " + RESTART_STORE_CAUSE, RuntimeWarning, stacklevel=3)


def destroy_distributed() -> None:
    """Destroy the default process group if there is one (no-op otherwise)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(
    backend: str | None = None,
    *,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    device: torch.device | str | int | None = None,
    transport: str | None = None,
) -> Iterator[TorchComm]:
    """`init_distributed` for a `with` block; destroys the group on exit if it created it.

    Args:
        backend: As in `init_distributed`.
        timeout: As in `init_distributed`.
        device: As in `init_distributed`.
        transport: As in `init_distributed`.

    Yields:
        A `TorchComm` over the default group.
    """
    created = not dist.is_initialized()
    comm = init_distributed(backend, timeout=timeout, device=device, transport=transport)
    try:
        yield comm
    finally:
        if created:
            destroy_distributed()

