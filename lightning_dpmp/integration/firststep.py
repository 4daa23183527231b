"""The first step of the run, recorded once per setup: the batch, the dense step's trace, loss and gradients, the
pipeline probe read from that same run, and the estimators' profiles, handed to every setup step that plans from them.

``DPMPStrategy.setup`` makes one :class:`FirstStep` and passes it to the layout choice
(:func:`~lightning_dpmp.integration.autolayout.choose_layout`,
:func:`~lightning_dpmp.integration.autolayout.check_memory`), the stage cut
(:func:`~lightning_dpmp.integration.parallelize.plan_pipeline`), the recompute choice
(:func:`~lightning_dpmp.integration.parallelize.plan_recompute`) and the plan
(:func:`~lightning_dpmp.integration.split.split_model`). Each product is made on first use and kept:

* :attr:`FirstStep.batch`: rank 0 reads the first batch of the stage's dataloader and broadcasts it, once;
* :meth:`FirstStep.dense`: the step run once on the dense model (on meta tensors for a meta model), traced, its
  loss and gradients kept (:func:`~lightning_dpmp.integration.verify.record_dense`) after every rank took rank 0's
  weights. When fitting, the same run also watches the repeated blocks for a pipeline cut (:meth:`stack`), where
  the setup asked for it at construction or before that run (the probe only reads: the trace, loss and gradients
  are those of the step alone);
* :meth:`layout_profile` and :meth:`recompute_profile`: the layout estimator's and ``activation_checkpointing=
  "auto"``'s profiles (:func:`~lightning_dpmp.planner.profile.profile_step`), each a run of its own: the profiler
  stands in for fused attention with empty tensors (what the kernel saves, not what it computes), so its run's
  values are not the step's, and the dense run cannot carry it.

A probe asked for after the dense run that did not record it, or outside fitting, runs the step for it alone (once):
an evaluation step's trace runs in eval mode and, on meta tensors, stops after the first pass (a probe of it would see
another step); and when the watched run fails, the step runs again without the probe, so that the probe's failure
never costs the plan its trace, and the probe then runs alone, as it would without the record.

Example:
    >>> first = FirstStep(trainer, lm, plugin, torch.device("cpu"), global_rank=0, meta=False,  # doctest: +SKIP
    ...                   stack_wanted=True)
    >>> first.stack().blocks, first.dense().loss          # one run of training_step  # doctest: +SKIP
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_dpmp.compat import tree_leaves
from lightning_dpmp.integration.activations import profile_module as meta_profile_module
from lightning_dpmp.integration.metrics import shapes_only
from lightning_dpmp.integration.pipeline import batch_rows
from lightning_dpmp.integration.stepdata import first_batch, isolated, step_runner
from lightning_dpmp.integration.verify import DenseStep, record_dense
from lightning_dpmp.parallel.comm import broadcast_dense
from lightning_dpmp.parallel.compiled import repeated_blocks
from lightning_dpmp.planner.profile import ModelProfile, config_sizes, profile_step, token_tensor
from lightning_dpmp.planner.stages import StackProfile, probe_stack

__all__ = ["FirstStep", "estimator_profile"]


def estimator_profile(module: nn.Module, run: Callable[[], Any], batch: Any) -> tuple[ModelProfile, int]:
    """The layout estimator's profile of ``module``'s step ``run`` on ``batch`` (one forward, on the tensors it
    holds), and the sequences (rows) ``batch`` holds: the per-rank batch.

    Sizes: a batch with a ``(sequences, tokens)`` integer tensor is read as sequences of that length, any other as
    rows of one token; vocabulary, width, heads and feed-forward width come from a transformers config when the
    model holds one, else from its largest ``nn.Embedding`` (width: the blocks' input when there is none).
    """
    try:
        sequences, seq = token_tensor(batch).shape
    except ValueError:
        first = next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        sequences, seq = (int(first.shape[0]) if first is not None else 1), 1
    cfg = next((m.config for m in module.modules() if hasattr(getattr(m, "config", None), "to_dict")), None)
    if cfg is not None:
        vocab, hidden, heads, kv, ffn = config_sizes(cfg)
    else:
        tables = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        big = max(tables, key=lambda m: m.num_embeddings, default=None)
        vocab, hidden = (big.num_embeddings, big.embedding_dim) if big is not None else (0, 0)
        heads = kv = ffn = 0
    prof = profile_step(module, run, vocab, hidden, int(seq), int(sequences), heads=heads, kv_heads=kv, ffn=ffn)
    if not prof.hidden and prof.block_input_bytes:
        prof = replace(prof, hidden=max(1, round(prof.block_input_bytes / (prof.seq * prof.act_bytes))))
    return prof, int(sequences)


@dataclass
class FirstStep:
    """The first step of this setup's run (the stage's own: training, validation, test or predict) on ``module``
    (a LightningModule) under ``trainer``'s current stage, on ``device`` under the precision ``plugin``; ``meta``:
    the model is on the meta device, so every run is on meta tensors (shapes only).

    ``stack_wanted``: the setup will ask for the pipeline probe (``pp > 1`` or ``"auto"``), so the dense run records
    it too when fitting.

    Collective: the first read of :attr:`batch` (rank 0 reads, every rank receives) and the call that makes the
    dense run (every rank takes rank 0's dense weights first) must come on every rank at the same point; the rest
    is local.
    """

    trainer: Any
    module: nn.Module
    plugin: Any
    device: torch.device
    global_rank: int
    meta: bool
    stack_wanted: bool = False
    _fetched: bool = field(default=False, init=False, repr=False)
    _batch: Any = field(default=None, init=False, repr=False)
    _notes: list[str] = field(default_factory=list, init=False, repr=False)
    _run: Optional[Callable[[], Any]] = field(default=None, init=False, repr=False)
    _dense: Optional[DenseStep] = field(default=None, init=False, repr=False)
    _synced: bool = field(default=False, init=False, repr=False)
    _stack: Optional[StackProfile] = field(default=None, init=False, repr=False)
    _stack_error: Optional[BaseException] = field(default=None, init=False, repr=False)
    _profiled: bool = field(default=False, init=False, repr=False)
    _profile: Optional[tuple[ModelProfile, int]] = field(default=None, init=False, repr=False)
    _recompute: Optional[ModelProfile] = field(default=None, init=False, repr=False)

    @property
    def training(self) -> bool:
        """Whether the step is a training step (fitting): the one whose run the probes ride on."""
        return self.trainer.state.fn == TrainerFn.FITTING

    @property
    def batch(self) -> Any:
        """The first batch (``None`` when the dataloader gave none); collective on the first read."""
        if not self._fetched:
            self._batch, self._notes = first_batch(self.trainer, self.module, self.global_rank)
            self._fetched = True
        return self._batch

    @property
    def notes(self) -> list[str]:
        """Why there is no batch, for the plan printout (after :attr:`batch` was read)."""
        return list(self._notes)

    @property
    def synced(self) -> bool:
        """Whether every rank already holds rank 0's dense weights (the dense run broadcast them)."""
        return self._synced

    def runner(self) -> Optional[Callable[[], Any]]:
        """The plain step on the first batch (``None`` without one), as the loop would run it: what the plan's
        verification runs again on the split model."""
        if self._run is None and self.batch is not None:
            self._run = step_runner(self.trainer, self.module, self.plugin, self.device, self.batch, self.meta)
        return self._run

    # ------------------------------------------------------------------ the dense run
    def dense(self) -> DenseStep:
        """The dense step's trace, loss and gradients (an empty record without a batch); the first call runs it,
        after every rank took rank 0's dense weights (collective)."""
        if self._dense is None:
            self._dense = self._record()
        return self._dense

    def _record(self) -> DenseStep:
        run = self.runner()
        if run is None:
            return DenseStep()
        if dist.is_initialized() and dist.get_world_size() > 1:
            broadcast_dense(self.module)  # unseeded runs agree: the MP ranks' dense steps must match
            self._synced = True
        rows = batch_rows(self.batch)
        # the probe rides on the training step's run only (an evaluation step's is traced in eval mode, and on meta
        # tensors stops after its first pass); a stack of fewer than two blocks is refused without running anything
        stack = (self.training and self.stack_wanted and rows is not None and self._stack is None
                 and self._stack_error is None and len(repeated_blocks(self.module)) >= 2)
        if not stack:
            return record_dense(self.module, run, self.training)
        done: list[Any] = []  # the step's output, once it returned

        def step() -> Any:
            done.append(run())
            return done[-1]

        def probed(inner: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                try:
                    assert rows is not None
                    self._stack = probe_stack(self.module, inner, rows)
                except Exception as exc:
                    if not done:
                        raise
                    self._stack_error = exc  # a step that cannot be cut: raised when pp > 1 asks
                return done[-1]

            return call

        watched = probed(step)
        with shapes_only(self.module) if self.meta else nullcontext():  # (the probe's, as when it runs alone)
            dense = record_dense(self.module, watched, True)
        if dense.trace is None:  # the watched run failed: nothing it watched is kept, and the step runs alone
            self._stack, self._stack_error = None, None
            dense = record_dense(self.module, run, True)
        return dense

    # ------------------------------------------------------------------ products of that run
    def stack(self) -> StackProfile:
        """The pipeline probe of the step (:func:`~lightning_dpmp.planner.stages.probe_stack`); raises
        :class:`~lightning_dpmp.planner.stages.StageCutError` (or the step's own error) when it cannot be cut."""
        if self._stack is None and self._stack_error is None and self._dense is None and self.training:
            self.stack_wanted = True
            self.dense()
        if self._stack is None and self._stack_error is None:  # not watched by the dense run: a run of its own
            rows = batch_rows(self.batch)
            try:
                with isolated(self.module), shapes_only(self.module) if self.meta else nullcontext():
                    self._stack = probe_stack(self.module, self._step(), rows or 0)
            except Exception as exc:
                self._stack_error = exc
        if self._stack_error is not None:
            raise self._stack_error
        assert self._stack is not None
        return self._stack

    def layout_profile(self) -> Optional[tuple[ModelProfile, int]]:
        """The layout estimator's profile of the step on the tensors the model holds (:func:`estimator_profile`)
        and the per-rank batch's sequences, made once; ``None`` when it could not be read. Local: it reads the
        batch already fetched (:attr:`batch`, collective, first)."""
        if not self._profiled:
            try:
                with isolated(self.module, []), torch.enable_grad():
                    self._profile = estimator_profile(self.module, self._step(), self.batch)
            except Exception:  # no profile: the layout choice falls back, the memory check is skipped
                self._profile = None
            self._profiled = True
        return self._profile

    def recompute_profile(self) -> ModelProfile:
        """``activation_checkpointing="auto"``'s profile of the step, on meta copies of every tensor, made once.

        Not :meth:`layout_profile` (both are set in one setup only when a layout is chosen at setup as well): this
        one allocates nothing, so it answers before the device is asked to hold the step, and it is sized by the
        largest embedding table, the sizes the recompute estimator was set against
        (:func:`~lightning_dpmp.integration.activations.profile_module`); one profile for both would change either
        choice."""
        if self._recompute is None:
            self._recompute = meta_profile_module(self.trainer, self.module, self.plugin, self.device, self.batch)
        return self._recompute

    def _step(self) -> Callable[[], Any]:
        run = self.runner()
        if run is None:
            raise RuntimeError("no first batch to run the step on")
        return run
