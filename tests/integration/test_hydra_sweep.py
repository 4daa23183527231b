"""examples/train.py end to end: a multirun sweep, a default run, failures and bad overrides.

Every run starts from pytest's tmp_path, so a stray ``outputs/`` or ``multirun/`` folder (a child replaying the
sweep) would show up there. The sweeps are real launches (the multirun starts each job's ranks itself); the single
runs, whose subject is the config and the training result, run in a rank pool as torchrun-launched ranks
(``run_ranks(..., torchrun=True)``; the popen and torchrun launches of train.py are in test_hydra_newuser.py).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples" / "train.py")
QUIET = ["trainer.enable_progress_bar=false", "print_config=false"]


def _train(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DPMP_CACHE_DIR": str(tmp_path / "cache"), "HYDRA_FULL_ERROR": "0"}
    try:
        return subprocess.run(
            [sys.executable, TRAIN, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"train.py {args} did not finish in {timeout} s:\n{(exc.stderr or '')[-3000:]}")


def _train_in_pool(tmp_path: Path, world: int, *args: str, timeout: float = 240):
    """``train.py *args`` in each rank of the ``world``-rank pool, as under ``torchrun --nproc_per_node=world``
    (``DPMP_TEST_POOL=0``: the plain ``python train.py *args`` launch, as before the pools)."""
    if os.environ.get("DPMP_TEST_POOL", "1") == "0":
        return _train(tmp_path, *args, timeout=timeout)
    env = {"DPMP_CACHE_DIR": str(tmp_path / "cache"), "HYDRA_FULL_ERROR": "0"}
    return run_ranks(world, [TRAIN, *args], timeout=timeout, env=env, cwd=tmp_path, torchrun=True)


def _rows(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "summary.csv").open() as f:
        return list(csv.DictReader(f))


def _no_stray_outputs(tmp_path: Path, expected: set[str]) -> None:
    assert {p.name for p in tmp_path.iterdir()} - {"cache"} == expected


@pytest.mark.slow
def test_layout_sweep_runs_each_job_once_with_its_own_world_size(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _train(
        tmp_path, "-m", "experiment=gpt_tiny", "strategy.dp=1", "strategy.mp=1,2", "trainer.max_steps=3",
        f"hydra.sweep.dir={sweep}", *QUIET,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(sweep)
    layouts = [(r["dp"], r["mp"], r["world_size"], r["status"]) for r in rows]
    assert layouts == [("1", "1", "1", "ok"), ("1", "2", "2", "ok")]
    assert all(float(r["tokens_per_s"]) > 0 and int(r["params_per_rank"]) > 0 for r in rows)
    assert (sweep / "summary.png").stat().st_size > 0 and (sweep / "summary.md").exists()
    # Exactly one sweep: two job folders, one multirun.yaml, nothing else launched anywhere.
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("multirun.yaml")] == [Path("sweep/multirun.yaml")]
    _no_stray_outputs(tmp_path, {"sweep"})
    assert (sweep / "1" / "train_rank1.log").exists()  # the child ran as a RUN inside its job's folder
    assert not (sweep / "1" / "train_rank1").exists()


@pytest.mark.slow
def test_sweep_records_failed_and_skipped_jobs_and_exits_nonzero(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _train(
        tmp_path, "-m", "experiment=gpt_tiny", "strategy.dp=1", "strategy.mp=2,8", "max_world_size=4",
        "strategy.plan_overrides={net:column}", "trainer.max_steps=3", f"hydra.sweep.dir={sweep}", *QUIET,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-4000:]
    rows = _rows(sweep)
    assert [(r["mp"], r["world_size"], r["status"]) for r in rows] == [("2", "2", "failed"), ("8", "8", "skipped")]
    assert "ValueError: plan['net']" in rows[0]["error"]  # the parent's own error, recorded in the row
    assert "sweep jobs failed" in proc.stderr + proc.stdout
    _no_stray_outputs(tmp_path, {"sweep"})


@pytest.mark.slow
def test_default_run_trains_and_writes_summary_and_consolidated_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = _train_in_pool(
        tmp_path, 4, "trainer.max_steps=25", "trainer.val_check_interval=25", "trainer.limit_val_batches=2",
        "data.max_bytes=300000", f"hydra.run.dir={run}", *QUIET,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["dp"], summary["mp"], summary["world_size"]) == ("ok", 2, 2, 4)
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary
    assert summary["final_val_loss"] is not None and summary["tokens_per_s"] > 0
    assert Path(summary["checkpoint"]).exists()
    import torch

    state = torch.load(summary["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    assert state["net.blocks.0.mlp.fc1.weight"].shape == (512, 128)  # consolidated: the dense shape
    rank_logs = sorted(p.name for p in run.glob("train_rank*.log"))  # ranks 1-3 log into rank 0's run folder
    assert rank_logs == ["train_rank1.log", "train_rank2.log", "train_rank3.log"]
    _no_stray_outputs(tmp_path, {"run"})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [("strategy.dp=two", "Value 'two' of type 'str' could not be converted to Integer"),
     ("strategy.dpp=2", "Could not override 'strategy.dpp'")],
)  # fmt: skip
def test_bad_override_fails_with_hydras_error(tmp_path, override, message):
    proc = _train_in_pool(tmp_path, 2, override, f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    assert proc.returncode != 0
    assert f"Error merging override {override}" in proc.stderr or message in proc.stderr, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr  # Hydra's message, not a stack trace from deep inside
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.slow
def test_layout_above_max_world_size_is_refused_in_a_single_run(tmp_path):
    proc = _train_in_pool(tmp_path, 2, "strategy.dp=4", "strategy.mp=4", "max_world_size=8",
                          f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert "needs 16 processes; this machine allows 8" in proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "skipped"
