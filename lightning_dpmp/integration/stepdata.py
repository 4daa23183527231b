"""The Lightning side of tracing: the first batch of the current stage, a callable running its step, isolation.

The step runs at setup, before Lightning has built the optimizers. A training step may read them
(``self.trainer.optimizers[0].param_groups[0]["lr"]``, ``self.lr_schedulers().get_last_lr()``), so while it runs
the Trainer holds real ones, fresh from ``configure_optimizers`` (:func:`trainer_state`); they are never stepped,
and its own (empty) lists come back afterwards. :func:`isolated` makes such an extra step leave no trace: RNG
states, buffers, torchmetrics states and modes are restored, ``self.log`` is silenced. Each function takes what it
reads (the module, the precision plugin, the device, the global rank), never the strategy.

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
from lightning_dpmp.compat import (
    collect_rng_states,
    init_optimizers_and_lr_schedulers,
    metric_state_keys,
    set_rng_states,
)
from lightning_dpmp.planner.trace import NoDropout

__all__ = ["real_tensors_on_meta", "first_batch", "isolated", "step_runner", "trainer_state"]

class _InertOptimizer:
    """Stands in for an optimizer while a manual-optimization step is traced: steps and zero_grad do nothing."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer, self.param_groups = optimizer, optimizer.param_groups

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        pass

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        return closure() if closure is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _manual_optimization_stand_ins(module: nn.Module, losses: list[Tensor]) -> dict[str, Any]:
    """``optimizers()``/``lr_schedulers()``/``manual_backward`` for tracing a manual-optimization step outside
    the loop: the step's losses are collected instead of back-propagated, and nothing is stepped."""
    optimizers, _ = init_optimizers_and_lr_schedulers(module)
    inert = [_InertOptimizer(o) for o in optimizers]
    return {
        "optimizers": lambda use_pl_optimizer=True: inert[0] if len(inert) == 1 else inert,
        "lr_schedulers": lambda: None,
        "manual_backward": lambda loss, *a, **k: losses.append(loss),
    }


@contextlib.contextmanager
def isolated(module: nn.Module, losses: Optional[list[Tensor]] = None) -> Iterator[None]:
    """Eval mode (a fitting step runner switches to training mode inside), saved RNG states and buffers, and
    silenced ``log``/``log_dict`` for a side-effect-free extra step.

    With ``losses`` and a LightningModule in manual optimization, the losses it back-propagates are collected there.
    """
    rng = collect_rng_states(include_cuda=torch.cuda.is_available())
    modes = [(m, m.training) for m in module.modules()]
    patches: dict[str, Any] = {name: (lambda *a, **k: None) for name in ("log", "log_dict") if hasattr(module, name)}
    if losses is not None and getattr(module, "automatic_optimization", True) is False:
        patches.update(_manual_optimization_stand_ins(module, losses))
    metrics = _metric_states(module)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]  # a train-mode step moves BatchNorm statistics
    module.eval()
    for name, fn in patches.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for metric, state in metrics:  # an extra step must not count in the user's metrics
            metric.__dict__.update(state)
        with torch.no_grad():
            for b, saved in buffers:
                if b.shape == saved.shape:
                    b.copy_(saved)
        for name in patches:
            delattr(module, name)
        for m, mode in modes:
            m.training = mode
        set_rng_states(rng)


def _metric_states(module: nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    """Snapshot of every torchmetrics Metric's accumulated state (tensors cloned, lists copied)."""
    from torchmetrics import Metric

    out = []
    for m in module.modules():
        if isinstance(m, Metric):
            keys = metric_state_keys(m)
            state = {k: m.__dict__.get(k) for k in keys if k in m.__dict__}
            out.append((m, {k: (v.clone() if isinstance(v, Tensor) else list(v) if isinstance(v, list) else v)
                            for k, v in state.items()}))
    return out


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
