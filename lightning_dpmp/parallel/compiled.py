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

The backend (:func:`exact_backend`) is Inductor, except for a graph that computes part of a float64 forward in a
narrower float dtype: transformers' ``LlamaRMSNorm`` casts to float32 whatever the model's dtype. Eager and the
single-process reference run those float32 ops with the same eager kernels, bit for bit; Inductor's fused kernel
sums them in another order (measured: 4.8e-7 on one norm's output), every block, forward and backward, and AdamW
turns that rounding into weights 1.8e-3 off single-process training after 6 steps (transformers Llama, hidden 256,
dp=1 x mp=2), where eager stays at 3e-8 (1e-11 with the norm in float64). Such a graph is compiled with
``aot_eager`` instead (the same captured graph and autograd, eager kernels: eager's numbers), with a warning naming
the modules. A float32 or lower-precision model keeps Inductor: there every compiled op differs from eager by
rounding anyway, as torch.compile documents.

Example:
    >>> names = compile_blocks(model)      # after the split, before the first step  # doctest: +SKIP
    >>> uncompile_blocks(model)            # eager again (teardown)                  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
from torch import fx, nn

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.entry import SharedInputCopy, shared_entries

__all__ = [
    "compile_blocks",
    "compiled_by_strategy",
    "exact_backend",
    "narrowing_modules",
    "repeated_blocks",
    "uncompile_blocks",
]

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


def _floats(node: fx.Node) -> list[torch.dtype]:
    """Floating dtypes of the tensors a Dynamo graph node produces (its ``example_value`` fake tensors)."""
    value = node.meta.get("example_value")
    values = value if isinstance(value, (tuple, list)) else [value]
    return [v.dtype for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _module_of(node: fx.Node) -> str:
    """The class name of the innermost module a node was traced in ("" outside every module)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    _, cls = list(stack.values())[-1]  # (path, class), the class a type or its qualified name by torch version
    return str(getattr(cls, "__name__", cls)).rsplit(".", 1)[-1]


def narrowing_modules(gm: fx.GraphModule) -> list[str]:
    """Modules (class names, sorted) where a graph that reads float64 tensors computes a narrower float dtype
    from them: the ops Inductor would recompute with its own, differently rounded, low-precision kernels."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or not any(d != torch.float64 for d in _floats(node)):
            continue
        if any(torch.float64 in _floats(arg) for arg in node.all_input_nodes):
            found.add(_module_of(node) or str(node.target))
    return sorted(found)


def exact_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The ``torch.compile`` backend of :func:`compile_blocks`: Inductor, or ``aot_eager`` (eager kernels, eager's
    numbers) for a float64 graph with low-precision islands (:func:`narrowing_modules`), said in a warning."""
    narrow = narrowing_modules(gm)
    if not narrow:
        return compat.compile_backend("inductor")(gm, example_inputs)
    warnings.warn(
        f"compile=True: a compiled block computes part of its float64 forward in a narrower dtype (in "
        f"{', '.join(narrow)}). Inductor would recompute those ops with its own kernels, rounded differently from "
        f"eager's, and the optimizer amplifies that (measured 1.8e-3 off single-process training after 6 AdamW "
        f"steps on a transformers Llama). This graph is compiled with the 'aot_eager' backend instead: the same "
        f"graph, no graph break, eager's numbers, without Inductor's fusion. Compute those modules in float64 or "
        f"train in float32 to get Inductor.",
        stacklevel=2,
    )
    return compat.compile_backend("aot_eager")(gm, example_inputs)


def _without_ddp_split(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, (re)compiled with Dynamo's DDP graph splitting off (:func:`compat.dynamo_without_ddp_split`).

    A block runs inside DDP's forward (dp > 1, zero <= 1), where Dynamo by default splits the block's graph at DDP's
    bucket boundaries (``DDPOptimizer``; 1 MB first bucket). On a split block the backward came out wrong: at
    dp=2 x mp=2 (transformers Llama, hidden 192, float64) the step-0 gradients of the blocks before the last, of
    the embedding and of the last block's first norm were off by up to 70% (the last block's other gradients and
    the forward were exact), weights 3e-2 off single-process training after 6 steps. Unsplit, the block's
    gradients reach DDP's reducer as in eager (its buckets still overlap with the earlier blocks' backward).
    """

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        with compat.dynamo_without_ddp_split():
            return compiled(*args, **kwargs)

    return run


def compile_blocks(module: nn.Module, **compile_kwargs: Any) -> list[str]:
    """Compile each repeated block of ``module`` in place (or ``module`` itself when it has none); returns the
    names compiled ("" for the whole module). ``compile_kwargs`` go to ``torch.compile`` (``backend`` defaults to
    :func:`exact_backend`)."""
    compile_kwargs.setdefault("backend", exact_backend)
    blocks = repeated_blocks(module) or [("", module)]
    for _, block in blocks:
        entries = shared_entries(block)
        if entries:  # eager, around the compiled forward: the entry starts and ends every forward empty
            hook = _reset_entries(entries)
            block.__dict__[_HOOKS] = [block.register_forward_pre_hook(hook), block.register_forward_hook(hook)]
        block.forward = _without_ddp_split(torch.compile(block.forward, **compile_kwargs))
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
