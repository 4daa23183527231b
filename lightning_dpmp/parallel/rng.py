"""Dropout randomness across the MP group: different masks inside sharded regions, equal masks outside.

All ranks start from the same seed, so in replicated regions (residual dropout, embeddings) every MP rank draws
the same mask, as one process would. Inside a column -> row region each rank holds different features (heads,
hidden units); drawing "the same" random stream there would correlate the masks of different features. The
:class:`RNGTracker` swaps the default generator's state for an MP-rank-specific one while the forward pass is
inside such a region (entered by column layers, left by row layers), as Megatron's RNG tracker does on CUDA.
It uses plain ``torch.Generator`` state, so it works on CPU and CUDA alike.

Example:
    >>> import torch.nn.functional as F
    >>> h = torch.ones(4, 8)
    >>> tracker = RNGTracker(seed=1234, mp_rank=grid.mp_rank, device=torch.device("cpu"))
    >>> tracker.enter(); y = F.dropout(h, 0.1); tracker.exit()
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["RNGTracker"]

_OFFSET = 2718  # keeps the sharded stream apart from the replicated one for every mp_rank


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class RNGTracker:
    """Holds the sharded-region generator state of this rank; ``enter``/``exit`` are idempotent."""

    def __init__(self, seed: int, mp_rank: int, device: torch.device) -> None:
        self.device = device
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed) + _OFFSET + int(mp_rank))
        self._sharded_state: torch.Tensor = gen.get_state()
        self._saved: Optional[torch.Tensor] = None

    @property
    def inside(self) -> bool:
        return self._saved is not None

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

    def state_dict(self) -> dict[str, Any]:
        self.exit()
        return {"sharded_state": self._sharded_state.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.exit()
        self._sharded_state = state["sharded_state"].clone()
