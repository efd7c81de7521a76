"""Tests for `fzero.checkpoint`: the pure reshard map, the files, save/load at every world size
and stage (SimWorld, and gloo processes), offline consolidate/reshard/export, bad input."""

from __future__ import annotations

import copy
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import fzero
from fzero.checkpoint import CheckpointError, read_manifest, record
from fzero.checkpoint.files import ShardFile, TensorSpec, crc32, write_file
from fzero.checkpoint.manifest import Manifest, latest
from fzero.checkpoint.mapping import reads, regroup
from fzero.testing import policies, trees

from checkpoint_bodies import resume_body, run_body, train_save_body
from models import MLP, FrozenMix, TinyGPT

STAGES = (0, 1, 2, 3)
WORLDS = (1, 2, 3, 4)
SAVE_AT = 2  # steps before the save
CONTINUE = 5  # steps after the load
# Runs at different world sizes or stages differ by reduction order alone (~1e-7 relative per
# step); Adam turns gradient noise into steps of size ~lr, so the matrix uses a small lr to keep
# that inherent difference below the 1e-6 it checks.
MATRIX_OPT = ("adamw", {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1})


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (any dtype; NaN-safe)."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def gpt_batches(count: int = 8, size: int = 12) -> list[Any]:
    return [TinyGPT.make_batch(100 + i, size) for i in range(count)]


def assert_state_equal(a: dict[str, Any], b: dict[str, Any], *, exact: bool) -> None:
    """Two `checkpoint_bodies.snapshot`s: bitwise, or within fp32 1e-6."""
    for part in ("params", "master"):
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            if exact:
                assert bitwise_equal(a[part][name], b[part][name]), (part, name)
            else:
                torch.testing.assert_close(a[part][name], b[part][name], rtol=1e-6, atol=1e-6,
                                           msg=lambda m, p=part, n=name: f"{p} {n}: {m}")
    assert a["buffers"].keys() == b["buffers"].keys()
    for name in a["buffers"]:
        assert bitwise_equal(a["buffers"][name], b["buffers"][name]), name
    assert a["step"] == b["step"] and a["loss_scale"] == b["loss_scale"]


def assert_losses(actual: list[float], expected: list[float], *, exact: bool) -> None:
    if exact:
        assert actual == expected
    else:
        assert actual == pytest.approx(expected, rel=1e-6)


# ----------------------------------------------------------------------------------------------
# The pure reshard map


@given(data=st.data(), spec=trees(max_size=40, allow_large=False),
       old_world=st.integers(1, 9), new_world=st.integers(1, 9))
def test_reads_reassemble_any_shard_of_any_new_layout(data, spec, old_world, new_world) -> None:
    """Applying `reads` to the old shards gives exactly ``shard(p, new, r)`` and
    ``flatten(p, new)``: unshard with the old layout, shard with the new, never assembled."""
    params = spec.build()
    old = fzero.plan(params, old_world, buckets=data.draw(policies(spec)))
    new = fzero.plan(params, new_world, buckets=data.draw(policies(spec)))
    old_shards = [fzero.shard(params, old, r) for r in range(old_world)]
    flats = fzero.flatten(params, new)
    located = old.locate()
    for index, bucket in enumerate(new.buckets):
        ranges = [bucket.shard_range(r) for r in range(new_world)] + [(0, bucket.padded_numel)]
        for lo, hi in ranges:
            out = torch.zeros(hi - lo, dtype=bucket.torch_dtype)
            for r in reads(old, new, index, lo, hi, located=located):
                assert r.stop > r.start
                out[r.at : r.at + r.stop - r.start] = old_shards[r.rank][r.bucket][r.start:r.stop]
            assert bitwise_equal(out, flats[index][lo:hi])


def test_reads_of_an_unchanged_layout_are_one_per_shard() -> None:
    layout = fzero.plan(TinyGPT(), 3)
    for index, bucket in enumerate(layout.buckets):
        for rank in range(3):
            lo, hi = bucket.shard_range(rank)
            got = reads(layout, layout, index, lo, hi)
            assert len(got) == 1 and got[0].rank == rank and got[0].start == 0
        assert [r.rank for r in reads(layout, layout, index, 0, bucket.padded_numel)] == [0, 1, 2]


def test_regroup_keeps_or_replans_buckets() -> None:
    layout = fzero.plan(FrozenMix(), 2)
    same = regroup(layout, 3)
    assert [b.names for b in same.buckets] == [b.names for b in layout.buckets]
    assert same.world_size == 3
    capped = regroup(layout, 3, 100)
    assert capped.names == layout.names and all(b.numel <= 143 for b in capped.buckets)
    assert [b.trainable for b in layout.buckets] != [] and {
        n: layout.buckets[i].trainable for n, (i, _) in layout.locate().items()
    } == {n: capped.buckets[i].trainable for n, (i, _) in capped.locate().items()}


# ----------------------------------------------------------------------------------------------
# Files and manifest


def test_written_files_are_safetensors(tmp_path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=gen),
        "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c": torch.arange(5),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(4, generator=gen).half(),
    }
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    pieces = [tensors["a"][:2], tensors["a"][2:], tensors["b"], tensors["c"][:1],
              tensors["c"][1:], tensors["scalar"], tensors["mask"], tensors["half"]]
    path = tmp_path / "x.safetensors"
    info = write_file(path, specs, pieces, {"format": "pt"})
    assert info.bytes == os.path.getsize(path) and info.crc32 == crc32(path)
    back = safetensors.load_file(path)
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert bitwise_equal(back[name], value), name
    with ShardFile(path) as f:
        assert f.metadata == {"format": "pt"}
        out = torch.empty(4, dtype=torch.float64)  # a range, cast on the way
        f.read_into("a", 3, 7, out)
        torch.testing.assert_close(out, tensors["a"].view(-1)[3:7].double(), rtol=0, atol=0)


