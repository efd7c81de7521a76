"""examples/finetune_hf.py end to end: GPT-2 / GPT-NeoX fine-tuned with fzero on 2 ranks, part
of the model frozen, data split by DistributedSampler, exported for `from_pretrained`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import finetune_hf as ft
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import (
    AutoModelForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    PreTrainedTokenizerFast,
)

import fzero

ROOT = Path(__file__).resolve().parent.parent
DATA = str(ROOT / "fzero")  # a small local folder of text: no download, fast to read
TINY = ["--steps", "4", "--seq-len", "16", "--d-model", "32", "--n-head", "2",
        "--batch-size", "4", "--lr", "3e-3", "--data", DATA]


def initial(args) -> dict[str, torch.Tensor]:
    model, _ = ft.build_model(args)  # seeded: the weights every run starts from
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_torchrun_stage3_partly_frozen_and_export(tmp_path: Path, nproc: int,
                                                    rtol: float) -> None:
    """finetune_hf.py under torchrun with `nproc` processes: the losses of one process (within
    `rtol`), only the chosen parameters trained, and an export `from_pretrained` loads."""
    out, metrics = tmp_path / "tuned", tmp_path / "metrics.json"
    argv = [*TINY, "--stage", "3", "--train", "transformer.h.*.attn.*"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), str(ROOT / "examples" / "finetune_hf.py"), *argv, "--out", str(out),
         "--metrics-json", str(metrics)],
        env=env, check=True, timeout=300, capture_output=True,
    )
    summary = json.loads(metrics.read_text())
    assert summary["world_size"] == nproc and len(summary["losses"]) == 4
    assert summary["trainable"] and all(".attn." in n for n in summary["trainable"])

    # The same global batches in one process (DistributedSampler's shuffle does not depend on
    # the world size): the same losses, up to float32 summation order.
    args = ft.parse_args(argv)
    alone = fzero.SimWorld(1).run(ft.train, args)[0]
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(alone["losses"]),
                               rtol=rtol, atol=0)

    # The export loads with from_pretrained: frozen weights as they started, attention trained.
    start = initial(args)
    loaded = dict(AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
                  .named_parameters())
    assert set(loaded) == set(start)
    for name, value in start.items():
        same = torch.equal(loaded[name], value)
        assert same == (name not in summary["trainable"]), name


@pytest.mark.slow
def test_torchrun_two_ranks_stage3_partly_frozen_and_export(tmp_path: Path) -> None:
    check_torchrun_stage3_partly_frozen_and_export(tmp_path, nproc=2, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torchrun_on_the_gpu_partly_frozen_and_export(tmp_path: Path) -> None:
    """One rank on the GPU (NCCL): the batches move to the state's device; the losses agree
    with the CPU's up to the devices' float32 kernels."""
    check_torchrun_stage3_partly_frozen_and_export(tmp_path, nproc=1, rtol=1e-3)


def neox_dir(path: Path, tokenizer: bool) -> str:
    """A saved tiny GPT-NeoX, with a byte-level BPE tokenizer of 256 tokens if `tokenizer`."""
    config = GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                           bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    GPTNeoXForCausalLM(config).save_pretrained(path)
    if tokenizer:
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(["def return"], vocab_size=256, show_progress=False)
        PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(("stage", "tokenizer"), [(1, False), (3, True)])
def test_local_model_directory_on_gloo(
    gloo_pool: Any, tmp_path: Path, stage: int, tokenizer: bool
) -> None:
    out = tmp_path / "tuned"
    args = ft.parse_args([*TINY, "--model", neox_dir(tmp_path / "neox", tokenizer),
                          "--stage", str(stage), "--train", "gpt_neox.layers.*",
                          "--out", str(out)])
    results = gloo_pool(2).run(ft.train, args)
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    assert not any("embed" in n for n in results[0]["trainable"])
    assert (out / "tokenizer.json").exists() == tokenizer
    assert (out / "config.json").exists()


def test_a_bfloat16_run_exports_its_master_copy_and_the_frozen_weights_as_they_were(
    gloo_pool: Any, tmp_path: Path,
) -> None:
    """Under ``--param-dtype bfloat16`` the export wrote the bfloat16 compute copy into the
    float32 model: trained weights rounded to bfloat16, and frozen pretrained weights changed
    by that rounding (a probe). The frozen ones come back bitwise, the trained ones at the
    master copy's float32 precision."""
    out = tmp_path / "tuned"
    model_dir = neox_dir(tmp_path / "neox", False)
    args = ft.parse_args([*TINY, "--model", model_dir, "--stage", "3", "--param-dtype",
                          "bfloat16", "--train", "gpt_neox.layers.*.attention.*",
                          "--out", str(out)])
    summary = gloo_pool(2).run(ft.train, args)[0]
    start = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    loaded = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    assert summary["trainable"] and set(loaded) == set(start)
    for name, value in loaded.items():
        assert value.dtype == torch.float32, name
        if name in summary["trainable"]:
            assert not torch.equal(value, start[name]), name
            assert not torch.equal(value, value.bfloat16().float()), name  # not rounded
        else:
            assert torch.equal(value, start[name]), name


