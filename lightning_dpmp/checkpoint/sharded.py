"""Sharded checkpoints: a folder written in parallel with ``torch.distributed.checkpoint`` (DCP), read into any layout.

Each rank writes only what it holds: each tensor is described to DCP by the rectangular chunks of the dense tensor
this rank holds (an MP shard is one chunk at its offset; ZeRO's flat DP slices, which may cut rows, are up to
``2·ndim - 1`` chunks each), so DCP stores every element once (replicas are deduplicated) and records the dense
shape. Nothing is gathered: no rank holds more than its own shards. Loading asks DCP for this rank's chunks of
the dense tensors under the *current* layout (into its ZeRO slices directly), which reshards ``(2, 2) -> (1, 4)``
or into a dense model (:mod:`lightning_dpmp.checkpoint.convert`).

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
import warnings
from collections.abc import Sequence
from itertools import zip_longest
from math import prod
from typing import Any, Optional, Protocol

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
    dense_param_shape,
    dense_shapes,
    element_wise_keys,
    optimizer_param_blocks,
    optimizer_param_dims,
    optimizer_param_names,
)
from lightning_dpmp.checkpoint.files import atomic_save, fsync_dir, replace_path, temp_sibling
from lightning_dpmp.checkpoint.held import Held, Piece, flat_boxes, held, held_of
from lightning_dpmp.parallel.comm import group_rank, group_size
from lightning_dpmp.parallel.grid import Grid
from lightning_dpmp.parallel.sharding import (
    Blocks,
    block_piece,
    local_block_sizes,
    shard_blocks,
    shard_dims,
    shard_tensor,
)

__all__ = [
    "LOCAL_LAYOUT_KEY", "META_FILE", "Holdings", "is_sharded_checkpoint", "load_sharded", "load_sharded_full",
    "save_sharded",
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


# ---------------------------------------------------------------------------------------------- chunks
class _Chunks(Tensor):
    """A stored tensor (its dense shape and dtype) of which this rank holds rectangular chunks, each a view into
    what it holds: DCP writes each chunk from, and reads each chunk into, that view. The protocol is the one
    ``DTensor`` implements (:func:`lightning_dpmp.compat.dcp_chunk_protocol`); a rank may hold any number of
    chunks, so ZeRO's flat DP slices, which cut rows, are written and read without gathering anything."""

    chunks: list[tuple[tuple[int, ...], tuple[int, ...], Tensor]]

    @staticmethod
    def of(shape: tuple[int, ...], dtype: torch.dtype, chunks: list[tuple[tuple[int, ...], tuple[int, ...], Tensor]],
           device: torch.device) -> _Chunks:
        out = compat.wrapper_tensor(_Chunks, shape, dtype, device)
        out.chunks = chunks
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise NotImplementedError(f"a checkpoint's chunk list has no data of its own ({func} called on it)")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        WriteItem, WriteItemType, TensorWriteData, Chunk, TensorProperties, MetadataIndex = compat.dcp_chunk_protocol()
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=Chunk(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                                                      properties=TensorProperties(dtype=self.dtype),
                                                      size=torch.Size(self.shape)))
                for offsets, sizes, _ in self.chunks]

    def __create_chunk_list__(self) -> list[Any]:
        Chunk = compat.dcp_chunk_protocol()[3]
        return [Chunk(offsets=torch.Size(o), sizes=torch.Size(z)) for o, z, _ in self.chunks]

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        for offsets, _, view in self.chunks:
            if tuple(offsets) == tuple(index.offset):
                return _own_storage(view)
        raise ValueError(f"no chunk of {index.fqn} at {tuple(index.offset)} on this rank")


def _own_storage(view: Tensor) -> Tensor:
    """``view`` aliased by a tensor whose storage is exactly its own bytes (no copy), where it is contiguous.

    DCP's writer keeps every tensor it wrote to a file until the file is closed, and clones one whose storage is
    larger than itself first: a chunk of a flat ZeRO shard would be copied, and all the copies held, a second copy
    of everything the rank holds. A storage slice shares the shard's memory and is exactly the chunk's size.
    """
    if view.numel() == 0 or not view.is_contiguous() or view.untyped_storage().nbytes() == view.nbytes:
        return view
    start = view.storage_offset() * view.element_size()
    part = view.untyped_storage()[start : start + view.nbytes]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(part, 0, view.shape, view.stride())


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


