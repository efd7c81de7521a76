"""Train a small byte-level GPT with fzero (ZeRO stage 0, 1, 2 or 3), top to bottom.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 200   # 2 ranks
    python examples/train_gpt.py                                                 # 1 rank
    python examples/train_gpt.py --reference      # plain torch.optim.AdamW, one process
    python examples/train_gpt.py --save-every 50 --resume ckpt   # restartable: rerun continues

The default corpus needs no download: the Python standard library's own top-level ``.py``
files (sorted, capped at 4 MiB), read as bytes, so the vocabulary is the 256 byte values.
``--data PATH`` trains on your own text file or directory instead.

Every rank builds the same model from the same seed and draws the same global batch indices
from the same seeded generator; rank r keeps rows [r * B / N, (r + 1) * B / N) of each global
batch. At the end the script prints, per rank, the model-state bytes and the bytes sent per
step next to the ZeRO paper's formulas, and a sample of generated text.

``--reference`` trains the same model on the same global batches with torch.optim.AdamW in one
process (no fzero, no process group): the baseline fzero's losses must match.

``--save-every K --resume DIR`` saves a sharded checkpoint to ``DIR/step-NNNNNN`` every K steps
(and at the end), and at start continues from the latest complete one in DIR if there is any:
a job that is killed and restarted with the same command picks up where it stopped, on any
number of ranks, and draws exactly the batches the uninterrupted run would have (the data
generator's state is saved in the checkpoint too). Under ``torchrun --max-restarts 2`` that
happens by itself when a rank dies (tests/test_recovery.py)::

    torchrun --standalone --nproc-per-node 2 --max-restarts 2 \\
        examples/train_gpt.py --save-every 50 --resume ckpt
"""

from __future__ import annotations

import argparse
import base64
import glob
import math
import os
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from tqdm import tqdm

import fzero

# -----------------------------------------------------------------------------
# The model: nanoGPT-style pre-LN transformer, lm_head tied to the token embedding


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 192  # 4 layers x 12 * 192^2 + embeddings: ~1.8M parameters


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, n_head, T, head_size)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_head, T, head_size)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        # A private RNG stream: every rank builds bitwise the same weights, global RNG untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            self.lm_head.weight = self.tok_emb.weight  # tied: one parameter, stored once
            # GPT-2 init: N(0, 0.02), residual projections scaled down by sqrt(2 * n_layer).
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() >= 2:
                    std = (
                        0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("proj.weight") else 0.02
                    )
                    nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, d_model)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)


