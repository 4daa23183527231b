"""Planning how a model is split from one traced step, like torch's ``distributed.tensor.parallel``: torch only.

Modules, one line each:

* ``trace``: record the data flow of one step (which Linear feeds which, through what ops).
* ``ops``: the op-name vocabulary of the analyses, by family.
* ``flow``: shardedness propagation over the record, where a column output may stay split.
* ``flow_state``: the state of one flow analysis (shards, regions), imported by the driver and its rules.
* ``flow_values``: flow rules for ops that compute values (element-wise, reductions, attention-like).
* ``flow_dims``: flow rules for ops that move dims (indexing, cat, reshapes, transposes, splits).
* ``structure``: what the model's structure says (aliases, shared weights, held head counts).
* ``linear_like``: layers that compute a Linear without being ``nn.Linear``.
* ``attention_plan``: how ``nn.MultiheadAttention`` modules are split, or why not.
* ``experts_detect``: find mixture-of-experts modules by what they compute.
* ``experts_ops``: the experts pass's op families and activation rules.
* ``experts_pass``: one walk over a candidate experts module's events.
* ``styles``: parallel styles as small classes (local shape, layer factory, collective cost).
* ``user_plan``: a user plan (``{glob: style}``) resolved to one style per layer.
* ``plan``: decide each layer's style from the recorded data flow (``make_plan``).
* ``plan_types``: the result of planning, ``LayerPlan`` and ``Plan``, with the printout.
* ``sequence``: sequence parallelism over the token-wise regions.
* ``apply_plan``: apply a plan to a module in place, and consolidate it back.
* ``materialize``: meta-device models allocated shard by shard.
* ``cost``: the cost of a traced model's plan at each (dp, mp) of a fixed world, and the measured links.
* ``stages``: pipeline stages from one traced step, where the block stack can and should be cut.
* ``gpt_shape``: the shape of a GPT-like decoder (the analytic cost model's and profile's sizes).
* ``profile``: reads a model's training step (saved activations, split and replicated parameters, FLOPs and MP
  collectives per block) from meta or real tensors: the estimator's input.
* ``estimate``: predicts per-rank peak memory and step time of every (dp, pp, mp, zero, ...) layout from a profile.
* ``layout_search``: the layouts a fixed world can take, ranked by the estimator: what ``"auto"`` sizes choose at
  setup, and the refusal of a given layout that will not fit.

May import: torch and :mod:`lightning_dpmp.parallel`. Never Lightning or torchmetrics.
"""
