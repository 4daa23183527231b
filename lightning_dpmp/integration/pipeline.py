"""The Lightning side of pipeline parallelism: stages planned at setup from the traced step, the step run by
torch's schedule, and what the rest of the strategy needs around it.

* **Setup** (:func:`probe_pipeline`, before the MP split; :class:`Pipeline` after it): the first batch's step is
  probed
  (:func:`~lightning_dpmp.planner.stages.probe_stack`), refused with the reason and the layer when it cannot be cut
  between its repeated blocks, and the blocks are cut into ``pp * stages_per_rank`` stages balanced by matmul FLOPs
  (:func:`~lightning_dpmp.planner.stages.balance`); the embeddings join the first stage, the head and loss the last.
* **A training step** (:meth:`Pipeline.training_step`): the batch is cut into micro-batches and the user's own
  ``training_step`` runs once per micro-batch and stage under the schedule
  (:class:`~lightning_dpmp.parallel.stage_runner.PipelineRunner`), forward and backward; ``self.log`` calls are
  recorded on the last stage, averaged over the micro-batches and replayed on every rank with the step's loss, so
  logging (``sync_dist`` included) behaves as without a pipeline. The step's gradients are set aside and the
  strategy's ``backward`` adds them (:meth:`Pipeline.apply_grads`): Lightning zeroes gradients between the two.
* **Gradients** (:meth:`Pipeline.reduce_grads`, in the optimizer step's closure): a parameter read on more than one
  stage (tied embeddings and head) gets its gradients summed over the PP group, then every gradient this rank
  computed is averaged over the DP group in flat buckets (no DDP: its reducer cannot follow a schedule's
  interleaved micro-batches). Clipping counts each parameter once, on the rank that owns it, and sums over PP.
* **ZeRO** (:meth:`Pipeline.attach_shards`): the stages are cut first and sharded over DP after, by whatever
  implements :class:`DPShards` (:class:`~lightning_dpmp.integration.staged_zero.StagedShards` over the ZeRO
  engine); this module knows nothing else of ZeRO. Each rank gathers and reduce-scatters its own stages' shards
  only (zero=1/2: once per step, after the schedule), the shards read on several stages are summed over PP, and a
  stage sync sends DP shards.
* **Evaluation** (:meth:`Pipeline.evaluation_step`): ``validation_step``, ``test_step`` and ``predict_step`` pass
  the micro-batches through the stages' blocks, forward only, each rank holding its stages' parameters only; the
  last stage runs the rest of the step once on the whole batch, and what it logs, adds to metrics and returns
  reaches every rank in one broadcast per batch, so logging, metrics, callbacks and prediction writers see what one
  process sees. Outside ``fit`` the stages are planned from
  the first batch of the run's own step.
* **Stage sync** (:meth:`Pipeline.sync`): every rank keeps the module's structure, but only its stages' parameters
  train there. Before teardown, the consistency guard or (under ZeRO) a checkpoint, each rank broadcasts the
  parameters (and optimizer state) it owns to its PP group, and then every rank holds the trained model. Without
  ZeRO a checkpoint is written from the stages (each tensor by its :attr:`Pipeline.owner`), nothing synced.

Example:
    >>> topology = Topology(dp=1, mp=2, pp=2, microbatches=4)
    >>> stage_ranges(profile, topology)                      # doctest: +SKIP
    [(0, 2), (2, 4)]
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.bridge import plain_value
from lightning_dpmp.parallel.comm import all_reduce_grads
from lightning_dpmp.parallel.compiled import repeated_blocks
from lightning_dpmp.parallel.embeddings import VocabParallelEmbedding
from lightning_dpmp.parallel.freed_reads import storage_freed
from lightning_dpmp.parallel.grid import Grid
from lightning_dpmp.parallel.stage_runner import PipelineRunner, bubble_fraction
from lightning_dpmp.parallel.topology import Topology
from lightning_dpmp.planner.stages import (
    BETWEEN,
    POST,
    PRE,
    StackProfile,
    StageCutError,
    balance,
    stand_in_shape,
)

__all__ = [
    "DPShards",
    "Pipeline",
    "batch_rows",
    "batch_shapes",
    "evaluation_microbatches",
    "check_batch_shapes",
    "check_pipeline_at_setup",
    "kept_everywhere",
    "probe_pipeline",
    "reading_ranks",
    "split_microbatches",
    "remote_parameters",
    "stage_ranges",
]


def check_pipeline_at_setup(trainer: Any, module: Any) -> None:
    """Refuse what a pipelined step cannot serve: manual optimization, fp16 loss scaling (checked at setup, when
    the Trainer's precision is known)."""
    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError("DPMPStrategy(pp > 1) runs the forward and backward of each micro-batch itself: it needs "
                         "automatic optimization (this LightningModule sets automatic_optimization = False).")
    if str(trainer.precision) in ("16-mixed", "16", "16-true"):
        raise ValueError(f"DPMPStrategy(pp > 1) does not support precision={trainer.precision!r} (fp16 loss scaling "
                         f"happens in Lightning's backward, which the pipeline replaces); use bf16-mixed, 32 or 64.")


class _LogRecorder:
    """``self.log``/``self.log_dict`` of the module, recorded per micro-batch instead of logged."""

    def __init__(self, metrics: Optional[Mapping[int, str]] = None) -> None:
        self.records: list[tuple[str, Any, dict[str, Any]]] = []
        self.metrics = metrics  # evaluation: id(Metric) -> its name in the module (a logged Metric is kept by name)

    @contextmanager
    def recording(self, module: nn.Module) -> Iterator[None]:
        def log(name: str, value: Any, **kwargs: Any) -> None:
            if self.metrics is not None and id(value) in self.metrics:
                self.records.append((name, _MetricRef(self.metrics[id(value)]), kwargs))
                return
            if not isinstance(value, (Tensor, int, float)):
                raise TypeError(f"under pipeline parallelism training_step logs values (tensors, numbers), not "
                                f"{type(value).__name__} ({name!r}): log a torchmetrics Metric from validation_step, "
                                f"or log its computed value")
            self.records.append((name, value.detach() if isinstance(value, Tensor) else value, kwargs))

        def log_dict(values: Mapping[str, Any], **kwargs: Any) -> None:
            for k, v in values.items():
                log(k, v, **kwargs)

        saved = {name: module.__dict__.get(name) for name in ("log", "log_dict")}
        vars(module).update(log=log, log_dict=log_dict)  # instance attributes over the methods, removed below
        try:
            yield
        finally:
            for name, own in saved.items():
                if own is None:
                    delattr(module, name)
                else:
                    setattr(module, name, own)

    def averaged(self) -> list[tuple[str, Any, dict[str, Any]]]:
        """One entry per logged name: the mean over micro-batches (a CPU tensor of the logged dtype, or a float),
        with the first call's arguments."""
        values: dict[str, list[Any]] = {}
        for name, value, kwargs in self.records:
            values.setdefault(name, [[], kwargs])[0].append(value)
        out: list[tuple[str, Any, dict[str, Any]]] = []
        for name, (seen, kwargs) in values.items():
            if isinstance(seen[0], _MetricRef):  # the metric itself: its state holds every micro-batch
                out.append((name, seen[0], kwargs))
            elif all(isinstance(v, Tensor) for v in seen):
                out.append((name, torch.stack([v.reshape(()) for v in seen]).mean().cpu(), kwargs))
            else:
                out.append((name, sum(float(v) for v in seen) / len(seen), kwargs))
        return out


class _MetricRef(str):
    """A torchmetrics ``Metric`` logged by an evaluation step: its name in the module (every rank has its own copy)."""


def evaluation_microbatches(rows: int, microbatches: int) -> int:
    """Micro-batches of an evaluation batch of ``rows`` rows: ``microbatches`` when it divides them, else the
    largest divisor of ``rows`` below it (a last, shorter batch is evaluated, not refused as in training)."""
    return max(n for n in range(1, min(rows, microbatches) + 1) if rows % n == 0)


class DPShards(Protocol):
    """What the stages need of a DP sharding of their parameters (ZeRO), and all they know of it: the tensors it
    steps in place of the parameters it holds, and the verbs a stage calls
    (:class:`~lightning_dpmp.integration.staged_zero.StagedShards` implements them over the ZeRO engine).
    Every rank of a DP group holds the same stages, so it names the same shards in the same order."""

    held: frozenset[int]  # id() of the parameters it holds: their gradients, storage and sync are its
    owner: dict[int, int]  # id(shard) -> the PP rank that owns it
    synced: list[nn.Parameter]  # the shards a stage sync sends (some stage does not read them)
    shared: list[nn.Parameter]  # trainable shards read on several stages: gradients summed over PP
    local_shards: frozenset[int]  # id() of this rank's stages' shards
    remote_shards: list[nn.Parameter]  # the other stages' shards
    grad_holders: list[nn.Parameter]  # where this rank's step leaves the gradients of what it holds
    compute_dtype: Optional[torch.dtype]  # the one compute dtype of a mixed-precision policy

    def no_sync(self) -> AbstractContextManager[Any]: ...  # the schedule's micro-batches keep gradients local
    def finish_backward(self) -> None: ...  # after the schedule: reduce over DP, once per step
    def release(self) -> None: ...  # train this rank's stages' shards only; free the others'
    def allocate(self) -> None: ...  # the others' shards' storage back, without values
    def restore(self, gather: bool) -> None: ...  # the others' shards take part again (gathered: whole again)
    def released_bytes(self) -> int: ...  # bytes :meth:`release` frees beside the shards
    def refresh(self) -> None: ...  # after a sync wrote shards: the parameters from them
    def whole(self) -> AbstractContextManager[Any]: ...  # every parameter whole for the duration
    def frees(self, param: Tensor) -> bool: ...  # ``param``'s storage is freed between uses now
    def value_of(self, param: Tensor) -> Tensor: ...  # a copy of ``param``'s current values
    def read_dtype(self, param: Tensor) -> torch.dtype: ...  # the dtype its values are read in


class Pipeline:
    """The stages of one model over one PP group, their schedule, and the step-time operations around it.

    Args:
        module: the LightningModule (already split over MP).
        profile: what the probe saw of its step.
        grid: this rank's grid (``pp > 1``); its topology holds the pipeline's settings.
        device: where activations live.
        batch: the batch the stages were planned from: every later batch must have its tensors' shapes past dim 0
            (the stages pass activations of a fixed shape).
        sequence_parallel: the split applied sequence parallelism (the stream holds 1/mp of the sequence).
    """

    def __init__(self, module: nn.Module, profile: StackProfile, grid: Grid, device: torch.device, batch: Any = None,
                 sequence_parallel: bool = False) -> None:
        config = grid.topology
        self.grid, self.config, self.profile = grid, config, profile
        self.batch_shapes = batch_shapes(batch) if batch is not None else None
        blocks = [m for _, m in repeated_blocks(module)]
        self.ranges = stage_ranges(profile, config)
        named = dict(module.named_parameters())  # tied parameters once, under their first name
        self.names = {id(p): n for n, p in named.items()}
        self.params = list(named.values())
        self.ranks = reading_ranks(module, profile, self.ranges, grid.pp)  # id(parameter) -> PP ranks reading it
        me = grid.pp_rank
        self.computed = [p for p in self.params if me in self.ranks[id(p)] and p.requires_grad]
        self.shared = [p for p in self.params if len(self.ranks[id(p)]) > 1 and p.requires_grad]
        self.owned = {id(p) for p in self.params if min(self.ranks[id(p)]) == me}
        modules = dict(module.named_modules())
        mp = grid.mp if sequence_parallel else 1
        stand_ins: list[Any] = [(modules[name], _stand_in_shape_of(modules[name], recorded, mp), recorded[2])
                                for name, recorded in profile.pre_modules.items()]
        # under sequence parallelism the stream between blocks holds 1/mp of the sequence (dim -2) on each MP rank,
        # and each sends its part to the same MP rank of the next stage
        stream_shape = tuple(profile.stream_shape)
        if mp > 1:
            stream_shape = stream_shape[:-2] + (stream_shape[-2] // mp, stream_shape[-1])
        self.runner = PipelineRunner(blocks, self.ranges, profile.stream, profile.output_arity, stream_shape,
                                     profile.stream_dtype, grid.pp_group, me, grid.pp, config.microbatches,
                                     config.schedule, device, stand_ins)
        # What this rank frees while training: the parameters none of its stages reads. Kept: those the code before
        # the stack reads outside a stood-in module (it runs on every stage), and any that shares its storage.
        kept = kept_everywhere(module, profile)
        self.local = {id(p) for p in self.params if me in self.ranks[id(p)] or id(p) in kept}
        self.keys = {id(p): (tuple(sorted(self.ranks[id(p)])), id(p) in kept) for p in self.params}
        remote = remote_parameters(module, profile, self.ranks, me)
        self.remote = [p for p in self.params if id(p) in remote]
        self.device = device
        # trained since the last sync: other stages' parameters (and optimizer state) here are stale
        self.stale_params = self.stale_state = False
        # the remote parameters' storage is freed (from the first step, or from the start for a meta-device model,
        # whose other stages' parameters were never allocated for longer than their initialisation, until a sync)
        self.staged = any(storage_freed(p) for p in self.remote)
        # What a stage sync sends: each tensor the optimizers step (a parameter; under ZeRO, a DP shard)
        # that some stage does not read, from the PP rank that owns it (the first that reads it)
        self.owner = {id(p): min(self.ranks[id(p)]) for p in self.params}
        self.synced = [p for p in self.params if len(self.ranks[id(p)]) < grid.pp]
        self.shards: Optional[DPShards] = None  # attach_shards: ZeRO over DP
        self.shared_shards: list[nn.Parameter] = []
        self._eval_streams: set[Any] = set()  # (hook, batch shapes) whose stream evaluation checked
        self.active = True  # until teardown: the stages hold the model (checkpoints are written from them)
        # User code reading a parameter outside the schedule (a callback's weight norm): the parameters some stage
        # does not read come from the stage that owns them (:meth:`fetches`, :meth:`values_of`); the same set on
        # every rank of the PP group, so every rank takes part in the same broadcasts. Inside the schedule the
        # ranks run user code at different times, so no read can be brought there (:meth:`refused_read`).
        self.staged_ids = {id(p) for p in self.params if len(self.ranks[id(p)]) < grid.pp}
        self._scheduling = 0
        # our own reads of the parameters run outside the reader of user code (set with it: the reader's aside())
        self.quiet: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext

    def attach_shards(self, shards: DPShards) -> None:
        """ZeRO over the DP group, built after the stages (keyed by :attr:`keys`, so no shard mixes stages): this
        rank trains its stages' shards only and frees the others' while it trains; a stage sync sends each shard
        from its owner instead of whole parameters."""
        self.shards = shards
        held = shards.held
        self.remote = [p for p in self.remote if id(p) not in held]
        self.owner.update(shards.owner)
        self.synced = [p for p in self.synced if id(p) not in held] + shards.synced
        self.shared_shards = shards.shared
        self.local |= shards.local_shards
        self.shared = [p for p in self.shared if id(p) not in held]
        self.computed = [p for p in self.computed if id(p) not in held]
        mine = self.grid.pp_rank
        self.owned = {i for i, r in self.owner.items() if r == mine}
        if shards.compute_dtype is not None:  # a mixed-precision policy: the blocks compute, and the stages send,
            self.runner.stream_dtype = shards.compute_dtype  # in its dtype
        self.staged = False
        self.stage()

    # ------------------------------------------------------------------ the printout
    def text(self) -> str:
        """Which blocks each stage holds, its share of the step's matmul FLOPs, and the schedule's bubble."""
        costs, pre, post = self.profile.costs()
        total = sum(costs) + pre + post or 1.0
        cfg = self.config
        lines = [f"  pipeline: pp={cfg.pp} x {cfg.stages_per_rank} stage(s) per rank, schedule {cfg.schedule},"
                 f" {cfg.microbatches} micro-batches per step; bubble "
                 f"{bubble_fraction(cfg.schedule, cfg.pp, cfg.microbatches, cfg.stages_per_rank):.1%};"
                 f" {2 * (cfg.stages - 1) * cfg.microbatches} activation/gradient sends per step"]
        names = self.profile.names
        for s, (a, b) in enumerate(self.ranges):
            cost = sum(costs[a:b]) + (pre if s == 0 else 0.0) + (post if s == cfg.stages - 1 else 0.0)
            extra = (" + the code before the stack" if s == 0 else "") + (
                " + the code after it (head, loss)" if s == cfg.stages - 1 else "")
            lines.append(f"    stage {s} (pp_rank {s % cfg.pp}): {names[a]} .. {names[b - 1]} ({b - a} blocks)"
                         f"{extra}; {cost / total:.1%} of the matmul FLOPs")
        if self.shared:
            lines.append(f"    read on several stages (gradients summed over PP): "
                         f"{', '.join(self.names[id(p)] for p in self.shared)}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ the step
    def training_step(self, module: Any, args: Sequence[Any], step_kwargs: Mapping[str, Any], accumulate: int,
                      optimizers: Sequence[Any] = (),
                      step_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext) -> Tensor:
        """Run the pipelined forward and backward of the batch (``args[0]`` or ``step_kwargs["batch"]``, the arguments
        Lightning calls ``training_step`` with, the others passed on as they are); log what ``training_step`` logged
        (the mean over micro-batches) on every rank; return the step's loss (the mean of the micro-batches' losses).

        ``step_context`` (the precision plugin's ``train_step_context``) surrounds each call of the user's
        ``training_step``, as Lightning's own step does, and not the schedule's backward: ``precision="64-true"``
        makes float64 the default dtype there (a table the step builds with ``torch.linspace`` or ``torch.tensor``
        is float64 as on one process; without it, float32: 8.2e-6 off one process after 6 AdamW steps at (1, 2, 1)
        on a Llama whose loss weights positions so), ``bf16-mixed`` turns autocast on (without it the first step's
        loss was 1.4e-5 off, float32 throughout)."""
        self.stage(optimizers)
        in_kwargs = not args
        batch = step_kwargs["batch"] if in_kwargs else args[0]
        check_batch_shapes(self.batch_shapes, batch)
        micro = split_microbatches(batch, self.config.microbatches)
        micro_size = _tensors(micro[0])[0].shape[0]
        recorder = _LogRecorder()

        def step_fn(mb: Any) -> Any:
            with recorder.recording(module), step_context():
                if in_kwargs:
                    out = module.training_step(**{**step_kwargs, "batch": mb})
                else:
                    out = module.training_step(mb, *args[1:], **step_kwargs)
            loss = out.get("loss") if isinstance(out, Mapping) else out
            loss = plain_value(loss)  # (a loss built from DTensor parameters: an L2 term)
            if loss is None:
                raise TypeError("under pipeline parallelism training_step must return the loss (a tensor, or a dict "
                                "with 'loss'); returning None to skip a batch is not supported")
            return loss

        # Lightning zeroes the gradients between training_step and backward: this step's gradients wait aside
        # until the strategy's backward adds them (apply_grads), as if the backward ran there
        # (under ZeRO the shards' too: zero=3 reduce-scatters each micro-batch's gradients into them; zero=1/2 keep
        # them local, reduce-scattered once per step by reduce_grads)
        holders = self._grad_holders()
        earlier = [p.grad for p in holders]
        for p in holders:
            p.grad = None
        try:
            with self.shards.no_sync() if self.shards is not None else contextlib.nullcontext(), self._schedule():
                losses = self.runner.step(micro, micro_size, step_fn, 1.0 / (self.config.microbatches * accumulate))
            self._pending = [p.grad for p in holders]
        finally:
            for p, g in zip(holders, earlier):
                p.grad = g
        self.stale_params = self.stale_state = True
        loss, logged = self._from_last_stage(losses, recorder)
        for name, value, kwargs in logged:
            module.log(name, value, **_local(kwargs, self.grid))
        return loss

    def evaluation_step(self, module: Any, hook: str, args: Sequence[Any], step_kwargs: Mapping[str, Any],
                        step_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
                        finish: Callable[[Any], Any] = lambda out: out, optimizers: Sequence[Any] = ()) -> Any:
        """Run the user's ``hook`` (``validation_step``, ``test_step`` or ``predict_step``) on the batch stage by stage:
        forward only, under the schedule's micro-batches, each rank running its stages' blocks with its own
        parameters (the other stages' stay freed). The last stage keeps its blocks' output of each micro-batch and
        runs the rest of the step (head, loss, metrics, ``self.log``) once on the whole batch
        (:meth:`~lightning_dpmp.parallel.stage_runner.PipelineRunner.evaluate`): what it logs is recorded, the metrics
        it updates change there, and ``finish`` (the strategy's conversion of DTensors and vocab-sharded logits) is
        applied to what it returns. Then one object broadcast over PP gives every rank that output, the logged values
        (a logged ``Metric`` by name) and what the step added to each metric (:class:`MetricUpdates`), and every rank
        logs them: what ``self.log``, metrics, callbacks and prediction writers see is one process's."""
        from lightning_dpmp.integration.metrics import MetricUpdates

        self.stage(optimizers)
        in_kwargs = not args
        batch = step_kwargs["batch"] if in_kwargs else args[0]
        tensors = _tensors(batch)
        if not tensors:
            raise ValueError(f"DPMPStrategy(pp > 1): {hook} runs stage by stage on micro-batches cut along dim 0; "
                             f"this batch holds no tensor")
        rows = int(tensors[0].shape[0])
        micro = split_microbatches(batch, evaluation_microbatches(rows, self.config.microbatches))
        micro_size = rows // len(micro)
        metrics = MetricUpdates(module)
        recorder = _LogRecorder({id(m): n for n, m in metrics.metrics.items()})
        step = getattr(module, hook)

        def recorded(into: _LogRecorder) -> Callable[[Any], Any]:
            def step_fn(mb: Any) -> Any:
                with into.recording(module), step_context():
                    out = step(**{**step_kwargs, "batch": mb}) if in_kwargs else step(mb, *args[1:], **step_kwargs)
                return finish(out)

            return step_fn

        with self._schedule():
            self._check_eval_stream(batch_shapes(batch), hook, micro[0], micro_size,
                                    recorded(_LogRecorder({id(m): n for n, m in metrics.metrics.items()})))
            mine, out = self.runner.evaluate(micro, micro_size, recorded(recorder), batch)
        last = (self.config.stages - 1) % self.grid.pp
        box: list[Any] = [None]
        if mine:
            logged = [(n, v, _portable(k, self.grid)) for n, v, k in recorder.averaged()]
            box = [(apply_to_collection(out, Tensor, lambda t: t.detach().cpu()), logged, metrics.taken())]
        dist.broadcast_object_list(box, group=self.grid.pp_group, group_src=last)
        received, logged, taken = box[0]
        if not mine:
            metrics.give(taken)
            out = apply_to_collection(received, Tensor, lambda t: t.to(self.device))
        for name, value, kwargs in logged:
            if isinstance(value, _MetricRef):
                value = module.get_submodule(str(value))
            elif isinstance(value, Tensor):
                value = value.to(self.device)
            module.log(name, value, **_local(kwargs, self.grid))
        return out

    # ------------------------------------------------------------------ user code reading parameters
    @contextmanager
    def _schedule(self) -> Iterator[None]:
        self._scheduling += 1
        try:
            yield
        finally:
            self._scheduling -= 1

    def refused_read(self, params: Sequence[Tensor]) -> Optional[str]:
        """Why a read of ``params`` cannot be made now (``None``: it can): another stage's parameter inside the
        schedule. (This rank's own, freed at zero=3, is gathered over its stage's DP group, whose ranks run the same
        micro-batches in the same order.)"""
        if not self._scheduling or all(id(p) in self.local for p in params):
            return None
        return ("that another pipeline stage owns, inside the pipelined step (training_step, validation_step, ...): "
                "the stages run each micro-batch's step at different times, so its values cannot be brought there "
                "(an L2 term: use the optimizer's weight_decay; read parameters in a callback or an epoch-end hook, "
                "or with pp=1)")

    def fetches(self, param: Tensor) -> bool:
        """Whether user code reading ``param`` reads it from elsewhere: a parameter some stage does not read (from
        the stage that owns it, alike on every rank), or at zero=3 one whose storage is freed (gathered over DP)."""
        freed = self.shards is not None and self.shards.frees(param)
        if self._scheduling:  # (each rank runs its own stages' step: what they read is here; the rest is refused)
            return freed or (id(param) in self.staged_ids and id(param) not in self.local)
        return id(param) in self.staged_ids or freed

    @contextmanager
    def values_of(self, params: Sequence[Tensor]) -> Iterator[list[Tensor]]:
        """The values of ``params`` (each as :meth:`fetches` says), as copies: collective over the PP group, and
        at zero=3 over the owning stage's DP group. Each parameter some stage does not read is broadcast from the
        PP rank that owns it (one broadcast each); what a rank reads is its own MP shard, as inside a step."""
        values = []
        for p in params:
            # (inside the schedule a rank reads only its own stages' parameters, whatever stage owns them)
            staged = id(p) in self.staged_ids and not (self._scheduling and id(p) in self.local)
            owner = self.owner[id(p)] if staged else None
            if owner is None or owner == self.grid.pp_rank:
                value = self._own_value(p)
            else:
                value = torch.empty(p.shape, dtype=self._read_dtype(p), device=p.device)
            if owner is not None:
                dist.broadcast(value, group=self.grid.pp_group, group_src=owner)
            values.append(value)
        yield values

    def _read_dtype(self, param: Tensor) -> torch.dtype:
        """The dtype its owner reads ``param`` in: under a ZeRO mixed-precision policy, the master one."""
        return self.shards.read_dtype(param) if self.shards is not None else param.dtype

    def _own_value(self, param: Tensor) -> Tensor:
        return self.shards.value_of(param) if self.shards is not None else param.detach().clone()

    def _check_eval_stream(self, shapes: list[tuple[int, ...]], hook: str, first: Any, micro_size: int,
                           step_fn: Callable[[Any], Any]) -> None:
        """Raise ``ValueError`` on every rank of the pipeline when an evaluation batch would send the stages another
        stream shape than the one they were planned with (a receiving stage would wait for bytes that never come).
        An evaluation batch may hold other tensors than a training batch (an index, a mask), so the stream itself is
        checked: once per new set of batch shapes, the first stage runs the code before the stack on one
        micro-batch and broadcasts the stream's shape over PP (a few integers)."""
        key = (hook, tuple(shapes))
        if key in self._eval_streams:
            return
        planned = (micro_size,) + tuple(self.runner.stream_shape[1:])
        shape = torch.full((len(planned) + 1,), -1, dtype=torch.long, device=self.device)
        if 0 in self.runner.my_stages:  # (what it logs or updates on the way is thrown away: the step runs later)
            got = self.runner.stream_shape_of(first, step_fn)
            shape[0] = len(got)
            shape[1:1 + min(len(got), len(planned))] = torch.tensor(got[:len(planned)])
        dist.broadcast(shape, group=self.grid.pp_group, group_src=0)
        rank = int(shape[0])
        got_shape = tuple(shape[1:1 + rank].tolist()) + ("...",) * max(0, rank - len(planned))
        if got_shape != planned:
            raise ValueError(
                f"DPMPStrategy(pp > 1): {hook} would pass the stages a stream of shape {got_shape} per micro-batch "
                f"(batch tensors {shapes}); the stages were planned for {planned}. Evaluate on batches padded to "
                f"the training sequence length.")
        self._eval_streams.add(key)

    _logged_layout: Optional[list[Any]] = None  # what the last stage logged last step: names, arguments, dtypes

    def _from_last_stage(self, losses: list[Tensor], recorder: _LogRecorder) -> tuple[Tensor, list[Any]]:
        """The step's loss and the logged values, on every rank of the pipeline from the rank holding the last stage:
        one broadcast of a float64 tensor ``[same names?, loss, values...]`` while the logged names and arguments stay
        those of the previous step, plus one object broadcast of the new layout when they change (the first step)."""
        grid, last = self.grid, (self.config.stages - 1) % self.grid.pp
        mine = grid.pp_rank == last
        known = self._logged_layout
        values: list[Any] = []
        layout: list[Any] = []
        if mine:
            logged = recorder.averaged()
            values = [float(torch.stack(losses).mean())] + [float(v) for _, v, _ in logged]
            layout = [str(losses[0].dtype)] + [(n, _portable(k, grid), str(v.dtype) if isinstance(v, Tensor) else None)
                                               for n, v, k in logged]
        width = len(known) if known is not None else 0
        packed = torch.zeros(1 + width, dtype=torch.float64, device=self.device)
        if mine and layout == known:
            packed[0] = 1.0
            packed[1:] = torch.tensor(values, dtype=torch.float64)
        dist.broadcast(packed, group=grid.pp_group, group_src=last)
        if packed[0].item() == 1.0:
            numbers = packed[1:].tolist()
        else:  # the first step, or the step logged other names: their layout and values as one object
            box: list[Any] = [(layout, values)]
            dist.broadcast_object_list(box, group=grid.pp_group, group_src=last)
            layout, numbers = box[0]
            self._logged_layout = layout
        assert self._logged_layout is not None
        dtypes = [self._logged_layout[0]] + [d for _, _, d in self._logged_layout[1:]]
        out = [torch.tensor(x, dtype=getattr(torch, d.split(".")[-1]), device=self.device) if d else x
               for x, d in zip(numbers, dtypes)]
        logged_out = [(n, v, k) for (n, k, _), v in zip(self._logged_layout[1:], out[1:])]
        return out[0], logged_out

    # ------------------------------------------------------------------ gradients
    _pending: Optional[list[Optional[Tensor]]] = None

    def apply_grads(self) -> None:
        """The strategy's ``backward``: add the gradients of the last :meth:`training_step` to the parameters'."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("DPMPStrategy(pp > 1): backward without a pipelined training_step before it")
        with torch.no_grad(), self.quiet():
            for p, g in zip(self._grad_holders(), pending):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)

    def _grad_holders(self) -> list[nn.Parameter]:
        """Where a step's gradients land: the parameters, and under ZeRO the DP shards of this rank's stages."""
        return self.params + (self.shards.grad_holders if self.shards is not None else [])

    def reduce_grads(self) -> None:
        """Sum the gradients of parameters read on several stages over PP, then average this rank's gradients over
        DP (flat, one all-reduce per dtype). Every rank of a DP group holds the same stages, so the same list.
        Under ZeRO the shards are reduce-scattered over DP instead, and the shards of parameters read on several stages
        (sliced alike on every stage) are summed over PP: the same sums, on 1/dp of the bytes."""
        with self.quiet():
            self._reduce_grads()

    def _reduce_grads(self) -> None:
        grid = self.grid
        if self.shards is not None:
            self.shards.finish_backward()
        # (keep_unused: a parameter no rank had a gradient for keeps None, so AdamW skips it as on one process; an
        # expert no token chose in this step, anywhere)
        for shared in (self.shared, self.shared_shards):
            if shared:
                all_reduce_grads(shared, grid.pp_group, average=False, keep_unused=True)
                for p in shared:
                    if id(p) not in self.local:
                        p.grad = None  # not read here: its storage may be freed, and the stages reading it step it
        if grid.dp > 1 and self.shards is None:
            # in place: a new tensor per gradient held the schedule's beside it (they are referenced until the step's
            # end), a second copy of the stage's gradients beside the flat one (measured: the peak of a recomputed
            # stage, hf_llama (2,2,2) at world 8, 15.5 MB above the step's start, twice the 7.8 MB of gradients)
            all_reduce_grads(self.computed, grid.dp_group, average=True, keep_unused=True, in_place=True)

    def counted(self) -> set[int]:
        """``id`` of the parameters whose gradient this rank counts in the global norm (each one on one rank)."""
        return self.owned

    # ------------------------------------------------------------------ stage sync
    def stage(self, optimizers: Sequence[Any] = ()) -> None:
        """Free the storage of the parameters no stage of this rank reads (under ZeRO: the other stages' shards, and
        this rank then gathers and reduce-scatters its own only), with their optimizer state (a sync brings both
        back); a no-op while they are freed."""
        shards = self.shards
        remote_shards = shards.remote_shards if shards is not None else []
        if self.staged or not (self.remote or remote_shards):
            return
        remote = {id(p) for p in self.remote + remote_shards}
        for optimizer in optimizers:
            inner = compat.unwrap_optimizer(optimizer)
            for p in [p for p in inner.state if id(p) in remote]:
                del inner.state[p]
        for p in self.remote:
            p.grad = None
            p.untyped_storage().resize_(0)  # shape, dtype and identity stay: names, optimizer, checkpoints
        if shards is not None:
            shards.release()  # (its owner's shards come back at a stage sync)
        self.staged = True

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Every parameter current on this rank inside (collective); the next training step frees them again
        (zero=3 gathers every shard for the duration, and frees them after)."""
        self.sync(with_state=False)
        with self.shards.whole() if self.shards is not None else contextlib.nullcontext():
            yield

    def allocate(self) -> None:
        """Give the freed parameters their storage back, without values (a checkpoint load fills them: under ZeRO
        the load writes the shards and regathers every parameter held whole)."""
        if self.staged:
            self._allocate_remote()
            if self.shards is not None:
                self.shards.restore(gather=False)
            self.staged = False

    def _allocate_remote(self) -> None:
        for p in self.remote:
            p.untyped_storage().resize_(p.numel() * p.element_size())
        if self.shards is not None:
            self.shards.allocate()

    def memory_freed(self) -> int:
        """Bytes of parameters this rank frees while it trains (the other stages' own; under ZeRO-1/2 their
        gathered buffers)."""
        freed = sum(p.numel() * p.element_size() for p in self.remote)
        return freed + (self.shards.released_bytes() if self.shards is not None else 0)

    def sync(self, optimizers: Sequence[Any] = (), with_state: bool = True) -> None:
        """Every rank of the PP group gets the parameters (and with ``with_state`` the optimizer state) the others
        own, freed storage allocated again (collective)."""
        if self.staged or self.stale_params:
            self._sync_params()
        if with_state and self.stale_state:
            self._sync_state(optimizers)

    def _sync_params(self) -> None:
        # one broadcast per owning PP rank and dtype: the whole parameters, or under ZeRO their DP shards
        # (each DP rank of a stage sends its slice to the same slice's holders on the other stages)
        grid = self.grid
        was_staged = self.staged
        if was_staged:
            self._allocate_remote()
        with torch.no_grad(), self.quiet():
            for r in range(grid.pp):
                theirs = [p for p in self.synced if self.owner[id(p)] == r]
                by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
                for p in theirs:
                    by_dtype.setdefault(p.dtype, []).append(p)
                for ps in by_dtype.values():
                    flat = torch.cat([t.detach().reshape(-1) for t in ps])
                    dist.broadcast(flat, group=grid.pp_group, group_src=r)
                    if r != grid.pp_rank:
                        offset = 0
                        for t in ps:
                            t.copy_(flat[offset: offset + t.numel()].view_as(t))
                            offset += t.numel()
        if self.shards is not None:
            if was_staged:
                self.shards.restore(gather=True)
            else:
                self.shards.refresh()  # the received shards into the parameters held whole
        self.staged = self.stale_params = False

    def _sync_state(self, optimizers: Sequence[Any]) -> None:
        # one pickled all-gather per optimizer over the PP group: a checkpoint's cost, not a step's
        grid = self.grid
        synced = {id(p) for p in self.synced}
        for optimizer in optimizers:
            inner = compat.unwrap_optimizer(optimizer)
            params = [p for g in inner.param_groups for p in g["params"]]
            mine = {i: {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in inner.state[p].items()}
                    for i, p in enumerate(params) if id(p) in self.owned and id(p) in synced and p in inner.state}
            every: list[Any] = [None] * grid.pp
            dist.all_gather_object(every, mine, group=grid.pp_group)
            for r, states in enumerate(every):
                if r == grid.pp_rank:
                    continue
                for i, state in states.items():
                    p = params[i]
                    inner.state[p] = {k: (v.to(p.device) if isinstance(v, Tensor) and v.dim() > 0 else v)
                                      for k, v in state.items()}
        self.stale_state = False


def batch_shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shapes past dim 0 of the tensors in ``batch`` (any nesting), in order.

    Example:
        >>> batch_shapes((torch.zeros(8, 16, dtype=torch.long), {"mask": torch.ones(8, 16), "n": 3}))
        [(16,), (16,)]
    """
    return [tuple(t.shape[1:]) for t in _tensors(batch)]


def _tensors(batch: Any) -> list[Tensor]:
    """The tensors of ``batch`` with a batch dim, in order, through any collection Lightning moves to a device
    (mappings such as transformers' ``BatchEncoding``, sequences, namedtuples, dataclasses)."""
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(t) if t.dim() > 0 else None)
    return found


def split_microbatches(batch: Any, n: int) -> list[Any]:
    """``batch`` cut into ``n`` equal parts along dim 0, the collections around its tensors rebuilt as Lightning
    rebuilds them (a ``BatchEncoding`` stays one); other leaves are shared by every part. Raises ``ValueError``
    naming the sizes when a tensor does not divide.

    Example:
        >>> [tuple(p["x"].shape) for p in split_microbatches({"x": torch.zeros(4, 3), "name": "a"}, 2)]
        [(2, 3), (2, 3)]
    """
    for t in _tensors(batch):
        if t.shape[0] % n:
            raise ValueError(
                f"pp_microbatches={n} must divide the batch: a batch tensor has {t.shape[0]} rows (shape "
                f"{tuple(t.shape)}). Use a batch size divisible by {n} (drop_last=True for the last batch)."
            )
    return [apply_to_collection(batch, Tensor, lambda t, i=i: t.chunk(n)[i] if t.dim() > 0 else t) for i in range(n)]


def check_batch_shapes(expected: Optional[list[tuple[int, ...]]], batch: Any) -> None:
    """Raise ``ValueError`` (on every rank of the row: they hold one batch) when ``batch``'s tensors differ past dim
    0 from the batch the stages were planned from: the stages send activations of fixed shape, and a different one
    would leave a receiving stage waiting for bytes that never come."""
    if expected is None:
        return
    got = batch_shapes(batch)
    if got != expected:
        raise ValueError(
            f"DPMPStrategy(pp > 1) plans fixed activation shapes from the first batch, whose tensors had shapes "
            f"(past the batch dim) {expected}; this batch has {got}. Pad every batch to one sequence length (e.g. "
            f"padding='max_length' or a fixed block size)."
        )


def stage_ranges(profile: StackProfile, config: Topology) -> list[tuple[int, int]]:
    """The ``[start, end)`` block range of every stage: :func:`~lightning_dpmp.planner.stages.balance` of the
    probed costs."""
    costs, pre, post = profile.costs()
    return balance(costs, pre, post, config.stages)


def reading_ranks(module: nn.Module, profile: StackProfile, ranges: Sequence[tuple[int, int]], pp: int
                  ) -> dict[int, set[int]]:
    """``id(parameter) -> the PP ranks whose stages read it`` (stage ``s`` on rank ``s % pp``; the code before the
    stack on the first stage, after it on the last; a parameter no region read goes to the first). A parameter
    inside a block belongs to that block's stage even where the probed step did not read it: a data-dependent step
    (an expert no token chose on the first batch) reads it later, there."""
    stage_of_block = {j: s for s, (a, b) in enumerate(ranges) for j in range(a, b)}
    region_stage = {PRE: 0, POST: len(ranges) - 1, BETWEEN: 0}
    prefixes = [(f"{name}.", j) for j, name in enumerate(profile.names)]
    ranks: dict[int, set[int]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):  # a tied parameter: every name's regions
        regions = set(profile.param_regions.get(name, set()))
        regions.update(j for prefix, j in prefixes if name.startswith(prefix))
        stages = {stage_of_block.get(r, region_stage.get(r, 0)) for r in regions}
        ranks.setdefault(id(p), set()).update(s % pp for s in stages)
    return {pid: r or {0} for pid, r in ranks.items()}


def _stand_in_shape_of(module: nn.Module, recorded: Any, mp: int) -> Any:
    """``shape_of`` for a module before the stack standing in on a later stage (zeros of the shape it would return,
    :func:`~lightning_dpmp.planner.stages.stand_in_shape`). A split embedding that reduce-scatters the sequence
    itself (sequence parallelism, ``mp > 1``) returns 1/mp of the tokens, and from there on its forward runs the
    per-rank dropout stream: the stand-in does both, as that forward would."""
    shape_of = functools.partial(stand_in_shape, recorded)
    if mp == 1 or not isinstance(module, VocabParallelEmbedding) or module.sequence_dim is None:
        return shape_of
    dim = module.sequence_dim

    def local(first: Any) -> Optional[tuple[int, ...]]:
        if module.rng is not None:
            module.rng.enter_for(module.training)
        shape = shape_of(first)
        if shape is None:
            return None
        out = list(shape)
        out[dim] //= mp
        return tuple(out)

    return local


def kept_everywhere(module: nn.Module, profile: StackProfile) -> set[int]:
    """``id`` of the parameters every stage keeps: the code before the stack reads them outside a stood-in module,
    and that code runs on every stage."""
    return {id(p) for n, p in module.named_parameters(remove_duplicate=False) if n in profile.pre_direct}


def remote_parameters(module: nn.Module, profile: StackProfile, ranks: Mapping[int, set[int]], pp_rank: int
                      ) -> set[int]:
    """``id`` of the parameters of ``module`` that pipeline rank ``pp_rank`` frees while training: none of its stages
    reads them (``ranks``: :func:`reading_ranks`). Kept: those the code before the stack reads outside a stood-in
    module (:func:`kept_everywhere`), and any that shares its storage with another tensor."""
    keep = kept_everywhere(module, profile)
    return {id(p) for p in module.parameters()
            if pp_rank not in ranks[id(p)] and id(p) not in keep and _owns(p)}


def _owns(p: Tensor) -> bool:
    """Whether ``p`` alone uses its whole storage (freeing a shared storage would free another tensor too), or
    already freed it (a meta model's other stages)."""
    return p.storage_offset() == 0 and p.untyped_storage().nbytes() in (0, p.numel() * p.element_size())


def _portable(kwargs: dict[str, Any], grid: Grid) -> dict[str, Any]:
    """``self.log`` arguments that can travel to the other stages: our process groups by name."""
    out = dict(kwargs)
    group = out.get("sync_dist_group")
    if group is not None:
        names = {id(grid.dp_group): "dp", id(grid.mp_group): "mp", id(dist.group.WORLD): "world"}
        if id(group) not in names:
            raise ValueError("under pipeline parallelism self.log(sync_dist_group=...) takes the strategy's DP or MP "
                             "group (trainer.strategy.grid.dp_group) or the world")
        out["sync_dist_group"] = names[id(group)]
    return out


def _local(kwargs: dict[str, Any], grid: Grid) -> dict[str, Any]:
    out = dict(kwargs)
    if "sync_dist_group" in out:
        out["sync_dist_group"] = {"dp": grid.dp_group, "mp": grid.mp_group, "world": dist.group.WORLD}[
            out["sync_dist_group"]]
    return out


def batch_rows(batch: Any) -> Optional[int]:
    """Dim 0 of the first tensor of ``batch`` with a batch dim (what micro-batches split); ``None`` without one."""
    sizes = [int(t.shape[0]) for t in _tensors(batch)]
    return sizes[0] if sizes else None


def probe_pipeline(probe: Callable[[], StackProfile], batch: Any, config: Topology) -> StackProfile:
    """Probe the step (``probe()``: the first batch's step on the dense model, real or meta tensors,
    :func:`~lightning_dpmp.planner.stages.probe_stack`; the setup's record of the first step keeps it) and check
    that the stages can be cut. Raises :class:`~lightning_dpmp.planner.stages.StageCutError` on every rank when the
    step cannot be cut (every rank probes the same model on the same batch)."""
    rows = batch_rows(batch)
    if rows is None:
        raise StageCutError("pipeline parallelism splits the batch into micro-batches along dim 0; the first batch "
                            "holds no tensor")
    if rows % config.microbatches:
        raise ValueError(f"pp_microbatches={config.microbatches} must divide the batch size; the first batch has "
                            f"{rows} rows per DP rank")
    try:
        profile = probe()
        stage_ranges(profile, config)  # enough blocks for the stages
        return profile
    except StageCutError as exc:
        raise StageCutError(f"DPMPStrategy(pp={config.pp}) cannot cut this training step into pipeline stages: "
                            f"{exc}") from None
