"""Running the user's module on a state's tensors: `torch.func.functional_call`, held open for a
whole forward *and* backward, and a check that the module still matches the state's layout.

[Note: bound through backward]
`functional_call(model, tensors, args)` substitutes the module's parameters for the duration of
one call. Activation checkpointing (`torch.utils.checkpoint`, Hugging Face's
``gradient_checkpointing_enable``) runs the forward again *during backward*, reading the
module's attributes then: after a plain `functional_call` has returned they are the module's
own (stale, or `meta`) tensors, and the gradients are silently wrong. So fzero runs a whole
micro-batch, ``loss_fn`` and ``loss.backward()``, inside one `functional_call` of a small
wrapper module whose only child is the user's model: the substitution lasts exactly as long as
anything may read it, and the module is left as it was afterwards. Every name of a tied
parameter is bound explicitly, so a tie the module lost (``model.to("meta")`` unties) does not
matter; a tie the module gained, or a shape it changed, is an error (`check_structure`).

Buffers are bound the same way, from the state's copies. An in-place update (BatchNorm's
running statistics) lands in them; a train step also keeps a buffer the forward *reassigned*
(``self.count = self.count + 1``), which the end of the binding would otherwise drop, by
copying the new value into the state's copy (`Binder.run`'s `keep`). Every rank must hold them
alike: rank 0's are broadcast into the others' each step (``buffers="broadcast"``), byte for
byte. A buffer the module has and the state lacks would read the module's own, unsynchronized
tensor, and ranks whose buffers differ in name or shape would pair unrelated bytes; so the
module's buffers are checked against the state's (`check_buffers`) and the ranks compare a
fingerprint of them (`buffers_fingerprint`) before anything moves.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fzero.buckets import holds_completion_hooks
from fzero.layout import ShardLayout, first_overlap, in_memory

__all__ = ["Binder", "GradientWatch", "ModuleVersions", "buffer_aliases", "buffers_fingerprint",
           "carry_attributes", "check_buffers", "check_shared_memory", "check_structure", "claim",
           "held_tensors", "module_versions", "requires_grad_flags", "same_values"]

T = TypeVar("T")

_OVERWRITE_ON_CONVERSION = (
    "forward converted a module (`module.to(...)`, `.float()`, `.half()`...) while "
    "torch.__future__.set_overwrite_module_params_on_conversion(True) is set: torch then "
    "replaces each parameter with a new nn.Parameter, and the step's parameters are the "
    "state's tensors bound in their place (not nn.Parameter objects), so torch refuses. "
    "Convert the module before fzero.init (build it in the dtype forward converts to), or "
    "leave that flag off: without it the conversion writes in place, which the step checks"
)


_ASSIGNED_PARAMETER = (
    "forward assigned a tensor to parameter {name!r} (e.g. tying weights in forward: "
    "`self.head.weight = self.emb.weight`): a step binds the state's tensors, not nn.Parameter "
    "objects, in the parameters' place, so torch refuses the assignment ({error}), and fzero "
    "plans its buckets and ties when the state is built. Tie the weights in __init__, before "
    "fzero.init; nothing was updated"
)


def _parameter_assignment(error: TypeError, model: nn.Module) -> str | None:
    """The dotted name forward assigned a non-Parameter to, when `error` is torch's refusal
    ("cannot assign ... as parameter ..." from ``nn.Module.__setattr__``); None otherwise."""
    if "as parameter" not in str(error):
        return None
    frame_of_setattr = None
    trace = error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code is nn.Module.__setattr__.__code__:
            frame_of_setattr = trace.tb_frame
        trace = trace.tb_next
    if frame_of_setattr is None:
        return None
    module, leaf = frame_of_setattr.f_locals.get("self"), frame_of_setattr.f_locals.get("name")
    path = next((path for path, m in model.named_modules() if m is module), None)
    if path is None or not isinstance(leaf, str):  # (a module outside the model: torch's own
        return None  # error, as plain torch raises it)
    return f"{path}.{leaf}" if path else leaf


class _Runner(nn.Module):
    """A module whose forward runs a thunk: functional_call(runner, ...) binds its child."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, thunk: Callable[[], Any]) -> Any:
        return thunk()


