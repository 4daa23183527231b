"""Entering a column region: the copy (identity forward, all-reduce backward) or, with sequence parallelism,
the sequence all-gather in front of column layers, and :class:`SharedInputCopy`, one entry shared by sibling
column layers that read the same input (q/k/v, gate/up), so that the input gradient costs one all-reduce.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.comm import copy_to_group, gather_from_sequence

__all__ = ["GATHERED", "SharedInputCopy", "enter_region", "shared_entries"]


class SharedInputCopy:
    """One ``copy_to_group`` shared by sibling column layers that read the same input tensor.

    q/k/v (or gate/up) each entering the parallel region on their own would all-reduce the input gradient once
    each; sharing the entry makes autograd sum their gradients first, so the group pays one all-reduce.

    Example:
        >>> from lightning_dpmp.parallel.layers import ColumnParallelLinear
        >>> entry = SharedInputCopy(grid.mp_group)
        >>> q = ColumnParallelLinear.from_dense(torch.nn.Linear(8, 8), grid.mp_group, shared_input=entry)
        >>> k = ColumnParallelLinear.from_dense(torch.nn.Linear(8, 8), grid.mp_group, shared_input=entry)
    """

    def __init__(self, group: Any, sequence_dim: Any = None) -> None:
        self.group = group
        self.sequence_dim = sequence_dim
        self._key: Optional[tuple[int, int, bool]] = None
        self._src: Optional[Tensor] = None
        self._out: Optional[Tensor] = None

    def __call__(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return self._traced(x)
        # The key includes the version counter and grad mode so that a tensor modified in place, or a copy made
        # under no_grad, is never reused. The references are strong (autograd keeps the tensor's data, not its
        # Python object), and are dropped as soon as the gradient has gone through, so no activation outlives
        # its step.
        key = (id(x), compat.tensor_version(x), torch.is_grad_enabled())
        if key == self._key and self._src is x and self._out is not None:
            return self._out
        out = enter_region(x, self.group, self.sequence_dim)
        self._key, self._src, self._out = key, x, out
        if out.requires_grad:
            out.register_hook(self._release)
        return out

    def _traced(self, x: Tensor) -> Tensor:
        # Under torch.compile this code runs once, while Dynamo traces a block, not at every step: the identity
        # test is between traced tensors (the siblings get the one entry node of the graph), with no id, no
        # version key and no hook. The block's reset hooks (lightning_dpmp.parallel.compiled) clear the fields
        # at its start and end, so no guard reads a previous step's tensor and nothing is kept between steps.
        if self._src is x and self._out is not None:
            return self._out
        out = enter_region(x, self.group, self.sequence_dim)
        self._src, self._out = x, out
        return out

    def reset(self) -> None:
        """Forget the last entry (a compiled block calls this before and after its forward)."""
        self._key = self._src = self._out = None

    def _release(self, grad: Tensor) -> None:
        self.reset()


def shared_entries(module: Any) -> list[SharedInputCopy]:
    """The distinct :class:`SharedInputCopy` entries of ``module``'s layers (``shared_input`` attributes), in order:
    what a block resets around its forward when something other than autograd runs it (a compiled forward, a
    recomputed one), so that no entry outlives the forward that set it.

    Example:
        >>> shared_entries(torch.nn.Linear(2, 2))
        []
    """
    return list({id(e): e for m in module.modules()
                 if isinstance(e := getattr(m, "shared_input", None), SharedInputCopy)}.values())


GATHERED = "gathered"  # sequence_dim value: the enclosing module already all-gathered the sequence


def enter_region(x: Tensor, group: Any, sequence_dim: Any) -> Tensor:
    """A column layer's entry: copy (backward all-reduce); with sequence parallelism all-gather the sequence
    (backward reduce-scatter), or nothing when the enclosing module gathered it (its backward sums already)."""
    if sequence_dim is None:
        return copy_to_group(x, group)
    if sequence_dim == GATHERED:
        return x
    return gather_from_sequence(x, group, sequence_dim)
