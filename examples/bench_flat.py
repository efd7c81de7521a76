"""Throughput of fzero's pure data movement against a plain ``torch.cat`` of the same bytes.

    python examples/bench_flat.py                 # ~1 GiB of float32 transformer parameters
    python examples/bench_flat.py --gib 0.25 --world-size 3

The parameter set is a GPT-like model (d_model 1024, vocab 8192) with as many blocks as fit
in ``--gib``. Each operation is timed ``--repeats`` times after one warm-up; the table shows
the median (min–max), the bytes it writes, and its throughput as a fraction of ``torch.cat``
copying every parameter into one flat tensor (1.00 = as fast as a plain copy).

- ``flatten``: every bucket's padded flat buffer (all bytes).
- ``shard (one rank)``: rank 0's shard of every bucket (1/N of the bytes).
- ``shard (all ranks)``: every rank's shards, one call per rank (all bytes).
- ``unshard``: the parameters back from all ranks' shards (all bytes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fzero

D_MODEL, VOCAB = 1024, 8192


def transformer_params(gib: float) -> dict[str, torch.Tensor]:
    """GPT-like float32 parameters totalling about ``gib`` GiB (at least one block)."""
    d = D_MODEL
    block = {
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.qkv.weight": (3 * d, d),
        "attn.qkv.bias": (3 * d,),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.fc.weight": (4 * d, d),
        "mlp.fc.bias": (4 * d,),
        "mlp.proj.weight": (d, 4 * d),
        "mlp.proj.bias": (d,),
    }
    block_numel = sum(torch.Size(s).numel() for s in block.values())
    embed_numel = VOCAB * d + 2 * d
    n_blocks = max(1, round((gib * 2**30 / 4 - embed_numel) / block_numel))
    gen = torch.Generator().manual_seed(0)
    shapes = {"tok_emb.weight": (VOCAB, d)}
    for i in range(n_blocks):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: first-touch page faults and allocator growth
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="parameter bytes, in GiB")
    ap.add_argument("--world-size", type=int, default=4, help="simulated number of ranks")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    params = transformer_params(args.gib)
    total = sum(p.numel() * p.element_size() for p in params.values())
    layout = fzero.plan(params, args.world_size)
    n = args.world_size
    shards_by_rank = [fzero.shard(params, layout, r) for r in range(n)]
    shard_bytes = sum(s.numel() * s.element_size() for s in shards_by_rank[0])
    padded = layout.padded_numel * 4

    rows = [  # (name, bytes written, fn)
        (
            "torch.cat (baseline)",
            total,
            lambda: torch.cat([p.reshape(-1) for p in params.values()]),
        ),
        ("fzero.flatten", padded, lambda: fzero.flatten(params, layout)),
        ("fzero.shard (one rank)", shard_bytes, lambda: fzero.shard(params, layout, 0)),
        (
            "fzero.shard (all ranks)",
            padded,
            lambda: [fzero.shard(params, layout, r) for r in range(n)],
        ),
        ("fzero.unshard", padded, lambda: fzero.unshard(shards_by_rank, layout)),
    ]
    print(
        f"{len(params)} float32 tensors, {total / 2**30:.3f} GiB, {len(layout.buckets)} buckets, "
        f"world size {n}, {torch.get_num_threads()} threads, median of {args.repeats}\n"
    )
    print("| operation | bytes written | median ms (min–max) | GB/s | vs torch.cat |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for name, nbytes, fn in rows:
        times = timed(fn, args.repeats)
        med = statistics.median(times)
        rate = nbytes / med
        base = base or rate
        print(
            f"| {name} | {nbytes / 2**20:,.0f} MiB | {med * 1e3:,.1f} "
            f"({min(times) * 1e3:,.1f}–{max(times) * 1e3:,.1f}) | {rate / 1e9:.2f} "
            f"| {rate / base:.2f} |"
        )


if __name__ == "__main__":
    main()
