"""User code reading a parameter whose storage is freed between uses: it reads the values, never freed memory.

ZeRO-3 frees each unit's gathered parameters after their use (they are views of a flat buffer whose storage is
resized to 0; a pipeline frees the parameters of the stages a rank does not run, too). A callback that reads such a
parameter (a weight norm in ``on_train_batch_end``, a histogram in ``on_validation_epoch_end``) would read freed
memory: measured on torch 2.13, ``p.pow(2).sum()`` of such a view dies of SIGSEGV, with no traceback.

:class:`GatherOnRead` is a ``TorchFunctionMode`` that, before an op reads a watched parameter that is freed, makes
its values current for the duration of the op (``make_current``: ZeRO-3 gathers its buckets over DP and frees them
again after; a pipeline broadcasts another stage's parameter from the stage that owns it), and copies any output
that still shares the parameter's storage (a ``detach()``, a view), so nothing kept afterwards points at freed
memory. Where no collective can run (another stage's parameter inside a pipeline's schedule, where the ranks run user
code at different times), ``refusal`` names why and the read raises at once.
What the op sees is this rank's parameter as it would be inside a step: the one-process tensor at ``mp=1``, the MP
shard otherwise.

Calls that only read metadata (shape, dtype, storage pointers, ``.grad``, setting ``.data``) pass through; so does
every call while a module's forward runs (the strategy steps the mode aside there, as the layers gather what they
use). Gathering is a collective over the ranks that share the parameter's state (a DP group at ZeRO-3): every
rank must run the reading code, as with DTensors. The op reads a copy; a value read with gradients enabled (an L2
term in ``training_step`` at zero=3) hands its gradient to ``sink`` (the ZeRO engine's accumulator) where there is
one, and a backward reaching it is refused with the reason where there is none (another pipeline stage's
parameter); in-place writes into a freed parameter are refused.

Example:
    >>> import torch
    >>> from contextlib import contextmanager
    >>> full = torch.arange(4.0)
    >>> p = torch.nn.Parameter(full[:2])
    >>> stored = full.untyped_storage()
    >>> _ = stored.resize_(0)  # freed, as ZeRO-3 leaves it between uses
    >>> @contextmanager
    ... def make_current(params):
    ...     stored.resize_(4 * 4); full.copy_(torch.arange(4.0)); yield None; stored.resize_(0)
    >>> with GatherOnRead({id(p)}, lambda t: t.untyped_storage().nbytes() == 0, make_current):
    ...     total = p.detach().sum().item()
    >>> total
    1.0
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor, nn

from lightning_dpmp.parallel.modes import AsideMode, writes_in_place

__all__ = ["GatherOnRead", "GradReads", "outermost_forward_hooks", "storage_freed"]

# Calls that read no element of their tensors: metadata, storage handles, attributes and hooks.
_METADATA = {
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "storage_offset", "untyped_storage",
    "data_ptr", "is_contiguous", "__len__", "get_device", "requires_grad_", "retain_grad", "register_hook",
    "register_post_accumulate_grad_hook", "__hash__", "__setstate__", "__reduce_ex__", "__deepcopy__",
    "__get__", "__set__", "__delete__", "_is_view", "is_floating_point", "is_complex", "type", "has_names",
}


def _tensors(args: tuple, kwargs: dict) -> Iterator[Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, Tensor))


def _swap(x: Any, copies: dict[int, Tensor]) -> Any:
    if isinstance(x, Tensor):
        return copies.get(id(x), x)
    if isinstance(x, (list, tuple)):
        return type(x)(_swap(v, copies) for v in x)
    return x


def storage_freed(t: Tensor) -> bool:
    """Whether ``t`` has elements but its storage was released (``resize_(0)``: ZeRO-3 between uses, a pipeline's
    other stage).

    Example:
        >>> t = torch.ones(3)
        >>> storage_freed(t), t.untyped_storage().resize_(0) is not None, storage_freed(t)
        (False, True, True)
    """
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


class _Read(torch.autograd.Function):
    """A freed parameter's values, read with gradients enabled: a backward through it is refused (at ZeRO-3 or for
    another stage's parameter the gradient would not reach the sharded update)."""

    @staticmethod
    def forward(ctx: Any, param: Tensor, value: Tensor) -> Tensor:
        return value

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        raise RuntimeError(
            "A gradient reached a parameter read outside its layers while its storage was freed (ZeRO-3, or another"
            " pipeline stage's parameter), e.g. an L2 term in training_step: it would not reach the sharded update."
            " Use the optimizer's weight_decay, or pp=1 (where ZeRO takes such a gradient into its update)."
        )


class _SunkRead(torch.autograd.Function):
    """A freed parameter's values, read with gradients enabled, whose gradient is handed to ``sink(param, grad)``
    (ZeRO-3: into the engine's accumulator for the parameter's bucket) instead of reaching the parameter."""

    @staticmethod
    def forward(ctx: Any, sink: Any, param: Tensor, value: Tensor) -> Tensor:
        ctx.sink, ctx.param = sink, param
        return value

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        ctx.sink(ctx.param, grad)
        return None, None, None


