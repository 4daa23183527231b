"""Plan a LightningModule from one traced step, parallelise it, and check the result numerically.

The sequence, run by :class:`~lightning_dpmp.integration.strategy.DPMPStrategy` at setup on every rank:

1. rank 0 takes the first batch of the stage's dataloader and broadcasts it (all MP ranks must see one batch);
2. each rank runs the step once on the dense model, recording data flow (:mod:`lightning_dpmp.planner.trace`) and, when
   fitting, the dense gradients (the Trainer strategy hands in that run from its record of the first step,
   :class:`~lightning_dpmp.integration.firststep.FirstStep`, made once per setup);
3. rank 0's plan (:mod:`lightning_dpmp.planner.plan`) is broadcast so that every rank applies the same layout;
4. the model is parallelised, and the same step is run again: loss and every gradient shard must match the dense
   ones within a tolerance set by the lowest floating precision the step computes in
   (:func:`~lightning_dpmp.integration.verify.tolerance`; the checks live in :mod:`lightning_dpmp.integration.verify`,
   the side-effect-free step in :func:`~lightning_dpmp.integration.stepdata.isolated`). If they
   do not, the plan falls back in stages (no attention-like pairs, then every split layer self-contained, then
   nothing split), with a :class:`PlanFallbackWarning`.

Nothing trains on a step that cannot be checked without saying so: a plan that could not be verified (no batch, a
step that does not run at setup, no scalar loss) comes with an :class:`UnverifiedPlanWarning`; a step whose dense
result differs between the ranks of one MP group (which see the same batch and weights), or that disagrees with
itself even with nothing split, stops the job on every rank with a
:class:`~lightning_dpmp.integration.verify.PlanVerificationError` saying why.

Every run happens in the stage's mode (training mode when fitting, with dropout switched off by
:class:`~lightning_dpmp.planner.trace.NoDropout`; eval mode otherwise) with all RNG states, buffers and
torchmetrics states saved and restored and ``self.log``
silenced, so training afterwards draws exactly the random numbers, and counts exactly the samples, it would have
without this check. A manual-optimization step is traced with inert optimizers; the losses it back-propagates
are collected instead.

Example:
    >>> cpu = torch.device("cpu")
    >>> result = plan_module(lm, grid, run_step, user_plan=None, verify=True, device=cpu)  # doctest: +SKIP
    >>> print(result.text)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_dpmp.integration.stepdata import isolated
from lightning_dpmp.integration.verify import (
    DenseStep,
    PlanVerificationError,
    all_levels_failed,
    check_mp_agreement,
    check_step,
    record_dense,
    tolerance,
    world_worst,
)
from lightning_dpmp.parallel.bridge import DTensorBridge
from lightning_dpmp.parallel.dtensor_params import DTensorParams
from lightning_dpmp.parallel.grid import Grid
from lightning_dpmp.planner.apply_plan import apply_plan, restore
from lightning_dpmp.planner.plan import Plan, make_plan
from lightning_dpmp.planner.plan_types import PlanResult
from lightning_dpmp.planner.sequence import plan_sequence_parallel
from lightning_dpmp.planner.trace import Trace, first_pass
from lightning_dpmp.planner.user_plan import UserPlan

__all__ = ["PlanFallbackWarning", "UnverifiedPlanWarning", "plan_module"]


class PlanFallbackWarning(UserWarning):
    """The plan first made failed verification; a safer one (fewer or no splits) passed and is trained."""


class UnverifiedPlanWarning(UserWarning):
    """``verify_plan=True`` could not check the plan (no batch, a step that does not run at setup, no loss), or the
    step could not be traced at all (the plan then gathers every split layer's output)."""


def _changes(old: Plan, new: Plan) -> str:
    """What a fallback changed, layer by layer, grouped by the new style and its reason."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, lp in new.layers.items():
        if old.layers[name].style != lp.style:
            groups.setdefault((f"{old.layers[name].style} -> {lp.style}", lp.note), []).append(name)
    parts = []
    for (change, note), names in groups.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        parts.append(f"{shown} {change}" + (f" ({note})" if note else ""))
    return "; ".join(parts)


def _same_layout(a: Plan, b: Plan) -> bool:
    """Whether two plans split every layer alike (notes aside)."""
    strip = lambda p: {n: replace(lp, note="") for n, lp in p.layers.items()}  # noqa: E731
    return strip(a) == strip(b) and a.adjust == b.adjust


def _world_max(values: list[float], device: torch.device) -> list[float]:
    """Each value's MAX over the world (a flag's OR), in one all-reduce."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _conditional_use(module: nn.Module, trace: Optional[Trace], grads: dict) -> tuple[str, ...]:
    """Why the parameters a step uses may vary (see
    :attr:`~lightning_dpmp.planner.plan_types.PlanResult.conditional`), from the traced step: trainable parameters
    that got no gradient, and ops in forward whose result depends on the data."""
    if trace is None:
        return ()
    why = []
    if grads:
        unused = [n for n, p in module.named_parameters() if p.requires_grad and n not in grads]
        if unused:
            why.append(f"{len(unused)} trainable parameters got no gradient in the traced step ({', '.join(unused[:3])}"
                       + (", ..." if len(unused) > 3 else "") + ")")
    ops = sorted({f"{op} in {mod or 'forward'}" for op, mod in trace.data_dependent})
    if ops:
        why.append("data-dependent ops in forward: " + ", ".join(ops[:4]) + (", ..." if len(ops) > 4 else ""))
    return tuple(why)


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sequence_plan(trace: Optional[Trace], plan: Plan, module: nn.Module, mp: int) -> Any:
    if trace is None:
        raise ValueError("sequence_parallel=True needs a traced step (a first batch and a training_step that runs).")
    sp = plan_sequence_parallel(trace, plan, mp, {n for n, _ in module.named_parameters()})
    if sp.problem:
        raise ValueError(f"sequence_parallel=True cannot be applied to {type(module).__name__}: {sp.problem}.")
    return sp


