"""`load`: a checkpoint back into a `ShardState`, at any world size, stage and bucket policy.

Every check comes first (manifest, files, model, optimizer: `fzero.checkpoint.verify`), then
the state is allocated as `fzero.init` lays it out for the new stage and filled straight from
the files: each tensor gets exactly the element ranges it keeps, found by
`fzero.checkpoint.mapping.reads` (the old layout's shards for the new layout's ranges), read
directly into the state's memory. Nothing else is held: no full model, no whole bucket beyond
the state's own buffers, and with an unchanged layout one read per stored shard.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from fzero.bound import (
    buffer_aliases,
    check_shared_memory,
    module_versions,
    non_persistent_buffers,
    requires_grad_flags,
)
from fzero.checkpoint import record
from fzero.checkpoint.files import ShardFile
from fzero.checkpoint.manifest import CheckpointError, Manifest, Pin, read_pinned
from fzero.checkpoint.mapping import compare, reads
from fzero.checkpoint.verify import verify
from fzero.comm import Comm, check_comm, fingerprint_check
from fzero.flat import all_finite
from fzero.layout import ShardLayout, _parse_dtype, flatten_names, plan
from fzero.optim import Optimizer, OptimizerSpec, from_spec
from fzero.state import (
    STAGES,
    ShardState,
    check_dtypes,
    check_optimizer_dtype,
    check_reduce_dtype,
    default_master_dtype,
    shared_lineage,
    state_device,
)

__all__ = ["Reader", "load"]


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Mapping[str, Tensor],
    comm: Comm,
    optimizer: Optimizer | None = None,
    stage: int | None = None,
    buckets: Any = None,
    trainable: Any = None,
    param_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    weights_only: bool = False,
    verify_checksums: bool = True,
    restore_rng: bool = True,
) -> ShardState:
    """Load a checkpoint written by `fzero.save` into this rank's `ShardState` (a collective).

    Same world size, stage and buckets: the state is bitwise the saved one, and training on
    continues exactly as the uninterrupted run (unless forward changes a non-persistent
    buffer, which comes from `model`, see below). Anything else is resharded while loading.
    Buffers: at the saved world size each rank gets its own (they differ under
    ``buffers="local"``); at another, every rank gets saved rank 0's (as a DDP run's
    checkpoint of rank 0's ``state_dict()``), and other ranks' local statistics are dropped.

    Args:
        path: the checkpoint directory.
        model: the module to train (any device, ``meta`` included: only its parameter names,
            shapes and buffers are read), or a mapping of parameter names to tensors. Its
            non-persistent buffers keep the values it holds (as ``load_state_dict`` leaves
            them: a rotary ``inv_freq`` of another ``rope_theta``), or on ``meta`` the saved;
            one saved persistent raises (`CheckpointError`), as torch's strict
            ``load_state_dict`` does (its saved value would be dropped).
        comm: this rank's communicator; every rank must call `load`.
        optimizer: the optimizer; default: rebuilt from the manifest (required when the saved
            one used a learning-rate schedule, which cannot be stored).
        stage: ZeRO stage to continue with; default the saved one.
        buckets: bucket policy as for `fzero.plan`; default the saved buckets.
        trainable: which parameters train, as for `fzero.plan`; default, as for `fzero.init`,
            the model's ``requires_grad`` (for a mapping of tensors: as saved). A parameter
            frozen when saved that trains now needs `weights_only` (it has no moments).
        param_dtype, master_dtype, reduce_dtype: as for `fzero.init`; default as saved
            (the model's own dtypes are not read: a float32 skeleton of a float64 run
            loads float64), except that the master copy is widened, as `init` makes
            it, to parameters wider than the saved master (``param_dtype=float64``).
        device: where the state lives; default the comm's device.
        weights_only: start a fresh optimizer (zero moments, step 0) from the saved weights
            (master copy where stored); required when the checkpoint has no optimizer state.
        verify_checksums: read every file once (spread over the ranks) to check its CRC-32
            before loading; headers and sizes are always checked.
        restore_rng: at an unchanged world size, set this rank's RNG states (CPU, and CUDA on a
            CUDA device) to those saved by the same rank.

    Returns:
        The state, with zero gradients.

    Raises:
        CheckpointError: naming the file and the problem, before any state is built: not a
            checkpoint, a newer format version, a missing, truncated or corrupt shard file, a
            checkpoint of another model (parameter names or shapes differ: listed), no
            optimizer state without `weights_only`, or an optimizer whose moments differ.
        CheckpointError: ranks that disagree on the checkpoint (another save), the layout
            (the model, `buckets=`, `trainable=`), the stage or the dtypes; every rank raises.
        ValueError: bad `stage`.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"load: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    check_comm(comm, "load")
    check_dtypes(param_dtype=param_dtype, master_dtype=master_dtype, reduce_dtype=reduce_dtype)
    if isinstance(model, nn.Module):
        check_shared_memory(model)
    manifest, pin = read_pinned(path)
    saved = manifest.state
    stage = manifest.stage if stage is None else stage
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage=}")
    if not saved["optimizer_state"] and not weights_only:
        raise CheckpointError(
            f"{path} holds no optimizer state (saved with optimizer_state=False): load it "
            f"with weights_only=True to start a fresh optimizer from its weights"
        )
    param_dtype = _dtype(saved["param_dtype"]) if param_dtype is None else param_dtype
    reduce_dtype = _dtype(saved["reduce_dtype"]) if reduce_dtype is None else reduce_dtype
    device = state_device(device, comm)
    layout = _layout(path, manifest, model, comm.world_size, buckets, trainable, param_dtype,
                     weights_only)
    if master_dtype is None:
        master_dtype = _master_dtype(saved, layout, manifest.layout)
    check_reduce_dtype(reduce_dtype, layout)
    optimizer = _optimizer(path, manifest, optimizer, weights_only)
    check_optimizer_dtype(optimizer, master_dtype)
    aliases = _buffer_aliases(manifest, model)
    buffer_names = _check_buffers(path, manifest, model, aliases)
    from_model = _model_owned_buffers(model, buffer_names)
    # One checkpoint, read alike: ranks given different ones (another run's save at the same
    # step) mixed them into one state silently, a probe found (a path may differ: mounts).
    call = {**layout.parts(),
            "the checkpoint (its save id, step and world size)": repr(
                (manifest.save_id, saved["step"], manifest.world_size)),
            "stage, dtypes (param, master, reduce), weights_only": repr(
                (stage, param_dtype, master_dtype, reduce_dtype, weights_only)),
            "the optimizer and its hyperparameters": optimizer.describe(),
            # Which buffers take the model's own values (non-persistent, not on meta): ranks
            # that differ would hold different buffers, or raise alone below.
            "the model's non-persistent buffers it holds values for": repr(sorted(from_model))}
    try:
        fingerprint_check(comm, repr((layout.fingerprint, *list(call.values())[-4:])),
                          "load call", parts=call)
    except ValueError as error:
        raise CheckpointError(f"load {path}: {error}; nothing was loaded") from None
    verify(path, manifest, comm, checksums=verify_checksums, pin=pin)

    # Each rank's own buffers (they differ under buffers="local"); at another N, rank 0's.
    own_buffers = comm.rank if manifest.world_size == comm.world_size else 0
    _check_persistence(path, saved, from_model)
    with Reader(path, manifest, layout) as reader:
        state = record.build(
            layout, stage, record.steps_by_every_name(saved, manifest.layout), reader.fill,
            comm=comm, optimizer=optimizer,
            param_dtype=param_dtype, master_dtype=master_dtype, reduce_dtype=reduce_dtype,
            device=device, buffers={
                name: from_model.get(name) or functools.partial(reader.buffer, rank=own_buffers)
                for name in buffer_names},
            same_buckets=[b.names for b in layout.buckets]
            == [b.names for b in manifest.layout.buckets],
            fresh_optimizer=weights_only,
            requires_grad=requires_grad_flags(model),
            module_versions=module_versions(model),
            buffer_aliases=aliases,
            non_persistent=non_persistent_buffers(model),
        )
        if restore_rng and manifest.world_size == comm.world_size:
            reader.restore_rng(comm.rank, device)
    # A rank's files may have been opened after the directory was replaced: every rank
    # learns of it (the reads themselves do not raise, so the ranks stay in step).
    _check_loaded(path, state, comm, pin)
    return dataclasses.replace(state, lineage=shared_lineage(comm))  # a state of its own


