"""Typed schemas for the Hydra configs in ``conf/`` and the OmegaConf resolvers they use.

Importing this module registers the schemas in Hydra's ConfigStore. The YAML files extend them
(``defaults: [/<name>_schema@_here_, _self_]``), so a wrongly typed override such as ``strategy.dp=two`` fails while
Hydra composes the config, with Hydra's own message, before any process starts. The schemas are stored outside any
config group, so ``--help`` does not offer them as choices (``strategy: dpmp``, not ``strategy: dpmp, dpmp_schema``).

Resolvers: ``dpmp_devices`` (``trainer.devices`` from the layout) and ``dpmp_launch_time`` (the run folder's time
stamp, the same in every process of one launch; see :func:`launch_time`).
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

__all__ = [
    "GPTNetConfig", "GPTModelConfig", "StrategyConfig", "TimeoutConfig", "TrainConfig", "launch_time",
    "register_configs",
]


@dataclass
class TimeoutConfig:
    """``datetime.timedelta`` for ``DPMPStrategy(timeout=...)``; ``strategy.timeout.seconds=120`` on the command
    line."""

    _target_: str = "datetime.timedelta"
    seconds: float = 600.0


@dataclass
class StrategyConfig:
    """``lightning_dpmp.DPMPStrategy`` arguments (see conf/strategy/dpmp.yaml for each field's meaning)."""

    _target_: str = "lightning_dpmp.DPMPStrategy"
    dp: int = 2
    mp: int = 2
    plan_overrides: Any = None  # {glob: style}; untyped so a command-line dict replaces it (typed dicts are closed)
    sequence_parallel: bool = False
    verify_plan: bool = True
    mp_batch: str = "broadcast"
    zero: int = 0
    reshard_after_forward: bool = True
    activation_checkpointing: Optional[str] = None  # None, "blocks" or "auto"
    pp: int = 1
    pp_microbatches: Optional[int] = None
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    timeout: TimeoutConfig = field(default_factory=TimeoutConfig)
    ddp: Dict[str, Any] = field(default_factory=dict)


@dataclass
class GPTNetConfig:
    """``examples.models.gpt.GPT`` arguments."""

    _target_: str = "examples.models.gpt.GPT"
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True


@dataclass
class GPTModelConfig:
    """``examples.models.gpt.GPTLitModule``: the LightningModule wrapping a :class:`GPTNetConfig`."""

    _target_: str = "examples.models.gpt.GPTLitModule"
    net: GPTNetConfig = field(default_factory=GPTNetConfig)


@dataclass
class TrainConfig:
    """Top level of ``conf/config.yaml``; the groups are typed by their own schemas (or by Lightning at init)."""

    data: Any = MISSING
    model: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = None
    strategy: Any = MISSING
    trainer: Any = MISSING
    callbacks: Any = None
    logger: Any = None
    paths: Any = MISSING
    experiment: Any = None
    task_name: str = "train"
    seed: Optional[int] = 0
    max_world_size: Optional[int] = None
    ckpt_path: Optional[str] = None
    print_config: bool = True
    summary_warmup_steps: int = 3
    cpu_threads: Optional[int] = None
    test: bool = False
    stage: str = "test"  # examples/eval.py only
    debug: Any = None
    hparams_search: Any = None


def _devices(dp: Any, mp: Any, num_nodes: Any = 1, pp: Any = 1) -> int:
    """``trainer.devices`` derived from the layout: processes per node = dp * pp * mp / num_nodes.

    A non-positive ``dp``/``mp`` gets the strategy's own message (``check_parallel_size``), not a bare arithmetic
    error, whichever of the two resolves first.
    """
    from lightning_dpmp.parallel.topology import check_parallel_size  # torch only; the strategy uses the same check

    check_parallel_size("dp", dp)
    check_parallel_size("mp", mp)
    check_parallel_size("pp", pp)
    world = dp * pp * mp
    if not isinstance(num_nodes, int) or num_nodes < 1 or world % num_nodes:
        raise ValueError(f"dp * pp * mp = {world} processes cannot be split evenly over num_nodes = {num_nodes}")
    return world // num_nodes


_LAUNCH_TIME: Optional[float] = None


def _process_start_time(pid: int) -> Optional[float]:
    """Start time (seconds since the epoch) of process ``pid``, from /proc; None where there is no /proc."""
    try:
        ticks = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def launch_time() -> float:
    """The time stamp of this launch, the same in every process that one command started.

    Hydra's ``${now:}`` is read by each process on its own, so ``torchrun --nproc_per_node=4 train.py`` used to make
    up to four run folders a second apart. The first of these that applies wins:

    1. ``DPMP_LAUNCH_TIME`` (seconds since the epoch), for any launcher: ``export DPMP_LAUNCH_TIME=$(date +%s)``;
    2. ``SLURM_JOB_START_TIME`` under SLURM (all tasks of the job agree);
    3. under torchrun (``TORCHELASTIC_RUN_ID`` is set), the start time of the torchrun agent, the parent of every
       local rank (so restarted workers write into the same folder too);
    4. otherwise now, read once per process.
    """
    global _LAUNCH_TIME
    if _LAUNCH_TIME is None:
        stamp: Optional[float] = None
        for key in ("DPMP_LAUNCH_TIME", "SLURM_JOB_START_TIME"):
            if os.environ.get(key, "").strip():
                try:
                    stamp = float(os.environ[key])
                    break
                except ValueError:
                    pass
        if stamp is None and "TORCHELASTIC_RUN_ID" in os.environ:
            stamp = _process_start_time(os.getppid())
        _LAUNCH_TIME = stamp if stamp is not None else time.time()
    return _LAUNCH_TIME


def _launch_time_resolver(fmt: str) -> str:
    return datetime.datetime.fromtimestamp(launch_time()).strftime(fmt)


def register_configs() -> None:
    """Registers the schemas (idempotent) and the ``dpmp_devices`` / ``dpmp_launch_time`` / ``mul`` resolvers."""
    cs = ConfigStore.instance()
    # No group: a group's stored configs are listed as its choices in --help.
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="dpmp_strategy_schema", node=StrategyConfig)
    cs.store(name="gpt_model_schema", node=GPTModelConfig)
    if not OmegaConf.has_resolver("dpmp_devices"):
        OmegaConf.register_new_resolver("dpmp_devices", _devices)
    if not OmegaConf.has_resolver("dpmp_launch_time"):
        OmegaConf.register_new_resolver("dpmp_launch_time", _launch_time_resolver, use_cache=True)
    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda *xs: __import__("math").prod(xs))


register_configs()
