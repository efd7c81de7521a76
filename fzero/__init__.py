"""fzero: JIT-free, functional ZeRO data parallelism (stages 1, 2, 3) for PyTorch.

Pure core: `plan` (layout), `flatten` / `unflatten` / `shard` / `unshard` (flat sharding),
`fzero.optim` (functional optimizers), `fzero.memory` (the paper's formulas). Effectful edge:
`TorchComm` / `SimWorld` (collectives).
"""

from fzero import checkpoint, memory, optim
from fzero.checkpoint import consolidate, load, save
from fzero.collect import Collectives, EmulatedStreams, Pending, Streams, collectives
from fzero.comm import CollectiveError, CollectiveTimeout, Comm, CommCounters, Work
from fzero.consensus import StepError
from fzero.flat import bucket_shards, flatten, shard, unflatten, unshard
from fzero.launch import destroy_distributed, distributed, init_distributed
from fzero.layout import Bucket, Entry, ShardLayout, plan
from fzero.residency import OutsideOwnerError
from fzero.simworld import SimComm, SimWorld, SimWorldError
from fzero.state import LossScale, ShardState, clone_state, init
from fzero.step import (
    MicroBatches,
    decay_matrices,
    full_params,
    make_eval_step,
    make_train_step,
)
from fzero.torchcomm import TorchComm

__all__ = [
    "Bucket",
    "CollectiveError",
    "CollectiveTimeout",
    "Collectives",
    "Comm",
    "CommCounters",
    "EmulatedStreams",
    "Entry",
    "LossScale",
    "MicroBatches",
    "OutsideOwnerError",
    "Pending",
    "ShardLayout",
    "ShardState",
    "SimComm",
    "SimWorld",
    "SimWorldError",
    "StepError",
    "Streams",
    "TorchComm",
    "Work",
    "bucket_shards",
    "checkpoint",
    "clone_state",
    "collectives",
    "consolidate",
    "decay_matrices",
    "destroy_distributed",
    "distributed",
    "flatten",
    "full_params",
    "init",
    "init_distributed",
    "load",
    "make_eval_step",
    "make_train_step",
    "memory",
    "optim",
    "plan",
    "save",
    "shard",
    "unflatten",
    "unshard",
]