def loss_fn(call, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean next-byte cross-entropy; ``call(idx)`` runs the model's forward."""
    x, y = batch  # (B, T) each
    logits = call(x)  # (B, T, vocab_size)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def num_params(model: nn.Module) -> int:
    """Ψ: parameters counted once (named_parameters() lists tied weights once)."""
    return sum(p.numel() for p in model.parameters())


# -----------------------------------------------------------------------------
# Data: bytes of a corpus, a seeded sampler shared by all ranks

DEFAULT_CORPUS_CAP = 4 << 20  # bytes of the standard-library corpus


def check_metrics_path(ap: argparse.ArgumentParser, path: str | None) -> None:
    """Refuse, as an argument error before training, a ``--metrics-json`` that could not be
    written when the run ends (a directory, or a file in a missing one)."""
    if path and os.path.isdir(path):
        ap.error(f"--metrics-json {path}: a directory, not a file")
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        ap.error(f"--metrics-json {path}: its directory does not exist (it is written at the "
                 f"end of the run)")


def _a_save(folder: str) -> bool:
    """Whether `folder` holds nothing but what an fzero save writes (a checkpoint, or a save's
    .partial / .old leftovers), and something of it: a user's folder that merely holds a
    manifest.json, or is named *.old, is data."""
    return bool(os.listdir(folder)) and fzero.checkpoint.saving.only_a_saves_files(folder)


def load_corpus(path: str | None, exclude: tuple[str, ...] = ()) -> tuple[Tensor, str]:
    """The corpus as a ``(n_bytes,)`` uint8 tensor, and a one-line description. A folder's
    subfolders in `exclude` (the run's checkpoint directory) and fzero checkpoints are skipped:
    their bytes change as the run saves, and a resumed run would read another corpus."""
    skip = {os.path.realpath(x) for x in exclude}
    if path is None:
        root = os.path.dirname(os.__file__)
        files, cap = sorted(glob.glob(os.path.join(root, "*.py"))), DEFAULT_CORPUS_CAP
        where = f"the Python standard library ({root})"
    elif os.path.isdir(path):
        files = []
        for d, dirs, names in os.walk(path):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__"
                       and os.path.realpath(os.path.join(d, x)) not in skip
                       and not _a_save(os.path.join(d, x))]
            files += [os.path.join(d, f) for f in names if not f.startswith(".")]
        files, cap, where = sorted(f for f in files if os.path.isfile(f)), None, path
    elif os.path.isfile(path):
        files, cap, where = [path], None, path
    else:
        raise SystemExit(f"--data {path!r}: no such file or directory")
    chunks, size = [], 0
    for name in files:
        with open(name, "rb") as f:
            chunks.append(f.read())
        size += len(chunks[-1])
        if cap is not None and size >= cap:
            break
    data = b"".join(chunks)[:cap]
    if len(data) < 1024:
        raise SystemExit(f"corpus from {where} has {len(data)} bytes; need at least 1024")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (n_bytes,)
    return tokens, f"{len(data):,} bytes from {len(chunks)} files of {where}"


def get_batch(
    data: Tensor, gen: torch.Generator, batch_size: int, seq_len: int, rank: int, world: int
) -> tuple[Tensor, Tensor]:
    """This rank's rows of the next global batch: inputs and next-byte targets, (B/N, T) each.

    Every rank draws all ``batch_size`` start offsets (the generators stay in step) and keeps
    its contiguous 1/world slice; the union over ranks is exactly the global batch.
    """
    if batch_size % world:  # the ranks would drop the remainder's rows, silently
        raise ValueError(f"a global batch of {batch_size} sequences does not split over "
                         f"{world} ranks: pass a multiple of {world}")
    ix = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)  # (B,)
    per_rank = batch_size // world
    ix = ix[rank * per_rank : (rank + 1) * per_rank]  # (B/N,)
    x = torch.stack([data[i : i + seq_len] for i in ix.tolist()]).long()  # (B/N, T)
    y = torch.stack([data[i + 1 : i + 1 + seq_len] for i in ix.tolist()]).long()  # (B/N, T)
    return x, y


# -----------------------------------------------------------------------------
# The ZeRO paper's numbers for this model (Rajbhandari et al. 2020, Table 1 and Section 7)


def zero_theory(psi: int, world: int, stage: int, param_bytes: int, accum_steps: int):
    """Per-rank model-state bytes and bytes one rank sends per optimizer step.

    Parameters and gradients are held in the param dtype (``param_bytes`` each); Adam keeps two
    fp32 moments, plus an fp32 master copy when the param dtype is not fp32: K = 8 or 12 bytes.
    A ring all-gather or reduce-scatter of P elements sends (N-1)/N * P elements per rank, an
    all-reduce twice that. Per step: stage 0 all-reduces the gradients once (2Ψ); stage 1
    reduce-scatters them once and all-gathers the updated parameters (Ψ + Ψ); stage 2
    reduce-scatters after every micro-batch (A·Ψ + Ψ); stage 3 gathers the parameters in
    forward and again in backward and reduce-scatters, every micro-batch (3·A·Ψ). fzero's
    stage 3 sends less: backward does not gather again the bucket forward ended with (the
    whole model when it fits one bucket: 2·A·Ψ from the second step on).
    """
    p = g = param_bytes
    k = 8 if param_bytes == 4 else 12
    n, a = world, accum_steps
    state = {
        0: (p + g + k) * psi,
        1: (p + g) * psi + k * psi / n,
        2: p * psi + (g + k) * psi / n,
        3: (p + g + k) * psi / n,
    }[stage]
    elements = {0: 2 * psi, 1: 2 * psi, 2: (a + 1) * psi, 3: 3 * a * psi}[stage]
    return state, elements * (n - 1) / n * p


