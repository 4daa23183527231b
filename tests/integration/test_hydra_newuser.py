"""What a new user hit with the Hydra examples (issue 15): early refusals, one run folder per launch, honest
summaries, logs in the run folder, and the lightning-hydra-template habits (eval.py, test=true, debug,
hparams_search, offline loggers, more callbacks, a local parallel launcher).

The in-process tests start no processes. Each ``slow`` test is one launch (or two) reused for several checks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

import examples.config as config
from examples import training
from examples.callbacks import RunStats
from tests.integration.test_hydra_config import _compose, _instantiate_all

ROOT = Path(__file__).resolve().parents[2]
TRAIN, EVAL = str(ROOT / "examples" / "train.py"), str(ROOT / "examples" / "eval.py")
TINY = ["experiment=gpt_tiny", "data.max_bytes=50000", "trainer.enable_progress_bar=false", "print_config=false"]
DEPRECATED = "is deprecated"


def _has_plugin(name: str) -> bool:
    try:
        return importlib.util.find_spec(f"hydra_plugins.{name}") is not None
    except ModuleNotFoundError:  # no hydra_plugins namespace at all
        return False


def _run(tmp_path: Path, *argv: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "DPMP_CACHE_DIR": str(tmp_path / "cache"),
           "HYDRA_FULL_ERROR": "0"}  # fmt: skip
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{argv} did not finish in {timeout} s:\n{(exc.stderr or '')[-3000:]}")
    return proc, time.monotonic() - started


def _run_dirs(tmp_path: Path, task: str) -> list[Path]:
    return sorted(p for p in (tmp_path / "outputs" / task).glob("*/*") if p.is_dir())


# ---------------------------------------------------------------- in process: refusals, helpers, configs


def test_schemas_are_not_offered_as_choices():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        assert loader.get_group_options("strategy") == ["dpmp"]  # what --help lists
        assert loader.get_group_options("model") == ["gpt", "hf_causal_lm", "mlp"]


def test_dp_zero_gets_the_strategys_message_not_the_resolvers(tmp_path):
    cfg = _compose(tmp_path, "strategy.dp=0")
    with pytest.raises(Exception, match=r"`dp` must be a positive integer") as err:
        training.train(cfg)
    assert "Interpolation" not in type(err.value).__name__
    with pytest.raises(Exception, match=r"`dp` must be a positive integer"):  # the resolver says the same
        _ = cfg.trainer.devices
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_config_without_cuda_says_there_is_no_gpu(tmp_path, capsys):
    cfg = _compose(tmp_path, "trainer=gpu", "strategy.dp=1", "strategy.mp=1")
    with pytest.raises(SystemExit) as exit_:
        training.train(cfg)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "trainer=cpu" in err and "max_world_size" not in err
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "skipped"


def test_threads_per_process_share_the_usable_cores(tmp_path, monkeypatch):
    assert 1 <= training.usable_cpus() <= (os.cpu_count() or 1)
    monkeypatch.setattr(training, "usable_cpus", lambda: 8)
    cfg = _compose(tmp_path)
    assert [training.threads_per_process(cfg, n) for n in (1, 2, 4, 16)] == [8, 4, 2, 1]
    assert training.threads_per_process(_compose(tmp_path, "cpu_threads=3"), 1) == 3


def test_ranks_started_by_torchrun_or_srun_write_only_their_log(monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "SLURM_NTASKS", "SLURM_PROCID", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    argv = ["examples/train.py", "strategy.mp=2"]
    assert training.external_rank_overrides(argv) == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("RANK", "0")
    assert training.external_rank_overrides(argv) == []
    monkeypatch.setenv("RANK", "3")
    assert training.external_rank_overrides(argv) == ["hydra.output_subdir=null", "hydra.job.name=train_rank3"]
    assert training.external_rank_overrides([*argv, "hydra.job.name=x"]) == ["hydra.output_subdir=null"]
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert training.external_rank_overrides(["examples/eval.py"])[-1] == "hydra.job.name=eval_rank2"


def test_launch_time_is_the_same_in_every_process_of_a_launch(monkeypatch):
    monkeypatch.setattr(config, "_LAUNCH_TIME", None)
    monkeypatch.setenv("DPMP_LAUNCH_TIME", "1700000000")
    assert config.launch_time() == 1700000000.0
    monkeypatch.setattr(config, "_LAUNCH_TIME", None)
    monkeypatch.delenv("DPMP_LAUNCH_TIME")
    monkeypatch.delenv("SLURM_JOB_START_TIME", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")  # torchrun: the agent (our parent) started every rank
    parent = config._process_start_time(os.getppid())
    assert parent is not None and parent <= time.time()
    assert config.launch_time() == parent


def test_first_loss_is_the_first_steps_loss_in_a_short_run():
    stats = RunStats(dp=1, warmup_steps=0)
    stats._fit_start = time.perf_counter()
    stats._losses = [5.0, 4.0, 3.0, 2.0]
    stats._steps = [(0.1, 8, 256)] * 4
    reduce = lambda t, reduce_op: t  # noqa: E731  (one process)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), reduce=reduce),
                              global_step=4, callback_metrics={})  # fmt: skip
    stats.on_train_end(trainer, torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    assert stats.stats["first_loss"] == 5.0 and stats.stats["final_loss"] == 2.5  # mean of the last 2 of 4


@pytest.mark.parametrize(
    "overrides",
    [["debug=default"], ["debug=overfit"], ["debug=profiler"], ["callbacks=early_stopping"], ["callbacks=rich"],
     ["logger=mlflow"], ["logger=wandb"]],
    ids=lambda o: " ".join(o),
)  # fmt: skip
def test_new_group_options_compose_and_instantiate(tmp_path, overrides):
    package = {"logger=mlflow": "mlflow", "logger=wandb": "wandb", "callbacks=rich": "rich"}.get(overrides[0])
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (optional: pip install {package})")
    cfg = _compose(tmp_path, "data.max_bytes=100000", *overrides)
    _instantiate_all(cfg)
    if overrides[0].startswith("logger="):
        (logger,) = training.instantiate_loggers(cfg.logger)
        logger.log_metrics({"train/loss": 1.0}, step=0)  # offline: no server, no account
        logger.finalize("success")
        assert any(tmp_path.rglob("*")), "nothing written to the run folder"


def test_eval_config_requires_a_checkpoint(tmp_path, capsys):
    from examples.evaluation import evaluate

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg: DictConfig = compose(config_name="eval", overrides=[f"paths.output_dir={tmp_path}"])
    assert cfg.task_name == "eval" and cfg.stage == "test" and cfg.strategy._target_ == "lightning_dpmp.DPMPStrategy"
    with pytest.raises(SystemExit) as exit_:
        evaluate(cfg)
    assert exit_.value.code == 2 and "ckpt_path is required" in capsys.readouterr().err


# ---------------------------------------------------------------- subprocesses


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [([TRAIN, "trainer=gpu"], 2, ["CUDA is not available", "trainer=cpu"]),
     ([TRAIN, "strategy.dp=0"], 1, ["`dp` must be a positive integer"]),
     ([EVAL, "ckpt_path=missing.ckpt"], 2, ["ckpt_path=missing.ckpt", "no such checkpoint file"])],
    ids=["trainer=gpu without GPU", "strategy.dp=0", "eval.py missing checkpoint"],
)  # fmt: skip
def test_refusals_exit_before_any_process_starts(tmp_path, argv, code, words):
    if "trainer=gpu" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc, seconds = _run(tmp_path, *argv, "hydra.run.dir=run", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert all(w in out for w in words), out[-3000:]
    assert "InterpolationResolutionError" not in out and "Initializing distributed" not in out
    assert seconds < 90, f"took {seconds:.0f} s"  # imports only (slow on a busy 2-core machine)


@pytest.mark.slow
def test_torchrun_makes_one_run_folder_with_every_ranks_log(tmp_path):
    proc, _ = _run(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN, *TINY,
                   "strategy.dp=1", "strategy.mp=2", "trainer.max_steps=4")  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    (run,) = _run_dirs(tmp_path, "gpt_tiny")  # one folder, not one per rank
    assert (run / ".hydra").is_dir() and (run / "summary.json").exists()
    assert "DPMPStrategy plan for mp=2" in (run / "train.log").read_text()  # the plan printout is in the log
    assert "GLOBAL_RANK: 1" in (run / "train_rank1.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["first_loss"] != summary["final_loss"]
    assert out.count(DEPRECATED) <= 1, out


@pytest.mark.slow
def test_popen_run_with_test_then_eval_under_another_layout(tmp_path):
    """Lightning's launcher path: one run folder, test=true, then eval.py on its checkpoint."""
    proc, _ = _run(tmp_path, TRAIN, *TINY, "callbacks=default", "test=true", "strategy.dp=1", "strategy.mp=2",
                   "trainer.max_steps=4", "trainer.val_check_interval=4")  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    (run,) = _run_dirs(tmp_path, "gpt_tiny")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test"]["test/loss"] > 0 and Path(summary["test"]["ckpt_path"]).exists()
    assert "DPMPStrategy plan for mp=2" in (run / "train.log").read_text()
    assert (run / "train_rank1.log").read_text().strip()
    # at most once per Trainer stage (fit, then test), never per step: a third-party deprecation (Lightning's
    # LeafSpec check under torch 2.13) shows again in the test stage once accelerate (peft's dependency) has been
    # imported, which resets Python's once-per-location warning registry
    assert out.count(DEPRECATED) <= 2, out

    # Another layout: dp=1 x mp=1 (dense). A larger dp would pad the test set to a multiple of dp (Lightning's
    # DistributedSampler repeats samples), which moves the mean loss by ~1e-4 here.
    ckpt = run / "checkpoints" / "last.ckpt"
    proc, _ = _run(tmp_path, EVAL, *TINY, "strategy.dp=1", "strategy.mp=1", f"ckpt_path={ckpt}",
                   f"hydra.run.dir={tmp_path / 'eval'}")  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["status"] == "ok" and result["world_size"] == 1
    # The same checkpoint (best = last here) on the same split: dp=1 x mp=1 agrees with the dp=1 x mp=2 test.
    assert abs(result["metrics"]["test/loss"] - summary["test"]["test/loss"]) < 1e-4, (result, summary["test"])


