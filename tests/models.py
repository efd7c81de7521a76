"""Tiny deterministic models for the parity tests, and the single-process reference trainer.

Every model class comes with two static methods the tests use as its data and objective:

- ``make_batch(seed, batch_size) -> tuple[Tensor, ...]``: a deterministic *global* batch; every
  tensor has the batch on dim 0, so a rank's slice is ``split_batch(batch, rank, world_size)``.
- ``loss_fn(call, batch) -> Tensor``: a scalar mean loss, where ``call(*args, **kwargs)`` runs the
  model's forward (``model`` itself, or fzero's ``functional_call`` on a state's parameters).

Sizes are deliberately awkward (odd widths, element counts not divisible by 2, 3 or 4) so that
layouts need padding at every world size the tests use. Constructors take a ``seed`` and leave the
global RNG untouched.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Batch = tuple[Tensor, ...]
LossFn = Callable[[Callable[..., Tensor], Batch], Tensor]


# torch's default generator is one per process and `fzero.SimWorld`'s ranks are threads: two ranks
# seeding it at once race (each may draw from the other's seed), and concurrent
# `torch.get_rng_state` calls have deadlocked (torch 2.13). Every seeded block takes this lock.
_DEFAULT_RNG = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's default RNG seeded to `seed`, then restore the RNG; one block
    at a time in the process, so ranks of a `SimWorld` build their models as separate
    processes would."""
    with _DEFAULT_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def per_block(model: nn.Module) -> Callable[[nn.Module], bool]:
    """A ``buckets=`` predicate giving one bucket per element of every list container of
    `model`, however small: the default policy without its size floor, which would put each of
    these tiny models in one or two buckets. Tests use it to exercise many buckets."""
    blocks = {id(sub) for name, sub in model.named_modules() if name.rpartition(".")[2].isdigit()}
    return lambda module: id(module) in blocks


def bucket_policy(model: nn.Module, buckets: Any) -> Any:
    """`buckets` as given, or `per_block(model)` when it is `per_block` itself (the default of
    the test bodies that build states)."""
    return per_block(model) if buckets is per_block else buckets


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def split_batch(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank ``rank``'s contiguous 1/world_size slice of a global batch (dim 0)."""
    size = batch[0].shape[0]
    if size % world_size:
        raise ValueError(f"batch size {size} not divisible by {world_size=}")
    per_rank = size // world_size
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)


# -----------------------------------------------------------------------------
# (a) MLP: 7 -> 13 -> 5, GELU


class MLP(nn.Module):
    """Two Linear layers with odd sizes: 7*13=91, 13, 13*5=65, 5 elements."""

    def __init__(self, seed: int = 0, d_in: int = 7, d_hidden: int = 13, d_out: int = 5):
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(d_in, d_hidden)
            self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (B, d_in) -> (B, d_out)

    @staticmethod
    def make_batch(seed: int, batch_size: int) -> Batch:
        g = _generator(seed)
        x = torch.randn(batch_size, 7, generator=g)  # (B, 7)
        y = torch.randn(batch_size, 5, generator=g)  # (B, 5)
        return x, y

    @staticmethod
    def loss_fn(call: Callable[..., Tensor], batch: Batch) -> Tensor:
        x, y = batch
        return F.mse_loss(call(x).float(), y)