class Binder:
    """Runs code with `model`'s parameters and buffers bound to given tensors.

    ``binder.run(tensors, fn)`` calls ``fn()`` while every name in `tensors` (parameters and
    buffers of `model`, dotted names) reads the given tensor; the module is restored afterwards,
    also when ``fn`` raises. Wrapping the model adds no reference to the model itself.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._runner = _Runner(model)

    def run(
        self, tensors: Mapping[str, Tensor], fn: Callable[[], T], *,
        keep: Collection[str] = (), reshaped: str = "raise",
    ) -> T:
        """``fn()`` with `tensors` bound (see the module note).

        A buffer named in `keep` that ``fn`` *reassigned* (``self.count = self.count + 1``
        instead of an in-place update) would be lost when the binding ends; its new value is
        copied into the bound tensor instead, as plain torch would keep it. One reassigned to
        another shape or dtype (or to None) raises (`reshaped` ``"raise"``), or is left to the
        binding's end (``"drop"``: an eval step, where such a buffer is a cache, e.g. a
        positional table grown for a longer input, that the next forward grows again).

        Raises:
            ValueError: a buffer in `keep` reassigned to something of another shape or dtype
                (or to None), with `reshaped` ``"raise"``: the state's buffers keep the shapes
                they were built with.
        """
        prefixed = {f"model.{name}": tensor
                    for name, tensor in self._one_name_per_attribute(tensors).items()}

        def keeping() -> T:
            out = fn()
            for name in keep:
                bound, now = tensors[name], _attribute(self.model, name)
                if now is bound:
                    continue
                if not isinstance(now, Tensor) or now.shape != bound.shape or (
                        now.dtype != bound.dtype):
                    if reshaped == "drop":
                        continue
                    shown = (f"shape {tuple(now.shape)}, {now.dtype}" if isinstance(now, Tensor)
                             else type(now).__name__)
                    raise ValueError(
                        f"buffer {name!r} was reassigned in forward to {shown}; the state "
                        f"keeps it as shape {tuple(bound.shape)}, {bound.dtype}. Keep its shape "
                        f"and dtype (or update it in place), or register it with its final "
                        f"shape before fzero.init"
                    )
                with torch.no_grad():
                    bound.copy_(now)
            return out

        held = _HeldReferences(self.model, tensors)
        try:
            return functional_call(self._runner, prefixed, (keeping if keep else fn,),
                                   tie_weights=False, strict=False)
        except AssertionError as error:
            if (str(error) == "param must be a Parameter"
                    and torch.__future__.get_overwrite_module_params_on_conversion()):
                raise RuntimeError(_OVERWRITE_ON_CONVERSION) from error
            raise
        except TypeError as error:
            assigned = _parameter_assignment(error, self.model)
            if assigned is None:
                raise
            # (from None: the original's frames hold the bound tensors, which stage 3 frees)
            raise ValueError(_ASSIGNED_PARAMETER.format(name=assigned, error=error)) from None
        finally:
            held.release()

    def _one_name_per_attribute(self, tensors: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """`tensors` with one name for each module attribute: a module registered under two
        names (``self.mid`` and ``self.blocks = nn.ModuleList([self.mid])``) reaches one
        attribute through both. `functional_call` would swap it twice and, restoring in the
        same order, leave the first swap's tensor in the module (the state's own memory, and
        at stage 3 a released bucket's). Names bound to different tensors are all kept."""
        by_tensor: dict[int, list[str]] = {}
        for name, tensor in tensors.items():
            by_tensor.setdefault(id(tensor), []).append(name)
        repeated = set()
        for names in by_tensor.values():
            if len(names) > 1:  # a tie: the same tensor under several names
                owners: set[tuple[int, str]] = set()
                for name in names:
                    owner, _, leaf = name.rpartition(".")
                    key = (id(self.model.get_submodule(owner)), leaf)
                    if key in owners:
                        repeated.add(name)
                    owners.add(key)
        if not repeated:
            return tensors
        return {name: tensor for name, tensor in tensors.items() if name not in repeated}


_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""The attributes every `nn.Module` keeps for itself (registries of parameters, buffers,
children and hooks); the rest of its ``__dict__`` is the user's."""


