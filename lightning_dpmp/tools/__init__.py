"""Command-line tools.

Modules, one line each:

* ``costmodel``: an analytic cost model for (dp, mp) layouts of a GPT-like transformer, and a recommendation.
* ``costmodel_cli``: its command line, run as ``python -m lightning_dpmp.costmodel``.
* ``profile``: reads a model's training step from meta tensors (saved activations, split and replicated parameters,
  FLOPs and MP collectives per block), without allocating it.
* ``estimate``: predicts per-rank peak memory and step time of every (dp, pp, mp, zero, ...) layout from a profile.
* ``plan_cli``: the estimator's command line, run as ``python -m lightning_dpmp.plan``.
* ``mfu``: the ``MFUMonitor`` callback: tokens/s, model TFLOP/s per device and MFU while training.

May import ``parallel``, ``planner``, ``checkpoint`` and ``compat`` (and Lightning); ``integration`` imports it:
``DPMPStrategy(activation_checkpointing="auto")`` asks the estimator at setup.
"""
