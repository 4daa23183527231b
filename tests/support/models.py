"""Small models and data shared by the tests (importable from worker scripts as ``tests.support.models``)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Block(nn.Module):
    """Pre-LN residual MLP block: x + fc2(dropout(gelu(fc1(ln(x)))))."""

    def __init__(self, width: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(self.act(self.fc1(self.ln(x)))))


class ResMLP(L.LightningModule):
    """Residual MLP classifier; ``head`` has 3 outputs, not divisible by mp = 2 or 4."""

    def __init__(self, d_in: int = 12, width: int = 16, hidden: int = 32, n_blocks: int = 2, n_out: int = 3,
                 lr: float = 1e-2, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width, hidden, dropout) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def make_dataset(n: int = 160, d_in: int = 12, n_out: int = 3, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, n_out, generator=g)
    y = (x @ w + 0.3 * torch.randn(n, n_out, generator=g)).argmax(-1)
    return TensorDataset(x, y)


def reference_loader(ds: TensorDataset, global_batch: int, seed: int) -> DataLoader:
    """The single-process loader drawing the permutation Lightning's DistributedSampler draws in multi-process runs."""
    return DataLoader(ds, batch_size=global_batch, sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=seed))