def _warn_if_unverified(
    run: Optional[Callable[[], Any]], trace: Optional[Trace], loss: Optional[Tensor], grads: dict, verify: bool,
    mp: int, notes: list[str], training: bool,
) -> None:
    """An :class:`UnverifiedPlanWarning` (rank 0) naming why the plan goes unchecked; ``mp=1`` splits nothing.

    An evaluation step without a loss (predictions, a ``validation_step`` that only logs) is the rule, not a
    mistake: that only goes into the printout (``notes``).
    """
    if mp <= 1 or (trace is not None and not verify):
        return
    if run is not None and trace is not None and (loss is None or not grads) and not training:
        notes.append("not verified: the step returns no scalar loss with gradients (an evaluation step)")
        return
    if run is None:
        why = next((n for n in notes if n.startswith("no batch")), "no batch to trace")
    elif trace is None:
        why = next((n for n in notes if n.startswith("could not trace")), "the step could not be traced on every rank")
        why += "; the plan keeps every split layer's output gathered (self-contained), costing extra collectives"
    elif loss is None or not grads:
        why = "the step returns no scalar loss with gradients (nothing to compare)"
    else:
        return
    what = "the plan is not verified against the dense step" if verify else "the plan comes from structure alone"
    rank_zero_warn(
        f"DPMPStrategy(mp={mp}): {what}: {why}. Make the step runnable on the first batch at setup, or set the"
        " styles with plan_overrides=..." + ("; DPMPStrategy(verify_plan=False) states that no check is wanted."
                                              if verify else "."),
        category=UnverifiedPlanWarning,
    )


