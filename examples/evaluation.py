"""``evaluate(cfg)``: what ``examples/eval.py`` does: test (or validate) a checkpoint written by train.py.

The checkpoint is loaded by the strategy under the layout of ``cfg.strategy``, which need not be the training
layout: train.py saves consolidated (dense) checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig

from examples.training import (
    _destroy_process_group,
    _env_rank,
    _release_children,
    entry_script,
    instantiate_loggers,
    instantiate_strategy,
    job_logging,
    no_gpu_message,
    quiet_nonzero_ranks,
)

log = logging.getLogger(__name__)

__all__ = ["evaluate"]


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Runs ``trainer.test`` (or ``validate``, ``cfg.stage``) on ``cfg.ckpt_path``; writes ``eval.json`` on rank 0.

    Refuses before any process starts when the checkpoint file does not exist or the config asks for a GPU that is
    not there (exit code 2, one message).
    """
    from lightning_dpmp.integration.launcher import launch_environment

    started = time.perf_counter()
    quiet_nonzero_ranks()
    rank0 = _env_rank() == 0
    ckpt_path = Path(os.path.expanduser(str(cfg.ckpt_path)))
    stage = str(cfg.get("stage", "test"))
    refusal = no_gpu_message(cfg)
    if cfg.get("ckpt_path") is None:
        refusal = "ckpt_path is required: python examples/eval.py ckpt_path=<run dir>/checkpoints/last.ckpt"
    elif stage not in ("test", "validate"):
        refusal = f"stage={stage!r}: use stage=test or stage=validate."
    elif not ckpt_path.is_file():
        refusal = f"ckpt_path={cfg.ckpt_path}: no such checkpoint file (looked in {ckpt_path.resolve().parent})."
    if refusal is not None:
        if rank0:
            print(f"Error: {refusal}", file=__import__("sys").stderr)
        raise SystemExit(2)

    strategy = instantiate_strategy(cfg.strategy)
    trainer: Optional[pl.Trainer] = None
    failed = True
    result: dict[str, Any] = {"status": "failed", "ckpt_path": str(ckpt_path), "stage": stage,
                              "dp": cfg.strategy.dp, "mp": cfg.strategy.mp}  # fmt: skip
    with launch_environment(), job_logging(), entry_script():
        try:
            if cfg.get("seed") is not None:
                pl.seed_everything(int(cfg.seed), workers=True)
            datamodule = hydra.utils.instantiate(cfg.data)
            model = hydra.utils.instantiate(cfg.model, optimizer=None, scheduler=None)
            loggers = instantiate_loggers(cfg.get("logger"))
            trainer = hydra.utils.instantiate(cfg.trainer, strategy=strategy, logger=loggers or False)
            run = trainer.test if stage == "test" else trainer.validate
            metrics = run(model, datamodule=datamodule, ckpt_path=str(ckpt_path), verbose=rank0)
            result.update(status="ok", world_size=trainer.world_size,
                          metrics={k: float(v) for k, v in (metrics[0] if metrics else {}).items()})  # fmt: skip
            failed = False
        finally:
            _release_children(trainer, failed)
            _destroy_process_group()
            result["wall_s"] = time.perf_counter() - started
            if (trainer.global_rank if trainer is not None else _env_rank()) == 0:
                out = Path(cfg.paths.output_dir)
                out.mkdir(parents=True, exist_ok=True)
                (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
                log.info(f"{stage} of {ckpt_path}: {result.get('metrics')}")
    return result
