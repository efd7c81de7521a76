"""Hugging Face `transformers` models (built from a config, random init, no download) train with
fzero exactly as with torch.optim in one process: GPT-2 (tied embeddings, Conv1D) and GPT-NeoX
(untied head, rotary buffers), fully and partly trainable.

SGD with momentum, not Adam: both models' fused qkv bias contains the key bias, whose gradient is
exactly zero (softmax ignores a per-query constant), so under Adam its rounding noise becomes
full-size steps and no two implementations agree there. AdamW parity is tested on
tests/models.py, whose attention has no qkv bias."""

from __future__ import annotations

import copy

import pytest
import torch

import fzero

transformers = pytest.importorskip("transformers")

STEPS = 4
GLOBAL_BATCH = 4


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def neox():
    config = transformers.GPTNeoXConfig(
        vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=40, max_position_embeddings=16, hidden_dropout=0.0,
        attention_dropout=0.0, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(config)


def loss_fn(call, batch):
    (ids,) = batch
    return call(input_ids=ids, labels=ids).loss


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 61, (GLOBAL_BATCH, 12), generator=gen),) for _ in range(STEPS)]


def freeze_embeddings(model):
    for name, p in model.named_parameters():
        if "wte" in name or "wpe" in name or "embed_in" in name:
            p.requires_grad_(False)
    return model


def reference(model, data):
    model = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
    losses = []
    for (ids,) in data:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def train(comm, model, stage, data):
    optimizer = fzero.optim.sgd(lr=0.1, momentum=0.9)
    state = fzero.init(model, stage=stage, comm=comm, optimizer=optimizer)
    step = fzero.make_train_step(model, loss_fn)
    per_rank = GLOBAL_BATCH // comm.world_size
    losses = []
    for (ids,) in data:
        state, metrics = step(state, (ids[comm.rank * per_rank : (comm.rank + 1) * per_rank],))
        losses.append(metrics["loss"])
    return losses, fzero.full_params(state)


@pytest.mark.slow
@pytest.mark.parametrize("build", [gpt2, neox], ids=["gpt2", "gpt-neox"])
@pytest.mark.parametrize("frozen", [False, True], ids=["all", "partly-frozen"])
@pytest.mark.parametrize("stage", [1, 3])
def test_transformers_model_trains_with_parity(build, frozen, stage):
    model = build()
    if frozen:
        freeze_embeddings(model)
    data = batches()
    want_losses, want_params = reference(model, data)
    losses, params = fzero.SimWorld(2).run(train, model, stage, data)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    if frozen:
        embed = next(n for n in want_params if "wte" in n or "embed_in" in n)
        assert torch.equal(params[embed], dict(model.named_parameters())[embed].detach())


def generate(model, prompt, new_tokens, use_cache):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=new_tokens, use_cache=use_cache, pad_token_id=0)


def generate_in_eval(comm, model, stage, prompts, data):
    """One train step, then greedy `generate` (KV cache on and off) inside an eval step, each
    rank its own prompt and length; stage 3 with the module on `meta` (nothing but the state
    holds the weights)."""
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    if stage == 3:
        model.to("meta")
    per_rank = GLOBAL_BATCH // comm.world_size
    step = fzero.make_train_step(model, loss_fn)
    state, _ = step(state, (data[0][0][comm.rank * per_rank : (comm.rank + 1) * per_rank],))
    evaluate = fzero.make_eval_step(model, lambda call, b: generate(model, *b))
    prompt, new_tokens = prompts[comm.rank]
    return {cache: evaluate(state, (prompt, new_tokens, cache)) for cache in (True, False)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_generate_inside_an_eval_step_matches_plain_transformers(stage):
    """Hugging Face `generate` runs the module many times with a growing KV cache; inside an
    eval step it sees the state's weights (at stage 3 gathered bucket by bucket, the ranks
    generating different lengths) and must give plain HF's tokens, after a train step."""
    model = gpt2().double()
    data = batches()
    reference_model = copy.deepcopy(model)  # one SGD step on the global batch
    reference_model(input_ids=data[0][0], labels=data[0][0]).loss.backward()
    torch.optim.SGD(reference_model.parameters(), lr=0.1).step()
    gen = torch.Generator().manual_seed(2)
    prompts = [(torch.randint(0, 61, (2, 3), generator=gen), 4),
               (torch.randint(0, 61, (1, 5), generator=gen), 7)]
    outs = fzero.SimWorld(2).run(generate_in_eval, model, stage, prompts, data)
    with torch.no_grad():
        for (prompt, new_tokens), out in zip(prompts, outs, strict=True):
            want = generate(reference_model, prompt, new_tokens, True)
            assert want.shape == (prompt.shape[0], prompt.shape[1] + new_tokens)
            assert torch.equal(out[True], want) and torch.equal(out[False], want)
