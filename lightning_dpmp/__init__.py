"""lightning-dpmp: data parallel x tensor model parallel training for PyTorch Lightning, with no plan to write.

Example:
    >>> import lightning as L
    >>> from lightning_dpmp import DPMPStrategy
    >>> trainer = L.Trainer(accelerator="cpu", devices=4, strategy=DPMPStrategy(dp=2, mp=2))  # doctest: +SKIP

Importing the package registers the strategy names ``"dpmp"`` and ``"dpmp_spawn"`` with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dpmp.integration.accounting import CommAccounting, CommCounter
from lightning_dpmp.integration.autoplan import PlanFallbackWarning, UnverifiedPlanWarning
from lightning_dpmp.integration.data_path import UnevenBatchesError
from lightning_dpmp.integration.fabric import FabricDPMPStrategy
from lightning_dpmp.integration.mp_batch import BatchMismatchError
from lightning_dpmp.integration.pretrained import from_pretrained, load_weights
from lightning_dpmp.integration.strategy import DPMPStrategy
from lightning_dpmp.integration.verify import PlanVerificationError
from lightning_dpmp.parallel.clipping import clip_grad_norm_
from lightning_dpmp.parallel.comm import copy_to_group, gather_from_group, reduce_from_group, scatter_to_group
from lightning_dpmp.parallel.embeddings import VocabParallelEmbedding
from lightning_dpmp.parallel.entry import SharedInputCopy
from lightning_dpmp.parallel.grid import Grid, build_grid
from lightning_dpmp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_dpmp.parallel.loss import VocabShardedLogits, vocab_parallel_cross_entropy
from lightning_dpmp.planner.apply_plan import apply_plan, consolidate, consolidated_state_dict
from lightning_dpmp.planner.plan import LayerPlan, Plan, make_plan
from lightning_dpmp.planner.trace import trace_step

__version__ = "0.1.0"

__all__ = [
    "BatchMismatchError",
    "ColumnParallelLinear",
    "CommAccounting",
    "CommCounter",
    "DPMPStrategy",
    "FabricDPMPStrategy",
    "Grid",
    "LayerPlan",
    "Plan",
    "PlanFallbackWarning",
    "PlanVerificationError",
    "RowParallelLinear",
    "SharedInputCopy",
    "UnevenBatchesError",
    "UnverifiedPlanWarning",
    "VocabParallelEmbedding",
    "VocabShardedLogits",
    "apply_plan",
    "build_grid",
    "clip_grad_norm_",
    "consolidate",
    "consolidated_state_dict",
    "copy_to_group",
    "from_pretrained",
    "gather_from_group",
    "load_weights",
    "make_plan",
    "reduce_from_group",
    "scatter_to_group",
    "trace_step",
    "vocab_parallel_cross_entropy",
]

DPMPStrategy.register_strategies(StrategyRegistry)
