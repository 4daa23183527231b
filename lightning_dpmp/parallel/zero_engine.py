"""ZeRO-2/3 over the DP group, the schedule: when buckets reduce-scatter gradients and gather parameters.

* **Collectives per unit.** A unit's buckets (one per param group, kind and dtype) are gathered, and their
  gradients reduce-scattered, in one coalesced collective (:func:`~lightning_dpmp.parallel.zero_shard.gather_buckets`,
  :func:`~lightning_dpmp.parallel.zero_shard.reduce_scatter_buckets`): one DP round trip per unit and direction.
* **zero=2.** Parameters stay whole. A unit's gradients are reduce-scattered (SUM, then ``/dp``, as DDP averages)
  as soon as all its parameters' gradients have accumulated (``register_post_accumulate_grad_hook``), so the
  reduce-scatters overlap the rest of the backward; the full gradients are freed; the end of the backward waits
  for them. Under gradient accumulation (:meth:`ZeroEngine.no_sync`) gradients accumulate locally and are
  reduce-scattered once, on the last micro-batch. After the optimizer steps the shards, each bucket is
  all-gathered back into the parameters, all in one collective (:meth:`ZeroEngine.after_step`).
* **zero=3.** Parameters are sharded too. Units are the children of every ``nn.ModuleList``/``nn.Sequential``
  that own parameters (the repeated blocks) plus one root unit for the rest (and for any parameter that two units
  reach: tied weights). A unit is gathered just before its forward (the next one prefetched, asynchronously),
  freed after it, gathered again when the gradient reaches its output (the previous one prefetched), and freed
  once all its parameters' gradients are reduce-scattered, every micro-batch (reduce-scatter is linear: the
  shards' gradients accumulate). The root is gathered at the start of each step (:meth:`ZeroEngine.gather_root`)
  and freed after the optimizer step. A module called several times per step is gathered again for each call.

Example:
    >>> engine = ZeroEngine(module, optimizers, 3, grid.dp_group, split_ids, partial_ids)  # doctest: +SKIP
    >>> optimizers = engine.optimizers                                    # over the shards  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dpmp.parallel.zero_shard import (
    Bucket,
    gather_buckets,
    optimizer_defaults,
    rebuild_optimizer,
    reduce_scatter_buckets,
)

__all__ = ["ZeroEngine", "find_units"]


def find_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost children of ``nn.ModuleList``/``nn.Sequential`` containers that own parameters, in order."""
    units: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()

    def walk(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            full = f"{prefix}{name}"
            if isinstance(mod, (nn.ModuleList, nn.Sequential)) and id(mod) not in inside and any(
                True for _ in child.parameters()
            ):
                units.append((full, child))
                inside.update(id(m) for m in child.modules())
                continue
            walk(f"{full}.", child)

    walk("", module)
    return units


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


class ZeroEngine:
    """Shards ``module``'s parameters stepped by ``optimizers`` over ``dp_group`` (level 2 or 3) and rebuilds the
    optimizers over the shards (:attr:`optimizers`).

    Args:
        module: the (MP-split) module; its parameters become views into the buckets' flat buffers.
        optimizers: the user's optimizers, before their first step.
        level: 2 (gradients and optimizer state sharded) or 3 (parameters too).
        dp_group: the DP process group.
        split: ``id()`` of the parameters that are MP shards; ``partial``: of the sequence-parallel partial ones.
    """

    def __init__(self, module: nn.Module, optimizers: list[Optimizer], level: int, dp_group: Any,
                 split: set[int], partial: set[int]) -> None:
        self.level, self.group = level, dp_group
        self.dp, self.rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.sync = True
        self._queued = False
        opt_of: dict[int, tuple[int, int]] = {}
        for i, opt in enumerate(optimizers):
            for j, g in enumerate(opt.param_groups):
                for p in g["params"]:
                    opt_of.setdefault(id(p), (i, j))
        self.units = find_units(module)  # zero=2 buckets by unit too: each block's reduce-scatter overlaps the backward
        unit_of = self._assign_units(module)
        self._broadcast_from_first(module)
        keyed: dict[tuple[Any, ...], list[nn.Parameter]] = {}
        for p in _unique_params(module):
            key_opt = opt_of.get(id(p)) if p.requires_grad else None
            kind = ("frozen" if key_opt is None else "partial" if id(p) in partial
                    else "split" if id(p) in split else "replicated")
            if kind == "frozen" and level < 3:
                continue  # zero=2 leaves parameters nobody steps as they are
            keyed.setdefault((unit_of.get(id(p), -1), key_opt, kind, p.dtype, p.device), []).append(p)
        self.buckets = [Bucket(ps, key[2], key[0], key[1], dp_group, self.dp, self.rank) for key, ps in keyed.items()]
        self.by_unit: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            self.by_unit.setdefault(b.unit, []).append(b)
        self._trainable_by_unit = {u: [b for b in bs if b.trainable] for u, bs in self.by_unit.items()}
        self.plain_groups = [[dict(g) for g in opt.param_groups] for opt in optimizers]
        self.optimizers = [
            rebuild_optimizer(opt, [[b.shard for b in self.buckets if b.opt_key == (i, j)]
                                    for j in range(len(opt.param_groups))])
            for i, opt in enumerate(optimizers)
        ]
        self._handles: list[Any] = []
        for b in self.buckets:
            if b.trainable:
                for p in b.params:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(b)))
        if level == 3:
            for u, (_, mod) in enumerate(self.units):
                self._handles.append(mod.register_forward_pre_hook(self._pre_forward(u)))
                self._handles.append(mod.register_forward_hook(self._post_forward(u)))
            for b in self.buckets:
                b.free()

    # ------------------------------------------------------------------ setup helpers
    def _assign_units(self, module: nn.Module) -> dict[int, int]:
        """Parameter id -> unit index; one reachable from two units (a tied weight) goes to the root (absent)."""
        seen: dict[int, set[int]] = {}
        for u, (_, mod) in enumerate(self.units):
            for _, p in mod.named_parameters(remove_duplicate=False):
                seen.setdefault(id(p), set()).add(u)
        inside = {id(p) for _, m in self.units for p in m.parameters()}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in inside and not any(name.startswith(f"{n}.") for n, _ in self.units):
                seen.setdefault(id(p), set()).add(-1)  # also reached from outside every unit
        return {pid: next(iter(us)) for pid, us in seen.items() if len(us) == 1 and -1 not in us}

    def _broadcast_from_first(self, module: nn.Module) -> None:
        """DP replicas start from DP rank 0's values, as DDP's constructor makes them (no DDP wrapper here)."""
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in list(_unique_params(module)) + list(module.buffers()):
                if t.device.type != "meta":
                    dist.broadcast(t.data, src=src, group=self.group)

    # ------------------------------------------------------------------ hooks
    def _queue_end_of_backward(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _grad_hook(self, b: Bucket) -> Any:
        def hook(p: Tensor) -> None:
            self._queue_end_of_backward()
            if not (self.sync or self.level == 3):
                return  # accumulating locally (zero=2): one reduce-scatter on the last micro-batch
            b.fired.add(id(p))
            unit = self._trainable_by_unit[b.unit]
            if len(b.fired) == len(b.params) and all(len(x.fired) == len(x.params) for x in unit):
                reduce_scatter_buckets(unit, self.group)  # the unit's buckets in one collective
                if self.level == 3 and b.unit >= 0:
                    for x in unit:
                        x.free()  # every backward use of these parameters has run
        return hook

    def _end_of_backward(self) -> None:
        self._queued = False
        if self.sync or self.level == 3:
            # Parameters that got no gradient this time: whatever is left, in one collective.
            reduce_scatter_buckets([b for b in self.buckets if b.trainable and b.has_grads()], self.group)
            for b in self.buckets:
                b.finish_reduce_scatter()
                b.fired.clear()
        if self.level == 3:
            for u in self.by_unit:
                if u >= 0:
                    self._free(u)

    def _gather(self, u: int, async_op: bool = False) -> None:
        gather_buckets(self.by_unit.get(u, []), self.group, async_op)  # the unit's buckets in one collective

    def _free(self, u: int) -> None:
        for b in self.by_unit.get(u, []):
            b.free()

    def _pre_forward(self, u: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._gather(u)
            if u + 1 < len(self.units):
                self._gather(u + 1, async_op=True)  # prefetch: overlaps this unit's compute
        return hook

    def _post_forward(self, u: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if torch.is_grad_enabled():
                for t in _tensors(out):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(u))
            self._free(u)
        return hook

    def _pre_backward(self, u: int) -> Any:
        def hook(grad: Tensor) -> None:
            self._queue_end_of_backward()
            self._gather(u)
            if u > 0:
                self._gather(u - 1, async_op=True)  # prefetch the unit the backward reaches next
        return hook

    # ------------------------------------------------------------------ the step
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches that accumulate: zero=2 keeps gradients local until the last one."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def gather_root(self) -> None:
        """Before a step's forward (zero=3): the parameters outside every unit."""
        if self.level == 3:
            self._gather(-1)

    def free_root(self) -> None:
        if self.level == 3:
            self._free(-1)

    def after_step(self) -> None:
        """After the optimizer stepped the shards: zero=2 gathers them into the parameters; zero=3 frees the root
        (gathered again, updated, at the next step)."""
        if self.level == 3:
            for b in self.buckets:
                b.free()
            return
        works = [b for b in self.buckets if b.trainable]
        for b in works:
            b.gathered = False  # stale: the shard was updated
        gather_buckets(works, self.group, async_op=False)  # every bucket in one collective

    @contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """The module's parameters whole for the duration (zero=3 gathers and frees again); ``write_back`` copies
        what was written into them back into the shards (a checkpoint load)."""
        was = [b.gathered for b in self.buckets]
        gather_buckets(self.buckets, self.group, async_op=False)
        try:
            yield
        finally:
            if write_back:
                for b in self.buckets:
                    b.params_to_shard()
            if self.level == 3:
                for b, w in zip(self.buckets, was):
                    if not w:
                        b.free()

    # ------------------------------------------------------------------ optimizer state as without ZeRO
    def plain_optimizer(self, i: int, with_state: bool = True) -> Optimizer:
        """Optimizer ``i`` as it would be without ZeRO: the same class over the module's parameters, with the
        current hyper-parameters and (``with_state``, collective over DP) the per-parameter state gathered."""
        sharded = self.optimizers[i]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(pg["params"])}
                  for g, pg in zip(sharded.param_groups, self.plain_groups[i])]
        plain = type(sharded)(groups, **optimizer_defaults(type(sharded), sharded.defaults))
        if with_state:
            for b in self.buckets:
                if b.opt_key is not None and b.opt_key[0] == i and b.shard in sharded.state:
                    for p, st in zip(b.params, b.export_state(sharded.state[b.shard])):
                        plain.state[p] = st
        return plain

    def load_plain(self, i: int, plain: Optimizer) -> None:
        """Take hyper-parameters and per-parameter state from ``plain`` (see :meth:`plain_optimizer`) into the
        shards' optimizer ``i``: this rank's slices (no communication)."""
        sharded = self.optimizers[i]
        for g, pg in zip(sharded.param_groups, plain.param_groups):
            g.update({k: v for k, v in pg.items() if k != "params"})
        sharded.state.clear()
        for b in self.buckets:
            if b.opt_key is not None and b.opt_key[0] == i:
                st = b.import_state([plain.state.get(p) for p in b.params])
                if st:
                    sharded.state[b.shard] = st

    def release(self) -> list[Optimizer]:
        """Undo the sharding: parameters whole with storage of their own, hooks removed; returns the plain
        optimizers with their state (collective over DP)."""
        plains = [self.plain_optimizer(i) for i in range(len(self.optimizers))]
        for h in self._handles:
            h.remove()
        self._handles.clear()
        with torch.no_grad():
            for b in self.buckets:
                b.gather()
                for p in b.params:
                    p.data = p.data.clone()
        self.buckets = []
        self.by_unit, self._trainable_by_unit = {}, {}
        return plains

    def shard_params(self, kind: Optional[str] = None) -> list[nn.Parameter]:
        """The shards (of one ``kind``) that the optimizers step."""
        return [b.shard for b in self.buckets if b.trainable and (kind is None or b.kind == kind)]


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())
