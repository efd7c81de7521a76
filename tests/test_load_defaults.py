"""What `fzero.load` takes by default when the model or the arguments differ from the save.

Each test resumes a checkpoint and compares the continued run with single-process
``torch.optim`` training in float64 from the saved values, or checks what the state holds: a
tied tensor's own optimizer step count after its tie was undone or renamed, the saved dtypes
whatever the skeleton's dtype and bucket policy, and a master copy at least as wide as the
parameters a load asks for (as `fzero.init` makes it). Each was silently wrong before (a
probe found them): a wrong Adam bias correction, a float64 run continued in float32, a
float64 run rounded to a float32 master at every update. And one buffer under two names,
which a ``meta`` skeleton holds as two tensors: the load and the offline tools raised,
taking it for another model.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

import fzero
from fzero.checkpoint import CheckpointError

OPT = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.0}
SAVED_AT, MORE = 3, 3


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _batches(count: int, rows: int = 8, width: int = 5, out: int = 3) -> list[tuple[Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, width, generator=gen, dtype=torch.float64),
             torch.randn(rows, out, generator=gen, dtype=torch.float64)) for _ in range(count)]


def _part(batch: tuple[Tensor, ...], rank: int, world: int) -> tuple[Tensor, ...]:
    rows = batch[0].shape[0] // world
    return tuple(t[rank * rows:(rank + 1) * rows] for t in batch)


# --- a tied tensor's own step count --------------------------------------------------------


class Branch(nn.Module):
    """A base layer and a tied pair (``b.weight`` is ``a.weight`` when `tied`) in a branch
    the first steps skip, so the tied tensor has taken fewer optimizer steps than the rest
    (fzero keeps per-parameter counts, as torch.optim skips a parameter whose grad is None).
    With `b_first` the tie's first registered name is ``b.weight``."""

    def __init__(self, tied: bool = True, b_first: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)  # SimWorld's ranks share torch's global one
        layers = {name: nn.Linear(4, 4, bias=name == "base", dtype=torch.float64)
                  for name in ("base", "a", "b")}
        with torch.no_grad():
            for layer in layers.values():
                for param in layer.parameters():
                    param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64))
        for name in ("b", "base", "a") if b_first else ("base", "a", "b"):
            setattr(self, name, layers[name])
        if tied:
            if b_first:
                self.a.weight = self.b.weight
            else:
                self.b.weight = self.a.weight

    def forward(self, x: Tensor, use: Tensor) -> Tensor:
        h = torch.tanh(self.base(x))
        if bool(use.any()):
            h = h + self.b(torch.tanh(self.a(h)))
        return h


def _branch_batches() -> list[tuple[Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=gen, dtype=torch.float64),
             torch.randn(4, 4, generator=gen, dtype=torch.float64),
             torch.full((4,), float(use))) for use in (0, 0, 1, 1, 1, 1)]


def _branch_loss(call: Any, batch: tuple[Tensor, ...]) -> Tensor:
    x, y, use = batch
    return F.mse_loss(call(x, use), y)


def _save_branch(comm: Any, model: nn.Module, path: str, stage: int) -> None:
    state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.adamw(**OPT))
    step = fzero.make_train_step(model, _branch_loss)
    for batch in _branch_batches()[:SAVED_AT]:
        state, _ = step(state, batch)
    fzero.save(state, path)


def _resume_branch(comm: Any, model: nn.Module, path: str, kwargs: dict[str, Any]) -> Any:
    state = fzero.load(path, model=model, comm=comm, **kwargs)
    step = fzero.make_train_step(model, _branch_loss)
    for batch in _branch_batches()[SAVED_AT:]:
        state, _ = step(state, batch)
    return fzero.full_params(state)