class _HeldReferences:
    """A module's parameters and buffers held outside its registry, bound too for one call.

    Module code may keep a parameter or buffer object in a plain attribute: in a list or dict
    (``self._ps = [self.w]``), under a second name (Hugging Face's ``original_inv_freq =
    inv_freq``), or cached by forward itself (``self._w = self.b.weight``). In torch that is
    the live tensor; a binding by registered name alone would leave the module's own object
    there, whose values a state never updates (after `fzero.load`, not even its initial ones),
    and forward would read it silently. So every such reference (a module attribute, or an item
    of a list, tuple or dict in one) to a module's own tensor of a bound name reads the bound
    tensor during the call (from construction), and after it every reference to a bound
    tensor, ours or one forward stored, holds the module's own again (`release`): what torch
    would hold. Each micro-batch pays two walks over the modules' attributes and two over the
    module tree (0.5 ms together at 96 modules and 125 names; a `get_submodule` lookup per
    name cost 3.5 ms, a ``getattr`` per name 0.25 ms more)."""

    def __init__(self, model: nn.Module, tensors: Mapping[str, Tensor]) -> None:
        self.model = model
        self.own_of: dict[int, Tensor] = {}  # id(bound tensor) -> the module's own tensor
        bound_of: dict[int, Tensor] = {}
        by_path = dict(model.named_modules(remove_duplicate=False))  # one walk, not one a name
        for name, bound in tensors.items():
            owner, _, leaf = name.rpartition(".")
            module = by_path.get(owner)
            own = _registered(module, leaf) if module is not None else _attribute(model, name)
            if isinstance(own, Tensor) and own is not bound:
                bound_of[id(own)] = bound
                self.own_of[id(bound)] = own
        _replace_held({id(m): m for m in by_path.values()}.values(), bound_of)

    def release(self) -> None:
        # (a new walk: forward may have added a module that keeps a bound tensor)
        _replace_held(_unique_modules(self.model), self.own_of)


def _unique_modules(model: nn.Module) -> list[nn.Module]:
    """`model` and its submodules, each once: what ``model.modules()`` yields, in another
    order, walked without its recursive generators and names (half the time, 35 us at 96
    modules)."""
    found = {id(model): model}
    pending = [model]
    while pending:
        for child in pending.pop()._modules.values():
            if child is not None and id(child) not in found:
                found[id(child)] = child
                pending.append(child)
    return list(found.values())


def _registered(module: nn.Module, leaf: str) -> Any:
    """``getattr(module, leaf)`` for a parameter or buffer, read from its registry directly:
    ``nn.Module.__getattr__`` (a Python call, reached only after the instance and class
    lookups fail) costs 2-4 us a name, most of the per-name cost of a binding. ``in`` and
    ``[]``, not ``.get``: a scripted submodule's registries are wrappers without ``get``."""
    parameters = module._parameters
    if leaf in parameters:
        return parameters[leaf]
    buffers = module._buffers
    if leaf in buffers:
        return buffers[leaf]
    return getattr(module, leaf)


def _replace_held(modules: Iterable[nn.Module], replacements: Mapping[int, Tensor]) -> None:
    """Wherever one of `modules` holds a tensor outside its registry (`held_tensors`), replace
    each one whose id is in `replacements` by its replacement. Every step runs this twice, so
    it scans the same attributes as `held_tensors` without its ordered generator (0.25 ms a
    step less at 96 modules); `held_tensors` keeps the order its error messages need."""
    if not replacements:
        return
    for module in modules:
        attributes = vars(module)
        for attr in attributes.keys() - _MODULE_INTERNALS:
            value = attributes[attr]
            if isinstance(value, Tensor):
                new = replacements.get(id(value))
                if new is not None:
                    attributes[attr] = new
            elif type(value) is tuple:
                if any(id(item) in replacements for item in value):
                    attributes[attr] = tuple(replacements.get(id(item), item)
                                             if isinstance(item, Tensor) else item
                                             for item in value)
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, Tensor) and id(item) in replacements:
                        value[i] = replacements[id(item)]
            elif isinstance(value, dict):
                for key, item in list(value.items()):
                    if isinstance(item, Tensor) and id(item) in replacements:
                        value[key] = replacements[id(item)]


