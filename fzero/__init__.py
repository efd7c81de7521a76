"""fzero: JIT-free, functional ZeRO data parallelism (stages 1, 2, 3) for PyTorch.

Pure core: `plan` (layout), `flatten` / `unflatten` / `shard` / `unshard` (flat sharding),
`fzero.optim` (functional optimizers), `fzero.memory` (the paper's formulas). Effectful edge:
`TorchComm` / `SimWorld` (collectives).
"""

from fzero import checkpoint, memory, optim
from fzero.checkpoint import consolidate, load, save
from fzero.collect import Collectives, Pending, Streams, collectives
from fzero.comm import (
    Comm,
    CommCounters,
    TorchComm,
    Work,
    destroy_distributed,
    distributed,
    init_distributed,
)
from fzero.flat import bucket_shards, flatten, shard, unflatten, unshard
from fzero.layout import Bucket, Entry, ShardLayout, plan
from fzero.simworld import SimComm, SimWorld, SimWorldError
from fzero.state import LossScale, ShardState, init
from fzero.step import full_params, make_eval_step, make_train_step

__all__ = [
    "Bucket",
    "Collectives",
    "LossScale",
    "Pending",
    "ShardState",
    "Streams",
    "Comm",
    "CommCounters",
    "Entry",
    "ShardLayout",
    "SimComm",
    "SimWorld",
    "SimWorldError",
    "TorchComm",
    "Work",
    "bucket_shards",
    "checkpoint",
    "collectives",
    "consolidate",
    "full_params",
    "init",
    "make_eval_step",
    "make_train_step",
    "destroy_distributed",
    "distributed",
    "flatten",
    "init_distributed",
    "load",
    "memory",
    "optim",
    "plan",
    "save",
    "shard",
    "unflatten",
    "unshard",
]
