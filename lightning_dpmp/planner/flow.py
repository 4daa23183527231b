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

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from torch import nn

from lightning_dpmp.planner.trace import LinearCall, OpCall, Trace

__all__ = ["Flow", "analyse"]

UNARY = {
    "relu", "relu_", "gelu", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "elu", "selu", "celu",
    "leaky_relu", "hardtanh", "relu6", "softplus", "mish", "hardswish", "hardsigmoid", "logsigmoid", "softsign",
    "dropout", "dropout_", "alpha_dropout", "exp", "log", "neg", "__neg__", "__pos__", "abs", "square", "sqrt",
    "rsqrt", "sin", "cos", "erf", "clamp", "clamp_", "clip", "float", "double", "half", "bfloat16", "to",
    "type_as", "contiguous", "clone", "detach", "__get__",
}
BINARY = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "true_divide", "pow", "maximum", "minimum",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__", "__pow__", "masked_fill", "masked_fill_", "where",
}
RESHAPES = {"view", "reshape", "flatten"}
TRANSPOSES = {"transpose", "swapaxes", "permute", "t"}
SPLITS = {"chunk", "split", "unbind"}
BATCHED = {"scaled_dot_product_attention", "matmul", "__matmul__", "bmm", "softmax", "log_softmax", "repeat_interleave"}
LOSSES = {"cross_entropy"}
ATTENTION = {"scaled_dot_product_attention", "softmax", "log_softmax"}
MATMULS = {"matmul", "__matmul__", "bmm"}


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


@dataclass
class Flow:
    """What the analysis found: roles per layer, partners, why layers stay unpaired, fused blocks and literals."""

    roles: dict[str, str] = field(default_factory=dict)  # "column" | "row" | "vocab"
    partners: dict[str, set[str]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)
    literals: dict[str, set[int]] = field(default_factory=dict)  # per paired source: fixed sizes to adjust
    simple: dict[str, bool] = field(default_factory=dict)
    attention: dict[str, bool] = field(default_factory=dict)  # per paired layer: its region involves attention


