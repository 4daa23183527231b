"""Checkpoint tensors held by reference: what a rank holds of a tensor, and how the dense one is produced only
while the checkpoint is written.

Under ZeRO a rank holds a parameter (or an AdamW moment) as flat slices of its DP shards, not as a tensor; and
the dense tensor of a consolidated checkpoint exists on no rank until it is gathered. Gathering everything before
writing would hold the whole model, and the whole optimizer state, on every rank: exactly where ZeRO was needed.
So a checkpoint dict holds a **held tensor** in their place: a tensor on the ``meta`` device with the shape and
dtype it will have in the file, carrying a :class:`Held` that says

* which flat ranges ``[lo, hi)`` of the MP-local tensor this rank holds, and the 1-D tensors holding them (the
  sharded format writes, and loads into, exactly these: :mod:`lightning_dpmp.checkpoint.sharded`);
* how the dense tensor is fetched (a collective: ``fetch()`` returns it on the writing rank, ``None`` elsewhere)
  and which :class:`Gathered` it is fetched from (a bucket's shards all-gathered over DP once for all its members,
  and freed after them), for the consolidated format's streamed writer (:mod:`lightning_dpmp.checkpoint.streamed`).

A hook that reads ``checkpoint["state_dict"]`` sees tensors of the right shape and dtype; reading their values
raises, as any meta tensor does.

Example:
    >>> t = torch.arange(6.0).view(2, 3)
    >>> h = held(t.shape, t.dtype, Held(pieces=[(0, 6, t.view(-1))], fetch=lambda: t.clone()))
    >>> h.device.type, tuple(h.shape), held_of(h).fetch().sum().item()
    ('meta', (2, 3), 15.0)
    >>> flat_boxes((2, 3), 1, 5)          # [1, 5) of a 2x3 tensor: (offsets, sizes, flat start) per box
    [((0, 1), (1, 2), 1), ((1, 0), (1, 2), 3)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_dpmp.compat import tree_leaves, tree_map

__all__ = [
    "Gathered", "Held", "Piece", "collect_held", "fetch_in_order", "flat_boxes", "held", "held_of", "resolve_held",
]

_ATTR = "_dpmp_held"

#: ``(lo, hi, data)``: elements ``[lo, hi)`` of a row-major MP-local tensor, held as the 1-D tensor ``data``.
Piece = tuple[int, int, Tensor]


class Gathered:
    """A flat buffer gathered for a run of held tensors and freed after them (one bucket's DP shards).

    ``gather()`` returns the buffer (collective over the group it gathers on); :attr:`full` holds it between
    :meth:`open` and :meth:`close`, so each member's ``fetch`` reads its own slice of it.
    """

    def __init__(self, gather: Callable[[], Tensor]) -> None:
        self._gather = gather
        self.full: Optional[Tensor] = None

    def open(self) -> None:
        self.full = self._gather()

    def close(self) -> None:
        self.full = None


@dataclass
class Held:
    """What one rank holds of a checkpoint tensor, and how its dense form is produced (see the module docstring).

    Attributes:
        pieces: this rank's flat ranges of the MP-local tensor and the tensors holding them.
        fetch: produces the dense tensor on the writing rank (``None`` elsewhere); collective.
        gathered: opened before ``fetch`` runs, and shared by the other tensors of the same bucket.
        local_shape: the MP-local shape (the pieces' coordinates); the held tensor's own shape is the dense one.
    """

    pieces: list[Piece] = field(default_factory=list)
    fetch: Optional[Callable[[], Optional[Tensor]]] = None
    gathered: Optional[Gathered] = None
    local_shape: Optional[tuple[int, ...]] = None


def held(shape: Any, dtype: torch.dtype, info: Held) -> Tensor:
    """A meta tensor of ``shape`` and ``dtype`` standing for a tensor described by ``info``."""
    t = torch.empty(tuple(shape), dtype=dtype, device="meta")
    setattr(t, _ATTR, info)
    return t


def held_of(t: Any) -> Optional[Held]:
    """The :class:`Held` behind a held tensor, else ``None``."""
    return getattr(t, _ATTR, None) if isinstance(t, Tensor) else None


def collect_held(obj: Any) -> list[Tensor]:
    """Every held tensor inside ``obj`` (nested containers), each once, in traversal order: the same order on
    every rank that built the same checkpoint."""
    found: dict[int, Tensor] = {}  # (insertion-ordered: the first occurrence of each, by identity)
    for t in tree_leaves(obj):
        if held_of(t) is not None:
            found.setdefault(id(t), t)
    return list(found.values())


def fetch_in_order(tensors: list[Tensor], consume: Callable[[Tensor, Optional[Tensor]], None]) -> None:
    """Fetch every held tensor, each bucket's gathered once around its members (collective: call with the same
    list on every rank); ``consume(held tensor, dense or None)`` gets each as soon as it exists, and drops it."""
    runs: dict[int, tuple[Optional[Gathered], list[Tensor]]] = {}
    order: list[int] = []
    for t in tensors:
        g = held_of(t).gathered  # type: ignore[union-attr]
        key = id(g) if g is not None else -len(order) - 1
        if key not in runs:
            runs[key] = (g, [])
            order.append(key)
        runs[key][1].append(t)
    for key in order:
        g, members = runs[key]
        if g is not None:
            g.open()
        try:
            for t in members:
                fetch = held_of(t).fetch  # type: ignore[union-attr]
                consume(t, fetch() if fetch is not None else None)
        finally:
            if g is not None:
                g.close()


def resolve_held(obj: Any) -> Any:
    """``obj`` with every held tensor replaced by its fetched dense value (``None`` where this rank gets none).
    Collective; holds everything at once: for writers that need the whole checkpoint in memory (another
    ``CheckpointIO``, a remote path)."""
    values: dict[int, Optional[Tensor]] = {}
    fetch_in_order(collect_held(obj), lambda t, v: values.__setitem__(id(t), v))
    return tree_map(lambda x: values[id(x)] if held_of(x) is not None else x, obj)


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as rectangular boxes ``(offsets, sizes, flat
    start)``, at most ``2·ndim - 1`` of them; each box's elements are contiguous in the flat order."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), lo)]
    row = prod(shape[1:])
    if len(shape) == 1 or row == 0:
        return [((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]), lo)] if len(shape) == 1 else []
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    at = lo
    if at % row:  # the partial first row
        r, end = at // row, min(hi, (at // row + 1) * row)
        out += [((r, *o), (1, *s), r * row + f) for o, s, f in flat_boxes(shape[1:], at - r * row, end - r * row)]
        at = end
    whole = (hi - at) // row
    if whole:
        out.append(((at // row,) + (0,) * (len(shape) - 1), (whole, *shape[1:]), at))
        at += whole * row
    if at < hi:  # the partial last row
        r = at // row
        out += [((r, *o), (1, *s), r * row + f) for o, s, f in flat_boxes(shape[1:], 0, hi - r * row)]
    return out
