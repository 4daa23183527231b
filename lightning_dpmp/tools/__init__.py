"""Command-line tools.

Modules, one line each:

* ``costmodel``: an analytic cost model for (dp, mp) layouts of a GPT-like transformer, and a recommendation.
* ``costmodel_cli``: its command line, run as ``python -m lightning_dpmp.costmodel``.

May import anything in the package; nothing in the package imports it.
"""
