"""Autograd-aware collectives over an explicit process group.

Each primitive is a tiny ``torch.autograd.Function`` whose forward and backward are conjugate: what one direction
reduces, the other copies, and what one gathers, the other splits. All of them are the identity when the group has
one member, so ``mp=1`` costs nothing. ``dim`` names a tensor dimension (the last, feature, one by default).

Two paths, chosen per call:

* eager: in-place c10d calls, the gathers and reduce-scatters as tensor collectives (``all_gather_into_tensor``,
  ``reduce_scatter_tensor``: one contiguous buffer, no per-rank list) where the backend has them for the tensor's
  device (:func:`tensor_collectives_supported`), the list versions otherwise; both give the same numbers.
* under ``torch.compile``: functional collectives (``torch.distributed._functional_collectives``), which Dynamo
  traces into the graph, so a compiled block has no graph break at its collectives. Out of place, hence no
  ``mark_dirty`` and no defensive clone there.

Example:
    >>> x = partial = torch.ones(2, 4)
    >>> y = copy_to_group(x, grid.mp_group)        # forward: identity, backward: all-reduce
    >>> z = reduce_from_group(partial, grid.mp_group)  # forward: all-reduce, backward: identity
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dpmp.compat import functional_collectives as funcol  # private torch module: see compat

__all__ = [
    "all_reduce_grads",
    "broadcast_dense",
    "all_reduce_sum",
    "copy_to_group",
    "gather_from_group",
    "gather_from_sequence",
    "group_rank",
    "group_size",
    "reduce_from_group",
    "reduce_scatter_to_sequence",
    "scatter_to_group",
    "tensor_collectives_supported",
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


def broadcast_dense(module: nn.Module) -> None:
    """Every rank takes rank 0's parameters and buffers of ``module`` (collective over the world; meta tensors are
    skipped), so that unseeded runs start from one dense model."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.device.type != "meta":
                dist.broadcast(t.data, src=0)


