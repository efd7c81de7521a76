"""Tensors a module keeps that share memory with a parameter or buffer without being it.

In torch a view, ``.detach()`` or ``.data`` of a parameter or buffer follows its updates; a
state keeps parameters in flat buckets and each buffer as a tensor of its own, so such an
alias kept in the module (a registered buffer, a plain attribute, a list of them) would hold
its initial values for ever. A probe found three (a buffer viewing another buffer, a
stop-gradient buffer ``w.detach()``, a detached weight kept as an attribute): each trained
silently wrong at every stage. `fzero.init` and `fzero.load` now raise, naming both tensors
(`fzero.bound.check_shared_memory`); one tensor under two names (ties, shared buffers, Hugging
Face's ``original_inv_freq``) and the attribute a hook-based reparametrization recomputes
before every forward stay allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fzero


def _linear() -> nn.Linear:
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(4, 3)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return layer


class BufferView(nn.Module):
    """A buffer registered as a view of another (`head` = ``stats[:3]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear()
        self.register_buffer("stats", torch.zeros(6))
        self.sub = nn.Module()
        self.sub.register_buffer("head", self.stats[:3])

    def forward(self, x: Tensor) -> Tensor:
        self.stats.add_(1)
        return self.lin(x) * self.sub.head


class StopGradientBuffer(nn.Module):
    """A buffer over a parameter's memory (a stop-gradient copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear()
        self.register_buffer("w_sg", self.lin.weight.detach())

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + x @ self.w_sg.t()


class DetachedAttribute(nn.Module):
    """A detached weight kept as a plain attribute, directly or in a container."""

    def __init__(self, container: str) -> None:
        super().__init__()
        self.lin = _linear()
        alias = self.lin.weight.detach()
        self.kept = {"plain": alias, "list": [alias], "dict": {"w": alias}}[container]

    def forward(self, x: Tensor) -> Tensor:
        kept = self.kept if isinstance(self.kept, Tensor) else (
            self.kept[0] if isinstance(self.kept, list) else self.kept["w"])
        return self.lin(x) + x @ kept.t()


class ParameterOverBuffer(nn.Module):
    """A parameter made from a buffer, sharing its memory."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("base", torch.ones(3))
        self.scale = nn.Parameter(self.base)

    def forward(self, x: Tensor) -> Tensor:
        return x[:, :3] * self.scale + self.base


def _init(comm: Any, model: nn.Module, stage: int) -> fzero.ShardState:
    return fzero.init(model, stage=stage, comm=comm, optimizer=fzero.optim.sgd(lr=0.1))


def _raised(fn: Callable[..., Any], *args: Any) -> str:
    with pytest.raises(fzero.SimWorldError) as error:
        fzero.SimWorld(1, copy_args=False).run(fn, *args)  # a copy would break the alias
    return str(error.value)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize(("build", "names"), [
    (BufferView, ("buffer 'sub.head'", "buffer 'stats'")),
    (StopGradientBuffer, ("parameter 'lin.weight'", "buffer 'w_sg'")),
    (lambda: DetachedAttribute("plain"), ("parameter 'lin.weight'", "attribute 'kept'")),
    (lambda: DetachedAttribute("list"), ("parameter 'lin.weight'", "attribute 'kept[0]'")),
    (lambda: DetachedAttribute("dict"), ("parameter 'lin.weight'", "attribute \"kept['w']\"")),
    (ParameterOverBuffer, ("parameter 'scale'", "buffer 'base'")),
], ids=["buffer-view", "stop-gradient-buffer", "attribute", "list", "dict", "param-over-buffer"])
def test_init_refuses_an_alias_that_would_go_stale(build: Callable[[], nn.Module],
                                                   names: tuple[str, str], stage: int) -> None:
    message = _raised(_init, build(), stage)
    assert "share memory without being one tensor" in message
    for name in names:
        assert name in message, (name, message)


class ParameterAsBuffer(nn.Module):
    """A parameter also registered as a buffer (one tensor object under both kinds of name),
    read through the buffer's name: torch's buffer is the parameter, so it trains; the state
    kept a copy of it as a buffer, which neither trained nor passed a gradient (a probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear()
        self.head = nn.Module()
        self.head.register_buffer("shadow", self.lin.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.head.shadow.t() + self.lin.bias


@pytest.mark.parametrize("stage", [0, 3])
def test_init_refuses_a_parameter_registered_as_a_buffer_too(stage: int) -> None:
    message = _raised(_init, ParameterAsBuffer(), stage)
    assert "buffer 'head.shadow' is parameter 'lin.weight'" in message, message
    frozen = ParameterAsBuffer()  # never changes: the buffer's copy stays equal (a review)
    frozen.lin.weight.requires_grad_(False)
    fzero.SimWorld(1, copy_args=False).run(_init, frozen, stage)


class SameTensorTwice(nn.Module):
    """One buffer object kept again as a plain attribute (Hugging Face's rotary embedding keeps
    ``original_inv_freq = inv_freq``), and a tied weight: the same tensors, never stale."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _linear(), _linear()
        self.b.weight = self.a.weight
        self.register_buffer("inv_freq", torch.arange(3.0), persistent=False)
        self.original_inv_freq = self.inv_freq

    def forward(self, x: Tensor) -> Tensor:
        return self.b(x) + self.a(x) * self.inv_freq


@pytest.mark.parametrize("build", [
    SameTensorTwice,
    lambda: nn.utils.spectral_norm(_linear()),   # `weight` views weight_orig until forward
    lambda: nn.utils.weight_norm(_linear()),
], ids=["same-tensor", "spectral-norm", "weight-norm"])
@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_aliases_that_cannot_go_stale_train(build: Callable[[], nn.Module]) -> None:
    """The same tensor object under two names, and the attribute a hook-based
    reparametrization recomputes before every forward: a state builds and steps."""
    def body(comm: Any, model: nn.Module) -> float:
        state = _init(comm, model, 1)
        step = fzero.make_train_step(model, lambda call, x: call(x).pow(2).mean())
        state, metrics = step(state, torch.ones(2, 4))
        return metrics["loss"]
    (loss,) = fzero.SimWorld(1, copy_args=False).run(body, build())
    assert loss > 0


def test_load_into_a_module_with_such_an_alias_raises(tmp_path) -> None:
    """`fzero.load` reads the values into the state, never into the module's alias: it
    refuses such a module too."""
    path = str(tmp_path / "ckpt")

    def save(comm: Any) -> None:
        fzero.save(_init(comm, nn.Sequential(_linear()), 1), path)

    def load(comm: Any, model: nn.Module) -> None:
        fzero.load(path, model=model, comm=comm)

    fzero.SimWorld(1).run(save)
    model = nn.Sequential(_linear())
    model.w_sg = model[0].weight.detach()
    message = _raised(load, model)
    assert "parameter '0.weight' and attribute 'w_sg' share memory" in message
