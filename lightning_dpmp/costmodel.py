"""``python -m lightning_dpmp.costmodel``: the public name of :mod:`lightning_dpmp.tools.costmodel`
(predicted step time, communication and memory per rank for every valid (dp, mp)) and of its command line
(:mod:`lightning_dpmp.tools.costmodel_cli`)."""

from lightning_dpmp.tools.costmodel import GPTShape, Hardware, Layout, predict, recommend, valid_layouts
from lightning_dpmp.tools.costmodel_cli import format_table, main

__all__ = ["GPTShape", "Hardware", "Layout", "format_table", "main", "predict", "recommend", "valid_layouts"]

if __name__ == "__main__":
    main()
