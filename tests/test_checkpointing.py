"""Activation checkpointing is exact at every stage (fzero.bound: the state's tensors stay bound
through backward, so recomputation reads them; stage 3 gathers them again for it).

References: the same model *without* checkpointing, trained by single-process torch.optim on
the global batch, in float64 (held to 1e-12). `test_stale_recomputation_is_visible` shows that
the reference tells the old, wrong path (recomputation after `functional_call` returned) apart.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import fzero
from fzero import residency
from fzero.buckets import LATE_GRADIENT_HELP
from fzero.comm import ring_bytes

import guarantee_bodies as gb

STAGES = (0, 1, 2, 3)
STEPS = 3
CHECKPOINTED = ("nonreentrant", "reentrant", "sequential")


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@functools.cache
def gpt_reference(n_layer: int = 2) -> gb.Reference:
    model = gb.CheckpointedGPT(mode="none", n_layer=n_layer).double()
    return gb.reference(model, gb.gpt_loss, gb.gpt_batches(STEPS))


# ----------------------------------------------------------------------------------------------
# torch.utils.checkpoint


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", CHECKPOINTED)
def test_checkpointed_gpt_is_exact(mode: str, stage: int, world: int) -> None:
    model = gb.CheckpointedGPT(mode=mode).double()
    out = fzero.SimWorld(world).run(gb.train, model, gb.gpt_loss, gb.gpt_batches(STEPS),
                                    stage=stage, count_calls="blocks.0")
    gb.assert_parity(out[0], gpt_reference())
    for other in out[1:]:
        assert other["losses"] == out[0]["losses"]
    assert out[0]["calls"] == 2 * STEPS  # forward and recomputation: checkpointing is on


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_stale_recomputation_is_visible(mode: str) -> None:
    """The wrong path the reference must catch: `functional_call` returns before backward, so
    recomputation reads the module's own tensors instead of the bound ones."""
    model = gb.CheckpointedGPT(mode=mode).double()
    plain = gb.CheckpointedGPT(mode="none").double()
    gen = torch.Generator().manual_seed(0)
    bound = {n: (p.detach() + 0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
             .requires_grad_() for n, p in model.named_parameters()}
    batch = gb.gpt_batches(1)[0]

    def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        for p in bound.values():
            p.grad = None
        loss = gb.gpt_loss(lambda *a: functional_call(module, bound, a), batch)
        loss.backward()
        return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in bound.items()}

    wrong, right = grads(model), grads(plain)
    assert gb.max_difference(wrong, right) > 1e-3


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_checkpointed_gpt_on_gloo(gloo_pool: Any, mode: str, world: int) -> None:
    model = gb.CheckpointedGPT(mode=mode).double()
    for stage in STAGES:
        out = gloo_pool(world).run(gb.train, model, gb.gpt_loss, gb.gpt_batches(STEPS),
                                   stage=stage)
        gb.assert_parity(out[0], gpt_reference())
        assert all(o["losses"] == out[0]["losses"] for o in out)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", CHECKPOINTED)
def test_stage3_recomputation_keeps_the_gathered_bound(mode: str, world: int) -> None:
    """Four blocks, 200-element buckets (many per block): recomputation gathers one block's
    buckets again and holds them until their gradients are complete, never the whole model;
    it adds no second full gather (comm_bytes counts what it gathers). Backward gathers every
    bucket again but the one forward ended with (kept, from the second step on)."""
    n_layer, prefetch = 4, 1
    model = gb.CheckpointedGPT(mode=mode, n_layer=n_layer).double()
    kwargs = {"stage": 3, "buckets": 200}
    out = fzero.SimWorld(world).run(gb.train, model, gb.gpt_loss, gb.gpt_batches(STEPS),
                                    **kwargs)[0]
    gb.assert_parity(out, gpt_reference(n_layer))
    plain = fzero.SimWorld(world).run(gb.train, gb.CheckpointedGPT(n_layer=n_layer).double(),
                                      gb.gpt_loss, gb.gpt_batches(1), **kwargs)[0]
    layout = out["layout"]
    sizes = sorted((b.padded_numel * 8 for b in layout.buckets), reverse=True)
    block = sum(b.padded_numel * 8 for b in layout.buckets
                if any(name.startswith("blocks.1.") for name in b.names))
    total = sum(sizes)
    assert len(layout.buckets) > 4 * n_layer
    psi = sum(ring_bytes("all_gather", b.padded_numel, 8, world) for b in layout.buckets)
    largest = max(ring_bytes("all_gather", b.padded_numel, 8, world) for b in layout.buckets)
    for m in out["metrics"]:
        assert m["gathered_bytes_peak"] <= block + sum(sizes[: prefetch + 1])
        assert m["gathered_bytes_peak"] < total / 2
        gathered = m["comm_bytes_by_kind"]["all_gather"]
        assert 2 * psi - largest <= gathered <= 2 * psi + 2 * largest
        assert gathered >= plain["metrics"][0]["comm_bytes_by_kind"]["all_gather"] - largest


