"""Other pipeline stages' gradients as the parameters' ``.grad``: user code reads what one process reads.

Under a pipeline each rank computes the gradients of its own stages' parameters only; the parameters no stage of
this rank reads have no gradient here (their storage is freed while training). Lightning's ``grad_norm`` in
``on_before_optimizer_step``, a gradient callback or ``clip_grad_norm_`` by hand then see part of the model: at
(1, 2, 2) ``grad_norm``'s total was 0.22-0.46 off one process's.

:class:`StagedGrads` gives each such parameter a ``.grad`` after every synchronised backward, without moving a byte:
a view of a flat buffer per (owning PP rank, dtype) whose storage is freed. Only when user code reads one (under
:class:`~lightning_dpmp.parallel.freed_reads.GatherOnRead`, which asks :meth:`StagedGrads.owns` of every tensor an
op reads, ``.data`` aliases included) is that buffer broadcast over PP from the rank that owns its parameters, once
per step. The owner takes part with its own gradients, which are watched too, so every rank of the PP group joins
the same broadcasts in the same order: like DTensor reductions, the reading code must run on every rank (it does in
Lightning's hooks). The buffer then holds a copy until the next backward, so a norm over every parameter costs one
broadcast per (stage, dtype) and, for that step, the other stages' gradient bytes.

An in-place write into such a copy (``clip_grad_norm_``) changes the copy only: the owner ran the same write on the
same values into the gradient its optimizer steps. A parameter that no step reaches (``unreached``: the traced step
left it out and no traced step branched on the data) keeps ``None`` on every rank, as on one process. One that this
step's owner has no gradient for, where steps may differ, reads as zeros on every rank (where one process shows
``None``): its norm and its share of any sum are those of one process. Those zeros are taken back before the
optimizer steps, so it is not stepped, as one process would not.

Under ZeRO (``source``: the engine's :class:`~lightning_dpmp.parallel.zero_grads.ShardedGrads`) the owner's own
gradients are themselves views of freed buffers, gathered over its DP group on first read: the owner gathers them
(over DP, every DP rank of the owning stage alike) before it broadcasts them over PP, and a gradient of a parameter
every stage reads (a tied weight at pp=2) is the source's alone. :class:`StagedGrads` then answers for both, as
the one :class:`~lightning_dpmp.parallel.freed_reads.GradReads` of the reader.

Example:
    >>> grads = StagedGrads(staged, owner, held, pp_rank, pp_group, target=lambda p: p,  # doctest: +SKIP
    ...                     wrap=lambda p, v: v)
    >>> grads.attach()       # after the PP/DP reduction: each parameter has a .grad (freed, here)  # doctest: +SKIP
    >>> grads.ensure([p.grad]); p.grad.norm()  # broadcast from its stage on the first read  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dpmp.parallel.dtensor_params import local_tensor
from lightning_dpmp.parallel.freed_reads import GradReads
from lightning_dpmp.parallel.zero_grads import storage_key

__all__ = ["StagedGrads"]


class _Group:
    """The parameters one PP rank owns, of one dtype: broadcast together, in this order."""

    __slots__ = ("owner", "params", "buffer", "grads", "current")

    def __init__(self, owner: int, params: list[nn.Parameter]) -> None:
        self.owner, self.params = owner, params
        self.buffer: Tensor | None = None  # non-owners: the received gradients (storage freed until read)
        self.grads: list[Tensor] = []  # non-owners: the gradients given to the parameters, views of the buffer
        self.current = False  # the buffer holds this step's gradients


class StagedGrads:
    """The gradients of parameters some stage of the pipeline does not read, readable on every rank (see the module
    docstring).

    Args:
        params: the parameters some PP rank does not read (plain local ones), in the same order on every PP rank.
        owner: ``id(param) -> `` the PP rank (group rank) that owns its trained gradient.
        held: ``id`` of those of ``params`` this rank's stages read (their gradients are trained here; the ones it
            owns among them).
        pp_rank: this rank's PP rank.
        pp_group: the PP process group.
        target: the parameter user code reads for one of ``params`` (its DTensor form, or itself).
        wrap: the gradient to give ``target(p)`` from a tensor of ``p``'s shape (a DTensor with its placements, or
            the tensor itself).
        source: where this rank's own gradients are brought from on first read (ZeRO's sharded gradients), or
            ``None`` (they hold their values).
        unreached: ``id`` of those of ``params`` that no step reaches (the traced step's, where no step can
            differ): they keep ``None``, as on one process, on every rank alike.
    """

    def __init__(self, params: list[nn.Parameter], owner: dict[int, int], held: set[int], pp_rank: int,
                 pp_group: Any, target: Callable[[nn.Parameter], nn.Parameter],
                 wrap: Callable[[nn.Parameter, Tensor], Tensor], source: Optional[GradReads] = None,
                 unreached: frozenset[int] = frozenset()) -> None:
        self.pp_rank, self.pp_group, self.target, self.wrap = pp_rank, pp_group, target, wrap
        self.held, self.source, self.unreached = held, source, unreached
        by_key: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            if p.requires_grad:
                by_key.setdefault((owner[id(p)], p.dtype), []).append(p)
        self.groups = [_Group(r, ps) for (r, _), ps in by_key.items()]
        self._by_storage: dict[int, _Group] = {}  # storage_key of a watched gradient -> its group
        self._attached: list[tuple[nn.Parameter, Tensor]] = []  # (target, the gradient attach gave it)

    def attach(self) -> None:
        """After a synchronised backward (the PP and DP reductions done): each parameter this rank does not hold
        gets a ``.grad`` viewing its group's freed buffer, and the gradients of those it holds (the owner's, and a
        tied weight's on another stage that holds it too: equal after the PP sum) are watched. Collective-free."""
        self.clear()
        for g in self.groups:
            if g.owner != self.pp_rank and not g.grads:  # made once, while the buffer is allocated (no view of
                p0 = g.params[0]                          # freed storage can be made)
                buf = torch.empty(sum(p.numel() for p in g.params), dtype=p0.dtype, device=p0.device)
                offsets, off = [], 0
                for p in g.params:
                    offsets.append(off)
                    off += p.numel()
                g.grads = [self.wrap(p, buf[o: o + p.numel()].view(p.shape)) for p, o in zip(g.params, offsets)]
                buf.untyped_storage().resize_(0)
                g.buffer = buf
            if g.buffer is not None:
                self._by_storage[storage_key(g.buffer)] = g
            for i, p in enumerate(g.params):
                t = self.target(p)
                if id(p) in self.unreached:
                    continue  # None on every rank, as on one process: no rank reads it, so no broadcast is missed
                if id(p) in self.held:  # its own gradient, which this rank steps
                    if t.grad is None:
                        # nothing reached it: zeros, as the ranks that do not hold it will read, so that a read
                        # of it joins the broadcast they start (taken back before the optimizer steps)
                        t.grad = self.wrap(p, torch.zeros(p.shape, dtype=p.dtype, device=p.device))
                        self._attached.append((t, t.grad))
                    self._by_storage[storage_key(t.grad)] = g
                else:
                    t.grad = g.grads[i]
                    self._attached.append((t, t.grad))

    def clear(self) -> None:
        """Take back the gradients :meth:`attach` gave (those user code did not replace) and free the buffers."""
        for t, grad in self._attached:
            if t.grad is grad:
                t.grad = None
        self._attached.clear()
        for g in self.groups:
            if g.buffer is not None and g.current:
                g.buffer.untyped_storage().resize_(0)
            g.current = False
        self._by_storage.clear()

    def _staged(self, t: Tensor) -> bool:
        return bool(self._by_storage) and storage_key(t) in self._by_storage

    def owns(self, t: Tensor) -> bool:
        """Whether ``t`` views a gradient of these groups (a received one, or this rank's own that others receive),
        or one of :attr:`source`'s."""
        return self._staged(t) or (self.source is not None and self.source.owns(t))

    def ensure(self, tensors: list[Tensor]) -> None:
        """Each group that ``tensors`` belong to broadcast from its owner over PP, once per step (collective: every
        rank of the PP group reads the same gradients in the same order), after :attr:`source` brought this rank's
        own among them (collective over this stage's DP group; the owner's too, before it sends them)."""
        if self.source is not None:  # this rank's own gradients first (a tied weight another stage owns included)
            mine = [t for t in tensors if self.source.owns(t)]
            if mine:
                self.source.ensure(mine)
        for t in tensors:
            if not self._staged(t):
                continue
            g = self._by_storage[storage_key(t)]
            if g.current:
                continue
            with torch.no_grad():
                if g.owner == self.pp_rank:
                    own = [self.target(p).grad for p in g.params]
                    if self.source is not None:  # (gathered over the owning stage's DP group first)
                        self.source.ensure([x for x in own if x is not None and self.source.owns(x)])
                    flat = torch.cat([(local_tensor(x).reshape(-1) if x is not None else
                                       torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
                                      for p, x in zip(g.params, own)])
                    dist.broadcast(flat, group=self.pp_group, group_src=g.owner)
                else:
                    assert g.buffer is not None
                    g.buffer.untyped_storage().resize_(g.buffer.numel() * g.buffer.element_size())
                    dist.broadcast(g.buffer, group=self.pp_group, group_src=g.owner)
            g.current = True

    def written(self, tensors: list[Tensor]) -> None:
        """An in-place write into a received copy: nothing to keep in step (the owner wrote its own alike); into
        one of :attr:`source`'s (this rank's own gradients under ZeRO): reported to it."""
        if self.source is not None:
            self.source.written([t for t in tensors if self.source.owns(t)])