def test_write_file_checks_its_pieces(tmp_path) -> None:
    specs = [TensorSpec("a", torch.float32, (4,))]
    with pytest.raises(ValueError, match="is torch.float32, got a piece of torch.float64"):
        write_file(tmp_path / "x", specs, [torch.zeros(4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="overruns tensor 'a'"):
        write_file(tmp_path / "x", specs, [torch.zeros(5)])
    with pytest.raises(ValueError, match="8 bytes short in tensor 'a'"):
        write_file(tmp_path / "x", specs, [torch.zeros(2)])
    assert not (tmp_path / "x").exists()  # no half-written file left behind


def test_manifest_round_trips_through_json(tmp_path) -> None:
    fzero.SimWorld(2).run(train_save_body, FrozenMix(), [FrozenMix.make_batch(0, 4)], 1,
                          str(tmp_path / "c"), stage=3, extra={"epoch": 3, "x": [1, 2]})
    manifest = read_manifest(tmp_path / "c")
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest
    assert manifest.extra == {"epoch": 3, "x": [1, 2]} and manifest.step == 1
    assert manifest.layout == fzero.plan(FrozenMix(), 2) and manifest.stage == 3
    assert manifest.state["optimizer"]["name"] == "adamw"
    frozen = [b for b in manifest.layout.buckets if not b.trainable]
    assert frozen and manifest.buffers == {"scale": ("float32", (13,)), "perm": ("int64", (7,))}
    assert [f.rng for f in manifest.files] == [("rng.cpu",)] * 2
    assert manifest.nbytes == sum(os.path.getsize(tmp_path / "c" / f.name) for f in manifest.files)


# ----------------------------------------------------------------------------------------------
# Save and load: the matrix


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory) -> dict[tuple[int, int], dict[str, Any]]:
    """TinyGPT (tied weights, 4 buckets) trained SAVE_AT steps and saved, per (N, stage)."""
    root = tmp_path_factory.mktemp("matrix")
    runs = {}
    for world in WORLDS:
        for stage in STAGES:
            path = str(root / f"n{world}-s{stage}")
            result = fzero.SimWorld(world).run(train_save_body, TinyGPT(), gpt_batches(), SAVE_AT,
                                               path, stage=stage, opt=MATRIX_OPT)[0]
            runs[world, stage] = {**result, "path": path}
    return runs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_resume_at_any_world_size_and_stage(saved_runs, world: int, stage: int) -> None:
    """Every (N, stage) checkpoint, loaded at (M, stage'): the loaded values are the saved
    ones bitwise (resharding moves bits), and 5 more steps match the uninterrupted run at
    (M, stage'): bitwise when nothing changed, to fp32 1e-6 otherwise."""
    model = TinyGPT()
    reference = fzero.SimWorld(world).run(run_body, model, gpt_batches(), SAVE_AT + CONTINUE,
                                          stage=stage, opt=MATRIX_OPT)[0]
    keys = sorted(saved_runs)
    results = fzero.SimWorld(world).run(resume_body, model, gpt_batches(),
                                        [saved_runs[k]["path"] for k in keys], CONTINUE,
                                        stage=stage)[0]
    for key, result in zip(keys, results, strict=True):
        saved = saved_runs[key]
        assert_state_equal(result["loaded"], saved["saved"], exact=True)
        assert result["loaded"]["moments"].keys() == {"exp_avg", "exp_avg_sq"}
        for name, moment in result["loaded"]["moments"].items():
            for param, value in moment.items():
                assert bitwise_equal(value, saved["saved"]["moments"][name][param]), (key, param)
        same = key == (world, stage)
        assert_losses(saved["losses"] + result["losses"], reference["losses"], exact=same)
        assert_state_equal(result["final"], reference["final"], exact=same)


# ----------------------------------------------------------------------------------------------
# Save and load: what must survive


def test_frozen_parameters_and_buffers_survive_any_reshard(tmp_path) -> None:
    """FrozenMix (frozen parameters interleaved with trainable ones, a float and an int64
    buffer) saved at N=3 stage 1, loaded at N=2 on every stage, from a `meta` skeleton."""
    model = FrozenMix()
    batches = [FrozenMix.make_batch(i, 6) for i in range(4)]
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(3).run(train_save_body, model, batches, 2, path, stage=1,
                                  opt=MATRIX_OPT)[0]
    skeleton = copy.deepcopy(model).to("meta")
    for stage in STAGES:
        reference = fzero.SimWorld(2).run(run_body, model, batches, 2 + CONTINUE, stage=stage,
                                          opt=MATRIX_OPT)[0]
        (result,) = fzero.SimWorld(2).run(resume_body, model, batches, [path], CONTINUE,
                                          stage=stage, runner=skeleton)[0]
        assert_state_equal(result["loaded"], saved["saved"], exact=True)
        layout = result["layout"]
        frozen = {n for b in layout.buckets if not b.trainable for n in b.names}
        assert frozen == {"frozen.weight", "frozen.bias", "offset"}
        assert result["loaded"]["buffers"]["perm"].dtype == torch.int64
        assert_losses(saved["losses"] + result["losses"], reference["losses"], exact=False)
        assert_state_equal(result["final"], reference["final"], exact=False)


def test_fp16_loss_scale_state_survives(tmp_path) -> None:
    """The dynamic loss scale (scale, growth counter) comes back; same N and stage: bitwise."""
    batches = [(x.half(), y) for x, y in (MLP.make_batch(i, 6) for i in range(4))]
    scale = fzero.LossScale(scale=2.0**8, interval=3)
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(2).run(train_save_body, MLP(), batches, 4, path, stage=2,
                                  param_dtype=torch.float16, loss_scale=scale)[0]
    assert saved["saved"]["loss_scale"] == fzero.LossScale(2.0**9, interval=3, good_steps=1)
    assert read_manifest(path).state["param_dtype"] == "float16"
    reference = fzero.SimWorld(2).run(run_body, MLP(), batches, 4 + CONTINUE, stage=2,
                                      param_dtype=torch.float16, loss_scale=scale)[0]
    (same,) = fzero.SimWorld(2).run(resume_body, MLP(), batches, [path], CONTINUE)[0]
    assert same["loaded"]["loss_scale"] == saved["saved"]["loss_scale"]
    assert_losses(saved["losses"] + same["losses"], reference["losses"], exact=True)
    assert_state_equal(same["final"], reference["final"], exact=True)
    (other,) = fzero.SimWorld(3).run(resume_body, MLP(), batches, [path], 1, stage=3)[0]
    assert other["loaded"]["loss_scale"] == saved["saved"]["loss_scale"]
    assert_state_equal(other["loaded"], saved["saved"], exact=True)


@pytest.mark.parametrize(("saved_at", "loaded_at"), [((2, 2), (2, 2)), ((2, 1), (3, 3))])
def test_bf16_params_with_fp32_master_survive(tmp_path, saved_at, loaded_at) -> None:
    """bf16 compute parameters and their fp32 master copy are stored apart and both come back
    bitwise at any world size and stage; unchanged, training continues bitwise."""
    (world, stage), (new_world, new_stage) = saved_at, loaded_at
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(world).run(train_save_body, TinyGPT(), gpt_batches(), SAVE_AT, path,
                                      stage=stage, param_dtype=torch.bfloat16)[0]
    manifest = read_manifest(path)
    assert manifest.state["master"] == [0, 1, 2, 3] and manifest.state["master_dtype"] == "float32"
    assert saved["saved"]["master"]["tok_emb.weight"].dtype == torch.float32
    (result,) = fzero.SimWorld(new_world).run(resume_body, TinyGPT(), gpt_batches(), [path],
                                              CONTINUE, stage=new_stage)[0]
    assert result["loaded"]["params"]["tok_emb.weight"].dtype == torch.bfloat16
    assert_state_equal(result["loaded"], saved["saved"], exact=True)
    if saved_at == loaded_at:
        reference = fzero.SimWorld(world).run(run_body, TinyGPT(), gpt_batches(),
                                              SAVE_AT + CONTINUE, stage=stage,
                                              param_dtype=torch.bfloat16)[0]
        assert_losses(saved["losses"] + result["losses"], reference["losses"], exact=True)
        assert_state_equal(result["final"], reference["final"], exact=True)


def test_load_with_another_bucket_policy(tmp_path) -> None:
    """Buckets re-planned at load (a size cap instead of one per block) reshard too."""
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), SAVE_AT, path,
                                  stage=3, opt=MATRIX_OPT)[0]
    reference = fzero.SimWorld(3).run(run_body, TinyGPT(), gpt_batches(), SAVE_AT + CONTINUE,
                                      stage=3, opt=MATRIX_OPT)[0]
    (result,) = fzero.SimWorld(3).run(resume_body, TinyGPT(), gpt_batches(), [path], CONTINUE,
                                      buckets=500)[0]
    assert len(result["layout"].buckets) > 4
    assert result["loaded"]["bucket_order"] is None  # learned for other buckets
    assert_state_equal(result["loaded"], saved["saved"], exact=True)
    assert_losses(saved["losses"] + result["losses"], reference["losses"], exact=False)
    assert_state_equal(result["final"], reference["final"], exact=False)


def test_stage3_learned_bucket_order_is_restored(saved_runs) -> None:
    saved = saved_runs[2, 3]
    order = saved["saved"]["bucket_order"]
    assert order is not None and read_manifest(saved["path"]).state["bucket_order"] == {
        "forward": list(order.forward), "backward": list(order.backward)}
    (result,) = fzero.SimWorld(3).run(resume_body, TinyGPT(), gpt_batches(), [saved["path"]], 0)[0]
    assert result["loaded"]["bucket_order"] == order


def test_weights_only_starts_a_fresh_optimizer(tmp_path) -> None:
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), SAVE_AT, path,
                                  stage=3, optimizer_state=False)[0]
    manifest = read_manifest(path)
    assert not manifest.state["optimizer_state"] and manifest.state["moments"] == []
    state_bytes = sum(b.numel for b in manifest.layout.buckets) * 4
    assert manifest.nbytes < state_bytes + 2 * 10_000  # parameters (+ headers, RNG) only
    (result,) = fzero.SimWorld(3).run(resume_body, TinyGPT(), gpt_batches(), [path], 1,
                                      stage=2, weights_only=True)[0]
    assert result["loaded"]["step"] == 0
    assert_state_equal({**result["loaded"], "step": SAVE_AT}, saved["saved"], exact=True)
    for moment in result["loaded"]["moments"].values():
        assert all(not v.any() for v in moment.values())


# ----------------------------------------------------------------------------------------------
# Offline: consolidate, reshard, export


def test_consolidate_equals_full_params(saved_runs) -> None:
    for key in [(1, 0), (3, 3), (4, 1)]:
        saved = saved_runs[key]
        state_dict = fzero.consolidate(saved["path"])
        assert state_dict.keys() == saved["saved"]["params"].keys()
        for name, value in saved["saved"]["params"].items():
            assert bitwise_equal(state_dict[name], value), (key, name)
        assert state_dict["lm_head.weight"] is state_dict["tok_emb.weight"]  # tied, as full_params
        master = fzero.consolidate(saved["path"], master=True)
        for name, value in saved["saved"]["master"].items():
            assert bitwise_equal(master[name], value), (key, name)


def test_consolidate_for_a_model_loads_strictly(tmp_path) -> None:
    model = FrozenMix()
    batches = [FrozenMix.make_batch(i, 6) for i in range(2)]
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(3).run(train_save_body, model, batches, 2, path, stage=3)[0]
    skeleton = copy.deepcopy(model).to("meta")
    state_dict = fzero.consolidate(path, model=skeleton)
    assert list(state_dict) == list(model.state_dict())  # buffers included, in model order
    fresh = FrozenMix(seed=7)
    fresh.load_state_dict(state_dict, strict=True)
    for name, value in saved["saved"]["params"].items():
        assert bitwise_equal(fresh.get_parameter(name).detach(), value), name


def shard_contents(path: str) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """A checkpoint's manifest and every stored tensor but the RNG states, by file and key."""
    manifest = read_manifest(path)
    tensors = {}
    for entry in manifest.files:
        with ShardFile(os.path.join(path, entry.name)) as f:
            for key in f.tensors:
                if not key.startswith("rng."):
                    tensors[f"{entry.rank}/{key}"] = f.read(key)
    return manifest, tensors


