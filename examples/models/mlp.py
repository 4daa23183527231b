"""A residual MLP classifier (plain PyTorch) and its LightningModule.

Under ``DPMPStrategy`` each block's ``fc1`` becomes column-parallel and ``fc2`` row-parallel; the input projection
and the classifier head stay replicated (they are small).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from examples.models.common import (
    OptimizerFactory,
    SchedulerFactory,
    build_optimizers,
    count_parameters,
)

__all__ = ["ResidualMLP", "MLPLitModule"]


class ResidualBlock(nn.Module):
    """x + fc2(dropout(gelu(fc1(ln(x)))))."""

    def __init__(self, width: int, expansion: int, dropout: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, expansion * width)
        self.fc2 = nn.Linear(expansion * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.dropout(F.gelu(self.fc1(self.ln(x)))))


class ResidualMLP(nn.Module):
    """Input projection, ``n_blocks`` residual blocks, final LayerNorm and a linear head.

    Args:
        in_features: input feature count (64 for 8x8 digits).
        num_classes: output classes.
        width: residual stream width.
        n_blocks: number of residual blocks.
        expansion: hidden width of each block = expansion * width.
        dropout: dropout inside the blocks.
    """

    def __init__(
        self,
        in_features: int = 64,
        num_classes: int = 10,
        width: int = 128,
        n_blocks: int = 2,
        expansion: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualBlock(width, expansion, dropout) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class MLPLitModule(pl.LightningModule):
    """Classification with cross-entropy; validation logs ``val/loss`` and ``val/acc`` (torchmetrics)."""

    def __init__(
        self,
        net: ResidualMLP,
        num_classes: int = 10,
        optimizer: Optional[OptimizerFactory] = None,
        scheduler: Optional[SchedulerFactory] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.val_loss = MeanMetric()
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_loss = MeanMetric()
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_loss.update(F.cross_entropy(logits, y))
        self.val_acc.update(logits, y)
        self.log("val/loss", self.val_loss, prog_bar=True, on_step=False, on_epoch=True)
        self.log("val/acc", self.val_acc, prog_bar=True, on_step=False, on_epoch=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_loss.update(F.cross_entropy(logits, y))
        self.test_acc.update(logits, y)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> Any:
        total = self.trainer.estimated_stepping_batches if self.trainer is not None else 1
        return build_optimizers(self, self.optimizer_factory, self.scheduler_factory, int(total))

    def num_local_parameters(self) -> int:
        return count_parameters(self)
