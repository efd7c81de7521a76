"""Fine-tune a Hugging Face causal LM (GPT-2 or GPT-NeoX) with fzero, at any ZeRO stage.

    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --steps 50   # tiny GPT-2
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py \\
        --model ./my-gpt2 --train 'transformer.h.*.attn.*' --data notes.txt --out ./tuned

Needs ``pip install "fzero[hf]"`` (transformers, tqdm). Nothing is downloaded: ``--model PATH``
is a local directory (``save_pretrained`` output, with or without a tokenizer); without it the
script builds a small ``--config gpt2`` or ``gpt-neox`` model with random weights and reads
bytes as tokens. ``--train PATTERN`` (repeatable, shell-style globs over parameter names)
trains only the matching parameters; the rest stay frozen: no gradients, no optimizer state,
and at stage 3 sharded like the rest. The data is a text file or folder (``--data``; default:
the Python standard library's source files), cut into sequences of ``--seq-len`` tokens;
`DistributedSampler` gives each rank its share of every global batch. At the end, ``--out DIR``
writes a directory ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.

``--gradient-checkpointing`` turns on Hugging Face's activation checkpointing (recompute each
block in backward); the recomputation is exact at every stage (README, "Guarantees").
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import os
import sys

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import (  # noqa: E402
    check_metrics_path,
    load_corpus,  # stdlib source, a file or a folder, as bytes
)

import fzero  # noqa: E402

# -----------------------------------------------------------------------------
# Model, tokens, data


def build_model(args: argparse.Namespace) -> tuple[nn.Module, object | None]:
    """The model (from ``--model`` or a small random ``--config``) and its tokenizer, if any."""
    if args.model is not None:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise SystemExit(f"--model {args.model}: not a local model directory (no "
                             f"config.json there; save_pretrained writes one)")
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
        has_tokenizer = any(os.path.exists(os.path.join(args.model, name)) for name in
                            ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
        tokenizer = (AutoTokenizer.from_pretrained(args.model, local_files_only=True)
                     if has_tokenizer else None)  # without one: bytes are the tokens
        return model, tokenizer
    torch.manual_seed(args.seed)  # every rank builds the same weights (rank 0's are used anyway)
    small = dict(vocab_size=256, bos_token_id=0, eos_token_id=0)  # bytes are the tokens
    if args.config == "gpt2":
        config = GPT2Config(n_positions=args.seq_len, n_embd=args.d_model, n_layer=args.n_layer,
                            n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            **small)
        return GPT2LMHeadModel(config), None
    config = GPTNeoXConfig(hidden_size=args.d_model, num_hidden_layers=args.n_layer,
                           num_attention_heads=args.n_head, intermediate_size=4 * args.d_model,
                           max_position_embeddings=args.seq_len, hidden_dropout=0.0,
                           attention_dropout=0.0, **small)
    return GPTNeoXForCausalLM(config), None


def tokens_of(args: argparse.Namespace, tokenizer, vocab_size: int) -> Tensor:
    """The corpus as a ``(n_tokens,)`` int64 tensor: tokenizer ids, or raw bytes without one."""
    data, about = load_corpus(args.data)  # (n_bytes,) uint8
    if tokenizer is None:
        if vocab_size < 256:
            raise SystemExit(f"the model has {vocab_size=} < 256 and no tokenizer: bytes need 256")
        return data.long()
    text = bytes(data.tolist()).decode("utf-8", errors="replace")
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def sequences(tokens: Tensor, seq_len: int) -> Tensor:
    """Non-overlapping ``(n, seq_len)`` sequences; the model shifts labels itself."""
    n = len(tokens) // seq_len
    if n < 1:
        raise SystemExit(f"the corpus has {len(tokens)} tokens, fewer than --seq-len {seq_len}")
    return tokens[: n * seq_len].view(n, seq_len)


def select_trainable(model: nn.Module, patterns: list[str] | None) -> list[list[str]]:
    """Freeze every parameter none of whose names matches a pattern (all train without
    patterns); returns the names of each trainable tensor. A tied tensor has several names
    (GPT-2's ``lm_head.weight`` is its ``transformer.wte.weight``): a pattern matching any of
    them trains it, under every name."""
    names_of: dict[int, list[str]] = {}
    tensors = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    chosen = [key for key, names in names_of.items()
              if not patterns or any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)]
    if not chosen:
        every = [n for names in names_of.values() for n in names]
        raise SystemExit(f"--train {patterns} matches no parameter; names look like {every[:4]}")
    for key, p in tensors.items():
        p.requires_grad_(key in chosen)
    return [names_of[key] for key in chosen]


def loss_fn(call, batch: tuple[Tensor]) -> Tensor:
    """Mean next-token cross-entropy; ``call(**kw)`` runs the model's forward."""
    (ids,) = batch  # (B, T)
    return call(input_ids=ids, labels=ids, use_cache=False).loss


def export_pretrained(state, model: nn.Module, tokenizer, out_dir: str, rank: int) -> None:
    """Write ``out_dir`` for ``from_pretrained``: the trained weights in a copy of `model`.

    A collective (every rank gathers the parameters); rank 0 writes. Trained parameters get
    the master copy (float32 under ``--param-dtype bfloat16``, not its bfloat16 rounding;
    a bfloat16 model is written in float32 then, its frozen values widened exactly); frozen
    ones keep the module's own values, bitwise the pretrained ones (fzero never writes the
    module; with ``--param-dtype bfloat16`` training computed with their bfloat16 rounding).
    From a saved checkpoint, offline: ``fzero.checkpoint.export``.
    """
    params = fzero.full_params(state, master=True)  # {name: full tensor}, tied names included
    if rank != 0:
        return
    trained = copy.deepcopy(model)
    # The module may be narrower than what trained (a bfloat16 checkpoint trained in float32,
    # or with its float32 master): widen it, exactly, so the copy below rounds nothing.
    widest = max((params[name].dtype for name, p in trained.named_parameters()
                  if p.requires_grad), key=lambda dtype: dtype.itemsize, default=None)
    if widest is not None and any(p.is_floating_point() and p.dtype.itemsize < widest.itemsize
                                  for p in trained.parameters()):
        trained.to(widest)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if p.requires_grad:  # (the trainable set: `select_trainable`)
                p.copy_(params[name])
        for name, b in trained.named_buffers():  # what the steps updated (replicated)
            if name in state.buffers:
                b.copy_(state.buffers[name])
    trained.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


# -----------------------------------------------------------------------------
# Training


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="local from_pretrained directory")
    ap.add_argument("--config", choices=("gpt2", "gpt-neox"), default="gpt2",
                    help="random-init architecture when --model is not given")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--train", action="append", metavar="PATTERN",
                    help="glob over parameter names to train (repeatable; default: all)")
    ap.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--data", default=None, help="text file or folder (default: stdlib source)")
    ap.add_argument("--out", default=None, help="write a from_pretrained directory here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--metrics-json", default=None, help="rank 0 writes the losses here")
    args = ap.parse_args(argv)
    sizes = ("n_layer", "d_model", "n_head", "steps", "batch_size", "seq_len")
    small = [f"--{name.replace('_', '-')}" for name in sizes if getattr(args, name) < 1]
    if small:
        ap.error(f"{', '.join(small)} must be >= 1")
    # Both are written after training: refuse now what would fail (or, for a file given as
    # --out, be skipped by save_pretrained with a log line while "saved to" was printed).
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"--out {args.out}: a file, not a directory (from_pretrained reads a directory)")
    check_metrics_path(ap, args.metrics_json)
    return args


