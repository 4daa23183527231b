"""Splitting the model at setup (one batch traced, the plan made and applied, a meta model materialised) and
gathering it back at teardown.

:func:`split_model` is what ``DPMPStrategy.model_to_device`` runs between Lightning's move to the device and the
DDP wrap; it returns what the strategy keeps for training (:class:`Split`). :func:`unsplit_model` makes the module
(and its optimizers' state) dense again.

Example:
    >>> split = split_model(strategy, trainer, False, None, verify=True, sequence_parallel=False)  # doctest: +SKIP
    >>> print(split.applied_plan.text)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.consolidated import consolidate_optimizer
from lightning_dpmp.checkpoint.weights import load_deferred
from lightning_dpmp.integration import validate
from lightning_dpmp.integration.autoplan import PlanResult, plan_module
from lightning_dpmp.integration.stepdata import first_batch, step_runner
from lightning_dpmp.parallel.rng import RNGTracker, has_dropout
from lightning_dpmp.parallel.sharding import shard_dims
from lightning_dpmp.planner.materialize import materialize
from lightning_dpmp.planner.parallelize import consolidate

__all__ = ["Split", "broadcast_dense", "split_model", "unsplit_model"]


@dataclass
class Split:
    """The result of :func:`split_model`."""

    applied_plan: PlanResult
    rng: Optional[RNGTracker]  # per-MP-rank dropout streams of the split regions; None with mp=1
    sequence_partial: list[nn.Parameter]  # gradients to sum over MP once per step (sequence parallelism)
    split_params: set[int]  # ids of the parameters that are MP shards (for the global-norm clip)


def broadcast_dense(module: nn.Module) -> None:
    """Make every rank start from rank 0's dense weights, so MP shards are slices of one model (unseeded runs)."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.device.type != "meta":
                dist.broadcast(t.data, src=0)


def split_model(
    strategy: Any,
    trainer: Any,
    meta: bool,
    plan_overrides: Optional[Mapping[str, str]],
    verify: bool,
    sequence_parallel: bool,
    zero: int = 0,
) -> Split:
    """Plan and split ``strategy.lightning_module`` in place over ``strategy.grid`` (collective over the world);
    ``zero`` only words the printout's line on steps that leave parameters out."""
    lm = strategy.lightning_module
    assert lm is not None
    grid, device = strategy.grid, strategy.root_device
    validate.check_plan_at_setup(lm, plan_overrides, strategy.mp, strategy.global_rank)  # a configure_model model
    broadcast_dense(lm)
    batch, notes = first_batch(trainer, strategy)
    run = step_runner(trainer, strategy, batch, meta) if batch is not None else None
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    rng = RNGTracker(seed, grid.mp_rank, device, active=has_dropout(lm)) if strategy.mp > 1 else None
    applied = plan_module(
        lm, grid, run, dict(plan_overrides) if plan_overrides else None, verify and not meta, device, notes, rng,
        sequence_parallel, str(trainer.precision), trainer.state.fn == TrainerFn.FITTING,
    )
    if meta:  # only now, split, does each rank allocate: its shards and the replicated rest
        materialize(lm, device, seed, grid.mp_rank)
        load_deferred(lm, grid.mp_group)  # pretrained weights: each rank reads only the slices it holds
    sp = applied.plan.sequence
    names = set(sp.partial_params) if sp is not None else set()
    dims = shard_dims(lm)
    split_params = {id(p) for n, p in lm.named_parameters() if n in dims}
    if strategy.is_global_zero:
        validate.warn_if_mp_idle(len(split_params), strategy.dp, strategy.mp)
    if applied.conditional and strategy.dp > 1:
        applied.text += (
            f"\n  data-dependent parameter use ({'; '.join(applied.conditional)}): "
            + ("DDP finds the parameters no DP rank used, each step (find_unused_parameters=True)"
               if zero == 0 else
               "ZeRO keeps each parameter in its own shard and marks, in one all-reduce per step, those no DP"
               " rank used (their gradients stay None, as on one process)"))
    summary = "; Lightning's model summary counts this rank's parameters" if strategy.mp > 1 else ""
    rank_zero_info(
        f"{applied.text}\n  grid: dp={strategy.dp} x mp={strategy.mp} (rank = dp_rank*mp + mp_rank){summary}"
        + (f"\n{strategy.layout_report}" if getattr(strategy, "layout_report", "") else "")
    )
    return Split(
        applied_plan=applied,
        rng=rng,
        sequence_partial=[p for n, p in lm.named_parameters() if n in names],
        split_params=split_params,
    )


def unsplit_model(strategy: Any) -> None:
    """Gather ``strategy.lightning_module``'s layers back to dense, and its optimizers' state with them (collective;
    under ZeRO the strategy has released the engine first, so the optimizers are plain again)."""
    lm = strategy.lightning_module
    moved = consolidate(lm)
    for optimizer in strategy.optimizers:
        consolidate_optimizer(compat.unwrap_optimizer(optimizer), moved, strategy.grid.mp_group)
