"""Record the data flow of one step of a model: which ``nn.Linear`` feeds which, and through what operations.

A ``TorchFunctionMode`` sees every torch function and tensor method called from Python, differentiable or not
(``argmax`` included), and forward hooks on each ``nn.Linear`` mark where a layer reads and writes. Calls made
inside a Linear are hidden, so the record reads like the model's own code. Leaf modules whose recorded forward
is one matmul of their input with their 2-D weight (GPT-2's ``Conv1D``: ``addmm(b, x, W)``) are recorded as
Linear calls too (:mod:`lightning_dpmp.planner.linear_like`); ``Trace.linear_forms`` says how each stores its
weight, and ``Trace.attention`` lists the ``nn.MultiheadAttention`` calls. The planner
(:mod:`lightning_dpmp.planner.plan`) turns the record into a layout.

Example:
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    >>> trace = trace_step(model, lambda: model(torch.randn(2, 4)).sum())   # e.g. lambda: lm.training_step(batch, 0)
    >>> [c.name for c in trace.linear_calls()]
    ['0', '2']
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_dpmp.compat import tree_leaves
from lightning_dpmp.planner.linear_like import LinearForm, candidate_params, detect
from lightning_dpmp.planner.ops import DROPOUTS, FACTORIES

__all__ = [
    "AttentionCall", "LinearCall", "ModuleCall", "NoDropout", "OpCall", "Trace", "describe_index", "first_pass",
    "has_own_forward", "is_linear", "loss_of", "op_name", "trace_step",
]


@dataclass(frozen=True)
class OpCall:
    """One torch call: its name, the tensor nodes it read (``None`` for a non-tensor argument) and wrote.

    ``values`` runs parallel to ``inputs``: the ``int`` arguments (shape literals, dims), ``None`` elsewhere.
    ``index`` describes the subscript of ``__getitem__``/``__setitem__``, one entry per indexed position (see
    :func:`describe_index`). A shape query (``x.shape``, ``x.size()``) is recorded as ``"size"`` with no output
    and the sizes in ``values``, so that the planner can tell sizes the code read from a tensor from literals.
    ``scope`` names the innermost (non-Linear) module that was running (``""`` outside every submodule): where to
    look for the attribute a literal size came from (an einops ``Rearrange`` layer holds its ``h=``).
    """

    name: str
    inputs: tuple[Optional[int], ...]
    outputs: tuple[int, ...]
    values: tuple[Optional[int], ...] = ()
    index: tuple[tuple, ...] = ()
    scope: str = ""


@dataclass(frozen=True)
class LinearCall:
    """One call of an ``nn.Linear`` module: the tensor node it read and the one it produced, and the mode it ran
    in: ``(module.training, torch.is_grad_enabled())`` (a vocab-parallel head keeps its logits split only in it)."""

    name: str
    input: int
    output: int
    input_requires_grad: bool
    mode: tuple[bool, bool] = (True, True)


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module other than ``nn.Linear``/``nn.Embedding``: its tensor arguments as ``(position or
    keyword, node, requires_grad)``, its tensor output nodes, and the events it issued (``events[start:end]``)."""

    name: str
    args: tuple[tuple[Union[int, str], int, bool], ...]
    outputs: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class AttentionCall:
    """One call of an ``nn.MultiheadAttention``: its query node, whether q, k, v were one tensor, whether the
    attention weights were returned (``need_weights``), and whether the query needed a gradient."""

    name: str
    input: int
    self_attention: bool
    need_weights: bool
    input_requires_grad: bool


