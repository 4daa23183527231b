"""What a run leaves at its end: under ZeRO the dense model gathered bucket by bucket straight from the engine's
shards onto the ranks that keep it, and a module an earlier run left split gathered onto rank 0 before the next run
splits it.

**ZeRO's teardown, streamed** (:func:`consolidate_engine`). With ``zero >= 1`` each rank holds 1/dp of the MP-local
optimizer state (and at zero=3 of the parameters) in the engine's flat shards. Releasing the engine first
(:meth:`~lightning_dpmp.parallel.zero_engine.ZeroEngine.release`) and consolidating afterwards made every rank hold
the whole MP-local model and optimizer state at once, although ``consolidate_on_teardown="rank0"`` keeps them on
global rank 0 only. Here the dense modules' shells are built first, without communication (real on the ranks that
keep the model, meta elsewhere), then each bucket's shards are gathered over DP onto the ranks that need them
(``"rank0"``: DP rank 0 of the first pipeline stage, by a ``gather``; ``True``: every rank, by an all-gather), each of
its tensors gathered over MP into its dense parameter and the bucket dropped; the optimizer state follows, flat
tensor by flat tensor. Each shard's storage is freed once it has been read. So no rank ever holds more than what it
keeps afterwards, its shards not yet read, one bucket's flat tensor and one dense tensor: with ``"rank0"`` the other
ranks end with the dense shapes on the meta device, having held nothing full (as zero=0 leaves them). With
``False`` the engine is released as before: every rank keeps its MP-local model and optimizer state, as zero=0 does.
With nothing to gather (mp=1, no engine) ``"rank0"`` still leaves the model on rank 0 alone (:func:`keep_on_rank0`).

**A module a run left split** (``consolidate_on_teardown=False``; :func:`gather_left_split`). The next
``fit``/``validate``/``test``/``predict`` on it plans its own step afresh, so the layers are first gathered onto
global rank 0 over the MP group they were split over (the other ranks keep meta shapes), as a ``"rank0"`` teardown
would have left them; the split then takes the weights from rank 0.

Example:
    >>> optimizers = consolidate_engine(module, grid, engine, optimizers, configs, everywhere=False)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.consolidated import consolidate_optimizer, optimizer_to_meta
from lightning_dpmp.integration.zero import repoint_schedulers
from lightning_dpmp.parallel.comm import group_rank, group_size
from lightning_dpmp.parallel.experts_layer import SHARDS_ATTR
from lightning_dpmp.parallel.sharding import Blocks, DenseGather, ParallelLinear, dense_meta, params_to_meta, shard_dims
from lightning_dpmp.parallel.zero_engine import ZeroEngine
from lightning_dpmp.parallel.zero_shard import Bucket, all_gather_flat
from lightning_dpmp.planner.apply_plan import consolidate

__all__ = ["consolidate_engine", "gather_left_split", "keep_on_rank0"]


class _ShellsOnly(DenseGather):
    """For :func:`~lightning_dpmp.planner.apply_plan.consolidate`: the dense modules' shells and no communication.
    A rank that keeps the model gets a zero-stride stand-in of each dense tensor (one element of memory), so the
    shells are allocated for real there; the values are filled in afterwards, one bucket at a time."""

    def __call__(self, local: Tensor, dim: int, group: Any, blocks: Blocks = 1) -> Optional[Tensor]:
        if not self.keep:
            return None
        shape = dense_meta(local, dim, group, blocks).shape
        return torch.zeros((), dtype=local.dtype, device=local.device).expand(shape)


def _stand_in(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A readable tensor of ``t``'s shape holding one element (zeros): what a bucket's parameter points at until its
    value arrives (under zero=3 its own storage is freed; reading it would be undefined)."""
    return torch.zeros((), dtype=dtype, device=t.device).expand(t.shape)


def _gather_flat(flat: Tensor, group: Any, total: int, to_first: bool) -> Optional[Tensor]:
    """Every DP rank's ``flat`` (a bucket's shard, or an optimizer state of its shape) in rank order: on the group's
    first rank only (``to_first``, a ``gather``; ``None`` elsewhere) or on every rank (an all-gather)."""
    flat = flat.detach().contiguous()
    n = group_size(group)
    if n == 1:
        return flat
    full = torch.empty(total, dtype=flat.dtype, device=flat.device)
    if not to_first:
        all_gather_flat(full, flat, group, async_op=False)
        return full
    if group_rank(group) != 0:
        dist.gather(flat, None, dst=dist.get_global_rank(group, 0), group=group)
        return None
    dist.gather(flat, list(full.chunk(n)), dst=dist.get_global_rank(group, 0), group=group)
    return full


