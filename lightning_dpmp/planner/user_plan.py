"""Resolve a user plan (``{glob: style}`` on module names) to one style per layer, with clear errors.

* :class:`PlanOverrides`: the user plan parsed once (types and style names checked, with a did-you-mean), at
  :class:`~lightning_dpmp.DPMPStrategy` construction; every later check and ``mp="auto"``'s costing take this object.
* :func:`check_styles`: the plan's types and style names (what :meth:`PlanOverrides.parse` checks).
* :func:`check_plan_on_model`: the globs against the model's structure, before any process starts: a glob that
  matches nothing, or only modules that cannot be styled, and forced splits that ``mp`` does not divide.
* :func:`user_styles`: the full resolution, at plan time, once the traced step has found linear-like layers.

Example:
    >>> PlanOverrides.parse({"blocks.*.fc1": "column", "blocks.*.fc2": "row"}).rules
    (('blocks.*.fc1', 'column'), ('blocks.*.fc2', 'row'))
    >>> forms = {"0": LinearForm(4, 8), "1": LinearForm(8, 4)}           # the linear-like layers, by name
    >>> user_styles(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), {"1": "row"}, 2, forms)
    {'1': 'row'}
    >>> check_styles({"blocks.*.fc1": "colum"})
    Traceback (most recent call last):
    ...
    ValueError: plan['blocks.*.fc1'] = 'colum' is not a style (did you mean 'column'?);
        choose one of column, row, column_gather, vocab, experts, heads, replicate.
"""

from __future__ import annotations

import difflib
import fnmatch
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from torch import nn

from lightning_dpmp.planner.linear_like import LinearForm, candidate_params, form_of_linear
from lightning_dpmp.planner.styles import STYLES
from lightning_dpmp.planner.trace import is_linear

__all__ = ["PlanOverrides", "UserPlan", "check_plan_on_model", "check_styles", "user_styles"]


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_styles(user_plan: Any) -> None:
    """Refuse a plan that is not a ``{str glob: str style}`` mapping, or names a style that does not exist."""
    if user_plan is None:
        return
    if not isinstance(user_plan, Mapping):
        raise TypeError(
            f"`plan_overrides` must be a mapping of module-name glob -> style, e.g. {{'blocks.*.fc1': 'column'}}, got"
            f" {type(user_plan).__name__} {user_plan!r}."
        )
    for pattern, style in user_plan.items():
        if not isinstance(pattern, str) or not isinstance(style, str):
            raise TypeError(
                f"`plan_overrides` entries must be str glob -> str style, got {pattern!r} ({type(pattern).__name__}) ->"
                f" {style!r} ({type(style).__name__})."
            )
        if style not in STYLES:
            raise ValueError(
                f"plan[{pattern!r}] = {style!r} is not a style{_did_you_mean(style, list(STYLES))}; choose one of"
                f" {', '.join(STYLES)}."
            )


@dataclass(frozen=True)
class PlanOverrides:
    """A user plan, parsed once: ``(glob, style)`` rules on module names in the order given; the first rule whose
    glob matches a layer's name gives its style. Empty when the user gave none (``bool(overrides)`` is False).

    Example:
        >>> overrides = PlanOverrides.parse({"head": "vocab"})
        >>> bool(overrides), overrides.as_dict(), bool(PlanOverrides.parse(None))
        (True, {'head': 'vocab'}, False)
        >>> PlanOverrides.parse(overrides) is overrides                   # parsing is done once
        True
    """

    rules: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, user_plan: "UserPlan") -> "PlanOverrides":
        """``user_plan`` (a ``{glob: style}`` mapping, ``None``, or an already parsed plan) checked and frozen;
        raises for a wrong type or an unknown style name (see :func:`check_styles`)."""
        if isinstance(user_plan, PlanOverrides):
            return user_plan
        check_styles(user_plan)
        return cls(tuple((str(p), str(s)) for p, s in (user_plan or {}).items()))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def patterns(self) -> list[str]:
        return [pattern for pattern, _ in self.rules]

    def as_dict(self) -> dict[str, str]:
        """The rules as a ``{glob: style}`` dict (insertion order: the order given)."""
        return dict(self.rules)


#: What the planning functions accept as a user plan: a mapping (parsed there) or an already parsed plan.
UserPlan = Union[PlanOverrides, Mapping[str, str], None]


