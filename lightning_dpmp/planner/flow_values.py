"""Flow rules for ops that compute values: element-wise ops, dtype donors (``to``/``type_as``), losses,
reductions, ``einsum``, attention-like batched ops (matmuls over split heads, softmax, sdpa), and the bookkeeping of
replicated tensors that are constant along a dim (a ``zeros((1, n_heads, T, S))`` bias may meet split heads once
the literal that sized it is set per rank).

:class:`ValueRules` is mixed into the analysis of :mod:`lightning_dpmp.planner.flow`, which owns the regions and
the op table (``flow.OPS``); each rule returns per-output ``(dim, raw)`` or a string saying why the region breaks.
"""

from __future__ import annotations

from typing import Optional, Union

from lightning_dpmp.planner.flow_state import AnalysisState, Shard
from lightning_dpmp.planner.ops import BINARY, FIRST_ONLY, UNARY
from lightning_dpmp.planner.trace import OpCall

__all__ = ["ValueRules"]


class ValueRules(AnalysisState):
    """Rules for point-wise, reducing, contracting and attention-like ops."""

    uniform: dict[int, dict[int, Optional[tuple[str, int]]]]  # provided by the analysis, as AnalysisState's

    def _elementwise(self, ev: OpCall, ins: list[tuple[int, Shard]]) -> Union[str, list]:
        """Point-wise ops: split operands must line up (broadcasting from the right) on one split dim."""
        out_shape = self._shape(ev.outputs[0])
        nd = len(out_shape)
        aligned = set()
        for p, s in ins:
            shape = self._shape(ev.inputs[p])
            dim = s.dim + nd - len(shape)
            if shape[s.dim] != out_shape[dim]:
                return f"used by '{ev.name}' broadcasting its split dim"
            aligned.add(dim)
        if len(aligned) != 1:
            return f"used by '{ev.name}' with differently split operands"
        dim = aligned.pop()
        if self._not_neutral(ev, ins, dim, nd):
            return f"used by '{ev.name}' together with a replicated full-width tensor"
        raws = {s.raw for _, s in ins}
        raw = raws.pop() if len(raws) == 1 else None
        if raw is None and any(not self.need_blocks(s, 1) for _, s in ins):
            return f"used by '{ev.name}' mixing fused layouts"
        return [(dim + len(self._shape(n)) - nd, raw) for n in ev.outputs]

    def _first_only(self, ev: OpCall, ins: list[tuple[int, Shard]]) -> Union[str, list]:
        """``x.to(y)``, ``x.type_as(y)``: only the first operand's data flows; the other gives a dtype/device."""
        (pos, sh) = ins[0]
        if pos != 0:
            return [None] * len(ev.outputs)  # a split tensor used as a dtype donor: the output is not split
        return [(sh.dim, sh.raw)] * len(ev.outputs)

    def _loss(self, ev: OpCall, ins: list[tuple[int, Shard]]) -> Union[str, list]:
        (pos, sh) = ins[0]
        in_shape = self._shape(ev.inputs[pos])
        if pos == 0 and len(ins) == 1 and len(in_shape) == 2 and sh.dim == 1 and self.need_blocks(sh, 1):
            self.regions[self.find(sh.region)].losses += 1
            return [None] * len(ev.outputs)
        return f"used by '{ev.name}' in a layout other than (N, classes)"

    def _reduce(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        """Reductions over other dims (a per-head norm over ``head_dim``) keep the split; over it, they break."""
        nd = len(shape)
        ints = [v for v in ev.values[1:] if v is not None]
        axes = {d % nd for d in ints} if ints else set(range(nd))
        if sh.dim in axes:
            return f"reduced by '{ev.name}' across the split dim"
        out_nd = len(self._shape(ev.outputs[0]))
        new = sh.dim if out_nd == nd else sh.dim - sum(d < sh.dim for d in axes)
        return [(new, None)] * len(ev.outputs)

    def _einsum(self, ev: OpCall, ins: list[tuple[int, Shard]]) -> Union[str, list]:
        """``einsum``: the split letter must be the same in every split operand, kept in the output, and absent
        (or of size 1) in the replicated operands."""
        eq = next((e[1] for e in ev.index if e[0] == "equation"), "")
        lhs, _, out = eq.replace(" ", "").partition("->")
        terms = lhs.split(",")
        operands = [n for n in ev.inputs if n is not None]
        if "." in eq or not out or len(terms) != len(operands):
            return f"used by '{ev.name}' with an equation the trace cannot follow"
        positions = [p for p, n in enumerate(ev.inputs) if n is not None]
        by_pos = dict(ins)
        letters = {terms[i][by_pos[p].dim] for i, p in enumerate(positions) if p in by_pos}
        if len(letters) != 1:
            return f"used by '{ev.name}' with differently split operands"
        letter = letters.pop()
        if letter not in out:
            return f"contracted by '{ev.name}' along the split dim"
        for i, p in enumerate(positions):
            if p not in by_pos and letter in terms[i] and self._shape(ev.inputs[p])[terms[i].index(letter)] != 1:
                return f"used by '{ev.name}' with unsplit heads"
        return [(out.index(letter), None)]

    def _carry_uniform(self, ev: OpCall) -> None:
        """Element-wise ops of replicated tensors stay uniform along a dim where every operand is (or is 1)."""
        if ev.name not in UNARY | BINARY | FIRST_ONLY or len(ev.outputs) != 1:
            for n in ev.outputs:
                self.uniform.pop(n, None)
            return
        out_shape = self.trace.shapes[ev.outputs[0]]
        nd = len(out_shape)
        dims: dict[int, Optional[tuple[str, int]]] = {}
        operands = [n for n in ev.inputs if n is not None]
        if ev.name in FIRST_ONLY:
            operands = operands[:1]
        for d in range(nd):
            literal, ok = None, True
            for n in operands:
                shape = self.trace.shapes[n]
                a = d - (nd - len(shape))
                if a < 0 or shape[a] == 1:
                    continue
                if a not in self.uniform.get(n, {}):
                    ok = False
                    break
                literal = self.uniform[n][a]
            if ok and literal is not None:
                dims[d] = literal
        self.uniform.pop(ev.outputs[0], None)  # after reading: x.contiguous() may return x itself
        if dims:
            self.uniform[ev.outputs[0]] = dims

    def _not_neutral(self, ev: OpCall, ins: list, dim: int, ndim: int) -> bool:
        """Whether a replicated operand spans the split dim at full extent (it would need slicing). A constant
        one sized by a literal is neutral: that literal becomes per-rank (see :func:`structure.resolve_literals`)."""
        split_pos = {p for p, _ in ins}
        region = self.regions[self.find(ins[0][1].region)]
        for p, n in enumerate(ev.inputs):
            if n is None or p in split_pos:
                continue
            shape = self.trace.shapes[n]
            aligned = dim - (ndim - len(shape))
            if aligned >= 0 and shape[aligned] != 1:
                literal = self.uniform.get(n, {}).get(aligned)
                if literal is None:
                    return True
                region.scoped.add((*literal, region.derived(literal[1])))
        return False


    def _batched(self, ev: OpCall, ins: list) -> Union[str, list]:
        """Attention-like ops over a split batch-like dim (heads): matmuls, softmax, sdpa."""
        shape = self._shape(ev.inputs[ins[0][0]])
        ndim = len(shape)
        dims = {s.dim + ndim - len(self._shape(ev.inputs[p])) for p, s in ins}
        if len(dims) != 1 or any(not self.need_blocks(s, 1) for _, s in ins):
            return f"used by '{ev.name}' with differently split operands"
        dim = dims.pop()
        if ev.name in ("softmax", "log_softmax"):
            axis = next((v for v in ev.values[1:] if v is not None), -1) % ndim
            return f"normalised by '{ev.name}' across the split dim" if axis == dim else [(dim, None)]
        if dim >= ndim - 2:
            return f"used by '{ev.name}' along a matrix dim"
        needed = {0, 1, 2} if ev.name == "scaled_dot_product_attention" else set()
        if not needed <= {p for p, _ in ins} or self._not_neutral(ev, ins, dim, ndim):
            return f"used by '{ev.name}' with unsplit heads"
        out_nd = len(self._shape(ev.outputs[0]))
        return [(dim + out_nd - ndim, None)] * len(ev.outputs)
