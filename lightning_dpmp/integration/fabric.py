"""DP x MP under Lightning Fabric: ``Fabric(strategy=FabricDPMPStrategy(dp=2, mp=2))``, the model code unchanged.

Fabric has no ``training_step`` to trace, and ``fabric.setup(model, optimizer)`` comes before any data, so the model
is planned and split at its **first forward call**: the wrapper :func:`~FabricDPMPStrategy.setup_module` returns
gives the ranks of each MP group one batch (rank ``dp_rank * mp`` sends its inputs, as the Trainer strategy's
``mp_batch="broadcast"``), traces that call, plans, splits in place (each rank keeps 1/mp of every split weight)
and verifies the result against the dense call, exactly as the Trainer strategy does at setup
(:func:`~lightning_dpmp.integration.autoplan.plan_module`). What the call returns stays whole on every rank (the
trace's outputs may not be split), so the user's loss, metrics and anything else downstream see dense tensors. The
optimizers given to ``fabric.setup`` are then re-pointed at the split parameters (any state they hold is sliced),
and a model built lazily (:func:`lightning_dpmp.from_pretrained`, ``fabric.init_module(empty_init=True)``) is
materialised shard by shard and its pending weights read slice by slice.

Gradients: each backward leaves local gradients; before the first ``fabric.clip_gradients`` or ``optimizer.step()``
that follows, the partial gradients are summed over MP and every gradient is averaged over the DP group in one
all-reduce per dtype (a presence flag per parameter rides along, so a parameter no DP rank used keeps ``None`` as
on one process). Gradient accumulation therefore needs nothing (``fabric.no_backward_sync`` is a no-op: nothing
syncs in backward). ``fabric.clip_gradients(model, optimizer, max_norm=...)`` clips by the dense global norm.

Checkpoints: ``fabric.save`` writes the dense model and optimizer state under the dense names (global rank 0
writes, its MP group gathers), which load into the plain model or into any (dp, mp); ``fabric.load`` slices them
for this rank (before the first call too: the optimizer's state is sliced when the model is split).
``fabric.all_reduce``/``all_gather`` default to the DP group (the ranks of an MP group hold the same values).

What user code reads (``mp > 1``): the split parameters are DTensors on the grid's mesh, as under the Trainer
strategy, and from the first call on user code runs under the strategy's one
:class:`~lightning_dpmp.parallel.bridge.DTensorBridge` (Fabric has no end of run: it stays until the strategy's
``teardown`` or the process ends): norms over ``model.parameters()``, ``model.state_dict()``
and an L2 term in the loss (``fabric.backward`` takes a DTensor loss's plain value) are the dense model's. The
layers compute on, and the optimizers step, the plain local shards; checkpoints are cut from them.

``activation_checkpointing="blocks"`` recomputes every repeated block in the backward, applied right after the split
(:mod:`lightning_dpmp.parallel.recompute`), as the Trainer strategy applies it.

Not under Fabric (refused at construction, with the reason): ZeRO, ``compile=True``, ``mp="auto"``,
``activation_checkpointing="auto"`` (it profiles a ``training_step``, which Fabric has none of).

Example:
    >>> from lightning.fabric import Fabric                                            # doctest: +SKIP
    >>> fabric = Fabric(accelerator="cpu", devices=4, strategy=FabricDPMPStrategy(dp=2, mp=2))  # doctest: +SKIP
    >>> fabric.launch()                                                                 # doctest: +SKIP
    >>> model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))  # doctest: +SKIP
    >>> loss = F.cross_entropy(model(x), y); fabric.backward(loss); optimizer.step()    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.consolidated import (
    consolidate_optimizer_state,
    gather_state_dict,
    optimizer_param_blocks,
    optimizer_param_dims,
    shard_optimizer_state,
    shard_state_dict,
)
from lightning_dpmp.checkpoint.weights import note_deferring_strategy
from lightning_dpmp.integration import validate
from lightning_dpmp.integration.activations import apply_recompute, describe
from lightning_dpmp.integration.mp_batch import broadcast_batch
from lightning_dpmp.integration.split import Split, split_module
from lightning_dpmp.integration.stepdata import real_tensors_on_meta, to_meta
from lightning_dpmp.parallel.bridge import DTensorBridge, plain_value
from lightning_dpmp.parallel.clipping import clip_grad_norm_, sync_partial_grads
from lightning_dpmp.parallel.comm import all_reduce_grads
from lightning_dpmp.parallel.grid import DEFAULT_TIMEOUT, Grid, build_grid, device_mesh
from lightning_dpmp.parallel.rng import RNGTracker
from lightning_dpmp.parallel.sharding import shard_blocks, shard_dims
from lightning_dpmp.parallel.topology import Topology, check_parallel_size
from lightning_dpmp.parallel.zero_engine import find_units
from lightning_dpmp.planner.materialize import empty_parameters, is_meta
from lightning_dpmp.planner.plan_types import PlanResult
from lightning_dpmp.planner.trace import NoDropout

__all__ = ["FabricDPMPStrategy", "ParallelOnFirstCall"]


def _surrogate_loss(out: Any) -> Optional[Tensor]:
    """A scalar that depends on every floating output of the traced call, for the plan's gradient check: the mean
    square of each output, summed, each in its own dtype (the user's loss is computed later, outside the call)."""
    leaves = [t for t in compat.tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point()]
    return torch.stack([t.square().mean() for t in leaves]).sum() if leaves else None


@dataclass
class _ModelState:
    """One module given to ``fabric.setup``: its optimizers, and once split at its first call, what the split made
    of it (plan, dropout streams, MP-shard and partial-gradient parameters)."""

    module: nn.Module
    optimizers: list[Optimizer] = field(default_factory=list)
    split: Optional[Split] = None
    pending: bool = False  # a backward ran since the gradients were last reduced

    def owns(self, optimizer: Optimizer) -> bool:
        ids = {id(p) for p in self.module.parameters()}
        if self.split is not None and self.split.params is not None:  # (its optimizers step the local shards)
            ids |= {id(p) for p in self.split.params.locals}
        return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])


