"""The side-stream ordering, proven on CPU with `fzero.EmulatedStreams` and on CUDA where a GPU is.

An emulated stream issues each collective on its own thread after a random delay and completes
it before the next, so a consumer that does not wait for a collective reads a buffer that is not
filled yet: the first test shows that the emulation does expose a missing wait, the parity tests
then run every stage through it (delays before each all-gather, reduction and optimizer step)
and must still equal single-process torch.optim.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import torch

import fzero
from fzero.collect import EmulatedStreams, Streams, all_gather_bucket, reduce_scatter_bucket

import step_bodies as sb
from models import TinyGPT, reference_train

STEPS = 4


def missing_wait_body(comm: Any, delay: float) -> tuple[bool, bool]:
    """Read an all-gather's output before and after waiting for it."""
    layout = fzero.plan({"w": torch.zeros(6)}, comm.world_size)
    bucket = layout.buckets[0]
    shard = torch.full((bucket.shard_numel,), float(comm.rank + 1))
    with EmulatedStreams(seed=comm.rank, max_delay=delay) as streams:
        out = torch.zeros(bucket.padded_numel)
        pending = all_gather_bucket(comm, bucket, shard, out=out, streams=streams)
        early = bool(out.ne(0).all())  # what a consumer that forgot to wait would see
        late = bool(pending.wait().ne(0).all())
    return early, late


def test_emulated_streams_expose_a_missing_wait() -> None:
    outcomes = fzero.SimWorld(2).run(missing_wait_body, 0.05)
    assert all(late for _, late in outcomes)
    assert not any(early for early, _ in outcomes), "a read before wait() saw the gathered data"


