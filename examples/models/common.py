"""Pieces shared by the example LightningModules: optimizer/scheduler wiring and parameter counting."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.1
) -> LambdaLR:
    """Linear warmup for ``warmup_steps`` steps, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""
    total_steps = max(1, int(total_steps))
    warmup_steps = max(0, min(int(warmup_steps), total_steps - 1))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (linear and embedding weights); none on biases and norms."""
    decay, no_decay = [], []
    for p in module.parameters():  # parameters() yields a tied weight once
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizers(
    module: nn.Module,
    optimizer: Optional[OptimizerFactory],
    scheduler: Optional[SchedulerFactory],
    total_steps: int,
) -> Any:
    """Instantiates the Hydra partials (``_partial_: true``) into Lightning's ``configure_optimizers`` output."""
    if optimizer is None:
        optimizer = torch.optim.AdamW
    keywords = getattr(optimizer, "keywords", {}) or {}
    weight_decay = float(keywords.get("weight_decay", 0.0))
    opt = optimizer(params=param_groups(module, weight_decay))
    if scheduler is None:
        return opt
    sched = scheduler(optimizer=opt, total_steps=total_steps)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


def count_parameters(module: nn.Module) -> int:
    """Parameters held by this process (tied weights counted once; MP shards count their local size)."""
    return sum(p.numel() for p in module.parameters())
