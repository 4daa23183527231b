"""ZeRO over the DP group, through :class:`~lightning_dpmp.parallel.zero_engine.ZeroEngine`: each DP rank steps
1/dp of every MP-local parameter (ZeRO-1, 2), and at 3 holds only that 1/dp of the parameters between uses.

One schedule serves zero=1 and zero=2: the gradients are reduce-scattered over DP in buckets during the backward,
each rank steps its slice, and one all-gather brings the updated parameters back. A reduce-scatter and an
all-gather move the bytes of DDP's one all-reduce, and each rank's optimizer does 1/dp of the work, so zero=1 is as
fast as zero=0 (torch's ``ZeroRedundancyOptimizer``, which kept DDP's all-reduce and then broadcast every parameter
after the step, measured 0.93x). Sharding the gradients too costs nothing there, so zero=1 does. The MP shards are
what gets partitioned, so each rank holds 1/(dp·mp) of AdamW's moments; AdamW is element-wise, so the trajectory
is the same as without ZeRO. No DDP wrapper at any level >= 1: the engine reduces the gradients over DP itself.
:func:`memory_report` counts what a rank holds, from the tensors' storages, at every level.

Example:
    >>> optimizers, engine = shard_optimizers(module, optimizers, configs, 2, grid, split, partial)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

from torch import nn

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.zero_engine import ZeroEngine
from lightning_dpmp.parallel.zero_shard import storage_bytes
from lightning_dpmp.planner.plan_types import PlanResult

__all__ = ["build_engine", "memory_report", "optimizer_state_bytes", "repoint_schedulers"]


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of tensors this rank holds in the optimizer's state (its DP slices under ZeRO)."""
    inner = compat.unwrap_optimizer(optimizer)
    return sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values() if hasattr(v, "numel"))


def repoint_schedulers(old: Sequence[Any], new: Sequence[Any], scheduler_configs: list[Any]) -> None:
    """LR schedulers of ``old[i]`` now drive ``new[i]`` (their state lives in the param groups, which are copied)."""
    for o, n in zip(old, new):
        for cfg in scheduler_configs:
            if getattr(cfg.scheduler, "optimizer", None) is compat.unwrap_optimizer(o):
                cfg.scheduler.optimizer = n


def build_engine(module: nn.Module, optimizers: list[Any], scheduler_configs: list[Any], level: int, dp_group: Any,
                 split_params: set[int], partial_grads: Sequence[nn.Parameter], conditional: bool = False,
                 branches: tuple[str, ...] = (), mixed_precision: Optional[Any] = None,
                 apart: Optional[dict[int, Any]] = None, reshard_after_forward: bool = True,
                 skip: Optional[Callable[[nn.Module], bool]] = None) -> ZeroEngine:
    """Shard ``module`` and its optimizers over ``dp_group`` (zero=``level``), schedulers re-pointed. ``split_params``
    (ids of the MP shards) is read, not changed: the engine's own shards of them are ``engine.shard_params("split")``.
    ``conditional``, ``branches``: a step may leave parameters out (see :class:`ZeroEngine`); ``apart``: keys of
    parameters no bucket mixes, and ``skip``: modules whose forward takes no part (a pipeline's stages and stand-ins);
    ``reshard_after_forward``: zero=3's trade (see :class:`ZeroEngine`)."""
    plain = [compat.unwrap_optimizer(o) for o in optimizers]
    engine = ZeroEngine(module, plain, level, dp_group, split_params, {id(p) for p in partial_grads},
                        conditional=conditional, branches=branches, mixed_precision=mixed_precision,
                        apart=apart, reshard_after_forward=reshard_after_forward, skip=skip)
    repoint_schedulers(plain, engine.optimizers, scheduler_configs)
    return engine


def shard_optimizers(module: nn.Module, optimizers: list[Any], scheduler_configs: list[Any], level: int, grid: Any,
                     split_params: set[int], partial_grads: Sequence[nn.Parameter],
                     applied: Optional[PlanResult] = None, mixed_precision: Optional[Any] = None,
                     apart: Optional[dict[int, Any]] = None, reshard_after_forward: bool = True,
                     skip: Optional[Callable[[nn.Module], bool]] = None) -> tuple[list[Any], Optional[ZeroEngine]]:
    """The optimizers for ZeRO level ``level`` over ``grid``'s DP group, and the engine: rebuilt over the DP shards
    (:func:`build_engine`, in its conditional mode where the ``applied`` plan's trace saw a step leave parameters out);
    unchanged at zero=0 or dp=1."""
    if not level or grid.dp == 1:
        return optimizers, None
    conditional, branches = (bool(applied.conditional), applied.branches) if applied is not None else (False, ())
    engine = build_engine(module, optimizers, scheduler_configs, level, grid.dp_group, split_params, partial_grads,
                          conditional, branches, mixed_precision, apart, reshard_after_forward, skip)
    return engine.optimizers, engine


def release_engine(engine: ZeroEngine, optimizers: Sequence[Any], scheduler_configs: list[Any]) -> list[Any]:
    """Undo :func:`build_engine` (collective over DP): whole parameters again, and the plain optimizers with their
    gathered state, which the LR schedulers now drive."""
    plain = engine.release()
    repoint_schedulers(optimizers, plain, scheduler_configs)
    return plain


def memory_line(report: dict[str, int], level: int) -> str:
    """The plan printout's line of :func:`memory_report`'s figures."""
    held = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in report.items())
    return f"  bytes held per rank (rank 0, zero={level}): {held}"


def memory_report(
    module: Optional[nn.Module], optimizers: Sequence[Any], engine: Optional[ZeroEngine]
) -> dict[str, int]:
    """Bytes this rank holds now, counted from the storages of the tensors themselves (a freed view counts 0):
    ``parameters`` (the module's and the ZeRO shards), ``gradients``, ``optimizer_state`` and ``buffers``."""
    params: list[Any] = list(module.parameters()) if module is not None else []
    if engine is not None:
        params += engine.shard_params() + [b.shard for b in engine.buckets if not b.trainable]
    inner = [compat.unwrap_optimizer(o) for o in optimizers]
    state = [v for o in inner for s in o.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    seen: set[int] = set()
    return {
        "parameters": storage_bytes(params, seen),
        "gradients": storage_bytes([p.grad for p in params if p.grad is not None], seen),
        "optimizer_state": storage_bytes(state, seen),
        "buffers": storage_bytes(list(module.buffers()) if module is not None else [], seen),
    }
