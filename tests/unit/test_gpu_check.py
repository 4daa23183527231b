"""``benchmarks/gpu_check.sh`` cannot run here (no GPU): its dry run checks the script's syntax, the paths it uses
and the commands it would run; ``benchmarks/gpu_bench.py --help`` checks that the benchmark imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_gpu_check_dry_run_lists_every_check(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "-m pytest tests/gpu" in out  # (a)
    assert "--layout 1x1 --compile" in out  # (b)
    assert "--device cuda --layout 1x1" in out and "--layout 1x2 --backend gloo" in out  # (c)
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"


def test_gpu_check_syntax_and_no_gpu_exit():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    import torch

    if not torch.cuda.is_available():  # says so and fails (exit 2), rather than passing with nothing checked
        env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": "/nonexistent/never-written"}
        proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "NO CUDA GPU" in proc.stderr


def test_gpu_bench_imports():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "--layout" in proc.stdout, proc.stderr
