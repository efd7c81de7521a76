"""`fzero.init` from a `meta` model: sharded init (init_fn= or load=) equals materialized init
and never holds more than one bucket's full values."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
from fzero.simworld import SimWorldError
from fzero.testing import worlds_and_trees

from models import TinyGPT, per_block


class Stack(nn.Module):
    """Untied: embedding, a ModuleList of blocks (one bucket each), a head. ~5k parameters."""

    def __init__(self, width: int = 12, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 5)
        self.register_buffer("scale", torch.full((width,), 0.5))

    def forward(self, idx):
        x = self.embed(idx) * self.scale
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def init_fn(module: nn.Module) -> None:
    for name, p in module.named_parameters(recurse=False):
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
        elif name == "weight":
            nn.init.ones_(p)
        else:
            nn.init.uniform_(p, -0.1, 0.1)
    if isinstance(module, Stack):
        module.scale.fill_(0.5)


def materialized(seed: int = 0) -> Stack:
    """The reference: the whole model, then init_fn on each module in modules() order."""
    model = Stack()
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            init_fn(module)
    return model


def meta_model() -> Stack:
    with torch.device("meta"):
        return Stack()


def init_and_gather(comm, model, stage, **kwargs):
    torch.manual_seed(0)
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.adamw(), **kwargs)
    return fzero.full_params(state), state.buffers


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("world", [1, 3])
def test_init_fn_on_meta_equals_materialized_init(stage, world):
    want = materialized()
    for params, buffers in fzero.SimWorld(world).run(
        init_and_gather, meta_model(), stage, init_fn=init_fn
    ):
        for name, value in want.named_parameters():
            assert torch.equal(params[name], value.detach()), name
        assert torch.equal(buffers["scale"], want.scale)


@pytest.mark.parametrize("cap", [150, 170, 200])
def test_init_fn_equals_materialized_init_when_a_module_spans_buckets(cap):
    """A size cap can put a module's weight and bias in two buckets: init_fn ran on the
    module once per bucket, drawing its weight twice, and every later parameter differed from
    the materialized model's (found through bench_step's bucket-cap rows). These caps split
    a Linear layer (144 + 12 elements) or a LayerNorm from its bias at different points."""
    want = materialized()
    layout = fzero.plan(meta_model(), 2, buckets=cap)
    owners = [{e.name.rsplit(".", 1)[0] for e in b.entries} for b in layout.buckets]
    assert any(a & b for a, b in zip(owners, owners[1:], strict=False))  # a module split
    for params, _ in fzero.SimWorld(2).run(init_and_gather, meta_model(), 3, init_fn=init_fn,
                                           buckets=cap):
        for name, value in want.named_parameters():
            assert torch.equal(params[name], value.detach()), name


class Kinds(nn.Module):
    """Three Linear layers, the middle one frozen (or of another dtype): one default group
    that splits into a trainable bucket (a, c) and a frozen one (b), out of module order."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4, dtype=dtype), nn.Linear(4, 4)
        self.b.requires_grad_(dtype != torch.float32)


