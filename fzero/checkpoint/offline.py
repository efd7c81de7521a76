"""Offline tools, one process and no process group: consolidate, reshard, export.

Each reads a checkpoint through `fzero.checkpoint.loading.Reader`, so it reads every stored byte
it needs once, straight into the tensor that keeps it, and holds at most one bucket (reshard),
one parameter (export) or the output itself (consolidate) at a time. Files are verified
(sizes, headers, CRC-32) before anything is read or written.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from fzero.checkpoint import record
from fzero.checkpoint.files import TensorSpec, fsync_dir, write_file
from fzero.checkpoint.loading import Reader
from fzero.checkpoint.manifest import (
    MANIFEST,
    PARTIAL_SUFFIX,
    CheckpointError,
    FileEntry,
    Manifest,
    file_metadata,
    read_pinned,
    shard_name,
)
from fzero.checkpoint.mapping import regroup
from fzero.checkpoint.saving import fzero_version, new_save_id, only_a_saves_files
from fzero.checkpoint.verify import verify
from fzero.layout import ShardLayout
from fzero.state import STAGES

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "consolidate", "export", "reshard", "write_model"]

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""Bytes above which `export` splits ``model.safetensors`` into several files plus an index
(Hugging Face's ``save_pretrained`` default is 5 GB too)."""


