"""What a model's structure says, for the planner: module aliases, shared weights, and what holds the head counts
attention code reshapes with (an int attribute, a field of a config shared by every layer, an einops layer's axes
lengths), found from the module whose code passed the size and set to per-rank values while the model is parallel
(a shared config on a copy seen by that module only).

Example:
    >>> lin = nn.Linear(2, 2); model = nn.ModuleDict({"a": lin, "b": lin})
    >>> module_aliases(model)
    {'a': ['b']}
"""

from __future__ import annotations

import ast
import copy
import inspect
import os
import re
import textwrap
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from torch import nn

__all__ = [
    "groups_by", "module_aliases", "read_path", "resolve_literals", "set_per_rank", "unset_per_rank", "weight_owners",
]


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
    """Find what holds the fixed sizes attention code reshapes with; names of unfixable sources.

    Each fixed size a split tensor was reshaped (or expanded) to at its split dim was passed by the code of one
    module (``OpCall.scope``). It is held by the innermost module from there up to the attention block (the common
    owner of its q/k/v and output layers) that holds that value: as an int attribute (``self.n_head``), else as an
    int field of an object the module keeps (``self.config.n_head``: litgpt's config, shared by every layer), else
    inside a tuple/list/dict attribute (an einops ``Rearrange`` layer's ``h=``); of several holding the value, those
    the module's code passes at the size's position (``view(B, T, self.config.n_query_groups, ...,
    self.config.head_size)``: not ``head_size`` when it happens to equal the count) or by keyword (einops'
    ``h=self.config.n_kv_heads``). A size held by nothing that divides a split size the code read (``x.shape``) was
    computed from it (einops infers ``h`` from ``d=``): per rank by itself. Those holders are set per rank
    (:func:`set_per_rank`, a copy for objects and containers, never the shared object). A size the code computes as
    a product with an attribute already set per rank (``self.config.head_size * self.config.n_head``) is per rank by
    itself; sizes are taken smallest first, so the counts come before their products. Returns ``{module: {path:
    (dense, local)}}`` (paths as :func:`set_per_rank` reads them) and ``{source layer: why it cannot be split}``.
    """
    adjust: dict[str, dict[str, tuple[int, int]]] = {}
    broken: dict[str, str] = {}
    refused: dict[str, str] = {}  # modules whose counts cannot all be per rank: why
    served: dict[str, set[str]] = {}  # module -> the source layers whose sizes it holds

    def owner_of(src: str) -> str:
        return _owner(model, {src} | flow.partners.get(src, set()))

    def set_local(module_name: str, paths: list[str], v: int, src: str) -> None:
        adjust.setdefault(module_name, {}).update({a: (v, v // mp) for a in paths})
        served.setdefault(module_name, set()).add(src)
        why = _follow_ratios(_module(model, module_name), module_name, adjust[module_name], mp)
        if why:  # that attention stays whole, its module untouched
            refused[module_name] = why
            del adjust[module_name]
            broken.update((s, why) for s in flow.literals if owner_of(s) in (module_name, owner_of(src)))
            broken[src] = why

    literals = sorted((v, scope, pos, src) for src, values in flow.literals.items() for v, scope, pos in values)
    for v, scope, pos, src in literals:
        chain = _scope_chain(scope, owner_of(src))
        if any(_explained(model, name, v, adjust.get(name, {}), mp) for name in chain):
            continue
        found = next(((name, paths) for name in chain if (paths := _holders(_module(model, name), v, pos))), None)
        if found is None and any(q % v == 0 for q in flow.queried.get(src, ())):
            continue  # held by nothing, a divisor of a split size the code read: computed from that size (einops'
            # rearrange(t, 'b n (h d) -> b h n d', d=self.dim_head) infers h = t.shape[-1] // d), per rank by itself
        if found is None or v % mp or found[0] in refused:
            place = found[0] if found else owner_of(src)
            broken[src] = refused.get(place) or (
                f"reshapes to a fixed size {v} in '{place or type(model).__name__}'"
                + (f" ({found[1][0]} not divisible by mp={mp})" if found else " held by no attribute")
                + "; write view(B, T, -1, head_dim) to allow head-parallel attention"
            )
            continue
        set_local(*found, v, src)
    for src, scoped in getattr(flow, "scoped", {}).items():
        for scope, v, derived in scoped:  # a constant made in `scope` (zeros((1, self.n_heads, T, S))): its
            found = _attr_up(model, scope, v)  # module's attribute, or the nearest enclosing one's, holds the size
            if found is None and derived:
                continue  # the size was read off a split tensor (q.shape[1]): per-rank at run time by itself
            if found is None or v % mp or found[0] in refused:
                broken[src] = (refused.get(found[0], "") if found else "") or (
                    f"a constant tensor made in '{scope}' spans the split heads with size {v}"
                    + (f", not divisible by mp={mp}" if found else ", held by no attribute")
                )
                continue
            set_local(*found, v, src)
    # A holder set per rank for one region is wrong for another that stays whole: both stay whole then.
    changed = True
    while changed:
        changed = False
        for module_name, srcs in served.items():
            bad = sorted(srcs & broken.keys())
            if bad and adjust.pop(module_name, None) is not None:
                changed = True
                broken.update((s, f"shares the sizes held by '{module_name}' with {bad[0]}, which is not split"
                                  f" ({broken[bad[0]]})") for s in sorted(srcs - broken.keys()))
    return adjust, broken


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def _scope_chain(scope: str, owner: str) -> list[str]:
    """The modules from ``scope`` (where the code ran) up to ``owner`` (the attention block), innermost first; just
    ``[owner]`` when the code ran outside it."""
    inside = owner == "" or scope == owner or scope.startswith(owner + ".")
    if not inside:
        return [owner]
    parts = scope.split(".") if scope else []
    depth = len(owner.split(".")) if owner else 0
    return [".".join(parts[:k]) for k in range(len(parts), depth - 1, -1)]


# What nn.Module keeps in its own __dict__ (parameters, buffers, submodules, hooks): never a user's size.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _holders(module: nn.Module, value: int, pos: Optional[int] = None) -> list[str]:
    """Paths (for :func:`set_per_rank`) of what ``module`` holds equal to ``value``, of the first kind that holds it:
    public int attributes, then public int fields of objects it keeps (a config shared with other modules), then
    ints inside its tuple/list/dict attributes (an einops layer's ``axes_lengths``/``_axes_lengths``). With ``pos``
    (where the size was among the sizes an op got), only those the module's code passes there when it passes any
    of them (a config whose ``head_size`` equals ``n_query_groups``: the view's head dim keeps ``head_size``)."""
    for kind in _int_leaves(module):
        hits = [path for path, x in kind if x == value]
        if hits:
            passed = _passed_at(type(module), pos) if pos is not None else set()
            return [p for p in hits if p in passed] or hits
    return []


# Ops taking sizes whose fixed sizes the flow records (flow_dims): x.view(*sizes), torch.reshape(x, sizes), ...
_SIZE_OPS = frozenset({"view", "reshape", "expand", "broadcast_to", "split"})


def _passed_at(cls: type, pos: int) -> set[str]:
    """Paths the class's code passes as size number ``pos`` of a sizes-taking op (``x.view(B, T,
    self.config.n_query_groups, ...)``: position 2, also inside one tuple, ``torch.reshape(x, (...))``) or by
    keyword to any call (einops' ``rearrange(t, 'b n (h d) -> b h n d', h=self.config.n_kv_heads)``: the op that
    gets the size runs inside the library), directly or through a local name bound to them."""
    out: set[str] = set()
    for fn in _methods(cls):
        aliases = _aliases(fn)
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                out.update(p for k in node.keywords if k.arg not in (None, "dim")
                           and (p := _self_attr(k.value, aliases)))
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            func, args = node.func, list(node.args)
            if func.attr not in _SIZE_OPS:
                continue
            if isinstance(func.value, ast.Name) and func.value.id == "torch":
                args = args[1:]  # torch.reshape(x, sizes): the tensor first
            if len(args) == 1 and isinstance(args[0], (ast.Tuple, ast.List)):
                args = list(args[0].elts)
            if pos < len(args) and not any(isinstance(a, ast.Starred) for a in args[:pos + 1]):
                path = _self_attr(args[pos], aliases)
                if path:
                    out.add(path)
    return out


def _int_leaves(module: nn.Module) -> tuple[list[tuple[str, int]], ...]:
    own: list[tuple[str, int]] = []
    fields: list[tuple[str, int]] = []
    nested: list[tuple[str, int]] = []
    for a, x in vars(module).items():
        if a in _MODULE_INTERNALS:
            continue
        if _is_int(x):
            if not a.startswith("_"):
                own.append((a, x))
        elif isinstance(x, (tuple, list, dict)):
            nested.extend(_container_ints(x, a, depth=2))
        elif not a.startswith("_") and _is_plain_object(x):
            fields.extend((f"{a}.{f}", y) for f, y in vars(x).items() if _is_int(y) and not f.startswith("_"))
    return own, fields, nested


def _is_int(x: Any) -> bool:
    return type(x) is int  # (bool is not a size)


def _is_plain_object(x: Any) -> bool:
    """An object holding settings (a config: a dataclass, a plain class, transformers' PretrainedConfig)."""
    return (hasattr(x, "__dict__") and not callable(x) and not isinstance(x, (nn.Module, torch.Tensor))
            and not inspect.ismodule(x))


def _container_ints(x: Any, path: str, depth: int) -> list[tuple[str, int]]:
    items = x.items() if isinstance(x, dict) else enumerate(x)
    out: list[tuple[str, int]] = []
    for k, y in items:
        if isinstance(x, dict) and not isinstance(k, str):
            continue
        sub = f"{path}[{k!r}]" if isinstance(x, dict) else f"{path}[{k}]"
        if _is_int(y):
            out.append((sub, y))
        elif depth > 1 and isinstance(y, (tuple, list, dict)):
            out.extend(_container_ints(y, sub, depth - 1))
    return out


_STEP = re.compile(r"\.?([A-Za-z_]\w*)|\[(\d+)\]|\['([^']*)'\]")


def _steps(path: str) -> list[Union[str, int]]:
    """``"config.n_head"`` -> ``["config", "n_head"]``, ``"_axes_lengths[0][1]"`` -> ``["_axes_lengths", 0, 1]``,
    ``"axes_lengths['h']"`` -> ``["axes_lengths", "h"]`` (attribute names and dict keys are both strings: the type
    of the holder says which)."""
    out: list[Union[str, int]] = []
    for m in _STEP.finditer(path):
        name, index, key = m.groups()
        out.append(name if name is not None else int(index) if index is not None else key)
    return out


def read_path(obj: Any, path: str) -> Any:
    """The value at ``path`` (see :func:`set_per_rank`) under ``obj``."""
    for step in _steps(path):
        obj = _item(obj, step) if isinstance(obj, (tuple, list, dict)) else getattr(obj, str(step))
    return obj


def _item(container: Any, step: Union[str, int]) -> Any:
    return container[step]


def _with(obj: Any, steps: list[Union[str, int]], value: Any) -> Any:
    """``obj`` with ``value`` at ``steps``, copied along the way (tuples rebuilt, lists, dicts and objects shallow
    copied): ``obj`` itself is never changed (a config object is shared by every layer, and the model)."""
    if not steps:
        return value
    step, rest = steps[0], steps[1:]
    if isinstance(obj, tuple):
        items = list(obj)
        items[int(step)] = _with(items[int(step)], rest, value)
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    new: Any = copy.copy(obj)
    if isinstance(obj, (list, dict)):
        new[step] = _with(_item(obj, step), rest, value)
        return new
    inner = _with(getattr(obj, str(step)), rest, value)
    try:
        setattr(new, str(step), inner)
    except AttributeError:  # a frozen dataclass
        object.__setattr__(new, str(step), inner)
    return new


def set_per_rank(module: nn.Module, values: Mapping[str, int]) -> dict[str, Any]:
    """Set the sizes at ``values``' paths (``"n_head"``, ``"config.n_head"``, ``"_axes_lengths[0][1]"``) of
    ``module`` to per-rank values; returns the module's attributes as they were, for :func:`unset_per_rank`.

    An attribute is replaced, never changed in place: a config object gets a shallow copy holding the per-rank
    counts, seen by this module only, while every other reader (the MLP, the model, other layers) keeps the shared
    dense one.

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(n_head=8, n_embd=32); attn, mlp = nn.Module(), nn.Module()
        >>> attn.config = mlp.config = cfg
        >>> dense = set_per_rank(attn, {"config.n_head": 4})
        >>> attn.config.n_head, mlp.config.n_head, attn.config.n_embd
        (4, 8, 32)
        >>> unset_per_rank(attn, dense); attn.config is cfg
        True
    """
    dense: dict[str, Any] = {}
    for path, local in values.items():
        steps = _steps(path)
        top = str(steps[0])
        dense.setdefault(top, getattr(module, top))
        setattr(module, top, _with(getattr(module, top), steps[1:], local))
    return dense


def unset_per_rank(module: nn.Module, dense: Mapping[str, Any]) -> None:
    """Put back the attributes :func:`set_per_rank` replaced (the very objects, shared ones included)."""
    for a, v in dense.items():
        setattr(module, a, v)


def _follow_ratios(module: nn.Module, module_name: str, attrs: dict[str, tuple[int, int]], mp: int) -> str:
    """Attributes the code divides by (or into) an adjusted one are adjusted with it, so every size derived from
    the pair stays what it was: ``dim_head = self.inner_dim // self.heads`` in forward keeps 4 when ``heads`` goes
    8 -> 4 only if ``inner_dim`` goes 32 -> 16, and litgpt's ``q_per_kv = n_head // n_query_groups`` (both read from
    ``self.config``) keeps 2 only if ``n_head`` goes per rank with ``n_query_groups``. Read from the module's code
    (its ``self.X / self.Y`` expressions, through local names bound to them), never from the names. Returns why the
    pair cannot both be per rank ("" when they can)."""
    for other in sorted(_ratio_partners(type(module), set(attrs))):
        try:
            value = read_path(module, other)
        except (AttributeError, KeyError, IndexError, TypeError):
            continue
        if other in attrs or not _is_int(value):
            continue
        if value % mp:  # the pair cannot both be per rank: that attention stays whole, its module untouched
            return (f"'{module_name}' divides {other}={value} by an attribute set per rank"
                    f" ({', '.join(sorted(attrs))}), and {value} is not divisible by mp={mp}")
        attrs[other] = (value, value // mp)
    return ""


def _ratio_partners(cls: type, attrs: set[str]) -> set[str]:
    """Paths ``X`` such that the class's own methods compute ``self.X / self.A``, ``self.X // self.A`` (or with the
    two swapped) for an ``A`` in ``attrs``; ``X`` and ``A`` may be fields of an object (``self.config.n_head``)."""
    out: set[str] = set()
    for fn in _methods(cls):
        aliases = _aliases(fn)
        for node in ast.walk(fn):
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
                left, right = _self_attr(node.left, aliases), _self_attr(node.right, aliases)
                if left and right and (left in attrs) != (right in attrs):
                    out.add(right if left in attrs else left)
    return out


def _explained(model: nn.Module, name: str, value: int, attrs: Mapping[str, tuple[int, int]], mp: int) -> bool:
    """Whether the code of module ``name`` computes ``value`` as a product of its attributes (and constants) in which
    exactly the per-rank ones in ``attrs`` make it ``value / mp`` (``self.config.head_size * self.config.n_head``):
    a size that follows the adjusted counts by itself."""
    if not attrs:
        return False
    module = _module(model, name)
    for factors in _products(type(module)):
        dense = local = 1
        for f in factors:
            if isinstance(f, int):
                dense, local = dense * f, local * f
                continue
            try:
                v = read_path(module, f)
            except (AttributeError, KeyError, IndexError, TypeError):
                break
            if not _is_int(v):
                break
            dense, local = dense * v, local * (attrs[f][1] if f in attrs else v)
        else:
            if dense == value and local * mp == value:
                return True
    return False


def _products(cls: type) -> list[list[Union[str, int]]]:
    """The products ``self.A * self.B * 2`` in the class's own methods, as their factors (paths and int
    constants); products with any other factor are left out."""
    out: list[list[Union[str, int]]] = []
    for fn in _methods(cls):
        aliases = _aliases(fn)
        inner = {id(n.left) for n in ast.walk(fn) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)}
        for node in ast.walk(fn):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and id(node) not in inner:
                factors = _factors(node, aliases)
                if factors is not None:
                    out.append(factors)
    return out


def _factors(node: ast.AST, aliases: Mapping[str, str]) -> Optional[list[Union[str, int]]]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = _factors(node.left, aliases), _factors(node.right, aliases)
        return left + right if left is not None and right is not None else None
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return [node.value]
    path = _self_attr(node, aliases)
    return [path] if path else None


def _methods(cls: type) -> list[ast.AST]:
    """The parsed methods the class (and its bases outside torch) runs in a step: not those run at construction
    or printing."""
    out: list[ast.AST] = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            break
        for name, fn in vars(klass).items():
            if name.startswith("__") or name == "extra_repr":
                continue
            tree = _parsed(fn)
            if tree is not None:
                out.append(tree)
    return out


def _parsed(fn: Any) -> Optional[ast.AST]:
    if not inspect.isfunction(fn):
        return None
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):  # no source (a C extension, an interactive session)
        return None


def _aliases(fn: ast.AST) -> dict[str, str]:
    """Local names bound to attributes in ``fn`` (``n_head = self.config.n_head``, ``h, d = self.heads, self.d``)."""
    out: dict[str, str] = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = (list(zip(target.elts, value.elts)) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                 and len(target.elts) == len(value.elts) else [(target, value)])
        for t, v in pairs:
            path = _self_attr(v, {})
            if isinstance(t, ast.Name) and path:
                out[t.id] = path
    return out


def _self_attr(node: ast.AST, aliases: Mapping[str, str]) -> Optional[str]:
    """The path ``X`` or ``X.Y`` for the expression ``self.X`` or ``self.X.Y`` (or ``int(...)`` of it, or a local
    name bound to it)."""
    if isinstance(node, ast.Call) and len(node.args) == 1 and isinstance(node.func, ast.Name):
        node = node.args[0]
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if not isinstance(node, ast.Attribute):
        return None
    if isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    inner = node.value
    if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self":
        return f"{inner.attr}.{node.attr}"
    return None


def _attr_up(model: nn.Module, scope: str, value: int) -> Optional[tuple[str, list[str]]]:
    """The innermost module on the path to ``scope`` holding ``value`` (see :func:`_holders`), with its paths."""
    parts = scope.split(".") if scope else []
    for k in range(len(parts), -1, -1):
        name = ".".join(parts[:k])
        paths = _holders(_module(model, name), value)
        if paths:
            return name, paths
    return None
