"""The checkpoint manifest: one JSON file that says what every shard file holds (pure).

A checkpoint is a directory::

    step-000100/
        manifest.json                      written last, by rank 0
        shard-00000-of-00004.safetensors   rank 0's shards (and the buffers, once)
        shard-00001-of-00004.safetensors
        ...

``manifest.json`` holds the format and its version, the fzero and torch versions that wrote
it, the world size, the layout (buckets, entries, offsets, padding, aliases, frozen flags: the
exact `ShardLayout` JSON), the state's static part (stage, step, dtypes, optimizer name and
hyperparameters, loss scale, learned stage-3 bucket order: `fzero.checkpoint.record`), the
buffers' dtypes and shapes, each file's size and CRC-32 and the names of the RNG states it
holds, the user's own JSON (``extra``), and the save's random id. Each shard file names, in its
safetensors metadata, the save that wrote it and the rank whose shards it holds (`file_metadata`):
a file renamed, swapped with another rank's or copied in from another checkpoint is found from
its header alone, also when a load skips the checksums (which read every byte).
"""

from __future__ import annotations

import json
import math
import os
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fzero.layout import ShardLayout

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "CheckpointError",
    "FileEntry",
    "Manifest",
    "Pin",
    "check_json",
    "file_metadata",
    "latest",
    "read_manifest",
    "read_pinned",
    "shard_name",
]

FORMAT = "fzero.checkpoint"
VERSION = 1
"""The format version this fzero writes and reads (it refuses newer ones)."""
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
"""A save in progress (or interrupted) writes into ``<path>.partial`` and renames it at the end."""
SAVE_ID_KEY = "fzero.save_id"
"""A shard file's metadata key: the id of the save that wrote it (`Manifest.save_id`)."""
RANK_KEY = "fzero.rank"
"""A shard file's metadata key: the rank whose shards it holds."""


def file_metadata(save_id: str, rank: int) -> dict[str, str]:
    """The safetensors metadata of rank `rank`'s shard file written by save `save_id`."""
    return {SAVE_ID_KEY: save_id, RANK_KEY: str(rank)}


class CheckpointError(ValueError):
    """A checkpoint cannot be read as asked: the message names the file and the problem."""