def plan_module(
    module: nn.Module,
    grid: Grid,
    run: Optional[Callable[[], Any]],
    user_plan: UserPlan,
    verify: bool,
    device: torch.device,
    notes: Optional[list[str]] = None,
    rng: Optional[Any] = None,
    sequence_parallel: bool = False,
    precision: str = "32-true",
    training: bool = True,
    distribute: Optional[Callable[[nn.Module], DTensorParams]] = None,
    bridge: Optional[DTensorBridge] = None,
    recorded: Optional[DenseStep] = None,
) -> PlanResult:
    """Trace, plan, parallelise ``module`` in place and (optionally) verify it against the dense step.

    ``run`` executes one step on a fixed batch and returns its output (``None`` when no batch was available:
    the plan then comes from ``user_plan`` and defaults alone); ``training`` says it is a training step, which
    should give a loss to verify with. ``distribute`` turns the split module's parameters into DTensors
    (:class:`~lightning_dpmp.parallel.dtensor_params.DTensorParams`): each candidate plan is then verified on them,
    under ``bridge``, as it will train, and the passing one keeps them (``PlanResult.params``). ``recorded``: the
    dense run of ``run`` made already (:class:`~lightning_dpmp.integration.firststep.FirstStep`), used instead of
    running it again. Collective over the world.
    """
    notes = list(notes or [])
    if recorded is None:
        recorded = record_dense(module, run, training) if run is not None else DenseStep()
    trace, loss_ref, grads_ref, dtype = recorded.trace, recorded.loss, recorded.grads, recorded.dtype
    if recorded.note:
        notes.append(recorded.note)
    if trace is not None and not training:  # generation: one pass per new token, each planned as the first
        trace, repeated = first_pass(trace)
        if repeated:
            notes.append(f"planned from the first complete pass through {repeated} in the step (generation runs"
                         " one per new token), so every pass keeps the split layout"
                         + (f"; the step stopped after it ({trace.error})" if trace.error else "")
                         + (f"; on meta tensors, {len(trace.defaulted)} Python value(s) read before it"
                            f" ({', '.join(sorted(set(trace.defaulted)))}) were taken as 0/False"
                            if trace.defaulted else ""))
        elif trace.error:
            notes.append(f"could not trace the step ({trace.error})")
            trace = None
    conditional = _conditional_use(module, trace, grads_ref)
    branches = tuple(sorted({m for _, m in trace.data_dependent})) if trace is not None else ()
    # one all-reduce: whether any rank failed to trace or saw a step leave parameters out, and one tolerance
    # (hence one verification decision) on every rank
    varies = trace is None or bool(trace.data_dependent) or not grads_ref
    failed_anywhere, conditional_anywhere, varies_anywhere, tol = _world_max(
        [float(trace is None), float(bool(conditional)), float(varies), tolerance(precision, dtype)], device)
    trace = None if failed_anywhere else trace
    if conditional_anywhere and not conditional:
        conditional = ("another rank's traced step left parameters out or branched on the data",)
    # no rank's traced step branched on the data: the parameters it left out are left out by every step
    unreached = () if varies_anywhere else tuple(
        n for n, p in module.named_parameters() if p.requires_grad and n not in grads_ref)
    if verify:
        check_mp_agreement(loss_ref, grads_ref, grid, tol, device)
    checkable = verify and trace is not None and loss_ref is not None and bool(grads_ref) and grid.mp > 1
    # rank 0's, as the plan is (and the warning, from rank 0, names them); its branches, which ZeRO's units follow
    notes, branches, unreached = _broadcast((notes, branches, unreached))
    _warn_if_unverified(run, trace, loss_ref, grads_ref, verify, grid.mp, notes, training)
    fallbacks = {
        1: "pairs through reshapes or attention self-contained",
        2: "no pairs: every split layer self-contained",
        3: "nothing split",
    }
    failed: Optional[Plan] = None
    for level in range(4):
        plan = make_plan(module, grid.mp, trace, user_plan, level=min(level, 2))
        if level == 3:
            for name, lp in plan.layers.items():
                plan.layers[name] = replace(lp, style="replicate", note="fallback")
        if sequence_parallel and grid.mp > 1:
            plan.sequence = _sequence_plan(trace, plan, module, grid.mp)
        plan = _broadcast(plan)  # every rank applies rank 0's plan, and takes the same decisions below
        if failed is not None:
            if _same_layout(failed, plan) and level < 3:
                continue  # this level changes nothing here: it would fail the same way
            notes[-1] += f"; fell back to {fallbacks[level]}: {_changes(failed, plan)}"
        plan.notes += _broadcast(notes)
        text = plan.describe(module)
        originals = apply_plan(module, plan, grid.mp_group, rng)
        if not checkable:
            return PlanResult(plan, text, conditional=conditional, branches=branches, unreached=unreached)
        # mypy: checkable implies a traced run with a loss
        assert run is not None and loss_ref is not None
        losses: list[Tensor] = []
        params = distribute(module) if distribute is not None else None
        with isolated(module, losses):
            try:
                err, reason = check_step(module, run, loss_ref, grads_ref, grid.mp_group, plan, losses, params, bridge)
            finally:
                if rng is not None:
                    rng.exit()
        err, reason = world_worst(err, reason)
        if err <= tol:
            text += (f"\n  verified against the dense step on the first batch: passed (max relative error {err:.1e},"
                     f" tolerance {tol:.0e})")
            if failed is not None:
                rank_zero_warn(
                    f"DPMPStrategy: the plan first made for this model failed verification; a safer one passed and is"
                    f" used ({'; '.join(n for n in notes if n.startswith('verification failed'))}). See the plan"
                    " printout, or set the styles with plan_overrides=...",
                    category=PlanFallbackWarning,
                )
            return PlanResult(plan, text, verified=True, max_error=err, conditional=conditional,
                              branches=branches, params=params, unreached=unreached)
        if params is not None:
            params.release()  # the plain shards again, before the dense layers come back
        if level == 3:  # the same decision on every rank: err is the world's worst
            raise PlanVerificationError(all_levels_failed(err, reason, tol, dtype, notes))
        restore(module, originals)
        if plan.sequence is not None:
            raise ValueError(
                "sequence_parallel=True: the parallel first step disagrees with the dense one"
                f" (relative error {err:.2e}{'; ' + reason if reason else ''}). Code that reads the sequence length"
                " from a sequence-split tensor (e.g. `B, T, C = x.shape` in an attention written inline in a block)"
                " breaks; keep attention in its own module whose input is the normalised hidden state (as GPT's"
                " Block.attn), or use sequence_parallel=False."
            )
        adjusted = ", ".join(f"{m or 'model'}.{a}" for m, attrs in plan.adjust.items() for a in attrs)
        notes.append(
            f"verification failed at level {level} (relative error {err:.2e}{'; ' + reason if reason else ''})"
            + (f" with {adjusted} set to per-rank values" if adjusted else "")
        )
        failed = plan
    raise AssertionError("unreachable")