@dataclass
class Trace:
    """Events in call order, each tensor node's shape, and the nodes that leave the step (its return value)."""

    events: list[Union[OpCall, LinearCall]] = field(default_factory=list)
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    escapes: set[int] = field(default_factory=set)
    embeddings: dict[str, int] = field(default_factory=dict)  # nn.Embedding name -> calls through forward()
    embedding_outputs: dict[int, str] = field(default_factory=dict)  # output node -> nn.Embedding name
    # nn.Embedding subclasses with a forward of their own (a scaled lookup): how each call looked its weight up,
    # "super" (through nn.Embedding.forward, which a vocab-parallel lookup can take the place of) or "direct"
    # (F.embedding called by the subclass's own code); the ops around the lookup are recorded like the model's own
    embedding_lookups: dict[str, list[str]] = field(default_factory=dict)
    params: dict[int, str] = field(default_factory=dict)  # node -> parameter name, for parameters read by ops
    modules: list[tuple[str, int, int]] = field(default_factory=list)  # other modules: (name, first input, output)
    calls: list[ModuleCall] = field(default_factory=list)  # other modules' calls, with every tensor argument
    linear_forms: dict[str, LinearForm] = field(default_factory=dict)  # linear-like modules (not nn.Linear) found
    attention: dict[str, list[AttentionCall]] = field(default_factory=dict)  # nn.MultiheadAttention calls
    # (op, module) for each op inside the model's forward whose result's shape, or the Python branch taken after it,
    # depends on the data (``nonzero``, a boolean mask, ``bool(t)``): which parameters get gradients may change
    # from step to step and from rank to rank (experts, LayerDrop, a branch on the data)
    data_dependent: list[tuple[str, str]] = field(default_factory=list)
    result: Any = None
    error: str = ""  # why the step stopped early (``trace_step(keep_partial=True)``); "" when it ran through
    defaulted: list[str] = field(default_factory=list)  # Python values of meta tensors taken as 0/False (see above)

    def linear_calls(self) -> list[LinearCall]:
        return [e for e in self.events if isinstance(e, LinearCall)]


class PassComplete(Exception):
    """Raised inside a traced step on meta tensors at the first Python value it reads after one whole pass through
    the model: what follows (generation's next token) would depend on values meta tensors do not have."""


# Python values a step may read from a tensor; on meta tensors, before the model has run once, the defaults below.
_META_DEFAULTS: dict[str, Any] = {"__bool__": False, "item": 0, "__int__": 0, "__index__": 0, "__float__": 0.0}


class _Recorder(TorchFunctionMode):
    def __init__(self, trace: Trace, meta_defaults: bool = False) -> None:
        super().__init__()
        self.trace = trace
        # A non-training step on meta tensors (generation): Python values read before the model's first pass get
        # defaults (generate checks its special tokens first), and the trace stops at the first one after it.
        self.meta_defaults = meta_defaults
        self.pass_done = False  # an outermost module call holding Linear calls has completed
        self.hidden = 0  # > 0 while inside a Linear: its F.linear is the LinearCall itself
        self._ids: dict[int, int] = {}
        self._keep: list[Tensor] = []  # keeps every traced tensor alive so that no id() is reused
        self.scope: list[str] = []  # names of the (non-Linear) modules being run, innermost last
        self.forward_depth = 0  # > 0 inside the model's own forward (not in the rest of the step: logging .item())
        self.lookups: list[tuple[nn.Module, str]] = []  # nn.Embedding subclasses being run, innermost last

    def node(self, t: Tensor) -> int:
        key = id(t)
        if key not in self._ids:
            self._ids[key] = len(self._keep)
            self._keep.append(t)
            self.trace.shapes[self._ids[key]] = tuple(t.shape)
        return self._ids[key]

    def module(self) -> str:
        """The innermost (non-Linear) module running, ``""`` outside every submodule."""
        return self.scope[-1] if self.scope else ""

    def data_dependent(self, name: str) -> None:
        if self.forward_depth:  # the model's forward, not the rest of the step (logging ``loss.item()``)
            self.trace.data_dependent.append((name, self.module()))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if self.meta_defaults and not self.hidden and args and isinstance(args[0], Tensor) and args[0].is_meta:
            name = op_name(func)
            if name in _META_DEFAULTS or name == "tolist":
                if self.pass_done:
                    raise PassComplete(f"{name} of a meta tensor after one whole pass through the model")
                self.trace.defaulted.append(name)
                return _META_DEFAULTS[name] if name != "tolist" else torch.zeros(args[0].shape, dtype=torch.int64,
                                                                                  ).tolist()
        out = func(*args, **(kwargs or {}))
        if self.hidden:
            return out
        name = op_name(func)
        if name == "embedding" and self.lookups and self._lookup(args, kwargs or {}, out):
            return out
        if name in DATA_DEPENDENT:  # (a boolean mask is found with the subscript, below)
            self.data_dependent(name)
        if name == "size" and args and isinstance(args[0], Tensor):
            sizes = tuple(out) if isinstance(out, tuple) else (out,) if isinstance(out, int) else ()
            self.trace.events.append(OpCall("size", (self.node(args[0]),), (), tuple(int(v) for v in sizes)))
            return out
        outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        leaves = tree_leaves((args, kwargs or {}))
        if name in FACTORIES and len(outs) == 1:  # constant tensors: uniform along every dim, sized by literals
            values = tuple(a if isinstance(a, int) and not isinstance(a, bool) else None for a in leaves)
            scope = (("module", self.module()),)
            self.trace.events.append(OpCall(name, (), (self.node(outs[0]),), values, scope))
            return out
        if not outs or not any(isinstance(a, Tensor) for a in leaves):
            return out  # metadata queries (dtype, dim) and other factories carry no data flow we care about
        inputs = tuple(self.node(a) if isinstance(a, Tensor) else None for a in leaves)
        values = tuple(a if isinstance(a, int) and not isinstance(a, bool) else None for a in leaves)
        index: tuple[tuple, ...] = ()
        if name in ("__getitem__", "__setitem__") and len(args) > 1:
            index = describe_index(args[1])
            if name == "__getitem__" and any(i[0] == "tensor" and i[2] and i[1] > 0 for i in index):
                self.data_dependent(name)  # x[mask]: as many rows as the mask has True
        elif name == "einsum" and args and isinstance(args[0], str):
            index = (("equation", args[0]),)
        self.trace.events.append(OpCall(name, inputs, tuple(self.node(t) for t in outs), values, index,
                                        self.module()))
        return out

    def _lookup(self, args: tuple, kwargs: dict, out: Any) -> bool:
        """Record ``F.embedding`` of the running embedding subclass's own weight as its lookup event."""
        module, name = self.lookups[-1]
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if weight is not module.weight or not isinstance(out, Tensor):
            return False
        ids = args[0] if args else kwargs.get("input")
        via = "direct"
        own = type(module).forward.__code__
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not own:  # up to the subclass's forward: who called F.embedding
            if frame.f_code is nn.Embedding.forward.__code__:
                via = "super"
                break
            frame = frame.f_back  # type: ignore[assignment]
        self.trace.embedding_lookups.setdefault(name, []).append(via)
        self.trace.embeddings[name] = self.trace.embeddings.get(name, 0) + 1
        node = self.node(out)
        self.trace.embedding_outputs[node] = name
        inputs = (self.node(ids) if isinstance(ids, Tensor) else None,)
        self.trace.events.append(OpCall("embedding", inputs, (node,), (), (("module", name),)))
        return True


