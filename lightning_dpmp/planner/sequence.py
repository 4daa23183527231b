"""Sequence parallelism: hold the token-wise regions (norms, dropout, residual adds) 1/mp of the sequence each.

Between a row layer's output and the next column layer's input, Megatron-style TP keeps full replicated
activations on every MP rank. With sequence parallelism those regions are split along the sequence: a column
layer's entry becomes an all-gather along the sequence (backward: reduce-scatter) and a row layer's exit a
reduce-scatter (backward: all-gather), the same bytes as one all-reduce, with 1/mp of the activation memory.

This module checks, on the recorded step, that everything done to sequence-split tensors is token-wise, and lists
the parameters that then see only 1/mp of the tokens (norm weights, row biases, unsplit layers): their gradients
are summed over the MP group once per step (forgetting it silently flat-lines the loss).

Example:
    >>> sp = plan_sequence_parallel(trace, plan, mp=2)   # doctest: +SKIP
    >>> sp.partial_params                                 # doctest: +SKIP
    ['blocks.0.ln_1.weight', 'blocks.0.ln_1.bias', ..., 'blocks.0.attn.out_proj.bias', ...]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_dpmp.planner.ops import BINARY, NORMS, UNARY
from lightning_dpmp.planner.plan import Plan
from lightning_dpmp.planner.trace import LinearCall, Trace

__all__ = ["SequencePlan", "plan_sequence_parallel"]

_REDUCING = {"mean", "sum", "var", "amax", "norm", "softmax", "log_softmax"}  # token-wise only along the last dim
_TOKENWISE = UNARY | BINARY | NORMS | _REDUCING


@dataclass
class SequencePlan:
    """Where the sequence is split, and what must be summed over MP afterwards.

    Attributes:
        scatter: embedding names whose outputs enter the stream, with the sequence dim of their output.
        partial_params: parameters whose gradients cover 1/mp of the tokens on each rank.
        problem: why sequence parallelism cannot apply (``None`` when it can).
    """

    scatter: dict[str, int] = field(default_factory=dict)
    partial_params: list[str] = field(default_factory=list)
    gather_entries: set[str] = field(default_factory=set)  # column-style layers reading a sequence-split input
    owner_gather: dict[str, list[str]] = field(default_factory=dict)  # module gathering its input -> its entries
    problem: Optional[str] = None


def plan_sequence_parallel(trace: Trace, plan: Plan, mp: int, param_names: Optional[set[str]] = None) -> SequencePlan:
    """Follow sequence-split tensors from the embeddings through the step; see the module docstring."""
    out = SequencePlan()
    split: dict[int, int] = {}  # node -> sequence dim (counted from the end: -2 for (B, T, C))
    partial: set[str] = set()
    shapes = trace.shapes

    def fail(why: str) -> SequencePlan:
        return SequencePlan(problem=why)

    for node, name in trace.embedding_outputs.items():
        shape = shapes[node]
        if len(shape) < 2 or shape[-2] % mp:
            return fail(f"the output of {name} has shape {shape}: sequence (dim -2) not divisible by mp={mp}")
        split[node] = -2
        out.scatter[name] = len(shape) - 2
    if not split:
        return fail("no nn.Embedding starts the sequence: nothing to split")
    for ev in trace.events:
        if isinstance(ev, LinearCall):
            lp = plan.layers[ev.name]
            if ev.input in split:
                if lp.style == "replicate":
                    partial.update((f"{ev.name}.weight", f"{ev.name}.bias"))  # filtered to real ones below
                    split[ev.output] = -2  # an unsplit Linear is token-wise: its output stays split
                    continue
                if lp.style == "row":
                    return fail(f"{ev.name} (row) reads a sequence-split tensor")
                out.gather_entries.add(ev.name)
                split.pop(ev.output, None)  # column entry gathers the sequence
                continue
            if lp.style == "row":
                split[ev.output] = -2  # the exit reduce-scatters along the sequence
                partial.add(f"{ev.name}.bias")
            continue
        if ev.name in ("size", "embedding", "zeros", "ones", "empty"):  # no data read (embeddings: marked above)
            continue
        ins = [(i, n) for i, n in enumerate(ev.inputs) if n is not None and n in split]
        if not ins:
            for n in ev.outputs:
                split.pop(n, None)
            continue
        if ev.name not in _TOKENWISE:
            return fail(f"'{ev.name}' reads across the sequence dimension (only token-wise ops may touch it)")
        if ev.name in _REDUCING:
            dims = [v for v in ev.values[1:] if v is not None]
            nd = len(shapes[ins[0][1]])
            if not dims or any(d % nd != nd - 1 for d in dims):
                return fail(f"'{ev.name}' reduces over more than the feature dim of a sequence-split tensor")
        nd = len(shapes[ins[0][1]])
        for operand in ev.inputs:
            if operand is None or operand in split:
                continue
            shape = shapes[operand]
            aligned = nd - 2 - (nd - len(shape))
            if aligned >= 0 and shape[aligned] != 1:
                return fail(f"'{ev.name}' mixes a sequence-split tensor with a full one of shape {shape}")
            if operand in trace.params:
                partial.add(trace.params[operand])
        for n in ev.outputs:
            split[n] = -2
    for n in trace.escapes:
        if n in split:
            return fail("a sequence-split tensor is returned from the step")
    out.partial_params = sorted(p for p in partial if param_names is None or p in param_names)
    out.owner_gather = _owners(trace, plan, out.gather_entries, split)
    return out


def _owners(trace: Trace, plan: Plan, entries: set[str], split: dict[int, int]) -> dict[str, list[str]]:
    """Modules (attention, MLP) whose input feeds only their column layers: gather the sequence at their input.

    Attention code often reads ``B, T, C = x.shape`` from its input and reshapes with it; gathering at the module
    boundary gives that code the full sequence, as Megatron's attention sees it. Where no such module exists the
    column layers gather at their own entry instead.
    """
    readers: dict[int, list[str]] = {}
    for ev in trace.events:
        if isinstance(ev, LinearCall):
            readers.setdefault(ev.input, []).append(ev.name)
        elif ev.name not in ("size", "embedding"):  # reading a shape is not reading the data; ids are no input
            for n in ev.inputs:
                if n is not None:
                    readers.setdefault(n, []).append("")  # an op, not a Linear
    calls = [name for name, _, _ in trace.modules]
    owners: dict[str, list[str]] = {}
    for name, node, out_node in sorted(trace.modules, key=lambda m: -len(m[0])):  # innermost first
        group = readers.get(node, [])
        if not group or calls.count(name) != 1 or out_node not in split:
            continue
        if any(r not in entries or plan.layers[r].style != "column" or not r.startswith(name + ".") for r in group):
            continue
        if any(set(group) & set(v) for v in owners.values()):
            continue
        owners[name] = sorted(group)
    return owners
