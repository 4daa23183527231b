"""Checkpoints of parallelised models: consolidated model and optimizer state (``consolidated``), atomic files and
weights-only loading (``files``), the layout and RNG states stored with them (``rng_states``), sharded DCP folders
(``sharded``), and the sharded -> consolidated converter (``convert``, also ``python -m lightning_dpmp.convert``).

May import: torch, Lightning's public checkpoint I/O, :mod:`lightning_dpmp.parallel` and
:mod:`lightning_dpmp.planner`. Never :mod:`lightning_dpmp.integration`.
"""
