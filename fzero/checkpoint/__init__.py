"""Sharded checkpoints: save, load at any world size / stage / bucket policy, consolidate, export.

    fzero.save(state, "ckpt/step-000100")                       # a collective: every rank
    state = fzero.load("ckpt/step-000100", model=model, comm=comm)   # any N, stage, buckets
    state_dict = fzero.consolidate("ckpt/step-000100")           # offline, one process
    fzero.checkpoint.reshard(src, dst, world_size=8)             # offline N -> M
    fzero.checkpoint.export(src, "hf_dir", model=model)          # model.safetensors for HF

A checkpoint is a directory of safetensors files, one per rank, and a JSON manifest
(`fzero.checkpoint.manifest`); every element is stored once, as the rank that owns it under
the saved layout holds it (`fzero.checkpoint.record`). Because the layout is a pure function
recorded exactly, resharding is arithmetic (`fzero.checkpoint.mapping`): each reader reads the
byte ranges it needs and nothing else. Command line: ``python -m fzero.checkpoint
{inspect,reshard,consolidate,export}``.
"""

from fzero.checkpoint.loading import load
from fzero.checkpoint.manifest import CheckpointError, Manifest, latest, read_manifest
from fzero.checkpoint.offline import consolidate, export, reshard
from fzero.checkpoint.saving import save

__all__ = [
    "CheckpointError",
    "Manifest",
    "consolidate",
    "export",
    "latest",
    "load",
    "read_manifest",
    "reshard",
    "save",
]
