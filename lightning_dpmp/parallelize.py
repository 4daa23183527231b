"""Apply a :class:`~lightning_dpmp.plan.Plan` to a module in place, and consolidate it back.

Parallel layers take the place of the dense ones under the same attribute names, with parameters named
``weight``/``bias`` and registered in the same order, so module names, ``state_dict`` keys and the optimizer's
parameter order are those of the dense model.

Example:
    >>> originals = parallelize(model, plan, grid.mp_group)   # model now holds 1/mp of each split Linear  # doctest: +SKIP
    >>> consolidate(model)                                     # and now the dense layers again  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from lightning_dpmp.comm import gather_from_group, group_size
from lightning_dpmp.layers import ColumnParallelLinear, RowParallelLinear, SharedInputCopy, _ParallelLinear, shard_dims
from lightning_dpmp.plan import Plan

__all__ = ["consolidate", "consolidated_state_dict", "parallelize", "restore", "set_submodule"]


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Replace ``root.<name>`` (dotted) by ``module``, keeping its slot in the parent's module order."""
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, module)


def parallelize(model: nn.Module, plan: Plan, group: Any) -> dict[str, nn.Linear]:
    """Swap every planned ``nn.Linear`` of ``model`` for its parallel form, sliced from the dense weights.

    Returns the dense layers that were replaced, by name, so that a caller can put them back (see
    :func:`restore`); drop the dict to free their memory.
    """
    originals: dict[str, nn.Linear] = {}
    if group_size(group) == 1:
        return originals
    entries: dict[int, SharedInputCopy] = {}
    for name, lp in plan.layers.items():
        if lp.style == "replicate":
            continue
        dense = model.get_submodule(name)
        layer: nn.Module
        if lp.style in ("column", "column_gather"):
            shared = entries.setdefault(lp.entry, SharedInputCopy(group)) if lp.entry >= 0 else None
            layer = ColumnParallelLinear.from_dense(
                dense, group, gather_output=lp.style == "column_gather", shared_input=shared
            )
        else:
            layer = RowParallelLinear.from_dense(dense, group, input_is_parallel=lp.input_is_parallel)
        originals[name] = dense
        set_submodule(model, name, layer)
    return originals


def restore(model: nn.Module, originals: dict[str, nn.Linear]) -> None:
    """Put back the dense layers :func:`parallelize` returned (no communication)."""
    for name, dense in originals.items():
        set_submodule(model, name, dense)


def consolidate(model: nn.Module) -> dict[int, tuple[nn.Parameter, Optional[int]]]:
    """Replace every parallel layer by an ``nn.Linear`` holding the gathered weights (collective over MP).

    Returns ``{id(shard parameter): (dense parameter, split dim or None)}`` so that optimizers can follow
    (:func:`lightning_dpmp.checkpoint.consolidate_optimizer`).
    """
    moved: dict[int, tuple[nn.Parameter, Optional[int]]] = {}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, _ParallelLinear):
            dense = mod.to_dense()
            for pname, dim in mod._shard_dims.items():
                if getattr(mod, pname) is not None:
                    moved[id(getattr(mod, pname))] = (getattr(dense, pname), dim)
            set_submodule(model, name, dense)
    return moved


def consolidated_state_dict(model: nn.Module, group: Any) -> dict[str, Tensor]:
    """``model.state_dict()`` with every split parameter gathered to its dense shape (collective over MP).

    Keys are the dense model's, so the result loads with ``strict=True`` into the plain model.
    """
    dims = shard_dims(model)
    state = model.state_dict()
    for key, dim in dims.items():
        state[key] = gather_from_group(state[key].detach(), group, dim)
    return state

