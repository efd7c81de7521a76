"""Checkpoint behaviours that no test pinned down: a mutation pass over fzero/checkpoint changed
one line at a time, and each test here pins a behaviour a mutant broke without any test
failing. Saving (overwrite=, <path>.partial, <path>.old, symlinks), verifying shard files
without their checksums, and the offline tools (consolidate, export, reshard, write_model).
Tiny models, SimWorld with one or two ranks."""

from __future__ import annotations

import json
import os
import struct
import time
from typing import Any
from unittest import mock

import pytest
import torch

import fzero
from fzero.checkpoint import CheckpointError, loading, offline, read_manifest

from models import seeded

LINEAR_BYTES = 4 * (4 * 3 + 3 + 3 * 2 + 2)  # fp32 Linear(4, 3) + Linear(3, 2): 92 bytes


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


class WithBuffers(torch.nn.Module):
    """Floating parameters and buffers besides an integer buffer (BatchNorm's
    num_batches_tracked) and, with `ids`, an integer parameter."""

    def __init__(self, ids: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        if ids:
            self.ids = torch.nn.Parameter(torch.arange(5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def _save_body(comm: Any, model: torch.nn.Module, path: str, kwargs: dict[str, Any]) -> None:
    state = fzero.init(model, stage=1, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm)
    fzero.save(state, path, **kwargs)


def _outcome_body(comm: Any, model: torch.nn.Module, path: str,
                  kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """Save; ``None``, or ``(type, message)`` of what the save raised."""
    try:
        _save_body(comm, model, path, kwargs)
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error)
    return None


def save(path: Any, *, world: int = 2, seed: int = 0, model: Any = None, **kwargs: Any) -> None:
    fzero.SimWorld(world).run(_save_body, model or small_model(seed), str(path), kwargs)


def save_outcomes(path: Any, *, world: int = 2, seed: int = 0,
                  **kwargs: Any) -> list[tuple[str, str] | None]:
    return fzero.SimWorld(world).run(_outcome_body, small_model(seed), str(path), kwargs)


def _overwrite_on_rank0_body(comm: Any, path: str) -> tuple[str, str] | None:
    return _outcome_body(comm, small_model(1), path,
                         {"overwrite": comm.rank == 0, "extra": {"run": "second"}})


# ----------------------------------------------------------------------------------------------
# Saving


def test_ranks_that_disagree_on_overwrite_raise_and_keep_the_checkpoint(tmp_path) -> None:
    """overwrite= was left out of the save call's cross-rank fingerprint: with rank 0
    passing overwrite=True and rank 1 False, the ranks went on with different plans (one
    replacing the checkpoint, one refusing). Every rank must raise naming overwrite before
    anything is written, and the old checkpoint must stay."""
    path = str(tmp_path / "c")
    save(path, extra={"run": "first"})
    before = {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)}
    outcomes = fzero.SimWorld(2).run(_overwrite_on_rank0_body, path)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None and outcome[0] == "CheckpointError", outcome
        assert f"they differ in: overwrite (this rank: {rank == 0})" in outcome[1], outcome
        assert "nothing was written" in outcome[1]
    assert read_manifest(path).extra == {"run": "first"}
    assert {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)} == before
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_leftover_old_folder_of_a_save_does_not_break_overwrite(tmp_path) -> None:
    """An overwrite interrupted just after moving the old checkpoint aside leaves
    ``<path>.old`` holding a save's files. The next save(overwrite=True) must clear it and
    succeed; without that, renaming the checkpoint onto the non-empty ``c.old`` failed and
    every later overwrite raised."""
    path = tmp_path / "c"
    save(path, seed=0, extra={"run": "first"})
    old = tmp_path / "c.old"
    old.mkdir()
    (old / "shard-00001-of-00002.safetensors").write_bytes(b"leftover")
    assert save_outcomes(path, seed=1, overwrite=True, extra={"run": "second"}) == [None, None]
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert read_manifest(str(path)).extra == {"run": "second"}


def test_a_users_file_named_like_a_shard_in_partial_is_kept(tmp_path) -> None:
    """``<path>.partial`` is cleared only when it holds nothing but a save's files, by
    exact name: a user's ``shard-00000-of-00002.safetensors.bak`` matched the shard-file
    pattern as a prefix and was deleted. It must be kept, and the save must raise naming
    ``c.partial``."""
    path = tmp_path / "c"
    partial = tmp_path / "c.partial"
    partial.mkdir()
    mine = partial / "shard-00000-of-00002.safetensors.bak"
    mine.write_text("user's backup")
    outcomes = save_outcomes(path)
    assert all(o is not None and o[0] == "CheckpointError" for o in outcomes), outcomes
    assert "c.partial holds other files than a save writes" in outcomes[0][1], outcomes
    assert mine.read_text() == "user's backup"
    assert sorted(os.listdir(partial)) == [mine.name]
    assert not path.exists()


def test_overwrite_refuses_a_symlink_to_a_checkpoint(tmp_path) -> None:
    """save(overwrite=True) to a symlink pointing at a checkpoint counted the link as a
    checkpoint and replaced the link (moving it aside, renaming a new directory onto its
    name). It must refuse, as for any path that is not a checkpoint directory, leaving the
    link and its target as they were."""
    real, link = tmp_path / "real", tmp_path / "link"
    save(real, seed=0, extra={"run": "first"})
    link.symlink_to(real)
    outcomes = save_outcomes(link, seed=1, overwrite=True)
    for outcome in outcomes:
        assert outcome is not None and outcome[0] == "CheckpointError", outcome
        assert "link exists and is not a checkpoint" in outcome[1], outcome
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert read_manifest(str(real)).extra == {"run": "first"}


# ----------------------------------------------------------------------------------------------
# Shard files checked without their checksums


def test_a_shard_file_longer_than_written_is_refused_without_the_checksums(tmp_path) -> None:
    """Only a file shorter than the manifest records was refused: one with bytes
    appended (copied over another, or partly replaced) passed the size check and, with
    verify_checksums=False, was read as if whole."""
    path = tmp_path / "c"
    save(path)
    shard = path / "shard-00001-of-00002.safetensors"
    size = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match=rf"shard-00001-of-00002.safetensors is {size + 16} "
                                              rf"bytes but the manifest records {size}: the file "
                                              r"is longer than written"):
        fzero.consolidate(path, verify_checksums=False)


