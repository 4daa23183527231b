"""Shared fixtures: running worker scripts in fresh processes, with a hard timeout so nothing can hang CI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.pool import CaseResult, close_pools, pool_summary, rank_pool

ROOT = Path(__file__).resolve().parents[1]


#: Whether the test being set up or run is marked ``slow``: only those may start processes (the fast tier,
#: ``pytest -m "not slow"``, must stay fast), and ``run_script``/``run_ranks`` check it.
_SLOW_ALLOWED = {"now": True}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _SLOW_ALLOWED["now"] = item.get_closest_marker("slow") is not None


def _require_slow_marker(args: list[str]) -> None:
    if not _SLOW_ALLOWED["now"]:
        pytest.fail(f"this test starts processes ({args[:2]}): mark it @pytest.mark.slow", pytrace=False)


def run_script(
    args: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Run ``python *args`` from the repo root; fail the test (not hang) past ``timeout`` seconds."""
    _require_slow_marker(args)
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        return subprocess.run(
            [sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out, err = (exc.stdout or "")[-3000:], (exc.stderr or "")[-3000:]
        pytest.fail(f"{args} did not finish in {timeout} s:\n{out}\n{err}")


def failure_text(stderr: str, tail: int = 6000) -> str:
    """What a failed launch's assertion shows: each distinct exception line of ``stderr`` (a chained error's root
    cause is printed first, often more than ``tail`` characters before the end, and every rank prints its own),
    then the last ``tail`` characters."""
    causes = dict.fromkeys(line.strip() for line in stderr.splitlines()
                           if re.match(r"^\s*[\w.]*(Error|Exception|Timeout)\b.*:", line))
    head = "exception lines, in order:\n" + "\n".join(list(causes)[:20]) + "\n--- tail ---\n" if causes else ""
    return head + stderr[-tail:]


@pytest.fixture
def script():
    return run_script


def run_ranks(
    world_size: int,
    args: list[str],
    timeout: float = 300,
    env: dict | None = None,
    cwd: Path = ROOT,
    torchrun: bool = False,
) -> CaseResult | subprocess.CompletedProcess:
    """Run a worker script in every rank of the session's pool of ``world_size`` ranks (``tests/support/pool.py``).

    The script must start a job of exactly ``world_size`` processes (``Trainer(devices=world_size)``): the pool's
    ranks are "launched externally", as under torchrun; ``torchrun=True`` also sets torchrun's own variables
    (``RANK``, ``TORCHELASTIC_RUN_ID``, ...). ``DPMP_TEST_POOL=0`` runs it as a fresh launch instead
    (``run_script``; under ``torch.distributed.run`` with ``torchrun=True``), the way the suite ran before the
    pools. Fails the test (not hang) past ``timeout`` seconds.
    """
    _require_slow_marker(args)
    if os.environ.get("DPMP_TEST_POOL", "1") == "0":
        if torchrun:
            args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}", *args]
        return run_script(args, timeout=timeout, env=env, cwd=cwd)
    # the pool sets OMP_NUM_THREADS=1
    result = rank_pool(world_size).run(args, timeout=timeout, env=env, cwd=cwd, torchrun=torchrun)
    if result.timed_out:
        pytest.fail(f"{args} did not finish in {timeout} s:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def run_layout(worker: str, dp: int, mp: int, out: Path, timeout: float = 420) -> tuple[Any, list[dict]]:
    """Run ``worker DP MP OUT`` on ``dp * mp`` pool ranks (:func:`run_ranks`), fail the test on a non-zero exit with
    the ranks' stderr, and return the result and each rank's ``OUT/rank<r>.json`` in rank order: the shape of
    every one-launch-per-layout fixture."""
    proc = run_ranks(dp * mp, [worker, str(dp), str(mp), str(out)], timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc, [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp * mp)]


def run_parity_worker(dp: int, mp: int, out: Path, models: Sequence[str], precisions: str = "64-true",
                      timeout: float = 600) -> list[dict]:
    """Train ``models`` (names of ``tests.support.models.build``, with ``+variant`` suffixes) at ``(dp, mp)`` in one
    pool launch of ``tests/distributed/parity_worker.py``; fail on a non-zero exit; each rank's ``rank<r>.json``."""
    proc = run_ranks(dp * mp, ["tests/distributed/parity_worker.py", str(dp), str(mp), str(out), ",".join(models)],
                     timeout=timeout, env={"PRECISIONS": precisions})
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp * mp)]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(pool_summary())


def pytest_unconfigure(config):
    close_pools()
