"""Consolidated checkpoints: model and optimizer state gathered to dense shapes, and sliced back on load.

A consolidated checkpoint is an ordinary Lightning checkpoint: ``state_dict`` holds dense tensors under the dense
model's names, and each optimizer's ``state`` holds per-parameter tensors (AdamW moments) of dense shape, keyed by
the dense model's parameter order. It loads into the plain model and resumes under any ``(dp, mp)``.

Example:
    >>> full = consolidate_optimizer_state(optimizer.state_dict(), param_dims, grid.mp_group)  # doctest: +SKIP
    >>> optimizer.load_state_dict(shard_optimizer_state(full, param_dims, grid.mp_group))    # doctest: +SKIP
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Optional

from torch import Tensor
from torch.optim import Optimizer

from lightning_dpmp.comm import gather_from_group, group_rank, group_size
from lightning_dpmp.layers import shard_dims

__all__ = ["consolidate_optimizer", "consolidate_optimizer_state", "optimizer_param_dims", "shard_optimizer_state", "shard_state_dict"]


def optimizer_param_dims(optimizer: Optimizer, module: Any) -> list[Optional[int]]:
    """For each parameter in the optimizer's order, the dim it is split along, or ``None`` if replicated."""
    by_id = {}
    dims = shard_dims(module)
    for name, p in module.named_parameters():
        by_id[id(p)] = dims.get(name)
    return [by_id.get(id(p)) for group in optimizer.param_groups for p in group["params"]]


def _map_state(state: dict[str, Any], param_dims: list[Optional[int]], fn: Any) -> dict[str, Any]:
    out = copy.copy(state)
    out["state"] = {}
    for idx, per_param in state["state"].items():
        dim = param_dims[idx] if idx < len(param_dims) else None
        out["state"][idx] = {
            k: (fn(v, dim) if dim is not None and isinstance(v, Tensor) and v.dim() > dim else v)
            for k, v in per_param.items()
        }
    return out


def consolidate_optimizer_state(
    state: dict[str, Any], param_dims: list[Optional[int]], group: Any
) -> dict[str, Any]:
    """Gather the split per-parameter tensors of an optimizer ``state_dict`` (collective over MP)."""
    if group_size(group) == 1:
        return state
    return _map_state(state, param_dims, lambda v, d: gather_from_group(v.detach(), group, d))


def shard_optimizer_state(state: dict[str, Any], param_dims: list[Optional[int]], group: Any) -> dict[str, Any]:
    """Keep this rank's slice of each split per-parameter tensor of a consolidated optimizer ``state_dict``."""
    n, r = group_size(group), group_rank(group)
    if n == 1:
        return state
    return _map_state(state, param_dims, lambda v, d: v.chunk(n, dim=d)[r].clone())


def shard_state_dict(state: Mapping[str, Any], dims: Mapping[str, int], group: Any) -> dict[str, Any]:
    """Slice the dense entries of a consolidated model ``state_dict`` for a parallelised module (no communication)."""
    n, r = group_size(group), group_rank(group)
    out = dict(state)
    for key, dim in dims.items():
        if key in out and isinstance(out[key], Tensor) and out[key].shape[dim] % n == 0:
            out[key] = out[key].chunk(n, dim=dim)[r]
    return out


def consolidate_optimizer(optimizer: Optimizer, moved: Mapping[int, tuple[Any, Optional[int]]], group: Any) -> None:
    """Point ``optimizer`` at the dense parameters :func:`~lightning_dpmp.parallelize.consolidate` made, with its
    per-parameter state gathered to dense shapes (collective over MP)."""
    for pg in optimizer.param_groups:
        new_params = []
        for p in pg["params"]:
            dense, dim = moved.get(id(p), (p, None))
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[dense] = {
                    k: (gather_from_group(v.detach(), group, dim)
                        if dim is not None and isinstance(v, Tensor) and v.shape == p.shape else v)
                    for k, v in state.items()
                }
            new_params.append(dense)
        pg["params"] = new_params
