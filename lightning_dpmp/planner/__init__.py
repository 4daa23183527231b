"""Planning a layout from one traced step, like torch's ``distributed.tensor.parallel``: torch only.

What lives here: the step recorder (``trace``), shardedness propagation over the record (``flow``; its rules in
``flow_values`` and ``flow_dims``), the per-layer plan and its printout (``plan``), sequence-parallel analysis
(``sequence``), applying a plan to a module and consolidating it back (``apply_plan``), and materialising
meta-device models shard by shard (``materialize``).

May import: torch and :mod:`lightning_dpmp.parallel`. Never Lightning or torchmetrics.
"""