def held_tensors(module: nn.Module) -> Iterator[tuple[str, Any, Tensor]]:
    """``(attribute, key, tensor)`` for each tensor `module` holds in its own attributes
    outside its registries: the attribute's value (key None), or an item of a list, tuple or
    dict there (key its index or dict key). One level deep; named tuples and other containers
    are not looked into."""
    for attr, value in vars(module).items():
        if attr in _MODULE_INTERNALS:
            continue
        if isinstance(value, Tensor):
            yield attr, None, value
        elif isinstance(value, list) or type(value) is tuple:
            yield from ((attr, i, item) for i, item in enumerate(value)
                        if isinstance(item, Tensor))
        elif isinstance(value, dict):
            yield from ((attr, k, item) for k, item in value.items()
                        if isinstance(item, Tensor))


_RUNNING = "_fzero_step_running"
"""The prefix of the key a step sets in the module's ``__dict__`` while it runs on it
(`claim`)."""


def claim(model: nn.Module, what: str) -> Callable[[], None]:
    """Mark `model` as in use by one step until the returned function is called.

    A step binds the state's tensors into the module's attributes, and at stage 3 hooks its
    modules; two steps running on one module object at once (SimWorld ranks or threads
    sharing it) would read each other's tensors and leave one in the module, silently.

    The key names the module object (its ``id``): a ``copy.deepcopy(model)`` taken while a step
    runs (inside a loss function, say) carries the key, and it must not make the copy look
    busy for ever.

    Raises:
        ValueError: another step runs on `model` now.
    """
    key, token = f"{_RUNNING}_{id(model):x}", (threading.get_ident(), object())
    holder = model.__dict__.setdefault(key, token)  # atomic: one dict operation
    if holder is not token:
        if holder[0] == token[0]:  # this thread: a step called inside another step's loss_fn
            raise ValueError(
                f"{what}: a step on this nn.Module object is already running in this thread "
                f"(called from inside its loss_fn or forward, e.g. an EMA teacher's eval "
                f"step on the student's own module): each step binds its state's tensors "
                f"into the module, so the inner one would replace the outer one's. Give the "
                f"inner step its own module: make_eval_step(copy.deepcopy(model), ...)"
            )
        raise ValueError(
            f"{what}: another step is running on this nn.Module object right now (SimWorld "
            f"ranks or threads that share one model): each step binds its state's tensors "
            f"into the module, so they would read each other's. Give each rank its own "
            f"module (SimWorld.run(fn, model) passes each rank a copy)"
        )
    return lambda: model.__dict__.pop(key, None)


def same_values(tensor: Tensor, reference: Tensor) -> bool:
    """Whether `tensor` (a module's) holds `reference`'s values (the state's, or another
    name's of one tie): the same shape, equal after a cast to `reference`'s dtype and device
    (NaN equals NaN)."""
    if tuple(tensor.shape) != tuple(reference.shape):
        return False
    cast = tensor.to(device=reference.device, dtype=reference.dtype)
    if torch.equal(cast, reference):  # the common case, without temporaries
        return True
    same = cast == reference
    if reference.is_floating_point() or reference.is_complex():
        same |= cast.isnan() & reference.isnan()
    return bool(same.all())


def _attribute(model: nn.Module, name: str) -> Any:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, leaf)


