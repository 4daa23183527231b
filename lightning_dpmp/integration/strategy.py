"""DPMPStrategy: Lightning's lifecycle for data x tensor-model parallel training; the work is delegated.

* The grid is the base class's (:class:`~lightning_dpmp.integration.grid_strategy.GridStrategy`): ``set_world_ranks``
  resolves (dp, mp) once, ``setup_environment`` builds the :class:`~lightning_dpmp.parallel.grid.Grid`, the sampler
  shards over DP only and ``reduce`` averages over the DP group.
* ``setup`` follows ``DDPStrategy.setup``'s order and calls the parallelize pipeline once
  (:func:`~lightning_dpmp.integration.parallelize.parallelize`: plan and split, metrics over DP, overlap, compile,
  the DP wrap or ZeRO, the optimizers, the clipping hooks, in that order); the step-time methods
  (``optimizer_step``, ``block_backward_sync``, the ``*_step`` methods) ask its
  :class:`~lightning_dpmp.integration.parallelize.Parallelized` result what to do.
* Checkpoints are the job of ``self.checkpointer``
  (:class:`~lightning_dpmp.integration.strategy_checkpoint.StrategyCheckpointer`).
* ``teardown`` undoes the pipeline, so the module you passed to ``fit`` is dense again afterwards (on rank 0 by
  default).
"""
from __future__ import annotations

import logging
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.weights import defer_loading, note_deferring_strategy
from lightning_dpmp.integration import validate
from lightning_dpmp.integration.autolayout import Request, check_memory, choose_layout
from lightning_dpmp.integration.averaging import split_averaging_callbacks
from lightning_dpmp.integration.data_path import trainer_of
from lightning_dpmp.integration.firststep import FirstStep
from lightning_dpmp.integration.grid_strategy import GridStrategy, check_mp_batch
from lightning_dpmp.integration.guard import ConsistencyGuard
from lightning_dpmp.integration.parallelize import ParallelConfig, Parallelized, parallelize, unparallelize
from lightning_dpmp.integration.pipeline import Pipeline
from lightning_dpmp.integration.split import agree_on_meta, meta_safe_teardown
from lightning_dpmp.integration.strategy_checkpoint import StrategyCheckpointer
from lightning_dpmp.integration.teardown import gather_left_split
from lightning_dpmp.integration.zero import memory_line, memory_report
from lightning_dpmp.parallel.bridge import plain_value
from lightning_dpmp.parallel.grid import DEFAULT_TIMEOUT
from lightning_dpmp.parallel.loss import VocabShardedLogits
from lightning_dpmp.parallel.rng import RNGTracker
from lightning_dpmp.parallel.topology import Topology, check_parallel_size, check_zero
from lightning_dpmp.parallel.zero_engine import ZeroEngine
from lightning_dpmp.planner.materialize import empty_parameters
from lightning_dpmp.planner.plan_types import PlanResult
from lightning_dpmp.planner.user_plan import PlanOverrides

log = logging.getLogger(__name__)

__all__ = ["DPMPStrategy"]


