"""Shardedness propagation over a recorded step: where a column layer's output may stay split.

Every candidate column layer (``out_features % mp == 0``) starts a *region*: its output is split on the last dim.
Each recorded call either keeps a region's tensors split (element-wise ops; head reshapes ``(B, T, C) -> (B, T,
H, d)`` that split whole heads; transposes; attention over split heads; chunks of fused projections), reads them
as a row layer (the region's exit), reads them as a vocab-parallel cross-entropy (an LM head's exit), or breaks
the region (anything else: a norm, a full-width reshape, ``argmax``, being returned). Broken regions fall back to
self-contained layers; the planner (:mod:`lightning_dpmp.planner.plan`) picks among the rest.

Example:
    >>> flow = analyse(trace, linears, mp=2, forced={})          # doctest: +SKIP
    >>> flow.roles                                                # doctest: +SKIP
    {'blocks.0.attn.q_proj': 'column', ..., 'blocks.0.attn.out_proj': 'row', 'lm_head': 'vocab'}
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from torch import nn

from lightning_dpmp.planner.ops import (
    ATTENTION, BATCHED, BINARY, CONCATS, EXPANDS, FACTORIES, FIRST_ONLY, LOSSES, MATMULS, REDUCTIONS, RESHAPES, SPLITS,
    TRANSPOSES, UNARY,
)
from lightning_dpmp.planner.trace import LinearCall, OpCall, Trace

__all__ = ["Flow", "analyse"]


@dataclass
class _Shard:
    region: int
    dim: int
    raw: Optional[str]  # source layer whose raw output layout this still is (fused blocks not yet decided)


@dataclass
class _Region:
    sources: set[str]
    sinks: set[str] = field(default_factory=set)
    losses: int = 0
    conflicts: list[str] = field(default_factory=list)
    literals: set[int] = field(default_factory=set)
    simple: bool = True  # element-wise ops only (an MLP); False once heads/attention are involved
    attention: bool = False  # softmax, scaled_dot_product_attention or a matmul of two split activations
    queried: set[int] = field(default_factory=set)  # split-dim sizes the code read from split tensors
    scoped: set[tuple[str, int, bool]] = field(default_factory=set)  # (module, literal, derived?) sizing a constant

    def derived(self, value: int) -> bool:
        """Whether a reshape literal can come from a size the code read off a split tensor (``x.shape``): then
        it is per-rank at run time by itself (``reshape(B, n_kv * n_rep, T, d)`` in repeat-kv)."""
        return any(value == q or (q > 1 and value % q == 0) for q in self.queried)


@dataclass
class Flow:
    """What the analysis found: roles per layer, partners, why layers stay unpaired, fused blocks and literals."""

    roles: dict[str, str] = field(default_factory=dict)  # "column" | "row" | "vocab"
    partners: dict[str, set[str]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)
    literals: dict[str, set[int]] = field(default_factory=dict)  # per paired source: fixed sizes to adjust
    scoped: dict[str, set[tuple[str, int, bool]]] = field(default_factory=dict)  # per source: (module, size, derived?)
    simple: dict[str, bool] = field(default_factory=dict)
    attention: dict[str, bool] = field(default_factory=dict)  # per paired layer: its region involves attention


class _Analysis:
    def __init__(self, trace: Trace, mp: int, can_source: Callable[[str], bool], can_sink: Callable[[str], bool],
                 can_source_embedding: Callable[[str], bool] = lambda name: False):
        self.trace, self.mp = trace, mp
        self.can_source, self.can_sink = can_source, can_sink
        self.can_source_embedding = can_source_embedding
        # Replicated tensors that do not vary along some dims (a zeros((1, n_heads, T, S)) bias): dim -> the
        # literal that sized it (with the module that made it), or None. They can meet split tensors there
        # once that literal is set per rank.
        self.uniform: dict[int, dict[int, Optional[tuple[str, int]]]] = {}
        self.parent: list[int] = []
        self.regions: list[_Region] = []
        self.state: dict[int, _Shard] = {}
        self.blocks: dict[str, int] = {}

    # ---- regions
    def find(self, r: int) -> int:
        while self.parent[r] != r:
            self.parent[r] = self.parent[self.parent[r]]
            r = self.parent[r]
        return r

    def union(self, rs: set[int]) -> int:
        roots = sorted({self.find(r) for r in rs})
        keep = roots[0]
        for r in roots[1:]:
            self.parent[r] = keep
            a, b = self.regions[keep], self.regions[r]
            a.sources |= b.sources
            a.sinks |= b.sinks
            a.losses += b.losses
            a.conflicts += b.conflicts
            a.literals |= b.literals
            a.simple &= b.simple
            a.queried |= b.queried
            a.scoped |= b.scoped
            a.attention |= b.attention
        return keep

    def new_region(self, source: str) -> int:
        self.parent.append(len(self.parent))
        self.regions.append(_Region({source}))
        return len(self.parent) - 1

    def need_blocks(self, sh: _Shard, k: int) -> bool:
        if sh.raw is None:
            return k == 1
        return self.blocks.setdefault(sh.raw, k) == k

    # ---- the pass
    def run(self) -> None:
        for ev in self.trace.events:
            if isinstance(ev, LinearCall):
                self.linear(ev)
            else:
                self.op(ev)
        for n in self.trace.escapes:
            if n in self.state:
                self.regions[self.find(self.state[n].region)].conflicts.append("returned from the step")

    def linear(self, ev: LinearCall) -> None:
        sh = self.state.get(ev.input)
        if sh is not None:
            r = self.regions[self.find(sh.region)]
            last = len(self.trace.shapes[ev.input]) - 1
            if self.can_sink(ev.name) and sh.dim == last and self.need_blocks(sh, 1):
                r.sinks.add(ev.name)
            else:
                r.conflicts.append(f"read by {ev.name}, which cannot be its row layer")
        self.state.pop(ev.output, None)
        if self.can_source(ev.name):
            self.state[ev.output] = _Shard(self.new_region(ev.name), len(self.trace.shapes[ev.output]) - 1, ev.name)

    def op(self, ev: OpCall) -> None:
        if ev.name == "size":  # a shape query: remember split-dim sizes the code reads (see _Region.derived)
            sh = self.state.get(ev.inputs[0])  # type: ignore[arg-type]
            if sh is not None:
                self.regions[self.find(sh.region)].queried.add(self.trace.shapes[ev.inputs[0]][sh.dim])  # type: ignore[index]
            return
        if ev.name == "embedding":  # a table whose rows reach split tensors can be split by columns (heads)
            name, out = ev.index[0][1], ev.outputs[0]
            self.state.pop(out, None)
            if self.can_source_embedding(name):
                self.state[out] = _Shard(self.new_region(name), len(self.trace.shapes[out]) - 1, None)
            return
        if ev.name in FACTORIES:
            (out,), shape = ev.outputs, self.trace.shapes[ev.outputs[0]]
            sizes = [v for v in ev.values if v is not None][: len(shape)]
            scope = ev.index[0][1] if ev.index else ""
            self.uniform[out] = {d: ((scope, sizes[d]) if len(sizes) == len(shape) else None) for d in range(len(shape))}
            return
        ins = [(i, self.state[n]) for i, n in enumerate(ev.inputs) if n is not None and n in self.state]
        if not ins:
            self._carry_uniform(ev)
            for n in ev.outputs:  # an in-place op may overwrite a split tensor with replicated data
                self.state.pop(n, None)
            return
        regions = {sh.region for _, sh in ins}
        result = self.rule(ev, ins)
        if isinstance(result, str):
            for r in regions:
                self.regions[self.find(r)].conflicts.append(result)
            for n in ev.outputs:
                self.state.pop(n, None)
            return
        r = self.union(regions)
        if ev.name not in UNARY and ev.name not in BINARY:
            self.regions[r].simple = False
        if ev.name in ATTENTION or (ev.name in MATMULS | {"einsum"} and len(ins) > 1):
            self.regions[r].attention = True
        for n, out in zip(ev.outputs, result):
            if out is None:
                self.state.pop(n, None)
            else:
                self.state[n] = _Shard(r, out[0], out[1])

    # ---- rules: return per-output (dim, raw) or None, or a string saying why the region breaks
    def rule(self, ev: OpCall, ins: list[tuple[int, _Shard]]) -> Union[str, list]:
        """Dispatch on :data:`OPS`: each handler says where the split dim of each output is, from what the op
        does to dims (never from module or parameter names)."""
        handler = OPS.get(ev.name)
        if handler is None:
            return f"used by '{ev.name}' (no rule for this op)"
        return handler(self, ev, ins)

    def _shape(self, node: Optional[int]) -> tuple:
        return self.trace.shapes[node]  # type: ignore[index]

    def _elementwise(self, ev: OpCall, ins: list[tuple[int, _Shard]]) -> Union[str, list]:
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

    def _first_only(self, ev: OpCall, ins: list[tuple[int, _Shard]]) -> Union[str, list]:
        """``x.to(y)``, ``x.type_as(y)``: only the first operand's data flows; the other gives a dtype/device."""
        (pos, sh) = ins[0]
        if pos != 0:
            return [None] * len(ev.outputs)  # a split tensor used as a dtype donor: the output is not split
        return [(sh.dim, sh.raw)] * len(ev.outputs)

    def _loss(self, ev: OpCall, ins: list[tuple[int, _Shard]]) -> Union[str, list]:
        (pos, sh) = ins[0]
        in_shape = self._shape(ev.inputs[pos])
        if pos == 0 and len(ins) == 1 and len(in_shape) == 2 and sh.dim == 1 and self.need_blocks(sh, 1):
            self.regions[self.find(sh.region)].losses += 1
            return [None] * len(ev.outputs)
        return f"used by '{ev.name}' in a layout other than (N, classes)"

    def _getitem(self, ev: OpCall, sh: _Shard, shape: tuple) -> Union[str, list]:
        """Indexing and slicing keep the split when the split dim is taken whole (``x[..., :d // 2]`` on the
        head dim of rotary embeddings, ``logits[:, :-1]``); an index into the split dim breaks it."""
        new = _index_target(ev.index, sh.dim, shape)
        if isinstance(new, str):
            return f"{new} by '{ev.name}'"
        out_shape = self._shape(ev.outputs[0])
        if new >= len(out_shape) or out_shape[new] != shape[sh.dim]:
            return f"indexed by '{ev.name}' in a way that moves the split dim"
        return [(new, sh.raw)]

    def _concat(self, ev: OpCall, ins: list[tuple[int, _Shard]]) -> Union[str, list]:
        """``cat``/``stack`` along another dim (rotary halves, a KV cache growing along the sequence): every
        non-empty operand must be split on the same dim; empty ones (a fresh cache) carry nothing."""
        split = dict(ins)
        operands = [(p, n) for p, n in enumerate(ev.inputs) if n is not None]
        ints = [v for v in ev.values if v is not None]
        out_nd = len(self._shape(ev.outputs[0]))
        axis = (ints[-1] if ints else 0) % out_nd
        dims, raws = set(), set()
        for p, n in operands:
            shape = self._shape(n)
            if math.prod(shape) == 0:
                continue
            if p not in split:
                return f"concatenated by '{ev.name}' with a replicated tensor"
            dims.add(split[p].dim)
            raws.add(split[p].raw)
        if len(dims) != 1:
            return f"concatenated by '{ev.name}' with differently split operands"
        dim = dims.pop()
        if ev.name == "stack":
            dim += axis <= dim
        elif axis == dim:
            return f"concatenated by '{ev.name}' along the split dim"
        raw = raws.pop() if len(raws) == 1 else None
        if raw is None and any(not self.need_blocks(s, 1) for s in split.values()):
            return f"concatenated by '{ev.name}' mixing fused layouts"
        return [(dim, raw)]

    def _unsqueeze(self, ev: OpCall, sh: _Shard, shape: tuple) -> Union[str, list]:
        ints = [v for v in ev.values[1:] if v is not None]
        axis = (ints[0] if ints else 0) % (len(shape) + 1)
        return [(sh.dim + (axis <= sh.dim), sh.raw)]

    def _squeeze(self, ev: OpCall, sh: _Shard, shape: tuple) -> Union[str, list]:
        out_shape = self._shape(ev.outputs[0])
        removed = len(shape) - len(out_shape)
        ints = [v % len(shape) for v in ev.values[1:] if v is not None]
        gone = [d for d in (ints or range(len(shape))) if shape[d] == 1]
        if len(gone) != removed:
            return f"squeezed by '{ev.name}' in a way the trace cannot follow"
        return [(sh.dim - sum(d < sh.dim for d in gone), sh.raw)]

    def _expand(self, ev: OpCall, sh: _Shard, shape: tuple) -> Union[str, list]:
        """``expand``/``broadcast_to``/``repeat``: new or size-1 dims grow; the split dim must keep its size
        (the repeat-kv pattern ``k[:, :, None].expand(B, Hkv, n_rep, T, d)``)."""
        out_shape = self._shape(ev.outputs[0])
        new = sh.dim + len(out_shape) - len(shape)
        if out_shape[new] != shape[sh.dim]:
            return f"repeated by '{ev.name}' along the split dim"
        return [(new, sh.raw)]

    def _narrow(self, ev: OpCall, sh: _Shard, shape: tuple) -> Union[str, list]:
        ints = [v for v in ev.values[1:] if v is not None]
        if not ints or ints[0] % len(shape) == sh.dim:
            return f"narrowed by '{ev.name}' along the split dim"
        return [(sh.dim, sh.raw)]

    def _reduce(self, ev: OpCall, sh: _Shard, shape: tuple) -> Union[str, list]:
        """Reductions over other dims (a per-head norm over ``head_dim``) keep the split; over it, they break."""
        nd = len(shape)
        ints = [v for v in ev.values[1:] if v is not None]
        axes = {d % nd for d in ints} if ints else set(range(nd))
        if sh.dim in axes:
            return f"reduced by '{ev.name}' across the split dim"
        out_nd = len(self._shape(ev.outputs[0]))
        new = sh.dim if out_nd == nd else sh.dim - sum(d < sh.dim for d in axes)
        return [(new, None)] * len(ev.outputs)

    def _einsum(self, ev: OpCall, ins: list[tuple[int, _Shard]]) -> Union[str, list]:
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
        nd, dims = len(out_shape), {}
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

    def _reshape(self, ev: OpCall, sh: _Shard, a: tuple) -> Union[str, list]:
        b = self._shape(ev.outputs[0])
        groups = _dim_groups(a, b)
        grp = next((g for g in groups if sh.dim in g[0]), None)
        if grp is None:
            return f"reshaped by '{ev.name}' across the split dim"
        ins, outs = grp
        if any(a[i] != 1 for i in ins if i < sh.dim):
            return f"reshaped by '{ev.name}' merging the split dim into an outer one"
        outs = [j for j in outs if b[j] != 1] or outs
        raw, new = sh.raw, outs[0]
        if len(outs) >= 3 and raw is not None and b[outs[1]] % self.mp == 0 and self.need_blocks(sh, b[outs[0]]):
            new, raw = outs[1], None  # fused (B, T, 3, H, d): the split is on H inside each of the 3 blocks
        elif not self.need_blocks(sh, 1):
            return f"reshaped by '{ev.name}' in a way that does not match its fused blocks"
        else:
            raw = None if len(outs) > 1 or len(ins) > 1 else raw
        if b[new] % self.mp:
            return f"reshaped to {b[new]} heads/groups at dim {new}, not divisible by mp={self.mp}"
        if ev.name in ("view", "reshape"):
            literal = [v for v in ev.values[1:]]
            region = self.regions[self.find(sh.region)]
            if len(literal) == len(b) and literal[new] not in (None, -1) and not region.derived(int(literal[new])):
                region.literals.add(int(literal[new]))
        return [(new, raw)]

    def _transpose(self, ev: OpCall, sh: _Shard, shape: tuple) -> Union[str, list]:
        ndim = len(shape)
        ints = [v for v in ev.values[1:] if v is not None]
        if ev.name == "permute":
            order = [d % ndim for d in ints]
            return [(order.index(sh.dim), sh.raw if order.index(sh.dim) == sh.dim else None)]
        a, b = ([ndim - 2, ndim - 1] if ev.name in ("t", "T", "mT") else [d % ndim for d in ints[:2]])
        new = b if sh.dim == a else a if sh.dim == b else sh.dim
        if new != sh.dim and not self.need_blocks(sh, 1):
            return f"transposed by '{ev.name}' before its fused blocks were separated"
        return [(new, sh.raw if new == sh.dim else None)]

    def _split(self, ev: OpCall, sh: _Shard, shape: tuple) -> Union[str, list]:
        ints = [v for v in ev.values[1:] if v is not None]
        if ev.name == "unbind":
            dim = (ints[0] if ints else 0) % len(shape)
            if dim == sh.dim:
                return "unbound by 'unbind' along the split dim"
            return [(sh.dim - (dim < sh.dim), None)] * len(ev.outputs)
        dim = (ints[-1] if len(ints) >= 2 else 0) % len(shape)
        if dim != sh.dim:
            return [(sh.dim, sh.raw)] * len(ev.outputs)
        if ev.name == "split" and len(ints) == 2:  # split(size, dim): a fixed size becomes per-rank
            self.regions[self.find(sh.region)].literals.add(int(ints[0]))
        pieces = len(ev.outputs)
        sizes = {self.trace.shapes[n][dim] for n in ev.outputs}
        if len(sizes) != 1 or not self.need_blocks(sh, pieces) or sizes.pop() % self.mp:
            return f"split by '{ev.name}' into unequal or indivisible parts along the split dim"
        return [(sh.dim, None)] * pieces

    def _repeat_interleave(self, ev: OpCall, sh: _Shard, shape: tuple) -> Union[str, list]:
        ints = [v for v in ev.values[1:] if v is not None]
        if len(ints) < 2 and len(shape) > 1:
            return f"flattened by '{ev.name}'"
        return [(sh.dim, None)]

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


