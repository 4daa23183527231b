"""Metrics under DP x MP: the ranks of an MP group see the same batch, so state must sync over DP only.

Synced over the world, every sum, count and concatenated state would come out ``mp`` times too large (a
``SumMetric`` over 20 samples reads 40 at mp=2). torchmetrics lets a metric's ``process_group`` be set after
construction; :func:`route_metrics` points every metric of a module at the DP group, unless the user chose one.

Under pipeline parallelism an evaluation step's metrics are updated on the last stage only:
:class:`MetricUpdates` takes what a step added to them there and gives it to the other stages' copies, so that every
rank's metric (and what ``compute`` syncs over DP) is one process's.

Example:
    >>> route_metrics(lightning_module, grid.dp_group)   # doctest: +SKIP
    3
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

import lightning_dpmp.compat as compat

__all__ = ["MetricUpdates", "route_metrics", "shapes_only"]


def route_metrics(module: nn.Module, group: Any) -> int:
    """Set ``process_group`` of every torchmetrics ``Metric`` in ``module`` that has none; returns how many."""
    from torchmetrics import Metric

    routed = 0
    for metric in module.modules():
        if isinstance(metric, Metric) and metric.process_group is None:
            metric.process_group = group
            routed += 1
    return routed


class MetricUpdates:
    """What one step adds to the torchmetrics ``Metric`` objects of a module: taken where the step ran
    (:meth:`taken`, on CPU tensors, picklable) and given to the same metrics elsewhere (:meth:`give`).

    A state that ``add_state`` registered as a tensor travels whole (a running sum, a count: small), a list state
    only its new elements (``cat`` states grow with the data: sending them whole every step would cost the square),
    with ``_update_count`` and the forward's batch value; the cached ``compute`` is dropped.

    Example:
        >>> seen = MetricUpdates(module)           # before the step, on every rank    # doctest: +SKIP
        >>> delta = seen.taken()                   # after it, where it ran            # doctest: +SKIP
        >>> MetricUpdates(module).give(delta)      # on the other ranks                # doctest: +SKIP
    """

    def __init__(self, module: nn.Module) -> None:
        from torchmetrics import Metric

        self.metrics = {name: m for name, m in module.named_modules() if isinstance(m, Metric)}
        self.before = {name: (m.__dict__["_update_count"], self._lengths(m)) for name, m in self.metrics.items()}

    @staticmethod
    def _lengths(metric: nn.Module) -> dict[str, int]:
        return {k: len(v) for k, v in ((k, metric.__dict__.get(k)) for k in compat.metric_state_keys(metric))
                if isinstance(v, list)}

    def taken(self) -> dict[str, dict[str, Any]]:
        """``{metric name: {state: value}}`` of the metrics the step updated since construction."""
        out: dict[str, dict[str, Any]] = {}
        for name, m in self.metrics.items():
            count, lengths = self.before[name]
            if m.__dict__["_update_count"] == count:
                continue
            delta: dict[str, Any] = {}
            for key in compat.metric_state_keys(m):
                if key == "_computed":
                    continue
                value = m.__dict__.get(key)
                if isinstance(value, list):
                    delta[key] = ("append", [_cpu(v) for v in value[lengths.get(key, 0):]])
                else:
                    delta[key] = ("set", _cpu(value))
            out[name] = delta
        return out

    def give(self, taken: dict[str, dict[str, Any]]) -> None:
        """Apply :meth:`taken` of another rank to this rank's metrics of the same names."""
        for name, delta in taken.items():
            m = self.metrics[name]
            device = m.device
            for key, (how, value) in delta.items():
                if how == "append":
                    m.__dict__[key].extend(_to(v, device) for v in value)
                else:
                    m.__dict__[key] = _to(value, device)
            m.__dict__["_computed"] = None


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _to(value: Any, device: Any) -> Any:
    return value.to(device) if isinstance(value, Tensor) else value


@contextmanager
def shapes_only(module: nn.Module) -> Iterator[None]:
    """While a step runs on meta tensors (a probe of a model built on the meta device): every torchmetrics
    ``Metric`` of ``module`` updates nothing, and its forward returns a meta scalar (their input checks read values,
    which meta tensors have none of).

    Example:
        >>> with shapes_only(lightning_module):      # doctest: +SKIP
        ...     lightning_module.validation_step(meta_batch, 0)
    """
    from torchmetrics import Metric

    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    names = ("update", "forward")
    # (torchmetrics keeps its wrapped update as an instance attribute: what was there is put back)
    saved = [{k: vars(m)[k] for k in names if k in vars(m)} for m in metrics]
    for m in metrics:
        vars(m).update(update=lambda *a, **k: None, forward=lambda *a, **k: torch.zeros((), device="meta"))
    try:
        yield
    finally:
        for m, own in zip(metrics, saved):
            for name in names:
                vars(m).pop(name, None)
            vars(m).update(own)
