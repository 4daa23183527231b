"""``train(cfg)``: everything ``examples/train.py`` does, callable with any composed config.

One call is one Hydra job. Under a multirun with Hydra's basic launcher, several jobs run one after another in the
same process, so each job leaves the process as it found it: process group destroyed, launcher environment variables
restored, child processes reaped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
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

__all__ = [
    "train",
    "instantiate_strategy",
    "instantiate_callbacks",
    "instantiate_loggers",
    "max_world_size",
    "usable_cpus",
    "threads_per_process",
    "external_rank_overrides",
    "no_gpu_message",
    "job_logging",
    "entry_script",
    "quiet_nonzero_ranks",
]


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


def usable_cpus() -> int:
    """CPU cores this process may use: its affinity mask, capped by a cgroup (container) CPU quota.

    ``os.cpu_count()`` counts the host's cores; in a container limited to a few of them, that many threads per
    process spin against each other (seen: a 1x1 sweep job 4x slower than with one thread).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        cores = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]  # cgroup v2: "max 100000" or "200000 100000"
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def threads_per_process(cfg: DictConfig, processes_per_node: int) -> int:
    """``cfg.cpu_threads``, or the usable cores shared evenly by this node's processes (at least 1)."""
    if cfg.get("cpu_threads"):
        return int(cfg.cpu_threads)
    return max(1, usable_cpus() // max(1, processes_per_node))


def max_world_size(cfg: DictConfig) -> int:
    """``cfg.max_world_size``, or what this machine allows: 4 processes per core on CPU, one per visible GPU."""
    if cfg.get("max_world_size") is not None:
        return int(cfg.max_world_size)
    if str(cfg.trainer.get("accelerator", "cpu")) in ("gpu", "cuda"):
        return torch.cuda.device_count() * int(cfg.trainer.get("num_nodes", 1))
    return usable_cpus() * 4 * int(cfg.trainer.get("num_nodes", 1))


def no_gpu_message(cfg: DictConfig) -> Optional[str]:
    """Why a GPU trainer config cannot run on this machine (no CUDA), or None."""
    accelerator = str(cfg.trainer.get("accelerator", "cpu"))
    if accelerator not in ("gpu", "cuda") or torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (
        f"trainer.accelerator={accelerator} (trainer=gpu) needs CUDA GPUs, but CUDA is not available on this machine"
        f" (torch {torch.__version__}, {build}, {torch.cuda.device_count()} GPUs visible). Use trainer=cpu (the"
        " default: one process per rank on the CPU cores, gloo) or run on a machine with NVIDIA GPUs."
    )


def _external_rank() -> Optional[int]:
    """The global rank given by torchrun (``RANK``) or srun (``SLURM_PROCID`` of a multi-task job), else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"])
    if os.environ.get("SLURM_NTASKS", "1").isdigit() and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        if os.environ.get("SLURM_PROCID", "").isdigit():
            return int(os.environ["SLURM_PROCID"])
    return None


def _env_rank() -> int:
    """This process's global rank as far as the environment tells before a Trainer exists (0 when unknown)."""
    rank = _external_rank()
    return rank if rank is not None else int(os.environ.get("LOCAL_RANK", "0") or 0)  # Lightning's popen children


def external_rank_overrides(argv: list[str]) -> list[str]:
    """Hydra overrides for a non-zero rank started by torchrun or srun (every rank runs the script itself).

    All ranks already agree on the run folder (``${dpmp_launch_time:}`` in conf/hydra/default.yaml); these make the
    other ranks write only their own ``<script>_rank<k>.log`` there, like the children of Lightning's launcher,
    instead of a second ``.hydra/`` and their lines interleaved in ``train.log``.
    """
    rank = _external_rank()
    if not rank:
        return []
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv[1:]}
    name = os.path.splitext(os.path.basename(argv[0]))[0] if argv else "train"
    extra = {"hydra.output_subdir": "null", "hydra.job.name": f"{name}_rank{rank}"}
    return [f"{k}={v}" for k, v in extra.items() if k not in given]