@pytest.mark.parametrize(("middle", "buckets"), [(2, None), (4, 700), (1, None)])
def test_offline_reshard_there_and_back_is_bitwise(saved_runs, tmp_path, middle, buckets) -> None:
    source = saved_runs[3, 1]["path"]
    there, back = str(tmp_path / "there"), str(tmp_path / "back")
    resharded = fzero.checkpoint.reshard(source, there, world_size=middle, buckets=buckets,
                                         stage=3)
    assert resharded.world_size == middle and resharded.stage == 3
    assert (len(resharded.layout.buckets) > 4) == (buckets is not None)
    restored = fzero.checkpoint.reshard(there, back, world_size=3, stage=1,
                                        buckets=[[e.name for e in b.entries]
                                                 for b in read_manifest(source).layout.buckets]
                                        if buckets else None)
    original, original_tensors = shard_contents(source)
    again, again_tensors = shard_contents(back)
    assert [b.names for b in again.layout.buckets] == [b.names for b in original.layout.buckets]
    assert again_tensors.keys() == original_tensors.keys()
    for key, value in original_tensors.items():
        assert bitwise_equal(again_tensors[key], value), key
    assert restored.state == {**original.state, "bucket_order": again.state["bucket_order"]}
    # The intermediate checkpoint loads like the original at the middle world size.
    results = fzero.SimWorld(middle).run(resume_body, TinyGPT(), gpt_batches(), [source, there],
                                         0)[0]
    assert_state_equal(results[1]["loaded"], results[0]["loaded"], exact=True)


PEAK_SCRIPT = r"""
import json, sys
import torch
from torch import Tensor
import fzero
from fzero.memory import reset_peak_rss, _status_bytes

what, src, dst = sys.argv[1:4]
base = reset_peak_rss()
if what == "consolidate":
    out = fzero.consolidate(src)
    kept = sum(t.numel() * t.element_size() for t in {id(t): t for t in out.values()}.values())
elif what == "load":  # N=2 -> 1 into a meta skeleton: the state is all it may hold
    from checkpoint_bodies import Wide
    from fzero.state import state_bytes
    with torch.device("meta"):
        skeleton = Wide()
    (state,) = fzero.SimWorld(1).run(lambda comm, m: fzero.load(src, model=m, comm=comm),
                                     skeleton)
    kept = state_bytes(state)
else:
    fzero.checkpoint.reshard(src, dst, world_size=3)
    kept = 0
print(json.dumps({"peak": _status_bytes("VmHWM") - base, "kept": kept}))
"""


def test_reshard_deletes_no_folder_of_the_users_at_its_partial_path(saved_runs, tmp_path):
    """reshard writes into `<dst>.partial` first and deleted whatever was there, a user's own
    folder included (a probe); like save, it deletes only an interrupted run's files."""
    source, dst = saved_runs[3, 1]["path"], str(tmp_path / "n4")
    os.makedirs(dst + ".partial")
    (tmp_path / "n4.partial" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="n4.partial holds other files than a"):
        fzero.checkpoint.reshard(source, dst, world_size=4)
    assert (tmp_path / "n4.partial" / "notes.txt").read_text() == "mine"
    (tmp_path / "n4.partial" / "notes.txt").unlink()
    (tmp_path / "n4.partial" / "shard-00000-of-00004.safetensors").write_bytes(b"half")
    assert fzero.checkpoint.reshard(source, dst, world_size=4).world_size == 4  # leftovers go
    assert sorted(os.listdir(tmp_path)) == ["n4"]


@pytest.mark.slow
def test_consolidate_reshard_and_load_memory_is_one_bucket_plus_the_output(tmp_path) -> None:
    """Measured peak RSS (a fresh process): consolidate holds its output plus at most one
    bucket, reshard one bucket (its output is on disk), a resharding load its state plus one
    bucket; reading the whole checkpoint would cost its size (96 MiB here) on top."""
    from checkpoint_bodies import Wide, init_save_body

    path = str(tmp_path / "c")
    fzero.SimWorld(2).run(init_save_body, Wide(), path, stage=3)
    manifest = read_manifest(path)
    bucket = max(b.padded_numel for b in manifest.layout.buckets) * 4  # 4 MiB
    assert manifest.nbytes > 24 * bucket
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), "tests"])}
    peaks = {}
    for what in ("consolidate", "reshard", "load"):
        done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, what, path,
                               str(tmp_path / what)], env=env, capture_output=True, text=True,
                              check=True)
        peaks[what] = json.loads(done.stdout)
    # The interpreter's own allocations while working, and the C heap growing from small
    # temporaries it does not return (measured 2-3 MiB for the finite check of the loaded
    # parameters alone).
    slack = 10 << 20
    assert peaks["consolidate"]["kept"] == manifest.layout.numel * 4
    assert peaks["consolidate"]["peak"] <= peaks["consolidate"]["kept"] + bucket + slack, peaks
    assert peaks["reshard"]["peak"] <= bucket + slack, peaks
    # Stage 3 at N=1 keeps parameters, gradients and two moments: 4 x 4 bytes per element.
    assert peaks["load"]["kept"] == 4 * 4 * manifest.layout.numel
    assert peaks["load"]["peak"] <= peaks["load"]["kept"] + bucket + slack, peaks


# ----------------------------------------------------------------------------------------------
# Export to Hugging Face transformers


def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def hf_neox():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=40, max_position_embeddings=16, hidden_dropout=0.0,
        attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(config)


def hf_loss(call, batch):
    (ids,) = batch
    return call(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("make", [hf_gpt2, hf_neox])
@pytest.mark.parametrize("max_shard_size", [None, 20_000])
def test_export_reloads_with_from_pretrained(tmp_path, make, max_shard_size) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    model = make().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 61, (4, 12), generator=gen),) for _ in range(2)]
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(2).run(train_save_body, model, batches, 2, path, stage=3,
                                  loss_fn=hf_loss, opt=("sgd", {"lr": 0.1, "momentum": 0.9}))[0]
    out = tmp_path / "hf"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    files = fzero.checkpoint.export(path, out, model=copy.deepcopy(model).to("meta"), **kwargs)
    names = sorted(os.path.basename(f) for f in files)
    if max_shard_size is None:
        assert names == ["config.json", "model.safetensors"]
    else:
        assert "model.safetensors.index.json" in names and "model-00002-of-" in " ".join(names)
    reloaded = type(model).from_pretrained(out).eval()
    trained = make().eval()
    trained.load_state_dict(fzero.consolidate(path, model=model), strict=True)
    for name, value in saved["saved"]["params"].items():  # the trained weights, not init's
        assert bitwise_equal(reloaded.get_parameter(name).detach(), value), name
    ids = torch.randint(0, 61, (2, 10), generator=gen)
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        assert torch.equal(reloaded(input_ids=ids).logits, expected)
    if max_shard_size is None:  # a plain state dict too: tied names each, persistent buffers
        fresh = make()
        fresh.load_state_dict(safetensors.load_file(out / "model.safetensors"), strict=True)
        with torch.no_grad():
            assert torch.equal(fresh.eval()(input_ids=ids).logits, expected)


def test_export_casts_from_the_master_copy(tmp_path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 2, path, stage=2,
                                  param_dtype=torch.bfloat16)[0]
    fzero.checkpoint.export(path, tmp_path / "fp32", dtype=torch.float32)
    fzero.checkpoint.export(path, tmp_path / "bf16")
    full = safetensors.load_file(tmp_path / "fp32" / "model.safetensors")
    half = safetensors.load_file(tmp_path / "bf16" / "model.safetensors")
    assert full.keys() == half.keys() == saved["saved"]["params"].keys()
    for name in full:
        assert bitwise_equal(full[name], saved["saved"]["master"][name]), name
        assert bitwise_equal(half[name], saved["saved"]["params"][name]), name


def test_an_export_of_a_bfloat16_run_says_bfloat16_in_its_config(tmp_path) -> None:
    """A meta model built in float32 for a bfloat16 checkpoint saved its config saying float32:
    the weight files held bfloat16, and `from_pretrained` loaded them as float32 (a probe). The
    config names the dtype written; the model's own config is left alone."""
    model = hf_gpt2()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 61, (4, 12), generator=gen),)]
    path = str(tmp_path / "c")
    fzero.SimWorld(2).run(train_save_body, model, batches, 1, path, stage=1, loss_fn=hf_loss,
                          param_dtype=torch.bfloat16)
    meta = copy.deepcopy(model).to("meta")
    before = meta.config.to_dict()
    for dtype, out in ((None, "bf16"), (torch.float32, "fp32")):
        fzero.checkpoint.export(path, tmp_path / out, model=meta, dtype=dtype)
        reloaded = type(model).from_pretrained(tmp_path / out)
        want = dtype or torch.bfloat16
        assert json.loads((tmp_path / out / "config.json").read_text())["dtype"] == str(
            want).removeprefix("torch.")
        assert {p.dtype for p in reloaded.parameters()} == {want}
    assert meta.config.to_dict() == before
    # A model built from a config names no class in it; save_pretrained's config.json names
    # it, and so does the export's, which the export command takes back as --hf-model (its
    # config.json had "architectures": null, and the command refused it: a probe).
    assert meta.config.architectures is None
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]
    from fzero.checkpoint.__main__ import main

    assert main(["export", path, str(tmp_path / "again"), "--hf-model",
                 str(tmp_path / "bf16")]) == 0
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config


