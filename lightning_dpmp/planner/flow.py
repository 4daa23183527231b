"""Shardedness propagation over a recorded step: where a column layer's output may stay split.

Every candidate column layer starts a *region*: its output is split on the last dim. A layer whose width ``mp``
does not divide may only end as a vocab-parallel head (its vocabulary padded to a multiple of ``mp``).
Each recorded call either keeps a region's tensors split (element-wise ops; head reshapes ``(B, T, C) -> (B, T,
H, d)`` that split whole heads; transposes; attention over split heads; chunks of fused projections), reads them
as a row layer (the region's exit), reads them as a vocab-parallel cross-entropy (an LM head's exit), or breaks
the region (anything else: a norm, a full-width reshape, ``argmax``, being returned). Broken regions fall back to
self-contained layers; the planner (:mod:`lightning_dpmp.planner.plan`) picks among the rest.

What lives here: the analysis driver (regions and their union, the pass over the recorded events, the dispatch),
the op table ``OPS`` (op name -> rule) and :func:`analyse`, which turns regions into roles. The rules themselves
are in :mod:`lightning_dpmp.planner.flow_values` (element-wise, reductions, losses, attention-like ops) and
:mod:`lightning_dpmp.planner.flow_dims` (reshapes, transposes, indexing, concatenation, splits).

Example:
    >>> import torch
    >>> from lightning_dpmp.planner.trace import trace_step
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    >>> trace = trace_step(model, lambda: model(torch.randn(2, 4)).sum())
    >>> flow = analyse(trace, {"0": model[0], "2": model[2]}, mp=2, forced={})
    >>> flow.roles                   # a GPT: {'blocks.0.attn.q_proj': 'column', ..., 'lm_head': 'vocab'}
    {'0': 'column', '2': 'row'}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from torch import nn

from lightning_dpmp.parallel.sharding import Blocks
from lightning_dpmp.planner.flow_dims import DimRules
from lightning_dpmp.planner.flow_state import Region, Shard
from lightning_dpmp.planner.flow_values import ValueRules
from lightning_dpmp.planner.linear_like import LinearForm
from lightning_dpmp.planner.ops import (
    ATTENTION,
    BATCHED,
    BINARY,
    CONCATS,
    EXPANDS,
    FACTORIES,
    FIRST_ONLY,
    LOSSES,
    MATMULS,
    REDUCTIONS,
    RESHAPES,
    SPLITS,
    TRANSPOSES,
    UNARY,
)
from lightning_dpmp.planner.trace import LinearCall, OpCall, Trace

__all__ = ["Flow", "analyse"]


@dataclass
class Flow:
    """What the analysis found: roles per layer, partners, why layers stay unpaired, fused blocks and literals."""

    roles: dict[str, str] = field(default_factory=dict)  # "column" | "row" | "vocab"
    partners: dict[str, set[str]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    blocks: dict[str, Blocks] = field(default_factory=dict)
    # per paired source: fixed sizes to adjust, each with the module whose code passed it (OpCall.scope) and its
    # position among the sizes passed (view(B, T, n, d): 2)
    literals: dict[str, set[tuple[int, str, int]]] = field(default_factory=dict)
    scoped: dict[str, set[tuple[str, int, bool]]] = field(default_factory=dict)  # per source: (module, size, derived?)
    queried: dict[str, set[int]] = field(default_factory=dict)  # per source: split-dim sizes the code read (x.shape)
    simple: dict[str, bool] = field(default_factory=dict)
    attention: dict[str, bool] = field(default_factory=dict)  # per paired layer: its region involves attention
    # whole parameters read only by ops on split tensors -> the first layers of the regions reading them: their
    # gradients are partial sums over MP where every one of those regions stays split
    partial: dict[str, set[str]] = field(default_factory=dict)


class _Analysis(ValueRules, DimRules):
    """One pass over a trace: which tensors are split, on which dim, in which region (rules: the mixins)."""

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
        self.regions: list[Region] = []
        self.state: dict[int, Shard] = {}
        self.blocks: dict[str, Blocks] = {}
        self.whole_reads: set[str] = set()  # parameters some op reads with no split tensor (full gradients)

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
            a.params |= b.params
            a.padded |= b.padded
        return keep

    def new_region(self, source: str) -> int:
        self.parent.append(len(self.parent))
        self.regions.append(Region({source}))
        return len(self.parent) - 1

    def need_blocks(self, sh: Shard, k: Blocks) -> bool:
        """Whether the raw output of ``sh``'s source can be read as ``k`` fused blocks (an int: equal ones; a
        tuple: their sizes), recording it; every reader of that output must see the same blocks."""
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
            self.state[ev.output] = Shard(self.new_region(ev.name), len(self.trace.shapes[ev.output]) - 1, ev.name)
            self.regions[-1].padded = self.trace.shapes[ev.output][-1] % self.mp != 0

    def op(self, ev: OpCall) -> None:
        if ev.name == "size":  # a shape query: remember split-dim sizes the code reads (see Region.derived)
            sh = self.state.get(ev.inputs[0])  # type: ignore[arg-type]
            if sh is not None:
                self.regions[self.find(sh.region)].queried.add(self.trace.shapes[ev.inputs[0]][sh.dim])  # type: ignore[index]
            return
        if ev.name == "embedding":  # a table whose rows reach split tensors can be split by columns (heads)
            name, out = ev.index[0][1], ev.outputs[0]
            self.state.pop(out, None)
            if self.can_source_embedding(name):
                self.state[out] = Shard(self.new_region(name), len(self.trace.shapes[out]) - 1, None)
            return
        if ev.name in FACTORIES:
            (out,), shape = ev.outputs, self.trace.shapes[ev.outputs[0]]
            sizes = [v for v in ev.values if v is not None][: len(shape)]
            scope = ev.index[0][1] if ev.index else ""
            complete = len(sizes) == len(shape)
            self.uniform[out] = {d: ((scope, sizes[d]) if complete else None) for d in range(len(shape))}
            return
        ins = [(i, self.state[n]) for i, n in enumerate(ev.inputs) if n is not None and n in self.state]
        if not ins:
            self.whole_reads |= {self.trace.params[n] for n in ev.inputs if n in self.trace.params}
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
        # A whole parameter meeting split tensors (a q/k norm's weight over head_dim, shared by all heads) gets from
        # each rank the gradient of its own heads only: a partial sum, summed over MP once per step if paired.
        self.regions[r].params |= {self.trace.params[n] for n in ev.inputs if n in self.trace.params}
        if ev.name not in UNARY and ev.name not in BINARY:
            self.regions[r].simple = False
        if ev.name in ATTENTION or (ev.name in MATMULS | {"einsum"} and len(ins) > 1):
            self.regions[r].attention = True
        for n, out in zip(ev.outputs, result):
            if out is None:
                self.state.pop(n, None)
            else:
                self.state[n] = Shard(r, out[0], out[1])

    # ---- rules: return per-output (dim, raw) or None, or a string saying why the region breaks
    def rule(self, ev: OpCall, ins: list[tuple[int, Shard]]) -> Union[str, list]:
        """Dispatch on :data:`OPS`: each handler says where the split dim of each output is, from what the op
        does to dims (never from module or parameter names)."""
        handler = OPS.get(ev.name)
        if handler is None:
            return f"used by '{ev.name}' (no rule for this op)"
        return handler(self, ev, ins)

    def _shape(self, node: Optional[int]) -> tuple:
        return self.trace.shapes[node]  # type: ignore[index]


def _on_first(method: Callable) -> Callable:
    """A layout op of one tensor (reshape, transpose, index...): only its first argument may be split."""

    def run(an: _Analysis, ev: OpCall, ins: list[tuple[int, Shard]]) -> Union[str, list]:
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
    linears: Mapping[str, LinearForm],
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

    def can_source(n: str) -> bool:  # (an indivisible width can only end as a vocab-parallel head: padded)
        return calls[n] == 1 and forced.get(n, "column") in ("column", "vocab")

    def can_sink(n: str) -> bool:
        return calls[n] == 1 and forced.get(n, "row") == "row" and linears[n].in_features % mp == 0

    an = _Analysis(trace, mp, can_source, can_sink, can_source_embedding)
    an.run()
    flow = Flow()
    candidates: list[Region] = []
    for root in sorted({an.find(r) for r in range(len(an.parent))}):
        reg = an.regions[root]
        if reg.conflicts:
            flow.why.update((s, f"output {reg.conflicts[0]}") for s in reg.sources)
        elif not complex_ok and not reg.simple and reg.sinks:  # a pair; a vocab-parallel head pairs with nothing
            kind = "attention-like region" if reg.attention else "paired region (reshapes/transposes)"
            flow.why.update((s, f"{kind} disabled after a failed verification") for s in reg.sources)
        elif not reg.sources - set(tables):
            continue  # a region fed only by embedding tables has nothing of its own to split
        elif reg.padded and (reg.sinks or not reg.losses):
            flow.why.update((s, f"out_features={linears[s].out_features} not divisible by mp={mp}")
                            for s in reg.sources if s in linears and linears[s].out_features % mp)
        elif reg.losses and not reg.sinks and len(reg.sources) == 1 or reg.sinks and not reg.losses:
            candidates.append(reg)
    taken: dict[str, str] = {}  # layer -> the first layer of the region that gave it its role
    split_regions: set[int] = set()  # id() of the regions that got roles

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
        split_regions.add(id(reg))
        for name in reg.params:
            flow.partial.setdefault(name, set()).add(first)
        if not reg.sinks:
            flow.roles[first] = "vocab"
            continue
        for s in reg.sources:
            flow.roles[s], flow.partners[s] = "column", set(reg.sinks)
            flow.blocks[s] = an.blocks.get(s, 1)
            flow.literals[s] = set(reg.literals)
            flow.scoped[s] = set(reg.scoped)
            flow.queried[s] = set(reg.queried)
            flow.simple[s] = reg.simple
            flow.attention[s] = reg.attention
        for s in reg.sinks:
            flow.roles[s], flow.partners[s] = "row", set(reg.sources)
            flow.attention[s] = reg.attention
    # a parameter also read on whole tensors, or inside a region that is not split, gets full gradients there
    unsplit = set(an.whole_reads)
    for root in {an.find(r) for r in range(len(an.parent))}:
        if id(an.regions[root]) not in split_regions:
            unsplit |= an.regions[root].params
    flow.partial = {n: firsts for n, firsts in flow.partial.items() if n not in unsplit}
    return flow
