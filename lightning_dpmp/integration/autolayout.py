"""``DPMPStrategy(dp="auto", mp="auto")``: the split of a fixed world into (dp, mp), chosen at setup by
measurement and the cost model.

:func:`choose_layout` runs in ``DPMPStrategy.setup``, after Lightning has moved the dense model and before the
parallelize pipeline plans it for real, on every rank:

1. rank 0's first batch is broadcast and the step is traced once on the dense model (side-effect free, as the
   planner's own trace: :func:`~lightning_dpmp.integration.stepdata.isolated`);
2. the links are measured briefly (:func:`measure_links`: a few all-reduces of 4 KiB and 4 MiB on the world group,
   per node and across nodes when ``num_nodes > 1``, one matmul and one copy; well under a second on 4 CPU
   processes) and rank 0's figures are broadcast, so that every rank predicts from the same numbers;
3. rank 0 plans the traced model at every ``mp`` dividing the world (:func:`~lightning_dpmp.planner.plan.make_plan`,
   no layer touched), predicts each ``(dp, mp)`` (:mod:`lightning_dpmp.planner.cost`) and broadcasts the table and
   the first-ranked layout;
4. the strategy builds the DP/MP groups for it (``GridStrategy.set_layout``: every rank, in the same order).

With no batch to trace (or a step that cannot run outside the loop), or a world of one process, it falls back to
today's rule, dp = nodes and mp = devices per node, and the printout says so.

Example:
    >>> choice = choose_layout(trainer, module, plugin, torch.device("cpu"), global_rank=0,  # doctest: +SKIP
    ...                        num_processes=4, num_nodes=1, meta=False, plan_overrides=None)
    >>> print(choice.text)                                                           # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from lightning_dpmp.integration.stepdata import first_batch, isolated, step_runner
from lightning_dpmp.parallel.topology import Topology
from lightning_dpmp.planner.cost import (
    LayoutCost,
    Links,
    ModelCost,
    format_table,
    model_cost,
    predict_layout,
    rank_layouts,
)
from lightning_dpmp.planner.plan import make_plan
from lightning_dpmp.planner.trace import Trace, trace_step
from lightning_dpmp.planner.user_plan import PlanOverrides

__all__ = ["Choice", "candidate_layouts", "choose_layout", "measure_links", "rank_candidates"]

SMALL, LARGE = 4 * 1024, 4 * 2**20  # bytes of the latency and the bandwidth probes
REPEATS = 5


@dataclass
class Choice:
    """The layout chosen at setup, the ranked table behind it and the printout (``text``)."""

    layout: Topology  # its dp and mp; the strategy keeps its own pp, zero and pipeline settings
    table: list[LayoutCost]
    links: Optional[Links]
    text: str
    measured: bool  # False: the fallback rule (no trace)


def candidate_layouts(world: int, mp_one_only: bool = False) -> list[Topology]:
    """Every ``(dp, mp)`` with ``dp * mp == world`` (only ``mp=1`` under ``sync_batchnorm``).

    Example:
        >>> [(t.dp, t.mp) for t in candidate_layouts(4)]
        [(4, 1), (2, 2), (1, 4)]
    """
    return [Topology(dp=world // mp, mp=mp) for mp in range(1, world + 1)
            if world % mp == 0 and (mp == 1 or not mp_one_only)]


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Median seconds of ``fn`` over :data:`REPEATS` runs after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _link(group: Any, n: int, device: torch.device) -> tuple[float, float]:
    """``(bandwidth, latency)`` of ``group`` (``n`` ranks) from a 4 KiB and a 4 MiB all-reduce (collective)."""
    small = torch.zeros(SMALL // 4, dtype=torch.float32, device=device)
    large = torch.zeros(LARGE // 4, dtype=torch.float32, device=device)
    t_small = _timed(lambda: dist.all_reduce(small, group=group), device)
    t_large = _timed(lambda: dist.all_reduce(large, group=group), device)
    latency = t_small / (2 * (n - 1))
    bw = 2 * (n - 1) / n * (LARGE - SMALL) / max(t_large - t_small, 1e-9)
    return bw, latency


def measure_links(device: torch.device, devices_per_node: int, num_nodes: int, dtype: torch.dtype) -> Links:
    """Measure this machine (collective over the world): returns rank 0's figures on every rank.

    The intra-node link is measured on each node's ranks (the whole world on one node), the inter-node one on the
    world; FLOP/s from a 512 x 512 matmul in ``dtype``, memory bandwidth from a 16 MiB copy.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if num_nodes > 1:
        node_group = None
        for node in range(num_nodes):  # every rank creates every node group, in the same order
            g = dist.new_group(list(range(node * devices_per_node, (node + 1) * devices_per_node)))
            if rank // devices_per_node == node:
                node_group = g
        intra = _link(node_group, devices_per_node, device) if devices_per_node > 1 else (float("inf"), 0.0)
        inter: Optional[tuple[float, float]] = _link(None, world, device)
    else:
        intra, inter = _link(None, world, device), None
    a = torch.randn(512, 512, device=device, dtype=dtype)
    flops = 2 * 512**3 / max(_timed(lambda: a @ a, device), 1e-9)
    src = torch.zeros(4 * 2**20, device=device)
    dst = torch.empty_like(src)
    mem_bw = 2 * src.numel() * 4 / max(_timed(lambda: dst.copy_(src), device), 1e-9)
    memory = float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
    box = [Links(intra_bw=intra[0], intra_latency=intra[1], flops=flops, mem_bw=mem_bw,
                 inter_bw=inter[0] if inter else None, inter_latency=inter[1] if inter else None, memory_bytes=memory)]
    dist.broadcast_object_list(box, src=0)  # one set of figures: every rank must choose the same layout
    return box[0]


