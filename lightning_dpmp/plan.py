"""Decide how each ``nn.Linear`` is split, from the recorded data flow of one step, and explain the decision.

Styles (the values a user plan may name):

* ``"column"``: split by output features; the output stays sharded and must reach only ``"row"`` layers, through
  element-wise operations (activation, dropout, multiply, add of two shards). Planned automatically for such
  pairs; a ``"column"`` whose output escapes anywhere else is gathered instead.
* ``"row"``: split by input features; the input arrives sharded from ``"column"`` layers (or is split locally
  when it does not); the output is all-reduced.
* ``"column_gather"``: split by output features, output all-gathered: a self-contained layer that is correct
  wherever its output goes. The default for a Linear that pairs with nothing.
* ``"replicate"``: not split. Used when the split dimension is not divisible by ``mp``, for a Linear called more
  than once per step with mixed roles, or one never called through its ``forward`` (e.g. its weight is read
  directly, as ``nn.MultiheadAttention`` does with ``out_proj``).

Example:
    >>> plan = make_plan(model, mp=2, trace=trace_step(model, run))    # doctest: +SKIP
    >>> print(plan.describe(model))                                    # doctest: +SKIP
"""

from __future__ import annotations

import fnmatch
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Optional

from torch import nn

from lightning_dpmp.trace import LinearCall, OpCall, Trace, is_linear

__all__ = ["LayerPlan", "Plan", "STYLES", "make_plan"]

STYLES = ("column", "row", "column_gather", "replicate")

# Calls that act on each element independently, so a tensor sharded on its last dim stays sharded the same way.
_UNARY = {
    "relu", "relu_", "gelu", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "elu", "selu", "celu",
    "leaky_relu", "hardtanh", "relu6", "softplus", "mish", "hardswish", "hardsigmoid", "logsigmoid", "softsign",
    "dropout", "dropout_", "alpha_dropout", "exp", "log", "neg", "__neg__", "__pos__", "abs", "square", "sqrt",
    "rsqrt", "sin", "cos", "erf", "clamp", "clamp_", "clip", "float", "double", "half", "bfloat16", "to",
    "type_as", "contiguous", "clone", "detach", "__get__",
}
_BINARY = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "true_divide", "pow", "maximum", "minimum",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__", "__pow__",
}


