"""A SIGKILL in the middle of a save leaves the previous checkpoint intact and loadable (both formats)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lightning_dpmp.checkpoint.files import load_file
from lightning_dpmp.checkpoint.sharded import load_sharded_full
from tests.conftest import ROOT

WORKER = "tests/distributed/checkpoint_kill_worker.py"


def _kill_mid_save(mode: str, path, tmp_path) -> list[str]:
    ready = tmp_path / f"ready_{mode}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, WORKER, mode, str(path), str(ready)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the save never reached its stall point"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    return [n for n in os.listdir(tmp_path) if ".tmp-" in n]


@pytest.mark.slow
def test_sigkill_during_consolidated_save_keeps_the_previous_file(tmp_path):
    path = tmp_path / "last.ckpt"
    leftovers = _kill_mid_save("file", path, tmp_path)
    assert leftovers, "the kill should have interrupted a write in progress"
    assert torch.equal(load_file(str(path))["state_dict"]["w"], torch.full((256, 256), 1.0))


@pytest.mark.slow
def test_sigkill_during_sharded_save_keeps_the_previous_folder(tmp_path):
    path = tmp_path / "last.ckpt"
    leftovers = _kill_mid_save("folder", path, tmp_path)
    assert leftovers, "the kill should have interrupted a write in progress"
    ckpt = load_sharded_full(str(path))
    assert ckpt["global_step"] == 1 and torch.equal(ckpt["state_dict"]["weight"], torch.ones(64, 64))
