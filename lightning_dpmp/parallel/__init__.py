"""Tensor-parallel primitives, like Megatron's ``tensor_parallel``: torch only.

Modules, one line each:

* ``topology``: every parallel degree (dp, pp, mp), the pipeline settings and the ZeRO level, validated once.
* ``grid``: this rank's coordinates and the process groups of each axis, and the grid as one N-D ``DeviceMesh``.
* ``comm``: autograd-aware collectives over an explicit process group (copy, reduce, gather, scatter).
* ``sharding``: slicing dense tensors into shards and back, the split layers' shared base, which params are split.
* ``entry``: entering a column region (copy or sequence all-gather), shared by sibling column layers.
* ``layers``: Column/Row parallel drop-ins for ``nn.Linear``.
* ``embeddings``: tensor-parallel drop-ins for ``nn.Embedding``.
* ``attention_layer``: head-parallel ``nn.MultiheadAttention``.
* ``experts_layer``: an experts module run on 1/mp of each expert's FFN, its own code unchanged.
* ``fused``: the output of a fused projection with blocks of different sizes, read per rank.
* ``overlap``: a column layer's input-gradient all-reduce overlapped with its weight gradient.
* ``loss``: vocab-parallel cross-entropy over logits split by vocabulary.
* ``rng``: dropout randomness across the MP group.
* ``clipping``: gradient clipping by the global norm computed from shards.
* ``dtensor_params``: parameters as DTensors on the grid's mesh, what user code reads of the split model.
* ``bridge``: user code between DTensor parameters and plain tensors computes what one process computes.
* ``modes``: the ``TorchFunctionMode`` entered for user code and stepped aside from for the strategy's own.
* ``freed_reads``: user code reading a parameter whose storage is freed between uses (ZeRO-3) reads its values.
* ``compiled``: ``torch.compile`` of a parallelised model, block by block.
* ``recompute``: activation checkpointing of the repeated blocks, the recompute restoring dropout streams and views.
* ``stage_runner``: pipeline stages of an unchanged step function, run by torch's schedules.
* ``zero_shard``: ZeRO-2/3 flat-shard buffers, their DP slices and the optimizer over the slices.
* ``zero_engine``: ZeRO-1/2/3's schedule: when buckets reduce-scatter gradients and gather parameters.
* ``zero_grads``: ZeRO's sharded gradients as the parameters' ``.grad``, gathered over DP when user code reads them.
* ``staged_grads``: other pipeline stages' gradients as the parameters' ``.grad``, brought from their owner on read.

May import: torch. Never Lightning, torchmetrics, or any other ``lightning_dpmp`` subpackage. Every process group
is passed in explicitly; nothing here holds module-level parallel state.
"""
