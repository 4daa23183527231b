"""Fine-tuning a pretrained Hugging Face causal LM (``examples/finetune.py``, ``experiment=finetune_hf``).

The model comes from :func:`lightning_dpmp.from_pretrained`: under DPMPStrategy each rank reads only its slices
of the safetensors files after the split; on one device it is transformers' ``from_pretrained``. At the end of
``fit`` the fine-tuned model is written back as a Hugging Face folder (``export_dir``), which
``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from torch import Tensor

import lightning_dpmp
from examples.models.common import OptimizerFactory, SchedulerFactory
from examples.models.gpt import GPTLitModule


class HFCausalLM(GPTLitModule):
    """Next-token fine-tuning of ``AutoModelForCausalLM`` loaded from ``pretrained`` (the GPT example's steps,
    loss and optimizers around a transformers model).

    Args:
        pretrained: a folder written by ``save_pretrained`` (one safetensors file or a sharded index).
        export_dir: where to write the fine-tuned model after ``fit`` (``None``: no export).
        make_tiny_if_missing: write a tiny random Llama to ``pretrained`` first if nothing is there (the example
            runs without a download); every rank may race to it: the first rename wins.
        optimizer: a partial optimizer (``_partial_: true``); called with the parameter groups.
        scheduler: an optional partial LR scheduler; called with ``optimizer`` and ``total_steps``.

    Example:
        >>> model = HFCausalLM("outputs/pretrained/tiny-llama", export_dir="finetuned")   # doctest: +SKIP
    """

    def __init__(
        self,
        pretrained: str,
        export_dir: Optional[str] = None,
        make_tiny_if_missing: bool = False,
        optimizer: Optional[OptimizerFactory] = None,
        scheduler: Optional[SchedulerFactory] = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if make_tiny_if_missing:
            write_tiny_pretrained(pretrained)
        net = lightning_dpmp.from_pretrained(AutoModelForCausalLM, pretrained)
        net.train()  # transformers returns it in eval mode; fine-tuning trains it
        super().__init__(net, optimizer, scheduler)  # type: ignore[arg-type]  # a transformers model, not a GPT
        self.save_hyperparameters("pretrained", "export_dir", logger=False)
        self.export_dir = export_dir

    def forward(self, idx: Tensor) -> Tensor:
        return self.net(input_ids=idx).logits

    def on_train_end(self) -> None:
        if not self.export_dir:
            return
        strategy = self.trainer.strategy
        if hasattr(strategy, "save_pretrained"):  # DPMPStrategy: gathered tensor by tensor, rank 0 writes
            strategy.save_pretrained(self.net, self.export_dir)
        elif self.trainer.is_global_zero:
            self.net.save_pretrained(self.export_dir)


def write_tiny_pretrained(path: str) -> None:
    """A 2-layer Llama over bytes, saved with ``save_pretrained`` (once; written aside, then renamed)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    tmp = f"{path}.tmp-{os.getpid()}"
    net.save_pretrained(tmp)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another rank wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
