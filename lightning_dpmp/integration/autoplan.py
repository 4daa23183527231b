"""Plan a LightningModule from one traced step, parallelise it, and check the result numerically.

The sequence, run by :class:`~lightning_dpmp.integration.strategy.DPMPStrategy` at setup on every rank:

1. rank 0 takes the first batch of the stage's dataloader and broadcasts it (all MP ranks must see one batch);
2. each rank runs the step once on the dense model, recording data flow (:mod:`lightning_dpmp.planner.trace`) and, when
   fitting, the dense gradients;
3. rank 0's plan (:mod:`lightning_dpmp.planner.plan`) is broadcast so that every rank applies the same layout;
4. the model is parallelised, and the same step is run again: loss and every gradient shard must match the dense
   ones within a tolerance set by the lowest floating precision the step computes in (:func:`tolerance`). If they
   do not, the plan falls back in stages (no attention-like pairs, then every split layer self-contained, then
   nothing split), with a :class:`PlanFallbackWarning`.

Nothing trains on a step that cannot be checked without saying so: a plan that could not be verified (no batch, a
step that does not run at setup, no scalar loss) comes with an :class:`UnverifiedPlanWarning`; a step whose dense
result differs between the ranks of one MP group (which see the same batch and weights), or that disagrees with
itself even with nothing split, stops the job on every rank with a :class:`PlanVerificationError` saying why.

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

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_dpmp.compat import (
    collect_rng_states,
    init_optimizers_and_lr_schedulers,
    metric_state_keys,
    set_rng_states,
    tree_leaves,
)
from lightning_dpmp.parallel.bridge import DTensorBridge, plain_value
from lightning_dpmp.parallel.clipping import sync_partial_grads
from lightning_dpmp.parallel.comm import group_rank, group_size
from lightning_dpmp.parallel.dtensor_params import DTensorParams
from lightning_dpmp.parallel.grid import Grid
from lightning_dpmp.parallel.sharding import shard_blocks, shard_dims, shard_tensor
from lightning_dpmp.planner.apply_plan import apply_plan, restore
from lightning_dpmp.planner.plan import Plan, make_plan
from lightning_dpmp.planner.sequence import plan_sequence_parallel
from lightning_dpmp.planner.trace import Trace, first_pass, loss_of, trace_step
from lightning_dpmp.planner.user_plan import UserPlan

__all__ = [
    "LowestFloat",
    "PlanFallbackWarning",
    "PlanResult",
    "PlanVerificationError",
    "UnverifiedPlanWarning",
    "isolated",
    "plan_module",
    "tolerance",
]


class PlanVerificationError(RuntimeError):
    """The first step cannot be made to agree with the dense one: the step itself is not reproducible across the
    ranks of an MP group or between two runs (raised on every rank together, at setup)."""


class PlanFallbackWarning(UserWarning):
    """The plan first made failed verification; a safer one (fewer or no splits) passed and is trained."""


class UnverifiedPlanWarning(UserWarning):
    """``verify_plan=True`` could not check the plan (no batch, a step that does not run at setup, no loss), or the
    step could not be traced at all (the plan then gathers every split layer's output)."""


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
    # the split module's parameters as DTensors (made to verify the plan on them); None when not distributed here
    params: Optional[DTensorParams] = None


class _InertOptimizer:
    """Stands in for an optimizer while a manual-optimization step is traced: steps and zero_grad do nothing."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer, self.param_groups = optimizer, optimizer.param_groups

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        pass

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        return closure() if closure is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _manual_optimization_stand_ins(module: nn.Module, losses: list[Tensor]) -> dict[str, Any]:
    """``optimizers()``/``lr_schedulers()``/``manual_backward`` for tracing a manual-optimization step outside
    the loop: the step's losses are collected instead of back-propagated, and nothing is stepped."""
    optimizers, _ = init_optimizers_and_lr_schedulers(module)
    inert = [_InertOptimizer(o) for o in optimizers]
    return {
        "optimizers": lambda use_pl_optimizer=True: inert[0] if len(inert) == 1 else inert,
        "lr_schedulers": lambda: None,
        "manual_backward": lambda loss, *a, **k: losses.append(loss),
    }


@contextlib.contextmanager
def isolated(module: nn.Module, losses: Optional[list[Tensor]] = None) -> Iterator[None]:
    """Eval mode (a fitting step runner switches to training mode inside), saved RNG states and buffers, and
    silenced ``log``/``log_dict`` for a side-effect-free extra step.

    With ``losses`` and a LightningModule in manual optimization, the losses it back-propagates are collected there.
    """
    rng = collect_rng_states(include_cuda=torch.cuda.is_available())
    modes = [(m, m.training) for m in module.modules()]
    patches: dict[str, Any] = {name: (lambda *a, **k: None) for name in ("log", "log_dict") if hasattr(module, name)}
    if losses is not None and getattr(module, "automatic_optimization", True) is False:
        patches.update(_manual_optimization_stand_ins(module, losses))
    metrics = _metric_states(module)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]  # a train-mode step moves BatchNorm statistics
    module.eval()
    for name, fn in patches.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for metric, state in metrics:  # an extra step must not count in the user's metrics
            metric.__dict__.update(state)
        with torch.no_grad():
            for b, saved in buffers:
                if b.shape == saved.shape:
                    b.copy_(saved)
        for name in patches:
            delattr(module, name)
        for m, mode in modes:
            m.training = mode
        set_rng_states(rng)


