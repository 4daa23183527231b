"""The output of a fused projection whose blocks differ in size (q|k|v with fewer key/value heads), read per rank.

Each MP rank holds ``size / mp`` of every block (:data:`~lightning_dpmp.parallel.sharding.Blocks`), but the model's
code cuts the output with sizes in dense coordinates: ``qkv.split([q, kv, kv], -1)`` (DBRX), or slices by bounds it
computes from config integers, ``qkv[..., :q_pos]``, ``qkv[..., q_pos:q_pos + kv]`` (Phi-3). The planner
(:mod:`lightning_dpmp.planner.flow_dims`) splits such a layer only when those cuts are exactly its blocks; the
layer then returns a :class:`FusedOutput`, on which the cuts are read per rank: every size and bound that falls on
a block boundary is divided by ``mp`` (each block is cut evenly, so boundary ``b`` of the dense layout is boundary
``b / mp`` of the local one). Element-wise ops that keep the shape (``clamp``, a dropout) keep the reading; every
other op returns a plain tensor, so nothing downstream sees the subclass.

Example:
    >>> import torch
    >>> out = FusedOutput.wrap(torch.zeros(2, 8), blocks=(8, 4, 4), mp=2)   # local 4 + 2 + 2 of dense 16
    >>> [t.shape[-1] for t in out.split([8, 4, 4], dim=-1)], out[..., 8:12].shape[-1]
    ([4, 2, 2], 2)
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

from torch import Tensor

import lightning_dpmp.compat as compat

__all__ = ["FusedOutput", "FusedOutputError"]


class FusedOutputError(ValueError):
    """A size or bound used on a fused output that is not one of its block boundaries."""


class FusedOutput(Tensor):
    """This rank's share of a fused projection's output, whose dense-coordinate cuts are read per rank."""

    _dpmp_blocks: tuple[int, ...] = ()
    _dpmp_mp: int = 1

    @staticmethod
    def wrap(local: Tensor, blocks: tuple[int, ...], mp: int) -> "FusedOutput":
        """``local`` (last dim ``sum(blocks) / mp``) as the output of a layer fused from ``blocks`` (dense sizes)."""
        out = local.as_subclass(FusedOutput)
        out._dpmp_blocks, out._dpmp_mp = tuple(blocks), mp
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        me = args[0] if args and isinstance(args[0], FusedOutput) else None
        with compat.disable_torch_function_subclass():
            if me is not None:
                args, kwargs = _local_cuts(getattr(func, "__name__", ""), me, args, kwargs)
            out = func(*args, **kwargs)
            if me is not None and isinstance(out, Tensor) and not isinstance(out, FusedOutput) and (
                    out.shape == me.shape and getattr(func, "__name__", "") != "__get__"):
                return FusedOutput.wrap(out, me._dpmp_blocks, me._dpmp_mp)  # clamp, dropout, ...: still fused
            return out


def _boundaries(blocks: tuple[int, ...]) -> set[int]:
    return set(itertools.accumulate(blocks, initial=0))


def _local(bound: Optional[int], me: FusedOutput, what: str) -> Optional[int]:
    """A dense-coordinate bound (or size, counted from the end when negative) as this rank's."""
    if bound is None:
        return None
    total, mp = sum(me._dpmp_blocks), me._dpmp_mp
    edge = bound if bound >= 0 else total + bound
    if edge not in _boundaries(me._dpmp_blocks):
        raise FusedOutputError(
            f"{what} {bound} on the output of a fused projection whose blocks are {list(me._dpmp_blocks)} (split "
            f"{mp} ways, so this rank holds {[b // mp for b in me._dpmp_blocks]}): the plan read the traced step's "
            "cuts as those blocks, and this one falls inside a block. plan_overrides={'<layer>': 'column_gather'} "
            "keeps the layer's output whole."
        )
    return bound // mp if bound >= 0 else -((-bound) // mp)


def _sizes(sizes: Any, me: FusedOutput) -> Any:
    """``split``'s sizes in dense coordinates (they add up to the dense width) as this rank's."""
    if not isinstance(sizes, (list, tuple)) or sum(sizes) != sum(me._dpmp_blocks):
        return sizes  # an int size, or sizes already per rank
    edges = list(itertools.accumulate(sizes, initial=0))
    local = [_local(e, me, "a split at") for e in edges]
    return type(sizes)(b - a for a, b in zip(local, local[1:]))  # type: ignore[operator]


def _local_cuts(name: str, me: FusedOutput, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of a cut of ``me`` along its last dim, in this rank's coordinates."""
    last = me.dim() - 1

    def on_last(dim: Any) -> bool:
        return isinstance(dim, int) and dim % me.dim() == last

    if name in ("split", "split_with_sizes"):
        key = next((k for k in ("split_size_or_sections", "split_size", "split_sizes") if k in kwargs), None)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        if on_last(dim):
            if key is not None:
                kwargs = {**kwargs, key: _sizes(kwargs[key], me)}
            elif len(args) > 1:
                args = (args[0], _sizes(args[1], me), *args[2:])
    elif name == "narrow" and len(args) >= 4 and on_last(args[1]):
        start, length = _local(args[2], me, "narrow from"), _local(args[2] + args[3], me, "narrow to")
        args = (args[0], args[1], start, length - start, *args[4:])  # type: ignore[operator]
    elif name == "__getitem__" and len(args) > 1:
        args = (args[0], _local_index(args[1], me, last))
    return args, kwargs


def _local_index(index: Any, me: FusedOutput, last: int) -> Any:
    """``x[index]`` with a slice of the last dim in this rank's coordinates."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(it, (Tensor, list)) or it is True or it is False for it in items):
        return index  # advanced indexing: the planner refused to split through it
    position = None
    if Ellipsis in items:
        if items[-1] is Ellipsis:
            return index
        after = items[items.index(Ellipsis) + 1:]
        if sum(it is not None for it in after) == 1 and after[-1] is not None:
            position = len(items) - 1
    elif sum(it is not None for it in items) == me.dim():
        position = max(i for i, it in enumerate(items) if it is not None)
    if position is None or not isinstance(items[position], slice):
        return index
    cut = items[position]
    if cut.step not in (None, 1) or (cut.start is None and cut.stop is None):
        return index
    items[position] = slice(_local(cut.start, me, "a slice from"), _local(cut.stop, me, "a slice to"), cut.step)
    return tuple(items) if isinstance(index, tuple) else items[0]
