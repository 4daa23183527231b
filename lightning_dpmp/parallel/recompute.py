"""Activation checkpointing of the repeated blocks: a block's activations are dropped after its forward and
recomputed from its input when the backward reaches it (torch's non-reentrant ``checkpoint``).

The blocks are the ZeRO engine's units (:func:`~lightning_dpmp.parallel.zero_engine.find_units`: the children of
``nn.ModuleList``/``nn.Sequential`` containers that own parameters), all of them or the first ``k`` of each pipeline
stage (:func:`first_blocks`). Each gets a checkpointed ``forward`` as an instance attribute over the class's, so the
module objects, parameter names and state-dict keys stay. It is applied after the MP split, so the recompute runs
the split layers, and it restores what torch's ``checkpoint`` does not restore by itself:

* dropout masks: torch replays the default generator; the MP-rank-specific stream of the split regions
  (:class:`~lightning_dpmp.parallel.rng.RNGTracker`) is replayed from where the block's first run started, and
  put back after (a pipeline runs other micro-batches' forwards in between);
* the parameters' local views (DTensor parameters, :mod:`~lightning_dpmp.parallel.dtensor_params`): the recompute
  runs in the backward, outside any module call, so it enters the block as the block's forward hooks would
  (``views``);
* the shared q/k/v entry (:class:`~lightning_dpmp.parallel.entry.SharedInputCopy`) is reset before and after each
  run, as a compiled block's is: otherwise it would keep one entered input per block alive until the backward.

The modes user code runs under (:class:`~lightning_dpmp.parallel.bridge.DTensorBridge`,
:class:`~lightning_dpmp.parallel.freed_reads.GatherOnRead`) are off during the recompute, although no
forward hook steps them aside there: every way into a backward (``Tensor.backward``, ``torch.autograd.backward`` and
``grad``, which Lightning, Fabric and torch's pipeline schedules call) is a torch function, which the innermost mode
intercepts and runs with the mode stack popped (measured on torch 2.13). So a block that reads its own parameter
outside a layer call (``x * self.scale``) recomputes on the values its forward read (held under a pipeline, with
DTensor parameters and at zero=3 by tests/distributed/test_recompute.py).

The block's own hooks run once, around its first run: ZeRO-3 gathers its parameters when the gradient reaches the
block's output, before autograd unpacks the first recomputed tensor, and frees them after their reduce-scatter, so
the recompute issues no gather. It re-issues the block's forward MP collectives (row all-reduces; the all-gathers
and reduce-scatters of sequence parallelism), every one of them: torch's early stop, which ends a recompute at the
last tensor the backward needs, is off, since it would leave a forward mid-region (the dropout stream switched, an
entry set) and make the count depend on the code's order.

Example:
    >>> from lightning_dpmp.parallel.zero_engine import find_units
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> checkpoint_blocks(find_units(net))
    ['0', '2']
    >>> net(torch.ones(2, 4, requires_grad=True)).sum().backward()   # each Linear recomputed once
    >>> uncheckpoint_blocks(net); checkpointed_blocks(net)
    []
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_dpmp.parallel.entry import shared_entries
from lightning_dpmp.parallel.rng import RNGTracker

__all__ = ["checkpoint_blocks", "checkpointed_blocks", "first_blocks", "uncheckpoint_blocks"]

_OWN = "_dpmp_recompute_own"  # module attribute: the instance forward it had before (None: the class's)

Views = Callable[[nn.Module], AbstractContextManager[Any]]


def first_blocks(blocks: Sequence[tuple[str, nn.Module]], k: int,
                 ranges: Optional[Sequence[tuple[int, int]]] = None) -> list[tuple[str, nn.Module]]:
    """The first ``k`` of ``blocks``, or of each ``[start, end)`` of ``ranges`` (a pipeline's stages), as
    Megatron's ``--recompute-method block`` picks them.

    Example:
        >>> blocks = [(str(i), nn.Linear(1, 1)) for i in range(6)]
        >>> [n for n, _ in first_blocks(blocks, 2)], [n for n, _ in first_blocks(blocks, 1, [(0, 3), (3, 6)])]
        (['0', '1'], ['0', '3'])
    """
    if k < 0:
        raise ValueError(f"the blocks to recompute must be counted from 0, got {k}")
    spans = list(ranges) if ranges is not None else [(0, len(blocks))]
    return [blocks[i] for start, end in spans for i in range(start, min(start + k, end))]


def checkpoint_blocks(blocks: Sequence[tuple[str, nn.Module]], rng: Optional[RNGTracker] = None,
                      views: Optional[Views] = None) -> list[str]:
    """Run each ``(name, block)``'s forward under activation checkpointing, in place; returns the names.

    ``rng``: the split regions' dropout stream (replayed by the recompute); ``views(block)``: a context in which the
    block's parameters are what its forward computes on (DTensor parameters' local views), entered around each run.
    """
    names = []
    for name, block in blocks:
        if _OWN in block.__dict__:
            raise ValueError(f"block {name!r} ({type(block).__name__}) is checkpointed already")
        block.__dict__[_OWN] = block.__dict__.get("forward")
        block.forward = _checkpointed(block, block.forward, rng, views)
        names.append(name)
    return names


def checkpointed_blocks(module: nn.Module) -> list[str]:
    """The names of ``module``'s submodules that :func:`checkpoint_blocks` wrapped."""
    return [name for name, m in module.named_modules() if _OWN in m.__dict__]


def uncheckpoint_blocks(module: nn.Module) -> None:
    """Undo :func:`checkpoint_blocks` on every submodule of ``module``: the forward each had before."""
    for mod in module.modules():
        if _OWN in mod.__dict__:
            own = mod.__dict__.pop(_OWN)
            if own is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = own


def _checkpointed(block: nn.Module, forward: Callable[..., Any], rng: Optional[RNGTracker],
                  views: Optional[Views]) -> Callable[..., Any]:
    entries = shared_entries(block)

    def reset() -> None:
        for entry in entries:
            entry.reset()

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # nothing to save (evaluation): the plain forward
        start = rng.snapshot() if rng is not None else None
        runs = [0]

        def body(*a: Any, **k: Any) -> Any:
            runs[0] += 1
            replay = rng.replaying(start) if rng is not None and start is not None and runs[0] > 1 else nullcontext()
            reset()
            try:
                with replay, views(block) if views is not None else nullcontext():
                    return forward(*a, **k)
            finally:
                reset()

        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True, early_stop=False, **kwargs)

    return run
