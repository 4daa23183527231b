"""The (dp, mp) layout of a DPMPStrategy, resolved once when the Trainer has set devices and nodes.

The strategy's ``dp``/``mp`` properties read the :class:`Layout` resolved here, and the
:class:`~lightning_dpmp.parallel.grid.Grid` is built from it, so the sizes have one source of truth.

Example:
    >>> resolve_layout("auto", 2, devices=4, num_nodes=1)
    Layout(dp=2, mp=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Union

__all__ = ["DEFAULT_TIMEOUT", "Layout", "resolve_layout"]

#: The process-group timeout when ``DPMPStrategy(timeout=None)``: shorter than torch's 30 minutes, so a collective
#: that one rank never joins fails in minutes.
DEFAULT_TIMEOUT = timedelta(seconds=600)

Size = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class Layout:
    """Data-parallel replicas ``dp`` x tensor-parallel ranks ``mp`` (rank = dp_rank * mp + mp_rank)."""

    dp: int
    mp: int


def resolve_layout(dp: Size, mp: Size, devices: int, num_nodes: int) -> Layout:
    """Resolve ``"auto"`` sizes: one auto -> world // the other; both auto -> (nodes, devices per node), the rule
    ``DPMPStrategy(dp="auto", mp="auto")`` falls back to where it cannot choose by measurement at setup
    (:mod:`lightning_dpmp.integration.autolayout`: no batch to trace)."""
    world = devices * num_nodes
    if dp == "auto" and mp == "auto":
        return Layout(num_nodes, max(devices, 1))
    if mp == "auto":
        assert isinstance(dp, int)
        if world % dp:
            raise ValueError(
                f"DPMPStrategy(dp={dp}, mp='auto'): devices*num_nodes = {world} is not divisible by dp={dp}."
            )
        return Layout(dp, world // dp)
    if dp == "auto":
        assert isinstance(mp, int)
        if world % mp:
            raise ValueError(
                f"DPMPStrategy(dp='auto', mp={mp}): devices*num_nodes = {world} is not divisible by mp={mp}."
            )
        return Layout(world // mp, mp)
    return Layout(int(dp), int(mp))
