"""ZeRO under a pipeline: the engine's buckets divided by stage, behind the interface the stages call.

The pipeline (:mod:`lightning_dpmp.integration.pipeline`) and the ZeRO engine
(:mod:`lightning_dpmp.parallel.zero_engine`) know nothing of each other. The stages are cut first; the engine is
then built over the split module with the stages' keys as its ``apart`` (no bucket mixes parameters that different
stages read) and :func:`~lightning_dpmp.parallel.stage_runner.stood_in` as its ``skip`` (a block standing in for
another stage gathers nothing). :class:`StagedShards` is all the pipeline holds of ZeRO (its
:class:`~lightning_dpmp.integration.pipeline.DPShards`): it names this rank's stages' buckets and the others', and
turns the pipeline's verbs (free what the other stages train, bring it back, sync it, read one parameter) into the
engine's. Only :func:`~lightning_dpmp.integration.parallelize.parallelize` composes the two.

Example:
    >>> shards = StagedShards(engine, pipeline.ranks, pipeline.local, grid.pp)  # doctest: +SKIP
    >>> pipeline.attach_shards(shards)                                          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_dpmp.parallel.freed_reads import storage_freed
from lightning_dpmp.parallel.zero_engine import ZeroEngine

__all__ = ["StagedShards"]


class StagedShards:
    """The ZeRO engine's DP shards as a pipeline's stages use them.

    Args:
        engine: built with the pipeline's keys as ``apart``, so each bucket's parameters are read by the same stages.
        ranks: ``id(parameter) -> the PP ranks whose stages read it`` (the pipeline's).
        local: ``id()`` of the parameters this rank's stages read.
        pp: the PP group's size.

    Attributes:
        held: ``id()`` of the parameters the engine holds: their gradients, storage and sync go through here.
        owner: ``id(shard) -> the PP rank that owns it`` (the first that reads its parameters).
        synced: the shards a stage sync sends (of the parameters some stage does not read).
        shared: the trainable shards read on several stages (their gradients are summed over PP).
        local_shards: ``id()`` of the shards of this rank's stages; ``remote_shards``: the others'.
        grad_holders: where this rank's step leaves the gradients of the parameters held here.
        compute_dtype: the one compute dtype of a mixed-precision policy (the stages send activations in it).
    """

    def __init__(self, engine: ZeroEngine, ranks: Mapping[int, set[int]], local: set[int], pp: int) -> None:
        self.engine = engine
        buckets = engine.buckets
        # (a bucket's parameters are read by the same stages: its first one speaks for it)
        self._local = [b for b in buckets if id(b.params[0]) in local]
        self._remote = [b for b in buckets if id(b.params[0]) not in local]
        ranks_of = {id(b): ranks[id(b.params[0])] for b in buckets}
        self.held = frozenset(id(p) for b in buckets for p in b.params)
        self.owner = {id(b.shard): min(ranks_of[id(b)]) for b in buckets}
        self.synced: list[nn.Parameter] = [b.shard for b in buckets if len(ranks_of[id(b)]) < pp]
        self.shared: list[nn.Parameter] = [b.shard for b in buckets if b.trainable and len(ranks_of[id(b)]) > 1]
        self.local_shards = frozenset(id(b.shard) for b in self._local)
        self.remote_shards: list[nn.Parameter] = [b.shard for b in self._remote]
        self.grad_holders: list[nn.Parameter] = [b.shard for b in self._local if b.trainable]
        compute = {b.full.dtype for b in buckets if b.mixed}
        self.compute_dtype: Optional[torch.dtype] = compute.pop() if len(compute) == 1 else None

    # ------------------------------------------------------------------ the step
    def no_sync(self) -> AbstractContextManager[Any]:
        """The schedule's micro-batches keep their gradients local (zero=3 still reduce-scatters each one's)."""
        return self.engine.no_sync()

    def finish_backward(self) -> None:
        """After the schedule: reduce-scatter what this rank's buckets hold, once per step."""
        self.engine.finish_backward()

    # ------------------------------------------------------------------ the other stages' buckets
    def release(self) -> None:
        """While training: gather and reduce-scatter this rank's stages' buckets only; free the others'."""
        self.engine.set_active(self._local)
        self.engine.release_buckets(self._remote)

    def allocate(self) -> None:
        """The other stages' shards get their storage back, without values (a sync or a load fills them)."""
        self.engine.allocate_shards(self._remote)

    def restore(self, gather: bool) -> None:
        """Every bucket takes part again; zero=1/2 hold the others' whole again (``gather``: from their current
        shards, over DP; else only allocated)."""
        self.engine.restore_buckets(self._remote, gather)

    def released_bytes(self) -> int:
        """Bytes :meth:`release` frees beside the shards (zero=1/2's gathered buffers of the other stages)."""
        return self.engine.released_bytes(self._remote)

    def refresh(self) -> None:
        """After a sync wrote shards received from their owners: zero=1/2 gather them into the parameters."""
        if self.engine.level < 3:
            self.engine.refresh()

    # ------------------------------------------------------------------ reads
    def whole(self) -> AbstractContextManager[Any]:
        """Every parameter whole for the duration (zero=3 gathers every bucket and frees them after)."""
        return self.engine.gathered() if self.engine.level == 3 else nullcontext()

    def frees(self, param: Tensor) -> bool:
        """Whether ``param``'s storage is freed between uses (zero=3) now: a read gathers it."""
        return self.engine.level == 3 and storage_freed(param)

    def value_of(self, param: Tensor) -> Tensor:
        """A copy of ``param``'s current values (zero=3: its buckets gathered over DP for the read only)."""
        if self.frees(param):
            with self.engine.gathered([param]):
                return param.detach().clone()
        return param.detach().clone()

    def read_dtype(self, param: Tensor) -> torch.dtype:
        """The dtype ``param`` is read in: under a mixed-precision policy, its master values' (the shard's)."""
        found = self.engine.locate(param)
        return found[0].shard.dtype if found is not None and found[0].mixed else param.dtype
