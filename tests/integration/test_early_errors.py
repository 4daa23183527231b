"""Issue 15's cases that need processes: a plan error found only at setup (a model built in ``configure_model``)
is reported once, by rank 0, while the other ranks exit quietly; rank 0's warnings for an mp that splits nothing and
a dataset smaller than dp appear once each. The cases that fail before launch are in tests/unit/test_early_errors.py.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import run_ranks, run_script

WORKER = "tests/integration/validate_worker.py"


@pytest.mark.slow
def test_setup_time_plan_error_is_one_message_from_rank_zero():
    proc = run_script([WORKER, "late_glob"], timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert out.count("plan pattern 'extar' matches no module of Later (did you mean 'extra'?)") == 1, out[-4000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]  # rank 1 exited quietly
    assert "DPMPStrategy plan for" not in out  # refused before the step was traced


@pytest.mark.slow
def test_a_module_compiled_in_configure_model_is_refused_at_setup_by_rank_zero():
    start = time.monotonic()
    proc = run_script([WORKER, "late_compile"], timeout=400)
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert out.count("'extra' (OptimizedModule) was compiled with torch.compile before fit") == 1, out[-4000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]  # rank 1 exited quietly
    assert "DPMPStrategy plan for" not in out  # refused before the step was traced
    print(f"compiled submodule refused at setup: launch exited 1 after {seconds:.1f} s")


@pytest.mark.slow
def test_idle_mp_and_tiny_data_warn_once_each():
    proc = run_ranks(4, [WORKER, "idle"], timeout=400)  # warnings, not launching: the 4-rank pool (all output joined)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("DPMPStrategy(dp=2, mp=2): the plan splits no parameter") == 1, out[-4000:]
    assert "Use mp=1 and dp=4" in out
    assert out.count("has 1 sample(s), fewer than dp=2") == 1, out[-4000:]
    assert out.count("DONE") == 4


@pytest.mark.slow
def test_torchrun_every_rank_checks_before_launch_and_rank_zero_reports():
    proc = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, "bad_glob"],
                      timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert out.count("plan pattern 'nte' matches no module of Odd (did you mean 'net'?)") == 1, out[-4000:]
    # torchrun names rank 0 (the one that reported) as the root cause: rank 1 waited instead of exiting first.
    root = out[out.index("Root Cause"):]
    assert "rank      : 0 (local_rank: 0)" in root.split("=====")[0], root
    assert "Initializing distributed" not in out  # refused before the process group was initialised
