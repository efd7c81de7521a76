"""Functional optimizers over flat shards: optax-style ``(init, update)`` pairs.

An `Optimizer` is two closures over its hyperparameters. ``init(params)`` returns the moments, a
plain ``dict`` of name -> tuple of tensors (one per parameter tensor, same dtype, device and
shape); ``update(grads, moments, params, step=...)`` applies one step **in place** to ``params``
and ``moments`` and returns ``None``. In fzero the tensors are the flat 1-D shards of a rank's
buckets, so every list has one tensor per bucket and each op below is one ``torch._foreach_*``
call over all buckets.

The arithmetic is torch.optim's, op for op (``_multi_tensor_adam`` / ``_multi_tensor_sgd``, which
on CPU are the same per-tensor ops as the single-tensor loop), so results match
`torch.optim.AdamW`, `torch.optim.Adam` and `torch.optim.SGD` bitwise on the same tensors.

[Note: in-place contract]
``params`` and ``moments`` are donated: they are overwritten, never copied, so optimizer memory
never doubles. ``grads`` are scratch: Adam's and SGD's L2 weight decay and SGD's Nesterov
momentum are added into them in place (torch.optim's foreach path does the same to ``p.grad``).
Pass a copy if you need the gradients afterwards. Temporaries: none the size of ``params``; Adam
computes its denominator in the gradients' storage, where torch's foreach Adam allocates one.

[Note: weight-decay ranges]
``decay[i]`` lists half-open ``(start, end)`` element ranges of ``params[i]`` (flattened) that get
weight decay; ``None`` decays every element. The train step derives them from the layout so that
biases and norm weights are not decayed, the same split torch users make with two param groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from fzero.layout import first_overlap

__all__ = [
    "DecayRanges",
    "InitFn",
    "Moments",
    "Optimizer",
    "OptimizerSpec",
    "Schedule",
    "UpdateFn",
    "adam",
    "adamw",
    "clip_coefficient",
    "constant_schedule",
    "cosine_schedule",
    "from_spec",
    "sgd",
]

Schedule = Callable[[int], float]
"""A learning rate as a function of the 1-based step: the number of the update it computes, so
a step skipped for a non-finite gradient (fp16 loss scaling) does not advance it (a torch loop
that calls ``scheduler.step()`` every iteration runs one step ahead after each skip)."""
Moments = dict[str, tuple[Tensor, ...]]
"""Optimizer state: name -> one tensor per parameter tensor. Names are checkpoint keys."""
DecayRanges = Sequence[Sequence[tuple[int, int]]]
"""Per parameter tensor, the half-open element ranges that get weight decay."""
InitFn = Callable[[Sequence[Tensor]], Moments]


class UpdateFn(Protocol):
    """Signature of `Optimizer.update`."""

    def __call__(
        self,
        grads: Sequence[Tensor],
        moments: Moments,
        params: Sequence[Tensor],
        *,
        step: int,
        lr: float | None = None,
        decay: DecayRanges | None = None,
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """What built an optimizer: its constructor's name and hyperparameters (JSON-able).

    Checkpoints record it so that `from_spec` can rebuild the same optimizer. A learning-rate
    schedule is a function, which no file can hold: then ``schedule`` is True, ``lr`` is absent
    from `hyperparameters`, and `from_spec` needs the schedule passed again.

    Attributes:
        name: the constructor in `fzero.optim`, e.g. ``"adamw"``.
        hyperparameters: ``(name, value)`` pairs of its keyword arguments, in signature order.
        schedule: whether ``lr`` was a schedule (a callable) rather than a number.
    """

    name: str
    hyperparameters: tuple[tuple[str, Any], ...]
    schedule: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict; `OptimizerSpec.from_json` is its inverse."""
        return {
            "name": self.name,
            "hyperparameters": {k: list(v) if isinstance(v, tuple) else v
                                for k, v in self.hyperparameters},
            "schedule": self.schedule,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> OptimizerSpec:
        """Parse `to_json`'s output (lists become tuples, as the constructors take them)."""
        try:
            name, hyper, schedule = doc["name"], doc["hyperparameters"], doc["schedule"]
        except (KeyError, TypeError) as error:
            raise ValueError(f"not an optimizer spec: {doc!r} ({error!r} missing)") from error
        if not isinstance(name, str) or not isinstance(hyper, Mapping):
            raise ValueError(f"not an optimizer spec: {doc!r}")
        pairs = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in hyper.items())
        return cls(name, pairs, bool(schedule))


