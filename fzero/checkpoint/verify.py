"""Checking a checkpoint's files before anything is built from them.

Every shard file must exist, have the size the manifest records, be the file of the rank and
save the manifest names (its metadata says which), hold exactly the tensors the manifest
implies (names, dtypes, sizes) and match its CRC-32. The cheap checks (existence and
size) run everywhere; reading a file's header and all its bytes happens once per file: in one
process for the offline tools, or spread over the ranks of a load (file f by rank f mod M, so
at an unchanged world size each rank checks the file it is about to read, and the page cache
serves the read), the verdicts then shared with one all-reduce so that every rank raises the
same error or none does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from fzero.checkpoint import record
from fzero.checkpoint.files import ShardFile, crc32
from fzero.checkpoint.manifest import (
    RANK_KEY,
    SAVE_ID_KEY,
    CheckpointError,
    FileEntry,
    Manifest,
    Pin,
)
from fzero.comm import Comm

__all__ = ["verify"]

_OK, _HEADER, _CHECKSUM, _FOREIGN, _SWAPPED, _CONTENTS = range(6)
_VERDICTS = {  # what a rank that did not check the file says of each problem
    _HEADER: "has a malformed header or cannot be read: the checkpoint is damaged",
    _CHECKSUM: "fails its checksum: the checkpoint is damaged",
    _FOREIGN: ("was written by another save than the manifest's: a file copied in from "
               "another checkpoint"),
    _SWAPPED: ("holds another rank's shards than the manifest lists: shard files were renamed "
               "or swapped"),
    _CONTENTS: "does not hold the tensors the manifest says: the checkpoint is not as saved",
}
"""The problems a rank finds in a file, by code: the ranks share only the codes (one all-reduce),
so each code must say what happened as well as the finding rank's own message does."""


def verify(
    path: str, manifest: Manifest, comm: Comm | None = None, *, checksums: bool = True,
    pin: Pin | None = None,
) -> None:
    """Raise `CheckpointError` naming the first bad file of checkpoint `path`, if any.

    Args:
        path: the checkpoint directory.
        manifest: its manifest.
        comm: share the work over these ranks (a collective: all must call); None: this
            process checks every file.
        checksums: also read every byte and compare CRC-32s (headers are always checked).
        pin: the directory the manifest was read from: if `path` names another one now, a
            file that does not match is not damage but another checkpoint, and the error
            says so (`Pin.error`).
    """
    try:
        _verify(path, manifest, comm, checksums)
    except CheckpointError:
        if pin is not None and pin.moved:
            raise pin.error() from None
        raise


def _verify(path: str, manifest: Manifest, comm: Comm | None, checksums: bool) -> None:
    for entry in manifest.files:
        _check_present(path, entry)
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world_size)
    codes = [_OK] * len(manifest.files)
    mine: dict[int, str] = {}
    for index in range(rank, len(manifest.files), world):
        try:
            problem = _check_contents(path, manifest, manifest.files[index], checksums)
        except OSError as error:  # unreadable: every rank must still reach the all-reduce
            problem = _HEADER, f"{os.path.join(path, manifest.files[index].name)}: {error}"
        if problem is not None:
            codes[index], mine[index] = problem
    if comm is not None:
        device = getattr(comm, "device", torch.device("cpu"))
        shared = torch.tensor(codes, dtype=torch.int64, device=device)
        comm.all_reduce(shared, op="max")
        codes = shared.tolist()
    for index, code in enumerate(codes):
        if code == _OK:
            continue
        if index in mine:
            raise CheckpointError(mine[index])
        name = os.path.join(path, manifest.files[index].name)
        raise CheckpointError(
            f"{name} {_VERDICTS[code]} (found by rank {index % world}, whose error has the "
            f"details)"
        )


def _check_present(path: str, entry: FileEntry) -> None:
    name = os.path.join(path, entry.name)
    try:
        size = os.stat(name).st_size
    except FileNotFoundError:
        raise CheckpointError(
            f"{name} is missing: the manifest lists it as rank {entry.rank}'s shard file"
        ) from None
    if size != entry.bytes:
        what = "truncated" if size < entry.bytes else "longer than written"
        raise CheckpointError(
            f"{name} is {size} bytes but the manifest records {entry.bytes}: the file is {what} "
            f"(copied partly, or replaced)"
        )


def _check_contents(
    path: str, manifest: Manifest, entry: FileEntry, checksums: bool
) -> tuple[int, str] | None:
    """None, or ``(code, message)`` for the file's first problem."""
    name = os.path.join(path, entry.name)
    try:
        with ShardFile(name) as f:
            found = {k: (dtype, shape) for k, (dtype, shape, _) in f.tensors.items()}
            metadata = f.metadata
    except ValueError as error:
        return _HEADER, str(error)
    stranger = _stranger(metadata, manifest, entry)
    if stranger:
        return stranger[0], f"{name} {stranger[1]}: the checkpoint is not as it was saved"
    expected = record.file_specs(manifest.layout, manifest.state, manifest.buffers, entry.rank)
    problems = _differences(found, [(s.name, s.dtype, s.shape) for s in expected], entry.rng)
    if problems:
        return _CONTENTS, f"{name} does not hold what the manifest says: {problems}"
    if checksums:
        actual = crc32(name)
        if actual != entry.crc32:
            return _CHECKSUM, (f"{name} fails its checksum: CRC-32 {actual:#010x}, the manifest "
                               f"records {entry.crc32:#010x}: the file is corrupt")
    return None


def _stranger(metadata: object, manifest: Manifest, entry: FileEntry) -> tuple[int, str] | None:
    """``(code, what)`` the file's own metadata says against the manifest; None where nothing
    (also for files written before fzero recorded its save id and rank there)."""
    meta = metadata if isinstance(metadata, dict) else {}
    saved, rank = meta.get(SAVE_ID_KEY), meta.get(RANK_KEY)
    if manifest.save_id is not None and saved is not None and saved != manifest.save_id:
        return _FOREIGN, (f"was written by another save (id {saved}) than the manifest's (id "
                          f"{manifest.save_id}): a file copied in from another checkpoint")
    if rank is not None and rank != str(entry.rank):
        return _SWAPPED, (f"holds rank {rank}'s shards, but the manifest lists it as rank "
                          f"{entry.rank}'s: shard files were renamed or swapped")
    return None


def _differences(
    found: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    expected: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    rng: Sequence[str],
) -> str:
    problems = []
    wanted = {}
    for key, dtype, shape in expected:
        wanted[key] = True
        if key not in found:
            problems.append(f"no tensor {key!r}")
        elif found[key] != (dtype, shape):
            problems.append(f"{key!r} is {found[key][0]} {list(found[key][1])}, expected "
                            f"{dtype} {list(shape)}")
    for key in rng:
        wanted[key] = True
        if key not in found:
            problems.append(f"no RNG state {key!r}")
    extra = sorted(set(found) - set(wanted))
    if extra:
        problems.append(f"unexpected tensors {extra[:5]}")
    return "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