def train(comm, args: argparse.Namespace) -> dict:
    """Fine-tune on this rank (all ranks call it); returns rank 0's summary."""
    rank, world = comm.rank, comm.world_size
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by {world} ranks")
    model, tokenizer = build_model(args)
    tensors = select_trainable(model, args.train)
    trainable = [name for names in tensors for name in names]
    if args.gradient_checkpointing:  # transformers 5 renamed gradient_ to activation_
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()

    positions = getattr(model.config, "max_position_embeddings", None)  # (n_positions: GPT-2)
    if positions is not None and args.seq_len > positions:
        raise SystemExit(f"--seq-len {args.seq_len} is longer than the model's "
                         f"{positions} positions")
    data = sequences(tokens_of(args, tokenizer, model.config.vocab_size), args.seq_len)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)  # every rank: same row count
    loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler,
                        drop_last=True)
    if len(loader) == 0:
        raise SystemExit(f"{len(data)} sequences are too few for --batch-size {args.batch_size}")

    optimizer = fzero.optim.adamw(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    state = fzero.init(model, stage=args.stage, optimizer=optimizer, comm=comm,
                       param_dtype=getattr(torch, args.param_dtype))
    step = fzero.make_train_step(model, loss_fn, clip_norm=1.0, decay=fzero.decay_matrices)
    if rank == 0:
        total = sum(p.numel() for p in model.parameters())
        chosen = sum(p.numel() for n, p in model.named_parameters() if n in trainable)
        print(f"{type(model).__name__}: {total:,} parameters, {chosen:,} trainable "
              f"({len(tensors)} tensors); {len(data):,} sequences of {args.seq_len}; "
              f"stage {args.stage} on {world} rank(s)")
        for names in tensors:
            if len(names) > 1:
                print(f"tied, trained as one tensor: {' = '.join(names)}")

    losses = []
    bar = tqdm(total=args.steps, disable=rank != 0, desc="fine-tune")
    epoch = 0
    while len(losses) < args.steps:
        sampler.set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
        for ids in loader:  # (B/N, T): this rank's rows of the global batch
            state, metrics = step(state, (ids.to(state.config.device),))  # the GPU under NCCL
            losses.append(metrics["loss"])
            bar.update()
            bar.set_postfix(loss=f"{metrics['loss']:.4f}")
            if len(losses) == args.steps:
                break
        epoch += 1
    bar.close()

    if args.out is not None:
        export_pretrained(state, model, tokenizer, args.out, rank)
    summary = {"losses": losses, "stage": args.stage, "world_size": world,
               "trainable": trainable, "state_bytes": metrics["state_bytes"]}
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
              + (f"; saved to {args.out}" if args.out else ""))
        if args.metrics_json:
            with open(args.metrics_json, "w") as f:
                json.dump(summary, f)
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    with fzero.distributed() as comm:  # torchrun's or Slurm's environment, or one process
        train(comm, args)


if __name__ == "__main__":
    main()