def _relabel(file: Any, key: str, field: str, value: Any) -> None:
    """Rewrite one field of a safetensors header in place, keeping the header's length."""
    with open(file, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header[key][field] = value
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > n:  # make room: drop the metadata (files of older fzero had none)
        header.pop("__metadata__")
        text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n, "no room in the header's padding"
    with open(file, "wb") as f:
        f.write(data[:8] + text + b" " * (n - len(text)) + data[8 + n:])


@pytest.mark.parametrize(("key", "field", "value"), [
    pytest.param("params.0", "dtype", "I32", id="V08-dtype"),
    pytest.param("buffers.bn.running_mean", "shape", [2, 2], id="V07-shape"),
])
def test_a_relabelled_shard_header_is_refused_without_the_checksums(tmp_path, key, field,
                                                                    value) -> None:
    """With verify_checksums=False, comparing each file's header with what the
    manifest implies is the only guard. Without the dtype comparison, float parameters
    relabelled int32 (same size) were read as int32 bits and cast: garbage weights; without
    the shape comparison, a (4,) running_mean relabelled (2, 2) came back as a (2, 2)
    buffer."""
    path = tmp_path / "c"
    save(path, world=1, model=WithBuffers())
    assert fzero.consolidate(path, verify_checksums=False)["bn.running_mean"].shape == (4,)
    _relabel(path / "shard-00000-of-00001.safetensors", key, field, value)
    with pytest.raises(CheckpointError, match="does not hold what the manifest says"):
        fzero.consolidate(path, verify_checksums=False)


# ----------------------------------------------------------------------------------------------
# consolidate, export, reshard, write_model


def test_consolidate_and_export_for_a_model_of_other_shapes_name_the_shapes(tmp_path) -> None:
    """With model=, the checkpoint's tensors are matched to the model's state_dict by
    name: a model with the same names but other shapes got the checkpoint's tensors under its
    names (a state_dict its load_state_dict rejects, or an export for another model). Both
    must raise naming the differing shapes, and export must write nothing."""
    path = tmp_path / "c"
    save(path)  # Linear(4, 3), Linear(3, 2)
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    shapes = r"shapes differing \(checkpoint vs model\): \[.*'0.weight: \[3, 4\] vs \[5, 4\]'"
    with pytest.raises(CheckpointError, match=shapes):
        fzero.consolidate(path, model=other)
    with pytest.raises(CheckpointError, match=shapes):
        fzero.checkpoint.export(path, tmp_path / "hf", model=other)
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_consolidate_and_export_for_a_smaller_model_name_what_it_lacks(tmp_path) -> None:
    """The model's keys were checked against the checkpoint, not the reverse: a checkpoint of
    two layers exported for a one-layer model wrote half the trained parameters, and
    ``from_pretrained`` of it loaded without a word (a probe, with GPT-2 configs). Both
    raise, naming the parameters the model lacks; export writes nothing."""
    path = tmp_path / "c"
    save(path)  # Linear(4, 3), Linear(3, 2)
    smaller = torch.nn.Sequential(torch.nn.Linear(4, 3))
    lacks = r"its parameters the model lacks: \['1.bias', '1.weight'\]"
    with pytest.raises(CheckpointError, match=lacks):
        fzero.consolidate(path, model=smaller)
    with pytest.raises(CheckpointError, match=lacks):
        fzero.checkpoint.export(path, tmp_path / "hf", model=smaller)
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_export_to_bfloat16_keeps_integer_parameters_and_buffers_integer(tmp_path) -> None:
    """export(dtype=) casts floating tensors only: casting BatchNorm's
    num_batches_tracked or an integer parameter (token ids) to bfloat16 wrote a model that
    load_state_dict takes with the wrong dtype (and values above 256 rounded)."""
    safetensors = pytest.importorskip("safetensors.torch")
    path = tmp_path / "c"
    save(path, model=WithBuffers(ids=True))
    fzero.checkpoint.export(path, tmp_path / "hf", dtype=torch.bfloat16)
    written = safetensors.load_file(tmp_path / "hf" / "model.safetensors")
    dtypes = {name: t.dtype for name, t in written.items()}
    assert dtypes["bn.num_batches_tracked"] == torch.int64, dtypes
    assert dtypes["ids"] == torch.int64, dtypes
    assert torch.equal(written["ids"], torch.arange(5))
    for name in ("lin.weight", "lin.bias", "bn.weight", "bn.running_mean", "bn.running_var"):
        assert dtypes[name] == torch.bfloat16, (name, dtypes)


class WithOddDtypes(torch.nn.Module):
    """A frozen complex parameter (`complex_dtype`) and a uint16 buffer beside a Linear."""

    def __init__(self, complex_dtype: torch.dtype = torch.complex64) -> None:
        super().__init__()
        with seeded(0):  # (built in SimWorld's rank threads: one seeded block at a time)
            self.lin = torch.nn.Linear(4, 3)
            self.phase = torch.nn.Parameter(torch.randn(3, dtype=complex_dtype),
                                            requires_grad=False)
        self.register_buffer("counts", torch.tensor([1, 65535, 7], dtype=torch.uint16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.phase.abs().to(x.dtype) + self.counts.to(x.dtype)


def _round_trip_body(comm: Any, path: str) -> dict[str, torch.Tensor]:
    model = WithOddDtypes()
    state = fzero.init(model, stage=3, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm)
    fzero.save(state, path)
    loaded = fzero.load(path, model=WithOddDtypes(), comm=comm)
    return {**fzero.full_params(loaded), **loaded.buffers}


def test_a_complex64_parameter_and_a_uint16_buffer_are_saved_bitwise(tmp_path) -> None:
    """safetensors holds complex64 and uint16 (C64, U16): save refused them, naming the file's
    tensor ('params.0') instead of the parameter (a probe). Now they load back bitwise, and
    consolidate writes them with their dtypes."""
    want = WithOddDtypes()
    for out in fzero.SimWorld(2).run(_round_trip_body, str(tmp_path / "c")):
        assert out["phase"].dtype == torch.complex64 and out["counts"].dtype == torch.uint16
        assert torch.equal(out["phase"], want.phase) and torch.equal(out["counts"], want.counts)
    full = fzero.checkpoint.consolidate(tmp_path / "c")
    assert torch.equal(full["phase"], want.phase) and torch.equal(full["counts"], want.counts)


def test_a_dtype_no_safetensors_file_holds_is_named_before_anything_is_written(tmp_path) -> None:
    outs = fzero.SimWorld(2).run(_outcome_body, WithOddDtypes(torch.complex128),
                                 str(tmp_path / "c"), {})
    for out in outs:
        assert out is not None and out[0] == "TypeError", out
        assert "['phase (complex128)']" in out[1] and "nothing was written" in out[1], out
    assert not os.path.exists(tmp_path / "c") and not os.path.exists(tmp_path / "c.partial")


def test_export_removes_tmp_files_of_an_interrupted_export(tmp_path) -> None:
    """An export interrupted mid-file leaves ``model*.safetensors.tmp`` files; the next
    export into the same directory must remove them with the earlier export's weights (they
    were left there for good), and keep the user's other files."""
    path, out = tmp_path / "c", tmp_path / "hf"
    save(path)
    out.mkdir()
    for name in ("model.safetensors.tmp", "model-00001-of-00002.safetensors.tmp"):
        (out / name).write_bytes(b"half an earlier export")
    (out / "notes.txt").write_text("keep me")
    fzero.checkpoint.export(path, out)
    assert sorted(os.listdir(out)) == ["model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"


def test_export_max_shard_size_is_inclusive(tmp_path) -> None:
    """Weights totalling exactly max_shard_size bytes fit in one model.safetensors (a
    file splits only when it would grow past the limit, as in transformers' own sharding);
    splitting at ``>=`` wrote two files for a model that fits the limit."""
    path = tmp_path / "c"
    save(path)
    files = fzero.checkpoint.export(path, tmp_path / "hf", max_shard_size=LINEAR_BYTES)
    assert [os.path.basename(f) for f in files] == ["model.safetensors"]
    files = fzero.checkpoint.export(path, tmp_path / "hf", max_shard_size=LINEAR_BYTES - 1)
    assert len(files) > 2 and "model.safetensors.index.json" in map(os.path.basename, files)


def test_a_sharded_exports_index_gives_the_total_size_of_all_tensors(tmp_path) -> None:
    """The index's metadata.total_size must be the bytes of every tensor written (over
    all files), not of the first file's only (what a loader's memory planning reads)."""
    safe_open = pytest.importorskip("safetensors").safe_open
    path, out = tmp_path / "c", tmp_path / "hf"
    save(path)
    fzero.checkpoint.export(path, out, max_shard_size=60)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1, index
    actual = 0
    for name in files:
        with safe_open(str(out / name), "pt") as f:
            actual += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size()
                          for k in f.keys())
    assert actual == LINEAR_BYTES
    assert index["metadata"]["total_size"] == LINEAR_BYTES


def test_reshard_into_an_existing_destination_raises_and_writes_nothing(tmp_path) -> None:
    """reshard writes a new checkpoint: into an existing one it wrote all of
    ``dst.partial`` and then failed renaming it (leaving the partial folder behind), and into
    an empty folder it silently wrote there. Both must raise up front, naming dst, write no
    ``dst.partial``, and leave dst as it was."""
    src, dst, empty = tmp_path / "c", tmp_path / "r", tmp_path / "empty"
    save(src)
    fzero.checkpoint.reshard(src, dst, world_size=1)
    before = {n: os.path.getmtime(dst / n) for n in os.listdir(dst)}
    empty.mkdir()
    for target in (dst, empty):
        with pytest.raises(CheckpointError, match=f"{target} exists: reshard writes a new"):
            fzero.checkpoint.reshard(src, target, world_size=3)
    assert sorted(os.listdir(tmp_path)) == ["c", "empty", "r"]
    assert {n: os.path.getmtime(dst / n) for n in os.listdir(dst)} == before
    assert read_manifest(str(dst)).world_size == 1
    assert os.listdir(empty) == []


def test_an_interrupted_write_model_leaves_the_previous_file(tmp_path, monkeypatch) -> None:
    """write_model(overwrite=True) writes aside and renames onto the target: writing
    in place, a read error on the second tensor left the previous model.safetensors
    destroyed (half-written or removed)."""
    path, target = tmp_path / "c", tmp_path / "model.safetensors"
    save(path)
    offline.write_model(path, target)
    before = target.read_bytes()
    real_fill, calls = loading.Reader.fill, []

    def failing_fill(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise OSError("simulated I/O error")
        return real_fill(self, *args, **kwargs)

    monkeypatch.setattr(loading.Reader, "fill", failing_fill)
    with pytest.raises(OSError, match="simulated I/O error"):
        offline.write_model(path, target, overwrite=True)
    assert target.read_bytes() == before
    assert len(calls) == 2


class DiskEvents:
    """Records, in order, every ``os.fsync`` (by the real path of the file or directory it
    flushed) and every ``os.rename`` / ``os.replace`` (Linux: the path of a descriptor comes
    from /proc/self/fd)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, ...]] = []
        real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

        def fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def moving(real: Any) -> Any:
            def move(src: Any, dst: Any) -> None:
                real(src, dst)
                self.events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
            return move

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", moving(real_rename))
        monkeypatch.setattr(os, "replace", moving(real_replace))

    def check_durable(self) -> int:
        """Assert that everything renamed was flushed before its rename (a directory: its
        entries and every file in it) and that the directory it landed in was flushed after;
        the number of renames checked."""
        renames = [(i, e[1], e[2]) for i, e in enumerate(self.events) if e[0] == "rename"]
        for at, src, dst in renames:
            before = {e[1] for e in self.events[:at] if e[0] == "fsync"}
            after = {e[1] for e in self.events[at + 1:] if e[0] == "fsync"}
            assert src in before, f"{src} renamed to {dst} before it was flushed"
            if os.path.isdir(dst):
                for name in os.listdir(dst):
                    assert os.path.join(src, name) in before, f"{name} in {src} not flushed"
            assert os.path.dirname(dst) in after, f"{os.path.dirname(dst)} not flushed after " \
                                                  f"{dst} appeared in it"
        return len(renames)


def test_save_reshard_export_and_write_model_reach_the_disk_before_they_return(
        tmp_path, monkeypatch) -> None:
    """A power cut right after any of them returns must not lose what it wrote: every file is
    flushed before it is renamed into place, and the directory it lands in after. reshard
    never flushed its new directory nor the parent around its rename, export neither its
    index nor its directory, write_model not the directory, all unlike fzero.save. Relative
    paths: the directory flushed after the rename is then the current one."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd (Linux) to name the flushed descriptors")
    monkeypatch.chdir(tmp_path)
    events = DiskEvents(monkeypatch)
    save("c")
    assert events.check_durable() == 1
    events.events.clear()
    fzero.checkpoint.reshard("c", "r", world_size=3)
    assert events.check_durable() == 1
    events.events.clear()
    fzero.checkpoint.export("c", "hf", max_shard_size=60)
    assert events.check_durable() > 2  # the weights files and the index
    events.events.clear()
    offline.write_model("c", "model.safetensors")
    assert events.check_durable() == 1


def test_inspect_counts_frozen_parameters_in_its_memory_table(tmp_path) -> None:
    """`inspect`'s table took only the trainable parameters (and bucket 0's element size):
    a fine-tuning checkpoint with a large frozen base read as a fraction of its memory (a
    probe). Now every stored bucket counts, by the paper's formulas with frozen parameters
    holding their values only: fp32 AdamW, at N = 2, stage 0 = 16 Ψ_trainable + 4 Ψ_frozen,
    stage 3 half of that."""
    from fzero.checkpoint.__main__ import describe

    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    model[0].requires_grad_(False)
    path = tmp_path / "c"
    save(path, model=model)
    text = describe(str(path), read_manifest(path), [2])
    row = next(line.split() for line in text.splitlines() if line.startswith("2 "))
    trainable, frozen = 100 * 10 + 10, 100 * 100 + 100
    stage0, stage3 = 16 * trainable + 4 * frozen, (16 * trainable + 4 * frozen) / 2
    assert float(row[1]) * 1e9 == pytest.approx(stage0, rel=1e-5)
    assert float(row[4]) * 1e9 == pytest.approx(stage3, rel=1e-5)
    assert "1,010 trainable" in text and "10,100 frozen" in text


class _Rotary(torch.nn.Module):
    """A linear layer scaled by a non-persistent buffer derived from a setting (as rotary
    embeddings' ``inv_freq`` is from ``rope_theta``)."""

    def __init__(self, theta: float) -> None:
        super().__init__()
        with seeded(0):
            self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("inv_freq", torch.full((3,), 1.0 / theta), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))  # persistent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.inv_freq


def _load_buffers(comm: Any, path: str, theta: float, meta: bool) -> dict[str, torch.Tensor]:
    state = fzero.init(_Rotary(100.0), stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    state.buffers["count"].fill_(7)
    fzero.save(state, path)
    model = _Rotary(theta)
    if meta:
        model.to("meta")
    return dict(fzero.load(path, model=model, comm=comm).buffers)


@pytest.mark.parametrize("meta", [False, True], ids=["materialized", "meta"])
def test_load_takes_non_persistent_buffers_from_the_model_as_torch_does(tmp_path,
                                                                        meta: bool) -> None:
    """torch's ``load_state_dict`` leaves non-persistent buffers as the model built them: a
    model built with another setting (``rope_theta``) computes with its own ``inv_freq``.
    `load` took the checkpoint's, silently (a probe). Persistent buffers come from the
    checkpoint; a model on meta has no values of its own, so there the checkpoint's are kept."""
    buffers = fzero.SimWorld(2).run(_load_buffers, str(tmp_path / "c"), 10.0, meta)[0]
    assert int(buffers["count"]) == 7
    want = 1.0 / (100.0 if meta else 10.0)
    assert torch.equal(buffers["inv_freq"], torch.full((3,), want))


def test_a_save_that_a_rank_does_not_join_names_the_save(tmp_path) -> None:
    """A save's collectives had no label: a rank that died or stalled during a save showed as
    a bare "all_gather #18, rank 0 of 3" (a probe). Each now names the save and its step."""
    path = str(tmp_path / "c")

    def body(comm: Any) -> str | None:
        state = fzero.init(torch.nn.Linear(3, 2), stage=1, comm=comm,
                           optimizer=fzero.optim.sgd(lr=0.1))
        if comm.rank == 1:
            return None  # never calls save
        with pytest.raises(fzero.CollectiveError) as info:
            fzero.save(state, path)
        return str(info.value)

    message = fzero.SimWorld(2, timeout=5.0).run(body)[0]
    assert "of fzero.save's checks of the states" in message, message
    assert not os.path.exists(path)
    # rank 1 stalls writing its file: rank 0 times out waiting for the file reports
    from fzero.checkpoint import saving

    write_file = saving.write_file

    def slow_rank_1(target: str, *args: Any, **kwargs: Any) -> Any:
        if os.path.basename(target).startswith("shard-00001"):
            time.sleep(3.0)
        return write_file(target, *args, **kwargs)

    def stalled(comm: Any) -> str:
        state = fzero.init(torch.nn.Linear(3, 2), stage=1, comm=comm,
                           optimizer=fzero.optim.sgd(lr=0.1))
        with pytest.raises(fzero.CollectiveError) as info:
            fzero.save(state, path)
        return str(info.value)

    with mock.patch.object(saving, "write_file", slow_rank_1):
        message = fzero.SimWorld(2, timeout=1.5).run(stalled)[0]
    assert f"of fzero.save({path!r})'s file reports (each rank wrote its file)" in message
    assert not os.path.exists(path)


def _narrow_master_body(comm: Any, path: str) -> dict[str, torch.Tensor]:
    with seeded(0):
        model = torch.nn.Linear(4, 3)
    state = fzero.init(model, stage=1, optimizer=fzero.optim.sgd(lr=0.1), comm=comm,
                       master_dtype=torch.float16)
    fzero.save(state, path)
    return {name: t.clone() for name, t in model.state_dict().items()}


def _loaded_weight(comm: Any, path: str, dtype: torch.dtype | None) -> torch.Tensor:
    model = torch.nn.Linear(4, 3).to("meta")
    state = fzero.load(path, model=model, comm=comm, param_dtype=dtype)
    return fzero.full_params(state)["weight"].clone()


def test_parameters_saved_beside_a_narrower_master_are_read_from_themselves(tmp_path) -> None:
    """float32 parameters over a float16 master copy, saved before the first update (when the
    parameters are not yet the master's cast): an export or load in another dtype read the
    parameters from the float16 master, 1e-4 off the stored float32 values (a probe)."""
    path = str(tmp_path / "c")
    want = fzero.SimWorld(2).run(_narrow_master_body, path)[0]["weight"]
    out = str(tmp_path / "out")
    offline.export(path, out, dtype=torch.float64)
    from safetensors.torch import load_file
    assert torch.equal(load_file(os.path.join(out, "model.safetensors"))["weight"],
                       want.double())
    for dtype in (torch.float64, torch.bfloat16):
        got = fzero.SimWorld(2).run(_loaded_weight, path, dtype)[0]
        assert torch.equal(got, want.to(dtype)), dtype


def _save_large(comm: Any, path: str) -> None:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[0, 0] = 1e5
    fzero.save(fzero.init(model, stage=1, optimizer=fzero.optim.sgd(lr=0.1), comm=comm), path)


def _load_narrow(comm: Any, path: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        fzero.load(path, model=torch.nn.Linear(3, 2), comm=comm, param_dtype=torch.float16)
    return str(caught.value)


def test_a_load_whose_param_dtype_overflows_says_so(tmp_path) -> None:
    """It said only that the checkpoint came from a diverged run or is damaged."""
    path = str(tmp_path / "c")
    fzero.SimWorld(2).run(_save_large, path)
    for message in fzero.SimWorld(2).run(_load_narrow, path):
        assert "weight" in message and "beyond param_dtype torch.float16's range" in message


class _Counted(torch.nn.Module):
    """A Linear beside a count forward keeps, registered persistent or not."""

    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(()), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.lin(x)


def _counted_save(comm: Any, model: torch.nn.Module, path: str) -> None:
    state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    step = fzero.make_train_step(model, lambda call, b: call(b).pow(2).mean())
    for _ in range(5):
        state, _ = step(state, torch.ones(2, 3))
    fzero.save(state, path)


def _counted_load(comm: Any, model: torch.nn.Module, path: str) -> float | str:
    try:
        return float(fzero.load(path, model=model, comm=comm).buffers["count"])
    except CheckpointError as error:
        return str(error)


def test_a_buffer_saved_persistent_does_not_load_from_a_model_that_is_not(tmp_path) -> None:
    """A count saved persistent (5) loaded into a model registering it persistent=False took
    the model's own 0 and dropped the saved 5, silently (a probe; torch's strict
    load_state_dict refuses the pair as an unexpected key): every rank raises, naming it. Saved
    and loaded non-persistent, the model's value (the rule); saved and loaded persistent, the
    saved one; on a meta skeleton, the saved one."""
    path = str(tmp_path / "persistent")
    fzero.SimWorld(2).run(_counted_save, _Counted(persistent=True), path)
    assert fzero.SimWorld(2).run(_counted_load, _Counted(persistent=True), path) == [5.0] * 2
    for message in fzero.SimWorld(2).run(_counted_load, _Counted(persistent=False), path):
        assert "['count'] were saved persistent" in message, message
    with torch.device("meta"):
        skeleton = _Counted(persistent=False)
    assert fzero.SimWorld(2).run(_counted_load, skeleton, path) == [5.0] * 2
    other = str(tmp_path / "non_persistent")
    fzero.SimWorld(2).run(_counted_save, _Counted(persistent=False), other)
    fresh = _Counted(persistent=False)
    with torch.no_grad():
        fresh.count.fill_(42.0)
    assert fzero.SimWorld(2).run(_counted_load, fresh, other) == [42.0] * 2
    assert read_manifest(other).state["non_persistent_buffers"] == ["count"]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_save_refuses_extra_values_json_cannot_hold(tmp_path, value: float) -> None:
    """save(extra={"best": inf}) wrote ``Infinity`` into manifest.json, which Python reads
    back but JSON parsers other than Python's (jq, JSON.parse, serde_json) refuse, with the
    whole manifest (a probe): every rank raises, naming the key, before anything is written."""
    path = str(tmp_path / "c")

    def body(comm: Any) -> str:
        state = fzero.init(small_model(), stage=1, comm=comm,
                           optimizer=fzero.optim.sgd(lr=0.1))
        with pytest.raises(TypeError) as caught:
            fzero.save(state, path, extra={"ok": [1.5], "best": value})
        return str(caught.value)

    for message in fzero.SimWorld(2).run(body):
        assert "extra['best']" in message or "'best'" in message, message
    assert not os.path.exists(path)


def _load_real_or_meta(comm: Any, path: str) -> str:
    """Rank 0 loads into a real model holding 42, the others into a meta skeleton."""
    if comm.rank == 0:
        model = _Counted(persistent=False)
        with torch.no_grad():
            model.count.fill_(42.0)
    else:
        with torch.device("meta"):
            model = _Counted(persistent=False)
    try:
        return repr(float(fzero.load(path, model=model, comm=comm).buffers["count"]))
    except CheckpointError as error:
        return str(error)


def test_ranks_whose_models_hold_a_non_persistent_buffer_differently_raise_together(
        tmp_path) -> None:
    """One rank loading into a real model (whose non-persistent buffer keeps its value) and
    another into a meta skeleton (which takes the saved one): saved persistent, the first
    raised alone and the other walked into the load's collectives; saved non-persistent, the
    ranks held 42 and 5, silently (a review). The ranks compare which buffers take the model's
    values before anything is read."""
    for persistent in (True, False):
        path = str(tmp_path / f"p{persistent}")
        fzero.SimWorld(2).run(_counted_save, _Counted(persistent=persistent), path)
        for message in fzero.SimWorld(2, timeout=20).run(_load_real_or_meta, path):
            assert "the model's non-persistent buffers it holds values for" in message, message


def test_a_save_whose_checks_fail_on_one_rank_raises_on_every_rank(tmp_path) -> None:
    """save's check of the parameters against their master copy (at stage 3 too now: it casts
    a bucket's master, which may run out of memory) ran before its first collective: a rank
    where it raised left the others waiting there (a review)."""
    real = fzero.checkpoint.saving.lost_writes

    def failing(state: Any) -> list[int]:
        if state.rank == 1:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return real(state)

    def body(comm: Any) -> str:
        state = fzero.init(small_model(), stage=3, comm=comm, param_dtype=torch.bfloat16,
                           optimizer=fzero.optim.sgd(lr=0.1))
        try:
            fzero.save(state, str(tmp_path / "c"))
        except Exception as error:  # noqa: BLE001 (which error each rank raised is the test)
            return f"{type(error).__name__}: {error}"
        return "saved"

    with mock.patch("fzero.checkpoint.saving.lost_writes", failing):
        first, second = fzero.SimWorld(2, timeout=20).run(body)
    assert first.startswith("CheckpointError") and "rank(s) [1] could not check" in first
    assert second.startswith("OutOfMemoryError")
    assert not os.path.exists(tmp_path / "c")
