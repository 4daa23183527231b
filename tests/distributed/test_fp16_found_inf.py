"""fp16 loss scaling across the grid (issue 22): one rank's overflow makes every rank skip that step; and the
grid as torch's ``DeviceMesh`` (the same launch).

One 4-process launch of ``fp16_worker.py`` at (2, 2), zero=0, 1 and 3: at step 3, global rank 1 alone writes an inf
into one element of its MP-split gradient (under zero=3, of its DP shard). Without agreeing ``found_inf``, rank 1
alone skips the step and halves its scale, and its DP replica (rank 3) steps on: measured, rank 1 ends at scale
32768 after 7 steps while ranks 0, 2, 3 end at 65536 after 8, and ranks 1 and 3 no longer hold the same weights.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_ranks
from tests.distributed.fp16_worker import POISONED_STEP, STEPS

WORKER = "tests/distributed/fp16_worker.py"
ZEROS = (0, 1, 3)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16")
    proc = run_ranks(4, [WORKER, "2", "2", str(out), ",".join(map(str, ZEROS))], timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "inf written" in proc.stdout + proc.stderr
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("zero", ZEROS)
def test_every_rank_skips_the_overflowed_step_and_keeps_one_scale(ranks, zero):
    runs = [r[f"z{zero}"] for r in ranks]
    for run in runs:
        # the step of the overflow is skipped (the step count stays), and the scale halves once, on every rank
        assert run["steps"] == [s if s <= POISONED_STEP else s - 1 for s in range(1, STEPS + 1)], run["steps"]
        assert run["scales"] == runs[0]["scales"]
    assert runs[0]["scales"][POISONED_STEP] == runs[0]["scales"][POISONED_STEP - 1] / 2
    # DP replicas (rank = dp_rank * 2 + mp_rank) hold bitwise-equal parameters
    assert runs[0]["params"] == runs[2]["params"] and runs[1]["params"] == runs[3]["params"]


@pytest.mark.slow
def test_device_mesh_is_the_grid_over_its_own_groups(ranks):
    for r in ranks:
        mesh = r["z0"]["mesh"]
        assert mesh["shape"] == [2, 1, 2] and mesh["names"] == ["dp", "pp", "mp"]
        assert mesh["groups"] == [True, True] and mesh["coordinate"] == mesh["grid"]
        assert mesh["dtensor_mp"] == [0.0, 0.0, 1.0, 1.0]  # each MP rank's shard, in MP-rank order