# -----------------------------------------------------------------------------
# (b) TinyGPT: byte-level GPT, pre-LN blocks in an nn.ModuleList, lm_head tied to tok_emb


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        # No qkv bias: the key bias gets an exactly-zero gradient (softmax ignores a constant
        # per query), so its gradient is pure rounding noise that Adam normalizes into full
        # steps, making parameter parity with any reference ill-conditioned.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, n_head, T, C // n_head)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_head, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT with token + position embeddings, pre-LN blocks, final LayerNorm, tied lm_head."""

    vocab_size = 64
    seq_len = 8

    def __init__(self, seed: int = 0, d_model: int = 16, n_layer: int = 2, n_head: int = 2):
        super().__init__()
        with seeded(seed):
            self.tok_emb = nn.Embedding(self.vocab_size, d_model)
            self.pos_emb = nn.Embedding(self.seq_len, d_model)
            self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(d_model)
            self.lm_head = nn.Linear(d_model, self.vocab_size, bias=False)
            self.lm_head.weight = self.tok_emb.weight  # tied: one parameter, one storage

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, d_model)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)

    @staticmethod
    def make_batch(seed: int, batch_size: int) -> Batch:
        """Arithmetic sequences mod vocab (random start, stride 1-3): learnable, not memorised."""
        g = _generator(seed)
        vocab, T = TinyGPT.vocab_size, TinyGPT.seq_len
        start = torch.randint(vocab, (batch_size, 1), generator=g)  # (B, 1)
        stride = torch.randint(1, 4, (batch_size, 1), generator=g)  # (B, 1)
        tokens = (start + stride * torch.arange(T + 1)) % vocab  # (B, T + 1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # 2 x (B, T)

    @staticmethod
    def loss_fn(call: Callable[..., Tensor], batch: Batch) -> Tensor:
        idx, targets = batch
        logits = call(idx)  # (B, T, vocab_size)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# -----------------------------------------------------------------------------
# (c) FrozenMix: frozen parameters, a float and an int64 buffer, element counts 5..143


class FrozenMix(nn.Module):
    """Trainable and frozen parameters interleaved in module order, plus two buffers.

    Parameters (elements): gain 7, frozen.weight 77 (frozen), frozen.bias 11 (frozen),
    proj.weight 143, proj.bias 13, offset 13 (frozen), head.weight 65, head.bias 5.
    Buffers: ``scale`` (13,) float32, read in forward, never written; ``perm`` (7,) int64.
    """

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(7))
            self.frozen = nn.Linear(7, 11).requires_grad_(False)
            self.proj = nn.Linear(11, 13)
            self.offset = nn.Parameter(0.1 * torch.randn(13), requires_grad=False)
            self.head = nn.Linear(13, 5)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 13))
            self.register_buffer("perm", torch.randperm(7))

    def forward(self, x: Tensor) -> Tensor:
        h = x[:, self.perm] * self.gain  # (B, 7)
        h = F.gelu(self.frozen(h))  # (B, 11)
        h = torch.tanh(self.proj(h) * self.scale + self.offset)  # (B, 13)
        return self.head(h)  # (B, 5)

    @staticmethod
    def make_batch(seed: int, batch_size: int) -> Batch:
        g = _generator(seed)
        x = torch.randn(batch_size, 7, generator=g)  # (B, 7)
        y = torch.randn(batch_size, 5, generator=g)  # (B, 5)
        return x, y

    @staticmethod
    def loss_fn(call: Callable[..., Tensor], batch: Batch) -> Tensor:
        x, y = batch
        return F.mse_loss(call(x).float(), y)


MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "tiny_gpt": TinyGPT, "frozen_mix": FrozenMix}


# -----------------------------------------------------------------------------
# The parity reference: plain torch.optim, one process, the full global batch


class Reference(NamedTuple):
    losses: list[float]  # loss at each step, before that step's update
    params: dict[str, Tensor]  # final named_parameters() (tied names once), detached clones


def reference_train(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Sequence[Batch] | Iterable[Batch],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    steps: int,
    clip_norm: float | None = None,
) -> Reference:
    """Train a deepcopy of ``model`` with plain torch.optim on each full global batch.

    ``batches`` is a sequence (cycled if shorter than ``steps``) or an iterable of global
    batches. ``optimizer_factory`` gets the trainable parameters in ``named_parameters()`` order.
    With ``clip_norm``, gradients are clipped to that total L2 norm before each update.
    ``model`` itself is not modified.
    """
    model = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_factory(trainable)
    if isinstance(batches, Sequence):
        if not batches:
            raise ValueError("reference_train needs at least one batch, got an empty sequence")
        source = (batches[i % len(batches)] for i in range(steps))
    else:
        source = iter(batches)
    losses = []
    for _ in range(steps):
        batch = next(source, None)
        if batch is None:
            raise ValueError(f"batches ran out before {steps=}")
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(trainable, clip_norm)
        optimizer.step()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return Reference(losses, params)