@dataclass(frozen=True)
class LayerPlan:
    """How one ``nn.Linear`` is parallelised.

    Attributes:
        name: fully qualified module name.
        style: one of :data:`STYLES`.
        in_features, out_features: the dense sizes.
        input_is_parallel: for ``"row"``: the input arrives sharded (else it is split locally).
        entry: layers with the same non-negative ``entry`` share one input copy (fan-out: one backward all-reduce).
        input_requires_grad: whether the traced input needed a gradient (a data input does not).
        note: why this style, for the printout.
    """

    name: str
    style: str
    in_features: int
    out_features: int
    input_is_parallel: bool = True
    entry: int = -1
    input_requires_grad: bool = True
    note: str = ""

    def local_shape(self, mp: int) -> tuple[int, int]:
        if self.style in ("column", "column_gather"):
            return (self.out_features // mp, self.in_features)
        if self.style == "row":
            return (self.out_features, self.in_features // mp)
        return (self.out_features, self.in_features)


@dataclass
class Plan:
    """The layout of every ``nn.Linear`` of a model, in module order, for an MP width ``mp``."""

    mp: int
    layers: dict[str, LayerPlan] = field(default_factory=dict)
    traced: bool = False
    notes: list[str] = field(default_factory=list)

    def comm_per_step(self) -> dict[str, dict[str, int]]:
        """Analytic MP collectives of one forward + backward (gradient clipping's one all-reduce not included)."""
        if self.mp == 1:
            return {"forward": {"all_reduce": 0, "all_gather": 0}, "backward": {"all_reduce": 0, "all_gather": 0}}
        layers = list(self.layers.values())
        entries = {
            (lp.entry if lp.entry >= 0 else f"own:{lp.name}")
            for lp in layers
            if lp.style in ("column", "column_gather") and lp.input_requires_grad
        }
        return {
            "forward": {
                "all_reduce": sum(lp.style == "row" for lp in layers),
                "all_gather": sum(lp.style == "column_gather" for lp in layers),
            },
            "backward": {
                "all_reduce": len(entries),
                "all_gather": sum(
                    lp.style == "row" and not lp.input_is_parallel and lp.input_requires_grad for lp in layers
                ),
            },
        }

    def param_counts(self, model: nn.Module) -> tuple[int, int]:
        """(parameters held per rank, parameters of the dense model) for ``model`` in its dense form."""
        total = sum(p.numel() for p in model.parameters())
        saved = 0
        for name, mod in model.named_modules():
            lp = self.layers.get(name)
            if lp is None or lp.style == "replicate" or self.mp == 1:
                continue
            saved += mod.weight.numel() - mod.weight.numel() // self.mp
            if mod.bias is not None and lp.style != "row":
                saved += mod.bias.numel() - mod.bias.numel() // self.mp
        return total - saved, total

    def describe(self, model: nn.Module) -> str:
        """A table, one line per Linear (name, style, full shape -> local shape, note), and per-rank totals."""
        rows = [("layer", "style", "full (out, in)", "local (out, in)", "note")]
        for lp in self.layers.values():
            full = f"({lp.out_features}, {lp.in_features})"
            rows.append((lp.name, lp.style, full, str(lp.local_shape(self.mp)), lp.note))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"DPMPStrategy plan for mp={self.mp} ({'traced one step' if self.traced else 'not traced'}):"]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + ("  " + r[4] if r[4] else ""))
        local, total = self.param_counts(model)
        c = self.comm_per_step()
        lines.append(
            f"  parameters per rank: {local:,} of {total:,} ({100.0 * local / max(total, 1):.1f}%);"
            f" MP collectives per step: forward {c['forward']['all_reduce']} all-reduce"
            f" + {c['forward']['all_gather']} all-gather, backward {c['backward']['all_reduce']} all-reduce"
            f" + {c['backward']['all_gather']} all-gather"
        )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _user_styles(model: nn.Module, user_plan: Optional[Mapping[str, str]], mp: int) -> dict[str, str]:
    """Resolve glob patterns to {layer name: style}; the first pattern that matches a name wins."""
    forced: dict[str, str] = {}
    if not user_plan:
        return forced
    modules = dict(model.named_modules())
    for pattern, style in user_plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style; choose one of {', '.join(STYLES)}.")
        matched = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            warnings.warn(f"DPMPStrategy plan pattern {pattern!r} matches no module of {type(model).__name__}.")
        layers = [n for n in matched if is_linear(modules[n])]
        if matched and not layers:
            mod = modules[matched[0]]
            raise ValueError(
                f"plan[{pattern!r}] = {style!r} matches {matched[0]!r}, a {type(mod).__name__}, and no nn.Linear;"
                " only nn.Linear layers can be given a style."
            )
        for name in layers:  # a glob like 'blocks.*' may also match norms and containers: those are skipped
            mod = modules[name]
            forced.setdefault(name, style)
            if style in ("column", "column_gather") and mod.out_features % mp:
                raise ValueError(
                    f"plan forces {name!r} to {style!r}, but its out_features={mod.out_features} is not divisible by"
                    f" mp={mp}. Use 'replicate' for it, or an mp that divides {mod.out_features}."
                )
            if style == "row" and mod.in_features % mp:
                raise ValueError(
                    f"plan forces {name!r} to 'row', but its in_features={mod.in_features} is not divisible by"
                    f" mp={mp}. Use 'replicate' for it, or an mp that divides {mod.in_features}."
                )
    return forced


