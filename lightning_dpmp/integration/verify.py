"""Numerical verification of a plan: the dense first step against the parallel one.

:func:`dense_step` runs the step once on the dense model and keeps its loss, gradients and the lowest floating
dtype it computed in (:class:`LowestFloat`), which sets the :func:`tolerance`. After the plan is applied,
:func:`check_step` runs the same step on the split model and measures the largest relative error of the loss and
of this rank's gradient shards. :func:`check_mp_agreement` first makes sure the ranks of one MP group computed the
same dense step (otherwise no plan could verify), raising :class:`PlanVerificationError` on every rank together.
:func:`~lightning_dpmp.integration.autoplan.plan_module` runs them and decides the fallbacks.

Example:
    >>> layer = nn.Linear(2, 1).double()
    >>> trace, loss, grads, dtype = dense_step(layer, lambda: layer(torch.ones(1, 2, dtype=torch.float64)).sum(), [])
    >>> sorted(grads), dtype, tolerance("64-true", dtype)
    (['bias', 'weight'], torch.float64, 1e-07)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_dpmp.compat import tree_leaves
from lightning_dpmp.integration.stepdata import isolated
from lightning_dpmp.parallel.bridge import DTensorBridge, plain_value
from lightning_dpmp.parallel.clipping import sync_partial_grads
from lightning_dpmp.parallel.comm import group_rank, group_size
from lightning_dpmp.parallel.dtensor_params import DTensorParams
from lightning_dpmp.parallel.grid import Grid
from lightning_dpmp.parallel.sharding import shard_blocks, shard_dims, shard_tensor
from lightning_dpmp.planner.plan import Plan
from lightning_dpmp.planner.trace import Trace, loss_of, trace_step

__all__ = [
    "DenseStep",
    "LowestFloat",
    "PlanVerificationError",
    "all_levels_failed",
    "check_mp_agreement",
    "check_step",
    "compare_grads",
    "dense_step",
    "fingerprint",
    "record_dense",
    "step_loss",
    "tolerance",
    "world_worst",
]


class PlanVerificationError(RuntimeError):
    """The first step cannot be made to agree with the dense one: the step itself is not reproducible across the
    ranks of an MP group or between two runs (raised on every rank together, at setup)."""



def step_loss(out: Any, losses: list[Tensor]) -> Optional[Tensor]:
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


def dense_step(
    module: nn.Module, run: Callable[[], Any], losses: list[Tensor], keep_partial: bool = False
) -> tuple[Optional[Trace], Optional[Tensor], dict, Optional[torch.dtype]]:
    """The traced dense step, its loss and gradients, and the lowest floating dtype it computed in (with
    ``keep_partial``, a step that raised gives its partial trace and no loss)."""
    lowest = LowestFloat(module)
    with torch.enable_grad():
        with lowest:
            trace = trace_step(module, run, keep_partial)
        loss = step_loss(trace.result, losses) if not trace.error else None
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


@dataclass
class DenseStep:
    """One run of the step on the dense model: what :func:`record_dense` keeps (all empty without a batch)."""

    trace: Optional[Trace] = None  # None: the step did not run outside the loop (``note`` says why)
    loss: Optional[Tensor] = None  # detached; None: no scalar loss
    grads: dict[str, Tensor] = field(default_factory=dict)  # parameter name -> dense gradient (a copy)
    dtype: Optional[torch.dtype] = None  # the lowest floating dtype it computed in
    note: str = ""  # why there is no trace, for the plan printout


def record_dense(module: nn.Module, run: Callable[[], Any], training: bool) -> DenseStep:
    """:func:`dense_step` of ``run`` with no side effect on ``module`` (:func:`isolated`: a manual-optimization step's
    losses collected); a step that raises gives no trace and a note saying why. Outside ``training`` (an evaluation
    step) a step that raised after a first pass keeps its partial trace."""
    losses: list[Tensor] = []
    try:
        with isolated(module, losses):
            trace, loss, grads, dtype = dense_step(module, run, losses, keep_partial=not training)
    except Exception as exc:  # a step that cannot run outside the loop
        return DenseStep(note=f"could not trace the step ({type(exc).__name__}: {exc})")
    return DenseStep(trace, loss, grads, dtype)


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


def check_step(
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
            loss = plain_value(step_loss(run(), losses))
            assert loss is not None
            loss.backward()
    except Exception as exc:  # a reshape that cannot take local sizes fails the same way on every rank
        module.zero_grad(set_to_none=True)
        return float("inf"), f"{type(exc).__name__}{locator.where(module)}: {exc}"
    finally:
        locator.remove()
    if params is None:
        return compare_grads(module, loss, loss_ref, grads_ref, group, plan)
    params.grads_to_local()
    with params.local():
        result = compare_grads(module, loss, loss_ref, grads_ref, group, plan)
    params.zero_grad()
    return result


def compare_grads(module: nn.Module, loss: Tensor, loss_ref: Tensor, grads_ref: dict, group: Any, plan: Plan
             ) -> tuple[float, str]:
    """:func:`check_step`'s comparison of the step's loss and local gradients (zeroed after) with the dense ones."""
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


def world_worst(err: float, reason: str) -> tuple[float, str]:
    """The largest error over the world and the reason its rank gave (collective over the world)."""
    if not dist.is_initialized():
        return err, reason
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (err, reason))
    return max(every, key=lambda e: e[0])


def fingerprint(loss: Optional[Tensor], grads: dict) -> list[float]:
    """(loss, sum of squared gradients) of a dense step in float64; NaN where there is none (or only shapes)."""
    nan = float("nan")
    scalar = loss is not None and loss.numel() == 1 and loss.device.type != "meta"
    total = nan
    if grads and all(g.device.type != "meta" for g in grads.values()):
        total = float(sum(g.double().square().sum() for g in grads.values()))
    return [float(loss) if scalar else nan, total]  # type: ignore[arg-type]


def check_mp_agreement(loss: Optional[Tensor], grads: dict, grid: Grid, tol: float, device: torch.device) -> None:
    """Raise on every rank when the ranks of an MP group computed different dense steps (collective over the world).

    They ran the same step on the same batch with the same weights: a difference is the step's, not the plan's (a
    loss scaled by ``self.global_rank``, a non-deterministic op), and no plan could then verify.
    """
    if not dist.is_initialized() or grid.mp <= 1:
        return
    mine = torch.tensor(fingerprint(loss, grads), dtype=torch.float64, device=device)
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
    worst, text = world_worst(worst, text)
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


def all_levels_failed(err: float, reason: str, tol: float, dtype: Optional[torch.dtype], notes: list[str]) -> str:
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
