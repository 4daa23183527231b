"""The checkpoint half of DPMPStrategy: consolidated and sharded saves, loads into any layout.

Consolidated (default): dense tensors under the dense names, gathered parameter by parameter onto rank 0, which
writes one file atomically (:mod:`lightning_dpmp.checkpoint.consolidated`). Sharded: every rank writes its own shards into a
folder (:mod:`lightning_dpmp.checkpoint.sharded`). Both load after setup, into the parallelised model, so each rank reads only
its slices. Kept apart from :mod:`lightning_dpmp.integration.strategy` so that each file reads as one concern.

Example:
    >>> trainer.save_checkpoint("last.ckpt")                  # collective; rank 0 writes  # doctest: +SKIP
    >>> trainer.fit(model, ckpt_path="last.ckpt")             # any (dp, mp)                # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dpmp.checkpoint.consolidated import (
    check_state_matches,
    consolidate_optimizer_state,
    dense_shapes,
    gather_state_dict,
    optimizer_param_blocks,
    optimizer_param_dims,
    shard_optimizer_state,
    shard_state_dict,
)
from lightning_dpmp.checkpoint.files import (
    atomic_save,
    load_file,
    make_weights_only_safe,
    recover_path,
    write_on_rank_zero,
)
from lightning_dpmp.checkpoint.integrity import load_checked
from lightning_dpmp.checkpoint.rng_states import layout_info, restore_rng_from
from lightning_dpmp.parallel.sharding import shard_blocks, shard_dims
from lightning_dpmp.integration.zero import is_zero, zero_state_dict

__all__ = ["CheckpointMixin"]

_TRACKER_KEY = "dpmp_rng_tracker"  # per-MP-rank dropout streams of the sharded regions (lightning_dpmp.parallel.rng)


class CheckpointMixin(DDPStrategy):
    """Checkpoint hooks of :class:`~lightning_dpmp.integration.strategy.DPMPStrategy` (uses its grid, sizes and options)."""

    _grid: Any
    _save_distributed_checkpoint: bool
    _rng: Any

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        dims = shard_dims(self.lightning_module)
        if self._grid is None or not dims or self._save_distributed_checkpoint or self.grid.dp_rank != 0:
            return state  # local shards: sharded saves write them as they are, and DP ranks > 0 do not write
        return gather_state_dict(state, dims, self.grid.mp_group, shard_blocks(self.lightning_module))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if is_zero(optimizer) and self._grid is not None:
            # ZeRO-1: the DP group's first rank gathers the partitions; each such rank holds its MP shard's state
            state = zero_state_dict(optimizer, keep=self.grid.dp_rank == 0)
        else:
            state = super().optimizer_state(optimizer)
        if self._grid is None or self.mp == 1 or self._save_distributed_checkpoint or self.grid.dp_rank != 0:
            return state
        inner = getattr(optimizer, "_optimizer", optimizer)
        lm = self.lightning_module
        return consolidate_optimizer_state(
            state, optimizer_param_dims(inner, lm), self.grid.mp_group, optimizer_param_blocks(inner, lm)
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` atomically: one file from rank 0, or a folder from all ranks (collective)."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        from lightning_dpmp.checkpoint.sharded import save_sharded

        path = str(self.broadcast(str(filepath)))
        checkpoint["dpmp"] = layout_info(self.dp, self.mp, self.root_device)
        if self._rng is not None and self._grid is not None:
            states: list[Any] = [None] * self.mp
            dist.all_gather_object(states, self._rng.state_dict()["sharded_state"], group=self.grid.mp_group)
            checkpoint[_TRACKER_KEY] = states
        make_weights_only_safe(checkpoint)
        if self._save_distributed_checkpoint:
            if storage_options is not None:
                raise TypeError("DPMPStrategy(save_distributed_checkpoint=True) does not take `storage_options`.")
            checkpoint["dpmp"]["format"] = "sharded"
            assert self.lightning_module is not None
            save_sharded(checkpoint, path, self.lightning_module, self.optimizers, self._grid, self.root_device.type)
            return
        if "://" in path or type(self.checkpoint_io) is not TorchCheckpointIO:
            write = lambda: self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)  # noqa: E731
        else:
            write = lambda: atomic_save(checkpoint, path)  # noqa: E731
        # The others wait for rank 0 with a long timeout of their own, not at a barrier bound by `timeout_s`.
        write_on_rank_zero(write, max(self._timeout, timedelta(hours=1)))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a consolidated file (``weights_only=True``, memory-mapped) or this rank's slices of a sharded folder."""
        from lightning_dpmp.checkpoint.sharded import is_sharded_checkpoint, load_sharded

        if weights_only is False:
            rank_zero_warn("DPMPStrategy always loads checkpoints with weights_only=True; `weights_only=False` is ignored.")
        path = str(self.broadcast(str(checkpoint_path)))
        found = recover_path(path)
        if found != path:
            rank_zero_warn(f"{path} is missing (a save was interrupted while swapping it); loading the previous one, {found}.")
        lm = self.lightning_module
        assert lm is not None
        if is_sharded_checkpoint(found):
            return load_sharded(found, lm, self.optimizers, self.grid, lm.strict_loading, self.root_device.type)
        if "://" in found or not os.path.exists(found):
            return self.checkpoint_io.load_checkpoint(found, weights_only=True)
        return load_checked(found, load_file)  # a truncated file: named, and said to be incomplete

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = str(filepath)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        from lightning_dpmp.checkpoint.sharded import LOCAL_LAYOUT_KEY

        lm = self.lightning_module
        assert lm is not None
        state = checkpoint["state_dict"]
        if self._grid is not None and not checkpoint.get(LOCAL_LAYOUT_KEY):
            found = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)}
            check_state_matches(dense_shapes(lm, self.grid.mp_group), found, strict)  # names the first difference
            if shard_dims(lm):
                state = shard_state_dict(state, shard_dims(lm), self.grid.mp_group, shard_blocks(lm))
        lm.load_state_dict(state, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        from lightning_dpmp.checkpoint.sharded import LOCAL_LAYOUT_KEY

        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if self._grid is not None and self.mp > 1 and not checkpoint.get(LOCAL_LAYOUT_KEY):
                lm = self.lightning_module
                state = shard_optimizer_state(
                    state, optimizer_param_dims(optimizer, lm), self.grid.mp_group, optimizer_param_blocks(optimizer, lm)
                )
            optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, self.root_device)
        # Called last before the fit loop runs: the RNG streams continue where the saving run left them.
        restore_rng_from(checkpoint, self.dp, self.mp, self.global_rank, self.root_device)
        tracker = checkpoint.get(_TRACKER_KEY)
        if self._rng is not None and tracker is not None and len(tracker) == self.mp:
            self._rng.load_state_dict({"sharded_state": tracker[self.mp_rank]})  # else: fresh streams for a new mp