def all_reduce_sum(tensor: Tensor, group: Optional[Any]) -> Tensor:
    """In-place SUM all-reduce (no autograd); returns ``tensor``."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_grads(params: Any, group: Optional[Any], *, average: bool, keep_unused: bool = False,
                     bucket_bytes: Optional[int] = None, in_place: bool = False) -> None:
    """Sum the gradients of ``params`` over ``group`` (divided by its size with ``average``), one flat all-reduce
    per (dtype, device), or per bucket of at most ``bucket_bytes`` of gradients (as DDP's ``bucket_cap_mb``: the
    flat copy never holds more than one bucket); a rank without a gradient contributes zeros. ``keep_unused``: a
    parameter no rank had a gradient for keeps ``None`` (so an optimizer skips it, as on one process), found from
    one more element per parameter in the same all-reduce; otherwise every parameter ends with a gradient.
    ``in_place``: a gradient that exists is overwritten with the result (the same tensor: whatever wraps it, a
    DTensor gradient, stays valid); else each gets a new tensor.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.full((2,), 3.0)
        >>> all_reduce_grads([p], None, average=True); p.grad.tolist()   # one process: unchanged
        [3.0, 3.0]
    """
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    size = group_size(group)
    buckets: list[tuple[torch.dtype, torch.device, list[Tensor]]] = []
    for (dtype, device), ps in by_kind.items():
        if bucket_bytes is None:
            buckets.append((dtype, device, ps))
            continue
        current: list[Tensor] = []
        held = 0
        for p in ps:
            if current and held + p.numel() * p.element_size() > bucket_bytes:
                buckets.append((dtype, device, current))
                current, held = [], 0
            current.append(p)
            held += p.numel() * p.element_size()
        buckets.append((dtype, device, current))
    for dtype, device, ps in buckets:
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps]
        if keep_unused:
            parts.append(torch.tensor([float(p.grad is not None) for p in ps], dtype=dtype, device=device))
        flat = all_reduce_sum(torch.cat(parts), group)
        used = flat[-len(ps):].tolist() if keep_unused else [1.0] * len(ps)
        offset = 0
        for p, u in zip(ps, used):
            if u > 0:
                total = flat[offset:offset + p.numel()].view_as(p)
                if in_place and p.grad is not None:
                    p.grad.copy_(total)
                    if average:
                        p.grad.div_(size)  # (the same rounding as total.div(size))
                else:
                    p.grad = total.div(size) if average else total.clone()
            offset += p.numel()


# torch 2.13 renamed all_gather_into_tensor/reduce_scatter_tensor (the old names warn); older torch has only those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def tensor_collectives_supported(group: Any, device: torch.device) -> bool:
    """Whether ``group``'s backend has ``all_gather_into_tensor``/``reduce_scatter_tensor`` for ``device`` tensors.

    NCCL has them for CUDA; gloo for CPU tensors (checked on torch 2.13), not reliably for CUDA ones. The one
    place that decides between the tensor and the list collectives.
    """
    backend = str(dist.get_backend(group)).lower()  # "gloo", "nccl" or a per-device "cpu:gloo,cuda:nccl"
    if device.type == "cuda":
        return "nccl" in backend
    return device.type == "cpu" and "gloo" in backend


def _sum_out_of_place(x: Tensor, group: Any) -> Tensor:
    """Functional SUM all-reduce (traced by Dynamo): a new tensor, ``x`` untouched."""
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def _split(x: Tensor, dim: int, group: Any) -> Tensor:
    # The chunk is a view; .contiguous() so that later in-place collectives and matmuls see dense memory.
    return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


def _gather(x: Tensor, dim: int, group: Any, tensor_api: Optional[bool] = None) -> Tensor:
    """All-gather along ``dim``, ranks in order; ``tensor_api`` forces (True) or refuses (False) the tensor
    collective (default: where the backend supports it)."""
    n, d = group_size(group), dim % x.dim()
    x = x.contiguous()
    if torch.compiler.is_compiling():
        stacked = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group)).view(n, *x.shape)
    else:
        if tensor_api is None:
            tensor_api = tensor_collectives_supported(group, x.device)
        if not tensor_api:
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x, group=group)
            return torch.cat(parts, dim=d)
        stacked = x.new_empty((n, *x.shape))  # rank r's tensor at [r]: gathered along dim 0 of one buffer
        all_gather_single(stacked.view(n * x.shape[0], *x.shape[1:]), x, group=group)
    # (n, ..., x_d, ...) -> (..., n * x_d, ...): a view for dim 0, one copy (as torch.cat's) otherwise.
    return stacked.movedim(0, d).flatten(d, d + 1)


def _reduce_scatter(x: Tensor, dim: int, group: Any, tensor_api: Optional[bool] = None) -> Tensor:
    """Sum over the group, keep this rank's chunk along ``dim``; ``tensor_api`` as in :func:`_gather`."""
    n, d = group_size(group), dim % x.dim()
    compiling = torch.compiler.is_compiling()
    if not compiling:
        if tensor_api is None:
            tensor_api = tensor_collectives_supported(group, x.device)
        if not tensor_api:
            parts = [p.contiguous() for p in x.chunk(n, dim=dim)]
            out = torch.empty_like(parts[0])
            dist.reduce_scatter(out, parts, group=group)
            return out
    # Rank r's chunk at [r] of one contiguous buffer (free for dim 0; one copy, as the chunks' .contiguous()).
    chunks = x.unflatten(d, (n, x.shape[d] // n)).movedim(d, 0).contiguous()
    flat = chunks.flatten(0, 1)
    if compiling:
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(flat, "sum", 0, group)).view(chunks.shape[1:])
    out = x.new_empty(chunks.shape[1:])
    reduce_scatter_single(out, flat, group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    """forward: identity; backward: all-reduce the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if torch.compiler.is_compiling():
            return _sum_out_of_place(grad, ctx.group), None
        # Clone: autograd may hand this same gradient tensor to another branch (e.g. both sides of a residual add),
        # and an in-place all-reduce would change it under that branch's feet.
        return all_reduce_sum(grad.contiguous().clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        if torch.compiler.is_compiling():
            return _sum_out_of_place(x, group)
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