def test_the_export_command_writes_a_directory_from_pretrained_loads(tmp_path, capsys) -> None:
    """`python -m fzero.checkpoint export` wrote weights without a config.json, so its "for HF"
    output did not load with from_pretrained (a probe). ``--hf-model DIR`` takes the run's
    model directory: its names, ties and config.json."""
    from fzero.checkpoint.__main__ import main

    model = hf_gpt2()
    model.save_pretrained(tmp_path / "start")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 61, (4, 12), generator=gen),)]
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(2).run(train_save_body, model, batches, 1, path, stage=3,
                                  loss_fn=hf_loss)[0]
    assert main(["export", path, str(tmp_path / "w")]) == 0
    assert "weights only: --hf-model DIR adds the config.json" in capsys.readouterr().out
    assert main(["export", path, str(tmp_path / "hf"), "--hf-model", str(tmp_path / "start")]) == 0
    reloaded = type(model).from_pretrained(tmp_path / "hf")
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight  # still tied
    for name, value in saved["saved"]["params"].items():
        assert bitwise_equal(reloaded.get_parameter(name).detach(), value), name
    assert main(["export", path, str(tmp_path / "x"), "--hf-model", str(tmp_path)]) == 1
    assert "no config.json there" in capsys.readouterr().err
    # a size of 0 bytes or less wrote one file per tensor (a probe)
    for size in ("0", "-5", "nan"):
        with pytest.raises(SystemExit):
            main(["export", path, str(tmp_path / "y"), "--max-shard-size", size])
        assert "--max-shard-size: a file holds more than 0 bytes" in capsys.readouterr().err
    for size in (0, -5.0, float("nan"), True):
        with pytest.raises(ValueError, match="max_shard_size must be a number of bytes > 0"):
            fzero.checkpoint.export(path, tmp_path / "y", max_shard_size=size)
    assert not (tmp_path / "y").exists()


def test_export_into_an_earlier_export_replaces_its_weights(tmp_path) -> None:
    """A single-file export over a sharded one (and back) left the other layout's files, and
    loading took the earlier weights (model.safetensors wins over an index): a probe's
    from_pretrained returned step 0's model after step 3's export. The earlier weight files
    go; other files (a tokenizer, notes) stay."""
    safetensors = pytest.importorskip("safetensors.torch")
    first, second, out = str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "out"
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 1, first, stage=2)
    saved = fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 3, second,
                                  stage=2)[0]["saved"]["params"]
    for earlier, later in ((None, 4096), (4096, None)):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        (out / "tokenizer.json").write_text("{}")
        fzero.checkpoint.export(first, out, max_shard_size=earlier or 2**40)
        fzero.checkpoint.export(second, out, max_shard_size=later or 2**40)
        names = sorted(os.listdir(out))
        assert "tokenizer.json" in names and not any(n.endswith(".tmp") for n in names)
        if later is None:
            assert [n for n in names if n.startswith("model")] == ["model.safetensors"]
            loaded = safetensors.load_file(out / "model.safetensors")
        else:
            assert "model.safetensors" not in names
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert sorted(set(index["weight_map"].values())) == [
                n for n in names if n.startswith("model-")]
            loaded = {k: v for n in set(index["weight_map"].values())
                      for k, v in safetensors.load_file(out / n).items()}
        for name, value in saved.items():
            assert bitwise_equal(loaded[name], value), name


# ----------------------------------------------------------------------------------------------
# Command line


def test_command_line(saved_runs, tmp_path, capsys) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    from fzero.checkpoint.__main__ import main

    path = saved_runs[2, 3]["path"]
    assert main(["inspect", path, "--world-size", "1", "16"]) == 0
    text = capsys.readouterr().out
    assert f"step {SAVE_AT}, stage 3, world size 2" in text and "adamw(lr=0.001" in text
    assert "blocks.0" in text and "stage 3 (os+g+p)" in text and "\n16 " in text
    assert main(["reshard", path, str(tmp_path / "r"), "--world-size", "3"]) == 0
    assert read_manifest(tmp_path / "r").world_size == 3
    assert main(["consolidate", path, str(tmp_path / "all.safetensors")]) == 0
    written = safetensors.load_file(tmp_path / "all.safetensors")
    expected = fzero.consolidate(path)
    assert written.keys() == expected.keys()
    assert all(bitwise_equal(written[k], v) for k, v in expected.items())
    assert main(["export", path, str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    assert os.path.exists(tmp_path / "hf" / "model.safetensors")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path)]) == 1
    assert "is not an fzero checkpoint: it has no manifest.json" in capsys.readouterr().err
    # inspect checks the files' sizes and headers (it printed a damaged checkpoint as whole)
    damaged = str(tmp_path / "damaged")
    shutil.copytree(path, damaged)
    with open(os.path.join(damaged, "shard-00001-of-00002.safetensors"), "r+b") as f:
        f.truncate(100)
    assert main(["inspect", damaged]) == 1
    assert "shard-00001-of-00002.safetensors is 100 bytes" in capsys.readouterr().err
    # consolidate replaced any file at its output (a user's notes: found by a probe)
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    assert main(["consolidate", path, str(notes)]) == 1
    assert "notes.txt exists: pass overwrite=True (--overwrite)" in capsys.readouterr().err
    assert notes.read_text() == "keep me"
    assert main(["consolidate", path, str(notes), "--overwrite"]) == 0
    assert safetensors.load_file(notes).keys() == expected.keys()
    # a world size below 1 is a usage error, not a traceback
    for command in (["inspect", path, "--world-size", "0"],
                    ["reshard", path, str(tmp_path / "z"), "--world-size", "-2"]):
        with pytest.raises(SystemExit) as exit_:
            main(command)
        assert exit_.value.code == 2
        assert "a world size is at least 1 rank" in capsys.readouterr().err
    # and so is a bucket cap below 1; an output directory that does not exist is an error
    # message, not a traceback
    with pytest.raises(SystemExit) as exit_:
        main(["reshard", path, str(tmp_path / "z"), "--world-size", "1", "--bucket-cap", "0"])
    assert exit_.value.code == 2
    assert "a bucket holds at least 1 element" in capsys.readouterr().err
    assert main(["consolidate", path, str(tmp_path / "no" / "such" / "all.safetensors")]) == 1
    assert "error: " in capsys.readouterr().err


def test_a_manifest_with_an_impossible_stage_or_step_names_the_file(checkpoint) -> None:
    """Written with a valid checksum by a buggy writer: a stage outside 0-3 raised a bare
    "stage must be one of" naming no file (a probe)."""
    edit_manifest(checkpoint, lambda doc: doc["state"].update(stage=7))
    with pytest.raises(CheckpointError, match=r"manifest.json is malformed: .*stage 7"):
        read_manifest(checkpoint)
    edit_manifest(checkpoint, lambda doc: doc["state"].update(stage=3, step=-1))
    with pytest.raises(CheckpointError, match=r"manifest.json is malformed: .*step -1"):
        read_manifest(checkpoint)


def test_command_line_runs_as_a_module(saved_runs) -> None:
    done = subprocess.run([sys.executable, "-W", "error", "-m", "fzero.checkpoint", "inspect",
                           saved_runs[1, 0]["path"]], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    assert "world size 1" in done.stdout and done.stderr == ""


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error naming the file and the problem, before any state is built


@pytest.fixture
def checkpoint(tmp_path) -> str:
    """A fresh TinyGPT checkpoint at N=2, stage 3, to damage."""
    path = str(tmp_path / "c")
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 1, path, stage=3)
    return path


@pytest.fixture
def no_state_built(monkeypatch):
    """Fail the test if a load gets as far as allocating the state."""
    from fzero.checkpoint import record

    def build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a state was built from a bad checkpoint")

    monkeypatch.setattr(record, "build", build)


def load_errors(path: str, world: int = 2, model: Any = None, **kwargs: Any) -> list[str]:
    """Every rank's error from loading `path` (each rank must raise a CheckpointError)."""
    from checkpoint_bodies import load_error_body

    results = fzero.SimWorld(world).run(load_error_body, model or TinyGPT(), path, **kwargs)
    assert {kind for kind, _ in results} == {"CheckpointError"}, results
    return [message for _, message in results]


def flip_byte(path: str, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))


