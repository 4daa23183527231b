"""ZeRO-1/2/3 over the DP group, the schedule: when buckets reduce-scatter gradients and gather parameters.

* **Collectives per unit.** A unit's buckets (one per param group, kind and dtype) are gathered, and their
  gradients reduce-scattered, in one coalesced collective (:func:`~lightning_dpmp.parallel.zero_shard.gather_buckets`,
  :func:`~lightning_dpmp.parallel.zero_shard.reduce_scatter_buckets`): one DP round trip per unit and direction.
* **zero=1 and zero=2** (one schedule). Parameters stay whole. A unit's gradients are reduce-scattered (SUM, then
  ``/dp``, as DDP averages) as soon as all its parameters' gradients have accumulated
  (``register_post_accumulate_grad_hook``), so the reduce-scatters overlap the rest of the backward; the gradients
  are freed as they are flattened for it, and that flat copy when the next unit's reduce-scatter is issued, which
  waits for this one (the last unit's at the end of the backward), so one unit's gradients are held whole at a
  time, beside the one in flight. Under gradient accumulation
  (:meth:`ZeroEngine.no_sync`) gradients accumulate locally and are reduce-scattered once, on the last micro-batch.
  After the optimizer steps the shards, each bucket is all-gathered back into the parameters, all in one collective
  (:meth:`ZeroEngine.after_step`).
* **zero=3.** Parameters are sharded too. Units are the children of every ``nn.ModuleList``/``nn.Sequential``
  that own parameters (the repeated blocks) plus one root unit for the rest (and for any parameter that two units
  reach: tied weights). A unit is gathered just before its forward (the next one prefetched, asynchronously),
  freed after it, gathered again when the gradient reaches its output (the previous one prefetched), and freed
  once all its parameters' gradients are reduce-scattered, every micro-batch (reduce-scatter is linear: the
  shards' gradients accumulate). The root is gathered at the start of each step (:meth:`ZeroEngine.gather_root`)
  and freed after the optimizer step. A module called several times per step is gathered again for each call.
* **zero=3 with** ``reshard_after_forward=False`` (FSDP2's option of that name, and its trade: fewer gathers for
  more bytes held). A unit stays gathered from its forward to its backward: one all-gather per unit and
  micro-batch instead of two. While gradients accumulate locally (:meth:`ZeroEngine.no_sync`: accumulation, and
  a pipeline's schedule, which runs every micro-batch of a step so) the units stay gathered from their first use
  until the synchronised end of the backward, the gradients accumulate whole (in a flat buffer of the bucket's
  reduce dtype, as FSDP2 keeps its unsharded accumulated gradient), and that end reduce-scatters them in one
  collective (a pipeline's :meth:`ZeroEngine.finish_backward`, once per step) and frees the units: under a
  pipeline each stage is gathered once per step and reduce-scattered once, as torch's pipelining schedules drive
  FSDP2 (``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` but on the last
  micro-batch), holding its parameters and gradients whole meanwhile. A forward without gradients (evaluation)
  frees each unit after it, as with ``True``.
* **Steps that leave parameters out** (``conditional=True``: the traced step had data-dependent ops in forward, or
  left trainable parameters without a gradient; experts, LayerDrop, a branch on the data). Every DP rank must issue
  the same collectives whatever its batch touched, and a parameter no rank used must keep a ``None`` gradient (so
  AdamW skips it, as on one process). So each parameter gets its own bucket (its own shard and optimizer state; a
  unit's buckets still go in one collective); a unit reduce-scatters when the backward reaches its inputs (an
  identity autograd function wraps them), never on the gradients this rank happened to produce, and the end of the
  backward reduce-scatters every unit that did not, in unit order, absent gradients as zeros; then one all-reduce
  (MAX) of a used-here flag per bucket tells which shards get a gradient. Units are never the children of a
  container whose enclosing forward branches on the data (LayerDrop could skip them on one rank): those join the
  root.
* **Training part of the buckets** (``apart``, ``skip``, :meth:`ZeroEngine.set_active`). A caller that trains
  only some of the parameters on this rank (a pipeline's stages) keys them with ``apart``: parameters of different
  keys never share a bucket, so each bucket is wholly in or out. :meth:`ZeroEngine.set_active` then restricts the
  step's gathers and reduce-scatters to the buckets it names (:meth:`ZeroEngine.release_buckets` frees the others'
  buffers and shards, :meth:`ZeroEngine.restore_buckets` brings them back), and ``skip`` names the modules whose
  forward stands in for work done elsewhere (their hooks do nothing). Such a caller runs its micro-batches under
  :meth:`ZeroEngine.no_sync`, and :meth:`ZeroEngine.finish_backward` reduce-scatters once per step. The engine
  knows nothing of why: the caller's keys are opaque to it.

Example:
    >>> engine = ZeroEngine(module, optimizers, 3, grid.dp_group, split_ids, partial_ids)  # doctest: +SKIP
    >>> optimizers = engine.optimizers                                    # over the shards  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dpmp.compat import queue_backward_callback, storage_identity
from lightning_dpmp.parallel.freed_reads import storage_freed
from lightning_dpmp.parallel.zero_shard import (
    Bucket,
    gather_buckets,
    optimizer_defaults,
    rebuild_optimizer,
    reduce_scatter_buckets,
)

__all__ = ["ZeroEngine", "find_units"]


def find_units(module: nn.Module, branches: tuple[str, ...] = ()) -> list[tuple[str, nn.Module]]:
    """The outermost children of ``nn.ModuleList``/``nn.Sequential`` containers that own parameters, in order (a
    child without a forward of its own, an ``nn.ModuleDict`` block, gives its members instead: they are what is
    called); not those of a container called from a module (named in ``branches``, ``""`` the root) whose forward
    branched on the data, or from inside one: a step may skip them on one rank."""
    units: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()

    def may_skip(container: str) -> bool:
        parent = container.rpartition(".")[0]
        return any(b == "" or b == parent or parent.startswith(f"{b}.") for b in branches)

    def add(full: str, child: nn.Module) -> None:
        if type(child).forward is nn.Module.forward:  # a ModuleDict block is never called, its members are
            for name, member in child.named_children():
                if any(True for _ in member.parameters()):
                    add(f"{full}.{name}", member)
            return
        units.append((full, child))
        inside.update(id(m) for m in child.modules())

    def walk(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            full = f"{prefix}{name}"
            if isinstance(mod, (nn.ModuleList, nn.Sequential)) and id(mod) not in inside and any(
                True for _ in child.parameters()
            ) and not may_skip(prefix[:-1]):
                add(full, child)
                continue
            walk(f"{full}.", child)

    walk("", module)
    return units


def _cast_inputs(dtype: torch.dtype) -> Any:
    """A forward pre-hook casting a module's floating-point tensor arguments to ``dtype`` (mixed precision: the
    compute dtype of the parameters it reads)."""
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != dtype else x

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
    return hook


def _on_output_grads(out: Any, hook: Any) -> None:
    """``hook(grad)`` on each tensor of a module's output that autograd records: it runs when the backward
    reaches that module."""
    if torch.is_grad_enabled():
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(hook)


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


class _BackwardReached(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the gradient has flowed through the whole unit."""

    @staticmethod
    def forward(ctx: Any, reached: Any, *xs: Tensor) -> Any:
        ctx.reached = reached
        out = tuple(x.view_as(x) for x in xs)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        ctx.reached()
        return (None, *grads)


