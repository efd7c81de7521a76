"""Stage 3 and the user's own hooks and reads (fzero.residency).

fzero's gathering pre-hooks run before the user's, so a user's forward pre-hook (or forward
hook) that reads its module's weight sees the gathered values and trains like torch. A
parameter read outside any module that owns it raises `fzero.OutsideOwnerError`, naming the
reading module, the parameter and the `buckets=` remedy, and the remedy works.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fzero

import guarantee_bodies as gb
from dist_pool import WorkerError

STAGES = (0, 1, 2, 3)
STEPS = 3


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def add_weight_mean(module: nn.Module, args: Any, output: Tensor) -> Tensor:
    """A forward hook that reads its module's weight after the forward."""
    return output + module.weight.mean()


def hooked() -> gb.PreHooked:
    model = gb.PreHooked()
    model.fc1.register_forward_hook(add_weight_mean)
    return model


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_users_hooks_read_gathered_weights(stage: int, world: int) -> None:
    """Each parameter in its own bucket, so nothing else keeps fc2's weight gathered."""
    model = hooked()
    data = gb.mse_batches(STEPS)
    want = gb.reference(model, gb.mse_loss, data)
    out = fzero.SimWorld(world).run(gb.train, model, gb.mse_loss, data, stage=stage,
                                    buckets=gb.each_parameter_alone(model))
    gb.assert_parity(out[0], want)


def test_the_hooks_change_the_result() -> None:
    """Without its hooks the same model trains differently: the hooks are really exercised."""
    data = gb.mse_batches(STEPS)
    plain = gb.PreHooked()
    plain.fc2._forward_pre_hooks.clear()
    assert gb.max_difference(gb.reference(hooked(), gb.mse_loss, data).params,
                             gb.reference(plain, gb.mse_loss, data).params) > 1e-3


# ----------------------------------------------------------------------------------------------
# Reading a parameter outside its owner


def square(steps: int) -> list[tuple[Tensor, Tensor]]:
    """Batches for the 5 -> 5 models below."""
    return gb.mse_batches(steps, d_in=5, d_out=5)


def outside_error(world: int, model: nn.Module, buckets: Any) -> list[dict[str, Any]]:
    data = square(1)
    outs = fzero.SimWorld(world).run(gb.train_through_failure, model, gb.mse_loss, data,
                                     stage=3, fail={}, buckets=buckets)
    return [out["errors"][0] for out in outs]


def test_root_reading_a_childs_weight_names_it() -> None:
    model = gb.RootReadsChild(read="matmul")
    for error in outside_error(2, model, gb.each_parameter_alone(model)):
        assert error["type"] == "OutsideOwnerError" and error["unchanged"]
        message = error["message"]
        assert "RootReadsChild" in message and "'child.weight'" in message
        assert "buckets=" in message


@pytest.mark.xfail(strict=True, reason=(
    "Residency.explain maps only torch's 'data is not allocated yet' to OutsideOwnerError; "
    "reading a released parameter through a view (w.T as F.linear does, w[0]) raises torch's "
    "'setStorage: ... out of bounds for storage of size 0' RuntimeError, passed on unexplained"))
def test_transposed_read_names_it() -> None:
    model = gb.RootReadsChild(read="transpose")
    for error in outside_error(2, model, gb.each_parameter_alone(model)):
        assert error["type"] == "OutsideOwnerError" and "'child.weight'" in error["message"]


@pytest.mark.xfail(strict=True, reason=(
    "Residency.explain reads self.stack after the exception has unwound every module: the "
    "post-hooks (always_call=True) popped them on the way out, so the error always names the "
    "root module, never the module whose forward read the parameter (here 'parent')"))
def test_nested_reader_is_named() -> None:
    model = gb.ReadsChild(own=True)
    for error in outside_error(2, model, gb.each_parameter_alone(model)):
        assert error["type"] == "OutsideOwnerError"
        assert "module 'parent' (Parent)" in error["message"]
        assert "'parent.child.weight'" in error["message"]


@pytest.mark.parametrize("policy", ["with_scale", "class"])
def test_buckets_remedy_when_the_reader_owns_a_parameter(policy: str) -> None:
    """The remedy the error names: the weight shares a bucket with a parameter the reading
    module owns (listed explicitly, or by the reading module's class)."""
    model = gb.ReadsChild(own=True, read_first=True)
    alone = gb.each_parameter_alone(model)
    assert outside_error(2, model, alone)[0]["type"] == "OutsideOwnerError"
    buckets: Any = gb.Parent if policy == "class" else [
        ["parent.child.weight", "parent.scale"],
        *[names for names in alone if names[0] not in ("parent.child.weight", "parent.scale")]]
    data = square(STEPS)
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, data, stage=3, buckets=buckets)
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, data))


@pytest.mark.xfail(strict=True, reason=(
    "the remedy OutsideOwnerError suggests (buckets= sharing a bucket with parameters the "
    "reading module owns, or a module class whose instances own it) cannot work when the "
    "reading module owns no parameter directly: trigger_modules hooks only modules with "
    "parameters of their own, so buckets=Parent still leaves the bucket released when "
    "Parent.forward reads child.weight before any child runs"))
def test_buckets_remedy_when_the_reader_owns_nothing() -> None:
    model = gb.ReadsChild(own=False, read_first=True)
    data = square(STEPS)
    out = fzero.SimWorld(2).run(gb.train, model, gb.mse_loss, data, stage=3, buckets=gb.Parent)
    gb.assert_parity(out[0], gb.reference(model, gb.mse_loss, data))


@pytest.mark.xfail(strict=True, raises=WorkerError, reason=(
    "an elementwise read of a released parameter outside its owner (w.sum(), w + 1, x * w) "
    "dereferences the zero-byte storage fzero resizes released buckets to: torch does not "
    "check, and the process dies with SIGSEGV instead of raising OutsideOwnerError (run in "
    "gloo workers so that only a worker dies)"))
def test_elementwise_read_raises_instead_of_crashing(gloo_pool: Any) -> None:
    model = gb.RootReadsChild(read="elementwise")
    outs = gloo_pool(2).run(gb.train_through_failure, model, gb.mse_loss, square(1),
                            stage=3, fail={}, buckets=gb.each_parameter_alone(model))
    for out in outs:
        assert out["errors"][0]["type"] == "OutsideOwnerError"
