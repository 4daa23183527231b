"""Typed schemas for the Hydra configs in ``conf/`` and the OmegaConf resolvers they use.

Importing this module registers the schemas in Hydra's ConfigStore. The YAML files extend them
(``defaults: [<name>_schema, _self_]``), so a wrongly typed override such as ``strategy.dp=two`` fails while Hydra
composes the config, with Hydra's own message, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

__all__ = ["GPTNetConfig", "GPTModelConfig", "StrategyConfig", "TrainConfig", "register_configs"]


@dataclass
class StrategyConfig:
    """``lightning_dpmp.DPMPStrategy`` arguments (see conf/strategy/dpmp.yaml for each field's meaning)."""

    _target_: str = "lightning_dpmp.DPMPStrategy"
    dp: int = 2
    mp: int = 2
    plan_overrides: Any = None  # {glob: style}; untyped so a command-line dict replaces it (typed dicts are closed)
    sequence_parallel: bool = False
    verify_plan: bool = True
    timeout_s: float = 600.0
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


def _devices(dp: int, mp: int, num_nodes: int = 1) -> int:
    """``trainer.devices`` derived from the layout: processes per node = dp * mp / num_nodes."""
    world = int(dp) * int(mp)
    if world < 1 or int(num_nodes) < 1 or world % int(num_nodes):
        raise ValueError(f"dp * mp = {world} processes cannot be split evenly over num_nodes = {num_nodes}")
    return world // int(num_nodes)


def register_configs() -> None:
    """Registers the schemas (idempotent) and the ``dpmp_devices`` / ``mul`` resolvers."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="strategy", name="dpmp_schema", node=StrategyConfig)
    cs.store(group="model", name="gpt_schema", node=GPTModelConfig)
    if not OmegaConf.has_resolver("dpmp_devices"):
        OmegaConf.register_new_resolver("dpmp_devices", _devices)
    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda *xs: __import__("math").prod(xs))


register_configs()
