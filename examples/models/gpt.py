"""A small GPT in plain PyTorch, written the way people write models (no parallelism in it).

Tensor-model parallelism is applied from the outside by ``DPMPStrategy``: q/k/v and ``fc1`` become column-parallel,
``out_proj`` and ``fc2`` row-parallel. That works because the attention reshapes with ``view(B, T, -1, head_dim)``:
the number of heads is *derived* from the (possibly sharded) width, never read from a stored full-width count.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from examples.models.common import (
    OptimizerFactory,
    SchedulerFactory,
    build_optimizers,
    count_parameters,
)

__all__ = ["GPT", "GPTLitModule"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections and an output projection."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.head_dim = n_embd // n_head
        self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.k_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        # (B, T, heads, head_dim) -> (B, heads, T, head_dim); heads = local width / head_dim
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """GELU feed-forward: fc1 widens 4x, fc2 projects back."""

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.fc2 = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Args:
        vocab_size: number of token ids (256 for bytes).
        block_size: maximum context length (size of the learned position table).
        n_layer: number of transformer blocks.
        n_head: attention heads (``n_embd`` must be divisible by it; for MP, by ``mp`` too).
        n_embd: model width.
        dropout: dropout probability everywhere (0.0 keeps runs bit-comparable across layouts).
        bias: biases in Linear and LayerNorm layers.
        tie_embeddings: share the LM head weight with the token embedding.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_embeddings: bool = True,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        # GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer). Deterministic under a seed.
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("out_proj", "fc2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, vocab_size)``."""
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0) -> Tensor:
        """Samples ``max_new_tokens`` tokens after the prompt ``idx`` (dense model only)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1, :] / temperature
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


class GPTLitModule(pl.LightningModule):
    """LightningModule around :class:`GPT` for next-token prediction.

    Args:
        net: the GPT (Hydra instantiates it from ``model.net``).
        optimizer: a partial optimizer (``_partial_: true``); called with the parameter groups.
        scheduler: an optional partial LR scheduler; called with ``optimizer`` and ``total_steps``.
    """

    def __init__(
        self,
        net: GPT,
        optimizer: Optional[OptimizerFactory] = None,
        scheduler: Optional[SchedulerFactory] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()

    def forward(self, idx: Tensor) -> Tensor:
        return self.net(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch))
        self.log("val/loss", self.val_loss, prog_bar=True, on_step=False, on_epoch=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.test_loss.update(self._loss(batch))
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> Any:
        total = self.trainer.estimated_stepping_batches if self.trainer is not None else 1
        return build_optimizers(self, self.optimizer_factory, self.scheduler_factory, int(total))

    def num_local_parameters(self) -> int:
        return count_parameters(self)