def _entries(key: str, shape: tuple[int, ...], dim: Optional[int], blocks: Blocks, mp: int, rank: int
             ) -> list[tuple[str, int, int, int, tuple[int, ...]]]:
    """Where an MP-local tensor of ``shape`` (split along ``dim`` in ``blocks``) lies in what is stored: per stored
    tensor, ``(key, first local row along dim, real rows, its first row there, its dense shape)``. A fused tensor
    (q|k|v in one weight, split block by block; or a padded vocabulary) is stored block by block, each block of its
    dense size (padding rows are not stored)."""
    if dim is None:
        return [(key, 0, 0, 0, shape)]
    local = shape[dim]

    def dense(size: int) -> tuple[int, ...]:
        return shape[:dim] + (size,) + shape[dim + 1:]

    if blocks == 1:
        return [(key, 0, local, rank * local, dense(local * mp))]
    out, at = [], 0
    for i, each in enumerate(local_block_sizes(blocks, local, mp)):
        if isinstance(blocks, int):
            out.append((_block_key(key, i), at, each, rank * each, dense(each * mp)))
        else:
            first, real, _ = block_piece(blocks[i], mp, rank)
            out.append((_block_key(key, i), at, real, first, dense(blocks[i])))
        at += each
    return out


def _chunk_map(key: str, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[Piece], dim: Optional[int],
               blocks: Blocks, mp: int, rank: int, device: torch.device) -> dict[str, _Chunks]:
    """The stored tensors an MP-local tensor's ``pieces`` (flat ranges this rank holds) fall into, each with this
    rank's chunks of it as views into the pieces."""
    entries = _entries(key, shape, dim, blocks, mp, rank)
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], Tensor]]] = {e[0]: [] for e in entries}
    for lo, hi, data in pieces:
        for offsets, sizes, start in flat_boxes(shape, lo, hi):
            view = data[start - lo : start - lo + prod(sizes)].view(sizes)
            for name, first, real, there, _ in entries:
                if dim is None:
                    chunks[name].append((offsets, sizes, view))
                    continue
                a, b = max(offsets[dim], first), min(offsets[dim] + sizes[dim], first + real)
                if a < b:
                    at = offsets[:dim] + (there + a - first,) + offsets[dim + 1:]
                    size = sizes[:dim] + (b - a,) + sizes[dim + 1:]
                    chunks[name].append((at, size, view.narrow(dim, a - offsets[dim], b - a)))
    return {name: _Chunks.of(dense, dtype, chunks[name], device) for name, _, _, _, dense in entries}


def _whole(t: Tensor) -> list[Piece]:
    """A tensor held whole, as pieces (one flat range)."""
    return [(0, t.numel(), t.detach().contiguous().view(-1))] if t.numel() else []


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
    """What one ``dcp.load`` asks for, and how each answer becomes what this rank holds afterwards.

    A logical tensor stored as it will be held (plain, or fused with the same blocks split the same way) is read
    straight into the pieces this rank holds (its local tensor, or its flat ZeRO slices); any other pairing reads
    the dense tensor (or its dense blocks), slices it, and copies the pieces out.
    """

    def __init__(self, saved: dict[str, TensorStorageMetadata], fused: dict[str, Any], group: Any) -> None:
        self.saved, self.fused, self.group = saved, fused, group
        self.mp, self.rank = group_size(group), group_rank(group)
        self.targets: dict[str, Tensor] = {}
        self.after: list[Any] = []

    def add(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[Piece], dim: Optional[int],
            blocks: Blocks, device: torch.device) -> None:
        """Fill ``pieces`` (flat ranges of this rank's tensor of ``shape``: split along ``dim`` in ``blocks``
        blocks, or whole) from ``key``."""
        stored, stored_dim = _fused(self.fused, key)
        if (stored == 1 and blocks == 1) or (stored == blocks and dim == stored_dim):
            self.targets.update(_chunk_map(key, shape, dtype, pieces, dim, blocks, self.mp, self.rank, device))
            return
        keys = [key] if stored == 1 else [_block_key(key, i) for i in range(_count(stored))]
        dense = [torch.empty(tuple(self.saved[k].size), dtype=self.saved[k].properties.dtype, device=device)
                 for k in keys]
        self.targets.update(zip(keys, dense))

        def finish() -> None:
            full = torch.cat(dense, dim=stored_dim)
            local = full if dim is None else shard_tensor(full, dim, self.mp, self.rank, blocks)
            flat = local.reshape(-1)
            for lo, hi, data in pieces:
                data.copy_(flat[lo:hi])

        self.after.append(finish)

    def load(self, path: str) -> None:
        dcp.load(self.targets, storage_reader=_SafeReader(path), planner=_SafePlanner())
        with torch.no_grad():
            for finish in self.after:
                finish()


