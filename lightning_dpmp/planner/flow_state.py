"""The state of one flow analysis (:mod:`lightning_dpmp.planner.flow`): where a tensor is split (:class:`Shard`), the
regions of split tensors between source and sink layers (:class:`Region`), and what the rule mixins
(:mod:`~lightning_dpmp.planner.flow_dims`, :mod:`~lightning_dpmp.planner.flow_values`) read from the analysis that
mixes them in (:class:`AnalysisState`). Its own module so that the driver and the rules import it, not each other.

Example:
    >>> Region(sources={"fc1"}).derived(8), Shard(region=0, dim=-1, raw=None).dim
    (False, -1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from lightning_dpmp.parallel.sharding import Blocks
from lightning_dpmp.planner.trace import Trace

__all__ = ["AnalysisState", "Region", "Shard"]


@dataclass
class Shard:
    """A split tensor: the region it belongs to and the dim that carries the split."""

    region: int
    dim: int
    raw: Optional[str]  # source layer whose raw output layout this still is (fused blocks not yet decided)


@dataclass
class Region:
    """Split tensors connected between source (column-like) and sink (row-like) layers, and what was seen there."""

    sources: set[str]
    sinks: set[str] = field(default_factory=set)
    losses: int = 0
    conflicts: list[str] = field(default_factory=list)
    # (fixed size, module whose code passed it, its position among the sizes passed)
    literals: set[tuple[int, str, int]] = field(default_factory=set)
    simple: bool = True  # element-wise ops only (an MLP); False once heads/attention are involved
    attention: bool = False  # softmax, scaled_dot_product_attention or a matmul of two split activations
    queried: set[int] = field(default_factory=set)  # split-dim sizes the code read from split tensors
    scoped: set[tuple[str, int, bool]] = field(default_factory=set)  # (module, literal, derived?) sizing a constant
    params: set[str] = field(default_factory=set)  # replicated parameters read together with split tensors
    padded: bool = False  # a source's width is not divisible by mp: only a padded vocabulary (no sinks) may split

    def derived(self, value: int) -> bool:
        """Whether a reshape literal can come from a size the code read off a split tensor (``x.shape``): then
        it is per-rank at run time by itself (``reshape(B, n_kv * n_rep, T, d)`` in repeat-kv)."""
        return any(value == q or (q > 1 and value % q == 0) for q in self.queried)


class AnalysisState:
    """What the rule mixins read from the analysis that mixes them in (lightning_dpmp.planner.flow._Analysis)."""

    trace: Trace
    mp: int
    regions: list[Region]
    find: Callable[[int], int]
    need_blocks: Callable[[Shard, Blocks], bool]
    _shape: Callable[[Optional[int]], tuple]