class Reader:
    """Reads a checkpoint's stored values into tensors of a (possibly different) layout.

    Shard files are opened on first use and closed with the reader; with a `pin`, opening one
    raises if the directory was replaced since the manifest was read (one process: the
    offline tools; a load checks every rank's `Pin` together at its end).
    """

    def __init__(self, path: str, manifest: Manifest, layout: ShardLayout,
                 pin: Pin | None = None) -> None:
        self.path = path
        self.manifest = manifest
        self.layout = layout
        self.pin = pin
        self._located = manifest.layout.locate()
        self._master = set(manifest.state["master"])
        self._master_dtype = record.stored_dtype(manifest.state, manifest.layout, record.MASTER,
                                                 0)
        self._files: dict[int, ShardFile] = {}

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def file(self, rank: int) -> ShardFile:
        """The shard file of saved rank `rank`."""
        if rank not in self._files:
            if self.pin is not None:
                self.pin.check()
            entry = self.manifest.files[rank]
            self._files[rank] = ShardFile(os.path.join(self.path, entry.name))
        return self._files[rank]

    def fill(self, kind: str, bucket: int, out: Tensor, lo: int) -> None:
        """``out[:] = `` elements ``[lo, lo + out.numel())`` of the new layout's bucket
        `bucket`, of `kind` (see `fzero.checkpoint.record.Fill`); padding is zero."""
        target = self.layout.buckets[bucket]
        hi = lo + out.numel()
        if hi > target.numel:  # the padding (past the last entry) is zero
            out[max(0, target.numel - lo):].zero_()
        for read in reads(self.manifest.layout, self.layout, bucket, lo, hi,
                          located=self._located):
            source = self._source(kind, read.bucket, out.dtype)
            piece = out[read.at : read.at + read.stop - read.start]
            self.file(read.rank).read_into(source, read.start, read.stop, piece)

    def buffer(self, name: str, rank: int = 0) -> Tensor:
        """Saved rank `rank`'s buffer `name` (rank 0's where the checkpoint holds only its)."""
        own = rank if self.manifest.state.get("rank_buffers", False) else 0
        return self.file(own).read(record.key(record.BUFFERS, name))

    def restore_rng(self, rank: int, device: torch.device) -> None:
        """Set this process's RNG states to those saved by rank `rank`."""
        for name in self.manifest.files[rank].rng:
            value = self.file(rank).read(name)
            if name == "rng.cpu":
                torch.set_rng_state(value)
            elif name == "rng.cuda" and device.type == "cuda":
                torch.cuda.set_rng_state(value, device)

    def _source(self, kind: str, old_bucket: int, dtype: torch.dtype) -> str:
        """The stored tensor that feeds `kind`: parameters of another dtype come from the
        master copy when there is one at least as wide (exact; a narrower one, float16 under
        float32 parameters, saved before its first update, rounded the parameters it did not
        yet equal), a master copy from the parameters when the parameters were the master
        copy."""
        stored_params = self.manifest.layout.buckets[old_bucket].torch_dtype
        has_master = old_bucket in self._master
        narrower = has_master and self._master_dtype.itemsize < stored_params.itemsize
        if kind == record.PARAMS and (stored_params == dtype or not has_master or narrower):
            return record.key(record.PARAMS, old_bucket)
        if kind in (record.PARAMS, record.MASTER):
            return record.key(record.MASTER if has_master else record.PARAMS, old_bucket)
        return record.key(kind, old_bucket)


