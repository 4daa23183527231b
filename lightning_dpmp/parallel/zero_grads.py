"""The ZeRO engine's gradients as the parameters' ``.grad``: what user code reads of them is what one process reads.

At zero >= 1 the engine reduce-scatters each bucket's gradients over DP into the shard the optimizer steps
(:mod:`lightning_dpmp.parallel.zero_engine`), and the module's parameters keep no gradient: Lightning's
``grad_norm`` in ``on_before_optimizer_step`` found none, and a gradient callback read ``None``.

:class:`ShardedGrads` gives every parameter whose bucket holds a gradient a ``.grad`` again after each synchronised
backward, but without gathering it: the gradient is a view of a flat buffer of the bucket's length whose storage is
freed, so it costs no memory and no collective. Only when user code reads one (under
:class:`~lightning_dpmp.parallel.freed_reads.GatherOnRead`, which asks :meth:`ShardedGrads.owns` of every tensor an
op reads, ``.data`` aliases included) is its bucket gathered over DP from the shards' gradients, once per step: the
buffer then stays current until the next backward, so a norm over every parameter costs one all-gather per bucket.
An in-place write into a gathered gradient (``clip_grad_norm_`` in ``on_before_optimizer_step``) is written back
into this rank's slice of the shard's gradient, which the optimizer steps: every DP rank ran the same write on the
same values, so the shards stay as one process's gradient would be.

The gathers are collectives over DP: every DP rank must run the reading code, as with DTensors.

Example:
    >>> grads = ShardedGrads(engine, target=lambda p: p, wrap=lambda p, view: view)  # doctest: +SKIP
    >>> grads.attach()  # after the backward: each parameter's .grad, not gathered yet  # doctest: +SKIP
    >>> grads.ensure([p.grad]); p.grad.norm()  # gathered over DP on the first read  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.dtensor_params import local_tensor
from lightning_dpmp.parallel.zero_shard import Bucket, all_gather_flat

__all__ = ["ShardedGrads", "storage_key"]


def storage_key(t: Tensor) -> int:
    """An identity of ``t``'s storage (its local tensor's, for a DTensor) that survives the storage's resizes and
    is shared by every view and ``.data`` alias of it."""
    return compat.storage_identity(local_tensor(t))


class ShardedGrads:
    """The engine's sharded gradients as ``.grad`` of the parameters user code reads (see the module docstring).

    Args:
        engine: the :class:`~lightning_dpmp.parallel.zero_engine.ZeroEngine`.
        target: the parameter user code reads for one of the engine's (its DTensor form, or the parameter itself).
        wrap: the gradient to give ``target(p)`` from a view of ``p``'s shape (a DTensor with its placements, or
            the view itself).
    """

    def __init__(self, engine: Any, target: Callable[[nn.Parameter], nn.Parameter],
                 wrap: Callable[[nn.Parameter, Tensor], Tensor]) -> None:
        self.engine, self.target, self.wrap = engine, target, wrap
        self._buffers: dict[int, Tensor] = {}  # id(bucket) -> its gradient buffer (storage freed until read)
        self._grads: dict[int, list[Tensor]] = {}  # id(bucket) -> its parameters' gradients, views of the buffer
        self._by_key: dict[int, Bucket] = {}
        self._current: set[int] = set()  # id() of the buckets whose buffer holds this step's gradients
        self._attached: list[nn.Parameter] = []

    def _grads_of(self, b: Bucket) -> list[Tensor]:
        """The gradients of ``b``'s parameters, made once: views of its buffer (made while it is allocated: a view
        of freed storage cannot be made), the buffer then freed."""
        grads = self._grads.get(id(b))
        if grads is None:
            buf = torch.empty(b.layout.total, dtype=b.full.dtype, device=b.full.device)
            grads = [self.wrap(p, buf[off: off + p.numel()].view(p.shape))
                     for p, off in zip(b.params, b.layout.offsets)]
            buf.untyped_storage().resize_(0)
            self._buffers[id(b)], self._grads[id(b)] = buf, grads
            self._by_key[storage_key(buf)] = b
        return grads

    def attach(self) -> None:
        """After a synchronised backward: each parameter of a bucket whose shard has a gradient gets a ``.grad``
        viewing the bucket's (freed) buffer. Collective-free."""
        self.clear()
        for b in self.engine.live():
            if not b.trainable or b.shard.grad is None:
                continue
            for p, grad in zip(b.params, self._grads_of(b)):
                t = self.target(p)
                t.grad = grad
                self._attached.append(t)

    def clear(self) -> None:
        """Before a backward (which would accumulate into them), and at teardown: no ``.grad`` left, the buffers'
        storage freed."""
        for t in self._attached:
            t.grad = None
        self._attached.clear()
        for key in self._current:
            buf = self._buffers.get(key)
            if buf is not None:
                buf.untyped_storage().resize_(0)
        self._current.clear()

    def owns(self, t: Tensor) -> bool:
        """Whether ``t`` views one of the gradient buffers (a ``.grad``, its ``.data``, a slice of it)."""
        return bool(self._by_key) and storage_key(t) in self._by_key

    def ensure(self, tensors: list[Tensor]) -> None:
        """Make the buffers that ``tensors`` view hold this step's gradients: the buckets not gathered yet are
        gathered over DP from their shards' gradients (in bucket order: the same on every DP rank)."""
        wanted = {id(b): b for t in tensors if (b := self._by_key.get(storage_key(t))) is not None}
        todo = [b for b in self.engine.buckets if id(b) in wanted and id(b) not in self._current]
        for b in todo:
            buf = self._buffers[id(b)]
            buf.untyped_storage().resize_(b.layout.total * buf.element_size())
            grad = b.shard.grad
            source = grad.detach().to(buf.dtype) if grad is not None else torch.zeros(
                b.layout.shard, dtype=buf.dtype, device=buf.device)
            with torch.no_grad():
                all_gather_flat(buf, source.contiguous(), b.group, async_op=False)
            self._current.add(id(b))

    def written(self, tensors: list[Tensor]) -> None:
        """After an in-place write into gathered gradients: this rank's slice of each bucket written back into the
        shard's gradient (what the optimizer steps)."""
        seen: set[int] = set()
        for t in tensors:
            b = self._by_key.get(storage_key(t))
            if b is None or id(b) in seen or b.shard.grad is None:
                continue
            seen.add(id(b))
            lo, hi = b.layout.owned(b.rank)
            with torch.no_grad():
                b.shard.grad.copy_(self._buffers[id(b)][lo:hi])
