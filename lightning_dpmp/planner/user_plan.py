"""Resolve a user plan (``{glob: style}`` on module names) to one style per layer, with clear errors.

Example:
    >>> forms = {"0": LinearForm(4, 8), "1": LinearForm(8, 4)}           # the linear-like layers, by name
    >>> user_styles(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), {"1": "row"}, 2, forms)
    {'1': 'row'}
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping
from typing import Optional

from torch import nn

from lightning_dpmp.planner.linear_like import LinearForm
from lightning_dpmp.planner.styles import STYLES

__all__ = ["user_styles"]


def user_styles(
    model: nn.Module, user_plan: Optional[Mapping[str, str]], mp: int, forms: Mapping[str, LinearForm]
) -> dict[str, str]:
    """Resolve glob patterns to {layer name: style}; the first pattern that matches a name wins."""
    forced: dict[str, str] = {}
    if not user_plan:
        return forced
    modules = dict(model.named_modules())
    inside_mha = {f"{n}.{c}" for n, m in modules.items() if isinstance(m, nn.MultiheadAttention) for c, _ in m.named_children()}
    for pattern, style in user_plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style; choose one of {', '.join(STYLES)}.")
        matched = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            warnings.warn(f"DPMPStrategy plan pattern {pattern!r} matches no module of {type(model).__name__}.")
        layers = [n for n in matched if n in forms or type(modules[n]) is nn.Embedding
                  or isinstance(modules[n], nn.MultiheadAttention)]
        stacked = [n for n in matched if n not in layers and any(p.dim() >= 3 for p in modules[n].parameters(False))]
        for name in stacked if style in ("experts", "replicate") else ():  # experts modules (planner/experts.py)
            forced.setdefault(name, style)
        if style == "experts":
            if not stacked:
                raise ValueError(f"plan[{pattern!r}] = 'experts' matches no module holding stacked (3-D) expert weights.")
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
                    raise ValueError(f"plan gives the nn.MultiheadAttention {name!r} style {style!r}; use 'heads' or 'replicate'.")
                forced.setdefault(name, style)
                continue
            if name in inside_mha:
                if fnmatch.fnmatchcase(name.rpartition(".")[0], pattern):
                    continue  # 'blocks.*' matched the attention too: its out_proj follows the attention
                raise ValueError(
                    f"plan gives {name!r} style {style!r}, but F.multi_head_attention_forward reads its weight without"
                    f" calling it; style the nn.MultiheadAttention {name.rpartition('.')[0]!r} ('heads' or 'replicate')."
                )
            if isinstance(mod, nn.Embedding):
                if style not in ("vocab", "replicate"):
                    raise ValueError(f"plan gives the embedding {name!r} style {style!r}; use 'vocab' or 'replicate'.")
                if style == "vocab" and mod.num_embeddings % mp:
                    raise ValueError(
                        f"plan forces {name!r} to 'vocab', but num_embeddings={mod.num_embeddings} is not divisible"
                        f" by mp={mp}. Use 'replicate', or pad the vocabulary to a multiple of {mp}."
                    )
                forced.setdefault(name, style)
                continue
            if style == "heads":
                raise ValueError(f"plan gives {name!r} style 'heads', which is for nn.MultiheadAttention only.")
            forced.setdefault(name, style)
            f = forms[name]
            if style in ("column", "column_gather", "vocab") and f.out_features % mp:
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