def _index_target(index: tuple, dim: int, shape: tuple) -> Union[int, str]:
    """Where input dim ``dim`` lands in ``x[index]``, or why it does not survive (indexed into, or moved by
    advanced indexing in a way that interleaves it)."""
    consumed = sum(it[1] if it[0] == "tensor" and it[2] else 1 for it in index if it[0] not in ("none", "ellipsis"))
    full = ("slice", None, None, None)
    items: list[tuple] = []
    for it in index:
        items.extend([full] * (len(shape) - consumed) if it[0] == "ellipsis" else [it])
    if not any(it[0] == "ellipsis" for it in index):
        items.extend([full] * (len(shape) - consumed))
    adv = [k for k, it in enumerate(items) if it[0] == "tensor"]
    adv_nd = max((it[1] if not it[2] else 1 for it in items if it[0] == "tensor"), default=0)
    adjacent = not adv or adv == list(range(adv[0], adv[-1] + 1))
    in_d = out_d = 0
    target: Optional[int] = None
    placed = False
    if adv and not adjacent:
        out_d, placed = adv_nd, True  # non-adjacent advanced indices put their result first
    for it in items:
        kind = it[0]
        if kind == "none":
            out_d += 1
            continue
        width = it[1] if kind == "tensor" and it[2] else 1
        if in_d <= dim < in_d + width:
            if kind != "slice":
                return "indexed along the split dim"
            start, stop, step = it[1], it[2], it[3]
            if (start or 0) != 0 or (step or 1) != 1 or (stop is not None and stop < shape[dim]):
                return "sliced along the split dim"
            target = out_d
        if kind == "tensor":
            if not placed:
                out_d, placed = out_d + adv_nd, True
        elif kind != "int":
            out_d += 1
        in_d += width
    return target if target is not None else "indexed in a way the trace cannot follow"


