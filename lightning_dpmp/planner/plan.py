"""Decide how each ``nn.Linear`` and ``nn.Embedding`` is split, from the recorded data flow of one step.

Styles (the values a user plan may name):

* ``"column"``: split by output features; the output stays split until ``"row"`` layers read it, through
  element-wise ops or head-wise attention (:mod:`lightning_dpmp.planner.flow` says which ops keep it split).
* ``"row"``: split by input features; the output is all-reduced.
* ``"column_gather"``: split by output features, output all-gathered: correct wherever the output goes. The
  default for a Linear that pairs with nothing.
* ``"vocab"``: an LM head split by vocabulary whose logits reach only ``F.cross_entropy`` (computed
  vocab-parallel, full logits never gathered); or an ``nn.Embedding`` split by vocabulary rows.
* ``"experts"``: a mixture-of-experts module whose stacked expert weights are split along the intermediate dim
  (:mod:`lightning_dpmp.planner.experts`); its routers stay replicated.
* ``"replicate"``: not split: the split dimension is not divisible by ``mp``, the weight is tied to a layer that
  stays whole, or the layer is never called through ``forward()`` (its weight is read directly).
* ``"heads"``: an ``nn.MultiheadAttention`` computed head-parallel: its ``in_proj`` split per q/k/v block like a
  fused column layer, its ``out_proj`` (listed as ``"row"``) split by input features; self-contained.

"Linear" covers ``nn.Linear`` and linear-like modules found in the traced step by what they compute
(:mod:`lightning_dpmp.planner.linear_like`, e.g. GPT-2's ``Conv1D``); ``LayerPlan.out_dim`` records how such a
layer stores its weight, and it is split in that layout.

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

from lightning_dpmp.planner.experts import plan_experts
from lightning_dpmp.planner.attention import decide_attention
from lightning_dpmp.planner.flow import analyse
from lightning_dpmp.planner.linear_like import LinearForm, form_of_linear, left_whole
from lightning_dpmp.planner.styles import STYLES, CommContext, Style, style_of
from lightning_dpmp.planner.trace import LinearCall, Trace, is_linear

__all__ = ["LayerPlan", "Plan", "STYLES", "block_of", "make_plan"]


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
        kind: ``"linear"``, ``"embedding"``, ``"experts"`` (in/out: hidden and intermediate width of one expert) or
            ``"attention"`` (an ``nn.MultiheadAttention``: ``in_features`` is ``embed_dim``, ``out_features`` the
            ``3 * embed_dim`` rows of ``in_proj_weight``).
        note: why this style, for the printout.
        attention: a column/row layer of a head-parallel (attention-like) region.
        calls: for an embedding, its lookups in the traced step (each vocab-parallel lookup all-reduces once).
        out_dim: dim of the stored weight holding the output features: 0 for ``(out, in)`` (``nn.Linear``), 1 for
            ``(in, out)`` (``Conv1D``).
        gather_weights: an attention whose averaged weights are returned (``need_weights=True``).
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
    attention: bool = False
    calls: int = 1  # an embedding's lookups per step (a table shared by aliases may be looked up via each, or none)
    out_dim: int = 0
    gather_weights: bool = False

    def full_shape(self) -> tuple[int, int]:
        """Dense weight shape as stored: ``(out, in)`` or ``(in, out)`` of a Linear, ``(rows, dim)`` of an embedding."""
        if self.kind == "embedding":
            return (self.in_features, self.out_features)
        return (self.out_features, self.in_features) if self.out_dim == 0 else (self.in_features, self.out_features)

    @property
    def parallel_style(self) -> Style:
        """The style object (:mod:`lightning_dpmp.planner.styles`) of this layer's ``(kind, style)``."""
        return style_of(self)

    def local_shape(self, mp: int) -> tuple[int, int]:
        """Local weight shape, in the same layout as :meth:`full_shape`."""
        return style_of(self).local_shape(self, mp)


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
    experts: dict[str, Any] = field(default_factory=dict)  # name -> lightning_dpmp.planner.experts.ExpertsLayout

    def layer_comm(self) -> list[tuple[str, str, str]]:
        """Every analytic MP collective of one forward + backward as ``(layer, phase, op)``, one call per layer.

        Without sequence parallelism: all-reduce and all-gather; with it, every entry all-gathers the sequence
        forward and reduce-scatters backward, every exit reduce-scatters forward. Column layers sharing one entry
        (q/k/v reading the same tensor) pay its backward all-reduce once, charged to the first of them.
        """
        if self.mp == 1:
            return []
        ctx = CommContext(sequence=self.sequence, experts=self.experts)
        return [c for lp in self.layers.values() for c in style_of(lp).comm(lp, ctx)]

    def comm_per_step(self) -> dict[str, dict[str, int]]:
        """Analytic MP collectives of one forward + backward (clipping's all-reduce excluded), by phase and op."""
        ops = ("all_reduce", "all_gather") + (("reduce_scatter",) if self.sequence is not None else ())
        totals = {phase: dict.fromkeys(ops, 0) for phase in ("forward", "backward")}
        for _, phase, op in self.layer_comm():
            totals[phase][op] += 1
        return totals

    def per_block(self) -> dict[str, dict[str, Any]]:
        """Per repeated block (the module path up to its first numeric index, e.g. ``model.layers.3``): its
        layers, whether its attention is head-parallel, and its MP collectives by phase and op."""
        ops = ("all_reduce", "all_gather") + (("reduce_scatter",) if self.sequence is not None else ())
        blocks: dict[str, dict[str, Any]] = {}
        for lp in self.layers.values():
            block = block_of(lp.name)
            if block:
                entry = blocks.setdefault(block, {
                    "layers": [], "head_parallel": False, "attention_gathered": False,
                    "forward": dict.fromkeys(ops, 0), "backward": dict.fromkeys(ops, 0),
                })
                entry["layers"].append(lp.name)
                entry["head_parallel"] |= (lp.attention and lp.style in ("column", "row")) or lp.style == "heads"
        for name, phase, op in self.layer_comm():
            block = block_of(name)
            if block in blocks:
                blocks[block][phase][op] += 1
        return blocks

    def _block_lines(self) -> list[str]:
        """One line per run of blocks alike: attention layout and collectives per block."""

        def fmt(d: dict[str, int]) -> str:
            return " + ".join(f"{n} {k.replace('_', '-')}" for k, n in d.items() if n) or "none"

        def describe(b: dict[str, Any]) -> str:
            has_attn = any(self.layers[n].attention or self.layers[n].kind == "attention" for n in b["layers"])
            attn = "attention head-parallel" if b["head_parallel"] else "no head-parallel attention"
            if not has_attn and all(self.layers[n].style in ("column", "row", "experts", "heads") for n in b["layers"]):
                attn = "split (no attention found)"
            return f"{attn}; MP collectives per block: forward {fmt(b['forward'])}, backward {fmt(b['backward'])}"

        runs: list[tuple[list[str], str]] = []
        for name, b in self.per_block().items():
            text = describe(b)
            if runs and runs[-1][1] == text and name.rsplit(".", 1)[0] == runs[-1][0][0].rsplit(".", 1)[0]:
                runs[-1][0].append(name)
            else:
                runs.append(([name], text))
        out = []
        for names, text in runs:
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1].rsplit('.', 1)[1]} ({len(names)} blocks)"
            out.append(f"  blocks {span}: {text}")
        return out

    def param_counts(self, model: nn.Module) -> tuple[int, int]:
        """(parameters held per rank, parameters of the dense model) for ``model`` in its dense form."""
        total = sum(p.numel() for p in model.parameters())
        saved, seen = 0, set()
        for name, mod in model.named_modules():
            lp = self.layers.get(name)
            if lp is not None and lp.style == "experts" and self.mp > 1:
                saved += self.experts[name].saved(mod, self.mp)
                continue
            if lp is None or lp.style == "replicate" or self.mp == 1:
                continue
            if lp.kind == "attention":  # out_proj has its own "row" entry
                split = [mod.in_proj_weight, mod.in_proj_bias]
            else:
                split = [mod.weight] + ([getattr(mod, "bias", None)] if lp.style != "row" else [])
            for p in split:
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    saved += p.numel() - p.numel() // self.mp
        return total - saved, total

    def describe(self, model: nn.Module) -> str:
        """A table, one line per layer (name, style, full shape -> local shape, note), and per-rank totals."""
        rows = [("layer", "style", "full", "local", "note")]
        for lp in self.layers.values():
            style = lp.style + ("(emb)" if lp.kind == "embedding" else "")
            rows.append((lp.name, style, str(lp.full_shape()), str(lp.local_shape(self.mp)), lp.note))
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
        lines.extend(self._block_lines())
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


