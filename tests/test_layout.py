"""Pure layout planning: rules, invariants, JSON and fingerprints, bad input."""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fzero
from fzero.layout import ShardLayout, first_overlap
from fzero.testing import TreeSpec, policies, trees, world_sizes, worlds_and_trees


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)


class Net(nn.Module):
    def __init__(self, d: int = 5, depth: int = 3, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.final = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied


@st.composite
def planned(draw):
    world, spec = draw(worlds_and_trees())
    policy = draw(policies(spec))
    return spec, world, policy, fzero.plan(spec.build(), world, buckets=policy)


@given(planned())
def test_every_parameter_is_stored_once_in_order(case):
    spec, world, _, layout = case
    stored = [n for n, t in zip(spec.names, spec.tied_to, strict=True) if t is None]
    planned = [e.name for b in layout.buckets for e in b.entries]
    assert sorted(planned) == sorted(stored) and len(planned) == len(set(planned))
    for bucket in layout.buckets:  # kinds split a group, but each bucket keeps parameter order
        order = [stored.index(e.name) for e in bucket.entries]
        assert order == sorted(order)
    assert sorted(layout.names) == sorted(spec.names)
    owner = {
        n: spec.names[t] if t is not None else n
        for n, t in zip(spec.names, spec.tied_to, strict=True)
    }
    for name, (index, entry) in layout.locate().items():
        assert entry.name == owner[name]
        assert name in layout.buckets[index].names


@given(planned())
def test_bucket_invariants(case):
    spec, world, _, layout = case
    tensors = spec.build()
    assert layout.world_size == world
    for bucket in layout.buckets:
        assert bucket.entries, "no empty buckets"
        assert bucket.world_size == world
        assert bucket.padded_numel % world == 0
        assert 0 <= bucket.padding < world
        assert bucket.padded_numel == bucket.shard_numel * world
        offset = 0
        for entry in bucket.entries:
            tensor = tensors[entry.name]
            assert entry.offset == offset
            assert entry.shape == tuple(tensor.shape)
            assert entry.dtype == bucket.dtype == str(tensor.dtype).removeprefix("torch.")
            assert tensor.requires_grad == bucket.trainable
            offset = entry.end
        assert bucket.numel == offset
        # The rank segments tile the unpadded elements exactly once.
        covered = sum(
            seg.shard_end - seg.shard_start
            for r in range(min(world, 70))
            for seg in bucket.segments(r)
        )
        if world <= 70:
            assert covered == bucket.numel
    assert layout.numel == sum(b.numel for b in layout.buckets)
    assert layout.padded_numel - layout.numel < world * max(1, len(layout.buckets))


@given(planned())
def test_planning_is_deterministic_and_json_round_trips(case):
    spec, world, policy, layout = case
    again = fzero.plan(spec.build(), world, buckets=policy)
    assert again == layout and hash(again) == hash(layout)
    assert again.fingerprint == layout.fingerprint
    restored = ShardLayout.from_json(layout.to_json())
    assert restored == layout and restored.fingerprint == layout.fingerprint
    # What a layout derives once (fingerprint, locate) is not state: a layout that computed
    # them pickles (to other processes), equals and hashes as one that did not.
    located = dict(layout.locate())
    copied = pickle.loads(pickle.dumps(layout))
    assert copied == again and hash(copied) == hash(again)
    assert copied.fingerprint == layout.fingerprint and dict(copied.locate()) == located
    assert dataclasses.replace(layout, world_size=world + 1).fingerprint != layout.fingerprint


@given(trees(max_size=30), world_sizes, st.data())
def test_fingerprint_changes_with_anything_that_defines_the_layout(spec, world, data):
    base = fzero.plan(spec.build(), world)
    tensors = spec.build()
    name = data.draw(st.sampled_from(sorted(tensors)))
    tensor = tensors[name]
    variants = {
        "world": fzero.plan(tensors, world + 1),
        "name": fzero.plan({(k + "_x" if k == name else k): v for k, v in tensors.items()}, world),
        "shape": fzero.plan(
            {**tensors, name: torch.zeros(tensor.numel() + 1, dtype=tensor.dtype)}, world
        ),
        "dtype": fzero.plan(
            {
                **tensors,
                name: tensor.detach().to(
                    torch.float64 if tensor.dtype != torch.float64 else torch.float32
                ),
            },
            world,
        ),
        "order": fzero.plan(dict(reversed(list(tensors.items()))), world),
    }
    for what, other in variants.items():
        if what == "order" and [e.name for b in other.buckets for e in b.entries] == [
            e.name for b in base.buckets for e in b.entries
        ]:
            continue  # one stored entry (or only aliases moved): reversing changes nothing
        assert other.fingerprint != base.fingerprint, what


def test_default_policy_buckets_each_list_element_and_ties_once():
    layout = fzero.plan(Net(), 3, floor=1)
    assert [b.label for b in layout.buckets] == [
        "embed",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "final",
    ]
    embed = layout.buckets[0].entries[0]
    assert embed.name == "embed.weight" and embed.aliases == ("head.weight",)
    assert layout.numel == 11 * 5 + 3 * (5 * 5 + 5 + 5 + 5) + 10


def test_a_tie_is_kept_when_each_name_has_its_own_tensor_object_on_the_same_memory():
    """``state_dict()`` and ``{n: p.detach()}`` give each name of a tied weight its own tensor
    object: planned by object identity alone, the tie became two parameters that a hand-written
    step would train apart (a probe). The same elements in memory are one tensor; views of
    other elements, meta tensors (no memory) and empty ones stay apart."""
    net = Net()
    want = fzero.plan(net, 3, floor=1)
    named = dict(net.named_parameters(remove_duplicate=False))
    detached = {name: p.detach() for name, p in named.items()}
    for params in (net.state_dict(), detached):
        got = fzero.plan(params, 3, floor=1, trainable=lambda name: True)
        assert got.numel == want.numel
        assert [(e.name, e.aliases) for b in got.buckets for e in b.entries] == [
            (e.name, e.aliases) for b in want.buckets for e in b.entries]
    flat = torch.zeros(12)
    apart = {"a": flat[:6].view(2, 3), "b": flat[6:].view(2, 3),
             "d": torch.zeros(3, 4)[:, 3]}
    assert fzero.plan(apart, 2).numel == 15  # other elements of one storage
    # the same elements shaped apart, a partial overlap, a strided view across others' spans
    for name, other in (("c", flat[:6].view(3, 2)), ("e", flat[5:7]),
                        ("f", flat.view(3, 4)[:, 3])):
        with pytest.raises(ValueError, match=f"parameters '.' and '{name}' share memory but are "
                                             f"not one tensor"):
            fzero.plan({**apart, name: other}, 2)
    net.head.weight = nn.Parameter(net.embed.weight.detach())  # two parameters, one memory:
    with pytest.raises(ValueError, match="'embed.weight' and 'head.weight' share memory"):
        fzero.plan(net, 3)  # torch would update the memory twice, once per parameter
    with torch.device("meta"):
        meta = {"a": torch.zeros(4), "b": torch.zeros(4)}
    assert fzero.plan(meta, 2).numel == 8
    empty = torch.zeros(0)
    assert [e.name for b in fzero.plan({"a": empty, "b": empty.view(0)}, 2).buckets
            for e in b.entries] == ["a", "b"]


@st.composite
def views_of_one_storage(draw):
    """2-4 views of one 24-element storage: a contiguous slice or a strided one each."""
    views = []
    for _ in range(draw(st.integers(2, 4))):
        start = draw(st.integers(0, 23))
        step = draw(st.integers(1, 3))
        count = draw(st.integers(0, (23 - start) // step + 1))
        views.append((start, step, count))
    return views


@given(views_of_one_storage())
def test_first_overlap_never_misses_a_shared_element(views):
    """`first_overlap` (plan's and the optimizer's check) finds every pair of views sharing
    an element, and between contiguous views finds only those: its one approximation is a
    strided view's span."""
    storage = torch.zeros(24)
    tensors = [(f"v{k}", storage[start::step][:count]) for k, (start, step, count) in
               enumerate(views)]
    elements = [set(range(start, start + step * count, step)) for start, step, count in views]
    shared = any(elements[a] & elements[b] for a in range(len(views))
                 for b in range(a + 1, len(views)))
    found = first_overlap(tensors)
    if shared:
        assert found is not None
    elif all(step == 1 or count <= 1 for _, step, count in views):
        assert found is None
    if found is not None:  # two labels of views whose spans meet
        assert found[0] != found[1]


def test_default_policy_merges_small_blocks_up_to_the_floor():
    net = Net()  # blocks of 40 elements, the final norm 10, the tied embedding 55
    assert [(b.label, b.numel) for b in fzero.plan(net, 3).buckets] == [
        ("embed", 55), ("blocks.0..final", 130)]  # tied: alone (used first and last)
    assert [(b.label, b.numel) for b in fzero.plan(net, 3, floor=41).buckets] == [
        ("embed", 55), ("blocks.0..blocks.1", 80), ("blocks.2..final", 50)]  # 80 >= 41: shut
    assert [(b.label, b.numel) for b in fzero.plan(net, 3, floor=40).buckets] == [
        ("embed", 55), ("blocks.0", 40), ("blocks.1", 40), ("blocks.2..final", 50)]  # norm: 10
    assert fzero.plan(net, 3, floor=1) == fzero.plan(net, 3, buckets=Block)
    assert fzero.plan(net, 3, buckets=Block, floor=10**9) == fzero.plan(net, 3, buckets=Block)


def test_a_deep_model_of_small_blocks_gets_buckets_of_about_the_floor():
    """Shrunk from a probe: a block under the floor joined the bucket before it whatever that
    bucket held, so 200 blocks of 490,700 elements were one bucket of 98M (stage 3 gathered the
    whole model at once, 6x the cap)."""
    with torch.device("meta"):
        deep = nn.Sequential(*[nn.Linear(700, 700) for _ in range(200)])
    sizes = [b.numel for b in fzero.plan(deep, 8).buckets]
    assert sizes[:-1] == [3 * 490_700] * 65 and sizes[-1] == 5 * 490_700  # the last 2 join
    assert sum(sizes) == 200 * 490_700


def test_a_bucket_s_label_names_the_modules_it_holds():
    """A group of parameters outside any block took its first parameter's module as its label,
    and kept it when split by kind: a frozen teacher's bucket was labelled
    ``student[frozen,float64]`` and errors named the wrong module (a probe)."""
    student, teacher = nn.Linear(3, 3), nn.Linear(3, 3).double().requires_grad_(False)
    model = nn.ModuleDict({"student": student, "teacher": teacher})
    assert [b.label for b in fzero.plan(model, 2, floor=1).buckets] == [
        "student[trainable,float32]", "teacher[frozen,float64]"]
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    assert [b.label for b in fzero.plan(model, 2).buckets] == ["a..b"]  # one group, two modules
    assert [b.label for b in fzero.plan(model, 2, buckets=3).buckets] == [
        "a", "a", "b", "b"]  # weights alone under the cap, each bias alone


def test_a_tied_group_merges_only_when_not_kept_separate():
    net = Net()  # the tied embedding (55) comes first: merged, it joins the blocks after it
    assert [(b.label, b.numel) for b in fzero.plan(net, 3, separate_tied=False).buckets] == [
        ("embed..final", 185)]
    # floor=1 merges nothing, tied or not
    assert fzero.plan(net, 3, floor=1, separate_tied=False) == fzero.plan(net, 3, floor=1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_init_keeps_the_tied_group_apart_in_stage_3_only(stage):
    """Stage 3 gathers a bucket at each use: a tied embedding beside the first block would
    gather the block again for the output head. Stages 0-2 merge it (fewer collectives)."""
    (labels,) = fzero.SimWorld(1).run(lambda comm: [b.label for b in fzero.init(
        Net(), stage=stage, optimizer=fzero.optim.sgd(lr=0.1), comm=comm).layout.buckets])
    assert labels == (["embed", "blocks.0..final"] if stage == 3 else ["embed..final"])


def test_a_merged_bucket_names_both_ends_even_when_they_share_a_label():
    """Shrunk from the property below: groups "h.0", "b", "h.0" merged into one bucket were
    labelled "h.0", as if the bucket held only h.0."""
    params = {name: torch.zeros((), dtype=torch.int64) for name in ("h.0.x", "b", "h.0.y")}
    frozen = lambda name: False  # noqa: E731
    assert [b.label for b in fzero.plan(params, 2, floor=1, trainable=frozen).buckets] == [
        "h.0", "b", "h.0"]
    assert [b.label for b in fzero.plan(params, 2, floor=2, trainable=frozen).buckets] == [
        "h.0..h.0"]


@given(worlds_and_trees(), st.integers(1, 300), st.booleans())
def test_the_floor_merges_consecutive_groups_of_one_kind(case, floor, separate_tied):
    world, spec = case
    params = spec.build()
    blocks = fzero.plan(params, world, floor=1)
    merged = fzero.plan(params, world, floor=floor, separate_tied=separate_tied)
    parts = iter(blocks.buckets)
    for bucket in merged.buckets:  # each bucket: consecutive per-block buckets of its kind
        run = [next(parts)]
        while sum(len(b.entries) for b in run) < len(bucket.entries):
            run.append(next(parts))
        assert [e.name for b in run for e in b.entries] == [e.name for e in bucket.entries]
        assert {(b.trainable, b.dtype) for b in run} == {(bucket.trainable, bucket.dtype)}
        if len(run) > 1 and separate_tied:
            assert not any(e.aliases for e in bucket.entries)
            assert bucket.label == f"{run[0].label}..{run[-1].label}"
        sizes = [b.numel for b in run]  # bounded: one group, under `floor` on each side
        assert any(sum(sizes[:j]) < floor and sum(sizes[j + 1:]) < floor
                   for j in range(len(run))), (floor, sizes)
    assert next(parts, None) is None

    def mergeable(bucket):  # its group had one kind (and no tie, if kept separate)
        return "[" not in bucket.label and not (
            separate_tied and any(e.aliases for e in bucket.entries))

    if floor == 1:  # merges nothing, not even empty groups
        assert merged == blocks
        return
    for a, b in zip(merged.buckets, merged.buckets[1:], strict=False):
        if mergeable(a) and mergeable(b) and (a.trainable, a.dtype) == (b.trainable, b.dtype):
            assert a.numel >= floor and b.numel >= floor  # else they would be one bucket


def test_module_class_and_predicate_policies():
    net = Net()
    by_class = fzero.plan(net, 2, buckets=Block)
    by_pred = fzero.plan(net, 2, buckets=lambda m: isinstance(m, Block))
    assert by_class == by_pred
    assert [b.label for b in by_class.buckets] == [
        "embed",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "final",
    ]
    per_linear = fzero.plan(net, 2, buckets=nn.Linear)
    assert [b.label for b in per_linear.buckets][:3] == ["embed", "blocks.0.attn", "blocks.0.norm"]


def test_size_cap_groups_in_order():
    params = {f"p{i}": torch.zeros(10) for i in range(7)}
    layout = fzero.plan(params, 4, buckets=25)
    assert [b.numel for b in layout.buckets] == [20, 20, 20, 10]
    big = fzero.plan(
        {"a": torch.zeros(3), "b": torch.zeros(100), "c": torch.zeros(3)}, 2, buckets=10
    )
    assert [b.numel for b in big.buckets] == [3, 100, 3]


def test_frozen_and_dtype_never_share_a_bucket():
    params = {
        "a": torch.zeros(3, requires_grad=True),
        "b": torch.zeros(3),
        "c": torch.zeros(3, dtype=torch.bfloat16, requires_grad=True),
        "d": torch.zeros(3, requires_grad=True),
        "steps": torch.zeros(2, dtype=torch.int64),
    }
    layout = fzero.plan(params, 2, buckets=[list(params)])
    kinds = [(b.trainable, b.dtype, [e.name for e in b.entries]) for b in layout.buckets]
    assert kinds == [
        (True, "float32", ["a", "d"]),
        (False, "float32", ["b"]),
        (True, "bfloat16", ["c"]),
        (False, "int64", ["steps"]),
    ]


def test_trainable_mask_forms_agree():
    net = Net()
    wanted = {"blocks.1.attn.weight", "blocks.1.attn.bias"}
    as_set = fzero.plan(net, 2, trainable=wanted)
    as_pred = fzero.plan(net, 2, trainable=lambda n: n in wanted)
    as_map = fzero.plan(net, 2, trainable={n: n in wanted for n, _ in net.named_parameters()})
    assert as_set == as_pred == as_map
    trained = {e.name for b in as_set.buckets if b.trainable for e in b.entries}
    assert trained == wanted


def test_alias_carries_the_trainable_flag_of_its_owner():
    layout = fzero.plan(Net(), 2, trainable={"head.weight"})
    assert [b.trainable for b in layout.buckets if "embed.weight" in b.names] == [True]


def test_a_predicate_that_names_every_name_of_a_tie_trains_it():
    layout = fzero.plan(Net(), 2, trainable=lambda n: n in ("embed.weight", "head.weight"))
    assert [b.trainable for b in layout.buckets if "embed.weight" in b.names] == [True]


@pytest.mark.parametrize(("mask", "given"), [
    # "train the head" (lm_head.* on a GPT whose head is its embedding): asked about every
    # name, not only the first, the predicate does not say what the tensor does
    (lambda n: n.startswith("head."), "{'embed.weight': False, 'head.weight': True}"),
    (lambda n: not n.startswith("head."), "{'embed.weight': True, 'head.weight': False}"),
    ({"embed.weight": True, "head.weight": False}, "{'embed.weight': True, 'head.weight': False}"),
])
def test_names_of_one_tied_tensor_given_different_flags_raise(mask, given):
    with pytest.raises(ValueError) as info:
        fzero.plan(Net(), 2, trainable=mask)
    assert f"trainable= gives the names of one tied tensor different flags, {given}" in str(
        info.value)


def test_numel_beyond_int32_is_exact():
    with torch.device("meta"):
        params = {"huge": torch.empty(3, 2**31 + 7), "tail": torch.empty(5)}
    layout = fzero.plan(params, 1000, buckets=[["huge", "tail"]])
    bucket = layout.buckets[0]
    assert bucket.numel == 3 * (2**31 + 7) + 5
    assert bucket.padded_numel % 1000 == 0 and bucket.padding < 1000
    assert bucket.segments(999)[-1].entry.name == "tail"


def test_meta_model_plans_like_a_real_one():
    with torch.device("meta"):
        meta = Net()
    assert fzero.plan(meta, 4) == fzero.plan(Net(), 4)


def test_with_world_size_keeps_buckets():
    layout = fzero.plan(Net(), 3)
    other = layout.with_world_size(4)
    assert other == fzero.plan(Net(), 4)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [0, -1, 1.5, True])
def test_world_size_must_be_positive_int(world):
    with pytest.raises(ValueError, match="world_size"):
        fzero.plan({"a": torch.zeros(2)}, world)


def test_non_tensor_leaf_is_named():
    with pytest.raises(TypeError, match="'blocks.w'.*list"):
        fzero.plan({"blocks": {"w": [1.0, 2.0]}}, 2)


def test_trainable_integer_parameter_is_named():
    with pytest.raises(ValueError, match="'count'.*int64"):
        fzero.plan({"count": torch.zeros(2, dtype=torch.int64)}, 2, trainable={"count"})


def test_explicit_buckets_must_cover_every_parameter_once():
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match="no bucket for parameters \\['b'\\]"):
        fzero.plan(params, 2, buckets=[["a"]])
    with pytest.raises(ValueError, match="'a' is in buckets\\[0\\] and buckets\\[1\\]"):
        fzero.plan(params, 2, buckets=[["a", "b"], ["a"]])
    with pytest.raises(ValueError, match="unknown parameter 'zz'"):
        fzero.plan(params, 2, buckets=[["a", "b", "zz"]])


def test_a_layouts_own_bucket_names_plan_it_again_and_a_tie_split_apart_is_named():
    """``Bucket.names`` lists every name of a tie; fed back as ``buckets=`` (a probe) it said
    "'head.weight' is in buckets[0] and buckets[0]". Both names of one tie in one bucket are
    one parameter; in two buckets, the message names the tie."""
    model = Net()
    layout = fzero.plan(model, 3, floor=1)
    again = fzero.plan(model, 3, buckets=[list(b.names) for b in layout.buckets])
    assert [b.entries for b in again.buckets] == [b.entries for b in layout.buckets]
    rest = [n for n, _ in model.named_parameters() if n != "embed.weight"]
    with pytest.raises(ValueError, match="'head.weight' is in buckets\\[1\\], but it is tied "
                                         "to 'embed.weight' \\(one tensor\\) in buckets\\[0\\]"):
        fzero.plan(model, 3, buckets=[["embed.weight"], rest + ["head.weight"]])
    with pytest.raises(ValueError, match="'embed.weight' is in buckets\\[0\\] and buckets\\[0\\]"):
        fzero.plan(model, 3, buckets=[["embed.weight", "embed.weight", *rest]])


def test_module_policy_needs_a_module():
    with pytest.raises(TypeError, match="plan\\(model"):
        fzero.plan({"a": torch.zeros(2)}, 2, buckets=nn.Linear)


def test_unknown_trainable_names_are_reported():
    with pytest.raises(ValueError, match="unknown parameters: \\['nope'\\]"):
        fzero.plan({"a": torch.zeros(2)}, 2, trainable={"nope"})


def test_json_from_another_version_or_format_is_rejected():
    text = fzero.plan({"a": torch.zeros(2)}, 2).to_json()
    with pytest.raises(ValueError, match="version 99 is not supported"):
        ShardLayout.from_json(text.replace('"version": 1', '"version": 99'))
    with pytest.raises(ValueError, match="not an fzero layout"):
        ShardLayout.from_json('{"format": "something else"}')
    with pytest.raises(ValueError, match="does not parse"):
        ShardLayout.from_json("{")


def test_rank_out_of_range():
    bucket = fzero.plan({"a": torch.zeros(5)}, 2).buckets[0]
    with pytest.raises(ValueError, match="rank must be an int in \\[0, 2\\)"):
        bucket.segments(2)


def test_layout_is_frozen():
    layout = fzero.plan({"a": torch.zeros(5)}, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.world_size = 3  # type: ignore[misc]


def test_tree_spec_builds_aliases_as_the_same_tensor():
    spec = TreeSpec(
        ("a", "b"), ((2,), (2,)), (torch.float32, torch.float32), (True, True), (None, 0), seed=0
    )
    tensors = spec.build()
    assert tensors["a"] is tensors["b"]


@pytest.mark.parametrize("view", [torch.Tensor.conj, torch._neg_view], ids=["conj", "neg"])
def test_a_conjugate_or_negative_view_of_another_name_is_not_a_tie(view: Callable) -> None:
    """Same memory, shape and strides, other values: `plan` took `z.conj()` for a tie of `z`
    and every function returned `z`'s values under its name, silently (a probe). It raises,
    as for any two names that share memory without being one tensor."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    with pytest.raises(ValueError, match="'a' and 'b' share memory but are not one tensor"):
        fzero.plan({"a": z, "b": view(z)}, 2)


def _edited_layout(edit: Callable[[dict], object]) -> str:
    layout = fzero.plan({"a": torch.randn(3, requires_grad=True), "b": torch.randn(2, 2)}, 2,
                        buckets=1)
    doc = json.loads(layout.to_json())
    edit(doc)
    return json.dumps(doc)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(world_size=0), "world_size must be an int >= 1, got world_size=0"),
    (lambda d: d.update(world_size="2"), "world_size must be an int >= 1"),
    (lambda d: d.update(world_size=True), "world_size must be an int >= 1"),
    (lambda d: d["buckets"][1].update(trainable="no"), "trainable must be true or false"),
    (lambda d: d["buckets"][0].update(dtype="int64"), "is trainable but of dtype int64"),
    (lambda d: d["buckets"][0]["entries"][0].__setitem__(3, ["a"]), "names parameter 'a' twice"),
    (lambda d: d.pop("buckets"), "malformed layout JSON: KeyError: 'buckets'"),
    # took silently (a probe): aliases "xy" as two names, a float size, a name not a string
    (lambda d: d["buckets"][0]["entries"][0].__setitem__(3, "xy"),
     "entry 'a': aliases must be a list of names, got 'xy'"),
    (lambda d: d["buckets"][0]["entries"][0].__setitem__(1, [1.5]),
     r"entry 'a': shape must be a list of sizes, got \[1.5\]"),
    (lambda d: d["buckets"][1]["entries"][0].__setitem__(2, 1.5),
     "entry 'b': offset must be a whole number, got 1.5"),
    (lambda d: d["buckets"][0]["entries"][0].__setitem__(0, 5),
     "an entry's name must be a string, got 5"),
    (lambda d: d["buckets"][0].update(label=7), "a bucket label must be a string, got 7"),
], ids=["world 0", "world str", "world bool", "trainable str", "trainable int", "self alias",
        "no buckets", "aliases a str", "float size", "float offset", "int name", "int label"])
def test_from_json_refuses_a_layout_plan_cannot_make(edit: Callable[[dict], object],
                                                     message: str) -> None:
    """`from_json` took these (a probe): they failed later, far from the JSON (a division by
    zero), or not at all (a truthy string read as trainable)."""
    with pytest.raises(ValueError, match=message):
        fzero.ShardLayout.from_json(_edited_layout(edit))
