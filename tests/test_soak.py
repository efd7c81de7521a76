"""The soak of examples/soak.py, short: 200 ZeRO-3 steps of the small GPT on 2 spawned gloo ranks
leak no memory, threads or file descriptors after the warm-up and give bitwise the losses of one
torch process (the full 2,000 steps: ``python examples/soak.py``; numbers in the README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/{task,fd}")
def test_soak_short(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "soak.py"), "--steps", "200", "--json",
         str(out)],
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["passed"] and result["loss_max_rel_diff"] == 0.0
    assert result["losses"] == result["reference"] and len(result["losses"]) == 200
    assert result["losses"][-1] < result["losses"][0] - 1.0  # it trains
    for rank in result["ranks"]:
        assert rank["rss_worst_growth"] <= 0.01, rank
        assert rank["threads"][0] == rank["threads"][1] and rank["fds"][0] == rank["fds"][1]
        assert len(rank["rss_mib"]) >= 3  # samples after the warm-up, not just the end


def test_soak_refuses_a_batch_the_ranks_cannot_split() -> None:
    """At 3 ranks the default global batch of 8 kept 2 rows per rank (6 of 8 trained), while
    its reference trained on all 8: the soak reported a 4% loss mismatch as fzero's failure
    (a probe). It is an argument error now, as in train_gpt.py."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "soak.py"), "--steps", "12", "--nproc", "3"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120)
    assert done.returncode == 2
    assert "--batch-size 8 must be a multiple of the 3 ranks" in done.stderr