def _torch_branch(untie: bool) -> dict[str, Tensor]:
    """The run in torch: tied for `SAVED_AT` steps, then (`untie`) ``b.weight`` a copy of
    ``a.weight`` with a copy of its optimizer state, including its own step count."""
    model = Branch()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    batches = _branch_batches()
    for index, batch in enumerate(batches):
        if index == SAVED_AT and untie:
            model.b.weight = nn.Parameter(model.a.weight.detach().clone())
            old = opt
            opt = torch.optim.AdamW(model.parameters(), **OPT)
            for param in model.parameters():
                source = model.a.weight if param is model.b.weight else param
                opt.state[param] = {k: v.clone() for k, v in old.state[source].items()}
        opt.zero_grad(set_to_none=True)
        _branch_loss(model, batch).backward()
        opt.step()
    assert int(opt.state[model.a.weight]["step"]) == len(batches) - 2  # it skipped two
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize(("target", "kwargs", "untie"), [
    ("untied", {}, True),                         # a tie the model no longer has
    ("b_first", {"buckets": 8}, False),           # the tie's first name changed, re-planned
    ("b_first", {}, False),
])
def test_a_tied_tensor_keeps_its_own_step_count(stage: int, target: str,
                                                kwargs: dict[str, Any], untie: bool,
                                                tmp_path) -> None:
    """A checkpoint keys each per-parameter step count by the tensor's first name; a load
    whose layout named the tensor otherwise (untied: ``b.weight`` is a tensor of its own; the
    tie registered ``b`` first) gave it the global count, or dropped every count, and Adam's
    bias correction was wrong (6e-3 after three steps). Now each name finds its tensor's
    count, and the run equals torch's."""
    path = str(tmp_path / "ckpt")
    fzero.SimWorld(2).run(_save_branch, Branch(), path, stage)
    model = Branch(tied=False) if target == "untied" else Branch(b_first=True)
    want = _torch_branch(untie)
    for got in fzero.SimWorld(2).run(_resume_branch, model, path, kwargs):
        for name, value in want.items():
            assert _rel(got[name], value) < 1e-12, (name, _rel(got[name], value))


# --- dtypes as saved ----------------------------------------------------------------------


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.5)
    return model


def _mlp_loss(call: Any, batch: tuple[Tensor, ...]) -> Tensor:
    x, y = batch
    return F.mse_loss(call(x).double(), y)


def _save_mlp(comm: Any, model: nn.Module, path: str) -> dict[str, Any]:
    """`SAVED_AT` AdamW steps in the model's dtype, then a save; the full parameters and
    moments saved."""
    dtype = next(model.parameters()).dtype
    state = fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.adamw(**OPT))
    step = fzero.make_train_step(model, lambda call, b: _mlp_loss(call, (b[0].to(dtype), b[1])))
    for batch in _batches(SAVED_AT):
        state, _ = step(state, _part(batch, comm.rank, comm.world_size))
    fzero.save(state, path)
    # The moments, gathered as a master copy would be (they are laid out like it).
    moments = {name: fzero.full_params(dataclasses.replace(state, master=values), master=True)
               for name, values in state.moments.items()}
    return {"params": fzero.full_params(state, master=True), "moments": moments}


def _resume_mlp(comm: Any, model: nn.Module, path: str, kwargs: dict[str, Any]) -> Any:
    state = fzero.load(path, model=model, comm=comm, **kwargs)
    dtypes = {p.dtype for p in state.params}
    masters = {m.dtype for m in state.master if m is not None}
    dtype = next(iter(dtypes))
    step = fzero.make_train_step(model, lambda call, b: _mlp_loss(call, (b[0].to(dtype), b[1])))
    for batch in _batches(SAVED_AT + MORE)[SAVED_AT:]:
        state, _ = step(state, _part(batch, comm.rank, comm.world_size))
    return {"params": fzero.full_params(state), "dtypes": dtypes, "masters": masters,
            "scaled": state.loss_scale is not None}