@dataclass(frozen=True)
class FileEntry:
    """One shard file: its name in the directory, its rank, size, CRC-32 and RNG tensors."""

    name: str
    rank: int
    bytes: int
    crc32: int
    rng: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` (see the module docstring)."""

    world_size: int
    layout: ShardLayout
    state: dict[str, Any]
    buffers: dict[str, tuple[str, tuple[int, ...]]]
    files: tuple[FileEntry, ...]
    extra: dict[str, Any] = field(default_factory=dict)
    fzero_version: str = "unknown"
    torch_version: str = "unknown"
    version: int = VERSION
    save_id: str | None = None
    """The save's random id, also in every shard file's metadata (None: a checkpoint written
    before fzero recorded it)."""

    @property
    def stage(self) -> int:
        """The stage the state was trained with (a load's default)."""
        return self.state["stage"]

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.state["step"]

    @property
    def nbytes(self) -> int:
        """Bytes of all shard files."""
        return sum(f.bytes for f in self.files)

    @property
    def buffer_aliases(self) -> dict[str, str]:
        """Each further name of a buffer registered under several, to the name it is stored
        under (none in a checkpoint written before fzero recorded them)."""
        return dict(self.state.get("buffer_aliases", ()))

    def to_json(self) -> str:
        """The manifest's JSON text; `Manifest.from_json` is its inverse."""
        doc = {
            "format": FORMAT,
            "version": self.version,
            "fzero_version": self.fzero_version,
            "torch_version": self.torch_version,
            "world_size": self.world_size,
            "state": self.state,
            "layout": json.loads(self.layout.to_json(indent=None)),
            "buffers": {n: {"dtype": d, "shape": list(s)} for n, (d, s) in self.buffers.items()},
            "files": [
                {"name": f.name, "rank": f.rank, "bytes": f.bytes, "crc32": f.crc32,
                 "rng": list(f.rng)}
                for f in self.files
            ],
            "extra": self.extra,
        }
        if self.save_id is not None:
            doc["save_id"] = self.save_id
        doc["crc32"] = _doc_crc32(doc)
        return json.dumps(doc, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "manifest") -> Manifest:
        """Parse a manifest; `where` (its path) goes into every error message.

        Raises:
            CheckpointError: not JSON, not an fzero checkpoint, a newer format version, or a
                malformed field.
        """
        try:
            doc = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{where} is not JSON ({error}): not an fzero checkpoint "
                                  f"manifest, or a damaged one") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise CheckpointError(f"{where} is not an fzero checkpoint manifest (format {got!r}, "
                                  f"expected {FORMAT!r})")
        version = doc.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise CheckpointError(
                f"{where} has checkpoint format version {version!r}, newer than the version "
                f"{VERSION} this fzero reads (it was written by fzero "
                f"{doc.get('fzero_version', '?')}): upgrade fzero to load it"
            )
        if "crc32" in doc:  # (manifests written before fzero stored it have none)
            stored = doc.pop("crc32")
            if stored != _doc_crc32(doc):
                shown = f"{stored:#010x}" if isinstance(stored, int) else repr(stored)
                raise CheckpointError(
                    f"{where} fails its checksum (CRC-32 of its content "
                    f"{_doc_crc32(doc):#010x}, it records {shown}): the manifest is damaged "
                    f"or was edited, and the step, settings and file list it gives cannot be "
                    f"trusted")
        try:
            layout = ShardLayout.from_json(json.dumps(doc["layout"]))
            files = tuple(
                FileEntry(f["name"], int(f["rank"]), int(f["bytes"]), int(f["crc32"]),
                          tuple(f.get("rng", ())))
                for f in doc["files"]
            )
            buffers = {n: (b["dtype"], tuple(b["shape"])) for n, b in doc["buffers"].items()}
            manifest = cls(
                world_size=int(doc["world_size"]), layout=layout, state=dict(doc["state"]),
                buffers=buffers, files=files, extra=dict(doc.get("extra") or {}),
                fzero_version=str(doc.get("fzero_version", "unknown")),
                torch_version=str(doc.get("torch_version", "unknown")), version=version,
                save_id=_optional_str(doc.get("save_id"), "save_id"),
            )
            for name in ("stage", "step", "master_dtype", "optimizer_state", "moments",
                         "master", "loss_scale", "bucket_order"):
                manifest.state[name]  # noqa: B018 (presence check)
            stage, step = manifest.state["stage"], manifest.state["step"]
            if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
                raise ValueError(f"stage {stage!r} is not one of 0, 1, 2, 3")
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"step {step!r} is not a count of steps")
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"{where} is malformed: {type(error).__name__}: {error}"
            ) from None
        if layout.world_size != manifest.world_size or [f.rank for f in files] != list(
            range(manifest.world_size)
        ):
            raise CheckpointError(
                f"{where} is malformed: world size {manifest.world_size}, layout world size "
                f"{layout.world_size}, files for ranks {[f.rank for f in files]}"
            )
        return manifest


def _optional_str(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{what} {value!r} is not a string")
    return value


def _doc_crc32(doc: Mapping[str, Any]) -> int:
    """CRC-32 of a manifest's content (every field but the CRC itself, in a canonical form:
    sorted keys, no whitespace), so that one flipped bit anywhere in it is noticed."""
    canonical = json.dumps({k: v for k, v in doc.items() if k != "crc32"}, sort_keys=True,
                           separators=(",", ":"))
    return zlib.crc32(canonical.encode())


def shard_name(rank: int, world_size: int) -> str:
    """The file name of rank `rank`'s shards."""
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


class Pin:
    """The directory a checkpoint path named when its manifest was read (device, inode).

    `fzero.save` with ``overwrite=True`` renames a new directory into place: a reader that
    opened shard files by name after that would read the new files under the old manifest.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.identity = _identity(path)

    @property
    def moved(self) -> bool:
        """Whether `path` now names another directory (or none)."""
        return _identity(self.path) != self.identity

    def check(self) -> None:
        """Raise `error()` if `moved`."""
        if self.moved:
            raise self.error()

    def error(self) -> CheckpointError:
        """The error for a checkpoint replaced while it was being read."""
        return CheckpointError(
            f"{self.path} was replaced while it was being read (a save with overwrite=True to "
            f"the same path, e.g. by the training job): what was read may mix the two "
            f"checkpoints, so nothing was loaded. Read it again (or read a path no job "
            f"overwrites)")


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def read_pinned(path: str | os.PathLike[str]) -> tuple[Manifest, Pin]:
    """`read_manifest`, and a `Pin` of the directory it was read from."""
    path = os.fspath(path)
    pin = Pin(path)
    manifest = read_manifest(path)
    pin.check()
    return manifest, pin


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and parse the manifest of the checkpoint directory `path`.

    Raises:
        CheckpointError: `path` does not exist, is not a directory, or holds no valid
            fzero manifest (the message says what it looks like instead).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        hint = ""
        if os.path.isfile(os.path.join(path + ".old", MANIFEST)):
            hint = (f" ({path}.old holds the checkpoint an overwriting save renamed away before "
                    f"it was interrupted: rename it back, or load {path}.old)")
        elif os.path.exists(path + PARTIAL_SUFFIX):
            hint = f" ({path}{PARTIAL_SUFFIX} exists: a save that did not finish)"
        raise CheckpointError(f"no checkpoint at {path}: no such file or directory{hint}")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not an fzero checkpoint (a directory with "
                              f"{MANIFEST})")
    where = os.path.join(path, MANIFEST)
    if not os.path.isfile(where):
        names = sorted(os.listdir(path))
        looks = ""
        if ".metadata" in names:
            looks = " (it has a .metadata file: a torch.distributed.checkpoint directory?)"
        elif "model.safetensors" in names or "model.safetensors.index.json" in names:
            looks = " (it has model.safetensors: an exported model, load it with from_pretrained " \
                    "or load_state_dict)"
        elif any(os.path.isfile(os.path.join(path, n, MANIFEST)) for n in names):
            newest = _newest(path, on_damaged=lambda damaged, error: None)  # (only skipped)
            looks = (f" (it holds checkpoints, the newest {newest}: a run's directory? "
                     f"fzero.checkpoint.latest(path) finds that one)") if newest else ""
        raise CheckpointError(f"{path} is not an fzero checkpoint: it has no {MANIFEST}{looks}")
    with open(where, "rb") as f:
        return Manifest.from_json(f.read(), where)


def latest(root: str | os.PathLike[str]) -> str | None:
    """The complete checkpoint under `root` with the highest step, or None if there is none.

    Looks at `root`'s subdirectories that hold a readable manifest; interrupted saves
    (``*.partial``) are skipped, and so are damaged checkpoints (a manifest that cannot be
    read), each with a `RuntimeWarning` naming it: a resume from an older checkpoint than the
    newest is not silent.

    Raises:
        CheckpointError: `root` is a checkpoint itself (its subdirectories hold none, and a
            resume would silently start afresh), or a file.
    """
    root = os.fspath(root)
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"latest: {root} is a file, not a directory of checkpoints "
                              f"(None would have meant starting afresh, and the first save "
                              f"under it failing)")
    if not os.path.isdir(root):
        return None
    if os.path.isfile(os.path.join(root, MANIFEST)):
        raise CheckpointError(
            f"latest: {root} is a checkpoint itself, not a directory of checkpoints (None "
            f"would have meant starting afresh): pass its parent, or load it directly"
        )
    return _newest(root, on_damaged=lambda path, error: warnings.warn(
        f"latest: skipping {path}, whose manifest cannot be read ({error})", RuntimeWarning,
        stacklevel=4))  # (the lambda, _newest, latest, its caller)


def _newest(root: str, on_damaged: Callable[[str, CheckpointError], None]) -> str | None:
    """The complete checkpoint under `root` with the highest step; a damaged one is passed to
    `on_damaged` and skipped (a callback, not a warnings filter: filters are process-wide, and
    changing them for one call would change them for every thread)."""
    best: tuple[int, str] | None = None
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.endswith(PARTIAL_SUFFIX) or not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        try:
            step = read_manifest(path).step
        except CheckpointError as error:
            on_damaged(path, error)
            continue
        if best is None or step >= best[0]:
            best = (step, path)
    return None if best is None else best[1]


def check_json(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """`extra` as a plain dict, after checking it survives a JSON round trip unchanged: JSON
    values only, dict keys strings, lists not tuples (JSON would make a key ``1`` the string
    ``"1"``, merging it with a key ``"1"``, and a tuple a list)."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a mapping of JSON values, got {type(extra).__name__}")
    problem = _json_change(extra, "extra")
    if problem:
        raise TypeError(f"extra must come back from JSON as saved: {problem}")
    try:
        return json.loads(json.dumps(dict(extra), allow_nan=False))
    except (TypeError, ValueError) as error:
        raise TypeError(f"extra must hold JSON values only (str, numbers, lists, dicts): "
                        f"{error}") from None


def _json_change(value: Any, where: str) -> str | None:
    """Where and how a JSON round trip would change `value` (None: it would not)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if type(key) is not str:
                return (f"{where} has the key {key!r} ({type(key).__name__}), which JSON "
                        f"stores as the string {json.dumps(str(key))}: use str keys")
            problem = _json_change(item, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            problem = _json_change(item, f"{where}[{index}]")
            if problem:
                return problem
        return None
    if isinstance(value, tuple):
        return f"{where} is a tuple, which JSON stores as a list: use a list"
    if type(value) is float and not math.isfinite(value):
        return (f"{where} is {value!r}, which JSON has no value for (Python writes it as "
                f"{json.dumps(value)}, which JSON parsers other than Python's refuse, with the "
                f"whole manifest): store None, a string, or a finite number")
    if value is None or type(value) in (str, int, float, bool):
        return None
    if isinstance(value, str | int | float):  # a subclass: an enum, a numpy scalar
        plain = next(t for t in (str, int, float) if isinstance(value, t)).__name__
        return (f"{where} is a {type(value).__name__}, which JSON stores as a plain {plain}: "
                f"convert it")
    return None  # not JSON at all: json.dumps names it
