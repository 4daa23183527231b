"""ZeRO over the DP group. ZeRO-1: each DP rank keeps the optimizer state of 1/dp of the parameters; ZeRO-2/3:
the gradients (and, at 3, the parameters) too, through :class:`~lightning_dpmp.parallel.zero_engine.ZeroEngine`.

torch's ``ZeroRedundancyOptimizer`` partitions the optimizer state across a process group and broadcasts the
updated parameters after each step. Given the DP group, it composes with tensor parallelism: the MP shards are
what gets partitioned, so each rank holds 1/(dp·mp) of AdamW's moments. AdamW is element-wise, so the update, and
with it the training trajectory, is the same as without ZeRO.

ZeRO-2/3 (:func:`build_engine`) need no DDP wrapper: the engine reduce-scatters the gradients over DP itself.
:func:`memory_report` counts what a rank holds, from the tensors' storages, at every level.

Example:
    >>> optimizers = shard_over_dp(optimizers, scheduler_configs, grid.dp_group)   # doctest: +SKIP
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Callable, Optional

from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.clipping import sync_sequence_partial_grads
from lightning_dpmp.parallel.zero_engine import ZeroEngine
from lightning_dpmp.parallel.zero_shard import storage_bytes

__all__ = [
    "build_engine", "is_zero", "memory_report", "optimizer_state_bytes", "repoint_schedulers", "shard_over_dp",
    "then_finish_zero", "zero_state_dict",
]


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


# ---------------------------------------------------------------------------------------------- ZeRO-2/3
def repoint_schedulers(old: Sequence[Any], new: Sequence[Any], scheduler_configs: list[Any]) -> None:
    """LR schedulers of ``old[i]`` now drive ``new[i]`` (their state lives in the param groups, which are copied)."""
    for o, n in zip(old, new):
        for cfg in scheduler_configs:
            if getattr(cfg.scheduler, "optimizer", None) is compat.unwrap_optimizer(o):
                cfg.scheduler.optimizer = n


def build_engine(module: nn.Module, optimizers: list[Any], scheduler_configs: list[Any], level: int, dp_group: Any,
                 split_params: set[int], sequence_partial: Sequence[nn.Parameter], conditional: bool = False,
                 branches: tuple[str, ...] = ()) -> ZeroEngine:
    """Shard ``module`` and its optimizers over ``dp_group`` (zero=``level``); schedulers re-pointed, and the ids of
    the MP-split shards added to ``split_params`` so that the global-norm clip sums their squares over MP.
    ``conditional``, ``branches``: a step may leave parameters out (see :class:`ZeroEngine`)."""
    plain = [compat.unwrap_optimizer(o) for o in optimizers]
    engine = ZeroEngine(module, plain, level, dp_group, split_params, {id(p) for p in sequence_partial},
                        conditional=conditional, branches=branches)
    repoint_schedulers(plain, engine.optimizers, scheduler_configs)
    split_params.update(id(p) for p in engine.shard_params("split"))
    return engine


def shard_optimizers(module: nn.Module, optimizers: list[Any], scheduler_configs: list[Any], level: int, grid: Any,
                     split_params: set[int], sequence_partial: Sequence[nn.Parameter], applied: Any = None
                     ) -> tuple[list[Any], Optional[ZeroEngine]]:
    """The optimizers for ZeRO level ``level`` over ``grid``'s DP group, and the engine of levels 2/3: zero=1 wraps
    them in ``ZeroRedundancyOptimizer`` (:func:`shard_over_dp`), zero=2/3 rebuild them over the DP shards
    (:func:`build_engine`, in its conditional mode where the ``applied`` plan's trace saw a step leave parameters out);
    unchanged at zero=0 or dp=1."""
    if not level or grid.dp == 1:
        return optimizers, None
    if level == 1:
        return shard_over_dp(optimizers, scheduler_configs, grid.dp_group), None
    conditional, branches = (bool(applied.conditional), applied.branches) if applied is not None else (False, ())
    engine = build_engine(module, optimizers, scheduler_configs, level, grid.dp_group, split_params, sequence_partial,
                          conditional, branches)
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


def then_finish_zero(closure: Callable[[], Any], engine: ZeroEngine, mp_group: Any) -> Callable[[], Any]:
    """``closure`` (forward and backward; the engine's end-of-backward already waited for the reduce-scatters),
    then the MP sum of the sequence-parallel partial shards' gradients, before the clip and the step."""

    def run() -> Any:
        result = closure()
        sync_sequence_partial_grads(list[Any](engine.shard_params("partial")), mp_group)
        return result

    return run


def memory_report(
    module: Optional[nn.Module], optimizers: Sequence[Any], engine: Optional[ZeroEngine]
) -> dict[str, int]:
    """Bytes this rank holds now, counted from the storages of the tensors themselves (a freed view counts 0):
    ``parameters`` (the module's and the ZeRO shards), ``gradients``, ``optimizer_state`` and ``buffers``."""
    params: list[Any] = list(module.parameters()) if module is not None else []
    if engine is not None:
        params += engine.shard_params() + [b.shard for b in engine.buckets if not b.trainable]
    inner = [compat.unwrap_optimizer(o) for o in optimizers]
    inner = [o.optim if isinstance(o, ZeroRedundancyOptimizer) else o for o in inner]
    state = [v for o in inner for s in o.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    seen: set[int] = set()
    return {
        "parameters": storage_bytes(params, seen),
        "gradients": storage_bytes([p.grad for p in params if p.grad is not None], seen),
        "optimizer_state": storage_bytes(state, seen),
        "buffers": storage_bytes(list(module.buffers()) if module is not None else [], seen),
    }
