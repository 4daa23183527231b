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


def _gpt2() -> tuple[L.LightningModule, object]:
    """GPT-2: every projection is a ``Conv1D`` (weight stored (in, out), ``addmm``), c_attn fused q|k|v."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        # A training step needs no KV cache; with the default (True) transformers builds a DynamicCache whose
        # cat along the sequence the op-propagation rules must see through (flow.py's cat rule, another branch).
        use_cache=False,
    )
    return CausalLM(GPT2LMHeadModel(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


class EncoderLM(L.LightningModule):
    """torch's own layers: nn.Embedding -> nn.TransformerEncoder (causal mask) -> nn.Linear head, shifted loss."""

    def __init__(self, norm_first: bool, vocab: int = VOCAB, d: int = 32, lr: float = 3e-3) -> None:
        super().__init__()
        self.vocab, self.lr = vocab, lr
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.lm_head = nn.Linear(d, vocab)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=self.embed.weight.dtype)
        logits = self.lm_head(self.encoder(self.embed(ids), mask=mask, is_causal=True))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def _encoder(norm_first: bool) -> Callable[[], tuple[L.LightningModule, object]]:
    return lambda: (EncoderLM(norm_first), make_lm_dataset(vocab=VOCAB, seq=SEQ))


REAL_MODELS: dict[str, RealModel] = {
    "hf_llama": RealModel(_llama, 2, "net.model.layers.{}."),
    "hf_gpt2": RealModel(_gpt2, 2, "net.transformer.h.{}.", embedding="wte"),
    "torch_encoder": RealModel(_encoder(False), 2, "encoder.layers.{}.", embedding="embed"),
    "torch_encoder_prenorm": RealModel(_encoder(True), 2, "encoder.layers.{}.", embedding="embed"),
}


def build_real(name: str) -> tuple[L.LightningModule, object]:
    torch.manual_seed(0)  # the same dense init in every process and in the reference
    return REAL_MODELS[name].build()