def _check_loaded(path: str, state: ShardState, comm: Comm, pin: Pin) -> None:
    """Every rank raises if on any rank the checkpoint directory was replaced during the load
    (`Pin`), or any rank loaded a NaN or infinite parameter (caught here, before training
    could spread it), naming the parameters this rank found."""
    bad = []
    for flat, bucket in zip(state.params, state.layout.buckets, strict=True):
        if all_finite(flat):
            continue
        lo = 0 if state.stage < 3 else bucket.shard_range(comm.rank)[0]
        for entry in bucket.entries:
            start, end = max(entry.offset - lo, 0), min(entry.end - lo, flat.numel())
            if start < end and not all_finite(flat[start:end]):
                bad.append(entry.name)
    flags = torch.tensor([float(pin.moved), float(bool(bad))], dtype=torch.float64,
                         device=getattr(comm, "device", "cpu"))
    comm.all_reduce(flags, op="max", label="of whether the loaded parameters are finite")
    somewhere_replaced, nonfinite = flags.tolist()
    if somewhere_replaced:
        raise pin.error()
    if nonfinite:
        raise CheckpointError(
            f"{path}: loaded parameters hold NaN or infinite values "
            f"({_short(bad) if bad else 'in the part another rank loaded'}); the checkpoint "
            f"was saved from a diverged run or is damaged"
            + (f", or holds values beyond param_dtype {state.config.param_dtype}'s range"
               if state.config.param_dtype is not None else "")
        )