def check_structure(
    model: nn.Module, layout: ShardLayout, *,
    requires_grad: Sequence[tuple[str, bool]] | None = None, train: bool = False,
) -> dict[str, Tensor]:
    """Raise if `model` no longer has the parameters, shapes and ties `layout` was planned for,
    or (given `requires_grad`, the flags `requires_grad_flags` took when the state was built)
    if a parameter's ``requires_grad`` changed since, or (`train`: a train step's check) if a
    parameter carries a gradient hook: which parameters train is fixed when the state is
    built, and a flag flipped later would otherwise be silently ignored; a hook on the module's
    parameter object (``p.register_hook``, ``p.register_post_accumulate_grad_hook``) would
    never fire, as a step computes with the state's tensors in the parameters' place.

    Returns the module's parameters by name (tied names included), for the step's later
    checks (`carry_attributes`, `GradientWatch`).

    A tie in the layout that the module has lost is accepted when the module's tensors are on
    ``meta`` (``model.to("meta")`` after `fzero.init`, to drop the module's memory: fzero binds
    every name itself); on materialized tensors it means the module was re-tied or re-assigned
    after the state was built, and is an error.

    Raises:
        ValueError: naming the parameters only in the state or only in the model, the shapes
            that differ, the ties that differ, the parameters whose ``requires_grad``
            changed, and those with gradient hooks.
    """
    located = layout.locate()
    named = dict(model.named_parameters(remove_duplicate=False))
    if train:
        hooked = sorted(name for name, t in named.items() if t.requires_grad and (
            t._backward_hooks or t._post_accumulate_grad_hooks))  # (a frozen one's never fire)
        bound = [name for name in hooked if holds_completion_hooks(named[name])]
        if bound:
            raise ValueError(
                f"the module holds, in place of its parameters {bound[:5]}, the tensors a "
                f"step binds there: a step on it was interrupted (e.g. by Ctrl-C) while it "
                f"bound or unbound them (torch's functional_call undoes a partial swap on an "
                f"error, not on an interrupt), and the module's own parameter objects are "
                f"gone. Build the module again (model = ...) and a step for it; the state "
                f"itself holds every value and is not affected"
            )
        if hooked:
            raise ValueError(
                f"parameters {hooked[:5]} carry gradient hooks (Tensor.register_hook or "
                f"register_post_accumulate_grad_hook on the module's parameter): a step binds "
                f"the state's tensors in the parameters' place (functional_call), so these "
                f"hooks would never fire. Change the gradient in the loss, or with a hook "
                f"registered inside forward on a tensor computed from the parameter "
                f"(`w = self.weight * 1; w.register_hook(fn)`), or clip with "
                f"make_train_step's clip_norm"
            )
    if requires_grad is not None:
        then = dict(requires_grad)
        flipped = sorted(name for name, t in named.items()
                         if name in then and t.requires_grad != then[name])
        if flipped:
            now = {name: named[name].requires_grad for name in flipped[:5]}
            raise ValueError(
                f"the module's requires_grad differs from the flags the state was built "
                f"with: now {now} (showing {min(len(flipped), 5)} of {len(flipped)}): changed "
                f"after the state was built, or the state was built from another module (or "
                f"with another trainable=). Which parameters train is fixed "
                f"when the state is built (fzero.init's trainable=, default the module's "
                f"requires_grad then), so the change would be ignored. To train another set, "
                f"build a new state (e.g. fzero.init(..., load=) from full_params or a "
                f"checkpoint) and a new step; or restore the flags"
            )
    missing = sorted(set(located) - set(named))
    extra = sorted(set(named) - set(located))
    wrong = sorted(
        f"{name}: state {located[name][1].shape} vs model {tuple(t.shape)}"
        for name, t in named.items()
        if name in located and tuple(t.shape) != located[name][1].shape
    )
    if missing or extra or wrong:
        raise ValueError(
            f"the state (layout fingerprint {layout.fingerprint}) was built for a different "
            f"model: parameters only in the state {missing[:5]}, only in the model {extra[:5]}, "
            f"shapes differing {wrong[:5]}"
        )
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in named.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    for names in by_tensor.values():
        owners = {located[name][1].name for name in names}
        if len(owners) > 1:
            raise ValueError(
                f"the module ties {names} (one tensor), but the state stores them as separate "
                f"parameters {sorted(owners)}: it was built before the tie; build it again with "
                f"fzero.init from the tied module"
            )
    for index, bucket in enumerate(layout.buckets):
        for entry in bucket.entries:
            if not entry.aliases:
                continue
            tensors = [named[name] for name in entry.names]
            if len({id(t) for t in tensors}) > 1 and not all(t.is_meta for t in tensors):
                raise ValueError(
                    f"the state ties {list(entry.names)} (one parameter, bucket {index} "
                    f"{bucket.label!r}), but the module now holds separate tensors for them: "
                    f"the tie was broken after fzero.init. Re-tie them (e.g. Hugging Face's "
                    f"model.tie_weights()), or move the module to 'meta' if you only need it "
                    f"as a function (fzero binds every tied name to the state's one tensor)"
                )
    return named