# Ops whose output shape (``nonzero``, ``masked_select``) or Python value (``bool(t)``, ``t.item()``) depends on the
# data: code that follows them may leave parameters out of a step.
DATA_DEPENDENT = frozenset({
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "__bool__", "item", "tolist", "__int__",
    "__index__", "__float__",
})


def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module`` (an ``nn.Embedding``) is of a subclass that overrides ``forward``."""
    return type(module).forward is not nn.Embedding.forward


def op_name(func: Any) -> str:
    """A torch function's name; attribute getters are named by their attribute (``x.shape`` is ``"size"``,
    ``x.mT`` is ``"mT"``), plain data views (``x.data``, ``x.real``) stay ``"__get__"``."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        return {"shape": "size", "T": "T", "mT": "mT", "H": "T", "mH": "mT"}.get(attr, name)
    return name


def describe_index(index: Any) -> tuple[tuple, ...]:
    """A subscript as plain data: ``("slice", start, stop, step)``, ``("int",)``, ``("none",)``,
    ``("ellipsis",)`` or ``("tensor", ndim, is_bool)`` per item (advanced indices by tensors or lists)."""
    items = index if isinstance(index, tuple) else (index,)
    out: list[tuple] = []
    for it in items:
        if it is None:
            out.append(("none",))
        elif it is Ellipsis:
            out.append(("ellipsis",))
        elif isinstance(it, bool):
            out.append(("tensor", 0, True))
        elif isinstance(it, int):
            out.append(("int",))
        elif isinstance(it, slice):
            ends = [v if v is None or isinstance(v, int) else -1 for v in (it.start, it.stop, it.step)]
            out.append(("slice", *ends))
        elif isinstance(it, Tensor):
            out.append(("tensor", it.dim(), it.dtype == torch.bool))
        else:
            out.append(("tensor", 1, False))  # a list of ints: advanced indexing along one dim
    return tuple(out)