def consolidate(
    path: str | os.PathLike[str],
    *,
    master: bool = False,
    model: nn.Module | None = None,
    verify_checksums: bool = True,
) -> dict[str, Tensor]:
    """The full parameters and buffers of a checkpoint, as a plain state dict (offline).

    Tied parameters appear under every name, as the same tensor (``full_params`` does the
    same), and so does a buffer registered under several names. Buffers are saved rank 0's
    (under ``buffers="local"`` other ranks' differ: `fzero.load` at the saved world size
    gives each rank its own). Memory: the output, plus nothing (values are read straight into
    it).

    Args:
        path: the checkpoint directory.
        master: trainable parameters from the master copy (e.g. fp32) where one is stored.
        model: when given (any device, ``meta`` included), return exactly the keys of
            ``model.state_dict()`` in its order: persistent buffers only, so
            ``model.load_state_dict(result, strict=True)`` accepts it.
        verify_checksums: check every file's CRC-32 first.

    Returns:
        Names to tensors (CPU).

    Raises:
        CheckpointError: as `fzero.load`, or `model` has names or shapes the checkpoint lacks.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"consolidate: model must be an nn.Module or None, got "
                        f"{type(model).__name__}")
    path = os.fspath(path)
    manifest, pin = read_pinned(path)
    verify(path, manifest, checksums=verify_checksums, pin=pin)
    layout = manifest.layout
    out: dict[str, Tensor] = {}
    with Reader(path, manifest, layout, pin) as reader:
        for index, bucket in enumerate(layout.buckets):
            dtype = _master_dtype(manifest) if master and bucket.trainable else bucket.torch_dtype
            flat = torch.empty(bucket.numel, dtype=dtype)
            reader.fill(record.MASTER if master else record.PARAMS, index, flat, 0)
            for entry in bucket.entries:
                view = flat[entry.offset : entry.end].view(entry.shape)
                out.update(dict.fromkeys(entry.names, view))
        for name in manifest.buffers:
            out[name] = reader.buffer(name)
        for alias, name in manifest.buffer_aliases.items():
            out[alias] = out[name]  # one tensor under every name, as tied parameters
    if model is None:
        return out
    keys = _model_keys(path, manifest, model)
    return {name: out[name] for name in keys}


def export(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    *,
    model: nn.Module | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    verify_checksums: bool = True,
    progress: bool = False,
) -> list[str]:
    """Write a checkpoint's model as ``model.safetensors`` in `out_dir` (offline, streamed),
    replacing the weight files of an earlier export there (other files stay).

    Given `model`, the result loads with ``model.load_state_dict(safetensors.torch.load_file(
    ...), strict=True)`` and, for a Hugging Face model, ``from_pretrained(out_dir)``; without
    it, it also holds the non-persistent buffers (rotary ``inv_freq``...), which a strict
    ``load_state_dict`` refuses as unexpected keys. Above
    `max_shard_size` bytes it is split into ``model-00001-of-0000K.safetensors`` files and a
    ``model.safetensors.index.json`` (Hugging Face's sharded format). One parameter is in
    memory at a time.

    Args:
        path: the checkpoint directory.
        out_dir: the directory to write (created if needed).
        dtype: the floating dtype to write; default the stored compute dtype. Values are cast
            from the master copy where one is stored (so fp32 export of a bf16 run is exact
            for trained parameters; frozen ones have no master copy and were rounded to the
            compute dtype when the state was built, so they come out rounded).
        model: the module it is for (any device, ``meta`` included): its ``state_dict()``
            keys and order are written (tied names each, persistent buffers only), and a
            Hugging Face model's config is saved as ``config.json`` (its ``dtype``: the
            parameters' as written, so ``from_pretrained`` loads them so). Without it: every
            parameter name (aliases too) and every buffer.
        max_shard_size: bytes per file before splitting.
        verify_checksums: check every file's CRC-32 first.
        progress: print a progress bar on stderr.

    Returns:
        The files written (paths).

    Raises:
        CheckpointError: as `consolidate`.
    """
    path = os.fspath(path)
    out_dir = os.fspath(out_dir)
    if isinstance(max_shard_size, bool) or not (
            isinstance(max_shard_size, int | float) and max_shard_size > 0):
        raise ValueError(f"export: max_shard_size must be a number of bytes > 0, got "
                         f"{max_shard_size!r} (it would write one file per tensor)")
    manifest, pin = read_pinned(path)
    verify(path, manifest, checksums=verify_checksums, pin=pin)
    names = None if model is None else _model_keys(path, manifest, model)
    tensors = _plan_tensors(manifest, names, dtype)
    groups = _split(tensors, max_shard_size)
    os.makedirs(out_dir, exist_ok=True)
    # An earlier export's weights would be loaded instead of these (from_pretrained prefers
    # model.safetensors to an index; a stale shard may be listed by neither): they go first,
    # and each new file appears whole (written aside, renamed), the index last, so that an
    # interrupted export leaves an incomplete set that fails to load, never old weights.
    for name in os.listdir(out_dir):
        if _EXPORTED.fullmatch(name):
            os.remove(os.path.join(out_dir, name))
    written = []
    bar = _Progress(sum(t.spec.nbytes for t in tensors), "export", enabled=progress)
    with Reader(path, manifest, manifest.layout, pin) as reader:
        for number, group in enumerate(groups, start=1):
            name = ("model.safetensors" if len(groups) == 1
                    else f"model-{number:05d}-of-{len(groups):05d}.safetensors")
            target = os.path.join(out_dir, name)
            _write_weights(target, reader, group, bar)
            written.append(target)
    bar.close()
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(t.spec.nbytes for t in tensors)},
            "weight_map": {t.spec.name: os.path.basename(written[g])
                           for g, group in enumerate(groups) for t in group},
        }
        target = os.path.join(out_dir, "model.safetensors.index.json")
        with open(target + ".tmp", "w") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(target + ".tmp", target)
        written.append(target)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        _config_for(config, tensors, type(model).__name__).save_pretrained(out_dir)
        written.append(os.path.join(out_dir, "config.json"))
    fsync_dir(out_dir)  # the renames themselves (each weights file was flushed before its own)
    return written


def _config_for(config: Any, tensors: Sequence[_Tensor], model_class: str) -> Any:
    """A Hugging Face config as ``save_pretrained`` would write it for these tensors: its
    ``dtype`` the parameters' as written (a meta model built in float32 for a bfloat16
    checkpoint said float32, and ``from_pretrained`` loaded the bfloat16 weights as float32),
    and ``architectures`` naming the model's class where the config names none (a model built
    from a config has none, and the export could not be given back as ``--hf-model``); the
    config itself is left alone."""
    written = {t.spec.dtype for t in tensors if t.bucket >= 0 and t.spec.dtype.is_floating_point}
    dtype = written.pop() if len(written) == 1 else None
    retype = dtype is not None and getattr(config, "dtype", None) != dtype
    name = not getattr(config, "architectures", None)
    if not (retype or name):
        return config
    saved = copy.deepcopy(config)
    if retype:
        saved.dtype = dtype
    if name:
        saved.architectures = [model_class]
    return saved


def write_model(
    path: str | os.PathLike[str],
    target: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    *,
    master: bool = False,
    progress: bool = False,
    overwrite: bool = False,
) -> None:
    """Stream every parameter name and buffer of a checkpoint into one safetensors file
    (written aside, then renamed onto `target`).

    Raises:
        CheckpointError: the checkpoint is damaged, or `target` exists and not `overwrite`.
    """
    path, target = os.fspath(path), os.fspath(target)
    if os.path.lexists(target) and not overwrite:
        raise CheckpointError(f"{target} exists: pass overwrite=True (--overwrite) to replace "
                              f"it, or write to a new path")
    manifest, pin = read_pinned(path)
    verify(path, manifest, pin=pin)
    if master:
        dtype = dtype or _master_dtype(manifest)
    tensors = _plan_tensors(manifest, None, dtype)
    bar = _Progress(sum(t.spec.nbytes for t in tensors), "consolidate", enabled=progress)
    with Reader(path, manifest, manifest.layout, pin) as reader:
        _write_weights(target, reader, tensors, bar)
    bar.close()
    fsync_dir(os.path.dirname(target))


def _write_weights(target: str, reader: Reader, tensors: Sequence[_Tensor], bar: _Progress) -> None:
    """One plain safetensors file of `tensors`' values, written aside and renamed onto
    `target`, so that it appears whole or not at all."""
    write_file(target + ".tmp", [t.spec for t in tensors], _values(reader, tensors, bar),
               {"format": "pt"})
    os.replace(target + ".tmp", target)


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    world_size: int,
    stage: int | None = None,
    buckets: Any = None,
    verify_checksums: bool = True,
    progress: bool = False,
) -> Manifest:
    """Rewrite a checkpoint for another world size (and stage, and buckets), offline.

    The result is what `fzero.save` would have written from a run at `world_size`: loading it
    there needs no resharding. Per-rank RNG states are kept when the world size is unchanged
    (they belong to ranks that no longer exist otherwise). One bucket shard is in memory at a
    time.

    Args:
        src: the checkpoint directory.
        dst: the new checkpoint directory (must not exist; written atomically).
        world_size: the new number of ranks.
        stage: the stage recorded as the default for loading; default unchanged.
        buckets: None (keep the buckets), an int size cap, or lists of parameter names.
        verify_checksums: check every file's CRC-32 first.
        progress: print a progress bar on stderr.

    Returns:
        The new checkpoint's manifest.
    """
    src, dst = os.fspath(src), os.path.abspath(os.fspath(dst))
    manifest, pin = read_pinned(src)
    if stage is not None and (isinstance(stage, bool) or stage not in STAGES):
        raise ValueError(f"stage must be one of {STAGES}, got {stage=}")
    if os.path.exists(dst):
        raise CheckpointError(f"{dst} exists: reshard writes a new checkpoint")
    verify(src, manifest, checksums=verify_checksums, pin=pin)
    old = manifest.layout
    layout = regroup(old, world_size, buckets)
    saved = dict(manifest.state)
    same = [b.names for b in layout.buckets] == [b.names for b in old.buckets]
    master_dtype = _master_dtype(manifest)
    new = {
        **saved,
        "stage": saved["stage"] if stage is None else stage,
        "master": [i for i, b in enumerate(layout.buckets)
                   if b.trainable and b.torch_dtype != master_dtype]
        if saved["optimizer_state"] else [],
        "bucket_order": saved["bucket_order"] if same else None,
    }
    keep_rng = world_size == manifest.world_size
    partial = dst + PARTIAL_SUFFIX
    if not only_a_saves_files(partial):
        raise CheckpointError(f"{partial} holds other files than a checkpoint's, and reshard "
                              f"would delete them (it writes there first): move it away")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted reshard's leftovers
    os.makedirs(partial)
    total = sum(s.nbytes for r in range(world_size)
                for s in record.file_specs(layout, new, manifest.buffers, r))
    bar = _Progress(total, "reshard", enabled=progress)
    files = []
    save_id = new_save_id()  # a new checkpoint: its files are not the source's
    with Reader(src, manifest, layout, pin) as reader:
        for rank in range(world_size):
            specs = record.file_specs(layout, new, manifest.buffers, rank)
            rng = manifest.files[rank].rng if keep_rng else ()
            rng_tensors = [reader.file(rank).read(name) for name in rng]
            specs += [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in zip(rng, rng_tensors,
                                                                              strict=True)]
            name = shard_name(rank, world_size)
            pieces = _shards(reader, layout, new, manifest, rank, bar)
            info = write_file(os.path.join(partial, name), specs, _chain(pieces, rng_tensors),
                              metadata=file_metadata(save_id, rank))
            files.append(FileEntry(name, rank, info.bytes, info.crc32, tuple(rng)))
    bar.close()
    result = Manifest(
        world_size=world_size, layout=layout, state=new, buffers=manifest.buffers,
        files=tuple(files), extra=manifest.extra, fzero_version=fzero_version(),
        torch_version=torch.__version__, save_id=save_id,
    )
    with open(os.path.join(partial, MANIFEST), "w") as f:
        f.write(result.to_json())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(partial)  # as `fzero.save`: the files' entries, then the rename, reach the disk
    os.rename(partial, dst)
    fsync_dir(os.path.dirname(dst))
    return result


# --- helpers ---------------------------------------------------------------------------------


_EXPORTED = re.compile(
    r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?(\.tmp)?")
"""The weight files `export` writes (and Hugging Face's save_pretrained), and their temporary
names: what an earlier export into the same directory left."""


class _Tensor(NamedTuple):
    spec: TensorSpec  # the output name, dtype and shape
    bucket: int  # where it is stored: bucket index and element offset (-1: a buffer)
    offset: int
    source: str  # the stored name (a parameter's first name, or the buffer's)


def _plan_tensors(
    manifest: Manifest, names: Sequence[str] | None, dtype: torch.dtype | None
) -> list[_Tensor]:
    """What to write, in order: every name of every parameter, then every buffer's (its
    aliases last, as `consolidate`)."""
    located = manifest.layout.locate()
    buffer_owner = manifest.buffer_aliases
    if names is None:
        names = [*located, *manifest.buffers, *buffer_owner]
    out = []
    for name in names:
        if name in located:
            index, entry = located[name]
            stored = manifest.layout.buckets[index].torch_dtype
            target = dtype if dtype is not None and stored.is_floating_point else stored
            out.append(_Tensor(TensorSpec(name, target, entry.shape), index, entry.offset,
                               entry.name))
        else:
            source = buffer_owner.get(name, name)
            stored_dtype, shape = manifest.buffers[source]
            buffer_dtype = getattr(torch, stored_dtype)
            if dtype is not None and buffer_dtype.is_floating_point:
                buffer_dtype = dtype
            out.append(_Tensor(TensorSpec(name, buffer_dtype, shape), -1, 0, source))
    return out


def _values(reader: Reader, tensors: Sequence[_Tensor], bar: _Progress) -> Iterator[Tensor]:
    for t in tensors:
        if t.bucket < 0:
            value = reader.buffer(t.source).to(t.spec.dtype)
        else:
            value = torch.empty(t.spec.shape, dtype=t.spec.dtype)
            reader.fill(record.PARAMS, t.bucket, value.view(-1), t.offset)
        bar.advance(t.spec.nbytes)
        yield value


def _shards(
    reader: Reader, layout: ShardLayout, new: dict[str, Any], manifest: Manifest, rank: int,
    bar: _Progress,
) -> Iterator[Tensor]:
    for kind, index in record.stored_kinds(new, layout):
        bucket = layout.buckets[index]
        out = torch.empty(bucket.shard_numel,
                          dtype=record.stored_dtype(new, layout, kind, index))
        reader.fill(kind, index, out, bucket.shard_range(rank)[0])
        bar.advance(out.numel() * out.element_size())
        yield out
    if rank == 0 or new.get("rank_buffers", False):
        # Each rank's own buffers where the world size is kept; else rank 0's for every rank.
        source = rank if manifest.world_size == layout.world_size else 0
        for name in manifest.buffers:
            value = reader.buffer(name, rank=source)
            bar.advance(value.numel() * value.element_size())
            yield value


def _chain(first: Iterator[Tensor], rest: Sequence[Tensor]) -> Iterator[Tensor]:
    yield from first
    yield from rest


def _split(tensors: Sequence[_Tensor], limit: int) -> list[list[_Tensor]]:
    groups: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.spec.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.spec.nbytes
    return groups


def _model_keys(path: str, manifest: Manifest, model: nn.Module) -> list[str]:
    """``model.state_dict()``'s keys, after checking the checkpoint has each, same shape."""
    wanted = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    located = manifest.layout.locate()
    have = {name: entry.shape for name, (_, entry) in located.items()}
    have.update({name: shape for name, (_, shape) in manifest.buffers.items()})
    have.update({alias: manifest.buffers[name][1]
                 for alias, name in manifest.buffer_aliases.items()})
    missing = sorted(set(wanted) - set(have))
    # A smaller model (fewer layers) would take a part of the trained parameters silently.
    dropped = sorted(set(located) - set(wanted))
    shapes = sorted(f"{n}: {list(have[n])} vs {list(s)}" for n, s in wanted.items()
                    if n in have and have[n] != s)
    if missing or dropped or shapes:
        raise CheckpointError(
            f"{os.path.join(path, MANIFEST)} is not a checkpoint of this model: state_dict keys "
            f"missing from it: {missing[:8]}; its parameters the model lacks: {dropped[:8]}"
            f"{f' ({len(dropped)} in all)' if len(dropped) > 8 else ''}; shapes differing "
            f"(checkpoint vs model): {shapes[:8]}"
        )
    return list(wanted)


def _master_dtype(manifest: Manifest) -> torch.dtype:
    return getattr(torch, manifest.state["master_dtype"])


class _Progress:
    """A one-line progress bar on stderr (redrawn at most ten times a second)."""

    def __init__(self, total: int, label: str, *, enabled: bool) -> None:
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.done = 0
        self.start = self.last = time.perf_counter()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            width = 30
            filled = width * min(self.done, self.total) // self.total
            rate = self.done / max(now - self.start, 1e-9) / 1e9
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB {rate:.2f} GB/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