@pytest.mark.parametrize("buckets", ["default", "alone"])
def test_stage3_checkpointed_body_reading_its_modules_own_parameter(buckets: str) -> None:
    """A module that checkpoints its own forward's body (checkpoint(self.inner, x), as
    transformers 5's GradientCheckpointingLayer does with `forward`, so that hooks stay outside)
    reads its *own* parameters during recomputation without its pre-hook running again: the
    torch function guard gathers them (a matmul read, and an elementwise one that torch would
    not bounds-check)."""
    model = gb.InnerCheckpointed()
    data = gb.mse_batches(STEPS, d_in=5, d_out=3)
    policy = None if buckets == "default" else gb.each_parameter_alone(model)
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, data, stage=3, buckets=policy)
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, data))


def test_checkpointed_body_reading_its_modules_own_parameter_below_stage3() -> None:
    model = gb.InnerCheckpointed()
    data = gb.mse_batches(STEPS, d_in=5, d_out=3)
    want = gb.reference(model, gb.mse_loss, data)
    for stage in (0, 1, 2):
        gb.assert_parity(fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, data,
                                               stage=stage)[0], want)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("source", ["leaf", "computed", "raw"])
@pytest.mark.parametrize("read", ["matmul", "elementwise"])
def test_stage3_region_reading_a_gathered_childs_weight(read: str, source: str,
                                                        world: int) -> None:
    """A region reads `lin.weight` directly while `lin`'s bucket is gathered for `lin`'s own
    backward, so the read gathers nothing; the recomputed tensors saved from that weight are
    read by forward's nodes after other buckets' gradients completed. Each such read keeps its
    bucket until the node that reads it has run (before: torch's error for a matmul, a
    segmentation fault for the elementwise read)."""
    model = gb.RegionReadsChild(read, source)
    data = gb.mse_batches(STEPS, rows=4, d_in=4, d_out=4)
    want = gb.reference(model, gb.mse_loss, data)
    for prefetch in (0, 1):
        out = fzero.SimWorld(world).run(gb.train, model, gb.mse_loss, data, stage=3, buckets=8,
                                        step_kwargs={"prefetch": prefetch})[0]
        assert len(out["layout"].buckets) > 3
        gb.assert_parity(out, want)


def test_stage3_nested_regions_keep_the_gathered_bound() -> None:
    """A region nested in one being recomputed builds a graph backward never runs: its reads
    were counted as a forward's, and their pins held one large bucket per enclosing region to
    the end of backward (2.04 buckets unnested; nested 4.1 at 3 regions, 7.1 at 6: a probe).
    Now nesting costs only the blocks' small buckets, whatever the depth."""
    data = gb.token_batches(2)
    big = 512 * 8 * 8  # one large bucket's bytes (float64)
    peaks = {}
    for pairs, nested in ((3, False), (3, True), (6, True)):
        model = gb.NestedRegions(pairs, nested)
        out = fzero.SimWorld(1).run(gb.train, model, gb.token_loss, data, stage=3,
                                    opt=("sgd", gb.SGD), buckets=gb.NestedRegions.policy,
                                    step_kwargs={"prefetch": 0})[0]
        peaks[pairs, nested] = max(m["gathered_bytes_peak"] for m in out["metrics"])
        if pairs == 3:
            gb.assert_parity(out, gb.reference(model, gb.token_loss, data, gb.torch_sgd))
    assert peaks[3, False] < 2.1 * big
    assert peaks[3, True] < peaks[3, False] + big / 8
    assert peaks[6, True] < peaks[3, False] + big / 8