def trace_step(model: nn.Module, run: Callable[[], Any], keep_partial: bool = False) -> Trace:
    """Run ``run()`` once while recording the data flow through ``model``'s ``nn.Linear`` layers.

    ``run`` should perform one forward step (e.g. ``training_step`` on a batch) and return its output; tensors in
    that output are recorded as escaping the step. The caller is responsible for RNG and mode (eval) hygiene.
    With ``keep_partial``, a step that raises gives the trace recorded up to the error, with ``error`` set (a
    generation step on meta tensors stops at its first ``.item()``, after one whole pass through the model).
    """
    trace = Trace()
    recorder = _Recorder(trace, meta_defaults=keep_partial)
    names = {m: n for n, m in model.named_modules() if is_linear(m)}
    pending: dict[nn.Module, list[tuple[int, bool]]] = {}

    def pre_hook(module: nn.Module, args: tuple) -> None:
        if recorder.hidden == 0 and args and isinstance(args[0], Tensor):
            pending.setdefault(module, []).append((recorder.node(args[0]), args[0].requires_grad))
        recorder.hidden += 1

    def post_hook(module: nn.Module, args: tuple, output: Any) -> None:
        recorder.hidden -= 1
        if recorder.hidden == 0 and pending.get(module) and isinstance(output, Tensor):
            node, requires_grad = pending[module].pop()
            trace.events.append(LinearCall(names[module], node, recorder.node(output), requires_grad, _mode(module)))

    embeddings: dict[nn.Module, str] = {m: n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    # a subclass running code of its own around the lookup is not hidden: its ops are the model's (a scale)
    scaled = {m: embeddings.pop(m) for m in list(embeddings) if has_own_forward(m)}

    emb_inputs: dict[nn.Module, list[Optional[int]]] = {}

    def emb_pre(module: nn.Module, args: tuple) -> None:
        if recorder.hidden == 0:
            trace.embeddings[embeddings[module]] = trace.embeddings.get(embeddings[module], 0) + 1
            ids = args[0] if args and isinstance(args[0], Tensor) else None
            emb_inputs.setdefault(module, []).append(recorder.node(ids) if ids is not None else None)
        recorder.hidden += 1  # the lookup itself is recorded as one "embedding" event below

    def emb_post(module: nn.Module, args: tuple, output: Any) -> None:
        recorder.hidden -= 1
        if recorder.hidden == 0 and isinstance(output, Tensor):
            out = recorder.node(output)
            trace.embedding_outputs[out] = embeddings[module]
            ids = emb_inputs[module].pop() if emb_inputs.get(module) else None
            trace.events.append(OpCall("embedding", (ids,), (out,), (), (("module", embeddings[module]),)))

    def scaled_pre(module: nn.Module, args: tuple) -> None:
        recorder.lookups.append((module, scaled[module]))

    def scaled_post(module: nn.Module, args: tuple, output: Any) -> None:
        recorder.lookups.pop()

    others = {m: n for n, m in model.named_modules()
              if n and m not in names and m not in embeddings and m not in scaled}
    opened: dict[nn.Module, list[Optional[int]]] = {}

    def mod_pre(module: nn.Module, args: tuple) -> None:
        first = args[0] if args and isinstance(args[0], Tensor) and recorder.hidden == 0 else None
        opened.setdefault(module, []).append(recorder.node(first) if first is not None else None)
        recorder.scope.append(others[module])

    def mod_post(module: nn.Module, args: tuple, output: Any) -> None:
        if recorder.scope:
            recorder.scope.pop()
        node = opened[module].pop() if opened.get(module) else None
        if node is not None and isinstance(output, Tensor) and recorder.hidden == 0:
            trace.modules.append((others[module], node, recorder.node(output)))

    def enter(module: nn.Module, args: tuple) -> None:
        recorder.forward_depth += 1

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        recorder.forward_depth -= 1

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
    handles += _hook_linear_like(model, recorder, trace, set(names) | set(embeddings) | set(scaled))
    handles += _hook_attention(model, recorder, trace)
    for module in others:
        handles.append(module.register_forward_pre_hook(mod_pre))
        handles.append(module.register_forward_hook(mod_post))
    handles += _record_calls(others, recorder, trace)
    for module in names:
        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(post_hook))
    for module in embeddings:
        handles.append(module.register_forward_pre_hook(emb_pre))
        handles.append(module.register_forward_hook(emb_post))
    for module in scaled:
        handles.append(module.register_forward_pre_hook(scaled_pre))
        handles.append(module.register_forward_hook(scaled_post, always_call=True))
    try:
        try:
            with recorder:
                result = run()
        except Exception as exc:
            if not keep_partial:
                raise
            trace.error, result = f"{type(exc).__name__}: {exc}", None
        trace.result = result
        trace.escapes = {recorder.node(t) for t in tree_leaves(result) if isinstance(t, Tensor)}
        by_id = {id(p): n for n, p in model.named_parameters()}
        trace.params = {node: by_id[key] for key, node in recorder._ids.items() if key in by_id}
        _drop_inconsistent_linear_like(trace)
    finally:
        for h in handles:
            h.remove()
    return trace


