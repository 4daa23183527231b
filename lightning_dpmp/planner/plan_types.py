"""The result of planning: :class:`LayerPlan` (one layer's style and sizes) and :class:`Plan` (all of them, their
MP collectives, the printout). :func:`lightning_dpmp.planner.plan.make_plan` makes one; the style objects of
:mod:`lightning_dpmp.planner.styles` give each layer's local shape and collective cost.

Example:
    >>> LayerPlan("fc1", "column", 16, 64).local_shape(mp=4)
    (16, 16)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from lightning_dpmp.parallel.dtensor_params import DTensorParams
from lightning_dpmp.parallel.sharding import Blocks
from lightning_dpmp.planner.styles import CommContext, Style, style_of

__all__ = ["LayerPlan", "Plan", "PlanResult", "block_of"]


@dataclass(frozen=True)
class LayerPlan:
    """How one layer is parallelised.

    Attributes:
        name: fully qualified module name.
        style: one of :data:`STYLES`.
        in_features, out_features: dense sizes (for an embedding: ``num_embeddings``, ``embedding_dim``).
        input_is_parallel: for ``"row"``: the input arrives split (else it is split locally).
        entry: layers with the same non-negative ``entry`` share one input copy (one backward all-reduce).
        entered: for ``"column"``: the input is already inside its region (the output of a ``"partial"`` layer, the
            first factor of a low-rank product): no entry copy, the input gradient stays a partial sum.
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
        mode: for ``"vocab"``: ``(training, grad enabled)`` of the traced call, the one mode in which the logits
            were proven to reach only the loss and so stay split; any other mode gathers them in the layer.
    """

    name: str
    style: str
    in_features: int
    out_features: int
    input_is_parallel: bool = True
    entry: int = -1
    entered: bool = False
    input_requires_grad: bool = True
    blocks: Blocks = 1
    kind: str = "linear"
    note: str = ""
    attention: bool = False
    calls: int = 1  # an embedding's lookups per step (a table shared by aliases may be looked up via each, or none)
    out_dim: int = 0
    gather_weights: bool = False
    mode: tuple[bool, bool] = (True, True)

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
    """How every Linear and Embedding of a model is split, in module order, for an MP width ``mp``.

    ``adjust`` maps a module name to ``{path: (dense value, local value)}``: head counts that attention code
    reshapes with, held by the module as an attribute (``"n_head"``), a field of an object it keeps
    (``"config.n_head"``, a config shared by every layer) or an entry of a container (an einops layer's
    ``"axes_lengths['h']"``), set to the per-rank count while the model is parallel
    (:func:`lightning_dpmp.planner.structure.set_per_rank`).
    """

    mp: int
    layers: dict[str, LayerPlan] = field(default_factory=dict)
    traced: bool = False
    notes: list[str] = field(default_factory=list)
    adjust: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    sequence: Optional[Any] = None  # a lightning_dpmp.planner.sequence.SequencePlan when sequence parallel
    experts: dict[str, Any] = field(default_factory=dict)  # name -> lightning_dpmp.planner.experts_detect.ExpertsSplit
    partial: list[str] = field(default_factory=list)  # whole parameters read inside split regions (partial_params)

    @property
    def partial_params(self) -> list[str]:
        """Parameters whose gradient each MP rank holds a partial sum of, summed over MP once per step: those of
        ``"partial"`` layers, whole parameters read only inside split regions (a q/k norm shared by all heads) and,
        under sequence parallelism, those that saw 1/mp of the tokens."""
        seq = self.sequence.partial_params if self.sequence is not None else []
        return sorted(set(self.partial) | set(seq))

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
            if lp is None or not lp.parallel_style.splits or self.mp == 1:
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
        if self.partial:
            lines.append(f"  partial gradients: {len(self.partial)} whole parameters read inside split regions (a"
                         " low-rank product's first factor, a norm shared by all heads) are summed over MP once per"
                         " step")
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


@dataclass
class PlanResult:
    """The plan applied, its printout, and notes on what was checked or fell back."""

    plan: Plan
    text: str
    verified: Optional[bool] = None
    max_error: float = 0.0
    # Why the parameters a step uses may change from step to step or rank to rank (empty: the traced step used
    # every trainable parameter, with no data-dependent op in forward); the same truth value on every rank.
    conditional: tuple[str, ...] = ()
    branches: tuple[str, ...] = ()  # modules whose forward ran a data-dependent op in the traced step ("": the root)
    # trainable parameters that nothing reaches in any step: no gradient in the traced step, on a rank of a world
    # where no traced step ran a data-dependent op (so the set cannot change); rank 0's, the same on every rank
    unreached: tuple[str, ...] = ()
    # the split module's parameters as DTensors (made to verify the plan on them); None when not distributed here
    params: Optional[DTensorParams] = None