class DPMPStrategy(GridStrategy):
    """Data parallel (``dp`` replicas) x tensor model parallel (``mp``-way split Linears) training, no plan needed.

    Args:
        dp: data-parallel size, or ``"auto"`` (world // mp when ``mp`` is given).
        mp: tensor-parallel size, or ``"auto"`` (world // dp when ``dp`` is given). Both ``"auto"`` (the default),
            or ``pp``/``zero`` ``"auto"``: the world size is fixed and the layout is chosen at setup, after tracing
            and profiling the model, by measuring the links and ranking every ``(dp, pp, mp, zero)`` the given sizes
            allow with the layout estimator (:mod:`lightning_dpmp.integration.autolayout`; the table is in the plan
            printout). ``dp * pp * mp`` must equal ``devices * num_nodes``. A layout given in full is refused at
            setup, before any step, when the estimator predicts it will not fit the device memory
            (``DPMP_MEMORY_CHECK=0`` turns that off, ``DPMP_DEVICE_MEMORY_GIB`` sets the memory per rank).
        plan_overrides: optional ``{glob: style}`` overrides on module names, styles ``"column"``, ``"row"``,
            ``"column_gather"``, ``"vocab"``, ``"replicate"``, ``"heads"``, ``"experts"`` (see
            :mod:`lightning_dpmp.planner.styles`); the first matching glob wins. The plan applied is
            :attr:`applied_plan`.
        sequence_parallel: keep norms/dropout/residual regions split along the sequence between the parallel
            layers (:mod:`lightning_dpmp.planner.sequence`); refused, with the reason, where the model does not
            allow it.
        verify_plan: run the first batch through the dense and the parallel model and compare loss and gradients
            before training; layers that disagree fall back to safer styles (a ``PlanFallbackWarning``), and a step
            no plan can match (rank-dependent, or not reproducible) raises ``PlanVerificationError`` on every rank.
        consolidate_on_teardown: at the end of ``fit``, ``validate``, ``test`` or ``predict``, gather the layers
            (and optimizer state) back to dense. ``"rank0"`` (default): global rank 0 holds the plain model, the
            other ranks its shapes on the meta device (no rank but 0 ever holds a full copy; a later
            ``fit``/``test`` on the same module takes the weights from rank 0); ``True``: every rank holds it;
            ``False``: the module stays split.
        save_distributed_checkpoint: write checkpoints as a folder of shards, in parallel
            (:mod:`lightning_dpmp.checkpoint.sharded`), instead of one consolidated file; both load into any layout.
        timeout: process-group timeout, a ``timedelta`` as ``DDPStrategy`` takes it (a collective that waits longer
            fails instead of hanging); ``None`` (default): 10 minutes, not torch's 30.
        zero: 1 shards the optimizer state over the DP group (ZeRO-1, :mod:`lightning_dpmp.integration.zero`): 1/dp
            of it per rank, same training trajectory. 1 and 2 share one schedule, which shards the gradients too
            (reduce-scattered over DP in buckets during the backward, parameters all-gathered after the step; no
            DDP wrapper: as fast as zero=0), 3 the parameters as well (gathered per block for its forward and again
            for its backward, freed after; :mod:`lightning_dpmp.parallel.zero_engine`). ZeRO needs an element-wise
            optimizer (SGD, Adam, AdamW, ...; not Adafactor, Shampoo, LAMB); every level writes both checkpoint
            formats. At zero=3 user code reading a parameter between its uses reads its values (the op gathers
            it; :mod:`lightning_dpmp.parallel.freed_reads`). ``"auto"``: chosen at setup, the lowest level predicted
            to fit unless a higher one is predicted at least 5% faster.
        reshard_after_forward: zero=3's trade, named after FSDP2's option: ``True`` (default) frees each block after
            its forward and gathers it again for its backward; ``False`` keeps it gathered from its forward to its
            backward (one all-gather per block and micro-batch instead of two, the block's parameters whole
            meanwhile). Under a pipeline (and with gradient accumulation) ``False`` keeps this rank's stage gathered
            from its first use to the optimizer step's backward, accumulates its gradients whole and
            reduce-scatters them once per step, as zero=1/2 do: ``U + 1`` all-gathers and one reduce-scatter per
            step instead of ``2·M·U + 1`` and ``M·(U + 1)``, for the stage's parameters and gradients held whole.
            ``False`` with zero < 3 is refused (those levels never free the parameters), and with
            ``zero="auto"``.
        check_consistency_every_n_steps: every N optimizer steps, verify with checksums and one small all-gather
            that DP replicas and MP-replicated parameters are identical and that each MP group got one batch
            (:mod:`lightning_dpmp.integration.guard`); raises naming the first difference. 0 (default) turns it off.
        mp_batch: how the ranks of an MP group come to train on one batch whatever the data pipeline does
            (:mod:`lightning_dpmp.integration.mp_batch`). ``"broadcast"`` (default): the group's first rank sends
            its batch to the others every step (one 2-int64 all-reduce and one broadcast of the batch's bytes over
            the MP group). ``"check"``: each rank keeps its own batch and one all-reduce of 8 int64 per step proves
            they are equal, raising :class:`~lightning_dpmp.integration.mp_batch.BatchMismatchError` on every rank
            when not. Either way loader workers are seeded by DP rank, not global rank.
        compile: after the split, ``torch.compile`` each repeated block in place (or the whole model when it has
            none; :mod:`lightning_dpmp.parallel.compiled`): no graph break inside a block, same parameter names.
        activation_checkpointing: recompute the repeated blocks' activations in the backward instead of keeping
            them (:mod:`lightning_dpmp.integration.activations`), as Lightning's FSDP strategy does through a policy:
            ``None`` (default) off; ``"blocks"`` every repeated block (children of ``nn.ModuleList``/
            ``nn.Sequential`` that own parameters; each recompute re-issues the block's forward MP collectives);
            ``"auto"`` the fewest blocks per stage whose peak the layout estimator predicts to fit the device's
            memory (CUDA; nothing on a CPU, which has no such limit). Applied after the split, with dropout masks
            reproduced; composes with ``mp``, ``zero`` (3: no extra gather), ``pp`` and ``sequence_parallel``, not
            yet with ``compile=True``. The setup printout says what was chosen.
        async_grad_allreduce: overlap a column layer's input-gradient all-reduce with its weight gradient
            (:mod:`lightning_dpmp.parallel.overlap`); ``None`` (default): on for CUDA, off on CPU/gloo.
        mixed_precision: with zero=2/3 (dp > 1), torch's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)``, as FSDP2 takes it: parameters gathered and computed with in
            ``param_dtype``, gradients reduced in ``reduce_dtype``, the optimizer stepping (and checkpoints holding)
            the parameters' own dtype.
        pp: pipeline stages (:mod:`lightning_dpmp.integration.pipeline`): the repeated blocks are cut into ``pp``
            stages balanced by FLOPs, found from the traced step (the embeddings join the first, the head and loss
            the last), and run by torch's schedules; world = ``dp * pp * mp``, MP innermost, then PP, then DP. Your
            ``training_step`` stays as written: it runs once per micro-batch and stage. Combines with MP, DP,
            clipping, accumulation, compile, ``zero`` (over each stage's DP group) and ``mixed_precision``,
            ``sequence_parallel``, both checkpoint formats, meta-device init and evaluation. ``"auto"``: chosen at
            setup with the other sizes (at most the repeated blocks; the settings below apply to the pp chosen).
        pp_microbatches: micro-batches per step (default: the number of stages); must divide the per-rank batch.
        pp_schedule: ``"1f1b"`` (default), ``"gpipe"``, or ``"interleaved"`` (``pp_stages_per_rank`` stages per
            rank, looping).
        pp_stages_per_rank: stages per rank for ``"interleaved"`` (>= 2).
        process_group_backend: ``"gloo"``/``"nccl"``; by default from the device.
        start_method: ``"popen"`` (default, Lightning's script launcher), ``"spawn"``, ``"fork"``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: Lightning's own, as
            ``DDPStrategy`` takes them (the ``Trainer`` fills them in).
        **ddp_kwargs: passed to ``DistributedDataParallel`` where it wraps the model (mp=1, zero=0, no pipeline;
            e.g. ``static_graph=True``); with mp > 1 the parameters are DTensors and the strategy averages the DP
            gradients itself, honouring only ``bucket_cap_mb`` and ``find_unused_parameters``.

    Example:
        >>> import lightning as L
        >>> from lightning_dpmp import DPMPStrategy
        >>> trainer = L.Trainer(accelerator="cpu", devices=4, strategy=DPMPStrategy(dp=2, mp=2))  # doctest: +SKIP
        >>> trainer.fit(model, dataloader)                                                       # doctest: +SKIP
        >>> trainer.save_checkpoint("last.ckpt")   # consolidated: loads into the plain model    # doctest: +SKIP
    """

    def __init__(
        self,
        dp: Union[int, Literal["auto"]] = "auto",
        mp: Union[int, Literal["auto"]] = "auto",
        plan_overrides: Optional[Mapping[str, str]] = None,
        sequence_parallel: bool = False,
        verify_plan: bool = True,
        consolidate_on_teardown: Union[bool, Literal["rank0"]] = "rank0",
        save_distributed_checkpoint: bool = False,
        timeout: Optional[timedelta] = None,
        check_consistency_every_n_steps: int = 0,
        mp_batch: Literal["broadcast", "check"] = "broadcast",
        zero: Union[int, Literal["auto"]] = 0,
        reshard_after_forward: bool = True,
        compile: bool = False,
        activation_checkpointing: Optional[Literal["blocks", "auto"]] = None,
        async_grad_allreduce: Optional[bool] = None,
        mixed_precision: Optional[Any] = None,
        pp: Union[int, Literal["auto"]] = 1,
        pp_microbatches: Optional[int] = None,
        pp_schedule: Literal["1f1b", "gpipe", "interleaved"] = "1f1b",
        pp_stages_per_rank: int = 1,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        **ddp_kwargs: Any,
    ) -> None:
        check_parallel_size("dp", dp, allow_auto=True)  # dp/mp refused first, before any other argument
        check_parallel_size("mp", mp, allow_auto=True)
        if pp != "auto":  # (the message of a bad pp stays the integer one: "auto" is the rarer wish)
            check_parallel_size("pp", pp)
        check_zero(zero, allow_auto=True)
        # pp, zero and the pipeline's settings; dp and mp are resolved with them once the world size is known.
        # "auto" ones are chosen at setup: their placeholders (pp=1, zero=0) validate the other settings' types
        micro = -1 if pp_microbatches is None else pp_microbatches  # -1: one per stage
        pp_auto, zero_auto = pp == "auto", zero == "auto"
        pipeline: dict[str, Any] = dict(microbatches=micro, schedule=pp_schedule, stages_per_rank=pp_stages_per_rank)
        self.init_grid(dp, mp, Topology(pp=1 if pp_auto else int(pp), zero=0 if zero_auto else int(zero),
                                        **pipeline), pp_auto=pp_auto, zero_auto=zero_auto, pipeline=pipeline)
        if zero_auto and mixed_precision is not None:
            raise ValueError("mixed_precision= is applied by the ZeRO-2/3 engine, which zero='auto' may not choose:"
                             " give zero=2 or zero=3 with it.")
        overrides = validate.check_init_args(plan_overrides, sequence_parallel, verify_plan, consolidate_on_teardown,
                                             save_distributed_checkpoint, process_group_backend, start_method,
                                             timeout)
        validate.check_speed_flags(compile, async_grad_allreduce)
        validate.check_recompute(activation_checkpointing, compile)
        self._guard = ConsistencyGuard(check_consistency_every_n_steps)
        check_mp_batch(mp_batch)
        self._mp_batch = mp_batch
        ddp_kwargs = validate.ddp_kwargs_from_user(ddp_kwargs)  # LightningCLI passes DDP's defaults, process_group=None
        if zero_auto and ddp_kwargs:
            raise ValueError(f"zero='auto' may choose ZeRO, which shards gradients without DistributedDataParallel,"
                             f" so the DDP options {sorted(ddp_kwargs)} would not apply: give zero=0 with them.")
        validate.check_zero_without_ddp(self._settings.zero, ddp_kwargs)
        if self._settings.zero == 0 and self._settings.pp == 1 and not pp_auto:
            validate.check_ddp_kwargs_with_dtensors(ddp_kwargs, mp)
        if zero_auto and reshard_after_forward is not True:
            raise ValueError(f"reshard_after_forward={reshard_after_forward!r} is zero=3's option; zero='auto' may "
                             f"choose another level: give zero=3 with it.")
        if not zero_auto:
            validate.check_mixed_precision(mixed_precision, self._settings.zero, dp)
            validate.check_reshard_after_forward(reshard_after_forward, self._settings.zero)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        # parsed and checked once, here; what setup's parallelize pipeline follows
        self._config = ParallelConfig(overrides, bool(verify_plan), bool(sequence_parallel), compile,
                                      async_grad_allreduce, mixed_precision, reshard_after_forward,
                                      activation_checkpointing)
        self._consolidate_on_teardown = consolidate_on_teardown
        self.checkpointer = StrategyCheckpointer(self, distributed=save_distributed_checkpoint)
        self._parallel: Optional[Parallelized] = None  # set by setup's parallelize
        self._failed = False
        note_deferring_strategy(self)  # from_pretrained called from now on leaves its weights to the split

    @property
    def rng_tracker(self) -> Optional[RNGTracker]:
        """The per-MP-rank dropout streams of the split regions (``None`` with mp=1 or before setup)."""
        return self._parallel.rng if self._parallel is not None else None

    @property
    def plan_overrides(self) -> Optional[dict[str, str]]:
        """The ``{glob: style}`` overrides given to the constructor (``None`` when the planner decides alone)."""
        return self._config.plan_overrides.as_dict() or None

    @property
    def parsed_plan_overrides(self) -> PlanOverrides:
        """The overrides as parsed at construction (empty when none were given): what every plan check takes."""
        return self._config.plan_overrides

    @property
    def parallel_config(self) -> ParallelConfig:
        """How the model is parallelized, as the constructor decided it."""
        return self._config

    @property
    def parallelized(self) -> Optional[Parallelized]:
        """What the last setup's :func:`~lightning_dpmp.integration.parallelize.parallelize` made of the module
        (plan, RNG tracker, MP-shard and partial parameters, ZeRO engine); ``None`` before setup."""
        return self._parallel

    @property
    def zero_engine(self) -> Optional[ZeroEngine]:
        """The engine that shards over DP while fitting with ``zero >= 1`` (``None`` otherwise, and after fit)."""
        return self._parallel.engine if self._parallel is not None else None

    @property
    def pipeline(self) -> Optional[Pipeline]:
        """The pipeline stages and schedule while fitting with ``pp > 1`` (``None`` otherwise)."""
        return self._parallel.pipeline if self._parallel is not None else None

    def sync_stages(self, with_state: bool = True) -> None:
        """With a pipeline: every rank gets the parameters (and with ``with_state`` the optimizer state) trained on
        the other stages (collective; nothing to do when no step ran since the last sync). Checkpoints under ZeRO,
        the consistency guard and teardown call it (evaluation and other checkpoints run stage by stage); call it
        yourself before reading another stage's parameters while training."""
        if self.pipeline is not None and not self._failed:
            self.pipeline.sync(self.optimizers, with_state)

    @property
    def applied_plan(self) -> Optional[PlanResult]:
        """The plan applied at the last setup (with its printout in ``.text``), or ``None`` before setup."""
        return self._parallel.plan if self._parallel is not None else None

    # ------------------------------------------------------------------ training-time checks
    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and self.is_global_zero:
            use_sampler = compat.uses_distributed_sampler(trainer)
            validate.warn_if_data_not_sharded(trainer.train_dataloader, use_sampler, self.dp, self.mp)
            validate.warn_if_data_smaller_than_dp(trainer.train_dataloader, use_sampler, self.dp)
        if self.is_global_zero:
            rank_zero_info(memory_line(self.memory_report(), self.zero))
        super().on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Before the step: parameters as the previous step left them, and the batch this step will use.
        if self._guard.every_n_steps and self.lightning_module is not None:
            step = self.lightning_module.trainer.global_step
            # zero=3 gathers the parameters only for a check
            with self.parameters_whole() if self._guard.due(step, self._grid) else nullcontext(), self._local():
                self._guard.maybe_check(step, self.lightning_module, batch, self._grid, self.root_device)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_train_end(self) -> None:
        if self._guard.every_n_steps and self.lightning_module is not None and self._grid is not None:
            with self.parameters_whole(), self._local():
                end = "the end of training"
                self._guard.check(self.lightning_module, None, self._grid, self.root_device, where=end)
        super().on_train_end()

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Lightning's setup, in ``DDPStrategy.setup``'s order, with the split in the middle: the accelerator, the
        layer sync, the precision conversion and the dense move, then :func:`parallelize` (plan, split, DP wrap or
        ZeRO, optimizers, hooks: :mod:`lightning_dpmp.integration.parallelize`), then the precision plugin."""
        assert self.accelerator is not None and self.model is not None and self.lightning_module is not None
        self._failed, self._parallel = False, None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not self.layout_pending:  # mp="auto" restricts itself to mp=1 under sync_batchnorm (_choose_layout)
            validate.check_sync_batchnorm(compat.layer_sync(self), self.mp)
            validate.check_averaging_callbacks(getattr(trainer, "callbacks", []), self.mp, self.zero,
                                               trainer.state.fn, self.checkpointer.distributed)
        self.accelerator.setup(trainer)
        layer_sync = compat.layer_sync(self)
        if fitting and layer_sync is not None:
            self.model = layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        # a previous run's teardown left it split (consolidate_on_teardown=False): to rank 0
        gather_left_split(self.lightning_module, self.optimizers, self.global_rank)
        # rank 0 alone holding the model (a previous run's teardown): every rank takes it from rank 0
        meta = agree_on_meta(self.lightning_module, self.global_rank, self.root_device)
        if not meta:
            self.model_to_device()
        # the first step, recorded once for everything below that plans from it (the batch, the dense run)
        first = FirstStep(trainer, self.lightning_module, self.precision_plugin, self.root_device, self.global_rank,
                          meta, stack_wanted=self._pp_auto or self._settings.pp > 1)
        if self.layout_pending:  # "auto" sizes: trace, measure, predict, then build the groups
            self._choose_layout(first)
        elif fitting and not self.layout_report and self.world_size > 1:  # a given layout: refused if it won't fit
            check_memory(first, self.topology, self.num_processes, self._config.sequence_parallel)
        validate.check_mixed_precision(self._config.mixed_precision, self.zero, self.dp)  # (dp chosen by now)
        # No module-state sync from rank 0 outside fitting (DDPStrategy's): the split broadcast rank 0's dense
        # weights before splitting, and a sync now would overwrite each rank's MP shards with rank 0's.
        self._parallel = parallelize(
            trainer, self.lightning_module, self.model, self.grid, self.root_device, self.precision_plugin,
            self._config, meta, mesh=lambda: self.device_mesh, ddp_kwargs=compat.ddp_kwargs(self),
            configure_ddp=self._configure_ddp_with, setup_optimizers=lambda: self._setup_optimizers(trainer),
            layout_report=self.layout_report, first=first)
        if self._parallel.optimizers is not None:  # fitting: over the split parameters (the ZeRO shards at zero >= 1)
            self.optimizers = self._parallel.optimizers
        if self.layout_report:
            self._parallel.plan.text += "\n" + self.layout_report
        if self._parallel.bridge is not None:  # user code from here to teardown reads the DTensor parameters
            self._parallel.bridge.__enter__()
        if self._parallel.reader is not None:  # ... or reads freed ZeRO-3 parameters by value
            self._parallel.reader.__enter__()
        self.setup_precision_plugin()
        if fitting:
            compat.optimizers_to_device(self.optimizers, self.root_device)
            compat.enable_model_averaging(self)  # DDPStrategy's post-local-SGD, when ddp_comm_state asks for it
            # Their copies were made in the callbacks' setup, before the split: they now average this rank's shards.
            split_averaging_callbacks(getattr(trainer, "callbacks", []), self.lightning_module, self.grid,
                                      self.checkpointer.gathers())

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        self._check_ddp_kwargs()  # mp is known now unless it is chosen at setup

    def _check_ddp_kwargs(self) -> None:
        if not self.layout_pending and self._topology is not None and self.zero == 0 and self.pp == 1:
            validate.check_ddp_kwargs_with_dtensors(compat.ddp_kwargs(self), self.mp)

    def _configure_ddp_with(self, ddp_kwargs: dict[str, Any]) -> None:
        """``configure_ddp`` (DDP over ``self.model``) with ``ddp_kwargs``, a copy of the user's with this run's
        options: the user's dict is put back after, never mutated, so a later run does not inherit them."""
        user = compat.ddp_kwargs(self)
        compat.set_ddp_kwargs(self, ddp_kwargs)
        try:
            self.configure_ddp()
        finally:
            compat.set_ddp_kwargs(self, user)

    def _setup_optimizers(self, trainer: "pl.Trainer") -> tuple[list[Optimizer], list[Any]]:
        """The user's ``configure_optimizers`` through the public ``setup_optimizers`` (so the LR finder's wrapper
        of it still applies): the optimizers and LR scheduler configs it made."""
        self.setup_optimizers(trainer)
        return self.optimizers, self.lr_scheduler_configs

    def _choose_layout(self, first: FirstStep) -> None:
        trainer = first.trainer
        validate.check_plan_at_setup(self.lightning_module, None, 1, self.global_rank)  # e.g. compiled: no trace
        s, pipeline = self._settings, self._pipeline_args
        request = Request(dp=self._dp_arg, mp=self._mp_arg, pp="auto" if self._pp_auto else s.pp,
                          zero="auto" if self._zero_auto else s.zero, microbatches=pipeline.get("microbatches", -1),
                          schedule=pipeline.get("schedule", "1f1b"), stages_per_rank=pipeline.get("stages_per_rank", 1),
                          sequence_parallel=self._config.sequence_parallel)
        choice = choose_layout(first, self.num_processes, self.num_nodes, self._config.plan_overrides,
                               compat.layer_sync(self) is not None, request=request)
        lay = choice.layout
        self.set_layout(lay.dp, lay.mp, choice.text, keep=choice.measured, pp=lay.pp, zero=lay.zero)
        self._check_ddp_kwargs()
        validate.check_averaging_callbacks(getattr(trainer, "callbacks", []), self.mp, self.zero, trainer.state.fn,
                                           self.checkpointer.distributed)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Optional[Any] = None, **kwargs: Any) -> Any:
        # The precision plugin runs `closure` (backward) inside optimizer.step, then clips: partial gradients are
        # summed over MP between the two, so the sum runs at the end of the closure.
        parallel = self._parallel
        if parallel is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        stepped = self.precision_plugin.main_params(optimizer)
        with parallel.optimizer_update(optimizer):
            out = super().optimizer_step(optimizer, parallel.step_closure(closure, stepped), model, **kwargs)
        parallel.after_step()
        return out

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        no_sync = self._parallel.no_sync() if self._parallel is not None else None
        with no_sync if no_sync is not None else super().block_backward_sync():  # ZeRO keeps gradients local
            yield

    def parameters_whole(self) -> Any:
        """A context in which the module's parameters hold their values (zero=3 gathers them over DP, then frees)."""
        return self._parallel.whole() if self._parallel is not None else nullcontext()

    def _local(self) -> Any:
        """A context in which the module's parameters are the plain local shards (DTensor parameters aside): what
        checkpoints, the guard and memory reports read."""
        return self._parallel.local() if self._parallel is not None else nullcontext()

    def _leave_bridge(self) -> None:
        if self._parallel is None or self._parallel.bridge is None:
            return
        self._parallel.bridge.leave()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now: ``parameters``, ``gradients``, ``optimizer_state``, ``buffers``, counted from
        the tensors' storages (parameters freed by zero=3 count 0; its DP shards count)."""
        with self._local():
            return memory_report(self.lightning_module, self.optimizers, self.zero_engine)

    def _in_step(self, training: bool = False) -> Any:
        return self._parallel.enter_step(training) if self._parallel is not None else nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self.pipeline is not None:  # other stages' parameters freed before zero=3 gathers this step's own
            self.pipeline.stage(self.optimizers)
        with self._in_step(training=True):
            pipeline = self.pipeline
            if pipeline is None:  # a loss built from DTensor parameters (an L2 term) becomes the plain loss
                return apply_to_collection(super().training_step(*args, **kwargs), DTensor, plain_value)
            assert self.lightning_module is not None and self._parallel is not None
            trainer = self.lightning_module.trainer
            self._parallel.start_schedule()
            return pipeline.training_step(self.lightning_module, args, kwargs, trainer.accumulate_grad_batches,
                                          self.optimizers, self.precision_plugin.train_step_context)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        parallel = self._parallel
        pipeline = self.pipeline
        if pipeline is None and parallel is not None and (parallel.params is not None or parallel.grads is not None):
            # Lightning's order, with the DP average of the gradients between the backward and on_after_backward
            assert self.lightning_module is not None
            parallel.start_backward()
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
            self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
            parallel.finish_backward()
            closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
            self.post_backward(closure_loss)
            return closure_loss
        if pipeline is None:
            try:
                return super().backward(closure_loss, optimizer, *args, **kwargs)
            except RuntimeError as exc:
                if "ready only once" not in str(exc):
                    raise
                # DDP's own refusal, whose advice (_set_static_graph) a Lightning user cannot follow as written
                raise RuntimeError(
                    f"DistributedDataParallel (dp={self.grid.dp}, mp=1, zero=0) refused a parameter whose gradient "
                    "arrived in more than one backward pass of this step (for example the same weights under "
                    "several calls of torch.utils.checkpoint(..., use_reentrant=True)). Pass static_graph=True to "
                    "DPMPStrategy if the step's graph is the same every step, or use zero=1 (the ZeRO engine "
                    "reduces such a parameter once per pass), or checkpoint with use_reentrant=False."
                ) from exc
        # the schedule ran every micro-batch's backward inside training_step; its gradients land here, between
        # the hooks that surround a backward (and are reduced over PP and DP before on_after_backward)
        assert self.lightning_module is not None and parallel is not None
        parallel.start_backward()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        pipeline.apply_grads()
        parallel.finish_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    # With a pipeline, evaluation runs stage by stage (Pipeline.evaluation_step): each rank keeps its stages'
    # parameters only, the others' stay (or are) freed, as while training.
    @override
    def on_validation_start(self) -> None:
        self._stage_for_evaluation()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._stage_for_evaluation()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._stage_for_evaluation()
        super().on_predict_start()

    def _stage_for_evaluation(self) -> None:
        if self.pipeline is not None and not self._failed:
            self.pipeline.stage(self._fitting_optimizers())

    def _fitting_optimizers(self) -> list[Any]:
        """The optimizers whose state of the other stages' parameters a stage drops: while fitting (as its training
        steps do). A later validate/test/predict leaves the fit's optimizers alone (teardown may have given this rank
        their whole state)."""
        trainer = trainer_of(self.lightning_module)
        return list(self.optimizers) if trainer is not None and trainer.state.fn == TrainerFn.FITTING else []

    def _pipelined(self, hook: str, context: Any, finish: Any, args: Any, kwargs: Any) -> Any:
        assert self.pipeline is not None
        with self._in_step():
            return self.pipeline.evaluation_step(self.lightning_module, hook, args, kwargs, context, finish,
                                                 self._fitting_optimizers())

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self.pipeline is not None:
            return self._pipelined("validation_step", self.precision_plugin.val_step_context, _plain_output, args,
                                   kwargs)
        with self._in_step():
            return _plain_output(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self.pipeline is not None:
            return self._pipelined("test_step", self.precision_plugin.test_step_context, _plain_output, args, kwargs)
        with self._in_step():
            return _plain_output(super().test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            return self._pipelined("predict_step", self.precision_plugin.predict_step_context, _predictions, args,
                                   kwargs)
        with self._in_step():
            return _predictions(super().predict_step(*args, **kwargs))

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)``: parameters on the meta device (buffers computed for real); each
        rank materialises its shards after the split (:mod:`lightning_dpmp.planner.materialize`), so the dense
        model never exists in memory."""
        params_ctx = empty_parameters() if empty_init else nullcontext()  # buffers still computed, on the CPU
        with params_ctx, defer_loading(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model``: :func:`lightning_dpmp.from_pretrained` called in it leaves its weights to the split,
        so each rank reads only its slices (other layers are built as usual)."""
        with defer_loading(), super().model_sharded_context():
            yield

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # no collectives on the way out: a peer may be dead
        super().on_exception(exception)  # DDPStrategy's advice names strategy='ddp_find_unused_parameters_true'
        validate.advise_our_arguments(exception, self._dp_arg, self._mp_arg, self.zero)

    @override
    def teardown(self) -> None:
        if self._parallel is not None:
            self._parallel.leave_reader()  # (innermost: the bridge is on top only once it is gone)
            self._leave_bridge()
            self.optimizers = unparallelize(self.lightning_module, self.optimizers, self.lr_scheduler_configs,
                                            self.grid, self._parallel, self._consolidate_on_teardown, self._failed)
        optimizers = self.optimizers
        with meta_safe_teardown(self.lightning_module, optimizers) as movable:
            self.optimizers = movable  # what Lightning's teardown moves to the CPU
            try:
                super().teardown()
            finally:
                self.optimizers = optimizers

    # ------------------------------------------------------------------ checkpoints (delegated to self.checkpointer)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # loads go into the split model: each rank reads only its slices

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        with self._local():
            return self.checkpointer.optimizer_state(optimizer, super().optimizer_state)

    def save_pretrained(self, module: torch.nn.Module, out_dir: str, max_shard_size: Union[int, str] = "5GB"
                        ) -> dict[str, int]:
        """Write ``module`` (e.g. the transformers model in ``self.net``) as a Hugging Face folder: safetensors,
        sharded with ``model.safetensors.index.json`` above ``max_shard_size``, plus its config and generation
        config. Call it on every rank, during fit (split) or after it; rank 0 writes, holding one dense tensor at a
        time. ``transformers``' ``from_pretrained`` (or :func:`lightning_dpmp.from_pretrained`) loads the result.

        Example:
            >>> trainer.strategy.save_pretrained(model.net, "finetuned/")      # doctest: +SKIP
            {'files': 1, 'tensors': 21, 'bytes': 181504}
        """
        with self._local():
            return self.checkpointer.save_pretrained(module, out_dir, max_shard_size)

    # Each checkpoint hook hands the call to the StrategyCheckpointer, with Lightning's arguments and defaults.
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # (the first thing a checkpoint asks for) a pipeline's stages write their own parameters and optimizer
        # state; under ZeRO they are synced first, with the optimizer state
        if not self.checkpointer.stages_write():
            self.sync_stages()
        with self._local():
            return self.checkpointer.module_state_dict()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Union[str, Path], storage_options: Optional[Any] = None
    ) -> None:
        with self._local():
            self.checkpointer.save(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.pipeline is not None:
            self.pipeline.allocate()  # a sharded folder is read straight into every stage's shards, freed ones too
        with self._local():
            return self.checkpointer.load(checkpoint_path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        self.checkpointer.remove(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.pipeline is not None:
            self.pipeline.allocate()  # a meta model's other stages were freed: the load fills them
        with self._local():
            self.checkpointer.load_module_state(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        with self._local():
            self.checkpointer.load_optimizer_states(checkpoint)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"dpmp"`` (dp and mp chosen at setup, ``mp="auto"``); registering again is a no-op."""
        if "dpmp" not in strategy_registry:
            strategy_registry.register(
                "dpmp", cls, description="Data x tensor-model parallel (dp x mp chosen at setup by measurement)"
            )
        if "dpmp_spawn" not in strategy_registry:
            strategy_registry.register(
                "dpmp_spawn", cls, description="DPMPStrategy with the spawn launcher", start_method="spawn"
            )



def _plain_output(out: Any) -> Any:
    """What an evaluation step returns, DTensors as the plain values one process holds."""
    return apply_to_collection(out, DTensor, plain_value)


def _predictions(out: Any) -> Any:
    """Predictions as one process holds them: never DTensors, never MP shards of the logits."""
    return apply_to_collection(_plain_output(out), VocabShardedLogits, lambda t: t.full())