class ZeroEngine:
    """Shards ``module``'s parameters stepped by ``optimizers`` over ``dp_group`` (level 2 or 3) and rebuilds the
    optimizers over the shards (:attr:`optimizers`).

    Args:
        module: the (MP-split) module; its parameters become views into the buckets' flat buffers.
        optimizers: the user's optimizers, before their first step.
        level: 1 or 2 (optimizer state and gradients sharded: one schedule) or 3 (parameters too).
        dp_group: the DP process group.
        split: ``id()`` of the parameters that are MP shards; ``partial``: of the sequence-parallel partial ones.
        conditional: a step may leave parameters out (see the module's docstring); ``branches`` the modules whose
            forward branched on the data in the traced step (``""`` the root's).
        mixed_precision: torch's ``MixedPrecisionPolicy`` (or anything with ``param_dtype``/``reduce_dtype``): the
            parameters are gathered and computed with in ``param_dtype`` (each module's floating inputs cast to
            it), gradients reduce-scattered in ``reduce_dtype``, and the shards the optimizer steps, checkpoints and
            teardown keep the parameters' own dtype (FSDP2's semantics).
        apart: ``id(parameter) -> a key`` (opaque here; a pipeline's: which stages read it): parameters of different
            keys never share a bucket. A parameter whose storage is freed (on a meta-device model, one this rank
            does not train) enters its bucket as zeros.
        skip: ``skip(module)`` true for a unit module whose forward now takes no part (it stands in for work done
            elsewhere): its hooks neither gather, free nor wrap anything.
        reshard_after_forward: zero=3 only: ``False`` keeps each unit gathered from its forward to its backward,
            and while accumulating until the synchronised end of the backward (see the module's docstring).
    """

    def __init__(self, module: nn.Module, optimizers: list[Optimizer], level: int, dp_group: Any,
                 split: set[int], partial: set[int], conditional: bool = False,
                 branches: tuple[str, ...] = (), mixed_precision: Optional[Any] = None,
                 apart: Optional[dict[int, Any]] = None, reshard_after_forward: bool = True,
                 skip: Optional[Callable[[nn.Module], bool]] = None) -> None:
        if not reshard_after_forward and level != 3:
            raise ValueError(f"reshard_after_forward=False applies to zero=3 (zero={level} never frees the parameters)")
        self.level, self.group, self.conditional = level, dp_group, conditional
        self.reshard_after_forward = reshard_after_forward
        self._skip: Callable[[nn.Module], bool] = skip if skip is not None else _never
        param_dtype = getattr(mixed_precision, "param_dtype", None)
        reduce_dtype = getattr(mixed_precision, "reduce_dtype", None)
        self.dp, self.rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.sync = True
        self._queued = False
        # set once the backward reached a unit (zero=3, conditional): a unit's forward now is a recompute (activation
        # checkpointing), which must neither prefetch nor count as a call whose backward is still to come
        self._in_backward = False
        # the units whose reduce-scatter was issued last (see _grad_hook): waited for when the next unit's is issued
        self._in_flight: list[list[Bucket]] = []
        opt_of: dict[int, tuple[int, int]] = {}
        for i, opt in enumerate(optimizers):
            for j, g in enumerate(opt.param_groups):
                for p in g["params"]:
                    opt_of.setdefault(id(p), (i, j))
        # zero=2 buckets by unit too: each block's reduce-scatter overlaps the backward
        self.units = find_units(module, branches if conditional else ())
        unit_of = self._assign_units(module)
        self._broadcast_from_first(module)
        keyed: dict[tuple[Any, ...], list[nn.Parameter]] = {}
        for p in _unique_params(module):
            key_opt = opt_of.get(id(p)) if p.requires_grad else None
            kind = ("frozen" if key_opt is None else "partial" if id(p) in partial
                    else "split" if id(p) in split else "replicated")
            if kind == "frozen" and level < 3:
                continue  # zero=2 leaves parameters nobody steps as they are
            own = id(p) if conditional and kind != "frozen" else 0  # its own shard: its own optimizer state
            part = apart.get(id(p)) if apart is not None else None
            keyed.setdefault((unit_of.get(id(p), -1), key_opt, kind, p.dtype, p.device, own, part), []).append(p)
        self.buckets = [Bucket(ps, key[2], key[0], key[1], dp_group, self.dp, self.rank,
                               param_dtype if ps[0].is_floating_point() else None, reduce_dtype)
                        for key, ps in keyed.items()]
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}  # parameter -> place
        self.by_unit: dict[int, list[Bucket]] = {}
        self._trainable_by_unit: dict[int, list[Bucket]] = {}
        self.active: Optional[set[int]] = None  # set_active: id() of the buckets this rank trains now
        self._index_units()
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
        self._calls: dict[int, int] = {}  # conditional: forward calls of each unit this step, minus backwards reached
        self._fired: set[int] = set()  # conditional: units reduce-scattered in this backward
        if conditional:
            for u, (_, mod) in enumerate(self.units):
                self._handles.append(mod.register_forward_pre_hook(self._wrap_inputs(u), with_kwargs=True))
                if level != 3:  # (zero=3's own output hook marks the backward)
                    self._handles.append(mod.register_forward_hook(self._mark_backward))
        if level == 3:
            for u, (_, mod) in enumerate(self.units):
                self._handles.append(mod.register_forward_pre_hook(self._pre_forward(u)))
                self._handles.append(mod.register_forward_hook(self._post_forward(u)))
            for b in self.buckets:
                b.free()
        if any(b.mixed for b in self.buckets):
            # mixed precision: each module that computes with parameters gets their compute dtype as its inputs'
            # (parameters no bucket holds, frozen ones at zero=2, compute in their own dtype)
            for mod in module.modules():
                floating = [p for p in mod.parameters(recurse=False) if p.is_floating_point()]
                if floating:
                    found = self.locate(floating[0])
                    dtype = found[0].full.dtype if found is not None else floating[0].dtype
                    self._handles.append(mod.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True))

    # ------------------------------------------------------------------ setup helpers
    def _index_units(self) -> None:
        """The buckets of each unit that the step's collectives touch: every bucket, or the active ones."""
        self.by_unit = {}
        for b in self.live():
            self.by_unit.setdefault(b.unit, []).append(b)
        self._trainable_by_unit = {u: [b for b in bs if b.trainable] for u, bs in self.by_unit.items()}

    def live(self) -> list[Bucket]:
        """The buckets a step gathers and reduce-scatters: all of them, or those :meth:`set_active` named."""
        return self.buckets if self.active is None else [b for b in self.buckets if id(b) in self.active]

    def set_active(self, buckets: Optional[list[Bucket]]) -> None:
        """Restrict the step's gathers and reduce-scatters to ``buckets`` (the ones this rank trains now), or lift
        the restriction (``None``: every bucket again). Every rank of the DP group must name the same buckets."""
        self.active = None if buckets is None else {id(b) for b in buckets}
        self._index_units()

    def release_buckets(self, buckets: Sequence[Bucket]) -> None:
        """Free the storage of ``buckets``' gathered buffers and DP shards, their gradients dropped: parameters this
        rank does not train now (their shapes, identities and the optimizers' references stay). Call
        :meth:`set_active` with the others first; :meth:`allocate_shards` and :meth:`restore_buckets` undo it."""
        for b in buckets:
            b.shard.grad = None
            b.free()
            b.shard.untyped_storage().resize_(0)

    def allocate_shards(self, buckets: Sequence[Bucket]) -> None:
        """Give the DP shards of ``buckets`` (released) their storage back, without values: what writes them next
        (a sync from another rank, a checkpoint load) fills them."""
        for b in buckets:
            b.shard.untyped_storage().resize_(b.shard.numel() * b.shard.element_size())

    def restore_buckets(self, buckets: Sequence[Bucket], gather: bool) -> None:
        """Every bucket takes part in the step again; zero=1/2 hold ``buckets`` (released) whole again: with
        ``gather`` their current shards gathered over DP (one collective), else only allocated."""
        self.set_active(None)
        if self.level < 3:
            if gather:
                gather_buckets(list(buckets), self.group, async_op=False)
            else:
                for b in buckets:
                    b.begin_gather()

    def released_bytes(self, buckets: Sequence[Bucket]) -> int:
        """Bytes :meth:`release_buckets` frees of ``buckets`` beside their shards: the buffers zero=1/2 keep
        gathered (zero=3 frees them anyway)."""
        return sum(b.layout.total * b.full.element_size() for b in buckets) if self.level < 3 else 0

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
                if t.device.type != "meta" and not storage_freed(t):  # (freed: not trained here; its caller syncs it)
                    dist.broadcast(t.data, src=src, group=self.group)

    # ------------------------------------------------------------------ hooks
    def _queue_end_of_backward(self) -> None:
        if not self._queued:
            self._queued = True
            queue_backward_callback(self._end_of_backward)

    def _grad_hook(self, b: Bucket) -> Any:
        def hook(p: Tensor) -> None:
            self._queue_end_of_backward()
            if self._holding():
                b.stash_grad(p)  # accumulated whole, in the reduce dtype, until the synchronised end
                return
            if self.conditional or not (self.sync or self.level == 3):
                # conditional: the unit goes when the backward reaches its inputs, whatever this rank produced;
                # accumulating locally (zero=2): one reduce-scatter on the last micro-batch
                return
            b.fired.add(id(p))
            unit = self._trainable_by_unit.get(b.unit, [])
            if len(b.fired) == len(b.params) and all(len(x.fired) == len(x.params) for x in unit):
                # The last unit's reduce-scatter had this unit's backward to run in: wait for it now, so that its
                # flat copy of the gradients goes, as FSDP2 waits for the previous reduce-scatter before the next.
                # Left to the end of the backward, every unit's copy was held at once: the full gradients again.
                self._finish_in_flight()
                reduce_scatter_buckets(unit, self.group)  # the unit's buckets in one collective
                self._in_flight.append(unit)
                for x in unit:
                    # counted afresh: a unit whose parameters take part in several backward passes of one step
                    # (each call under reentrant activation checkpointing, weights shared across depth) is
                    # reduce-scattered once per pass, when all its parameters fired again; left full, the next
                    # pass's first gradient reduce-scattered (and at zero=3 freed) the unit while that pass still
                    # needed its parameters (it crashed reading freed storage)
                    x.fired.clear()
                if self.level == 3 and b.unit >= 0:
                    for x in unit:
                        x.free()  # every backward use of these parameters has run
        return hook

    def _finish_in_flight(self) -> None:
        for unit in self._in_flight:
            for x in unit:
                x.finish_reduce_scatter()
        self._in_flight.clear()

    def accumulate(self, param: nn.Parameter, grad: Tensor) -> None:
        """Add ``grad`` into ``param``'s gradient as autograd's accumulation would, and run what the engine runs
        then (a gradient that reached ``param`` by another route: its DTensor form, read by user code)."""
        found = self.locate(param)
        if found is None or not found[0].trainable:  # (not the engine's to reduce: autograd's accumulation)
            param.grad = grad.detach().clone() if param.grad is None else param.grad.add_(grad.detach())
            return
        # Into the bucket's accumulator, not param.grad: it must not count as the parameter's gradient from its
        # layer (the unit would be reduce-scattered before its layers' gradients arrive). The accumulator goes with
        # the unit's reduce-scatter, or, arriving after it, with one more at the end of the backward.
        found[0].add_grad(param, grad)
        self._queue_end_of_backward()

    def _mark_backward(self, module: nn.Module, args: Any, out: Any) -> None:
        _on_output_grads(out, self._backward_began)

    def _backward_began(self, grad: Tensor) -> None:
        self._in_backward = True
        self._queue_end_of_backward()

    def _wrap_inputs(self, u: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if not torch.is_grad_enabled() or self._in_backward or self._skip(module):
                return None  # no graph, a recompute in the backward (its original call was wrapped), or a module
                # standing in for work done elsewhere
            keys = [("a", i) for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
            keys += [("k", k) for k, v in kwargs.items() if isinstance(v, Tensor) and v.requires_grad]
            if not keys:
                return None  # nothing to reach: the unit goes at the end of the backward
            self._calls[u] = self._calls.get(u, 0) + 1
            new_args, new_kwargs = list(args), dict(kwargs)
            wrapped = _BackwardReached.apply(self._reached(u), *[args[k] if w == "a" else kwargs[k] for w, k in keys])
            for (w, k), t in zip(keys, wrapped if len(keys) > 1 else (wrapped,)):
                if w == "a":
                    new_args[k] = t
                else:
                    new_kwargs[k] = t
            return tuple(new_args), new_kwargs
        return hook

    def _reached(self, u: int) -> Any:
        def reached() -> None:
            self._queue_end_of_backward()
            # (absent: an earlier backward ended since this call's forward, as a pipeline's schedule interleaves
            # micro-batches; then no other call of the unit is pending)
            self._calls[u] = self._calls.get(u, 0) - 1
            if self._calls[u] > 0 or u in self._fired or not (self.sync or self.level == 3) or self._holding():
                return  # an earlier call's backward is still to come, or accumulating locally (zero=2)
            self._fired.add(u)
            reduce_scatter_buckets(self._trainable_by_unit.get(u, []), self.group)
            if self.level == 3:
                self._free(u)  # every backward use of these parameters has run
        return reached

    @property
    def reduces_now(self) -> bool:
        """Whether a backward now ends with the gradients reduce-scattered into the shards (not a micro-batch that
        accumulates locally, nor zero=3 keeping them whole to the synchronised end)."""
        return self.sync or self.level == 3 and not self._holding()

    def _holding(self) -> bool:
        """zero=3 with ``reshard_after_forward=False`` while accumulating: units stay gathered, gradients whole."""
        return self.level == 3 and not self.reshard_after_forward and not self.sync

    def _end_of_backward(self) -> None:
        self._queued, self._in_backward = False, False
        self._calls.clear()
        self._in_flight.clear()  # (waited for below, with every bucket)
        if self._holding():
            return  # the units stay gathered, the gradients accumulate: the synchronised end reduce-scatters
        if self.sync or self.level == 3:
            if self.conditional:
                self._flush_conditional()
            else:
                # Parameters that got no gradient this time: whatever is left, in one collective.
                reduce_scatter_buckets([b for b in self.live() if b.trainable and b.has_grads()], self.group)
                for b in self.live():
                    b.finish_reduce_scatter()
                    b.fired.clear()
            # gradients that arrived after their unit's reduce-scatter (accumulate: a parameter read outside the
            # layers, whose backward ran late): one more, in one collective (every DP rank ran the same read)
            late = [b for b in self.live() if b.trainable and b.stashed]
            if late:
                reduce_scatter_buckets(late, self.group)
                for b in late:
                    b.finish_reduce_scatter()
        self._fired.clear()
        if self.level == 3:
            for u in self.by_unit:
                if u >= 0:
                    self._free(u)

    def _flush_conditional(self) -> None:
        """Every unit not reduce-scattered yet, in unit order (absent gradients as zeros), then which buckets some
        DP rank used: one all-reduce (MAX) of one flag per bucket."""
        late = [p for u in self._fired for b in self._trainable_by_unit[u] for p in b.params if p.grad is not None]
        if late:
            raise RuntimeError(
                f"zero={self.level}: {len(late)} parameters got a gradient after the backward had left their"
                " block (a block called on an input that needs no gradient, or its parameters used outside its"
                " forward); their reduction would depend on each rank's data. Use zero=0 for this model."
            )
        if self.level == 3 and not self.reshard_after_forward:  # (the gradients were kept whole: all at once)
            reduce_scatter_buckets([b for u in self._trainable_by_unit if u not in self._fired
                                    for b in self._trainable_by_unit[u]], self.group)
        for u in self._trainable_by_unit:
            if u not in self._fired:
                reduce_scatter_buckets(self._trainable_by_unit[u], self.group)
        trainable = [b for b in self.live() if b.trainable]
        if trainable:
            flags = torch.tensor([float(b.used_here) for b in trainable], device=trainable[0].full.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            for b, used in zip(trainable, flags.tolist()):
                b.finish_reduce_scatter(used=bool(used))

    def _gather(self, u: int, async_op: bool = False) -> None:
        gather_buckets(self.by_unit.get(u, []), self.group, async_op)  # the unit's buckets in one collective

    def _free(self, u: int) -> None:
        for b in self.by_unit.get(u, []):
            b.free()

    def _pre_forward(self, u: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self._skip(module):
                return  # standing in for work done elsewhere: its parameters take no part
            self._gather(u)
            # prefetch: overlaps this unit's compute; not when activation checkpointing recomputes this forward in
            # the backward, where the next unit is done (and freed) already
            if u + 1 < len(self.units) and not self._in_backward:
                self._gather(u + 1, async_op=True)
        return hook

    def _post_forward(self, u: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if self._skip(module):
                return
            _on_output_grads(out, self._pre_backward(u))
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self._free(u)  # (else kept for its backward, which frees it)
        return hook

    def _pre_backward(self, u: int) -> Any:
        def hook(grad: Tensor) -> None:
            self._backward_began(grad)
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

    def finish_backward(self) -> None:
        """End a backward that ran with gradients kept local (a caller that runs a step's micro-batches under
        :meth:`no_sync`, as a pipeline's schedule does): reduce-scatter what the active buckets hold, as the end of a
        synchronised backward
        would (in one collective), and at zero=3 with ``reshard_after_forward=False`` free the units kept
        gathered. zero=3 otherwise has nothing left: it reduce-scatters at the end of every backward."""
        if self.level == 3 and self.reshard_after_forward:
            return
        old, self.sync = self.sync, True
        try:
            self._end_of_backward()
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
        works = [b for b in self.live() if b.trainable]
        for b in works:
            b.gathered = False  # stale: the shard was updated
        gather_buckets(works, self.group, async_op=False)  # every bucket in one collective

    @contextmanager
    def gathered(self, params: Optional[Sequence[Tensor]] = None, storages: Optional[set[int]] = None
                 ) -> Iterator[None]:
        """The module's parameters (or only the buckets holding ``params``, or whose buffer's storage identity is
        in ``storages``) whole, with their master values, for the duration (zero=3 gathers and frees again; under
        mixed precision a master-dtype buffer stands in for the compute one, and with ``storages`` the compute
        buffer is gathered too: a view of it is being read). Collective over DP."""
        buckets = self.buckets
        if params is not None:
            held = {id(found[0]): found[0] for p in params if (found := self.locate(p)) is not None}
            buckets = [b for b in self.buckets if id(b) in held]  # (in bucket order: the same on every DP rank)
        if storages is not None:
            buckets = [b for b in self.buckets if storage_identity(b.full) in storages]
        was = [b.gathered for b in buckets]
        plain = [b for b in buckets if not b.mixed or storages is not None]
        gather_buckets(plain, self.group, async_op=False)
        for b in buckets:
            if b.mixed:
                b.use_master()  # the master values, not their compute-dtype copies
        try:
            yield
        finally:
            for b in buckets:
                if b.mixed:
                    b.use_compute()
            if self.level == 3:
                for b, w in zip(buckets, was):
                    if not w and (not b.mixed or storages is not None):
                        b.free()

    # ------------------------------------------------------------------ what this rank holds (checkpoints)
    def locate(self, param: Tensor) -> Optional[tuple[Bucket, int]]:
        """The bucket holding ``param`` (a module parameter) and its index there, or ``None``."""
        return self._where.get(id(param))

    def holds_whole(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s parameters hold their current master values whole now (zero=1/2 without mixed
        precision), so a reader needs no DP gather."""
        return bucket.gathered and not bucket.mixed and self.level < 3

    def param_pieces(self, param: Tensor) -> Optional[list[tuple[int, int, Tensor]]]:
        """This rank's slices of ``param``: ``(lo, hi, view)`` with ``view`` the part of the DP shard holding
        elements ``[lo, hi)`` of the flattened (MP-local) parameter; ``None`` if no bucket holds it. Written into,
        they change the shard (a checkpoint load; :meth:`refresh` then regathers what is kept whole)."""
        found = self.locate(param)
        if found is None:
            return None
        b, i = found
        shard = b.shard.detach()
        return [(lo, hi, shard[at : at + hi - lo]) for j, lo, hi, at in b.layout.pieces(b.rank) if j == i]

    def state_pieces(self, optimizer: int, param: Tensor, key: str, dtype: Optional[torch.dtype] = None
                     ) -> Optional[list[tuple[int, int, Tensor]]]:
        """As :meth:`param_pieces`, for the element-wise optimizer state ``key`` (an AdamW moment) of ``param`` in
        optimizer ``optimizer``; ``dtype`` given: allocated as zeros if absent (a load), in the master dtype for a
        floating ``dtype`` (as ``Optimizer.load_state_dict`` casts). ``None`` if absent, or not held in slices."""
        found = self.locate(param)
        if found is None or found[0].opt_key is None or found[0].opt_key[0] != optimizer:
            return None
        b, i = found
        states = self.optimizers[optimizer].state
        flat = states.get(b.shard, {}).get(key)  # (.get: the state is a defaultdict; a save must not add entries)
        if flat is None:
            if dtype is None:
                return None
            dtype = b.shard.dtype if dtype.is_floating_point else dtype
            flat = torch.zeros(b.layout.shard, dtype=dtype, device=b.shard.device)
            states.setdefault(b.shard, {})[key] = flat
        return [(lo, hi, flat[at : at + hi - lo]) for j, lo, hi, at in b.layout.pieces(b.rank) if j == i]

    def refresh(self) -> None:
        """After the shards were written (a checkpoint load): gather them again where the parameters are kept
        gathered (zero=1/2, or a zero=3 unit gathered now), all in one collective over DP."""
        stale = [b for b in self.buckets if b.gathered]
        for b in stale:
            b.gathered = False
        gather_buckets(stale, self.group, async_op=False)

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

    def release(self) -> list[Optimizer]:
        """Undo the sharding: parameters whole with storage of their own, hooks removed; returns the plain
        optimizers with their state (collective over DP)."""
        plains = [self.plain_optimizer(i) for i in range(len(self.optimizers))]
        with torch.no_grad():
            for b in self.detach():
                if b.mixed:
                    b.use_master()  # whole again in the parameters' own dtype (the master values)
                else:
                    b.gather()
                for p in b.params:
                    p.data = p.data.clone()
        return plains

    def detach(self) -> list[Bucket]:
        """Remove the hooks and forget the buckets, gathering nothing; returns the buckets (their shards, and the
        optimizers' state of them, still hold the values): for :meth:`release`, and for a teardown that takes the
        values straight from the shards (:mod:`lightning_dpmp.integration.teardown`)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        buckets, self.buckets = self.buckets, []
        self.by_unit, self._trainable_by_unit = {}, {}
        self._where = {}
        return buckets

    def shard_params(self, kind: Optional[str] = None) -> list[nn.Parameter]:
        """The shards (of one ``kind``) that the optimizers step."""
        return [b.shard for b in self.buckets if b.trainable and (kind is None or b.kind == kind)]


def _never(module: nn.Module) -> bool:
    return False


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())