def test_not_a_checkpoint(tmp_path, no_state_built) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "file").write_text("hello")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "manifest.json").write_text('{"format": "something else"}')
    (tmp_path / "gone.partial").mkdir()
    cases = {
        "missing": "no checkpoint at .*missing: no such file or directory",
        "gone": r"gone: no such file or directory \(.*gone.partial exists: a save that did not",
        "file": "file is a file, not an fzero checkpoint",
        "empty": "empty is not an fzero checkpoint: it has no manifest.json",
        "dcp": "dcp is not an fzero checkpoint: .* a torch.distributed.checkpoint directory",
        "hf": "hf is not an fzero checkpoint: .* an exported model",
        "json": r"json/manifest.json is not an fzero checkpoint manifest \(format 'something",
    }
    for name, pattern in cases.items():
        for message in load_errors(str(tmp_path / name)):
            assert re.search(pattern, message), (name, message)
        with pytest.raises(CheckpointError, match=pattern):
            fzero.consolidate(tmp_path / name)


def edit_manifest(path: str, edit: Any, *, reseal: bool = True) -> None:
    """Edit a checkpoint's manifest as a writer would have written it (`reseal`: with the
    checksum of its new content), or as damage would (not resealed)."""
    from fzero.checkpoint import manifest

    where = os.path.join(path, "manifest.json")
    with open(where) as f:
        doc = json.load(f)
    edit(doc)
    if reseal:
        doc["crc32"] = manifest._doc_crc32(doc)
    with open(where, "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("edit", [
    lambda doc: doc["state"].update(step=doc["state"]["step"] - 1),  # b'3' -> b'2': one bit
    lambda doc: doc["state"]["optimizer"]["hyperparameters"].update(lr=0.5),
    lambda doc: doc["files"][1].update(crc32=doc["files"][1]["crc32"] ^ 1),
    lambda doc: doc.update(crc32=doc["crc32"] ^ 1),
])
def test_a_damaged_manifest_fails_its_checksum(checkpoint, no_state_built, edit) -> None:
    """The manifest was the one file without a checksum: a flipped bit in its step count
    loaded silently and the resumed run trained differently (a probe)."""
    edit_manifest(checkpoint, edit, reseal=False)
    for message in load_errors(checkpoint):
        assert "manifest.json fails its checksum" in message, message
    with pytest.raises(CheckpointError, match="manifest.json fails its checksum"):
        fzero.consolidate(checkpoint)


def test_a_manifest_without_a_checksum_still_loads(checkpoint) -> None:
    """Manifests written before fzero stored their checksum have none: they load as before."""
    edit_manifest(checkpoint, lambda doc: doc.pop("crc32"), reseal=False)
    assert read_manifest(checkpoint).step == 1


def test_newer_format_version(checkpoint, no_state_built) -> None:
    edit_manifest(checkpoint, lambda doc: doc.update(version=99))
    for message in load_errors(checkpoint):
        assert "manifest.json has checkpoint format version 99, newer than the version 1" in (
            message) and "upgrade fzero" in message


def test_missing_and_truncated_shard_files(checkpoint, no_state_built) -> None:
    second = os.path.join(checkpoint, "shard-00001-of-00002.safetensors")
    size = os.path.getsize(second)
    os.truncate(second, size - 100)
    for message in load_errors(checkpoint, world=3):
        assert f"shard-00001-of-00002.safetensors is {size - 100} bytes but the manifest " \
               f"records {size}: the file is truncated" in message
    os.remove(second)
    for message in load_errors(checkpoint, world=1):
        assert "shard-00001-of-00002.safetensors is missing: the manifest lists it as rank 1" in (
            message)
    with pytest.raises(CheckpointError, match="shard-00001-of-00002.safetensors is missing"):
        fzero.checkpoint.export(checkpoint, os.path.join(checkpoint, "..", "out"))


def test_checksum_mismatch(checkpoint, no_state_built, monkeypatch) -> None:
    flip_byte(os.path.join(checkpoint, "shard-00001-of-00002.safetensors"), 1000)
    messages = load_errors(checkpoint)
    assert "shard-00001-of-00002.safetensors fails its checksum: CRC-32 0x" in messages[1]
    assert "the manifest records 0x" in messages[1]
    assert "shard-00001-of-00002.safetensors fails its checksum: the checkpoint is damaged " \
           "(found by rank 1" in messages[0]
    with pytest.raises(CheckpointError, match="00001-of-00002.safetensors fails its checksum"):
        fzero.checkpoint.reshard(checkpoint, checkpoint + "-r", world_size=1)
    assert not os.path.exists(checkpoint + "-r")
    # Skipping checksums reads the damaged values: the option exists for trusted storage only.
    monkeypatch.undo()
    load_state = fzero.SimWorld(2).run(resume_body, TinyGPT(), gpt_batches(), [checkpoint], 0,
                                       verify_checksums=False)
    assert load_state[0][0]["loaded"]["step"] == 1


SHARD_0, SHARD_1 = "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"


def test_swapped_shard_files_are_found_without_the_checksums(checkpoint, no_state_built) -> None:
    """Every rank stores its buffers, so two ranks' files have equal sizes and headers: swapped
    (a copy script's mix-up), they loaded silently with verify_checksums=False, each rank
    reading another's moments and weights (a review). Each file names its rank now."""
    first, second = (os.path.join(checkpoint, name) for name in (SHARD_0, SHARD_1))
    assert os.path.getsize(first) == os.path.getsize(second)  # else the sizes would tell
    os.rename(first, first + ".tmp")
    os.rename(second, first)
    os.rename(first + ".tmp", second)
    messages = load_errors(checkpoint, verify_checksums=False)
    assert f"{SHARD_0} holds rank 1's shards, but the manifest lists it as rank 0's: shard " \
           f"files were renamed or swapped" in messages[0]
    # The other rank says what happened too, not "malformed header" (a probe)
    assert f"{SHARD_0} holds another rank's shards than the manifest lists: shard files were " \
           f"renamed or swapped (found by rank 0" in messages[1]
    with pytest.raises(CheckpointError, match="holds rank 1's shards"):
        fzero.consolidate(checkpoint, verify_checksums=False)


def test_a_shard_file_of_another_save_is_found_without_the_checksums(tmp_path,
                                                                     no_state_built) -> None:
    """A file copied in from another checkpoint of the same run (same layout, sizes and
    headers) loaded silently with verify_checksums=False; every file names its save now, and
    a reshard is a save of its own."""
    paths = [str(tmp_path / name) for name in ("a", "b")]
    for steps, path in zip((1, 2), paths, strict=True):
        fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), steps, path, stage=3)
    ids = [read_manifest(path).save_id for path in paths]
    assert len(set(ids)) == 2 and all(re.fullmatch("[0-9a-f]{16}", i) for i in ids), ids
    for path, save_id in zip(paths, ids, strict=True):
        for rank, name in enumerate((SHARD_0, SHARD_1)):
            with ShardFile(os.path.join(path, name)) as f:
                assert f.metadata == {"fzero.save_id": save_id, "fzero.rank": str(rank)}
    fzero.checkpoint.reshard(paths[0], str(tmp_path / "r"), world_size=2, progress=False)
    assert read_manifest(str(tmp_path / "r")).save_id not in ids
    shutil.copy(os.path.join(paths[1], SHARD_1), os.path.join(paths[0], SHARD_1))
    messages = load_errors(paths[0], verify_checksums=False)
    assert f"{SHARD_1} was written by another save (id {ids[1]}) than the manifest's (id " \
           f"{ids[0]}): a file copied in from another checkpoint" in messages[1]
    # Rank 0, whose log users read, said "has a malformed header ... damaged" (a probe)
    assert f"{SHARD_1} was written by another save than the manifest's: a file copied in from " \
           f"another checkpoint (found by rank 1" in messages[0]
    with pytest.raises(CheckpointError, match="was written by another save"):
        fzero.consolidate(paths[0], verify_checksums=False)


def test_a_checkpoint_written_before_files_named_their_save_loads(tmp_path, monkeypatch) -> None:
    """Checkpoints written before the save id and the files' ranks were recorded have neither:
    they load as before."""
    from fzero.checkpoint import saving

    monkeypatch.setattr(saving, "file_metadata", lambda save_id, rank: {})
    path = str(tmp_path / "old")
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 1, path, stage=1)
    edit_manifest(path, lambda doc: doc.pop("save_id"))
    assert read_manifest(path).save_id is None
    loaded = fzero.SimWorld(2).run(resume_body, TinyGPT(), gpt_batches(), [path], 0,
                                   verify_checksums=False)
    assert loaded[0][0]["loaded"]["step"] == 1


def test_checkpoint_of_another_model_lists_the_differences(checkpoint, no_state_built) -> None:
    for message in load_errors(checkpoint, model=TinyGPT(d_model=24, n_layer=3)):
        assert "manifest.json is a checkpoint of another model" in message
        assert "parameters only in the model: [blocks.2." in message
        assert "shapes differ (checkpoint vs model): [blocks.0.attn.proj.bias: (16,) vs (24,)" in (
            message)
    for message in load_errors(checkpoint, model=MLP()):
        assert "parameters only in the checkpoint: [blocks.0.attn.proj.bias" in message
        assert "parameters only in the model: [fc1.bias, fc1.weight, fc2.bias, fc2.weight]" in (
            message)


