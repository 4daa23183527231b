"""Consolidated checkpoints: dense model and optimizer state under the dense names, gathered from and sliced back
into the shards, and checked against the model before anything is loaded.

A consolidated checkpoint is an ordinary Lightning checkpoint: ``state_dict`` holds dense tensors under the dense
model's names, and each optimizer's ``state`` holds per-parameter tensors (AdamW moments) of dense shape, keyed by
the dense model's parameter order. It loads into the plain model (``weights_only=True``, ``strict=True``) and
resumes under any ``(dp, mp)``. Alongside, ``checkpoint["dpmp"]`` records the layout that wrote it and every
rank's RNG states (:mod:`lightning_dpmp.checkpoint.rng_states`); the file is written atomically and loaded with
``weights_only=True`` (:mod:`lightning_dpmp.checkpoint.files`).

Memory: only the MP group of DP rank 0 gathers, one parameter at a time, onto its first rank (global rank 0, which
writes); no other rank ever holds more than its own shards. Loading maps the file (``mmap=True``), so each rank
reads only the slices it keeps.

Example:
    >>> module = nn.Linear(2, 2)
    >>> state = gather_state_dict(module.state_dict(), shard_dims(module), grid.mp_group)
    >>> sorted(state)
    ['bias', 'weight']
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Callable, Optional

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dpmp.parallel.comm import group_rank, group_size
from lightning_dpmp.parallel.sharding import (
    Blocks,
    DenseGather,
    dense_meta,
    dense_size,
    gather_to_first,
    shard_blocks,
    shard_dims,
    shard_tensor,
)

__all__ = [
    "CheckpointMismatchError",
    "check_state_matches",
    "consolidate_optimizer",
    "consolidate_optimizer_state",
    "dense_param_shape",
    "dense_shapes",
    "element_wise_keys",
    "gather_state_dict",
    "optimizer_param_blocks",
    "optimizer_param_dims",
    "optimizer_param_names",
    "optimizer_to_meta",
    "shard_optimizer_state",
    "shard_state_dict",
]


class CheckpointMismatchError(RuntimeError):
    """A checkpoint does not fit the model: names the first missing/unexpected key or the shapes that differ."""


# ---------------------------------------------------------------------------------------------- gathering / slicing
def gather_state_dict(
    state: Mapping[str, Any], dims: Mapping[str, int], group: Any, blocks: Optional[Mapping[str, Blocks]] = None
) -> dict[str, Any]:
    """Dense ``state`` on the group's first rank (split entries gathered one by one); ``state`` unchanged elsewhere."""
    out = dict(state)
    done: dict[tuple, Optional[Tensor]] = {}  # aliases of one weight (tied or shared modules) are gathered once
    for key, dim in dims.items():
        t = state[key]
        tag = (t.data_ptr(), tuple(t.shape), dim)
        if tag not in done:
            done[tag] = gather_to_first(t, group, dim, (blocks or {}).get(key, 1))
        if done[tag] is not None:
            out[key] = done[tag]
    return out


def optimizer_param_dims(optimizer: Optimizer, module: Any) -> list[Optional[int]]:
    """For each parameter in the optimizer's order, the dim it is split along, or ``None`` if replicated."""
    dims = shard_dims(module)
    by_id = {id(p): dims.get(name) for name, p in module.named_parameters()}
    return [by_id.get(id(p)) for group in optimizer.param_groups for p in group["params"]]


def optimizer_param_blocks(optimizer: Optimizer, module: Any) -> list[Blocks]:
    """For each parameter in the optimizer's order, its fused blocks (1 unless a fused projection or a padded
    vocabulary)."""
    blocks = shard_blocks(module)
    by_id = {id(p): blocks.get(name, 1) for name, p in module.named_parameters()}
    return [by_id.get(id(p), 1) for group in optimizer.param_groups for p in group["params"]]