def test_torch_recomputation_hooks_are_told_from_a_regions_forward() -> None:
    """Stage 3 tells a non-reentrant region's forward (whose graph backward runs: its reads
    keep their buckets until their nodes have run) from its recomputation (whose graph is never
    run) by the qualified name of torch's recomputation hooks. Were torch to rename them,
    recomputation's reads would hold their buckets to the end of backward."""
    names, inside = [], []

    def region(x: torch.Tensor) -> torch.Tensor:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        names.append(residency._qualname(top[1]))
        inside.append(residency._inside_recomputation())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    checkpoint(region, x, use_reentrant=False).sum().backward()
    assert len(names) == 2
    assert not names[0].startswith(residency._RECOMPUTATION_HOOKS)
    assert names[1].startswith(residency._RECOMPUTATION_HOOKS)
    assert inside == [False, True]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("buckets", [8, "alone"])
def test_nested_reentrant_misuse_raises_the_documented_error(stage: int, buckets: Any) -> None:
    """Nested regions, reentrant and not, reading parameters used outside them: every stage
    raises the documented error (stage 3 with 8-element buckets crashed the process: a
    non-reentrant region's recomputed tensors inside a reentrant region's backward read
    released buckets)."""
    model = gb.NestedReentrantMisuse()
    policy = gb.each_parameter_alone(model) if buckets == "alone" else buckets
    fixed = LATE_GRADIENT_HELP.split("{label!r}")[1][:60]
    data = gb.mse_batches(2, rows=2, d_in=4, d_out=4)
    for prefetch in (0, 2):
        out = fzero.SimWorld(1).run(gb.train_through_failure, model, gb.mse_loss, data,
                                    stage=stage, fail={}, buckets=policy,
                                    step_kwargs={"prefetch": prefetch})[0]
        error = out["errors"][0]
        assert error["type"] == "RuntimeError" and fixed in error["message"], error
        assert error["unchanged"]


# ----------------------------------------------------------------------------------------------
# A parameter in two reentrant regions: exact when its bucket completes once, else an error


def shared_model_and_buckets() -> tuple[gb.SharedInRegions, list[list[str]]]:
    model = gb.SharedInRegions().double()
    return model, [[name] for name, _ in model.named_parameters()]


@pytest.mark.parametrize("stage", STAGES)
def test_two_reentrant_regions_raise_naming_the_parameter(stage: int) -> None:
    """Each parameter in its own bucket: `shared`'s bucket is complete (and being reduced)
    after the second region's nested backward; the first region's adds to it late."""
    model, alone = shared_model_and_buckets()
    fixed = LATE_GRADIENT_HELP.split("{label!r}")[1][:60]
    batches = gb.regions_batches(2, world=2, reentrant_ranks=[0, 1])
    outs = fzero.SimWorld(2).run(gb.train_through_failure, model, gb.regions_loss, batches,
                                 stage=stage, fail={}, buckets=alone)
    for out in outs:
        assert sorted(out["errors"]) == [0, 1]
        for error in out["errors"].values():
            assert error["type"] == "RuntimeError"
            assert "'shared." in error["message"] and fixed in error["message"]
            assert error["unchanged"]


@pytest.mark.parametrize("stage", STAGES)
def test_reentrant_regions_on_one_rank_raise_on_every_rank(stage: int) -> None:
    model, alone = shared_model_and_buckets()
    batches = gb.regions_batches(1, world=3, reentrant_ranks=[1])
    outs = fzero.SimWorld(3, timeout=5).run(  # a rank left waiting fails fast
        gb.train_through_failure, model, gb.regions_loss, batches, stage=stage, fail={},
        buckets=alone)
    own = outs[1]["errors"][0]
    assert own["type"] == "RuntimeError" and "'shared." in own["message"]
    for rank in (0, 2):
        error = outs[rank]["errors"][0]
        assert error["type"] == "StepError" and error["ranks"] == (1,)
        assert "'shared." in error["message"]
    assert all(out["errors"][0]["unchanged"] for out in outs)


@pytest.mark.parametrize("stage", STAGES)
def test_reentrant_regions_in_one_bucket_are_exact(stage: int) -> None:
    """The default policy puts the whole small model in one bucket: it completes after both
    nested backward passes, so nothing arrives late and training is exact."""
    model = gb.SharedInRegions().double()
    batches = gb.regions_batches(3, world=2, reentrant_ranks=[0, 1])
    ref = gb.reference(model, gb.regions_loss, batches)
    out = fzero.SimWorld(2).run(gb.train, model, gb.regions_loss, batches, stage=stage)[0]
    assert len(out["layout"].buckets) == 1
    gb.assert_parity(out, ref)


