"""Experts detection, the pass: one walk over the events of one call of a candidate experts module, tracking which
parameter dim each view of an expert weight is, which activations are split or partial sums, and which arguments
enter the split region; it raises ``Conflict`` with the reason when the module cannot be split.

The rules for ops on split activations and partial sums are in :mod:`lightning_dpmp.planner.experts_ops`; what
the pass accepts is described in :mod:`lightning_dpmp.planner.experts_detect`, which turns its result into a split.
"""

from __future__ import annotations

from typing import Optional, Union

from lightning_dpmp.planner.experts_ops import (
    CASTS,
    INDEXING,
    MATMULS,
    PARTIAL,
    RESHAPES,
    SHAPE_ONLY,
    TRANSPOSES,
    ZEROS,
    ActivationRules,
    Conflict,
    Key,
    SplitAt,
    common_suffix,
    reshaped_dim,
)
from lightning_dpmp.planner.trace import LinearCall, ModuleCall, OpCall, Trace

__all__ = ["ExpertsPass"]


class ExpertsPass(ActivationRules):
    """One pass over the events of one call of a candidate module (see the module docstring)."""

    def __init__(self, trace: Trace, call: ModuleCall, own: dict[str, tuple[int, ...]], mp: int) -> None:
        self.trace, self.call, self.mp = trace, call, mp
        self.shapes = trace.shapes
        self.own = own  # candidate parameter -> dense shape
        self.origin: dict[int, tuple[str, tuple[Optional[int], ...]]] = {}  # weight node -> (param, param dim per dim)
        self.state: dict[int, Union[SplitAt, str]] = {}
        self.zero: set[int] = set()
        self.taint: dict[int, frozenset] = {}  # replicated node -> arguments it derives from
        self.ptaint: dict[int, frozenset] = {}  # replicated node -> parameters/layers it derives from
        self.split: dict[str, tuple[int, str]] = {}  # param -> (dim, "column" | "row")
        self.blocks: dict[str, int] = {}
        self.entered: set[Key] = set()
        self.x_args: set[Key] = set()
        for key, node, _ in call.args:
            self.taint[node] = self.taint.get(node, frozenset()) | {key}
        for node, pname in trace.params.items():
            if pname in own:
                self.origin[node] = (pname, tuple(range(len(own[pname]))))
            else:
                self.ptaint[node] = frozenset({pname})

    # ---- helpers
    def need_blocks(self, raw: Optional[str], k: int) -> bool:
        return k == 1 if raw is None else self.blocks.setdefault(raw, k) == k

    def assign(self, pname: str, dim: Optional[int], role: str, op: str) -> None:
        if dim is None:
            raise Conflict(f"its parameter {pname} reaches '{op}' with its split dim merged or indexed away")
        if self.split.setdefault(pname, (dim, role)) != (dim, role):
            raise Conflict(f"its parameter {pname} is used both as {self.split[pname][1]} and as {role}")

    def replicated_use(self, node: int, op: str) -> None:
        """A replicated operand combined with split/partial data: it enters the region (or cannot)."""
        if self.ptaint.get(node):
            src = sorted(self.ptaint[node])[0]
            raise Conflict(
                f"the replicated {src} feeds the split region through '{op}' inside the module (its gradient would"
                " be a partial sum); keep such layers (a router) outside the experts module"
            )
        self.entered |= self.taint.get(node, frozenset())

    # ---- the pass
    def run(self) -> None:
        events = self.trace.events
        own_nodes = set(self.origin)
        for ev in events[:self.call.start]:
            reads = [ev.input] if isinstance(ev, LinearCall) else [n for n in ev.inputs if n is not None]
            if own_nodes.intersection(reads):
                raise Conflict(f"its expert weights are also read before it runs (by '{getattr(ev, 'name', '')}')")
        produced: set[int] = set()
        for ev in events[self.call.start:self.call.end]:
            produced.update([ev.output] if isinstance(ev, LinearCall) else ev.outputs)
            if isinstance(ev, LinearCall):
                if ev.input in self.state or ev.input in self.origin:
                    raise Conflict(f"a split tensor is read by the layer {ev.name}")
                self.ptaint[ev.output] = self.ptaint.get(ev.input, frozenset()) | {ev.name}
                self.taint[ev.output] = self.taint.get(ev.input, frozenset())
                continue
            if isinstance(ev, OpCall):
                self.op(ev)
        outs = self.call.outputs
        if len(outs) != 1 or self.state.get(outs[0]) != PARTIAL:
            what = "split" if outs and isinstance(self.state.get(outs[0]), SplitAt) else "replicated or not one tensor"
            raise Conflict(f"its output is {what}, not a sum of per-expert partial products")
        live = (set(self.state) | set(self.origin)) - set(outs)
        # replicated values computed inside from an entered argument: their gradient must not leave the module
        live |= {
            n for n in produced - set(outs) if self.taint.get(n, frozenset()) & self.entered and n not in self.zero
        }
        for ev in events[self.call.end:]:
            if isinstance(ev, OpCall) and ev.name in SHAPE_ONLY:
                continue
            reads = [ev.input] if isinstance(ev, LinearCall) else [n for n in ev.inputs if n is not None]
            if live.intersection(reads):
                raise Conflict(f"a split tensor is read after the module returns (by '{getattr(ev, 'name', '')}')")
        if live & self.trace.escapes:
            raise Conflict("a split tensor is returned from the step")
        roles = {r for _, r in self.split.values()}
        if roles != {"column", "row"}:
            raise Conflict("its expert weights do not form column -> row pairs")

    def op(self, ev: OpCall) -> None:
        if ev.name in SHAPE_ONLY:  # reading a shape, or a lookup recorded for the planner: no data read here
            return
        nodes = [n for n in ev.inputs if n is not None]
        if ev.name in MATMULS and any(n in self.origin for n in nodes[:2]):
            return self.matmul(ev)
        if any(n in self.origin for n in nodes):
            return self.weight_layout(ev)
        if any(n in self.state for n in nodes):
            reads_split = any(isinstance(self.state.get(n), SplitAt) for n in nodes)
            result = self.split_op(ev) if reads_split else self.partial_op(ev)
            for n, st in zip(ev.outputs, result):
                self.state[n] = st
                self.zero.discard(n)
            return
        # replicated: carry where it comes from; zero buffers are data-independent
        for n in ev.outputs:
            self.state.pop(n, None)
            if ev.name in ZEROS:
                self.zero.add(n)
                self.taint.pop(n, None)
                self.ptaint.pop(n, None)
                continue
            self.zero.discard(n)
            data = nodes[:1] if ev.name in INDEXING else nodes  # an index carries no gradient
            self.taint[n] = frozenset().union(*(self.taint.get(i, frozenset()) for i in data))
            self.ptaint[n] = frozenset().union(*(self.ptaint.get(i, frozenset()) for i in data))

    def weight_layout(self, ev: OpCall) -> None:
        """Indexing / transposing / casting an expert weight: follow which parameter dim each dim is."""
        src = next(n for n in ev.inputs if n is not None and n in self.origin)
        if ev.inputs[0] != src or len(ev.outputs) != 1:
            raise Conflict(f"its parameter {self.origin[src][0]} is read by '{ev.name}'")
        pname, dims = self.origin[src]
        a, b = self.shapes[src], self.shapes[ev.outputs[0]]
        if ev.name in CASTS and a == b and (ev.name != "__get__" or len(a) < 2 or a[-1] != a[-2]):
            new = dims
        elif ev.name == "__getitem__":
            k = common_suffix(a, b)
            new = tuple([None] * (len(b) - k)) + dims[len(a) - k:]
        elif ev.name in TRANSPOSES:
            order = self._permutation(ev, len(a))
            new = tuple(dims[i] for i in order)
        elif ev.name in RESHAPES:
            mapped: list[Optional[int]] = [None] * len(b)
            for i, pd in enumerate(dims):
                j = reshaped_dim(a, b, i)
                if j is not None and pd is not None:
                    mapped[j] = pd
            new = tuple(mapped)
        else:
            raise Conflict(f"its parameter {pname} is read by '{ev.name}'")
        self.origin[ev.outputs[0]] = (pname, new)

    def _permutation(self, ev: OpCall, ndim: int) -> list[int]:
        ints = [v for v in ev.values[1:] if v is not None]
        order = list(range(ndim))
        if ev.name == "permute":
            return [d % ndim for d in ints]
        if ev.name in ("t", "T", "mT"):
            i, j = (0, 1) if ev.name == "t" or ndim < 2 else (ndim - 2, ndim - 1)
            i, j = (0, ndim - 1) if ev.name == "T" and ndim > 2 else (i, j)  # Tensor.T reverses; 2-D is a swap
        else:
            i, j = ints[0] % ndim, ints[1] % ndim
        order[i], order[j] = order[j], order[i]
        return order

    def matmul(self, ev: OpCall) -> None:
        a, b = ev.inputs[0], ev.inputs[1]
        if ev.name == "__rmatmul__":
            a, b = b, a
        if a is None or b is None or (a in self.origin) == (b in self.origin):
            raise Conflict(f"'{ev.name}' multiplies two expert weights, or a weight by a non-tensor")
        for extra in ev.inputs[2:]:
            if extra is not None:
                if extra in self.origin or extra in self.state:
                    raise Conflict(f"'{ev.name}' adds an expert bias (not supported: no bias on expert weights)")
                self.replicated_use(extra, ev.name)
        w_first = a in self.origin and ev.name != "linear"
        w, x = (a, b) if a in self.origin else (b, a)
        if ev.name == "linear" and w != b:
            raise Conflict("'linear' takes an expert weight as its input")
        pname, dims = self.origin[w]
        wn, xn, on = len(self.shapes[w]), len(self.shapes[x]), len(self.shapes[ev.outputs[0]])
        if min(wn, xn) < 2 and ev.name != "linear":
            raise Conflict(f"'{ev.name}' on a 1-D operand")
        if ev.name == "linear":
            w_out, w_k, x_k, o_dim = wn - 2, wn - 1, xn - 1, on - 1
        elif w_first:
            w_out, w_k, x_k, o_dim = wn - 2, wn - 1, xn - 2, on - 2
        else:
            w_out, w_k, x_k, o_dim = wn - 1, wn - 2, xn - 1, on - 1
        st = self.state.get(x)
        if st is None:
            self.replicated_use(x, ev.name)
            self.x_args |= self.taint.get(x, frozenset())
            self.assign(pname, dims[w_out], "column", ev.name)
            self.state[ev.outputs[0]] = SplitAt(o_dim, pname)
        elif isinstance(st, SplitAt) and st.dim == x_k and self.need_blocks(st.raw, 1):
            self.assign(pname, dims[w_k], "row", ev.name)
            self.state[ev.outputs[0]] = PARTIAL
        else:
            raise Conflict(f"'{ev.name}' reads an expert weight with an activation split along the wrong dim")
        self.zero.discard(ev.outputs[0])
