"""What a model's structure says, for the planner: module aliases, shared weights, and the int attributes that
hold the head counts attention code reshapes with (set to per-rank values while the model is parallel).

Example:
    >>> lin = nn.Linear(2, 2); model = nn.ModuleDict({"a": lin, "b": lin})
    >>> module_aliases(model)
    {'a': ['b']}
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
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
    _follow_ratios(model, adjust, broken, flow, mp)
    return adjust, broken


def _follow_ratios(model: nn.Module, adjust: dict[str, dict[str, tuple[int, int]]], broken: dict[str, str],
                   flow: Any, mp: int) -> None:
    """Attributes the code divides by (or into) an adjusted one are adjusted with it, so every size derived from
    the pair stays what it was: ``dim_head = self.inner_dim // self.heads`` in forward keeps 4 when ``heads`` goes
    8 -> 4 only if ``inner_dim`` goes 32 -> 16. Read from the module's code (its ``self.X / self.Y`` expressions),
    never from the names."""
    for module_name, attrs in list(adjust.items()):
        module = model.get_submodule(module_name) if module_name else model
        for other in sorted(_ratio_partners(type(module), set(attrs))):
            value = vars(module).get(other)
            if other in attrs or type(value) is not int:
                continue
            if value % mp:  # the pair cannot both be per rank: that attention stays whole, its module untouched
                why = (f"'{module_name}' divides {other}={value} by an attribute set per rank"
                       f" ({', '.join(sorted(attrs))}), and {value} is not divisible by mp={mp}")
                for src in flow.literals:
                    if _owner(model, {src} | flow.partners.get(src, set())) == module_name:
                        broken[src] = why
                del adjust[module_name]
                break
            attrs[other] = (value, value // mp)


def _ratio_partners(cls: type, attrs: set[str]) -> set[str]:
    """Names ``X`` such that the class's own methods compute ``self.X / self.A``, ``self.X // self.A`` (or with the
    two swapped) for an ``A`` in ``attrs``."""
    out: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            break
        for name, fn in vars(klass).items():
            if name.startswith("__") or name == "extra_repr":  # run at construction or printing, not in the step
                continue
            tree = _parsed(fn)
            if tree is None:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
                    left, right = _self_attr(node.left), _self_attr(node.right)
                    if left and right and (left in attrs) != (right in attrs):
                        out.add(right if left in attrs else left)
    return out


def _parsed(fn: Any) -> Optional[ast.AST]:
    if not inspect.isfunction(fn):
        return None
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):  # no source (a C extension, an interactive session)
        return None


def _self_attr(node: ast.AST) -> Optional[str]:
    """``X`` for the expression ``self.X`` (or ``int(self.X)``)."""
    if isinstance(node, ast.Call) and len(node.args) == 1 and isinstance(node.func, ast.Name):
        node = node.args[0]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


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
