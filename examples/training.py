"""``train(cfg)``: everything ``examples/train.py`` does, callable with any composed config.

One call is one Hydra job. Under a multirun with Hydra's basic launcher, several jobs run one after another in the
same process, so each job leaves the process as it found it: process group destroyed, launcher environment variables
restored, child processes reaped.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

from examples.callbacks import RunStats
from examples.hydra_callbacks import SweepSummary

log = logging.getLogger(__name__)

__all__ = ["train", "instantiate_strategy", "instantiate_callbacks", "instantiate_loggers", "max_world_size"]


def instantiate_strategy(cfg: DictConfig) -> Any:
    """``strategy`` config -> strategy; the ``ddp`` sub-dict is spread into the constructor's ``**ddp_kwargs``."""
    conf = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(conf, dict)
    ddp_kwargs = conf.pop("ddp", None) or {}
    return hydra.utils.instantiate({**conf, **ddp_kwargs})


def instantiate_callbacks(cfg: Optional[DictConfig]) -> list[Callback]:
    """Every non-null entry with a ``_target_`` (the keys are only names)."""
    if not cfg:
        return []
    return [hydra.utils.instantiate(c) for c in cfg.values() if c is not None and "_target_" in c]


def instantiate_loggers(cfg: Optional[DictConfig]) -> list[Logger]:
    if not cfg:
        return []
    return [hydra.utils.instantiate(c) for c in cfg.values() if c is not None and "_target_" in c]


def max_world_size(cfg: DictConfig) -> int:
    """``cfg.max_world_size``, or what this machine allows: 4 processes per core on CPU, one per visible GPU."""
    if cfg.get("max_world_size") is not None:
        return int(cfg.max_world_size)
    if str(cfg.trainer.get("accelerator", "cpu")) in ("gpu", "cuda"):
        return torch.cuda.device_count() * int(cfg.trainer.get("num_nodes", 1))
    return (os.cpu_count() or 1) * 4 * int(cfg.trainer.get("num_nodes", 1))