def _shares(t: Tensor, other: Optional[Tensor]) -> bool:
    return other is not None and t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


def _free(t: Tensor) -> None:
    """Release ``t``'s storage now (a shard read for the last time), not when the last reference goes; a storage
    that user code pinned (``p.detach().numpy()``, as a histogram logger reads a parameter, shares it with a numpy
    array and makes it not resizable) goes with its last reference instead."""
    try:
        t.untyped_storage().resize_(0)
    except RuntimeError as err:
        if "not resizable" not in str(err):
            raise


def consolidate_engine(module: nn.Module, grid: Any, engine: ZeroEngine, optimizers: Sequence[Any],
                       scheduler_configs: list[Any], everywhere: bool) -> list[Optimizer]:
    """Undo ``engine`` straight into the dense ``module`` over ``grid`` (collective over the world; see the module
    docstring):
    ``everywhere`` (``consolidate_on_teardown=True``): every rank ends with the plain model and optimizer state;
    else global rank 0 alone, the other ranks with their shapes on the meta device. ``optimizers`` (the engine's,
    as the strategy holds them) give way to the plain ones returned, which the LR schedulers now drive."""
    lm = module
    keep = everywhere or grid.rank == 0
    # "rank0": the first stage's DP groups gather onto their DP rank 0 (every stage holds the synced model), and
    # the MP group of global rank 0 gathers onto it; the other ranks only give their shards, or nothing
    gives = everywhere or grid.pp_rank == 0
    receives = everywhere or (grid.pp_rank == 0 and grid.dp_rank == 0)
    mp_gather = DenseGather(to_first=not everywhere, keep=keep, communicate=receives)
    plains = [engine.plain_optimizer(i, with_state=False) for i in range(len(engine.optimizers))]
    sharded = list(engine.optimizers)
    before = [p for p in lm.parameters()]  # (module order: the same on every rank)
    buckets = engine.detach()
    with torch.no_grad():
        for b in buckets:  # the parameters point at stand-ins; the buffers they viewed are dropped now
            for p in b.params:
                p.data = _stand_in(p, b.shard.dtype)  # (the master dtype, under mixed precision too)
            _free(b.full)
        moved = consolidate(lm, _ShellsOnly(to_first=not everywhere, keep=keep))
        target = {id(p): moved.get(id(p), (p, None, 1)) for p in before}
        if keep:  # the parameters no layer replaced (norms, embeddings kept whole): storage of their own here
            for p in {id(t[0]): t[0] for t in target.values()}.values():
                if p.untyped_storage().nbytes() < p.nbytes:
                    p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        in_buckets = {id(p) for b in buckets for p in b.params}
        for b in buckets:
            full = _gather_flat(b.shard, engine.group, b.layout.total, not everywhere) if gives else None
            for p, off in zip(b.params, b.layout.offsets):
                local = full[off : off + p.numel()].view(p.shape) if full is not None else _stand_in(p, p.dtype)
                _fill(target[id(p)], local, grid.mp_group, mp_gather, keep)
            del full
            _free(b.shard)
        for p in before:  # the others (frozen ones below zero=3) are whole and current: only MP gathers them
            dense, dim, blocks = target[id(p)]
            if id(p) not in in_buckets and dim is not None:
                _fill((dense, dim, blocks), p.detach(), grid.mp_group, mp_gather, keep)
        for i, plain in enumerate(plains):
            consolidate_optimizer(plain, moved, grid.mp_group, mp_gather)  # (no state yet: the parameters follow)
            for b in buckets:
                if b.opt_key is not None and b.opt_key[0] == i:
                    _fill_state(plain, sharded[i].state.get(b.shard, {}), b, target, engine.group, grid.mp_group,
                                mp_gather, keep, gives, everywhere)
    if not keep:  # the rest (buffers stay) on the meta device too: the next setup takes every value from rank 0
        meta = params_to_meta(lm)
        for plain in plains:
            optimizer_to_meta(plain, meta)
    repoint_schedulers(optimizers, plains, scheduler_configs)
    return list(plains)


