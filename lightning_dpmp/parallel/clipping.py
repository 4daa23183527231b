"""Gradient clipping by the norm of the whole (dense) gradient, computed from shards.

Each rank of an MP group holds 1/mp of every split parameter and all of every replicated one. The global squared
norm is the MP-sum of the split parameters' squared norms plus the replicated parameters' squared norm counted
once; every rank then scales by the same factor, exactly as single-process ``clip_grad_norm_`` would. Under
ZeRO-2/3 the gradients are flat DP shards (zero padding): the squares are then also summed over ``dp_group``.

Example:
    >>> params = [torch.nn.Parameter(torch.ones(3))]
    >>> params[0].grad = torch.full((3,), 2.0)
    >>> set_of_split_params: set[int] = set()          # those held 1/mp per rank (none at mp=1)
    >>> total = clip_grad_norm_(params, max_norm=1.0, split=set_of_split_params, group=grid.mp_group)
    >>> round(total.item(), 4), round(params[0].grad.norm().item(), 4)
    (3.4641, 1.0)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_dpmp.parallel.comm import all_reduce_sum
from lightning_dpmp.parallel.freed_reads import storage_freed

__all__ = ["clip_grad_norm_", "grad_norm", "sync_partial_grads"]


def grad_norm(params: Iterable[Tensor], split: set[int], group: Any, dp_group: Any = None, *,
              pp_group: Any = None, counted: Optional[set[int]] = None) -> Tensor:
    """The 2-norm of the dense gradient; ``split`` holds ``id()`` of the parameters that are MP shards;
    ``dp_group``: the gradients are also sharded over DP (ZeRO-2/3), every rank's part summed; ``pp_group``: the
    parameters live on pipeline stages, each counted only where ``counted`` holds it, the parts summed over PP."""
    params = list(params)
    grads = [(p.grad, id(p) in split) for p in params
             if p.grad is not None and (counted is None or id(p) in counted)]
    if not grads and pp_group is None:  # the same on every rank: DP shards get gradients from the same graph
        return torch.tensor(0.0)
    first = grads[0][0] if grads else next((p for p in params if p.grad is not None), torch.zeros(()))
    device, dtype = first.device, first.dtype
    sq = torch.zeros(2, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    for g, is_split in grads:
        sq[0 if is_split else 1] += torch.linalg.vector_norm(g.detach(), 2, dtype=sq.dtype) ** 2
    # One all-reduce for the split part only; the replicated part is identical on every MP rank.
    sharded = all_reduce_sum(sq[:1].clone(), group)
    total = sharded[0] + sq[1]
    if dp_group is not None:  # each DP rank holds 1/dp of every flat gradient (the padding is zero)
        total = all_reduce_sum(total.reshape(1), dp_group)[0]
    if pp_group is not None:  # each stage's own parameters
        total = all_reduce_sum(total.reshape(1), pp_group)[0]
    return total.sqrt()


def clip_grad_norm_(
    params: Iterable[Tensor], max_norm: float, split: set[int], group: Any, dp_group: Any = None, *,
    pp_group: Any = None, counted: Optional[set[int]] = None,
) -> Tensor:
    """Scale gradients in place so that their dense 2-norm is at most ``max_norm``; returns the norm before.
    ``dp_group``: the gradients are DP shards (ZeRO-2/3); ``pp_group``/``counted``: pipeline stages
    (:func:`grad_norm`)."""
    # (a pipeline's other stages' gradients that user code may read are copies, freed unless read: not scaled here,
    # their owners scale theirs)
    params = [p for p in params if p.grad is not None and not storage_freed(p.grad)]
    total = grad_norm(params, split, group, dp_group, pp_group=pp_group, counted=counted)
    # Same formula as torch.nn.utils.clip_grad_norm_, so single-process and sharded runs clip alike.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        assert p.grad is not None  # filtered above
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


def sync_partial_grads(params: list[Tensor], group: Any) -> None:
    """Sum over MP the gradients each rank holds a partial sum of (parameters that saw 1/mp of the sequence, whole
    layers inside a column layer's region): one flat all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_sum(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
