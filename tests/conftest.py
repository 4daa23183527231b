"""Shared fixtures: running worker scripts in fresh processes, with a hard timeout so nothing can hang CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(
    args: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Run ``python *args`` from the repo root; fail the test (not hang) past ``timeout`` seconds."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        return subprocess.run(
            [sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out, err = (exc.stdout or "")[-3000:], (exc.stderr or "")[-3000:]
        pytest.fail(f"{args} did not finish in {timeout} s:\n{out}\n{err}")


@pytest.fixture
def script():
    return run_script
