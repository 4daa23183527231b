"""Splitting the model at setup (one batch traced, the plan made and applied, a meta model materialised) and
gathering it back at teardown.

:func:`split_model` is the first step of the parallelize pipeline (:mod:`lightning_dpmp.integration.parallelize`),
after Lightning's move to the device and before the DP wrap; it returns what training keeps (:class:`Split`).
:func:`unsplit_model` makes the module (and its optimizers' state) dense again.

Example:
    >>> split = split_model(first, grid, None, verify=True, sequence_parallel=False)  # doctest: +SKIP
    >>> print(split.applied_plan.text)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.consolidated import consolidate_optimizer, optimizer_to_meta
from lightning_dpmp.checkpoint.weights import DEFERRED_ATTR, DeferredWeights, RankZeroWeights, load_deferred
from lightning_dpmp.integration import validate
from lightning_dpmp.integration.autoplan import plan_module
from lightning_dpmp.integration.firststep import FirstStep
from lightning_dpmp.integration.verify import DenseStep
from lightning_dpmp.parallel.bridge import DTensorBridge
from lightning_dpmp.parallel.comm import broadcast_dense
from lightning_dpmp.parallel.dtensor_params import DTensorParams
from lightning_dpmp.parallel.rng import RNGTracker, has_dropout
from lightning_dpmp.parallel.sharding import DenseGather, params_to_meta, shard_dims
from lightning_dpmp.planner.apply_plan import consolidate
from lightning_dpmp.planner.materialize import is_meta, materialize
from lightning_dpmp.planner.plan_types import PlanResult
from lightning_dpmp.planner.user_plan import PlanOverrides

__all__ = [
    "Split", "agree_on_meta", "meta_safe_teardown", "split_model", "split_module", "unsplit_model"
]


@dataclass
class Split:
    """The result of :func:`split_model`."""

    applied_plan: PlanResult
    rng: Optional[RNGTracker]  # per-MP-rank dropout streams of the split regions; None with mp=1
    partial_grads: list[nn.Parameter]  # gradients to sum over MP once per step (partial layers, sequence parallelism)
    split_params: set[int]  # ids of the parameters that are MP shards (for the global-norm clip)
    # the parameters as DTensors on the grid's mesh (what user code reads) and the bridge user code runs under;
    # None when they stay plain (mp=1, or a path not distributed yet: ZeRO, pipelines, Fabric)
    params: Optional[DTensorParams] = None
    bridge: Optional[DTensorBridge] = None


def agree_on_meta(module: nn.Module, global_rank: int, device: torch.device) -> bool:
    """Whether the model is to be split from the meta device, agreed by every rank (one all-reduce).

    A model that is meta on some ranks and real on global rank 0 (what ``consolidate_on_teardown="rank0"`` leaves
    after a run, for the next ``fit``/``validate``/``test``) is taken from rank 0: every rank turns its parameters
    to meta, and after the split each reads its slices of rank 0's tensors, one broadcast tensor at a time.
    Raises ``ValueError`` on every rank when rank 0 is meta but another rank is not.
    """
    lm = module
    meta = is_meta(lm)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return meta
    real0 = global_rank == 0 and not meta
    flags = torch.tensor([float(meta), float(not meta), float(real0)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    any_meta, any_real, rank0_real = (bool(f) for f in flags.tolist())
    if not any_meta or not any_real:
        return any_meta
    if not rank0_real:
        raise ValueError(
            "The model's parameters are on the meta device on global rank 0 but real on another rank: build it the"
            " same way on every rank (lightning_dpmp.from_pretrained decides laziness per process: create the"
            " Trainer before the model, call it in configure_model, or pass lazy=True)."
        )
    state = {k: v.detach() for k, v in lm.state_dict().items()} if global_rank == 0 else None
    for mod in lm.modules():  # rank 0's values win over any other source
        mod.__dict__.pop(DEFERRED_ATTR, None)
    params_to_meta(lm)
    lm.__dict__[DEFERRED_ATTR] = DeferredWeights(RankZeroWeights(state, device))
    return True


def split_module(
    module: nn.Module,
    grid: Any,
    device: torch.device,
    run: Optional[Callable[[], Any]],
    plan_overrides: PlanOverrides,
    verify: bool,
    sequence_parallel: bool,
    precision: str,
    training: bool,
    meta: bool,
    notes: Optional[list[str]] = None,
    free: frozenset = frozenset(),
    mesh: Optional[Any] = None,
    recorded: Optional[DenseStep] = None,
    synced: bool = False,
    bridge: Optional[DTensorBridge] = None,
) -> Split:
    """Plan ``module`` from ``run`` (one step, or ``None`` when there is no batch) and split it in place over
    ``grid`` (collective over the world): every rank starts from rank 0's dense weights, the split regions get
    their dropout streams, and a meta model is materialised shard by shard and its pending weights read. With a
    ``mesh`` (the grid's ``("dp", "pp", "mp")``) and ``mp > 1``, the split parameters become DTensors on it
    (:mod:`lightning_dpmp.parallel.dtensor_params`), the plan is verified on them, and the :class:`Split` carries
    them and the bridge user code runs under. ``recorded``: the dense run of ``run`` made already, after every rank
    took rank 0's weights (``synced``). ``bridge``: the one to use (Fabric's, shared by every module it splits
    on ``mesh``); else a new one. The one core of the Trainer strategy's setup (:func:`split_model`) and of
    Fabric's first call."""
    if not synced:
        broadcast_dense(module)  # unseeded runs agree (meta tensors are skipped)
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    rng = RNGTracker(seed, grid.mp_rank, device, active=has_dropout(module)) if grid.mp > 1 else None
    if bridge is None and mesh is not None and grid.mp > 1:
        bridge = DTensorBridge(mesh)

    def distribute(m: nn.Module) -> DTensorParams:
        assert bridge is not None
        params = DTensorParams(m, mesh, grid.mp)
        params.install_hooks(bridge.step_aside, bridge.step_back)
        return params

    applied = plan_module(module, grid, run, plan_overrides, verify and not meta, device, notes, rng,
                          sequence_parallel, precision, training, distribute if bridge is not None else None, bridge,
                          recorded)
    if meta:  # only now, split, does each rank allocate: its shards and the replicated rest
        materialize(module, device, seed, grid.mp_rank, free)
        load_deferred(module, grid.mp_group)  # pretrained weights: each rank reads only the slices it holds
    params = applied.params
    if bridge is not None and params is None:  # not verified on DTensors (no check, or a meta model): now
        params = distribute(module)
    with params.local() if params is not None else contextlib.nullcontext():
        dims, partial = shard_dims(module), set(applied.plan.partial_params)
        named = list(module.named_parameters())
    return Split(
        applied_plan=applied,
        rng=rng,
        partial_grads=[p for n, p in named if n in partial],
        split_params={id(p) for n, p in named if n in dims},
        params=params,
        bridge=bridge,
    )


