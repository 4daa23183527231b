"""What a model's structure says, for the planner: module aliases, shared weights, and the int attributes that
hold the head counts attention code reshapes with (set to per-rank values while the model is parallel).

Example:
    >>> lin = nn.Linear(2, 2); model = nn.ModuleDict({"a": lin, "b": lin})
    >>> module_aliases(model)
    {'a': ['b']}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

from torch import nn

__all__ = ["groups_by", "module_aliases", "resolve_literals", "weight_owners"]


def module_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Other names under which a module object is registered: ``{first name: [further names]}``."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in first:
            out.setdefault(first[id(mod)], []).append(name)
        else:
            first[id(mod)] = name
    return out


def weight_owners(model: nn.Module) -> dict[int, list[str]]:
    """``{id(parameter): [modules holding it]}``, each module object once (under its first name)."""
    canonical = {id(m): n for n, m in model.named_modules()}
    owners: dict[int, list[str]] = {}
    for mod in {id(m): m for m in model.modules()}.values():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(canonical[id(mod)])
    for p in model.parameters():
        owners.setdefault(id(p), [])
    return owners


def groups_by(modules: Mapping[str, nn.Module], key: Any) -> list[list[str]]:
    """Module names grouped by ``key(module)`` (e.g. the weight they share), in module order."""
    out: dict[Any, list[str]] = {}
    for n, m in modules.items():
        out.setdefault(key(m), []).append(n)
    return list(out.values())


def _owner(model: nn.Module, names: set[str]) -> str:
    """The innermost module containing all ``names`` (e.g. the attention block of q/k/v/out)."""
    prefix = os.path.commonprefix([n.split(".") for n in names])
    return ".".join(prefix[:-1] if len(prefix) == min(len(n.split(".")) for n in names) else prefix)


def resolve_literals(model: nn.Module, flow, mp: int) -> tuple[dict[str, dict[str, tuple[int, int]]], dict[str, str]]:
    """Find the int attributes holding the fixed sizes attention code reshapes with; names of unfixable sources."""
    adjust: dict[str, dict[str, tuple[int, int]]] = {}
    broken: dict[str, str] = {}
    for src, values in flow.literals.items():
        if not values:
            continue
        owner_name = _owner(model, {src} | flow.partners.get(src, set()))
        owner = model.get_submodule(owner_name) if owner_name else model
        for v in values:
            attrs = [a for a, x in vars(owner).items() if type(x) is int and x == v and not a.startswith("_")]
            if not attrs or v % mp:
                broken[src] = (
                    f"reshapes to a fixed size {v} in '{owner_name or type(model).__name__}'"
                    + (f" (attribute {attrs[0]} not divisible by mp={mp})" if attrs else " held by no attribute")
                    + "; write view(B, T, -1, head_dim) to allow head-parallel attention"
                )
                continue
            adjust.setdefault(owner_name, {}).update({a: (v, v // mp) for a in attrs})
    for src, scoped in getattr(flow, "scoped", {}).items():
        for scope, v, derived in scoped:  # a constant made in `scope` (zeros((1, self.n_heads, T, S))): its
            found = _attr_up(model, scope, v)  # module's attribute, or the nearest enclosing one's, holds the size
            if found is None and derived:
                continue  # the size was read off a split tensor (q.shape[1]): per-rank at run time by itself
            if found is None or v % mp:
                broken[src] = (
                    f"a constant tensor made in '{scope}' spans the split heads with size {v}"
                    + (f", not divisible by mp={mp}" if found else ", held by no attribute")
                )
                continue
            module_name, attrs = found
            adjust.setdefault(module_name, {}).update({a: (v, v // mp) for a in attrs})
    return adjust, broken


def _attr_up(model: nn.Module, scope: str, value: int) -> Optional[tuple[str, list[str]]]:
    """The innermost module on the path to ``scope`` with public int attributes equal to ``value``."""
    parts = scope.split(".") if scope else []
    for k in range(len(parts), -1, -1):
        name = ".".join(parts[:k])
        module = model.get_submodule(name) if name else model
        attrs = [a for a, x in vars(module).items() if type(x) is int and x == value and not a.startswith("_")]
        if attrs:
            return name, attrs
    return None
