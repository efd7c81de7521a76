"""Behaviours no test pinned until a mutation probe (2026-11-26) changed one line of fzero at
a time and every test still passed: each test here fails on its mutant (named in brackets:
the probe's id) and passes on fzero. Checkpoint headers and manifests, layouts read from
JSON, dtype casts, what a load restores, the collective signature, and statistics."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import fzero
from fzero.checkpoint.files import ShardFile


def _raw_safetensors(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_a_header_whose_offsets_disagree_with_the_shape_is_rejected(tmp_path) -> None:
    """[F6] data_offsets spanning 8 bytes for a (4,) float32 tensor (16 bytes): reading it
    would silently run into the next tensor's bytes (nothing else checks offsets when
    checksums are off, or for a foreign file)."""
    path = tmp_path / "x.safetensors"
    _raw_safetensors(path, {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
    }, torch.arange(4, dtype=torch.float32).numpy().tobytes())
    with pytest.raises(ValueError, match="inconsistent offsets"):
        ShardFile(path).close()


def test_a_header_whose_data_runs_past_the_end_of_the_file_is_rejected_on_open(tmp_path) -> None:
    """[F7] A file cut short by a few bytes (fewer than 8) must fail when opened, as a cut of
    more bytes does, not only when the last tensor is read."""
    path = tmp_path / "x.safetensors"
    _raw_safetensors(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                     torch.arange(4, dtype=torch.float32).numpy().tobytes()[:-4])
    with pytest.raises(ValueError, match="is truncated"):
        ShardFile(path).close()


def test_layout_json_with_a_gap_between_entries_is_rejected() -> None:
    """[LY1] from_json must reject offsets that do not follow each other: flatten/unflatten
    would otherwise read and write the wrong elements of the flat buffer."""
    layout = fzero.plan({"a": torch.zeros(3), "b": torch.zeros(2)}, 2, buckets=[["a", "b"]])
    doc = json.loads(layout.to_json())
    doc["buckets"][0]["entries"][1][2] += 1  # b's offset 3 -> 4
    with pytest.raises(ValueError, match="inconsistent offset"):
        fzero.ShardLayout.from_json(json.dumps(doc))


def test_an_int_cap_is_inclusive() -> None:
    """[LY3] buckets=<int> caps a bucket at that many elements: parameters that fill it
    exactly share one bucket."""
    params = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(1)}
    layout = fzero.plan(params, 1, buckets=4)
    assert [b.names for b in layout.buckets] == [("a", "b"), ("c",)]


def _init_int_param_body(comm, model):
    state = fzero.init(model, stage=1, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm,
                       param_dtype=torch.bfloat16)
    return {k: v.clone() for k, v in fzero.full_params(state).items()}


def test_param_dtype_leaves_integer_parameters_alone() -> None:
    """[LY12] param_dtype casts floating parameters only (as model.to(dtype) does): an
    integer frozen parameter keeps its dtype and exact values (257 is not a bfloat16)."""
    layout = fzero.plan({"w": torch.zeros(3, requires_grad=True),
                         "i": torch.tensor([257, 3])}, 1)
    cast = layout.cast(torch.bfloat16)
    assert {b.names: b.dtype for b in cast.buckets} == {("w",): "bfloat16", ("i",): "int64"}

    model = torch.nn.Linear(2, 2)
    model.register_parameter("index", torch.nn.Parameter(torch.tensor([257, 3]),
                                                         requires_grad=False))
    (full,) = fzero.SimWorld(1).run(_init_int_param_body, model)
    assert full["index"].dtype == torch.int64
    assert full["index"].tolist() == [257, 3]


def _signature_body(comm):
    """The signature of a fresh channel after each of a few one-collective sequences."""
    def after(name, issue):
        channel = comm.channel(name)
        issue(channel)
        return channel.signature

    f32, f64 = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    return {
        "sum": after("a", lambda c: c.all_reduce(f32.clone(), op="sum")),
        "max": after("b", lambda c: c.all_reduce(f32.clone(), op="max")),
        "f64": after("c", lambda c: c.all_reduce(f64.clone(), op="sum")),
        "numel": after("d", lambda c: c.all_reduce(torch.zeros(5), op="sum")),
        "again": after("e", lambda c: c.all_reduce(f32.clone(), op="sum")),
    }


def test_comm_signature_covers_op_dtype_and_size() -> None:
    """[CM1, CM2] The train step compares channel signatures to catch ranks that issued
    different collectives: two sequences differing only in the reduction op, or only in the
    dtype, must not sign alike (else e.g. a sum on one rank against a max on another, or
    float32 bytes reduced as float64, goes unnoticed)."""
    (sig,) = fzero.SimWorld(1).run(_signature_body)
    assert sig["sum"] == sig["again"]
    assert len({sig["sum"], sig["max"], sig["f64"], sig["numel"]}) == 4, sig


def _rank0_nonfinite_body(comm):
    from fzero.consensus import exchange_statistics
    return exchange_statistics(
        comm, squared_norm=1.0, loss_sum=float("nan") if comm.rank == 0 else 1.0, rows=4,
        failed=None, nonfinite=comm.rank == 0, signatures=[7], used=[True])


def test_rank_0s_nonfinite_loss_is_reported() -> None:
    """[C5] A non-finite loss on rank 0 is named like any other rank's (the step's error
    message and metrics["nonfinite_ranks"] come from it)."""
    stats = fzero.SimWorld(2).run(_rank0_nonfinite_body)
    assert stats[0].nonfinite == stats[1].nonfinite == (0,)


def test_agreed_compares_both_fingerprint_halves() -> None:
    """[SC2] Sequences whose fingerprints differ in the low 30 bits only are not agreed."""
    from fzero.schedule import agreed, header
    a = header(1, None, [0, 1, 2])
    b = list(a)
    b[3] ^= 1
    assert agreed([a, a]) and not agreed([a, b])


def test_read_into_a_non_contiguous_tensor_fills_it(tmp_path) -> None:
    """[F12] ShardFile.read_into promises out[:] = the stored range for any out; a strided
    out of the stored dtype must not be read into a temporary copy and left untouched."""
    from fzero.checkpoint.files import TensorSpec, write_file
    value = torch.arange(6, dtype=torch.float32)
    path = tmp_path / "x.safetensors"
    write_file(path, [TensorSpec("a", torch.float32, (6,))], [value])
    out = torch.zeros(4, 2)[:, 0]  # 4 elements, stride 2
    assert not out.is_contiguous()
    with ShardFile(path) as f:
        f.read_into("a", 1, 5, out)
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]


def _save_body(comm, model, path, stage=1):
    state = fzero.init(model, stage=stage, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm)
    fzero.save(state, path)


@pytest.fixture
def tiny_checkpoint(tmp_path) -> str:
    path = str(tmp_path / "c")
    torch.manual_seed(0)
    fzero.SimWorld(1).run(_save_body, torch.nn.Linear(3, 2), path)
    return path


def test_the_next_format_version_is_refused(tiny_checkpoint) -> None:
    """[M1] A manifest of format version VERSION + 1 (the next one, not only a far-off one)
    is refused with the upgrade message, instead of being misread."""
    from fzero.checkpoint import CheckpointError
    from fzero.checkpoint.manifest import VERSION, Manifest
    with open(f"{tiny_checkpoint}/manifest.json") as f:
        doc = json.load(f)
    doc["version"] = VERSION + 1
    with pytest.raises(CheckpointError, match="newer than the version"):
        Manifest.from_json(json.dumps(doc))


def test_a_manifest_listing_files_out_of_rank_order_is_malformed(tmp_path) -> None:
    """[M3] Reader.file(rank) takes manifest.files[rank]: a manifest (with a valid checksum)
    whose file list is not ranks 0..N-1 in order would read one rank's shards as another's."""
    from fzero.checkpoint import CheckpointError
    from fzero.checkpoint.manifest import Manifest, _doc_crc32
    path = str(tmp_path / "c")
    torch.manual_seed(0)
    fzero.SimWorld(2).run(_save_body, torch.nn.Linear(3, 2), path)
    with open(f"{path}/manifest.json") as f:
        doc = json.load(f)
    doc["files"].reverse()
    doc.pop("crc32")
    doc["crc32"] = _doc_crc32(doc)
    with pytest.raises(CheckpointError, match="files for ranks"):
        Manifest.from_json(json.dumps(doc))


def _load_error_body(comm, model, path):
    from fzero.checkpoint import CheckpointError
    try:
        fzero.load(path, model=model, comm=comm)
    except CheckpointError as error:
        return str(error)
    return None


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("damaged", [0, 1, 2, 3])
def test_a_load_at_a_smaller_world_size_checks_every_file(tmp_path, damaged) -> None:
    """[V1] Saved by 4 ranks, loaded by 2: every one of the 4 files is checksummed by some
    rank (file f by rank f mod 2), so a corrupt file raises on every rank instead of being
    loaded silently."""
    path = str(tmp_path / "c")
    torch.manual_seed(0)
    fzero.SimWorld(4).run(_save_body, torch.nn.Linear(3, 2), path)
    _flip_last_byte(f"{path}/shard-{damaged:05d}-of-00004.safetensors")
    errors = fzero.SimWorld(2).run(_load_error_body, torch.nn.Linear(3, 2), path)
    assert all(e is not None and f"shard-{damaged:05d}" in e for e in errors), errors


def _save_with_counters_body(comm, path):
    import dataclasses
    torch.manual_seed(0)
    state = fzero.init(torch.nn.Linear(3, 2), stage=1, optimizer=fzero.optim.adamw(lr=1e-3),
                       comm=comm)
    # As after 5 steps of which the bias missed 2 (unused) and the last 3 were skipped.
    state = dataclasses.replace(state, step=5, param_steps=(5, 3), skipped=3)
    fzero.save(state, path)


def _loaded_counters_body(comm, path):
    state = fzero.load(path, model=torch.nn.Linear(3, 2), comm=comm)
    return state.step, state.param_steps, state.skipped


def test_a_load_restores_skipped_and_per_parameter_steps(tmp_path) -> None:
    """[R3, R5] The manifest records `skipped` (steps skipped in a row: what max_skipped
    counts) and `param_steps` (Adam's per-parameter step for parameters some steps left
    unused, its bias correction); a resumed run must continue from both, not from 0 / None."""
    path = str(tmp_path / "c")
    fzero.SimWorld(2).run(_save_with_counters_body, path)
    for step, param_steps, skipped in fzero.SimWorld(2).run(_loaded_counters_body, path):
        assert step == 5
        assert skipped == 3
        assert param_steps == (5, 3)


def test_reshard_into_other_buckets_drops_the_learned_stage3_order(tmp_path) -> None:
    """[O4] The learned stage-3 gather order indexes the saved buckets: a reshard that
    re-buckets must not carry it over to the new, differently numbered buckets."""
    from checkpoint_bodies import train_save_body
    from models import TinyGPT
    path, same, other = (str(tmp_path / n) for n in ("c", "same", "other"))
    fzero.SimWorld(2).run(train_save_body, TinyGPT(),
                          [TinyGPT.make_batch(100 + i, 12) for i in range(2)], 1, path, stage=3)
    saved = fzero.checkpoint.read_manifest(path).state["bucket_order"]
    assert saved is not None
    assert fzero.checkpoint.reshard(path, same, world_size=3).state["bucket_order"] == saved
    resharded = fzero.checkpoint.reshard(path, other, world_size=3, buckets=700)
    assert [b.names for b in resharded.layout.buckets] != [
        b.names for b in fzero.checkpoint.read_manifest(path).layout.buckets]
    assert resharded.state["bucket_order"] is None


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def _load_bf16_buffers_body(comm, path):
    loaded = fzero.load(path, model=_bn_model(), comm=comm, param_dtype=torch.bfloat16)
    fresh = fzero.init(_bn_model(), stage=1, optimizer=fzero.optim.adamw(lr=1e-3), comm=comm,
                       param_dtype=torch.bfloat16)
    return ({k: v.dtype for k, v in loaded.buffers.items()},
            {k: v.dtype for k, v in fresh.buffers.items()})


def test_load_with_param_dtype_casts_floating_buffers_as_init_does(tmp_path) -> None:
    """[R9] load(param_dtype=bf16) of an fp32 checkpoint gives floating buffers the compute
    dtype, exactly as init(param_dtype=bf16) does (an integer buffer keeps its dtype)."""
    path = str(tmp_path / "c")
    fzero.SimWorld(1).run(_save_body, _bn_model(), path)
    ((loaded, fresh),) = fzero.SimWorld(1).run(_load_bf16_buffers_body, path)
    assert loaded == fresh
    assert loaded["1.running_mean"] == torch.bfloat16
    assert loaded["1.num_batches_tracked"] == torch.int64
