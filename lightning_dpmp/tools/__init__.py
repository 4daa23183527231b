"""Command-line tools: the layout cost model (``costmodel``) and its command line (``costmodel_cli``, run as
``python -m lightning_dpmp.costmodel``).

May import anything in the package; nothing in the package imports it.
"""
