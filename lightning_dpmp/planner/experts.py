"""Expert tensor parallelism: find mixture-of-experts modules by what they compute in the traced step.

A module qualifies when it owns parameters of 3 or more dims (experts stacked along one dim) that it uses, after
indexing per expert (``W[e]``, ``W[expert_ids]``) or whole (grouped matmuls), as the weight of matmul-like calls
(``linear``, ``matmul``, ``bmm``, ``grouped_mm``) forming column -> row pairs:

* a weight multiplying a *replicated* activation is split along its output dim (``column``): the result is split
  along its last dim. Fused ``gate|up`` weights chunked afterwards are split block by block (each rank holds the
  same intermediate slice of gate and of up);
* element-wise ops, chunks into fused blocks, reshapes and indexing that keep that dim intact keep it split;
* a weight multiplying an activation split along the contraction dim is split along its input dim (``row``): the
  result is a *partial sum* (each rank holds its share of the true value);
* partial sums stay partial through linear ops only: scaling by replicated tensors (routing weights), adding
  partials, ``index_add_``/``scatter_add_`` into a zero buffer (``zeros_like``), reshapes and sums;
* the module's output must be a partial sum, and nothing split or partial may be read after it returns.

Then the module is run with its expert parameters replaced by shards (:mod:`lightning_dpmp.parallel.experts`): its
replicated inputs that reach the split region enter it once (one fused all-reduce of their gradients backward, the
routing weights included, whose gradient is a partial sum too) and its output is all-reduced once forward:
1 all-reduce each way per MoE block, however many experts. A replicated parameter feeding the split region (a
router computed inside the same module) would get a partial gradient: such a module is left whole, with the reason.

A ``Linear`` whose output only routes tokens (it reaches the experts call through its routing arguments, not as the
activation) stays replicated, as in Megatron: splitting a (hidden, experts) router saves little and costs an
all-gather.

Example:
    >>> plan_experts(plan, model, trace, mp=2, forced={})     # fills plan.layers / plan.experts   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from torch import nn

from lightning_dpmp.planner import ops
from lightning_dpmp.planner.layout import LayerPlan
from lightning_dpmp.planner.trace import LinearCall, ModuleCall, OpCall, Trace

__all__ = ["ExpertsLayout", "analyse_experts", "plan_experts"]

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
class ExpertsLayout:
    """How one experts module is split.

    Attributes:
        name: the module owning the stacked expert parameters.
        shards: ``{parameter: (dim, blocks)}``: each is split along ``dim``, block by block when ``blocks > 1``.
        entries: the arguments (position or keyword) entering the split region: their gradients are summed over MP
            in one all-reduce backward.
        needs_grad: whether any entered argument required a gradient in the traced step (the backward all-reduce).
        hidden, intermediate: the activation width and the (dense) intermediate width of one expert.
        activations: the entered arguments that are the experts' activation input (the rest route or scale).
        routers: ``nn.Linear`` layers whose output only routes tokens to these experts (kept replicated).
    """

    name: str
    shards: dict[str, tuple[int, int]]
    entries: tuple[Key, ...]
    needs_grad: bool
    hidden: int
    intermediate: int
    activations: tuple[Key, ...] = ()
    routers: tuple[str, ...] = ()

    def saved(self, module: nn.Module, mp: int) -> int:
        """Parameters this layout takes off each rank (dense minus local numel)."""
        return sum(getattr(module, p).numel() * (mp - 1) // mp for p in self.shards)


@dataclass(frozen=True)
class _S:
    """Split along ``dim``; ``raw``: the parameter whose fused blocks this output still holds (not chunked yet)."""

    dim: int
    raw: Optional[str]


_P = "partial"


class _Conflict(Exception):
    """The module cannot be split this way; the message says why."""


def _suffix(a: tuple, b: tuple) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[len(a) - 1 - k] == b[len(b) - 1 - k]:
        k += 1
    return k


def _prod(xs: tuple) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _reshaped_dim(a: tuple, b: tuple, d: int) -> Optional[int]:
    """Where dim ``d`` of shape ``a`` lands in shape ``b`` under a reshape that keeps it whole, else ``None``."""
    before = _prod(a[:d])
    for j, size in enumerate(b):
        if size == a[d] and _prod(b[:j]) == before:
            return j
    return None


class _Experts:
    """One pass over the events of one call of a candidate module (see the module docstring)."""

    def __init__(self, trace: Trace, call: ModuleCall, own: dict[str, tuple[int, ...]], mp: int) -> None:
        self.trace, self.call, self.mp = trace, call, mp
        self.shapes = trace.shapes
        self.own = own  # candidate parameter -> dense shape
        self.origin: dict[int, tuple[str, tuple[Optional[int], ...]]] = {}  # weight node -> (param, param dim per dim)
        self.state: dict[int, Union[_S, str]] = {}
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
            raise _Conflict(f"its parameter {pname} reaches '{op}' with its split dim merged or indexed away")
        if self.split.setdefault(pname, (dim, role)) != (dim, role):
            raise _Conflict(f"its parameter {pname} is used both as {self.split[pname][1]} and as {role}")

    def replicated_use(self, node: int, op: str) -> None:
        """A replicated operand combined with split/partial data: it enters the region (or cannot)."""
        if self.ptaint.get(node):
            src = sorted(self.ptaint[node])[0]
            raise _Conflict(
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
                raise _Conflict(f"its expert weights are also read before it runs (by '{getattr(ev, 'name', '')}')")
        produced: set[int] = set()
        for ev in events[self.call.start:self.call.end]:
            produced.update([ev.output] if isinstance(ev, LinearCall) else ev.outputs)
            if isinstance(ev, LinearCall):
                if ev.input in self.state or ev.input in self.origin:
                    raise _Conflict(f"a split tensor is read by the layer {ev.name}")
                self.ptaint[ev.output] = self.ptaint.get(ev.input, frozenset()) | {ev.name}
                self.taint[ev.output] = self.taint.get(ev.input, frozenset())
                continue
            if isinstance(ev, OpCall):
                self.op(ev)
        outs = self.call.outputs
        if len(outs) != 1 or self.state.get(outs[0]) != _P:
            what = "split" if outs and isinstance(self.state.get(outs[0]), _S) else "replicated or not one tensor"
            raise _Conflict(f"its output is {what}, not a sum of per-expert partial products")
        live = (set(self.state) | set(self.origin)) - set(outs)
        # replicated values computed inside from an entered argument: their gradient must not leave the module
        live |= {n for n in produced - set(outs) if self.taint.get(n, frozenset()) & self.entered and n not in self.zero}
        for ev in events[self.call.end:]:
            if isinstance(ev, OpCall) and ev.name in SHAPE_ONLY:
                continue
            reads = [ev.input] if isinstance(ev, LinearCall) else [n for n in ev.inputs if n is not None]
            if live.intersection(reads):
                raise _Conflict(f"a split tensor is read after the module returns (by '{getattr(ev, 'name', '')}')")
        if live & self.trace.escapes:
            raise _Conflict("a split tensor is returned from the step")
        roles = {r for _, r in self.split.values()}
        if roles != {"column", "row"}:
            raise _Conflict("its expert weights do not form column -> row pairs")

    def op(self, ev: OpCall) -> None:
        if ev.name in SHAPE_ONLY:  # reading a shape, or a lookup recorded for the planner: no data read here
            return
        nodes = [n for n in ev.inputs if n is not None]
        if ev.name in MATMULS and any(n in self.origin for n in nodes[:2]):
            return self.matmul(ev)
        if any(n in self.origin for n in nodes):
            return self.weight_layout(ev)
        if any(n in self.state for n in nodes):
            result = self.split_op(ev) if any(isinstance(self.state.get(n), _S) for n in nodes) else self.partial_op(ev)
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
            raise _Conflict(f"its parameter {self.origin[src][0]} is read by '{ev.name}'")
        pname, dims = self.origin[src]
        a, b = self.shapes[src], self.shapes[ev.outputs[0]]
        if ev.name in CASTS and a == b and (ev.name != "__get__" or len(a) < 2 or a[-1] != a[-2]):
            new = dims
        elif ev.name == "__getitem__":
            k = _suffix(a, b)
            new = tuple([None] * (len(b) - k)) + dims[len(a) - k:]
        elif ev.name in TRANSPOSES:
            order = self._permutation(ev, len(a))
            new = tuple(dims[i] for i in order)
        elif ev.name in RESHAPES:
            mapped: list[Optional[int]] = [None] * len(b)
            for i, pd in enumerate(dims):
                j = _reshaped_dim(a, b, i)
                if j is not None and pd is not None:
                    mapped[j] = pd
            new = tuple(mapped)
        else:
            raise _Conflict(f"its parameter {pname} is read by '{ev.name}'")
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
            raise _Conflict(f"'{ev.name}' multiplies two expert weights, or a weight by a non-tensor")
        for extra in ev.inputs[2:]:
            if extra is not None:
                if extra in self.origin or extra in self.state:
                    raise _Conflict(f"'{ev.name}' adds an expert bias (not supported: no bias on expert weights)")
                self.replicated_use(extra, ev.name)
        w_first = a in self.origin and ev.name != "linear"
        w, x = (a, b) if a in self.origin else (b, a)
        if ev.name == "linear" and w != b:
            raise _Conflict("'linear' takes an expert weight as its input")
        pname, dims = self.origin[w]
        wn, xn, on = len(self.shapes[w]), len(self.shapes[x]), len(self.shapes[ev.outputs[0]])
        if min(wn, xn) < 2 and ev.name != "linear":
            raise _Conflict(f"'{ev.name}' on a 1-D operand")
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
            self.state[ev.outputs[0]] = _S(o_dim, pname)
        elif isinstance(st, _S) and st.dim == x_k and self.need_blocks(st.raw, 1):
            self.assign(pname, dims[w_k], "row", ev.name)
            self.state[ev.outputs[0]] = _P
        else:
            raise _Conflict(f"'{ev.name}' reads an expert weight with an activation split along the wrong dim")
        self.zero.discard(ev.outputs[0])

    def split_op(self, ev: OpCall) -> list:
        """Rules for ops reading a tensor split along the intermediate dim."""
        ins = [(p, n) for p, n in enumerate(ev.inputs) if n is not None]
        split = [(p, n, self.state[n]) for p, n in ins if isinstance(self.state.get(n), _S)]
        if any(self.state.get(n) == _P for _, n in ins):
            raise _Conflict(f"'{ev.name}' mixes split and partial tensors")
        p0, n0, s0 = split[0]
        a = self.shapes[n0]
        if ev.name in ELEMENTWISE or ev.name in CASTS:
            if ev.name == "__get__" and self.shapes[ev.outputs[0]] != a:
                raise _Conflict("a split tensor is read through an attribute that changes its shape")
            for p, n in ins[1:]:
                self.replicated_use(n, ev.name)
            return [s0] * len(ev.outputs)
        if ev.name in BINARY:
            if len({s.dim for _, _, s in split}) != 1 or len({self.shapes[n] for _, n, _ in split}) != 1:
                raise _Conflict(f"'{ev.name}' combines differently split tensors")
            for p, n in ins:
                if isinstance(self.state.get(n), _S):
                    continue
                shape = self.shapes[n]
                aligned = s0.dim - (len(a) - len(shape))
                if aligned >= 0 and shape[aligned] != 1:
                    raise _Conflict(f"'{ev.name}' combines a split tensor with a replicated full-width one")
                self.replicated_use(n, ev.name)
            raws = {s.raw for _, _, s in split}
            raw = raws.pop() if len(raws) == 1 else None
            if raw is None and not all(self.need_blocks(s.raw, 1) for _, _, s in split):
                raise _Conflict(f"'{ev.name}' mixes fused layouts")
            return [_S(s0.dim, raw)] * len(ev.outputs)
        if len(split) != 1 or p0 != 0:
            raise _Conflict(f"a split tensor is read by '{ev.name}'")
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
                        return [_S(s0.dim - (dim < s0.dim), s0.raw)] * len(outs)
                raise _Conflict(f"'{ev.name}' splits a split tensor in a way that cannot be followed")
            if s0.raw is None or len({o[s0.dim] for o in outs}) != 1 or not self.need_blocks(s0.raw, len(outs)):
                raise _Conflict(f"'{ev.name}' cuts the split dim into unequal or unfused parts")
            return [_S(s0.dim, None)] * len(outs)
        if len(ev.outputs) != 1:
            raise _Conflict(f"a split tensor is read by '{ev.name}'")
        b = outs[0]
        if ev.name == "__getitem__":
            k = _suffix(a, b)
            if len(a) - s0.dim > k:
                raise _Conflict("indexing touches the split dim")
            return [_S(len(b) - (len(a) - s0.dim), s0.raw)]
        if ev.name in TRANSPOSES:
            order = self._permutation(ev, len(a))
            return [_S(order.index(s0.dim), s0.raw)]
        if ev.name in RESHAPES:
            j = _reshaped_dim(a, b, s0.dim)
            if j is None:
                raise _Conflict(f"'{ev.name}' reshapes across the split dim")
            return [_S(j, s0.raw)]
        raise _Conflict(f"a split tensor is read by '{ev.name}' (not element-wise)")

    def partial_op(self, ev: OpCall) -> list:
        """Rules for ops reading partial sums: only linear ones keep them partial."""
        ins = [(p, n) for p, n in enumerate(ev.inputs) if n is not None]
        partial = [(p, n) for p, n in ins if self.state.get(n) == _P]
        others = [(p, n) for p, n in ins if self.state.get(n) != _P]
        name = ev.name
        if name in CASTS or name in LAYOUT_ANY or name in REDUCTIONS:
            if partial[0][0] != 0 or len(partial) != 1:
                raise _Conflict(f"'{name}' reads a partial sum in an unsupported position")
            for _, n in others:
                if name not in INDEXING:
                    self.replicated_use(n, name)
            return [_P] * len(ev.outputs)
        if name in MULS or name in DIVS:
            if len(partial) != 1 or (name in DIVS and partial[0][0] != 0):
                raise _Conflict(f"'{name}' of a partial sum by another partial sum, or divides by one")
            for _, n in others:
                self.replicated_use(n, name)
            return [_P]
        if name in ADDS or name in ("cat", "stack"):
            if any(n not in self.zero for _, n in others) or (name in ADDS and None in ev.inputs[:2]):
                raise _Conflict(f"'{name}' adds a replicated tensor to a partial sum (it would count {self.mp} times)")
            return [_P] * len(ev.outputs)
        if name in ACCUMULATES:
            target = ev.inputs[0]
            if target is None or (self.state.get(target) != _P and target not in self.zero):
                raise _Conflict(f"'{name}' accumulates partial sums into a tensor not known to be zero")
            for p, n in others:  # (self, dim, index, source): only the index may be replicated
                if n != target and p != 2:
                    raise _Conflict(f"'{name}' accumulates a replicated tensor (it would count {self.mp} times)")
            return [_P] * len(ev.outputs)
        raise _Conflict(f"a partial sum is read by '{name}' (not linear)")


def analyse_experts(
    model: nn.Module, trace: Trace, mp: int
) -> tuple[dict[str, ExpertsLayout], dict[str, str]]:
    """Experts modules of ``model`` found in ``trace``: their layouts, and why each other candidate stays whole.

    A candidate owns a parameter of 3+ dims that reaches a matmul-like call; modules whose stacked parameters never
    do (convolutions) are not experts and are not reported.
    """
    layouts: dict[str, ExpertsLayout] = {}
    why: dict[str, str] = {}
    calls: dict[str, list[ModuleCall]] = {}
    for c in trace.calls:
        calls.setdefault(c.name, []).append(c)
    for name, mod in model.named_modules():
        own = {f"{name}.{p}" if name else p: tuple(t.shape) for p, t in mod.named_parameters(recurse=False) if t.dim() >= 3}
        if not own or not _reaches_matmul(trace, set(own)):
            continue
        found = calls.get(name, [])
        if not name:
            why[name] = "the model itself holds the expert weights: they must sit in a submodule it calls"
            continue
        if len(found) != 1:
            why[name] = f"called {len(found)} times in the traced step (experts are split when called once)"
            continue
        an = _Experts(trace, found[0], own, mp)
        try:
            an.run()
            layouts[name] = _layout(name, an, found[0], own, mp)
        except _Conflict as exc:
            why[name] = str(exc)
    return layouts, why


def _reaches_matmul(trace: Trace, params: set[str]) -> bool:
    nodes = {n for n, p in trace.params.items() if p in params}
    for ev in trace.events:
        if isinstance(ev, OpCall) and nodes.intersection(n for n in ev.inputs if n is not None):
            if ev.name in MATMULS:
                return True
            nodes.update(ev.outputs)
    return False


def _layout(name: str, an: _Experts, call: ModuleCall, own: dict[str, tuple[int, ...]], mp: int) -> ExpertsLayout:
    shards: dict[str, tuple[int, int]] = {}
    hidden = intermediate = 0
    for pname, (dim, role) in sorted(an.split.items()):
        blocks = an.blocks.get(pname, 1)
        size = own[pname][dim]
        if size % (blocks * mp):
            fused = f" in {blocks} fused blocks" if blocks > 1 else ""
            raise _Conflict(f"{pname} has {size} along dim {dim}{fused}, not divisible by mp={mp}")
        shards[pname.rpartition(".")[2] if "." in pname else pname] = (dim, blocks)
        if role == "row":
            intermediate = size
            hidden = _prod(own[pname]) // (size * own[pname][0])
    grads = {key: rg for key, _, rg in call.args}
    entries = tuple(k for k, _, _ in call.args if k in an.entered)
    activations = tuple(k for k in entries if k in an.x_args)
    return ExpertsLayout(name, shards, entries, any(grads[k] for k in entries), hidden, intermediate, activations)


def _routers(trace: Trace, call: ModuleCall, x_keys: set[Key]) -> set[str]:
    """Linear layers whose output reaches the experts call only through its routing (non-activation) arguments."""
    routing = _ancestors(trace, call.start, {node for key, node, _ in call.args if key not in x_keys})
    activation = _ancestors(trace, call.start, {node for key, node, _ in call.args if key in x_keys})
    return {ev.name for ev in trace.events[:call.start]
            if isinstance(ev, LinearCall) and ev.output in routing and ev.output not in activation}


def _ancestors(trace: Trace, end: int, nodes: set[int]) -> set[int]:
    """Every node that ``nodes`` derive from through the events before ``end`` (one backward pass)."""
    seen = set(nodes)
    for ev in reversed(trace.events[:end]):
        outs = [ev.output] if isinstance(ev, LinearCall) else ev.outputs
        if seen.intersection(outs):
            seen.update([ev.input] if isinstance(ev, LinearCall) else (n for n in ev.inputs if n is not None))
    return seen


def plan_experts(plan: Any, model: nn.Module, trace: Optional[Trace], mp: int, forced: dict[str, str]) -> None:
    """Add experts layouts to ``plan`` (``plan.experts``, ``plan.layers`` entries of kind ``"experts"``), keep their
    routers replicated, and record why any other experts-like module stays whole."""

    if trace is None or mp == 1:
        return
    layouts, why = analyse_experts(model, trace, mp)
    for name, reason in why.items():
        if forced.get(name) == "experts":
            raise ValueError(f"plan forces {name!r} to 'experts', but it cannot be split: {reason}.")
    for name in [n for n in layouts if forced.get(n) == "replicate"]:
        del layouts[name]
        why[name] = "user plan"
    calls = {c.name: c for c in trace.calls}
    for name, lay in layouts.items():
        routers = tuple(sorted(r for r in _routers(trace, calls[name], set(lay.activations))
                               if r in plan.layers and plan.layers[r].style == "column_gather" and r not in forced))
        lay = replace(lay, routers=routers)
        plan.experts[name] = lay
        parts = ", ".join(
            f"{p} {tuple(getattr(model.get_submodule(name), p).shape)} dim {d}" + (f" in {k} blocks" if k > 1 else "")
            for p, (d, k) in lay.shards.items()
        )
        routing = f"router{'s' if len(routers) > 1 else ''} {', '.join(routers)} replicated" if routers else "routing replicated"
        note = f"experts: {parts}; {routing}; 1 all-reduce each way"
        plan.layers[name] = LayerPlan(name, "experts", lay.hidden, lay.intermediate, kind="experts", note=note)
        for r in routers:
            plan.layers[r] = replace(plan.layers[r], style="replicate", note=f"router of {name}: replicated")
    for name, reason in why.items():
        shape = next(t.shape for t in model.get_submodule(name).parameters(recurse=False) if t.dim() >= 3)
        note = "user plan" if reason == "user plan" else f"experts left whole: {reason}"
        plan.layers[name] = LayerPlan(name, "replicate", shape[-1], shape[-2], kind="experts", note=note)

