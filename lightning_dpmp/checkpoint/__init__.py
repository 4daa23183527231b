"""Checkpoints of parallelised models.

Modules, one line each:

* ``consolidated``: dense model and optimizer state under the dense names, gathered from and sliced into shards.
* ``held``: tensors held by reference (flat ZeRO slices or the tensor), fetched dense only while written.
* ``streamed``: a consolidated file written tensor by tensor in ``torch.save``'s format, atomically.
* ``sharded``: folders written in parallel with ``torch.distributed.checkpoint`` (DCP), read into any layout.
* ``files``: atomic writes and folder swaps, ``weights_only`` loading, rank 0 writing while others wait.
* ``integrity``: a truncated or corrupt file told apart from other load errors.
* ``rng_states``: the layout that wrote a checkpoint and every rank's RNG states.
* ``weights``: initial weights (safetensors, Lightning or torch files) read slice by slice into a split model.
* ``hf_export``: models out as Hugging Face safetensors plus config, one dense tensor at a time.
* ``convert``: sharded -> consolidated, or either -> Hugging Face (also ``python -m lightning_dpmp.convert``).

May import: torch, Lightning's public checkpoint I/O, :mod:`lightning_dpmp.parallel` and
:mod:`lightning_dpmp.planner`. Never :mod:`lightning_dpmp.integration`.
"""
