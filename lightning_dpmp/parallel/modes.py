"""A ``TorchFunctionMode`` that the strategy enters for user code and takes off the stack while its own code runs.

Both modes user code runs under (:class:`~lightning_dpmp.parallel.bridge.DTensorBridge` and
:class:`~lightning_dpmp.parallel.freed_reads.GatherOnRead`) step aside while a module's forward runs (the layers
compute on plain tensors; a compiled block must not trace a mode) and while the strategy's own bookkeeping runs.

Example:
    >>> mode = AsideMode()
    >>> with mode:
    ...     stepped = mode.step_aside(); inside = compat.current_function_mode() is mode; mode.step_back()
    ...     with mode.aside():
    ...         inside_aside = compat.current_function_mode() is mode
    >>> stepped, inside, inside_aside
    (True, False, False)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.overrides import TorchFunctionMode

import lightning_dpmp.compat as compat

__all__ = ["AsideMode", "writes_in_place"]

# Python's in-place operators, as a TorchFunctionMode sees them (``+=`` on a tensor)
_IN_PLACE_OPERATORS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                       "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def writes_in_place(name: str) -> bool:
    """Whether the torch call named ``name`` writes into its first argument: an ``op_`` method or an in-place
    operator (what both modes user code runs under must tell apart from reads).

    Example:
        >>> writes_in_place("mul_"), writes_in_place("__iadd__"), writes_in_place("mul"), writes_in_place("__add__")
        (True, True, False, False)
    """
    return name.endswith("_") and not name.endswith("__") or name in _IN_PLACE_OPERATORS


class AsideMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` with :meth:`step_aside`/:meth:`step_back` (nestable) and :meth:`leave`."""

    def __init__(self) -> None:
        super().__init__()
        self._aside = 0  # times step_aside took the mode off the stack, still to be put back

    def step_aside(self) -> bool:
        """Take the mode off the stack; only when it is the innermost mode (``__exit__`` pops whatever is). Returns
        whether it did (then :meth:`step_back` puts it back)."""
        if compat.current_function_mode() is self:
            self.__exit__(None, None, None)
            self._aside += 1
            return True
        return False

    def step_back(self) -> None:
        """Undo :meth:`step_aside`."""
        if self._aside:
            self._aside -= 1
            self.__enter__()

    @contextmanager
    def aside(self) -> Iterator[None]:
        """:meth:`step_aside` for the duration (the strategy's own reads of the parameters)."""
        stepped = self.step_aside()
        try:
            yield
        finally:
            if stepped:
                self.step_back()

    def leave(self) -> None:
        """Leave the mode stack for good (teardown), whether it is on it or stepped aside."""
        if compat.current_function_mode() is self:
            self.__exit__(None, None, None)
        self._aside = 0