# --- checks, all before any tensor is allocated ---------------------------------------------


def _layout(
    path: str,
    manifest: Manifest,
    model: nn.Module | Mapping[str, Tensor],
    world_size: int,
    buckets: Any,
    trainable: Any,
    param_dtype: torch.dtype | None,
    weights_only: bool,
) -> ShardLayout:
    """The new layout, after checking that `model` is the saved model."""
    saved = manifest.layout
    model = _retied(model, saved, check_flags=trainable is None)
    planned = plan(model, world_size)
    mismatch = compare(saved, planned)
    if mismatch:
        raise CheckpointError(
            f"{os.path.join(path, 'manifest.json')} is a checkpoint of another model: "
            f"{_listing('parameters only in the checkpoint', mismatch.only_old)}"
            f"{_listing('parameters only in the model', mismatch.only_new)}"
            f"{_listing('shapes differ (checkpoint vs model)', mismatch.shapes)}"
            f"{_listing(_GAINED_TIES, [' = '.join(names) for names in mismatch.ties])}"
        )
    as_saved = {name: saved.buckets[i].trainable for name, (i, _) in saved.locate().items()}
    flags = trainable
    if flags is None:  # as fzero.init: the module's requires_grad (a mapping: as saved)
        flags = dict(requires_grad_flags(model) or as_saved)
    # A tie lost on meta was restored above (`_retied`); one the model lost while holding
    # separate tensors is untied.
    located = planned.locate()
    untied = any(len({located[name][1].name for name in entry.names}) > 1
                 for bucket in saved.buckets for entry in bucket.entries)
    if buckets is None and flags == as_saved and not untied:
        layout = saved.with_world_size(world_size)
    else:
        # The saved buckets, in the model's names: a tie the model no longer has (each name its
        # own tensor now, read from the one stored) puts both names in the tie's bucket.
        stored = {entry.name for bucket in planned.buckets for entry in bucket.entries}
        groups = [[name for entry in bucket.entries for name in entry.names if name in stored]
                  for bucket in saved.buckets] if buckets is None else buckets
        layout = _as_saved_dtypes(path, plan(model, world_size, buckets=groups,
                                             trainable=flags), saved)
    if param_dtype is not None:
        layout = layout.cast(param_dtype)
    was = saved.locate()
    unfrozen = sorted(name for name, (i, _) in layout.locate().items()
                      if layout.buckets[i].trainable and not saved.buckets[was[name][0]].trainable)
    if unfrozen and not weights_only:
        raise CheckpointError(
            f"{path}: parameters frozen when saved are trainable now and have no optimizer "
            f"state: {_short(unfrozen)}; pass weights_only=True to start a fresh optimizer"
        )
    return layout


def _master_dtype(saved: Mapping[str, Any], layout: ShardLayout,
                  saved_layout: ShardLayout) -> torch.dtype:
    """The master copy's default dtype: as saved, unless the parameters now are wider than
    both it and the saved parameters (``param_dtype=torch.float64`` for a float32 run): then
    theirs, as `fzero.init` makes it. A master chosen narrower than its parameters (float16
    under float32) stays so."""
    master = _dtype(saved["master_dtype"])
    wider = default_master_dtype(layout)
    if wider.itemsize > max(master.itemsize, default_master_dtype(saved_layout).itemsize):
        return wider
    return master