class ParallelOnFirstCall(nn.Module):
    """What :meth:`FabricDPMPStrategy.setup_module` returns: the user's module, split over MP at its first call.

    Every call first gives the ranks of the MP group one batch (the group's first rank's inputs), so a data pipeline
    that draws differently per rank cannot make MP ranks compute on different data.
    """

    def __init__(self, state: _ModelState, strategy: "FabricDPMPStrategy") -> None:
        super().__init__()
        self.module = state.module
        self.__dict__["_state"], self.__dict__["_strategy"] = state, strategy  # not submodules

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state: _ModelState = self.__dict__["_state"]
        strategy: FabricDPMPStrategy = self.__dict__["_strategy"]
        grid = strategy.grid
        if grid.mp > 1:
            (args, kwargs), _ = broadcast_batch((args, kwargs), grid.mp_group, src=grid.dp_rank * grid.mp)
        if state.split is None:
            strategy.parallelize_on_call(state, args, kwargs)
        assert state.split is not None
        try:
            return self.module(*args, **kwargs)
        finally:
            if state.split.rng is not None:
                state.split.rng.exit()  # code between calls (data, the user's loss) sees the replicated RNG stream


def _unwrap(module: nn.Module) -> nn.Module:
    """The user's module inside :class:`ParallelOnFirstCall` (what Fabric's checkpoint calls pass), else ``module``."""
    return module.module if isinstance(module, ParallelOnFirstCall) else module