# ----------------------------------------------------------------------------------------------
# Hugging Face activation checkpointing (GPT-2: tied head, Conv1D; GPT-NeoX: untied, rotary)
#
# SGD, not Adam: both models' fused qkv bias holds the key bias, whose gradient is exactly zero
# in exact arithmetic (softmax ignores a per-query constant); its float64 rounding noise would
# be normalized by Adam into full-size steps that no two summation orders agree on.

transformers = pytest.importorskip("transformers")

HF_MODELS = {"gpt2": (gb.hf_gpt2, "transformer.h.0.attn.c_attn"),
             "gpt-neox": (gb.hf_neox, "gpt_neox.layers.0.attention.query_key_value")}
"""Each model's builder, and a module inside its first layer whose calls are counted:
transformers 5 checkpoints a layer's `forward`, not its `__call__` (so that hooks on the layer
itself run once), and the modules inside run again in recomputation."""


@functools.cache
def hf_reference(name: str) -> gb.Reference:
    build, _ = HF_MODELS[name]
    return gb.reference(build(), gb.hf_loss, gb.hf_batches(STEPS), gb.torch_sgd)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hf_activation_checkpointing_is_exact(name: str, reentrant: bool, stage: int,
                                              world: int) -> None:
    build, layer = HF_MODELS[name]
    prepare = functools.partial(gb.enable_hf_checkpointing, use_reentrant=reentrant)
    out = fzero.SimWorld(world).run(gb.train, build(), gb.hf_loss, gb.hf_batches(STEPS),
                                    stage=stage, opt=("sgd", gb.SGD), prepare=prepare,
                                    count_calls=layer)
    gb.assert_parity(out[0], hf_reference(name))
    assert out[0]["calls"] == 2 * STEPS  # the layer was recomputed in every backward


@pytest.mark.skipif(not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"),
                    reason="transformers 4: gradient_checkpointing_enable is the only name")
@pytest.mark.parametrize("stage", [0, 3])
def test_hf_gradient_checkpointing_enable_is_exact(stage: int) -> None:
    """The deprecated name (transformers 5 warns) takes the same path."""
    model = gb.hf_gpt2()
    with pytest.warns(FutureWarning, match="gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
    out = fzero.SimWorld(2).run(gb.train, model, gb.hf_loss, gb.hf_batches(STEPS), stage=stage,
                                opt=("sgd", gb.SGD), count_calls="transformer.h.1.attn.c_attn")
    gb.assert_parity(out[0], hf_reference("gpt2"))
    assert out[0]["calls"] == 2 * STEPS


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_hf_checkpointing_on_gloo(gloo_pool: Any, world: int) -> None:
    prepare = functools.partial(gb.enable_hf_checkpointing, use_reentrant=False)
    for name in sorted(HF_MODELS):
        build, layer = HF_MODELS[name]
        out = gloo_pool(world).run(gb.train, build(), gb.hf_loss, gb.hf_batches(STEPS),
                                   stage=3, opt=("sgd", gb.SGD), prepare=prepare,
                                   count_calls=layer)
        gb.assert_parity(out[0], hf_reference(name))
        assert out[0]["calls"] == 2 * STEPS


HF_MLPS = {"gpt2": ".mlp.", "gpt-neox": ".mlp."}


def _partly_frozen(name: str) -> torch.nn.Module:
    """The model with only its MLPs trainable: each block then has a frozen bucket that
    several modules share (norms, attention), besides its trainable one."""
    build, _ = HF_MODELS[name]
    model = build()
    for param_name, param in model.named_parameters():
        param.requires_grad_(HF_MLPS[name] in param_name)
    return model


@functools.cache
def hf_partly_frozen_reference(name: str) -> gb.Reference:
    return gb.reference(_partly_frozen(name), gb.hf_loss, gb.hf_batches(STEPS), gb.torch_sgd)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hf_checkpointing_of_partly_frozen_blocks_is_exact(name: str, stage: int,
                                                         world: int) -> None:
    """Only the MLPs trainable, non-reentrant checkpointing (Hugging Face makes the embedding's
    output require grad, so frozen modules' inputs do): at stage 3 the first frozen module
    whose input gradients were done reset its frozen bucket's recomputation pins, releasing
    the bucket while other modules' recomputed saved tensors still pointed into it. A
    misleading OutsideOwnerError, or a segmentation fault (`finetune_hf.py
    --gradient-checkpointing --train 'transformer.h.*.mlp.*'`, a probe). Exact now."""
    prepare = functools.partial(gb.enable_hf_checkpointing, use_reentrant=False)
    out = fzero.SimWorld(world).run(gb.train, _partly_frozen(name), gb.hf_loss,
                                    gb.hf_batches(STEPS), stage=stage, opt=("sgd", gb.SGD),
                                    prepare=prepare)
    gb.assert_parity(out[0], hf_partly_frozen_reference(name))


def test_hf_references_train() -> None:
    """The HF references move every parameter by far more than the 1e-12 tolerance (the
    comparisons above are not of untouched weights)."""
    for name, (build, _) in HF_MODELS.items():
        start = {n: p.detach() for n, p in build().named_parameters()}
        moved = {n: float((hf_reference(name).params[n] - v).abs().max()) for n, v in start.items()}
        assert min(moved.values()) > 1e-5, name


class _SignGate(torch.nn.Module):
    """A checkpointed body that reads ``b`` for a sign mask only (no gradient of ``b`` there;
    it comes from the use after the region), or, `late`, trains ``b`` inside the region too."""

    def __init__(self, inner_reentrant: bool, late: bool) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.b = torch.nn.Parameter(torch.randn(4, generator=gen, dtype=torch.float64))
        self.inner_reentrant, self.late = inner_reentrant, late

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.b if self.late else torch.where(self.b > 0, x, -x) * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=self.inner_reentrant)
        return h * self.b


