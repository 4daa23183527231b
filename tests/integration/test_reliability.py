"""A failure on one rank ends the whole dp=2 x mp=2 job: non-zero exit, within 60 s of the failure, no orphans.

Each case is one 4-process launch of reliability_worker.py (Lightning's popen launcher, or torchrun). The worker
records every rank's pid and the moment of the failure; "time to exit" is from that moment to the launcher's exit.
The stuck-rank job spends most of its life waiting for the process-group timeout, idle: it is started in the
background when the module's first test runs (``stuck_job``) and checked by its own test, so the wait overlaps the
other launches instead of adding to the suite's time.
The consistency guard is exercised by guard_worker.py in the 4-rank pool (its subject is the guard, not the
launch; every rank reports the failure, so the pool keeps running): a clean run passes, a nudged replica and a
batch split by global rank are named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_ranks
from tests.support.pool import CaseResult

WORKER = "tests/integration/reliability_worker.py"
GUARD_WORKER = "tests/integration/guard_worker.py"
LIMIT_S = 60  # the bound from failure to exit; measured 2-13 s here (timeout case: the timeout + ~5 s)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


class _Background:
    """A job started now whose end is taken later (``wait``), with the moment its launcher exited."""

    def __init__(self, args: list[str], env: dict | None = None) -> None:
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        # drain the pipes while it runs; communicate() returns once the launcher has exited
        self.result = ThreadPoolExecutor(1).submit(lambda: (*self.proc.communicate(), time.time()))

    def wait(self, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
        try:
            stdout, stderr, ended = self.result.result(timeout=timeout)
        except FuturesTimeout:
            self.kill()
            pytest.fail(f"the job did not end within {timeout} s (a hang):\n{self.result.result()[1][-3000:]}")
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, stdout, stderr), ended

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def _run(args: list[str], timeout: float = 240, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run a job to its end: the result and the moment its launcher exited."""
    return _Background(args, env).wait(timeout)


def _check_ended(proc: subprocess.CompletedProcess, ended: float, out: Path, limit_s: float = LIMIT_S) -> float:
    assert proc.returncode != 0, "a failed job must not exit 0"
    assert (out / "fail_time").exists(), proc.stderr[-3000:]
    elapsed = ended - float((out / "fail_time").read_text())
    pids = [int(p.read_text()) for p in out.glob("pid_*")]
    assert len(pids) == 4, proc.stderr[-3000:]
    deadline = time.time() + 3  # the kernel may need a moment to deliver a SIGKILL
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], f"orphan ranks left running: {[p for p in pids if _alive(p)]}"
    assert elapsed < limit_s, f"the job took {elapsed:.1f} s after the failure to exit"
    print(f"time to exit after the failure: {elapsed:.1f} s")  # shown with pytest -s; reported in the issue note
    return elapsed


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,rank",
    [
        ("train", 1),  # exception in training_step on a child rank
        ("val", 1),  # exception in validation_step
        ("callback", 2),  # exception in a Callback hook
        ("checkpoint", 0),  # checkpoint write fails (rank 0 writes)
        ("sigkill", 3),  # a child rank is SIGKILLed
        ("sigkill", 0),  # the launching process (rank 0) is SIGKILLed: its children must not linger
    ],
)
def test_a_failing_rank_ends_the_popen_job(tmp_path, case, rank):
    proc, ended = _run([WORKER, case, str(rank), str(tmp_path)])
    _check_ended(proc, ended, tmp_path)
    if case != "sigkill":
        assert f"injected failure ({case})" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case,rank", [("train", 0), ("sigkill", 2)])
def test_a_failing_rank_ends_the_torchrun_job(tmp_path, case, rank):
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", WORKER, case, str(rank), str(tmp_path)]
    proc, ended = _run(args)
    _check_ended(proc, ended, tmp_path)


#: The stuck-rank job's process-group timeout. It also bounds the start-up rendezvous, which the concurrent launches
#: slow down: 30 s was enough alone on a loaded 2-core machine; 45 s leaves room for the overlap.
STUCK_TIMEOUT_S = 45
STUCK_TEST = "test_a_rank_alive_but_stuck_is_bounded_by_the_timeout"


@pytest.fixture(scope="module", autouse=True)
def stuck_job(request, tmp_path_factory):
    """Start the stuck-rank job when the module's first test runs, if its test is selected; kill what is left at the
    end of the module."""
    if not any(item.name == STUCK_TEST for item in request.session.items):
        yield None
        return
    out = tmp_path_factory.mktemp("stuck")
    job = _Background([WORKER, "hang", "1", str(out)], {"DPMP_TEST_TIMEOUT_S": str(STUCK_TIMEOUT_S)})
    yield job, out
    job.kill()


@pytest.mark.slow
def test_a_rank_alive_but_stuck_is_bounded_by_the_timeout(stuck_job):
    # Rank 1 sleeps inside its step: nothing is closed, so only the process-group timeout can end the wait.
    # Rank 0 (the launcher) times out and exits; rank 1 must not survive it (die_with_parent).
    job, out = stuck_job
    proc, ended = job.wait(timeout=240)
    elapsed = _check_ended(proc, ended, out, limit_s=STUCK_TIMEOUT_S + 40)
    assert elapsed >= STUCK_TIMEOUT_S - 1, "the others should have waited for the timeout, not less"


def _guard(case: str, out: Path) -> CaseResult | subprocess.CompletedProcess:
    return run_ranks(4, [GUARD_WORKER, case, str(out)], timeout=240)


@pytest.mark.slow
def test_consistency_guard_passes_a_correct_run_cheaply(tmp_path):
    proc = _guard("clean", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "guard.json").read_text())
    assert report["checks"] == 7  # steps 0..5 and the end of training
    assert max(report["seconds"]) < 1.0, report  # measured 2-14 ms per check for this model


@pytest.mark.slow
def test_consistency_guard_names_a_diverged_dp_replica(tmp_path):
    proc = _guard("param", tmp_path)
    assert proc.returncode != 0
    assert (
        "consistency check failed at step 2 (dp=2, mp=2): parameter 'blocks.0.fc1.weight' (sharded over MP; DP"
        " replicas) on rank 3 (dp_rank 1, mp_rank 1) differs from rank 1 (dp_rank 0, mp_rank 1)"
    ) in proc.stderr


@pytest.mark.slow
def test_consistency_guard_names_an_mp_group_with_different_batches(tmp_path):
    proc = _guard("batch", tmp_path)
    assert proc.returncode != 0
    assert "Trainer(use_distributed_sampler=False) leaves the DataLoaders as given" in proc.stderr  # the warning
    # mp_batch="check" stops the first step, before the guard (the default "broadcast" would train on MP rank 0's)
    assert "BatchMismatchError: the ranks of a tensor-parallel group hold different batches" in proc.stderr
