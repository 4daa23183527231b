"""Sharded checkpoints: a folder written in parallel with ``torch.distributed.checkpoint`` (DCP), read into any layout.

Each rank writes only what it holds: a split parameter (and its AdamW moments) is described to DCP as a ``DTensor``
on the ``(dp, mp)`` mesh with placements ``[Replicate(), Shard(dim)]``, so DCP stores each MP shard once (DP
replicas are deduplicated) and records the dense shape; replicated tensors are stored once, by one rank. Nothing is
gathered: no rank holds more than its own shards. Loading asks DCP for this rank's slice of the dense tensors under
the *current* layout, which reshards ``(2, 2) -> (1, 4)`` or into a dense model
(:mod:`lightning_dpmp.checkpoint.convert`).

The folder::

    last.ckpt/
      .metadata          DCP's index (dense shapes, chunks, files); read with a restricted unpickler
      __<rank>_0.distcp  tensor data written by each rank
      dpmp_meta.pt       everything else Lightning saves (loops, callbacks, LR schedulers, hyper-parameters, RNG
                         states, optimizer param_groups); torch.save, read with weights_only=True

Keys inside DCP: ``model/<state_dict key>`` and ``optim<i>/<parameter name>/<state key>`` (e.g.
``optim0/blocks.0.fc1.weight/exp_avg``): by dense names, so they survive any change of layout.

Fused projections (q|k|v in one weight, split block by block: each rank holds the same rows of every block) are
not one contiguous shard of the dense tensor. Each block is stored as its own logical tensor, ``<key>#block<i>``
(``dpmp_meta.pt`` lists the fused keys, their block counts and the dim they are split along), sharded over MP like
any other split tensor. A layout that splits the same blocks reads its slices of each block; any other (mp=1, or
the layer planned differently) reads the dense blocks and slices them locally.

Example:
    >>> save_sharded(checkpoint, "last.ckpt", module, optimizers, grid)      # collective  # doctest: +SKIP
    >>> ckpt = load_sharded("last.ckpt", module, optimizers, grid)           # this rank's slices  # doctest: +SKIP
    >>> full = load_sharded_full("last.ckpt")       # one process, no process group: dense  # doctest: +SKIP
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
import warnings
from collections.abc import Sequence
from itertools import zip_longest
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.consolidated import (
    CheckpointMismatchError,
    check_state_matches,
    dense_shapes,
    optimizer_param_blocks,
    optimizer_param_dims,
    optimizer_param_names,
)
from lightning_dpmp.checkpoint.files import atomic_save, fsync_dir, replace_path
from lightning_dpmp.parallel.comm import group_rank, group_size
from lightning_dpmp.parallel.grid import Grid
from lightning_dpmp.parallel.sharding import (
    Blocks,
    block_piece,
    dense_size,
    local_block_sizes,
    shard_blocks,
    shard_dims,
    shard_tensor,
)

__all__ = [
    "LOCAL_LAYOUT_KEY", "META_FILE", "is_sharded_checkpoint", "load_sharded", "load_sharded_full", "save_sharded"
]

META_FILE = "dpmp_meta.pt"
FORMAT = "dpmp-sharded-v1"
#: Set in a checkpoint dict whose tensors are already this rank's slices (no slicing on load).
LOCAL_LAYOUT_KEY = "dpmp_local_layout"


def is_sharded_checkpoint(path: Any) -> bool:
    """True for a folder written by :func:`save_sharded`."""
    return os.path.isdir(str(path)) and os.path.isfile(os.path.join(str(path), META_FILE))


# ---------------------------------------------------------------------------------------------- safe reading
class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its ``.metadata`` index; accept only DCP's own dataclasses, torch's dtype/layout/Size and paths."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                      "torch.distributed.checkpoint.planner"):
            return super().find_class(module, name)
        if (module, name) in {("collections", "OrderedDict"), ("copyreg", "_reconstructor"), ("builtins", "object"),
                              ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "WindowsPath"), ("pathlib", "Path")}:
            return super().find_class(module, name)
        torch_enums = (torch.dtype, torch.layout, torch.memory_format)
        if module == "torch" and isinstance(getattr(torch, name, None), torch_enums):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from a checkpoint's DCP metadata")


class _SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with an allowlist (tensor data is ``weights_only`` already)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(os.path.join(str(self.path), ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("the checkpoint's .metadata is not DCP metadata")
        from torch.distributed.checkpoint.metadata import StorageMeta

        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """Never unpickles arbitrary objects: we only request tensors, and a bytes entry is read ``weights_only``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _tensor_meta(path: str) -> dict[str, TensorStorageMetadata]:
    md = _SafeReader(path).read_metadata()
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


