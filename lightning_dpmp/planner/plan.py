"""Decide how each ``nn.Linear`` and ``nn.Embedding`` is split, from the recorded data flow of one step.

Styles (the values a user plan may name):

* ``"column"``: split by output features; the output stays split until ``"row"`` layers read it, through
  element-wise ops or head-wise attention (:mod:`lightning_dpmp.planner.flow` says which ops keep it split).
* ``"row"``: split by input features; the output is all-reduced.
* ``"column_gather"``: split by output features, output all-gathered: correct wherever the output goes. The
  default for a Linear that pairs with nothing.
* ``"vocab"``: an LM head split by vocabulary whose logits reach only ``F.cross_entropy`` (computed
  vocab-parallel, full logits never gathered); or an ``nn.Embedding`` split by vocabulary rows.
* ``"replicate"``: not split: the split dimension is not divisible by ``mp``, the weight is tied to a layer that
  stays whole, or the layer is never called through ``forward()`` (its weight is read directly).

Example:
    >>> plan = make_plan(model, mp=2, trace=trace_step(model, run))    # doctest: +SKIP
    >>> print(plan.describe(model))                                    # doctest: +SKIP
"""

from __future__ import annotations

import fnmatch
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from torch import nn

from lightning_dpmp.planner.flow import analyse
from lightning_dpmp.planner.trace import LinearCall, Trace, is_linear

__all__ = ["LayerPlan", "Plan", "STYLES", "make_plan"]

STYLES = ("column", "row", "column_gather", "vocab", "replicate")


