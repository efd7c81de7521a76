"""Per-rank test bodies for `fzero.collect`: `fn(comm, *args)`, run by SimWorld and GlooPool alike.

Module-level so spawned workers can unpickle them by name. Inputs for every rank are drawn in the
pytest process and shipped whole; each body picks its own with `comm.rank`. Results travel back
as plain tensors, tuples and dicts, and are checked against local references in the test module.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

import fzero
from fzero.collect import Collectives, collectives
from fzero.comm import Comm
from fzero.layout import ShardLayout

Params = Mapping[str, Tensor]


def snapshot(comm: Comm) -> dict[str, dict[str, int]]:
    return comm.counters.snapshot()


# ----------------------------------------------------------------------------------------------
# Data movement


def gather_scatter_body(
    comm: Comm,
    layout: ShardLayout,
    params: Params,
    grads_by_rank: Sequence[Params],
    subset: Sequence[int],
    async_bucket: int,
    reduce_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Every collective of `collectives` once, with the counters after each step.

    Returns `full` (gather of every bucket), `grad_shards` (scatter_grads of this rank's
    gradients), `part` (gather of `subset`), `flat` (gather_async of `async_bucket`), and
    `counts`: counter snapshots after construction, after the full gather, after scatter_grads.
    """
    comm.counters.reset()
    gather, scatter_grads, gather_async = collectives(layout, comm, reduce_dtype=reduce_dtype)
    counts = {"construct": snapshot(comm)}
    shards = fzero.shard(params, layout, comm.rank)
    full = gather(shards)
    counts["gather"] = snapshot(comm)
    grad_shards = scatter_grads(grads_by_rank[comm.rank])
    counts["scatter_grads"] = snapshot(comm)
    return {
        "full": full,
        "grad_shards": grad_shards,
        "part": gather(shards, buckets=subset),
        "flat": gather_async(shards, async_bucket).wait(),
        "counts": counts,
    }


def two_async_gathers_body(
    comm: Comm, layout: ShardLayout, params: Params, first: int, second: int
) -> tuple[Tensor, Tensor, Tensor, bool]:
    """Issue two `gather_async` before waiting on either; wait in reverse order, one twice."""
    _, _, gather_async = collectives(layout, comm)
    shards = fzero.shard(params, layout, comm.rank)
    a = gather_async(shards, first)
    b = gather_async(shards, second)
    out_b = b.wait()
    out_a = a.wait()
    again = a.wait()
    return out_a, out_b, again, again is out_a


# ----------------------------------------------------------------------------------------------
# Autograd through gather


def weighted_square_loss(full: Params, weights: Params) -> Tensor:
    """``sum over names n in weights of sum(w_n * p_n**2)``: names may be tied aliases.

    Each name uses its tensor once, so its gradient reaches autograd as one term (2 w_n p_n)."""
    terms = [(w * full[name].square()).sum() for name, w in weights.items()]
    return torch.stack(terms).sum()


