"""Metrics under DP x MP: the ranks of an MP group see the same batch, so state must sync over DP only.

Synced over the world, every sum, count and concatenated state would come out ``mp`` times too large (a
``SumMetric`` over 20 samples reads 40 at mp=2). torchmetrics lets a metric's ``process_group`` be set after
construction; :func:`route_metrics` points every metric of a module at the DP group, unless the user chose one.

Example:
    >>> route_metrics(lightning_module, grid.dp_group)   # doctest: +SKIP
    3
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["route_metrics"]


def route_metrics(module: nn.Module, group: Any) -> int:
    """Set ``process_group`` of every torchmetrics ``Metric`` in ``module`` that has none; returns how many."""
    from torchmetrics import Metric

    routed = 0
    for metric in module.modules():
        if isinstance(metric, Metric) and metric.process_group is None:
            metric.process_group = group
            routed += 1
    return routed
