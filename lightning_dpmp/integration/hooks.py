"""What DPMPStrategy changes in Lightning's precision plugin: global-norm clipping, sequence-parallel gradient sums.

Lightning clips gradients through the precision plugin, which a strategy cannot subclass (the Trainer picks it from
``precision=``). Two methods are shadowed on the plugin *instance* and removed again at teardown:

* ``clip_grad_by_norm``: the norm of the dense gradient (shards' squares summed over MP, replicated parameters
  counted once), so every MP rank scales by the same factor, as one process would;
* ``_after_closure`` (sequence parallelism only): first sum over MP the gradients of parameters that saw 1/mp of
  the tokens, once per optimizer step (after all accumulated micro-batches, before clipping), then Lightning's own.

Example:
    >>> install(trainer.precision_plugin, split_params, sequence_partial, grid.mp_group)   # doctest: +SKIP
    >>> remove(trainer.precision_plugin)                                                   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Union

from torch import nn
from torch.optim import Optimizer

from lightning_dpmp.parallel.clipping import clip_grad_norm_, sync_sequence_partial_grads

__all__ = ["install", "remove"]


def install(plugin: Any, split_params: set[int], sequence_partial: list[nn.Parameter], group: Any) -> None:
    """Shadow the plugin's clipping (and, with ``sequence_partial``, its after-closure step) on this instance."""
    after_closure = plugin._after_closure

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(list(plugin.main_params(optimizer)), float(clip_val), split_params, group)

    def sum_sequence_partial_then(model: Any, optimizer: Any) -> None:
        mine = {id(p) for p in plugin.main_params(optimizer)}
        sync_sequence_partial_grads([p for p in sequence_partial if id(p) in mine], group)
        after_closure(model, optimizer)

    plugin.clip_grad_by_norm = clip_grad_by_norm
    if sequence_partial:
        plugin._after_closure = sum_sequence_partial_then


def remove(plugin: Any) -> None:
    """Undo :func:`install` (no-op if nothing was installed)."""
    plugin.__dict__.pop("clip_grad_by_norm", None)
    plugin.__dict__.pop("_after_closure", None)