# ---------------------------------------------------------------------------------------------- layout helpers
def _mesh(grid: Grid, device_type: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(grid.dp * grid.mp).view(grid.dp, grid.mp)
    return DeviceMesh.from_group([grid.dp_group, grid.mp_group], device_type, mesh=ranks, mesh_dim_names=("dp", "mp"))


def _as_dcp(local: Tensor, dim: Optional[int], mesh: Any, dense: Optional[int] = None) -> Tensor:
    """A split tensor becomes a DTensor (replicated over DP, sharded over MP along ``dim``); others stay plain.

    ``dense``: the size along ``dim`` when ``mp`` does not divide it (a padded vocabulary): ``local`` then holds
    ``ceil(dense / mp)`` rows, and only the real ones are described, so the stored tensor has the dense shape.
    """
    if dim is None or mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if dense is None or dense == local.shape[dim] * mesh.size(1):
        return DTensor.from_local(local, mesh, [Replicate(), Shard(dim)], run_check=False)
    _, real, _ = block_piece(dense, mesh.size(1), mesh.get_local_rank(1))
    shape = list(local.shape)
    shape[dim] = dense
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.narrow(dim, 0, real), mesh, [Replicate(), Shard(dim)], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _block_key(key: str, i: int) -> str:
    return f"{key}#block{i}"


def _fused(fused: dict[str, Any], key: str) -> tuple[Blocks, int]:
    """(blocks, dim the blocks are stacked along) of a stored tensor; plain tensors are one block. Blocks of
    unequal or padded sizes are stored as the list of their dense sizes."""
    value = fused.get(key, 1)
    if isinstance(value, int):
        return value, 0
    blocks = value[0]
    return (blocks if isinstance(blocks, int) else tuple(int(b) for b in blocks)), int(value[1])


def _count(blocks: Blocks) -> int:
    return blocks if isinstance(blocks, int) else len(blocks)


def _put(flat: dict[str, Tensor], fused: dict[str, Any], key: str, local: Tensor, dim: Optional[int],
         blocks: Blocks, mesh: Any) -> None:
    """Describe one local tensor to DCP: a fused one (``blocks``, split block by block along ``dim``: dim 0 of a
    Linear's q|k|v, dim 1 of GPT-2's ``Conv1D`` (in, out) weight, or a padded vocabulary) as one entry per block,
    each of its dense size."""
    if dim is not None and blocks != 1 and mesh is not None:
        fused[key] = (blocks if isinstance(blocks, int) else list(blocks), dim)
        n = mesh.size(1)
        parts = local.split(local_block_sizes(blocks, local.shape[dim], n), dim=dim)
        for i, part in enumerate(parts):
            size = None if isinstance(blocks, int) else blocks[i]
            flat[_block_key(key, i)] = _as_dcp(part.contiguous(), dim, mesh, size)
    else:
        flat[key] = _as_dcp(local, dim, mesh)


def _logical_shapes(saved: dict[str, TensorStorageMetadata], fused: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Dense shape of every logical tensor of a folder (a fused tensor's blocks stacked along their dim)."""
    out = {k: tuple(v.size) for k, v in saved.items() if "#block" not in k}
    for key in fused:
        blocks, dim = _fused(fused, key)
        shape = list(saved[_block_key(key, 0)].size)
        shape[dim] = sum(saved[_block_key(key, i)].size[dim] for i in range(_count(blocks)))
        out[key] = tuple(shape)
    return out


class _Reads:
    """What one ``dcp.load`` asks for, and how each answer becomes this rank's local tensor afterwards.

    A logical tensor stored as it will be held (plain, or fused with the same blocks split the same way) is read
    straight into its local slices; any other pairing reads the dense tensor (or its dense blocks) and slices it.
    """

    def __init__(self, saved: dict[str, TensorStorageMetadata], fused: dict[str, Any], mesh: Any, group: Any) -> None:
        self.saved, self.fused, self.mesh, self.group = saved, fused, mesh, group
        self.targets: dict[str, Tensor] = {}
        self.after: list[Any] = []

    def add(self, key: str, local: Tensor, dim: Optional[int], blocks: Blocks) -> None:
        """Fill ``local`` (this rank's tensor: split along ``dim`` in ``blocks`` blocks, or whole) from ``key``."""
        stored, stored_dim = _fused(self.fused, key)
        if stored == 1 and blocks == 1:
            self.targets[key] = _as_dcp(local, dim, self.mesh)
            return
        if stored == blocks and dim == stored_dim and self.mesh is not None:
            n = group_size(self.group)
            parts = [torch.zeros_like(p) for p in local.split(local_block_sizes(blocks, local.shape[dim], n), dim=dim)]
            for i, part in enumerate(parts):
                size = None if isinstance(blocks, int) else blocks[i]
                self.targets[_block_key(key, i)] = _as_dcp(part, dim, self.mesh, size)
            self.after.append(lambda: local.copy_(torch.cat(parts, dim=dim)))
            return
        keys = [key] if stored == 1 else [_block_key(key, i) for i in range(_count(stored))]
        dense = [torch.empty(tuple(self.saved[k].size), dtype=self.saved[k].properties.dtype, device=local.device)
                 for k in keys]
        self.targets.update(zip(keys, dense))

        def finish() -> None:
            full = torch.cat(dense, dim=stored_dim)
            n, r = group_size(self.group), group_rank(self.group)
            local.copy_(full if dim is None else shard_tensor(full, dim, n, r, blocks))

        self.after.append(finish)

    def load(self, path: str) -> None:
        dcp.load(self.targets, storage_reader=_SafeReader(path), planner=_SafePlanner())
        with torch.no_grad():
            for finish in self.after:
                finish()


# ---------------------------------------------------------------------------------------------- save
def save_sharded(
    checkpoint: dict[str, Any], path: str, module: nn.Module, optimizers: Sequence[Any], grid: Optional[Grid],
    device_type: str = "cpu",
) -> None:
    """Write ``checkpoint`` (model/optimizer tensors as this rank's shards) as a folder at ``path``, atomically.

    Collective over the world. All ranks write into a temporary sibling folder; when DCP has finished, rank 0 adds
    ``dpmp_meta.pt`` and renames the folder over ``path``. A crash before the rename leaves the previous
    checkpoint untouched. Needs a filesystem that every rank sees at ``path``.
    """
    dims, blocks = shard_dims(module), shard_blocks(module)
    mesh = _mesh(grid, device_type) if dims and grid is not None else None
    flat: dict[str, Tensor] = {}
    fused: dict[str, Any] = {}  # DCP key -> (blocks, dim), for tensors stored block by block
    state = checkpoint.pop("state_dict", {})
    model_keys, model_extra = [], {}
    for key, value in state.items():
        if isinstance(value, Tensor):
            _put(flat, fused, f"model/{key}", value.detach(), dims.get(key), blocks.get(key, 1), mesh)
            model_keys.append(key)
        else:
            model_extra[key] = value
    optim_info = []
    for i, (opt, st) in enumerate(zip(optimizers, checkpoint.pop("optimizer_states", []))):
        inner = compat.unwrap_optimizer(opt)
        names, pdims = optimizer_param_names(inner, module), optimizer_param_dims(inner, module)
        pblocks = optimizer_param_blocks(inner, module)
        params = [p for g in inner.param_groups for p in g["params"]]
        layout: dict[int, list[tuple[str, bool, Any]]] = {}
        for idx, per in st["state"].items():
            entries = []
            for key, value in per.items():
                if isinstance(value, Tensor):
                    dim = pdims[idx] if value.shape == params[idx].shape else None
                    _put(flat, fused, f"optim{i}/{names[idx]}/{key}", value.detach(), dim, pblocks[idx], mesh)
                    entries.append((key, True, None))
                else:
                    entries.append((key, False, value))
            layout[idx] = entries
        optim_info.append({"param_names": names, "param_groups": st["param_groups"], "layout": layout})
    meta = {**checkpoint, "dpmp_sharded": {"format": FORMAT, "model_keys": model_keys, "model_extra": model_extra,
                                           "optimizers": optim_info, "fused": fused}}

    distributed = dist.is_available() and dist.is_initialized()
    parent, base = os.path.split(os.path.abspath(path))
    holder = [os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:12]}")]
    if distributed:
        dist.broadcast_object_list(holder, src=0)  # one temporary name for all ranks
    tmp = holder[0]
    os.makedirs(tmp, exist_ok=True)
    with warnings.catch_warnings():  # without a process group DCP warns that it saves in one process: intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(flat, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=not distributed)
    if not distributed or dist.get_rank() == 0:
        atomic_save(meta, os.path.join(tmp, META_FILE))
        fsync_dir(tmp)
        replace_path(tmp, path)
    # Nobody returns (and, e.g., removes an older top-k folder) before the new folder is in place. A crash before
    # this point leaves a hidden ".<name>.tmp-*" folder and the previous checkpoint untouched.
    if distributed:
        dist.barrier()


# ---------------------------------------------------------------------------------------------- load
def load_sharded(
    path: str, module: nn.Module, optimizers: Sequence[Any], grid: Grid, strict: bool = True, device_type: str = "cpu",
) -> dict[str, Any]:
    """Read this rank's slices of a sharded folder for the module's current layout (collective over the world).

    Returns a Lightning checkpoint dict whose ``state_dict`` and ``optimizer_states`` hold local shards, marked
    with :data:`LOCAL_LAYOUT_KEY`. Raises :class:`CheckpointMismatchError` before reading any tensor if the
    checkpoint's names or dense shapes do not fit ``module``.
    """
    meta = torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=True)
    info = meta.pop("dpmp_sharded")
    saved = _tensor_meta(path)
    fused = info.get("fused", {})
    shapes = _logical_shapes(saved, fused)
    saved_model = {k[len("model/"):]: v for k, v in shapes.items() if k.startswith("model/")}
    check_state_matches(dense_shapes(module, grid.mp_group), saved_model, strict)
    dims, blocks = shard_dims(module), shard_blocks(module)
    mesh = _mesh(grid, device_type) if dims else None
    reads = _Reads(saved, fused, mesh, grid.mp_group)
    local_state: dict[str, Any] = dict(info["model_extra"])
    for key, t in module.state_dict().items():
        if isinstance(t, Tensor) and key in saved_model:
            local_state[key] = torch.empty_like(t)
            reads.add(f"model/{key}", local_state[key], dims.get(key), blocks.get(key, 1))
    opt_states = []
    for i, (opt, oinfo) in enumerate(zip(optimizers, info["optimizers"])):
        inner = compat.unwrap_optimizer(opt)
        names, pdims = optimizer_param_names(inner, module), optimizer_param_dims(inner, module)
        pblocks = optimizer_param_blocks(inner, module)
        params = [p for g in inner.param_groups for p in g["params"]]
        if names != oinfo["param_names"]:
            pairs = list(zip_longest(names, oinfo["param_names"]))
            at = next(j for j, (ours, theirs) in enumerate(pairs) if ours != theirs)
            raise CheckpointMismatchError(
                f"Checkpoint does not match optimizer {i}: its parameter #{at} is {pairs[at][1]!r} in the checkpoint"
                f" but {pairs[at][0]!r} in the model."
            )
        state: dict[int, dict[str, Any]] = {}
        for idx, entries in oinfo["layout"].items():
            state[idx] = {}
            for key, is_tensor, value in entries:
                if not is_tensor:
                    state[idx][key] = value
                    continue
                name = f"optim{i}/{names[idx]}/{key}"
                size = shapes[name]
                split = pdims[idx] is not None and size == dense_param_shape(params[idx], pdims[idx], grid,
                                                                             pblocks[idx])
                dtype = saved[name if name in saved else _block_key(name, 0)].properties.dtype
                local = torch.empty(params[idx].shape if split else size, dtype=dtype, device=params[idx].device)
                state[idx][key] = local
                reads.add(name, local, pdims[idx] if split else None, pblocks[idx] if split else 1)
        opt_states.append({"state": state, "param_groups": oinfo["param_groups"]})
    reads.load(path)
    meta["state_dict"] = local_state
    if info["optimizers"]:  # absent for save_weights_only checkpoints, as in Lightning's own files
        meta["optimizer_states"] = opt_states
    meta[LOCAL_LAYOUT_KEY] = True
    return meta


def dense_param_shape(p: Tensor, dim: Optional[int], grid: Grid, blocks: Blocks = 1) -> tuple[int, ...]:
    """Dense shape of a (possibly split) parameter."""
    shape = list(p.shape)
    if dim is not None:
        shape[dim] = dense_size(blocks, shape[dim], grid.mp)
    return tuple(shape)


def load_sharded_full(path: str) -> dict[str, Any]:
    """Read a sharded folder into one dense, consolidated Lightning checkpoint (one process, no process group).

    Holds the whole model and optimizer state in memory: this is the converter's path
    (:func:`lightning_dpmp.checkpoint.convert.convert`), not the training one.
    """
    path = str(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a sharded DPMPStrategy checkpoint (no {META_FILE} inside).")
    meta = torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=True)
    info = meta.pop("dpmp_sharded")
    saved = _tensor_meta(path)
    targets = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in saved.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, storage_reader=_SafeReader(path), planner=_SafePlanner(), no_dist=True)
    fused = info.get("fused", {})
    for key in fused:  # fused tensors: their blocks stacked back in order, along the dim they were split on
        blocks, dim = _fused(fused, key)
        targets[key] = torch.cat([targets.pop(_block_key(key, i)) for i in range(_count(blocks))], dim=dim)
    state: dict[str, Any] = {k: targets[f"model/{k}"] for k in info["model_keys"]}
    state.update(info["model_extra"])
    opt_states = []
    for i, oinfo in enumerate(info["optimizers"]):
        names = oinfo["param_names"]
        per = {idx: {key: (targets[f"optim{i}/{names[idx]}/{key}"] if is_tensor else value)
                     for key, is_tensor, value in entries} for idx, entries in oinfo["layout"].items()}
        opt_states.append({"state": per, "param_groups": oinfo["param_groups"]})
    meta["state_dict"] = state
    if info["optimizers"]:
        meta["optimizer_states"] = opt_states
    return meta
