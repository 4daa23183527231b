"""``benchmarks/gpu_check.sh --device cpu``: the GPU check's dry mode, end to end on the CPU (the same script, code
and checks as on a GPU, tiny sizes), so that the script cannot rot before a GPU is at hand; and the refusal without
a GPU. Measured on the 2-core machine: 43-64 s for the whole dry mode (64 s with a cold Inductor cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_checks as G  # noqa: E402


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **extra}
    env.pop("GPU_CHECK_KEEP", None)
    return env


@pytest.mark.slow
def test_dry_mode_runs_and_passes_every_check(tmp_path):
    out = tmp_path / "gpu_check"
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(SCRIPT), "--device", "cpu"], cwd=ROOT, env=_env(GPU_CHECK_OUT=str(out)),
                          capture_output=True, text=True, timeout=720)
    wall = time.perf_counter() - start
    print(f"gpu_check.sh --device cpu: {wall:.0f} s\n{proc.stdout[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "gpu_check.sh: all checks passed" in proc.stdout
    results = {c: json.loads((out / "results" / f"{c}.json").read_text()) for c in G.CHECKS}
    assert {c: r["status"] for c, r in results.items()} == dict.fromkeys(G.CHECKS, "pass")
    # every multi-rank case ran, within the float64 bound, with the collectives the test suite expects
    rows = [row for c in G.RANK_CHECKS for row in results[c]["rows"]]
    assert sorted(r["case"] for r in rows) == sorted(c.name for c in G.CASES)
    assert all(r["ok"] and r["max_abs_diff"] <= G.PARITY_TOL for r in rows), rows
    assert set(results["gloo_cuda_probe"]["figures"]["ops"].values()) == {"ok"}
    assert results["hydra_train"]["figures"]["backend"] == "gloo"  # (nccl on CUDA)
    mfu = results["mfu"]["figures"]
    assert 0 < mfu["mfu"] < 1 and mfu["dpmp_over_lightning"] > 0 and mfu["estimator_prediction"].startswith("n/a")
    assert results["compile"]["figures"]["compiled_blocks"] == G.SIZES["cpu"].compile_gpt["n_layer"]
    summary = (out / "summary.md").read_text()
    assert summary in proc.stdout  # printed at the end, as written
    assert "| check | status | result | s |" in summary
    assert f"**{len(G.CHECKS)} of {len(G.CHECKS)} checks passed**" in summary
    for check in G.CHECKS:
        assert f"| {check} | PASS |" in summary, check
    assert "| run | tokens/s | TFLOP/s | MFU | pre-flight estimate (n/a: no estimator yet) |" in summary
    assert (out / "device.txt").read_text().startswith("Device: --device cpu")
    assert not (out / "work").exists()  # checkpoints, exports and Hydra run folders are removed


@pytest.mark.slow
def test_syntax_and_no_gpu_exit():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    # says so and fails (exit 2), rather than passing with nothing checked; writes nothing
    never = "/nonexistent/never-written"
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=_env(GPU_CHECK_OUT=never), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "NO CUDA GPU" in proc.stderr and "--device cpu" in proc.stderr, proc.stderr
    assert not Path(never).exists()
    bad = subprocess.run(["bash", str(SCRIPT), "--device", "tpu"], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--device must be cuda or cpu" in bad.stderr