def element_wise_keys(shaped: Mapping[int, set[str]], ndims: list[int]) -> set[str]:
    """The optimizer state keys that are element-wise (AdamW's moments, not its ``step``): those shaped like their
    parameter (``shaped``: per parameter index, the keys whose tensor has its shape) for some parameter with at
    least one dimension. A 0-d parameter's scalar state is shaped like it either way; this tells them apart.

    Example:
        >>> sorted(element_wise_keys({0: {"exp_avg"}, 1: {"exp_avg", "step"}}, [2, 0]))
        ['exp_avg']
    """
    return {k for idx, keys in shaped.items() if ndims[idx] > 0 for k in keys}


def optimizer_param_names(optimizer: Optimizer, module: nn.Module) -> list[str]:
    """Dense name of each parameter in the optimizer's order (``param_<i>`` for one the module does not own)."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [by_id.get(id(p), f"param_{i}") for i, p in enumerate(params)]


def _map_state(
    state: dict[str, Any], param_dims: list[Optional[int]], fn: Callable[[Tensor, int, Blocks], Any],
    param_blocks: Optional[list[Blocks]] = None,
) -> dict[str, Any]:
    out = copy.copy(state)
    out["state"] = {}
    for idx, per_param in state.get("state", {}).items():
        dim = param_dims[idx] if idx < len(param_dims) else None
        blocks: Blocks = param_blocks[idx] if param_blocks and idx < len(param_blocks) else 1
        out["state"][idx] = {
            k: (fn(v, dim, blocks) if dim is not None and isinstance(v, Tensor) and v.dim() > dim else v)
            for k, v in per_param.items()
        }
    return out


def consolidate_optimizer_state(
    state: dict[str, Any], param_dims: list[Optional[int]], group: Any, param_blocks: Optional[list[Blocks]] = None
) -> dict[str, Any]:
    """Gather the split per-parameter tensors of an optimizer ``state_dict`` onto the group's first rank.

    Collective over ``group``; the other ranks get ``state`` back unchanged.
    """
    if group_size(group) == 1:
        return state
    gathered = _map_state(state, param_dims, lambda v, d, b: gather_to_first(v, group, d, b), param_blocks)
    return gathered if group_rank(group) == 0 else state


def shard_optimizer_state(
    state: dict[str, Any], param_dims: list[Optional[int]], group: Any, param_blocks: Optional[list[Blocks]] = None
) -> dict[str, Any]:
    """Keep this rank's slice of each split per-parameter tensor of a consolidated optimizer ``state_dict``."""
    n, r = group_size(group), group_rank(group)
    if n == 1:
        return state
    return _map_state(state, param_dims, lambda v, d, b: shard_tensor(v, d, n, r, b).clone(), param_blocks)


def shard_state_dict(
    state: Mapping[str, Any], dims: Mapping[str, int], group: Any, blocks: Optional[Mapping[str, Blocks]] = None
) -> dict[str, Any]:
    """Slice the dense entries of a consolidated model ``state_dict`` for a parallelised module (no communication)."""
    n, r = group_size(group), group_rank(group)
    out = dict(state)
    for key, dim in dims.items():
        b = (blocks or {}).get(key, 1)
        if key in out and isinstance(out[key], Tensor) and (
                out[key].shape[dim] % n == 0 if isinstance(b, int) else out[key].shape[dim] == sum(b)):
            out[key] = shard_tensor(out[key], dim, n, r, b)
    return out


def consolidate_optimizer(
    optimizer: Optimizer, moved: Mapping[int, tuple[Any, Optional[int], Blocks]], group: Any,
    gather: Optional[DenseGather] = None,
) -> None:
    """Point ``optimizer`` at the dense parameters :func:`~lightning_dpmp.planner.apply_plan.consolidate` made,
    with its per-parameter state gathered to dense shapes (collective over MP; ``gather`` as there: a rank that
    does not keep the result gets the dense state's shapes on the meta device)."""
    gather = gather if gather is not None else DenseGather()
    for pg in optimizer.param_groups:
        new_params = []
        for p in pg["params"]:
            dense, dim, blocks = moved.get(id(p), (p, None, 1))
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[dense] = {
                    k: (_dense_state(v, dim, group, blocks, gather)
                        if dim is not None and isinstance(v, Tensor) and v.shape == p.shape else v)
                    for k, v in state.items()
                }
            new_params.append(dense)
        pg["params"] = new_params


