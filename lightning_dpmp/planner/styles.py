"""Parallel styles as small classes: what one split layer holds, what it costs, and which parallel layer it becomes.

A :class:`~lightning_dpmp.planner.plan.LayerPlan` names its style with a plain string (plans are pickled to every
rank and printed); :func:`style_of` maps ``(kind, style)`` to the one object that knows, for that layer:

* :meth:`Style.local_shape`: the weight shape each rank holds, in the layout the dense layer stores it;
* :meth:`Style.comm`: the MP collectives one call costs in forward + backward (shared entries, sequence parallel);
* :meth:`Style.build`: the parallel layer that replaces the dense one (or, for experts, the in-place shards).

Layouts, as torch's ``ParallelStyle`` comments state them (``mp`` ranks, activations ``(..., features)``):

============================  ================================================================================
``("linear", "column")``      replicated input, output split on the last dim (read by ``"row"`` layers)
``("linear", "column_gather")`` replicated input, output all-gathered: replicated
``("linear", "vocab")``       replicated input, logits split by vocabulary, read only by the vocab-parallel loss
``("linear", "row")``         input split on the last dim (or split locally), output all-reduced: replicated
``("embedding", "vocab")``    rows split: each rank looks up its ids, the partial outputs are all-reduced
``("embedding", "column")``   columns split: the output stays split on the last dim (per-head biases)
``("attention", "heads")``    an ``nn.MultiheadAttention`` computed on ``num_heads / mp`` heads per rank
``("experts", "experts")``    stacked expert weights split along the intermediate dim, in place
``(any kind, "replicate")``   whole on every rank
``("linear", "partial")``     whole, reading a column layer's entry: its gradients are partial sums over MP
============================  ================================================================================

Example:
    >>> from lightning_dpmp.planner.plan_types import LayerPlan
    >>> style_of(LayerPlan("fc1", "column", 16, 64)).local_shape(LayerPlan("fc1", "column", 16, 64), mp=4)
    (16, 16)
    >>> style_of(LayerPlan("fc2", "row", 64, 16)).is_column_entry
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Protocol, TypeVar, Union

from torch import nn

from lightning_dpmp.parallel.attention_layer import HeadParallelMultiheadAttention
from lightning_dpmp.parallel.embeddings import ColumnParallelEmbedding, vocab_parallel
from lightning_dpmp.parallel.entry import GATHERED, SharedInputCopy
from lightning_dpmp.parallel.experts_layer import ExpertsShards, shard_experts
from lightning_dpmp.parallel.layers import ColumnParallelLinear, EnteredLinear, RowParallelLinear
from lightning_dpmp.parallel.sharding import Blocks

__all__ = ["STYLES", "BuildContext", "CommContext", "Comm", "LayerSpec", "Style", "style_of"]


class LayerSpec(Protocol):
    """What a style reads of one layer's plan entry: :class:`~lightning_dpmp.planner.plan_types.LayerPlan` has it.

    A protocol, not the class, so that the plan (``layout``, which asks styles for shapes and collectives) and the
    styles need not import each other.
    """

    # Read-only: plan entries are frozen dataclasses.
    @property
    def name(self) -> str: ...
    @property
    def style(self) -> str: ...
    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def input_is_parallel(self) -> bool: ...
    @property
    def entry(self) -> int: ...
    @property
    def entered(self) -> bool: ...
    @property
    def input_requires_grad(self) -> bool: ...
    @property
    def blocks(self) -> Blocks: ...
    @property
    def kind(self) -> str: ...
    @property
    def calls(self) -> int: ...
    @property
    def out_dim(self) -> int: ...
    @property
    def gather_weights(self) -> bool: ...
    @property
    def mode(self) -> tuple[bool, bool]: ...


    def full_shape(self) -> tuple[int, int]: ...

_M = TypeVar("_M", bound=nn.Module)


def _expect(module: nn.Module, cls: type[_M]) -> _M:
    """``module`` as a ``cls``: a plan that names a style for the wrong kind of module fails here, by name."""
    if not isinstance(module, cls):
        raise TypeError(f"this style builds from an {cls.__name__}, got a {type(module).__name__}")
    return module

STYLES = ("column", "row", "column_gather", "vocab", "experts", "heads", "replicate")  # the names a user plan may use

Comm = tuple[str, str, str]  # (layer, phase, op): one analytic collective


@dataclass
class CommContext:
    """What a style needs to count a layer's collectives: the sequence plan, the entries already paid for, and the
    experts layouts (``Plan.experts``)."""

    sequence: Optional[Any] = None  # a lightning_dpmp.planner.sequence.SequencePlan
    experts: dict[str, Any] = field(default_factory=dict)
    seen_entries: set[int] = field(default_factory=set)

    @property
    def exit_op(self) -> str:
        """How a split result is summed: all-reduce, or reduce-scatter along the sequence under sequence parallel."""
        return "reduce_scatter" if self.sequence is not None else "all_reduce"


@dataclass
class BuildContext:
    """What a style needs to build its parallel layer: the MP group, the dropout RNG tracker, the sequence plan and
    the entry copies made so far (``{entry: SharedInputCopy}``, one per group of layers reading one tensor)."""

    group: Any
    rng: Optional[Any] = None
    sequence: Optional[Any] = None
    experts: dict[str, Any] = field(default_factory=dict)
    entries: dict[int, SharedInputCopy] = field(default_factory=dict)

    @property
    def sequence_out(self) -> Optional[int]:
        """The sequence dim a row/vocab layer reduce-scatters its output along (``None``: all-reduce)."""
        return -2 if self.sequence is not None else None

    def sequence_in(self, name: str) -> Any:
        """How a column layer's input arrives: already gathered by its owner's hook (``GATHERED``), split along the
        sequence (dim ``-2``, all-gathered at the entry) or replicated (``None``)."""
        sp = self.sequence
        if sp is not None and any(name in names for names in sp.owner_gather.values()):
            return GATHERED
        return -2 if sp is not None and name in sp.gather_entries else None

    def entry(self, lp: "LayerSpec", *args: Any) -> Optional[SharedInputCopy]:
        """The input copy ``lp`` shares with its siblings (``None`` for a layer reading its own input)."""
        return self.entries.setdefault(lp.entry, SharedInputCopy(self.group, *args)) if lp.entry >= 0 else None


class Style:
    """One way of splitting one kind of layer. Stateless: one instance per ``(kind, name)`` in the registry."""

    name: ClassVar[str]
    kind: ClassVar[str]
    splits: ClassVar[bool] = True  # the layer holds 1/mp of its weight
    swaps_module: ClassVar[bool] = True  # parallelize builds a layer for it (a whole one may need one too)
    is_column_entry: ClassVar[bool] = False  # reads a replicated input through an entry copy (all-reduce backward)
    in_place: ClassVar[bool] = False  # split without swapping the module (experts keep their class and code)
    swaps_weight: ClassVar[bool] = True  # a new layer with one ``weight`` (ties and module aliases follow it)
    builds_children: ClassVar[bool] = False  # its parallel layer also splits its planned children (out_proj)

    def local_shape(self, lp: "LayerSpec", mp: int) -> tuple[int, int]:
        """The weight shape each rank holds, in the layout of :meth:`LayerPlan.full_shape`."""
        return lp.full_shape()

    def comm(self, lp: "LayerSpec", ctx: CommContext) -> list[Comm]:
        """The MP collectives of one forward + backward of ``lp`` (none: a replicated layer)."""
        return []

    def build(self, dense: nn.Module, lp: "LayerSpec", ctx: BuildContext) -> Union[nn.Module, ExpertsShards]:
        """The parallel layer taking ``dense``'s place (split from its weights)."""
        raise TypeError(f"style {self.name!r} of {lp.name!r} builds no parallel layer")

    def __repr__(self) -> str:
        return f"<style {self.kind}/{self.name}>"