def untied(model: TinyGPT) -> TinyGPT:
    """`model` with its head a tensor of its own (values equal to the embedding's)."""
    model.lm_head.weight = torch.nn.Parameter(model.tok_emb.weight.detach().clone())
    return model


def test_a_tie_the_checkpoint_does_not_have_raises(tmp_path, no_state_built) -> None:
    """Saved untied, loaded into the tied model: the tensor would take one name's values and
    drop the other's, whatever the bucket policy."""
    path = str(tmp_path / "c")
    batches = [TinyGPT.make_batch(0, 2)]
    fzero.SimWorld(1).run(train_save_body, untied(TinyGPT()), batches, 1, path, stage=1)
    for kwargs in ({}, {"buckets": 10_000}, {"trainable": lambda name: True}):
        for message in load_errors(path, world=1, model=TinyGPT(), **kwargs):
            assert "tied in the model (one tensor) but separate in the checkpoint" in message
            assert "[lm_head.weight = tok_emb.weight]" in message or (
                "[tok_emb.weight = lm_head.weight]" in message), message


def _load_untied_body(comm: Any, path: str, **kwargs: Any) -> list[dict[str, Tensor]]:
    """The parameters as loaded into an untied model, and after a step."""
    model = untied(TinyGPT())
    state = fzero.load(path, model=model, comm=comm, **kwargs)
    loaded = {name: value.clone() for name, value in fzero.full_params(state).items()}
    state, _ = fzero.make_train_step(model, TinyGPT.loss_fn)(state, TinyGPT.make_batch(0, 2))
    return [loaded, fzero.full_params(state)]


def test_a_tie_the_model_no_longer_has_reads_the_one_stored_tensor_into_both(tmp_path) -> None:
    path = str(tmp_path / "c")
    batches = [TinyGPT.make_batch(0, 2)]
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), batches, 1, path, stage=2)
    # (By default the step then raised "the tie was broken after fzero.init", after a load.)
    for kwargs in ({}, {"buckets": 10_000}, {"trainable": lambda name: True}):
        for loaded, trained in fzero.SimWorld(2).run(_load_untied_body, path, **kwargs):
            assert torch.equal(loaded["lm_head.weight"], loaded["tok_emb.weight"])
            assert not torch.equal(trained["lm_head.weight"], trained["tok_emb.weight"])


def _local_buffers_body(comm: Any, path: str, save: bool) -> dict[str, Tensor]:
    """A BatchNorm net with buffers="local": two steps then a save (each rank's running
    statistics its own), or a load; the buffers either way."""
    import guarantee_bodies as gb

    model = gb.BatchNormNet()
    step = fzero.make_train_step(model, gb.mse_loss, buffers="local")
    if save:
        state = fzero.init(model, stage=1, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        batches = gb.mse_batches(4, rows=4, d_in=5, d_out=3)
        for index in range(2):  # each rank its own rows: its own statistics
            state, _ = step(state, batches[2 * index + comm.rank])
        fzero.save(state, path)
    else:
        state = fzero.load(path, model=model, comm=comm)
    return {name: b.clone() for name, b in state.buffers.items()}


def test_each_rank_gets_its_own_buffers_back(tmp_path) -> None:
    """buffers="local": only rank 0's were stored, and a load gave them to every rank."""
    path = str(tmp_path / "c")
    saved = fzero.SimWorld(2).run(_local_buffers_body, path, True)
    assert not torch.equal(saved[0]["bn.running_mean"], saved[1]["bn.running_mean"])
    for own, loaded in zip(saved, fzero.SimWorld(2).run(_local_buffers_body, path, False),
                           strict=True):
        assert all(torch.equal(own[name], loaded[name]) for name in own)
    for loaded in fzero.SimWorld(3).run(_local_buffers_body, path, False):  # another N
        assert all(torch.equal(saved[0][name], loaded[name]) for name in loaded)
    resharded = str(tmp_path / "r")
    fzero.checkpoint.reshard(path, resharded, world_size=2, progress=False)
    for own, loaded in zip(saved, fzero.SimWorld(2).run(_local_buffers_body, resharded, False),
                           strict=True):
        assert all(torch.equal(own[name], loaded[name]) for name in own)


def test_a_checkpoint_without_every_ranks_buffers_reads_rank_0s() -> None:
    """Checkpoints written before every rank stored its buffers hold rank 0's only."""
    layout = fzero.plan(TinyGPT(), 2)
    buffers = {"scale": ("float32", (3,))}
    old = {"master": [], "optimizer_state": False, "moments": []}
    names = [[s.name for s in record.file_specs(layout, {**old, **flag}, buffers, rank)]
             for flag in ({}, {"rank_buffers": True}) for rank in (0, 1)]
    assert ["buffers.scale" in n for n in names] == [True, False, True, True]


def test_buffers_of_another_model(tmp_path, no_state_built) -> None:
    path = str(tmp_path / "c")
    fzero.SimWorld(1).run(train_save_body, FrozenMix(), [FrozenMix.make_batch(0, 2)], 1, path,
                          stage=0)
    model = FrozenMix()
    del model.perm
    model.register_buffer("other", torch.zeros(3))
    for message in load_errors(path, world=1, model=model):
        assert "buffers only in the checkpoint: [perm]" in message
        assert "buffers only in the model: [other]" in message
    model = FrozenMix()
    model.perm = model.perm.double()  # an index buffer in the checkpoint, floating here
    for message in load_errors(path, world=1, model=model):
        assert "buffer dtypes differ (checkpoint vs model): [perm: int64 vs float64]" in message


def test_optimizer_problems(tmp_path, no_state_built) -> None:
    from checkpoint_bodies import make_optimizer

    weights = str(tmp_path / "weights")
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 1, weights, stage=3,
                          optimizer_state=False)
    for message in load_errors(weights):
        assert "weights holds no optimizer state (saved with optimizer_state=False): load it " \
               "with weights_only=True" in message
    adamw = str(tmp_path / "adamw")
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 1, adamw, stage=3)
    sgd = make_optimizer(("sgd", {"lr": 0.1, "momentum": 0.9}))
    for message in load_errors(adamw, optimizer=sgd):
        assert "holds optimizer moments ['exp_avg', 'exp_avg_sq'], but the optimizer keeps " \
               "['momentum_buffer']" in message
    edit_manifest(adamw, lambda doc: doc["state"]["optimizer"].update(schedule=True))
    for message in load_errors(adamw):
        assert "was trained with a learning-rate schedule (adamw), which a checkpoint cannot " \
               "store: pass the optimizer again" in message


def test_unfreezing_needs_weights_only(tmp_path, no_state_built) -> None:
    path = str(tmp_path / "c")
    fzero.SimWorld(1).run(train_save_body, FrozenMix(), [FrozenMix.make_batch(0, 2)], 1, path,
                          stage=1)
    everything = FrozenMix().requires_grad_(True)
    for message in load_errors(path, world=1, model=everything, trainable=lambda name: True):
        assert "parameters frozen when saved are trainable now and have no optimizer state: " \
               "[frozen.bias, frozen.weight, offset]" in message


# ----------------------------------------------------------------------------------------------
# Atomic saves


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    from checkpoint_bodies import save_error_body

    save_module = importlib.import_module("fzero.checkpoint.saving")

    path = str(tmp_path / "c")
    before = fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 1, path,
                                   stage=3)[0]
    real = save_module.write_file

    def crash_on_rank1(target, *args, **kwargs):
        if "shard-00001" in os.fspath(target):
            with open(target, "wb") as f:
                f.write(b"half a file")
            raise OSError("disk full (simulated)")
        return real(target, *args, **kwargs)

    monkeypatch.setattr(save_module, "write_file", crash_on_rank1)
    results = fzero.SimWorld(2).run(save_error_body, TinyGPT(), path, overwrite=True)
    for kind, message in results:
        assert kind == "CheckpointError" and "failed on ranks [1]; nothing was written" in message
    assert "disk full (simulated)" in results[1][1]
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no partial directory left behind
    monkeypatch.setattr(save_module, "write_file", real)
    (after,) = fzero.SimWorld(2).run(resume_body, TinyGPT(), gpt_batches(), [path], 0)[0]
    assert_state_equal(after["loaded"], before["saved"], exact=True)


def _odd_save_body(comm: Any, path: str, odd: dict[str, Any]) -> tuple[str, str]:
    """Init and save; rank 1 passes `odd` to save besides (the others nothing)."""
    state = fzero.init(TinyGPT(), stage=3, optimizer=fzero.optim.adamw(lr=0.01), comm=comm)
    try:
        fzero.save(state, path, overwrite=True, **(odd if comm.rank == 1 else {}))
    except (CheckpointError, TypeError) as error:
        return type(error).__name__, str(error)
    return "saved", ""


