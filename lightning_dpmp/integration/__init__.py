"""The Lightning side: ``DPMPStrategy`` and what it delegates to.

Modules, one line each:

* ``strategy``: ``DPMPStrategy``, Lightning's lifecycle; the work is delegated.
* ``grid_strategy``: the strategy's topology resolved once, the DP-only sampler and the process groups.
* ``fabric``: DP x MP under Lightning Fabric (``FabricDPMPStrategy``).
* ``launcher``: the multirun-safe popen launcher, and a launched rank's end (dies with its launcher, closes gloo).
* ``validate``: the checks of the user's input, each at the first point its information exists.
* ``verify``: numerical verification of a plan: the dense first step against the parallel one.
* ``parallelize``: the setup pipeline from the dense module to the parallel one, in order, and its undoing.
* ``activations``: ``activation_checkpointing=``: which blocks recompute (all, or the fewest that fit), applied.
* ``autolayout``: ``dp="auto"``/``mp="auto"``, the (dp, mp) split chosen at setup.
* ``autoplan``: plan a LightningModule from one traced step, parallelise it, fall back until it verifies.
* ``stepdata``: the first batch of the current stage, a callable running its step, and its isolation.
* ``firststep``: the first step recorded once per setup (batch, dense trace, loss and gradients, stage probe).
* ``split``: splitting the model at setup and gathering it back at teardown.
* ``teardown``: what a run leaves at its end (the dense model gathered back, from ZeRO's shards too).
* ``pipeline``: the Lightning side of pipeline parallelism (stages planned at setup, the step by torch's schedule).
* ``zero``: ZeRO over the DP group through the ZeRO engine.
* ``staged_zero``: ZeRO under a pipeline: the engine's buckets divided by stage, behind the stages' interface.
* ``hooks``: the optimizer step's changes (global-norm clipping, sequence-parallel gradient sums).
* ``strategy_checkpoint``: the checkpoint collaborator, consolidated and sharded saves and loads.
* ``pretrained``: pretrained Hugging Face models built on meta, each rank reading only its slices.
* ``averaging``: weight-averaging callbacks (SWA, EMA) on the split model.
* ``data_path``: worker seeds by DP rank, loader lengths agreed, prediction writers once per DP rank.
* ``mp_batch``: one batch per MP group, the batch its first rank read.
* ``metrics``: metrics synced over DP only.
* ``guard``: the replica-consistency guard (one model and one batch per MP group).
* ``accounting``: the collectives a block of code issues, by operation and group.

May import: Lightning, torchmetrics, and every lower subpackage (``parallel``, ``planner``, ``checkpoint``,
``tools``).
"""