class _Analysis:
    def __init__(self, trace: Trace, mp: int, can_source: Callable[[str], bool], can_sink: Callable[[str], bool]):
        self.trace, self.mp = trace, mp
        self.can_source, self.can_sink = can_source, can_sink
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
        ins = [(i, self.state[n]) for i, n in enumerate(ev.inputs) if n is not None and n in self.state]
        if not ins:
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
        if ev.name in ATTENTION or (ev.name in MATMULS and len(ins) > 1):
            self.regions[r].attention = True
        for n, out in zip(ev.outputs, result):
            if out is None:
                self.state.pop(n, None)
            else:
                self.state[n] = _Shard(r, out[0], out[1])

    # ---- rules: return per-output (dim, raw) or None, or a string saying why the region breaks
    def rule(self, ev: OpCall, ins: list[tuple[int, _Shard]]) -> Union[str, list]:
        shapes = self.trace.shapes
        (pos, sh), name = ins[0], ev.name
        dims = {s.dim for _, s in ins}
        in_shape = shapes[ev.inputs[pos]]  # type: ignore[index]
        if name in UNARY or name in BINARY:
            if len(dims) != 1 or len({shapes[ev.inputs[p]] for p, _ in ins}) != 1:  # type: ignore[index]
                return f"used by '{name}' with differently split operands"
            bad = self._not_neutral(ev, ins, sh.dim, len(in_shape))
            if bad:
                return f"used by '{name}' together with a replicated full-width tensor"
            raws = {s.raw for _, s in ins}
            raw = raws.pop() if len(raws) == 1 else None
            if raw is None and any(not self.need_blocks(s, 1) for _, s in ins):
                return f"used by '{name}' mixing fused layouts"
            return [(sh.dim, raw)] * len(ev.outputs)
        if name in LOSSES:
            if pos == 0 and len(ins) == 1 and len(in_shape) == 2 and sh.dim == 1 and self.need_blocks(sh, 1):
                self.regions[self.find(sh.region)].losses += 1
                return [None] * len(ev.outputs)
            return f"used by '{name}' in a layout other than (N, classes)"
        if len(ins) == 1 and pos == 0 and name in RESHAPES:
            return self._reshape(ev, sh, in_shape, shapes[ev.outputs[0]])
        if len(ins) == 1 and pos == 0 and name in TRANSPOSES:
            return self._transpose(ev, sh, len(in_shape))
        if len(ins) == 1 and pos == 0 and name in SPLITS:
            return self._split(ev, sh, in_shape)
        if name in BATCHED:
            return self._batched(ev, ins, in_shape)
        return f"used by '{name}' (not element-wise)"

    def _not_neutral(self, ev: OpCall, ins: list, dim: int, ndim: int) -> bool:
        split_pos = {p for p, _ in ins}
        for p, n in enumerate(ev.inputs):
            if n is None or p in split_pos:
                continue
            shape = self.trace.shapes[n]
            aligned = dim - (ndim - len(shape))
            if aligned >= 0 and shape[aligned] != 1:
                return True
        return False

    def _reshape(self, ev: OpCall, sh: _Shard, a: tuple, b: tuple) -> Union[str, list]:
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
            if len(literal) == len(b) and literal[new] not in (None, -1):
                self.regions[self.find(sh.region)].literals.add(int(literal[new]))
        return [(new, raw)]

    def _transpose(self, ev: OpCall, sh: _Shard, ndim: int) -> Union[str, list]:
        ints = [v for v in ev.values[1:] if v is not None]
        if ev.name == "permute":
            order = [d % ndim for d in ints]
            return [(order.index(sh.dim), sh.raw if order.index(sh.dim) == sh.dim else None)]
        a, b = ([0, 1] if ev.name == "t" else [d % ndim for d in ints[:2]])
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

    def _batched(self, ev: OpCall, ins: list, shape: tuple) -> Union[str, list]:
        ndim = len(shape)
        dims = {s.dim for _, s in ins}
        if len(dims) != 1 or any(not self.need_blocks(s, 1) for _, s in ins):
            return f"used by '{ev.name}' with differently split operands"
        dim = dims.pop()
        if ev.name in ("softmax", "log_softmax"):
            axis = next((v for v in ev.values[1:] if v is not None), -1) % ndim
            return f"normalised by '{ev.name}' across the split dim" if axis == dim else [(dim, None)]
        if ev.name == "repeat_interleave":
            return [(dim, None)]
        if dim >= ndim - 2:
            return f"used by '{ev.name}' along a matrix dim"
        needed = {0, 1, 2} if ev.name == "scaled_dot_product_attention" else {0, 1}
        if not needed <= {p for p, _ in ins} or self._not_neutral(ev, ins, dim, ndim):
            return f"used by '{ev.name}' with unsplit heads"
        return [(dim, None)] * len(ev.outputs)


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


def analyse(trace: Trace, linears: dict[str, nn.Linear], mp: int, forced: dict[str, str], complex_ok: bool = True) -> Flow:
    """Find the pairs (and vocab-parallel heads) of a traced step; ``complex_ok=False`` keeps only MLP-like pairs.

    Every layer gets at most one role. A layer can be the row end of one region and the source of the next (a
    chain ``L1 -> L2 -> L3 -> L4``); the regions are then taken greedily in call order, each only if none of its
    layers has a role yet: ``(L1 column, L2 row), (L3 column, L4 row)``. Layers left out become self-contained.
    """
    calls = Counter(c.name for c in trace.linear_calls())
    order = {c.name: i for i, c in reversed(list(enumerate(trace.linear_calls())))}

    def can_source(n: str) -> bool:
        return calls[n] == 1 and forced.get(n, "column") in ("column", "vocab") and linears[n].out_features % mp == 0

    def can_sink(n: str) -> bool:
        return calls[n] == 1 and forced.get(n, "row") == "row" and linears[n].in_features % mp == 0

    an = _Analysis(trace, mp, can_source, can_sink)
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
        elif reg.losses and not reg.sinks and len(reg.sources) == 1 or reg.sinks and not reg.losses:
            candidates.append(reg)
    taken: dict[str, str] = {}  # layer -> the first layer of the region that gave it its role
    for reg in sorted(candidates, key=lambda g: min(order[s] for s in g.sources)):
        members = reg.sources | reg.sinks
        first = min(reg.sources, key=order.__getitem__)
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
            flow.simple[s] = reg.simple
            flow.attention[s] = reg.attention
        for s in reg.sinks:
            flow.roles[s], flow.partners[s] = "row", set(reg.sources)
            flow.attention[s] = reg.attention
    return flow