def _dense_state(v: Tensor, dim: int, group: Any, blocks: Blocks, gather: DenseGather) -> Tensor:
    full = gather(v.detach(), dim, group, blocks)
    return full if full is not None and gather.keep else dense_meta(v, dim, group, blocks)


def optimizer_to_meta(optimizer: Optimizer, params: Mapping[int, nn.Parameter]) -> None:
    """Point ``optimizer`` at the meta parameters ``params`` (``{id(old): new}``) and move its state tensors to the
    meta device: shapes kept, memory freed (a rank that does not keep the model after a run)."""
    for pg in optimizer.param_groups:
        new_params = []
        for p in pg["params"]:
            fresh = params.get(id(p), p)
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[fresh] = {
                    k: v.to("meta") if isinstance(v, Tensor) and v.dim() else v for k, v in state.items()
                }
            new_params.append(fresh)
        pg["params"] = new_params


# ---------------------------------------------------------------------------------------------- validation
def dense_shapes(module: nn.Module, group: Any) -> dict[str, tuple[int, ...]]:
    """Shape of every ``state_dict`` tensor of ``module`` as the dense model has it (split dims times the group)."""
    dims, blocks, n = shard_dims(module), shard_blocks(module), group_size(group)
    out: dict[str, tuple[int, ...]] = {}
    for key, t in module.state_dict().items():
        if isinstance(t, Tensor):
            shape = list(t.shape)
            if key in dims:
                shape[dims[key]] = dense_size(blocks.get(key, 1), shape[dims[key]], n)
            out[key] = tuple(shape)
    return out


def dense_param_shape(p: Tensor, dim: Optional[int], mp: int, blocks: Blocks = 1) -> tuple[int, ...]:
    """The dense shape of a tensor shaped like an MP-local parameter split along ``dim`` (``None``: whole).

    Example:
        >>> w = nn.Linear(4, 3).weight                     # (3, 4): a column shard of a (6, 4) weight at mp=2
        >>> dense_param_shape(w, 0, 2), dense_param_shape(w, None, 2)
        ((6, 4), (3, 4))
    """
    shape = list(p.shape)
    if dim is not None:
        shape[dim] = dense_size(blocks, shape[dim], mp)
    return tuple(shape)


def check_state_matches(
    expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], strict: bool
) -> None:
    """Raise :class:`CheckpointMismatchError` naming the first difference between model and checkpoint.

    Order: missing keys (in the model's order), unexpected keys (in the checkpoint's order), then shape mismatches,
    which are reported even with ``strict=False`` since no tensor of the wrong shape can be loaded.

    Example:
        >>> check_state_matches({"w": (4, 2)}, {"w": (4, 3)}, strict=True)
        Traceback (most recent call last):
        ...
        lightning_dpmp.checkpoint.consolidated.CheckpointMismatchError: Checkpoint does not match the model:
            'w' has shape (4, 3) in the checkpoint but (4, 2) in the model.
    """
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [k for k in expected if k in found and tuple(found[k]) != tuple(expected[k])]
    total = len(wrong) + (len(missing) + len(unexpected) if strict else 0)
    if not total:
        return
    if strict and missing:
        first = f"missing key {missing[0]!r} (shape {tuple(expected[missing[0]])} in the model)"
    elif strict and unexpected:
        first = f"unexpected key {unexpected[0]!r} (shape {tuple(found[unexpected[0]])} in the checkpoint)"
    else:
        k = wrong[0]
        first = f"{k!r} has shape {tuple(found[k])} in the checkpoint but {tuple(expected[k])} in the model"
    more = f" ({total - 1} more difference{'s' if total > 2 else ''})" if total > 1 else ""
    raise CheckpointMismatchError(f"Checkpoint does not match the model: {first}.{more}")
