"""Sanity checks for the parity-test models in tests/models.py and the reference trainer."""

import copy

import pytest
import torch
from torch.func import functional_call

from models import MLP, MODELS, FrozenMix, TinyGPT, reference_train, split_batch


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_constructor_is_deterministic_and_keeps_global_rng(name):
    cls = MODELS[name]
    before = torch.random.get_rng_state()
    a, b, c = cls(seed=0), cls(seed=0), cls(seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_make_batch_is_deterministic(name):
    cls = MODELS[name]
    a, b, c = cls.make_batch(3, 6), cls.make_batch(3, 6), cls.make_batch(4, 6)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    assert all(t.shape[0] == 6 for t in a)


@pytest.mark.parametrize(
    ("name", "out_shape"),
    [
        ("mlp", (6, 5)),
        ("tiny_gpt", (6, TinyGPT.seq_len, TinyGPT.vocab_size)),
        ("frozen_mix", (6, 5)),
    ],
)
def test_forward_shape_and_scalar_loss(name, out_shape):
    cls = MODELS[name]
    model, batch = cls(seed=0), cls.make_batch(0, 6)
    assert model(batch[0]).shape == out_shape
    loss = cls.loss_fn(model, batch)
    assert loss.shape == () and torch.isfinite(loss)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_loss_fn_through_functional_call_matches_module(name):
    cls = MODELS[name]
    model, batch = cls(seed=0), cls.make_batch(1, 4)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def call(*args, **kwargs):
        return functional_call(model, (params, buffers), args, kwargs)

    torch.testing.assert_close(cls.loss_fn(call, batch), cls.loss_fn(model, batch), rtol=0, atol=0)


def test_tiny_gpt_tying_shares_storage():
    model = TinyGPT(seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    assert "lm_head.weight" in model.state_dict()  # state_dict keys repeat the tied tensor
    with torch.no_grad():
        model.tok_emb.weight[0, 0] = 42.0
    assert model.lm_head.weight[0, 0].item() == 42.0
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2


def test_tiny_gpt_tying_survives_deepcopy():
    model = copy.deepcopy(TinyGPT(seed=0))
    assert model.lm_head.weight is model.tok_emb.weight


def test_tiny_gpt_is_causal():
    model, (idx, _) = TinyGPT(seed=0), TinyGPT.make_batch(0, 2)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % TinyGPT.vocab_size
    torch.testing.assert_close(model(idx)[:, :-1], model(changed)[:, :-1], rtol=0, atol=0)


def test_frozen_mix_parameters_and_buffers():
    model = FrozenMix(seed=0)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"frozen.weight", "frozen.bias", "offset"}
    for name, p in model.named_parameters():
        assert all(p.numel() % d for d in (2, 3, 4)), f"{name} has {p.numel()} elements"
    buffers = dict(model.named_buffers())
    assert buffers["scale"].dtype == torch.float32
    assert buffers["perm"].dtype == torch.int64
    assert sorted(buffers["perm"].tolist()) == list(range(7))
    scale = buffers["scale"].clone()
    FrozenMix.loss_fn(model, FrozenMix.make_batch(0, 4)).backward()
    assert torch.equal(model.scale, scale)  # constant buffer: forward never writes it
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)


def test_split_batch_partitions_dim0():
    batch = MLP.make_batch(0, 6)
    parts = [split_batch(batch, r, 3) for r in range(3)]
    for i, t in enumerate(batch):
        assert torch.equal(torch.cat([p[i] for p in parts]), t)
    with pytest.raises(ValueError, match="not divisible"):
        split_batch(batch, 0, 4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_reference_train_lowers_the_loss_and_leaves_model_alone(name):
    cls = MODELS[name]
    model = cls(seed=0)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    batches = [cls.make_batch(0, 16)]  # one batch, cycled: the loss must fall on it
    losses, params = reference_train(model, cls.loss_fn, batches, _adamw, steps=30)
    assert len(losses) == 30 and losses[-1] < 0.7 * losses[0]
    assert set(params) == set(before)
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    for k, p in model.named_parameters():
        changed = not torch.equal(params[k], before[k])
        assert changed == p.requires_grad, k  # frozen parameters stay, trainable ones move


def test_reference_train_generalises_on_tiny_gpt_fresh_batches():
    batches = (TinyGPT.make_batch(seed, 32) for seed in range(60))
    losses, _ = reference_train(TinyGPT(seed=0), TinyGPT.loss_fn, batches, _adamw, steps=60)
    assert losses[-1] < 0.6 * losses[0]


def test_reference_train_clip_norm_and_errors():
    model, batches = MLP(seed=0), [MLP.make_batch(0, 8)]
    clipped = reference_train(model, MLP.loss_fn, batches, _adamw, steps=3, clip_norm=1e-3)
    free = reference_train(model, MLP.loss_fn, batches, _adamw, steps=3)
    assert clipped.losses[0] == free.losses[0]
    with pytest.raises(ValueError, match="at least one batch"):
        reference_train(model, MLP.loss_fn, [], _adamw, steps=1)
    with pytest.raises(ValueError, match="ran out"):
        reference_train(model, MLP.loss_fn, iter(batches), _adamw, steps=2)
