"""Command-line tools: the layout cost model (``costmodel``, also ``python -m lightning_dpmp.costmodel``).

May import anything in the package; nothing in the package imports it.
"""