def _torch_mlp_from(saved: dict[str, Any]) -> dict[str, Tensor]:
    """Torch AdamW in float64 from the saved values and moments (each exact in float64), for
    `MORE` steps on the same global batches."""
    model = _mlp(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(saved["params"][name])
            opt.state[param] = {"step": torch.tensor(float(SAVED_AT)),
                                "exp_avg": saved["moments"]["exp_avg"][name].double(),
                                "exp_avg_sq": saved["moments"]["exp_avg_sq"][name].double()}
    for batch in _batches(SAVED_AT + MORE)[SAVED_AT:]:
        opt.zero_grad()
        _mlp_loss(model, batch).backward()
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kwargs", [{}, {"buckets": 30}, {"stage": 3, "buckets": 30}])
def test_a_float32_skeleton_resumes_a_float64_run_in_float64(kwargs: dict[str, Any],
                                                             tmp_path) -> None:
    """The model given to load says names and shapes; the dtypes default to the saved ones.
    With another bucket policy the parameters took the skeleton's float32 instead, silently
    (3.5e-8 from the float64 run); now every policy continues in float64, equal to torch."""
    path = str(tmp_path / "ckpt")
    saved = fzero.SimWorld(2).run(_save_mlp, _mlp(torch.float64), path)[0]
    want = _torch_mlp_from(saved)
    for out in fzero.SimWorld(2).run(_resume_mlp, _mlp(), path, kwargs):
        assert out["dtypes"] == {torch.float64}
        for name, value in want.items():
            assert _rel(out["params"][name], value) < 1e-12, name


@pytest.mark.parametrize("kwargs", [
    {}, {"buckets": 30}, {"trainable": lambda name, *_: name != "2.bias"},
])
def test_a_half_skeleton_keeps_a_float32_checkpoint_float32(kwargs: dict[str, Any],
                                                            tmp_path) -> None:
    """A ``half()`` meta skeleton of a float32 checkpoint: float32 parameters and no loss
    scale with every bucket policy and trainable set (it became float16 with a fresh loss
    scale once either differed from the save)."""
    path = str(tmp_path / "ckpt")
    fzero.SimWorld(2).run(_save_mlp, _mlp(), path)
    skeleton = _mlp().half().to("meta")
    kwargs = {**kwargs, "weights_only": "trainable" in kwargs}
    for out in fzero.SimWorld(2).run(_resume_mlp, skeleton, path, kwargs):
        assert out["dtypes"] == {torch.float32} and not out["scaled"]


def test_param_dtype_wider_than_the_saved_master_widens_it(tmp_path) -> None:
    """``load(param_dtype=torch.float64)`` of a float32 checkpoint kept a float32 master copy,
    so every update rounded the float64 parameters to float32 (5.6e-8 from a float64 run);
    as `fzero.init`, the master copy is now at least as wide as the parameters. Equal to
    torch in float64 from the saved values and moments."""
    path = str(tmp_path / "ckpt")
    saved = fzero.SimWorld(2).run(_save_mlp, _mlp(), path)[0]
    want = _torch_mlp_from(saved)
    for out in fzero.SimWorld(2).run(_resume_mlp, _mlp(), path,
                                     {"param_dtype": torch.float64}):
        assert out["dtypes"] == out["masters"] == {torch.float64}
        for name, value in want.items():
            assert _rel(out["params"][name], value) < 1e-12, name


def test_a_master_chosen_narrower_than_its_parameters_stays_so(tmp_path) -> None:
    """The widening is for parameters wider than the save's: a float16 master under float32
    parameters (chosen at init) loads as saved."""
    path = str(tmp_path / "ckpt")

    def save(comm: Any) -> None:
        fzero.save(fzero.init(_mlp(), stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1),
                              master_dtype=torch.float16), path)

    def load(comm: Any) -> set[torch.dtype]:
        state = fzero.load(path, model=_mlp(), comm=comm)
        return {m.dtype for m in state.master if m is not None}

    fzero.SimWorld(2).run(save)
    assert fzero.SimWorld(2).run(load) == [{torch.float16}] * 2


