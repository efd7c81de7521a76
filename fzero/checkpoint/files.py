"""safetensors files, streamed: write tensors piece by piece, read byte ranges into tensors.

The files are plain safetensors (an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and ``data_offsets``, then the raw little-endian bytes), readable by
``safetensors.safe_open`` and ``transformers``. No pickle anywhere.

This module writes and reads them itself, for three reasons a checkpoint needs:

- `write_file` streams: the header comes from the tensors' specs, then each tensor's bytes
  arrive in pieces (a shard, one parameter, a slice of another file), so writing a model never
  needs more than one piece in memory; the CRC-32 is computed over the bytes as they go out,
  with no second pass.
- `ShardFile.read_into` reads an element range of a stored tensor straight into a destination
  tensor (positioned reads, no memory map), so a rank reads only the bytes it keeps and holds
  no temporary when the dtypes agree.
- `crc32` verifies a file in fixed-size chunks (bounded memory).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["CHUNK_BYTES", "DTYPE_CODES", "FileInfo", "ShardFile", "TensorSpec", "crc32",
           "fsync_dir", "write_file"]

CHUNK_BYTES = 4 << 20
"""Bytes per read when checksumming a file."""
MAX_HEADER_BYTES = 100 << 20
"""A larger header is not a safetensors file (the library's own limit)."""

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",  # (the safetensors library reads these as torch does: a complex64
    torch.uint16: "U16",     # parameter or a uint16 buffer refused a save, naming a file's
    torch.uint32: "U32",     # tensor instead, a probe)
    torch.uint64: "U64",
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class TensorSpec(NamedTuple):
    """A tensor's name, dtype and shape: everything the header needs before any byte."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        return math.prod(self.shape) * self.dtype.itemsize


class FileInfo(NamedTuple):
    """What was written: the file's size in bytes and the CRC-32 of all its bytes."""

    bytes: int
    crc32: int


def fsync_dir(path: str) -> None:
    """Flush directory `path`'s entries (files created or renamed in it) to stable storage:
    without it a power cut after a rename may lose the rename, whatever the files hold.
    ``""`` (the `os.path.dirname` of a bare file name) is the current directory."""
    try:
        fd = os.open(path or os.curdir, os.O_RDONLY)
    except OSError:
        return  # not supported (e.g. Windows): the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(
    path: str | os.PathLike[str],
    specs: Sequence[TensorSpec],
    pieces: Iterable[Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
) -> FileInfo:
    """Write a safetensors file whose tensors arrive in pieces.

    The tensors are stored in `specs` order. `pieces` yields, in that order, tensors whose
    flattened elements concatenate to each spec's tensor: one piece per tensor, or many; a
    piece never spans two tensors; empty tensors need none.

    Args:
        path: the file to create (overwritten if it exists).
        specs: name, dtype and shape of each tensor; names unique.
        pieces: the data, each piece of its tensor's dtype (any device, any layout).
        metadata: string pairs stored under ``"__metadata__"`` in the header.
        fsync: flush the file to stable storage before returning.

    Returns:
        The file's size and CRC-32.

    Raises:
        ValueError: a piece has the wrong dtype or overruns its tensor, or the pieces end
            before every tensor is complete; the partial file is removed.
    """
    header = _header(specs, metadata)
    crc = zlib.crc32(header)
    written = len(header)
    try:
        with open(path, "wb", buffering=0) as f:
            _write_all(f, header)
            index, left = 0, specs[0].nbytes if specs else 0
            for piece in pieces:
                while index < len(specs) and left == 0:
                    index += 1
                    left = specs[index].nbytes if index < len(specs) else 0
                if index == len(specs):
                    raise ValueError(f"{path}: more data than the {len(specs)} tensors declared")
                spec = specs[index]
                if piece.dtype != spec.dtype:
                    raise ValueError(
                        f"{path}: tensor {spec.name!r} is {spec.dtype}, got a piece of "
                        f"{piece.dtype}"
                    )
                data = _bytes_of(piece)
                if data.nbytes > left:
                    raise ValueError(
                        f"{path}: a piece of {data.nbytes} bytes overruns tensor {spec.name!r} "
                        f"({left} bytes left of {spec.nbytes})"
                    )
                _write_all(f, data)
                crc = zlib.crc32(data, crc)
                left -= data.nbytes
                written += data.nbytes
            while index < len(specs) and left == 0:
                index += 1
                left = specs[index].nbytes if index < len(specs) else 0
            if index < len(specs):
                raise ValueError(
                    f"{path}: data ended {left} bytes short in tensor {specs[index].name!r}"
                )
            if fsync:
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise
    return FileInfo(written, crc)


class ShardFile:
    """An open safetensors file: its header, and positioned reads of element ranges.

    Args:
        path: the file.

    Raises:
        ValueError: the file is not a well-formed safetensors file (the message names it).
        FileNotFoundError: it does not exist.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
        try:
            self.tensors, self.metadata, self._data_start = _parse_header(self._file, self.path)
        except BaseException:
            self._file.close()
            raise

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def spec(self, name: str) -> TensorSpec:
        """The stored tensor's spec."""
        dtype, shape, _ = self._entry(name)
        return TensorSpec(name, dtype, shape)

    def read_into(self, name: str, start: int, stop: int, out: Tensor) -> None:
        """``out[:] = flattened tensor name[start:stop]``, cast to ``out.dtype`` if needed.

        Reads exactly those bytes; straight into `out` when it is a contiguous CPU tensor of
        the stored dtype, else through one temporary of ``stop - start`` elements.

        Raises:
            ValueError: unknown name, range outside the tensor, or `out` of the wrong size.
        """
        dtype, shape, begin = self._entry(name)
        numel = math.prod(shape)
        if not 0 <= start <= stop <= numel or out.numel() != stop - start:
            raise ValueError(
                f"{self.path}: cannot read elements [{start}, {stop}) of {name!r} ({numel} "
                f"elements) into a tensor of {out.numel()}"
            )
        if start == stop:
            return
        direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(stop - start, dtype=dtype)
        offset = self._data_start + begin + start * dtype.itemsize
        _read_exact(self._file, _bytes_of(target), offset, self.path)
        if not direct:
            with torch.no_grad():
                out.view(-1).copy_(target)

    def read(self, name: str) -> Tensor:
        """The whole stored tensor (a new CPU tensor)."""
        dtype, shape, _ = self._entry(name)
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, 0, out.numel(), out.view(-1))
        return out

    def _entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        try:
            return self.tensors[name]
        except KeyError:
            raise ValueError(
                f"{self.path} holds no tensor {name!r} (it has {len(self.tensors)} tensors, "
                f"e.g. {sorted(self.tensors)[:5]})"
            ) from None