@pytest.mark.parametrize(("odd", "named"), [
    ({"optimizer_state": False}, "they differ in: optimizer_state (this rank: "),
    ({"extra": {"x": object()}}, "extra= of rank(s) [1] is not JSON data"),
])
def test_ranks_that_save_differently_raise_and_keep_the_checkpoint(tmp_path, odd, named) -> None:
    """Each rank writes its own file, rank 0 describes them all: a rank saving without its
    optimizer state wrote a checkpoint that "saved" but could not be loaded, deleting the good
    one (overwrite=True); a rank whose extra= is not JSON left the others in a collective that
    failed with "connection closed" (a probe). Every rank now raises before anything is
    written, and the previous checkpoint stays."""
    path = str(tmp_path / "c")
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 2, path, stage=3)
    before = {name: os.path.getmtime(os.path.join(path, name)) for name in os.listdir(path)}
    outcomes = fzero.SimWorld(2).run(_odd_save_body, path, odd)
    if "extra" in odd:
        assert outcomes[1][0] == "TypeError"
        assert outcomes[0][0] == "CheckpointError" and named in outcomes[0][1]
    else:
        for kind, message in outcomes:
            assert kind == "CheckpointError" and named in message, message
            assert "nothing was written" in message
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no partial directory left either
    assert {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)} == before
    assert read_manifest(path).step == 2


def test_save_refuses_to_overwrite_unless_asked(tmp_path) -> None:
    from checkpoint_bodies import save_error_body

    path = str(tmp_path / "c")
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 1, path, stage=3)
    for kind, message in fzero.SimWorld(2).run(save_error_body, TinyGPT(), path):
        assert kind == "CheckpointError" and "c exists: pass overwrite=True" in message
    assert read_manifest(path).step == 1
    for kind, _ in fzero.SimWorld(2).run(save_error_body, TinyGPT(), path, extra={"x": object()}):
        assert kind == "TypeError"


def test_overwrite_replaces_only_a_checkpoint(tmp_path) -> None:
    """A run directory (or a file) given by mistake is not deleted by overwrite=True."""
    from checkpoint_bodies import save_error_body

    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me too")
    for target in (run, tmp_path / "file"):
        for kind, message in fzero.SimWorld(2).run(save_error_body, TinyGPT(), str(target),
                                                    overwrite=True):
            assert kind == "CheckpointError", message
            assert "exists and is not a checkpoint (no manifest.json)" in message
    assert (run / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "file").read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "run"]  # nothing partial


def test_a_save_deletes_no_folder_of_the_users_beside_the_checkpoint(tmp_path) -> None:
    """``<path>.partial`` (where a save writes first) and ``<path>.old`` (where overwrite=True
    moves the old checkpoint for a moment) are deleted only when they hold nothing but a save's
    files: a folder of the user's own under that name is kept, and every rank raises naming it
    (overwrite=True deleted a user's ``c.old``)."""
    from checkpoint_bodies import save_error_body

    path = tmp_path / "c"
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 2, str(path), stage=3)
    for suffix in (".partial", ".old"):
        mine = tmp_path / f"c{suffix}"
        mine.mkdir()
        (mine / "notes.txt").write_text("keep me")
        outcomes = fzero.SimWorld(2).run(save_error_body, TinyGPT(), str(path), overwrite=True)
        assert all(kind == "CheckpointError" for kind, _ in outcomes), outcomes
        assert f"c{suffix} holds other files" in outcomes[0][1], outcomes
        assert (mine / "notes.txt").read_text() == "keep me"
        assert read_manifest(str(path)).step == 2  # the checkpoint is untouched
        (mine / "notes.txt").unlink()
    assert sorted(os.listdir(tmp_path / "c.partial")) == [  # the new one, waiting
        "manifest.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]


def test_interrupted_save_is_ignored_and_cleaned(tmp_path) -> None:
    root = tmp_path / "run"
    for steps in (1, 3):
        fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), steps,
                              str(root / f"step-{steps:06d}"), stage=3)
    # A job killed mid-save leaves its partial directory (even with a manifest in it).
    killed = root / "step-000005.partial"
    killed.mkdir()
    (killed / "manifest.json").write_text("{")
    (killed / "shard-00000-of-00002.safetensors").write_bytes(b"junk")
    assert latest(root) == str(root / "step-000003")
    assert latest(tmp_path / "nothing") is None
    # A checkpoint given for the run's directory: None would have meant a silent fresh start.
    with pytest.raises(CheckpointError, match=r"step-000003 is a checkpoint itself, not a "
                                              r"directory of checkpoints"):
        latest(root / "step-000003")
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 5, str(root / "step-000005"),
                          stage=3)
    assert latest(root) == str(root / "step-000005")
    assert sorted(os.listdir(root)) == ["step-000001", "step-000003", "step-000005"]
    # a file: None would have trained from scratch up to the first save under it (a probe)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match=r"a-file is a file, not a directory of "):
        latest(tmp_path / "a-file")
    # the run's directory given for a checkpoint: the message names the newest inside
    with pytest.raises(CheckpointError, match=r"run is not an fzero checkpoint: it has no "
                                              r"manifest.json \(it holds checkpoints, the "
                                              r"newest .*step-000005: a run's directory\?"):
        read_manifest(root)
    # ... with a damaged one among them: skipped without a word and without touching the
    # warnings filters, which are process-wide (a catch_warnings here raced other threads')
    (root / "step-000005" / "manifest.json").write_text("{ truncated")
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught, \
            mock.patch.object(warnings, "simplefilter", side_effect=AssertionError("touched")):
        with pytest.raises(CheckpointError, match=r"the newest .*step-000003: a run's"):
            read_manifest(root)
    assert caught == [] and warnings.filters == filters


def test_latest_says_when_it_skips_a_damaged_checkpoint(tmp_path) -> None:
    """A newest checkpoint whose manifest is damaged is skipped for the one before, with a
    warning naming it (a resume went back 10 steps without a word: found by a probe)."""
    root = tmp_path / "run"
    for steps in (1, 3):
        fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), steps,
                              str(root / f"step-{steps:06d}"), stage=1)
    (root / "step-000003" / "manifest.json").write_text("{ truncated")
    with pytest.warns(RuntimeWarning, match=r"latest: skipping .*step-000003, whose manifest "
                                            r"cannot be read \(.*is not JSON") as caught:
        assert latest(root) == str(root / "step-000001")
    assert caught[0].filename == __file__  # (the warning points at the caller of latest)


def test_overwrite_replaces_atomically(tmp_path) -> None:
    from checkpoint_bodies import init_save_body

    path = str(tmp_path / "c")
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 2, path, stage=3)
    fzero.SimWorld(3).run(init_save_body, TinyGPT(), path, stage=1, overwrite=True)
    manifest = read_manifest(path)
    assert manifest.world_size == 3 and manifest.step == 0
    assert sorted(os.listdir(tmp_path)) == ["c"]


@pytest.mark.parametrize("when", ["before verifying", "after verifying"])
def test_a_load_overlapping_an_overwriting_save_raises(tmp_path, monkeypatch, when) -> None:
    """An eval job loading "last" while training overwrites it: the load read the old manifest
    and then opened shard files by name from the directory renamed into place, and returned
    the new weights and moments under the old step and settings, without an error (a probe saw
    33 such mixes in 178 loads). The directory is now pinned: replaced during a load, every
    rank raises."""
    from fzero.checkpoint import loading

    old, new = str(tmp_path / "last"), str(tmp_path / "next")
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 1, old, stage=3)
    fzero.SimWorld(2).run(train_save_body, TinyGPT(), gpt_batches(), 3, new, stage=3)
    real_verify = loading.verify

    def overwrite() -> None:  # what save(overwrite=True) does: a rename into place
        os.rename(old, old + ".old")
        shutil.copytree(new, old)
        shutil.rmtree(old + ".old")

    def verify(path: str, manifest: Any, comm: Any, **kwargs: Any) -> None:
        if when == "before verifying" and comm.rank == 0:
            overwrite()
        comm.barrier()
        real_verify(path, manifest, comm, **kwargs)
        if when == "after verifying" and comm.rank == 0:
            overwrite()
        comm.barrier()

    monkeypatch.setattr(loading, "verify", verify)
    for message in load_errors(old):
        assert "was replaced while it was being read" in message, message
    monkeypatch.setattr(loading, "verify", real_verify)
    assert fzero.SimWorld(2).run(lambda comm: fzero.load(old, model=TinyGPT(), comm=comm).step
                                 ) == [3, 3]  # loading it again reads the new one

    # The offline tools (one process) raise where they would open a file of the new one.
    real_file = loading.Reader.file

    def file_after_overwrite(reader: Any, rank: int) -> Any:
        if rank == 1:
            overwrite()
        return real_file(reader, rank)

    monkeypatch.setattr(loading.Reader, "file", file_after_overwrite)  # replaced again
    with pytest.raises(CheckpointError, match="was replaced while it was being read"):
        fzero.consolidate(old)


# ----------------------------------------------------------------------------------------------
# gloo processes