def _metric_states(module: nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    """Snapshot of every torchmetrics Metric's accumulated state (tensors cloned, lists copied)."""
    from torchmetrics import Metric

    out = []
    for m in module.modules():
        if isinstance(m, Metric):
            keys = metric_state_keys(m)
            state = {k: m.__dict__.get(k) for k in keys if k in m.__dict__}
            out.append((m, {k: (v.clone() if isinstance(v, Tensor) else list(v) if isinstance(v, list) else v)
                            for k, v in state.items()}))
    return out


def _step_loss(out: Any, losses: list[Tensor]) -> Optional[Tensor]:
    """The step's loss: what it returned, or (manual optimization) the sum of what it back-propagated."""
    loss = loss_of(out)
    if loss is None and losses:
        loss = torch.stack([x.reshape(()) for x in losses]).sum()
    return loss


_FLOAT_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}
_TOLERANCE = {16: 5e-2, 32: 1e-3, 64: 1e-7}


def tolerance(precision: str, dtype: Optional[torch.dtype] = None) -> float:
    """Relative error a correct plan stays under at a Lightning ``precision`` when the lowest floating dtype the
    step computes in is ``dtype``: summation order alone stays far below it; a wrong plan does not.

    Mixed precision computes in 16 bits even where the loss is float32; a float32 loss inside a float64 model (as
    transformers' ``labels=`` loss) rounds like float32, and float16 parameters like float16 whatever the Trainer's
    precision. So the looser of the two wins.
    """
    bits = 64 if precision.startswith("64") else 32 if precision.startswith("32") else 16
    if dtype in _FLOAT_BITS:
        bits = min(bits, _FLOAT_BITS[dtype])
    return _TOLERANCE[bits]