def check_plan_on_model(model: nn.Module, user_plan: UserPlan, mp: int) -> None:
    """What the model's structure alone can refute in ``user_plan``, before anything is traced or launched.

    Raises for a glob that matches no module (with the closest module name), and for every error
    :func:`user_styles` finds when each leaf *shaped* like a linear-like layer is taken to be one of any width: such
    a leaf (GPT-2's ``Conv1D``) is only recognised by tracing, so no certain error is raised about it here.
    """
    overrides = PlanOverrides.parse(user_plan)
    if not overrides:
        return
    names = [n for n, _ in model.named_modules() if n]
    for pattern in overrides.patterns():
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            # A glob is compared with globs: 'blocks.0.fc1' also offered as 'blocks.*.fc1'.
            globs = {".".join("*" if part.isdigit() else part for part in n.split(".")) for n in names}
            offered = names + sorted(globs) if "*" in pattern else names
            hint = _did_you_mean(pattern, offered) or (f"; its modules include {', '.join(names[:6])}" if names else "")
            raise ValueError(
                f"plan pattern {pattern!r} matches no module of {type(model).__name__}{hint}. Patterns are globs on"
                " the names of model.named_modules() (e.g. 'blocks.*.mlp.fc1'); a plan that does not apply is refused"
                " rather than ignored."
            )
    forms: dict[str, LinearForm] = {}
    for n, m in model.named_modules():
        if is_linear(m):
            forms[n] = form_of_linear(m)
        elif candidate_params(m) is not None:  # possibly linear-like: a width every mp divides, so nothing fails
            forms[n] = LinearForm(mp, mp)
    user_styles(model, overrides, mp, forms)


def user_styles(model: nn.Module, user_plan: UserPlan, mp: int, forms: Mapping[str, LinearForm]) -> dict[str, str]:
    """Resolve glob patterns to {layer name: style}; the first pattern that matches a name wins."""
    forced: dict[str, str] = {}
    overrides = PlanOverrides.parse(user_plan)
    if not overrides:
        return forced
    modules = dict(model.named_modules())
    inside_mha = {
        f"{n}.{c}" for n, m in modules.items() if isinstance(m, nn.MultiheadAttention) for c, _ in m.named_children()
    }
    for pattern, style in overrides.rules:
        matched = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            warnings.warn(
                f"DPMPStrategy plan pattern {pattern!r} matches no module of {type(model).__name__}.", stacklevel=1
            )
        layers = [n for n in matched if n in forms or type(modules[n]) is nn.Embedding
                  or isinstance(modules[n], nn.MultiheadAttention)]
        stacked = [n for n in matched if n not in layers and any(p.dim() >= 3 for p in modules[n].parameters(False))]
        for name in stacked if style in ("experts", "replicate") else ():  # experts modules (planner/experts_detect.py)
            forced.setdefault(name, style)
        if style == "experts":
            if not stacked:
                raise ValueError(
                    f"plan[{pattern!r}] = 'experts' matches no module holding stacked (3-D) expert weights."
                )
            continue
        if matched and not layers and not stacked:
            mod = modules[matched[0]]
            raise ValueError(
                f"plan[{pattern!r}] = {style!r} matches {matched[0]!r}, a {type(mod).__name__}, and no nn.Linear,"
                " linear-like layer, nn.Embedding or nn.MultiheadAttention; only those layers can be given a style."
            )
        for name in layers:  # a glob like 'blocks.*' may also match norms and containers: those are skipped
            mod = modules[name]
            if isinstance(mod, nn.MultiheadAttention):
                if style not in ("heads", "replicate"):
                    raise ValueError(
                        f"plan gives the nn.MultiheadAttention {name!r} style {style!r}; use 'heads' or 'replicate'."
                    )
                forced.setdefault(name, style)
                continue
            if name in inside_mha:
                if fnmatch.fnmatchcase(name.rpartition(".")[0], pattern):
                    continue  # 'blocks.*' matched the attention too: its out_proj follows the attention
                raise ValueError(
                    f"plan gives {name!r} style {style!r}, but F.multi_head_attention_forward reads its weight without"
                    f" calling it; style the nn.MultiheadAttention {name.rpartition('.')[0]!r}"
                    " ('heads' or 'replicate')."
                )
            if isinstance(mod, nn.Embedding):
                if style not in ("vocab", "replicate"):
                    raise ValueError(f"plan gives the embedding {name!r} style {style!r}; use 'vocab' or 'replicate'.")
                forced.setdefault(name, style)
                continue
            if style == "heads":
                raise ValueError(f"plan gives {name!r} style 'heads', which is for nn.MultiheadAttention only.")
            forced.setdefault(name, style)
            f = forms[name]
            if style in ("column", "column_gather") and f.out_features % mp:  # (a vocabulary is padded)
                raise ValueError(
                    f"plan forces {name!r} to {style!r}, but its out_features={f.out_features} is not divisible by"
                    f" mp={mp}. Use 'replicate' for it, or an mp that divides {f.out_features}."
                )
            if style == "row" and f.in_features % mp:
                raise ValueError(
                    f"plan forces {name!r} to 'row', but its in_features={f.in_features} is not divisible by"
                    f" mp={mp}. Use 'replicate' for it, or an mp that divides {f.in_features}."
                )
    return forced