class _NoSyncNeeded:
    """Fabric's backward-sync control for this strategy: nothing syncs in backward (gradients are reduced before
    clipping or stepping), so there is nothing to skip."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class FabricDPMPStrategy(FabricDDPStrategy):
    """Data parallel (``dp`` replicas) x tensor model parallel (``mp``-way split layers) for Lightning Fabric.

    Args:
        dp, mp: the grid (``dp * mp`` must equal ``devices * num_nodes``; one of them may be ``"auto"``).
        plan_overrides, sequence_parallel, verify_plan, timeout, process_group_backend: as
            :class:`~lightning_dpmp.DPMPStrategy`.
        zero, compile: must stay 0 / False (not built for Fabric; the Trainer strategy has them).
        activation_checkpointing: ``None`` (default) or ``"blocks"``: every repeated block recomputes its
            activations in the backward (:mod:`lightning_dpmp.integration.activations`); ``"auto"`` is the Trainer
            strategy's only.

    Example:
        >>> strategy = FabricDPMPStrategy(dp=2, mp=2)
        >>> strategy.applied_plan is None   # planned at the model's first call
        True
    """

    def __init__(
        self,
        dp: Union[int, Literal["auto"]] = "auto",
        mp: Union[int, Literal["auto"]] = "auto",
        plan_overrides: Optional[Mapping[str, str]] = None,
        sequence_parallel: bool = False,
        verify_plan: bool = True,
        timeout: Optional[timedelta] = None,
        zero: int = 0,
        compile: bool = False,
        activation_checkpointing: Optional[Literal["blocks"]] = None,
        process_group_backend: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        check_parallel_size("dp", dp, allow_auto=True)
        check_parallel_size("mp", mp, allow_auto=True)
        if dp == "auto" and mp == "auto":
            raise ValueError("FabricDPMPStrategy needs dp or mp as an integer (the other may be 'auto'): choosing"
                             " both by measurement (mp='auto') is built for the Trainer strategy only.")
        if zero or compile:
            raise ValueError(f"FabricDPMPStrategy does not implement zero={zero!r} or compile={compile!r} yet; use"
                             " lightning_dpmp.DPMPStrategy with the Trainer for ZeRO and compiled blocks.")
        validate.check_recompute(activation_checkpointing)
        if activation_checkpointing == "auto":
            raise ValueError('FabricDPMPStrategy(activation_checkpointing="auto") is not supported: "auto" profiles a '
                             'training_step, which Fabric has none of; use "blocks" (every block) or None.')
        self._recompute = activation_checkpointing
        self._overrides = validate.check_init_args(plan_overrides, sequence_parallel, verify_plan, "rank0", False,
                                                   process_group_backend, "popen", timeout)
        super().__init__(process_group_backend=process_group_backend,
                         timeout=DEFAULT_TIMEOUT if timeout is None else timeout, **kwargs)
        self._dp_arg, self._mp_arg = dp, mp
        self._sequence_parallel, self._verify = bool(sequence_parallel), bool(verify_plan)
        self._grid: Optional[Grid] = None
        self._models: list[_ModelState] = []  # every module given to fabric.setup, latest last
        # (mp > 1) the bridge user code runs under from the first module's split: one for all of them, so that a
        # second module's forward steps aside the same one (Fabric has no end of run: it stays until teardown or
        # the process ends)
        self._bridge: Optional[DTensorBridge] = None
        self._bridge_entered = False
        compat.set_backward_sync_control(self, _NoSyncNeeded())  # fabric.no_backward_sync: a no-op, no warning
        note_deferring_strategy(self)  # from_pretrained from now on leaves its weights to the split

    # ------------------------------------------------------------------ the grid
    @property
    def topology(self) -> Topology:
        """The :class:`~lightning_dpmp.parallel.topology.Topology` for Fabric's devices and nodes (one ``"auto"``
        is world // the other), as the Trainer strategy resolves it; raises, naming the numbers, when it does not
        fit the world."""
        return Topology.resolve(self._dp_arg, self._mp_arg, self.num_processes * self.num_nodes,
                                devices=self.num_processes, num_nodes=self.num_nodes)

    @property
    def dp(self) -> int:
        """Data-parallel size."""
        return self.topology.dp

    @property
    def mp(self) -> int:
        """Tensor-parallel size."""
        return self.topology.mp

    @property
    def grid(self) -> Grid:
        """This rank's :class:`~lightning_dpmp.parallel.grid.Grid`, built in ``setup_environment``."""
        if self._grid is None:
            raise RuntimeError("FabricDPMPStrategy.grid is built when Fabric launches (fabric.launch()).")
        return self._grid

    @property
    def applied_plan(self) -> Optional[PlanResult]:
        """The plan applied at the first call of the latest module set up (``.text`` is its printout), ``None``
        before."""
        split = self._models[-1].split if self._models else None
        return split.applied_plan if split is not None else None

    @property
    def rng_tracker(self) -> Optional[RNGTracker]:
        """Per-MP-rank dropout streams of the latest module's split regions (``None`` with mp=1 or before its first
        call)."""
        split = self._models[-1].split if self._models else None
        return split.rng if split is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # MP ranks read the same samples
        return {"num_replicas": self.dp, "rank": self.topology.coords(self.global_rank).dp_rank}

    @override
    def _configure_launcher(self) -> None:
        _ = self.topology  # in the launching process, before any rank starts: raises when it does not fit the world
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        topology = self.topology
        super().setup_environment()
        self._grid = build_grid(topology, timeout=compat.ddp_timeout(self))

    # ------------------------------------------------------------------ the model
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]  # not DDP: split at the first call
        """Move the (dense) module to the device and wrap it: it is split at its first call."""
        if not is_meta(module):
            module.to(self.root_device)
        state = _ModelState(module)
        self._models.append(state)
        return ParallelOnFirstCall(state, self)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not is_meta(module):
            module.to(self.root_device)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # re-pointed at the shards when its module is split; fabric.setup passes a module's optimizers right after it
        owner = self._owner(optimizer) or (self._models[-1] if self._models else None)
        if owner is None:
            raise RuntimeError("FabricDPMPStrategy: set up the model before (or with) its optimizers.")
        owner.optimizers.append(optimizer)
        return optimizer

    def _owner(self, optimizer: Optimizer) -> Optional[_ModelState]:
        return next((m for m in reversed(self._models) if m.owns(optimizer)), None)

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: parameters on the meta device; each rank allocates its shards
        after the split."""
        return empty_parameters() if empty_init else super().module_init_context(empty_init)

    def parallelize_on_call(self, state: _ModelState, args: tuple, kwargs: dict) -> PlanResult:
        """Trace ``state.module(*args, **kwargs)``, plan, split the module in place and verify (collective over
        the world), then re-point its optimizers at the split parameters. Called by the wrapper at the first call."""
        module, grid = state.module, self.grid
        meta = is_meta(module)
        names_before = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        modes = [(m, m.training) for m in module.modules()]
        training = module.training

        def run() -> Any:
            for m, mode in modes:  # `isolated` switches to eval mode; the call runs in the modes it will train in
                m.training = mode
            a, k = (to_meta(args), to_meta(kwargs)) if meta else (args, kwargs)
            with real_tensors_on_meta(module) if meta else nullcontext(), NoDropout() if training else nullcontext():
                out = module(*a, **k)
            return {"loss": _surrogate_loss(out), "output": out}  # the output is returned: it stays whole

        precision = str(getattr(self.precision, "precision", "32-true"))
        if grid.mp > 1 and self._bridge is None:  # one mesh and one bridge for every module split here
            self._bridge = DTensorBridge(device_mesh(grid, self.root_device.type))
        bridge = self._bridge
        entered = bridge is not None and self._bridge_entered
        # (a later module splits while user code runs under the bridge: our own work runs outside it)
        with bridge.aside() if entered and bridge is not None else nullcontext():
            state.split = split_module(module, grid, self.root_device, run, self._overrides, self._verify,
                                       self._sequence_parallel, precision, training, meta,
                                       mesh=bridge.mesh if bridge is not None else None, bridge=bridge)
            self._repoint_optimizers(state, names_before)
        if bridge is not None and not entered:  # user code from here on reads the DTensor parameters
            bridge.__enter__()
            self._bridge_entered = True
        plan = state.split.applied_plan
        if self._recompute == "blocks":  # after the split: the recompute runs the split layers
            names = apply_recompute(module, None, state.split.rng, state.split.params)
            plan.text += "\n" + describe(names, len(find_units(module)))
        if self.global_rank == 0:
            print(f"{plan.text}\n  grid: dp={self.dp} x mp={self.mp} (rank = dp_rank*mp + mp_rank)")
        return plan

    def _repoint_optimizers(self, state: _ModelState, names_before: dict[int, str]) -> None:
        """The optimizers held the dense parameters: give them the split ones (same names, same order), and slice
        any state they already hold (a ``fabric.load`` before the first call)."""
        assert state.split is not None
        params = state.split.params
        with params.local() if params is not None else nullcontext():  # (the shards: what the state is sliced for)
            now = dict(state.module.named_parameters(remove_duplicate=False))
            for opt in state.optimizers:
                saved = opt.state_dict() if opt.state else None
                for group in opt.param_groups:
                    group["params"] = [now[names_before[id(p)]] if id(p) in names_before else p
                                       for p in group["params"]]
                if saved is not None:
                    opt.state.clear()
                    opt.load_state_dict(shard_optimizer_state(saved, optimizer_param_dims(opt, state.module),
                                                              self.grid.mp_group,
                                                              optimizer_param_blocks(opt, state.module)))

    # ------------------------------------------------------------------ gradients
    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        for state in self._models:  # an optimizer's zero_grad cleared the local gradients: the DTensors' go too
            if state.split is not None and state.split.params is not None:
                state.split.params.clear_stale_grads()
        # a loss built from DTensor parameters (an L2 term) is the plain loss one process computes
        super().backward(plain_value(tensor), module, *args, **kwargs)
        for state in self._models:
            state.pending = state.split is not None
            if state.split is not None and state.split.params is not None:
                # the local parameters hold them too (the same storage): a micro-batch's gradients are not taken
                # for stale ones at the next backward (only an optimizer's zero_grad clears the local ones)
                state.split.params.grads_to_local()

    def _reduce_gradients(self, optimizer: Optimizer) -> Optional[_ModelState]:
        """Once per step, before clipping or stepping: the partial gradients of ``optimizer``'s module summed over
        MP, then every gradient of its optimizers averaged over DP (one all-reduce per dtype, presence flags
        included). Returns that module's state (``None`` for an optimizer of no module set up here)."""
        state = self._owner(optimizer)
        if state is None or state.split is None or not state.pending:
            return state
        state.pending = False
        grid = self.grid
        dtensors = state.split.params
        if dtensors is not None:  # the backward reached the DTensor parameters: their local gradients are reduced
            dtensors.grads_to_local()
        partial: list[Tensor] = list(state.split.partial_grads)
        if partial:
            sync_partial_grads(partial, grid.mp_group)
        if grid.dp > 1:
            params = {id(p): p for opt in state.optimizers for g in opt.param_groups for p in g["params"]
                      if p.requires_grad}
            # a parameter no DP rank used keeps None, as on one process
            all_reduce_grads(params.values(), grid.dp_group, average=True, keep_unused=True)
        if dtensors is not None:  # user code reads the reduced gradients (clipped in place later: the same storage)
            dtensors.grads_from_local()
        return state

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._reduce_gradients(compat.unwrap_optimizer(optimizer))
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Clip by the dense model's global norm (shards' squares summed over MP, replicated parameters once)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"FabricDPMPStrategy clips by the 2-norm only (norm_type={norm_type!r}).")
        state = self._reduce_gradients(optimizer)
        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        shards = state.split.split_params if state is not None and state.split is not None else set()
        total = clip_grad_norm_(params, float(max_norm), shards, self.grid.mp_group)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of the gradients is {total.item()}: non-finite.")
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self._reduce_gradients(optimizer)
        super().clip_gradients_value(module, optimizer, clip_val)

    # ------------------------------------------------------------------ collectives for the user
    @override
    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Over the DP group by default: the ranks of an MP group hold the same values (a world sum would count
        each mp times)."""
        return super().all_reduce(tensor, group=self._dp_default(group), reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Over the DP group by default: each sample once, not once per MP rank."""
        return super().all_gather(tensor, group=self._dp_default(group), sync_grads=sync_grads)

    def _dp_default(self, group: Optional[Any]) -> Optional[Any]:
        # Fabric passes the world group when the user gives none: that means the default too
        default = group is None or group is dist.group.WORLD
        return self._grid.dp_group if default and self._grid is not None else group

    # ------------------------------------------------------------------ checkpoints
    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Dense, under the dense names, on the ranks of DP row 0 (global rank 0 writes); local shards elsewhere."""
        module = _unwrap(module)  # fabric.save hands over the module setup_module returned
        with self._local(module):
            state = module.state_dict()
            dims = shard_dims(module)
        if not dims or self.grid.dp_rank != 0:
            return state
        return gather_state_dict(state, dims, self.grid.mp_group, shard_blocks(module))

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = optimizer.state_dict()
        module = self.module_of(optimizer)
        if module is None or self.grid.dp_rank != 0:
            return state
        with self._local(module):
            dims, blocks = optimizer_param_dims(optimizer, module), optimizer_param_blocks(optimizer, module)
        return consolidate_optimizer_state(state, dims, self.grid.mp_group, blocks)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        module = _unwrap(module)
        with self._local(module):
            dims = shard_dims(module)
            if dims:
                state_dict = shard_state_dict(state_dict, dims, self.grid.mp_group, shard_blocks(module))
            module.load_state_dict(state_dict, strict=strict)

    def _local(self, module: nn.Module) -> AbstractContextManager:
        """A context in which ``module``'s registered parameters are its plain local shards (what checkpoints are
        cut from), when they are DTensors."""
        state = next((m for m in self._models if m.module is module), None)
        params = state.split.params if state is not None and state.split is not None else None
        return params.local() if params is not None else nullcontext()

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            return super().load_checkpoint(path, state, strict, weights_only)
        optimizers = {k: o for k, o in state.items() if isinstance(o, Optimizer)}
        for key, opt in optimizers.items():  # their dense state is sliced here; Fabric loads the rest
            state[key] = _SlicedOnLoad(opt, self)
        try:
            return super().load_checkpoint(path, state, strict, weights_only)
        finally:
            state.update(optimizers)

    def module_of(self, optimizer: Optimizer) -> Optional[nn.Module]:
        """The split module whose parameters ``optimizer`` steps (``None`` before its split)."""
        state = self._owner(optimizer)
        return state.module if state is not None and state.split is not None else None

    @override
    def teardown(self) -> None:
        if self._bridge is not None:  # the bridge left, the plain local shards registered again
            self._bridge.leave()
            self._bridge, self._bridge_entered = None, False
        for state in self._models:
            if state.split is not None and state.split.params is not None:
                state.split.params.release()
        self._models = []
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Nothing: DDPStrategy's would register its "ddp" names to this class; pass an instance instead."""


class _SlicedOnLoad:
    """Stands for an optimizer in ``fabric.load``'s state: slices the dense state for this rank, then loads it."""

    def __init__(self, optimizer: Optimizer, strategy: FabricDPMPStrategy) -> None:
        self.optimizer, self.strategy = optimizer, strategy

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        module = self.strategy.module_of(self.optimizer)
        if module is not None:
            with self.strategy._local(module):
                dims = optimizer_param_dims(self.optimizer, module)
                blocks = optimizer_param_blocks(self.optimizer, module)
            state = shard_optimizer_state(state, dims, self.strategy.grid.mp_group, blocks)
        self.optimizer.load_state_dict(state)