def grad_through_gather_body(
    comm: Comm, layout: ShardLayout, params: Params, weights_by_rank: Sequence[Params]
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """This rank's loss differentiated two ways.

    Returns ``autograd.grad(loss(gather(shards)), shards)`` and ``scatter_grads`` of the loss's
    gradients with respect to a full-parameter copy (one leaf per name, aliases included).
    """
    gather, scatter_grads, _ = collectives(layout, comm)
    weights = weights_by_rank[comm.rank]
    shards = tuple(s.requires_grad_() for s in fzero.shard(params, layout, comm.rank))
    full = gather(shards)
    through_gather = torch.autograd.grad(weighted_square_loss(full, weights), shards)
    leaves = {name: full[name].detach().clone().requires_grad_() for name in weights}
    leaf_grads = torch.autograd.grad(weighted_square_loss(leaves, weights), list(leaves.values()))
    return through_gather, scatter_grads(dict(zip(leaves, leaf_grads, strict=True)))


def adjoint_body(
    comm: Comm, layout: ShardLayout, params: Params, v_by_rank: Sequence[Params]
) -> tuple[float, float]:
    """``(<v_q, gather_q(x)>, <scatter_grads(v)_r, x_r>)`` on this rank (float64 sums)."""
    gather, scatter_grads, _ = collectives(layout, comm)
    shards = fzero.shard(params, layout, comm.rank)
    full = gather(shards)
    v = v_by_rank[comm.rank]
    lhs = sum(float((v[name].double() * full[name].double()).sum()) for name in v)
    grad_shards = scatter_grads(v)
    rhs = sum(
        float((g.double() * s.double()).sum()) for g, s in zip(grad_shards, shards, strict=True)
    )
    return lhs, rhs


def serve_rank_body(
    comm: Comm, layout: ShardLayout, commands: Sequence[queue.Queue], replies: Sequence[queue.Queue]
) -> int:
    """A long-lived rank (SimWorld with ``copy_args=False``) serving forward/backward commands.

    Commands on ``commands[rank]``:
    - ``("forward", key, shards)``: gather fresh leaves copied from `shards`; reply with
      ``cat(gathered[name].flatten() for name in layout.names)`` (aliases included) and keep
      the graph under `key`.
    - ``("backward", key, v)``: reply with ``autograd.grad(out[key], leaves[key], v)``.
    - ``("stop",)``: return the number of graphs kept.

    Each reply is ``("ok", value)`` or ``("error", exception)`` (then the body re-raises).
    """
    inbox, outbox = commands[comm.rank], replies[comm.rank]
    gather, _, _ = collectives(layout, comm)
    graphs: dict[int, tuple[tuple[Tensor, ...], Tensor]] = {}
    while True:
        command = inbox.get(timeout=120)
        if command[0] == "stop":
            return len(graphs)
        try:
            if command[0] == "forward":
                _, key, shards = command
                leaves = tuple(s.detach().clone().requires_grad_() for s in shards)
                full = gather(leaves)
                out = torch.cat([full[name].reshape(-1) for name in layout.names])
                graphs[key] = (leaves, out)
                outbox.put(("ok", out.detach()))
            elif command[0] == "backward":
                _, key, v = command
                leaves, out = graphs[key]
                outbox.put(("ok", torch.autograd.grad(out, leaves, v, retain_graph=True)))
            else:
                raise ValueError(f"unknown command {command[0]!r}")
        except BaseException as exc:
            outbox.put(("error", exc))
            raise


# ----------------------------------------------------------------------------------------------
# Bad input: every rank makes the same bad call; it must raise before any communication


def _wrong_length(shards: Sequence[Tensor]) -> list[Tensor]:
    return [*shards[:-1], torch.zeros(shards[-1].numel() + 1, dtype=shards[-1].dtype)]


def _wrong_dtype(shards: Sequence[Tensor]) -> list[Tensor]:
    return [*shards[:-1], shards[-1].to(torch.float16)]


BadCall = Callable[[Collectives, list[Tensor], Params], object]

BAD_CALLS: dict[str, BadCall] = {
    "gather/wrong length": lambda c, s, p: c.gather(_wrong_length(s)),
    "gather/wrong dtype": lambda c, s, p: c.gather(_wrong_dtype(s)),
    "gather/not a tensor": lambda c, s, p: c.gather([*s[:-1], [0.0]]),
    "gather/too few shards": lambda c, s, p: c.gather(s[:-1]),
    "gather/bucket out of range": lambda c, s, p: c.gather(s, buckets=[0, len(s)]),
    "gather/negative bucket": lambda c, s, p: c.gather(s, buckets=[-1]),
    "gather/repeated bucket": lambda c, s, p: c.gather(s, buckets=[0, 0]),
    "gather_async/wrong length": lambda c, s, p: c.gather_async(_wrong_length(s), len(s) - 1),
    "gather_async/bucket out of range": lambda c, s, p: c.gather_async(s, len(s)),
    "gather_async/negative bucket": lambda c, s, p: c.gather_async(s, -1),
    "scatter_grads/wrong shape": lambda c, s, p: c.scatter_grads({"h.0.w": torch.zeros(4, 3)}),
    "scatter_grads/tied alias wrong shape": lambda c, s, p: c.scatter_grads(
        {"h.0.w": torch.zeros(3, 4), "tied.w": torch.zeros(12)}
    ),
    "scatter_grads/unknown name": lambda c, s, p: c.scatter_grads({"nope.w": torch.zeros(3)}),
    "scatter_grads/not a tensor": lambda c, s, p: c.scatter_grads({"h.1.b": [0.0] * 5}),
    "scatter_grads/bucket out of range": lambda c, s, p: c.scatter_grads({}, buckets=[len(s)]),
}


def bad_call_body(
    comm: Comm, layouts: Sequence[ShardLayout], params: Params, case: str | None
) -> tuple[str, str, bool]:
    """Build `collectives` from ``layouts[rank]``, then make the bad call `case` (if any).

    Returns ``(exception type name, message, whether the counters stayed unchanged)`` for
    the first exception, construction included (``("", "", ...)`` if nothing raised).
    """
    layout = layouts[comm.rank]
    before = snapshot(comm)
    try:
        coll = collectives(layout, comm)
        if case is not None:
            before = snapshot(comm)
            shards = list(fzero.shard(params, layout, comm.rank))
            BAD_CALLS[case](coll, shards, params)
    except Exception as exc:
        return type(exc).__name__, str(exc), snapshot(comm) == before
    return "", "", snapshot(comm) == before


def construct_body(comm: Comm, layouts: Sequence[ShardLayout]) -> int:
    """`collectives(layouts[rank], comm)`, letting any error propagate; the bucket count."""
    collectives(layouts[comm.rank], comm)
    return len(layouts[comm.rank].buckets)


# ----------------------------------------------------------------------------------------------
# Integer (frozen) buckets: no gradient, no communication


def integer_bucket_body(comm: Comm, layout: ShardLayout, params: Params) -> dict[str, Any]:
    """On a layout with a frozen int64 bucket: backward through gather, and scatter_grads."""
    gather, scatter_grads, _ = collectives(layout, comm)
    shards = fzero.shard(params, layout, comm.rank)
    shards = tuple(s.requires_grad_(s.is_floating_point()) for s in shards)
    full = gather(shards)
    out: dict[str, Any] = {}
    try:
        trainable = [s for s in shards if s.requires_grad]
        out["backward"] = torch.autograd.grad((full["w"] * full["w"]).sum(), trainable)
    except Exception as exc:
        out["backward"] = exc
    try:
        out["scatter_grads"] = scatter_grads({"w": 2 * full["w"].detach()})
    except Exception as exc:
        out["scatter_grads"] = exc
    return out


def complex_loss(full: Mapping[str, Tensor], rank: int) -> Tensor:
    """A real loss of a complex and a real parameter that differs per rank."""
    return (full["c"].abs() ** 2).sum() * (rank + 1) + (full["w"] * (rank + 1)).sum()


def complex_bucket_body(comm: Comm, layout: ShardLayout, params: Params) -> dict[str, Any]:
    """On a layout with a trainable complex bucket: the shards' gradients through gather's
    backward, and scatter_grads of the complex parameter's gradient alone."""
    gather, scatter_grads, _ = collectives(layout, comm)
    shards = [s.requires_grad_() for s in fzero.shard(params, layout, comm.rank)]
    complex_loss(gather(shards), comm.rank).backward()
    c = params["c"].detach()
    return {"backward": [s.grad for s in shards],
            "scatter_grads": scatter_grads({"c": 2 * c * (comm.rank + 1)})}


# ----------------------------------------------------------------------------------------------
# Found by a probe of the hand-written-step API (each was silently wrong before)


def double_backward_body(comm: Comm, w: Tensor, x: Tensor) -> str:
    """A gradient penalty on the parameters through `gather` (create_graph=True, then
    differentiate the gradient): the error's text. gloo's reduce-scatter ran its Python
    arithmetic under grad mode, so the second backward saw only this rank's 1/N term."""
    layout = fzero.plan({"w": w}, comm.world_size, trainable=lambda name: True)
    gather = collectives(layout, comm).gather
    shards = [s.requires_grad_() for s in fzero.shard({"w": w}, layout, comm.rank)]
    loss = ((x @ gather(shards)["w"].T) ** 3).sum()
    try:
        (g,) = torch.autograd.grad(loss, shards, create_graph=True)
        torch.autograd.grad(loss + (g**2).sum(), shards)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def reduce_dtype_body(comm: Comm, w: Tensor, grads: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """`collectives(..., reduce_dtype=float32)` on a bfloat16 bucket: the shard gradient from
    gather's backward and from scatter_grads, for this rank's gradient ``grads[rank]``."""
    layout = fzero.plan({"w": w}, comm.world_size, trainable=lambda name: True)
    gather, scatter_grads, _ = collectives(layout, comm, reduce_dtype=torch.float32)
    shards = [s.requires_grad_() for s in fzero.shard({"w": w}, layout, comm.rank)]
    loss = (gather(shards)["w"].float() * grads[comm.rank]).sum()
    (through_gather,) = torch.autograd.grad(loss, shards)
    (scattered,) = scatter_grads({"w": grads[comm.rank].to(w.dtype)})
    return through_gather, scattered


def empty_bucket_body(comm: Comm, params: Params) -> tuple[list[tuple[int, ...]], list[Tensor]]:
    """A bucket of zero-size parameters only (``floor=1``) beside a real one: gather's shapes
    and the gradient shards of a mean over ranks of ``rank + 1``."""
    layout = fzero.plan(params, comm.world_size, floor=1, trainable=lambda name: True)
    gather, scatter_grads, _ = collectives(layout, comm)
    full = gather(fzero.shard(params, layout, comm.rank))
    grads = {name: torch.full_like(p, comm.rank + 1.0) for name, p in params.items()}
    return [tuple(t.shape) for t in full.values()], list(scatter_grads(grads))


def tied_grads_body(comm: Comm, params: Params, x: Tensor) -> dict[str, Any]:
    """Gradients of gather's output dict, as ``autograd.grad`` returns them for its aliases
    (one tensor under both tied names), and of two separate leaves, through scatter_grads."""
    layout = fzero.plan(params, comm.world_size, trainable=lambda name: name != "steps")
    gather, scatter_grads, _ = collectives(layout, comm)
    gathered = gather(fzero.shard(params, layout, comm.rank))
    full = {"emb": gathered["emb"].detach().clone().requires_grad_()}
    full["head"] = full["emb"]  # gather's own aliasing: one tensor, two names

    def loss(p: Params) -> Tensor:
        return ((x @ p["emb"]) @ p["head"].T).pow(2).sum()

    shared = dict(zip(full, torch.autograd.grad(loss(full), list(full.values())), strict=True))
    leaves = {k: v.detach().clone().requires_grad_() for k, v in full.items()}  # two tensors
    separate = dict(zip(leaves, torch.autograd.grad(loss(leaves), list(leaves.values())),
                        strict=True))
    out: dict[str, Any] = {"same_object": shared["emb"] is shared["head"],
                           "shared": scatter_grads(shared), "separate": scatter_grads(separate)}
    try:
        scatter_grads({"emb": torch.zeros(4, 3, dtype=torch.float64), "steps": torch.zeros(2)})
    except ValueError as exc:
        out["integer"] = str(exc)
    try:
        gather(fzero.shard(params, layout, comm.rank), buckets=[True, False])
    except ValueError as exc:
        out["bool"] = str(exc)
    return out