@dataclass(frozen=True)
class LayerPlan:
    """How one layer is parallelised.

    Attributes:
        name: fully qualified module name.
        style: one of :data:`STYLES`.
        in_features, out_features: dense sizes (for an embedding: ``num_embeddings``, ``embedding_dim``).
        input_is_parallel: for ``"row"``: the input arrives split (else it is split locally).
        entry: layers with the same non-negative ``entry`` share one input copy (one backward all-reduce).
        input_requires_grad: whether the traced input needed a gradient (a data input does not).
        blocks: fused projections (q|k|v): each of ``blocks`` row blocks is split separately.
        kind: ``"linear"`` or ``"embedding"``.
        note: why this style, for the printout.
    """

    name: str
    style: str
    in_features: int
    out_features: int
    input_is_parallel: bool = True
    entry: int = -1
    input_requires_grad: bool = True
    blocks: int = 1
    kind: str = "linear"
    note: str = ""

    def local_shape(self, mp: int) -> tuple[int, int]:
        """Local weight shape: ``(out, in)`` of a Linear, ``(rows, dim)`` of an embedding."""
        if self.kind == "embedding":
            rows = self.in_features // mp if self.style == "vocab" else self.in_features
            return (rows, self.out_features)
        if self.style in ("column", "column_gather", "vocab"):
            return (self.out_features // mp, self.in_features)
        if self.style == "row":
            return (self.out_features, self.in_features // mp)
        return (self.out_features, self.in_features)


@dataclass
class Plan:
    """The layout of every Linear and Embedding of a model, in module order, for an MP width ``mp``.

    ``adjust`` maps a module name to ``{attribute: (dense value, local value)}``: head counts that attention code
    keeps in attributes and uses in reshapes, set to the per-rank count while the model is parallel.
    """

    mp: int
    layers: dict[str, LayerPlan] = field(default_factory=dict)
    traced: bool = False
    notes: list[str] = field(default_factory=list)
    adjust: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    sequence: Optional[Any] = None  # a lightning_dpmp.planner.sequence.SequencePlan when sequence parallel

    def comm_per_step(self) -> dict[str, dict[str, int]]:
        """Analytic MP collectives of one forward + backward, one call per layer (clipping's all-reduce excluded).

        Without sequence parallelism: all-reduce and all-gather; with it, every entry all-gathers the sequence
        forward and reduce-scatters backward, every exit reduce-scatters forward.
        """
        layers = [lp for lp in self.layers.values() if self.mp > 1]
        linear = [lp for lp in layers if lp.kind == "linear"]
        sp = self.sequence
        split_in = sp.gather_entries if sp is not None else set()
        entries: dict[Any, tuple[bool, bool]] = {}
        for lp in linear:
            if lp.style in ("column", "column_gather", "vocab"):
                key = lp.entry if lp.entry >= 0 else f"own:{lp.name}"
                entries[key] = (lp.name in split_in, lp.input_requires_grad)
        rows = sum(lp.style == "row" for lp in linear)
        vocab_emb = sum(lp.style == "vocab" for lp in layers if lp.kind == "embedding")
        fwd = {"all_reduce": 2 * sum(lp.style == "vocab" for lp in linear), "all_gather": 0, "reduce_scatter": 0}
        bwd = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
        fwd["all_gather"] += sum(lp.style == "column_gather" for lp in linear)
        bwd["all_gather"] += sum(lp.style == "row" and not lp.input_is_parallel and lp.input_requires_grad for lp in linear)
        for seq_split, needs_grad in entries.values():
            fwd["all_gather"] += seq_split
            bwd["reduce_scatter" if seq_split else "all_reduce"] += needs_grad
        if sp is None:
            fwd["all_reduce"] += rows + vocab_emb
        else:
            fwd["reduce_scatter"] += rows + vocab_emb
            bwd["all_gather"] += rows + vocab_emb + len([n for n in sp.scatter if self.layers[n].style == "replicate"])
        if sp is None:
            fwd.pop("reduce_scatter"), bwd.pop("reduce_scatter")
        return {"forward": fwd, "backward": bwd}

    def param_counts(self, model: nn.Module) -> tuple[int, int]:
        """(parameters held per rank, parameters of the dense model) for ``model`` in its dense form."""
        total = sum(p.numel() for p in model.parameters())
        saved, seen = 0, set()
        for name, mod in model.named_modules():
            lp = self.layers.get(name)
            if lp is None or lp.style == "replicate" or self.mp == 1 or id(mod.weight) in seen:
                continue
            seen.add(id(mod.weight))
            saved += mod.weight.numel() - mod.weight.numel() // self.mp
            bias = getattr(mod, "bias", None)
            if bias is not None and lp.style != "row":
                saved += bias.numel() - bias.numel() // self.mp
        return total - saved, total

    def describe(self, model: nn.Module) -> str:
        """A table, one line per layer (name, style, full shape -> local shape, note), and per-rank totals."""
        rows = [("layer", "style", "full", "local", "note")]
        for lp in self.layers.values():
            full = (lp.in_features, lp.out_features) if lp.kind == "embedding" else (lp.out_features, lp.in_features)
            style = lp.style + ("(emb)" if lp.kind == "embedding" else "")
            rows.append((lp.name, style, str(full), str(lp.local_shape(self.mp)), lp.note))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"DPMPStrategy plan for mp={self.mp} ({'traced one step' if self.traced else 'not traced'}):"]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + ("  " + r[4] if r[4] else ""))
        local, total = self.param_counts(model)
        c = self.comm_per_step()

        def fmt(d: dict[str, int]) -> str:
            return " + ".join(f"{n} {k.replace('_', '-')}" for k, n in d.items())

        lines.append(
            f"  parameters per rank: {local:,} of {total:,} ({100.0 * local / max(total, 1):.1f}%);"
            f" MP collectives per step: forward {fmt(c['forward'])}, backward {fmt(c['backward'])}"
        )
        if self.sequence is not None:
            lines.append(
                f"  sequence parallel: {len(self.sequence.partial_params)} parameters see 1/{self.mp} of the tokens"
                " and are summed over MP once per step"
            )
        for module, attrs in self.adjust.items():
            for attr, (dense, local_v) in attrs.items():
                lines.append(f"  adjusted: {module}.{attr} = {dense} -> {local_v} per rank")
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
        layers = [n for n in matched if is_linear(modules[n]) or type(modules[n]) is nn.Embedding]
        if matched and not layers:
            mod = modules[matched[0]]
            raise ValueError(
                f"plan[{pattern!r}] = {style!r} matches {matched[0]!r}, a {type(mod).__name__}, and no nn.Linear"
                " or nn.Embedding; only those layers can be given a style."
            )
        for name in layers:  # a glob like 'blocks.*' may also match norms and containers: those are skipped
            mod = modules[name]
            if isinstance(mod, nn.Embedding):
                if style not in ("vocab", "replicate"):
                    raise ValueError(f"plan gives the embedding {name!r} style {style!r}; use 'vocab' or 'replicate'.")
                if style == "vocab" and mod.num_embeddings % mp:
                    raise ValueError(
                        f"plan forces {name!r} to 'vocab', but num_embeddings={mod.num_embeddings} is not divisible"
                        f" by mp={mp}. Use 'replicate', or pad the vocabulary to a multiple of {mp}."
                    )
                forced.setdefault(name, style)
                continue
            forced.setdefault(name, style)
            if style in ("column", "column_gather", "vocab") and mod.out_features % mp:
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


def _module_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Other names under which a module object is registered: ``{first name: [further names]}``."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in first:
            out.setdefault(first[id(mod)], []).append(name)
        else:
            first[id(mod)] = name
    return out


