"""The Lightning side of tracing: the first batch of the current stage, and a callable running its step.

The step runs at setup, before Lightning has built the optimizers. A training step may read them
(``self.trainer.optimizers[0].param_groups[0]["lr"]``, ``self.lr_schedulers().get_last_lr()``), so while it runs
the Trainer holds real ones, fresh from ``configure_optimizers`` (:func:`trainer_state`); they are never stepped,
and its own (empty) lists come back afterwards. Each function takes what it reads (the module, the precision plugin,
the device, the global rank), never the strategy.

Example:
    >>> # collective: rank 0 reads, everyone receives; run() -> training_step(batch, 0)'s output
    >>> batch, notes = first_batch(trainer, module, global_rank=0)  # doctest: +SKIP
    >>> run = step_runner(trainer, module, plugin, torch.device("cpu"), batch)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

import lightning_dpmp.compat as compat
from lightning_dpmp.integration.autoplan import isolated
from lightning_dpmp.planner.trace import NoDropout

__all__ = ["real_tensors_on_meta", "first_batch", "step_runner", "trainer_state"]

_STEPS = {
    TrainerFn.FITTING: ("fit_loop", "training_step", "train_step_context"),
    TrainerFn.VALIDATING: ("validate_loop", "validation_step", "val_step_context"),
    TrainerFn.TESTING: ("test_loop", "test_step", "test_step_context"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_step", "predict_step_context"),
}


def _first_of(loaders: Any) -> Any:
    if isinstance(loaders, dict):
        return _first_of(next(iter(loaders.values())))
    if isinstance(loaders, (list, tuple)):
        return _first_of(loaders[0])
    return loaders


def first_batch(trainer: Any, module: Any, global_rank: int) -> tuple[Optional[Any], list[str]]:
    """Global rank 0 reads one batch of the stage's dataloader (RNG states untouched, ``module``'s modes kept) and
    broadcasts it to every rank."""
    notes: list[str] = []
    batch = None
    if global_rank == 0:
        loop_name = _STEPS[trainer.state.fn][0]
        source = compat.loop_data_source(trainer, loop_name)
        try:
            with isolated(module):
                loader = _first_of(source.dataloader())
                batch = move_data_to_device(next(iter(loader)), "cpu")
        except Exception as exc:
            notes.append(f"no batch to trace ({type(exc).__name__}: {exc}); plan from defaults and user plan only")
    box: list[Any] = [batch, notes]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0], box[1]


def step_runner(trainer: Any, module: Any, plugin: Any, device: torch.device, batch: Any, meta: bool = False
                ) -> Callable[[], Any]:
    """A callable running the stage's step hook of ``module`` on ``batch`` as the loop would (moved to ``device``,
    the precision ``plugin``'s input conversion and step context); with ``meta``, on meta tensors (shapes only), for
    a model built on the meta device."""
    lm = module
    _, hook, context = _STEPS[trainer.state.fn]
    training = trainer.state.fn == TrainerFn.FITTING
    # Lightning's fit loop runs each module in the mode it is in now (it never calls train(): a submodule that
    # from_pretrained or the user left in eval mode trains in eval mode), so the traced step runs in these modes
    modes = [(m, m.training) for m in lm.modules()]

    def run() -> Any:
        b = compat.apply_batch_transfer_handler(lm, batch, device)
        b = plugin.convert_input(to_meta(b) if meta else b)
        if training:  # trace the path that trains (caches, checkpointing, aux losses follow self.training)
            for m, mode in modes:  # `isolated` restores every module's mode afterwards
                m.training = mode
        state = trainer_state(trainer, lm) if training else contextlib.nullcontext()
        buffers = real_tensors_on_meta(lm) if meta else contextlib.nullcontext()
        with state, buffers, getattr(plugin, context)(), NoDropout() if training else contextlib.nullcontext():
            return getattr(lm, hook)(b, 0)

    return run


@contextlib.contextmanager
def trainer_state(trainer: Any, module: Any) -> Iterator[None]:
    """While a training step runs at setup: ``trainer.optimizers`` and ``trainer.lr_scheduler_configs`` (what
    ``self.optimizers()`` and ``self.lr_schedulers()`` read; Lightning keeps both on ``trainer.strategy``) built by
    ``module``'s ``configure_optimizers`` over its current (dense or split) parameters, then the previous values
    again.

    Nothing is stepped: a scheduler's constructor sets the first learning rate, as it does in the real run. Lightning
    already holds optimizers (a later stage), or ``configure_optimizers`` fails here: the step runs as it is.
    """
    holder = trainer.strategy  # (the Trainer's setter covers optimizers only)
    if holder.optimizers or not is_overridden("configure_optimizers", module):
        yield
        return
    saved = (holder.optimizers, holder.lr_scheduler_configs)
    try:
        with warnings.catch_warnings():  # Lightning's warnings about the configuration come at its own call
            warnings.simplefilter("ignore")
            optimizers, configs = compat.init_optimizers_and_lr_schedulers(module)
    except Exception:  # reported, if it matters, when Lightning calls configure_optimizers itself
        optimizers, configs = [], []
    holder.optimizers, holder.lr_scheduler_configs = optimizers, configs
    try:
        yield
    finally:
        holder.optimizers, holder.lr_scheduler_configs = saved


@contextlib.contextmanager
def real_tensors_on_meta(module: nn.Module) -> Iterator[None]:
    """While tracing a meta model: its real buffers (computed at build, e.g. rotary ``inv_freq``) and real
    parameters (adapters added to a lazily loaded model) as meta copies, so no op mixes devices; the real ones are
    back afterwards, untouched by the traced step. Tied parameters get one copy."""
    copies: dict[int, Tensor] = {}

    def meta(t: Tensor) -> Tensor:
        if id(t) not in copies:
            m = t.to("meta")
            copies[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
        return copies[id(t)]

    slots: list[dict[str, Any]] = [s for m in module.modules()
                                   for s in (compat.own_parameters(m), compat.own_buffers(m))]
    saved = [(slot, k, t) for slot in slots for k, t in slot.items() if t is not None and not t.is_meta]
    for slot, k, t in saved:
        slot[k] = meta(t)
    try:
        yield
    finally:
        for slot, k, t in saved:
            slot[k] = t


def to_meta(batch: Any) -> Any:
    """The batch as meta tensors, for tracing a meta model (shapes only)."""
    return apply_to_collection(batch, Tensor, lambda t: t.to("meta"))
