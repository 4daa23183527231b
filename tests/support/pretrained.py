"""Tiny transformers models saved with ``save_pretrained`` (random init, no downloads), standing in for a pretrained
checkpoint, and the LightningModules that fine-tune them in the pretrained tests.

``save(name, folder)`` writes one of :data:`PRETRAINED` (seeded, so the reference and the workers read the same
files); ``+sharded`` in a case name writes it as a sharded index instead of one file.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import lightning as L
import torch
from torch import nn

from tests.support.models import make_lm_dataset
from tests.support.real_models import SEQ, VOCAB, CausalLM, LabelsLM

ODD_VOCAB = 67


def _llama(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=tied))


def _gpt2(vocab: int = VOCAB) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
        tie_word_embeddings=False, output_router_logits=False))


# name -> (builder, the model class to load it with, the LightningModule that trains it)
PRETRAINED: dict[str, tuple[Callable[[], nn.Module], str, Callable[[nn.Module], Any]]] = {
    "llama": (lambda: _llama(False), "LlamaForCausalLM", CausalLM),
    "llama_tied": (lambda: _llama(True), "LlamaForCausalLM", LabelsLM),  # transformers' own labels= loss
    "gpt2": (_gpt2, "GPT2LMHeadModel", CausalLM),  # Conv1D, fused q|k|v
    # a vocabulary no mp divides: each rank reads its rows of the file and pads them (67 -> 68 at mp=2, 68 at mp=4)
    "gpt2_vocab67": (lambda: _gpt2(ODD_VOCAB), "GPT2LMHeadModel", lambda net: CausalLM(net, vocab=ODD_VOCAB)),
    "t5": (_t5, "T5ForConditionalGeneration", LabelsLM),  # one embedding under three names
    # save_pretrained writes the hub layout (experts.<i>.w1/w2/w3) that transformers stacks into
    # experts.gate_up_proj / down_proj when it loads: a converted layout
    "mixtral": (_mixtral, "MixtralForCausalLM", CausalLM),
}

# from_pretrained keywords per model: the stacked experts' default kernel (grouped_mm) has no float64 CPU kernel
LOAD_KWARGS: dict[str, dict[str, Any]] = {"mixtral": {"experts_implementation": "eager"}}


def load_kwargs(case: str) -> dict[str, Any]:
    """What both transformers' and lightning_dpmp's ``from_pretrained`` are given for the case's model."""
    return dict(LOAD_KWARGS.get(base(case), {}))


NEW_TOKENS = 4


class GenerateLM(L.LightningModule):
    """A validation step that generates greedily (``model.generate``) from each sequence's first 8 tokens."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net, self.generated = net, []

    def validation_step(self, batch, batch_idx):
        out = self.net.generate(batch[0][:, :8], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
        self.generated.append(out[:, 8:].tolist())


# LoRA adapters (peft) on a lazily loaded model: ``+lora`` on the attention's q and v (peft's default for Llama,
# column-parallel bases), ``+lora_all`` on every Linear of the blocks (row-parallel bases too).
LORA_TARGETS = {"+lora_all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "+lora": ["q_proj", "v_proj"]}


def with_adapters(case: str, net: nn.Module) -> nn.Module:
    """``net`` with the case's LoRA adapters (seeded, so that every process draws the same ``A``), or as it is."""
    targets = next((t for k, t in LORA_TARGETS.items() if k in case), None)
    if targets is None:
        return net
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(net, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))


def base(case: str) -> str:
    """The model of a case name (``llama_tied+sharded`` -> ``llama_tied``, ``llama@generate`` -> ``llama``)."""
    return case.split("+")[0].split("@")[0]


def save(case: str, folder: str) -> str:
    """Write the case's model (seed 0) with ``save_pretrained`` into ``folder/<case>``; returns that folder."""
    path = os.path.join(folder, case)
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        net = PRETRAINED[base(case)][0]()
        net.save_pretrained(path, max_shard_size="20KB" if "+sharded" in case else "5GB")
    return path


def model_class(case: str) -> Any:
    import transformers

    return getattr(transformers, PRETRAINED[base(case)][1])


def lightning_module(case: str, net: nn.Module) -> Any:
    return PRETRAINED[base(case)][2](with_adapters(case, net))


def checkpoint_case(case: str) -> str:
    """The saved model a case fine-tunes (``llama+z3`` and ``llama+lora`` read ``llama``)."""
    return case.replace("+again", "").replace("+z3", "").replace("+lora_all", "").replace("+lora", "")


def dataset() -> Any:
    return make_lm_dataset(vocab=VOCAB, seq=SEQ)
