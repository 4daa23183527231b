"""Dropout randomness across the MP group: different masks inside sharded regions, equal masks outside.

All ranks start from the same seed, so in replicated regions (residual dropout, embeddings) every MP rank draws
the same mask, as one process would. Inside a column -> row region each rank holds different features (heads,
hidden units); drawing "the same" random stream there would correlate the masks of different features. The
:class:`RNGTracker` swaps the default generator's state for an MP-rank-specific one while the forward pass is
inside such a region (entered by column layers, left by row layers), as Megatron's RNG tracker does on CUDA.
It uses plain ``torch.Generator`` state, so it works on CPU and CUDA alike.

When the model has no active dropout (every rate 0, :func:`has_dropout`), the layers skip the switch altogether
(:meth:`RNGTracker.enter_for`): reading and writing generator state is a graph break under ``torch.compile``
and a cost in eager, for masks nobody draws. Likewise in eval mode, where dropout draws nothing.

Example:
    >>> import torch.nn.functional as F
    >>> h = torch.ones(4, 8)
    >>> tracker = RNGTracker(seed=1234, mp_rank=grid.mp_rank, device=torch.device("cpu"))
    >>> tracker.enter(); y = F.dropout(h, 0.1); tracker.exit()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn

import lightning_dpmp.compat as compat

__all__ = ["RNGTracker", "has_dropout"]

_OFFSET = 2718  # keeps the sharded stream apart from the replicated one for every mp_rank


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def has_dropout(module: nn.Module) -> bool:
    """Whether any dropout in ``module`` can draw a mask: a ``nn.Dropout*`` with ``p > 0``, or a numeric
    attribute whose name contains "drop" (``attention_dropout``, ``attn_pdrop``, ``nn.MultiheadAttention.dropout``:
    rates passed to functional dropout) above 0. Conservative: a rate it cannot read counts as active."""
    for mod in module.modules():
        if isinstance(mod, compat.DropoutNd):
            if mod.p > 0:
                return True
            continue
        for name, value in vars(mod).items():
            if "drop" in name.lower() and isinstance(value, (int, float)) and not isinstance(value, bool):
                if value > 0:
                    return True
    return False


class RNGTracker:
    """Holds the sharded-region generator state of this rank; ``enter``/``exit`` are idempotent.

    ``active`` (default True): whether the model has dropout to draw; set from :func:`has_dropout` at setup.
    """

    def __init__(self, seed: int, mp_rank: int, device: torch.device, active: bool = True) -> None:
        self.device = device
        self.active = active
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed) + _OFFSET + int(mp_rank))
        self._sharded_state: torch.Tensor = gen.get_state()
        self._saved: Optional[torch.Tensor] = None

    @property
    def inside(self) -> bool:
        return self._saved is not None

    def enter_for(self, training: bool) -> None:
        """A split region starts in a module in ``training`` mode: switch only if a mask can be drawn there."""
        if training and self.active:
            self.enter()

    def enter(self) -> None:
        """Switch the default generator to the sharded stream (no-op if already inside)."""
        if self._saved is None:
            gen = _default_generator(self.device)
            self._saved = gen.get_state()
            gen.set_state(self._sharded_state)

    def exit(self) -> None:
        """Switch back to the replicated stream, keeping the sharded one's progress (no-op if outside)."""
        if self._saved is not None:
            gen = _default_generator(self.device)
            self._sharded_state = gen.get_state()
            gen.set_state(self._saved)
            self._saved = None

    def snapshot(self) -> torch.Tensor:
        """The sharded stream's state now: where a recomputed forward (activation checkpointing) replays from."""
        return (_default_generator(self.device).get_state() if self.inside else self._sharded_state).clone()

    @contextmanager
    def replaying(self, state: torch.Tensor) -> Iterator[None]:
        """The sharded stream from ``state`` for the duration, then back where it was: a forward recomputed in the
        backward draws the masks its first run drew, and the forwards after it (a pipeline's next micro-batch)
        draw what they would have drawn without the recompute."""
        inside = self.inside
        self.exit()
        now, self._sharded_state = self._sharded_state, state.clone()
        try:
            yield
        finally:
            self.exit()
            self._sharded_state = now
            if inside:
                self.enter()

    def state_dict(self) -> dict[str, Any]:
        self.exit()
        return {"sharded_state": self._sharded_state.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.exit()
        self._sharded_state = state["sharded_state"].clone()
