"""Command-line tools.

Modules, one line each:

* ``costmodel``: an analytic cost model for (dp, mp) layouts of a GPT-like transformer, and a recommendation.
* ``costmodel_cli``: its command line, run as ``python -m lightning_dpmp.costmodel``.
* ``profile``: the public name of :mod:`lightning_dpmp.planner.profile` (moved there for the strategy's setup).
* ``estimate``: the public name of :mod:`lightning_dpmp.planner.estimate` (moved there for the strategy's setup).
* ``plan_cli``: the estimator's command line, run as ``python -m lightning_dpmp.plan``.
* ``mfu``: the ``MFUMonitor`` callback: tokens/s, model TFLOP/s per device and MFU while training.

May import anything in the package; nothing in the package imports it.
"""
