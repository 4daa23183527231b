"""DPMPStrategy's checkpoint collaborator: consolidated and sharded saves, loads into any layout.

Consolidated (default): dense tensors under the dense names, gathered parameter by parameter onto rank 0, which
writes one file atomically (:mod:`lightning_dpmp.checkpoint.consolidated`). Sharded: every rank writes its own
shards into a folder (:mod:`lightning_dpmp.checkpoint.sharded`). Both load after setup, into the parallelised model,
so each rank reads only its slices. The strategy owns one :class:`StrategyCheckpointer` and delegates its checkpoint
hooks to it.

ZeRO-2/3: every hook sees the model as it is without ZeRO (:meth:`StrategyCheckpointer._plain`): parameters
gathered over DP into the MP-local ones, and a plain optimizer over them holding the per-parameter state gathered
from the shards; a load goes into that plain view, then back into the shards. Both formats therefore resume into
any (dp, mp, zero).

Example:
    >>> trainer.save_checkpoint("last.ckpt")                  # collective; rank 0 writes  # doctest: +SKIP
    >>> trainer.fit(model, ckpt_path="last.ckpt")             # any (dp, mp)                # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

import lightning_dpmp.compat as compat
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
from lightning_dpmp.checkpoint.hf_export import (
    TensorEntry,
    floating_dtype,
    state_entries,
    write_config,
    write_streamed,
)
from lightning_dpmp.checkpoint.integrity import load_checked
from lightning_dpmp.checkpoint.rng_states import layout_info, restore_rng_from
from lightning_dpmp.parallel.sharding import gather_to_first, shard_blocks, shard_dims

__all__ = ["StrategyCheckpointer"]

_TRACKER_KEY = "dpmp_rng_tracker"  # per-MP-rank dropout streams of the sharded regions (lightning_dpmp.parallel.rng)


class StrategyCheckpointer:
    """The checkpoint hooks of :class:`~lightning_dpmp.integration.strategy.DPMPStrategy`, owned by it.

    Args:
        strategy: the owning strategy; read for its grid (``None`` before ``setup_environment``), layout, devices,
            module, optimizers and RNG tracker, and used for ``broadcast`` and its ``checkpoint_io``.
        distributed: write a folder of shards (``save_distributed_checkpoint=True``) instead of one file.
    """

    def __init__(self, strategy: Any, distributed: bool) -> None:
        # Any, not DPMPStrategy: the strategy module imports this one, and a typing import back would close a circle.
        self.strategy = strategy
        self.distributed = distributed

    def gathers(self) -> bool:
        """Whether this rank gathers MP shards into dense tensors: consolidated saves, on each MP group of DP rank 0."""
        grid = self.strategy.grid_or_none
        return grid is not None and not self.distributed and grid.dp_rank == 0

    def _engine(self) -> Any:
        return getattr(self.strategy, "zero_engine", None)

    def _plain(self, optimizer: Any, with_state: bool) -> Any:
        """``optimizer`` as without ZeRO-2/3 (a plain optimizer over the module's parameters; collective over DP
        ``with_state``), or ``optimizer`` itself when it is not a ZeRO-2/3 one."""
        engine, inner = self._engine(), compat.unwrap_optimizer(optimizer)
        if engine is None or not any(inner is o for o in engine.optimizers):
            return optimizer
        return engine.plain_optimizer(next(i for i, o in enumerate(engine.optimizers) if o is inner), with_state)

    def module_state_dict(self) -> dict[str, Any]:
        """The module's state: dense on the ranks that write a consolidated file, local shards elsewhere."""
        lm = self.strategy.lightning_module
        assert lm is not None
        engine = self._engine()
        if engine is not None:
            with engine.gathered():  # zero=3: freed again after, so keep copies
                state = {k: v.clone() if isinstance(v, Tensor) else v for k, v in lm.state_dict().items()}
        else:
            state = lm.state_dict()
        dims = shard_dims(lm)
        if not dims or not self.gathers():
            return state  # local shards: sharded saves write them as they are, and DP ranks > 0 do not write
        return gather_state_dict(state, dims, self.strategy.grid.mp_group, shard_blocks(lm))

    def optimizer_state(self, optimizer: Optimizer, default: Callable[[Optimizer], dict[str, Any]]) -> dict[str, Any]:
        """The optimizer's state (``default``: Lightning's), consolidated to dense shapes where :meth:`gathers`."""
        optimizer = self._plain(optimizer, with_state=True)
        state = default(optimizer)
        if not self.gathers() or self.strategy.mp == 1:
            return state
        inner = compat.unwrap_optimizer(optimizer)
        lm = self.strategy.lightning_module
        return consolidate_optimizer_state(
            state, optimizer_param_dims(inner, lm), self.strategy.grid.mp_group, optimizer_param_blocks(inner, lm)
        )

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` atomically: one file from rank 0, or a folder from all ranks (collective)."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        from lightning_dpmp.checkpoint.sharded import save_sharded

        st = self.strategy
        path = str(st.broadcast(str(filepath)))
        checkpoint["dpmp"] = layout_info(st.dp, st.mp, st.root_device)
        if st.rng_tracker is not None and st.grid_or_none is not None:
            states: list[Any] = [None] * st.mp
            dist.all_gather_object(states, st.rng_tracker.state_dict()["sharded_state"], group=st.grid.mp_group)
            checkpoint[_TRACKER_KEY] = states
        make_weights_only_safe(checkpoint)
        if self.distributed:
            if storage_options is not None:
                raise TypeError("DPMPStrategy(save_distributed_checkpoint=True) does not take `storage_options`.")
            checkpoint["dpmp"]["format"] = "sharded"
            assert st.lightning_module is not None
            optimizers = [self._plain(o, with_state=False) for o in st.optimizers]  # for the parameter names
            save_sharded(checkpoint, path, st.lightning_module, optimizers, st.grid_or_none, st.root_device.type)
            return
        if "://" in path or type(st.checkpoint_io) is not TorchCheckpointIO:
            write = lambda: st.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)  # noqa: E731
        else:
            write = lambda: atomic_save(checkpoint, path)  # noqa: E731
        # The others wait for rank 0 with a long timeout of their own, not at a barrier bound by `timeout`.
        write_on_rank_zero(write, max(st.timeout, timedelta(hours=1)))

    def load(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a consolidated file (``weights_only=True``, memory-mapped) or this rank's slices of a sharded folder."""
        from lightning_dpmp.checkpoint.sharded import is_sharded_checkpoint, load_sharded

        st = self.strategy
        if weights_only is False:
            rank_zero_warn(
                "DPMPStrategy always loads checkpoints with weights_only=True; `weights_only=False` is ignored."
            )
        path = str(st.broadcast(str(checkpoint_path)))
        found = recover_path(path)
        if found != path:
            rank_zero_warn(
                f"{path} is missing (a save was interrupted while swapping it); loading the previous one, {found}."
            )
        lm = st.lightning_module
        assert lm is not None
        if is_sharded_checkpoint(found):
            optimizers = [self._plain(o, with_state=False) for o in st.optimizers]  # for the parameter names
            return load_sharded(found, lm, optimizers, st.grid, lm.strict_loading, st.root_device.type)
        if "://" in found or not os.path.exists(found):
            return st.checkpoint_io.load_checkpoint(found, weights_only=True)
        return load_checked(found, load_file)  # a truncated file: named, and said to be incomplete

    def save_pretrained(self, module: Any, out_dir: str, max_shard_size: Any = "5GB") -> dict[str, int]:
        """Write ``module`` (a submodule of the trained model, e.g. the transformers model in ``self.net``) as a
        Hugging Face folder: safetensors under its own names plus its config (collective over the world).

        Each split tensor is gathered onto global rank 0 over DP row 0's MP group, written, and freed before the
        next one, so no rank ever holds more than its shards and one dense tensor; rank 0 writes, the others
        return once the folder is complete.
        """
        st = self.strategy
        grid = st.grid_or_none
        engine = self._engine()
        gathered = engine.gathered() if engine is not None else contextlib.nullcontext()
        with gathered:  # zero=3: the MP-local parameters exist only inside
            state = module.state_dict(keep_vars=True)  # tied weights are one object: written once
            dims, blocks = shard_dims(module), shard_blocks(module)  # empty unless split, hence a grid
            mp_group = grid.mp_group if grid is not None else None
            entries = state_entries(state, dense_shapes(module, mp_group))

            def fetch(e: TensorEntry) -> Optional[Tensor]:
                if e.name in dims:
                    return gather_to_first(state[e.name], mp_group, dims[e.name], blocks.get(e.name, 1))
                return state[e.name].detach() if st.is_global_zero else None

            summary = {"files": 0, "tensors": len(entries), "bytes": 0}
            if grid is None or grid.dp_rank == 0:  # the MP group rank 0 gathers from
                summary = write_streamed(out_dir, entries, fetch, max_shard_size, write=st.is_global_zero)
        config, generation = getattr(module, "config", None), getattr(module, "generation_config", None)
        dtype = floating_dtype(p.dtype for p in module.parameters())
        finish = lambda: write_config(out_dir, config, dtype, [generation])  # noqa: E731
        write_on_rank_zero(finish, max(st.timeout, timedelta(hours=1)))  # the others wait for the folder
        return summary

    def remove(self, filepath: Any) -> None:
        """Delete a checkpoint file or sharded folder (rank 0)."""
        if self.strategy.is_global_zero:
            path = str(filepath)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                self.strategy.checkpoint_io.remove_checkpoint(filepath)

    def load_module_state(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a dense (any layout) or local-layout state dict into the parallelised module."""
        from lightning_dpmp.checkpoint.sharded import LOCAL_LAYOUT_KEY

        st = self.strategy
        lm = st.lightning_module
        assert lm is not None
        state = checkpoint["state_dict"]
        if st.grid_or_none is not None and not checkpoint.get(LOCAL_LAYOUT_KEY):
            found = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)}
            check_state_matches(dense_shapes(lm, st.grid.mp_group), found, strict)  # names the first difference
            if shard_dims(lm):
                state = shard_state_dict(state, shard_dims(lm), st.grid.mp_group, shard_blocks(lm))
        engine = self._engine()
        if engine is None:
            lm.load_state_dict(state, strict=strict)
            return
        with engine.gathered(write_back=True):  # zero=2/3: into the parameters, then into the DP shards
            lm.load_state_dict(state, strict=strict)

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Load the optimizer states (sharded to this rank's slices), then the RNG streams."""
        from lightning_dpmp.checkpoint.sharded import LOCAL_LAYOUT_KEY

        st = self.strategy
        for original, state in zip(st.optimizers, checkpoint["optimizer_states"]):
            optimizer = self._plain(original, with_state=False)  # zero=2/3: loaded as without ZeRO, then sharded
            if st.grid_or_none is not None and st.mp > 1 and not checkpoint.get(LOCAL_LAYOUT_KEY):
                lm = st.lightning_module
                state = shard_optimizer_state(
                    state, optimizer_param_dims(optimizer, lm), st.grid.mp_group, optimizer_param_blocks(optimizer, lm)
                )
            optimizer.load_state_dict(state)
            compat.optimizer_to_device(optimizer, st.root_device)
            if optimizer is not original:
                engine = self._engine()
                engine.load_plain(next(i for i, o in enumerate(engine.optimizers) if o is compat.unwrap_optimizer(
                    original)), optimizer)
        # Called last before the fit loop runs: the RNG streams continue where the saving run left them.
        restore_rng_from(checkpoint, st.dp, st.mp, st.global_rank, st.root_device)
        tracker = checkpoint.get(_TRACKER_KEY)
        if st.rng_tracker is not None and tracker is not None and len(tracker) == st.mp:
            st.rng_tracker.load_state_dict({"sharded_state": tracker[st.mp_rank]})  # else: fresh streams for a new mp
