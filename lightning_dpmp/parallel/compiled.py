"""``torch.compile`` of a parallelised model, block by block, in place.

The repeated blocks (children of an ``nn.ModuleList`` that own parameters: transformer layers) get a compiled
``forward`` (an instance attribute over the class's), which keeps the module objects and so every parameter name
and state-dict key; one compiled code object then serves every block of the same shape. A model without such a
list is compiled whole. Only ``forward`` is compiled, not ``nn.Module.__call__``: the module's hooks run eagerly
around it, so the ZeRO-3 gather/free hooks (:mod:`lightning_dpmp.parallel.zero_engine`), whose collectives are
asynchronous and whose storage resizes Dynamo cannot trace, never enter the graph.

Inside a block nothing breaks the graph: the collectives are functional ones under compile
(:mod:`lightning_dpmp.parallel.comm`), the shared q/k/v entry is resolved while tracing
(:meth:`~lightning_dpmp.parallel.entry.SharedInputCopy.reset` hooks installed here clear it around each block's
forward), and the dropout RNG switch is skipped when no dropout is active (:mod:`lightning_dpmp.parallel.rng`).

Example:
    >>> names = compile_blocks(model)      # after the split, before the first step  # doctest: +SKIP
    >>> uncompile_blocks(model)            # eager again (teardown)                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_dpmp.parallel.entry import SharedInputCopy

__all__ = ["compile_blocks", "compiled_by_strategy", "repeated_blocks", "uncompile_blocks"]

_HOOKS = "_dpmp_compile_hooks"  # module attribute: the reset hooks' handles, removed by uncompile_blocks
_COMPILED = "_dpmp_compiled"  # module attribute: its ``forward`` instance attribute is ours, removed by uncompile


def repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``nn.ModuleList`` children that own parameters, by name (nested lists stay inside them)."""
    out: list[tuple[str, nn.Module]] = []
    for name, mod in module.named_modules():
        if not isinstance(mod, nn.ModuleList) or any(name.startswith(f"{b}.") for b, _ in out):
            continue
        for i, child in enumerate(mod):
            if next(child.parameters(), None) is not None:
                out.append((f"{name}.{i}" if name else str(i), child))
    return out


def _reset_entries(entries: list[SharedInputCopy]) -> Any:
    def hook(*_: Any) -> None:
        for entry in entries:
            entry.reset()

    return hook


def compile_blocks(module: nn.Module, **compile_kwargs: Any) -> list[str]:
    """Compile each repeated block of ``module`` in place (or ``module`` itself when it has none); returns the
    names compiled ("" for the whole module). ``compile_kwargs`` go to ``torch.compile``."""
    blocks = repeated_blocks(module) or [("", module)]
    for _, block in blocks:
        entries = list({id(e): e for m in block.modules()
                        if isinstance(e := getattr(m, "shared_input", None), SharedInputCopy)}.values())
        if entries:  # eager, around the compiled forward: the entry starts and ends every forward empty
            hook = _reset_entries(entries)
            block.__dict__[_HOOKS] = [block.register_forward_pre_hook(hook), block.register_forward_hook(hook)]
        block.forward = torch.compile(block.forward, **compile_kwargs)
        block.__dict__[_COMPILED] = True
    return [name for name, _ in blocks]


def compiled_by_strategy(module: nn.Module) -> bool:
    """Whether ``module``'s compiled ``forward`` is one :func:`compile_blocks` set (not the user's)."""
    return bool(module.__dict__.get(_COMPILED, False))


def uncompile_blocks(module: nn.Module) -> None:
    """Undo :func:`compile_blocks`: every module of ``module`` runs eagerly again, without the reset hooks."""
    for mod in module.modules():
        for handle in mod.__dict__.pop(_HOOKS, []):
            handle.remove()
        if mod.__dict__.pop(_COMPILED, False):
            mod.__dict__.pop("forward", None)  # the class's forward again
