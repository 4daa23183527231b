"""Parameters as DTensors on the grid's mesh: what user code reads of the split model is the one-process model.

After the split, every parameter of the module becomes an ``nn.Parameter`` holding a ``DTensor`` on the grid's
3-D mesh ``("dp", "pp", "mp")`` whose local tensor is this rank's shard (the same storage):

* a parameter split over MP along ``dim`` is ``Shard(dim)`` on ``"mp"`` (torch's chunk layout: a vocabulary that
  ``mp`` does not divide keeps its zero padding rows at the end of the last ranks' shards, which
  ``full_tensor()`` strips and no sum or norm sees); a fused weight split block by block (q|k|v in one tensor, each
  rank holding the same rows of every block) is ``_StridedShard(dim, split_factor=blocks)``, torch's name for
  exactly that layout, and :class:`BlockShard` (its subclass carrying the sizes) where the blocks differ in size,
  so ``full_tensor()`` gives the model's own tensor;
* every other parameter is ``Replicate()``, on every dim.

So a norm, a sum, ``full_tensor()`` or ``state_dict()`` read by user code (Lightning's ``grad_norm``, a
weight-norm callback, an L2 term in ``training_step``, an EMA callback) gives the single-process value, and
``.grad`` (a DTensor with the parameter's placements) the single-process gradient once the DP reduction ran.

The layers never compute on DTensors (no per-op dispatch in forward or backward): while a module's forward runs,
every parameter of its subtree is swapped for a plain tensor (:meth:`DTensorParams.install_hooks`; the outermost
module called swaps for all its submodules). In training that is the plain local ``Parameter`` itself
(:meth:`DTensorParams.compute_on_locals`: the gradients land there, and each DTensor parameter's ``.grad`` wraps
its local one once the strategy's reduction ran); otherwise ``p.to_local()``, a view of the local shard that takes
the gradient back to the DTensor parameter. Everything of our own that works on shards (checkpoints, clipping, the
optimizer step, teardown) runs under :meth:`DTensorParams.local`, where the registered parameters are the plain local
``Parameter`` objects the split made, unchanged, so that nothing below this module needed to learn about DTensors.

Example:
    >>> params = DTensorParams(model, mesh)             # after the split  # doctest: +SKIP
    >>> params.install_hooks()                           # doctest: +SKIP
    >>> with params.local():                             # the plain shards, for the machinery  # doctest: +SKIP
    ...     state = model.state_dict()                   # doctest: +SKIP
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.sharding import (
    Blocks,
    dense_size,
    interleave_blocks,
    shard_blocks,
    shard_dims,
    shard_tensor,
)

__all__ = ["BlockShard", "DTensorParams", "is_dtensor", "local_tensor", "placement_for", "register_missing_ops"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a parameter, a gradient, a value computed from them)."""
    return isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t`` (``t`` itself when it is a plain tensor), sharing its storage, no autograd link."""
    return t._local_tensor if isinstance(t, DTensor) else t


class BlockShard(compat.StridedShard):
    """A fused weight split block by block where the blocks differ in size (q|k|v with fewer key/value heads): each
    rank holds the same share of every block, ``[q_r; k_r; v_r]``, each block padded with zero rows to a multiple of
    the mesh dim's size (:data:`~lightning_dpmp.parallel.sharding.Blocks`).

    torch's ``_StridedShard(dim, split_factor=k)`` describes exactly this layout for ``k`` equal blocks; this
    subclass carries the blocks' sizes, so that ``full_tensor()`` (and any redistribution to or from it) gives the
    model's own tensor, while a reduction treats it as any shard does (local, then summed over the mesh dim).
    Element-wise ops between it and another DTensor replicate it first (torch's strategies do not know it): exact,
    at the cost of a gather.

    Example:
        >>> BlockShard(0, (32, 16, 16))
        BlockShard(dim=0, blocks=(32, 16, 16))
    """

    def __init__(self, dim: int, blocks: tuple[int, ...]) -> None:
        super().__init__(dim, split_factor=len(blocks))
        self.blocks = tuple(blocks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockShard) and other.dim == self.dim and other.blocks == self.blocks

    def __hash__(self) -> int:
        return hash((BlockShard, self.dim, self.blocks))

    def __repr__(self) -> str:
        return f"BlockShard(dim={self.dim}, blocks={self.blocks})"

    def __str__(self) -> str:
        return f"BS({self.dim}, {self.blocks})"

    def _to_replicate_tensor(self, local_tensor: Tensor, mesh: Any, mesh_dim: int, current_logical_shape: Any
                             ) -> Tensor:
        n = mesh.size(mesh_dim=mesh_dim)
        gathered = compat.functional_collectives.all_gather_single(local_tensor.contiguous(), gather_dim=self.dim,
                                                                   group=(mesh, mesh_dim))
        if hasattr(gathered, "wait"):
            gathered = gathered.wait()
        return interleave_blocks(list(gathered.chunk(n, dim=self.dim)), self.dim, self.blocks)

    def _replicate_to_shard(self, local_tensor: Tensor, mesh: Any, mesh_dim: int, shard_index: int) -> Tensor:
        return shard_tensor(local_tensor, self.dim, mesh.size(mesh_dim=mesh_dim), shard_index, self.blocks).clone()

    def _split_tensor(self, tensor: Tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True) -> tuple[list[Tensor], list[int]]:
        pieces = [shard_tensor(tensor, self.dim, num_chunks, r, self.blocks) for r in range(num_chunks)]
        return [p.contiguous() if contiguous else p for p in pieces], [0] * num_chunks  # equal by construction


def placement_for(dim: Optional[int], blocks: Blocks) -> Any:
    """The ``"mp"`` placement of a parameter split along ``dim`` (``None``: replicated) in ``blocks`` fused blocks.

    Example:
        >>> placement_for(None, 1), placement_for(0, 1), placement_for(0, 3), placement_for(0, (8, 4, 4))
        (Replicate(), Shard(dim=0), _StridedShard(dim=0, sf=3), BlockShard(dim=0, blocks=(8, 4, 4)))
    """
    if dim is None:
        return Replicate()
    if isinstance(blocks, int) and blocks > 1:
        return compat.StridedShard(dim, split_factor=blocks)
    if isinstance(blocks, tuple) and len(blocks) > 1:
        return BlockShard(dim, blocks)
    return Shard(dim)  # equal parts, or one padded block (torch's chunk layout: the padding at the end)


@functools.lru_cache(maxsize=None)
def register_missing_ops() -> None:
    """Teach DTensor the ops it lacks that Lightning's own paths run on gradients (once per process):
    ``aten._is_any_true`` (autograd's anomaly mode, ``Trainer(detect_anomaly=True)``, checks every gradient a
    backward node returns with it) on the whole tensor, replicated first (a debug mode: exact, not fast)."""
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(compat.any_true_op())
    def _any_true(x: Any) -> list[tuple[list[Any], list[Any]]]:
        return [([Replicate()], [Replicate()])]


class _Slot:
    """One registration of a parameter: ``module._parameters[name]``."""

    __slots__ = ("module", "name", "index")

    def __init__(self, module: nn.Module, name: str, index: int) -> None:
        self.module, self.name, self.index = module, name, index


class DTensorParams:
    """The parameters of ``module`` as DTensors on ``mesh`` (registered) and as the split's plain local tensors.

    Built after the split (collective-free: every placement and shape comes from the layers), it replaces each
    registration ``module._parameters[name]`` by an ``nn.Parameter(DTensor)`` sharing the local tensor's storage;
    tied parameters stay one object. ``local(p)`` and ``dtensor(p)`` map between the two.

    Args:
        module: the split module.
        mesh: the grid's ``DeviceMesh`` with dims ``("dp", "pp", "mp")``.
        mp: the MP width (sizes of padded and fused layouts).
    """

    def __init__(self, module: nn.Module, mesh: Any, mp: int) -> None:
        register_missing_ops()
        self.module, self.mesh = module, mesh
        self._mp_dim = mesh.mesh_dim_names.index("mp")
        dims, blocks = shard_dims(module), shard_blocks(module)
        self.locals: list[nn.Parameter] = []  # the split's Parameter objects, one per distinct parameter
        self.dtensors: list[nn.Parameter] = []
        self._index: dict[int, int] = {}  # id(local or DTensor parameter) -> index
        self._slots: list[_Slot] = []
        for prefix, mod in module.named_modules(remove_duplicate=False):
            for name, p in list(compat.own_parameters(mod).items()):
                if p is None:
                    continue
                if isinstance(p, DTensor):
                    raise ValueError(f"{prefix}.{name} is a DTensor already: DTensorParams distributes a module once")
                full = f"{prefix}.{name}" if prefix else name
                i = self._index.get(id(p))
                if i is None:
                    i = len(self.locals)
                    self._index[id(p)] = i
                    d = self._distribute(p, dims.get(full), blocks.get(full, 1), mp)
                    self._index[id(d)] = i
                    self.locals.append(p)
                    self.dtensors.append(d)
                self._slots.append(_Slot(mod, name, i))
        self._by_module: dict[int, list[_Slot]] = {}
        for slot in self._slots:
            self._by_module.setdefault(id(slot.module), []).append(slot)
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []  # compute_on_locals' hand-over hooks, removed by release()
        self._depth = 0
        self._localized = 0  # inside local(): the hooks leave the registration alone
        self._on_enter: Optional[Callable[[], object]] = None
        self._on_exit: Optional[Callable[[], object]] = None
        # a module's forward computes on the plain local Parameters themselves, not on views of the DTensors (under
        # the ZeRO engine, whose hooks and flat buffers are the local Parameters'): see compute_on_locals
        self._on_locals = False
        self._register(self.dtensors)

    def compute_on_locals(self, accumulate: Callable[[nn.Parameter, Tensor], None]) -> None:
        """From now on a module's forward registers the plain local Parameters themselves (their gradients, hooks
        and storage are the ZeRO engine's), and each DTensor parameter is rebuilt on its local Parameter's current
        storage (the engine made it a view of a flat buffer). A gradient that reaches a DTensor parameter (user code
        read it outside the layers: an L2 term in ``training_step``) is handed to ``accumulate(local, grad)``."""
        self._on_locals = True
        rebuilt = [nn.Parameter(self.like(loc, loc.detach()), requires_grad=loc.requires_grad) for loc in self.locals]
        self._index = {k: v for k, v in self._index.items() if k in {id(p) for p in self.locals}}
        for i, d in enumerate(rebuilt):
            self._index[id(d)] = i
            if d.requires_grad:
                self._grad_handles.append(d.register_post_accumulate_grad_hook(self._hand_over(accumulate)))
        self.dtensors = rebuilt
        self._register(self.dtensors)

    @property
    def on_locals(self) -> bool:
        """Whether forwards compute on the plain local Parameters (:meth:`compute_on_locals`): their gradients land
        there, and the DTensor forms' ``.grad`` wrap them only once :meth:`grads_from_local` ran."""
        return self._on_locals

    def _hand_over(self, accumulate: Callable[[nn.Parameter, Tensor], None]) -> Callable[[Tensor], None]:
        # A weak reference: the hook lives in the parameter's C++ autograd metadata, which the garbage collector
        # cannot see, so a strong one would make parameter -> hook -> self -> parameter a cycle it never frees (and
        # with it the mesh and its process groups: 9 gloo threads per rank per job at (2, 2), woken by gloo's
        # timers, in a process that runs jobs one after another)
        owner = weakref.ref(self)

        def hook(d: Tensor) -> None:
            params = owner()
            g = d.grad
            d.grad = None
            if g is not None and params is not None:
                accumulate(*params.local_grad(d, g))
        return hook

    def like(self, p: Tensor, local: Tensor) -> Tensor:
        """A DTensor laid out as ``p``'s DTensor form (either form given: mesh, placements, shape, stride) over
        ``local``, this rank's part: a value or a gradient of ``p`` built from local storage."""
        d = self.dtensor(p)
        spec = d.data
        placements = spec.placements if isinstance(spec, DTensor) else [Replicate()] * self.mesh.ndim
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=d.shape, stride=d.stride())

    def local_grad(self, p: Tensor, grad: Tensor) -> tuple[nn.Parameter, Tensor]:
        """``p``'s local Parameter and this rank's part of ``grad``, a gradient of ``p``'s DTensor form (one in
        other placements, a Partial sum from a replicated term, is settled into ``p``'s first)."""
        d = self.dtensor(p)
        spec = d.data
        if isinstance(grad, DTensor) and isinstance(spec, DTensor) and tuple(grad.placements) != tuple(spec.placements):
            grad = grad.redistribute(grad.device_mesh, spec.placements)
        return self.local(p), local_tensor(grad)

    def set_modes(self, on_enter: Optional[Callable[[], object]], on_exit: Optional[Callable[[], object]]) -> None:
        """What the outermost module's forward calls when it starts and ends (the modes user code runs under step
        aside), replacing what :meth:`install_hooks` was given."""
        self._on_enter, self._on_exit = on_enter, on_exit

    def _distribute(self, p: nn.Parameter, dim: Optional[int], blocks: Blocks, mp: int) -> nn.Parameter:
        placements = [Replicate()] * self.mesh.ndim
        shape = list(p.shape)
        if dim is not None:
            placements[self._mp_dim] = placement_for(dim, blocks)
            shape[dim] = dense_size(blocks, shape[dim], mp)
        stride = torch.empty(shape, device="meta").stride()
        d = DTensor.from_local(p.detach(), self.mesh, placements, run_check=False, shape=torch.Size(shape),
                               stride=stride)
        return nn.Parameter(d, requires_grad=p.requires_grad)

    # ------------------------------------------------------------------ views
    def _register(self, params: list[nn.Parameter]) -> None:
        for slot in self._slots:
            compat.own_parameters(slot.module)[slot.name] = params[slot.index]

    def local(self, p: Optional[Tensor] = None) -> Any:
        """With a parameter (either form): its plain local ``Parameter``. Without one: a context in which the
        module's registered parameters are the plain local ones (for code that works on shards)."""
        if p is not None:
            return self.locals[self._index[id(p)]]
        return self._local_context()

    def dtensor(self, p: Tensor) -> nn.Parameter:
        """The DTensor parameter of ``p`` (either form)."""
        return self.dtensors[self._index[id(p)]]

    def owns(self, p: Tensor) -> bool:
        return id(p) in self._index

    @contextmanager
    def _local_context(self) -> Iterator[None]:
        registered = [compat.own_parameters(s.module)[s.name] for s in self._slots]
        self._register(self.locals)
        self._localized += 1
        try:
            yield
        finally:
            self._localized -= 1
            for slot, p in zip(self._slots, registered):
                compat.own_parameters(slot.module)[slot.name] = p

    def release(self) -> None:
        """The plain local parameters, registered for good (teardown): no hooks, no DTensor left in the module."""
        self.remove_hooks()
        while self._grad_handles:
            self._grad_handles.pop().remove()
        self.grads_to_local()
        self._register(self.locals)

    # ------------------------------------------------------------------ compute
    def install_hooks(self, on_enter: Optional[Callable[[], object]] = None,
                      on_exit: Optional[Callable[[], object]] = None) -> None:
        """Forward hooks on every module that holds parameters in its subtree: the outermost module called swaps
        its subtree's parameters for local views (``p.to_local()``: the gradient reaches the DTensor) for the
        duration of its forward; ``on_enter``/``on_exit`` run then too (the bridge steps aside)."""
        self._on_enter, self._on_exit = on_enter, on_exit
        subtree: dict[int, list[_Slot]] = {}
        for mod in self.module.modules():
            slots = [s for m in mod.modules() for s in self._by_module.get(id(m), [])]
            if slots:
                subtree[id(mod)] = slots
        for mod in self.module.modules():
            found = subtree.get(id(mod))
            if found:
                self._handles.append(mod.register_forward_pre_hook(self._enter(found)))
                self._handles.append(mod.register_forward_hook(self._exit(found), always_call=True))

    def remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _enter(self, slots: list[_Slot]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._depth += 1
            if self._depth > 1 or self._localized:
                return
            if self._on_enter is not None:
                self._on_enter()
            views: dict[int, Tensor] = {}
            for slot in slots:
                d = self.dtensors[slot.index]
                view = views.get(slot.index)
                if view is None:
                    view = views[slot.index] = (self.locals[slot.index] if self._on_locals
                                                else d.to_local() if isinstance(d, DTensor) else d)
                compat.own_parameters(slot.module)[slot.name] = view  # type: ignore[assignment]  # a view, for the forward

        return hook

    def _exit(self, slots: list[_Slot]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._depth -= 1
            if self._depth > 0 or self._localized:
                return
            for slot in slots:
                compat.own_parameters(slot.module)[slot.name] = self.dtensors[slot.index]
            if self._on_exit is not None:
                self._on_exit()

        return hook

    @contextmanager
    def computing(self, module: nn.Module) -> Iterator[None]:
        """For the duration, what ``module``'s forward hooks make of the registered parameters of its subtree (local
        views, the bridge aside; nothing inside another module's forward): for its forward run outside a module
        call, as activation checkpointing recomputes it in the backward."""
        slots = [s for m in module.modules() for s in self._by_module.get(id(m), [])]
        self._enter(slots)(module, ())
        try:
            yield
        finally:
            self._exit(slots)(module, (), None)

    @property
    def in_forward(self) -> bool:
        """A module forward is running (the registered parameters are local views)."""
        return self._depth > 0

    # ------------------------------------------------------------------ gradients
    def grads_to_local(self) -> None:
        """Each local parameter's ``.grad`` is its DTensor's local gradient (the same storage), or ``None``."""
        for loc, d in zip(self.locals, self.dtensors):
            g = d.grad
            loc.grad = g._local_tensor if isinstance(g, DTensor) else g

    def grads_from_local(self) -> None:
        """Each DTensor parameter's ``.grad`` wraps its local parameter's gradient (after a reduction replaced it)."""
        for loc, d in zip(self.locals, self.dtensors):
            g, current = loc.grad, d.grad
            if g is None:
                if current is not None:
                    d.grad = None
                continue
            if isinstance(current, DTensor) and current._local_tensor is g:
                continue  # (reduced in place: it wraps it already; reading d.data would build a DTensor each time)
            if isinstance(d.data, DTensor):
                d.grad = self.like(d, g)

    def step_locals(self, optimizer: Any) -> None:
        """Point ``optimizer`` at the local parameters of the DTensor ones it was given (its param groups and any
        state it holds, the state's DTensors as their local tensors): it then steps plain tensors. Parameters that
        are not ours are left as they are. Its ``zero_grad`` clears the local gradients; :meth:`clear_stale_grads`
        follows with the DTensors' before the next backward."""
        for group in optimizer.param_groups:
            group["params"] = [self.local(p) if self.owns(p) else p for p in group["params"]]
        for key in [k for k in optimizer.state if isinstance(k, Tensor) and self.owns(k)]:
            state = optimizer.state.pop(key)
            optimizer.state[self.local(key)] = {k: local_tensor(v) if isinstance(v, Tensor) else v
                                                for k, v in state.items()}
        if hasattr(optimizer, "_params"):  # LBFGS keeps its own list of the first group's parameters
            optimizer._params = optimizer.param_groups[0]["params"]

    def clear_stale_grads(self) -> None:
        """A DTensor parameter whose local parameter's gradient was set to ``None`` (an optimizer's ``zero_grad``
        ran on the local parameters) drops its gradient too; run before each backward, which would otherwise
        accumulate into it. (``zero_grad(set_to_none=False)`` zeroes the shared storage in place.)"""
        for loc, d in zip(self.locals, self.dtensors):
            if loc.grad is None and d.grad is not None:
                d.grad = None

    def forget_grads(self) -> None:
        """Drop the DTensor parameters' gradients, keeping the local ones: after :meth:`compute_on_locals` they are
        only user code's view of the local gradients, and a backward about to run (a pipeline's schedule, before
        Lightning's ``zero_grad``) would add its gradients to last step's there."""
        for d in self.dtensors:
            d.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear both forms' gradients (an optimizer over the local parameters cleared theirs)."""
        for loc, d in zip(self.locals, self.dtensors):
            if set_to_none:
                loc.grad = d.grad = None
            else:
                for g in (loc.grad, d.grad):
                    if g is not None:
                        local_tensor(g).zero_()