class _NestedRegions(torch.nn.Module):
    """`_SignGate` inside an outer reentrant region, between two linear layers."""

    def __init__(self, inner_reentrant: bool, late: bool = False) -> None:
        super().__init__()
        with gb.seeded(3):
            self.inp, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        self.gate = _SignGate(inner_reentrant, late)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.gate, self.inp(x), use_reentrant=True)
        return self.head(h)


@pytest.mark.parametrize("inner_reentrant", [True, False], ids=["reentrant", "nonreentrant"])
def test_stage3_checkpoint_nested_in_a_reentrant_region_is_exact(inner_reentrant: bool) -> None:
    """A reentrant region's backward calls ``torch.autograd.backward`` on its recomputation,
    which torch ran with stage 3's gathering guard switched off: a checkpoint nested there
    recomputed ``b`` after its bucket was released (its gradient complete), a segfault (a
    probe). That backward runs under the guard now: exact, also with ``b`` trained inside the
    inner region when that one is non-reentrant; a reentrant one gives the documented error
    for a parameter used across reentrant regions (two backward passes over it)."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=gen, dtype=torch.float64),
                torch.randn(4, 2, generator=gen, dtype=torch.float64)) for _ in range(2)]
    for late in (False, True):
        model = _NestedRegions(inner_reentrant, late)
        run = functools.partial(fzero.SimWorld(2).run, gb.train, model, gb.mse_loss, batches,
                                stage=3, opt=("sgd", gb.SGD), buckets=1)
        if late and inner_reentrant:  # two backward passes over b
            with pytest.raises(fzero.SimWorldError, match="accumulated a gradient after its"):
                run()
        else:
            gb.assert_parity(run()[0], gb.reference(model, gb.mse_loss, batches, gb.torch_sgd))


class _StopGradient(torch.nn.Module):
    """Uses a stop-gradient copy of its own weight (``self.scale.detach()``, taken and used in
    one forward) beside the weight itself: elementwise, or as a matmul operand."""

    def __init__(self, matmul: bool) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.scale = torch.nn.Parameter(torch.randn(4, 4, generator=gen, dtype=torch.float64))
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x @ self.scale.detach() if self.matmul else x * self.scale.detach()[0]
        return z * self.scale[0]


class _CheckpointedStopGradient(torch.nn.Module):
    """The block's input: computed (``"computed"``), the raw batch, which needs no gradient
    (``"raw"``), or a leaf that requires one (``"leaf"``)."""

    def __init__(self, matmul: bool, source: str = "computed") -> None:
        super().__init__()
        with gb.seeded(4):
            self.inp, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        self.block = _StopGradient(matmul)
        self.source = source
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = {"computed": lambda: self.inp(x), "raw": lambda: x,
             "leaf": lambda: x.detach().requires_grad_()}[self.source]()
        return self.head(torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False))


@pytest.mark.parametrize("source", ["computed", "raw", "leaf"])
@pytest.mark.parametrize("matmul", [False, True], ids=["elementwise", "matmul"])
def test_stage3_stop_gradient_copy_in_a_checkpointed_block_is_exact(matmul: bool,
                                                                    source: str) -> None:
    """The recomputed ``scale.detach()`` aliases its bucket; ``scale``'s gradient completes
    through its other use first, and completion released the bucket under the alias, which an
    earlier node then read: a segfault or OutsideOwnerError (a probe's fuzzer). A module whose
    backward is still to run keeps its recomputation pins now; one whose input needs no
    gradient or is a leaf (no hook can say when its backward ran) keeps them to the end of
    backward (it segfaulted still: a probe)."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=gen, dtype=torch.float64),
                torch.randn(4, 2, generator=gen, dtype=torch.float64)) for _ in range(2)]
    model = _CheckpointedStopGradient(matmul, source)
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, batches, stage=3,
                                opt=("sgd", gb.SGD), buckets=1)
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, batches, gb.torch_sgd))