def _as_saved_dtypes(path: str, layout: ShardLayout, saved: ShardLayout) -> ShardLayout:
    """`layout`, planned on the model, with each floating bucket in the dtype its parameters
    were saved in: a skeleton built in another dtype (float32 for a float64 run, ``half()``)
    says only names and shapes, as when the saved buckets are kept. A bucket whose parameters
    were saved in several dtypes raises."""
    was = saved.locate()
    buckets = []
    for bucket in layout.buckets:
        dtypes = {saved.buckets[was[entry.name][0]].torch_dtype for entry in bucket.entries}
        if not bucket.torch_dtype.is_floating_point or not dtypes:
            buckets.append(bucket)
            continue
        if len(dtypes) > 1:
            raise CheckpointError(
                f"{path}: bucket {bucket.label!r} of the new bucket policy holds parameters "
                f"saved in different dtypes ({sorted(str(d) for d in dtypes)}; the model "
                f"holds them in one): pass param_dtype=, or build the model in the saved "
                f"dtypes so that the policy separates them"
            )
        buckets.append(bucket.cast(dtypes.pop()))
    return ShardLayout(tuple(buckets), layout.world_size, layout.version)


def _optimizer(
    path: str, manifest: Manifest, optimizer: Optimizer | None, weights_only: bool
) -> Optimizer:
    saved = manifest.state
    if optimizer is None:
        if saved["optimizer"] is None:
            raise CheckpointError(
                f"{path} records no optimizer (the state's optimizer was not built by "
                f"fzero.optim): pass optimizer="
            )
        spec = OptimizerSpec.from_json(saved["optimizer"])
        if spec.schedule:
            raise CheckpointError(
                f"{path} was trained with a learning-rate schedule ({spec.name}), which a "
                f"checkpoint cannot store: pass the optimizer again, e.g. optimizer="
                f"fzero.optim.{spec.name}(lr=<the schedule>, ...)"
            )
        optimizer = from_spec(spec)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be an fzero.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    names = sorted(optimizer.init([]))
    if not weights_only and names != saved["moments"]:
        raise CheckpointError(
            f"{path} holds optimizer moments {saved['moments']}, but the optimizer keeps "
            f"{names}: pass the optimizer it was trained with (or weights_only=True)"
        )
    return optimizer


def _buffer_aliases(
    manifest: Manifest, model: nn.Module | Mapping[str, Tensor]
) -> tuple[tuple[str, str], ...]:
    """The model's buffer aliases (`fzero.bound.buffer_aliases`), and the saved ones it lost
    only by moving to ``meta`` (which gives each name of one buffer its own tensor), as
    `_retied` restores the ties of parameters."""
    own = buffer_aliases(model)
    if not isinstance(model, nn.Module):
        return own
    named = dict(model.named_buffers())
    lost = tuple((alias, name) for alias, name in manifest.buffer_aliases.items()
                 if alias in named and name in named
                 and named[alias].is_meta and named[name].is_meta)
    return own + lost


def _check_buffers(
    path: str, manifest: Manifest, model: nn.Module | Mapping[str, Tensor],
    aliases: tuple[tuple[str, str], ...],
) -> list[str]:
    """The model's buffer names the state keeps (aliases left out), after checking that they
    are the saved ones."""
    named = dict(model.named_buffers()) if isinstance(model, nn.Module) else {}
    for alias, _ in aliases:
        named.pop(alias, None)
    saved = manifest.buffers
    only_saved = sorted(set(saved) - set(named))
    only_model = sorted(set(named) - set(saved))
    shapes = sorted(f"{n}: {list(saved[n][1])} vs {list(named[n].shape)}"
                    for n in set(saved) & set(named) if tuple(named[n].shape) != saved[n][1])
    dtypes = sorted(f"{n}: {saved[n][0]} vs {str(named[n].dtype).removeprefix('torch.')}"
                    for n in set(saved) & set(named)
                    if not _same_kind(_dtype(saved[n][0]), named[n].dtype))
    if only_saved or only_model or shapes or dtypes:
        raise CheckpointError(
            f"{os.path.join(path, 'manifest.json')} is a checkpoint of another model: "
            f"{_listing('buffers only in the checkpoint', only_saved)}"
            f"{_listing('buffers only in the model', only_model)}"
            f"{_listing('buffer shapes differ (checkpoint vs model)', shapes)}"
            f"{_listing('buffer dtypes differ (checkpoint vs model)', dtypes)}"
        )
    return list(named)


