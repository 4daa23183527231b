"""Expert tensor parallelism at run time: an experts module holding 1/mp of each expert's FFN, its own code unchanged.

The module keeps its class, its forward and its parameter names; each stacked expert weight is replaced by this
rank's slice along the intermediate dim (``shard_tensor``, block by block for fused ``gate|up``), so every rank
computes every expert on its intermediate slice and the module's output is a partial sum. Two hooks close the
region:

* a forward pre-hook passes the entered arguments (the activation, the routing weights) through one
  :func:`copy_many_to_group`: forward identity, backward **one** all-reduce of all their gradients together;
* a forward hook all-reduces the output (``reduce_from_group``: forward all-reduce, backward identity).

So an MoE block costs 1 all-reduce each way, however many experts it has.

Example:
    >>> undo = shard_experts(moe.experts, {"w_in": (1, 2), "w_out": (2, 1)}, (0, 2), grid.mp_group)  # doctest: +SKIP
    >>> undo.restore()            # the dense parameters and no hooks again (no communication)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_dpmp.parallel.comm import all_reduce_sum, group_rank, group_size, reduce_from_group
from lightning_dpmp.parallel.sharding import SHARDS_ATTR, DenseGather, dense_meta, shard_tensor

__all__ = ["ExpertsShards", "consolidate_experts", "copy_many_to_group", "shard_experts"]

_HOOKS = "_dpmp_experts_hooks"
Key = Union[int, str]


class _CopyManyToGroup(torch.autograd.Function):
    """forward: identity on every tensor; backward: one all-reduce of all their gradients (flattened together)."""

    @staticmethod
    def forward(ctx: Any, group: Any, *xs: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        ctx.meta = [(x.shape, x.dtype) for x in xs]
        ctx.device = xs[0].device
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        dtype = torch.promote_types(*[d for _, d in ctx.meta]) if len(ctx.meta) > 1 else ctx.meta[0][1]
        flat = [
            (g if g is not None else torch.zeros(shape, dtype=d, device=ctx.device)).reshape(-1).to(dtype)
            for g, (shape, d) in zip(grads, ctx.meta)
        ]
        buf = all_reduce_sum(torch.cat(flat), ctx.group)
        out, at = [], 0
        for shape, d in ctx.meta:
            n = shape.numel()
            out.append(buf[at:at + n].view(shape).to(d))
            at += n
        return (None, *out)


def copy_many_to_group(xs: tuple[Tensor, ...], group: Any) -> tuple[Tensor, ...]:
    """Enter a parallel region with several tensors at once: forward identity, backward one all-reduce."""
    if group_size(group) == 1 or not xs:
        return xs
    return _CopyManyToGroup.apply(group, *xs)


class _Enter:
    """Forward pre-hook: the entered arguments that need a gradient go through one shared copy."""

    def __init__(self, keys: tuple[Key, ...], group: Any) -> None:
        self.keys, self.group = keys, group

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        positional, kwargs = list(args), dict(kwargs)
        slots: list[tuple[Any, Key]] = []
        for k in self.keys:
            present = k < len(positional) if isinstance(k, int) else k in kwargs
            box: Any = positional if isinstance(k, int) else kwargs
            if present and isinstance(box[k], Tensor) and box[k].requires_grad:
                slots.append((box, k))
        entered = copy_many_to_group(tuple(box[key] for box, key in slots), self.group)
        for (box, key), t in zip(slots, entered):
            box[key] = t
        return tuple(positional), kwargs


class _Reduce:
    """Forward hook: the module's output is a partial sum; all-reduce it."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Tensor:
        if not isinstance(output, Tensor):
            raise TypeError(
                f"{type(module).__name__} was planned as experts from a traced step returning one tensor, but now"
                f" returns {type(output).__name__}; plan it again, or keep it whole with a user plan."
            )
        return reduce_from_group(output, self.group)


class ExpertsShards:
    """What :func:`shard_experts` changed on one module, so that :meth:`restore` can put the dense state back."""

    def __init__(self, module: nn.Module, dense: dict[str, nn.Parameter]) -> None:
        self.module, self.dense = module, dense

    def restore(self) -> None:
        """The dense parameters (the very objects) and no hooks again; no communication."""
        for name, p in self.dense.items():
            setattr(self.module, name, p)
        _unhook(self.module)


def shard_experts(
    module: nn.Module, shards: dict[str, tuple[int, int]], entries: tuple[Key, ...], group: Any
) -> ExpertsShards:
    """Replace ``module``'s expert parameters by this rank's slices and hook its entry and exit (see module doc).

    ``shards`` maps a parameter name (of ``module`` itself) to ``(dim, blocks)``; ``entries`` are the argument
    positions/keywords whose gradients must be summed over the group.
    """
    mp, rank = group_size(group), group_rank(group)
    dense: dict[str, nn.Parameter] = {}
    for name, (dim, blocks) in shards.items():
        full = getattr(module, name)
        if full.shape[dim] % (mp * blocks):
            raise ValueError(
                f"{type(module).__name__}.{name} has {full.shape[dim]} along dim {dim}"
                f"{f' in {blocks} fused blocks' if blocks > 1 else ''}: not divisible by mp={mp}."
            )
        local = shard_tensor(full.detach(), dim, mp, rank, blocks).clone()
        setattr(module, name, nn.Parameter(local, requires_grad=full.requires_grad))
        dense[name] = full
    module.__dict__[SHARDS_ATTR] = dict(shards)
    module.__dict__[_HOOKS] = [
        module.register_forward_pre_hook(_Enter(entries, group), with_kwargs=True),
        module.register_forward_hook(_Reduce(group)),
    ]
    module.__dict__["_dpmp_experts_group"] = group
    return ExpertsShards(module, dense)


def _unhook(module: nn.Module) -> None:
    for h in module.__dict__.pop(_HOOKS, []):
        h.remove()
    module.__dict__.pop(SHARDS_ATTR, None)
    module.__dict__.pop("_dpmp_experts_group", None)


def consolidate_experts(model: nn.Module, gather: Optional[DenseGather] = None
                        ) -> dict[int, tuple[nn.Parameter, int, int]]:
    """Gather every sharded experts module of ``model`` back to dense parameters, same names (collective over MP;
    ``gather`` as in :meth:`ParallelLinear.to_dense`: a rank that does not keep the result gets meta shapes).

    Returns ``{id(shard): (dense parameter, dim, blocks)}`` for the optimizer to follow.
    """
    gather = gather if gather is not None else DenseGather()
    moved: dict[int, tuple[nn.Parameter, int, int]] = {}
    for module in model.modules():
        shards = module.__dict__.get(SHARDS_ATTR)
        if not shards or _HOOKS not in module.__dict__:
            continue
        group = module.__dict__["_dpmp_experts_group"]
        for name, (dim, blocks) in shards.items():
            local = getattr(module, name)
            with torch.no_grad():
                full = gather(local.detach(), dim, group, blocks)
            full = dense_meta(local, dim, group) if full is None or not gather.keep else full.clone()
            dense = nn.Parameter(full, requires_grad=local.requires_grad)
            setattr(module, name, dense)
            moved[id(local)] = (dense, dim, blocks)
        _unhook(module)
    return moved