# ---------------------------------------------------------------------------------------------- save
def save_sharded(
    checkpoint: dict[str, Any], path: str, module: nn.Module, optimizers: Sequence[Any], grid: Optional[Grid]
) -> None:
    """Write ``checkpoint`` (model/optimizer tensors as this rank's shards) as a folder at ``path``, atomically.

    Collective over the world. All ranks write into a temporary sibling folder; when DCP has finished, rank 0 adds
    ``dpmp_meta.pt`` and renames the folder over ``path``. A crash before the rename leaves the previous
    checkpoint untouched. Needs a filesystem that every rank sees at ``path``.
    """
    dims, blocks = shard_dims(module), shard_blocks(module)
    mp, rank = (group_size(grid.mp_group), group_rank(grid.mp_group)) if grid is not None else (1, 0)
    flat: dict[str, Tensor] = {}
    fused: dict[str, Any] = {}  # DCP key -> (blocks, dim), for tensors stored block by block

    def put(key: str, value: Tensor, dim: Optional[int], b: Blocks) -> None:
        info = held_of(value)  # ZeRO: this rank's flat slices; else the tensor, whole
        shape = tuple(info.local_shape or value.shape) if info is not None else tuple(value.shape)
        # A meta tensor is one this rank does not hold (after a teardown that left global rank 0 alone with the
        # model): it describes no chunk, and the rank holding the tensor writes it whole.
        pieces = info.pieces if info is not None else [] if value.is_meta else _whole(value)
        device = pieces[0][2].device if pieces else torch.device("cpu")  # (no pieces: nothing to write here)
        if dim is not None and b != 1 and mp > 1:
            fused[key] = (b if isinstance(b, int) else list(b), dim)
        flat.update(_chunk_map(key, shape, value.dtype, pieces, dim if mp > 1 else None, b, mp, rank, device))

    state = checkpoint.pop("state_dict", {})
    model_keys, model_extra = [], {}
    for key, value in state.items():
        if isinstance(value, Tensor):
            put(f"model/{key}", value, dims.get(key), blocks.get(key, 1))
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
                    info = held_of(value)
                    shape = tuple(info.local_shape or value.shape) if info is not None else tuple(value.shape)
                    split = shape == tuple(params[idx].shape) and pdims[idx] is not None
                    put(f"optim{i}/{names[idx]}/{key}", value, pdims[idx] if split else None, pblocks[idx])
                    entries.append((key, True, None))
                else:
                    entries.append((key, False, value))
            layout[idx] = entries
        optim_info.append({"param_names": names, "param_groups": st["param_groups"], "layout": layout})
    meta = {**checkpoint, "dpmp_sharded": {"format": FORMAT, "model_keys": model_keys, "model_extra": model_extra,
                                           "optimizers": optim_info, "fused": fused}}

    distributed = dist.is_available() and dist.is_initialized()
    holder = [temp_sibling(path)]
    if distributed:
        dist.broadcast_object_list(holder, src=0)  # one temporary name for all ranks
    tmp = holder[0]
    os.makedirs(tmp, exist_ok=True)
    with warnings.catch_warnings():  # without a process group DCP warns that it saves in one process: intended
        warnings.simplefilter("ignore", UserWarning)
        written = dcp.save(flat, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=not distributed)
    missing = None
    if not distributed or dist.get_rank() == 0:
        missing = _unwritten(flat, written)
        if missing is None:
            atomic_save(meta, os.path.join(tmp, META_FILE))
            fsync_dir(tmp)
            replace_path(tmp, path)
    # Nobody returns (and, e.g., removes an older top-k folder) before the new folder is in place. A crash before
    # this point leaves a hidden ".<name>.tmp-*" folder and the previous checkpoint untouched.
    if distributed:
        status = [missing]
        dist.broadcast_object_list(status, src=0)  # (rank 0's verdict, once the folder is in place: a barrier)
        missing = status[0]
    if missing is not None:
        raise RuntimeError(missing)


def _unwritten(flat: dict[str, Tensor], written: Any) -> Optional[str]:
    """Why the folder is incomplete, or ``None``: a tensor with elements that reached DCP's index from no rank (every
    rank held it on the meta device). Rank 0 holds every tensor a teardown leaves anywhere, so none should be."""
    stored = getattr(written, "state_dict_metadata", None)
    if stored is None:  # (a DCP that returns no index: nothing to compare with)
        return None
    missing = [k for k, t in flat.items() if k not in stored and prod(t.shape) > 0]
    if not missing:
        return None
    return (f"no rank holds {missing[0]!r} ({len(missing)} tensors in all): every rank has it on the meta device, so"
            " the sharded checkpoint was not written")


