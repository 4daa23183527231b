"""DPMPStrategy's checkpoint collaborator: consolidated and sharded saves, loads into any layout.

Consolidated (default): dense tensors under the dense names in one file that rank 0 writes tensor by tensor
(:mod:`lightning_dpmp.checkpoint.streamed`), each gathered only when it is written. Sharded: every rank writes the
chunks it holds into a folder (:mod:`lightning_dpmp.checkpoint.sharded`). Both load after setup, into the
parallelised model, so each rank reads only its slices. The strategy owns one :class:`StrategyCheckpointer` and
delegates its checkpoint hooks to it.

Memory: the checkpoint dict Lightning builds holds *held tensors* (:mod:`lightning_dpmp.checkpoint.held`) wherever
the value needs communication or lives in ZeRO's flat DP shards, so nothing is gathered while it is built. A
consolidated save gathers one bucket (one unit) over DP at a time and one dense tensor over MP onto rank 0; a
sharded save writes each rank's chunks of its shards as they are; loads copy each tensor's slices straight into
the shards (a sharded folder is read into them in place). No rank holds more than its shards plus one unit's
gathered copy and one dense tensor. Under ZeRO, checkpoints hold the state as without ZeRO (per-parameter AdamW
moments under the dense names), so both formats resume into any (dp, mp, zero). With a pipeline (without ZeRO)
each parameter and its optimizer state are written from the pipeline rank that owns it: nothing is synced, and a
later stage sends each dense tensor of a consolidated file to global rank 0 as it is written.

Example:
    >>> trainer.save_checkpoint("last.ckpt")                  # collective; rank 0 writes  # doctest: +SKIP
    >>> trainer.fit(model, ckpt_path="last.ckpt")             # any (dp, mp)                # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.consolidated import (
    check_state_matches,
    dense_param_shape,
    dense_shapes,
    element_wise_keys,
    optimizer_param_blocks,
    optimizer_param_dims,
    shard_optimizer_state,
    shard_state_dict,
)
from lightning_dpmp.checkpoint.files import (
    load_file,
    make_weights_only_safe,
    recover_path,
    write_on_rank_zero,
)
from lightning_dpmp.checkpoint.held import Gathered, Held, held, held_of, resolve_held
from lightning_dpmp.checkpoint.hf_export import (
    TensorEntry,
    floating_dtype,
    state_entries,
    write_config,
    write_streamed,
)
from lightning_dpmp.checkpoint.integrity import load_checked
from lightning_dpmp.checkpoint.rng_states import layout_info, restore_rng_from
from lightning_dpmp.checkpoint.streamed import stream_save
from lightning_dpmp.parallel.sharding import gather_to_first, shard_blocks, shard_dims, shard_tensor

__all__ = ["CheckpointHost", "StrategyCheckpointer"]

_TRACKER_KEY = "dpmp_rng_tracker"  # per-MP-rank dropout streams of the sharded regions (lightning_dpmp.parallel.rng)


class CheckpointHost(Protocol):
    """What :class:`StrategyCheckpointer` reads of the strategy that owns it (structural: the Trainer's
    :class:`~lightning_dpmp.integration.strategy.DPMPStrategy` is one; a typing import of it would close a circle,
    since it imports this module). The grid is ``None`` before ``setup_environment``; the engine and the pipeline
    exist only while a fit holds them."""

    @property
    def grid(self) -> Any: ...
    @property
    def grid_or_none(self) -> Any: ...
    @property
    def dp(self) -> Any: ...
    @property
    def mp(self) -> Any: ...
    @property
    def mp_rank(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def timeout(self) -> timedelta: ...
    @property
    def lightning_module(self) -> Any: ...
    @property
    def optimizers(self) -> list[Optimizer]: ...
    @property
    def rng_tracker(self) -> Any: ...
    @property
    def zero_engine(self) -> Any: ...
    @property
    def pipeline(self) -> Any: ...
    @property
    def checkpoint_io(self) -> Any: ...
    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


class StrategyCheckpointer:
    """The checkpoint hooks of :class:`~lightning_dpmp.integration.strategy.DPMPStrategy`, owned by it.

    Args:
        strategy: the owning strategy; read for its grid (``None`` before ``setup_environment``), layout, devices,
            module, optimizers and RNG tracker, and used for ``broadcast`` and its ``checkpoint_io``.
        distributed: write a folder of shards (``save_distributed_checkpoint=True``) instead of one file.
    """

    def __init__(self, strategy: CheckpointHost, distributed: bool) -> None:
        self.strategy = strategy
        self.distributed = distributed
        # one Gathered per (bucket, flat source) of the save being built: its members fetch from one gather
        self._bucket_gathers: dict[tuple[int, int], Gathered] = {}

    def gathers(self) -> bool:
        """Whether this rank gathers MP shards into dense tensors: consolidated saves, on the MP group of DP rank 0
        (and pipeline rank 0)."""
        grid = self.strategy.grid_or_none
        # with a pipeline under ZeRO every stage holds the synced model: the first stage's MP group gathers (without
        # ZeRO each tensor's owning stage gathers it: _from_stage)
        return grid is not None and not self.distributed and grid.dp_rank == 0 and grid.pp_rank == 0

    def _engine(self) -> Any:
        return self.strategy.zero_engine

    def _stages(self) -> Any:
        """The pipeline when checkpoints are written from the stages (``pp > 1`` without ZeRO; under ZeRO the stages
        are synced first), else ``None``."""
        pipeline = self.strategy.pipeline
        return pipeline if pipeline is not None and pipeline.active and self._engine() is None else None

    def stages_write(self) -> bool:
        """Whether a save now is written from the stages, nothing synced (the strategy asks before a save)."""
        return self._stages() is not None

    def _plain(self, optimizer: Any) -> Any:
        """``optimizer`` as without ZeRO (the same class over the module's parameters, without state: for the
        parameter order and names), or ``optimizer`` itself when it is not a ZeRO one."""
        engine, inner = self._engine(), compat.unwrap_optimizer(optimizer)
        if engine is None or not any(inner is o for o in engine.optimizers):
            return optimizer
        return engine.plain_optimizer(self._engine_index(optimizer), with_state=False)

    def module_state_dict(self) -> dict[str, Any]:
        """The module's state as held tensors where producing it needs communication or this rank holds slices.

        * ZeRO: a parameter a bucket holds is a held tensor: its DP slices (sharded format), or its dense value
          fetched while the file is written, its bucket gathered once for all its members (consolidated).
        * Consolidated: a split tensor is a held tensor gathered over MP onto rank 0 while the file is written.
        * Everything else is the tensor itself. Nothing is gathered here (see :mod:`lightning_dpmp.checkpoint.held`).
        """
        lm = self.strategy.lightning_module
        assert lm is not None
        self._bucket_gathers.clear()  # a new save
        engine, dims, blocks = self._engine(), shard_dims(lm), shard_blocks(lm)
        state = lm.state_dict(keep_vars=True)  # parameters themselves: the engine knows them by identity
        made: dict[int, Tensor] = {}  # tied or aliased parameters: one held tensor under each of their keys
        out: dict[str, Any] = {}
        stages = self._stages()
        for key, v in state.items():
            if not isinstance(v, Tensor):
                out[key] = v
                continue
            owner = stages.owner.get(id(v)) if stages is not None else None
            if id(v) not in made and owner is not None:  # a parameter, written from the stage that owns it
                dim, b = dims.get(key), blocks.get(key, 1)
                made[id(v)] = self._from_stage(v.detach(), dim, b, owner,
                                               dense_param_shape(v, dim, self.strategy.mp, b))
            elif id(v) not in made:
                made[id(v)] = self._held_tensor(v, engine, dims.get(key), blocks.get(key, 1), None)
            out[key] = made[id(v)]
        return out

    def _held_tensor(self, v: Tensor, engine: Any, dim: Optional[int], blocks: Any,
                     state: Optional[tuple[int, str, Tensor]]) -> Tensor:
        """``v`` (a parameter; with ``state = (optimizer, key, value)``, that optimizer state of it) as this save
        holds it: a held tensor, or the tensor itself (see :meth:`module_state_dict`)."""
        found = engine.locate(v) if engine is not None else None
        value = state[2] if state is not None else v
        dense_shape = dense_param_shape(v, dim, self.strategy.mp, blocks)
        if found is None:
            if self.distributed or dim is None:
                return value.detach()
            return held(dense_shape, value.dtype, Held(fetch=self._dense(lambda: value.detach(), dim, blocks)))
        bucket, index = found
        off, n, shape = bucket.layout.offsets[index], v.numel(), tuple(v.shape)
        source = bucket.shard if state is None else value  # the flat DP slice: the master values
        if self.distributed:
            pieces = (engine.param_pieces(v) if state is None else engine.state_pieces(state[0], v, state[1]))
            return held(shape, source.dtype, Held(pieces=pieces, local_shape=shape))
        if state is None and engine.holds_whole(bucket):  # zero=1/2: only MP gathers it
            return held(dense_shape, v.dtype, Held(fetch=self._dense(lambda: v.detach(), dim, blocks)))
        gathered = self._bucket_gathers.get((id(bucket), id(source)))
        if gathered is None:
            gathered = self._bucket_gathers[(id(bucket), id(source))] = Gathered(partial(bucket.gathered_copy, source))

        def local() -> Tensor:  # (valid while the bucket is open: between Gathered.open and close)
            assert gathered.full is not None
            return gathered.full[off : off + n].view(shape)

        return held(dense_shape, source.dtype, Held(fetch=self._dense(local, dim, blocks), gathered=gathered))

    def _dense(self, local: Callable[[], Tensor], dim: Optional[int], blocks: Any) -> Callable[[], Optional[Tensor]]:
        """Fetch the dense tensor onto global rank 0 from each rank's MP-local ``local()`` (collective over DP row
        0's MP group; nothing elsewhere)."""
        st = self.strategy

        def fetch() -> Optional[Tensor]:
            if not self.gathers():
                return None
            if dim is None:
                return local().detach().cpu().clone() if st.mp_rank == 0 else None
            return gather_to_first(local(), st.grid.mp_group, dim, blocks)

        return fetch

    def _from_stage(self, value: Tensor, dim: Optional[int], blocks: Any, owner: int,
                    dense_shape: tuple[int, ...]) -> Tensor:
        """``value`` (a parameter or its optimizer state, MP-local) written from the pipeline rank ``owner`` that
        owns it: in the sharded format, ``value`` on the owner's ranks and a meta tensor (no chunk) elsewhere, so
        each stage writes its own; in the consolidated format a held tensor that the owner's DP-row-0 MP group
        gathers and, from a later stage, sends to global rank 0 over the PP group (one point-to-point send)."""
        grid = self.strategy.grid
        here = grid.pp_rank == owner
        if self.distributed:
            return value if here else torch.empty(value.shape, dtype=value.dtype, device="meta")

        def fetch() -> Optional[Tensor]:
            if grid.dp_rank != 0:
                return None
            dense = None
            if here:
                dense = (gather_to_first(value, grid.mp_group, dim, blocks) if dim is not None
                         else value.detach().cpu().clone() if grid.mp_rank == 0 else None)
            if owner == 0 or grid.mp_rank != 0:
                return dense
            if here:
                assert dense is not None
                dist.send(dense.contiguous(), group=grid.pp_group, group_dst=0)
                return None
            if grid.pp_rank != 0:
                return None
            received = torch.empty(dense_shape, dtype=value.dtype)
            dist.recv(received, group=grid.pp_group, group_src=owner)
            return received

        return held(dense_shape, value.dtype, Held(fetch=fetch))

    def _stage_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any], stages: Any) -> dict[str, Any]:
        """Lightning's ``state`` of ``optimizer`` with each parameter's entry from the stage that owns it: this rank's
        own entries as they are, the others' described by their owners (one ``all_gather_object`` over PP of keys,
        shapes and non-tensor values, no tensor data) and written from there (:meth:`_from_stage`)."""
        st = self.strategy
        grid = st.grid
        inner = compat.unwrap_optimizer(optimizer)
        params = [p for g in inner.param_groups for p in g["params"]]
        dims = optimizer_param_dims(inner, st.lightning_module)
        blocks = optimizer_param_blocks(inner, st.lightning_module)
        mine = {idx: per for idx, per in state.get("state", {}).items()
                if stages.owner.get(id(params[idx])) == grid.pp_rank}
        described = {idx: {k: (tuple(v.shape), str(v.dtype).split(".")[-1]) if isinstance(v, Tensor) else ("value", v)
                           for k, v in per.items()} for idx, per in mine.items()}
        every: list[Any] = [None] * grid.pp
        dist.all_gather_object(every, described, group=grid.pp_group)
        out: dict[int, dict[str, Any]] = {}
        for idx in sorted({i for d in every for i in d}):
            p = params[idx]
            owner = stages.owner[id(p)]
            per: dict[str, Any] = {}
            for key, (shape, kind) in every[owner][idx].items():
                if shape == "value":
                    per[key] = kind
                    continue
                value = mine[idx][key] if owner == grid.pp_rank else torch.empty(shape, dtype=getattr(torch, kind),
                                                                                 device="meta")
                split = dims[idx] is not None and tuple(shape) == tuple(p.shape)
                dim = dims[idx] if split else None
                dense = dense_param_shape(p, dim, st.mp, blocks[idx]) if split else tuple(shape)
                per[key] = self._from_stage(value, dim, blocks[idx], owner, dense)
            out[idx] = per
        return {**state, "state": out}

    def optimizer_state(self, optimizer: Optimizer, default: Callable[[Optimizer], dict[str, Any]]) -> dict[str, Any]:
        """The optimizer's state (``default``: Lightning's) as without ZeRO, its tensors held tensors as in
        :meth:`module_state_dict` (nothing gathered here)."""
        st, engine = self.strategy, self._engine()
        stages = self._stages()
        if stages is not None:
            return self._stage_optimizer_state(optimizer, default(optimizer), stages)
        plain = self._plain(optimizer)
        inner = compat.unwrap_optimizer(plain)
        params = [p for g in inner.param_groups for p in g["params"]]
        layout = dict(zip(map(id, params), zip(optimizer_param_dims(inner, st.lightning_module),
                                               optimizer_param_blocks(inner, st.lightning_module))))
        if plain is not optimizer:  # ZeRO: each parameter's state from its bucket's shard state
            i = self._engine_index(optimizer)
            for p in params:
                found = engine.locate(p)
                if found is None:
                    continue  # frozen at zero<3: never stepped, no state (as without ZeRO)
                bucket = found[0]
                inner.state[p] = {
                    k: (self._held_tensor(p, engine, *layout[id(p)], (i, k, v))
                        if isinstance(v, Tensor) and v.shape == bucket.shard.shape
                        else v.clone() if isinstance(v, Tensor) else v)
                    for k, v in engine.optimizers[i].state.get(bucket.shard, {}).items()
                }
                if not inner.state[p]:
                    del inner.state[p]  # never stepped: no state, as without ZeRO
        state = default(plain)
        if plain is optimizer and not self.distributed:  # consolidated: split state tensors gathered over MP
            # (new per-parameter dicts: state_dict() hands out the optimizer's own)
            state = {**state, "state": {idx: dict(per) for idx, per in state.get("state", {}).items()}}
            for idx, per in state["state"].items():
                p = params[idx]
                dim, blocks = layout[id(p)]
                for k, v in per.items():
                    if isinstance(v, Tensor) and dim is not None and v.shape == p.shape:
                        per[k] = self._held_tensor(p, None, dim, blocks, (0, k, v))
        return state

    def _engine_index(self, optimizer: Any) -> int:
        engine, inner = self._engine(), compat.unwrap_optimizer(optimizer)
        return next(i for i, o in enumerate(engine.optimizers) if o is inner)

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
            optimizers = [self._plain(o) for o in st.optimizers]  # for the parameter names
            try:
                save_sharded(checkpoint, path, st.lightning_module, optimizers, st.grid_or_none)
            finally:
                self._bucket_gathers.clear()
            return
        try:
            if "://" in path or type(st.checkpoint_io) is not TorchCheckpointIO:
                # another writer needs the whole checkpoint in memory: fetch every held tensor first
                whole = resolve_held(checkpoint)
                write = lambda: st.checkpoint_io.save_checkpoint(whole, path, storage_options=storage_options)  # noqa: E731
                # The others wait for rank 0 with a long timeout of their own, not at a barrier bound by `timeout`.
                write_on_rank_zero(write, max(st.timeout, timedelta(hours=1)))
            else:
                # every rank takes part in the fetches; rank 0 writes each dense tensor as it arrives
                stream_save(checkpoint, path, write=st.is_global_zero)
        finally:
            self._bucket_gathers.clear()

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
            optimizers = [self._plain(o) for o in st.optimizers]  # for the parameter names
            engine = self._engine()
            holdings = None if engine is None else _ZeroHoldings(
                engine, [self._engine_index(o) if p is not o else None for o, p in zip(st.optimizers, optimizers)])
            loaded = load_sharded(found, lm, optimizers, st.grid, lm.strict_loading, holdings)
            if engine is not None:
                engine.refresh()  # ZeRO slices were read in place: gather again what is kept whole
            return loaded
        if "://" in found or not os.path.exists(found):
            return st.checkpoint_io.load_checkpoint(found, weights_only=True)
        return load_checked(found, load_file)  # a truncated file: named, and said to be incomplete

    def save_pretrained(self, module: Any, out_dir: str, max_shard_size: Any = "5GB") -> dict[str, int]:
        """Write ``module`` (a submodule of the trained model, e.g. the transformers model in ``self.net``) as a
        Hugging Face folder: safetensors under its own names plus its config (collective over the world).

        Each split tensor is gathered onto global rank 0 over DP row 0's MP group, written, and freed before the
        next one; under ZeRO each bucket is gathered over DP once for its run of tensors (the masters, under mixed
        precision), so no rank ever holds more than its shards, one unit and one dense tensor; rank 0 writes, the
        others return once the folder is complete.
        """
        st = self.strategy
        grid = st.grid_or_none
        engine = self._engine()
        state = module.state_dict(keep_vars=True)  # tied weights are one object: written once
        dims, blocks = shard_dims(module), shard_blocks(module)  # empty unless split, hence a grid
        mp_group = grid.mp_group if grid is not None else None
        # a parameter the engine holds is written in its master dtype (its shard's), whatever it computes in
        masters = {id(t): torch.empty(t.shape, dtype=found[0].shard.dtype, device="meta") for t in state.values()
                   if isinstance(t, Tensor) and (found := engine.locate(t) if engine is not None else None)}
        entries = state_entries({k: masters.get(id(t), t) for k, t in state.items()}, dense_shapes(module, mp_group))
        current: list[Any] = [None, None]  # (bucket, Gathered) open now

        def local(t: Tensor) -> Tensor:
            found = engine.locate(t) if engine is not None else None
            if found is None or engine.holds_whole(found[0]):
                return t.detach()  # held whole and current (zero=0/1/2)
            bucket, index = found
            if current[0] is not bucket:
                if current[1] is not None:
                    current[1].close()
                current[:] = [bucket, Gathered(partial(bucket.gathered_copy, bucket.shard))]
                current[1].open()
            off = bucket.layout.offsets[index]
            return current[1].full[off : off + t.numel()].view(t.shape)

        def fetch(e: TensorEntry) -> Optional[Tensor]:
            t = local(state[e.name])
            if grid is not None and grid.dp_rank != 0:
                return None  # (DP row 0's MP group gathers; the other rows only take part in the bucket gathers)
            if e.name in dims:
                return gather_to_first(t, mp_group, dims[e.name], blocks.get(e.name, 1))
            return t if st.is_global_zero else None  # (written, copied, before the next fetch)

        try:
            summary = write_streamed(out_dir, entries, fetch, max_shard_size, write=st.is_global_zero)
        finally:
            if current[1] is not None:
                current[1].close()
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
        """Load a dense (any layout) or local-layout state dict into the parallelised module. Under ZeRO each
        parameter's slices are copied into this rank's shards, one parameter at a time: nothing is gathered."""
        from lightning_dpmp.checkpoint.sharded import LOCAL_LAYOUT_KEY

        st = self.strategy
        lm = st.lightning_module
        assert lm is not None
        state, local = checkpoint["state_dict"], bool(checkpoint.get(LOCAL_LAYOUT_KEY))
        dims, blocks = shard_dims(lm), shard_blocks(lm)
        if st.grid_or_none is not None and not local:
            found = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)}
            check_state_matches(dense_shapes(lm, st.grid.mp_group), found, strict)  # names the first difference
        engine = self._engine()
        if engine is None:
            if st.grid_or_none is not None and not local and dims:
                state = shard_state_dict(state, dims, st.grid.mp_group, blocks)
            lm.load_state_dict(state, strict=strict)
            return
        params = lm.state_dict(keep_vars=True)
        rest: dict[str, Any] = {}
        wrote = False
        with torch.no_grad():
            for key, v in state.items():
                t = params.get(key)
                pieces = engine.param_pieces(t) if isinstance(t, Tensor) and isinstance(v, Tensor) else None
                if pieces is None:
                    rest[key] = v
                elif held_of(v) is None:  # (a held one was read into the slices already: a sharded folder)
                    _copy_pieces(self._local(v, None if local else dims.get(key), blocks.get(key, 1)), pieces)
                    wrote = True
        if not local and dims:
            rest = shard_state_dict(rest, dims, st.grid.mp_group, blocks)
        lm.load_state_dict(rest, strict=False)  # (strictness was checked against the whole state above)
        if wrote:  # (every rank alike: the same checkpoint keys) the shards changed: gather what is kept whole
            engine.refresh()

    def _local(self, dense: Tensor, dim: Optional[int], blocks: Any) -> Tensor:
        """This rank's MP slice of a dense checkpoint tensor (``dim`` ``None``: the tensor itself)."""
        st = self.strategy
        return dense if dim is None or st.mp == 1 else shard_tensor(dense, dim, st.mp, st.mp_rank, blocks)

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Load the optimizer states (sharded to this rank's slices), then the RNG streams."""
        from lightning_dpmp.checkpoint.sharded import LOCAL_LAYOUT_KEY

        st = self.strategy
        local = bool(checkpoint.get(LOCAL_LAYOUT_KEY))
        for original, state in zip(st.optimizers, checkpoint["optimizer_states"]):
            optimizer = self._plain(original)
            if optimizer is not original:
                self._load_zero_optimizer(original, optimizer, state, local)
                continue
            if st.grid_or_none is not None and st.mp > 1 and not local:
                lm = st.lightning_module
                state = shard_optimizer_state(
                    state, optimizer_param_dims(optimizer, lm), st.grid.mp_group, optimizer_param_blocks(optimizer, lm)
                )
            optimizer.load_state_dict(state)
            compat.optimizer_to_device(optimizer, st.root_device)
        # Called last before the fit loop runs: the RNG streams continue where the saving run left them.
        restore_rng_from(checkpoint, st.dp, st.mp, st.global_rank, st.root_device)
        tracker = checkpoint.get(_TRACKER_KEY)
        if st.rng_tracker is not None and tracker is not None and len(tracker) == st.mp:
            st.rng_tracker.load_state_dict({"sharded_state": tracker[st.mp_rank]})  # else: fresh streams for a new mp

    def _load_zero_optimizer(self, original: Any, plain: Optimizer, state: Mapping[str, Any], local: bool) -> None:
        """A ZeRO optimizer's state from a checkpoint as without ZeRO: hyper-parameters per group, and each
        parameter's element-wise state copied into this rank's slices one tensor at a time (those a sharded
        folder read in place already are left), scalars (``step``) once per bucket."""
        st, engine = self.strategy, self._engine()
        i = self._engine_index(original)
        sharded = engine.optimizers[i]
        groups = state["param_groups"]
        if len(groups) != len(sharded.param_groups):
            raise ValueError(f"loaded state dict has {len(groups)} parameter groups; the optimizer has "
                             f"{len(sharded.param_groups)}")
        for g, saved in zip(sharded.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        params = [p for g in plain.param_groups for p in g["params"]]
        dims = optimizer_param_dims(plain, st.lightning_module)
        blocks = optimizer_param_blocks(plain, st.lightning_module)
        if not any(held_of(v) is not None for per in state["state"].values() for v in per.values()):
            sharded.state.clear()  # (else a sharded folder's slices were read into a cleared state already)

        def dense(idx: int) -> tuple[int, ...]:  # the parameter's shape as the checkpoint stores it
            return dense_param_shape(params[idx], None if local else dims[idx], st.mp, blocks[idx])

        shaped = {idx: {k for k, v in per.items() if isinstance(v, Tensor) and tuple(v.shape) == dense(idx)}
                  for idx, per in state["state"].items()}
        element_wise = element_wise_keys(shaped, [p.dim() for p in params])
        with torch.no_grad():
            for idx, per in state["state"].items():
                p = params[idx]
                bucket, _ = engine.locate(p)
                for k, v in per.items():
                    if held_of(v) is not None:
                        continue
                    if k in shaped[idx] and (p.dim() > 0 or k in element_wise):
                        dim = None if local else dims[idx]
                        _copy_pieces(self._local(v, dim, blocks[idx]), engine.state_pieces(i, p, k, v.dtype))
                    else:  # a scalar (AdamW's step): one per bucket, as the shard steps once
                        sharded.state[bucket.shard].setdefault(k, v.clone() if isinstance(v, Tensor) else v)


class _ZeroHoldings:
    """What a sharded folder reads in place under ZeRO (:class:`lightning_dpmp.checkpoint.sharded.Holdings`): the
    engine's slices of each parameter, and of each optimizer's element-wise state (that optimizer's old state
    cleared before its first slice is allocated). ``engine_index[i]``: the engine's index of optimizer ``i``, or
    ``None`` for one it does not shard."""

    def __init__(self, engine: Any, engine_index: list[Optional[int]]) -> None:
        self.engine, self.engine_index = engine, engine_index
        self.cleared: set[int] = set()

    def param_pieces(self, param: Tensor) -> Any:
        return self.engine.param_pieces(param)

    def state_pieces(self, optimizer: int, param: Tensor, key: str, dtype: torch.dtype) -> Any:
        j = self.engine_index[optimizer] if optimizer < len(self.engine_index) else None
        if j is None:
            return None
        if j not in self.cleared:
            self.cleared.add(j)
            self.engine.optimizers[j].state.clear()
        return self.engine.state_pieces(j, param, key, dtype)


def _copy_pieces(local: Tensor, pieces: Any) -> None:
    """Copy the flat ranges ``pieces`` hold out of ``local`` (an MP-local tensor; one copy of it at most)."""
    flat = local.reshape(-1)
    for lo, hi, data in pieces:
        data.copy_(flat[lo:hi])
