"""fzero: JIT-free, functional ZeRO data parallelism (stages 1, 2, 3) for PyTorch.

Pure core: `plan` (layout), `flatten` / `unflatten` / `shard` / `unshard` (flat sharding),
`fzero.optim` (functional optimizers), `fzero.memory` (the paper's formulas). Effectful edge:
`TorchComm` / `SimWorld` (collectives).
"""

from fzero import memory, optim
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
    "CollectiveError",
    "CollectiveTimeout",
    "EmulatedStreams",
    "MicroBatches",
    "OutsideOwnerError",
    "StepError",
    "clone_state",
    "decay_matrices",
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
    "collectives",
    "full_params",
    "init",
    "make_eval_step",
    "make_train_step",
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
