"""Real architectures for the planner: models built from the ``transformers`` package's configs (tiny sizes,
random init, no downloads) and from torch's own layers, each wrapped the way users train them.

Every entry of :data:`REAL_MODELS` is ``name -> RealModel``: a builder returning ``(LightningModule, dataset)``,
the number of repeated blocks, and what each block must cost. Add a model by adding an entry; ``tests/models/test_real_models.py`` picks it up.
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
    n_blocks: int  # repeated blocks (module paths with a numeric index, e.g. model.layers.3)
    max_mp: int = 4  # the largest mp its heads allow
    attention: bool = True  # its blocks hold attention, which must come out head-parallel
    # MP all-reduces (forward, backward) a block must cost: one per sublayer each way (attention, MLP), by
    # default 2 + 2; an encoder-decoder block with cross-attention has 3.
    per_block: Callable[[str], tuple[int, int]] = lambda block: (2, 2)


def _llama() -> tuple[L.LightningModule, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )
    return CausalLM(LlamaForCausalLM(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


class MaskedLM(CausalLM):
    """A masked-LM objective computed inside the model (transformers' own ``labels=`` loss)."""

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        loss = self.net(input_ids=ids, labels=targets).loss
        self.log("train_loss", loss)
        return loss


def _bert() -> tuple[L.LightningModule, object]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return MaskedLM(BertForMaskedLM(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


class Seq2SeqLM(CausalLM):
    """Encoder-decoder denoising objective: transformers' own ``labels=`` loss (decoder inputs shifted inside)."""

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        loss = self.net(input_ids=ids, labels=targets).loss
        self.log("train_loss", loss)
        return loss


def _t5() -> tuple[L.LightningModule, object]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )
    return Seq2SeqLM(T5ForConditionalGeneration(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _t5_block(block: str) -> tuple[int, int]:
    """Encoder blocks: attention + MLP. Decoder blocks add cross-attention; the encoder output that every
    cross-attention's k/v reads enters the MP region once (one backward all-reduce, charged to block 0)."""
    if ".encoder." in f".{block}.":
        return (2, 2)
    return (3, 4) if block.endswith(".0") else (3, 3)


REAL_MODELS: dict[str, RealModel] = {
    "hf_llama": RealModel(_llama, 2),
    "hf_bert": RealModel(_bert, 2),
    "hf_t5": RealModel(_t5, 4, per_block=_t5_block),
}


def build_real(name: str) -> tuple[L.LightningModule, object]:
    torch.manual_seed(0)  # the same dense init in every process and in the reference
    return REAL_MODELS[name].build()
