"""Plan ``nn.MultiheadAttention`` modules: head-parallel where they can be, whole (with the reason) where not.

torch's attention is recognised as a primitive (like ``nn.Linear``): its q/k/v live in the bare parameter
``in_proj_weight`` and ``F.multi_head_attention_forward`` reads ``out_proj.weight`` directly, so no call of a
Linear marks them. Head-parallel attention is self-contained: it reads a replicated input and writes a
replicated output (:class:`~lightning_dpmp.parallel.attention_layer.HeadParallelMultiheadAttention`), so it needs no
region analysis, only the facts of its calls in the traced step (:class:`~lightning_dpmp.planner.trace.AttentionCall`).

Example:
    >>> import torch
    >>> from lightning_dpmp.planner.trace import trace_step
    >>> layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    >>> model = nn.ModuleDict({"enc": nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)})
    >>> trace = trace_step(model, lambda: model["enc"](torch.randn(2, 6, 16)).sum())
    >>> decide_attention(model, trace, mp=2, forced={}, level=0)
    {'enc.layers.0.self_attn': AttentionDecision(style='heads', note='2 of 4 heads per rank; ...', ...)}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from torch import nn

from lightning_dpmp.parallel.attention_layer import unsupported_reason
from lightning_dpmp.planner.trace import Trace

__all__ = ["AttentionDecision", "decide_attention"]


@dataclass(frozen=True)
class AttentionDecision:
    """``style`` is ``"heads"`` or ``"replicate"``; ``input`` the traced query node (for a shared entry)."""

    style: str
    note: str
    input: Optional[int] = None
    input_requires_grad: bool = True
    gather_weights: bool = False


def decide_attention(
    model: nn.Module, trace: Optional[Trace], mp: int, forced: Mapping[str, str], level: int
) -> dict[str, AttentionDecision]:
    """One decision per ``nn.MultiheadAttention`` of ``model``, in module order.

    ``level`` >= 1 (a verification fallback that disables attention-like pairs) keeps every attention whole.
    """
    out: dict[str, AttentionDecision] = {}
    for name, mha in model.named_modules():
        if not isinstance(mha, nn.MultiheadAttention):
            continue
        calls = trace.attention.get(name, []) if trace is not None else []
        reason = unsupported_reason(mha, mp)
        if forced.get(name) == "replicate":
            reason = "user plan"
        elif reason is not None:
            pass
        elif level >= 1:
            reason = "attention-like region disabled after a failed verification"
        elif trace is None and forced.get(name) != "heads":
            reason = "not traced (head-parallel attention is planned from a traced step or plan='heads')"
        elif trace is not None and len(calls) != 1:
            reason = "not called in the traced step" if not calls else f"called {len(calls)} times per step"
        elif calls and not calls[0].self_attention:
            reason = "cross-attention (query, key and value are different tensors)"
        if reason is not None:
            if forced.get(name) == "heads":
                raise ValueError(f"plan forces {name!r} to 'heads', but it cannot be head-parallel: {reason}.")
            out[name] = AttentionDecision("replicate", reason)
            continue
        call = calls[0] if calls else None
        weights = call.need_weights if call is not None else True
        note = f"{mha.num_heads // mp} of {mha.num_heads} heads per rank; in_proj split per q/k/v block, out_proj row"
        if weights:
            note += "; need_weights=True: per-head weights all-gathered"
        out[name] = AttentionDecision(
            "heads", note, call.input if call is not None else None,
            call.input_requires_grad if call is not None else True, weights,
        )
    return out
