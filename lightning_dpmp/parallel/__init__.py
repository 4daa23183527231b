"""Tensor-parallel primitives, like Megatron's ``tensor_parallel``: torch only.

What lives here: the 2-D process grid (``grid``), autograd collectives (``comm``), the layers' shared base and
sharding helpers (``sharding``), the column-region entry shared by sibling layers (``entry``), the Column/Row
parallel linears (``layers``) and embeddings (``embeddings``), head-parallel attention (``attention_layer``), experts'
shards (``experts_layer``), the vocab-parallel cross-entropy (``loss``), the MP dropout RNG tracker (``rng``) and
global-norm clipping (``clipping``).

May import: torch. Never Lightning, torchmetrics, or any other ``lightning_dpmp`` subpackage. Every process group
is passed in explicitly; nothing here holds module-level parallel state.
"""
