"""The layouts a fixed world can take for one profiled model, predicted by the estimator and ranked: what
``DPMPStrategy(dp="auto", mp="auto", pp="auto", zero="auto")`` chooses at setup, and the memory check that refuses
a given layout that will not fit.

Pure arithmetic over a :class:`~lightning_dpmp.planner.profile.ModelProfile` and a
:class:`~lightning_dpmp.planner.estimate.Device` (the measured links, :func:`measured_device`); the Lightning side
(tracing, measuring, broadcasting) is :mod:`lightning_dpmp.integration.autolayout`.

* :func:`candidates`: every ``(dp, pp, mp, zero)`` with ``dp * pp * mp == world`` that agrees with the sizes given
  (an int fixes a size, ``"auto"`` leaves it free), where ``mp`` is one the planner could plan (``allowed_mp``) and
  divides the heads, key/value heads and feed-forward width the profile knows, ``pp * stages_per_rank`` is at most
  the repeated blocks, the micro-batches divide the per-rank batch, and (``zero="auto"``) ``zero > 0`` only with
  ``dp > 1``; the layouts left out are returned with the reason.
* :func:`rank`: each candidate predicted at the global batch its ``dp`` implies (the loader's batch is fixed per
  rank, so the global batch is ``dp`` times it): ranked by predicted **tokens per second**, fitting layouts first.
  Per ``(dp, pp, mp)`` the zero level is the lowest that fits (fewer collectives) unless a higher one is predicted
  at least :data:`ZERO_MARGIN` faster (the estimator's step-time error on CPU is larger than the few percent the
  optimizer step's sharding saves); ties go to smaller ``mp``, then smaller ``pp``.
* :func:`refusal`: for a given layout, ``None`` when it fits, else the message naming the predicted peak, the
  device memory, the largest contributors and what would fit.

Example:
    >>> from lightning_dpmp.planner.gpt_shape import GPTShape
    >>> from lightning_dpmp.planner.profile import ModelProfile
    >>> prof = ModelProfile.from_gpt(GPTShape(layers=4, hidden=64, heads=4, vocab=128, seq=16, batch=8))
    >>> dev = measured_device(intra_bw=1e9, intra_latency=1e-5, flops=1e10, mem_bw=1e10, devices_per_node=4,
    ...                       memory_bytes=2**30, cpu=True)
    >>> specs, _ = candidates(prof, world=4, per_rank_batch=4, dp="auto", pp="auto", mp=1, zero=0)
    >>> sorted((s.dp, s.pp, s.mp) for s in specs)
    [(1, 4, 1), (2, 2, 1), (4, 1, 1)]
    >>> ranking = rank(prof, dev, specs, world=4, per_rank_batch=4, precision="32-true")
    >>> ranking.chosen is ranking.rows[0] and ranking.chosen.fits
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

from lightning_dpmp.planner.estimate import CPU_MICRO_OVERHEAD_S, PRECISIONS, Device, Estimate, LayoutSpec, predict
from lightning_dpmp.planner.profile import ModelProfile

__all__ = ["CPU_MICRO_OVERHEAD_S", "ZERO_MARGIN", "Ranking", "candidates", "estimator_precision", "format_ranking",
           "measured_device", "rank", "refusal"]

#: A higher zero level is chosen over a lower one that fits only when predicted at least this much faster.
ZERO_MARGIN = 0.05

SizeArg = Union[int, str]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def measured_device(intra_bw: float, intra_latency: float, flops: float, mem_bw: float, devices_per_node: int,
                    memory_bytes: float, cpu: bool, inter_bw: Optional[float] = None,
                    inter_latency: Optional[float] = None, processes_per_core: float = 1.0) -> Device:
    """The :class:`~lightning_dpmp.planner.estimate.Device` of measured figures: ``flops`` is what one process
    sustained on a matmul in the training dtype while every rank ran one (so efficiency 1), the links as measured.
    On CPU the DP all-reduce competes for the same cores (no overlap), a stage waiting in the bubble gives its core
    to another (no idle bubble), as the ``cpu`` preset says, and each pipeline micro-batch costs a stage
    :data:`CPU_MICRO_OVERHEAD_S` of CPU, stretched by ``processes_per_core`` (the ranks sharing a core).

    Example:
        >>> measured_device(1e9, 1e-5, 2e10, 5e9, 4, 2**31, cpu=True).memory_gib
        2.0
        >>> measured_device(1e9, 1e-5, 2e10, 5e9, 4, 2**31, cpu=True, processes_per_core=2).micro_overhead_s
        0.01
    """
    return Device("measured", memory_gib=memory_bytes / 2**30,
                  peak_flops={"bf16": flops, "fp32": flops, "fp64": flops}, efficiency=1.0, mem_bw=mem_bw,
                  intra_bw=intra_bw, inter_bw=inter_bw if inter_bw is not None else intra_bw,
                  intra_latency=intra_latency,
                  inter_latency=inter_latency if inter_latency is not None else intra_latency,
                  devices_per_node=devices_per_node, overhead_s=0.0, overlap_dp=not cpu, idle_bubble=not cpu,
                  micro_overhead_s=CPU_MICRO_OVERHEAD_S * max(1.0, processes_per_core) if cpu else 0.0)


def estimator_precision(precision: str) -> str:
    """The estimator's precision name for a Lightning one (``"64"``, ``"64-true"``, ``"16-mixed"``, ...).

    Example:
        >>> [estimator_precision(p) for p in ("64-true", "32", "bf16-mixed", "16-true", "transformer-engine")]
        ['64-true', '32-true', 'bf16-mixed', 'bf16-true', 'bf16-mixed']
    """
    p = str(precision)
    if p.startswith("64"):
        return "64-true"
    if p.startswith("32"):
        return "32-true"
    if "mixed" in p or "transformer-engine" in p:
        return "bf16-mixed" if p not in PRECISIONS else p
    return "bf16-true"


def candidates(prof: ModelProfile, world: int, per_rank_batch: int, dp: SizeArg = "auto", pp: SizeArg = "auto",
               mp: SizeArg = "auto", zero: SizeArg = "auto", allowed_mp: Optional[Sequence[int]] = None,
               microbatches: int = -1, schedule: str = "1f1b", stages_per_rank: int = 1,
               sequence_parallel: bool = False) -> tuple[list[LayoutSpec], list[str]]:
    """The layouts of ``world`` processes that agree with the sizes given (see the module docstring) and the
    reasons the others are left out. ``microbatches``: the pipeline's (``-1``: one per stage).

    Example:
        >>> from lightning_dpmp.planner.gpt_shape import GPTShape
        >>> prof = ModelProfile.from_gpt(GPTShape(layers=2, hidden=64, heads=4, vocab=128, seq=16, batch=8))
        >>> specs, out = candidates(prof, 4, per_rank_batch=2, pp="auto", mp=1, zero=0)
        >>> sorted((s.dp, s.pp) for s in specs), out
        ([(2, 2), (4, 1)], ['(dp, pp, mp) = (1, 4, 1): pp=4 x 1 stages per rank > the 2 repeated blocks'])
    """
    specs: list[LayoutSpec] = []
    out: list[str] = []
    for m in _divisors(world):
        if mp != "auto" and m != mp:
            continue
        for p in _divisors(world // m):
            d = world // (m * p)
            if (pp != "auto" and p != pp) or (dp != "auto" and d != dp):
                continue
            where = f"(dp, pp, mp) = ({d}, {p}, {m})"
            if allowed_mp is not None and m not in allowed_mp:
                out.append(f"{where}: the planner cannot split this model {m} ways")
                continue
            bad = [f"{name} {x}" for name, x in (("heads", prof.heads), ("key/value heads", prof.kv_heads),
                                                 ("feed-forward width", prof.ffn)) if x and x % m]
            if bad:
                out.append(f"{where}: mp={m} does not divide the {', '.join(bad)}")
                continue
            if p > 1 and p * stages_per_rank > max(prof.layers, 0):
                out.append(f"{where}: pp={p} x {stages_per_rank} stages per rank > the {prof.layers} repeated"
                           " blocks")
                continue
            micro = 1
            if p > 1:
                micro = microbatches if microbatches > 0 else p * stages_per_rank
                if per_rank_batch % micro:
                    out.append(f"{where}: {micro} micro-batches do not divide the per-rank batch of"
                               f" {per_rank_batch}")
                    continue
            # zero="auto" tries a level > 0 only where there is a DP group to shard over; a given level stays as given
            zeros = [z for z in (0, 1, 2, 3) if d > 1 or z == 0] if zero == "auto" else [int(zero)]
            sched = "none" if p == 1 else ("interleaved" if schedule == "interleaved" else schedule)
            for z in zeros:
                specs.append(LayoutSpec(d, p, m, z, sequence_parallel and m > 1, micro, sched, False))
    return specs, out


@dataclass
class Ranking:
    """The predicted layouts, best first (fitting ones first), and the one chosen (``None``: none fits)."""

    rows: list[Estimate]
    chosen: Optional[Estimate]
    others: list[Estimate] = field(default_factory=list)  # higher/lower zero levels not chosen for their layout


def rank(prof: ModelProfile, dev: Device, specs: Sequence[LayoutSpec], world: int, per_rank_batch: int,
         precision: str) -> Ranking:
    """Predict every spec (global batch = ``dp * per_rank_batch``) and rank them (see the module docstring)."""
    preds = [predict(prof, dev, world, s.dp * per_rank_batch, s, precision) for s in specs]
    groups: dict[tuple[int, int, int], list[Estimate]] = {}
    for e in preds:
        groups.setdefault((e.dp, e.pp, e.mp), []).append(e)
    reps: list[Estimate] = []
    others: list[Estimate] = []
    for rows in groups.values():
        rows.sort(key=lambda e: e.zero)
        fitting = [e for e in rows if e.fits]
        if not fitting:
            best = min(rows, key=lambda e: e.peak_mem_gib)
        else:
            best = fitting[0]  # the lowest zero that fits
            faster = max(fitting, key=lambda e: e.tokens_per_s)
            if faster.tokens_per_s > best.tokens_per_s * (1 + ZERO_MARGIN):
                best = faster
        reps.append(best)
        others += [e for e in rows if e is not best]
    reps.sort(key=lambda e: (not e.fits, -round(e.tokens_per_s, 6), e.mp, e.pp, e.zero))
    chosen = reps[0] if reps and reps[0].fits else None
    if chosen is not None:
        chosen.chosen = True
    return Ranking(reps, chosen, others)


def format_ranking(ranking: Ranking, top: int = 12) -> str:
    """A table of the ranked layouts (one row per ``(dp, pp, mp)`` at its zero level), the chosen one marked.

    Example:
        >>> e = Estimate(2, 1, 2, 0, False, 1, "none", False, True, 0.5, 0.1, 1e4, 0.3, chosen=True)
        >>> print(format_ranking(Ranking([e], e)))
           dp  pp  mp zero micro   peak MiB  step ms  tokens/s fits
        ->  2   1   2    0     1      512.0    100.0    10,000  yes
    """
    lines = ["   dp  pp  mp zero micro   peak MiB  step ms  tokens/s fits"]
    for e in ranking.rows[:top]:
        mark = "->" if e.chosen else "  "
        lines.append(f"{mark} {e.dp:>2}  {e.pp:>2}  {e.mp:>2} {e.zero:>4} {e.microbatches:>5} "
                     f"{e.peak_mem_gib * 1024:>10.1f} {e.step_s * 1e3:>8.1f} {e.tokens_per_s:>9,.0f}"
                     f" {'yes' if e.fits else 'NO'}")
    if len(ranking.rows) > top:
        lines.append(f"   ... {len(ranking.rows) - top} more")
    return "\n".join(lines)


def _gib(x: float) -> str:
    return f"{x / 2**30:.3g} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def refusal(prof: ModelProfile, dev: Device, spec: LayoutSpec, world: int, per_rank_batch: int, precision: str,
            memory_source: str) -> Optional[str]:
    """``None`` when ``spec`` is predicted to fit ``dev``'s memory; else the message refusing it: the predicted
    peak, the device memory (``memory_source`` says where that figure comes from), the largest contributors and
    which changes are predicted to fit.

    Example:
        >>> from lightning_dpmp.planner.gpt_shape import GPTShape
        >>> prof = ModelProfile.from_gpt(GPTShape(layers=4, hidden=256, heads=4, vocab=128, seq=64, batch=8))
        >>> dev = measured_device(1e9, 1e-5, 1e10, 1e10, 4, 30 * 2**20, cpu=True)
        >>> msg = refusal(prof, dev, LayoutSpec(4, 1, 1), 4, 2, "32-true", "a test")
        >>> msg.split(":")[0]
        'DPMPStrategy(dp=4, pp=1, mp=1, zero=0) will not fit'
    """
    gb = spec.dp * per_rank_batch
    est = predict(prof, dev, world, gb, spec, precision)
    if est.fits:
        return None
    mem = est.memory or {}
    top = sorted(((v, k) for k, v in mem.items() if v > 0), reverse=True)[:3]
    limit = dev.memory_gib * 2**30
    tries = []
    for z in (1, 2, 3):
        if z > spec.zero and spec.dp > 1:
            tries.append((f"zero={z}", replace(spec, zero=z)))
    tries.append(("recompute (activation checkpointing of the blocks)", replace(spec, recompute=True)))
    fits = []
    for label, s in tries:
        e = predict(prof, dev, world, gb, s, precision)
        if e.fits:
            fits.append(f"{label}: {_gib(e.peak_mem_gib * 2**30)}")
    others, _ = candidates(prof, world, per_rank_batch, zero="auto", microbatches=-1)
    bigger = [e for e in (predict(prof, dev, world, s.dp * per_rank_batch, s, precision) for s in others)
              if e.fits and (e.mp > spec.mp or e.pp > spec.pp)]
    if bigger:
        b = min(bigger, key=lambda e: e.peak_mem_gib)
        fits.append(f"(dp, pp, mp) = ({b.dp}, {b.pp}, {b.mp}) zero={b.zero}: {_gib(b.peak_mem_gib * 2**30)}")
    suggestion = ("predicted to fit: " + "; ".join(fits)) if fits else \
        "no higher zero level, recomputation or larger mp/pp of this world is predicted to fit: use more devices"
    return (f"DPMPStrategy(dp={spec.dp}, pp={spec.pp}, mp={spec.mp}, zero={spec.zero}) will not fit: the estimator"
            f" predicts a peak of {_gib(est.peak_mem_gib * 2**30)} per rank, over the {_gib(limit)} of device"
            f" memory per rank ({memory_source}). Largest: "
            + ", ".join(f"{k} {_gib(v)}" for v, k in top)
            + f". Set a higher zero, more mp or pp, or recompute; {suggestion}."
            " DPMP_MEMORY_CHECK=0 skips this check; DPMP_DEVICE_MEMORY_GIB sets the memory per rank.")