def split_model(
    first: FirstStep,
    grid: Any,
    plan_overrides: PlanOverrides,
    verify: bool,
    sequence_parallel: bool,
    free: frozenset = frozenset(),
    mesh: Optional[Any] = None,
    layout_report: str = "",
) -> Split:
    """Plan and split the LightningModule of ``first`` (the setup's record of the first step: its module, device,
    precision plugin and dense run) in place over ``grid`` (collective over the world); a meta model's parameters
    named in ``free`` are freed right after their initialisation (a pipeline's other stages); ``mesh``: the
    parameters become DTensors on it (:func:`split_module`); ``layout_report``: how (dp, mp) was chosen, printed with
    the plan."""
    lm, trainer = first.module, first.trainer
    validate.check_plan_at_setup(lm, plan_overrides, grid.mp, grid.rank)  # a configure_model model
    recorded = first.dense()  # (the record's, when an earlier step, the layout choice or the stage cut, ran it)
    split = split_module(lm, grid, first.device, first.runner(), plan_overrides, verify, sequence_parallel,
                         str(trainer.precision), trainer.state.fn == TrainerFn.FITTING, first.meta, first.notes, free,
                         mesh, recorded=recorded, synced=first.synced)
    applied, split_params = split.applied_plan, split.split_params
    if grid.rank == 0:
        validate.warn_if_mp_idle(len(split_params), grid.dp, grid.mp)
    if applied.conditional and grid.dp > 1:
        applied.text += (f"\n  data-dependent parameter use ({'; '.join(applied.conditional)}): "
                         + _unused_line(grid, split.params is not None))
    summary = ""
    if split.params is not None:
        summary = "; parameters are DTensors on the (dp, pp, mp) mesh: user code reads the dense model"
    elif grid.mp > 1:
        summary = "; Lightning's model summary counts this rank's parameters"
    rank_zero_info(
        f"{applied.text}\n  grid: {_grid_line(grid)}{summary}"
        + (f"\n{layout_report}" if layout_report else "")
    )
    return split