def _spec(name: str, lr: float | Schedule, **hyperparameters: Any) -> OptimizerSpec:
    if callable(lr):
        return OptimizerSpec(name, tuple(hyperparameters.items()), schedule=True)
    return OptimizerSpec(name, (("lr", float(lr)), *hyperparameters.items()))


class Optimizer(NamedTuple):
    """A functional optimizer: a pair of closures over its hyperparameters.

    Attributes:
        init: ``init(params) -> moments``: zero moments shaped like ``params``.
        update: ``update(grads, moments, params, *, step, lr=None, decay=None) -> None``: one
            step, in place on ``params`` and ``moments``. ``step`` is the 1-based number of this
            update (torch's ``state["step"]`` after its increment); ``lr`` overrides the
            constructor's learning rate or schedule; ``decay`` restricts weight decay to element
            ranges (see the module docstring).
        lr: the learning-rate schedule ``step -> lr`` the constructor was given (a constant
            learning rate becomes a constant schedule); train steps report it.
        spec: the constructor and hyperparameters that built it (None for a hand-made pair),
            recorded by checkpoints; `from_spec` rebuilds the optimizer from it.
    """

    init: InitFn
    update: UpdateFn
    lr: Schedule
    spec: OptimizerSpec | None = None

    def describe(self) -> str:
        """The constructor and hyperparameters as text (``"None"`` for a hand-made pair): what
        ranks compare before they train together."""
        return repr(self.spec.to_json() if self.spec is not None else None)


# --------------------------------------------------------------------------------------------
# Hyperparameter checks


