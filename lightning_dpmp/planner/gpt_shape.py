"""The shape of a GPT-like decoder: the sizes an analytic cost (:mod:`lightning_dpmp.tools.costmodel`) and an
analytic profile (:meth:`lightning_dpmp.planner.profile.ModelProfile.from_gpt`) depend on.

Example:
    >>> GPTShape(layers=2, hidden=64, heads=4, vocab=128, seq=16, batch=8).hidden
    64
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["GPTShape"]


@dataclass(frozen=True)
class GPTShape:
    """The shape of a GPT-like decoder (the sizes the cost depends on).

    Args:
        layers: transformer blocks.
        hidden: model width.
        heads: attention heads (``mp`` must divide it).
        vocab: vocabulary (split by vocabulary when ``mp`` divides it, replicated otherwise).
        seq: tokens per sequence.
        batch: sequences per optimizer step, over all DP ranks (the global batch).
        ffn: feed-forward width; ``4 * hidden`` when ``None``.
        micro_batch: sequences per forward pass on one rank (gradient accumulation over ``batch / (dp *
            micro_batch)`` micro-batches); ``None`` = the whole local batch in one pass.
        tied: input and output embeddings share one matrix.
        act_bytes: bytes per activation element (2 for bf16/fp16, 4 for fp32).
        bytes_per_param: bytes per parameter for weights + gradients + AdamW state (16 for bf16 mixed precision
            with fp32 master weights and moments; 16 for fp32: 4 weight + 4 gradient + 8 moments).
        grad_bytes: bytes per gradient element on the wire (2 for bf16 gradients, 4 for fp32).
        recompute: full activation recomputation (keeps only block inputs; one more forward pass).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    ffn: Optional[int] = None
    micro_batch: Optional[int] = None
    tied: bool = True
    act_bytes: int = 2
    bytes_per_param: int = 16
    grad_bytes: int = 2
    recompute: bool = False

    @property
    def ffn_width(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def block_params(self) -> int:
        """Split parameters of one block: q/k/v/out (4 h^2 + 3h column biases) and fc1/fc2 (2 h f + f)."""
        h, f = self.hidden, self.ffn_width
        return 4 * h * h + 3 * h + 2 * h * f + f

    @property
    def replicated_block_params(self) -> int:
        """Two LayerNorms (weight + bias) and the two row-layer biases."""
        return 4 * self.hidden + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        """All parameters (position table and final norm included)."""
        return (self.layers * (self.block_params + self.replicated_block_params) + self.embedding_params
                + self.seq * self.hidden + 2 * self.hidden)

    @classmethod
    def from_module(cls, module: Any, seq: int, batch: int, heads: Optional[int] = None, **kwargs: Any) -> "GPTShape":
        """Read the shape off a GPT-like ``nn.Module``: vocab and hidden from the largest ``nn.Embedding``, layers
        from the longest ``nn.ModuleList``, ffn from the widest Linear reading ``hidden`` features, heads from an
        attribute named ``n_head``/``num_heads``/``num_attention_heads``/``n_heads`` (or ``head_dim``) unless given.
        """
        from torch import nn

        embs = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        if not embs:
            raise ValueError("GPTShape.from_module needs an nn.Embedding (the token table) to read vocab and hidden.")
        emb = max(embs, key=lambda m: m.num_embeddings * m.embedding_dim)
        vocab, hidden = emb.num_embeddings, emb.embedding_dim
        layers = max((len(m) for m in module.modules() if isinstance(m, nn.ModuleList)), default=1)
        wide = [m.out_features for m in module.modules() if isinstance(m, nn.Linear) and m.in_features == hidden
                and m.out_features > hidden and m.out_features != vocab]
        ffn = max(wide) if wide else 4 * hidden
        if heads is None:
            for m in module.modules():
                for name in ("n_head", "num_heads", "num_attention_heads", "n_heads"):
                    if isinstance(getattr(m, name, None), int):
                        heads = getattr(m, name)
                        break
                if heads is None and isinstance(getattr(m, "head_dim", None), int):
                    heads = hidden // m.head_dim
                if heads is not None:
                    break
        if heads is None:
            raise ValueError("GPTShape.from_module could not find the number of heads; pass heads=...")
        tied = any(
            isinstance(m, nn.Linear) and m.weight is emb.weight for m in module.modules()
        )
        return cls(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, batch=batch, ffn=ffn, tied=tied,
                   **kwargs)