class GradientWatch:
    """The gradients of a module's own parameter objects as a train step starts, to tell
    afterwards whether the step's forward reached one of them.

    A step binds the state's tensors under the module's registered names (functional_call);
    forward code that reaches a parameter some other way (a list or dict attribute holding it,
    ``self.__dict__``, a closure kept from ``__init__``) computes with the module's own,
    stale values, and autograd leaves the gradient on that object: `reached` names them."""

    def __init__(self, named: Mapping[str, Tensor]) -> None:
        before: dict[int, tuple[str, Tensor, Tensor | None, int]] = {}
        for name, tensor in named.items():
            if tensor.requires_grad and not tensor.is_meta and id(tensor) not in before:
                grad = tensor.grad
                before[id(tensor)] = (name, tensor, grad, -1 if grad is None else grad._version)
        self._before = tuple(before.values())

    def reached(self) -> list[str]:
        """The parameters (one name each) whose gradient was set or written since."""
        return [name for name, tensor, grad, version in self._before
                if tensor.grad is not grad or (grad is not None and grad._version != version)]


def carry_attributes(bindings: Mapping[str, Tensor], named: Mapping[str, Tensor]) -> None:
    """Give each bound tensor the Python attributes its module parameter carries
    (``p.flag = ...``; Hugging Face's ``_is_hf_initialized``), so that forward code reading
    them (``getattr(self.weight, "flag", default)``) sees them, as it would on the module."""
    for name, tensor in named.items():
        attributes = tensor.__dict__
        if attributes and name in bindings:
            bindings[name].__dict__.update(attributes)


def buffer_aliases(model: nn.Module | Mapping[str, Tensor]) -> tuple[tuple[str, str], ...]:
    """``(alias, name)`` for each further name of a buffer registered under several (one tensor
    in two submodules): `name` is the one ``named_buffers()`` reports, which the state keeps.
    A step binds every alias to the state's tensor of its name, as torch's modules share it."""
    if not isinstance(model, nn.Module):
        return ()
    first: dict[int, str] = {}
    pairs = []
    for name, tensor in model.named_buffers(remove_duplicate=False):
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            pairs.append((name, owner))
    return tuple(pairs)


def non_persistent_buffers(model: nn.Module | Mapping[str, Tensor]) -> tuple[str, ...] | None:
    """The names (as ``named_buffers()`` gives them) of `model`'s buffers registered with
    ``persistent=False``, which ``state_dict()`` leaves out; None for a mapping of tensors
    (no module: unknown)."""
    if not isinstance(model, nn.Module):
        return None
    return tuple(sorted(
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules(remove_duplicate=False)
        for name in module._non_persistent_buffers_set
        if module._buffers.get(name) is not None))


def check_buffers(
    model: nn.Module, buffers: Mapping[str, Tensor], aliases: Sequence[tuple[str, str]] = (),
) -> None:
    """Raise if `model`'s buffers are not the state's `buffers` (names and shapes).

    The dtypes may differ: ``fzero.init(param_dtype=...)`` casts the state's floating buffers
    as ``model.to(param_dtype)`` would, and leaves the module alone. A name in `aliases`
    (`buffer_aliases`) is the state's buffer of its other name, also when the module now holds
    it as a tensor of its own (``model.to("meta")`` gives each name its own).

    Raises:
        ValueError: naming the buffers only in the state, only in the model, and the shapes
            that differ.
    """
    named = dict(model.named_buffers())
    owner = dict(aliases)
    held = {name: owner.get(name, name) for name in named}  # the state's name of each
    missing = sorted(set(buffers) - set(named))
    extra = sorted(name for name, own in held.items() if own not in buffers)
    wrong = sorted(
        f"{name}: state {tuple(buffers[held[name]].shape)} vs model {tuple(t.shape)}"
        for name, t in named.items()
        if held[name] in buffers and t.shape != buffers[held[name]].shape
    )
    if missing or extra or wrong:
        raise ValueError(
            f"the state's buffers are not the model's: buffers only in the state {missing[:5]}, "
            f"only in the model {extra[:5]}, shapes differing {wrong[:5]} (a buffer registered "
            f"or replaced after fzero.init; build the state again, or register it before init)"
        )


