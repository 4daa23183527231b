"""Strategy hooks written once: overrides of Lightning's ``Strategy`` methods that only forward the call.

``DPMPStrategy`` binds them in its class body (``save_checkpoint = to_checkpointer("save_checkpoint", "save")``),
so the strategy's file lists what it delegates in one line per hook instead of a method each.

Example:
    >>> class Holder:
    ...     checkpointer = type("C", (), {"remove": staticmethod(lambda path: f"removed {path}")})()
    ...     remove_checkpoint = to_checkpointer("remove_checkpoint", "remove")
    >>> Holder().remove_checkpoint("last.ckpt")
    'removed last.ckpt'
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["leaves_sharded_rng", "to_checkpointer"]


def leaves_sharded_rng(name: str) -> Callable[..., Any]:
    """An override of ``Strategy.<name>`` that leaves the sharded-region RNG stream when the step returns."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._step_then_leave_sharded_rng(name, *args, **kwargs)

    step.__name__ = step.__qualname__ = name
    return step


def to_checkpointer(name: str, method: str) -> Callable[..., Any]:
    """An override of ``Strategy.<name>`` that hands the call to ``self.checkpointer.<method>``."""

    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpointer, method)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"Delegated to :meth:`StrategyCheckpointer.{method}`."
    return hook