def _unused_line(grid: Any, dtensors: bool) -> str:
    """How the DP reduction of this topology keeps a ``None`` gradient for a parameter no DP rank used."""
    if grid.topology.zero_enabled:
        return ("ZeRO keeps each parameter in its own shard and marks, in one all-reduce per step, those no DP rank"
                " used (their gradients stay None, as on one process)")
    if grid.pp > 1 or dtensors:
        return ("the DP gradient all-reduce carries a used-here flag per parameter, so a parameter no DP rank used"
                " keeps a None gradient, as on one process")
    return "DDP finds the parameters no DP rank used, each step (find_unused_parameters=True)"


def _grid_line(grid: Any) -> str:
    topology = grid.topology
    if topology.pp > 1:
        return (f"dp={topology.dp} x pp={topology.pp} x mp={topology.mp}"
                " (rank = (dp_rank*pp + pp_rank)*mp + mp_rank)")
    return f"dp={topology.dp} x mp={topology.mp} (rank = dp_rank*mp + mp_rank)"


def unsplit_model(module: nn.Module, optimizers: list[Any], grid: Any, everywhere: bool = True) -> None:
    """Gather ``module``'s layers (split over ``grid``) back to dense, and the state of its ``optimizers`` with them
    (collective; under ZeRO the strategy has released the engine first, so the optimizers are plain again).

    ``everywhere=False``: only global rank 0 ends with the plain model. Its MP group gathers each tensor onto it
    (no all-gather); the other DP rows do not communicate at all; every rank but 0 ends with the dense shapes on
    the meta device, having held nothing more than its shards.
    """
    lm = module
    if everywhere:
        gather = DenseGather()
    else:
        gather = DenseGather(to_first=True, keep=grid.rank == 0, communicate=grid.dp_rank == 0)
    moved = consolidate(lm, gather)
    for optimizer in optimizers:
        consolidate_optimizer(compat.unwrap_optimizer(optimizer), moved, grid.mp_group, gather)
    if not gather.keep:  # the replicated rest too: the next setup takes every value from rank 0
        meta = params_to_meta(lm)
        for optimizer in optimizers:
            optimizer_to_meta(compat.unwrap_optimizer(optimizer), meta)


@contextlib.contextmanager
def meta_safe_teardown(module: Optional[nn.Module], optimizers: list[Any]) -> Iterator[list[Any]]:
    """Around Lightning's teardown, which moves the module and optimizer state to the CPU: yields the optimizers it
    may move. A ``module`` left with meta parameters (a rank that does not keep the model, or a setup that failed
    before materialising) moves its real tensors only, and ``optimizers`` holding meta state (the earlier run's,
    whose model went to rank 0 before this run split it again) are left out, instead of failing with "Cannot copy
    out of meta tensor". The caller holds the yielded list while the teardown runs, and its own afterwards."""
    lm = module
    module_meta = lm is not None and is_meta(lm)
    movable = [o for o in optimizers if not _meta_state(o)]
    if not module_meta and len(movable) == len(optimizers):
        yield optimizers
        return
    if module_meta:
        assert lm is not None
        compat.module_apply(lm, lambda t: t if t.is_meta else t.cpu())
        lm.__dict__["cpu"] = lambda: lm  # Strategy.teardown calls lightning_module.cpu(); the move is done above
        movable = []  # their state is meta on this rank, or was never made
    try:
        yield movable
    finally:
        if lm is not None:
            lm.__dict__.pop("cpu", None)


def _meta_state(optimizer: Any) -> bool:
    """Whether ``optimizer`` holds any state tensor on the meta device."""
    inner = compat.unwrap_optimizer(optimizer)
    return any(isinstance(v, torch.Tensor) and v.is_meta for s in inner.state.values() for v in s.values())