def check_shared_memory(model: nn.Module) -> None:
    """Raise if one of `model`'s buffers is one of its parameters (registered both ways), or a
    buffer, or a tensor it keeps as a plain attribute (directly, or in a list, tuple or dict),
    shares memory with a parameter or a buffer without being the same tensor object:
    ``register_buffer("head", self.stats[:3])``, ``register_buffer("w_sg", self.w.detach())``,
    ``self.w_sg = self.lin.weight.detach()``.

    A state keeps every parameter in its flat buckets and every buffer as a tensor of its own,
    and a step binds those under the registered names; in torch such an alias follows the
    tensor it shares memory with, here it would keep the values it had when the state was
    built, silently. (One tensor under several names is fine: ties and shared buffers are
    bound under every name.) An attribute a forward pre-hook recomputes before every call
    (the hook-based ``spectral_norm``, ``weight_norm`` and pruning keep the hook's ``name``)
    is not read stale and is skipped.

    Raises:
        ValueError: naming the two tensors and what to do instead.
    """
    trained = {id(param): name for name, param in model.named_parameters()
               if param.requires_grad}  # (a frozen one never changes: its copy stays equal)
    for name, buffer in model.named_buffers():
        if id(buffer) in trained:
            raise ValueError(
                f"buffer {name!r} is parameter {trained[id(buffer)]!r} (one tensor registered "
                f"as a trainable parameter and as a buffer): fzero keeps parameters in its "
                f"flat buckets and buffers apart, so the buffer would keep the values it had "
                f"when the state was built and pass no gradient, where torch's is the "
                f"parameter. Read it through the parameter's name, or register a copy if it "
                f"should not train")
    labelled: dict[int, tuple[str, Tensor]] = {}
    for name, param in model.named_parameters():
        labelled.setdefault(id(param), (f"parameter {name!r}", param))
    for name, buffer in model.named_buffers():
        labelled.setdefault(id(buffer), (f"buffer {name!r}", buffer))
    for prefix, module in model.named_modules():
        recomputed = {getattr(hook, "name", None) for hook in module._forward_pre_hooks.values()}
        if isinstance(module, nn.RNNBase):  # its forward reads its weights into this list
            recomputed.add("_flat_weights")  # again whenever one is another tensor
        for attr, key, item in held_tensors(module):
            if attr not in recomputed and id(item) not in labelled:
                where = f"{prefix}.{attr}" if prefix else attr
                where += "" if key is None else f"[{key!r}]"
                labelled[id(item)] = (f"attribute {where!r}", item)
    pair = first_overlap(
        ((label, t) for label, t in labelled.values() if in_memory(t)),
        counts=lambda a, b: not (a.startswith("parameter") and b.startswith("parameter")))
    if pair is None:  # (two parameters: `fzero.plan` raises)
        return
    a, b = pair
    raise ValueError(
        f"{a} and {b} share memory without being one tensor (a view, .detach() or .data of "
        f"the other, kept in the module): fzero keeps parameters in its own flat buckets and "
        f"each buffer as a tensor of its own, so after a step the alias would still hold the "
        f"values it had when the state was built, where torch's would follow. Take the alias "
        f"inside forward (e.g. `self.w.detach()`, `self.stats[:3]`), or register the same "
        f"tensor under both names"
    )


def buffers_fingerprint(buffers: Mapping[str, Tensor]) -> str:
    """A 16-hex-digit hash of the buffers' names, shapes and dtypes, in order (not values)."""
    described = [(name, tuple(t.shape), str(t.dtype)) for name, t in buffers.items()]
    return hashlib.blake2b(repr(described).encode(), digest_size=8).hexdigest()


def requires_grad_flags(
    model: nn.Module | Mapping[str, Tensor],
) -> tuple[tuple[str, bool], ...] | None:
    """Every parameter name (tied names included) with its ``requires_grad``, for
    `check_structure` to tell later whether one changed (`ShardConfig.requires_grad`); None
    for a mapping of tensors, which has no flags of its own to change."""
    if not isinstance(model, nn.Module):
        return None
    return tuple((name, t.requires_grad)
                 for name, t in model.named_parameters(remove_duplicate=False))