def test_gloo_save_load_and_reshard(gloo_pool, tmp_path) -> None:
    """Two gloo processes save at stage 3; two resume bitwise (RNG states included), three
    load it resharded at stage 1."""
    from checkpoint_bodies import rng_body

    path = str(tmp_path / "c")
    saved = gloo_pool(2).run(train_save_body, TinyGPT(), gpt_batches(), SAVE_AT, path, stage=3)
    reference = gloo_pool(2).run(run_body, TinyGPT(), gpt_batches(), SAVE_AT + CONTINUE,
                                 stage=3)[0]
    (same,) = gloo_pool(2).run(resume_body, TinyGPT(), gpt_batches(), [path], CONTINUE)[0]
    assert_state_equal(same["loaded"], saved[0]["saved"], exact=True)
    assert_losses(saved[0]["losses"] + same["losses"], reference["losses"], exact=True)
    assert_state_equal(same["final"], reference["final"], exact=True)
    (other,) = gloo_pool(3).run(resume_body, TinyGPT(), gpt_batches(), [path], 1, stage=1)[0]
    assert_state_equal(other["loaded"], saved[0]["saved"], exact=True)
    rng = str(tmp_path / "rng")
    drawn = gloo_pool(2).run(rng_body, TinyGPT(), rng, save=True)
    assert drawn[0] != drawn[1]
    assert gloo_pool(2).run(rng_body, TinyGPT(), rng, save=False) == drawn


def test_gloo_every_rank_raises_on_a_damaged_file(gloo_pool, tmp_path) -> None:
    from checkpoint_bodies import load_error_body

    path = str(tmp_path / "c")
    gloo_pool(3).run(train_save_body, TinyGPT(), gpt_batches(), 1, path, stage=2)
    flip_byte(os.path.join(path, "shard-00002-of-00003.safetensors"), 500)
    results = gloo_pool(3).run(load_error_body, TinyGPT(), path)
    assert [kind for kind, _ in results] == ["CheckpointError"] * 3
    assert all("shard-00002-of-00003.safetensors fails its checksum" in m for _, m in results)


# ----------------------------------------------------------------------------------------------
# Examples


def run_example(*argv: str) -> str:
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_train_gpt_restarts_where_it_stopped(tmp_path) -> None:
    """A job stopped after 3 of 4 steps and rerun ends exactly where the uninterrupted job
    does: same parameters, moments and sampler state, bitwise."""
    args = ["examples/train_gpt.py", "--steps", "4", "--batch-size", "4", "--seq-len", "16",
            "--warmup-steps", "1", "--sample-bytes", "0", "--save-every", "2"]
    run_example(*args, "--resume", str(tmp_path / "a"))
    first = run_example(*args, "--resume", str(tmp_path / "b"), "--stop-after", "3")
    second = run_example(*args, "--resume", str(tmp_path / "b"))
    assert "resume" not in first and f"resume {tmp_path / 'b' / 'step-000003'}: 3 steps" in second
    assert sorted(os.listdir(tmp_path / "b")) == ["step-000002", "step-000003", "step-000004"]
    whole, whole_tensors = shard_contents(str(tmp_path / "a" / "step-000004"))
    resumed, resumed_tensors = shard_contents(str(tmp_path / "b" / "step-000004"))
    assert whole.extra == resumed.extra and whole.step == resumed.step == 4
    assert whole_tensors.keys() == resumed_tensors.keys()
    for key, value in whole_tensors.items():
        assert bitwise_equal(resumed_tensors[key], value), key
    # A rerun after the last save (a restart of a job killed during its evaluation) still
    # evaluates and reports: it returned with neither (a probe).
    metrics = tmp_path / "done.json"
    done = run_example(*args, "--resume", str(tmp_path / "b"), "--metrics-json", str(metrics))
    assert "all 4 steps were taken already" in done
    val = float(done.split("val loss ")[1].split()[0])
    finished = run_example(*args, "--resume", str(tmp_path / "a"))  # (evaluated as it ended)
    assert f"val loss {val:.3f}" in finished
    assert json.loads(metrics.read_text())[0]["losses"] == []


@pytest.mark.slow
def test_train_gpt_stop_after_saves_where_it_stops(tmp_path) -> None:
    """``--stop-after`` without ``--save-every`` saved nothing, so every rerun started again
    from step 1 (a probe); the run now saves where it stops, and the rerun continues. Without
    ``--resume`` there is nowhere to save: an argument error."""
    args = ["examples/train_gpt.py", "--steps", "4", "--batch-size", "4", "--seq-len", "16",
            "--warmup-steps", "1", "--sample-bytes", "0"]
    run_example(*args, "--resume", str(tmp_path / "b"), "--stop-after", "3")
    assert os.listdir(tmp_path / "b") == ["step-000003"]
    second = run_example(*args, "--resume", str(tmp_path / "b"))
    assert f"resume {tmp_path / 'b' / 'step-000003'}: 3 steps" in second
    refused = subprocess.run([sys.executable, *args, "--stop-after", "3"], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert refused.returncode == 2 and "--stop-after needs --resume DIR" in refused.stderr
    # A rerun with other settings continued as if it were the same run, drawing other batches
    # or another schedule (a probe): refused, naming each setting.
    changed = subprocess.run([sys.executable, *args, "--lr", "0.5", "--resume",
                              str(tmp_path / "b")], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=600)
    assert changed.returncode != 0 and "saved by a run with other settings" in changed.stderr
    assert "(lr: 0.002 in the checkpoint, 0.5 now)" in changed.stderr, changed.stderr


def test_train_gpt_reads_no_checkpoint_as_its_corpus(tmp_path) -> None:
    """``--data .`` beside ``--resume ck`` read the checkpoint's own shards as text on resume
    (22 MB instead of 39 KB, other losses: a probe): the corpus leaves out the run's
    checkpoint folder, any fzero checkpoint and a save's .partial / .old folders."""
    sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
    try:
        train_gpt = importlib.import_module("train_gpt")
    finally:
        sys.path.pop(0)
    (tmp_path / "text.txt").write_text("hello corpus\n" * 100)
    for folder in ("ck/step-000002", "other", "x.partial", "y.old"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "shard-00000-of-00002.safetensors").write_bytes(b"\0" * 100)
    (tmp_path / "other" / "manifest.json").write_text("{}")
    tokens, _ = train_gpt.load_corpus(str(tmp_path), exclude=(str(tmp_path / "ck"),))
    assert bytes(tokens.tolist()) == b"hello corpus\n" * 100
    # A user's folder holding a manifest.json of its own, or named *.old, is data (the first
    # version skipped both: a review).
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "manifest.json").write_text('{"source": "a library"}')
    (tmp_path / "books" / "a.txt").write_text("a book\n")
    (tmp_path / "drafts.old").mkdir()
    (tmp_path / "drafts.old" / "b.txt").write_text("old draft\n")
    tokens, _ = train_gpt.load_corpus(str(tmp_path), exclude=(str(tmp_path / "ck"),))
    text = bytes(tokens.tolist())
    assert b"a book" in text and b"old draft" in text and b"\0" not in text


@pytest.mark.slow
def test_bench_checkpoint_runs(tmp_path) -> None:
    out = run_example("examples/bench_checkpoint.py", "--size", "small", "--dir", str(tmp_path))
    assert "| fzero stage 3 |" in out and "| FSDP2 + DCP |" in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [1, 3])
def test_gpu_state_resumes_bitwise_and_loads_on_the_cpu(tmp_path, bare_env, stage: int) -> None:
    """A state on the GPU (NCCL, one rank) saved after 2 steps and loaded trains on bitwise like
    the uninterrupted run, every tensor back on the GPU; the same checkpoint loads into a CPU
    state with the saved values."""
    path = str(tmp_path / "ckpt")
    batches = [tuple(t.cuda() for t in batch) for batch in gpt_batches(5)]
    with fzero.distributed(backend="nccl") as comm:
        model = TinyGPT().cuda()
        step = fzero.make_train_step(model, TinyGPT.loss_fn)
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.adamw(lr=1e-2), comm=comm)
        for batch in batches[:SAVE_AT]:
            state, _ = step(state, batch)
        fzero.save(state, path)
        saved = {name: value.cpu() for name, value in fzero.full_params(state).items()}
        uninterrupted, resumed = [], []
        for batch in batches[SAVE_AT:]:
            state, metrics = step(state, batch)
            uninterrupted.append(metrics["loss"])
        loaded = fzero.load(path, model=model, comm=comm)
        held = [t for t in (*loaded.params, *loaded.grads, *loaded.master,
                            *(m for ms in loaded.moments.values() for m in ms)) if t is not None]
        assert held and all(t.is_cuda for t in held)
        for batch in batches[SAVE_AT:]:
            loaded, metrics = step(loaded, batch)
            resumed.append(metrics["loss"])
    assert resumed == uninterrupted

    def load_on_cpu(comm: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return fzero.full_params(fzero.load(path, model=model, comm=comm))

    (on_cpu,) = fzero.SimWorld(1).run(load_on_cpu, TinyGPT())
    assert set(on_cpu) == set(saved)
    for name, value in saved.items():
        assert not on_cpu[name].is_cuda and torch.equal(on_cpu[name], value), name
