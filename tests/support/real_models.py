"""Real architectures for the planner: models built from the ``transformers`` package's configs (tiny sizes,
random init, no downloads) and from torch's own layers, each wrapped the way users train them.

Every entry of :data:`REAL_MODELS` is ``name -> RealModel``: a builder returning ``(LightningModule, dataset)``,
the number of repeated blocks, and the prefix of block ``i``'s modules (for the "every Linear-like layer of a
block is split" check). Add a model by adding an entry; ``tests/models/test_real_models.py`` picks it up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.models import make_lm_dataset

VOCAB, SEQ = 64, 16


class CausalLM(L.LightningModule):
    """Next-token loss the usual way: the logits are shifted by slicing first (``logits[:, :-1]``)."""

    def __init__(self, net: nn.Module, vocab: int = VOCAB, lr: float = 3e-3) -> None:
        super().__init__()
        self.net, self.vocab, self.lr = net, vocab, lr

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        logits = self.net(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.01)


@dataclass(frozen=True)
class RealModel:
    build: Callable[[], tuple[L.LightningModule, object]]
    n_blocks: int
    block_prefix: str  # format with the block index
    max_mp: int = 4  # the largest mp its heads allow
    embedding: str = "embed_tokens"  # name suffix of the token embedding (vocab-split when the plan says so)
    head: str = "lm_head"  # name suffix of the LM head


def _llama() -> tuple[L.LightningModule, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )
    return CausalLM(LlamaForCausalLM(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _frozen_llama() -> tuple[L.LightningModule, object]:
    """Fine-tuning: the Llama above with every attention parameter frozen (``self_attn``'s q/k/v/o)."""
    module, data = _llama()
    for layer in module.net.model.layers:
        layer.self_attn.requires_grad_(False)
    return module, data


REAL_MODELS: dict[str, RealModel] = {
    "hf_llama": RealModel(_llama, 2, "net.model.layers.{}."),
    "frozen_llama": RealModel(_frozen_llama, 2, "net.model.layers.{}."),
}


def build_real(name: str) -> tuple[L.LightningModule, object]:
    torch.manual_seed(0)  # the same dense init in every process and in the reference
    return REAL_MODELS[name].build()