class ModuleVersions:
    """Which of a module's own tensors were written or converted since a state was built from it.

    A state takes the module's values once, when it is built (`fzero.init`, or
    `fzero.checkpoint.load` with a model); from then on a step reads the state's tensors and
    never the module's. A write into the module's own parameters or buffers afterwards
    (``model.load_state_dict(pretrained)``, a ``copy_`` under ``no_grad``) or a conversion of
    them (``model.to(torch.bfloat16)``, ``model.cuda()``: the same objects over new data)
    would be silently ignored, so steps look for one: each tensor's version counter, bumped by
    every in-place write, its data pointer, dtype and device are recorded here and compared. A
    tensor the module has since *replaced* (another object under that name:
    ``model.to("meta")``, an assignment) is not watched any more. An in-place write through
    ``.data`` (``p.data.copy_(x)``) bumps no counter: when the state's tensors took their
    values from the module (`taken_into`: ``fzero.init`` of a materialized model, on rank 0,
    whose values every rank takes), the first step compares every watched tensor's values with
    the state's once (`unverified`), which sees such a write made between building the state
    and training it (loading weights through ``.data`` after ``init``), unless the state's own
    tensors were written since (then they, not the module, hold the values to train); later
    writes are not seen. Tensors on ``meta`` hold no values and are not watched.
    """

    def __init__(self, model: nn.Module, *, taken_into: Sequence[Tensor] = ()) -> None:
        self._seen: dict[str, _Seen] = {}
        self._taken = [(weakref.ref(t), t._version) for t in taken_into]
        self.accept(dict(_own_tensors(model)))

    def unverified(self, model: nn.Module) -> dict[str, Tensor]:
        """Every watched tensor `model` still holds, while their values were never compared
        with those of the state's tensors that took them, which nothing wrote since (see the
        class note); else nothing."""
        live = [(ref, version) for ref, version in self._taken if ref() is not None]
        if any(ref()._version != version for ref, version in live):
            live = []  # the state's tensors were written: they hold what trains now
        self._taken = live  # (a dropped state's are gone: its clones', `cloned`, remain)
        if not self._taken:
            return {}
        return {name: tensor for name, seen in self._seen.items()
                if (tensor := seen.ref()) is not None and _holds(model, name, tensor)}

    def cloned(self, pairs: Iterable[tuple[Tensor, Tensor]]) -> None:
        """A state was cloned (`fzero.clone_state`): each ``(original, copy)`` whose original
        took the module's values and was not written since is one more tensor holding them,
        which the first step may compare (the original may be dropped, the clone trained)."""
        taken = {id(ref()): version for ref, version in self._taken if ref() is not None}
        for original, copy in pairs:
            if taken.get(id(original)) == original._version:
                self._taken.append((weakref.ref(copy), copy._version))

    def verified(self) -> None:
        """The watched tensors' values were found to be the state's: `unverified` is empty
        from now on."""
        self._taken = []

    def written(self, model: nn.Module) -> dict[str, Tensor]:
        """The module's tensors (by name, tied names included) that are the objects recorded
        and were written in place or given new data since."""
        found = {}
        for name, seen in self._seen.items():  # no walk of the module: a step's cost
            tensor = seen.ref()
            if (tensor is not None
                    and (tensor._version != seen.version or tensor.data_ptr() != seen.pointer)
                    and _holds(model, name, tensor)):
                found[name] = tensor
        return found

    def kind(self, name: str) -> tuple[torch.dtype, torch.device]:
        """The dtype and device tensor `name` had when it was last seen."""
        return self._seen[name].kind

    def accept(self, tensors: Mapping[str, Tensor]) -> None:
        """Take these tensors as they are now as seen (when the state was built, or when their
        values were found to be the state's: e.g. the state's values exported into the
        module)."""
        for name, tensor in tensors.items():
            if not tensor.is_meta:
                self._seen[name] = _Seen(weakref.ref(tensor), tensor._version,
                                         tensor.data_ptr(), (tensor.dtype, tensor.device))


class _Seen(NamedTuple):
    ref: weakref.ref[Tensor]
    version: int
    pointer: int
    kind: tuple[torch.dtype, torch.device]


def module_versions(model: nn.Module | Mapping[str, Tensor], *,
                    taken_into: Sequence[Tensor] = ()) -> ModuleVersions | None:
    """`ModuleVersions` of `model` now (`ShardConfig.module_versions`); None for a mapping of
    tensors, which a step never sees again. `taken_into`: the state's tensors that took the
    module's values (see `ModuleVersions`)."""
    return (ModuleVersions(model, taken_into=taken_into) if isinstance(model, nn.Module)
            else None)


def _holds(model: nn.Module, name: str, tensor: Tensor) -> bool:
    """Whether `model` still holds `tensor` under `name`."""
    try:
        return _attribute(model, name) is tensor
    except AttributeError:  # the name's module is gone
        return False


def _own_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    return itertools.chain(model.named_parameters(remove_duplicate=False),
                           model.named_buffers(remove_duplicate=False))
