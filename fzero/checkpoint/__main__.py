"""Command line: ``python -m fzero.checkpoint {inspect,reshard,consolidate,export} ...``.

    python -m fzero.checkpoint inspect ckpt/step-000100 --world-size 8 64
    python -m fzero.checkpoint reshard ckpt/step-000100 ckpt/step-000100-n8 --world-size 8
    python -m fzero.checkpoint consolidate ckpt/step-000100 model.safetensors --master
    python -m fzero.checkpoint export ckpt/step-000100 hf_dir --dtype bfloat16
    python -m fzero.checkpoint export ckpt/step-000100 hf_dir --hf-model ./my-gpt2  # + config
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence

import torch

from fzero import memory
from fzero.checkpoint.manifest import CheckpointError, Manifest, read_manifest
from fzero.checkpoint.offline import DEFAULT_MAX_SHARD_SIZE, export, reshard, write_model
from fzero.checkpoint.verify import verify
from fzero.state import STAGES, layout_bytes_theory

__all__ = ["describe", "main"]


def describe(path: str, manifest: Manifest, world_sizes: Sequence[int]) -> str:
    """What `inspect` prints: the run, the files, the buckets and a memory table."""
    state, layout = manifest.state, manifest.layout
    optimizer = state["optimizer"]
    if optimizer is None:
        opt = "not recorded"
    else:
        hyper = ", ".join(f"{k}={v}" for k, v in optimizer["hyperparameters"].items())
        schedule = ", lr=<schedule>" if optimizer["schedule"] else ""
        opt = f"{optimizer['name']}({hyper}{schedule})"
    stored = ("stored: " + ", ".join(state["moments"]) if state["optimizer_state"]
              else "not stored (weights only)")
    lines = [
        f"checkpoint  {path}",
        f"format      fzero.checkpoint v{manifest.version}, written by fzero "
        f"{manifest.fzero_version}, torch {manifest.torch_version}",
        f"run         step {manifest.step}, stage {manifest.stage}, world size "
        f"{manifest.world_size}, param dtype {state['param_dtype'] or 'as the model'}, master "
        f"{state['master_dtype']}, reduce {state['reduce_dtype'] or 'as params'}",
        f"optimizer   {opt}; state {stored}",
        f"loss scale  {state['loss_scale']}",
        f"parameters  {layout.numel:,} stored ({layout.trainable_numel:,} trainable) in "
        f"{len(layout.buckets)} buckets, padding {layout.padded_numel - layout.numel:,}",
        (f"buffers     {len(manifest.buffers)}: "
         + ", ".join(f"{n} {d}{list(s)}" for n, (d, s) in list(manifest.buffers.items())[:6])
         + (" ..." if len(manifest.buffers) > 6 else "")) if manifest.buffers else
        "buffers     none",
        f"files       {len(manifest.files)}, {manifest.nbytes:,} bytes",
    ]
    for entry in manifest.files[:8]:
        lines.append(f"  {entry.name}  {entry.bytes:>15,} B  crc32 {entry.crc32:#010x}")
    if len(manifest.files) > 8:
        lines.append(f"  ... {len(manifest.files) - 8} more")
    if manifest.extra:
        lines.append(f"extra       {sorted(manifest.extra)}")
    lines.append("")
    lines.append(f"{'bucket':>6}  {'label':<28} {'dtype':<9} {'train':<5} {'numel':>13} "
                 f"{'padding':>7}  entries")
    for index, bucket in enumerate(layout.buckets):
        lines.append(
            f"{index:>6}  {bucket.label[:28]:<28} {bucket.dtype:<9} "
            f"{'yes' if bucket.trainable else 'no':<5} {bucket.numel:>13,} {bucket.padding:>7}  "
            f"{len(bucket.entries)}"
        )
    lines.append("")
    # Every bucket as it is stored, frozen ones included, at each world size and stage.
    master = getattr(torch, state["master_dtype"])
    reduce = getattr(torch, state["reduce_dtype"]) if state["reduce_dtype"] else None
    rows = [memory.EstimateRow(n, *(layout_bytes_theory(
        layout.with_world_size(n), stage, master_dtype=master, moments=len(state["moments"]),
        reduce_dtype=reduce) for stage in STAGES)) for n in world_sizes]
    lines.append(
        f"model-state GB (1e9 bytes) per rank, as stored: {layout.trainable_numel:,} trainable "
        f"parameters (master {state['master_dtype']}, {len(state['moments'])} moments), "
        f"{layout.numel - layout.trainable_numel:,} frozen; padding not included")
    lines.append(memory.format_rows(rows))
    return "\n".join(lines)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise argparse.ArgumentTypeError(f"not a floating torch dtype: {name!r}")
    return dtype


def _at_least_one(unit: str, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number of `unit`, at least 1 (`what` names the bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number of {unit}: {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{what} at least 1 {unit[:-1]}, got {value}")
        return value

    return parse


_world_size = _at_least_one("ranks", "a world size is")
_bucket_cap = _at_least_one("elements", "a bucket holds")


def _shard_size(text: str) -> int:
    """An argparse type: a whole number of bytes above 0 (``5e9`` allowed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of bytes: {text!r}") from None
    if not (math.isfinite(value) and value >= 1):  # (0.5 became 0 bytes in export)
        raise argparse.ArgumentTypeError(f"a file holds more than 0 bytes (whole bytes), "
                                         f"got {text}")
    return int(value)


def _meta_hf_model(directory: str) -> torch.nn.Module:
    """The Hugging Face model of `directory`'s config.json, built on `meta` (names, ties and
    config only: no weights are read)."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise CheckpointError(f"--hf-model {directory}: no config.json there (a Hugging Face "
                              f"model directory, as save_pretrained writes, is needed)")
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None:
        raise CheckpointError(
            f"--hf-model {directory}: its config.json names no model class this transformers "
            f"has (architectures={architectures}; a config saved on its own names none: add "
            f"the class, e.g. \"architectures\": [\"GPT2LMHeadModel\"])")
    with torch.device("meta"):
        return cls(config)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m fzero.checkpoint",
                                 description="Inspect and convert fzero checkpoints.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print step, layout, sizes and a memory table (after "
                       "checking the files' sizes and headers; not their checksums)")
    p.add_argument("path")
    p.add_argument("--world-size", type=_world_size, nargs="+", default=None,
                   help="world sizes for the memory table (default: 1, 2, 4, 8 and the saved)")
    p = sub.add_parser("reshard", help="rewrite for another world size (and stage, buckets)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--world-size", type=_world_size, required=True)
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None)
    p.add_argument("--bucket-cap", type=_bucket_cap, default=None,
                   help="re-plan buckets under this size cap (elements)")
    p = sub.add_parser("consolidate", help="every parameter and buffer in one safetensors file")
    p.add_argument("src")
    p.add_argument("out", help="the .safetensors file to write")
    p.add_argument("--master", action="store_true", help="trainable parameters from the master "
                   "copy (e.g. fp32)")
    p.add_argument("--dtype", type=_dtype, default=None, help="write floating tensors in "
                   "this dtype (trained parameters cast from the master copy where one is "
                   "stored, so float32 of a bfloat16 run is the master's values)")
    p.add_argument("--overwrite", action="store_true", help="replace `out` if it exists")
    p = sub.add_parser("export", help="model.safetensors (sharded above a size) for HF / torch")
    p.add_argument("src")
    p.add_argument("out_dir")
    p.add_argument("--dtype", type=_dtype, default=None, help="as consolidate's --dtype")
    p.add_argument("--max-shard-size", type=_shard_size, default=DEFAULT_MAX_SHARD_SIZE,
                   help="bytes per file before splitting (default 5e9)")
    p.add_argument("--hf-model", metavar="DIR", default=None,
                   help="the Hugging Face model directory the run started from (its "
                        "config.json): write its state_dict names and a config.json, so that "
                        "from_pretrained(out_dir) loads the export; without it, the weights "
                        "only (load_state_dict)")
    args = ap.parse_args(argv)
    try:
        if args.command == "inspect":
            manifest = read_manifest(args.path)
            verify(args.path, manifest, checksums=False)  # the files' sizes and headers
            sizes = args.world_size or sorted({1, 2, 4, 8, manifest.world_size})
            print(describe(args.path, manifest, sizes))
        elif args.command == "reshard":
            result = reshard(args.src, args.dst, world_size=args.world_size, stage=args.stage,
                             buckets=args.bucket_cap, progress=True)
            print(f"wrote {args.dst}: {len(result.files)} files, {result.nbytes:,} bytes")
        elif args.command == "consolidate":
            write_model(args.src, args.out, args.dtype, master=args.master, progress=True,
                        overwrite=args.overwrite)
            print(f"wrote {args.out}: {os.path.getsize(args.out):,} bytes")
        else:
            model = None if args.hf_model is None else _meta_hf_model(args.hf_model)
            files = export(args.src, args.out_dir, args.dtype, model=model,
                           max_shard_size=args.max_shard_size, progress=True)
            print(f"wrote {len(files)} files to {args.out_dir}"
                  + ("" if model is not None else " (weights only: --hf-model DIR adds the "
                     "config.json that from_pretrained needs)"))
    except (CheckpointError, OSError) as error:  # (OSError: a missing output directory...)
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