def _fill(target: tuple[nn.Parameter, Optional[int], Blocks], local: Tensor, mp_group: Any, gather: DenseGather,
          keep: bool) -> None:
    """Copy ``local`` (this rank's MP-local value; a stand-in on a rank that holds none) into its dense parameter:
    gathered over MP first when it is split."""
    dense, dim, blocks = target
    full = local if dim is None else gather(local, dim, mp_group, blocks)
    if keep and full is not None:
        dense.copy_(full)


def _fill_state(plain: Optimizer, shard_state: dict[str, Any], b: Bucket, target: dict[int, Any], dp_group: Any,
                mp_group: Any, gather: DenseGather, keep: bool, gives: bool, everywhere: bool) -> None:
    """``plain``'s per-parameter state for ``b``'s parameters from the shard's (what
    :meth:`~lightning_dpmp.parallel.zero_shard.Bucket.export_state` gives, streamed): element-wise tensors gathered
    over DP, cut per parameter and gathered over MP (meta shapes on a rank that does not keep them), each flat
    tensor freed once read; scalars (AdamW's ``step``) copied."""
    per: list[dict[str, Any]] = [{} for _ in b.params]
    for key, value in shard_state.items():
        if not (isinstance(value, Tensor) and value.shape == b.shard.shape):
            for d in per:
                d[key] = value.clone() if isinstance(value, Tensor) else value
            continue
        full = _gather_flat(value, dp_group, b.layout.total, not everywhere) if gives else None
        for i, (p, off) in enumerate(zip(b.params, b.layout.offsets)):
            dense, dim, blocks = target[id(p)]
            local = full[off : off + p.numel()].view(p.shape) if full is not None else _stand_in(p, value.dtype)
            whole = local if dim is None else gather(local, dim, mp_group, blocks)
            if keep and whole is not None:  # (its own memory: the flat tensor it came from is freed below)
                per[i][key] = whole.clone() if _shares(whole, value) or _shares(whole, full) else whole
            else:
                per[i][key] = torch.empty(dense.shape, dtype=value.dtype, device="meta")
        del full
        _free(value)
    for p, state in zip(b.params, per):
        if state:
            plain.state[target[id(p)][0]] = state


def keep_on_rank0(module: Optional[nn.Module], optimizers: list[Any], global_rank: int) -> None:
    """``consolidate_on_teardown="rank0"`` with nothing split to gather (mp=1, no ZeRO engine): every rank but global
    rank 0 lets its copy of the model and optimizer state go, keeping the dense shapes on the meta device, as a
    gather onto rank 0 leaves them (no communication: rank 0 holds the same values)."""
    lm = module
    if lm is None or global_rank == 0:
        return
    meta = params_to_meta(lm)
    for optimizer in optimizers:
        optimizer_to_meta(compat.unwrap_optimizer(optimizer), meta)


# ---------------------------------------------------------------------------------------------- a module left split
def _split_group(module: nn.Module) -> Any:
    """The MP group ``module``'s split layers were split over (one per module: one run split it)."""
    for mod in module.modules():
        if isinstance(mod, ParallelLinear) and mod.mp > 1:
            return mod.group
        if mod.__dict__.get(SHARDS_ATTR):
            return mod.__dict__["_dpmp_experts_group"]
    return None


def gather_left_split(module: Optional[nn.Module], optimizers: list[Any], global_rank: int) -> bool:
    """Before a run's split: a module that an earlier run left split (``consolidate_on_teardown=False``) is gathered
    onto global rank 0 over the MP group it was split over, with its optimizers' state, and the other ranks keep
    its shapes on the meta device (collective over that run's world: every rank holds such a module, or none does;
    its grid's groups live as long as the process group). Returns whether it was split."""
    lm = module
    if lm is None or not shard_dims(lm) or not (dist.is_available() and dist.is_initialized()):
        return False
    group = _split_group(lm)
    first = group is not None and dist.get_global_rank(group, 0) == 0  # (the MP group global rank 0 is in gathers)
    gather = DenseGather(to_first=True, keep=global_rank == 0, communicate=first)
    moved = consolidate(lm, gather)
    plain = [compat.unwrap_optimizer(o) for o in optimizers]
    for optimizer in plain:
        consolidate_optimizer(optimizer, moved, group, gather)
    if not gather.keep:
        meta = params_to_meta(lm)
        for optimizer in plain:
            optimizer_to_meta(optimizer, meta)
    return True