# -----------------------------------------------------------------------------
# Sampling


@torch.no_grad()
def generate(call, prompt: str, n_new: int, seq_len: int, temperature: float, seed: int,
             device: torch.device) -> str:
    """Sample ``n_new`` bytes after ``prompt`` (the model's parameters on `device`);
    temperature 0 is greedy."""
    gen = torch.Generator().manual_seed(seed)  # on the CPU, so a sample is the same anywhere
    idx = torch.tensor([list(prompt.encode())], device=device)  # (1, T0)
    for _ in range(n_new):
        logits = call(idx[:, -seq_len:])[:, -1, :].float()  # (1, vocab_size)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
        else:
            probs = F.softmax(logits / temperature, dim=-1)  # (1, vocab_size)
            nxt = torch.multinomial(probs.cpu(), 1, generator=gen).to(device)  # (1, 1)
        idx = torch.cat([idx, nxt], dim=1)  # (1, T0 + i + 1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# -----------------------------------------------------------------------------
# Training


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32, help="global batch, in sequences")
    ap.add_argument("--seq-len", type=int, default=GPTConfig.seq_len)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--param-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--data", default=None, help="text file or directory (default: stdlib)")
    ap.add_argument("--accum-steps", type=int, default=1)
    ap.add_argument("--clip-norm", type=float, default=1.0, help="0 disables clipping")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-bytes", type=int, default=300, help="bytes to generate at the end")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps (0: never)")
    ap.add_argument(
        "--resume",
        metavar="DIR",
        default=None,
        help="checkpoint directory: continue from its latest checkpoint; --save-every saves here",
    )
    ap.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="stop after this many steps of this run (a job's time slice), saving to --resume "
             "DIR; rerun to continue",
    )
    ap.add_argument(
        "--reference",
        action="store_true",
        help="train with plain torch.optim.AdamW in one process (the parity baseline)",
    )
    ap.add_argument("--transport", choices=("pairwise", "shm"), default=None,
                    help="gloo ranks' transport (default pairwise; shm: shared memory, one host)")
    ap.add_argument("--metrics-json", default=None, help="rank 0 writes every rank's losses here")
    args = ap.parse_args(argv)
    if min(args.steps, args.accum_steps, args.batch_size, args.seq_len) < 1:
        ap.error("--steps, --batch-size, --accum-steps and --seq-len must be >= 1")
    if min(args.save_every, args.stop_after, args.sample_bytes) < 0:
        ap.error("--save-every, --stop-after and --sample-bytes must be >= 0 (0: never)")
    if not (math.isfinite(args.lr) and args.lr > 0) or args.warmup_steps < 0:
        ap.error("--lr must be a positive number and --warmup-steps >= 0")
    if not (math.isfinite(args.clip_norm) and args.clip_norm >= 0):
        ap.error("--clip-norm must be a number >= 0 (0: no clipping)")
    check_metrics_path(ap, args.metrics_json)
    args.warmup_steps = min(args.warmup_steps, args.steps)
    if args.save_every and not args.resume:
        ap.error("--save-every needs --resume DIR: the directory checkpoints go to")
    if args.stop_after and not args.resume:
        ap.error("--stop-after needs --resume DIR: the run saves there when it stops, and a "
                 "rerun continues from it")
    if args.reference and args.resume:
        ap.error("--reference does not checkpoint; drop --resume")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.reference:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--reference trains in one process: run it with plain `python`")
        run(args, comm=None)
        return
    # The process group from torchrun's (or Slurm's) environment, or a one-rank world without
    # a launcher; NCCL on cuda:LOCAL_RANK when CUDA is there, else gloo. Destroyed on exit.
    with fzero.distributed(transport=args.transport) as comm:
        run(args, comm)