class Mixed(nn.Module):
    """A float64 layer and a float32 one (two buckets)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(4, 4, dtype=torch.float64)
        self.narrow = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.narrow(self.wide(x.double()).float())


def test_one_new_bucket_over_parameters_saved_in_two_dtypes_raises(tmp_path) -> None:
    """A skeleton built in one dtype cannot say which dtype a bucket over parameters saved
    in two should take: the load names the bucket and the way out."""
    path = str(tmp_path / "ckpt")

    def save(comm: Any, model: nn.Module) -> None:
        fzero.save(fzero.init(model, stage=1, comm=comm, optimizer=fzero.optim.sgd(lr=0.1)),
                   path)

    def load(comm: Any, model: nn.Module) -> str:
        with pytest.raises(CheckpointError) as error:
            fzero.load(path, model=model, comm=comm, buckets=[[n for n, _ in
                                                              model.named_parameters()]])
        return str(error.value)

    fzero.SimWorld(1).run(save, Mixed())
    skeleton = copy.deepcopy(Mixed()).float().to("meta")
    (message,) = fzero.SimWorld(1).run(load, skeleton)
    assert "saved in different dtypes" in message and "param_dtype=" in message


# --- one buffer under two names ----------------------------------------------------------


class SharedCount(nn.Module):
    """One buffer tensor registered in two submodules, counted up in place by forward."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen))
        shared = torch.zeros(())
        self.a.register_buffer("count", shared)
        self.b.register_buffer("count", shared)

    def forward(self, x: Tensor) -> Tensor:
        self.a.count.add_(1)
        return self.b(torch.tanh(self.a(x))) * (1 + 0.1 * self.b.count)


def _count_loss(call: Any, x: Tensor) -> Tensor:
    return call(x).pow(2).mean()


def _count_run(comm: Any, path: str, skeleton: nn.Module | None, stage: int) -> Any:
    """Two SGD steps and a save, or (`skeleton`) a load into it; then two more steps."""
    xs = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    model = skeleton if skeleton is not None else SharedCount()
    if skeleton is None:
        state = fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))
    else:
        state = fzero.load(path, model=model, comm=comm, stage=stage)
    step = fzero.make_train_step(model, _count_loss)
    for x in xs[:2] if skeleton is None else ():
        state, _ = step(state, x)
    if skeleton is None:
        fzero.save(state, path)
    for x in xs[2:]:
        state, _ = step(state, x)
    return fzero.full_params(state), {k: v.clone() for k, v in state.buffers.items()}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_shared_buffer_loads_into_a_meta_skeleton(stage: int, tmp_path) -> None:
    """``model.to("meta")`` gives each name of a buffer registered in two submodules its own
    tensor; a load into such a skeleton raised "a checkpoint of another model: buffers only
    in the model" (the checkpoint stores the buffer once), and `consolidate` / `export` with
    the model raised "state_dict keys missing". The manifest now records the buffer's
    aliases: the load continues exactly as the uninterrupted run, and the offline tools give
    every name."""
    path = str(tmp_path / "ckpt")
    want_params, want_buffers = fzero.SimWorld(1).run(_count_run, path, None, stage)[0]
    skeleton = SharedCount().to("meta")
    got_params, got_buffers = fzero.SimWorld(1).run(_count_run, path, skeleton, stage)[0]
    assert got_buffers.keys() == want_buffers.keys() == {"a.count"}
    assert float(got_buffers["a.count"]) == float(want_buffers["a.count"]) == 4.0
    for name, value in want_params.items():
        assert torch.equal(got_params[name], value), name
    merged = fzero.consolidate(path, model=SharedCount())
    assert list(merged) == list(SharedCount().state_dict())
    assert float(merged["a.count"]) == float(merged["b.count"]) == 2.0
    out = tmp_path / "export"
    fzero.checkpoint.export(path, str(out), model=SharedCount())
    exported = load_file(str(out / "model.safetensors"))
    assert float(exported["a.count"]) == float(exported["b.count"]) == 2.0
    SharedCount().load_state_dict(exported, strict=True)
    # without the model: every name too, as consolidate gives them (export dropped "b.count",
    # and the strict load of its file failed: a probe)
    assert float(fzero.consolidate(path)["b.count"]) == 2.0
    fzero.checkpoint.export(path, str(out))
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == fzero.consolidate(path).keys()
    assert float(exported["a.count"]) == float(exported["b.count"]) == 2.0
    SharedCount().load_state_dict(exported, strict=True)
