"""DPMPScriptLauncher's child command under Hydra (no processes started) and its environment restore."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import open_dict

import examples.config  # noqa: F401
from lightning_dpmp.integration.launcher import LAUNCH_ENV_VARS, hydra_child_command, launch_environment

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture
def hydra_job(tmp_path, monkeypatch):
    """Makes HydraConfig look like job #1 of `train.py -m strategy.mp=1,2 ...`, launched from tmp_path."""

    def make(mode: RunMode, task_overrides: list[str], hydra_overrides: list[str], argv: list[str]) -> Path:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="config", overrides=task_overrides, return_hydra_config=True)
        job_dir = tmp_path / "multi run, with=odd chars" / "1"
        with open_dict(cfg):
            cfg.hydra.mode = mode
            cfg.hydra.runtime.output_dir = str(job_dir)
            cfg.hydra.runtime.cwd = str(tmp_path)
            cfg.hydra.job.name = "train"
            cfg.hydra.job.num = 1
            cfg.hydra.overrides.hydra = hydra_overrides
        HydraConfig.instance().set_config(cfg)
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)  # `python script.py`, not `python -m`
        return job_dir

    yield make
    HydraConfig.instance().cfg = None  # type: ignore[assignment]
    GlobalHydra.instance().clear()


def test_multirun_child_runs_only_its_own_job(hydra_job, tmp_path):
    job_dir = hydra_job(
        RunMode.MULTIRUN,
        ["strategy.mp=2", "strategy.dp=1", "trainer.max_steps=3"],
        ["hydra.sweep.dir=/somewhere", "hydra.mode=MULTIRUN", "hydra/launcher=basic", "hydra.verbose=true"],
        ["examples/train.py", "-m", "--config-name", "config",
         "strategy.mp=1,2", "strategy.dp=1", "trainer.max_steps=3"],
    )
    command, cwd = hydra_child_command(local_rank=1)
    assert command[0] == sys.executable
    assert command[1] == str(tmp_path / "examples" / "train.py")  # relative to the launch dir, not the job dir
    assert cwd == str(tmp_path)
    args = command[2:]
    assert "-m" not in args and "--multirun" not in args
    assert not any("," in a and not a.startswith("hydra.run.dir=") for a in args), args  # no sweep values
    assert args[:2] == ["--config-name", "config"]
    assert ["strategy.mp=2", "strategy.dp=1", "trainer.max_steps=3"] == args[2:5]
    assert "hydra.verbose=true" in args  # the user's other hydra overrides survive
    assert not any(a.startswith(("hydra.sweep", "hydra/launcher", "hydra.mode=MULTIRUN")) for a in args)
    assert "hydra.mode=RUN" in args and "hydra.output_subdir=null" in args
    assert f"hydra.run.dir='{job_dir}'" in args
    assert "hydra.job.name=train_rank1" in args


def test_run_mode_child_writes_into_the_parent_run_dir(hydra_job):
    job_dir = hydra_job(RunMode.RUN, ["experiment=gpt_tiny"], [], ["examples/train.py", "experiment=gpt_tiny"])
    command, _ = hydra_child_command(local_rank=3)
    assert "experiment=gpt_tiny" in command
    assert f"hydra.run.dir='{job_dir}'" in command and "hydra.job.name=train_rank3" in command


def test_child_run_dir_override_parses_back_to_the_same_path(hydra_job):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    job_dir = hydra_job(RunMode.MULTIRUN, [], [], ["examples/train.py", "-m"])
    command, _ = hydra_child_command(local_rank=1)
    run_dir = next(a for a in command if a.startswith("hydra.run.dir="))
    (override,) = OverridesParser.create().parse_overrides([run_dir])
    assert override.value() == str(job_dir)


def test_launch_environment_restores_what_the_launcher_exported(monkeypatch):
    for key in LAUNCH_ENV_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # set before the job (e.g. by the user): must survive
    threads = torch.get_num_threads()
    with launch_environment():
        os.environ.update(LOCAL_RANK="0", WORLD_SIZE="4", MASTER_PORT="12345", MASTER_ADDR="127.0.0.1", NODE_RANK="0")
        torch.set_num_threads(1)
    assert "LOCAL_RANK" not in os.environ and "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ
    assert os.environ["MASTER_ADDR"] == "10.0.0.1"
    assert torch.get_num_threads() == threads
