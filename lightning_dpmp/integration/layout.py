"""The (dp, mp) layout of a DPMPStrategy, resolved once when the Trainer has set devices and nodes; and the
constructor's aliases (``plan``/``plan_overrides``, ``timeout``/``timeout_s``) resolved to one value each.

The strategy's ``dp``/``mp`` properties read the :class:`Layout` resolved here, and the
:class:`~lightning_dpmp.parallel.grid.Grid` is built from it, so the sizes have one source of truth.

Example:
    >>> resolve_layout("auto", 2, devices=4, num_nodes=1)
    Layout(dp=2, mp=2)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Optional, Union

__all__ = ["Layout", "resolve_aliases", "resolve_layout"]

DEFAULT_TIMEOUT_S = 600.0

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


def resolve_aliases(
    plan_overrides: Optional[Mapping[str, str]],
    plan: Optional[Mapping[str, str]],
    timeout_s: Optional[float],
    timeout: Optional[timedelta],
) -> tuple[Optional[Mapping[str, str]], float]:
    """The constructor's two spellings of the same thing, to one: ``plan`` (deprecated) is ``plan_overrides``;
    ``timeout`` (a ``timedelta``, as ``DDPStrategy`` takes it) is ``timeout_s``. Giving both of a pair raises;
    ``None`` means not given (LightningCLI passes every parameter)."""
    if plan is not None:
        if plan_overrides is not None:
            raise ValueError("Give `plan_overrides` only: `plan` is its deprecated alias.")
        warnings.warn("DPMPStrategy(plan=...) is deprecated; use plan_overrides=...", DeprecationWarning, stacklevel=3)
        plan_overrides = plan
    if timeout is not None and timeout_s is not None:
        raise ValueError(f"Give either `timeout` ({timeout!r}) or `timeout_s` ({timeout_s!r}), not both.")
    if timeout is not None:
        if not isinstance(timeout, timedelta):
            raise ValueError(f"`timeout` must be a datetime.timedelta, got {timeout!r}.")
        return plan_overrides, timeout.total_seconds()
    return plan_overrides, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