@pytest.mark.slow
@pytest.mark.skipif(not _has_plugin("hydra_optuna_sweeper"),
                    reason="hydra-optuna-sweeper is not installed (optional: pip install hydra-optuna-sweeper)")
def test_optuna_search_runs_its_trials(tmp_path):  # pragma: no cover - optional plugin
    sweep = tmp_path / "sweep"
    proc, _ = _run(tmp_path, TRAIN, "hparams_search=optuna", *TINY, "strategy.dp=1", "strategy.mp=1",
                   "trainer.max_steps=2", "trainer.val_check_interval=2", "hydra.sweeper.n_trials=2",
                   "hydra.sweeper.sampler.n_startup_trials=2", f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (sweep / "optimization_results.yaml").exists() and (sweep / "summary.csv").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _has_plugin("hydra_joblib_launcher"),
                    reason="hydra-joblib-launcher is not installed (optional: pip install hydra-joblib-launcher)")
def test_joblib_launcher_runs_jobs_in_parallel(tmp_path):  # pragma: no cover - optional plugin
    sweep = tmp_path / "sweep"
    proc, _ = _run(tmp_path, TRAIN, "-m", "hydra/launcher=joblib", *TINY, "strategy.dp=1", "strategy.mp=1,2",
                   "trainer.max_steps=2", "trainer.val_check_interval=2", f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = (sweep / "summary.csv").read_text()
    assert rows.count(",ok,") == 2, rows


@pytest.mark.slow
def test_pipeline_run_validates_tests_checkpoints_and_evaluates_elsewhere(tmp_path):
    """``strategy.pp=2 strategy.dp=2 strategy.zero=3`` from the command line: trainer.devices follows dp * pp * mp;
    validation (a MeanMetric), ModelCheckpoint and the test after fit run on the pipelined model under ZeRO-3; its
    checkpoint evaluates at dp=2 x mp=1 without a pipeline or ZeRO (the same test samples per DP rank)."""
    proc, _ = _run(tmp_path, TRAIN, *TINY, "callbacks=default", "test=true", "strategy.dp=2", "strategy.mp=1",
                   "strategy.pp=2", "strategy.zero=3", "trainer.max_steps=4",
                   "trainer.val_check_interval=4")  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    (run,) = _run_dirs(tmp_path, "gpt_tiny")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 4 and summary["pp"] == 2
    assert summary["final_val_loss"] > 0 and summary["test"]["test/loss"] > 0
    assert "pipeline: pp=2 x 1 stage(s) per rank, schedule 1f1b" in (run / "train.log").read_text()
    ckpt = run / "checkpoints" / "last.ckpt"
    proc, _ = _run(tmp_path, EVAL, *TINY, "strategy.dp=2", "strategy.mp=1", f"ckpt_path={ckpt}",
                   f"hydra.run.dir={tmp_path / 'eval'}")  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert abs(result["metrics"]["test/loss"] - summary["test"]["test/loss"]) < 1e-5, (result, summary["test"])