def quiet_nonzero_ranks() -> None:
    """Deprecation warnings are the same in every rank: only rank 0 shows them (4 identical lines otherwise)."""
    if _env_rank() != 0:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)


@contextlib.contextmanager
def entry_script() -> Iterator[None]:
    """Makes ``__main__`` look like the entry script (train.py / eval.py) while the ranks are launched.

    Lightning's launcher starts the other ranks by re-running ``__main__``. In a worker of a parallel sweep launcher
    (hydra-joblib-launcher's loky processes) ``__main__`` is the worker's own module, so the children would run
    ``python -m loky...``. The entry scripts export ``DPMP_ENTRY_SCRIPT`` (inherited by the workers) for this.
    """
    import __main__

    script = os.environ.get("DPMP_ENTRY_SCRIPT")
    if not script or os.path.abspath(getattr(__main__, "__file__", "") or "") == script:
        yield
        return
    saved = sys.argv[0], getattr(__main__, "__spec__", None)
    sys.argv[0], __main__.__spec__ = script, None
    try:
        yield
    finally:
        sys.argv[0], __main__.__spec__ = saved


@contextlib.contextmanager
def job_logging() -> Iterator[None]:
    """Sends Lightning's log records (the strategy's plan printout, "Initializing distributed: ...") to the job's
    log file too (``train.log``, ``train_rank<k>.log``).

    Lightning's loggers keep their own console handler and do not propagate when Lightning is imported before
    logging is configured (train.py does that on purpose: no doubled console lines), so Hydra's file handler never
    saw them.
    """
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    targets = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    added = [(lg, h) for lg in targets if not lg.propagate for h in files if h not in lg.handlers]
    for lg, h in added:
        lg.addHandler(h)
    try:
        yield
    finally:
        for lg, h in added:
            lg.removeHandler(h)


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
            "peak_mem_mb", "threads", "first_loss", "final_loss", "final_val_loss", "steps", "wall_s", "checkpoint",
            "error"]  # fmt: skip
    lines = ["| field | value |", "|---|---|"]
    for k in keys:
        v = summary.get(k)
        if v is not None:
            lines.append(f"| {k} | {f'{v:.4g}' if isinstance(v, float) else v} |")
    for k, v in (summary.get("test") or {}).items():
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