def _dim_groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims of ``a`` and ``b`` whose sizes multiply to the same number (a reshape's structure)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj = [i] if i < len(a) else [], [j] if j < len(b) else []
        pa = a[i] if i < len(a) else 1
        pb = b[j] if j < len(b) else 1
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa *= a[i]
                gi.append(i)
                i += 1
            elif j < len(b):
                pb *= b[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def _on_first(method: Callable) -> Callable:
    """A layout op of one tensor (reshape, transpose, index...): only its first argument may be split."""

    def run(an: _Analysis, ev: OpCall, ins: list[tuple[int, _Shard]]) -> Union[str, list]:
        if len(ins) != 1 or ins[0][0] != 0:
            return f"used by '{ev.name}' with a split tensor in another argument"
        return method(an, ev, ins[0][1], an._shape(ev.inputs[0]))

    return run


# One table: op name -> rule. Everything not listed breaks the region (the layer then gathers its output).
OPS: dict[str, Callable] = {
    **{n: _Analysis._elementwise for n in UNARY | BINARY},
    **{n: _Analysis._first_only for n in FIRST_ONLY},
    **{n: _Analysis._loss for n in LOSSES},
    **{n: _on_first(_Analysis._reshape) for n in RESHAPES},
    **{n: _on_first(_Analysis._transpose) for n in TRANSPOSES},
    **{n: _on_first(_Analysis._split) for n in SPLITS},
    **{n: _on_first(_Analysis._reduce) for n in REDUCTIONS},
    **{n: _on_first(_Analysis._expand) for n in EXPANDS},
    **{n: _Analysis._concat for n in CONCATS},
    **{n: _Analysis._batched for n in BATCHED},
    "__getitem__": _on_first(_Analysis._getitem),
    "unsqueeze": _on_first(_Analysis._unsqueeze),
    "squeeze": _on_first(_Analysis._squeeze),
    "narrow": _on_first(_Analysis._narrow),
    "repeat_interleave": _on_first(_Analysis._repeat_interleave),
    "einsum": _Analysis._einsum,
}


def analyse(
    trace: Trace,
    linears: dict[str, nn.Linear],
    mp: int,
    forced: dict[str, str],
    complex_ok: bool = True,
    embeddings: Optional[dict[str, nn.Embedding]] = None,
) -> Flow:
    """Find the pairs (and vocab-parallel heads) of a traced step; ``complex_ok=False`` keeps only MLP-like pairs.

    Every layer gets at most one role. A layer can be the row end of one region and the source of the next (a
    chain ``L1 -> L2 -> L3 -> L4``); the regions are then taken greedily in call order, each only if none of its
    layers has a role yet: ``(L1 column, L2 row), (L3 column, L4 row)``. Layers left out become self-contained.

    ``embeddings`` (called once, plain, ``embedding_dim % mp == 0``) may join a region as column sources split
    by ``embedding_dim``: a relative position bias table whose output reaches head-parallel attention.
    """
    calls = Counter(c.name for c in trace.linear_calls())
    order = {c.name: i for i, c in reversed(list(enumerate(trace.linear_calls())))}
    tables = embeddings or {}

    def can_source_embedding(n: str) -> bool:
        e = tables.get(n)
        plain = e is not None and e.max_norm is None and not e.sparse and not e.scale_grad_by_freq
        return plain and trace.embeddings.get(n, 0) == 1 and n not in forced and e.embedding_dim % mp == 0  # type: ignore[union-attr]

    def can_source(n: str) -> bool:
        return calls[n] == 1 and forced.get(n, "column") in ("column", "vocab") and linears[n].out_features % mp == 0

    def can_sink(n: str) -> bool:
        return calls[n] == 1 and forced.get(n, "row") == "row" and linears[n].in_features % mp == 0

    an = _Analysis(trace, mp, can_source, can_sink, can_source_embedding)
    an.run()
    flow = Flow()
    candidates: list[_Region] = []
    for root in sorted({an.find(r) for r in range(len(an.parent))}):
        reg = an.regions[root]
        if reg.conflicts:
            flow.why.update((s, f"output {reg.conflicts[0]}") for s in reg.sources)
        elif not complex_ok and not reg.simple and reg.sinks:  # a pair; a vocab-parallel head pairs with nothing
            kind = "attention-like region" if reg.attention else "paired region (reshapes/transposes)"
            flow.why.update((s, f"{kind} disabled after a failed verification") for s in reg.sources)
        elif not reg.sources - set(tables):
            continue  # a region fed only by embedding tables has nothing of its own to split
        elif reg.losses and not reg.sinks and len(reg.sources) == 1 or reg.sinks and not reg.losses:
            candidates.append(reg)
    taken: dict[str, str] = {}  # layer -> the first layer of the region that gave it its role

    def rank(name: str) -> int:  # call order; an embedding table joining a region counts last
        return order.get(name, len(order))

    for reg in sorted(candidates, key=lambda g: min(rank(s) for s in g.sources)):
        members = reg.sources | reg.sinks
        first = min(reg.sources, key=rank)
        clash = sorted(m for m in members if m in taken)
        if clash:
            held = f"{clash[0]} already is {flow.roles[clash[0]]} (paired from {taken[clash[0]]})"
            flow.why.update((s, f"one role per layer: {held}") for s in reg.sources)
            continue
        taken.update((m, first) for m in members)
        if not reg.sinks:
            flow.roles[first] = "vocab"
            continue
        for s in reg.sources:
            flow.roles[s], flow.partners[s] = "column", set(reg.sinks)
            flow.blocks[s] = an.blocks.get(s, 1)
            flow.literals[s] = set(reg.literals)
            flow.scoped[s] = set(reg.scoped)
            flow.simple[s] = reg.simple
            flow.attention[s] = reg.attention
        for s in reg.sinks:
            flow.roles[s], flow.partners[s] = "row", set(reg.sources)
            flow.attention[s] = reg.attention
    return flow
