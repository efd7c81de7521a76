"""`save`: every rank writes its shards; the checkpoint appears only once all of them have.

[Note: atomic save]
All files go into ``<path>.partial``. Rank 0 creates that directory (removing the leftovers
of an interrupted save), every rank writes its shard file there and reports its size and
CRC-32 with one all-gather; only when every rank succeeded does rank 0 write the manifest and
rename ``<path>.partial`` to ``<path>`` (with ``overwrite=True`` an existing ``<path>`` is
renamed to ``<path>.old`` first and removed after). A crash before the rename leaves no
``<path>`` at all, and any earlier checkpoint untouched; `fzero.checkpoint.latest` ignores
``*.partial`` directories. A ``<path>.partial`` or ``<path>.old`` that holds anything but a
save's files (the manifest, shard files) is a folder of the user's: it is never deleted, and
the save raises naming it. Each decision that could go differently on different ranks (rank
0's directory operations, a rank's write) is shared by a collective first, so that every rank
raises the same error or none does. Ranks must share the filesystem (as
``torch.distributed.checkpoint``'s file writer assumes).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Mapping, Sequence
from importlib import metadata as importlib_metadata
from typing import Any

import torch
from torch import Tensor

from fzero.checkpoint import record
from fzero.checkpoint.files import DTYPE_CODES, TensorSpec, fsync_dir, write_file
from fzero.checkpoint.manifest import (
    MANIFEST,
    PARTIAL_SUFFIX,
    CheckpointError,
    FileEntry,
    Manifest,
    check_json,
    file_metadata,
    shard_name,
)
from fzero.comm import Comm, fingerprint_check
from fzero.state import ShardState, check_live, lost_writes, params_fingerprint

__all__ = ["fzero_version", "new_save_id", "only_a_saves_files", "save"]

_OK, _EXISTS, _FAILED, _NOT_CHECKPOINT = 0, 1, 2, 3  # rank 0's verdicts, broadcast
_SHARD_FILE = re.compile(r"shard-\d{5}-of-\d{5}\.safetensors")


def _raise_flagged(rows: Sequence[Sequence[int]], column: int, own: Exception | None,
                   what: str) -> None:
    """Raise on every rank when a rank flagged a problem in `column` of the gathered `rows`:
    its own error `own` on such a rank, a `CheckpointError` naming them (`what`, formatted
    with their list) on the others."""
    flagged = [rank for rank, row in enumerate(rows) if row[column]]
    if flagged:
        if own is not None:
            raise own
        raise CheckpointError(f"save: {what.format(flagged)} (their own error says why); "
                              f"nothing was written")


def save(
    state: ShardState,
    path: str | os.PathLike[str],
    *,
    extra: Mapping[str, Any] | None = None,
    optimizer_state: bool = True,
    overwrite: bool = False,
) -> None:
    """Save a training state as a sharded checkpoint directory (a collective).

    Each rank writes its shard of every parameter, master-copy and moment bucket, whatever its
    stage kept whole (so every element is written once), its buffers (under
    ``buffers="local"`` each rank's differ) and its RNG states; rank 0 also writes the
    manifest. See the module's note: the checkpoint appears atomically, once every rank has
    finished.

    Args:
        state: this rank's state; every rank of its comm must call `save`.
        path: the checkpoint directory to create, e.g. ``"ckpt/step-000100"``.
        extra: JSON data to keep in the manifest (e.g. a data sampler's position), read back
            with ``fzero.checkpoint.read_manifest(path).extra``. Rank 0's is stored.
        optimizer_state: store the master copy and optimizer moments (False: only the
            parameters, which `load` accepts with ``weights_only=True``).
        overwrite: replace an existing checkpoint at `path` (a path that exists and is not a
            checkpoint is never replaced).

    Raises:
        CheckpointError: `path` exists (without `overwrite`, or is not a checkpoint), or a
            rank failed to write (every rank raises, naming the ranks; the partial directory is
            removed), or the parameters hold a write through ``.data`` that training would
            drop (apart from their master copy, or different between ranks at stages 0-2).
        TypeError: `extra` is not JSON data, or a JSON round trip would change it (a
            key not a str, a tuple).
    """
    if not isinstance(state, ShardState):
        raise TypeError(f"save needs a ShardState (from fzero.init or fzero.load), got "
                        f"{type(state).__name__}")
    _check_storable(state)
    comm = state.config.comm
    bad_extra: TypeError | None = None
    try:
        extra = check_json(extra)
    except TypeError as error:  # raised below, on every rank
        bad_extra = error
    # A consumed state (one a train step updated in place) would be stored under the wrong
    # step, and a resume would repeat a step; every rank learns whether any rank's is, and
    # whether any rank's `extra` is no JSON data.
    # Parameters a step would not keep, which a checkpoint must not make look like its own:
    # a write through .data its master copy lacks (a step raised on it and left it there),
    # or parameters that differ between ranks at stages 0-2 (each rank writes only its part).
    live = state.lease.consumed_by is None
    check_failed: Exception | None = None
    try:  # reads (and, apart from a master, casts) every shard: may fail here only (an OOM)
        written = lost_writes(state) if live else []
        fingerprint = params_fingerprint(state) if live else None
    except Exception as error:  # raised below, on every rank
        written, fingerprint, check_failed = [], None, error
    rows = _gather(comm, [state.lease.consumed_by or 0, int(bad_extra is not None),
                          int(bool(written)),
                          int(fingerprint) if fingerprint is not None else 0,
                          int(check_failed is not None)],
                   label="of fzero.save's checks of the states")
    _raise_flagged(rows, 4, check_failed, "rank(s) {} could not check their parameters")
    consumed = [row[0] for row in rows]
    if any(consumed):
        if state.lease.consumed_by is not None:
            check_live(state, "save")  # raises this rank's own error
        raise CheckpointError(
            f"save: the state of rank(s) {[r for r, c in enumerate(consumed) if c]} was "
            f"consumed by a train step; save the state that step returned")
    if any(row[2] for row in rows) or len({row[3] for row in rows}) > 1:
        apart = [r for r, row in enumerate(rows) if row[2]]
        differ = [r for r, row in enumerate(rows) if row[3] != rows[0][3]]
        here = (f" (this rank: buckets {[state.layout.buckets[i].label for i in written]})"
                if written else "")
        found = ([f"rank(s) {apart} hold parameters apart from their master copy{here}"]
                 if apart else [])
        found += ([f"rank(s) {differ} hold full parameters that differ from rank 0's (a "
                   f"write that reached some ranks' copies only)"] if differ else [])
        raise CheckpointError(
            f"save: the parameters hold a write outside a train step (through .data, an "
            f"in-place write in an eval step's forward, or a tree_map over the state such as "
            f"an EMA's lerp_ of parameters that have a separate master copy) which training "
            f"would drop or the ranks do not share: {'; '.join(found)}. A checkpoint would "
            f"store it as if it were trained state; nothing was written. Rebuild the state "
            f"(the last checkpoint, or fzero.init from fzero.full_params(state, master=True)) "
            f"and drop the write")
    _raise_flagged(rows, 1, bad_extra, "extra= of rank(s) {} is not JSON data")
    path = os.path.abspath(os.fspath(path))
    partial = path + PARTIAL_SUFFIX
    described = record.describe(state, optimizer_state=optimizer_state)
    buffers = record.describe_buffers(state)
    # Every rank writes its own file from its own arguments, and rank 0 describes them all in
    # the manifest: ranks that disagree would write a checkpoint that cannot be loaded.
    # (param_dtype=None and the model's own dtype build the same layout: rank 0's is recorded)
    call = {"path": path, "optimizer_state": repr(optimizer_state),
            "overwrite": repr(overwrite), "the layout": state.layout.fingerprint,
            "the state's lineage (which state it is)": repr(state.lineage),
            "the state's description (step, optimizer, dtypes, loss scale)": repr(
                {k: v for k, v in described.items() if k != "param_dtype"}),
            "the buffers": repr(buffers)}
    try:
        fingerprint_check(comm, repr(tuple(call.values())), "save call", parts=call)
    except ValueError as error:
        raise CheckpointError(f"save: {error}; nothing was written") from None

    # 1. rank 0 prepares the partial directory; everyone learns whether it could.
    code, failure = _prepare(path, partial, overwrite) if comm.rank == 0 else (_OK, None)
    drawn = int(new_save_id(), 16) if comm.rank == 0 else 0  # shared with the verdict
    code, shared = _share(comm, code, drawn, label=f"of fzero.save({path!r})'s start (rank 0 "
                                                    f"created the partial directory)")
    save_id = f"{shared:016x}"  # rank 0's: every file and the manifest name this save
    if code == _EXISTS:
        raise CheckpointError(f"{path} exists: pass overwrite=True to replace it, or save to a "
                              f"new path")
    if code == _NOT_CHECKPOINT:
        raise CheckpointError(
            f"{path} exists and is not a checkpoint (no {MANIFEST}): overwrite=True replaces "
            f"a checkpoint only, never another file or folder (a run directory given by "
            f"mistake would be deleted); save to a new path")
    if code != _OK:
        raise CheckpointError(failure or f"rank 0 could not create {partial}: see its error")

    # 2. every rank writes its shard file.
    tensors = record.shard_tensors(state, optimizer_state=optimizer_state)
    tensors += record.buffer_tensors(state)
    rng = _rng_states(state.config.device)
    specs = record.file_specs(state.layout, described, buffers, comm.rank)
    specs += [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in rng]
    name = shard_name(comm.rank, comm.world_size)
    error: BaseException | None = None
    try:
        info = write_file(os.path.join(partial, name), specs, [t for _, t in tensors + rng],
                          metadata=file_metadata(save_id, comm.rank))
        report = [1, info.bytes, info.crc32]
    except Exception as caught:  # shared below: the other ranks must not wait forever
        error, report = caught, [0, 0, 0]
    reports = _gather(comm, report, label=f"of fzero.save({path!r})'s file reports (each rank "
                                          f"wrote its file)")
    failed = [rank for rank, (ok, _, _) in enumerate(reports) if not ok]
    if failed:
        if comm.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        message = f"saving {path} failed on ranks {failed}; nothing was written"
        raise CheckpointError(message + (f": {error}" if error else "")) from error

    # 3. rank 0 writes the manifest and renames the directory into place.
    if comm.rank == 0:
        manifest = Manifest(
            world_size=comm.world_size,
            layout=state.layout,
            state=described,
            buffers=buffers,
            files=tuple(
                FileEntry(shard_name(rank, comm.world_size), rank, size, crc,
                          tuple(n for n, _ in rng))
                for rank, (_, size, crc) in enumerate(reports)
            ),
            extra=extra,
            fzero_version=fzero_version(),
            torch_version=torch.__version__,
            save_id=save_id,
        )
        failure = _publish(manifest, path, partial)
    verdict = _share(comm, _OK if failure is None else _FAILED,
                     label=f"of fzero.save({path!r})'s verdict (rank 0 renamed the checkpoint "
                           f"into place before: it is complete where rank 0 said nothing else)")
    if verdict[0] != _OK:
        raise CheckpointError(failure or f"rank 0 could not publish {path}: see its error")


def _check_storable(state: ShardState) -> None:
    """Raise, naming them, if parameters or buffers have a dtype no safetensors file holds
    (complex128, complex32...): the file's own error named the bucket's tensor ('params.0').
    Every rank holds the same dtypes, so every rank raises, before any collective."""
    bad = [f"{entry.name} ({bucket.dtype})" for bucket in state.layout.buckets
           if bucket.torch_dtype not in DTYPE_CODES for entry in bucket.entries]
    bad += [f"{name} ({str(b.dtype).removeprefix('torch.')}, a buffer)"
            for name, b in state.buffers.items() if b.dtype not in DTYPE_CODES]
    if bad:
        raise TypeError(
            f"save: {bad[:5]}{' ...' if len(bad) > 5 else ''} have a dtype no safetensors "
            f"file holds; nothing was written. Store such a tensor as one of another dtype "
            f"(a complex128 one as float64 of shape (..., 2), torch.view_as_real)")


def new_save_id() -> str:
    """A new save's id: 16 hex digits of 63 random bits (so that it fits an int64 when rank 0
    shares it). Drawn from the OS, not torch's generator, which a save must not advance."""
    return f"{secrets.randbits(63):016x}"


def fzero_version() -> str:
    """The installed fzero's version ("unknown" when it runs from a source tree)."""
    try:
        return importlib_metadata.version("fzero")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def _prepare(path: str, partial: str, overwrite: bool) -> tuple[int, str | None]:
    if os.path.exists(path) and not overwrite:
        return _EXISTS, None
    if os.path.lexists(path) and not (os.path.isdir(path) and not os.path.islink(path)
                                      and os.path.isfile(os.path.join(path, MANIFEST))):
        return _NOT_CHECKPOINT, None
    if not only_a_saves_files(partial):
        return _FAILED, (f"{partial} holds other files than a save writes, and a save would "
                         f"delete them (it writes there first): move it away")
    try:
        shutil.rmtree(partial, ignore_errors=True)  # an interrupted save's leftovers
        os.makedirs(partial)
    except OSError as error:
        return _FAILED, f"cannot create {partial}: {error}"
    return _OK, None


def _publish(manifest: Manifest, path: str, partial: str) -> str | None:
    try:
        with open(os.path.join(partial, MANIFEST), "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(partial)
        if os.path.exists(path):
            old = path + ".old"
            if not only_a_saves_files(old):
                return (f"cannot publish {path}: {old} holds other files than a checkpoint's, "
                        f"and overwrite=True would delete them (it renames {path} there for a "
                        f"moment): move it away; the new checkpoint waits in {partial}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            os.rename(partial, path)
            shutil.rmtree(old)
        else:
            os.rename(partial, path)
        fsync_dir(os.path.dirname(path))
    except OSError as error:
        return f"cannot publish {path}: {error}"
    return None


def only_a_saves_files(directory: str) -> bool:
    """Whether `directory` is absent, or a directory that holds nothing but what a save writes
    (the manifest, shard files): the leftovers of an interrupted or superseded save, which a
    save deletes. Anything else there (a user's own ``<path>.old``) is not deleted."""
    if not os.path.lexists(directory):
        return True
    if os.path.islink(directory) or not os.path.isdir(directory):
        return False
    return all(name == MANIFEST or _SHARD_FILE.fullmatch(name) for name in os.listdir(directory))


def _rng_states(device: torch.device) -> list[tuple[str, Tensor]]:
    states = [("rng.cpu", torch.get_rng_state())]
    if device.type == "cuda":
        states.append(("rng.cuda", torch.cuda.get_rng_state(device)))
    return states


def _share(comm: Comm, *values: int, label: str) -> list[int]:
    """Rank 0's `values` (int64s), on every rank (`label`: for a collective error)."""
    tensor = torch.tensor(values, dtype=torch.int64, device=_device(comm))
    comm.broadcast(tensor, src=0, label=label)
    return tensor.tolist()


def _gather(comm: Comm, values: list[int], label: str) -> list[tuple[int, ...]]:
    """Every rank's `values` (a fixed-length list of ints), on every rank."""
    mine = torch.tensor(values, dtype=torch.int64, device=_device(comm))
    every = torch.empty(comm.world_size * len(values), dtype=torch.int64, device=_device(comm))
    comm.all_gather(every, mine, label=label)
    rows = every.view(comm.world_size, len(values)).tolist()
    return [tuple(row) for row in rows]


def _device(comm: Comm) -> torch.device:
    return torch.device(getattr(comm, "device", "cpu"))
