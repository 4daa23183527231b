"""``DPMPStrategy(dp="auto", mp="auto", pp="auto", zero="auto")``: the layout of a fixed world, chosen at setup by
measurement and the layout estimator; and the memory check that refuses a given layout that will not fit.

:func:`choose_layout` runs in ``DPMPStrategy.setup``, after Lightning has moved the dense model and before the
parallelize pipeline plans it for real, on every rank, when any of dp/mp (both), pp or zero is ``"auto"``:

1. rank 0's first batch is broadcast and the step is traced once on the dense model (side-effect free, as the
   planner's own trace: :func:`~lightning_dpmp.integration.stepdata.isolated`), and its forward profiled
   (:func:`~lightning_dpmp.planner.profile.profile_step`: saved activations, parameters, FLOPs, MP collectives per
   block, on the real tensors): both kept in the setup's record of the first step
   (:class:`~lightning_dpmp.integration.firststep.FirstStep`), whose trace, dense loss and gradients the plan then
   reuses;
2. the links are measured briefly (:func:`measure_links`: a few all-reduces of 4 KiB and 4 MiB on the world group,
   per node and across nodes when ``num_nodes > 1``, one matmul and one copy; well under a second on 4 CPU
   processes) and rank 0's figures are broadcast, so that every rank predicts from the same numbers;
3. rank 0 plans the traced model at every ``mp`` dividing the world (:func:`~lightning_dpmp.planner.plan.make_plan`,
   no layer touched: an ``mp`` it cannot plan is no candidate), enumerates every ``(dp, pp, mp, zero)`` the given
   sizes allow (:func:`~lightning_dpmp.planner.layout_search.candidates`), predicts each with the estimator on a
   device made of the measured figures and :func:`device_memory` (:func:`~lightning_dpmp.planner.layout_search.rank`),
   and broadcasts the ranked table and the first layout that fits; none fitting raises on every rank;
4. the strategy builds the groups for it (``GridStrategy.set_layout``: every rank, in the same order).

With no batch to trace (or a step that cannot run outside the loop), or a world of one process, it falls back to
the old rule, dp = nodes and mp = devices per node (pp = 1 and zero = 0 where those were ``"auto"``), and the
printout says so.

:func:`check_memory` runs for a given layout while fitting: where the parameters, gradients and optimizer state
alone take more than half of :func:`device_memory` (a lower bound, no user code run), the first batch's step is
profiled on rank 0, which predicts the peak at that layout; over the memory every rank raises
the same ``ValueError`` (naming the predicted peak, the memory, the largest contributors and what would fit) before
any step. ``DPMP_MEMORY_CHECK=0`` turns the check (and the fit filter of the choice) off;
``DPMP_DEVICE_MEMORY_GIB`` sets the memory per rank.

Example:
    >>> choice = choose_layout(first, num_processes=4, num_nodes=1, plan_overrides=None,  # doctest: +SKIP
    ...                        request=request)
    >>> print(choice.text)                                                           # doctest: +SKIP
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_dpmp.integration.firststep import FirstStep
from lightning_dpmp.parallel.topology import Size, Topology
from lightning_dpmp.planner.cost import Links
from lightning_dpmp.planner.estimate import PRECISIONS, LayoutSpec
from lightning_dpmp.planner.layout_search import (
    candidates,
    estimator_precision,
    format_ranking,
    measured_device,
    rank,
    refusal,
)
from lightning_dpmp.planner.plan import make_plan
from lightning_dpmp.planner.profile import ModelProfile
from lightning_dpmp.planner.trace import Trace
from lightning_dpmp.planner.user_plan import PlanOverrides

__all__ = ["PROFILE_ABOVE", "Choice", "Request", "candidate_layouts", "check_memory", "choose_layout", "device_memory",
           "link_figures", "measure_links", "states_bytes"]

SMALL, LARGE = 4 * 1024, 4 * 2**20  # bytes of the latency and the bandwidth probes
#: A given layout's step is profiled for the memory check only where its states alone exceed this share of memory.
PROFILE_ABOVE = 0.5
REPEATS = 5
FLOP_REPS = 16  # back-to-back 512^3 matmuls per rank for the FLOP/s figure (~0.1 s on a shared CPU core)


@dataclass(frozen=True)
class Request:
    """The sizes as given to ``DPMPStrategy`` (``"auto"``: chosen here) and the settings a candidate keeps."""

    dp: Size = "auto"
    mp: Size = "auto"
    pp: Size = 1
    zero: Union[int, str] = 0
    microbatches: int = -1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    sequence_parallel: bool = False

    def layout(self, dp: int, pp: int, mp: int, zero: int) -> Topology:
        """The full topology of one candidate (a ``ValueError`` where the pipeline's settings do not suit it)."""
        if pp == 1:
            return Topology(dp=dp, mp=mp, zero=zero)
        return Topology(dp=dp, mp=mp, pp=pp, zero=zero, microbatches=self.microbatches, schedule=self.schedule,
                        stages_per_rank=self.stages_per_rank)


@dataclass
class Choice:
    """The layout chosen at setup, the ranked table behind it and the printout (``text``)."""

    layout: Topology  # dp, pp, mp and zero; the pipeline's settings as given
    table: list[Any]  # the estimator's rows (planner.estimate.Estimate), best first
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


def _timed(fn: Callable[[], Any], device: torch.device, best: bool = False) -> float:
    """Median (``best``: least) seconds of ``fn`` over :data:`REPEATS` runs after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def _together(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Seconds per call of ``fn`` run ``reps`` times back to back on every rank at once (collective: a barrier
    starts them together), after one warm-up: what a rank sustains while the others work too, as in training.
    (Timing single short calls instead let some ranks run alone on a shared CPU: the figure swung 1.6x between two
    setups of the same run.)"""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def link_figures(t_small: float, t_large: float, n: int, small: int = SMALL, large: int = LARGE
                 ) -> tuple[float, float]:
    """``(bandwidth, latency)`` of a ring of ``n`` ranks from the times of an all-reduce of ``small`` and of
    ``large`` bytes (:data:`SMALL`, :data:`LARGE`). The large one's transfer is taken as at least a tenth of its
    time: where noise makes the two times nearly equal, the difference alone would give any bandwidth (6e6 GB/s was
    seen on a loaded CPU).

    Example:
        >>> bw, lat = link_figures(6e-3, 18e-3, 4)   # 6 ring steps of 1 ms, 12 ms to move 4 MiB
        >>> round(bw / 1e9, 2), round(lat * 1e3, 2)
        (0.52, 1.0)
        >>> round(link_figures(7.7e-3, 7.6e-3, 4)[0] / 1e9, 1)  # unresolved: bounded by the large one's time
        8.3
    """
    latency = t_small / (2 * (n - 1))
    bw = 2 * (n - 1) / n * (large - small) / max(t_large - t_small, t_large / 10, 1e-9)
    return bw, latency


def _link(group: Any, n: int, device: torch.device) -> tuple[float, float]:
    """``(bandwidth, latency)`` of ``group`` (``n`` ranks) from a 4 KiB and a 4 MiB all-reduce (collective), each
    its least time of :data:`REPEATS` (a link's own cost; the longer times are other work on a shared machine)."""
    small = torch.zeros(SMALL // 4, dtype=torch.float32, device=device)
    large = torch.zeros(LARGE // 4, dtype=torch.float32, device=device)
    t_small = _timed(lambda: dist.all_reduce(small, group=group), device, best=True)
    t_large = _timed(lambda: dist.all_reduce(large, group=group), device, best=True)
    return link_figures(t_small, t_large, n)


def measure_links(device: torch.device, devices_per_node: int, num_nodes: int, dtype: torch.dtype) -> Links:
    """Measure this machine (collective over the world): returns rank 0's figures on every rank.

    The intra-node link is measured on each node's ranks (the whole world on one node), the inter-node one on the
    world; FLOP/s from 512 x 512 matmuls in ``dtype`` (every rank at once, as they will train: :func:`_together`),
    memory bandwidth from a 16 MiB copy; the memory per rank from :func:`device_memory`.
    """
    world, rank_ = dist.get_world_size(), dist.get_rank()
    if num_nodes > 1:
        node_group = None
        for node in range(num_nodes):  # every rank creates every node group, in the same order
            g = dist.new_group(list(range(node * devices_per_node, (node + 1) * devices_per_node)))
            if rank_ // devices_per_node == node:
                node_group = g
        intra = _link(node_group, devices_per_node, device) if devices_per_node > 1 else (float("inf"), 0.0)
        inter: Optional[tuple[float, float]] = _link(None, world, device)
    else:
        intra, inter = _link(None, world, device), None
    a = torch.randn(512, 512, device=device, dtype=dtype)
    flops = 2 * 512**3 / max(_together(lambda: a @ a, device, FLOP_REPS), 1e-9)
    src = torch.zeros(4 * 2**20, device=device)
    dst = torch.empty_like(src)
    mem_bw = 2 * src.numel() * 4 / max(_timed(lambda: dst.copy_(src), device), 1e-9)
    memory, _ = device_memory(device, devices_per_node)
    box = [Links(intra_bw=intra[0], intra_latency=intra[1], flops=flops, mem_bw=mem_bw,
                 inter_bw=inter[0] if inter else None, inter_latency=inter[1] if inter else None, memory_bytes=memory)]
    dist.broadcast_object_list(box, src=0)  # one set of figures: every rank must choose the same layout
    return box[0]


def device_memory(device: torch.device, processes_per_node: int) -> tuple[float, str]:
    """Bytes one rank may hold, and where the figure comes from: ``DPMP_DEVICE_MEMORY_GIB`` when set; a CUDA
    device's total memory; on CPU the host's available memory (``MemAvailable`` of ``/proc/meminfo``, else the
    physical memory) shared by the ``processes_per_node`` ranks of this node.

    Example:
        >>> b, where = device_memory(torch.device("cpu"), 4)
        >>> b > 0 and "per rank" in where or "DPMP_DEVICE_MEMORY_GIB" in where
        True
    """
    env = os.environ.get("DPMP_DEVICE_MEMORY_GIB")
    if env:
        return float(env) * 2**30, f"DPMP_DEVICE_MEMORY_GIB={env}"
    if device.type == "cuda":
        total = float(torch.cuda.get_device_properties(device).total_memory)
        return total, f"{torch.cuda.get_device_name(device)}: {total / 2**30:.3g} GiB"
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = float(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    n = max(processes_per_node, 1)
    return avail / n, f"the host's available {avail / 2**30:.3g} GiB / {n} processes per node, per rank"


def _memory_check_on() -> bool:
    return os.environ.get("DPMP_MEMORY_CHECK", "1") != "0"


def _fallback(num_processes: int, num_nodes: int, request: Request, why: str) -> Choice:
    pp = request.pp if isinstance(request.pp, int) else 1
    lay = Topology.resolve(request.dp, request.mp, num_processes * num_nodes, num_nodes=num_nodes, pp=pp)
    zero = request.zero if isinstance(request.zero, int) else 0
    lay = request.layout(lay.dp, lay.pp, lay.mp, zero)
    return Choice(lay, [], None, f"  layout: 'auto' fell back to dp = nodes, mp = devices per node ({lay}): {why}",
                  measured=False)


def _trace(first: FirstStep) -> tuple[Optional[Trace], Optional[tuple[ModelProfile, int]]]:
    """The first step's trace and the estimator's profile, from the setup's record (collective: the batch broadcast
    and the dense run when they are first made); ``(None, None)`` on every rank when any rank could not trace or
    profile it."""
    trace: Optional[Trace] = None
    prof: Optional[tuple[ModelProfile, int]] = None
    if first.batch is not None:
        dense = first.dense()  # (the planner reports a failure at its own use)
        trace = dense.trace if dense.trace is not None and not dense.trace.error else None
        if trace is not None:
            prof = first.layout_profile()  # no profile: no prediction (the fallback rule)
    failed = torch.tensor([float(trace is None or prof is None)], device=first.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return (trace, prof) if failed.item() == 0 else (None, None)


def _plannable_mp(module: nn.Module, trace: Trace, world: int, overrides: PlanOverrides, mp_one_only: bool
                  ) -> tuple[list[int], list[str]]:
    """The ``mp`` dividing the world the planner can plan for this model, and why the others cannot."""
    ok, notes = [], []
    for mp in (m for m in range(1, world + 1) if world % m == 0):
        if mp > 1 and mp_one_only:
            notes.append(f"mp={mp}: sync_batchnorm keeps mp=1")
            continue
        try:
            make_plan(module, mp, trace, overrides)
            ok.append(mp)
        except Exception as exc:  # e.g. an override forcing a split that mp does not divide
            notes.append(f"mp={mp}: cannot plan: {exc}")
    return ok, notes


def choose_layout(first: FirstStep, num_processes: int, num_nodes: int, plan_overrides: PlanOverrides,
                  mp_one_only: bool = False, request: Optional[Request] = None) -> Choice:
    """Trace and profile the step of ``first`` (the setup's record of the first step: its module, device and
    precision plugin), measure, predict and choose a layout for ``num_processes`` per node on ``num_nodes`` within
    ``request`` (default: dp and mp ``"auto"``, pp 1, zero 0); collective over the world; the caller builds the
    groups. Raises a ``ValueError`` on every rank when no candidate is predicted to fit."""
    request = request if request is not None else Request()
    world = num_processes * num_nodes
    if world == 1:
        lay = request.layout(1, 1, 1, 0)
        return Choice(lay, [], None, f"  layout: {lay} (the only one)", measured=True)
    trace, prof = _trace(first)
    if trace is None or prof is None:
        return _fallback(num_processes, num_nodes, request,
                         "no batch to trace at this stage (or the step did not run outside the loop)")
    trainer, module, device, global_rank = first.trainer, first.module, first.device, first.global_rank
    t0 = time.perf_counter()
    precision = estimator_precision(str(trainer.precision))
    dtype = {"64-true": torch.float64, "32-true": torch.float32}.get(precision, torch.bfloat16)
    links = measure_links(device, num_processes, num_nodes, dtype)
    seconds = time.perf_counter() - t0
    box: list[Any] = [None]
    if global_rank == 0:
        box = [_rank_on_rank_zero(module, trace, prof[0], links, world, prof[1], num_processes, request,
                                  plan_overrides, mp_one_only, precision, device)]
    dist.broadcast_object_list(box, src=0)
    chosen, table, text, error = box[0]
    if error:
        raise ValueError(error)
    if chosen is None:
        return _fallback(num_processes, num_nodes, request, text)
    dp, pp, mp, zero = chosen
    text = (f"  layout: {_given(request)} chose {request.layout(dp, pp, mp, zero)} of {world} processes, ranked"
            f" first by predicted tokens/s (links measured in {seconds:.2f} s: intra"
            f" {links.intra_bw / 1e9:.3g} GB/s, {links.intra_latency * 1e6:.3g} us"
            + (f"; inter {links.inter_bw / 1e9:.3g} GB/s" if links.inter_bw is not None else "")
            + f"; {links.flops / 1e9:.3g} GFLOP/s, memory {links.mem_bw / 1e9:.3g} GB/s)\n" + text)
    return Choice(request.layout(dp, pp, mp, zero), table, links, text, measured=True)


def _cores() -> int:
    """CPU cores this process may run on (its affinity where the platform tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _given(request: Request) -> str:
    return (f"DPMPStrategy(dp={request.dp!r}, pp={request.pp!r}, mp={request.mp!r}, zero={request.zero!r})")


def _rank_on_rank_zero(module: nn.Module, trace: Trace, prof: ModelProfile, links: Links, world: int,
                       per_rank: int, per_node: int, request: Request, overrides: PlanOverrides, mp_one_only: bool,
                       precision: str, device: torch.device) -> tuple[Any, list[Any], str, str]:
    """``(chosen (dp, pp, mp, zero) or None, ranked rows, the table's text, an error for every rank or "")``."""
    allowed, notes = _plannable_mp(module, trace, world, overrides, mp_one_only)
    specs, out = candidates(prof, world, per_rank, dp=request.dp, pp=request.pp, mp=request.mp, zero=request.zero,
                            allowed_mp=allowed, microbatches=request.microbatches, schedule=request.schedule,
                            stages_per_rank=request.stages_per_rank, sequence_parallel=request.sequence_parallel)
    kept: list[LayoutSpec] = []
    for spec in specs:
        try:
            request.layout(spec.dp, spec.pp, spec.mp, spec.zero)
            kept.append(spec)
        except ValueError as exc:
            out.append(f"(dp, pp, mp) = ({spec.dp}, {spec.pp}, {spec.mp}): {exc}")
    out = list(dict.fromkeys(notes + out))
    if not kept:
        return None, [], "no layout can be planned (" + "; ".join(out) + ")", ""
    memory = links.memory_bytes if links.memory_bytes is not None else device_memory(device, per_node)[0]
    if not _memory_check_on():
        memory = float("inf")
    dev = measured_device(links.intra_bw, links.intra_latency, links.flops, links.mem_bw, per_node, memory,
                          cpu=device.type == "cpu", inter_bw=links.inter_bw, inter_latency=links.inter_latency,
                          processes_per_core=per_node / _cores())
    ranking = rank(prof, dev, kept, world, per_rank, precision)
    text = "\n".join("    " + line for line in format_ranking(ranking).splitlines())
    text += "".join(f"\n    not a candidate: {r}" for r in out)
    if ranking.chosen is None:
        low = min(ranking.rows, key=lambda e: e.peak_mem_gib)
        _, where = device_memory(device, per_node)
        msg = refusal(prof, dev, low.spec, world, per_rank, precision, where) or ""
        return None, ranking.rows, text, ("no layout of the candidates is predicted to fit; the smallest peak: "
                                          + msg + "\n" + text)
    c = ranking.chosen
    return (c.dp, c.pp, c.mp, c.zero), ranking.rows, text, ""


def states_bytes(module: nn.Module, topology: Topology, precision: str) -> float:
    """A lower bound of what one rank holds at ``topology``: parameters, gradients and optimizer state, as if every
    parameter were split ``mp * pp`` ways and sharded over DP as the ZeRO level shards it (no activations).

    Example:
        >>> states_bytes(nn.Linear(100, 10), Topology(dp=2, mp=2), "64-true")   # 1,010 / 2 x (8 + 8 + 16)
        16160.0
    """
    _, pb, gb, ob = PRECISIONS[precision]
    t, n = topology, sum(p.numel() for p in module.parameters())
    z = t.zero if t.dp > 1 else 0
    per = pb / (t.dp if z == 3 else 1) + gb / (t.dp if z >= 1 else 1) + ob / (t.dp if z >= 1 else 1)
    return n / (t.mp * t.pp) * per


def check_memory(first: FirstStep, topology: Topology, num_processes: int, sequence_parallel: bool) -> None:
    """Refuse a given layout the estimator predicts will not fit: the same ``ValueError`` on every rank, before any
    step (collective over the world). The step of ``first`` (the setup's record of the first step) is profiled
    (fitting: in the record's one dense run, which the plan reads later) only where the parameters, gradients and
    optimizer state alone take more than half the memory (:data:`PROFILE_ABOVE`); below that the layout is taken to
    fit, with one small broadcast. Off with ``DPMP_MEMORY_CHECK=0``; a step that cannot be profiled is not checked."""
    if not _memory_check_on() or not dist.is_initialized():
        return
    trainer, module, device, global_rank = first.trainer, first.module, first.device, first.global_rank
    precision = estimator_precision(str(trainer.precision))
    gate: list[Any] = [False]
    if global_rank == 0:
        memory, _ = device_memory(device, num_processes)
        gate = [states_bytes(module, topology, precision) > PROFILE_ABOVE * memory]
    dist.broadcast_object_list(gate, src=0)
    if not gate[0]:
        return
    batch = first.batch
    box: list[Optional[str]] = [None]
    measured = first.layout_profile() if global_rank == 0 and batch is not None else None
    if measured is not None:
        try:
            prof, per_rank = measured
            memory, where = device_memory(device, num_processes)
            dev = measured_device(1e9, 1e-5, 1e12, 1e10, num_processes, memory, cpu=device.type == "cpu")
            t = topology
            spec = LayoutSpec(t.dp, t.pp, t.mp, t.zero, sequence_parallel and t.mp > 1,
                              t.microbatches if t.pp > 1 else 1,
                              ("interleaved" if t.schedule == "interleaved" else t.schedule) if t.pp > 1 else "none")
            box = [refusal(prof, dev, spec, t.world_size, per_rank, precision, where)]
        except Exception:  # a step the profiler cannot read is not checked (the planner reports real errors)
            box = [None]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ValueError(box[0])