def _weight_owners(model: nn.Module) -> dict[int, list[str]]:
    """``{id(parameter): [modules holding it]}``, each module object once (under its first name)."""
    canonical = {id(m): n for n, m in model.named_modules()}
    owners: dict[int, list[str]] = {}
    for mod in {id(m): m for m in model.modules()}.values():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(canonical[id(mod)])
    for p in model.parameters():
        owners.setdefault(id(p), [])
    return owners


def _groups(modules: Mapping[str, nn.Module], key: Any) -> list[list[str]]:
    """Module names grouped by ``key(module)`` (e.g. the weight they share), in module order."""
    out: dict[Any, list[str]] = {}
    for n, m in modules.items():
        out.setdefault(key(m), []).append(n)
    return list(out.values())


def _owner(model: nn.Module, names: set[str]) -> str:
    """The innermost module containing all ``names`` (e.g. the attention block of q/k/v/out)."""
    prefix = os.path.commonprefix([n.split(".") for n in names])  # type: ignore[type-var]
    return ".".join(prefix[:-1] if len(prefix) == min(len(n.split(".")) for n in names) else prefix)


def _resolve_literals(model: nn.Module, flow, mp: int) -> tuple[dict[str, dict[str, tuple[int, int]]], dict[str, str]]:
    """Find the int attributes holding the fixed sizes attention code reshapes with; names of unfixable sources."""
    adjust: dict[str, dict[str, tuple[int, int]]] = {}
    broken: dict[str, str] = {}
    for src, values in flow.literals.items():
        if not values:
            continue
        owner_name = _owner(model, {src} | flow.partners.get(src, set()))
        owner = model.get_submodule(owner_name) if owner_name else model
        for v in values:
            attrs = [a for a, x in vars(owner).items() if type(x) is int and x == v and not a.startswith("_")]
            if not attrs or v % mp:
                broken[src] = (
                    f"reshapes to a fixed size {v} in '{owner_name or type(model).__name__}'"
                    + (f" (attribute {attrs[0]} not divisible by mp={mp})" if attrs else " held by no attribute")
                    + "; write view(B, T, -1, head_dim) to allow head-parallel attention"
                )
                continue
            adjust.setdefault(owner_name, {}).update({a: (v, v // mp) for a in attrs})
    return adjust, broken


def make_plan(
    model: nn.Module,
    mp: int,
    trace: Optional[Trace] = None,
    user_plan: Optional[Mapping[str, str]] = None,
    level: int = 0,
) -> Plan:
    """Plan every ``nn.Linear`` and ``nn.Embedding`` of ``model`` for an MP width ``mp``.

    Args:
        model: the dense model (module names are those of ``model.named_modules()``).
        mp: tensor-parallel width.
        trace: the recorded data flow of one step (:func:`lightning_dpmp.planner.trace.trace_step`); without it only the
            user plan can pair layers, and every other divisible Linear becomes ``"column_gather"``.
        user_plan: ``{glob: style}`` overrides, e.g. ``{"blocks.*.fc1": "column", "head": "replicate"}``.
        level: 0 = everything; 1 = no attention-like pairs; 2 = no pairs, no vocab splitting (fallbacks).

    Example:
        >>> make_plan(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), mp=2).layers["0"].style
        'column_gather'
    """
    linears = {n: m for n, m in model.named_modules() if is_linear(m)}
    embeddings = {n: m for n, m in model.named_modules() if type(m) is nn.Embedding}
    forced = _user_styles(model, user_plan, mp)
    plan = Plan(mp=mp, traced=trace is not None)
    if mp == 1:
        for n, m in linears.items():
            plan.layers[n] = LayerPlan(n, "replicate", m.in_features, m.out_features, note="mp=1")
        return plan

    # Embeddings: split the token table (the largest, or one tied to an LM head) by vocabulary rows. Decided per
    # weight: modules sharing one weight (T5's shared/encoder.embed_tokens/decoder.embed_tokens) are one table.
    owners = _weight_owners(model)
    direct = set(trace.params.values()) if trace is not None else set()  # weights read outside their modules
    pnames = {id(p): n for n, p in model.named_parameters()}
    largest = max((e.num_embeddings for e in embeddings.values()), default=0)
    emb_split: dict[str, str] = {}
    for names in _groups(embeddings, lambda e: id(e.weight)):
        e = embeddings[names[0]]
        tied_linears = [o for o in owners[id(e.weight)] if o in linears]
        styles = {forced[n] for n in names if n in forced}
        called = trace is None or any(trace.embeddings.get(n, 0) > 0 for n in names)
        plain = all(embeddings[n].max_norm is None and not embeddings[n].sparse and not embeddings[n].scale_grad_by_freq
                    for n in names)
        if "replicate" in styles or level >= 2:
            reason = "user plan" if styles else "fallback"
        elif not called:
            reason = "not called through forward()" + (" (nor any module sharing its weight)" if len(names) > 1 else "")
        elif pnames.get(id(e.weight)) in direct:
            reason = "its weight is also read outside the module (not through forward())"
        elif not plain:
            reason = "max_norm/sparse embeddings stay whole"
        elif e.num_embeddings % mp:
            reason = f"num_embeddings={e.num_embeddings} not divisible by mp={mp}"
        elif "vocab" not in styles and not tied_linears and e.num_embeddings < largest:
            reason = "not the token table (smaller than the largest embedding)"
        else:
            reason = ""
        emb_split.update((n, reason) for n in names)
        for o in tied_linears:  # a Linear sharing this weight can be split only together with it
            if reason:
                forced[o] = "replicate"
    for n, m in linears.items():
        tied = [o for o in owners[id(m.weight)] if o != n]
        if tied and not all(o in embeddings and not emb_split[o] for o in tied):
            if forced.get(n, "replicate") != "replicate":
                raise ValueError(f"plan forces {n!r} to {forced[n]!r}, but its weight is tied to {tied[0]!r}.")
            forced[n] = "replicate"

    calls: dict[str, list[LinearCall]] = {}
    roles: dict[str, str] = {}
    partners: dict[str, set[str]] = {}
    why: dict[str, str] = {}
    blocks: dict[str, int] = {}
    if trace is not None:
        for c in trace.linear_calls():
            calls.setdefault(c.name, []).append(c)
        if level < 2:
            flow = analyse(trace, linears, mp, forced, complex_ok=level == 0)
            plan.adjust, broken = _resolve_literals(model, flow, mp)
            for src, reason in broken.items():  # demote the whole pair group of an unfixable reshape
                for n in {src} | flow.partners.get(src, set()):
                    flow.roles.pop(n, None)
                why[src] = reason
            roles, partners, blocks = flow.roles, flow.partners, flow.blocks
            why = {**flow.why, **why}
        else:
            why = {n: "no pairs (fallback after a failed verification)" for n in linears}
    else:
        roles = {n: s for n, s in forced.items() if s in ("column", "row") and n in linears}

    for n, m in linears.items():
        style, note, parallel_in = roles.get(n), "", True
        own = calls.get(n, [])
        if style in ("column", "row"):
            note = ("-> " if style == "column" else "<- ") + ", ".join(sorted(partners.get(n, ()))) if partners else ""
        elif style == "vocab":
            note = "logits reach only cross_entropy: vocab-parallel loss"
        elif forced.get(n) in ("column_gather", "replicate"):
            tied = [o for o in owners[id(m.weight)] if o != n]
            style, note = forced[n], (f"weight tied to {tied[0]}.weight" if tied else "user plan")
        elif forced.get(n) in ("column", "vocab"):
            style, note = "column_gather", f"user plan said {forced[n]}; its output is not read only by row layers/loss"
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
            n, style, m.in_features, m.out_features, parallel_in, input_requires_grad=requires_grad,
            blocks=blocks.get(n, 1) if style == "column" else 1, note=note,
        )
    aliases = _module_aliases(model)
    for n, e in embeddings.items():
        tied_heads = [o for o in owners[id(e.weight)] if o in linears]
        same = [o for o in owners[id(e.weight)] if o in embeddings and o != n] + aliases.get(n, [])
        split = not emb_split[n] and all(plan.layers[o].style in ("column", "column_gather", "vocab") for o in tied_heads)
        note = emb_split[n] or ("tied to " + ", ".join(tied_heads) if tied_heads else "")
        if not emb_split[n] and not split:
            bad = next(o for o in tied_heads if plan.layers[o].style not in ("column", "column_gather", "vocab"))
            note = f"tied to {bad}, which is {plan.layers[bad].style}"
        if same:
            note = (note + "; " if note else "") + "same weight as " + ", ".join(same)
        plan.layers[n] = LayerPlan(
            n, "vocab" if split else "replicate", e.num_embeddings, e.embedding_dim, kind="embedding", note=note
        )

    # Fan-out: column-style layers that read the same tensor share one entry into the region.
    by_input: dict[int, list[str]] = {}
    for n, lp in plan.layers.items():
        if lp.kind == "linear" and lp.style in ("column", "column_gather", "vocab") and len(calls.get(n, [])) == 1:
            by_input.setdefault(calls[n][0].input, []).append(n)
    for entry, names in enumerate(v for v in by_input.values() if len(v) > 1):
        for n in names:
            plan.layers[n] = replace(plan.layers[n], entry=entry)
    return plan