def _elem_bytes(precision: str) -> tuple[int, int]:
    """Bytes per ``(activation, parameter/gradient)`` element at a Lightning precision: mixed precision computes
    (and all-reduces activations) in 16 bits but keeps float32 parameters and gradients."""
    if precision.startswith(("64", "32")):
        n = 8 if precision.startswith("64") else 4
        return n, n
    return 2, 4 if "mixed" in precision else 2


def _model_costs(module: torch.nn.Module, trace: Trace, layouts: list[Topology], overrides: PlanOverrides,
                 elem_bytes: int) -> dict[int, ModelCost]:
    """A :class:`ModelCost` per candidate ``mp``: the plan the planner would make there, or the reason it cannot."""
    out: dict[int, ModelCost] = {}
    for lay in layouts:
        try:
            out[lay.mp] = model_cost(module, make_plan(module, lay.mp, trace, overrides), trace, elem_bytes)
        except Exception as exc:  # e.g. an override forcing a split that mp does not divide
            out[lay.mp] = ModelCost(0, 0, 0, 0, 0, note=f"cannot plan: {exc}")
    return out


def rank_candidates(costs: dict[int, ModelCost], links: Links, layouts: list[Topology], devices_per_node: int,
                    elem_bytes: int, micro_batches: int, training: bool) -> list[LayoutCost]:
    """Predict every candidate and rank them (best first); layouts that cannot be planned are left out."""
    rows = [predict_layout(costs[lay.mp], links, lay.dp, lay.mp, devices_per_node, elem_bytes, micro_batches,
                           training) for lay in layouts if not costs[lay.mp].note]
    return rank_layouts(rows)


def _fallback(num_processes: int, num_nodes: int, why: str) -> Choice:
    lay = Topology.resolve("auto", "auto", num_processes * num_nodes, num_nodes=num_nodes)
    return Choice(lay, [], None, f"  layout: mp='auto' fell back to dp = nodes, mp = devices per node"
                                 f" (dp={lay.dp} x mp={lay.mp}): {why}", measured=False)


def _trace(trainer: Any, module: Any, plugin: Any, device: torch.device, global_rank: int, meta: bool
           ) -> Optional[Trace]:
    """Rank 0's first batch, traced on every rank's dense model (collective: the batch broadcast); ``None`` on
    every rank when any rank could not trace it."""
    batch, _ = first_batch(trainer, module, global_rank)
    trace: Optional[Trace] = None
    if batch is not None:
        run = step_runner(trainer, module, plugin, device, batch, meta)
        try:
            with isolated(module, []), torch.enable_grad():
                trace = trace_step(module, run)
                trace.result = None  # drop the graph
        except Exception:  # the planner reports it at its own trace; here it only means "no measurement"
            trace = None
    failed = torch.tensor([float(trace is None)], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return trace if failed.item() == 0 else None


def choose_layout(trainer: Any, module: Any, plugin: Any, device: torch.device, global_rank: int,
                  num_processes: int, num_nodes: int, meta: bool, plan_overrides: PlanOverrides,
                  mp_one_only: bool = False) -> Choice:
    """Trace ``module``'s step (on ``device``, under the precision ``plugin``), measure, predict and choose a
    (dp, mp) for ``num_processes`` per node on ``num_nodes`` (collective over the world); the caller builds the
    groups."""
    world = num_processes * num_nodes
    layouts = candidate_layouts(world, mp_one_only)
    if len(layouts) == 1:
        return Choice(layouts[0], [], None, f"  layout: dp={layouts[0].dp} x mp={layouts[0].mp} (the only one)",
                      measured=True)
    trace = _trace(trainer, module, plugin, device, global_rank, meta)
    if trace is None:
        return _fallback(num_processes, num_nodes,
                         "no batch to trace at this stage (or the step did not run outside the loop)")
    t0 = time.perf_counter()
    act, elem = _elem_bytes(str(trainer.precision))
    dtype = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}[act]
    links = measure_links(device, num_processes, num_nodes, dtype)
    seconds = time.perf_counter() - t0
    box: list[Any] = [None]
    if global_rank == 0:
        costs = _model_costs(module, trace, layouts, plan_overrides, act)
        training = trainer.state.fn == TrainerFn.FITTING
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if training else 1
        table = rank_candidates(costs, links, layouts, num_processes, elem, accumulate, training)
        refused = [f"mp={mp}: {c.note}" for mp, c in costs.items() if c.note]
        box = [(table, refused)]
    dist.broadcast_object_list(box, src=0)
    table, refused = box[0]
    if not table:
        return _fallback(num_processes, num_nodes, "no layout could be planned (" + "; ".join(refused) + ")")
    best = table[0]
    text = (
        f"  layout: mp='auto' chose dp={best.dp} x mp={best.mp} of {world} processes, ranked first by predicted"
        f" tokens/s (links measured in {seconds:.2f} s: intra {links.intra_bw / 1e9:.3g} GB/s,"
        f" {links.intra_latency * 1e6:.3g} us"
        + (f"; inter {links.inter_bw / 1e9:.3g} GB/s" if links.inter_bw is not None else "")
        + f"; {links.flops / 1e9:.3g} GFLOP/s)\n"
        + "\n".join("    " + line for line in format_table(table, best).splitlines())
        + "".join(f"\n    not a candidate: {r}" for r in refused)
    )
    return Choice(Topology(dp=best.dp, mp=best.mp), table, links, text, measured=True)

