"""Initial weights read slice by slice: a dense checkpoint (Hugging Face safetensors, one file or a sharded index,
or a Lightning / torch checkpoint of the plain model) loaded into a model that is split, each rank reading only the
slices it keeps.

A model built with its parameters on the meta device is marked with :func:`defer_weights`; after the strategy has
split and materialised it, :func:`load_deferred` reads, for every tensor of the split model, exactly the rows or
columns this MP rank holds (``safe_open(...).get_slice``; a memory-mapped ``torch.load`` for ``.ckpt`` files), one
tensor at a time, through the same shard metadata (:func:`~lightning_dpmp.parallel.sharding.shard_dims`, fused
blocks) that checkpoints use. Tied and aliased parameters are read once, frozen parameters stay frozen, and names
saved once for a tied pair (``lm_head.weight`` with ``embed_tokens.weight``) are found under the other name.

Example:
    >>> files = WeightFiles("pretrained/")                        # doctest: +SKIP
    >>> files.read("model.layers.0.mlp.up_proj.weight", dim=0, parts=2, part=1).shape   # doctest: +SKIP
    torch.Size([32, 32])
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dpmp.checkpoint.consolidated import dense_shapes
from lightning_dpmp.checkpoint.files import load_file
from lightning_dpmp.parallel.comm import group_rank, group_size
from lightning_dpmp.parallel.freed_reads import storage_freed
from lightning_dpmp.parallel.sharding import (
    MATERIALIZED_ATTR,
    Blocks,
    block_piece,
    dense_block_sizes,
    shard_blocks,
    shard_dims,
    shard_tensor,
)

__all__ = [
    "DEFERRED_ATTR",
    "ConvertedWeights",
    "DeferredWeights",
    "RankZeroWeights",
    "WeightFiles",
    "defer_loading",
    "defer_weights",
    "load_deferred",
    "loading_deferred",
    "match_keys",
    "note_deferring_strategy",
]

SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFERRED_ATTR = "_dpmp_deferred_weights"  # on a module: the DeferredWeights that fill it after the split


def _safe_open(file: str) -> Any:
    """``safetensors.safe_open(file)`` on the CPU (safetensors comes with transformers: imported when needed)."""
    from safetensors import safe_open

    return safe_open(file, "pt", device="cpu")


class WeightFiles:
    """The dense tensors of a checkpoint by name, read in slices.

    Args:
        path: a folder holding ``model.safetensors`` or a sharded index (``model.safetensors.index.json``) as
            ``save_pretrained`` writes them, a single ``.safetensors`` file, or a Lightning / torch checkpoint file
            (its ``state_dict``, or the file's own mapping when it has none).
    """

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self._where: dict[str, str] = {}  # key -> safetensors file
        self._state: Optional[Mapping[str, Any]] = None  # torch checkpoint (memory-mapped)
        self._shapes: dict[str, tuple[int, ...]] = {}
        if os.path.isdir(self.path):
            index = os.path.join(self.path, SAFETENSORS_INDEX)
            if os.path.exists(index):
                with open(index) as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
            else:
                files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{self.path} holds no model.safetensors, no {SAFETENSORS_INDEX} and no other .safetensors"
                    " file (a folder written by save_pretrained has one of them).")
            for name in files:
                self._add_file(os.path.join(self.path, name))
        elif self.path.endswith(".safetensors"):
            self._add_file(self.path)
        elif os.path.isfile(self.path):
            loaded = load_file(self.path)  # weights_only=True, memory-mapped: no page is read before it is sliced
            state = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else None
            if not isinstance(state, Mapping):
                raise ValueError(f"{self.path} holds no state_dict (found {type(loaded).__name__}).")
            self._state = {k: v for k, v in state.items() if isinstance(v, Tensor)}
            self._shapes = {k: tuple(v.shape) for k, v in self._state.items()}
        else:
            raise FileNotFoundError(f"No pretrained weights at {self.path}.")

    def _add_file(self, file: str) -> None:
        """Record where each tensor of one safetensors file is, and its shape (the header only)."""
        with _safe_open(file) as f:
            for key in f.keys():
                self._where[key] = file
                self._shapes[key] = tuple(f.get_slice(key).get_shape())

    def keys(self) -> list[str]:
        """Every tensor name in the checkpoint, in its order."""
        return list(self._shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        """The dense shape of ``key``."""
        return self._shapes[key]

    def read(self, key: str, dim: Optional[int] = None, parts: int = 1, part: int = 0, blocks: Blocks = 1) -> Tensor:
        """Part ``part`` of ``parts`` of ``key`` along ``dim`` (the whole tensor when ``dim`` is None); with
        ``blocks`` (fused q|k|v, or a padded vocabulary), that part of each block, concatenated, as
        :func:`~lightning_dpmp.parallel.sharding.shard_tensor` cuts it. Only those elements are read."""
        shape = self._shapes[key]
        ranges = [(0, shape[dim] if dim is not None else 0, 0)]  # (first, end, zero rows after: the padding)
        if dim is not None and parts > 1:
            if isinstance(blocks, int) and shape[dim] % (blocks * parts):
                raise ValueError(f"{key}: dim {dim} of size {shape[dim]} does not split into {blocks} block(s) x"
                                 f" mp={parts}.")
            ranges, start = [], 0
            for size in dense_block_sizes(blocks, shape[dim]):
                first, real, each = block_piece(size, parts, part)
                ranges.append((start + first, start + first + real, each - real))
                start += size
        pieces = []
        for lo, hi, pad in ranges:
            piece = self._read_range(key, dim, lo, hi)
            if pad:
                assert dim is not None
                zeros = list(piece.shape)
                zeros[dim] = pad
                piece = torch.cat([piece, piece.new_zeros(zeros)], dim=dim)
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim if dim is not None else 0)

    def _read_range(self, key: str, dim: Optional[int], lo: int, hi: int) -> Tensor:
        index = tuple([slice(None)] * dim + [slice(lo, hi)]) if dim is not None else ()
        if self._state is not None:
            t = self._state[key]
            return (t[index] if index else t).clone()  # a copy: the mapped file is not kept alive
        # Opened per tensor: the mapping (and the pages it touched, which count in RSS) closes with each read.
        with _safe_open(self._where[key]) as f:
            sl = f.get_slice(key)
            return sl[index] if index else sl[:]


#: ``make(read)`` of a converted group: reads each of its source tensors whole through ``read(key)`` and returns the
#: model's tensors it makes, by the model's names.
MakeTensors = Callable[[Callable[[str], Tensor]], dict[str, Tensor]]


class ConvertedWeights:
    """A checkpoint stored in another layout than the model's, read under the model's names.

    Some tensors are the checkpoint's under another name (``renamed``: model key -> checkpoint key), read in slices
    as :class:`WeightFiles` reads them; others are made from several checkpoint tensors (``groups``: Mixtral's
    per-expert ``w1``/``w3`` stacked into one ``gate_up_proj``), made whole when first read, sliced, and dropped
    once the next group is made, so a rank holds at most one group's tensors beyond its slices. The shapes of made
    tensors are found by making them once from meta tensors (no data read).

    Args:
        files: the checkpoint.
        renamed: model key -> checkpoint key, read as they are.
        groups: ``(checkpoint keys, make)`` for the tensors made from several (see ``MakeTensors``).
    """

    def __init__(self, files: WeightFiles, renamed: Mapping[str, str], groups: list[tuple[list[str], MakeTensors]]
                 ) -> None:
        self.files, self.path = files, files.path
        self._renamed = dict(renamed)
        self._groups = groups
        self._owner: dict[str, int] = {}
        self._shapes = {k: files.shape(src) for k, src in self._renamed.items()}
        for i, (_, make) in enumerate(groups):
            for key, t in make(lambda k: torch.empty(files.shape(k), device="meta")).items():
                self._owner[key], self._shapes[key] = i, tuple(t.shape)
        self._made: tuple[int, dict[str, Tensor]] = (-1, {})

    def keys(self) -> list[str]:
        """The model's names this checkpoint holds a tensor for."""
        return list(self._shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        """The dense shape of the model's ``key``."""
        return self._shapes[key]

    def read(self, key: str, dim: Optional[int] = None, parts: int = 1, part: int = 0, blocks: Blocks = 1) -> Tensor:
        """As :meth:`WeightFiles.read`, under the model's name ``key``."""
        if key in self._renamed:
            return self.files.read(self._renamed[key], dim, parts, part, blocks)
        i = self._owner[key]
        if self._made[0] != i:
            self._made = (-1, {})  # the previous group's tensors go before the next are made
            self._made = (i, self._groups[i][1](self.files.read))
        full = self._made[1][key]
        return full.clone() if dim is None or parts == 1 else shard_tensor(full, dim, parts, part, blocks).clone()


def match_keys(module: nn.Module, names: list[str], prefix: Optional[str] = None) -> dict[str, str]:
    """For each ``state_dict`` key of ``module``, the checkpoint name that holds it.

    Tried in order: the key itself; another name of the same tensor (a tied weight saved once); and, for the whole
    model at once, the checkpoint's names with a leading ``prefix`` added or removed (transformers' base-model
    prefix, e.g. a ``LlamaModel`` read from a ``LlamaForCausalLM`` folder). Last, a module wrapped after loading
    (an adapter layer registered under the old name, holding the original one as a child): the key with one inner
    level left out, ``q_proj.base_layer.weight`` -> ``q_proj.weight``, when exactly one such name exists and no
    other key took it. Keys found nowhere are left out.
    """
    state = module.state_dict(keep_vars=True)
    available = set(names)
    candidates = [("", "")]
    if prefix:
        candidates += [(f"{prefix}.", ""), ("", f"{prefix}.")]  # (add to our key, strip from our key)

    def rename(key: str, add: str, strip: str) -> str:
        return add + key[len(strip):] if key.startswith(strip) else add + key

    add, strip = max(candidates, key=lambda c: sum(rename(k, *c) in available for k in state))
    found = {k: rename(k, add, strip) for k in state if rename(k, add, strip) in available}
    by_tensor: dict[int, str] = {}
    for k, t in state.items():
        if k in found and isinstance(t, Tensor):
            by_tensor.setdefault(id(t), found[k])
    for k, t in state.items():
        if k not in found and isinstance(t, Tensor) and id(t) in by_tensor:
            found[k] = by_tensor[id(t)]  # an alias of a tensor stored under another name
    taken = set(found.values())
    for k in state:
        if k in found:
            continue
        parts = k.split(".")
        inner = {rename(".".join(parts[:i] + parts[i + 1:]), add, strip) for i in range(1, len(parts) - 1)}
        hits = [n for n in inner if n in available and n not in taken]
        if len(hits) == 1:
            found[k] = hits[0]
            taken.add(hits[0])
    return found


class RankZeroWeights:
    """The dense tensors global rank 0 holds, read by every rank in slices (collective over the world): for each
    tensor, rank 0 broadcasts it, each rank keeps its slice and frees the rest, so no other rank ever holds more
    than one dense tensor. Every rank must read the same keys in the same order.

    Args:
        state: rank 0's dense ``state_dict`` (``None`` on the other ranks).
        device: where the broadcast happens (the strategy's root device: NCCL needs CUDA tensors).
    """

    def __init__(self, state: Optional[Mapping[str, Tensor]], device: torch.device) -> None:
        self.path = "rank 0's model"
        self._state = state
        self._device = device
        box = [{k: (tuple(v.shape), v.dtype) for k, v in state.items() if isinstance(v, Tensor)} if state else None]
        dist.broadcast_object_list(box, src=0)
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = box[0] or {}

    def keys(self) -> list[str]:
        return list(self._meta)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._meta[key][0]

    def read(self, key: str, dim: Optional[int] = None, parts: int = 1, part: int = 0, blocks: Blocks = 1) -> Tensor:
        shape, dtype = self._meta[key]
        if self._state is not None:
            full = self._state[key].detach().to(self._device)
        else:
            full = torch.empty(shape, dtype=dtype, device=self._device)
        dist.broadcast(full, src=0)
        return full if dim is None or parts == 1 else shard_tensor(full, dim, parts, part, blocks).clone()


@dataclass
class DeferredWeights:
    """Weights to read into a module once it is split: where they are, and whether every tensor must be found."""

    source: Union[str, RankZeroWeights]  # a path for WeightFiles, or rank 0's tensors
    strict: bool = True
    prefix: Optional[str] = None  # a base-model prefix the checkpoint's names may carry or lack (see match_keys)
    # the files' layout -> the model's, when they differ (a transformers checkpoint it converts on load)
    convert: Optional[Callable[[WeightFiles], Optional[ConvertedWeights]]] = None

    def open(self) -> Union[WeightFiles, ConvertedWeights, RankZeroWeights]:
        if not isinstance(self.source, str):
            return self.source
        files = WeightFiles(self.source)
        converted = self.convert(files) if self.convert is not None else None
        return converted if converted is not None else files


def defer_weights(module: nn.Module, path: str, strict: bool = True, prefix: Optional[str] = None,
                  convert: Optional[Callable[[WeightFiles], Optional[ConvertedWeights]]] = None) -> nn.Module:
    """Mark ``module`` (its parameters on the meta device) to be filled from ``path`` after the split; the
    strategy then calls :func:`load_deferred`. ``convert``: the files seen under the model's names when their
    layout differs (``None`` from it: read as they are). Returns ``module``."""
    WeightFiles(str(path))  # fail now, with the path named, rather than at setup on every rank
    module.__dict__[DEFERRED_ATTR] = DeferredWeights(str(path), strict, prefix, convert)
    return module


def load_deferred(root: nn.Module, mp_group: Any) -> dict[str, int]:
    """Fill every module marked by :func:`defer_weights` under ``root`` with its slices (no communication).

    Returns ``{"tensors": ..., "elements": ...}`` read by this rank. Raises ``KeyError`` naming the first tensor
    the checkpoint lacks (``strict``) or ``ValueError`` naming one whose shape differs, before anything is copied.
    """
    read = {"tensors": 0, "elements": 0}
    parts, part = group_size(mp_group), group_rank(mp_group)
    for _, module in root.named_modules():
        spec = module.__dict__.pop(DEFERRED_ATTR, None)
        if spec is None:
            continue
        files = spec.open()
        state = module.state_dict(keep_vars=True)
        names = match_keys(module, files.keys(), spec.prefix)
        dims, blocks = shard_dims(module), shard_blocks(module)
        # tensors that were real before the split (adapters added after from_pretrained, initialised by the code
        # that added them) are not missing; those materialize allocated from meta are
        missing = [k for k, t in state.items() if k not in names and (not isinstance(t, Tensor) or t.is_meta
                                                                     or getattr(t, MATERIALIZED_ATTR, False))]
        if spec.strict and missing:
            raise KeyError(f"{files.path} has no tensor for {missing[0]!r} ({len(missing)} missing in all) of"
                           f" {type(module).__name__}; pass strict=False to keep their initial values.")
        dense = dense_shapes(module, mp_group)
        for key, name in names.items():
            if dense[key] != files.shape(name):
                raise ValueError(f"{files.path}: {name!r} has shape {files.shape(name)} but the model's {key!r} is"
                                 f" {dense[key]}.")
        done: set[int] = set()
        with torch.no_grad():
            for key, name in names.items():
                target = state[key]
                if id(target) in done:
                    continue
                done.add(id(target))
                if storage_freed(target):  # (a pipeline's other stage: freed; its owner reads it)
                    if isinstance(files, RankZeroWeights):
                        files.read(name)  # (collective: every rank takes part in rank 0's broadcast of each tensor)
                    continue
                dim = dims.get(key)
                local = files.read(name, dim, parts if dim is not None else 1, part, blocks.get(key, 1))
                target.copy_(local)
                read["tensors"] += 1
                read["elements"] += local.numel()
                del local  # before the next read: one tensor's slice at a time
    return read


# Whether a pretrained model built now will be split by DPMPStrategy (so its loading can wait for the split): set
# inside the strategy's init contexts (configure_model, init_module), or once a strategy exists in this process.
_DEFERRING: ContextVar[bool] = ContextVar("dpmp_defer_loading", default=False)
_STRATEGIES: "weakref.WeakSet[Any]" = weakref.WeakSet()


@contextmanager
def defer_loading() -> Iterator[None]:
    """Inside: :func:`loading_deferred` is True (the strategy's ``configure_model`` / ``init_module`` contexts)."""
    token = _DEFERRING.set(True)
    try:
        yield
    finally:
        _DEFERRING.reset(token)


def note_deferring_strategy(owner: object) -> None:
    """Record ``owner``, a live strategy that splits models after building them (a weak reference: only its
    lifetime is read)."""
    _STRATEGIES.add(owner)


def loading_deferred() -> bool:
    """Whether weights loaded now can be read slice by slice after a split: inside :func:`defer_loading`, or with a
    strategy recorded by :func:`note_deferring_strategy` alive in this process."""
    return _DEFERRING.get() or len(_STRATEGIES) > 0