class LowestFloat(TorchFunctionMode):
    """Records the lowest floating dtype among the parameters and every differentiable value a step computes.

    Only values that require grad count: they lie between the parameters and the loss, where the verification
    compares. A float32 constant (rotary frequencies, a mask) computed the same way in both steps does not.

    Example:
        >>> layer = nn.Linear(2, 2).double()
        >>> lowest = LowestFloat(layer)
        >>> with lowest:
        ...     loss = layer(torch.ones(1, 2, dtype=torch.float64)).float().sum()  # a float32 loss
        >>> lowest.dtype
        torch.float32
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.dtype: Optional[torch.dtype] = None
        for p in module.parameters():
            self.see(p)

    def see(self, value: Any) -> None:
        """Count ``value`` (a floating tensor; anything else is ignored)."""
        if isinstance(value, Tensor) and value.dtype in _FLOAT_BITS:
            if self.dtype is None or _FLOAT_BITS[value.dtype] < _FLOAT_BITS[self.dtype]:
                self.dtype = value.dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, Tensor) and leaf.requires_grad:
                self.see(leaf)
        return out


def _dense_grads(
    module: nn.Module, run: Callable[[], Any], losses: list[Tensor], keep_partial: bool = False
) -> tuple[Optional[Trace], Optional[Tensor], dict, Optional[torch.dtype]]:
    """The traced dense step, its loss and gradients, and the lowest floating dtype it computed in (with
    ``keep_partial``, a step that raised gives its partial trace and no loss)."""
    lowest = LowestFloat(module)
    with torch.enable_grad():
        with lowest:
            trace = trace_step(module, run, keep_partial)
        loss = _step_loss(trace.result, losses) if not trace.error else None
        if loss is not None:
            lowest.see(loss)
        grads: dict[str, Tensor] = {}
        if loss is not None and loss.requires_grad and loss.numel() == 1:  # a prediction is not a loss
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
            module.zero_grad(set_to_none=True)
    if trace is not None:
        trace.result = None  # drop the graph
    return trace, (loss.detach() if loss is not None else None), grads, lowest.dtype


class _Locator:
    """Forward hooks on every submodule recording which modules are open: after an exception inside the step, the
    innermost one still open is the layer that raised."""

    def __init__(self, module: nn.Module) -> None:
        self.stack: list[str] = []
        self.handles = []
        for name, mod in module.named_modules():
            if name:
                self.handles.append(mod.register_forward_pre_hook(self._opener(name)))
                self.handles.append(mod.register_forward_hook(self._close))

    def _opener(self, name: str) -> Callable[..., None]:
        def open_(module: nn.Module, args: Any) -> None:
            self.stack.append(name)

        return open_

    def _close(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def where(self, module: nn.Module) -> str:
        if not self.stack:
            return ""
        name = self.stack[-1]
        return f" in '{name}' ({type(module.get_submodule(name)).__name__})"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _check(
    module: nn.Module, run: Callable[[], Any], loss_ref: Tensor, grads_ref: dict, group: Any, plan: Plan,
    losses: list[Tensor], params: Optional[DTensorParams] = None, bridge: Optional[DTensorBridge] = None,
) -> tuple[float, str]:
    """Largest relative error of this rank's loss and gradient shards against the dense step, and where it is.

    Only gradients that exist are compared: a frozen parameter (``requires_grad=False``) has none in either step.
    A gradient present in one step and absent in the other (a frozen flag lost in the split) is an infinite error.
    A step that raises is an infinite error naming the layer that raised. With ``params`` the step runs on the
    DTensor parameters under ``bridge``, as training will (a loss that reads parameters reads the dense values),
    and the local gradients are compared.
    """
    locator = _Locator(module)
    try:
        with torch.enable_grad(), bridge if bridge is not None else contextlib.nullcontext():
            loss = plain_value(_step_loss(run(), losses))
            assert loss is not None
            loss.backward()
    except Exception as exc:  # a reshape that cannot take local sizes fails the same way on every rank
        module.zero_grad(set_to_none=True)
        return float("inf"), f"{type(exc).__name__}{locator.where(module)}: {exc}"
    finally:
        locator.remove()
    if params is None:
        return _compare(module, loss, loss_ref, grads_ref, group, plan)
    params.grads_to_local()
    with params.local():
        result = _compare(module, loss, loss_ref, grads_ref, group, plan)
    params.zero_grad()
    return result


def _compare(module: nn.Module, loss: Tensor, loss_ref: Tensor, grads_ref: dict, group: Any, plan: Plan
             ) -> tuple[float, str]:
    """:func:`_check`'s comparison of the step's loss and local gradients (zeroed after) with the dense ones."""
    if plan.partial_params:  # as the strategy does before each optimizer step
        names = set(plan.partial_params)
        sync_partial_grads([p for n, p in module.named_parameters() if n in names], group)
    dims = shard_dims(module)
    blocks = shard_blocks(module)
    n, r = group_size(group), group_rank(group)
    err = float((loss.detach() - loss_ref).abs() / (loss_ref.abs() + 1e-12))
    where = "the loss"
    # A gradient that is zero in exact arithmetic (a key bias under softmax) is pure rounding noise on both
    # sides; measure each parameter against at least 1% of the largest gradient anywhere.
    floor = 1e-2 * max((g.abs().max().item() for g in grads_ref.values()), default=0.0) + 1e-30
    for name, p in module.named_parameters():
        ref = grads_ref.get(name)
        if ref is None or p.grad is None:
            if (ref is None) != (p.grad is None) and err != float("inf"):
                err = float("inf")
                where = f"{name} (a gradient in the {'parallel' if ref is None else 'dense'} step only)"
            continue
        if name in dims:
            ref = shard_tensor(ref, dims[name], n, r, blocks.get(name, 1))
        scale = max(ref.abs().max().item(), floor)
        e = (p.grad - ref).abs().max().item() / scale
        if e > err:
            err, where = e, name
    module.zero_grad(set_to_none=True)
    return err, f"largest at {where}"


def _world_worst(err: float, reason: str) -> tuple[float, str]:
    """The largest error over the world and the reason its rank gave (collective over the world)."""
    if not dist.is_initialized():
        return err, reason
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (err, reason))
    return max(every, key=lambda e: e[0])


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
    """Why the parameters a step uses may vary (see :attr:`PlanResult.conditional`), from the traced step: trainable
    parameters that got no gradient, and ops in forward whose result depends on the data."""
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


def _fingerprint(loss: Optional[Tensor], grads: dict) -> list[float]:
    """(loss, sum of squared gradients) of a dense step in float64; NaN where there is none (or only shapes)."""
    nan = float("nan")
    scalar = loss is not None and loss.numel() == 1 and loss.device.type != "meta"
    total = nan
    if grads and all(g.device.type != "meta" for g in grads.values()):
        total = float(sum(g.double().square().sum() for g in grads.values()))
    return [float(loss) if scalar else nan, total]  # type: ignore[arg-type]


def _check_mp_agreement(loss: Optional[Tensor], grads: dict, grid: Grid, tol: float, device: torch.device) -> None:
    """Raise on every rank when the ranks of an MP group computed different dense steps (collective over the world).

    They ran the same step on the same batch with the same weights: a difference is the step's, not the plan's (a
    loss scaled by ``self.global_rank``, a non-deterministic op), and no plan could then verify.
    """
    if not dist.is_initialized() or grid.mp <= 1:
        return
    mine = torch.tensor(_fingerprint(loss, grads), dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(grid.mp)]
    dist.all_gather(every, mine, group=grid.mp_group)
    ranks = dist.get_process_group_ranks(grid.mp_group)
    worst, text = 0.0, ""
    for rank, values in zip(ranks[1:], every[1:]):
        parts, diff = [], 0.0
        for i, what in enumerate(("loss", "sum of squared gradients")):
            ref, value = float(every[0][i]), float(values[i])
            if value != value or ref != ref:  # NaN: nothing to compare (no loss, or a NaN step, caught later)
                continue
            d = abs(value - ref) / (abs(ref) + 1e-30)
            diff = max(diff, d)
            if d > tol:
                parts.append(f"{what}: rank {ranks[0]} {ref:.10g}, rank {rank} {value:.10g}")
        if diff > worst:
            worst, text = diff, "; ".join(parts)
    worst, text = _world_worst(worst, text)
    if worst > tol:
        raise PlanVerificationError(
            "DPMPStrategy: the dense training step on the first batch gives different results on the ranks of one"
            f" MP group, which run it on the same batch with the same weights ({text}; relative difference"
            f" {worst:.2e} > tolerance {tol:.0e}). The step depends on the rank (e.g. self.global_rank or"
            " self.local_rank in the loss), draws random numbers that differ between ranks (torch.randn in the step"
            " of an unseeded run: call L.seed_everything), or runs a non-deterministic op, so the MP ranks would"
            " train different models and no plan can be verified. Make the step the same on every rank (model"
            " parallelism needs one step computed by all ranks of an MP group); DPMPStrategy(verify_plan=False)"
            " skips this check."
        )


def _all_levels_failed(err: float, reason: str, tol: float, dtype: Optional[torch.dtype], notes: list[str]) -> str:
    """The message when even the plan that splits nothing disagrees with the dense step."""
    levels = "; ".join(n for n in notes if n.startswith("verification failed"))
    return (
        "DPMPStrategy: the first training step disagrees with the dense one at every fallback level, even with"
        f" nothing split (relative error {err:.2e}, {reason}; tolerance {tol:.0e} for the lowest floating dtype the"
        f" step computes in, {str(dtype).replace('torch.', '') if dtype else 'unknown'}). With nothing split both"
        " runs execute the same code on the same batch and weights, so the step itself is not reproducible: a"
        " non-deterministic op, state the step changes from one call to the next (a counter, a cache, a buffer or"
        " parameter updated in place), or rounding larger than the tolerance (parameters or a loss in a lower"
        f" precision than the Trainer's). Levels: {levels}. To train anyway with an unchecked plan, pass"
        " DPMPStrategy(verify_plan=False), and choose the styles with plan_overrides=... if needed."
    )


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
) -> PlanResult:
    """Trace, plan, parallelise ``module`` in place and (optionally) verify it against the dense step.

    ``run`` executes one step on a fixed batch and returns its output (``None`` when no batch was available:
    the plan then comes from ``user_plan`` and defaults alone); ``training`` says it is a training step, which
    should give a loss to verify with. ``distribute`` turns the split module's parameters into DTensors
    (:class:`~lightning_dpmp.parallel.dtensor_params.DTensorParams`): each candidate plan is then verified on them,
    under ``bridge``, as it will train, and the passing one keeps them (``PlanResult.params``). Collective over
    the world.
    """
    trace, loss_ref, dtype = None, None, None
    grads_ref: dict[str, Any] = {}
    notes = list(notes or [])
    if run is not None:
        try:
            losses: list[Tensor] = []
            with isolated(module, losses):
                trace, loss_ref, grads_ref, dtype = _dense_grads(module, run, losses, keep_partial=not training)
        except Exception as exc:  # a step that cannot run outside the loop
            trace = None
            notes.append(f"could not trace the step ({type(exc).__name__}: {exc})")
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
    failed_anywhere, conditional_anywhere, tol = _world_max(
        [float(trace is None), float(bool(conditional)), tolerance(precision, dtype)], device)
    trace = None if failed_anywhere else trace
    if conditional_anywhere and not conditional:
        conditional = ("another rank's traced step left parameters out or branched on the data",)
    if verify:
        _check_mp_agreement(loss_ref, grads_ref, grid, tol, device)
    checkable = verify and trace is not None and loss_ref is not None and bool(grads_ref) and grid.mp > 1
    # rank 0's, as the plan is (and the warning, from rank 0, names them); its branches, which ZeRO's units follow
    notes, branches = _broadcast((notes, branches))
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
            return PlanResult(plan, text, conditional=conditional, branches=branches)
        # mypy: checkable implies a traced run with a loss
        assert run is not None and loss_ref is not None
        losses = []
        params = distribute(module) if distribute is not None else None
        with isolated(module, losses):
            try:
                err, reason = _check(module, run, loss_ref, grads_ref, grid.mp_group, plan, losses, params, bridge)
            finally:
                if rng is not None:
                    rng.exit()
        err, reason = _world_worst(err, reason)
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
                              branches=branches, params=params)
        if params is not None:
            params.release()  # the plain shards again, before the dense layers come back
        if level == 3:  # the same decision on every rank: err is the world's worst
            raise PlanVerificationError(_all_levels_failed(err, reason, tol, dtype, notes))
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
