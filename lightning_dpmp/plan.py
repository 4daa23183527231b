"""``python -m lightning_dpmp.plan``: every layout of a model on a cluster ranked by predicted throughput before
launch, with per-rank peak memory (:mod:`lightning_dpmp.tools.plan_cli`; the estimator is
:mod:`lightning_dpmp.tools.estimate`, the model's profile :mod:`lightning_dpmp.tools.profile`), and
:class:`~lightning_dpmp.tools.mfu.MFUMonitor` to measure throughput and MFU while training."""

import sys

from lightning_dpmp.tools.estimate import DEVICES, PRECISIONS, Estimate, LayoutSpec, estimate, layouts, predict
from lightning_dpmp.tools.mfu import MFUMonitor
from lightning_dpmp.tools.plan_cli import main
from lightning_dpmp.tools.profile import ModelProfile, profile_config, profile_step

__all__ = ["DEVICES", "PRECISIONS", "Estimate", "LayoutSpec", "MFUMonitor", "ModelProfile", "estimate", "layouts",
           "main", "predict", "profile_config", "profile_step"]

if __name__ == "__main__":
    sys.exit(main())
