"""Experts detection, its vocabulary and activation rules: the op families as they act on a tensor split along
the experts' intermediate dim or on a partial sum, the two states (split, partial), and the rules for ops that
read them (:class:`ActivationRules`, mixed into the pass of :mod:`lightning_dpmp.planner.experts_pass`).

What the rules accept is described in :mod:`lightning_dpmp.planner.experts_detect`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from lightning_dpmp.planner import ops
from lightning_dpmp.planner.trace import OpCall

__all__ = [
    "ACCUMULATES", "ADDS", "BINARY", "CASTS", "DIVS", "ELEMENTWISE", "INDEXING", "Key", "LAYOUT_ANY", "MATMULS", "MULS",
    "REDUCTIONS", "RESHAPES", "SHAPE_ONLY", "SPLITS", "TRANSPOSES", "ZEROS", "PARTIAL", "ActivationRules", "Conflict",
    "SplitAt", "common_suffix", "prod", "reshaped_dim",
]

Key = Union[int, str]

# Op families as they act on a split/partial tensor (the experts' own semantics), drawn from the shared vocabulary.
ELEMENTWISE = ops.ACTIVATIONS | ops.MATH | {"dropout", "dropout_"}  # keep a split; never applied to a partial sum
CASTS = ops.CASTS | ops.SIGNS  # value-preserving or linear: a partial sum stays one
MULS, DIVS = ops.MULS, ops.DIVS
BINARY = ops.ADDS | ops.SUBS | MULS | DIVS | {"__rsub__"}
ADDS = ops.ADDS | ops.SUBS
RESHAPES = ops.VIEWS | ops.SQUEEZES
TRANSPOSES = ops.TRANSPOSES - {"swapdims"}  # the forms expert code was seen to use
SPLITS = ops.SPLITS - {"tensor_split"}
MATMULS = ops.MATMULS | {"linear", "__rmatmul__", "mm", "grouped_mm", "_grouped_mm"}  # activation @ weight too
ACCUMULATES = {"index_add_", "index_add", "scatter_add_", "scatter_add"}
REDUCTIONS = {"sum", "mean"}  # linear: a partial sum stays one
LAYOUT_ANY = RESHAPES | TRANSPOSES | SPLITS | {"__getitem__", "expand", "repeat_interleave", "narrow", "select"}
ZEROS = {"zeros_like", "new_zeros", "zero_", "zeros"}
SHAPE_ONLY = {"size"}
INDEXING = {"__getitem__", "index_select", "gather", "take_along_dim"}  # (data, index...): only data is differentiable


@dataclass(frozen=True)
class SplitAt:
    """Split along ``dim``; ``raw``: the parameter whose fused blocks this output still holds (not chunked yet)."""

    dim: int
    raw: Optional[str]


PARTIAL = "partial"


class Conflict(Exception):
    """The module cannot be split this way; the message says why."""


def common_suffix(a: tuple, b: tuple) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[len(a) - 1 - k] == b[len(b) - 1 - k]:
        k += 1
    return k


def prod(xs: tuple) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def reshaped_dim(a: tuple, b: tuple, d: int) -> Optional[int]:
    """Where dim ``d`` of shape ``a`` lands in shape ``b`` under a reshape that keeps it whole, else ``None``."""
    before = prod(a[:d])
    for j, size in enumerate(b):
        if size == a[d] and prod(b[:j]) == before:
            return j
    return None


class ActivationRules:
    """Rules for ops reading split activations or partial sums; mixed into the pass (``ExpertsPass``)."""

    # Provided by the pass that mixes this in (lightning_dpmp.planner.experts_pass.ExpertsPass).
    mp: int
    shapes: dict[int, tuple]
    state: dict[int, Union[SplitAt, str]]
    zero: set[int]
    need_blocks: Callable[[Optional[str], int], bool]
    replicated_use: Callable[[int, str], None]
    _permutation: Callable[[OpCall, int], list[int]]

    def split_op(self, ev: OpCall) -> list:
        """Rules for ops reading a tensor split along the intermediate dim."""
        ins = [(p, n) for p, n in enumerate(ev.inputs) if n is not None]
        split = [(p, n, s) for p, n in ins if isinstance(s := self.state.get(n), SplitAt)]
        if any(self.state.get(n) == PARTIAL for _, n in ins):
            raise Conflict(f"'{ev.name}' mixes split and partial tensors")
        p0, n0, s0 = split[0]
        a = self.shapes[n0]
        if ev.name in ELEMENTWISE or ev.name in CASTS:
            if ev.name == "__get__" and self.shapes[ev.outputs[0]] != a:
                raise Conflict("a split tensor is read through an attribute that changes its shape")
            for _p, n in ins[1:]:
                self.replicated_use(n, ev.name)
            return [s0] * len(ev.outputs)
        if ev.name in BINARY:
            if len({s.dim for _, _, s in split}) != 1 or len({self.shapes[n] for _, n, _ in split}) != 1:
                raise Conflict(f"'{ev.name}' combines differently split tensors")
            for _p, n in ins:
                if isinstance(self.state.get(n), SplitAt):
                    continue
                shape = self.shapes[n]
                aligned = s0.dim - (len(a) - len(shape))
                if aligned >= 0 and shape[aligned] != 1:
                    raise Conflict(f"'{ev.name}' combines a split tensor with a replicated full-width one")
                self.replicated_use(n, ev.name)
            raws = {s.raw for _, _, s in split}
            raw = raws.pop() if len(raws) == 1 else None
            if raw is None and not all(self.need_blocks(s.raw, 1) for _, _, s in split):
                raise Conflict(f"'{ev.name}' mixes fused layouts")
            return [SplitAt(s0.dim, raw)] * len(ev.outputs)
        if len(split) != 1 or p0 != 0:
            raise Conflict(f"a split tensor is read by '{ev.name}'")
        for _, n in ins[1:]:
            if ev.name not in INDEXING:  # an index carries no gradient
                self.replicated_use(n, ev.name)
        outs = [self.shapes[n] for n in ev.outputs]
        if ev.name in SPLITS:
            if ev.name != "unbind" and all(o[s0.dim] == a[s0.dim] for o in outs):
                return [s0] * len(outs)
            changed = [d for d in range(len(a)) if ev.name != "unbind" and outs[0][d] != a[d]]
            if ev.name == "unbind" or changed != [s0.dim]:
                if ev.name == "unbind" and len(outs[0]) == len(a) - 1:
                    dim = next((d for d in range(len(a)) if a[:d] + a[d + 1:] == outs[0] and d != s0.dim), None)
                    if dim is not None:
                        return [SplitAt(s0.dim - (dim < s0.dim), s0.raw)] * len(outs)
                raise Conflict(f"'{ev.name}' splits a split tensor in a way that cannot be followed")
            if s0.raw is None or len({o[s0.dim] for o in outs}) != 1 or not self.need_blocks(s0.raw, len(outs)):
                raise Conflict(f"'{ev.name}' cuts the split dim into unequal or unfused parts")
            return [SplitAt(s0.dim, None)] * len(outs)
        if len(ev.outputs) != 1:
            raise Conflict(f"a split tensor is read by '{ev.name}'")
        b = outs[0]
        if ev.name == "__getitem__":
            k = common_suffix(a, b)
            if len(a) - s0.dim > k:
                raise Conflict("indexing touches the split dim")
            return [SplitAt(len(b) - (len(a) - s0.dim), s0.raw)]
        if ev.name in TRANSPOSES:
            order = self._permutation(ev, len(a))
            return [SplitAt(order.index(s0.dim), s0.raw)]
        if ev.name in RESHAPES:
            j = reshaped_dim(a, b, s0.dim)
            if j is None:
                raise Conflict(f"'{ev.name}' reshapes across the split dim")
            return [SplitAt(j, s0.raw)]
        raise Conflict(f"a split tensor is read by '{ev.name}' (not element-wise)")

    def partial_op(self, ev: OpCall) -> list:
        """Rules for ops reading partial sums: only linear ones keep them partial."""
        ins = [(p, n) for p, n in enumerate(ev.inputs) if n is not None]
        partial = [(p, n) for p, n in ins if self.state.get(n) == PARTIAL]
        others = [(p, n) for p, n in ins if self.state.get(n) != PARTIAL]
        name = ev.name
        if name in CASTS or name in LAYOUT_ANY or name in REDUCTIONS:
            if partial[0][0] != 0 or len(partial) != 1:
                raise Conflict(f"'{name}' reads a partial sum in an unsupported position")
            for _, n in others:
                if name not in INDEXING:
                    self.replicated_use(n, name)
            return [PARTIAL] * len(ev.outputs)
        if name in MULS or name in DIVS:
            if len(partial) != 1 or (name in DIVS and partial[0][0] != 0):
                raise Conflict(f"'{name}' of a partial sum by another partial sum, or divides by one")
            for _, n in others:
                self.replicated_use(n, name)
            return [PARTIAL]
        if name in ADDS or name in ("cat", "stack"):
            if any(n not in self.zero for _, n in others) or (name in ADDS and None in ev.inputs[:2]):
                raise Conflict(f"'{name}' adds a replicated tensor to a partial sum (it would count {self.mp} times)")
            return [PARTIAL] * len(ev.outputs)
        if name in ACCUMULATES:
            target = ev.inputs[0]
            if target is None or (self.state.get(target) != PARTIAL and target not in self.zero):
                raise Conflict(f"'{name}' accumulates partial sums into a tensor not known to be zero")
            for p, n in others:  # (self, dim, index, source): only the index may be replicated
                if n != target and p != 2:
                    raise Conflict(f"'{name}' accumulates a replicated tensor (it would count {self.mp} times)")
            return [PARTIAL] * len(ev.outputs)
        raise Conflict(f"a partial sum is read by '{name}' (not linear)")
