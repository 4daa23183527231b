"""Fine-tuning a pretrained Hugging Face causal LM (``examples/finetune.py``, ``experiment=finetune_hf``).

The model comes from :func:`lightning_dpmp.from_pretrained`: under DPMPStrategy each rank reads only its slices
of the safetensors files after the split; on one device it is transformers' ``from_pretrained``. At the end of
``fit`` the fine-tuned model is written back as a Hugging Face folder (``export_dir``), which
``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning.pytorch as pl
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanMetric

import lightning_dpmp
from examples.models.common import OptimizerFactory, SchedulerFactory, build_optimizers


class HFCausalLM(pl.LightningModule):
    """Next-token fine-tuning of ``AutoModelForCausalLM`` loaded from ``pretrained``.

    Args:
        pretrained: a folder written by ``save_pretrained`` (one safetensors file or a sharded index).
        export_dir: where to write the fine-tuned model after ``fit`` (``None``: no export).
        optimizer: a partial optimizer (``_partial_: true``); called with the parameter groups.
        scheduler: an optional partial LR scheduler; called with ``optimizer`` and ``total_steps``.

    Example:
        >>> model = HFCausalLM("outputs/pretrained/tiny-llama", export_dir="finetuned")   # doctest: +SKIP
    """

    def __init__(
        self,
        pretrained: str,
        export_dir: Optional[str] = None,
        optimizer: Optional[OptimizerFactory] = None,
        scheduler: Optional[SchedulerFactory] = None,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.save_hyperparameters(ignore=["optimizer", "scheduler"], logger=False)
        self.net = lightning_dpmp.from_pretrained(AutoModelForCausalLM, pretrained)
        self.net.train()  # transformers returns it in eval mode; fine-tuning trains it
        self.export_dir = export_dir
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.val_loss = MeanMetric()

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self.net(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch))
        self.log("val/loss", self.val_loss, prog_bar=True, on_step=False, on_epoch=True)

    def on_train_end(self) -> None:
        if not self.export_dir:
            return
        strategy = self.trainer.strategy
        if hasattr(strategy, "save_pretrained"):  # DPMPStrategy: gathered tensor by tensor, rank 0 writes
            strategy.save_pretrained(self.net, self.export_dir)
        elif self.trainer.is_global_zero:
            self.net.save_pretrained(self.export_dir)

    def configure_optimizers(self) -> Any:
        return build_optimizers(self, self.optimizer_factory, self.scheduler_factory,
                                self.trainer.estimated_stepping_batches)


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
    except OSError:  # another process wrote it first
        pass
