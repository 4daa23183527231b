"""The public name of :mod:`lightning_dpmp.planner.estimate` under ``tools`` (where it lived before the strategy's
setup-time layout search, in ``integration``, came to use it: ``integration`` may not import ``tools``)."""

from lightning_dpmp.planner.estimate import (
    DEVICES,
    PRECISIONS,
    Device,
    Estimate,
    LayoutSpec,
    estimate,
    fewest_recomputed,
    layouts,
    predict,
    recomputed_per_stage,
)

__all__ = ["DEVICES", "PRECISIONS", "Device", "Estimate", "LayoutSpec", "estimate", "fewest_recomputed", "layouts",
           "predict", "recomputed_per_stage"]