class _Regions:
    """Union-find over 'sharded regions': tensors derived element-wise from column-layer outputs."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.sources: list[set[str]] = []
        self.sinks: list[set[str]] = []
        self.conflicts: list[list[str]] = []

    def new(self, source: str) -> int:
        self.parent.append(len(self.parent))
        self.sources.append({source})
        self.sinks.append(set())
        self.conflicts.append([])
        return len(self.parent) - 1

    def find(self, r: int) -> int:
        while self.parent[r] != r:
            self.parent[r] = self.parent[self.parent[r]]
            r = self.parent[r]
        return r

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        if a != b:
            lo, hi = min(a, b), max(a, b)
            self.parent[hi] = lo
            self.sources[lo] |= self.sources[hi]
            self.sinks[lo] |= self.sinks[hi]
            self.conflicts[lo] += self.conflicts[hi]
        return self.find(a)

    def roots(self) -> list[int]:
        return sorted({self.find(r) for r in range(len(self.parent))})


def _neutral(shape: tuple[int, ...]) -> bool:
    """A tensor operand that broadcasts along the feature dim without reading it (a scalar or size-1 last dim)."""
    return len(shape) == 0 or shape[-1] == 1


def _find_pairs(
    trace: Trace, linears: dict[str, nn.Linear], mp: int, forced: dict[str, str]
) -> tuple[dict[str, str], dict[str, set[str]], dict[str, str]]:
    """Propagate shardedness from column candidates and keep the regions that end only in row layers."""
    calls = Counter(c.name for c in trace.linear_calls())

    def can_source(n: str) -> bool:
        return calls[n] == 1 and forced.get(n, "column") == "column" and linears[n].out_features % mp == 0

    def can_sink(n: str) -> bool:
        return calls[n] == 1 and forced.get(n, "row") == "row" and linears[n].in_features % mp == 0

    regions = _Regions()
    state: dict[int, int] = {}  # tensor node -> region
    for ev in trace.events:
        if isinstance(ev, LinearCall):
            if ev.input in state:
                r = regions.find(state[ev.input])
                if can_sink(ev.name):
                    regions.sinks[r].add(ev.name)
                else:
                    regions.conflicts[r].append(f"read by {ev.name}, which cannot be a row layer")
            state.pop(ev.output, None)
            if can_source(ev.name):
                state[ev.output] = regions.new(ev.name)
            continue
        assert isinstance(ev, OpCall)
        sharded = [n for n in ev.inputs if n is not None and n in state]
        if not sharded:
            for n in ev.outputs:  # an in-place op may overwrite a sharded tensor with replicated data
                state.pop(n, None)
            continue
        rs = {regions.find(state[n]) for n in sharded}
        shape = trace.shapes[sharded[0]]
        others_ok = all(
            n is None or n in state or _neutral(trace.shapes[n]) for n in ev.inputs
        ) and all(trace.shapes[n] == shape for n in sharded)
        elementwise = ev.name in _UNARY or ev.name in _BINARY
        if elementwise and others_ok:
            r = rs.pop()
            for other in rs:
                r = regions.union(r, other)
            for n in ev.outputs:
                state[n] = r
        else:
            why = f"used by '{ev.name}'" + ("" if elementwise else " (not element-wise)")
            for r in rs:
                regions.conflicts[regions.find(r)].append(why)
            for n in ev.outputs:
                state.pop(n, None)
    for n in trace.escapes:
        if n in state:
            regions.conflicts[regions.find(state[n])].append("returned from the step")

    roles: dict[str, str] = {}
    partners: dict[str, set[str]] = {}
    why: dict[str, str] = {}  # unpaired source -> what its output met
    for r in regions.roots():
        srcs, snks, conflicts = regions.sources[r], regions.sinks[r], regions.conflicts[r]
        if conflicts:
            why.update((s, f"output {conflicts[0]}") for s in srcs)
            continue
        if not snks:
            continue
        if any(roles.get(s) == "row" for s in srcs) or any(roles.get(s) == "column" for s in snks):
            continue  # a chain a -> b -> c: b already closes the pair (a, b)
        for s in srcs:
            roles[s] = "column"
            partners[s] = set(snks)
        for s in snks:
            roles[s] = "row"
            partners[s] = set(srcs)
    return roles, partners, why


def make_plan(
    model: nn.Module, mp: int, trace: Optional[Trace] = None, user_plan: Optional[Mapping[str, str]] = None
) -> Plan:
    """Plan every ``nn.Linear`` of ``model`` for an MP width ``mp``.

    Args:
        model: the dense model (module names are those of ``model.named_modules()``).
        mp: tensor-parallel width.
        trace: the recorded data flow of one step (:func:`lightning_dpmp.trace.trace_step`); without it only the
            user plan can pair layers, and every other divisible Linear becomes ``"column_gather"``.
        user_plan: ``{glob: style}`` overrides, e.g. ``{"blocks.*.fc1": "column", "head": "replicate"}``.

    Example:
        >>> make_plan(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), mp=2).layers["0"].style
        'column_gather'
    """
    linears = {n: m for n, m in model.named_modules() if is_linear(m)}
    forced = _user_styles(model, user_plan, mp)
    owners: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for n, m in linears.items():
        tied = [o for o in owners[id(m.weight)] if o != f"{n}.weight"]
        if tied:  # splitting one side of a tie would untie it; vocab-parallel handling is the embedding's job
            if forced.get(n, "replicate") != "replicate":
                raise ValueError(f"plan forces {n!r} to {forced[n]!r}, but its weight is tied to {tied[0]!r}.")
            forced[n] = "replicate"
    plan = Plan(mp=mp, traced=trace is not None)
    if mp == 1:
        for n, m in linears.items():
            plan.layers[n] = LayerPlan(n, "replicate", m.in_features, m.out_features, note="mp=1")
        return plan

    calls: dict[str, list[LinearCall]] = {}
    if trace is not None:
        for c in trace.linear_calls():
            calls.setdefault(c.name, []).append(c)
        roles, partners, why = _find_pairs(trace, linears, mp, forced)
    else:
        roles = {n: s for n, s in forced.items() if s in ("column", "row")}
        partners, why = {}, {}

    for n, m in linears.items():
        style, note, parallel_in = roles.get(n), "", True
        own = calls.get(n, [])
        if style is not None:
            note = ("-> " if style == "column" else "<- ") + ", ".join(sorted(partners.get(n, ()))) if partners else ""
        elif forced.get(n) in ("column_gather", "replicate"):
            tied = [o for o in owners[id(m.weight)] if o != f"{n}.weight"]
            style, note = forced[n], (f"weight tied to {tied[0]}" if tied else "user plan")
        elif forced.get(n) == "column":
            style, note = "column_gather", "user plan said column; its output is not read only by row layers"
        elif forced.get(n) == "row":
            style, parallel_in, note = "row", False, "user plan said row; input is replicated, split locally"
        elif trace is not None and not own:
            style, note = "replicate", "not called through forward() in the traced step"
        elif m.out_features % mp == 0:
            style = "column_gather"
            note = "called more than once per step" if len(own) > 1 else why.get(n, "")
        else:
            style, note = "replicate", f"out_features={m.out_features} not divisible by mp={mp}"
        requires_grad = all(c.input_requires_grad for c in own) if own else True
        plan.layers[n] = LayerPlan(
            n, style, m.in_features, m.out_features, parallel_in, input_requires_grad=requires_grad, note=note
        )

    # Fan-out: column-style layers that read the same tensor share one entry into the region.
    by_input: dict[int, list[str]] = {}
    for n, lp in plan.layers.items():
        if lp.style in ("column", "column_gather") and len(calls.get(n, [])) == 1:
            by_input.setdefault(calls[n][0].input, []).append(n)
    for entry, names in enumerate(v for v in by_input.values() if len(v) > 1):
        for n in names:
            plan.layers[n] = replace(plan.layers[n], entry=entry)
    return plan
