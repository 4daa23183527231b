"""A tiny LightningCLI app for tests/integration/test_cli.py (a 2-layer MLP on 32 random samples).

``DPMP_CLI_RUN=0`` builds the Trainer without running a subcommand (LightningCLI(run=False)) and prints the
strategy's class and sizes: instantiation is checked without starting processes.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyModel(L.LightningModule):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TinyData(L.LightningDataModule):
    def __init__(self, n: int = 32) -> None:
        super().__init__()
        self.n = n

    def train_dataloader(self):
        x = torch.randn(self.n, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


if __name__ == "__main__":
    run = os.environ.get("DPMP_CLI_RUN", "1") != "0"
    cli = LightningCLI(TinyModel, TinyData, run=run, save_config_kwargs={"overwrite": True})
    if not run:
        s = cli.trainer.strategy
        print(f"STRATEGY {type(s).__name__} dp={s.dp} mp={s.mp} ddp_kwargs={s._ddp_kwargs}")
    elif cli.trainer.is_global_zero:
        print(f"TRAINED global_step={cli.trainer.global_step} grid={cli.trainer.strategy.dp}x{cli.trainer.strategy.mp}")
