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

Then the module is run with its expert parameters replaced by shards (:mod:`lightning_dpmp.parallel.experts_layer`): its
replicated inputs that reach the split region enter it once (one fused all-reduce of their gradients backward, the
routing weights included, whose gradient is a partial sum too) and its output is all-reduced once forward:
1 all-reduce each way per MoE block, however many experts. A replicated parameter feeding the split region (a
router computed inside the same module) would get a partial gradient: such a module is left whole, with the reason.

A ``Linear`` whose output only routes tokens (it reaches the experts call through its routing arguments, not as the
activation) stays replicated, as in Megatron: splitting a (hidden, experts) router saves little and costs an
all-gather.

The detection pass lives in :mod:`lightning_dpmp.planner.experts_pass` (its op families and activation rules in
:mod:`lightning_dpmp.planner.experts_ops`); this module turns its result into splits and plan entries.

Example:
    >>> plan_experts(plan, model, trace, mp=2, forced={})     # fills plan.layers / plan.experts   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from torch import nn

from lightning_dpmp.planner.experts_ops import MATMULS, Conflict, Key, prod
from lightning_dpmp.planner.experts_pass import ExpertsPass
from lightning_dpmp.planner.plan_types import LayerPlan
from lightning_dpmp.planner.trace import LinearCall, ModuleCall, OpCall, Trace

__all__ = ["ExpertsSplit", "analyse_experts", "plan_experts"]


@dataclass(frozen=True)
class ExpertsSplit:
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
        """Parameters this split takes off each rank (dense minus local numel)."""
        return sum(getattr(module, p).numel() * (mp - 1) // mp for p in self.shards)


def analyse_experts(
    model: nn.Module, trace: Trace, mp: int
) -> tuple[dict[str, ExpertsSplit], dict[str, str]]:
    """Experts modules of ``model`` found in ``trace``: their splits, and why each other candidate stays whole.

    A candidate owns a parameter of 3+ dims that reaches a matmul-like call; modules whose stacked parameters never
    do (convolutions) are not experts and are not reported.
    """
    splits: dict[str, ExpertsSplit] = {}
    why: dict[str, str] = {}
    calls: dict[str, list[ModuleCall]] = {}
    for c in trace.calls:
        calls.setdefault(c.name, []).append(c)
    for name, mod in model.named_modules():
        own = {
            f"{name}.{p}" if name else p: tuple(t.shape) for p, t in mod.named_parameters(recurse=False) if t.dim() >= 3
        }
        if not own or not _reaches_matmul(trace, set(own)):
            continue
        found = calls.get(name, [])
        if not name:
            why[name] = "the model itself holds the expert weights: they must sit in a submodule it calls"
            continue
        if len(found) != 1:
            why[name] = f"called {len(found)} times in the traced step (experts are split when called once)"
            continue
        an = ExpertsPass(trace, found[0], own, mp)
        try:
            an.run()
            splits[name] = _split(name, an, found[0], own, mp)
        except Conflict as exc:
            why[name] = str(exc)
    return splits, why


def _reaches_matmul(trace: Trace, params: set[str]) -> bool:
    nodes = {n for n, p in trace.params.items() if p in params}
    for ev in trace.events:
        if isinstance(ev, OpCall) and nodes.intersection(n for n in ev.inputs if n is not None):
            if ev.name in MATMULS:
                return True
            nodes.update(ev.outputs)
    return False


def _split(name: str, an: ExpertsPass, call: ModuleCall, own: dict[str, tuple[int, ...]], mp: int) -> ExpertsSplit:
    shards: dict[str, tuple[int, int]] = {}
    hidden = intermediate = 0
    for pname, (dim, role) in sorted(an.split.items()):
        blocks = an.blocks.get(pname, 1)
        size = own[pname][dim]
        if size % (blocks * mp):
            fused = f" in {blocks} fused blocks" if blocks > 1 else ""
            raise Conflict(f"{pname} has {size} along dim {dim}{fused}, not divisible by mp={mp}")
        shards[pname.rpartition(".")[2] if "." in pname else pname] = (dim, blocks)
        if role == "row":
            intermediate = size
            hidden = prod(own[pname]) // (size * own[pname][0])
    grads = {key: rg for key, _, rg in call.args}
    entries = tuple(k for k, _, _ in call.args if k in an.entered)
    activations = tuple(k for k in entries if k in an.x_args)
    return ExpertsSplit(name, shards, entries, any(grads[k] for k in entries), hidden, intermediate, activations)


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
    """Add experts splits to ``plan`` (``plan.experts``, ``plan.layers`` entries of kind ``"experts"``), keep their
    routers replicated, and record why any other experts-like module stays whole."""

    if trace is None or mp == 1:
        return
    splits, why = analyse_experts(model, trace, mp)
    for name, reason in why.items():
        if forced.get(name) == "experts":
            raise ValueError(f"plan forces {name!r} to 'experts', but it cannot be split: {reason}.")
    for name in [n for n in splits if forced.get(n) == "replicate"]:
        del splits[name]
        why[name] = "user plan"
    calls = {c.name: c for c in trace.calls}
    for name, lay in splits.items():
        routers = tuple(sorted(r for r in _routers(trace, calls[name], set(lay.activations))
                               if r in plan.layers and plan.layers[r].style == "column_gather" and r not in forced))
        lay = replace(lay, routers=routers)
        plan.experts[name] = lay
        parts = ", ".join(
            f"{p} {tuple(getattr(model.get_submodule(name), p).shape)} dim {d}" + (f" in {k} blocks" if k > 1 else "")
            for p, (d, k) in lay.shards.items()
        )
        routers_s = f"router{'s' if len(routers) > 1 else ''} {', '.join(routers)}"
        routing = f"{routers_s} replicated" if routers else "routing replicated"
        note = f"experts: {parts}; {routing}; 1 all-reduce each way"
        plan.layers[name] = LayerPlan(name, "experts", lay.hidden, lay.intermediate, kind="experts", note=note)
        for r in routers:
            plan.layers[r] = replace(plan.layers[r], style="replicate", note=f"router of {name}: replicated")
    for name, reason in why.items():
        shape = next(t.shape for t in model.get_submodule(name).parameters(recurse=False) if t.dim() >= 3)
        note = "user plan" if reason == "user plan" else f"experts left whole: {reason}"
        plan.layers[name] = LayerPlan(name, "replicate", shape[-1], shape[-2], kind="experts", note=note)