def run(args: argparse.Namespace, comm) -> None:
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world_size)
    master = rank == 0
    if args.batch_size % (world * args.accum_steps):
        raise SystemExit(
            f"--batch-size {args.batch_size} must be divisible by world size x accum steps "
            f"= {world} x {args.accum_steps}"
        )
    if comm is not None:
        device = comm.device
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    param_dtype = getattr(torch, args.param_dtype)
    if args.reference and param_dtype != torch.float32:
        raise SystemExit("--reference trains in float32; drop --param-dtype")
    clip_norm = args.clip_norm or None

    # data -------------------------------------------------------------------
    tokens, about = load_corpus(args.data, exclude=(args.resume,) if args.resume else ())
    if len(tokens) < 3 * (args.seq_len + 2):
        raise SystemExit(f"--seq-len {args.seq_len} needs a corpus of at least "
                         f"{3 * (args.seq_len + 2):,} bytes (train and validation sequences); "
                         f"the corpus has {len(tokens):,} ({about})")
    n_val = max(len(tokens) // 20, args.seq_len + 2)
    train_data, val_data = tokens[:-n_val], tokens[-n_val:]
    gen = torch.Generator().manual_seed(args.seed + 1)  # same stream on every rank
    tokens_per_step = args.batch_size * args.seq_len  # global
    # What a resume must share with the run it continues, or it draws other batches or another
    # learning-rate schedule than the uninterrupted run would have (silently, before).
    run_config = {"batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
                  "lr": args.lr, "warmup_steps": args.warmup_steps, "seed": args.seed,
                  "clip_norm": args.clip_norm,
                  "corpus": f"{len(tokens)} bytes, crc32 {zlib.crc32(tokens.numpy()):08x}"}

    # model ------------------------------------------------------------------
    cfg = GPTConfig(seq_len=args.seq_len)
    model = GPT(cfg, seed=args.seed).to(device)
    psi = num_params(model)
    schedule = fzero.optim.cosine_schedule(
        peak_lr=args.lr, warmup_steps=args.warmup_steps, total_steps=args.steps, min_lr=args.lr / 10
    )
    if master:
        mode = (
            "reference: torch.optim.AdamW, 1 process"
            if comm is None
            else f"fzero stage {args.stage}"
        )
        print(f"data   {about}")
        print(
            f"model  GPT {cfg.n_layer} layers x d {cfg.d_model}, {cfg.n_head} heads, "
            f"seq {cfg.seq_len}: Ψ = {psi:,} parameters"
        )
        print(
            f"train  {mode}, {world} rank(s), global batch {args.batch_size} x {args.seq_len} "
            f"= {tokens_per_step:,} tokens, accum {args.accum_steps}, {args.param_dtype}, "
            f"clip {clip_norm}, lr {args.lr:g} (cosine, warmup {args.warmup_steps})"
        )

    done = 0  # steps taken so far, by this run and the runs it resumes
    if comm is None:
        state, step = reference_trainer(model, args, schedule, clip_norm)
    else:
        # The schedule is a function, which no checkpoint can hold: a load gets the optimizer.
        optimizer = fzero.optim.adamw(lr=schedule, betas=(0.9, 0.95), weight_decay=0.1)
        latest = fzero.checkpoint.latest(args.resume) if args.resume else None
        if latest is None:
            state = fzero.init(
                model, stage=args.stage, optimizer=optimizer, comm=comm, param_dtype=param_dtype
            )
        else:  # any world size: the checkpoint is resharded while it loads
            extra = fzero.checkpoint.read_manifest(latest).extra
            saved = extra.get("run_config", run_config)
            differ = [f"{k}: {saved.get(k)!r} in the checkpoint, {v!r} now"
                      for k, v in run_config.items() if saved.get(k) != v]
            if differ:
                raise SystemExit(f"--resume {args.resume}: {latest} was saved by a run with "
                                 f"other settings ({'; '.join(differ)}): rerun with the same "
                                 f"arguments and data, or use a new --resume DIR")
            state = fzero.load(latest, model=model, comm=comm, optimizer=optimizer,
                               stage=args.stage, param_dtype=param_dtype)
            done = extra["steps_done"]
            gen.set_state(torch.frombuffer(bytearray(base64.b64decode(extra["data_rng"])),
                                           dtype=torch.uint8))
            if master:
                print(f"resume {latest}: {done} steps done")
        # GPT's weight-decay rule (matrices and embeddings only), as the reference's two groups.
        step = fzero.make_train_step(
            model, loss_fn, accum_steps=args.accum_steps, clip_norm=clip_norm,
            decay=fzero.decay_matrices,
        )

    # loop -------------------------------------------------------------------
    losses, times = [], []
    last = min(args.steps, done + args.stop_after) if args.stop_after else args.steps
    t_start = time.perf_counter()
    bar = tqdm(total=args.steps, initial=done, disable=not master, unit="step",
               mininterval=1.0, dynamic_ncols=True)
    for i in range(done + 1, last + 1):
        batch = get_batch(train_data, gen, args.batch_size, args.seq_len, rank, world)
        batch = tuple(t.to(device) for t in batch)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])  # a host sync: the step is done
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / times[-1]:,.0f}",
                        refresh=False)
        bar.update()
        # Every K steps, and where a run stops early (--stop-after: the next one continues).
        if (args.save_every and i % args.save_every == 0) or (
                args.resume and i == last and (args.save_every or last < args.steps)):
            # A collective; it appears atomically once every rank has written its shards.
            data_rng = base64.b64encode(gen.get_state().numpy().tobytes()).decode()
            fzero.save(state, os.path.join(args.resume, f"step-{i:06d}"), overwrite=True,
                       extra={"steps_done": i, "data_rng": data_rng, "run_config": run_config})
    bar.close()
    wall = time.perf_counter() - t_start

    # evaluation and sample (full_params is a collective: every rank calls it) -----
    if comm is None:
        params = {k: p.detach() for k, p in model.named_parameters()}
    else:
        params = fzero.full_params(state)
    # float32 for evaluation, each tensor once: a tie (the head is the embedding) stays one
    # tensor under both names, as functional_call requires of tied names.
    as_float: dict[int, Tensor] = {}
    params = {k: as_float.setdefault(id(v), v.float()) for k, v in params.items()}
    buffers = dict(model.named_buffers())

    def call(*a, **kw):
        return functional_call(model, (params, buffers), a, kw)

    val_gen = torch.Generator().manual_seed(args.seed + 2)  # 8 fixed held-out batches of 16
    val_batches = [get_batch(val_data, val_gen, 16, args.seq_len, 0, 1) for _ in range(8)]
    with torch.no_grad():
        val = [loss_fn(call, (x.to(device), y.to(device))) for x, y in val_batches]
    val_loss = float(torch.stack(val).mean())
    if master and not losses:  # (a restart after the last save: evaluated and reported all
        # the same, or a job killed during its evaluation would end without it)
        print(f"done   all {args.steps} steps were taken already; val loss {val_loss:.3f}")
    elif master:
        steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
        print(
            f"done   loss {losses[0]:.3f} -> {losses[-1]:.3f} (last-10 mean "
            f"{sum(losses[-10:]) / len(losses[-10:]):.3f}), val loss {val_loss:.3f}; "
            f"{wall:.1f} s, median step {steady * 1e3:.0f} ms, "
            f"{tokens_per_step / steady:,.0f} tok/s"
        )

    # memory and communication against the paper (measured by the steps run) ------
    if losses:
        report_memory(args, metrics, psi, world, rank, master, param_dtype, comm)

    if master and args.sample_bytes > 0:
        prompt = "def "
        text = generate(call, prompt, args.sample_bytes, args.seq_len, 0.8, args.seed, device)
        print(f"\nsample (temperature 0.8):\n{text}")

    if args.metrics_json:  # for tests and scripts: each rank's losses, as that rank saw them
        import json

        mine = {"rank": rank, "losses": losses, "val_loss": val_loss, "device": str(device)}
        every = every_rank(mine, world)
        if master:
            with open(args.metrics_json, "w") as f:
                json.dump(every, f)