class _AliasBeforeItsModule(torch.nn.Module):
    """In a checkpointed region, a stop-gradient alias of ``lin``'s weight (``detach`` or
    ``.data``) is taken just before ``lin`` runs, and read by a node after ``lin``'s."""

    def __init__(self, how: str) -> None:
        super().__init__()
        with gb.seeded(5):
            self.pre, self.lin, self.other, self.post = (torch.nn.Linear(4, 4) for _ in range(4))
        self.how = how
        self.double()

    def region(self, t: torch.Tensor) -> torch.Tensor:
        alias = self.lin.weight.detach() if self.how == "detach" else self.lin.weight.data
        return self.other(self.lin(t * alias[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.region, self.pre(x), use_reentrant=False)
        return self.post(h)


@pytest.mark.parametrize("how", ["detach", "data"])
def test_stage3_stop_gradient_alias_taken_before_its_module_in_a_region_is_exact(
        how: str) -> None:
    """The recomputation's read of ``lin.weight`` for the alias pinned its bucket for no
    module; the bucket's completed gradient dropped that pin and ``lin``'s finished backward
    its own, and the multiplication's backward read the alias released: a segfault (a probe).
    An alias taken during recomputation keeps its bucket to the end of backward."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=gen, dtype=torch.float64),
                torch.randn(4, 4, generator=gen, dtype=torch.float64)) for _ in range(2)]
    model = _AliasBeforeItsModule(how)
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, batches, stage=3,
                                opt=("sgd", gb.SGD),
                                buckets=lambda m: isinstance(m, torch.nn.Linear))
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, batches, gb.torch_sgd))


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_SAVE


class _Selective(torch.nn.Module):
    """A region checkpointed selectively (``context_fn``: torch's documented policy)."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        with gb.seeded(6):
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.policy = policy
        self.double()

    def region(self, t: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(t)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        context = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return torch.utils.checkpoint.checkpoint(self.region, self.a(x), use_reentrant=False,
                                                 context_fn=context)


@pytest.mark.parametrize("policy", [_save_matmuls, _save_all], ids=["matmuls", "all"])
@pytest.mark.parametrize("world", [1, 2])
def test_stage3_selective_checkpointing_is_exact(policy: Any, world: int) -> None:
    """Selective checkpointing counts and caches its region's ops by their order under a torch
    dispatch mode; fzero's own ops in its hooks (a gather round's header, a gather's copies),
    which recomputation issues differently from forward, ran under that mode and it raised,
    at every world size (a probe). fzero's hooks run with the user's dispatch modes off."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=gen, dtype=torch.float64),
                torch.randn(4, 4, generator=gen, dtype=torch.float64)) for _ in range(2)]
    model = _Selective(policy)
    out = fzero.SimWorld(world).run(gb.train, model, gb.mse_loss, batches, stage=3,
                                    opt=("sgd", gb.SGD),
                                    buckets=lambda m: isinstance(m, torch.nn.Linear))
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, batches, gb.torch_sgd))
