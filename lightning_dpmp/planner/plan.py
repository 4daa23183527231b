"""Decide how each ``nn.Linear`` and ``nn.Embedding`` is split, from the recorded data flow of one step.

Styles (the values a user plan may name):

* ``"column"``: split by output features; the output stays split until ``"row"`` layers read it, through
  element-wise ops or head-wise attention (:mod:`lightning_dpmp.planner.flow` says which ops keep it split).
* ``"row"``: split by input features; the output is all-reduced.
* ``"column_gather"``: split by output features, output all-gathered: correct wherever the output goes. The
  default for a Linear that pairs with nothing.
* ``"vocab"``: an LM head split by vocabulary whose logits reach only ``F.cross_entropy`` (computed
  vocab-parallel, full logits never gathered) and that is wider than its input (``out_features > in_features``,
  see :func:`vocab_split_pays`); or an ``nn.Embedding`` split by vocabulary rows. Its logits stay split only in
  the mode of the traced call (``LayerPlan.mode``); in any other mode the layer gathers them in its forward.
* ``"experts"``: a mixture-of-experts module whose stacked expert weights are split along the intermediate dim
  (:mod:`lightning_dpmp.planner.experts_detect`); its routers stay replicated.
* ``"replicate"``: not split: the split dimension is not divisible by ``mp``, the weight is tied to a layer that
  stays whole, or the layer is never called through ``forward()`` (its weight is read directly).
* ``"partial"``: whole, reading a column layer's input inside its region: the first factor ``A`` of a low-rank
  product ``B(A(x))`` added to that column layer's output (a LoRA adapter), whose ``B`` is then ``"column"`` too
  and takes ``A``'s output as entered. Its gradients are partial sums over MP, summed once per step; the pair
  costs no collective (see :func:`_low_rank_products`). Not a style a user plan names.
* ``"heads"``: an ``nn.MultiheadAttention`` computed head-parallel: its ``in_proj`` split per q/k/v block like a
  fused column layer, its ``out_proj`` (listed as ``"row"``) split by input features; self-contained.

"Linear" covers ``nn.Linear`` and linear-like modules found in the traced step by what they compute
(:mod:`lightning_dpmp.planner.linear_like`, e.g. GPT-2's ``Conv1D``); ``LayerPlan.out_dim`` records how such a
layer stores its weight, and it is split in that layout.

Example:
    >>> import torch
    >>> from lightning_dpmp.planner.trace import trace_step
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    >>> run = lambda: model(torch.randn(2, 4)).sum()                   # one step, e.g. lm.training_step(batch, 0)
    >>> plan = make_plan(model, mp=2, trace=trace_step(model, run))
    >>> print(plan.describe(model))
    DPMPStrategy plan for mp=2 (traced one step):
      layer  style   full    local   note
      0      column  (8, 4)  (4, 4)  -> 2
      2      row     (4, 8)  (4, 4)  <- 0
      parameters per rank: 40 of 76 (52.6%); MP collectives per step: forward 1 all-reduce + 0 all-gather, ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from torch import nn

from lightning_dpmp.parallel.sharding import Blocks
from lightning_dpmp.planner.attention_plan import decide_attention
from lightning_dpmp.planner.experts_detect import plan_experts
from lightning_dpmp.planner.flow import analyse
from lightning_dpmp.planner.linear_like import LinearForm, form_of_linear, left_whole
from lightning_dpmp.planner.plan_types import LayerPlan, Plan, block_of
from lightning_dpmp.planner.structure import groups_by, module_aliases, resolve_literals, weight_owners
from lightning_dpmp.planner.styles import STYLES
from lightning_dpmp.planner.trace import LinearCall, Trace, has_own_forward, is_linear
from lightning_dpmp.planner.user_plan import UserPlan, user_styles

# LayerPlan, Plan: planner/plan_types.py
__all__ = ["LayerPlan", "Plan", "STYLES", "block_of", "make_plan", "vocab_split_pays"]


def vocab_split_pays(
    name: str, form: LinearForm, mp: int, calls: list[LinearCall], trace: Optional[Trace]
) -> Optional[str]:
    """``None`` when splitting head ``name`` by vocabulary pays; otherwise why it stays whole (the printout note).

    The rule: split only a head wider than its input, ``out_features > in_features``. Per token, the split adds
    one all-reduce of the ``in_features`` values of the input gradient (plus 4 loss statistics), and saves
    ``(1 - 1/mp) * out_features`` logits and ``(1 - 1/mp) * out_features * in_features`` weights per rank. A head
    no wider than its input (a 10-class classifier on a 128-wide stream) can never save more logits than it sends,
    and its weight is a rounding error next to the blocks: it stays whole and costs no collective at all. An LM
    head (vocabulary >> width) saves the most memory of any layer. ``plan_overrides={name: "vocab"}`` forces the split.
    """
    out_f, in_f = form.out_features, form.in_features
    if out_f > in_f:
        return None
    weights = out_f * in_f + (out_f if form.bias is not None else 0)
    saved = weights - weights // mp
    tokens = 0
    if trace is not None and calls:
        shape = trace.shapes.get(calls[0].input, ())
        tokens = math.prod(shape[:-1]) if shape else 0
    grads = all(c.input_requires_grad for c in calls) if calls else True
    moved = tokens * (in_f * grads + 4)
    traffic = f" moving {moved:,} values per step at the traced batch" if tokens else ""
    return (
        f"kept whole: out_features={out_f} <= in_features={in_f}: a vocab split would save {saved:,} parameters per"
        f" rank for {3 if grads else 2} all-reduces{traffic}; it pays only when out_features > in_features"
        f" (plan_overrides={{{name!r}: 'vocab'}} forces it)"
    )


def make_plan(
    model: nn.Module,
    mp: int,
    trace: Optional[Trace] = None,
    user_plan: UserPlan = None,
    level: int = 0,
) -> Plan:
    """Plan every Linear (``nn.Linear`` or linear-like), ``nn.Embedding`` and ``nn.MultiheadAttention`` of ``model``.

    Args:
        model: the dense model (module names are those of ``model.named_modules()``).
        mp: tensor-parallel width.
        trace: the recorded data flow of one step (:func:`lightning_dpmp.planner.trace.trace_step`); without it only the
            user plan can pair layers, and every other divisible Linear becomes ``"column_gather"``.
        user_plan: ``{glob: style}`` overrides, e.g. ``{"blocks.*.fc1": "column", "head": "replicate"}``, or the
            :class:`~lightning_dpmp.planner.user_plan.PlanOverrides` the strategy parsed them into.
        level: 0 = everything; 1 = no attention-like pairs; 2 = no pairs, no vocab splitting (fallbacks).

    Example:
        >>> make_plan(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), mp=2).layers["0"].style
        'column_gather'
    """
    modules = dict(model.named_modules())
    linears: dict[str, LinearForm] = {n: form_of_linear(m) for n, m in modules.items() if is_linear(m)}
    linears.update(trace.linear_forms if trace is not None else {})  # Conv1D & co, found by what they computed
    linears = {n: linears[n] for n in modules if n in linears}  # module order
    embeddings = {n: m for n, m in modules.items() if isinstance(m, nn.Embedding)}  # subclasses: see below
    forced = user_styles(model, user_plan, mp, linears)
    plan = Plan(mp=mp, traced=trace is not None)
    if mp == 1:
        for n, f in linears.items():
            plan.layers[n] = LayerPlan(n, "replicate", f.in_features, f.out_features, note="mp=1", out_dim=f.out_dim)
        return plan
    fixed = _unsplittable_linear_like(linears, forced)
    owners = weight_owners(model)
    emb_split = _embedding_tables(model, trace, mp, level, linears, embeddings, forced, owners)
    roles = _flow_roles(plan, model, trace, mp, level, linears, embeddings, forced, owners)
    for n, f in linears.items():
        tied = [o for o in owners[id(getattr(modules[n], f.weight))] if o != n]
        plan.layers[n] = _decide_linear(n, f, mp, trace, roles, forced, fixed.get(n), tied)
    if trace is not None:
        _low_rank_products(plan, trace, linears, forced, roles.calls)
    _decide_embeddings(plan, model, trace, linears, embeddings, emb_split, roles, owners)
    if level < 2:  # mixture-of-experts modules (stacked expert weights), and their routers kept replicated
        plan_experts(plan, model, trace, mp, forced)
    attention = decide_attention(model, trace, mp, forced, level)
    _add_attention(plan, model, attention)
    # whole parameters read only inside regions that all stayed split (after every decision: a split layer's or an
    # experts module's own weight read directly is accounted for by that layer)
    for pname, firsts in sorted(roles.partial.items()):
        owner = plan.layers.get(pname.rpartition(".")[0])
        if owner is not None and owner.parallel_style.splits:
            continue
        if all(f in plan.layers and plan.layers[f].style in ("column", "vocab") for f in firsts):
            plan.partial.append(pname)
    if trace is not None:
        plan.notes += left_whole(model, set(plan.layers), {m[0] for m in trace.modules})
    _share_entries(plan, roles.calls, attention)
    return plan


@dataclass
class _Roles:
    """What the flow analysis found: roles, partners, fused blocks, attention layers, reasons, calls per layer."""

    roles: dict[str, str] = field(default_factory=dict)
    partners: dict[str, set[str]] = field(default_factory=dict)
    blocks: dict[str, Blocks] = field(default_factory=dict)
    attention: set[str] = field(default_factory=set)  # column/row layers of attention-like regions
    why: dict[str, str] = field(default_factory=dict)
    calls: dict[str, list[LinearCall]] = field(default_factory=dict)
    partial: dict[str, set[str]] = field(default_factory=dict)  # whole parameter -> first layers of its regions


def _unsplittable_linear_like(linears: Mapping[str, LinearForm], forced: dict[str, str]) -> dict[str, str]:
    """Keep whole (in ``forced``) the linear-like layers whose parameters are not named weight/bias; their notes."""
    fixed: dict[str, str] = {}
    for n, f in linears.items():
        if (f.weight, f.bias) not in (("weight", "bias"), ("weight", None)):
            forced[n], fixed[n] = "replicate", (
                f"linear-like, but its parameters are named {f.weight!r}/{f.bias!r}: only 'weight'/'bias' can be"
                " split under the dense module's state_dict keys"
            )
    return fixed


def _embedding_tables(
    model: nn.Module, trace: Optional[Trace], mp: int, level: int, linears: Mapping[str, LinearForm],
    embeddings: Mapping[str, nn.Embedding], forced: dict[str, str], owners: dict[int, list[str]],
) -> dict[str, str]:
    """Embeddings and ties: why each token table stays whole (``""``: split by rows); Linears tied to a whole one
    are forced whole."""
    # The token table (the largest, or one tied to an LM head) is split by vocabulary rows. Decided per weight:
    # modules sharing one weight (T5's shared/encoder.embed_tokens/decoder.embed_tokens) are one table.
    modules = dict(model.named_modules())
    direct = set(trace.params.values()) if trace is not None else set()  # weights read outside their modules
    pnames = {id(p): n for n, p in model.named_parameters()}
    largest = max((e.num_embeddings for e in embeddings.values()), default=0)
    emb_split: dict[str, str] = {}
    for names in groups_by(embeddings, lambda e: id(e.weight)):
        e = embeddings[names[0]]
        tied_linears = [o for o in owners[id(e.weight)] if o in linears]
        styles = {forced[n] for n in names if n in forced}
        called = trace is None or any(trace.embeddings.get(n, 0) > 0 for n in names)
        subclass = _why_subclass_whole(names, embeddings, trace)
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
        elif subclass:
            reason = subclass
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
    return emb_split


def _why_subclass_whole(names: list[str], embeddings: Mapping[str, nn.Embedding], trace: Optional[Trace]) -> str:
    """Why a table of ``nn.Embedding`` subclasses with a ``forward`` of their own cannot be split by rows (``""``:
    it can). The split class keeps the subclass's code and replaces ``nn.Embedding.forward`` with the vocab-parallel
    lookup, so every lookup of its weight must have gone through ``nn.Embedding.forward`` (``super().forward``)."""
    own = [n for n in names if has_own_forward(embeddings[n])]
    if not own:
        return ""
    if trace is None:
        return f"{type(embeddings[own[0]]).__name__} has a forward of its own, and no step was traced to read it"
    for n in own:
        if "direct" in trace.embedding_lookups.get(n, []):
            return (f"{type(embeddings[n]).__name__}.forward calls F.embedding on its weight itself; only a lookup"
                    " through nn.Embedding.forward (super().forward) can be split by vocabulary")
    return ""


def _flow_roles(
    plan: Plan, model: nn.Module, trace: Optional[Trace], mp: int, level: int, linears: dict[str, LinearForm],
    embeddings: Mapping[str, nn.Embedding], forced: dict[str, str], owners: dict[int, list[str]],
) -> _Roles:
    """Flow roles: pair layers over the traced step (or take the user's column/row); sets ``plan.adjust``."""
    out = _Roles()
    if trace is None:
        out.roles = {n: s for n, s in forced.items() if s in ("column", "row") and n in linears}
        return out
    for c in trace.linear_calls():
        out.calls.setdefault(c.name, []).append(c)
    if level >= 2:
        out.why = {n: "no pairs (fallback after a failed verification)" for n in linears}
        return out
    # column tables are rebuilt as ColumnParallelEmbedding: plain nn.Embedding only (a subclass's code would be lost)
    tables = {n: e for n, e in embeddings.items()
              if type(e) is nn.Embedding and len(owners[id(e.weight)]) == 1 and n not in forced}
    flow = analyse(trace, linears, mp, forced, complex_ok=level == 0, embeddings=tables)
    plan.adjust, broken = resolve_literals(model, flow, mp)
    why: dict[str, str] = {}
    for src, reason in broken.items():  # demote the whole pair group of an unfixable reshape
        for n in {src} | flow.partners.get(src, set()):
            flow.roles.pop(n, None)
        why[src] = reason
    out.roles, out.partners, out.blocks, out.partial = flow.roles, flow.partners, flow.blocks, flow.partial
    out.attention = {n for n, attn in flow.attention.items() if attn}
    out.why = {**flow.why, **why}
    return out


def _decide_linear(
    n: str, f: LinearForm, mp: int, trace: Optional[Trace], found: _Roles, forced: Mapping[str, str],
    fixed: Optional[str], tied: list[str],
) -> LayerPlan:
    """Per-layer decision for one Linear: its flow role, else the user's style, else a self-contained default."""
    style, note, parallel_in = found.roles.get(n), "", True
    own = found.calls.get(n, [])
    partners = found.partners
    if style in ("column", "row"):
        note = ("-> " if style == "column" else "<- ") + ", ".join(sorted(partners.get(n, ()))) if partners else ""
    elif style == "vocab":
        note = "logits reach only cross_entropy: vocab-parallel loss"
        whole = None if forced.get(n) == "vocab" else vocab_split_pays(n, f, mp, own, trace)
        if whole is not None:
            style, note = "replicate", whole
    elif forced.get(n) in ("column_gather", "replicate"):
        style, note = forced[n], fixed or (f"weight tied to {tied[0]}.weight" if tied else "user plan")
    elif forced.get(n) in ("column", "vocab"):
        style, note = "column_gather", f"user plan said {forced[n]}; its output is not read only by row layers/loss"
    elif forced.get(n) == "row":
        style, parallel_in, note = "row", False, "user plan said row; input is replicated, split locally"
    elif trace is not None and not own:
        style, note = "replicate", "not called through forward() in the traced step"
    elif f.out_features % mp == 0 or tied:  # (a head tied to a split token table: its vocabulary is padded)
        style = "column_gather"
        note = "called more than once per step" if len(own) > 1 else found.why.get(n, "")
    else:
        style, note = "replicate", f"out_features={f.out_features} not divisible by mp={mp}"
    requires_grad = all(c.input_requires_grad for c in own) if own else True
    return LayerPlan(
        n, style, f.in_features, f.out_features, parallel_in, input_requires_grad=requires_grad,
        blocks=found.blocks.get(n, 1) if style == "column" else 1, note=note, out_dim=f.out_dim,
        attention=style in ("column", "row") and n in found.attention,
        mode=own[0].mode if style == "vocab" and own else (True, True),
    )


def _low_rank_products(
    plan: Plan, trace: Trace, linears: Mapping[str, LinearForm], forced: Mapping[str, str],
    calls: Mapping[str, list[LinearCall]],
) -> None:
    """Low-rank products follow the layer whose layout surrounds them, with no collective of their own.

    A low-rank product is two Linears called once each, back to back: ``B`` reads ``A``'s output and nothing else
    does, and ``A``'s output is narrower than both outer widths (LoRA's ``lora_B(lora_A(x))``, a factorised
    projection). Found by that data flow, never by names:

    * ``B`` is a column layer (its output joins a column layer ``C``'s region) and ``A`` reads the very tensor ``C``
      reads: ``A`` becomes ``"partial"`` (whole, reading ``C``'s entry) and ``B`` takes ``A``'s output as entered.
      ``A``'s input gradient joins ``C``'s one backward all-reduce and its weight gradient is summed over MP once
      per step. (If ``A`` reads another tensor, a dropout of ``C``'s input, ``A`` stays whole and ``B`` keeps its own
      entry: one all-reduce of ``A``'s narrow output gradient.)
    * ``A`` is a row layer (it reads a split tensor, beside the base row layer): ``B`` reads its replicated narrow
      output and stays whole, instead of splitting a tiny weight and all-gathering a full-width output.
    """
    reads: dict[int, int] = {}
    for ev in trace.events:
        nodes = [ev.input] if isinstance(ev, LinearCall) else [] if ev.name == "size" else list(ev.inputs)
        for node in nodes:
            if node is not None:
                reads[node] = reads.get(node, 0) + 1
    producer = {c[0].output: n for n, c in calls.items() if len(c) == 1}
    column_inputs = {c[0].input: n for n, c in calls.items()
                     if len(c) == 1 and n in plan.layers and plan.layers[n].style == "column"}
    for b, (call_b,) in ((n, c) for n, c in calls.items() if len(c) == 1):
        a = producer.get(call_b.input)
        if a is None or a not in plan.layers or b not in plan.layers or a in forced or b in forced:
            continue
        fa, fb = linears[a], linears[b]
        if reads.get(call_b.input, 0) != 1 or call_b.input in trace.escapes:
            continue
        if not fa.out_features < min(fa.in_features, fb.out_features):
            continue
        la, lb = plan.layers[a], plan.layers[b]
        if lb.style == "column" and la.style in ("column_gather", "replicate"):
            base = column_inputs.get(calls[a][0].input)
            if base is not None and base != b:
                plan.layers[a] = replace(la, style="partial", note=(
                    f"low-rank product into {b}: whole, reads {base}'s entry; gradient summed over MP once per step"))
                plan.layers[b] = replace(lb, entered=True, note=lb.note + f"; input from {a}, already entered")
                plan.partial.extend(f"{a}.{p}" for p in (fa.weight, fa.bias) if p is not None)
            elif la.style == "column_gather":
                plan.layers[a] = replace(la, style="replicate", note=(
                    f"low-rank product into {b}: whole; {b}'s entry sums its {fa.out_features}-wide input gradient"))
        elif la.style == "row" and lb.style in ("column_gather", "replicate"):
            plan.layers[b] = replace(lb, style="replicate", note=(
                f"low-rank product after {a} (row): reads its {fa.out_features}-wide replicated output; whole, no"
                " collective"))


def _decide_embeddings(
    plan: Plan, model: nn.Module, trace: Optional[Trace], linears: Mapping[str, LinearForm],
    embeddings: Mapping[str, nn.Embedding], emb_split: Mapping[str, str], found: _Roles, owners: dict[int, list[str]],
) -> None:
    """Embedding decisions: a column table feeding head-parallel attention, else vocab rows if its ties allow."""
    aliases = module_aliases(model)
    for n, e in embeddings.items():
        if found.roles.get(n) == "column":  # its rows reach head-parallel attention: each rank looks up its heads
            partner = ", ".join(sorted(found.partners.get(n, ())))
            plan.layers[n] = LayerPlan(
                n, "column", e.num_embeddings, e.embedding_dim, kind="embedding", note=f"-> {partner}",
                attention=n in found.attention,
            )
            continue
        tied_heads = [o for o in owners[id(e.weight)] if o in linears]
        same = [o for o in owners[id(e.weight)] if o in embeddings and o != n] + aliases.get(n, [])
        # a table tied to LM heads is split by rows only if every head is split by output features (its rows)
        whole = [o for o in tied_heads if not plan.layers[o].parallel_style.is_column_entry]
        split = not emb_split[n] and not whole
        note = emb_split[n] or ("tied to " + ", ".join(tied_heads) if tied_heads else "")
        if not emb_split[n] and not split:
            note = f"tied to {whole[0]}, which is {plan.layers[whole[0]].style}"
        if same:
            note = (note + "; " if note else "") + "same weight as " + ", ".join(same)
        plan.layers[n] = LayerPlan(
            n, "vocab" if split else "replicate", e.num_embeddings, e.embedding_dim, kind="embedding", note=note,
            calls=trace.embeddings.get(n, 0) if trace is not None else 1,
        )


def _share_entries(plan: Plan, calls: Mapping[str, list[LinearCall]], attention: Mapping[str, Any]) -> None:
    """Fan-out entries: column-style layers (and head-parallel attention) that read the same tensor share one."""
    by_input: dict[int, list[str]] = {}
    for n, lp in plan.layers.items():
        if lp.kind == "linear" and lp.parallel_style.is_column_entry and len(calls.get(n, [])) == 1:
            by_input.setdefault(calls[n][0].input, []).append(n)
        elif lp.style == "heads" and attention[n].input is not None:
            by_input.setdefault(attention[n].input, []).append(n)
    for entry, names in enumerate(v for v in by_input.values() if len(v) > 1):
        for n in names:
            plan.layers[n] = replace(plan.layers[n], entry=entry)


def _add_attention(plan: Plan, model: nn.Module, decisions: Mapping[str, Any]) -> None:
    """Insert one entry per ``nn.MultiheadAttention`` (right before its ``out_proj``) and restyle that out_proj."""
    extra: dict[str, LayerPlan] = {}
    for name, d in decisions.items():
        mha = model.get_submodule(name)
        assert isinstance(mha, nn.MultiheadAttention), name
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
