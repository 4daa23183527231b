"""Command-line tools: the layout cost model (``costmodel``) and its command line (``costmodel_cli``, run as
``python -m lightning_dpmp.costmodel``); the layout estimator (``profile`` reads a model's step from meta tensors,
``estimate`` predicts memory and step time of every layout) and its command line (``plan_cli``, run as
``python -m lightning_dpmp.plan``).

May import anything in the package; nothing in the package imports it.
"""