class Replicate(Style):
    """Whole on every rank: no weight split, no collective, nothing swapped."""

    name, kind, splits, swaps_module = "replicate", "linear", False, False


class ReplicateEmbedding(Replicate):
    """A whole embedding; under sequence parallel, one feeding the stream keeps its slice of the sequence (a
    forward hook), whose backward all-gathers the gradient."""

    kind = "embedding"

    def comm(self, lp: "LayerSpec", ctx: CommContext) -> list[Comm]:
        sp = ctx.sequence
        return [(lp.name, "backward", "all_gather")] if sp is not None and lp.name in sp.scatter else []


class _Entry(Style):
    """A layer reading a replicated input: column-like Linears and head-parallel attention.

    Layers sharing one entry (q/k/v reading the same tensor) pay its backward all-reduce once, charged to the first
    of them; under sequence parallel the entry all-gathers the sequence forward and reduce-scatters backward.
    """

    is_column_entry = True
    gather_output: ClassVar[bool] = False  # the output is all-gathered forward

    def local_shape(self, lp: "LayerSpec", mp: int) -> tuple[int, int]:
        out, inp = -(-lp.out_features // mp), lp.in_features  # (ceil: a vocabulary mp does not divide is padded)
        return (out, inp) if lp.out_dim == 0 else (inp, out)

    def comm(self, lp: "LayerSpec", ctx: CommContext) -> list[Comm]:
        out: list[Comm] = []
        # an entered layer's input is already inside the region (the first factor of a low-rank product put it there)
        if not lp.entered and (lp.entry < 0 or lp.entry not in ctx.seen_entries):
            ctx.seen_entries.add(lp.entry)
            seq_split = ctx.sequence is not None and lp.name in ctx.sequence.gather_entries
            if seq_split:
                out.append((lp.name, "forward", "all_gather"))
            if lp.input_requires_grad:
                out.append((lp.name, "backward", "reduce_scatter" if seq_split else "all_reduce"))
        if self.gather_output or lp.gather_weights:  # need_weights: the per-head attention weights are gathered
            out.append((lp.name, "forward", "all_gather"))
        return out


class Column(_Entry):
    """Split by output features; the output stays split until ``"row"`` layers read it (own dropout stream)."""

    name, kind = "column", "linear"
    vocab_logits: ClassVar[bool] = False  # the logits go to the vocab-parallel cross-entropy
    own_dropout: ClassVar[bool] = True  # a column -> row region: its own dropout stream (different masks per rank)

    def build(self, dense: nn.Module, lp: "LayerSpec", ctx: BuildContext) -> nn.Module:
        seq_dim = GATHERED if lp.entered else ctx.sequence_in(lp.name)
        return ColumnParallelLinear.from_dense(
            dense, ctx.group, gather_output=self.gather_output, shared_input=ctx.entry(lp, seq_dim), blocks=lp.blocks,
            vocab_logits=self.vocab_logits, rng=ctx.rng if self.own_dropout else None, sequence_dim=seq_dim,
            out_dim=lp.out_dim, vocab_mode=lp.mode, name=lp.name,
        )


class Partial(_Entry):
    """Whole on every rank, but inside a column layer's region: it reads the entry that layer shares (its input
    gradient joins that entry's all-reduce) and feeds a column layer that takes its output as entered
    (``entered``), so its gradients are partial sums, summed over MP once per step (``Plan.partial_params``). The
    first factor of a low-rank product on a column-parallel base (a LoRA ``A``): no collective of its own."""

    name, kind, splits = "partial", "linear", False

    def local_shape(self, lp: "LayerSpec", mp: int) -> tuple[int, int]:
        return lp.full_shape()

    def build(self, dense: nn.Module, lp: "LayerSpec", ctx: BuildContext) -> nn.Module:
        return EnteredLinear.from_dense(dense, ctx.group, out_dim=lp.out_dim,
                                        shared_input=ctx.entry(lp, ctx.sequence_in(lp.name)))


class ColumnGather(Column):
    """Split by output features, output all-gathered: correct wherever the output goes."""

    name, gather_output, own_dropout = "column_gather", True, False


class Vocab(Column):
    """An LM head split by vocabulary; its logits reach only the vocab-parallel cross-entropy (max, then sums)."""

    name, vocab_logits, own_dropout = "vocab", True, False

    def comm(self, lp: "LayerSpec", ctx: CommContext) -> list[Comm]:
        return super().comm(lp, ctx) + [(lp.name, "forward", "all_reduce")] * 2


class Row(Style):
    """Split by input features; the output is all-reduced (reduce-scattered along the sequence under sequence
    parallel). An input that arrives replicated (``input_is_parallel=False``) is split locally."""

    name, kind = "row", "linear"

    def local_shape(self, lp: "LayerSpec", mp: int) -> tuple[int, int]:
        out, inp = lp.out_features, lp.in_features // mp
        return (out, inp) if lp.out_dim == 0 else (inp, out)

    def comm(self, lp: "LayerSpec", ctx: CommContext) -> list[Comm]:
        out = [(lp.name, "forward", ctx.exit_op)]
        if ctx.sequence is not None:
            out.append((lp.name, "backward", "all_gather"))
        if not lp.input_is_parallel and lp.input_requires_grad:
            out.append((lp.name, "backward", "all_gather"))
        return out

    def build(self, dense: nn.Module, lp: "LayerSpec", ctx: BuildContext) -> nn.Module:
        return RowParallelLinear.from_dense(
            dense, ctx.group, input_is_parallel=lp.input_is_parallel, rng=ctx.rng if ctx.sequence is None else None,
            sequence_dim=ctx.sequence_out, out_dim=lp.out_dim,
        )


class VocabEmbedding(Style):
    """Rows split by vocabulary: each lookup in the traced step (``lp.calls``) all-reduces its partial output."""

    name, kind = "vocab", "embedding"

    def local_shape(self, lp: "LayerSpec", mp: int) -> tuple[int, int]:
        return (-(-lp.in_features // mp), lp.out_features)  # (padded to a multiple of mp)

    def comm(self, lp: "LayerSpec", ctx: CommContext) -> list[Comm]:
        out = [(lp.name, "forward", ctx.exit_op)] * lp.calls
        if ctx.sequence is not None:
            out += [(lp.name, "backward", "all_gather")] * lp.calls
        return out

    def build(self, dense: nn.Module, lp: "LayerSpec", ctx: BuildContext) -> nn.Module:
        return vocab_parallel(_expect(dense, nn.Embedding), ctx.group, sequence_dim=ctx.sequence_out,
                              rng=ctx.rng if ctx.sequence is not None else None)


class ColumnEmbedding(ReplicateEmbedding):
    """Columns split: each rank looks up its heads of a per-head table (a relative position bias); no collective."""

    name, splits, swaps_module = "column", True, True

    def local_shape(self, lp: "LayerSpec", mp: int) -> tuple[int, int]:
        return (lp.in_features, lp.out_features // mp)

    def build(self, dense: nn.Module, lp: "LayerSpec", ctx: BuildContext) -> nn.Module:
        return ColumnParallelEmbedding.from_dense(_expect(dense, nn.Embedding), ctx.group)


class Heads(_Entry):
    """An ``nn.MultiheadAttention`` on its heads: ``in_proj`` split per q/k/v block like a fused column layer, its
    ``out_proj`` (planned as ``"row"``, built here) split by input features."""

    name, kind, swaps_weight, builds_children = "heads", "attention", False, True

    def build(self, dense: nn.Module, lp: "LayerSpec", ctx: BuildContext) -> nn.Module:
        return HeadParallelMultiheadAttention.from_dense(
            _expect(dense, nn.MultiheadAttention), ctx.group, shared_input=ctx.entry(lp), rng=ctx.rng
        )


class Experts(Style):
    """Stacked expert weights split along the intermediate dim, in place: the module keeps its class and code.
    Its output is all-reduced forward; its entered inputs' gradients once backward (if any needs one)."""

    name, kind, in_place, swaps_weight = "experts", "experts", True, False

    def local_shape(self, lp: "LayerSpec", mp: int) -> tuple[int, int]:
        return (lp.out_features // mp, lp.in_features)

    def comm(self, lp: "LayerSpec", ctx: CommContext) -> list[Comm]:
        out = [(lp.name, "forward", "all_reduce")]
        if ctx.experts[lp.name].needs_grad:
            out.append((lp.name, "backward", "all_reduce"))
        return out

    def build(self, dense: nn.Module, lp: "LayerSpec", ctx: BuildContext) -> ExpertsShards:
        """Swap the expert parameters for their shards; the returned handle restores them."""
        lay = ctx.experts[lp.name]
        return shard_experts(dense, lay.shards, lay.entries, ctx.group)


class ReplicateAttention(Replicate):
    """An ``nn.MultiheadAttention`` kept whole (its ``out_proj`` then too)."""

    kind = "attention"


class ReplicateExperts(Replicate):
    """An experts module kept whole, with the reason in its note."""

    kind = "experts"


_REGISTRY: dict[tuple[str, str], Style] = {
    (s.kind, s.name): s
    for s in (Column(), ColumnGather(), Vocab(), Row(), Replicate(), Partial(), VocabEmbedding(), ColumnEmbedding(),
              ReplicateEmbedding(), Heads(), ReplicateAttention(), Experts(), ReplicateExperts())
}


def style_of(lp: "LayerSpec") -> Style:
    """The style object of a planned layer, by its ``(kind, style)``.

    Example:
        >>> from lightning_dpmp.planner.plan_types import LayerPlan
        >>> style_of(LayerPlan("wte", "vocab", 50304, 768, kind="embedding"))
        <style embedding/vocab>
    """
    try:
        return _REGISTRY[(lp.kind, lp.style)]
    except KeyError:
        known = ", ".join(s for k, s in _REGISTRY if k == lp.kind)
        raise ValueError(f"{lp.name!r}: no style {lp.style!r} for a layer of kind {lp.kind!r} ({known})") from None
