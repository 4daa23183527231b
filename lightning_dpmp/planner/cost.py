"""The cost of a traced model's plan at each (dp, mp) of a fixed world, and the measured link figures (:class:`Links`).

``DPMPStrategy(mp="auto")`` ranked layouts with it until issue 44 item 3; the setup-time choice now ranks with the
layout estimator (:mod:`lightning_dpmp.planner.layout_search`), which keeps using :func:`ring_s`,
:data:`BUCKET_BYTES` and :class:`Links` from here (as does :mod:`lightning_dpmp.tools.costmodel`).

:mod:`lightning_dpmp.tools.costmodel` predicts a GPT of a given *shape* at a fixed *global* batch. At setup the
strategy knows more and less: it has the traced step (every Linear's sizes, the tokens each one read, the MP
collectives each plan issues: :meth:`~lightning_dpmp.planner.plan_types.Plan.layer_comm`), and the batch the
dataloader hands each rank is fixed, so the global batch is ``dp`` times it. Layouts are therefore ranked by
predicted **tokens per second** (equivalently, time per sample), with the same formulas as the GPT model:

* compute: ``2 * tokens * in * out`` FLOPs per Linear call forward, twice that backward; split layers ``/ mp``;
* MP: every collective of the plan, ring cost ``2 (mp-1)/mp * bytes / bw + 2 (mp-1) * latency`` for an
  all-reduce (half the bytes term for an all-gather or reduce-scatter); an activation of ``tokens x width``;
* DP: one ring all-reduce of the local gradients over ``dp`` ranks per optimizer step, in 25 MiB buckets, exposed
  only where it exceeds the last micro-batch's backward (DDP overlaps it);
* optimizer: AdamW reads and writes ~7 words per local parameter, at the memory bandwidth;
* memory: weights, gradients and two AdamW moments of the local parameters (activations are not counted).

Ties go to the smaller ``mp`` (fewer collectives for the same prediction), as in the GPT model.

Example:
    >>> links = Links(intra_bw=1e10, intra_latency=1e-5, flops=1e11, mem_bw=1e10)
    >>> model = ModelCost(tokens=512, split_matmul=1_000_000, replicated_matmul=0, split_params=1_000_000,
    ...                   replicated_params=1000, mp_collectives=[("forward", "all_reduce", 512 * 256)] * 4)
    >>> rows = rank_layouts([predict_layout({1: model, 2: model, 4: model}[mp], links, 4 // mp, mp, 4)
    ...                      for mp in (1, 2, 4)])
    >>> (rows[0].dp, rows[0].mp)
    (4, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from lightning_dpmp.planner.plan_types import Plan
from lightning_dpmp.planner.trace import Trace

__all__ = ["Links", "LayoutCost", "ModelCost", "format_table", "model_cost", "predict_layout", "rank_layouts",
           "ring_s"]

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


@dataclass(frozen=True)
class Links:
    """Measured (or given) figures of the machine, per device.

    Args:
        intra_bw: collective bandwidth inside a node, bytes/s (NCCL's "bus bandwidth" convention: a ring
            all-reduce of ``b`` bytes over ``n`` ranks takes ``2 (n-1)/n * b / bw``).
        intra_latency: seconds per ring step inside a node.
        flops: FLOP/s one device sustains on a matmul in the training dtype.
        mem_bw: device memory bandwidth, bytes/s (for the optimizer step).
        inter_bw, inter_latency: the same across nodes; the intra figures when ``None`` (one node).
        memory_bytes: memory per device; ``None`` = not checked (CPU).
    """

    intra_bw: float
    intra_latency: float
    flops: float
    mem_bw: float
    inter_bw: Optional[float] = None
    inter_latency: Optional[float] = None
    memory_bytes: Optional[float] = None

    def link(self, inside_node: bool) -> tuple[float, float]:
        """``(bandwidth, latency)`` of the intra-node link, or of the inter-node one."""
        if inside_node or self.inter_bw is None:
            return self.intra_bw, self.intra_latency
        return self.inter_bw, self.inter_latency if self.inter_latency is not None else self.intra_latency


@dataclass(frozen=True)
class ModelCost:
    """What one plan of the traced model costs per micro-batch on one rank (independent of ``dp``).

    Attributes:
        tokens: rows one Linear call reads per micro-batch (product of its input's leading dims; the largest seen).
        split_matmul: weight elements of the layers the plan splits over MP (dense sizes), times their calls.
        replicated_matmul: the same for the layers every rank computes whole.
        split_params, replicated_params: parameters split over MP (dense count) and held whole.
        mp_collectives: ``(phase, op, bytes)`` of every MP collective of one forward + backward.
        note: why this mp could not be planned (then the layout is not a candidate).
    """

    tokens: int
    split_matmul: int
    replicated_matmul: int
    split_params: int
    replicated_params: int
    mp_collectives: list[tuple[str, str, int]] = field(default_factory=list)
    note: str = ""


@dataclass
class LayoutCost:
    """The prediction for one ``(dp, mp)``; seconds per optimizer step, bytes per rank."""

    dp: int
    mp: int
    compute_s: float
    mp_comm_s: float
    dp_exposed_s: float
    optimizer_s: float
    step_s: float
    tokens_per_s: float
    mp_bytes: int
    dp_bytes: int
    memory_bytes: int
    fits: bool = True
    notes: list[str] = field(default_factory=list)


def model_cost(module: nn.Module, plan: Plan, trace: Trace, elem_bytes: int = 4) -> ModelCost:
    """The :class:`ModelCost` of ``plan`` (made at ``plan.mp`` for ``module``) from the traced step ``trace``.

    Each Linear's rows are the tokens its traced call read; a layer not seen as a Linear call (an attention's
    packed projection, experts) is charged the largest token count seen. An MP collective moves the layer's input
    width backward and its output width forward (``tokens x width`` elements); the vocab-parallel loss's two
    forward all-reduces move one float32 per token.
    """
    rows: dict[str, int] = {}
    for call in trace.linear_calls():
        shape = trace.shapes.get(call.input, ())
        rows[call.name] = rows.get(call.name, 0) + math.prod(shape[:-1]) if shape else rows.get(call.name, 0)
    tokens = max(rows.values(), default=1) or 1
    split_mm = rep_mm = 0.0
    for name, lp in plan.layers.items():
        if lp.kind == "embedding":
            continue  # a lookup, no matmul
        work = rows.get(name, tokens) / tokens * lp.in_features * lp.out_features
        if not lp.parallel_style.splits or plan.mp == 1:
            rep_mm += work
        else:
            split_mm += work
    per_rank, total = plan.param_counts(module)
    split = round((total - per_rank) * plan.mp / (plan.mp - 1)) if plan.mp > 1 else 0
    collectives = []
    for name, phase, op in plan.layer_comm():
        lp = plan.layers[name]
        n = rows.get(name, tokens)
        if lp.style == "vocab" and phase == "forward" and op == "all_reduce":
            collectives.append((phase, op, n * 4))
        else:
            collectives.append((phase, op, n * (lp.in_features if phase == "backward" else lp.out_features)
                                * elem_bytes))
    return ModelCost(tokens=tokens, split_matmul=int(split_mm), replicated_matmul=int(rep_mm), split_params=split,
                     replicated_params=total - split, mp_collectives=collectives)


def ring_s(nbytes: float, n: int, bw: float, latency: float, op: str = "all_reduce") -> float:
    """Seconds of one ring collective of ``nbytes`` (the full tensor) over ``n`` ranks.

    Example:
        >>> ring_s(1e6, 2, bw=1e9, latency=0.0)   # all-reduce: 2 (n-1)/n * bytes / bw
        0.001
    """
    if n <= 1:
        return 0.0
    factor = 2.0 if op == "all_reduce" else 1.0  # all-gather / reduce-scatter move half an all-reduce's bytes
    return factor * (n - 1) / n * nbytes / bw + factor * (n - 1) * latency


def predict_layout(
    model: ModelCost,
    links: Links,
    dp: int,
    mp: int,
    devices_per_node: int,
    elem_bytes: int = 4,
    micro_batches: int = 1,
    training: bool = True,
) -> LayoutCost:
    """Predict one optimizer step of ``model`` (planned at this ``mp``) at ``(dp, mp)``.

    ``micro_batches`` is the gradient accumulation; ``training=False`` (validate/test/predict) counts the forward
    only: no backward, no DP all-reduce, no optimizer step.
    """
    notes: list[str] = [model.note] if model.note else []
    passes = 3.0 if training else 1.0  # backward costs twice the forward
    flops = passes * 2 * model.tokens * (model.split_matmul / mp + model.replicated_matmul)
    compute_s = micro_batches * flops / links.flops
    mp_in_node = mp <= devices_per_node and devices_per_node % mp == 0
    if mp > 1 and not mp_in_node:
        notes.append("MP group spans nodes")
    bw, lat = links.link(mp_in_node)
    mp_ops = [(op, b) for phase, op, b in model.mp_collectives if training or phase == "forward"]
    mp_comm_s = micro_batches * sum(ring_s(b, mp, bw, lat, op) for op, b in mp_ops)
    mp_bytes = micro_batches * sum(b for _, b in mp_ops) if mp > 1 else 0
    local_params = model.split_params / mp + model.replicated_params
    grad_bytes = local_params * elem_bytes
    dp_exposed_s = optimizer_s = 0.0
    if training:
        dp_bw, dp_lat = links.link(dp * mp <= devices_per_node)
        buckets = max(1, math.ceil(grad_bytes / BUCKET_BYTES))
        dp_comm_s = ring_s(grad_bytes, dp, dp_bw, 0.0) + (buckets * 2 * (dp - 1) * dp_lat if dp > 1 else 0.0)
        backward_s = compute_s * (2 / 3) / micro_batches  # only the last micro-batch's backward overlaps
        dp_exposed_s = max(0.0, dp_comm_s - backward_s)
        optimizer_s = local_params * 7 * elem_bytes / links.mem_bw
    step_s = compute_s + mp_comm_s + dp_exposed_s + optimizer_s
    memory = int(local_params * elem_bytes * (4 if training else 1))  # weight, gradient, two AdamW moments
    fits = links.memory_bytes is None or memory <= links.memory_bytes
    if not fits:
        notes.append("does not fit in memory")
    tokens = dp * micro_batches * model.tokens
    return LayoutCost(
        dp=dp, mp=mp, compute_s=compute_s, mp_comm_s=mp_comm_s, dp_exposed_s=dp_exposed_s, optimizer_s=optimizer_s,
        step_s=step_s, tokens_per_s=tokens / step_s if step_s > 0 else math.inf, mp_bytes=int(mp_bytes),
        dp_bytes=int(grad_bytes) if dp > 1 and training else 0, memory_bytes=memory, fits=fits, notes=notes,
    )


def rank_layouts(rows: list[LayoutCost]) -> list[LayoutCost]:
    """Best first: layouts that fit before those that do not, then the most tokens per second (rounded to 9
    significant digits so that float noise does not decide), then the smaller ``mp``."""
    return sorted(rows, key=lambda r: (not r.fits, -float(f"{r.tokens_per_s:.9g}"), r.mp))


def format_table(rows: list[LayoutCost], chosen: Optional[LayoutCost] = None) -> str:
    """The ranked table as printed at setup (one line per layout, the chosen one marked)."""
    lines = ["   dp x mp   step ms  compute   MP comm  DP exposed  tokens/s  MB/rank  notes"]
    for r in rows:
        mark = "->" if chosen is not None and (r.dp, r.mp) == (chosen.dp, chosen.mp) else "  "
        lines.append(
            f"{mark} {r.dp:>3} x {r.mp:<3} {r.step_s * 1e3:>8.3f} {r.compute_s * 1e3:>8.3f} {r.mp_comm_s * 1e3:>9.3f}"
            f" {r.dp_exposed_s * 1e3:>11.3f} {r.tokens_per_s:>9.0f} {r.memory_bytes / 2**20:>8.1f}  "
            + "; ".join(r.notes)
        )
    return "\n".join(lines)