def _steps_counting_side_streams(comm: Any, stage: int, monkeypatch: Any) -> int:
    """Three train steps and two eval steps on one pair of step functions; how many times
    they made side streams."""
    made = [0]
    real = Streams.for_device

    def counting(device: Any) -> Any:
        made[0] += 1
        return real(device)

    monkeypatch.setattr(Streams, "for_device", staticmethod(counting))
    model = TinyGPT()
    state = fzero.init(model, stage=stage, optimizer=sb.make_optimizer(("adamw", sb.ADAMW)),
                       comm=comm)
    step = fzero.make_train_step(model, TinyGPT.loss_fn)
    evaluate = fzero.make_eval_step(model, TinyGPT.loss_fn)
    batches, _ = reference()
    for batch in batches[:3]:
        state, _ = step(state, batch)
    for batch in batches[:2]:
        evaluate(state, batch)
    return made[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_step_function_makes_its_side_streams_once(stage: int, monkeypatch) -> None:
    """A train step made new CUDA side streams every step (and stage 3's eval every call):
    torch takes them from a device's fixed pool, which c10d's NCCL streams come from too, so a
    side stream sooner or later shared one with a collective (a static review). Each step
    function makes them once per device (None on CPU, made once all the same)."""
    made = fzero.SimWorld(1).run(_steps_counting_side_streams, stage, monkeypatch)[0]
    assert made == (2 if stage == 3 else 1)  # the train step's, and stage 3's eval step's


def test_emulated_streams_reject_a_negative_delay() -> None:
    with pytest.raises(ValueError, match="max_delay"):
        EmulatedStreams(max_delay=-1.0)


@functools.cache
def reference() -> Any:
    batches = tuple(TinyGPT.make_batch(seed, 12) for seed in range(STEPS))
    factory = functools.partial(torch.optim.AdamW, **sb.ADAMW)
    return batches, reference_train(TinyGPT(), TinyGPT.loss_fn, batches, factory, STEPS)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parity_through_emulated_streams(stage: int, world: int) -> None:
    batches, ref = reference()
    results = fzero.SimWorld(world).run(
        sb.train_body, TinyGPT(), batches, STEPS, stage=stage, accum=2, buckets=300,
        emulated_delay=2e-3,
    )
    for out in results:
        torch.testing.assert_close(torch.tensor(out["losses"], dtype=torch.float64),
                                   torch.tensor(ref.losses, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6)
        for name, value in ref.params.items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-5, atol=1e-6)


class SlowStreams(Streams):
    """CUDA side streams that sleep on the GPU before each collective: the CUDA twin of
    `EmulatedStreams`. A consumer that reads a collective's output without `Pending.wait()`
    (which makes the compute stream wait on the side stream's event) then reads it unfilled."""

    CYCLES = 20_000_000  # ~10 ms at 2 GHz: far longer than the host takes to read on

    def launch(self, role: str, output: Any, inputs: Any, issue: Any) -> Any:
        stream = self.all_gather if role == "all_gather" else self.reduce_scatter
        with torch.cuda.stream(stream):
            torch.cuda._sleep(self.CYCLES)
        return super().launch(role, output, inputs, issue)


def cuda_missing_wait_body(comm: Any) -> tuple[bool, bool]:
    """`missing_wait_body` on the GPU: read an all-gather's output before and after waiting.
    The kernels it reads with run once first, so their lazy loading (which may synchronize the
    device) happens before the collective is in flight."""
    layout = fzero.plan({"w": torch.zeros(6)}, comm.world_size)
    bucket = layout.buckets[0]
    shard = torch.full((bucket.shard_numel,), float(comm.rank + 1), device="cuda")
    out = torch.zeros(bucket.padded_numel, device="cuda")
    out.ne(0).all().item()
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    pending = all_gather_bucket(comm, bucket, shard, out=out, streams=SlowStreams(out.device))
    early = out.ne(0).all().item()  # on the compute stream, which nothing made wait
    late = pending.wait().ne(0).all().item()
    return early, late


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_slow_cuda_streams_expose_a_missing_wait(bare_env: pytest.MonkeyPatch) -> None:
    """Over NCCL, whose collectives follow the issuing stream (a `SimWorld` rank's run on its
    executor thread's default stream, so it cannot show stream ordering)."""
    with fzero.distributed(backend="nccl") as comm:
        early, late = cuda_missing_wait_body(comm)
    assert late
    assert not early, "a read before wait() saw the gathered data: SlowStreams proves nothing"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_host_wait_on_a_helper_thread_leaves_the_compute_stream_free(
    bare_env: pytest.MonkeyPatch,
) -> None:
    """Stage 3 waits for its reductions on a helper thread (`Reducer`'s patience). NCCL's
    `wait()` does not block the host: it makes the calling thread's current stream wait, on a
    helper thread the default stream, which the step computes on; the compute stream then
    stalled until each reduction was done, and backward stopped overlapping its reductions.
    The wait runs on the collective's side stream: the compute stream reads the output before
    the (GPU-delayed) reduction fills it, until `wait()` orders it."""
    with fzero.distributed(backend="nccl") as comm:
        layout = fzero.plan({"w": torch.zeros(6)}, comm.world_size)
        bucket = layout.buckets[0]
        flat = torch.ones(bucket.padded_numel, device="cuda")
        out = torch.zeros(bucket.shard_numel, device="cuda")
        out.ne(0).all().item()
        torch.cuda.synchronize()
        pending = reduce_scatter_bucket(comm, bucket, flat, out=out,
                                        streams=SlowStreams(out.device))
        helper = threading.Thread(target=pending.wait_host)
        helper.start()
        helper.join()
        early = out.ne(0).all().item()  # on the compute stream: nothing should order it yet
        late = pending.wait().ne(0).all().item()
    assert late
    assert not early, "a host wait on a helper thread made the compute stream wait"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("own_stream", [False, True], ids=["default_stream", "own_stream"])
@pytest.mark.parametrize("slow", [False, True], ids=["streams", "slow_streams"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parity_on_cuda_side_streams(
    bare_env: pytest.MonkeyPatch, stage: int, slow: bool, own_stream: bool
) -> None:
    """One rank on the GPU, over NCCL: collectives on the CUDA side streams (delayed by a GPU
    sleep before each, with ``slow``), parity with torch.optim; with ``own_stream`` the steps
    run on a stream of the caller's own, which every wait must order (stage 3 waits for its
    reductions on a helper thread, whose wait orders that thread's stream only)."""
    batches, ref = reference()

    def body(comm: Any) -> Any:
        model = TinyGPT().cuda()
        state = fzero.init(model, stage=stage, optimizer=sb.make_optimizer(("adamw", sb.ADAMW)),
                           comm=comm, device="cuda", buckets=300)
        streams = SlowStreams(torch.device("cuda")) if slow else None
        step = fzero.make_train_step(model, TinyGPT.loss_fn, accum_steps=2, streams=streams)
        losses = []
        for batch in batches:
            state, metrics = step(state, tuple(t.cuda() for t in batch))
            losses.append(metrics["loss"])
        return losses, {k: v.cpu() for k, v in fzero.full_params(state).items()}

    with fzero.distributed(backend="nccl") as comm:
        with torch.cuda.stream(torch.cuda.Stream() if own_stream else torch.cuda.current_stream()):
            losses, params = body(comm)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-4,
                               atol=1e-5)
    for name, value in ref.params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5)
