"""What DPMPStrategy changes in Lightning's optimizer step: global-norm clipping, fp16's ``found_inf``.

* ``clip_grad_by_norm``: Lightning clips through the precision plugin, which a strategy cannot subclass (the
  Trainer picks it from ``precision=``), so this public method is shadowed on the plugin *instance* and removed at
  teardown. It takes the norm of the dense gradient (shards' squares summed over MP, replicated parameters counted
  once), so every MP rank scales by the same factor, as one process would.
* ``16-mixed``: the GradScaler decides per rank whether a gradient overflowed, but each rank holds only its MP
  shard (and under ZeRO-2/3 its DP shard) of the gradients, so an inf in one rank's slice would make that rank alone
  skip its step and lower its scale, and the replicas would part. The scaler's ``unscale_`` is shadowed on the
  instance so that ``found_inf`` is all-reduced (MAX) over the world after each unscale, as Megatron agrees it
  over the model-parallel group: every rank skips or steps together and keeps one scale.

(The MP sum of partial gradients, once per optimizer step before clipping, is
:class:`~lightning_dpmp.integration.parallelize.Parallelized`'s: in the step's synchronised backward, or after the
closure.)

Example:
    >>> install(trainer.precision_plugin, split_params, grid.mp_group)                  # doctest: +SKIP
    >>> remove(trainer.precision_plugin)                                                 # doctest: +SKIP
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.optim import Optimizer

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.clipping import clip_grad_norm_

__all__ = ["agree_found_inf", "install", "remove"]


def install(plugin: Any, split_params: set[int], group: Any, dp_group: Any = None, pp_group: Any = None,
            counted: Optional[set[int]] = None,
            own_work: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
    """Shadow the plugin's ``clip_grad_by_norm`` on this instance with the global-norm clip; ``dp_group`` when
    the gradients are DP shards (ZeRO-2/3); ``pp_group`` and ``counted`` (the parameters this rank counts) with a
    pipeline. ``own_work``: the context the clip and the unscale run in, outside the modes user code runs under
    (under a pipeline a read of this rank's own gradient there would start a broadcast the other stages, which
    count their own, never join)."""

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        with own_work():
            clip_grad_norm_(list(plugin.main_params(optimizer)), float(clip_val), split_params, group, dp_group,
                            pp_group=pp_group, counted=counted)

    plugin.clip_grad_by_norm = clip_grad_by_norm
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and hasattr(scaler, "unscale_"):
        agree_found_inf(scaler, None, own_work)


def agree_found_inf(scaler: Any, group: Optional[Any],
                    own_work: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
    """Shadow ``scaler.unscale_`` on the instance: after unscaling, the optimizer's ``found_inf`` is the MAX over
    ``group`` (``None``: the world), in one all-reduce, so every rank skips or steps together; the unscale runs
    in ``own_work`` (see :func:`install`).

    Example:
        >>> scaler = torch.amp.GradScaler("cpu"); agree_found_inf(scaler, group)   # doctest: +SKIP
    """
    unscale = type(scaler).unscale_

    def unscale_(optimizer: Any) -> None:
        with own_work():
            unscale(scaler, optimizer)
        if not scaler.is_enabled():
            return
        found, device = compat.scaler_found_inf(scaler, optimizer)
        local = torch.zeros((), dtype=torch.float32, device=device)
        for v in found.values():
            local = torch.maximum(local, v.to(device))
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        # every device's entry (and one for a rank that holds no gradient) takes the agreed value
        agreed = {d: local.to(d) for d in found} or {device: local}
        found.clear()
        found.update(agreed)

    scaler.unscale_ = unscale_


def remove(plugin: Any) -> None:
    """Undo :func:`install` (no-op if nothing was installed)."""
    plugin.__dict__.pop("clip_grad_by_norm", None)
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        scaler.__dict__.pop("unscale_", None)
