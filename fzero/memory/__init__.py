"""Model-state memory per rank: the ZeRO paper's formulas, and a small CLI to print them.

Ψ = number of parameters, N = world size (data-parallel degree), K = optimizer bytes per
parameter (12 for mixed-precision Adam: fp32 master copy 4 + two fp32 moments 8). The bytes one
rank holds for parameters, gradients and optimizer state (Rajbhandari et al., SC'20, Section 5):

| stage | partitioned            | bytes per rank                |
|-------|------------------------|-------------------------------|
| 0     | nothing (plain DP)     | (2 + 2 + K)·Ψ                 |
| 1     | optimizer state (P_os) | 2Ψ + 2Ψ + K·Ψ/N               |
| 2     | + gradients (P_os+g)   | 2Ψ + (2 + K)·Ψ/N              |
| 3     | + parameters (P_os+g+p)| (2 + 2 + K)·Ψ/N               |

The 2s are `param_bytes` and `grad_bytes` (bf16/fp16 copies). These are the paper's idealised
numbers: no padding, no activations, no temporary buffers.

Run ``python -m fzero.memory --params 7.5B`` to print a table of GB per rank. `measure` runs one
train step and reports what it really held, split by kind.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = [
    "DEFAULT_WORLD_SIZES",
    "STAGES",
    "EstimateRow",
    "MemoryReport",
    "estimate",
    "estimate_table",
    "format_rows",
    "format_table",
    "main",
    "measure",
    "parse_count",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
    "storage_bytes",
]

STAGES: tuple[int, ...] = (0, 1, 2, 3)
DEFAULT_WORLD_SIZES: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)

# Decimal multipliers for `parse_count`; "B" (billion) and "G" are the same thing.
_SUFFIXES: dict[str, float] = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*\.?[0-9_]*(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]?)\s*$")


class EstimateRow(NamedTuple):
    """Per-rank model-state bytes at one world size, for each ZeRO stage."""

    world_size: int
    stage0: float
    stage1: float
    stage2: float
    stage3: float


def _check_number(name: str, value: object, *, minimum: float) -> float:
    # bool is an int subclass; a flag passed by mistake should not read as 0 or 1.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be an int or float, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {name}={value!r}")
    return float(value)


def _check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(
            f"world_size must be an int >= 1, got {world_size!r} ({type(world_size).__name__})"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size=}")
    return world_size


def estimate(
    num_params: int | float,
    world_size: int,
    stage: int,
    k: int | float = 12,
    param_bytes: int | float = 2,
    grad_bytes: int | float = 2,
) -> float:
    """Model-state bytes one rank holds under a ZeRO stage (the paper's formulas).

    Args:
        num_params: Ψ, the number of parameters (tied weights counted once).
        world_size: N, the data-parallel degree.
        stage: 0 (plain data parallel), 1 (optimizer state partitioned), 2 (+ gradients),
            3 (+ parameters).
        k: optimizer bytes per parameter: 12 for mixed-precision Adam (fp32 master 4 +
            moments 8), 8 for pure-fp32 Adam (the parameters are the master copy).
        param_bytes: bytes per element of the working parameters (2 for bf16/fp16).
        grad_bytes: bytes per element of the gradients (2 for bf16/fp16).

    Returns:
        Bytes per rank, as a float (Ψ/N need not be whole).

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: if ``stage`` is not in 0..3, ``world_size < 1``, or a count is negative.

    Example:
        >>> estimate(7.5e9, 64, stage=1) / 1e9  # the paper's 31.4 GB
        31.40625
    """
    psi = _check_number("num_params", num_params, minimum=0)
    n = _check_world_size(world_size)
    k_ = _check_number("k", k, minimum=0)
    p = _check_number("param_bytes", param_bytes, minimum=0)
    g = _check_number("grad_bytes", grad_bytes, minimum=0)
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"stage must be an int in {STAGES}, got {stage!r} ({type(stage).__name__})")
    if stage == 0:
        return (p + g + k_) * psi
    if stage == 1:
        return p * psi + g * psi + k_ * psi / n
    if stage == 2:
        return p * psi + (g + k_) * psi / n
    if stage == 3:
        return (p + g + k_) * psi / n
    raise ValueError(f"stage must be one of {STAGES}, got {stage=}")


def estimate_table(
    num_params: int | float,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    *,
    k: int | float = 12,
    param_bytes: int | float = 2,
    grad_bytes: int | float = 2,
) -> tuple[EstimateRow, ...]:
    """`estimate` for stages 0–3 at each world size: the rows of the paper's Table 1.

    Args:
        num_params: Ψ, the number of parameters.
        world_sizes: the data-parallel degrees, one row each, in the given order.
        k: optimizer bytes per parameter (see `estimate`).
        param_bytes: bytes per parameter element.
        grad_bytes: bytes per gradient element.

    Returns:
        One `EstimateRow` (bytes per rank for each stage) per world size.

    Raises:
        TypeError, ValueError: as `estimate`, or if ``world_sizes`` is empty.
    """
    if len(world_sizes) == 0:
        raise ValueError(f"world_sizes must name at least one world size, got {world_sizes!r}")
    rows = []
    for n in world_sizes:
        by_stage = (
            estimate(num_params, n, s, k=k, param_bytes=param_bytes, grad_bytes=grad_bytes)
            for s in STAGES
        )
        rows.append(EstimateRow(n, *by_stage))
    return tuple(rows)


def parse_count(text: str) -> float:
    """Parse a parameter count such as ``"7.5e9"``, ``"7.5B"``, ``"350M"``, ``"1T"``, ``"125k"``.

    Suffixes are decimal and case-insensitive: K = 1e3, M = 1e6, B = G = 1e9, T = 1e12.
    Underscores between digits are allowed (``"7_500_000_000"``).

    Args:
        text: the count as written on a command line.

    Returns:
        The count as a float.

    Raises:
        TypeError: if ``text`` is not a string.
        ValueError: if ``text`` is not a non-negative number with an optional known suffix.
    """
    if not isinstance(text, str):
        raise TypeError(f"expected a string such as '7.5B', got {text!r} ({type(text).__name__})")
    if text.strip().startswith("-"):
        raise ValueError(f"a parameter count cannot be negative, got {text!r}")
    match = _COUNT_RE.match(text)
    suffix = match.group(2).upper() if match else ""
    if match is None or suffix not in _SUFFIXES:
        raise ValueError(
            f"cannot parse parameter count {text!r}: expected a number with an optional suffix "
            f"K, M, B (or G), T, e.g. '7.5e9', '7.5B', '350M', '1T'"
        )
    try:
        value = float(match.group(1))
    except ValueError as err:  # e.g. "1__0." slips past the pattern but not float()
        raise ValueError(f"cannot parse parameter count {text!r}: {err}") from None
    return value * _SUFFIXES[suffix]


def format_table(
    rows: Sequence[EstimateRow],
    *,
    num_params: int | float,
    k: int | float = 12,
    param_bytes: int | float = 2,
    grad_bytes: int | float = 2,
) -> str:
    """Render `estimate_table` rows as a plain-text table of GB (1e9 bytes) per rank.

    Args:
        rows: the rows to print, e.g. from `estimate_table`.
        num_params: Ψ, shown in the title line.
        k: optimizer bytes per parameter, shown in the title line.
        param_bytes: bytes per parameter element, shown in the title line.
        grad_bytes: bytes per gradient element, shown in the title line.

    Returns:
        The table as a string with one line per row (no trailing newline).
    """
    title = (
        f"model-state GB (1e9 bytes) per rank: params={num_params:.6g}, k={k:g}, "
        f"param_bytes={param_bytes:g}, grad_bytes={grad_bytes:g}"
    )
    return f"{title}\n{format_rows(rows)}"


def format_rows(rows: Sequence[EstimateRow]) -> str:
    """`rows` as plain-text columns of GB (1e9 bytes) per rank, a header line first (no
    title, no trailing newline): `format_table`'s body, for tables titled elsewhere."""
    headers = ("N", "stage 0", "stage 1 (os)", "stage 2 (os+g)", "stage 3 (os+g+p)")
    cells = [(str(row.world_size), *(f"{b / 1e9:.6g}" for b in row[1:])) for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(lines)


def _count_arg(text: str) -> float:
    try:
        return parse_count(text)
    except ValueError as err:  # argparse turns ArgumentTypeError into a usage error
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Print per-rank model-state memory for stages 0–3 (``python -m fzero.memory``).

    Args:
        argv: command-line arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The process exit status (0). Bad arguments exit with status 2 via argparse.
    """
    parser = argparse.ArgumentParser(
        prog="python -m fzero.memory",
        description="ZeRO model-state memory per rank (paper formulas), in GB = 1e9 bytes.",
    )
    parser.add_argument(
        "--params", type=_count_arg, required=True, help="parameter count: 7.5e9, 7.5B, 350M, 1T"
    )
    parser.add_argument(
        "--world-sizes", type=int, nargs="+", default=list(DEFAULT_WORLD_SIZES), metavar="N"
    )
    parser.add_argument("--k", type=float, default=12.0, help="optimizer bytes per parameter")
    parser.add_argument("--param-bytes", type=float, default=2.0)
    parser.add_argument("--grad-bytes", type=float, default=2.0)
    args = parser.parse_args(argv)
    try:
        rows = estimate_table(
            args.params,
            args.world_sizes,
            k=args.k,
            param_bytes=args.param_bytes,
            grad_bytes=args.grad_bytes,
        )
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    print(
        format_table(
            rows,
            num_params=args.params,
            k=args.k,
            param_bytes=args.param_bytes,
            grad_bytes=args.grad_bytes,
        )
    )
    return 0


# ----------------------------------------------------------------------------------------------
# Measurement: what one train step really holds


class MemoryReport(NamedTuple):
    """One train step's memory on one rank, in bytes.

    Attributes:
        state_bytes: model state owned between steps (parameters, gradients, master copy,
            moments; each storage once), the quantity the stage table predicts.
        gathered_bytes_peak: stage 3's full-parameter buckets alive at once, at their largest.
        grad_bytes_peak: full bucket gradients alive at once while being reduced (stages 2-3).
        peak_bytes: the step's peak above the memory in use when it started: from the CUDA
            caching allocator's statistics, or on CPU from the process's peak resident set
            (``VmHWM``, reset before the step), which also counts freed-but-cached pages.
        other_bytes: ``peak_bytes - gathered_bytes_peak - grad_bytes_peak`` (at least 0):
            activations, autograd buffers and temporaries.
        source: ``"cuda"`` or ``"rss"``.
    """

    state_bytes: int
    gathered_bytes_peak: int
    grad_bytes_peak: int
    peak_bytes: int
    other_bytes: int
    source: str


def measure(step: Callable[[Any, Any], tuple[Any, dict[str, Any]]], state: Any, batch: Any):
    """Run ``step(state, batch)`` once and report its memory (`MemoryReport`).

    Args:
        step: a train step from `fzero.make_train_step`.
        state: its `ShardState`.
        batch: this rank's batch.

    Returns:
        ``(state, metrics, report)``: the step's own results and the memory report.
    """
    device = state.config.device
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        state, metrics = step(state, batch)
        torch.cuda.synchronize(device)
        peak, source = torch.cuda.max_memory_allocated(device) - start, "cuda"
    else:
        start = reset_peak_rss()
        state, metrics = step(state, batch)
        peak, source = max(0, _status_bytes("VmHWM") - start), "rss"
    gathered = int(metrics.get("gathered_bytes_peak", 0))
    grads = int(metrics.get("grad_bytes_peak", 0))
    report = MemoryReport(
        state_bytes=int(metrics["state_bytes"]),
        gathered_bytes_peak=gathered,
        grad_bytes_peak=grads,
        peak_bytes=peak,
        other_bytes=max(0, peak - gathered - grads),
        source=source,
    )
    return state, metrics, report


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages among `tensors` (None skipped; views of one storage, e.g.
    tied weights or a master copy that is the parameters, counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (Linux; 0 where unavailable)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux ``VmHWM``; elsewhere ``ru_maxrss``)."""
    peak = _status_bytes("VmHWM")
    if peak:
        return peak
    try:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    except ImportError:  # pragma: no cover - Windows
        return 0


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes; 0 if unavailable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> int:
    """Reset this process's peak resident set (`peak_rss_bytes`) to the current one, so a
    later peak covers only what runs after (Linux ``/proc/self/clear_refs``; elsewhere the
    peak keeps covering the process's lifetime). Returns the current resident set in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass  # not Linux, or not permitted: the peak then covers the process's lifetime
    return _status_bytes("VmRSS")