def normal_init(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        p.normal_()


@pytest.mark.parametrize(("dtype", "buckets"), [
    (torch.float32, None), (torch.bfloat16, None), (torch.float32, 1),
    (torch.float32, [["c.weight", "c.bias"], ["a.weight", "a.bias", "b.weight", "b.bias"]]),
])
def test_init_fn_runs_in_module_order_whatever_the_bucket_order(dtype, buckets):
    """The default policy puts a frozen (or bfloat16) module's bucket after its trainable
    neighbours', and an explicit list may come in any order: init_fn ran in bucket order, so
    the random draws came in another order than a materialized model's (a probe)."""
    want = Kinds(dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        for module in want.modules():
            normal_init(module)
    with torch.device("meta"):
        meta = Kinds(dtype)
    layout = fzero.plan(meta, 2, buckets=buckets)
    order = [e.name[0] for b in layout.buckets for e in b.entries]
    assert order != sorted(order) or buckets == 1  # bucket order is not module order
    for params, _ in fzero.SimWorld(2).run(init_and_gather, meta, 3, init_fn=normal_init,
                                           buckets=buckets):
        for name, value in want.named_parameters():
            assert torch.equal(params[name], value.detach()), name


def test_load_on_meta_equals_init_from_the_materialized_model():
    source = materialized(seed=3)
    state_dict = {k: v.detach().clone() for k, v in source.state_dict().items()}
    calls: list[list[str]] = []

    def load(names):
        calls.append(list(names))
        return {name: state_dict[name] for name in names}

    results = fzero.SimWorld(2, copy_args=False).run(
        init_and_gather, meta_model(), 3, load=load
    )
    direct = fzero.SimWorld(2).run(init_and_gather, source, 3)
    for (params, buffers), (want, want_buffers) in zip(results, direct, strict=True):
        assert params.keys() == want.keys()
        for name in want:
            assert torch.equal(params[name], want[name]), name
        assert torch.equal(buffers["scale"], want_buffers["scale"])
    layout = fzero.plan(meta_model(), 2)
    # Rank 0 alone reads: once per bucket, then once for the buffers.
    assert len(calls) == len(layout.buckets) + 1
    assert sorted(n for names in calls[:-1] for n in names) == sorted(layout.names)


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage any tensor op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_sharded_init_never_allocates_more_than_a_bucket():
    model = meta_model()
    layout = fzero.plan(model, 1, buckets=per_block(model))
    largest_bucket = max(b.padded_numel for b in layout.buckets) * 4
    whole = layout.padded_numel * 4
    assert largest_bucket * 3 < whole  # the bound below means something

    def body(comm):
        with LargestAllocation() as tracker:
            fzero.init(model, stage=3, comm=comm, optimizer=fzero.optim.adamw(),
                       init_fn=init_fn, buckets=per_block(model))
        return tracker.largest

    (largest,) = fzero.SimWorld(1, copy_args=False).run(body)
    assert 0 < largest <= largest_bucket


def test_meta_model_needs_exactly_one_source():
    with pytest.raises(SimWorldError) as info:
        fzero.SimWorld(1).run(init_and_gather, meta_model(), 3)
    assert "pass exactly one of init_fn= " in str(info.value.__cause__)
    with pytest.raises(SimWorldError) as info:
        fzero.SimWorld(1).run(init_and_gather, materialized(), 3, init_fn=init_fn)
    assert "materialized already" in str(info.value.__cause__)


def test_load_missing_a_parameter_is_named():
    def load(names):
        return {}

    with pytest.raises(SimWorldError) as info:
        fzero.SimWorld(1).run(init_and_gather, meta_model(), 3, load=load)
    assert "load() returned no value for parameter 'embed.weight'" in str(info.value.__cause__)


def test_load_missing_a_buffer_is_named():
    def load(names):
        return {name: torch.zeros(materialized().get_parameter(name).shape) for name in names
                if name != "scale"}

    with pytest.raises(SimWorldError) as info:
        fzero.SimWorld(1).run(init_and_gather, meta_model(), 3, load=load)
    assert "load() returned no value for buffers ['scale']" in str(info.value.__cause__)
    assert "non-persistent" not in str(info.value.__cause__)  # 'scale' is in a state_dict


def test_load_missing_a_non_persistent_buffer_says_no_checkpoint_holds_it():
    """Hugging Face registers rotary frequencies and position ids with persistent=False: a
    load() reading a checkpoint cannot return them, and the error says why (a probe found the
    bare message puzzling)."""
    def build() -> nn.Module:
        model = materialized()
        model.register_buffer("inv_freq", torch.arange(3.0), persistent=False)
        return model

    with torch.device("meta"):
        meta = build()
    saved = build().state_dict()
    assert "inv_freq" not in saved

    with pytest.raises(SimWorldError) as info:
        fzero.SimWorld(1).run(init_and_gather, meta, 3, load=lambda names: saved)
    text = str(info.value.__cause__)
    assert "no value for buffers ['inv_freq']; ['inv_freq'] are non-persistent" in text
    assert "no checkpoint file holds them" in text


class Counted(nn.Module):
    """A module whose own gain, float buffer and integer buffer an init_fn may forget."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.ones(3))
        self.register_buffer("offset", torch.zeros(3), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(3, dtype=torch.uint8))

    def forward(self, x):
        return self.lin(x) * self.gain + self.offset


def _init_all_but(forget: str, *, through_data: bool = False):
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            weight = module.weight.data if through_data else module.weight
            weight.normal_()  # through .data: no version bump, still seen as written
            module.bias.zero_()
        elif isinstance(module, Counted):
            for name in ("gain", "offset", "count"):
                if name != forget:
                    getattr(module, name).fill_(1)
            if forget != "mask":
                module.mask.zero_()  # zeros are a value: an unsigned fill is the largest
    return init


def _init_counted(comm, forget: str, through_data: bool = False):
    with torch.device("meta"):
        model = Counted()
    state = fzero.init(model, stage=3, comm=comm, optimizer=fzero.optim.sgd(lr=0.1),
                       init_fn=_init_all_but(forget, through_data=through_data))
    return fzero.full_params(state), state.buffers


def _expect_failure(comm, forget):
    try:
        _init_counted(comm, forget)
    except ValueError as error:
        return type(error).__name__, str(error)
    return None, ""


@pytest.mark.parametrize("forget", ["gain", "offset", "count", "mask"])
def test_an_init_fn_that_leaves_a_tensor_unwritten_raises_naming_it(forget):
    """Fresh memory from to_empty would otherwise silently become the state's values (an
    init_fn that does not handle one module type, or one buffer)."""
    outcomes = fzero.SimWorld(2).run(_expect_failure, forget)
    own, other = outcomes
    assert own[0] == "ValueError" and f"init_fn left 1 tensor(s) uninitialized, ['{forget}'] " \
        f"(of modules ['Counted'])" in own[1], own
    assert other[0] == "ValueError" and "rank 0's init_fn / load= raised" in other[1], other
    assert f"['{forget}']" in other[1]


def test_an_init_fn_that_writes_everything_passes_also_through_data():
    for through_data in (False, True):
        (params, buffers), = fzero.SimWorld(1).run(_init_counted, "", through_data)
        assert torch.equal(params["gain"], torch.ones(3))
        assert not params["lin.weight"].isnan().any()
        assert torch.equal(params["lin.bias"], torch.zeros(3))
        assert torch.equal(buffers["offset"], torch.ones(3))
        assert buffers["count"].item() == 1
        assert torch.equal(buffers["mask"], torch.zeros(3, dtype=torch.uint8))


def _load_tied(comm, head_differs: bool):
    from models import TinyGPT

    source = dict(TinyGPT().named_parameters(remove_duplicate=False))
    values = {name: value.detach().clone() for name, value in source.items()}
    if head_differs:  # an untied checkpoint: the head has values of its own
        values["lm_head.weight"] += 1.0
    with torch.device("meta"):
        model = TinyGPT()
    state = fzero.init(model, stage=3, comm=comm, optimizer=fzero.optim.sgd(lr=0.1),
                       load=lambda names: values)  # a whole state dict, ties under each name
    return fzero.full_params(state)["tok_emb.weight"], values["tok_emb.weight"]


def test_load_giving_a_tie_two_different_values_raises():
    """An untied checkpoint loaded into a tied model: one name's values would be dropped."""
    with pytest.raises(SimWorldError) as info:
        fzero.SimWorld(2).run(_load_tied, True)
    assert ("load() returned different values for ['tok_emb.weight', 'lm_head.weight'], which "
            "the model ties") in str(info.value)
    for loaded, want in fzero.SimWorld(2).run(_load_tied, False):  # equal values: one tensor
        assert torch.equal(loaded, want)


def _nested_body(comm):
    gen = torch.Generator().manual_seed(0)
    tree = {"enc": {"w": torch.randn(3, 4, generator=gen, requires_grad=True)},
            "head": {"b": torch.randn(4, generator=gen, requires_grad=True)}}
    state = fzero.init(tree, stage=3, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    return fzero.full_params(state), tree


def test_init_takes_a_nested_mapping_as_plan_does():
    """A pytree of parameters (names by path), as `fzero.plan` takes it: init raised
    AttributeError ('dict' object has no attribute 'is_meta')."""
    for params, tree in fzero.SimWorld(2).run(_nested_body):
        assert torch.equal(params["enc.w"], tree["enc"]["w"].detach())
        assert torch.equal(params["head.b"], tree["head"]["b"].detach())


def _mismatched_init(comm: Any, how: str) -> str:
    model = materialized()
    kwargs: dict[str, Any] = {}
    if comm.rank == 1 and how == "frozen":
        model.embed.weight.requires_grad_(False)
    if comm.rank == 1 and how == "buckets":
        kwargs["buckets"] = [[name] for name, _ in model.named_parameters()]
    if comm.rank == 1 and how == "shape":
        model.embed.weight = nn.Parameter(torch.zeros(3, 3))
    stage, optimizer = 3, fzero.optim.adamw()
    if comm.rank == 1 and how == "stage":
        stage = 2
    if comm.rank == 1 and how == "master_dtype":
        kwargs["master_dtype"] = torch.float64
    if comm.rank == 1 and how == "optimizer":
        optimizer = fzero.optim.adamw(lr=2e-3)
    with pytest.raises(ValueError) as info:
        fzero.init(model, stage=stage, comm=comm, optimizer=optimizer, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(("how", "named"), [
    ("frozen", "which parameters are trainable (requires_grad, trainable=) (this rank: "),
    ("buckets", "they differ in: how parameters are bucketed (buckets=) (this rank: "),
    ("shape", "they differ in: parameter names, shapes and dtypes (this rank: "),
    ("stage", "stage (this rank: "),
    ("master_dtype", "they differ in: master_dtype (this rank: "),
    ("optimizer", "they differ in: the optimizer and its hyperparameters (this rank: "),
])
def test_ranks_building_different_layouts_are_told_what_differs(how: str, named: str) -> None:
    """Every rank raises at init; the message said "layout fingerprint (parameter names, shapes
    and dtypes) differs" with two hashes, also when only requires_grad or the bucket policy
    differed (a probe). It names the parts that differ, with this rank's value. The stage,
    master_dtype and optimizer, which only the first step compared, are compared too: a save,
    `full_params` or eval step before it ran on states built differently."""
    for rank, message in enumerate(fzero.SimWorld(2).run(_mismatched_init, how)):
        assert message.startswith("layout fingerprint differs across ranks: rank 0 has ")
        assert f"(this is rank {rank}); " in message and named in message, message
    if how == "buckets":
        assert "trainable" not in message and "shapes" not in message


def _blocks(count: int, frozen: int = 0) -> nn.Module:
    """`count` blocks of 2048 * 2049 elements on meta (nothing allocated), the first `frozen`
    of them frozen."""
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(count)))
    for block in model[:frozen]:
        block.requires_grad_(False)
    return model


def _default_layout(model: nn.Module, stage: int, device: str) -> fzero.ShardLayout:
    """The layout `init` plans for `model` on 2 ranks (as it does, in two passes)."""
    from fzero.state import default_buckets

    planned = fzero.plan(model, 2, separate_tied=stage == 3)
    policy = default_buckets(stage, torch.device(device), planned)
    return planned if policy is None else fzero.plan(model, 2, buckets=policy)


BLOCK = 2048 * 2049


def test_default_buckets_cap_stages_0_to_2_on_cuda_only() -> None:
    """`init`'s default policy: on CUDA at stages 0-2 buckets of up to 2**26 elements in
    parameter order (a GPU's host cost per collective outweighs finer overlap: one H200, 30M
    GPT, stage 1 went from 1.28x DDP's step to level with it); stage 3 and every CPU stage
    keep `fzero.plan`'s one bucket per block."""
    from fzero.layout import DEFAULT_BUCKET_CAP_CUDA

    model = _blocks(20)  # 84M elements
    per_block = fzero.plan(model, 2, separate_tied=False)
    assert len(per_block.buckets) == 20
    for stage in (0, 1, 2, 3):
        assert _default_layout(model, stage, "cpu") == per_block
    assert _default_layout(model, 3, "cuda") == per_block
    for stage in (0, 1):
        sizes = [b.numel for b in _default_layout(model, stage, "cuda").buckets]
        assert sizes == [15 * BLOCK, 5 * BLOCK]  # 16 blocks would exceed 2**26
        assert max(sizes) <= DEFAULT_BUCKET_CAP_CUDA


@pytest.mark.parametrize("blocks", [1, 2, 5, 8, 20, 40])
def test_stage_2_on_cuda_holds_less_gradient_than_stage_1(blocks: int) -> None:
    """Stage 2 holds its shards of the gradient (half of it at two ranks) and two or three
    buckets of it while reducing (the leaves of one, its flat copy, the previous one in
    flight); stage 1 holds the whole gradient. Its CUDA cap keeps half the model plus three of
    its largest buckets below the model, except where its smallest cap binds (buckets of at
    most 2**22 elements, 16 MiB in fp32: bytes a GPU does not miss)."""
    from fzero.layout import STAGE2_MIN_CAP_CUDA

    numel = blocks * BLOCK
    sizes = [b.numel for b in _default_layout(_blocks(blocks), 2, "cuda").buckets]
    assert sum(sizes) == numel
    assert 3 * max(sizes) < numel / 2 or max(sizes) <= STAGE2_MIN_CAP_CUDA, (blocks, sizes)
    if numel >= 8 * STAGE2_MIN_CAP_CUDA:  # the eighth binds, not the smallest cap
        assert 3 * max(sizes) < numel / 2, (blocks, sizes)


def test_stage_2_on_cuda_keeps_large_frozen_buckets() -> None:
    """A mostly frozen model (a base with a small trainable head, as in LoRA) at stage 2: the
    eighth of its few trainable elements caps the trainable buckets only; the frozen base stays
    in buckets of up to 2**26 elements (cut by the trainable cap, 2**22, it would make one
    bucket per block here, and a 7B base 1,700, each a fixed cost per step)."""
    layout = _default_layout(_blocks(21, frozen=20), 2, "cuda")
    frozen = [b.numel for b in layout.buckets if not b.trainable]
    trainable = [b.numel for b in layout.buckets if b.trainable]
    assert frozen == [15 * BLOCK, 5 * BLOCK]
    assert sum(trainable) == BLOCK and max(trainable) <= 2**22


def test_init_plans_with_the_policy_default_buckets_names(monkeypatch) -> None:
    """`init`'s wiring of `default_buckets`, on CPU (where the real one names no policy): a
    policy it names is the layout `init` builds, from the layout it was given; given
    ``buckets=``, it is not asked."""
    import fzero.state

    asked = []

    def one_bucket_each(stage, device, planned):
        asked.append((stage, device.type, [b.label for b in planned.buckets]))
        return [list(entry.names) for bucket in planned.buckets for entry in bucket.entries]

    monkeypatch.setattr(fzero.state, "default_buckets", one_bucket_each)

    def body(comm):
        model = TinyGPT()
        state = fzero.init(model, stage=2, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
        given = fzero.init(model, stage=2, optimizer=fzero.optim.sgd(lr=0.1), comm=comm,
                           buckets=10**6)
        return state.layout, given.layout

    [(layout, given)] = fzero.SimWorld(1).run(body)
    model = TinyGPT()
    assert asked == [(2, "cpu", [b.label for b in fzero.plan(model, 1, separate_tied=False)
                                 .buckets])]
    assert layout == fzero.plan(model, 1, buckets=one_bucket_each(2, torch.device("cpu"),
                                                                  fzero.plan(model, 1)))
    assert len(layout.buckets) == len(list(model.parameters()))  # (a tie is one parameter)
    assert given == fzero.plan(model, 1, buckets=10**6, separate_tied=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_init_on_cuda_plans_with_the_default_policy(bare_env, stage: int) -> None:
    """On the GPU `init` (buckets=None) builds the layout `default_buckets` names."""
    from fzero.state import default_buckets

    with fzero.distributed(backend="nccl") as comm:
        model = TinyGPT().cuda()
        state = fzero.init(model, stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm)
    planned = fzero.plan(model, 1, separate_tied=stage == 3)
    policy = default_buckets(stage, torch.device("cuda"), planned)
    expected = planned if policy is None else fzero.plan(model, 1, buckets=policy)
    assert state.layout == expected


@given(worlds_and_trees(work_bound=400), st.sampled_from([0, 1, 2, 3]),
       st.integers(1, 3000), st.integers(1, 64))
def test_default_buckets_properties(world_and_spec, stage: int, cap: int, floor: int) -> None:
    """`default_buckets` on any parameter set (ties, mixed dtypes, frozen and trainable, empty
    and 0-d tensors), with its caps shrunk to the tree's scale: on CUDA at stages 0-2 its
    groups name every parameter once, keep the order of each kind (trainability and dtype, as
    `plan` splits a group), and plan; a bucket of more than one non-empty parameter holds at
    most its kind's cap (stage 2's trainable: an eighth of the trainable elements within [floor,
    cap]). CPU and stage 3: no policy."""
    from unittest import mock

    import fzero.state
    from fzero.state import default_buckets

    world, spec = world_and_spec
    params = spec.build()
    planned = fzero.plan(params, world, separate_tied=stage == 3)
    assert default_buckets(stage, torch.device("cpu"), planned) is None
    with mock.patch.object(fzero.state, "DEFAULT_BUCKET_CAP_CUDA", cap), \
            mock.patch.object(fzero.state, "STAGE2_MIN_CAP_CUDA", min(floor, cap)):
        groups = default_buckets(stage, torch.device("cuda"), planned)
        if stage == 3:
            assert groups is None
            return
        names = [name for bucket in planned.buckets for name in bucket.names]
        assert sorted(name for group in groups for name in group) == sorted(names)
        layout = fzero.plan(params, world, buckets=groups)
        kinds = {(b.trainable, b.dtype) for b in planned.buckets}
        for kind in kinds:
            order = [[e.name for b in lay.buckets if (b.trainable, b.dtype) == kind
                      for e in b.entries] for lay in (planned, layout)]
            assert order[0] == order[1], kind
        trainable = sum(b.numel for b in planned.buckets if b.trainable)
        trainable_cap = cap if stage < 2 else min(cap, max(min(floor, cap), -(-trainable // 8)))
        for bucket in layout.buckets:  # (one parameter larger than a cap has it to itself)
            if sum(1 for entry in bucket.entries if entry.numel) > 1:
                assert bucket.numel <= (trainable_cap if bucket.trainable else cap), bucket