def test_a_bfloat16_model_trained_in_float32_exports_float32(
    gloo_pool: Any, tmp_path: Path,
) -> None:
    """A bfloat16 ``save_pretrained`` model trains in float32 (the default ``--param-dtype``
    widens it), but the export copied the trained weights into the bfloat16 module: the
    output was not the trained model (a probe). It is written in float32: the trained weights
    as trained, the frozen ones the bfloat16 values widened exactly."""
    out = tmp_path / "tuned"
    base = tmp_path / "neox-bf16"
    AutoModelForCausalLM.from_pretrained(neox_dir(tmp_path / "neox", False)).to(
        torch.bfloat16).save_pretrained(base)
    args = ft.parse_args([*TINY, "--model", str(base), "--stage", "1",
                          "--train", "gpt_neox.layers.*.attention.*", "--out", str(out)])
    summary = gloo_pool(2).run(ft.train, args)[0]
    start = dict(AutoModelForCausalLM.from_pretrained(base).named_parameters())
    loaded = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    assert summary["trainable"] and set(loaded) == set(start)
    for name, value in loaded.items():
        assert value.dtype == torch.float32, name
        if name in summary["trainable"]:
            assert not torch.equal(value, value.bfloat16().float()), name  # not rounded
        else:
            assert torch.equal(value, start[name].float()), name


def checkpointing_runs(gloo_pool: Any, config: str) -> tuple[list[float], list[float]]:
    argv = [*TINY, "--config", config, "--stage", "3", "--train", "*.attn.*",
            "--train", "*.attention.*"]
    plain = gloo_pool(2).run(ft.train, ft.parse_args(argv))[0]["losses"]
    recomputed = gloo_pool(2).run(ft.train, ft.parse_args([*argv, "--gradient-checkpointing"]))
    return plain, recomputed[0]["losses"]


def test_gradient_checkpointing_flag_runs(gloo_pool: Any) -> None:
    plain, recomputed = checkpointing_runs(gloo_pool, "gpt2")
    assert len(recomputed) == 4 and all(torch.isfinite(torch.tensor(recomputed)))
    assert recomputed[0] == plain[0]  # the first forward is the same computation


@pytest.mark.parametrize("config", ["gpt2", "gpt-neox"])
def test_gradient_checkpointing_parity(gloo_pool: Any, config: str) -> None:
    plain, recomputed = checkpointing_runs(gloo_pool, config)
    torch.testing.assert_close(torch.tensor(recomputed), torch.tensor(plain), rtol=1e-6, atol=0)


def test_a_wrong_model_directory_or_a_too_long_sequence_is_named(tmp_path: Path) -> None:
    """``--model`` at a missing directory gave Hugging Face's "Repo id must be in the form"
    (it read the path as a hub id), one without a config "Unrecognized model", and a
    ``--seq-len`` beyond the model's positions a bare IndexError at the first step (a probe)."""
    for model in (tmp_path / "missing", tmp_path):
        with pytest.raises(SystemExit, match=f"--model {model}: not a local model directory"):
            ft.build_model(ft.parse_args([*TINY, "--model", str(model)]))
    args = ft.parse_args([*TINY, "--model", neox_dir(tmp_path / "neox", False),
                          "--seq-len", "17"])
    with pytest.raises(fzero.SimWorldError, match="--seq-len 17 is longer than the model's 16"):
        fzero.SimWorld(1).run(ft.train, args)


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--seq-len", "--n-layer",
                                  "--d-model", "--n-head"])
def test_sizes_below_one_are_argument_errors(flag: str, capsys) -> None:
    """``--steps 0`` crashed with UnboundLocalError after training nothing (a probe)."""
    with pytest.raises(SystemExit) as info:
        ft.parse_args([*TINY, flag, "0"])
    assert info.value.code == 2 and f"{flag} must be >= 1" in capsys.readouterr().err


def test_outputs_that_cannot_be_written_are_argument_errors(tmp_path: Path, capsys) -> None:
    """``--out`` naming a file trained the whole run, then save_pretrained logged and skipped
    it while the script printed "saved to" (a probe); a ``--metrics-json`` in a missing folder
    failed after training. Both are argument errors before anything runs."""
    taken = tmp_path / "file"
    taken.write_text("")
    for argv, message in ((["--out", str(taken)], "a file, not a directory"),
                          (["--metrics-json", str(tmp_path / "no" / "m.json")],
                           "its directory does not exist"),
                          (["--metrics-json", str(tmp_path)], "a directory, not a file")):
        with pytest.raises(SystemExit) as info:
            ft.parse_args([*TINY, *argv])
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_pattern_matching_a_tied_name_trains_the_tensor() -> None:
    """GPT-2's ``lm_head.weight`` is its ``transformer.wte.weight`` (tied): ``--train
    'lm_head.*'`` said "matches no parameter" (the names were listed without duplicates, a
    probe); it trains the tied tensor, listed under both names, and freezes the rest."""
    model, _ = ft.build_model(ft.parse_args(TINY))
    tensors = ft.select_trainable(model, ["lm_head.*"])
    assert tensors == [["transformer.wte.weight", "lm_head.weight"]]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "transformer.wte.weight"]
    every = ft.select_trainable(model, None)
    assert len(every) == len(list(model.parameters())) and all(
        p.requires_grad for p in model.parameters())