def first_pass(trace: Trace) -> tuple[Trace, str]:
    """``trace`` cut to the first complete pass through the outermost module that runs the Linear layers, and that
    module's name; ``(trace, "")`` when there is nothing to cut.

    A generation step runs the model once per new token: every Linear is called ``k`` times, each pass the same
    sequence of layers. Planned as it is, every layer would be "called more than once" and kept whole; planned from
    one pass, each decode step keeps the split layout (2 all-reduces per block). It applies when one module's ``k``
    calls hold every Linear call in the same order, or when the step stopped with an error (``trace.error``: on
    meta tensors, at generation's first ``.item()``) after that module's first call had completed.
    """
    linear = [i for i, e in enumerate(trace.events) if isinstance(e, LinearCall)]
    if not linear:
        return trace, ""
    outer = [c for c in trace.calls if c.start <= linear[0] < c.end]
    if not outer:
        return trace, ""
    first = min(outer, key=lambda c: (c.start, -c.end))  # the outermost completed call holding the first Linear
    calls = sorted((c for c in trace.calls if c.name == first.name), key=lambda c: c.start)
    names = [[e.name for e in trace.events[c.start:c.end] if isinstance(e, LinearCall)] for c in calls]
    if trace.error:
        cut = first.end
    elif (len(calls) < 2 or sum(map(len, names)) != len(linear) or any(n != names[0] for n in names)
          or len(set(Counter(n for p in names for n in p).values())) != 1):
        return trace, ""
    else:
        cut = calls[1].start
    kept = trace.events[:cut]
    last = max((n for e in kept for n in (e.outputs if isinstance(e, OpCall) else (e.output,))), default=-1)
    embeddings = Counter(dict(e.index).get("module") for e in kept if isinstance(e, OpCall) and e.name == "embedding")
    passes = max(len(calls), 1)
    return replace(
        trace, events=kept, calls=[c for c in trace.calls if c.end <= cut],
        modules=[m for m in trace.modules if m[2] <= last],
        embeddings={n: embeddings.get(n, 0) for n in trace.embeddings},
        attention={n: a[: max(1, len(a) // passes)] for n, a in trace.attention.items()},
    ), first.name


def _record_calls(names: dict[nn.Module, str], recorder: _Recorder, trace: Trace) -> list[Any]:
    """Hooks filling ``trace.calls`` (every tensor argument, positional or keyword, and the span of events)."""
    opened: dict[nn.Module, list[tuple[tuple, int]]] = {}

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        keyed = list(enumerate(args)) + list(kwargs.items())
        tensors = tuple((k, recorder.node(a), a.requires_grad) for k, a in keyed if isinstance(a, Tensor))
        opened.setdefault(module, []).append((tensors if recorder.hidden == 0 else (), len(trace.events)))

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        tensors, start = opened[module].pop()
        if recorder.hidden == 0:
            outs = tuple(recorder.node(t) for t in tree_leaves(output) if isinstance(t, Tensor))
            trace.calls.append(ModuleCall(names[module], tensors, outs, start, len(trace.events)))
            if recorder.meta_defaults and not recorder.scope and any(
                    isinstance(e, LinearCall) for e in trace.events[start:]):
                recorder.pass_done = True  # an outermost call (the scope is popped first) that ran Linear layers

    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles


def _mode(module: nn.Module) -> tuple[bool, bool]:
    """The mode a call runs in: the module's training flag and whether autograd records."""
    return (module.training, torch.is_grad_enabled())


def _hook_linear_like(model: nn.Module, recorder: _Recorder, trace: Trace, skip: set[nn.Module]) -> list:
    """Hooks on leaf modules shaped like a Linear: a call whose recorded ops are one matmul of the input with the
    weight is replaced in ``trace.events`` by a :class:`LinearCall`; any other call stays as its ops."""
    cands = {m: (n, p) for n, m in model.named_modules() if m not in skip and (p := candidate_params(m)) is not None}
    opened: dict[nn.Module, list[tuple[int, int, bool]]] = {}

    def pre(module: nn.Module, args: tuple) -> None:
        if recorder.hidden == 0 and args and isinstance(args[0], Tensor):
            opened.setdefault(module, []).append((len(trace.events), recorder.node(args[0]), args[0].requires_grad))

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        if recorder.hidden or not opened.get(module):
            return
        start, x, requires_grad = opened[module].pop()
        name, (w, b) = cands[module]
        form = None
        if isinstance(output, Tensor):
            w_node = recorder._ids.get(id(getattr(module, w)))
            b_node = recorder._ids.get(id(getattr(module, b))) if b is not None else None
            if w_node is not None:
                ops = trace.events[start:]
                form = detect(ops, x, recorder.node(output), w_node, b_node, trace.shapes, (w, b))
        if form is None or trace.linear_forms.get(name, form) != form:
            trace.linear_forms[name] = None  # type: ignore[assignment]  # seen computing something else
            return
        del trace.events[start:]
        trace.events.append(LinearCall(name, x, recorder.node(output), requires_grad, _mode(module)))
        trace.linear_forms[name] = form

    handles = []
    for module in cands:
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles


def _hook_attention(model: nn.Module, recorder: _Recorder, trace: Trace) -> list:
    """Record each ``nn.MultiheadAttention`` call (its ops stay in the trace: one ``multi_head_attention_forward``)."""
    mhas: dict[nn.Module, str] = {m: n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        q, k, v = (list(args) + [kwargs.get(a) for a in ("query", "key", "value")[len(args):]])[:3]
        if recorder.hidden or not isinstance(q, Tensor):
            return
        weights = isinstance(output, tuple) and len(output) > 1 and isinstance(output[1], Tensor)
        call = AttentionCall(mhas[module], recorder.node(q), q is k and k is v, weights, q.requires_grad)
        trace.attention.setdefault(mhas[module], []).append(call)

    return [m.register_forward_hook(hook, with_kwargs=True) for m in mhas]


def _drop_inconsistent_linear_like(trace: Trace) -> None:
    """A module linear-like in one call but not in another is opaque: its Linear calls become plain ops."""
    bad = {n for n, f in trace.linear_forms.items() if f is None}
    for n in bad:
        del trace.linear_forms[n]
    if bad:
        trace.events = [
            OpCall("linear_like_module", (e.input,), (e.output,)) if isinstance(e, LinearCall) and e.name in bad else e
            for e in trace.events
        ]


def loss_of(step_output: Any) -> Optional[Tensor]:
    """The loss a Lightning step returned (a tensor, or ``{"loss": tensor}``), or ``None``."""
    if isinstance(step_output, Tensor):
        return step_output
    if isinstance(step_output, dict) and isinstance(step_output.get("loss"), Tensor):
        return step_output["loss"]
    return None


def is_linear(module: nn.Module) -> bool:
    """Exactly ``nn.Linear`` or a subclass that does not change its forward
    (e.g. ``NonDynamicallyQuantizableLinear``)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


class NoDropout(TorchFunctionMode):
    """Training mode without randomness, for the extra steps of planning and verification.

    A step traced in eval mode is not the step that trains (transformers switches gradient checkpointing, KV
    caches and auxiliary losses on ``self.training``), but a step with live dropout cannot be compared between
    the dense and the parallel model. Under this mode every dropout is the identity and attention dropout is 0.

    Example:
        >>> with NoDropout():
        ...     torch.nn.functional.dropout(torch.ones(2), p=0.5, training=True)
        tensor([1., 1.])
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in DROPOUTS and args and isinstance(args[0], Tensor):
            return args[0]
        if name == "scaled_dot_product_attention":
            if len(args) > 4:
                args = args[:4] + (0.0,) + tuple(args[5:])
            elif "dropout_p" in kwargs:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)