# ---------------------------------------------------------------------------------------------- load
class Holdings(Protocol):
    """Where this rank holds tensors in slices of its own (ZeRO's flat DP shards): a load reads straight into them."""

    def param_pieces(self, param: Tensor) -> Optional[list[Piece]]:
        """The pieces of ``param`` (the module's parameter object) this rank holds, or ``None`` if held whole."""

    def state_pieces(self, optimizer: int, param: Tensor, key: str, dtype: torch.dtype) -> Optional[list[Piece]]:
        """The pieces of optimizer ``optimizer``'s state ``key`` for ``param``, allocated (zeros of ``dtype``) if
        absent; ``None`` if that optimizer holds its state whole."""


def load_sharded(
    path: str, module: nn.Module, optimizers: Sequence[Any], grid: Grid, strict: bool = True,
    holdings: Optional[Holdings] = None,
) -> dict[str, Any]:
    """Read this rank's slices of a sharded folder for the module's current layout (collective over the world).

    Returns a Lightning checkpoint dict whose ``state_dict`` and ``optimizer_states`` hold local shards, marked
    with :data:`LOCAL_LAYOUT_KEY`. What ``holdings`` holds in slices (ZeRO) is read in place, into those slices,
    and stands in the dict as a held tensor (:mod:`lightning_dpmp.checkpoint.held`) saying so: no rank ever holds
    more than its own slices. Raises :class:`CheckpointMismatchError` before reading any tensor if the
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
    reads = _Reads(saved, fused, grid.mp_group)

    def read(key: str, like: Tensor, shape: tuple[int, ...], dtype: torch.dtype, pieces: Optional[list[Piece]],
             dim: Optional[int], b: Blocks) -> Tensor:
        """Ask for ``key``: into ``pieces`` (returned as a held tensor saying so), or into a new local tensor."""
        if pieces is not None:
            reads.add(key, shape, dtype, pieces, dim, b, like.device)
            return held(shape, dtype, Held(pieces=pieces, local_shape=shape))
        local = torch.zeros(shape, dtype=dtype, device=like.device)  # (zeros: padding rows are not stored)
        reads.add(key, shape, dtype, _whole(local), dim, b, like.device)
        return local

    local_state: dict[str, Any] = dict(info["model_extra"])
    for key, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, Tensor) and key in saved_model:
            pieces = holdings.param_pieces(t) if holdings is not None else None
            local_state[key] = read(f"model/{key}", t, tuple(t.shape), t.dtype, pieces, dims.get(key),
                                    blocks.get(key, 1))
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
        shaped = {idx: {key for key, is_tensor, _ in entries if is_tensor and shapes[f"optim{i}/{names[idx]}/{key}"]
                        == dense_param_shape(params[idx], pdims[idx], grid.mp, pblocks[idx])}
                  for idx, entries in oinfo["layout"].items()}
        element_wise = element_wise_keys(shaped, [p.dim() for p in params])
        state: dict[int, dict[str, Any]] = {}
        for idx, entries in oinfo["layout"].items():
            state[idx] = {}
            p = params[idx]
            for key, is_tensor, value in entries:
                if not is_tensor:
                    state[idx][key] = value
                    continue
                name = f"optim{i}/{names[idx]}/{key}"
                size = shapes[name]
                split = pdims[idx] is not None and key in shaped[idx]
                dtype = saved[name if name in saved else _block_key(name, 0)].properties.dtype
                shape = tuple(p.shape) if split else tuple(size)
                # shaped like the parameter (AdamW's moments, not its step): held as the parameter is
                held_so = key in shaped[idx] and (p.dim() > 0 or key in element_wise)
                pieces = holdings.state_pieces(i, p, key, dtype) if holdings is not None and held_so else None
                state[idx][key] = read(name, p, shape, dtype, pieces, pdims[idx] if split else None,
                                       pblocks[idx] if split else 1)
        opt_states.append({"state": state, "param_groups": oinfo["param_groups"]})
    reads.load(path)
    meta["state_dict"] = local_state
    if info["optimizers"]:  # absent for save_weights_only checkpoints, as in Lightning's own files
        meta["optimizer_states"] = opt_states
    meta[LOCAL_LAYOUT_KEY] = True
    return meta


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
