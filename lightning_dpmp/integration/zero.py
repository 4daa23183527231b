"""ZeRO-1 over the DP group: each DP rank keeps the optimizer state of 1/dp of the parameters.

torch's ``ZeroRedundancyOptimizer`` partitions the optimizer state across a process group and broadcasts the
updated parameters after each step. Given the DP group, it composes with tensor parallelism: the MP shards are
what gets partitioned, so each rank holds 1/(dp·mp) of AdamW's moments. AdamW is element-wise, so the update, and
with it the training trajectory, is the same as without ZeRO.

Example:
    >>> optimizers = shard_over_dp(optimizers, scheduler_configs, grid.dp_group)   # doctest: +SKIP
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

import lightning_dpmp.compat as compat

__all__ = ["is_zero", "optimizer_state_bytes", "shard_over_dp", "zero_state_dict"]


def _constructor_defaults(cls: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``defaults`` minus keys its constructor does not take (AdamW's ``decoupled_weight_decay``)."""
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in defaults.items() if k in accepted}


def shard_over_dp(optimizers: list[Optimizer], scheduler_configs: list[Any], group: Any) -> list[Optimizer]:
    """Replace each optimizer by a ``ZeroRedundancyOptimizer`` of the same class and param groups over ``group``;
    LR schedulers are re-pointed at the replacement (their state lives in the param groups, which are copied)."""
    out: list[Optimizer] = []
    for opt in optimizers:
        if isinstance(opt, ZeroRedundancyOptimizer):
            out.append(opt)
            continue
        if opt.state:
            raise RuntimeError("ZeRO-1 must wrap the optimizer before its first step (it already holds state).")
        zero = ZeroRedundancyOptimizer(
            [dict(g) for g in opt.param_groups], optimizer_class=type(opt), process_group=group,
            **_constructor_defaults(type(opt), opt.defaults),
        )
        for cfg in scheduler_configs:
            if getattr(cfg.scheduler, "optimizer", None) is opt:
                cfg.scheduler.optimizer = zero
        out.append(zero)
    return out


def is_zero(optimizer: Any) -> bool:
    return isinstance(compat.unwrap_optimizer(optimizer), ZeroRedundancyOptimizer)


def zero_state_dict(optimizer: Any, keep: bool) -> dict[str, Any]:
    """Consolidate a ZeRO optimizer's state on DP rank 0 (collective over DP); the full dict where ``keep``."""
    inner = compat.unwrap_optimizer(optimizer)
    inner.consolidate_state_dict(to=0)
    return inner.state_dict() if keep else {}


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of tensors this rank holds in the optimizer's state (the local partition under ZeRO)."""
    inner = compat.unwrap_optimizer(optimizer)
    inner = inner.optim if isinstance(inner, ZeroRedundancyOptimizer) else inner
    return sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values() if hasattr(v, "numel"))


def unshard(zero: Any, moved: Any, full_state: dict[str, Any]) -> Optimizer:
    """A plain optimizer of the wrapped class over the dense parameters that
    :func:`~lightning_dpmp.planner.parallelize.consolidate` made, loaded with the consolidated ``full_state``: what
    the model's owner gets back after ``fit``."""
    inner = compat.unwrap_optimizer(zero)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [moved.get(id(p), (p,))[0] for p in g["params"]]}
        for g in inner.param_groups
    ]
    constructor, defaults = compat.zero_optimizer_constructor(inner)
    plain = constructor(groups, **_constructor_defaults(constructor, defaults))
    if full_state:
        plain.load_state_dict(full_state)
    return plain