def every_rank(value: dict, world: int) -> list[dict]:
    """Every rank's `value`, in rank order (a collective over several ranks)."""
    if world == 1:
        return [value]
    values: list = [None] * world
    dist.all_gather_object(values, value)
    return values


def report_memory(args: argparse.Namespace, metrics: dict, psi: int, world: int, rank: int,
                  master: bool, param_dtype: torch.dtype, comm) -> None:
    """Print every rank's model-state bytes and traffic of the last step against the paper's
    formulas (a collective)."""
    param_bytes = torch.empty((), dtype=param_dtype).element_size()
    stage = 0 if comm is None else args.stage
    state_theory, comm_theory = zero_theory(psi, world, stage, param_bytes, args.accum_steps)
    row = {
        "rank": rank,
        "state": int(metrics["state_bytes"]),
        "state_fzero": metrics.get("state_bytes_theory"),
        "state_theory": state_theory,
        "comm": int(metrics.get("comm_bytes", 0)),
        "comm_theory": comm_theory,
        "gathered": int(metrics.get("gathered_bytes_peak", 0)),
    }
    rows = every_rank(row, world)
    if master:
        print(
            f"\nper-rank model state and traffic, stage {stage}, N = {world}, "
            f"{args.param_dtype} params/grads (theory: ZeRO paper, Ψ = {psi:,}):"
        )
        print(
            "| rank | state bytes | fzero theory | paper theory | measured/paper "
            "| comm bytes/step | paper comm | measured/paper | stage-3 gathered peak |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            comm_ratio = f"{r['comm'] / r['comm_theory']:.4f}" if r["comm_theory"] else "-"
            fzero_theory = "-" if r["state_fzero"] is None else f"{int(r['state_fzero']):,}"
            print(
                f"| {r['rank']} | {r['state']:,} | {fzero_theory} "
                f"| {r['state_theory']:,.0f} | {r['state'] / r['state_theory']:.4f} "
                f"| {r['comm']:,} | {r['comm_theory']:,.0f} | {comm_ratio} "
                f"| {r['gathered']:,} |"
            )


def reference_trainer(model: nn.Module, args: argparse.Namespace, schedule, clip_norm):
    """A ``step(state, batch) -> (state, metrics)`` with plain torch.optim.AdamW, in place.

    Same objective as fzero's step: the mean loss over the global batch, split into
    ``accum_steps`` micro-batches; weight decay on matrices only (biases, norm weights and
    nothing else with fewer than 2 dims are not decayed); the same 1-based lr schedule.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), foreach=True)

    def step(state, batch):
        state += 1  # the 1-based step number is all the state this trainer returns
        for group in opt.param_groups:
            group["lr"] = schedule(state)
        micro = zip(*(t.chunk(args.accum_steps) for t in batch), strict=True)
        loss = 0.0
        for mb in micro:
            part = loss_fn(model, mb) / args.accum_steps
            part.backward()
            loss += part.item()
        grad_norm = nn.utils.clip_grad_norm_(params, clip_norm or math.inf)
        opt.step()
        state_bytes = fzero.memory.storage_bytes(
            list(model.parameters())
            + [p.grad for p in params]
            + [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
        )
        opt.zero_grad(set_to_none=True)
        return state, {"loss": loss, "grad_norm": float(grad_norm), "state_bytes": state_bytes}

    return 0, step


if __name__ == "__main__":
    main()