def _model_owned_buffers(
    model: nn.Module | Mapping[str, Tensor], names: list[str]
) -> dict[str, Callable[[str], Tensor]]:
    """Readers of the model's own values for its non-persistent buffers among `names` that it
    holds on a device (not meta): torch's ``load_state_dict`` never touches those (rotary
    ``inv_freq``: a model built with another ``rope_theta`` keeps its own), so `load` takes them
    from the model too; it took the checkpoint's, silently (a probe). On meta the checkpoint's
    are the only values there are."""
    if not isinstance(model, nn.Module):
        return {}
    non_persistent = set(non_persistent_buffers(model) or ())
    named = dict(model.named_buffers())
    return {name: lambda _, value=named[name]: value.detach().clone()
            for name in names
            if name in non_persistent and name in named and not named[name].is_meta}


def _check_persistence(path: str, saved: Mapping[str, Any], from_model: Mapping[str, Any]
                       ) -> None:
    """Raise if a buffer the model registers non-persistent (whose value a load takes from the
    model) was saved persistent: its saved value is data the model would replace silently,
    where torch's strict ``load_state_dict`` refuses the pair (an unexpected key). Checkpoints
    written before fzero recorded persistence are not checked."""
    recorded = saved.get("non_persistent_buffers")
    if recorded is None:
        return
    persistent = sorted(set(from_model) - set(recorded))
    if persistent:
        raise CheckpointError(
            f"{os.path.join(path, 'manifest.json')}: buffers {persistent[:8]} were saved "
            f"persistent (their values are in the checkpoint) but the model registers them with "
            f"persistent=False, so the load would take the model's own values and drop the "
            f"saved ones (torch's strict load_state_dict refuses this as unexpected keys). "
            f"Register them as persistent, or load into a model on 'meta' (which takes the "
            f"saved values)")


def _retied(
    model: nn.Module | Mapping[str, Tensor], saved: ShardLayout, *, check_flags: bool = True
) -> nn.Module | Mapping[str, Tensor]:
    """`model` with the saved ties that it lost only by moving to `meta` restored, for planning
    (``model.to("meta")`` gives each name of a tied weight its own tensor): a new bucket policy
    planned on the untied names stored and trained the tie as two parameters. A copy (on meta:
    no memory); the user's model is left alone. `check_flags`: raise if the names of a tie
    restored so differ in ``requires_grad`` (the first name's decided, silently: a probe)."""
    if not isinstance(model, nn.Module | Mapping):
        return model  # (plan names what it takes)
    named = (dict(model.named_parameters(remove_duplicate=False))
             if isinstance(model, nn.Module) else flatten_names(model))
    lost = [entry for bucket in saved.buckets for entry in bucket.entries
            if entry.aliases and all(isinstance(named.get(name), Tensor) and named[name].is_meta
                                     for name in entry.names)]  # (another model: named later)
    if not lost:
        return model
    for entry in lost if check_flags else ():  # one tensor: which flag would it take?
        flags = {name: named[name].requires_grad for name in entry.names}
        if len(set(flags.values())) > 1:
            raise CheckpointError(
                f"{entry.names} are one tied tensor in the checkpoint, which the model (on "
                f"meta, where the names hold separate tensors) marks differently: "
                f"requires_grad {flags}. Set the same flag on every name (or pass trainable=)")
    if not isinstance(model, nn.Module):
        for entry in lost:
            named.update(dict.fromkeys(entry.aliases, named[entry.name]))
        return named
    model = copy.deepcopy(model)
    for entry in lost:
        owner = model.get_parameter(entry.name)
        for alias in entry.aliases:
            parent, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(parent), leaf, owner)
    return model


def _same_kind(saved: torch.dtype, model: torch.dtype) -> bool:
    """Whether a buffer saved as `saved` can be the model's of dtype `model`: both floating
    (the state keeps floating buffers in its compute dtype), or the same dtype."""
    return saved == model or (saved.is_floating_point and model.is_floating_point)


_GAINED_TIES = ("tied in the model (one tensor) but separate in the checkpoint, each with "
                "values of its own (untie them in the model, or tie them before saving)")


def _listing(what: str, names: tuple[str, ...] | list[str]) -> str:
    return f"{what}: {_short(names)}; " if names else ""


def _short(names: tuple[str, ...] | list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else _parse_dtype(name)