def _hydra_job() -> tuple[bool, Optional[str], list[str], bool]:
    """(in a multirun, job number, task overrides, whether the sweep summary callback will report failures)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:  # pragma: no cover
        return False, None, [], False
    if not HydraConfig.initialized():
        return False, None, [], False
    h = HydraConfig.get()
    multirun = h.mode == RunMode.MULTIRUN
    job_num = str(h.job.num) if multirun else None
    return multirun, job_num, [str(o) for o in h.overrides.task], SweepSummary.configured(h.get("callbacks"))


def _write_summary(summary: dict[str, Any], output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    keys = ["status", "dp", "mp", "world_size", "tokens_per_s", "samples_per_s", "params_per_rank", "params_total",
            "peak_mem_mb", "first_loss", "final_loss", "final_val_loss", "steps", "wall_s", "checkpoint", "error"]  # fmt: skip
    lines = ["| field | value |", "|---|---|"]
    for k in keys:
        v = summary.get(k)
        if v is not None:
            lines.append(f"| {k} | {f'{v:.4g}' if isinstance(v, float) else v} |")
    (output_dir / "summary.md").write_text("\n".join(lines) + "\n")


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _release_children(trainer: Optional[pl.Trainer], failed: bool) -> list[Optional[int]]:
    """Reaps this job's child processes (only the launching process has any)."""
    from lightning_dpmp.integration.launcher import DPMPScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None) if trainer is not None else None
    if not isinstance(launcher, DPMPScriptLauncher) or not launcher.procs:
        return []
    # After a failure the children usually exit on their own (their peer is gone) with their own error; give them a
    # moment so their exit codes say which rank failed first, then kill what is left (it may sit in a collective).
    return launcher.shutdown(timeout_s=5.0 if failed else 120.0)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Trains ``cfg.model`` on ``cfg.data`` with ``cfg.strategy``; returns (and on rank 0 writes) the run summary.

    The summary goes to ``<paths.output_dir>/summary.json`` and ``summary.md``. In a multirun, a failed job is
    recorded as ``status: failed`` and the sweep continues (the sweep summary callback exits non-zero at the end);
    a job whose ``dp * mp`` exceeds :func:`max_world_size` is recorded as ``skipped``.
    """
    from lightning_dpmp.integration.launcher import launch_environment

    started = time.perf_counter()
    multirun, job_num, overrides, failures_reported = _hydra_job()
    output_dir = Path(cfg.paths.output_dir)
    launching = "LOCAL_RANK" not in os.environ  # this process starts the others (not a child, not torchrun's)
    dp, mp = int(cfg.strategy.get("dp", 1)), int(cfg.strategy.get("mp", 1))
    summary: dict[str, Any] = {
        "job": job_num,
        "dp": dp,
        "mp": mp,
        "world_size": None,
        "status": "failed",
        "overrides": overrides,
    }

    limit = max_world_size(cfg)
    if dp * mp > limit:
        message = (
            f"Layout dp={dp} x mp={mp} needs {dp * mp} processes; this machine allows {limit}"
            f" (max_world_size={cfg.get('max_world_size')}). Skipped."
        )
        log.warning(message)
        summary.update(status="skipped", world_size=dp * mp, error=message, wall_s=time.perf_counter() - started)
        if launching:
            _write_summary(summary, output_dir)
        if not multirun:
            print(f"Error: {message}", file=sys.stderr)
            sys.exit(2)
        return summary

    trainer: Optional[pl.Trainer] = None
    failed = False
    with launch_environment():
        try:
            if cfg.get("print_config") and launching:
                log.info("Config:\n" + OmegaConf.to_yaml(cfg, resolve=True))
            if cfg.get("seed") is not None:
                pl.seed_everything(int(cfg.seed), workers=True)
            datamodule = hydra.utils.instantiate(cfg.data)
            optimizer = hydra.utils.instantiate(cfg.optimizer) if cfg.get("optimizer") else None
            scheduler = hydra.utils.instantiate(cfg.scheduler) if cfg.get("scheduler") else None
            model = hydra.utils.instantiate(cfg.model, optimizer=optimizer, scheduler=scheduler)
            summary["params_total"] = sum(p.numel() for p in model.parameters())

            stats = RunStats(dp=dp, warmup_steps=int(cfg.get("summary_warmup_steps", 3)))
            callbacks = [*instantiate_callbacks(cfg.get("callbacks")), stats]
            loggers = instantiate_loggers(cfg.get("logger"))
            strategy = instantiate_strategy(cfg.strategy)
            trainer = hydra.utils.instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False)
            if trainer.accelerator.__class__.__name__ == "CPUAccelerator":
                # CPU processes share the cores: oversubscribed OpenMP threads spin and slow every rank down.
                threads = cfg.get("cpu_threads") or max(1, (os.cpu_count() or 1) // max(1, trainer.num_devices))
                torch.set_num_threads(int(threads))

            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

            summary.update(stats.result() or {})
            summary["world_size"] = trainer.world_size
            ckpt = next((c for c in trainer.checkpoint_callbacks if getattr(c, "last_model_path", "")), None)
            summary["checkpoint"] = getattr(ckpt, "last_model_path", None) or None
            summary["status"] = "ok"
        except Exception as err:
            failed = True
            summary["error"] = f"{type(err).__name__}: {err}"
            if trainer is not None:
                summary["world_size"] = trainer.world_size
            log.exception(f"Job failed: {summary['error']}")
            if not (multirun and failures_reported):
                raise
        finally:
            codes = _release_children(trainer, failed)
            _destroy_process_group()
            if any(codes):
                summary["status"] = "failed"
                summary["error"] = f"{summary.get('error') or 'a child process failed'} (exit codes of local ranks 1..: {codes})"
            summary["wall_s"] = time.perf_counter() - started
            global_rank = trainer.global_rank if trainer is not None else (0 if launching else -1)
            if global_rank == 0:
                _write_summary(summary, output_dir)
    if summary["status"] != "ok" and not (multirun and failures_reported):
        raise RuntimeError(f"Training failed: {summary.get('error')}")
    if summary["status"] == "ok" and trainer is not None and trainer.global_rank == 0:
        log.info("Summary:\n" + (output_dir / "summary.md").read_text())
    return summary