class GradReads(Protocol):
    """Gradients whose values are brought on first read (ZeRO's sharded gradients,
    :class:`~lightning_dpmp.parallel.zero_grads.ShardedGrads`)."""

    def owns(self, t: Tensor) -> bool:
        """Whether ``t`` views one of these gradients."""

    def ensure(self, tensors: list[Tensor]) -> None:
        """Make ``tensors`` (each one :meth:`owns`) hold their values (collective)."""

    def written(self, tensors: list[Tensor]) -> None:
        """``tensors`` were written in place: keep what they came from in step."""


def _writes(name: str) -> bool:
    return writes_in_place(name) or name == "__setitem__"  # (``grad[mask] = 0`` writes too)


class GatherOnRead(AsideMode):
    """A ``TorchFunctionMode`` in which an op reading a freed parameter reads its values (see the module docstring).

    Args:
        watched: ``id`` of the parameters to watch (the module's).
        is_freed: whether a watched parameter is freed now; it must answer alike on every rank that takes part in
            ``make_current``'s collectives (ZeRO-3: a bucket's state, the same on its DP ranks).
        make_current: a context in which the given parameters' values can be read: it yields ``None`` when the
            parameters themselves hold them for its duration (ZeRO-3 gathers their buckets), or one tensor of values
            per parameter (another pipeline stage's parameter, received from the stage that owns it).
        refusal: called with the freed parameters before a read makes them current; a message refuses it (raised
            as a ``RuntimeError``), e.g. another stage's parameter inside a pipeline's schedule, where the ranks run
            user code at different times and no collective can bring its value.
        key: what ``watched`` holds of a tensor (``id``; a storage identity also catches views and ``.data``
            aliases of a watched parameter).
        grads: gradients brought on first read (:class:`GradReads`): an op reading one makes it current first,
            and an in-place write into one is reported back.
        sink: where the gradient of a freed parameter read with gradients enabled goes, ``sink(param, grad)``
            (an L2 term in ``training_step`` at ZeRO-3); without one such a backward is refused.
    """

    def __init__(self, watched: set[int], is_freed: Callable[[Tensor], bool],
                 make_current: Callable[[list[Tensor]], AbstractContextManager[Optional[list[Tensor]]]],
                 refusal: Optional[Callable[[list[Tensor]], Optional[str]]] = None, key: Callable[[Tensor], int] = id,
                 grads: Optional[GradReads] = None, sink: Optional[Callable[[Tensor, Tensor], None]] = None
                 ) -> None:
        super().__init__()
        self.watched = watched
        self.is_freed = is_freed
        self.make_current = make_current
        self.refusal = refusal
        self.key = key
        self.grads = grads
        self.sink = sink

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _METADATA:
            return func(*args, **kwargs)
        if self.grads is None:
            return self._read(func, name, args, kwargs)
        grads = [t for t in _tensors(args, kwargs) if self.grads.owns(t)]
        if not grads:
            return self._read(func, name, args, kwargs)
        self.grads.ensure(grads)  # (in argument order: the same on every DP rank)
        out = self._read(func, name, args, kwargs)
        if _writes(name) and args:
            target = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.grads.written([t for t in target if isinstance(t, Tensor) and self.grads.owns(t)])
        return out

    def _read(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        # (each once, in argument order: the same on every rank taking part in make_current's collectives)
        freed = list({id(t): t for t in _tensors(args, kwargs)
                      if self.key(t) in self.watched and self.is_freed(t)}.values())
        if not freed:
            return func(*args, **kwargs)
        name = name or repr(func)
        if name.endswith("_") and not name.endswith("__") and args and args[0] is freed[0]:
            raise RuntimeError(
                f"'{name}' writes into a parameter whose storage is freed between uses (ZeRO-3 or another pipeline"
                " stage's); the write would be lost. Change parameters inside a step, or use zero <= 2 and pp=1."
            )
        refused = self.refusal(freed) if self.refusal is not None else None
        if refused:
            raise RuntimeError(f"'{name}' reads a parameter {refused}")
        with self.make_current(freed) as values:
            # the op reads copies: nothing it returns (a detach(), a view) points at storage freed again after
            held = [t.detach() for t in freed] if values is None else [v.detach() for v in values]
            copies = {id(t): self._differentiable(t, v.clone()) if torch.is_grad_enabled() and t.requires_grad
                      else v.clone() for t, v in zip(freed, held)}
            return func(*_swap(args, copies), **{k: _swap(v, copies) for k, v in kwargs.items()})


    def _differentiable(self, param: Tensor, value: Tensor) -> Tensor:
        if self.sink is None:
            return _Read.apply(param, value)
        return _SunkRead.apply(self.sink, param, value)


def outermost_forward_hooks(module: nn.Module, on_enter: Callable[[], object], on_exit: Callable[[], object]
                            ) -> list[Any]:
    """Forward hooks on every submodule of ``module`` calling ``on_enter`` when the outermost one called starts and
    ``on_exit`` when it ends (also after an error); returns the handles."""
    depth = [0]

    def pre(mod: nn.Module, args: Any) -> None:
        depth[0] += 1
        if depth[0] == 1:
            on_enter()

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            on_exit()

    handles = []
    for mod in module.modules():
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    return handles