def crc32(path: str | os.PathLike[str], chunk_bytes: int = CHUNK_BYTES) -> int:
    """CRC-32 (zlib's) of every byte of a file, read in chunks of `chunk_bytes`."""
    crc = 0
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                return crc
            crc = zlib.crc32(view[:n], crc)


# --- helpers ---------------------------------------------------------------------------------


def _header(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None) -> bytes:
    doc: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        doc["__metadata__"] = dict(metadata)
    offset = 0
    for spec in specs:
        if spec.name in doc or spec.name == "__metadata__":
            raise ValueError(f"tensor name {spec.name!r} appears twice")
        if spec.dtype not in DTYPE_CODES:
            raise TypeError(f"dtype {spec.dtype} of {spec.name!r} has no safetensors code")
        end = offset + spec.nbytes
        doc[spec.name] = {
            "dtype": DTYPE_CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes
    return struct.pack("<Q", len(text)) + text


def _parse_header(
    f: io.FileIO, path: str
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int]], dict[str, str], int]:
    size = os.fstat(f.fileno()).st_size
    raw = f.read(8)
    if len(raw) < 8:
        raise ValueError(f"{path} is not a safetensors file: {size} bytes, shorter than a header")
    (length,) = struct.unpack("<Q", raw)
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(
            f"{path} is not a safetensors file (or is truncated): its header claims {length} "
            f"bytes, the file has {size}"
        )
    try:
        doc = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: the safetensors header is not JSON ({error})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    data_bytes = size - 8 - length
    tensors = {}
    for name, entry in doc.items():
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: malformed header entry for {name!r}: {entry!r}") from None
        if end - begin != math.prod(shape) * dtype.itemsize or not 0 <= begin <= end:
            raise ValueError(f"{path}: tensor {name!r} has inconsistent offsets {entry!r}")
        if end > data_bytes:
            raise ValueError(
                f"{path} is truncated: tensor {name!r} ends at data byte {end}, the file holds "
                f"{data_bytes} data bytes"
            )
        tensors[name] = (dtype, shape, begin)
    return tensors, metadata, 8 + length


def _bytes_of(tensor: Tensor) -> memoryview:
    """A flat byte view of a CPU copy (or the tensor itself when contiguous on CPU)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _write_all(f: io.FileIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = f.write(view)
        view = view[n:]


def _read_exact(f: io.FileIO, view: memoryview, offset: int, path: str) -> None:
    f.seek(offset)
    wanted = view.nbytes
    while view.nbytes:
        n = f.readinto(view)
        if not n:
            raise ValueError(
                f"{path} is truncated: {view.nbytes} of {wanted} bytes missing at byte "
                f"{offset + wanted - view.nbytes}"
            )
        view = view[n:]

