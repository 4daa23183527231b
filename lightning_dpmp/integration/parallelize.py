"""The parallelize pipeline: every step that turns the user's dense module into the (dp x mp) one, in one place and
in its order, and the steps that undo it at teardown.

``DPMPStrategy.setup`` calls :func:`parallelize` once, after Lightning's precision conversion and the dense move to
the device (skipped for a meta model). Every step that plans from the first batch reads one record of it,
:class:`~lightning_dpmp.integration.firststep.FirstStep` (made by the strategy, which may have used it already to
choose the layout): the batch is read once and the dense step runs once for the stage cut, the plan and its
verification's reference. The steps, each a short function below, run in this order:

1. :func:`plan_and_split`: trace one step, plan, split over MP (sequence-parallel regions included), materialise a
   meta model and read deferred pretrained weights (:func:`~lightning_dpmp.integration.split.split_model`);
2. :func:`route_metrics`: torchmetrics states sync over the DP group only (MP ranks saw the same batch);
3. :func:`overlap_grad_allreduce`: column layers' input-gradient all-reduce overlapped with their weight gradient;
4. :func:`compile_model`: ``torch.compile`` per block, after the split and its eager verification.

Fitting only:

0b. before step 1, with ``activation_checkpointing="auto"`` on a device with a memory limit, :func:`plan_recompute`:
   the first batch's step profiled on meta tensors and the fewest blocks to recompute predicted
   (:mod:`lightning_dpmp.integration.activations`);
4b. :func:`recompute_blocks`: after the pipeline's stages are built over the split model, the chosen blocks run
   under activation checkpointing (:mod:`lightning_dpmp.parallel.recompute`), so the recompute runs the split
   layers (and under ZeRO the engine's hooks stay around the block's first run only);

0. before step 1, with ``pp > 1``, :func:`plan_pipeline`: the first batch's step is probed on the dense model (in
   the record's dense run when fitting) and
   the repeated blocks are cut into pipeline stages (:mod:`lightning_dpmp.integration.pipeline`), built over the
   split model after step 4; DP then averages the stages' gradients itself (no DDP: its reducer cannot follow a
   schedule's interleaved micro-batches);
5. :func:`wrap_dp`: zero=0 with dp > 1 and no pipeline: ``DistributedDataParallel`` over the DP group
   (``find_unused_parameters`` when the trace saw a step leave parameters out), built by the strategy's
   ``configure_ddp`` with this run's options on a copy of the user's;
6. the user's ``configure_optimizers``, through the strategy's public ``setup_optimizers`` (so the LR finder's
   wrapper of it still applies), over the split parameters;
7. :func:`shard_dp`: zero >= 1 with dp > 1: the ZeRO engine shards gradients, optimizer state (and at 3 the
   parameters) over DP and rebuilds the optimizers over its shards; the strategy then steps those.

Then, at every stage:

8. :func:`install_step_hooks`: global-norm clipping over the shards and ``found_inf`` agreed over the world.

No step receives the strategy: each takes what it reads (the module, the grid, the device, the precision plugin,
the configuration, the optimizers) and returns what it makes, like torchtitan's ``apply_*(model, mesh, config)``.
The two things only Lightning's strategy can do, building DDP and running the user's ``configure_optimizers``,
come in as callables.

:func:`unparallelize` undoes them in reverse at teardown. What the strategy needs between the two is the
:class:`Parallelized` result: the plan, the RNG tracker, which parameters are MP shards or partial, and the engine,
with the few step-time operations that depend on them (:meth:`Parallelized.step_closure`,
:meth:`Parallelized.no_sync`, :meth:`Parallelized.whole`, :meth:`Parallelized.enter_step`).

Example:
    >>> config = ParallelConfig(PlanOverrides(), verify=True, sequence_parallel=True)
    >>> config.sequence_parallel
    True
    >>> parallel = parallelize(trainer, module, model, grid, device, plugin, config, meta=False,  # doctest: +SKIP
    ...                        mesh=lambda: mesh, ddp_kwargs={}, configure_ddp=configure_ddp,
    ...                        setup_optimizers=setup_optimizers)
    >>> print(parallel.plan.text)                                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import lightning_dpmp.compat as compat
from lightning_dpmp.integration import hooks
from lightning_dpmp.integration.activations import (
    NO_LIMIT,
    apply_recompute,
    batch_sequences,
    describe,
    device_budget,
    recompute_count,
)
from lightning_dpmp.integration.firststep import FirstStep
from lightning_dpmp.integration.metrics import route_metrics as route_metrics_over
from lightning_dpmp.integration.pipeline import (
    Pipeline,
    check_pipeline_at_setup,
    probe_pipeline,
    reading_ranks,
    remote_parameters,
    stage_ranges,
)
from lightning_dpmp.integration.split import Split, split_model, unsplit_model
from lightning_dpmp.integration.staged_zero import StagedShards
from lightning_dpmp.integration.teardown import consolidate_engine, keep_on_rank0
from lightning_dpmp.integration.zero import release_engine, shard_optimizers
from lightning_dpmp.parallel.bridge import DTensorBridge
from lightning_dpmp.parallel.clipping import sync_partial_grads
from lightning_dpmp.parallel.comm import all_reduce_grads
from lightning_dpmp.parallel.compiled import compile_blocks, repeated_blocks, uncompile_blocks
from lightning_dpmp.parallel.dtensor_params import DTensorParams, local_tensor
from lightning_dpmp.parallel.freed_reads import GatherOnRead, outermost_forward_hooks, storage_freed
from lightning_dpmp.parallel.layers import set_async_grad_allreduce
from lightning_dpmp.parallel.recompute import uncheckpoint_blocks
from lightning_dpmp.parallel.rng import RNGTracker
from lightning_dpmp.parallel.sharding import shard_dims
from lightning_dpmp.parallel.stage_runner import stood_in
from lightning_dpmp.parallel.staged_grads import StagedGrads
from lightning_dpmp.parallel.topology import Topology
from lightning_dpmp.parallel.zero_engine import ZeroEngine, find_units
from lightning_dpmp.parallel.zero_grads import ShardedGrads, storage_key
from lightning_dpmp.planner.plan_types import PlanResult
from lightning_dpmp.planner.stages import StackProfile
from lightning_dpmp.planner.user_plan import PlanOverrides

__all__ = [
    "ParallelConfig",
    "Parallelized",
    "compile_model",
    "install_step_hooks",
    "overlap_grad_allreduce",
    "parallelize",
    "plan_and_split",
    "plan_pipeline",
    "plan_recompute",
    "recompute_blocks",
    "route_metrics",
    "shard_dp",
    "unparallelize",
    "wrap_dp",
]


@dataclass(frozen=True)
class ParallelConfig:
    """What the strategy's constructor decided about parallelizing (validated there, before any launch); the sizes,
    the ZeRO level and the pipeline's settings are the grid's :class:`~lightning_dpmp.parallel.topology.Topology`."""

    plan_overrides: PlanOverrides
    verify: bool = True
    sequence_parallel: bool = False
    compile: bool = False
    async_grad_allreduce: Optional[bool] = None  # None: on for CUDA, off on CPU/gloo
    mixed_precision: Optional[Any] = None  # zero >= 2: torch's MixedPrecisionPolicy (param_dtype, reduce_dtype)
    reshard_after_forward: bool = True  # zero=3: False keeps a unit gathered to its backward (a pipeline: the step)
    activation_checkpointing: Optional[str] = None  # None, "blocks" or "auto" (integration.activations)


@dataclass
class Parallelized:
    """The result of :func:`parallelize`: what training needs to know about the split model.

    ``split_params`` holds the ids of the parameters that are MP shards, the engine's flat shards of them included
    (the global-norm clip sums their squares over MP); ``partial_grads`` the parameters whose gradients are summed
    over MP once per step (sequence-parallel regions, whole layers inside a column region).
    """

    plan: PlanResult
    rng: Optional[RNGTracker]
    split_params: frozenset[int]
    partial_grads: list[nn.Parameter]
    mp_group: Any
    engine: Optional[ZeroEngine] = None
    compiled: bool = False
    pipeline: Optional[Pipeline] = None
    # the parameters as DTensors (what user code reads) and the bridge user code runs under (None: plain shards)
    params: Optional[DTensorParams] = None
    bridge: Optional[DTensorBridge] = None
    # with DTensor parameters and dp > 1: the DP group their gradients are averaged over after each synced backward,
    # in buckets of at most this many bytes (DDP's bucket_cap_mb, 25 MiB by default)
    dp_group: Any = None
    dp_bucket_bytes: int = 25 * 2**20
    # zero=3 or a pipeline: the mode user code runs under, reading freed parameters' values (None: nothing is freed)
    reader: Optional[GatherOnRead] = None
    # when fitting: the optimizers the strategy steps (over the ZeRO engine's shards at zero >= 1); None otherwise
    optimizers: Optional[list[Any]] = None
    # zero >= 1: the engine's sharded gradients as the parameters' .grad, gathered on first read (under a pipeline,
    # this rank's stages' buckets)
    grads: Optional[ShardedGrads] = None
    # a pipeline: the other stages' gradients as .grad, brought from their owner on first read (the reader's one
    # GradReads, answering for `grads` too)
    staged: Optional[StagedGrads] = None
    _pipeline_reduced: bool = False  # finish_backward ran the pipeline's reductions of this step's closure
    # automatic optimization (one backward per optimizer step, micro-batches before the last inside no_sync): the
    # partial gradients' MP sum runs in finish_backward, before on_after_backward, not after the closure. Manual
    # optimization may run several backwards into one step: a sum after each would count the first ones mp times.
    partial_in_backward: bool = False
    _partial_summed: bool = False  # finish_backward summed this step's partial gradients
    _reader_hooks: list[Any] = field(default_factory=list)
    _hooked: list[Any] = field(default_factory=list)  # the precision plugin the step hooks were installed on
    _accumulating: bool = False  # inside no_sync (a micro-batch before the last): gradients stay local
    _stepped: list[list[Any]] = field(default_factory=list)  # the modes each open _modes_aside took off the stack

    def step_closure(self, closure: Callable[[], Any], stepped: Iterable[nn.Parameter]) -> Callable[[], Any]:
        """``closure`` (forward and backward), then the MP sum of the partial gradients among ``stepped`` (the
        parameters the optimizer steps; read only when there are partial gradients), before the precision plugin
        clips and steps."""
        # a pipeline's PP and DP reductions (under ZeRO the engine's reduce-scatter), then the partial sums (a LoRA A
        # inside a column region): both linear
        if self.pipeline is not None:
            closure = _then(closure, self._reduce_pipeline)
        if self.partial_in_backward:  # (summed in finish_backward, or else here)
            return _then(closure, self._partial_after_closure)
        if self.engine is None and not self.partial_grads:
            return closure
        # manual optimization: each optimizer's step sums those it steps (the engine's shards: all of them)
        mine = {id(p) for p in stepped} if self.engine is None else None
        return _then(closure, lambda: self._sum_partial_now(mine))

    def _partial_after_closure(self) -> None:
        if not self._partial_summed:  # (a backward that did not pass through finish_backward)
            self._sum_partial_now()
        self._partial_summed = False

    def _sum_partial(self) -> None:
        """In finish_backward of the step's synchronised backward (see :attr:`partial_in_backward`): the MP sum of
        the partial gradients, once per step."""
        synced = self.engine.sync if self.engine is not None else not self._accumulating
        if self.partial_in_backward and synced and not self._partial_summed:
            self._sum_partial_now()
            self._partial_summed = True

    def _sum_partial_now(self, only: Optional[set[int]] = None) -> None:
        """The MP sum of the partial gradients (the engine's partial shards under ZeRO; else those ``only`` names,
        when given), one flat all-reduce outside the modes user code runs under (collective over MP: every MP rank
        holds the same partial parameters; those without a gradient are skipped)."""
        if self.engine is not None:
            partial = list[Any](self.engine.shard_params("partial"))
        else:
            partial = [p for p in self.partial_grads if only is None or id(p) in only]
        if partial:
            with self.modes_aside():
                sync_partial_grads(partial, self.mp_group)

    def _reduce_pipeline(self) -> None:
        """The pipeline's PP and DP reductions after the closure, unless :meth:`finish_backward` ran them already
        (before ``on_after_backward``, so that user code there reads reduced gradients)."""
        if self._pipeline_reduced:
            self._pipeline_reduced = False
            return
        assert self.pipeline is not None
        self.pipeline.reduce_grads()

    def after_step(self) -> None:
        """After the optimizer step: ZeRO gathers the updated parameters (zero=1/2) or frees them (zero=3)."""
        if self.engine is not None:
            self.engine.after_step()

    def no_sync(self) -> Any:
        """Context of an accumulating micro-batch (gradients stay local) under ZeRO or with DTensor parameters;
        ``None`` otherwise, where DDP's own ``no_sync`` applies."""
        if self.engine is not None:
            return self.engine.no_sync()
        return self._no_dp_sync() if self.params is not None or self.pipeline is not None else None

    @contextmanager
    def _no_dp_sync(self) -> Iterator[None]:
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def start_backward(self) -> None:
        """Before each backward: DTensor gradients whose local ones an optimizer's ``zero_grad`` cleared are
        cleared too, and under ZeRO the last step's gradient views go (the backward would accumulate into them)."""
        if self.staged is not None:
            self.staged.clear()
        if self.grads is not None:
            with self.modes_aside():
                self.grads.clear()
                if self.params is not None:
                    # (views of the local accumulation after an accumulating micro-batch: the gradient of a read
                    # outside the layers, an L2 term, would be added into them, and then handed on with them)
                    self.params.forget_grads()
        elif self.params is not None:
            with self.modes_aside():
                if self.params.on_locals:
                    # the DTensor forms only wrap the local gradients: a read outside the layers (an L2 term) must
                    # reach the DTensor parameter as its own gradient, handed on to the local one, not added into
                    # last micro-batch's wrapper
                    self.params.forget_grads()
                else:
                    self.params.clear_stale_grads()

    def start_schedule(self) -> None:
        """Before a pipeline's schedule (forward and backward inside ``training_step``): the gradients user code was
        shown go (the other stages' copies; the DTensor forms, into which the schedule's backward of a read outside
        the layers, an L2 term, would otherwise accumulate), the local ones stay."""
        if self.staged is not None:
            self.staged.clear()
        if self.grads is not None:  # (views of freed buffers: the schedule's backward must not accumulate there)
            with self.modes_aside():
                self.grads.clear()
        if self.params is not None:
            self.params.forget_grads()

    def finish_backward(self) -> None:
        """After each backward, before Lightning's ``on_after_backward``: with DTensor parameters, the DP average of
        the gradients (one flat all-reduce per dtype; not while accumulating), and the local parameters the
        optimizer steps take the gradients (the same storage)."""
        params = self.params
        engine = self.engine
        pipeline = self.pipeline
        if pipeline is not None:
            # the schedule's gradients (added by the strategy's backward) reduced over PP and DP now (under ZeRO:
            # reduce-scattered into the shards), not after the closure; then the MP sum of partial ones; the other
            # stages' gradients readable (brought from their owners on a read)
            synced = engine.sync if engine is not None else not self._accumulating
            with self.modes_aside():
                if synced:
                    pipeline.reduce_grads()
                    self._pipeline_reduced = True
                    self._sum_partial()
                if params is not None and engine is None:
                    params.grads_from_local()
                if synced:
                    if self.grads is not None:
                        self.grads.attach()
                    if self.staged is not None:
                        self.staged.attach()
            return
        if engine is not None:  # the engine reduced them already; user code sees them when it reads them
            with self.modes_aside():  # (our own views of the buffers: nothing to gather)
                self._sum_partial()
                if self.grads is not None and engine.reduces_now:
                    self.grads.attach()
                elif params is not None:
                    # a micro-batch that accumulates locally (zero 1/2 until the last one): each rank's local
                    # accumulation, as DDP shows inside no_sync (at mp = 1 the parameters hold it themselves)
                    params.grads_from_local()
            return
        if params is None:
            return
        with self.modes_aside():  # (our own work on the shards: no per-call pass through the bridge)
            if not params.on_locals:
                params.grads_to_local()
            if self.dp_group is not None and not self._accumulating:
                # a parameter no DP rank used keeps None (an optimizer skips it, as on one process): one flag each;
                # in place, so each DTensor gradient still wraps its local one (re-wrapping them was most of the cost)
                all_reduce_grads([p for p in params.locals if p.requires_grad], self.dp_group, average=True,
                                 keep_unused=True, bucket_bytes=self.dp_bucket_bytes, in_place=True)
            self._sum_partial()  # (in place: each DTensor gradient still wraps its local one)
            if params.on_locals or (self.dp_group is not None and not self._accumulating):
                params.grads_from_local()

    @contextmanager
    def modes_aside(self) -> Iterator[None]:
        """The modes user code runs under stepped aside (the reader, innermost, first), for our own work."""
        self._modes_aside()
        try:
            yield
        finally:
            self._modes_back()

    def _modes_aside(self) -> None:
        # which of them this call took off the stack (one already aside, as inside local(), stays as it is)
        self._stepped.append([m for m in (self.reader, self.bridge) if m is not None and m.step_aside()])

    def _modes_back(self) -> None:
        for mode in reversed(self._stepped.pop() if self._stepped else []):
            mode.step_back()

    @contextmanager
    def local(self) -> Iterator[None]:
        """Context in which the module's registered parameters are the plain local shards (what checkpoints,
        clipping and teardown work on), and freed ones stay freed (the reader of user code steps aside)."""
        if self.reader is not None:
            self.reader.step_aside()
        try:
            with self.params.local() if self.params is not None else nullcontext():
                yield
        finally:
            if self.reader is not None:
                self.reader.step_back()

    def watch_freed_reads(self, module: nn.Module) -> None:
        """Under zero=3 or a pipeline parameters are freed between uses: build :attr:`reader`, the
        :class:`~lightning_dpmp.parallel.freed_reads.GatherOnRead` mode user code runs under (the strategy enters
        it), stepped aside while a module's forward runs. At zero=3 a freed parameter's buckets are gathered over DP
        for the read; under a pipeline every parameter that some stage does not read is broadcast from the stage
        that owns it (whether it is freed here differs by rank, so the rule is the same on every rank), and reads
        inside the schedule are refused with the reason."""
        engine, pipeline, params = self.engine, self.pipeline, self.params
        target = params.dtensor if params is not None else _same
        if pipeline is not None:  # another stage's parameter from its owner (the schedule refuses reads)
            watched = {id(p) for p in module.parameters()} | (
                {id(p) for p in params.locals} if params is not None else set())
            grid = pipeline.grid
            # under ZeRO this rank's own gradients are its stages' buckets' shards, gathered over DP when read
            # (the engine's live buckets are this rank's stages' while it trains), and those are what the owner
            # sends to the other stages
            self.grads = ShardedGrads(engine, target, self._grad_of) if engine is not None else None
            staged = [p for p in pipeline.params if id(p) in pipeline.staged_ids]
            # what no step reaches keeps None, as on one process (the names the plan found; its local parameters)
            names = set(self.plan.unreached)
            unreached = frozenset(id(params.local(p) if params is not None and params.owns(p) else p)
                                  for n, p in module.named_parameters() if n in names)
            self.staged = StagedGrads(staged, pipeline.owner,
                                      {id(p) for p in staged if grid.pp_rank in pipeline.ranks[id(p)]},
                                      grid.pp_rank, grid.pp_group, target, self._grad_of, source=self.grads,
                                      unreached=unreached)
            # an L2 term at zero=3 reads its stage's freed parameters inside the schedule: its gradient goes into
            # the engine's accumulator, as without a pipeline
            reader = GatherOnRead(watched, self._pipeline_fetches, self._pipeline_values, self._pipeline_refusal,
                                  grads=self.staged, sink=self._pipeline_sink if engine is not None else None)
            pipeline.quiet = reader.aside
        elif engine is not None:
            # the engine's gradients, read on demand; at zero=3 its parameters too, watched by their buffers'
            # storage (a DTensor parameter's, a view's and a .data alias's alike)
            self.grads = ShardedGrads(engine, target, self._grad_of)
            watched = {storage_key(b.full) for b in engine.buckets} if engine.level == 3 else set()
            reader = GatherOnRead(watched, _freed, self._current_values, key=storage_key, grads=self.grads,
                                  sink=self._sink)
        else:
            return
        self.reader = reader
        if params is not None:  # one pair of hooks steps both modes aside, in stack order
            params.set_modes(self._modes_aside, self._modes_back)
        else:
            self._reader_hooks = outermost_forward_hooks(module, reader.step_aside, reader.step_back)

    def _local_of(self, t: Tensor) -> Tensor:
        params = self.params
        return params.local(t) if params is not None and params.owns(t) else t

    def _pipeline_fetches(self, t: Tensor) -> bool:
        assert self.pipeline is not None
        return self.pipeline.fetches(self._local_of(t))

    def _pipeline_refusal(self, tensors: list[Tensor]) -> Optional[str]:
        assert self.pipeline is not None
        return self.pipeline.refused_read([self._local_of(t) for t in tensors])

    def _pipeline_sink(self, param: Tensor, grad: Tensor) -> None:
        """The gradient of a freed parameter read with gradients enabled under a pipeline with ZeRO: into the
        engine's accumulator when this rank's stages train it (an L2 term at zero=3), else refused."""
        assert self.pipeline is not None
        if id(self._local_of(param)) not in self.pipeline.local:
            raise RuntimeError(
                "A gradient reached another pipeline stage's parameter, read outside its layers and outside the "
                "pipelined training_step: this rank does not train it. Use the optimizer's weight_decay, or read it "
                "inside training_step.")
        self._sink(param, grad)

    @contextmanager
    def _pipeline_values(self, tensors: list[Tensor]) -> Iterator[list[Tensor]]:
        """Another stage's parameters from their owner: each rank receives its own MP shard, a DTensor parameter's
        value a DTensor over it (so a norm of it is the dense one)."""
        assert self.pipeline is not None
        params = self.params
        with self.pipeline.values_of([self._local_of(t) for t in tensors]) as values:
            yield [params.like(t, v) if params is not None and isinstance(t, DTensor) and params.owns(t) else v
                   for t, v in zip(tensors, values)]

    def _grad_of(self, p: nn.Parameter, view: Tensor) -> Tensor:
        """The gradient user code reads of the engine's parameter ``p``, from a view of its values: a DTensor with
        the placements of ``p``'s DTensor form, or the view."""
        return view if self.params is None else self.params.like(p, view)

    @contextmanager
    def _current_values(self, tensors: list[Tensor]) -> Iterator[list[Tensor]]:
        """zero=3: the buckets that ``tensors`` view gathered for the duration; yields each one's values (a
        parameter's from its local one: under mixed precision its master values)."""
        assert self.engine is not None
        with self.engine.gathered(storages={storage_key(t) for t in tensors}):
            yield [self._value_of(t) for t in tensors]

    def _sink(self, param: Tensor, grad: Tensor) -> None:
        """The gradient of a freed parameter that user code read (an L2 term at zero=3): into the engine's
        accumulator for its bucket, as the gradient of its local form (a DTensor's in the parameter's placements)."""
        assert self.engine is not None
        params = self.params
        if params is not None and params.owns(param):
            param, grad = params.local_grad(param, grad)
        self.engine.accumulate(param, grad)  # type: ignore[arg-type]  # (a module parameter)

    def _value_of(self, t: Tensor) -> Tensor:
        params = self.params
        if params is None or not params.owns(t):
            return t.detach()
        loc = params.local(t)
        return loc.detach() if t is loc or not isinstance(t, DTensor) else params.like(t, loc.detach())

    @contextmanager
    def optimizer_update(self, optimizer: Any) -> Iterator[None]:
        """Around the strategy's optimizer step: the optimizer's update (after the closure, which runs the step and
        the hooks of user code before it) runs with the modes of user code aside (:meth:`modes_aside`), and so does
        the optimizer's ``zero_grad`` while the step runs. The optimizer holds the plain local parameters
        (:meth:`DTensorParams.step_locals`, the ZeRO shards), so the bridge has nothing to translate there, yet
        each of AdamW's per-tensor ops passed through it (about 9,000 calls in 13 steps of rank 0 at (2,2)). Under a
        pipeline each rank updates its own stages' parameters and must not fetch them from their owners (the
        reader). A closure the optimizer calls again (LBFGS) runs with the modes back."""
        if self.reader is None and self.bridge is None:
            yield
            return
        inner = compat.unwrap_optimizer(optimizer)
        step, zero_grad = inner.step, inner.zero_grad
        # an LR scheduler wraps ``step`` on the instance: that wrapper is put back afterwards, not deleted
        own = {name: inner.__dict__[name] for name in ("step", "zero_grad") if name in inner.__dict__}
        aside = [False]

        def step_aside() -> None:
            if not aside[0]:
                self._modes_aside()
                aside[0] = True
            if self.staged is not None:  # (the other stages' gradients: read by user code, not stepped here)
                self.staged.clear()

        def step_back() -> None:
            if aside[0]:
                self._modes_back()
                aside[0] = False

        def stepped(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
            def run() -> Any:
                assert closure is not None
                step_back()
                out = closure()
                step_aside()
                return out

            if closure is None:  # (a plugin that ran the closure itself: GradScaler's step)
                step_aside()
            return step(closure=run if closure is not None else None, **kwargs)

        def zeroed(*args: Any, **kwargs: Any) -> Any:
            with self.modes_aside():
                return zero_grad(*args, **kwargs)

        inner.step, inner.zero_grad = stepped, zeroed  # this call only: instance attributes shadow the class's
        try:
            yield
        finally:
            for name in ("step", "zero_grad"):
                if name in own:
                    setattr(inner, name, own[name])
                else:
                    delattr(inner, name)
            step_back()

    def leave_reader(self) -> None:
        """Take :attr:`reader` off the mode stack (teardown) and remove its hooks."""
        if self.reader is not None:
            self.reader.leave()
        for h in self._reader_hooks:
            h.remove()
        self._reader_hooks.clear()
        self.reader = None

    def whole(self) -> Any:
        """Context in which every parameter holds its values (zero=3 gathers them over DP, then frees them; a
        pipeline brings the other stages' parameters, until its next step frees them again)."""
        if self.pipeline is not None:
            return self.pipeline.whole()
        return self.engine.gathered() if self.engine is not None else nullcontext()

    @contextmanager
    def enter_step(self, training: bool) -> Iterator[None]:
        """Around a training/validation/test/predict step: zero=3 gathers the parameters outside the repeated blocks
        (a training step's stay until its optimizer step), and the split regions' dropout stream is left after it,
        so the data pipeline between steps sees the replicated RNG stream."""
        if self.engine is not None:
            self.engine.gather_root()
        try:
            yield
        finally:
            if self.engine is not None and not training:
                self.engine.free_root()
            if self.rng is not None:
                self.rng.exit()


def _same(p: nn.Parameter) -> nn.Parameter:
    return p


def _add_grad(p: nn.Parameter, grad: Tensor) -> None:
    with torch.no_grad():
        p.grad = grad.clone() if p.grad is None else p.grad.add_(grad)


def _freed(t: Tensor) -> bool:
    return storage_freed(local_tensor(t))


def _then(closure: Callable[[], Any], after: Callable[[], None]) -> Callable[[], Any]:
    def run() -> Any:
        out = closure()
        after()
        return out

    return run


# ---------------------------------------------------------------------------------------------- the steps
def plan_and_split(first: FirstStep, grid: Any, config: ParallelConfig, mesh: Callable[[], Any],
                   free: frozenset = frozenset(), layout_report: str = "") -> Split:
    """Step 1: trace, plan and split the LightningModule of ``first`` (the setup's record of the first step) over
    ``grid`` (collective); a meta model's parameters named in ``free`` are initialised and their storage freed at
    once (other stages'). The split parameters become DTensors on the grid's mesh (``mesh()``, built only then:
    :func:`distributes_parameters`)."""
    fitting = first.trainer.state.fn == TrainerFn.FITTING
    on_mesh = mesh() if distributes_parameters(grid.topology, fitting) else None
    return split_model(first, grid, config.plan_overrides, config.verify, config.sequence_parallel, free, on_mesh,
                       layout_report)


def distributes_parameters(topology: Topology, fitting: bool) -> bool:
    """Whether the split parameters become DTensors (:mod:`lightning_dpmp.parallel.dtensor_params`): with mp > 1
    (with mp = 1 every parameter is whole, as one process holds it), at every zero level and under a pipeline."""
    return topology.mp > 1


def route_metrics(module: nn.Module, dp_group: Any) -> None:
    """Step 2: torchmetrics in ``module`` sum their states over the DP group, not the world."""
    route_metrics_over(module, dp_group)


def overlap_grad_allreduce(module: nn.Module, setting: Optional[bool], device_type: str) -> None:
    """Step 3: column layers overlap their input-gradient all-reduce with their weight gradient (``None``: on CUDA,
    where streams make it pay; on CPU/gloo it only adds threads)."""
    set_async_grad_allreduce(module, device_type == "cuda" if setting is None else setting)


def compile_model(module: nn.Module, enabled: bool) -> bool:
    """Step 4: ``torch.compile`` each repeated block in place; after the split and the plan's eager verification,
    so that the compiled code is the split model's. Returns whether it compiled."""
    if enabled:
        compile_blocks(module)
    return enabled


def plan_pipeline(first: FirstStep, grid: Any) -> tuple[StackProfile, frozenset]:
    """Step 0 (``pp > 1``), before the split: probe the first batch's step (the run's own: training, validation, test
    or predict; when training, read from the record's one dense run) on the dense model (on meta tensors for a meta
    model) and check that it can be cut into stages. Returns the probe's profile and, for a meta model, the names of
    the parameters this rank's stages never read: the split initialises them and frees their storage at once, so that
    no rank ever holds more than its stages and one module."""
    lm, config, trainer = first.module, grid.topology, first.trainer
    if trainer.state.fn == TrainerFn.FITTING:  # (evaluation runs no backward: any optimization and precision can be
        check_pipeline_at_setup(trainer, lm)  # evaluated stage by stage)
    batch = first.batch  # (rank 0 reads, every rank receives: the same probe everywhere)
    if batch is None:
        raise RuntimeError(f"DPMPStrategy(pp > 1) plans its stages from the first batch of the run; the "
                           f"{trainer.state.fn} dataloader gave none.")
    profile = probe_pipeline(first.stack, batch, config)
    if not first.meta:
        return profile, frozenset()
    ranks = reading_ranks(lm, profile, stage_ranges(profile, config), grid.pp)
    remote = remote_parameters(lm, profile, ranks, grid.pp_rank)
    return profile, frozenset(n for n, p in lm.named_parameters(remove_duplicate=False) if id(p) in remote)


def plan_recompute(first: FirstStep, grid: Any, config: ParallelConfig) -> tuple[Optional[int], str]:
    """Step 0b (fitting with ``activation_checkpointing``): how many blocks of each stage recompute (``None``: all)
    and the printout's line. ``"auto"`` profiles the dense module's step on meta tensors
    (:meth:`~lightning_dpmp.integration.firststep.FirstStep.recompute_profile`) and asks the estimator, on a device
    with a memory limit."""
    if config.activation_checkpointing != "auto":
        return None, ""
    budget = device_budget(first.device)  # (the same kind of device on every rank: all take this branch or none)
    if budget is None:
        return 0, NO_LIMIT
    # every rank recomputes the same blocks (a recompute re-issues MP collectives): the smallest budget decides
    least = torch.tensor([budget], dtype=torch.float64, device=first.device)
    torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
    budget = float(least.item())
    batch = first.batch
    prof = first.recompute_profile()
    k, line = recompute_count(prof, grid.topology, config.sequence_parallel, batch_sequences(batch)[0],
                              str(first.trainer.precision), budget)
    return k, line


def recompute_blocks(module: nn.Module, setting: Optional[str], count: Optional[int], split: Split,
                     pipeline: Optional[Pipeline]) -> str:
    """Step 4b: the blocks ``setting`` names (``count`` of each stage, ``None``: all) run under activation
    checkpointing, restoring the split's dropout stream and DTensor views in the recompute. Returns the printout's
    line ("" when nothing is set)."""
    if setting is None or count == 0:
        return ""
    # a count is of the blocks the estimator profiled and the pipeline cuts: the ModuleList's
    blocks = repeated_blocks(module) if count is not None else find_units(module)
    ranges = list(pipeline.ranges) if pipeline is not None and count is not None else None
    names = apply_recompute(module, count, split.rng, split.params, ranges, blocks)
    return describe(names, len(blocks)) if setting == "blocks" else ""


def wrap_dp(configure_ddp: Callable[[dict[str, Any]], None], ddp_kwargs: Mapping[str, Any], grid: Any,
            conditional: bool) -> None:
    """Step 5 (zero=0, dp > 1): ``DistributedDataParallel`` over the DP group, so gradients are averaged over DP
    only; with mp=1 the DP group is the world and DDP gets the default group, as ``DDPStrategy`` gives it.
    ``conditional``: the traced step left parameters out or branched on the data, so DDP must find each step the
    parameters no rank used (their gradients stay None, as on one process). ``configure_ddp`` builds it with the
    options it is given (the strategy's ``configure_ddp`` over them)."""
    # This run's options on a copy of the user's (never mutated): a later fit at another layout (or with a plan that
    # does not branch) must not inherit this run's process group or find_unused_parameters.
    run = {**ddp_kwargs, "process_group": grid.dp_group if grid.mp > 1 else None}
    if conditional:
        run["find_unused_parameters"] = True
    configure_ddp(run)


def step_local_shards(optimizers: list[Any], params: DTensorParams) -> None:
    """Step 6b (DTensor parameters): each optimizer steps the plain local ``Parameter`` of each DTensor parameter
    the user gave it (the same storage; its gradient is the DTensor's local gradient), so no DTensor dispatch runs
    per op of the step (measured on CPU: AdamW over DTensors 1.9x the time over plain tensors)."""
    for optimizer in optimizers:
        params.step_locals(compat.unwrap_optimizer(optimizer))


def shard_dp(module: nn.Module, optimizers: list[Any], scheduler_configs: list[Any], grid: Any, split: Split,
             zero: int, mixed_precision: Optional[Any] = None, pipeline: Optional[Pipeline] = None,
             reshard_after_forward: bool = True) -> tuple[list[Any], Optional[ZeroEngine]]:
    """Step 7 (zero >= 1, dp > 1): shard over DP and rebuild ``optimizers`` over the shards (the LR schedulers of
    ``scheduler_configs`` re-pointed), with ``mixed_precision`` (zero >= 2) and ``reshard_after_forward`` (zero=3).
    With a ``pipeline`` (its stages already cut) the engine keeps the stages apart and skips the blocks that stand
    in for other stages, and the pipeline gets its shards through
    :class:`~lightning_dpmp.integration.staged_zero.StagedShards`: the one place the two meet. Returns the
    optimizers to step and the engine (``None`` when there is nothing to shard)."""
    optimizers, engine = shard_optimizers(module, optimizers, scheduler_configs, zero, grid, split.split_params,
                                          split.partial_grads, split.applied_plan, mixed_precision,
                                          pipeline.keys if pipeline is not None else None,
                                          reshard_after_forward, stood_in if pipeline is not None else None)
    if engine is not None and pipeline is not None:
        pipeline.attach_shards(StagedShards(engine, pipeline.ranks, pipeline.local, grid.pp))
    return optimizers, engine


def install_step_hooks(plugin: Any, parallel: Parallelized, dp_group: Any, pp_group: Any = None) -> None:
    """Step 8: global-norm clipping over the shards (``dp_group`` too when the engine shards gradients over DP;
    ``pp_group`` with a pipeline: each parameter counted on the rank that owns it) and ``found_inf`` agreed over
    the world, on the precision plugin's instance."""
    counted = parallel.pipeline.counted() if parallel.pipeline is not None else None
    hooks.install(plugin, set(parallel.split_params), parallel.mp_group, dp_group, pp_group, counted,
                  own_work=parallel.modes_aside)
    parallel._hooked.append(plugin)


# ---------------------------------------------------------------------------------------------- the pipeline
def parallelize(trainer: Any, module: nn.Module, model: nn.Module, grid: Any, device: torch.device, plugin: Any,
                config: ParallelConfig, meta: bool, *, mesh: Callable[[], Any], ddp_kwargs: Mapping[str, Any],
                configure_ddp: Callable[[dict[str, Any]], None],
                setup_optimizers: Callable[[], tuple[list[Any], list[Any]]], layout_report: str = "",
                first: Optional[FirstStep] = None) -> Parallelized:
    """Run steps 1-8 on the LightningModule ``module`` (``model``: what Lightning wraps around it) over ``grid``
    (collective over the world: every rank calls it), on ``device`` under the precision ``plugin``.

    ``meta``: the module's parameters are on the meta device (each rank allocates only its shards). ``mesh()``: the
    grid's ``DeviceMesh`` (built on first use). When fitting, ``configure_ddp`` wraps ``model`` in DDP (zero=0) with
    this run's copy of ``ddp_kwargs``, ``setup_optimizers()`` runs the user's ``configure_optimizers`` and returns
    the optimizers and LR scheduler configs, and the result's ``optimizers`` are the ones to step (over the ZeRO
    shards at zero >= 1), as Lightning's setup would leave them. ``first``: the setup's record of the first step
    (:class:`~lightning_dpmp.integration.firststep.FirstStep`), when the layout choice made it already; each
    step below reads it, so the step runs once for them all.
    """
    fitting = trainer.state.fn == TrainerFn.FITTING
    topology = grid.topology
    if first is None:
        first = FirstStep(trainer, module, plugin, device, grid.rank, meta, stack_wanted=grid.pp > 1)
    # with pp > 1 every run is staged, evaluation too: planned from the first batch of the run's own step
    profile, free = plan_pipeline(first, grid) if grid.pp > 1 else (None, frozenset())
    recompute, recompute_line = plan_recompute(first, grid, config) if fitting else (None, "")
    split = plan_and_split(first, grid, config, mesh, free, layout_report)
    route_metrics(model, grid.dp_group)
    overlap_grad_allreduce(model, config.async_grad_allreduce, device.type)
    compiled = compile_model(module, config.compile)
    engine = pipeline = None
    optimizers: Optional[list[Any]] = None
    if profile is not None:  # the stages, over the split model's plain local parameters
        with split.params.local() if split.params is not None else nullcontext():
            pipeline = Pipeline(module, profile, grid, device, first.batch,
                                sequence_parallel=split.applied_plan.plan.sequence is not None)
        if split.params is not None:
            # the stages compute on, send, free and sync the local Parameters themselves; a gradient user code's
            # read of a DTensor parameter gives (an L2 term on the last stage) joins its local one
            split.params.compute_on_locals(_add_grad)
        split.applied_plan.text += "\n" + pipeline.text()
        rank_zero_info(pipeline.text())
    if fitting and config.activation_checkpointing is not None:
        recompute_line = recompute_blocks(module, config.activation_checkpointing, recompute, split,
                                          pipeline) or recompute_line
        split.applied_plan.text += "\n" + recompute_line
        rank_zero_info(recompute_line)
    if fitting:
        if pipeline is None and grid.dp > 1 and topology.zero == 0 and split.params is None:
            wrap_dp(configure_ddp, ddp_kwargs, grid, bool(split.applied_plan.conditional))
        optimizers, scheduler_configs = setup_optimizers()
        if split.params is not None:  # they step the local shards: plain tensors, no DTensor dispatch per op
            step_local_shards(optimizers, split.params)
        if topology.zero_enabled:
            # the engine shards the plain local parameters; the DTensor forms are then rebuilt on its buffers
            with split.params.local() if split.params is not None else nullcontext():
                optimizers, engine = shard_dp(module, optimizers, scheduler_configs, grid, split, topology.zero,
                                              config.mixed_precision, pipeline, config.reshard_after_forward)
            if split.params is not None and engine is not None:
                split.params.compute_on_locals(engine.accumulate)
    # the engine's flat shards of MP-split parameters are MP shards too
    split_params = frozenset(split.split_params) | (
        frozenset(id(p) for p in engine.shard_params("split")) if engine is not None else frozenset())
    parallel = Parallelized(split.applied_plan, split.rng, split_params, split.partial_grads, grid.mp_group,
                            engine, compiled, pipeline, split.params, split.bridge, optimizers=optimizers)
    parallel.partial_in_backward = bool(getattr(module, "automatic_optimization", False))
    if split.params is not None and engine is None and pipeline is None and fitting:
        # zero=0 without stages: the forwards compute on the plain local Parameters too (no DTensor op in the
        # forward or the backward: each parameter's to_local view and its backward, which wrapped every gradient in
        # a DTensor and accumulated it through DTensor dispatch, were zero=0's CPU cost over plain parameters); the
        # DTensor forms' gradients wrap the local ones after the backward (finish_backward)
        split.params.compute_on_locals(_add_grad)
    if split.params is not None and grid.dp > 1 and engine is None and pipeline is None:
        # DP averaged by the strategy (DDP's buckets); a pipeline averages its own
        parallel.dp_group = grid.dp_group
        parallel.dp_bucket_bytes = int((ddp_kwargs.get("bucket_cap_mb") or 25) * 2**20)
    parallel.watch_freed_reads(module)
    if grid.mp > 1 or engine is not None or pipeline is not None:
        install_step_hooks(plugin, parallel, grid.dp_group if engine is not None else None,
                           grid.pp_group if pipeline is not None else None)
    return parallel


def unparallelize(module: Optional[nn.Module], optimizers: list[Any], scheduler_configs: list[Any], grid: Any,
                  parallel: Parallelized, consolidate: Union[bool, str], failed: bool) -> list[Any]:
    """Undo :func:`parallelize` in reverse (collective unless ``failed``: after an error no rank communicates, since
    a peer may be dead): gather the layers back per ``consolidate`` (``"rank0"``: global rank 0 alone ends with the
    plain model; ``True``: every rank; ``False``: stays split), under ZeRO straight from the engine's shards
    (:func:`~lightning_dpmp.integration.teardown.consolidate_engine`; with ``False`` the engine is released: whole
    MP-local parameters, plain optimizers with their gathered state), uncompile, remove the step hooks. Returns the
    optimizers the strategy holds from then on (``optimizers``, or the plain ones that replace the engine's)."""
    if parallel.grads is not None:
        parallel.grads.clear()
        parallel.grads = None
    if parallel.staged is not None:
        parallel.staged.clear()
        parallel.staged = None
    if parallel.params is not None:  # the plain shards for good: what the rest of the teardown gathers
        parallel.params.release()
        parallel.params = parallel.bridge = None  # a save after fit reads the module as teardown leaves it
    if parallel.pipeline is not None and not failed:
        parallel.pipeline.sync(optimizers)  # every rank the trained model before gathering it
    if parallel.pipeline is not None:
        parallel.pipeline.active = False  # (a save after fit writes the module teardown leaves, not the stages)
    if parallel.engine is not None and not failed:
        if consolidate and module is not None:  # each bucket straight into the dense model: nobody holds it whole
            optimizers = consolidate_engine(module, grid, parallel.engine, optimizers, scheduler_configs,
                                            everywhere=consolidate is True)
        else:  # the module stays split: every rank its MP-local model and optimizer state, as at zero=0
            optimizers = release_engine(parallel.engine, optimizers, scheduler_configs)
    parallel.engine = None
    if consolidate and not failed and module is not None and shard_dims(module):
        unsplit_model(module, optimizers, grid, everywhere=consolidate is True)
    elif consolidate == "rank0" and not failed and module is not None:
        keep_on_rank0(module, optimizers, grid.rank)  # nothing split (mp=1): the other ranks let theirs go as well
    if module is not None:
        uncheckpoint_blocks(module)
    if parallel.compiled and module is not None:
        uncompile_blocks(module)
    while parallel._hooked:
        hooks.remove(parallel._hooked.pop())
    return optimizers