def block_of(name: str) -> str:
    """The repeated block a module belongs to: its path up to the first numeric index (``""`` for none)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _user_styles(
    model: nn.Module, user_plan: Optional[Mapping[str, str]], mp: int, forms: Mapping[str, LinearForm]
) -> dict[str, str]:
    """Resolve glob patterns to {layer name: style}; the first pattern that matches a name wins."""
    forced: dict[str, str] = {}
    if not user_plan:
        return forced
    modules = dict(model.named_modules())
    inside_mha = {f"{n}.{c}" for n, m in modules.items() if isinstance(m, nn.MultiheadAttention) for c, _ in m.named_children()}
    for pattern, style in user_plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style; choose one of {', '.join(STYLES)}.")
        matched = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            warnings.warn(f"DPMPStrategy plan pattern {pattern!r} matches no module of {type(model).__name__}.")
        layers = [n for n in matched if n in forms or type(modules[n]) is nn.Embedding
                  or isinstance(modules[n], nn.MultiheadAttention)]
        stacked = [n for n in matched if n not in layers and any(p.dim() >= 3 for p in modules[n].parameters(False))]
        for name in stacked if style in ("experts", "replicate") else ():  # experts modules (planner/experts.py)
            forced.setdefault(name, style)
        if style == "experts":
            if not stacked:
                raise ValueError(f"plan[{pattern!r}] = 'experts' matches no module holding stacked (3-D) expert weights.")
            continue
        if matched and not layers and not stacked:
            mod = modules[matched[0]]
            raise ValueError(
                f"plan[{pattern!r}] = {style!r} matches {matched[0]!r}, a {type(mod).__name__}, and no nn.Linear,"
                " linear-like layer, nn.Embedding or nn.MultiheadAttention; only those layers can be given a style."
            )
        for name in layers:  # a glob like 'blocks.*' may also match norms and containers: those are skipped
            mod = modules[name]
            if isinstance(mod, nn.MultiheadAttention):
                if style not in ("heads", "replicate"):
                    raise ValueError(f"plan gives the nn.MultiheadAttention {name!r} style {style!r}; use 'heads' or 'replicate'.")
                forced.setdefault(name, style)
                continue
            if name in inside_mha:
                if fnmatch.fnmatchcase(name.rpartition(".")[0], pattern):
                    continue  # 'blocks.*' matched the attention too: its out_proj follows the attention
                raise ValueError(
                    f"plan gives {name!r} style {style!r}, but F.multi_head_attention_forward reads its weight without"
                    f" calling it; style the nn.MultiheadAttention {name.rpartition('.')[0]!r} ('heads' or 'replicate')."
                )
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
            if style == "heads":
                raise ValueError(f"plan gives {name!r} style 'heads', which is for nn.MultiheadAttention only.")
            forced.setdefault(name, style)
            f = forms[name]
            if style in ("column", "column_gather", "vocab") and f.out_features % mp:
                raise ValueError(
                    f"plan forces {name!r} to {style!r}, but its out_features={f.out_features} is not divisible by"
                    f" mp={mp}. Use 'replicate' for it, or an mp that divides {f.out_features}."
                )
            if style == "row" and f.in_features % mp:
                raise ValueError(
                    f"plan forces {name!r} to 'row', but its in_features={f.in_features} is not divisible by"
                    f" mp={mp}. Use 'replicate' for it, or an mp that divides {f.in_features}."
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
    for src, scoped in getattr(flow, "scoped", {}).items():
        for scope, v, derived in scoped:  # a constant made in `scope` (zeros((1, self.n_heads, T, S))): its
            found = _attr_up(model, scope, v)  # module's attribute, or the nearest enclosing one's, holds the size
            if found is None and derived:
                continue  # the size was read off a split tensor (q.shape[1]): per-rank at run time by itself
            if found is None or v % mp:
                broken[src] = (
                    f"a constant tensor made in '{scope}' spans the split heads with size {v}"
                    + (f", not divisible by mp={mp}" if found else ", held by no attribute")
                )
                continue
            module_name, attrs = found
            adjust.setdefault(module_name, {}).update({a: (v, v // mp) for a in attrs})
    return adjust, broken


def _attr_up(model: nn.Module, scope: str, value: int) -> Optional[tuple[str, list[str]]]:
    """The innermost module on the path to ``scope`` with public int attributes equal to ``value``."""
    parts = scope.split(".") if scope else []
    for k in range(len(parts), -1, -1):
        name = ".".join(parts[:k])
        module = model.get_submodule(name) if name else model
        attrs = [a for a, x in vars(module).items() if type(x) is int and x == value and not a.startswith("_")]
        if attrs:
            return name, attrs
    return None


def make_plan(
    model: nn.Module,
    mp: int,
    trace: Optional[Trace] = None,
    user_plan: Optional[Mapping[str, str]] = None,
    level: int = 0,
) -> Plan:
    """Plan every Linear (``nn.Linear`` or linear-like), ``nn.Embedding`` and ``nn.MultiheadAttention`` of ``model``.

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
    modules = dict(model.named_modules())
    linears: dict[str, LinearForm] = {n: form_of_linear(m) for n, m in modules.items() if is_linear(m)}
    linears.update(trace.linear_forms if trace is not None else {})  # Conv1D & co, found by what they computed
    linears = {n: linears[n] for n in modules if n in linears}  # module order
    embeddings = {n: m for n, m in modules.items() if type(m) is nn.Embedding}
    forced = _user_styles(model, user_plan, mp, linears)
    plan = Plan(mp=mp, traced=trace is not None)
    if mp == 1:
        for n, f in linears.items():
            plan.layers[n] = LayerPlan(n, "replicate", f.in_features, f.out_features, note="mp=1", out_dim=f.out_dim)
        return plan
    fixed: dict[str, str] = {}  # layers kept whole for a reason of their own
    for n, f in linears.items():
        if (f.weight, f.bias) not in (("weight", "bias"), ("weight", None)):
            forced[n], fixed[n] = "replicate", (
                f"linear-like, but its parameters are named {f.weight!r}/{f.bias!r}: only 'weight'/'bias' can be"
                " split under the dense module's state_dict keys"
            )

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
    for n, f in linears.items():
        tied = [o for o in owners[id(getattr(modules[n], f.weight))] if o != n]
        if tied and not all(o in embeddings and not emb_split[o] for o in tied):
            if forced.get(n, "replicate") != "replicate":
                raise ValueError(f"plan forces {n!r} to {forced[n]!r}, but its weight is tied to {tied[0]!r}.")
            forced[n] = "replicate"

    calls: dict[str, list[LinearCall]] = {}
    attn_layers: set[str] = set()  # column/row layers of attention-like regions
    roles: dict[str, str] = {}
    partners: dict[str, set[str]] = {}
    why: dict[str, str] = {}
    blocks: dict[str, int] = {}
    if trace is not None:
        for c in trace.linear_calls():
            calls.setdefault(c.name, []).append(c)
        if level < 2:
            tables = {n: e for n, e in embeddings.items() if len(owners[id(e.weight)]) == 1 and n not in forced}
            flow = analyse(trace, linears, mp, forced, complex_ok=level == 0, embeddings=tables)
            plan.adjust, broken = _resolve_literals(model, flow, mp)
            for src, reason in broken.items():  # demote the whole pair group of an unfixable reshape
                for n in {src} | flow.partners.get(src, set()):
                    flow.roles.pop(n, None)
                why[src] = reason
            roles, partners, blocks = flow.roles, flow.partners, flow.blocks
            attn_layers = {n for n, attn in flow.attention.items() if attn}
            why = {**flow.why, **why}
        else:
            why = {n: "no pairs (fallback after a failed verification)" for n in linears}
    else:
        roles = {n: s for n, s in forced.items() if s in ("column", "row") and n in linears}

    for n, f in linears.items():
        style, note, parallel_in = roles.get(n), "", True
        own = calls.get(n, [])
        if style in ("column", "row"):
            note = ("-> " if style == "column" else "<- ") + ", ".join(sorted(partners.get(n, ()))) if partners else ""
        elif style == "vocab":
            note = "logits reach only cross_entropy: vocab-parallel loss"
        elif forced.get(n) in ("column_gather", "replicate"):
            tied = [o for o in owners[id(getattr(modules[n], f.weight))] if o != n]
            style, note = forced[n], fixed.get(n) or (f"weight tied to {tied[0]}.weight" if tied else "user plan")
        elif forced.get(n) in ("column", "vocab"):
            style, note = "column_gather", f"user plan said {forced[n]}; its output is not read only by row layers/loss"
        elif forced.get(n) == "row":
            style, parallel_in, note = "row", False, "user plan said row; input is replicated, split locally"
        elif trace is not None and not own:
            style, note = "replicate", "not called through forward() in the traced step"
        elif f.out_features % mp == 0:
            style = "column_gather"
            note = "called more than once per step" if len(own) > 1 else why.get(n, "")
        else:
            style, note = "replicate", f"out_features={f.out_features} not divisible by mp={mp}"
        requires_grad = all(c.input_requires_grad for c in own) if own else True
        plan.layers[n] = LayerPlan(
            n, style, f.in_features, f.out_features, parallel_in, input_requires_grad=requires_grad,
            blocks=blocks.get(n, 1) if style == "column" else 1, note=note, out_dim=f.out_dim,
            attention=style in ("column", "row") and n in attn_layers,
        )
    aliases = _module_aliases(model)
    for n, e in embeddings.items():
        if roles.get(n) == "column":  # its rows reach head-parallel attention: each rank looks up its heads
            partner = ", ".join(sorted(partners.get(n, ())))
            plan.layers[n] = LayerPlan(
                n, "column", e.num_embeddings, e.embedding_dim, kind="embedding", note=f"-> {partner}",
                attention=n in attn_layers,
            )
            continue
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
            n, "vocab" if split else "replicate", e.num_embeddings, e.embedding_dim, kind="embedding", note=note,
            calls=trace.embeddings.get(n, 0) if trace is not None else 1,
        )

    if level < 2:  # mixture-of-experts modules (stacked expert weights), and their routers kept replicated
        plan_experts(plan, model, trace, mp, forced)
    attention = decide_attention(model, trace, mp, forced, level)
    _add_attention(plan, model, attention)
    if trace is not None:
        plan.notes += left_whole(model, set(plan.layers), {m[0] for m in trace.modules})

    # Fan-out: column-style layers (and head-parallel attention) that read the same tensor share one entry.
    by_input: dict[int, list[str]] = {}
    for n, lp in plan.layers.items():
        if lp.kind == "linear" and lp.style in ("column", "column_gather", "vocab") and len(calls.get(n, [])) == 1:
            by_input.setdefault(calls[n][0].input, []).append(n)
        elif lp.style == "heads" and attention[n].input is not None:
            by_input.setdefault(attention[n].input, []).append(n)  # type: ignore[arg-type]
    for entry, names in enumerate(v for v in by_input.values() if len(v) > 1):
        for n in names:
            plan.layers[n] = replace(plan.layers[n], entry=entry)
    return plan


def _add_attention(plan: Plan, model: nn.Module, decisions: Mapping[str, Any]) -> None:
    """Insert one entry per ``nn.MultiheadAttention`` (right before its ``out_proj``) and restyle that out_proj."""
    extra: dict[str, LayerPlan] = {}
    for name, d in decisions.items():
        mha = model.get_submodule(name)
        e = mha.embed_dim
        heads = d.style == "heads"
        extra[name] = LayerPlan(
            name, d.style, e, 3 * e, input_requires_grad=d.input_requires_grad, blocks=3 if heads else 1,
            kind="attention", note=d.note, gather_weights=heads and d.gather_weights,
        )
        out = f"{name}.out_proj" if name else "out_proj"
        if out in plan.layers:
            note = f"<- heads of {name}" if heads else f"read inside {name}, which stays whole"
            plan.layers[out] = replace(plan.layers[out], style="row" if heads else "replicate", note=note,
                                       input_is_parallel=True)
    if not extra:
        return
    layers: dict[str, LayerPlan] = {}
    for n, lp in plan.layers.items():
        owner = n.rpartition(".")[0]
        if owner in extra:
            layers[owner] = extra.pop(owner)
        layers[n] = lp
    layers.update(extra)
    plan.layers = layers
