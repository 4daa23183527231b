"""User code between DTensor parameters and plain tensors: what it computes is what one process computes.

Outside the layers' forward (:mod:`lightning_dpmp.parallel.dtensor_params`), user code reads DTensor parameters and
mixes them with plain tensors: an L2 term added to a plain loss, a norm turned into a float, Lightning's
``grad_norm`` building ``torch.tensor`` from a list of norms, a logger converting a histogram to numpy. torch's
DTensor leaves three of these wrong or failing (measured on torch 2.13):

* ``.item()``/``float()`` of a sum or a norm over a sharded DTensor (a ``Partial`` placement, reduced lazily) gives
  this rank's partial value;
* ``plain_loss + dtensor`` builds, but its backward raises ("got mixed torch.Tensor and DTensor");
* ``torch.tensor([dtensor, ...])`` raises ("its data is not allocated yet").

:class:`DTensorBridge` is a ``TorchFunctionMode`` that settles each where it happens, and does nothing to a call
that involves no DTensor:

* a value read out of a DTensor (``item``, ``tolist``, ``numpy``, ``float``, ``int``, ``bool``, ``torch.tensor``
  of DTensors) is read from its ``full_tensor()``: the one-process value, on every rank;
* an in-place op on a plain tensor (a logger's running sum) takes a DTensor operand's ``full_tensor()``;
* any other op mixing the two takes each plain tensor as replicated (``DTensor.from_local``, differentiable), so
  the backward of ``plain_loss + l2`` reaches both.

Collectives follow from the DTensor's placements, as with any DTensor code: every rank of the mesh must run the
same code (a norm computed on rank 0 only waits for the others). The strategy enters the bridge for its runs and
steps it aside while a module's forward runs, so the layers (and compiled blocks) never see it.

Example:
    >>> bridge = DTensorBridge(mesh)                      # doctest: +SKIP
    >>> with bridge:                                       # doctest: +SKIP
    ...     total = sum(p.pow(2).sum() for p in model.parameters()).item()  # the dense model's value
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_dpmp.parallel.modes import AsideMode, writes_in_place

__all__ = ["DTensorBridge", "plain_value"]

# Calls that read values out of their tensor arguments: they see the full tensor.
_READS = {
    Tensor.item, Tensor.tolist, Tensor.numpy, Tensor.__float__, Tensor.__int__, Tensor.__bool__, Tensor.__index__,
    Tensor.__array__, Tensor.__complex__, Tensor.__format__,
}
_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


def _any_dtensor(args: tuple, kwargs: dict) -> bool:
    for a in args:
        if isinstance(a, DTensor):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(x, DTensor) for x in a):
            return True
    return any(isinstance(v, DTensor) for v in kwargs.values())


def _first_dtensor(args: tuple) -> Optional[DTensor]:
    for a in args:
        if isinstance(a, DTensor):
            return a
        if isinstance(a, (list, tuple)):
            found = next((x for x in a if isinstance(x, DTensor)), None)
            if found is not None:
                return found
    return None


def _has_plain(args: tuple, kwargs: dict) -> bool:
    def plain(x: Any) -> bool:
        return isinstance(x, Tensor) and not isinstance(x, DTensor)

    return any(plain(a) or isinstance(a, (list, tuple)) and any(plain(v) for v in a)
               for a in (*args, *kwargs.values()))


def _full(x: Any) -> Any:
    """``x`` read whole: a DTensor's full tensor (detached), anything else as it is, inside lists and tuples."""
    if isinstance(x, DTensor):
        return x.detach().full_tensor()  # type: ignore[attr-defined]  # detach keeps the DTensor
    if isinstance(x, (list, tuple)):
        return type(x)(_full(v) for v in x)
    return x


def plain_value(x: Any) -> Any:
    """A DTensor as the plain tensor one process would hold (``full_tensor()``, differentiable: a loss built from
    DTensors back-propagates into them); anything else as it is.

    Example:
        >>> plain_value(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return x.full_tensor() if isinstance(x, DTensor) else x


class DTensorBridge(AsideMode):
    """A ``TorchFunctionMode`` under which user code mixing DTensors and plain tensors computes as one process.

    Args:
        mesh: the mesh the DTensor parameters live on; plain tensors mixed with them are taken as replicated on it.
    """

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh
        self._replicate = [Replicate()] * mesh.ndim

    def _as_dtensor(self, x: Any, like: Optional[DTensor]) -> Any:
        if isinstance(x, Tensor) and not isinstance(x, DTensor):
            mesh = like.device_mesh if like is not None else self.mesh
            return DTensor.from_local(x, mesh, self._replicate, run_check=False)
        if isinstance(x, (list, tuple)):
            return type(x)(self._as_dtensor(v, like) for v in x)
        return x

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if not _any_dtensor(args, kwargs):
            return func(*args, **kwargs)
        if func in _READS or func in _FACTORIES:
            return func(*_full(args), **{k: _full(v) for k, v in kwargs.items()})
        first = args[0] if args else None
        name = getattr(func, "__name__", "")
        if isinstance(first, Tensor) and not isinstance(first, DTensor) and (
                writes_in_place(name)):
            # an in-place op on a plain tensor: it stays plain and takes the full values
            return func(first, *_full(args[1:]), **{k: _full(v) for k, v in kwargs.items()})
        if _has_plain(args, kwargs):
            like = _first_dtensor((*args, *kwargs.values()))
            args = tuple(self._as_dtensor(a, like) for a in args)
            kwargs = {k: self._as_dtensor(v, like) for k, v in kwargs.items()}
        return func(*args, **kwargs)