def _test_after_fit(trainer: pl.Trainer, model: pl.LightningModule, datamodule: Any) -> dict[str, float]:
    """``trainer.test`` on the best checkpoint (by the monitored metric), else the last one, else the weights in
    memory; returns the test metrics (the same on every rank: they are synced)."""
    best = next((c.best_model_path for c in trainer.checkpoint_callbacks if getattr(c, "best_model_path", "")), "")
    last = next((c.last_model_path for c in trainer.checkpoint_callbacks if getattr(c, "last_model_path", "")), "")
    ckpt_path = best or last or None
    log.info(f"Testing {'checkpoint ' + ckpt_path if ckpt_path else 'the trained weights (no checkpoint)'}")
    results = trainer.test(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
    metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
    return {**metrics, "ckpt_path": ckpt_path}  # type: ignore[dict-item]


def train(cfg: DictConfig) -> dict[str, Any]:
    """Trains ``cfg.model`` on ``cfg.data`` with ``cfg.strategy``; returns (and on rank 0 writes) the run summary.

    The summary goes to ``<paths.output_dir>/summary.json`` and ``summary.md``. In a multirun, a failed job is
    recorded as ``status: failed`` and the sweep continues (the sweep summary callback exits non-zero at the end);
    a job whose ``dp * pp * mp`` exceeds :func:`max_world_size` is recorded as ``skipped``.
    """
    from lightning_dpmp.integration.launcher import launch_environment

    started = time.perf_counter()
    quiet_nonzero_ranks()
    multirun, job_num, overrides, failures_reported = _hydra_job()
    output_dir = Path(cfg.paths.output_dir)
    rank0 = _env_rank() == 0  # before the Trainer exists: this process is (or will be) global rank 0
    dp, mp, pp = cfg.strategy.get("dp", 1), cfg.strategy.get("mp", 1), cfg.strategy.get("pp", 1)
    summary: dict[str, Any] = {
        "job": job_num,
        "dp": dp,
        "mp": mp,
        "pp": pp,
        "world_size": None,
        "status": "failed",
        "overrides": overrides,
    }

    # Refusals that need no process: the strategy's own argument checks (e.g. dp=0: its message, not the devices
    # resolver's), a GPU config without CUDA, a layout above what this machine allows.
    try:
        strategy = instantiate_strategy(cfg.strategy)
    except Exception as err:
        if not (multirun and failures_reported):
            raise
        summary.update(error=f"{type(err).__name__}: {err}", wall_s=time.perf_counter() - started)
        log.exception(f"Job failed: {summary['error']}")
        if rank0:
            _write_summary(summary, output_dir)
        return summary
    limit = max_world_size(cfg)
    refusal = no_gpu_message(cfg)
    layout = f"dp={dp} x pp={pp} x mp={mp}" if pp != 1 else f"dp={dp} x mp={mp}"
    if refusal is None and dp * pp * mp > limit:
        refusal = (
            f"Layout {layout} needs {dp * pp * mp} processes; this machine allows {limit}"
            f" (max_world_size={cfg.get('max_world_size')}). Skipped."
        )
    if refusal is not None:
        log.warning(refusal)
        summary.update(status="skipped", world_size=dp * pp * mp, error=refusal, wall_s=time.perf_counter() - started)
        if rank0:
            _write_summary(summary, output_dir)
        if not multirun:
            print(f"Error: {refusal}", file=sys.stderr)
            sys.exit(2)
        return summary

    trainer: Optional[pl.Trainer] = None
    failed = False
    with launch_environment(), job_logging(), entry_script():
        try:
            if cfg.get("print_config") and rank0:
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
            trainer = hydra.utils.instantiate(
                cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False
            )
            if trainer.accelerator.__class__.__name__ == "CPUAccelerator":
                # CPU processes share the cores: oversubscribed OpenMP threads spin and slow every rank down. Export
                # OMP_NUM_THREADS too: Lightning's launcher otherwise resets the count when the variable is unset, and
                # the children it starts read it (launch_environment restores it after the job).
                summary["threads"] = threads_per_process(cfg, trainer.num_devices)
                torch.set_num_threads(summary["threads"])
                os.environ["OMP_NUM_THREADS"] = str(summary["threads"])
            log.info(
                f"rank {trainer.global_rank} (pid {os.getpid()}): {layout},"
                f" {trainer.num_devices} processes per node, {torch.get_num_threads()} torch threads"
            )

            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

            summary.update(stats.result() or {})
            summary["world_size"] = trainer.world_size
            ckpt = next((c for c in trainer.checkpoint_callbacks if getattr(c, "last_model_path", "")), None)
            summary["checkpoint"] = getattr(ckpt, "last_model_path", None) or None
            if cfg.get("test"):
                summary["test"] = _test_after_fit(trainer, model, datamodule)
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
                why = summary.get("error") or "a child process failed"
                summary["error"] = f"{why} (exit codes of local ranks 1..: {codes})"
            summary["wall_s"] = time.perf_counter() - started
            global_rank = trainer.global_rank if trainer is not None else (0 if rank0 else -1)
            if global_rank == 0:
                _write_summary(summary, output_dir)
    if summary["status"] != "ok" and not (multirun and failures_reported):
        raise RuntimeError(f"Training failed: {summary.get('error')}")
    if summary["status"] == "ok" and trainer is not None and trainer.global_rank == 0:
        log.info("Summary:\n" + (output_dir / "summary.md").read_text())
    return summary
