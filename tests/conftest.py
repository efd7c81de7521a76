"""Shared pytest configuration: hypothesis profiles (`HYPOTHESIS_PROFILE=dev|ci`)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci",
    max_examples=500,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# ----------------------------------------------------------------------------------------------
# gloo worker pools (tests/dist_pool.py), owned by fzero.comm's tests; usable by any test:
#     def test_x(gloo_pool):
#         results = gloo_pool(2).run(body, *args)   # body(comm, *args) on 2 gloo ranks

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gloo_pool():
    """Factory `world_size -> GlooPool`: one long-lived pool per world size per session."""
    from dist_pool import GlooPool

    pools: dict[int, GlooPool] = {}

    def get(world_size: int) -> GlooPool:
        if world_size not in pools:
            pools[world_size] = GlooPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a test module (`pytestmark = pytest.mark.usefixtures(...)`):
    tiny kernels run ~3x slower with intra-op threads fighting SimWorld's rank threads for
    2 cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher in the environment (torchrun's and Slurm's variables removed): the
    `fzero.distributed()` of a test is then a world of one process."""
    from fzero import launch

    for name in (*launch._TORCHRUN_VARS, *launch._SLURM_VARS):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch
