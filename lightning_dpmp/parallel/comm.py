"""Autograd-aware collectives over an explicit process group.

Each primitive is a tiny ``torch.autograd.Function`` whose forward and backward are conjugate: what one direction
reduces, the other copies, and what one gathers, the other splits. All of them are the identity when the group has
one member, so ``mp=1`` costs nothing. ``dim`` names a tensor dimension (the last, feature, one by default).

Example:
    >>> x = partial = torch.ones(2, 4)
    >>> y = copy_to_group(x, grid.mp_group)        # forward: identity, backward: all-reduce
    >>> z = reduce_from_group(partial, grid.mp_group)  # forward: all-reduce, backward: identity
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_reduce_sum",
    "copy_to_group",
    "gather_from_group",
    "gather_from_sequence",
    "group_rank",
    "group_size",
    "reduce_from_group",
    "reduce_scatter_to_sequence",
    "scatter_to_group",
]


def group_size(group: Optional[Any]) -> int:
    """Members of ``group``; 1 when torch.distributed is not initialised (single-process use)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional[Any]) -> int:
    """This process's rank inside ``group``; 0 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_reduce_sum(tensor: Tensor, group: Optional[Any]) -> Tensor:
    """In-place SUM all-reduce (no autograd); returns ``tensor``."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _split(x: Tensor, dim: int, group: Any) -> Tensor:
    # The chunk is a view; .contiguous() so that later in-place collectives and matmuls see dense memory.
    return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


def _gather(x: Tensor, dim: int, group: Any) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: Tensor, dim: int, group: Any) -> Tensor:
    parts = [p.contiguous() for p in x.chunk(group_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    """forward: identity; backward: all-reduce the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # Clone: autograd may hand this same gradient tensor to another branch (e.g. both sides of a residual add),
        # and an in-place all-reduce would change it under that branch's feet.
        return all_reduce_sum(grad.contiguous().clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        # The input is a partial sum freshly made by a matmul and saved by no one: reduce it in place, no copy.
        if not x.is_contiguous():
            return all_reduce_sum(x.contiguous(), group)
        ctx.mark_dirty(x)
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """forward: all-gather and concatenate along ``dim``; backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _split(grad, ctx.dim, ctx.group), None, None


class _ScatterToGroup(torch.autograd.Function):
    """forward: keep this rank's slice along ``dim``; backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """forward: reduce-scatter along ``dim`` (the sequence); backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    """forward: all-gather along ``dim`` (the sequence); backward: reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


def copy_to_group(x: Tensor, group: Any) -> Tensor:
    """Enter a parallel region: forward identity, backward all-reduce (sums the input gradient of all shards)."""
    return _CopyToGroup.apply(x, group) if group_size(group) > 1 else x


def reduce_from_group(x: Tensor, group: Any) -> Tensor:
    """Leave a parallel region by summing partial results: forward all-reduce, backward identity."""
    return _ReduceFromGroup.apply(x, group) if group_size(group) > 1 else x


def gather_from_group(x: Tensor, group: Any, dim: int = -1) -> Tensor:
    """Assemble a tensor sharded along ``dim``: forward all-gather, backward split."""
    return _GatherFromGroup.apply(x, group, dim) if group_size(group) > 1 else x


def scatter_to_group(x: Tensor, group: Any, dim: int = -1) -> Tensor:
    """Keep this rank's slice of a replicated tensor: forward split, backward all-gather."""
    return _ScatterToGroup.apply(x, group, dim) if group_size(group) > 1 else x


def reduce_scatter_to_sequence(x: Tensor, group: Any, dim: int = 1) -> Tensor:
    """Sequence parallel exit: forward reduce-scatter along the sequence, backward all-gather."""
    return _ReduceScatterToSequence.apply(x, group, dim) if group_size(group) > 1 else x


def gather_from_sequence(x: Tensor, group: Any, dim: int = 1) -> Tensor:
    """Sequence parallel entry: forward all-gather along the sequence, backward reduce-scatter."""
    return _GatherFromSequence.apply(x, group, dim) if group_size(group) > 1 else x