def _check_real(name: str, value: object, *, low: float, high: float | None = None) -> float:
    """A finite real in [low, high) (or [low, inf) without ``high``), as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    ok = math.isfinite(value) and value >= low and (high is None or value < high)
    if not ok:
        expected = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a finite number {expected}, got {name}={value!r}")
    return float(value)


def _as_schedule(lr: float | Schedule) -> Schedule:
    if callable(lr):
        return lr
    value = _check_real("lr", lr, low=0.0)
    return lambda step: value


def _check_betas(betas: object) -> tuple[float, float]:
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas=}")
    return (
        _check_real("betas[0]", betas[0], low=0.0, high=1.0),
        _check_real("betas[1]", betas[1], low=0.0, high=1.0),
    )


# --------------------------------------------------------------------------------------------
# Per-call checks: everything is validated before the first tensor is touched, so a bad call
# never leaves half-updated state behind.


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int >= 1, got {step!r} ({type(step).__name__})")
    if step < 1:
        raise ValueError(f"step must be an int >= 1 (1-based, as torch's state step), got {step=}")
    return step


def _resolve_lr(schedule: Schedule, lr: float | None, step: int) -> float:
    if lr is None:
        value = schedule(step)
        if isinstance(value, Tensor):  # a schedule may compute in torch; take the number
            value = value.item()
        return _check_real(f"lr schedule({step})", value, low=0.0)
    return _check_real("lr", lr, low=0.0)


def _check_params(params: object, what: str = "params") -> list[Tensor]:
    if isinstance(params, Tensor) or not isinstance(params, Sequence):
        raise TypeError(f"{what} must be a sequence of tensors (one per bucket), got {params!r}")
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"{what}[{i}] must be a Tensor, got {type(p).__name__}")
        if not p.is_floating_point():
            raise ValueError(f"{what}[{i}] must be floating point, got dtype={p.dtype}")
    return list(params)


def _check_disjoint(written: dict[str, list[Tensor]]) -> None:
    """No two of the tensors an update writes (parameters, moments, and the gradients, which
    are scratch) share an element, and none repeats one of its own (an expanded tensor): each
    such element would be written twice, and the update would be silently wrong. (Strided
    views that interleave without sharing an element raise too: `first_overlap`.)"""
    for group, tensors in written.items():
        for i, t in enumerate(tensors):
            if not t.is_contiguous() and any(size > 1 and stride == 0 for size, stride
                                             in zip(t.shape, t.stride(), strict=True)):
                raise ValueError(
                    f"{group}[{i}] repeats elements in memory (an expanded tensor, stride 0): "
                    f"the update writes it in place; pass a contiguous copy"
                )
    pair = first_overlap((f"{group}[{i}]", t) for group, tensors in written.items()
                         for i, t in enumerate(tensors))
    if pair is not None:
        raise ValueError(
            f"{pair[0]} and {pair[1]} overlap in memory: the update writes both in place "
            f"(gradients are scratch), so an element would be written twice; give every "
            f"parameter, gradient and moment its own memory"
        )


def _check_like(name: str, tensors: object, params: list[Tensor]) -> list[Tensor]:
    """``tensors`` has one tensor per param with the same shape, dtype and device."""
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a sequence of tensors, got {type(tensors).__name__}")
    if len(tensors) != len(params):
        raise ValueError(f"len({name})={len(tensors)} does not match len(params)={len(params)}")
    for i, (t, p) in enumerate(zip(tensors, params, strict=True)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a Tensor, got {type(t).__name__}")
        if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
            raise ValueError(
                f"{name}[{i}] has shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}; "
                f"expected params[{i}]'s shape={tuple(p.shape)}, dtype={p.dtype}, "
                f"device={p.device}"
            )
    return list(tensors)


def _check_moments(moments: object, names: tuple[str, ...], params: list[Tensor]) -> None:
    if not isinstance(moments, dict):
        raise TypeError(f"moments must be the dict returned by init, got {type(moments).__name__}")
    if set(moments) != set(names):
        raise ValueError(f"moments has keys {sorted(moments)}, expected {sorted(names)}")
    for name in names:
        _check_like(f"moments[{name!r}]", moments[name], params)


def _decay_spans(decay: DecayRanges | None, params: list[Tensor]) -> list[tuple[int, int, int]]:
    """Validated ``(index, start, end)`` spans to decay; adjacent ranges merged."""
    if decay is None:
        return [(i, 0, p.numel()) for i, p in enumerate(params)]
    if isinstance(decay, str | bytes) or not isinstance(decay, Sequence):
        raise TypeError(f"decay must be a sequence of range lists or None, got {decay!r}")
    if len(decay) != len(params):
        raise ValueError(f"len(decay)={len(decay)} does not match len(params)={len(params)}")
    spans = []
    for i, (ranges, p) in enumerate(zip(decay, params, strict=True)):
        numel = p.numel()
        if ranges and not p.is_contiguous():
            raise ValueError(f"params[{i}] must be contiguous to decay element ranges of it")
        checked = []
        for r in ranges:
            ok = (
                isinstance(r, tuple | list)
                and len(r) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                and 0 <= r[0] <= r[1] <= numel
            )
            if not ok:
                raise ValueError(
                    f"decay[{i}] has range {r!r}; expected (start, end) ints with "
                    f"0 <= start <= end <= params[{i}].numel()={numel}"
                )
            if r[0] < r[1]:
                checked.append((r[0], r[1]))
        checked.sort()
        merged: list[list[int]] = []
        for start, end in checked:
            if merged and start < merged[-1][1]:
                raise ValueError(
                    f"decay[{i}] has overlapping ranges ({merged[-1][0]}, {merged[-1][1]}) and "
                    f"({start}, {end}); each element may be decayed once"
                )
            if merged and start == merged[-1][1]:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        spans += [(i, start, end) for start, end in merged]
    return spans


def _views(tensors: list[Tensor], spans: list[tuple[int, int, int]]) -> list[Tensor]:
    out = []
    for i, start, end in spans:
        t = tensors[i]
        out.append(t if start == 0 and end == t.numel() else t.view(-1)[start:end])
    return out


# --------------------------------------------------------------------------------------------
# Adam / AdamW

_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _zeros_init(names: tuple[str, ...]) -> InitFn:
    """``init(params)``: one zero tensor like each parameter, per moment name."""

    def init(params: Sequence[Tensor]) -> Moments:
        ps = _check_params(params)
        return {name: tuple(torch.zeros_like(p) for p in ps) for name in names}

    return init


class _Call(NamedTuple):
    step: int
    lr: float
    params: list[Tensor]
    grads: list[Tensor]
    spans: list[tuple[int, int, int]]


def _checked_call(
    schedule: Schedule,
    weight_decay: float,
    names: tuple[str, ...],
    grads: Sequence[Tensor],
    moments: Moments,
    params: Sequence[Tensor],
    step: int,
    lr: float | None,
    decay: DecayRanges | None,
) -> _Call:
    """Validate one `update` call (before any tensor is touched) and resolve its lr."""
    step = _check_step(step)
    lr_t = _resolve_lr(schedule, lr, step)
    ps = _check_params(params)
    gs = _check_like("grads", grads, ps)
    _check_moments(moments, names, ps)
    _check_disjoint({"params": ps, "grads": gs,
                     **{f"moments[{name!r}]": list(moments[name]) for name in names}})
    spans = _decay_spans(decay, ps) if weight_decay != 0 else []
    return _Call(step, lr_t, ps, gs, spans)


def _adam(
    lr: float | Schedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    *,
    decoupled: bool,
) -> Optimizer:
    schedule = _as_schedule(lr)
    beta1, beta2 = _check_betas(betas)
    eps = _check_real("eps", eps, low=0.0)
    weight_decay = _check_real("weight_decay", weight_decay, low=0.0)

    def update(
        grads: Sequence[Tensor],
        moments: Moments,
        params: Sequence[Tensor],
        *,
        step: int,
        lr: float | None = None,
        decay: DecayRanges | None = None,
    ) -> None:
        step, lr_t, ps, gs, spans = _checked_call(
            schedule, weight_decay, _ADAM_MOMENTS, grads, moments, params, step, lr, decay
        )
        if not ps:
            return
        exp_avgs, exp_avg_sqs = list(moments["exp_avg"]), list(moments["exp_avg_sq"])

        if spans:
            if decoupled:  # AdamW: p <- p * (1 - lr * wd), before the moment update
                torch._foreach_mul_(_views(ps, spans), 1 - lr_t * weight_decay)
            else:  # Adam: L2 folded into the gradient (in place: grads are scratch)
                torch._foreach_add_(_views(gs, spans), _views(ps, spans), alpha=weight_decay)

        torch._foreach_lerp_(exp_avgs, gs, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, gs, gs, 1 - beta2)

        # torch computes the bias corrections from a float step; keep its exact expressions.
        bias_correction1 = 1 - beta1 ** float(step)
        bias_correction2 = 1 - beta2 ** float(step)
        step_size = (lr_t / bias_correction1) * -1
        # The denominator goes into the gradients, which are scratch and no longer needed:
        # torch's foreach Adam allocates a params-sized temporary here (Ψ/N bytes per step).
        denom = gs
        torch._foreach_copy_(denom, exp_avg_sqs)
        torch._foreach_sqrt_(denom)
        torch._foreach_div_(denom, bias_correction2**0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(ps, exp_avgs, denom, step_size)

    spec = _spec("adamw" if decoupled else "adam", lr, betas=(beta1, beta2), eps=eps,
                 weight_decay=weight_decay)
    return Optimizer(_zeros_init(_ADAM_MOMENTS), update, schedule, spec)


def adamw(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> Optimizer:
    """AdamW (decoupled weight decay), numerically `torch.optim.AdamW`.

    Moments: ``"exp_avg"`` and ``"exp_avg_sq"``. Decayed elements are multiplied by
    ``1 - lr * weight_decay`` before the Adam update.

    Args:
        lr: learning rate, or a schedule ``step -> lr`` (1-based step).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled weight-decay coefficient, >= 0.

    Returns:
        The `Optimizer` pair.

    Raises:
        TypeError, ValueError: if a hyperparameter is of the wrong type or out of range.
    """
    return _adam(lr, betas, eps, weight_decay, decoupled=True)


def adam(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> Optimizer:
    """Adam with L2 regularisation, numerically `torch.optim.Adam`.

    Moments: ``"exp_avg"`` and ``"exp_avg_sq"``. ``weight_decay * param`` is added to the
    gradient of the decayed elements, in place in ``grads``.

    Args:
        lr: learning rate, or a schedule ``step -> lr`` (1-based step).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 coefficient, >= 0.

    Returns:
        The `Optimizer` pair.

    Raises:
        TypeError, ValueError: if a hyperparameter is of the wrong type or out of range.
    """
    return _adam(lr, betas, eps, weight_decay, decoupled=False)


# --------------------------------------------------------------------------------------------
# SGD


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> Optimizer:
    """SGD with optional momentum, Nesterov and L2, numerically `torch.optim.SGD`.

    Moments: ``"momentum_buffer"`` when ``momentum > 0``, else none (an empty dict). As in
    torch, at ``step == 1`` the buffer is set to the gradient (no dampening); afterwards
    ``buf = momentum * buf + (1 - dampening) * grad``. L2 and Nesterov terms are added to
    ``grads`` in place.

    Args:
        lr: learning rate, or a schedule ``step -> lr`` (1-based step).
        momentum: momentum factor, >= 0.
        dampening: dampening for momentum, >= 0.
        weight_decay: L2 coefficient, >= 0.
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).

    Returns:
        The `Optimizer` pair.

    Raises:
        TypeError, ValueError: if a hyperparameter is of the wrong type or out of range.
    """
    schedule = _as_schedule(lr)
    momentum = _check_real("momentum", momentum, low=0.0)
    dampening = _check_real("dampening", dampening, low=0.0)
    weight_decay = _check_real("weight_decay", weight_decay, low=0.0)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov=True needs momentum > 0 and dampening == 0, got {momentum=}, {dampening=}"
        )
    names = ("momentum_buffer",) if momentum != 0 else ()

    def update(
        grads: Sequence[Tensor],
        moments: Moments,
        params: Sequence[Tensor],
        *,
        step: int,
        lr: float | None = None,
        decay: DecayRanges | None = None,
    ) -> None:
        step, lr_t, ps, gs, spans = _checked_call(
            schedule, weight_decay, names, grads, moments, params, step, lr, decay
        )
        if not ps:
            return

        if spans:  # L2 folded into the gradient (in place: grads are scratch)
            torch._foreach_add_(_views(gs, spans), _views(ps, spans), alpha=weight_decay)
        direction = gs
        if momentum != 0:
            bufs = list(moments["momentum_buffer"])
            if step == 1:  # torch creates the buffer as a copy of the first gradient
                torch._foreach_copy_(bufs, gs)
            else:
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, gs, alpha=1 - dampening)
            if nesterov:
                torch._foreach_add_(gs, bufs, alpha=momentum)
            else:
                direction = bufs
        torch._foreach_add_(ps, direction, alpha=-lr_t)

    spec = _spec("sgd", lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                 nesterov=nesterov)
    return Optimizer(_zeros_init(names), update, schedule, spec)


def from_spec(spec: OptimizerSpec, *, lr: float | Schedule | None = None) -> Optimizer:
    """Rebuild the optimizer `spec` describes (``from_spec(opt.spec)`` acts as ``opt``).

    Args:
        spec: an `OptimizerSpec`, e.g. from a checkpoint's manifest.
        lr: a learning rate or schedule replacing the recorded one; required when the
            optimizer was built with a schedule (``spec.schedule``), which no spec can hold.

    Returns:
        The `Optimizer`.

    Raises:
        ValueError: `spec` names no `fzero.optim` constructor, or it needs `lr` and got none.
        TypeError, ValueError: a recorded hyperparameter is out of range (as the constructor).
    """
    constructors: dict[str, Callable[..., Optimizer]] = {"adamw": adamw, "adam": adam, "sgd": sgd}
    if not isinstance(spec, OptimizerSpec):
        raise TypeError(f"spec must be an fzero.optim.OptimizerSpec, got {type(spec).__name__}")
    if spec.name not in constructors:
        raise ValueError(
            f"optimizer spec names {spec.name!r}; fzero.optim can rebuild {sorted(constructors)}"
        )
    kwargs = dict(spec.hyperparameters)
    if lr is not None:
        kwargs["lr"] = lr
    elif spec.schedule:
        raise ValueError(
            f"this {spec.name} optimizer was built with a learning-rate schedule (a function), "
            f"which its spec cannot hold: pass lr=<the schedule> (or build the optimizer "
            f"yourself)"
        )
    return constructors[spec.name](**kwargs)


# --------------------------------------------------------------------------------------------
# Clipping and schedules


def clip_coefficient(total_norm: Tensor, max_norm: float, eps: float = 1e-6) -> Tensor:
    """The factor `torch.nn.utils.clip_grad_norm_` scales gradients by.

    ``min(1, max_norm / (total_norm + eps))``, computed as torch does, on ``total_norm``'s
    device and without a host sync. Multiply the gradient shards by it (e.g.
    ``torch._foreach_mul_(grads, coef)``) once ``total_norm`` is the global norm.

    Args:
        total_norm: the global gradient norm, a 0-d tensor.
        max_norm: the largest allowed norm, >= 0.
        eps: added to the norm to avoid dividing by zero (torch uses 1e-6).

    Returns:
        A 0-d tensor in ``total_norm``'s dtype; NaN or inf norms give a NaN or 0 factor.

    Raises:
        TypeError: if ``total_norm`` is not a tensor.
        ValueError: if ``max_norm`` or ``eps`` is negative or not finite.
    """
    if not isinstance(total_norm, Tensor):
        raise TypeError(f"total_norm must be a Tensor, got {type(total_norm).__name__}")
    max_norm = _check_real("max_norm", max_norm, low=0.0)
    eps = _check_real("eps", eps, low=0.0)
    return torch.clamp(max_norm / (total_norm + eps), max=1.0)


def constant_schedule(lr: float) -> Schedule:
    """A schedule that returns ``lr`` at every step.

    Args:
        lr: the learning rate, >= 0.

    Returns:
        ``step -> lr``.

    Raises:
        TypeError, ValueError: if ``lr`` is not a finite number >= 0.
    """
    value = _check_real("lr", lr, low=0.0)

    def schedule(step: int) -> float:
        _check_step(step)
        return value

    return schedule


def cosine_schedule(
    peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0
) -> Schedule:
    """Linear warmup to ``peak_lr``, then cosine decay to ``min_lr`` at ``total_steps``.

    With 1-based ``step``: ``peak_lr * step / warmup_steps`` for ``step <= warmup_steps``;
    then ``min_lr + (peak_lr - min_lr) * (1 + cos(pi * t)) / 2`` with
    ``t = (step - warmup_steps) / (total_steps - warmup_steps)``; ``min_lr`` from
    ``total_steps`` on, after the warmup (``warmup_steps == total_steps``: ``peak_lr`` at
    that step, ``min_lr`` after it). Step k here has the rate Hugging Face's
    ``get_cosine_schedule_with_warmup`` (a ``LambdaLR``) gives its step k + 1: that one starts
    at 0 and reaches ``min_lr`` one step later; this one's first update already moves and its
    step ``total_steps`` runs at ``min_lr`` (no move at the default 0).

    Args:
        peak_lr: learning rate at the end of warmup, >= 0.
        warmup_steps: number of warmup steps, >= 0.
        total_steps: step at which the decay reaches ``min_lr``, >= ``warmup_steps`` and >= 1.
        min_lr: final learning rate, in [0, peak_lr].

    Returns:
        ``step -> lr``.

    Raises:
        TypeError, ValueError: if an argument is of the wrong type or out of range.
    """
    peak = _check_real("peak_lr", peak_lr, low=0.0)
    floor = _check_real("min_lr", min_lr, low=0.0)
    if floor > peak:
        raise ValueError(f"min_lr must be <= peak_lr, got {min_lr=}, {peak_lr=}")
    for name, value in (("warmup_steps", warmup_steps), ("total_steps", total_steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if warmup_steps < 0 or total_steps < max(warmup_steps, 1):
        raise ValueError(
            f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, "
            f"got {warmup_steps=}, {total_steps=}"
        )

    def schedule(step: int) -> float:
        _check_step(step)
        if step <= warmup_steps:
            return peak * step / warmup_steps
        if step >= total_steps:
            return floor
        progress = (step - warmup_steps) / (total_steps - warmup_steps)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule
