"""fzero: JIT-free, functional ZeRO data parallelism (stages 1, 2, 3) for PyTorch.

Pure core: `plan` (layout), `flatten` / `unflatten` / `shard` / `unshard` (flat sharding),
`fzero.optim` (functional optimizers), `fzero.memory` (the paper's formulas). Effectful edge:
`TorchComm` / `SimWorld` (collectives).
"""

from fzero import memory, optim
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

__all__ = [
    "Bucket",
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
    "destroy_distributed",
    "distributed",
    "flatten",
    "init_distributed",
    "memory",
    "optim",
    "plan",
    "shard",
    "unflatten",
    "unshard",
]
